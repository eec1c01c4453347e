"""Paged attention of several new tokens per sequence over FP8 (or 16-bit) KV pages: speculative-decode
verification (2-16 draft tokens) and chunked-prefill append (a chunk of the prompt), with split-KV.

The new tokens of sequence b are the last ``qo_len`` tokens of its cache row, already written; query j
sits at position ``p = seq_len - qo_len + j`` and attends keys ``0 .. p`` (``p - window < key`` with a
window). A program owns (a tile of query rows of one sequence, a KV head, a split). Its rows are the
flattened (query j, query head h of the KV head's group) pairs, ``row = j * GROUP + h``, so every row
of the group reads the same K/V tile: each byte is loaded once for all of them (spec-verify: q_len x
group rows in one tile; a long chunk: tiles of BLOCK_M rows). The programs of all sequences form one
grid axis: sequence b's tiles start at ``qo_indptr[b] * GROUP // BLOCK_M + b`` (at least as many as its
rows need, one empty tile at most), found by a binary search over ``qo_indptr``, so the grid follows
from shapes alone.

A tile reads only keys some row of it attends: ``[lowest window start, highest position]``, so the
work of a chunk is proportional to the causal triangle (and the window's band), not the square. A
per-element mask keeps each row to its own keys, in the key tiles that need one: the whole tiles up to the
tile's lowest query position (every row attends them; no window) run the decode's unmasked step, so a
spec-verify's loop is the decode's but for its last tile or two. Everything else is the decode kernel's
(:mod:`fp8kv.ops.decode.triton_kernel`): online softmax in fp32 in the exp2 domain, dequant mode (FP8 codes
converted to a 16-bit type, 16-bit dots) and fp8 mode (the query quantized per row to e4m3 with scale
amax / 448, FP8 x FP8 dots, p scaled by 448 onto e4m3's range), the same scale kinds and variants.
Several splits write fp32 partials (normalised output, log2-sum-exp) that the decode's split combine
(:func:`fp8kv.ops.decode.combine.combine_splits`: a row of the ragged batch is a sequence of the decode's)
merges, folding in the sinks. The helpers shared with the decode kernels (FP8 tiles to the compute type, a
tile's addresses, soft-capping, a sink) are theirs (:mod:`fp8kv.ops.decode.triton_helpers`).
"""

import triton
import triton.language as tl

from ..decode.triton_helpers import E4M3_MAX, LN2, P_SCALE
from ..decode.triton_helpers import as_fp8 as _as_fp8
from ..decode.triton_helpers import fold_sink as _fold_sink
from ..decode.triton_helpers import kv_tile_to_compute as _to_compute
from ..decode.triton_helpers import query_rows as _query_rows
from ..decode.triton_helpers import soft_cap_scores as _capped
from ..decode.triton_helpers import tile_addresses as _tile_addresses
from ..fp8_codec import fp32_to_e4m3
from ..pages import SCALE_CHANNEL, SCALE_PER_HEAD, SCALE_TOKEN_HEAD


