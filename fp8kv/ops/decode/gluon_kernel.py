"""FP8-KV paged decode in Triton's Gluon dialect: every warp streams its own tokens, and the FP8 tile
reaches the tensor cores without an fp16 round trip through shared memory. It reads INT8 codes (a quantized
cache's, one scale per token and head) the same way, their bytes turned to fp16 by their bits, and INT4 codes, two a
byte, by theirs.

The plain Triton kernel (:mod:`.triton_kernel`) converts each FP8 tile to fp16 in a
blocked layout and lets the compiler move it through shared memory into the MMA operand layout, and
its warps share every tile's tokens, so each tile exchanges the row max, the row sum and P across
warps. Here:

* A tile of BLOCK_N tokens is four warp slices of NW = BLOCK_N / 4 tokens. The MMA layout's first
  dimension is the warp (a batched mma.sync, ``warps_per_cta=[4, 1, 1]``): each warp keeps its own
  running max, sum and output, so the loop has no cross-warp reduction; the four are merged once, at
  the end of the split.
* Raw FP8 bytes go global -> shared memory (cp.async, a ring of STAGES tiles), and are loaded from
  there straight into a layout that *is* the MMA B-operand layout up to a permutation inside each
  thread, then converted to fp16 in registers (``cvt.rn.f16x2.e4m3x2``).

How a tile's codes reach the tensor cores (the permutation of head_dim that keeps the loads wide, and the conversions
of FP8, INT8 and INT4 codes): :mod:`.gluon_operands`.

A head_dim below HP (a multiple of 16: 48, 80, 96, 112) copies only its own 16-byte chunks; the rest of
the tile is zero-filled, so the padding costs registers and MMAs but no memory traffic.

A head_dim above 128 (up to 256) is cut into PARTS = 2 parts of 128 columns, one program per part: each
program reads all of K (two 128-wide tiles, both contracted with the query into the same scores) and the
V columns of its own part, so that a warp's accumulator stays 16 x 128 (a 16 x 256 one alone would take
128 registers a thread). The two programs of a KV head run side by side in the grid, so that the second
read of a K page can come from L2; both compute the same scores, and part 0 writes the LSE.

A program takes HEADS query heads of one KV head in ROWS MMA rows (16, or 32 in a 64-wide tile, where
the registers allow it); a larger group is cut into HEAD_TILES programs per KV head, side by side in
the grid so that they read the same pages while they are in L2. With QO new tokens per sequence
(speculative verification) a KV head has GROUP x QO rows, (token, head) pairs, cut the same way: a
row is masked causally at its own token's position, and every K/V tile is read once for all of them.

Scope (:mod:`.gluon_scope`): NHD or HND pages (the page, token and head strides are arguments), one tensor-wide
K and V scale or one per token and KV head (TOKEN_SCALES: K's multiply the score columns, V's the probabilities,
the accumulator kept in units of the largest V scale a warp has seen), head_dim a multiple of 16 from 48 to 256 (of 32
for INT4 codes: a tile row is then HB = HP / 2 bytes), 4 warps, a sliding window (no soft cap, no sinks).
:func:`fp8kv.ops.gluon_refusal` checks all of it (this is the default kernel where it holds) and :mod:`.gluon_launcher` launches it; the interpreter cannot
run Gluon, so the tensor-core Triton kernel is its twin on CPU. Besides the kernel, this module builds its
layouts (:func:`make_layouts`, constexprs built on the host), the one part of its launch that needs Gluon.
"""

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .gluon_operands import CODE_TYPES, k_dphys, k_operand, v_dphys, v_operand
from .gluon_scope import NUM_WARPS, head_pad

__all__ = ["gluon_decode_kernel", "make_layouts", "CODE_TYPES"]  # CODE_TYPES: the launch reads it here

