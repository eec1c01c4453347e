"""Real models with an FP8 KV cache (notebook 06): greedy decoding through a paged FP8 cache against bf16."""

from __future__ import annotations

__all__ = ["printable_text", "greedy_decode_table"]


def printable_text(text: str) -> str:
    """Generated text for a one-line table cell: each line break shown as ``⏎``, runs of spaces kept."""
    return str(text).replace("\r\n", "\n").replace("\n", "⏎ ")


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
