"""Quantize a real model's K/V as they enter attention; capture K/V; calibrate scales.

The hook is a custom attention function registered with transformers' ``AttentionInterface``
under the name ``"fp8kv"`` (with sdpa's mask builder), which every modern transformers model
calls with ``(module, query, key, value, attention_mask, scaling, ...)``: ``key`` is after RoPE
(and after Gemma-3's k-norm), ``value`` as projected, both ``[B, Hkv, T, D]`` before GQA
expansion, exactly what a serving engine writes to its KV cache. One hook therefore covers Llama
and Gemma-3 alike (sliding windows arrive in the mask). While a handler is active the model's
attention implementation is switched to ``"fp8kv"``; on exit the previous one is restored.

What a handler does with K/V:

* :class:`KVQuantConfig` handlers store K and V the way an FP8 KV cache does
  (``fp8kv.quant.quantize``: stored = Q(x / scale), dequantized = stored x scale, see
  ``fp8kv/quant.py``) and run attention in the model's dtype on the dequantized values. Every
  query reads every key through the quantized copy, the token's own included, as in decode.
* The baseline is a bf16 KV cache: K/V rounded through bf16 (``kv_dtype="bf16"``). The model itself
  computes in fp32 on CPU because bf16 matmuls are several times slower there.
* A side that is not quantized (``quantize_k=False`` or ``quantize_v=False``) is rounded to bf16
  like the baseline, whatever ``kv_dtype`` the other side is stored in, so K-vs-V attribution
  compares against the baseline only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import checks
from ..formats import KV_DTYPE_NAMES, UNQUANTIZED_DTYPES, FP8Format, kv_dtype_info
from ..quant import GRANULARITIES, SCALE_METHODS, compute_scale, quantize
from .loading import windows

__all__ = ["KVQuantConfig", "KVStats", "CapturedKV", "quantized_kv", "run_quantized", "capture_kv",
           "calibrate_scales", "attention_handler", "ATTN_NAME", "num_layers", "layer_types",
           "attention_modules", "quantize_kv", "attention_variants", "model_attention", "one_sequence",
           "layer_entry", "check_layer_scales", "vocab_size", "check_token_ids", "check_token_id",
           "token_ids"]

ATTN_NAME = "fp8kv"

_HANDLERS: list = []  # active handlers, innermost last
_REGISTERED = False


# ------------------------------------------------------------------------ attention dispatch

def attention_variants(module, kwargs) -> dict:
    """The attention variants of one layer, in :func:`fp8kv.decode`'s terms (only those present).

    ``window``: the module's ``sliding_window`` (Gemma-2/3, Ministral: set on sliding layers only;
    transformers' mask keeps key j for query p when ``p - W < j <= p``, fp8kv's convention) or the
    ``sliding_window`` keyword the layer passes to its attention function. ``soft_cap``: the
    ``softcap`` keyword (Gemma-2 passes ``attn_logit_softcapping``). ``sinks``: the module's
    ``sinks`` parameter ``[Hq]`` (gpt-oss), as fp32.
    """
    out = {}
    window = getattr(module, "sliding_window", None) or kwargs.get("sliding_window")
    if window is not None:
        out["window"] = int(window)
    soft_cap = kwargs.get("softcap")
    if soft_cap is None:
        soft_cap = getattr(module, "attn_logit_softcapping", None)
    if soft_cap is not None:
        out["soft_cap"] = float(soft_cap)
    sinks = getattr(module, "sinks", None)
    if isinstance(sinks, torch.Tensor):
        out["sinks"] = sinks.detach().to(torch.float32).reshape(-1).contiguous()
    return out


def model_attention(module, query, key, value, attention_mask, scaling, kwargs):
    """The model's own attention (GQA, masks, sliding windows): transformers' sdpa, or the model's
    eager attention where sdpa cannot express a variant (soft-capping, sinks). Returns
    ``([B, T, Hq, D], weights or None)``."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    variants = attention_variants(module, kwargs)
    if "soft_cap" in variants or "sinks" in variants:
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=0.0,
                                          scaling=scaling, **kwargs)


