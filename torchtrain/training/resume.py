"""A rerun of `anchor train` with the same --out: it resumes only what the run started as.

    saved = check_resume(cfg, run, source)  # RUN/config.yaml against the config (only RESUMABLE_CHANGES may
                                            # differ), the data against data_source.json; None for a new run
    prepare_resume(cfg, run, world, ...)    # steps never below a checkpoint; a checkpoint converted once for
                                            # another process count (torchtrain.training.universal)

RUN/config.yaml is the config as resolved (`auto` engine, seq_len): what every rank trains (`load_run_config`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from anchor_core.yamlfile import read_yaml
from torchtrain.config import KEYS, RESUMABLE_CHANGES, TrainConfig, by_dotted_key, current_keys, validate
from torchtrain.config.schema import plain
from torchtrain.training import checkpoint as ckpt
from torchtrain.training import universal
from torchtrain.training.data import SOURCE_FILE, read_source, resolved_data, resolved_path
from torchtrain.training.metrics import read_log

CONFIG_FILE = "config.yaml"


def check_resume(cfg: TrainConfig, run: Path, source: dict[str, Any], *,
                 asked_engine: str | None = None) -> dict[str, Any] | None:
    """A rerun with the same --out trains what the run started as: the same config (check_resume_config) and the
    same data (check_source; `source`: data_source's), checked before the run folder is touched. Returns the run's
    saved config (None: a new run)."""
    saved = saved_config(run)
    if saved is not None:
        check_resume_config(cfg, saved, run, asked_engine=asked_engine)
        check_source(source, run)  # the same data and held-out data
    return saved


def prepare_resume(cfg: TrainConfig, run: Path, world: int, source: dict[str, Any], progress: bool) -> None:
    """What a resume does to the run folder before any rank starts: a checkpoint of another process count
    converted (check_process_count), `schedule.steps` never below the newest checkpoint, and data_source.json
    written for a run that predates it (`source`: data_source's)."""
    check_process_count(cfg, run, world, progress)
    trained = max(ckpt.list_steps(run), default=0)
    if cfg.schedule.steps < trained:  # config.yaml would say the run stops before where it stands
        raise InputError(f"schedule.steps={cfg.schedule.steps} but the run has a checkpoint at step {trained}; steps "
                         "may grow on a rerun, not shrink below it (choose another --out for a shorter run)",
                         path=run / CONFIG_FILE)
    if read_source(run) is None:  # a run from before data_source.json: its config.yaml matched above
        write_text_atomic(run / SOURCE_FILE, json.dumps(source, indent=1) + "\n")


def saved_config(run: Path) -> dict[str, Any] | None:
    """RUN/config.yaml as sections, a key an earlier release wrote under its new name (current_keys; None: no such
    file)."""
    path = run / CONFIG_FILE
    if not path.is_file():
        return None
    saved = read_yaml(path)
    if not isinstance(saved, dict):
        raise InputError("not a run's config (not a mapping)", path=path)
    return current_keys(saved)


def load_run_config(run: Path) -> TrainConfig:
    """RUN/config.yaml, validated: the config a worker trains."""
    return validate(saved_config(run), source=str(run / CONFIG_FILE))


def check_source(source: dict[str, Any], run: Path) -> None:
    """A resumed run trains on the data it started with: same content (the fingerprint), same packing."""
    old = read_source(run)
    if old is None:
        return  # a run folder without data_source.json (an older anchor's): its config.yaml was compared already
    if old.get("fingerprint") != source.get("fingerprint"):
        raise InputError(f"data {source['data']}: its content changed since the run started (fingerprint "
                         f"{old.get('fingerprint')} then, {source.get('fingerprint')} now); resume with the same data "
                         "or choose another --out", path=run / SOURCE_FILE)
    then, now = old.get("heldout"), source.get("heldout")
    if isinstance(then, dict) and now is not None and then.get("fingerprint") != now["fingerprint"]:
        # a repacked held-out folder: the held-out series would switch windows mid-run without a word
        raise InputError(f"eval.heldout_data {now['data']}: its content changed since the run started (fingerprint "
                         f"{then.get('fingerprint')} then, {now['fingerprint']} now); resume with the same held-out "
                         "data or choose another --out", path=run / SOURCE_FILE)


def check_resume_config(cfg: TrainConfig, saved: dict[str, Any], run: Path, *, asked_engine: str | None = None) -> None:
    """A rerun with the same --out must train the same thing (only RESUMABLE_CHANGES may differ).
    `saved`: the run's config.yaml by section (saved_config). `model.engine` is already resolved, so `auto`
    equals the engine it resolves to here (`asked_engine`: the name the config gave, for the message)."""
    old_keys = by_dotted_key(saved)
    for key, value in by_dotted_key(cfg.to_dict()).items():
        if key in RESUMABLE_CHANGES or (key == "data.seq_len" and value is None):
            continue
        old = old_keys.get(key)
        if key not in old_keys and key in KEYS and not KEYS[key].is_required():
            # a key newer than the run: it was started with what the key's default does
            old = plain(KEYS[key].get_default(call_default_factory=True))
        if key == "data.path" and isinstance(old, str):  # the same data by another name is the same data
            old, value = resolved_data(old), resolved_data(value)
        if key == "eval.heldout_data" and isinstance(old, str) and isinstance(value, str):  # likewise
            old, value = resolved_path(old), resolved_path(value)
        if isinstance(old, list):
            value = list(value) if isinstance(value, (tuple, list)) else value
        if key == "model.rope" and old is None:
            old = {}
        if old != value:
            if key == "model.engine" and asked_engine not in (None, value):
                value = f"{value} ({asked_engine} here)"
            raise InputError(f"{key} is {value!r} but the run was started with {old!r}; resume with the same "
                             f"config or choose another --out", path=run / CONFIG_FILE)


def check_process_count(cfg: TrainConfig, run: Path, world: int, progress: bool = True) -> None:
    """A resume with another process count: at ZeRO-0 the workers load the checkpoint as it is
    (torchtrain.training.checkpoint.Checkpointer.resume); at ZeRO >= 1 the optimizer states are partitioned over the
    processes that wrote them, so the checkpoint the workers will resume from is converted here, once, before any
    of them starts, to DeepSpeed's universal format (torchtrain.training.universal), which any process count loads."""
    universal.clear_unfinished(run)
    step = ckpt.universal_step(run, read_log(run).last, world, cfg.parallel.zero_stage)  # the one the ranks resume
    if step is not None:
        universal.convert_for_resume(run, step, progress=progress)
