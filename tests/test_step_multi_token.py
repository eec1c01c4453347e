"""The step with several new tokens per sequence (fp8kv.step): q_len 1 is the decode step bit for bit; the
verification step's logits against decoding the same tokens one at a time through the fp32 oracle; chunked
prefill against the full prefill; the accepted-tokens formula; the sweeps' rows; every new argument refused."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures import DEVICE, LIBRARY_TAKES_SIGTERM, seeded

from fp8kv import decode
from fp8kv import step as S
from fp8kv.capacity import ModelShape
from fp8kv.checks import MAX_REP_MS
from fp8kv.quant import relative_error
from fp8kv.reference import unit_roundoff
from fp8kv.rope import apply_rope, rope_cos_sin

# Two layers, GQA group 2, q/k norm, tied embeddings: every branch of the step at interpreter speed.
TOY = ModelShape("toy", 2, 4, 2, 32, hidden_size=64, max_position_embeddings=4096, intermediate_size=96,
                 vocab_size=128, tie_word_embeddings=True, rope_theta=10_000.0, rms_norm_eps=1e-6, qk_norm=True)
# The Triton path against the oracle's: fp16 roundings of the query and of the attention output (2^-11 each),
# compounded over 2 layers (as tests/test_step.py bounds the decode step's).
TRITON_TOL = 2**-8
# The reference path against itself at another row count: the fp32 GEMMs of B x q_len rows may round apart from
# those of B rows (2^-24 relative), which can move a 16-bit / FP8 cache element across a rounding boundary on
# rare elements; the logits stay within far less than one fp16 ulp (2^-11).
REFERENCE_TOL = 2**-13


def _weights(seed=1):
    return S.random_weights(TOY, torch.float32, DEVICE, seed=seed)


def _tokens(batch, n, seed=3):
    return torch.randint(0, TOY.vocab_size, (batch, n), generator=seeded(seed))


def _decode_logits(w, kv, tokens, backend="reference"):
    """Every position's logits ``[B, T, V]`` of ``tokens`` ``[B, T]`` fed one at a time through the decode step."""
    b, t = tokens.shape
    step = S.DecodeStep(TOY, w, S.KVPool(TOY, 16, kv).caches(b, 64), backend=backend)
    out = []
    for pos in range(t):
        step.input_ids.copy_(tokens[:, pos])
        step.set_positions(pos)
        out.append(step.forward())
    return torch.stack(out, 1), step


def _verify_logits(w, kv, tokens, q_len, backend):
    """The same tokens fed ``q_len`` at a time through the verification step: ``[B, T, V]``."""
    b, t = tokens.shape
    step = S.DecodeStep(TOY, w, S.KVPool(TOY, 16, kv).caches(b, 64), backend=backend, q_len=q_len)
    out = []
    for start in range(0, t, q_len):
        step.input_ids.copy_(tokens[:, start:start + q_len].reshape(-1))
        step.set_positions(start)
        out.append(step.forward().view(b, q_len, -1))
    return torch.cat(out, 1), step


