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


def _answer_09(r: dict) -> tuple[str, str]:
    return ("the break-even context of FP8 KV, a real model's scale health and error against context",
            _drop_smoke_banner(as_text(r.get("answer"))) or "no answer was written.")


def _step_sentence(rows) -> str:
    """The whole-step reading of notebook 10: the fastest KV dtype at its best batch against the 16-bit one."""
    rows = [as_dict(x) for x in (rows or []) if as_dict(x).get("best_tokens_per_s") is not None]
    base = next((x for x in rows if not x.get("kv_format")), None)
    if not rows or base is None:
        return ""
    best = max(rows, key=lambda x: float(x["best_tokens_per_s"]))
    if best is base:
        return (f" In a whole decode step ({as_text(base.get('model'))}, context {base.get('context')}) no format "
                f"outran {as_text(base.get('kv_dtype'))} KV ({float(base['best_tokens_per_s']):,.0f} tokens/s).")
    return (f" In a whole decode step ({as_text(best.get('model'))}, context {best.get('context')}), "
            f"{as_text(best.get('kv_dtype'))} KV reaches {float(best['best_tokens_per_s']):,.0f} tokens/s at batch "
            f"{best.get('best_batch')} (its ceiling {best.get('ceiling')}), "
            f"{float(best['best_tokens_per_s']) / float(base['best_tokens_per_s']):.2f}x "
            f"{as_text(base.get('kv_dtype'))} KV's best ({float(base['best_tokens_per_s']):,.0f} at batch "
            f"{base.get('best_batch')}).")


def _answer_10(r: dict) -> tuple[str, str]:
    said = _drop_smoke_banner(as_text(r.get("answer")))
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
