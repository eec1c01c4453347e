"""FP8-KV paged decode in Triton's Gluon dialect: the FP8 tile reaches the tensor cores without an
fp16 round trip through shared memory.

The plain Triton kernel (:mod:`fp8kv.kernels.paged_decode`) converts each FP8 tile to fp16 in a
blocked layout and lets the compiler move it through shared memory into the MMA operand layout.
Here raw FP8 bytes are copied global -> shared memory (cp.async, a ring of STAGES tiles), loaded
from there straight into a layout that *is* the MMAv2 B-operand layout up to a permutation inside
each thread, and converted to fp16 in registers (``cvt.rn.f16x2.e4m3x2``).

How the loads stay 16 bytes wide although the operand layout scatters every thread's elements:
the contraction index of Q·Kᵀ and the output column of P·V (both head_dim) may be permuted freely,
as long as the query (loaded once) and the output store (once) use the same permutation.

* K tile, physical [BLOCK_N tokens, 128 bytes]: thread (lane = 4g + t, warp w) reads the 32
  contiguous bytes ``d_phys = 32 t + c`` of rows ``n = g + 8 w + 32 r``. Byte c = 4 kb + 2 h + e is
  contraction index ``k = 16 kb + 8 h + 2 t + e``, where the m16n8k16 B fragment wants it.
* V tile: thread reads 4 contiguous bytes ``d_phys = 32 w + 4 g + r`` of tokens ``2 t + e + 8 h +
  16 kb``, which is output column ``n = 32 r + 8 w + g`` of the fragment.

One tile shape: NHD pages, head_dim 128, one tensor-wide K and V scale, groups of up to 16 query
heads (16 MMA rows), 4 warps. :func:`fp8kv.ops.decode_kernel` checks all of it (this is the
default kernel where it holds) and :func:`fp8kv.ops.paged_decode` launches; the interpreter cannot
run Gluon, so the tensor-core Triton kernel is its twin on CPU.
"""

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

NUM_WARPS = 4
HEAD_DIM = 128  # the one head dim of this kernel
GROUP_PAD = 16  # MMA rows: query heads per program, padded


