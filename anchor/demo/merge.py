"""`anchor demo --merge PART [PART ...] --out DIR`: one demo folder from parts that each ran some of the runs.

A profile whose runs are better spread over several machines or sittings (paper-gpu on several GPUs at once, or
where no GPU is free for all its runs; its checkpoints stay on the machine that wrote them) runs in parts: `anchor demo --profile P
--runs full,intra_doc --out part1`, another part with other runs, each trained and evaluated to its end where
it ran. A part needs to come back with `demo.json`, each run's `eval/<run>/eval.json` and, if it has one, the
profile's summary JSON (its machine); no checkpoint.

A part is input the merge did not write: every file it reads from one is checked before anything is
written, and no path read from a part names a file (the runs' names are the profile's variants, checked;
the summary JSON is a profile's name, never the part's). Each demo.json has the shape and types a demo writes;
each run's eval.json is valid JSON of the part's evaluation (its seed, tasks, lengths, samples, resolved dtype
and engine, this run's checkpoints, the scores the part's demo.json holds); each run's metrics.jsonl and
config.yaml, where the part has them, hold the steps, losses, variant and dtype its demo.json records. The
merge then checks that the parts are one experiment: the same model bytes (`model_identity` in the train
summary; a part without it is named to be run again) and settings but for `only_runs`, the same resolved
evaluation (`eval_dtype` auto resolves per machine: the dtype it resolved to must be the same), the same
packed windows (the `pack` job's fingerprint: same corpus, tokenizer, window and budget), their `train` and
`eval` jobs finished, no run in two parts, no part given twice. It then writes what one demo of all the runs
writes (demo.json, index.html, summary.png, the figures, the summary JSON), with the parts' machines and
seconds in `merged_from`. Step times are compared with `full`'s only within a part (`jobs.step_time_ratios`):
a part without `full` times full's first `timing_steps` steps itself. Bad parts get one line and exit 2, and
no folder.

`--out` is a new or empty folder, or an earlier merge (its marker's verb is `MERGE_VERB`): a merge never
replaces a demo that ran its jobs (its checkpoints are not the merge's to delete) nor another verb's folder.
"""

from __future__ import annotations

import json
import time
import typing
from dataclasses import MISSING, asdict, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from anchor.demo.jobs import _run_scores, eval_figures, step_time_ratios, train_figures
from anchor.demo.page import index_page, summary_figure
from anchor.demo.settings import DEMO_JSON, PROFILES, DemoSettings, all_run_names, parse_run, upgrade_record
from anchor.demo.summary import job_seconds_all_attempts, reset_effect, write_summary
from anchor_core.atomic import publish, staging_dir
from anchor_core.errors import InputError
from anchor_core.limits import excerpt
from anchor_core.outdir import write_marker
from anchor_core.variants import VARIANTS
from anchor_core.yamlfile import parse_yaml

# The verb in a merge's marker: a merge replaces only a merge (never a demo that ran its jobs, nor another
# verb's folder), and `anchor demo` never runs its jobs over a merge
MERGE_VERB = "demo --merge"

_PART_FILES = ("metrics.jsonl", "config.yaml")  # per run under train/<run>/, linked from the page
# The summary JSON a part may carry: a profile's, never a name read from the part (it names a file the merge
# reads from the part and writes into --out)
_SUMMARY_NAMES = frozenset(p.summary_json for p in PROFILES.values() if p.summary_json)
# What the parts' evaluation summaries must share: the resolved evaluation (eval_dtype `auto` resolves per
# machine; the summary holds what it resolved to), not the settings that asked for it
_EVAL_SHARED = ("tasks", "lengths", "samples", "dtype", "engine", "perplexity_docs", "perplexity_windows",
                "perplexity_bucket")


def _bad(what: str, where: Path) -> InputError:
    return InputError(f"not a demo part anchor wrote: {what}", path=where)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _typed(x: Any, default: Any, hint: Any) -> bool:
    """Whether the JSON value `x` fits a DemoSettings field of this default and type hint."""
    if default is None:  # the Optional numbers: None or a number
        return x is None or _is_num(x)
    if isinstance(default, bool):
        return isinstance(x, bool)
    if isinstance(default, int):
        return _is_int(x)
    if isinstance(default, float):
        return _is_num(x)
    if isinstance(default, str):
        return isinstance(x, str)
    if isinstance(default, tuple):
        item = typing.get_args(hint)[0] if typing.get_args(hint) else str
        check = {int: _is_int, float: _is_num, str: lambda y: isinstance(y, str)}[item]
        return isinstance(x, list) and all(check(y) for y in x)
    return False


