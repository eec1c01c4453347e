"""Argument checks shared by every entry point.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value)
with a message that names the argument, the value seen and what is accepted, and returns the
value normalised (``int``/``float``/``str``). Entry points call them once, where input enters
(``fp8kv.decode``, ``PagedKVCache``, ``write_cache``, the planner, the CLIs); the layers below
trust what they are given.
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
from collections.abc import Iterable, Sequence

import torch

__all__ = ["flag", "integer", "generator_seed", "GENERATOR_SEEDS", "run_seed", "RUN_SEEDS", "rep_ms", "MAX_REP_MS", "positive_int", "nonnegative_int", "real", "positive_float", "one_of", "many_of", "listed", "dataframe",
           "tensor", "float_dtype", "readable_tensor", "version_counter", "finite_tensor", "fp32_range_tensor", "positive_fp32", "int_tensor", "device", "fail",
           "ArgumentParser", "output_folder", "attention_variant", "softmax_scale", "softmax_scale_or_default", "resolved_softmax_scale",
           "show_value", "MIN_SOFT_CAP", "MAX_SOFT_CAP",
           "MAX_SINK", "MAX_WINDOW", "MIN_SCORE_FACTOR", "MAX_SCORE_FACTOR", "FLOAT_DTYPES"]

FP32_MAX = torch.finfo(torch.float32).max
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # the float inputs numbers are read from
# The kernels fold sm_scale x log2(e), and with a soft cap x 2 / cap, into one fp32 factor that
# multiplies q·k (the CUDA-core kernel multiplies q's elements by it first). It must be a normal fp32
# number (below 2^-126 it loses bits, then flushes to 0: every score 0) and leave room above it for
# a 16-bit query (<= 2^16) times key scales up to 2^48 (above 2^64 a finite factor times a zero dot
# could meet an inf: NaN). softmax_scale() refuses (sm_scale, soft_cap) pairs outside this range.
MIN_SCORE_FACTOR = 2.0**-126
MAX_SCORE_FACTOR = 2.0**64
# Soft caps in [1e-6, 1e30] (models use 30-50). Below 1e-6 every capped score lies within 1e-6 of 0
# (attention is uniform to that), and the cap's own factor 2 / cap (<= 2e6, 21 binary orders) is
# what pushed the folded factor to inf for tiny caps: NaN on whole heads (a zero dot times inf).
# Above 1e30 the cap changes no fp32 score short of 1e26, and 2 / cap takes the factor below fp32's
# normal range for sm_scale < 4e-9.
MIN_SOFT_CAP = 1e-6
MAX_SOFT_CAP = 1e30
# Sink logits in [-1e38, 1e38]: the kernels take them to log2 units (x 1/ln 2 = 1.44), which is inf
# in fp32 past 2.36e38 (lse = -inf and NaN outputs). Learned sinks are O(1-10).
MAX_SINK = 1e38
# Windows of 2^31 - 1 tokens or more are the whole sequence (seq_lens are int32) and are passed on as
# 2^31 - 1, which the backends' int32 window arguments hold (FlashInfer's window_left = W - 1).
MAX_WINDOW = 2**31 - 1
_LOG2E = math.log2(math.e)
FP32_TINY = 2.0**-149  # smallest positive float32 (a subnormal)


def fail(msg: str, exc: type[Exception] = ValueError):
    """Raise ``exc(msg)``: for checks that need their own wording."""
    raise exc(msg)


def show_value(value) -> str:
    """``repr(value)`` cut to 80 characters: a value as an error message shows it."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python converts to text (sys.get_int_max_str_digits)
        text = f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else f"<a {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def integer(value, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int (not a bool, not a float, even an integral one) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
                and value.dtype != torch.bool:
            value = int(value)
        else:
            fail(f"{name}={show_value(value)} ({type(value).__name__}); expected an int", TypeError)
    value = int(value)
    if minimum is not None and value < minimum:
        fail(f"{name}={show_value(value)}; expected an int >= {minimum}")
    if maximum is not None and value > maximum:
        fail(f"{name}={show_value(value)}; expected an int <= {maximum}")
    return value


# torch.Generator.manual_seed's seeds (a negative one taken modulo 2**64)
GENERATOR_SEEDS = (-2**63, 2**64 - 1)


