"""Measurements behind the notebooks: FP8 quantization error of K/V and attention, and KV capacity.

Every function returns tidy pandas DataFrames (one measurement per row, every condition a
column), so notebooks only choose inputs, draw and save, and results of several GPUs concatenate.

Quantization error (notebook 02)
--------------------------------
:func:`quantization_error` quantizes K and V with :func:`fp8kv.quant.quantize` for every format ×
granularity × scale method, and measures against the *original* tensors (this is quantization
error, not kernel error): the relative error of K and of V, and of the attention output, computed
by the fp32 oracle :func:`fp8kv.reference.attention` with the quantized K and/or V against the
same oracle on the originals. ``quantize="k"`` keeps V exact and ``"v"`` keeps K exact, which
attributes the output error to K or V. Scales are computed from the data they quantize (the
"calibrated on this very sequence" best case for static scales).

Scale methods (names used in the tables): ``"1.0"`` (no scale: the engines' fallback when a
checkpoint has none), ``"amax"`` (amax / fmt.max per group), ``"percentile"`` (the 99.9th
percentile maps to fmt.max; larger values saturate) and ``"vllm"`` (vLLM's one-shot heuristic:
K amax / 200, V amax / 100, whatever the format).

Around it: :func:`error_vs_context` (the same on growing prefixes), :func:`attribution` (K's share
of the output error), :func:`key_numbers`, :func:`saturation_long` (tables reshaped for results
and figures), :func:`describe_kv` / :func:`channel_amax` (what the data look like: outlier
channels, tails, spreads) and :func:`real_kv_error` (the same measurement on a real model's
captured activations, through ``fp8kv.models``).

KV capacity (notebook 03)
-------------------------
:func:`capacity_grid` wraps :func:`fp8kv.capacity.capacity_table`; :func:`tokens_ratio` gives the
FP8-over-16-bit token ratio; :func:`capacity_walkthrough` redoes the planner's block-granular
accounting step by step from the model shape; :func:`measured_vs_formula` builds real
:class:`~fp8kv.cache.PagedKVCache` objects and compares their ``nbytes`` with the formula.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import checks
from .cache import PagedKVCache
from .capacity import GIB, WEIGHT_BYTES, capacity_table, plan_capacity, resolve_model
from .formats import format as get_format
from .formats import kv_dtype_info
from .quant import GRANULARITIES, SCALE_BYTES, kv_scale_bytes, quantize, relative_error
from .reference import attention

__all__ = ["SCALE_LABELS", "SCALE_METHODS", "QUANTIZE", "scale_argument", "attend", "quantization_error", "error_vs_context",
           "attribution", "key_numbers", "saturation_long", "describe_kv", "channel_amax", "real_kv_error",
           "capacity_grid", "tokens_ratio", "ratio_per_model", "capacity_walkthrough",
           "measured_cache_bytes", "measured_vs_formula", "roundtrip_sweep", "scale_sweep", "cast_comparison",
           "DecodeGrid", "DECODE_GRIDS", "decode_grid", "registry_names", "printable_text", "greedy_decode_table"]

# The scales the error tables compare, as table labels; scale_argument turns each into quantize's
# ``scale=`` (whose own vocabulary is fp8kv.quant.SCALE_METHODS).
SCALE_LABELS = ("1.0", "amax", "percentile", "vllm")
SCALE_METHODS = SCALE_LABELS  # the former name, kept for notebooks that read it
QUANTIZE = ("kv", "k", "v")  # which of K / V is quantized; the other stays exact


# --------------------------------------------------------------------------- validation helpers


def _choices(values, allowed: Sequence[str], name: str) -> tuple[str, ...]:
    return tuple(checks.many_of(values, name, allowed))


def _formats(formats) -> tuple[str, ...]:
    formats = (formats,) if isinstance(formats, str) else tuple(formats)
    if not formats:
        raise ValueError("formats is empty; pass at least one FP8 format name such as 'e4m3'")
    return tuple(get_format(f).name for f in formats)  # raises naming the unknown format


def _check_qkv(k, v, q) -> torch.Tensor:
    for name, t in (("k", k), ("v", v), ("q", q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor, got {t.dtype}")
    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [tokens, Hkv, D] with equal shapes; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] < 1:
        raise ValueError("k has no tokens; attention needs at least one")
    if q.ndim == 2:
        q = q.unsqueeze(0)
    if q.ndim != 3:
        raise ValueError(f"q must be [num_queries, Hq, D] (or [Hq, D]); got shape {tuple(q.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head_dim {q.shape[-1]} but k has {k.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of k's {k.shape[1]} KV heads")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    return q


def scale_argument(method: str, which: str):
    """The ``scale=`` argument of :func:`fp8kv.quant.quantize` for a table's scale method and K or V."""
    checks.one_of(method, "scale_method", SCALE_LABELS)
    if which not in ("k", "v"):
        raise ValueError(f"which={which!r}; expected 'k' or 'v'")
    if method == "1.0":
        return 1.0
    if method == "vllm":
        return f"vllm_{which}"
    return method


