"""The speed page: anchor against full attention (one layer and a whole step), the trainer against a
plain loop, the audit's wall time, the data pipeline and the oracle's forward."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .records import (AUDIT_SPEED, BENCH_CPU, BENCH_H100, BENCH_H100_FLEX, BENCH_STEP_WARMUP, DATA, GENERATED,
                      ORACLE_FORWARD, TRAIN_GPU, TRAIN_OVERHEAD, Records, agree, machine_label, model_label, need,
                      provenance_cells, refuse, section)
from .stats import Stats, num, ratio_cells, ratio_spread, steps_word, table


def bench_attention(rel: str, rec: dict[str, Any], variant: str = "anchor") -> list[list[Any]]:
    """`variant` against `full` per (windows, engine, T): FLOPs and time over full's, the time by mean (the
    windows' summed times) and by median, the per-window range; stored sums and ratios checked."""
    rows, full = [], {}
    ok = [a for a in rec.get("attention", []) if "error" not in a]
    for a in ok:
        if a.get("variant") == "full":
            full[(a.get("distribution"), a.get("engine"), a.get("seq_len"))] = a
    for a in ok:
        where = f"attention[{a.get('variant')}, {a.get('engine')}, {a.get('distribution')}, T={a.get('seq_len')}]"
        w = a["ms_windows"]
        agree(rel, f"{where}.ms", a.get("ms"), sum(w), abs_tol=2e-3)
        for i, reps in enumerate(a.get("ms_repeats") or []):
            agree(rel, f"{where}.ms_windows[{i}]", w[i], statistics.median(reps), abs_tol=6e-4)
        f = full.get((a.get("distribution"), a.get("engine"), a.get("seq_len")))
        if f is None:
            continue
        time_ratio, flop_ratio = sum(w) / sum(f["ms_windows"]), a["flops"] / f["flops"]
        agree(rel, f"{where}.time_ratio", a.get("time_ratio"), time_ratio, abs_tol=6e-5)
        agree(rel, f"{where}.flop_ratio", a.get("flop_ratio"), flop_ratio, abs_tol=6e-5)
        # anchor/bench/run.py divides the two ratios as it stores them, rounded to 4 decimals
        agree(rel, f"{where}.time_over_flop", a.get("time_over_flop"), round(time_ratio, 4) / round(flop_ratio, 4),
              abs_tol=6e-4)
        if a.get("variant") != variant:
            continue
        per_window = [x / y for x, y in zip(w, f["ms_windows"])]
        mine, theirs = Stats.of(w), Stats.of(f["ms_windows"])
        rows.append([a.get("distribution"), a.get("engine"), num(a.get("seq_len")), num(mine.n), num(flop_ratio),
                     *ratio_cells(mine, theirs), ratio_spread(min(per_window), max(per_window)),
                     num(time_ratio / flop_ratio)])
    return rows


def window_repeats(rec: dict[str, Any]) -> str:
    """How a window's time in an `anchor bench` record was taken, and whether the record keeps the repeats."""
    repeats = rec.get("settings", {}).get("repeats")
    rows = [a for a in rec.get("attention", []) if "error" not in a]
    if rows and all(a.get("ms_repeats") for a in rows):
        return (f"each window's time is the median of its {repeats} repeats after a warm-up round, and the "
                "record keeps every repeat (`ms_repeats`)")
    return (f"each window's time is the median of its {repeats} repeats after a warm-up round; the record "
            "keeps those medians, not the repeats")


def windows_note(rec: dict[str, Any]) -> str:
    """Says so where a row's ratios are over two windows or fewer: the mean and the median then coincide."""
    ns = sorted({len(a["ms_windows"]) for a in rec.get("attention", []) if "error" not in a})
    if ns and max(ns) <= 2:
        many = "window" if ns == [1] else "windows"
        return (f" With {' or '.join(map(str, ns))} {many} per row the mean of a row's windows is their median, "
                "so the two ratios are the same number.")
    return ""