def generator_seed(value, name: str = "seed") -> int:
    """A seed for ``torch.Generator.manual_seed``: an int in :data:`GENERATOR_SEEDS`."""
    return integer(value, name, minimum=GENERATOR_SEEDS[0], maximum=GENERATOR_SEEDS[1])


# A run's seed (bench cases, notebooks, step sweeps): a non-negative int64, as its results record it
RUN_SEEDS = (0, 2**63 - 1)


def run_seed(value, name: str = "seed") -> int:
    """A run's seed: an int in :data:`RUN_SEEDS`."""
    return integer(value, name, minimum=RUN_SEEDS[0], maximum=RUN_SEEDS[1])


# The most milliseconds of CUDA-graph replays one timing takes (``rep``: a bench case, a step point): 10 s, 100 times
# the bench's default. do_bench_cudagraph captures rep / (one call's ms) calls in one graph, which no larger rep makes
# more precise, and a sweep of 100 points at the bound already runs for over a quarter of an hour.
MAX_REP_MS = 10_000


def rep_ms(value, name: str = "rep") -> int:
    """Milliseconds of repetitions per timing: an int in [1, :data:`MAX_REP_MS`]."""
    return integer(value, name, minimum=1, maximum=MAX_REP_MS)


def positive_int(value, name: str) -> int:
    return integer(value, name, minimum=1)


def nonnegative_int(value, name: str) -> int:
    return integer(value, name, minimum=0)


def real(value, name: str, *, minimum: float | None = None, maximum: float | None = None,
         inclusive: bool = True) -> float:
    """A finite real number (int or float, not a bool or a string) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(f"{name}={show_value(value)} ({type(value).__name__}); expected a finite number", TypeError)
    try:
        value = float(value)
    except OverflowError:  # an int past float's range (10**400)
        fail(f"{name}={show_value(value)}; expected a finite number (this int is past float64's range)")
    if not math.isfinite(value):
        fail(f"{name}={value}; expected a finite number")
    lo_ok = minimum is None or (value >= minimum if inclusive else value > minimum)
    hi_ok = maximum is None or (value <= maximum if inclusive else value < maximum)
    if not (lo_ok and hi_ok):
        lo = "" if minimum is None else f"{'>=' if inclusive else '>'} {minimum}"
        hi = "" if maximum is None else f"{'<=' if inclusive else '<'} {maximum}"
        fail(f"{name}={value}; expected a finite number {' and '.join(x for x in (lo, hi) if x)}")
    return value


def flag(value, name: str) -> bool:
    """``value`` if it is True or False; not a truthy stand-in such as 1 or "no"."""
    if not isinstance(value, bool):
        fail(f"{name}={show_value(value)} ({type(value).__name__}); expected True or False", TypeError)
    return bool(value)


def positive_float(value, name: str) -> float:
    return real(value, name, minimum=0.0, inclusive=False)


def one_of(value, name: str, choices: Iterable) -> object:
    """``value`` if it is among ``choices``."""
    choices = tuple(choices)
    try:
        ok = value in choices
    except TypeError:  # unhashable or incomparable
        ok = False
    if not ok:
        fail(f"{name}={show_value(value)}; expected one of {choices}")
    return value


def listed(values, name: str, what: str) -> list:
    """``values`` as a non-empty list (a single string counts as a list of one); ``what`` names its items in
    the messages ("values among (...)", "KV dtype or format names")."""
    if isinstance(values, str):
        values = [values]
    try:
        values = list(values)
    except TypeError:
        fail(f"{name}={show_value(values)}; expected a list of {what}", TypeError)
    if not values:
        fail(f"{name} is empty; expected a list of {what} with at least one")
    return values


def dataframe(value, name: str, columns: Iterable = (), *, expected: str):
    """``value`` if it is a pandas DataFrame holding ``columns``: else a TypeError (another kind of thing) or a
    ValueError naming the columns it lacks (in the order given), each ending "expected ``expected``"."""
    import pandas as pd

    if not isinstance(value, pd.DataFrame):
        fail(f"{name} is a {type(value).__name__}; expected {expected}", TypeError)
    missing = [c for c in columns if c not in value.columns]
    if missing:
        fail(f"{name} lacks columns {missing}; expected {expected}")
    return value


def many_of(values, name: str, choices: Sequence) -> list:
    """A non-empty list of ``choices`` (a single string counts as a list of one)."""
    values = listed(values, name, f"values among {tuple(choices)}")
    bad = [v for v in values if v not in tuple(choices)]
    if bad:
        fail(f"{name} has {bad}; expected values among {tuple(choices)}")
    return values


def tensor(value, name: str, *, ndim: int | None = None, dtypes: Iterable[torch.dtype] | None = None,
           device: torch.device | None = None, shape_hint: str = "") -> torch.Tensor:
    """A ``torch.Tensor`` of the given rank, dtype family and device."""
    hint = f" {shape_hint}" if shape_hint else ""
    if not isinstance(value, torch.Tensor):
        fail(f"{name} must be a torch.Tensor{hint}, got {type(value).__name__}", TypeError)
    if ndim is not None and value.ndim != ndim:
        fail(f"{name} must be {ndim}-D{hint}; got shape {tuple(value.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            fail(f"{name} has dtype {str(value.dtype).replace('torch.', '')}; expected one of: {names}", TypeError)
    if device is not None and value.device != torch.device(device):
        fail(f"{name} is on {value.device} but must be on {device}; move it with .to()")
    return value


def readable_tensor(value: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` (a tensor) if it is on 'cpu' or a CUDA device: one with values to read ('meta' holds none)."""
    if value.device.type not in ("cpu", "cuda"):
        fail(f"{name} is on {value.device}; expected a tensor on 'cpu' or a CUDA device (one holding values)")
    return value


