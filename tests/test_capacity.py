"""Tests for fp8kv.capacity: the planner against hand-computed numbers, config loading, errors."""

import json
import re

import pytest

from fp8kv.capacity import (
    GPUS,
    MODELS,
    CapacityError,
    ModelShape,
    capacity_table,
    get_gpu,
    get_model,
    gpu_table,
    load_hf_config,
    model_table,
    plan_capacity,
)

GIB = 2**30
MIB = 2**20

# Llama-3.1-8B: 32 layers, 8 KV heads, head_dim 128, 131072 positions, 8,030,261,248 parameters.
LLAMA8B_BF16_BPT = 32 * 2 * 8 * 128 * 2  # = 131072 bytes per token (128 KiB)
LLAMA8B_FP8_BPT = 32 * 2 * 8 * 128 * 1  # = 65536


# A real config.json (Llama-3.1-8B's fields that matter here; no head_dim key, as upstream).
LLAMA8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


# ---------------------------------------------------------------- hand-computed plans

def test_llama8b_bf16_on_80gib_of_kv():
    p = plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=80)
    assert p["bytes_per_token"] == LLAMA8B_BF16_BPT == 131072
    assert p["block_bytes"] == 16 * 131072 == 2 * MIB
    assert p["blocks"] == (80 * GIB) // (2 * MIB) == 40960
    assert p["tokens"] == 40960 * 16 == 655360
    assert p["max_model_len"] == 131072
    assert p["max_concurrency"] == 655360 / 131072 == 5.0
    assert p["granularity"] is None  # 16-bit caches have no scales
    assert p["scale_overhead_bytes"] == p["fixed_scale_bytes"] == p["scale_bytes_per_token"] == 0
    assert p["weights_bytes"] is None and p["kv_memory_gib"] == 80


def test_llama8b_fp8_tensor_scales_cost_one_block():
    p = plan_capacity("Llama-3.1-8B", "fp8_e4m3", kv_memory_gib=80, granularity="tensor")
    assert p["bytes_per_token"] == LLAMA8B_FP8_BPT == 65536
    assert p["fixed_scale_bytes"] == 32 * 2 * 4 == 256  # a K and a V scalar per layer, fp32
    assert p["kv_memory_bytes"] == 80 * GIB - 256
    # 80 GiB / 1 MiB blocks would be 81920 exactly; the 256 scale bytes take one block away.
    assert p["blocks"] == (80 * GIB - 256) // (16 * 65536) == 81919
    assert p["tokens"] == 81919 * 16
    assert p["scale_overhead_bytes"] == 256


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fp8_halves_bytes_per_token(name):
    m = MODELS[name]
    bf16 = plan_capacity(name, "bf16", kv_memory_gib=64)
    fp8 = plan_capacity(name, "e4m3", kv_memory_gib=64)
    assert bf16["bytes_per_token"] == m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2
    assert fp8["bytes_per_token"] * 2 == bf16["bytes_per_token"]
    assert bf16["blocks"] == (64 * GIB) // (16 * bf16["bytes_per_token"])
    assert fp8["blocks"] == (64 * GIB - m.num_layers * 2 * 4) // (16 * fp8["bytes_per_token"])
    # Halving the block size doubles the count, give or take the floor and the scale bytes.
    assert abs(fp8["blocks"] - 2 * bf16["blocks"]) <= 1


def test_token_head_scales_add_per_token_bytes():
    p = plan_capacity("Llama-3.1-8B", "fp8_e4m3", kv_memory_gib=80, granularity="token_head")
    scale_bpt = 2 * 8 * 4 * 32  # K and V, 8 heads, fp32, 32 layers = 2048
    assert p["scale_bytes_per_token"] == scale_bpt == 2048
    assert p["bytes_per_token"] == 65536 + 2048 == 67584
    assert p["fixed_scale_bytes"] == 0
    assert p["blocks"] == (80 * GIB) // (16 * 67584)
    assert p["scale_overhead_bytes"] == 2048 * p["tokens"]


