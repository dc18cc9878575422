"""Experiment trackers: each step's metrics in TensorBoard, Weights & Biases and MLflow besides RUN/metrics.jsonl
(`logging.report_to`, `logging.project`), through each tracker's own client.

    check_trackers(cfg)              prepare_run, before the run folder is touched: each named tracker's package
                                     installed, the W&B project name one W&B takes and a W&B login when W&B is
                                     online, MLflow's tracking store answering within PROBE_TIMEOUT_S; else one
                                     line (exit 2)
    prepare_trackers(cfg, run)       prepare_run, once config.yaml is written: the tracker runs this run logs in,
                                     made once and recorded in RUN/trackers.json (an MLflow run holding the
                                     resolved config as its parameters; a W&B run id), reused by every resume
    Trackers(cfg, run, start)        rank 0 of the worker, once metrics.jsonl holds steps 1..start: opens them,
                                     brings each to step `start`, `log(row)` each step, `close()`

metrics.jsonl is the truth: after a resume each tracker holds each of its steps once, with its values.
Nothing a tracker was handed before a kill is taken for held: each is asked what it holds when the run opens it.

- TensorBoard (RUN/tensorboard/): its writer is flushed each step, and opened with `purge_step=start + 1`, so
  that TensorBoard's readers drop what an earlier attempt logged past `start`.
- MLflow: the histories of the run's metrics say which steps it holds. Steps 1..H once each, H <= start: the
  steps H+1..start are sent from metrics.jsonl. Otherwise (steps past `start`, which this resume trains again,
  or a step held twice or in part) the run is replaced, as MLflow keeps every value it was given: a new run in
  the experiment, under the same name, with the config and steps 1..start from metrics.jsonl; the old one is
  tagged `anchor.replaced_by` and deleted (MLflow's trash: `mlflow gc` purges it, `mlflow runs restore`
  brings it back).
- W&B offline: its own files say which steps it holds (W&B writes them in 32 KiB blocks, so a killed process
  leaves only what filled a block). Steps 1..H once each, H <= start: H+1..start are sent again from
  metrics.jsonl. Otherwise the earlier attempts' folders of the run are moved into `<wandb dir>/anchor-replaced/`
  (out of `wandb sync`'s reach) and steps 1..start are sent again.
- W&B online: the server's step says which it holds (resume); H+1..start are sent. W&B's history only grows:
  steps past `start` it already holds keep the killed attempt's values, and the run's summary names them
  (`anchor/steps_from_a_killed_attempt`).

A tracker that fails while the run trains (a server gone, a full disk) is named once on stderr with the step and
the error, and dropped; the training goes on and metrics.jsonl holds every step.

Logged: every number of a metrics.jsonl line but `step`, a list's or a mapping's items under `<key>/<i>` (the
held-out loss by slot range as `heldout_loss_by_position/<b>`, the first line's per-rank lists as
`ranks_peak_memory_gib/<rank>`); TensorBoard's tags are `train/<key>`.

Each tracker's own environment variables apply (MLFLOW_TRACKING_URI and its credentials, WANDB_MODE, WANDB_DIR,
WANDB_NAME, WANDB_ENTITY, WANDB_SILENT ...). Unset: MLflow's default store, sqlite:///mlflow.db in the working
folder; W&B's files under RUN/wandb/, its console output silenced.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable

from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from torchtrain.config import TrainConfig
from torchtrain.training.metrics import read_metrics
from torchtrain.training.tracker_checks import mlflow_client, one_line, wandb_settings

TRACKERS_FILE = "trackers.json"
MLFLOW_BATCH = 1000  # MLflow takes at most 1000 metrics and 100 parameters a call
REPLACED_DIR = "anchor-replaced"


# ---------------------------------------------------------------------------------------------------------------
# RUN/trackers.json

def read_state(run: Path) -> dict[str, Any]:
    path = run / TRACKERS_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the trackers' record ({one_line(e)}); fix or remove it", path=path) from None
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


def _new_mlflow_run(client: Any, experiment: str, cfg: TrainConfig, run: Path, tags: dict[str, str]) -> str:
    """An MLflow run of `run` in `experiment`, the resolved config as its parameters; its id."""
    from mlflow.entities import Param

    made = client.create_run(experiment, run_name=run.name, tags={"anchor.run_folder": str(run.resolve()), **tags})
    params = [Param(k, str(v)) for k, v in flat_config(cfg).items()]
    for i in range(0, len(params), 100):
        client.log_batch(made.info.run_id, params=params[i:i + 100])
    return made.info.run_id


def prepare_trackers(cfg: TrainConfig, run: Path) -> None:
    """The tracker runs of this run, made once and recorded in RUN/trackers.json (module docstring)."""
    state = read_state(run)
    where = cfg.where("logging.report_to")
    if "mlflow" in cfg.logging.report_to and "mlflow" not in state:
        client = mlflow_client(where)
        try:
            found = client.get_experiment_by_name(cfg.logging.project)
            experiment = found.experiment_id if found else client.create_experiment(cfg.logging.project)
            run_id = _new_mlflow_run(client, experiment, cfg, run, {})
        except Exception as e:  # noqa: BLE001
            raise InputError(f"logging.report_to mlflow: cannot make the run ({one_line(e)})", path=where) from None
        state["mlflow"] = {"run_id": run_id, "tracking_uri": client.tracking_uri}
    if "wandb" in cfg.logging.report_to and "wandb" not in state:  # W&B run ids: lowercase letters and digits
        state["wandb"] = {"id": secrets.token_hex(4)}
    _write_state(run, state)


# ---------------------------------------------------------------------------------------------------------------
# What is logged

def scalars(row: dict[str, Any]) -> dict[str, float]:
    """Every number of a metrics.jsonl line but `step` (a finite one: metrics.jsonl has null for the others), the
    items of lists and mappings as `<key>/<i>`."""
    out: dict[str, float] = {}

    def walk(key: str, value: Any) -> None:
        if isinstance(value, bool) or value is None or isinstance(value, float) and not math.isfinite(value):
            return  # metrics.jsonl writes a number that is not finite as null
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{key}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{key}/{i}", v)

    for key, value in row.items():
        if key != "step":
            walk(key, value)
    return out


def _span(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def wandb_steps(path: Path) -> list[int]:
    """The steps of the history records of a W&B .wandb file, in order, read by W&B's own reader (a record cut by
    a kill ends the reading)."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    steps = []
    store = datastore.DataStore()
    store.open_for_scan(str(path))
    try:
        while (data := store.scan_data()) is not None:
            record = pb.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                steps.append(record.history.step.num)
    finally:
        store.close()
    return steps


