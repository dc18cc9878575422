"""A checkpoint's hf/ as transformers writes it, exported from ZeRO-3 on 2 processes (torchtrain.training.export
`export_model`): sharded safetensors with an index past max_shard_size, in the training dtype, gathered one
layer at a time, loaded by transformers' own `from_pretrained` (no custom code) with the logits of the
trainer's forward, every shard under the checkpoint's manifest.

The runs set `checkpoint.max_shard_size=300KB` (random:llama's 0.86 MB of float32 parameters make three shards,
its bf16 ones two) and start with tests/train/export_probe/sitecustomize.py on PYTHONPATH, which records every
gather the export opens."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.conftest import ENV, run_train

PROBE = Path(__file__).parent / "export_probe"
STEPS = 2
SHARD = "300KB"
COMMON = (f"schedule.steps={STEPS}", f"checkpoint.max_shard_size={SHARD}", "data.global_batch=4", "data.micro_batch=1", "eval.window=0",
          "checkpoint.save_every=0", "parallel.nproc=2", "parallel.zero_stage=3", "logging.report_to=[]")
# The project's fp32 rule (parity_tests.core.Rule.fp32_tol): logits within 1e-5 relative L2.
FP32_TOL = 1e-5


def _run(packed: Path, out: Path, *overrides: str) -> tuple[Path, list[list[dict]]]:
    """A ZeRO-3 run of random:llama on 2 processes, probed; its last checkpoint and each rank's gathers."""
    log = out.parent / f"{out.name}-gathers"
    log.mkdir(parents=True)
    env = {**ENV, "ANCHOR_TEST_GATHER_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(PROBE), ENV.get("PYTHONPATH", "")])}
    run_train(out, *COMMON, f"data.path={packed}", *overrides, env=env)
    gathers = [[json.loads(line) for line in (log / f"rank-{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    return out / "checkpoints" / f"step-{STEPS}", gathers


@pytest.fixture(scope="module")
def fp32(packed, tmp_path_factory):
    return _run(packed, tmp_path_factory.mktemp("fp32") / "run")


@pytest.fixture(scope="module")
def bf16(packed, tmp_path_factory):
    return _run(packed, tmp_path_factory.mktemp("bf16") / "run", "model.dtype=bfloat16")


def _shards(hf: Path) -> tuple[dict, list[str]]:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    return index, sorted(set(index["weight_map"].values()))


def _zero_state(step: Path) -> dict[str, torch.Tensor]:
    """The float32 master weights DeepSpeed saved in the checkpoint's ds/ (ZeRO-3 partitions, consolidated by
    DeepSpeed's own zero_to_fp32): what the export must hold, read from other files than hf/."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(step / "ds"), tag="state")


@pytest.mark.slow
def test_zero3_export_is_sharded_and_loads_in_transformers_with_the_trainers_logits(fp32, packed):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from anchor_core.data.packed import PackedData
    from torchtrain.model import build_model

    step, _ = fp32
    hf = step / "hf"
    index, files = _shards(hf)
    print(sorted(p.name for p in hf.iterdir()), index["metadata"])
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors"]
    assert not (hf / "model.safetensors").exists()
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in hf.iterdir()}

    # every shard within max_shard_size, the index's total_size their tensors' bytes, each tensor where the
    # index puts it, float32, and the weights DeepSpeed's own ZeRO-3 files hold, bit for bit
    master = _zero_state(step)
    total = 0
    for file in files:
        assert (hf / file).stat().st_size - 8 - int.from_bytes((hf / file).read_bytes()[:8], "little") <= 300_000
        with safe_open(hf / file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                t = f.get_tensor(name)
                assert index["weight_map"][name] == file and t.dtype == torch.float32
                assert torch.equal(t, master[name]), name
                total += t.numel() * 4
    assert set(index["weight_map"]) == set(master) and not any("inv_freq" in n for n in index["weight_map"])
    assert index["metadata"]["total_size"] == total

    config = json.loads((hf / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(hf).eval()  # stock transformers, no trust_remote_code
    assert type(loaded).__module__.startswith("transformers.") and next(loaded.parameters()).dtype == torch.float32

    # the trainer's own forward of the same checkpoint (its model and attention engine, read through
    # anchor_core.weights from the shards), on the first window of the data as one causal sequence, where
    # transformers computes the same function; the rule's margin over fp32's own noise is measured: the
    # same logits in two summation orders (transformers' sdpa and eager attention)
    trainer = build_model(str(step), engine="varlen", dtype="float32").eval()
    ids = torch.as_tensor(PackedData.open(packed).batch([0], "full").tokens, dtype=torch.long)
    eager = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    with torch.no_grad():
        want = trainer(input_ids=ids, use_cache=False).logits.double()
        got = loaded(ids, use_cache=False).logits.double()
        other = eager(ids, use_cache=False).logits.double()
    rel = float((got - want).norm() / want.norm())
    baseline = float((other - got).norm() / got.norm())
    print(f"logits rel L2: transformers vs the trainer {rel:.2e}; sdpa vs eager (fp32's own noise) {baseline:.2e}")
    assert baseline < FP32_TOL
    assert rel <= FP32_TOL


@pytest.mark.slow
def test_a_bf16_run_exports_bf16(bf16):
    from safetensors import safe_open

    step, _ = bf16
    hf = step / "hf"
    index, files = _shards(hf)
    assert len(files) == 2
    master = _zero_state(step)
    for file in files:
        with safe_open(hf / file, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16, name
                # the bf16 weights the model trained with: its float32 master weights rounded
                assert torch.equal(t, master[name].to(torch.bfloat16)), name
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in master.values())
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_the_gather_is_one_layer_at_a_time(fp32):
    """Each GatheredParameters the export opens holds one decoder layer's parameters or one other parameter
    (embeddings, final norm, lm_head), on every rank in the same order, never written back (modifier_rank
    None); together they are the model once."""
    from anchor_core.spec import random_preset
    from anchor_core.weights import expected_shapes

    spec = random_preset("llama")
    shapes = expected_shapes(spec)
    layer = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("model.layers.0."))
    per_layer = sum(1 for n in shapes if n.startswith("model.layers.0."))
    _, gathers = fp32
    assert gathers[0] == gathers[1]
    print([(len(g["numel"]), sum(g["numel"])) for g in gathers[0]], f"one layer: {per_layer} tensors, {layer}")
    assert len(gathers[0]) == spec.num_layers + 3
    assert all(g["modifier_rank"] is None for g in gathers[0])
    assert all(len(g["numel"]) in (1, per_layer) and sum(g["numel"]) <= max(layer, spec.vocab_size * spec.hidden_size)
               for g in gathers[0])
    assert sorted(tuple(s) for g in gathers[0] for s in g["shapes"]) == sorted(shapes.values())


@pytest.mark.slow
def test_the_manifest_covers_every_shard(fp32, tmp_path):
    """A byte flipped in the second shard: every reader of the checkpoint refuses it in one line naming it,
    and a resume does not use it."""
    from anchor.eval.generate import eval_model_source
    from anchor_core.errors import InputError
    from anchor_core.weights import load_spec, load_weights
    from torchtrain.training import checkpoint as ckpt

    step, _ = fp32
    run = tmp_path / "run"
    folder = ckpt.step_dir(run, STEPS)
    shutil.copytree(step, folder)
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    _, files = _shards(folder / "hf")
    assert {f"hf/{f}" for f in [*files, "model.safetensors.index.json"]} <= set(manifest)
    load_weights(str(folder))
    second = folder / "hf" / files[1]
    raw = bytearray(second.read_bytes())
    raw[-7] ^= 0xFF
    second.write_bytes(bytes(raw))
    want = f"{folder}: checkpoint step-{STEPS} does not verify: checksum mismatch in hf/{files[1]}"
    for name in (folder / "hf", folder):
        for read in (load_weights, load_spec, eval_model_source):
            with pytest.raises(InputError) as e:
                read(str(name))
            print(f"{read.__name__}({name.name}): {e.value}")
            assert str(e.value) == want
    logs: list[str] = []
    assert ckpt.newest_valid(run, log=logs.append) is None
    assert len(logs) == 1 and f"step-{STEPS} is corrupt (checksum mismatch in hf/{files[1]})" in logs[0]
