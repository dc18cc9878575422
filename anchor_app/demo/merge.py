"""`anchor demo --merge PART [PART ...] --out DIR`: one demo folder from parts that each ran some of the runs.

A profile whose runs do not fit one sitting on the machine that trains them (paper-gpu on a GPU lent for
15 minutes at a time, whose checkpoints cannot leave the machine) runs in parts: `anchor demo --profile P
--runs full,intra_doc --out part1`, another part with other runs, each trained and evaluated to its end
where it ran. A part needs to come back with `demo.json`, each run's `eval/<run>/eval.json` and, if it has
one, the profile's summary JSON (its machine); no checkpoint.

The merge checks that the parts are one experiment: the same model and settings but for `only_runs`, the
same packed windows (the `pack` stage's fingerprint: same corpus, tokenizer, window and budget), their
`train` and `eval` stages finished, no run in two parts. It then writes what one demo of all the runs
writes (demo.json, index.html, summary.png, the figures, the summary JSON), with the parts' machines and
seconds in `merged_from`. Step times are compared with `full`'s only within a part (`stages.step_time_ratios`):
a part without `full` times full's first `timing_steps` steps itself. Bad parts get one line and exit 2, and no folder.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from anchor.errors import InputError
from anchor_app.demo.settings import DEMO_JSON, DemoSettings, all_run_names

_PART_FILES = ("metrics.jsonl", "config.yaml")  # per run under train/<run>/, linked from the page


def _settings(d: dict[str, Any], where: Path) -> DemoSettings:
    names = {f.name for f in fields(DemoSettings)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise InputError(f"demo.json: settings key {unknown[0]!r} is not one this anchor knows", path=where)
    return DemoSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def read_part(part: Path) -> dict[str, Any]:
    """A part's record, settings, runs and machine; an InputError where it is not a finished demo part."""
    path = part / DEMO_JSON
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        stages = record["stages"]
        s = _settings(record["settings"], path)
    except OSError:
        raise InputError("no demo.json here: not a demo folder", path=part) from None
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"demo.json unreadable ({type(e).__name__}: {e})", path=path) from None
    for st in ("pack", "train", "eval"):
        if not (stages.get(st) or {}).get("done"):
            raise InputError(f"its {st} stage did not finish: finish the part (run the same command again) first",
                             path=part)
    runs = list(stages["train"]["summary"]["runs"])
    missing = [v for v in runs if v not in stages["eval"]["summary"]["runs"]
               or not (part / "eval" / v / "eval.json").is_file()]
    if missing:
        raise InputError(f"run {missing[0]!r} has no evaluation (eval/{missing[0]}/eval.json)", path=part)
    machine = None
    if s.summary_json and (part / s.summary_json).is_file():
        try:
            machine = json.loads((part / s.summary_json).read_text(encoding="utf-8")).get("machine")
        except ValueError:
            raise InputError(f"{s.summary_json} unreadable", path=part / s.summary_json) from None
    return {"dir": part, "record": record, "settings": s, "runs": runs, "machine": machine}


def check_parts(parts: list[dict[str, Any]]) -> DemoSettings:
    """The profile's settings (every run) where the parts are one experiment; else an InputError naming the
    part and what differs."""
    if len(parts) < 2:
        raise InputError("--merge: give at least two demo parts (each --merge DIR)")
    first = parts[0]
    base = asdict(replace(first["settings"], only_runs=()))
    pack_fp = first["record"]["stages"]["pack"].get("fingerprint")
    seen: dict[str, Path] = {v: first["dir"] for v in first["runs"]}
    for p in parts[1:]:
        mine = asdict(replace(p["settings"], only_runs=()))
        diff = [k for k in base if base[k] != mine[k]]
        if diff:
            raise InputError(f"setting {diff[0]} is {mine[diff[0]]!r} here and {base[diff[0]]!r} in {first['dir']}: "
                             "not parts of one experiment", path=p["dir"])
        if p["record"]["stages"]["pack"].get("fingerprint") != pack_fp:
            raise InputError(f"its packed windows are not those of {first['dir']} (pack fingerprints differ: "
                             "another corpus, tokenizer or anchor version)", path=p["dir"])
        for v in p["runs"]:
            if v in seen:
                raise InputError(f"run {v!r} is in this part and in {seen[v]}: each run belongs to one part",
                                 path=p["dir"])
            seen[v] = p["dir"]
    return replace(first["settings"], only_runs=())


