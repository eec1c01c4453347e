"""The one home of the tests' data: seeded generators, paged caches and queries, the test device and the
dequant-mode tolerance; bench rows of given latency lines (:func:`breakeven_rows`); and a call counter (:func:`count_calls`). tests/conftest.py offers the cache factory
and a generator as fixtures; a test module imports the rest from here (``from fixtures import ...``) and
defines none of these names again (tests/test_architecture.py holds it)."""

from __future__ import annotations

import functools
import sys

import torch

from fp8kv.cache import PagedKVCache
from fp8kv.reference import output_tolerance
from fp8kv.synthetic import ragged_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def seeded(seed: int) -> torch.Generator:
    """A fresh CPU generator seeded with ``seed``: the one way a test draws reproducible data."""
    return torch.Generator().manual_seed(seed)


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


def matrix_cache(lens, hkv, d, **kw):
    """:func:`make_cache` on the backend matrix's data (``fp8kv.synthetic.ragged_kv``: K's heads spread over
    [10^-0.5, 10^0.5] and an outlier channel, so scale granularities differ), on :data:`DEVICE`;
    ``k_spread`` scales K (large scores)."""
    return make_cache(lens, hkv, d, data="ragged", device=DEVICE, **kw)


def make_q(rows, hq, d, dtype=torch.float16, seed=1, *, scale: float = 1.0, device=DEVICE) -> torch.Tensor:
    """A Gaussian query ``[rows, hq, d]`` drawn on the CPU from ``seeded(seed)``, times ``scale``, as
    ``dtype`` on ``device``."""
    q = torch.randn(rows, hq, d, generator=seeded(seed))
    if scale != 1.0:
        q = q * scale
    return q.to(device, dtype)


def random_sinks(hq, seed=3) -> torch.Tensor:
    """Per-head attention-sink logits ``[hq]`` (Gaussian times 2, from ``seeded(seed)``) on :data:`DEVICE`."""
    return (torch.randn(hq, generator=seeded(seed)) * 2).to(DEVICE)


def indptr(qo_lens, device=DEVICE, dtype=torch.int32) -> torch.Tensor:
    """``qo_indptr`` of these per-sequence new-token counts."""
    return torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=dtype, device=device)


def dequant_tol(q_dtype, granularity) -> float:
    """The Triton dequant mode's output tolerance for this query dtype and scale granularity."""
    return output_tolerance("triton", "dequant", q_dtype, granularity)


def count_calls(monkeypatch, owner, name: str, counts: dict) -> None:
    """Replace ``owner.name`` (a function of a module, or a method of a class) and every binding of it in the
    loaded fp8kv modules (``from ... import name``) by a wrapper counting its calls into ``counts[name]``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def counting(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    counts[name] = 0
    monkeypatch.setattr(owner, name, counting)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("fp8kv") and module is not None and getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, counting)


def run_tokens(step, n_tokens: int, gen: torch.Generator):
    """Decode ``n_tokens`` random tokens through a DecodeStep (positions 0, 1, ...); the last logits."""
    logits = None
    for pos in range(n_tokens):
        step.input_ids.copy_(torch.randint(0, step.shape.vocab_size, (step.batch,), generator=gen))
        step.set_positions(pos)
        logits = step.forward()
    return logits


def breakeven_rows(lines, contexts=None, *, rel_noise=0.0, seed=0, batch=16, backend="triton", **extra):
    """Bench rows (the columns fp8kv.bench writes that fp8kv.analysis.breakeven reads) of ``lines``: kv_dtype ->
    (intercept, slope) or a function of the context; times multiplied by 1 + rel_noise x N(0, 1)."""
    import numpy as np
    import pandas as pd

    from fp8kv.analysis.breakeven import BREAKEVEN_GRID

    contexts = BREAKEVEN_GRID["contexts"] if contexts is None else contexts
    rng = np.random.default_rng(seed)
    out = []
    for kv, line in lines.items():
        for c in contexts:
            t = line(c) if callable(line) else line[0] + line[1] * c
            out.append(dict(gpu="NVIDIA H200", backend=backend, variant="", kv_dtype=kv, mode="dequant",
                            granularity="tensor", batch=batch, context=int(c), num_q_heads=32, num_kv_heads=8,
                            head_dim=128, block_size=16, time_us=t * (1 + rel_noise * rng.standard_normal()),
                            status="ok", **extra))
    return pd.DataFrame(out)


# The prelude of the stop-signal tests' child processes: library_takes_sigterm() sets SIGTERM's C-level handler to
# the default action behind Python's back, as LLVM inside Triton does when a compile first needs it (Python's
# table still names the run's handler). In a child: where the handler is not taken back, the signal ends it.
LIBRARY_TAKES_SIGTERM = """
import ctypes, signal
_libc = ctypes.CDLL(None)
_libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
def library_takes_sigterm():
    _libc.signal(signal.SIGTERM, None)
"""


# The Gluon decode kernel's strides of the query and the split partials: argument -> (tensor argument, dimension).
GLUON_ROW_STRIDES = {"stride_qb": ("q_ptr", 0), "stride_qh": ("q_ptr", 1), "stride_ob": ("part_out_ptr", 0),
                     "stride_oh": ("part_out_ptr", 1), "stride_os": ("part_out_ptr", 2),
                     "stride_lb": ("part_lse_ptr", 0), "stride_lh": ("part_lse_ptr", 1)}


def gluon_stand_in(on_launch):
    """A stand-in for the Gluon decode kernel (a CPU cannot run it): ``stand_in[grid](*args, **kwargs)`` checks the
    call against the kernel's signature (its runtime arguments in order, its constexprs by name, as a launch passes
    them) and calls ``on_launch(grid, named, constants)`` with the runtime arguments by name. Build it before the
    kernel is patched: it reads the real kernel's signature."""
    import inspect

    from fp8kv.ops.decode import gluon_kernel

    params = list(inspect.signature(gluon_kernel.gluon_decode_kernel.fn).parameters)

    class StandIn:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                constants = {k: v for k, v in kwargs.items() if k != "num_warps"}
                runtime = [p for p in params if p not in constants]
                assert len(args) == len(runtime) and set(constants) <= set(params)
                named = dict(zip(runtime, args, strict=True))
                for name, (tensor, dim) in GLUON_ROW_STRIDES.items():
                    assert named[name] == named[tensor].stride(dim), name
                on_launch(grid, named, constants)
            return launch

    return StandIn()

