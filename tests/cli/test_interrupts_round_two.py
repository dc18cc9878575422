"""Ctrl-C at any moment of a run: exit 130, one line, no traceback, no abort.

A signal's handler runs at the next bytecode of the main thread: inside a module being imported, or inside a
third-party library that a native extension called back, where an exception cannot pass (JAX's MLIR bindings
abort the process: "terminate called after throwing an instance of 'nanobind::python_error'"). There the
command's handler (anchor.interrupts.Signals) only notes the signal, and the interrupt is raised in the run's own
frame once the import or the call is done. The command takes the signals over before its first import of a
library and keeps them until it exits, so a signal early in the run, or repeated every 10 ms, is the interrupt
too. Here: both places simulated in this process, and `anchor audit` / `anchor parity` as the command, with
SIGINTs sent at moments found from the command's own imports (`python -X importtime`).
"""

from __future__ import annotations

import importlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from anchor import interrupts
from anchor_core.outdir import MARKER, read_marker
from tests.cli.helpers import leftovers

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# The handler, in this process


def test_an_interrupt_during_an_import_waits_for_the_import(tmp_path, monkeypatch):
    """SIGINT while another package's module is being imported: the module is imported whole, and the
    interrupt is raised in the run's frame at the line after the import."""
    name = "anchor_test_slow_import"
    (tmp_path / f"{name}.py").write_text(
        "import signal\n"
        "signal.raise_signal(signal.SIGINT)  # the handler runs at the next bytecode, in this module\n"
        "STEPS = [i for i in range(1000)]\n"
        "COMPLETE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    after = []
    try:
        with pytest.raises(interrupts.Interrupted) as caught, interrupts.Signals() as signals:
            importlib.import_module(name)
            after.append("the line after the import ran")
        module = sys.modules.get(name)
        print("raised:", caught.value, "module imported whole:", getattr(module, "COMPLETE", False), "after:", after)
        assert module is not None and module.COMPLETE and len(module.STEPS) == 1000
        assert after == [] and caught.value.signum == signal.SIGINT and signals.received == signal.SIGINT
    finally:
        sys.modules.pop(name, None)


def test_an_interrupt_inside_a_library_callback_waits_for_the_library(tmp_path, monkeypatch):
    """SIGINT while a third-party library (here a module under a site-packages folder) runs, between the run's
    callback it called and its own work after it: nothing is raised inside the library or the callback; the
    interrupt is raised in the run's frame at the line after the call."""
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "anchor_test_foreign.py").write_text(
        "import signal\n"
        "def call_back(fn):\n"
        "    done = [fn()]\n"
        "    for i in range(1000):\n"
        "        done.append(i)\n"
        "    return len(done)\n")
    monkeypatch.syspath_prepend(str(lib))
    foreign = importlib.import_module("anchor_test_foreign")
    seen = []

    def callback():
        signal.raise_signal(signal.SIGINT)  # the handler runs at the next bytecode: in this callback
        seen.append("callback finished")
        return 0

    try:
        with pytest.raises(interrupts.Interrupted), interrupts.Signals():
            seen.append(f"library returned {foreign.call_back(callback)}")
            seen.append("the line after the call ran")
        print("seen:", seen)
        assert seen == ["callback finished", "library returned 1001"]
        assert sys.gettrace() is not interrupts._untraced  # the trace that waited for the frame is gone
    finally:
        sys.modules.pop("anchor_test_foreign", None)


# ---------------------------------------------------------------------------------------------
# The command, in a child process


def audit_argv(out: Path) -> list[str]:
    return ["audit", "--model", "random:llama", "--quick", "--policies", "fp32", "--seq-len", "16", "--max-len", "32",
            "--no-progress", "--out", str(out)]


def parity_argv(out: Path) -> list[str]:
    return ["parity", "--model", "random:llama", "--variants", "anchor", "--engines", "eager", "--policies", "fp32",
            "--seq-len", "33", "--no-progress", "--out", str(out)]


class Command:
    """`python -X importtime -m anchor ARGV` in a child process; `imported(name)` waits until the import of
    `name` has completed in it (importtime's line for it on stderr), the moment a test can aim at."""

    def __init__(self, argv: list[str]):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("PYTHONFAULTHANDLER", None)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "anchor", *argv], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._imported: dict[str, threading.Event] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith("import time:"):
                event = self._imported.setdefault(line.rsplit("|", 1)[-1].strip(), threading.Event())
                event.set()

    def imported(self, name: str, timeout: float = 300) -> None:
        event = self._imported.setdefault(name, threading.Event())
        assert event.wait(timeout), f"{name} was never imported"

    def interrupt(self, every: float | None = None) -> int:
        """SIGINT now, and again every `every` seconds until the process ends; returns how many were sent."""
        sent = 0
        while True:
            try:
                self.proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                break
            sent += 1
            if every is None or self.proc.poll() is not None:
                break
            time.sleep(every)
        return sent

    def finish(self, timeout: float = 600) -> tuple[int, list[str]]:
        """The exit status and stderr without importtime's lines."""
        self.proc.wait(timeout)
        self._reader.join(30)
        return self.proc.returncode, [l.rstrip("\n") for l in self.lines if not l.startswith("import time:")]


