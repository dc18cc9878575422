"""Each `anchor train` key is declared once (torchtrain.config.key, docs/DESIGN.md §8), and every list of
keys (SCHEMA, the dataclass fields, to_dict, the documentation, the resumable keys, the shipped YAML,
the trainer's reads) agrees with the declarations. The checks are shown to fail on planted
inconsistencies. Also: engine names come from the core (anchor.engines) with one engine -> oracle
emulation table, and the three YAML loaders share one reader (anchor.yamlfile)."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from anchor.errors import InputError
from tests.train.conftest import ROOT
from torchtrain import config
from torchtrain.config import (NESTED, PACK_KEYS, RESUMABLE_CHANGES, ROPE_SCHEMA, SCHEMA, TrainConfig,
                               check_declarations, key, validate)

TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").rglob("*.yaml"))
REQUIRED = {"model": "random:llama", "data": "corpus", "steps": 1}


def one_place_problems(cls: type, schema: dict[str, Any], resumable: tuple[str, ...], doc: str) -> list[str]:
    """Keys found in one place and not another: the dataclass fields (minus those marked not a key), the
    schema, the resumable keys and the documentation; and fields without a check or a doc."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    keys = [name for name, f in fields.items() if f.metadata.get("key") is not False]
    problems = []
    for name in keys:
        meta = fields[name].metadata
        if name not in schema:
            problems.append(f"{name}: a field of {cls.__name__} but not in SCHEMA")
        if not (callable(meta.get("check")) and getattr(meta["check"], "expected", None)):
            problems.append(f"{name}: no check (type and range) in its declaration")
        if not meta.get("doc"):
            problems.append(f"{name}: no one-line doc in its declaration")
        if f"  {name} (" not in doc:
            problems.append(f"{name}: not in the documentation")
    for name in schema:
        if name not in keys:
            problems.append(f"{name}: in SCHEMA but not a field of {cls.__name__}")
    for name in resumable:
        if name not in keys:
            problems.append(f"{name}: resumable but not a key")
    return problems


def test_every_key_is_in_every_list():
    assert one_place_problems(TrainConfig, SCHEMA, RESUMABLE_CHANGES, TrainConfig.__doc__) == []
    check_declarations(TrainConfig)
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert list(SCHEMA) == [n for n in names if n != "source"]  # the one field that is not a key
    cfg = validate(dict(REQUIRED))
    assert list(cfg.to_dict()) == list(SCHEMA)
    required = [n for n, (_, default, _) in SCHEMA.items() if default is config.REQUIRED]
    assert required == ["model", "data", "steps"] and TrainConfig("m", "d", 3).steps == 3  # positional, in this order
    assert set(NESTED) == {"rope", "pack"}
    assert len(SCHEMA) >= 35


def test_a_key_in_one_place_only_is_caught():
    """Planted: a field added without `key(...)`, a key with no doc, a default its own check refuses, a
    SCHEMA entry with no field, a resumable name that is no key."""

    @dataclass(frozen=True)
    class PlainField(TrainConfig):
        colour: str = "red"  # added to the dataclass only

    with pytest.raises(TypeError, match="PlainField.colour is not declared with"):
        check_declarations(PlainField)
    problems = one_place_problems(PlainField, SCHEMA, RESUMABLE_CHANGES, TrainConfig.__doc__)
    assert "colour: a field of PlainField but not in SCHEMA" in problems
    assert "colour: not in the documentation" in problems

    @dataclass(frozen=True)
    class NoDoc(TrainConfig):
        colour: str = key("red", config._STR, "")

    with pytest.raises(TypeError, match="NoDoc.colour is not declared with"):
        check_declarations(NoDoc)

    @dataclass(frozen=True)
    class BadDefault(TrainConfig):
        colour: int = key(0, config._int(1), "a colour number")

    with pytest.raises(TypeError, match="BadDefault.colour: its default 0 is not accepted"):
        check_declarations(BadDefault)

    @dataclass(frozen=True)
    class NotAKey(TrainConfig):
        note: str = field(default="", kw_only=True, metadata={"key": False})

    check_declarations(NotAKey)  # marked not a key: fine

    assert one_place_problems(TrainConfig, {**SCHEMA, "colour": SCHEMA["seed"]}, RESUMABLE_CHANGES,
                              TrainConfig.__doc__) == ["colour: in SCHEMA but not a field of TrainConfig"]
    assert one_place_problems(TrainConfig, SCHEMA, (*RESUMABLE_CHANGES, "colour"), TrainConfig.__doc__) == [
        "colour: resumable but not a key"]
    undocumented = TrainConfig.__doc__.replace("  lr (", "  ")
    assert one_place_problems(TrainConfig, SCHEMA, RESUMABLE_CHANGES, undocumented) == ["lr: not in the documentation"]


def test_defaults_round_trip_through_validate():
    """Each default is a value its key accepts: a config of every default validates to the defaults."""
    defaults = TrainConfig(**REQUIRED)
    data = {k: v for k, v in defaults.to_dict().items() if v is not None}  # seq_len: omitted means None
    assert validate(data) == defaults
    for name, (check, default, doc) in SCHEMA.items():
        assert doc and "\n" not in doc and check.expected, name
        if default is not config.REQUIRED and default is not None:
            assert check(default) == default, name


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=[str(p.relative_to(ROOT / "configs" / "train"))
                                                     for p in TRAIN_CONFIGS])
def test_shipped_yaml_keys_are_declared(path):
    d = yaml.safe_load(path.read_text())
    assert set(d) <= set(SCHEMA), sorted(set(d) - set(SCHEMA))
    assert set(d.get("pack", {})) <= set(PACK_KEYS)
    assert set(d.get("rope", {})) <= set(ROPE_SCHEMA)


