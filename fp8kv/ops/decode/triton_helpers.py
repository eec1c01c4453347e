"""The @triton.jit helpers and constexpr codes fp8kv's Triton attention kernels share (the decode's
tensor-core kernel of :mod:`.triton_kernel` and CUDA-core one of :mod:`.cuda_core_kernel`, and the
multi-token kernel of :mod:`fp8kv.ops.attend.kernel`): the query rows as the QK dot takes them, FP8 tiles to
the compute type, a split's token range, a tile's addresses through the block table, soft-capping, a sink,
fp8 mode's e4m3 range.
"""

import triton
import triton.language as tl

from ...formats import FORMATS
from ..fp8_codec import fp8_bits_to_fp16, fp8_bits_to_fp16_ptx, fp32_to_fp8_bits
from ..pages import SCALE_CHANNEL, SCALE_PER_HEAD

LN2 = tl.constexpr(0.6931471805599453)
TANH_POLY_MAX = tl.constexpr(0.125)  # soft_cap_scores: |x| below it takes tanh's polynomial, above it the exp form

E4M3_MAX = tl.constexpr(FORMATS["e4m3"].max)  # fp8 mode: q and p are e4m3
P_SCALE = tl.constexpr(FORMATS["e4m3"].max)  # fp8 mode: p ∈ [0, 1] is scaled onto e4m3's range before rounding

# CONVERT values: how dequant mode turns FP8 codes into 16-bit values
CONVERT_CAST = tl.constexpr(0)  # Triton's fp8 cast (sm89+, and the interpreter)
CONVERT_SOFTWARE = tl.constexpr(1)  # integer bit manipulation (any arch; sm80/86)
CONVERT_PTX = tl.constexpr(2)  # inline cvt.rn.f16x2.e4m3x2 / e5m2x2 (sm89+)


@triton.jit
def kv_tile_to_compute(codes, COMPUTE: tl.constexpr, KV_FP8: tl.constexpr, CONVERT: tl.constexpr,
                        MANT: tl.constexpr, BIAS: tl.constexpr):
    """A loaded K/V tile -> the dot's 16-bit type.

    FP8 tiles arrive as uint8 codes (software and PTX conversion) or, for Triton's cast, as FP8
    values: loading through an FP8 pointer lets Triton keep the tile as bytes in shared memory and
    convert after the dot-operand load.
    """
    if KV_FP8:
        if CONVERT == CONVERT_SOFTWARE:
            x = fp8_bits_to_fp16(codes, MANT, BIAS)
        elif CONVERT == CONVERT_PTX:
            x = fp8_bits_to_fp16_ptx(codes, MANT)
        else:
            x = as_fp8(codes, MANT)
        return x.to(COMPUTE)
    return codes.to(COMPUTE)


@triton.jit
def as_fp8(x, MANT: tl.constexpr):
    """A tile as Triton FP8 values: uint8 codes are reinterpreted, FP8 tiles pass through."""
    if x.dtype.is_fp8():
        y = x
    elif MANT == 3:
        y = x.to(tl.float8e4nv, bitcast=True)
    else:
        y = x.to(tl.float8e5, bitcast=True)
    return y


@triton.jit
def split_range(seq_lens_ptr, b, split, tokens_per_split, row_capacity, window, WINDOWED: tl.constexpr):
    """Tokens ``[start, end)`` of sequence ``b`` that split ``split`` reads.

    The length is clamped to the row's capacity, so a table edited after validation cannot send
    the loads outside the pool. With a window, tokens before it are never addressed."""
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), row_capacity)
    if WINDOWED:
        start = tl.maximum(seq_len - window, 0) + split * tokens_per_split
    else:
        start = split * tokens_per_split
    return start, tl.minimum(seq_len, start + tokens_per_split)