def bench_step_stats(rel: str, rec: dict[str, Any]) -> dict[tuple[str, int], dict[str, tuple[dict[str, Any], Stats]]]:
    """`anchor bench`'s training-step rows by (engine, T) and variant: each row with its steps after the warm-up,
    the median it stores checked against them."""
    out: dict[tuple[str, int], dict[str, tuple[dict[str, Any], Stats]]] = {}
    for s in rec.get("step", []):
        where = f"step[{s.get('variant')}, {s.get('engine')}]"
        st = Stats.of(s["step_s_all"][BENCH_STEP_WARMUP:])
        agree(rel, f"{where}.step_s", s.get("step_s"), st.median, abs_tol=6e-4)
        out.setdefault((s.get("engine"), s.get("seq_len")), {})[s.get("variant")] = (s, st)
    return out


def bench_steps(rel: str, rec: dict[str, Any]) -> list[list[Any]]:
    """`anchor bench`'s training-step rows: the steps after the warm-up, and time and FLOPs over full's."""
    rows = []
    for steps in bench_step_stats(rel, rec).values():
        full = steps.get("full")
        for variant, (s, st) in steps.items():
            ratios = ["—", "—", "—"]
            if full:
                flop_ratio = s["flops"] / full[0]["flops"]
                agree(rel, f"step[{variant}].flop_ratio", s.get("flop_ratio"), flop_ratio, abs_tol=6e-5)
                # anchor/bench/run.py divides the step times as it stores them, rounded to 3 decimals
                agree(rel, f"step[{variant}].time_ratio", s.get("time_ratio"),
                      round(st.median, 3) / round(full[1].median, 3), abs_tol=6e-5)
                ratios = [num(flop_ratio), *ratio_cells(st, full[1])]
            rows.append([variant, s.get("engine"), num(s.get("seq_len")), s.get("layers"), s.get("dtype"),
                         *st.cells(), *ratios])
    return rows


def train_gpu_rows(rel: str, rec: dict[str, Any], length: str) -> tuple[dict[str, Stats], list[list[Any]]]:
    """One length of benchmarks/bench_train_gpu.py's record: each configuration's steps after the record's
    `warmup` in every round, and its stored medians, means, throughputs and MFU checked against them."""
    warmup = need(rel, rec, "warmup")
    block = rec["lengths"][length]
    T = int(length)
    stats, rows = {}, []
    for r in block.get("rows", []):
        cfg = r["config"]
        where = f"lengths.{length}.rows[{cfg}]"
        if not r.get("step_s"):
            rows.append([f"{cfg} ({r.get('error', 'no steps').split('.')[0]})"] + ["—"] * 7)
            continue
        rounds = r["step_s"] if isinstance(r["step_s"][0], list) else [r["step_s"]]
        # a run no longer than its warm-up counts whole, as benchmarks/bench_train_gpu.py counts it
        st = Stats.of(t for times in rounds for t in (times[warmup:] or times))
        agree(rel, f"{where}.median_step_s", r.get("median_step_s"), st.median)
        agree(rel, f"{where}.mean_step_s", r.get("mean_step_s"), st.mean)
        agree(rel, f"{where}.tokens_per_s", r.get("tokens_per_s"), T / st.median)
        agree(rel, f"{where}.tokens_per_s_mean", r.get("tokens_per_s_mean"), T / st.mean)
        agree(rel, f"{where}.last_step_over_median", r.get("last_step_over_median"),
              statistics.fmean(times[-1] for times in rounds) / st.median)
        flops = r.get("model_flops_per_step")
        if flops:
            agree(rel, f"{where}.tflop_s", r.get("tflop_s"), flops / st.median / 1e12)
            if rec.get("peak_bf16_flop_s"):
                agree(rel, f"{where}.mfu", r.get("mfu"), flops / st.median / rec["peak_bf16_flop_s"])
        stats[cfg] = st
        mfu = flops / st.median / rec["peak_bf16_flop_s"] if flops and rec.get("peak_bf16_flop_s") else None
        label = cfg + (f" (then {r['error'].split('.')[0]})" if r.get("error") else "")
        rows.append([label, *st.cells(), num(T / st.median), num(mfu), num(r.get("peak_memory_gib"))])
    return stats, rows


