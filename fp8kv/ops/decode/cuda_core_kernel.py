"""Paged decode attention on CUDA cores (no ``tl.dot``), for small query groups (MHA, group 2).

The tensor-core kernel (:mod:`.triton_kernel`) pads the query group to tl.dot's 16 rows: at group 1
(MHA) fifteen of them are waste, and every FP8 tile makes an extra shared-memory round trip to reach
the dot's operand layout. Here one program handles one *query* head (a group of 2 reads each K/V
tile twice, the second time from L2), and the dots are FMAs in fp32 registers: a score is a
reduction over D inside a warp, the P·V update an elementwise FMA, so a K/V tile goes from global
memory to registers once and never through shared memory.

To keep cross-warp traffic out of the loop, every token slot ``n`` of the BLOCK_N-token tile runs
its own online softmax (running max ``m[n]``, sum ``l[n]``, output row ``acc[n, :]``) across the
tiles, as FlashInfer's CUDA-core decode gives each thread group its own state; the slots are merged
once, after the loop. Same arguments and outputs as ``paged_decode_kernel`` (the split combine, :mod:`.combine`, is
shared), grid ``(B, Hq, splits)``; dequant mode only.
"""

import triton
import triton.language as tl

from ..pages import SCALE_CHANNEL, SCALE_PER_HEAD, SCALE_TOKEN_HEAD

# the kernel's body calls the shared helpers by these names
from .triton_helpers import LN2
from .triton_helpers import fold_sink as _fold_sink
from .triton_helpers import kv_tile_to_compute as _kv_tile_to_compute
from .triton_helpers import soft_cap_scores as _soft_cap
from .triton_helpers import split_range as _split_range
from .triton_helpers import tile_addresses as _tile_addresses


@triton.jit
def _tile_to_fp32(x, KV_FP8: tl.constexpr, CONVERT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    """FP8 codes through fp16 (exact; the sm89+ conversion instructions produce fp16), 16-bit pages directly."""
    if KV_FP8:
        return _kv_tile_to_compute(x, tl.float16, KV_FP8, CONVERT, MANT, BIAS).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def paged_decode_cuda_core_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    qk_scale, tokens_per_split, num_kv_heads, num_blocks, row_capacity, window, soft_cap_log2, sinks_ptr,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALE_KIND: tl.constexpr,
    SCALE_HEAD_STRIDE: tl.constexpr,
    KV_FP8: tl.constexpr,
    CONVERT_K: tl.constexpr,
    CONVERT_V: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    KV_EVICTION: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Arguments as ``paged_decode_kernel`` (see there); the query, K and V are multiplied in fp32."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = h // GROUP

    start, end = _split_range(seq_lens_ptr, b, split, tokens_per_split, row_capacity, window, WINDOWED)

    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if SCALE_KIND == SCALE_CHANNEL:
        q = q * tl.load(k_scale_ptr + kvh * HEAD_DIM + offs_d, mask=d_mask, other=0.0) * qk_scale
    elif SCALE_KIND == SCALE_PER_HEAD:
        q = q * (qk_scale * tl.load(k_scale_ptr + kvh * SCALE_HEAD_STRIDE))
    else:
        q = q * qk_scale

    # Per token slot online-softmax state: no reduction across slots (or warps) inside the loop.
    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    bt_row = block_table_ptr + b * stride_btb
    kv_head_off = kvh * stride_kh

    for n0 in range(start, end, BLOCK_N):
        t_mask, page, in_page, kv_off, kv_mask = _tile_addresses(bt_row, n0, end, offs_n, offs_d, num_blocks, stride_kb,
                                                                  stride_kt, kv_head_off, BLOCK_SIZE, HEAD_DIM, D_PAD)
        k = tl.load(k_pages_ptr + kv_off, mask=kv_mask, other=0.0, eviction_policy=KV_EVICTION)
        v = tl.load(v_pages_ptr + kv_off, mask=kv_mask, other=0.0, eviction_policy=KV_EVICTION)
        s = tl.sum(_tile_to_fp32(k, KV_FP8, CONVERT_K, MANT, BIAS) * q[None, :], axis=1)  # [N], exp2 domain
        if SCALE_KIND == SCALE_TOKEN_HEAD:
            sc_off = (page * BLOCK_SIZE + in_page) * num_kv_heads + kvh
            s = s * tl.load(k_scale_ptr + sc_off, mask=t_mask, other=0.0)
        if SOFT_CAP:
            s = _soft_cap(s, soft_cap_log2)
        s = tl.where(t_mask, s, float("-inf"))

        m_new = tl.maximum(m_i, s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slot with no token yet stays empty
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use)
        l_i = l_i * alpha + p
        m_i = m_new
        if SCALE_KIND == SCALE_TOKEN_HEAD:
            p = p * tl.load(v_scale_ptr + sc_off, mask=t_mask, other=0.0)
        acc = acc * alpha[:, None] + p[:, None] * _tile_to_fp32(v, KV_FP8, CONVERT_V, MANT, BIAS)

    # Merge the token slots: one flash-decoding reduction over BLOCK_N partial states.
    m_row = tl.max(m_i, axis=0)
    m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    w = tl.math.exp2(m_i - m_safe)
    l_row = tl.sum(l_i * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0)  # [D]
    if HAS_SINKS and not SPLIT:
        m_row, l_row, alpha = _fold_sink(m_row, l_row, tl.load(sinks_ptr + h) * (1.0 / LN2))
        o = o * alpha
        m_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    l_safe = tl.where(l_row > 0, l_row, 1.0)
    out = o / l_safe
    if SCALE_KIND == SCALE_PER_HEAD:
        out = out * tl.load(v_scale_ptr + kvh * SCALE_HEAD_STRIDE)
    elif SCALE_KIND == SCALE_CHANNEL:
        out = out * tl.load(v_scale_ptr + kvh * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
    lse2 = tl.where(l_row > 0, m_safe + tl.math.log2(l_safe), float("-inf"))

    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d
    if not SPLIT:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)
        tl.store(lse_ptr + b * stride_lb + h * stride_lh, lse2 * LN2)
    else:
        tl.store(o_ptrs + split * stride_os, out, mask=d_mask)
        tl.store(lse_ptr + b * stride_lb + h * stride_lh + split, lse2)
