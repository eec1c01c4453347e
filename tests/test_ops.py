"""Triton kernels (decode, fused cache write, FP8 codec) against the fp32 reference.

On a CPU machine these run under the Triton interpreter (conftest sets TRITON_INTERPRET=1). Its
bf16 arithmetic is wrong, so there the launcher computes and stores in fp32 what would be bf16,
and bf16 queries and caches are checked here too. On a GPU the same cases run compiled, plus large
shapes (marker ``gpu``).

Tolerances (kernel error, measured against ``reference.decode`` on the *dequantized* cache):

* dequant mode: K and V convert exactly (every e4m3/e5m2 value is an fp16 and a bf16 value), scores
  accumulate in fp32, so the error comes from rounding p to the 16-bit dot type and rounding the
  output: each ≤ u (fp16 u = 2^-11, bf16 u = 2^-8) relative, so the norm-wise output error is
  ≤ 2u. Per-channel K scales are folded into q and rounded once more: ≤ 3u.
* fp8 mode: q and p are rounded to e4m3 (u = 2^-4 relative each). The errors are independent across
  D and tokens and average out, so the norm-wise error sits near u/2; we allow 0.08 (≈ 1.3u). A
  dropped or misapplied scale (≥ 2x) or a broken P path gives errors of order 1.

The numbers live beside the oracle (``fp8kv.reference.output_tolerance`` / ``lse_tolerance``), where
the benchmark and the backend matrix take them too.
"""

import functools
import math
import re

import pytest
import torch
from fixtures import DEVICE, dequant_tol, make_q, matrix_cache, seeded

import fp8kv
from fp8kv.cache import PagedKVCache
from fp8kv.cache.quantized import QuantizedPagedKVCache
from fp8kv.capability import UnsupportedError
from fp8kv.quant import relative_error
from fp8kv.reference import FP8_MODE_TOL, lse_tolerance, unit_roundoff
from fp8kv.reference import decode as ref_decode

triton = pytest.importorskip("triton")
from fp8kv.ops import choose_num_splits, launch_config, paged_decode, write_cache  # noqa: E402

Q_DTYPES = [torch.float16, torch.bfloat16]


def check_against_reference(q, cache, mode, tol, **kw):
    out, lse = paged_decode(q, cache, mode=mode, **kw)
    ref_out, ref_lse = ref_decode(q, cache)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    err = relative_error(out.float(), ref_out)
    assert err <= tol, f"{mode} {cache}: rel err {err:.3e} > {tol:.3e}"
    # LSE: scores carry the same relative error as q (fp8: 2^-4; dequant channel fold: u).
    lse_tol = lse_tolerance("triton", mode, q.dtype, ref_lse)
    lse_err = float((lse - ref_lse).abs().max())
    assert lse_err <= lse_tol, f"lse err {lse_err:.3e} > {lse_tol:.3e}"
    return err


# ---------------------------------------------------------------------------------------------- decode
LENS = [1, 16, 37, 64]  # one token, a block boundary, a non-multiple, several pages


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "token_head", "channel"])
def test_dequant_matches_reference(kv_dtype, granularity, q_dtype):
    cache = matrix_cache(LENS, 2, 64, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(len(LENS), 8, 64, q_dtype)
    for splits in (1, 3):
        check_against_reference(q, cache, "dequant", dequant_tol(q_dtype, granularity), num_splits=splits,
                                block_n=32)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "channel"])
def test_fp8_mode_matches_reference(kv_dtype, granularity):
    cache = matrix_cache(LENS, 2, 64, kv_dtype=kv_dtype, granularity=granularity)
    q = make_q(len(LENS), 8, 64, Q_DTYPES[-1])
    for splits in (1, 2):
        check_against_reference(q, cache, "fp8", FP8_MODE_TOL, num_splits=splits, block_n=32)


def test_fp8_mode_error_exceeds_dequant_error():
    """fp8 mode costs accuracy (q and p in e4m3); measure that it does, so the mode is really on."""
    cache = matrix_cache(LENS, 2, 64)
    q = make_q(len(LENS), 8, 64, torch.float16)
    e_deq = check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "tensor"))
    e_fp8 = check_against_reference(q, cache, "fp8", FP8_MODE_TOL)
    assert e_fp8 > 4 * e_deq


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gqa_groups_and_layouts(group, layout):
    cache = matrix_cache([1, 17, 33], 2, 64, layout=layout, granularity="head", seed=group)
    q = make_q(3, 2 * group, 64, torch.float16, seed=group)
    check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "head"), num_splits=2, block_n=16)


def test_mqa_sixteen_query_heads_one_kv_head():
    cache = matrix_cache([5, 40], 1, 64)
    q = make_q(2, 16, 64, torch.float16)
    check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "tensor"))
    check_against_reference(q, cache, "fp8", FP8_MODE_TOL)


# Odd head layouts, a covering set rather than the full product: every group of 1, 3, 5 and 7, every
# head dim of 80, 96 and 112 (padded to 128 in registers, read exactly), pages of 16 and 32.
ODD_LAYOUTS = [(1, 80, 16), (3, 96, 32), (5, 112, 16), (7, 80, 32), (1, 112, 32), (7, 96, 16)]


@pytest.mark.parametrize("group,head_dim,block_size", ODD_LAYOUTS)
@pytest.mark.parametrize("use_tensor_cores", [True, False])
def test_odd_layouts_and_lengths(group, head_dim, block_size, use_tensor_cores):
    """Both kernels at odd groups and head dims over sequences of 1, 17 and 5003 tokens (a partial
    page, a partial tile, many splits) against the oracle."""
    lens = [1, 17, 5003]
    cache = matrix_cache(lens, 2, head_dim, granularity="head", block_size=block_size, seed=group)
    q = make_q(len(lens), 2 * group, head_dim, torch.float16, seed=head_dim)
    check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "head"),
                            use_tensor_cores=use_tensor_cores)


@pytest.mark.parametrize("group,heads_per_program", [(5, 2), (7, 3), (71, 24)])
@pytest.mark.parametrize("mode,granularity", [("dequant", "tensor"), ("dequant", "token_head"),
                                              ("dequant", "channel"), ("fp8", "head")])
def test_a_group_cut_into_head_tiles(group, heads_per_program, mode, granularity, kernel_spies):
    """Large groups are cut into several programs per KV head (5 -> 2+2+1, 7 -> 3+3+1, 71 -> 24+24+23),
    every head of the tile mapped to its own query row, output and LSE, with one split and three."""
    cache = matrix_cache([1, 17, 70], 2, 32, granularity=granularity, seed=group)
    q = make_q(3, 2 * group, 32, torch.float16, seed=group)
    tol = FP8_MODE_TOL if mode == "fp8" else dequant_tol(torch.float16, granularity)
    for splits in (1, 3):
        check_against_reference(q, cache, mode, tol, num_splits=splits, block_n=32,
                                heads_per_program=heads_per_program)
    tiles = math.ceil(group / heads_per_program)
    assert kernel_spies["tensor"].grids == [(3, 2 * tiles, 1), (3, 2 * tiles, 3)]


def test_head_tiles_with_a_sink_per_query_head():
    cache = matrix_cache([3, 40], 1, 32, granularity="head")
    q = make_q(2, 7, 32, torch.float16)
    sinks = torch.linspace(-3.0, 4.0, 7).to(DEVICE)  # a sink read by the wrong head would fail
    ref_o, ref_l = ref_decode(q, cache, sinks=sinks)
    for splits in (1, 3):
        out, lse = paged_decode(q, cache, num_splits=splits, block_n=16, sinks=sinks, heads_per_program=3)
        assert relative_error(out.float(), ref_o) <= dequant_tol(torch.float16, "head")
        assert float((lse - ref_l).abs().max()) <= lse_tolerance("triton", "dequant", torch.float16, ref_l)


def test_falcon_group_runs_as_two_programs_when_latency_bound_and_one_when_streaming(kernel_spies, monkeypatch):
    """71 query heads per KV head: two programs of 36 and 35 heads (GROUP_PAD 64) in a latency-bound launch,
    one of 71 (GROUP_PAD 128) where the launch streams; both against the oracle."""
    from fp8kv import ops

    cache = matrix_cache([3, 40], 1, 32, granularity="head")
    q = make_q(2, 71, 32, torch.float16)
    check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "head"), num_splits=2, block_n=16)
    assert kernel_spies["tensor"].grids == [(2, 2, 2)]
    monkeypatch.setattr(ops.decode.splits, "sm_count", lambda device: 1)  # two sequences of 13 tiles then stream
    long = matrix_cache([3, 200], 1, 32, granularity="head")
    check_against_reference(q, long, "dequant", dequant_tol(torch.float16, "head"), num_splits=2, block_n=16)
    assert kernel_spies["tensor"].grids[-1] == (2, 1, 2)