@pytest.mark.parametrize("granularity, fixed", [
    ("tensor", 32 * 2 * 4),  # 256
    ("head", 32 * 2 * 8 * 4),  # 2048
    ("channel", 32 * 2 * 8 * 128 * 4),  # 262144
])
def test_fixed_scale_bytes_per_granularity(granularity, fixed):
    p = plan_capacity("Llama-3.1-8B", "fp8_e5m2", kv_memory_gib=10, granularity=granularity)
    assert p["fixed_scale_bytes"] == fixed
    assert p["scale_bytes_per_token"] == 0
    assert p["blocks"] == (10 * GIB - fixed) // (16 * 65536)


def test_small_models_bytes_per_token():
    # Gemma-3-270M: 18 layers x 2 x 1 KV head x 256 x 2 B = 18432 B (18 KiB); SmolLM2-135M: 30 x 2 x 3 x 64 x 2.
    assert plan_capacity("Gemma-3-270M", "bf16", kv_memory_gib=1)["bytes_per_token"] == 18 * 2 * 1 * 256 * 2
    assert plan_capacity("SmolLM2-135M", "bf16", kv_memory_gib=1)["bytes_per_token"] == 30 * 2 * 3 * 64 * 2


def test_block_flooring_drops_partial_blocks():
    block = 16 * LLAMA8B_BF16_BPT
    p = plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=(3 * block - 1) / GIB)
    assert p["kv_memory_bytes"] == 3 * block - 1
    assert p["blocks"] == 2 and p["tokens"] == 32
    p = plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=3 * block / GIB)
    assert p["blocks"] == 3


def test_block_size_changes_block_count_not_tokens_when_it_divides():
    p16 = plan_capacity("Qwen3-8B", "bf16", kv_memory_gib=32, block_size=16)
    p32 = plan_capacity("Qwen3-8B", "bf16", kv_memory_gib=32, block_size=32)
    # Qwen3-8B bf16: 36 x 2 x 8 x 128 x 2 = 147456 B/token; 32 GiB is not a whole number of blocks.
    assert p16["blocks"] == (32 * GIB) // (16 * 147456)
    assert p32["blocks"] == (32 * GIB) // (32 * 147456)
    assert p32["tokens"] <= p16["tokens"]


def test_gpu_memory_path_with_given_weights():
    # 80 GiB x 0.5 - 8 GiB of weights = 32 GiB for the cache; 2 MiB bf16 blocks -> 16384 blocks.
    p = plan_capacity("Llama-3.1-8B", "bf16", gpu_memory_gib=80, utilization=0.5, weights_gib=8)
    assert p["kv_budget_bytes"] == 32 * GIB
    assert p["weights_bytes"] == 8 * GIB
    assert p["blocks"] == 16384


def test_gpu_name_uses_registry_weights_and_driver_total():
    p = plan_capacity("Llama-3.1-8B", "bf16", gpu_memory_gib="A100-80GB", utilization=0.9)
    weights = 8_030_261_248 * 2  # parameters x 2 bytes (bf16)
    budget = 80 * GIB * 9 // 10 - weights  # A100-80GB reports 81920 MiB = 80 GiB
    assert p["gpu"] == "A100-80GB" and p["gpu_memory_gib"] == 80.0
    assert p["weights_bytes"] == weights
    assert p["kv_budget_bytes"] == budget
    assert p["blocks"] == budget // (2 * MIB)


def test_max_model_len_override():
    p = plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=80, max_model_len=8192)
    assert p["max_model_len"] == 8192
    assert p["max_concurrency"] == 655360 / 8192 == 80.0