# --------------------------------------------------------------------------- attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None) -> torch.Tensor:
    """fp32 attention of several decode queries against one context, by the oracle.

    q: ``[Nq, Hq, D]``; k, v: ``[L, Hkv, D]``. Every query attends to all ``L`` tokens (a decode
    step at position L). Returns ``[Nq, Hq, D]`` fp32.

    The queries go through :func:`fp8kv.reference.attention` in one call: the ``Nq`` queries of
    a KV head are presented to it as ``Nq × G`` query heads of that KV head's group (its GQA
    mapping, head ``h`` reads KV head ``h // group``, is exactly that).
    """
    q = _check_qkv(k, v, q)
    nq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    qq = q.reshape(nq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv * nq * g, d)
    out, _ = attention(qq, k, v, sm_scale)
    return out.reshape(hkv, nq, g, d).permute(1, 0, 2, 3).reshape(nq, hq, d)


# --------------------------------------------------------------------------- quantization error


def quantization_error(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, *, formats=("e4m3", "e5m2"),
                       granularities=GRANULARITIES, scale_methods=SCALE_METHODS, quantize=QUANTIZE,
                       sm_scale: float | None = None, percentile: float = 99.9):
    """Error of FP8 K, V and of the attention output, for every format × granularity × scale × quantize.

    Parameters
    ----------
    k, v : ``[L, Hkv, D]`` float tensors (one sequence's keys and values, as cached).
    q : ``[Nq, Hq, D]`` (or ``[Hq, D]``) decode queries; Hq a multiple of Hkv.
    formats : FP8 format names (``fp8kv.formats``).
    granularities : among ``"tensor"``, ``"head"``, ``"token_head"``, ``"channel"``. Channel scales
        for V are unusual (KIVI scales V per token) but measured all the same.
    scale_methods : among ``"1.0"``, ``"amax"``, ``"percentile"``, ``"vllm"`` (module docstring).
    quantize : among ``"kv"`` (both), ``"k"`` (V exact), ``"v"`` (K exact).
    sm_scale : softmax scale, default ``1/sqrt(D)``.
    percentile : for the ``"percentile"`` method.

    Returns
    -------
    pandas.DataFrame, one row per combination, columns: format, granularity, scale_method,
    quantize, k_rel_err, v_rel_err, out_rel_err (``||x̂ - x|| / ||x||``; 0 for a tensor left
    exact), k_saturated_frac, k_underflow_frac, v_saturated_frac, v_underflow_frac (fractions of
    elements clamped to ±max / non-zero values flushed to zero), k_scale_bytes, v_scale_bytes,
    scale_bytes, data_bytes (FP8 bytes of what is quantized), scale_overhead (scale / data bytes),
    unit_roundoff (the format's per-element bound for normal values), tokens, num_kv_heads,
    num_q_heads, head_dim, num_queries.
    """
    import pandas as pd

    q = _check_qkv(k, v, q)
    formats = _formats(formats)
    granularities = _choices(granularities, GRANULARITIES, "granularities")
    scale_methods = _choices(scale_methods, SCALE_LABELS, "scale_methods")
    modes = _choices(quantize, QUANTIZE, "quantize")
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(k.shape[-1])
    kf, vf = k.to(torch.float32), v.to(torch.float32)
    ref = attend(q, kf, vf, sm_scale)
    shape = dict(tokens=k.shape[0], num_kv_heads=k.shape[1], num_q_heads=q.shape[1], head_dim=k.shape[2],
                 num_queries=q.shape[0])
    rows = []
    for fmt in formats:
        for gran in granularities:
            for method in scale_methods:
                stats = {}
                deq = {}
                for which, x in (("k", k), ("v", v)):
                    if not any(which in m for m in modes):
                        continue
                    qx = _quantize(x, fmt, gran, scale_argument(method, which), percentile)
                    deq[which] = qx.dequantize()
                    stats[which] = dict(rel_err=relative_error(deq[which], x), saturated_frac=qx.saturated_fraction,
                                        underflow_frac=qx.underflow_fraction, scale_bytes=qx.scale_nbytes,
                                        data_bytes=qx.data.numel() * qx.data.element_size())
                for mode in modes:
                    kk = deq["k"] if "k" in mode else kf
                    vv = deq["v"] if "v" in mode else vf
                    row = dict(format=fmt, granularity=gran, scale_method=method, quantize=mode)
                    for which in ("k", "v"):
                        s = stats[which] if which in mode else dict(rel_err=0.0, saturated_frac=0.0,
                                                                     underflow_frac=0.0, scale_bytes=0,
                                                                     data_bytes=0)
                        row.update({f"{which}_rel_err": s["rel_err"], f"{which}_saturated_frac": s["saturated_frac"],
                                    f"{which}_underflow_frac": s["underflow_frac"],
                                    f"{which}_scale_bytes": s["scale_bytes"], f"_{which}_data": s["data_bytes"]})
                    row["out_rel_err"] = relative_error(attend(q, kk, vv, sm_scale), ref)
                    row["scale_bytes"] = row["k_scale_bytes"] + row["v_scale_bytes"]
                    row["data_bytes"] = row.pop("_k_data") + row.pop("_v_data")
                    row["scale_overhead"] = row["scale_bytes"] / row["data_bytes"]
                    row["unit_roundoff"] = get_format(fmt).unit_roundoff
                    rows.append(dict(row, **shape))
    cols = ["format", "granularity", "scale_method", "quantize", "k_rel_err", "v_rel_err", "out_rel_err",
            "k_saturated_frac", "k_underflow_frac", "v_saturated_frac", "v_underflow_frac", "k_scale_bytes",
            "v_scale_bytes", "scale_bytes", "data_bytes", "scale_overhead", "unit_roundoff", *shape]
    return pd.DataFrame(rows)[cols]


