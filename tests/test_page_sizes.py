"""Pages of any size (SGLang's 1, hybrid models' odd sizes, FlashInfer takes any): every Triton kernel reads
and writes them as it does powers of two, checked against the fp32 reference under the interpreter.

A tile of ``block_n`` tokens then spans pages that do not divide it (page 3 in a 16-token tile: a page
boundary inside the tile, a page split between two tiles), which is what these sizes exercise; page 1 makes
every token its own block-table entry. The tolerances are the decode's (``fp8kv.reference.output_tolerance``):
the page size changes which addresses a tile loads, not one rounding.
"""

from __future__ import annotations

import pytest
import torch
from fixtures import DEVICE, dequant_tol, indptr, make_q, matrix_cache, seeded

from fp8kv.capacity import plan_capacity
from fp8kv.quant import relative_error
from fp8kv.reference import attend as ref_attend
from fp8kv.reference import decode as ref_decode

triton = pytest.importorskip("triton")

from fp8kv.ops import attend, gluon_refusal, paged_decode, write_cache  # noqa: E402

ODD_PAGES = [1, 3, 5, 12, 24, 100]


def _check(out, ref, tol, what):
    assert torch.isfinite(out).all(), what
    err = relative_error(out.float(), ref)
    assert err <= tol, f"{what}: rel err {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("block_size", ODD_PAGES)
@pytest.mark.parametrize("granularity,layout", [("tensor", "NHD"), ("token_head", "HND")])
def test_decode_reads_any_page_size(block_size, granularity, layout):
    """Lengths 1, a page and one more, and several pages, at group 4; one split and several (a split's first
    token inside a page)."""
    lens = [1, block_size + 1, 37]
    cache = matrix_cache(lens, 2, 32, block_size=block_size, granularity=granularity, layout=layout, seed=block_size)
    q = make_q(3, 8, 32, seed=block_size)
    ref, _ = ref_decode(q, cache)
    for splits in (1, 3):
        out, _ = paged_decode(q, cache, num_splits=splits, block_n=16)
        _check(out, ref, dequant_tol(q.dtype, granularity), f"page {block_size}, {splits} splits")


@pytest.mark.parametrize("block_size", [1, 5, 24])
def test_cuda_core_decode_reads_any_page_size(block_size):
    lens = [9, 40]
    cache = matrix_cache(lens, 2, 32, block_size=block_size, seed=block_size)
    q = make_q(2, 4, 32, seed=block_size)
    out, _ = paged_decode(q, cache, use_tensor_cores=False, num_splits=2)
    _check(out, ref_decode(q, cache)[0], dequant_tol(q.dtype, "tensor"), f"cuda-core page {block_size}")


@pytest.mark.parametrize("block_size", ODD_PAGES)
def test_attend_reads_any_page_size(block_size):
    """A 3-token draft and a chunk of 20 after 17 cached tokens: the causal diagonal crosses pages."""
    lens, qo_lens = [3 + 10, 17 + 20], [3, 20]
    cache = matrix_cache(lens, 2, 32, block_size=block_size, seed=block_size)
    q = make_q(sum(qo_lens), 4, 32, seed=block_size)
    ref = ref_attend(q, cache, indptr(qo_lens))
    for splits in (1, 2):
        out, _ = attend(q, cache, indptr(qo_lens), num_splits=splits, block_m=16, block_n=16)
        _check(out, ref, dequant_tol(q.dtype, "tensor"), f"attend page {block_size}, {splits} splits")


@pytest.mark.parametrize("block_size", [1, 3, 12])
@pytest.mark.parametrize("granularity", ["tensor", "token_head"])
def test_fused_write_is_bit_exact_at_any_page_size(block_size, granularity):
    hkv, d, lens, n = 2, 32, [4, 9], 7
    a, b = (matrix_cache(lens, hkv, d, block_size=block_size, granularity=granularity) for _ in range(2))
    g = seeded(block_size)
    k_new = (torch.randn(n, hkv, d, generator=g) * 3).to(DEVICE)
    v_new = torch.randn(n, hkv, d, generator=g).to(DEVICE)
    free = torch.arange(a.num_blocks * block_size, device=DEVICE)
    slots = free[torch.randperm(free.numel(), generator=g)[:n].to(DEVICE)]
    assert a.write(k_new, v_new, slots) == int(write_cache(b, k_new, v_new, slots).item())
    for pa, pb in ((a.k_pages, b.k_pages), (a.v_pages, b.v_pages)):
        assert torch.equal(pa.view(torch.uint8), pb.view(torch.uint8))
    assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)


@pytest.mark.parametrize("block_size,refused", [(3, True), (12, True), (100, True), (1, False), (16, False)])
def test_gluon_names_the_page_sizes_it_takes(block_size, refused):
    """The Gluon kernel addresses pages that divide its tile or that it divides; other sizes run the Triton
    kernel, and the refusal says why (on this CPU every size is refused later for the interpreter)."""
    cache = matrix_cache([5], 1, 32, block_size=block_size)
    why = gluon_refusal(cache, "dequant", 32, 4, cache.device)
    assert why is not None and (f"block_size={block_size}" in why) == refused, why


@pytest.mark.parametrize("block_size", [1, 3, 12])
def test_the_planner_counts_odd_pages(block_size):
    """Blocks of any size: the tokens that fit are whole blocks of it."""
    plan = plan_capacity("Llama-3.1-8B", "fp8_e4m3", kv_memory_gib=1, block_size=block_size)
    assert plan["tokens"] == plan["blocks"] * block_size > 0
    assert plan["blocks"] * plan["block_bytes"] <= plan["kv_memory_bytes"] < (plan["blocks"] + 1) * plan["block_bytes"]
