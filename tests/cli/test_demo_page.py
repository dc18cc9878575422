"""The demo page's readability: the summary figure draws one legend per group of curves and its audit panels
at the size of the others (not shrunk inside a four-panel picture); step times measured on a busy machine
are flagged, with the load sampled while the run trained."""

from __future__ import annotations

from anchor.demo.page import draw_summary, index_page
from tests.test_summary_figure import demo_record


def test_one_legend_per_group_of_curves(tmp_path):
    import matplotlib.pyplot as plt

    fig = draw_summary(tmp_path, demo_record(tmp_path))
    try:
        axes = fig.axes
        titles = [ax.get_title() for ax in axes]
        legends = [ax.get_title() for ax in axes if ax.get_legend() is not None]
        print(titles, legends)
        assert len(axes) == 6  # three audit panels, loss, RULER, attention time: a full 2 x 3 grid
        assert sum(t.startswith("audit:") for t in titles) == 3
        # the audit's policies once, the runs once (loss panel), the speed panel's own markers
        assert [t.split(":")[0].split(" ")[0] for t in legends] == ["audit", "training", "attention"], legends
        widths = {round(ax.get_position().width, 3) for ax in axes}
        assert len(widths) == 1, widths  # every panel the same size: the audit's text as large as the rest
    finally:
        plt.close(fig)


def test_step_times_of_a_busy_machine_are_flagged(tmp_path, monkeypatch):
    import anchor.demo.jobs as jobs
    import anchor.demo.train_job as train_job

    monkeypatch.setattr(train_job.os, "cpu_count", lambda: 2)
    assert jobs.busy_machine(1.5) and not jobs.busy_machine(0.4) and not jobs.busy_machine(None)
    run = {"steps": 2, "loss_first": 3.0, "loss_last": 2.9, "step_s_median": 1.0, "tokens_per_s_median": 100.0,
           "step_time_vs_full": 1.0, "eval_checkpoints": ["step-2"], "loss": [3.0, 2.9]}
    summary = {"model": "m", "seq_len": 128, "engine": "varlen", "dtype": "float32",
               "runs": {"full": {**run, "load_average": {"before": 0.1, "after": 1.1, "cores": 2}, "busy": False},
                        "anchor": {**run, "load_average": {"before": 2.4, "after": 3.0, "cores": 2}, "busy": True}}}
    record = {"model": "m", "jobs": {"train": {"done": True, "summary": summary, "finished": "now", "seconds": 1}}}
    index_page(tmp_path, record)
    html = (tmp_path / "index.html").read_text()
    assert "2.40 → 3.00 (2 cores) busy" in html and "0.10 → 1.10 (2 cores)</td>" in html
    assert "The machine was busy with other work when anchor started" in html


def test_the_load_is_sampled_while_a_run_trains(monkeypatch):
    import time

    import anchor.demo.jobs as jobs
    import anchor.demo.train_job as train_job

    loads = iter([1.0, 3.0, 2.0] + [2.0] * 100)
    monkeypatch.setattr(train_job, "_load_average", lambda: next(loads))
    with jobs.LoadSampler(every_s=0.01) as s:
        time.sleep(0.2)
    got = s.summary()
    assert got["samples"] >= 3 and got["min"] == 1.0 and got["max"] == 3.0, got
