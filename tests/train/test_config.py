"""`anchor train` configs: every shipped config resolves and yields its DeepSpeed JSON; bad configs
and bad command lines are one-line errors naming the key and the file, exit 2, before any process
group starts and before anything is written (docs/DESIGN.md §8)."""

from __future__ import annotations

import os
import json
from pathlib import Path

import pytest

from anchor_core.errors import InputError
from anchor_core.spec import ModelSpec, RopeSpec
from tests.train.conftest import ROOT, TINY
from torchtrain.config import load_train_config, with_changes
from torchtrain.config.deepspeed_json import deepspeed_config
from torchtrain.training.fit import check_model
CONFIGS = sorted((ROOT / "configs" / "train").rglob("*.yaml"))

# The published Hugging Face configs of the paper's models (heads, kv heads, positions, RoPE base):
# they cannot be downloaded here, so the shipped configs are resolved against these shapes.
PUBLISHED = {
    "models/Llama-2-7b-hf": dict(family="llama", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32,
                                 num_kv_heads=32, head_dim=128, intermediate_size=11008, max_position=4096,
                                 rope=RopeSpec(base=10000.0)),
    "models/Meta-Llama-3-8B": dict(family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                                   num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position=8192,
                                   rope=RopeSpec(base=500000.0)),
    "models/Mistral-7B-v0.3": dict(family="mistral", vocab_size=32768, hidden_size=4096, num_layers=32, num_heads=32,
                                   num_kv_heads=8, head_dim=128, intermediate_size=14336, max_position=32768,
                                   rope=RopeSpec(base=1e6)),
    "models/Qwen1.5-1.8B": dict(family="qwen2", vocab_size=151936, hidden_size=2048, num_layers=24, num_heads=16,
                                num_kv_heads=16, head_dim=128, intermediate_size=5504, max_position=32768,
                                rope=RopeSpec(base=1e6), qkv_bias=True, tie_embeddings=False, bos_token_id=None,
                                eos_token_id=151643),
}
PAPER_BASE = {65536: 5e6, 131072: 1e7}


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT / "configs" / "train")) for p in CONFIGS])
def test_every_shipped_config_resolves(path, monkeypatch):
    # a step's memory against the whole machine's (MemTotal), not what the processes beside this test
    # leave free at the moment: a fresh-clone run beside a 12 GB job refused smollm2_2k.yaml (5.5 GiB
    # needed, 5.2 available), which fits this 24 GB machine idle
    from torchtrain.attention import engines

    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": total)
    cfg = load_train_config(path)
    ds = deepspeed_config(cfg, cfg.parallel.nproc)
    print(path.name, json.dumps(ds))
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * cfg.parallel.nproc
    assert ds["gradient_clipping"] == cfg.optim.grad_clip  # never DeepSpeed's silent default
    assert ds["zero_optimization"]["stage"] == cfg.parallel.zero_stage
    assert cfg.data.global_batch == cfg.data.micro_batch * cfg.grad_accum(cfg.parallel.nproc) * cfg.dp(cfg.parallel.nproc)
    if cfg.model.name in PUBLISHED:
        spec = ModelSpec(**PUBLISHED[cfg.model.name]).with_rope(**cfg.rope_overrides())
        trained = check_model(cfg, spec, cfg.data.seq_len, here=False)  # flash-attn is CUDA-only
        assert trained.max_position == cfg.data.seq_len and trained.rope.base == PAPER_BASE[cfg.data.seq_len]
        assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas, cfg.schedule.steps, cfg.data.global_batch) == (2e-5, 0.1, (0.9, 0.95), 2000, 8)
        assert (cfg.model.dtype, cfg.parallel.zero_stage, cfg.parallel.sequence_parallel) == ("bfloat16", 3, 8)
    else:  # every phase of a length schedule (one without), as prepare_run checks them
        from torchtrain.training.fit import model_spec
        from torchtrain.training.phases import run_phases

        for phase in run_phases(cfg):
            trained = check_model(phase.cfg, model_spec(phase.cfg), phase.seq_len)
            assert trained.max_position >= phase.seq_len