def _settings(d: Any, where: Path) -> DemoSettings:
    """The part's settings, every value of the type its field has; an InputError naming the first that is not."""
    if not isinstance(d, dict):
        raise _bad("settings is not an object", where)
    hints = typing.get_type_hints(DemoSettings)
    known = {f.name: f for f in fields(DemoSettings)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise InputError(f"demo.json: settings key {unknown[0]!r} is not one this anchor knows", path=where)
    for k, v in d.items():
        f = known[k]
        default = f.default if f.default is not MISSING else None
        if not _typed(v, default, hints[k]):
            raise _bad(f"settings {k} is {json.dumps(v)[:60]}, not a value of its type", where)
    s = DemoSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    bad = [v for v in (*s.train_variants, *s.fp32_variants) if v not in VARIANTS]
    if bad:
        raise _bad(f"settings name the attention variant {bad[0]!r} (known: {', '.join(VARIANTS)})", where)
    if set(s.only_runs) - set(all_run_names(s)):
        raise _bad("settings only_runs names a run the profile does not have", where)
    if s.summary_json and s.summary_json not in _SUMMARY_NAMES:
        raise _bad(f"settings summary_json {s.summary_json!r} is no profile's summary JSON", where)
    return s


def _obj(x: Any, what: str, where: Path) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise _bad(f"{what} is not an object", where)
    return x


def _read_json(path: Path) -> Any:
    """A JSON file of a part (a plain file: a link could name any file on this machine)."""
    return _read_json_bytes(path)[0]


def _read_json_bytes(path: Path) -> tuple[Any, bytes]:
    """(the JSON value, the bytes it was read from) of a plain file of a part."""
    if path.is_symlink() or not path.is_file():
        raise InputError("not a plain file in the part (missing, or a link)", path=path)
    try:
        data = path.read_bytes()
        return json.loads(data.decode("utf-8")), data
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"unreadable JSON ({e})", path=path) from None


# Per run, what the merge and the page read from the part's job summaries, with their types
_TRAIN_RUN = {"steps": _is_int, "loss": lambda x: isinstance(x, list) and all(_is_num(y) for y in x),
              "step_s_median": lambda x: _is_num(x) and x > 0, "dtype": lambda x: isinstance(x, str),
              "variant": lambda x: isinstance(x, str), "eval_checkpoints": lambda x: isinstance(x, list)
              and all(isinstance(y, str) for y in x), "flop_ratio": lambda x: isinstance(x, dict),
              "device": lambda x: x is None or isinstance(x, str),
              "full_timing": lambda x: x is None or (isinstance(x, dict) and _is_int(x.get("steps"))
                                                      and _is_num(x.get("step_s_median")) and x["step_s_median"] > 0)}
_OPTIONAL = ("device", "full_timing")
_EVAL_RUN = {"checkpoints": lambda x: isinstance(x, list) and all(isinstance(y, str) for y in x),
             "scores": lambda x: isinstance(x, dict), "tasks": lambda x: isinstance(x, list),
             "perplexity": lambda x: isinstance(x, dict) and all(_is_num(y) for y in x.values()),
             "nll": lambda x: isinstance(x, dict) and all(_is_num(y) for y in x.values()),
             "buckets": lambda x: isinstance(x, dict), "runtime_s": _is_num}


def _check_run(v: str, s: DemoSettings, t: Any, e: Any, where: Path) -> None:
    """The part's train and eval summaries of run `v`: their shape, and the run the settings make (its variant,
    dtype and steps, the checkpoints the evaluation schedule keeps)."""
    t, e = _obj(t, f"train run {v!r}", where), _obj(e, f"eval run {v!r}", where)
    for table, rec, job in ((_TRAIN_RUN, t, "train"), (_EVAL_RUN, e, "eval")):
        for k, ok in table.items():
            if (k not in rec and k not in _OPTIONAL) or not ok(rec.get(k)):
                raise _bad(f"{job} run {v!r}: {k} missing or not of its type", where)
    r = parse_run(s, v)
    for k in ("variant", "dtype", "steps"):
        if t[k] != r[k]:
            raise InputError(f"run {v!r} trained with {k} {t[k]!r}, its settings make {r[k]!r}: not a run of "
                             "this experiment", path=where)
    if e["checkpoints"] != t["eval_checkpoints"]:
        raise InputError(f"run {v!r}: its evaluation read checkpoints {e['checkpoints']}, its training kept "
                         f"{t['eval_checkpoints']} for evaluation", path=where)