def test_heads_per_program_rule():
    from fp8kv import ops
    from fp8kv.ops import MAX_HEADS_PER_PROGRAM

    # splits are sized for every program of a sequence: two head tiles need half the splits of one
    long = matrix_cache([5, 4096], 1, 32)
    assert launch_config(8, long, group=71, heads_per_program=36)["num_splits"] == 2
    assert launch_config(8, long, group=71, heads_per_program=71)["num_splits"] == 4
    # by default a group of up to MAX_HEADS_STREAMING is one program where the launch streams (8 x 4k on the
    # CPU's 4 "SMs"), and cut into programs of MAX_HEADS_PER_PROGRAM where it is latency-bound (2 x 40)
    assert launch_config(8, long, group=71)["head_tiles"] == 1
    assert launch_config(8, long, group=ops.MAX_HEADS_STREAMING + 1)["head_tiles"] == 3
    assert ops.latency_bound(2, 1, 48, 16, 4) and not ops.latency_bound(8, 1, 4096, 16, 4)

    mqa = matrix_cache([5, 40], 1, 32)
    assert launch_config(2, mqa, group=8) == launch_config(2, mqa, group=8, heads_per_program=8)
    cfg = launch_config(2, mqa, group=71)
    tiles = math.ceil(71 / MAX_HEADS_PER_PROGRAM)
    assert (cfg["head_tiles"], cfg["heads_per_program"]) == (tiles, math.ceil(71 / tiles))
    assert (launch_config(2, mqa, group=71, heads_per_program=16)["head_tiles"],
            launch_config(2, mqa, group=71, heads_per_program=16)["heads_per_program"]) == (5, 15)
    assert launch_config(2, mqa, group=4, heads_per_program=100)["head_tiles"] == 1
    assert launch_config(2, mqa, use_tensor_cores=False, group=71)["head_tiles"] == 1
    with pytest.raises(ValueError, match="heads_per_program=0"):
        launch_config(2, mqa, group=4, heads_per_program=0)
    with pytest.raises(ValueError, match="heads_per_program=4 with use_tensor_cores=False"):
        launch_config(2, mqa, group=4, heads_per_program=4, use_tensor_cores=False)


@pytest.mark.parametrize("head_dim", [40, 80, 128])
def test_head_dims_padded(head_dim):
    """Non-powers of two are padded to the next power of two inside the kernel."""
    cache = matrix_cache([3, 29], 2, head_dim)
    q = make_q(2, 4, head_dim, torch.float16)
    check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "tensor"), block_n=16)


@pytest.mark.parametrize("block_size,block_n", [(16, 64), (32, 32), (64, 16), (8, 32)])
def test_tile_size_decoupled_from_page_size(block_size, block_n):
    cache = matrix_cache([1, 31, 70], 2, 64, block_size=block_size)
    q = make_q(3, 8, 64, torch.float16)
    check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "tensor"), block_n=block_n,
                            num_splits=2)