def _fp8kv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function: the active handler's, or plain sdpa when none is active."""
    if not _HANDLERS:
        return model_attention(module, query, key, value, attention_mask, scaling, kwargs)
    return _HANDLERS[-1](module, query, key, value, attention_mask, scaling, kwargs)


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, _fp8kv_attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    _REGISTERED = True


def _set_attn(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError):  # older transformers: set the config field directly
        model.config._attn_implementation = name


@contextmanager
def attention_handler(model, handler):
    """Route ``model``'s attention through ``handler(module, q, k, v, mask, scaling, kwargs)``.

    q: ``[B, Hq, T, D]``; k, v: ``[B, Hkv, T, D]`` (after RoPE); the handler returns
    ``(out [B, T, Hq, D], weights or None)``. Restores the previous attention on exit.
    """
    _register()
    prev = model.config._attn_implementation
    _set_attn(model, ATTN_NAME)
    _HANDLERS.append(handler)
    try:
        yield handler
    finally:
        _HANDLERS.remove(handler)
        _set_attn(model, prev)


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def num_layers(model) -> int:
    """Number of decoder layers (= KV caches) of ``model``."""
    return int(_text_config(model).num_hidden_layers)


def layer_types(model) -> list[str]:
    """Per layer ``"full_attention"`` or ``"sliding_attention"``."""
    cfg = _text_config(model)
    types = getattr(cfg, "layer_types", None)
    return list(types) if types else ["full_attention"] * num_layers(model)


def attention_modules(model) -> list:
    """The attention modules in layer order (those with ``layer_idx`` and ``k_proj``)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    return sorted(mods, key=lambda m: m.layer_idx)


def vocab_size(model) -> int | None:
    """How many token ids ``model`` embeds: its input embedding's ``num_embeddings`` (what an id
    indexes), else the config's ``vocab_size``; None when neither is known."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    if n is None:
        n = getattr(_text_config(model), "vocab_size", None)
    return None if n is None else int(n)


def check_token_ids(ids: torch.Tensor, name: str, model) -> torch.Tensor:
    """Refuse an integer id tensor with an id outside ``model``'s vocabulary ``[0, V)`` by name,
    naming the first bad id and V (a host sync). The embedding would otherwise fail with a bare
    IndexError (on CPU) or a device-side assert (on CUDA)."""
    n = vocab_size(model)
    if n is None or ids.numel() == 0:
        return ids
    bad = (ids < 0) | (ids >= n)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        at = idx[0] if len(idx) == 1 else idx
        raise ValueError(f"{name} has {int(bad.sum())} token id(s) outside the model's vocabulary of {n} "
                         f"(ids 0..{n - 1}); the first is {int(ids[idx])} at index {at}")
    return ids


def token_ids(tokens, name: str, model) -> torch.Tensor:
    """1-D integer token ids (a tensor or list) within ``model``'s vocabulary, as int64 ``[N]``, by name.
    Float ids are refused rather than truncated."""
    ids = torch.as_tensor(tokens)
    if ids.ndim != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be 1-D int64 [N]; got {ids.dtype} of shape {tuple(ids.shape)}")
    return check_token_ids(ids, name, model).to(torch.int64)


def check_token_id(value, name: str, model) -> int:
    """One token id (an int, e.g. ``bos_token_id``) within ``model``'s vocabulary, by name."""
    value = checks.integer(value, name)
    n = vocab_size(model)
    if n is not None and not 0 <= value < n:
        raise ValueError(f"{name}={value} is outside the model's vocabulary of {n} (ids 0..{n - 1})")
    return value


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype).to(x.dtype)


# --------------------------------------------------------------------------------- configs

