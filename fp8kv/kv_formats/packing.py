"""Two 4-bit codes per byte.

Layout: along the last dim (head_dim), element ``2i`` sits in the **low** nibble of byte ``i`` and
element ``2i + 1`` in the high nibble: ``byte = (c[2i + 1] << 4) | c[2i]``. This is the order of
``torch.float4_e2m1fn_x2`` and of the NVFP4 / MXFP4 tensors of cuBLAS and torchao, so packed e2m1
codes can be viewed as ``torch.float4_e2m1fn_x2`` as they are. Signed 4-bit integers are stored as
their two's complement nibble (-7 is 0x9) and sign-extended on the way back.
"""

from __future__ import annotations

import torch

__all__ = ["pack_nibbles", "unpack_nibbles", "signed_nibbles"]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., D]`` (any integer dtype, ``D`` even) to uint8 ``[..., D // 2]``: each code's low nibble,
    so a signed code -8..-1 is stored as its two's complement. The values are not checked (no host sync: the step's
    write runs it inside a CUDA graph); the codecs hand it codes in range."""
    if not isinstance(codes, torch.Tensor) or codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        what = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"codes must be an integer tensor [..., D], got {what}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes has shape {tuple(codes.shape)}; expected [..., D] with D even (two codes a byte)")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., D // 2]`` to the 4-bit codes ``[..., D]`` (uint8, values 0..15)."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.ndim == 0:
        what = f"{packed.dtype} of shape {tuple(packed.shape)}" if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(f"packed must be a uint8 tensor [..., D // 2], got {what}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def signed_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked two's complement nibbles (uint8 0..15) to their values -8..7 (int16)."""
    c = codes.to(torch.int16)
    return (c ^ 8) - 8
