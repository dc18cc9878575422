"""A user's YAML is bounded before anything is built from it, and `anchor plan` refuses what `anchor train` refuses.

- An alias bomb ("billion laughs": each level nine aliases of the one before) is refused in one short line naming
  the file, at once, by every reader of a user's YAML (train configs, data configs, policy files, overrides), as
  are a recursive alias, lists nested too deep and a file too large; YAML's merge key (`<<: *base`) still works.
- An error echoes at most an excerpt of a value, however large the value.
- YAML 1.1's booleans (yes, no, on, off, any case) are strings: every boolean key refuses them as it refuses `1`,
  from an override and from the file.
- `anchor plan` and `anchor train` refuse the configs a CPU cannot train (bf16 at ZeRO-0, flash_varlen,
  offloaded checkpoints) by one check (torchtrain.training.memory.check_device), in the same words, exit 2.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from anchor_core import yamlfile
from anchor_core.errors import InputError
from anchor_core.limits import excerpt
from tests.cli.helpers import assert_usage_error, run_cli
from torchtrain.config import KEYS, expected, load_train_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "train" / "tiny.yaml"
LINE_MAX = 300  # characters of the one error line


def bomb(levels: int) -> str:
    """A "billion laughs" document: `a0` nine strings, each `aN` nine aliases of `a(N-1)`: 9**(levels+1) strings
    once expanded, from a few hundred bytes; `model.name` the last level."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nmodel:\n  name: *a{levels}\n"


def short_line(code: int, err: str, verb: str, *needles: str) -> str:
    line = assert_usage_error(code, err, verb, *needles)
    assert len(line) <= LINE_MAX, len(line)
    return line


@pytest.mark.parametrize("verb", ["train", "plan"])
def test_an_alias_bomb_is_refused_at_once_in_one_short_line(verb, tmp_path, capsys):
    config = tmp_path / "bomb.yaml"
    config.write_text(bomb(6))
    assert len(config.read_bytes()) < 500
    argv = [verb, "--config", config] + (["--out", tmp_path / "run", "--no-progress"] if verb == "train" else [])
    t0 = time.perf_counter()
    code, _, err = run_cli(argv, capsys)
    took = time.perf_counter() - t0
    short_line(code, err, verb, f"{config}: ", "more than 10000 values once its YAML aliases (*name) are expanded")
    assert took < 5, took
    assert not (tmp_path / "run").exists()


def test_every_reader_of_a_users_yaml_refuses_the_bomb(tmp_path, capsys):
    """Data configs (`anchor pack --config`), policy files and command-line overrides read YAML as train configs
    do; nine levels are refused as fast as six."""
    from anchor_core.data.config import load_pack_config
    from jaxref.policy import load_policy

    path = tmp_path / "nine.yaml"
    path.write_text(bomb(9))
    for read in (yamlfile.read_yaml, load_pack_config, load_policy, load_train_config):
        t0 = time.perf_counter()
        with pytest.raises(InputError) as e:
            read(path)
        print(read.__name__, e.value)
        assert str(e.value).startswith(f"{path}: the document holds more than 10000 values") and len(str(e.value)) < 200
        assert time.perf_counter() - t0 < 5
    code, _, err = run_cli(["pack", "--config", path, "--out", tmp_path / "pack", "--no-progress"], capsys)
    short_line(code, err, "pack", f"{path}: the document holds more than 10000 values")
    # an override: the same bound, naming the override
    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
    override = f"model.name=[{', '.join(levels)}]"
    code, _, err = run_cli(["plan", "--config", "tiny", override], capsys)
    short_line(code, err, "plan", "command-line override model.name=[&a0 [lol", "more than 10000 values")