def test_model_as_shape_and_as_dict():
    shape = ModelShape("toy", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                       max_position_embeddings=1024)
    p = plan_capacity(shape, "bf16", kv_memory_gib=1)
    assert p["bytes_per_token"] == 2 * 2 * 2 * 64 * 2 == 1024
    assert p["blocks"] == GIB // (16 * 1024)
    q = plan_capacity(dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64,
                           max_position_embeddings=1024), "bf16", kv_memory_gib=1)
    assert q["model"] == "custom" and q["blocks"] == p["blocks"]


# ---------------------------------------------------------------- config.json loading

def test_config_json_path_matches_registry(tmp_path):
    d = tmp_path / "Llama-3.1-8B-local"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA8B_CONFIG))
    shape = load_hf_config(d / "config.json")
    assert shape.name == "Llama-3.1-8B-local"
    assert (shape.num_layers, shape.num_q_heads, shape.num_kv_heads) == (32, 32, 8)
    assert shape.head_dim == 4096 // 32  # no head_dim key: hidden_size / heads
    assert shape.max_position_embeddings == 131072 and shape.torch_dtype == "bfloat16"
    # Dense count: 2 x 128256 x 4096 embeddings + 32 x (2*4096*4096 + 2*4096*1024 + 3*4096*14336
    # + 2*4096) + 4096 = 8,030,261,248, the model card's figure.
    assert shape.num_params == (2 * 128256 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024
                                + 3 * 4096 * 14336 + 2 * 4096) + 4096) == MODELS["Llama-3.1-8B"].num_params
    for path in (str(d / "config.json"), d):  # a str path and a folder
        p = plan_capacity(path, "fp8_e4m3", gpu_memory_gib="H100")
        r = plan_capacity("Llama-3.1-8B", "fp8_e4m3", gpu_memory_gib="H100")
        assert (p["blocks"], p["bytes_per_token"], p["weights_bytes"]) == \
            (r["blocks"], r["bytes_per_token"], r["weights_bytes"])


def test_config_nested_text_config_and_fallbacks(tmp_path):
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
           "text_config": {"num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                           "head_dim": 256, "hidden_size": 2560, "max_position_embeddings": 131072}}
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    shape = load_hf_config(f)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (34, 4, 256)
    assert shape.num_params is None  # no vocab/intermediate sizes: weights must be given
    with pytest.raises(ValueError, match="has no num_params; pass weights_gib"):
        plan_capacity(str(f), "bf16", gpu_memory_gib=80)
    # no num_key_value_heads -> multi-head attention (KV heads = attention heads)
    mha = plan_capacity({"num_hidden_layers": 4, "num_attention_heads": 6, "hidden_size": 384,
                         "max_position_embeddings": 512}, "bf16", kv_memory_gib=1)
    assert mha["num_kv_heads"] == 6 and mha["head_dim"] == 64
    assert mha["bytes_per_token"] == 4 * 2 * 6 * 64 * 2


def test_config_dtype_key_and_moe_skip(tmp_path):
    cfg = dict(LLAMA8B_CONFIG, dtype="float32", num_local_experts=8)
    del cfg["torch_dtype"]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    shape = load_hf_config(f)
    assert shape.torch_dtype == "float32"
    assert shape.num_params is None  # experts: the dense formula would undercount


# ---------------------------------------------------------------- registries

def test_registry_shapes_hold_the_requested_small_models():
    s = MODELS["SmolLM2-135M"]
    assert (s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim) == (30, 9, 3, 64)
    g = MODELS["Gemma-3-270M"]
    assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim) == (18, 4, 1, 256)
    assert all(m.source.startswith("https://huggingface.co/") and m.source.endswith("config.json")
               for m in MODELS.values())
    assert get_model("meta-llama/Llama-3.1-8B") is MODELS["Llama-3.1-8B"]
    assert get_model("google/gemma-3-270m") is MODELS["Gemma-3-270M"]
    assert len(model_table()) == len(MODELS)


