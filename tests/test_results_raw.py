"""The results pages are computed from each record's raw samples (tools/results_pages.py): a changed sample
changes the page, the warm-up the record states is left out, and a stored summary that disagrees with its
samples stops the render on one line naming the record and the field."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import statistics
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_pages_raw", ROOT / "tools" / "results_pages.py")
results_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_pages)
num = results_pages.num

TRAIN_GPU = results_pages.TRAIN_GPU


def _record(rel: str) -> dict[str, Any]:
    return json.loads((ROOT / rel).read_text())


def _render(tmp_path: Path, rel: str, rec: dict[str, Any]) -> dict[str, str]:
    """Every page, with the record at `rel` replaced by `rec` (written to tmp_path)."""
    path = tmp_path / Path(rel).name
    path.write_text(json.dumps(rec))
    return results_pages.render_all(ROOT, paths={rel: path})


def _section(page: str, heading: str) -> str:
    start = page.index(heading)
    end = page.find("\n## ", start + len(heading))
    return page[start:end if end > 0 else len(page)]


def _table_rows(text: str, after: str) -> dict[str, list[str]]:
    """The rows of the first table after the line `after`, by their first cell."""
    lines = text[text.index(after):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows[cells[0]] = cells[1:]
    return rows


def _gpu_train_section(pages: dict[str, str]) -> str:
    return _section(pages["docs/results/speed.md"], "## `anchor train` against a plain transformers loop on one GPU")


def _row(rec: dict[str, Any], length: str, config: str) -> dict[str, Any]:
    return next(r for r in rec["lengths"][length]["rows"] if r["config"] == config)


def _timed(rec: dict[str, Any], row: dict[str, Any]) -> list[float]:
    rounds = row["step_s"] if isinstance(row["step_s"][0], list) else [row["step_s"]]
    return [t for times in rounds for t in times[rec["warmup"]:]]


def _expected_cells(steps: list[float]) -> list[str]:
    return [num(len(steps)), num(statistics.fmean(steps)), num(statistics.median(steps)),
            f"{num(min(steps))}–{num(max(steps))}"]


def test_the_gpu_throughput_table_gives_timed_steps_mean_median_range_and_both_ratios():
    rec = _record(TRAIN_GPU)
    section = _gpu_train_section(results_pages.render_all(ROOT))
    print(section)
    for length, block in rec["lengths"].items():
        text = section[section.index(f"T = {int(length):,}:"):]
        rows = _table_rows(text, f"T = {int(length):,}:")
        timed = {}
        for r in block["rows"]:
            if not r.get("step_s"):
                assert any(k.startswith(r["config"]) for k in rows), r["config"]
                continue
            timed[r["config"]] = steps = _timed(rec, r)
            assert rows[r["config"]][:4] == _expected_cells(steps), (length, r["config"])
        ratios = _table_rows(text, "| step time, this ÷ that")
        plain = [k for k in timed if k.startswith("plain/")]
        for k, steps in timed.items():
            for p in plain:
                if k.startswith("train/"):
                    assert ratios[f"{k} ÷ {p}"][:2] == [
                        num(statistics.fmean(steps) / statistics.fmean(timed[p])),
                        num(statistics.median(steps) / statistics.median(timed[p]))], (length, k, p)
        full, anchor = timed["train/full/varlen"], timed["train/anchor/varlen"]
        assert ratios["train/anchor/varlen ÷ train/full/varlen"][:2] == [
            num(statistics.fmean(anchor) / statistics.fmean(full)),
            num(statistics.median(anchor) / statistics.median(full))]


def test_a_changed_timed_step_changes_the_page_as_its_samples_do(tmp_path: Path):
    rec = _record(TRAIN_GPU)
    changed = copy.deepcopy(rec)
    row = _row(changed, "16384", "train/anchor/varlen")
    row["step_s"][-1] *= 2  # the slowest timed step: the median (and what the record stores) stays
    section = _gpu_train_section(_render(tmp_path, TRAIN_GPU, changed))
    rows = _table_rows(section, "T = 16,384:")
    assert rows["train/anchor/varlen"][:4] == _expected_cells(_timed(changed, row))
    assert rows["train/anchor/varlen"][:4] != _expected_cells(_timed(rec, _row(rec, "16384", "train/anchor/varlen")))


def test_the_warm_up_the_record_states_is_left_out(tmp_path: Path):
    rec = _record(TRAIN_GPU)
    before = _gpu_train_section(results_pages.render_all(ROOT))
    warm = copy.deepcopy(rec)
    _row(warm, "16384", "train/anchor/varlen")["step_s"][0] *= 10  # a warm-up step
    assert _gpu_train_section(_render(tmp_path, TRAIN_GPU, warm)) == before

    one = copy.deepcopy(rec)  # one warm-up step instead of two, and no stored summary to disagree with it
    one["warmup"] = 1
    for block in one["lengths"].values():
        block.pop("ratios", None)
        for r in block["rows"]:
            for k in ("median_step_s", "mean_step_s", "tokens_per_s", "tokens_per_s_mean", "tflop_s", "mfu"):
                r.pop(k, None)
    rows = _table_rows(_gpu_train_section(_render(tmp_path, TRAIN_GPU, one)), "T = 16,384:")
    steps = _row(one, "16384", "train/anchor/varlen")["step_s"][1:]
    assert rows["train/anchor/varlen"][:4] == _expected_cells(steps)

    del one["warmup"]
    with pytest.raises(SystemExit, match=re.escape(f"{TRAIN_GPU}: warmup:")):
        _render(tmp_path, TRAIN_GPU, one)


def _median_over_all_steps(rec):
    row = _row(rec, "16384", "train/anchor/varlen")
    row["median_step_s"] = statistics.median(row["step_s"])  # warm-up included


def _case_verdict_flipped(rec):
    rec["cases"][0]["pass"] = not rec["cases"][0]["pass"]


def _report_passes(rec):
    rec["pass"] = True


def _slower_anchor_ratio(rec):
    next(a for a in rec["attention"] if a["variant"] == "anchor")["time_ratio"] += 0.25


def _higher_ruler_mean(rec):
    rec["eval"]["anchor"]["ruler_mean_of_tasks"]["1024"]["mean"] += 7.0


def _finding_flipped(rec):
    rec["findings"][2]["holds"] = not rec["findings"][2]["holds"]


def _oracle_median(rec):
    rec["results"][0]["oracle_fp32_s"] = statistics.fmean(rec["results"][0]["oracle_runs_s"])


def _hf_status(rec):
    row = next(r for r in rec["rows"] if r["status"] == "none")
    row["status"] = "computes"


def _overhead(rec):
    rec["overhead"] = statistics.fmean(rec["anchor_step_s"]) / statistics.fmean(rec["plain_step_s"]) - 1


PLANTED: list[tuple[str, Callable[[dict], None], str]] = [
    (TRAIN_GPU, _median_over_all_steps, "lengths.16384.rows[train/anchor/varlen].median_step_s"),
    (results_pages.GPU_PARITY[0], _case_verdict_flipped, "cases[0].pass"),
    (results_pages.GPU_PARITY[0], _report_passes, "pass"),
    (results_pages.BENCH_CPU, _slower_anchor_ratio, ".time_ratio"),
    (results_pages.PAPER_SMALL, _higher_ruler_mean, "eval.anchor.ruler_mean_of_tasks.1024.mean"),
    (results_pages.AUDIT, _finding_flipped, "findings[2].holds"),
    (results_pages.ORACLE_FORWARD, _oracle_median, "results[0].oracle_fp32_s"),
    (results_pages.HF_STACK[1], _hf_status, ".status"),
    (results_pages.TRAIN_OVERHEAD, _overhead, "overhead"),
]


@pytest.mark.parametrize(("rel", "plant", "field"), PLANTED, ids=[f"{Path(r).stem}-{p.__name__.strip('_')}"
                                                                   for r, p, _ in PLANTED])
def test_a_stored_summary_that_disagrees_with_its_samples_is_refused(tmp_path: Path, rel, plant, field):
    rec = _record(rel)
    results_pages.render_all(ROOT, paths={rel: ROOT / rel})  # as committed: rendered
    plant(rec)
    with pytest.raises(SystemExit) as e:
        _render(tmp_path, rel, rec)
    message = str(e.value.code)
    print(message)
    assert "\n" not in message and message.startswith(f"results_pages: {rel}: ") and field in message
    assert "stored" in message and "its samples give" in message


def test_each_parity_section_names_the_weights_its_report_ran_with():
    page = results_pages.render_all(ROOT)["docs/results/gpu.md"]
    intro = page[:page.index("\n## ")]
    assert "own weights" not in intro  # a claim for one report would not hold for another
    for rel in results_pages.GPU_PARITY:
        rec = _record(rel)
        section = _section(page, f"## `{Path(rel).stem}`")
        assert f"Model {results_pages.model_label(rec['model'])};" in section, rel
        if rec["model"].startswith("random:"):
            assert "random weights" in section and "own weights" not in section, rel


def test_readme_shows_a_parity_report_only_when_finished_under_todays_rule_and_emulation():
    readme = results_pages.render_all(ROOT)["README.md"]
    for rel in results_pages.GPU_PARITY[:2]:
        rec = _record(rel)
        rows = [line for line in readme.splitlines() if f"`{Path(rel).stem}`" in line]
        differs = results_pages.not_todays(rec)
        current = not (differs["rule"] or differs["emulation"] or results_pages.parity_counts(rel, rec)["unfinished"])
        assert len(rows) == int(current), (rel, rows)
        assert (rel in results_pages.current_parity(results_pages.Records(ROOT))) == current, rel
    h200 = _record(results_pages.GPU_PARITY[0])
    assert results_pages.not_todays(h200)["rule"], "the H200 report was judged under another rule: not in README"


SCRIPT = re.compile(r"(?<![\w./-])((?:benchmarks|tools|experiments|parity_tests|anchor|anchor_core|jaxref|torchtrain)"
                    r"/[\w./-]*?\.(?:py|sh))\b")


def test_every_script_a_record_names_is_where_it_says():
    missing = []
    for d in results_pages.RECORD_DIRS:
        for p in sorted((ROOT / d).rglob("*.json")):
            for path in SCRIPT.findall(p.read_text(encoding="utf-8")):
                if not (ROOT / path).is_file():
                    missing.append(f"{p.relative_to(ROOT)}: {path}")
    assert missing == []
