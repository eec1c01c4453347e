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

__all__ = ["scale_keys"]


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
