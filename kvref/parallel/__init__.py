"""Tensor- and sequence-parallel process groups, and the check that ranks
agree on free pages after warmup."""
