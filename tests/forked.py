"""`anchor` command lines run as processes forked from one that has imported the trainer already.

A tiny `anchor train` in a fresh interpreter spends most of its time importing torch, transformers
and DeepSpeed (about 8 of 10 seconds on 2 busy cores; the training itself is 2). The trainer's tests
run dozens of such processes, so they fork them instead from a server (multiprocessing's
forkserver, one per test process) whose only work was those imports, started with the runs'
environment, `ENV` (OMP_NUM_THREADS and the other variables torch reads at import are fixed there).

Each run is still a process of its own, as a user's shell would start it: its own pid, environment,
working directory, standard streams (files), exit status (SystemExit's code; 1 and a traceback for
an exception; minus the signal when one killed it) and, if asked, its own session. A run whose
environment is not `ENV` (a planted defect's PYTHONPATH) runs as a fresh interpreter (`subprocess`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

# What `anchor train` imports in a tiny run (the trainer, its engines' transformers models, DeepSpeed,
# the packing plot's matplotlib, TensorBoard's writer): each import, once, in the server.
PRELOAD = ["anchor.cli", "anchor.commands.train", "torchtrain.training.trainer", "deepspeed", "matplotlib.pyplot",
           "transformers.models.llama.modeling_llama", "safetensors.torch", "torch.utils.tensorboard"]

# The runs' environment: one intra-op thread per process (two xdist workers, and two ranks, share two
# cores; a run and its resumed continuation must use the same arithmetic).
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
_started = False


def _context(env: dict[str, str]):
    """The forkserver context for a run in `env` (its server started on first use), or None where `env`
    is not `ENV` (the caller then starts a fresh interpreter)."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    global _started
    if env != ENV:
        return None
    ctx = mp.get_context("forkserver")
    if not _started:
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(ENV)
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _started = True
    return ctx


def _child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str, new_session: bool) -> None:
    """The forked process: a fresh interpreter's view of `python -m anchor ARGV`, then its exit."""
    import atexit
    import traceback

    os.environ.clear()
    os.environ.update(env)
    if new_session:
        os.setsid()
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.argv = ["anchor", *argv]
    code, killed_by = 0, None
    try:
        from anchor.cli import main

        main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # uncaught: Python dies by the signal itself
        traceback.print_exc()
        killed_by = signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if killed_by is not None:
        signal.signal(killed_by, signal.SIG_DFL)
        os.kill(os.getpid(), killed_by)
    os._exit(code)


class Run:
    """A `subprocess.Popen`-like handle on one run: pid, poll, wait, communicate, send_signal, kill."""

    def __init__(self, argv: list[str], env: dict[str, str], *, cwd: str | Path | None = None,
                 new_session: bool = False):
        self._dir = tempfile.mkdtemp(prefix="anchor-run-")
        self._out, self._err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        cwd = str(cwd or os.getcwd())
        ctx = _context(env)
        self.forked = ctx is not None
        if ctx is None:
            with open(self._out, "wb") as o, open(self._err, "wb") as e:
                self._proc = subprocess.Popen([sys.executable, "-m", "anchor", *argv], env=env, cwd=cwd, stdout=o,
                                              stderr=e, stdin=subprocess.DEVNULL, start_new_session=new_session)
        else:
            self._proc = ctx.Process(target=_child, args=(list(argv), dict(env), cwd, self._out, self._err,
                                                          new_session))
            self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._proc.exitcode if self.forked else self._proc.poll()
            if code is not None:  # ended: its streams into memory, its folder gone
                self._streams = tuple(Path(p).read_text(encoding="utf-8", errors="replace")
                                      for p in (self._out, self._err))
                shutil.rmtree(self._dir, ignore_errors=True)
                self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.forked:
            self._proc.join(timeout)
            if self._proc.exitcode is None:
                raise subprocess.TimeoutExpired(["anchor"], timeout)
        else:
            self._proc.wait(timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout(), self.stderr()

    def stdout(self) -> str:
        """What the run wrote to its standard output (once it has ended)."""
        return self._streams[0]

    def stderr(self) -> str:
        return self._streams[1]


def run(argv: list[str], env: dict[str, str], *, cwd: str | Path | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """`subprocess.run([python, -m, anchor, *argv], capture_output=True, text=True)`, forked."""
    r = Run(argv, env, cwd=cwd)
    try:
        r.wait(timeout)
    except subprocess.TimeoutExpired:
        r.kill()
        r.wait()
        raise
    return subprocess.CompletedProcess(["anchor", *argv], r.returncode, r.stdout(), r.stderr())
