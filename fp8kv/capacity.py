"""KV-cache capacity planner: how many tokens fit, in bf16, FP8 or a format of :mod:`fp8kv.kv_formats` (INT8,
INT4, KIVI, NVFP4, MXFP4, ...: bytes from ``kv_footprint``), on a given GPU. The models and GPUs it
knows and the Hugging Face config reader are :mod:`fp8kv.capacity_registry`'s (importable from here too).

The accounting follows the paged engines (vLLM's block manager):

1. memory for the KV cache, in bytes: either given (``kv_memory_gib``) or
   ``gpu_memory x utilization - weights``;
2. minus the fixed scale bytes (per-tensor / per-head / per-channel scales live
   beside the pages, once per layer);
3. ``blocks = floor(kv_memory / (block_size x bytes_per_token))``, where one token
   costs ``layers x 2 (K and V) x Hkv x head_dim x element_size`` bytes, plus its own
   scales under ``token_head`` granularity;
4. ``tokens = blocks x block_size`` and ``max_concurrency = tokens / max_model_len``.

Scales are fp32 (4 bytes), as ``fp8kv.quant`` stores them. Scale shapes per layer and
per K/V (see ``fp8kv.quant.scale_shape``): ``tensor`` one scalar, ``head`` ``[Hkv]``,
``channel`` ``[Hkv, D]``, ``token_head`` ``[tokens, Hkv]``; 16-bit caches have none.

What the planner leaves out (so it is an upper bound on what an engine reports):
activation and CUDA-graph memory, which engines subtract after a profiling run, and
sliding-window layers (Gemma 3 keeps only a window on 5 of 6 layers; every layer is
counted here as full attention).

GPU memory sizes
----------------
Vendors print memory capacity in "GB" following the JEDEC convention for memory
devices, where 1 GB = 2**30 bytes (JEDEC JESD100B.01). The driver confirms it: an
"A100 40GB" reports exactly 40960 MiB. Reading the datasheet "GB" as 10**9 bytes
would undercount an 80 GB card by 7 % (74.5 GiB). The planner uses the total that
``nvidia-smi`` reports (``memory.total``), slightly below the datasheet figure
because the driver and ECC reserve some; pass ``gpu_memory_gib`` as a number (e.g.
``torch.cuda.mem_get_info()[1] / 2**30``) for a measured value.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict

import torch

from fp8kv import checks
from fp8kv.cache import check_block_size
from fp8kv.capacity_registry import (
    GPU,
    GPUS,
    MODEL_SHAPES,
    MODELS,
    ModelShape,
    get_gpu,
    get_model,
    load_hf_config,
    resolve_model,
)
from fp8kv.formats import KV_DTYPES, kv_dtype_info
from fp8kv.kv_formats import KV_FORMAT_NAMES, KVFormat, kv_footprint, kv_format
from fp8kv.quant import GRANULARITIES, kv_scale_bytes

__all__ = ["ModelShape", "MODEL_SHAPES", "MODELS", "GPU", "GPUS", "CapacityError", "get_model", "get_gpu", "resolve_model",
           "load_hf_config", "plan_capacity", "capacity_table", "model_table", "gpu_table", "MAX_MEMORY_GIB", "MAX_MODEL_LEN",
           "checked_memory_gib", "gib_text"]

GIB = 2**30
WEIGHT_BYTES = 2  # bf16/fp16 weights: vLLM's dtype="auto" serves fp32 checkpoints in 16-bit too
# The largest memory the planner accepts, GiB (about a pebibyte): over 70 times a 72-GPU NVL72 rack's
# HBM, so a larger number is a typo or a unit slip. It also keeps the byte arithmetic exact: 1e6 GiB
# in bytes (1.07e15) is below 2**53, where float64 still counts every byte.
MAX_MEMORY_GIB = 1e6
# The longest sequence a plan takes (int32 positions, as the caches' seq_lens): past it max_concurrency would
# round toward 0.0 rather than say the length is none a cache holds.
MAX_MODEL_LEN = 2**31 - 1


def gib_text(nbytes: float) -> str:
    """Bytes as GiB with four significant digits ("71.5 GiB", "9.313e-10 GiB"): never a bare 0.00 for a
    small but non-zero amount."""
    return f"{nbytes / GIB:.4g} GiB"


def checked_memory_gib(value, name: str, *, allow_zero: bool = False) -> float:
    """``value`` GiB checked: a finite number > 0 (>= 0 with ``allow_zero``) and at most :data:`MAX_MEMORY_GIB`."""
    value = checks.real(value, name, minimum=0.0, inclusive=allow_zero)
    if value > MAX_MEMORY_GIB:
        checks.fail(f"{name}={value:g} GiB is over the planner's bound of {MAX_MEMORY_GIB:g} GiB (about a "
                    "pebibyte, more than any GPU or node holds); give the memory in GiB, e.g. 80")
    return value


class CapacityError(ValueError):
    """The inputs are valid but leave no room for a single KV block (e.g. weights do not fit)."""


def _kv_dtype(kv_dtype) -> tuple[str, torch.dtype | None, object, KVFormat | None]:
    """``(name, torch dtype, fp8 format, None)`` of a KV element type (``kv_dtype_info``), or ``(name, None, None,
    KVFormat)`` of a storage format of :mod:`fp8kv.kv_formats` (its codes and scales counted by ``kv_footprint``).
    Non-strings (a bool or None is not a name) are a TypeError, unknown names a ValueError naming both sets."""
    if not isinstance(kv_dtype, (str, torch.dtype)):
        checks.fail(f"kv_dtype={kv_dtype!r} ({type(kv_dtype).__name__}); expected a name among "
                    f"{list(KV_DTYPES)}, a KV format among {list(KV_FORMAT_NAMES)} or a torch dtype", TypeError)
    try:
        return (*kv_dtype_info(kv_dtype), None)
    except ValueError:
        if isinstance(kv_dtype, torch.dtype):
            raise
    try:
        f = kv_format(kv_dtype)
    except ValueError:
        checks.fail(f"kv_dtype={kv_dtype!r} is not supported; expected one of the element types {list(KV_DTYPES)} "
                    f"or a KV format among {list(KV_FORMAT_NAMES)}")
    return f.name, None, None, f


def _exact(x):
    """An exact byte count (int or Fraction) as an int where it is whole, else as the float nearest it."""
    return int(x) if getattr(x, "denominator", 1) == 1 else float(x)


def _format_bytes(f: KVFormat, shape: ModelShape) -> tuple[object, object, int]:
    """``(codes, scales)`` bytes per token and fixed bytes of format ``f`` for the whole model, from
    :func:`fp8kv.kv_formats.kv_footprint` (the one count of a format's bytes). A format that cannot hold the
    model's head_dim (a block that does not divide it) is a CapacityError naming both."""
    try:
        fp = kv_footprint(f, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, num_layers=shape.num_layers)
    except ValueError as e:
        raise CapacityError(f"kv_dtype={f.name!r} cannot store {shape.name}'s head_dim {shape.head_dim}: {e}") from e
    return fp.codes, fp.per_token_scales, fp.fixed


def plan_capacity(model, kv_dtype, kv_memory_gib=None, gpu_memory_gib=None, utilization=0.9,
                  weights_gib=None, block_size=16, max_model_len=None, granularity="tensor") -> dict:
    """Plan how many KV tokens, blocks and full-length sequences fit.

    Parameters
    ----------
    model : str | dict | ModelShape | path
        Registry name (see ``MODEL_SHAPES``), a dict of ModelShape fields or a Hugging Face config
        dict, a ModelShape, or a path to a ``config.json`` (or its folder).
    kv_dtype : str | torch.dtype
        KV element type: ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` (or aliases), or a storage
        format of :mod:`fp8kv.kv_formats` (``"int8_token_head"``, ``"int4_token_head"``, ``"kivi4_g32"``,
        ``"nvfp4"``, ``"mxfp4"``, ... :data:`~fp8kv.kv_formats.KV_FORMAT_NAMES`): its bytes per token and fixed
        bytes are :func:`~fp8kv.kv_formats.kv_footprint`'s (codes in ``kv_data_bytes_per_token``, scales and zero
        points in ``scale_bytes_per_token``; ``element_size`` is the code's bits / 8), ``granularity`` is
        ignored (None: the format names its scales), and a format whose block does not divide the model's
        head_dim is a CapacityError.
    kv_memory_gib : float, optional
        Memory given to the KV cache, GiB. Exclusive with ``gpu_memory_gib``.
    gpu_memory_gib : float | str, optional
        GPU memory in GiB, or a GPU name from ``GPUS`` (its driver-reported total). The KV
        budget is then ``gpu_memory_gib x utilization - weights``.
    utilization : float
        Fraction of GPU memory the engine may use, in (0, 1] (vLLM's gpu_memory_utilization).
    weights_gib : float, optional
        Weight memory, GiB (>= 0); default ``num_params x 2 bytes`` from the model.
    block_size : int
        Tokens per KV block: a positive int (:func:`fp8kv.cache.check_block_size`, the cache's rule).
    max_model_len : int, optional
        Sequence length for ``max_concurrency``, an int in ``[1, MAX_MODEL_LEN]`` (2**31 - 1); default the
        model's max_position_embeddings.
    granularity : str
        FP8 scale granularity: ``"tensor"``, ``"head"``, ``"token_head"`` or ``"channel"``.
        Ignored (reported as None) for 16-bit caches, which have no scales.

    Returns
    -------
    dict
        model, kv_dtype, granularity, block_size, element_size, num_layers, num_kv_heads,
        head_dim, kv_data_bytes_per_token, scale_bytes_per_token, bytes_per_token,
        fixed_scale_bytes, kv_budget_bytes (before fixed scales), kv_memory_bytes (after),
        block_bytes, blocks, tokens, max_model_len, max_concurrency (float),
        scale_overhead_bytes (all scales at full occupancy), weights_bytes, and the inputs
        gpu, gpu_memory_gib, utilization, weights_gib, kv_memory_gib.

    Raises
    ------
    TypeError
        An argument of the wrong kind: a bool, a string or None where a number is expected
        (``utilization=True``, ``kv_memory_gib="8"``, ``block_size=16.0``), a kv_dtype that is
        neither a name nor a torch dtype.
    ValueError
        Unknown model / kv_dtype / granularity / GPU; utilization outside (0, 1] or NaN; memory
        that is not a positive finite number (weights_gib may be 0) or is over ``MAX_MEMORY_GIB``
        (1e6 GiB, about a pebibyte: a typo, not a GPU); block_size not a power of
        two >= 8; both or neither of kv_memory_gib and gpu_memory_gib; a model config that is
        not JSON or whose shape fields are missing, zero, non-integer or do not divide.
    CapacityError (a ValueError)
        The weights leave no memory for the KV cache, or the memory holds no single block.
    """
    shape = resolve_model(model)
    kv_name, kv_torch_dtype, fmt, storage = _kv_dtype(kv_dtype)
    checks.one_of(granularity, "granularity", GRANULARITIES)
    utilization = checks.real(utilization, "utilization")
    if not 0 < utilization <= 1:
        checks.fail(f"utilization={utilization}; expected a fraction in (0, 1]")
    block_size = check_block_size(block_size)  # the cache's rule: a plan for pages no cache would build is no plan
    if max_model_len is not None:
        max_model_len = checks.integer(max_model_len, "max_model_len", minimum=1, maximum=MAX_MODEL_LEN)

    layers, hkv, d = shape.num_layers, shape.num_kv_heads, shape.head_dim
    if storage is not None:  # a kv_formats format: its codes and scales as kv_footprint counts them
        granularity = None  # the format names its own scales
        elem = storage.key.bits / 8
        data_bpt, scale_bpt, fixed = _format_bytes(storage, shape)
    else:
        elem = torch.tensor([], dtype=kv_torch_dtype).element_size()
        data_bpt = layers * 2 * hkv * d * elem
        if fmt is None:
            granularity = None  # 16-bit caches carry no scales
        fixed, scale_bpt = kv_scale_bytes(granularity, num_layers=layers, num_kv_heads=hkv, head_dim=d)
    bpt = data_bpt + scale_bpt

    gpu_name, weights_bytes = None, None
    if (kv_memory_gib is None) == (gpu_memory_gib is None):
        raise ValueError("pass exactly one of kv_memory_gib (memory for the KV cache) and "
                         f"gpu_memory_gib (GPU memory or name); got kv_memory_gib={kv_memory_gib!r}, "
                         f"gpu_memory_gib={gpu_memory_gib!r}")
    if kv_memory_gib is not None:
        if weights_gib is not None:
            raise ValueError(f"weights_gib={weights_gib!r} only applies with gpu_memory_gib; "
                             "kv_memory_gib is already the KV budget")
        kv_memory_gib = checked_memory_gib(kv_memory_gib, "kv_memory_gib")
        budget = math.floor(kv_memory_gib * GIB)
    else:
        if isinstance(gpu_memory_gib, (str, GPU)):
            gpu = get_gpu(gpu_memory_gib)
            gpu_name, gpu_memory_gib = gpu.name, gpu.total_gib
        gpu_memory_gib = checked_memory_gib(gpu_memory_gib, "gpu_memory_gib")
        gpu_bytes = gpu_memory_gib * GIB
        if weights_gib is not None:
            weights_gib = checked_memory_gib(weights_gib, "weights_gib", allow_zero=True)
            weights_bytes = math.ceil(weights_gib * GIB)
        elif shape.num_params is not None:
            weights_bytes = shape.num_params * WEIGHT_BYTES
        else:
            raise ValueError(f"model {shape.name!r} has no num_params; pass weights_gib")
        budget = math.floor(gpu_bytes * utilization) - weights_bytes
        if budget <= 0:
            raise CapacityError(
                f"no memory left for the KV cache{' on ' + gpu_name if gpu_name else ''}: "
                f"gpu_memory_gib={gpu_memory_gib:.4g} x "
                f"utilization={utilization} = {gib_text(gpu_bytes * utilization)}, but the weights of "
                f"{shape.name} take {gib_text(weights_bytes)}; the weights do not fit")

    kv_bytes = budget - fixed
    # A group spanning tokens (KIVI's keys) can leave a fraction of a byte per token: a block rounds up.
    block_bytes = math.ceil(block_size * bpt)
    blocks = kv_bytes // block_bytes if kv_bytes > 0 else 0
    if blocks == 0:
        raise CapacityError(f"KV memory of {budget} bytes ({fixed} of them fixed scales) holds no block "
                            f"of {block_bytes} bytes ({block_size} tokens x {bpt} bytes/token)")
    tokens = blocks * block_size

    if max_model_len is None:
        max_model_len = shape.max_position_embeddings
        if max_model_len is None:
            raise ValueError(f"model {shape.name!r} has no max_position_embeddings; pass max_model_len")
        if max_model_len > MAX_MODEL_LEN:
            checks.fail(f"model {shape.name!r} has max_position_embeddings={max_model_len}, past MAX_MODEL_LEN="
                        f"{MAX_MODEL_LEN}; pass a max_model_len within it")

    return dict(
        model=shape.name, kv_dtype=kv_name, granularity=granularity, block_size=block_size,
        element_size=elem, num_layers=layers, num_kv_heads=hkv, head_dim=d,
        kv_data_bytes_per_token=_exact(data_bpt), scale_bytes_per_token=_exact(scale_bpt), bytes_per_token=_exact(bpt),
        fixed_scale_bytes=fixed, kv_budget_bytes=budget, kv_memory_bytes=kv_bytes,
        block_bytes=block_bytes, blocks=blocks, tokens=tokens, max_model_len=max_model_len,
        max_concurrency=tokens / max_model_len, scale_overhead_bytes=_exact(fixed + scale_bpt * tokens),
        weights_bytes=weights_bytes, gpu=gpu_name, gpu_memory_gib=gpu_memory_gib,
        utilization=utilization, weights_gib=weights_gib, kv_memory_gib=kv_memory_gib,
    )


def _items(value, name: str, single: tuple) -> list:
    """One item (a name is one item, not a sequence of characters) or a non-empty list of them."""
    if isinstance(value, single):
        return [value]
    try:
        value = list(value)
    except TypeError:
        checks.fail(f"{name}={value!r} ({type(value).__name__}); expected one item or a list of them", TypeError)
    if not value:
        checks.fail(f"{name} is empty; expected at least one item")
    return value


def _each(items, name: str, resolve) -> None:
    """``resolve`` every entry of ``items``; its error is re-raised with ``name[i]`` in front."""
    for i, item in enumerate(items):
        try:
            resolve(item)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}[{i}]: {e}") from None


