"""Checkpoints of a training run (docs/DESIGN.md §8): atomic folders with a sha256 manifest; saving,
resuming and the RNG states they carry.

    RUN/checkpoints/step-<N>/
      manifest.json        {"step": N, "files": {relative path: sha256}, "config": "config.yaml"}; written last
      trainer.json         step, loader position, RNG states of every rank (JSON), elapsed seconds, world size
      ds/state/...         DeepSpeed's own files (model, optimizer, LR scheduler, ZeRO partitions): pickles
      hf/                  a Hugging Face folder as transformers' save_pretrained writes it: config.json,
                           generation_config.json, model.safetensors (or model-0000i-of-0000N.safetensors
                           and model.safetensors.index.json past max_shard_size), the tokenizer (`export_model`)

A checkpoint is built in `RUN/checkpoints/.step-<N>.tmp` by all ranks and renamed into place by
rank 0 after the manifest is written, so `step-<N>` exists only complete. A checkpoint is loaded only
after every file's sha256 matches the manifest this run wrote (otherwise the next older one is tried):
the checksum guards against corruption. The check is `anchor_core.weights.verify`, the one every reader
of a checkpoint goes through (a model folder given to any verb: `anchor_core.weights.model_folder`).
Against a planted object (a manifest rewritten to match), DeepSpeed's files, which it writes and reads as
pickles (`torch.load(weights_only=False)`), are read through torch's `weights_only` unpickler, which
builds tensors, containers and the few DeepSpeed types of `DEEPSPEED_ALLOWLIST` and nothing else
(`safe_loads`, torchtrain.training.state): any other object is refused in one line before it is built, and
nothing of it runs.

`Checkpointer` saves and resumes one rank's state (every rank calls both): model, optimizer and LR
scheduler through DeepSpeed; the loader's position and the rank's RNG states (torch on CPU and
CUDA, numpy, Python's `random`: the generators `seed_rng` seeds) through trainer.json. After a
save, the newest `keep_last` checkpoints stay whole; older regular ones are deleted and older evaluation
ones keep only their weights (hf/, trainer.json): nothing resumes from them (`prune`). Checkpoints of
higher steps than the one a run resumed from (corrupt, or weights only) are an earlier attempt's: named
in one line at the resume, not counted by `prune`, replaced when the run writes their steps again.
metrics.jsonl is no part of a checkpoint: a resumed run cuts it back to its step (torchtrain.training.metrics), and
resumes only from a checkpoint whose steps metrics.jsonl logs whole (`newest_valid`'s `upto`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchor_core.atomic import sha256_file, write_text_atomic
from anchor_core.errors import InputError
from anchor_core.export import DEFAULT_MAX_SHARD_SIZE
from anchor_core.weights import MANIFEST, MANIFEST_ERRORS, read_manifest, verify
from torchtrain.training.export import export_model  # looked up here: a test holds a rank inside it
from torchtrain.training.state import read_trainer_state, rng_state, safe_loads, seed_rng, set_rng_state

if TYPE_CHECKING:
    from torchtrain.training.phases import PhasedLoader
    from anchor_core.spec import ModelSpec
    from torchtrain.config import TrainConfig
    from torchtrain.parallel.distributed import World

TRAINER_STATE = "trainer.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OLD_DIR = re.compile(r"^\.(step-\d+)\.old$")


def checkpoints_dir(run: Path) -> Path:
    return Path(run) / "checkpoints"


def step_dir(run: Path, step: int) -> Path:
    return checkpoints_dir(run) / f"step-{step}"


def staging_path(run: Path, step: int) -> Path:
    return checkpoints_dir(run) / f".step-{step}.tmp"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Hash every file under `folder` (fsynced first) into `folder/manifest.json`; returns the manifest."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[path.relative_to(folder).as_posix()] = sha256_file(path)
    manifest = {"step": step, "files": files, **(extra or {})}
    write_text_atomic(folder / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def list_steps(run: Path) -> list[int]:
    """Steps of the published checkpoints, newest first."""
    root = checkpoints_dir(run)
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(steps, reverse=True)


UNIVERSAL = "universal"  # step-<N>/ds/universal: DeepSpeed's universal copy of ds/state (torchtrain.training.universal)


def universal_step(run: Path, upto: int | None, world: int, zero_stage: int) -> int | None:
    """The checkpoint this run resumes from (`newest_valid(run, upto=upto)`) where another process count wrote it
    at ZeRO >= 1: it is resumed through its universal copy (torchtrain.training.universal; DeepSpeed's
    `checkpoint.load_universal`); None where the run starts afresh or resumes as it is."""
    if zero_stage < 1:
        return None
    step = newest_valid(run, log=lambda _line: None, upto=upto)
    if step is None:
        return None
    try:
        saved_world = len(read_trainer_state(step_dir(run, step) / TRAINER_STATE)["rng"])
    except InputError:
        return None  # unreadable: the resume names it
    return step if saved_world != world else None


# AdamW's settings that DeepSpeed's ZeRO-3 universal load overwrites with the first group's in every group; the
# learning rate is the schedule's (loaded with it), the parameters DeepSpeed's own.
_GROUP_SETTINGS_KEPT = ("params", "lr", "initial_lr")


def _group_settings(optimizer: Any) -> list[dict[str, Any]]:
    inner = getattr(optimizer, "optimizer", optimizer)
    return [{k: v for k, v in g.items() if k not in _GROUP_SETTINGS_KEPT} for g in inner.param_groups]


def _mend_universal_load(optimizer: Any, settings: list[dict[str, Any]]) -> None:
    """Two things DeepSpeed's ZeRO-3 universal load gets wrong for AdamW, put right: every group gets the first
    group's settings (here the settings the trainer built from its config, taken before the load, go back: the
    no-decay group's weight decay), and every group's state shares one `step` tensor, which AdamW would advance
    once per group each step (a bias correction a step ahead for the second group)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    for group, own in zip(inner.param_groups, settings):
        group.update(own)
    for state in inner.state.values():
        step = state.get("step")
        if step is not None and hasattr(step, "clone"):
            state["step"] = step.clone()