@triton.jit
def tile_addresses(bt_row, n0, end, offs_n, offs_d, num_blocks, stride_kb, stride_kt, kv_head_off,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Element offsets and mask of the K/V tile of tokens ``n0 + offs_n`` (through the block table,
    entries clamped into the pool), with the page and in-page position of each token."""
    t = n0 + offs_n
    t_mask = t < end
    page = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_blocks - 1).to(tl.int64)
    in_page = t % BLOCK_SIZE
    kv_off = (page * stride_kb + in_page * stride_kt + kv_head_off)[:, None] + offs_d[None, :]
    if D_PAD == HEAD_DIM:
        kv_mask = t_mask[:, None]
    else:
        kv_mask = t_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    return t_mask, page, in_page, kv_off, kv_mask


@triton.jit
def soft_cap_scores(s, soft_cap_log2):
    """Scores ``s = 2x / ln 2`` with ``x = score / cap`` (the host folds 2 / cap into the QKᵀ factor)
    -> ``cap * tanh(x)`` in log2 units.

    tanh(x) = 1 - 2 / (e^2x + 1) (one exp2; saturates to ±1 without overflow trouble) errs by ~u
    *absolutely*: for small |x| that is all of tanh(x) ~ x (a cap of 1e30 turned every logit into
    0). Below TANH_POLY_MAX its odd Taylor polynomial to x^7 is used instead: relative error
    <= 62/2835 x^8 < 1.4e-9 there, below fp32's u; at the seam the exp form errs by ~u / 0.125."""
    x = s * (0.5 * LN2)
    x2 = x * x
    poly = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    tanh = tl.where(tl.abs(x) < TANH_POLY_MAX, poly, 1.0 - 2.0 / (tl.math.exp2(s) + 1.0))
    return soft_cap_log2 * tanh


@triton.jit
def fold_sink(m, denom, sink):
    """One more logit with no value (an attention sink, log2 units) joins the running softmax state
    (max ``m``, denominator ``denom``): returns the new pair and the factor ``alpha`` the output is
    rescaled by. A state and sink both empty (-inf) stay empty instead of turning into NaN."""
    m_new = tl.maximum(m, sink)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_use)
    return m_new, denom * alpha + tl.math.exp2(sink - m_use), alpha


@triton.jit
def query_rows(q_ptrs, qd_mask, offs_d, k_scale_ptr, kvh, qk_scale, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               SCALE_KIND: tl.constexpr, SCALE_HEAD_STRIDE: tl.constexpr, FP8_QK: tl.constexpr,
               RESCALE_Q: tl.constexpr, COMPUTE: tl.constexpr):
    """A program's query rows ``[ROWS, D_PAD]`` as its QK dot takes them, and each row's factor on the scores
    (``qk_scale`` times what was taken out of the row, times a per-head K scale).

    Per-channel K scales are folded into the query in fp32 before any rounding (q . (s * k) = (q * s) . k).
    fp8 mode (FP8_QK): each row is quantized to e4m3 with scale amax / E4M3_MAX, exact in the fp32 scores.
    RESCALE_Q: a bf16 row (or one with channel scales folded in) may leave fp16's range or sink into its
    subnormals: its amax is brought to [2^13, 2^14) by a power of two (exact) that the factor carries back.
    Per row, not one scalar per query group: on the H200 (32/8/128, FP8, B=64 x 16k decode) per row ran 668 us,
    one scalar per group 818 us in a run of the same day (``results/bench/nvidia-h200/20261203T101714Z.csv``).
    Else the row is rounded to COMPUTE."""
    if SCALE_KIND == SCALE_CHANNEL:
        qf = tl.load(q_ptrs, mask=qd_mask, other=0.0).to(tl.float32)
        qf = qf * tl.load(k_scale_ptr + kvh * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0)[None, :]
        k_head_scale = 1.0
    else:
        qf = tl.load(q_ptrs, mask=qd_mask, other=0.0)
        if SCALE_KIND == SCALE_PER_HEAD:
            k_head_scale = tl.load(k_scale_ptr + kvh * SCALE_HEAD_STRIDE)
        else:
            k_head_scale = 1.0
    if FP8_QK:
        qf = qf.to(tl.float32)
        q_scale = tl.max(tl.abs(qf), axis=1) / E4M3_MAX
        q_scale = tl.where(q_scale > 0, q_scale, 1.0)
        q = fp32_to_fp8_bits(qf / q_scale[:, None], 3, 7, E4M3_MAX).to(tl.float8e4nv, bitcast=True)
        row_scale = q_scale * (qk_scale * k_head_scale)
    elif RESCALE_Q:
        qf = qf.to(tl.float32)
        amax = tl.max(tl.abs(qf), axis=1)
        e = tl.where(amax > 0, tl.floor(tl.log2(tl.where(amax > 0, amax, 1.0))) - 13.0, 0.0)
        e = tl.minimum(tl.maximum(e, -126.0), 126.0).to(tl.int32)
        up = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, built exactly from its bits
        q = (qf * up[:, None]).to(COMPUTE)
        row_scale = ((127 + e) << 23).to(tl.float32, bitcast=True) * (qk_scale * k_head_scale)
    else:
        q = qf.to(COMPUTE)
        row_scale = tl.full([ROWS], 1.0, tl.float32) * (qk_scale * k_head_scale)
    return q, row_scale
