"""The audiences' installs, simulated in one environment: a module of an extra not installed is made absent
(`sys.modules[name] = None`: `import` fails with ModuleNotFoundError and `importlib.util.find_spec` answers None,
as for a package that is not there, so transformers' availability checks see it absent too).

- the base install (no oracle, DeepSpeed, GGUF, figures, evaluation, TRL): `import anchor`, the Trainer example
  with anchor_varlen trains;
- the train extra without the oracle's: `anchor train --config tiny` trains, `anchor parity` and
  `anchor.check_step` say in one line which extra to install (exit 2 for the command);
- the oracle without the train extra: `anchor train` says so in one line before it packs anything into --out;
- the pytest plugin's fixtures without the oracle: each fails its test with the same line, before any work.
The real installs, each in its own venv from the built wheel, are the install test's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from anchor_core import extras
from anchor_core.extras import EXTRAS
from torchtrain.parallel.distributed import environ_for_child

ROOT = Path(__file__).resolve().parent.parent
ORACLE = [m for m, e in EXTRAS.items() if e == "oracle"]
NOT_BASE = [m for m, e in EXTRAS.items() if e in ("oracle", "eval", "hf")] + ["deepspeed", "gguf", "matplotlib"]


def run_without(modules: list[str], code: str, cwd: Path) -> subprocess.CompletedProcess:
    head = f"import sys\nfor m in {modules!r}: sys.modules[m] = None\nsys.path.insert(0, {str(ROOT)!r})\n"
    # not the world of a run this pytest worker trained in-process: a child that inherited it would take itself
    # for a launched rank on a bound port
    return subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, cwd=cwd, timeout=600,
                          env=environ_for_child())


def test_base_install_trains_in_the_trainer_example(tmp_path):
    code = (f"sys.path.insert(0, {str(ROOT / 'examples' / 'hf_trainer')!r})\n"
            "import anchor\n"
            "from hf_trainer_anchor import build\n"
            f"result = build({str(tmp_path / 'out')!r}, steps=2, attention='anchor_varlen').train()\n"
            "print('trained', result.global_step, [m for m in ('jax', 'deepspeed', 'lm_eval') if sys.modules.get(m)])\n")
    done = run_without(NOT_BASE, code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "trained 2 []"


def test_without_the_oracle_train_trains_and_parity_names_the_extra(tmp_path):
    train = run_without(ORACLE, "from anchor.cli import main\n"
                        "main(['train', '--config', 'tiny', '--out', 'run', 'schedule.steps=2', '--no-progress'])\n", tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    parity = run_without(ORACLE, "from anchor.cli import main\nmain(['parity', '--model', 'random:llama', '--out', 'p'])\n",
                         tmp_path)
    assert parity.returncode == 2, parity.stderr[-3000:]
    lines = parity.stderr.strip().splitlines()
    assert lines == ['anchor parity: error: `anchor parity` needs the oracle extra (jax is not installed): '
                     'pip install "anchor-toolkit[oracle]"'], parity.stderr[-3000:]
    assert not (tmp_path / "p").exists()


def test_the_api_names_the_extra(tmp_path):
    done = run_without(ORACLE, "import anchor\ntry:\n    anchor.check_step\nexcept ModuleNotFoundError as e:\n"
                       "    print(e)\n", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ('anchor.check_step needs the oracle extra (jax is not installed): '
                                   'pip install "anchor-toolkit[oracle]"')


def test_without_the_train_extra_train_says_so_before_any_work(tmp_path):
    """DeepSpeed is imported only where the engine starts: the corpus would be built, tokenized and packed into
    --out before that (63 MB for `tiny`). The verb names the extra first and writes nothing."""
    done = run_without(["deepspeed"], "from anchor.cli import main\n"
                       "main(['train', '--config', 'tiny', '--out', 'run', '--no-progress'])\n", tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        'anchor train: error: `anchor train` needs the train extra (deepspeed is not installed): '
        'pip install "anchor-toolkit[train]"'], done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing is written"


def test_extras_require_names_the_first_missing_module():
    assert extras.missing_module("train") is None and extras.missing_line("oracle", "x") is None  # this venv has all
    code = ("from anchor_core import extras\n"
            "print(extras.missing_module('train'), extras.missing_module('train', 'deepspeed'), '|',\n"
            "      extras.missing_line('train', 'the thing'))\n")
    done = run_without(["gguf"], code, ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == ('gguf None | the thing needs the train extra (gguf is not installed): '
                                   'pip install "anchor-toolkit[train]"')
    with pytest.raises(ValueError, match="jax is not a module of the train extra"):
        extras.require("train", "jax")


def test_without_the_eval_extra_the_demo_says_so_before_any_work(tmp_path):
    """The demo's evaluation comes after its training: without lm-eval it would fail minutes in. The verb
    names the missing extra first and writes nothing."""
    done = run_without(["lm_eval"], "from anchor.cli import main\n"
                       "main(['demo', '--model', 'random:llama', '--out', 'd', '--no-progress'])\n", tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        'anchor demo: error: `anchor demo` needs the eval extra (lm_eval is not installed): '
        'pip install "anchor-toolkit[eval]"'], done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing is written"
