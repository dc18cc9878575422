"""benchmarks/bench_train_gpu.py dry-run on the CPU: the plain loop's batches are
DataCollatorWithFlattening's over each window's documents at the window's shape, and a tiny run writes
the rows, the ratios within the run and the reasons for what a CPU leaves out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_train_gpu import documents, measure_all  # noqa: E402


def test_plain_batches_mask_within_documents_at_the_window_shape():
    from transformers import DataCollatorWithFlattening

    tokens = np.arange(100, 117)
    doc_ids = np.array([0] + [1] * 6 + [2] * 3 + [3] * 4 + [-1] * 3)  # an anchor-like slot 0, three documents, padding
    batch = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)(documents(tokens, doc_ids))
    assert batch["input_ids"].tolist() == [tokens.tolist()]  # every slot, in order: one shape for every window
    starts = [0, 1, 7, 10, 14]  # each document's first slot, and the padding's
    assert batch["position_ids"].tolist() == [[i - max(s for s in starts if s <= i) for i in range(17)]]
    labels = batch["labels"][0].tolist()
    assert [i for i, x in enumerate(labels) if x == -100] == starts + [15, 16]  # no target across a boundary or in padding
    assert all(labels[i] == tokens[i] for i in range(17) if labels[i] != -100)


# flex_attention compiles on the CPU (40 s of `make test` on 2 cores): it runs in `make test-all`;
# parity_tests/test_hf_stack.py holds its packed position_ids in `make test`.
@pytest.mark.parametrize("implementation", ["sdpa", pytest.param("flex_attention", marks=pytest.mark.slow)])
def test_the_plain_loop_computes_the_intra_document_loss(implementation):
    """What the plain loop trains is the intra-document mask: stock transformers on the collated window
    gives the loss of each document run alone (fp32, random:llama, T = 515 with padding)."""
    import torch
    from transformers import DataCollatorWithFlattening

    from anchor_core.weights import load_weights
    from parity_tests.hf_stack import stock_model

    spec, state = load_weights("random:llama")
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, spec.vocab_size, 515)
    doc_ids = np.concatenate([[0], np.repeat([1, 2, 3], [200, 150, 100]), -np.ones(64, int)])
    features = documents(tokens, doc_ids)
    batch = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)(features)
    eager = stock_model(spec, state, "float32")
    total, count = 0.0, 0
    with torch.no_grad():
        packed = float(stock_model(spec, state, "float32", attn_implementation=implementation)(**batch).loss)
        for f in features:
            labels = torch.tensor([f["labels"]])
            n = int((labels[0, 1:] != -100).sum())
            if n:
                total += float(eager(input_ids=torch.tensor([f["input_ids"]]), labels=labels).loss) * n
                count += n
    assert abs(packed - total / count) <= 1e-5 * abs(packed)


@pytest.mark.slow  # minutes of CPU: make test-all
def test_dry_run_writes_rows_and_ratios(tmp_path):
    """Two rounds at T = 97: each configuration twice, in turn; flex rows left out with the reason on a CPU;
    with --phases, each anchor train step's parts, which the trainer's own step time contains."""
    out = tmp_path / "train_gpu.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train_gpu.py"), "--model", "random:llama",
                        "--seq-len", "97", "--steps", "2", "--warmup", "1", "--rounds", "2", "--plain", "sdpa,flex_attention",
                        "--runs", "intra_doc/varlen,anchor/flex", "--phases", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = {r["config"]: r for r in result["lengths"]["97"]["rows"]}
    assert set(rows) == {"plain/sdpa", "plain/flex_attention", "train/intra_doc/varlen", "train/anchor/flex"}
    assert rows["plain/flex_attention"]["skipped"] == rows["train/anchor/flex"]["skipped"] == "FlexAttention has no CPU backward"
    for name in ("plain/sdpa", "train/intra_doc/varlen"):
        r = rows[name]
        assert [len(t) for t in r["step_s"]] == [2, 2]  # two rounds of two steps
        assert r["median_step_s"] == (r["step_s"][0][1] + r["step_s"][1][1]) / 2  # each round's warm-up left out
        assert r["tokens_per_s"] == 97 / r["median_step_s"] and r["mfu"] is None  # no GPU peak on a CPU
        assert r["model_flops_per_step"] > 0
        assert r["mean_step_s"] == pytest.approx(r["median_step_s"], rel=1e-12)  # two kept steps: mean = median
        assert r["last_step_over_median"] == pytest.approx(
            (r["step_s"][0][1] + r["step_s"][1][1]) / 2 / r["median_step_s"], rel=1e-12)
    train = rows["train/intra_doc/varlen"]
    assert [len(p) for p in train["phases"]] == [2, 2] and "phases" not in rows["plain/sdpa"]
    for times, phases in zip(train["step_s"], train["phases"]):
        for t, p in zip(times, phases):
            assert set(p) == {"loader", "forward", "backward", "optimizer", "train_step"}
            assert all(v > 0 for v in p.values())
            assert p["forward"] + p["backward"] + p["optimizer"] <= p["train_step"] < t  # parts of the step, then the loader's
            assert p["train_step"] + p["loader"] <= t * 1.01  # the trainer's step time holds both (its clock is read outside)
    ratios = result["lengths"]["97"]["ratios"]
    train, plain = rows["train/intra_doc/varlen"], rows["plain/sdpa"]
    assert ratios["train/intra_doc/varlen over plain/sdpa"] == train["tokens_per_s"] / plain["tokens_per_s"]
    assert ratios["train/intra_doc/varlen over plain/sdpa (means)"] == train["tokens_per_s_mean"] / plain["tokens_per_s_mean"]
    assert result["machine"] and result["peak_bf16_flop_s"] is None and result["lengths"]["97"]["complete"]


# make test-all only (the CI budget on 2 cores): 33 s; the dry run of every row stays in make test
@pytest.mark.slow
def test_each_configurations_run_is_reported_as_it_ends():
    """The rows so far go to `report` after every configuration's run, a failure included, so a benchmark
    stopped at a device call's limit keeps what it measured (main rewrites the JSON from them)."""
    def fails(r):
        raise RuntimeError("CUDA out of memory")

    configs = [("plain/sdpa", lambda r: [0.5, 0.4, 0.4], [1e12] * 3), ("train/full/varlen", fails, [1e12] * 3),
               ("train/anchor/varlen", lambda r: [0.3, 0.2, 0.25 + r], [1e12] * 3)]
    reports = []
    rows = measure_all(configs, 2, None, 1, 97, report=lambda rows: reports.append([r["config"] for r in rows]))
    assert reports == [["plain/sdpa"], ["plain/sdpa", "train/full/varlen"],
                       ["plain/sdpa", "train/full/varlen", "train/anchor/varlen"]] + \
                      [["plain/sdpa", "train/full/varlen", "train/anchor/varlen"]] * 2  # round 2: the failed one left out
    by = {r["config"]: r for r in rows}
    assert by["train/full/varlen"]["error"] == "RuntimeError: CUDA out of memory"
    assert by["train/anchor/varlen"]["step_s"] == [[0.3, 0.2, 0.25], [0.3, 0.2, 1.25]]
