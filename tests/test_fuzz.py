"""Property fuzzing of fp8kv's public entry points: every call either refuses its input with a
``TypeError``/``ValueError`` that names the argument, or answers what the fp32 oracle
(:mod:`fp8kv.reference`) or an independent computation answers, within the tolerances of
tests/test_ops.py and tests/test_quant.py (``fp8kv.reference.output_tolerance`` / ``lse_tolerance``,
``conftest.assert_rel_err``). No other exception type (IndexError, KeyError, a torch RuntimeError,
ZeroDivisionError...) and no NaN/Inf in an accepted result unless the oracle has one too (where
the fp32 oracle itself overflows, a float64 computation of the same formula stands in for it).

Families here: ``fp8kv.decode`` (reference and Triton backends, window / soft_cap / sinks, both
modes, sm_scale, check), the paged cache (``from_dense``, ``empty``, ``write``, ``append``,
``slots``, ``gather``, ``fp8kv.ops.write_cache``), the quantizer, the capacity planner and the
synthetic generators. The file readers and the command lines are in tests/test_fuzz_io.py.

Every failure found is pinned as an ``@example``, so it stays tested whatever the generator draws.

Profiles (hypothesis, derandomized: the same examples on every run):

* default ``FP8KV_FUZZ=ci``: a few examples per test (3 x the count each test names), tiny shapes (batch <= 3, length <= 40,
  head_dim 16/32), so both modules run in about a minute and a half on two cores under the
  Triton interpreter;
* ``FP8KV_FUZZ=long``: twenty times the examples (60 x), for a run by hand::

      FP8KV_FUZZ=long TRITON_INTERPRET=1 python -m pytest -q tests/test_fuzz.py tests/test_fuzz_io.py

* ``FP8KV_FUZZ=explore``: as long, without the pinned ``@example`` cases (a failing explicit example
  stops a test before it generates any): what else the generators find.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import fp8kv
from conftest import make_cache
from fp8kv import checks, reference
from fp8kv.cache import LAYOUTS, PagedKVCache
from fp8kv.capability import AUTO_MODE
from fp8kv.checks import FP32_MAX, FP32_TINY
from fp8kv.formats import FORMATS
from fp8kv.quant import GRANULARITIES, quantize
from fp8kv.reference import lse_tolerance, output_tolerance, score_bound

# ------------------------------------------------------------------------------------------ profiles
_COMMON = dict(derandomize=True, deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                      HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
settings.register_profile("fp8kv-fuzz-ci", max_examples=3, **_COMMON)
settings.register_profile("fp8kv-fuzz-long", max_examples=60, **_COMMON)
# generated examples only: what the fuzz finds besides the failures pinned as @example
settings.register_profile("fp8kv-fuzz-explore", max_examples=60, phases=[Phase.generate, Phase.shrink], **_COMMON)
PROFILE = os.environ.get("FP8KV_FUZZ", "ci")
if PROFILE not in ("ci", "long", "explore"):
    raise ValueError(f"FP8KV_FUZZ={PROFILE!r}; expected 'ci' (default), 'long' or 'explore'")
_BASE = settings.get_profile(f"fp8kv-fuzz-{PROFILE}")


def fuzz(examples: int) -> settings:
    """The settings of a fuzz test: ``examples`` x the profile's factor (its ``max_examples``: 3 in CI, 60 in
    the long and explore profiles) generated examples."""
    return settings(_BASE, max_examples=examples * _BASE.max_examples)


# ------------------------------------------------------------------------------------------ the property
class Refused(Exception):
    """Internal: the call refused its input with a named TypeError/ValueError (checked)."""


def attempt(call, names):
    """``call()``'s result, or :class:`Refused` after checking that its TypeError/ValueError names one
    of ``names``. Any other exception propagates: a failure of the property."""
    try:
        return call()
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        assert any(n in msg for n in names), \
            f"{type(exc).__name__} names none of {sorted(names)}: {msg}"
        raise Refused from exc


def refuses(call, names) -> bool:
    """True when ``call()`` was refused (by name), False when it answered."""
    try:
        attempt(call, names)
    except Refused:
        return True
    return False


def tagged(legal, illegal):
    """``(value, is_legal)`` pairs drawn from two strategies."""
    return st.one_of(legal.map(lambda v: (v, True)), illegal.map(lambda v: (v, False)))


# Reasons a *legal* decode may still be refused (the capability table): they name what they refuse.
CAPABILITY_NAMES = ("mode", "backend", "granularity", "kv_dtype", "q", "layout", "head_dim", "window",
                    "soft_cap", "sinks", "dtype")


# ------------------------------------------------------------------------------------------ decode
@st.composite
def decode_setups(draw, backends=("reference", "triton")):
    """A small cache (``conftest.make_cache``'s backend-matrix data) and a query for it."""
    batch = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    hkv, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([16, 32]))
    kv_dtype = draw(st.sampled_from(["fp8_e4m3", "fp8_e5m2", "fp16", "bf16"]))
    granularity = draw(st.sampled_from(GRANULARITIES))
    layout = draw(st.sampled_from(LAYOUTS))
    block_size = draw(st.sampled_from([8, 16]))
    backend = draw(st.sampled_from(backends))
    mode = draw(st.sampled_from(["dequant", "fp8", "auto"]))
    q_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16] + ([torch.float32] if backend == "reference" else [])))
    seed = draw(st.integers(0, 3))
    return dict(lens=lens, hkv=hkv, group=group, head_dim=head_dim, kv_dtype=kv_dtype, granularity=granularity,
                layout=layout, block_size=block_size, backend=backend, mode=mode, q_dtype=q_dtype, seed=seed)


def build(setup):
    s = setup
    cache = make_cache(s["lens"], s["hkv"], s["head_dim"], kv_dtype=s["kv_dtype"], granularity=s["granularity"],
                       layout=s["layout"], block_size=s["block_size"], seed=s["seed"], data="ragged")
    g = torch.Generator().manual_seed(s["seed"] + 7)
    q = torch.randn(len(s["lens"]), s["hkv"] * s["group"], s["head_dim"], generator=g).to(s["q_dtype"])
    return q, cache


