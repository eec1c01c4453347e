"""Paged decode attention over the pages of a :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache`: INT8 and
INT4 codes with an fp32 scale per token and head, NVFP4 (e2m1 codes, an e4m3 scale per 16 channels, an fp32
tensor scale) and MXFP4 (e2m1 codes, a power-of-two e8m0 scale per 32 channels).

One program handles one (sequence, KV head, split), as the FP8 kernel of :mod:`fp8kv.ops.decode.triton_kernel`
does: the GROUP query heads of the KV head together (rows padded to 16 for ``tl.dot``), the split's tokens in
tiles of BLOCK_N through the block table, an online softmax in fp32 in the exp2 domain, and either the final
output (one split) or normalised partials and their log2-sum-exp for :mod:`fp8kv.ops.decode.combine`.

Codes are dequantized in registers, never in memory:

* INT8 / INT4 (one scale per token and head): the dots take the integer codes as they are (-127..127 and
  -7..7 are exact in fp16); K's scale multiplies the score columns, V's the probabilities (divided by the
  tile's largest V scale, which multiplies the dot's fp32 result: p stays in fp16's range), as the FP8
  token_head path does.
* NVFP4: code x block scale is exact in fp16 (a 2-bit by a 4-bit significand, magnitudes in [2^-10, 2688]), so
  the tiles are dequantized to it; the tensor scales (fp32) multiply the scores (K) and the output (V).
* MXFP4: each token's largest block scale is factored out and handled as INT8's per-token scale; the tiles
  hold code x the block's power of two relative to it (exact in fp16 within 2^23 of it, see
  :func:`.codes.mxfp4_tiles`).

How the code tiles become fp16 (CONVERT: integer conversions, bits placed into fp16's fields, or the same in
inline PTX on four codes at a time) is :mod:`.codes`; every way gives the same values (NVFP4's software and
ptx tiles scaled by 2^-7 exactly, undone in fp32 by NV_UNIT).

The 4-bit codes are never interleaved: byte ``j`` holds channels ``2j`` (low nibble) and ``2j + 1`` (high
nibble), so the query is loaded as its even and odd channels and q·k is two dots over D / 2 (``lo`` and
``hi``); P·V gives the even and odd output channels, stored to their places in the epilogue. A tile of
codes is then one contiguous run of D / 2 bytes per token, loaded as it lies.

The query is rounded to fp16 for the dots; a query of another dtype is first brought, per head, to an amax
in [2^13, 2^14) by a power of two (exact, and multiplied back into the scores), so it keeps fp16's precision
whatever its range.
"""

import triton
import triton.language as tl

from ..decode.triton_helpers import LN2, split_range, tile_addresses
from .codes import CONVERT_CAST, NVFP4_UNIT, int4_tiles, int8_tile, mxfp4_tiles, nvfp4_tiles

# FORMAT values (constexpr): the page formats the kernel reads
FORMAT_INT8 = tl.constexpr(0)
FORMAT_INT4 = tl.constexpr(1)
FORMAT_NVFP4 = tl.constexpr(2)
FORMAT_MXFP4 = tl.constexpr(3)
NVFP4_BLOCK = tl.constexpr(16)  # channels an NVFP4 scale covers: 8 bytes of codes
MXFP4_BLOCK = tl.constexpr(32)  # channels an MXFP4 scale covers: 16 bytes of codes


