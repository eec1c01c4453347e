"""How a simulated KV cache stores K and V (:class:`KVQuantConfig`: dtype, granularity, scales per layer) and
one layer's K or V stored and loaded through it (:func:`quantize_kv`)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import checks
from ..formats import KV_DTYPE_NAMES, UNQUANTIZED_DTYPES, FP8Format, kv_dtype_info
from ..kv_formats import kv_format
from ..kv_formats import quantize as format_quantize
from ..quant import GRANULARITIES, SCALE_METHODS, check_percentile, compute_scale, quantize
from .introspect import num_layers

__all__ = ["KV_CONFIG_DTYPES", "KVQuantConfig", "BASELINE", "quantize_kv", "round_through", "layer_entry",
           "check_layer_scales", "check_config_layers", "KV_SIDES"]


def round_through(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded through ``dtype`` and back (a cache of that dtype stores and loads it so)."""
    return x if x.dtype == dtype else x.to(dtype).to(x.dtype)


def _check_scale(value, name):
    if value is None or (isinstance(value, str) and value in SCALE_METHODS):
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r} must be positive and finite")
        return
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, Sequence) and not isinstance(value, str):
        for i, entry in enumerate(value):  # each layer's, named by its index (it failed later, unnamed)
            if isinstance(entry, str):
                checks.one_of(entry, f"{name}[{i}]", SCALE_METHODS)
            else:
                checks.positive_fp32(entry, f"{name}[{i}]", expected=f"one of {SCALE_METHODS}, a positive float "
                                     "or a tensor of positive scales")
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
    layer = checks.integer(layer, "layer", minimum=0)  # -1 would take the last entry
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


def check_config_layers(model, cfg: KVQuantConfig, *, named: bool = True) -> None:
    """A config's per-layer scales and 16-bit layers against ``model``'s layers, once where they enter; the
    messages name the config by its label with ``named`` (where several are compared)."""
    of = f" of config {cfg.label!r}" if named else ""
    check_layer_scales(model, **{f"k_scale{of}": cfg.k_scale, f"v_scale{of}": cfg.v_scale})
    n = num_layers(model)
    if cfg.bf16_layers and cfg.bf16_layers[-1] >= n:
        raise ValueError(f"bf16_layers={list(cfg.bf16_layers)}{of}: the model has {n} layers (0..{n - 1})")


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


