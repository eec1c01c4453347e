"""The decode step over quantized KV formats (fp8kv.step with fp8kv.cache.quantized pages): the step's write
stores the cache's own bytes; its attention through the quantized-page kernel matches the fp32 oracle within
the kernel's tolerance; each format's ceiling follows the planner's bytes per token (scales counted); rows carry
the format and its bytes; a format a backend, mode, q_len or head_dim cannot run is refused by name, before
anything is built."""

from __future__ import annotations

import pytest
import torch
from fixtures import DEVICE, run_tokens, seeded

from fp8kv import step as S
from fp8kv.cache.quantized import QuantizedPagedKVCache
from fp8kv.capacity import MODELS, ModelShape, plan_capacity
from fp8kv.kv_formats import PAGED_FORMATS
from fp8kv.ops.quant_decode import QUANT_DECODE_FORMATS, kernel_tolerance, quantized_reference
from fp8kv.quant import relative_error
from fp8kv.reference import unit_roundoff
from fp8kv.step.quantized import STEP_KV_DTYPES, format_name, step_kv_dtype, write_rows

TOY = S.TOY_QWEN  # two layers, GQA group 2, q/k norm, head_dim 32: every format's blocks divide it
KERNEL_FORMATS = tuple(QUANT_DECODE_FORMATS)
NO_KERNEL = tuple(f for f in PAGED_FORMATS if f not in QUANT_DECODE_FORMATS)  # e4m3_b16, e4m3_b32


def _step(kv_dtype, backend, batch=2, context=48, seed=0, **kw):
    weights = S.random_weights(TOY, torch.float32, DEVICE, seed=seed)
    pool = S.KVPool(TOY, 16, kv_dtype, device=DEVICE, **kw)
    return S.DecodeStep(TOY, weights, pool.caches(batch, context), backend=backend)


# ---------------------------------------------------------------------------------------------- write
@pytest.mark.parametrize("fmt", PAGED_FORMATS)
def test_step_write_stores_the_caches_bytes(fmt):
    """write_rows (no host sync) against QuantizedPagedKVCache.write (the codec's quantize) on the same rows:
    every code, scale byte and slot equal, rows of every magnitude (zeros, tiny, large enough to saturate a
    tensor scale of 1e-3) included."""
    g = seeded(7)
    n, hkv, d = 12, 2, 32
    rows = torch.randn(2, n, hkv, d, generator=g) * torch.logspace(-6, 3, n)[None, :, None, None]
    rows[:, 0] = 0.0  # an all-zero row: scale 1 (or the smallest power of two) and zero codes
    k, v = rows[0], rows[1]
    scales = {"k_tensor_scale": 1e-3, "v_tensor_scale": 1e-3} if fmt in ("nvfp4", "e4m3_b16") else {}
    ours = QuantizedPagedKVCache.empty(fmt, 2, 16, hkv, d, block_size=8, seed=3, **scales)
    theirs = QuantizedPagedKVCache.empty(fmt, 2, 16, hkv, d, block_size=8, seed=3, **scales)
    slots = torch.cat([ours.slots(0, torch.arange(6)), ours.slots(1, torch.arange(3, 9))])
    write_rows(ours, k, v, slots)
    theirs.write(k, v, slots)
    assert theirs.saturated > 0 or not scales  # the tiny tensor scale made some values saturate
    for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), name


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_quantized_step_attention_matches_the_oracle(fmt, gen):
    """The Triton step (its write and fp8kv's quantized-page decode kernel, in the interpreter) against the fp32
    oracle reading the same pages, every layer, within kernel_tolerance: both read the same codes and scales, so
    only fp16's roundings of the probabilities, the output and the query separate them."""
    step = _step(fmt, "triton")
    logits = run_tokens(step, 19, gen)  # two pages and a partial third per sequence
    assert step.backend == "triton" and step.mode == "dequant" and step.kv_dtype == fmt
    assert torch.isfinite(logits).all() and step.seq_lens.tolist() == [19, 19]
    for q_dtype in (torch.float16, torch.float32):
        q = torch.randn(step.batch, TOY.num_q_heads, TOY.head_dim, generator=gen).to(DEVICE, q_dtype)
        for layer, cache in enumerate(step.caches):
            assert isinstance(cache, QuantizedPagedKVCache) and cache.fmt.name == fmt
            got = step.attend(layer, q)
            ref, _ = quantized_reference(q.to(step.q_dtype), cache, step.sm_scale)
            tol = kernel_tolerance(q.to(step.q_dtype), got.dtype, cache, step.sm_scale)
            assert relative_error(got, ref) <= tol, (layer, q_dtype, relative_error(got, ref), tol)


