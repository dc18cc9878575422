"""Two nodes on this machine: two torchrun launchers (`--nnodes 2`, c10d rendezvous on 127.0.0.1), one process
each, as docs/guides/multinode.md runs them. Their losses equal a one-node two-process run's within the fp32 rule
(1e-6); launchers given two different run folders (a node-local path on each node), or other overrides, stop with
one line naming the rank that differs; a dead node ends the other within a minute, with `parallel.timeout_s` at its
600 s, and one line naming it, whatever the other waits in (a step's collective, its own checkpoint write, the
checkpoint's barrier, a node frozen rather than killed), while a node that finishes first is no death; and the same
command on one node resumes the run (ZeRO-1: through the universal checkpoint, torchrun's rendezvous again)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.docs_recipes.recipes import documented_output, output_shape
from tests.train.conftest import ENV, TINY, metrics, run_train

PROBE = Path(__file__).parent / "hold_probe"  # holds a rank in its checkpoint write, or after it trained

COMMON = ("data.global_batch=4", "data.micro_batch=1", "eval.window=0", "optim.grad_clip=1.0",
          "logging.report_to=[]", "parallel.zero_stage=1", "schedule.kind=constant")


def _free_port() -> int:
    from torchtrain.parallel.distributed import free_port

    return free_port()


def _listening(port: int) -> bool:
    """Some process of this machine listens on TCP `port` (/proc/net/tcp, tcp6: state 0A), no connection made."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def _launch(node: int, out: Path, port: int, log: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """One node's launcher, as the guide writes it, in a process group of its own (torchrun starts its rank in
    another: killing the launcher's group leaves the rank running, as a launcher killed alone would).

    Node 0's launcher returns once it listens on the rendezvous port: on several hosts only the endpoint's host
    (node 0's) can hold the job's store, but here every launcher is on that host and the first to bind the port
    holds it, so node 1 must not start before node 0 holds it (else a frozen node 1 would freeze the store too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "anchor-test",
           "-m", "anchor", "train", "--config", str(TINY), "--out", str(out), "--no-progress", *COMMON, *overrides]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env or ENV,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while node == 0 and proc.poll() is None and not _listening(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its ranks in process groups of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _both(outs: tuple[Path, Path], tmp: Path, *overrides: str, timeout: float = 300) -> list[str]:
    port = _free_port()
    logs = [tmp / f"node{n}.log" for n in (0, 1)]
    procs = [_launch(n, outs[n], port, logs[n], *overrides) for n in (0, 1)]
    for p in procs:
        p.wait(timeout=timeout)
    return [log.read_text() for log in logs]


@pytest.mark.slow  # minutes of CPU: make test-all
def test_two_nodes_train_as_one_node_of_two_processes(packed, tmp_path):
    ref = tmp_path / "one-node"
    run_train(ref, *COMMON, "parallel.nproc=2", "schedule.steps=4", f"data.path={packed}")
    out = tmp_path / "two-nodes"
    logs = _both((out, out), tmp_path, "schedule.steps=4", f"data.path={packed}")
    assert (out / "checkpoints" / "step-4" / "manifest.json").is_file(), logs[0][-3000:]
    a = np.array([r["loss"] for r in metrics(ref)])
    b = np.array([r["loss"] for r in metrics(out)])
    print(f"one node {a.round(7)}\ntwo nodes {b.round(7)}")
    assert [r["tokens"] for r in metrics(ref)] == [r["tokens"] for r in metrics(out)]
    assert (np.abs(a - b) / np.abs(a)).max() <= 1e-6


@pytest.mark.slow
def test_a_node_local_run_folder_is_refused_in_one_line(packed, tmp_path):
    here, there = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    logs = _both((here, there), tmp_path, "schedule.steps=2", f"data.path={packed}")
    for log in logs:
        lines = [ln for ln in log.splitlines() if ln.startswith("anchor train: error:")]
        assert len(lines) == 1, log[-3000:]
        assert "rank 1 on" in lines[0] and "does not see the run folder rank 0 prepared" in lines[0]
        assert str(there) in lines[0] and len(lines[0]) < 400
    assert not (here / "checkpoints").exists() and not there.exists()


@pytest.mark.slow
def test_nodes_started_with_other_overrides_are_refused_in_one_line(packed, tmp_path):
    out, port = tmp_path / "run", _free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    args = ("schedule.steps=2", f"data.path={packed}")
    procs = [_launch(0, out, port, logs[0], *args),
             _launch(1, out, port, logs[1], *args, "optim.lr=0.5", "data.seed=3")]
    for p in procs:
        p.wait(timeout=300)
    host = socket.gethostname()
    for p, log in zip(procs, logs):
        text = log.read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith("anchor train:")]
        assert len(lines) == 1 and p.returncode != 0, text[-3000:]
        assert lines[0].startswith(f"anchor train: error: rank 1 on {host} was started with another config than "
                                   f"rank 0 on {host}: data.seed 3 there, 0 on rank 0; optim.lr 0.5 there, 0.001 on "
                                   "rank 0;"), lines[0]
        page = documented_output("tests/train/test_multinode.py::"
                                 "test_nodes_started_with_other_overrides_are_refused_in_one_line")  # multinode.md
        assert output_shape(lines[0], (host,)) == output_shape(page), (lines[0], page)
        assert len(lines[0]) < 300
        assert re.search(r"exitcode\s*:\s*2\b", text), text[-3000:]  # the rank's exit status, in torchrun's summary
    assert not (out / "config.yaml").exists()  # refused before rank 0 prepared the run folder


# A node killed (or frozen) while the other does one thing: (the node that dies, the rank held in its first checkpoint
# write by tests/train/hold_probe or None, how it dies). "launcher": its launcher's process group killed (its rank,
# in a session of its own, runs on: it must see its launcher gone); "node": the launcher and its rank killed;
# "frozen": both stopped (SIGSTOP), their connections open, as a node that went silent. Node 0's launcher holds the
# job's store.
MOMENTS = {
    "in a step": (1, None, "launcher"),
    "in its own checkpoint write": (1, 0, "node"),  # the survivor is the one writing, for longer than a beat's limit
    "in the checkpoint's barrier, the store's node dead": (0, 0, "launcher"),
    "in the checkpoint's barrier, a node frozen": (1, 1, "frozen"),
}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_dead_node_ends_the_other_within_a_minute(packed, tmp_path, moment):
    from torchtrain.parallel.distributed import STALE_S

    victim, held, how = MOMENTS[moment]
    survivor = 1 - victim
    out, port, mark = tmp_path / "run", _free_port(), tmp_path / "held"
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE), ENV.get("PYTHONPATH")]))}
    if held is not None:
        env["ANCHOR_TEST_HOLD"] = f"{held}:{mark}"
    args = ("schedule.steps=400", "checkpoint.save_every=2", "parallel.timeout_s=600", f"data.path={packed}")
    procs = [_launch(n, out, port, logs[n], *args, env=env) for n in (0, 1)]
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and all(p.poll() is None for p in procs) and not (
                mark.exists() if held is not None else
                (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 3):
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
        if held == survivor:  # a rank busy past the limit beats on: nobody is taken for dead
            time.sleep(STALE_S + 5)
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:] + logs[1].read_text()[-3000:]
        ranks = _descendants(procs[victim].pid)
        killed_at = time.monotonic()
        if how == "launcher":
            os.killpg(procs[victim].pid, signal.SIGKILL)
        for pid in [procs[victim].pid, *ranks] if how != "launcher" else []:
            os.kill(pid, signal.SIGSTOP if how == "frozen" else signal.SIGKILL)
        try:
            procs[survivor].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {survivor} still runs 60 s after node {victim} died ({moment}):\n"
                        + logs[survivor].read_text()[-3000:])
        ended = time.monotonic() - killed_at
        orphans = [pid for pid in ranks if _alive(pid)] if how == "launcher" else []
        while orphans and time.monotonic() < killed_at + 60:
            time.sleep(0.2)
            orphans = [pid for pid in orphans if _alive(pid)]
    finally:
        for pid in [p.pid for p in procs] + ranks + [d for p in procs for d in _descendants(p.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    text = logs[survivor].read_text()
    ours = [ln for ln in text.splitlines() if ln.startswith("anchor train:")]
    print(f"{moment}: node {survivor} ended {ended:.1f} s after node {victim} died; its line: {ours}")
    assert procs[survivor].returncode != 0 and len(ours) == 1, text[-3000:]
    assert ours[0].startswith(f"anchor train: error: rank {survivor}: node {victim} (rank {victim} on "
                              f"{socket.gethostname()}) stopped"), ours[0]
    # docs/guides/multinode.md shows a silent node's line: ours has its shape, or (another cause) its start and end
    page = output_shape(documented_output("tests/train/test_multinode.py::"
                                          "test_a_dead_node_ends_the_other_within_a_minute"))
    shape = output_shape(ours[0], (socket.gethostname(),))
    if "no heartbeat" in ours[0]:
        assert shape == page, (ours[0], page)
    head, tail = page[:page.index(" stopped")], page[page.index("; this rank stops too"):]
    assert shape.startswith(head + " stopped") and shape.endswith(tail), (ours[0], page)
    assert not orphans, f"node {victim}'s rank still runs without its launcher"  # it stopped on its own


@pytest.mark.slow
def test_a_node_that_finishes_first_is_not_taken_for_dead(packed, tmp_path):
    """Rank 0 ends longer after node 1 than a silent node is given (tests/train/hold_probe lingers it once trained):
    node 1, done, is no death, and both launchers exit 0."""
    from torchtrain.parallel.distributed import STALE_S

    out, port = tmp_path / "run", _free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROBE), ENV.get("PYTHONPATH")])),
           "ANCHOR_TEST_LINGER": f"0:{STALE_S + 10:.0f}"}
    procs = [_launch(n, out, port, logs[n], "schedule.steps=2", f"data.path={packed}", env=env) for n in (0, 1)]
    ranks: dict[int, list[int]] = {}
    ended: dict[int, float] = {}  # when each node's rank ended (its launcher then waits in torchrun's exit barrier)
    deadline = time.monotonic() + 400
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for n, p in enumerate(procs):
            ranks[n] = ranks.get(n) or _descendants(p.pid)
            if n not in ended and ranks[n] and not any(_alive(pid) for pid in ranks[n]):
                ended[n] = time.monotonic()
        time.sleep(0.2)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    texts = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], texts[0][-3000:] + texts[1][-3000:]
    assert not any("anchor train: error" in t for t in texts)
    print(f"node 0 ended {ended[0] - ended[1]:.1f} s after node 1")
    assert ended[0] - ended[1] > STALE_S


