"""How much FP8 costs K, V and the attention output (notebook 02), measured against the originals.

:func:`quantization_error` quantizes K and V with :func:`fp8kv.quant.quantize` for every format ×
granularity × scale method and measures against the *original* tensors (quantization error, not
kernel error): the relative error of K, of V, and of the attention output, computed by the fp32
oracle :func:`fp8kv.reference.attention` with the quantized K and/or V against the same oracle on
the originals. ``quantize="k"`` keeps V exact and ``"v"`` keeps K exact, which attributes the
output error to K or V. Scales are computed from the data they quantize (the "calibrated on this
very sequence" best case for static scales).

Scale methods (names used in the tables): ``"1.0"`` (no scale: the engines' fallback when a
checkpoint has none), ``"amax"`` (amax / fmt.max per group), ``"percentile"`` (the 99.9th
percentile maps to fmt.max; larger values saturate) and ``"vllm"`` (vLLM's one-shot heuristic:
K amax / 200, V amax / 100, whatever the format).

Around it: :func:`error_vs_context` (the same on growing prefixes), :func:`attribution` (K's share
of the output error), :func:`key_numbers`, :func:`saturation_long` (tables reshaped for results and
figures), :func:`real_kv_error` (the same measurement on a real model's captured activations,
through ``fp8kv.models``; :func:`real_kv_error_or_reason` says why not where it cannot run),
:func:`synthetic_vs_real` and :func:`quantization_results` (the notebook's results file).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from .. import checks
from ..formats import format as get_format
from ..quant import GRANULARITIES, quantize, relative_error
from ..reference import attention
from .kv_stats import describe_kv
from .selection import format_names

__all__ = ["SCALE_LABELS", "QUANTIZE", "scale_argument", "attend", "check_qkv", "check_layer_counts", "check_bf16_layers", "quantization_error",
           "error_vs_context", "attribution", "key_numbers", "saturation_long", "real_kv_error",
           "real_kv_error_or_reason", "synthetic_vs_real", "quantization_results"]

# The scales the error tables compare, as table labels; scale_argument turns each into quantize's
# ``scale=`` (whose own vocabulary is fp8kv.quant.SCALE_METHODS).
SCALE_LABELS = ("1.0", "amax", "percentile", "vllm")
QUANTIZE = ("kv", "k", "v")  # which of K / V is quantized; the other stays exact


def check_qkv(k, v, q) -> torch.Tensor:
    """``k``, ``v`` ``[L, Hkv, D]`` and ``q`` ``[Nq, Hq, D]`` (or ``[Hq, D]``, returned as ``[1, Hq, D]``) of one
    context: float tensors on one device, at least one of each size, Hq a multiple of Hkv, finite and within fp32's
    range (the errors are computed in fp32: a NaN or an overflow would read as an error of 0 or NaN, not a refusal)."""
    for name, t in (("k", k), ("v", v), ("q", q)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected float16, bfloat16, float32 or float64")
    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [tokens, Hkv, D] with equal shapes; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if min(k.shape) < 1:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected at least one token, KV head and channel")
    if q.ndim == 2:
        q = q.unsqueeze(0)
    if q.ndim != 3 or min(q.shape) < 1:
        raise ValueError(f"q must be [num_queries, Hq, D] (or [Hq, D]) with at least one query; got shape "
                         f"{tuple(q.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head_dim {q.shape[-1]} but k has {k.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of k's {k.shape[1]} KV heads")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    for name, t in (("k", k), ("v", v), ("q", q)):
        checks.fp32_range_tensor(checks.finite_tensor(t, name), name)
    return q


def check_layer_counts(advice) -> None:
    """A :func:`~.scale_health.keep_bf16_advice` table's counts: whole, 0 <= n_layers_bf16 <= n_layers, else ValueError naming the row."""
    for i, n16, n in zip(advice.index, advice["n_layers_bf16"], advice["n_layers"], strict=True):
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (n16, n)) or not 0 <= n16 <= n:
            checks.fail(f"advice row {i} has n_layers_bf16={n16!r}, n_layers={n!r}; expected whole numbers with "
                        "0 <= n_layers_bf16 <= n_layers (keep_bf16_advice()'s table)")