def _quantize(x, fmt, gran, scale, percentile):
    # Named to keep the public keyword ``quantize`` of quantization_error free of the function.
    return quantize(x, fmt, gran, scale, percentile=percentile)


def error_vs_context(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, lengths: Sequence[int], *,
                     formats=("e4m3", "e5m2"), granularities=("tensor",), scale_methods=("amax",),
                     quantize=("kv",), sm_scale: float | None = None, percentile: float = 99.9):
    """:func:`quantization_error` on the first ``L`` tokens of ``k``/``v``, for each ``L`` in ``lengths``.

    Scales are recomputed on each prefix (as a per-request calibration would). Returns the
    same columns plus ``context_len``, one block of rows per length (increasing).
    """
    import pandas as pd

    q = _check_qkv(k, v, q)
    if isinstance(lengths, int) or not len(lengths):
        raise ValueError(f"lengths={lengths!r} must be a non-empty sequence of ints")
    lens = []
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= k.shape[0]:
            raise ValueError(f"lengths has {n!r}; each must be an int in [1, {k.shape[0]}] (the tokens of k)")
        lens.append(n)
    frames = []
    for n in sorted(set(lens)):
        df = quantization_error(k[:n], v[:n], q, formats=formats, granularities=granularities,
                                scale_methods=scale_methods, quantize=quantize, sm_scale=sm_scale,
                                percentile=percentile)
        df.insert(0, "context_len", n)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


_KEYS = ["format", "granularity", "scale_method"]


def attribution(table):
    """K-vs-V attribution of the attention-output error, per format × granularity × scale method.

    ``table`` is a :func:`quantization_error` result holding the ``"k"``, ``"v"`` and ``"kv"``
    rows of each combination (extra key columns, e.g. a ``source``, are kept as groups).
    Returns columns: the keys, ``out_rel_err_k`` (K quantized only), ``out_rel_err_v``,
    ``out_rel_err_kv``, ``k_share`` = k² / (k² + v²) (the share of the output's squared error
    due to K, since independent errors add in squares) and ``additivity`` =
    sqrt(k² + v²) / kv (close to 1 when the two errors are independent).
    """
    missing = {"quantize", "out_rel_err", *_KEYS} - set(table.columns)
    if missing:
        raise ValueError(f"table lacks columns {sorted(missing)}; pass a quantization_error() result")
    modes = set(table["quantize"])
    if not {"k", "v", "kv"} <= modes:
        raise ValueError(f"table has quantize modes {sorted(modes)}; attribution needs 'k', 'v' and 'kv' rows")
    extra = [c for c in ("source", "context_len") if c in table.columns]
    keys = extra + _KEYS
    wide = table.pivot_table(index=keys, columns="quantize", values="out_rel_err", sort=False).reset_index()
    wide = wide.rename(columns={m: f"out_rel_err_{m}" for m in ("k", "v", "kv")})
    wide.columns.name = None
    k2, v2 = wide["out_rel_err_k"] ** 2, wide["out_rel_err_v"] ** 2
    total = k2 + v2
    wide["k_share"] = (k2 / total).where(total > 0, 0.5)
    wide["additivity"] = (total**0.5 / wide["out_rel_err_kv"]).where(wide["out_rel_err_kv"] > 0, 1.0)
    return wide[keys + ["out_rel_err_k", "out_rel_err_v", "out_rel_err_kv", "k_share", "additivity"]]


def key_numbers(table) -> dict:
    """Flat dict of the ``quantize == "kv"`` rows' errors: ``"<format>_<granularity>_<scale>_<k|v|out>_rel_err"``.

    E.g. ``e4m3_tensor_amax_k_rel_err``. Scale method ``"1.0"`` is spelled ``unit``. Needs one row
    per combination (filter a multi-source table first).
    """
    kv = table[table["quantize"] == "kv"]
    if kv.duplicated(_KEYS).any():
        raise ValueError("table has several 'kv' rows per format/granularity/scale_method; filter it to one "
                         "source/layer/context length first")
    out = {}
    for row in kv.itertuples(index=False):
        method = "unit" if row.scale_method == "1.0" else row.scale_method
        stem = f"{row.format}_{row.granularity}_{method}"
        for which in ("k", "v", "out"):
            out[f"{stem}_{which}_rel_err"] = float(getattr(row, f"{which}_rel_err"))
    return out