def test_gpu_registry_units():
    for g in GPUS.values():
        assert g.total_gib == g.total_mib / 1024
        # Datasheet "GB" are binary (JEDEC); the driver reports a little less, never 7 % less.
        assert 0.93 * g.datasheet_gb < g.total_gib <= g.datasheet_gb
    assert GPUS["A100-40GB"].total_gib == 40.0
    assert get_gpu("rtx4090") is GPUS["RTX 4090"]
    assert get_gpu("H100-80GB") is GPUS["H100"]
    assert list(gpu_table()["name"]) == list(GPUS)


# ---------------------------------------------------------------- table

def test_capacity_table_rows():
    df = capacity_table(["Llama-3.1-8B", "Llama-3.1-70B"], ["H200", "RTX 4090"], ["bf16", "fp8_e4m3"],
                        ["tensor", "token_head"])
    # per model x GPU: one bf16 row + two fp8 rows
    assert len(df) == 2 * 2 * 3
    assert set(df[df.kv_dtype == "bf16"].granularity.isna()) == {True}
    fits = df.set_index(["model", "gpu", "kv_dtype", "granularity"], drop=False)
    # Llama-3.1-70B weights (141 GB in bf16) fit on neither card.
    assert not df[df.model == "Llama-3.1-70B"].fits.any()
    assert (df[df.model == "Llama-3.1-70B"].tokens == 0).all()
    assert df[df.model == "Llama-3.1-70B"].note.str.contains("weights do not fit").all()
    row = fits.loc[("Llama-3.1-8B", "H200", "fp8_e4m3", "tensor")]
    direct = plan_capacity("Llama-3.1-8B", "fp8_e4m3", gpu_memory_gib="H200")
    assert row.tokens == direct["tokens"] and row.fits


def test_capacity_table_fixed_kv_budget():
    df = capacity_table("SmolLM2-135M", None, ["bf16", "e4m3"], "tensor", kv_memory_gib=2)
    assert len(df) == 2
    bf16, fp8 = df.tokens.tolist()
    assert bf16 == (2 * GIB) // (16 * 23040) * 16
    assert fp8 == (2 * GIB - 30 * 2 * 4) // (16 * 11520) * 16


# ---------------------------------------------------------------- validation

def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match=r"model='GPT-5' is not a known model; known: \[.*'Llama-3.1-8B'"):
        plan_capacity("GPT-5", "bf16", kv_memory_gib=1)
    with pytest.raises(ValueError, match="no such config file"):
        plan_capacity("/nonexistent/config.json", "bf16", kv_memory_gib=1)
    with pytest.raises(TypeError, match="model must be a registry name"):
        plan_capacity(3, "bf16", kv_memory_gib=1)
    with pytest.raises(ValueError, match=r"unknown keys \['layers'\]"):
        plan_capacity({"layers": 3}, "bf16", kv_memory_gib=1)


@pytest.mark.parametrize("u", [0, -0.1, 1.5, True])
def test_bad_utilization(u):
    exc, msg = (TypeError, r"utilization=True \(bool\); expected a finite number") if u is True else \
        (ValueError, rf"utilization={float(u)}; expected a fraction in \(0, 1\]")
    with pytest.raises(exc, match=msg):
        plan_capacity("Llama-3.1-8B", "bf16", gpu_memory_gib=80, utilization=u)


def test_weights_do_not_fit():
    with pytest.raises(CapacityError, match=r"no memory left for the KV cache on RTX 4090.*weights do not fit"):
        plan_capacity("Llama-3.1-8B", "bf16", gpu_memory_gib="RTX 4090", utilization=0.5)
    with pytest.raises(ValueError, match="weights do not fit"):  # CapacityError is a ValueError
        plan_capacity("Llama-3.1-8B", "bf16", gpu_memory_gib=16, weights_gib=16)


def test_memory_too_small_for_one_block():
    with pytest.raises(CapacityError, match="holds no block of 2097152 bytes"):
        plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=1 / 1024)  # 1 MiB < one 2 MiB block


