"""FlashInfer's import, its shared workspaces and the translation of fp8kv's arguments into FlashInfer's
(the page tables, the query counts, the window), for the decode (:mod:`fp8kv.backends.flashinfer_decode`) and
the multi-token attend (:mod:`fp8kv.backends.flashinfer_attend`). Pure torch: it runs anywhere, and imports
``flashinfer`` only when :func:`import_flashinfer` is called. What FlashInfer's wheel shows that this relies on
is written in :mod:`fp8kv.backends.flashinfer`.

Workspaces: one zeroed 128 MiB buffer per (device, kernel family), shared by every wrapper fp8kv
creates there, as FlashInfer's examples share one across layers. Run the wrappers on one stream.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Iterable

import torch

from .. import checks
from ..cache import PagedKVCache
from ..capability import UnsupportedError, flashinfer_installed

__all__ = ["paged_kv_args", "qo_indptr", "query_counts", "workspace", "import_flashinfer", "plan_growing",
           "window_left", "NOT_INSTALLED", "LN2", "DEFAULT_WORKSPACE_BYTES", "MAX_WORKSPACE_BYTES"]

NOT_INSTALLED = "FlashInfer is not installed (pip install 'fp8kv[gpu]')"
LN2 = math.log(2.0)  # FlashInfer's LSE is log2; natural log = log2 * ln 2
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024
MAX_WORKSPACE_BYTES = 4 * 1024**3  # the float workspace grows by doubling up to this (plan retries)
# FlashInfer's allocator error names the bytes it had: the float workspace's size when that one is short.
_FLOAT_WORKSPACE_SHORT = re.compile(r"but only (\d+) bytes available.*Increase the workspace buffer size", re.S)

_MODULE = "flashinfer"  # the import name (a constant so tests can point it elsewhere)
_WORKSPACES: dict[tuple[str, torch.device], torch.Tensor] = {}


def window_left(window: int | None) -> int:
    """FlashInfer's ``window_left`` for fp8kv's sliding ``window`` (keys seen, the query's own
    included): the keys strictly left of the query, ``window - 1``; ``-1`` (no window) for None."""
    return -1 if window is None else window - 1


# ----------------------------------------------------------------------------------------- imports
def import_flashinfer():
    """The ``flashinfer`` module, or UnsupportedError saying why it cannot be had."""
    if not flashinfer_installed():
        raise UnsupportedError(NOT_INSTALLED)
    try:
        return importlib.import_module(_MODULE)
    except Exception as e:  # a broken install: say what is missing rather than a bare traceback
        raise UnsupportedError(
            f"FlashInfer is installed but failed to import ({type(e).__name__}: {e}); it needs "
            "apache-tvm-ffi, einops, ninja, tabulate and nvidia-ml-py") from e


def workspace(device, nbytes: int = DEFAULT_WORKSPACE_BYTES, family: str = "fa2") -> torch.Tensor:
    """The shared zero-initialised uint8 workspace of ``nbytes`` for ``family`` on ``device``.

    ``family`` separates kernel families that keep state in the buffer (the TRT-LLM kernels keep
    counters there), so they never see each other's scratch data.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (family, dev)
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        _WORKSPACES[key] = buf
    return buf


def plan_growing(workspace_buf: torch.Tensor, wrapper, new_wrapper, fixed: bool, *args, **kwargs):
    """``wrapper.plan(*args, **kwargs)``, retried over a float workspace twice as large (``new_wrapper(nbytes)``:
    a workspace of at least ``nbytes`` and a wrapper over it) while FlashInfer says that workspace is short, up to
    :data:`MAX_WORKSPACE_BYTES`. Returns the (workspace, wrapper) that planned; on failure the caller's pair is
    untouched. ``fixed``: the wrapper's buffers may not change (a CUDA-graph wrapper): say which size to build."""
    while True:
        try:
            wrapper.plan(*args, **kwargs)
            return workspace_buf, wrapper
        except RuntimeError as e:
            size = workspace_buf.numel()
            short = _FLOAT_WORKSPACE_SHORT.search(str(e))
            if short is None or int(short.group(1)) != size or size >= MAX_WORKSPACE_BYTES:
                raise  # not the float workspace (FlashInfer's fixed int workspace), or at the cap
            if fixed:
                raise ValueError(f"FlashInfer's plan needs more than the {size} bytes of workspace this "
                                 f"CUDA-graph decoder was built with; build it with workspace_bytes="
                                 f"{min(2 * size, MAX_WORKSPACE_BYTES)} or more") from e
        workspace_buf, wrapper = new_wrapper(min(2 * workspace_buf.numel(), MAX_WORKSPACE_BYTES))


