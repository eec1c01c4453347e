"""A model whose keys are large, with the same function: in chosen layers K is multiplied by a gain and Q divided
by it. Every score q·k, hence every attention weight and output, is unchanged up to rounding (RoPE rotates both
and commutes with a scalar); only the values a KV cache stores grow. Models such as Qwen2-7B carry keys beyond
e4m3's range (|K| > 448), so a cache without scales (scale 1.0) saturates them; the offline models' keys are
small, and this gives them such keys without changing what they compute: a scale failure shown on a model
fp8kv ships."""

from __future__ import annotations

import torch

from .. import checks
from .introspect import attention_modules

__all__ = ["scale_keys", "load_model_with_keys"]


def _layer_list(layers, n: int) -> list[int]:
    layers = checks.listed(layers, "layers", f"layer indices in [0, {n})")
    return sorted({checks.integer(x, "layers", minimum=0, maximum=n - 1) for x in layers})


@torch.no_grad()
def scale_keys(model, gain: float, layers) -> list[int]:
    """Multiply the key projection of each of ``layers`` by ``gain`` and divide its query projection by it, in
    place (weights and biases). Returns the layers, sorted.

    ValueError naming the argument for a gain that is not a positive finite number, a layer outside the model,
    or a layer that normalizes its keys (``k_norm``, Gemma-3 and Qwen3: the gain would be normalized away).
    """
    gain = checks.real(gain, "gain", minimum=0.0, inclusive=False)
    mods = attention_modules(model)
    chosen = _layer_list(layers, len(mods))
    for m in mods:
        if m.layer_idx in chosen and getattr(m, "k_norm", None) is not None:
            checks.fail(f"layers={chosen}: layer {m.layer_idx} normalizes its keys (k_norm), which would undo a "
                        "gain on them; expected a model without QK-norm (e.g. smollm2-135m)")
    for m in mods:
        if m.layer_idx in chosen:
            for proj, factor in ((m.k_proj, gain), (m.q_proj, 1.0 / gain)):
                proj.weight.mul_(factor)
                if proj.bias is not None:
                    proj.bias.mul_(factor)
    return chosen


def load_model_with_keys(model: str, *, device="cpu", key_gain: float = 1.0, key_layers=()):
    """``fp8kv.models.load_model(model)`` in fp32 on ``device``, with the keys of ``key_layers`` multiplied by
    ``key_gain`` and their queries divided by it (:func:`scale_keys`: the same function, larger keys) when
    ``key_layers`` is not empty. Returns ``(net, tokenizer, note)``, the note saying what was changed ("" for
    nothing). ``key_layers`` and ``key_gain`` are checked by name before the model loads."""
    from .loading import load_model

    if key_layers is None or (not isinstance(key_layers, str) and hasattr(key_layers, "__len__")
                              and len(key_layers) == 0):
        key_layers = []
    else:  # checked before the model loads; the model's layer count where scale_keys meets it
        key_layers = [checks.integer(x, "key_layers", minimum=0)
                      for x in checks.listed(key_layers, "key_layers", "layer indices (ints >= 0)")]
    key_gain = checks.real(key_gain, "key_gain", minimum=0.0, inclusive=False)
    net, tok = load_model(model, dtype=torch.float32, device=device)
    if not key_layers:
        return net, tok, ""
    layers = scale_keys(net, key_gain, key_layers)
    return net, tok, (f"keys of layer(s) {', '.join(map(str, layers))} x{key_gain:g} and their queries "
                      f"/{key_gain:g} (the same function, larger keys)")
