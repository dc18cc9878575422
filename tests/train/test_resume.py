"""Runs survive a kill: `kill -9` at a random step, then the same command again, continues exactly
(docs/DESIGN.md §8); a corrupt newest checkpoint is detected through its manifest and skipped."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests import forked
from tests.train.conftest import DETERMINISTIC, ENV, final_weights, kill_after, metrics, run_train, train_args

STEPS = 10
ARGS = (f"schedule.steps={STEPS}", "checkpoint.save_every=2", "checkpoint.keep_last=2", "eval.window=0")


def _kill_at(out: Path, data: Path, after_lines: int) -> int:
    """Start a run, SIGKILL it once metrics.jsonl has `after_lines` lines; returns the lines seen."""
    return kill_after(train_args(out, *ARGS, f"data.path={data}"), out, after_lines)


def _compare(a: Path, b: Path) -> None:
    ma, mb = metrics(a), metrics(b)
    print("uninterrupted:", [round(r["loss"], 6) for r in ma])
    print("resumed:      ", [round(r["loss"], 6) for r in mb])
    assert [r["step"] for r in mb] == list(range(1, STEPS + 1))
    for ra, rb in zip(ma, mb):
        assert {k: ra[k] for k in DETERMINISTIC} == {k: rb[k] for k in DETERMINISTIC}
    wa, wb = final_weights(a, STEPS), final_weights(b, STEPS)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert np.array_equal(wa[name], wb[name]), name


def test_kill9_then_rerun_is_bitwise_uninterrupted(packed, tmp_path):
    ref = tmp_path / "ref"
    run_train(ref, *ARGS, f"data.path={packed}")
    k = random.Random().randint(2, STEPS - 2)
    out = tmp_path / "killed"
    seen = _kill_at(out, packed, k)
    print(f"killed after {seen} logged steps (asked {k}); checkpoints:",
          sorted(p.name for p in (out / "checkpoints").iterdir()) if (out / "checkpoints").exists() else None)
    p = run_train(out, *ARGS, f"data.path={packed}")
    print(p.stderr[-500:])
    _compare(ref, out)
    assert not [q for q in (out / "checkpoints").iterdir() if q.name.startswith(".")], "staging left behind"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_newest_checkpoint_is_skipped(packed, tmp_path, damage):
    out = tmp_path / "run"
    run_train(out, "schedule.steps=4", "checkpoint.save_every=2", "checkpoint.keep_last=0", "eval.window=0", f"data.path={packed}")
    newest = out / "checkpoints" / "step-4"
    victim = next((newest / "ds").rglob("*.pt"))
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    elif damage == "flip":
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        victim.write_bytes(bytes(raw))
    else:
        (newest / "hf" / "model.safetensors").unlink()
    p = run_train(out, "schedule.steps=6", "checkpoint.save_every=2", "checkpoint.keep_last=0", "eval.window=0", f"data.path={packed}")
    lines = [l for l in p.stderr.splitlines() if l.startswith(("checkpoint step-", "resuming"))]
    print(lines)
    assert len(lines) == 1 and "step-4" in lines[0] and "resuming from step-2" in lines[0]
    steps = [r["step"] for r in metrics(out)]
    assert steps == [1, 2, 3, 4, 5, 6]
    # the rerun from step 2 rewrote step 4, and it verifies again
    from torchtrain.training.checkpoint import verify

    assert verify(newest) is None


def test_evaluation_checkpoints_past_keep_last_keep_only_their_weights(packed, tmp_path):
    """keep_last=1 over three evaluation checkpoints: the newest stays whole, the two older lose ds/ but
    still verify and evaluate; a longer rerun resumes from the whole one."""
    from anchor.eval.runner import checkpoints_of_run
    from torchtrain.training import checkpoint as ckpt

    out = tmp_path / "run"
    args = ("checkpoint.save_every=0", "checkpoint.keep_last=1", "eval.every=1", "eval.window=3", f"data.path={packed}")
    run_train(out, "schedule.steps=3", *args)
    folders = {s: ckpt.step_dir(out, s) for s in (1, 2, 3)}
    print({s: sorted(p.name for p in f.iterdir()) for s, f in folders.items()})
    assert ckpt.list_steps(out) == [3, 2, 1]
    assert [ckpt.is_weights_only(folders[s]) for s in (1, 2, 3)] == [True, True, False]
    assert not (folders[1] / "ds").exists() and not (folders[2] / "ds").exists() and (folders[3] / "ds").is_dir()
    assert all(ckpt.verify(f) is None for f in folders.values())  # the hashes written when each was whole
    assert [label for label, _ in checkpoints_of_run(out)] == ["step-1", "step-2", "step-3"]
    p = run_train(out, "schedule.steps=4", *args)
    resumed = [line for line in p.stderr.splitlines() if line.startswith(("resuming", "checkpoint step-"))]
    print(resumed)
    assert len(resumed) == 1 and resumed[0].startswith("resuming from") and resumed[0].endswith("step-3")
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    assert ckpt.list_steps(out) == [4, 3, 2]  # step 1 is no evaluation step of a 4-step run: deleted
    assert [ckpt.is_weights_only(ckpt.step_dir(out, s)) for s in (2, 3, 4)] == [True, True, False]


def test_resume_refuses_a_changed_config(packed, tmp_path):
    out = tmp_path / "run"
    run_train(out, "schedule.steps=2", f"data.path={packed}")
    p = run_train(out, "schedule.steps=3", "optim.lr=0.5", f"data.path={packed}", check=False)
    print(p.stderr)
    assert p.returncode == 2
    assert "optim.lr" in p.stderr and "config.yaml" in p.stderr and "Traceback" not in p.stderr


def test_auto_engine_resumes_the_engine_it_resolved_to(packed, tmp_path):
    """config.yaml records the engine that ran: a run started with tiny's `model.engine: auto` says varlen
    on this CPU, and a rerun resumes it whether it names auto or varlen; sdpa is refused naming the key."""
    import yaml

    from tests.train.conftest import TINY

    assert yaml.safe_load(TINY.read_text())["model"]["engine"] == "auto"
    out = tmp_path / "run"
    run_train(out, "schedule.steps=1", "eval.window=0", f"data.path={packed}")
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["engine"] == "varlen"
    for steps, engine in ((2, ("model.engine=varlen",)), (3, ())):
        p = run_train(out, f"schedule.steps={steps}", "eval.window=0", *engine, f"data.path={packed}")
        assert f"resuming from {out / 'checkpoints' / f'step-{steps - 1}'}" in p.stderr, p.stderr[-2000:]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    p = run_train(out, "schedule.steps=4", "eval.window=0", "model.engine=sdpa", f"data.path={packed}", check=False)
    print(p.stderr)
    assert p.returncode == 2 and "model.engine is 'sdpa' but the run was started with 'varlen'" in p.stderr


@pytest.mark.slow
def test_kill9_two_processes_zero2_resumes_to_1e6(packed, tmp_path):
    """The whole job (launcher and both ranks) killed as a scheduler would, then rerun."""
    args = (*ARGS, "parallel.nproc=2", "parallel.zero_stage=2", "data.micro_batch=1", "data.global_batch=4", f"data.path={packed}")
    ref = tmp_path / "ref"
    run_train(ref, *args)
    out = tmp_path / "killed"
    k = kill_after(train_args(out, *args), out, random.Random().randint(3, STEPS - 2), job=True)
    print("killed after step", k)
    run_train(out, *args)
    ma, mb = metrics(ref), metrics(out)
    la, lb = np.array([r["loss"] for r in ma]), np.array([r["loss"] for r in mb])
    print("uninterrupted:", la.round(7), "\nresumed:      ", lb.round(7))
    assert [r["step"] for r in mb] == list(range(1, STEPS + 1))
    assert np.abs(la - lb).max() / np.abs(la).max() <= 1e-6
    wa, wb = final_weights(ref, STEPS), final_weights(out, STEPS)
    worst = max(float(np.abs(wa[n] - wb[n]).max() / (np.abs(wa[n]).max() + 1e-30)) for n in wa)
    print("final weights max rel diff", worst)
    assert worst <= 1e-6


@pytest.mark.parametrize("sig,nproc", [("SIGINT", 1), pytest.param("SIGTERM", 2, marks=pytest.mark.slow)])
def test_signal_stops_the_run_cleanly_then_it_resumes(packed, tmp_path, sig, nproc):
    """Ctrl-C / a scheduler's SIGTERM: one line, exit 130/143, the workers gone, no half-written
    checkpoint, the lock released; the same command then finishes the run."""
    import signal

    out = tmp_path / "run"
    args = ("schedule.steps=400", "checkpoint.save_every=3", "eval.window=0", f"parallel.nproc={nproc}", "data.micro_batch=1", "data.global_batch=4",
            f"data.path={packed}")
    p = forked.Run(train_args(out, *args), ENV, new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "checkpoints" / "step-6").exists():
        time.sleep(0.05)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=120)
    lines = [l for l in err.splitlines() if l.startswith("anchor train")]
    print(p.returncode, lines)
    assert p.returncode == {"SIGINT": 130, "SIGTERM": 143}[sig]
    assert lines == ["anchor train: interrupted"] and "Traceback" not in err
    leftovers = [q.name for q in (out / "checkpoints").iterdir() if q.name.startswith(".")]
    assert not leftovers and not any(q.name.endswith(".lock") for q in tmp_path.iterdir())
    for _ in range(150):  # the stopped workers exit within seconds
        alive = subprocess.run(["pgrep", "-s", str(p.pid)], capture_output=True, text=True).stdout.split()
        if not alive:
            break
        time.sleep(0.1)
    assert not alive, f"workers left running: {alive}"
    done = len(metrics(out))
    run_train(out, "schedule.steps=" + str(done + 2), *args[1:])
    assert [r["step"] for r in metrics(out)] == list(range(1, done + 3))


class _Planted:
    """An object whose unpickling creates a file: what a planted payload would do instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_pickle_is_refused_and_never_runs(packed, tmp_path):
    """An object planted in DeepSpeed's model states, with the manifest's hash rewritten
    to match, is refused in one line (exit 2) before it is built; the resume writes nothing."""
    import json

    import torch

    from torchtrain.training.checkpoint import sha256_file

    out = tmp_path / "run"
    run_train(out, "schedule.steps=2", "checkpoint.save_every=2", "eval.window=0", f"data.path={packed}")
    folder = out / "checkpoints" / "step-2"
    victim = next((folder / "ds").rglob("mp_rank_00_model_states.pt"))
    marker = tmp_path / "payload-ran"
    state = torch.load(victim, weights_only=False)  # our own file, written by the run above
    state["planted"] = _Planted(marker)
    torch.save(state, victim)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][str(victim.relative_to(folder))] = sha256_file(victim)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))

    p = run_train(out, "schedule.steps=3", "checkpoint.save_every=2", "eval.window=0", f"data.path={packed}", check=False)
    print(p.stderr)
    assert not marker.exists(), "the planted object was built: its payload ran"
    assert p.returncode == 2
    errors = [line for line in p.stderr.splitlines() if "refused" in line]
    assert len(errors) == 1 and "mp_rank_00_model_states.pt" in errors[0] and "io.open" in errors[0]
    assert "Traceback" not in p.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


