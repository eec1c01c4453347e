"""Real activations of a model's forward (:func:`capture_kv`: per layer K before and after RoPE, V and Q) and
per-layer static scales calibrated from them (:func:`calibrate_scales`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import checks
from ..quant import compute_scale
from .attention import attention_handler, model_attention
from .introspect import (
    attention_modules,
    check_positions,
    check_token_id,
    layer_types,
    num_layers,
    one_sequence,
    token_ids,
)
from .kv_config import KVQuantConfig
from .loading import windows

__all__ = ["CapturedKV", "capture_kv", "calibrate_scales"]


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
    if cfg is None:
        cfg = KVQuantConfig()
    elif not isinstance(cfg, KVQuantConfig):
        checks.fail(f"cfg={checks.show_value(cfg)} ({type(cfg).__name__}); expected a KVQuantConfig or None",
                    TypeError)
    if cfg.fmt is not None:  # the format's scales are its own, found as each token is written
        raise ValueError(f"cfg.fmt={cfg.fmt!r}: calibration derives FP8 scales, and a kv_formats format finds its "
                         "own; pass a config without fmt (an FP8 kv_dtype such as 'fp8_e4m3')")
    if not cfg.is_fp8:
        raise ValueError(f"cfg.kv_dtype={cfg.kv_dtype!r}: calibration derives FP8 scales; use an FP8 kv_dtype "
                         f"such as 'fp8_e4m3'")
    if cfg.granularity == "token_head":
        raise ValueError("granularity='token_head' computes scales per token at write time; nothing to calibrate")
    # Ids checked once here (the model's vocabulary included), not again per window.
    ids = token_ids(calibration_ids, "calibration_ids", model)
    if ids.numel() < 2:  # windows() would name its window, cut to the ids' length
        raise ValueError(f"calibration_ids has {ids.numel()} token(s); expected at least 2 (one window of 2 or more)")
    window = checks.integer(window, "window", minimum=2)
    if bos_token_id is not None:
        bos_token_id = check_token_id(bos_token_id, "bos_token_id", model)
    chunk = windows(ids, min(window, ids.numel()), None, bos_token_id)
    check_positions(model, len(chunk[0]), f"window={window}" + (" with its BOS" if bos_token_id is not None else ""))
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