def _check_scale(value, name):
    if value is None or (isinstance(value, str) and value in SCALE_METHODS):
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be positive and finite")
        return
    if isinstance(value, torch.Tensor) or (isinstance(value, Sequence) and not isinstance(value, str)):
        return
    raise ValueError(f"{name}={value!r} is not a scale; expected None, one of {SCALE_METHODS}, a positive "
                     "float, a tensor, or a per-layer list of those")


def _is_per_layer(spec) -> bool:
    return isinstance(spec, Sequence) and not isinstance(spec, str)


def layer_entry(spec, name: str, layer: int, n_layers: int | None = None):
    """``spec``'s value at ``layer``: ``spec`` itself, or ``spec[layer]`` when it is a per-layer list/tuple.

    A per-layer list holds one entry per layer: ValueError naming ``name`` when it has none for
    ``layer`` or, given the model's ``n_layers`` (at an entry point), when its length differs (a
    list calibrated on another model would otherwise fail mid-run, or silently use its first entries).
    """
    if not _is_per_layer(spec):
        return spec
    if layer >= len(spec) or (n_layers is not None and len(spec) != n_layers):
        has = f"the model has {n_layers} layers" if n_layers is not None else f"layer {layer} was asked for"
        raise ValueError(f"{name} has {len(spec)} per-layer entries but {has}; expected one entry per layer "
                         "(e.g. calibrate_scales on this model)")
    return spec[layer]


def check_layer_scales(model, **specs) -> None:
    """Check, once where they enter, that each per-layer scale list in ``specs`` (by argument name)
    holds one entry per layer of ``model``; other specs pass."""
    n = num_layers(model)
    for name, spec in specs.items():
        layer_entry(spec, name, 0, n)


def _describe_scale(value) -> str:
    if value is None:
        return "amax"
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return f"{value:g}"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "per-layer"


# What a simulated cache may store: the package's KV dtypes, and fp32 (an exact cache).
KV_CONFIG_DTYPES = (*KV_DTYPE_NAMES, "fp32")