def test_paper_runs_cover_the_study():
    names = {p.stem for p in (ROOT / "configs" / "train" / "paper").glob("*.yaml")}
    for length in ("64k", "128k"):
        for run in ("full", "intra_doc", "intra_doc_reset", "anchor", "anchor_tags", "anchor_interleave"):
            assert f"llama2_7b_{length}_{run}" in names
    for model in ("llama3_8b", "mistral_7b_v0.3", "qwen1.5_1.8b"):
        assert f"{model}_64k_anchor" in names


def test_overrides_win_and_nest(tmp_path):
    cfg = load_train_config(TINY, ["schedule.steps=3", "model.rope.theta=5e6", "data.pack.budget=1000",
                                   "optim.betas=[0.8, 0.9]"])
    assert (cfg.schedule.steps, cfg.model.rope.given(), cfg.data.pack["budget"], cfg.optim.betas) == \
        (3, {"theta": 5e6}, 1000, (0.8, 0.9))
    assert cfg.data.pack["mixture"] == "original"  # the file's other pack keys stay
    assert (cfg.optim.lr, cfg.schedule.kind) == (1e-3, "cosine")  # the file's other keys of a section stay


REQUIRED_YAML = "model:\n  name: random:llama\ndata:\n  path: corpus\nschedule:\n  steps: 2\n"

