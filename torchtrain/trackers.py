"""Experiment trackers: each step's metrics in Weights & Biases and MLflow besides RUN/metrics.jsonl and TensorBoard
(`logging.report_to`, `logging.project`), through each tracker's own client.

    check_trackers(cfg)          prepare_run, before the run folder is touched: each named tracker's package is
                                 installed and MLflow's tracking store answers, else one line (exit 2)
    prepare_trackers(cfg, run)   prepare_run, once config.yaml is written: the tracker runs this run logs in,
                                 made once and recorded in RUN/trackers.json (an MLflow run holding the resolved
                                 config as its parameters; a W&B run id), reused by every resume
    Trackers(cfg, run)           rank 0 of the worker: opens them (a W&B run that cannot start stops the run
                                 before its first step, in one line), `log(row)` each step, `close()`

TensorBoard stays with metrics.jsonl (torchtrain.metrics.MetricsLog: torch's SummaryWriter, which drops the steps
past a resume's checkpoint as it opens).

Every step is logged once, across kills and resumes. MLflow: the steps the run already holds are read back from
it (the history of `loss`, logged first) and skipped. W&B: RUN/trackers.json records the last step handed to it,
and a resume skips up to there (W&B itself keeps the first value it got for a step). A resumed fp32 run logs the
same values for the steps it trains again, so what the tracker holds equals metrics.jsonl.

A tracker that fails while the run trains (a server gone, a full disk) is named once on stderr with the step and
the error, and dropped; the training goes on and metrics.jsonl holds every step.

Logged: every number of a metrics.jsonl line (not the per-rank lists of the first line); the held-out loss by
slot range as `heldout_loss_by_position/<b>`.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from anchor_core.extras import missing_extra
from torchtrain.config import TrainConfig

TRACKERS_FILE = "trackers.json"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def check_trackers(cfg: TrainConfig) -> None:
    """Each tracker of logging.report_to installed, and MLflow's tracking store reachable; one line otherwise."""
    where = cfg.where("logging.report_to")
    for name in cfg.logging.report_to:
        if name == "tensorboard" and not cfg.logging.tensorboard:
            continue  # logging.tensorboard: false writes no events
        try:
            __import__(name)  # each tracker's package is named as the tracker
        except ModuleNotFoundError as e:
            raise InputError(missing_extra(e, f"logging.report_to {name}") or _one_line(e), path=where) from None
    if "mlflow" in cfg.logging.report_to:
        _mlflow_client(where)


def _mlflow_client(where: str) -> Any:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = mlflow.get_tracking_uri()
    try:
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 -- any failure of the store is the one line
        raise InputError(f"logging.report_to mlflow: the tracking store {uri} does not answer ({_one_line(e)}); set "
                         "MLFLOW_TRACKING_URI to a tracking server (http://...) or a file store (file:///..., with "
                         "MLFLOW_ALLOW_FILE_STORE=true)", path=where) from None
    return client


def read_state(run: Path) -> dict[str, Any]:
    path = run / TRACKERS_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the trackers' record ({_one_line(e)}); fix or remove it", path=path) from None
    if not isinstance(state, dict):
        raise InputError("the trackers' record is not a JSON object; fix or remove it", path=path)
    return state


def _write_state(run: Path, state: dict[str, Any]) -> None:
    write_text_atomic(run / TRACKERS_FILE, json.dumps(state, indent=1) + "\n")


def flat_config(cfg: TrainConfig) -> dict[str, Any]:
    """The resolved config as dotted keys (`model.rope` and `data.pack` stay whole, as text)."""
    out: dict[str, Any] = {}
    for section, keys in cfg.to_dict().items():
        for key, value in (keys.items() if isinstance(keys, dict) else []):
            out[f"{section}.{key}"] = value if isinstance(value, (bool, int, float, str)) or value is None \
                else json.dumps(value)
    return out


