"""One parity report from several `anchor parity` reports of the same model, device and rule.

    python tools/merge_parity.py OUT PARITY_DIR [PARITY_DIR ...] [--slim FILE.json]

`anchor parity` runs its cases one after another in one process; on a GPU machine with many cores (16 in
tools/gpu_parity.sh) the oracle on the CPU is faster as one process per variant, each on its
own cores (tools/gpu_parity.sh `fanout`). This joins their reports: the cases and gradient cases in
the order `anchor parity` would have run them, `pass` only where every case passed, the longest runtime (they
ran side by side), and each part's folder and runtime under `merged_from`. A report that disagrees with the
first on model, device, oracle device, rule, optimizer or machine, or repeats a case, is refused (exit 2):
a merged report never mixes settings.

A folder may also be an unfinished run's parts (`.<name>.parts` beside its --out, anchor_core.parts: a JSON file
per finished case, `case-N.json` and `grad_case-N.json`, kept when the run was stopped at its time limit):
its finished cases make a report of their own, with the rule and optimizer of this checkout, no machine
(a part does not record one: `--machine FILE.json` takes it from a JSON file's `machine`, e.g. a script run
in the same command), and `unfinished` naming the folder. A merged report with an unfinished part does not pass.
The run is the newest part's (its key: settings, code, versions, device); parts of another run (carried from
an earlier run by `anchor parity --keep-parts` and not computed again yet) are counted as `stale_parts` and
left out. A parts folder whose run's report is also given (`--keep-parts` keeps both) is left out.

`--slim FILE.json` also writes the merged report without what only its figures need, numbers to 4
significant digits (a SmolLM2 report with gradients is 5 MB; this is what results/gpu/parity keeps): per
forward case each layer's taps (rel_l2, baseline_rel_l2, tol, pass), per gradient case each parameter's
gradient row and each optimizer step's verdict; the trajectory sections (params@k, update@k) are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from anchor_core.errors import InputError  # noqa: E402

SAME = ("model", "device", "oracle_device", "rule", "optimizer")


def numbers(x):
    """A parity.json as read back, with its non-finite numbers (written as "inf", "-inf", "nan") as floats."""
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    if isinstance(x, dict):
        return {k: numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [numbers(v) for v in x]
    return x


def from_parts(folder: str | Path, machine: dict | None = None) -> dict:
    """The report of an unfinished `anchor parity` run: the finished cases kept in its parts `folder`."""
    from anchor_core.parts import Parts
    from parity_tests.core import RULE
    from parity_tests.grads import OPTIMIZER

    folder = Path(folder)
    found: dict[str, list] = {"case": [], "grad_case": []}
    named = []  # anchor parity's parts are `case-N` and `grad_case-N` (parity_tests.suite.run_parity)
    for name, part in Parts(folder, "parity").saved().items():
        if m := re.fullmatch(r"(case|grad_case)-(\d+)", name):
            named.append((m.group(1), int(m.group(2)), name, part))
    for _, _, name, part in named:
        if not isinstance(part["key"], dict) or part["key"].get("run") is None:
            raise InputError("not a parity case's part (its key names no run)", path=folder / f"{name}.json")
    if not named:
        raise InputError("no finished case in it (case-N.json)", path=folder)
    # Parts carried from an earlier run (`anchor parity --keep-parts`, gpu_parity.sh `seed`) that the
    # run has not computed again yet hold another run's key (other code, versions or device): the run is
    # the newest part's, and the others are stale, counted and left out.
    newest = max(named, key=lambda n: ((folder / f"{n[2]}.json").stat().st_mtime_ns, n[2]))
    run = newest[3]["key"]["run"]
    stale = 0
    for kind, _, name, part in sorted(named):
        if part["key"]["run"] != run:
            stale += 1
            continue
        found[kind].append(numbers(part["value"]))
    models = {c["model"] for c in found["case"] + found["grad_case"]}
    if len(models) != 1:
        raise InputError(f"cases of several models ({', '.join(sorted(models))})", path=folder)
    r = {"model": models.pop(), "device": run.get("device"), "oracle_device": run.get("oracle_device"),
         "cases": found["case"], "rule": RULE.to_dict(), "machine": machine,
         "pass": all(c["pass"] for c in found["case"] + found["grad_case"]),
         "runtime_s": round(sum(c["runtime_s"] for c in found["case"] + found["grad_case"]), 2),
         "unfinished": str(folder)}
    if stale:
        r["stale_parts"] = stale
    if run.get("grads"):
        r["grad_cases"], r["optimizer"] = found["grad_case"], OPTIMIZER.to_dict()
    return r


def merge(reports: list[tuple[str, dict]]) -> dict:
    """The merged report of [(folder, parity.json's dict)], checked for one setting throughout."""
    if not reports:
        raise InputError("merge_parity: no reports given")
    first_dir, first = reports[0]
    cases, grad_cases, seen = [], [], set()
    for folder, r in reports:
        for k in SAME:
            if r.get(k) != first.get(k):
                raise InputError(f"{k} differs from {first_dir}'s ({r.get(k)!r} vs {first.get(k)!r})",
                                 path=folder)
        if (r.get("machine") or {}).get("gpu") != (first.get("machine") or {}).get("gpu"):
            raise InputError(f"ran on another machine than {first_dir}", path=folder)
        if ("grad_cases" in r) != ("grad_cases" in first):
            raise InputError(f"gradient cases in one report and not the other ({first_dir})", path=folder)
        for c in r["cases"]:
            if c["id"] in seen:
                raise InputError(f"case {c['id']} is in more than one report", path=folder)
            seen.add(c["id"])
        cases += r["cases"]
        grad_cases += r.get("grad_cases", [])
    order = {"full": 0, "intra_doc": 1, "intra_doc_reset": 2, "anchor": 3}

    def key(c: dict) -> tuple:
        return (order.get(c["variant"], 9), c["variant"], c.get("layout", "plain"), c["seq_len"],
                c.get("requested_policy", c["policy"]), c["engine"])

    out = {k: v for k, v in first.items() if k not in ("cases", "grad_cases", "reused")}
    out["cases"] = sorted(cases, key=key)
    if "grad_cases" in first:
        out["grad_cases"] = sorted(grad_cases, key=key)
    unfinished = [r["unfinished"] for _, r in reports if r.get("unfinished")]
    out["pass"] = all(c["pass"] for c in cases + grad_cases) and not unfinished
    if unfinished:
        out["unfinished"] = unfinished
    out["runtime_s"] = max(r["runtime_s"] for _, r in reports)
    out["merged_from"] = [{"folder": f, "runtime_s": r["runtime_s"], "cases": len(r["cases"]),
                           "grad_cases": len(r.get("grad_cases", []))} for f, r in reports]
    return out


def _round(x, digits: int = 4):
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v, digits) for v in x]
    return x