# (config text or "tiny" for tiny.yaml, overrides, words the one-line message must hold)
BAD = [
    # unknown keys: at the top, in a section, in a nested mapping; from the file or an override
    ("tiny", ["colour=red"], ["unknown key 'colour'", "override 'colour=red'"]),
    ("tiny", ["optim.colour=red"], ["unknown key 'optim.colour'", "known in optim: lr,", "override optim.colour=red"]),
    ("tiny", ["model.rope.colour=1"], ["unknown key 'model.rope.colour'", "override model.rope.colour=1"]),
    ("tiny", ["data.pack.colour=1"], ["unknown key 'data.pack.colour'", "override data.pack.colour=1"]),
    (REQUIRED_YAML + "optim:\n  lerning_rate: 1\n", [], ["unknown key 'optim.lerning_rate'", "bad.yaml"]),
    (REQUIRED_YAML + "colour: red\n", [], ["unknown key 'colour'", "bad.yaml"]),
    # wrong types
    ("model:\n  name: random:llama\ndata:\n  path: corpus\nschedule:\n  steps: two\n", [],
     ["schedule.steps: expected an integer >= 1", "got 'two'", "bad.yaml"]),
    ("tiny", ["optim.lr=abc"], ["optim.lr: expected a number > 0", "override optim.lr=abc"]),
    ("tiny", ["schedule.steps=true"], ["schedule.steps: expected an integer", "override schedule.steps=true"]),
    ("tiny", ["schedule.steps=2.0"], ["schedule.steps: expected an integer", "got 2.0"]),
    ("tiny", ["data.tags=1"], ["data.tags: expected true or false", "got 1"]),
    ("tiny", ["model.dtype=float16"], ["model.dtype: expected one of float32, bfloat16"]),
    ("tiny", ["model.engine=warp"], ["model.engine: expected one of auto,"]),
    ("tiny", ["model.variant=causal"], ["model.variant: expected one of full, intra_doc"]),
    ("tiny", ["optim=3"], ["unknown key 'optim'", "dotted by section"]),
    (REQUIRED_YAML + "optim: 3\n", [], ["optim: expected a mapping", "bad.yaml"]),
    ("tiny", ["data.pack.budget=many"], ["data.pack.budget: expected", "got 'many'", "override data.pack.budget=many"]),
    # missing
    ("model:\n  name: random:llama\nschedule:\n  steps: 2\n", [], ["missing required key 'data.path'", "bad.yaml"]),
    ("data:\n  path: corpus\nschedule:\n  steps: 2\n", [], ["missing required key 'model.name'"]),
    # out of range
    ("tiny", ["parallel.zero_stage=4"], ["parallel.zero_stage: expected an integer in [0, 3]"]),
    ("tiny", ["parallel.zero_stage=-1"], ["parallel.zero_stage", "in [0, 3]"]),
    ("tiny", ["data.seed=-1"], ["data.seed", "in [0, 4294967295]", "override data.seed=-1"]),
    ("tiny", ["optim.betas=[0.9, 1.0]"], ["optim.betas: expected two numbers [beta1, beta2] in [0, 1)"]),
    ("tiny", ["schedule.min_lr_ratio=1.5"], ["schedule.min_lr_ratio: expected a number in [0, 1]"]),
    ("tiny", ["model.rope.theta=1"], ["model.rope.theta: expected a number > 1"]),
    ("tiny", ["optim.eps=.nan"], ["optim.eps: expected a number > 0"]),
    ("tiny", ["logging.dump_grads=[0]"], ["logging.dump_grads: expected a list of step numbers >= 1"]),
    # across keys, the model, the machine
    ("tiny", ["model.name=/nonexistent/model"], ["/nonexistent/model", "no such model"]),
    ("tiny", ["data.path=/nonexistent/data.jsonl"], ["/nonexistent/data.jsonl", "no such data"]),
    ("tiny", ["data.seq_len=5000"], ["data.seq_len 5000", "4096 positions", "model.rope.theta"]),
    ("tiny", ["parallel.sequence_parallel=2", "parallel.nproc=2", "data.seq_len=127"],
     ["does not divide seq_len 127", "command-line override parallel.sequence_parallel=2",
      "command-line override data.seq_len=127"]),
    ("tiny", ["model.name=random:smollm2", "parallel.sequence_parallel=2", "parallel.nproc=2"],
     ["does not divide", "9 attention heads"]),
    ("tiny", ["parallel.sequence_parallel=2", "parallel.nproc=1"],
     ["parallel.sequence_parallel 2 needs at least 2 processes", "has 1"]),
    ("tiny", ["parallel.sequence_parallel=2", "parallel.nproc=3", "data.global_batch=3", "data.micro_batch=1"],
     ["3 processes do not split into sequence-parallel groups of 2"]),
    ("tiny", ["data.global_batch=5", "data.micro_batch=2"],
     ["data.global_batch 5 is not a multiple of data.micro_batch 2"]),
    ("tiny", ["data.global_batch=4", "data.micro_batch=1", "parallel.nproc=3"], ["does not split", "3 data-parallel ranks"]),
    ("tiny", ["model.rope.scaling=yarn"], ["model.rope", "original_max_position"]),
    ("tiny", ["model.engine=flex"], ["flex", "no backward on CPU"]),
    # a dense T x T mask of 13 TiB: refused before packing, whatever the machine
    ("tiny", ["model.engine=sdpa", "data.seq_len=1048576", "model.rope.theta=5e7"],
     ["model.engine 'sdpa' at data.seq_len=1048576", "needs about", "dense T x T mask", "available",
      "model.engine: auto"]),
    # activations linear in T, 250 GB at 1e7 slots on the default engine: refused before packing
    ("tiny", ["data.seq_len=10000001", "model.rope.theta=5e7"],
     ["data.seq_len=10000001 (data.micro_batch=2) needs about", "activations", "available",
      "model.activation_checkpointing"]),
    ("tiny", ["model.dtype=bfloat16", "parallel.zero_stage=0"], ["bfloat16 needs parallel.zero_stage >= 1"]),
    # pack keys are named as the config names them, not as `anchor pack`'s flags
    ("tiny", ["data.pack.budget=0"], ["data.pack.budget must be at least 1", "override data.pack.budget=0"]),
    ("tiny", ["data.pack.upsample_factor=5000"], ["data.pack.upsample_factor must be at most 1000"]),
    ("tiny", ["data.pack.seed=-3"], ["data.pack.seed"]),
    ("tiny", ["data.pack.seq_len=64"], ["unknown key 'data.pack.seq_len'", "give it as data.seq_len"]),
    ("tiny", ["data.pack.budget=100000000000000"], ["data.pack.budget 100000000000000 (packed windows of", "of disk"]),
    ("tiny", ["steps"], ["override 'steps' is not key=value"]),
    ("\xff\xfe not utf8", [], ["bad.yaml", "not UTF-8"]),
    ("model: [unclosed\n", [], ["bad.yaml", "invalid YAML"]),
]