@pytest.mark.parametrize("fmt", PAGED_FORMATS)
def test_reference_step_reads_every_format_through_the_oracle(fmt, gen):
    """The reference backend writes through the cache's checked write and attends through the oracle: every paged
    format runs, the two formats without a kernel included; "auto" on CPU with the interpreter picks the kernel
    where the format has one."""
    step = _step(fmt, "reference")
    assert torch.isfinite(run_tokens(step, 5, gen)).all()
    q = torch.randn(step.batch, TOY.num_q_heads, TOY.head_dim, generator=gen).to(DEVICE)
    assert torch.equal(step.attend(0, q), quantized_reference(q, step.caches[0], step.sm_scale)[0])
    assert _step(fmt, "auto").backend == ("triton" if fmt in KERNEL_FORMATS else "reference")


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_triton_and_reference_steps_agree_on_the_first_token(fmt):
    """Token 0 of the same weights and ids: both steps quantize the same K/V rows (bytes equal) and their logits
    differ only by the kernel's roundings (attention within kernel_tolerance, times the fp32 layers after it)."""
    steps = {b: _step(fmt, b) for b in ("reference", "triton")}
    out = {}
    for b, st in steps.items():
        st.input_ids.copy_(torch.tensor([5, 9]))
        st.set_positions(0)
        out[b] = st.forward()
    c_ref, c_tri = steps["reference"].caches[0], steps["triton"].caches[0]
    for name in ("k_pages", "v_pages", "k_scales", "v_scales"):  # layer 0's input is the same in both
        a, b = getattr(c_ref, name), getattr(c_tri, name)
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b), name
    # 2^-8 for the interpreter's fp16 query; a GPU's bf16 query (u = 2^-8, not 2^-11) grows it by their ratio
    grow = unit_roundoff(steps["triton"].q_dtype) / unit_roundoff("fp16")
    assert relative_error(out["triton"], out["reference"]) < 2**-8 * grow


# -------------------------------------------------------------------------------------------- ceilings
ALL_KV = ("bf16", "fp8_e4m3", *PAGED_FORMATS)


@pytest.mark.parametrize("model,context", [("Qwen3-8B", 16384), ("Llama-3.1-8B", 32768), ("Qwen3-0.6B", 4096)])
def test_each_formats_ceiling_follows_the_planners_bytes(model, context):
    """A format's step ceiling is planned with fp8kv.capacity's bytes per token for it (codes and scales): the
    step's bytes are the planner's, its KV per sequence is whole blocks of them, and fewer bytes per token never
    give a lower ceiling. The orders researchers read off (INT8 holds more than bf16, 4-bit more than FP8, NVFP4's
    e4m3 scales and tensor scale less than MXFP4's) are the planner's numbers, not typed ones."""
    got = {kv: S.step_ceiling(MODELS[model], kv, context, gpu_memory_gib="H200") for kv in ALL_KV}
    planned = {kv: plan_capacity(model, kv, gpu_memory_gib="H200", max_model_len=context) for kv in ALL_KV}
    for kv in ALL_KV:
        assert got[kv]["bytes_per_token"] == planned[kv]["bytes_per_token"]
        assert got[kv]["block_bytes"] == planned[kv]["block_bytes"]
        assert got[kv]["fixed_scale_bytes"] == planned[kv]["fixed_scale_bytes"]
        # activations are a small part of the memory: the ceiling is the planner's concurrency, nearly
        assert 0.98 * planned[kv]["max_concurrency"] - 1 <= got[kv]["ceiling"] <= planned[kv]["max_concurrency"]
    for a in ALL_KV:
        for b in ALL_KV:
            if planned[a]["bytes_per_token"] < planned[b]["bytes_per_token"]:
                assert got[a]["ceiling"] >= got[b]["ceiling"], (a, b)
            # ceilings scale as the inverse of the bytes (within the activations' and a block's share)
            ratio = got[a]["ceiling"] / got[b]["ceiling"]
            want = planned[b]["bytes_per_token"] / planned[a]["bytes_per_token"]
            assert abs(ratio / want - 1) < 0.05, (a, b, ratio, want)
    assert got["int8_token_head"]["ceiling"] > got["bf16"]["ceiling"]
    for four_bit in ("int4_token_head", "nvfp4", "mxfp4"):
        assert got[four_bit]["ceiling"] > got["fp8_e4m3"]["ceiling"]


