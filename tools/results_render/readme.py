"""README.md's headline table: one line per claim, each with its record, machine, date and commit. The speed
claim is the whole training step, anchor ÷ full by mean and by median with the number of steps and their
range beside the FLOP ratio; attention alone is a row of its own, labelled so. The table holds current claims
only: a GPU parity report that did not finish, or was judged under a rule or emulation the code no longer
applies, stays on its results page (docs/results/gpu.md), labelled there, and is not a row here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .evaluation import ruler_scores
from .gpu import not_todays, parity_counts
from .precision import shift_curves
from .records import (AUDIT, BENCH_H100, BENCH_STEP_WARMUP, GPU_PARITY, PAPER_SMALL, TRAIN_GPU, Records,
                      machine_label, model_label, need, provenance_cells)
from .speed import bench_attention, bench_step_stats, train_gpu_rows, window_repeats
from .stats import Stats, num, ratio, ratio_cells, spread, steps_word, table

Row = list[Any]  # what, measured, the record's path, the record


def _step_cell(T: int, anchor: Stats, full: Stats, flop_ratio: float) -> str:
    by_mean, by_median = ratio_cells(anchor, full)
    n = f"{num(anchor.n)} steps each" if anchor.n == full.n else f"{num(anchor.n)} steps of anchor, {num(full.n)} of full"
    return (f"T={T:,}: by mean {by_mean}, by median {by_median}, over {n} (min–max, s: anchor "
            f"{spread(anchor.lo, anchor.hi)}, full {spread(full.lo, full.hi)}); FLOPs {ratio(flop_ratio)}")


def step_rows(records: Records) -> list[Row]:
    """The whole training step, anchor ÷ full: `anchor train` on the whole model (benchmarks/bench_train_gpu.py)
    per length and engine, then `anchor bench`'s step of the model cut to its first layers."""
    rows = []
    if records.exists(TRAIN_GPU):
        rec = records.load(TRAIN_GPU)
        warmup = need(TRAIN_GPU, rec, "warmup")
        for engine in ("varlen", "flex"):
            cells = []
            for length, block in rec.get("lengths", {}).items():
                stats, _ = train_gpu_rows(TRAIN_GPU, rec, length)
                a, f = stats.get(f"train/anchor/{engine}"), stats.get(f"train/full/{engine}")
                if a and f:
                    flops = {r["config"]: r.get("model_flops_per_step") for r in block.get("rows", [])}
                    cells.append(_step_cell(int(length), a, f, flops[f"train/anchor/{engine}"]
                                            / flops[f"train/full/{engine}"]))
            if cells:
                rows.append([f"**A whole training step**, AnchorAttention ÷ full attention: `anchor train` on the "
                             f"whole model ({model_label(rec.get('model'))}), engine `{engine}`, one GPU, each "
                             f"run's first {steps_word(warmup)} left out", "; ".join(cells), TRAIN_GPU, rec])
    if records.exists(BENCH_H100):
        rec = records.load(BENCH_H100)
        steps = bench_step_stats(BENCH_H100, rec)
        cells, layers = [], set()
        for (engine, T), by_variant in sorted(steps.items()):
            if "anchor" in by_variant and "full" in by_variant:
                (a_row, a), (f_row, f) = by_variant["anchor"], by_variant["full"]
                layers.add(a_row.get("layers"))
                cells.append(f"`{engine}` " + _step_cell(T, a, f, a_row["flops"] / f_row["flops"]))
        if cells:
            rows.append([f"A whole training step of the model cut to its first "
                         f"{' or '.join(map(num, sorted(layers)))} layers (`anchor bench`), AnchorAttention ÷ full, "
                         f"one GPU, each run's first {steps_word(BENCH_STEP_WARMUP)} left out", "; ".join(cells),
                         BENCH_H100, rec])
    return rows


