"""Experiment trackers (torchtrain.trackers, logging.report_to) with the real libraries, offline: MLflow's file store
read back with MlflowClient.get_metric_history holds every step once across a `kill -9` and the resume, with the
losses of metrics.jsonl and the resolved config as the run's parameters; TensorBoard's events, read with
TensorBoard's EventAccumulator, hold every step once across the same kill; Weights & Biases in offline mode, its
run files read with its own reader (wandb.sdk.internal.datastore), every step once across a resume; a tracker that
cannot start is refused in one line (exit 2) before the run folder exists; one that fails mid-run is named once
and the run trains to its end."""

from __future__ import annotations

import glob
import shutil
import time
from pathlib import Path

import pytest

from tests import forked
from tests.train.conftest import ENV, metrics, run_train, train_args

STEPS = 10
ARGS = (f"schedule.steps={STEPS}", "checkpoint.save_every=2", "checkpoint.keep_last=2", "eval.window=0",
        "logging.project=anchor-test")


def _env(tmp: Path, **extra: str) -> dict:
    return {**ENV, "MLFLOW_TRACKING_URI": f"file://{tmp}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true",
            "WANDB_MODE": "offline", "WANDB_SILENT": "true", **extra}


def _kill_after(out: Path, args: list[str], env: dict, lines: int) -> None:
    p = forked.Run(train_args(out, *args), env)
    path, deadline = out / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if path.is_file() and len(path.read_text().splitlines()) >= lines:
            break
        time.sleep(0.005)
    p.kill()
    p.wait()
    assert p.returncode == -9, f"the run ended by itself ({p.returncode}) before the kill"


def _mlflow_history(tmp: Path, run: Path, key: str = "loss") -> list:
    import json

    from mlflow.tracking import MlflowClient

    record = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=f"file://{tmp}/mlruns")
    return sorted(client.get_metric_history(record["run_id"], key), key=lambda m: m.step), client, record["run_id"]


def test_mlflow_and_tensorboard_hold_every_step_once_across_a_kill(packed, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    env = _env(tmp_path)
    out = tmp_path / "run"
    args = [*ARGS, f"data.path={packed}", "logging.report_to=[tensorboard,mlflow]"]
    _kill_after(out, args, env, 5)
    done = run_train(out, *args, env=env)
    want = {r["step"]: r["loss"] for r in metrics(out)}
    assert sorted(want) == list(range(1, STEPS + 1))
    history, client, run_id = _mlflow_history(tmp_path, out)
    assert [m.step for m in history] == list(range(1, STEPS + 1))  # each step once
    assert {m.step: m.value for m in history} == want
    params = client.get_run(run_id).data.params
    assert params["model.variant"] == "anchor" and params["schedule.steps"] == str(STEPS)
    assert client.get_run(run_id).info.status == "FINISHED"
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert "tracker" not in done.stderr


def _wandb_history(run: Path) -> list[tuple[int, dict]]:
    import json

    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    rows = []
    for f in sorted(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))):
        ds = datastore.DataStore()
        ds.open_for_scan(f)
        while (data := ds.scan_data()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                rows.append((rec.history.step.num, {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                                    for i in rec.history.item}))
    return rows


@pytest.mark.slow
def test_wandb_offline_holds_every_step_once_across_a_resume(packed, tmp_path):
    env = _env(tmp_path)
    out = tmp_path / "run"
    base = ["checkpoint.save_every=2", "eval.window=0", "logging.project=anchor-test", f"data.path={packed}",
            "logging.report_to=[wandb]", "logging.tensorboard=false"]
    run_train(out, *base, "schedule.steps=4", env=env)
    run_train(out, *base, "schedule.steps=8", env=env)
    rows = _wandb_history(out)
    want = {r["step"]: r for r in metrics(out)}
    assert [step for step, _ in rows] == list(range(1, 9))
    for step, items in rows:
        assert items["loss"] == want[step]["loss"] and items["mfu"] == want[step]["mfu"]


def test_a_tracker_that_cannot_start_is_refused_in_one_line(packed, tmp_path):
    out = tmp_path / "run"
    done = run_train(out, *ARGS, f"data.path={packed}", "logging.report_to=[mlflow]", check=False,
                     env=_env(tmp_path, MLFLOW_TRACKING_URI="file:///proc/no-such-store"))
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "logging.report_to mlflow: the tracking store file:///proc/no-such-store does not " \
                                "answer" in lines[0], done.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_named_once_and_the_run_goes_on(packed, tmp_path):
    import json

    env = _env(tmp_path)
    out = tmp_path / "run"
    steps = 40
    p = forked.Run(train_args(out, "schedule.steps=40", "checkpoint.save_every=0", "eval.window=0",
                              f"data.path={packed}", "logging.report_to=[mlflow]", "logging.tensorboard=false"), env)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if (out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.005)
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    shutil.rmtree(next((tmp_path / "mlruns").glob(f"*/{run_id}")))  # the store loses the run mid-training
    p.wait()
    assert p.returncode == 0, p.stderr()
    assert [r["step"] for r in metrics(out)] == list(range(1, steps + 1))
    failed = [line for line in p.stderr().splitlines() if "tracker mlflow failed at step" in line]
    assert len(failed) == 1, p.stderr()