def capacity_table(models, gpus, kv_dtypes, granularities=("tensor",), **kw):
    """Plan every model x GPU x kv_dtype x granularity; one tidy row per plan.

    ``gpus`` items are GPU names or GiB numbers; pass ``gpus=None`` with ``kv_memory_gib=`` in
    ``kw`` for a fixed KV budget. 16-bit kv_dtypes get one row (granularity None). Combinations
    where the model does not fit get ``fits=False``, zero blocks/tokens/concurrency and the
    reason in ``note``; other errors propagate. ``kw`` goes to :func:`plan_capacity`.

    Returns
    -------
    pandas.DataFrame
        The :func:`plan_capacity` keys plus ``fits`` and ``note``.
    """
    import pandas as pd

    models = _items(models, "models", (str, dict, ModelShape, os.PathLike))
    kv_dtypes = _items(kv_dtypes, "kv_dtypes", (str, torch.dtype))
    granularities = checks.many_of(granularities, "granularities", GRANULARITIES)
    if gpus is not None:
        gpus = _items(gpus, "gpus", (str, int, float, GPU))
    for key, instead in (("granularity", "granularities"), ("gpu_memory_gib", "gpus")):
        if key in kw and (key == "granularity" or gpus is not None):
            checks.fail(f"{key}={kw[key]!r} is set per row by capacity_table; pass {instead}= instead")
    # each entry resolved once here, so that an error names the list and index it came from
    _each(models, "models", resolve_model)
    _each(kv_dtypes, "kv_dtypes", _kv_dtype)
    _each([g for g in gpus or () if isinstance(g, str)], "gpus", get_gpu)
    rows = []
    for model in models:
        for gpu in (gpus if gpus is not None else [None]):
            for kv_dtype in kv_dtypes:
                kv_name, _, fmt, _ = _kv_dtype(kv_dtype)
                for gran in (granularities if fmt is not None else granularities[:1]):
                    args = dict(kw, granularity=gran)
                    if gpu is not None:
                        args["gpu_memory_gib"] = gpu
                    try:
                        row = dict(plan_capacity(model, kv_dtype, **args), fits=True, note="")
                    except CapacityError as e:
                        g = get_gpu(gpu) if isinstance(gpu, (str, GPU)) else None
                        row = dict(model=resolve_model(model).name, kv_dtype=kv_name,
                                   granularity=gran if fmt is not None else None,
                                   gpu=g.name if g else None, gpu_memory_gib=g.total_gib if g else gpu,
                                   blocks=0, tokens=0, max_concurrency=0.0, fits=False, note=str(e))
                    rows.append(row)
    return pd.DataFrame(rows)


def model_table():
    """The model registry as a pandas DataFrame (one row per model, ModelShape fields as columns)."""
    import pandas as pd

    return pd.DataFrame([asdict(m) for m in MODEL_SHAPES.values()])


def gpu_table():
    """The GPU registry as a pandas DataFrame, with the driver total in GiB."""
    import pandas as pd

    return pd.DataFrame([dict(asdict(g), total_gib=g.total_gib) for g in GPUS.values()])