# ------------------------------------------------------------------------------- CUDA-core kernel
class _Spy:
    """Wraps a Triton kernel to count its launches (which kernel the dispatcher picked) and keep their grids."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.grids = kernel, 0, []

    def __getitem__(self, grid):
        self.launches += 1
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.fixture
def kernel_spies(monkeypatch):
    from fp8kv import ops

    spies = {"tensor": _Spy(ops.paged_decode_kernel), "cuda": _Spy(ops.paged_decode_cuda_core_kernel)}
    monkeypatch.setattr(ops.decode.triton_launcher, "paged_decode_kernel", spies["tensor"])
    monkeypatch.setattr(ops.decode.triton_launcher, "paged_decode_cuda_core_kernel", spies["cuda"])
    return spies


@pytest.mark.parametrize("group", [1, 2, 3, 5])
@pytest.mark.parametrize("kv_dtype,granularity", [("fp8_e4m3", "tensor"), ("fp8_e5m2", "head"),
                                                  ("fp8_e4m3", "token_head"), ("fp8_e4m3", "channel"),
                                                  ("bf16", "tensor"), ("fp16", "tensor")])
def test_cuda_core_kernel_matches_reference(group, kv_dtype, granularity, kernel_spies):
    """The FMA kernel (no tl.dot) on any group, scale granularity and cache type; one split and three
    (empty splits included: the 1-token sequence). It computes in fp32, so only the output's rounding
    to the query dtype remains: the dequant tolerance holds with room."""
    q_dtype = torch.bfloat16 if kv_dtype == "bf16" else torch.float16
    cache = matrix_cache(LENS, 2, 48, kv_dtype=kv_dtype, granularity=granularity, seed=group)
    q = make_q(len(LENS), 2 * group, 48, q_dtype, seed=group)
    for splits, block_n in ((1, 16), (3, 8)):
        check_against_reference(q, cache, "dequant", dequant_tol(q_dtype, granularity), num_splits=splits,
                                block_n=block_n, use_tensor_cores=False)
    assert kernel_spies["cuda"].launches == 2 and kernel_spies["tensor"].launches == 0


def test_kernel_choice_is_explicit(kernel_spies):
    """The tensor-core kernel runs unless use_tensor_cores=False asks for the CUDA-core one (opt-in
    until measured on a GPU); fp8 mode refuses CUDA cores; a non-bool is refused by name."""
    mha = matrix_cache([5, 40], 4, 32)
    q = make_q(2, 4, 32, torch.float16)
    paged_decode(q, mha)
    paged_decode(q, mha, use_tensor_cores=True)
    paged_decode(q, mha, mode="fp8")
    assert (kernel_spies["cuda"].launches, kernel_spies["tensor"].launches) == (0, 3)
    out, lse = paged_decode(q, mha, use_tensor_cores=False)
    assert (kernel_spies["cuda"].launches, kernel_spies["tensor"].launches) == (1, 3)
    ref_o, _ = ref_decode(q, mha)
    assert relative_error(out.float(), ref_o) <= dequant_tol(torch.float16, "tensor")
    with pytest.raises(ValueError, match="use_tensor_cores=False with mode='fp8'"):
        paged_decode(q, mha, mode="fp8", use_tensor_cores=False)
    with pytest.raises(TypeError, match="use_tensor_cores='no'"):
        paged_decode(q, mha, use_tensor_cores="no")


@pytest.mark.parametrize("variant", ["window", "soft_cap", "sinks"])
def test_cuda_core_kernel_variants(variant):
    """Sliding window, soft-cap and sinks on the CUDA-core kernel, one split and several, at a group of 3
    with a different sink per query head (a sink read by KV head would fail)."""
    cache = matrix_cache([1, 40, 70], 2, 32, granularity="head")
    q = make_q(3, 6, 32, torch.float16)  # a group of 3: query head and KV head numbers differ
    kw = {"window": dict(window=20), "soft_cap": dict(soft_cap=4.0),
          "sinks": dict(sinks=torch.linspace(-3.0, 4.0, 6).to(DEVICE))}[variant]  # one per query head
    ref_o, ref_l = ref_decode(q, cache, **kw)
    for splits in (1, 4):
        out, lse = paged_decode(q, cache, num_splits=splits, block_n=8, use_tensor_cores=False, **kw)
        assert relative_error(out.float(), ref_o) <= dequant_tol(torch.float16, "head")
        assert float((lse - ref_l).abs().max()) <= lse_tolerance("triton", "dequant", torch.float16, ref_l)


CONVERTS = ["software", "cast", "software/cast", "cast/software"]
if DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
    CONVERTS += ["ptx", "cast/ptx", "ptx/cast"]


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_conversion_paths_agree(kv_dtype):
    """The sm80 path (uint8 codes decoded with integer ops), Triton's cast and (on sm89+ GPUs) the
    inline-PTX conversion are all exact, so they give bit-identical outputs, also mixed per tile."""
    cache = matrix_cache(LENS, 2, 64, kv_dtype=kv_dtype)
    q = make_q(len(LENS), 8, 64, torch.float16)
    outs = {c: paged_decode(q, cache, convert=c) for c in CONVERTS}
    first_out, first_lse = outs[CONVERTS[0]]
    for c in CONVERTS[1:]:
        assert torch.equal(outs[c][0], first_out) and torch.equal(outs[c][1], first_lse), c


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_sixteen_bit_kv_through_same_kernel(kv_dtype):
    """A 16-bit cache read with a query of its own dtype (fp16 dots over bf16 pages are refused)."""
    cache = matrix_cache(LENS, 2, 64, kv_dtype=kv_dtype)
    q_dtype = torch.bfloat16 if kv_dtype == "bf16" else torch.float16
    q = make_q(len(LENS), 8, 64, q_dtype)
    check_against_reference(q, cache, "dequant", dequant_tol(q_dtype, "tensor"), num_splits=2)


@pytest.mark.parametrize("mode", ["dequant", "fp8"])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_non_unit_scales_are_honoured(mode, granularity):
    """K x 4 stored with k_scale 4 and V x 1/4 with v_scale 1/4 hold the same codes as unit scales:
    the scores must be identical and the output exactly 1/4 of the unit-scale output."""
    g = seeded(5)
    lens = [9, 50]
    k = torch.randn(2, 50, 2, 64, generator=g).to(DEVICE)
    v = torch.randn(2, 50, 2, 64, generator=g).to(DEVICE)
    unit = PagedKVCache.from_dense(k, v, lens, granularity=granularity, scale=1.0)
    scaled = PagedKVCache.from_dense(k * 4, v / 4, lens, granularity=granularity, k_scale=4.0, v_scale=0.25)
    assert torch.equal(unit.k_pages.view(torch.uint8), scaled.k_pages.view(torch.uint8))
    q = make_q(2, 8, 64, torch.float16)
    o1, l1 = paged_decode(q, unit, mode=mode)
    o2, l2 = paged_decode(q, scaled, mode=mode)
    ref_o2, ref_l2 = ref_decode(q, scaled)
    # k_scale 4 multiplies every score, so the lse differs from the unit run: check it on the reference
    assert float((l2 - ref_l2).abs().max()) <= (2.0**-3 if mode == "fp8" else 1e-2) * max(1.0, float(ref_l2.abs().max()))
    tol = FP8_MODE_TOL if mode == "fp8" else dequant_tol(torch.float16, granularity)
    assert relative_error(o2.float(), ref_o2) <= tol
    # V scale: the same scores with V codes identical => output scales by exactly 1/4 (a power of two)
    same_k = PagedKVCache.from_dense(k, v / 4, lens, granularity=granularity, k_scale=1.0, v_scale=0.25)
    o3, l3 = paged_decode(q, same_k, mode=mode)
    assert torch.equal(l3, l1)
    assert torch.equal(o3, (o1.float() / 4).to(o1.dtype))


def test_splits_agree_and_batch_one_fills_the_gpu(monkeypatch):
    cache = matrix_cache([200], 2, 64, seed=3)
    q = make_q(1, 8, 64, torch.float16)
    outs = [paged_decode(q, cache, num_splits=s, block_n=16) for s in (1, 2, 5)]
    for o, lse in outs[1:]:
        assert relative_error(o.float(), outs[0][0].float()) < 2 * unit_roundoff(torch.float16)
        assert float((lse - outs[0][1]).abs().max()) < 1e-4
    # the heuristic: batch 1 x 8 KV heads on 132 SMs asks for many splits; capped by context length
    assert choose_num_splits(1, 8, 16384, 64, 132) == 64
    assert choose_num_splits(64, 8, 16384, 128, 132) == 3  # 8 waves: ceil(8 * 132 / 512)
    assert choose_num_splits(16, 8, 16384, 128, 132) == 9
    assert choose_num_splits(256, 8, 16384, 128, 132) == 1
    assert choose_num_splits(1, 8, 128, 64, 132) == 1  # two tiles: one split, no combine launch
    # latency-bound shapes: one-tile splits until four waves of programs run, at most MAX_SPLITS
    assert choose_num_splits(1, 8, 4096, 128, 132) == 32  # 4-tile splits would give 8
    assert choose_num_splits(3, 8, 1000, 128, 132) == 8
    assert choose_num_splits(1, 32, 4096, 128, 132) == 17  # MHA: 8 splits would fill not four waves (32 x 8 < 528)
    # MQA: 64 splits would leave SMs idle, so up to 128 (not 256 one-tile splits)
    assert choose_num_splits(1, 1, 16384, 64, 132) == 128
    assert choose_num_splits(2, 1, 16384, 64, 132) == 128
    assert choose_num_splits(3, 1, 16384, 64, 132) == 64
    assert choose_num_splits(1, 1, 2**20, 128, 132) == 128  # the bandwidth rule would ask for 1056

    # what launch_config launches: whole tiles per split (17 wanted at B=4 x 4k -> 16 of 256 tokens)
    from fp8kv import ops
    from fp8kv.ops import launch_config

    monkeypatch.setattr(ops.decode.splits, "sm_count", lambda device: 132)  # an H200's launch, on any machine
    for b, hkv, lens, want in ((4, 8, [4096] * 4, 16), (1, 8, [4096], 32), (2, 8, [1000, 1000], 8)):
        cfg = launch_config(b, matrix_cache(lens, hkv, 128, seed=1), block_n=128)
        assert cfg["num_splits"] == want and cfg["tokens_per_split"] % 128 == 0, (b, lens, cfg)
    # the CUDA-core kernel runs one program per query head: its split count follows Hq, not Hkv
    mha = matrix_cache([16384], 2, 64, seed=1)  # long enough that the two counts stay under their caps
    tc = launch_config(1, mha, block_n=64)["num_splits"]
    cc = launch_config(1, mha, block_n=64, use_tensor_cores=False, group=4)["num_splits"]
    assert cc < tc
    with pytest.raises(ValueError, match="group"):
        launch_config(1, mha, use_tensor_cores=False)


def test_resident_programs_follow_registers_shared_memory_and_threads():
    """The occupancy rules behind fill_waves, at the builds the H200 runs (fp8kv.ops.decode.gluon_build: 168 registers and
    72 KiB for 32/8/128, 96 and 28 KiB for 12/4/64, 212 and 104 KiB for MHA, 247 for 8/1/256)."""
    from fp8kv.ops import resident_programs

    assert resident_programs(168, 73728, 4) == 3  # 5376 registers a warp: 3 warps per sub-partition
    assert resident_programs(96, 28672, 4) == 5
    assert resident_programs(104, 28672, 4) == 4  # 8 registers more lose a program
    assert resident_programs(212, 106496, 4) == 2
    assert resident_programs(247, 106496, 4) == 2
    assert resident_programs(64, 106496, 4) == 2  # shared memory bounds it: 2 x (104 + 1) KiB
    assert resident_programs(32, 0, 4) == 16  # threads: 2048 / 128
    assert resident_programs(32, 0, 1) == 32  # the programs-per-SM limit
    assert resident_programs(255, 240000, 8) == 1  # never below one


def test_fill_waves_takes_the_fewest_splits_that_waste_the_least_of_the_last_wave():
    """The measured H200 cases of fill_waves' docstring: 132 SMs, B = 64 x 16k."""
    from fp8kv.ops import choose_num_splits, fill_waves

    # 8/1/256, Gluon: 128 programs a split, 2 an SM; the rule's 9 splits are 4.36 waves, 4 splits 1.94
    assert choose_num_splits(64, 2, 16384, 128, 132) == 9
    assert choose_num_splits(64, 2, 16384, 128, 132, slots=264) == 4
    # 28/4/128: 256 a split, 3 an SM: 5 splits (3.23 waves) -> 3 (1.94)
    assert choose_num_splits(64, 4, 16384, 64, 132, slots=396) == 3
    # 32/8/128: the rule's 3 splits (3.88 waves) stay
    assert choose_num_splits(64, 8, 16384, 64, 132, slots=396) == 3
    # 71/1/64 in one Triton program: 64 a split, 2 an SM: 17 -> 8 splits (1.94 waves)
    assert choose_num_splits(64, 1, 16384, 64, 132, slots=264) == 8
    # 14/2/64: 128 a split, 5 an SM; 5 splits would be a single wave (0.97): kept at 9 (1.75)
    assert choose_num_splits(64, 2, 16384, 64, 132, slots=660) == 9
    assert fill_waves(128, 9, 660, 16384, 64) == 9
    # a latency-bound launch keeps the latency rule's count
    assert choose_num_splits(1, 8, 4096, 128, 132, slots=396) == 32

    def realised(s: int, capacity: int = 16384, block_n: int = 64) -> int:  # launch_config's whole tiles per split
        return math.ceil(capacity / (math.ceil(math.ceil(capacity / s) / block_n) * block_n))

    for programs, splits, slots in ((128, 9, 264), (7, 40, 100), (3, 1, 50), (1000, 7, 132), (640, 30, 660)):
        s = fill_waves(programs, splits, slots, 16384, 64)
        assert -(-splits // 4) <= s <= splits and realised(s) == s
        assert s == splits or programs * s > slots  # more than one wave, or the rule's own count


def test_latency_rule_takes_four_waves_only_at_power_of_two_head_dims(monkeypatch):
    """B = 1 x 4k MHA on 132 SMs: 16 splits at D = 128 (four waves), 8 at D = 80 and 96 (two), as
    ``latency_waves`` says."""
    from fp8kv import ops

    monkeypatch.setattr(ops.decode.splits, "sm_count", lambda device: 132)
    assert [ops.latency_waves(d) for d in (64, 80, 96, 112, 128, 256)] == [4.0, 2.0, 2.0, 2.0, 4.0, 4.0]
    for d, splits in ((128, 16), (80, 8), (96, 8)):
        cache = matrix_cache([4096], 32, d)
        assert launch_config(1, cache, group=1)["num_splits"] == splits, d


def test_empty_split_ranges_are_harmless():
    """More splits than tokens in some sequences: empty splits must not disturb the combine."""
    cache = matrix_cache([1, 2, 130], 2, 64)
    q = make_q(3, 4, 64, torch.float16)
    check_against_reference(q, cache, "dequant", dequant_tol(torch.float16, "tensor"), num_splits=8, block_n=16)


def test_decode_errors_are_clear():
    """Bad input through the entry point (fp8kv.decode validates; the launcher checks its options)."""
    decode_triton = functools.partial(fp8kv.decode, backend="triton")
    cache = matrix_cache([4, 5], 2, 64)
    q = make_q(2, 8, 64, torch.float16)
    with pytest.raises(TypeError, match="triton takes bf16/fp16 queries; fp32 queries run on the reference only"):
        decode_triton(q.float(), cache)
    with pytest.raises(ValueError, match="mode="):
        decode_triton(q, cache, mode="int8")
    with pytest.raises(ValueError, match="multiple of"):
        decode_triton(make_q(2, 7, 64, torch.float16), cache)
    with pytest.raises(ValueError, match="head_dim"):
        decode_triton(make_q(2, 8, 32, torch.float16), cache)
    with pytest.raises(ValueError, match="contiguous"):
        decode_triton(make_q(2, 8, 128, torch.float16)[..., ::2], cache)
    with pytest.raises(ValueError, match="block_n"):
        decode_triton(q, cache, mode="fp8", block_n=16)
    for bad in ("magic", "cast/", "cast/ptx/cast"):
        with pytest.raises(ValueError, match="convert="):
            decode_triton(q, cache, convert=bad)
    with pytest.raises(TypeError, match="convert"):
        decode_triton(q, cache, convert=("cast", "cast"))
    with pytest.raises(ValueError, match="eviction_policy="):
        decode_triton(q, cache, eviction_policy="evict_always")
    th = matrix_cache([4, 5], 2, 64, granularity="token_head")
    with pytest.raises(UnsupportedError, match="token_head needs dequant"):
        decode_triton(q, th, mode="fp8")
    bf = matrix_cache([4, 5], 2, 64, kv_dtype="bf16")
    with pytest.raises(UnsupportedError, match="needs an FP8 KV cache"):
        decode_triton(q, bf, mode="fp8")


# ---------------------------------------------------------------------------------- fused cache write
WRITE_CASES = [(f, g) for f in ("fp8_e4m3", "fp8_e5m2") for g in ("tensor", "head", "token_head", "channel")]
WRITE_CASES += [("fp16", "tensor"), ("bf16", "tensor")]


@pytest.mark.parametrize("kv_dtype,granularity", WRITE_CASES)
def test_write_cache_bit_exact_with_torch_write(kv_dtype, granularity):
    hkv, d = 3, 40
    lens = [5, 20]
    base = matrix_cache(lens, hkv, d, kv_dtype=kv_dtype, granularity=granularity)
    g = seeded(9)
    n = 11
    k_new = (torch.randn(n, hkv, d, generator=g) * 3).to(DEVICE)
    v_new = torch.randn(n, hkv, d, generator=g).to(DEVICE)
    if base.is_fp8 and granularity != "token_head":
        k_new[0, 0, 0] = 1e6  # far past the range: must saturate, and be counted
    free = torch.arange(base.num_blocks * base.block_size, device=DEVICE)
    slots = free[torch.randperm(free.numel(), generator=g)[:n].to(DEVICE)]
    slots[3] = -1  # padding slot: skipped
    # two identical caches, then one torch write and one fused write
    a, b = (matrix_cache(lens, hkv, d, kv_dtype=kv_dtype, granularity=granularity) for _ in range(2))
    n_torch = a.write(k_new, v_new, slots)
    sat = write_cache(b, k_new, v_new, slots)
    assert int(sat.item()) == n_torch
    if base.is_fp8 and granularity != "token_head":
        assert n_torch >= 1
    for pa, pb in ((a.k_pages, b.k_pages), (a.v_pages, b.v_pages)):
        assert torch.equal(pa.view(torch.uint8) if a.is_fp8 else pa, pb.view(torch.uint8) if b.is_fp8 else pb)
    assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)