@triton.jit
def _sequence_of_tile(qo_indptr_ptr, tile, batch, search_steps, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The sequence whose tiles hold grid tile ``tile``: the largest b in [0, batch) with
    ``qo_indptr[b] * GROUP // BLOCK_M + b <= tile`` (a strictly increasing start), by binary search
    (``search_steps`` >= log2(batch) halvings)."""
    lo = tile * 0
    hi = lo + batch - 1
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        first = tl.load(qo_indptr_ptr + mid).to(tl.int32) * GROUP // BLOCK_M + mid
        ok = first <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _attend_tile(q, row_scale, m_i, l_i, acc, k_pages_ptr, v_pages_ptr, k_scale_ptr, v_scale_ptr, bt_row, n0, end,
                 pos, offs_n, offs_d, num_blocks, stride_kb, stride_kt, kv_head_off, kvh, num_kv_heads, window,
                 soft_cap_log2, MASKED: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 D_PAD: tl.constexpr, SCALE_KIND: tl.constexpr, KV_FP8: tl.constexpr, CONVERT_K: tl.constexpr,
                 CONVERT_V: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, FP8_QK: tl.constexpr,
                 FP8_PV: tl.constexpr, ROUND_HW: tl.constexpr, COMPUTE: tl.constexpr, WINDOWED: tl.constexpr,
                 SOFT_CAP: tl.constexpr):
    """One key tile ``n0 + offs_n`` folded into the online softmax state ``(m_i, l_i, acc)``. MASKED: each row
    keeps only its own keys (causal, window, inside the split) and a row may have none yet; unmasked (a whole
    tile below every row's position, no window), the decode's step."""
    t = n0 + offs_n
    t_mask, page, in_page, kv_off, kv_mask = _tile_addresses(bt_row, n0, end, offs_n, offs_d, num_blocks,
                                                             stride_kb, stride_kt, kv_head_off, BLOCK_SIZE,
                                                             HEAD_DIM, D_PAD)
    k = tl.load(k_pages_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_pages_ptr + kv_off, mask=kv_mask, other=0.0)

    if FP8_QK:
        s = tl.dot(q, tl.trans(_as_fp8(k, MANT)))
    else:
        s = tl.dot(q, tl.trans(_to_compute(k, COMPUTE, KV_FP8, CONVERT_K, MANT, BIAS)))
    s = s * row_scale[:, None]
    if SCALE_KIND == SCALE_TOKEN_HEAD:
        sc_off = (page * BLOCK_SIZE + in_page) * num_kv_heads + kvh
        s = s * tl.load(k_scale_ptr + sc_off, mask=t_mask, other=0.0)[None, :]
    if SOFT_CAP:
        s = _capped(s, soft_cap_log2)
    if MASKED:
        # each row its own keys: causal (key <= p), inside the window (key > p - W), inside the split
        keep = t_mask[None, :] & (t[None, :] <= pos[:, None])
        if WINDOWED:
            keep = keep & (t[None, :] > pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        # a row may have no key yet (all masked so far): its max stays -inf, and 0 stands in for it
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if SCALE_KIND == SCALE_TOKEN_HEAD:
        # p scaled by s_v / max(s_v) keeps the 16-bit p in range; the tile's max(s_v) multiplies the dot
        vs_tok = tl.load(v_scale_ptr + sc_off, mask=t_mask, other=0.0)
        vs_max = tl.max(vs_tok, axis=0)
        vs_max = tl.where(vs_max > 0, vs_max, 1.0)
        p = p * (vs_tok / vs_max)[None, :]
    else:
        vs_max = 1.0
    if FP8_PV:
        p8 = fp32_to_e4m3(p * P_SCALE, E4M3_MAX, ROUND_HW)
        acc += tl.dot(p8, _as_fp8(v, MANT))
    else:
        acc += tl.dot(p.to(COMPUTE), _to_compute(v, COMPUTE, KV_FP8, CONVERT_V, MANT, BIAS)) * vs_max
    return m_new, l_i, acc


@triton.jit
def paged_attend_kernel(
    q_ptr,  # [total_q, Hq, D] 16-bit queries (fp8 mode quantizes each row here to e4m3)
    k_pages_ptr,  # K pages: 16-bit, or FP8 as uint8 codes or FP8 values (see _to_compute); strides below
    v_pages_ptr,  # V pages, same layout as K
    k_scale_ptr,  # fp32 K scales: [] / [Hkv] (per head), [Hkv, D] (channel), [blocks, block_size, Hkv]
    v_scale_ptr,  # fp32 V scales, same shapes as K's
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32 (the new tokens included)
    qo_indptr_ptr,  # [B + 1] int32 / int64 row offsets into q
    out_ptr,  # [total_q, Hq, D] (not SPLIT) or fp32 partials [total_q, Hq, num_splits, D]
    lse_ptr,  # [total_q, Hq] fp32 natural-log LSE, or fp32 partials [total_q, Hq, num_splits] in log2 units
    qk_scale,  # sm_scale x log2(e); with SOFT_CAP sm_scale x 2 log2(e) / cap
    tokens_per_split,  # keys each split covers (a multiple of BLOCK_N)
    num_kv_heads,  # Hkv (token_head scale indexing)
    num_blocks,  # pages in the pool: block-table entries are clamped into [0, num_blocks)
    row_capacity,  # max_blocks_per_seq x BLOCK_SIZE: seq_lens are clamped to it
    total_q,  # rows of q: row offsets are clamped to them
    batch,  # B
    search_steps,  # halvings of _sequence_of_tile's search: ceil(log2(B))
    window,  # WINDOWED: keys each query attends (>= 1), counted back from its own position
    soft_cap_log2,  # SOFT_CAP: cap x log2(e)
    sinks_ptr,  # HAS_SINKS: [Hq] fp32 sink logits (natural log)
    stride_qt, stride_qh,  # query strides (elements): token, head; the last dim is contiguous
    stride_kb, stride_kt, stride_kh,  # page strides: block, token-in-block, head (NHD or HND)
    stride_btb,  # block-table row stride
    stride_ot, stride_oh, stride_os,  # output strides: token, head, split
    stride_lt, stride_lh,  # LSE strides: token, head (split stride is 1)
    GROUP: tl.constexpr,  # query heads per KV head (Hq // Hkv)
    BLOCK_M: tl.constexpr,  # rows (query, head) per program, >= 16 (tl.dot's minimum M)
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    BLOCK_N: tl.constexpr,  # keys per tile
    SPLIT: tl.constexpr,  # False: write the final output; True: write partials for the combine
    SCALE_KIND: tl.constexpr,
    SCALE_HEAD_STRIDE: tl.constexpr,  # per-head kind: 0 for one tensor-wide scale, 1 for one per KV head
    KV_FP8: tl.constexpr,
    CONVERT_K: tl.constexpr,  # CONVERT_CAST / CONVERT_SOFTWARE / CONVERT_PTX, for the K tile
    CONVERT_V: tl.constexpr,  # the same for the V tile
    MANT: tl.constexpr,  # FP8 KV format: mantissa bits (3 = e4m3, 2 = e5m2)
    BIAS: tl.constexpr,  # FP8 KV format: exponent bias
    FP8_QK: tl.constexpr,  # FP8 query, FP8 x FP8 QK dot
    FP8_PV: tl.constexpr,  # FP8 probabilities, FP8 x FP8 P.V dot
    ROUND_HW: tl.constexpr,  # FP8_PV: probabilities rounded to e4m3 by the GPU's conversion (else bit arithmetic)
    COMPUTE: tl.constexpr,  # dot type in dequant mode (fp16 / bf16; fp32 under the interpreter)
    RESCALE_Q: tl.constexpr,  # scale each query row by a power of two before rounding it to fp16
    WINDOWED: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # folded here for one split; several fold it in the split combine
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = _sequence_of_tile(qo_indptr_ptr, tile, batch, search_steps, GROUP, BLOCK_M)
    q_begin = tl.minimum(tl.load(qo_indptr_ptr + b).to(tl.int32), total_q)
    q_end = tl.minimum(tl.load(qo_indptr_ptr + b + 1).to(tl.int32), total_q)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), row_capacity)
    n_new = tl.minimum(tl.maximum(q_end - q_begin, 0), seq_len)
    row0 = (tile - (tl.load(qo_indptr_ptr + b).to(tl.int32) * GROUP // BLOCK_M + b)) * BLOCK_M

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    rows = row0 + offs_m
    j = rows // GROUP  # the row's query (new token) ...
    heads = kvh * GROUP + rows % GROUP  # ... and its query head
    row_ok = rows < n_new * GROUP
    first_pos = seq_len - n_new  # position of the sequence's first new token
    pos = tl.where(row_ok, first_pos + j, -1)  # a row past the sequence's attends nothing
    qrow = (q_begin + tl.where(row_ok, j, 0)).to(tl.int64)

    # the keys some row of this tile attends: [kv_lo, kv_hi)
    kv_hi = tl.max(pos, axis=0) + 1
    if WINDOWED:
        kv_lo = tl.maximum(first_pos + row0 // GROUP - window + 1, 0)
    else:
        kv_lo = 0
    start = kv_lo + split * tokens_per_split
    # the last split takes every key left: sequences grown past the planned longest stay covered
    end = tl.where(split == tl.num_programs(2) - 1, kv_hi, tl.minimum(kv_hi, start + tokens_per_split))

    q_ptrs = q_ptr + qrow[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    qd_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q, row_scale = _query_rows(q_ptrs, qd_mask, offs_d, k_scale_ptr, kvh, qk_scale, BLOCK_M, HEAD_DIM, SCALE_KIND,
                               SCALE_HEAD_STRIDE, FP8_QK, RESCALE_Q, COMPUTE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_table_ptr + b * stride_btb
    kv_head_off = kvh * stride_kh

    # Keys up to the tile's lowest position are attended by every row (no window): their whole tiles take the
    # unmasked step, the rest (the causal diagonal, a split's last partial tile, a window's band) the masked one.
    if WINDOWED:
        body_end = start
    else:
        tile_first = first_pos + row0 // GROUP
        body_end = start + tl.maximum(tl.minimum(end, tile_first + 1) - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, body_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, row_scale, m_i, l_i, acc, k_pages_ptr, v_pages_ptr, k_scale_ptr,
                                     v_scale_ptr, bt_row, n0, end, pos, offs_n, offs_d, num_blocks, stride_kb,
                                     stride_kt, kv_head_off, kvh, num_kv_heads, window, soft_cap_log2, False,
                                     BLOCK_SIZE, HEAD_DIM, D_PAD, SCALE_KIND, KV_FP8, CONVERT_K, CONVERT_V, MANT,
                                     BIAS, FP8_QK, FP8_PV, ROUND_HW, COMPUTE, WINDOWED, SOFT_CAP)
    for n0 in range(body_end, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, row_scale, m_i, l_i, acc, k_pages_ptr, v_pages_ptr, k_scale_ptr,
                                     v_scale_ptr, bt_row, n0, end, pos, offs_n, offs_d, num_blocks, stride_kb,
                                     stride_kt, kv_head_off, kvh, num_kv_heads, window, soft_cap_log2, True,
                                     BLOCK_SIZE, HEAD_DIM, D_PAD, SCALE_KIND, KV_FP8, CONVERT_K, CONVERT_V, MANT,
                                     BIAS, FP8_QK, FP8_PV, ROUND_HW, COMPUTE, WINDOWED, SOFT_CAP)

    if HAS_SINKS and not SPLIT:
        # one more logit with no value: it rescales the running state as a tile would
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=float("-inf")) * (1.0 / LN2)
        m_i, l_i, alpha = _fold_sink(m_i, l_i, sink)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if FP8_PV:
        out = out * (1.0 / P_SCALE)
    if SCALE_KIND == SCALE_PER_HEAD:
        out = out * tl.load(v_scale_ptr + kvh * SCALE_HEAD_STRIDE)
    elif SCALE_KIND == SCALE_CHANNEL:
        out = out * tl.load(v_scale_ptr + kvh * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM, other=0.0)[None, :]
    lse2 = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))

    o_ptrs = out_ptr + qrow[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    l_ptrs = lse_ptr + qrow * stride_lt + heads * stride_lh
    if SPLIT:
        tl.store(o_ptrs + split * stride_os, out, mask=qd_mask)
        tl.store(l_ptrs + split, lse2, mask=row_ok)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=qd_mask)
        tl.store(l_ptrs, lse2 * LN2, mask=row_ok)

