"""Experiment trackers (torchtrain.training.trackers, logging.report_to) with the real libraries, offline, each read back by
its own library: MLflow through MlflowClient.get_metric_history, TensorBoard through its EventAccumulator, Weights &
Biases' offline run files through its own reader (wandb.sdk.internal.datastore), as `wandb sync` would find them.
Across `kill -9`s and their resumes each holds every step once, with metrics.jsonl's values (TensorBoard every
number of every line); a resume that trains steps again replaces what a tracker held of them. MLflow with no
environment set trains (MLflow's default store); W&B keeps to its own environment (WANDB_DIR) and is quiet.
A tracker that cannot start is refused in one line (exit 2) before the run folder exists; one that fails mid-run
is named once and the run trains to its end."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from tests import forked
from tests.train.conftest import ENV, kill_when, metrics, run_train, train_args

STEPS = 10
ARGS = (f"schedule.steps={STEPS}", "checkpoint.save_every=2", "checkpoint.keep_last=2", "eval.window=0",
        "logging.project=anchor-test")
ALL = "logging.report_to=[mlflow,wandb,tensorboard]"


@pytest.fixture(autouse=True)
def _read_mlflow_file_stores(monkeypatch):
    """The tests read the runs' MLflow file stores (MLflow 3 opens one only when asked to)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def _env(tmp: Path, **extra: str) -> dict:
    return {**ENV, "MLFLOW_TRACKING_URI": f"file://{tmp}/mlruns", "MLFLOW_ALLOW_FILE_STORE": "true",
            "WANDB_MODE": "offline", **extra}


def _lines(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _numbers(row: dict) -> dict[str, float]:
    """Every number of a metrics.jsonl line but `step`, a list's items as `<key>/<i>` (what every tracker logs)."""
    out = {}
    for key, value in row.items():
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and key != "step":
                out[key if i is None else f"{key}/{i}"] = float(v)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Each tracker read by its own library

def _mlflow_steps(out: Path, uri: str) -> tuple[dict[str, list[tuple[int, float]]], object, str]:
    """key -> [(step, value)] of the MLflow run trackers.json names, sorted by step; the client and the run id."""
    from mlflow.tracking import MlflowClient

    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=uri)
    keys = client.get_run(run_id).data.metrics
    history = {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}
    return history, client, run_id


def _tensorboard_steps(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _wandb_history(root: Path) -> list[tuple[int, dict]]:
    """The history rows of the offline W&B runs under `root`/wandb, in the order `wandb sync` finds them."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    rows = []
    for f in sorted(glob.glob(str(root / "wandb" / "offline-run-*" / "run-*.wandb"))):
        ds = datastore.DataStore()
        ds.open_for_scan(f)
        while (data := ds.scan_data()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
                rows.append((rec.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows


def _by_key(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as key -> [(step, value)]: what each tracker must hold."""
    want: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in _numbers(row).items():
            want.setdefault(key, []).append((row["step"], value))
    return want


def _assert_trackers_hold_metrics(out: Path, mlflow_uri: str, wandb_root: Path | None = None) -> None:
    """Each tracker holds each step of metrics.jsonl once, with its every number (TensorBoard: as float32)."""
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    want = _by_key(rows)
    history, _, _ = _mlflow_steps(out, mlflow_uri)
    assert history == want, "MLflow"
    board = _tensorboard_steps(out)
    assert set(board) == {f"train/{k}" for k in want}, "TensorBoard's tags"
    for key, values in want.items():
        got = board[f"train/{key}"]
        assert [s for s, _ in got] == [s for s, _ in values], f"TensorBoard's steps of {key}"
        assert [v for _, v in got] == pytest.approx([v for _, v in values], rel=1e-6), f"TensorBoard's {key}"
    logged = _wandb_history(wandb_root or out)
    assert [step for step, _ in logged] == [r["step"] for r in rows], "W&B's steps"
    for (step, items), row in zip(logged, rows):
        assert items == _numbers(row), f"W&B's step {step}"


# ---------------------------------------------------------------------------------------------------------------
# Kills and resumes

def test_every_tracker_holds_every_step_once_across_a_kill(packed, tmp_path):
    """Killed after step 5 (checkpoint at 4): MLflow held step 5 and W&B's offline file nothing (W&B writes 32 KiB
    blocks); after the resume each holds steps 1-10 once with metrics.jsonl's values, the retrained step 5's
    timings included, and TensorBoard every number of every line."""
    env = _env(tmp_path)
    out = tmp_path / "run"
    args = [*ARGS, f"data.path={packed}", ALL]
    # once MLflow holds step 5 (its file store's `loss` file: a line a step), before the checkpoint of step 6
    losses = str(tmp_path / "mlruns" / "*" / "*" / "metrics" / "loss")
    kill_when(train_args(out, *args), lambda: any(len(Path(f).read_text().splitlines()) >= 5 for f in glob.glob(losses)),
              env=env, what="after 5 steps")
    killed = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    done = run_train(out, *args, env=env)
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))
    _assert_trackers_hold_metrics(out, f"file://{tmp_path}/mlruns")
    history, client, run_id = _mlflow_steps(out, f"file://{tmp_path}/mlruns")
    assert run_id != killed and f"MLflow run {killed} holds step" in done.stderr  # replaced: it held step 5
    assert client.get_run(killed).info.lifecycle_stage == "deleted"
    assert client.get_run(killed).data.tags["anchor.replaced_by"] == run_id
    params = client.get_run(run_id).data.params
    assert params["model.variant"] == "anchor" and params["schedule.steps"] == str(STEPS)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert "failed at step" not in done.stderr


