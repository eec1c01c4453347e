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


# ------------------------------------------------------------------------ notebook 03's walkthrough and measured bytes
ODD = dict(name="odd", num_layers=3, num_q_heads=6, num_kv_heads=3, head_dim=64, max_position_embeddings=100,
           num_params=1000)


@pytest.mark.parametrize("fmt", kvf.PAGED_FORMATS)
def test_the_walkthrough_recomputes_a_paged_formats_plan(fmt):
    from fp8kv import analysis

    walk = analysis.capacity_walkthrough("Qwen3-8B", fmt, "H100", request_len=1000)
    assert walk["match"].map(lambda m: m is not False).all() and (walk["match"] == True).sum() == 8  # noqa: E712
    steps = dict(zip(walk["step"], walk["value"], strict=True))
    fp = kvf.kv_footprint(fmt, num_kv_heads=8, head_dim=128, num_layers=36)
    assert steps["bytes per token"] == fp.per_token and steps["fixed scale bytes"] == fp.fixed
    assert fmt in dict(zip(walk["step"], walk["formula"], strict=True))["fixed scale bytes"]
    walks = analysis.capacity_walkthroughs("Qwen3-8B", ["bf16", fmt], "H100", request_len=1000)
    assert f"KV {fmt}:" in analysis.walkthrough_text(walks, "Qwen3-8B", "H100")


@pytest.mark.parametrize("fmt", kvf.PAGED_FORMATS)
def test_a_paged_formats_measured_bytes_are_a_quantized_caches(fmt):
    from fp8kv import analysis
    from fp8kv.cache.quantized import QuantizedPagedKVCache

    m = analysis.measured_cache_bytes(ODD, fmt, kv_memory_gib=0.001, block_size=8)
    assert m["equal"] and m["measured_bytes"] == m["formula_bytes"] <= m["budget_bytes"] and m["granularity"] is None
    assert m["tokens"] == m["blocks"] * 8 and m["blocks"] > 0
    # Independently: codes and scales of blocks x 8 tokens x 3 heads, K and V, and the tensor scales, per layer.
    c = kvf.kv_format(fmt).key
    groups = 64 // c.block if c.scaling == "block" else 1
    tokens_heads = m["blocks"] * 8 * 3
    layer = 2 * tokens_heads * (64 * c.bits // 8 + groups * c.scale_bytes) + (2 * 4 if c.tensor_scale else 0)
    assert m["layer_nbytes"] == layer and m["measured_bytes"] == 3 * layer
    scales = {"k_tensor_scale": 1.0, "v_tensor_scale": 1.0} if c.tensor_scale else {}
    assert QuantizedPagedKVCache.empty(fmt, 1, m["tokens"], 3, 64, block_size=8, **scales).nbytes == layer


def test_measured_vs_formula_takes_paged_formats_once_each():
    from fp8kv import analysis

    df = analysis.measured_vs_formula(["SmolLM2-135M"], ("bf16", "fp8_e4m3", "int8_token_head", "nvfp4"),
                                      kv_memory_gib=0.005)
    assert list(df["kv_dtype"]) == ["bf16", *["fp8_e4m3"] * len(GRANULARITIES), "int8_token_head", "nvfp4"]
    assert df["equal"].all() and df.loc[df["kv_dtype"] == "nvfp4", "granularity"].map(lambda g: g is None).all()


@pytest.mark.parametrize("bad, exc, match", [
    ("kivi4_g32", ValueError, r"kv_dtype='kivi4_g32' is paged by fp8kv.cache.KIVIPagedKVCache, .* token-local pages; "
                              r"expected .* a paged format among \['int8_token_head'"),
    ("fp8_e4m3_tensor", ValueError, r"kv_dtype='fp8_e4m3_tensor' has no paged cache .* 'fp8_e4m3' and a granularity"),
    ("int3", ValueError, r"kv_dtype='int3' is not known; expected an element type among \['bf16'"),
    (3, TypeError, r"kv_dtype=3 \(int\); expected an element type"),
])
def test_the_capacity_steps_refuse_what_is_no_paged_kv_dtype_by_name(bad, exc, match):
    from fp8kv import analysis

    for call in (lambda: analysis.capacity_walkthrough("Qwen3-8B", bad, "H100"),
                 lambda: analysis.measured_cache_bytes("SmolLM2-135M", bad, kv_memory_gib=0.001),
                 lambda: analysis.measured_vs_formula(["SmolLM2-135M"], ["bf16", bad], kv_memory_gib=0.001)):
        with pytest.raises(exc, match=match):
            call()


# ------------------------------------------------------------------------ the GPU notebook 03 reads its ratio on
def _device(name, gib):
    return {"type": "cuda", "name": name, "memory_gib": gib}


@pytest.mark.parametrize("info, want", [
    (_device("NVIDIA H100 80GB HBM3", 79.19), "H100"),
    (_device("NVIDIA H200", 139.8), "H200"),
    (_device("NVIDIA A100-SXM4-80GB", 79.15), "A100-80GB"),
    (_device("NVIDIA A100-PCIE-40GB", 39.4), "A100-40GB"),
    (_device("NVIDIA GeForce RTX 4090", 23.6), "RTX 4090"),
    (_device("NVIDIA H100 NVL", 93.1), None),        # an H100 by name, not by memory
    (_device("NVIDIA GH200 480GB", 94.5), None),     # GH200 is no H200
    (_device("NVIDIA RTX A6000", 47.5), None),       # not in the registry
    ({"type": "cpu", "name": "cpu", "memory_gib": None}, None),
])
def test_device_gpu_names_the_registry_gpu_this_is(info, want):
    from fp8kv.analysis.capacity import device_gpu

    assert device_gpu(info) == want


def test_reference_gpu_is_this_gpu_where_known_else_the_fallback():
    from fp8kv.analysis.capacity import reference_gpu

    cpu = {"type": "cpu", "name": "cpu", "memory_gib": None}
    assert reference_gpu("auto", cpu) == "H200"
    assert reference_gpu("auto", _device("NVIDIA H100 80GB HBM3", 79.19)) == "H100"
    assert reference_gpu("auto", _device("NVIDIA RTX A6000", 47.5), fallback="b200") == "B200"
    assert reference_gpu("h100", cpu) == "H100"  # a name as the registry spells it
    with pytest.raises(ValueError, match=r"REFERENCE_GPU='H300' is not a known GPU; expected \"auto\" or one of"):
        reference_gpu("H300", cpu)
    with pytest.raises(TypeError, match=r"REFERENCE_GPU=None \(NoneType\)"):
        reference_gpu(None, cpu)
    with pytest.raises(TypeError, match=r"info=\[\] \(list\)"):
        reference_gpu("auto", [])