def check_decode(q, cache, backend, mode, granularity, bad=(), **kw):
    """The decode property: refused by name (``bad``: the illegal arguments given, one of which must be
    named), or the oracle's answer within the backend's tolerance."""
    try:
        out, lse = attempt(lambda: fp8kv.decode(q, cache, backend, mode, **kw), bad or CAPABILITY_NAMES)
    except Refused:
        return
    assert not bad, f"accepted illegal {list(bad)}: {kw}"
    variants = {k: kw.get(k) for k in ("window", "soft_cap", "sinks")}
    sm_scale = kw.get("sm_scale")
    ref_out, ref_lse = reference.paged_attention(q, cache, None if sm_scale is None else float(sm_scale),
                                                 **{k: (float(v) if k == "soft_cap" and v is not None else v)
                                                    for k, v in variants.items()})
    finite_ref = bool(torch.isfinite(ref_out).all() and torch.isfinite(ref_lse).all())
    if not finite_ref:  # the oracle has NaN/Inf (e.g. NaN sinks under check=False): nothing to compare
        return
    sinks = kw.get("sinks")
    if kw.get("check") is False and isinstance(sinks, torch.Tensor) and float(sinks.abs().max()) > checks.MAX_SINK:
        return  # contents check=True refuses are the caller's promise under check=False (fp8kv.decode's docstring)
    assert torch.isfinite(out).all(), f"non-finite output where the oracle is finite ({kw})"
    assert torch.isfinite(lse).all(), f"non-finite lse where the oracle is finite ({kw})"
    mode = AUTO_MODE if mode == "auto" else mode
    if backend == "triton":
        assert out.dtype == q.dtype and out.shape == q.shape, f"out {out.dtype} {tuple(out.shape)}"
    bound = score_bound(q, cache, None if sm_scale is None else float(sm_scale))
    tol = output_tolerance(backend, mode, q.dtype, granularity, score_bound=bound)
    assert out.shape == ref_out.shape
    # Below the output type's normal range a rounding loses up to half a subnormal step, not u relative
    # (outputs a dominant sink shrinks to 1e-5 are fp16 subnormals): one step per element for p and out.
    floor = math.sqrt(out.numel()) * float(torch.finfo(out.dtype).smallest_normal) * float(torch.finfo(out.dtype).eps)
    err = float((out.double() - ref_out.double()).norm())
    assert err <= tol * float(ref_out.double().norm()) + floor, \
        f"{backend} out {kw}: error {err:.3e} > {tol:.1e} x |ref| {float(ref_out.norm()):.3e} + {floor:.1e}"
    err = float((lse - ref_lse).abs().max())
    tol = lse_tolerance(backend, mode, q.dtype, ref_lse, granularity, score_bound=bound)
    assert err <= tol, f"{backend} lse error {err:.3e} > {tol:.3e} ({kw})"


def runnable(q, cache, setup) -> bool:
    """Whether the setup's decode runs here without any variant (else the capability table refused it,
    by name: a setup, not a finding)."""
    return not refuses(lambda: fp8kv.decode(q, cache, setup["backend"], setup["mode"]), CAPABILITY_NAMES)


def run_setup(setup, bad=(), **kw):
    q, cache = build(setup)
    if not runnable(q, cache, setup):
        return
    check_decode(q, cache, setup["backend"], setup["mode"], cache.granularity, bad, **kw)


TRITON_FP8 = dict(lens=[5, 33], hkv=2, group=2, head_dim=16, kv_dtype="fp8_e4m3", granularity="tensor",
                  layout="NHD", block_size=16, backend="triton", mode="dequant", q_dtype=torch.float16, seed=0)

SM_SCALE = tagged(st.one_of(st.floats(1e-3, 10.0), st.sampled_from([1, 2, 1e-8, 1e-30, FP32_TINY, 1e4, 1e30, 1e-320,
                                                                   1e39])),
                  st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -float("inf"), True, "0.1",
                                   torch.tensor(0.1), [0.1]]))


@fuzz(6)
@given(setup=decode_setups(), sm_scale=SM_SCALE, check=st.booleans())
def test_decode_sm_scale(setup, sm_scale, check):
    value, legal = sm_scale
    run_setup(setup, () if legal else ("sm_scale",), sm_scale=value, check=check)


WINDOW = tagged(st.one_of(st.integers(1, 45), st.sampled_from([2**31, 2**63, 2**70])),
                st.sampled_from([0, -1, -(2**40), True, False, 3.0, 2.5, "4", float("nan")]))


@fuzz(6)
@given(setup=decode_setups(), window=WINDOW, check=st.booleans())
def test_decode_window(setup, window, check):
    value, legal = window
    run_setup(setup, () if legal else ("window",), window=value, check=check)


SOFT_CAP = tagged(st.one_of(st.floats(0.5, 100.0), st.sampled_from([1, 1e-3, 1e-20, 1e-30, 1e-38, 1e-40, FP32_TINY,
                                                                     1e20, 1e30])),
                  st.sampled_from([0.0, -2.0, float("nan"), float("inf"), 1e31, True, "30", 5e-324]))


@fuzz(6)
@given(setup=decode_setups(), soft_cap=SOFT_CAP, check=st.booleans())
@example(setup=TRITON_FP8, soft_cap=(1e-30, True), check=True)
@example(setup=TRITON_FP8, soft_cap=(FP32_TINY, True), check=True)
def test_decode_soft_cap(setup, soft_cap, check):
    value, legal = soft_cap
    run_setup(setup, () if legal else ("soft_cap",), soft_cap=value, check=check)


SINK_VALUES = st.one_of(st.floats(-20.0, 20.0), st.sampled_from([0.0, 1e4, -1e4, 1e30, -1e30, 3e38, -3e38,
                                                                  FP32_MAX, -FP32_MAX, FP32_TINY]))
SINK_KINDS = tagged(st.sampled_from(["values", "strided", "expanded", "transposed-view"]),
                    st.sampled_from(["fp16", "fp64", "int32", "short", "long", "2d", "0d", "meta", "nan", "inf",
                                     "list", "number"]))


def make_sinks(kind: str, hq: int, value: float, device):
    """Sinks ``[hq]`` of the given kind (legal ones hold ``value`` around a spread of finite logits)."""
    base = torch.linspace(-2.0, 2.0, hq) + 0.0
    base[0] = value
    return {
        "values": lambda: base.clone(),
        "strided": lambda: torch.stack([base, torch.full_like(base, 99.0)], 1).reshape(-1)[::2],
        "expanded": lambda: torch.tensor(value).expand(hq),
        "transposed-view": lambda: torch.stack([base, base + 50.0]).t()[:, 0],
        "fp16": lambda: base.half(), "fp64": lambda: base.double(), "int32": lambda: base.int(),
        "short": lambda: base[: hq - 1] if hq > 1 else base[:0], "long": lambda: torch.cat([base, base]),
        "2d": lambda: base[None], "0d": lambda: base[0], "meta": lambda: base.to("meta"),
        "nan": lambda: base.clone().fill_(float("nan")), "inf": lambda: base.clone().fill_(float("inf")),
        "list": lambda: base.tolist(), "number": lambda: value,
    }[kind]()


