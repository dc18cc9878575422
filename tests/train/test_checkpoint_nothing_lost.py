"""Nothing lost, nothing read unchecked (docs/DESIGN.md §8, §9): a checkpoint is verified against its manifest
by whatever reads it (a resume, `anchor eval --run`, a checkpoint folder or its hf/ given as a model), a folder
without a manifest is read only where it is plainly a Hugging Face folder (with a note), and a run that cannot
resume from the checkpoints of an earlier attempt keeps what it writes through a kill -9."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from anchor.cli import main
from anchor.eval.generate import eval_model_source
from anchor_core.errors import InputError
from anchor_core.export import export_hf
from anchor_core.weights import load_spec, load_weights, random_preset, random_state
from tests import forked
from tests.train.conftest import DETERMINISTIC, ENV, final_weights, metrics, run_train, train_args
from torchtrain.training import checkpoint as ckpt


def _checkpoint(run: Path, step: int) -> Path:
    """A published checkpoint of random:llama as `Checkpointer.save` lays it out (hf/ exported, trainer.json,
    a DeepSpeed file), under its manifest."""
    folder = ckpt.step_dir(run, step)
    spec = random_preset("llama")
    export_hf(spec, random_state(spec, seed=step), folder / "hf", tokenizer_of="random:llama")
    (folder / "trainer.json").write_text(json.dumps({"step": step}))
    (folder / "ds" / "state").mkdir(parents=True)
    (folder / "ds" / "state" / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 4)
    ckpt.write_manifest(folder, step, {"config": "config.yaml"})
    return folder


def _flip_a_weight_byte(folder: Path) -> None:
    """One byte of a tensor's data flipped: the safetensors header still parses, the file keeps its size."""
    f = folder / "hf" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-7] ^= 0xFF
    f.write_bytes(bytes(raw))


def _refused(read, name: str) -> str:
    with pytest.raises(InputError) as e:
        read(name)
    return str(e.value)


def test_every_reader_of_a_checkpoint_verifies_its_manifest(tmp_path):
    folder = _checkpoint(tmp_path / "run", 12)
    want = load_weights(str(folder / "hf"))[1]
    _flip_a_weight_byte(folder)
    for name in (folder / "hf", folder):
        for read in (load_weights, load_spec, eval_model_source):
            message = _refused(read, str(name))
            print(f"{read.__name__}({name.name}): {message}")
            assert message == f"{folder}: checkpoint step-12 does not verify: checksum mismatch in hf/model.safetensors"
    _flip_a_weight_byte(folder)  # flipped back: the bytes the manifest holds
    for name in (folder, folder / "hf"):
        spec, state = load_weights(str(name))
        assert spec.num_layers == random_preset("llama").num_layers
        assert all(np.array_equal(state[k], want[k]) for k in want)
    assert eval_model_source(str(folder)) == str(folder / "hf")


def test_only_a_plain_hugging_face_folder_is_read_without_a_manifest_and_it_is_noted(tmp_path, capsys):
    folder = _checkpoint(tmp_path / "run", 4)
    (folder / "manifest.json").unlink()
    for name in (folder / "hf", folder):
        message = _refused(load_weights, str(name))
        print(message)
        assert f"{name}: a training checkpoint without its manifest.json" in message
    plain = tmp_path / "plain"
    shutil.copytree(folder / "hf", plain)  # a Hugging Face folder of our own making, out of any checkpoint
    capsys.readouterr()
    load_weights(str(plain))
    load_weights(str(plain))
    err = capsys.readouterr().err
    print(err)
    assert err.splitlines() == [f"note: {plain}: a Hugging Face model folder without manifest.json, read as it is "
                                "(not verified)"]


def test_eval_model_refuses_a_corrupt_checkpoint_in_one_line(tmp_path, capsys):
    folder = _checkpoint(tmp_path / "run", 12)
    _flip_a_weight_byte(folder)
    for name in (folder / "hf", folder):
        out = tmp_path / "eval"
        with pytest.raises(SystemExit) as e:
            main(["eval", "--model", str(name), "--out", str(out), "--tasks", "niah_single_1", "--lengths", "1024",
                  "--samples", "1", "--dtype", "float32", "--perplexity-windows", "0", "--no-progress"])
        err = capsys.readouterr().err
        print(err)
        want = f"{folder}: checkpoint step-12 does not verify: checksum mismatch in hf/model.safetensors"
        assert e.value.code == 2 and err.strip().splitlines() == [f"anchor eval: error: {want}"]
        assert not out.exists()