# ----------------------------------------------------------------------------------- q_len 1: the decode step
def _decode_formula(w, caches, tokens, backend):
    """The decode step written out from its pieces (RMSNorm, fused QKV, q/k norm, RoPE, the cache write,
    fp8kv.decode, the MLP, the LM head): the computation q_len = 1 must keep bit for bit."""
    from fp8kv.ops import write_cache

    b, t = tokens.shape
    hq, hkv, d, eps = TOY.num_q_heads, TOY.num_kv_heads, TOY.head_dim, TOY.rms_norm_eps
    inv = S.rope_inv_freq(d, TOY.rope_theta).to(w.device)
    lin = torch.nn.functional.linear
    # the step's query dtype: the model's for the oracle, else fp16 in the interpreter and bf16 on a GPU
    q_dtype = torch.float32 if backend == "reference" else torch.bfloat16 if w.device.type == "cuda" else torch.float16
    logits = None
    for pos in range(t):
        slot = caches[0].block_table[:, pos // 16].long() * 16 + pos % 16
        caches[0].seq_lens.fill_(pos + 1)
        cos, sin = rope_cos_sin(torch.full((b,), pos, device=w.device), inv, torch.float32)
        x = w.embed[tokens[:, pos]]
        for lw, cache in zip(w.layers, caches, strict=True):
            q, k, v = lin(S.rms_norm(x, lw.input_norm, eps), lw.qkv).split([hq * d, hkv * d, hkv * d], -1)
            q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.reshape(b, hkv, d)
            q, k = S.rms_norm(q, lw.q_norm, eps), S.rms_norm(k, lw.k_norm, eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if backend == "reference":
                cache.write(k, v, slot)
            else:
                write_cache(cache, k, v, slot, count_saturated=False, check=False)
            attn = decode(q.to(q_dtype), cache, backend=backend, sm_scale=d ** -0.5, check=False)[0].float()
            x = x + lin(attn.reshape(b, hq * d), lw.o)
            x = x + S.gated_mlp(S.rms_norm(x, lw.post_norm, eps), lw.gate_up, lw.down)
        logits = lin(S.rms_norm(x, w.final_norm, eps), w.lm_head)
    return logits


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_q_len_1_is_the_decode_step_bit_for_bit(kv_dtype, backend):
    w, tokens = _weights(), _tokens(2, 18)
    step = S.DecodeStep(TOY, w, S.KVPool(TOY, 16, kv_dtype).caches(2, 48), backend=backend, q_len=1)
    for pos in range(tokens.shape[1]):
        step.input_ids.copy_(tokens[:, pos])
        step.set_positions(pos)
        got = step.forward()
    want = _decode_formula(w, S.KVPool(TOY, 16, kv_dtype).caches(2, 48), tokens, backend)
    assert got.shape == (2, TOY.vocab_size)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------ the verification step
@pytest.mark.parametrize("backend,tol", [("reference", REFERENCE_TOL), ("triton", TRITON_TOL)])
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_verify_step_matches_decoding_one_token_at_a_time(kv_dtype, backend, tol):
    """q_len = 4 rows per sequence (RoPE at each row's position, the four K/V written, causal attention among
    them) give each row the logits the oracle's decode gives that token, and leave the same cache."""
    w, tokens = _weights(), _tokens(2, 20)
    want, ref_step = _decode_logits(w, kv_dtype, tokens)
    got, step = _verify_logits(w, kv_dtype, tokens, 4, backend)
    assert got.shape == want.shape
    assert relative_error(got, want) < tol
    # per position, not only on the whole: a row attending the wrong keys would stand out
    per_pos = [relative_error(got[:, p], want[:, p]) for p in range(tokens.shape[1])]
    assert max(per_pos) < 4 * tol, per_pos
    assert step.seq_lens.tolist() == [20, 20]
    for a, b in zip(ref_step.caches, step.caches, strict=True):
        for i in range(2):
            (ka, va), (kb, vb) = a.gather(i), b.gather(i)
            # fp16's 2^-10, grown by the ratio of the query's unit roundoff where it is bf16 (a GPU)
            grow = max(1.0, unit_roundoff(step.q_dtype) / unit_roundoff("fp16"))
            bound = 2**-4 if kv_dtype.startswith("fp8") else 2**-10 * grow
            assert relative_error(kb, ka) < bound
            assert relative_error(vb, va) < bound


def test_verify_rows_at_swapped_positions_would_be_caught():
    """The comparison above fails for a step whose rows are rotated at each other's positions (RoPE sees only
    distances, so a shift of them all would not show; an order reversed does): the test can fail."""
    w, tokens = _weights(), _tokens(1, 8)
    want, _ = _decode_logits(w, "fp16", tokens)
    step = S.DecodeStep(TOY, w, S.KVPool(TOY, 16, "fp16").caches(1, 64), backend="reference", q_len=8)
    step.input_ids.copy_(tokens.reshape(-1))
    step.set_positions(0)
    step.positions.copy_(step.positions.flip(0))  # the first new token rotated as the last, and so on
    assert relative_error(step.forward().view(1, 8, -1), want) > 100 * REFERENCE_TOL


def test_logits_last_is_each_sequences_last_row():
    w, tokens = _weights(), _tokens(3, 5)
    every, _ = _verify_logits(w, "fp16", tokens, 5, "reference")
    step = S.DecodeStep(TOY, w, S.KVPool(TOY, 16, "fp16").caches(3, 64), backend="reference", q_len=5,
                        logits="last")
    step.input_ids.copy_(tokens.reshape(-1))
    step.set_positions(0)
    last = step.forward()
    assert last.shape == (3, TOY.vocab_size)
    assert relative_error(last, every[:, -1]) < REFERENCE_TOL


# ------------------------------------------------------------------------------------------ chunked prefill
@pytest.mark.parametrize("backend,tol", [("reference", REFERENCE_TOL), ("triton", TRITON_TOL)])
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8_e4m3"])
def test_chunked_prefill_gives_the_full_prefills_last_logits(kv_dtype, backend, tol):
    w, prompt = _weights(), _tokens(1, 40)
    full = S.ChunkedPrefill(TOY, w, S.KVPool(TOY, 16, kv_dtype).caches(1, 48), 40, 40, backend="reference")
    want = full.run(prompt)
    for chunk in (16, 7):  # chunks that end inside a page, and a shorter last chunk (40 = 2 x 16 + 8, 5 x 7 + 5)
        pre = S.ChunkedPrefill(TOY, w, S.KVPool(TOY, 16, kv_dtype).caches(1, 48), 40, chunk, backend=backend)
        assert [n for _, n in pre.spans] == [chunk] * (40 // chunk) + [40 % chunk]
        got = pre.run(prompt[0])
        assert got.shape == (1, TOY.vocab_size)
        assert relative_error(got, want) < tol, chunk
    # and the full prefill's last logits are those of decoding the prompt token by token
    dec, _ = _decode_logits(w, kv_dtype, prompt)
    assert relative_error(want, dec[:, -1]) < REFERENCE_TOL


def test_chunk_spans_cover_the_prompt():
    for prompt in (1, 15, 16, 17, 100):
        for chunk in (1, 3, 16, 200):
            spans = S.chunk_spans(prompt, chunk)
            assert spans[0][0] == 0 and sum(n for _, n in spans) == prompt
            assert all(s + n == s2 for (s, n), (s2, _) in zip(spans, spans[1:], strict=False))
            assert all(1 <= n <= chunk for _, n in spans) and len(spans) == math.ceil(prompt / chunk)


# ------------------------------------------------------------------------------- accepted tokens per step
@pytest.mark.parametrize("a,k,want", [(0.0, 4, 1.0), (1.0, 4, 5.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (0.5, 2, 1.75),
                                      (0.5, 1, 1.5), (0.9, 8, (1 - 0.9**9) / 0.1)])
def test_expected_accepted_edges(a, k, want):
    assert S.expected_accepted(a, k) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("k", [0, 1, 3, 8, 16])
def test_expected_accepted_is_the_geometric_series(k):
    for a in (0.0, 0.1, 0.5, 0.8, 0.999999, 1.0):
        assert S.expected_accepted(a, k) == pytest.approx(sum(a**i for i in range(k + 1)), rel=1e-9)
    # near a = 1 the closed form approaches k + 1 continuously
    assert S.expected_accepted(1 - 1e-9, k) == pytest.approx(k + 1, rel=1e-6)



@pytest.mark.parametrize("acceptance", [0.5, 0.999999, 1.0])
def test_a_draft_past_the_longest_is_refused_by_name(acceptance):
    """A float exponent or count that overflowed (OverflowError) before; the longest draft still counts exactly."""
    from fp8kv.step.speculative import MAX_DRAFT_LEN

    with pytest.raises(ValueError, match="draft_len=10000000000"):
        S.expected_accepted(acceptance, 10**10)
    want = MAX_DRAFT_LEN + 1 if acceptance == 1 else (1 - acceptance ** (MAX_DRAFT_LEN + 1)) / (1 - acceptance)
    assert S.expected_accepted(acceptance, MAX_DRAFT_LEN) == pytest.approx(want)


def test_a_draft_longer_than_a_context_is_refused_by_its_argument():
    """The sweep names draft_lens (the argument given), not the q_len = k + 1 its planner sees."""
    from fp8kv.step.speculative import verify_sweep

    with pytest.raises(ValueError, match=r"draft_lens\[1\]=999999: its 1000000 new tokens .* one of 64 tokens"):
        verify_sweep(["Qwen3-0.6B"], [64, 4096], [2, 999999], gpu_memory_gib=80)
    # a draft that fits is refused for what it is refused for, by the draft length that asked for the new tokens:
    # here a quantized format's pages (one new token only)
    with pytest.raises(ValueError, match=r"draft_lens\[1\]=2 with kv_dtypes='int8_token_head': .*expected draft_lens "
                                         r"of 0"):
        verify_sweep(["Qwen3-0.6B"], [64], [0, 2], kv_dtypes=["bf16", "int8_token_head"], gpu_memory_gib=80)


def test_a_prefill_names_the_chunk_a_quantized_format_cannot_read():
    """The chunk of several new tokens, not the q_len its planner sees; a chunk of one token reads the format."""
    from fp8kv.step.prefill import prefill_sweep

    with pytest.raises(ValueError, match=r"chunks\[1\]=16 with kv_dtypes='nvfp4': .*expected chunks of 1"):
        prefill_sweep(["Qwen3-0.6B"], [64], [1, 16], kv_dtypes=["nvfp4"], gpu_memory_gib=80, device="cpu")


@pytest.mark.parametrize("bad,exc", [(-0.1, ValueError), (1.0001, ValueError), (float("nan"), ValueError),
                                     (float("inf"), ValueError), ("0.5", TypeError), (True, TypeError),
                                     (None, TypeError)])
def test_expected_accepted_refuses_a_bad_acceptance(bad, exc):
    with pytest.raises(exc, match="acceptance"):
        S.expected_accepted(bad, 2)


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)])
def test_expected_accepted_refuses_a_bad_draft_len(bad, exc):
    with pytest.raises(exc, match="draft_len"):
        S.expected_accepted(0.5, bad)


# ------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize("kwargs,exc,needle", [
    ({"q_len": 0}, ValueError, "q_len=0"), ({"q_len": -2}, ValueError, "q_len=-2"),
    ({"q_len": 1.5}, TypeError, "q_len=1.5"), ({"q_len": True}, TypeError, "q_len=True"),
    ({"q_len": "2"}, TypeError, "q_len="), ({"logits": "first"}, ValueError, "logits='first'"),
    ({"logits": None}, ValueError, "logits=None"),
])
def test_step_refuses_bad_multi_token_arguments(kwargs, exc, needle):
    pool = S.KVPool(TOY, 16, "fp16")
    with pytest.raises(exc, match=needle):
        S.DecodeStep(TOY, _weights(), pool.caches(1, 32), backend="reference", **kwargs)


