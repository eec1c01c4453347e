"""Speculative verification on the Gluon decode kernel (``fp8kv.ops.decode.plan_rows``): with as many new tokens in
every sequence, ``fp8kv.attend`` runs a KV head's (token, head) rows in the decode kernel's programs, each row masked
causally at its own token, so that every K/V tile is read once for all the drafts.

On a CPU (no Gluon there) the choice of kernel, the refusals and the launch's arguments are checked, the kernel
replaced by a stand-in that checks its call; the kernel itself builds for sm90 here (tests/test_gluon_build.py) and
answers what the oracle answers on a GPU (below)."""

from __future__ import annotations

import re

import pytest
import torch
from fixtures import DEVICE, gluon_stand_in, indptr, make_q, matrix_cache

import fp8kv
from fp8kv import backends, ops
from fp8kv.cache import PagedKVCache
from fp8kv.cache.quantized import QuantizedPagedKVCache
from fp8kv.capability import UnsupportedError
from fp8kv.quant import relative_error
from fp8kv.reference import lse_tolerance, output_tolerance

pytest.importorskip("triton")
from fp8kv.ops.attend import AttendPlan  # noqa: E402
from fp8kv.ops.decode import DecodePlan, plan_rows  # noqa: E402
from fp8kv.ops.decode.planning import MAX_ROW_TILES  # noqa: E402

ON_GPU = DEVICE == "cuda"


def _plan(q, cache, qo_lens, **launch):
    return backends.planned_attend(q, cache, indptr(qo_lens), "triton", **launch).args[0]


# ------------------------------------------------------------------------------------ which kernel runs
def test_ragged_counts_and_attend_kernel_options_run_the_attend_kernel():
    cache = matrix_cache([40, 30], 2, 64)
    assert isinstance(_plan(make_q(5, 4, 64), cache, [3, 2]), AttendPlan)  # ragged: not the rows' kernel
    assert isinstance(_plan(make_q(6, 4, 64), cache, [3, 3], block_m=16), AttendPlan)
    assert isinstance(_plan(make_q(6, 4, 64), cache, [3, 3], gluon=False), AttendPlan)


@pytest.mark.skipif(ON_GPU, reason="the refusal of a machine without a GPU")
def test_without_a_gpu_the_rows_run_the_attend_kernel_and_gluon_true_says_why():
    cache = matrix_cache([40, 30], 2, 64)
    q = make_q(6, 4, 64)
    assert isinstance(_plan(q, cache, [3, 3]), AttendPlan)
    assert plan_rows(q, cache, 3) == "Gluon kernels run on a CUDA GPU only (not under the Triton interpreter)"
    with pytest.raises(UnsupportedError, match="gluon=True: Gluon kernels run on a CUDA GPU only"):
        fp8kv.attend(q, cache, indptr([3, 3]), "triton", gluon=True)


@pytest.mark.parametrize("qo_lens,launch,pattern", [
    ([3, 2], {}, "gluon=True: the Gluon kernel takes as many new tokens in every sequence"),
    ([3, 3], {"block_n": 32}, r"and no launch option of the attend kernel \('num_splits'"),
])
def test_gluon_true_outside_the_rows_kernel_is_refused_by_name(qo_lens, launch, pattern):
    cache = matrix_cache([40, 30], 2, 64)
    with pytest.raises(UnsupportedError, match=pattern):
        fp8kv.attend(make_q(sum(qo_lens), 4, 64), cache, indptr(qo_lens), "triton", gluon=True, **launch)


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_a_gluon_choice_that_is_not_a_bool_is_refused_by_name(value):
    cache = matrix_cache([40, 30], 2, 64)
    with pytest.raises(TypeError, match=rf"gluon={value!r}; expected None \(the faster kernel that runs\), True or "
                                        "False"):
        fp8kv.attend(make_q(6, 4, 64), cache, indptr([3, 3]), "triton", gluon=value)


