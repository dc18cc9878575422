"""The demo's summary figure fills its canvas, and its page's tables print no dict: the measurements of
tests/browser/pagecheck.py (`check_bands`, numpy on the PNG; `check_cells`) on a summary.png and an
index.html drawn from a demo record, and on the earlier layout (the audit's four-panel figure pasted at full
width, the others two to a row), which they fail."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from anchor.demo.page import index_page, summary_figure
from tests.browser.pagecheck import blank_bands, check_bands, check_cells

POLICIES = ("fp32", "hf_bf16", "fa2_bf16", "paper_bf16")


def _audit(out: Path) -> None:
    (out / "audit").mkdir(parents=True)
    rng = np.random.default_rng(0)
    audit = {"shift_curve": {p: {"shifts": [0, 8, 15, 17, 100, 2000], "seq_len": 64,
                                 "D": list(10.0 ** rng.uniform(-3 if p == "fp32" else 0, 1, 6))} for p in POLICIES},
             "per_token": {p: {"values": list(10.0 ** rng.uniform(-6, 0, 63))} for p in POLICIES},
             "length_curve": {p: {"lengths": [64, 128, 256], "D_logit": list(10.0 ** rng.uniform(-4, 0.7, 3))}
                              for p in POLICIES}}
    (out / "audit" / "audit.json").write_text(json.dumps(audit))


def demo_record(out: Path) -> dict:
    """A finished demo's record (the job summaries the page and the figure read), its audit.json in `out`."""
    _audit(out)
    run = lambda loss: {"steps": 4, "loss": loss, "loss_first": loss[0], "loss_last": loss[-1], "step_s_median": 9.0,
                        "tokens_per_s_median": 110.0, "eval_checkpoints": ["step-2", "step-4"], "dtype": "bfloat16",
                        "load_average": {"before": 1.0, "after": 1.2, "cores": 2,
                                         "during": {"samples": 8, "every_s": 5.0, "mean": 1.9, "min": 1.1, "max": 2.6}}}
    score = lambda m: {"mean": m, "std": 3.0, "se": 9.0, "checkpoints": 2}
    summaries = {
        "corpus": {"file": "corpus.jsonl", "python": "3.11", "max_docs_per_domain": None,
                   "domains": {"code": {"docs": 729, "chars": 12117039}, "docs": {"docs": 79, "chars": 464970}}},
        "pack": {"windows": {"seq_len": 1024, "count": 396, "slots": 405504, "padding_slots": 618,
                             "docs_per_window": {"mean": 7.3, "median": 7.0, "max": 19}, "boundary_window_share": 0.88},
                 "documents": {"documents": 830, "pieces": 19258, "left_out": 28, "left_out_chars": 1691370,
                               "max_chars": 16384, "selected": 2507, "mixture": "original",
                               "tokens_per_piece": {"median": 65.0, "q1": 32.0, "q3": 149.0, "mean": 155.1, "min": 3,
                                                    "max": 8693, "p90": 323.0},
                               "domains": {"code": {"documents": 729, "pieces": 18951, "left_out": 25,
                                                    "left_out_chars": 1618456}}},
                 "docs_per_window": {"median": 7.0, "q1": 4.0, "q3": 10.0, "mean": 7.3, "min": 1, "max": 19},
                 "keys_differ_share": 0.70},
        "audit": {"runtime_s": 15.0, "policies": list(POLICIES)},
        "train": {"model": "default", "seq_len": 1024, "engine": "varlen", "dtype": "bfloat16",
                  "runs": {"anchor": run([2.9, 2.7, 2.5, 2.4]), "full": run([2.7, 2.6, 2.4, 2.2])}},
        "eval": {"tasks": ["niah_single_1", "vt"], "lengths": [1024, 2048], "samples": 4, "dtype": "bfloat16",
                 "runs": {v: {"checkpoints": ["step-2", "step-4"], "scores": {"1024": score(60.0), "2048": score(m)},
                              "tasks": [], "perplexity": {}, "buckets": {}} for v, m in (("anchor", 55.0), ("full", 50.0))}},
        "bench": {"machine": "cpu", "estimate": [],
                  "attention": [{"engine": "varlen", "variant": v, "seq_len": L, "ms": 100.0, "flop_ratio": f, "time_ratio": t}
                                for L, f, t in ((2048, 0.28, 0.32), (4096, 0.5, 0.53)) for v in ("full", "anchor")]}}
    jobs = {st: {"done": True, "finished": "now", "seconds": 1.0, "summary": s} for st, s in summaries.items()}
    return {"model": "default", "jobs": jobs, "ran": list(jobs), "reused": [],
            "dtype_choice": {"dtype": "bfloat16", "reason": "this CPU has bf16 units (avx512_bf16)"}}


