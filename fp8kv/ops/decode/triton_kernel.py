"""Paged decode attention over FP8 (or 16-bit) KV pages: split-KV with a reduction step.

One program handles one (sequence, KV head, split): the GROUP query heads that share the KV head
are processed together, so each K/V byte is loaded once. Large groups (MQA with 71 query heads)
are cut into HEAD_TILES programs of at most ceil(GROUP / HEAD_TILES) heads each, which read the same
K/V (the second read mostly from L2): one program holding every head would pad the dot's rows to
128 and keep a 128-row score tile in registers. It streams the split's tokens in tiles of
BLOCK_N through the block table (a tile may span several pages: tile size and page size are
independent), keeps an online softmax in fp32 (exp2 domain), and writes either the final output
(one split) or a normalised partial output plus its log2-sum-exp for ``combine_splits_kernel`` (:mod:`.combine`).

Modes (see :mod:`.triton_launcher` for the host side):

* dequant: FP8 codes are turned into a 16-bit type in registers, 16-bit ``tl.dot``. CONVERT_K and
  CONVERT_V pick how, per operand: integer ops (any arch; sm80/86, where Triton has no e4m3),
  Triton's cast, or inline PTX ``cvt.rn.f16x2.e4m3x2`` (sm89+).
* fp8 (FP8_QK and FP8_PV): the query is quantized here to e4m3 with a per-(sequence, head) scale
  amax/448 (carried exactly into the fp32 scores); QKᵀ is an FP8 x FP8 dot. Probabilities
  p ∈ [0, 1] are multiplied by P_SCALE (= 448, the e4m3 max), rounded to e4m3 and multiplied with
  the FP8 V tile; the epilogue divides P_SCALE back out. FP8_QK alone keeps P·V in 16 bits.

Attention variants (constexpr switches; off, the kernel compiles to the plain code):

* WINDOWED: the query attends the last ``window`` tokens. The splits tile ``[max(0, L - window), L)``
  only (the host sizes them over the window), so pages before the window are never addressed.
* SOFT_CAP: scores become ``cap * tanh(score / cap)`` in natural units; the host folds ``2 / cap``
  into the QKᵀ factor and tanh comes from one exp2: ``1 - 2 / (e^(2x) + 1)``, or for |x| < 1/8
  (where that form cancels) from its odd Taylor polynomial (see ``soft_cap_scores``).
* HAS_SINKS: one fp32 logit per query head joins the softmax denominator, folded once: in the
  epilogue for one split, in ``combine_splits_kernel`` for several. The LSE includes it.

Scales (stored = Q(x / scale)): a per-KV-head K scale multiplies the scores, a per-KV-head V scale
the output; per-channel K scales are folded into the query (in fp32, before it is rounded) and
per-channel V scales multiply the output; per-token-head scales multiply score columns (K) and
probabilities (V) inside the loop.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ..fp8_codec import fp32_to_e4m3
from ..pages import SCALE_CHANNEL, SCALE_PER_HEAD, SCALE_TOKEN_HEAD

# the kernel's body calls the shared helpers by these names
from .triton_helpers import E4M3_MAX, LN2, P_SCALE
from .triton_helpers import as_fp8 as _as_fp8
from .triton_helpers import fold_sink as _fold_sink
from .triton_helpers import kv_tile_to_compute as _kv_tile_to_compute
from .triton_helpers import query_rows as _query_rows
from .triton_helpers import soft_cap_scores as _soft_cap
from .triton_helpers import split_range as _split_range
from .triton_helpers import tile_addresses as _tile_addresses


@triton.jit
def paged_decode_kernel(
    q_ptr,  # [B, Hq, D] 16-bit query (fp8 mode quantizes it here, per head, to e4m3)
    k_pages_ptr,  # K pages: 16-bit, or FP8 as uint8 codes or FP8 values (see _kv_tile_to_compute); strides
    v_pages_ptr,  # V pages, same layout as K
    k_scale_ptr,  # fp32 K scales: [] / [Hkv] (per head), [Hkv, D] (channel), [blocks, block_size, Hkv]
    v_scale_ptr,  # fp32 V scales, same shapes as K's
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] (not SPLIT) or fp32 partials [B, Hq, num_splits, D]
    lse_ptr,  # [B, Hq] fp32 natural-log LSE, or fp32 partials [B, Hq, num_splits] in log2 units
    qk_scale,  # sm_scale x log2(e): scores live in the exp2 domain; with SOFT_CAP sm_scale x 2 log2(e) / cap
    tokens_per_split,  # tokens each split covers (a multiple of BLOCK_N)
    num_kv_heads,  # Hkv (for token_head scale indexing)
    num_blocks,  # pages in the pool: block-table entries are clamped into [0, num_blocks)
    row_capacity,  # max_blocks_per_seq x BLOCK_SIZE: seq_lens are clamped to it
    window,  # WINDOWED: tokens the query attends (>= 1), counted back from the last one
    soft_cap_log2,  # SOFT_CAP: cap x log2(e)
    sinks_ptr,  # HAS_SINKS: [Hq] fp32 sink logits (natural log)
    stride_qb, stride_qh,  # query strides (elements); the last dim is contiguous
    stride_kb, stride_kt, stride_kh,  # page strides: block, token-in-block, head (NHD or HND)
    stride_btb,  # block-table row stride
    stride_ob, stride_oh, stride_os,  # output strides: batch, head, split
    stride_lb, stride_lh,  # LSE strides: batch, head (split stride is 1)
    GROUP: tl.constexpr,  # query heads per KV head (Hq // Hkv)
    GROUP_PAD: tl.constexpr,  # the program's heads (ceil(GROUP / HEAD_TILES)) padded to >= 16 (tl.dot's minimum M)
    HEAD_TILES: tl.constexpr,  # programs per KV head, each taking ceil(GROUP / HEAD_TILES) of its query heads
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    BLOCK_N: tl.constexpr,  # tokens per tile
    SPLIT: tl.constexpr,  # False: write the final output; True: write partials for the combine step
    SCALE_KIND: tl.constexpr,
    SCALE_HEAD_STRIDE: tl.constexpr,  # per-head kind: 0 for one tensor-wide scale, 1 for one per KV head
    KV_FP8: tl.constexpr,
    CONVERT_K: tl.constexpr,  # CONVERT_CAST / CONVERT_SOFTWARE / CONVERT_PTX, for the K tile
    CONVERT_V: tl.constexpr,  # the same for the V tile
    MANT: tl.constexpr,  # FP8 KV format: mantissa bits (3 = e4m3, 2 = e5m2)
    BIAS: tl.constexpr,  # FP8 KV format: exponent bias
    FP8_QK: tl.constexpr,  # FP8 query, FP8 x FP8 QKᵀ
    FP8_PV: tl.constexpr,  # FP8 probabilities, FP8 x FP8 P·V
    ROUND_HW: tl.constexpr,  # FP8_PV: probabilities rounded to e4m3 by the GPU's conversion (else bit arithmetic)
    KV_EVICTION: tl.constexpr,  # eviction policy of the K/V tile loads ("" or "evict_first")
    COMPUTE: tl.constexpr,  # dot type in dequant mode (fp16 / bf16; fp32 under the interpreter)
    RESCALE_Q: tl.constexpr,  # scale each query head by a power of two before rounding it to fp16
    WINDOWED: tl.constexpr,  # attend only the last `window` tokens: the splits tile the window alone
    SOFT_CAP: tl.constexpr,  # scores -> cap * tanh(score / cap), in natural units
    HAS_SINKS: tl.constexpr,  # one sink logit per query head joins the denominator (here for one
    # split; several splits fold it in combine_splits_kernel)
    PDL: tl.constexpr = False,  # sm90+: let the split combine launch now (it waits for this grid's partials)
):
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    if HEAD_TILES == 1:
        kvh = tl.program_id(1)
        g_mask = offs_g < GROUP
        heads = kvh * GROUP + offs_g
    else:
        kvh = tl.program_id(1) // HEAD_TILES
        g = (tl.program_id(1) % HEAD_TILES) * ((GROUP + HEAD_TILES - 1) // HEAD_TILES) + offs_g
        g_mask = (offs_g < (GROUP + HEAD_TILES - 1) // HEAD_TILES) & (g < GROUP)
        heads = kvh * GROUP + g

    start, end = _split_range(seq_lens_ptr, b, split, tokens_per_split, row_capacity, window, WINDOWED)

    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    qd_mask = g_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q, row_scale = _query_rows(q_ptrs, qd_mask, offs_d, k_scale_ptr, kvh, qk_scale, GROUP_PAD, HEAD_DIM, SCALE_KIND,
                               SCALE_HEAD_STRIDE, FP8_QK, RESCALE_Q, COMPUTE)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = block_table_ptr + b * stride_btb
    kv_head_off = kvh * stride_kh

    for n0 in range(start, end, BLOCK_N):
        t_mask, page, in_page, kv_off, kv_mask = _tile_addresses(bt_row, n0, end, offs_n, offs_d, num_blocks, stride_kb,
                                                                  stride_kt, kv_head_off, BLOCK_SIZE, HEAD_DIM, D_PAD)
        k = tl.load(k_pages_ptr + kv_off, mask=kv_mask, other=0.0, eviction_policy=KV_EVICTION)
        v = tl.load(v_pages_ptr + kv_off, mask=kv_mask, other=0.0, eviction_policy=KV_EVICTION)

        if FP8_QK:
            s = tl.dot(q, tl.trans(_as_fp8(k, MANT)))
        else:
            s = tl.dot(q, tl.trans(_kv_tile_to_compute(k, COMPUTE, KV_FP8, CONVERT_K, MANT, BIAS)))
        s = s * row_scale[:, None]
        if SCALE_KIND == SCALE_TOKEN_HEAD:
            sc_off = (page * BLOCK_SIZE + in_page) * num_kv_heads + kvh
            s = s * tl.load(k_scale_ptr + sc_off, mask=t_mask, other=0.0)[None, :]
        if SOFT_CAP:
            s = _soft_cap(s, soft_cap_log2)
        s = tl.where(t_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        m_i = m_new
        if SCALE_KIND == SCALE_TOKEN_HEAD:
            # Scale p by s_v / max(s_v) so the 16-bit p stays in range (e5m2 scales are ~1e-4 and
            # would land in fp16 subnormals), and apply the tile's max(s_v) to the dot's fp32 result.
            vs_tok = tl.load(v_scale_ptr + sc_off, mask=t_mask, other=0.0)
            vs_max = tl.max(vs_tok, axis=0)
            p = p * (vs_tok / vs_max)[None, :]
        else:
            vs_max = 1.0

        if FP8_PV:
            p8 = fp32_to_e4m3(p * P_SCALE, E4M3_MAX, ROUND_HW)
            acc += tl.dot(p8, _as_fp8(v, MANT))
        else:
            vc = _kv_tile_to_compute(v, COMPUTE, KV_FP8, CONVERT_V, MANT, BIAS)
            acc += tl.dot(p.to(COMPUTE), vc) * vs_max

    if HAS_SINKS and not SPLIT:
        # The sink is one more logit with no value: it rescales the running state like a tile would.
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=float("-inf")) * (1.0 / LN2)
        m_i, l_i, alpha = _fold_sink(m_i, l_i, sink)
        acc = acc * alpha[:, None]
    # Epilogue: normalise, apply the V scale (and undo P_SCALE in fp8 mode).
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if FP8_PV:
        out = out * (1.0 / P_SCALE)
    if SCALE_KIND == SCALE_PER_HEAD:
        out = out * tl.load(v_scale_ptr + kvh * SCALE_HEAD_STRIDE)
    elif SCALE_KIND == SCALE_CHANNEL:
        vs = tl.load(v_scale_ptr + kvh * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0)
        out = out * vs[None, :]
    lse2 = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))

    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh, lse2 * LN2, mask=g_mask)
    else:
        tl.store(o_ptrs + split * stride_os, out, mask=qd_mask)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse2, mask=g_mask)
