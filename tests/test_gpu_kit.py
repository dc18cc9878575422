"""The real weights' way to the GPU machine (issue 28 item 1), dry-run here: the GGUF split into parts, the
parts arriving one device call at a time, joined only when whole and equal by sha256; a damaged part or a
wrong join is refused and leaves no file under the target's name."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "benchmarks" / "gpu_kit.py"


def kit(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(KIT), *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_parts_arrive_one_call_at_a_time_and_join_to_the_same_sha256(tmp_path):
    from anchor.paths import resolve_model_name

    src = Path(resolve_model_name("default"))  # the real SmolLM2 GGUF (98 MB)
    here = tmp_path / "here"
    assert kit("split", src, "--out", here, "--part-mib", 30).returncode == 0
    manifest = json.loads((here / "manifest.json").read_text())
    assert len(manifest["parts"]) == -(-src.stat().st_size // (30 * 2**20))
    assert all(p["bytes"] <= 30 * 2**20 for p in manifest["parts"])
    stash, into = tmp_path / "stash", tmp_path / "models"
    for k, part in enumerate(manifest["parts"]):  # each call carries the manifest and one part
        call = tmp_path / f"call-{k}"
        call.mkdir()
        shutil.copy(here / "manifest.json", call)
        shutil.copy(here / part["file"], call)
        p = kit("join", call, "--stash", stash, "--into", into)
        assert p.returncode == 0, p.stderr
        last = k == len(manifest["parts"]) - 1
        assert ("complete" in p.stdout) == last and (into / src.name).exists() == last, p.stdout
    digest = hashlib.sha256((into / src.name).read_bytes()).hexdigest()
    assert digest == manifest["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_a_damaged_part_is_refused(tmp_path):
    src = tmp_path / "w.bin"
    src.write_bytes(bytes(range(256)) * 9001)
    here = tmp_path / "here"
    assert kit("split", src, "--out", here, "--part-mib", 0.5).returncode == 0
    part = sorted(here.glob("w.bin.part-*"))[1]
    data = bytearray(part.read_bytes())
    data[7] ^= 1
    part.write_bytes(bytes(data))
    p = kit("join", here, "--stash", tmp_path / "stash", "--into", tmp_path / "models")
    print(p.stdout, p.stderr)
    assert p.returncode == 2 and "sha256 differs" in p.stderr and not (tmp_path / "models" / "w.bin").exists()
