"""The benchmark's cases: :class:`Case` (one cell of the grid), :func:`sweep` (the grid, with what
cannot run here marked), the bytes a decode call moves (:func:`bytes_moved`), the check tolerance
(:func:`tolerance`, from :mod:`fp8kv.reference`) and the memory a case needs (:func:`footprint_bytes`,
:func:`memory_budget`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .. import checks
from ..cache import LAYOUTS, check_block_size
from ..capability import BACKEND_NAMES, KV_DTYPE_NAMES, MODES, check_query
from ..capability import check as capability_check
from ..capability_formats import mode_refusal
from ..capacity import gib_text
from ..checks import fail as _fail
from ..formats import KV_DTYPES, UNQUANTIZED_DTYPES, is_fp8
from ..launch_options import convert_refusal
from ..ops.decode.gluon_scope import READS_PAGES, reads_pages
from ..quant import GRANULARITIES, kv_scale_bytes
from ..reference import output_tolerance
from ..synthetic import CHUNK_ELEMS
from .formats import QUANT_KV_DTYPES, format_bytes, format_footprint_bytes, format_support, is_quantized

Q_DTYPES = UNQUANTIZED_DTYPES  # the query types a case may ask for


# --------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One benchmark cell: a decode shape, a cache format and a backend configuration.

    ``options`` go to the backend as keyword arguments: Triton launch overrides (``num_splits``,
    ``block_n``, ``num_warps``, ``num_stages``) or FlashInfer's ``use_tensor_cores`` (vLLM's kernel takes none). ``status`` is
    ``"ready"``, ``"unsupported"`` or ``"skipped"`` (set by :func:`sweep`, with ``reason``).
    ``window``: a sliding-window layer attending the last ``window`` tokens of each sequence (as
    :func:`fp8kv.decode` defines it; FlashInfer's ``window_left = window - 1``); None: the whole context.
    """

    batch: int
    context: int  # tokens per sequence (every sequence of the batch holds this many)
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
    window: int | None = None

    def __post_init__(self):
        checks.run_seed(self.seed, "Case.seed")
        if self.window is not None:
            checks.positive_int(self.window, "Case.window")
        for name in ("batch", "context", "num_q_heads", "num_kv_heads", "head_dim", "block_size"):
            checks.positive_int(getattr(self, name), f"Case.{name}")
        if self.num_q_heads % self.num_kv_heads:
            _fail(f"Case.num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        choices = {"kv_dtype": (*KV_DTYPE_NAMES, *QUANT_KV_DTYPES), "mode": MODES, "backend": BACKEND_NAMES,
                   "granularity": GRANULARITIES, "q_dtype": tuple(Q_DTYPES), "layout": LAYOUTS,
                   "status": ("ready", "unsupported", "skipped")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                _fail(f"Case.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if not isinstance(self.options, dict):
            _fail(f"Case.options must be a dict of backend keyword arguments, got {type(self.options).__name__}",
                  TypeError)
        if why_not := mode_refusal(self.kv_dtype, self.mode):
            _fail(f"Case.mode={self.mode!r} with kv_dtype={self.kv_dtype!r}: {why_not}")
        if not is_fp8(self.kv_dtype):
            self.granularity = "tensor"  # 16-bit caches carry no scales; a quantized format names its own
        if not self.label:
            self.label = " ".join(x for x in (self.backend + (f"-{self.variant}" if self.variant else ""),
                                              self.kv_dtype, self.mode,
                                              "" if self.granularity == "tensor" else self.granularity,
                                              "" if self.window is None else f"window={self.window}") if x)

    @property
    def variant(self) -> str:
        """Backend configuration in a word: ``tc``/``no-tc`` for FlashInfer, ``k=v,...`` overrides."""
        opts = dict(self.options)
        tc = opts.pop("use_tensor_cores", None)
        parts = [] if tc is None else ["tc" if tc else "no-tc"]
        parts += [f"{k}={v}" for k, v in sorted(opts.items())]
        return ",".join(parts)

    @property
    def cache_key(self) -> tuple:
        """Cases with equal keys read the same cache (built once by :func:`run`)."""
        return (self.batch, self.context, self.num_kv_heads, self.head_dim, self.block_size, self.kv_dtype,
                self.granularity, self.layout, self.seed)

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.kv_dtype)


def _elem_size(kv_dtype: str) -> int:
    return KV_DTYPES[kv_dtype][0].itemsize


def _out_elem_size(case: Case) -> int:
    # The reference returns fp32; Triton, FlashInfer and vLLM return the query's dtype, or the out_dtype asked for.
    if case.backend == "reference":
        return 4
    out_dtype = case.options.get("out_dtype")
    return (out_dtype or Q_DTYPES[case.q_dtype]).itemsize


def bytes_moved(case: Case, seq_lens: Sequence[int] | None = None) -> dict:
    """Useful bytes one decode call moves, by part (ints).

    ``kv`` = Σ_b tokens_b × Hkv × D × 2 (K and V) × element size, with ``tokens_b = seq_len_b``, or
    ``min(seq_len_b, window)`` for a windowed case (the tokens it attends); ``scales`` = scale bytes read
    (fp32: two scalars for tensor, 2 × Hkv for head, 2 × Hkv × D for channel, 2 × Hkv per token for
    token_head; 0 for 16-bit caches). A quantized format (:data:`.formats.QUANT_KV_DTYPES`) counts ``kv`` as its
    codes and ``scales`` as its per-token and tensor scales, both from ``kv_footprint``
    (:func:`.formats.format_bytes`); ``q`` = B × Hq × D × q's size; ``out`` = B × Hq × D × the
    output's size (an ``out_dtype`` among the options, else q's; fp32 for the reference). Block tables, seq_lens, the LSE and split-KV partials are not counted (< 0.1 %
    of ``kv`` at Hkv × D = 1024, except the partials, which are an implementation cost, not work).
    ``seq_lens`` defaults to ``[case.context] * case.batch``.
    """
    lens = [case.context] * case.batch if seq_lens is None else [int(n) for n in seq_lens]
    tokens = sum(lens) if case.window is None else sum(min(n, case.window) for n in lens)
    hkv, d = case.num_kv_heads, case.head_dim
    if is_quantized(case.kv_dtype):
        kv, scales = format_bytes(case.kv_dtype, tokens, hkv, d)
    else:
        kv = tokens * hkv * d * 2 * _elem_size(case.kv_dtype)
        fixed, per_token = kv_scale_bytes(case.granularity if case.is_fp8 else None, num_layers=1,
                                          num_kv_heads=hkv, head_dim=d)
        scales = fixed + per_token * tokens
    q = case.batch * case.num_q_heads * d * Q_DTYPES[case.q_dtype].itemsize
    out = case.batch * case.num_q_heads * d * _out_elem_size(case)
    return {"kv": kv, "scales": scales, "q": q, "out": out, "total": kv + scales + q + out}


def tolerance(case: Case) -> float:
    """Allowed ``||out - ref|| / ||ref||`` of ``case`` against the fp32 reference on the same dequantized
    cache: :func:`fp8kv.reference.output_tolerance` (where the tolerance model is derived). A quantized
    format's row takes its tolerance from its data (:func:`.formats.check_quantized`): NaN here."""
    if is_quantized(case.kv_dtype):
        return float("nan")
    return output_tolerance(case.backend, case.mode, case.q_dtype, case.granularity)


# ----------------------------------------------------------------------------------------- memory
def footprint_bytes(case: Case) -> int:
    """Device bytes a case needs at peak: pages + scales + build workspace + check + split partials."""
    if is_quantized(case.kv_dtype):
        return format_footprint_bytes(case)
    bs = case.block_size
    num_blocks = case.batch * math.ceil(case.context / bs)
    page_elems = num_blocks * bs * case.num_kv_heads * case.head_dim
    pages = 2 * page_elems * _elem_size(case.kv_dtype)
    _, scale_per_token = kv_scale_bytes(case.granularity if case.is_fp8 else None, num_layers=1,
                                        num_kv_heads=case.num_kv_heads, head_dim=case.head_dim)
    scales = 2 * num_blocks * bs * scale_per_token  # per-token scales: built + the cache's own copy
    build = min(page_elems, CHUNK_ELEMS) * 4 * 3 if case.is_fp8 else min(page_elems, CHUNK_ELEMS) * 4
    check = 2 * 2 * case.context * case.num_kv_heads * case.head_dim * 4  # two gathered fp32 sequences
    partials = case.batch * case.num_q_heads * 128 * (case.head_dim + 1) * 4  # ≤ 128 splits in fp32
    return pages + scales + build + check + partials


def memory_budget(device: torch.device | str | None = None, fraction: float = 0.6) -> int:
    """``fraction`` of the free memory of ``device`` (:func:`fp8kv.device.free_memory_bytes`)."""
    from ..device import free_memory_bytes, resolve_device

    dev = resolve_device(device)
    if not 0 < fraction <= 1:
        _fail(f"fraction={fraction}; expected a number in (0, 1]")
    free = free_memory_bytes(dev)
    if free is None:  # unreadable here: assume 8 GiB
        free = 8 * 2**30
    return int(free * fraction)


# ------------------------------------------------------------------------------------------ sweep
def _as_list(x, name):
    if isinstance(x, (str, int, dict)) or x is None:
        x = [x]
    x = list(x)
    if not x:
        _fail(f"{name} is empty; give at least one value")
    return x


def sweep(batches: Sequence[int], contexts: Sequence[int], heads: Sequence[tuple[int, int]] = ((32, 8),),
          head_dims: Sequence[int] = (128,), block_sizes: Sequence[int] = (16,),
          kv_dtypes: Sequence[str] = ("bf16", "fp8_e4m3"), modes: Sequence[str] = ("dequant", "fp8"),
          backends: Sequence[str] = ("triton", "flashinfer"), granularities: Sequence[str] = ("tensor",),
          q_dtype: str | None = None, flashinfer_tensor_cores: Sequence[bool] = (False, True),
          triton_options: dict | Sequence[dict] | None = None, layout: str = "NHD",
          memory_budget_bytes: int | None = None, device=None, arch: str | None = None,
          windows: Sequence[int | None] = (None,), shapes: Sequence[tuple[int, int, int]] | None = None,
          seed: int = 0) -> list[Case]:
    """Expand the grid into :class:`Case` s, marking what cannot run here.

    The product of every argument, minus combinations that are not combinations at all (fp8 mode
    on a 16-bit cache; granularities of a 16-bit cache collapse to one). Each remaining case is
    checked with :func:`fp8kv.capability.check` (``arch=None``: this machine) and kept with
    ``status="unsupported"`` and the reason when it cannot run, and with ``status="skipped"``,
    ``reason="does not fit ..."`` when :func:`footprint_bytes` exceeds ``memory_budget_bytes``
    (default: 60 % of the device's free memory now).

    Parameters
    ----------
    heads : (Hq, Hkv) pairs.
    q_dtype : "bf16", "fp16" or "fp32"; default bf16 on a GPU, fp16 on CPU (the Triton
        interpreter's bf16 arithmetic is wrong).
    flashinfer_tensor_cores : FlashInfer variants (``use_tensor_cores`` values) per FlashInfer cell.
    triton_options : one dict or a list of dicts of Triton launch overrides (one variant each).
    windows : sliding windows (None: the whole context), one case each (:attr:`Case.window`).
    shapes : (Hq, Hkv, D) head layouts; when given they replace the product of ``heads`` and ``head_dims``
        (a model family is one triple, not every pairing of its numbers).
    seed : the synthetic cache's data (:attr:`Case.seed`) for every case.
    arch : ask the capability table about another arch ("sm90") instead of this machine.
    """
    from ..device import resolve_device

    dev = resolve_device(device)
    if q_dtype is None:
        q_dtype = "bf16" if dev.type == "cuda" else "fp16"
    budget = memory_budget(dev) if memory_budget_bytes is None else int(memory_budget_bytes)
    seed = checks.integer(seed, "seed")
    tri_opts = [dict(o) for o in _as_list(triton_options or {}, "triton_options")]
    fi_opts = [{"use_tensor_cores": checks.flag(t, f"flashinfer_tensor_cores[{i}]")}  # bool("no") is True
               for i, t in enumerate(_as_list(flashinfer_tensor_cores, "flashinfer_tensor_cores"))]
    # names checked here, before the grid: a name no case takes (an unknown dtype with fp8 mode) made no case at all
    for name, given, allowed in (("kv_dtypes", kv_dtypes, (*KV_DTYPE_NAMES, *QUANT_KV_DTYPES)), ("modes", modes, MODES),
                                 ("backends", backends, BACKEND_NAMES), ("granularities", granularities, GRANULARITIES)):
        for x in _as_list(given, name):
            if not isinstance(x, str) or x not in allowed:
                _fail(f"{name} has {x!r}; expected names among {allowed}")
    checks.one_of(layout, "layout", LAYOUTS)
    formats = [kv for kv in _as_list(kv_dtypes, "kv_dtypes") if is_quantized(kv)]
    if layout != "NHD" and formats:  # their rows would say HND over NHD pages (QuantizedPagedKVCache's only layout)
        _fail(f"layout={layout!r} (--page-layout {layout}): the quantized formats {' '.join(formats)} of kv_dtypes "
              "(--kv-dtypes) are stored in NHD pages only; drop the layout, or give the formats without it")
    if not isinstance(heads, (list, tuple)) or not heads:
        _fail(f"heads={heads!r}; expected a non-empty list of (num_q_heads, num_kv_heads) pairs such as [(32, 8)]",
              TypeError if not isinstance(heads, (list, tuple)) else ValueError)
    heads = [tuple(h) if isinstance(h, (list, tuple)) else (h,) for h in heads]
    for h in heads:
        if len(h) != 2:
            _fail(f"heads entry {h!r}; expected (num_q_heads, num_kv_heads) pairs such as (32, 8)")
    if shapes is None:
        layouts = [(hq, hkv, d) for (hq, hkv), d in itertools.product(heads, _as_list(head_dims, "head_dims"))]
    else:
        layouts = [tuple(x) for x in _as_list(list(shapes), "shapes")]
        for x in layouts:
            if len(x) != 3:
                _fail(f"shapes entry {x!r}; expected (num_q_heads, num_kv_heads, head_dim) triples such as (32, 8, 128)")
    cases, seen = [], set()
    block_sizes = [check_block_size(bs, f"block_sizes[{i}]") for i, bs in enumerate(_as_list(block_sizes, "block_sizes"))]
    grid = itertools.product(_as_list(batches, "batches"), _as_list(contexts, "contexts"), layouts, block_sizes,
                             _as_list(kv_dtypes, "kv_dtypes"), _as_list(backends, "backends"),
                             _as_list(modes, "modes"), _as_list(granularities, "granularities"))
    grid = itertools.product(grid, _as_list(list(windows), "windows"))
    for (b, ctx, (hq, hkv, d), bs, kv, backend, mode, gran), window in grid:
        if mode_refusal(kv, mode):
            continue  # not a combination: fp8 mode is about FP8 KV (a quantized format's runs in dequant mode)
        opts_list = {"triton": tri_opts, "flashinfer": fi_opts}.get(backend, [{}])
        for opts in opts_list:
            case = Case(b, ctx, hq, hkv, d, bs, kv, mode, backend, gran, q_dtype, layout, dict(opts), window=window,
                        seed=seed)
            key = (case.cache_key, case.num_q_heads, case.mode, case.backend, case.q_dtype, case.label)
            if key in seen:
                continue
            seen.add(key)
            if is_quantized(kv):  # the format's capability rows; the kernel takes any 16/32-bit query
                ok, why = format_support(backend, kv, arch)
                if ok and window is not None:
                    ok, why = False, f"the quantized-page kernel reads the whole context; {kv} has no window rows"
            else:
                ok, why = capability_check(backend, kv, mode, arch, case.granularity, d, layout)
                if ok:
                    ok, why = check_query(backend, q_dtype, kv)
            if ok and "convert" in opts and (why_not := convert_refusal(kv, mode)):  # refused there, so no row
                case.status, case.reason = "skipped", f"convert does not apply: {why_not}"
                cases.append(case)
                continue
            if ok and opts.get("gluon") is False and not reads_pages(kv, case.granularity, d):
                case.status, case.reason = "skipped", (f"the Gluon kernel reads {READS_PAGES}: over {kv} "
                                                       f"({case.granularity}, D {d}) gluon=False runs the default")
                cases.append(case)
                continue
            if not ok:
                case.status, case.reason = "unsupported", why
            elif footprint_bytes(case) > budget:
                case.status = "skipped"
                case.reason = f"does not fit: needs ~{gib_text(footprint_bytes(case))}, budget {gib_text(budget)}"
            cases.append(case)
    return cases

