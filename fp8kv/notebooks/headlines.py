"""Each notebook page's first screen: the machine, what was measured and the answer in a sentence, written from
the results the notebook saved (:func:`page_headline`; a notebook's last cell, tagged ``headline``, shows
:func:`headline_markdown`, and the page renderer moves it under the title). A smoke run says its numbers are no
result instead of giving them as one."""

from __future__ import annotations

import os
import re

from ..results import load_results
from .index import HEADLINE_FP8, as_dict, as_dicts, as_text, fmt_value, shapes_text

__all__ = ["page_headline", "headline_markdown"]


def _device_words(device: dict) -> str:
    name = str(device.get("name") or device.get("device") or "this machine")
    arch = device.get("arch")
    mem = device.get("memory_gib")
    extra = ", ".join(x for x in (str(arch) if arch else "", f"{mem:.0f} GiB" if isinstance(mem, (int, float)) else "")
                      if x)
    return f"**{name}**" + (f" ({extra})" if extra else "")


def _pct(v) -> str:
    return fmt_value(100 * v, ".3g", " %") if fmt_value(v) != "–" else "–"


def _answer_00(r: dict) -> tuple[str, str]:
    here = as_dicts(r.get("capability_here"))
    gbps = as_dict(r.get("copy_bandwidth")).get("gbps")
    return ("its copy bandwidth and what runs on it",
            f"one device-to-device copy moves {fmt_value(gbps, '.4g', ' GB/s')}; "
            f"{sum(bool(x.get('supported')) for x in here)} of {len(here)} backend × KV dtype × mode combinations "
            "run here.")


def _answer_01(r: dict) -> tuple[str, str]:
    parts = []
    for name, f in as_dict(r.get("roundtrip")).items():
        f = as_dict(f)
        parts.append(f"{name} {fmt_value(f.get('max_rel_error_normal'), '.3g')} (bound {fmt_value(f.get('unit_roundoff'), '.3g')})")
    casts = ", ".join(f"{n} {as_dict(c).get('bare_nonfinite')} of {len(as_dict(c).get('inputs') or [])}"
                      for n, c in as_dict(r.get("casts")).items() if isinstance(as_dict(c).get("bare_nonfinite"), int))
    return ("the FP8 formats' round trip and casts on this device",
            f"largest relative error of a normal value: {', '.join(parts) or '–'}; inputs near and beyond max that a "
            f"bare cast turns into inf/NaN: {casts or '–'} (fp8kv's clamp: none).")


def _answer_02(r: dict) -> tuple[str, str]:
    sizes = as_dict(r.get("sizes"))
    k = r.get("e4m3_tensor_amax_k_rel_err")
    out = r.get("e4m3_tensor_amax_out_rel_err")
    e5 = as_dict(r.get("key_numbers")).get("e5m2_tensor_amax_out_rel_err")
    return (f"quantization error of synthetic K/V ({as_text(sizes.get('tokens'))} tokens)",
            f"e4m3 with one amax scale per tensor: K relative error {fmt_value(k, '.2e')}, attention output "
            f"{fmt_value(out, '.2e')} (e5m2: {fmt_value(e5, '.2e')}).")


def _answer_03(r: dict) -> tuple[str, str]:
    rows = as_dicts(r.get("fp8_over_bf16_tokens_ratio_rows"))
    ratios = [x.get("ratio") for x in rows if fmt_value(x.get("ratio")) != "–"]
    span = "–" if not ratios else (f"{min(ratios):.3f}×" if f"{min(ratios):.3f}" == f"{max(ratios):.3f}"
                                   else f"{min(ratios):.3f}–{max(ratios):.3f}×")
    ref = as_text(r.get("reference_gpu"))
    elsewhere = ", ".join(f"{as_text(x.get('model'))} on {as_text(x.get('gpu'))}" for x in rows if x.get("gpu") != ref)
    return ("how many KV tokens fit, by the paged engines' accounting",
            f"FP8 e4m3 with per-tensor scales holds {span} the tokens of bf16 for the {len(rows)} models on {ref}"
            + (f" ({elsewhere}, whose bf16 weights do not fit {ref})" if elsewhere else "")
            + f", at utilization {as_text(r.get('utilization'))}.")