@fuzz(8)
@given(setup=decode_setups(), kind=SINK_KINDS, value=SINK_VALUES, check=st.booleans())
@example(setup=TRITON_FP8, kind=("strided", True), value=0.0, check=True)
@example(setup=TRITON_FP8, kind=("expanded", True), value=1.5, check=True)
@example(setup=TRITON_FP8, kind=("values", True), value=3e38, check=True)
@example(setup=TRITON_FP8, kind=("values", True), value=FP32_MAX, check=False)
@example(setup=dict(TRITON_FP8, lens=[1], hkv=1, group=1, block_size=8), kind=("values", True), value=12.0,
         check=False)  # a dominant sink: outputs near 1e-5, fp16 subnormals
def test_decode_sinks(setup, kind, value, check):
    (kind, legal), hq = kind, setup["hkv"] * setup["group"]
    if kind in ("nan", "inf") and not check:
        legal = True  # contents are checked only with check=True; the oracle then has NaN too
    sinks = make_sinks(kind, hq, value, "cpu")
    run_setup(setup, () if legal else ("sinks",), sinks=sinks, check=check)


def legal(tagged_strategy):
    """The legal values of a :func:`tagged` strategy's legal side, as ``(value, True)``."""
    return tagged_strategy.filter(lambda vt: vt[1])


@fuzz(12)
@given(setup=decode_setups(), sm_scale=legal(SM_SCALE), window=legal(WINDOW), soft_cap=legal(SOFT_CAP),
       sink=SINK_VALUES, use=st.lists(st.sampled_from(["sm_scale", "window", "soft_cap", "sinks"]), unique=True))
@example(setup=dict(TRITON_FP8, lens=[3], hkv=2, group=1, granularity="channel", block_size=8), sm_scale=(1.0, True),
         window=(1, True), soft_cap=(1.0, True), sink=0.0, use=["sm_scale"])
@example(setup=dict(TRITON_FP8, lens=[1, 16, 40], hkv=2, group=1, head_dim=32, granularity="channel", block_size=8),
         sm_scale=(1.0, True), window=(1, True), soft_cap=(1.0, True), sink=0.0, use=["sm_scale", "window", "soft_cap"])
def test_decode_variants_together(setup, sm_scale, window, soft_cap, sink, use):
    """Legal variants in every combination (a tiny cap with a tiny or huge sm_scale, a window with sinks...)."""
    hq = setup["hkv"] * setup["group"]
    kw = dict(sm_scale=sm_scale[0], window=window[0], soft_cap=soft_cap[0], sinks=make_sinks("values", hq, sink, "cpu"))
    run_setup(setup, **{k: v for k, v in kw.items() if k in use})


QUERY_DAMAGE = st.sampled_from(["transposed", "expanded", "strided-batch", "fp64", "int", "fp8", "meta", "2d",
                                "head_dim", "batch", "heads", "empty", "nan", "list"])


@fuzz(8)
@given(setup=decode_setups(), damage=QUERY_DAMAGE, check=st.booleans())
def test_decode_damaged_query(setup, damage, check):
    q, cache = build(setup)
    if not runnable(q, cache, setup):
        return
    b, hq, d = q.shape
    legal = damage in ("expanded", "strided-batch") or (damage == "transposed" and setup["backend"] == "reference") \
        or (damage == "nan" and not check)
    bad_q = {
        "transposed": lambda: q.transpose(1, 2).contiguous().transpose(1, 2),
        "expanded": lambda: q[:1].expand(b, hq, d),
        "strided-batch": lambda: torch.stack([q, q + 1], 1)[:, 0],
        "fp64": lambda: q.double(), "int": lambda: q.int(), "fp8": lambda: q.float().to(torch.float8_e4m3fn),
        "meta": lambda: q.to("meta"), "2d": lambda: q[0], "head_dim": lambda: q[..., : d // 2],
        "batch": lambda: torch.cat([q, q]), "heads": lambda: q[:, :0] if hq == 1 else q[:, :1].expand(b, 3, d),
        "empty": lambda: q[:0], "nan": lambda: q.clone().fill_(float("nan")), "list": lambda: q.tolist(),
    }[damage]()
    if damage == "transposed" and bad_q.stride(-1) == 1:
        legal = True  # one head: the transposed copy is contiguous in head_dim after all
    if damage == "heads" and (3 % cache.num_kv_heads == 0) and hq != 1:
        legal = True  # 3 heads over 1 KV head is a legal GQA group
    if damage == "nan" and not check:
        return  # q NaN unchecked: the oracle is NaN as well, and the property says nothing more
    check_decode(bad_q, cache, setup["backend"], setup["mode"], cache.granularity, () if legal else ("q",), check=check)


CACHE_DAMAGE = st.sampled_from(["seq_lens-past-capacity", "seq_lens-negative", "seq_lens-zero", "block_table-range",
                                "block_table-negative", "k_scale-nan", "v_scale-negative", "k_scale-zero",
                                "k_scale-shape", "v_scale-dtype", "k_pages-dtype", "seq_lens-dtype",
                                "block_table-noncontiguous"])
CACHE_NAMES = {"seq_lens-zero": ("seq_lens",), "k_scale-shape": ("k_scale",), "v_scale-dtype": ("v_scale",)}


@fuzz(8)
@given(setup=decode_setups(), damage=CACHE_DAMAGE)
@example(setup=dict(TRITON_FP8, backend="reference"), damage="seq_lens-past-capacity")
@example(setup=TRITON_FP8, damage="seq_lens-zero")
def test_decode_damaged_cache(setup, damage):
    """Tables and scales edited after construction (check=True, the default): refused by name."""
    q, cache = build(setup)
    if not runnable(q, cache, setup):
        return
    name = damage.split("-")[0]
    cap = cache.max_blocks_per_seq * cache.block_size
    edit = {
        "seq_lens-past-capacity": lambda: cache.seq_lens.__setitem__(0, cap + 5),
        "seq_lens-negative": lambda: cache.seq_lens.__setitem__(0, -3),
        "seq_lens-zero": lambda: cache.seq_lens.__setitem__(0, 0),
        "block_table-range": lambda: cache.block_table.__setitem__((0, 0), cache.num_blocks + 3),
        "block_table-negative": lambda: cache.block_table.__setitem__((0, 0), -1),
        "k_scale-nan": lambda: cache.k_scale.fill_(float("nan")) if cache.is_fp8 else None,
        "v_scale-negative": lambda: cache.v_scale.fill_(-1.0),
        "k_scale-zero": lambda: cache.k_scale.fill_(0.0),
        "k_scale-shape": lambda: setattr(cache, "k_scale", torch.ones(7, 3)),
        "v_scale-dtype": lambda: setattr(cache, "v_scale", cache.v_scale.double()),
        "k_pages-dtype": lambda: setattr(cache, "k_pages", cache.k_pages.view(torch.uint8)
                                         if cache.k_pages.element_size() == 1 else cache.k_pages.view(torch.int16)),
        "seq_lens-dtype": lambda: setattr(cache, "seq_lens", cache.seq_lens.long()),
        "block_table-noncontiguous": lambda: setattr(cache, "block_table",
                                                     torch.stack([cache.block_table] * 2, -1)[..., 0]),
    }[damage]
    edit()
    # a 16-bit cache's scale is 1 and the NaN edit skipped it: nothing is damaged, the decode must answer
    bad = () if damage == "k_scale-nan" and not cache.is_fp8 else CACHE_NAMES.get(damage, (name,))
    check_decode(q, cache, setup["backend"], setup["mode"], cache.granularity, bad)


@fuzz(4)
@given(setup=decode_setups(), extra=st.sampled_from([("backend", "cuda"), ("backend", 3), ("mode", "fp4"),
                                                     ("mode", None), ("check", 1), ("check", "yes"),
                                                     ("num_splits", 0), ("num_splits", 2.0), ("block_n", 24),
                                                     ("num_warps", 3), ("out_dtype", torch.int8),
                                                     ("cache", "not-a-cache"), ("heads_per_program", True)]))
def test_decode_bad_arguments(setup, extra):
    q, cache = build(setup)
    name, value = extra
    kw = dict(q=q, cache=cache, backend=setup["backend"], mode=setup["mode"])
    if name in ("num_splits", "block_n", "num_warps", "out_dtype", "heads_per_program"):
        kw["backend"] = "triton"
    if refuses(lambda: fp8kv.decode(**kw), CAPABILITY_NAMES):
        return  # the setup itself does not run here (named): nothing to learn about the option
    assert refuses(lambda: fp8kv.decode(**{**kw, name: value}), (name,)), f"decode accepted {name}={value!r}"


# ------------------------------------------------------------------------------------------ cache
def independent_roundtrip(x: torch.Tensor, scale: torch.Tensor, fmt) -> tuple[torch.Tensor, int]:
    """``Q(x / scale) * scale`` by torch's own cast of the clamped fp32 values, and the saturation count
    (:func:`rounds_past_max` of the fp32 ``x / scale``), with ``scale`` broadcast by the caller."""
    y = x.float() / scale
    return y.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).float() * scale, rounds_past_max(y, fmt.max, fmt.mantissa_bits)


