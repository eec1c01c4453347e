"""calibrate_scales refuses what it does not calibrate for, and bad arguments, by name (a tiny random Llama)."""

from __future__ import annotations

import pytest
import torch

from fp8kv.models import KVQuantConfig, calibrate_scales

pytest.importorskip("transformers", reason="needs the 'models' extra: pip install -e '.[models]'")
VOCAB = 64


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, head_dim=8)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cfg, exc, words", [
    (KVQuantConfig(fmt="nvfp4"), ValueError, r"cfg.fmt='nvfp4': calibration derives FP8 scales"),  # gave FP8 amax
    (KVQuantConfig(fmt="int8_token_head"), ValueError, r"cfg.fmt='int8_token_head'"),
    ({"kv_dtype": "fp8"}, TypeError, r"cfg=\{'kv_dtype': 'fp8'\} \(dict\); expected a KVQuantConfig or None"),
    ("fp8_e4m3", TypeError, r"cfg='fp8_e4m3' \(str\); expected a KVQuantConfig"),
])
def test_calibrate_scales_refuses_a_config_it_does_not_calibrate_for(tiny, cfg, exc, words):
    with pytest.raises(exc, match=words):
        calibrate_scales(tiny, IDS, cfg, window=8)


@pytest.mark.parametrize("ids, window, exc, words", [
    (IDS[:1], 8, ValueError, r"calibration_ids has 1 token\(s\); expected at least 2"),  # named window
    (IDS[:0], 8, ValueError, r"calibration_ids has 0 token\(s\)"),
    (IDS, 1e9, TypeError, r"window=1000000000.0 \(float\); expected an int"),
    (IDS, 1, ValueError, r"window=1; expected an int >= 2"),
    (IDS, True, TypeError, r"window=True \(bool\)"),
])
def test_calibrate_scales_refuses_few_ids_or_a_bad_window_by_name(tiny, ids, window, exc, words):
    with pytest.raises(exc, match=words):
        calibrate_scales(tiny, ids, window=window)


def test_calibrate_scales_gives_one_scale_per_layer(tiny):
    ks, vs = calibrate_scales(tiny, IDS, window=8)
    assert len(ks) == len(vs) == 2 and all(float(s) > 0 for s in ks + vs)
    ks2, _ = calibrate_scales(tiny, IDS[:5], window=100)  # a window past the ids is cut to them
    assert len(ks2) == 2
