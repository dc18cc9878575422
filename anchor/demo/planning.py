"""Planning, fingerprints and stage reuse: which stages run, which are reused, and the record (demo.json).

Every stage is recorded in `demo.json` with a fingerprint of its settings, its inputs' fingerprints and
anchor's version, the content of its folder when it finished (`stage_content`) and the files it wrote
(`files`), an id of that execution (`ran_id`) and the ids of the stages it read (`read`). A stage writes into
its own folder alone. A stage is reused where its fingerprint still matches, its folder still holds what it
wrote (files added since are kept), and the stages it reads have not run since it read them: a stage folder
another verb replaced (`anchor corpus --out DEMO/corpus`) or whose files changed runs again, and so does
every stage that reads it, in this demo or the next that selects it. A stage is redone only where that
removes nothing the demo did not write (`anchor train --out DEMO/train/anchor` adding a checkpoint): such
files are named and the demo stops before any work, unless `--fresh` asks for the stage anew. `train` and
`eval` resume where a killed demo left them (`RESUMABLE`) when the stages they read have not run since.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

from anchor_core.flops import matmul_params
from anchor.demo.page import index_page, summary_figure
from anchor.demo.settings import (
    DEMO_JSON,
    NEEDS,
    PROFILES,
    STAGES,
    TITLES,
    DemoSettings,
    parse_run,
    run_names,
    times_full,
)
from anchor.demo.stages import RUNNERS, StageContext
from anchor.demo.summary import write_summary
from anchor.eval.perplexity import heldout_windows
from anchor.eval.runner import tasks_that_do_not_fit
from anchor_core import __version__, machine
from anchor_core.atomic import write_text_atomic
from anchor_core.errors import InputError
from anchor_core.outdir import MARKER, guard_out, out_lock, read_marker, remove_stale_staging, rmtree, write_marker
from anchor_core.paths import resolve_model_name
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_spec

# Stages that a stopped demo continues (the same fingerprint): training from each run's newest checkpoint,
# evaluation from the checkpoint it was on (finished runs whole, finished checkpoints from their parts).
RESUMABLE = ("train", "eval")

# The settings each stage's result depends on (besides its inputs' fingerprints and the model file).
_KEYS = {"top5": ("model", "prompt", "policy"), "corpus": (), "pack": ("model", "seq_len", "budget"),
         "audit": ("model",),
         "train": ("model", "seq_len", "train_variants", "train_steps", "global_batch", "lr", "train_engine",
                   "train_dtype", "eval_every", "eval_window", "seed"),
         "parity": ("parity_seq_len", "parity_policies", "parity_grad_layers"),
         "eval": ("eval_tasks", "eval_lengths", "eval_samples", "eval_dtype", "eval_engine", "perplexity_windows",
                  "seed"),
         "bench": ("model", "bench_seq_lens", "bench_windows", "bench_repeats", "seed")}
# Settings hashed into a stage's fingerprint only where they differ from their default, so that a demo folder
# written by a version without them keeps its fingerprints (and is reused) while any other value changes them.
# Every field of DemoSettings is in _KEYS, here, or in _NOT_RESULTS (`unlisted_settings()`, tested).
_KEYS_IF_SET = {"pack": ("pack_docs",),
                "train": ("train_rope_theta", "zero_stage", "train_warmup_steps", "fp32_variants", "fp32_steps",
                          "fp32_eval_window", "only_runs", "timing_steps"),
                "eval": ("eval_batch_size", "eval_group_by_budget", "perplexity_docs", "perplexity_bucket",
                         "perplexity_data", "only_runs")}
# Fields that change no stage's result: what runs by default, and where the summary goes.
_NOT_RESULTS = ("stages", "summary_json")
# A stage folder's files up to this size count by their bytes in `stage_content`, larger ones by their size:
# the large ones are checkpoint weights and optimizer states, whose sha256 each checkpoint's manifest.json
# holds, so checking a demo for reuse reads megabytes, not the checkpoints' gigabytes.
_HASHED_BYTES = 64 << 20


def check_steps(steps: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`--steps` as a tuple of known stage names, in the pipeline's order; none or an unknown one is an InputError."""
    items = [x.strip() for x in steps.split(",")] if isinstance(steps, str) else [str(x).strip() for x in steps]
    items = [x for x in items if x]
    if not items:
        raise InputError(f"--steps: no step given: select at least one stage ({', '.join(STAGES)})")
    unknown = [x for x in items if x not in STAGES]
    if unknown:
        raise InputError(f"--steps: unknown demo stage {unknown[0]!r} (stages: {', '.join(STAGES)})")
    return tuple(x for x in STAGES if x in items)


