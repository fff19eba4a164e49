"""Kernel tests run on CUDA when there is one, else on the CPU through Triton's interpreter.

NOTE: TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it then);
pytest loads this file before it collects the test modules.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