def test_step_bytes_count_a_formats_scales():
    """The KV bytes a step moves are the planner's bytes per token times the tokens read and written."""
    w = S.random_weights(TOY, torch.float32, "cpu")
    for kv in ALL_KV:
        per_token = plan_capacity(TOY, kv, kv_memory_gib=1.0, max_model_len=64)["bytes_per_token"]
        assert S.step_bytes(TOY, w, kv, 3, 64)["kv"] == 3 * 65 * per_token


def test_sweep_rows_carry_the_format_its_bytes_and_its_ceiling():
    """A smoke sweep of the toy (Triton in the interpreter, batch 1): every format's rows ran, each with its
    kv_format, the planner's bytes per token and the ceiling plan_sweep planned; the plan table shows the same."""
    settings = S.smoke_settings(on_gpu=False)
    kv_dtypes = ["fp16", "fp8_e4m3", "int8_token_head", "nvfp4", "mxfp4"]
    mem = settings["gpu_memory_gib"]
    plans = S.plan_sweep([TOY], [64], kv_dtypes, gpu_memory_gib=mem, device=DEVICE, backend="triton")
    df = S.sweep([TOY], [64], kv_dtypes, backend="triton", gpu_memory_gib=mem, weights="random", device=DEVICE,
                 progress=False, cpu_reps=1, batches=[1], copy_bandwidth=False)
    assert (df["status"] == "ok").all(), df["reason"].tolist()
    assert df["logits_finite"].all() and list(df["kv_dtype"]) == kv_dtypes
    assert list(df["kv_format"]) == ["", "fp8_e4m3_tensor", "int8_token_head", "nvfp4", "mxfp4"]
    assert list(df["ceiling"]) == [p["plan"]["ceiling"] for p in plans]
    for row in df.itertuples():
        assert row.bytes_per_token == plan_capacity(TOY, row.kv_dtype, kv_memory_gib=1.0)["bytes_per_token"]
        assert row.backend == "triton" and row.mode == "dequant" or row.kv_dtype in ("fp16", "fp8_e4m3")
    table = S.plan_table([(TOY, 64)], kv_dtypes, gpu_memory_gib=mem, device=DEVICE)
    assert list(table["ceiling"]) == list(df["ceiling"]) and list(table["bytes/token"]) == list(df["bytes_per_token"])
    assert df.set_index("kv_dtype")["ceiling"]["nvfp4"] > df.set_index("kv_dtype")["ceiling"]["fp8_e4m3"]


def test_format_names_and_aliases():
    assert step_kv_dtype("NVFP4") == "nvfp4" and step_kv_dtype("mxfp8") == "e4m3_b32"
    assert step_kv_dtype("bfloat16") == "bf16" and step_kv_dtype("e4m3") == "fp8_e4m3"
    assert set(STEP_KV_DTYPES) == {"bf16", "fp16", "fp8_e4m3", "fp8_e5m2", *PAGED_FORMATS}
    assert [format_name(kv) for kv in ("bf16", "fp8_e5m2", "mxfp4")] == ["", "fp8_e5m2_tensor", "mxfp4"]


# -------------------------------------------------------------------------------------------- refusals
BAD_NAMES = {
    "int8": "is not a KV dtype the step runs",  # ambiguous: int8_tensor or int8_token_head
    "nvfp5": "is not a KV dtype the step runs",
    "kivi4_g32": "cannot be paged token by token",
    "int8_tensor": "cannot be paged token by token",
    "fp8_e4m3_token_head": "cannot be paged token by token",
}


@pytest.mark.parametrize("name", BAD_NAMES)
def test_an_unknown_or_unpaged_name_is_refused_naming_what_is_accepted(name, capsys):
    accepted = str(STEP_KV_DTYPES).replace("(", r"\(").replace(")", r"\)")
    for call in (lambda: S.KVPool(TOY, 16, name),
                 lambda: S.plan_sweep([TOY], [64], ["fp16", name], gpu_memory_gib=0.0016, device="cpu")):
        with pytest.raises(ValueError, match=f"{name!r}.*{BAD_NAMES[name]}.*expected one of {accepted}"):
            call()
    with pytest.raises(SystemExit) as exc:
        S.main(["--model", "Qwen3-8B", "--contexts", "4096", "--gpu-memory", "H200", "--dry-run",
                "--kv-dtypes", "bf16", name])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert f"argument --kv-dtypes: --kv-dtypes={name!r}" in err and "nvfp4" in err and BAD_NAMES[name] in err


