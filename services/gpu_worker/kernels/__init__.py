"""Triton kernels of the CUDA path, one per file, each with its launcher and its torch reference; and what several
of them share: paging.py (page-table lookups), v_pairs.py (the FP8 V cache's key-pair layout).

Import these modules only where Triton runs: on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
"""
