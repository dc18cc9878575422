"""`anchor bench`'s shared pack cache: two benches building the same entry at once, and leftovers in the
cache. Each docstring says what goes wrong without the behaviour it checks."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.bench.helpers import corpus as _corpus, env as _env, T


# ---------------------------------------------------------------------------------------------
# 1. The shared pack cache

# Builds the cache entry of `corpus` at T with random:llama's tokenizer and prints its windows. The
# packer's window writing (`_write_windows`, inside the build) waits until every process of the test has
# reached it (or the test releases it): both builds of the same entry are under way at the same time.
_BUILDER = """
import json, sys, time
from pathlib import Path
import anchor_core.data.pipeline as pipeline

barrier, me, corpus, T = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
write_windows = pipeline._write_windows

def waiting(*args, **kwargs):
    (barrier / f"ready-{me}").touch()
    deadline = time.monotonic() + 120  # a guard against a hang only
    while (len(list(barrier.glob("ready-*"))) < 2 and not (barrier / "release").exists()
           and time.monotonic() < deadline):
        time.sleep(0.02)
    return write_windows(*args, **kwargs)

pipeline._write_windows = waiting
from anchor.bench.windows import corpus_seg
print(json.dumps(corpus_seg(T, 3, model="random:llama", data=corpus).tolist()))
"""


def test_two_processes_build_the_same_cache_entry_at_once(tmp_path):
    """Two benches (different --out) packing the same corpus at the same T at the same time. Were the
    cache entry `anchor pack`'s --out, under its lock, the second would fail: `--out .../cache/bench/
    pack-<key>-129: another anchor pack (pid ...) is writing this folder`."""
    corpus = _corpus(tmp_path / "docs.jsonl")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = _env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(barrier), str(i), str(corpus), str(T)],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    deadline = time.monotonic() + 180  # a guard against a hang only
    while len(list(barrier.glob("ready-*"))) < 2 and all(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "the builders never met"
        time.sleep(0.05)
    both_met = len(list(barrier.glob("ready-*"))) == 2
    (barrier / "release").touch()  # one exited before the other reached the packer: let the other go on
    results = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, results):
        print(f"exit {p.returncode}\n{err[-2000:]}")
    assert [p.returncode for p in procs] == [0, 0]
    assert both_met  # the two builds overlapped
    windows = [np.array(json.loads(out.strip().splitlines()[-1])) for out, _ in results]
    assert windows[0].shape == (3, T) and np.array_equal(windows[0], windows[1])
    bench = tmp_path / "cache" / "bench"
    entries = [p.name for p in bench.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and entries[0].startswith("pack-") and entries[0].endswith(f"-{T}")
    assert (bench / entries[0] / "pack.json").is_file()
    assert not [p.name for p in bench.iterdir() if ".tmp-" in p.name]  # the loser's build is gone


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("leftover", ["no pack.json", "pack.json cut short"])
def test_incomplete_cache_entry_is_rebuilt(tmp_path, monkeypatch, leftover):
    """A half-written entry at the cache's path (a copy cut short, an older version killed mid-write) is
    not used: it is rebuilt. Taken as an `anchor pack` output, 'no pack.json' would fail with `--out
    .../pack-<key>-129 is a folder anchor did not write`, 'pack.json cut short' with `unreadable pack.json:
    Expecting ',' delimiter`."""
    from anchor.bench.windows import _pack_key, corpus_seg

    corpus = _corpus(tmp_path / "docs.jsonl")
    monkeypatch.setenv("ANCHOR_CACHE", str(tmp_path / "cache"))
    bench = tmp_path / "cache" / "bench"
    entry = bench / f"pack-{_pack_key(str(corpus), 'random:llama')}-{T}"
    (entry / "store").mkdir(parents=True)
    (entry / "store" / "tokens.bin").write_bytes(b"\0" * 100)
    (entry / "shard-00000.tokens.npy").write_bytes(b"\x93NUMPY")
    if leftover == "pack.json cut short":
        (entry / "pack.json").write_text('{"format": 1, "seq_len": 1')
    stale = bench / f".{entry.name}.tmp-{_dead_pid()}-x1y2z3"  # a build of a killed process
    (stale / "pack").mkdir(parents=True)

    seg = corpus_seg(T, 2, model="random:llama", data=str(corpus))
    assert seg.shape == (2, T) and (seg[:, 0] == 0).all()
    assert json.loads((entry / "pack.json").read_text())["seq_len"] == T
    assert np.load(entry / "shard-00000.tokens.npy").shape[1] == T  # the planted shard is gone
    assert not stale.exists()
    assert not [p.name for p in bench.iterdir() if ".tmp-" in p.name]
    assert np.array_equal(seg, corpus_seg(T, 2, model="random:llama", data=str(corpus)))  # now used as is
