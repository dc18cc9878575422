"""What the bench tests share: a small corpus, a subprocess environment with its own cache, `anchor bench`
run in this process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
T = 129  # odd, and small: the corpus below holds a few windows of it


def corpus(path: Path) -> Path:
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"text": " ".join(f"w{int(x)}" for x in rng.integers(0, 50, n))}) + "\n"
                            for n in rng.integers(5, 60, 40)))
    return path


def env(tmp_path: Path) -> dict[str, str]:
    """A child's environment: its own cache and TMPDIR under tmp_path, this checkout importable."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir(exist_ok=True)
    return {**os.environ, "ANCHOR_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmpdir),
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


class Result:
    def __init__(self, code, out, err):
        self.exit_code, self.output = code, out + err


def run_bench(args, capsys) -> Result:
    """`anchor bench ARGS` in this process: its exit code and output."""
    from anchor.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    out = capsys.readouterr()
    return Result(e.value.code, out.out, out.err)
