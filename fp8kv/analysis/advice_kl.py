"""Whether the keep-16-bit advice buys accuracy where it counts, in the model's next-token distribution: KL
against the 16-bit cache with every layer FP8, and with the advised layers 16-bit (vLLM's
``--kv-cache-dtype-skip-layers``), per scale method, on a stretch of the text the advice was not chosen on.

The advice itself (:func:`fp8kv.analysis.keep_bf16_advice`) is chosen on the attention output's error; this is
the measurement that says whether following it changes what the model predicts."""

from __future__ import annotations

from .. import checks
from ..quant import check_scale_method
from .errors import check_bf16_layers
from .scale_health import HEALTH_GRANULARITIES

__all__ = ["METHOD_SCALES", "advice_kl", "advice_kl_text", "stress_sentence"]

# Each scale method of the scale health as a simulated cache's (k_scale, v_scale); "calibrated" takes the
# per-layer scales calibrate_scales derives from the calibration text instead.
METHOD_SCALES = {"1.0": (1.0, 1.0), "amax": ("amax", "amax"), "percentile": ("percentile", "percentile"),
                 "vllm": ("vllm_k", "vllm_v")}


def advice_kl(model: str, advice, *, num_tokens: int = 256, calibration_tokens: int = 256, window: int = 128,
              offset: int | None = None, device="cpu", kv_dtype: str = "fp8_e4m3", granularity: str = "tensor",
              percentile: float = 99.9, key_gain: float = 1.0, key_layers=()):
    """Per method of ``advice`` (``keep_bf16_advice``'s or ``advice_capacity``'s table): next-token KL and top-1
    agreement against the bf16 cache (:func:`fp8kv.models.evaluate`, windows of ``window`` tokens) with every
    layer FP8, and with the advice's ``layers_bf16`` kept 16-bit. The text: ``num_tokens`` tokens from token
    ``offset`` (default ``num_tokens + calibration_tokens``: after what ``model_scale_health`` captures and
    calibrates on, the held-out stretch); the ``"calibrated"`` scales from tokens ``num_tokens`` ..
    ``num_tokens + calibration_tokens`` as there. ``granularity`` and ``percentile``: the scales' as in the
    scale health the advice came from (its ``ScaleHealth.granularity``; a per-head advice measured with
    per-tensor scales would judge other scales than it chose for). ``key_gain`` / ``key_layers``:
    :func:`fp8kv.models.outliers.load_model_with_keys`'s.

    Returns ``advice`` with ``kl_all_fp8``, ``kl_after``, ``top1_all_fp8``, ``top1_after`` and ``kl_reduces``
    (after < all-FP8; None where no layer is kept: not applicable). ImportError as ``fp8kv.models``' without the ``models`` extra."""
    import pandas as pd

    from ..models import KVQuantConfig, bos_token_id, calibrate_scales, evaluate, text_tokens
    from ..models.outliers import load_model_with_keys

    if not isinstance(advice, pd.DataFrame) or {"method", "layers_bf16"} - set(advice.columns):
        checks.fail("advice must be keep_bf16_advice()'s table", TypeError)
    unknown = sorted(set(advice["method"]) - set(METHOD_SCALES) - {"calibrated"})
    if unknown:
        checks.fail(f"advice has method(s) {unknown}; expected among {[*METHOD_SCALES, 'calibrated']}")
    check_bf16_layers(advice)  # int() read 1.5 as layer 1, a string as its characters
    num_tokens = checks.positive_int(num_tokens, "num_tokens")
    calibration_tokens = checks.positive_int(calibration_tokens, "calibration_tokens")
    window = checks.integer(window, "window", minimum=2, maximum=num_tokens)
    offset = num_tokens + calibration_tokens if offset is None else checks.nonnegative_int(offset, "offset")
    checks.one_of(kv_dtype, "kv_dtype", ("fp8_e4m3", "fp8_e5m2"))
    checks.one_of(granularity, "granularity", HEALTH_GRANULARITIES)
    percentile = check_scale_method("percentile", percentile)
    net, tok, _ = load_model_with_keys(model, device=device, key_gain=key_gain, key_layers=key_layers)
    scales = dict(METHOD_SCALES)
    if "calibrated" in set(advice["method"]):
        scales["calibrated"] = calibrate_scales(net, text_tokens(tok, calibration_tokens, offset=num_tokens),
                                                KVQuantConfig(kv_dtype=kv_dtype, granularity=granularity),
                                                window=calibration_tokens)
    configs = []
    for r in advice.itertuples(index=False):
        k, v = scales[r.method]
        same = dict(kv_dtype=kv_dtype, granularity=granularity, percentile=percentile, k_scale=k, v_scale=v)
        configs.append(KVQuantConfig(name=f"{r.method} all FP8", **same))
        if len(r.layers_bf16):
            configs.append(KVQuantConfig(name=f"{r.method} advised", **same,
                                         bf16_layers=tuple(int(x) for x in r.layers_bf16)))
    got = evaluate(net, text_tokens(tok, num_tokens, offset=offset), configs, window=window,
                   bos_token_id=bos_token_id(tok), measure_error=False).set_index("config")
    out = advice.copy()
    for col, metric in (("kl", "kl_mean"), ("top1", "top1_agree")):
        out[f"{col}_all_fp8"] = [float(got.loc[f"{m} all FP8", metric]) for m in out["method"]]
        out[f"{col}_after"] = [float(got.loc[f"{m} advised" if len(kept) else f"{m} all FP8", metric])
                               for m, kept in zip(out["method"], out["layers_bf16"], strict=True)]
    # None where no layer is kept: there is no advised run to compare, not a reduction
    out["kl_reduces"] = [bool(a < b) if len(kept) else None for a, b, kept in
                         zip(out["kl_after"], out["kl_all_fp8"], out["layers_bf16"], strict=True)]
    return out