def follow_schedule(engine: Any) -> None:
    """The learning rate of the next update set from this run's schedule (torchtrain.training.optim.lr_factor) at the step
    the loaded scheduler stands at. A checkpoint holds the rate its own schedule gave for that update, in the
    scheduler's state and in the optimizer's groups: when `schedule.steps` grew on resume the new schedule's rate
    differs, and the first resumed step would otherwise update (and log) with the old one. Where the schedule is
    unchanged the rate is the same number, computed by the same expression."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is None or not hasattr(scheduler, "lr_lambdas"):
        return
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    groups = [scheduler.optimizer.param_groups]
    wrapper = getattr(engine, "optimizer", None)  # DeepSpeed's ZeRO optimizer: its own view of the groups
    if wrapper is not None and getattr(wrapper, "param_groups", None) is not groups[0]:
        groups.append(wrapper.param_groups)
    for each in groups:
        for group, lr in zip(each, lrs):
            group["lr"] = lr
    scheduler._last_lr = lrs


def newest_valid(run: Path, log=print, upto: int | None = None) -> int | None:
    """The newest checkpoint whose manifest verifies and that holds DeepSpeed's state (one kept for its
    weights only, `keep_weights_only`, is nothing to resume from) and, with `upto` (the last step metrics.jsonl
    logs whole: torchtrain.training.metrics.read_log), whose step is no later than it, so that the resumed run's log has
    no gap; None when there is none.

    Where newer checkpoints cannot be used, one line through `log` names each and why, and says what the
    run does: resume from the older one or start from scratch. Those checkpoints are left as they are: an
    earlier attempt's, they are not counted as newer than what this run writes (`prune` counts only the
    steps up to the one just written), and the run replaces each when it writes that step again."""
    unusable: list[str] = []
    past: list[str] = []  # newer than the log: the newest, so named first
    found = None
    for step in list_steps(run):
        folder = step_dir(run, step)
        if upto is not None and step > upto:
            past.append(f"step-{step}")
            continue
        if is_weights_only(folder):
            unusable.append(f"step-{step} holds weights only")
            continue
        problem = verify(folder)
        if problem is None:
            found = step
            break
        unusable.append(f"step-{step} is corrupt ({problem})")
    if past:
        unusable.insert(0, f"{', '.join(past)} {'is' if len(past) == 1 else 'are'} past step {upto}, the last one "
                           "metrics.jsonl logs whole (resuming there would leave the steps in between unlogged)")
    if unusable:
        outcome = f"resuming from step-{found}" if found is not None else "none can be resumed, starting from scratch"
        log(f"checkpoint {', '.join(unusable)}: {outcome} (the unusable ones stay until this run writes their "
            "steps again; pruning does not count them as newer than its own)")
    return found


def publish(run: Path, step: int) -> Path:
    """Rename the finished staging folder of `step` into place (replacing a corrupt older copy)."""
    dst = step_dir(run, step)
    _swap_in(staging_path(run, step), dst)
    return dst


def _swap_in(src: Path, dst: Path) -> None:
    """Rename folder `src` to `dst`; an existing `dst` steps aside to `.<name>.old` first and is deleted
    after (`clear_staging` puts it back where a killed process left it without a `dst`)."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    _fsync_dir(dst.parent)