@pytest.mark.slow
def test_a_dead_node_ends_the_other_and_one_node_resumes(packed, tmp_path):
    out = tmp_path / "run"
    timeout_s = 20
    port = _free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    args = ("schedule.steps=400", "checkpoint.save_every=2", f"parallel.timeout_s={timeout_s}", f"data.path={packed}")
    procs = [_launch(n, out, port, logs[n], *args) for n in (0, 1)]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (out / "checkpoints" / "step-4").is_dir():
        time.sleep(0.5)
    assert (out / "checkpoints" / "step-4").is_dir(), logs[0].read_text()[-3000:]
    killed_at = time.monotonic()
    for pid in [procs[1].pid, *_descendants(procs[1].pid)]:  # node 1 dies whole: its launcher and its rank
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    procs[0].wait(timeout=timeout_s + 60)
    ended = time.monotonic() - killed_at
    text = logs[0].read_text()
    ours = [ln for ln in text.splitlines() if ln.startswith("anchor train:")]
    print(f"node 0 ended {ended:.1f} s after node 1 died; its line: {ours}")
    assert ended <= timeout_s + 30 and procs[0].returncode != 0
    assert len(ours) == 1 and f"node 1 (rank 1 on {socket.gethostname()}) stopped" in ours[0], text[-3000:]

    trained = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    done = run_train(out, *COMMON, "parallel.nproc=1", f"schedule.steps={trained + 2}",
                     "checkpoint.save_every=2", f"parallel.timeout_s={timeout_s}", f"data.path={packed}")
    assert "2 processes then, 1 now" in done.stderr
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, trained + 3))
    assert json.loads((out / "checkpoints" / f"step-{trained + 2}" / "manifest.json").read_text())["step"] == trained + 2