@dataclass
class KVQuantConfig:
    """How K and V are stored in the simulated KV cache.

    Parameters
    ----------
    name : label used in result tables (default: built from the fields).
    kv_dtype : the cache's element type, named as everywhere in fp8kv (``"fp8_e4m3"``, ``"fp8_e5m2"``,
        ``"bf16"``, ``"fp16"``; the aliases of :func:`fp8kv.formats.kv_dtype_info`, such as ``"e4m3"``, are
        normalised), or ``"fp32"`` for an exact cache. 16/32-bit caches round K/V through that dtype.
    granularity : ``"tensor"``, ``"head"``, ``"token_head"`` or ``"channel"`` (see ``fp8kv.quant``).
    k_scale, v_scale : how the scale is found, per layer: ``None``/``"amax"`` (from the K/V of the
        current forward: the best static scale in hindsight), ``"percentile"``, ``"vllm_k"``,
        ``"vllm_v"``, a positive float (e.g. 1.0, the engines' default without checkpoint scales),
        a tensor of the granularity's scale shape, or a per-layer list of floats/tensors (e.g. from
        :func:`calibrate_scales`).
    scale_factor : multiplies whatever scale is found (``1/64`` makes most values saturate).
    quantize_k, quantize_v : store that side in ``kv_dtype`` (otherwise it is rounded to bf16, the
        baseline, whatever ``kv_dtype`` is: ``kv_dtype="fp16", quantize_k=False`` stores V in fp16 and K
        in bf16, labelled ``"fp16 V only"``). Bools.
    percentile : for ``"percentile"`` scales.
    """

    name: str | None = None
    kv_dtype: str = "fp8_e4m3"
    granularity: str = "tensor"
    k_scale: object = "amax"
    v_scale: object = "amax"
    scale_factor: float = 1.0
    quantize_k: bool = True
    quantize_v: bool = True
    percentile: float = 99.9

    def __post_init__(self):
        if not isinstance(self.kv_dtype, str):
            raise TypeError(f"kv_dtype={self.kv_dtype!r} ({type(self.kv_dtype).__name__}); expected a name among "
                            f"{KV_CONFIG_DTYPES}")
        if self.kv_dtype not in UNQUANTIZED_DTYPES:
            try:
                self.kv_dtype = kv_dtype_info(self.kv_dtype)[0]
            except ValueError:
                raise ValueError(f"kv_dtype={self.kv_dtype!r}; expected one of {KV_CONFIG_DTYPES}") from None
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r}; expected one of {GRANULARITIES}")
        _check_scale(self.k_scale, "k_scale")
        _check_scale(self.v_scale, "v_scale")
        for flag in ("quantize_k", "quantize_v"):  # "no" or 0.0 would otherwise be read as truthy or falsy
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag}={getattr(self, flag)!r} ({type(getattr(self, flag)).__name__}); "
                                "expected True or False")
        if not (isinstance(self.scale_factor, (int, float)) and math.isfinite(self.scale_factor)
                and self.scale_factor > 0):
            raise ValueError(f"scale_factor={self.scale_factor!r} must be a positive finite number")

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype not in UNQUANTIZED_DTYPES

    @property
    def fp8_format(self) -> FP8Format | None:
        """The FP8 format K/V are stored in (None for a 16/32-bit cache)."""
        return kv_dtype_info(self.kv_dtype)[2] if self.is_fp8 else None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        # Results are keyed by label, so every field that changes what is computed shows in it: the
        # quantize flags too for a 16/32-bit cache (its other side is bf16: "fp16 V only" is not "fp16").
        if not self.is_fp8:
            parts = [self.kv_dtype]
        else:
            parts = [self.fp8_format.name, self.granularity, f"k={_describe_scale(self.k_scale)}",
                     f"v={_describe_scale(self.v_scale)}"]
            if self.scale_factor != 1.0:
                parts.append(f"x{self.scale_factor:g}")
        if not self.quantize_k:
            parts.append("V only")
        if not self.quantize_v:
            parts.append("K only")
        return " ".join(parts)

    def describe(self) -> dict:
        """The configuration as plain columns for result tables."""
        return dict(config=self.label, kv_dtype=self.kv_dtype, granularity=self.granularity if self.is_fp8 else "-",
                    k_scale=_describe_scale(self.k_scale) if self.is_fp8 else "-",
                    v_scale=_describe_scale(self.v_scale) if self.is_fp8 else "-",
                    scale_factor=self.scale_factor, quantize_k=self.quantize_k, quantize_v=self.quantize_v)

    def layer_scale(self, which: str, layer: int):
        """The scale spec of K (``which="k"``) or V at ``layer``: a method name or a fixed value."""
        spec = self.k_scale if which == "k" else self.v_scale
        spec = "amax" if spec is None else spec
        return layer_entry(spec, f"{which}_scale", layer)


BASELINE = KVQuantConfig(name="bf16", kv_dtype="bf16")


def quantize_kv(x: torch.Tensor, cfg: KVQuantConfig, which: str, layer: int):
    """Store-and-load one layer's K or V through the configured cache.

    x : ``[B, H, T, D]`` (transformers' layout). Returns ``(x_dequantized like x, info)`` where
    info holds saturated / underflow / numel / scale (mean) / amax of this call.
    """
    quantize_side = cfg.quantize_k if which == "k" else cfg.quantize_v
    amax = float(x.detach().abs().amax()) if x.numel() else 0.0
    info = dict(saturated=0, underflow=0, numel=x.numel(), scale=float("nan"), amax=amax)
    if not quantize_side:  # the baseline's bf16, for a 16/32-bit kv_dtype too (as documented)
        return _round(x, torch.bfloat16), info
    if not cfg.is_fp8:
        return _round(x, UNQUANTIZED_DTYPES[cfg.kv_dtype]), info
    xt = x.transpose(1, 2)  # [B, T, H, D]: leading dims are tokens, as fp8kv.quant expects
    spec = cfg.layer_scale(which, layer)
    if isinstance(spec, str):
        s = compute_scale(xt, cfg.fp8_format, cfg.granularity, spec, cfg.percentile)
    else:
        s = torch.as_tensor(spec, dtype=torch.float32, device=x.device)
    if cfg.scale_factor != 1.0:
        s = s * cfg.scale_factor
    q = quantize(xt, cfg.fp8_format, cfg.granularity, scale=s, percentile=cfg.percentile)
    info.update(saturated=q.saturated, underflow=q.underflow, scale=float(q.scale.mean()))
    return q.dequantize(torch.float32).to(x.dtype).transpose(1, 2), info


