"""Signals around long runs whose results must not be lost: SIGTERM stopping a run as Ctrl-C does,
and both ignored while what was measured is saved (the benchmark CLI and the notebook runner)."""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["STOP_SIGNALS", "sigterm_as_keyboard_interrupt", "signals_ignored"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what `timeout`, CI runners, `kill` and Ctrl-C send


def _restore(saved: dict) -> None:
    for sig, handler in saved.items():  # None: a handler installed outside Python; the default stands in
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def sigterm_as_keyboard_interrupt():
    """SIGTERM raises KeyboardInterrupt in the main thread for the duration, so that a run stopped by
    ``timeout`` or ``kill`` can save what it measured, as after Ctrl-C. Elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    saved = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt)}
    try:
        yield
    finally:
        _restore(saved)


@contextlib.contextmanager
def signals_ignored():
    """:data:`STOP_SIGNALS` ignored in the main thread for the duration (a save or a clean-up that a
    second signal must not cut short). Elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        _restore(saved)