def test_set_positions_leaves_room_for_every_new_token():
    step = S.DecodeStep(TOY, _weights(), S.KVPool(TOY, 16, "fp16").caches(1, 32), backend="reference", q_len=4)
    step.set_positions(28)  # tokens 28..31: the last four slots
    assert step.positions.tolist() == [28, 29, 30, 31] and step.seq_lens.tolist() == [32]
    with pytest.raises(ValueError, match=r"outside \[0, 29\).*writes 4 new ones"):
        step.set_positions(29)
    fresh = S.DecodeStep(TOY, _weights(), S.KVPool(TOY, 16, "fp16").caches(1, 32), backend="reference", q_len=4)
    with pytest.raises(ValueError, match="call it before forward"):
        fresh.forward()


SWEEP = dict(gpu_memory_gib=0.0016, backend="reference", weights="random", device="cpu", progress=False, cpu_reps=1)


@pytest.mark.parametrize("kwargs,exc,needle", [
    ({"draft_lens": []}, ValueError, "draft_lens is empty"), ({"draft_lens": [-1]}, ValueError, "draft_lens=-1"),
    ({"draft_lens": ["2"]}, TypeError, "draft_lens="), ({"draft_lens": [1.5]}, TypeError, "draft_lens=1.5"),
    ({"draft_lens": "2"}, TypeError, "draft_lens="),
    ({"acceptance": 1.5}, ValueError, "acceptance=1.5"), ({"acceptance": [0.5, -0.5]}, ValueError, "acceptance=-0.5"),
    ({"acceptance": []}, ValueError, "acceptance is empty"), ({"acceptance": "0.7"}, TypeError, "acceptance="),
    ({"draft_us": -1.0}, ValueError, "draft_us=-1.0"), ({"draft_us": float("nan")}, ValueError, "draft_us=nan"),
    ({"draft_us": "5"}, TypeError, "draft_us="),
    ({"contexts": [4], "draft_lens": [4]}, ValueError, r"draft_lens\[0\]=4: its 5 new tokens .* one of 4 tokens"),
])
def test_verify_sweep_refuses_bad_input_before_building(monkeypatch, kwargs, exc, needle):
    from fp8kv.step import speculative

    monkeypatch.setattr(speculative, "KVPool", _never)
    args = dict(contexts=[64], draft_lens=[2], acceptance=0.7) | kwargs
    with pytest.raises(exc, match=needle):
        S.verify_sweep([S.TOY_QWEN], args.pop("contexts"), args.pop("draft_lens"), args.pop("acceptance"), ["fp16"],
                       **args, **SWEEP)