@pytest.mark.parametrize("text,overrides,words", BAD, ids=[" ".join(o) or t[:20] for t, o, _ in BAD])
def test_bad_config_is_one_line_exit_2_nothing_written(tmp_path, capsys, text, overrides, words):
    from anchor.cli import main

    config = TINY
    if text != "tiny":
        config = tmp_path / "bad.yaml"
        config.write_bytes(text.encode("latin-1"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(config), "--out", str(out), "--no-progress", *overrides])
    err = capsys.readouterr().err
    print(e.value.code, err)
    lines = [l for l in err.splitlines() if l.strip() and "[WARNING]" not in l]
    assert e.value.code == 2
    assert len(lines) == 1 and lines[0].startswith("anchor train: error:"), lines
    for w in words:
        assert w in lines[0]
    for flag in ("--budget", "--seq-len", "--upsample-factor", "--seed"):  # flags `anchor train` does not have
        assert flag not in lines[0]
    assert not out.exists(), "a refused run wrote its folder"


def test_validation_errors_name_where_each_value_came_from():
    # data.micro_batch: 2 from the file, data.global_batch from the command line
    with pytest.raises(InputError) as e:
        load_train_config(TINY, ["data.global_batch=5"])
    assert "command-line override data.global_batch=5" in str(e.value) and "tiny.yaml" in str(e.value)
    with pytest.raises(InputError) as e:
        load_train_config(TINY, ["data.global_batch=5", "data.micro_batch=2"])
    assert "tiny.yaml" not in str(e.value) and "command-line override data.micro_batch=2" in str(e.value)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT / "configs" / "train")) for p in CONFIGS])
def test_every_shipped_config_loads(path):
    """Every YAML under configs/train/ is in sections and validates (the model and data need not exist here)."""
    cfg = load_train_config(path)
    print(path.name, cfg.to_dict())
    assert cfg.source == str(path) and cfg.schedule.steps >= 1 and cfg.model.name and cfg.data.path


def test_an_override_reaches_training(tmp_path, capsys):
    """`anchor train --config configs/train/tiny.yaml optim.lr=1e-5` trains with lr 1e-5: the run's config.yaml
    records it and the first step (no warmup) is taken at it."""
    import yaml

    from anchor.cli import main
    from torchtrain.training.metrics import read_metrics

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(TINY), "--out", str(out), "--no-progress", "optim.lr=1e-5", "schedule.steps=1",
              "schedule.warmup_steps=0", "checkpoint.save_every=0", "eval.every=1", "eval.window=1",
              "data.pack.budget=4000"])
    print(capsys.readouterr())
    assert e.value.code in (0, None)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 1e-5 and saved["schedule"]["steps"] == 1
    rows = read_metrics(out)
    print(rows)
    assert [r["step"] for r in rows] == [1] and rows[0]["lr"] == pytest.approx(1e-5)


def test_a_run_in_this_process_does_not_make_the_next_look_launched(tmp_path, capsys):
    """A world of one leaves RANK/WORLD_SIZE in os.environ (torch and DeepSpeed read them); a later
    `anchor train` in the same process (the demo trains two runs) must still be a local one: its
    nproc checks apply and it is not mistaken for a torchrun rank."""
    from anchor.cli import main
    from torchtrain.parallel.distributed import launched_externally

    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(TINY), "--out", str(tmp_path / "one"), "--no-progress", "schedule.steps=1",
              "checkpoint.save_every=0", "eval.every=1", "eval.window=1", "data.pack.budget=4000"])
    assert e.value.code in (0, None)
    assert os.environ.get("RANK") == "0" and not launched_externally()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(TINY), "--out", str(tmp_path / "two"), "--no-progress",
              "parallel.sequence_parallel=2", "parallel.nproc=2", "data.seq_len=127"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip() and "[WARNING]" not in l]
    assert e.value.code == 2 and "does not divide seq_len 127" in err[0], err


