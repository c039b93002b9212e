"""Paged attention over kvref's page tables: the torch reference, one
batched SDPA gather, and FlashInfer's wrappers on CUDA."""