def rounds_past_max(y: torch.Tensor, fmax: float, mantissa_bits: int) -> int:
    """Elements of ``y`` that round-to-nearest-even with ``mantissa_bits`` would take past ``fmax``, from the
    format's definition alone: beyond the midpoint between max and the next step, or on it when max's
    mantissa is odd (the tie goes to the even neighbour)."""
    ulp = 2.0 ** (math.floor(math.log2(fmax)) - mantissa_bits)
    mid = fmax + ulp / 2
    odd = (fmax / ulp) % 2 == 1
    a = y.double().abs()
    return int(((a > mid) | ((a == mid) & odd)).sum())


EDGE_VALUES = st.sampled_from([0.0, 1.0, -1.0, 448.0, 464.0, 465.0, 57344.0, 1e-45, 1e-40, -1e-38, 1e-20, 1e20,
                               3e38, -3e38, 65504.0, 65520.0])


@st.composite
def kv_tensors(draw, tokens=None, hkv=None, d=None):
    """``[T, Hkv, D]`` fp32 values: Gaussian with some edge values mixed in, or a deep-subnormal block."""
    t = tokens if tokens is not None else draw(st.integers(1, 20))
    h = hkv if hkv is not None else draw(st.sampled_from([1, 2]))
    dd = d if d is not None else draw(st.sampled_from([16, 32]))
    seed = draw(st.integers(0, 100))
    scale = draw(st.sampled_from([1.0, 1e-3, 1e3, 1e-30, 1e30]))
    x = torch.randn(t, h, dd, generator=torch.Generator().manual_seed(seed)) * scale
    kind = draw(st.sampled_from(["gauss", "edges", "subnormal", "deep-subnormal", "zeros"]))
    if kind == "edges":
        vals = draw(st.lists(EDGE_VALUES, min_size=1, max_size=6))
        flat = x.view(-1)
        for i, v in enumerate(vals):
            flat[(i * 7919) % flat.numel()] = v
    elif kind == "subnormal":  # fp32 subnormals of a few bits
        x = torch.randn(t, h, dd, generator=torch.Generator().manual_seed(seed)) * draw(
            st.sampled_from([1e-39, 1e-41, 1e-43]))
    elif kind == "deep-subnormal":
        x = torch.full_like(x, 1e-45) * torch.sign(x)
    elif kind == "zeros":
        x = torch.zeros_like(x)
    return x


@fuzz(10)
@given(x=kv_tensors(), fmt=st.sampled_from(sorted(FORMATS)), granularity=st.sampled_from(GRANULARITIES),
       method=st.sampled_from(["amax", "vllm_k", "vllm_v", 1.0, 0.5, 2.0]))