@pytest.mark.slow
def test_a_child_of_a_process_that_trained_is_not_mistaken_for_a_launched_rank(tmp_path):
    """The world-of-one variables stay in os.environ and a child inherits them (`!anchor train` in a notebook
    that trained in-process; pytest running the CLI after an in-process run): the child must train as a
    plain process, not join the parent's rendezvous port as a torchrun rank (EADDRINUSE).
    A launcher's own MASTER_PORT still makes it a launched rank."""
    import subprocess
    import sys

    from anchor.cli import main
    from torchtrain.parallel.distributed import SOLO_PORT, environ_for_child

    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(TINY), "--out", str(tmp_path / "parent"), "--no-progress", "schedule.steps=1",
              "checkpoint.save_every=0", "eval.every=1", "eval.window=1", "data.pack.budget=4000"])
    assert e.value.code in (0, None)
    assert os.environ[SOLO_PORT] == os.environ["MASTER_PORT"] and os.environ["WORLD_SIZE"] == "1"
    probe = "from torchtrain.parallel.distributed import launched_externally as f; print(f())"
    launched = {**os.environ, "MASTER_PORT": str(int(os.environ["MASTER_PORT"]) + 1), "WORLD_SIZE": "2"}
    for env, want in ((dict(os.environ), "False"), (launched, "True")):
        out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True)
        assert out.stdout.strip() == want, out.stderr[-2000:]
    # a child that starts a world of its own (an accelerate script) gets none of the world-of-one variables;
    # a launcher's stay
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", SOLO_PORT} & set(environ_for_child())
    assert environ_for_child(launched) == launched
    child = subprocess.run([sys.executable, "-m", "anchor", "train", "--config", str(TINY), "--out",
                            str(tmp_path / "child"), "--no-progress", "schedule.steps=1", "checkpoint.save_every=0", "eval.every=1",
                            "eval.window=1", "data.pack.budget=4000"], cwd=ROOT, capture_output=True, text=True)
    assert child.returncode == 0, child.stderr[-3000:]


def test_engine_defaults_to_auto_and_resolves_to_a_linear_one_here():
    """No `model.engine:` means auto; on this CPU it runs as varlen (never a dense engine by default)."""
    from torchtrain.config import validate
    from torchtrain.training.fit import resolved_engine
    cfg = validate({"model": {"name": "random:llama"}, "data": {"path": "corpus"}, "schedule": {"steps": 1}})
    assert cfg.model.engine == "auto"
    assert resolved_engine(cfg) in ("varlen", "flash_varlen")
    assert resolved_engine(with_changes(cfg, {"model.engine": "sdpa"})) == "sdpa"


@pytest.mark.parametrize("engine", ["sdpa", "eager"])
def test_dense_engine_refused_when_its_mask_does_not_fit(tmp_path, capsys, monkeypatch, engine):
    """With 0.7 GiB free, tiny at T=4096 (sdpa: 13 bytes per T² pair, 0.2 GiB, beside the 0.56 GiB of a
    linear engine's step) is refused in one line naming the engine and the estimate, exit 2, nothing
    written; auto (linear in T) is not."""
    from anchor.cli import main
    from torchtrain.attention import engines

    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": int(0.7 * 2**30))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(TINY), "--out", str(out), "--no-progress", f"model.engine={engine}",
              "data.seq_len=4096", "data.micro_batch=1", "data.global_batch=1"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip() and "[WARNING]" not in l]
    print(err)
    assert e.value.code == 2 and len(err) == 1
    assert f"model.engine {engine!r} at data.seq_len=4096 (data.micro_batch=1) needs about" in err[0]
    # the length came from the command line, not from tiny.yaml: the error names the override
    assert "0.7 GiB available" in err[0] and "command-line override data.seq_len=4096" in err[0]
    assert "tiny.yaml" not in err[0] and "dense T x T" in err[0]
    assert not out.exists(), "a refused run wrote its folder"
    from anchor_core.weights import load_spec
    from torchtrain.config import load_train_config

    cfg = load_train_config(TINY, ["data.seq_len=4096", "data.micro_batch=1", "data.global_batch=1"])
    check_model(cfg, load_spec(cfg.model.name), 4096)  # auto: no T x T tensors, no refusal


