"""Signals around long runs whose results must not be lost: a signal that would end the process
(SIGTERM, SIGINT, SIGHUP, ...) stopping a run as Ctrl-C does, and all of them ignored while what was
measured is saved (the benchmark CLI and the notebook runner), and those handlers taken back from a library
that replaced them behind Python's back (:func:`reclaim_stop_signals`)."""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["STOP_SIGNALS", "stop_signals", "stop_signals_handled", "stop_signals_as_keyboard_interrupt",
           "sigterm_as_keyboard_interrupt", "signals_ignored", "reclaim_stop_signals"]

# Every signal whose default action ends the process and that a handler can turn into a clean stop:
# SIGTERM and SIGINT (`timeout`, `kill`, CI runners, Ctrl-C), SIGHUP (the terminal or ssh session closed),
# SIGQUIT (Ctrl-\), SIGXCPU (a CPU-time limit), the user and timer signals, SIGPWR, SIGIO. Left out: SIGKILL
# and SIGSTOP (no handler runs), the faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGSYS, SIGTRAP: the
# process cannot go on from them) and SIGPIPE / SIGXFSZ (Python ignores them). Names missing on a platform
# (Windows has SIGTERM and SIGINT only) are skipped.
_STOP_NAMES = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGXCPU", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM",
               "SIGPROF", "SIGPWR", "SIGIO")
STOP_SIGNALS = tuple(getattr(signal, n) for n in _STOP_NAMES if hasattr(signal, n))
_ALWAYS = (signal.SIGTERM, signal.SIGINT)  # what the runs have always taken over


def _ours(handler) -> bool:
    return bool(getattr(handler, "fp8kv_stop", False))


def stop_signals() -> tuple:
    """The :data:`STOP_SIGNALS` a run takes over now: SIGTERM and SIGINT always; every other one only while it
    has its default action (ending the process) or a handler of this module's. One that is ignored
    (``nohup``'s SIGHUP) or handled by someone else (a profiler's SIGPROF, a test timeout's SIGALRM) is left
    to them."""
    return tuple(s for s in STOP_SIGNALS
                 if s in _ALWAYS or signal.getsignal(s) == signal.SIG_DFL or _ours(signal.getsignal(s)))


def _restore(saved: dict) -> None:
    for sig, handler in saved.items():  # None: a handler installed outside Python; the default stands in
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def stop_signals_handled(handler, *, keep_sigint: bool = False):
    """``handler(signum, frame)`` for each of :func:`stop_signals` in the main thread for the duration
    (with ``keep_sigint``, SIGINT keeps its handler), the previous handlers back afterwards. Elsewhere a
    no-op: Python sets handlers from the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ours(signum, frame):
        return handler(signum, frame)

    ours.fp8kv_stop = True  # so that signals_ignored and a nested run see it as a stop signal's handler
    saved = {sig: signal.signal(sig, ours) for sig in stop_signals() if not (keep_sigint and sig == signal.SIGINT)}
    try:
        yield
    finally:
        _restore(saved)


@contextlib.contextmanager
def stop_signals_as_keyboard_interrupt():
    """Each of :func:`stop_signals` raises KeyboardInterrupt in the main thread for the duration, so that a
    run stopped by ``timeout``, ``kill`` or a closed terminal can save what it measured, as after Ctrl-C
    (SIGINT keeps its handler: Python's raises KeyboardInterrupt already). Elsewhere a no-op."""

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    with stop_signals_handled(interrupt, keep_sigint=True):
        yield


sigterm_as_keyboard_interrupt = stop_signals_as_keyboard_interrupt  # its former name (SIGTERM was the first)


@contextlib.contextmanager
def signals_ignored():
    """:func:`stop_signals` ignored in the main thread for the duration (a save or a clean-up that a
    second signal must not cut short). Elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stop_signals()}
    try:
        yield
    finally:
        _restore(saved)


def reclaim_stop_signals() -> None:
    """Put Python's handlers of :data:`STOP_SIGNALS` back at the C level, where a library replaced them.

    LLVM inside Triton (``libtriton.so``) installs its own handlers of SIGTERM, SIGINT, SIGHUP, ... when a
    compile first needs them (measured on an H100: after some 40 kernels of ``--preset formats-tune``); they
    clean up and end the process by the default action, so a ``timeout`` then lost every row. Python's table
    still names the old handler, so setting it again is what restores it. Runs call this after each case
    (a compile happens in one). Only handlers Python installed are set again (this module's, and
    Python's own KeyboardInterrupt one); elsewhere than in the main thread a no-op."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        handler = signal.getsignal(sig)
        if _ours(handler) or handler is signal.default_int_handler:
            signal.signal(sig, handler)
