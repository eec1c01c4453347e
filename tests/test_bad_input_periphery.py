"""Bad input to the planner, the model-config reader, the quantizer's calibration and the CLIs.

Every refusal is a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value)
whose message names the argument and the value seen; each CLI refusal is exit status 2 with one
line on stderr and no traceback. Where an unusual input is accepted, the result is compared with
an independent computation.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kv import bench
from fp8kv.capacity import GIB, capacity_table, load_hf_config, plan_capacity
from fp8kv.quant import compute_scale, quantize

REPO = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------------ model config files
GQA_CONFIG = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=512,
                  max_position_embeddings=4096)


def _write_config(tmp_path: Path, text: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("change, exc, pattern", [
    ({"num_key_value_heads": 0}, ValueError, r"num_key_value_heads=0; expected an int >= 1"),
    ({"num_attention_heads": 0}, ValueError, r"num_attention_heads=0; expected an int >= 1"),
    ({"num_hidden_layers": None}, ValueError, r"num_hidden_layers is null; expected a positive int"),
    ({"num_attention_heads": "8"}, TypeError, r"num_attention_heads='8' \(str\); expected an int"),
    ({"num_key_value_heads": 2.0}, TypeError, r"num_key_value_heads=2.0 \(float\); expected an int"),
    ({"num_hidden_layers": True}, TypeError, r"num_hidden_layers=True \(bool\); expected an int"),
    ({"head_dim": -64}, ValueError, r"head_dim=-64; expected an int >= 1"),
    ({"max_position_embeddings": "4k"}, TypeError, r"max_position_embeddings='4k' \(str\)"),
    ({"num_key_value_heads": 3}, ValueError, r"num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
    ({"hidden_size": 500}, ValueError, r"no head_dim and hidden_size=500 is not a multiple of num_attention_heads=8"),
    ({"tie_word_embeddings": "false"}, TypeError, r"tie_word_embeddings='false' \(str\); expected true or false"),
])
def test_config_json_fields_are_checked_and_named_with_the_file(tmp_path, change, exc, pattern):
    path = _write_config(tmp_path, json.dumps({**GQA_CONFIG, **change}))
    with pytest.raises(exc, match=pattern) as info:
        load_hf_config(path)
    assert str(path) in str(info.value)
    with pytest.raises(exc, match=pattern):  # the planner reads the same file the same way
        plan_capacity(str(path), "bf16", kv_memory_gib=1)


@pytest.mark.parametrize("text, pattern", [
    ('{"num_hidden_layers": 4,', r"is not valid JSON: .* at line 1 column"),
    ("[1, 2]", r"holds a JSON list, not an object"),
    ("", r"is not valid JSON"),
])
def test_config_json_that_is_not_a_json_object_names_the_file(tmp_path, text, pattern):
    path = _write_config(tmp_path, text)
    with pytest.raises(ValueError, match=pattern) as info:
        load_hf_config(path.parent)  # the folder form finds config.json itself
    assert str(path) in str(info.value)


def test_config_json_null_kv_heads_is_multi_head_and_planned_right(tmp_path):
    # Hugging Face reads num_key_value_heads: null as "absent": multi-head attention.
    path = _write_config(tmp_path, json.dumps({**GQA_CONFIG, "num_key_value_heads": None, "head_dim": None}))
    shape = load_hf_config(path)
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim) == (8, 8, 64)
    plan = plan_capacity(path, "fp8_e4m3", kv_memory_gib=0.25, granularity="head")
    per_token = 4 * 2 * 8 * 64 * 1  # layers x (K, V) x Hkv x D x 1 byte
    fixed = 4 * 2 * 8 * 4  # one fp32 scale per layer, K/V and head
    blocks = (int(0.25 * 2**30) - fixed) // (16 * per_token)
    assert (plan["bytes_per_token"], plan["blocks"], plan["tokens"]) == (per_token, blocks, blocks * 16)
    assert plan["max_concurrency"] == blocks * 16 / 4096


# ------------------------------------------------------------------------------ planner arguments
@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(kv_memory_gib=-1), ValueError, r"kv_memory_gib=-1.0; expected a finite number > 0"),
    (dict(kv_memory_gib=NAN), ValueError, r"kv_memory_gib=nan; expected a finite number"),
    (dict(kv_memory_gib="8"), TypeError, r"kv_memory_gib='8' \(str\); expected a finite number"),
    (dict(kv_memory_gib=True), TypeError, r"kv_memory_gib=True \(bool\)"),
    (dict(gpu_memory_gib=INF), ValueError, r"gpu_memory_gib=inf; expected a finite number"),
    (dict(gpu_memory_gib=0), ValueError, r"gpu_memory_gib=0.0; expected a finite number > 0"),
    (dict(gpu_memory_gib="TPU-v5"), ValueError, r"gpu_memory_gib='TPU-v5' is not a known GPU; known: \["),
    (dict(gpu_memory_gib=80, utilization=0), ValueError, r"utilization=0.0; expected a fraction in \(0, 1\]"),
    (dict(gpu_memory_gib=80, utilization=1.01), ValueError, r"utilization=1.01; expected a fraction in \(0, 1\]"),
    (dict(gpu_memory_gib=80, utilization=NAN), ValueError, r"utilization=nan; expected a finite number"),
    (dict(gpu_memory_gib=80, utilization="0.9"), TypeError, r"utilization='0.9' \(str\)"),
    (dict(gpu_memory_gib=80, weights_gib=-2), ValueError, r"weights_gib=-2.0; expected a finite number >= 0"),
    (dict(gpu_memory_gib=80, weights_gib=NAN), ValueError, r"weights_gib=nan"),
    (dict(kv_memory_gib=1, block_size=0), ValueError, r"block_size=0; expected an int >= 1"),
    (dict(kv_memory_gib=1, block_size=-4), ValueError, r"block_size=-4; expected an int >= 1"),
    (dict(kv_memory_gib=1, block_size=16.0), TypeError, r"block_size=16.0 \(float\); expected an int"),
    (dict(kv_memory_gib=1, max_model_len=0), ValueError, r"max_model_len=0; expected an int >= 1"),
    (dict(kv_memory_gib=1, max_model_len=2048.5), TypeError, r"max_model_len=2048.5 \(float\)"),
    (dict(kv_memory_gib=1, granularity="block"), ValueError, r"granularity='block'; expected one of"),
    (dict(kv_memory_gib=1, kv_dtype=None), TypeError, r"kv_dtype=None \(NoneType\); expected a name among"),
    (dict(kv_memory_gib=1, kv_dtype=True), TypeError, r"kv_dtype=True \(bool\)"),
    (dict(kv_memory_gib=1, kv_dtype="int8"), ValueError, r"kv_dtype='int8' is not supported; expected one of"),
    (dict(kv_memory_gib=1, model="GPT-5"), ValueError, r"model='GPT-5' is not a known model; known: \["),
    (dict(kv_memory_gib=1, model=42), TypeError, r"model must be a registry name.*got int"),
])
def test_plan_capacity_refuses_bad_arguments_by_name(kwargs, exc, pattern):
    args = {"model": "Llama-3.1-8B", "kv_dtype": "fp8_e4m3", **kwargs}
    with pytest.raises(exc, match=pattern):
        plan_capacity(args.pop("model"), args.pop("kv_dtype"), **args)


def test_registry_lookups_refuse_non_names():
    from fp8kv.capacity import get_gpu, get_model

    with pytest.raises(TypeError, match=r"model=8 \(int\); expected a registry name among \["):
        get_model(8)
    with pytest.raises(TypeError, match=r"gpu must be a GPU name or GPU, got float"):
        get_gpu(80.0)


def test_plan_capacity_on_a_named_gpu_matches_hand_arithmetic():
    plan = plan_capacity("Llama-3.1-8B", "fp8_e4m3", gpu_memory_gib="H100", utilization=0.85,
                         granularity="head", block_size=32)
    budget = math.floor(81559 / 1024 * GIB * 0.85) - 8_030_261_248 * 2  # driver total x util - bf16 weights
    fixed = 32 * 2 * 8 * 4  # head scales: layers x (K, V) x Hkv x fp32
    per_token = 32 * 2 * 8 * 128  # layers x (K, V) x Hkv x D x 1 byte
    blocks = (budget - fixed) // (32 * per_token)
    assert (plan["kv_budget_bytes"], plan["blocks"], plan["tokens"]) == (budget, blocks, blocks * 32)
    assert plan["max_concurrency"] == blocks * 32 / 131072


@pytest.mark.parametrize("args, kwargs, exc, pattern", [
    (([], "H100", "bf16"), {}, ValueError, r"models is empty"),
    (("Qwen3-8B", [], "bf16"), {}, ValueError, r"gpus is empty"),
    (("Qwen3-8B", "H100", 5), {}, TypeError, r"kv_dtypes=5 \(int\); expected one item or a list"),
    (("Qwen3-8B", "H100", "fp8_e4m3"), dict(granularities=["tensor", "block"]), ValueError,
     r"granularities has \['block'\]; expected values among"),
    (("Qwen3-8B", "H100", "fp8_e4m3"), dict(granularity="head"), ValueError,
     r"granularity='head' is set per row by capacity_table; pass granularities= instead"),
    (("Qwen3-8B", "H100", "bf16"), dict(gpu_memory_gib=80), ValueError, r"gpu_memory_gib=80 is set per row"),
    (("Qwen3-8B", ["H100", True], "bf16"), {}, TypeError, r"gpu_memory_gib=True \(bool\)"),
])
def test_capacity_table_refuses_bad_arguments_by_name(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        capacity_table(*args, **kwargs)


# ------------------------------------------------------------------------------ quantizer calibration
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("method", ["amax", "percentile", "vllm_k"])
def test_calibration_refuses_non_finite_input_naming_the_index(bad, method):
    x = torch.ones(3, 2, 8)
    x[1, 0, 5] = bad
    with pytest.raises(ValueError, match=rf"x has 1 non-finite value\(s\) \(NaN/Inf\); the first is at index \(1, 0, 5\) \(value {bad}\)"):
        compute_scale(x, "e4m3", "head", method)
    with pytest.raises(ValueError, match=r"x has 1 non-finite value\(s\)"):
        quantize(x, "e4m3", "head", method)
    # saturate mode calibrates on the finite values only: every scale is the clean one
    q = quantize(x, "e4m3", "tensor", "amax", nonfinite="saturate")
    assert torch.equal(q.scale, torch.tensor(1.0) / 448) and q.nonfinite == 1


@pytest.mark.parametrize("percentile, exc, pattern", [
    ("99", TypeError, r"percentile='99' \(str\); expected a finite number"),
    (True, TypeError, r"percentile=True \(bool\)"),
    (None, TypeError, r"percentile=None \(NoneType\)"),
    (0, ValueError, r"percentile=0 must be in \(0, 100\]"),
    (-5.0, ValueError, r"percentile=-5.0 must be in \(0, 100\]"),
    (100.5, ValueError, r"percentile=100.5 must be in \(0, 100\]"),
    (NAN, ValueError, r"percentile=nan; expected a finite number"),
])
def test_percentile_is_a_number_in_0_100(percentile, exc, pattern):
    x = torch.randn(4, 2, 8)
    with pytest.raises(exc, match=pattern):
        compute_scale(x, method="percentile", percentile=percentile)
    with pytest.raises(exc, match=pattern):
        quantize(x, scale="percentile", percentile=percentile)


def test_percentile_scale_matches_a_sort_and_empty_groups_get_scale_one(gen):
    x = torch.randn(50, 2, 8, generator=gen)
    got = compute_scale(x, "e5m2", "head", "percentile", percentile=90)
    for h in range(2):
        mags = sorted(abs(v) for v in x[:, h].flatten().tolist())
        kth = mags[round(0.9 * len(mags)) - 1]  # the k-th smallest, k = round(p / 100 * n)
        assert got[h].item() == pytest.approx(kth / 57344.0, rel=1e-6)
    empty = torch.empty(0, 2, 8)
    for gran, shape in (("tensor", ()), ("head", (2,)), ("channel", (2, 8)), ("token_head", (0, 2))):
        for method in ("percentile", "amax"):
            s = compute_scale(empty, "e4m3", gran, method)
            assert s.shape == shape and torch.equal(s, torch.ones(shape)), (gran, method)


@pytest.mark.parametrize("scale, exc, pattern", [
    (True, TypeError, r"scale=True \(bool\); expected None, a method name"),
    (object(), TypeError, r"scale=<object .*> \(object\); expected None, a method name"),
    (torch.tensor([True, True]), TypeError, r"scale has dtype torch.bool; expected a real"),
    (0.0, ValueError, r"scale must be positive and finite; got 0.0"),
    (-2, ValueError, r"scale must be positive and finite; got -2.0"),
    (NAN, ValueError, r"scale must be positive and finite; got nan"),
    (torch.tensor([1.0, INF]), ValueError, r"scale must be positive and finite"),
    ("max", ValueError, r"scale='max' is not a known scale method; expected one of \('amax'"),
])
def test_explicit_scales_are_positive_finite_numbers(scale, exc, pattern):
    with pytest.raises(exc, match=pattern):
        quantize(torch.randn(4, 2, 8), "e4m3", "head", scale)


def test_an_integer_scale_is_the_same_as_the_float(gen):
    x = torch.randn(4, 2, 8, generator=gen)
    assert torch.equal(quantize(x, scale=2).data.view(torch.uint8), quantize(x, scale=2.0).data.view(torch.uint8))
    expect = (x / 2).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(quantize(x, scale=2).data.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("call, exc, pattern", [
    (lambda x: compute_scale(x, "e3m4"), ValueError, r"fmt='e3m4' is not a known FP8 format"),
    (lambda x: compute_scale(x, 8), TypeError, r"fmt must be a format name or torch dtype, got int"),
    (lambda x: compute_scale(x, granularity="block"), ValueError, r"granularity='block' is not supported"),
    (lambda x: compute_scale(x, method="max"), ValueError, r"scale='max' is not a known scale method"),
    (lambda x: compute_scale(x, method=None), TypeError, r"scale=None \(NoneType\); expected a method name"),
    (lambda x: compute_scale(x.to(torch.float8_e4m3fn)), TypeError, r"x must be a float16/bfloat16/float32"),
    (lambda x: compute_scale(x.tolist()), TypeError, r"x must be a torch.Tensor, got list"),
    (lambda x: compute_scale(x[0, 0]), ValueError, r"x must have at least 2 dims .* got shape \(8,\)"),
    (lambda x: quantize(x, nonfinite=None), ValueError, r"nonfinite=None; expected 'raise' or 'saturate'"),
])
def test_calibration_names_unknown_formats_granularities_and_methods(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(torch.randn(4, 2, 8))


# ------------------------------------------------------------------------------ command lines
# A few real subprocesses prove what only a process shows (exit status, nothing but one line on
# stderr, no traceback); the rest of the argument families run main() in-process, which is the
# same code path without the interpreter start-up.
def _cli(module: str, *args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if not interpret:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _assert_usage_error(returncode: int, err: str, *needles: str) -> None:
    assert returncode == 2, (returncode, err[-2000:])
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    for needle in needles:
        assert needle in err, (needle, err)


def _in_process(main, argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of ``main(argv)``, whether it returns or exits."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def a_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "results.csv"
    path.write_text("not a folder\n")
    return path


NO_GPU_HERE = pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that must be missing")


@pytest.mark.parametrize("module, args, needles", [
    ("fp8kv.bench", ["--batches", "0", "--contexts", "16"], ["fp8kv bench: error: --batches=0; expected an int >= 1"]),
    # a budget that leaves nothing to run is an error, not an empty success
    ("fp8kv.bench", ["--preset", "smoke", "--backends", "reference", "--memory-budget-gb", "1e-9", "--no-save"],
     ["fp8kv bench: error: none of the 3 cases can run here", "does not fit"]),
    ("fp8kv.cli", ["frobnicate"], ["fp8kv: error: argument COMMAND: invalid choice: 'frobnicate'"]),
])
def test_cli_processes_exit_2_with_one_line_and_no_traceback(module, args, needles):
    proc = _cli(module, *args)
    _assert_usage_error(proc.returncode, proc.stderr, *needles)


BENCH_ERRORS = [
    (["--preset", "nope"], ["--preset", "'nope'", "smoke"]),
    (["--preset", "smoke", "--contexts", "-8"], ["--contexts=-8"]),
    (["--preset", "smoke", "--head-dims", "64", "0"], ["--head-dims=0"]),
    (["--preset", "smoke", "--rep", "0"], ["--rep=0"]),
    (["--preset", "smoke", "--batches", "x"], ["--batches", "'x'"]),
    (["--preset", "smoke", "--memory-budget-gb", "nan"], ["--memory-budget-gb=nan", "finite"]),
    (["--preset", "smoke", "--memory-budget-gb", "-1"], ["--memory-budget-gb=-1.0"]),
    (["--preset", "smoke", "--memory-budget-gb", "1e300"], ["--memory-budget-gb=1e+300 GiB", "bound of 1e+06 GiB"]),  # not an OverflowError
    (["--preset", "smoke", "--heads", "32:7"], ["--heads", "'32:7'", "multiple of Hkv"]),
    (["--preset", "smoke", "--heads", "0:0"], ["--heads", "'0:0'"]),
    (["--preset", "smoke", "--triton-opt", "num_splits=0"], ["--triton-opt", "'num_splits=0'", "INT >= 1"]),
    (["--preset", "smoke", "--device", "cuda:7"], ["--device cuda:7", "cuda:7"]),
    (["--preset", "smoke", "--device", "tpu"], ["--device tpu", "is not a device"]),
    pytest.param(["--preset", "smoke", "--device", "cuda"], ["--device cuda", "no CUDA device"], marks=NO_GPU_HERE),
    (["--preset", "smoke", "--interpret", "--device", "cuda"], ["--interpret runs on CPU tensors"]),
    (["--batches", "2"], ["give --preset, or --batches and --contexts"]),
]


@pytest.mark.parametrize("args, needles", BENCH_ERRORS)
def test_bench_cli_bad_arguments_exit_2_with_one_line(args, needles, tmp_path, capsys):
    rc, err = _in_process(bench.main, [*args, "--out", str(tmp_path), "--quiet"], capsys)
    _assert_usage_error(rc, err, "fp8kv bench: error:", *needles)


def test_bench_cli_refuses_an_existing_file_as_out(a_file, capsys):
    proc = _cli("fp8kv.bench", "--preset", "smoke", "--backends", "reference", "--out", str(a_file))
    _assert_usage_error(proc.returncode, proc.stderr, f"--out={str(a_file)!r} is an existing file; expected a folder")
    rc, err = _in_process(bench.main, ["--preset", "smoke", "--out", str(a_file / "sub")], capsys)
    _assert_usage_error(rc, err, f"{str(a_file)!r} is a file, so no folder can be made under it")
    assert a_file.read_text() == "not a folder\n"


def test_bench_help_describes_every_flag_and_preset():
    parser = bench.build_parser()
    undocumented = [a.option_strings for a in parser._actions if not a.help]
    assert not undocumented
    proc = _cli("fp8kv.bench", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for name, description in bench.PRESET_HELP.items():
        assert f"{name} {' '.join(description.split())}" in text
    assert set(bench.PRESET_HELP) == set(bench.PRESETS)


@NO_GPU_HERE
def test_bench_smoke_on_cpu_names_the_interpret_flag(monkeypatch, capsys):
    proc = _cli("fp8kv.bench", "--preset", "smoke", "--dry-run", interpret=False)
    assert proc.returncode == 0, proc.stderr
    triton_rows = [line for line in proc.stdout.splitlines() if " triton " in f" {line} "]
    assert triton_rows and all("add --interpret" in line for line in triton_rows)
    assert "TRITON_INTERPRET" not in proc.stdout
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, err = _in_process(bench.main, ["--preset", "smoke", "--backends", "triton", "--dry-run"], capsys)
    _assert_usage_error(rc, err, "none of the 3 cases can run here", "add --interpret")


CLI_ERRORS = [
    ([], ["fp8kv: error:", "COMMAND"]),
    (["notebooks"], ["fp8kv notebooks: error:", "ACTION"]),
    (["notebooks", "walk"], ["fp8kv notebooks: error:", "'walk'"]),
    (["notebooks", "run", "--timeout", "0"], ["fp8kv notebooks run: error:", "--timeout", "'0'"]),
    (["notebooks", "run", "--timeout", "ten"], ["--timeout", "'ten'"]),
    (["notebooks", "run", "--device", "cuda:7"], ["--device", "'cuda:7'"]),
    (["notebooks", "run", "--only", "99_nothing"], ["only='99_nothing' matches no notebook"]),
    (["notebooks", "list", "--notebooks", "/no/such/folder"], ["notebook_dir='/no/such/folder' is not a folder"]),
    (["bench", "--rep", "-1", "--preset", "smoke"], ["fp8kv bench: error:", "--rep=-1"]),
]


@pytest.mark.parametrize("args, needles", CLI_ERRORS)
def test_fp8kv_cli_bad_arguments_exit_2_with_one_line(args, needles, capsys):
    from fp8kv import cli

    rc, err = _in_process(cli.main, args, capsys)
    _assert_usage_error(rc, err, *needles)


def test_fp8kv_cli_refuses_an_existing_file_as_reports_folder(a_file):
    proc = _cli("fp8kv.cli", "notebooks", "run", "--smoke", "--device", "cpu", "--out", str(a_file))
    _assert_usage_error(proc.returncode, proc.stderr, "argument --out", f"{str(a_file)!r} is a file, not a folder")
    assert a_file.read_text() == "not a folder\n"