def test_the_format_helpers_refuse_an_unknown_name_or_a_bad_q_len():
    from fp8kv.step.quantized import check_format_step, format_backends

    with pytest.raises(ValueError, match="'nvfp5'"):  # was given the oracle
        format_backends("nvfp5")
    with pytest.raises(ValueError, match="'nvfp5'"):
        check_format_step("nvfp5", "auto")
    for bad in (True, 1.0):
        with pytest.raises(TypeError, match="q_len"):
            check_format_step("nvfp4", "auto", q_len=bad)


@pytest.mark.parametrize("bad", [3, None, torch.float16])
def test_a_kv_dtype_that_is_not_a_name_is_a_type_error(bad):
    with pytest.raises(TypeError, match="kv_dtypes=.*expected a name among"):
        S.plan_sweep([TOY], [64], [bad], gpu_memory_gib=0.0016, device="cpu")


@pytest.mark.parametrize("fmt", NO_KERNEL)
def test_triton_is_refused_for_a_format_without_a_kernel(fmt, capsys):
    msg = f"backend='triton' cannot read kv_dtype={fmt!r}.*expected backend among \\('auto', 'reference'\\)"
    with pytest.raises(ValueError, match=msg):
        _step(fmt, "triton")
    with pytest.raises(ValueError, match=msg):
        S.plan_sweep([TOY], [64], [fmt], gpu_memory_gib=0.0016, device="cpu", backend="triton")
    with pytest.raises(SystemExit) as exc:
        S.main(["--model", "Qwen3-8B", "--contexts", "4096", "--gpu-memory", "H200", "--dry-run",
                "--kv-dtypes", fmt, "--backend", "triton"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--backend='triton' cannot read --kv-dtypes={fmt!r}" in err


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("backend", ["flashinfer", "vllm", "gluon"])
def test_a_backend_outside_the_step_is_refused_for_a_format(fmt, backend):
    with pytest.raises(ValueError, match=f"backend={backend!r}"):
        _step(fmt, backend)
    with pytest.raises(ValueError, match=f"backend={backend!r} cannot read kv_dtype={fmt!r}.*'triton', 'reference'"):
        S.plan_sweep([TOY], [64], [fmt], gpu_memory_gib=0.0016, device="cpu", backend=backend)


@pytest.mark.parametrize("fmt", PAGED_FORMATS)
def test_fp8_mode_and_several_new_tokens_are_refused_for_a_format(fmt, capsys):
    w = S.random_weights(TOY, torch.float32, DEVICE)
    caches = S.KVPool(TOY, 16, fmt, device=DEVICE).caches(2, 48)
    with pytest.raises(ValueError, match=f"mode='fp8' with kv_dtype={fmt!r}.*expected mode 'auto' or 'dequant'"):
        S.DecodeStep(TOY, w, caches, backend="reference", mode="fp8")
    for q_len in (2, 5):
        with pytest.raises(ValueError, match=f"q_len={q_len} with kv_dtype={fmt!r}.*expected q_len=1"):
            S.DecodeStep(TOY, w, caches, backend="reference", q_len=q_len)
        with pytest.raises(ValueError, match=f"q_len={q_len} with kv_dtype={fmt!r}"):
            S.plan_sweep([TOY], [64], [fmt], gpu_memory_gib=0.0016, device="cpu", q_len=q_len)
    with pytest.raises(SystemExit) as exc:
        S.main(["--model", "Qwen3-8B", "--contexts", "4096", "--gpu-memory", "H200", "--dry-run",
                "--kv-dtypes", fmt, "--draft-lens", "2"])
    assert exc.value.code == 2 and f"--draft-lens=2 with --kv-dtypes={fmt!r}" in capsys.readouterr().err


# head_dim 48: NVFP4 and e4m3_b16's blocks of 16 divide it, MXFP4 and MXFP8's of 32 do not; head_dim 24 fits
# only the per-token-head codes.
@pytest.mark.parametrize("head_dim,fmt", [(48, "mxfp4"), (48, "e4m3_b32"), (24, "nvfp4"), (24, "e4m3_b16"),
                                          (24, "mxfp4")])
def test_a_format_whose_block_does_not_fit_the_head_dim_is_refused(head_dim, fmt):
    shape = ModelShape(f"toy-d{head_dim}", 2, 4, 2, head_dim, hidden_size=64, max_position_embeddings=4096,
                       intermediate_size=96, vocab_size=128, tie_word_embeddings=True, rope_theta=1e6,
                       rms_norm_eps=1e-6, qk_norm=True)
    fits = [f for f in PAGED_FORMATS if f not in ("mxfp4", "e4m3_b32") and (head_dim % 16 == 0 or "token" in f)]
    msg = (f"kv_dtypes={fmt!r} cannot store toy-d{head_dim}'s head_dim {head_dim}: .*multiple of its block size"
           f".*formats that fit it: {fits}".replace("[", r"\[").replace("]", r"\]"))
    with pytest.raises(ValueError, match=msg):
        S.plan_sweep([shape], [64], ["fp16", fmt], gpu_memory_gib=0.0016, device="cpu")
    with pytest.raises(ValueError, match=f"kv_dtype={fmt!r} cannot store toy-d{head_dim}'s head_dim {head_dim}"):
        S.KVPool(shape, 16, fmt)
    for ok in fits:
        S.KVPool(shape, 4, ok)  # the formats named as fitting do


def test_a_step_refuses_caches_of_mixed_kinds_or_formats():
    w = S.random_weights(TOY, torch.float32, DEVICE)
    nv = S.KVPool(TOY, 16, "nvfp4", device=DEVICE).caches(1, 32)
    fp16 = S.KVPool(TOY, 16, "fp16", device=DEVICE).caches(1, 32)
    with pytest.raises(TypeError, match=r"caches\[1\] is a PagedKVCache; expected QuantizedPagedKVCache"):
        S.DecodeStep(TOY, w, [nv[0], fp16[1]], backend="reference")
    mx = S.KVPool(TOY, 16, "mxfp4", device=DEVICE).caches(1, 32)
    with pytest.raises(ValueError, match=r"caches\[1\] holds mxfp4, caches\[0\] nvfp4"):
        S.DecodeStep(TOY, w, [nv[0], mx[1]], backend="reference")


# ---------------------------------------------------------------------------------------------- reading
def _rows(points):
    """Sweep rows of the toy at context 64: (kv_dtype, bytes per token, ceiling, batch, tokens/s) each."""
    import pandas as pd

    rows = []
    for kv, per_token, ceiling, batch, tps in points:
        row = dict.fromkeys(S.COLUMNS)
        row.update(model="toy-qwen", context=64, kv_dtype=kv, kv_format=format_name(kv), bytes_per_token=per_token,
                   ceiling=ceiling, batch=batch, tokens_per_s=tps, step_us=1e6 * batch / tps, attention_share=0.5,
                   attention_us=1.0, pct_copy_bw=float("nan"), status="ok", reason="", timing="cpu-wallclock")
        rows.append(row)
    return pd.DataFrame(rows, columns=S.COLUMNS)


def test_ceiling_table_reads_tokens_per_s_to_each_formats_ceiling():
    df = _rows([("fp16", 2048, 4, 1, 100.0), ("fp16", 2048, 4, 4, 300.0),
                ("nvfp4", 576, 14, 1, 90.0), ("nvfp4", 576, 14, 4, 280.0), ("nvfp4", 576, 14, 14, 700.0),
                ("mxfp4", 544, 15, 1, 95.0), ("mxfp4", 544, 15, 4, 290.0)])  # mxfp4's ceiling not measured
    t = S.ceiling_table(df)
    assert list(t["kv_dtype"]) == ["fp16", "nvfp4", "mxfp4"] and list(t["kv_format"]) == ["", "nvfp4", "mxfp4"]
    assert list(t["bytes_per_token"]) == [2048, 576, 544] and list(t["ceiling"]) == [4, 14, 15]
    assert list(t["best_tokens_per_s"]) == [300.0, 700.0, 290.0] and list(t["best_batch"]) == [4, 14, 4]
    assert t["ceiling_tokens_per_s"].tolist()[:2] == [300.0, 700.0] and t["ceiling_tokens_per_s"].isna().tolist()[2]
    sentence = S.reading(df, baseline="fp16", fp8="nvfp4")["toy-qwen @ 64"]["sentence"]
    assert sentence.startswith("toy-qwen at 64 tokens: nvfp4 KV's best is 700 tokens/s (batch 14)")
    text = S.summary(df)
    assert "tokens/s to each KV dtype's ceiling:" in text and "bytes_per_token" in text
    with pytest.raises(ValueError, match="ceiling_table"):
        S.ceiling_table(df.drop(columns=["ceiling"]))