def prepare_trackers(cfg: TrainConfig, run: Path) -> None:
    """The tracker runs of this run, made once and recorded in RUN/trackers.json (module docstring)."""
    state = read_state(run)
    where = cfg.where("logging.report_to")
    if "mlflow" in cfg.logging.report_to and "mlflow" not in state:
        from mlflow.entities import Param

        client = _mlflow_client(where)
        try:
            found = client.get_experiment_by_name(cfg.logging.project)
            experiment = found.experiment_id if found else client.create_experiment(cfg.logging.project)
            made = client.create_run(experiment, run_name=run.name, tags={"anchor.run_folder": str(run.resolve())})
            params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                client.log_batch(made.info.run_id, params=params[i:i + 100])
        except Exception as e:  # noqa: BLE001
            raise InputError(f"logging.report_to mlflow: cannot make the run ({_one_line(e)})", path=where) from None
        state["mlflow"] = {"run_id": made.info.run_id, "tracking_uri": client.tracking_uri}
    if "wandb" in cfg.logging.report_to and "wandb" not in state:  # W&B run ids: lowercase letters and digits
        state["wandb"] = {"id": secrets.token_hex(4), "config_logged": False, "logged_upto": 0}
    _write_state(run, state)


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl line (module docstring)."""
    out = {k: float(v) for k, v in row.items()
           if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    for b, v in enumerate(row.get("heldout_loss_by_position") or []):
        if v is not None:
            out[f"heldout_loss_by_position/{b}"] = float(v)
    return out


class Trackers:
    """The W&B and MLflow runs of RUN/trackers.json, opened on rank 0 (module docstring)."""

    def __init__(self, cfg: TrainConfig, run: Path):
        self.run, self.state = run, read_state(run)
        self.mlflow: Any = None
        self.wandb: Any = None
        self.mlflow_upto = self.wandb_upto = 0
        names = cfg.logging.report_to
        if "mlflow" in names:
            from mlflow.tracking import MlflowClient

            record = self.state["mlflow"]
            self.mlflow = (MlflowClient(tracking_uri=record["tracking_uri"]), record["run_id"])
            try:
                held = self.mlflow[0].get_metric_history(self.mlflow[1], "loss")
            except Exception as e:  # noqa: BLE001
                raise InputError(f"logging.report_to mlflow: cannot open run {record['run_id']} at "
                                 f"{record['tracking_uri']} ({_one_line(e)})", path=run / TRACKERS_FILE) from None
            self.mlflow_upto = max((m.step for m in held), default=0)
        if "wandb" in names:
            self._open_wandb(cfg)

    def _open_wandb(self, cfg: TrainConfig) -> None:
        import wandb

        record = self.state["wandb"]
        try:
            self.wandb = wandb.init(project=cfg.logging.project, id=record["id"], resume="allow", dir=str(self.run),
                                    name=self.run.name, config=None if record["config_logged"] else flat_config(cfg))
        except Exception as e:  # noqa: BLE001
            raise InputError(f"logging.report_to wandb: cannot start run {record['id']} ({_one_line(e)}); "
                             "`wandb login`, or WANDB_MODE=offline", path=self.run / TRACKERS_FILE) from None
        record["config_logged"] = True
        self.wandb_upto = int(record.get("logged_upto", 0))
        _write_state(self.run, self.state)

    def log(self, row: dict[str, Any]) -> None:
        step, values = int(row["step"]), scalars(row)
        if self.mlflow is not None and step > self.mlflow_upto:
            self._send("mlflow", step, lambda: self._mlflow_log(step, values))
        if self.wandb is not None and step > self.wandb_upto:
            self._send("wandb", step, lambda: self.wandb.log(values, step=step))
            if self.wandb is not None:
                self.state["wandb"]["logged_upto"] = self.wandb_upto = step
                _write_state(self.run, self.state)

    def _mlflow_log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        client, run_id = self.mlflow
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def _send(self, name: str, step: int, send: Any) -> None:
        try:
            send()
        except Exception as e:  # noqa: BLE001 -- a tracker never stops the training
            print(f"anchor train: tracker {name} failed at step {step} ({_one_line(e)}); training goes on without it "
                  f"(metrics.jsonl holds every step)", file=sys.stderr, flush=True)
            setattr(self, name, None)

    def close(self, finished: bool) -> None:
        if self.mlflow is not None and finished:
            self._send("mlflow", -1, lambda: self.mlflow[0].set_terminated(self.mlflow[1], "FINISHED"))
        if self.wandb is not None:
            self._send("wandb", -1, lambda: self.wandb.finish())