def test_write_cache_errors():
    cache = matrix_cache([4], 2, 64)
    k = torch.randn(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_new must be \[N, 2, 64\]"):
        write_cache(cache, k[:, :1], k[:, :1], torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="slot_mapping must be an int32 or int64"):
        write_cache(cache, k, k, torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="agree on N"):
        write_cache(cache, k, k, torch.zeros(2, dtype=torch.int64, device=DEVICE))
    slot = torch.arange(3, device=DEVICE)
    for flag in (None, "no"):  # None skipped the saturation count silently; "no" counted
        with pytest.raises(TypeError, match=rf"count_saturated={flag!r} .*expected True or False"):
            write_cache(cache, k, k, slot, count_saturated=flag)


# ------------------------------------------------------------------------------------------ GPU only
@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype,mode", [("fp8_e4m3", "dequant"), ("fp8_e4m3", "fp8"), ("fp8_e5m2", "dequant"),
                                           ("bf16", "dequant")])
def test_large_shapes_on_gpu(kv_dtype, mode):
    torch.manual_seed(0)
    lens = [4096, 1, 3000, 16384 - 5]
    cache = matrix_cache(lens, 8, 128, kv_dtype=kv_dtype)
    q = make_q(len(lens), 32, 128, torch.bfloat16)
    tol = FP8_MODE_TOL if mode == "fp8" else dequant_tol(torch.bfloat16, "tensor")
    check_against_reference(q, cache, mode, tol)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_decode_is_cuda_graph_capturable():
    cache = matrix_cache([100, 2000], 8, 128)
    q = make_q(2, 32, 128, torch.bfloat16)
    eager, _ = paged_decode(q, cache)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        paged_decode(q, cache)  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out, _ = paged_decode(q, cache)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert math.isfinite(float(out.float().abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9, reason="needs an sm90+ GPU")
@pytest.mark.parametrize("sinks", [False, True])
def test_combine_as_dependent_launch_gives_the_plain_launchs_bits(monkeypatch, sinks):
    """The split combine launched as a programmatic dependent of the decode (it starts while the decode
    runs, and waits for its partials) gives bit for bit what a plain launch gives, eagerly and replayed in
    a CUDA graph: 2 sequences (1000 tokens and 1) in one-tile splits, 16/2/128, with and without a
    sink term in the combine. Each measured decode follows one of another query, whose partials the
    allocator hands on: a combine that read before the decode wrote would combine those."""
    from fp8kv import ops

    torch.manual_seed(0)
    cache = matrix_cache([1000, 1], 2, 128)
    q, other = make_q(2, 16, 128, torch.bfloat16), make_q(2, 16, 128, torch.bfloat16, seed=2)
    kw = dict(gluon=False, sinks=torch.randn(16, device=DEVICE) if sinks else None)
    cfg = ops.decode_launch(2, cache, "dequant", 128, 8, q.device, gluon=False)[1]
    programs = 2 * 2 * cfg["head_tiles"] * cfg["num_splits"]
    results = {}
    for pdl in (False, True):
        monkeypatch.setattr(ops.decode.combine, "COMBINE_PDL", pdl)
        assert cfg["num_splits"] > 1 and ops.combine_as_dependent(programs, q.device) is pdl  # the path under test
        paged_decode(other, cache, **kw)
        eager = paged_decode(q, cache, **kw)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            paged_decode(other, cache, **kw)
            graphed = paged_decode(q, cache, **kw)
        g.replay()
        torch.cuda.synchronize()
        results[pdl] = (eager, graphed)
    plain = results[False][0]
    assert not torch.equal(paged_decode(other, cache, **kw)[0], plain[0])  # the other query's partials differ
    for out, lse in (*results[True], results[False][1]):
        assert torch.equal(out, plain[0]) and torch.equal(lse, plain[1])


def test_dependent_launch_only_on_a_gpu_with_half_its_sms_free(monkeypatch):
    from fp8kv import ops

    assert not ops.combine_as_dependent(1, torch.device("cpu"))
    monkeypatch.setattr(ops.decode.combine, "pdl_capable", lambda device: True)  # as on an sm90 GPU
    monkeypatch.setattr(ops.decode.splits, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert ops.combine_as_dependent(66, gpu) and not ops.combine_as_dependent(67, gpu)
    monkeypatch.setattr(ops.decode.combine, "COMBINE_PDL", False)  # the switch off: plain launches everywhere
    assert not ops.combine_as_dependent(1, gpu)


def test_copy_kernel_copies_every_element():
    """The bandwidth ceiling's kernel (fp8kv.bench.measure_copy_bandwidth on a GPU)."""
    from fp8kv.ops.copy import copy_kernel

    src = torch.randn(10_000, device=DEVICE)
    dst = torch.full_like(src, float("nan"))
    copy_kernel[(triton.cdiv(src.numel(), 4096),)](src, dst, src.numel(), BLOCK=4096)
    assert torch.equal(dst, src)


def test_stream_copy_copies_every_element_of_an_odd_length():
    from fp8kv.ops import COPY_BLOCK, stream_copy

    src = torch.randn(COPY_BLOCK + 37, generator=seeded(3)).to(DEVICE)  # a partial last program
    dst = torch.full_like(src, float("nan"))
    assert stream_copy(src, dst) is dst
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="equal numel"):
        stream_copy(src, torch.empty(COPY_BLOCK, device=DEVICE))
    with pytest.raises(TypeError, match="dst has dtype float16"):
        stream_copy(src, torch.empty_like(src, dtype=torch.float16))
    x = torch.arange(3 * COPY_BLOCK, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="overlap"):  # blocks in any order: a block could read another's writes
        stream_copy(x[:2 * COPY_BLOCK], x[COPY_BLOCK:])
    with pytest.raises(TypeError, match="src must be a torch.Tensor"):
        stream_copy([1.0], dst)
    stream_copy(x[:COPY_BLOCK], x[COPY_BLOCK:2 * COPY_BLOCK])  # adjacent, not overlapping
    assert torch.equal(x[COPY_BLOCK:2 * COPY_BLOCK], x[:COPY_BLOCK])


# ------------------------------------------------------------------------------------ the Gluon kernel
@pytest.mark.parametrize("kw, cache_kw, q_shape, match", [
    (dict(mode="fp8"), {}, (2, 8, 128), "mode='fp8'"),
    ({}, dict(kv_dtype="bf16"), (2, 8, 128), "kv_dtype=bf16"),
    ({}, dict(granularity="head"), (2, 8, 128), "granularity='head'"),
    ({}, dict(d=72), (2, 8, 72), "head_dim=72"),
    ({}, dict(d=272), (2, 8, 272), "head_dim=272: .* multiples of 16 from 48 to 256"),
    ({}, dict(d=200), (2, 8, 200), "head_dim=200"),
    ({}, dict(d=32), (2, 8, 32), "head_dim=32"),
    (dict(heads_per_program=17), {}, (2, 34, 128), "heads_per_program=17: .* at most 16 query heads at head_dim 128"),
    (dict(heads_per_program=33), dict(d=64), (2, 66, 64), "heads_per_program=33: .* at most 32 query heads at head_dim 64"),
    (dict(heads_per_program=17), dict(d=256), (2, 34, 256), "heads_per_program=17: .* at most 16 query heads at head_dim 256"),
    (dict(soft_cap=30.0), {}, (2, 8, 128), r"no \['soft_cap'\]"),
    (dict(sinks=torch.zeros(8)), {}, (2, 8, 128), r"no \['sinks'\]"),
    (dict(use_tensor_cores=False), {}, (2, 8, 128), r"no \['use_tensor_cores'\]"),
    (dict(num_warps=8), {}, (2, 8, 128), "num_warps=8"),
    ({}, {}, (2, 8, 128), "CUDA GPU only"),  # the one shape, but no GPU here
])
def test_gluon_kernel_refuses_what_its_shape_does_not_cover(kw, cache_kw, q_shape, match):
    """gluon=True is one compiled shape; everything else is refused by name (here on CPU, where the
    interpreter cannot run Gluon at all: the last refusal)."""
    if DEVICE == "cuda" and match == "CUDA GPU only":
        pytest.skip("this machine has a GPU")
    d = cache_kw.pop("d", 128)
    cache = matrix_cache([5, 40], 2, d, **cache_kw)
    q = make_q(*q_shape, torch.bfloat16 if cache_kw.get("kv_dtype") == "bf16" else torch.float16)
    with pytest.raises(UnsupportedError, match=match):
        paged_decode(q, cache, gluon=True, **kw)


def test_the_gluon_kernel_is_the_default_where_it_runs(monkeypatch):
    """The dispatcher's choice (decode_kernel), tested on CPU with the GPU facts faked: Gluon by default
    on its shape, the Triton kernel for any Triton override, a variant or gluon=False; gluon=True
    raises where Gluon cannot run; the arch rules name the GPU."""
    from fp8kv import ops
    from fp8kv.ops import decode_kernel, gluon_refusal

    cache = matrix_cache([5, 40], 2, 128)
    assert gluon_refusal(cache, "dequant", 128, 4, "cpu") is not None  # no GPU here
    assert decode_kernel(cache, "dequant", 128, 4, "cpu") == "triton"
    with pytest.raises(UnsupportedError, match="gluon=True: .*CUDA GPU only"):
        decode_kernel(cache, "dequant", 128, 4, "cpu", gluon=True)
    with pytest.raises(TypeError, match="gluon=1"):
        decode_kernel(cache, "dequant", 128, 4, "cpu", gluon=1)

    monkeypatch.setattr(ops.decode.planning, "interpreter_on", lambda: False)  # as on a GPU
    monkeypatch.setattr(ops.decode.planning, "current_arch", lambda device=None: "sm90")
    assert gluon_refusal(cache, "dequant", 128, 4, "cuda") is None
    assert decode_kernel(cache, "dequant", 128, 4, "cuda") == "gluon"
    assert decode_kernel(cache, "dequant", 128, 4, "cuda", gluon=False) == "triton"
    assert decode_kernel(cache, "dequant", 128, 4, "cuda", gluon=True, block_n=64, num_stages=3) == "gluon"
    for override in (dict(block_n=64), dict(num_warps=4), dict(num_stages=3), dict(convert="ptx"),
                     dict(window=8), dict(heads_per_program=2), dict(use_tensor_cores=False)):
        assert decode_kernel(cache, "dequant", 128, 4, "cuda", **override) == "triton", override
    assert decode_kernel(cache, "dequant", 128, 4, "cuda", block_n=None) == "gluon"  # None: not given
    for d in (48, 64, 80, 96, 112, 144, 192, 256):  # any multiple of 16 up to 256 (zero-filled to the tile width)
        assert decode_kernel(matrix_cache([5, 40], 2, d), "dequant", d, 4, "cuda") == "gluon", d
    for refused in (dict(mode="fp8"), dict(head_dim=72), dict(head_dim=272), dict(head_dim=32)):
        args = {"mode": "dequant", "head_dim": 128, "group": 4, **refused}
        assert decode_kernel(cache, args["mode"], args["head_dim"], args["group"], "cuda") == "triton", refused
    for group in (17, 48, 71):  # any group: cut into programs of at most gluon_max_heads query heads
        assert decode_kernel(cache, "dequant", 128, group, "cuda") == "gluon", group
    assert decode_kernel(cache, "dequant", 128, 48, "cuda", gluon=True, heads_per_program=16) == "gluon"
    with pytest.raises(ValueError, match="heads_per_program=0"):
        decode_kernel(cache, "dequant", 128, 48, "cuda", gluon=True, heads_per_program=0)
    for kw in (dict(kv_dtype="bf16"), dict(granularity="head")):
        assert decode_kernel(matrix_cache([5, 40], 2, 128, **kw), "dequant", 128, 4, "cuda") == "triton", kw
    assert decode_kernel(matrix_cache([5, 40], 2, 128, layout="HND"), "dequant", 128, 4, "cuda") == "gluon"
    monkeypatch.setattr(ops.decode.planning, "current_arch", lambda device=None: "sm80")
    assert "need sm89+" in gluon_refusal(cache, "dequant", 128, 4, "cuda")  # an A100
    assert "need sm89+" in gluon_refusal(matrix_cache([5, 40], 2, 128, kv_dtype="fp8_e5m2"), "dequant", 128, 4, "cuda")


def test_small_batches_run_the_triton_kernel_by_default(monkeypatch):
    """Gluon by default only where each split streams GLUON_MIN_SPLIT_TOKENS tokens or more; asked for
    by name it runs anyway."""
    from fp8kv import ops

    monkeypatch.setattr(ops.decode.planning, "gluon_refusal", lambda *a, **k: None)  # as on a GPU where it runs
    cache = matrix_cache([5, 300], 2, 128)  # 304 tokens of capacity: tiles of 64 make splits of 320 or 192
    long_split = dict(num_splits=1)
    monkeypatch.setitem(ops.GLUON_MIN_SPLIT_TOKENS, 1, 200)
    assert ops.decode_launch(2, cache, "dequant", 128, 4, torch.device("cpu"), **long_split)[0] == "gluon"
    assert ops.decode_launch(2, cache, "dequant", 128, 4, torch.device("cpu"), num_splits=2)[0] == "triton"
    assert ops.decode_launch(2, cache, "dequant", 128, 4, torch.device("cpu"), num_splits=2, gluon=True)[0] == "gluon"
    # a group cut into several programs per KV head runs the Triton kernel by default (48 > 16 at D = 128)
    assert ops.decode_launch(2, cache, "dequant", 128, 48, torch.device("cpu"), **long_split)[0] == "triton"
    assert ops.decode_launch(2, cache, "dequant", 128, 16, torch.device("cpu"), **long_split)[0] == "gluon"
    assert ops.decode_launch(2, cache, "dequant", 128, 48, torch.device("cpu"), gluon=True, **long_split)[0] == "gluon"


def test_two_part_heads_take_the_gluon_kernel_from_shorter_splits(monkeypatch):
    """Above head_dim 128 (two programs per head tile) Gluon is the default from 512 tokens per split, at
    128 and below from 1024 (GLUON_MIN_SPLIT_TOKENS)."""
    from fp8kv import ops

    monkeypatch.setattr(ops.decode.planning, "gluon_refusal", lambda *a, **k: None)  # as on a GPU where it runs
    cpu = torch.device("cpu")
    for d, splits, kernel in ((256, 2, "gluon"), (256, 4, "triton"), (128, 2, "triton"), (128, 1, "gluon")):
        cache = matrix_cache([5, 1024], 2, d)  # 1024 tokens of capacity: 2 splits of 512, 4 of 256
        chosen, cfg = ops.decode_launch(2, cache, "dequant", d, 4, cpu, num_splits=splits)
        assert chosen == kernel, (d, splits, cfg)
        if chosen == "gluon":
            assert cfg["tokens_per_split"] == 1024 // splits


def test_int4_codes_take_the_gluon_kernel_from_512_token_splits():
    """INT4 codes (two a byte) go to the Gluon kernel from GLUON_MIN_PACKED_SPLIT_TOKENS (512) tokens per split, below
    the decode's 1024 (their alternative is the slower Triton quantized kernel); INT8 codes keep the decode's bound."""
    from fp8kv import ops
    from fp8kv.ops.decode.planning import gluon_config

    cpu = torch.device("cpu")
    k, v = torch.randn(2, 1024, 2, 128), torch.randn(2, 1024, 2, 128)
    for fmt, splits, runs in (("int4_token_head", 2, True), ("int4_token_head", 4, False),
                              ("int8_token_head", 2, False), ("int8_token_head", 1, True)):
        cache = QuantizedPagedKVCache.from_dense(fmt, k, v, [5, 1024])  # 1024 tokens of capacity
        cfg = gluon_config(2, cache, 4, cpu, gluon=None, q_dtype=torch.bfloat16, num_splits=splits)
        assert (cfg is not None) == runs, (fmt, splits, cfg)
        if runs:
            assert cfg["tokens_per_split"] == 1024 // splits
    assert ops.GLUON_MIN_PACKED_SPLIT_TOKENS == 512 < ops.GLUON_MIN_SPLIT_TOKENS[1]


def test_gluon_rings_fit_the_gpus_shared_memory(monkeypatch):
    """On a GPU with 99 KiB per program (sm89, sm120) the default ring is made shallower until it fits;
    an explicit tile that cannot fit is refused by name, not left to fail at launch."""
    from fp8kv import ops

    cache = matrix_cache([5, 300], 2, 128)
    assert ops.gluon_smem_bytes(128, 3, 128) == 2 * 3 * 128 * 128 + ops.GLUON_SMEM_EXTRA
    assert ops.gluon_smem_bytes(64, 3, 64) == 2 * 3 * 64 * 64 + ops.GLUON_SMEM_EXTRA  # 64-wide tile
    # the tiles depend on the SM count too: the 4 SMs the launches are planned for off CUDA, on any machine
    monkeypatch.setattr(ops.decode.splits, "sm_count", lambda device: 4)
    monkeypatch.setattr(ops.decode.gluon_launcher, "smem_per_block", lambda device: 101376)
    mha = ops.gluon_launch(512, cache, 1)  # 128 / 3 (MHA at a batch that fills 8 waves) needs 104 KiB
    assert (mha["block_n"], mha["num_stages"]) == (128, 2)
    assert ops.gluon_launch(2, cache, 4)["num_stages"] == 4  # 64 / 4: 72 KiB fits
    with pytest.raises(UnsupportedError, match="block_n=128, num_stages=4: .*101376"):
        ops.gluon_launch(2, cache, 4, block_n=128, num_stages=4)
    monkeypatch.setattr(ops.decode.gluon_launcher, "smem_per_block", lambda device: 232448)  # an H200: the defaults stand
    assert ops.gluon_launch(512, cache, 1)["num_stages"] == 3
    # above 128 columns: two K tiles (both parts) and one V tile (the program's part) per stage
    assert ops.gluon_smem_bytes(64, 3, 256) == 3 * 3 * 64 * 128 + ops.GLUON_SMEM_EXTRA
    assert ops.gluon_smem_bytes(64, 3, 144) == ops.gluon_smem_bytes(64, 3, 256)
    wide = matrix_cache([5, 300], 2, 256)
    monkeypatch.setattr(ops.decode.gluon_launcher, "smem_per_block", lambda device: 101376)  # 128 / 2 needs 104 KiB: 64-token tiles
    assert (ops.gluon_launch(2, wide, 8)["block_n"], ops.gluon_launch(2, wide, 8)["num_stages"]) == (64, 3)
    assert ops.gluon_launch(2, wide, 8, num_stages=2)["block_n"] == 64
    # INT4 codes, two a byte: half the rings, so 128 / 2 fits at 256 columns where one-byte codes do not
    assert ops.gluon_smem_bytes(64, 3, 256, packed=True) == 3 * 3 * 64 * 64 + ops.GLUON_SMEM_EXTRA
    # per-token scales: a ring of a K and a V scale (fp32) per token beside the codes'
    assert ops.gluon_smem_bytes(64, 4, 128, token_scales=True) == (2 * 128 + 8) * 4 * 64 + ops.GLUON_SMEM_EXTRA
    int4 = QuantizedPagedKVCache.from_dense("int4_token_head", torch.randn(2, 300, 2, 256), torch.randn(2, 300, 2, 256),
                                            [5, 300])
    assert (ops.gluon_launch(2, int4, 8)["block_n"], ops.gluon_launch(2, int4, 8)["num_stages"]) == (128, 2)
    with pytest.raises(UnsupportedError, match="block_n=128, num_stages=2"):
        ops.gluon_launch(2, wide, 8, block_n=128)
    with pytest.raises(UnsupportedError, match=r"block_n=64 \(the default tile made smaller\), num_stages=4"):
        ops.gluon_launch(2, wide, 8, num_stages=4)


def test_gluon_splits_count_both_parts_of_a_wide_head():
    """A head_dim above 128 runs two programs per head tile: the splits are sized for that grid."""
    from fp8kv import ops

    wide = matrix_cache([5, 3000], 2, 256)
    cfg = ops.gluon_launch(2, wide, 8)
    assert cfg["num_splits"] == ops.launch_config(2, wide, group=8, heads_per_program=16, head_parts=2,
                                                  block_n=cfg["block_n"])["num_splits"]
    assert cfg["num_splits"] < ops.launch_config(2, wide, group=8, heads_per_program=16,
                                                 block_n=cfg["block_n"])["num_splits"]
    with pytest.raises(ValueError, match="head_parts=0"):
        ops.launch_config(2, wide, head_parts=0)


def test_gluon_splits_fill_the_waves_of_the_programs_an_sm_holds():
    """8/1/256 at B = 64 x 16k planned for an H200: the eight-wave rule's 9 splits, or with 2 programs an SM
    (the sm90 build's) the 4 that fill two waves; programs_per_sm is validated by name."""
    from fp8kv import ops
    from fp8kv.cache import PagedKVCache

    cache = PagedKVCache.empty(1, 16384, 1, 256)  # only its shape is read
    assert ops.gluon_launch(64, cache, 8, num_sms=132)["num_splits"] == 9
    cfg = ops.gluon_launch(64, cache, 8, num_sms=132, programs_per_sm=2)
    assert (cfg["num_splits"], cfg["tokens_per_split"]) == (4, 4096)
    assert ops.gluon_launch(64, cache, 8, num_sms=132, programs_per_sm=2, num_splits=9)["num_splits"] == 9
    with pytest.raises(ValueError, match="programs_per_sm=0"):
        ops.gluon_launch(64, cache, 8, num_sms=132, programs_per_sm=0)


def test_residency_compiles_the_planned_launch_once_per_kernel(monkeypatch):
    """What decode_launch does on a GPU, with the compile stubbed: each kernel is compiled (warmup, its full
    argument list and constexprs) once per distinct kernel, and a variant compiled in is another kernel."""
    from fp8kv import ops
    from fp8kv.ops.decode import gluon_kernel as g

    compiled = []

    def warmup(*args, grid, **constexprs):
        compiled.append((len(grid), len(args), constexprs))

    monkeypatch.setattr(ops.paged_decode_kernel, "warmup", warmup, raising=False)
    monkeypatch.setattr(g.gluon_decode_kernel, "warmup", warmup, raising=False)
    known = {}
    monkeypatch.setattr(ops.decode.splits, "kernel_residency", lambda key, device, compile_kernel: known.get(key) or known.setdefault(
        key, compile_kernel() or 2))
    cache = matrix_cache([5, 300], 2, 64)
    cfg = ops.launch_config(2, cache, group=4)
    plain = dict(window=None, soft_cap=None, sinks=None, convert=None, eviction_policy="", compute_dtype=None)
    cpu = torch.device("cpu")
    for variants in (plain, plain, {**plain, "soft_cap": 30.0}, {**plain, "soft_cap": 50.0}):
        assert ops.decode.triton_launcher.triton_residency(2, cache, cfg, "dequant", 4, torch.float16, cpu, variants) == 2
    assert [c[2]["SOFT_CAP"] for c in compiled] == [False, True]
    assert all(c[0] == 3 and c[2]["GROUP_PAD"] == 16 and c[2]["num_warps"] == cfg["num_warps"] for c in compiled)
    gcfg = ops.gluon_launch(2, cache, 4)
    for _ in range(2):
        assert ops.decode.gluon_launcher.gluon_residency(cache, gcfg, 4, torch.bfloat16, cpu) == 2
    assert len(compiled) == 3 and compiled[-1][2]["HEADS"] == 4 and compiled[-1][2]["num_warps"] == g.NUM_WARPS


def test_gluon_launch_defaults_and_bad_options():
    from fp8kv import ops
    from fp8kv.ops import gluon_launch

    cache = matrix_cache([5, 300], 2, 128)
    cfg = gluon_launch(2, cache, 4)
    assert (cfg["block_n"], cfg["num_stages"], cfg["num_warps"]) == (64, 4, 4)
    assert (gluon_launch(2, cache, 1)["block_n"], gluon_launch(2, cache, 1)["num_stages"]) == (64, 4)  # MHA, B = 2
    mha = gluon_launch(512, cache, 1)  # 1024 sequence-heads: 8 waves of 4 SMs (the CPU's stand-in count)
    assert (mha["block_n"], mha["num_stages"], mha["num_splits"]) == (128, 3, 1)
    assert ops.gluon_tile(4, 64, 8, 132) == (64, 3)
    assert ops.gluon_tile(8, 256, 64, 132) == ops.gluon_tile(1, 256, 8 * 132, 132) == (128, 2)  # two parts
    # MHA streams whole sequences in 128-token tiles once the sequences alone fill 8 waves; else 64
    assert ops.gluon_tile(1, 128, 8 * 132, 132) == (128, 3) and ops.gluon_tile(1, 128, 8 * 132 - 1, 132) == (64, 4)
    # INT4 codes (two a byte) in 128-token tiles, 3 deep, at every batch up to head_dim 128; wider heads as FP8's.
    # H100, the formats grid (32/8/128 and 8/1/128, B 1/16/64 x 4k/16k/32k) through the Gluon kernel at 128 / 3
    # (results/bench/nvidia-h100-80gb-hbm3/20261207T093604Z.csv) against 64 / 4 (...093537Z.csv): faster at 16 of 18
    # points, by up to 1.48x (32/8/128, 1 x 4k: 14.5 against 21.4 us; 64 x 32k: 939 against 1045), 0.7 and 2.5 %
    # slower at the other two (8/1/128, B 16 and 1 x 4k, where the Triton kernel runs by default)
    assert ops.gluon_tile(4, 128, 8, 132, packed=True) == ops.gluon_tile(6, 64, 64 * 4, 132, packed=True) == (128, 3)
    assert ops.gluon_tile(8, 256, 64, 132, packed=True) == (128, 2)
    assert gluon_launch(2, cache, 4, block_n=128, num_stages=2)["block_n"] == 128
    with pytest.raises(ValueError, match="block_n=32"):
        gluon_launch(2, cache, 4, block_n=32)
    with pytest.raises(ValueError, match="num_stages=1"):
        gluon_launch(2, cache, 4, num_stages=1)
    with pytest.raises(ValueError, match="num_stages=5"):
        gluon_launch(2, cache, 4, num_stages=5)
    with pytest.raises(TypeError, match="gluon='yes'"):
        paged_decode(make_q(2, 4, 128, torch.float16), cache, gluon="yes")
    assert ops.GLUON_BLOCK_N == (64, 128)


def test_gluon_programs_hold_a_group_in_as_few_programs_as_its_rows_allow():
    """A group larger than a program's MMA rows (32 in a 64-wide tile, 16 in a 128-wide one) is cut into
    programs of equal size, side by side per KV head; heads_per_program asks for smaller programs."""
    from fp8kv import ops
    from fp8kv.ops.decode.gluon_scope import mma_rows

    assert (ops.gluon_max_heads(64), ops.gluon_max_heads(48), ops.gluon_max_heads(80), ops.gluon_max_heads(128),
            ops.gluon_max_heads(144), ops.gluon_max_heads(256)) == (32, 32, 16, 16, 16, 16)
    cases = {(71, 64, None): (24, 3), (71, 64, 16): (15, 5), (48, 128, None): (16, 3), (20, 64, None): (20, 1),
             (20, 96, None): (10, 2), (7, 64, None): (7, 1), (1, 128, None): (1, 1), (20, 256, None): (10, 2),
             (8, 256, None): (8, 1)}
    for (group, d, hpp), (heads, tiles) in cases.items():
        cfg = ops.gluon_launch(2, matrix_cache([5, 300], 1, d), group, heads_per_program=hpp)
        assert (cfg["heads_per_program"], cfg["head_tiles"]) == (heads, tiles), (group, d, hpp)
        assert heads * tiles >= group > heads * (tiles - 1)
        assert mma_rows(heads) == (16 if heads <= 16 else 32)


def _gluon_matches_oracle_and_twin(kv_dtype, q_dtype, hq, hkv, d, launch, layout="NHD", granularity="tensor"):
    """Run the Gluon kernel at ragged lengths (1 token, a partial page, a partial tile, 16k) and check it
    against the fp32 oracle (the dequant tolerance) and the Triton kernel it twins (2u); returns the
    cache and query for further checks."""
    cache = matrix_cache([1, 17, 5003, 16379], hkv, d, kv_dtype=kv_dtype, layout=layout, granularity=granularity)
    q = make_q(4, hq, d, q_dtype)
    out, lse = paged_decode(q, cache, gluon=True, **launch)
    ref_o, ref_l = ref_decode(q, cache)
    assert relative_error(out.float(), ref_o) <= dequant_tol(q_dtype, granularity)
    assert float((lse - ref_l).abs().max()) <= lse_tolerance("triton", "dequant", q_dtype, ref_l)
    twin_o, _ = paged_decode(q, cache, gluon=False)
    assert relative_error(out.float(), twin_o.float()) <= 2 * unit_roundoff(q_dtype)
    return cache, q


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype,q_dtype", [("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.float16)])
@pytest.mark.parametrize("hq,hkv,d", [(8, 8, 128), (32, 8, 128), (28, 4, 128), (32, 2, 128), (12, 4, 64),
                                      (7, 1, 64), (16, 2, 96), (4, 4, 80), (40, 8, 112), (6, 2, 48),
                                      (71, 1, 64), (48, 1, 128), (40, 2, 64), (20, 1, 96), (8, 1, 256), (4, 4, 256),
                                      (32, 8, 256), (12, 4, 192), (6, 2, 144)])
