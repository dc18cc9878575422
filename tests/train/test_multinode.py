"""Two nodes on this machine: two torchrun launchers (`--nnodes 2`, c10d rendezvous on 127.0.0.1), one process
each, as docs/guides/multinode.md runs them. Their losses equal a one-node two-process run's within the fp32 rule
(1e-6); launchers given two different run folders (a node-local path on each node) stop with one line naming the
rank that cannot see rank 0's; a dead node ends the other within `parallel.timeout_s`, and the same command on one
node resumes the run (ZeRO-1: through the universal checkpoint, torchrun's rendezvous again)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import ENV, TINY, metrics, run_train

COMMON = ("data.global_batch=4", "data.micro_batch=1", "eval.window=0", "optim.grad_clip=1.0",
          "logging.tensorboard=false", "parallel.zero_stage=1", "schedule.kind=constant")


def _free_port() -> int:
    from torchtrain.distributed import free_port

    return free_port()


def _launch(node: int, out: Path, port: int, log: Path, *overrides: str) -> subprocess.Popen:
    """One node's launcher, as the guide writes it, in a process group of its own (so that it dies whole)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "anchor-test",
           "-m", "anchor", "train", "--config", str(TINY), "--out", str(out), "--no-progress", *COMMON, *overrides]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV, start_new_session=True)


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
    assert len(ours) == 1 and ("another rank stopped" in ours[0] or ours[0] == "anchor train: interrupted")

    trained = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    done = run_train(out, *COMMON, "parallel.nproc=1", f"schedule.steps={trained + 2}",
                     "checkpoint.save_every=2", f"parallel.timeout_s={timeout_s}", f"data.path={packed}")
    assert "2 processes then, 1 now" in done.stderr
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, trained + 3))
    assert json.loads((out / "checkpoints" / f"step-{trained + 2}" / "manifest.json").read_text())["step"] == trained + 2