@example(x=torch.full((4, 2, 16), 1e-45), fmt="e4m3", granularity="tensor", method="amax")
@example(x=torch.full((1, 1, 16), 448.0), fmt="e4m3", granularity="tensor", method=1.0)
@example(x=torch.full((1, 1, 16), 464.0), fmt="e4m3", granularity="tensor", method=1.0)
def test_quantize_roundtrip(x, fmt, granularity, method):
    """Legal input: the saturating cast an independent computation gives, its saturation count, and for
    data-derived amax scales an answer within FP8's relative precision (plus half a subnormal step)."""
    f = FORMATS[fmt]
    qz = attempt(lambda: quantize(x, fmt, granularity, method), ("x", "scale"))
    from fp8kv.quant import broadcast_scale

    s = broadcast_scale(qz.scale, x.ndim, granularity)
    assert torch.isfinite(qz.scale).all() and (qz.scale > 0).all(), f"scale {qz.scale}"
    ref, sat = independent_roundtrip(x, s, f)
    deq = qz.dequantize()
    assert torch.equal(deq, ref), "dequantized values differ from torch's saturating cast"
    assert qz.saturated == sat, f"saturated={qz.saturated}, independent count {sat}"
    underflow = int(((ref == 0) & (x != 0)).sum())
    assert qz.underflow == underflow, f"underflow={qz.underflow}, independent count {underflow}"
    if method == "amax":
        # amax scaling maps each group's amax onto max: nothing saturates, every element is within
        # u|x| + scale * min_subnormal / 2, and a group's largest element keeps FP8's relative precision
        assert sat == 0, f"amax scaling saturated {sat} element(s)"
        bound = f.unit_roundoff * x.abs() + s * f.min_subnormal / 2
        assert ((deq - x).abs() <= bound * (1 + 1e-6)).all(), "amax roundtrip outside FP8's precision"
        big = x.abs() == x.abs().amax()
        if x.abs().amax() > 0:
            err = ((deq - x).abs() / x.abs())[big]
            assert (err <= f.unit_roundoff).all(), f"the largest |x| came back with relative error {err.max():.3g}"


BAD_X = st.sampled_from(["int", "1d", "meta", "list", "fp8", "nan", "inf", "fp64-huge", "empty", "bool"])


@fuzz(6)
@given(damage=BAD_X, granularity=st.sampled_from(GRANULARITIES),
       scale=tagged(st.sampled_from([None, "amax", "percentile", 0.25, 1, "vllm_v"]),
                    st.sampled_from([0.0, -1.0, float("nan"), True, "max", 1e-300, 1e300, [1.0, 2.0, 3.0]])),
       percentile=tagged(st.sampled_from([99.9, 50, 100]), st.sampled_from([0, -5, 101, float("nan"), True, "99"])),
       nonfinite=st.sampled_from(["raise", "saturate", "clip", None]))
@example(damage="meta", granularity="tensor", scale=(None, True), percentile=(99.9, True), nonfinite="raise")
def test_quantize_refuses_by_name(damage, granularity, scale, percentile, nonfinite):
    x = torch.randn(3, 2, 16)
    x = {"int": lambda: x.int(), "1d": lambda: x[0, 0], "meta": lambda: x.to("meta"), "list": lambda: x.tolist(),
         "fp8": lambda: x.to(torch.float8_e4m3fn), "nan": lambda: x.clone().fill_(float("nan")),
         "inf": lambda: x.clone().fill_(float("inf")), "fp64-huge": lambda: x.double() * 1e300,
         "empty": lambda: x[:0], "bool": lambda: x > 0}[damage]()
    (s, s_ok), (p, p_ok) = scale, percentile
    names = ["x"] + ([] if s_ok else ["scale"]) + ([] if p_ok else ["percentile"]) \
        + ([] if nonfinite in ("raise", "saturate") else ["nonfinite"])
    legal = damage == "empty" or (damage in ("nan", "inf") and nonfinite == "saturate")
    legal = legal and s_ok and nonfinite in ("raise", "saturate") and (p_ok or not isinstance(s, (str, type(None))))
    try:
        qz = attempt(lambda: quantize(x, "e4m3", granularity, s, percentile=p, nonfinite=nonfinite), names)
    except Refused:
        return
    assert legal, f"accepted {damage} x with scale={s!r}, percentile={p!r}, nonfinite={nonfinite!r}"
    assert torch.isfinite(qz.dequantize()).all()


@st.composite
def dense_setups(draw):
    batch = draw(st.integers(1, 3))
    lens = draw(st.lists(st.integers(0, 24), min_size=batch, max_size=batch))
    hkv, d = draw(st.sampled_from([1, 2])), draw(st.sampled_from([16, 32]))
    k = torch.stack([draw(kv_tensors(tokens=max(max(lens), 1), hkv=hkv, d=d)) for _ in range(batch)])
    v = torch.randn_like(k)
    return dict(k=k, v=v, lens=lens, kv_dtype=draw(st.sampled_from(["fp8_e4m3", "fp8_e5m2", "fp16", "bf16"])),
                granularity=draw(st.sampled_from(GRANULARITIES)), layout=draw(st.sampled_from(LAYOUTS)),
                block_size=draw(st.sampled_from([8, 16])), max_seq_len=draw(st.sampled_from([None, 40])))


def expected_tokens(cache: PagedKVCache, x: torch.Tensor, which: str) -> torch.Tensor:
    """What ``gather`` should give for tokens ``x`` [n, Hkv, D] written into ``cache`` (independently)."""
    if not cache.is_fp8:
        fmax = torch.finfo(cache.dtype).max
        return x.float().clamp(-fmax, fmax).to(cache.dtype).float()
    f = cache.fmt
    if cache.granularity == "token_head":
        s = scale_of_stat(x.abs().double().amax(-1, keepdim=True), f.max)
    else:
        s = scale_of(cache, which)
    return independent_roundtrip(x, s, f)[0]


def scale_of_stat(stat: torch.Tensor, fmax: float) -> torch.Tensor:
    """stat / max in fp64, as fp32: to nearest, or up where the quotient is below fp32's normal range
    (deep-subnormal groups keep a scale that represents them); 1 for a group without a non-zero value."""
    exact = (stat.double() / fmax).numpy()
    s = exact.astype(np.float32)
    up = (s.astype(np.float64) < exact) & (s < np.finfo(np.float32).tiny)
    s = torch.from_numpy(np.asarray(np.where(up, np.nextafter(s, np.float32(np.inf)), s), dtype=np.float32))
    return torch.where(stat > 0, s, torch.ones_like(s))


def static_scale(x: torch.Tensor, granularity: str, fmax: float) -> torch.Tensor:
    """The amax of each scale group over the format's max (:func:`scale_of_stat`)."""
    a = x.abs().double()
    stat = {"tensor": lambda: a.amax() if a.numel() else a.new_zeros(()),
            "head": lambda: a.amax((0, 2)) if a.numel() else a.new_zeros(a.shape[1]),
            "channel": lambda: a.amax(0) if a.numel() else a.new_zeros(a.shape[1:])}[granularity]()
    return scale_of_stat(stat, fmax)


@fuzz(10)
@given(d=dense_setups())
@example(d=dict(k=torch.full((1, 4, 1, 16), 1e-45), v=torch.ones(1, 4, 1, 16), lens=[4], kv_dtype="fp8_e4m3",
                granularity="tensor", layout="NHD", block_size=16, max_seq_len=None))
