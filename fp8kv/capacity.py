"""KV-cache capacity planner: how many tokens fit, in bf16 vs FP8, on a given GPU.

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

import json
import math
import os
from dataclasses import asdict, dataclass, fields

import torch

from fp8kv import checks
from fp8kv.cache import check_block_size
from fp8kv.formats import KV_DTYPES, kv_dtype_info
from fp8kv.quant import GRANULARITIES, kv_scale_bytes

__all__ = ["ModelShape", "MODEL_SHAPES", "MODELS", "GPU", "GPUS", "CapacityError", "get_model", "get_gpu", "resolve_model",
           "load_hf_config", "plan_capacity", "capacity_table", "model_table", "gpu_table", "MAX_MEMORY_GIB",
           "gib_text"]

GIB = 2**30
WEIGHT_BYTES = 2  # bf16/fp16 weights: vLLM's dtype="auto" serves fp32 checkpoints in 16-bit too
# The largest memory the planner accepts, GiB (about a pebibyte): over 70 times a 72-GPU NVL72 rack's
# HBM, so a larger number is a typo or a unit slip. It also keeps the byte arithmetic exact: 1e6 GiB
# in bytes (1.07e15) is below 2**53, where float64 still counts every byte.
MAX_MEMORY_GIB = 1e6


def gib_text(nbytes: float) -> str:
    """Bytes as GiB with four significant digits ("71.5 GiB", "9.313e-10 GiB"): never a bare 0.00 for a
    small but non-zero amount."""
    return f"{nbytes / GIB:.4g} GiB"


def _memory_gib(value, name: str, *, allow_zero: bool = False) -> float:
    """``value`` GiB checked: a finite number > 0 (>= 0 with ``allow_zero``) and at most :data:`MAX_MEMORY_GIB`."""
    value = checks.real(value, name, minimum=0.0, inclusive=allow_zero)
    if value > MAX_MEMORY_GIB:
        checks.fail(f"{name}={value:g} GiB is over the planner's bound of {MAX_MEMORY_GIB:g} GiB (about a "
                    "pebibyte, more than any GPU or node holds); give the memory in GiB, e.g. 80")
    return value


class CapacityError(ValueError):
    """The inputs are valid but leave no room for a single KV block (e.g. weights do not fit)."""


@dataclass(frozen=True)
class ModelShape:
    """The shape facts of a decoder that set its KV-cache size and weight memory.

    ``num_params`` counts every stored parameter once (tied embeddings once); it gives
    the weight bytes (``num_params x 2``). ``source`` is where the numbers come from.
    """

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int | None = None
    max_position_embeddings: int | None = None
    num_params: int | None = None
    torch_dtype: str = "bfloat16"
    source: str = ""
    # The rest of a dense decoder's forward pass (fp8kv.step builds its decode step from them).
    intermediate_size: int | None = None  # gated-MLP width
    vocab_size: int | None = None
    tie_word_embeddings: bool = False  # the LM head reuses the input embedding matrix
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)

    def __post_init__(self):
        for f in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelShape {self.name!r}: {f}={v!r} must be a positive int")
        for f in ("hidden_size", "max_position_embeddings", "num_params"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"ModelShape {self.name!r}: {f}={v!r} must be a positive int or None")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape {self.name!r}: num_q_heads={self.num_q_heads} is not a multiple "
                             f"of num_kv_heads={self.num_kv_heads} (grouped-query attention needs it)")


# Shapes from each model's Hugging Face config.json (URL in ``source``). num_params is counted
# from the same config: embeddings (x2 when untied) + per layer (q, k, v, o, gated MLP, norms,
# q/k norms where the architecture has them) + final norm; each matches the model card's total.
# intermediate_size, vocab_size, tie_word_embeddings, rope_theta and rms_norm_eps are the config's
# keys of the same names (Llama 3.1 also scales its RoPE frequencies, "rope_scaling": llama3, which
# is not recorded here); qk_norm is the architecture's (Qwen3Attention, Gemma3Attention).
MODEL_SHAPES: dict[str, ModelShape] = {m.name: m for m in (
    # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json (tied embeddings, q/k norm)
    ModelShape("Qwen3-0.6B", 28, 16, 8, 128, 1024, 40960, 596_049_920,
               source="https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json",
               intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
               rope_theta=1_000_000.0, rms_norm_eps=1e-06, qk_norm=True),
    # https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json (tied embeddings, q/k norm)
    ModelShape("Qwen3-4B", 36, 32, 8, 128, 2560, 40960, 4_022_468_096,
               source="https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json",
               intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
               rope_theta=1_000_000.0, rms_norm_eps=1e-06, qk_norm=True),
    # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (untied embeddings, q/k norm)
    ModelShape("Qwen3-8B", 36, 32, 8, 128, 4096, 40960, 8_190_735_360,
               source="https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
               intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
               rope_theta=1_000_000.0, rms_norm_eps=1e-06, qk_norm=True),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (head_dim = 4096 / 32)
    ModelShape("Llama-3.1-8B", 32, 32, 8, 128, 4096, 131072, 8_030_261_248,
               source="https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
               intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
               rope_theta=500_000.0, rms_norm_eps=1e-05),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (head_dim = 8192 / 64)
    ModelShape("Llama-3.1-70B", 80, 64, 8, 128, 8192, 131072, 70_553_706_496,
               source="https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json",
               intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
               rope_theta=500_000.0, rms_norm_eps=1e-05),
    # https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json (sliding_window null)
    ModelShape("Mistral-7B-v0.3", 32, 32, 8, 128, 4096, 32768, 7_248_023_552,
               source="https://huggingface.co/mistralai/Mistral-7B-v0.3/blob/main/config.json",
               intermediate_size=14336, vocab_size=32768, tie_word_embeddings=False,
               rope_theta=1_000_000.0, rms_norm_eps=1e-05),
    # https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json (tied embeddings)
    ModelShape("SmolLM2-135M", 30, 9, 3, 64, 576, 8192, 134_515_008,
               source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M/blob/main/config.json",
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
               rope_theta=100_000.0, rms_norm_eps=1e-05),
    # https://huggingface.co/google/gemma-3-270m/blob/main/config.json (15 of 18 layers slide over 512)
    ModelShape("Gemma-3-270M", 18, 4, 1, 256, 640, 32768, 268_098_176,
               source="https://huggingface.co/google/gemma-3-270m/blob/main/config.json",
               intermediate_size=2048, vocab_size=262144, tie_word_embeddings=True,
               rope_theta=1_000_000.0, rms_norm_eps=1e-06, qk_norm=True),
)}
MODELS = MODEL_SHAPES  # the former name, kept for notebooks and callers that read it


@dataclass(frozen=True)
class GPU:
    """One GPU's memory: the datasheet figure and the total the driver reports."""

    name: str
    datasheet_gb: float  # as printed by the vendor (JEDEC GB = 2**30 bytes)
    total_mib: int  # nvidia-smi memory.total
    memory: str
    source: str

    @property
    def total_gib(self) -> float:
        """Driver-reported total in GiB (what an engine multiplies by its utilization)."""
        return self.total_mib / 1024


