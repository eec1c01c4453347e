"""The bandwidth ceiling (fp8kv.bench.ceiling): one device-to-device copy, its bytes and its time."""

from __future__ import annotations

import pytest
import torch

from fp8kv.bench.ceiling import measure_copy_bandwidth


def test_measure_copy_bandwidth_cpu():
    nbytes = 1 << 20
    r = measure_copy_bandwidth(nbytes, "cpu", repeats=5)
    assert r["nbytes"] == nbytes and r["bytes_moved"] == 2 * nbytes
    assert r["time_ms"] > 0
    assert r["gbps"] == pytest.approx(r["bytes_moved"] / (r["time_ms"] * 1e-3) / 1e9)
    assert r["method"] == "perf_counter" and r["meaningful_for_gpu"] is False


@pytest.mark.parametrize("nbytes, exc", [(0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError)])
def test_measure_copy_bandwidth_rejects_nbytes(nbytes, exc):
    with pytest.raises(exc, match="nbytes="):
        measure_copy_bandwidth(nbytes, "cpu")


def test_measure_copy_bandwidth_rejects_repeats():
    with pytest.raises(ValueError, match="repeats=0; expected an int >= 1"):
        measure_copy_bandwidth(1024, "cpu", repeats=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_copy_bandwidth_gpu():
    nbytes = 256 * 2**20
    r = measure_copy_bandwidth(nbytes, "cuda")
    assert r["method"] == "cuda_graph" and r["meaningful_for_gpu"] is True
    assert r["bytes_moved"] == 2 * nbytes
    # A copy cannot beat the memory system's spec; 20 TB/s is above every GPU's HBM peak today.
    assert 10 < r["gbps"] < 20_000
