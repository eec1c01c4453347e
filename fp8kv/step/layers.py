"""The pieces of a decode step (RMSNorm, RoPE, the gated MLP) and its weights: random ones of a
model's shapes, or a Hugging Face model's own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import checks
from ..capacity import ModelShape, get_model
from ..checks import fail as _fail

# Registry models whose real weights fp8kv loads offline (fp8kv.models) -> their fp8kv.models name.
REAL_WEIGHTS = {"SmolLM2-135M": "smollm2-135m"}

STEP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the weights' (and activations') dtypes a step runs


def require_step_shape(shape: ModelShape) -> ModelShape:
    """The ModelShape fields a decode step needs, present (a registry entry has them all)."""
    if not isinstance(shape, ModelShape):
        _fail(f"shape must be a fp8kv.capacity.ModelShape, got {type(shape).__name__}", TypeError)
    missing = [f for f in ("hidden_size", "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps")
               if getattr(shape, f) is None]
    if missing:
        _fail(f"ModelShape {shape.name!r} lacks {missing}; a decode step needs them (fill them from the "
              "model's config.json)")
    if shape.head_dim % 2:
        _fail(f"ModelShape {shape.name!r}: head_dim={shape.head_dim} is odd; RoPE rotates pairs of channels")
    return shape


def step_shape(model, name: str = "model") -> ModelShape:
    """A step's model argument as its ModelShape: a registry name (:func:`fp8kv.capacity.get_model`) or a
    ModelShape, with the fields a decode step needs (:func:`require_step_shape`); anything else is a TypeError
    naming ``name``."""
    if not isinstance(model, (str, ModelShape)):
        _fail(f"{name}={model!r} ({type(model).__name__}); expected a registry model name (fp8kv.capacity.MODELS) "
              "or a ModelShape", TypeError)
    return require_step_shape(model if isinstance(model, ModelShape) else get_model(model))


# ------------------------------------------------------------------------------------------ pieces
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as Llama/Qwen compute it: in fp32, cast back, then × weight.

    x: ``[..., N]`` any float dtype; weight: ``[N]``. Returns x's dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the gate and up projections fused: gate_up ``[2I, H]``, down ``[H, I]``."""
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)


# ----------------------------------------------------------------------------------------- weights
@dataclass
class LayerWeights:
    """One decoder layer (H hidden, I intermediate, Hq/Hkv heads of D), all in the model's dtype.

    input_norm ``[H]``; qkv ``[(Hq + 2 Hkv) D, H]`` (q, k, v rows in that order); q_norm, k_norm
    ``[D]`` or None; o ``[H, Hq D]``; post_norm ``[H]``; gate_up ``[2I, H]`` (gate rows first); down ``[H, I]``.
    """

    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.input_norm, self.qkv, self.q_norm, self.k_norm, self.o, self.post_norm,
                            self.gate_up, self.down) if t is not None]


@dataclass
class StepWeights:
    """A model's weights in the step's layout: embed ``[V, H]``, layers, final_norm ``[H]``, lm_head
    ``[V, H]`` (the embed tensor itself when tied). ``source``: ``"random"`` or where they came from."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    source: str

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.final_norm] + [t for layer in self.layers for t in layer.tensors()]
        return out if self.lm_head is self.embed else out + [self.lm_head]

    @property
    def nbytes(self) -> int:
        """Bytes of every stored weight, tied embeddings once."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def check_step_weights(shape: ModelShape, weights: StepWeights) -> None:
    """``weights`` hold ``shape``'s tensors: every layer's and the embedding's shapes, q/k norms where
    ``shape.qk_norm``, one float dtype and one device; the first mismatch is named (a step of another model's
    weights would run, and count bytes, for a model it is not)."""
    h, d, inter, vocab = shape.hidden_size, shape.head_dim, shape.intermediate_size, shape.vocab_size
    hq, hkv = shape.num_q_heads, shape.num_kv_heads
    want = {"embed": (vocab, h), "final_norm": (h,), "lm_head": (vocab, h)}
    got = {"embed": weights.embed, "final_norm": weights.final_norm, "lm_head": weights.lm_head}
    norm = (d,) if shape.qk_norm else None
    for i, lw in enumerate(weights.layers):
        for name, dims in (("input_norm", (h,)), ("qkv", ((hq + 2 * hkv) * d, h)), ("q_norm", norm), ("k_norm", norm),
                           ("o", (h, hq * d)), ("post_norm", (h,)), ("gate_up", (2 * inter, h)), ("down", (h, inter))):
            want[f"layers[{i}].{name}"], got[f"layers[{i}].{name}"] = dims, getattr(lw, name)
    for name, dims in want.items():
        t = got[name]
        shown = None if t is None else (tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__)
        if (dims is None) != (t is None) or (t is not None and shown != dims):
            _fail(f"weights.{name} is {shown}; {shape.name} needs {dims} (H={h}, I={inter}, V={vocab}, "
                  f"Hq={hq}, Hkv={hkv}, D={d}{', q/k norms' if shape.qk_norm else ', no q/k norms'})")
        if t is not None and (t.dtype != weights.dtype or t.device != weights.device):
            _fail(f"weights.{name} is {t.dtype} on {t.device}; every weight must be {weights.dtype} on "
                  f"{weights.device}, as weights.embed")
    if weights.dtype not in STEP_DTYPES:
        _fail(f"weights are {weights.dtype}; expected one of {STEP_DTYPES}", TypeError)


