"""The `anchor` command's interrupt (anchor.interrupts.Signals): a SIGINT whose handler runs where Python cannot
raise (a garbage collector's callback, as JAX's `_xla_gc_callback`) is neither printed as "Exception
ignored" nor lost: it is raised again once the main thread is back in ordinary code."""

from __future__ import annotations

import gc
import signal
import time

import pytest

from anchor import interrupts


def test_an_interrupt_swallowed_by_a_gc_callback_is_raised_again(capsys):
    fired = []

    def callback(phase, info):
        if phase == "start" and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)  # the handler runs at the callback's next bytecode
            sum(range(1000))

    gc.callbacks.append(callback)
    try:
        with pytest.raises(interrupts.Interrupted) as caught, interrupts.Signals() as signals:
            gc.collect()
            assert fired
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the run's own code, where the repeated signal lands
                time.sleep(0.001)
    finally:
        gc.callbacks.remove(callback)
    assert caught.value.signum == signal.SIGINT and signals.received == signal.SIGINT
    assert "Exception ignored" not in capsys.readouterr().err
