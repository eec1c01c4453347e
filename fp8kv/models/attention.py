"""The attention hook: a custom attention function registered with transformers' ``AttentionInterface``
under the name ``"fp8kv"`` (with sdpa's mask builder), routing a model's attention through a handler while
one is active (:func:`attention_handler`), else through the model's own attention (:func:`model_attention`);
and the attention variants of a layer in :func:`fp8kv.decode`'s terms (:func:`attention_variants`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["ATTN_NAME", "attention_variants", "model_attention", "attention_handler"]

ATTN_NAME = "fp8kv"

_HANDLERS: list = []  # active handlers, innermost last
_REGISTERED = False


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
