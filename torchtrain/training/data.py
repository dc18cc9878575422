"""What a run trains on: its data, recorded, packed and checked.

    RUN/data/             the corpus packed on the fly, when `data.path` is not an `anchor pack` output
    RUN/data-<seq_len>/   with `schedule.phases`: the corpus packed for each phase's length (torchtrain.training.phases)
    RUN/data_source.json  `data.path` resolved, a fingerprint of its content, and the settings RUN/data was packed
                          with; RUN/data is reused only when they still hold (`clear_stale_packs`), and a resume
                          whose data changed is refused (torchtrain.training.resume); `eval.heldout_data` resolved
                          and fingerprinted the same way (`heldout`)

    check_data(cfg, spec)                     before the run folder is touched: the data exists, and every length
                                              (each phase's) fits the model and the memory
    pack_run_data(cfg, phases, run, ...)      the packed windows of every phase, each checked against its config
"""

from __future__ import annotations

import hashlib
import json
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
from anchor_core.tokenizer import load_tokenizer
from torchtrain.config import TrainConfig, with_changes
from torchtrain.config.validation import check_heldout_buckets
from torchtrain.training.fit import check_model, model_spec
from torchtrain.training.heldout import check_heldout_data
from torchtrain.training.phases import Phase, named_phase, run_phases

if TYPE_CHECKING:
    from anchor_core.spec import ModelSpec

DATA_DIR = "data"
SOURCE_FILE = "data_source.json"
_EDGE = 1 << 20  # bytes of each end of a file read by the fingerprint


def check_data(cfg: TrainConfig, spec: ModelSpec) -> tuple[list[Phase], int | None]:
    """Before any packing and before the run folder is touched: `data.path` exists, and each length the run
    trains (every phase's, or `data.seq_len`, or the packed data's) fits the model and the memory, with its
    held-out settings. Returns the run's phases and its length (None: a corpus packed at a length only packing
    gives)."""
    data_path = Path(cfg.data.path)
    if cfg.data.path != "corpus" and not data_path.exists():
        raise InputError("no such data file or folder (an `anchor pack` output, a corpus, or `corpus`)",
                         path=data_path)
    seq_len = cfg.data.seq_len
    phases = run_phases(cfg)  # one, without schedule.phases
    if cfg.schedule.phases:
        if (data_path / "pack.json").is_file():
            raise InputError(f"data.path {data_path} is an `anchor pack` output of one length; schedule.phases packs "
                             "each phase's windows from a corpus (a JSONL file or folder, or `corpus`)",
                             path=cfg.where("data.path", "schedule.phases"))
        for phase in phases:  # each length against the model and the memory, before any packing
            with named_phase(phase, cfg):
                check_model(phase.cfg, model_spec(phase.cfg), phase.seq_len)
        return phases, seq_len
    if seq_len is None and (data_path / "pack.json").is_file():
        seq_len = PackedData.open(data_path).seq_len
    if seq_len is not None:
        check_model(cfg, spec, seq_len)  # before packing and before the run folder: a bad length fails fast
        check_heldout_buckets(cfg, seq_len)
        check_heldout_data(cfg, seq_len)
    return phases, seq_len


def pack_run_data(cfg: TrainConfig, phases: list[Phase], run: Path, spec: ModelSpec, seq_len: int | None,
                  source: dict[str, Any], progress: bool) -> PackedData:
    """RUN/data_source.json (`source`, data_source's) and every phase's packed windows (`phase_data`: packed on
    the fly when needed, reused when packed with these settings); returns the last phase's."""
    clear_stale_packs(run, source)
    write_text_atomic(run / SOURCE_FILE, json.dumps(source, indent=1) + "\n")
    for phase in phases:
        with named_phase(phase, cfg):
            packed = phase_data(cfg, phase, run, spec, seq_len, progress)
    return packed


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
        lengths = [s.seq_len for s in cfg.schedule.phases]
        record["packed_with"] = {"model": cfg.model.name, "seq_len": lengths or d.seq_len, "tags": d.tags,
                                 "interleave": d.interleave, "seed": d.seed,
                                 "pack": {k: d.pack[k] for k in sorted(d.pack)}}
    return record


def read_source(run: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((run / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def data_dir(cfg: TrainConfig, run: Path, seq_len: int | None = None) -> Path:
    """The packed folder of a prepared run: `data.path` itself when it is an `anchor pack` output, else RUN/data;
    with `schedule.phases`, the phase of `seq_len`'s, RUN/data-<seq_len>."""
    if cfg.schedule.phases:
        return run / f"{DATA_DIR}-{seq_len}"
    return Path(cfg.data.path) if (Path(cfg.data.path) / "pack.json").is_file() else run / DATA_DIR


def pack_data(cfg: TrainConfig, run: Path, progress: bool, target: Path) -> Path:
    """The packed folder to train on: `data.path` itself when it is an `anchor pack` output (checked
    against the config), else `target` (RUN/data, or a phase's RUN/data-<seq_len>), packed from the corpus once
    and reused on resume (`clear_stale_packs` removed any packed with other settings)."""
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
        check_tokenizer(cfg, packed.meta, data)
        return data
    if cfg.data.seq_len is None:
        raise InputError("data.seq_len is required when data.path is a corpus packed on the fly",
                         path=cfg.where("data.path"))
    if (target / "pack.json").is_file():  # packed with these settings (`clear_stale_packs`), named by its length
        return target

    source: str | Path = cfg.data.path
    if cfg.data.path == "corpus":
        if not (run / "corpus" / CORPUS_FILE).is_file():  # written whole or not at all; one for every phase
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


def check_tokenizer(cfg: TrainConfig, meta: dict[str, Any], where: Path) -> None:
    tok = load_tokenizer(cfg.model.name)
    ident = (meta.get("tokenizer") or {}).get("identity")
    if ident is not None and ident != tok.identity:
        raise InputError(f"the packed data was tokenized with another tokenizer than the model {cfg.model.name!r}'s",
                         path=where)


def clear_stale_packs(run: Path, source: dict[str, Any]) -> None:
    """RUN/data and every phase's RUN/data-<seq_len> removed when RUN/data_source.json records other data or other
    packing settings than `source`: packed by an earlier attempt with another config that stopped before config.yaml
    (a resume with other settings is refused before this), packed again, never trained on silently."""
    old = read_source(run) or {}
    if all(old.get(k) == source.get(k) for k in ("fingerprint", "packed_with")):
        return
    for folder in [run / DATA_DIR, *run.glob(f"{DATA_DIR}-*")]:
        if folder.is_dir():
            shutil.rmtree(folder)


def phase_data(run_cfg: TrainConfig, phase: Phase, run: Path, spec: ModelSpec, seq_len: int | None,
                progress: bool) -> PackedData:
    """A phase's packed windows (`pack_data`: packed on the fly when needed), checked against its config: the
    model's vocabulary and positions (and, for a length only the packed data gave, `seq_len` None, the memory), one
    global batch left once its held-out windows are held out, eval.heldout_data's length."""
    cfg = phase.cfg
    data = pack_data(cfg, run, progress, data_dir(run_cfg, run, phase.seq_len))
    packed = PackedData.open(data)
    if cfg.data.seq_len is None:
        cfg = with_changes(cfg, {"data.seq_len": packed.seq_len})
    phased = bool(run_cfg.schedule.phases)  # a phase's own RoPE; its memory was checked before packing
    spec = check_model(cfg, model_spec(cfg) if phased else spec, packed.seq_len, memory=seq_len is None and not phased)
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