@pytest.mark.parametrize("prompts,chunks,exc,needle", [
    ([], [16], ValueError, "prompt_lens is empty"), ([0], [16], ValueError, "prompt_lens=0"),
    ([32], [0], ValueError, "chunks=0"), ([32], [], ValueError, "chunks is empty"),
    ([32.0], [16], TypeError, "prompt_lens=32.0"), ([32], ["16"], TypeError, "chunks="),
])
def test_prefill_sweep_refuses_bad_input_before_building(monkeypatch, prompts, chunks, exc, needle):
    from fp8kv.step import prefill

    monkeypatch.setattr(prefill, "KVPool", _never)
    with pytest.raises(exc, match=needle):
        S.prefill_sweep([S.TOY_QWEN], prompts, chunks, ["fp16"], **SWEEP)


RUN_OPTIONS = [  # checked by every sweep before it builds anything (they were errors in every row before)
    ({"backend": "bogus"}, ValueError, "backend='bogus'"), ({"mode": "fp4"}, ValueError, "mode='fp4'"),
    ({"cpu_reps": 0}, ValueError, "cpu_reps=0"), ({"cpu_reps": 1.5}, TypeError, "cpu_reps"),
    ({"rep": -1}, ValueError, "rep=-1"), ({"rep": 10**30}, ValueError, r"rep=10{30}; expected an int <= 10000"),
    ({"seed": 1.5}, TypeError, "seed"), ({"progress": "x"}, TypeError, "progress"),
    ({"dtype": torch.int8}, TypeError, "dtype=torch.int8"), ({"dtype": "float32"}, TypeError, "dtype='float32'"),
    ({"models": []}, ValueError, "models is empty"), ({"contexts": []}, ValueError, "(contexts|prompt_lens) is empty"),
    ({"batches": []}, ValueError, "batches is empty"),
]


SWEEP_CASES = [(sweep, *case) for sweep in ("sweep", "verify_sweep", "prefill_sweep") for case in RUN_OPTIONS
               if not (sweep == "prefill_sweep" and "batches" in case[0])]  # a prefill runs one sequence a prompt


@pytest.mark.parametrize("sweep,kwargs,exc,needle", SWEEP_CASES, ids=[f"{c[0]}-{c[1]}" for c in SWEEP_CASES])
def test_every_sweep_refuses_bad_run_options_before_building(monkeypatch, sweep, kwargs, exc, needle):
    from fp8kv.step import measure, prefill, speculative

    for module in (measure, prefill, speculative):
        monkeypatch.setattr(module, "KVPool", _never)
    args = SWEEP | {"models": [S.TOY_QWEN], "contexts": [64], "batches": [1]} | kwargs
    models, contexts, batches = args.pop("models"), args.pop("contexts"), args.pop("batches")
    if sweep == "prefill_sweep":  # prompts take the contexts' place
        call = lambda: S.prefill_sweep(models, contexts, [16], ["fp16"], **args)  # noqa: E731
    elif sweep == "verify_sweep":
        call = lambda: S.verify_sweep(models, contexts, [2], 0.7, ["fp16"], batches=batches, **args)  # noqa: E731
    else:
        call = lambda: S.sweep(models, contexts, ["fp16"], batches=batches, copy_bandwidth=False, **args)  # noqa: E731
    with pytest.raises(exc, match=needle):
        call()


def _never(*args, **kwargs):
    raise AssertionError("built before the arguments were refused")


