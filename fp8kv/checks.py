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

__all__ = ["integer", "positive_int", "nonnegative_int", "real", "positive_float", "one_of", "many_of",
           "tensor", "finite_tensor", "fp32_range_tensor", "positive_fp32", "int_tensor", "device", "fail",
           "ArgumentParser", "output_folder", "attention_variant"]

FP32_MAX = torch.finfo(torch.float32).max
# Soft caps up to this: the kernels fold 2 / cap into the fp32 score factor, which a larger cap (with
# sm_scale down to 1e-8) would take below fp32's normal range; and a cap of 1e30 already changes no
# fp32 score short of 1e26. Models use 30-50.
MAX_SOFT_CAP = 1e30
FP32_TINY = 2.0**-149  # smallest positive float32 (a subnormal)


def fail(msg: str, exc: type[Exception] = ValueError):
    """Raise ``exc(msg)``: for checks that need their own wording."""
    raise exc(msg)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer(value, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int (not a bool, not a float, even an integral one) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
                and value.dtype != torch.bool:
            value = int(value)
        else:
            fail(f"{name}={_show(value)} ({type(value).__name__}); expected an int", TypeError)
    value = int(value)
    if minimum is not None and value < minimum:
        fail(f"{name}={value}; expected an int >= {minimum}")
    if maximum is not None and value > maximum:
        fail(f"{name}={value}; expected an int <= {maximum}")
    return value


def positive_int(value, name: str) -> int:
    return integer(value, name, minimum=1)


def nonnegative_int(value, name: str) -> int:
    return integer(value, name, minimum=0)


def real(value, name: str, *, minimum: float | None = None, maximum: float | None = None,
         inclusive: bool = True) -> float:
    """A finite real number (int or float, not a bool or a string) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(f"{name}={_show(value)} ({type(value).__name__}); expected a finite number", TypeError)
    value = float(value)
    if not math.isfinite(value):
        fail(f"{name}={value}; expected a finite number")
    lo_ok = minimum is None or (value >= minimum if inclusive else value > minimum)
    hi_ok = maximum is None or (value <= maximum if inclusive else value < maximum)
    if not (lo_ok and hi_ok):
        lo = "" if minimum is None else f"{'>=' if inclusive else '>'} {minimum}"
        hi = "" if maximum is None else f"{'<=' if inclusive else '<'} {maximum}"
        fail(f"{name}={value}; expected a finite number {' and '.join(x for x in (lo, hi) if x)}")
    return value


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
        fail(f"{name}={_show(value)}; expected one of {choices}")
    return value


def many_of(values, name: str, choices: Sequence) -> list:
    """A non-empty list of ``choices`` (a single string counts as a list of one)."""
    if isinstance(values, str):
        values = [values]
    try:
        values = list(values)
    except TypeError:
        fail(f"{name}={_show(values)}; expected a list of values among {tuple(choices)}", TypeError)
    if not values:
        fail(f"{name} is empty; give at least one of {tuple(choices)}")
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
        fail(f"{name}={_show(value)} ({type(value).__name__}); expected {expected}", TypeError)
    try:
        # Python numbers as float64: the default dtype (fp32) would turn 1e-300 into 0 before the check
        t = torch.as_tensor(value, device=device,
                            dtype=None if isinstance(value, torch.Tensor) else torch.float64)
    except (TypeError, ValueError, RuntimeError):  # e.g. ["a"], ragged lists
        fail(f"{name}={_show(value)} is not a list of numbers; expected {expected}", TypeError)
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
        fail(f"{name}={_show(value)} ({type(value).__name__}); expected a device such as 'cpu' or 'cuda'",
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
        fail(f"{name}={_show(path)} ({type(path).__name__}); expected a folder path", TypeError)
    path = os.fspath(path)
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
    soft_cap : None, or a number in (0, :data:`MAX_SOFT_CAP`] (a float is returned).
    sinks : None, or a float32 tensor ``[num_q_heads]`` on ``device``, of finite values (checked with
        ``contents``: a host sync).
    """
    if window is not None:
        window = integer(window, "window", minimum=1)
    if soft_cap is not None:
        soft_cap = positive_float(soft_cap, "soft_cap")
        if soft_cap > MAX_SOFT_CAP:
            fail(f"soft_cap={soft_cap:g}; expected a number in (0, {MAX_SOFT_CAP:g}] (models use 30-50; a larger cap "
                 "changes no fp32 score, and the kernels' fp32 factor 2 / cap would underflow): pass None for no cap")
    if sinks is not None:
        tensor(sinks, "sinks", ndim=1, dtypes=(torch.float32,), device=device, shape_hint=f"[{num_q_heads}] (one "
               "logit per query head)")
        if sinks.shape[0] != num_q_heads:
            fail(f"sinks has shape {tuple(sinks.shape)}; expected [{num_q_heads}] (one logit per query head)")
        if contents:
            finite_tensor(sinks, "sinks")
    return window, soft_cap, sinks


def softmax_scale(sm_scale: float | None, head_dim: int) -> float:
    """``sm_scale`` as given (checked where it entered: :func:`positive_float`), or for None the default
    softmax scale ``1 / sqrt(head_dim)``: the one place that default is computed."""
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
