"""Fused cache write: quantize new K/V rows and scatter them into their pages (:func:`write_cache`, and its
kernel: one program per token).

The engines' ``reshape_and_cache_flash``: slot s = block * block_size + offset; slots < 0 are
padding and skipped. Quantization matches ``fp8kv.quant`` bit for bit: y = x / scale in fp32 (IEEE-rounded
division, as torch's: a GPU's fast division can miss a tie by an ulp),
clamp to ±max, round to nearest even (software encoder, so it also runs on sm80 where Triton cannot
cast to e4m3). Saturated elements (|y| at or above the first fp32 magnitude that rounds past max,
``fp8kv.formats.saturation_bounds``) are counted with one atomic add per program.
"""

import torch
import triton
import triton.language as tl

from .. import checks
from ..cache import PagedKVCache
from ..capability import UnsupportedError, interpreter_on
from ..formats import saturation_bounds
from .fp8_codec import fp32_to_fp8_bits
from .pages import SCALE_CHANNEL, SCALE_TOKEN_HEAD, format_bits, kernel_pages, page_strides, scale_kind

FP32_NORMAL_MIN: tl.constexpr = tl.constexpr(torch.finfo(torch.float32).tiny)  # below it fp32 loses bits

__all__ = ["write_cache", "cache_write_kernel", "scale_from_amax"]



@triton.jit
def scale_from_amax(amax, QMAX: tl.constexpr):
    """fp8kv.quant.scale_from_stat's rule, bit for bit: ``amax / QMAX`` with the quotient in fp64, rounded to fp32,
    but up where it falls below fp32's normal range (a row of deep subnormals keeps a scale that codes it); 1 for
    an all-zero row."""
    exact = amax.to(tl.float64) / QMAX
    s = exact.to(tl.float32)
    low = (s.to(tl.float64) < exact) & (s < FP32_NORMAL_MIN)
    s = tl.where(low, (s.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), s)
    return tl.where(amax > 0, s, 1.0)