def check_bf16_layers(advice, name: str = "advice") -> None:
    """A :func:`~.scale_health.keep_bf16_advice` table's ``layers_bf16``: per row a list (or 1-D array) of layer
    indices, ints >= 0 and below ``n_layers`` (a whole number >= 1) where the table has that column, as many distinct
    ones as ``n_layers_bf16`` says where it has that; else a TypeError / ValueError naming ``name``, the row and the
    value (int() read 1.5 as layer 1 and True as layer 1)."""
    import numpy as np

    def column(c):
        return advice[c] if c in advice.columns else [None] * len(advice)

    for i, layers, n, n16 in zip(advice.index, advice["layers_bf16"], column("n_layers"), column("n_layers_bf16"),
                                 strict=True):
        if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
            checks.fail(f"{name} row {i} has n_layers={checks.show_value(n)}; expected a whole number >= 1")
        if isinstance(layers, np.ndarray) and layers.ndim == 1:
            layers = layers.tolist()
        if not isinstance(layers, (list, tuple)):
            checks.fail(f"{name} row {i} has layers_bf16={checks.show_value(layers)} ({type(layers).__name__}); "
                        "expected a list of layer indices (ints >= 0)", TypeError)
        said = (f"{name} row {i} has layers_bf16={checks.show_value(layers)}; expected layer indices (ints >= 0"
                f"{'' if n is None else f' and < n_layers={n}'})")
        if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in layers):
            checks.fail(said, TypeError)
        if any(x < 0 or (n is not None and x >= n) for x in layers):
            checks.fail(said)
        if n16 is not None and n16 != len(set(layers)):  # the headline's count and the layers kept disagreed
            checks.fail(f"{name} row {i} has layers_bf16={checks.show_value(layers)} but n_layers_bf16="
                        f"{checks.show_value(n16)}; expected that many distinct layers")


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
    q = check_qkv(k, v, q)
    nq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sm_scale = checks.softmax_scale_or_default(sm_scale, d)
    qq = q.reshape(nq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv * nq * g, d)
    out, _ = attention(qq, k, v, sm_scale)
    return out.reshape(hkv, nq, g, d).permute(1, 0, 2, 3).reshape(nq, hq, d)


# --------------------------------------------------------------------------- quantization error


def quantization_error(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, *, formats=("e4m3", "e5m2"),
                       granularities=GRANULARITIES, scale_methods=SCALE_LABELS, quantize=QUANTIZE,
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

    q = check_qkv(k, v, q)
    formats = format_names(formats)
    granularities = tuple(checks.many_of(granularities, "granularities", GRANULARITIES))
    scale_methods = tuple(checks.many_of(scale_methods, "scale_methods", SCALE_LABELS))
    modes = tuple(checks.many_of(quantize, "quantize", QUANTIZE))
    sm_scale = checks.softmax_scale_or_default(sm_scale, k.shape[-1])
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

    q = check_qkv(k, v, q)
    try:
        lens = [] if isinstance(lengths, (str, bytes)) else list(lengths)
    except TypeError:
        lens = []
    if not lens:
        checks.fail(f"lengths={lengths!r}; expected a non-empty sequence of ints (prefix lengths of k)")
    # each a prefix of k: at most its tokens
    lens = [checks.integer(n, f"lengths[{i}]", minimum=1, maximum=k.shape[0]) for i, n in enumerate(lens)]
    frames = []
    for n in sorted(set(lens)):
        df = quantization_error(k[:n], v[:n], q, formats=formats, granularities=granularities,
                                scale_methods=scale_methods, quantize=quantize, sm_scale=sm_scale,
                                percentile=percentile)
        df.insert(0, "context_len", n)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


_KEYS = ["format", "granularity", "scale_method"]


def _check_table(table, columns, numeric=(), name: str = "table") -> None:
    """``table`` is a DataFrame with ``columns`` (those of ``numeric`` holding numbers): a quantization_error() result."""
    import pandas as pd

    checks.dataframe(table, name, columns, expected="a pandas DataFrame, a quantization_error() result")
    for c in numeric:
        if not pd.api.types.is_numeric_dtype(table[c]) or pd.api.types.is_bool_dtype(table[c]):
            checks.fail(f"{name} column {c!r} holds {table[c].dtype} values; expected numbers", TypeError)


def attribution(table):
    """K-vs-V attribution of the attention-output error, per format × granularity × scale method.

    ``table`` is a :func:`quantization_error` result holding the ``"k"``, ``"v"`` and ``"kv"``
    rows of each combination (extra key columns, e.g. a ``source``, are kept as groups).
    Returns columns: the keys, ``out_rel_err_k`` (K quantized only), ``out_rel_err_v``,
    ``out_rel_err_kv``, ``k_share`` = k² / (k² + v²) (the share of the output's squared error
    due to K, since independent errors add in squares) and ``additivity`` =
    sqrt(k² + v²) / kv (close to 1 when the two errors are independent).
    """
    _check_table(table, ["quantize", "out_rel_err", *_KEYS], numeric=["out_rel_err"])
    modes = set(table["quantize"])
    if not {"k", "v", "kv"} <= modes:
        raise ValueError(f"table has quantize modes {sorted(modes)}; attribution needs 'k', 'v' and 'kv' rows")
    if not table["out_rel_err"].notna().any():  # else an empty table
        checks.fail(f"table has no out_rel_err value ({len(table)} rows, all NaN); nothing to attribute")
    extra = [c for c in ("source", "context_len") if c in table.columns]
    keys = extra + _KEYS
    wide = table.pivot_table(index=keys, columns="quantize", values="out_rel_err", sort=False)
    wide = wide.reindex(columns=["k", "v", "kv"]).reset_index()  # a mode with no value: NaN, not a missing column
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
    _check_table(table, ["quantize", *_KEYS, "k_rel_err", "v_rel_err", "out_rel_err"],
                 numeric=["k_rel_err", "v_rel_err", "out_rel_err"])
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
    _check_table(table, ["quantize", *cols, *_KEYS])
    keys = [c for c in ("source",) if c in table.columns] + _KEYS
    long = table[table["quantize"] == "kv"].melt(id_vars=keys, value_vars=list(cols), var_name="column",
                                                 value_name="fraction")
    long["tensor"] = long["column"].map(lambda c: cols[c][0])
    long["kind"] = long["column"].map(lambda c: cols[c][1])
    return long[keys + ["tensor", "kind", "fraction"]]

def _layer_ids(layers, n: int) -> list[int]:
    if layers is None:
        layers = 3
    if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
        if layers < 1:
            raise ValueError(f"layers={layers} must be >= 1 (a count) or a list of layer indices")
        count = min(int(layers), n)
        return sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})
    # int() read 1.5 as layer 1 and the string "12" as layers 1 and 2
    ids = [checks.integer(i, "layers") for i in checks.listed(layers, "layers", "layer indices (or a count)")]
    bad = [i for i in ids if not 0 <= i < n]
    if not ids or bad:
        raise ValueError(f"layers={layers!r}: indices must be in [0, {n}) and not empty")
    return ids