def is_weights_only(folder: Path) -> bool:
    """A checkpoint kept for its weights (`keep_weights_only`): no DeepSpeed state, nothing to resume."""
    try:
        return read_manifest(folder).get("weights_only") is True
    except MANIFEST_ERRORS:
        return False


def keep_weights_only(run: Path, step: int) -> bool:
    """Drop checkpoint `step`'s DeepSpeed state (`ds/`: model, optimizer moments, ZeRO partitions; about
    three quarters of its bytes under AdamW), keeping `hf/` and trainer.json under its manifest marked
    `weights_only`. The slim copy is built beside it from hard links and swapped in, so `step-<N>` is at
    every moment the whole checkpoint or the slim one. False (untouched) where it has no readable
    manifest or is slim already."""
    folder = step_dir(run, step)
    try:
        manifest = read_manifest(folder)
    except MANIFEST_ERRORS:
        return False
    if manifest.get("weights_only") is True:
        return False
    slim = checkpoints_dir(run) / f".step-{step}.slim.tmp"
    shutil.rmtree(slim, ignore_errors=True)
    kept = {rel: digest for rel, digest in manifest["files"].items() if not rel.startswith("ds/")}
    for rel in kept:
        target = slim / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(folder / rel, target)
        except OSError:  # a file system without hard links
            shutil.copy2(folder / rel, target)
    write_text_atomic(slim / MANIFEST, json.dumps({**manifest, "files": kept, "weights_only": True}, indent=1))
    _swap_in(slim, folder)
    return True


def prune(run: Path, keep_last: int, is_evaluation: Callable[[int], bool],
          written: int | None = None) -> tuple[list[int], list[int]]:
    """Past the newest `keep_last` checkpoints (0: none is touched), which stay whole to resume from:
    delete the regular ones, keep only the weights of the evaluation ones (`is_evaluation(step)`;
    `keep_weights_only`).

    `written`: the step a run has just written. Only checkpoints up to it are counted and touched, so the
    one just written is always among the newest kept; a checkpoint of a higher step is an earlier
    attempt's that the run could not resume from (`newest_valid`), left as it is until the run writes
    that step again. None: every checkpoint counts.
    Returns (deleted steps, steps made weights-only)."""
    if keep_last <= 0:
        return [], []
    deleted, slimmed = [], []
    counted = [s for s in list_steps(run) if written is None or s <= written]
    for step in counted[keep_last:]:
        if is_evaluation(step):
            if keep_weights_only(run, step):
                slimmed.append(step)
        else:
            shutil.rmtree(step_dir(run, step), ignore_errors=True)
            deleted.append(step)
    return deleted, slimmed


def clear_staging(run: Path) -> None:
    """Remove half-written checkpoint folders of a killed run; a checkpoint it killed between the two
    renames of `_swap_in` (only `.step-<N>.old` left) is put back."""
    root = checkpoints_dir(run)
    if root.is_dir():
        for p in root.iterdir():
            m = _OLD_DIR.match(p.name)
            if m and not (root / m.group(1)).exists():
                os.replace(p, root / m.group(1))
            elif p.name.startswith(".step-"):
                shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Saving and resuming a run's state


