"""`anchor bench`: the FLOP model against the contract mask, the synthetic layouts,
the estimator's arithmetic and calibration, and the CLI's output and errors. Timings are not
asserted (benchmarks/ and results/ record them); the shapes of bench.json are."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from anchor.bench import estimate as est
from anchor_core.flops import attention_flops, full_pairs, pairs, step_flops
from anchor.bench.windows import SYNTHETIC, doc_lengths, synthetic_seg
from anchor_core.data.batch import make_batch
from anchor_core.spec import random_preset
from tests.torchtrain.conftest import packed_batch
from torchtrain.attention.variants import VARIANTS, dense_mask
from tests.bench.helpers import run_bench as _run


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [97, 1025])
def test_pairs_count_the_contract_mask(variant, T):
    batch = packed_batch(variant, T, layouts=("cut", "padded", "interleaved"), seed=T)
    got = pairs(batch.doc_ids.numpy(), variant)
    want = dense_mask(batch.doc_ids, variant).sum(dim=(1, 2)).numpy()
    print(variant, T, got.tolist(), want.tolist())
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dist", SYNTHETIC)
def test_synthetic_windows(dist):
    seg = synthetic_seg(dist, 1025, 3, seed=1)
    assert seg.shape == (3, 1025) and (seg[:, 0] == 0).all() and (seg[:, 1:] >= 1).all()
    for row in seg:  # documents numbered 1, 2, ... by first appearance, each contiguous
        firsts = [int(d) for d in dict.fromkeys(row[1:].tolist())]
        assert firsts == list(range(1, len(firsts) + 1))
        assert (np.diff(row[1:]) >= 0).all()
    assert np.array_equal(seg, synthetic_seg(dist, 1025, 3, seed=1))
    assert not np.array_equal(seg, synthetic_seg(dist, 1025, 3, seed=2))
    # windows continue the document cut at the end of the previous one: lengths add up to the slots
    assert sum(map(sum, doc_lengths(seg))) == 3 * 1024


def test_anchor_costs_less_than_full_on_many_documents():
    seg = synthetic_seg("slimpajama", 8192, 2)
    doc = {v: make_batch(seg, seg, np.zeros_like(seg), v).doc_ids for v in VARIANTS}
    p = {v: pairs(doc[v], v) for v in VARIANTS}
    print({v: x.tolist() for v, x in p.items()})
    assert (p["full"] == full_pairs(8192)).all()
    assert (p["intra_doc"] == p["intra_doc_reset"]).all()
    # the anchor adds one key per document slot (and the anchor's own row) to intra_doc
    n_doc_slots = (doc["anchor"] > 0).sum(axis=1)
    assert np.array_equal(p["anchor"], p["intra_doc"] - 1 + n_doc_slots + 1) or (p["anchor"] > p["intra_doc"]).all()
    assert (p["anchor"] < 0.5 * p["full"]).all()


def test_step_flops():
    spec = random_preset("llama")
    f = step_flops(spec, full_pairs(97), 97)
    H, I, L, V = spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.vocab_size
    per_layer = 4 * H * H + 3 * H * I  # q, k, v, o (N = K = 6 heads of 14 = 84) and the MLP
    assert f["dense"] == 6 * 97 * (L * per_layer + V * H)
    assert f["attention"] == pytest.approx(L * 3.5 * 4 * full_pairs(97) * 6 * 14)
    assert float(attention_flops(10, 2, 3, backward=False)) == 240.0


def test_estimate_arithmetic():
    full = est.estimate(est.SHAPES["llama2-7b"], 65536, 8, full_pairs(65536), est.GPUS["a100-80gb"])
    half = est.estimate(est.SHAPES["llama2-7b"], 65536, 8, full_pairs(65536) / 2, est.GPUS["a100-80gb"])
    assert half["attention_flops"] == pytest.approx(full["attention_flops"] / 2)
    assert half["days_per_1b_tokens"] < full["days_per_1b_tokens"]
    # days per 1B tokens = 1e9 tokens / (T tokens per step time) in days
    assert full["days_per_1b_tokens"] == pytest.approx(1e9 * full["step_s"] / 65536 / 86400)
    one = est.estimate(est.SHAPES["llama2-7b"], 65536, 1, full_pairs(65536), est.GPUS["a100-80gb"])
    assert one["comms_s"] == 0.0 and full["comms_s"] > 0.0


def test_calibration_recovers_rates():
    rates = {"dense": 7e10, "attention": 3e10}
    rows = [{"dense_flops": d, "attention_flops": a, "step_s": d / rates["dense"] + a / rates["attention"]}
            for d, a in ((2e12, 1e12), (2e12, 2.5e11))]
    cal = est.calibrate(rows)
    print(cal)
    assert cal["how"].startswith("least squares")
    assert cal["rates_flops_per_s"]["dense"] == pytest.approx(rates["dense"], rel=1e-9)
    assert cal["rates_flops_per_s"]["attention"] == pytest.approx(rates["attention"], rel=1e-9)
    same = est.calibrate([{"dense_flops": 1e12, "attention_flops": 1e11, "step_s": 11.0}] * 2)
    assert same["how"].startswith("one rate") and same["rates_flops_per_s"]["dense"] == pytest.approx(1e11)


def test_cli_attention(tmp_path, capsys):
    out = tmp_path / "bench"
    r = _run(["--out", str(out), "--seq-len", "97,201", "--variants", "anchor", "--engines", "varlen,sdpa",
              "--distributions", "slimpajama", "--windows", "2", "--repeats", "1", "--no-step", "--no-progress",
              "--estimate-seq-len", "4096"], capsys)
    print(r.output)
    assert r.exit_code == 0
    result = json.loads((out / "bench.json").read_text())
    assert {"machine", "attention", "step", "estimate"} <= set(result)
    rows = result["attention"]
    assert {(r["engine"], r["variant"], r["seq_len"]) for r in rows} == {
        (e, v, T) for e in ("varlen", "sdpa") for v in ("full", "anchor") for T in (97, 201)}
    for row in rows:
        assert row["pass"] == "fwd+bwd" and row["ms"] > 0 and len(row["ms_windows"]) == 2
        ref = next(x for x in rows if x["variant"] == "full" and x["engine"] == row["engine"]
                   and x["seq_len"] == row["seq_len"])
        assert row["flop_ratio"] == pytest.approx(row["pairs"] / ref["pairs"], abs=1e-4)
        assert row["time_ratio"] == pytest.approx(row["ms"] / ref["ms"], abs=1e-4)
    est_rows = result["estimate"]
    assert {e["variant"] for e in est_rows} == {"full", "anchor"} and all(e["seq_len"] == 4096 for e in est_rows)
    assert (out / "time_vs_length.png").stat().st_size > 0 and (out / "time_ratio_vs_flop_ratio.png").is_file()
    assert "| varlen | slimpajama | 97 | anchor |" in (out / "report.md").read_text()


def test_cli_step(tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    data.write_text("".join(json.dumps({"text": " ".join(f"w{int(x)}" for x in rng.integers(0, 50, n))}) + "\n"
                            for n in rng.integers(5, 60, 40)))
    out = tmp_path / "bench"
    r = _run(["--out", str(out), "--model", "random:smollm2", "--data", str(data), "--seq-len", "129",
              "--variants", "anchor", "--distributions", "corpus", "--windows", "1", "--repeats", "1",
              "--step-layers", "2", "--step-steps", "2", "--no-progress", "--estimate-seq-len", "4096"], capsys)
    print(r.output)
    assert r.exit_code == 0
    result = json.loads((out / "bench.json").read_text())
    steps = result["step"]
    assert [s["variant"] for s in steps] == ["full", "anchor"]
    for s in steps:
        assert s["seq_len"] == 129 and s["layers"] == 2 and len(s["step_s_all"]) == 2 and s["step_s"] > 0
        assert s["dense_flops"] > 0 and 0 < s["flop_ratio"] <= 1
    assert result["calibration"]["fit"]


@pytest.mark.parametrize("args, needle", [
    (["--variants", "fulll"], "--variants: unknown value 'fulll'"),
    (["--variants", ","], "--variants: empty selection"),
    (["--seq-len", "8k,abc"], "--seq-len: expected comma-separated integers"),
    (["--engines", "nope"], "--engines: unknown value 'nope'"),
    (["--distributions", "books"], "--distributions: unknown value 'books'"),
    (["--windows", "0"], "--windows must be >= 1"),
    (["--estimate-model", "gpt5"], "--estimate-model: unknown model 'gpt5'"),
    (["--data", "/nonexistent/corpus.jsonl"], "/nonexistent/corpus.jsonl"),
    (["--step-seq-len", "0"], "--step-seq-len"),  # 0 is refused, not taken as the default
    (["--step-seq-len", "-5"], "--step-seq-len"),
])
def test_cli_bad_input(tmp_path, capsys, args, needle):
    out = tmp_path / "bench"
    r = _run(["--out", str(out), "--no-progress", *args], capsys)
    print(r.output)
    assert r.exit_code == 2
    assert needle in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_peak_memory_sees_an_allocation():
    """The peak is measured against the resident size at the block's start (comparing with a later empty
    block instead failed after other tests in the process: the resident size moved in between)."""
    import os

    from anchor.bench.timing import peak_memory

    def rss_gib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30

    start = rss_gib()
    with peak_memory("cpu") as mem:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        x += 1
    del x
    print(mem, "resident at the start", start)
    if mem["peak_rss_gib"] is None:
        pytest.skip("this kernel cannot reset the resident high-water mark")
    assert mem["peak_rss_gib"] - start >= 0.05