@pytest.mark.parametrize("bs", [0, -16, 2.0, True])
def test_bad_block_size(bs):
    """The cache's rule (fp8kv.cache.check_block_size): a positive int."""
    exc, msg = (TypeError, rf"block_size={bs} \({type(bs).__name__}\); expected an int") \
        if isinstance(bs, (bool, float)) else (ValueError, rf"block_size={bs}; expected an int >= 1")
    with pytest.raises(exc, match=msg):
        plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=1, block_size=bs)


def test_bad_kv_dtype_and_granularity():
    with pytest.raises(ValueError, match=r"kv_dtype='int8' is not supported; expected one of"):
        plan_capacity("Llama-3.1-8B", "int8", kv_memory_gib=1)
    with pytest.raises(ValueError, match=r"granularity='block'; expected one of \('tensor', 'head'"):
        plan_capacity("Llama-3.1-8B", "fp8_e4m3", kv_memory_gib=1, granularity="block")


def test_memory_arguments():
    with pytest.raises(ValueError, match="pass exactly one of kv_memory_gib"):
        plan_capacity("Llama-3.1-8B", "bf16")
    with pytest.raises(ValueError, match="pass exactly one of kv_memory_gib"):
        plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=10, gpu_memory_gib=80)
    with pytest.raises(ValueError, match="weights_gib=4 only applies with gpu_memory_gib"):
        plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=10, weights_gib=4)
    with pytest.raises(ValueError, match=r"kv_memory_gib=-1.0; expected a finite number > 0"):
        plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=-1)
    with pytest.raises(ValueError, match=r"gpu_memory_gib='A100' is not a known GPU; known: \["):
        plan_capacity("Llama-3.1-8B", "bf16", gpu_memory_gib="A100")
    with pytest.raises(TypeError, match="gpu must be a GPU name"):
        get_gpu(80)


def test_max_model_len_errors():
    shape = ModelShape("no-ctx", 2, 2, 2, 64)
    with pytest.raises(ValueError, match="has no max_position_embeddings; pass max_model_len"):
        plan_capacity(shape, "bf16", kv_memory_gib=1)
    with pytest.raises(ValueError, match=r"max_model_len=0; expected an int >= 1"):
        plan_capacity(shape, "bf16", kv_memory_gib=1, max_model_len=0)


def test_model_shape_validation():
    with pytest.raises(ValueError, match=r"num_kv_heads=0 must be a positive int"):
        ModelShape("bad", 2, 4, 0, 64)
    with pytest.raises(ValueError, match="num_q_heads=6 is not a multiple of num_kv_heads=4"):
        ModelShape("bad", 2, 6, 4, 64)
    with pytest.raises(ValueError, match="lacks \\['num_attention_heads'\\]"):
        plan_capacity({"num_hidden_layers": 2}, "bf16", kv_memory_gib=1)


@pytest.mark.parametrize("key", ["kv_memory_gib", "gpu_memory_gib", "weights_gib"])
@pytest.mark.parametrize("value", [1e300, 1e6 * 1.0001])
def test_absurd_memory_is_refused_not_overflowed(key, value):
    """A memory over 1e6 GiB (about a pebibyte) is a typo, refused by name; 1e300 GiB used to
    overflow (OverflowError) in the byte arithmetic."""
    args = {"kv_memory_gib": {"kv_memory_gib": value}, "gpu_memory_gib": {"gpu_memory_gib": value},
            "weights_gib": {"gpu_memory_gib": 80, "weights_gib": value}}[key]
    with pytest.raises(ValueError, match=re.escape(f"{key}={value:g} GiB is over the planner's bound of 1e+06 GiB")):
        plan_capacity("Llama-3.1-8B", "fp8", **args)