def _check_eval_json(path: Path, v: str, s: DemoSettings, ev: dict[str, Any], run: dict[str, Any]) -> bytes:
    """Run `v`'s eval.json: a whole evaluation (valid JSON of the shape `write_eval` writes) of this experiment
    (the part's resolved evaluation settings and seed) whose scores are those the part's record holds."""
    r, data = _read_json_bytes(path)
    if not isinstance(r, dict) or not isinstance(r.get("settings"), dict) or not isinstance(r.get("rows"), list) \
            or not isinstance(r.get("checkpoints"), list) or not isinstance(r.get("perplexity"), list):
        raise InputError("not an evaluation anchor wrote (settings, checkpoints, rows, perplexity)", path=path)
    got = r["settings"]
    want = {"seed": s.seed, "samples": ev["samples"], "tasks": ev["tasks"], "lengths": ev["lengths"],
            "dtype": ev["dtype"], "engine": ev["engine"]}
    for k, x in want.items():
        if got.get(k) != x:
            raise InputError(f"evaluated with {k} {got.get(k)!r}, the part's evaluation has {x!r}: an evaluation of "
                             "another experiment", path=path)
    try:
        labels = [c["label"] for c in r["checkpoints"]]
        if any(_checkpoint_of(c["source"]) != ("train", v, "checkpoints", c["label"]) for c in r["checkpoints"]):
            raise InputError(f"it evaluated checkpoints of another run than {v!r} (train/{v}/checkpoints/...)",
                             path=path)
        scores = {str(L): x for L, x in _run_scores(r).items()}
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise InputError(f"not an evaluation anchor wrote ({type(e).__name__}: {e})", path=path) from None
    if labels != run["checkpoints"] or json.dumps(scores, sort_keys=True) != json.dumps(run["scores"], sort_keys=True):
        raise InputError(f"its checkpoints or scores are not those the part's demo.json holds for run {v!r}: "
                         "an evaluation of another run or experiment", path=path)
    return data


def _checkpoint_of(source: str) -> tuple[str, ...]:
    """The last four parts of an evaluated checkpoint's folder, `train/<run>/checkpoints/<label>` (its `hf/` in it
    stands for it)."""
    parts = Path(source).parts
    return parts[:-1][-4:] if parts and parts[-1] == "hf" else parts[-4:]


