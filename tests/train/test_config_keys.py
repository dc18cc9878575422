"""Each `anchor train` key is declared once (a field of a section model of torchtrain.config, docs/DESIGN.md §8),
and every list of keys (KEYS, the documentation, the resumable keys, to_dict, the shipped YAML, the trainer's
reads) agrees with the declarations. The checks are shown to fail on planted
inconsistencies. Also: engine names come from the core (anchor_core.engines) with one engine -> oracle
emulation table, and the three YAML loaders share one reader (anchor_core.yamlfile)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import Field, StrictInt

from anchor_core.errors import InputError
from tests.train.conftest import ROOT
from torchtrain import config
from torchtrain.config import (KEYS, NESTED, PACK_KEYS, PACK_OPTIONS, RESUMABLE_CHANGES, SECTIONS, TrainConfig,
                               check_declarations, validate)

TRAIN_CONFIGS = sorted((ROOT / "configs" / "train").rglob("*.yaml"))
REQUIRED = {"model": {"name": "random:llama"}, "data": {"path": "corpus"}, "schedule": {"steps": 1}}


def one_place_problems(cls: type, keys: dict[str, Any], resumable: tuple[str, ...], doc: str) -> list[str]:
    """Keys found in one place and not another: the section fields, KEYS, the resumable keys and the
    documentation."""
    fields = [f"{s}.{k}" for s, f in cls.model_fields.items() for k in f.annotation.model_fields]
    problems = []
    for name in fields:
        if name not in keys:
            problems.append(f"{name}: a field of {cls.__name__} but not in KEYS")
        if f"  {name} (" not in doc:
            problems.append(f"{name}: not in the documentation")
    for name in keys:
        if name not in fields:
            problems.append(f"{name}: in KEYS but not a field of {cls.__name__}")
    for name in resumable:
        if name not in fields:
            problems.append(f"{name}: resumable but not a key")
    return problems


def test_every_key_is_in_every_list():
    assert one_place_problems(TrainConfig, KEYS, RESUMABLE_CHANGES, TrainConfig.__doc__) == []
    check_declarations(TrainConfig)
    cfg = validate(REQUIRED)
    dumped = cfg.to_dict()
    assert [f"{s}.{k}" for s in dumped for k in dumped[s]] == list(KEYS)
    required = [n for n, f in KEYS.items() if f.is_required()]
    assert required == ["model.name", "data.path", "schedule.steps"]
    # `deepspeed:` is open: DeepSpeed's own keys, none declared here (torchtrain.config.deepspeed_json checks them)
    assert list(SECTIONS) == ["model", "data", "optim", "schedule", "parallel", "checkpoint", "logging", "eval",
                              "deepspeed"]
    assert not SECTIONS["deepspeed"].model_fields and dumped["deepspeed"] == {}
    assert set(NESTED) == {"model.rope", "data.pack"} and set(NESTED) <= set(KEYS)
    assert len(KEYS) == 51
    assert set(RESUMABLE_CHANGES) == {"schedule.steps", "parallel.nproc", "parallel.timeout_s", "parallel.sequence_parallel",
                                      "parallel.context_parallel",
                                      "eval.heldout_buckets", "logging.report_to", "checkpoint.save_every",
                                      "checkpoint.keep_last", "checkpoint.max_shard_size", "checkpoint.export_dtype",
                                      "logging.every", "logging.tensorboard", "logging.dump_grads"}


def test_a_key_in_one_place_only_is_caught():
    """Planted: a field without a description, a section that is not a model, a KEYS entry with no field,
    a resumable name that is no key, an undocumented key."""

    class NoDoc(config.OptimConfig):
        colour: StrictInt = Field(1)

    class Planted(TrainConfig):
        optim: NoDoc = NoDoc()

    with pytest.raises(TypeError, match="NoDoc.colour: its description must be one line"):
        check_declarations(Planted)
    problems = one_place_problems(Planted, KEYS, RESUMABLE_CHANGES, TrainConfig.__doc__)
    assert problems == ["optim.colour: a field of Planted but not in KEYS", "optim.colour: not in the documentation"]

    class NotAKey(config.OptimConfig):
        colour: StrictInt = Field(1, description="a colour number")

    class Planted2(TrainConfig):
        optim: NotAKey = NotAKey()

    with pytest.raises(TypeError, match="NotAKey.colour is not declared with"):
        check_declarations(Planted2)

    class NotASection(TrainConfig):
        colour: int = 1

    with pytest.raises(TypeError, match="NotASection.colour is not a section"):
        check_declarations(NotASection)

    assert one_place_problems(TrainConfig, {**KEYS, "optim.colour": KEYS["optim.lr"]}, RESUMABLE_CHANGES,
                              TrainConfig.__doc__) == ["optim.colour: in KEYS but not a field of TrainConfig"]
    assert one_place_problems(TrainConfig, KEYS, (*RESUMABLE_CHANGES, "optim.colour"), TrainConfig.__doc__) == [
        "optim.colour: resumable but not a key"]
    undocumented = TrainConfig.__doc__.replace("  optim.lr (", "  ")
    assert one_place_problems(TrainConfig, KEYS, RESUMABLE_CHANGES, undocumented) == [
        "optim.lr: not in the documentation"]


def test_defaults_round_trip_through_validate():
    """Each default is a value its key accepts: a config of every default validates to the defaults."""
    defaults = validate(REQUIRED)
    data = defaults.to_dict()
    data["data"].pop("seq_len")  # omitted means None
    assert validate(data) == defaults
    for name, f in KEYS.items():
        assert f.description and "\n" not in f.description and config.expected(f), name


def test_an_empty_section_takes_its_defaults():
    """`optim:` with every key left out (None in YAML) is the section's defaults; an empty `model:` still
    misses its required key, named by its dotted path."""
    assert validate({**REQUIRED, "optim": None}).optim == config.OptimConfig()
    with pytest.raises(InputError, match="missing required key 'model.name'"):
        validate({**REQUIRED, "model": None})


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=[str(p.relative_to(ROOT / "configs" / "train"))
                                                     for p in TRAIN_CONFIGS])
def test_shipped_yaml_keys_are_declared(path):
    d = yaml.safe_load(path.read_text())
    assert set(d) <= set(SECTIONS), sorted(set(d) - set(SECTIONS))
    keys = {f"{s}.{k}" for s, section in d.items() for k in section}
    assert keys <= set(KEYS), sorted(keys - set(KEYS))
    assert set(d.get("data", {}).get("pack", {})) <= set(PACK_KEYS)
    assert set(d.get("model", {}).get("rope", {})) <= set(config.RopeConfig.model_fields)


def test_pack_keys_are_anchor_pack_options_not_given_as_keys_of_their_own():
    from anchor_core.data.config import PACK_SCHEMA

    assert PACK_OPTIONS == {"model": "model.name", "data": "data.path", "seq_len": "data.seq_len",
                            "tags": "data.tags", "interleave": "data.interleave"}
    assert set(PACK_OPTIONS) <= set(PACK_SCHEMA) and set(PACK_KEYS) == set(PACK_SCHEMA) - set(PACK_OPTIONS)
    assert "seed" in PACK_KEYS and "data.seed" in KEYS  # data.pack.seed: the packing seed, defaults to data.seed


def _cfg_reads(path: Path) -> set[str]:
    """`cfg.<a>` and `cfg.<a>.<b>` read in a file, dotted (`self.cfg` too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    reads = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(base, ast.Attribute) and _is_cfg(base.value):
            reads.add(f"{base.attr}.{node.attr}")
        elif _is_cfg(base):
            reads.add(node.attr)
    return reads


def _is_cfg(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "cfg") or (
        isinstance(node, ast.Attribute) and node.attr == "cfg" and isinstance(node.value, ast.Name))


def test_keys_the_trainer_reads_are_declared():
    """`cfg.<section>.<key>` in the torchtrain modules that take a TrainConfig: a key; `cfg.<name>`: a section
    or a TrainConfig method."""
    files = [p for p in sorted((ROOT / "torchtrain").rglob("*.py"))
             if "TrainConfig" in p.read_text(encoding="utf-8") and "config" not in p.relative_to(ROOT).parts[1:-1]]
    assert any(p.name == "trainer.py" for p in files)
    reads = set().union(*(_cfg_reads(p) for p in files))
    undeclared = sorted(n for n in reads if ("." in n and n.split(".")[0] in SECTIONS and n not in KEYS) or (
        "." not in n and n not in SECTIONS and not hasattr(TrainConfig, n)))
    assert not undeclared, f"read as cfg.<name> but not declared: {undeclared}"
    assert {"optim.lr", "data.seq_len", "model.engine", "schedule.steps"} <= reads


def test_engine_and_variant_names_come_from_the_core():
    import anchor_core.engines
    import anchor_core.variants
    import torchtrain.attention.engines

    assert torchtrain.attention.engines.ENGINES is anchor_core.engines.ENGINES and torchtrain.attention.engines.AUTO == anchor_core.engines.AUTO
    assert anchor_core.engines.TRAIN_ENGINES == ("auto", *anchor_core.engines.ENGINES)
    assert "auto" not in anchor_core.engines.ENGINES
    accepted = [e for e in (*anchor_core.engines.TRAIN_ENGINES, "warp") if _accepts("model", "engine", e)]
    assert accepted == list(anchor_core.engines.TRAIN_ENGINES)
    variants = anchor_core.variants.VARIANTS
    assert [v for v in (*variants, "causal") if _accepts("model", "variant", v)] == list(variants)


def test_one_engine_to_emulation_table():
    from anchor_core.engines import ENGINES
    from parity_tests import emulations, runners
    from parity_tests.audit import torch_stack as torch_audit

    assert tuple(emulations.EMULATIONS) == ENGINES
    assert runners.EMULATIONS is emulations.EMULATIONS and torch_audit.ORACLE_POLICY is emulations.EMULATIONS
    assert all(runners.RUNNERS[e].emulation == emulations.EMULATIONS[e] for e in ENGINES)
    assert tuple(emulations.CUDA_EMULATIONS) == ENGINES


def test_engines_on_cuda_are_held_against_the_kernels_they_run_there(monkeypatch):
    """On CUDA torch's varlen_attn (FlashAttention-2) and CUDA SDPA run where the CPU runs its fused
    kernel: the parity runners and the torch-stack audit hold them against fa2_bf16 there, and against
    the CPU kernel's emulation on the CPU; an emulation given to a runner stays whatever the device."""
    from anchor_core.engines import ENGINES
    from parity_tests import runners
    from parity_tests.audit import torch_stack as torch_audit

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


def _accepts(section: str, name: str, value: Any) -> bool:
    try:
        validate({**REQUIRED, section: {**REQUIRED.get(section, {}), name: value}})
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
    from anchor_core.data.config import load_pack_config
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
