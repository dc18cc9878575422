"""Bad models and policies through the CLI: one line on stderr, exit 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from anchor.cli import main
from anchor_core.paths import default_model_path
from anchor_core.spec import random_preset
from anchor_core.export import write_model
from anchor_core.weights import random_state


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    print(err)
    assert code == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("anchor demo: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0]


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    spec = random_preset("llama")
    return write_model(spec, random_state(spec), tmp_path / "model")


def demo(model: str, out: Path, *extra: str) -> list[str]:
    return ["demo", "--jobs", "top5", "--model", model, "--out", str(out), *extra]


def test_missing_weight_file(tmp_path, capsys):
    code, err = run_cli(demo(str(tmp_path / "nope.gguf"), tmp_path / "out"), capsys)
    assert_one_line_error(code, err, "nope.gguf", "no such model")
    assert not (tmp_path / "out").exists()


def test_truncated_gguf(tmp_path, capsys):
    bad = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    code, err = run_cli(demo(str(bad), tmp_path / "out"), capsys)
    assert_one_line_error(code, err, "cut.gguf", "truncated or corrupt")
    assert not (tmp_path / "out").exists()


def test_truncated_safetensors(hf_dir, tmp_path, capsys):
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, err = run_cli(demo(str(hf_dir), tmp_path / "out"), capsys)
    assert_one_line_error(code, err, "model.safetensors", "truncated")


def test_missing_safetensors(hf_dir, tmp_path, capsys):
    (hf_dir / "model.safetensors").unlink()
    code, err = run_cli(demo(str(hf_dir), tmp_path / "out"), capsys)
    assert_one_line_error(code, err, "no *.safetensors")


def test_config_weight_shape_mismatch(hf_dir, tmp_path, capsys):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["intermediate_size"] += 2
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(demo(str(hf_dir), tmp_path / "out"), capsys)
    assert_one_line_error(code, err, "shape mismatch", "mlp")


def test_unsupported_architecture(hf_dir, tmp_path, capsys):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(demo(str(hf_dir), tmp_path / "out"), capsys)
    assert_one_line_error(code, err, "unsupported architecture 'gpt2'", "config.json")


def test_unknown_policy_stage(tmp_path, capsys):
    pol = tmp_path / "pol.yaml"
    pol.write_text("base: hf_bf16\nqk_accumulator: float32\n")
    code, err = run_cli(demo("random:llama", tmp_path / "out", "--policy", str(pol)), capsys)
    assert_one_line_error(code, err, "pol.yaml", "qk_accumulator")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # minutes of CPU: make test-all
def test_console_script_exit_code(tmp_path):
    """The installed `anchor` script itself: exit 2 and a single line, no traceback."""
    exe = Path(sys.executable).parent / "anchor"
    r = subprocess.run([str(exe), *demo(str(tmp_path / "nope"), tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "no such model" in r.stderr


def test_demo_top5_on_a_random_preset(tmp_path, capsys):
    """The demo's first step end to end on a tiny model: the oracle and transformers agree."""
    with pytest.raises(SystemExit) as e:
        main(demo("random:llama", tmp_path / "out"))
    assert e.value.code == 0
    result = json.loads((tmp_path / "out" / "top5" / "top5.json").read_text())
    print(result["oracle"], result["transformers"])
    assert result["same_top5"]
    assert result["max_prob_diff_top5"] < 1e-5
    assert (tmp_path / "out" / "index.html").is_file()
    assert not list(tmp_path.glob(".out.tmp-*"))