@pytest.mark.parametrize("launch", [{}, {"block_n": 128, "num_stages": 3}, {"num_stages": 2, "num_splits": 1},
                                    {"heads_per_program": 5}])
def test_gluon_kernel_matches_the_oracle_and_its_twin_on_the_gpu(kv_dtype, q_dtype, hq, hkv, d, launch):
    """The compiled Gluon kernel against the fp32 oracle (the dequant tolerance, 2u) and against the
    Triton kernel it twins, at ragged lengths (1 token, a partial page, a partial tile, 16k), MHA to
    a group of 71 (16 or 32 MMA rows, groups cut into several programs per KV head, the last one
    partial), head dims 48 to 256 (those below the tile width zero-filled; above 128 in two parts)."""
    cache, q = _gluon_matches_oracle_and_twin(kv_dtype, q_dtype, hq, hkv, d, launch)
    if not launch:  # long splits run the Gluon kernel by default, where the group fits one program
        one_program = hq // hkv <= fp8kv.ops.gluon_max_heads(d)
        kernel = fp8kv.ops.decode_launch(4, cache, "dequant", d, hq // hkv, q.device, num_splits=1)[0]
        assert kernel == ("gluon" if one_program else "triton")
        if one_program:
            assert torch.equal(paged_decode(q, cache, num_splits=1)[0],
                               paged_decode(q, cache, gluon=True, num_splits=1)[0])


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype,q_dtype", [("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.float16)])
@pytest.mark.parametrize("hq,hkv,d", [(8, 1, 256), (40, 2, 256), (12, 4, 192)])
@pytest.mark.parametrize("launch", [{"block_n": 64, "num_stages": 3}, {"block_n": 64, "num_stages": 2, "heads_per_program": 5}])
def test_gluon_wide_heads_in_64_token_tiles_and_several_programs_on_the_gpu(kv_dtype, q_dtype, hq, hkv, d, launch):
    """Heads above 128 columns in 64-token tiles (the default where 128-token rings do not fit: 99 KiB
    GPUs), and with several KV heads, several head tiles and both parts at once (40/2/256 in programs
    of 5 heads: program ids split three ways), against the oracle and the Triton twin."""
    _gluon_matches_oracle_and_twin(kv_dtype, q_dtype, hq, hkv, d, launch)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d", [(32, 32, 80), (16, 2, 96), (32, 8, 128), (71, 1, 64), (8, 1, 256)])
