"""The decode-latency grids of notebook 04: named presets of what :func:`fp8kv.bench.sweep` expands and how it times."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecodeGrid", "DECODE_GRIDS", "decode_grid"]


@dataclass(frozen=True)
class DecodeGrid:
    """The decode-latency grid of notebook 04: what :func:`fp8kv.bench.sweep` expands and how it times.

    ``heads`` is (query heads, KV heads); ``baseline`` the 16-bit KV dtype FP8 is compared with;
    ``rep_ms`` the timed repetitions per case (CUDA); ``copy_mib`` the copy-bandwidth buffer.
    """

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    heads: tuple[int, int]
    head_dim: int
    kv_dtypes: tuple[str, ...]
    baseline: str
    modes: tuple[str, ...]
    backends: tuple[str, ...]
    flashinfer_tensor_cores: tuple[bool, ...]
    rep_ms: int
    copy_mib: int


DECODE_GRIDS = {
    # Curves on a GPU: 1k ... 64k tokens, 1 ... 256 sequences (cases beyond the memory budget are skipped);
    # four points a decade, so the whole grid times in a few minutes.
    "full": DecodeGrid(batches=(1, 16, 64, 256), contexts=(1024, 4096, 16384, 65536),
                       heads=(32, 8), head_dim=128, kv_dtypes=("bf16", "fp8_e4m3"), baseline="bf16",
                       modes=("dequant", "fp8"), backends=("triton", "flashinfer"), flashinfer_tensor_cores=(True,),
                       rep_ms=50, copy_mib=1024),
    # A few points anywhere; the Triton interpreter's bf16 arithmetic is wrong, so the 16-bit cache is fp16.
    "smoke": DecodeGrid(batches=(1, 3), contexts=(40, 100), heads=(4, 2), head_dim=64,
                        kv_dtypes=("fp16", "fp8_e4m3"), baseline="fp16", modes=("dequant", "fp8"),
                        backends=("reference", "triton", "flashinfer"), flashinfer_tensor_cores=(True,),
                        rep_ms=20, copy_mib=16),
}


def decode_grid(name: str | None, smoke: bool) -> DecodeGrid:
    """A grid of :data:`DECODE_GRIDS` by name; ``None`` picks ``"smoke"`` or ``"full"`` by ``smoke``."""
    if name is None:
        name = "smoke" if smoke else "full"
    if name not in DECODE_GRIDS:
        raise ValueError(f"grid={name!r} is not a decode grid; expected None or one of {sorted(DECODE_GRIDS)}")
    return DECODE_GRIDS[name]