# Datasheet capacity from the vendor product pages in ``source``; total_mib as nvidia-smi prints it
# on these boards (e.g. "0MiB / 81559MiB" on an H100 80GB HBM3).
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("H200", 141, 143771, "HBM3e", "https://www.nvidia.com/en-us/data-center/h200/"),
    GPU("H100", 80, 81559, "HBM3", "https://www.nvidia.com/en-us/data-center/h100/"),
    GPU("A100-80GB", 80, 81920, "HBM2e", "https://www.nvidia.com/en-us/data-center/a100/"),
    GPU("A100-40GB", 40, 40960, "HBM2", "https://www.nvidia.com/en-us/data-center/a100/"),
    # GDDR6 with ECC on (the default): the ECC bits take about 1/16 of the 48 GiB.
    GPU("L40S", 48, 46068, "GDDR6", "https://www.nvidia.com/en-us/data-center/l40s/"),
    # "1,440GB total GPU memory" for the 8 GPUs of a DGX B200.
    GPU("B200", 180, 183359, "HBM3e", "https://www.nvidia.com/en-us/data-center/dgx-b200/"),
    GPU("RTX 4090", 24, 24564, "GDDR6X",
        "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/"),
    GPU("RTX 5090", 32, 32607, "GDDR7",
        "https://www.nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/"),
)}


