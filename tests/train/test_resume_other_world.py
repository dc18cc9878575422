"""A ZeRO-1/2/3 run resumed on another process count (torchtrain.training.universal): 4 steps on 2 processes, then the
same command with parallel.nproc=1 to step 8 (and 1 -> 2; a constant learning rate, which schedule.steps does not change) gives, from step 5 on, the losses and gradient norms of
an uninterrupted run on the new count, within the fp32 rule of tests/train/test_zero.py (1e-6; the counts
themselves agree to it). What a conversion killed by `kill -9` leaves (its temporary folder; the converted folder
renamed into place before the manifest that lists it) is removed and made again: the resume is the same.
The sequence-parallel degree may change too (2 processes at degree 2 -> 2 at degree 1, or -> 1 process), with the
same result. Every case starts several runs of 2 processes (half a minute to minutes on 2 cores): `make test-all` runs
them all, `make test` none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import metrics, run_train

COMMON = ("data.global_batch=4", "data.micro_batch=1", "eval.window=0", "checkpoint.save_every=4", "schedule.kind=constant",
          "optim.grad_clip=1.0", "logging.report_to=[]", "checkpoint.keep_last=0")
STAGES = [pytest.param(stage, marks=pytest.mark.slow) for stage in (1, 2, 3)]


def _run(out, packed, stage, nproc, steps, check=True):
    return run_train(out, *COMMON, f"parallel.zero_stage={stage}", f"parallel.nproc={nproc}", f"schedule.steps={steps}",
                     f"data.path={packed}", check=check)


def _same(ref, got, what):
    a = np.array([r["loss"] for r in ref][4:])
    b = np.array([r["loss"] for r in got][4:])
    rel = np.abs(a - b) / np.abs(a)
    print(f"{what}: uninterrupted {a.round(7)}\n{what}: resumed       {b.round(7)}\n{what}: max rel {rel.max():.2e}")
    assert [r["step"] for r in got] == list(range(1, 9))
    assert rel.max() <= 1e-6
    assert np.allclose([r["grad_norm"] for r in ref][4:], [r["grad_norm"] for r in got][4:], rtol=1e-5)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("before,after", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_a_zero_run_resumes_on_another_process_count(packed, tmp_path, stage, before, after):
    ref = tmp_path / "uninterrupted"
    _run(ref, packed, stage, after, 8)
    out = tmp_path / "run"
    _run(out, packed, stage, before, 4)
    done = _run(out, packed, stage, after, 8)
    assert f"({before} processes then, {after} now" in done.stderr
    step4 = out / "checkpoints" / "step-4"
    manifest = json.loads((step4 / "manifest.json").read_text())
    assert any(k.startswith("ds/universal/") for k in manifest["files"])  # the conversion is under the manifest
    _same(metrics(ref), metrics(out), f"ZeRO-{stage} {before} -> {after}")


@pytest.mark.slow
@pytest.mark.parametrize("left", [pytest.param("temporary folder", marks=pytest.mark.slow), "unlisted conversion"])
def test_what_a_killed_conversion_left_is_made_again(packed, tmp_path, left):
    stage = 1
    ref = tmp_path / "uninterrupted"
    _run(ref, packed, stage, 1, 8)
    out = tmp_path / "run"
    _run(out, packed, stage, 2, 4)
    step4 = out / "checkpoints" / "step-4"
    if left == "temporary folder":  # killed while converting
        junk = out / "checkpoints" / ".universal-step-4.tmp" / "universal" / "zero"
        junk.mkdir(parents=True)
        (junk / "half.pt").write_bytes(b"\x80\x04")
    else:  # killed after the converted folder was renamed into place, before the manifest listing it
        (step4 / "ds" / "universal" / "zero").mkdir(parents=True)
        (step4 / "ds" / "universal" / "zero" / "half.pt").write_bytes(b"\x80\x04")
    _run(out, packed, stage, 1, 8)
    assert not (out / "checkpoints" / ".universal-step-4.tmp").exists()
    assert not (step4 / "ds" / "universal" / "zero" / "half.pt").exists()
    _same(metrics(ref), metrics(out), f"ZeRO-{stage} 2 -> 1 after a killed conversion ({left})")


@pytest.mark.slow
def test_a_tampered_conversion_is_refused_as_the_checkpoint_is(packed, tmp_path):
    """A listed universal file whose bytes changed fails the checkpoint's manifest: the run names it and starts
    over from the older checkpoint it can verify (here none: from scratch), as for any corrupt checkpoint."""
    out = tmp_path / "run"
    _run(out, packed, 1, 2, 4)
    _run(out, packed, 1, 1, 5)  # converts step-4, resumes, writes nothing new before step 8 (save_every 4)
    step4 = out / "checkpoints" / "step-4"
    victim = sorted((step4 / "ds" / "universal" / "zero").rglob("fp32.pt"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed (a zip's last bytes are often zeros already)
    victim.write_bytes(bytes(data))
    shutil.rmtree(out / "checkpoints" / "step-5", ignore_errors=True)
    done = _run(out, packed, 1, 1, 6, check=False)
    assert "step-4 is corrupt (checksum mismatch in ds/universal/" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow  # minutes of CPU: make test-all
def test_a_conversion_killed_midway_is_made_again(packed, tmp_path):
    """`kill -9` while DeepSpeed's converter runs (tests/train/conversion_probe holds it between its extraction and
    its merge), then the same command: the half-made conversion is removed, made again, and the losses are those of
    the uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.train.conftest import ENV, train_args

    stage = 1
    ref = tmp_path / "uninterrupted"
    _run(ref, packed, stage, 1, 8)
    out = tmp_path / "run"
    _run(out, packed, stage, 2, 4)
    mark = tmp_path / "converting"
    probe = Path(__file__).parent / "conversion_probe"
    env = {**ENV, "ANCHOR_TEST_CONVERSION_MARK": str(mark),
           "PYTHONPATH": os.pathsep.join([str(probe), ENV.get("PYTHONPATH", "")])}
    args = train_args(out, *COMMON, f"parallel.zero_stage={stage}", "parallel.nproc=1", "schedule.steps=8",
                      f"data.path={packed}")
    proc = subprocess.Popen([sys.executable, "-m", "anchor", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert mark.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no conversion started"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    left = out / "checkpoints" / ".universal-step-4.tmp"
    assert left.is_dir() and not (out / "checkpoints" / "step-4" / "ds" / "universal").exists()
    _run(out, packed, stage, 1, 8)
    assert not left.exists()
    _same(metrics(ref), metrics(out), f"ZeRO-{stage} 2 -> 1 after kill -9 mid-conversion")


@pytest.mark.slow
def test_a_world_too_small_for_the_run_is_refused_before_any_conversion(packed, tmp_path, monkeypatch):
    """The step's memory is held to the memory free here before the checkpoint is converted: with (as it were) no
    free memory, the resume on 1 process stops in one line and leaves the run folder as it was (prepare_run holds
    the memory before the run folder is touched: data.seq_len, or a pack folder's, is known then)."""
    from anchor_core.errors import InputError
    from tests.train.conftest import TINY
    from torchtrain.attention import engines
    from torchtrain.config import load_train_config
    from torchtrain.training.trainer import train

    out = tmp_path / "run"
    _run(out, packed, 1, 2, 4)
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    log = (out / "metrics.jsonl").read_bytes()
    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": 2**20)  # 1 MiB free
    cfg = load_train_config(TINY, [*COMMON, "parallel.zero_stage=1", "parallel.nproc=1", "schedule.steps=8",
                                   f"data.path={packed}", "data.seq_len=null"])
    with pytest.raises(InputError, match=r"needs about .* for one training step; 0\.0 GiB available here"):
        train(cfg, out, progress=False)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # no universal/, no temporary folder
    assert (out / "metrics.jsonl").read_bytes() == log


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [((2, 2), (2, 1)), ((2, 2), (1, 1))])
def test_the_sequence_parallel_degree_may_change_on_resume(packed, tmp_path, before, after):
    """(processes, sequence-parallel degree): 4 steps under Ulysses, then the same command on the other degree (and
    count) to step 8 gives the uninterrupted run's losses on the new one. ZeRO partitions over every rank whatever
    the degree (torchtrain.parallel.distributed.ParallelGroups): the same count loads the checkpoint as it is, another count
    through the universal one."""
    stage = 1

    def run(out, shape, steps):
        return _run(out, packed, stage, shape[0], steps, check=True) if shape[1] == 1 else run_train(
            out, *COMMON, f"parallel.zero_stage={stage}", f"parallel.nproc={shape[0]}", f"schedule.steps={steps}",
            f"parallel.sequence_parallel={shape[1]}", f"data.path={packed}")

    ref = tmp_path / "uninterrupted"
    run(ref, after, 8)
    out = tmp_path / "run"
    run(out, before, 4)
    run(out, after, 8)
    _same(metrics(ref), metrics(out), f"ZeRO-{stage} (nproc, sp) {before} -> {after}")
