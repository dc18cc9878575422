"""A train config's keys and where they came from: a key given twice (twice in the YAML file, or by two
command-line overrides) is refused in one line naming it, both values and where each came from; an error
names the full dotted key and the source of its value (the override, or the file and the key's line), each
key's own where an error is about several; a hint names the dotted key a user types."""

from __future__ import annotations

from pathlib import Path

import pytest

from anchor.cli import main
from anchor_core.errors import InputError
from anchor_core import yamlfile
from torchtrain.config import check_world, load_train_config
from tests.cli.helpers import assert_usage_error

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny.yaml"

CONFIG = """\
model:
  name: random:llama
data:
  path: corpus
  seq_len: 64
  global_batch: 6
optim:
  lr: 1.0e-3
schedule:
  steps: 2
"""


def train(config: Path, out: Path, *overrides: str, capsys) -> tuple[int, str]:
    """`anchor train --config CONFIG OVERRIDES` in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(config), "--out", str(out), "--no-progress", *overrides])
    err = capsys.readouterr().err
    print("exit", e.value.code, "stderr:", err)
    return e.value.code, err


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_a_key_twice_in_the_yaml_file_is_refused_naming_both_lines(tmp_path, capsys):
    config = write(tmp_path, CONFIG.replace("  lr: 1.0e-3\n", "  lr: 1.0e-3\n  eps: 1.0e-8\n  lr: 2.0e-5\n"))
    code, err = train(config, tmp_path / "run", capsys=capsys)
    assert_usage_error(code, err, "train", f"{config}: optim.lr is given twice: 1.0e-3 (line 8) and 2.0e-5 (line 10)")
    assert not (tmp_path / "run").exists()


def test_a_key_twice_in_any_yaml_the_project_reads_is_refused(tmp_path):
    """The one YAML reader (anchor_core.yamlfile) refuses it: policy files and data configs too; a merge key
    (`<<: *base`, YAML's own override) is not a repeat."""
    path = tmp_path / "policy.yaml"
    path.write_text("base: &base\n  qk: float32\nmine:\n  <<: *base\n  qk: bfloat16\n  io: bfloat16\n  io: float32\n")
    with pytest.raises(InputError) as e:
        yamlfile.read_yaml(path)
    print(e.value)
    assert str(e.value) == f"{path}: mine.io is given twice: bfloat16 (line 6) and float32 (line 7); give each key once"
    path.write_text("base: &base\n  qk: float32\nmine:\n  <<: *base\n  qk: bfloat16\n")
    data, lines = yamlfile.read_yaml_lines(path)
    assert data["mine"] == {"qk": "bfloat16"} and lines == {"base": 1, "base.qk": 2, "mine": 3, "mine.qk": 5}


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=1e-5", "optim.lr=2e-5"],
     "optim.lr is given twice: 1e-5 (command-line override optim.lr=1e-5) and 2e-5 (command-line override "
     "optim.lr=2e-5)"),
    (["optim={lr: 1e-5}", "optim.lr=2e-5"],
     "optim.lr is given twice: 1e-5 (command-line override optim={lr: 1e-5}) and 2e-5 (command-line override "
     "optim.lr=2e-5)"),
    (["data.pack.budget=100", "data.pack=null"],
     "data.pack is given twice: 100 (command-line override data.pack.budget=100) and null (command-line override "
     "data.pack=null)"),
], ids=["same-key", "mapping-then-key", "key-then-its-mapping"])
def test_a_key_two_overrides_set_is_refused_naming_both(tmp_path, capsys, overrides, message):
    code, err = train(TINY, tmp_path / "run", *overrides, capsys=capsys)
    assert_usage_error(code, err, "train", message)
    # overrides of different keys of one mapping are not repeats
    cfg = load_train_config(TINY, ["optim={betas: [0.8, 0.9]}", "optim.lr=1e-5", "data.pack.budget=100"])
    assert cfg.optim.betas == (0.8, 0.9) and cfg.optim.lr == 1e-5 and cfg.data.pack["budget"] == 100


def test_a_bad_value_in_the_file_names_the_file_its_line_and_the_dotted_key(tmp_path, capsys):
    config = write(tmp_path, CONFIG.replace("lr: 1.0e-3", "lr: fast"))
    code, err = train(config, tmp_path / "run", capsys=capsys)
    assert_usage_error(code, err, "train", f"{config}:8: optim.lr: expected a number > 0", "got 'fast'")


def test_a_bad_value_from_an_override_names_the_override_not_the_file(tmp_path, capsys):
    config = write(tmp_path, CONFIG)
    code, err = train(config, tmp_path / "run", "data.pack.skip_bad=maybe", capsys=capsys)
    line = assert_usage_error(code, err, "train", "command-line override data.pack.skip_bad=maybe: "
                              "data.pack.skip_bad: expected true or false")
    assert str(config) not in line


@pytest.mark.parametrize("overrides, where", [
    # across keys: the override and the file line of the other key
    (["data.micro_batch=4"], "{config}:6 (data.global_batch) and command-line override data.micro_batch=4: "
                             "data.global_batch 6 is not a multiple of data.micro_batch 4"),
    # a RoPE the override makes: the override, not the file that gives no RoPE
    (["model.rope.scaling=yarn"], "command-line override model.rope.scaling=yarn: model.rope: "),
], ids=["batch", "rope"])
def test_an_error_across_keys_names_where_each_came_from(tmp_path, capsys, overrides, where):
    config = write(tmp_path, CONFIG)
    code, err = train(config, tmp_path / "run", *overrides, capsys=capsys)
    assert_usage_error(code, err, "train", where.format(config=config))


def test_a_world_that_does_not_fit_names_the_override_that_asked_for_it(tmp_path):
    config = write(tmp_path, CONFIG + "parallel:\n  nproc: 1\n")
    cfg = load_train_config(config, ["parallel.sequence_parallel=2"])
    with pytest.raises(InputError) as e:
        check_world(cfg, 1)
    print(e.value)
    assert str(e.value).startswith(f"command-line override parallel.sequence_parallel=2 and {config}:12 "
                                   "(parallel.nproc): parallel.sequence_parallel 2 needs at least 2 processes")
    assert cfg.where("optim.lr") == f"{config}:8" and cfg.where("optim.eps") == str(config)  # a default: the file


def test_the_skip_bad_hint_names_the_dotted_key(tmp_path, capsys):
    """A bad record in a corpus packed on the fly: the hint names data.pack.skip_bad and data.pack.text_field,
    the keys a train config (or an override) gives, and the config takes data.pack.skip_bad=true as said."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "one two three"}\n{"text": 5}\n{"text": "four five six"}\n')
    config = write(tmp_path, CONFIG.replace("path: corpus", f"path: {corpus}"))
    code, err = train(config, tmp_path / "run", capsys=capsys)
    assert_usage_error(code, err, "train", f"{corpus}:2: text field 'text' is not a string (int) "
                                           "(set data.pack.text_field, or data.pack.skip_bad: true)")
    cfg = load_train_config(config, ["data.pack.skip_bad=true"])
    assert cfg.data.pack == {"skip_bad": True}
