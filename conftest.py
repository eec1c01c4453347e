"""Loaded by pytest before any test module: on a machine without a CUDA GPU, Triton kernels run
under the Triton interpreter, which must be switched on before triton is first imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
