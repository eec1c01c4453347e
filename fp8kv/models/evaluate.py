"""Accuracy of a model with a quantized KV cache, against the bf16-KV baseline on the same tokens.

Metrics, per configuration (all teacher-forced over the same windows):

* perplexity of the next token (``ppl``) beside the baseline's (``ppl_base``); ``ppl_delta_pct``
  with ``ppl_delta_pct_se``, the standard error of the per-window deltas (deltas smaller than about
  two standard errors are window-to-window noise);
* ``kl_mean``: mean KL(baseline || config) of the next-token distributions, nats per token, and its
  99th percentile over tokens (``kl_p99``): far more sensitive than perplexity, since it compares
  whole distributions token by token rather than the probability of one target;
* ``top1_agree``: fraction of positions whose argmax token equals the baseline's;
* saturation / underflow counts and fractions of K and V, and the per-layer local attention
  output error (``attn_rel_err_mean`` / ``_max`` over layers; per layer with ``per_layer=True``).
"""

from __future__ import annotations

import math

import torch

from .introspect import check_positions, check_token_id, layer_types, num_layers, token_ids
from .kv_config import BASELINE, KVQuantConfig, check_config_layers
from .loading import windows
from .quantized import KVStats, quantized_kv

__all__ = ["evaluate", "BASELINE", "standard_configs", "accuracy_markdown", "next_token_kl"]