def _norm(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum() or c == ".")


def get_gpu(gpu: str | GPU) -> GPU:
    """Look up a GPU by name, ignoring case, spaces and dashes (``"rtx4090"``, ``"a100-80gb"``)."""
    if isinstance(gpu, GPU):
        return gpu
    if not isinstance(gpu, str):
        raise TypeError(f"gpu must be a GPU name or GPU, got {type(gpu).__name__}")
    table = {_norm(k): v for k, v in GPUS.items()}
    # also accept the name with its datasheet size appended ("H100-80GB", "H200 141GB")
    table.update({_norm(f"{k}{v.datasheet_gb:g}gb"): v for k, v in GPUS.items()})
    key = _norm(gpu)
    if key not in table:
        raise ValueError(f"gpu_memory_gib={gpu!r} is not a known GPU; known: {sorted(GPUS)} "
                         "(or pass a number of GiB)")
    return table[key]


def get_model(name: str) -> ModelShape:
    """Look up a registry model by name, ignoring case and an ``org/`` prefix
    (``"meta-llama/Llama-3.1-8B"``, ``"google/gemma-3-270m"``)."""
    if not isinstance(name, str):
        checks.fail(f"model={name!r} ({type(name).__name__}); expected a registry name among {sorted(MODEL_SHAPES)}",
                    TypeError)
    table = {k.lower(): v for k, v in MODEL_SHAPES.items()}
    key = name.lower()
    if key not in table and "/" in key:
        key = key.rsplit("/", 1)[1]
    if key not in table:
        raise ValueError(f"model={name!r} is not a known model; known: {sorted(MODEL_SHAPES)}. Pass a "
                         "ModelShape, a dict of shape fields or a path to a config.json instead")
    return table[key]


_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _dense_param_count(cfg: dict, num_layers: int, hq: int, hkv: int, d: int) -> int | None:
    """Parameter count of a dense gated-MLP decoder from its config, or None when the config
    lacks the sizes or describes a mixture of experts (whose count this formula would miss)."""
    hidden, inter, vocab = cfg.get("hidden_size"), cfg.get("intermediate_size"), cfg.get("vocab_size")
    if any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in (hidden, inter, vocab)) \
            or any(cfg.get(k) for k in _MOE_KEYS):
        return None
    tied = cfg.get("tie_word_embeddings", False)
    per_layer = (2 * hidden * hq * d  # q and o projections
                 + 2 * hidden * hkv * d  # k and v projections
                 + 3 * hidden * inter  # gate, up, down
                 + 2 * hidden)  # two RMSNorms
    return vocab * hidden * (1 if tied else 2) + num_layers * per_layer + hidden


def _config_int(cfg: dict, key: str, where: str, *, required: bool) -> int | None:
    """``cfg[key]`` as a positive int. Absent or ``null`` means "not given" (Hugging Face's own
    reading: ``num_key_value_heads: null`` is multi-head attention); required fields must be given."""
    value = cfg.get(key)
    if value is None:
        if required:
            checks.fail(f"{where}: {key} is {'null' if key in cfg else 'missing'}; expected a positive int "
                        "(a Hugging Face decoder config gives num_hidden_layers and num_attention_heads)")
        return None
    try:
        return checks.positive_int(value, key)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: {exc}") from None