# Two builtins were renamed after Triton 3.6 (the old names then raise): the kernel calls whichever this Triton has.
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def make_layouts(block_n: int, head_dim: int, packed: bool = False):
    """The kernel's layouts for tiles of ``block_n`` (64 or 128) tokens of ``head_dim``, built on the
    host and passed as constexprs; ``packed``: codes two a byte (HB, a tile row's bytes, is then HP / 2)."""
    hp = head_pad(head_dim)
    hb = hp // 2 if packed else hp
    nw = block_n // NUM_WARPS  # tokens per warp slice: 16 or 32
    w = NUM_WARPS
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1, 1], instr_shape=[1, 16, 8])
    a_op = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # K slice [W, NW, HB] bytes: tokens g + 8r, HB/4 contiguous bytes at (HB/4) t (the codes of HP/4 columns).
    k_phys = gl.BlockedLayout(size_per_thread=[1, 1, hb // 4], threads_per_warp=[1, 8, 4], warps_per_cta=[w, 1, 1],
                              order=[2, 1, 0])
    # V slice [W, NW, HB] bytes: HB/8 contiguous bytes (HB/8) g + j of tokens 2t + e + 8h + 16kb.
    v_phys = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(int(math.log2(hb // 8)))] + [[0, 1, 0], [0, 8, 0]]
        + [[0, 16 << i, 0] for i in range(int(math.log2(nw // 16)))],
        lane_bases=[[0, 2, 0], [0, 4, 0]] + [[0, 0, (hb // 8) << i] for i in range(3)],
        warp_bases=[[1, 0, 0], [2, 0, 0]],
        block_bases=[],
        shape=[w, nw, hb],
    )
    q_blk = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 256 // hp, hp // 8],
                             warps_per_cta=[w, 1, 1], order=[2, 1, 0])
    # Shared ring [STAGES, W, NW, HB] bytes; 16-byte chunk c of a row stored at chunk c ^ (row % (HB/16)):
    # conflict-free for the cp.async writes and the K and V reads.
    smem = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=hb // 16, order=[2, 1, 0])
    # cp.async layout over [W, NW, HB] bytes: 16 B per thread, each warp copies its own slice.
    cp = gl.BlockedLayout(size_per_thread=[1, 1, 16], threads_per_warp=[1, 512 // hb, hb // 16],
                          warps_per_cta=[w, 1, 1], order=[2, 1, 0])
    # Per-token scales (TOKEN_SCALES) [W, NW, 2] fp32, K's then V's: a cp.async of 4 bytes per scale, each warp its own
    # slice; their ring unswizzled. (At NW = 16 the layout's 4 per thread cover the 2 twice: the compiler predicates
    # the repeats off; this is the layout the GPU tests ran.)
    sc_cp = gl.BlockedLayout(size_per_thread=[1, 1, 64 // nw], threads_per_warp=[1, nw, 32 // nw],
                             warps_per_cta=[w, 1, 1], order=[2, 1, 0])
    sc_smem = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
    # ... read back as the score tile's columns (MMA sliced over its rows: lane 4g + t holds columns 8c + 2t + e of
    # every row), K's and V's scale of a token in one thread's registers
    sc_read = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 1, 0]] + [[0, 8 << i, 0] for i in range(int(math.log2(nw // 8)))],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[w, nw, 2])
    return dict(W=w, HP=hp, HB=hb, NW=nw, MMA=mma, A_OP=a_op, B_OP=b_op, K_PHYS=k_phys, V_PHYS=v_phys, Q_BLK=q_blk,
                SMEM=smem, CP=cp, SC_CP=sc_cp, SC_SMEM=sc_smem, SC_READ=sc_read)


@gluon.jit
def _slice_tokens(W: gl.constexpr, NW: gl.constexpr, L: gl.constexpr):
    """Token offsets [W, NW] (layout L) within a tile: warp w owns w NW + [0, NW)."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, L))
    n = gl.arange(0, NW, layout=gl.SliceLayout(0, L))
    return gl.expand_dims(w * NW, 1) + gl.expand_dims(n, 0)


@gluon.jit
def _page_rows(n0, local, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """(block-table column, row in its page) of tokens n0 + local, n0 a multiple of BLOCK_N. Pages and
    tiles are powers of two (the planner refuses other pages), so one divides the other: the row is
    loop-invariant (pages no larger than a tile) or one scalar per tile (larger pages)."""
    if BLOCK_N % BLOCK_SIZE == 0:
        return n0 // BLOCK_SIZE + local // BLOCK_SIZE, local % BLOCK_SIZE
    else:
        return n0 // BLOCK_SIZE + local * 0, n0 % BLOCK_SIZE + local


@gluon.jit
def _load_block_entries(bt_row, n0, local, end, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Block-table entries of tokens n0 + local (0 if >= end), as stored: :func:`_issue_tile` clamps them
    where it uses them, a tile later, so that no instruction waits on this load in the tile that issues it."""
    col, _ = _page_rows(n0, local, BLOCK_N, BLOCK_SIZE)
    return gl.load(bt_row + col, mask=n0 + local < end, other=0)


@gluon.jit
def _issue_tile(k_ptr, v_ptr, k_buf, k2_buf, v_buf, pages, num_blocks, n0, local, end, kv_head_off, v_byte0, stride_kb,
                stride_kt, HB: gl.constexpr, ROW_BYTES: gl.constexpr, PARTS: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_SIZE: gl.constexpr, CP: gl.constexpr):
    """cp.async (16 B per thread and row chunk) of the raw code bytes of tile n0's K rows (bytes
    [0, HB) into k_buf, [HB, 2 HB) into k2_buf when PARTS == 2) and V rows (bytes [v_byte0, v_byte0 + HB))
    into v_buf ([W, NW, HB] u8 smem). Rows >= end and bytes >= ROW_BYTES (a head's) are zero-filled (src-size 0).
    ``pages`` (block-table entries) are clamped into [0, num_blocks) here."""
    _, row = _page_rows(n0, local, BLOCK_N, BLOCK_SIZE)
    pages = gl.minimum(gl.maximum(pages, 0), num_blocks - 1)
    d = gl.arange(0, HB, layout=gl.SliceLayout(0, gl.SliceLayout(1, CP)))
    off = pages.to(gl.int64) * stride_kb + (row * stride_kt + kv_head_off).to(gl.int64)
    d3 = gl.expand_dims(gl.expand_dims(d, 0), 1)
    live = gl.expand_dims(n0 + local < end, 2)
    _copy_columns(k_buf, k_ptr, off, 0, d3, live, ROW_BYTES)
    if PARTS == 2:
        _copy_columns(k2_buf, k_ptr, off, HB, d3, live, ROW_BYTES)
    _copy_columns(v_buf, v_ptr, off, v_byte0, d3, live, ROW_BYTES)


@gluon.jit
def _copy_columns(buf, ptr, off, col0, d3, live, ROW_BYTES: gl.constexpr):
    """cp.async of bytes col0 + d3 of the rows at byte offsets ``off`` (multiples of 16, as col0 is) into
    buf; rows not ``live`` and bytes >= ROW_BYTES are zero-filled."""
    offs = gl.expand_dims(gl.multiple_of(off + col0, [16, 16]), 2) + d3
    _async_load(buf, ptr + offs, mask=live & (d3 < ROW_BYTES - col0))


@gluon.jit
def _row_offsets(row0, rows, b, kvh, stride_tok, stride_head, GROUP: gl.constexpr, QO: gl.constexpr):
    """Element offsets of the program's rows ``row0 + rows`` in a [tokens, heads, ...] tensor: row r is new token
    r // GROUP of sequence b (token b QO + r // GROUP) and query head r % GROUP of KV head kvh's group."""
    r = row0 + rows
    return (b * QO + r // GROUP) * stride_tok + (kvh * GROUP + r % GROUP) * stride_head


@gluon.jit
def _load_query(q_ptr, col0, b, stride_qb, stride_qh, kvh, row0, rows_here, GROUP: gl.constexpr, QO: gl.constexpr,
                W: gl.constexpr, ROWS: gl.constexpr, HP: gl.constexpr, HB: gl.constexpr, HEAD_DIM: gl.constexpr,
                Q_BLK: gl.constexpr):
    """Query columns [col0, col0 + HP) of the program's rows, fp32 [W, ROWS, HP] (Q_BLK, every warp the
    same), the columns permuted as K's contraction index; zero beyond the rows and HEAD_DIM."""
    wq = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, Q_BLK)))
    rows_q = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, Q_BLK)))
    kq = gl.arange(0, HP, layout=gl.SliceLayout(0, gl.SliceLayout(1, Q_BLK)))
    r3 = gl.expand_dims(gl.expand_dims(rows_q, 0), 2) + gl.expand_dims(gl.expand_dims(wq * 0, 1), 2)
    d3 = gl.expand_dims(gl.expand_dims(k_dphys(kq, HP, HB < HP), 0), 1) + col0
    q_ptrs = q_ptr + _row_offsets(row0, r3, b, kvh, stride_qb, stride_qh, GROUP, QO) + d3
    return gl.load(q_ptrs, mask=(r3 < rows_here) & (d3 < HEAD_DIM), other=0.0).to(gl.float32)


@gluon.jit
def _issue_scales(buf, k_scale_ptr, v_scale_ptr, pages, n0, local, end, num_blocks, kv_head_scale_off, stride_sb,
                  stride_st, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, SC_CP: gl.constexpr):
    """cp.async of the K and V scales (fp32, one per token and KV head) of tile n0's tokens ``local`` into buf
    ([W, NW, 2] smem, K's at 0); tokens >= end are zero-filled. ``pages``: their block-table entries, clamped into
    [0, num_blocks) here."""
    _, row = _page_rows(n0, local, BLOCK_N, BLOCK_SIZE)
    pages = gl.minimum(gl.maximum(pages, 0), num_blocks - 1)
    off = gl.expand_dims(pages.to(gl.int64) * stride_sb + (row * stride_st + kv_head_scale_off).to(gl.int64), 2)
    kv = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, SC_CP))), 0), 1)
    live = gl.expand_dims(n0 + local < end, 2)
    _async_load(buf, gl.where(kv == 0, k_scale_ptr + off, v_scale_ptr + off), mask=live & (kv < 2))


@gluon.jit
def gluon_decode_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # sm_scale * log2(e)
    tokens_per_split, num_blocks, row_capacity,
    window,  # WINDOWED: the keys a query attends (>= 1), itself and those before it
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
    stride_sb, stride_st, stride_sh,  # TOKEN_SCALES: the scales' (page, token, head) strides, K's and V's
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: gl.constexpr,  # query heads per KV head
    QO: gl.constexpr,  # new tokens per sequence (1: a decode); a KV head's rows are (token, head) pairs j GROUP + h
    WINDOWED: gl.constexpr,  # a sliding window: the splits tile the window (from a whole tile below it) alone
    HEADS: gl.constexpr, HEAD_TILES: gl.constexpr,  # rows per program; row tiles per KV head
    ROWS: gl.constexpr,  # MMA rows (HEADS padded: 16 or 32)
    PARTS: gl.constexpr,  # programs per head tile, one per HP output columns (head_parts)
    HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    CODE_TY: gl.constexpr,  # the pages' codes: e4m3, e5m2, int8 or int4 (uint8: two a byte; CODE_TYPES)
    TOKEN_SCALES: gl.constexpr,  # one K and one V scale per token and KV head (else one tensor-wide scale each)
    STAGES: gl.constexpr,  # smem ring depth (>= 2); STAGES - 1 tiles of copies in flight during compute
    W: gl.constexpr, HP: gl.constexpr, HB: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr,
    K_PHYS: gl.constexpr, V_PHYS: gl.constexpr, Q_BLK: gl.constexpr, SMEM: gl.constexpr, CP: gl.constexpr,
    SC_CP: gl.constexpr, SC_SMEM: gl.constexpr, SC_READ: gl.constexpr,
):
    """The tensor-core kernel's split-KV decode (fp8kv.kernels.paged_decode, its twin): warps own token
    slices of every tile, K/V FP8 bytes go global -> shared memory ring by cp.async, then shared memory ->
    registers straight in K_PHYS / V_PHYS (trivially the MMA B operand layout), converted to fp16 there.
    Grid (Hkv x HEAD_TILES x PARTS, B, splits). Writes fp32 partials and log2-LSE for combine_splits_kernel,
    one row per (token, query head): ``[B QO, Hq, splits, D]``.

    With QO > 1 (speculative verification: QO new tokens per sequence, the last QO of its row) a KV head's
    GROUP x QO rows share every K/V tile, which is read once for all of them; row j GROUP + h is query head h
    of new token j, which attends the tokens before position seq_len - QO + j + 1 (causal).

    WINDOWED: the query at position p attends the keys p - window < key <= p (fp8kv.reference.decode's window). The
    splits tile the tokens from the first new token's window start, rounded down to a whole tile (the page
    addressing takes tiles at multiples of BLOCK_N), so pages before the window are never read; the tokens of
    that first tile below each row's window are masked."""
    BLOCK_N: gl.constexpr = W * NW
    ROW_BYTES: gl.constexpr = HEAD_DIM * HB // HP  # a head's bytes of codes (HB = HP / 2 for INT4)
    part = gl.program_id(0) % PARTS  # a head tile's parts side by side: they read the same K pages
    tile = gl.program_id(0) // PARTS
    kvh = tile // HEAD_TILES  # KV heads first: a sequence's heads run side by side
    row0 = tile % HEAD_TILES * HEADS  # the program's first row of its KV head's GROUP x QO
    v_col0 = part * HP  # the program's V and output columns
    v_byte0 = part * HB  # and their codes' first byte
    rows_here = gl.minimum(GROUP * QO - row0, HEADS)
    b = gl.program_id(1)
    split = gl.program_id(2)

    seq_len = gl.minimum(gl.load(seq_lens_ptr + b), row_capacity)
    if WINDOWED:
        lo = gl.maximum(seq_len - QO + 1 - window, 0)  # the first new token's first key
        start = lo // BLOCK_N * BLOCK_N + split * tokens_per_split
    else:
        lo = 0
        start = split * tokens_per_split
    end = gl.minimum(seq_len, start + tokens_per_split)

    bt_row = bt_ptr + b * stride_btb
    kv_head_off = kvh * stride_kh
    k_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, W, NW, HB], SMEM)
    v_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, W, NW, HB], SMEM)
    if PARTS == 2:
        k2_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, W, NW, HB], SMEM)
    else:
        k2_smem = k_smem  # not copied into
    local = _slice_tokens(W, NW, gl.SliceLayout(2, CP))  # the copy layout's tokens of a tile
    if TOKEN_SCALES:
        # A tile's scales travel with its codes, in a ring of their own: loaded from global memory in the tile that
        # used them, their latency was the loop's (H100, INT4 at 32/8/128: 65 % of the copy bandwidth), and
        # prefetched into registers a tile ahead they took 203 registers a thread against 168 (2 programs an SM).
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, W, NW, 2], SC_SMEM)
        sc_local = _slice_tokens(W, NW, gl.SliceLayout(2, SC_CP))
        sc_head = kvh * stride_sh
    # prologue: tiles 0 .. STAGES-2 in flight before the query is even loaded
    for st in gl.static_range(STAGES - 1):
        n0 = start + st * BLOCK_N
        pg = _load_block_entries(bt_row, n0, local, end, BLOCK_N, BLOCK_SIZE)
        _issue_tile(k_ptr, v_ptr, k_smem.index(st), k2_smem.index(st), v_smem.index(st), pg, num_blocks, n0, local,
                    end, kv_head_off, v_byte0, stride_kb, stride_kt, HB, ROW_BYTES, PARTS, BLOCK_N, BLOCK_SIZE, CP)
        if TOKEN_SCALES:
            sc_pg = _load_block_entries(bt_row, n0, sc_local, end, BLOCK_N, BLOCK_SIZE)
            _issue_scales(sc_smem.index(st), k_scale_ptr, v_scale_ptr, sc_pg, n0, sc_local, end, num_blocks, sc_head,
                          stride_sb, stride_st, BLOCK_N, BLOCK_SIZE, SC_CP)
        async_copy.commit_group()
    pg_next = _load_block_entries(bt_row, start + (STAGES - 1) * BLOCK_N, local, end, BLOCK_N, BLOCK_SIZE)
    if TOKEN_SCALES:
        sc_pg_next = _load_block_entries(bt_row, start + (STAGES - 1) * BLOCK_N, sc_local, end, BLOCK_N, BLOCK_SIZE)

    # ---- query, in every warp: each head rescaled by a power of two before fp16 rounding (as RESCALE_Q in
    # the twin), its head_dim permuted as K's contraction index
    qf = _load_query(q_ptr, 0, b, stride_qb, stride_qh, kvh, row0, rows_here, GROUP, QO, W, ROWS, HP, HB, HEAD_DIM,
                     Q_BLK)
    amax = gl.max(gl.abs(qf), axis=2)
    if PARTS == 2:
        qf2 = _load_query(q_ptr, HP, b, stride_qb, stride_qh, kvh, row0, rows_here, GROUP, QO, W, ROWS, HP, HB, HEAD_DIM,
                          Q_BLK)
        amax = gl.maximum(amax, gl.max(gl.abs(qf2), axis=2))
    e = gl.where(amax > 0, gl.floor(gl.log2(gl.where(amax > 0, amax, 1.0))) - 13.0, 0.0)
    e = gl.minimum(gl.maximum(e, -126.0), 126.0).to(gl.int32)
    up = gl.expand_dims(((127 - e) << 23).to(gl.float32, bitcast=True), 2)
    q_op = gl.convert_layout((qf * up).to(gl.float16), A_OP)
    if PARTS == 2:
        q_op2 = gl.convert_layout((qf2 * up).to(gl.float16), A_OP)
    if TOKEN_SCALES:  # K's scales multiply the score columns, V's the probabilities (below)
        row_scale_q = ((127 + e) << 23).to(gl.float32, bitcast=True) * qk_scale
    else:
        row_scale_q = ((127 + e) << 23).to(gl.float32, bitcast=True) * (qk_scale * gl.load(k_scale_ptr))
    row_scale = gl.expand_dims(gl.convert_layout(row_scale_q, gl.SliceLayout(2, MMA)), 2)

    # A finite floor for the running max, fp32's lowest (below every finite score): a warp whose slice is
    # past `end` sees only -inf scores, and exp2(-inf - floor) = 0 where exp2(-inf - -inf) would be NaN.
    m_i = gl.full([W, ROWS], -3.4028234663852886e38, gl.float32, layout=gl.SliceLayout(2, MMA))
    l_i = gl.full([W, ROWS], 0.0, gl.float32, layout=gl.SliceLayout(2, MMA))
    acc = gl.zeros([W, ROWS, HP], gl.float32, layout=MMA)
    s_zero = gl.zeros([W, ROWS, NW], gl.float32, layout=MMA)
    s_local = _slice_tokens(W, NW, gl.SliceLayout(1, MMA))  # the score tile's tokens
    if QO > 1:  # each row's keys: new token j sees those before seq_len - QO + j + 1 (and in its window)
        j = (row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))) // GROUP
        row_end = gl.expand_dims(gl.expand_dims(gl.minimum(end, seq_len - QO + 1 + j), 0), 2)  # [1, ROWS, 1]
        if WINDOWED:
            row_lo = gl.expand_dims(gl.expand_dims(gl.maximum(seq_len - QO + 1 + j - window, 0), 0), 2)

    if TOKEN_SCALES:
        # The accumulator is kept in units of u, the largest V scale a warp has seen, so that its fp16 p * s_v / u <= 1
        # (e5m2 scales of ~1e-4 would put p * s_v among fp16's subnormals): a larger one rescales it, as a larger max
        # does.
        u = gl.full([W, 1], 1.1754943508222875e-38, gl.float32, layout=gl.SliceLayout(2, MMA))  # fp32's least normal

    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(0, num_tiles):
        n0 = start + i * BLOCK_N
        async_copy.wait_group(STAGES - 2)  # tile i landed (this thread's copies) ...
        _thread_barrier()  # ... everyone's; and everyone is done reading slot (i - 1) % STAGES
        nslot = (i + STAGES - 1) % STAGES
        _issue_tile(k_ptr, v_ptr, k_smem.index(nslot), k2_smem.index(nslot), v_smem.index(nslot), pg_next, num_blocks,
                    n0 + (STAGES - 1) * BLOCK_N, local, end, kv_head_off, v_byte0, stride_kb, stride_kt, HB, ROW_BYTES,
                    PARTS, BLOCK_N, BLOCK_SIZE, CP)
        if TOKEN_SCALES:
            _issue_scales(sc_smem.index(nslot), k_scale_ptr, v_scale_ptr, sc_pg_next, n0 + (STAGES - 1) * BLOCK_N,
                          sc_local, end, num_blocks, sc_head, stride_sb, stride_st, BLOCK_N, BLOCK_SIZE, SC_CP)
            sc_pg_next = _load_block_entries(bt_row, n0 + STAGES * BLOCK_N, sc_local, end, BLOCK_N, BLOCK_SIZE)
        async_copy.commit_group()
        pg_next = _load_block_entries(bt_row, n0 + STAGES * BLOCK_N, local, end, BLOCK_N, BLOCK_SIZE)

        slot = i % STAGES
        if TOKEN_SCALES:
            sk, sv = gl.split(sc_smem.index(slot).load(SC_READ))
            sk = gl.convert_layout(sk, gl.SliceLayout(1, MMA), assert_trivial=True)
            sv = gl.convert_layout(sv, gl.SliceLayout(1, MMA), assert_trivial=True)
        kt = k_operand(k_smem.index(slot).load(K_PHYS), W, NW, HP, B_OP, CODE_TY)
        s = mma_v2(q_op, kt, s_zero)
        if PARTS == 2:
            s = mma_v2(q_op2, k_operand(k2_smem.index(slot).load(K_PHYS), W, NW, HP, B_OP, CODE_TY), s)
        s = s * row_scale
        if TOKEN_SCALES:
            s = s * gl.expand_dims(sk, 1)
            sv_tile = gl.expand_dims(sv, 1)  # [W, 1, NW]
        if QO > 1:
            t = gl.expand_dims(n0 + s_local, 1)
            if WINDOWED:
                s = gl.where((t < row_end) & (t >= row_lo), s, float("-inf"))
            else:
                s = gl.where(t < row_end, s, float("-inf"))
        elif WINDOWED:
            s = gl.where(gl.expand_dims((n0 + s_local < end) & (n0 + s_local >= lo), 1), s, float("-inf"))
        else:
            s = gl.where(gl.expand_dims(n0 + s_local < end, 1), s, float("-inf"))

        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 2))
        l_i = l_i * alpha + gl.sum(p, axis=2)
        if TOKEN_SCALES:
            u_new = gl.maximum(u, gl.max(sv_tile, axis=2))  # [W, 1]
            inv_u = 1.0 / u_new
            acc = acc * gl.expand_dims(alpha * (u * inv_u), 2)
            p = p * (sv_tile * gl.expand_dims(inv_u, 2))
            u = u_new
        else:
            acc = acc * gl.expand_dims(alpha, 2)
        m_i = m_new

        p_op = gl.convert_layout(p.to(gl.float16), A_OP)
        vv = v_operand(v_smem.index(slot).load(V_PHYS), W, NW, HP, B_OP, CODE_TY)
        acc = mma_v2(p_op, vv, acc)
    async_copy.wait_group(0)  # no copies in flight at exit

    # ---- merge the warps' slices (once per split)
    m = gl.max(m_i, axis=0)
    w_scale = gl.exp2(m_i - gl.expand_dims(m, 0))
    l_sum = gl.sum(l_i * w_scale, axis=0)
    l_safe = gl.where(l_sum > 0, l_sum, 1.0)
    lse2 = gl.where(l_sum > 0, m + gl.log2(l_safe), float("-inf"))
    O_L: gl.constexpr = gl.SliceLayout(0, MMA)
    if TOKEN_SCALES:  # each warp's accumulator in its own units u
        o = gl.sum(acc * gl.expand_dims(w_scale * u, 2), axis=0)
        o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, O_L)), 1)
    else:
        o = gl.sum(acc * gl.expand_dims(w_scale, 2), axis=0)
        o = o * gl.expand_dims(gl.convert_layout(gl.load(v_scale_ptr) / l_safe, gl.SliceLayout(1, O_L)), 1)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, O_L))
    dcol = gl.expand_dims(v_dphys(gl.arange(0, HP, layout=gl.SliceLayout(0, O_L)), HP), 0) + v_col0
    o_rows = _row_offsets(row0, rows, b, kvh, stride_ob, stride_oh, GROUP, QO)
    o_ptrs = part_out_ptr + split * stride_os + gl.expand_dims(o_rows, 1) + dcol
    gl.store(o_ptrs, o, mask=gl.expand_dims(rows < rows_here, 1) & (dcol < HEAD_DIM))
    lse_rows = gl.convert_layout(lse2, gl.SliceLayout(1, O_L))
    lse_ptrs = part_lse_ptr + _row_offsets(row0, rows, b, kvh, stride_lb, stride_lh, GROUP, QO) + split
    gl.store(lse_ptrs, lse_rows, mask=(rows < rows_here) & (part == 0))