@pytest.mark.parametrize("text, problem", [
    ("a: &a [1, *a]\n", "a YAML alias (*name) inside the node it names"),
    ("a: &a {b: *a}\n", "a YAML alias (*name) inside the node it names"),
    ("a: " + "[" * 100 + "]" * 100 + "\n", "lists and mappings nested more than 64 deep"),
    ("a: " + "[" * 3000 + "]" * 3000 + "\n", "invalid YAML: lists and mappings nested more than 64 deep"),
    ("a: '" + "x" * (1 << 20) + "'\n", "larger than a train config can be (more than 1048576 bytes)"),
    ("a: &s '" + "x" * 200_000 + "'\nb: [*s, *s, *s, *s, *s, *s]\n",
     "more than 1048576 bytes of text once its YAML aliases (*name) are expanded"),
], ids=["recursive-list", "recursive-mapping", "deep", "deeper-than-pyyaml", "large", "aliased-text"])
def test_what_cannot_be_a_config_is_refused_in_one_short_line(text, problem, tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    code, _, err = run_cli(["plan", "--config", config], capsys)
    short_line(code, err, "plan", f"{config}: ", problem)


def test_aliases_within_the_bounds_and_merge_keys_still_work(tmp_path):
    config = tmp_path / "c.yaml"
    text = TINY.read_text()
    assert "  every: 2 " in text and "  window: 4 " in text
    config.write_text(text.replace("  every: 2 ", "  every: &two 2 ").replace("  window: 4 ", "  window: *two "))
    cfg = load_train_config(config)
    assert cfg.eval.every == cfg.eval.window == 2
    merged = tmp_path / "m.yaml"
    merged.write_text("base: &base {qk: float32, io: float32}\nmine:\n  <<: *base\n  qk: bfloat16\n")
    assert yamlfile.read_yaml(merged)["mine"] == {"qk": "bfloat16", "io": "float32"}


@pytest.mark.parametrize("name, problem", [
    ("[" + ", ".join(["x" * 100] * 3000) + "]", "model.name: expected a non-empty string"),
    ("{" + ", ".join(f"k{i}: {'v' * 100}" for i in range(3000)) + "}", "model.name: expected a non-empty string"),
    ("9" * 5000, "invalid YAML at line 4, column 9: an integer of 5000 characters"),
    ("random:llama\n  ? " + "k" * 5000 + "\n  : 1", "unknown key 'model.kkkkk"),
], ids=["long-list", "long-mapping", "huge-int", "long-key"])
def test_an_error_echoes_an_excerpt_of_the_value(name, problem, tmp_path, capsys):
    """However large the value, from the file or an override, the line stays short (the file's path, the key's
    meaning and an excerpt of the value)."""
    config = tmp_path / "c.yaml"
    config.write_text(TINY.read_text().replace("  name: random:llama", f"  name: {name}"))
    code, _, err = run_cli(["plan", "--config", config], capsys)
    line = assert_usage_error(code, err, "plan", problem)
    assert len(line) <= 400, len(line)
    code, _, err = run_cli(["plan", "--config", "tiny", f"model.name={name}"], capsys)
    line = assert_usage_error(code, err, "plan")
    assert len(line) <= 400, len(line)


@pytest.mark.parametrize("value", [["x" * 100] * 10**6, "y" * 10**7, 10**5000, {"k" * 5000: [[[[[1]]]]]}],
                         ids=["long-list", "long-string", "huge-int", "nested"])
def test_an_excerpt_is_short_and_made_at_once(value):
    t0 = time.perf_counter()
    text = excerpt(value)
    assert len(text) <= 80 and time.perf_counter() - t0 < 0.1, text
    assert excerpt([0.9, 0.95]) == "[0.9, 0.95]" and excerpt("fast") == "'fast'"


BOOL_KEYS = [k for k, f in KEYS.items() if expected(f) == "true or false"]


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "Yes", "ON", "Off", "NO"])
def test_yaml_1_1_booleans_are_refused_like_1(word, tmp_path, capsys):
    """`model.tiled_mlp=yes` is refused as `model.tiled_mlp=1` is, from an override and from the file; so is every
    boolean key, and the `data.pack` booleans; `true`/`false` (any of YAML 1.2's spellings) still read."""
    assert len(BOOL_KEYS) >= 7 and "model.tiled_mlp" in BOOL_KEYS
    from anchor_core.data.config import load_pack_config

    code, _, err = run_cli(["plan", "--config", "tiny", "model.tiled_mlp=1"], capsys)
    assert_usage_error(code, err, "plan", "model.tiled_mlp: expected true or false", "got 1")
    code, _, err = run_cli(["plan", "--config", "tiny", f"model.tiled_mlp={word}"], capsys)
    assert_usage_error(code, err, "plan", f"command-line override model.tiled_mlp={word}: model.tiled_mlp: expected "
                       "true or false", f"got '{word}'")
    config = tmp_path / "c.yaml"
    config.write_text(TINY.read_text().replace("  activation_checkpointing: false", f"  tiled_mlp: {word}"))
    code, _, err = run_cli(["train", "--config", config, "--out", tmp_path / "run", "--no-progress"], capsys)
    assert_usage_error(code, err, "train", f"{config}:", "model.tiled_mlp: expected true or false", f"got '{word}'")
    assert not (tmp_path / "run").exists()
    for key in BOOL_KEYS + ["data.pack.skip_bad"]:
        with pytest.raises(InputError, match=f"{key}: expected true or false"):
            load_train_config(TINY, [f"{key}={word}"])
    data = tmp_path / "d.yaml"  # a data config (`anchor pack --config`)
    data.write_text(f"tags: {word}\n")
    with pytest.raises(InputError, match=f"tags: expected .*, got '{word}'"):
        load_pack_config(data)
    for spelling, value in (("true", True), ("True", True), ("TRUE", True), ("false", False), ("FALSE", False)):
        assert load_train_config(TINY, [f"model.tiled_mlp={spelling}"]).model.tiled_mlp is value


CPU_REFUSALS = {
    "bf16-zero0": ["model.dtype=bfloat16"],
    "flash_varlen": ["model.engine=flash_varlen"],
    "offload": ["model.activation_checkpointing=true", "model.offload_checkpoints=true"],
}


@pytest.mark.parametrize("overrides", CPU_REFUSALS.values(), ids=CPU_REFUSALS.keys())
def test_plan_refuses_what_train_refuses_in_the_same_words(overrides, tmp_path, capsys):
    """Where `anchor train` refuses a config on this machine, `anchor plan` (for this machine) refuses it in the
    same line after the verb: the one check, torchtrain.training.memory.check_device."""
    if torch.cuda.is_available() and "model.offload_checkpoints=true" in overrides:
        pytest.skip("this machine trains on a GPU, where checkpoints may be offloaded")
    code, _, err = run_cli(["train", "--config", "tiny", "--out", tmp_path / "run", "--no-progress", *overrides],
                           capsys)
    train_line = assert_usage_error(code, err, "train")
    assert not (tmp_path / "run").exists()
    code, out, err = run_cli(["plan", "--config", "tiny", *overrides], capsys)
    plan_line = assert_usage_error(code, err, "plan")
    assert "fits" not in out  # no plan printed
    assert plan_line.removeprefix("anchor plan: error: ") == train_line.removeprefix("anchor train: error: ")
    reason = {"bf16-zero0": "model.dtype bfloat16 needs parallel.zero_stage >= 1",
              "flash_varlen": "engine 'flash_varlen'", "offload": "model.offload_checkpoints moves the checkpoints"}
    assert any(r in plan_line for r in reason.values())