def _layers(layers) -> str:
    return ", ".join(str(int(x)) for x in sorted(layers))


def advice_kl_text(table) -> list[str]:
    """One line per method of :func:`advice_kl`'s table: the layers kept and the KL and top-1 agreement they
    buy, or the KL of every layer FP8 where none is kept."""
    import pandas as pd

    need = {"method", "layers_bf16", "kl_all_fp8", "kl_after", "top1_all_fp8", "top1_after"}
    if not isinstance(table, pd.DataFrame) or need - set(table.columns):
        checks.fail("table must be advice_kl()'s", TypeError)
    check_bf16_layers(table, "table")
    out = []
    for r in table.itertuples(index=False):
        if len(r.layers_bf16):
            kept = _layers(r.layers_bf16)
            out.append(f"scale {r.method}: layers {kept} kept 16-bit: next-token KL {r.kl_all_fp8:.3g} -> "
                       f"{r.kl_after:.3g}, top-1 agreement {r.top1_all_fp8:.1%} -> {r.top1_after:.1%}")
        else:
            out.append(f"scale {r.method}: every layer FP8: next-token KL {r.kl_all_fp8:.3g}, top-1 agreement "
                       f"{r.top1_all_fp8:.1%}")
    return out


def stress_sentence(table, key_gain: float, key_layers) -> str:
    """The answer's sentence for :func:`advice_kl` of the model with large keys: what scale 1.0 does to it, what
    keeping the collapsed layers 16-bit buys in next-token KL and, where the table went through
    :func:`~fp8kv.analysis.advice_capacity` (``tokens_lost``), what it costs in tokens ("" without a ``"1.0"``
    row)."""
    import pandas as pd

    if not isinstance(table, pd.DataFrame) or {"method", "layers_bf16", "kl_all_fp8", "kl_after"} - set(table.columns):
        checks.fail("table must be advice_kl()'s", TypeError)
    check_bf16_layers(table, "table")
    key_gain = checks.positive_float(key_gain, "key_gain")
    key_layers = [checks.nonnegative_int(x, "key_layers") for x in checks.listed(key_layers, "key_layers",
                                                                               "layer indices (ints >= 0)")]
    rows = table[table["method"] == "1.0"]
    if rows.empty:
        return ""
    r = rows.iloc[0]
    layers = _layers(key_layers)
    where = f"With the keys of layer(s) {layers} x{key_gain:g} (the same model, keys beyond e4m3's range)"
    if not len(r["layers_bf16"]):
        return f"{where}, scale 1.0 still needs no 16-bit layer (next-token KL {r['kl_all_fp8']:.3g})."
    kept = _layers(r["layers_bf16"])
    cost = ""
    if "tokens_lost" in table.columns:
        lost = checks.nonnegative_int(r["tokens_lost"], "table['tokens_lost']")  # NaN or 1.5 read as a count
        cost = f" ({lost:,} tokens fewer than all-FP8)"
    return (f"{where}, scale 1.0 needs layer(s) {kept} 16-bit{cost}: keeping them cuts the next-token KL from "
            f"{r['kl_all_fp8']:.3g} to {r['kl_after']:.3g}.")
