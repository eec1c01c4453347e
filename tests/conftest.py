"""Shared test helpers: one error-ratio assertion, a seeded generator and one paged-cache factory,
as fixtures (``assert_rel_err``, ``gen``, ``make_cache``; a module-level helper built on one of them
imports it by name, as tests/test_ops.py does for the backend matrix's cache); and ``smoke_report``, one smoke render of every notebook per test session, shared by the
modules that read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8kv.cache import PagedKVCache
from fp8kv.quant import relative_error
from fp8kv.synthetic import ragged_kv


def assert_rel_err(a: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Assert equal shapes and ``||a - ref|| / ||ref|| <= tol``, naming ``what`` on failure."""
    assert a.shape == ref.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(ref.shape)}"
    err = relative_error(a, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator seeded the same in every test, so failures reproduce."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(name="assert_rel_err")
def _assert_rel_err_fixture():
    """:func:`assert_rel_err` as a fixture: ``assert_rel_err(a, ref, tol, what)``."""
    return assert_rel_err


def make_cache(lens, num_kv_heads: int = 2, head_dim: int = 32, *, kv_dtype: str = "fp8_e4m3",
               granularity: str = "tensor", block_size: int = 16, layout: str = "NHD", seed: int = 0,
               generator: torch.Generator | None = None, draw_device="cpu", device=None, dtype=None,
               k_spread: float = 1.0, k_head_gain=None, v_head_gain=None, k_outlier_channels: slice | None = None,
               k_outlier_gain: float = 1.0, dense: bool = False, data: str = "gaussian", **cache_kw):
    """A shuffled-page :class:`PagedKVCache` of ragged sequences of Gaussian K/V (``PagedKVCache.from_dense``).

    K and V ``[len(lens), max(lens), num_kv_heads, head_dim]`` are drawn on ``draw_device`` from
    ``generator`` (default: a fresh one seeded with ``seed``), K first; ``data="ragged"`` takes them
    from :func:`fp8kv.synthetic.ragged_kv` instead (the backend matrix's data: K's heads spread, an
    outlier channel; drawn on the CPU from ``seed``). Then K is multiplied by
    ``k_spread``, each head by its gain (``k_head_gain`` / ``v_head_gain``: a sequence of per-head
    factors, or a number ``r`` for ``r ** head``), the channels ``k_outlier_channels`` of K by
    ``k_outlier_gain`` (outlier channels, as real keys have); then cast to ``dtype`` and moved to
    ``device``. ``seed`` also shuffles the pages; ``cache_kw`` (scales, ``max_seq_len``...) goes to
    ``from_dense``. Returns the cache, or ``(cache, k, v)`` with ``dense=True``.
    """
    if data == "ragged":
        k, v = ragged_kv(lens, num_kv_heads, head_dim, seed=seed)
        draw_device = "cpu"
    elif data == "gaussian":
        gen = generator if generator is not None else torch.Generator(device=draw_device).manual_seed(seed)
        shape = (len(lens), max(max(lens), 1), num_kv_heads, head_dim)
        k = torch.randn(shape, generator=gen, device=draw_device)
        v = torch.randn(shape, generator=gen, device=draw_device)
    else:
        raise ValueError(f"data={data!r}; expected 'gaussian' or 'ragged'")
    if k_spread != 1.0:
        k = k * k_spread
    gains = []
    for x, gain in ((k, k_head_gain), (v, v_head_gain)):
        if gain is not None:
            if isinstance(gain, (int, float)):
                gain = float(gain) ** torch.arange(num_kv_heads, dtype=torch.float32)
            x = x * torch.as_tensor(gain, dtype=torch.float32, device=draw_device)[:, None]
        gains.append(x)
    k, v = gains
    if k_outlier_channels is not None:
        k[..., k_outlier_channels] *= k_outlier_gain
    if dtype is not None:
        k, v = k.to(dtype), v.to(dtype)
    if device is not None:
        k, v = k.to(device), v.to(device)
    cache = PagedKVCache.from_dense(k, v, list(lens), block_size=block_size, kv_dtype=kv_dtype,
                                    granularity=granularity, layout=layout, seed=seed, **cache_kw)
    return (cache, k, v) if dense else cache


@pytest.fixture(name="make_cache")
def _make_cache_fixture():
    """:func:`make_cache` as a fixture: ``make_cache(lens, num_kv_heads, head_dim, kv_dtype=..., ...)``."""
    return make_cache


@pytest.fixture(name="write_notebook")
def _write_notebook_fixture():
    """``write_notebook(folder, name, body) -> path``: a three-cell notebook as the runner expects
    (a title, the tagged parameters cell of every fp8kv notebook, then ``body``)."""
    import nbformat

    def write(folder, name: str, body: str):
        nb = nbformat.v4.new_notebook()
        params = nbformat.v4.new_code_cell('SMOKE = None\nDEVICE = "auto"\nOUT_DIR = "results"\nSEED = 0\n'
                                           'SHOW_WIDGETS = True')
        params.metadata["tags"] = ["parameters"]
        nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"), params, nbformat.v4.new_code_cell(body)]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        path = folder / f"{name}.ipynb"
        nbformat.write(nb, path)
        return path

    return write


@pytest.fixture(scope="session")
def smoke_report(tmp_path_factory):
    """``fp8kv notebooks run --smoke`` of every notebook in notebooks/, once per session.

    Returns ``(exit status, report folder, manifest)``.
    """
    from fp8kv import cli
    from fp8kv.device import gpu_slug

    notebooks = Path(__file__).resolve().parent.parent / "notebooks"
    out = tmp_path_factory.mktemp("reports")
    rc = cli.main(["notebooks", "run", "--smoke", "--out", str(out), "--notebooks", str(notebooks),
                   "--no-progress", "--timeout", "300"])
    folder = out / gpu_slug()
    manifest = json.loads((folder / "manifest.json").read_text())
    return rc, folder, manifest