# ----------------------------------------------------------------------------------- stats

_COUNTERS = ("k_saturated", "k_underflow", "k_numel", "v_saturated", "v_underflow", "v_numel",
             "err_num2", "err_den2", "calls")


class KVStats:
    """Per-layer counts accumulated over every forward run under one handler.

    ``frame()`` gives one row per layer: saturated / underflow counts and fractions for K and V,
    mean scale and max |x| seen, and ``attn_rel_err``: ``||o_q - o_ref|| / ||o_ref||`` of the
    attention output computed from the quantized K/V vs from bf16 K/V, *same inputs* (the local
    error of that layer's cache, before it propagates), over all tokens and forwards.
    """

    def __init__(self, n_layers: int, types: list[str] | None = None):
        self.n_layers = n_layers
        self.types = types or ["full_attention"] * n_layers
        self.count = {c: [0.0] * n_layers for c in _COUNTERS}
        self.k_scale = [[] for _ in range(n_layers)]
        self.v_scale = [[] for _ in range(n_layers)]
        self.k_amax = [0.0] * n_layers
        self.v_amax = [0.0] * n_layers

    def add(self, layer: int, k_info: dict, v_info: dict, err_num2: float = 0.0, err_den2: float = 0.0):
        c = self.count
        for side, info in (("k", k_info), ("v", v_info)):
            c[f"{side}_saturated"][layer] += info["saturated"]
            c[f"{side}_underflow"][layer] += info["underflow"]
            c[f"{side}_numel"][layer] += info["numel"]
            (self.k_scale if side == "k" else self.v_scale)[layer].append(info["scale"])
        self.k_amax[layer] = max(self.k_amax[layer], k_info["amax"])
        self.v_amax[layer] = max(self.v_amax[layer], v_info["amax"])
        c["err_num2"][layer] += err_num2
        c["err_den2"][layer] += err_den2
        c["calls"][layer] += 1

    def total(self, name: str) -> int:
        return int(sum(self.count[name]))

    def frame(self):
        import pandas as pd

        c = self.count
        rows = []
        for i in range(self.n_layers):
            kn, vn = max(1, c["k_numel"][i]), max(1, c["v_numel"][i])
            den = c["err_den2"][i]
            rows.append(dict(
                layer=i, layer_type=self.types[i],
                k_saturated=int(c["k_saturated"][i]), v_saturated=int(c["v_saturated"][i]),
                k_underflow=int(c["k_underflow"][i]), v_underflow=int(c["v_underflow"][i]),
                k_sat_frac=c["k_saturated"][i] / kn, v_sat_frac=c["v_saturated"][i] / vn,
                k_underflow_frac=c["k_underflow"][i] / kn, v_underflow_frac=c["v_underflow"][i] / vn,
                k_scale=_nanmean(self.k_scale[i]), v_scale=_nanmean(self.v_scale[i]),
                k_amax=self.k_amax[i], v_amax=self.v_amax[i],
                attn_rel_err=math.sqrt(c["err_num2"][i] / den) if den > 0 else 0.0,
            ))
        return pd.DataFrame(rows)


def _nanmean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


