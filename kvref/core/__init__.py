"""The state every mechanism shares: the configuration, the concurrency
seam, per-stream bookkeeping and the stream table, the reference-counted
page pool with its prefix index, and the paged K/V tensor. Nothing here
knows what a step, an offload or a transfer is."""
