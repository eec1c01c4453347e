"""fp8kv.interrupts: every signal that would end the process (SIGTERM, SIGINT, SIGHUP, SIGQUIT, ...) as Ctrl-C
around a run, all of them ignored while its results are saved, the previous handlers back afterwards; a
signal someone else handles or ignores (nohup's SIGHUP) is left to them."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
from fixtures import LIBRARY_TAKES_SIGTERM

from fp8kv.interrupts import (
    STOP_SIGNALS,
    reclaim_stop_signals,
    signals_ignored,
    sigterm_as_keyboard_interrupt,
    stop_signals,
    stop_signals_as_keyboard_interrupt,
)

NAMES = [signal.Signals(s).name for s in STOP_SIGNALS]
OTHERS = [n for n in NAMES if n not in ("SIGTERM", "SIGINT")]  # taken only while at their default action


@contextlib.contextmanager
def _handler(sig, handler):
    """``sig`` handled by ``handler`` for the duration (e.g. SIG_DFL, as in a process started without a
    test timeout's SIGALRM or nohup's SIGHUP), the previous handler back afterwards."""
    before = signal.signal(sig, handler)
    try:
        yield
    finally:
        signal.signal(sig, before)


def test_the_stop_signals_are_the_terminating_ones_a_handler_can_catch():
    assert {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"} <= set(NAMES)
    assert not {"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGPIPE", "SIGCHLD"} & set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_stop_signal_raises_keyboard_interrupt_and_the_handler_is_restored(name):
    sig = signal.Signals[name]
    default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    with _handler(sig, default):
        with pytest.raises(KeyboardInterrupt) as exc:
            with stop_signals_as_keyboard_interrupt():
                os.kill(os.getpid(), sig)
                time.sleep(5)  # the handler interrupts the sleep at once
        if sig != signal.SIGINT:  # Python's own handler says nothing more
            assert str(exc.value) == f"stopped by {name}"
        assert signal.getsignal(sig) == default


@pytest.mark.parametrize("name", OTHERS)
@pytest.mark.parametrize("theirs", ["ignored", "handled"])
def test_a_signal_ignored_or_handled_by_someone_else_is_left_to_them(name, theirs):
    sig = signal.Signals[name]
    seen = []

    def handler(signum, _frame):
        seen.append(signum)

    with _handler(sig, signal.SIG_IGN if theirs == "ignored" else handler):
        before = signal.getsignal(sig)
        with stop_signals_as_keyboard_interrupt(), signals_ignored():
            assert sig not in stop_signals() and signal.getsignal(sig) == before
            os.kill(os.getpid(), sig)  # nohup's SIGHUP stays ignored; a profiler's SIGPROF reaches it
            time.sleep(0.05)
        assert seen == ([] if theirs == "ignored" else [sig])


@pytest.mark.parametrize("name", NAMES)
def test_signals_are_ignored_while_saving_and_restored_after(name):
    sig = signal.Signals[name]
    default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
    with _handler(sig, default):
        with stop_signals_as_keyboard_interrupt():  # as the bench saves: inside the run's handlers
            taken = signal.getsignal(sig)
            with signals_ignored():
                assert signal.getsignal(sig) == signal.SIG_IGN
                os.kill(os.getpid(), sig)  # ignored: the process goes on
                time.sleep(0.05)
            assert signal.getsignal(sig) == taken
        with signals_ignored():  # and outside them
            assert signal.getsignal(sig) == signal.SIG_IGN
        assert signal.getsignal(sig) == default


def test_the_former_name_is_the_same_context():
    assert sigterm_as_keyboard_interrupt is stop_signals_as_keyboard_interrupt


def test_both_are_no_ops_outside_the_main_thread():
    seen = []

    def work():
        with stop_signals_as_keyboard_interrupt(), signals_ignored():
            seen.append({s: signal.getsignal(s) for s in STOP_SIGNALS})

    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [before]  # signal handlers can only be set from the main thread: left alone


# A library taking a stop signal behind Python's back (fixtures.LIBRARY_TAKES_SIGTERM), then the signal.
TAKEN_THEN_STOPPED = LIBRARY_TAKES_SIGTERM + """
import os, sys, time
from fp8kv.interrupts import reclaim_stop_signals, stop_signals_as_keyboard_interrupt
with stop_signals_as_keyboard_interrupt():
    library_takes_sigterm()
    if sys.argv[1] == "reclaim":
        reclaim_stop_signals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except KeyboardInterrupt as e:
        print(e)
"""


@pytest.mark.parametrize("reclaim", [True, False])
def test_a_handler_a_library_took_is_taken_back(reclaim):
    import subprocess
    import sys

    got = subprocess.run([sys.executable, "-c", TAKEN_THEN_STOPPED, "reclaim" if reclaim else "as-is"],
                         capture_output=True, text=True, timeout=120)
    if reclaim:
        assert got.returncode == 0 and got.stdout.strip() == "stopped by SIGTERM", got.stderr
    else:  # what a timeout did to a benchmark before: the process ended, nothing saved
        assert got.returncode == -signal.SIGTERM, (got.returncode, got.stderr)


def test_reclaiming_sets_again_only_the_handlers_python_installed(monkeypatch):
    """Which handlers are set again: a run's own and Python's Ctrl-C one; never an ignored or default one
    (nohup's SIGHUP, a signal left to end the process), nor another thread's."""
    import fp8kv.interrupts as interrupts

    set_again = []
    real = signal.signal

    def recorded(sig, handler):
        set_again.append(signal.Signals(sig).name)
        return real(sig, handler)

    with _handler(signal.SIGHUP, signal.SIG_IGN), _handler(signal.SIGUSR1, signal.SIG_DFL), \
            _handler(signal.SIGINT, signal.default_int_handler):
        with stop_signals_as_keyboard_interrupt():
            monkeypatch.setattr(interrupts.signal, "signal", recorded)
            reclaim_stop_signals()
            monkeypatch.setattr(interrupts.signal, "signal", real)
            assert "SIGTERM" in set_again and "SIGINT" in set_again  # the run's, and Python's Ctrl-C handler
            assert "SIGHUP" not in set_again  # ignored (nohup): left alone
        set_again.clear()
        monkeypatch.setattr(interrupts.signal, "signal", recorded)
        reclaim_stop_signals()  # outside a run: only Python's Ctrl-C handler is Python's own
        monkeypatch.setattr(interrupts.signal, "signal", real)
        assert set_again == ["SIGINT"]
        thread = threading.Thread(target=reclaim_stop_signals)
        set_again.clear()
        monkeypatch.setattr(interrupts.signal, "signal", recorded)
        thread.start()
        thread.join()
        monkeypatch.setattr(interrupts.signal, "signal", real)
        assert set_again == []


def test_a_second_interrupt_while_a_sweep_hands_back_memory_loses_no_rows(monkeypatch):
    """The first Ctrl-C stops the work and its rows stand; a second one while the memory is handed back (before the
    rows are saved) is ignored: it ended the whole run before, rows and all."""
    import torch

    from fp8kv import sweeps

    rows = []

    def work():
        rows.append(1)
        raise KeyboardInterrupt

    def release(dev):  # the second Ctrl-C arrives here
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)

    monkeypatch.setattr(sweeps, "release_memory", release)
    with stop_signals_as_keyboard_interrupt():
        assert sweeps.interruptible(work, keep_partial=True, dev=torch.device("cpu")) is True
    assert rows == [1]
