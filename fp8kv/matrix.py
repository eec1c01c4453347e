"""The backend matrix: every backend × KV dtype × mode × granularity, run once here and checked.

::

    df = backend_matrix()            # one row per combination, on this machine
    df[df.status != "passed"]        # what failed, errored or cannot run here, and why

For each combination :func:`fp8kv.capability.check` is asked first (``arch=None``: this machine,
with what is installed and, on CPU, whether the Triton interpreter is on), then
:func:`fp8kv.capability.check_query` (whether the backend takes the row's query dtype over that
cache). Where either says no, the row has ``status="unsupported"`` and that reason. Otherwise
:func:`fp8kv.decode` runs once through that backend and mode, and its output and LSE are compared
with :func:`fp8kv.reference.decode` on the *same* cache (kernel error on the dequantized cache, not
quantization error), with the output tolerances of :func:`fp8kv.reference.output_tolerance` and
:func:`fp8kv.reference.lse_tolerance`.
A backend that returns no LSE (vLLM's kernel; its ``reason`` says so) is judged on its output alone,
with ``lse_err`` and ``lse_tol`` NaN.

The sequences are ragged (by default: one token, a length that is not a multiple of the page size,
and several pages), so the one-token and partial-page paths run in every cell. K has a per-head
magnitude spread and an outlier channel, as real keys do, so the granularities differ.

Rows
----
``backend, kv_dtype, mode, granularity, q_dtype, status, passed, rel_err, tol, lse_err, lse_tol,
reason, error, seconds, batch, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, device,
arch``. ``status`` is ``"passed"``, ``"failed"`` (ran; an error above its tolerance), ``"error"``
(ran and raised although the capability table says it runs: the exception is in ``error``) or
``"unsupported"`` (``reason`` = the capability table's reason, or ``check_query``'s for a query dtype
the backend refuses). For rows that ran ``reason`` is ``capability.check``'s text: how the combination
runs. ``seconds`` is the wall time of the one checked call, compilation included (not a benchmark).

The combinations are those of :func:`fp8kv.bench.sweep`: the product of the axes minus what is not
a combination at all. A 16-bit cache carries no scales, so its granularities collapse to one row
per backend (``granularity="tensor"``), and it has no fp8 mode (that mode quantizes the query and
the probabilities to meet FP8 K/V).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import pandas as pd
import torch

from . import checks
from .cache import PagedKVCache
from .capability import BACKEND_NAMES, KV_DTYPE_NAMES, MODES, check_query
from .capability import check as capability_check
from .capability_formats import mode_refusal
from .formats import UNQUANTIZED_DTYPES, is_fp8
from .quant import GRANULARITIES, relative_error
from .reference import lse_tolerance, output_tolerance
from .synthetic import ragged_kv

__all__ = ["backend_matrix", "ragged_seq_lens", "lse_tolerance", "summarize", "COLUMNS", "STATUSES"]

STATUSES = ("passed", "failed", "error", "unsupported")
COLUMNS = ["backend", "kv_dtype", "mode", "granularity", "q_dtype", "status", "passed", "rel_err", "tol",
           "lse_err", "lse_tol", "reason", "error", "seconds", "batch", "seq_lens", "num_q_heads",
           "num_kv_heads", "head_dim", "block_size", "device", "arch"]
_Q_DTYPES = UNQUANTIZED_DTYPES  # the query types a row may ask for


def _choices(name: str, values, allowed) -> list[str]:
    return list(dict.fromkeys(checks.many_of(values, name, allowed)))


MAX_RAGGED_BATCH = 2**20  # sequences of one ragged test batch: far past any GPU's cache, a list the host builds fast


def ragged_seq_lens(batch: int = 4, block_size: int = 16, max_len: int = 203) -> list[int]:
    """Ragged sequence lengths that exercise the edge paths of a paged decode.

    The first sequence holds one token, the last ``max_len``; the ones between are spaced
    geometrically and moved off multiples of ``block_size``, so partial last pages occur.
    ``batch=1`` gives ``[max_len]``. Returns a list of ``batch`` ints in ``[1, max_len]``; ``batch`` at most
    :data:`MAX_RAGGED_BATCH` (a list, built on the host: a huge one would run for ever).
    """
    checks.integer(batch, "batch", minimum=1, maximum=MAX_RAGGED_BATCH)
    checks.positive_int(block_size, "block_size")
    checks.positive_int(max_len, "max_len")
    if batch == 1:
        return [max_len]
    lens = [1]
    for i in range(1, batch - 1):
        n = max(2, round(max_len ** (i / (batch - 1))))
        if n % block_size == 0 and n + 1 < max_len:
            n += 1
        lens.append(min(n, max_len))
    return lens + [max_len]


def _default_q_dtype(kv_dtype: str, dev: torch.device) -> str:
    # A 16-bit cache is read with a query of its own type (FlashInfer and fp8kv's kernel pair them
    # so); FP8 with bf16 on a GPU and fp16 on CPU, whose Triton interpreter computes bf16 in fp32.
    if kv_dtype in ("bf16", "fp16"):
        return kv_dtype
    return "bf16" if dev.type == "cuda" else "fp16"


def backend_matrix(*, device=None, kv_dtypes: Sequence[str] = KV_DTYPE_NAMES, modes: Sequence[str] = MODES,
                   granularities: Sequence[str] = GRANULARITIES, backends: Sequence[str] = BACKEND_NAMES,
                   batch: int | None = None, seq_lens: Sequence[int] | None = None, max_len: int = 203,
                   heads: tuple[int, int] = (32, 8), head_dim: int = 128, block_size: int = 16,
                   q_dtype: str | None = None, seed: int = 0) -> pd.DataFrame:
    """Run every backend × KV dtype × mode × granularity once on this machine; check each.

    Parameters
    ----------
    device : where the caches and queries live (``fp8kv.device.resolve_device``; default the GPU
        if there is one). Support is asked of this machine (``capability.check(arch=None)``).
    kv_dtypes, modes, granularities, backends : the axes (default: all of each).
    batch, seq_lens : the sequences. ``seq_lens`` default: :func:`ragged_seq_lens` ``(batch,
        block_size, max_len)`` with ``batch`` default 4; given both, ``batch == len(seq_lens)``.
    heads : ``(num_q_heads, num_kv_heads)``; head_dim, block_size: the cache's shape.
    q_dtype : "bf16", "fp16" or "fp32" for every row; default the cache's own type for 16-bit
        caches, and for FP8 caches bf16 on a GPU, fp16 on CPU.
    seed : K/V and query data.

    Returns
    -------
    pandas.DataFrame, one row per combination (columns :data:`COLUMNS`, described in the module
    docstring), in the order backend, kv_dtype, mode, granularity.
    """
    from .backends import decode
    from .device import current_arch, resolve_device
    from .reference import decode as ref_decode

    dev = resolve_device(device)
    kv_dtypes = _choices("kv_dtypes", kv_dtypes, KV_DTYPE_NAMES)
    modes = _choices("modes", modes, MODES)
    granularities = _choices("granularities", granularities, GRANULARITIES)
    backends = _choices("backends", backends, BACKEND_NAMES)
    checks.positive_int(head_dim, "head_dim")
    checks.positive_int(block_size, "block_size")
    if not (isinstance(heads, (tuple, list)) and len(heads) == 2):
        checks.fail(f"heads={heads!r}; expected a (num_q_heads, num_kv_heads) pair such as (32, 8)")
    hq, hkv = (checks.positive_int(heads[0], "heads[0]"), checks.positive_int(heads[1], "heads[1]"))
    if hq % hkv:
        checks.fail(f"heads={tuple(heads)!r}: num_q_heads must be a multiple of num_kv_heads")
    if q_dtype is not None and (not isinstance(q_dtype, str) or q_dtype not in _Q_DTYPES):
        checks.fail(f"q_dtype={q_dtype!r}; expected None or one of {tuple(_Q_DTYPES)}")
    if batch is not None:
        batch = checks.positive_int(batch, "batch")
    if seq_lens is None:
        seq_lens = ragged_seq_lens(4 if batch is None else batch, block_size, max_len)
    else:
        if isinstance(seq_lens, (str, bytes)) or not hasattr(seq_lens, "__iter__"):
            checks.fail(f"seq_lens={seq_lens!r} ({type(seq_lens).__name__}); expected a list of lengths, one per "
                        "sequence", TypeError)
        seq_lens = [checks.positive_int(n, f"seq_lens[{i}]")
                    for i, n in enumerate(seq_lens)]
        if not seq_lens:
            checks.fail("seq_lens is empty; give at least one sequence length")
        if batch is not None and batch != len(seq_lens):
            checks.fail(f"batch={batch!r} but seq_lens has {len(seq_lens)} entries; give one or make them agree")

    arch = current_arch(dev)
    k, v = (t.to(dev) for t in ragged_kv(seq_lens, hkv, head_dim, seed=seed))  # heads spread, an outlier channel
    q32 = torch.randn(len(seq_lens), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dev)
    shape = dict(batch=len(seq_lens), seq_lens=",".join(map(str, seq_lens)), num_q_heads=hq, num_kv_heads=hkv,
                 head_dim=head_dim, block_size=block_size, device=str(dev), arch=arch)

    # (kv_dtype, granularity, q_dtype) -> (cache, q, ref_out, ref_lse): built once, shared by backends and modes
    caches: dict[tuple[str, str, str], tuple] = {}

    def prepared(kv: str, gran: str, qd: str):
        key = (kv, gran, qd)
        if key not in caches:
            cache = PagedKVCache.from_dense(k, v, seq_lens, block_size=block_size, kv_dtype=kv,
                                            granularity=gran, seed=seed)
            q = q32.to(_Q_DTYPES[qd])
            caches[key] = (cache, q, *ref_decode(q, cache))
        return caches[key]

    rows = []
    for backend in backends:
        for kv in kv_dtypes:
            grans = granularities if is_fp8(kv) else ["tensor"]  # 16-bit caches carry no scales
            for mode in modes:
                if mode_refusal(kv, mode):
                    continue  # not a combination: fp8 mode quantizes q and p against FP8 KV
                for gran in grans:
                    qd = q_dtype or _default_q_dtype(kv, dev)
                    row = dict.fromkeys(COLUMNS)
                    row.update(shape, backend=backend, kv_dtype=kv, mode=mode, granularity=gran, q_dtype=qd,
                               error="", rel_err=math.nan, lse_err=math.nan, tol=math.nan, lse_tol=math.nan,
                               seconds=math.nan)
                    ok, why = capability_check(backend, kv, mode, None, gran, head_dim)
                    if ok:  # a query dtype the backend refuses is a fact, not a failure of the run
                        q_ok, q_why = check_query(backend, qd, kv)
                        ok, why = q_ok, (why if q_ok else q_why)
                    row["reason"] = why
                    if not ok:
                        row.update(status="unsupported")
                        rows.append(row)
                        continue
                    try:
                        cache, q, ref_out, ref_lse = prepared(kv, gran, qd)
                        row.update(tol=output_tolerance(backend, mode, qd, gran))
                        t0 = time.perf_counter()
                        out, lse = decode(q, cache, backend=backend, mode=mode)
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)
                        row["seconds"] = time.perf_counter() - t0
                        lse_shape = None if lse is None else tuple(lse.shape)
                        if tuple(out.shape) != tuple(ref_out.shape) or lse_shape not in (None, tuple(ref_lse.shape)):
                            raise ValueError(f"output shapes {tuple(out.shape)}, {lse_shape}; expected "
                                             f"{tuple(ref_out.shape)}, {tuple(ref_lse.shape)}")
                        rel = relative_error(out, ref_out)
                        if lse is None and backend != "vllm":
                            raise ValueError(f"{backend} returned no LSE")
                        if lse is None:  # vLLM's kernel computes no LSE: the output alone is judged
                            lse_err, lse_ok = math.nan, True
                        else:
                            row["lse_tol"] = lse_tolerance(backend, mode, qd, ref_lse)
                            lse_err = float((lse.double() - ref_lse.double()).abs().max())
                            lse_ok = lse_err <= row["lse_tol"]
                        # NaN fails both comparisons, so a non-finite output never passes.
                        passed = bool(rel <= row["tol"] and lse_ok)
                        row.update(rel_err=rel, lse_err=lse_err, passed=passed,
                                   status="passed" if passed else "failed")
                    except Exception as e:  # one broken cell must not hide the others; the row says what
                        row.update(status="error", passed=False, error=f"{type(e).__name__}: {e}")
                    rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def summarize(df: pd.DataFrame) -> dict:
    """Counts of a :func:`backend_matrix` table: rows, ran, passed, failed, error, unsupported."""
    if not isinstance(df, pd.DataFrame):
        checks.fail(f"df must be a pandas DataFrame (backend_matrix's rows), got {type(df).__name__}", TypeError)
    missing = sorted({"status", "passed"} - set(df.columns))
    if missing:
        checks.fail(f"df lacks columns {missing}; expected the rows of fp8kv.matrix.backend_matrix()")
    counts = df["status"].value_counts()
    n = {s: int(counts.get(s, 0)) for s in STATUSES}
    return {"n_rows": len(df), "n_ran": n["passed"] + n["failed"] + n["error"], "n_passed": n["passed"],
            "n_failed": n["failed"], "n_error": n["error"], "n_unsupported": n["unsupported"]}