# `make test` keeps ZeRO-3 bf16; ZeRO-1 bf16 and ZeRO-2 fp32 run in `make test-all`.
@pytest.mark.parametrize("zero_stage,dtype", [pytest.param(1, "bfloat16", marks=pytest.mark.slow),
                                              pytest.param(2, "float32", marks=pytest.mark.slow), (3, "bfloat16")])
def test_resume_through_the_weights_only_reader(packed, tmp_path, zero_stage, dtype):
    """Every DeepSpeed file of a ZeRO-1..3, fp32 or bf16 checkpoint loads through the weights_only reader
    (torchtrain.training.state.DEEPSPEED_ALLOWLIST), and the resumed run equals the uninterrupted one."""
    args = ("checkpoint.save_every=1", "checkpoint.keep_last=3", "eval.window=0", f"parallel.zero_stage={zero_stage}", f"model.dtype={dtype}",
            f"data.path={packed}")
    ref, out = tmp_path / "ref", tmp_path / "resumed"
    run_train(ref, "schedule.steps=3", *args)
    run_train(out, "schedule.steps=2", *args)
    p = run_train(out, "schedule.steps=3", *args)
    assert "resuming from" in p.stderr and "step-2" in p.stderr
    ma, mb = metrics(ref), metrics(out)
    assert [{k: r[k] for k in DETERMINISTIC} for r in ma] == [{k: r[k] for k in DETERMINISTIC} for r in mb]
    wa, wb = final_weights(ref, 3), final_weights(out, 3)
    assert all(np.array_equal(wa[name], wb[name]) for name in wa)


