"""The benchmark of multi-token attention (``fp8kv.attend``): speculative verification (a few draft tokens per
sequence) and chunked-prefill append (a chunk of the prompt after the cached tokens).

:class:`AttendCase` is one cell (``q_len`` new tokens after ``context`` cached ones, in every sequence),
:func:`attend_sweep` the grid with what cannot run here marked, :func:`attend_run` measures it (each cache built
once; every row checked against :func:`fp8kv.reference.attend` on a subset of the sequences before it is
timed, as the decode bench checks a subset), :func:`attend_summary` prints it. Rows go through the decode
bench's results path (:func:`fp8kv.bench.save`). The presets :data:`ATTEND_PRESETS` run from the command
line: ``python -m fp8kv.bench --preset spec-verify`` (``--q-lens`` / ``--chunks`` to change the counts).

Per row: ``time_us``; ``gbps``, the useful bytes (K/V of every cached token, the new ones included, scales,
the query and the output) per second; ``tflops``, the causal-aware FLOPs ``4 x Hq x D x`` the keys the rows
attend (``q_len x context + q_len (q_len + 1) / 2`` per sequence) per second; ``pct_copy_bw``, GB/s as a share
of a device-to-device copy measured in the same run; ``math_peak_tflops``, the dense tensor-core peak of the GPU
the run is on for the dot the mode uses (:func:`attend_math_peak`), and ``pct_math_peak``, TFLOP/s as a share of
it (NaN on a CPU, on a GPU :data:`fp8kv.device.MATH_PEAK_TFLOPS` does not hold, and for the fp32 reference).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch

from .. import checks
from ..attend_checks import ATTEND_BACKEND_OPTIONS
from ..backends import planned_attend
from ..cache import LAYOUTS, check_block_size
from ..capability import BACKEND_NAMES, KV_DTYPE_NAMES, MODES, UnsupportedError, check_query
from ..capability import check as capability_check
from ..capability_formats import mode_refusal
from ..capacity import gib_text
from ..device import math_peak_tflops
from ..formats import KV_DTYPES, is_fp8
from ..interrupts import reclaim_stop_signals
from ..launch_options import convert_refusal
from ..ops.decode.gluon_scope import READS_PAGES, reads_pages
from ..quant import GRANULARITIES, kv_scale_bytes, relative_error
from ..reference import output_tolerance
from ..results import utc_stamp
from ..sweeps import interruptible, release_memory
from ..synthetic import CHUNK_ELEMS
from .cases import Q_DTYPES, memory_budget
from .measure import resolve_copy_bandwidth, synthetic_cache, time_call

__all__ = ["AttendCase", "attend_sweep", "attend_run", "attend_summary", "attend_bytes", "attend_flops",
           "attend_footprint", "attend_math_peak", "ATTEND_COLUMNS", "ATTEND_PRESETS", "ATTEND_PRESET_HELP"]

ATTEND_COLUMNS = [
    "timestamp", "gpu", "gpu_slug", "arch", "device", "torch", "triton", "flashinfer", "vllm", "fp8kv_source",
    "op", "label", "backend", "variant", "mode", "kv_dtype", "granularity", "layout", "q_dtype",
    "batch", "context", "q_len", "num_q_heads", "num_kv_heads", "head_dim", "block_size",
    "kernel", "num_splits", "block_m", "block_n", "num_warps",
    "timing", "time_us", "bytes", "kv_bytes", "gbps", "flops", "tflops", "math_peak_tflops", "pct_math_peak",
    "pct_copy_bw", "copy_gbps", "kv_copies",
    "rel_err", "tol", "check_passed", "status", "reason",
]
# Llama-3-8B's 32/8/128 and two more real layouts: Qwen2.5-14B's 40/8/128 (group 5) and Gemma-2B's MQA 8/1/256.
_SHAPES = [(32, 8, 128), (40, 8, 128), (8, 1, 256)]
ATTEND_PRESETS = {
    "spec-verify": dict(batches=[16, 64, 256], contexts=[4096, 16384, 32768], q_lens=[1, 2, 4, 8], shapes=_SHAPES,
                        block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant"],
                        backends=["triton", "flashinfer", "vllm"], granularities=["tensor"],
                        # the default (the Gluon kernel's rows where it runs) beside the Triton kernels
                        triton_options=[{}, {"gluon": False}]),
    "chunked-prefill": dict(batches=[1, 4], contexts=[0, 4096, 16384, 32768], q_lens=[256, 2048, 8192],
                            shapes=[(32, 8, 128)], block_sizes=[16], kv_dtypes=["bf16", "fp8_e4m3"],
                            modes=["dequant", "fp8"], backends=["triton", "flashinfer", "vllm"],
                            granularities=["tensor"]),
    # fp8kv's attend kernel over FP8 pages at a verify point and a chunk point, one launch option changed per
    # variant (the first: the defaults), dequant and FP8 tensor-core modes: which launch to make the default
    "attend-tune": dict(batches=[64], contexts=[16384], q_lens=[2, 8], shapes=[(32, 8, 128)], block_sizes=[16],
                        kv_dtypes=["fp8_e4m3"], modes=["dequant", "fp8"], backends=["triton"],
                        granularities=["tensor"],
                        triton_options=[{}, {"convert": "cast"}, {"convert": "software"}, {"block_n": 32},
                                        {"block_n": 128}, {"num_warps": 8}, {"num_stages": 3}, {"num_stages": 4},
                                        {"block_m": 16}, {"block_m": 32}, {"block_m": 64}, {"num_splits": 1},
                                        {"num_splits": 2}]),
    "attend-smoke": dict(batches=[2], contexts=[0, 40], q_lens=[1, 3], shapes=[(4, 2, 64)], block_sizes=[16],
                         kv_dtypes=["bf16", "fp8_e4m3"], modes=["dequant", "fp8"],
                         backends=["triton", "flashinfer", "vllm", "reference"], granularities=["tensor"]),
}
ATTEND_PRESET_HELP = {
    "spec-verify": "speculative verification: q_len 1 (the decode's point), 2, 4, 8 new tokens after 4k-32k cached "
                   "ones, B 16-256, Hq/Hkv/D 32/8/128, 40/8/128 and 8/1/256, bf16 vs fp8_e4m3, Triton (the default "
                   "kernel beside gluon=False), FlashInfer (prefill wrapper) and vLLM's kernel; GB/s, TFLOP/s, % of "
                   "the copy limit (GPU)",
    "chunked-prefill": "chunked-prefill append: chunks of 256/2048/8192 tokens after 0-32k cached ones, B 1-4, "
                       "32/8/128, bf16 vs fp8_e4m3 (dequant and FP8 tensor-core modes), Triton, FlashInfer and vLLM's "
                       "kernel (GPU)",
    "attend-tune": "fp8kv's attend kernel over e4m3 pages, B 64 x 16k, 2 and 8 new tokens, 32/8/128, dequant and fp8 "
                   "modes: the default launch beside one changed option each (convert, block_n, warps, stages, "
                   "block_m, splits) (GPU)",
    "attend-smoke": "a tiny multi-token grid that runs anywhere; on CPU add --interpret for the Triton rows",
}


@dataclass
class AttendCase:
    """One multi-token cell: ``batch`` sequences of ``context`` cached tokens and ``q_len`` new ones each (the
    new ones written into the cache before attention, as the engines do), a cache format and a backend.
    ``options`` go to the Triton backend (:data:`fp8kv.attend_checks.ATTEND_BACKEND_OPTIONS`). ``status``: ``"ready"``,
    ``"unsupported"`` or ``"skipped"`` (set by :func:`attend_sweep`, with ``reason``)."""

    batch: int
    context: int  # cached tokens before the new ones (>= 0)
    q_len: int  # new tokens per sequence (a draft, or a prefill chunk)
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    kv_dtype: str = "bf16"
    mode: str = "dequant"
    backend: str = "triton"
    granularity: str = "tensor"
    q_dtype: str = "bf16"
    layout: str = "NHD"
    options: dict = field(default_factory=dict)
    label: str = ""
    status: str = "ready"
    reason: str = ""
    seed: int = 0

    def __post_init__(self):
        for name in ("batch", "q_len", "num_q_heads", "num_kv_heads", "head_dim", "block_size"):
            checks.positive_int(getattr(self, name), f"AttendCase.{name}")
        checks.integer(self.context, "AttendCase.context", minimum=0)
        if self.num_q_heads % self.num_kv_heads:
            checks.fail(f"AttendCase.num_q_heads={self.num_q_heads} is not a multiple of "
                        f"num_kv_heads={self.num_kv_heads}")
        choices = {"kv_dtype": KV_DTYPE_NAMES, "mode": MODES, "backend": BACKEND_NAMES, "granularity": GRANULARITIES,
                   "q_dtype": tuple(Q_DTYPES), "layout": LAYOUTS, "status": ("ready", "unsupported", "skipped")}
        for name, allowed in choices.items():
            checks.one_of(getattr(self, name), f"AttendCase.{name}", allowed)
        if not isinstance(self.options, dict):
            checks.fail(f"AttendCase.options must be a dict, got {type(self.options).__name__}", TypeError)
        unknown = sorted(set(self.options) - set(ATTEND_BACKEND_OPTIONS))
        if unknown or (self.options and self.backend != "triton"):
            checks.fail(f"AttendCase.options={self.options!r}: the triton backend takes {ATTEND_BACKEND_OPTIONS}, the others "
                        "none")
        if not is_fp8(self.kv_dtype):
            self.granularity = "tensor"
        if not self.label:
            self.label = " ".join(x for x in (self.backend + (f"-{self.variant}" if self.variant else ""), self.kv_dtype,
                                              self.mode, "" if self.granularity == "tensor" else self.granularity,
                                              f"q_len={self.q_len}") if x)

    @property
    def variant(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))

    @property
    def seq_len(self) -> int:
        """Tokens of each sequence in the cache: the cached ones and the new ones."""
        return self.context + self.q_len

    @property
    def cache_key(self) -> tuple:
        return (self.batch, self.seq_len, self.num_kv_heads, self.head_dim, self.block_size, self.kv_dtype,
                self.granularity, self.layout, self.seed)


def attend_bytes(case: AttendCase) -> dict:
    """Useful bytes one call moves (ints): ``kv`` (K and V of every token of every sequence, once),
    ``scales`` (as the decode bench counts them), ``q`` and ``out`` (``B x q_len x Hq x D`` each; the reference's
    output is fp32, the others' the query's type or the ``out_dtype`` asked for), and their ``total``."""
    hkv, d = case.num_kv_heads, case.head_dim
    tokens = case.batch * case.seq_len
    kv = tokens * hkv * d * 2 * KV_DTYPES[case.kv_dtype][0].itemsize
    fixed, per_token = kv_scale_bytes(case.granularity if is_fp8(case.kv_dtype) else None, num_layers=1,
                                      num_kv_heads=hkv, head_dim=d)
    rows = case.batch * case.q_len * case.num_q_heads * d
    q = rows * Q_DTYPES[case.q_dtype].itemsize
    out_dtype = torch.float32 if case.backend == "reference" else (case.options.get("out_dtype")
                                                                    or Q_DTYPES[case.q_dtype])
    out = rows * out_dtype.itemsize
    scales = fixed + per_token * tokens
    return {"kv": kv, "scales": scales, "q": q, "out": out, "total": kv + scales + q + out}


def attend_flops(case: AttendCase) -> int:
    """Causal-aware FLOPs: ``4 x Hq x D`` (a multiply and an add in q.k and in p.v) per attended key, summed over
    the rows; query j of a sequence attends ``context + j + 1`` keys."""
    keys = case.q_len * case.context + case.q_len * (case.q_len + 1) // 2
    return 4 * case.num_q_heads * case.head_dim * case.batch * keys


def attend_math_peak(case: AttendCase, gpu: str | None) -> float:
    """The dense tensor-core peak (TFLOP/s) a case's arithmetic is measured against on the GPU named ``gpu``
    (:func:`fp8kv.device.math_peak_tflops`): the 16-bit dot's in dequant mode (FP8 pages converted to the query's
    type), the FP8 dot's in fp8 mode. NaN on a CPU (``gpu`` ``"cpu"``), on a GPU the table does not hold, and for
    the reference backend (fp32 torch arithmetic, neither dot)."""
    if case.backend == "reference":
        return float("nan")
    return math_peak_tflops(gpu, "fp8" if case.mode == "fp8" else "16-bit")


def attend_footprint(case: AttendCase) -> int:
    """Device bytes a case needs at peak: pages, scales, the build's chunk, the checked sequences, the query, the
    output and the largest split partials (fp32, at most 64 splits)."""
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    page_elems = case.batch * math.ceil(case.seq_len / bs) * bs * hkv * d
    _, per_token = kv_scale_bytes(case.granularity if is_fp8(case.kv_dtype) else None, num_layers=1,
                                  num_kv_heads=hkv, head_dim=d)
    rows = case.batch * case.q_len * case.num_q_heads
    return (2 * page_elems * KV_DTYPES[case.kv_dtype][0].itemsize + 2 * page_elems // d * per_token // hkv
            + min(page_elems, CHUNK_ELEMS) * 4 * 3 + 2 * 2 * case.seq_len * hkv * d * 4
            + rows * d * 8 + rows * 64 * (d + 1) * 4)


def _as_list(x, name: str) -> list:
    x = [x] if isinstance(x, (str, int, dict)) or x is None else list(x)
    if not x:
        checks.fail(f"{name} is empty; give at least one value")
    return x


def attend_sweep(batches: Sequence[int], contexts: Sequence[int], q_lens: Sequence[int],
                 shapes: Sequence[tuple[int, int, int]] = ((32, 8, 128),), block_sizes: Sequence[int] = (16,),
                 kv_dtypes: Sequence[str] = ("bf16", "fp8_e4m3"), modes: Sequence[str] = ("dequant",),
                 backends: Sequence[str] = ("triton", "flashinfer", "vllm"), granularities: Sequence[str] = ("tensor",),
                 q_dtype: str | None = None, triton_options: dict | Sequence[dict] | None = None,
                 layout: str = "NHD", memory_budget_bytes: int | None = None, device=None, arch: str | None = None,
                 seed: int = 0) -> list[AttendCase]:
    """Expand the grid into :class:`AttendCase` s: the product of the arguments, minus fp8 mode over a 16-bit
    cache; each case asked of :func:`fp8kv.capability.check` (``op="attend"``; ``arch=None``: this machine) and
    :func:`~fp8kv.capability.check_query`, kept ``"unsupported"`` with the reason where it cannot run, and
    ``"skipped"`` where :func:`attend_footprint` exceeds ``memory_budget_bytes`` (default 60 % of the free
    memory). ``contexts`` may hold 0 (a chunk of a new prompt); ``q_dtype`` defaults to bf16 on a GPU and fp16 on
    CPU (the interpreter's bf16 is wrong); ``triton_options``: one dict or a list (a variant each) of
    :data:`~fp8kv.attend_checks.ATTEND_BACKEND_OPTIONS`."""
    from ..device import resolve_device

    dev = resolve_device(device)
    q_dtype = q_dtype or ("bf16" if dev.type == "cuda" else "fp16")
    budget = memory_budget(dev) if memory_budget_bytes is None else int(memory_budget_bytes)
    tri_opts = [dict(o) for o in _as_list(triton_options or {}, "triton_options")]
    for kv in _as_list(kv_dtypes, "kv_dtypes"):  # before a case names itself (AttendCase.kv_dtype)
        checks.one_of(kv, "kv_dtypes", KV_DTYPE_NAMES)
    layouts = [tuple(x) for x in _as_list(list(shapes), "shapes")]
    for x in layouts:
        if len(x) != 3:
            checks.fail(f"shapes entry {x!r}; expected (num_q_heads, num_kv_heads, head_dim) triples such as (32, 8, 128)")
    sizes = [check_block_size(bs, f"block_sizes[{i}]") for i, bs in enumerate(_as_list(block_sizes, "block_sizes"))]
    cases, seen = [], set()
    grid = itertools.product(_as_list(batches, "batches"), _as_list(contexts, "contexts"), _as_list(q_lens, "q_lens"),
                             layouts, sizes, _as_list(kv_dtypes, "kv_dtypes"), _as_list(backends, "backends"),
                             _as_list(modes, "modes"), _as_list(granularities, "granularities"))
    for b, ctx, n, (hq, hkv, d), bs, kv, backend, mode, gran in grid:
        if mode_refusal(kv, mode):
            continue  # not a combination: fp8 mode is about FP8 KV
        for opts in tri_opts if backend == "triton" else [{}]:
            case = AttendCase(b, ctx, n, hq, hkv, d, bs, kv, mode, backend, gran, q_dtype, layout, dict(opts),
                              seed=checks.integer(seed, "seed"))
            key = (case.cache_key, case.q_len, case.num_q_heads, case.label)
            if key in seen:
                continue
            seen.add(key)
            ok, why = capability_check(backend, kv, mode, arch, case.granularity, d, layout, op="attend")
            if ok:
                ok, why = check_query(backend, q_dtype, kv)
            if ok and "convert" in opts and (why_not := convert_refusal(kv, mode)):  # refused there, so no row
                case.status, case.reason = "skipped", f"convert does not apply: {why_not}"
                cases.append(case)
                continue
            # so would this one where the Gluon kernel cannot read the pages (the decode's twin: fp8kv.bench.cases)
            if ok and opts.get("gluon") is False and not reads_pages(kv, case.granularity, d):
                case.status, case.reason = "skipped", (f"the Gluon kernel reads {READS_PAGES}: over {kv} "
                                                       f"({case.granularity}) gluon=False runs the default")
                cases.append(case)
                continue
            if not ok:
                case.status, case.reason = "unsupported", why
            elif attend_footprint(case) > budget:
                case.status = "skipped"
                case.reason = f"does not fit: needs ~{gib_text(attend_footprint(case))}, budget {gib_text(budget)}"
            cases.append(case)
    return cases


def _checked(batch: int, n: int) -> list[int]:
    """The sequences compared with the oracle: the first ``n - 1`` and the last."""
    return list(range(batch)) if batch <= n else sorted({*range(n - 1), batch - 1})


def _row(base: dict, c: AttendCase, **values) -> dict:
    row = dict.fromkeys(ATTEND_COLUMNS)
    by = attend_bytes(c)
    row.update(base, op="attend", label=c.label, backend=c.backend, variant=c.variant, mode=c.mode,
               kv_dtype=c.kv_dtype, granularity=c.granularity, layout=c.layout, q_dtype=c.q_dtype, batch=c.batch,
               context=c.context, q_len=c.q_len, num_q_heads=c.num_q_heads, num_kv_heads=c.num_kv_heads,
               head_dim=c.head_dim, block_size=c.block_size, bytes=by["total"], kv_bytes=by["kv"],
               flops=attend_flops(c), time_us=float("nan"), gbps=float("nan"), tflops=float("nan"),
               math_peak_tflops=attend_math_peak(c, base["gpu"]), pct_math_peak=float("nan"),
               pct_copy_bw=float("nan"), rel_err=float("nan"), reason="")
    row.update(values)
    return row


def _measure(c: AttendCase, caches: list, dev: torch.device, base: dict, *, check: bool, rep: int, warmup: int,
             check_seqs: int, cpu_reps: int) -> dict:
    values: dict = {"tol": output_tolerance(c.backend, c.mode, c.q_dtype, c.granularity), "kv_copies": len(caches)}
    try:
        g = torch.Generator(device=dev).manual_seed(c.seed + 7)
        hq, d = c.num_q_heads, c.head_dim
        q = torch.randn(c.batch * c.q_len, hq, d, generator=g, device=dev).to(Q_DTYPES[c.q_dtype])
        indptr = torch.arange(c.batch + 1, dtype=torch.int32, device=dev) * c.q_len
        calls = [planned_attend(q, cache, indptr, c.backend, c.mode, **c.options) for cache in caches]
        if c.backend == "triton":
            from ..ops.decode.planning import DecodePlan  # here: importing fp8kv.bench must not import triton

            plan = calls[0].args[0]
            if isinstance(plan, DecodePlan):  # fp8kv.attend runs a decode kernel: one new token, or (token, head) rows
                values.update(kernel=f"decode-{plan.kernel}" if plan.qo_len == 1 else f"{plan.kernel}-multi-token",
                              block_m=plan.config.get("heads_per_program"),
                              **{k: plan.config.get(k) for k in ("num_splits", "block_n", "num_warps")})
            else:
                values.update(kernel="triton-attend", **{k: plan.config[k] for k in ("num_splits", "block_m",
                                                                                      "block_n", "num_warps")})
        elif c.backend == "vllm":  # its split ("3D") launch only where every sequence has one new token
            segments = calls[0].args[0].args.get("num_par_softmax_segments") or 1
            values.update(kernel="vllm-3d" if segments > 1 else "vllm-2d", num_splits=segments)
        else:
            values["kernel"] = "flashinfer-prefill" if c.backend == "flashinfer" else c.backend
        out = calls[0]()[0]
        reclaim_stop_signals()  # the first call compiled: take the handlers back before the timing's minutes
        if check:
            from ..reference import attend as ref_attend

            idx = _checked(c.batch, check_seqs)
            sub = caches[0] if len(idx) == c.batch else caches[0].select(idx)
            rows = q.view(c.batch, c.q_len, hq, d)[idx].reshape(-1, hq, d)
            ref = ref_attend(rows, sub, indptr[:len(idx) + 1])
            err = relative_error(out.view(c.batch, c.q_len, hq, d)[idx].reshape(-1, hq, d), ref)
            values.update(rel_err=err, check_passed=bool(err <= values["tol"]))
            del ref, sub
        del out
        cycle = itertools.cycle(calls)
        seconds, timing = time_call(lambda: next(cycle)(), dev, graph=c.backend != "reference", rep=rep,
                                    warmup=warmup, cpu_reps=cpu_reps)
    except torch.OutOfMemoryError as e:
        return _row(base, c, status="skipped", reason=f"out of memory: {e}", **values)
    except UnsupportedError as e:
        return _row(base, c, status="unsupported", reason=str(e), **values)
    except Exception as e:  # one broken cell must not end the sweep; the row says what happened
        return _row(base, c, status="error", reason=f"{type(e).__name__}: {e}", **values)
    gbps = attend_bytes(c)["total"] / seconds / 1e9
    tflops = attend_flops(c) / seconds / 1e12
    copy = base["copy_gbps"]
    return _row(base, c, status="ok", timing=timing, time_us=seconds * 1e6, gbps=gbps, tflops=tflops,
                pct_math_peak=100.0 * tflops / attend_math_peak(c, base["gpu"]),  # NaN where the peak is
                pct_copy_bw=100.0 * gbps / copy if copy == copy else copy, **values)


def attend_run(cases: Sequence[AttendCase], *, check: bool = True, rep: int = 100, warmup: int = 25,
               copy_bandwidth=None, progress: bool = True, device=None, rotate: bool = True, check_seqs: int = 2,
               cpu_reps: int = 3, keep_partial: bool = False) -> pd.DataFrame:
    """Measure ``cases`` (as :func:`fp8kv.bench.run` measures decode cases: the same arguments, timers, cache
    builds and L2 rotation); one row per case, columns :data:`ATTEND_COLUMNS`. Each row that runs is checked
    against :func:`fp8kv.reference.attend` on ``check_seqs`` sequences (the first ones and the last) before it
    is timed; ``df.attrs["bench"]`` holds the run's metadata."""
    from tqdm.auto import tqdm

    from ..device import describe_device, resolve_device

    dev = resolve_device(device)
    cases = list(cases)
    for i, c in enumerate(cases):
        if not isinstance(c, AttendCase):
            checks.fail(f"cases[{i}] is a {type(c).__name__}; expected fp8kv.bench.attend.AttendCase", TypeError)
    checks.rep_ms(rep, "rep")
    checks.rep_ms(warmup, "warmup")
    checks.positive_int(check_seqs, "check_seqs")
    checks.positive_int(cpu_reps, "cpu_reps")
    checks.flag(keep_partial, "keep_partial")
    info = describe_device(dev)
    ready = [i for i, c in enumerate(cases) if c.status == "ready"]
    copy_gbps, copy_info = resolve_copy_bandwidth(copy_bandwidth, dev) if ready else (float("nan"), None)
    stamp = utc_stamp()
    base = {"timestamp": stamp, "gpu": info["name"], "gpu_slug": info["slug"], "arch": info["arch"],
            "device": info["device"], "torch": info["torch"], "triton": info["triton"], "flashinfer": info["flashinfer"],
            "vllm": info["vllm"], "fp8kv_source": info["fp8kv_source"], "copy_gbps": copy_gbps}
    rows = {i: _row(base, c, status=c.status, reason=c.reason) for i, c in enumerate(cases) if c.status != "ready"}
    groups: dict[tuple, list[int]] = {}
    for i in ready:
        groups.setdefault(cases[i].cache_key, []).append(i)
    bar = tqdm(total=len(ready), disable=not progress, desc="attend", unit="case")

    def measure_groups():
        for idx in groups.values():
            first = cases[idx[0]]
            try:
                caches = [synthetic_cache(first.batch, first.seq_len, first.num_kv_heads, first.head_dim,
                                          block_size=first.block_size, kv_dtype=first.kv_dtype,
                                          granularity=first.granularity, layout=first.layout, device=dev,
                                          seed=first.seed)]
                if rotate and dev.type == "cuda":  # clones until 4 x L2: every call reads K/V from HBM
                    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0) or 64 * 2**20)
                    copies = math.ceil(4 * l2 / caches[0].nbytes) - 1
                    caches += [caches[0].clone() for _ in range(copies)]
            except Exception as e:  # OOM or a broken build: the group's rows say so, the sweep goes on
                oom = isinstance(e, torch.OutOfMemoryError)
                for i in idx:
                    rows[i] = _row(base, cases[i], status="skipped" if oom else "error",
                                   reason=f"building the cache: {type(e).__name__}: {e}")
                bar.update(len(idx))
                continue
            for i in idx:
                bar.set_postfix_str(f"{cases[i].label} B={cases[i].batch} ctx={cases[i].context}")
                rows[i] = _measure(cases[i], caches, dev, base, check=check, rep=rep, warmup=warmup,
                                   check_seqs=check_seqs, cpu_reps=cpu_reps)
                reclaim_stop_signals()  # a compile in the case may have let LLVM take them
                bar.update(1)
            del caches
            release_memory(dev)

    interrupted = interruptible(measure_groups, keep_partial=keep_partial, dev=dev)
    if interrupted:
        for i, c in enumerate(cases):
            rows.setdefault(i, _row(base, c, status="skipped", reason="the run was interrupted before this case"))
    bar.close()
    df = pd.DataFrame([rows[i] for i in range(len(cases))], columns=ATTEND_COLUMNS)
    df.attrs["bench"] = {"timestamp": stamp, "op": "attend", "device": info, "copy_bandwidth": copy_info,
                         "interrupted": interrupted, "settings": {"check": check, "rep": rep, "warmup": warmup,
                                                                 "rotate": rotate, "check_seqs": check_seqs,
                                                                 "cpu_reps": cpu_reps}}
    return df