def float_dtype(value, name: str = "dtype", choices: Iterable[torch.dtype] = FLOAT_DTYPES) -> torch.dtype:
    """A torch dtype among ``choices`` (a bool, a string or a number is refused, not read as one)."""
    choices = tuple(choices)
    if not isinstance(value, torch.dtype) or value not in choices:
        names = ", ".join(str(d).replace("torch.", "") for d in choices)
        fail(f"{name}={show_value(value)}; expected a torch dtype among: {names}", TypeError)
    return value


def version_counter(value: torch.Tensor) -> int | None:
    """``value``'s in-place-write counter (metadata, no host sync): what a plan holding a copy compares to see
    the tensor written since; None for an inference-mode tensor, which keeps none."""
    try:
        return value._version
    except RuntimeError:
        return None


def finite_tensor(value: torch.Tensor, name: str) -> torch.Tensor:
    """Refuse NaN / Inf contents, naming the first bad index (a host sync)."""
    if value.is_floating_point() and value.numel():
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            fail(f"{name} has {int(bad.sum())} non-finite value(s) (NaN/Inf); the first is at index {idx} "
                 f"(value {float(value[idx])}); expected finite values")
    return value


def fp32_range_tensor(value: torch.Tensor, name: str) -> torch.Tensor:
    """Refuse finite values beyond float32's range (|x| > 3.4028235e38; only float64 holds them).

    fp8kv computes in fp32, where such a value becomes inf (an inf scale, NaN on the way back), so
    it is refused rather than guessed at: a KV value that large is a bug upstream. NaN/Inf are left
    to :func:`finite_tensor`. A host sync for float64 input; free for narrower dtypes.
    """
    if value.dtype == torch.float64 and value.numel():
        bad = torch.isfinite(value) & (value.abs() > FP32_MAX)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            fail(f"{name} has {int(bad.sum())} value(s) beyond float32's range; the first is at index {idx} "
                 f"(value {float(value[idx])!r}); expected |values| <= {FP32_MAX!r} (float32's largest)")
    return value


