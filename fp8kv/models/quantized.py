"""A model run with its K/V stored as a :class:`~fp8kv.models.kv_config.KVQuantConfig` says
(:func:`quantized_kv`, :func:`run_quantized`), and the per-layer counts of such runs (:class:`KVStats`)."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from .attention import attention_handler, model_attention
from .introspect import layer_types, num_layers, one_sequence
from .kv_config import BASELINE, KVQuantConfig, check_config_layers, quantize_kv, round_through

__all__ = ["KVStats", "quantized_kv", "run_quantized"]

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
            ref, _ = model_attention(module, q, round_through(k, torch.bfloat16), round_through(v, torch.bfloat16), mask, scaling,
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
    check_config_layers(model, cfg, named=False)  # the config meets the model here
    stats = stats if stats is not None else KVStats(num_layers(model), layer_types(model))
    with attention_handler(model, _QuantHandler(cfg, stats, measure_error)):
        yield stats


@torch.no_grad()
def run_quantized(model, input_ids, cfg: KVQuantConfig = BASELINE, *, measure_error: bool = False):
    """One forward with K/V stored per ``cfg``. Returns (logits fp32 ``[T, vocab]``, :class:`KVStats`)."""
    ids = one_sequence(input_ids, model)
    with quantized_kv(model, cfg, measure_error=measure_error) as stats:
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return logits, stats
