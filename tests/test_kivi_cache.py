"""KIVI's 4-bit pages (fp8kv.cache.KIVIPagedKVCache): bit for bit what fp8kv.kv_formats.quantize gives a full key
group and a token's values, the same bytes however the tokens were batched, the residual read as it is, the bytes
a token costs as the planner counts them, and bad input refused by name."""

from __future__ import annotations

import pytest
import torch
from fixtures import seeded

from fp8kv.cache import KIVIPagedKVCache
from fp8kv.kv_formats import quantize

B, T, H, D = 3, 150, 2, 64
LENS = [150, 31, 64]  # groups of 32: 4 full and 22 waiting, none full and 31 waiting, exactly 2 full
ARRAYS = ("k_pages", "v_pages", "k_scales", "k_zeros", "v_scales", "v_zeros", "k_residual")


def _kv(dtype=torch.float16, seed=0):
    g = seeded(seed)
    k = torch.randn(B, T, H, D, generator=g) * torch.linspace(0.2, 4.0, D)  # channels of different ranges, as keys
    return k.to(dtype), torch.randn(B, T, H, D, generator=g).to(dtype)


@pytest.mark.parametrize("group,block_size", [(32, 32), (32, 64), (64, 128)])
def test_pages_hold_what_quantize_gives_full_groups_and_tokens(group, block_size):
    k, v = _kv()
    cache = KIVIPagedKVCache.from_dense(group, k, v, LENS, block_size=block_size, max_seq_len=200)
    for i, n in enumerate(LENS):
        full = n // group * group
        kk, vv = cache.gather(i)
        assert kk.shape == vv.shape == (n, H, D) and kk.dtype == vv.dtype == torch.float32
        enc = quantize(k[i, :full], f"kivi4_key_g{group}")
        assert torch.equal(kk[:full], enc.dequantize())
        assert torch.equal(kk[full:], k[i, full:n].float())  # the unfilled group, as it came (fp16)
        assert torch.equal(vv, quantize(v[i, :n], f"kivi4_value_g{group}").dequantize())
        if full:  # 4-bit codes on a min..max grid: within half a step of the group's scale, and not exact
            err = (kk[:full] - k[i, :full].float()).abs()
            half_step = 0.5 * enc.scales.float().repeat_interleave(group, dim=0)
            assert err.max() > 0 and bool((err <= half_step * 1.001 + 1e-3).all())


def test_the_same_bytes_however_the_tokens_came():
    """Token by token, in uneven batches, or all at once: the pages, scales and residuals are equal."""
    k, v = _kv()
    bulk = KIVIPagedKVCache.from_dense(32, k, v, LENS, block_size=64, max_seq_len=200)
    steps = KIVIPagedKVCache.empty(32, B, 200, H, D, block_size=64)
    steps.block_table.copy_(bulk.block_table)
    t = 0
    for step in (1, 5, 40, 1, 3, 100):
        counts = [max(0, min(step, n - t)) for n in LENS]
        rows = torch.cat([k[i, t:t + c] for i, c in enumerate(counts)]), torch.cat([v[i, t:t + c] for i, c in enumerate(counts)])
        steps.append_tokens(*rows, counts)
        t += step
    assert steps.seq_lens.tolist() == LENS
    for name in ARRAYS:
        assert torch.equal(getattr(bulk, name), getattr(steps, name)), name


def test_keys_wait_in_the_residual_in_its_dtype():
    k, v = _kv(torch.float32)
    for dtype in (torch.float16, torch.float32):
        cache = KIVIPagedKVCache.from_dense(32, k, v, LENS, block_size=32, residual_dtype=dtype)
        kk, _ = cache.gather(1)  # 31 keys: all in the residual
        assert torch.equal(kk, k[1, :31].to(dtype).float())
        kk, _ = cache.gather(0)  # the full groups are quantized from the residual's rounding
        assert torch.equal(kk[:128], quantize(k[0, :128].to(dtype), "kivi4_key_g32").dequantize())


def test_the_models_kivi_store_and_load_is_the_pages_read():
    """Notebook 06's KIVI (fp8kv.models.quantize_kv: whole key groups, the rest in bf16) reads what a KIVI cache
    with a bf16 residual holds for the same bf16 prompt."""
    from fp8kv.models.kv_config import KVQuantConfig, quantize_kv

    k, v = (t.to(torch.bfloat16) for t in _kv(torch.float32))
    cfg = KVQuantConfig(fmt="kivi4_g32")
    cache = KIVIPagedKVCache.from_dense(32, k, v, LENS, block_size=64, residual_dtype=torch.bfloat16)
    for i, n in enumerate(LENS):
        kk, vv = cache.gather(i)
        for which, x, paged in (("k", k, kk), ("v", v, vv)):
            model, _ = quantize_kv(x[i:i + 1, :n].transpose(1, 2), cfg, which, 0)
            assert torch.equal(model[0].transpose(0, 1).float(), paged.to(torch.bfloat16).float()), (i, which)


def test_an_empty_sequence_reads_as_no_tokens():
    k, v = KIVIPagedKVCache.empty(32, 2, 64, H, D).gather(1)
    assert k.shape == v.shape == (0, H, D)


def test_bytes_per_token_are_the_planners():
    cache = KIVIPagedKVCache.empty(64, 2, 256, H, 128, block_size=128)
    assert cache.bytes_per_token() == cache.footprint().per_token  # codes 2 x 64 B a head; scales and zeros
    assert cache.fixed_nbytes == 2 * 64 * H * 128 * 2  # a 64-key fp16 residual a sequence


def test_bad_input_is_refused_by_name():
    k, v = _kv()
    with pytest.raises(ValueError, match="block_size=48; .* multiple of 32"):
        KIVIPagedKVCache.empty(32, 1, 64, H, D, block_size=48)
    with pytest.raises(ValueError, match="head_dim=48; .* multiple of 32"):
        KIVIPagedKVCache.empty(32, 1, 64, H, 48)
    with pytest.raises(ValueError, match="group=16"):
        KIVIPagedKVCache.empty(16, 1, 64, H, D)
    with pytest.raises(TypeError, match="residual_dtype"):
        KIVIPagedKVCache.empty(32, 1, 64, H, D, residual_dtype=torch.int8)
    cache = KIVIPagedKVCache.empty(32, 2, 64, H, D)
    with pytest.raises(ValueError, match="exceeds its capacity"):
        cache.append_tokens(k[0, :65], v[0, :65], [65, 0])
    bad = k[0, :3].clone()
    bad[1, 0, 5] = float("nan")
    with pytest.raises(ValueError, match="k_new"):
        cache.append_tokens(bad, v[0, :3], [3, 0])
    assert cache.seq_lens.tolist() == [0, 0] and not cache.k_residual.any()  # nothing written
    cache.k_scales[0, 0, 0, 0] = 0.0
    with pytest.raises(ValueError, match=r"k_scales\[0, 0, 0, 0\]=0.0; scales must be positive"):
        cache.gather(0)
    with pytest.raises(ValueError, match="k_residual has shape"):
        KIVIPagedKVCache(32, cache.k_pages, cache.v_pages, cache.k_scales.fill_(1.0), cache.k_zeros, cache.v_scales,
                         cache.v_zeros, cache.k_residual[:1], cache.block_table, cache.seq_lens)
