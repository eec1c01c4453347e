"""The Gluon decode kernel compiled for sm90 on this machine (no GPU needed: Triton's bundled ptxas assembles
it, fp8kv.ops.decode.gluon_build): the H200's tiles build with the Triton installed here without spilling, within the
shared memory that fp8kv.ops reserves for them (what decides whether a ring fits a smaller GPU). Its numbers
are tested on a GPU (tests/test_ops.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fp8kv import ops

gluon_kernel = pytest.importorskip("fp8kv.ops.decode.gluon_kernel")  # a Triton with the Gluon dialect

H200_SMS = 132
# (Hq, Hkv, D, B): the Gluon launch gluon_launch plans for a layout at B sequences of 16k tokens on an H200 (tile,
# ring depth, splits; decode_launch runs it by default there, except 71/1/64, cut into programs: gluon=True)
LAUNCHES = [(32, 8, 128, 64),  # 64-token tiles, 4 deep, 16 rows
            (32, 32, 128, 64),  # MHA whose sequences fill 8 waves: 128-token tiles, 3 deep
            (12, 4, 64, 64),  # a 64-wide tile, 3 deep
            (71, 1, 64, 64),  # a group cut into 3 programs of 24 heads in 32 rows
            (32, 32, 80, 4),  # a padded head dim, 64-token tiles
            (8, 1, 256, 64),  # two parts of 128 columns, 128-token tiles 2 deep
            (16, 16, 256, 64),  # the same at a group of one, one split (Triton 3.6: 254 registers)
            (40, 8, 128, 64)]  # a group of 5 in 16 rows
# (Hq, Hkv, D, B, qo_len): speculative verification's (token, head) rows (fp8kv.ops.decode.plan_rows): 16 rows in one
# program, 32 in two, a group of 5 in two programs of 10 rows, two parts of 128 columns in two programs
ROW_LAUNCHES = [(32, 8, 128, 64, 4), (32, 8, 128, 64, 8), (40, 8, 128, 64, 4), (8, 1, 256, 64, 4)]
# (Hq, Hkv, D, B, qo_len, window): sliding windows of 512 tokens, a decode's and the rows'
WINDOW_LAUNCHES = [(32, 16, 128, 64, 1, 512), (32, 8, 128, 64, 4, 512), (8, 1, 256, 64, 1, 512)]
# (Hq, Hkv, D, B, qo_len, window, kv_dtype, granularity): one scale per token and KV head, on FP8 pages and on a
# quantized cache's INT8 and INT4 codes, and the programs an SM then holds (the decode's above: 3, 5 and 2)
SCALE_LAUNCHES = {(32, 8, 128, 64, 1, None, "fp8_e4m3", "token_head"): 3,
                  (32, 8, 128, 64, 1, None, "int8_token_head", "tensor"): 2,
                  (32, 8, 128, 64, 1, None, "int4_token_head", "tensor"): 2,  # its default 128-token tiles
                  (32, 8, 128, 64, 4, None, "fp8_e4m3", "token_head"): 3,
                  (12, 4, 64, 64, 1, None, "int8_token_head", "tensor"): 4,
                  (12, 4, 64, 64, 1, None, "int4_token_head", "tensor"): 4,
                  (8, 1, 256, 64, 1, None, "fp8_e4m3", "token_head"): 2,
                  (8, 1, 256, 64, 1, None, "int4_token_head", "tensor"): 2,
                  (8, 2, 160, 64, 1, None, "int4_token_head", "tensor"): 2}  # a part of 32 columns past the first 128

# Run in a process without the interpreter (build() refuses it): every launch above, one JSON line each.
_BUILD_ALL = r"""
import json, re, sys
from fp8kv.ops.decode.gluon_build import block_table_summary, build, gluon_loop_mix
launches, sms = json.loads(sys.argv[1])
for hq, hkv, d, b, qo_len, window, *pages in launches:
    kv_dtype, granularity = pages or ("fp8_e4m3", "tensor")
    k, cfg = build(hq, hkv, d, batch=b, context=16384, num_sms=sms, qo_len=qo_len, window=window, kv_dtype=kv_dtype,
                   granularity=granularity)
    print(json.dumps(dict(registers=k.registers, spilled_bytes=k.spilled_bytes, shared_bytes=k.shared_bytes,
                          block_n=cfg["block_n"], num_stages=cfg["num_stages"], num_splits=cfg["num_splits"],
                          programs_per_sm=k.programs_per_sm, head_tiles=cfg["head_tiles"],
                          tokens_per_split=cfg["tokens_per_split"], programs_per_head=k.programs_per_head,
                          bytes_per_token=k.bytes_per_token, **{n: x for n, x in gluon_loop_mix(k, cfg).items() if n != "block_n"},
                          **block_table_summary(k.sass),
                          hmma="HMMA.16816.F32" in k.sass, unpack="F2FP.F16.E4M3.UNPACK_B" in k.sass,
                          int8_bits="HADD2" in k.sass and "PRMT" in k.sass and not re.search(r"I2FP?\.F16", k.sass),
                          int4_bits="HFMA2" in k.sass and "LOP3" in k.sass and "PRMT" in k.sass
                          and not re.search(r"I2FP?\.F16", k.sass))),
          flush=True)
