"""fp8kv.interrupts: SIGTERM as Ctrl-C around a run, both ignored while its results are saved, and
the previous handlers back afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from fp8kv.interrupts import STOP_SIGNALS, signals_ignored, sigterm_as_keyboard_interrupt


def test_sigterm_raises_keyboard_interrupt_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt, match="stopped by SIGTERM"):
        with sigterm_as_keyboard_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts the sleep at once
    assert signal.getsignal(signal.SIGTERM) == before


def test_signals_are_ignored_while_saving_and_restored_after():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with signals_ignored():
        assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)  # ignored: the process goes on
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_both_are_no_ops_outside_the_main_thread():
    seen = []

    def work():
        with sigterm_as_keyboard_interrupt(), signals_ignored():
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [before]  # signal handlers can only be set from the main thread: left alone
