"""Paths no file system holds, and a run's metrics.jsonl that a resume cannot take as it is.

A path option (`--out`, `--model`, `--config`, and the train config's `model.name`) with a name longer than the
file system allows (300 bytes where 255 is the limit) is one line, exit 2, that shows an excerpt of the path (never
the whole name), and nothing is created: no folder, no parent, no lock. A resume over a metrics.jsonl with a line
that is not a logged step (a string step, a byte that is not UTF-8, a line that is not JSON before the last) is one
line naming the file and the line, exit 2, and the run folder keeps every byte. A metrics.jsonl cut mid-line (a
kill while logging) resumes from a checkpoint no later than its last whole step: the lines dropped are named on
stderr and the file ends with steps 1..N, no gap, the uninterrupted run's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from anchor_core.errors import InputError
from tests import forked
from tests.cli.helpers import assert_usage_error, run_cli, tree_hash

LONG = "a" * 300  # one name of 300 bytes: more than the 255 of Linux's and macOS's file systems
MODEL = "random:llama"


def _check_line(line: str) -> None:
    """The line shows an excerpt of the path and its size, never the 300-byte name."""
    print("line:", len(line), "characters")
    assert len(line) < 300, line
    assert "a" * 100 not in line, line
    assert "bytes" in line and "…" in line, line


def _long_cases(tmp: Path) -> dict[str, tuple[str, list]]:
    """id -> (verb, argv) with one over-long path each; every other path lies in `tmp/ok` (never created)."""
    long_file, out = tmp / LONG, tmp / "ok" / "out"
    nested = tmp / "new" / LONG / "out"  # under a parent that does not exist either: none of it is made
    return {
        "train --out": ("train", ["--config", "tiny", "--out", long_file]),
        "train --out nested": ("train", ["--config", "tiny", "--out", nested]),
        "train --config": ("train", ["--config", long_file, "--out", out]),
        "train model.name": ("train", ["--config", "tiny", "--out", out, f"model.name={long_file}"]),
        "train data.path": ("train", ["--config", "tiny", "--out", out, f"data.path={long_file}"]),
        "parity --model": ("parity", ["--model", long_file, "--out", out]),
        "parity --out": ("parity", ["--model", MODEL, "--out", nested]),
        "eval --model": ("eval", ["--model", long_file, "--out", out]),
        "eval --out": ("eval", ["--model", MODEL, "--out", nested]),
        "demo --model": ("demo", ["--model", long_file, "--out", out]),
        "demo --out": ("demo", ["--model", MODEL, "--out", nested]),
        "audit --model": ("audit", ["--model", long_file, "--out", out]),
        "audit --out": ("audit", ["--model", MODEL, "--out", nested]),
        "bench --model": ("bench", ["--model", long_file, "--out", out]),
        "pack --out": ("pack", ["--model", MODEL, "--data", tmp / "corpus.jsonl", "--seq-len", "64", "--out", nested]),
        "corpus --out": ("corpus", ["--out", nested]),
    }


@pytest.mark.parametrize("case", list(_long_cases(Path("/x"))))
def test_an_over_long_path_is_one_line_and_creates_nothing(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello world"}\n')
    verb, argv = _long_cases(tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run_cli([verb, *argv, *(["--no-progress"] if verb in ("train", "demo", "pack") else [])],
                           capsys)
    _check_line(assert_usage_error(code, err, verb))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no folder, parent, lock or staging


def test_the_check_names_the_option_and_the_too_long_name():
    from anchor_core.paths import check_path_length, path_length_problem

    with pytest.raises(InputError) as e:
        check_path_length(f"/tmp/{LONG}/x", "--out")
    assert str(e.value).startswith("--out /tmp/aaa") and "is 300 bytes" in str(e.value), str(e.value)
    _check_line(str(e.value))
    assert path_length_problem("/tmp/" + "b" * 255) is None
    assert "4096" in path_length_problem("/tmp/" + "/".join(["c" * 200] * 25))
    check_path_length("random:llama", "model")  # a name that is no path passes


def test_the_cli_maps_the_kernels_name_too_long_to_one_line(tmp_path, capsys, monkeypatch):
    """Where no check ran first, the kernel's ENAMETOOLONG (here from the verb's first use of --out) is still one
    line with an excerpt of the path, exit 2, never a traceback."""
    import errno
    import os

    def kernel_refuses(out, *args, **kwargs):
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), str(out))
    monkeypatch.setattr("anchor_core.outdir.guard_out", kernel_refuses)
    code, _, err = run_cli(["corpus", "--out", tmp_path / "new" / LONG / "out"], capsys)
    _check_line(assert_usage_error(code, err, "corpus", str(tmp_path)[:40], "is 300 bytes"))


# ---------------------------------------------------------------------------------------------
# metrics.jsonl on resume

ARGS = ("schedule.steps=8", "checkpoint.save_every=2", "checkpoint.keep_last=0", "eval.window=0")
DETERMINISTIC = ("step", "loss", "tokens", "lr", "grad_norm")  # tokens_per_s and elapsed_s are timings


def _train(out: Path) -> forked.subprocess.CompletedProcess:
    return forked.run(["train", "--config", "tiny", "--out", str(out), "--no-progress", *ARGS], forked.ENV,
                      timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of 8 steps with a checkpoint every 2 (all kept)."""
    out = tmp_path_factory.mktemp("metrics-ref") / "run"
    p = _train(out)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def _copy(reference: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(reference, run, symlinks=True)
    return run


def _edit_lines(run: Path, edit) -> None:
    path = run / "metrics.jsonl"
    lines = path.read_bytes().split(b"\n")
    edit(lines)
    path.write_bytes(b"\n".join(lines))


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _string_step(lines):
    lines[2] = b'{"step": "3"}'


def _not_utf8(lines):
    lines[4] = lines[4][:20] + b"\xff" + lines[4][20:]


def _cut_in_the_middle(lines):
    lines[3] = lines[3][:25]  # line 4 cut, lines 5.. after it


@pytest.mark.parametrize("edit, needles", [
    (_string_step, ("line 3", "'step' is \"3\"")),
    (_not_utf8, ("line 5", "0xff", "not UTF-8")),
    (_cut_in_the_middle, ("line 4", "not a JSON line")),
], ids=["string-step", "non-utf8-byte", "json-error-before-the-last-line"])
def test_an_unreadable_metrics_log_is_refused_and_the_run_folder_kept(reference, tmp_path, edit, needles):
    run = _copy(reference, tmp_path)
    _edit_lines(run, edit)
    before, listing = tree_hash(run), sorted(p.name for p in tmp_path.iterdir())
    p = _train(run)
    print(p.stderr[-2000:])
    assert_usage_error(p.returncode, p.stderr, "train", str(run / "metrics.jsonl"), *needles)
    assert tree_hash(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # no lock left beside it


def test_a_log_cut_mid_line_resumes_without_a_gap(reference, tmp_path):
    """The run killed while logging step 3, after its step-6 checkpoint (the file cut mid-line 3, the step-8
    checkpoint never written): it resumes from step-2, the last checkpoint the log covers, names the cut line,
    and ends with steps 1..8, the uninterrupted run's (an old resume from step-6 gave steps 1, 2, 7, 8)."""
    run = _copy(reference, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-8")

    def cut(lines):
        lines[2] = lines[2][:30]
        del lines[3:]
    _edit_lines(run, cut)
    p = _train(run)
    print(p.stderr[-3000:])
    assert p.returncode == 0, p.stderr[-3000:]
    ref, got = _rows(reference), _rows(run)
    assert [r["step"] for r in got] == list(range(1, 9))
    said = [line for line in p.stderr.splitlines() if "metrics.jsonl" in line]
    assert any("line 3" in line and "cut" in line for line in said), said
    assert any("resuming from step-2" in line and "step-6" in line for line in said), said
    assert [{k: r[k] for k in DETERMINISTIC} for r in got] == [{k: r[k] for k in DETERMINISTIC} for r in ref]


def test_steps_logged_past_the_checkpoint_are_named_when_dropped(reference, tmp_path):
    """Killed after logging steps 7 and 8 but before the step-8 checkpoint: the resume from step-6 drops
    lines 7-8 saying so, and logs them anew."""
    run = _copy(reference, tmp_path)
    shutil.rmtree(run / "checkpoints" / "step-8")
    p = _train(run)
    print(p.stderr[-3000:])
    assert p.returncode == 0, p.stderr[-3000:]
    ref, got = _rows(reference), _rows(run)
    assert [r["step"] for r in got] == list(range(1, 9))
    dropped = [line for line in p.stderr.splitlines() if "dropping" in line]
    assert len(dropped) == 1 and "steps 7-8" in dropped[0] and "metrics.jsonl" in dropped[0], dropped
    assert [{k: r[k] for k in DETERMINISTIC} for r in got] == [{k: r[k] for k in DETERMINISTIC} for r in ref]


def test_read_log_takes_a_cut_last_line_only(tmp_path):
    from torchtrain.training.metrics import read_log, read_metrics

    path = tmp_path / "metrics.jsonl"
    assert read_log(tmp_path).last == 0
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    logged = read_log(tmp_path)
    assert (logged.last, logged.cut) == (2, 3)
    with pytest.raises(InputError, match="line 3"):
        read_metrics(tmp_path)  # a reader of a finished run takes no cut line either
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(InputError, match="line 2: not a JSON line"):
        read_log(tmp_path)
    path.write_text('{"step": 1}\n{"step": true}\n')
    with pytest.raises(InputError, match="line 2"):
        read_log(tmp_path)
    path.write_text('{"step": 1}\n{"step": 7}\n')
    with pytest.raises(InputError, match="line 2: step 7 where step 2 belongs"):
        read_log(tmp_path)