def _shape_from_hf(cfg: dict, name: str, source: str = "") -> ModelShape:
    """Build a ModelShape from a Hugging Face config dict (nested ``text_config`` accepted).

    Every shape field is checked here, naming the config (``source``) and the field: a field that
    is ``null`` counts as absent, a string, float, bool or non-positive number is refused.
    """
    where = f"config {source}" if source else f"config for {name!r}"
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        # multimodal configs (Gemma 3 4B+, ...) keep the decoder under text_config
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{where} lacks {missing}; expected a Hugging Face decoder "
                         "config with num_hidden_layers and num_attention_heads")
    layers = _config_int(cfg, "num_hidden_layers", where, required=True)
    hq = _config_int(cfg, "num_attention_heads", where, required=True)
    hkv = _config_int(cfg, "num_key_value_heads", where, required=False) or hq  # absent -> multi-head
    if hq % hkv:
        raise ValueError(f"{where}: num_attention_heads={hq} is not a multiple of num_key_value_heads={hkv} "
                         "(grouped-query attention needs it)")
    hidden = _config_int(cfg, "hidden_size", where, required=False)
    d = _config_int(cfg, "head_dim", where, required=False)
    if d is None:
        if hidden is None or hidden % hq:
            raise ValueError(f"{where} has no head_dim and hidden_size={hidden!r} is not "
                             f"a multiple of num_attention_heads={hq}")
        d = hidden // hq
    max_pos = _config_int(cfg, "max_position_embeddings", where, required=False)
    tied = cfg.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise TypeError(f"{where}: tie_word_embeddings={tied!r} ({type(tied).__name__}); expected true or false")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"  # newer configs say "dtype"
    return ModelShape(name, layers, hq, hkv, d, hidden, max_pos, _dense_param_count(cfg, layers, hq, hkv, d),
                      str(dtype), source)


def load_hf_config(path: str | os.PathLike) -> ModelShape:
    """Read a Hugging Face ``config.json`` (or a folder holding one) into a ModelShape.

    Reads num_hidden_layers, num_key_value_heads (else num_attention_heads), head_dim (else
    hidden_size / num_attention_heads), max_position_embeddings and torch_dtype; num_params is
    counted for dense decoders when vocab_size and intermediate_size are present.

    Raises
    ------
    FileNotFoundError
        No such file (or no config.json in the folder).
    ValueError / TypeError
        The file is not JSON, does not hold an object, or a shape field is missing, ``0``, a
        string, a float or inconsistent (heads that do not divide); the message names the file.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
                         "expected a Hugging Face config.json") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         "expected a Hugging Face config.json") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, not an object; expected a Hugging Face "
                         "config.json")
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"
    return _shape_from_hf(cfg, name, source=path)


def resolve_model(model) -> ModelShape:
    """A ModelShape from any ``model`` argument the planner takes (see :func:`plan_capacity`)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        if "num_hidden_layers" in model or "text_config" in model:
            return _shape_from_hf(model, str(model.get("_name_or_path", "custom")))
        known = {f.name for f in fields(ModelShape)}
        extra = set(model) - known
        if extra:
            raise ValueError(f"model dict has unknown keys {sorted(extra)}; expected ModelShape fields "
                             f"{sorted(known)} or a Hugging Face config dict")
        return ModelShape(**{"name": "custom", **model})
    if isinstance(model, os.PathLike):
        return load_hf_config(model)
    if isinstance(model, str):
        # a registry name wins over a same-named folder in the working directory
        if model.lower() in {k.lower() for k in MODEL_SHAPES} or not os.path.exists(model):
            if model.endswith(".json"):
                raise ValueError(f"model={model!r}: no such config file")
            return get_model(model)
        return load_hf_config(model)
    raise TypeError(f"model must be a registry name, ModelShape, dict or config.json path, "
                    f"got {type(model).__name__}")


