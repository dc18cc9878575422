"""The demo's figures on disk and `summary.png`: the run's results in one grid of panels at the page's width.

`save_figure` writes a matplotlib figure atomically (a temporary name, then a rename), for every figure the
jobs draw. `draw_summary` draws the finished jobs' results anew from their summaries and files (the
audit's curves, the training loss, RULER, the held-out loss by position and the speed against the FLOP
ratio), three or two panels to a row with one legend per group of curves, so that its text shows at about the
page's size; `summary_figure` saves it as `summary.png`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Save a matplotlib figure to `path` atomically (a temporary name, then a rename)."""
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)


# The summary's panels in groups: each group's curves share one legend, in its first panel.
SUMMARY_GROUPS = ("audit", "runs", "speed")
SUMMARY_WIDTH_IN, SUMMARY_DPI = 10.5, 100  # 1050 pixels: about the page's width, so its text shows at ~its size


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _summary_panels(out: Path, record: dict[str, Any]) -> list[tuple[str, Any]]:
    """(group, draw(ax)) for each panel the finished jobs give, in the page's order: the audit's three
    curves, the training loss, RULER, held-out loss by position (without the audit or the bench), attention
    time and step time against their FLOP ratios."""
    jobs = record.get("jobs", {})

    def summary(st: str) -> dict[str, Any] | None:
        rec = jobs.get(st) or {}
        return rec.get("summary") if rec.get("done") and isinstance(rec.get("summary"), dict) else None

    panels: list[tuple[str, Any]] = []
    audit = _read_json(out / "audit" / "audit.json") if summary("audit") is not None else None
    if audit:
        for key in ("shift_curve", "per_token", "length_curve"):
            if audit.get(key):
                panels.append(("audit", lambda ax, k=key: _audit_panel(ax, audit, k)))
    train, ev, bench = summary("train"), summary("eval"), summary("bench")
    if train and train.get("runs"):
        keys = (summary("pack") or {}).get("keys_differ_share")
        panels.append(("runs", lambda ax: _loss_panel(ax, train, keys)))
    if ev and ev.get("runs"):
        panels.append(("runs", lambda ax: _ruler_panel(ax, ev)))
        if not (audit and bench) and any(r.get("buckets") for r in ev["runs"].values()):
            panels.append(("runs", lambda ax: _position_panel(ax, ev)))
    if bench and bench.get("attention"):
        panels.append(("speed", lambda ax: _bench_panel(ax, bench)))
    if not bench and train and any(r.get("step_time_vs_full") and r.get("flop_ratio") for r in train["runs"].values()):
        panels.append(("speed", lambda ax: _step_time_panel(ax, train)))
    return panels


def _style(v: str) -> dict[str, Any]:
    """One colour per variant on every panel (a run's fp32 twin dashed)."""
    base = v.split("@")[0]
    colors = {"anchor": "C0", "full": "C1", "intra_doc": "C2", "intra_doc_reset": "C3"}
    return {"color": colors.get(base, "C4"), "ls": "--" if v.endswith("@fp32") else "-", "label": v}


def _audit_panel(ax, audit: dict[str, Any], key: str) -> None:
    for k, (pol, c) in enumerate(audit[key].items()):
        if key == "shift_curve":
            ax.plot(range(len(c["shifts"])), c["D"], marker="o", ms=3, color=f"C{k}", label=pol)
            ax.set_xticks(range(len(c["shifts"])), [str(x) for x in c["shifts"]])
            ax.set_xlabel("shift of every position")
            ax.set_ylabel("attention difference D")
            ax.set_title(f"audit: RoPE under a shift (T = {c.get('seq_len')})", fontsize=9)
        elif key == "per_token":
            ax.plot(range(1, len(c["values"]) + 1), c["values"], lw=1, color=f"C{k}", label=pol)
            ax.set_xscale("log")
            ax.set_xlabel("key token (1: the first)")
            ax.set_ylabel("per-token difference")
            ax.set_title("audit: difference per key token", fontsize=9)
        else:
            ax.plot(c["lengths"], c["D_logit"], marker="o", ms=3, color=f"C{k}", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("first-token logit difference")
            ax.set_title("audit: first-token logit against length", fontsize=9)
    ax.set_yscale("log")


def _loss_panel(ax, train: dict[str, Any], keys_differ: float | None) -> None:
    for v, r in train["runs"].items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], marker="o" if len(r["loss"]) < 40 else None, ms=4,
                **_style(v))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    what = f", keys differ on {keys_differ:.0%} of slots" if keys_differ is not None else ""
    ax.set_title(f"training at T={train.get('seq_len')}, {train.get('dtype')}{what}", fontsize=9)


