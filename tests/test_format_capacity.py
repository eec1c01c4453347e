"""The capacity planner with the storage formats of fp8kv.kv_formats as the KV dtype: bytes per token, fixed bytes,
codes and scales are kv_footprint's, exactly; FP8 as a format plans as the FP8 dtype does; BF16 and FP8 are as
before; formats that cannot hold a model's head_dim and unknown names are refused by name."""

import math
from fractions import Fraction

import pytest

from fp8kv import kv_formats as kvf
from fp8kv.capacity import MODELS, CapacityError, capacity_table, plan_capacity
from fp8kv.quant import GRANULARITIES

GIB = 2**30


def fits(fmt, model) -> bool:
    m = MODELS[model]
    try:
        kvf.kv_footprint(fmt, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("fmt", kvf.KV_FORMAT_NAMES)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_bytes_per_token_are_kv_footprint(fmt, model):
    m = MODELS[model]
    if not fits(fmt, model):
        with pytest.raises(CapacityError, match=rf"kv_dtype='{fmt}' cannot store {model}'s head_dim {m.head_dim}"):
            plan_capacity(model, fmt, kv_memory_gib=8)
        return
    fp = kvf.kv_footprint(fmt, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, num_layers=m.num_layers)
    p = plan_capacity(model, fmt, kv_memory_gib=8, block_size=16)
    assert Fraction(p["bytes_per_token"]) == fp.per_token
    assert Fraction(p["kv_data_bytes_per_token"]) == fp.codes
    assert Fraction(p["scale_bytes_per_token"]) == fp.per_token - fp.codes
    assert p["fixed_scale_bytes"] == fp.fixed
    assert p["kv_dtype"] == kvf.kv_format(fmt).name and p["granularity"] is None
    assert p["block_bytes"] == math.ceil(16 * fp.per_token)
    assert p["blocks"] == (8 * GIB - fp.fixed) // p["block_bytes"]
    assert p["tokens"] == p["blocks"] * 16
    assert p["max_concurrency"] == p["tokens"] / m.max_position_embeddings


def test_codes_are_the_element_bits_and_scales_the_rest():
    """Llama-3.1-8B (32 layers, 8 KV heads, D 128), K and V: codes are bits x values; scales as the formats say."""
    values = 32 * 2 * 8 * 128
    p = {f: plan_capacity("Llama-3.1-8B", f, kv_memory_gib=80) for f in
         ("int8_token_head", "int4_token_head", "nvfp4", "mxfp4", "kivi4_g32", "kivi4_g128", "e4m3_b16")}
    assert p["int8_token_head"]["kv_data_bytes_per_token"] == values
    assert p["int8_token_head"]["scale_bytes_per_token"] == 32 * 2 * 8 * 4  # an fp32 scale per token and head
    assert p["int4_token_head"]["kv_data_bytes_per_token"] == values // 2
    assert p["nvfp4"]["scale_bytes_per_token"] == values // 16  # an e4m3 byte per 16 values
    assert p["nvfp4"]["fixed_scale_bytes"] == 32 * 2 * 4  # the fp32 tensor scale of K and V per layer
    assert p["mxfp4"]["scale_bytes_per_token"] == values // 32  # an e8m0 byte per 32 values
    assert p["kivi4_g32"]["scale_bytes_per_token"] == values // 32 * 4  # fp16 scale + zero point per 32
    assert p["kivi4_g128"]["scale_bytes_per_token"] == values // 128 * 4
    assert p["e4m3_b16"]["kv_data_bytes_per_token"] == values
    order = sorted(p, key=lambda f: p[f]["bytes_per_token"])
    assert [p[f]["tokens"] for f in order] == sorted((p[f]["tokens"] for f in p), reverse=True)


@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("model", ["Llama-3.1-8B", "SmolLM2-135M", "Gemma-3-270M"])
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_fp8_as_a_format_plans_as_the_fp8_dtype(gran, model, elem):
    """The FP8 dtype with a granularity and the kv_formats format of the same name count the same bytes."""
    as_dtype = plan_capacity(model, f"fp8_{elem}", gpu_memory_gib="H100-80GB", granularity=gran)
    as_format = plan_capacity(model, f"fp8_{elem}_{gran}", gpu_memory_gib="H100-80GB")
    for key in ("bytes_per_token", "kv_data_bytes_per_token", "scale_bytes_per_token", "fixed_scale_bytes",
                "blocks", "tokens", "max_concurrency", "element_size"):
        assert as_dtype[key] == as_format[key], key


def test_bf16_and_fp8_figures_are_unchanged():
    """Llama-3.1-8B on 80 GiB of KV: BF16 128 KiB a token, FP8 64 KiB plus 256 fixed scale bytes."""
    bf16 = plan_capacity("Llama-3.1-8B", "bf16", kv_memory_gib=80)
    fp8 = plan_capacity("Llama-3.1-8B", "fp8_e4m3", kv_memory_gib=80)
    assert (bf16["bytes_per_token"], bf16["blocks"], bf16["tokens"]) == (131072, 40960, 655360)
    assert (fp8["bytes_per_token"], fp8["fixed_scale_bytes"], fp8["blocks"]) == (65536, 256, 81919)
    assert bf16["granularity"] is None and fp8["granularity"] == "tensor"


@pytest.mark.parametrize("bad", ["int3", "nvfp8", "kivi4_g16", "", "fp8_e4m3_row"])
def test_an_unknown_name_is_refused_naming_both_sets(bad):
    with pytest.raises(ValueError, match=rf"kv_dtype='{bad}' is not supported; expected one of the element types "
                                         r"\[.*'fp8_e4m3'.*\] or a KV format among \[.*'nvfp4'.*\]"):
        plan_capacity("Llama-3.1-8B", bad, kv_memory_gib=8)


@pytest.mark.parametrize("bad", [None, True, 8, 1.0, ["nvfp4"]])
def test_a_non_name_is_a_type_error(bad):
    with pytest.raises(TypeError, match="kv_dtype=.*expected a name among"):
        plan_capacity("Llama-3.1-8B", bad, kv_memory_gib=8)


def test_capacity_table_one_row_per_format_and_misfits_noted():
    formats = ["bf16", "fp8_e4m3", "int8_token_head", "int4_token_head", "nvfp4", "mxfp4", "kivi4_g128"]
    df = capacity_table(["Llama-3.1-8B", "SmolLM2-135M"], ["H100", "H200"], formats,
                        granularities=["tensor", "token_head"])
    per = df.groupby(["model", "gpu", "kv_dtype"]).size()
    assert per.xs("fp8_e4m3", level="kv_dtype").eq(2).all()  # FP8: one row per granularity
    assert per.drop("fp8_e4m3", level="kv_dtype").eq(1).all()  # the formats: one row each
    smol_kivi = df[(df.model == "SmolLM2-135M") & (df.kv_dtype == "kivi4_g128")]
    assert (~smol_kivi.fits).all() and smol_kivi.note.str.contains("head_dim 64").all()
    assert df.drop(smol_kivi.index).fits.all()
    llama = df[(df.model == "Llama-3.1-8B") & (df.gpu == "H100")].set_index("kv_dtype")
    assert llama.loc["int4_token_head", "tokens"] > llama.loc["int8_token_head", "tokens"] > llama.loc["bf16", "tokens"]