@pytest.mark.parametrize("override,match", [
    ("data.pack.chunks_max=60", "chunks_max - 1 = 59"),
    ("data.pack.chunk_cut_lo=0.9", "chunk_cut_lo 0.9"),
    ("data.pack.chunk_doc_max=10", "chunk_doc_max 10"),
])
def test_pack_chunking_keys_are_checked_before_any_work(override, match):
    """The interleave chunking keys are read as `anchor pack` reads them, and a range
    with no room for the cuts is one line naming the keys."""
    with pytest.raises(InputError, match=match):
        load_train_config(TINY, [override])
    cfg = load_train_config(TINY, ["data.pack.chunks_max=4", "data.pack.chunk_cut_hi=0.9"])
    assert cfg.data.pack["chunks_max"] == 4


def test_many_processes_are_refused_by_their_memory(tmp_path, capsys, monkeypatch):
    """`nproc` far beyond what the machine holds: every local process costs its own
    interpreter, torch and DeepSpeed (torchtrain.training.memory.BASE_PROCESS_BYTES, measured): with 4 GiB free,
    16 processes of tiny are refused in one line naming nproc and the estimate, before any process starts;
    2 are not."""
    from anchor.cli import main
    from anchor_core.weights import load_spec
    from torchtrain.attention import engines
    from torchtrain.config import load_train_config

    monkeypatch.setattr(engines, "available_memory", lambda device="cpu": 4 * 2**30)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(TINY), "--out", str(out), "--no-progress", "parallel.nproc=16", "data.global_batch=16",
              "data.micro_batch=1"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip() and "[WARNING]" not in l]
    print(err)
    assert e.value.code == 2 and len(err) == 1
    assert "parallel.nproc=16 needs about" in err[0] and "16 x [process 0.58" in err[0] and "fewer processes" in err[0]
    assert not out.exists()
    cfg = load_train_config(TINY, ["parallel.nproc=2", "data.global_batch=2", "data.micro_batch=1"])
    check_model(cfg, load_spec(cfg.model.name), cfg.data.seq_len or 256)


def test_a_late_config_error_leaves_no_run_folder_nor_parents(tmp_path, capsys):
    """An error found after the run folder was made (here: the packed data holds fewer windows than one global
    batch, known only once packed) removes the run folder, its pack and the parents the verb made; a folder
    that existed before stays, with what it held."""
    from anchor.cli import main

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "mine.txt").write_text("x")
    for out in (tmp_path / "a" / "b" / "run", kept / "run"):
        with pytest.raises(SystemExit) as e:
            main(["train", "--config", str(TINY), "--out", str(out), "--no-progress", "data.global_batch=100000",
                  "data.micro_batch=1", "data.pack.budget=20000"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "fewer than one global batch" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"], list(tmp_path.iterdir())
    assert sorted(p.name for p in kept.iterdir()) == ["mine.txt"]


@pytest.mark.slow  # two processes (the CI budget on 2 cores): `make test-all`
def test_a_two_process_run_prints_no_warnings(tmp_path):
    """DeepSpeed's accelerator WARNING, printed once per process, is silenced: stderr and stdout (DeepSpeed
    logs there) of a 2-process run hold no WARNING line (and no other noise than the progress-free run's own)."""
    from tests.train.conftest import run_train

    p = run_train(tmp_path / "run", "parallel.nproc=2", "data.global_batch=2", "data.micro_batch=1", "schedule.steps=1")
    noise = [l for l in (p.stdout + p.stderr).splitlines() if "WARN" in l.upper() or "warn(" in l]
    print(p.stdout, p.stderr)
    assert noise == [], noise
