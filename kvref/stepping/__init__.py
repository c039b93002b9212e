"""Admit, plan and commit: one step running and one preplanned (R23). The
step vocabulary, admission's grants and refusals, page tables and write
slots, forks, truncation, CUDA-graph staging, and the K/V reads and writes
attention layers make between plan and commit."""
