"""`anchor demo --profile paper-gpu` (`make paper-gpu`) dry-run on the CPU: the profile's own jobs (corpus, pack,
train, eval) at tiny sizes on `random:llama` (windows of 128 with the profile's RoPE override, 2 steps per run,
two samples per RULER task and length), and every field the page and the summary JSON (paper_gpu.json) must hold:
RULER per run x length with the spread over checkpoints and the standard error over samples, per task and
checkpoint with standard errors; the held-out loss by position bucket; step time over full's beside the FLOP
ratio; the bf16 against fp32 reset comparison. Also the profile's real settings: the paper's evaluation
schedule, the RoPE base, the sample count that bounds the standard error, and fingerprints that stay complete.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import replace

import pytest

from anchor.demo import PROFILES, fingerprints, read_record, run_demo
from anchor.demo.settings import run_names
from tests.browser.pagecheck import check_links
from tests.cli.helpers import assert_usage_error, run_cli

MODEL = "random:llama"
TINY = replace(PROFILES["paper-gpu"], model=MODEL, seq_len=128, budget=20_000, train_rope_theta=2e4, train_steps=2,
               train_warmup_steps=1, eval_every=1, eval_window=2, fp32_steps=1, eval_lengths=(768, 1024),
               eval_samples=2, eval_batch_size=4, eval_dtype="float32", perplexity_windows=2, perplexity_bucket=256,
               timing_steps=3)
RUNS = ("full", "intra_doc", "intra_doc_reset", "anchor", "intra_doc@fp32", "intra_doc_reset@fp32")


@contextlib.contextmanager
def one_thread():
    """One intra-op thread: on shared cores torch's second thread spins (a tiny model's evaluation took 12x
    as long with two threads beside other work)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def test_the_profile_settings():
    from torchtrain.config import load_train_config

    from anchor.demo.pipeline import unlisted_settings
    from anchor.demo.jobs import _train_overrides

    s = PROFILES["paper-gpu"]
    assert s.model == "default" and s.seq_len == 16384 and s.train_rope_theta == 5e5
    assert (s.train_dtype, s.zero_stage, s.train_engine) == ("bfloat16", 1, "auto")
    assert run_names(s) == RUNS and s.jobs == ("corpus", "pack", "train", "eval")
    assert s.eval_lengths == (4096, 8192, 16384) and s.eval_tasks == ("niah_single_1", "niah_multikey_1", "vt")
    # the standard error of a 0-100 score averaged over n samples is at most 50 / sqrt(n): below 5 points for a
    # length's mean of the three tasks
    assert 50 / math.sqrt(len(s.eval_tasks) * s.eval_samples) < 5 <= 50 / math.sqrt(len(s.eval_tasks) * (s.eval_samples - 1))
    assert s.eval_group_by_budget and s.eval_batch_size == 2 * s.eval_samples  # both needle tasks in one batch
    configs = {v: load_train_config(None, _train_overrides(s, "pack", v)) for v in run_names(s)}
    for v, cfg in configs.items():
        assert cfg.model.rope.given() == {"theta": 5e5} and cfg.parallel.zero_stage == 1 and cfg.data.seed == s.seed
        assert cfg.model.engine == "auto"
        assert cfg.model.dtype == ("float32" if v.endswith("@fp32") else "bfloat16")
    # the paper's schedule: every 10 steps over the last 50, five checkpoints; the fp32 runs their last
    assert [k for k in range(1, 201) if configs["anchor"].is_eval_step(k)] == [160, 170, 180, 190, 200]
    assert [k for k in range(1, 41) if configs["intra_doc@fp32"].is_eval_step(k)] == [40]
    # every setting is in a fingerprint (or changes no result); the new ones only where not at their default
    assert unlisted_settings() == []
    a, b = fingerprints(PROFILES["paper-small"]), fingerprints(replace(PROFILES["paper-small"], zero_stage=1))
    assert [k for k in a if a[k] != b[k]] == ["train", "parity", "eval"]
    c = fingerprints(replace(PROFILES["paper-gpu"], eval_samples=10))
    assert [k for k in c if c[k] != fingerprints(PROFILES["paper-gpu"])[k]] == ["eval"]