def next_token_kl(base_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(baseline || other) of next-token distributions, nats, per position: both arguments are
    log-probabilities ``[..., vocab]`` (``logits.log_softmax(-1)``), the baseline's first."""
    return (base_logprobs.exp() * (base_logprobs - logprobs)).sum(-1)


def standard_configs(k_scales=None, v_scales=None, *, smoke: bool = False) -> list[KVQuantConfig]:
    """The configurations the model-accuracy notebook compares (the bf16 baseline is added by evaluate).

    ``k_scales`` / ``v_scales``: per-layer calibrated scales (:func:`fp8kv.models.calibrate_scales`);
    without them the calibrated row is left out. ``smoke`` keeps the six that carry the story:
    amax, scale 1.0, calibrated, K only, V only and a deliberately bad scale.
    """
    cal = [KVQuantConfig(name="e4m3 tensor calibrated", k_scale=k_scales, v_scale=v_scales)] \
        if k_scales is not None and v_scales is not None else []
    amax = KVQuantConfig(name="e4m3 tensor amax")
    one = KVQuantConfig(name="e4m3 tensor scale=1", k_scale=1.0, v_scale=1.0)
    k_only = KVQuantConfig(name="e4m3 K only", quantize_v=False)
    v_only = KVQuantConfig(name="e4m3 V only", quantize_k=False)
    bad = KVQuantConfig(name="bad: e4m3 amax/64", scale_factor=1 / 64)
    if smoke:
        return [amax, one, *cal, k_only, v_only, bad]
    return [
        amax, one, *cal,
        KVQuantConfig(name="e4m3 tensor vllm (amax/200, amax/100)", k_scale="vllm_k", v_scale="vllm_v"),
        KVQuantConfig(name="e4m3 head amax", granularity="head"),
        KVQuantConfig(name="e4m3 channel amax", granularity="channel"),
        KVQuantConfig(name="e4m3 token_head", granularity="token_head"),
        k_only, v_only,
        KVQuantConfig(name="e5m2 tensor amax", kv_dtype="fp8_e5m2"),
        KVQuantConfig(name="fp16", kv_dtype="fp16"),
        bad,
    ]


def accuracy_markdown(summary) -> str:
    """A markdown table of :func:`evaluate` summaries (one or several models concatenated).

    Columns: model, KV cache, PPL (baseline -> config), delta % (+- standard error over windows),
    KL nats/token, top-1 agreement, saturated %.
    """
    lines = ["| model | KV cache | PPL bf16 → this | ΔPPL % (± s.e.) | KL nats/token | top-1 agree | saturated % |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary.to_dict(orient="records"):
        sat = 100.0 * (r["k_sat_frac"] + r["v_sat_frac"]) / 2
        se = r["ppl_delta_pct_se"]
        delta = f"{r['ppl_delta_pct']:+.2f} (± {se:.2f})" if se == se else f"{r['ppl_delta_pct']:+.2f}"
        lines.append(f"| {r['model']} | {r['config']} | {r['ppl_base']:.3f} → {r['ppl']:.3f} | {delta} | "
                     f"{r['kl_mean']:.4f} | {100 * r['top1_agree']:.1f}% | {sat:.2g} |")
    return "\n".join(lines) + "\n"


def _model_name(model) -> str:
    return getattr(model, "fp8kv_name", None) or str(getattr(model.config, "model_type", "model"))


def _logprobs(model, ids) -> torch.Tensor:
    return model(input_ids=ids[None].to(model.device), use_cache=False).logits[0].float().log_softmax(-1)


@torch.no_grad()
def evaluate(model, tokens, configs, *, window: int = 256, n_windows: int | None = None,
             bos_token_id: int | None = None, baseline: KVQuantConfig = BASELINE, per_layer: bool = False,
             measure_error: bool = True, progress: bool = False):
    """Compare KV-cache configurations with the baseline on consecutive windows of ``tokens``.

    Parameters
    ----------
    model : a causal LM from :func:`fp8kv.models.load_model`.
    tokens : int64 ``[N]`` text tokens (:func:`fp8kv.models.text_tokens`; ids within the model's
        vocabulary), split into ``n_windows`` (default: as many as fit) consecutive windows of
        ``window`` tokens, each run from scratch.
    configs : a :class:`KVQuantConfig` or a list of them (labels must be distinct).
    bos_token_id : prefix each window with this token id, within the vocabulary (Gemma needs
        ``<bos>``; see :func:`fp8kv.models.bos_token_id`). With it every text token of a window is
        scored (the first from BOS alone), else all but the first.
    baseline : the reference cache (bf16 K/V by default).
    per_layer : also return the per-layer table.
    measure_error : compute each layer's local attention-output error (about twice the attention cost).

    Returns
    -------
    pandas.DataFrame, one row per configuration (the baseline first), columns: model, config,
    kv_dtype, granularity, k_scale, v_scale, scale_factor, quantize_k, quantize_v, window, n_windows,
    n_tokens, ppl_base, ppl, ppl_delta_pct, ppl_delta_pct_se, nll_delta, kl_mean, kl_p99, kl_max,
    top1_agree, k_saturated, v_saturated, k_sat_frac, v_sat_frac, k_underflow, v_underflow,
    k_underflow_frac, v_underflow_frac, attn_rel_err_mean, attn_rel_err_max. With ``per_layer=True``,
    ``(summary, layers)`` where layers has one row per (config, layer) (see :class:`KVStats`).
    """
    import pandas as pd

    if isinstance(configs, KVQuantConfig):
        configs = [configs]
    configs = list(configs)
    for c in [baseline, *configs]:
        if not isinstance(c, KVQuantConfig):
            raise TypeError(f"configs must be KVQuantConfig objects; got {type(c).__name__}")
    configs = [baseline] + [c for c in configs if c is not baseline]
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        dup = sorted({x for x in labels if labels.count(x) > 1})
        raise ValueError(f"config labels must be distinct (give them names); duplicated: {dup}")
    for c in configs:  # before any window runs, not at the first layer of the second config
        check_config_layers(model, c)
    # Ids enter here: out-of-vocabulary ones would fail in the embedding with a bare IndexError.
    tokens = token_ids(tokens, "tokens", model)
    if bos_token_id is not None:
        bos_token_id = check_token_id(bos_token_id, "bos_token_id", model)
    wins = windows(tokens, window, n_windows, bos_token_id)
    check_positions(model, len(wins[0]), f"window={window}" + (" with its BOS" if bos_token_id is not None else ""))

    n_l, types = num_layers(model), layer_types(model)
    stats = {c.label: KVStats(n_l, types) for c in configs}
    acc = {c.label: dict(nll=[], nll_base=[], kl=[], top1=0, n=0) for c in configs}
    it = wins
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(wins, desc=f"evaluate {_model_name(model)}")
    for ids in it:
        inputs, targets = ids[:-1], ids[1:]
        base_lp = None
        for cfg in configs:
            with quantized_kv(model, cfg, measure_error=measure_error and cfg is not baseline,
                              stats=stats[cfg.label]):
                lp = _logprobs(model, inputs)
            tgt = targets.to(lp.device)
            if base_lp is None:
                base_lp = lp
            a = acc[cfg.label]
            a["nll"].append(-lp.gather(-1, tgt[:, None])[:, 0].double().sum().item())
            a["nll_base"].append(-base_lp.gather(-1, tgt[:, None])[:, 0].double().sum().item())
            a["kl"].append(next_token_kl(base_lp, lp).double().cpu())
            a["top1"] += int((lp.argmax(-1) == base_lp.argmax(-1)).sum())
            a["n"] += tgt.numel()

    rows, layer_frames = [], []
    per_window = len(wins[0]) - 1  # scored tokens per window
    for cfg in configs:
        a, st = acc[cfg.label], stats[cfg.label]
        n = a["n"]
        kl = torch.cat(a["kl"])
        ppl, ppl_base = math.exp(sum(a["nll"]) / n), math.exp(sum(a["nll_base"]) / n)
        deltas = [100.0 * (math.exp((x - y) / per_window) - 1.0) for x, y in zip(a["nll"], a["nll_base"], strict=True)]
        se = (torch.tensor(deltas, dtype=torch.float64).std().item() / math.sqrt(len(deltas))
              if len(deltas) > 1 else float("nan"))
        lf = st.frame()
        k_numel, v_numel = max(1, st.total("k_numel")), max(1, st.total("v_numel"))
        rows.append(dict(
            model=_model_name(model), **cfg.describe(), window=window, n_windows=len(wins), n_tokens=n,
            ppl_base=ppl_base, ppl=ppl, ppl_delta_pct=100.0 * (ppl / ppl_base - 1.0), ppl_delta_pct_se=se,
            nll_delta=(sum(a["nll"]) - sum(a["nll_base"])) / n,
            kl_mean=float(kl.mean()), kl_p99=float(torch.quantile(kl, 0.99)), kl_max=float(kl.max()),
            top1_agree=a["top1"] / n,
            k_saturated=st.total("k_saturated"), v_saturated=st.total("v_saturated"),
            k_sat_frac=st.total("k_saturated") / k_numel, v_sat_frac=st.total("v_saturated") / v_numel,
            k_underflow=st.total("k_underflow"), v_underflow=st.total("v_underflow"),
            k_underflow_frac=st.total("k_underflow") / k_numel, v_underflow_frac=st.total("v_underflow") / v_numel,
            attn_rel_err_mean=float(lf.attn_rel_err.mean()), attn_rel_err_max=float(lf.attn_rel_err.max()),
        ))
        if per_layer:
            lf.insert(0, "config", cfg.label)
            lf.insert(0, "model", _model_name(model))
            layer_frames.append(lf)
    summary = pd.DataFrame(rows)
    if per_layer:
        return summary, pd.concat(layer_frames, ignore_index=True)
    return summary