@pytest.mark.slow
def test_every_tracker_holds_every_step_once_across_kills_at_five_moments(packed, tmp_path):
    """One run killed at five moments in turn, each resumed with the same command: right after the trackers open,
    after steps 1 and 3, past step 5, while a checkpoint is written; the last resume trains to the end. (A moment
    is counted in metrics.jsonl's lines, which a resume cuts back only once it starts: each moment lies past the
    one before.)"""
    env = _env(tmp_path)
    out = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith("schedule.steps=")] + ["schedule.steps=12", f"data.path={packed}", ALL]
    staging = str(out / "checkpoints" / ".step-*.tmp")
    writing: list[bool] = []
    launched = [0.0]

    def checkpoint_written() -> bool:
        def new(path: str) -> bool:  # not one a killed attempt left (the resume removes those)
            try:
                return os.stat(path).st_mtime > launched[0]
            except FileNotFoundError:
                return False
        if any(new(p) for p in glob.glob(staging)):
            writing.append(True)
            return True
        return _lines(out) >= 11  # the checkpoints of steps 6, 8 and 10 each written between two polls

    moments = [("right after the trackers open", lambda: bool(glob.glob(str(out / "wandb" / "offline-run-*")))),
               ("after step 1", lambda: _lines(out) >= 1),
               ("after step 3", lambda: _lines(out) >= 3),
               ("past step 5", lambda: _lines(out) >= 6),
               ("while a checkpoint is written", checkpoint_written)]
    for what, ready in moments:
        launched[0] = time.time()
        kill_when(train_args(out, *args), ready, env=env, what=what)
    print(f"killed while a checkpoint was written: {bool(writing)}")
    run_train(out, *args, env=env)
    assert [r["step"] for r in metrics(out)] == list(range(1, 13))
    _assert_trackers_hold_metrics(out, f"file://{tmp_path}/mlruns")


@pytest.mark.slow
def test_a_resume_that_trains_steps_again_replaces_them_in_every_tracker(packed, tmp_path):
    """A finished run whose last checkpoints are gone trains steps 5-8 again: W&B's finished offline file and
    MLflow's run hold them from the first attempt, so both are replaced (the W&B folder moved out of `wandb sync`'s
    reach, a new MLflow run) and every tracker ends with metrics.jsonl's values."""
    env = _env(tmp_path)
    out = tmp_path / "run"
    args = ["schedule.steps=8", "checkpoint.save_every=4", "checkpoint.keep_last=0", "eval.window=0",
            "logging.project=anchor-test", f"data.path={packed}", ALL]
    run_train(out, *args, env=env)
    assert [s for s, _ in _wandb_history(out)] == list(range(1, 9))
    shutil.rmtree(out / "checkpoints" / "step-8")
    done = run_train(out, *args, env=env)
    assert "dropping steps 5-8" in done.stderr
    assert "its earlier folders are moved to" in done.stderr
    assert len(glob.glob(str(out / "wandb" / "anchor-replaced" / "offline-run-*"))) == 1
    _assert_trackers_hold_metrics(out, f"file://{tmp_path}/mlruns")