@pytest.mark.slow  # minutes of CPU: make test-all
def test_paper_gpu_dry_run(tmp_path, capsys):
    out = tmp_path / "paper-gpu"
    said: list[str] = []
    with one_thread():
        record = run_demo(MODEL, out, settings=TINY, progress=False, say=said.append)
    print(f"dry run: {record['seconds']} s")
    assert record["ran"] == ["corpus", "pack", "train", "eval"] and record["summary_json"] == "paper_gpu.json"
    assert any(x.startswith("left out: RULER vt") for x in said)  # vt needs ~1.7K byte tokens
    tasks = ["niah_single_1", "niah_multikey_1"]

    # the runs: the RoPE override, bf16 under ZeRO-1, the fp32 pair; step time against the FLOP ratio
    import yaml

    cfg = yaml.safe_load((out / "train" / "anchor" / "config.yaml").read_text())
    assert cfg["model"]["rope"] == {"theta": 2e4} and cfg["parallel"]["zero_stage"] == 1
    assert cfg["model"]["dtype"] == "bfloat16"
    train = record["jobs"]["train"]["summary"]
    assert tuple(train["runs"]) == RUNS and train["rope_theta"] == 2e4
    for v, r in train["runs"].items():
        assert r["dtype"] == ("float32" if v.endswith("@fp32") else "bfloat16") and len(r["step_s"]) == r["steps"]
        assert 0 < r["flop_ratio"]["attention"] <= 1 and 0 < r["flop_ratio"]["step"] <= 1
        if not v.endswith("@fp32"):
            assert r["step_time_vs_full"] > 0
    assert train["runs"]["full"]["flop_ratio"] == {"attention": 1.0, "step": 1.0}

    # eval.json: standard errors per row, per-sample scores, buckets that average back to the NLL
    result = json.loads((out / "eval" / "anchor" / "eval.json").read_text())
    assert result["settings"]["perplexity_docs"] == "long" and result["settings"]["device"] == "cpu"
    for r in result["rows"]:
        assert len(r["sample_scores"]) == 2 and r["se"] is not None
    for p in result["perplexity"]:
        spans = [(b["start"], b["end"]) for b in p["buckets"]]
        assert spans == [(k, min(p["length"], k + 256)) for k in range(0, p["length"], 256)]
        assert sum(b["tokens"] for b in p["buckets"]) == p["tokens"]
        assert sum(b["nll"] * b["tokens"] for b in p["buckets"]) / p["tokens"] == pytest.approx(p["nll"], rel=1e-9)
    assert {s["se"] is not None for s in result["summary"]} == {True}

    # the page: the table with standard errors, the position buckets, step time vs FLOPs, the reset, the summary
    page = (out / "index.html").read_text()
    for needle in ("<th>768</th><th>1024</th>", "(SE ", "Held-out loss by position at 1024", "<th>768–1024</th>",
                   "step time / full", "FLOP ratio: step", "bf16 against fp32", "href='paper_gpu.json'",
                   "RoPE base 2e+04", "ZeRO-1", "intra_doc_reset@fp32", "Left out on this model"):
        assert needle in page, needle
    for fig in ("train/step_time_vs_flops.png", "eval/position_loss.png", "eval/ruler.png", "summary.png"):
        assert (out / fig).is_file() and f"src='{fig}'" in page, fig
    problems = check_links(out / "index.html")
    assert not problems, "\n".join(problems)

    # the summary JSON: machine, seconds, per run and checkpoint RULER with standard errors, buckets, step times
    summary = json.loads((out / "paper_gpu.json").read_text())
    assert summary["machine"]["cpu_count"] and summary["seconds"]["jobs_total"] > 0
    assert summary["seconds"]["on_machines"] == round(sum(summary["seconds"]["jobs_all_attempts"].values()), 1) > 0
    assert set(summary["seconds"]["train_runs"]) == set(RUNS) == set(summary["seconds"]["eval_runs"])
    assert summary["rope"]["theta"] == 2e4 and summary["rope"]["paper_gpu_16k"] == 5e5
    assert summary["ruler"]["se_bound_of_task_mean"] == pytest.approx(50 / math.sqrt(2 * 2))  # two tasks (vt left out), two samples
    for v in RUNS:
        r = summary["runs"][v]
        assert r["step_s_median"] > 0 and r["step_s"] and r["flop_ratio"]["step"] > 0 and r["engine"] == "varlen"
        assert ("step_time_vs_full" in r) and list(r["checkpoints"]) == (["step-1"] if v.endswith("@fp32")
                                                                        else ["step-1", "step-2"])
        for c in r["checkpoints"].values():
            assert sorted(c["ruler"]) == sorted(tasks)
            for t in tasks:
                for L in ("768", "1024"):
                    assert set(c["ruler"][t][L]) == {"score", "se", "n"} and c["ruler"][t][L]["n"] == 2
            assert all(c["ruler_mean_of_tasks"][L]["se"] is not None for L in ("768", "1024"))
            assert [b["start"] for b in c["heldout"]["1024"]["buckets"]] == [0, 256, 512, 768]
        m = r["mean_over_checkpoints"]
        assert m["ruler_mean_of_tasks"]["1024"]["se"] is not None and len(m["buckets"]["1024"]) == 4
    reset = summary["reset_effect"]
    assert [e["dtype"] for e in reset["pairs"]] == ["bfloat16", "float32"] and reset["steps_compared"] == 1
    assert "bf16_over_fp32_loss_diff" in reset and "size" in reset
    for e in reset["pairs"]:
        assert set(e["ruler_diff"]) == {"768", "1024"} and set(e["heldout_nll_diff"]) == {"768", "1024"}
        assert e["bucket_nll_diff"]["1024"]
    # its tables for the README (paper_gpu.md beside it): every run's row with the JSON's numbers
    md = (out / "paper_gpu.md").read_text()
    for v in RUNS:
        r, m = summary["runs"][v], summary["runs"][v]["mean_over_checkpoints"]
        cells = [f"{x['mean']:.1f} ± {x['std']:.1f} (SE {x['se']:.1f})" for x in (m["ruler_mean_of_tasks"][L]
                                                                          for L in ("768", "1024"))]
        ratio = "—" if r["step_time_vs_full"] is None else f"{r['step_time_vs_full']:.2f}"
        row = (f"| {v} | {r['dtype']} | {' | '.join(cells)} | {m['heldout_nll']['1024']:.3f} | {ratio} | "
               f"{r['flop_ratio']['step']:.2f} | {r['flop_ratio']['attention']:.2f} |")
        assert row in md, (row, md)
        buckets = " | ".join(f"{c['nll']:.3f} ± {c['std']:.3f}" for c in m["buckets"]["1024"])
        assert f"| {v} | {buckets} |" in md
    for e in reset["pairs"]:
        assert f"| {e['dtype']} | {e['loss_diff']['mean_abs']:.3g} | {e['loss_diff']['max_abs']:.3g} | " in md
    assert reset["size"] + "." in md and "| run | 0–256 | 256–512 | 512–768 | 768–1024 |" in md
    assert "](results/gpu/paper_gpu_position_loss.png)" in md and (out / "eval" / "position_loss.png").is_file()

    # a second run reuses every job (the new settings keep the fingerprints stable) and rewrites the summary
    again = run_demo(MODEL, out, settings=TINY, progress=False, say=lambda _: None)
    assert again["ran"] == [] and again["reused"] == ["corpus", "pack", "train", "eval"]
    assert read_record(out)["summary_json"] == "paper_gpu.json" and (out / "paper_gpu.json").is_file()

    # in parts (a GPU host reached 15 minutes at a time): two folders, each with some of the runs (--runs), joined by
    # --merge; the same seed and windows, so each run's losses and scores are the whole demo's
    with one_thread():
        parts = [tmp_path / "part-a", tmp_path / "part-b"]
        for part, runs in zip(parts, (("full",), ("intra_doc", "intra_doc@fp32"))):
            run_demo(MODEL, part, settings=replace(TINY, only_runs=runs), progress=False, say=lambda _: None)
    merged = tmp_path / "merged"
    code, stdout, _ = run_cli(["demo", "--profile", "paper-gpu", "--merge", parts[0], "--merge", parts[1],
                               "--out", merged], capsys)
    assert code == 0 and "merged 2 parts (full, intra_doc, intra_doc@fp32)" in stdout
    whole, joined = summary, json.loads((merged / "paper_gpu.json").read_text())
    assert list(joined["runs"]) == ["full", "intra_doc", "intra_doc@fp32"]
    for v, r in joined["runs"].items():
        assert r["loss"] == whole["runs"][v]["loss"] and r["checkpoints"] == whole["runs"][v]["checkpoints"]
        assert r["device"] == whole["runs"][v]["device"]
    # step times against full's within a part only (one sitting): the part without full timed its first steps
    t = json.loads((parts[1] / "demo.json").read_text())["jobs"]["train"]["summary"]["full_timing"]
    assert t["steps"] == 3 and len(t["step_s"]) == 3 and (parts[1] / "train" / "full-timing" / "metrics.jsonl").is_file()
    r = joined["runs"]["intra_doc"]
    assert r["step_time_vs_full"] == pytest.approx(r["step_s_median"] / t["step_s_median"], rel=1e-12)
    assert r["step_time_vs_full_why"] == "against full's first 3 steps, timed in this run's part"
    assert "step_time_vs_full" not in joined["runs"]["intra_doc@fp32"] or joined["runs"]["intra_doc@fp32"]["step_time_vs_full"] is None
    assert not (parts[0] / "train" / "full-timing").exists()  # part a has full itself
    assert [p["runs"] for p in joined["parts"]] == [["full"], ["intra_doc", "intra_doc@fp32"]]
    assert joined["machine"]["cpu_count"] and joined["reset_effect"]["pairs"] == []  # no pair is complete
    part_s = [sum(st.get("seconds_all_attempts", 0) for st in json.loads((p / "demo.json").read_text())["jobs"].values())
              for p in parts]
    assert joined["seconds"]["on_machines"] == pytest.approx(sum(part_s), abs=0.15)  # every part's jobs
    md = (merged / "paper_gpu.md").read_text()
    assert f"{joined['seconds']['on_machines'] / 60:.1f} minutes there" in md
    assert " in 2 parts, " in md and "| intra_doc@fp32 | float32 |" in md and "The reset" not in md
    assert (merged / "eval" / "position_loss.png").is_file()
    page = (merged / "index.html").read_text()
    assert "runs in no part: intra_doc_reset, anchor, intra_doc_reset@fp32" in page and "Part " in page
    assert not check_links(merged / "index.html")
    # parts that are not one experiment: one line, exit 2, no folder
    for args, why in (([parts[0], parts[0]], "this part is given twice; give each part once"),
                      ([parts[0]], "give at least two demo parts"),
                      ([parts[0], out], "run 'full' is in this part and in"),
                      ([parts[0], tmp_path], "no demo.json here")):
        code, _, err = run_cli(["demo", "--profile", "paper-gpu", *[x for p in args for x in ("--merge", p)],
                                "--out", tmp_path / "bad"], capsys)
        assert_usage_error(code, err, "demo", why)
        assert not (tmp_path / "bad").exists()
    rec = json.loads((parts[1] / "demo.json").read_text())
    rec["settings"]["seed"] = 1
    (parts[1] / "demo.json").write_text(json.dumps(rec))
    code, _, err = run_cli(["demo", "--profile", "paper-gpu", "--merge", parts[0], "--merge", parts[1],
                            "--out", tmp_path / "bad"], capsys)
    assert_usage_error(code, err, "demo", "setting seed is 1 here and 0 in")
    code, _, err = run_cli(["demo", "--profile", "paper-gpu", "--merge", parts[0], "--runs", "full",
                            "--out", tmp_path / "bad"], capsys)
    assert_usage_error(code, err, "demo", "--merge joins finished parts: it takes no --runs or --jobs")
    code, _, err = run_cli(["demo", "--profile", "paper-gpu", "--runs", "full,sliding", "--out", tmp_path / "bad"],
                           capsys)
    assert_usage_error(code, err, "demo", "--runs: unknown run 'sliding' (this profile's runs: full, intra_doc")