def _on_a_gpu(monkeypatch):
    """Planning as on a GPU where the Gluon kernel runs (its refusal of this machine taken away)."""
    monkeypatch.setattr(ops.decode.planning, "gluon_refusal", lambda *a, **k: None)


@pytest.mark.parametrize("hq,hkv,d,qo_len,tiles", [(32, 8, 128, 8, 2), (40, 8, 128, 4, 2), (40, 8, 128, 8, 3),
                                                  (4, 2, 64, 16, 1), (16, 1, 128, 5, 5)])
def test_a_kv_heads_rows_are_cut_into_programs_as_a_group_is(monkeypatch, hq, hkv, d, qo_len, tiles):
    """group x qo_len rows per KV head, in programs of at most gluon_max_heads rows (16 at head_dim 128 and in two
    parts of 256, 32 at 64), balanced; more than MAX_ROW_TILES programs is a chunk: refused, with the count."""
    _on_a_gpu(monkeypatch)
    cache = matrix_cache([300, 2000], hkv, d)
    q = make_q(2 * qo_len, hq, d)
    plan = plan_rows(q, cache, qo_len, gluon=True)
    rows = hq // hkv * qo_len
    if tiles > MAX_ROW_TILES:
        assert plan == (f"qo_len={qo_len}: {hq // hkv} x {qo_len} rows per KV head would take {tiles} Gluon programs "
                        f"(at most {MAX_ROW_TILES}, of {ops.gluon_max_heads(d)} rows each at head_dim {d})")
        return
    assert isinstance(plan, DecodePlan) and plan.kernel == "gluon" and plan.qo_len == qo_len
    assert plan.config["head_tiles"] == tiles and plan.config["heads_per_program"] == -(-rows // tiles)
    assert (plan.launch["QO"], plan.launch["GROUP"], plan.launch["HEADS"]) == (qo_len, hq // hkv, -(-rows // tiles))


def test_short_splits_refuse_the_rows_kernel_unless_asked_for(monkeypatch):
    """A launch whose splits hold fewer than GLUON_MIN_ROW_SPLIT_TOKENS tokens (512: half the decode's bound, since the
    rows' alternative is the multi-token kernel) is latency-bound; at 512 and more the rows run."""
    _on_a_gpu(monkeypatch)
    cache = matrix_cache([300, 200], 2, 64)
    q = make_q(8, 4, 64)
    why = plan_rows(q, cache, 4)
    assert isinstance(why, str) and why.startswith("splits of ") and "fewer than 512" in why
    assert isinstance(plan_rows(q, cache, 4, gluon=True), DecodePlan)
    assert plan_rows(q, cache, 4, gluon=False) == "gluon=False: the Triton kernels"
    # 16 sequences of 4k with 2 drafts, 32/8/128 (6 splits of 704 tokens on 132 SMs): the rows, where the decode's bound
    # would refuse them
    monkeypatch.setattr(ops.decode.splits, "sm_count", lambda device: 132)  # an H100's or H200's
    long = PagedKVCache.empty(16, 4096 + 2, 8, 128, kv_dtype="fp8_e4m3")
    plan = plan_rows(make_q(32, 32, 128, torch.bfloat16), long, 2)
    assert isinstance(plan, DecodePlan), plan
    assert ops.GLUON_MIN_ROW_SPLIT_TOKENS[1] <= plan.config["tokens_per_split"] < ops.GLUON_MIN_SPLIT_TOKENS[1]


@pytest.mark.parametrize("options,pattern", [({"convert": "cast"}, r"the Gluon kernel takes no \['convert'\]"),
                                             ({"soft_cap": 30.0}, r"the Gluon kernel takes no \['soft_cap'\]")])
def test_options_the_gluon_kernel_does_not_take_are_a_refusal(options, pattern):
    cache = matrix_cache([300, 200], 2, 64)
    assert re.fullmatch(pattern, plan_rows(make_q(8, 4, 64), cache, 4, **options))  # before the machine's refusal


def test_no_new_tokens_and_one_each_take_their_own_paths(monkeypatch):
    """Counts of 0 everywhere are the attend kernel's (it launches nothing); 1 everywhere is the decode's plan, which
    gluon=True asks of the Gluon decode (planned as on a GPU where it runs); plan_rows refuses a count of 0 by
    name."""
    _on_a_gpu(monkeypatch)
    cache = matrix_cache([40, 30], 2, 64)
    assert isinstance(_plan(make_q(0, 4, 64), cache, [0, 0]), AttendPlan)
    out, lse = fp8kv.attend(make_q(0, 4, 64), cache, indptr([0, 0]), "triton")
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    plan = _plan(make_q(2, 4, 64), cache, [1, 1], gluon=True)
    assert isinstance(plan, DecodePlan) and plan.kernel == "gluon" and plan.qo_len == 1
    with pytest.raises(ValueError, match="qo_len=0"):
        plan_rows(make_q(0, 4, 64), cache, 0)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_rows_launch_passes_the_kernel_every_argument(monkeypatch, layout):
    """What the rows' launch hands the kernel: the [B qo_len, Hq, D] query and partials, the grid of the sequences
    (not the query rows), QO; then the combine merges partials of every (token, head) row."""
    gluon_kernel = pytest.importorskip("fp8kv.ops.decode.gluon_kernel")  # the stand-in replaces its kernel
    seen = {}

    def check(grid, named, constants):
        assert named["q_ptr"] is q and named["part_out_ptr"].shape[:2] == (3 * 4, 8) and named["window"] == 0
        named["part_out_ptr"].fill_(1.0)
        named["part_lse_ptr"].zero_()
        seen.update(grid=grid, **constants)

    monkeypatch.setattr(gluon_kernel, "gluon_decode_kernel", gluon_stand_in(check))
    _on_a_gpu(monkeypatch)
    cache = matrix_cache([40, 300, 2000], 2, 128, layout=layout)
    q = make_q(3 * 4, 8, 128)
    plan = plan_rows(q, cache, 4, gluon=True)
    out, lse = ops.decode.run(plan, q, cache)
    cfg = plan.config
    assert seen["grid"] == (2 * cfg["head_tiles"], 3, cfg["num_splits"])  # KV heads x row tiles, sequences, splits
    assert (seen["QO"], seen["GROUP"], seen["HEADS"], seen["ROWS"]) == (4, 4, 16, 16)
    assert out.shape == (12, 8, 128) and torch.equal(out, torch.ones_like(out))  # every row combined
    assert lse.shape == (12, 8)


@pytest.mark.parametrize("qo_len,window,expect", [(1, 100, 100), (4, 100, 100), (1, 5000, None), (4, None, None),
                                                  (1, 1990, 1990), (4, 1990, 1990)])
def test_a_window_reaches_the_kernel_and_its_splits_cover_it(monkeypatch, qo_len, window, expect):
    """The window is a runtime argument with WINDOWED compiled in, its splits cover window + qo_len - 1 + block_n - 1
    tokens from its first tile, or the page table where that is as long (a window of 1990 in 2000 tokens' pages);
    one at least as long as the page table (5000) is no window."""
    pytest.importorskip("fp8kv.ops.decode.gluon_kernel")
    from fp8kv.ops.decode import gluon_kernel

    seen = {}

    def check(grid, named, constants):
        named["part_out_ptr"].zero_()
        named["part_lse_ptr"].fill_(float("-inf"))
        seen.update(window=named["window"], grid=grid, **constants)

    monkeypatch.setattr(gluon_kernel, "gluon_decode_kernel", gluon_stand_in(check))
    _on_a_gpu(monkeypatch)
    cache = matrix_cache([300, 2000], 2, 128)
    q = make_q(2 * qo_len, 8, 128)
    plan = plan_rows(q, cache, qo_len, gluon=True, window=window) if qo_len > 1 else \
        ops.plan(q, cache, gluon=True, window=window)
    ops.decode.run(plan, q, cache)
    assert plan.window == expect and seen["WINDOWED"] == (expect is not None) and seen["window"] == (expect or 0)
    cfg = plan.config
    capacity = cache.max_blocks_per_seq * cache.block_size
    span = capacity if expect is None else min(expect + qo_len - 1 + cfg["block_n"] - 1, capacity)
    assert cfg["num_splits"] * cfg["tokens_per_split"] >= span > (cfg["num_splits"] - 1) * cfg["tokens_per_split"]


def test_a_launch_run_on_other_pages_than_planned_is_refused(monkeypatch):
    """Constants planned for one tensor-wide scale would read a token-head cache's first scale as the tensor's, and FP8
    constants would read INT8 codes as e4m3: run_gluon refuses both by name, before anything launches."""
    _on_a_gpu(monkeypatch)
    from fp8kv.ops.decode.gluon_launcher import run_gluon

    tensor = matrix_cache([300, 2000], 2, 128)
    token = matrix_cache([300, 2000], 2, 128, granularity="token_head")
    q = make_q(2, 8, 128)
    plan = ops.plan(q, tensor, gluon=True)
    with pytest.raises(ValueError, match="TOKEN_SCALES=False, but this cache holds fp8_e4m3 codes with per-token"):
        run_gluon(q, token, plan.config, plan.launch, plan.sm_scale, plan.out_dtype)
    int8 = QuantizedPagedKVCache.from_dense("int8_token_head", torch.randn(2, 2000, 2, 128), torch.randn(2, 2000, 2, 128),
                                            [300, 2000])
    plan = ops.plan(q, token, gluon=True)
    with pytest.raises(ValueError, match="but this cache holds int8 codes with per-token scales"):
        run_gluon(q, int8, plan.config, plan.launch, plan.sm_scale, plan.out_dtype)


def test_the_gluon_kernel_reads_token_head_scales_and_refuses_what_it_cannot_read():
    """codes_refusal: per-token scales are read (the machine's refusal is all that is left on a CPU), per-channel ones
    are not, and K and V scales laid out differently are refused, not read with K's strides."""
    token = matrix_cache([40, 30], 2, 64, granularity="token_head")
    assert ops.decode.planning.codes_refusal(token) is None
    assert ops.gluon_refusal(token, "dequant", 64, 2, "cpu").startswith("Gluon kernels run on a CUDA GPU only")
    channel = matrix_cache([40, 30], 2, 64, granularity="channel")
    assert "granularity='channel'" in ops.decode.planning.codes_refusal(channel)
    token.v_scale = token.v_scale.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, other strides
    assert "the Gluon kernel reads both with one set" in ops.decode.planning.codes_refusal(token)
    int4 = QuantizedPagedKVCache.from_dense("int4_token_head", torch.randn(1, 40, 2, 64), torch.randn(1, 40, 2, 64), [40])
    assert ops.decode.planning.codes_refusal(int4) is None
    int4 = QuantizedPagedKVCache.from_dense("int4_token_head", torch.randn(1, 40, 2, 48), torch.randn(1, 40, 2, 48), [40])
    assert ops.decode.planning.codes_refusal(int4).startswith("head_dim=48: the Gluon kernel reads int4_token_head")
    nvfp4 = QuantizedPagedKVCache.from_dense("nvfp4", torch.randn(1, 40, 2, 64), torch.randn(1, 40, 2, 64), [40])
    assert "nvfp4: of the quantized formats the Gluon kernel reads 'int8_token_head' and 'int4_token_head'" == \
        ops.decode.planning.codes_refusal(nvfp4)


def test_a_launch_run_with_another_window_than_planned_is_refused(monkeypatch):
    _on_a_gpu(monkeypatch)
    from fp8kv.ops.decode.gluon_launcher import run_gluon

    cache = matrix_cache([300, 2000], 2, 128)
    q = make_q(2, 8, 128)
    plan = ops.plan(q, cache, gluon=True, window=100)
    with pytest.raises(ValueError, match="window=None but the launch was planned with WINDOWED=True"):
        run_gluon(q, cache, plan.config, plan.launch, plan.sm_scale, plan.out_dtype, None)


# ------------------------------------------------------------------------------------------ GPU only
# (Hq, Hkv, D, qo_len, page): the target layout and real ones, groups that fill 16 rows, a group cut into programs,
# two parts of 128 columns, a 64-wide tile, pages larger than a tile
GPU_CASES = [(32, 8, 128, 4, 16), (32, 8, 128, 8, 16), (32, 8, 128, 2, 128), (40, 8, 128, 3, 16), (40, 8, 128, 6, 32),
             (8, 1, 256, 2, 16), (8, 1, 256, 4, 64), (14, 2, 64, 4, 16), (32, 32, 128, 8, 16), (16, 16, 80, 6, 16)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d,qo_len,page", GPU_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("kv_dtype,layout", [("fp8_e4m3", "NHD"), ("fp8_e5m2", "HND")])
def test_the_rows_kernel_matches_the_oracle(hq, hkv, d, qo_len, page, kv_dtype, layout):
    """Lengths around split and tile boundaries, one sequence of only new tokens, pages smaller and larger than a tile,
    bf16 queries; the attend kernel beside it (a split that starts past some rows' causal end: below)."""
    lens = [3075, 2050, qo_len, 1025, 4097, 513 + qo_len]
    cache = matrix_cache(lens, hkv, d, kv_dtype=kv_dtype, block_size=page, layout=layout)
    qo_lens = [qo_len] * len(lens)
    q = make_q(sum(qo_lens), hq, d, torch.bfloat16, seed=qo_len)
    plan = _plan(q, cache, qo_lens, gluon=True)
    assert isinstance(plan, DecodePlan) and plan.qo_len == qo_len
    ref_out, ref_lse = fp8kv.reference.attend(q, cache, indptr(qo_lens), return_lse=True)
    tol = output_tolerance("triton", "dequant", q.dtype, "tensor")
    for gluon in (True, False):
        out, lse = fp8kv.attend(q, cache, indptr(qo_lens), "triton", gluon=gluon)
        err = relative_error(out.float(), ref_out)
        assert err <= tol, f"gluon={gluon}: {err:.3e} > {tol:.3e}"
        assert float((lse - ref_lse).abs().max()) <= lse_tolerance("triton", "dequant", q.dtype, ref_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d,qo_len,page", [GPU_CASES[i] for i in (0, 4, 5, 7)], ids=lambda x: str(x))
@pytest.mark.parametrize("kv_dtype,layout", [("fp8_e4m3", "NHD"), ("fp8_e5m2", "HND")])
def test_the_rows_kernel_reads_token_head_scales(hq, hkv, d, qo_len, page, kv_dtype, layout):
    """One scale per token and KV head under the rows too, against the oracle, the attend kernel beside it."""
    lens = [3075, qo_len, 1025, 513 + qo_len]
    cache = matrix_cache(lens, hkv, d, kv_dtype=kv_dtype, block_size=page, layout=layout, granularity="token_head")
    qo_lens = [qo_len] * len(lens)
    q = make_q(sum(qo_lens), hq, d, torch.bfloat16, seed=qo_len)
    assert isinstance(_plan(q, cache, qo_lens, gluon=True), DecodePlan)
    ref_out, ref_lse = fp8kv.reference.attend(q, cache, indptr(qo_lens), return_lse=True)
    for gluon in (True, False):
        out, lse = fp8kv.attend(q, cache, indptr(qo_lens), "triton", gluon=gluon)
        err = relative_error(out.float(), ref_out)
        assert err <= output_tolerance("triton", "dequant", q.dtype, "token_head"), f"gluon={gluon}: {err:.3e}"
        assert float((lse - ref_lse).abs().max()) <= lse_tolerance("triton", "dequant", q.dtype, ref_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d,qo_len", [(32, 8, 128, 4), (40, 8, 128, 6), (8, 1, 256, 3)])
@pytest.mark.parametrize("window", [1, 2, 63, 700])
def test_the_rows_kernel_takes_a_sliding_window(hq, hkv, d, qo_len, window):
    """Each row's window counted back from its own token (a window of 1: each draft sees itself only)."""
    lens = [3075, qo_len, 700 + qo_len, 64 + qo_len]
    cache = matrix_cache(lens, hkv, d)
    qo_lens = [qo_len] * len(lens)
    q = make_q(sum(qo_lens), hq, d, torch.bfloat16, seed=window)
    assert isinstance(_plan(q, cache, qo_lens, gluon=True, window=window), DecodePlan)
    out, lse = fp8kv.attend(q, cache, indptr(qo_lens), "triton", gluon=True, window=window)
    ref_out, ref_lse = fp8kv.reference.attend(q, cache, indptr(qo_lens), return_lse=True, window=window)
    assert relative_error(out.float(), ref_out) <= output_tolerance("triton", "dequant", q.dtype, "tensor")
    assert float((lse - ref_lse).abs().max()) <= lse_tolerance("triton", "dequant", q.dtype, ref_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("hq,hkv,d,qo_len", [(32, 8, 128, 8), (40, 8, 128, 4), (8, 1, 256, 4)])
def test_rows_with_no_key_in_a_split_are_left_out_of_the_combine(hq, hkv, d, qo_len):
    """Four splits forced; sequences ending 1 .. qo_len - 1 tokens into a split: there the rows of the earlier new
    tokens see no key (lse -inf, weight 0 in the combine)."""
    from fp8kv.ops.decode.gluon_launcher import gluon_launch, launch_constants, run_gluon

    longest = 4097
    probe = matrix_cache([longest], hkv, d)
    group = hq // hkv
    cfg = gluon_launch(4, probe, group, qo_len=qo_len, num_splits=4)
    tps = cfg["tokens_per_split"]
    lens = [longest, tps + 1, 2 * tps + qo_len - 1, qo_len]  # the last split of the first three starts past some rows
    assert all((n - 1) % tps < qo_len - 1 for n in lens[1:3]) and cfg["num_splits"] == 4
    cache = matrix_cache(lens, hkv, d)
    assert cache.max_blocks_per_seq == probe.max_blocks_per_seq  # the same capacity: the same splits
    q = make_q(4 * qo_len, hq, d, torch.bfloat16, seed=3)
    sm_scale = d ** -0.5
    out, lse = run_gluon(q, cache, cfg, launch_constants(cfg, group, cache, qo_len), sm_scale,
                         torch.bfloat16)
    ref_out, ref_lse = fp8kv.reference.attend(q, cache, indptr([qo_len] * 4), return_lse=True)
    assert relative_error(out.float(), ref_out) <= output_tolerance("triton", "dequant", q.dtype, "tensor")
    assert float((lse - ref_lse).abs().max()) <= lse_tolerance("triton", "dequant", q.dtype, ref_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_the_rows_kernel_is_the_default_where_its_splits_are_long_and_replays_in_a_graph():
    cache = matrix_cache([16384] * 16, 8, 128)
    q = make_q(16 * 4, 32, 128, torch.bfloat16)
    call = backends.planned_attend(q, cache, indptr([4] * 16), "triton")
    assert isinstance(call.args[0], DecodePlan) and call.args[0].qo_len == 4
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = call()
    q.copy_(make_q(16 * 4, 32, 128, torch.bfloat16, seed=5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8kv.attend(q, cache, indptr([4] * 16), "triton")[0])