def _kv_dtype(kv_dtype):
    """``kv_dtype_info`` that refuses non-strings (a bool or None is not a dtype name)."""
    if not isinstance(kv_dtype, (str, torch.dtype)):
        checks.fail(f"kv_dtype={kv_dtype!r} ({type(kv_dtype).__name__}); expected a name among "
                    f"{list(KV_DTYPES)} or a torch dtype", TypeError)
    return kv_dtype_info(kv_dtype)


def plan_capacity(model, kv_dtype, kv_memory_gib=None, gpu_memory_gib=None, utilization=0.9,
                  weights_gib=None, block_size=16, max_model_len=None, granularity="tensor") -> dict:
    """Plan how many KV tokens, blocks and full-length sequences fit.

    Parameters
    ----------
    model : str | dict | ModelShape | path
        Registry name (see ``MODEL_SHAPES``), a dict of ModelShape fields or a Hugging Face config
        dict, a ModelShape, or a path to a ``config.json`` (or its folder).
    kv_dtype : str | torch.dtype
        KV element type: ``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` (or aliases).
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
        Tokens per KV block: a power of two >= 8 (:func:`fp8kv.cache.check_block_size`, the cache's rule).
    max_model_len : int, optional
        Sequence length for ``max_concurrency``; default the model's max_position_embeddings.
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
    kv_name, kv_torch_dtype, fmt = _kv_dtype(kv_dtype)
    checks.one_of(granularity, "granularity", GRANULARITIES)
    utilization = checks.real(utilization, "utilization")
    if not 0 < utilization <= 1:
        checks.fail(f"utilization={utilization}; expected a fraction in (0, 1]")
    block_size = check_block_size(block_size)  # the cache's rule: a plan for pages no cache would build is no plan
    if max_model_len is not None:
        max_model_len = checks.positive_int(max_model_len, "max_model_len")

    layers, hkv, d = shape.num_layers, shape.num_kv_heads, shape.head_dim
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
        kv_memory_gib = _memory_gib(kv_memory_gib, "kv_memory_gib")
        budget = math.floor(kv_memory_gib * GIB)
    else:
        if isinstance(gpu_memory_gib, (str, GPU)):
            gpu = get_gpu(gpu_memory_gib)
            gpu_name, gpu_memory_gib = gpu.name, gpu.total_gib
        gpu_memory_gib = _memory_gib(gpu_memory_gib, "gpu_memory_gib")
        gpu_bytes = gpu_memory_gib * GIB
        if weights_gib is not None:
            weights_gib = _memory_gib(weights_gib, "weights_gib", allow_zero=True)
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
    block_bytes = block_size * bpt
    blocks = kv_bytes // block_bytes if kv_bytes > 0 else 0
    if blocks == 0:
        raise CapacityError(f"KV memory of {budget} bytes ({fixed} of them fixed scales) holds no block "
                            f"of {block_bytes} bytes ({block_size} tokens x {bpt} bytes/token)")
    tokens = blocks * block_size

    if max_model_len is None:
        max_model_len = shape.max_position_embeddings
        if max_model_len is None:
            raise ValueError(f"model {shape.name!r} has no max_position_embeddings; pass max_model_len")

    return dict(
        model=shape.name, kv_dtype=kv_name, granularity=granularity, block_size=block_size,
        element_size=elem, num_layers=layers, num_kv_heads=hkv, head_dim=d,
        kv_data_bytes_per_token=data_bpt, scale_bytes_per_token=scale_bpt, bytes_per_token=bpt,
        fixed_scale_bytes=fixed, kv_budget_bytes=budget, kv_memory_bytes=kv_bytes,
        block_bytes=block_bytes, blocks=blocks, tokens=tokens, max_model_len=max_model_len,
        max_concurrency=tokens / max_model_len, scale_overhead_bytes=fixed + scale_bpt * tokens,
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
    rows = []
    for model in models:
        for gpu in (gpus if gpus is not None else [None]):
            for kv_dtype in kv_dtypes:
                kv_name, _, fmt = _kv_dtype(kv_dtype)
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
