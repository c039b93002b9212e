"""KV transfer between managers: a publish and its lease, a retrieve, and
the transfer engines that move pages in one process, over shared memory or
over CUDA IPC (R33-R37)."""