def saturation_long(table):
    """The saturated / underflow fractions of a :func:`quantization_error` table in long form.

    Keeps the ``quantize == "kv"`` rows; returns the key columns (and ``source`` if present) plus
    ``tensor`` ("K"/"V"), ``kind`` ("saturated"/"underflow") and ``fraction``: one bar per row.
    """
    cols = {"k_saturated_frac": ("K", "saturated"), "k_underflow_frac": ("K", "underflow"),
            "v_saturated_frac": ("V", "saturated"), "v_underflow_frac": ("V", "underflow")}
    missing = {"quantize", *cols, *_KEYS} - set(table.columns)
    if missing:
        raise ValueError(f"table lacks columns {sorted(missing)}; pass a quantization_error() result")
    keys = [c for c in ("source",) if c in table.columns] + _KEYS
    long = table[table["quantize"] == "kv"].melt(id_vars=keys, value_vars=list(cols), var_name="column",
                                                 value_name="fraction")
    long["tensor"] = long["column"].map(lambda c: cols[c][0])
    long["kind"] = long["column"].map(lambda c: cols[c][1])
    return long[keys + ["tensor", "kind", "fraction"]]


# --------------------------------------------------------------------------- describing K/V


def describe_kv(k: torch.Tensor, v: torch.Tensor, *, top_channels: int = 4) -> dict:
    """Summary statistics of ``k``, ``v`` ``[L, H, D]`` that decide how well they quantize.

    Returns a dict: tokens, num_kv_heads, head_dim; ``k_outlier_ratio`` (per head, the mean amax
    of the ``top_channels`` largest-amax channels over the median channel amax; averaged over
    heads), the same ``v_outlier_ratio``; ``k_kurtosis``, ``v_kurtosis`` (of all elements; 3 for
    a Gaussian); ``k_head_rms_ratio``, ``v_head_rms_ratio`` (largest over smallest per-head RMS);
    ``k_token_norm_ratio``, ``v_token_norm_ratio`` (95th over 5th percentile of token norms);
    ``k_amax``, ``v_amax``.
    """
    from .synthetic import kurtosis

    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [tokens, H, D] with equal shapes; got {tuple(k.shape)}, {tuple(v.shape)}")
    if not 1 <= top_channels <= k.shape[-1]:
        raise ValueError(f"top_channels={top_channels} must be in [1, head_dim={k.shape[-1]}]")
    out = dict(tokens=k.shape[0], num_kv_heads=k.shape[1], head_dim=k.shape[2])
    for name, x in (("k", k), ("v", v)):
        x = x.detach().to(torch.float32)
        amax = x.abs().amax(dim=0)  # [H, D]
        top = amax.topk(top_channels, dim=-1).values.mean(-1)
        med = amax.median(dim=-1).values.clamp_min(torch.finfo(torch.float32).tiny)
        rms = x.pow(2).mean(dim=(0, 2)).sqrt()
        norms = x.norm(dim=(1, 2)).to(torch.float64)
        lo = float(norms.quantile(0.05)) if x.shape[0] > 1 else float(norms[0])
        hi = float(norms.quantile(0.95)) if x.shape[0] > 1 else float(norms[0])
        out.update({f"{name}_outlier_ratio": float((top / med).mean()), f"{name}_kurtosis": kurtosis(x),
                    f"{name}_head_rms_ratio": float(rms.max() / rms.min().clamp_min(1e-30)),
                    f"{name}_token_norm_ratio": hi / lo if lo > 0 else math.inf,
                    f"{name}_amax": float(amax.max())})
    return out


def channel_amax(k: torch.Tensor, v: torch.Tensor):
    """amax over tokens of every (head, channel) of K and V: rows tensor ("K"/"V"), head, channel, amax."""
    import pandas as pd

    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [tokens, H, D] with equal shapes; got {tuple(k.shape)}, {tuple(v.shape)}")
    frames = []
    for name, x in (("K", k), ("V", v)):
        a = x.detach().abs().to(torch.float32).amax(dim=0).cpu()  # [H, D]
        h, d = a.shape
        frames.append(pd.DataFrame({"tensor": name, "head": torch.arange(h).repeat_interleave(d).numpy(),
                                    "channel": torch.arange(d).repeat(h).numpy(), "amax": a.reshape(-1).numpy()}))
    return pd.concat(frames, ignore_index=True)


def _layer_ids(layers, n: int) -> list[int]:
    if layers is None:
        layers = 3
    if isinstance(layers, int) and not isinstance(layers, bool):
        if layers < 1:
            raise ValueError(f"layers={layers} must be >= 1 (a count) or a list of layer indices")
        count = min(layers, n)
        return sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})
    ids = [int(i) for i in layers]
    bad = [i for i in ids if not 0 <= i < n]
    if not ids or bad:
        raise ValueError(f"layers={layers!r}: indices must be in [0, {n}) and not empty")
    return ids