def test_chunked_prefill_refuses_prompts_that_do_not_fit():
    w = _weights()
    with pytest.raises(ValueError, match="prompt=40 tokens do not fit the caches' 32"):
        S.ChunkedPrefill(TOY, w, S.KVPool(TOY, 16, "fp16").caches(1, 32), 40, 16, backend="reference")
    pre = S.ChunkedPrefill(TOY, w, S.KVPool(TOY, 16, "fp16").caches(1, 32), 20, 16, backend="reference")
    for bad in (torch.zeros(19, dtype=torch.int64), torch.zeros(2, 20, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"prompt_ids has shape .* expected ints of shape \[1, 20\]"):
            pre.run(bad)
    with pytest.raises(TypeError, match=r"prompt_ids is a torch.float32 tensor; expected ints"):
        pre.run(torch.zeros(20))
    for bad_id in (-1, TOY.vocab_size):  # -1 indexed the last token's embedding
        with pytest.raises(ValueError, match=rf"prompt_ids holds id {bad_id}; expected ids in \[0, {TOY.vocab_size}\)"):
            pre.run([bad_id] * 20)


# ---------------------------------------------------------------------------------------------- the ceiling
def test_ceiling_counts_the_verify_rows():
    shape, kw = _model("Qwen3-8B"), dict(gpu_memory_gib="H200")
    one = S.step_ceiling(shape, "bf16", 16384, **kw)
    assert S.step_ceiling(shape, "bf16", 16384, q_len=1, **kw)["ceiling"] == one["ceiling"]
    prev = one["ceiling"]
    for q in (2, 5, 9, 64, 512):
        c = S.step_ceiling(shape, "bf16", 16384, q_len=q, **kw)
        assert c["q_len"] == q and c["ceiling"] <= prev
        assert c["activation_bytes"] == S.activation_bytes(shape, c["ceiling"], q_len=q)
        prev = c["ceiling"]
    assert prev < one["ceiling"]  # 512 rows per sequence cost batch


def _model(name):
    from fp8kv.capacity import get_model

    return get_model(name)


def test_activations_grow_with_the_rows():
    shape = _model("Qwen3-8B")
    base = S.activation_bytes(shape, 4)
    assert S.activation_bytes(shape, 4, q_len=1) == base
    per_sequence = S.activation_bytes(shape, 5) - base  # one more sequence of one new token
    assert S.activation_bytes(shape, 4, q_len=8) > 8 * 4 * per_sequence


@pytest.mark.parametrize("kw, exc, pattern", [
    (dict(batch=0), ValueError, "batch=0"), (dict(batch=2.5), TypeError, "batch"), (dict(q_len=-3), ValueError, "q_len=-3"),
    (dict(num_sms=-1000), ValueError, "num_sms=-1000"), (dict(dtype=torch.int8), TypeError, "dtype=torch.int8"),
    (dict(dtype="fp16"), TypeError, "dtype='fp16'")])
def test_activation_bytes_refuses_bad_arguments_by_name(kw, exc, pattern):
    """A negative SM count gave negative bytes (and a larger ceiling); an int8 dtype counted one byte an element."""
    args = {"batch": 4, **kw}
    with pytest.raises(exc, match=pattern):
        S.activation_bytes(_model("Qwen3-8B"), args.pop("batch"), **args)


# ---------------------------------------------------------------------------------------------- the sweeps
def test_verify_sweep_rows():
    df = S.verify_sweep([S.TOY_QWEN], [40], [0, 3], [0.5, 1.0], ["fp16", "fp8_e4m3"], batches=[1, 2], draft_us=7.0,
                        **SWEEP)
    assert list(df.columns) == S.VERIFY_COLUMNS
    assert (df["status"] == "ok").all(), df["reason"].tolist()
    assert len(df) == 2 * 2 * 2 * 2  # dtypes x draft lengths x batches x acceptances
    for r in df.itertuples():
        assert r.q_len == r.draft_len + 1 and r.step_us == pytest.approx(r.verify_us + 7.0)
        assert r.accepted_per_step == pytest.approx(S.expected_accepted(r.acceptance, r.draft_len))
        assert r.accepted_tokens_per_s == pytest.approx(r.batch * r.accepted_per_step / (r.step_us * 1e-6))
        assert r.logits_finite is True and r.batch <= r.ceiling
    same = df.groupby(["kv_dtype", "draft_len", "batch"])["verify_us"].nunique()
    assert (same == 1).all()  # one timing serves every acceptance rate
    assert S.verify_summary(df)
    S.accepted_tokens_figure(df, draft_len=3, acceptance=0.5)


TOY_DRAFT = ModelShape("toy-draft", 1, 2, 1, 32, hidden_size=32, max_position_embeddings=4096, intermediate_size=48,
                       vocab_size=128, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True)


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3", "nvfp4"])
def test_a_draft_model_takes_its_weights_and_kv_off_the_ceiling(kv):
    """With a draft model on the GPU the ceiling is the largest batch whose target KV, draft KV (same dtype and
    context, the planner's bytes) and activations fit what is left after both models' weights."""
    from fp8kv.capacity import plan_capacity

    target, draft = _model("Qwen3-8B"), _model("Qwen3-0.6B")
    alone = S.step_ceiling(target, kv, 16384, gpu_memory_gib=141)
    both = S.step_ceiling(target, kv, 16384, gpu_memory_gib=141, draft_model="Qwen3-0.6B")
    d = plan_capacity(draft, kv, gpu_memory_gib=141, max_model_len=16384)
    bpseq = 16384 // 16
    assert both["draft_model"] == "Qwen3-0.6B" and both["draft_weights_bytes"] == d["weights_bytes"] > 0
    assert both["draft_bytes_per_seq"] == bpseq * d["block_bytes"]
    assert alone["draft_bytes_per_seq"] == 0 and alone["draft_model"] is None
    budget = alone["kv_budget_bytes"] + alone["activation_bytes"]  # what the target alone planned in

    def fits(b):
        need = b * bpseq * (alone["block_bytes"] + d["block_bytes"]) + S.activation_bytes(target, b)
        return need + alone["fixed_scale_bytes"] + d["fixed_scale_bytes"] <= budget - d["weights_bytes"]
    c = both["ceiling"]
    assert 1 <= c < alone["ceiling"] and fits(c) and not fits(c + 1)


@pytest.mark.parametrize("bad,exc,needle", [("NoSuchModel", ValueError, "NoSuchModel"), (7, TypeError, "draft_model=7")])
def test_verify_sweep_refuses_a_bad_draft_model(monkeypatch, bad, exc, needle):
    from fp8kv.step import speculative

    monkeypatch.setattr(speculative, "KVPool", _never)
    with pytest.raises(exc, match=needle):
        S.verify_sweep([S.TOY_QWEN], [40], [2], 0.7, ["fp16"], draft_model=bad, **SWEEP)


def test_verify_sweep_times_the_draft_models_steps():
    """Given a draft model and no draft_us, each batch's draft cost is k of the draft's own decode steps (one
    timing per batch, 0 for the plain decode step); its weights and KV lower the ceiling."""
    df = S.verify_sweep([S.TOY_QWEN], [40], [0, 2, 3], [0.5], ["fp16"], batches=[1, 2], draft_model=TOY_DRAFT,
                        **SWEEP)
    assert (df["status"] == "ok").all(), df["reason"].tolist()
    assert set(df["draft_model"]) == {"toy-draft"}
    assert (df[df["draft_len"] == 0]["draft_us"] == 0).all()
    for b in (1, 2):
        per = df[(df["batch"] == b) & (df["draft_len"] > 0)]
        one = per["draft_us"] / per["draft_len"]
        assert (one > 0).all() and one.nunique() == 1  # k x one measured draft step
    for r in df.itertuples():
        assert r.step_us == pytest.approx(r.verify_us + r.draft_us)
    plain = S.verify_sweep([S.TOY_QWEN], [40], [0], [0.5], ["fp16"], batches=[1], **SWEEP)
    assert df["ceiling"].iloc[0] < plain["ceiling"].iloc[0]
    fixed = S.verify_sweep([S.TOY_QWEN], [40], [2], [0.5], ["fp16"], batches=[1], draft_model=TOY_DRAFT,
                           draft_us=5.0, **SWEEP)
    assert (fixed["draft_us"] == 5.0).all()  # a given cost is used as given; the memory still counts
    assert fixed["ceiling"].iloc[0] == df[df["draft_len"] == 2]["ceiling"].iloc[0]


def test_prefill_sweep_rows():
    df = S.prefill_sweep([S.TOY_QWEN], [24, 40], [16, 64], ["fp16", "fp8_e4m3"], **SWEEP)
    assert list(df.columns) == S.PREFILL_COLUMNS
    assert (df["status"] == "ok").all(), df["reason"].tolist()
    assert len(df) == 2 * 2 * 2
    for r in df.itertuples():
        assert r.n_chunks == math.ceil(r.prompt / r.chunk) and r.ttft_us > 0
        assert r.prefill_tokens_per_s == pytest.approx(r.prompt / (r.ttft_us * 1e-6))
        # the attention calls are timed apart from the chunks: on a busy CPU's wall clock their share may pass 1
        assert r.attention_share == pytest.approx(r.attention_us / r.ttft_us) and r.attention_share > 0
    assert S.prefill_summary(df)
    S.ttft_figure(df)


# ---------------------------------------------------------------------------------------------- the CLI
@pytest.fixture
def toy_cli(monkeypatch):
    from fp8kv import capacity

    monkeypatch.setitem(capacity.MODEL_SHAPES, S.TOY_QWEN.name, S.TOY_QWEN)


@pytest.mark.parametrize("extra,needle", [
    (["--acceptance", "1.5"], "argument --acceptance: '1.5'"),
    (["--acceptance", "nan"], "argument --acceptance: 'nan'"),
    (["--draft-lens", "-1"], "argument --draft-lens: '-1'"),
    (["--draft-lens", "x"], "argument --draft-lens: 'x'"),
    (["--draft-us", "-3"], "argument --draft-us: '-3'"),
    (["--draft-us", "inf"], "argument --draft-us: 'inf'"),
    (["--prompt-lens", "0", "--chunks", "16"], "argument --prompt-lens: '0'"),
    (["--prompt-lens", "32", "--chunks", "0"], "argument --chunks: '0'"),
    (["--prompt-lens", "32"], "--prompt-lens and --chunks go together"),
    (["--rep", "10001"], "argument --rep: '10001': --rep=10001; expected an int <= 10000"),  # MAX_REP_MS
    (["--rep", "9" * 40], "expected an int <= 10000"),  # ran for ever
    (["--chunks", "32"], "--prompt-lens and --chunks go together"),
    (["--acceptance", "0.5"], "--acceptance 0.5: applies to the verification run"),
    (["--draft-us", "5"], "--draft-us 5.0: applies to the verification run"),
    (["--draft-model", "Qwen3-0.6B"], "--draft-model Qwen3-0.6B: applies to the verification run"),
    (["--draft-lens", "2", "--draft-model", "NoSuchModel"], "NoSuchModel"),
    (["--draft-lens", "2", "--prompt-lens", "32", "--chunks", "16"], "ask for two runs"),
    # the planner's refusals, named by the flags given (it sees q_len = k + 1 new tokens)
    (["--draft-lens", "80"], "--draft-lens=80: its 81 new tokens (k drafts and the bonus token) are the last of a "
                             "sequence's context, and --contexts holds one of 64 tokens"),
    (["--draft-lens", "1048577"], "argument --draft-lens: '1048577': --draft-lens=1048577; expected an int <= 1048576"),
    (["--draft-lens", "0", "2", "--kv-dtypes", "fp16", "int4_token_head"],
     "--draft-lens=2 with --kv-dtypes='int4_token_head': quantized pages are read by a decode of one new token"),
    (["--prompt-lens", "32", "--chunks", "1", "16", "--kv-dtypes", "mxfp4"],
     "--chunks=16 with --kv-dtypes='mxfp4': quantized pages are read by a decode of one new token"),
    (["--kv-dtypes", "int8_token_head", "--mode", "fp8"], "--mode='fp8' with --kv-dtypes='int8_token_head'"),
])
def test_cli_refuses_bad_multi_token_arguments(capsys, toy_cli, extra, needle):
    argv = ["--model", "toy-qwen", "--gpu-memory", "0.0016", "--device", "cpu", "--dry-run"]
    if "--prompt-lens" not in extra:
        argv += ["--contexts", "64"]
    with pytest.raises(SystemExit) as e:
        S.main(argv + extra)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_prefill_refuses_contexts(capsys, toy_cli):
    with pytest.raises(SystemExit) as e:
        S.main(["--model", "toy-qwen", "--gpu-memory", "0.0016", "--prompt-lens", "32", "--chunks", "16",
                "--contexts", "64", "--dry-run"])
    assert e.value.code == 2 and "drop --contexts" in capsys.readouterr().err


@pytest.mark.parametrize("kind,extra,folder", [
    ("verify", ["--contexts", "40", "--draft-lens", "0", "2", "--acceptance", "0.6", "--batches", "1"],
     "step-verify"),
    ("prefill", ["--prompt-lens", "24", "--chunks", "16"], "step-prefill"),
])
def test_cli_runs_and_saves_each_kind_in_its_folder(capsys, tmp_path, toy_cli, kind, extra, folder):
    import pandas as pd

    out = tmp_path / folder
    argv = ["--model", "toy-qwen", "--gpu-memory", "0.0016", "--device", "cpu", "--backend", "reference",
            "--weights", "random", "--kv-dtypes", "fp16", "--quiet", "--out", str(out), *extra]
    assert S.main(argv) == 0
    assert S.main(argv) == 0  # a second run beside the first, never over it
    csvs = sorted((out / "cpu").glob("*.csv"))
    assert len(csvs) == 2
    rows = pd.read_csv(csvs[0])
    assert list(rows.columns) == (S.VERIFY_COLUMNS if kind == "verify" else S.PREFILL_COLUMNS)
    assert (rows["status"] == "ok").all()


def test_draft_cost_is_draft_len_decode_steps_of_the_draft_model():
    kw = dict(backend="reference", device="cpu", cpu_reps=1)
    assert S.draft_cost_us(S.TOY_QWEN, 2, 32, 0, "fp16", **kw) == 0.0
    us = S.draft_cost_us(S.TOY_QWEN, 2, 32, 3, "fp16", **kw)
    assert us > 0 and math.isfinite(us)
    for bad, exc, needle in ((-1, ValueError, "draft_len=-1"), (2.0, TypeError, "draft_len=2.0")):
        with pytest.raises(exc, match=needle):
            S.draft_cost_us(S.TOY_QWEN, 2, 32, bad, "fp16", **kw)
    with pytest.raises(ValueError, match="batch=0"):
        S.draft_cost_us(S.TOY_QWEN, 0, 32, 3, "fp16", **kw)
    with pytest.raises(ValueError, match=f"rep={MAX_REP_MS + 1}; expected an int <= {MAX_REP_MS}"):
        S.draft_cost_us(S.TOY_QWEN, 2, 32, 3, "fp16", rep=MAX_REP_MS + 1, **kw)


@pytest.mark.parametrize("which", ["decode", "verify"])
def test_a_pool_or_weights_that_cannot_be_built_fail_their_rows_only(monkeypatch, which):
    """Both sweeps run through one loop (fp8kv.step.measure.run_pools): a KV pool that cannot be allocated
    (out of memory on a GPU) turns its own points into error rows naming why and the other dtype runs; weights
    that do not load turn every point of the model into such rows. Nothing is left out, nothing raises."""
    from fp8kv.step import measure

    real = measure.KVPool

    def pool(shape, blocks, kv, **kw):
        if kv == "fp8_e4m3":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(shape, blocks, kv, **kw)

    def run():
        if which == "decode":
            return S.sweep([S.TOY_QWEN], [40], ["fp16", "fp8_e4m3"], batches=[1, 2], **SWEEP)
        return S.verify_sweep([S.TOY_QWEN], [40], [0, 2], [0.5], ["fp16", "fp8_e4m3"], batches=[1, 2], **SWEEP)

    monkeypatch.setattr(measure, "KVPool", pool)
    df = run()
    assert len(df) == 2 * 2 * (1 if which == "decode" else 2)
    bad, ok = df[df["kv_dtype"] == "fp8_e4m3"], df[df["kv_dtype"] == "fp16"]
    assert (ok["status"] == "ok").all(), ok["reason"].tolist()
    assert (bad["status"] == "error").all()
    assert bad["reason"].str.contains("allocating the fp8_e4m3 KV pool: OutOfMemoryError").all()
    monkeypatch.setattr(measure, "KVPool", real)
    monkeypatch.setattr(measure, "load_weights", lambda *a, **k: (_ for _ in ()).throw(OSError("no weights")))
    df = run()
    assert (df["status"] == "error").all() and df["reason"].str.contains("loading the weights: OSError").all()


def _interrupt_at(monkeypatch, n: int):
    """Ctrl-C (or a stop signal the CLI turns into it) as the ``n``-th step of the run is built."""
    from fp8kv.step import measure, prefill

    built = []

    def build(real):
        def step(*args, **kwargs):
            built.append(1)
            if len(built) == n:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return step

    monkeypatch.setattr(measure, "DecodeStep", build(measure.DecodeStep))
    monkeypatch.setattr(prefill, "DecodeStep", build(prefill.DecodeStep))


@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
def test_an_interrupted_sweep_keeps_the_points_it_measured(monkeypatch, kind):
    """Each step sweep: by default an interrupt stops the caller (a notebook cell); with keep_partial the rows
    measured before it come back, marked interrupted, and a run that was not interrupted says so."""
    run = {"decode": lambda **kw: S.sweep([S.TOY_QWEN], [40], ["fp16"], batches=[1, 2, 3], copy_bandwidth=False,
                                          **SWEEP, **kw),
           "verify": lambda **kw: S.verify_sweep([S.TOY_QWEN], [40], [0, 2], 0.5, ["fp16"], batches=[1, 2], **SWEEP,
                                                 **kw),
           "prefill": lambda **kw: S.prefill_sweep([S.TOY_QWEN], [24, 40], [64], ["fp16"], **SWEEP, **kw)}[kind]
    whole = run()
    assert whole.attrs["step"]["interrupted"] is False and len(whole) >= 2 and (whole["status"] == "ok").all()
    _interrupt_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run()
    _interrupt_at(monkeypatch, 2)
    df = run(keep_partial=True)
    assert df.attrs["step"]["interrupted"] is True
    assert len(df) == 1 and (df["status"] == "ok").all()  # the first point, whole; none after the interrupt
    point = [c for c in ("model", "kv_dtype", "context", "prompt", "chunk", "draft_len", "batch", "acceptance")
             if c in df.columns]
    assert df[point].iloc[0].equals(whole[point].iloc[0])  # the first point of the whole run


STEP_TIMEOUT_AFTER_A_LIBRARY_TOOK_SIGTERM = LIBRARY_TAKES_SIGTERM + """
import os, sys
from fp8kv import capacity, step
from fp8kv.step import measure
capacity.MODEL_SHAPES[step.TOY_QWEN.name] = step.TOY_QWEN
real, built = measure.DecodeStep, []
def build(*args, **kwargs):
    built.append(1)
    if len(built) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    got = real(*args, **kwargs)
    library_takes_sigterm()
    return got
measure.DecodeStep = build
sys.exit(step.main(["--model", "toy-qwen", "--contexts", "64", "--gpu-memory", "0.0016", "--weights", "random",
                    "--quiet", "--device", "cpu", "--backend", "reference", "--kv-dtypes", "fp16", "--batches", "1",
                    "2", "--out", sys.argv[1]]))
"""


def test_the_step_cli_saves_what_it_measured_when_terminated(tmp_path):
    """A timeout's SIGTERM during the second point, after a library took the handler in the first: the first
    point is saved and the exit status is 130."""
    import subprocess
    import sys

    import pandas as pd

    got = subprocess.run([sys.executable, "-c", STEP_TIMEOUT_AFTER_A_LIBRARY_TOOK_SIGTERM, str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 130 and "interrupted" in got.stderr, (got.returncode, got.stderr[-2000:])
    (csv,) = tmp_path.glob("*/*.csv")
    rows = pd.read_csv(csv)
    assert list(rows["batch"]) == [1] and list(rows["status"]) == ["ok"]


def test_a_step_run_interrupted_before_its_first_point_exits_130_and_saves_nothing(monkeypatch, tmp_path, capsys):
    from fp8kv import capacity

    monkeypatch.setitem(capacity.MODEL_SHAPES, S.TOY_QWEN.name, S.TOY_QWEN)
    _interrupt_at(monkeypatch, 1)
    code = S.main(["--model", "toy-qwen", "--contexts", "64", "--gpu-memory", "0.0016", "--weights", "random",
                   "--quiet", "--device", "cpu", "--backend", "reference", "--kv-dtypes", "fp16", "--batches", "1",
                   "--out", str(tmp_path)])
    assert code == 130 and "interrupted before a point was measured: nothing to save" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.csv"))


def test_sweep_runs_stops_at_an_interrupted_pair(monkeypatch):
    _interrupt_at(monkeypatch, 2)
    df = S.sweep_runs([(S.TOY_QWEN, 40), (S.TOY_QWEN, 48)], ["fp16"], batches=[1, 2], copy_bandwidth=False,
                      keep_partial=True, **SWEEP)
    assert df.attrs["step"]["interrupted"] is True
    assert list(df["context"]) == [40] and list(df["batch"]) == [1]  # the second pair never started


@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
@pytest.mark.parametrize("value", [1, "no", None])
def test_keep_partial_must_be_a_bool(kind, value):
    run = {"decode": lambda **kw: S.sweep([S.TOY_QWEN], [40], ["fp16"], batches=[1], **SWEEP, **kw),
           "verify": lambda **kw: S.verify_sweep([S.TOY_QWEN], [40], [0], 0.5, ["fp16"], batches=[1], **SWEEP, **kw),
           "prefill": lambda **kw: S.prefill_sweep([S.TOY_QWEN], [24], [64], ["fp16"], **SWEEP, **kw)}[kind]
    with pytest.raises(TypeError, match=rf"keep_partial={value!r} \({type(value).__name__}\); expected True or False"):
        run(keep_partial=value)


# ------------------------------------------------------------------------------- the attention kernel's speed-up
def _attend_row(kv, mode, time_us, *, q_len=2, context=100, variant="", status="ok"):
    return dict(backend="triton", mode=mode, variant=variant, kv_dtype=kv, batch=4, context=context, q_len=q_len,
                num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, layout="NHD", q_dtype="bf16",
                time_us=time_us, status=status)


def test_one_bf16_row_is_the_baseline_of_both_fp8_modes():
    """The baseline runs in dequant mode only: joined on a key with the mode, every fp8-mode row was dropped."""
    import pandas as pd

    rows = pd.DataFrame([_attend_row("bf16", "dequant", 100.0), _attend_row("fp8_e4m3", "dequant", 50.0),
                         _attend_row("fp8_e4m3", "fp8", 25.0), _attend_row("fp8_e4m3", "fp8", 1.0, status="error")])
    sp = S.attend_speedup(rows).set_index("mode")
    assert sorted(sp.index) == ["dequant", "fp8"]
    assert sp.loc["dequant", "speedup"] == pytest.approx(2.0) and sp.loc["fp8", "speedup"] == pytest.approx(4.0)
    assert (sp["base_us"] == 100.0).all() and sp.loc["fp8", "fp8_us"] == 25.0


def test_a_variant_is_compared_with_its_own_baseline_else_the_default_launch():
    import pandas as pd

    rows = pd.DataFrame([_attend_row("bf16", "dequant", 100.0), _attend_row("bf16", "dequant", 80.0, variant="block_n=32"),
                         _attend_row("fp8_e4m3", "dequant", 40.0, variant="block_n=32"),
                         _attend_row("fp8_e4m3", "dequant", 50.0, variant="gluon=False"),  # 16-bit pages skip it
                         _attend_row("fp8_e4m3", "dequant", 25.0)])
    sp = S.attend_speedup(rows).set_index("variant")["speedup"]
    assert sp.to_dict() == pytest.approx({"block_n=32": 2.0, "gluon=False": 2.0, "": 4.0})
    csv = rows.assign(variant=rows["variant"].replace("", float("nan")))  # a CSV reads "" back as NaN
    assert S.attend_speedup(csv).set_index("variant")["speedup"].to_dict() == pytest.approx(sp.to_dict())
    with pytest.raises(ValueError, match=r"2 bf16 rows of one cell \(backend=triton.*pass the rows of one run"):
        S.attend_speedup(pd.concat([rows, rows.iloc[:1]]))


def test_the_speedup_figure_draws_each_mode_apart():
    import pandas as pd

    rows = pd.DataFrame([_attend_row(kv, mode, t, q_len=q, context=c) for q in (1, 4) for c in (100, 200)
                         for kv, mode, t in (("bf16", "dequant", 100.0), ("fp8_e4m3", "dequant", 60.0),
                                             ("fp8_e4m3", "fp8", 40.0))])
    fig = S.attend_speedup_figure(rows)
    names = [t.name for t in fig.data]
    assert len(names) == len(set(names)) == 2 * (2 + 2)  # (two contexts left, two q_lens right) x two modes
    for mode, dash, y in (("dequant", "solid", 100 / 60), ("fp8", "dash", 100 / 40)):
        mine = [t for t in fig.data if f", {mode} mode," in t.name]
        assert len(mine) == 4 and {t.line.dash for t in mine} == {dash}
        assert all(v == pytest.approx(y) for t in mine for v in t.y)
    # the left panel's lines: a colour a context, both modes of it in that colour and one legend group (the dash apart)
    left = [t for t in fig.data if t.xaxis == "x"]
    assert len({t.line.color for t in left}) == len({t.legendgroup for t in left}) == 2
    assert all(len({t.line.dash for t in left if t.legendgroup == g}) == 2 for g in {t.legendgroup for t in left})
    assert len({t.line.color for t in fig.data}) == 2 + 2  # two contexts, two q_lens: no colour shared between them