class _QuantHandler:
    def __init__(self, cfg: KVQuantConfig, stats: KVStats, measure_error: bool):
        self.cfg, self.stats, self.measure_error = cfg, stats, measure_error

    def __call__(self, module, q, k, v, mask, scaling, kwargs):
        layer = module.layer_idx
        kq, k_info = quantize_kv(k, self.cfg, "k", layer)
        vq, v_info = quantize_kv(v, self.cfg, "v", layer)
        out, w = model_attention(module, q, kq, vq, mask, scaling, kwargs)
        num2 = den2 = 0.0
        if self.measure_error:
            ref, _ = model_attention(module, q, _round(k, torch.bfloat16), _round(v, torch.bfloat16), mask, scaling,
                                     kwargs)
            ref64 = ref.detach().to(torch.float64)
            num2 = float((out.detach().to(torch.float64) - ref64).pow(2).sum())
            den2 = float(ref64.pow(2).sum())
        self.stats.add(layer, k_info, v_info, num2, den2)
        return out, w


@contextmanager
def quantized_kv(model, cfg: KVQuantConfig, *, measure_error: bool = True, stats: KVStats | None = None):
    """Run ``model`` with its K/V stored as ``cfg`` says, inside a ``with`` block.

    Yields a :class:`KVStats` that accumulates per-layer counts over every forward in the block
    (pass ``stats`` to keep accumulating into an existing one). ``measure_error`` also computes
    each layer's attention with bf16 K/V to report the local attention-output error (about twice
    the attention cost).
    """
    if not isinstance(cfg, KVQuantConfig):
        raise TypeError(f"cfg must be a KVQuantConfig, got {type(cfg).__name__}")
    check_layer_scales(model, k_scale=cfg.k_scale, v_scale=cfg.v_scale)  # the config meets the model here
    stats = stats if stats is not None else KVStats(num_layers(model), layer_types(model))
    with attention_handler(model, _QuantHandler(cfg, stats, measure_error)):
        yield stats


def one_sequence(input_ids, model, name: str = "input_ids") -> torch.Tensor:
    """Token ids of one sequence (``[T]`` or ``[1, T]``, int32/int64, within the model's vocabulary)
    as int64 ``[1, T]`` on the model's device; errors name the argument ``name``."""
    ids = torch.as_tensor(input_ids)
    if ids.dtype not in (torch.int64, torch.int32) or ids.ndim not in (1, 2):
        raise ValueError(f"{name} must be int64 [T] or [1, T]; got {ids.dtype} of shape {tuple(ids.shape)}")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"{name} must hold one sequence ([T] or [1, T]); got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty")
    check_token_ids(ids, name, model)
    return ids.reshape(1, -1).to(torch.int64).to(model.device)


@torch.no_grad()
def run_quantized(model, input_ids, cfg: KVQuantConfig = BASELINE, *, measure_error: bool = False):
    """One forward with K/V stored per ``cfg``. Returns (logits fp32 ``[T, vocab]``, :class:`KVStats`)."""
    ids = one_sequence(input_ids, model)
    with quantized_kv(model, cfg, measure_error=measure_error) as stats:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return logits, stats


# --------------------------------------------------------------------------------- capture

@dataclass
class CapturedKV:
    """Real activations of one forward, per layer, batch dim dropped.

    ``k``: after RoPE ``[T, Hkv, D]`` (what a KV cache stores); ``k_pre_rope``: before RoPE (after
    Gemma-3's k-norm) ``[T, Hkv, D]``; ``v``: ``[T, Hkv, D]``; ``q``: after RoPE ``[T, Hq, D]``
    (real decode queries). ``sm_scale`` per layer; ``layer_types`` per layer. Model dtype and device.
    """

    k: list
    k_pre_rope: list
    v: list
    q: list
    sm_scale: list
    layer_types: list

    @property
    def n_layers(self) -> int:
        return len(self.k)


class _CaptureHandler:
    def __init__(self, n):
        self.k, self.v, self.q, self.sm_scale = [None] * n, [None] * n, [None] * n, [None] * n

    def __call__(self, module, q, k, v, mask, scaling, kwargs):
        i = module.layer_idx
        self.k[i] = k[0].transpose(0, 1).detach().clone()
        self.v[i] = v[0].transpose(0, 1).detach().clone()
        self.q[i] = q[0].transpose(0, 1).detach().clone()
        self.sm_scale[i] = checks.resolved_softmax_scale(None if scaling is None else float(scaling), q.shape[-1])
        return model_attention(module, q, k, v, mask, scaling, kwargs)