@pytest.mark.slow
def test_wandb_offline_holds_every_step_once_across_a_resume(packed, tmp_path):
    """A finished run resumed for more steps: W&B's first folder holds steps 1-4 and is kept; the resume's holds
    5-8."""
    env = _env(tmp_path)
    out = tmp_path / "run"
    base = ["checkpoint.save_every=2", "eval.window=0", "logging.project=anchor-test", f"data.path={packed}",
            "logging.report_to=[wandb]"]
    run_train(out, *base, "schedule.steps=4", env=env)
    run_train(out, *base, "schedule.steps=8", env=env)
    rows = _wandb_history(out)
    want = {r["step"]: r for r in metrics(out)}
    assert [step for step, _ in rows] == list(range(1, 9))
    assert len(glob.glob(str(out / "wandb" / "offline-run-*"))) == 2
    for step, items in rows:
        assert items == _numbers(want[step])


# ---------------------------------------------------------------------------------------------------------------
# Each tracker's own environment

@pytest.mark.slow
def test_mlflow_with_no_environment_and_wandb_in_its_own_dir_train_quietly(packed, tmp_path):
    """No MLFLOW_* variable: MLflow's default store, sqlite:///mlflow.db in the working folder, named in the run
    log. WANDB_DIR: W&B's files there, not in the run folder; no WANDB_SILENT: W&B's banner stays quiet."""
    env = {k: v for k, v in ENV.items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wdir"))
    (tmp_path / "wdir").mkdir()
    out = tmp_path / "run"
    argv = train_args(out, "schedule.steps=3", "checkpoint.save_every=0", "eval.window=0",
                      "logging.project=anchor-test", f"data.path={packed}", "logging.report_to=[mlflow,wandb]")
    done = forked.run(argv, env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert f"(experiment 'anchor-test') at {uri}" in done.stderr  # MLflow's absolute form: sqlite:////PATH
    history, _, _ = _mlflow_steps(out, uri)
    assert history == _by_key(metrics(out))
    assert not (out / "wandb").exists()
    assert [s for s, _ in _wandb_history(tmp_path / "wdir")] == [1, 2, 3]
    banner = [line for line in done.stderr.splitlines() if line.startswith("wandb:")]
    assert len(banner) == 1 and banner[0].startswith("wandb: offline run"), done.stderr


# ---------------------------------------------------------------------------------------------------------------
# Refusals: one line, exit 2, before the run folder exists

def _refused(done, out: Path, *phrases: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and all(p in lines[0] for p in phrases), done.stderr
    assert not out.exists()


def test_a_tracker_that_cannot_start_is_refused_in_one_line(packed, tmp_path):
    out = tmp_path / "run"
    done = run_train(out, *ARGS, f"data.path={packed}", "logging.report_to=[mlflow]", check=False,
                     env=_env(tmp_path, MLFLOW_TRACKING_URI="file:///proc/no-such-store"))
    _refused(done, out, "logging.report_to mlflow: the tracking store file:///proc/no-such-store does not answer")


def test_a_wandb_project_name_wandb_refuses_is_refused_before_any_work(packed, tmp_path):
    out = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith("logging.project=")]
    done = run_train(out, *args, f"data.path={packed}", "logging.report_to=[wandb]", "logging.project=a/b",
                     check=False, env=_env(tmp_path))
    _refused(done, out, "logging.project: W&B refuses it as a project name", "'a/b'")


@pytest.fixture
def trackers_env(monkeypatch, tmp_path):
    """An environment with no tracker variable and a home of its own (no ~/.netrc)."""
    for k in list(os.environ):
        if k.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("NETRC", raising=False)
    return monkeypatch


def _cfg(*overrides: str):
    from tests.train.conftest import TINY
    from torchtrain.config import load_train_config

    return load_train_config(TINY, ["logging.project=anchor-test", *overrides])


def test_wandb_online_without_a_login_is_refused_with_the_online_hint(trackers_env, tmp_path):
    from anchor_core.errors import InputError
    from torchtrain.training.tracker_checks import check_trackers

    with pytest.raises(InputError) as e:
        check_trackers(_cfg("logging.report_to=[wandb]"))
    assert "W&B logs online" in str(e.value) and "wandb login" in str(e.value) and "WANDB_MODE=offline" in str(e.value)
    trackers_env.setenv("WANDB_MODE", "offline")  # offline: no login needed
    check_trackers(_cfg("logging.report_to=[wandb]"))
    trackers_env.delenv("WANDB_MODE")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    os.chmod(tmp_path / "home" / ".netrc", 0o600)
    check_trackers(_cfg("logging.report_to=[wandb]"))  # `wandb login`'s entry


def test_an_mlflow_server_that_never_answers_is_refused_within_seconds(trackers_env):
    from anchor_core.errors import InputError
    from torchtrain.training.tracker_checks import PROBE_TIMEOUT_S, check_trackers

    with socket.socket() as server:  # accepts connections (the kernel's backlog) and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        trackers_env.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.getsockname()[1]}")
        t0 = time.time()
        with pytest.raises(InputError, match="does not answer within"):
            check_trackers(_cfg("logging.report_to=[mlflow]"))
        assert time.time() - t0 < 3 * PROBE_TIMEOUT_S
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # MLflow's own settings back for the run


def test_mlflow_default_store_without_sqlalchemy_names_the_extra(trackers_env, tmp_path):
    """mlflow-skinny alone cannot open MLflow's default store: the one line names the extra that can."""
    from anchor_core.errors import InputError
    from torchtrain.training.tracker_checks import check_trackers

    trackers_env.chdir(tmp_path)
    trackers_env.setitem(sys.modules, "sqlalchemy", None)  # not installed
    with pytest.raises(InputError, match=r"logging.report_to mlflow with the store sqlite:///.*mlflow.db needs the "
                                         r"trackers extra \(sqlalchemy is not installed\)"):
        check_trackers(_cfg("logging.report_to=[mlflow]"))


def test_report_to_takes_a_list_of_trackers_or_one_name(trackers_env):
    from anchor_core.errors import InputError

    assert _cfg("logging.report_to=tensorboard").logging.report_to == ("tensorboard",)
    assert _cfg("logging.report_to=[mlflow,mlflow]").logging.report_to == ("mlflow",)  # once
    for bad in ("[comet]", "comet", "3"):
        with pytest.raises(InputError, match=r"logging\.report_to: expected a list among tensorboard, wandb, "
                                             r"mlflow \(or one name\)"):
            _cfg(f"logging.report_to={bad}")
    # the older key, read into report_to
    assert _cfg("logging.tensorboard=false").logging.report_to == ()
    assert _cfg("logging.tensorboard=false", "logging.report_to=[wandb,tensorboard]").logging.report_to == ("wandb",)
    assert _cfg("logging.tensorboard=true", "logging.report_to=[wandb]").logging.report_to == ("wandb",)
    assert _cfg("logging.tensorboard=false").to_dict()["logging"]["tensorboard"] is None


def test_every_number_of_a_line_is_logged():
    from torchtrain.training.trackers import scalars

    row = {"step": 3, "loss": 2.5, "tokens": 40, "ok": True, "heldout_loss_by_position": [1.5, None, 2.0],
           "ranks_peak_memory_gib": [0.5, 0.6], "nested": {"a": 1, "b": {"c": 2.0}}, "nan": float("nan"), "x": None}
    assert scalars(row) == {"loss": 2.5, "tokens": 40.0, "heldout_loss_by_position/0": 1.5,
                            "heldout_loss_by_position/2": 2.0, "ranks_peak_memory_gib/0": 0.5,
                            "ranks_peak_memory_gib/1": 0.6, "nested/a": 1.0, "nested/b/c": 2.0}


@pytest.mark.slow
def test_a_tracker_failing_mid_run_is_named_once_and_the_run_goes_on(packed, tmp_path):
    env = _env(tmp_path)
    out = tmp_path / "run"
    steps = 40
    p = forked.Run(train_args(out, "schedule.steps=40", "checkpoint.save_every=0", "eval.window=0",
                              f"data.path={packed}", "logging.report_to=[mlflow]"), env)
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
