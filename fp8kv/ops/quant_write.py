"""Fused write of INT8 / INT4 rows per token and head (``int8_token_head``, ``int4_token_head``): one program
per new token quantizes its K (or V) heads and stores codes and scales into their pages, where the step's torch
path (:func:`fp8kv.kv_formats.encode_rows`, then two scattered index writes) takes several kernels per layer.

Bit for bit :func:`fp8kv.kv_formats.encode_rows`: the scale by :func:`fp8kv.quant.scale_from_stat`'s rule
(amax / the largest code, the quotient in fp64 rounded to fp32, up where it falls below fp32's normal range,
1 for an all-zero head), y = x / scale in fp32, rounded to nearest even, clamped to ±127 (INT8) or ±7 (INT4);
INT4 codes two a byte, the even element in the low nibble (:func:`fp8kv.kv_formats.packing.pack_nibbles`).
Like the torch path it counts nothing (no host sync: a CUDA graph holds it): a head scaled by its own amax
rounds to at most the largest code, so nothing saturates.
"""

import torch
import triton
import triton.language as tl

from .. import checks
from .cache_write import scale_from_amax

__all__ = ["quant_write_kernel", "write_quantized_rows", "FUSED_WRITE_FORMATS"]

FUSED_WRITE_FORMATS = {"int8_token_head": 127.0, "int4_token_head": 7.0}  # format -> largest code


@triton.jit
def quant_write_kernel(
    x_ptr,  # [N, Hkv, D] new K (or V) rows, finite (the step's contract: NaN and inf are stored otherwise than
    # the codec stores them), any float dtype, last dim contiguous
    slot_ptr,  # [N] int64 slots
    codes_ptr,  # [blocks, block_size, Hkv, D] int8, or [..., D // 2] uint8 (INT4 packed)
    scale_ptr,  # [blocks, block_size, Hkv, 1] fp32
    stride_xn, stride_xh,
    stride_cb, stride_ct, stride_ch,  # code pages: block, token-in-block, head
    stride_sb, stride_st, stride_sh,  # scales: the same
    num_kv_heads,
    num_slots,  # num_blocks x BLOCK_SIZE: a slot < 0 (padding) or past the pool is skipped, as the FP8 write skips it
    HKV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QMAX: tl.constexpr,  # the largest code: 127 or 7
    PACKED: tl.constexpr,  # INT4: two codes a byte
):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n)
    offs_h = tl.arange(0, HKV_PAD)
    offs_d = tl.arange(0, D_PAD)
    slot_v = tl.zeros([HKV_PAD], tl.int64) + slot  # as a tensor: scalar-bool masks trip the interpreter
    h_mask = (offs_h < num_kv_heads) & (slot_v >= 0) & (slot_v < num_slots)
    slot_safe = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    blk = slot_safe // BLOCK_SIZE
    off = slot_safe % BLOCK_SIZE
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(x_ptr + n * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    s = scale_from_amax(tl.max(tl.abs(x), axis=1), QMAX)
    tl.store(scale_ptr + blk * stride_sb + off * stride_st + offs_h * stride_sh, s, mask=h_mask)
    y = tl.math.div_rn(x, s[:, None])  # IEEE division, as torch's (a fast division can miss a tie by an ulp)
    # round to nearest even, exactly: for |y| <= 127, y - floor(y) is exact but in (-0.5, 0), where any rounding
    # still leaves it below 0.5 (floor(y + 0.5) is not exact: 0.49999997 + 0.5 rounds to 1 in fp32)
    r = tl.floor(y)
    frac = y - r
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
    q = tl.minimum(tl.maximum(r, -QMAX), QMAX).to(tl.int32)
    row = codes_ptr + blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch
    if PACKED:
        lo, hi = tl.split(tl.reshape(q & 0xF, [HKV_PAD, D_PAD // 2, 2]))
        offs_b = tl.arange(0, D_PAD // 2)
        tl.store(row + offs_b[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=h_mask[:, None] & (offs_b[None, :] < HEAD_DIM // 2))
    else:
        tl.store(row + offs_d[None, :], q.to(tl.int8), mask=mask)


def write_quantized_rows(cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``, ``v`` ``[N, Hkv, D]`` (finite floats, last dim contiguous) into ``cache`` (a QuantizedPagedKVCache
    of a :data:`FUSED_WRITE_FORMATS` format) at ``slot_mapping`` ``[N]`` (int32 or int64; a slot < 0 or past the pool
    is skipped), as :func:`fp8kv.step.quantized.write_rows` stores them (the same bytes), in one kernel per K and V.
    Types, shapes and devices are checked (no host sync: a CUDA graph holds it); the contents are not (the step's
    contract; :meth:`QuantizedPagedKVCache.write` checks them)."""
    from ..cache.quantized import QuantizedPagedKVCache

    if not isinstance(cache, QuantizedPagedKVCache):
        checks.fail(f"cache must be a QuantizedPagedKVCache, got {type(cache).__name__}", TypeError)
    name = cache.fmt.name
    if name not in FUSED_WRITE_FORMATS:
        checks.fail(f"cache format {name!r}: the fused write stores {tuple(FUSED_WRITE_FORMATS)}")
    hkv, d, dev = cache.num_kv_heads, cache.head_dim, cache.k_pages.device
    for arg, t in (("k", k), ("v", v)):
        checks.tensor(t, arg, dtypes=checks.FLOAT_DTYPES, ndim=3)
        if tuple(t.shape[1:]) != (hkv, d) or t.stride(-1) != 1 or t.device != dev:
            checks.fail(f"{arg} has shape {tuple(t.shape)}, strides {t.stride()} on {t.device}; expected "
                        f"[N, {hkv}, {d}] with its last dim contiguous on {dev}")
    n = k.shape[0]
    if v.shape[0] != n:
        checks.fail(f"v has {v.shape[0]} rows but k has {n}; expected one V row per K row")
    checks.tensor(slot_mapping, "slot_mapping", dtypes=(torch.int32, torch.int64), ndim=1)
    if slot_mapping.shape != (n,) or slot_mapping.device != dev:
        checks.fail(f"slot_mapping has shape {tuple(slot_mapping.shape)} on {slot_mapping.device}; expected [{n}] "
                    f"(one slot per row) on {dev}")
    if n == 0:
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    for x, pages, scales in ((k, cache.k_pages, cache.k_scales), (v, cache.v_pages, cache.v_scales)):
        quant_write_kernel[(n,)](
            x, slots, pages, scales, x.stride(0), x.stride(1), *pages.stride()[:3], *scales.stride()[:3],
            hkv, cache.num_blocks * cache.block_size, HKV_PAD=triton.next_power_of_2(hkv), HEAD_DIM=d,
            D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=cache.block_size, QMAX=FUSED_WRITE_FORMATS[name],
            PACKED=name == "int4_token_head")