def test_checkpoints_that_do_not_fit_the_disk_are_refused_before_any_work(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    from anchor_core.errors import InputError
    from anchor.demo import pipeline
    from tests.cli.helpers import assert_usage_error, run_cli

    # the real profile: 20 bf16 checkpoints (ZeRO-1: 18 bytes a parameter) and 2 fp32 ones (20) of SmolLM2-135M
    assert pipeline.checkpoint_bytes(replace(PROFILES["paper-gpu"], model="random:llama")) > 0
    assert pipeline.bytes_per_param("bfloat16", 1) == 16 and pipeline.bytes_per_param("float32", 0) == 16
    # a part: its runs' checkpoints, and a part without full the one of full's timing run
    one = {run: pipeline.checkpoint_bytes(replace(PROFILES["paper-gpu"], model="random:llama", only_runs=(run,)))
           for run in ("full", "anchor", "intra_doc@fp32")}
    assert one["anchor"] == one["full"] * 6 // 5  # five evaluation checkpoints, and the timing run's last
    assert one["intra_doc@fp32"] < one["full"]  # fp32 runs alone: one checkpoint, no timing run
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(InputError, match=r"checkpoints need about .* GB \(6 runs.* GB are free here"):
        run_demo(MODEL, tmp_path / "d", settings=TINY, progress=False, say=lambda _: None)
    assert not (tmp_path / "d").exists()
    monkeypatch.undo()
    code, _, err = run_cli(["demo", "--model", MODEL, "--profile", "paper-gpu", "--heldout", str(tmp_path / "nope.jsonl"),
                            "--out", tmp_path / "d", "--no-progress"], capsys)
    assert_usage_error(code, err, "demo", "no such held-out file")
    assert not (tmp_path / "d").exists()


def test_the_profile_fits_one_h100():
    """The memory estimates the trainer and the evaluation check before any work (torchtrain.training.memory) leave room
    on an H100's 79 GiB: a training step at 16K (bf16 and fp32 under ZeRO-1) and the evaluation's batch of 68
    prompts of 16K with their KV cache; the checkpoints fit its 64 GiB disk (about 54 GB)."""
    import torch

    from anchor_core.errors import InputError
    from anchor_core.weights import load_spec
    from anchor.demo.pipeline import checkpoint_bytes
    from torchtrain.training.memory import forward_memory, step_memory

    s = PROFILES["paper-gpu"]
    try:
        spec = load_spec(s.model).replace(max_position=s.seq_len).with_rope(base=s.train_rope_theta)
    except InputError as e:
        pytest.skip(f"the embedded SmolLM2 is not installed here: {e}")
    h100 = 78 * 2**30
    ev = forward_memory(spec, seq_len=max(s.eval_lengths), batch=s.eval_batch_size, engine=s.eval_engine,
                        dtype=torch.bfloat16)
    steps = [step_memory(spec, seq_len=s.seq_len, micro_batch=1, dtype=dt, engine="varlen", zero_stage=s.zero_stage,
                         procs=1) for dt in (torch.bfloat16, torch.float32)]
    print(ev.describe(), [m.describe() for m in steps], f"checkpoints {checkpoint_bytes(s) / 1e9:.1f} GB")
    assert ev.total < 0.92 * h100 and all(m.total < 0.5 * h100 for m in steps)
    assert checkpoint_bytes(s) < 56e9


def test_the_short_profile_is_paper_gpu_in_one_sitting():
    """paper-gpu-short: paper-gpu's windows (the same corpus, pack and seed: the pack job's fingerprint is equal),
    its four bf16 runs for 100 steps evaluated at their last checkpoint alone, the same RULER samples; no fp32
    runs and no timing run; its own summary JSON."""
    from torchtrain.config import load_train_config

    from anchor.demo.jobs import _train_overrides

    short, full = PROFILES["paper-gpu-short"], PROFILES["paper-gpu"]
    assert fingerprints(short)["pack"] == fingerprints(full)["pack"]
    assert fingerprints(short)["corpus"] == fingerprints(full)["corpus"]
    assert run_names(short) == RUNS[:4] and short.train_steps == 100 and short.timing_steps == 0
    assert (short.eval_tasks, short.eval_lengths, short.eval_samples) == (full.eval_tasks, full.eval_lengths,
                                                                          full.eval_samples)
    cfg = load_train_config(None, _train_overrides(short, "pack", "anchor"))
    assert [k for k in range(1, 101) if cfg.is_eval_step(k)] == [100]
    assert cfg.model.dtype == "bfloat16" and cfg.model.rope.given() == {"theta": 5e5}
    assert short.summary_json == "paper_gpu_short.json" != full.summary_json


@pytest.mark.slow
def test_the_short_profile_dry_run(tmp_path, capsys):
    """The short profile end to end on the CPU at tiny sizes: the four runs, their last checkpoint evaluated with
    standard errors and position buckets, the summary JSON and its tables without the fp32 comparison."""
    tiny = replace(PROFILES["paper-gpu-short"], model=MODEL, seq_len=128, budget=20_000, train_rope_theta=2e4,
                   train_steps=2, train_warmup_steps=1, eval_every=1, eval_lengths=(768, 1024), eval_samples=2,
                   eval_batch_size=4, eval_dtype="float32", perplexity_windows=2, perplexity_bucket=256)
    out = tmp_path / "short"
    with one_thread():
        record = run_demo(MODEL, out, settings=tiny, progress=False, say=lambda _: None)
    assert record["ran"] == ["corpus", "pack", "train", "eval"] and record["summary_json"] == "paper_gpu_short.json"
    summary = json.loads((out / "paper_gpu_short.json").read_text())
    assert list(summary["runs"]) == list(RUNS[:4])
    for r in summary["runs"].values():
        assert r["dtype"] == "bfloat16" and list(r["checkpoints"]) == ["step-2"]
        m = r["mean_over_checkpoints"]
        assert m["ruler_mean_of_tasks"]["1024"]["se"] is not None and len(m["buckets"]["1024"]) == 4
    # the reset in bf16 alone: the fp32 pair is left for later
    assert [e["dtype"] for e in summary["reset_effect"]["pairs"]] == ["bfloat16"]
    md = (out / "paper_gpu_short.md").read_text()
    assert "](results/gpu/paper_gpu_short_position_loss.png)" in md and "| anchor | bfloat16 |" in md
    assert not check_links(out / "index.html")
