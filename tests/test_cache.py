"""fp8kv.cache.PagedKVCache: placement in shuffled pages, bit-exact round trips, writes, validation."""

from __future__ import annotations

import math
import re

import pytest
import torch
from fixtures import DEVICE

import fp8kv
from fp8kv.cache import PagedKVCache
from fp8kv.formats import kv_dtype_info
from fp8kv.ops import write_cache
from fp8kv.quant import quantize
from fp8kv.reference import decode as ref_decode

GRANS = ("tensor", "head", "token_head", "channel")
FP8 = ("fp8_e4m3", "fp8_e5m2")
# Lengths with 1, one under / exactly / one over a 16-token block, and a non-multiple (54).
LENS = [1, 15, 16, 17, 54]
PAD = 1e6  # padding rows get a huge value: it must not leak into pages or scales


def padded(lens, h, d, dtype, gen, spread=1.0):
    """Padded [B, max_len, H, D] K and V with PAD beyond each sequence's length."""
    b, t = len(lens), max(lens)
    k = torch.randn(b, t, h, d, generator=gen) * spread
    v = torch.randn(b, t, h, d, generator=gen) * spread
    for i, n in enumerate(lens):
        k[i, n:] = PAD
        v[i, n:] = -PAD
    return k.to(dtype), v.to(dtype)