"""


def _tile(hq, hkv, d, b):
    return ops.gluon_tile(hq // hkv, d, b * hkv, H200_SMS)


@pytest.fixture(scope="module")
def builds():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    launches = [(*layout, 1, None) for layout in LAUNCHES] + [(*rows, None) for rows in ROW_LAUNCHES] + \
        WINDOW_LAUNCHES + list(SCALE_LAUNCHES)
    done = subprocess.run([sys.executable, "-c", _BUILD_ALL, json.dumps([launches, H200_SMS])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    built = dict(zip(launches, rows, strict=True))
    return {**{layout: built[(*layout, 1, None)] for layout in LAUNCHES},
            **{rows: built[(*rows, None)] for rows in ROW_LAUNCHES}, **{w: built[w] for w in WINDOW_LAUNCHES},
            **{scaled: built[scaled] for scaled in SCALE_LAUNCHES}}


@pytest.mark.parametrize("launch", list(SCALE_LAUNCHES), ids=lambda t: "/".join(map(str, t[:3])) + f"-qo{t[4]}-{t[6]}")
def test_token_scales_and_int8_and_int4_codes_build_without_spills(builds, launch):
    """One scale per token and KV head (copied with the tile into a ring of its own, the accumulator in units of a
    warp's largest V scale) costs no spill; the programs an SM holds are the decode's at 32/8/128 and 8/1/256 with FP8
    codes and INT4 (166-167 and 226-238 registers with Triton 3.9), and in the rows of 4 drafts at 32/8/128, one fewer
    at 12/4/64 and with INT8 codes at 32/8/128 (193 registers: Triton 3.9's allocation; INT8 measured on an H100 with
    Triton 3.6 at 93 % of the copy bandwidth, results/bench/nvidia-h100-80gb-hbm3/20261206T074628Z.csv); INT8 codes become
    fp16 by byte permutes and fp16 subtractions, INT4 codes by a permute, a mask (LOP3) and an fp16 multiply-add or
    subtraction per nibble pair, with no integer-to-float conversion (a quarter-rate instruction); INT4's rings take
    half the shared memory of INT8's."""
    kernel = builds[launch]
    assert kernel["spilled_bytes"] == 0 and kernel["hmma"], kernel
    assert kernel["programs_per_sm"] == SCALE_LAUNCHES[launch]
    bits = {"int8_token_head": "int8_bits", "int4_token_head": "int4_bits"}.get(launch[6], "unpack")
    assert kernel[bits], kernel
    if launch[6] == "int4_token_head":
        int8 = builds.get((*launch[:6], "int8_token_head", "tensor"))
        rings = ops.gluon_smem_bytes(kernel["block_n"], kernel["num_stages"], launch[2], packed=True,
                                     token_scales=True) - ops.GLUON_SMEM_EXTRA
        assert rings < kernel["shared_bytes"] <= rings + ops.GLUON_SMEM_EXTRA
        def per_ring_token(k):  # tiles differ (INT4 defaults to 128 tokens): compare a token of one stage
            return k["shared_bytes"] / (k["block_n"] * k["num_stages"])
        assert int8 is None or per_ring_token(kernel) < per_ring_token(int8)


@pytest.mark.parametrize("launch", WINDOW_LAUNCHES, ids=lambda t: "/".join(map(str, t[:3])) + f"-qo{t[4]}-w{t[5]}")
def test_windowed_launches_build_without_spills_and_split_the_window(builds, launch):
    """A window's splits cover the window from the whole tile below it (window + qo_len - 1 + block_n - 1 tokens),
    not the page table."""
    kernel = builds[launch]
    assert kernel["spilled_bytes"] == 0 and kernel["hmma"] and kernel["unpack"], kernel
    window, qo_len = launch[5], launch[4]
    assert kernel["tokens_per_split"] * kernel["num_splits"] >= window + qo_len - 1 + kernel["block_n"] - 1
    assert kernel["tokens_per_split"] * (kernel["num_splits"] - 1) < window + qo_len - 1 + kernel["block_n"] - 1


@pytest.mark.parametrize("launch", ROW_LAUNCHES, ids=lambda t: "/".join(map(str, t[:3])) + f"-B{t[3]}-qo{t[4]}")
def test_verification_rows_build_as_the_decode_does(builds, launch):
    """The rows' masks and addresses cost no spill and no SM residency against the decode of the same layout, and the
    rows are cut into as few programs as gluon_max_heads allows (plan_rows's count; its limit: tests/test_attend_rows.py)."""
    rows, decode = builds[launch], builds[launch[:4]]
    assert rows["spilled_bytes"] == 0 and rows["hmma"] and rows["unpack"], rows
    hq, hkv, d, _, qo_len = launch
    assert rows["head_tiles"] == -(-hq // hkv * qo_len // ops.gluon_max_heads(d))
    assert rows["programs_per_sm"] == decode["programs_per_sm"] and rows["shared_bytes"] == decode["shared_bytes"]


@pytest.mark.parametrize("layout", LAUNCHES, ids=lambda t: "/".join(map(str, t[:3])) + f"-B{t[3]}")
def test_h200_gluon_launches_build_for_sm90_without_spills(builds, layout):
    kernel = builds[layout]
    block_n, stages = _tile(*layout)
    assert (kernel["block_n"], kernel["num_stages"]) == (block_n, stages)  # the H200's tile and ring depth
    assert kernel["spilled_bytes"] == 0, kernel
    rings = ops.gluon_smem_bytes(block_n, stages, layout[2]) - ops.GLUON_SMEM_EXTRA
    assert rings < kernel["shared_bytes"] <= ops.gluon_smem_bytes(block_n, stages, layout[2])
    assert kernel["hmma"] and kernel["unpack"]  # fp16 tensor-core MMAs over FP8 codes unpacked in registers


def test_h200_gluon_launches_fill_the_waves_their_builds_allow(builds):
    """The programs an SM holds, from each build's registers and shared memory, and the splits planned from them:
    those the H200 ran in results/bench/nvidia-h200/20261204T184750Z-fill-waves.json (8/1/256: 4, 32/8/128: 3)."""
    assert {layout[:3]: builds[layout]["programs_per_sm"] for layout in LAUNCHES} == {
        (32, 8, 128): 3, (32, 32, 128): 2, (12, 4, 64): 5, (71, 1, 64): 3, (32, 32, 80): 3, (8, 1, 256): 2,
        (16, 16, 256): 2, (40, 8, 128): 3}
    assert builds[(8, 1, 256, 64)]["num_splits"] == 4 and builds[(32, 8, 128, 64)]["num_splits"] == 3


@pytest.mark.parametrize("layout", LAUNCHES, ids=lambda t: "/".join(map(str, t[:3])) + f"-B{t[3]}")
def test_no_instruction_waits_for_the_block_table_in_the_tile_that_loads_it(builds, layout):
    """Each tile loads the block-table entries of the tile it copies next. The first instruction that waits
    for them (by the scoreboard in its scheduling bits) must come in the next tile: one that waits in the same
    tile stalls every warp for a global load's latency once a tile (the clamp applied at load time did: 30 %
    of the 32/8/128 kernel's warp samples; at D = 256 the FP8 conversions of the second K tile shared the
    load's scoreboard and waited for it)."""
    kernel = builds[layout]
    assert kernel["loads"] > 0  # the loop was found, and its loads
    assert kernel["never_waited_for"] == 0  # every load's scoreboard is waited on somewhere in the loop
    assert kernel["waited_in_the_loading_tile"] == []


def test_the_build_refuses_an_interpreted_triton():
    from fp8kv.ops.decode.gluon_build import build
    from fp8kv.ops.offline_build import interpreter_replaced_triton

    if not interpreter_replaced_triton():
        pytest.skip("triton was imported without its interpreter here")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        build(32, 8, 128)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_gluon_launch_passes_every_argument_of_the_kernels_signature(monkeypatch, layout):
    """paged_decode's Gluon launch (not runnable on a CPU) hands the kernel its runtime arguments in signature
    order, each stride the one of its tensor and dimension (the pages' token and head dimensions swapped on HND
    pages), and every constexpr by name: a stand-in kernel checks the call, then the combine runs on its
    partials."""
    import torch
    from fixtures import gluon_stand_in, make_cache

    seen = {}

    def check(grid, named, constants):
        token, head = (1, 2) if layout == "NHD" else (2, 1)
        strides = {"stride_kb": ("k_ptr", 0), "stride_kt": ("k_ptr", token), "stride_kh": ("k_ptr", head),
                   "stride_btb": ("bt_ptr", 0)}
        for name, (tensor, dim) in strides.items():
            assert named[name] == named[tensor].stride(dim), name
        assert named["k_ptr"].data_ptr() == cache.k_pages.data_ptr() and named["bt_ptr"] is cache.block_table
        assert named["v_ptr"].data_ptr() == cache.v_pages.data_ptr() and named["seq_lens_ptr"] is cache.seq_lens
        assert named["q_ptr"] is q and named["k_scale_ptr"] is cache.k_scale
        assert named["qk_scale"] == pytest.approx(128 ** -0.5 * 1.4426950408889634)
        assert (named["tokens_per_split"], named["num_blocks"], named["row_capacity"], named["window"]) == (
            cfg["tokens_per_split"], cache.num_blocks, cache.max_blocks_per_seq * cache.block_size, 0)
        named["part_out_ptr"].zero_()
        named["part_lse_ptr"].zero_()
        seen.update(grid=grid, **constants)

    monkeypatch.setattr(gluon_kernel, "gluon_decode_kernel", gluon_stand_in(check))
    monkeypatch.setattr(ops.decode.planning, "gluon_refusal", lambda *a, **k: None)  # as on a GPU where it runs
    cache = make_cache([40, 300], 2, 128, layout=layout)
    q = torch.randn(2, 8, 128, dtype=torch.float16)
    plan = ops.plan(q, cache, gluon=True, num_splits=3)  # three splits: distinct strides
    cfg = plan.config
    assert plan.kernel == "gluon" and cfg == ops.gluon_launch(2, cache, 4, num_splits=3, device=torch.device("cpu"))
    out, lse = ops.run(plan, q, cache)
    assert seen["grid"] == (2 * cfg["head_tiles"], 2, cfg["num_splits"])
    assert (seen["GROUP"], seen["HEAD_DIM"], seen["STAGES"]) == (4, 128, cfg["num_stages"])
    assert out.shape == (2, 8, 128) and out.dtype == torch.float16 and lse.shape == (2, 8)


@pytest.mark.parametrize("args, kw, exc, match", [
    ((5, 2, 64), {}, ValueError, "num_q_heads=5 is not a multiple of num_kv_heads=2"),  # was a silent group of 2
    ((1, 2, 64), {}, ValueError, "num_q_heads=1 is not a multiple of num_kv_heads=2"),
    ((8, 2, 512), {}, ValueError, "head_dim=512: the Gluon kernel takes multiples of 16 from 48 to 256"),
    ((8, 2, 40), {}, ValueError, "head_dim=40: the Gluon kernel takes multiples of 16"),  # was an MLIR pass failure
    ((8, 2, 32), {}, ValueError, "head_dim=32"),
    ((8, 2, 64), dict(q_dtype=torch.float32), TypeError, "q_dtype=torch.float32: the Gluon kernel takes a torch.bfloat16"),
    ((8, 2, 64), dict(q_dtype=torch.float16, kv_dtype="bf16"), ValueError, "kv_dtype=bf16: the Gluon kernel reads FP8"),
    ((8, 2, 64), dict(q_dtype=5), TypeError, "q_dtype=5"),
    ((8, 2, 64), dict(q_dtype="bf16"), TypeError, "q_dtype='bf16'.*not a torch dtype"),
    ((8, 2, 64), dict(arch=80), ValueError, r"arch=80; expected one of \(89, 90, 100, 120\)"),  # was a CompilationError
    ((8, 2, 64), dict(arch="sm90"), TypeError, r"arch='sm90' \(str\)"),
    ((8, 1, 64), dict(heads_per_program=64), ValueError, "heads_per_program=64: a Gluon program holds at most 32"),
    ((8, 2, 64), dict(block_n=32), ValueError, "block_n=32"),
    ((8, 2, 64), dict(num_stages=5), ValueError, "num_stages=5"),
    ((8, 2, 64), dict(batch=0), ValueError, "batch=0"),  # was a ZeroDivisionError
    ((8, 0, 64), {}, ValueError, "num_kv_heads=0"),  # was a ZeroDivisionError
    ((8, 2, 64), dict(context=0), ValueError, "context=0"),
    ((8, 2, 64), dict(num_sms=0), ValueError, "num_sms=0"),
])
def test_build_refuses_what_the_kernel_does_not_take_by_name(args, kw, exc, match):
    """Checked before anything compiles (and before the interpreter check: this process may have one on)."""
    from fp8kv.ops.decode.gluon_build import build

    with pytest.raises(exc, match=match):
        build(*args, **{"context": 4096, **kw})


def test_build_archs_are_fp8kvs_targets_from_sm89():
    from fp8kv.capability import ARCHS
    from fp8kv.ops.decode.gluon_build import BUILD_ARCHS

    assert BUILD_ARCHS == (89, 90, 100, 120) and all(f"sm{a}" in ARCHS for a in BUILD_ARCHS)


def test_issue_counts_read_each_kv_heads_programs_and_bytes(builds):
    """gluon_loop_mix's issue per token counts every warp of every program that reads a KV head's token (a group cut into
    programs, a head_dim cut into parts), and Build's bytes a token are what those programs read of memory: K and V
    codes and their per-token scales (4 bytes each), half the codes for INT4."""
    for launch, kernel in builds.items():
        assert kernel["issue_per_token"] == kernel["total"] * 4 * kernel["programs_per_head"] / kernel["block_n"]
        hq, hkv, d = launch[:3]
        parts = 2 if d > 128 else 1
        assert kernel["programs_per_head"] == kernel["head_tiles"] * parts, launch
        kv_dtype, granularity = (launch[6], launch[7]) if len(launch) > 6 else ("fp8_e4m3", "tensor")
        codes = {"int4_token_head": d, "int8_token_head": 2 * d}.get(kv_dtype, 2 * d)
        scales = 0 if (kv_dtype, granularity) == ("fp8_e4m3", "tensor") else 8
        assert kernel["bytes_per_token"] == codes + scales, launch
    assert builds[(71, 1, 64, 64)]["programs_per_head"] == 3 and builds[(8, 1, 256, 64)]["programs_per_head"] == 2
    # INT4 spends more instructions a byte than FP8 with the same scales: the unpacking of two codes a byte
    int4 = builds[(32, 8, 128, 64, 1, None, "int4_token_head", "tensor")]
    fp8 = builds[(32, 8, 128, 64, 1, None, "fp8_e4m3", "token_head")]
    assert int4["issue_per_token"] / int4["bytes_per_token"] > 1.5 * fp8["issue_per_token"] / fp8["bytes_per_token"]


def test_issue_budget_script_writes_its_table(tmp_path):
    """scripts/issue_budget.py (one launch of its list) writes a table whose budget is issue_budget's at the copy
    rate of the bench file it names, and metadata naming that file, the clock and the SMs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bench = tmp_path / "bench.csv"
    bench.write_text("copy_gbps\n4000\n4200\n4100\n")
    code = (
        "import runpy, sys; sys.argv = ['issue_budget', '--copy-from', sys.argv[1], '--out', sys.argv[2]]\n"
        "g = runpy.run_path('scripts/issue_budget.py', run_name='not_main')\n"
        "g['LAUNCHES'][:] = [l for l in g['LAUNCHES'] if l[1].get('kv_dtype') == 'int4_token_head' and l[1].get('block_n') != 128 or l[1].get('max_registers')]\n"
        "g['main']()\n")
    done = subprocess.run([sys.executable, "-c", code, str(bench), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    import pandas as pd

    from fp8kv.ops.offline_build import issue_budget
    (csv,) = (tmp_path / "out" / "sm90").glob("*.csv")
    meta = json.loads(csv.with_suffix(".json").read_text())
    assert (meta["copy_gbps"], meta["num_sms"], meta["clock_ghz"], meta["copy_from"]) == (4100.0, 132, 1.98, str(bench))
    row, capped = pd.read_csv(csv).to_dict("records")
    assert row["kv_dtype"] == "int4_token_head" and row["bytes_per_token"] == 136 and row["spilled_bytes"] == 0
    assert row["budget"] == pytest.approx(issue_budget(136, 4100.0, 132, 1.98))
    assert row["budget_share"] == pytest.approx(row["issue_per_token"] / row["budget"])
    # the what-if: a register cap the build honours (ptxas spills what does not fit), and an SM then holds more
    assert capped["max_registers"] == 168 and capped["registers"] <= 168
    assert capped["block_n"] == 128 and capped["num_stages"] == 3 and capped["programs_per_sm"] >= 3


def test_a_register_cap_is_checked_by_name():
    from fp8kv.ops.decode.gluon_build import build

    with pytest.raises(ValueError, match="max_registers"):
        build(32, 8, 128, max_registers=0)
    with pytest.raises(TypeError, match="max_registers"):
        build(32, 8, 128, max_registers=1.5)


def test_issue_budget_is_four_instructions_a_clock_at_the_copy_rate():
    from fp8kv.ops.offline_build import issue_budget
    # 256 bytes a token at 4 TB/s over 100 SMs at 2 GHz: an SM reads 20 bytes a clock, a token takes 12.8 clocks
    assert issue_budget(256, 4000.0, 100, 2.0) == pytest.approx(4 * 12.8)
    for bad, name in (((0, 4000.0, 100, 2.0), "bytes_per_token"), ((256, -1.0, 100, 2.0), "copy_gbps"),
                      ((256, 4000.0, 0, 2.0), "num_sms"), ((256, 4000.0, 100, float("nan")), "clock_ghz")):
        with pytest.raises(ValueError, match=name):
            issue_budget(*bad)
    with pytest.raises(TypeError, match="num_sms"):
        issue_budget(256, 4000.0, 1.5, 2.0)
