"""Where a stack runs when it may kill its process: `Isolated`, a child interpreter (`_child`) spoken to
over a socket pair in messages of JSON and numpy arrays (`_pack`, `_unpack`: nothing pickled); a child
that dies is the outcome ("crash", `crash_text`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from parity_tests.cases import CaseInputs
from parity_tests.hf_stack.runner import Outcome, run_here
from parity_tests.hf_stack.stacks import Stack, load_function
from parity_tests.hf_stack.subjects import Subject, named_subject


def _child(fd: int) -> None:
    """The child process of `Isolated` (`python -c`, the connection's socket as file descriptor `fd`): the
    subject's model name, then one (stack, inputs, variant, dtype) request at a time, answered with
    run_here's outcome; an end message ends it."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    meta, _ = _unpack(conn.recv_bytes())
    subject = named_subject(meta["subject"])
    while (message := _unpack(conn.recv_bytes()))[0]["kind"] == "request":
        meta, arrays = message
        stack = Stack(**{**meta["stack"], "function": load_function(meta["stack"]["function"])
                         if meta["stack"]["function"] else None})
        inputs = CaseInputs(arrays["tokens"], arrays["doc_ids"], arrays["positions"], arrays["loss_mask"],
                            tuple(meta["rows"]))
        kind, value = run_here(subject, stack, inputs, meta["variant"], meta["dtype"])
        conn.send_bytes(_pack({"kind": kind, "text": None if kind == "ok" else value}, value if kind == "ok" else {}))
    conn.close()


def _pack(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """One message between `Isolated` and its child: a JSON header and numpy arrays (np.savez), nothing
    pickled: both sides read it with json and np.load(allow_pickle=False)."""
    import io
    import json

    buf = io.BytesIO()
    np.savez(buf, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
    head = json.dumps(meta).encode()
    return len(head).to_bytes(8, "little") + head + buf.getvalue()


def _unpack(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    import io
    import json

    n = int.from_bytes(data[:8], "little")
    with np.load(io.BytesIO(data[8 + n:]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(data[8:8 + n]), arrays


def _function_ref(fn: Callable[..., Any] | None) -> str | None:
    """`module:qualname` of a function the child imports again (load_function); a function it cannot
    import that way (a lambda, a closure) cannot run there."""
    if fn is None:
        return None
    ref = f"{fn.__module__}:{fn.__qualname__}"
    if "<" in ref:
        raise TypeError(f"{ref} cannot be imported by a child process")
    return ref


def crash_text(returncode: int | None) -> str:
    """How a child's end reads in a row: a signal (return code -N) or an exit code."""
    if returncode is not None and returncode < 0:
        return f"crashes (signal {-returncode})"
    return f"crashes (exit code {returncode})"


class Isolated:
    """A runner whose forwards run in a child process: a fresh interpreter (`python -c`, so nothing of this
    process is copied into it and no main module is imported again), spoken to over a socket pair with
    multiprocessing's Connection (`_pack`: JSON and numpy arrays, nothing pickled).

    One child serves every request of a group (an implementation's styles and variants: one start, one
    compilation cache); a request during which the child dies (a segmentation fault in a kernel, an abort)
    gets the outcome ("crash", "crashes (signal N)"), and the next request starts a new child.
    """

    def __init__(self, subject: Subject):
        # the child loads the named model again; a user's module does not travel (the caller runs it here)
        if subject.module is not None:
            raise TypeError("a user's module runs in this process")
        self.ref = subject.name
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        import socket
        import subprocess
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        try:
            proc = subprocess.Popen([sys.executable, "-c", f"from parity_tests.hf_stack.isolation import _child; "
                                     f"_child({theirs.fileno()})"], pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()  # the child's end lives in the child only: its death is an EOF here
        self.proc, self.conn = proc, Connection(ours.detach())
        self.conn.send_bytes(_pack({"kind": "subject", "subject": self.ref}, {}))

    def __call__(self, subject: Subject, stack: Stack, inputs: CaseInputs, variant: str, dtype: str) -> Outcome:
        if self.proc is None:
            self._start()
        meta = {"kind": "request", "stack": {**dataclasses.asdict(stack), "function": _function_ref(stack.function)},
                "rows": [int(r) for r in inputs.rows], "variant": variant, "dtype": dtype}
        arrays = {"tokens": inputs.tokens, "doc_ids": inputs.doc_ids, "positions": inputs.positions,
                  "loss_mask": inputs.loss_mask}
        try:
            self.conn.send_bytes(_pack(meta, arrays))
            reply, taps = _unpack(self.conn.recv_bytes())
            return ("ok", taps) if reply["kind"] == "ok" else (reply["kind"], reply["text"])
        except (EOFError, OSError):
            code = self.proc.wait()
            self.conn.close()
            self.proc = self.conn = None
            return "crash", crash_text(code)

    def close(self) -> None:
        import subprocess

        if self.proc is None:
            return
        try:
            self.conn.send_bytes(_pack({"kind": "end"}, {}))
            self.proc.wait(timeout=60)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.conn.close()
        self.proc = self.conn = None

    def __enter__(self) -> Isolated:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