def test_pack_keys_are_anchor_pack_options_not_given_at_the_top_level():
    from anchor.data.config import PACK_SCHEMA

    top = [n for n, f in config._KEYS.items() if f.metadata["pack_option"]]
    assert top == ["model", "data", "seq_len", "tags", "interleave"] and set(top) <= set(PACK_SCHEMA)
    assert set(PACK_KEYS) == set(PACK_SCHEMA) - set(top)
    assert "seed" in PACK_KEYS and "seed" in SCHEMA  # pack.seed: the packing seed, defaults to the run's seed


def _cfg_reads(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cfg"}


def test_keys_the_trainer_reads_are_declared():
    """`cfg.<name>` in the torchtrain modules that take a TrainConfig: a key or a TrainConfig method."""
    files = [p for p in sorted((ROOT / "torchtrain").glob("*.py")) if "TrainConfig" in p.read_text(encoding="utf-8")]
    assert any(p.name == "trainer.py" for p in files)
    reads = set().union(*(_cfg_reads(p) for p in files))
    undeclared = sorted(n for n in reads if n not in SCHEMA and not callable(getattr(TrainConfig, n, None))
                        and n != "source")
    assert not undeclared, f"read as cfg.<name> but not declared with key(...): {undeclared}"
    assert {"lr", "seq_len", "engine", "steps"} <= reads


def test_engine_and_variant_names_come_from_the_core():
    import anchor.engines
    import anchor.variants
    import torchtrain.engines

    assert torchtrain.engines.ENGINES is anchor.engines.ENGINES and torchtrain.engines.AUTO == anchor.engines.AUTO
    assert anchor.engines.TRAIN_ENGINES == ("auto", *anchor.engines.ENGINES)
    assert "auto" not in anchor.engines.ENGINES
    accepted = [e for e in (*anchor.engines.TRAIN_ENGINES, "warp") if _accepts("engine", e)]
    assert accepted == list(anchor.engines.TRAIN_ENGINES)
    variants = anchor.variants.VARIANTS
    assert [v for v in (*variants, "causal") if _accepts("variant", v)] == list(variants)


def test_one_engine_to_emulation_table():
    from anchor.engines import ENGINES
    from parity_tests import emulations, runners, torch_audit

    assert tuple(emulations.EMULATIONS) == ENGINES
    assert runners.EMULATIONS is emulations.EMULATIONS and torch_audit.ORACLE_POLICY is emulations.EMULATIONS
    assert all(runners.RUNNERS[e].emulation == emulations.EMULATIONS[e] for e in ENGINES)
    assert tuple(emulations.CUDA_EMULATIONS) == ENGINES


def test_engines_on_cuda_are_held_against_the_kernels_they_run_there(monkeypatch):
    """On CUDA torch's varlen_attn (FlashAttention-2) and CUDA SDPA run where the CPU runs its fused
    kernel: the parity runners and the torch-stack audit hold them against fa2_bf16 there, and against
    the CPU kernel's emulation on the CPU; an emulation given to a runner stays whatever the device."""
    from anchor.engines import ENGINES
    from parity_tests import runners, torch_audit

    on_cpu = {e: runners.RUNNERS[e].emulation for e in ENGINES}
    monkeypatch.setattr(runners, "_DEVICE", ["cuda"])
    on_cuda = {e: runners.RUNNERS[e].emulation for e in ENGINES}
    assert on_cpu["varlen"] == on_cpu["sdpa"] == "sdpa_cpu_bf16"
    assert on_cuda["varlen"] == on_cuda["sdpa"] == "fa2_bf16"
    assert {e: p for e, p in on_cuda.items() if e not in ("varlen", "sdpa")} == \
        {e: p for e, p in on_cpu.items() if e not in ("varlen", "sdpa")}
    assert runners.TorchRunner("varlen", name="x", emulation="hf_bf16").emulation == "hf_bf16"
    assert [torch_audit.oracle_policy("varlen", "bfloat16", d) for d in ("cpu", "cuda")] == ["sdpa_cpu_bf16", "fa2_bf16"]
    assert torch_audit.oracle_policy("varlen", "float32", "cuda") == "fp32"


def _accepts(name: str, value: Any) -> bool:
    try:
        validate({**REQUIRED, name: value})
    except InputError:
        return False
    return True


# (file bytes, words of the one-line error every loader gives)
BAD_YAML = [
    (None, ["cannot read", "No such file"]),
    (b"model: \xff\xfe\n", ["not UTF-8 text (invalid byte at offset 7)"]),
    (b"model: [unclosed\n", ["invalid YAML at line 2, column 1:", "expected ',' or ']'"]),
    (b"- 1\n- 2\n", ["must be a mapping of keys to values, got list"]),
]


@pytest.mark.parametrize("content,words", BAD_YAML, ids=["missing", "not-utf8", "malformed", "list"])
def test_one_yaml_reader_for_train_data_and_policy_files(tmp_path, content, words):
    from anchor.data.config import load_pack_config
    from jaxref.policy import load_policy
    from torchtrain.config import load_train_config

    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_bytes(content)
    messages = []
    for load in (load_train_config, load_pack_config, load_policy):
        with pytest.raises(InputError) as e:
            load(path)
        messages.append(str(e.value))
    print(*messages, sep="\n")
    for m in messages:
        assert m.startswith(f"{path}: ") and "\n" not in m
        assert all(w in m for w in words), m
    assert [m.replace("train config", "X").replace("data config", "X").replace("policy file", "X")
            for m in messages] == [messages[0].replace("train config", "X")] * 3  # the same message, but the kind