def page_rows(cache: PagedKVCache, pages: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Rows [n, Hkv, D] of sequence b read straight from the pages via the block table."""
    bs = cache.block_size
    rows = []
    for t in range(n):
        blk = int(cache.block_table[b, t // bs])
        rows.append(pages[blk, t % bs] if cache.layout == "NHD" else pages[blk, :, t % bs])
    return torch.stack(rows) if rows else pages.new_zeros(0, cache.num_kv_heads, cache.head_dim)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def check_shuffled(cache: PagedKVCache, lens):
    bs = cache.block_size
    used = torch.cat([cache.block_table[i, : (n + bs - 1) // bs] for i, n in enumerate(lens)])
    assert len(set(used.tolist())) == used.numel()  # no page shared between sequences
    flat = cache.block_table.flatten()
    assert not torch.equal(flat, torch.arange(flat.numel(), dtype=torch.int32))
    assert cache.block_table.dtype == torch.int32 and cache.seq_lens.dtype == torch.int32


# ------------------------------------------------------------------------------ from_dense / gather


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_round_trip_is_quantize_of_valid_tokens(kv_dtype, gran, layout, gen):
    h, d = 2, 24
    k, v = padded(LENS, h, d, torch.bfloat16, gen, spread=3.0)
    cache = PagedKVCache.from_dense(k, v, LENS, block_size=16, kv_dtype=kv_dtype, granularity=gran,
                                    layout=layout)
    fmt = kv_dtype_info(kv_dtype)[2]
    assert cache.seq_lens.tolist() == LENS and cache.layout == layout and cache.granularity == gran
    page_shape = (cache.num_blocks, 16, h, d) if layout == "NHD" else (cache.num_blocks, h, 16, d)
    assert cache.k_pages.shape == page_shape and cache.k_pages.dtype == fmt.torch_dtype
    check_shuffled(cache, LENS)
    k_all = torch.cat([k[i, :n] for i, n in enumerate(LENS)])
    v_all = torch.cat([v[i, :n] for i, n in enumerate(LENS)])
    qk, qv = quantize(k_all, fmt, gran), quantize(v_all, fmt, gran)
    assert float(k_all.abs().max()) < PAD  # padding excluded from the expected scales
    if gran != "token_head":
        assert torch.equal(cache.k_scale, qk.scale) and torch.equal(cache.v_scale, qv.scale)
    start = 0
    for i, n in enumerate(LENS):
        sl = slice(start, start + n)
        gk, gv = cache.gather(i)
        assert gk.dtype == torch.float32 and gk.shape == (n, h, d)
        assert torch.equal(gk, qk.dequantize()[sl]) and torch.equal(gv, qv.dequantize()[sl])
        # The codes sit where the block table says, independent of gather().
        assert torch.equal(as_bits(page_rows(cache, cache.k_pages, i, n)), as_bits(qk.data[sl]))
        assert torch.equal(as_bits(page_rows(cache, cache.v_pages, i, n)), as_bits(qv.data[sl]))
        if gran == "token_head":
            rows = [cache.k_scale[int(cache.block_table[i, t // 16]), t % 16] for t in range(n)]
            assert torch.equal(torch.stack(rows), qk.scale[sl])
        start += n
    assert cache.saturated == 0  # amax scales never saturate


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16"])
def test_16bit_round_trip_is_exact(kv_dtype, layout, gen):
    dtype = kv_dtype_info(kv_dtype)[1]
    lens = [17, 1, 54, 16, 15]
    k, v = padded(lens, 4, 40, dtype, gen)
    cache = PagedKVCache.from_dense(k, v, lens, block_size=8, kv_dtype=kv_dtype, granularity="channel",
                                    layout=layout)
    assert cache.k_pages.dtype == dtype and cache.granularity == "tensor"  # no scales for 16-bit
    assert float(cache.k_scale) == 1.0 and cache.scale_nbytes == 0
    check_shuffled(cache, lens)
    for i, n in enumerate(lens):
        gk, gv = cache.gather(i)
        assert torch.equal(gk, k[i, :n].to(torch.float32)) and torch.equal(gv, v[i, :n].to(torch.float32))
        assert torch.equal(page_rows(cache, cache.k_pages, i, n), k[i, :n])


def test_list_input_equals_padded_input(gen):
    lens = [3, 33, 8]
    k, v = padded(lens, 2, 24, torch.float32, gen)
    a = PagedKVCache.from_dense(k, v, lens, block_size=8, granularity="head")
    b = PagedKVCache.from_dense([k[i, :n] for i, n in enumerate(lens)], [v[i, :n] for i, n in enumerate(lens)],
                                torch.tensor(lens), block_size=8, granularity="head")
    assert torch.equal(a.block_table, b.block_table)
    assert torch.equal(a.k_pages.view(torch.uint8), b.k_pages.view(torch.uint8))
    assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)


def test_layouts_and_seeds_agree_on_content(gen):
    lens = [5, 40]
    k, v = padded(lens, 2, 24, torch.float16, gen)
    nhd = PagedKVCache.from_dense(k, v, lens, block_size=16, granularity="channel", seed=0)
    hnd = PagedKVCache.from_dense(k, v, lens, block_size=16, granularity="channel", layout="HND", seed=0)
    other = PagedKVCache.from_dense(k, v, lens, block_size=16, granularity="channel", seed=7)
    assert torch.equal(nhd.k_pages.view(torch.uint8), hnd.k_pages.transpose(1, 2).view(torch.uint8))
    assert not torch.equal(nhd.block_table, other.block_table)
    for i in range(2):
        assert all(torch.equal(a, b) for a, b in zip(nhd.gather(i), other.gather(i), strict=True))


def test_scale_options(gen):
    lens = [15, 17]
    k, v = padded(lens, 2, 24, torch.float32, gen, spread=10.0)
    k_all, v_all = k[0, :15].abs().max(), v[1, :17].abs().max()
    k_all = torch.maximum(k_all, k[1, :17].abs().max())
    v_all = torch.maximum(v_all, v[0, :15].abs().max())
    c = PagedKVCache.from_dense(k, v, lens, k_scale="vllm_k", v_scale="vllm_v")
    assert torch.equal(c.k_scale, k_all / 200) and torch.equal(c.v_scale, v_all / 100)
    c = PagedKVCache.from_dense(k, v, lens, scale=0.5, kv_dtype="fp8_e5m2")
    assert float(c.k_scale) == float(c.v_scale) == 0.5
    gk, _ = c.gather(1)
    expected = quantize(k[1, :17], "e5m2", "tensor", 0.5).dequantize()
    assert torch.equal(gk, expected)
    s = torch.rand(2, generator=gen) + 0.1
    c = PagedKVCache.from_dense(k, v, lens, granularity="head", scale=s)
    assert torch.equal(c.k_scale, s) and torch.equal(c.v_scale, s)
    c.k_scale[0] = 99.0  # the cache owns its scales
    assert float(s[0]) != 99.0


def test_static_scale_saturates_and_counts(gen):
    lens = [17, 54]
    k, v = padded(lens, 2, 24, torch.bfloat16, gen, spread=300.0)
    c = PagedKVCache.from_dense(k, v, lens, scale=1.0)
    # e4m3's tie 464 rounds to max 448 (even mantissa): only what lies above it is an overflow
    exp = sum(int((t[i, :n].float().abs() > 464).sum()) for t in (k, v) for i, n in enumerate(lens))
    assert c.saturated == exp > 0
    for i in range(len(lens)):
        gk, gv = c.gather(i)
        assert gk.abs().max() <= 448 and torch.isfinite(gv).all()


def test_empty_sequence_and_max_seq_len(gen):
    lens = [0, 9]
    k, v = padded([1, 9], 2, 24, torch.float32, gen)
    c = PagedKVCache.from_dense(k, v, lens, block_size=8, max_seq_len=40)
    assert c.max_blocks_per_seq == 5 and c.seq_lens.tolist() == [0, 9]
    gk, gv = c.gather(0)
    assert gk.shape == (0, 2, 24) and gv.shape == (0, 2, 24)
    assert c.gather(1)[0].shape == (9, 2, 24)


# ----------------------------------------------------------------------------------- write / append


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("gran", GRANS)
def test_write_with_slot_mapping_skips_padding(gran, layout, gen):
    h, d, bs = 2, 40, 8
    static = {"tensor": torch.tensor(0.01), "head": torch.tensor([0.01, 0.02]),
              "channel": torch.rand(h, d, generator=gen) * 0.02 + 0.001, "token_head": None}[gran]
    kw = {} if static is None else {"k_scale": static, "v_scale": static * 2}
    c = PagedKVCache.empty(2, 20, h, d, block_size=bs, kv_dtype="fp8_e4m3", granularity=gran, layout=layout, **kw)
    k_new = torch.randn(6, h, d, generator=gen) * 4
    v_new = torch.randn(6, h, d, generator=gen) * 4
    k_new[1] = v_new[1] = 1e9  # padding rows (slot -1): must be skipped, not counted as saturated
    k_new[3] = v_new[3] = -1e9
    slots = torch.tensor([0, -1, 13, -1, c.num_blocks * bs - 1, 21])
    sat = c.write(k_new, v_new, slots)
    keep = slots >= 0
    fmt = c.fmt
    k_scale = quantize(k_new[keep], fmt, gran).scale if static is None else static
    v_scale = quantize(v_new[keep], fmt, gran).scale if static is None else static * 2
    qk = quantize(k_new[keep], fmt, gran, k_scale)
    qv = quantize(v_new[keep], fmt, gran, v_scale)
    assert sat == c.saturated == qk.saturated + qv.saturated
    nhd_k = c.k_pages if layout == "NHD" else c.k_pages.transpose(1, 2)
    nhd_v = c.v_pages if layout == "NHD" else c.v_pages.transpose(1, 2)
    flat_k = nhd_k.reshape(-1, h, d).view(torch.uint8)
    flat_v = nhd_v.reshape(-1, h, d).view(torch.uint8)
    kept = slots[keep]
    assert torch.equal(flat_k[kept], qk.data.view(torch.uint8))
    assert torch.equal(flat_v[kept], qv.data.view(torch.uint8))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[kept] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()
    if gran == "token_head":  # one scale per written slot and head, stored beside the token
        flat_s = c.k_scale.reshape(-1, h)
        assert c.k_scale.shape == (c.num_blocks, bs, h)
        assert torch.equal(flat_s[kept], k_new[keep].abs().amax(-1) / fmt.max)
        assert torch.equal(c.v_scale.reshape(-1, h)[kept], v_new[keep].abs().amax(-1) / fmt.max)
        assert (flat_s[untouched] == 1).all()
    assert c.seq_lens.tolist() == [0, 0]  # write() places tokens; it does not extend sequences


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16"])
def test_append_extends_each_sequence(gran, kv_dtype, gen):
    lens = [1, 15, 16]
    k, v = padded(lens, 2, 24, torch.bfloat16, gen)
    c = PagedKVCache.from_dense(k, v, lens, block_size=16, kv_dtype=kv_dtype, granularity=gran,
                                max_seq_len=18)
    before = [c.gather(i) for i in range(3)]
    sat0 = c.saturated
    k_new = torch.randn(3, 2, 24, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(3, 2, 24, generator=gen).to(torch.bfloat16)
    sat = c.append(k_new, v_new)
    assert c.seq_lens.tolist() == [2, 16, 17]  # 16 -> 17 crosses into a new block
    exp_sat = 0
    for i, n in enumerate(lens):
        gk, gv = c.gather(i)
        assert torch.equal(gk[:n], before[i][0]) and torch.equal(gv[:n], before[i][1])
        if c.is_fp8:
            s_k = None if gran == "token_head" else c.k_scale
            s_v = None if gran == "token_head" else c.v_scale
            qk = quantize(k_new[i : i + 1], c.fmt, gran, s_k)
            qv = quantize(v_new[i : i + 1], c.fmt, gran, s_v)
            exp_k, exp_v = qk.dequantize()[0], qv.dequantize()[0]
            exp_sat += qk.saturated + qv.saturated  # static scales may be too small for new tokens
        else:
            exp_k, exp_v = k_new[i].float(), v_new[i].float()
        assert torch.equal(gk[n], exp_k) and torch.equal(gv[n], exp_v)
    assert sat == exp_sat == c.saturated - sat0
    c.append(k_new, v_new)
    assert c.seq_lens.tolist() == [3, 17, 18]  # 18 = max_seq_len, rows of 2 blocks x 16 = 32 slots
    rows_k, rows_v = k_new[:1].expand(15, -1, -1), v_new[:1].expand(15, -1, -1)
    with pytest.raises(ValueError, match=r"sequence 2: seq_len 18 \+ 15 new tokens exceeds its capacity of "
                                         r"32 tokens; build the cache with a larger max_seq_len"):
        c.append_tokens(rows_k, rows_v, [0, 0, 15])
    assert c.seq_lens.tolist() == [3, 17, 18]
    c.append_tokens(rows_k[:14], rows_v[:14], [0, 0, 14])  # exactly fills the row
    assert c.seq_lens.tolist() == [3, 17, 32]
    assert torch.equal(c.gather(2)[0][18:], c.gather(2)[0][18:19].expand(14, -1, -1))


def test_write_saturation_accumulates(gen):
    c = PagedKVCache.empty(1, 16, 2, 24, kv_dtype="fp8_e5m2", k_scale=1.0, v_scale=1.0)
    k_new = torch.zeros(2, 2, 24)
    k_new[0, 0, :3] = torch.tensor([61440.0, 1e6, 60000.0])  # 60000 rounds to max: not counted
    v_new = torch.zeros(2, 2, 24)
    v_new[1, 1, 0] = -1e7
    assert c.write(k_new, v_new, [0, 1]) == 3
    assert c.write(k_new, v_new, [2, -1]) == 2
    assert c.saturated == 5
    flat = c.k_pages.reshape(-1, 2, 24).to(torch.float32)
    assert flat[0, 0, :3].tolist() == [57344.0, 57344.0, 57344.0] and torch.isfinite(flat).all()
    assert float(c.v_pages.reshape(-1, 2, 24)[1, 1, 0].float()) == -57344.0


@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
def test_16bit_write_saturates_instead_of_inf(kv_dtype):
    """fp32 values past the 16-bit range are clamped to ±finfo.max and counted, never stored as inf."""
    dtype = kv_dtype_info(kv_dtype)[1]
    fi = torch.finfo(dtype)
    # fp16: max 65504, ulp 32 there, so 65519 rounds down to max and 65520 (the tie) overflows.
    big = [65519.0, 65520.0, -1e5, 1.0] if kv_dtype == "fp16" else [3.0e38, 3.4e38, -3.4e38, 1.0]
    k = torch.zeros(1, 3, 1, 8)
    k[0, 0, 0, :4] = torch.tensor(big)
    bare = k.to(dtype)
    n_inf = int(torch.isinf(bare).sum())
    assert n_inf > 0  # the hazard being guarded against
    c = PagedKVCache.from_dense(k, k, [3], block_size=8, kv_dtype=kv_dtype)
    gk, gv = c.gather(0)
    assert torch.isfinite(gk).all() and torch.isfinite(gv).all()
    assert torch.equal(gk, bare[0].to(torch.float32).clamp(-fi.max, fi.max))
    assert c.saturated == 2 * n_inf


# ---------------------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16"])
def test_nbytes_includes_scales(kv_dtype, gran):
    h, d, bs = 4, 40, 16
    c = PagedKVCache.empty(3, 50, h, d, block_size=bs, kv_dtype=kv_dtype, granularity=gran)
    nb = c.num_blocks
    assert nb == 3 * 4  # ceil(50 / 16) = 4 blocks per sequence
    elem = 1 if kv_dtype.startswith("fp8") else 2
    pages = 2 * nb * bs * h * d * elem
    if elem == 2:
        scales = 0
    else:
        scales = 2 * 4 * {"tensor": 1, "head": h, "channel": h * d, "token_head": nb * bs * h}[gran]
    assert c.nbytes == pages + scales
    assert c.scale_nbytes == scales
    per_token = 2 * h * d * elem + (2 * h * 4 if elem == 1 and gran == "token_head" else 0)
    assert c.bytes_per_token() == per_token


# ----------------------------------------------------------------------------------- validation


def _parts(kv_dtype="fp8_e4m3", blocks=4, bs=16, h=2, d=24):
    dtype = kv_dtype_info(kv_dtype)[1]
    pages = torch.zeros(blocks, bs, h, d, dtype=dtype)
    return pages, pages.clone(), torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)


def test_constructor_accepts_valid_parts_and_ignores_unused_table_entries():
    kp, vp, bt, sl = _parts()
    bt[0, 1] = 99  # 20 tokens use both blocks of the row, so entry 1 is checked
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=99 is out of range \[0, 4\)"):
        PagedKVCache(kp, vp, bt, sl)
    sl[0] = 16  # now only block 0 of the row is used: entry 1 is never read
    c = PagedKVCache(kp, vp, bt, sl)
    assert (c.num_blocks, c.block_size, c.num_kv_heads, c.head_dim, c.batch_size) == (4, 16, 2, 24, 1)


@pytest.mark.parametrize("bs", [0, -3])
def test_block_size_is_a_positive_int(bs, gen):
    k, v = padded([5], 2, 24, torch.float32, gen)
    with pytest.raises(ValueError, match=rf"block_size={bs}; expected an int >= 1"):
        PagedKVCache.from_dense(k, v, [5], block_size=bs)


@pytest.mark.parametrize("bs", [1, 3, 5, 12, 24, 100])
def test_any_page_size_holds_the_rows_it_was_given(bs, gen):
    """Pages of any size (SGLang's 1, hybrid models' odd sizes): every row reads back what 16-token pages hold."""
    k, v = padded([5, 17, 1], 2, 24, torch.float32, gen)
    c = PagedKVCache.from_dense(k, v, [5, 17, 1], block_size=bs)
    ref = PagedKVCache.from_dense(k, v, [5, 17, 1], block_size=16)
    assert c.block_size == bs and c.block_table.shape[1] == -(-17 // bs)
    for i in range(3):
        (kr, vr), (ks, vs) = c.gather(i), ref.gather(i)
        assert torch.equal(kr, ks) and torch.equal(vr, vs)


def test_table_and_length_errors():
    kp, vp, bt, sl = _parts()
    bt[0, 0] = -1
    with pytest.raises(ValueError, match=r"block_table\[0, 0\]=-1 is out of range \[0, 4\)"):
        PagedKVCache(kp, vp, bt, sl)
    kp, vp, bt, sl = _parts()
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=33 exceeds the capacity of its block-table row "
                                         r"\(2 blocks x 16 = 32 tokens\)"):
        PagedKVCache(kp, vp, bt, torch.tensor([33], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=-2 is negative"):
        PagedKVCache(kp, vp, bt, torch.tensor([-2], dtype=torch.int32))
    with pytest.raises(TypeError, match=r"block_table must be int32, got torch.int64"):
        PagedKVCache(kp, vp, bt.to(torch.int64), sl)
    with pytest.raises(TypeError, match=r"seq_lens must be int32, got torch.int64"):
        PagedKVCache(kp, vp, bt, sl.to(torch.int64))
    with pytest.raises(ValueError, match=r"seq_lens has 2 entries but block_table has 1 rows"):
        PagedKVCache(kp, vp, bt, torch.tensor([1, 1], dtype=torch.int32))


def test_page_errors():
    kp, vp, bt, sl = _parts()
    with pytest.raises(TypeError, match=r"k_pages has dtype torch.bfloat16, but kv_dtype='fp8_e4m3' stores "
                                        r"torch.float8_e4m3fn"):
        PagedKVCache(kp.to(torch.bfloat16), vp, bt, sl)
    with pytest.raises(TypeError, match=r"v_pages has dtype torch.float8_e5m2, but kv_dtype='fp8_e4m3'"):
        PagedKVCache(kp, vp.view(torch.float8_e5m2), bt, sl)
    nc = torch.zeros(4, 2, 16, 24, dtype=torch.float8_e4m3fn).transpose(1, 2)
    assert nc.shape == kp.shape
    with pytest.raises(ValueError, match=r"k_pages must be contiguous; call .contiguous\(\) first"):
        PagedKVCache(nc, vp, bt, sl)
    with pytest.raises(ValueError, match=r"v_pages must be contiguous"):
        PagedKVCache(kp, nc, bt, sl)
    with pytest.raises(ValueError, match=r"k_pages must be 4-D .* got shape \(4, 16, 48\)"):
        PagedKVCache(kp.reshape(4, 16, 48), vp, bt, sl)
    with pytest.raises(ValueError, match=r"must have the same shape"):
        PagedKVCache(kp, vp[:3].contiguous(), bt, sl)
    with pytest.raises(ValueError, match=r"layout='NDH'; expected one of \('NHD', 'HND'\)"):
        PagedKVCache(kp, vp, bt, sl, layout="NDH")
    with pytest.raises(ValueError, match=r"granularity='block'; expected one of"):
        PagedKVCache(kp, vp, bt, sl, granularity="block")
    with pytest.raises(ValueError, match=r"kv_dtype='int8' is not supported"):
        PagedKVCache(kp, vp, bt, sl, kv_dtype="int8")


def test_k_and_v_pages_sharing_memory_are_refused():
    """``k = v = torch.zeros(...)``: every write of V would land on K's pages, and K read back as V."""
    kp, vp, bt, sl = _parts()
    with pytest.raises(ValueError, match=r"k_pages and v_pages share memory .* v_pages=k_pages.clone\(\)"):
        PagedKVCache(kp, kp, bt, sl)
    both = torch.zeros(2 * kp.numel(), dtype=kp.dtype)
    with pytest.raises(ValueError, match="k_pages and v_pages share memory"):  # overlapping views of one buffer
        PagedKVCache(both[:kp.numel()].view(kp.shape), both[8:8 + kp.numel()].view(kp.shape), bt, sl)
    halves = both.view(2, *kp.shape)  # disjoint halves of one buffer are two arrays
    PagedKVCache(halves[0], halves[1], bt, sl)
    c = PagedKVCache(kp, vp, bt, sl)
    c.v_pages = c.k_pages  # replaced after construction: named where the cache is next read or written
    with pytest.raises(ValueError, match="k_pages and v_pages share memory"):
        c.write(torch.ones(1, 2, 24), torch.zeros(1, 2, 24), [0])
    with pytest.raises(ValueError, match="k_pages and v_pages share memory"):
        fp8kv.decode(torch.zeros(1, 4, 24), c, backend="reference")


def test_device_mismatch_errors():
    """'meta' tensors stand in for a second device: the checks run before any data is read."""
    kp, vp, bt, sl = _parts()
    meta_pages = torch.empty(vp.shape, dtype=vp.dtype, device="meta")
    with pytest.raises(ValueError, match=r"v_pages is on meta but k_pages is on cpu"):
        PagedKVCache(kp, meta_pages, bt, sl)
    with pytest.raises(ValueError, match=r"block_table is on meta but the pages are on cpu"):
        PagedKVCache(kp, vp, bt.to("meta"), sl)
    with pytest.raises(ValueError, match=r"seq_lens is on meta but the pages are on cpu"):
        PagedKVCache(kp, vp, bt, sl.to("meta"))
    c = PagedKVCache(kp, vp, bt, sl)
    k_new = torch.zeros(1, 2, 24)
    with pytest.raises(ValueError, match=r"k_new is on meta but the cache is on cpu"):
        c.write(k_new.to("meta"), k_new, [0])
    with pytest.raises(ValueError, match=r"v_new is on meta but the cache is on cpu"):
        c.write(k_new, k_new.to("meta"), [0])


def test_scale_errors():
    kp, vp, bt, sl = _parts()
    with pytest.raises(ValueError, match=r"k_scale of shape \(3,\) does not fit granularity 'head': "
                                         r"expected shape \(2,\)"):
        PagedKVCache(kp, vp, bt, sl, granularity="head", k_scale=torch.ones(3))
    with pytest.raises(ValueError, match=r"v_scale must be positive and finite"):
        PagedKVCache(kp, vp, bt, sl, v_scale=0.0)
    with pytest.raises(ValueError, match=r"k_scale must be positive and finite"):
        PagedKVCache(kp, vp, bt, sl, granularity="head", k_scale=torch.tensor([1.0, float("nan")]))
    kp16, vp16, _, _ = _parts("bf16")
    with pytest.raises(ValueError, match=r"k_scale must be 1.0 \(or None\) for 16-bit kv_dtype='bf16'"):
        PagedKVCache(kp16, vp16, bt, sl, kv_dtype="bf16", k_scale=0.5)


def test_write_errors(gen):
    c = PagedKVCache.empty(2, 32, 2, 24, block_size=16)
    good = torch.randn(3, 2, 24, generator=gen)
    with pytest.raises(ValueError, match=r"k_new must be \[N, 2, 24\] \(tokens, Hkv, D\); got \(3, 2, 25\)"):
        c.write(torch.zeros(3, 2, 25), good, [0, 1, 2])
    with pytest.raises(ValueError, match=r"v_new must be \[N, 2, 24\] .* got \(3, 48\)"):
        c.write(good, torch.zeros(3, 48), [0, 1, 2])
    with pytest.raises(TypeError, match=r"k_new has dtype torch.int32; expected one of"):
        c.write(torch.zeros(3, 2, 24, dtype=torch.int32), good, [0, 1, 2])
    with pytest.raises(TypeError, match=r"k_new must be a torch.Tensor, got list"):
        c.write([[0.0]], good, [0, 1, 2])
    with pytest.raises(TypeError, match=r"k_new has dtype torch.float8_e4m3fn; expected one of"):  # torch's isfinite
        c.write(good.to(torch.float8_e4m3fn), good, [0, 1, 2])  # raised NotImplementedError
    bad = good.clone()
    bad[1, 0, 3] = float("nan")
    bad[2, 1, 0] = float("inf")
    with pytest.raises(ValueError, match=r"k_new has non-finite values \(first at index \(1, 0, 3\)\)"):
        c.write(bad, good, [0, 1, 2])
    with pytest.raises(ValueError, match=r"v_new has non-finite values \(first at index \(1, 0, 3\)\)"):
        c.write(good, bad, [0, 1, 2])
    with pytest.raises(ValueError, match=r"slot_mapping \(2,\), k_new \(3, 2, 24\) and v_new \(3, 2, 24\) must "
                                         r"agree on N"):
        c.write(good, good, [0, 1])
    with pytest.raises(ValueError, match=r"slot_mapping has slot 64 >= num_blocks x block_size = 64"):
        c.write(good, good, [0, 64, -1])
    assert c.saturated == 0 and (c.k_pages.view(torch.uint8) == 0).all()  # nothing was written


def test_from_dense_and_gather_errors(gen):
    k, v = padded([5, 7], 2, 24, torch.float32, gen)
    with pytest.raises(ValueError, match=r"k \(2\), v \(2\) and seq_lens \(3\) must have the same batch size"):
        PagedKVCache.from_dense(k, v, [5, 7, 1])
    with pytest.raises(ValueError, match=r"seq_lens\[1\]=8 is outside \[0, 7\] \(the tokens given\)"):
        PagedKVCache.from_dense(k, v, [5, 8])
    with pytest.raises(ValueError, match=r"sequence 0: k and v must be \[len, Hkv, D\] with equal shapes"):
        PagedKVCache.from_dense([k[0]], [v[0, :, :1]], [5])
    with pytest.raises(ValueError, match=r"seq_lens is empty"):
        PagedKVCache.from_dense([], [], [])
    k_nan = k.clone()
    k_nan[1, 2, 1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"k has 1 non-finite value\(s\) \(NaN/Inf\); the first is at index "
                                         r"\(7, 1, 5\)"):  # row 7 of the concatenated valid tokens
        PagedKVCache.from_dense(k_nan, v, [5, 7])
    with pytest.raises(ValueError, match=r"k has 1 non-finite value\(s\) .* index \(7, 1, 5\)"):  # named as given
        PagedKVCache.from_dense(k_nan, v, [5, 7], granularity="token_head")
    k_nan[0, 6] = float("nan")  # in sequence 0's padding (seq_len 5): never read
    k_nan[1, 2, 1, 5] = 0.0
    c = PagedKVCache.from_dense(k_nan, v, [5, 7])
    assert torch.isfinite(c.gather(0)[0]).all() and c.gather(0)[0].shape == (5, 2, 24)
    with pytest.raises(ValueError, match=r"sequence index 2 is out of range \[0, 2\)"):
        c.gather(2)
    with pytest.raises(ValueError, match=r"sequence index -1 is out of range"):
        c.gather(-1)


# ----------------------------------------------------------------------- saturation on both write paths


def test_bf16_rows_into_an_fp16_cache_store_max_not_inf():
    """fp16's max 65504 is not a bf16 value (it rounds to 65536, inf in fp16): the clamp is done in
    fp32, so both write paths store ±65504 and count the overflow, and decode stays finite."""
    k = torch.zeros(1, 16, 2, 16, dtype=torch.bfloat16)
    k[0, 3, 0, 0], k[0, 4, 1, 2] = 7e4, -7e4
    c = PagedKVCache.from_dense(k, k, [16], kv_dtype="fp16")
    gk, gv = c.gather(0)
    assert torch.isfinite(c.k_pages).all() and torch.isfinite(c.v_pages).all()
    assert float(gk[3, 0, 0]) == float(gv[3, 0, 0]) == 65504.0 and float(gk[4, 1, 2]) == -65504.0
    assert c.saturated == 4  # two values, in K and in V
    out, _ = ref_decode(torch.ones(1, 2, 16), c)
    assert torch.isfinite(out).all()
    # the Triton write runs where the pages are: a CUDA GPU, or the interpreter on CPU
    a, b = (PagedKVCache.empty(1, 16, 2, 16, kv_dtype="fp16", device=DEVICE) for _ in range(2))
    rows = k[0, :5].contiguous().to(DEVICE)
    slots = a.slots(0, list(range(5)))
    assert a.write(rows, -rows, slots) == int(write_cache(b, rows, -rows, slots)) == 4
    assert a.saturated == b.saturated == 4
    assert torch.equal(a.k_pages.view(torch.int16), b.k_pages.view(torch.int16))
    assert torch.equal(a.v_pages.view(torch.int16), b.v_pages.view(torch.int16))
    assert float(a.k_pages.float().abs().max()) == 65504.0


@pytest.mark.parametrize("kv_dtype", FP8)
def test_both_write_paths_count_only_what_rounds_past_max(kv_dtype):
    """The tie between max and the next code: e4m3's 464 rounds (to even) down to 448, not an
    overflow; e5m2's 61440 rounds up, one. Just above the tie both overflow. All are stored as ±max."""
    f = kv_dtype_info(kv_dtype)[2]
    tie = torch.tensor(f.overflow_threshold)
    above = torch.nextafter(tie, torch.tensor(math.inf))
    rows = torch.zeros(2, 2, 16)
    rows[0, 0, :2] = torch.stack([tie, -tie])
    rows[1, 1, :2] = torch.stack([above, -above])
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the fused write runs on a GPU, or interpreted on the CPU
    rows = rows.to(dev)
    a, b = (PagedKVCache.empty(1, 16, 2, 16, kv_dtype=kv_dtype, k_scale=1.0, v_scale=1.0, device=dev) for _ in range(2))
    per_side = 2 + (2 if kv_dtype == "fp8_e5m2" else 0)
    assert a.write(rows, rows, [0, 1]) == int(write_cache(b, rows, rows, torch.tensor([0, 1], device=dev))) \
        == 2 * per_side
    assert torch.equal(a.k_pages.view(torch.uint8), b.k_pages.view(torch.uint8))
    stored = a.k_pages.reshape(-1, 2, 16)[:2].float()
    assert stored[0, 0, :2].tolist() == stored[1, 1, :2].tolist() == [f.max, -f.max]


@pytest.mark.parametrize("kv_dtype,gran", [("fp8_e4m3", g) for g in GRANS] + [("fp16", "tensor")])
def test_values_beyond_fp32_are_refused_where_they_enter(kv_dtype, gran):
    """A finite float64 1e300 would be inf in the fp32 arithmetic (token_head: an inf scale, NaN
    reads): refused, naming the argument and the value, for every granularity and path."""
    c = PagedKVCache.empty(1, 16, 2, 16, kv_dtype=kv_dtype, granularity=gran)
    big = torch.randn(1, 2, 16, dtype=torch.float64)
    big[0, 1, 3] = 1e300
    ok = torch.randn(1, 2, 16, dtype=torch.float64)
    msg = (r"{} has 1 value\(s\) beyond float32's range; the first is at index \({}\) \(value 1e\+300\); "
           r"expected \|values\| <= 3.4028234663852886e\+38")
    with pytest.raises(ValueError, match=msg.format("k_new", "0, 1, 3")):
        c.write(big, ok, [0])
    with pytest.raises(ValueError, match=msg.format("v_new", "0, 1, 3")):
        c.write(ok, big, [0])
    with pytest.raises(ValueError, match=msg.format("k_new", "0, 1, 3")):
        write_cache(c, big, ok, torch.tensor([0]))
    with pytest.raises(ValueError, match=msg.format("k_new", "0, 1, 3")):
        c.append(big, ok)
    assert c.saturated == 0 and c.seq_lens.tolist() == [0] and (c.k_pages.float() == 0).all()
    assert (c.k_scale == 1).all()  # token_head: no inf scale stored either
    with pytest.raises(ValueError, match=msg.format("v", "0, 1, 3")):
        PagedKVCache.from_dense(ok[None], big[None], [1], kv_dtype=kv_dtype, granularity=gran)


# --------------------------------------------------------------------------------- scale arguments


def test_scales_the_cache_would_not_use_are_refused_not_ignored(gen):
    lens = [5, 7]
    k, v = padded(lens, 2, 24, torch.float32, gen)
    for bad in (-5.0, "bogus", 0.5, "vllm_k", torch.ones(7, 2)):
        with pytest.raises(ValueError, match=r"scale=.*: granularity='token_head' computes one scale per token "
                                             r"and head as it writes .* pass scale=None \(or 'amax'\)"):
            PagedKVCache.from_dense(k, v, lens, granularity="token_head", scale=bad)
    with pytest.raises(ValueError, match=r"v_scale=2.0: granularity='token_head'"):
        PagedKVCache.from_dense(k, v, lens, granularity="token_head", v_scale=2.0)
    a = PagedKVCache.from_dense(k, v, lens, granularity="token_head", scale="amax")
    b = PagedKVCache.from_dense(k, v, lens, granularity="token_head")
    assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.k_pages.view(torch.uint8), b.k_pages.view(torch.uint8))
    for kv in ("bf16", "fp16"):
        for bad, shown in (("bogus", "'bogus'"), ("amax", "'amax'"), (0.5, "0.5"),
                           (torch.tensor([1.0, 2.0]), "<float32 tensor of shape (2,)>")):
            shown = re.escape(shown)
            with pytest.raises(ValueError, match=rf"scale={shown}: kv_dtype='{kv}' is a 16-bit cache: it stores "
                                                 r"values unscaled, so a given scale would be ignored; pass "
                                                 r"scale=None \(or 1.0\)"):
                PagedKVCache.from_dense(k, v, lens, kv_dtype=kv, scale=bad)
        with pytest.raises(ValueError, match=r"k_scale must be positive and finite; got -5.0"):
            PagedKVCache.from_dense(k, v, lens, kv_dtype=kv, k_scale=-5.0)
        assert PagedKVCache.from_dense(k, v, lens, kv_dtype=kv, scale=1.0).saturated == 0
    with pytest.raises(ValueError, match=r"k_scale=0.5: granularity='token_head' .* pass k_scale=None \(or 1.0\)"):
        PagedKVCache.empty(1, 16, 2, 24, granularity="token_head", k_scale=0.5)
    with pytest.raises(ValueError, match=r"v_scale must be 1.0 \(or None\) for 16-bit kv_dtype='bf16' \(it stores "
                                         r"values unscaled\); got 0.5"):
        PagedKVCache.empty(1, 16, 2, 24, kv_dtype="bf16", v_scale=0.5)
    kp16, vp16, bt, sl = _parts("bf16")
    with pytest.raises(TypeError, match=r"k_scale='amax' \(str\); expected None or 1.0 \(kv_dtype='bf16' is a "
                                        r"16-bit cache"):
        PagedKVCache(kp16, vp16, bt, sl, kv_dtype="bf16", k_scale="amax")