KV_SIDES = ("k", "v")  # which side of the cache quantize_kv stores

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
    bf16_layers : layers whose K and V stay 16-bit (rounded to bf16, the baseline): vLLM's
        ``--kv-cache-dtype-skip-layers``, the advice of :func:`fp8kv.analysis.keep_bf16_advice`.
    fmt : a storage format of :mod:`fp8kv.kv_formats` (``"int8_token_head"``, ``"int4_token_head"``,
        ``"kivi4_g32"``, ``"nvfp4"``, ``"mxfp4"``, ...: :data:`~fp8kv.kv_formats.KV_FORMAT_NAMES`) instead of
        ``kv_dtype``: K and V go through :func:`fp8kv.kv_formats.quantize` with the format's own scales
        (``kv_dtype``, ``granularity`` and the scale fields are then not used). Token-local scales are those
        of each token as it enters the cache; NVFP4's tensor scale comes from the forward's K (V), as
        ``"amax"`` FP8 scales do; KIVI's keys are quantized in whole groups of G tokens, the last partial
        group kept in bf16 (KIVI's full-precision residual).
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
    fmt: str | None = None
    bf16_layers: tuple[int, ...] = ()

    def __post_init__(self):
        try:
            layers = list(self.bf16_layers)
        except TypeError:
            raise TypeError(f"bf16_layers={self.bf16_layers!r}; expected layer indices (ints >= 0)") from None
        if any(isinstance(x, bool) or not isinstance(x, numbers.Integral) for x in layers):
            raise TypeError(f"bf16_layers={self.bf16_layers!r}; expected layer indices (ints >= 0)")
        if any(x < 0 for x in layers):
            raise ValueError(f"bf16_layers={self.bf16_layers!r}; expected layer indices (ints >= 0)")
        self.bf16_layers = tuple(sorted({int(x) for x in layers}))
        if self.fmt is not None:
            self.fmt = kv_format(self.fmt).name  # TypeError / ValueError naming fmt and the formats
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
        self.scale_factor = checks.positive_float(self.scale_factor, "scale_factor")
        if self.scale_factor != 1.0 and (self.fmt is not None or not self.is_fp8):  # it would do nothing
            uses = f"fmt={self.fmt!r} (the format's own scales)" if self.fmt is not None else \
                f"kv_dtype={self.kv_dtype!r} (no scales)"
            raise ValueError(f"scale_factor={self.scale_factor:g} has no effect with {uses}; it multiplies the "
                             "scales of an FP8 kv_dtype without fmt: leave it at 1.0")
        self.percentile = check_percentile(self.percentile)

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
        if self.fmt is not None:
            return " ".join([self.fmt] + (["V only"] if not self.quantize_k else []) +
                            (["K only"] if not self.quantize_v else [])) + self._bf16_label()
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
        return " ".join(parts) + self._bf16_label()

    def _bf16_label(self) -> str:
        return f" bf16 layers {','.join(str(x) for x in self.bf16_layers)}" if self.bf16_layers else ""

    def describe(self) -> dict:
        """The configuration as plain columns for result tables."""
        if self.fmt is not None:
            return dict(config=self.label, kv_dtype=self.fmt, granularity="-", k_scale="-", v_scale="-",
                        scale_factor=self.scale_factor, quantize_k=self.quantize_k, quantize_v=self.quantize_v)
        return dict(config=self.label, kv_dtype=self.kv_dtype, granularity=self.granularity if self.is_fp8 else "-",
                    k_scale=_describe_scale(self.k_scale) if self.is_fp8 else "-",
                    v_scale=_describe_scale(self.v_scale) if self.is_fp8 else "-",
                    scale_factor=self.scale_factor, quantize_k=self.quantize_k, quantize_v=self.quantize_v)

    def layer_scale(self, which: str, layer: int):
        """The scale spec of K (``which="k"``) or V (``"v"``) at ``layer``: a method name or a fixed value."""
        checks.one_of(which, "which", KV_SIDES)
        spec = self.k_scale if which == "k" else self.v_scale
        spec = "amax" if spec is None else spec
        return layer_entry(spec, f"{which}_scale", layer)


BASELINE = KVQuantConfig(name="bf16", kv_dtype="bf16")


def quantize_kv(x: torch.Tensor, cfg: KVQuantConfig, which: str, layer: int):
    """Store-and-load one layer's K or V through the configured cache.

    x : ``[B, H, T, D]`` (transformers' layout). Returns ``(x_dequantized like x, info)`` where
    info holds saturated / underflow / numel / scale (mean) / amax of this call. ``which`` is ``"k"`` or
    ``"v"`` (lower case), ``layer`` an int >= 0 (below the length of a per-layer scale list).
    """
    checks.tensor(x, "x", ndim=4, dtypes=checks.FLOAT_DTYPES, shape_hint="[batch, heads, tokens, head_dim]")
    checks.one_of(which, "which", KV_SIDES)  # "K" would otherwise be read as V
    layer = checks.integer(layer, "layer", minimum=0)
    if not isinstance(cfg, KVQuantConfig):
        checks.fail(f"cfg={checks.show_value(cfg)} ({type(cfg).__name__}); expected a KVQuantConfig", TypeError)
    quantize_side = cfg.quantize_k if which == "k" else cfg.quantize_v
    amax = float(x.detach().abs().amax()) if x.numel() else 0.0
    info = dict(saturated=0, underflow=0, numel=x.numel(), scale=float("nan"), amax=amax)
    if not quantize_side or layer in cfg.bf16_layers:  # the baseline's bf16, for a 16/32-bit kv_dtype too
        return round_through(x, torch.bfloat16), info
    if cfg.fmt is not None:
        return _through_format(x, cfg, which, info)
    if not cfg.is_fp8:
        return round_through(x, UNQUANTIZED_DTYPES[cfg.kv_dtype]), info
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


def _through_format(x: torch.Tensor, cfg: KVQuantConfig, which: str, info: dict):
    """:func:`quantize_kv` of a kv_formats format: ``x`` ``[B, H, T, D]`` quantized per the format's K or V codec
    and dequantized (tokens in whole groups where its scales span tokens; the rest rounded to bf16)."""
    f = kv_format(cfg.fmt)
    codec = f.key if which == "k" else f.value
    xt = x.detach().transpose(1, 2).float()  # [B, T, H, D]: leading dims are tokens
    n = xt.shape[1] // codec.block * codec.block if codec.scaling == "channel_group" else xt.shape[1]
    out = round_through(xt, torch.bfloat16)  # KIVI's residual: tokens of a group not yet full
    if n:
        enc = format_quantize(xt[:, :n].contiguous(), codec)
        out[:, :n] = enc.dequantize()
        info.update(saturated=enc.saturated, underflow=enc.underflow, scale=float(enc.scales.float().mean()))
    return out.to(x.dtype).transpose(1, 2), info