@pytest.mark.parametrize("launch", [{}, {"block_n": 128, "num_stages": 3}, {"heads_per_program": 5}])
def test_gluon_kernel_reads_hnd_pages_on_the_gpu(hq, hkv, d, launch):
    """HND pages ([blocks, Hkv, block_size, D]: a head's rows of a page contiguous) through the same kernel,
    its token and head strides swapped, against the oracle and the Triton twin."""
    _gluon_matches_oracle_and_twin("fp8_e4m3", torch.bfloat16, hq, hkv, d, launch, layout="HND")


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size,launch", [(8, {}), (32, {}), (128, {}), (128, {"block_n": 128}),
                                               (256, {"block_n": 128})])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_gluon_kernel_reads_every_page_size(block_size, launch, layout):
    """Pages smaller than, equal to and larger than a tile: the row addressing takes two paths (the
    page row loop-invariant, or one scalar per tile), on either page layout."""
    cache = matrix_cache([1, 17, 5003, 1000], 4, 128, block_size=block_size, layout=layout)
    q = make_q(4, 16, 128, torch.bfloat16)
    out, lse = paged_decode(q, cache, gluon=True, **launch)
    ref_o, ref_l = ref_decode(q, cache)
    assert relative_error(out.float(), ref_o) <= dequant_tol(torch.bfloat16, "tensor")
    assert float((lse - ref_l).abs().max()) <= lse_tolerance("triton", "dequant", torch.bfloat16, ref_l)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype,q_dtype", [("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.float16)])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (12, 4, 64), (16, 2, 96), (71, 1, 64), (8, 1, 256)])