def real_kv_error(model: str = "smollm2-135m", num_tokens: int = 512, layers=3, num_queries: int = 16, *,
                  device="cpu", formats=("e4m3", "e5m2"), granularities=GRANULARITIES,
                  scale_methods=SCALE_METHODS, quantize=QUANTIZE, percentile: float = 99.9):
    """:func:`quantization_error` on a real model's K, V and queries (``fp8kv.models``).

    Runs one forward of ``num_tokens`` tokens of the fixed evaluation text through the offline
    ``model`` (fp32 weights on ``device``) and captures every layer's post-RoPE K, V and Q. For
    each chosen layer, the last ``num_queries`` query rows act as decode queries, each attending
    to the whole captured context, with the layer's own softmax scale.

    Parameters
    ----------
    layers : a count (that many layers evenly spaced from the first to the last) or a list of
        layer indices.

    Returns
    -------
    (table, stats) : the :func:`quantization_error` rows with columns ``source``
        ("<model> layer <i>"), ``layer`` and ``layer_type`` in front; and one :func:`describe_kv`
        row per layer (same three columns).

    Raises
    ------
    ImportError when the ``models`` extra or the model's weights package is missing (the
    message names the pip command).
    """
    import pandas as pd

    from .models import capture_kv, load_model, text_tokens

    if isinstance(num_queries, bool) or not isinstance(num_queries, int) or not 1 <= num_queries <= num_tokens:
        raise ValueError(f"num_queries={num_queries!r} must be an int in [1, num_tokens={num_tokens}]")
    net, tok = load_model(model, dtype=torch.float32, device=device)
    cap = capture_kv(net, text_tokens(tok, num_tokens))
    tables, stats = [], []
    for i in _layer_ids(layers, cap.n_layers):
        head = dict(source=f"{model} layer {i}", layer=i, layer_type=cap.layer_types[i])
        k, v, q = cap.k[i], cap.v[i], cap.q[i][-num_queries:]
        df = quantization_error(k, v, q, formats=formats, granularities=granularities, scale_methods=scale_methods,
                                quantize=quantize, sm_scale=cap.sm_scale[i], percentile=percentile)
        for j, (col, val) in enumerate(head.items()):
            df.insert(j, col, val)
        tables.append(df)
        stats.append(dict(head, **describe_kv(k, v)))
    return pd.concat(tables, ignore_index=True), pd.DataFrame(stats)


# --------------------------------------------------------------------------- KV capacity


def capacity_grid(models, gpus, kv_dtypes=("bf16", "fp8_e4m3"), granularities=("tensor",), *,
                  device_memory_gib: float | None = None, device_label: str = "this device", **kw):
    """:func:`fp8kv.capacity.capacity_table` over ``gpus`` (names), plus this device when given.

    ``device_memory_gib`` (e.g. ``describe_device()["memory_gib"]`` on a GPU) adds a GPU of that
    total, whose ``gpu`` column is ``device_label``. Adds ``tokens_per_gib`` (tokens per GiB of
    KV budget) and ``scale_fraction`` (scale bytes over all KV bytes in use: pages plus scales, at
    full occupancy); both NaN where the model does not fit. ``kw`` goes to ``plan_capacity``
    (utilization, block_size, max_model_len).
    """
    import pandas as pd

    gpus = [gpus] if isinstance(gpus, str) else list(gpus)
    frames = [capacity_table(models, gpus, kv_dtypes, granularities, **kw)] if gpus else []
    if device_memory_gib is not None:
        dev = capacity_table(models, [float(device_memory_gib)], kv_dtypes, granularities, **kw)
        frames.append(dev.assign(gpu=device_label))
    if not frames:
        raise ValueError("no GPU to plan for: pass gpus names and/or device_memory_gib")
    table = pd.concat(frames, ignore_index=True)
    if "kv_budget_bytes" in table:
        table["tokens_per_gib"] = table["tokens"] / (table["kv_budget_bytes"] / GIB)
        used = table["tokens"] * table["bytes_per_token"] + table["fixed_scale_bytes"]
        table["scale_fraction"] = table["scale_overhead_bytes"] / used
    return _none_for_missing(table, "granularity")


def _none_for_missing(df, column):
    """16-bit rows have no granularity: keep it None (JSON null), not pandas' NaN."""
    df[column] = df[column].astype(object).where(df[column].notna(), None)
    return df


def tokens_ratio(table, numerator: str = "fp8_e4m3", denominator: str = "bf16"):
    """Tokens of ``numerator`` over tokens of ``denominator`` kv_dtype, per model × GPU × granularity.

    ``table``: a :func:`capacity_grid` / ``capacity_table`` result. Only plans that fit in both
    dtypes are compared. Returns columns model, gpu, granularity, tokens_<num>, tokens_<den>,
    blocks_<den>, ratio, and ``ratio_upper`` = element-size ratio × (1 + 1 / blocks_<den>): whole
    blocks make the ratio exceed the element-size ratio (2 for bf16 → FP8) by at most one block's
    worth, while scales only lower it.
    """
    gpu_col = "gpu"
    fits = table[table["fits"]] if "fits" in table.columns else table
    num = fits[fits["kv_dtype"] == kv_dtype_info(numerator)[0]]
    den = fits[fits["kv_dtype"] == kv_dtype_info(denominator)[0]]
    if num.empty or den.empty:
        raise ValueError(f"table has no fitting rows for kv_dtype {numerator!r} and/or {denominator!r}")
    den = den[["model", gpu_col, "tokens", "blocks", "element_size"]]
    merged = num[["model", gpu_col, "granularity", "tokens", "element_size"]].merge(
        den, on=["model", gpu_col], suffixes=("_num", "_den"))
    merged["ratio"] = merged["tokens_num"] / merged["tokens_den"]
    elem = merged["element_size_den"] / merged["element_size_num"]
    # blocks_num <= floor(a·x) < a·(floor(x) + 1), x = budget / block_bytes_den: at most a·(1 + 1/blocks_den).
    merged["ratio_upper"] = elem * (1 + 1 / merged["blocks"])
    return merged.rename(columns={"tokens_num": f"tokens_{numerator}", "tokens_den": f"tokens_{denominator}",
                                  "blocks": f"blocks_{denominator}"}).drop(
        columns=["element_size_num", "element_size_den"])


