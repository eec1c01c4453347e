"""Inside a notebook: the sizes and device a run uses on this machine (:func:`setup_notebook`), decided
as the runner decides them."""

from __future__ import annotations

import dataclasses
import os
import sys

# --------------------------------------------------------------------------- the machine a notebook runs on


@dataclasses.dataclass(frozen=True)
class MachineSetup:
    """What :func:`setup_notebook` decided: ``smoke`` sizes, the ``device``, the Triton interpreter."""

    smoke: bool
    device: str
    triton_interpret: bool
    message: str


def machine_defaults(device="auto") -> tuple[bool, bool]:
    """``(smoke, triton_interpret)`` for a device: without a CUDA device, small sizes and the interpreter.

    The one rule the runner and the notebooks' defaults share.
    """
    from ..device import resolve_device

    on_gpu = resolve_device(device).type == "cuda"
    return not on_gpu, not on_gpu


def setup_notebook(smoke: bool | None = None, device="auto") -> MachineSetup:
    """Decide a notebook's sizes and Triton mode for this machine, as the runner does; print what was done.

    ``smoke=None`` (a notebook's default) detects: smoke sizes without a CUDA device, full sizes on one;
    True/False (what the runner injects) is kept. Without a CUDA device ``TRITON_INTERPRET=1`` is set,
    which works only before triton is first imported: call this first, in the cell after the parameters.
    """
    from ..capability import interpreter_on, use_interpreter
    from ..device import resolve_device

    if smoke is not None and not isinstance(smoke, bool):
        raise TypeError(f"smoke={smoke!r} must be None (detect), True or False")
    dev = resolve_device(device)
    default_smoke, interpret = machine_defaults(dev)
    smoke = default_smoke if smoke is None else smoke
    notes = [f"device {dev}: {'smoke' if smoke else 'full'} sizes"
             + (" (no GPU here)" if dev.type != "cuda" else "")]
    if interpret:
        if interpreter_on():
            notes.append("Triton kernels run in the Triton interpreter (TRITON_INTERPRET=1)")
        elif sys.modules.get("triton") is not None:
            notes.append("WARNING: triton was imported before TRITON_INTERPRET could be set; restart the kernel "
                         "and run this cell before anything imports triton")
        else:
            use_interpreter(os.environ)
            notes.append("set TRITON_INTERPRET=1: Triton kernels run in the Triton interpreter")
    message = "; ".join(notes)
    print(message)
    return MachineSetup(smoke=smoke, device=str(dev), triton_interpret=interpreter_on(),
                        message=message)