def make_layouts(block_n: int):
    """The kernel's layouts for tiles of ``block_n`` (64 or 128) tokens, built on the host and passed
    as constexprs."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NUM_WARPS], instr_shape=[16, 8])
    a_op = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # K tile [BLOCK_N, 128] bytes: row n = g + 8w + 32r, 32 contiguous bytes at 32t.
    k_phys = gl.BlockedLayout(size_per_thread=[1, 32], threads_per_warp=[8, 4], warps_per_cta=[NUM_WARPS, 1],
                              order=[1, 0])
    # V tile [BLOCK_N, 128] bytes: 4 contiguous bytes d = 32w + 4g + r of tokens 2t + e + 8h + 16kb.
    kb_bases = [[16 << i, 0] for i in range(int(math.log2(block_n // 16)))]
    v_phys = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [8, 0]] + kb_bases,
        lane_bases=[[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]],
        warp_bases=[[0, 32], [0, 64]],
        block_bases=[],
        shape=[block_n, HEAD_DIM],
    )
    q_blk = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[NUM_WARPS, 1],
                             order=[1, 0])
    # shared layout of the async-copy ring: [BLOCK_N, 128] bytes, 16-byte chunk c of row n stored at chunk
    # c ^ (n % 8). Conflict-free for the 16-byte cp.async writes (a row's 8 chunks per 8 lanes), for the K_PHYS
    # reads (ld.shared.v4; a quarter warp = rows g, g+1 x chunks 2t+h) and the V_PHYS reads (ld.shared.b32;
    # rows 2t+e, t=0..3 x chunks 2w, 2w+1 -> 8 distinct chunks after the xor).
    smem = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
    # cp.async layout over [BLOCK_N, 128] bytes: 16 B per thread, a warp covers 4 rows x 128 B per copy;
    # rows of one thread are 16 apart (one 16-token page each).
    cp = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[NUM_WARPS, 1],
                          order=[1, 0])
    return dict(MMA=mma, A_OP=a_op, B_OP=b_op, K_PHYS=k_phys, V_PHYS=v_phys, Q_BLK=q_blk, SMEM=smem,
                CP=cp)


@gluon.jit
def _k_dphys(k):
    """Physical byte (head_dim index) of contraction index k in the K tile (and the query)."""
    return 32 * ((k >> 1) & 3) + 4 * (k >> 4) + 2 * ((k >> 3) & 1) + (k & 1)


@gluon.jit
def _v_dphys(n):
    """Physical head_dim index of logical output column n = 32r + 8w + g (stored at 32w + 4g + r)."""
    return 32 * ((n >> 3) & 3) + 4 * (n & 7) + (n >> 5)


@gluon.jit
def _k_operand(k_codes, BLOCK_N: gl.constexpr, B_OP: gl.constexpr, FP8_TY: gl.constexpr):
    """[BLOCK_N, 128] uint8 codes (K_PHYS) -> Kᵀ [128 (permuted k), BLOCK_N] fp16 in the B layout."""
    x = k_codes.to(FP8_TY, bitcast=True)
    x = x.reshape([BLOCK_N, 4, 8, 2, 2])  # n, t, kb, h, e
    x = x.permute([2, 3, 1, 4, 0])  # kb, h, t, e, n
    x = x.reshape([128, BLOCK_N])  # k = 16kb + 8h + 2t + e
    x = gl.convert_layout(x, B_OP, assert_trivial=True)
    return x.to(gl.float16)


@gluon.jit
def _v_operand(v_codes, BLOCK_N: gl.constexpr, B_OP: gl.constexpr, FP8_TY: gl.constexpr):
    """[BLOCK_N, 128] uint8 codes (V_PHYS) -> V [BLOCK_N, 128 (permuted n)] fp16 in the B layout."""
    x = v_codes.to(FP8_TY, bitcast=True)
    x = x.reshape([BLOCK_N, 4, 8, 4])  # tok, w, g, r
    x = x.permute([0, 3, 1, 2])  # tok, r, w, g
    x = x.reshape([BLOCK_N, 128])  # n = 32r + 8w + g
    x = gl.convert_layout(x, B_OP, assert_trivial=True)
    return x.to(gl.float16)


@gluon.jit
def _load_pages(bt_row, n0, end, num_blocks, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, CP: gl.constexpr):
    """Block-table entries of the rows n0 + [0, BLOCK_N) in the copy layout's row slice (clamped; 0 if >= end)."""
    t = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CP))
    page = gl.load(bt_row + t // BLOCK_SIZE, mask=t < end, other=0)
    return gl.minimum(gl.maximum(page, 0), num_blocks - 1)


@gluon.jit
def _issue_tile(k_ptr, v_ptr, k_buf, v_buf, pages, n0, end, kv_head_off, stride_kb, stride_kt,
                BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, CP: gl.constexpr):
    """cp.async (16 B per thread and row chunk) of the raw FP8 bytes of K and V rows n0 + [0, BLOCK_N) into
    k_buf / v_buf ([BLOCK_N, 128] u8 smem). Rows >= end are zero-filled (src-size 0)."""
    t = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CP))
    d = gl.arange(0, 128, layout=gl.SliceLayout(0, CP))
    off = pages.to(gl.int64) * stride_kb + ((t % BLOCK_SIZE) * stride_kt + kv_head_off).to(gl.int64)
    off = gl.multiple_of(off, 16)
    offs = gl.expand_dims(off, 1) + gl.expand_dims(d, 0)
    mask = gl.expand_dims(t < end, 1) & gl.expand_dims(d < 128, 0)
    async_copy.async_copy_global_to_shared(k_buf, k_ptr + offs, mask=mask)
    async_copy.async_copy_global_to_shared(v_buf, v_ptr + offs, mask=mask)


