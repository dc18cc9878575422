"""ZeRO-3 builds the model partitioned (torchtrain.parallel.sharded_build): a user's sharded Hugging Face folder (several
safetensors files and their index) trains on 2 processes with the losses and gradient norms of one plain process
on the same weights (the fp32 rule of tests/train/test_zero.py, 1e-6), every rank logs the host memory it held
once the model was built and once the engine was, and a folder whose tensor cannot be read stops every rank with one line, exit 2.

The folder holds random:llama's weights (the tiny config's model, seed 0) written in 300 KB shards: three files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import metrics, run_train

STEPS = 3
COMMON = (f"schedule.steps={STEPS}", "data.global_batch=4", "eval.window=0", "checkpoint.save_every=0",
          "optim.grad_clip=1.0", "logging.report_to=[]")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from anchor_core.export import write_model, write_tokenizer
    from anchor_core.weights import random_preset, random_state

    spec = random_preset("llama")
    out = write_model(spec, random_state(spec, 0), tmp_path_factory.mktemp("user") / "llama-sharded",
                      max_shard_size="300KB")
    write_tokenizer("random:llama", spec, out)  # the byte tokenizer the corpus was packed with
    assert len(list(out.glob("*.safetensors"))) >= 2 and (out / "model.safetensors.index.json").is_file()
    return out


@pytest.fixture(scope="module")
def packed(corpus, folder, tmp_path_factory) -> Path:
    """The corpus packed for the folder (its byte tokenizer: the tokens random:llama's packing gives)."""
    from anchor_core.data.mixture import MixtureSpec
    from anchor_core.data.pipeline import PackConfig, pack_corpus

    out = tmp_path_factory.mktemp("user-data") / "pack"
    pack_corpus(str(folder), corpus, out, PackConfig(seq_len=128, mixture=MixtureSpec(budget=60000)))
    return out


@pytest.fixture(scope="module")
def single(packed, folder, tmp_path_factory):
    """One plain process building the whole model (ZeRO-0), on the same folder."""
    out = tmp_path_factory.mktemp("single") / "run"
    run_train(out, *COMMON, f"model.name={folder}", "data.micro_batch=4", "parallel.nproc=1",
              "parallel.zero_stage=0", f"data.path={packed}")
    return metrics(out)


@pytest.fixture(scope="module")
def sharded(packed, folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "run"
    done = run_train(out, *COMMON, f"model.name={folder}", "data.micro_batch=1", "parallel.nproc=2",
                     "parallel.zero_stage=3", f"data.path={packed}")
    return metrics(out), done


@pytest.mark.slow
def test_a_sharded_user_folder_trains_at_zero3_as_one_process_does(single, sharded):
    got, _ = sharded
    a, b = np.array([r["loss"] for r in single]), np.array([r["loss"] for r in got])
    rel = np.abs(a - b) / np.abs(a)
    print(f"losses: one process {a.round(7)}\n        ZeRO-3 x2 {b.round(7)}\n        max rel {rel.max():.2e}")
    assert [r["tokens"] for r in single] == [r["tokens"] for r in got]
    assert rel.max() <= 1e-6
    assert np.allclose([r["grad_norm"] for r in single], [r["grad_norm"] for r in got], rtol=1e-5)


@pytest.mark.slow  # the sharded run of 2 processes (half a minute on 2 cores): make test-all
def test_the_build_peaks_are_logged_for_every_rank(sharded):
    rows, done = sharded
    first = rows[0]
    model, engine, step = first["ranks_build_peak_gib"], first["ranks_engine_peak_gib"], first["ranks_peak_memory_gib"]
    assert len(model) == len(engine) == len(step) == 2 and all(isinstance(p, float) and p > 0 for p in model)
    assert first["build_peak_gib"] == model[0] and first["engine_peak_gib"] == engine[0]
    # a high-water mark never falls: the model's build, then the engine's, then the first step
    assert all(m <= e <= s for m, e, s in zip(model, engine, step))
    assert all("build_peak_gib" not in r for r in rows[1:])
    line = [ln for ln in done.stderr.splitlines() if ln.startswith("model built: host memory peak")]
    assert line == [f"model built: host memory peak {model[0]:.2f}, {model[1]:.2f} GiB (ranks 0-1); engine built: "
                    f"{engine[0]:.2f}, {engine[1]:.2f} GiB"]


def test_an_unreadable_tensor_stops_every_rank_in_one_line(packed, folder, tmp_path):
    """The index names a tensor the file does not hold: found from the headers, before any rank builds."""
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    other = sorted(set(index["weight_map"].values()) - {index["weight_map"][name]})[0]
    index["weight_map"][name] = other
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "run"
    done = run_train(out, *COMMON, f"model.name={bad}", "data.micro_batch=1", "parallel.nproc=2",
                     "parallel.zero_stage=3", f"data.path={packed}", check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [ln for ln in done.stderr.splitlines() if "puts" in ln and name in ln]
    assert errors and len(errors[0]) < 400


def test_each_rank_gets_its_slices_without_a_gather(folder, monkeypatch):
    """The build sends each rank its slice of each tensor (torchtrain.parallel.sharded_build._scatter_slices): DeepSpeed's
    gather, which holds a whole layer twice on every rank, is not called, and the partitions hold the weights
    build_model reads, rounded to bf16 (here one process: its partition is the whole flattened tensor, padded)."""
    import deepspeed
    import torch

    from torchtrain.config import load_train_config
    from torchtrain.config.deepspeed_json import deepspeed_config
    from torchtrain.parallel.distributed import ParallelGroups, init_world
    from torchtrain.model import build_model
    from torchtrain.parallel.sharded_build import build_partitioned

    gathers = []
    real = deepspeed.zero.GatheredParameters
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", lambda *a, **k: gathers.append(1) or real(*a, **k))
    cfg = load_train_config("tiny", [f"model.name={folder}", "model.dtype=bfloat16", "parallel.zero_stage=3"])
    world = init_world(1)
    model = build_partitioned(str(folder), engine="varlen", dtype="bfloat16", rope=None, seed=0,
                              ds_config=deepspeed_config(cfg, 1),
                              group=ParallelGroups(world).get_data_parallel_group())
    want = dict(build_model(str(folder), engine="varlen").named_parameters())
    assert gathers == []
    for name, p in model.named_parameters():
        flat = want[name].detach().reshape(-1).to(torch.bfloat16)
        assert torch.equal(p.ds_tensor[:flat.numel()], flat), name
        assert not p.ds_tensor[flat.numel():].any(), name
