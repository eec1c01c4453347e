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
from ..kv_formats import KV_FORMAT_NAMES, holding_formats, kv_footprint, kv_format
from ..models.kv_config import KVQuantConfig, quantize_kv
from ..reference import attention
from ..synthetic import kv_like_llm, queries_like_llm
from .errors import check_qkv

__all__ = ["COMPARED_FORMATS", "through_format", "kv_format_errors", "synthetic_format_errors",
           "model_format_errors", "format_accuracy", "models_format_accuracy", "fitting_formats", "bench_format_name", "format_table"]

# The formats compared by default: FP8 per tensor and per token and head, INT8 / INT4, KIVI, the FP4 formats.
COMPARED_FORMATS = ("fp8_e4m3_tensor", "fp8_e4m3_token_head", "int8_token_head", "int4_token_head", "kivi4_g32",
                    "kivi4_g128", "nvfp4", "mxfp4")


def _formats(formats) -> list[str]:
    return [kv_format(f).name for f in checks.many_of(formats, "formats", KV_FORMAT_NAMES)]


def through_format(x: torch.Tensor, fmt: str, which: str) -> torch.Tensor:
    """``x`` ``[T, H, D]`` (one sequence's K or V) stored in ``fmt`` and loaded back, fp32: the model hook's path
    (:func:`fp8kv.models.kv_config.quantize_kv`)."""
    checks.one_of(which, "which", ("k", "v"))
    checks.tensor(x, "x", ndim=3, dtypes=checks.FLOAT_DTYPES, shape_hint="[tokens, heads, head_dim]")
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
    checks.tensor(q, "q", ndim=3, shape_hint="[queries, heads, head_dim]")
    q = check_qkv(k, v, q)
    hkv, d = k.shape[1], k.shape[2]
    sm_scale = checks.softmax_scale_or_default(sm_scale, d)
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


def models_format_accuracy(loaded: dict, formats=COMPARED_FORMATS, *, window: int = 256, n_windows: int = 8):
    """:func:`format_accuracy` of each loaded model (``{name: (model, tokenizer)}``, as
    :func:`fp8kv.analysis.model_accuracy` leaves them) over the first ``n_windows`` windows of ``window`` text
    tokens, BOS first where its tokenizer puts one, with the formats among ``formats`` that can hold its KV heads
    (:func:`fitting_formats`). One table, a ``model`` column first; each model's bf16 baseline row included."""
    import pandas as pd

    from ..models import bos_token_id, text_tokens
    from ..models.introspect import kv_head_layout

    window, n_windows = checks.positive_int(window, "window"), checks.positive_int(n_windows, "n_windows")
    if not isinstance(loaded, dict) or not loaded:
        checks.fail(f"loaded={checks.show_value(loaded)}; expected a non-empty dict of model name -> (model, "
                    "tokenizer), as fp8kv.analysis.model_accuracy(...).loaded", TypeError)
    tables = []
    for name, (model, tok) in loaded.items():
        hkv, d = kv_head_layout(model)
        fits = fitting_formats(formats, num_kv_heads=hkv, head_dim=d)
        t = format_accuracy(model, text_tokens(tok, window * n_windows), fits, window=window, n_windows=n_windows,
                            bos_token_id=bos_token_id(tok))
        tables.append(t.assign(model=name)[["model", *[c for c in t.columns if c != "model"]]])
    return pd.concat(tables, ignore_index=True)


def fitting_formats(formats=COMPARED_FORMATS, *, num_kv_heads: int, head_dim: int) -> list[str]:
    """The names among ``formats`` that can store ``num_kv_heads`` heads of ``head_dim`` (their blocks divide it:
    KIVI's groups of 128 cannot hold a head_dim of 64), in the order given (:func:`fp8kv.kv_formats.holding_formats`
    of the checked names)."""
    return holding_formats(_formats(formats), num_kv_heads=num_kv_heads, head_dim=head_dim)


def bench_format_name(kv_dtype: str, granularity=None) -> str | None:
    """The KV format a bench row's ``kv_dtype`` (and FP8 ``granularity``) stores, or None for a 16-bit cache:
    the quantized formats keep their names, ``fp8_e4m3`` with scales per ``tensor`` is ``fp8_e4m3_tensor``."""
    if not isinstance(kv_dtype, str):
        checks.fail(f"kv_dtype={checks.show_value(kv_dtype)} ({type(kv_dtype).__name__}); expected a bench row's "
                    "kv_dtype name", TypeError)
    try:
        return kv_format(kv_dtype).name  # names and aliases, in any case
    except ValueError:
        pass
    name = f"{kv_dtype.lower()}_{granularity}"
    return name if name in KV_FORMAT_NAMES else None


_TABLE_COLUMNS = ("format", "bytes_per_token", "code_bytes_per_token", "scale_bytes_per_token", "tokens", "fits",
                  "out_rel_err", "k_rel_err", "v_rel_err", "kl_mean", "top1_agree", "tokens_per_s", "timing",
                  "timed_batch", "timed_context", "gpu", "gpu_memory_gib")