def train_gpu_ratios(rel: str, rec: dict[str, Any], length: str, stats: dict[str, Stats]) -> list[list[Any]]:
    """Step time of each `anchor train` configuration over the plain loop's, and anchor's over full's per
    engine, by mean and by median; the ratios the record stores are checked against the same steps."""
    block = rec["lengths"][length]
    flops = {r["config"]: r.get("model_flops_per_step") for r in block.get("rows", [])}
    stored = block.get("ratios", {})
    rows = []
    for k, st in stats.items():
        for p, pst in stats.items():
            if not (k.startswith("train/") and p.startswith("plain/")):
                continue
            agree(rel, f"lengths.{length}.ratios[{k} over {p}]", stored.get(f"{k} over {p}"), pst.median / st.median)
            agree(rel, f"lengths.{length}.ratios[{k} over {p} (means)]", stored.get(f"{k} over {p} (means)"),
                  pst.mean / st.mean)
            rows.append([f"{k} ÷ {p}", *ratio_cells(st, pst), "—"])
    for engine in ("varlen", "flex"):
        full, anchor = f"train/full/{engine}", f"train/anchor/{engine}"
        if full in stats and anchor in stats:
            flop_ratio = flops[anchor] / flops[full]
            agree(rel, f"lengths.{length}.ratios[anchor over full step time ({engine})]",
                  stored.get(f"anchor over full step time ({engine})"), stats[anchor].median / stats[full].median)
            agree(rel, f"lengths.{length}.ratios[anchor over full FLOPs ({engine})]",
                  stored.get(f"anchor over full FLOPs ({engine})"), flop_ratio)
            rows.append([f"{anchor} ÷ {full}", *ratio_cells(stats[anchor], stats[full]), num(flop_ratio)])
    return rows