@triton.jit
def quant_decode_kernel(
    q_ptr,  # [B, Hq, D] query (fp16, or fp32 for RESCALE_Q)
    k_codes_ptr, v_codes_ptr,  # [num_blocks, block_size, Hkv, C] codes: int8 (C = D), uint8 packed (C = D / 2)
    k_scales_ptr, v_scales_ptr,  # [num_blocks, block_size, Hkv, groups]: fp32 (int), e4m3 / e8m0 bits (FP4)
    k_tensor_scale_ptr, v_tensor_scale_ptr,  # NVFP4: fp32 [] tensor scales (else any pointer, unread)
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] (not SPLIT) or fp32 partials [B, Hq, num_splits, D]
    lse_ptr,  # [B, Hq] fp32 natural-log LSE, or fp32 partials [B, Hq, num_splits] in log2 units
    qk_scale,  # sm_scale x log2(e)
    tokens_per_split,  # tokens each split covers (a multiple of BLOCK_N)
    num_blocks,  # pages in the pool: block-table entries are clamped into [0, num_blocks)
    row_capacity,  # max_blocks_per_seq x BLOCK_SIZE: seq_lens are clamped to it
    stride_qb, stride_qh,  # query strides (elements); the last dim is contiguous
    stride_cb, stride_ct, stride_ch,  # code strides: block, token, head (the last dim is contiguous)
    stride_sb, stride_st, stride_sh,  # scale strides: block, token, head
    stride_btb,  # block-table row stride
    stride_ob, stride_oh, stride_os,  # output strides: batch, head, split
    stride_lb, stride_lh,  # LSE strides: batch, head (split stride is 1)
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum M)
    HEAD_DIM: tl.constexpr,
    C: tl.constexpr,  # code bytes per token and head: HEAD_DIM, or HEAD_DIM // 2 packed
    C_PAD: tl.constexpr,  # C padded to a power of two >= 16 (tl.dot's minimum K)
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    BLOCK_N: tl.constexpr,  # tokens per tile
    SPLIT: tl.constexpr,  # False: write the final output; True: partials for the combine
    FORMAT: tl.constexpr,  # FORMAT_INT8 / FORMAT_INT4 / FORMAT_NVFP4 / FORMAT_MXFP4
    RESCALE_Q: tl.constexpr,  # bring each head to fp16's range by a power of two before rounding it
    CONVERT: tl.constexpr,  # how code tiles become fp16 (.codes): CONVERT_CAST / CONVERT_SOFTWARE / CONVERT_PTX
):
    PACKED: tl.constexpr = FORMAT != FORMAT_INT8
    TOKEN_SCALE: tl.constexpr = FORMAT != FORMAT_NVFP4  # a factor per token: stored (INT), or MXFP4's largest
    BLOCK_BYTES: tl.constexpr = (NVFP4_BLOCK if FORMAT == FORMAT_NVFP4 else MXFP4_BLOCK) // 2  # code bytes a scale covers
    NB: tl.constexpr = C // BLOCK_BYTES  # FP4: block scales per token and head
    NB_ALIGN: tl.constexpr = NB & (~NB + 1)  # the largest power of two dividing NB
    # NVFP4 tiles other than cast's hold code x block scale / 128: the fp32 score and output factors undo it
    NV_UNIT: tl.constexpr = NVFP4_UNIT if FORMAT == FORMAT_NVFP4 and CONVERT != CONVERT_CAST else 1.0
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    start, end = split_range(seq_lens_ptr, b, split, tokens_per_split, row_capacity, 0, False)

    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, C_PAD)
    c_mask = offs_c < C
    qc_mask = g_mask[:, None] & c_mask[None, :]
    # Query channels as the code bytes hold them: channel j (int8), or the even / odd channels 2j, 2j + 1.
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    if PACKED:
        q_cols = 2 * offs_c[None, :]
        qa = tl.load(q_row + q_cols, mask=qc_mask, other=0.0).to(tl.float32)
        qb = tl.load(q_row + q_cols + 1, mask=qc_mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qa), axis=1), tl.max(tl.abs(qb), axis=1))
    else:
        qa = tl.load(q_row + offs_c[None, :], mask=qc_mask, other=0.0).to(tl.float32)
        qb = qa
        amax = tl.max(tl.abs(qa), axis=1)
    row_scale = tl.full([GROUP_PAD], 1.0, tl.float32) * qk_scale
    if RESCALE_Q:
        e = tl.where(amax > 0, tl.floor(tl.log2(tl.where(amax > 0, amax, 1.0))) - 13.0, 0.0)
        e = tl.minimum(tl.maximum(e, -126.0), 126.0).to(tl.int32)
        up = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, built exactly from its bits
        qa = qa * up[:, None]
        qb = qb * up[:, None]
        row_scale = row_scale * ((127 + e) << 23).to(tl.float32, bitcast=True)
    qa = qa.to(tl.float16)
    qb = qb.to(tl.float16)
    if FORMAT == FORMAT_NVFP4:
        row_scale = row_scale * (tl.load(k_tensor_scale_ptr) * NV_UNIT)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc_a = tl.zeros([GROUP_PAD, C_PAD], tl.float32)  # output channels j (int8), or 2j (packed)
    acc_b = tl.zeros([GROUP_PAD, C_PAD], tl.float32)  # packed: output channels 2j + 1
    bt_row = block_table_ptr + b * stride_btb

    for n0 in range(start, end, BLOCK_N):
        t_mask, page, in_page, c_off, c_ld = tile_addresses(bt_row, n0, end, offs_n, offs_c, num_blocks, stride_cb,
                                                            stride_ct, kvh * stride_ch, BLOCK_SIZE, C, C_PAD)
        kc = tl.load(k_codes_ptr + c_off, mask=c_ld, other=0)
        vc = tl.load(v_codes_ptr + c_off, mask=c_ld, other=0)
        s_row = page * stride_sb + in_page * stride_st + kvh * stride_sh  # [BLOCK_N]: the tokens' first scale
        if FORMAT == FORMAT_NVFP4 or FORMAT == FORMAT_MXFP4:
            # The scales are contiguous (the launch in .launcher checks it), so each token's NB block scales start
            # at a multiple of NB: said, they load as one vector a token, not a byte at a time.
            s_row = tl.multiple_of(s_row, NB_ALIGN)

        if FORMAT == FORMAT_INT8:
            s = tl.dot(qa, tl.trans(int8_tile(kc, CONVERT)))
        else:
            if FORMAT == FORMAT_INT4:
                k_lo, k_hi = int4_tiles(kc, CONVERT)
            elif FORMAT == FORMAT_NVFP4:
                k_lo, k_hi = nvfp4_tiles(kc, k_scales_ptr, s_row, t_mask, c_ld, CONVERT, BLOCK_N, C_PAD, NB,
                                         BLOCK_BYTES)
            else:
                k_lo, k_hi, k_tok = mxfp4_tiles(kc, k_scales_ptr, s_row, t_mask, c_ld, CONVERT, BLOCK_N, C_PAD, NB,
                                                BLOCK_BYTES)
            s = tl.dot(qa, tl.trans(k_lo))
            s = tl.dot(qb, tl.trans(k_hi), s)
        if FORMAT == FORMAT_INT8 or FORMAT == FORMAT_INT4:
            k_tok = tl.load(k_scales_ptr + s_row, mask=t_mask, other=0.0)
        s = s * row_scale[:, None]
        if TOKEN_SCALE:
            s = s * k_tok[None, :]
        s = tl.where(t_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
        m_i = m_new
        if FORMAT == FORMAT_MXFP4:
            v_lo, v_hi, vs = mxfp4_tiles(vc, v_scales_ptr, s_row, t_mask, c_ld, CONVERT, BLOCK_N, C_PAD, NB,
                                         BLOCK_BYTES)
            vs = tl.where(t_mask, vs, 0.0)
        elif TOKEN_SCALE:
            vs = tl.load(v_scales_ptr + s_row, mask=t_mask, other=0.0)
        if TOKEN_SCALE:
            # p x s_v / max(s_v) stays in fp16's range; the tile's max(s_v) multiplies the fp32 dot.
            vs_max = tl.max(vs, axis=0)
            p = p * (vs / vs_max)[None, :]
        else:
            vs_max = 1.0
        pc = p.to(tl.float16)
        if FORMAT == FORMAT_INT8:
            acc_a += tl.dot(pc, int8_tile(vc, CONVERT)) * vs_max
        elif FORMAT == FORMAT_INT4:
            v_lo, v_hi = int4_tiles(vc, CONVERT)
            acc_a += tl.dot(pc, v_lo) * vs_max
            acc_b += tl.dot(pc, v_hi) * vs_max
        elif FORMAT == FORMAT_NVFP4:
            v_lo, v_hi = nvfp4_tiles(vc, v_scales_ptr, s_row, t_mask, c_ld, CONVERT, BLOCK_N, C_PAD, NB, BLOCK_BYTES)
            acc_a = tl.dot(pc, v_lo, acc_a)
            acc_b = tl.dot(pc, v_hi, acc_b)
        else:
            acc_a += tl.dot(pc, v_lo) * vs_max
            acc_b += tl.dot(pc, v_hi) * vs_max

    # Epilogue: normalise (and apply V's tensor scale), then store the channels where they belong.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out_scale = 1.0 / l_safe
    if FORMAT == FORMAT_NVFP4:
        out_scale = out_scale * (tl.load(v_tensor_scale_ptr) * NV_UNIT)
    out_a = acc_a * out_scale[:, None]
    out_b = acc_b * out_scale[:, None]
    lse2 = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))

    o_row = out_ptr + b * stride_ob + heads[:, None] * stride_oh
    if SPLIT:
        o_row = o_row + split * stride_os
    if PACKED:
        tl.store(o_row + 2 * offs_c[None, :], out_a.to(out_ptr.dtype.element_ty), mask=qc_mask)
        tl.store(o_row + 2 * offs_c[None, :] + 1, out_b.to(out_ptr.dtype.element_ty), mask=qc_mask)
    else:
        tl.store(o_row + offs_c[None, :], out_a.to(out_ptr.dtype.element_ty), mask=qc_mask)
    if SPLIT:
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse2, mask=g_mask)
    else:
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh, lse2 * LN2, mask=g_mask)