def test_pruning_counts_no_unusable_checkpoint_of_a_higher_step(tmp_path):
    """Two whole checkpoints lose ds/: the checkpoint a restarted run writes next, step 2, is the newest pruning
    counts, so it stays (and goes once step 4 is written); the unusable ones are left as they are. A resume
    names both in one line, whether it finds an older checkpoint or none."""
    for step in (10, 12):
        shutil.rmtree(_checkpoint(tmp_path, step) / "ds")
    _checkpoint(tmp_path, 2)
    assert ckpt.prune(tmp_path, keep_last=1, is_evaluation=lambda step: False, written=2) == ([], [])
    assert ckpt.list_steps(tmp_path) == [12, 10, 2]
    _checkpoint(tmp_path, 4)
    assert ckpt.prune(tmp_path, keep_last=1, is_evaluation=lambda step: False, written=4) == ([2], [])
    assert ckpt.list_steps(tmp_path) == [12, 10, 4]
    logs: list[str] = []
    assert ckpt.newest_valid(tmp_path, log=logs.append) == 4
    print(logs)
    assert len(logs) == 1 and "resuming from step-4" in logs[0]
    assert "step-12 is corrupt (missing file ds/" in logs[0] and "step-10 is corrupt (missing file ds/" in logs[0]
    shutil.rmtree(ckpt.step_dir(tmp_path, 4))
    logs.clear()
    assert ckpt.newest_valid(tmp_path, log=logs.append) is None
    print(logs)
    assert len(logs) == 1 and "starting from scratch" in logs[0] and "step-12" in logs[0] and "step-10" in logs[0]


def test_a_restart_from_scratch_keeps_its_checkpoints_through_a_kill9(packed, tmp_path):
    """The two newest (and only whole) checkpoints of a finished run lose ds/. The rerun starts from scratch,
    saying so in one line that names both; killed with SIGKILL after its step-4 checkpoint, it left step-2 and
    step-4 in place, and the next rerun resumes from the newest of them, rewrites the unusable steps and ends
    where the first run ended, bit for bit. (24 steps: the kill lands long before the rerun could finish.)"""
    steps = 24
    args = (f"schedule.steps={steps}", "checkpoint.save_every=2", "checkpoint.keep_last=2", "eval.window=0",
            f"data.path={packed}")
    out = tmp_path / "run"
    run_train(out, *args)
    first, first_weights = metrics(out), final_weights(out, steps)
    stale = [steps, steps - 2]
    assert ckpt.list_steps(out) == stale
    for step in stale:
        shutil.rmtree(ckpt.step_dir(out, step) / "ds")

    p = forked.Run(train_args(out, *args), ENV)
    deadline, cut = time.time() + 300, False
    while time.time() < deadline and p.poll() is None:
        lines = len((out / "metrics.jsonl").read_text().splitlines()) if (out / "metrics.jsonl").is_file() else 0
        cut = cut or lines < 5  # the rerun has cut the first run's lines back
        if cut and lines >= 5:
            break  # step 5 is logged after the step-4 checkpoint was published
        time.sleep(0.005)
    p.kill()
    p.wait()
    assert p.returncode == -9, f"the rerun ended by itself ({p.returncode}) before the kill:\n{p.stderr()[-2000:]}"
    warned = [line for line in p.stderr().splitlines() if "starting from scratch" in line]
    print(warned, ckpt.list_steps(out))
    assert {2, 4} <= set(ckpt.list_steps(out)), "the restarted run lost the checkpoints it wrote"
    assert all(ckpt.verify(ckpt.step_dir(out, s)) is None for s in (2, 4))
    assert len(warned) == 1 and all(f"step-{s} is corrupt (missing file ds/" in warned[0] for s in stale)

    q = run_train(out, *args)
    resumed = [line for line in q.stderr.splitlines() if line.startswith(("checkpoint step-", "resuming"))]
    print(resumed)
    assert len(resumed) == 1 and "resuming from step-" in resumed[0]
    assert 4 <= int(resumed[0].split("resuming from step-")[1].split()[0]) < steps - 2
    assert [{k: r[k] for k in DETERMINISTIC} for r in metrics(out)] == [{k: r[k] for k in DETERMINISTIC} for r in first]
    weights = final_weights(out, steps)
    assert weights.keys() == first_weights.keys() and all(np.array_equal(weights[k], first_weights[k]) for k in weights)
    assert ckpt.list_steps(out) == stale
    assert all(ckpt.verify(ckpt.step_dir(out, s)) is None and not ckpt.is_weights_only(ckpt.step_dir(out, s))
               for s in stale)