def _png(path: Path, size: tuple[int, int]) -> None:
    """A panel image of `size` (width, height) pixels: drawn to its edges, as a saved figure's axes are."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = size
    img = np.full((h, w, 3), 0.35)
    img[::7] = 0.9  # some lines, no blank row
    plt.imsave(path, img)


def earlier_layout(out: Path, model: str = "default") -> Path:
    """summary.png as the earlier page.summary_figure drew it, from panels of the sizes the demo's jobs save
    (audit/figure1.png 1760x473, loss.png and ruler.png 660x396, the bench's 528x462)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    sizes = {"precision audit": (1760, 473), "training loss": (660, 396), "RULER": (660, 396),
             "attention time": (528, 462)}
    panels = []
    for title, size in sizes.items():
        _png(out / "old" / f"{title}.png", size)
        panels.append((out / "old" / f"{title}.png", title))
    wide = [pt for pt in panels if pt[1] == "precision audit"]
    rest = [pt for pt in panels if pt[1] != "precision audit"]
    cols = 2 if len(rest) > 1 else 1
    rows = (len(rest) + cols - 1) // cols
    heights = ([2.0] if wide else []) + [1.0] * rows
    fig = plt.figure(figsize=(7 * cols if rest else 14, 4.2 * sum(heights)))
    grid = fig.add_gridspec(len(heights), cols, height_ratios=heights)
    cells = ([fig.add_subplot(grid[0, :])] if wide else []) + [
        fig.add_subplot(grid[(1 if wide else 0) + k // cols, k % cols]) for k in range(len(rest))]
    for ax, (path, title) in zip(cells, wide + rest):
        ax.axis("off")
        ax.imshow(mpimg.imread(path))
    fig.suptitle(f"anchor demo — {model}", fontsize=14)
    fig.tight_layout()
    target = out / "summary-earlier.png"
    fig.savefig(target, dpi=90)
    plt.close(fig)
    return target


def test_the_summary_figure_fills_its_canvas(tmp_path):
    path = summary_figure(tmp_path, demo_record(tmp_path))
    bands = blank_bands(path)
    from PIL import Image

    w, h = Image.open(path).size
    print(f"summary.png {w}x{h}: widest blank band {max(n for _, n in bands)} rows ({max(n for _, n in bands) / h:.1%})")
    assert not check_bands(path), check_bands(path)
    assert w <= 1100  # drawn at about the page's width (1000 CSS pixels): its text is not shrunk to pixels


def test_the_earlier_layout_fails_the_band_check(tmp_path):
    problems = check_bands(earlier_layout(tmp_path))
    print("\n".join(problems))
    assert problems  # the audit's wide figure in a tall cell: blank bands above and below it


def test_without_audit_and_bench_the_runs_fill_the_figure(tmp_path):
    record = demo_record(tmp_path)
    for st in ("audit", "bench"):
        del record["jobs"][st]
    path = summary_figure(tmp_path, record)
    assert not check_bands(path), check_bands(path)


def test_no_table_cell_holds_a_dict(tmp_path):
    record = demo_record(tmp_path)
    index_page(tmp_path, record)
    html = (tmp_path / "index.html").read_text()
    assert not check_cells(html), check_cells(html)
    assert "Documents per window: median 7 (quartiles 4–10, range 1–19" in html
    assert "Slots whose visible keys differ between anchor and full attention: 70%" in html
    assert "1.90 (1.10–2.60, 8 samples)" in html  # the load while the runs trained
    # the check fails on a cell printed as a dict, as the corpus's domains and the pack's windows were
    assert check_cells("<table><tr><td>{'seq_len': 1024}</td></tr></table>")
