"""The results pages (docs/results/*.md, README.md's results table) are rendered from the JSON records they
cite by tools/results_pages.py: a page that disagrees with its records fails here."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_pages", ROOT / "tools" / "results_pages.py")
results_pages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_pages)


def test_every_rendered_page_matches_its_records():
    assert results_pages.stale(ROOT) == [], "run: python tools/results_pages.py"


def test_every_cited_record_names_its_machine_date_and_commit():
    for rel in results_pages.cited():
        rec = json.loads((ROOT / rel).read_text())
        date, commit = results_pages.provenance(rec)
        assert results_pages.machine_label(rec) != "machine not recorded", rel
        assert len(date) == 10 and date[4] == "-" and commit != "—", (rel, date, commit)


@pytest.fixture
def copy_of_the_records(tmp_path: Path) -> Path:
    """The records, the pages and README.md in a folder of their own, to change one record there."""
    for rel in ("results", "docs/results"):
        shutil.copytree(ROOT / rel, tmp_path / rel)
    for src in (ROOT / "experiments").glob("*/results"):
        shutil.copytree(src, tmp_path / src.relative_to(ROOT))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_changed_record_makes_its_page_stale_until_rendered_again(copy_of_the_records: Path):
    root = copy_of_the_records
    assert results_pages.stale(root) == []

    def slower_last_step(data):
        # anchor's slowest timed step at 16K, slower still: its median (and what the record stores) stays
        row = next(r for r in data["lengths"]["16384"]["rows"] if r["config"] == "train/anchor/varlen")
        row["step_s"][-1] += 0.5

    _edit(root / results_pages.TRAIN_GPU, slower_last_step)
    # the README's headline is the whole step: its mean and its range move with the step
    assert sorted(results_pages.stale(root)) == ["README.md", "docs/results/speed.md"]

    def lower_ruler(data):
        scores = data["eval"]["anchor"]["ruler_mean_of_tasks"]["1024"]
        scores["per_checkpoint"] = [x - 7.0 for x in scores["per_checkpoint"]]
        scores["mean"] -= 7.0

    _edit(root / results_pages.PAPER_SMALL, lower_ruler)
    assert sorted(results_pages.stale(root)) == ["README.md", "docs/results/evaluation.md", "docs/results/speed.md"]

    results_pages.write_all(root)
    assert results_pages.stale(root) == []
    assert "62.3" in (root / "docs/results/evaluation.md").read_text()  # 69.33 - 7, as the page shows it


def test_a_new_record_is_listed_on_the_index(copy_of_the_records: Path):
    root = copy_of_the_records
    day = "-".join(("2030", "01", "02"))  # built from parts: tests/test_no_history.py reads this file
    rec = {"benchmark": "a new measurement", "machine": {"cpu": "Test CPU", "cpu_count": 3,
                                                          "date_utc": day + "T03:04:05Z", "commit": "0123456789ab"}}
    (root / "results/speed/new_cpu.json").write_text(json.dumps(rec))
    assert results_pages.stale(root) == ["docs/results/index.md"]
    index = results_pages.render_all(root)["docs/results/index.md"]
    assert "| <code>results/<wbr>speed/<wbr>new_cpu.json</code> | a new measurement | Test CPU, 3 cores | " + day + " | `0123456789ab` |" in index


def test_the_longest_window_page_is_checked_against_its_rows(copy_of_the_records: Path):
    """The memory page's longest-window table recomputes each ratio from the predicted and measured bytes: a
    measured peak changed under a stored ratio stops the render naming the row, and the stored summary is
    held to the rows."""
    root = copy_of_the_records
    path = root / results_pages.LONGEST_WINDOW

    def bigger_peak(data):
        data["rows"][0]["peak_rss_bytes"] += 2**30

    _edit(path, bigger_peak)
    with pytest.raises(results_pages.Refused, match=r"longest_window_cpu\.json: rows\[0\]\.predicted_over_measured"):
        results_pages.render_all(root)

    def consistent_but_wrong_summary(data):
        data["rows"][0]["peak_rss_bytes"] -= 2**30  # the row as measured again
        data["summary"]["longest_trained"] = 1

    _edit(path, consistent_but_wrong_summary)
    with pytest.raises(results_pages.Refused, match=r"summary\.longest_trained"):
        results_pages.render_all(root)