def _answer_04(r: dict) -> tuple[str, str]:
    used = [x for x in as_dicts(r.get("speedup")) if all(x.get(k) == v for k, v in HEADLINE_FP8.items())
            and not x.get("variant") and fmt_value(x.get("speedup_vs_bf16")) != "–"]
    import statistics

    v = [x["speedup_vs_bf16"] for x in used]
    best = max((as_dict(x).get("pct_copy_bw") for x in as_dicts(r.get("best_pct_copy_bw"))
                if fmt_value(as_dict(x).get("pct_copy_bw")) != "–"), default=None)
    answer = (f"fp8kv's FP8 decode (e4m3, dequant) is {statistics.median(v):.2f}× as fast as the best 16-bit decode "
              f"(median; best {max(v):.2f}×) over {shapes_text(used)}" if v else "no FP8-over-BF16 speed-up ran")
    return ("paged decode latency of every backend × KV dtype × mode",
            answer + (f"; the fastest calls reach {best:.0f} % of the copy bandwidth." if best is not None else "."))


def _answer_05(r: dict) -> tuple[str, str]:
    return ("every backend × KV format against the fp32 reference",
            f"{as_text(r.get('n_ran'))} of {as_text(r.get('n_rows'))} combinations ran here: {as_text(r.get('n_passed'))} "
            f"within their tolerance, {as_text(r.get('n_failed'))} above it, {as_text(r.get('n_error'))} raised; "
            f"{as_text(r.get('n_unsupported'))} cannot run here.")


def _answer_06(r: dict) -> tuple[str, str]:
    rows = [x for x in as_dicts(r.get("summary")) if x.get("config") == "e4m3 tensor amax"]
    parts = [f"{as_text(x.get('model'))}: KL {fmt_value(x.get('kl_mean'), '.2e')} nats/token, top-1 agreement "
             f"{_pct(x.get('top1_agree'))}" for x in rows]
    return ("real models' next-token predictions with an FP8 KV cache against bf16",
            f"e4m3 with per-tensor amax scales: {'; '.join(parts) or '–'}.")


def _answer_07(r: dict) -> tuple[str, str]:
    sentences = [as_dict(x).get("sentence") for x in as_dict(r.get("reading")).values()]
    sentences = [s for s in sentences if s]
    more = f" ({len(sentences) - 1} more below)" if len(sentences) > 1 else ""
    base = as_text(r.get("baseline_kv_dtype")) if r.get("baseline_kv_dtype") else "16-bit"
    return (f"whole decode steps, {base} against FP8 KV", (sentences[0] + more) if sentences else
            f"no pair of {base} and FP8 steps ran.")


def _answer_08(r: dict) -> tuple[str, str]:
    readings = [as_dict(x) for x in as_dict(r.get("verify_reading")).values()]
    spec = [x for x in readings if x.get("draft_len") and x.get("sentence")]
    chunked = [as_dict(x).get("sentence") for x in as_dict(r.get("prefill_reading")).values()]
    said = " ".join(s for s in (spec[0]["sentence"] if spec else None, next(iter(chunked), None)) if s)
    return ("speculative-decoding verify steps and chunked prefill, 16-bit against FP8 KV",
            said or "no pair of 16-bit and FP8 runs completed.")


def _drop_smoke_banner(text: str) -> str:
    """A notebook's own answer without the smoke banner it may open with (the headline says it once)."""
    return re.sub(r"^\*\*Smoke run[^*]*\*\*\s*", "", text)


def _saved_table(rows):
    """A table ``save_results`` wrote (a list of row dicts) as a DataFrame, its non-finite floats (saved as the strings
    "nan", "inf", "-inf") floats again; None where there is none."""
    import pandas as pd

    if not isinstance(rows, list):
        return None
    back = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
    return pd.DataFrame([{k: back.get(v, v) if isinstance(v, str) else v for k, v in as_dict(x).items()}
                         for x in rows])


def _answer_09(r: dict) -> tuple[str, str]:
    """Notebook 09's answer in two sentences, written afresh from the tables it saved
    (:func:`fp8kv.analysis.deciding.headline`: per batch fp8kv's and FlashInfer's verdicts, then accuracy); a
    results file without them gives the answer it saved."""
    from ..analysis.deciding import headline

    what = "the break-even context of FP8 KV, a real model's scale health and error against context"
    crossings, verdict, advice = (_saved_table(r.get(k)) for k in ("crossings", "long_context_verdict", "advice"))
    if crossings is None and verdict is None and advice is None:
        return what, (_drop_smoke_banner(str(r["answer"])) if r.get("answer") else "") or "no answer was written."
    gpu = str(crossings["gpu"].iloc[0]) if crossings is not None and "gpu" in crossings and len(crossings) else ""
    gpu = gpu or "this GPU"
    said = headline(gpu, crossings=crossings, verdict=verdict, advice=advice,
                    health=_saved_table(r.get("scale_health_collapses")), model=str(r.get("model") or "") or None,
                    backend=as_dict(r.get("settings")).get("answer_backend"))
    lead = f"On {gpu}, "  # the page's first words name the machine already
    return what, (said[len(lead)].upper() + said[len(lead) + 1:]) if said.startswith(lead) else said