def _require(df, columns, arg):
    missing = [c for c in columns if c not in df.columns]
    if missing:
        checks.fail(f"{arg} lacks column(s) {missing}; it has {list(df.columns)}")


def _timed(bench, backend: str) -> dict:
    """format -> (tokens/s, timing, batch, context) of ``backend``'s ok rows of its default launch (a row with a
    ``variant``, such as gluon=False beside it, is another launch of the same format) at the bench's largest batch,
    then its largest context: the bandwidth-bound point where bytes per token decide the speed."""
    from ..results import check_rows

    _require(bench, ("backend", "kv_dtype", "granularity", "batch", "context", "time_us", "status", "timing"), "bench")
    check_rows(bench, "format_table", (), whole=("batch", "context"), expected="bench rows (fp8kv.bench.run())")
    ok = bench[(bench["backend"] == backend) & (bench["status"] == "ok")]
    if "variant" in ok:
        ok = ok[ok["variant"].fillna("").astype(str) == ""]
    if ok.empty:
        return {}
    batch = int(ok["batch"].max())
    ok = ok[ok["batch"] == batch]
    context = int(ok["context"].max())
    out = {}
    for r in ok[ok["context"] == context].itertuples():
        name = bench_format_name(r.kv_dtype, r.granularity)
        if name is not None:
            out[name] = (batch / (float(r.time_us) * 1e-6), r.timing, batch, context)
    return out


def format_table(capacity, *, errors=None, accuracy=None, bench=None, backend: str = "triton"):
    """One row per KV format of ``capacity``: what it costs and what it does to the model, side by side.

    Parameters
    ----------
    capacity : :func:`fp8kv.capacity.capacity_table` of one model and one GPU (rows whose ``kv_dtype`` is not a
        KV format, such as ``bf16``, are left out): ``bytes_per_token`` (all layers, K + V, codes and scales),
        ``code_bytes_per_token`` and ``scale_bytes_per_token``, ``tokens`` that fit (0 where none does).
    errors : :func:`model_format_errors` (or :func:`synthetic_format_errors`): ``out_rel_err``, ``k_rel_err``,
        ``v_rel_err`` averaged over layers (NaN where a format was not measured).
    accuracy : :func:`format_accuracy`'s table: ``kl_mean`` and ``top1_agree`` per format.
    bench : bench rows (:func:`fp8kv.bench.run`): ``tokens_per_s`` (sequences / decode time) of ``backend``'s
        ok rows at their largest batch and context, with ``timing`` (``cpu-wallclock``: a CPU smoke number).

    Returns a pandas DataFrame with the columns of :data:`_TABLE_COLUMNS`, in ``capacity``'s order.
    """
    import pandas as pd

    from ..results import check_rows

    _require(capacity, ("kv_dtype", "bytes_per_token", "kv_data_bytes_per_token", "scale_bytes_per_token", "tokens",
                        "fits", "gpu", "gpu_memory_gib"), "capacity")
    cap = capacity[capacity["kv_dtype"].isin(KV_FORMAT_NAMES)]
    if cap.empty:
        checks.fail(f"capacity has no row of a KV format (its kv_dtype: {sorted(set(capacity['kv_dtype']))}); "
                    f"expected names among {KV_FORMAT_NAMES}")
    check_rows(cap, "format_table", (), whole=("tokens",), expected="fp8kv.capacity.capacity_table()'s rows")
    err = {}
    if errors is not None:
        _require(errors, ("format", "out_rel_err", "k_rel_err", "v_rel_err"), "errors")
        err = errors.dropna(subset=["out_rel_err"]).groupby("format")[["out_rel_err", "k_rel_err", "v_rel_err"]] \
            .mean().to_dict("index")
    acc = {}
    if accuracy is not None:
        _require(accuracy, ("config", "kl_mean", "top1_agree"), "accuracy")
        acc = accuracy.set_index("config")[["kl_mean", "top1_agree"]].to_dict("index")
    timed = _timed(bench, backend) if bench is not None else {}
    rows = []
    for r in cap.itertuples():
        e, a = err.get(r.kv_dtype, {}), acc.get(r.kv_dtype, {})
        tps, timing, batch, context = timed.get(r.kv_dtype, (math.nan, None, None, None))
        rows.append(dict(format=r.kv_dtype, bytes_per_token=float(r.bytes_per_token),
                         code_bytes_per_token=float(r.kv_data_bytes_per_token),
                         scale_bytes_per_token=float(r.scale_bytes_per_token), tokens=int(r.tokens), fits=bool(r.fits),
                         out_rel_err=e.get("out_rel_err", math.nan), k_rel_err=e.get("k_rel_err", math.nan),
                         v_rel_err=e.get("v_rel_err", math.nan), kl_mean=a.get("kl_mean", math.nan),
                         top1_agree=a.get("top1_agree", math.nan), tokens_per_s=tps, timing=timing,
                         timed_batch=batch, timed_context=context, gpu=r.gpu, gpu_memory_gib=r.gpu_memory_gib))
    return pd.DataFrame(rows, columns=list(_TABLE_COLUMNS))
