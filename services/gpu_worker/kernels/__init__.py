"""Triton kernels of the CUDA path, one per file, each with its launcher and its torch reference.

Import these modules only where Triton runs: on CUDA, or on the CPU under TRITON_INTERPRET=1 (tests).
"""