def _step_sentence(rows) -> str:
    """The whole-step reading of notebook 10: the fastest KV dtype at its best batch against the 16-bit one."""
    rows = [as_dict(x) for x in (rows or []) if as_dict(x).get("best_tokens_per_s") is not None]
    base = next((x for x in rows if not x.get("kv_format")), None)
    if not rows or base is None:
        return ""
    best = max(rows, key=lambda x: float(x["best_tokens_per_s"]))
    where = f"In a whole decode step ({as_text(best.get('model'))}, {fmt_value(best.get('context'), ',.0f')} tokens)"
    if best is base:
        return (f" {where} no format outran {as_text(base.get('kv_dtype'))} KV "
                f"({float(base['best_tokens_per_s']):,.0f} tokens/s).")
    return (f" {where} {as_text(best.get('kv_dtype'))} KV reaches {float(best['best_tokens_per_s']):,.0f} tokens/s at "
            f"batch {best.get('best_batch')}, {float(best['best_tokens_per_s']) / float(base['best_tokens_per_s']):.2f}x "
            f"{as_text(base.get('kv_dtype'))} KV's best ({float(base['best_tokens_per_s']):,.0f}).")


def _pick_sentence(r: dict) -> str:
    """Notebook 10's pick from its table: the format, why, its KL, bytes per token and tokens over bf16's; "" where
    the table holds no row of the pick."""
    pick = as_text(r.get("pick")) if r.get("pick") else ""
    row = next((as_dict(x) for x in as_dicts(r.get("table")) if as_dict(x).get("format") == pick), None)
    if not pick or row is None:
        return ""
    bf16 = next((as_dict(x) for x in as_dicts(r.get("capacity")) if as_dict(x).get("kv_dtype") == "bf16"), {})
    ratio = (f", {float(row['tokens']) / float(bf16['tokens']):.2f}× bf16's tokens"
             if fmt_value(row.get("tokens")) != "–" and fmt_value(bf16.get("tokens")) not in ("–", "0") else "")
    return (f"pick **{pick}** for {as_text(r.get('capacity_model') or r.get('model'))}, the smallest format on the "
            f"Pareto front within {fmt_value(r.get('tolerance'), 'g')} nats/token: KL "
            f"{fmt_value(row.get('kl_mean'), '.3g')} against bf16 K/V (top-1 {_pct(row.get('top1_agree'))}), "
            f"{fmt_value(row.get('bytes_per_token'), ',.0f')} bytes per token{ratio}.")


def _answer_10(r: dict) -> tuple[str, str]:
    """Notebook 10's answer in two sentences: the pick from its table, then the whole-step reading; a results file
    without the pick's row gives the first sentence of the answer it saved."""
    said = _pick_sentence(r)
    if not said:
        saved = _drop_smoke_banner(as_text(r.get("answer"))) if r.get("answer") else ""
        said = re.split(r"(?<=[.!?])\s+(?=[A-Z*])", saved)[0] if saved else ""
    return ("every KV format's error, bytes per token and speed",
            (said + _step_sentence(r.get("step_ceilings"))) if said else "no answer was written.")


_ANSWERS = {"00": _answer_00, "01": _answer_01, "02": _answer_02, "03": _answer_03, "04": _answer_04,
            "05": _answer_05, "06": _answer_06, "07": _answer_07, "08": _answer_08, "09": _answer_09,
            "10": _answer_10}


def page_headline(name: str, results: dict, device: dict, *, smoke: bool) -> str:
    """The first screen of notebook ``name``'s page, as Markdown written from its ``results`` (the JSON
    ``save_results`` wrote): the machine, what was measured, and the answer in a sentence. A smoke run says
    that its numbers are no result instead of giving them as one."""
    if not isinstance(results, dict) or not isinstance(device, dict):
        raise TypeError(f"results and device must be the dicts of a results file, got {type(results).__name__} "
                        f"and {type(device).__name__}")
    answer = _ANSWERS.get(str(name)[:2])
    if answer is None:
        raise ValueError(f"name={name!r} has no headline; expected one of the notebooks {sorted(_ANSWERS)}")
    what, said = answer(results)
    if smoke:
        return (f"**Smoke run** on {_device_words(device)}: {what}, at toy sizes to check the code path. "
                "Its numbers are no result for this machine or any GPU.")
    return f"On {_device_words(device)}, {what}: {said}"


def headline_markdown(out_dir: str | os.PathLike, name: str, *, smoke: bool) -> str:
    """:func:`page_headline` of the results notebook ``name`` saved in ``out_dir``."""
    doc = load_results(out_dir, name)
    return page_headline(name, doc["results"], as_dict(doc.get("device")), smoke=bool(smoke))
