"""bench.json, report.md and the figures of `anchor bench`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from anchor_core.atomic import publish, staging_dir


def _fmt(x: Any, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)


def plot_figures(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    rows = [r for r in result["attention"] if r.get("ms")]
    if rows:
        dists = list(dict.fromkeys(r["distribution"] for r in rows))
        fig, axes = plt.subplots(1, len(dists), figsize=(4.6 * len(dists), 3.8), squeeze=False)
        for ax, dist in zip(axes[0], dists):
            for engine in dict.fromkeys(r["engine"] for r in rows):
                for variant in dict.fromkeys(r["variant"] for r in rows):
                    pts = sorted((r["seq_len"], r["ms"]) for r in rows
                                 if r["distribution"] == dist and r["engine"] == engine and r["variant"] == variant)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{variant} ({engine})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("window length T")
            ax.set_ylabel("attention fwd+bwd, ms (one layer)")
            ax.set_title(dist)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "time_vs_length.png", dpi=110)
        plt.close(fig)
        names.append("time_vs_length.png")

        pts = [r for r in rows if r["variant"] != "full" and r.get("time_ratio") is not None]
        if pts:
            fig, ax = plt.subplots(figsize=(4.8, 4.2))
            for variant in dict.fromkeys(r["variant"] for r in pts):
                sel = [r for r in pts if r["variant"] == variant]
                ax.scatter([r["flop_ratio"] for r in sel], [r["time_ratio"] for r in sel], label=variant, s=18)
            top = max(1.0, max(max(r["flop_ratio"], r["time_ratio"]) for r in pts)) * 1.05
            ax.plot([0, top], [0, top], "k-", lw=0.8, label="time = FLOPs")
            ax.plot([0, top], [0, 1.25 * top], "k--", lw=0.8, label="1.25 x FLOPs")
            ax.set_xlim(0, top)
            ax.set_ylim(0, top * 1.25)
            ax.set_xlabel("FLOP ratio against full")
            ax.set_ylabel("time ratio against full")
            ax.set_title("attention: measured against the FLOP limit")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(out / "time_ratio_vs_flop_ratio.png", dpi=110)
            plt.close(fig)
            names.append("time_ratio_vs_flop_ratio.png")
    return names


def render_report(result: dict[str, Any], figures: list[str] | None) -> str:
    s = result["settings"]
    m = result["machine"]
    lines = ["# anchor bench", "",
             f"Model {s['model']} (heads {s['heads']['heads']}/{s['heads']['kv_heads']}, head dim "
             f"{s['heads']['head_dim']}), {s['device']} {s['dtype']}; machine: {m.get('gpu') or m.get('cpu')}, "
             f"{m.get('cpus_usable')} CPUs usable, load {m.get('load_average')}; {result['runtime_s']} s.", ""]
    if result["attention"]:
        lines += ["## Attention (one layer, forward + backward)", "",
                  "Ratios are against `full` on the same engine and windows, measured in this run.", "",
                  "| engine | distribution | T | variant | ms | FLOP ratio | time ratio | time / FLOP ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["attention"]:
            ms = r.get("ms")
            lines.append(f"| {r['engine']} | {r['distribution']} | {r['seq_len']} | {r['variant']} | "
                         f"{_fmt(ms, '.1f') if ms else r.get('error', '—')} | {_fmt(r.get('flop_ratio'), '.3f')} | "
                         f"{_fmt(r.get('time_ratio'), '.3f')} | {_fmt(r.get('time_over_flop'), '.2f')} |")
        lines += ["", "Distributions: " + "; ".join(f"{k}: {v}" for k, v in result["distributions"].items()), ""]
    if result["step"]:
        mem_key, mem_name = ("peak_cuda_gib", "CUDA") if s["device"] == "cuda" else ("peak_rss_gib", "RSS")
        lines += ["## A whole training step (`anchor train`)", "",
                  f"| engine | T | variant | model | step s | FLOP ratio | time ratio | peak {mem_name} GiB |", "|---|---|---|---|---|---|---|---|"]
        for r in result["step"]:
            lines.append(f"| {r['engine']} | {r['seq_len']} | {r['variant']} | {r['model']}, {r['layers']} layers | "
                         f"{_fmt(r.get('step_s'), '.2f') if r.get('step_s') else r.get('error', '—')} | "
                         f"{_fmt(r.get('flop_ratio'), '.3f')} | {_fmt(r.get('time_ratio'), '.3f')} | "
                         f"{_fmt(r.get(mem_key), '.2f')} |")
        cal = result.get("calibration")
        if cal:
            rates = cal["rates_flops_per_s"]
            lines += ["", f"Calibration ({cal['how']}): dense {rates['dense'] / 1e9:.1f} GFLOP/s, attention "
                          f"{rates['attention'] / 1e9:.1f} GFLOP/s; predicted against measured step: "
                      + ", ".join(f"{f['predicted_s']:.2f} / {f['step_s']:.2f} s" for f in cal["fit"])]
        lines.append("")
    if result["estimate"]:
        a = result["estimate_assumptions"]
        lines += ["## Estimate: days per 1B tokens", "",
                  f"GPU rates {a['source']}: {a['name']}, peak {a['peak_tflops']} TFLOP/s, MFU dense {a['mfu_dense']}, "
                  f"attention {a['mfu_attention']}, all-to-all {a['all_to_all_gbps']} GB/s per GPU; {a['note']}.", "",
                  "| model | GPUs | T | distribution | variant | days / 1B tokens | saving vs full | comms share |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in result["estimate"]:
            lines.append(f"| {e['model']} | {e['gpus']} x {e['gpu']} | {e['seq_len']} | {e['distribution']} | "
                         f"{e['variant']} | {e['days_per_1b_tokens']:.3g} | {_fmt(e.get('saving_vs_full'), '.1%')} | "
                         f"{e['comms_s'] / e['step_s']:.1%} |")
        lines += ["", f"The paper: {result['paper']}.", ""]
    for f in figures or []:
        lines += [f"![{f}]({f})", ""]
    return "\n".join(lines)


def write_bench(result: dict[str, Any], out: str | Path, staging: Path | None = None) -> Path:
    """bench.json, report.md and the figures into `out`, via a staging folder renamed at the end (`staging`:
    one of `anchor_core.atomic.staging_dir(out)` the caller holds, else a new one)."""
    import contextlib


    out = Path(out).resolve()
    with contextlib.nullcontext(staging) if staging is not None else staging_dir(out, "bench") as tmp:
        work = tmp / "bench"
        work.mkdir()
        figures = plot_figures(result, work)
        (work / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
        (work / "report.md").write_text(render_report(result, figures))
        publish(work, out)
    return out