def real_kv_error(model: str = "smollm2-135m", num_tokens: int = 512, layers=3, num_queries: int = 16, *,
                  device="cpu", formats=("e4m3", "e5m2"), granularities=GRANULARITIES,
                  scale_methods=SCALE_LABELS, quantize=QUANTIZE, percentile: float = 99.9):
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

    # before the import and the model load; num_tokens unchecked made num_queries' bound a raw TypeError
    num_tokens = checks.positive_int(num_tokens, "num_tokens")
    num_queries = checks.integer(num_queries, "num_queries", minimum=1, maximum=num_tokens)
    from ..models import capture_kv, load_model, text_tokens

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


def real_kv_error_or_reason(model: str | None, num_tokens: int = 512, layers=3, num_queries: int = 16,
                            **kw) -> tuple:
    """:func:`real_kv_error`, or why it cannot run here: ``(table, stats, status)``.

    ``status`` is ``"ok"``; or, with ``table`` and ``stats`` None, ``"real activations unavailable: "``
    and the reason: ``model`` is None, or the ``models`` extra or the model's weights package is
    missing (the message names the pip command). ``kw`` goes to :func:`real_kv_error`.
    """
    if model is None:
        return None, None, "real activations unavailable: REAL_MODEL is None"
    try:
        table, stats = real_kv_error(model, num_tokens, layers, num_queries, **kw)
    except (ImportError, OSError) as exc:  # the models extra or the weights package is missing
        return None, None, f"real activations unavailable: {exc}"
    return table, stats, "ok"


def synthetic_vs_real(table, real, *, quantize: str = "kv", scale_method: str = "amax"):
    """The rows of one ``quantize`` mode and scale method of a synthetic :func:`quantization_error`
    table (``source`` "synthetic") and of :func:`real_kv_error`'s (one source per layer), stacked;
    None when ``real`` is None (no real activations)."""
    import pandas as pd

    if real is None:
        return None
    checks.one_of(quantize, "quantize", QUANTIZE)
    checks.one_of(scale_method, "scale_method", SCALE_LABELS)
    for frame, name in ((table, "table"), (real, "real")):
        _check_table(frame, ["quantize", "scale_method"], name=name)
    both = pd.concat([table.assign(source="synthetic"), real], ignore_index=True)
    return both[(both["quantize"] == quantize) & (both["scale_method"] == scale_method)]


def quantization_results(table, context, *, sizes: dict, data_stats: dict, real=None, real_stats=None,
                         real_status: str = "") -> dict:
    """Notebook 02's results file: its inputs, the tables and the numbers derived from them.

    ``table``: the synthetic :func:`quantization_error` table; ``context``: :func:`error_vs_context`'s;
    ``real``, ``real_stats``, ``real_status``: :func:`real_kv_error_or_reason`'s. Adds the unit roundoff
    of each format (``bound``), :func:`key_numbers` (and the three e4m3 per-tensor amax errors at top
    level) and :func:`attribution` of the synthetic and the real tables.
    """
    key = key_numbers(table)
    headline = {f"e4m3_tensor_amax_{which}_rel_err": key[f"e4m3_tensor_amax_{which}_rel_err"]
                for which in ("k", "v", "out")}
    return {
        "sizes": sizes,
        "data_stats": data_stats,
        "bound": {name: get_format(name).unit_roundoff for name in dict.fromkeys(table["format"])},
        **headline,
        "key_numbers": key,
        "rows": table,
        "attribution": attribution(table),
        "context": context,
        "real_status": real_status,
        "real_rows": real if real is not None else [],
        "real_stats": real_stats if real_stats is not None else [],
        "real_attribution": attribution(real) if real is not None else [],
    }