@dataclass(frozen=True)
class Checkpointer:
    """What one rank saves and resumes (module docstring); every rank calls `save` and `resume`.

    run: the run folder; cfg: its config (model, keep_last, the evaluation steps kept from pruning);
    spec: the model as trained (RoPE overrides applied), hf/'s config; engine: the DeepSpeed engine
    (model, optimizer, LR scheduler); world: this rank's place; loader: the batches' position;
    config_file: the run's config file, named in every manifest; max_shard_size, export_dtype: hf/'s
    shards and dtype (`export_model`).
    """

    run: Path
    cfg: TrainConfig
    spec: ModelSpec
    engine: Any
    world: World
    loader: PhasedLoader
    config_file: str
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    export_dtype: str = "auto"

    def resume(self, upto: int | None = None) -> tuple[int, float]:
        """Load the newest checkpoint whose manifest verifies (each rank checks it before DeepSpeed
        unpickles anything) and, with `upto`, whose step is no later than it (`newest_valid`); returns its
        step and elapsed seconds, (0, 0.0) when there is none."""
        import torch.distributed as dist

        start, elapsed = 0, 0.0
        logs: list[str] = []
        found = newest_valid(self.run, log=logs.append, upto=upto)
        if self.world.is_main:
            for line in logs:
                print(line, file=sys.stderr, flush=True)
        if found is not None:
            folder = step_dir(self.run, found)
            state = read_trainer_state(folder / TRAINER_STATE)
            saved_world = len(state["rng"])
            tag = "state"
            if saved_world != self.world.size and self.cfg.parallel.zero_stage >= 1:
                # partitioned over the processes that wrote it: the universal copy prepare_run made
                tag = UNIVERSAL
                if not (folder / "ds" / UNIVERSAL).is_dir():
                    raise InputError(f"the checkpoint was written by {saved_world} processes and has no universal "
                                     "copy for another count (anchor train makes one before its ranks start)",
                                     path=folder)
            settings = _group_settings(self.engine.optimizer)
            with safe_loads():
                self.engine.load_checkpoint(str(folder / "ds"), tag=tag, load_optimizer_states=True,
                                            load_lr_scheduler_states=True)
            if tag == UNIVERSAL and self.cfg.parallel.zero_stage == 3:
                _mend_universal_load(self.engine.optimizer, settings)
            follow_schedule(self.engine)
            try:
                self.loader.load_state_dict(state["loader"])
                if saved_world == self.world.size:
                    set_rng_state(state["rng"][self.world.rank])
                else:  # another process count: the data position is exact, the RNG states derived
                    seed_rng(self.cfg.data.seed + 1_000_003 * int(state["step"]) + self.world.rank)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise InputError(f"not a trainer state this run wrote ({type(e).__name__}: {e})",
                                 path=folder / TRAINER_STATE) from None
            start, elapsed = int(state["step"]), float(state["elapsed_s"])
            if self.world.is_main and not logs:
                print(f"resuming from {folder}" + (f" ({saved_world} processes then, {self.world.size} now: data "
                      "position exact, RNG states derived per rank)" if saved_world != self.world.size else ""),
                      file=sys.stderr, flush=True)
        dist.barrier()
        return start, elapsed

    def save(self, step: int, elapsed_s: float) -> None:
        """Write checkpoint `step`: staging folder, DeepSpeed state, trainer state, hf/, manifest,
        rename; then prune old regular checkpoints."""
        import torch.distributed as dist


        run, world = self.run, self.world
        staging = staging_path(run, step)
        if world.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()
        self.engine.save_checkpoint(str(staging / "ds"), tag="state", save_latest=False)
        rngs: list[Any] = [None] * world.size
        dist.all_gather_object(rngs, rng_state())
        export_model(self.engine.module, self.spec, staging / "hf" if world.is_main else None,
                     zero3=self.engine.zero_optimization_stage() == 3, tokenizer_of=self.cfg.model.name,
                     train_dtype=self.cfg.model.dtype, export_dtype=self.export_dtype,
                     max_shard_size=self.max_shard_size)
        if world.is_main:
            trainer = {"step": step, "loader": self.loader.state_dict(), "rng": rngs, "elapsed_s": elapsed_s,
                       "world": world.size}
            (staging / TRAINER_STATE).write_text(json.dumps(trainer), encoding="utf-8")
        dist.barrier()
        if world.is_main:
            write_manifest(staging, step, {"config": self.config_file})
            publish(run, step)
            prune(run, self.cfg.checkpoint.keep_last, self.cfg.is_eval_step, written=step)
        dist.barrier()