def attention_rows(records: Records) -> list[Row]:
    """Attention alone (one layer's forward and backward) at the longest length of `anchor bench`'s record."""
    if not records.exists(BENCH_H100):
        return []
    rec = records.load(BENCH_H100)
    bench_attention(BENCH_H100, rec)  # the stored sums and ratios checked
    rows_h = [a for a in rec.get("attention", []) if a.get("variant") == "anchor" and "error" not in a
              and a.get("distribution") == "corpus"]
    longest = max(rows_h, key=lambda a: a["seq_len"], default=None)
    if not longest:
        return []
    full = next(a for a in rec["attention"] if a.get("variant") == "full" and a.get("distribution") == "corpus"
                and a.get("seq_len") == longest["seq_len"] and a.get("engine") == longest["engine"])
    mine, theirs = Stats.of(longest["ms_windows"]), Stats.of(full["ms_windows"])
    by_mean, by_median = ratio_cells(mine, theirs)
    n = mine.n
    same = (f"over {num(n)} windows each, so by mean and by median are the same number" if n <= 2
            else f"over {num(n)} windows each")
    return [[f"Attention alone (one layer's forward and backward, not a training step), AnchorAttention ÷ full "
             f"at T={longest['seq_len']:,}, engine `{longest['engine']}`, one GPU",
             f"by mean {by_mean}, by median {by_median}, {same}; {window_repeats(rec)} (FLOPs "
             f"{ratio(longest['flops'] / full['flops'])})", BENCH_H100, rec]]


def readme_table(records: Records) -> list[str]:
    """README's headline table: one line per claim, each with its record, machine, date and commit."""
    rows: list[Row] = []
    if records.exists(AUDIT):
        rec = records.load(AUDIT)
        curves = shift_curves(AUDIT, rec)
        if "fp32" in curves:
            fp32 = curves["fp32"]
            worst = max((p for p in curves if p != "fp32"), key=lambda p: curves[p].mean)
            rows.append([f"bf16 moves a pretrained model's attention when positions shift (model "
                         f"{model_label(rec.get('model'))})", f"D over {num(fp32.n)} shifts, by mean: fp32 {num(fp32.mean)}, "
                         f"`{worst}` {num(curves[worst].mean)}; "
                         f"by median: {num(fp32.median)}, {num(curves[worst].median)}", AUDIT, rec])
    rows += step_rows(records) + attention_rows(records)
    for rel in current_parity(records):
        rec = records.load(rel)
        n = parity_counts(rel, rec)
        rows.append([f"The real GPU kernels against the oracle, `{Path(rel).stem}`",
                     f"forward {n['forward'][0]}/{n['forward'][1]}, gradients {n['gradients'][0]}/"
                     f"{n['gradients'][1]}", rel, rec])
    if records.exists(PAPER_SMALL):
        rec = records.load(PAPER_SMALL)
        scores = ruler_scores(PAPER_SMALL, rec)
        cells = [f"{v} " + " / ".join(num(scores[v][l].mean) for l in sorted(scores[v]))
                 for v in ("anchor", "full") if scores.get(v)]
        if cells:
            lengths = sorted(scores.get("anchor") or next(iter(scores.values())))
            n = sorted({s.n for v in scores.values() for s in v.values()})
            rows.append(["RULER by length, paper-small profile (" + " / ".join(f"{l // 1024}K" for l in lengths)
                         + f"), mean over {', '.join(map(num, n))} checkpoints", "; ".join(cells), PAPER_SMALL, rec])
    out = table(["what", "measured", "record (machine, date, commit)"],
                [[w, m, f"`{rel}` ({machine_label(rec)}, {', '.join(provenance_cells(rec))})"]
                 for w, m, rel, rec in rows])
    return out + ["", "A date or commit marked (from git) was filled in later from git history, not written by the "
                  "run. A GPU parity report is a row here once it finished under today's rule and emulation; every "
                  "report, finished or not, is [on its page](docs/results/gpu.md). All results, each with its "
                  "record: [docs/results](docs/results/index.md)."]


def current_parity(records: Records) -> list[str]:
    """The GPU parity reports README's table shows, of the two at T=1025 (the smoke report is not a claim):
    finished, and judged under the rule and the emulations the code applies today (gpu.not_todays finds
    neither differing)."""
    current = []
    for rel in GPU_PARITY[:2]:
        if records.exists(rel):
            rec = records.load(rel)
            differs = not_todays(rec)
            if not parity_counts(rel, rec)["unfinished"] and not differs["rule"] and not differs["emulation"]:
                current.append(rel)
    return current