@gluon.jit
def gluon_decode_async_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,  # sm_scale * log2(e)
    tokens_per_split, num_blocks, row_capacity,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    GROUP: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_SIZE: gl.constexpr, FP8_TY: gl.constexpr,
    STAGES: gl.constexpr,  # smem ring depth (>= 2); STAGES - 1 tiles of copies in flight during compute
    MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, K_PHYS: gl.constexpr, V_PHYS: gl.constexpr,
    Q_BLK: gl.constexpr, SMEM: gl.constexpr, CP: gl.constexpr,
):
    """The tensor-core kernel's split-KV decode (fp8kv.kernels.paged_decode, its twin) for one tile shape:
    K/V FP8 bytes go global -> shared memory ring by cp.async, then shared memory -> registers straight
    in K_PHYS / V_PHYS (trivially the MMA B operand layout), converted to fp16 there: no fp16 tile goes
    back through shared memory. Writes fp32 partials and log2-LSE for combine_splits_kernel."""
    b = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)

    seq_len = gl.minimum(gl.load(seq_lens_ptr + b), row_capacity)
    start = split * tokens_per_split
    end = gl.minimum(seq_len, start + tokens_per_split)

    bt_row = bt_ptr + b * stride_btb
    kv_head_off = kvh * stride_kh
    k_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 128], SMEM)
    v_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 128], SMEM)
    # prologue: tiles 0 .. STAGES-2 in flight before the query is even loaded
    for st in gl.static_range(STAGES - 1):
        pg = _load_pages(bt_row, start + st * BLOCK_N, end, num_blocks, BLOCK_N, BLOCK_SIZE, CP)
        _issue_tile(k_ptr, v_ptr, k_smem.index(st), v_smem.index(st), pg, start + st * BLOCK_N, end, kv_head_off,
                    stride_kb, stride_kt, BLOCK_N, BLOCK_SIZE, CP)
        async_copy.commit_group()
    pg_next = _load_pages(bt_row, start + (STAGES - 1) * BLOCK_N, end, num_blocks, BLOCK_N, BLOCK_SIZE, CP)

    # ---- query: each head rescaled by a power of two before fp16 rounding (as RESCALE_Q in the twin)
    rows_q = gl.arange(0, 16, layout=gl.SliceLayout(1, Q_BLK))
    kq = gl.arange(0, 128, layout=gl.SliceLayout(0, Q_BLK))
    q_mask = gl.expand_dims(rows_q < GROUP, 1) & gl.expand_dims(kq < 128, 0)
    q_ptrs = q_ptr + b * stride_qb + gl.expand_dims((kvh * GROUP + rows_q) * stride_qh, 1) \
        + gl.expand_dims(_k_dphys(kq), 0)
    qf = gl.load(q_ptrs, mask=q_mask, other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(qf), axis=1)
    e = gl.where(amax > 0, gl.floor(gl.log2(gl.where(amax > 0, amax, 1.0))) - 13.0, 0.0)
    e = gl.minimum(gl.maximum(e, -126.0), 126.0).to(gl.int32)
    up = ((127 - e) << 23).to(gl.float32, bitcast=True)
    q16 = (qf * gl.expand_dims(up, 1)).to(gl.float16)
    q_op = gl.convert_layout(q16, A_OP)
    k_scale = gl.load(k_scale_ptr)
    row_scale_q = ((127 + e) << 23).to(gl.float32, bitcast=True) * (qk_scale * k_scale)
    row_scale = gl.convert_layout(row_scale_q, gl.SliceLayout(1, MMA))

    m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.full([16], 0.0, gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([16, 128], gl.float32, layout=MMA)
    s_zero = gl.zeros([16, BLOCK_N], gl.float32, layout=MMA)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))

    num_tiles = gl.cdiv(end - start, BLOCK_N)
    for i in range(0, num_tiles):
        n0 = start + i * BLOCK_N
        async_copy.wait_group(STAGES - 2)  # tile i landed (this thread's copies) ...
        gl.thread_barrier()  # ... everyone's; and everyone is done reading slot (i - 1) % STAGES
        nslot = (i + STAGES - 1) % STAGES
        _issue_tile(k_ptr, v_ptr, k_smem.index(nslot), v_smem.index(nslot), pg_next, n0 + (STAGES - 1) * BLOCK_N,
                    end, kv_head_off, stride_kb, stride_kt, BLOCK_N, BLOCK_SIZE, CP)
        async_copy.commit_group()
        pg_next = _load_pages(bt_row, n0 + STAGES * BLOCK_N, end, num_blocks, BLOCK_N, BLOCK_SIZE, CP)

        slot = i % STAGES
        k_codes = k_smem.index(slot).load(K_PHYS)
        kt = _k_operand(k_codes, BLOCK_N, B_OP, FP8_TY)
        s = mma_v2(q_op, kt, s_zero)
        s = s * gl.expand_dims(row_scale, 1)
        s = gl.where(gl.expand_dims(n0 + cols < end, 0), s, float("-inf"))

        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.expand_dims(alpha, 1)
        m_i = m_new

        p_op = gl.convert_layout(p.to(gl.float16), A_OP)
        v_codes = v_smem.index(slot).load(V_PHYS)
        vv = _v_operand(v_codes, BLOCK_N, B_OP, FP8_TY)
        acc = mma_v2(p_op, vv, acc)
    async_copy.wait_group(0)  # no copies in flight at exit

    l_safe = gl.where(l_i > 0, l_i, 1.0)
    out = acc * gl.expand_dims(gl.load(v_scale_ptr) / l_safe, 1)
    lse2 = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    ncol = gl.arange(0, 128, layout=gl.SliceLayout(0, MMA))
    heads = kvh * GROUP + rows
    o_ptrs = part_out_ptr + b * stride_ob + split * stride_os + gl.expand_dims(heads * stride_oh, 1) \
        + gl.expand_dims(_v_dphys(ncol), 0)
    o_mask = gl.expand_dims(rows < GROUP, 1) & gl.expand_dims(ncol < 128, 0)
    gl.store(o_ptrs, out, mask=o_mask)
    gl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse2, mask=rows < GROUP)