def attend_summary(df: pd.DataFrame) -> str:
    """A compact text table of an attend run: q_len, µs, GB/s, TFLOP/s, % of the dense math peak, % of copy, check;
    then what did not run."""
    lines = []
    ok = df[df["status"] == "ok"]
    if len(ok):
        t = ok[["label", "batch", "context", "q_len", "num_q_heads", "num_kv_heads", "head_dim", "num_splits", "time_us",
                "gbps", "tflops", "pct_math_peak", "pct_copy_bw", "rel_err", "check_passed"]].copy()
        t.columns = ["case", "B", "ctx", "q_len", "Hq", "Hkv", "D", "splits", "us", "GB/s", "TFLOP/s", "%math",
                     "%copy", "rel_err", "check"]
        lines.append(t.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        lines.append(f"copy bandwidth: {ok['copy_gbps'].iloc[0]:.0f} GB/s on {ok['gpu'].iloc[0]}")
        peaks = ok.dropna(subset=["math_peak_tflops"]).drop_duplicates("mode").set_index("mode")["math_peak_tflops"]
        lines.append("%math: TFLOP/s over the dense tensor-core peak of the mode's dot ("
                     + (", ".join(f"{m}: {p:g} TFLOP/s" for m, p in peaks.items()) if len(peaks) else
                        "not known for this device: fp8kv.device.MATH_PEAK_TFLOPS") + ")")
        if (ok["timing"] == "cpu-wallclock").any():
            lines.append("CPU wall-clock timings (interpreter / reference): they say nothing about any GPU.")
    for status in ("unsupported", "skipped", "error"):
        rest = df[df["status"] == status]
        if len(rest):
            lines.append(f"{status} ({len(rest)}):")
            for (label, reason), grp in rest.groupby(["label", "reason"], sort=False):
                lines.append(f"  {label} x{len(grp)}: {reason}")
    return "\n".join(lines)
