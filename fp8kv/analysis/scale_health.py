"""Scale health of a model's KV cache: which layers and heads each scale method saturates or flushes to zero,
what that costs, and which layers to keep 16-bit.

Input: captured K and V, one ``[tokens, Hkv, D]`` tensor per layer (``fp8kv.models.capture_kv``, or synthetic),
optionally decode queries ``[Nq, Hq, D]`` per layer. Each layer gets one scale per K and per V (``"tensor"``
granularity, what vLLM stores; ``"head"`` or ``"channel"`` on request) from each method:

* ``"1.0"``: no scale, the engines' fallback when a checkpoint has none (|x| > 448 saturates in e4m3,
  |x| below 2^-9 underflows);
* ``"amax"``: amax / fmt.max of these very values (the best static scale in hindsight);
* ``"percentile"``: the 99.9th percentile of |x| maps to fmt.max (the largest 0.1 % saturate);
* ``"vllm"``: vLLM's one-shot heuristic, amax(|K|) / 200 and amax(|V|) / 100;
* ``"calibrated"``: amax / fmt.max of a calibration run on another text (:func:`calibration_scales`,
  ``fp8kv.models.calibrate_scales``): a static scale meets values it has not seen.

Measured per layer x KV head x side (K, V) x method: the fractions saturated and underflowed (counted by
:func:`fp8kv.quant.quantize`), the relative error of the dequantized values, and, with queries, the relative
error of the attention output (the fp32 oracle on the dequantized cache against it on the original).

A layer's *error* is its attention-output relative error where queries are given, else its K-and-V relative
error (both pooled over heads); the model's error is the root mean square of its layers' errors, a layer kept
16-bit counting 0 (its error against the 16-bit baseline). :func:`keep_bf16_advice` keeps the layers a
scale collapses 16-bit, then picks more **greedily**, largest contribution (error²) first, until the model's
error is under the tolerance; because the mean square adds up over layers, the greedy set is also the
smallest. The RMS (not the mean) weighs a layer far worse than the rest more than many slightly worse ones. :func:`advice_capacity` prices the advice
with :mod:`fp8kv.capacity`'s per-token bytes: the tokens the 16-bit layers cost.

A scale that would collapse a layer is reported, not raised: :attr:`ScaleHealth.collapses` names each layer,
head, side and method whose values saturate (> :data:`SATURATION_LIMIT`), underflow
(> :data:`UNDERFLOW_LIMIT`), or whose relative error reaches :data:`COLLAPSE_REL_ERR` or whose every non-zero
value flushes to zero, or whose calibrated scale is 0, NaN or Inf (a checkpoint's scales never applied:
"scale 0: not applied", its values counted lost); :meth:`ScaleHealth.report` says it in sentences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import checks
from ..formats import kv_dtype_info
from ..quant import compute_scale, quantize, relative_error, scale_shape
from .errors import attend, check_layer_counts, scale_argument
from .health_inputs import SIDES, check_calibration, check_kv, check_queries, scale_applied

__all__ = ["SCALE_HEALTH_METHODS", "HEALTH_GRANULARITIES", "DEFAULT_TOLERANCE", "SATURATION_LIMIT", "UNDERFLOW_LIMIT",
           "COLLAPSE_REL_ERR", "ScaleHealth", "measure_scale_health", "calibration_scales", "keep_bf16_advice",
           "advice_capacity", "model_scale_health"]

SCALE_HEALTH_METHODS = ("1.0", "amax", "percentile", "vllm", "calibrated")
HEALTH_GRANULARITIES = ("tensor", "head", "channel")  # static scales; token_head is computed per token at write
# RMS over layers of the relative error. e4m3's rounding alone costs ~0.027 on K and V and ~0.06 on the
# attention output (SmolLM2-135M, amax scales): 0.1 flags layers clearly worse than rounding.
DEFAULT_TOLERANCE = 0.1
SATURATION_LIMIT = 0.01  # of a head's values; percentile scales saturate 0.1 % of a layer's by design
UNDERFLOW_LIMIT = 0.05
COLLAPSE_REL_ERR = 0.5  # half of the values' norm lost: the layer no longer holds its keys / values


# ------------------------------------------------------------------------------------ input
def calibration_scales(k, v, kv_dtype: str = "fp8_e4m3", granularity: str = "tensor") -> tuple[list, list]:
    """Static per-layer scales from a calibration run's K and V (lists of ``[tokens, Hkv, D]``): amax / fmt.max,
    as :func:`fp8kv.models.calibrate_scales` derives them from a model. Returns ``(k_scales, v_scales)``."""
    k, v = check_kv(k, v)
    fmt = _fp8(kv_dtype)
    checks.one_of(granularity, "granularity", HEALTH_GRANULARITIES)
    return ([compute_scale(x, fmt, granularity, "amax") for x in k], [compute_scale(x, fmt, granularity, "amax")
                                                                      for x in v])


def _fp8(kv_dtype: str):
    return kv_dtype_info(checks.one_of(kv_dtype, "kv_dtype", ("fp8_e4m3", "fp8_e5m2")))[2]


# ------------------------------------------------------------------------------------ measuring
@dataclass
class ScaleHealth:
    """What :func:`measure_scale_health` measured.

    ``heads``: one row per layer x KV head x side x method: ``layer``, ``head``, ``side`` (``"k"``, ``"v"``, or
    ``"out"``: the attention output of the query heads reading that KV head, with queries), ``method``,
    ``scale_min`` / ``scale_max`` (the head's scales), ``scale_bad`` (a scale of 0, NaN or Inf as text, "" else), ``amax``, ``amax_over_range`` (amax over scale x fmt.max:
    above 1 saturates), ``saturated_frac``, ``underflow_frac``, ``nonzero_frac``, ``rel_err``, ``err_sq`` and
    ``norm_sq`` (its parts). ``layers``: one row per layer x method: ``k_rel_err``, ``v_rel_err``,
    ``kv_rel_err``, ``out_rel_err`` (NaN without queries), ``k_/v_saturated_frac``, ``k_/v_underflow_frac``,
    ``error`` (the advice's measure, module docstring) and ``collapsed`` (a side of it collapsed).
    ``collapses``: the flagged heads (``kind``: ``"saturates"``, ``"underflows"``, ``"collapsed"``) and a
    sentence each (``text``). ``metric``: ``"out"`` or ``"kv"``.
    """

    heads: object
    layers: object
    collapses: object
    kv_dtype: str
    granularity: str
    metric: str
    methods: tuple
    notes: list = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return int(self.layers["layer"].nunique())

    def report(self) -> list[str]:
        """Sentences: per method, its model error and what collapses; then the notes."""
        lines = []
        for m in self.methods:
            lay = self.layers[self.layers["method"] == m]
            rms = _rms(lay["error"])
            bad = self.collapses[self.collapses["method"] == m]
            head = f"scale {m}: RMS {self.metric} error {rms:.3g} over {len(lay)} layers"
            if bad.empty:
                lines.append(f"{head}; no head saturates or underflows beyond the limits")
                continue
            kinds = ", ".join(f"{n} heads {kind}" for kind, n in bad["kind"].value_counts().items())
            lines.append(f"{head}; {kinds}:")
            lines.extend(f"  {t}" for t in bad["text"].head(8))
            if len(bad) > 8:
                lines.append(f"  ... and {len(bad) - 8} more (ScaleHealth.collapses)")
        return lines + self.notes


def _rms(errors) -> float:
    errors = [float(e) for e in errors]
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else float("nan")


def _scale(method, x, side, fmt, granularity, percentile, calibrated):
    if method == "calibrated":
        return calibrated
    arg = scale_argument(method, side)
    if isinstance(arg, float):
        return torch.full(scale_shape(x.shape, granularity), arg, dtype=torch.float32, device=x.device)
    return compute_scale(x, fmt, granularity, arg, percentile)


def _head_rows(x, s, fmt, granularity, meta) -> tuple[list[dict], torch.Tensor]:
    """Quantize ``x`` [T, H, D] with scale ``s`` one KV head at a time (the quantizer counts per call). A head whose
    scale is 0, NaN or Inf (a checkpoint's scale never applied) is not quantized: its values count as lost (0)."""
    rows, deq = [], []
    for h in range(x.shape[1]):
        xh = x[:, h:h + 1]
        sh = s if granularity == "tensor" else s[h:h + 1]
        amax = float(xh.abs().max())
        applied, bad = scale_applied(sh)
        if applied:
            qz = quantize(xh, fmt, granularity, scale=sh)
            d = qz.dequantize(torch.float32)
            reach = xh.abs().to(torch.float32).amax(dim=0) / (sh.to(torch.float32) * fmt.max)  # per channel
            counts = dict(amax_over_range=float(reach.max()), saturated_frac=qz.saturated_fraction,
                          underflow_frac=qz.underflow_fraction)
        else:  # what the engine's cache holds then is no function of x: nothing to count, every value lost
            d = torch.zeros_like(xh, dtype=torch.float32)
            counts = dict(amax_over_range=math.nan, saturated_frac=math.nan, underflow_frac=math.nan)
        deq.append(d)
        x64, d64 = xh.to(torch.float64), d.to(torch.float64)
        rows.append(dict(meta, head=h, scale_min=float(sh.min()), scale_max=float(sh.max()), scale_bad=bad, amax=amax,
                         **counts, nonzero_frac=float((xh != 0).float().mean()),
                         rel_err=relative_error(d, xh) if applied else 1.0, err_sq=float(((d64 - x64) ** 2).sum()),
                         norm_sq=float((x64 ** 2).sum())))
    return rows, torch.cat(deq, dim=1)


def _out_rows(q, k, v, k_hat, v_hat, sm_scale, meta) -> list[dict]:
    ref = attend(q, k.float(), v.float(), sm_scale)
    out = attend(q, k_hat, v_hat, sm_scale)
    g = q.shape[1] // k.shape[1]
    rows = []
    for h in range(k.shape[1]):
        r, o = ref[:, h * g:(h + 1) * g].double(), out[:, h * g:(h + 1) * g].double()
        rows.append(dict(meta, side="out", head=h, rel_err=relative_error(o, r), err_sq=float(((o - r) ** 2).sum()),
                         norm_sq=float((r ** 2).sum())))
    return rows


def measure_scale_health(k, v, *, q=None, sm_scale=None, calibration=None, kv_dtype: str = "fp8_e4m3",
                 granularity: str = "tensor", methods=None, percentile: float = 99.9) -> ScaleHealth:
    """Saturation, underflow and error of every scale method, per layer and KV head (module docstring).

    Parameters
    ----------
    k, v : lists (one per layer) of float tensors ``[tokens, Hkv, D]``, equal shapes per layer; finite.
    q : None, or a list of decode queries ``[Nq, Hq, D]`` per layer (Hq a multiple of Hkv): adds the
        attention-output error, which then is the advice's measure.
    sm_scale : the softmax scale, one number or one per layer (default ``1/sqrt(D)``).
    calibration : ``(k_scales, v_scales)``, per-layer scales of a calibration run (:func:`calibration_scales`,
        ``fp8kv.models.calibrate_scales``, or a checkpoint's), shaped per granularity; needed for the
        ``"calibrated"`` method. A scale of 0, NaN or Inf is reported as a collapse, a negative one refused.
    kv_dtype : ``"fp8_e4m3"`` or ``"fp8_e5m2"``.
    granularity : ``"tensor"`` (one scale per layer and side), ``"head"`` or ``"channel"``.
    methods : among :data:`SCALE_HEALTH_METHODS`; default all of them, ``"calibrated"`` only with
        ``calibration`` (a note says it was left out).
    percentile : for ``"percentile"``.

    Raises ValueError / TypeError naming the argument on malformed input (shapes, NaN, a method without its
    data); a scale that collapses a layer is measured and reported (:attr:`ScaleHealth.collapses`), not raised.
    """
    import pandas as pd

    k, v = check_kv(k, v)
    fmt = _fp8(kv_dtype)
    checks.one_of(granularity, "granularity", HEALTH_GRANULARITIES)
    q, sm_scale = check_queries(q, sm_scale, k)
    calibration = check_calibration(calibration, k, granularity)
    notes = []
    if methods is None:
        methods = [m for m in SCALE_HEALTH_METHODS if m != "calibrated" or calibration is not None]
        if calibration is None:
            notes.append("method 'calibrated' left out: no calibration scales were given")
    methods = tuple(dict.fromkeys(checks.many_of(methods, "methods", SCALE_HEALTH_METHODS)))
    if "calibrated" in methods and calibration is None:
        checks.fail("methods has 'calibrated' but calibration is None; pass calibration=(k_scales, v_scales) "
                    "(calibration_scales or fp8kv.models.calibrate_scales)")
    rows = []
    for i, (kk, vv) in enumerate(zip(k, v, strict=True)):
        for m in methods:
            deq = {}
            for j, (side, x) in enumerate((("k", kk), ("v", vv))):
                cal = calibration[j][i] if calibration is not None else None
                s = _scale(m, x, side, fmt, granularity, percentile, cal)
                head_rows, deq[side] = _head_rows(x, s, fmt, granularity, dict(layer=i, side=side, method=m))
                rows += head_rows
            if q is not None:
                rows += _out_rows(q[i].float(), kk, vv, deq["k"], deq["v"], sm_scale[i], dict(layer=i, method=m))
    heads = pd.DataFrame(rows)
    cols = ["layer", "head", "side", "method", "scale_min", "scale_max", "scale_bad", "amax", "amax_over_range",
            "saturated_frac", "underflow_frac", "nonzero_frac", "rel_err", "err_sq", "norm_sq"]
    heads = heads.reindex(columns=cols)
    metric = "out" if q is not None else "kv"
    layers = _layer_table(heads, metric)
    return ScaleHealth(heads, layers, _collapses(heads, kv_dtype, fmt), kv_dtype, granularity, metric, methods, notes)


def _pooled(g) -> float:
    den = g["norm_sq"].sum()
    return math.sqrt(g["err_sq"].sum() / den) if den > 0 else math.sqrt(g["err_sq"].sum())


def _layer_table(heads, metric):
    import pandas as pd

    out = []
    for (layer, method), g in heads.groupby(["layer", "method"], sort=False):
        row = dict(layer=layer, method=method)
        for side in SIDES:
            gs = g[g["side"] == side]
            row[f"{side}_rel_err"] = _pooled(gs)
            n = gs["norm_sq"].size
            row[f"{side}_saturated_frac"] = float(gs["saturated_frac"].mean()) if n else float("nan")
            row[f"{side}_underflow_frac"] = float(gs["underflow_frac"].mean()) if n else float("nan")
        row["kv_rel_err"] = _pooled(g[g["side"].isin(SIDES)])
        go = g[g["side"] == "out"]
        row["out_rel_err"] = _pooled(go) if len(go) else float("nan")
        row["collapsed"] = bool(((g["side"].isin(SIDES)) & ((g["rel_err"] >= COLLAPSE_REL_ERR) | _all_flushed(g) |
                                                            _not_applied(g))).any())
        row["error"] = row["out_rel_err"] if metric == "out" else row["kv_rel_err"]
        out.append(row)
    return pd.DataFrame(out)


def _all_flushed(g):
    """Heads with non-zero values every one of which underflowed."""
    return (g["nonzero_frac"] > 0) & (g["underflow_frac"] >= g["nonzero_frac"])


def _not_applied(g):
    """Heads whose scale was 0, NaN or Inf (``scale_bad`` names it; "" where the scale was usable)."""
    return g["scale_bad"].fillna("").astype(str) != ""


def _collapses(heads, kv_dtype, fmt):
    import pandas as pd

    kv = heads[heads["side"].isin(SIDES)]
    out = []
    for r in kv.itertuples(index=False):
        where = f"scale {r.method} on {r.side.upper()} of layer {r.layer} head {r.head}"
        scale = f"{r.scale_min:.3g}" if r.scale_min == r.scale_max else f"{r.scale_min:.3g}-{r.scale_max:.3g}"
        flushed = r.nonzero_frac > 0 and r.underflow_frac >= r.nonzero_frac
        if r.scale_bad:
            out.append(dict(layer=r.layer, head=r.head, side=r.side, method=r.method, kind="collapsed",
                            text=f"{where} collapses: scale {r.scale_bad}: not applied (a checkpoint whose scales "
                                 f"were never set; an engine's cache holds no function of x there: every value "
                                 f"lost, |x| reaches {r.amax:.3g})"))
        elif r.rel_err >= COLLAPSE_REL_ERR or flushed:
            why = ("every non-zero value underflows to 0" if flushed else
                   f"relative error {r.rel_err:.2f} (>= {COLLAPSE_REL_ERR})")
            out.append(dict(layer=r.layer, head=r.head, side=r.side, method=r.method, kind="collapsed",
                            text=f"{where} collapses: {why}; |x| reaches {r.amax:.3g}, {r.amax_over_range:.3g} x "
                                 f"the range (scale {scale} x {kv_dtype}'s max {fmt.max:g}); "
                                 f"{r.saturated_frac:.1%} saturate, {r.underflow_frac:.1%} underflow"))
        elif r.saturated_frac > SATURATION_LIMIT:
            out.append(dict(layer=r.layer, head=r.head, side=r.side, method=r.method, kind="saturates",
                            text=f"{where}: {r.saturated_frac:.1%} of values saturate (|x| reaches {r.amax:.3g} = "
                                 f"{r.amax_over_range:.3g} x scale {scale} x {fmt.max:g}); relative error "
                                 f"{r.rel_err:.3g}"))
        elif r.underflow_frac > UNDERFLOW_LIMIT:
            out.append(dict(layer=r.layer, head=r.head, side=r.side, method=r.method, kind="underflows",
                            text=f"{where}: {r.underflow_frac:.1%} of values underflow to 0 (scale {scale}); "
                                 f"relative error {r.rel_err:.3g}"))
    return pd.DataFrame(out, columns=["layer", "head", "side", "method", "kind", "text"])


# ------------------------------------------------------------------------------------ advice
def keep_bf16_advice(health: ScaleHealth, tolerance: float = DEFAULT_TOLERANCE):
    """Per method, the layers to keep 16-bit so the model's error (RMS over layers) is at most ``tolerance``.

    Layers where the method collapses a side (:attr:`ScaleHealth.collapses`) are kept 16-bit first, whatever
    the tolerance: their keys or values are gone, and an average over many layers must not hide one. Then
    greedily: the remaining layers largest error first (each one's contribution to the mean square is its
    error² / layers) until the model's error is under the tolerance; as the mean square adds up over layers,
    the greedy set is also a smallest one that holds the collapsed layers. Returns one row per method:
    ``method``, ``metric``, ``tolerance``, ``n_layers``, ``error_all_fp8``, ``layers_bf16`` (list, in the
    order taken), ``n_layers_bf16``, ``error_after``, ``collapsed_layers`` and ``advice`` (a sentence).
    """
    import pandas as pd

    if not isinstance(health, ScaleHealth):
        checks.fail(f"health is a {type(health).__name__}; expected measure_scale_health()'s ScaleHealth", TypeError)
    tolerance = checks.positive_float(tolerance, "tolerance")
    out = []
    for m in health.methods:
        lay = health.layers[health.layers["method"] == m]
        n = len(lay)
        collapsed = lay[lay["collapsed"]].sort_values(["error", "layer"], ascending=[False, True])
        rest = lay[~lay["collapsed"]].sort_values(["error", "layer"], ascending=[False, True])
        order = [*zip(collapsed["layer"], collapsed["error"], strict=True), *zip(rest["layer"], rest["error"],
                                                                                     strict=True)]
        squares = [float(e) ** 2 for _, e in order]
        kept = []
        # The mean square of the layers not kept, summed afresh (a running difference leaves rounding dust).
        while len(kept) < len(collapsed) or (len(kept) < n and math.sqrt(sum(squares[len(kept):]) / n) > tolerance):
            kept.append(int(order[len(kept)][0]))
        before, after = math.sqrt(sum(squares) / n), math.sqrt(sum(squares[len(kept):]) / n)
        if not kept:
            text = f"scale {m}: every layer can stay FP8 (RMS {health.metric} error {before:.3g} <= {tolerance})"
        else:
            forced = f"; {len(collapsed)} of them collapse under this scale" if len(collapsed) else ""
            text = (f"scale {m}: keep {len(kept)} of {n} layers 16-bit ({', '.join(map(str, sorted(kept)))}): RMS "
                    f"{health.metric} error {before:.3g} -> {after:.3g} <= {tolerance} (greedy, largest error "
                    f"first{forced})")
        out.append(dict(method=m, metric=health.metric, tolerance=tolerance, n_layers=n, error_all_fp8=before,
                        layers_bf16=kept, n_layers_bf16=len(kept), error_after=after,
                        collapsed_layers=sorted(int(x) for x in collapsed["layer"]), advice=text))
    return pd.DataFrame(out)


def advice_capacity(advice, model, *, kv_dtype: str = "fp8_e4m3", granularity: str = "tensor",
                    gpu_memory_gib="H200", kv_memory_gib=None, **plan_kw):
    """What each advice costs in tokens: :func:`fp8kv.capacity.plan_capacity` for the model all-FP8 and
    all-16-bit, and the mix (``n_layers_bf16`` layers 16-bit, the rest FP8) from the same per-token bytes.

    One token of one layer costs ``bytes_per_token / num_layers`` of its dtype (K and V, and per-token
    scales); the mix pays the fixed scales of its FP8 layers only; blocks and tokens follow the planner's
    rule (``floor((budget - fixed scales) / (block_size x bytes per token))`` blocks). ``model``: what
    ``plan_capacity`` takes (a registry name such as ``"SmolLM2-135M"``, a ModelShape, ...), with as many layers
    as the advice measured. ``gpu_memory_gib`` / ``kv_memory_gib`` and ``plan_kw`` (``utilization``,
    ``block_size``, ...) go to ``plan_capacity``. Adds ``tokens_fp8``, ``tokens_mixed``, ``tokens_bf16``,
    ``tokens_lost`` (all-FP8 minus mixed) and ``gain_kept`` (the share of FP8's extra tokens the mix keeps).
    """
    import pandas as pd

    from ..capacity import plan_capacity

    if not isinstance(advice, pd.DataFrame) or {"n_layers_bf16", "n_layers"} - set(advice.columns):
        checks.fail("advice must be keep_bf16_advice()'s table", TypeError)
    check_layer_counts(advice)  # a negative or fractional count gave capacities no cache has
    memory = dict(kv_memory_gib=kv_memory_gib) if kv_memory_gib is not None else dict(gpu_memory_gib=gpu_memory_gib)
    fp8 = plan_capacity(model, kv_dtype, granularity=granularity, **memory, **plan_kw)
    b16 = plan_capacity(model, "bf16", **memory, **plan_kw)
    n_layers = fp8["num_layers"]
    measured = set(int(x) for x in advice["n_layers"])
    if measured != {n_layers}:
        checks.fail(f"model {fp8['model']!r} has {n_layers} layers but the advice measured {sorted(measured)}; "
                    "expected the model the K/V were captured from")
    per_layer8, per_layer16 = fp8["bytes_per_token"] / n_layers, b16["bytes_per_token"] / n_layers
    fixed8 = fp8["fixed_scale_bytes"] / n_layers
    budget, bs = fp8["kv_budget_bytes"], fp8["block_size"]

    def tokens(n16: int) -> int:
        bpt = n16 * per_layer16 + (n_layers - n16) * per_layer8
        blocks = int((budget - (n_layers - n16) * fixed8) // (bs * bpt))
        return max(blocks, 0) * bs

    out = advice.copy()
    out["tokens_fp8"], out["tokens_bf16"] = fp8["tokens"], b16["tokens"]
    out["tokens_mixed"] = [tokens(int(n)) for n in out["n_layers_bf16"]]
    out["tokens_lost"] = out["tokens_fp8"] - out["tokens_mixed"]
    gain = fp8["tokens"] - b16["tokens"]
    out["gain_kept"] = (out["tokens_mixed"] - b16["tokens"]) / gain if gain else float("nan")
    out["capacity"] = [f"{r.tokens_mixed:,} tokens ({r.tokens_lost:,} fewer than all-FP8's {r.tokens_fp8:,}; "
                       f"{r.gain_kept:.0%} of FP8's gain over 16-bit kept)" for r in out.itertuples()]
    return out


# ------------------------------------------------------------------------------------ a real model
def model_scale_health(model: str = "smollm2-135m", num_tokens: int = 256, calibration_tokens: int = 256,
                       num_queries: int = 16, *, device="cpu", kv_dtype: str = "fp8_e4m3",
                       granularity: str = "tensor", methods=None, percentile: float = 99.9, key_gain: float = 1.0,
                       key_layers=(), offset: int = 0) -> ScaleHealth:
    """:func:`measure_scale_health` of an offline model (``fp8kv.models``) on the fixed evaluation text.

    One forward of ``num_tokens`` tokens captures every layer's K (after RoPE), V and Q; the last
    ``num_queries`` query rows act as decode queries over the whole captured context, with the layer's
    softmax scale. The ``"calibrated"`` scales come from the ``calibration_tokens`` tokens that follow
    (a disjoint text: amax per layer, ``fp8kv.models.calibrate_scales``). fp32 weights on ``device``; with
    ``key_layers``, those layers' keys ``key_gain`` times larger
    (:func:`fp8kv.models.outliers.load_model_with_keys`). ``offset``: the captured text starts at that token
    (the calibration text stays where it is). ImportError when the ``models`` extra or the weights package is missing (the message names the pip
    command).
    """
    from ..models import KVQuantConfig, calibrate_scales, capture_kv, text_tokens
    from ..models.outliers import load_model_with_keys

    num_tokens = checks.positive_int(num_tokens, "num_tokens")
    calibration_tokens = checks.positive_int(calibration_tokens, "calibration_tokens")
    checks.integer(num_queries, "num_queries", minimum=1, maximum=num_tokens)
    checks.one_of(granularity, "granularity", HEALTH_GRANULARITIES)
    offset = checks.nonnegative_int(offset, "offset")
    _fp8(kv_dtype)  # refused before the model loads
    net, tok, changed = load_model_with_keys(model, device=device, key_gain=key_gain, key_layers=key_layers)
    cap = capture_kv(net, text_tokens(tok, num_tokens, offset=offset))
    cal = calibrate_scales(net, text_tokens(tok, calibration_tokens, offset=num_tokens),
                           KVQuantConfig(kv_dtype=kv_dtype, granularity=granularity), window=calibration_tokens)
    health = measure_scale_health([x.float() for x in cap.k], [x.float() for x in cap.v],
                          q=[x[-num_queries:].float() for x in cap.q], sm_scale=cap.sm_scale, calibration=cal,
                          kv_dtype=kv_dtype, granularity=granularity, methods=methods, percentile=percentile)
    text = (f"{model}: {num_tokens} tokens captured, {num_queries} decode queries, calibrated on the next "
            f"{calibration_tokens} tokens of the evaluation text" if offset == 0 else
            f"{model}: held-out text, {num_tokens} tokens from token {offset}")
    health.notes.append(text + (f"; {changed}" if changed else ""))
    return health
