"""Interrupted runs leave nothing behind: SIGTERM and SIGINT during pack and
audit remove the staging folder and the lock; after kill -9 the next run removes them; of two writers
of one `--out` one succeeds and the other exits 2 naming the first; the output is whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anchor_core.atomic import publish, staging_dir
from anchor_core.data.packed import PackedData
from anchor_core.outdir import MARKER, read_marker, remove_stale_staging, write_marker
from tests.cli.helpers import assert_usage_error, leftovers, run_cli, tree_hash, write_corpus

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("blocking_run.py")


def pack_argv(corpus: Path, out: Path) -> list[str]:
    return ["pack", "--model", "random:llama", "--data", str(corpus), "--seq-len", "16", "--no-progress",
            "--out", str(out)]


def audit_argv(out: Path) -> list[str]:
    return ["audit", "--model", "random:llama", "--quick", "--policies", "fp32", "--seq-len", "16", "--max-len", "32",
            "--no-progress", "--out", str(out)]


class Blocked:
    """`anchor ARGV` in a child process, paused at `point` (tests/cli/blocking_run.py)."""

    def __init__(self, tmp: Path, point: str, argv: list[str]):
        self.ready, self.go = tmp / f"ready-{point}", tmp / f"go-{point}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), point, str(self.ready), str(self.go), "--", *argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)

    def wait_ready(self, timeout: float = 120) -> None:
        t0 = time.time()
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited early ({self.proc.returncode}): {self.proc.stderr.read()}")
            if time.time() - t0 > timeout:
                self.proc.kill()
                raise AssertionError("never reached the pause point")
            time.sleep(0.05)

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        print("child exit", self.proc.returncode, "stderr:", err[-2000:])
        return self.proc.returncode, err


def staging(parent: Path, name: str) -> list[str]:
    return [n for n in leftovers(parent, name) if ".tmp-" in n or ".old-" in n]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_during_pack_leaves_nothing(sig, code, tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    child = Blocked(tmp_path, "pack-read", pack_argv(corpus, out))
    child.wait_ready()
    during = leftovers(tmp_path, "out")
    print("while paused:", during)
    assert any(n.startswith(f".out.tmp-{child.proc.pid}-") for n in during) and ".out.lock" in during
    child.proc.send_signal(sig)
    rc, err = child.finish()
    print("after:", leftovers(tmp_path, "out"), "out exists:", out.exists())
    assert rc == code and err.strip().splitlines()[-1] == "anchor pack: interrupted"
    assert "Traceback" not in err
    assert leftovers(tmp_path, "out") == [] and not out.exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_during_audit_keeps_the_previous_output(sig, code, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "audit.json").write_text('{"old": true}')
    write_marker(out, "audit")
    before = tree_hash(out)
    child = Blocked(tmp_path, "audit-write", audit_argv(out))
    child.wait_ready()
    during = leftovers(tmp_path, "out")
    print("while paused:", during)
    assert any(n.startswith(f".out.tmp-{child.proc.pid}-") for n in during) and ".out.lock" in during
    child.proc.send_signal(sig)
    rc, err = child.finish()
    print("after:", leftovers(tmp_path, "out"))
    assert rc == code and err.strip().splitlines()[-1] == "anchor audit: interrupted"
    # no staging folder or lock left; what the audit had finished stays beside --out (anchor_core.parts) for a rerun
    assert leftovers(tmp_path, "out") == [".out.parts"] and read_marker(tmp_path / ".out.parts")["verb"] == "audit"
    assert tree_hash(out) == before


def test_kill9_then_rerun_leaves_nothing(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    child = Blocked(tmp_path, "pack-read", pack_argv(corpus, out))
    child.wait_ready()
    child.proc.kill()
    child.finish()
    orphans = leftovers(tmp_path, "out")
    print("after kill -9:", orphans)
    assert any(".tmp-" in n for n in orphans)  # SIGKILL cannot be caught: the staging folder stays ...
    code, _, _ = run_cli(pack_argv(corpus, out), capsys)
    print("after the rerun:", leftovers(tmp_path, "out"))
    assert code == 0 and leftovers(tmp_path, "out") == []  # ... until the next writer of --out
    assert PackedData.open(out).num_windows > 0


def test_two_writers_one_wins_output_whole(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    first = Blocked(tmp_path, "pack-read", pack_argv(corpus, out))
    first.wait_ready()
    code, _, err = run_cli(pack_argv(corpus, out), capsys)
    assert_usage_error(code, err, "pack", f"pid {first.proc.pid}", "is writing this folder")
    first.go.write_text("")
    rc, _ = first.finish()
    assert rc == 0
    data = PackedData.open(out)
    stats = json.loads((out / "stats.json").read_text())
    print("windows:", data.num_windows, stats["windows"]["count"], "marker:", read_marker(out))
    assert data.num_windows == stats["windows"]["count"] > 0 and read_marker(out)["verb"] == "pack"
    assert leftovers(tmp_path, "out") == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_staging_of_dead_processes_removed_live_ones_kept(tmp_path):
    out = tmp_path / "out"
    dead = _dead_pid()
    (tmp_path / f".out.tmp-{dead}-abc").mkdir()
    (tmp_path / f".out.tmp-{dead}-abc" / "big.bin").write_bytes(b"x" * 1000)
    (tmp_path / ".out.tmp-k2j4_x9a").mkdir()  # anchor < 0.1.1: no pid in the name
    (tmp_path / f".out.tmp-{os.getpid()}-live").mkdir()  # a live process's (ours)
    (tmp_path / f".other.tmp-{dead}-abc").mkdir()  # another output's
    remove_stale_staging(out)
    left = sorted(p.name for p in tmp_path.iterdir())
    print(left)
    assert left == sorted([f".out.tmp-{os.getpid()}-live", f".other.tmp-{dead}-abc"])


def test_publish_killed_between_renames_is_repaired(tmp_path):
    """kill -9 after the old output was set aside and before the new one arrived: the next writer puts it back."""
    out = tmp_path / "out"
    old = tmp_path / f".out.old-{_dead_pid()}-1234"
    old.mkdir()
    (old / "result.json").write_text("old")
    write_marker(old, "pack")
    remove_stale_staging(out)
    print(sorted(p.name for p in tmp_path.iterdir()))
    assert (out / "result.json").read_text() == "old" and not old.exists()


def test_publish_failure_restores_the_old_output(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    write_marker(out, "x")
    real = os.replace
    calls = []

    def flaky(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # the new folder's rename into place
            raise OSError(28, "No space left on device")
        return real(src, dst)

    with pytest.raises(OSError):
        with staging_dir(out, "x") as tmp:
            (tmp / "new").mkdir()
            (tmp / "new" / "a.txt").write_text("new")
            monkeypatch.setattr(os, "replace", flaky)
            publish(tmp / "new", out, "x")
    monkeypatch.setattr(os, "replace", real)
    print(calls, sorted(p.name for p in tmp_path.iterdir()))
    assert (out / "a.txt").read_text() == "old" and (out / MARKER).is_file()
    assert leftovers(tmp_path, "out") == []