def check_no_crash(err: list[str]) -> None:
    text = "\n".join(err)
    for bad in ("Traceback", "terminate called", "Exception ignored", "Fatal Python error"):
        assert bad not in text, text[-3000:]


def check_interrupted(rc: int, err: list[str], verb: str, out: Path) -> None:
    """Exit 130 and the one line; no traceback, no abort; nothing half-written at --out."""
    text = "\n".join(err)
    assert rc == 130, text[-3000:]
    assert [l for l in err if l.strip()][-1] == f"anchor {verb}: interrupted", text[-3000:]
    check_no_crash(err)
    left = [n for n in leftovers(out.parent, out.name) if n != f".{out.name}.parts"]
    assert left == [], left  # no staging folder, set-aside output or lock
    assert not out.exists() or read_marker(out) is not None and (out / MARKER).is_file()


@pytest.mark.parametrize("verb, argv", [("audit", audit_argv), ("parity", parity_argv)], ids=["audit", "parity"])
def test_sigint_during_the_commands_imports_and_every_10ms_after_is_one_line_exit_130(tmp_path, verb, argv):
    """The first SIGINT once typer is imported: the command's own imports, before its verbs are loaded."""
    out = tmp_path / "out"
    child = Command(argv(out))
    child.imported("typer")
    sent = child.interrupt(every=0.01)
    rc, err = child.finish()
    print(f"{verb}: SIGINT once typer was imported ({time.monotonic() - child.t0:.1f} s), then every 10 ms: "
          f"{sent} sent, exit {rc}, stderr {err[-3:]}")
    check_interrupted(rc, err, verb, out)


@pytest.mark.slow
def test_a_hundred_sigints_at_random_moments_of_audit_and_parity(tmp_path):
    """50 runs of each verb, each sent SIGINT at a random moment: 10 within half a second after JAX's MLIR bindings
    were imported (`jaxlib.mlir.ir`: the moment the reported abort came from), 40 between the command's first
    import of a library (typer) and three quarters of an uninterrupted run (measured first; the machine's load
    changes). Every fourth run is sent one every 10 ms from then until it exits. Each exits 130 with the one
    line and nothing half-written, or, where the run had decided its outcome before the signal, 0 with its
    output whole."""
    rng = random.Random(11)
    durations = {}
    for verb, argv in (("audit", audit_argv), ("parity", parity_argv)):
        out = tmp_path / f"{verb}-whole"
        child = Command(argv(out))
        child.imported("typer")
        start = time.monotonic()
        rc, err = child.finish()
        assert rc == 0, "\n".join(err)[-3000:]
        durations[verb] = time.monotonic() - start
    print("uninterrupted, from typer's import:", {v: round(d, 1) for v, d in durations.items()})
    results = []
    for i in range(100):
        verb, argv = (("audit", audit_argv), ("parity", parity_argv))[i % 2]
        moment, delay = ("jaxlib.mlir.ir", rng.uniform(0.0, 0.5)) if i % 10 < 2 else \
            ("typer", rng.uniform(0.0, 0.75 * durations[verb]))
        every = 0.01 if i % 4 == 3 else None
        out = tmp_path / f"try-{i}" / "out"
        out.parent.mkdir()
        child = Command(argv(out))
        child.imported(moment)
        time.sleep(delay)
        sent_at = time.monotonic()
        sent = child.interrupt(every=every)
        rc, err = child.finish()
        latency = time.monotonic() - sent_at
        results.append((verb, rc, latency))
        print(f"try {i}: {verb} SIGINT {delay:.2f} s after {moment} was imported ({sent} sent) -> exit {rc} "
              f"in {latency:.2f} s")
        if rc == 0:  # the run had decided its outcome before the signal (a signal during the exit is ignored)
            check_no_crash(err)
            assert read_marker(out) is not None and leftovers(out.parent, out.name) == [], "\n".join(err)[-3000:]
            continue
        check_interrupted(rc, err, verb, out)
    latencies = sorted(latency for _, rc, latency in results if rc == 130)
    print(f"{len(latencies)} interrupted, {100 - len(latencies)} done first; from the signal to the exit: median "
          f"{latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s")
    assert len(latencies) >= 70