def positive_fp32(value, name: str, *, expected: str, device=None) -> torch.Tensor:
    """Positive finite number(s) that stay positive and finite in float32, as an fp32 tensor.

    ``value``: a real number (not a bool), a real tensor or a (nested) list/tuple of numbers; the
    shape is kept (callers broadcast). ``expected`` completes the TypeError for anything else. A
    zero, negative, NaN or Inf entry is a ValueError naming the first; so is one that float32
    cannot hold (1e-300 rounds to 0, 1e300 to inf), with the value as given.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor, list, tuple)):
        fail(f"{name}={show_value(value)} ({type(value).__name__}); expected {expected}", TypeError)
    try:
        # Python numbers as float64: the default dtype (fp32) would turn 1e-300 into 0 before the check
        t = torch.as_tensor(value, device=device,
                            dtype=None if isinstance(value, torch.Tensor) else torch.float64)
    except (TypeError, ValueError, RuntimeError):  # e.g. ["a"], ragged lists
        fail(f"{name}={show_value(value)} is not a list of numbers; expected {expected}", TypeError)
    if t.dtype == torch.bool or t.is_complex():
        fail(f"{name} has dtype {t.dtype}; expected a real (fp32) tensor of positive values", TypeError)
    wide = t.to(torch.float64)
    bad = ~torch.isfinite(wide) | (wide <= 0)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        at = f" at index {idx}" if idx else ""
        fail(f"{name} must be positive and finite; got {float(wide[idx])}{at}")
    s = wide.to(torch.float32)
    lost = (s == 0) | torch.isinf(s)
    if bool(lost.any()):
        idx = tuple(int(i) for i in lost.nonzero()[0])
        at = f"[{', '.join(map(str, idx))}]" if idx else ""
        fail(f"{name}{at}={float(wide[idx])!r} {'underflows' if s[idx] == 0 else 'overflows'} float32 (it becomes "
             f"{float(s[idx])} there, and scales are fp32); expected positive values in "
             f"[{FP32_TINY:.4g}, {FP32_MAX:.8g}]")
    return s


def int_tensor(value, name: str, *, ndim: int, device: torch.device | None = None,
               shape_hint: str = "") -> torch.Tensor:
    """An int32/int64 tensor (floats are refused: 3.7 is not a length or an index)."""
    return tensor(value, name, ndim=ndim, dtypes=(torch.int32, torch.int64), device=device,
                  shape_hint=shape_hint)


def device(value, name: str = "device") -> torch.device:
    """A torch device that exists on this machine (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a torch.device)."""
    if not isinstance(value, (str, torch.device)):
        fail(f"{name}={show_value(value)} ({type(value).__name__}); expected a device such as 'cpu' or 'cuda'",
             TypeError)
    try:
        dev = torch.device(value)
    except RuntimeError:
        fail(f"{name}={value!r} is not a device; expected e.g. 'cpu', 'cuda' or 'cuda:0'")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            fail(f"{name}={value!r}: this machine has no CUDA GPU; use 'cpu'")
        if dev.index is not None and dev.index >= count:
            fail(f"{name}={value!r}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
    elif dev.type not in ("cpu", "meta"):
        fail(f"{name}={value!r}: expected a 'cpu' or 'cuda' device")
    return dev


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr, ``PROG: error: MESSAGE``, with
    exit status 2 (argparse's own prints the usage first). Subparsers inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())} (see {self.prog} --help)\n")


def output_folder(path, name: str) -> str:
    """A folder that exists or can be made and written: not a file, not under a file, writable."""
    if not isinstance(path, (str, os.PathLike)):
        fail(f"{name}={show_value(path)} ({type(path).__name__}); expected a folder path", TypeError)
    path = os.fspath(path)
    if not path:  # "" would write into the working directory
        fail(f"{name}='' is no folder path; expected a folder (e.g. results)")
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{name}={path!r} is an existing file; expected a folder")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(f"{name}={path!r}: {parent!r} is a file, so no folder can be made under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{name}={path!r}: {parent!r} is not writable")
    return path


def attention_variant(window, soft_cap, sinks, *, num_q_heads: int, device, contents: bool = True) -> tuple:
    """The attention variants of a decode call, checked: ``(window, soft_cap, sinks)``.

    window : None, or an int >= 1 (tokens the query attends, itself included; not a bool or float).
        One of :data:`MAX_WINDOW` (2^31 - 1) or more is returned as :data:`MAX_WINDOW`: every
        sequence fits in it, as it fits in any window that long.
    soft_cap : None, or a number in [:data:`MIN_SOFT_CAP`, :data:`MAX_SOFT_CAP`] = [1e-6, 1e30] (a
        float is returned). With ``sm_scale`` it must also pass :func:`softmax_scale`.
    sinks : None, or a float32 tensor ``[num_q_heads]`` on ``device``, any strides (a strided or
        expanded view is returned as a contiguous copy: the kernels read ``[Hq]`` with stride 1; no
        host sync). With ``contents`` (a host sync) its values must be finite with ``|sink| <=``
        :data:`MAX_SINK` (1e38).
    """
    if window is not None:
        window = min(integer(window, "window", minimum=1), MAX_WINDOW)
    if soft_cap is not None:
        soft_cap = positive_float(soft_cap, "soft_cap")
        if not MIN_SOFT_CAP <= soft_cap <= MAX_SOFT_CAP:
            fail(f"soft_cap={soft_cap:g}; expected a number in [{MIN_SOFT_CAP:g}, {MAX_SOFT_CAP:g}] (models use "
                 "30-50; the kernels fold 2 / cap into an fp32 factor, which overflows below the range and "
                 "underflows above it): pass None for no cap")
    if sinks is not None:
        tensor(sinks, "sinks", ndim=1, dtypes=(torch.float32,), device=device, shape_hint=f"[{num_q_heads}] (one "
               "logit per query head)")
        if sinks.shape[0] != num_q_heads:
            fail(f"sinks has shape {tuple(sinks.shape)}; expected [{num_q_heads}] (one logit per query head)")
        if contents:
            finite_tensor(sinks, "sinks")
            big = sinks.abs() > MAX_SINK
            if bool(big.any()):
                i = int(big.nonzero()[0])
                fail(f"sinks[{i}]={float(sinks[i])!r}; expected sink logits in [-{MAX_SINK:g}, {MAX_SINK:g}] (the "
                     "kernels take them to log2 units in fp32, where larger ones overflow)")
        if not sinks.is_contiguous():  # a strided or expanded view: the kernels read sinks[h] at offset h
            sinks = sinks.contiguous()
    return window, soft_cap, sinks


def softmax_scale(sm_scale, soft_cap: float | None = None, name: str = "sm_scale") -> float:
    """``sm_scale``, a positive finite number, checked with the (already checked) ``soft_cap`` it is used with.

    The kernels fold ``sm_scale x log2(e)`` (``x 2 / soft_cap`` with a cap) into one fp32 factor;
    it, and without the cap's part, must lie in [:data:`MIN_SCORE_FACTOR`, :data:`MAX_SCORE_FACTOR`] = [2^-126, 2^64] (normal
    fp32, with room for a 16-bit query times the key scales). The ValueError names the range of
    ``sm_scale`` that works with this cap. Returns it as a float.
    """
    value = positive_float(sm_scale, name)
    # The plain factor sm_scale x log2(e) is also what the reference multiplies q·k by; with a cap the
    # kernels' factor is 2 / cap times it. Both must lie in the range.
    per_unit = (_LOG2E,) if soft_cap is None else (_LOG2E, _LOG2E * 2.0 / soft_cap)
    lo = max(MIN_SCORE_FACTOR / f for f in per_unit)
    hi = min(MAX_SCORE_FACTOR / f for f in per_unit)
    if not lo <= value <= hi:
        cap = "" if soft_cap is None else f" and sm_scale x log2(e) x 2 / soft_cap (soft_cap={soft_cap:g})"
        fail(f"{name}={value:g}; expected {name} in [{lo:.3g}, {hi:.3g}]: the kernels fold sm_scale x log2(e){cap} "
             "into fp32 factors, which must lie in [2^-126, 2^64] (fold a larger or smaller factor into q instead)")
    return value


def softmax_scale_or_default(sm_scale, head_dim: int, name: str = "sm_scale") -> float:
    """A positive ``sm_scale`` (checked here), or for None the default ``1 / sqrt(head_dim)``: the analyses' rule,
    which take any positive scale (the kernels' entries bound it: :func:`softmax_scale`)."""
    return resolved_softmax_scale(None if sm_scale is None else positive_float(sm_scale, name), head_dim)


def resolved_softmax_scale(sm_scale: float | None, head_dim: int) -> float:
    """``sm_scale`` as given (checked where it entered: :func:`softmax_scale`), or for None the default
    softmax scale ``1 / sqrt(head_dim)``: the one place that default is computed."""
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
