"""The memory page: measured peaks against the estimates and the plan that refuse a run."""

from __future__ import annotations

import math

from .records import (GENERATED, GIB, LONGEST_WINDOW, MEMORY, MEMORY_ESTIMATES, ORACLE_GRAD_MEMORY, SHARDED_BUILD,
                      STEP_MEMORY, Records, agree, need, quoted_commit, refuse, section)
from .stats import num, table


def memory_page(records: Records) -> str:
    def per_engine(rel, rec):
        rows = []
        for i, r in enumerate(rec.get("rows", [])):
            if "peak_rss_bytes" not in r:
                continue
            gib = r["peak_rss_bytes"] / GIB
            agree(rel, f"rows[{i}].peak_rss_gib", r.get("peak_rss_gib"), gib, abs_tol=6e-4)
            engine = r.get("engine") + (f" ({r['resolved_engine']})" if r.get("resolved_engine") not in
                                        (None, r.get("engine")) else "")
            rows.append([engine, num(r.get("seq_len")), num(gib), num(r.get("seconds"))])
        return table(["engine", "T", "peak RSS, GiB", "step, s (one run)"], rows)

    def estimates(rel, rec):
        rows, ratios = [], []
        for i, r in enumerate(rec.get("rows", [])):
            ratio = r["estimate_gib"] / r["peak_gib"]
            agree(rel, f"rows[{i}].ratio", r.get("ratio"), ratio, abs_tol=6e-3)
            ratios.append(ratio)
            what = f"`{r['config']}`" if r.get("config") else f"model `{r['model']}`" if r.get("model") else "—"
            rows.append([r.get("verb"), what, num(r.get("seq_len")), r.get("engine", ""),
                         num(r.get("estimate_gib")), num(r.get("peak_gib")), num(ratio)])
        if ratios:
            agree(rel, "ratio_min", rec.get("ratio_min"), min(ratios), abs_tol=6e-3)
            agree(rel, "ratio_max", rec.get("ratio_max"), max(ratios), abs_tol=6e-3)
        return table(["verb", "config (or the model)", "T", "engine", "estimate, GiB", "measured peak, GiB", "estimate ÷ peak"], rows)

    def step(rel, rec):
        rows = []
        for k, v in rec.get("check", {}).items():
            own = v["peak_rss_bytes"] - v["base_rss_bytes"]
            agree(rel, f"check.{k}.step_bytes", v.get("step_bytes"), own)
            agree(rel, f"check.{k}.peak_rss_gib", v.get("peak_rss_gib"), v["peak_rss_bytes"] / GIB, abs_tol=6e-4)
            ratio = v["step_estimate_bytes"] / own
            agree(rel, f"check.{k}.step_estimate_over_step_bytes", v.get("step_estimate_over_step_bytes"), ratio,
                  abs_tol=6e-4)
            rows.append([k, num(v.get("seq_len")), num(v["peak_rss_bytes"] / GIB), num(own / GIB), num(ratio)])
        return table(["case (lm-head)", "T", "peak RSS, GiB", "step's own, GiB", "estimate ÷ measured"], rows)

    def oracle(rel, rec):
        rows = []
        for i, r in enumerate(rec.get("rows", [])):
            b = {k: v / GIB for k, v in r["bytes"].items()}
            for k in ("temp", "argument", "output"):
                agree(rel, f"rows[{i}].{k}_gib", r.get(f"{k}_gib"), b[k], abs_tol=6e-3)
            total = b["temp"] + b["argument"] + b["output"]
            agree(rel, f"rows[{i}].total_gib", r.get("total_gib"), total, abs_tol=1.6e-2)
            rows.append([num(r.get("seq_len")), f"`{r.get('policy')}`", num(b["temp"]), num(b["argument"]),
                         num(b["output"]), num(total)])
        return table(["T", "policy", "temporaries, GiB", "arguments, GiB", "outputs, GiB", "total, GiB"], rows)

    def largest(terms):
        """The term that weighs most in a plan row's `terms_bytes` (as torchtrain.training.memory.largest_term)."""
        return max(terms.items(), key=lambda kv: kv[1])

    def longest(rel, rec):
        rows, ratios = [], []
        names = [k for k in (need(rel, rec, "rows")[0].get("predicted_terms_bytes") or {}) if k != "attention"]
        for i, r in enumerate(need(rel, rec, "rows")):
            terms = r.get("predicted_terms_bytes") or refuse(rel, f"rows[{i}].predicted_terms_bytes", "missing")
            agree(rel, f"rows[{i}].predicted_bytes", r.get("predicted_bytes"), sum(terms.values()))
            cells = [num(r["seq_len"]), r.get("windows", "—"),
                     num(r.get("rope_theta")) if r.get("rope_theta") else "the model's",
                     " + ".join(num(terms[k] / GIB) for k in names),
                     num(r["predicted_bytes"] / GIB)]
            commit = quoted_commit(r.get("commit"))
            if "peak_rss_bytes" not in r:
                rows.append(cells + [f"failed: {r.get('failed', 'not measured')}", "—", "—", "—", commit])
                continue
            ratio = r["predicted_bytes"] / r["peak_rss_bytes"]
            agree(rel, f"rows[{i}].predicted_over_measured", r.get("predicted_over_measured"), ratio, abs_tol=6e-4)
            agree(rel, f"rows[{i}].loss_finite", r.get("loss_finite"), math.isfinite(r["loss"]))
            ratios.append((r["seq_len"], ratio, math.isfinite(r["loss"])))
            rows.append(cells + [num(r["peak_rss_bytes"] / GIB), num(ratio), num(r["loss"], 4), num(r.get("seconds")),
                                 commit])
        summary = rec.get("summary") or {}
        agree(rel, "summary.lengths_measured", summary.get("lengths_measured"), len(ratios))
        agree(rel, "summary.worst_predicted_over_measured", summary.get("worst_predicted_over_measured"),
              max((abs(x - 1) for _, x, _ in ratios), default=None), abs_tol=6e-4)
        agree(rel, "summary.longest_trained", summary.get("longest_trained"),
              max((t for t, _, ok in ratios if ok), default=None))
        plan = need(rel, rec, "plan")
        out = [f"`anchor plan {' '.join(rec.get('plan_args', []))}` predicts one step's peak term by term "
               f"(`torchtrain.training.memory.step_memory`, which `anchor train` refuses a run by); each length ran as "
               f"`{rec.get('command')}` in a fresh process, its peak RSS read by `/usr/bin/time -v`.", "",
               *table(["T", "windows of", "RoPE base", f"predicted: {' + '.join(names)}, GiB",
                       "predicted, GiB", "measured peak, GiB", "predicted ÷ measured", "loss", "seconds (one run)",
                       "measured at commit"], rows), ""]
        if len({r.get("windows") for r in rec["rows"]}) > 1:
            out.append("The step's memory does not depend on the lengths of the window's documents (the varlen "
                       "engine keeps per-document offsets), its time grows with their squares: the longer windows "
                       "were packed from the corpus's shorter documents, as the windows column says.")
        if rec.get("unfinished"):
            out.append("The run was stopped before its last length: these are the lengths it measured.")
        if ratios:
            out.append(f"Every prediction within {num(100 * max(abs(x - 1) for _, x, _ in ratios), 2)}% of the "
                       f"measured peak over {len(ratios)} lengths; the longest trained with a finite loss: "
                       f"{num(max((t for t, _, ok in ratios if ok), default=None))}.")
        budget = need(rel, plan, "budget_bytes")
        longest_row = next((r for r in rec.get("plan_rows", []) if r["seq_len"] == rec.get("longest_planned")), None)
        agree(rel, "longest_planned", rec.get("longest_planned"),
              max((r["seq_len"] for r in rec.get("plan_rows", []) if r["fits"]), default=None))
        stop = next((r for r in rec.get("plan_rows", []) if not r["fits"]), None)
        if longest_row:
            given = (f"the {num(budget / GIB)} GiB it was given (`{rec['plan_memory_from']}`)"
                     if rec.get("plan_memory_from") else f"a budget of {num(budget / GIB)} GiB")
            at_start = (f"; {num(rec['mem_available_bytes_at_start'] / GIB, 4)} GiB were available when the "
                        "measurements began" if rec.get("mem_available_bytes_at_start") else "")
            agree(rel, "plan_memory_gib", rec.get("plan_memory_gib"), budget / GIB, abs_tol=6e-3)
            planned = f" (planned at commit {quoted_commit(rec['planned_by'])})" if rec.get("planned_by") else ""
            out.append(f"The plan's longest window on this machine{planned}, for {given}{at_start}: "
                       f"{num(longest_row['seq_len'])}, {num(longest_row['total_bytes'] / GIB)} GiB.")
        if stop:
            name, size = largest(stop["terms_bytes"])
            out.append(f"It refuses the next doubling, {num(stop['seq_len'])}: {num(stop['total_bytes'] / GIB)} GiB, "
                       f"{name} the largest term ({num(size / GIB)} GiB).")
        out.append("")
        alst = need(rel, rec, "alst")
        published = {int(k): v for k, v in alst["llama3.1-8b_longest_by_gpus"].items()}
        gpu_rows = []
        for g in rec.get("gpu_plans", []):
            gp = g["plan"]
            fits = [r for r in gp["rows"] if r["fits"]]
            agree(rel, f"gpu_plans[{g['model']}, {g['gpus']}].longest", gp.get("longest"),
                  fits[-1]["seq_len"] if fits else None)
            stop = next((r for r in gp["rows"] if not r["fits"]), None)
            why = "—"
            if stop:
                name, size = largest(stop["terms_bytes"])
                why = f"{num(stop['seq_len'])}: {num(stop['total_bytes'] / GIB)} GiB, {name} {num(size / GIB)} GiB"
            offloaded = [what for what, key in (("checkpoints", "offload_checkpoints"),
                                                ("optimizer states", "offload_optimizer"),
                                                ("parameters", "offload_params")) if gp.get(key)]
            recipe = (f"{gp['dtype']}, ZeRO-{gp['zero_stage']}, sequence parallel {gp['sequence_parallel']}, "
                      f"offloaded: {', '.join(offloaded) or 'nothing'}, "
                      f"tiled MLP {'on' if gp.get('tiled_mlp') else 'off'}")
            alst_cell = num(published.get(g["gpus"])) if g["model"].startswith("Llama-3.1-8B") else "—"
            host = fits[-1].get("host_total_bytes") if fits and offloaded else None
            gpu_rows.append([g["model"], num(g["gpus"]), recipe, num(gp.get("longest")) if gp.get("longest")
                             else "none fits", "—" if host is None else num(host / GIB), why, alst_cell])
        plans = rec.get("gpu_plans", [])
        sizes = sorted({g["plan"]["budget_bytes"] for g in plans})
        own_windows = sorted({g["model"] for g in plans if g["gpus"] > 1 and g["plan"]["sequence_parallel"] == 1})
        single = sorted({g["model"] for g in plans if g["gpus"] == 1})
        out += [f"The plan for {plans[0].get('device', 'GPU').upper() if plans else 'GPU'}s "
                f"({' or '.join(num(b / 1e9) for b in sizes)} GB each; nothing ran on a GPU), beside ALST's "
                f"published figures ({alst['source']}; its Hugging Face baseline: {num(alst['baseline_longest'])})."
                + (f" Where a plan on several GPUs does not split the sequence over them ({', '.join(own_windows)}: "
                   "its heads do not split), each GPU trains windows of its own." if own_windows else "")
                + (f" On one GPU ({', '.join(single)}) the plans offload what the recipe column names." if single
                   else ""), "",
                *table(["model", "GPUs", "recipe", "plan's longest window",
                        "host memory what it offloads needs, GiB (all GPUs)",
                        "the next doubling: need, largest term", "ALST, published"], gpu_rows),
                "", "The GPU plans check each GPU's memory; what all of a node's GPUs offload shares its "
                "host memory, which the plan checks where it is given (`anchor plan --host-memory GIB`), and "
                "which these plans leave unchecked: the column says what the host must hold.", ""]
        return out

    def sharded(rel, rec):
        rows = []
        for i, r in enumerate(need(rel, rec, "rows")):
            m, p, idle = r["measured"], r["planned"], r["idle"]
            if "failed" in m or "failed" in idle:
                rows.append([num(r["world"]), m.get("failed") or idle.get("failed"), "", "", "", "", "", "", ""])
                continue
            above = {}
            for key in ("build", "engine", "step"):
                above[key] = [a - b for a, b in zip(m[f"{key}_gib"], idle[f"{key}_gib"])]
                for j, v in enumerate(above[key]):
                    agree(rel, f"rows[{i}].{key}_above_idle_gib[{j}]", r[f"{key}_above_idle_gib"][j], v, abs_tol=2e-4)
            per_rank = lambda xs: " / ".join(num(x) for x in xs)  # noqa: E731
            rows.append([num(r["world"]), per_rank(above["build"]),
                         per_rank([p["build_gib"]] + [p["build_other_ranks_gib"]] * (len(above["build"]) - 1)),
                         num(r["bound_gib"]), per_rank(above["engine"]), num(p["engine_gib"]),
                         per_rank(above["step"]), num(p["step_gib"]), f"{num(m['run_gib'])} (plan {num(p['run_gib'])})"])
        model = rec.get("model", {})
        ranks = " / ".join(str(r) for r in range(max(r["world"] for r in rec["rows"])))
        return [f"{num(model.get('parameters', 0) / 1e9)}B parameters read from {len(model.get('shards', []))} "
                f"safetensors shards with their index, one optimizer step of {num(need(rel, rec, 'seq_len'))} slots "
                f"per process; each rank's peak above the same run's with the tiny model, GiB, ranks {ranks}. The "
                "model built: partitioned and filled (the first rank reads the weights); the engine: DeepSpeed's "
                "ZeRO-3 partitions beside it (bf16 flat copy while it defragments, fp32 master, gradient "
                "partition).", "",
                *table(["processes", "model built", "plan", "bound (half fp32 + largest shard)", "engine built",
                        "plan", "first step", "plan", "whole run, all processes"], rows)]

    out = ["# Memory", "", GENERATED, "",
           "Peaks are measured per process (VmHWM), one run per case; every size option is checked against an "
           "estimate before any work starts, and these tables hold the estimates against the peaks.", ""]
    what = ""
    if records.exists(LONGEST_WINDOW):
        lw = records.load(LONGEST_WINDOW)
        what = (f"Model `{lw.get('model')}`, variant {lw.get('variant')}, {lw.get('dtype')}, engine "
                f"{lw.get('engine')}, activation checkpointing and the tiled MLP, one optimizer step per length.")
    out += section(records, LONGEST_WINDOW, "The longest window this machine trains, planned and measured", what,
                   longest)
    out += section(records, SHARDED_BUILD, "A model read from shards, built partitioned under ZeRO-3",
                   "bf16, ZeRO-3, its checkpoint exported; host memory once the model and the engine are built and "
                   "at the first step, per rank, against the plan (torchtrain.training.memory.build_memory, step_memory, "
                   "run_memory).", sharded)
    out += section(records, MEMORY, "One training step per engine", "The default engine grows linearly in T; "
                   "sdpa and eager hold a dense T × T mask.", per_engine)
    out += section(records, MEMORY_ESTIMATES, "The estimates that refuse a run, against measured peaks",
                   "Each case in a fresh process.", estimates)
    out += section(records, STEP_MEMORY, "The lm-head fused with the loss", "A step with no [T, V] logits against "
                   "one through the logits.", step)
    out += section(records, ORACLE_GRAD_MEMORY, "The oracle's gradient program", "XLA's memory plan of the "
                   "differentiated program, compiled and not run.", oracle)
    return "\n".join(out)
