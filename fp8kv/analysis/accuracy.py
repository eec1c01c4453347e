"""Real models with an FP8 KV cache (notebook 06): how far their predictions move from a bf16 KV
cache (:func:`model_accuracy`), and greedy decoding through a paged FP8 cache against bf16
(:func:`greedy_decode_table`). ``fp8kv.models`` is imported on first use (the ``models`` extra)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import checks

__all__ = ["SUMMARY_COLUMNS", "LAYER_METRICS", "AccuracyRun", "model_accuracy", "model_descriptions",
           "printable_text", "printable_decodes", "greedy_decode_table"]

# The columns of fp8kv.models.evaluate's summary a reader looks at first.
SUMMARY_COLUMNS = ("model", "config", "ppl_base", "ppl", "ppl_delta_pct", "ppl_delta_pct_se", "kl_mean", "kl_p99",
                   "top1_agree", "k_sat_frac", "v_sat_frac", "k_underflow_frac", "v_underflow_frac",
                   "attn_rel_err_max")
# The per-layer columns (of evaluate's layer table) worth drawing through the network.
LAYER_METRICS = ("attn_rel_err", "k_amax", "v_amax", "k_sat_frac", "v_sat_frac", "k_underflow_frac",
                 "v_underflow_frac")


@dataclass
class AccuracyRun:
    """What :func:`model_accuracy` measured, and the loaded models for the decode comparison.

    ``loaded``: ``{model name: (model, tokenizer)}``; ``scales``: ``{model name: (k_scales, v_scales)}``
    (calibrated per layer); ``summary`` / ``layers``: :func:`fp8kv.models.evaluate`'s tables of every
    model, concatenated.
    """

    loaded: dict = field(repr=False)
    scales: dict = field(repr=False)
    summary: object
    layers: object

    def overview(self):
        """The summary's :data:`SUMMARY_COLUMNS`."""
        return self.summary[list(SUMMARY_COLUMNS)]


def model_accuracy(models, *, device="cpu", window: int = 512, n_windows: int = 12, calib_tokens: int = 4096,
                   calib_offset: int = 60_000, smoke: bool = False) -> AccuracyRun:
    """Every configuration of :func:`fp8kv.models.standard_configs` against the bf16 KV cache, per model.

    For each model (names of ``fp8kv.models.WEIGHTS``): load it on ``device``, calibrate per-layer
    scales on ``calib_tokens`` held-out tokens from token ``calib_offset``, then
    :func:`~fp8kv.models.evaluate` every configuration (the smoke list with ``smoke``) on the same
    ``n_windows`` windows of ``window`` tokens from the start of the text, BOS first where the
    tokenizer puts one. Raises ImportError (naming the pip command) when a model cannot be loaded.
    """
    import pandas as pd

    from ..models import (
        WEIGHTS,
        bos_token_id,
        calibrate_scales,
        evaluate,
        load_model,
        standard_configs,
        text_tokens,
    )

    # every name before the first model loads: a typo in the last one lost the minutes spent on the others
    models = list(dict.fromkeys(checks.many_of(models, "models", tuple(WEIGHTS))))
    window = checks.integer(window, "window", minimum=2)  # a window scores its tokens after the first
    n_windows = checks.positive_int(n_windows, "n_windows")
    calib_tokens = checks.positive_int(calib_tokens, "calib_tokens")
    calib_offset = checks.nonnegative_int(calib_offset, "calib_offset")
    loaded, scales, summaries, layer_tables = {}, {}, [], []
    for name in models:
        model, tok = load_model(name, device=device)
        loaded[name] = (model, tok)
        bos = bos_token_id(tok)  # Gemma reads <bos> first; SmolLM2 uses none
        scales[name] = calibrate_scales(model, text_tokens(tok, calib_tokens, offset=calib_offset), bos_token_id=bos)
        summary, layers = evaluate(model, text_tokens(tok, window * n_windows),
                                   standard_configs(*scales[name], smoke=smoke), window=window, bos_token_id=bos,
                                   per_layer=True)
        summaries.append(summary)
        layer_tables.append(layers)
    return AccuracyRun(loaded, scales, pd.concat(summaries, ignore_index=True),
                       pd.concat(layer_tables, ignore_index=True))


def model_descriptions(models):
    """One row per model name of ``fp8kv.models.WEIGHTS``: model, description. A DataFrame."""
    import pandas as pd

    from ..models import WEIGHTS

    models = [models] if isinstance(models, str) else list(models)
    return pd.DataFrame([{"model": m, "description": WEIGHTS[checks.one_of(m, "model", WEIGHTS)].description}
                         for m in models])


def printable_text(text: str) -> str:
    """Generated text for a one-line table cell: each line break shown as ``⏎``, runs of spaces kept."""
    return str(text).replace("\r\n", "\n").replace("\n", "⏎ ")


def printable_decodes(decodes):
    """A :func:`greedy_decode_table` with its ``text`` and ``baseline_text`` through :func:`printable_text`
    (one line per cell)."""
    return decodes.assign(text=decodes["text"].map(printable_text),
                          baseline_text=decodes["baseline_text"].map(printable_text))


def greedy_decode_table(loaded: dict, scales: dict, backends, *, prompt_tokens: int, new_tokens: int,
                        offset: int):
    """Greedy decoding through a paged FP8 cache against the same loop on bf16, per model × backend × setup.

    ``loaded``: ``{model name: (model, tokenizer)}``; ``scales``: ``{model name: (k_scale, v_scale)}``
    (calibrated per-layer scales). Runs, for each: e4m3 with scales from the prompt, e4m3 with the
    calibrated scales, e5m2 with scales from the prompt. Returns a DataFrame, one row per run, with
    :meth:`fp8kv.models.DecodeResult.summary` (of ``greedy_decode_paged``) plus ``text`` and ``baseline_text``.
    """
    import pandas as pd

    from ..models import greedy_decode_paged, text_tokens

    rows = []
    for name, (model, tok) in loaded.items():
        prompt = text_tokens(tok, prompt_tokens, offset=offset, bos=True)
        runs = {"e4m3, scales from prompt": dict(kv_dtype="fp8_e4m3"),
                "e4m3, calibrated scales": dict(kv_dtype="fp8_e4m3", k_scale=scales[name][0], v_scale=scales[name][1]),
                "e5m2, scales from prompt": dict(kv_dtype="fp8_e5m2")}
        for backend in backends:
            for label, kw in runs.items():
                r = greedy_decode_paged(model, prompt, new_tokens, backend=backend, **kw)
                rows.append({"model": name, "backend": backend, "run": label, **r.summary(),
                             "text": tok.decode(r.tokens), "baseline_text": tok.decode(r.baseline_tokens)})
    return pd.DataFrame(rows)