def ratio_per_model(ratios, gpu: str, granularity: str = "tensor"):
    """One :func:`tokens_ratio` row per model: on ``gpu`` when the model fits there, else on the
    first GPU of the table where it fits (the ``gpu`` column says which). A DataFrame."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r}; expected one of {GRANULARITIES}")
    part = ratios[ratios["granularity"] == granularity]
    if part.empty:
        raise ValueError(f"ratios has no rows of granularity {granularity!r}")
    rows = []
    for _, group in part.groupby("model", sort=False):
        here = group[group["gpu"] == gpu]
        rows.append((here if len(here) else group).iloc[0])
    return type(part)(rows).reset_index(drop=True)


def capacity_walkthrough(model, kv_dtype, gpu, *, utilization: float = 0.9, block_size: int = 16,
                         granularity: str = "tensor", max_model_len: int | None = None,
                         request_len: int | None = None):
    """The engines' block-granular KV accounting, one step per row, recomputed and checked.

    Each quantity is derived here from the model shape and the GPU total (the vLLM recipe in
    ``fp8kv.capacity``'s docstring) and set beside :func:`~fp8kv.capacity.plan_capacity`'s value.
    ``request_len`` (default ``max_model_len``) adds how many requests of that length fit when each
    holds ``ceil(request_len / block_size)`` whole blocks, the last one partly empty.

    Returns
    -------
    pandas.DataFrame with columns step, formula, value, planner (the planner's number or None),
    match (bool or None).
    """
    import pandas as pd

    plan = plan_capacity(model, kv_dtype, gpu_memory_gib=gpu, utilization=utilization, block_size=block_size,
                         granularity=granularity, max_model_len=max_model_len)
    shape = resolve_model(model)
    _, tdtype, fmt = kv_dtype_info(kv_dtype)
    elem = torch.empty(0, dtype=tdtype).element_size()
    layers, hkv, d = shape.num_layers, shape.num_kv_heads, shape.head_dim
    total = plan["gpu_memory_gib"] * GIB
    weights = shape.num_params * WEIGHT_BYTES
    budget = math.floor(total * utilization) - weights
    gran = granularity if fmt is not None else None
    fixed, scale_bpt = kv_scale_bytes(gran, num_layers=layers, num_kv_heads=hkv, head_dim=d)
    data_bpt = layers * 2 * hkv * d * elem
    bpt = data_bpt + scale_bpt
    block_bytes = block_size * bpt
    blocks = (budget - fixed) // block_bytes
    tokens = blocks * block_size
    mml = plan["max_model_len"]
    req = mml if request_len is None else request_len
    blocks_per_req = -(-req // block_size)
    G = "GiB"
    steps = [
        ("GPU memory (driver total)", f"{plan['gpu_memory_gib']:.3f} {G} x 2^30", total, None),
        ("weights", f"{shape.num_params:,} params x {WEIGHT_BYTES} bytes (bf16)", weights, plan["weights_bytes"]),
        ("KV budget", f"floor(total x {utilization}) - weights", budget, plan["kv_budget_bytes"]),
        ("fixed scale bytes", f"{gran} scales, fp32, per layer and K/V" if gran else "16-bit: no scales",
         fixed, plan["fixed_scale_bytes"]),
        ("bytes per token", f"{layers} layers x 2 (K,V) x {hkv} heads x {d} x {elem} B"
         + (f" + {layers} x 2 x {hkv} x {SCALE_BYTES} B scales" if scale_bpt else ""), bpt, plan["bytes_per_token"]),
        ("block bytes", f"{block_size} tokens x bytes per token", block_bytes, plan["block_bytes"]),
        ("blocks", "floor((budget - fixed scales) / block bytes)", blocks, plan["blocks"]),
        ("tokens", f"blocks x {block_size}", tokens, plan["tokens"]),
        ("max concurrency", f"tokens / max_model_len ({mml})", tokens / mml, plan["max_concurrency"]),
        (f"requests of {req} tokens", f"floor(blocks / ceil({req} / {block_size}))", blocks // blocks_per_req,
         None),
        (f"KV bytes left empty in a {req}-token request", f"({blocks_per_req} x {block_size} - {req}) x bytes "
         "per token", (blocks_per_req * block_size - req) * bpt, None),
    ]
    rows = []
    for step, formula, value, planner in steps:
        match = None if planner is None else bool(math.isclose(value, planner, rel_tol=1e-12, abs_tol=0))
        rows.append(dict(step=step, formula=formula, value=_exact(value), planner=_exact(planner), match=match))
    return pd.DataFrame(rows, dtype=object)


def _exact(x):
    """Integral numbers as int (byte counts print exactly), others unchanged."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def measured_cache_bytes(model, kv_dtype, granularity: str = "tensor", *, kv_memory_gib: float,
                         block_size: int = 16, device="cpu") -> dict:
    """Allocate the planner's blocks for one layer as a real :class:`PagedKVCache`; compare bytes.

    ``plan_capacity(model, kv_dtype, kv_memory_gib=...)`` says how many blocks fit in that budget
    (over all layers). One layer's cache with exactly that many blocks is built
    (``PagedKVCache.empty``), and ``nbytes × num_layers`` (pages plus scales, as allocated) is set
    beside the formula ``bytes_per_token × tokens + fixed_scale_bytes``.

    Returns a dict: model, kv_dtype, granularity, num_layers, blocks, tokens, layer_nbytes,
    measured_bytes, formula_bytes, equal (bool), budget_bytes.
    """
    plan = plan_capacity(model, kv_dtype, kv_memory_gib=kv_memory_gib, block_size=block_size,
                         granularity=granularity, max_model_len=block_size)
    shape = resolve_model(model)
    cache = PagedKVCache.empty(1, plan["tokens"], shape.num_kv_heads, shape.head_dim, block_size=block_size,
                               kv_dtype=kv_dtype, granularity=granularity, device=device)
    if cache.num_blocks != plan["blocks"]:  # empty() reserves ceil(tokens / block_size) = blocks
        raise RuntimeError(f"cache has {cache.num_blocks} blocks, the plan {plan['blocks']}")
    measured = cache.nbytes * shape.num_layers
    formula = plan["bytes_per_token"] * plan["tokens"] + plan["fixed_scale_bytes"]
    return dict(model=shape.name, kv_dtype=plan["kv_dtype"], granularity=plan["granularity"],
                num_layers=shape.num_layers, blocks=plan["blocks"], tokens=plan["tokens"],
                layer_nbytes=cache.nbytes, measured_bytes=measured, formula_bytes=formula,
                equal=measured == formula, budget_bytes=plan["kv_budget_bytes"])


def measured_vs_formula(models, kv_dtypes=("bf16", "fp8_e4m3"), granularities=GRANULARITIES, *,
                        kv_memory_gib: float, block_size: int = 16, device="cpu"):
    """:func:`measured_cache_bytes` for every model × kv_dtype × granularity (16-bit: once). A DataFrame."""
    import pandas as pd

    models = [models] if isinstance(models, str) else list(models)
    kv_dtypes = [kv_dtypes] if isinstance(kv_dtypes, str) else list(kv_dtypes)
    granularities = _choices(granularities, GRANULARITIES, "granularities")
    rows = []
    for m in models:
        for kd in kv_dtypes:
            fp8 = kv_dtype_info(kd)[2] is not None
            for gran in granularities if fp8 else granularities[:1]:
                rows.append(measured_cache_bytes(m, kd, gran, kv_memory_gib=kv_memory_gib, block_size=block_size,
                                                 device=device))
    return _none_for_missing(pd.DataFrame(rows), "granularity")


# ------------------------------------------------------------------------------ FP8 formats (notebook 01)
def roundtrip_sweep(magnitudes: torch.Tensor, formats, *, plot_points: int = 4000):
    """Relative round-trip error of positive ``magnitudes`` through each format with scale 1.

    Returns ``(curve, summary)``: ``curve`` a DataFrame (format, magnitude, rel_error) thinned to about
    ``plot_points`` points per format for plotting; ``summary`` per format: the largest relative error
    in the normal range (bounded by the unit roundoff), in the subnormal range, and the saturation /
    underflow counts of the sweep.
    """
    import pandas as pd

    if magnitudes.ndim != 1 or not bool((magnitudes > 0).all()):
        raise ValueError("magnitudes must be a 1-D tensor of positive values")
    mags = magnitudes.detach().to(torch.float32).cpu()
    step = max(1, mags.numel() // plot_points)
    curves, summary = [], {}
    for name in _formats(formats):
        f = get_format(name)
        q = quantize(magnitudes.view(-1, 1, 1), f, scale=1.0, nonfinite="saturate")
        rel = ((q.dequantize().view(-1).cpu() - mags).abs() / mags)
        normal = (mags >= f.min_normal) & (mags <= f.max)
        subnormal = mags < f.min_normal
        summary[name] = {
            "max_rel_error_normal": float(rel[normal].max()) if normal.any() else None,
            "unit_roundoff": f.unit_roundoff,
            "max_rel_error_subnormal_range": float(rel[subnormal].max()) if subnormal.any() else None,
            "points": mags.numel(),
            "points_normal": int(normal.sum()),
            "points_above_max": int((mags > f.max).sum()),
            "saturated": q.saturated,
            "underflow": q.underflow,
        }
        curves.append(pd.DataFrame({"format": name, "magnitude": mags[::step].numpy(),
                                    "rel_error": rel[::step].numpy()}))
    return pd.concat(curves, ignore_index=True), summary


def scale_sweep(base: torch.Tensor, sigmas, formats=("e4m3", "e5m2"), scales=(1.0, "amax")):
    """Relative error of ``base × σ`` quantized with each scale, for every spread σ.

    Shows why a scale is needed: with scale 1 only tensors inside the format's window survive;
    the amax scale makes the error independent of σ. Returns a tidy DataFrame.
    """
    import pandas as pd

    rows = []
    for sigma in sigmas:
        x = base * float(sigma)
        for name in _formats(formats):
            for scale in scales:
                q = quantize(x, name, scale=scale)
                rows.append({"format": name, "scale": str(scale), "setup": f"{name}, scale={scale}",
                             "sigma": float(sigma), "rel_error": relative_error(q.dequantize(), x),
                             "saturated_fraction": q.saturated_fraction,
                             "underflow_fraction": q.underflow_fraction})
    return pd.DataFrame(rows)


def cast_comparison(formats, factors=(0.9, 1.0, 1.02, 1.05, 1.1, 1.5, 2.0, 4.0), device=None):
    """A bare ``x.to(float8)`` against fp8kv's clamp-then-cast, for inputs ``factor × max``.

    Returns ``(table, summary)``: table rows (format, method, input, output) and per format the
    non-finite outputs of each method and fp8kv's saturation count.
    """
    import pandas as pd

    rows, summary = [], {}
    for name in _formats(formats):
        f = get_format(name)
        x = torch.tensor(factors, dtype=torch.float32, device=device) * f.max
        bare = x.to(f.torch_dtype).to(torch.float32).cpu()
        q = quantize(x.view(-1, 1, 1), f, scale=1.0)
        mine = q.dequantize().view(-1).cpu()
        for xi, b, m in zip(x.cpu().tolist(), bare.tolist(), mine.tolist(), strict=True):
            rows += [{"format": name, "method": "bare .to()", "input": xi, "output": b},
                     {"format": name, "method": "fp8kv clamp+cast", "input": xi, "output": m}]
        summary[name] = {"inputs": x.cpu().tolist(), "bare_cast": bare.tolist(), "fp8kv": mine.tolist(),
                         "bare_nonfinite": int((~torch.isfinite(bare)).sum()),
                         "fp8kv_nonfinite": int((~torch.isfinite(mine)).sum()), "fp8kv_saturated": q.saturated}
    return pd.DataFrame(rows), summary


# --------------------------------------------------------------------------- notebook presets


@dataclass(frozen=True)
class DecodeGrid:
    """The decode-latency grid of notebook 04: what :func:`fp8kv.bench.sweep` expands and how it times.

    ``heads`` is (query heads, KV heads); ``baseline`` the 16-bit KV dtype FP8 is compared with;
    ``rep_ms`` the timed repetitions per case (CUDA); ``copy_mib`` the copy-bandwidth buffer.
    """

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    heads: tuple[int, int]
    head_dim: int
    kv_dtypes: tuple[str, ...]
    baseline: str
    modes: tuple[str, ...]
    backends: tuple[str, ...]
    flashinfer_tensor_cores: tuple[bool, ...]
    rep_ms: int
    copy_mib: int


DECODE_GRIDS = {
    # Curves on a GPU: 1k ... 64k tokens, 1 ... 256 sequences (cases beyond the memory budget are skipped);
    # four points a decade, so the whole grid times in a few minutes.
    "full": DecodeGrid(batches=(1, 16, 64, 256), contexts=(1024, 4096, 16384, 65536),
                       heads=(32, 8), head_dim=128, kv_dtypes=("bf16", "fp8_e4m3"), baseline="bf16",
                       modes=("dequant", "fp8"), backends=("triton", "flashinfer"), flashinfer_tensor_cores=(True,),
                       rep_ms=50, copy_mib=1024),
    # A few points anywhere; the Triton interpreter's bf16 arithmetic is wrong, so the 16-bit cache is fp16.
    "smoke": DecodeGrid(batches=(1, 3), contexts=(40, 100), heads=(4, 2), head_dim=64,
                        kv_dtypes=("fp16", "fp8_e4m3"), baseline="fp16", modes=("dequant", "fp8"),
                        backends=("reference", "triton", "flashinfer"), flashinfer_tensor_cores=(True,),
                        rep_ms=20, copy_mib=16),
}


def decode_grid(name: str | None, smoke: bool) -> DecodeGrid:
    """A grid of :data:`DECODE_GRIDS` by name; ``None`` picks ``"smoke"`` or ``"full"`` by ``smoke``."""
    if name is None:
        name = "smoke" if smoke else "full"
    if name not in DECODE_GRIDS:
        raise ValueError(f"grid={name!r} is not a decode grid; expected None or one of {sorted(DECODE_GRIDS)}")
    return DECODE_GRIDS[name]


def registry_names(selection, registry, what: str) -> list[str]:
    """``"all"`` → every name of ``registry`` (a dict), in its order; a list of names → checked and kept."""
    if selection == "all":
        return list(registry)
    if isinstance(selection, str) or not isinstance(selection, (list, tuple)):
        raise ValueError(f"{what}={selection!r} must be 'all' or a list of names from {list(registry)}")
    unknown = [n for n in selection if n not in registry]
    if unknown:
        raise ValueError(f"{what}={list(selection)!r}: unknown {unknown}; known: {list(registry)}")
    return list(selection)


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

    from .models import greedy_decode_paged, text_tokens

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