def test_from_dense_then_gather(d):
    """from_dense's scales are the amax of the valid tokens (a group without any: 1), and gather gives back
    each token quantized with them."""
    try:
        cache = attempt(lambda: PagedKVCache.from_dense(d["k"], d["v"], d["lens"], d["block_size"], d["kv_dtype"],
                                                        d["granularity"], layout=d["layout"],
                                                        max_seq_len=d["max_seq_len"]), ("k", "v", "seq_lens"))
    except Refused:
        assert (~torch.isfinite(d["k"])).any() or d["k"].abs().max() > FP32_MAX, "legal input refused"
        return
    assert cache.seq_lens.tolist() == d["lens"]
    valid_k = torch.cat([d["k"][i, :n] for i, n in enumerate(d["lens"])])
    valid_v = torch.cat([d["v"][i, :n] for i, n in enumerate(d["lens"])])
    if cache.is_fp8 and cache.granularity != "token_head":
        for name, x in (("k_scale", valid_k), ("v_scale", valid_v)):
            want = static_scale(x, cache.granularity, cache.fmt.max)
            assert torch.allclose(getattr(cache, name), want, rtol=1e-6, atol=0), f"{name} is not amax / max"
    for i, n in enumerate(d["lens"]):
        k, v = cache.gather(i)
        assert torch.equal(k, expected_tokens(cache, d["k"][i, :n], "k_scale")), f"gather({i}) K"
        assert torch.equal(v, expected_tokens(cache, d["v"][i, :n], "v_scale")), f"gather({i}) V"


@fuzz(8)
@given(arg=st.sampled_from([("batch_size", 0), ("batch_size", 2.0), ("batch_size", True), ("max_seq_len", -1),
                            ("max_seq_len", 1.5), ("num_kv_heads", 0), ("head_dim", 0), ("head_dim", 16.0),
                            ("block_size", 0), ("block_size", -4), ("block_size", 16.0), ("kv_dtype", "fp4"),
                            ("kv_dtype", torch.int8), ("granularity", "row"), ("layout", "HDN"),
                            ("num_blocks", 1), ("num_blocks", 0), ("device", "meta"), ("device", 3),
                            ("k_scale", float("nan")), ("k_scale", -1.0), ("k_scale", True), ("v_scale", "amax"),
                            ("seed", 1.5), ("seed", None), ("max_seq_len", 2**40)]))
@example(arg=("max_seq_len", 2**40))
def test_empty_refuses_by_name(arg):
    name, value = arg
    kw = dict(batch_size=2, max_seq_len=20, num_kv_heads=2, head_dim=16)
    kw[name] = value
    pos = [kw.pop(k) for k in ("batch_size", "max_seq_len", "num_kv_heads", "head_dim")]
    try:
        cache = attempt(lambda: PagedKVCache.empty(*pos, **kw), (name,))
    except Refused:
        return
    pytest.fail(f"empty accepted {name}={value!r}: {cache}")


def scale_of(cache: PagedKVCache, which: str) -> torch.Tensor:
    """The cache's static K or V scale, shaped to broadcast against ``[N, Hkv, D]``."""
    s = getattr(cache, which)
    if cache.granularity == "tensor":
        return s.reshape(())
    return s.reshape(-1, 1) if cache.granularity == "head" else s


def saturations(cache: PagedKVCache, x: torch.Tensor, which: str) -> int:
    """Elements of ``x`` written into ``cache`` that an unclamped cast would take past max (independently)."""
    if not cache.is_fp8:
        info = torch.finfo(cache.dtype)
        return rounds_past_max(x.float(), info.max, {torch.float16: 10, torch.bfloat16: 7}[cache.dtype])
    if cache.granularity == "token_head":
        return 0  # amax scaling per token: nothing saturates
    return independent_roundtrip(x, scale_of(cache, which), cache.fmt)[1]


@fuzz(10)
@given(setup=decode_setups(backends=("reference",)), x=kv_tensors(tokens=3, hkv=2, d=32),
       slots=st.sampled_from(["fresh", "negative", "past-pool", "float", "bool-list", "list", "int32", "meta",
                              "short"]),
       writer=st.sampled_from(["write", "write_cache"]))
@example(setup=dict(TRITON_FP8, backend="reference"), x=torch.full((3, 2, 32), 1e-40), slots="fresh",
         writer="write_cache")
@example(setup=dict(TRITON_FP8, backend="reference", granularity="token_head"),
         x=torch.linspace(-1.1e-39, 8.5e-40, 3 * 2 * 32).reshape(3, 2, 32), slots="fresh", writer="write_cache")
def test_write_and_write_cache_agree(setup, x, slots, writer):
    """cache.write and the fused fp8kv.ops.write_cache: the same pages, the same saturation count, the one
    an independent computation gives, and gather reads the tokens back."""
    from fp8kv.ops import write_cache

    setup = dict(setup, lens=[min(n, 8) for n in setup["lens"]])
    _, cache = build(setup)
    x = x[:, : cache.num_kv_heads, : cache.head_dim].contiguous()
    b = cache.batch_size - 1  # three fresh slots past the last sequence's tokens, in its own pages
    n = int(cache.seq_lens[b])
    if n + 3 > cache.max_blocks_per_seq * cache.block_size:
        return
    fresh = cache.slots(b, list(range(n, n + 3)))
    total = cache.num_blocks * cache.block_size
    mapping = {"fresh": lambda: fresh, "negative": lambda: torch.tensor([-1, -5, -1]),
               "past-pool": lambda: fresh + total, "float": lambda: fresh.float(),
               "bool-list": lambda: [True, False, True], "list": lambda: fresh.tolist(),
               "int32": lambda: fresh.int(), "meta": lambda: fresh.to("meta"), "short": lambda: fresh[:2]}[slots]()
    legal = slots in ("fresh", "negative", "list", "int32")
    a, ref = cache.clone(), cache.clone()
    try:
        if writer == "write":
            sat = attempt(lambda: a.write(x, x, mapping), ("slot_mapping",))
        else:
            sat = int(attempt(lambda: write_cache(a, x, x, mapping), ("slot_mapping",)).sum())
    except Refused:
        assert not legal, f"legal slots {slots} refused"
        return
    assert legal, f"{writer} accepted slot_mapping {slots}"
    sat_torch = ref.write(x, x, fresh if slots != "negative" else mapping)
    for name in ("k_pages", "v_pages", "k_scale", "v_scale"):
        got, want = getattr(a, name), getattr(ref, name)
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want), f"{writer}: {name} differ"
    assert sat == sat_torch, f"{writer} counted {sat}, write counted {sat_torch}"
    if slots == "negative":
        assert sat == 0
        return
    independent = saturations(ref, x, "k_scale") + saturations(ref, x, "v_scale")
    assert sat == independent, f"saturation count {sat}, independent count {independent}"
    ref.seq_lens[b] += 3
    for side, which in ((0, "k_scale"), (1, "v_scale")):
        got = ref.gather(b)[side][n:]
        assert torch.equal(got, expected_tokens(ref, x, which)), "gather does not read back what was written"