@pytest.mark.parametrize("launch,layout", [({}, "NHD"), ({"block_n": 128, "num_stages": 3}, "HND"),
                                           ({"num_stages": 2, "num_splits": 1}, "NHD"), ({"heads_per_program": 5}, "NHD")])
def test_gluon_kernel_reads_token_head_scales_on_the_gpu(kv_dtype, q_dtype, hq, hkv, d, launch, layout):
    """One scale per token and KV head (K's on the score columns, V's on the probabilities, the accumulator in
    units of the largest V scale a warp has seen), against the oracle and the Triton twin; the default kernel where
    the group fits one program."""
    cache, q = _gluon_matches_oracle_and_twin(kv_dtype, q_dtype, hq, hkv, d, launch, layout, "token_head")
    if not launch and hq // hkv <= fp8kv.ops.gluon_max_heads(d):
        assert fp8kv.ops.decode_launch(4, cache, "dequant", d, hq // hkv, q.device, num_splits=1)[0] == "gluon"


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gluon_token_head_scales_spanning_six_decades_on_the_gpu(kv_dtype, window, block_size):
    """Token scales from 1e-4 to 1e2 of one another (V rows scaled by 10^u, u uniform in [-4, 2]; K rows too): a
    tile whose largest V scale exceeds every earlier one rescales the accumulator; one sequence whose V rows are all
    ~1e-4 (p * s_v / u would sit among fp16's subnormals without the units u) is checked on its own, as is every
    sequence; pages of 16 and of 128 tokens (larger than the 64-token tiles); against the oracle, with a window too."""
    lens, hkv, hq, d = [3, 129, 4000, 2500], 2, 8, 128
    gen = seeded(7)
    k = torch.randn(len(lens), max(lens), hkv, d, generator=gen)
    v = torch.randn(len(lens), max(lens), hkv, d, generator=gen)
    k = k * 10 ** (torch.rand(len(lens), max(lens), hkv, 1, generator=gen) * 2 - 1)
    v = v * 10 ** (torch.rand(len(lens), max(lens), hkv, 1, generator=gen) * 6 - 4)
    v[3] = v[3] / v[3].abs().amax() * 1e-4  # every value of the last sequence below 1e-4
    cache = PagedKVCache.from_dense(k.to(DEVICE), v.to(DEVICE), lens, kv_dtype=kv_dtype, granularity="token_head",
                                    block_size=block_size)
    q = make_q(len(lens), hq, d, torch.bfloat16)
    tol = dequant_tol(torch.bfloat16, "token_head")
    for launch in ({}, {"num_splits": 1}, {"num_splits": 5, "block_n": 64}):
        out, lse = paged_decode(q, cache, gluon=True, window=window, **launch)
        ref_o, ref_l = ref_decode(q, cache, window=window)
        for b in range(len(lens)):
            assert relative_error(out[b].float(), ref_o[b]) <= tol, (launch, b)
        assert float((lse - ref_l).abs().max()) <= lse_tolerance("triton", "dequant", torch.bfloat16, ref_l)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (14, 2, 64), (8, 1, 256)])
