"""tools/merge_parity.py: several `anchor parity` reports (one process a variant on the GPU machine)
as one, in the order `anchor parity` runs its cases, refusing reports of other settings; and its slim form."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from anchor_core.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("merge_parity", ROOT / "tools" / "merge_parity.py")
mp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mp)


def report(variant: str, passed: bool = True, **over) -> dict:
    def case(engine):
        return {"id": f"default/{variant}/bf16/{engine}/T1025", "variant": variant, "layout": "plain",
                "seq_len": 1025, "policy": "fa2_bf16", "requested_policy": "bf16", "engine": engine, "pass": passed,
                "layers": [{"layer": 0, "taps": {"q": {"rel_l2": 1.23456789e-3, "baseline_rel_l2": 1e-3,
                                                        "tol": 3e-3, "pass": True, "max_abs": 0.5}}}],
                "fidelity": {"big": [1.0] * 10}}

    def grad(engine):
        rows = [{"param": "model.norm.weight", "rel_l2": 0.02, "baseline_rel_l2": 0.01, "tol": 0.021, "pass": True,
                 "max_abs": 0.1, "cosine": 0.99}]
        return {**case(engine), "grads": {"params": rows, "pass": True, "first_divergence": None},
                "step@1": {"params": rows, "pass": True, "first_divergence": None},
                "params@1": {"params": rows, "pass": True, "first_divergence": None}}

    r = {"model": "default", "device": "cuda", "oracle_device": "cpu (cpu)", "rule": {"factor": 2.0},
         "optimizer": {"lr": 1e-3}, "machine": {"gpu": "NVIDIA H200"}, "runtime_s": 100.0, "pass": passed,
         "cases": [case("varlen"), case("flex")], "grad_cases": [grad("varlen"), grad("flex")]}
    r.update(over)
    return r


def test_merged_in_variant_order_and_passing_only_if_all_pass():
    out = mp.merge([("a", report("anchor", runtime_s=120.0)), ("f", report("full")),
                    ("i", report("intra_doc", passed=False))])
    assert [c["variant"] for c in out["cases"]] == ["full", "full", "intra_doc", "intra_doc", "anchor", "anchor"]
    assert [c["engine"] for c in out["cases"][:2]] == ["flex", "varlen"]
    assert len(out["grad_cases"]) == 6 and out["pass"] is False and out["runtime_s"] == 120.0
    assert [m["folder"] for m in out["merged_from"]] == ["a", "f", "i"]
    assert mp.merge([("a", report("anchor")), ("f", report("full"))])["pass"] is True


@pytest.mark.parametrize("over, what", [
    ({"device": "cpu"}, "device differs"),
    ({"rule": {"factor": 3.0}}, "rule differs"),
    ({"oracle_device": "cuda (H200)"}, "oracle_device differs"),
    ({"machine": {"gpu": "NVIDIA H100"}}, "another machine"),
])
def test_a_report_of_other_settings_is_refused(over, what):
    with pytest.raises(InputError, match=what):
        mp.merge([("a", report("anchor")), ("b", report("full", **over))])


def test_a_case_in_two_reports_is_refused():
    with pytest.raises(InputError, match="in more than one report"):
        mp.merge([("a", report("anchor")), ("b", report("anchor"))])


def test_non_finite_numbers_read_back():
    assert mp.numbers({"tol": "inf", "x": ["nan", "-inf", "info"]})["tol"] == float("inf")
    assert mp.numbers(["info"]) == ["info"]  # only the exact words


def test_slim_keeps_the_verdicts_and_drops_the_trajectories():
    s = mp.slim(mp.merge([("a", report("anchor"))]))
    json.dumps(s)
    c, g = s["cases"][0], s["grad_cases"][0]
    assert "fidelity" not in c and c["layers"][0]["taps"]["q"] == {"rel_l2": 0.001235, "baseline_rel_l2": 0.001,
                                                                     "tol": 0.003, "pass": True}
    assert g["grads"]["params"][0] == {"param": "model.norm.weight", "rel_l2": 0.02, "baseline_rel_l2": 0.01,
                                       "tol": 0.021, "pass": True}
    assert g["step@1"] == {"pass": True, "first_divergence": None, "max_rel_l2": 0.02} and "params@1" not in g


def _parts(folder: Path, variant: str, cases: int, grads: int, run: dict | None = None, start: int = 0) -> Path:
    """An unfinished run's parts as `anchor parity` keeps them (anchor_core.parts): `cases` forward and `grads`
    gradient cases of report(variant)'s, finished before it was stopped."""
    from anchor_core.parts import Parts

    r = report(variant)
    run = run or {"anchor": "0.1.0", "model_files": [["default"]], "device": "cuda", "oracle_device": "cpu (cpu)",
                  "grads": True}
    parts = Parts(folder, "parity")
    for kind, done, rows in (("case", cases, r["cases"]), ("grad_case", grads, r["grad_cases"])):
        for i in range(start, done):
            value = {**rows[i], "model": "default", "runtime_s": 10.0 + i}
            parts.kept(f"{kind}-{i}", {"run": run, "case": {"variant": variant, "i": i}, "kind": kind}, lambda v=value: v)
    return folder


