"""The results pages (docs/results/*.md, README.md's results table) are rendered from the JSON records they
cite by tools/results_pages.py: a page that disagrees with its records fails here."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

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


# ---- every figure from its record ------------------------------------------------------------------------

_tools = str(ROOT / "tools")
if _tools not in sys.path:
    sys.path.insert(0, _tools)
from results_render import stats as _stats  # noqa: E402  (the package results_pages.py re-exports)

# A figure in prose: a number standing alone ("0.845", "16,384", "22.16"), not part of a name ("fp32", "H100",
# "SmolLM2-135M", "Llama-3.1-8B"), a path, a date or a paper's section ("§2").
FIGURE = re.compile(r"(?<![\w.\-/§])\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]\d+)?(?![\w\-/])")
RECORD_NAMED = re.compile(r"(?:`|<code>)((?:results|experiments)/[^`<]+\.json)(?:`|</code>)")


def figures(text: str) -> set[str]:
    return {m.group(0) for m in FIGURE.finditer(re.sub(r"`[^`]*`|<code>.*?</code>", "", text))}


def record_figures(rec: Any) -> set[str]:
    """Every figure a record gives: its numbers as written and with thousands separators, and the figures in
    its strings and keys."""
    out: set[str] = set()
    if isinstance(rec, dict):
        for k, v in rec.items():
            out |= figures(str(k)) | record_figures(v)
    elif isinstance(rec, list):
        for v in rec:
            out |= record_figures(v)
    elif isinstance(rec, (int, float)) and not isinstance(rec, bool):
        out |= {str(rec), f"{rec:,}"}
    elif isinstance(rec, str):
        out |= figures(rec)
    return out


def foreign_figures(text: str, computed: set[str], root: Path = ROOT, split: str = r"\n(?=## )") -> list[str]:
    """The figures of a rendered page that neither its render computed (`num`) nor the records named in their
    part of it (a section; a row of README's table, `split` at each row) give: a number typed into the page."""
    out = []
    parts = re.split(split, text)
    for part in parts:
        named = RECORD_NAMED.findall(part.replace("<wbr>", ""))
        given: set[str] = set()
        for rel in named:
            if (root / rel).is_file():
                given |= record_figures(json.loads((root / rel).read_text()))
        out += [f"{f!r} in: {part.strip()[:160]}" for f in sorted(figures(part) - computed - given)]
    return out


def test_every_figure_on_a_page_is_computed_or_given_by_its_record():
    for rel, fn in results_pages.PAGES.items():
        with _stats.collect() as computed:
            text = fn(results_pages.Records(ROOT))
        assert foreign_figures(text, computed) == [], rel
    readme = (ROOT / "README.md").read_text()
    block = readme.split(results_pages.README_START)[1].split(results_pages.README_END)[0]
    with _stats.collect() as computed:
        results_pages.readme_table(results_pages.Records(ROOT))
    assert foreign_figures(block, computed, split=r"\n(?=\| )") == []


def test_a_typed_figure_is_caught():
    rel = results_pages.LONGEST_WINDOW
    page = f"## Memory\n\n*Record: `{rel}` · machine: x*\n\nThe plan for H100s (80 GB each; nothing ran on a GPU)."
    with _stats.collect() as computed:
        _stats.num(13.7)
    assert [f.split(" in: ")[0] for f in foreign_figures(page, computed)] == ["'80'"]
    assert foreign_figures(page.replace("80 GB", f"{_stats.num(80.0)} GB"), computed | {"80"}) == []


def _prose_figures_in_the_render_code() -> list[str]:
    """Figures typed into the prose strings of the page modules (docstrings and comments aside): a figure on a
    page is computed from its record, never typed. References to the paper ("Figure 1") are not figures."""
    import ast

    out = []
    for path in sorted((ROOT / "tools" / "results_render").glob("*.py")):
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                text = re.sub(r"Figure \d+|utf-8|\b20\b", "", node.value)
                out += [f"{path.name}:{node.lineno}: {f!r} in {node.value[:80]!r}" for f in sorted(figures(text))]
    return out


def test_no_figure_is_typed_into_the_pages_prose():
    assert _prose_figures_in_the_render_code() == []


def test_the_memory_page_reads_the_memory_available_at_the_start_from_its_record():
    rec = json.loads((ROOT / results_pages.LONGEST_WINDOW).read_text())
    page = results_pages.render_all(ROOT)["docs/results/memory.md"]
    at_start = results_pages.num(rec["mem_available_bytes_at_start"] / 2**30, 4)
    assert f"{at_start} GiB were available when the measurements began" in page
    given = results_pages.num(rec["plan"]["budget_bytes"] / 2**30)
    assert f"the {given} GiB it was given (`{rec['plan_memory_from']}`)" in page
    for row in rec["rows"]:  # every length with the commit it was measured at
        assert f"`{row['commit'][:12]}" in page


def test_the_readme_speed_headline_is_the_whole_step_and_attention_a_row_of_its_own():
    readme = (ROOT / "README.md").read_text()
    block = readme.split(results_pages.README_START)[1].split(results_pages.README_END)[0]
    rows = [line for line in block.splitlines() if "÷ full" in line]
    assert "whole training step" in rows[0]
    rec = json.loads((ROOT / results_pages.TRAIN_GPU).read_text())
    warmup = rec["warmup"]
    for length, block_ in rec["lengths"].items():
        steps = {r["config"]: [t for t in r["step_s"][warmup:]] for r in block_["rows"] if r.get("step_s")}
        a, f = steps["train/anchor/varlen"], steps["train/full/varlen"]
        mean = results_pages.ratio(statistics.fmean(a) / statistics.fmean(f))
        median = results_pages.ratio(statistics.median(a) / statistics.median(f))
        assert (f"T={int(length):,}: by mean {mean}, by median {median}, over {len(a)} steps each (min–max, s: "
                f"anchor {results_pages.num(min(a))}–{results_pages.num(max(a))}, full "
                f"{results_pages.num(min(f))}–{results_pages.num(max(f))})") in rows[0]
    attention = next(r for r in rows if "Attention alone" in r)
    assert "not a training step" in attention and "the same number" in attention  # two windows: mean is median
    assert "the record keeps those medians, not the repeats" in attention


def test_a_ratio_is_never_written_as_one_when_it_is_not():
    assert results_pages.ratio(1.004) == "1.004" and results_pages.ratio(0.9996) == "0.9996"
    assert results_pages.ratio(1.0) == "1" and results_pages.ratio(0.761) == "0.761"
    assert results_pages.ratio_spread(0.76, 1.004) == "0.76–1.004"
    page = results_pages.render_all(ROOT)["docs/results/speed.md"]
    assert "–1 |" not in page


def test_a_date_filled_in_from_git_is_marked_so(copy_of_the_records: Path):
    root = copy_of_the_records
    rec = {"benchmark": "an old measurement", "machine": {"cpu": "Test CPU", "cpu_count": 3},
           "record": {"date": "-".join(("2030", "01", "02")), "commit": "0123456789ab", "from": "git log"}}
    (root / "results/speed/old_cpu.json").write_text(json.dumps(rec))
    index = results_pages.render_all(root)["docs/results/index.md"]
    day = rec["record"]["date"]
    assert f"| an old measurement | Test CPU, 3 cores | {day} (from git) | `0123456789ab` (from git) |" in index


def test_make_demos_disk_use_is_the_estimate_checkpoint_bytes_gives():
    from anchor.demo.checks import checkpoint_bytes
    from anchor.demo.settings import PROFILES

    gb = f"{checkpoint_bytes(PROFILES['demo']) / 1e9:.1f} GB"
    readme = (ROOT / "README.md").read_text()
    demo = (ROOT / "docs" / "verbs" / "demo.md").read_text()
    assert f"`make demo` writes an estimated {gb}" in " ".join(readme.split()) and "checkpoint_bytes" in readme
    assert f"Disk: an estimated {gb}" in demo


def test_the_million_audits_walls_are_recomputed_from_its_curves(copy_of_the_records: Path):
    """The precision page's walls (per RoPE base and policy, the first shift past twice a baseline) are recomputed
    from the record's shift curves by the audit's own rule: a stored wall moved, or a wall stored as never where
    the curve passes, stops the render naming the field."""
    root = copy_of_the_records
    path = root / results_pages.AUDIT_MILLION

    def moved(data):
        next(iter(data["rope_bases"].values()))["walls"]["fp32"]["over_floor"] = 8

    _edit(path, moved)
    with pytest.raises(results_pages.Refused, match=r"rope_bases\.[^.]+\.walls\.fp32\.over_floor"):
        results_pages.render_all(root)

    def never(data):
        next(iter(data["rope_bases"].values()))["walls"]["fp32"]["over_floor"] = None

    _edit(path, never)
    with pytest.raises(results_pages.Refused, match=r"rope_bases\.[^.]+\.walls\.fp32\.over_floor"):
        results_pages.render_all(root)