class Trackers:
    """The trackers of logging.report_to, opened on rank 0 at step `start` (module docstring)."""

    def __init__(self, cfg: TrainConfig, run: Path, start: int):
        self.cfg, self.run, self.start, self.state = cfg, run, start, read_state(run)
        self.tensorboard: Any = None
        self.mlflow: Any = None
        self.wandb: Any = None
        self.upto: dict[str, int] = {}  # tracker -> the last step it holds: it is sent the later ones
        self._kept: list[dict[str, Any]] | None = None
        names = cfg.logging.report_to
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run / "tensorboard"), purge_step=start + 1)
            self.upto["tensorboard"] = start  # flushed each step; the steps past `start` purged
        if "mlflow" in names:
            self._open_mlflow()
        if "wandb" in names:
            self._open_wandb()

    def _kept_rows(self, after: int) -> list[dict[str, Any]]:
        """metrics.jsonl's lines of steps after+1..start (the file holds steps 1..start when the trackers open)."""
        if self._kept is None:
            self._kept = read_metrics(self.run)[:self.start]
        return self._kept[after:]

    def _catch_up(self, name: str, held: int, send: Callable[[list[dict[str, Any]]], None]) -> None:
        """A tracker holding steps 1..held is sent held+1..start from metrics.jsonl."""
        self.upto[name] = max(held, self.start)
        if held < self.start:
            self._send(name, self.start, lambda: send(self._kept_rows(held)))

    # MLflow ------------------------------------------------------------------------------------------------------

    def _open_mlflow(self) -> None:
        from mlflow.tracking import MlflowClient

        record = self.state["mlflow"]
        client = MlflowClient(tracking_uri=record["tracking_uri"])
        try:
            held = _mlflow_held(client, record["run_id"])
            if held is None or held > self.start:
                record, held = self._replace_mlflow(client, record, held), 0
        except Exception as e:  # noqa: BLE001
            raise InputError(f"logging.report_to mlflow: cannot open run {record['run_id']} at "
                             f"{record['tracking_uri']} ({one_line(e)})", path=self.run / TRACKERS_FILE) from None
        self.mlflow = (client, record["run_id"])
        print(f"mlflow: run {record['run_id']} (experiment {self.cfg.logging.project!r}) at {record['tracking_uri']}",
              file=sys.stderr, flush=True)
        self._catch_up("mlflow", held, self._mlflow_log)

    def _replace_mlflow(self, client: Any, record: dict[str, Any], held: int | None) -> dict[str, Any]:
        """A new MLflow run in place of `record`'s (module docstring); recorded in trackers.json before the old one is
        deleted."""
        old = record["run_id"]
        experiment = client.get_run(old).info.experiment_id
        new = _new_mlflow_run(client, experiment, self.cfg, self.run, {"anchor.replaces": old})
        self.state["mlflow"] = record = {**record, "run_id": new}
        _write_state(self.run, self.state)
        why = f"holds {_span(self.start + 1, held)}, which this resume trains again" if held is not None else \
            "holds a step twice or in part (a kill while it was logging)"
        print(f"anchor train: MLflow run {old} {why}; MLflow keeps every value it is given, so run {new} replaces it "
              f"with metrics.jsonl's steps (run {old} is deleted: MLflow's trash)", file=sys.stderr, flush=True)
        client.set_tag(old, "anchor.replaced_by", new)
        client.set_terminated(old, "KILLED")
        client.delete_run(old)
        return record

    def _mlflow_log(self, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        client, run_id = self.mlflow
        now = int(time.time() * 1000)
        batch: list[Any] = []
        for row in rows:
            step, values = int(row["step"]), scalars(row)
            loss = values.pop("loss", None)
            # `loss` last: a step whose loss the run holds holds all of its metrics (_mlflow_held)
            metrics = [Metric(k, v, now, step) for k, v in values.items()]
            metrics += [] if loss is None else [Metric("loss", loss, now, step)]
            if len(batch) + len(metrics) > MLFLOW_BATCH:
                for i in range(0, len(batch), MLFLOW_BATCH):
                    client.log_batch(run_id, metrics=batch[i:i + MLFLOW_BATCH])
                batch = []
            batch += metrics
        for i in range(0, len(batch), MLFLOW_BATCH):
            client.log_batch(run_id, metrics=batch[i:i + MLFLOW_BATCH])

    # W&B ---------------------------------------------------------------------------------------------------------

    def _open_wandb(self) -> None:
        import wandb

        record = self.state["wandb"]
        offline = wandb_settings().mode in ("offline", "dryrun")
        args: dict[str, Any] = {"project": self.cfg.logging.project, "id": record["id"]}
        if not offline:  # W&B resumes a run on its server; offline, each attempt writes a folder of its own
            args["resume"] = "allow"
        if "WANDB_DIR" not in os.environ:
            args["dir"] = str(self.run)
        if "WANDB_NAME" not in os.environ:
            args["name"] = self.run.name
        if not {"WANDB_SILENT", "WANDB_QUIET"} & set(os.environ):  # W&B's banner and notes, unless asked for
            args["settings"] = wandb.Settings(silent=True)
        try:
            run = wandb.init(**args)
            run.config.update(flat_config(self.cfg), allow_val_change=True)  # this attempt's resolved config
        except Exception as e:  # noqa: BLE001
            hint = "" if offline else "; `wandb login`, or WANDB_MODE=offline"
            raise InputError(f"logging.report_to wandb: cannot start run {record['id']} ({one_line(e)}){hint}",
                             path=self.run / TRACKERS_FILE) from None
        self.wandb = run
        if run.disabled:
            self.upto["wandb"] = self.start
            return
        if run.offline:
            held = self._wandb_offline_held(run)
            print(f"wandb: offline run {record['id']} in {run.sync_dir} (`wandb sync` uploads it)", file=sys.stderr,
                  flush=True)
        else:
            held = max(0, int(run.starting_step) - 1)
            print(f"wandb: {run.url}", file=sys.stderr, flush=True)
            if held > self.start:
                kept = _span(self.start + 1, held)
                run.summary["anchor/steps_from_a_killed_attempt"] = kept
                print(f"anchor train: W&B run {record['id']} holds {kept} from a killed attempt; W&B's history only "
                      "grows, so they keep that attempt's values (metrics.jsonl holds this one's)", file=sys.stderr,
                      flush=True)
        self._catch_up("wandb", held, self._wandb_log)

    def _wandb_offline_held(self, run: Any) -> int:
        """The steps 1..H the earlier attempts' offline folders of this W&B run hold; H, or 0 after moving them out
        of `wandb sync`'s reach when they hold steps past `start`, a step twice, or cannot be read."""
        root, current = Path(run.settings.wandb_dir), Path(run.sync_dir).resolve()
        folders = sorted(d for d in root.glob(f"offline-run-*-{run.id}*") if d.is_dir() and d.resolve() != current)
        steps: list[int] = []
        try:
            for folder in folders:
                for f in sorted(folder.glob("run-*.wandb")):
                    steps += wandb_steps(f)
            ok, why = steps == list(range(1, len(steps) + 1)), "a step twice or out of order"
        except Exception as e:  # noqa: BLE001 -- a file W&B's reader refuses is replaced
            ok, why = False, f"a file W&B cannot read ({one_line(e)})"
        if ok and len(steps) > self.start:
            ok, why = False, f"{_span(self.start + 1, len(steps))}, which this resume trains again"
        if ok:
            return len(steps)
        aside = root / REPLACED_DIR
        aside.mkdir(exist_ok=True)
        for folder in folders:
            os.replace(folder, aside / folder.name)
        print(f"anchor train: the offline W&B run {run.id} holds {why}; its earlier folders are moved to {aside} and "
              "it is sent metrics.jsonl's steps again", file=sys.stderr, flush=True)
        return 0

    def _wandb_log(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.wandb.log(scalars(row), step=int(row["step"]), commit=True)

    # TensorBoard -------------------------------------------------------------------------------------------------

    def _tensorboard_log(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            for key, value in scalars(row).items():
                self.tensorboard.add_scalar(f"train/{key}", value, int(row["step"]))
        self.tensorboard.flush()  # in the file before the step's checkpoint: a kill loses no step a resume keeps

    # -------------------------------------------------------------------------------------------------------------

    def log(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        for name, send in (("tensorboard", self._tensorboard_log), ("mlflow", self._mlflow_log),
                           ("wandb", self._wandb_log)):
            if getattr(self, name) is not None and step > self.upto[name]:
                self._send(name, step, lambda: send([row]))

    def _send(self, name: str, step: int, send: Callable[[], None]) -> None:
        try:
            send()
        except Exception as e:  # noqa: BLE001 -- a tracker never stops the training
            print(f"anchor train: tracker {name} failed at step {step} ({one_line(e)}); training goes on without it "
                  f"(metrics.jsonl holds every step)", file=sys.stderr, flush=True)
            setattr(self, name, None)

    def close(self, finished: bool) -> None:
        if self.tensorboard is not None:
            self._send("tensorboard", -1, self.tensorboard.close)
        if self.mlflow is not None and finished:
            self._send("mlflow", -1, lambda: self.mlflow[0].set_terminated(self.mlflow[1], "FINISHED"))
        if self.wandb is not None:
            self._send("wandb", -1, self.wandb.finish)


def _mlflow_held(client: Any, run_id: str) -> int | None:
    """H where the MLflow run holds steps 1..H of every metric once and no other (H from `loss`, which each step
    logs last); None where a step is held twice, or some metric without its `loss`."""
    keys = list(client.get_run(run_id).data.metrics)
    steps = {k: [m.step for m in client.get_metric_history(run_id, k)] for k in keys}
    loss = sorted(steps.get("loss", []))
    last = len(loss)
    if loss != list(range(1, last + 1)):
        return None
    if any(len(set(s)) != len(s) or any(not 1 <= x <= last for x in s) for s in steps.values()):
        return None
    return last