def test_static_scale_arguments_are_checked_under_their_own_names(gen):
    lens = [5, 7]
    k, v = padded(lens, 2, 24, torch.float32, gen)
    with pytest.raises(ValueError, match=r"k_scale='max' is not a known scale method"):
        PagedKVCache.from_dense(k, v, lens, k_scale="max")
    with pytest.raises(ValueError, match=r"v_scale=1e-300 underflows float32 \(it becomes 0.0 there"):
        PagedKVCache.from_dense(k, v, lens, v_scale=1e-300)
    with pytest.raises(ValueError, match=r"k_scale of shape \(3,\) does not fit granularity 'head'"):
        PagedKVCache.from_dense(k, v, lens, granularity="head", k_scale=torch.ones(3))
    with pytest.raises(TypeError, match=r"scale=\['a'\] is not a list of numbers"):
        PagedKVCache.from_dense(k, v, lens, scale=["a"])
    with pytest.raises(ValueError, match=r"scale=0.5 would be ignored: k_scale and v_scale override it"):
        PagedKVCache.from_dense(k, v, lens, scale=0.5, k_scale=1.0, v_scale=2.0)
    kp, vp, bt, sl = _parts()
    with pytest.raises(ValueError, match=r"k_scale=1e\+50 overflows float32"):
        PagedKVCache(kp, vp, bt, sl, k_scale=1e50)