def _ruler_panel(ax, ev: dict[str, Any]) -> None:
    Ls = [int(L) for L in ev.get("lengths", [])]
    for v, r in ev["runs"].items():
        got = [L for L in Ls if str(L) in r["scores"]]
        ax.errorbar(got, [r["scores"][str(L)]["mean"] for L in got], yerr=[r["scores"][str(L)]["std"] for L in got],
                    marker="o", ms=4, capsize=3, **_style(v))
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ls, [str(L) for L in Ls])
    ax.minorticks_off()
    ax.set_ylim(-5, 105)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("RULER score (mean of tasks)")
    ax.set_title(f"RULER, {ev.get('dtype')}, mean ± std over checkpoints", fontsize=9)


def _position_panel(ax, ev: dict[str, Any]) -> None:
    L = max(int(x) for r in ev["runs"].values() for x in r.get("buckets") or {})
    for v, r in ev["runs"].items():
        cells = (r.get("buckets") or {}).get(str(L))
        if cells:
            ax.plot([(c["start"] + c["end"]) / 2 for c in cells], [c["nll"] for c in cells], marker="o", ms=3,
                    **_style(v))
    ax.set_xlabel("position in the held-out document")
    ax.set_ylabel("NLL (nats per token)")
    ax.set_title(f"held-out loss by position at {L}", fontsize=9)


def _bench_panel(ax, bench: dict[str, Any]) -> None:
    rows = [r for r in bench["attention"] if r.get("variant") != "full" and r.get("time_ratio") is not None]
    ax.plot([0, 1.05], [0, 1.05], color="grey", lw=0.8, ls=":", label="time = FLOPs")
    for k, r in enumerate(rows):
        ax.plot(r["flop_ratio"], r["time_ratio"], "o", color=f"C{k + 2}", label=f"{r['variant']}, T={r['seq_len']}")
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, max([1.1, *(r["time_ratio"] * 1.1 for r in rows)]))
    ax.set_xlabel("FLOPs / full's")
    ax.set_ylabel("attention time / full's")
    ax.set_title("attention alone, fwd + bwd", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")


def _step_time_panel(ax, train: dict[str, Any]) -> None:
    ax.plot([0, 1.05], [0, 1.05], color="grey", lw=0.8, ls=":")
    for v, r in train["runs"].items():
        if r.get("step_time_vs_full") and r.get("flop_ratio"):
            ax.plot(r["flop_ratio"]["step"], r["step_time_vs_full"], "o", color=_style(v)["color"])
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, max([1.2, *(r.get("step_time_vs_full") or 0 for r in train["runs"].values())]) * 1.05)
    ax.set_xlabel("FLOPs / full's (whole step)")
    ax.set_ylabel("median step time / full's")
    ax.set_title("training step time (dotted: time = FLOPs)", fontsize=9)


def summary_figure(out: Path, record: dict[str, Any]) -> Path | None:
    """`summary.png` (`draw_summary`) in `out`; None (and no file) when no job gave a panel."""
    target = out / "summary.png"
    fig = draw_summary(out, record)
    if fig is None:
        target.unlink(missing_ok=True)
        return None
    import matplotlib.pyplot as plt

    save_figure(fig, target, dpi=SUMMARY_DPI)
    plt.close(fig)
    return target


def draw_summary(out: Path, record: dict[str, Any]):
    """The summary figure: the finished jobs' results redrawn in one grid of panels, three (or two) to
    a row, a shorter last row sharing the width among its panels, at the page's width (`_summary_panels`):
    the audit's curves, the training loss, RULER and the speed against the FLOP ratio. The canvas holds
    nothing but the panels, their legends (one per group of curves: the audit's policies in its first panel,
    the runs in theirs; the speed panel its own) and the title. None when no job gave a panel."""
    panels = _summary_panels(out, record)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = 3 if n % 3 == 0 or n > 4 else min(n, 2)
    rows = (n + cols - 1) // cols
    span = 6 if cols == 3 else cols  # grid columns: a last row of fewer panels shares the width among them
    fig = plt.figure(figsize=(SUMMARY_WIDTH_IN, 3.3 * rows + 0.5), layout="constrained")
    grid = fig.add_gridspec(rows, span)
    axes = []
    for k in range(n):
        row, col = divmod(k, cols)
        m = min(cols, n - row * cols)  # panels in this row
        w = span // m
        axes.append(fig.add_subplot(grid[row, col * w:(col + 1) * w]))
    seen: set[str] = set()
    for ax, (group, draw) in zip(axes, panels):
        draw(ax)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if group not in seen and group != "speed":  # the group's legend, once (speed panels carry their own)
            seen.add(group)
            ax.legend(fontsize=8, title="RoPE policy" if group == "audit" else "run", title_fontsize=8)
    fig.suptitle(f"anchor demo — {record.get('model')}", fontsize=12)
    return fig
