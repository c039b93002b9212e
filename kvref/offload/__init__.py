"""Eviction to host memory: an offload's claim, copy, commit or abandon, a
reload, the host page pool, and the typed answers an engine's scheduler
reads (R44-R46)."""