def test_a_failed_first_attempt_never_leaves_its_pack_to_another_config(corpus, tmp_path):
    """A first attempt that packs RUN/data and then fails (a global batch larger than the data) removes its
    run folder, so that a rerun with other settings does not train on that pack while config.yaml records
    the new settings; a first attempt killed between its pack and config.yaml (kill -9: nothing can clean
    up) leaves RUN/data, and that pack is reused only when the settings it was made with still hold."""
    import json
    import shutil

    out = tmp_path / "run"
    p = run_train(out, f"data.path={corpus}", "data.tags=false", "data.pack.budget=20000", "data.global_batch=100000", check=False)
    assert p.returncode == 2 and not out.exists(), p.stderr
    # the state a kill -9 right after packing leaves: the marker, RUN/data, data_source.json, no config.yaml
    run_train(out, f"data.path={corpus}", "data.tags=false", "data.pack.budget=20000", "schedule.steps=1")
    for p in out.iterdir():
        if p.name not in ("data", "data_source.json", ".anchor-output.json"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    first = json.loads((out / "data" / "pack.json").read_text())
    run_train(out, f"data.path={corpus}", "data.tags=true", "data.pack.budget=30000", "schedule.steps=1")
    second = json.loads((out / "data" / "pack.json").read_text())
    print("layout before/after:", first["layout"], second["layout"])
    assert first["layout"]["tags"] is False and second["layout"]["tags"] is True
    source = json.loads((out / "data_source.json").read_text())
    assert source["packed_with"]["tags"] is True and source["packed_with"]["pack"]["budget"] == 30000


def test_resume_compares_the_data_by_path_and_content(corpus, tmp_path):
    """The same file by another name resumes; the same name with other content is refused."""
    import shutil

    data = tmp_path / "c.jsonl"
    shutil.copy(corpus, data)
    out = tmp_path / "run"
    run_train(out, f"data.path={data}", "schedule.steps=1", "data.pack.budget=20000")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    relative = os.path.relpath(data, elsewhere)  # ../c.jsonl: the same file by another name
    p = forked.run(train_args(out, f"data.path={relative}", "schedule.steps=2", "data.pack.budget=20000"), ENV, cwd=elsewhere)
    assert p.returncode == 0, p.stderr
    with open(data, "a", encoding="utf-8") as f:
        f.write('{"text": "a document added after the run started", "domain": "prose"}\n')
    p = run_train(out, f"data.path={data}", "schedule.steps=3", "data.pack.budget=20000", check=False)
    print(p.stderr)
    assert p.returncode == 2 and "content changed" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow  # two processes (the CI budget on 2 cores): `make test-all`
def test_resume_with_another_process_count(packed, tmp_path):
    """Resuming with another nproc, whose ranks the checkpoint holds no RNG states for. At ZeRO-0 it
    resumes: the data position exact (the same windows: the same counted tokens per step as the
    uninterrupted run), the RNG states derived per rank. At ZeRO >= 1, whose optimizer states are partitioned
    over the processes, the checkpoint is converted to DeepSpeed's universal format first
    (tests/train/test_resume_other_world.py holds those runs to uninterrupted ones)."""
    args = ("checkpoint.save_every=2", "checkpoint.keep_last=2", "eval.window=0", "data.micro_batch=1", f"data.path={packed}")
    ref, out = tmp_path / "ref", tmp_path / "run"
    run_train(ref, "schedule.steps=3", *args)
    run_train(out, "schedule.steps=2", *args)
    p = run_train(out, "schedule.steps=3", "parallel.nproc=2", *args)
    assert "1 processes then, 2 now" in p.stderr
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert [r["tokens"] for r in metrics(out)] == [r["tokens"] for r in metrics(ref)]
    assert abs(metrics(out)[2]["loss"] - metrics(ref)[2]["loss"]) < 1e-3 * abs(metrics(ref)[2]["loss"])


def test_a_tampered_trainer_state_is_one_line(packed, tmp_path):
    """trainer.json rewritten (its manifest hash fixed to match) is refused in one line."""
    import json

    from torchtrain.training.checkpoint import sha256_file

    out = tmp_path / "run"
    run_train(out, "schedule.steps=2", "checkpoint.save_every=2", "eval.window=0", f"data.path={packed}")
    folder = out / "checkpoints" / "step-2"
    state = json.loads((folder / "trainer.json").read_text())
    state["rng"] = {"not": "a list"}
    (folder / "trainer.json").write_text(json.dumps(state))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["trainer.json"] = sha256_file(folder / "trainer.json")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    p = run_train(out, "schedule.steps=3", "checkpoint.save_every=2", "eval.window=0", f"data.path={packed}", check=False)
    print(p.stderr)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len([line for line in p.stderr.splitlines() if "trainer.json" in line and "malformed" in line]) == 1


def test_a_rerun_never_shrinks_steps_below_the_trained(packed, tmp_path):
    """A finished run rerun with fewer steps is refused in one line, config.yaml unchanged (rewritten, it
    would give eval --run the wrong schedule)."""
    out = tmp_path / "run"
    run_train(out, "schedule.steps=4", "checkpoint.save_every=2", "eval.window=0", f"data.path={packed}")
    before = (out / "config.yaml").read_text()
    p = run_train(out, "schedule.steps=2", "checkpoint.save_every=2", "eval.window=0", f"data.path={packed}", check=False)
    print(p.stderr)
    assert p.returncode == 2 and "schedule.steps=2" in p.stderr and "step 4" in p.stderr and "Traceback" not in p.stderr
    assert (out / "config.yaml").read_text() == before
