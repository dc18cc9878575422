"""The run folder (docs/DESIGN.md §8), checked and prepared before any process group starts.

    prepare_run(cfg, "runs/tiny")     # checks everything, packs data, writes config.yaml

    RUN/config.yaml       the config as resolved (`auto` engine, seq_len): what every rank trains, and what
                          a rerun with the same --out must match (only RESUMABLE_CHANGES may differ)
    RUN/deepspeed.json    the generated DeepSpeed config (torchtrain.config.deepspeed_json.deepspeed_config)
    RUN/data/             the corpus packed on the fly, when `data.path` is not an `anchor pack` output
    RUN/data-<seq_len>/   with `schedule.stages`: the corpus packed for each stage's length (torchtrain.training.stages)
    RUN/data_source.json  what the run trains on: `data.path` resolved, a fingerprint of its content, and the
                          settings RUN/data was packed with; RUN/data is reused only when they still
                          hold, and a resume whose data changed is refused; `eval.heldout_data` resolved and
                          fingerprinted the same way (`heldout`), a resume whose held-out pack changed refused
    RUN/checkpoints/      torchtrain.training.checkpoint; RUN/metrics.jsonl, grads/, tensorboard/: torchtrain.training.metrics

The checks here (`check_model`) run again in every worker, on the machine that trains.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anchor_core.atomic import write_text_atomic
from anchor_core.data.config import layout_of
from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus
from anchor_core.data.mixture import MixtureSpec
from anchor_core.data.packed import PackedData
from anchor_core.data.pipeline import PackConfig, pack_corpus
from anchor_core.errors import InputError
from anchor_core.outdir import guard_out, write_marker
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weight_stream import stream_weights
from anchor_core.weights import load_spec
from anchor_core.yamlfile import read_yaml
from torchtrain.training import checkpoint as ckpt
from torchtrain.attention import engines
from torchtrain.training import universal
from torchtrain.config import (KEYS, RESUMABLE_CHANGES, TrainConfig, check_world, from_flat, is_flat, validate,
                               with_changes)
from torchtrain.config.validation import check_heldout_buckets
from torchtrain.config.deepspeed_json import check_offload_buckets, deepspeed_config
from torchtrain.config.schema import plain
from torchtrain.parallel.distributed import launched_externally
from torchtrain.attention.engines import resolve_engine
from torchtrain.training.memory import check_device, largest_term, parameters, step_memory, step_of
from torchtrain.training.metrics import read_log
from torchtrain.parallel.ulysses import check_sequence_parallel
from torchtrain.training.stages import Stage, named_stage, run_stages
from torchtrain.training.trackers import check_trackers, prepare_trackers

if TYPE_CHECKING:
    import torch

    from anchor_core.spec import ModelSpec

CONFIG_FILE = "config.yaml"
DS_CONFIG_FILE = "deepspeed.json"
DATA_DIR = "data"
SOURCE_FILE = "data_source.json"
_EDGE = 1 << 20  # bytes of each end of a file read by the fingerprint


def content_fingerprint(path: Path) -> str:
    """sha256 over every file under `path` (or `path` itself): its relative name, its size, and its first
    and last MiB. Cheap on a corpus of many GB, and it changes when a file is replaced, cut or grown."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.relative_to(path) if f != path else f.name}\0{size}\0".encode())
        with open(f, "rb") as handle:
            digest.update(handle.read(_EDGE))
            if size > 2 * _EDGE:
                handle.seek(size - _EDGE)
                digest.update(handle.read(_EDGE))
    return digest.hexdigest()[:32]


def resolved_data(data: str) -> str:
    """`data.path` as the run records it: `corpus` (the embedded corpus), else the absolute path."""
    return data if data == "corpus" else resolved_path(data)


def resolved_path(path: str) -> str:
    """A path as the run records it (`eval.heldout_data`, `data.path`): absolute, so that a resume from another
    working directory reads the same folder."""
    return str(Path(path).expanduser().resolve())