def test_an_unfinished_runs_parts_are_a_report_that_does_not_pass(tmp_path):
    """Its finished cases, with this checkout's rule and optimizer and the machine given; merged beside
    whole reports in variant order, the merged report names it and does not pass."""
    from parity_tests.core import RULE
    from parity_tests.grads import OPTIMIZER

    r = mp.from_parts(_parts(tmp_path / ".fanout_anchor.parts", "anchor", 2, 1), {"gpu": "NVIDIA H200"})
    assert [c["engine"] for c in r["cases"]] == ["varlen", "flex"] and len(r["grad_cases"]) == 1
    assert r["rule"] == RULE.to_dict() and r["optimizer"] == OPTIMIZER.to_dict() and r["runtime_s"] == 31.0
    assert r["pass"] is True and r["model"] == "default" and r["device"] == "cuda"
    whole = report("full", rule=RULE.to_dict(), optimizer=OPTIMIZER.to_dict())
    out = mp.merge([("a", r), ("f", whole)])
    assert [c["variant"] for c in out["cases"]] == ["full", "full", "anchor", "anchor"]
    assert out["pass"] is False and out["unfinished"] == [str(tmp_path / ".fanout_anchor.parts")]


def test_the_command_takes_parts_folders_and_a_machine(tmp_path, capsys, monkeypatch):
    import parity_tests.report

    written = {}
    monkeypatch.setattr(parity_tests.report, "write_report", lambda r, out: written.setdefault("r", r) and Path(out))
    folders = [_parts(tmp_path / f".fanout_{v}.parts", v, 2, 1) for v in ("full", "anchor")]
    (tmp_path / "diag.json").write_text(json.dumps({"machine": {"gpu": "NVIDIA H100 80GB HBM3"}}))
    slim = tmp_path / "slim.json"
    rc = mp.main([str(tmp_path / "merged"), *map(str, folders), "--machine", str(tmp_path / "diag.json"),
                  "--slim", str(slim)])
    assert rc == 1 and "4 cases, 2 gradient cases, 6 pass, unfinished" in capsys.readouterr().out
    s = json.loads(slim.read_text())
    assert s["machine"]["gpu"] == "NVIDIA H100 80GB HBM3" and len(s["unfinished"]) == 2
    assert written["r"]["unfinished"] == list(map(str, folders)) and written["r"]["pass"] is False
    md = parity_tests.report.render_markdown({**written["r"], "cases": [], "grad_cases": []})
    assert "**Unfinished**: the run(s) kept in " + str(folders[0]) in md


def test_of_parts_of_two_runs_the_newest_runs_are_taken_and_the_others_counted_stale(tmp_path):
    """A folder seeded with an earlier session's parts (other code: another key) and then partly computed
    again holds two runs' parts: the report is the newest part's run, whichever case it is."""
    import os

    folder = _parts(tmp_path / ".a.parts", "anchor", 2, 1)  # carried: forward cases 0, 1 and gradients 0
    new_run = {"anchor": "0.1.0", "model_files": [["default"]], "device": "cuda", "oracle_device": "cpu (cpu)",
               "grads": True, "code": "0123456789abcdef"}
    _parts(folder, "anchor", 1, 0, run=new_run)  # ...case-0 computed again under this code
    for f in folder.glob("[!.]*.json"):
        os.utime(f, ns=(10**18, 10**18 + (10**9 if f.name == "case-0.json" else 0)))
    r = mp.from_parts(folder)
    assert len(r["cases"]) == 1 and "grad_cases" in r and r["grad_cases"] == [] and r["stale_parts"] == 2
    os.utime(folder / "grad_case-0.json", ns=(10**18, 10**18 + 2 * 10**9))  # newest now: the old run's
    r = mp.from_parts(folder)
    assert (len(r["cases"]), len(r["grad_cases"]), r["stale_parts"]) == (1, 1, 1)


def test_a_kept_parts_folder_beside_its_report_is_left_out(tmp_path, capsys, monkeypatch):
    import parity_tests.report

    monkeypatch.setattr(parity_tests.report, "write_report", lambda r, out: Path(out))
    run = tmp_path / "fanout_anchor"
    run.mkdir()
    (run / "parity.json").write_text(json.dumps(report("anchor")))
    kept = _parts(tmp_path / ".fanout_anchor.parts", "anchor", 2, 1)
    assert mp.main([str(tmp_path / "merged"), str(run), str(kept)]) == 0
    assert "kept parts of fanout_anchor, whose report is given: left out" in capsys.readouterr().out


def test_parts_of_none_are_refused(tmp_path):
    (tmp_path / ".b.parts").mkdir()
    with pytest.raises(InputError, match="no finished case"):
        mp.from_parts(tmp_path / ".b.parts")
    folder = _parts(tmp_path / ".c.parts", "anchor", 1, 0)
    (folder / "showcase-1.json").write_text("{}")  # in a folder of parts, a file that is not one
    with pytest.raises(InputError, match="not a part anchor kept"):
        mp.from_parts(folder)
    (folder / "showcase-1.json").unlink()
    (folder / "case-10.json").write_text('{"key": [], "value": {}}')
    with pytest.raises(InputError, match="its key names no run"):
        mp.from_parts(folder)
