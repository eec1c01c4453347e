"""How many tokens fit (notebook 03): the planner over models × GPUs, FP8 over 16-bit ratios, the
accounting step by step, and real caches' bytes beside the formula.

:func:`capacity_grid` wraps :func:`fp8kv.capacity.capacity_table`; :func:`tokens_ratio` gives the
FP8-over-16-bit token ratio; :func:`capacity_walkthrough` redoes the planner's block-granular
accounting step by step from the model shape (:func:`walkthrough_text` prints it);
:func:`measured_vs_formula` builds real :class:`~fp8kv.cache.PagedKVCache` objects (a
:class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` for a paged format of :mod:`fp8kv.kv_formats`) and
compares their ``nbytes`` with the formula; :func:`device_gpu` / :func:`reference_gpu` name the registry GPU
this machine is.

The KV dtypes these take (:data:`KV_KINDS`): the element types of :data:`fp8kv.formats.KV_DTYPE_NAMES` (FP8 with a
scale granularity) and the paged formats of :data:`fp8kv.kv_formats.PAGED_FORMATS` (INT8 / INT4 per token and head,
NVFP4, MXFP4, ...: their scales named by the format, their bytes :func:`fp8kv.kv_formats.kv_footprint`'s).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import torch

from .. import checks
from ..cache import PagedKVCache
from ..cache.quantized import QuantizedPagedKVCache
from ..capacity import (
    GIB,
    GPUS,
    WEIGHT_BYTES,
    capacity_table,
    get_gpu,
    gib_text,
    plan_capacity,
    resolve_model,
)
from ..device import free_memory_bytes
from ..formats import KV_DTYPE_NAMES, kv_dtype_info
from ..kv_formats import PAGED_FORMATS, KVFormat, kv_format
from ..quant import GRANULARITIES, SCALE_BYTES, kv_scale_bytes

__all__ = ["KV_KINDS", "capacity_grid", "tokens_ratio", "ratio_per_model", "capacity_walkthrough",
           "capacity_walkthroughs", "walkthrough_text", "measured_cache_bytes", "measured_vs_formula", "device_gpu",
           "reference_gpu"]

KV_KINDS = (f"an element type among {list(KV_DTYPE_NAMES)} or a paged format among {list(PAGED_FORMATS)}")
_SCALE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.float8_e4m3fn: "e4m3", torch.float8_e8m0fnu: "e8m0"}
_SAME_MEMORY = 0.03  # a registry GPU is the device only where their totals are this close (relative)


def _paged_format(kv_dtype) -> KVFormat | None:
    """None for an element type (:func:`fp8kv.formats.kv_dtype_info`'s), the format of a paged format; anything else
    refused by name (TypeError for what is no name, ValueError for a name of neither)."""
    try:
        kv_dtype_info(kv_dtype)
        return None
    except ValueError:
        pass
    if not isinstance(kv_dtype, str):
        checks.fail(f"kv_dtype={checks.show_value(kv_dtype)} ({type(kv_dtype).__name__}); expected {KV_KINDS}",
                    TypeError)
    try:
        f = kv_format(kv_dtype)
    except ValueError:
        checks.fail(f"kv_dtype={kv_dtype!r} is not known; expected {KV_KINDS}")
    if f.name.startswith("kivi4_"):
        checks.fail(f"kv_dtype={kv_dtype!r} is paged by fp8kv.cache.KIVIPagedKVCache, whose keys wait a group in a "
                    f"residual: the capacity steps measure token-local pages; expected {KV_KINDS}")
    if f.name not in PAGED_FORMATS:
        checks.fail(f"kv_dtype={kv_dtype!r} has no paged cache (its scales span tokens or the whole tensor); expected "
                    f"{KV_KINDS} (FP8 with its scales: 'fp8_e4m3' and a granularity)")
    return f


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

    if isinstance(gpus, str):
        gpus = [gpus]
    elif isinstance(gpus, (list, tuple)):
        gpus = list(gpus)
    else:
        checks.fail(f"gpus={gpus!r}; expected a list of GPU names (e.g. ['H100', 'H200']), possibly empty", TypeError)
    frames = [capacity_table(models, gpus, kv_dtypes, granularities, **kw)] if gpus else []
    if device_memory_gib is not None:  # a number of GiB (a name goes in gpus): plan_capacity bounds it
        device_memory_gib = checks.real(device_memory_gib, "device_memory_gib", minimum=0.0, inclusive=False)
        dev = capacity_table(models, [device_memory_gib], kv_dtypes, granularities, **kw)
        frames.append(dev.assign(gpu=device_label))
    if not frames:
        raise ValueError("no GPU to plan for: pass gpus names and/or device_memory_gib")
    table = pd.concat(frames, ignore_index=True)
    if "kv_budget_bytes" in table:
        table["tokens_per_gib"] = table["tokens"] / (table["kv_budget_bytes"] / GIB)
        used = table["tokens"] * table["bytes_per_token"] + table["fixed_scale_bytes"]
        table["scale_fraction"] = table["scale_overhead_bytes"] / used
    else:  # no model fits any GPU given: the columns are there, NaN, as for every row that does not fit
        table["tokens_per_gib"] = table["scale_fraction"] = math.nan
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
    from ..results import check_rows

    check_rows(table, "tokens_ratio", ("model", "gpu", "kv_dtype", "granularity", "tokens", "blocks", "element_size"),
               expected="a capacity_grid() or fp8kv.capacity.capacity_table() table")
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
    from ..results import check_rows

    check_rows(ratios, "ratio_per_model", ("model", "gpu", "granularity"), expected="a tokens_ratio() table")
    checks.one_of(granularity, "granularity", GRANULARITIES)
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

    if request_len is not None:
        request_len = checks.positive_int(request_len, "request_len")
    shape = resolve_model(model)
    if shape.num_params is None:  # the planner's refusal would advise weights_gib, which the walkthrough has not
        checks.fail(f"model {shape.name!r} has no num_params; the walkthrough counts the weights as num_params x "
                    f"{WEIGHT_BYTES} bytes: expected a registry name, a ModelShape or dict with num_params, or a "
                    "Hugging Face config with vocab_size and intermediate_size")
    paged = _paged_format(kv_dtype)
    plan = plan_capacity(shape, kv_dtype, gpu_memory_gib=gpu, utilization=utilization, block_size=block_size,
                         granularity=granularity, max_model_len=max_model_len)
    layers, hkv, d = shape.num_layers, shape.num_kv_heads, shape.head_dim
    total = plan["gpu_memory_gib"] * GIB
    weights = shape.num_params * WEIGHT_BYTES
    budget = math.floor(total * utilization) - weights
    if paged is None:
        _, tdtype, fmt = kv_dtype_info(kv_dtype)
        elem = torch.empty(0, dtype=tdtype).element_size()
        gran = granularity if fmt is not None else None
        fixed, scale_bpt = kv_scale_bytes(gran, num_layers=layers, num_kv_heads=hkv, head_dim=d)
        bpt = layers * 2 * hkv * d * elem + scale_bpt
        fixed_text = f"{gran} scales, fp32, per layer and K/V" if gran else "16-bit: no scales"
        bpt_text = (f"{layers} layers x 2 (K,V) x {hkv} heads x {d} x {elem} B"
                    + (f" + {layers} x 2 x {hkv} x {SCALE_BYTES} B scales" if scale_bpt else ""))
    else:
        fixed, bpt, fixed_text, bpt_text = _format_bytes(paged, layers, hkv, d)
    block_bytes = math.ceil(block_size * bpt)
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
        ("fixed scale bytes", fixed_text, fixed, plan["fixed_scale_bytes"]),
        ("bytes per token", bpt_text, bpt, plan["bytes_per_token"]),
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


def _format_bytes(f: KVFormat, layers: int, hkv: int, d: int) -> tuple:
    """``(fixed, bytes per token, their formulas)`` of paged format ``f``, from its codecs' codes and scales (what
    ``kv_footprint`` counts, recomputed): each token holds ``d x bits / 8`` bytes of codes and one scale per
    head (``token_head``) or per ``block`` channels; a per-tensor second level is fp32, once per layer and K/V."""
    per_head, texts, tensor = 0, [], 0
    for c in f.codecs:
        groups = d // c.block if c.scaling == "block" else 1
        per_head += Fraction(d * c.bits, 8) + groups * c.scale_bytes
        dtype = _SCALE_NAMES.get(c.scale_dtype, str(c.scale_dtype).split(".")[-1])
        texts.append(f"{d} x {c.bits}/8 + {groups} x {c.scale_bytes} {dtype}")
        tensor += SCALE_BYTES if c.tensor_scale else 0
    bpt = layers * hkv * per_head
    each = texts[0] if texts[0] == texts[1] else None
    bpt_text = (f"{layers} layers x 2 (K,V) x {hkv} heads x ({each}) B" if each else
                f"{layers} layers x {hkv} heads x (K: {texts[0]} + V: {texts[1]}) B")
    fixed_text = (f"{f.name}: fp32 tensor scales, per layer and K/V" if tensor else
                  f"{f.name}: none (its scales go with each token)")
    return layers * tensor, int(bpt) if bpt.denominator == 1 else float(bpt), fixed_text, bpt_text


def capacity_walkthroughs(model, kv_dtypes, gpu, **kw) -> dict:
    """:func:`capacity_walkthrough` of ``model`` on ``gpu`` for each of ``kv_dtypes``: ``{kv_dtype: steps}``.

    ``kw`` (utilization, block_size, granularity, max_model_len, request_len) goes to each."""
    kv_dtypes = [kv_dtypes] if isinstance(kv_dtypes, str) else list(kv_dtypes)
    return {kv: capacity_walkthrough(model, kv, gpu, **kw) for kv in kv_dtypes}


def walkthrough_text(walks: dict, model, gpu) -> str:
    """:func:`capacity_walkthroughs` as aligned text: one block per KV dtype, one line per step (its
    formula and value, and whether it equals the planner's number)."""
    if not isinstance(walks, dict):
        checks.fail(f"walks={checks.show_value(walks)} ({type(walks).__name__}); expected capacity_walkthroughs()' "
                    "dict of {kv_dtype: steps}", TypeError)
    lines = []
    for kv, steps in walks.items():
        lines.append(f"{model} on {gpu}, KV {kv}:")
        for s in steps.itertuples():
            check = "" if s.match is None else ("  = planner" if s.match else f"  != planner {s.planner}")
            value = f"{s.value:,.4f}" if isinstance(s.value, float) else f"{s.value:,}"
            lines.append(f"  {s.step:<44} {s.formula:<58} {value:>20}{check}")
        lines.append("")
    return "\n".join(lines)

def _exact(x):
    """Integral numbers as int (byte counts print exactly), others unchanged."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x


def measured_cache_bytes(model, kv_dtype, granularity: str = "tensor", *, kv_memory_gib: float,
                         block_size: int = 16, device="cpu") -> dict:
    """Allocate the planner's blocks for one layer as a real :class:`PagedKVCache` (``kv_dtype`` an element type) or
    :class:`~fp8kv.cache.quantized.QuantizedPagedKVCache` (a paged format; :data:`KV_KINDS`); compare bytes.

    ``plan_capacity(model, kv_dtype, kv_memory_gib=...)`` says how many blocks fit in that budget
    (over all layers; a format's bytes are ``kv_footprint``'s). One layer's cache with exactly that many blocks is
    built (``empty``; a format's per-tensor scales 1), and ``nbytes × num_layers`` (pages plus scales, as
    allocated) is set beside the formula ``bytes_per_token × tokens + fixed_scale_bytes``.

    Returns a dict: model, kv_dtype, granularity (None for 16-bit and formats), num_layers, blocks, tokens,
    layer_nbytes, measured_bytes, formula_bytes, equal (bool), budget_bytes.
    """
    paged = _paged_format(kv_dtype)
    plan = plan_capacity(model, kv_dtype, kv_memory_gib=kv_memory_gib, block_size=block_size,
                         granularity=granularity, max_model_len=block_size)
    shape = resolve_model(model)
    layer_bytes = (plan["bytes_per_token"] * plan["tokens"] + plan["fixed_scale_bytes"]) // shape.num_layers
    free = free_memory_bytes(device)
    if free is not None and layer_bytes > free:  # refused by name rather than failed in the allocator
        checks.fail(f"kv_memory_gib={kv_memory_gib:g}: one layer of {shape.name}'s planned cache takes "
                    f"{gib_text(layer_bytes)}, more than the {gib_text(free)} free on {device}; measure a smaller budget")
    if paged is None:
        cache = PagedKVCache.empty(1, plan["tokens"], shape.num_kv_heads, shape.head_dim, block_size=block_size,
                                   kv_dtype=kv_dtype, granularity=granularity, device=device)
    else:
        tensor = {f"{w}_tensor_scale": 1.0 for w, c in zip("kv", paged.codecs, strict=True) if c.tensor_scale}
        cache = QuantizedPagedKVCache.empty(paged, 1, plan["tokens"], shape.num_kv_heads, shape.head_dim,
                                            block_size=block_size, device=device, **tensor)
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
    """:func:`measured_cache_bytes` for every model × kv_dtype × granularity (16-bit and paged formats, whose scales
    the format names: once). ``kv_dtypes``: names of :data:`KV_KINDS`. A DataFrame."""
    import pandas as pd

    models = [models] if isinstance(models, str) else list(models)
    kv_dtypes = [kv_dtypes] if isinstance(kv_dtypes, str) else list(kv_dtypes)
    granularities = tuple(checks.many_of(granularities, "granularities", GRANULARITIES))
    fp8 = {kd: _paged_format(kd) is None and kv_dtype_info(kd)[2] is not None for kd in kv_dtypes}  # named up front
    rows = []
    for m in models:
        for kd in kv_dtypes:
            for gran in granularities if fp8[kd] else granularities[:1]:
                rows.append(measured_cache_bytes(m, kd, gran, kv_memory_gib=kv_memory_gib, block_size=block_size,
                                                 device=device))
    return _none_for_missing(pd.DataFrame(rows), "granularity")


def device_gpu(info: dict) -> str | None:
    """The name in :data:`fp8kv.capacity.GPUS` of the GPU that ``info`` (:func:`fp8kv.device.describe_device`'s dict)
    describes, or None: a CPU, or a GPU the registry does not know. A registry GPU is the device where every word of
    its name is a word of the device's ("NVIDIA H100 80GB HBM3" is the H100, "NVIDIA A100-SXM4-80GB" the A100-80GB,
    "NVIDIA GeForce RTX 4090" the RTX 4090) and its driver total is within 3 % of the device's memory (an H100 NVL,
    94 GB, is no H100)."""
    if not isinstance(info, dict):
        checks.fail(f"info={checks.show_value(info)} ({type(info).__name__}); expected describe_device()'s dict",
                    TypeError)
    if info.get("type") != "cuda" or not isinstance(info.get("name"), str) or not info.get("memory_gib"):
        return None
    words = set(re.findall(r"[a-z0-9.]+", info["name"].lower()))
    found = [g.name for g in GPUS.values() if set(re.findall(r"[a-z0-9.]+", g.name.lower())) <= words
             and abs(g.total_gib - float(info["memory_gib"])) <= _SAME_MEMORY * g.total_gib]
    return found[0] if len(found) == 1 else None


def reference_gpu(choice: str, info: dict, fallback: str = "H200") -> str:
    """Notebook 03's REFERENCE_GPU: ``"auto"``, the GPU this is (:func:`device_gpu` of ``info``) where the registry
    knows it, else ``fallback``; or a GPU name of :data:`fp8kv.capacity.GPUS`, as the registry spells it."""
    if not isinstance(choice, str):
        checks.fail(f"REFERENCE_GPU={checks.show_value(choice)} ({type(choice).__name__}); expected \"auto\" or a GPU "
                    f"name among {sorted(GPUS)}", TypeError)
    if choice == "auto":
        return device_gpu(info) or get_gpu(fallback).name
    try:
        return get_gpu(choice).name
    except ValueError:
        checks.fail(f"REFERENCE_GPU={choice!r} is not a known GPU; expected \"auto\" or one of {sorted(GPUS)}")
