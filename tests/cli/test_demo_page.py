"""The demo page's readability: the summary figure's audit panel (four panels of its own) spans the figure
rather than a quarter of it, where it could not be read; step times measured on a busy machine are flagged."""

from __future__ import annotations

import numpy as np

from anchor_app.demo.page import SUMMARY_PANELS, index_page, summary_figure


def _png(path, color, size=(400, 600)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    img = np.zeros((*size, 3))
    img[..., ["r", "g", "b"].index(color)] = 1.0
    plt.imsave(path, img)


def test_the_audit_panel_spans_the_summary_figure(tmp_path):
    record = {"model": "m", "stages": {}}
    for stage, name, _ in SUMMARY_PANELS:
        _png(tmp_path / stage / name, "r" if stage == "audit" else "b")
        record["stages"][stage] = {"done": True}
    import matplotlib.image as mpimg

    img = mpimg.imread(summary_figure(tmp_path, record))
    red = (img[..., 0] > 0.9) & (img[..., 1] < 0.1) & (img[..., 2] < 0.1)
    cols = red.any(axis=0).mean()  # share of the figure's width the audit covers
    area = red.mean()
    print(f"audit panel: {cols:.2f} of the width, {area:.2f} of the area")
    assert cols > 0.6 and area > 0.3  # before: one cell of a 2 x 2 grid (under 0.5 of the width, ~0.2 of the area)


def test_step_times_of_a_busy_machine_are_flagged(tmp_path, monkeypatch):
    import anchor_app.demo.stages as stages

    monkeypatch.setattr(stages.os, "cpu_count", lambda: 2)
    assert stages.busy_machine(1.5) and not stages.busy_machine(0.4) and not stages.busy_machine(None)
    run = {"steps": 2, "loss_first": 3.0, "loss_last": 2.9, "step_s_median": 1.0, "tokens_per_s_median": 100.0,
           "step_time_vs_full": 1.0, "eval_checkpoints": ["step-2"], "loss": [3.0, 2.9]}
    summary = {"model": "m", "seq_len": 128, "engine": "varlen", "dtype": "float32",
               "runs": {"full": {**run, "load_average": {"before": 0.1, "after": 1.1, "cores": 2}, "busy": False},
                        "anchor": {**run, "load_average": {"before": 2.4, "after": 3.0, "cores": 2}, "busy": True}}}
    record = {"model": "m", "stages": {"train": {"done": True, "summary": summary, "finished": "now", "seconds": 1}}}
    index_page(tmp_path, record)
    html = (tmp_path / "index.html").read_text()
    assert "2.40 → 3.00 (2 cores) busy" in html and "0.10 → 1.10 (2 cores)</td>" in html
    assert "The machine was busy with other work when anchor started" in html