def speed_page(records: Records) -> str:
    def attention(rel, rec):
        return table(["windows", "engine", "T", "timed windows", "FLOPs, anchor ÷ full", "time, anchor ÷ full: "
                      "by mean", "by median", "per-window range", "time ratio ÷ FLOP ratio (by mean)"],
                     bench_attention(rel, rec)) + [
            "", f"Each row sets anchor's windows against full's: {window_repeats(rec)} "
            "(anchor/bench/timing.py). The ratios are of the windows' means (the summed times) and of their "
            "medians; the per-window range is of each window's anchor ÷ full." + windows_note(rec)]

    def step(rel, rec):
        return table(["variant", "engine", "T", "layers", "dtype", "timed steps", "step, s: mean", "median", "min–max",
                      "FLOPs ÷ full's", "time ÷ full's: by mean", "by median"], bench_steps(rel, rec)) + [
            "", f"Each run's first {steps_word(BENCH_STEP_WARMUP)}, a warm-up, left out as anchor/bench/step.py "
            "leaves it out; the record keeps every step in `step_s_all`."]

    def train_gpu(rel, rec):
        out = []
        for length in rec.get("lengths", {}):
            stats, rows = train_gpu_rows(rel, rec, length)
            out += [f"T = {int(length):,}:", ""] + table(
                ["configuration", "timed steps", "step, s: mean", "median", "min–max", "tokens/s (T ÷ median)",
                 "MFU (by median)", "peak GiB"], rows) + [""]
            ratios = train_gpu_ratios(rel, rec, length, stats)
            if ratios:
                out += table(["step time, this ÷ that", "by mean", "by median", "FLOPs per step, this ÷ that"],
                             ratios) + [""]
        return out

    def overhead(rel, rec):
        p, a = rec["plain_step_s"], rec["anchor_step_s"]
        rounds, per_run = need(rel, rec, "rounds"), need(rel, rec, "steps_per_run")
        # benchmarks/bench_train.py keeps each run's steps after its first (the warm-up): runs x (steps - 1)
        for field, xs in (("plain_step_s", p), ("anchor_step_s", a)):
            agree(rel, f"{field} (count: rounds x steps_per_run, less a warm-up step per run)", len(xs), rounds * (per_run - 1))
        ps, as_ = Stats.of(p), Stats.of(a)
        tokens = rec.get("seq_len", 0) * rec.get("global_batch", 1)
        agree(rel, "plain_median_s", rec.get("plain_median_s"), ps.median)
        agree(rel, "anchor_median_s", rec.get("anchor_median_s"), as_.median)
        agree(rel, "plain_tokens_per_s", rec.get("plain_tokens_per_s"), tokens / ps.median)
        agree(rel, "anchor_tokens_per_s", rec.get("anchor_tokens_per_s"), tokens / as_.median)
        agree(rel, "overhead", rec.get("overhead"), as_.median / ps.median - 1)
        rows = [["plain transformers + AdamW loop", *ps.cells(), num(tokens / ps.median)],
                ["`anchor train`", *as_.cells(), num(tokens / as_.median)]]
        by_mean, by_median = ratio_cells(as_, ps)
        return table(["loop", "timed steps", "step, s: mean", "median", "min–max", "tokens/s (by median)"], rows) + [
            "", f"Model {model_label(rec.get('model'))}; T={rec.get('seq_len')}, {rec.get('engine')}, "
            f"{rec.get('dtype')}; "
            f"{rounds} rounds of {per_run} steps per loop, the first step of each run a warm-up and not in the record. "
            f"Step time, `anchor train` ÷ the plain loop: by mean {by_mean}, by median {by_median}."]

    def audit_speed(rel_list):
        rows = []
        for rel in rel_list:
            if not records.exists(rel):
                continue
            rec = records.load(rel)
            runs = rec.get("runs", [])
            cold = [r for r in runs if str(r.get("label", "")).startswith("cold")]
            warm = [r for r in runs if str(r.get("label", "")).startswith("warm")]
            if not cold:
                refuse(rel, "runs", "no run labelled cold")
            agree(rel, "wall_s", rec.get("wall_s"), cold[0]["wall_s"])
            agree(rel, "cpu_s", rec.get("cpu_s"), cold[0]["cpu_s"])
            agree(rel, "warm_wall_s", rec.get("warm_wall_s"), warm[-1]["wall_s"] if warm else None)
            agree(rel, "within_limit", rec.get("within_limit"), cold[0]["wall_s"] <= rec.get("limit_s", math.inf))
            date, commit = provenance_cells(rec)
            rows.append([machine_label(rec), num(cold[0]["wall_s"]), num(warm[-1]["wall_s"]) if warm else "—",
                         num(cold[0]["cpu_s"]), num(rec.get("limit_s")), f"`{rel}`", date, commit])
        return table(["machine", "cold, s (one run)", "warm, s (one run)", "CPU s (cold)", "limit, s", "record", "date",
                      "commit"], rows)

    def data(rel, rec):
        tok = rec.get("tokenization", {})
        rows = []
        for name, key in (("tokenization (ours)", "tok"), ("raw `tokenizers`", "raw"),
                          ("raw `tokenizers`, fast path", "raw_fast")):
            rate = tok["tokens"] / tok[f"{key}_seconds"]
            agree(rel, f"tokenization.{key}_tokens_per_s", tok.get(f"{key}_tokens_per_s"), rate)
            rows.append([name, num(rate) + " tokens/s"])
        for i, p in enumerate(rec.get("packing", [])):
            rate = p["slots"] / p["seconds"]
            agree(rel, f"packing[{i}].tokens_per_s", p.get("tokens_per_s"), rate)
            how = [k for k in ("tags", "interleave") if p.get(k)]
            rows.append([f"packing at T={p.get('seq_len')}" + (f" ({', '.join(how)})" if how else ""),
                         num(rate) + " tokens/s"])
        return table(["what", "throughput (one run)"], rows)

    def oracle(rel, rec):
        rows = []
        for i, r in enumerate(rec.get("results", [])):
            o, t = Stats.of(r["oracle_runs_s"]), Stats.of(r["transformers_runs_s"])
            agree(rel, f"results[{i}].oracle_fp32_s", r.get("oracle_fp32_s"), o.median)
            agree(rel, f"results[{i}].transformers_sdpa_fp32_s", r.get("transformers_sdpa_fp32_s"), t.median)
            agree(rel, f"results[{i}].ratio_oracle_over_transformers", r.get("ratio_oracle_over_transformers"),
                  o.median / t.median)
            for j, (x, y) in enumerate(zip(r["oracle_runs_s"], r["transformers_runs_s"])):
                agree(rel, f"results[{i}].ratio_per_round[{j}]", (r.get("ratio_per_round") or [None] * (j + 1))[j],
                      x / y)
            rows.append([num(r.get("T")), num(o.n), *o.cells()[1:], *t.cells()[1:], *ratio_cells(o, t)])
        return table(["T", "rounds", "oracle, s: mean", "median", "min–max", "transformers sdpa, s: mean", "median",
                      "min–max", "oracle ÷ transformers: by mean", "by median"], rows) + [
            "", "Each side's first call (compilation) is left out: the record keeps it apart."]

    out = ["# Speed", "", GENERATED, "",
           "Every ratio is measured in one run on one machine (`anchor bench` and the scripts in `benchmarks/`) "
           "and given by mean and by median, beside the samples' range. AnchorAttention saves time only where "
           "the engine skips what the mask hides; the FLOP ratio is what a perfect engine would reach.", ""]
    out += section(records, BENCH_CPU, "Attention on the CPU, anchor against full",
                   "Forward and backward of one layer, per window set and length.", attention)
    out += section(records, BENCH_CPU, "A whole training step on the CPU", "`anchor train` steps of the model cut "
                   "to its first layers.", step)
    out += section(records, BENCH_H100, "Attention on an H100, anchor against full",
                   "Forward and backward of one layer through the record's engine.", attention)
    out += section(records, BENCH_H100_FLEX, "Attention on an H100 through FlexAttention",
                   "The same measurement through the flex engine.", attention)
    out += section(records, BENCH_H100, "A whole training step on an H100", "`anchor train` steps of the model "
                   "cut to its first layers.", step)
    if records.exists(TRAIN_GPU):
        rec = records.load(TRAIN_GPU)
        what = (f"Model {model_label(rec.get('model'))}. {rec.get('steps')} steps per configuration and length, each "
                f"run's first {steps_word(need(TRAIN_GPU, rec, 'warmup'))} left out as warm-up (the record's "
                "`warmup`); the ratios divide step times.")
    else:
        what = ""
    out += section(records, TRAIN_GPU, "`anchor train` against a plain transformers loop on one GPU", what, train_gpu)
    out += section(records, TRAIN_OVERHEAD, "`anchor train` against a plain loop on the CPU",
                   "The trainer's overhead over the loop a user would write, same model, windows and optimizer.",
                   overhead)
    out += ["## The default `anchor audit`, cold and warm", "",
            "Wall time of the whole command on SmolLM2 with every option at its default, per machine.", ""]
    out += audit_speed(AUDIT_SPEED) + [""]
    out += section(records, DATA, "The data pipeline", "Tokenization against raw `tokenizers`, and packing.", data)
    oracle_what = ""
    if records.exists(ORACLE_FORWARD):
        o = records.load(ORACLE_FORWARD)
        oracle_what = f"The {o.get('variant')} variant, batch {o.get('batch')}, several rounds each."
    out += section(records, ORACLE_FORWARD, "The oracle's fp32 forward against transformers'",
                   oracle_what, oracle)
    return "\n".join(out)