@torch.no_grad()
def capture_kv(model, input_ids) -> CapturedKV:
    """Capture per-layer K (after and before RoPE), V and Q of one forward of ``input_ids`` ([T] or [1, T])."""
    return _capture(model, one_sequence(input_ids, model))


def _capture(model, ids: torch.Tensor) -> CapturedKV:
    """:func:`capture_kv` of checked ids (int64 ``[1, T]`` on the model's device)."""
    n = num_layers(model)
    pre = [None] * n
    hooks = []
    for m in attention_modules(model):
        # Gemma-3 normalizes keys (k_norm, [B, Hkv, T, D]) before RoPE; Llama goes straight from k_proj
        # ([B, T, Hkv*D]) to RoPE. Either output is the pre-RoPE key.
        sub = m.k_norm if getattr(m, "k_norm", None) is not None else m.k_proj

        def hook(_mod, _inp, out, i=m.layer_idx, d=m.head_dim):
            x = out[0].transpose(0, 1) if out.ndim == 4 else out[0].reshape(out.shape[1], -1, d)
            pre[i] = x.detach().clone()

        hooks.append(sub.register_forward_hook(hook))
    handler = _CaptureHandler(n)
    try:
        with attention_handler(model, handler):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return CapturedKV(handler.k, pre, handler.v, handler.q, handler.sm_scale, layer_types(model))


@torch.no_grad()
def calibrate_scales(model, calibration_ids, cfg: KVQuantConfig | None = None, *, window: int = 512,
                     bos_token_id: int | None = None):
    """Per-layer static K and V scales from a held-out text, as a calibration pass would produce.

    Runs the unquantized model on ``calibration_ids`` (1-D, split into windows of ``window``) and
    derives each layer's scale from all its K (V) values with ``cfg``'s method (``cfg.k_scale`` /
    ``cfg.v_scale`` when they name a method, else amax), format and granularity. BOS positions are
    included (a serving engine stores them too).

    Returns
    -------
    (k_scales, v_scales) : lists of ``num_layers`` fp32 tensors shaped per granularity ([] for
    tensor, [Hkv] head, [Hkv, D] channel); pass them as ``KVQuantConfig(k_scale=k_scales, ...)``.
    """
    cfg = cfg or KVQuantConfig()
    if not cfg.is_fp8:
        raise ValueError(f"cfg.kv_dtype={cfg.kv_dtype!r}: calibration derives FP8 scales; use an FP8 kv_dtype "
                         f"such as 'fp8_e4m3'")
    if cfg.granularity == "token_head":
        raise ValueError("granularity='token_head' computes scales per token at write time; nothing to calibrate")
    # Ids checked once here (the model's vocabulary included), not again per window.
    ids = token_ids(calibration_ids, "calibration_ids", model)
    if bos_token_id is not None:
        bos_token_id = check_token_id(bos_token_id, "bos_token_id", model)
    chunk = windows(ids, min(window, ids.numel()), None, bos_token_id)
    ks, vs = [[] for _ in range(num_layers(model))], [[] for _ in range(num_layers(model))]
    for w in chunk:
        cap = _capture(model, w[None].to(model.device))
        for i in range(cap.n_layers):
            ks[i].append(cap.k[i].float())
            vs[i].append(cap.v[i].float())

    def method(spec, default):
        return spec if isinstance(spec, str) else default

    km, vm = method(cfg.k_scale, "amax"), method(cfg.v_scale, "amax")
    k_scales = [compute_scale(torch.cat(x), cfg.fp8_format, cfg.granularity, km, cfg.percentile) for x in ks]
    v_scales = [compute_scale(torch.cat(x), cfg.fp8_format, cfg.granularity, vm, cfg.percentile) for x in vs]
    return k_scales, v_scales
