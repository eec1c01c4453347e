"""The models and GPUs the capacity planner (:mod:`fp8kv.capacity`) knows, and the reader of a Hugging Face
``config.json`` into a model's shape: :class:`ModelShape` and its registry :data:`MODEL_SHAPES`, :class:`GPU` and
:data:`GPUS` (their memory sizes as the driver reports them: see :mod:`fp8kv.capacity`), the lookups
:func:`get_model` / :func:`get_gpu`, :func:`load_hf_config` and :func:`resolve_model` (any model argument the
planner takes). Every name is also importable from :mod:`fp8kv.capacity`."""

from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, dataclass, fields

from fp8kv import checks

__all__ = ["ModelShape", "MODEL_SHAPES", "MODELS", "GPU", "GPUS", "get_model", "get_gpu", "resolve_model",
           "load_hf_config"]


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
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"ModelShape name={self.name!r} ({type(self.name).__name__}); expected a non-empty str")
        for f in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelShape {self.name!r}: {f}={v!r} must be a positive int")
        for f in ("hidden_size", "max_position_embeddings", "num_params", "intermediate_size", "vocab_size"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"ModelShape {self.name!r}: {f}={v!r} must be a positive int or None")
        for f in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"ModelShape {self.name!r}: {f}={v!r} must be a finite number > 0 or None")
        for f in ("tie_word_embeddings", "qk_norm"):
            v = getattr(self, f)
            if not isinstance(v, bool):
                raise TypeError(f"ModelShape {self.name!r}: {f}={v!r} ({type(v).__name__}); expected True or False")
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
    for key in ("intermediate_size", "vocab_size"):  # a bad one is named, not read as absent (no num_params)
        _config_int(cfg, key, where, required=False)
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
    except IsADirectoryError:  # e.g. a folder whose config.json is itself a folder
        raise ValueError(f"{path} is a folder, not a file; expected a Hugging Face config.json") from None
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
            return _shape_from_hf(model, str(model.get("_name_or_path") or "custom"))  # "" for a config built in code
        known = {f.name for f in fields(ModelShape)}
        extra = set(model) - known
        if extra:
            raise ValueError(f"model dict has unknown keys {sorted(extra)}; expected ModelShape fields "
                             f"{sorted(known)} or a Hugging Face config dict")
        required = [f.name for f in fields(ModelShape) if f.default is MISSING and f.default_factory is MISSING
                    and f.name != "name"]
        missing = [k for k in required if k not in model]
        if missing:  # else a bare "__init__() missing ... arguments"
            raise ValueError(f"model dict lacks ModelShape fields {missing}; it needs {required} (or pass a "
                             "Hugging Face config dict)")
        return ModelShape(**{"name": "custom", **model})
    if isinstance(model, str) and (model.lower() in {k.lower() for k in MODEL_SHAPES} or not os.path.exists(model)):
        # a registry name wins over a same-named folder in the working directory
        if model.endswith(".json"):
            raise ValueError(f"model={model!r}: no such config file")
        return get_model(model)
    if isinstance(model, (str, os.PathLike)):
        try:
            return load_hf_config(model)
        except FileNotFoundError as exc:  # a folder without config.json: the argument named, as any bad model is
            raise ValueError(f"model={os.fspath(model)!r}: no {exc.filename} (expected a Hugging Face config.json or "
                             "a folder holding one, or a registry name)") from None
    raise TypeError(f"model must be a registry name, ModelShape, dict or config.json path, "
                    f"got {type(model).__name__}")