@pytest.mark.parametrize("block_size,layout", [(16, "NHD"), (128, "HND")])
@pytest.mark.parametrize("window", [1, 63, 64, 65, 700, 4999])
def test_gluon_kernel_takes_a_sliding_window_on_the_gpu(hq, hkv, d, block_size, layout, window):
    """A window starting anywhere in a tile (its splits tile it from the whole tile below it): against the oracle,
    at lengths shorter than, around and far beyond it, pages smaller and larger than a tile."""
    cache = matrix_cache([1, 64, 700, 5003, 16000], hkv, d, block_size=block_size, layout=layout)
    q = make_q(5, hq, d, torch.bfloat16)
    for launch in ({}, {"num_splits": 1}):
        out, lse = paged_decode(q, cache, gluon=True, window=window, **launch)
        ref_o, ref_l = ref_decode(q, cache, window=window)
        assert relative_error(out.float(), ref_o) <= dequant_tol(torch.bfloat16, "tensor"), launch
        assert float((lse - ref_l).abs().max()) <= lse_tolerance("triton", "dequant", torch.bfloat16, ref_l)


@pytest.mark.parametrize("kw, exc, words", [(dict(batch=0), ValueError, "batch=0"), (dict(batch=1.5), TypeError, "batch=1.5"),
                                            (dict(mode="bogus"), ValueError, "mode='bogus'"),
                                            (dict(use_tensor_cores="no"), TypeError, "use_tensor_cores='no'"),
                                            (dict(window=0), ValueError, "window=0"),
                                            (dict(window=2.5), TypeError, "window=2.5"),
                                            (dict(num_stages=10**9), ValueError, "num_stages=1000000000"),
                                            (dict(cache=None), TypeError, "cache must be a fp8kv.PagedKVCache")])
def test_launch_config_called_directly_refuses_bad_arguments_by_name(kw, exc, words):
    """It is public (the bench and notebooks plan with it): no ZeroDivisionError, no float token counts."""
    from fp8kv.ops import launch_config

    args = dict(batch=2, cache=matrix_cache([40, 5], 2, 16))
    args.update(kw)
    with pytest.raises(exc, match=re.escape(words)):
        launch_config(args.pop("batch"), args.pop("cache"), num_sms=132, **args)


def test_a_plan_run_on_other_inputs_is_refused_by_name():
    """fp8kv.ops.run checks (metadata only, no host sync) that q and the cache are what the plan was made for."""
    from fp8kv import ops

    cache = matrix_cache([5, 9], 2, 64, kv_dtype="fp8_e4m3", granularity="tensor")
    q = make_q(2, 8, 64, torch.float16)
    plan = ops.plan(q, cache)
    ops.run(plan, q.clone(), cache.clone())  # the same shapes: fine
    with pytest.raises(ValueError, match=r"q's shape is \(1, 8, 64\), but the plan was made for \(2, 8, 64\)"):
        ops.run(plan, q[:1], cache)
    wide = torch.zeros(2, 8, 128, dtype=q.dtype, device=q.device)
    wide[..., ::2] = q  # the same values, head_dim strided: read as if contiguous they were other numbers
    with pytest.raises(ValueError, match="q's head_dim contiguous is False, but the plan was made for True"):
        ops.run(plan, wide[..., ::2], cache)
    other = matrix_cache([5, 9], 2, 64, kv_dtype="fp8_e5m2", granularity="tensor")
    with pytest.raises(ValueError, match=r"the cache's format is \('fp8_e5m2', 'tensor', 'NHD'\)"):
        ops.run(plan, q, other)


@pytest.mark.parametrize("q_shape,kw,exc,match", [
    ((2, 4, 32), {}, ValueError, "q has head_dim 32 but the cache has head_dim 64"),  # a process crash before
    ((300, 4, 64), {}, ValueError, "q has batch 300 but the cache holds 2 sequences"),  # read seq_lens past its end
    ((2, 3, 64), {}, ValueError, "q has 3 heads, not a multiple of the cache's 2 KV heads"),
    ((2, 4, 64), dict(sm_scale=float("nan")), ValueError, "sm_scale=nan"),
    ((2, 4, 64), dict(sm_scale=0), ValueError, "sm_scale=0"),
    ((2, 4, 64), dict(sm_scale=True), TypeError, "sm_scale=True"),
    ((2, 4, 64), dict(soft_cap=0.0), ValueError, "soft_cap=0.0"),  # a ZeroDivisionError in the launcher before
    ((2, 4, 64), dict(sinks=torch.zeros(2)), ValueError, r"sinks has shape \(2,\); expected \[4\]"),  # read past [2]
    ((2, 4, 64), dict(sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor"),
    ((2, 4, 64), dict(mode="x"), ValueError, "mode='x'"),
])
def test_the_op_entry_checks_shapes_and_scalars_without_a_sync(q_shape, kw, exc, match):
    """fp8kv.ops.paged_decode, the decode without fp8kv.decode's checks of the contents, still checks what costs no
    host sync: a mismatched query crashed the process or returned plausible numbers read past the cache's tables."""
    cache = matrix_cache([20, 7], 2, 64)
    with pytest.raises(exc, match=match):
        paged_decode(make_q(*q_shape, torch.float16), cache, **kw)
    with pytest.raises(TypeError, match="cache must be a fp8kv.PagedKVCache, got NoneType"):
        paged_decode(make_q(2, 4, 64, torch.float16), None)