def slim(result: dict) -> dict:
    """`result` without what only its figures and trajectories need (see the module's docstring)."""
    tap_keys = ("rel_l2", "baseline_rel_l2", "tol", "pass")
    row_keys = ("param", "rel_l2", "baseline_rel_l2", "tol", "pass")
    cases = []
    for c in result["cases"]:
        c = {k: v for k, v in c.items() if k not in ("layers", "fidelity")}
        cases.append(c)
    for c, full in zip(cases, result["cases"]):
        c["layers"] = [{"layer": lay["layer"], "taps": {t: {k: v[k] for k in tap_keys if k in v}
                                                         for t, v in lay["taps"].items()}}
                       for lay in full["layers"]]
    grads = []
    for g in result.get("grad_cases", []):
        h = {k: v for k, v in g.items() if not (k == "grads" or "@" in k)}
        h["grads"] = {"pass": g["grads"]["pass"], "first_divergence": g["grads"]["first_divergence"],
                      "params": [{k: r[k] for k in row_keys} for r in g["grads"]["params"]]}
        for k in (k for k in g if k.startswith("step@")):
            h[k] = {"pass": g[k]["pass"], "first_divergence": g[k]["first_divergence"],
                    "max_rel_l2": max(r["rel_l2"] for r in g[k]["params"])}
        grads.append(h)
    out = {k: v for k, v in result.items() if k not in ("cases", "grad_cases")}
    out["cases"] = cases
    if "grad_cases" in result:
        out["grad_cases"] = grads
    out["slim"] = "tools/merge_parity.py --slim: figures' data and the trajectory sections left out, 4 digits"
    return _round(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("parts", nargs="+")
    ap.add_argument("--slim", help="also write the slim report (see the docstring) to this JSON file")
    ap.add_argument("--machine", help="an unfinished part's machine: this JSON file's `machine` (see the docstring)")
    args = ap.parse_args(argv)
    from parity_tests.report import write_report

    try:
        reports = []
        machine = None
        if args.machine:
            try:
                machine = json.loads(Path(args.machine).read_text(encoding="utf-8"))["machine"]
            except (OSError, ValueError, KeyError) as e:
                raise InputError(f"no machine in it ({e})", path=args.machine) from None
        from anchor_core.parts import parts_dir

        kept_beside = {parts_dir(d): d for d in args.parts}  # each given folder's own `.<name>.parts`
        for d in args.parts:
            p = Path(d) / "parity.json"
            if (run := kept_beside.get(Path(os.path.abspath(d)))) is not None:
                print(f"{d}: kept parts of {Path(run).name}, whose report is given: left out")
                continue
            if not p.is_file() and any(Path(d).glob("case-*.json")):
                reports.append((d, from_parts(d, machine)))
                continue
            if not p.is_file():
                raise InputError("no parity.json (an unfinished run?)", path=d)
            try:
                reports.append((d, numbers(json.loads(p.read_text()))))
            except json.JSONDecodeError as e:
                raise InputError(f"not JSON ({e.msg}, line {e.lineno})", path=p) from None
        result = merge(reports)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = write_report(result, args.out)
    if args.slim:
        from anchor_core.atomic import write_text_atomic

        write_text_atomic(args.slim, json.dumps(slim(result), separators=(",", ":"), allow_nan=True) + "\n")
    n, g = len(result["cases"]), len(result.get("grad_cases", []))
    verdict = "all pass" if result["pass"] else "NOT all pass"
    if result.get("unfinished"):
        verdict = f"{sum(c['pass'] for c in result['cases'] + result.get('grad_cases', []))} pass, unfinished"
    print(f"wrote {path}: {n} cases, {g} gradient cases, {verdict}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
