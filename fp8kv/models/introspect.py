"""What a loaded model is, read from its config and modules: its decoder layers, their attention types and
modules, its vocabulary; and token ids checked against that vocabulary where they enter."""

from __future__ import annotations

import torch

from .. import checks
from ..capacity_registry import resolve_model

__all__ = ["num_layers", "layer_types", "attention_modules", "vocab_size", "kv_head_layout", "check_token_ids",
           "token_ids", "check_token_id", "one_sequence", "max_positions", "check_positions"]


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


def kv_head_layout(model) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of ``model``'s KV cache, read from its config as the capacity planner reads a
    Hugging Face config (:func:`fp8kv.capacity.resolve_model`: KV heads else one per attention head, head_dim
    else hidden size over attention heads)."""
    shape = resolve_model(_text_config(model).to_dict())
    return shape.num_kv_heads, shape.head_dim


def vocab_size(model) -> int | None:
    """How many token ids ``model`` embeds: its input embedding's ``num_embeddings`` (what an id
    indexes), else the config's ``vocab_size``; None when neither is known."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(emb, "num_embeddings", None)
    if n is None:
        n = getattr(_text_config(model), "vocab_size", None)
    return None if n is None else int(n)


def max_positions(model) -> int | None:
    """The most positions ``model`` takes (its config's ``max_position_embeddings``); None where it says none."""
    n = getattr(_text_config(model), "max_position_embeddings", None)
    return None if n is None else int(n)


def check_positions(model, positions: int, what: str) -> None:
    """Refuse a forward over more than :func:`max_positions` positions, ``what`` naming the input: past them RoPE
    extrapolates without a word and every number describes positions the model was never trained on."""
    n = max_positions(model)
    if n is not None and positions > n:
        raise ValueError(f"{what} spans {positions} positions, past the model's {n} (max_position_embeddings); "
                         f"expected at most {n}")


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


def one_sequence(input_ids, model, name: str = "input_ids") -> torch.Tensor:
    """Token ids of one sequence (``[T]`` or ``[1, T]``, int32/int64, within the model's vocabulary and
    :func:`max_positions`) as int64 ``[1, T]`` on the model's device; errors name the argument ``name``."""
    ids = torch.as_tensor(input_ids)
    if ids.dtype not in (torch.int64, torch.int32) or ids.ndim not in (1, 2):
        raise ValueError(f"{name} must be int64 [T] or [1, T]; got {ids.dtype} of shape {tuple(ids.shape)}")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"{name} must hold one sequence ([T] or [1, T]); got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty")
    check_token_ids(ids, name, model)
    check_positions(model, ids.shape[-1], f"{name} of {ids.shape[-1]} tokens")
    return ids.reshape(1, -1).to(torch.int64).to(model.device)