def plan(steps: tuple[str, ...]) -> tuple[str, ...]:
    """The selected stages and every stage they need, in the pipeline's order."""
    want: set[str] = set()

    def add(x: str) -> None:
        if x not in want:
            want.add(x)
            for y in NEEDS.get(x, ()):
                add(y)

    for x in steps:
        add(x)
    return tuple(x for x in STAGES if x in want)


def _model_identity(model: str) -> dict[str, Any]:
    try:
        path = Path(resolve_model_name(model))
    except Exception:  # noqa: BLE001 - the stages report a bad model themselves
        return {"name": model}
    if path.is_file():
        st = path.stat()
        return {"name": model, "path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file())
        return {"name": model, "path": str(path.resolve()),
                "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    return {"name": model}


def fingerprints(settings: DemoSettings) -> dict[str, str]:
    """sha256 (16 hex) per stage of its settings, its inputs' fingerprints, the model file and anchor's version."""
    d = asdict(settings)
    default = asdict(DemoSettings())
    ident = _model_identity(settings.model)
    fps: dict[str, str] = {}
    for stage in STAGES:
        keys = {k: d[k] for k in _KEYS[stage]}
        keys.update({k: d[k] for k in _KEYS_IF_SET.get(stage, ()) if d[k] != default[k]})
        blob = {"stage": stage, "version": __version__, "settings": keys,
                "needs": {x: fps[x] for x in NEEDS.get(stage, ())}}
        if "model" in _KEYS[stage]:
            blob["model"] = ident
        text = json.dumps(blob, sort_keys=True, default=list)
        fps[stage] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return fps


def unlisted_settings() -> list[str]:
    """Fields of DemoSettings that no stage's fingerprint names and that are not marked as changing no
    result ([] when the fingerprints are complete)."""
    from dataclasses import fields

    listed = {k for keys in (*_KEYS.values(), *_KEYS_IF_SET.values()) for k in keys} | set(_NOT_RESULTS)
    return [f.name for f in fields(DemoSettings) if f.name not in listed]


def read_record(out: Path) -> dict[str, Any]:
    """demo.json of an earlier demo in `out` ({} when none or unreadable)."""
    try:
        d = json.loads((out / DEMO_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) and isinstance(d.get("stages"), dict) else {}


def _stage_done(out: Path, stage: str, rec: dict[str, Any] | None, fp: str) -> bool:
    return bool(rec and rec.get("done") and rec.get("fingerprint") == fp and read_marker(out / stage) is not None)


def stage_content(folder: Path) -> str | None:
    """sha256 (16 hex) of what a stage folder holds: each file's path in it, its size and, up to
    `_HASHED_BYTES`, its bytes (the marker's among them), each link's target; None where the folder is missing
    or cannot be read (it then matches no record)."""
    scan = scan_stage(folder)
    return None if scan is None else scan[0]


def scan_stage(folder: Path) -> tuple[str, dict[str, str]] | None:
    """`stage_content` and the file list it is computed from: each file's path in the folder (posix, relative)
    with `<size>:<sha256 16 hex>` (`<size>` alone above `_HASHED_BYTES`, `link:<target>` for a link); None where
    the folder is missing or cannot be read."""
    if not folder.is_dir() or folder.is_symlink():
        return None
    h = hashlib.sha256()
    files: dict[str, str] = {}
    try:
        for root, dirs, names in os.walk(folder, onerror=_raise):
            dirs.sort()
            for name in sorted(names + [d for d in dirs if os.path.islink(os.path.join(root, d))]):
                p = Path(root) / name
                rel = p.relative_to(folder).as_posix()
                if p.is_symlink():
                    h.update(json.dumps([rel, "link", os.readlink(p)]).encode())
                    files[rel] = f"link:{os.readlink(p)}"
                    continue
                size = p.stat().st_size
                h.update(json.dumps([rel, size]).encode())
                files[rel] = str(size)
                if size <= _HASHED_BYTES:
                    digest = hashlib.sha256(p.read_bytes()).digest()
                    h.update(digest)
                    files[rel] += f":{digest.hex()[:16]}"
    except OSError:
        return None
    return h.hexdigest()[:16], files


def _raise(e: OSError) -> None:
    raise e


Scan = tuple[str, dict[str, str]] | None  # scan_stage's: a stage folder's content and its file list


class _Scans:
    """Each stage folder scanned once in a demo run (`scan_stage` reads every file up to `_HASHED_BYTES`): the
    reuse checks before any stage runs and those as each one comes read the same scan; a stage's is forgotten
    when its folder is cleared or written."""

    def __init__(self, out: Path):
        self.out, self._scans = out, {}

    def __call__(self, stage: str) -> Scan:
        if stage not in self._scans:
            self._scans[stage] = scan_stage(self.out / stage)
        return self._scans[stage]

    def forget(self, stage: str) -> None:
        self._scans.pop(stage, None)


def added_files(stage: str, rec: dict[str, Any] | None, scan: Scan) -> list[str] | None:
    """What is in the stage folder (`scan`) that the stage's recorded execution did not write: each added folder
    once (`stage/<path>/`: no file the stage wrote lies under it) and each added file in a folder the stage wrote
    (`stage/<path>`), sorted; [] where there is none or the folder is gone; None where the record has no file
    list (a demo folder written before stages recorded theirs: which files are whose is not known)."""
    had = (rec or {}).get("files")
    if not isinstance(had, dict):
        return None
    if scan is None:
        return []
    written_dirs = {"/".join(k.split("/")[:i]) for k in had for i in range(1, k.count("/") + 1)}
    items = set()
    for rel in set(scan[1]) - set(had):
        parts = rel.split("/")
        top = next((i for i in range(1, len(parts)) if "/".join(parts[:i]) not in written_dirs), None)
        items.add(rel if top is None else "/".join(parts[:top]) + "/")
    return [f"{stage}/{x}" for x in sorted(items)]


def _changed(stage: str, rec: dict[str, Any], read: dict[str, str | None], scan: Scan) -> tuple[str | None, list[str]]:
    """Why the finished stage `rec` cannot be reused though its settings are unchanged (a stage it reads ran
    again since it read it, or its folder, `scan`, no longer holds what it wrote), or None where it can; and
    what was added to its folder since, where it is reused with that (every file it wrote still there
    unchanged)."""
    had = rec.get("read") or {}
    moved = [n for n in read if had.get(n) != read[n]]
    if moved:
        return f"the {moved[0]} stage it reads was run again since", []
    if rec.get("content") is not None and scan is not None and scan[0] == rec["content"]:
        return None, []
    files = rec.get("files")
    if rec.get("content") is not None and isinstance(files, dict) and scan is not None \
            and all(scan[1].get(k) == v for k, v in files.items()):
        return None, added_files(stage, rec, scan) or []
    return f"{stage}/ no longer holds what this stage wrote: replaced, or its files changed", []


def _name_files(files: list[str]) -> str:
    """At most three of `files` and how many more."""
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return ", ".join(files[:3]) + more


def _check_nothing_added(out: Path, stage: str, rec: dict[str, Any] | None, why: str | None, fresh: bool,
                         say: Callable[[str], None], scan: Scan) -> None:
    """Before a finished stage's folder is redone (`why`: the reason it is not reused; None: its settings
    changed): what was added to it since the stage wrote it (a checkpoint `anchor train --out` added to a demo
    run, a user's notes) is never removed silently: an InputError naming it, unless `--fresh` asked for the
    stage anew (then a line names what goes)."""
    added = added_files(stage, rec, scan)
    if not added:
        return
    if not fresh:
        raise InputError(f"the {stage} stage must run again ({why or 'its settings changed'}); redoing it would "
                         f"remove what the demo did not write: {_name_files(added)}; move that away, or pass --fresh "
                         "to redo the stage anyway", path=out / stage)
    say(f"    --fresh: removing what the demo did not write: {_name_files(added)}")


def _clear(out: Path, stage: str) -> None:
    """Remove a stage folder before it is redone: only one anchor wrote (its marker)."""
    path = out / stage
    if not path.exists():
        return
    if read_marker(path) is None and any(path.iterdir()):
        raise InputError(f"the demo's stage folder holds files anchor did not write (no {MARKER}); "
                         "move them away or name another --out", path=path)
    rmtree(path)


def run_demo(model: str = "default", out: str | Path = "runs/demo", *, steps: tuple[str, ...] | None = None,
             settings: DemoSettings | None = None, fresh: bool = False, say: Callable[[str], None] = print,
             progress: bool = True, **overrides: Any) -> dict[str, Any]:
    """Run (or reuse) the selected stages into the demo folder `out`. Returns the record written to demo.json.

    `steps`: the stages to run (None: the profile's, `settings.stages`). `overrides` replace fields of
    `settings` (default: the `demo` profile), e.g. seq_len=512."""
    s = replace(settings or PROFILES["demo"], model=model, **overrides)
    s, dtype_choice = resolve_dtype(s)  # before the fingerprints: a run in bf16 is another result than in fp32
    steps = check_steps(s.stages if steps is None else steps)
    pol_file = s.policy if s.policy.endswith((".yaml", ".yml")) else None
    out = guard_out(out, "demo", inputs=(model, pol_file), replace=False)
    todo = plan(steps)
    t0 = time.time()
    _check_model(s.model)  # a bad model fails before the folder exists
    s, left_out = feasible(s, todo)  # and a task that cannot run is left out before any work
    if "train" in todo:
        check_disk(s, out)  # the runs' checkpoints fit the disk
    for line in left_out:
        say(f"left out: {line}")
    fps = fingerprints(s)
    created = not out.exists() or not any(out.iterdir())
    with out_lock(out, "demo"):
        try:
            return _run_stages(out, s, steps, todo, fps, fresh, say, progress, t0, left_out, dtype_choice)
        except BaseException:
            if created and not any(r.get("done") for r in read_record(out).get("stages", {}).values()):
                _remove_own_files(out)  # nothing finished: leave no half-written demo folder behind
            raise


def _remove_own_files(out: Path) -> None:
    """Remove what this demo wrote in `out` (its record, page, figure, marker, stage folders with their
    markers, staging leftovers), then `out` itself if nothing else is left: files a user put there
    meanwhile stay, and so does the folder holding them."""
    if not out.is_dir():
        return
    for p in out.iterdir():
        own = (p.name in (DEMO_JSON, "index.html", "summary.png", MARKER) or p.name in _summary_names()
               or (p.is_dir() and p.name in STAGES and read_marker(p) is not None)
               or (p.name.startswith(".") and (".tmp-" in p.name or p.name.startswith(".parity-model-"))))
        if own:
            rmtree(p) if p.is_dir() else p.unlink()
    if not any(out.iterdir()):
        out.rmdir()


def _summary_names() -> set[str]:
    """The summary JSON names of every profile (files the demo writes into its folder)."""
    return {p.summary_json for p in PROFILES.values() if p.summary_json}


def choose_dtype() -> dict[str, Any]:
    """The demo's training and evaluation dtype on this machine, and why: bfloat16 where it has bf16 units
    (CUDA; a CPU with avx512_bf16 or AMX, anchor_core.machine.cpu_bf16): it multiplies bf16 natively (a 1024²
    matmul ran 3.1x faster than in fp32 on a 2-core AVX-512-bf16 EPYC, anchor/eval/dtype.py), and the
    runs train in the precision whose effect on RoPE the paper is about; float32 elsewhere, where bf16 is
    emulated and 3-6x slower (anchor_core.machine)."""
    import torch


    if torch.cuda.is_available():
        return {"dtype": "bfloat16", "reason": f"a CUDA GPU ({torch.cuda.get_device_name(0)}) multiplies bf16 "
                                               "natively (the paper's precision)", "bf16_units": ["cuda"]}
    units = machine.cpu_bf16()
    if units:
        return {"dtype": "bfloat16", "reason": f"this CPU has bf16 units ({', '.join(units)}): it multiplies bf16 "
                                               "natively, and the runs train in the precision the paper is about",
                "bf16_units": units}
    return {"dtype": "float32", "reason": "this CPU has no bf16 units (no avx512_bf16, no AMX): bf16 would be "
                                          "emulated, slower than fp32", "bf16_units": []}


def resolve_dtype(s: DemoSettings) -> tuple[DemoSettings, dict[str, Any] | None]:
    """`s` with a `train_dtype` of `auto` resolved by `choose_dtype` (evaluation too, where it is `auto`; ZeRO-1
    in bf16, which the trainer needs), and the choice; `s` and None where the dtype is given."""
    if s.train_dtype != "auto":
        return s, None
    choice = choose_dtype()
    dtype = choice["dtype"]
    zero = max(s.zero_stage, 1) if dtype == "bfloat16" else s.zero_stage
    return replace(s, train_dtype=dtype, zero_stage=zero,
                   eval_dtype=dtype if s.eval_dtype == "auto" else s.eval_dtype), choice


def feasible(s: DemoSettings, todo: tuple[str, ...]) -> tuple[DemoSettings, list[str]]:
    """The settings with what cannot run on this model left out, and a line for each thing left out; an
    InputError (before any work) where nothing of a stage would be left. What is left out: the RULER tasks whose prompts
    do not fit every evaluation length with the model's tokenizer (a byte-level tokenizer needs ~1.7K tokens
    for `vt`); they are left out of the whole grid, so every length averages the same tasks."""
    if "eval" not in todo:
        return s, []

    tok = load_tokenizer(s.model)
    if s.perplexity_windows and s.perplexity_docs == "long":  # enough long held-out documents, before training

        heldout_windows(tok, max(s.eval_lengths), s.perplexity_windows, s.perplexity_data or None,
                        whole_documents=True)
    misfits = tasks_that_do_not_fit(tok, s.eval_tasks, s.eval_lengths, s.eval_samples, s.seed)
    if not misfits:
        return s, []
    keep = tuple(t for t in s.eval_tasks if t not in misfits)
    if not keep:
        first = next(iter(misfits.values()))
        raise InputError(f"no RULER task of the demo fits its evaluation lengths "
                         f"{', '.join(map(str, s.eval_lengths))} with the model {s.model!r}'s tokenizer ({first}); "
                         "give longer lengths or leave out the eval stage (--steps)")
    return replace(s, eval_tasks=keep), [f"RULER {t}: {why}" for t, why in misfits.items()]


def bytes_per_param(dtype: str, zero_stage: int) -> int:
    """A checkpoint's bytes per parameter: DeepSpeed's module (4 in fp32, 2 in bf16), AdamW's two moments (8),
    ZeRO >= 1's fp32 copy of the parameters (4), and hf/ in the training dtype (4 in fp32, 2 in bf16). 16 in fp32
    under ZeRO-0: SmolLM2-135M's measured 2.1 GB is 15.6. `auto` counts fp32's (16 either way: bf16 trains under
    ZeRO-1)."""
    elem = 2 if dtype == "bfloat16" else 4
    return elem + 8 + (4 if zero_stage >= 1 else 0) + elem


def checkpoint_bytes(s: DemoSettings) -> int:
    """About how many bytes the `train` stage's checkpoints take: every run's evaluation checkpoints and its
    last (kept for good), `bytes_per_param` each."""
    spec = load_spec(s.model)
    params = matmul_params(spec) + (0 if spec.tie_embeddings else spec.vocab_size * spec.hidden_size)
    total = 0
    for run in run_names(s):
        r = parse_run(s, run)
        steps, window = r["steps"], r["eval_window"]
        count = len({k for k in range(1, steps + 1) if steps - k < window and (steps - k) % s.eval_every == 0}
                    | {steps})
        total += count * params * bytes_per_param(r["dtype"], s.zero_stage)
    if times_full(s):  # its last checkpoint
        total += params * bytes_per_param(s.train_dtype, s.zero_stage)
    return total


def check_disk(s: DemoSettings, out: Path) -> None:
    """The checkpoints still to write (checkpoint_bytes less what `out/train` holds) against the disk's free
    space: one line and exit 2 before any work, where they would not fit."""
    need = checkpoint_bytes(s)
    train = out / "train"
    have = sum(f.stat().st_size for f in train.rglob("*") if f.is_file()) if train.is_dir() else 0
    where = out
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if need - have > free:
        raise InputError(f"the training runs' checkpoints need about {(need - have) / 1e9:.1f} GB "
                         f"({len(run_names(s))} runs, their evaluation checkpoints and last ones); "
                         f"{free / 1e9:.1f} GB are free here: free some space or name an --out on a larger disk",
                         path=where)


def _check_model(model: str) -> None:
    """The model exists and its config reads (weights and tokenizer are checked by the first stage that loads
    them; a failure before any stage finished removes the folder it created)."""
    load_spec(model)


def _run_stages(out: Path, s: DemoSettings, steps: tuple[str, ...], todo: tuple[str, ...], fps: dict[str, str],
                fresh: bool, say: Callable[[str], None], progress: bool, t0: float,
                left_out: list[str], dtype_choice: dict[str, Any] | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "demo")
    for stage in STAGES:
        remove_stale_staging(out / stage)
    for tmp in out.glob(".parity-model-*"):  # the cut model of a killed parity stage
        shutil.rmtree(tmp, ignore_errors=True)
    old = read_record(out)
    record: dict[str, Any] = {"model": s.model, "settings": asdict(s), "stages": dict(old.get("stages", {})),
                              "ran": [], "reused": [], "selected": list(steps), "left_out": left_out}
    if dtype_choice:
        record["dtype_choice"] = dtype_choice
        say(f"dtype: {dtype_choice['dtype']} ({dtype_choice['reason']})")
    ctx = StageContext(out, s, progress, say, record["stages"])
    scans = _Scans(out)
    _preflight(out, todo, record["stages"], fps, fresh, scans)
    for i, stage in enumerate(todo, 1):
        rec = record["stages"].get(stage)
        # the executions of the stages this one reads (earlier in `todo`: run or reused by now)
        read = {n: (record["stages"].get(n) or {}).get("ran_id") for n in NEEDS.get(stage, ())}
        action, changed, added = _decide(out, stage, rec, fps[stage], read, fresh, scans)
        if action == "reuse":
            kept = f"; kept what was added since: {_name_files(added)}" if added else ""
            say(f"[{i}/{len(todo)}] {stage}: reused (finished {rec['finished']}, settings unchanged{kept})")
            record["reused"].append(stage)
            continue
        if changed is not None:
            say(f"[{i}/{len(todo)}] {stage}: not reused: {changed}")
        resumable = action == "resume"
        if not resumable:
            _check_nothing_added(out, stage, rec, changed, fresh, say, scans(stage))
            _clear(out, stage)
        scans.forget(stage)  # written from here on
        say(f"[{i}/{len(todo)}] {stage}: {TITLES[stage]}")
        # the seconds of the attempts a signal stopped (SIGTERM, Ctrl-C: they unwind) that this one resumes
        earlier = list(rec.get("stopped_attempts_s", [])) if resumable else []
        record["stages"][stage] = {"fingerprint": fps[stage], "done": False, "started": _now(),
                                   "stopped_attempts_s": earlier, "read": read}
        _write_record(out, record, t0)
        t = time.time()
        try:
            summary = RUNNERS[stage](ctx)
        except BaseException:
            record["stages"][stage]["stopped_attempts_s"] = [*earlier, round(time.time() - t, 1)]
            _write_record(out, record, t0)
            raise
        seconds = round(time.time() - t, 1)
        content, files = scans(stage) or (None, None)
        record["stages"][stage] = {"fingerprint": fps[stage], "done": True, "started": record["stages"][stage]["started"],
                                   "finished": _now(), "seconds": seconds, "stopped_attempts_s": earlier,
                                   "seconds_all_attempts": round(seconds + sum(earlier), 1), "summary": summary,
                                   "read": read, "content": content, "files": files,
                                   "ran_id": secrets.token_hex(8)}
        record["ran"].append(stage)
        _write_record(out, record, t0)
        index_page(out, record, fps)
    record["seconds"] = round(time.time() - t0, 1)
    _write_record(out, record, t0)
    summary_figure(out, record)
    if write_summary(out, record, s) is not None:
        record["summary_json"] = s.summary_json
        _write_record(out, record, t0)
    index_page(out, record, fps)
    return record


def _decide(out: Path, stage: str, rec: dict[str, Any] | None, fp: str, read: dict[str, str | None],
            fresh: bool, scans: _Scans) -> tuple[str, str | None, list[str]]:
    """What becomes of a stage: `reuse` (finished, same settings and inputs, its folder as it left it or only
    added to), `resume` (a stopped `RESUMABLE` stage on the same settings and inputs) or `redo`; why a finished
    stage is not reused (None where that is not the reason); the files added to a reused stage's folder."""
    changed = None
    if not fresh and _stage_done(out, stage, rec, fp):
        changed, added = _changed(stage, rec, read, scans(stage))
        if changed is None:
            return "reuse", None, added
    # a stopped stage continues only on the same settings and the same executions of what it reads
    resumable = (stage in RESUMABLE and not fresh and changed is None and rec is not None
                 and rec.get("fingerprint") == fp and rec.get("read") == read)
    return ("resume" if resumable else "redo"), changed, []


def _preflight(out: Path, todo: tuple[str, ...], stages: dict[str, Any], fps: dict[str, str], fresh: bool,
               scans: _Scans) -> None:
    """Before any stage runs: every stage that will be redone, decided as the loop will (a stage redone gives
    the stages reading it a new input), is checked for files added to its folder since the demo wrote it, so
    a refusal comes before any work."""
    ran_ids = {n: (r or {}).get("ran_id") for n, r in stages.items()}
    for stage in todo:
        read = {n: ran_ids.get(n) for n in NEEDS.get(stage, ())}
        action, changed, _ = _decide(out, stage, stages.get(stage), fps[stage], read, fresh, scans)
        if action != "reuse":
            ran_ids[stage] = f"to run: {stage}"
        if action == "redo" and not fresh:
            _check_nothing_added(out, stage, stages.get(stage), changed, fresh, lambda _: None, scans(stage))


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def _write_record(out: Path, record: dict[str, Any], t0: float) -> None:
    record["seconds"] = round(time.time() - t0, 1)
    record["finished"] = _now()
    write_text_atomic(out / DEMO_JSON, json.dumps(record, indent=1, ensure_ascii=False, default=str))