def data_source(cfg: TrainConfig) -> dict[str, Any]:
    """What RUN/data_source.json records: the data (resolved) and its content's fingerprint, and, for a
    corpus packed on the fly, every setting the packing reads."""
    data = resolved_data(cfg.data.path)
    record: dict[str, Any] = {"data": data,
                              "fingerprint": None if data == "corpus" else content_fingerprint(Path(data))}
    if cfg.eval.heldout_data is not None:  # the held-out windows, held to their content as the training data is
        held = resolved_path(cfg.eval.heldout_data)
        record["heldout"] = {"data": held, "fingerprint": content_fingerprint(Path(held))}
    if not (Path(data) / "pack.json").is_file():
        d = cfg.data
        lengths = [s.seq_len for s in cfg.schedule.stages]
        record["packed_with"] = {"model": cfg.model.name, "seq_len": lengths or d.seq_len, "tags": d.tags,
                                 "interleave": d.interleave, "seed": d.seed,
                                 "pack": {k: d.pack[k] for k in sorted(d.pack)}}
    return record


def _read_source(run: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((run / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def saved_config(run: Path) -> dict[str, Any] | None:
    """RUN/config.yaml as sections (None: no such file); a run folder written with the flat keys of the
    pre-sectioned format is translated through torchtrain.config.MOVED, so it resumes."""
    path = run / CONFIG_FILE
    if not path.is_file():
        return None
    saved = read_yaml(path)
    if not isinstance(saved, dict):
        raise InputError("not a run's config (not a mapping)", path=path)
    return from_flat(saved, source=str(path)) if is_flat(saved) else saved


def load_run_config(run: Path) -> TrainConfig:
    """RUN/config.yaml, validated: the config a worker trains."""
    return validate(saved_config(run), source=str(run / CONFIG_FILE))


def data_dir(cfg: TrainConfig, run: Path, seq_len: int | None = None) -> Path:
    """The packed folder of a prepared run: `data.path` itself when it is an `anchor pack` output, else RUN/data;
    with `schedule.stages`, the stage of `seq_len`'s, RUN/data-<seq_len>."""
    if cfg.schedule.stages:
        return run / f"{DATA_DIR}-{seq_len}"
    return Path(cfg.data.path) if (Path(cfg.data.path) / "pack.json").is_file() else run / DATA_DIR


def model_spec(cfg: TrainConfig) -> ModelSpec:
    """The spec of `model.name` with the config's RoPE overrides (`model.rope`) applied."""
    spec = load_spec(cfg.model.name)
    if cfg.rope_overrides():
        try:
            spec = spec.with_rope(**cfg.rope_overrides())
        except TypeError as e:
            raise InputError(f"model.rope: {e}", path=cfg.where("model.rope")) from None
    return spec


def resolved_engine(cfg: TrainConfig) -> str:
    """The engine `model.engine` runs as on this machine (`auto` resolved by
    torchtrain.attention.engines.resolve_engine for the device init_world picks: CUDA where torch sees one)."""
    import torch


    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    return resolve_engine(cfg.model.engine, "cuda" if torch.cuda.is_available() else "cpu", dtype)


def check_model(cfg: TrainConfig, spec: ModelSpec, seq_len: int, *, here: bool = True,
                memory: bool = True) -> ModelSpec:
    """Length, sequence parallelism and (`here`: on this machine) the engine against the model, and
    (`memory`) a dense engine's T x T tensors against the memory free here; returns the spec to train
    (with `max_position` raised to `seq_len` when the RoPE is overridden for a longer context)."""
    import torch


    if seq_len > spec.max_position:
        if not cfg.rope_overrides():
            raise InputError(
                f"data.seq_len {seq_len} is beyond the model's {spec.max_position} positions; extend its RoPE for "
                f"the longer context (e.g. model.rope.theta: the paper uses 1e6 at 32K, 5e6 at 64K, 1e7 at 128K, 5e7 at 256K)",
                path=cfg.where("data.seq_len", "model.name"))
        spec = spec.replace(max_position=seq_len)
    try:
        check_sequence_parallel(spec, seq_len, cfg.parallel.sequence_parallel)
    except InputError as e:
        raise InputError(str(e), path=cfg.where("parallel.sequence_parallel", "data.seq_len")) from None
    # dtype, engine and offloading against the device: the one check anchor plan makes too
    engine = check_device(cfg, ("cuda" if torch.cuda.is_available() else "cpu") if here else None)
    if here and memory:
        dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
        check_step_memory(cfg, spec, seq_len, engine, dtype)
    return spec


def check_step_memory(cfg: TrainConfig, spec: ModelSpec, seq_len: int, engine: str, dtype: torch.dtype) -> None:
    """One step's memory (torchtrain.training.memory.step_memory: the processes, weights and optimizer, activations
    linear in T, a dense engine's T x T tensors) against the memory free here, before any work: on the CPU
    the local processes share it (`parallel.nproc`), on CUDA each has its device. One line naming the key that
    weighs most and the estimate."""
    import torch


    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_externally() else cfg.parallel.nproc
    procs = 1 if cuda else local  # the processes that share this memory: on CUDA each has its device
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_externally() else cfg.parallel.nproc
    need = step_memory(spec, seq_len=seq_len, **step_of(cfg, engine=engine, dtype=dtype, procs=procs, world=world,
                                                        on_gpu=cuda))
    if need.host:  # offloaded checkpoints (CUDA): every local process's in this host's memory
        host_free = engines.available_memory("cpu")
        if host_free is not None and need.host * local > host_free:
            raise InputError(f"model.offload_checkpoints at data.seq_len={seq_len} needs about "
                             f"{need.host * local / 2**30:.1f} GiB of host memory for the checkpoints of {local} "
                             f"process(es); {host_free / 2**30:.1f} GiB available here: a shorter data.seq_len, or "
                             "more hosts (anchor plan --host-memory shows where it stops)",
                             path=cfg.where("model.offload_checkpoints", "data.seq_len"))
    free = engines.available_memory("cuda" if cuda else "cpu")
    if free is None or need.total <= free:
        return
    if need.dense > need.activations:
        what = "mask" if engine == "sdpa" else "mask and attention scores"
        linear = engines.resolve_engine(engines.AUTO, "cuda" if cuda else "cpu", dtype)
        hint = (f"most of it is the dense T x T {what}: use model.engine: auto ({linear}, linear in T) or a shorter "
                "data.seq_len")
        key = f"model.engine {engine!r} at data.seq_len={seq_len} (data.micro_batch={cfg.data.micro_batch})"
        keys = ("model.engine", "data.seq_len")
    elif procs > 1 and need.base * procs > need.per_process:
        key, hint, keys = f"parallel.nproc={procs}", "fewer processes", ("parallel.nproc",)
    elif need.activations >= need.states:
        key = f"data.seq_len={seq_len} (data.micro_batch={cfg.data.micro_batch})"
        keys = ("data.seq_len",)
        levers = ["a shorter data.seq_len"]
        levers += [f"{k}: true" for k, on in (("model.activation_checkpointing", cfg.model.activation_checkpointing),
                                                ("model.tiled_mlp", cfg.model.tiled_mlp)) if not on]
        levers.append("parallel.sequence_parallel over more processes")
        name, _ = largest_term(need)
        hint = (f"{name} the largest term; " + ", ".join(levers[:-1]) + f" or {levers[-1]}"
                + " (anchor plan shows each term)")
    else:
        key, hint = ("the model's weights and optimizer",
                     "a higher parallel.zero_stage over more processes, or a smaller model")
        keys = ("model.name",)
    raise InputError(f"{key} needs about {need.describe()} for one training step; {free / 2**30:.1f} GiB "
                     f"available here: {hint}", path=cfg.where(*keys))


def _resolve_data(cfg: TrainConfig, run: Path, progress: bool, target: Path) -> Path:
    """The packed folder to train on: `data.path` itself when it is an `anchor pack` output (checked
    against the config), else `target` (RUN/data, or a stage's RUN/data-<seq_len>), packed from the corpus once
    and reused on resume (`_clear_stale_packs` removed any packed with other settings)."""
    data = Path(cfg.data.path)
    if (data / "pack.json").is_file():
        packed = PackedData.open(data)
        layout = packed.meta.get("layout", {})
        if cfg.data.seq_len is not None and cfg.data.seq_len != packed.seq_len:
            raise InputError(f"data.seq_len {cfg.data.seq_len} differs from the packed data's {packed.seq_len}",
                             path=data)
        for key in ("tags", "interleave"):
            if bool(layout.get(key)) != getattr(cfg.data, key):
                raise InputError(f"data.{key}: the config says {getattr(cfg.data, key)}, the packed data was made "
                                 f"with {bool(layout.get(key))}", path=data)
        _check_tokenizer(cfg, packed.meta, data)
        return data
    if cfg.data.seq_len is None:
        raise InputError("data.seq_len is required when data.path is a corpus packed on the fly",
                         path=cfg.where("data.path"))
    if (target / "pack.json").is_file():  # packed with these settings (`_clear_stale_packs`), named by its length
        return target

    source: str | Path = cfg.data.path
    if cfg.data.path == "corpus":
        if not (run / "corpus" / CORPUS_FILE).is_file():  # written whole or not at all; one for every stage
            write_default_corpus(run / "corpus", progress=progress)
        source = run / "corpus" / CORPUS_FILE
    d, p = cfg.data, cfg.data.pack
    mix_keys = ("budget", "long_threshold", "upsample_factor")
    mixture = MixtureSpec(kind=p.get("mixture", "original"), seed=p.get("seed", d.seed),
                          **{k: p[k] for k in mix_keys if k in p})
    pack_cfg = PackConfig(seq_len=d.seq_len, mixture=mixture,
                          layout=layout_of(p, tags=d.tags, interleave=d.interleave),
                          seed=p.get("seed", d.seed), text_field=p.get("text_field", "text"),
                          domain_field=p.get("domain_field"), skip_bad=p.get("skip_bad", False))
    pack_corpus(cfg.model.name, source, target, pack_cfg, progress=progress,
                names={"seq_len": "data.seq_len", "budget": "data.pack.budget"})
    return target


def _check_tokenizer(cfg: TrainConfig, meta: dict[str, Any], where: Path) -> None:
    tok = load_tokenizer(cfg.model.name)
    ident = (meta.get("tokenizer") or {}).get("identity")
    if ident is not None and ident != tok.identity:
        raise InputError(f"the packed data was tokenized with another tokenizer than the model {cfg.model.name!r}'s",
                         path=where)


def prepare_run(cfg: TrainConfig, run: str | Path, *, world: int | None = None, progress: bool = True) -> None:
    """Check the config against the model, the data and the run folder, pack data on the fly if
    needed, and write RUN/config.yaml; nothing distributed starts before this returns."""
    run = Path(run)
    check_world(cfg, world if world is not None else cfg.parallel.nproc)
    asked = cfg.model.engine
    cfg = with_changes(cfg, {"model.engine": resolved_engine(cfg)})  # `auto` resolved: config.yaml records what runs
    spec = model_spec(cfg)
    check_offload_buckets(cfg, world if world is not None else cfg.parallel.nproc, parameters(spec))
    check_trackers(cfg)  # each tracker installed, MLflow's store answering: before the run folder is touched
    weights = stream_weights(cfg.model.name, seed=cfg.data.seed)  # names and shapes from the files' headers, no
    # data: weights that do not fit the model are refused here, not in a rank that has started building it
    data_path = Path(cfg.data.path)
    if cfg.data.path != "corpus" and not data_path.exists():
        raise InputError("no such data file or folder (an `anchor pack` output, a corpus, or `corpus`)",
                         path=data_path)
    seq_len = cfg.data.seq_len
    stages = run_stages(cfg)  # one, without schedule.stages
    if cfg.schedule.stages:
        if (data_path / "pack.json").is_file():
            raise InputError(f"data.path {data_path} is an `anchor pack` output of one length; schedule.stages packs "
                             "each stage's windows from a corpus (a JSONL file or folder, or `corpus`)",
                             path=cfg.where("data.path", "schedule.stages"))
        for stage in stages:  # each length against the model and the memory, before any packing
            with named_stage(stage, cfg):
                check_model(stage.cfg, model_spec(stage.cfg), stage.seq_len)
    else:
        if seq_len is None and (data_path / "pack.json").is_file():
            seq_len = PackedData.open(data_path).seq_len
        if seq_len is not None:
            check_model(cfg, spec, seq_len)  # before packing and before the run folder: a bad length fails fast
            check_heldout_buckets(cfg, seq_len)
            check_heldout_data(cfg, seq_len)
    guard_out(run, "train", inputs=[cfg.data.path, cfg.model.name], replace=False)
    saved = saved_config(run)
    if saved is not None:
        _check_resume_config(cfg, saved, run, asked_engine=asked)
        _check_source(data_source(cfg), run)  # the same data and held-out data, before the run folder is touched
    read_log(run)  # a metrics.jsonl a resume cannot read whole is refused here, the run folder untouched
    if weights.files and not ckpt.list_steps(run):  # a model's files the run starts from (a resume loads its
        weights.check_finite()  # checkpoint over them), read a tensor at a time: a NaN would make every loss NaN
    del weights  # its reader maps the model's file: unmapped now, not when this frame goes (packing is next)
    run.mkdir(parents=True, exist_ok=True)
    _fill_run(cfg, stages, run, spec, seq_len, saved, world, progress)


def _fill_run(cfg: TrainConfig, stages: list[Stage], run: Path, spec: ModelSpec, seq_len: int | None,
              saved: dict[str, Any] | None, world: int | None, progress: bool) -> None:
    """The run folder's marker, data (packed on the fly when needed), data_source.json, the checks that need
    the packed data, then config.yaml and the DeepSpeed config (prepare_run)."""
    write_marker(run, "train")
    ckpt.clear_staging(run)
    source = data_source(cfg)
    if saved is not None:
        _check_process_count(cfg, run, world if world is not None else cfg.parallel.nproc, progress)
        trained = max(ckpt.list_steps(run), default=0)
        if cfg.schedule.steps < trained:  # config.yaml would say the run stops before where it stands
            raise InputError(f"schedule.steps={cfg.schedule.steps} but the run has a checkpoint at step {trained}; steps may grow on a "
                             f"rerun, not shrink below it (choose another --out for a shorter run)", path=run / CONFIG_FILE)
        if _read_source(run) is None:  # a run from before data_source.json: its config.yaml matched above
            write_text_atomic(run / SOURCE_FILE, json.dumps(source, indent=1) + "\n")
    _clear_stale_packs(run, source)
    write_text_atomic(run / SOURCE_FILE, json.dumps(source, indent=1) + "\n")
    for stage in stages:
        with named_stage(stage, cfg):
            packed = _stage_data(cfg, stage, run, spec, seq_len, progress)
    if cfg.data.seq_len is None and not cfg.schedule.stages:
        cfg = with_changes(cfg, {"data.seq_len": packed.seq_len})
    import yaml

    resolved = cfg.to_dict()
    resolved["data"]["path"] = resolved_data(cfg.data.path)
    if cfg.eval.heldout_data is not None:
        resolved["eval"]["heldout_data"] = resolved_path(cfg.eval.heldout_data)
    write_text_atomic(run / CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
    (run / DS_CONFIG_FILE).write_text(json.dumps(deepspeed_config(cfg, world or cfg.parallel.nproc), indent=1))
    prepare_trackers(cfg, run)


def _clear_stale_packs(run: Path, source: dict[str, Any]) -> None:
    """RUN/data and every stage's RUN/data-<seq_len> removed when RUN/data_source.json records other data or other
    packing settings than `source`: packed by an earlier attempt with another config that stopped before config.yaml
    (a resume with other settings is refused before this), packed again, never trained on silently."""
    old = _read_source(run) or {}
    if all(old.get(k) == source.get(k) for k in ("fingerprint", "packed_with")):
        return
    for folder in [run / DATA_DIR, *run.glob(f"{DATA_DIR}-*")]:
        if folder.is_dir():
            shutil.rmtree(folder)


def _stage_data(run_cfg: TrainConfig, stage: Stage, run: Path, spec: ModelSpec, seq_len: int | None,
                progress: bool) -> PackedData:
    """A stage's packed windows (`_resolve_data`: packed on the fly when needed), checked against its config: the
    model's vocabulary and positions (and, for a length only the packed data gave, `seq_len` None, the memory), one
    global batch left once its held-out windows are held out, eval.heldout_data's length."""
    cfg = stage.cfg
    data = _resolve_data(cfg, run, progress, data_dir(run_cfg, run, stage.seq_len))
    packed = PackedData.open(data)
    if cfg.data.seq_len is None:
        cfg = with_changes(cfg, {"data.seq_len": packed.seq_len})
    staged = bool(run_cfg.schedule.stages)  # a stage's own RoPE; its memory was checked before packing
    spec = check_model(cfg, model_spec(cfg) if staged else spec, packed.seq_len, memory=seq_len is None and not staged)
    vocab = (packed.meta.get("tokenizer") or {}).get("vocab_size")
    if vocab is not None and vocab > spec.vocab_size:
        raise InputError(f"the packed data's tokenizer has {vocab} tokens, the model only {spec.vocab_size}", path=data)
    held = 0 if cfg.eval.heldout_data else cfg.eval.heldout_windows
    if held > packed.num_windows:
        raise InputError(f"eval.heldout_windows {held} is more than the {packed.num_windows} windows of the packed "
                         "data; hold out fewer windows or pack more data", path=data)
    if packed.num_windows - held < cfg.data.global_batch:
        kept = f" left once eval.heldout_windows={held} are held out" if held else ""
        raise InputError(f"{packed.num_windows - held} windows{kept} are fewer than one global batch of "
                         f"{cfg.data.global_batch}; pack more data or lower data.global_batch", path=data)
    check_heldout_data(cfg, packed.seq_len)
    return packed


def check_heldout_data(cfg: TrainConfig, seq_len: int) -> PackedData | None:
    """eval.heldout_data, opened: an `anchor pack` folder of windows of the run's length (None when not given)."""
    if cfg.eval.heldout_data is None:
        return None
    where = cfg.where("eval.heldout_data")
    folder = Path(cfg.eval.heldout_data).expanduser()
    if not (folder / "pack.json").is_file():
        raise InputError(f"eval.heldout_data {folder} is not an `anchor pack` output folder (no pack.json)", path=where)
    held = PackedData.open(folder)
    if held.seq_len != seq_len:
        raise InputError(f"eval.heldout_data {folder} holds windows of {held.seq_len} slots, the run trains on "
                         f"{seq_len}", path=where)
    if cfg.eval.heldout_windows > held.num_windows:
        raise InputError(f"eval.heldout_windows {cfg.eval.heldout_windows} is more than the {held.num_windows} "
                         f"windows of eval.heldout_data {folder} (0: all of them)",
                         path=cfg.where("eval.heldout_windows", "eval.heldout_data"))
    return held


def _check_process_count(cfg: TrainConfig, run: Path, world: int, progress: bool = True) -> None:
    """A resume with another process count: at ZeRO-0 the workers load the checkpoint as it is
    (torchtrain.training.checkpoint.Checkpointer.resume); at ZeRO >= 1 the optimizer states are partitioned over the
    processes that wrote them, so the checkpoint the workers will resume from is converted here, once, before any
    of them starts, to DeepSpeed's universal format (torchtrain.training.universal), which any process count loads."""
    universal.clear_unfinished(run)
    step = ckpt.universal_step(run, read_log(run).last, world, cfg.parallel.zero_stage)  # the one the ranks resume
    if step is not None:
        universal.convert_for_resume(run, step, progress=progress)


def _check_source(source: dict[str, Any], run: Path) -> None:
    """A resumed run trains on the data it started with: same content (the fingerprint), same packing."""
    old = _read_source(run)
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


def _dotted(d: dict[str, Any]) -> dict[str, Any]:
    """A config by section as dotted key -> value (`model.rope` and `data.pack` stay whole mappings)."""
    return {f"{section}.{k}": v for section, keys in d.items() if isinstance(keys, dict) for k, v in keys.items()}


def _check_resume_config(cfg: TrainConfig, saved: dict[str, Any], run: Path, *, asked_engine: str | None = None) -> None:
    """A rerun with the same --out must train the same thing (only RESUMABLE_CHANGES may differ).
    `saved`: the run's config.yaml by section (saved_config). `model.engine` is already resolved, so `auto`
    equals the engine it resolves to here (`asked_engine`: the name the config gave, for the message)."""
    old_keys = _dotted(saved)
    for key, value in _dotted(cfg.to_dict()).items():
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