# ---------------------------------------------------------------------------- argument translation
def paged_kv_args(cache: PagedKVCache, device=None):
    """FlashInfer's CSR page description of ``cache``: ``(indptr, indices, last_page_len)``.

    Parameters
    ----------
    cache : the cache; its ``block_table`` ``[B, max_blocks]`` and ``seq_lens`` ``[B]`` are read
        (one device-to-host copy: call this at plan time, not in a timed loop).
    device : where the results go (default: the cache's device).

    Returns
    -------
    indptr : int32 ``[B + 1]``, ``indptr[i+1] - indptr[i]`` = pages of sequence i = ceil(len / bs).
    indices : int32 ``[indptr[-1]]``, the used block-table entries, sequence by sequence in order.
    last_page_len : int32 ``[B]``, tokens in each sequence's last page: ``(len - 1) % bs + 1``
        (in ``[1, bs]``) for ``len >= 1``; ``0`` for an empty sequence (zero pages), the form
        ``flashinfer.get_seq_lens`` maps back to length 0. Decode needs every length >= 1.
    """
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a fp8kv.PagedKVCache, got {type(cache).__name__}")
    device = cache.device if device is None else torch.device(device)
    lens = cache.seq_lens.detach().to("cpu", torch.int64)
    bs = cache.block_size
    pages = (lens + bs - 1) // bs
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(cache.max_blocks_per_seq)[None, :] < pages[:, None]
    indices = cache.block_table.detach().to("cpu")[used]  # row-major: sequence by sequence, in order
    last = torch.where(lens > 0, (lens - 1) % bs + 1, torch.zeros_like(lens))
    return (indptr.to(torch.int32).to(device), indices.to(torch.int32).contiguous().to(device),
            last.to(torch.int32).to(device))


def query_counts(qo_lens) -> torch.Tensor:
    """Query tokens per sequence, checked, as host int64 ``[B]``: a list/tuple of ints or a 1-D
    int32/int64 tensor. Floats (even integral ones: 1.5 would become a pointer step, 2.0 hides a
    bug), float or bool tensors, bools and negative counts are refused by name (``qo_lens[i]``)."""
    if isinstance(qo_lens, torch.Tensor):
        lens = checks.int_tensor(qo_lens, "qo_lens", ndim=1, shape_hint="[B] (query tokens per sequence)")
        lens = lens.detach().to("cpu", torch.int64)
    elif isinstance(qo_lens, (str, bytes)) or not isinstance(qo_lens, Iterable):
        checks.fail(f"qo_lens={qo_lens!r} ({type(qo_lens).__name__}); expected a list of ints or a 1-D int tensor "
                    "(query tokens per sequence)", TypeError)
    else:
        lens = torch.tensor([checks.integer(n, f"qo_lens[{i}]") for i, n in enumerate(qo_lens)], dtype=torch.int64)
    if (lens < 0).any():
        i = int((lens < 0).nonzero()[0])
        checks.fail(f"qo_lens[{i}]={int(lens[i])} is negative; expected query counts >= 0")
    return lens


def qo_indptr(qo_lens, device=None) -> torch.Tensor:
    """int32 ``[B + 1]`` prefix sums of the query lengths (FlashInfer's ``qo_indptr``); ``qo_lens`` as
    :func:`query_counts` takes them."""
    lens = query_counts(qo_lens)
    out = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lens, 0)
    return out.to(torch.int32).to(device or "cpu")