@fuzz(8)
@given(setup=decode_setups(backends=("reference",)),
       seq=tagged(st.integers(0, 2), st.sampled_from([-1, 3, True, 1.0, "0", None])),
       positions=tagged(st.lists(st.integers(0, 15), min_size=0, max_size=4),
                        st.sampled_from([[-1], [10**6], [1.5], [True], "0", torch.tensor([0.0]),
                                         torch.tensor([[0]]), None])))
def test_slots(setup, seq, positions):
    _, cache = build(setup)
    (s, s_ok), (p, p_ok) = seq, positions
    s_ok = s_ok and s < cache.batch_size
    p_ok = p_ok and all(x < cache.max_blocks_per_seq * cache.block_size for x in p)
    names = ([] if s_ok else ["seq"]) + ([] if p_ok else ["positions"])
    try:
        got = attempt(lambda: cache.slots(s, p), names or ("?",))
    except Refused:
        return
    assert not names, f"slots accepted seq={s!r}, positions={p!r}"
    row = cache.block_table[s].tolist()
    assert got.tolist() == [row[x // cache.block_size] * cache.block_size + x % cache.block_size for x in p]


@fuzz(6)
@given(setup=decode_setups(backends=("reference",)),
       edit=st.sampled_from(["past-capacity", "negative", "index-bool", "index-float", "index-range",
                             "block_table-range"]))
@example(setup=dict(TRITON_FP8, backend="reference"), edit="past-capacity")
@example(setup=dict(TRITON_FP8, backend="reference"), edit="negative")
@example(setup=dict(TRITON_FP8, backend="reference"), edit="block_table-range")
def test_gather_after_edits(setup, edit):
    """gather(i) after the tables were edited in place: a named refusal, or the tokens (never IndexError)."""
    _, cache = build(setup)
    cap = cache.max_blocks_per_seq * cache.block_size
    i = 0
    if edit == "past-capacity":
        cache.seq_lens[0] = cap + 3
    elif edit == "negative":
        cache.seq_lens[0] = -2
    elif edit == "block_table-range":
        cache.block_table[0, 0] = cache.num_blocks + 5
    else:
        i = {"index-bool": True, "index-float": 0.0, "index-range": cache.batch_size}[edit]
    names = {"past-capacity": ("seq_lens",), "negative": ("seq_lens",), "block_table-range": ("block_table",),
             "index-bool": ("i=",), "index-float": ("i=",), "index-range": ("sequence index",)}[edit]
    try:
        k, v = attempt(lambda: cache.gather(i), names)
    except Refused:
        return
    pytest.fail(f"gather accepted the {edit} edit: K {tuple(k.shape)}")


@fuzz(6)
@given(setup=decode_setups(backends=("reference",)),
       counts=tagged(st.lists(st.integers(0, 3), min_size=3, max_size=3),
                     st.sampled_from([[-1, 0, 0], [1.0, 1, 1], [True, 0, 0], [100, 0, 0], "1", [0, 0, 0, 0]])))
def test_append_tokens(setup, counts):
    _, cache = build(setup)
    c, ok = counts
    c = list(c[: cache.batch_size]) + [0] * (cache.batch_size - len(c)) if ok else c
    n = sum(c) if ok else 2
    k = torch.randn(n, cache.num_kv_heads, cache.head_dim)
    before = cache.seq_lens.clone()
    cap = cache.max_blocks_per_seq * cache.block_size
    ok = ok and all(int(before[i]) + c[i] <= cap for i in range(cache.batch_size))
    try:
        attempt(lambda: cache.append_tokens(k, k, c), ("counts", "capacity", "k_new"))
    except Refused:
        assert not ok, f"legal counts {c} refused"
        assert torch.equal(cache.seq_lens, before), "a refused append changed seq_lens"
        return
    assert ok, f"append_tokens accepted counts {c!r}"
    assert (cache.seq_lens - before).tolist() == c
    for i in range(cache.batch_size):  # the appended tokens read back
        got = cache.gather(i)[0][int(before[i]):]
        start = sum(c[:i])
        assert torch.equal(got, expected_tokens(cache, k[start:start + c[i]], "k_scale")), f"append, sequence {i}"


# ------------------------------------------------------------------------------------------ capacity
MODEL_NAMES = sorted(fp8kv.MODELS)


@fuzz(12)
@given(model=st.sampled_from(MODEL_NAMES), kv=st.sampled_from(["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]),
       gran=st.sampled_from(GRANULARITIES),
       memory=tagged(st.one_of(st.floats(0.001, 1000.0), st.integers(1, 1000)),
                     st.sampled_from([0, -1.0, float("nan"), float("inf"), True, "8", 2e6, None])),
       block=tagged(st.sampled_from([1, 3, 8, 12, 16, 256]), st.sampled_from([0, -1, -16, 16.0, True, "16"])),
       max_len=tagged(st.sampled_from([None, 1, 4096, 10**6]), st.sampled_from([0, -1, 1.5, True, "4096"])))
def test_plan_capacity_is_the_accounting(model, kv, gran, memory, block, max_len):
    (mem, mem_ok), (bs, bs_ok), (ml, ml_ok) = memory, block, max_len
    names = ([] if mem_ok else ["kv_memory_gib", "gpu_memory_gib"]) + ([] if bs_ok else ["block_size"]) \
        + ([] if ml_ok else ["max_model_len"])
    try:
        plan = attempt(lambda: fp8kv.plan_capacity(model, kv, kv_memory_gib=mem, block_size=bs, max_model_len=ml,
                                                   granularity=gran), names or ("kv_memory_gib", "block", "KV memory"))
    except Refused:
        return
    assert not names, f"plan_capacity accepted {names}"
    shape = fp8kv.MODELS[model]
    elem = 1 if kv.startswith("fp8") else 2
    fp8 = kv.startswith("fp8")
    per_group = {"tensor": 1, "head": shape.num_kv_heads, "channel": shape.num_kv_heads * shape.head_dim,
                 "token_head": shape.num_kv_heads}[gran]
    fixed = 0 if not fp8 or gran == "token_head" else shape.num_layers * 2 * per_group * 4
    per_token_scales = shape.num_layers * 2 * per_group * 4 if fp8 and gran == "token_head" else 0
    bpt = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * elem + per_token_scales
    budget = math.floor(float(mem) * 2**30)
    blocks = (budget - fixed) // (bs * bpt)
    assert plan["blocks"] == blocks and plan["tokens"] == blocks * bs
    assert plan["max_model_len"] == (ml if ml is not None else shape.max_position_embeddings)
    assert math.isclose(plan["max_concurrency"], blocks * bs / plan["max_model_len"])
    assert plan["blocks"] >= 1


@fuzz(8)
@given(models=st.sampled_from([MODEL_NAMES[:2], MODEL_NAMES[0], [], "nope", [3], None]),
       gpus=st.sampled_from([["H200"], "H200", [80, 8.5], [], ["H9000"], [float("nan")], [True], None]),
       kv=st.sampled_from([["bf16", "fp8_e4m3"], "fp8_e4m3", [], ["fp3"], [None]]),
       grans=st.sampled_from([("tensor",), ["head", "channel"], "token_head", [], ["row"]]))
def test_capacity_table(models, gpus, kv, grans):
    names = ("models", "gpus", "kv_dtype", "granularit", "model", "gpu", "GPU", "memory", "utilization")
    try:
        df = attempt(lambda: fp8kv.capacity_table(models, gpus, kv, grans), names)
    except Refused:
        return
    assert len(df) and set(df["fits"]) <= {True, False}
    assert (df.loc[df["fits"], "blocks"] >= 1).all()


# ------------------------------------------------------------------------------------------ synthetic
@fuzz(10)
@given(fn=st.sampled_from(["kv_like_llm", "queries_like_llm", "ragged_kv", "random_paged_cache"]),
       arg=st.sampled_from([None, ("num_tokens", 0), ("num_kv_heads", 0), ("head_dim", 15), ("head_dim", 16.0),
                            ("seed", -1), ("seed", 2**70), ("seed", 1.0), ("dtype", torch.int32),
                            ("dtype", torch.float16), ("outlier_channels", 100), ("outlier_scale", float("nan")),
                            ("outlier_scale", 1e30), ("head_spread", 0.0), ("token_spread", -1.0),
                            ("v_tail_df", 0.0), ("rope_theta", 0.0), ("device", "meta"), ("position", -1),
                            ("position", [1, 2]), ("query_scale", float("inf")), ("seq_lens", [0, 3]),
                            ("seq_lens", [2.5]), ("context", 0), ("block_size", 12), ("kv_dtype", "fp8_e4m3"),
                            ("granularity", "channel"), ("layout", "HND"), ("batch", True)]))
def test_synthetic_generators(fn, arg):
    from fp8kv import synthetic

    base = {"kv_like_llm": dict(num_tokens=5, num_kv_heads=2, head_dim=16),
            "queries_like_llm": dict(num_queries=3, num_q_heads=4, head_dim=16),
            "ragged_kv": dict(seq_lens=[3, 1], num_kv_heads=2, head_dim=16),
            "random_paged_cache": dict(batch=2, context=20, num_kv_heads=2, head_dim=16)}[fn]
    kw = dict(base)
    name = None
    if arg is not None:
        name, value = arg
        if name == "num_tokens" and fn == "queries_like_llm":
            name = "num_queries"
        kw[name] = value
    try:
        out = attempt(lambda: getattr(synthetic, fn)(**kw), (name,) if name else ("?",))
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            return  # not an argument of this generator
        raise
    except Refused:
        return
    tensors = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, tuple) else \
        [out.k_pages, out.v_pages]
    for t in tensors:
        if t.device.type != "meta":  # meta tensors hold no values to check
            assert torch.isfinite(t.float()).all(), f"{fn}({kw}) returned non-finite values"


# ------------------------------------------------------------------------------------------ FlashInfer prefill
QO_LENS = tagged(st.sampled_from(["ints", "int-tensor", "numpy-ints", "int32-tensor"]),
                 st.sampled_from(["floats", "float-tensor", "numpy-floats", "halves", "bools", "negative", "too-many",
                                  "past-seq-len", "0d-tensor", "2d-tensor", "strings", "none"]))


@fuzz(8)
@given(setup=decode_setups(backends=("reference",)), qo=QO_LENS, causal=st.sampled_from([True, False, 1, None]),
       sm_scale=st.sampled_from([None, 0.5, 0.0, float("nan"), True]))
@example(setup=dict(TRITON_FP8, backend="reference"), qo=("none", False), causal=True, sm_scale=None)
def test_flashinfer_prefill_arguments(setup, qo, causal, sm_scale):
    """FlashInfer's prefill checks every argument before FlashInfer is asked: a refusal names the argument;
    legal arguments reach FlashInfer (here: refused by the capability table when it cannot run)."""
    from fp8kv.backends.flashinfer import prefill

    setup = dict(setup, q_dtype=torch.float16 if setup["kv_dtype"] != "bf16" else torch.bfloat16)
    _, cache = build(setup)
    lens = cache.seq_lens.tolist()
    (kind, legal) = qo
    counts = [min(n, 2) for n in lens]
    value = {"ints": counts, "int-tensor": torch.tensor(counts), "numpy-ints": np.array(counts),
             "int32-tensor": torch.tensor(counts, dtype=torch.int32), "floats": [float(n) for n in counts],
             "float-tensor": torch.tensor(counts, dtype=torch.float32), "numpy-floats": np.array(counts, dtype=float),
             "halves": [n + 0.5 for n in counts], "bools": [True] * len(counts), "negative": [-1] + counts[1:],
             "too-many": counts + [1], "past-seq-len": [lens[0] + 1] + counts[1:], "0d-tensor": torch.tensor(1),
             "2d-tensor": torch.tensor([counts]), "strings": [str(n) for n in counts], "none": None}[kind]
    rows = sum(counts) if legal else max(sum(counts), 1)
    q = torch.randn(rows, cache.num_kv_heads * setup["group"], cache.head_dim).to(setup["q_dtype"])
    bad = ([] if legal else ["qo_lens"]) + ([] if isinstance(causal, bool) else ["causal"]) + \
        ([] if sm_scale in (None, 0.5) else ["sm_scale"])
    try:
        attempt(lambda: prefill(q, value, cache, causal=causal, sm_scale=sm_scale), bad or ("flashinfer", "FlashInfer"))
    except Refused:
        return
    assert not bad, f"prefill accepted {bad}"