def _check_part_file(path: Path, name: str) -> bytes | None:
    """A run's metrics.jsonl (JSON objects, a line each) or config.yaml (a YAML mapping), as its bytes; None
    where the part has none."""
    if not (path.exists() or path.is_symlink()):
        return None
    if path.is_symlink() or not path.is_file():
        raise InputError("not a plain file in the part (a link, or a folder)", path=path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
        if name == "metrics.jsonl":
            ok = all(isinstance(json.loads(line), dict) for line in text.splitlines() if line.strip())
        else:
            ok = isinstance(parse_yaml(text, where=str(path)), dict)  # bounded: aliases cannot expand it
    except InputError:
        raise
    except Exception as e:  # UnicodeDecodeError, ValueError (JSON)
        raise InputError(f"unreadable ({type(e).__name__})", path=path) from None
    if not ok:
        raise InputError(f"not the {name} a training run writes", path=path)
    return data


def read_part(part: Path, summary_json: str | None = None) -> dict[str, Any]:
    """A part's record, settings, runs, machine and files, every one checked; an InputError where it is not a
    finished demo part. `summary_json`: the summary JSON the profile writes (the part's must be that one)."""
    path = part / DEMO_JSON
    if not (path.exists() or path.is_symlink()):
        raise InputError("no demo.json here: not a demo folder", path=part)
    record = upgrade_record(_read_json(path))  # a part an earlier version wrote: its jobs under the old key
    if not isinstance(record, dict):
        raise _bad("not an object", path)
    s = _settings(record.get("settings"), path)
    jobs = _obj(record.get("jobs"), "jobs", path)
    for st in ("corpus", "pack", "train", "eval"):
        _obj(jobs.get(st) or {}, f"job {st}", path)
    for st in ("pack", "train", "eval"):
        if not (jobs.get(st) or {}).get("done"):
            raise InputError(f"its {st} job did not finish: finish the part (run the same command again) first",
                             path=part)
    train = _obj(jobs["train"].get("summary"), "train summary", path)
    ev = _obj(jobs["eval"].get("summary"), "eval summary", path)
    truns, eruns = _obj(train.get("runs"), "train runs", path), _obj(ev.get("runs"), "eval runs", path)
    names = all_run_names(s)
    runs = [v for v in names if v in truns]
    if [v for v in truns if v not in names]:
        raise _bad(f"its train job holds run {next(v for v in truns if v not in names)!r}, not one of its "
                   "profile's runs", path)
    if s.only_runs and runs != [v for v in names if v in s.only_runs]:
        raise _bad("the runs it trained are not those its settings (only_runs) name", path)
    for k in _EVAL_SHARED:
        if k not in ev:
            raise _bad(f"eval summary: {k} missing", path)
    if not isinstance(ev["dtype"], str) or not _is_int(ev["samples"]) or not isinstance(ev["tasks"], list) \
            or not isinstance(ev["lengths"], list):
        raise _bad("eval summary: dtype, samples, tasks or lengths not of its type", path)
    for v in runs:
        if v not in eruns or not (part / "eval" / v / "eval.json").is_file():
            raise InputError(f"run {v!r} has no evaluation (eval/{v}/eval.json)", path=part)
        _check_run(v, s, truns[v], eruns[v], path)
    if (s.summary_json or None) != (summary_json or None) and summary_json is not None:
        raise InputError(f"the part writes {s.summary_json or 'no summary JSON'}, the profile "
                         f"{summary_json or 'none'}: give the --profile the part ran with", path=part)
    machine = None
    if s.summary_json and (part / s.summary_json).exists():
        d = _read_json(part / s.summary_json)
        machine = d.get("machine") if isinstance(d, dict) else None
        if machine is not None and not isinstance(machine, dict):
            raise _bad(f"{s.summary_json}: machine is not an object", part / s.summary_json)
    for k, ok in (("seconds", lambda x: x is None or _is_num(x)), ("finished", lambda x: x is None or isinstance(x, str)),
                  ("left_out", lambda x: isinstance(x, list) and all(isinstance(y, str) for y in x)),
                  ("dtype_choice", lambda x: isinstance(x, dict) and x.get("dtype") == s.train_dtype
                   and isinstance(x.get("reason"), str))):
        if k in record and not ok(record[k]):
            raise _bad(f"{k} not of its type", path)
    for st, rec in jobs.items():
        if isinstance(rec, dict) and rec.get("done") and not all(
                x is None or _is_num(x) for x in (rec.get("seconds"), rec.get("seconds_all_attempts"))):
            raise _bad(f"job {st}: seconds not a number", path)
    return {"dir": part, "record": record, "settings": s, "runs": runs, "machine": machine}


def read_part_files(p: dict[str, Any]) -> None:
    """The files of a part `read_part` read: each run's eval.json (`_check_eval_json`), metrics.jsonl and
    config.yaml, checked, as the bytes the merge writes (`p["evals"]`, `p["files"]`)."""
    part, s = p["dir"], p["settings"]
    ev = p["record"]["jobs"]["eval"]["summary"]
    p["evals"] = {v: _check_eval_json(part / "eval" / v / "eval.json", v, s, ev, ev["runs"][v]) for v in p["runs"]}
    p["files"] = {(v, name): _check_part_file(part / "train" / v / name, name)
                  for v in p["runs"] for name in _PART_FILES}
    for v in p["runs"]:
        _check_run_files_agree(p, v)


def _check_run_files_agree(p: dict[str, Any], v: str) -> None:
    """Run `v`'s metrics.jsonl and config.yaml (where the part has them) hold the run its demo.json records: the
    same steps and losses, the same variant, dtype, steps and window. The merge copies these files beside the
    record, so a part whose records disagree (a file cut short, or another run's) is refused."""
    part, s = p["dir"], p["settings"]
    run = p["record"]["jobs"]["train"]["summary"]["runs"][v]

    def disagree(what: str) -> InputError:
        return InputError(f"its records disagree: run {v!r}: {what}", path=part)

    if len(run["loss"]) != run["steps"]:
        raise disagree(f"demo.json holds {len(run['loss'])} losses for its {run['steps']} steps")
    metrics = p["files"][(v, "metrics.jsonl")]
    if metrics is not None:
        rows = [json.loads(line) for line in metrics.decode("utf-8").splitlines() if line.strip()]
        if len(rows) != run["steps"]:
            raise disagree(f"train/{v}/metrics.jsonl holds {len(rows)} steps, demo.json {run['steps']}")
        if [r.get("step") for r in rows] != list(range(1, len(rows) + 1)):
            raise disagree(f"train/{v}/metrics.jsonl does not hold steps 1 to {len(rows)} in order")
        if json.dumps([r.get("loss") for r in rows]) != json.dumps(run["loss"]):  # NaN compares by its text
            raise disagree(f"train/{v}/metrics.jsonl holds other losses than demo.json")
    config = p["files"][(v, "config.yaml")]
    if config is not None:
        c = parse_yaml(config.decode("utf-8"), where=f"{part}/train/{v}/config.yaml")
        got = {"variant": _dig(c, "model", "variant"), "dtype": _dig(c, "model", "dtype"),
               "steps": _dig(c, "schedule", "steps"), "seq_len": _dig(c, "data", "seq_len")}
        want = {"variant": run["variant"], "dtype": run["dtype"], "steps": run["steps"], "seq_len": s.seq_len}
        for k in want:
            if got[k] != want[k]:
                raise disagree(f"train/{v}/config.yaml has {k} {excerpt(got[k])}, demo.json {excerpt(want[k])}")


def _dig(d: Any, *keys: str) -> Any:
    """d[k1][k2]... of a YAML mapping; None where a level is missing or not a mapping."""
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _model_identity(part: dict[str, Any]) -> Any:
    """The model bytes a part's runs trained from; a part whose train job does not record them (an
    older version's) is named to be run again."""
    ident = part["record"]["jobs"]["train"]["summary"].get("model_identity")
    if ident is None:
        raise InputError("its train job records no model_identity (the model's bytes), so it cannot be shown "
                         "to be a part of this experiment: run that part again with this version", path=part["dir"])
    return ident


def check_parts(parts: list[dict[str, Any]]) -> DemoSettings:
    """The profile's settings (every run) where the parts are one experiment; else an InputError naming the
    part and what differs."""
    if len(parts) < 2:
        raise InputError("--merge: give at least two demo parts (each --merge DIR)")
    first = parts[0]
    base = asdict(replace(first["settings"], only_runs=()))
    jobs0 = first["record"]["jobs"]
    pack_fp = jobs0["pack"].get("fingerprint")
    ident0 = _model_identity(first)
    seen: dict[str, Path] = {v: first["dir"] for v in first["runs"]}
    for p in parts[1:]:
        mine = asdict(replace(p["settings"], only_runs=()))
        diff = [k for k in base if base[k] != mine[k]]
        if diff:
            raise InputError(f"setting {diff[0]} is {mine[diff[0]]!r} here and {base[diff[0]]!r} in {first['dir']}: "
                             "not parts of one experiment", path=p["dir"])
        st = p["record"]["jobs"]
        if st["pack"].get("fingerprint") != pack_fp:
            raise InputError(f"its packed windows are not those of {first['dir']} (pack fingerprints differ: "
                             "another corpus, tokenizer or anchor version)", path=p["dir"])
        if _model_identity(p) != ident0:
            raise InputError(f"its runs trained from another model file than those of {first['dir']} (the "
                             f"model {p['settings'].model!r} resolved to other bytes)", path=p["dir"])
        for k in _EVAL_SHARED:
            a, b = st["eval"]["summary"][k], jobs0["eval"]["summary"][k]
            if a != b:
                raise InputError(f"evaluated with {k} {a!r} here and {b!r} in {first['dir']} (the resolved "
                                 "evaluation): not parts of one experiment", path=p["dir"])
        for v in p["runs"]:
            if v in seen:
                raise InputError(f"run {v!r} is in this part and in {seen[v]}: each run belongs to one part",
                                 path=p["dir"])
            seen[v] = p["dir"]
    return replace(first["settings"], only_runs=())


def merge_demos(parts: Sequence[str | Path], out: str | Path, *, profile: str | None = None,
                say: Callable[[str], None] = print) -> dict[str, Any]:
    """Write the demo folder `out` of the parts (module docstring); returns its record. `profile`: the profile
    the parts ran with (its summary JSON is the one they carry); None takes the parts' own, a profile's.
    Every part is read and checked before anything is written: a bad one is an InputError, and no folder."""
    t0 = time.time()
    dirs: list[Path] = []
    for p in parts:
        d = Path(p).resolve()
        if d in dirs:
            raise InputError("--merge: this part is given twice; give each part once", path=d)
        dirs.append(d)
    if profile is not None and profile not in PROFILES:
        raise InputError(f"--profile: unknown profile {profile!r} (profiles: {', '.join(PROFILES)})")
    summary_json = None if profile is None else PROFILES[profile].summary_json
    read = [read_part(d, summary_json) for d in dirs]
    s = check_parts(read)
    for p in read:
        read_part_files(p)
    order = [v for v in all_run_names(s) if any(v in p["runs"] for p in read)]
    absent = [v for v in all_run_names(s) if v not in order]
    train_runs: dict[str, Any] = {}
    eval_runs: dict[str, Any] = {}
    for i, p in enumerate(read):
        st = p["record"]["jobs"]
        for v in p["runs"]:
            train_runs[v] = {**st["train"]["summary"]["runs"][v], "part": i}
            eval_runs[v] = st["eval"]["summary"]["runs"][v]
    train_runs = {v: train_runs[v] for v in order}
    eval_runs = {v: eval_runs[v] for v in order}
    step_time_ratios(train_runs)
    first = read[0]["record"]["jobs"]
    train = {**first["train"]["summary"], "runs": train_runs, "full_timing": None}  # per part: merged_from
    ev = {**first["eval"]["summary"], "runs": eval_runs}
    ev.pop("reset", None)
    if s.fp32_variants:
        ev["reset"] = reset_effect(train_runs, eval_runs)
    now = time.strftime("%Y-%m-%d %H:%M:%S")

    def merged_job(name: str, summary: dict[str, Any]) -> dict[str, Any]:
        return {"fingerprint": "merged", "done": True, "finished": now,
                "seconds": round(sum((p["record"]["jobs"][name].get("seconds") or 0) for p in read), 1),
                "seconds_all_attempts": round(sum(job_seconds_all_attempts(p["record"]["jobs"])[name]
                                                  for p in read), 1),
                "summary": summary}

    record: dict[str, Any] = {
        "model": s.model, "settings": asdict(s),
        "jobs": {"corpus": first.get("corpus") or {}, "pack": first["pack"], "train": merged_job("train", train),
                 "eval": merged_job("eval", ev)},
        "ran": [], "reused": [], "selected": ["train", "eval"],
        "left_out": sorted({x for p in read for x in p["record"].get("left_out", [])})
        + ([f"runs in no part: {', '.join(absent)}"] if absent else []),
        # the machines' dtype choices agree (the resolved train_dtype is a setting every part shares): the first says why
        **({"dtype_choice": first_choice} if (first_choice := next((p["record"]["dtype_choice"] for p in read
                                                                      if "dtype_choice" in p["record"]), None)) else {}),
        "merged_from": [{"folder": str(p["dir"]), "runs": p["runs"], "machine": p["machine"],
                         "devices": sorted({train_runs[v].get("device") or "?" for v in p["runs"]}),
                         "full_timing": p["record"]["jobs"]["train"]["summary"].get("full_timing"),
                         "seconds": p["record"].get("seconds"), "finished": p["record"].get("finished"),
                         "jobs_s_all_attempts": round(sum(job_seconds_all_attempts(
                             p["record"]["jobs"]).values()), 1)}
                        for p in read]}
    # --out: a new or empty folder, or an earlier merge (MERGE_VERB in its marker): never a demo that ran its
    # jobs, nor another verb's output (anchor_core.outdir.guard_out, under the lock)
    with staging_dir(out, MERGE_VERB, inputs=[p["dir"] for p in read]) as tmp:
        work = tmp / "merged"
        for job in ("train", "eval"):
            (work / job).mkdir(parents=True)
            write_marker(work / job, "demo")
        for p in read:  # what was read and checked, under names the merge makes (run names of the profile)
            for v in p["runs"]:
                (work / "eval" / v).mkdir()
                (work / "eval" / v / "eval.json").write_bytes(p["evals"][v])
                for name in _PART_FILES:
                    data = p["files"][(v, name)]
                    if data is not None:
                        (work / "train" / v).mkdir(exist_ok=True)
                        (work / "train" / v / name).write_bytes(data)
        train_figures(train_runs, work / "train", s)
        eval_figures(eval_runs, work / "eval", s)
        record["seconds"] = round(time.time() - t0, 1)
        record["finished"] = now
        summary_figure(work, record)
        if write_summary(work, record, s) is not None:
            record["summary_json"] = s.summary_json
        (work / DEMO_JSON).write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str), encoding="utf-8")
        index_page(work, record)
        publish(work, out, MERGE_VERB)
    say(f"merged {len(read)} parts ({', '.join(order)}) into {out}"
        + (f"; runs in no part: {', '.join(absent)}" if absent else ""))
    return record