def random_weights(shape: ModelShape, dtype: torch.dtype = torch.bfloat16, device=None, seed: int = 0) -> StepWeights:
    """Random weights of ``shape`` (N(0, 1/fan_in) projections, N(0, 1) embeddings, unit norms).

    The scale keeps activations O(1) through the layers, so K and V fit an FP8 cache with a scale of
    1.0 (the engines' default) and the logits stay finite. Time does not depend on the values.
    """
    from ..device import resolve_device

    shape = require_step_shape(shape)
    if dtype not in STEP_DTYPES:
        _fail(f"dtype={dtype!r}; expected one of {STEP_DTYPES}", TypeError)
    seed = checks.generator_seed(seed)
    dev = resolve_device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    h, d, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    hq, hkv = shape.num_q_heads, shape.num_kv_heads

    def proj(out_f, in_f):
        return (torch.randn(out_f, in_f, generator=g, device=dev, dtype=dtype) / math.sqrt(in_f))

    def ones(n):
        return torch.ones(n, device=dev, dtype=dtype)

    layers = [LayerWeights(ones(h), proj((hq + 2 * hkv) * d, h), ones(d) if shape.qk_norm else None,
                           ones(d) if shape.qk_norm else None, proj(h, hq * d), ones(h), proj(2 * inter, h),
                           proj(h, inter))
              for _ in range(shape.num_layers)]
    embed = torch.randn(shape.vocab_size, h, generator=g, device=dev, dtype=dtype)
    lm_head = embed if shape.tie_word_embeddings else proj(shape.vocab_size, h)
    return StepWeights(embed, layers, ones(h), lm_head, "random")


def _config_value(config, key):
    value = getattr(config, key, None)
    if value is None and key == "rope_theta":  # transformers 5 keeps it under rope_parameters
        value = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    return value


def weights_from_hf(model, shape: ModelShape | None = None, dtype: torch.dtype | None = None,
                    device=None) -> StepWeights:
    """The weights of a Llama / Qwen3 causal LM from transformers (``fp8kv.models.load_model``),
    copied into the step's fused layout (QKV and gate/up concatenated, as engines store them).

    ``shape`` (default: the registry entry of ``model.fp8kv_name``'s model) is checked against the
    model's config, so the step cannot silently run a different architecture.
    """
    from ..device import resolve_device

    cfg = model.config
    if shape is None:
        names = {v: k for k, v in REAL_WEIGHTS.items()}
        name = getattr(model, "fp8kv_name", None)
        if name not in names:
            _fail(f"model {name!r} has no registry shape; pass shape= (known: {sorted(names)})")
        shape = get_model(names[name])
    shape = require_step_shape(shape)
    facts = {"num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_q_heads,
             "num_key_value_heads": shape.num_kv_heads, "hidden_size": shape.hidden_size,
             "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
             "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps}
    # GGUF files store rope_theta and the eps as fp32: compare floats to fp32 precision.
    wrong = {k: (_config_value(cfg, k), v) for k, v in facts.items()
             if not (_config_value(cfg, k) == v or isinstance(v, float) and isinstance(_config_value(cfg, k), float)
                     and math.isclose(_config_value(cfg, k), v, rel_tol=2**-23))}
    if wrong:
        _fail(f"model config disagrees with ModelShape {shape.name!r} on {{key: (config, shape)}} {wrong}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        _fail(f"hidden_act={cfg.hidden_act!r}; the step's MLP is SiLU-gated")
    scaling = getattr(cfg, "rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        _fail(f"rope_scaling={scaling!r}; the step applies unscaled RoPE frequencies")
    dtype = dtype or next(model.parameters()).dtype
    dev = resolve_device(device) if device is not None else next(model.parameters()).device

    def w(t):
        return t.detach().to(device=dev, dtype=dtype).contiguous()

    layers = []
    for block in model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        if any(getattr(m, "bias", None) is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
            _fail("the attention projections carry biases; the step's projections have none")
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (qn is not None) != shape.qk_norm:
            _fail(f"model {'has' if qn is not None else 'lacks'} q/k norms but ModelShape.qk_norm={shape.qk_norm}")
        layers.append(LayerWeights(
            w(block.input_layernorm.weight),
            w(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])),
            w(qn.weight) if qn is not None else None, w(kn.weight) if kn is not None else None,
            w(attn.o_proj.weight), w(block.post_attention_layernorm.weight),
            w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])), w(mlp.down_proj.weight)))
    embed = w(model.model.embed_tokens.weight)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    lm_head = embed if tied else w(model.lm_head.weight)
    return StepWeights(embed, layers, w(model.model.norm.weight), lm_head,
                       f"real ({getattr(model, 'fp8kv_name', type(model).__name__)})")