def test_memory_at_the_bound_plans_exactly():
    from fp8kv.capacity import MAX_MEMORY_GIB

    p = plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=MAX_MEMORY_GIB)
    assert p["blocks"] == int(MAX_MEMORY_GIB) * GIB // (16 * LLAMA8B_BF16_BPT)  # byte-exact at the bound
    p = plan_capacity("Llama-3.1-8B", "bf16", gpu_memory_gib=MAX_MEMORY_GIB, weights_gib=MAX_MEMORY_GIB / 2)
    assert p["kv_budget_bytes"] == int(MAX_MEMORY_GIB) * GIB * 9 // 10 - int(MAX_MEMORY_GIB) * GIB // 2


def test_tiny_memory_message_keeps_its_digits():
    """The refusal of a tiny GPU says how tiny (significant digits), not "0.00 x 0.9 = 0.00 GiB"."""
    with pytest.raises(CapacityError) as exc:
        plan_capacity("SmolLM2-135M", "fp8", gpu_memory_gib=1e-9)
    msg = str(exc.value)
    assert "gpu_memory_gib=1e-09 x utilization=0.9 = 9e-10 GiB" in msg and "0.2506 GiB" in msg
    assert "0.00" not in msg


def test_a_config_built_in_code_plans_under_a_default_name():
    """transformers' ``to_dict()`` of a config not loaded from a path has ``_name_or_path: ""``: planned as "custom"."""
    p = plan_capacity(LLAMA8B_CONFIG | {"_name_or_path": ""}, "bf16", kv_memory_gib=80)
    assert p["bytes_per_token"] == LLAMA8B_BF16_BPT and p["model"] == "custom"


def test_a_folder_without_a_config_and_a_bad_size_are_named(tmp_path):
    """plan_capacity(model=<a folder without config.json>) raised FileNotFoundError; a vocab_size of -5 was read as
    absent, and the plan then said the model had no num_params."""
    from pathlib import Path

    from fp8kv.capacity_registry import resolve_model

    for given in (str(tmp_path), Path(tmp_path)):
        with pytest.raises(ValueError, match=r"model=.*: no .*config\.json \(expected a Hugging Face config\.json"):
            resolve_model(given)
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": -5,
           "intermediate_size": 10}
    with pytest.raises(ValueError, match="vocab_size=-5; expected an int >= 1"):
        resolve_model(cfg)


def test_plan_capacity_names_a_folder_config_an_unbounded_length_and_missing_fields(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ValueError, match=r"config\.json is a folder, not a file"):
        plan_capacity(str(tmp_path), "bf16", kv_memory_gib=1)
    with pytest.raises(ValueError, match=r"max_model_len=1000+\.\.\.; expected an int <= 2147483647"):
        plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=80, max_model_len=10**400)
    with pytest.raises(ValueError, match=r"model dict lacks ModelShape fields \['num_q_heads', 'num_kv_heads', "
                                         r"'head_dim'\]"):
        plan_capacity(dict(num_layers=2), "bf16", kv_memory_gib=1)
    shape = ModelShape("toy", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=2**40)
    with pytest.raises(ValueError, match=r"max_position_embeddings=1099511627776, past MAX_MODEL_LEN"):
        plan_capacity(shape, "bf16", kv_memory_gib=1)


@pytest.mark.parametrize("kw,match", [
    (dict(models=["Qwen3-8B", "nope"], gpus=["H200"], kv_dtypes=["bf16"]), r"models\[1\]: model='nope'"),
    (dict(models=["Qwen3-8B"], gpus=["H200", "H999"], kv_dtypes=["bf16"]), r"gpus\[1\]: .*'H999' is not a known GPU"),
    (dict(models=["Qwen3-8B"], gpus=["H200"], kv_dtypes=["bf16", "fp9"]), r"kv_dtypes\[1\]: kv_dtype='fp9'"),
])
def test_capacity_table_names_the_list_entry_it_refuses(kw, match):
    """The error names capacity_table's own argument and the entry's index, not plan_capacity's parameter alone."""
    with pytest.raises(ValueError, match=match):
        capacity_table(**kw)
