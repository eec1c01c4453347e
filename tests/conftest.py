"""Shared test fixtures: one error-ratio assertion, a seeded generator and the paged-cache factory
(``assert_rel_err``, ``gen``, ``make_cache``; the factory, the queries and the generators live in
tests/fixtures.py, which module-level code imports); and ``smoke_report``, one smoke render of every
notebook per test session, shared by the modules that read it."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Under pytest-xdist each worker gets its share of the cores for torch's threads and the notebook kernels it starts
# (their default, every core each, oversubscribes them: CI on 2 cores ran slower in 2 workers than in one).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _CORES // _WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402
from fixtures import make_cache, seeded  # noqa: E402

from fp8kv.quant import relative_error  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def assert_rel_err(a: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    """Assert equal shapes and ``||a - ref|| / ||ref|| <= tol``, naming ``what`` on failure."""
    assert a.shape == ref.shape, f"{what}: shape {tuple(a.shape)} != reference {tuple(ref.shape)}"
    err = relative_error(a, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > tolerance {tol:.1e}"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``make test``: ``-n auto --dist loadgroup``) every test that reads the session's smoke
    render runs in one worker, so that the notebooks are rendered once, not once per worker; and the GPU's tests run
    in one worker, one at a time, as the GPU is one."""
    for item in items:
        if "smoke_report" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smoke_report"))
        elif item.get_closest_marker("gpu") is not None:  # one GPU: its tests one at a time (timings, memory)
            item.add_marker(pytest.mark.xdist_group("gpu"))


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator seeded the same in every test, so failures reproduce."""
    return seeded(1234)


@pytest.fixture(name="assert_rel_err")
def _assert_rel_err_fixture():
    """:func:`assert_rel_err` as a fixture: ``assert_rel_err(a, ref, tol, what)``."""
    return assert_rel_err


@pytest.fixture(name="make_cache")
def _make_cache_fixture():
    """:func:`make_cache` as a fixture: ``make_cache(lens, num_kv_heads, head_dim, kv_dtype=..., ...)``."""
    return make_cache


@pytest.fixture(name="write_notebook")
def _write_notebook_fixture():
    """``write_notebook(folder, name, body, params="") -> path``: a three-cell notebook as the runner expects
    (a title, the tagged parameters cell of every fp8kv notebook plus ``params``' lines, then ``body``)."""
    import nbformat

    def write(folder, name: str, body: str, params: str = ""):
        nb = nbformat.v4.new_notebook()
        params = nbformat.v4.new_code_cell('SMOKE = None\nDEVICE = "auto"\nOUT_DIR = "results"\nSEED = 0\n'
                                           'SHOW_WIDGETS = True' + (f"\n{params}" if params else ""))
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
