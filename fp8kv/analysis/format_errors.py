"""Every KV format side by side: the relative error of K, V and the attention output against fp32, on synthetic K/V
with an LLM's structure (:func:`fp8kv.synthetic.kv_like_llm`: outlier key channels, heads of different scales) and
per layer on a real model's activations (:func:`fp8kv.models.capture_kv`), with the bytes per token each format
stores (:func:`fp8kv.kv_formats.kv_footprint`); and the accuracy of next-token distributions under each format
(:func:`format_accuracy`: KL and top-1 agreement against bf16 K/V).

K and V go through :func:`fp8kv.models.kv_config.quantize_kv` with ``KVQuantConfig(fmt=...)``: the one path a
model's attention hook takes too, so these errors are those the accuracy runs see.
"""

from __future__ import annotations

import math

import torch

from .. import checks
from ..kv_formats import KV_FORMAT_NAMES, kv_footprint, kv_format
from ..models.kv_config import KVQuantConfig, quantize_kv
from ..reference import attention
from ..synthetic import kv_like_llm, queries_like_llm

__all__ = ["COMPARED_FORMATS", "through_format", "kv_format_errors", "synthetic_format_errors",
           "model_format_errors", "format_accuracy"]

# The formats compared by default: FP8 per tensor and per token and head, INT8 / INT4, KIVI, the FP4 formats.
COMPARED_FORMATS = ("fp8_e4m3_tensor", "fp8_e4m3_token_head", "int8_token_head", "int4_token_head", "kivi4_g32",
                    "kivi4_g128", "nvfp4", "mxfp4")


def _formats(formats) -> list[str]:
    return [kv_format(f).name for f in checks.many_of(formats, "formats", KV_FORMAT_NAMES)]


def through_format(x: torch.Tensor, fmt: str, which: str) -> torch.Tensor:
    """``x`` ``[T, H, D]`` (one sequence's K or V) stored in ``fmt`` and loaded back, fp32: the model hook's path
    (:func:`fp8kv.models.kv_config.quantize_kv`)."""
    checks.one_of(which, "which", ("k", "v"))
    y, _ = quantize_kv(x.float().permute(1, 0, 2)[None], KVQuantConfig(fmt=fmt), which, 0)
    return y[0].permute(1, 0, 2).float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / den if den > 0 else 0.0


def kv_format_errors(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, formats=COMPARED_FORMATS, *,
                     sm_scale: float | None = None) -> list[dict]:
    """One row per format: ``k_rel_err``, ``v_rel_err`` (``||x_hat - x|| / ||x||``) and ``out_rel_err`` (the
    attention of each query in ``q`` over all of ``k``, ``v``, fp32, quantized against exact), with
    ``bytes_per_token`` (K and V, one layer, :func:`~fp8kv.kv_formats.kv_footprint`). ``k``, ``v`` ``[T, Hkv, D]``,
    ``q`` ``[Nq, Hq, D]`` float. A format that cannot hold ``D`` gets NaN errors and the reason in ``note``."""
    for name, t in (("k", k), ("v", v), ("q", q)):
        checks.tensor(t, name, ndim=3, shape_hint="[tokens, heads, head_dim]")
    if v.shape != k.shape or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        checks.fail(f"k {tuple(k.shape)}, v {tuple(v.shape)} and q {tuple(q.shape)} must share head_dim, k and v "
                    "their shape, and q's heads be a multiple of k's")
    hkv, d = k.shape[1], k.shape[2]
    sm_scale = checks.resolved_softmax_scale(sm_scale, d)
    k, v, q = k.float(), v.float(), q.float()
    ref = torch.stack([attention(qi, k, v, sm_scale)[0] for qi in q])
    rows = []
    for f in _formats(formats):
        try:
            fp = kv_footprint(f, num_kv_heads=hkv, head_dim=d)
        except ValueError as e:
            rows.append(dict(format=f, bytes_per_token=math.nan, code_bytes=math.nan, scale_bytes=math.nan,
                             k_rel_err=math.nan, v_rel_err=math.nan, out_rel_err=math.nan, note=str(e)))
            continue
        kh, vh = through_format(k, f, "k"), through_format(v, f, "v")
        out = torch.stack([attention(qi, kh, vh, sm_scale)[0] for qi in q])
        rows.append(dict(format=f, bytes_per_token=float(fp.per_token), code_bytes=float(fp.codes),
                         scale_bytes=float(fp.per_token_scales), k_rel_err=_rel(kh, k), v_rel_err=_rel(vh, v),
                         out_rel_err=_rel(out, ref), note=""))
    return rows


def synthetic_format_errors(formats=COMPARED_FORMATS, *, num_tokens: int = 1024, num_kv_heads: int = 8,
                            head_dim: int = 128, group: int = 4, num_queries: int = 8, seed: int = 0):
    """:func:`kv_format_errors` on :func:`fp8kv.synthetic.kv_like_llm` K/V and :func:`~fp8kv.synthetic.queries_like_llm`
    queries (``group`` query heads per KV head). Returns a pandas DataFrame, one row per format, ``source``
    ``"synthetic"``, ``layer`` -1."""
    import pandas as pd

    k, v = kv_like_llm(num_tokens, num_kv_heads, head_dim, seed=seed)
    q = queries_like_llm(num_queries, num_kv_heads * checks.positive_int(group, "group"), head_dim, seed=seed + 1)
    rows = kv_format_errors(k, v, q, formats)
    return pd.DataFrame([dict(source="synthetic", layer=-1, **r) for r in rows])


def model_format_errors(model, input_ids, formats=COMPARED_FORMATS, *, num_queries: int = 8):
    """:func:`kv_format_errors` per layer of ``model`` on its own activations of ``input_ids`` (one sequence): K
    after RoPE and V as the cache holds them, the last ``num_queries`` positions' queries attending every token.
    Returns a pandas DataFrame, one row per layer and format, ``source`` the model's name."""
    import pandas as pd

    from ..models import capture_kv

    num_queries = checks.positive_int(num_queries, "num_queries")
    cap = capture_kv(model, input_ids)
    name = getattr(getattr(model, "config", None), "_name_or_path", type(model).__name__)
    rows = []
    for layer, (k, v, q, scale) in enumerate(zip(cap.k, cap.v, cap.q, cap.sm_scale, strict=True)):
        for r in kv_format_errors(k, v, q[-num_queries:], formats, sm_scale=scale):
            rows.append(dict(source=name, layer=layer, **r))
    return pd.DataFrame(rows)


def format_accuracy(model, tokens, formats=COMPARED_FORMATS, *, window: int = 256, n_windows: int | None = None,
                    bos_token_id: int | None = None, per_layer: bool = False):
    """Next-token distributions with K/V stored in each format against bf16 K/V (KL, top-1 agreement,
    perplexity change): :func:`fp8kv.models.evaluate` with ``KVQuantConfig(fmt=f)`` per format, K/V quantized in
    the attention hook as they enter the cache. Returns its table (one row per format, the baseline first), and
    the per-layer table with ``per_layer=True``."""
    from ..models import evaluate

    configs = [KVQuantConfig(fmt=f) for f in _formats(formats)]
    return evaluate(model, tokens, configs, window=window, n_windows=n_windows, bos_token_id=bos_token_id,
                    per_layer=per_layer)
