"""fp8kv.ops.write_quantized_rows: the fused INT8 / INT4 write against the codec's own write (QuantizedPagedKVCache.write,
fp8kv.kv_formats.quantize), byte for byte: exact ties, all-zero and deep-subnormal heads, odd head counts and dims,
16-bit input."""

import pytest
import torch
from fixtures import DEVICE, seeded

from fp8kv.cache import PagedKVCache
from fp8kv.cache.quantized import QuantizedPagedKVCache
from fp8kv.capability import interpreter_on
from fp8kv.ops import FUSED_WRITE_FORMATS, write_quantized_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not interpreter_on(),
                                reason="the Triton kernel needs a CUDA GPU or TRITON_INTERPRET=1")


def _pair(fmt, hkv, d):
    return tuple(QuantizedPagedKVCache.empty(fmt, 2, 24, hkv, d, block_size=8, seed=3, device=DEVICE)
                 for _ in range(2))


def _rows(n, hkv, d, g):
    """Rows of every magnitude, with heads made of exact ties and the extremes of fp32."""
    rows = torch.randn(2, n, hkv, d, generator=g) * torch.logspace(-6, 3, n)[None, :, None, None]
    rows[:, 0] = 0.0  # all zero: scale 1, zero codes
    ties = torch.arange(d, dtype=torch.float32) % 16 - 7.5  # x.5 everywhere ...
    ties[0] = 127.0  # ... with amax 127: scale 1 for INT8, so y = x: every tie rounds to even
    rows[:, 1, 0] = ties
    ties4 = torch.arange(d, dtype=torch.float32) % 14 - 6.5
    ties4[0] = 7.0  # amax 7: scale 1 for INT4, every other value a tie
    rows[:, 2, -1] = ties4
    rows[:, 3] *= 1e-40  # deep subnormal heads: the scale rounds up, as scale_from_stat's rule
    rows[:, 4, :, 1::2] = -rows[:, 4, :, 0::2]  # odd and even elements of opposite sign (the nibble order)
    return rows


@pytest.mark.parametrize("fmt", sorted(FUSED_WRITE_FORMATS))
@pytest.mark.parametrize("hkv,d", [(1, 32), (3, 80), (2, 128)])
# bf16 rows on a GPU only: the interpreter's bf16 arithmetic is wrong
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, *([torch.bfloat16] if DEVICE == "cuda" else [])])
def test_the_fused_write_stores_the_codecs_bytes(fmt, hkv, d, dtype):
    g = seeded(11)
    rows = _rows(12, hkv, d, g).to(device=DEVICE, dtype=dtype)
    if dtype != torch.float32:
        rows = rows.clamp(-6e4, 6e4)
    ours, theirs = _pair(fmt, hkv, d)
    slots = torch.cat([ours.slots(0, torch.arange(5, 11)), ours.slots(1, torch.arange(0, 6))]).to(DEVICE)
    slots[3] = -1  # padding: skipped by both
    write_quantized_rows(ours, rows[0], rows[1], slots)
    theirs.write(rows[0], rows[1], slots)
    assert theirs.saturated == 0  # a head scaled by its own amax never saturates: nothing to count
    for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert torch.equal(a, b), (name, (a != b).nonzero()[:5].tolist())


def test_strided_rows_and_slots_past_the_pool():
    """K and V sliced from one fused QKV tensor (rows strided past Hkv x D), int32 slots, and a slot past the pool:
    skipped, as the FP8 write skips it (the checked write refuses it)."""
    g = seeded(5)
    qkv = torch.randn(6, 3 * 2, 64, generator=g).to(DEVICE)
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    assert k.stride(0) == 3 * 2 * 64
    ours, theirs = _pair("int4_token_head", 2, 64)
    slots = ours.slots(0, torch.arange(6)).to(DEVICE)
    before = ours.k_pages.clone()
    write_quantized_rows(ours, k, v, slots.to(torch.int32))
    theirs.write(k.contiguous(), v.contiguous(), slots)
    for name in ("k_pages", "v_pages", "k_scales", "v_scales"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    past = torch.full_like(slots, ours.num_blocks * ours.block_size)
    write_quantized_rows(ours, k * 3, v * 3, past)
    assert torch.equal(ours.k_pages, theirs.k_pages) and not torch.equal(before, ours.k_pages)


def test_the_fused_write_refuses_what_it_does_not_store():
    cache = QuantizedPagedKVCache.empty("int8_token_head", 1, 8, 2, 32, block_size=8)
    k = torch.zeros(3, 2, 32)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="fused write stores"):
        write_quantized_rows(QuantizedPagedKVCache.empty("mxfp4", 1, 8, 2, 32, block_size=8), k, k, slots)
    with pytest.raises(TypeError, match="cache must be a QuantizedPagedKVCache, got PagedKVCache"):
        write_quantized_rows(PagedKVCache.empty(1, 8, 2, 32, block_size=8), k, k, slots)
    with pytest.raises(ValueError, match=r"k has shape \(3, 2, 16\)"):
        write_quantized_rows(cache, torch.zeros(3, 2, 16), k, slots)
    with pytest.raises(ValueError, match=r"k has shape .* strides \(64, 1, 2\)"):
        write_quantized_rows(cache, torch.zeros(3, 32, 2).transpose(1, 2), k, slots)
    with pytest.raises(TypeError, match="v has dtype int32"):
        write_quantized_rows(cache, k, k.int(), slots)
    with pytest.raises(ValueError, match="v has 2 rows but k has 3"):
        write_quantized_rows(cache, k, k[:2], slots)
    with pytest.raises(TypeError, match="slot_mapping has dtype float32"):
        write_quantized_rows(cache, k, k, slots.float())
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor"):
        write_quantized_rows(cache, k, k, [0, 1, 2])
    with pytest.raises(ValueError, match=r"slot_mapping has shape \(2,\) .* expected \[3\]"):
        write_quantized_rows(cache, k, k, slots[:2])
