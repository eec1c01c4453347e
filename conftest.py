"""Loaded by pytest before any test module: on a machine without a CUDA GPU, Triton kernels run
under the Triton interpreter, which must be switched on before triton is first imported."""

import os

import torch

from fp8kv.capability import INTERPRETER_ENV, use_interpreter

if not torch.cuda.is_available() and INTERPRETER_ENV not in os.environ:  # a value set by hand is kept
    use_interpreter()
