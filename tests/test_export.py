"""anchor_core.export.export_hf (what a checkpoint's `hf/` holds) for every family, tied and untied heads:
the folder reloads in transformers' own `from_pretrained` with logits identical to those of the model it
was exported from (stock transformers built from the spec and the state), reads back through
anchor_core.weights as the same spec and weights, and its tokenizer loads in transformers. Sharded
(`max_shard_size`), the files and index are transformers' own split; bf16 on request; anchor_core.weights
reads an index's shards and refuses a broken index in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from anchor_core.errors import InputError
from anchor_core.export import DEFAULT_MAX_SHARD_SIZE, TensorInfo, export_hf, plan_shards, shard_size_bytes
from anchor_core.spec import RANDOM_PRESETS, random_preset, to_hf_config
from anchor_core.tokenizer import load_tokenizer
from anchor_core.weights import load_weights, random_state

# Every preset as it is (qwen2, qwen3, smollm2 tie their embeddings), and Qwen3 untied (as Qwen3-8B and up).
MODELS = [*RANDOM_PRESETS, "qwen3+untied"]


def spec_and_state(model: str):
    preset, _, variant = model.partition("+")
    spec = random_preset(preset)
    if variant == "untied":
        spec = spec.replace(tie_embeddings=False)
    return preset, spec, random_state(spec, seed=1)


# sharded (100KB: four or five shards) with an untied and a tied head
@pytest.mark.parametrize(("model", "shard"), [*((m, DEFAULT_MAX_SHARD_SIZE) for m in MODELS),
                                              ("llama", "100KB"), ("smollm2", "100KB")])
def test_export_reloads_in_transformers_with_identical_logits(model, shard, tmp_path):
    preset, spec, state = spec_and_state(model)
    folder = export_hf(spec, state, tmp_path / "hf", tokenizer_of=f"random:{preset}", max_shard_size=shard)
    sharded = (folder / "model.safetensors.index.json").is_file()
    assert sharded == (shard != DEFAULT_MAX_SHARD_SIZE) and sharded != (folder / "model.safetensors").is_file()

    source = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec)), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    missing, unexpected = source.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if spec.tie_embeddings else set())
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == type(source).__name__ == to_hf_config(spec)["architectures"][0]
    assert reloaded.config.tie_word_embeddings == spec.tie_embeddings
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == spec.tie_embeddings

    ids = torch.from_numpy(np.random.default_rng(0).integers(3, spec.vocab_size, (2, 97)))
    with torch.no_grad():
        a, b = source(ids, use_cache=False).logits, reloaded(ids, use_cache=False).logits
    print(f"{model} ({type(reloaded).__name__}, tied {spec.tie_embeddings}): max |diff| {(a - b).abs().max():.1e}")
    assert torch.equal(a, b)

    spec_back, state_back = load_weights(str(folder))
    assert spec_back == spec
    assert set(state_back) == set(state) and all(np.array_equal(state_back[k], v) for k, v in state.items())

    text = "Qwen3 q/k norms, ünïcode"
    assert AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"] == \
        load_tokenizer(f"random:{preset}").encode_batch([text])[0]


def test_shard_sizes_read_as_transformers_reads_them():
    from transformers.utils.hub import convert_file_size_to_int

    for size in ("5GB", "50GB", "500MB", "64KB", "2GiB", "300MiB", "1KiB", "5gb", "8Mb", "10kb", "1gib", 12345):
        assert shard_size_bytes(size) == convert_file_size_to_int(size), size
    for bad in ("", "5", "1.5GB", "5TB", "GB", "-1MB", "0KB", 0, True, None, 2.5):
        with pytest.raises(InputError) as e:
            shard_size_bytes(bad, option="checkpoint.max_shard_size")
        print(e.value)
        assert str(e.value).startswith("checkpoint.max_shard_size: ") and "\n" not in str(e.value)


def _transformers_split(spec, limit):
    """huggingface_hub's split, as transformers' save_pretrained calls it, of a stock model of `spec`."""
    from huggingface_hub import split_torch_state_dict_into_shards

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**to_hf_config(spec)), dtype=torch.float32)
    state = {k: v for k, v in model.state_dict().items() if not (spec.tie_embeddings and k == "lm_head.weight")}
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=limit)
    return state, split


@pytest.mark.parametrize("limit", [10**9, 120_000, 50_000, 30_000])
def test_shards_are_split_as_transformers_splits_them(limit):
    """The same files holding the same tensors, in the model's order, whatever the size (a tensor larger than
    the limit alone in its own file, 30KB: every weight matrix of random:llama)."""
    spec = random_preset("llama")
    state, split = _transformers_split(spec, limit)
    plan = plan_shards([TensorInfo(k, tuple(v.shape), "F32") for k, v in state.items()], limit)
    print([(f, len(ts)) for f, ts in plan])
    assert {f: [t.name for t in ts] for f, ts in plan} == split.filename_to_tensors
    assert [f for f, _ in plan] == list(split.filename_to_tensors)


def test_bf16_export(tmp_path):
    import ml_dtypes
    from safetensors import safe_open

    spec, state = random_preset("llama"), random_state(random_preset("llama"), seed=1)
    folder = export_hf(spec, state, tmp_path / "hf", tokenizer_of="random:llama", max_shard_size="200KB",
                       dtype="bfloat16")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(v.size * 2 for v in state.values())
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(folder / file, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16
                assert np.array_equal(t.float().numpy(), state[name].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert next(reloaded.parameters()).dtype == torch.bfloat16


def _sharded(tmp_path):
    spec, state = random_preset("llama"), random_state(random_preset("llama"), seed=2)
    folder = export_hf(spec, state, tmp_path / "hf", tokenizer_of="random:llama", max_shard_size="200KB")
    return folder, state, json.loads((folder / "model.safetensors.index.json").read_text())


def test_a_sharded_folder_reads_through_its_index(tmp_path, capsys):
    """Only the index's shards are read, each for the tensors the index puts in it; a folder with a
    model.safetensors besides is read from that file, as transformers reads it."""
    from anchor_core.weights import read_safetensors

    folder, state, index = _sharded(tmp_path)
    np.save(folder / "stray.npy", np.zeros(3))
    other = random_state(random_preset("llama"), seed=3)
    (folder / "stray.safetensors").write_bytes((folder / index["weight_map"]["model.norm.weight"]).read_bytes())
    _, back = load_weights(str(folder))
    assert set(back) == set(state) and all(np.array_equal(back[k], state[k]) for k in state)
    export_hf(random_preset("llama"), other, tmp_path / "single", tokenizer_of="random:llama")
    shutil.copyfile(tmp_path / "single" / "model.safetensors", folder / "model.safetensors")
    _, back = load_weights(str(folder))
    assert all(np.array_equal(back[k], other[k]) for k in other)
    assert set(read_safetensors(folder / index["weight_map"]["model.norm.weight"], {"model.norm.weight"})) == \
        {"model.norm.weight"}


@pytest.mark.parametrize("case", ["missing shard", "outside the folder", "not in its shard", "no weight_map",
                                  "not json"])
def test_a_broken_index_is_one_line(case, tmp_path):
    folder, _, index = _sharded(tmp_path)
    where = folder / "model.safetensors.index.json"
    files = sorted(set(index["weight_map"].values()))
    if case == "missing shard":
        (folder / files[1]).unlink()
        want = f"{where}: weight_map: "
    elif case == "outside the folder":
        index["weight_map"]["model.norm.weight"] = "../" + files[0]
        want = f"{where}: weight_map: model.norm.weight is in '../{files[0]}', not a .safetensors file of this folder"
    elif case == "not in its shard":
        name = next(k for k, f in index["weight_map"].items() if f == files[0])
        index["weight_map"][name] = files[1]
        want = f"{folder}: model.safetensors.index.json puts {name} in {files[1]}, which does not hold it"
    elif case == "no weight_map":
        index.pop("weight_map")
        want = f"{where}: a sharded model's index needs a non-empty weight_map object"
    else:
        index = "["
        want = f"{where}: unreadable model.safetensors.index.json"
    if case != "missing shard":
        where.write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(InputError) as e:
        load_weights(str(folder))
    print(e.value)
    assert str(e.value).startswith(want) and "\n" not in str(e.value)


@pytest.mark.parametrize("model", [*MODELS, "llama+yarn"])
def test_the_trainers_export_writes_the_models_own_config(model, tmp_path):
    """torchtrain.training.checkpoint.export_model (a checkpoint's hf/, here without ZeRO) for every family, tied and
    untied, and a RoPE override with the positions raised as a run trains them: config.json is the model's
    own config with the spec as trained, reads back as that spec, and from_pretrained gives the trained model's
    logits."""
    from torchtrain.training.checkpoint import export_model
    from torchtrain.model import model_from_weights

    preset, spec, state = spec_and_state(model.replace("+yarn", ""))
    if model.endswith("+yarn"):
        spec = spec.with_rope(kind="yarn", factor=4.0, original_max_position=spec.max_position)
        spec = spec.replace(max_position=4 * spec.max_position)
    trained = model_from_weights(spec.replace(max_position=RANDOM_PRESETS[preset].max_position), state,
                                 engine="eager").eval()
    folder = tmp_path / "hf"
    export_model(trained, spec, folder, zero3=False, tokenizer_of=f"random:{preset}", train_dtype="float32",
                 max_shard_size="100KB")
    config = json.loads((folder / "config.json").read_text())
    assert config["use_cache"] is True and config["dtype"] == "float32"
    assert config["max_position_embeddings"] == to_hf_config(spec)["max_position_embeddings"]
    assert load_weights(str(folder))[0] == spec
    reloaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(3, spec.vocab_size, (1, 41)))
    with torch.no_grad():
        assert torch.equal(trained(input_ids=ids, use_cache=False).logits, reloaded(ids, use_cache=False).logits)
    assert (folder / "generation_config.json").is_file()
