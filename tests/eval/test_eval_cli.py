"""`anchor eval` end to end: checkpoints written by `anchor train`, averaged; eval.json, samples.jsonl,
report.md and the PNG as docs/DESIGN.md §9 says; bad input is one line and exit 2 with nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from anchor.cli import main
from tests import forked
from tests.train.conftest import ENV, train_args

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The tiny config: 8 steps, evaluation checkpoints every 2 over the last 4 (steps 6 and 8); keep_last=3
    keeps the regular checkpoint of step 4 too, for --checkpoints to name one off the schedule."""
    run = tmp_path_factory.mktemp("run") / "tiny"
    p = forked.run(train_args(run, "checkpoint.keep_last=3"), ENV, cwd=ROOT)  # its own process, forked with the trainer imported
    assert p.returncode == 0, p.stderr[-2000:]
    return run


def test_eval_of_a_training_run_averages_its_schedule_checkpoints(tiny_run, tmp_path, capsys):
    out = tmp_path / "eval"
    rc = _run(["eval", "--run", str(tiny_run), "--out", str(out), "--tasks", "niah_single_1,vt", "--lengths", "2048,2500",
               "--samples", "2", "--dtype", "float32", "--perplexity-windows", "1", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0
    result = json.loads((out / "eval.json").read_text())
    assert [c["label"] for c in result["checkpoints"]] == ["step-6", "step-8"]  # not step-4: outside the window
    assert len(result["rows"]) == 2 * 2 * 2
    for r in result["rows"]:
        assert set(r) >= {"checkpoint", "task", "length", "score", "samples"} and 0 <= r["score"] <= 100
    for s in result["summary"]:
        assert set(s) >= {"task", "length", "mean", "std", "checkpoints"} and s["checkpoints"] == ["step-6", "step-8"]
    assert {(p["checkpoint"], p["length"]) for p in result["perplexity"]} == {(c, L) for c in ("step-6", "step-8")
                                                                              for L in (2048, 2500)}
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 2 * 2 * 2
    for s in samples:
        assert set(s) >= {"task", "length", "input", "answers", "prediction", "prompt_tokens"}
    # the same prompts for every checkpoint
    by = {(s["task"], s["length"], s["index"]): s["input"] for s in samples if s["checkpoint"] == "step-6"}
    assert all(by[(s["task"], s["length"], s["index"])] == s["input"] for s in samples)
    report = (out / "report.md").read_text()
    assert "| step-6 |" in report and "| step-8 |" in report and "mean ± std" in report
    assert (out / "score_vs_length.png").stat().st_size > 5_000


def test_eval_checkpoints_option_picks_named_ones(tiny_run, tmp_path):
    import torch

    out = tmp_path / "eval"
    rc = _run(["eval", "--run", str(tiny_run), "--checkpoints", "step-4,8", "--out", str(out), "--tasks", "niah_single_1",
               "--lengths", "2048", "--samples", "1", "--perplexity-windows", "0", "--no-progress"])
    assert rc == 0
    result = json.loads((out / "eval.json").read_text())
    assert [c["label"] for c in result["checkpoints"]] == ["step-4", "step-8"]
    # --dtype auto (the default): bf16 on a CUDA machine, on a CPU the faster of bf16 and fp32 as measured
    # on this one; eval.json says which and why
    choice = result["dtype_choice"]
    print(choice)
    assert result["settings"]["dtype"] == choice["dtype"]
    if not torch.cuda.is_available():
        rates = choice["gflops"]
        assert choice["dtype"] == ("bfloat16" if rates["bfloat16"] > rates["float32"] else "float32")
        assert f"{rates['bfloat16']:g} GFLOP/s" in choice["reason"]


def test_auto_dtype_follows_the_machine(monkeypatch, tmp_path):
    import torch

    from anchor.eval import dtype as eval_dtype
    from anchor.eval.runner import resolve_dtype

    monkeypatch.setenv("ANCHOR_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_dtype("auto") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # a CPU without bf16 units (AVX2: bf16 3-6x slower) and one with them (avx512_bf16: 4x faster)
    for rates, want in (({"float32": 224.0, "bfloat16": 50.0}, "float32"),
                        ({"float32": 224.0, "bfloat16": 975.0}, "bfloat16")):
        for f in (tmp_path / "machine").glob("*.json"):
            f.unlink()
        calls = []
        monkeypatch.setattr(eval_dtype, "matmul_rates", lambda rates=rates: calls.append(1) or dict(rates))
        choice = eval_dtype.dtype_choice("auto")
        print(choice)
        assert choice["dtype"] == want and "GFLOP/s" in choice["reason"]
        assert resolve_dtype("auto") == want and calls == [1]  # measured once, then read from the cache
    assert resolve_dtype("bfloat16") == "bfloat16" and resolve_dtype("float32") == "float32"
    monkeypatch.undo()  # the real measurement runs and gives both rates
    rates = eval_dtype.matmul_rates(n=256, repeats=2)
    assert set(rates) == {"float32", "bfloat16"} and min(rates.values()) > 0


def _bad_inputs(tiny_run: Path, tmp: Path) -> list[tuple[list[str], str]]:
    empty = tmp / "step-9"
    empty.mkdir()
    no_weights = tmp / "hfcopy"
    shutil.copytree(tiny_run / "checkpoints" / "step-8" / "hf", no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    not_a_run = tmp / "not-a-run"
    not_a_run.mkdir()
    long_positions = tmp / "long-positions"  # the tiny model with 4M positions: a length the memory refuses
    shutil.copytree(tiny_run / "checkpoints" / "step-8" / "hf", long_positions)
    cfg = json.loads((long_positions / "config.json").read_text())
    (long_positions / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4_000_000}))
    base = ["--lengths", "2048", "--samples", "1", "--no-progress"]
    return [
        (["--model", str(empty), *base], "no hf/"),
        (["--model", str(no_weights), *base], "safetensors"),
        (["--run", str(tiny_run), "--lengths", "9000", "--samples", "1"], "longer than the model's 4096 positions"),
        (["--model", "random:llama", "--tasks", "qa_1", *base], "--squad"),
        (["--model", "random:llama", "--tasks", "niah_single_9", *base], "niah_single_9"),
        (["--run", str(tiny_run), "--checkpoints", "step-5", *base], "no checkpoint 'step-5'"),
        (["--run", str(not_a_run), *base], "not a training run"),
        (["--run", str(tiny_run), "--model", "default", *base], "exactly one of --run"),
        (["--run", str(tiny_run), "--dtype", "float16", *base], "--dtype: unsupported dtype 'float16'"),
        (["--model", str(long_positions), "--lengths", "3000000", "--samples", "1", "--engine", "sdpa"],
         "--lengths 3000000 needs about"),  # 180 TB of dense masks, refused before allocating them
        (["--model", str(long_positions), "--lengths", "3000000", "--samples", "1", "--engine", "varlen"],
         "shorter --lengths or a smaller --batch-size"),  # ~100 GB of KV cache and activations
    ]


def test_eval_bad_input_is_one_line_and_writes_nothing(tiny_run, tmp_path, capsys):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for argv, message in _bad_inputs(tiny_run, inputs):
        out = tmp_path / "out"
        rc = _run(["eval", "--out", str(out), *argv])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert not out.exists()


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_finds_the_needle(tmp_path):
    """A real reader: SmolLM2-135M-Instruct finds a single needle at 1K (2 samples, fp32, ~1 min)."""
    out = tmp_path / "eval"
    rc = _run(["eval", "--model", "default", "--out", str(out), "--tasks", "niah_single_1", "--lengths", "1024",
               "--samples", "2", "--dtype", "float32", "--perplexity-windows", "1", "--no-progress"])
    assert rc == 0
    result = json.loads((out / "eval.json").read_text())
    assert result["rows"][0]["score"] == 100.0
    assert 1 < result["perplexity"][0]["ppl"] < 100


def test_a_killed_eval_resumes_at_the_checkpoint_it_was_on(tiny_run, tmp_path, monkeypatch):
    """Each finished checkpoint is kept beside --out (`.<name>.parts`); a rerun with the same settings loads
    only the checkpoints not finished and gives what an uninterrupted run gives; other settings reuse nothing;
    the parts go when the evaluation is published."""
    from anchor.eval import generate
    from anchor.eval.runner import parts_dir

    real, loads = generate.load_eval_model, []

    def loader(die_at: int | None):
        def load(source, **kw):
            loads.append(Path(source).parent.name)
            if len(loads) == die_at:
                raise KeyboardInterrupt  # as Ctrl-C while the second checkpoint loads
            return real(source, **kw)
        return load

    out = tmp_path / "eval"
    argv = lambda n, o=out: ["eval", "--run", str(tiny_run), "--out", str(o), "--tasks", "niah_single_1,vt",  # noqa: E731
                             "--lengths", "2048", "--samples", str(n), "--dtype", "float32",
                             "--perplexity-windows", "1", "--no-progress"]
    monkeypatch.setattr(generate, "load_eval_model", loader(2))
    assert _run(argv(1)) == 130
    assert not out.exists() and (parts_dir(out) / "part-0.json").is_file()
    assert not (parts_dir(out) / "part-1.json").exists()
    loads.clear()
    assert _run(argv(2)) == 130  # other settings: the part of step-6 is not reused
    assert loads == ["step-6", "step-8"]
    loads.clear()
    monkeypatch.setattr(generate, "load_eval_model", loader(None))
    assert _run(argv(2)) == 0
    assert loads == ["step-8"]  # step-6 finished before the interruption
    assert not parts_dir(out).exists()
    loads.clear()
    whole = tmp_path / "whole"
    assert _run(argv(2, whole)) == 0
    assert loads == ["step-6", "step-8"]
    a, b = (json.loads((d / "eval.json").read_text()) for d in (out, whole))
    for k in ("rows", "summary", "perplexity", "settings", "checkpoints"):
        assert a[k] == b[k], k
    assert (out / "samples.jsonl").read_text() == (whole / "samples.jsonl").read_text()
    # a parts folder holding someone else's files: one line, exit 2, their files kept
    other = tmp_path / "other"
    parts_dir(other).mkdir()
    (parts_dir(other) / "mine.txt").write_text("mine")
    assert _run(argv(2, other)) == 2
    assert (parts_dir(other) / "mine.txt").read_text() == "mine" and not other.exists()
