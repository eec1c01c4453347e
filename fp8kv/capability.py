"""What runs where: arch × backend × KV dtype × mode → supported, with the reason.

Modes: ``dequant`` stores FP8 and does the arithmetic in 16 bits (the cache is converted to the
query's dtype in registers); ``fp8`` quantizes the query (and the probabilities) to FP8 and feeds
FP8 tensor cores. For a 16-bit cache only ``dequant`` applies.

The facts, each with its source:

* FP8 *storage* works on every GPU from sm80 on: a byte is a byte; a kernel that cannot convert
  in hardware loads uint8 and decodes the bits in software (``fp8_bits_to_fp16``,
  ``fp8kv/ops/fp8_codec.py``).
* FP8 tensor-core arithmetic (``mma ... .e4m3/.e5m2``) needs sm89 or newer (PTX ISA, "Warp-level
  matrix instructions: mma", FP8 types require sm_89).
* Triton compiles ``fp8e4nv`` (e4m3fn) only on sm89+; below that it offers ``fp8e5`` and
  ``fp8e4b15`` (triton ``python/triton/language/semantic.py`` / the CUDA backend's
  ``supported_fp8_dtypes``). So on sm80/86 fp8kv's Triton kernel reads e4m3 as uint8 and decodes it.
* Triton's FP8 ``tl.dot`` needs at least 32 along K (the mma k-size for 8-bit types); fp8kv's
  fp8 mode uses head_dim (≥ 64) for QKᵀ and a KV tile of ≥ 32 for P·V.
* FlashInfer's FA2 decode (``BatchDecodeWithPagedKVCacheWrapper``) reads FP8 KV on sm80+ and takes
  only scalar ``k_scale``/``v_scale`` (flashinfer/decode.py); fp8kv folds per-head and per-channel
  scales exactly into the query (K) and the output (V). Per-token scales cannot be folded.
* FlashInfer takes an FP8 *query* only in its TRT-LLM-generated kernels, built for sm100
  (flashinfer ``trtllm_batch_decode_with_kv_cache``); elsewhere ``q_data_type`` must be 16-bit.
* FlashInfer decode builds head_dim 64, 128, 256.
* Attention variants in FlashInfer 0.6.13 (``flashinfer/decode.py``, ``include/flashinfer/attention/
  variants.cuh``): ``plan(window_left=..., logits_soft_cap=...)``; the FA2 mask keeps key ``j`` when
  ``j + qo_len + window_left >= kv_len + qo_idx``, so a decode query sees ``window_left + 1`` keys
  (fp8kv's window W is ``window_left = W - 1``); soft-capping is ``cap * tanh(sm_scale * q·k / cap)``.
  ``run(sinks=...)`` reaches only the TRT-LLM-generated kernels: the FA2 run path drops it.
  ``trtllm_batch_decode_with_kv_cache`` takes ``window_left`` and ``sinks`` but no soft cap.
* vLLM's Triton unified-attention kernel (vllm-project/vllm ``vllm/v1/attention/ops/
  triton_unified_attention.py``, read at commit 86a153bd; the facts in :mod:`fp8kv.backends.vllm`)
  reads NHD pages ``[num_blocks, block_size, Hkv, D]``, takes no query scale (``q_descale`` must be
  None: no FP8-query mode), dequantizes FP8 with one per-tensor scale (``KVQuantMode.FP8_PER_TENSOR``:
  ``(stored * k_scale).to(q.dtype)``), loads the float8 pages as they are (so e4m3 needs Triton's
  ``fp8e4nv``: sm89+), pads head_dim to a power of two, and returns no LSE. It maps fp8kv's window,
  soft cap and sinks one to one. It is never chosen automatically: it is a peer to measure against.

Two operations (:data:`OPS`): ``"decode"``, one query token per sequence (``fp8kv.decode``), and
``"attend"``, several new tokens per sequence, causal among them (``fp8kv.attend``: speculative
verification, chunked-prefill append). The attend runs where the decode does, by the same facts, but that
FlashInfer runs it (``BatchPrefillWithPagedKVCacheWrapper``, FA2, 16-bit query; causal mask aligned bottom-right,
``plan(window_left=..., logits_soft_cap=...)`` as its decode) in dequant mode only: its FP8-query paths are not
wired for the attend (:func:`check` with ``op="attend"``; the table :func:`attend_capability`, per class of
new-token counts with the kernel that runs for ``by_queries=True``). Which kernel runs each count on each
backend, and why: :mod:`fp8kv.capability_attend`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Sequence

from . import checks
from .cache import LAYOUTS  # same layer as capability; cache imports nothing of it
from .capability_attend import QUERY_CLASSES, attend_facts, query_kernel  # same layer, imports none of this
from .device import current_arch  # the arch of a device ("sm90"), None on CPU
from .formats import KV_DTYPE_NAMES, UNQUANTIZED_DTYPES, is_fp8
from .quant import GRANULARITIES

__all__ = ["ARCHS", "AUTO_MODE", "BACKEND_NAMES", "KV_DTYPE_NAMES", "MODES", "FP8_MODE_NEEDS_FP8", "VARIANTS", "UnsupportedError",
           "check", "check_query", "capability", "current_arch", "arch_number",
           "choose_backend", "choose_mode", "flashinfer_installed", "vllm_installed", "check_variant", "check_variants",
           "variants", "VLLM_HEAD_DIMS", "VLLM_NOT_INSTALLED", "scales_refusal", "check_query_strides",
           "interpreter_on", "use_interpreter", "INTERPRETER_ENV", "OPS", "attend_capability"]

ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm120")
BACKEND_NAMES = ("reference", "triton", "flashinfer", "vllm")  # fp8kv.backends.BACKENDS maps each to its runner
MODES = ("dequant", "fp8")
FP8_MODE_NEEDS_FP8 = "fp8 mode needs an FP8 KV cache; a 16-bit cache runs in dequant mode"  # why a 16-bit one has none
FLASHINFER_HEAD_DIMS = (64, 128, 256)
# The head dims at which vLLM's kernel (it pads head_dim to a power of two) was checked against the
# oracle on an H200 (Triton 3.6, vLLM commit 86a153bd, both launch paths): an earlier build of it crashed
# the CUDA context at 96, so a size not measured is refused rather than trusted.
VLLM_HEAD_DIMS = (64, 80, 96, 112, 128, 256)
VLLM_NOT_INSTALLED = ("vLLM is not installed (fp8kv imports its kernel from vllm.v1.attention.ops."
                      "triton_unified_attention: pip install vllm, or put a package providing that module on "
                      "PYTHONPATH)")
TRITON_MAX_HEAD_DIM = 256
VARIANTS = ("window", "soft_cap", "sinks")  # the keyword arguments of fp8kv.decode that name them
OPS = ("decode", "attend")  # one query token per sequence (fp8kv.decode), several (fp8kv.attend)


class UnsupportedError(ValueError):
    """A backend/mode/dtype combination this machine (or the asked arch) cannot run; says why."""


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


INTERPRETER_ENV = "TRITON_INTERPRET"  # Triton runs its kernels on CPU, interpreted, where this is set (not "0")


def interpreter_on() -> bool:
    return os.environ.get(INTERPRETER_ENV, "0") not in ("", "0")


def use_interpreter(environ=None) -> bool:
    """Turn the Triton interpreter on: the one place :data:`INTERPRETER_ENV` is set, by every command's
    ``--interpret`` and the notebooks on CPU. In ``environ`` (a child process's environment), or by default in
    this process's, where Triton reads it once, when it is first imported: True where it is on (now, or
    already), False (nothing set) where triton was already imported without it, too late to take effect."""
    if environ is not None:
        environ[INTERPRETER_ENV] = "1"
        return True
    if interpreter_on():
        return True
    if "triton" in sys.modules:
        return False
    os.environ[INTERPRETER_ENV] = "1"
    return True


def check_query(backend: str, q_dtype, kv_dtype: str) -> tuple[bool, str]:
    """Whether ``backend`` takes a ``q_dtype`` query (a name such as "bf16", or a torch dtype) with a
    ``kv_dtype`` cache: ``(ok, reason)``, the reason a whole message naming the query's dtype. The
    kernels take 16-bit queries (fp32: the reference only); FlashInfer and vLLM's kernel pair a 16-bit
    query with a cache of the same type or FP8 (vLLM casts the pages to the query's type); fp8kv's
    kernel refuses an fp16 query over bf16 pages, whose fp16 dots would turn values beyond 65504 into inf.

    A ``backend`` or ``kv_dtype`` that is not a name is a ValueError naming it."""
    checks.one_of(backend, "backend", BACKEND_NAMES)
    checks.one_of(kv_dtype, "kv_dtype", KV_DTYPE_NAMES)
    q = next((n for n, dt in UNQUANTIZED_DTYPES.items() if dt == q_dtype), q_dtype)
    if not isinstance(q, str) or q not in UNQUANTIZED_DTYPES:  # a list is no dtype (and is unhashable)
        return False, f"q is {q_dtype!r}; expected one of {tuple(UNQUANTIZED_DTYPES)}"
    if q == "fp32" and backend != "reference":
        return False, f"q is fp32: {backend} takes bf16/fp16 queries; fp32 queries run on the reference only"
    if backend == "flashinfer" and not is_fp8(kv_dtype) and kv_dtype != q:
        return False, f"q is {q}: FlashInfer pairs a {q} query with a {q} or FP8 cache, not {kv_dtype}"
    if backend == "vllm" and not is_fp8(kv_dtype) and kv_dtype != q:
        return False, (f"q is {q}: vLLM's kernel casts the pages to the query's type, so it pairs a {q} query "
                       f"with a {q} or FP8 cache, not {kv_dtype}")
    if backend == "triton" and q == "fp16" and kv_dtype == "bf16":
        return False, ("q is float16 but the cache is bf16: pass a bfloat16 query (as FlashInfer also "
                       "requires)")
    return True, ""


def arch_number(arch: str) -> int:
    """The compute capability of ``arch``, "sm" and two or three ASCII digits ("sm90": 90); ValueError naming it
    otherwise ("sm9", a typo of sm90, is no arch: it would read as one that predates sm80)."""
    if not (isinstance(arch, str) and re.fullmatch(r"sm[1-9][0-9]{1,2}", arch, flags=re.ASCII)):
        raise ValueError(f"arch={arch!r}; expected 'sm' and a compute capability of two or three digits, such as "
                         f"{ARCHS}")
    return int(arch[2:])


def _arch_facts(backend, kv_dtype, mode, arch, granularity, head_dim, layout="NHD") -> tuple[bool, str]:
    """Support on ``arch`` by hardware and library facts alone (ignores what is installed here)."""
    n = arch_number(arch)
    fp8_kv = is_fp8(kv_dtype)
    if mode == "fp8" and not fp8_kv:
        return False, FP8_MODE_NEEDS_FP8
    if backend == "reference":
        if mode == "fp8":
            return False, "the reference is the fp32 oracle: it has no FP8-arithmetic mode"
        return True, "fp32 torch oracle: dequantizes the cache and computes in fp32"
    if n < 80:
        return False, f"{arch} predates sm80; fp8kv targets sm80 and newer"
    if backend == "vllm":
        return _vllm_facts(kv_dtype, mode, arch, granularity, head_dim, layout)
    if backend == "triton":
        if head_dim is not None and head_dim > TRITON_MAX_HEAD_DIM:
            return False, f"head_dim {head_dim} > {TRITON_MAX_HEAD_DIM} is not built"
        if mode == "fp8":
            if n < 89:
                return False, f"FP8 tensor-core arithmetic needs sm89+; {arch} has none (use dequant mode)"
            return True, "FP8 query and probabilities, FP8 x FP8 tl.dot (fp32 accumulate)"
        if not fp8_kv:
            return True, "16-bit KV, 16-bit tl.dot (the BF16 baseline through the same kernel)"
        if n < 89:
            return True, (f"FP8 KV loaded as uint8 and decoded in software ({arch} has no FP8 conversion "
                          "instructions; Triton has no e4m3 there), 16-bit tl.dot")
        return True, "FP8 KV converted in hardware to the query's 16-bit type, 16-bit tl.dot"
    # flashinfer
    if head_dim is not None and head_dim not in FLASHINFER_HEAD_DIMS:
        return False, f"FlashInfer decode builds head_dim {FLASHINFER_HEAD_DIMS}, not {head_dim}"
    if fp8_kv and granularity == "token_head":
        return False, ("FlashInfer takes scalar k_scale/v_scale only; per-token-head scales cannot be "
                       "folded into the query or output")
    if mode == "fp8":
        if n != 100:
            return False, (f"FlashInfer takes an FP8 query only in its TRT-LLM kernels (sm100); {arch} "
                           "runs FP8 KV with a 16-bit query (dequant mode)")
        return True, "TRT-LLM-generated decode with FP8 query (sm100)"
    if not fp8_kv:
        return True, "FA2 paged decode, 16-bit KV"
    return True, "FA2 paged decode reads FP8 KV, scalar scales (per-head/channel folded into q and out)"


def _vllm_facts(kv_dtype, mode, arch, granularity, head_dim, layout) -> tuple[bool, str]:
    """vLLM's Triton unified-attention kernel on ``arch`` (sm80 or newer), by its source."""
    if layout != "NHD":
        return False, (f"vLLM's kernel reads pages laid out [num_blocks, block_size, Hkv, D] (NHD); this cache "
                       f"is {layout}")
    if head_dim is not None and head_dim not in VLLM_HEAD_DIMS:
        return False, (f"fp8kv runs vLLM's kernel at the head dims checked against the oracle on a GPU, "
                       f"{VLLM_HEAD_DIMS}, not {head_dim}")
    if mode == "fp8":
        return False, ("vLLM's unified_attention takes no query scale (q_descale must be None): it has no "
                       "FP8-query mode; its FP8 KV runs in dequant mode")
    if not is_fp8(kv_dtype):
        return True, "vLLM's Triton unified-attention kernel, 16-bit KV, 16-bit tl.dot; returns no LSE"
    if granularity != "tensor":
        why = ("its KVQuantMode.FP8_PER_TOKEN_HEAD reads token_head scales too, but fp8kv passes it per-tensor "
               "scales only" if granularity == "token_head" else "fp8kv passes it per-tensor scales only")
        return False, (f"vLLM's kernel takes one k and one v scale (KVQuantMode.FP8_PER_TENSOR) or one per token and "
                       f"head; {why}: {granularity} scales are refused")
    if kv_dtype == "fp8_e4m3" and arch_number(arch) < 89:
        return False, (f"vLLM's kernel loads the float8_e4m3fn pages as they are, and Triton has e4m3 "
                       f"(fp8e4nv) only on sm89+; {arch} runs fp8_e5m2 through it")
    return True, ("vLLM's Triton unified-attention kernel: FP8 pages x per-tensor scale rounded to the query's "
                  "type, 16-bit tl.dot; returns no LSE")


def check(backend: str, kv_dtype: str, mode: str = "dequant", arch: str | None = None,
          granularity: str = "tensor", head_dim: int | None = None, layout: str = "NHD", *,
          op: str = "decode") -> tuple[bool, str]:
    """Whether ``backend`` runs ``kv_dtype`` in ``mode``, and why (not), for ``op`` (one of :data:`OPS`: the
    decode, or the attend of several new tokens per sequence, which runs where the decode does but as
    :func:`fp8kv.capability_attend.attend_facts` says).

    With ``arch=None`` the question is about *this* machine: the current GPU, what is installed,
    and (on CPU) whether the Triton interpreter is on. With an explicit arch it is about that arch.
    ``layout`` is the cache's page layout ("NHD" or "HND"; vLLM's kernel reads NHD only).

    Arguments outside their sets (``granularity`` of :data:`fp8kv.quant.GRANULARITIES`, ``layout``
    of :data:`fp8kv.cache.LAYOUTS`, ``head_dim`` None or an int >= 1) are a ValueError/TypeError
    naming them; ``(False, reason)`` is for valid arguments that do not run.
    """
    checks.one_of(backend, "backend", BACKEND_NAMES)
    checks.one_of(mode, "mode", MODES)
    checks.one_of(kv_dtype, "kv_dtype", KV_DTYPE_NAMES)
    checks.one_of(granularity, "granularity", GRANULARITIES)
    checks.one_of(layout, "layout", LAYOUTS)
    checks.one_of(op, "op", OPS)
    if head_dim is not None:
        head_dim = checks.positive_int(head_dim, "head_dim")
    ok, why = _support(backend, kv_dtype, mode, arch, granularity, head_dim, layout)
    refusal = scales_refusal(backend, mode, granularity) if ok else None
    if refusal:
        return False, refusal
    return attend_facts(backend, mode, why) if ok and op == "attend" else (ok, why)


def _support(backend, kv_dtype, mode, arch, granularity, head_dim, layout) -> tuple[bool, str]:
    """:func:`check` of valid arguments, but the refusal of :func:`scales_refusal`."""
    if arch is not None:
        return _arch_facts(backend, kv_dtype, mode, arch, granularity, head_dim, layout)
    here = current_arch()
    if here is None:  # CPU machine
        if backend == "reference":
            return _arch_facts(backend, kv_dtype, mode, "sm90", granularity, head_dim)
        if backend == "flashinfer":
            return False, ("no GPU: FlashInfer runs only on CUDA GPUs"
                           + ("" if flashinfer_installed() else " (and it is not installed)"))
        if backend == "vllm":
            return _vllm_on_cpu(kv_dtype, mode, granularity, head_dim, layout)
        if not interpreter_on():
            return False, "no GPU: Triton kernels run on CPU only under TRITON_INTERPRET=1"
        if mode == "fp8" and not is_fp8(kv_dtype):
            return False, FP8_MODE_NEEDS_FP8
        return True, "CPU: Triton interpreter (TRITON_INTERPRET=1), for correctness only"
    ok, why = _arch_facts(backend, kv_dtype, mode, here, granularity, head_dim, layout)
    if ok and backend == "flashinfer" and not flashinfer_installed():
        return False, "FlashInfer is not installed (pip install 'fp8kv[gpu]')"
    if ok and backend == "vllm" and not vllm_installed():
        return False, VLLM_NOT_INSTALLED
    return ok, why


def scales_refusal(backend: str, mode: str, granularity: str) -> str | None:
    """Why ``backend`` cannot run ``mode`` with ``granularity`` scales on any arch, or None: fp8kv's Triton
    kernel has no fp8 mode over per-token-head scales (they would scale the FP8 probabilities per token).
    The one home of that refusal: :func:`check` asks it of every combination its other facts let run, and
    :func:`fp8kv.ops.paged_decode` of its own input."""
    if backend == "triton" and mode == "fp8" and granularity == "token_head":
        return "fp8 mode takes tensor, head and channel scales; token_head needs dequant mode"
    return None


def check_query_strides(backend: str, q) -> None:
    """ValueError naming ``q``'s strides where ``backend``'s kernels cannot address it: the GPU kernels
    (fp8kv's, FlashInfer's, vLLM's) read head_dim with stride 1; the reference takes any layout. The one
    home of that check: :func:`fp8kv.decode` asks it once per call, as do the backends' own entry points."""
    if backend != "reference" and q.stride(-1) != 1:
        checks.fail(f"q has strides {tuple(q.stride())}: the {backend} backend needs it contiguous in its last "
                    "(head_dim) dimension; call .contiguous()")


def _vllm_on_cpu(kv_dtype, mode, granularity, head_dim, layout) -> tuple[bool, str]:
    """vLLM's kernel on a machine without a GPU: its own limits, then the interpreter and the install."""
    if mode == "fp8" and not is_fp8(kv_dtype):
        return False, FP8_MODE_NEEDS_FP8
    ok, why = _vllm_facts(kv_dtype, mode, "sm90", granularity, head_dim, layout)  # the interpreter has e4m3
    if not ok:
        return ok, why
    if not interpreter_on():
        return False, ("no GPU: vLLM's Triton kernel runs on CUDA GPUs, and on CPU only under TRITON_INTERPRET=1"
                       + ("" if vllm_installed() else " (and it is not installed)"))
    if not vllm_installed():
        return False, VLLM_NOT_INSTALLED
    return True, ("CPU: vLLM's kernel under the Triton interpreter (TRITON_INTERPRET=1), for correctness only; "
                  "returns no LSE")


def capability(arch: str | Sequence[str] | None = None):
    """Table of backend × kv_dtype × mode for ``arch`` (current device when None; a list or tuple
    of archs: their tables one after another).

    Returns a pandas DataFrame with columns arch, backend, kv_dtype, mode, supported,
    granularities (those supported, comma-separated) and reason.
    """
    import pandas as pd

    if isinstance(arch, (list, tuple)):
        if not arch:
            checks.fail("arch=[]: give one arch such as 'sm90', a list of them, or None for this machine")
        return pd.concat([capability(a) for a in arch], ignore_index=True)

    label = arch or current_arch() or "cpu"
    rows = []
    for backend in BACKEND_NAMES:
        for kv in KV_DTYPE_NAMES:
            for mode in MODES:
                ok, why = check(backend, kv, mode, arch)
                grans = [g for g in GRANULARITIES
                         if check(backend, kv, mode, arch, granularity=g)[0]] if is_fp8(kv) else []
                rows.append(dict(arch=label, backend=backend, kv_dtype=kv, mode=mode, supported=ok,
                                 granularities=",".join(grans) if ok else "", reason=why))
    return pd.DataFrame(rows)


# ``auto`` mode: dequant. It is the accurate mode and, for decode (memory-bound), as fast; fp8 mode
# is asked for explicitly when its tensor-core arithmetic is the subject.
AUTO_MODE = "dequant"


def choose_mode(backend: str, kv_dtype: str, arch: str | None = None, granularity: str = "tensor") -> str:
    """``auto`` mode (:data:`AUTO_MODE`) for ``backend``, or UnsupportedError with the reason when
    that backend cannot run ``kv_dtype`` in it here."""
    ok, why = check(backend, kv_dtype, AUTO_MODE, arch, granularity)
    if not ok:
        raise UnsupportedError(f"{backend} cannot run kv_dtype={kv_dtype} here: {why}")
    return AUTO_MODE


def choose_backend(kv_dtype: str, mode: str = "dequant", arch: str | None = None,
                   granularity: str = "tensor", head_dim: int | None = None, *, op: str = "decode") -> str:
    """``auto`` backend of ``op`` (:data:`OPS`): Triton where it runs compiled (a GPU), else FlashInfer, else
    the reference; never vLLM's kernel (a peer to measure against, asked for by name)."""
    on_gpu = current_arch() is not None or arch is not None
    order = ("triton", "flashinfer", "reference") if on_gpu else ("reference",)
    reasons = []
    for b in order:
        ok, why = check(b, kv_dtype, mode, arch, granularity, head_dim, op=op)
        if ok:
            return b
        reasons.append(f"{b}: {why}")
    raise UnsupportedError(f"no backend runs the {op} of kv_dtype={kv_dtype} mode={mode} here: " + "; ".join(reasons))


_VARIANT_FACTS = {
    ("reference", "window"): (True, "the fp32 oracle masks the scores before the window"),
    ("reference", "soft_cap"): (True, "the fp32 oracle applies cap * tanh(s / cap) to the scaled scores"),
    ("reference", "sinks"): (True, "the fp32 oracle adds exp(sink) to each head's softmax denominator"),
    ("triton", "window"): (True, "the splits tile the window only: pages before it are never read"),
    ("triton", "soft_cap"): (True, "tanh from one exp2 per score, in the exp2 domain"),
    ("triton", "sinks"): (True, "folded once into the final normalisation (epilogue or split combine)"),
    ("flashinfer", "window"): (True, "plan(window_left=window - 1): FlashInfer counts the keys left of the query"),
    ("flashinfer", "soft_cap"): (True, "plan(logits_soft_cap=cap) in the FA2 kernels"),
    ("flashinfer", "sinks"): (False, "FlashInfer 0.6.13's decode wrapper passes sinks only to its TRT-LLM "
                                     "kernels (sm100); the FA2 decode kernels have no sink term"),
    ("vllm", "window"): (True, "window_size=(window - 1, 0): vLLM's SLIDING_WINDOW keeps the window keys, the "
                               "query's own included, and skips the tiles before them"),
    ("vllm", "soft_cap"): (True, "softcap=cap: cap * tanh(s / cap) on the scaled scores, from exp(±s / cap) "
                                 "(which overflows to NaN once |s / cap| passes ~88)"),
    ("vllm", "sinks"): (True, "sinks=[Hq]: the running max starts at the sink logit with a sum of 1, so exp(sink) "
                              "joins each head's denominator once"),
}
_NO_FP8_MODE = ("reference", "vllm")  # backends whose variants table lists dequant mode only
_FLASHINFER_FP8_VARIANTS = {
    "window": (True, "trtllm_batch_decode_with_kv_cache(window_left=window - 1)"),
    "soft_cap": (False, "trtllm_batch_decode_with_kv_cache has no logit soft-cap argument in FlashInfer 0.6.13"),
    "sinks": (False, "fp8kv does not pass sinks to the TRT-LLM kernels (their sink layout is untested here)"),
}

# FlashInfer's prefill wrapper (the attend) plans the same variant arguments as its decode wrapper.
_FLASHINFER_ATTEND_VARIANTS = {
    "window": (True, "BatchPrefillWithPagedKVCacheWrapper.plan(window_left=window - 1): the keys left of each query"),
    "soft_cap": (True, "BatchPrefillWithPagedKVCacheWrapper.plan(logits_soft_cap=cap) in the FA2 kernels"),
    "sinks": (False, "fp8kv passes no sinks to FlashInfer's prefill: its FA2 kernels, like its FA2 decode, have no "
                     "sink term"),
}


def check_variant(backend: str, variant: str, mode: str = "dequant", *, op: str = "decode") -> tuple[bool, str]:
    """Whether ``backend`` in ``mode`` computes attention variant ``variant`` (one of :data:`VARIANTS`) in ``op``
    (:data:`OPS`), and how/why not.

    Library facts, the same on every arch the backend runs on (:func:`check` says where that is).
    """
    checks.one_of(backend, "backend", BACKEND_NAMES)
    checks.one_of(variant, "variant", VARIANTS)
    checks.one_of(mode, "mode", MODES)
    checks.one_of(op, "op", OPS)
    if backend == "flashinfer" and op == "attend":
        return _FLASHINFER_ATTEND_VARIANTS[variant]
    if backend == "flashinfer" and mode == "fp8":
        return _FLASHINFER_FP8_VARIANTS[variant]
    return _VARIANT_FACTS[(backend, variant)]


def check_variants(backend: str, mode: str, used, *, op: str = "decode") -> None:
    """Raise UnsupportedError naming the first variant in ``used`` (names) that ``backend`` cannot run in ``op``."""
    if isinstance(used, str):  # one name: not its letters
        used = (used,)
    for name in used:
        ok, why = check_variant(backend, name, mode, op=op)
        if not ok:
            raise UnsupportedError(f"backend={backend}, mode={mode} cannot apply {name}: {why}")


def variants():
    """Table of backend x mode x attention variant: supported and how (or why not).

    Returns a pandas DataFrame with columns backend, mode, variant, supported, reason. The
    reference and vLLM's kernel have no fp8 mode (see :func:`capability`), so they are listed in
    dequant mode only.
    """
    import pandas as pd

    rows = [dict(backend=b, mode=m, variant=v, supported=ok, reason=why)
            for b in BACKEND_NAMES for m in MODES if not (b in _NO_FP8_MODE and m == "fp8")
            for v in VARIANTS for ok, why in [check_variant(b, v, m)]]
    return pd.DataFrame(rows)


def attend_capability(arch: str | Sequence[str] | None = None, *, by_queries: bool = False):
    """Table of the attend (several new tokens per sequence, :data:`OPS`): backend x kv_dtype x mode for ``arch``
    (as :func:`capability` takes it), with the scale granularities and the attention variants each runs.

    Returns a pandas DataFrame with columns arch, op (``"attend"``), backend, kv_dtype, mode, supported,
    granularities and variants (those supported, comma-separated) and reason. With ``by_queries=True`` each row is
    repeated per class of new-token counts (:data:`fp8kv.capability_attend.QUERY_CLASSES`: "1", "2+ equal",
    "ragged or long"), with columns ``queries``, ``kernel`` (what runs that class: for fp8kv's Triton backend the
    decode's plan, the Gluon kernel's rows or the Triton attend kernel; "" where the combination does not run) and
    ``kernel_reason`` (:func:`fp8kv.capability_attend.query_kernel`) after mode. The Gluon kernel is counted in only
    where it is compiled: on a GPU of ``arch``, or of this machine with ``arch=None`` and the interpreter off.
    """
    import pandas as pd

    by_queries = checks.flag(by_queries, "by_queries")
    if isinstance(arch, (list, tuple)):
        if not arch:
            checks.fail("arch=[]: give one arch such as 'sm90', a list of them, or None for this machine")
        return pd.concat([attend_capability(a, by_queries=by_queries) for a in arch], ignore_index=True)
    label = arch or current_arch() or "cpu"
    compiled = None if label == "cpu" or (arch is None and interpreter_on()) else arch_number(label)
    rows = []
    for backend in BACKEND_NAMES:
        for kv in KV_DTYPE_NAMES:
            for mode in MODES:
                ok, why = check(backend, kv, mode, arch, op="attend")
                grans = [g for g in GRANULARITIES
                         if check(backend, kv, mode, arch, granularity=g, op="attend")[0]] if is_fp8(kv) else []
                used = [v for v in VARIANTS if check_variant(backend, v, mode, op="attend")[0]]
                head = dict(arch=label, op="attend", backend=backend, kv_dtype=kv, mode=mode)
                tail = dict(supported=ok, granularities=",".join(grans) if ok else "",
                            variants=",".join(used) if ok else "", reason=why)
                for queries in QUERY_CLASSES if by_queries else ():
                    kernel, how = query_kernel(backend, kv, mode, queries, compiled) if ok else ("", "")
                    rows.append({**head, "queries": queries, "kernel": kernel, "kernel_reason": how, **tail})
                if not by_queries:
                    rows.append({**head, **tail})
    return pd.DataFrame(rows)