def merge_demos(parts: Sequence[str | Path], out: str | Path, *, say: Callable[[str], None] = print
                ) -> dict[str, Any]:
    """Write the demo folder `out` of the parts (module docstring); returns its record."""
    from anchor.atomic import publish, staging_dir
    from anchor.outdir import write_marker
    from anchor_app.demo.page import index_page, summary_figure
    from anchor_app.demo.stages import eval_figures, step_time_ratios, train_figures
    from anchor_app.demo.summary import reset_effect, stage_seconds_all_attempts, write_summary

    t0 = time.time()
    read = [read_part(Path(p).resolve()) for p in parts]
    s = check_parts(read)
    order = [v for v in all_run_names(s) if any(v in p["runs"] for p in read)]
    absent = [v for v in all_run_names(s) if v not in order]
    train_runs: dict[str, Any] = {}
    eval_runs: dict[str, Any] = {}
    for i, p in enumerate(read):
        st = p["record"]["stages"]
        for v in p["runs"]:
            train_runs[v] = {**st["train"]["summary"]["runs"][v], "part": i}
            eval_runs[v] = st["eval"]["summary"]["runs"][v]
    train_runs = {v: train_runs[v] for v in order}
    eval_runs = {v: eval_runs[v] for v in order}
    step_time_ratios(train_runs)
    first = read[0]["record"]["stages"]
    train = {**first["train"]["summary"], "runs": train_runs, "full_timing": None}  # per part: merged_from
    ev = {**first["eval"]["summary"], "runs": eval_runs}
    ev.pop("reset", None)
    if s.fp32_variants:
        ev["reset"] = reset_effect(train_runs, eval_runs)
    now = time.strftime("%Y-%m-%d %H:%M:%S")

    def merged_stage(name: str, summary: dict[str, Any]) -> dict[str, Any]:
        return {"fingerprint": "merged", "done": True, "finished": now,
                "seconds": round(sum((p["record"]["stages"][name].get("seconds") or 0) for p in read), 1),
                "seconds_all_attempts": round(sum(stage_seconds_all_attempts(p["record"]["stages"])[name]
                                                  for p in read), 1),
                "summary": summary}

    record: dict[str, Any] = {
        "model": s.model, "settings": asdict(s),
        "stages": {"corpus": first["corpus"], "pack": first["pack"], "train": merged_stage("train", train),
                   "eval": merged_stage("eval", ev)},
        "ran": [], "reused": [], "selected": ["train", "eval"],
        "left_out": sorted({x for p in read for x in p["record"].get("left_out", [])})
        + ([f"runs in no part: {', '.join(absent)}"] if absent else []),
        "merged_from": [{"folder": str(p["dir"]), "runs": p["runs"], "machine": p["machine"],
                         "devices": sorted({train_runs[v].get("device") or "?" for v in p["runs"]}),
                         "full_timing": p["record"]["stages"]["train"]["summary"].get("full_timing"),
                         "seconds": p["record"].get("seconds"), "finished": p["record"].get("finished"),
                         "stages_s_all_attempts": round(sum(stage_seconds_all_attempts(
                             p["record"]["stages"]).values()), 1)}
                        for p in read]}
    with staging_dir(out, "demo", inputs=[p["dir"] for p in read]) as tmp:
        work = tmp / "merged"
        for stage in ("train", "eval"):
            (work / stage).mkdir(parents=True)
            write_marker(work / stage, "demo")
        for p in read:
            for v in p["runs"]:
                (work / "eval" / v).mkdir()
                shutil.copy2(p["dir"] / "eval" / v / "eval.json", work / "eval" / v / "eval.json")
                for name in _PART_FILES:
                    src = p["dir"] / "train" / v / name
                    if src.is_file():
                        (work / "train" / v).mkdir(exist_ok=True)
                        shutil.copy2(src, work / "train" / v / name)
        train_figures(train_runs, work / "train", s)
        eval_figures(eval_runs, work / "eval", s)
        record["seconds"] = round(time.time() - t0, 1)
        record["finished"] = now
        summary_figure(work, record)
        if write_summary(work, record, s) is not None:
            record["summary_json"] = s.summary_json
        (work / DEMO_JSON).write_text(json.dumps(record, indent=1, ensure_ascii=False, default=str), encoding="utf-8")
        index_page(work, record)
        publish(work, out, "demo")
    say(f"merged {len(read)} parts ({', '.join(order)}) into {out}"
        + (f"; runs in no part: {', '.join(absent)}" if absent else ""))
    return record