@triton.jit
def cache_write_kernel(
    x_ptr,  # [N, Hkv, D] new K (or V) rows, any float dtype, last dim contiguous
    slot_ptr,  # [N] int64 slots; < 0 means skip (and so, defensively, does a slot past the pool)
    pages_ptr,  # pages (uint8 codes for FP8 caches), layout given by strides
    scale_ptr,  # fp32: [] or [Hkv] (per head), [Hkv, D] (channel) or [blocks, block_size, Hkv] (token_head)
    sat_ptr,  # [1] int32 saturation counter (atomic add)
    stride_xn, stride_xh,
    stride_pb, stride_pt, stride_ph,  # page strides: block, token-in-block, head
    num_kv_heads,
    num_slots,  # num_blocks x BLOCK_SIZE
    HKV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    SCALE_HEAD_STRIDE: tl.constexpr,  # per-head kind: 0 for one tensor-wide scale, 1 for one per KV head
    KV_FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FMAX: tl.constexpr,  # largest finite value of the page dtype
    OVERFLOW: tl.constexpr,  # the first fp32 magnitude that rounds past FMAX: values at or above it are counted
    BF16_BITS: tl.constexpr,  # bf16 pages passed as int16: round to nearest even in integer ops
):
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n)
    offs_h = tl.arange(0, HKV_PAD)
    offs_d = tl.arange(0, D_PAD)
    slot_v = tl.zeros([HKV_PAD], tl.int64) + slot  # as a tensor: scalar-bool masks trip the interpreter
    valid = (slot_v >= 0) & (slot_v < num_slots)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM) & valid[:, None]
    x = tl.load(x_ptr + n * stride_xn + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    slot_safe = tl.minimum(tl.maximum(slot, 0), num_slots - 1)
    blk = slot_safe // BLOCK_SIZE
    off = slot_safe % BLOCK_SIZE
    dst = pages_ptr + blk * stride_pb + off * stride_pt + offs_h[:, None] * stride_ph + offs_d[None, :]
    if KV_FP8:
        h_mask = (offs_h < num_kv_heads) & valid
        if SCALE_KIND == SCALE_TOKEN_HEAD:
            s = scale_from_amax(tl.max(tl.abs(x), axis=1), FMAX)
            tl.store(scale_ptr + (blk * BLOCK_SIZE + off) * num_kv_heads + offs_h, s, mask=h_mask)
            y = tl.math.div_rn(x, s[:, None])
        elif SCALE_KIND == SCALE_CHANNEL:
            s = tl.load(scale_ptr + offs_h[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=(offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM), other=1.0)
            y = tl.math.div_rn(x, s)
        else:
            s = tl.load(scale_ptr + offs_h * SCALE_HEAD_STRIDE, mask=offs_h < num_kv_heads, other=1.0)
            y = tl.math.div_rn(x, s[:, None])
        tl.store(dst, fp32_to_fp8_bits(y, MANT, BIAS, FMAX), mask=mask)
    else:  # 16-bit pages: saturate like the FP8 path (a bare cast turns fp16 overflow into inf)
        y = x
        clamped = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        if BF16_BITS:
            bits = clamped.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even, finite values
            tl.store(dst, bits.to(tl.int16), mask=mask)
        else:
            tl.store(dst, clamped.to(pages_ptr.dtype.element_ty), mask=mask)
    tl.atomic_add(sat_ptr, tl.sum(tl.sum(((tl.abs(y) >= OVERFLOW) & mask).to(tl.int32), axis=1), axis=0))


def write_cache(cache: PagedKVCache, k_new: torch.Tensor, v_new: torch.Tensor, slot_mapping: torch.Tensor,
                *, count_saturated: bool = True, check: bool = True) -> torch.Tensor:
    """Fused quantize + scatter of ``k_new``/``v_new`` ``[N, Hkv, D]`` into the cache's pages.

    The Triton twin of :meth:`PagedKVCache.write` (bit-identical pages and scales). ``slot_mapping``:
    ``[N]`` int32/int64 slots, < 0 skipped. Returns the saturation count as a device int32 tensor
    ``[1]`` (no host sync); with ``count_saturated`` it is also added to ``cache.saturated`` (a sync:
    a CUDA-graph capture passes ``check=False, count_saturated=False``).

    ``check`` (default) validates the contents before launching (one host sync): finite rows,
    slots inside the pool, no write into a page that two block-table entries holding tokens
    reference (see :meth:`PagedKVCache.check_write`). With ``check=False`` (a CUDA-graph capture)
    only shapes, dtypes and devices are checked; the kernel still skips slots outside the pool.
    """
    checks.flag(check, "check")
    checks.flag(count_saturated, "count_saturated")  # None skipped the count, silently
    slots = cache.check_write(k_new, v_new, slot_mapping, contents=check)
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension; call .contiguous()")
    if cache.device.type != "cuda" and not interpreter_on():
        raise UnsupportedError("the Triton kernel needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU")
    slots = slots.contiguous()
    sat = torch.zeros(1, dtype=torch.int32, device=cache.device)
    n = k_new.shape[0]
    if n == 0:
        return sat
    skb, skt, skh = page_strides(cache)
    hkv = cache.num_kv_heads
    # overflow: the first fp32 magnitude that rounds past max (e4m3's tie 464 goes to 448: not counted),
    # the rule of PagedKVCache.write; the kernel clamps in fp32 as it does, so both store ±max alike.
    fmax, overflow = saturation_bounds(cache.dtype)
    # The interpreter rounds fp32 -> bf16 wrongly: there bf16 pages are written as rounded bits.
    bf16_bits = interpreter_on() and cache.dtype == torch.bfloat16
    for x, pages, scale in ((k_new, cache.k_pages, cache.k_scale), (v_new, cache.v_pages, cache.v_scale)):
        cache_write_kernel[(n,)](
            x, slots, pages.view(torch.int16) if bf16_bits else kernel_pages(cache, pages), scale, sat,
            x.stride(0), x.stride(1), skb, skt, skh, hkv, cache.num_blocks * cache.block_size,
            HKV_PAD=triton.next_power_of_2(hkv), HEAD_DIM=cache.head_dim,
            D_PAD=triton.next_power_of_2(cache.head_dim), BLOCK_SIZE=cache.block_size, SCALE_KIND=scale_kind(cache),
            SCALE_HEAD_STRIDE=int(scale.numel() > 1), KV_FP8=cache.is_fp8, FMAX=fmax, OVERFLOW=overflow,
            BF16_BITS=bf16_bits, **format_bits(cache),
        )
    if count_saturated:
        cache.saturated += int(sat.item())
    return sat
