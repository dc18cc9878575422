"""jaxref.policy: presets, YAML form, with_stages and the one-line errors."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import pytest
import yaml

from anchor_core.errors import InputError
from jaxref.policy import ONE_BLOCK, PRESETS, STAGES, DtypePolicy, get_policy, parse_policies

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policies"

# docs/DESIGN.md §4, stage by stage: (hf_bf16, fa2_bf16, paper_bf16).
EXPECTED = {
    "param": ("bfloat16",) * 3,
    "act": ("bfloat16",) * 3,
    "norm": ("float32",) * 3,
    "rope_angle": ("float32",) * 3,
    "rope_table": ("bfloat16", "bfloat16", "float32"),
    "rope_apply": ("bfloat16", "bfloat16", "float32"),
    "qk_in": ("bfloat16",) * 3,
    "qk_acc": ("float32",) * 3,
    "logits": ("bfloat16", "float32", "float32"),
    "softmax": ("float32",) * 3,
    "pv_in": ("bfloat16",) * 3,
    "pv_acc": ("float32",) * 3,
    "head": ("bfloat16",) * 3,
}


def test_stage_order_is_the_contract_order() -> None:
    assert STAGES == tuple(EXPECTED)
    fields = [f.name for f in DtypePolicy.__dataclass_fields__.values()]
    assert fields[: len(STAGES)] == list(STAGES)


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if not p.fp8])  # FP8's: tests/jaxref/test_fp8.py
def test_presets_have_every_stage(name: str) -> None:
    policy = PRESETS[name]
    print(f"\n{name}: {policy.to_dict()}")
    assert policy.name == name
    for stage in STAGES:
        assert policy.dtype(stage) == jnp.dtype(getattr(policy, stage))
    if name in ("fp64", "fp32"):
        assert {getattr(policy, s) for s in STAGES} == {"float64" if name == "fp64" else "float32"}
        assert policy.attention == "dense"
    else:
        # torch's CPU SDPA and the one-pass varlen emulation have fa2_bf16's stages, other key blocks
        cpu_kernel = name.startswith("sdpa_cpu_bf16_")  # one preset per capability of torch's CPU kernels
        same_stages = "fa2_bf16" if cpu_kernel or name in ("fa2_bf16_1pass", "flex_bf16") else name
        column = ("hf_bf16", "fa2_bf16", "paper_bf16").index(same_stages)
        assert {s: getattr(policy, s) for s in STAGES} == {s: v[column] for s, v in EXPECTED.items()}
        assert policy.attention == ("dense" if name == "hf_bf16" else "online")
        assert policy.kv_block == (512 if cpu_kernel else {"fa2_bf16_1pass": ONE_BLOCK}.get(name, 128))
    # the kernels whose backward is written out (jaxref.attention.kernel_backward); the rest differentiate
    # their forward (fa2_bf16_1pass emulates torchtrain's pure-torch varlen, itself differentiated by autograd)
    assert policy.backward == ("cpu" if name.startswith("sdpa_cpu_bf16_") else
                               {"fa2_bf16": "fa2", "paper_bf16": "fa2", "flex_bf16": "flex"}.get(name, "autodiff"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_yaml_round_trip(name: str, tmp_path: Path) -> None:
    policy = PRESETS[name].with_stages(softmax="float64")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(policy.to_dict()))
    assert get_policy(path) == policy
    assert get_policy(str(path)) == policy
    assert get_policy(policy.to_dict()) == policy


def test_with_stages_records_the_change() -> None:
    p = PRESETS["hf_bf16"].with_stages(softmax="fp64", rope_apply=jnp.float32)
    assert p.name == "hf_bf16[softmax=float64,rope_apply=float32]"
    assert p.softmax == "float64" and p.rope_apply == "float32" and p.dtype("softmax") == jnp.float64
    assert PRESETS["hf_bf16"].softmax == "float32"  # the preset is untouched
    assert p.with_stages() is p


def test_mapping_with_base_and_extras() -> None:
    p = get_policy({"base": "fa2_bf16", "rope_apply": "float32", "kv_block": 32})
    assert p.name == "fa2_bf16[rope_apply=float32]" and p.kv_block == 32 and p.attention == "online"
    q = get_policy({**PRESETS["fp32"].to_dict(), "name": "mine", "attention": "online"})
    assert q.name == "mine" and q.attention == "online" and q.logits == "float32"


@pytest.mark.parametrize("path", sorted(POLICY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_example_policy_files(path: Path) -> None:
    policy = get_policy(path)
    print(f"\n{path.name}: {policy.to_dict()}")
    raw = yaml.safe_load(path.read_text())
    assert policy.name == raw.get("name", path.stem)
    for stage in STAGES:
        expected = raw.get(stage, getattr(PRESETS[raw["base"]], stage))
        assert getattr(policy, stage) == expected
    for line in path.read_text().splitlines():  # every key carries a comment
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line, f"{path.name}: key without a comment: {line!r}"


def test_example_policy_dir_has_examples() -> None:
    assert len(list(POLICY_DIR.glob("*.yaml"))) >= 2


def test_parse_policies() -> None:
    ps = parse_policies("fp32, hf_bf16,paper_bf16")
    assert [p.name for p in ps] == ["fp32", "hf_bf16", "paper_bf16"]
    with pytest.raises(InputError, match="no policy given"):
        parse_policies(" , ")


def _error(x: object) -> str:
    with pytest.raises(InputError) as info:
        get_policy(x)  # type: ignore[arg-type]
    message = str(info.value)
    print(f"\n{message}")
    assert "\n" not in message
    return message


def test_unknown_preset() -> None:
    message = _error("bf16_fast")
    assert "bf16_fast" in message and all(name in message for name in PRESETS)


def test_unknown_stage_in_file(tmp_path: Path) -> None:
    path = tmp_path / "bad_stage.yaml"
    path.write_text("base: hf_bf16\nsoftmx: float32\n")
    message = _error(path)
    assert str(path) in message and "softmx" in message and "softmax" in message


def test_unknown_dtype_in_file(tmp_path: Path) -> None:
    path = tmp_path / "bad_dtype.yaml"
    path.write_text("base: hf_bf16\nsoftmax: float8\n")
    message = _error(path)
    assert str(path) in message and "float8" in message and "bfloat16" in message


def test_unknown_base_in_file(tmp_path: Path) -> None:
    path = tmp_path / "bad_base.yaml"
    path.write_text("base: hf_fp8\n")
    message = _error(path)
    assert str(path) in message and "hf_fp8" in message and "paper_bf16" in message


@pytest.mark.parametrize("text", ["base: [hf_bf16\n", "- hf_bf16\n", "base: hf_bf16\nkv_block: 0\n",
                                  "base: hf_bf16\nattention: sparse\n", "softmax: float32\n"])
def test_bad_yaml_names_the_file(text: str, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert str(path) in _error(path)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    assert str(path) in _error(str(path))


def test_bad_values_in_code() -> None:
    with pytest.raises(InputError, match="unknown policy stage"):
        PRESETS["fp32"].with_stages(softmx="float64")
    with pytest.raises(InputError, match="unknown dtype"):
        PRESETS["fp32"].with_stages(softmax="int8")
    with pytest.raises(InputError, match="unknown policy stage"):
        PRESETS["fp32"].dtype("rope")
    with pytest.raises(InputError, match="unknown dtype 'None'"):  # an empty YAML value
        get_policy({"base": "fp32", "softmax": None})