# ------------------------------------------------------------------------ slots, devices, seq_lens


def test_slots_take_integer_positions_inside_the_row(gen):
    lens = [20, 5]
    c = PagedKVCache.from_dense(*padded(lens, 2, 24, torch.float32, gen), lens, max_seq_len=32)
    t = c.slots(0, torch.tensor([0, 17, 31]))
    assert t.dtype == torch.int64 and torch.equal(c.slots(0, [0, 17, 31]), t)
    assert t.tolist() == [int(c.block_table[0, p // 16]) * 16 + p % 16 for p in (0, 17, 31)]
    for bad, shown in (([32], 32), ([-1], -1), (torch.tensor([3, 40]), 40)):
        with pytest.raises(ValueError, match=rf"positions\[\d\]={shown} is outside \[0, 32\): sequence 0's "
                                             r"block-table row holds 2 blocks x 16 tokens"):
            c.slots(0, bad)
    with pytest.raises(TypeError, match=r"positions has dtype float32; expected one of: int32, int64"):
        c.slots(0, torch.tensor([1.7]))
    with pytest.raises(TypeError, match=r"positions\[0\]=1.7 \(float\); expected an int"):
        c.slots(0, [1.7])
    with pytest.raises(ValueError, match=r"positions must be 1-D"):
        c.slots(0, torch.tensor([[1]]))
    with pytest.raises(ValueError, match=r"seq=2; expected an int <= 1"):
        c.slots(2, [0])
    c.block_table[1, 1] = -1  # padding: sequence 1 (5 tokens) never reads it
    with pytest.raises(ValueError, match=r"positions\[0\]=20 lies in block_table\[1, 1\]=-1, which is not a page "
                                         r"in \[0, 4\)"):
        c.slots(1, [20])


def test_meta_and_mixed_devices_are_refused():
    with pytest.raises(ValueError, match=r"device='meta'; a PagedKVCache holds its data on 'cpu' or a CUDA device"):
        PagedKVCache.empty(1, 16, 2, 16, device="meta")
    k = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"v\[0\] is on meta but k\[0\] is on cpu; k and v must be on one device"):
        PagedKVCache.from_dense(k, k.to("meta"), [4])
    with pytest.raises(ValueError, match=r"k is on meta; a PagedKVCache holds its data on 'cpu' or a CUDA device"):
        PagedKVCache.from_dense(k.to("meta"), k.to("meta"), [4])
    kp, vp, bt, sl = _parts()
    with pytest.raises(ValueError, match=r"k_pages is on meta"):
        PagedKVCache(kp.to("meta"), vp.to("meta"), bt.to("meta"), sl.to("meta"))


def test_seq_lens_is_one_length_per_sequence(gen):
    k, v = padded([3], 2, 24, torch.float32, gen)
    for bad in (torch.tensor(3), torch.tensor([[3]])):
        with pytest.raises(ValueError, match=rf"seq_lens has shape {re.escape(str(tuple(bad.shape)))}; expected a "
                                             r"1-D tensor \[B\] \(or a list\) of lengths, one per sequence "
                                             r"\(a batch of one is \[n\]\)"):
            PagedKVCache.from_dense(k, v, bad)
    assert PagedKVCache.from_dense(k, v, torch.tensor([3])).seq_lens.tolist() == [3]
    with pytest.raises(ValueError, match=r"k and v given as tensors must be 4-D \[B, max_len, Hkv, D\]"):
        PagedKVCache.from_dense(k[0], v[0], [3])


def test_decode_refuses_scales_and_pages_replaced_after_the_cache_was_built():
    """The attributes are plain: a scale or page tensor swapped in later reaches fp8kv.decode's check,
    never a kernel (a wrong-shaped scale is read out of bounds, a NaN or negative one decodes wrongly)."""
    import fp8kv

    k, v = torch.randn(2, 20, 2, 16), torch.randn(2, 20, 2, 16)
    cache = PagedKVCache.from_dense(k, v, [20, 5], kv_dtype="fp8_e4m3", granularity="head")
    q = torch.randn(2, 4, 16)
    fp8kv.decode(q, cache, backend="reference")  # as built: fine
    cases = [("k_scale", torch.full((2,), float("nan")), ValueError, r"k_scale\[0\]=nan"),
             ("v_scale", -cache.v_scale, ValueError, r"v_scale\[0\]=-"),
             ("k_scale", torch.ones(5), ValueError, r"k_scale has shape \(5,\)"),
             ("k_scale", torch.ones(2, dtype=torch.float64), TypeError, "k_scale has dtype float64"),
             ("k_pages", cache.k_pages.view(torch.int8), TypeError, "k_pages has dtype torch.int8")]
    for attr, value, exc, words in cases:
        broken = cache.clone()
        setattr(broken, attr, value)
        for backend in ("reference", "triton"):
            with pytest.raises(exc, match=words):
                fp8kv.decode(q.half(), broken, backend=backend)
    broken = cache.clone()
    broken.k_scale = torch.full((2,), float("nan"))
    broken.validate_arrays(contents=False)  # the values are a host sync: checked only with check=True
    with pytest.raises(ValueError, match="k_scale"):
        broken.validate_arrays()


def test_seed_outside_torchs_generator_range_is_refused_by_name():
    with pytest.raises(ValueError, match=r"seed=1180591620717411303424; expected an int <= 18446744073709551615"):
        PagedKVCache.empty(1, 16, 1, 16, seed=2**70)
    PagedKVCache.empty(1, 16, 1, 16, seed=2**64 - 1)  # the ends of torch.Generator.manual_seed's range
    PagedKVCache.empty(1, 16, 1, 16, seed=-(2**63))


def test_check_query_takes_one_per_sequence_as_true_or_false():
    cache = PagedKVCache.empty(2, 16, 1, 8, device=DEVICE)
    q = torch.zeros(2, 2, 8, device=DEVICE)
    cache.check_query(q, one_per_sequence=False)
    with pytest.raises(TypeError, match=r"one_per_sequence=0 \(int\); expected True or False"):
        cache.check_query(q, one_per_sequence=0)


def test_gather_checks_the_scales_unless_a_loop_checked_them_once():
    """gather(i) refuses a scale replaced since construction; check_scales=False (the oracles' loops, after one
    validate_arrays) skips that pass, and is a flag, not any truthy value."""
    cache = PagedKVCache.from_dense(torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32), [8])
    good = cache.gather(0)
    cache.k_scale = torch.full_like(cache.k_scale, float("nan"))
    with pytest.raises(ValueError, match="k_scale"):
        cache.gather(0)
    assert cache.gather(0, check_scales=False)[1].equal(good[1])  # V is untouched; K's NaN scale is the caller's
    with pytest.raises(TypeError, match="check_scales='no'"):
        cache.gather(0, check_scales="no")
