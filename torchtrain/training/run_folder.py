"""The run folder (docs/DESIGN.md §8), checked and prepared before any process group starts.

    prepare_run(cfg, "runs/tiny")     # checks everything, packs data, writes config.yaml

    RUN/config.yaml       the config as resolved (`auto` engine, seq_len): what every rank trains, and what a rerun
                          with the same --out must match (torchtrain.training.resume)
    RUN/deepspeed.json    the generated DeepSpeed config (torchtrain.config.deepspeed_json.deepspeed_config)
    RUN/data*/, RUN/data_source.json   the packed windows and what they were packed from (torchtrain.training.data)
    RUN/trackers.json     the tracker runs this run logs in (torchtrain.training.trackers)
    RUN/checkpoints/      torchtrain.training.checkpoint
    RUN/metrics.jsonl, grads/, tensorboard/   torchtrain.training.metrics

Each check lives with what it checks: the model, the engine and the memory in torchtrain.training.fit (run again in
every worker, on the machine that trains), the data in torchtrain.training.data, a rerun's config and data in
torchtrain.training.resume, the trackers in torchtrain.training.tracker_checks; `prepare_run` is the list of steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchor_core.atomic import write_text_atomic
from anchor_core.outdir import guard_out, write_marker
from anchor_core.weight_stream import stream_weights
from torchtrain.config import TrainConfig, check_world, with_changes
from torchtrain.config.deepspeed_json import check_offload_buckets, deepspeed_config
from torchtrain.training import checkpoint as ckpt
from torchtrain.training.data import check_data, data_source, pack_run_data, resolved_data, resolved_path
from torchtrain.training.fit import model_spec, resolved_engine
from torchtrain.training.memory import parameters
from torchtrain.training.metrics import read_log
from torchtrain.training.resume import CONFIG_FILE, check_resume, prepare_resume
from torchtrain.training.phases import Phase
from torchtrain.training.tracker_checks import check_trackers
from torchtrain.training.trackers import prepare_trackers

if TYPE_CHECKING:
    from anchor_core.spec import ModelSpec

DS_CONFIG_FILE = "deepspeed.json"


def prepare_run(cfg: TrainConfig, run: str | Path, *, world: int | None = None, progress: bool = True) -> None:
    """Check the config against the model, the data and the run folder, pack data on the fly if needed, and write
    RUN/config.yaml; nothing distributed starts before this returns. Every check that can fail runs before the
    run folder is touched."""
    run, world = Path(run), world if world is not None else cfg.parallel.nproc
    check_world(cfg, world)
    asked = cfg.model.engine
    cfg = with_changes(cfg, {"model.engine": resolved_engine(cfg)})  # `auto` resolved: config.yaml records what runs
    spec = model_spec(cfg)
    check_offload_buckets(cfg, world, parameters(spec))
    check_trackers(cfg)  # each tracker installed, MLflow's store answering
    weights = stream_weights(cfg.model.name, seed=cfg.data.seed)  # names and shapes from the files' headers, no
    # data: weights that do not fit the model are refused here, not in a rank that has started building it
    phases, seq_len = check_data(cfg, spec)  # the data, and every length against the model and the memory
    guard_out(run, "train", inputs=[cfg.data.path, cfg.model.name], replace=False)
    source = data_source(cfg)  # the data's fingerprint: read once, for the resume's check and data_source.json
    saved = check_resume(cfg, run, source, asked_engine=asked)  # a rerun trains the config and data it started with
    read_log(run)  # a metrics.jsonl a resume cannot read whole is refused here, the run folder untouched
    if weights.files and not ckpt.list_steps(run):  # a model's files the run starts from (a resume loads its
        weights.check_finite()  # checkpoint over them), read a tensor at a time: a NaN would make every loss NaN
    del weights  # its reader maps the model's file: unmapped now, not when this frame goes (packing is next)
    run.mkdir(parents=True, exist_ok=True)
    _fill_run(cfg, phases, run, spec, seq_len, source, saved is not None, world, progress)


def _fill_run(cfg: TrainConfig, phases: list[Phase], run: Path, spec: ModelSpec, seq_len: int | None,
              source: dict[str, Any], resumed: bool, world: int, progress: bool) -> None:
    """The run folder's marker, the resume's conversions, the data (packed on the fly when needed), then
    config.yaml, the DeepSpeed config and the trackers' runs."""
    write_marker(run, "train")
    ckpt.clear_staging(run)
    if resumed:
        prepare_resume(cfg, run, world, source, progress)
    packed = pack_run_data(cfg, phases, run, spec, seq_len, source, progress)
    if cfg.data.seq_len is None and not cfg.schedule.phases:
        cfg = with_changes(cfg, {"data.seq_len": packed.seq_len})
    write_run_config(cfg, run)
    (run / DS_CONFIG_FILE).write_text(json.dumps(deepspeed_config(cfg, world), indent=1))
    prepare_trackers(cfg, run)


def write_run_config(cfg: TrainConfig, run: Path) -> None:
    """RUN/config.yaml: the config with its paths resolved, so that a resume from another working directory
    reads the same data."""
    import yaml

    resolved = cfg.to_dict()
    resolved["data"]["path"] = resolved_data(cfg.data.path)
    if cfg.eval.heldout_data is not None:
        resolved["eval"]["heldout_data"] = resolved_path(cfg.eval.heldout_data)
    write_text_atomic(run / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
