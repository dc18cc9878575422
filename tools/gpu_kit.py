"""Take what the project needs to a GPU machine without network: wheels, the model, held-out documents.

Such a machine cannot download, so everything it runs is copied to it from a machine with network (here),
beside a checkout of this repository; where each copy is limited in size (an upload form, a job system's
input), the large files go in parts. Speed does not depend on weight values, so the benchmark there can run
without the weights file at all: on random weights of SmolLM2's exact shape, with its real tokenizer (the
corpus windows are packed with it, so their document lengths are the real ones):

    here:   python tools/gpu_kit.py pack --model default --out .devkit/smollm2
            (config.json and the tokenizer files, no weights)
    there:  python3 tools/gpu_kit.py weights .devkit/smollm2
            (model.safetensors: random weights of config.json's shapes, seed 0)

Then `anchor bench --model .devkit/smollm2 ...` runs there as here.

The real weights (parity and the paper-gpu profile need them) can go in parts, one part per copy, and are
joined there only when every part and the whole file hash as they did here:

    here:   python tools/gpu_kit.py split .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --out .devkit/parts
            (parts of at most --part-mib MiB and manifest.json: name, bytes, sha256 of the whole and of
            each part)
    there:  python3 tools/gpu_kit.py join .devkit/parts --stash /tmp/anchor-parts --into .cache/models
            after each copy of `.devkit/parts/manifest.json` and the next part: each part is checked and
            kept in the stash; when all are there, the file is joined beside its target, its sha256 checked
            against the manifest, and renamed into place (never a partial file under the name).

Everything the GPU machine needs, in one command here (`make gpu-kit`, under a minute; the GPU machine's
time goes to the checks, not to building wheels):

    here:   python tools/gpu_kit.py kit [--transfer-mib N]
            .whl/        the wheels the GPU image lacks or holds at another version (WHEELS), at the
                         versions of this venv, for the image's Python (3.12, manylinux x86_64);
                         deepspeed built here (PyPI has its source only; pure Python, no ops compiled)
            .devkit/parts/            the GGUF in two parts (copies 2 and 3 left the same room) and manifest.json
            .devkit/heldout.jsonl     held-out long documents (the image's Python has no test suite)
            .devkit/attn_grad_inputs.npz   experiments/attn_grad_diag's captured inputs (only with
                                      --attention-inputs)
            .devkit/kit.json          each file's bytes and sha256, what each copy holds, and the command
                                      to run there after it
            and checks that each copy of tools/gpu_parity.sh's plan (CALLS), with the working tree, fits
            --transfer-mib MiB (TRANSFER_MIB by default); one that does not is an error naming the copy.

The parity parts that came back from the GPU machine, kept for its next run (`anchor parity --keep-parts`:
each part's key holds the code, versions and GPU, so only cases computed by the same code are taken there):

    here:   python tools/gpu_kit.py keep R     (R: what came back, gpu_parity.sh's OUT)
            -> results/gpu/parity/parts_<gpu>.tgz, tracked: it travels with the tree
    there:  gpu_parity.sh OUT seed (the plan's first step): the GPU's archive unpacked into OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
sys.path.insert(0, str(ROOT))

from anchor_core.atomic import sha256_file  # noqa: E402
from anchor_core.errors import InputError  # noqa: E402

NOTE = "random weights of this config's shapes (tools/gpu_kit.py): for timing only"


def pack(model: str, out: Path) -> None:
    from anchor_core.export import write_tokenizer
    from anchor_core.spec import to_hf_config
    from anchor_core.weights import load_spec

    spec = load_spec(model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_hf_config(spec), indent=2))
    write_tokenizer(model, spec, out)
    (out / "WEIGHTS.txt").write_text(f"{NOTE}; shape and tokenizer of {model}\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.1f} MiB, no weights)")


def weights(folder: Path, seed: int) -> None:
    from anchor_core.export import write_model
    from anchor_core.weights import random_state, read_hf_config

    spec = read_hf_config(folder)
    write_model(spec, random_state(spec, seed), folder)
    print(f"wrote {folder / 'model.safetensors'} ({NOTE}, seed {seed})")


def split(src: Path, out: Path, part_mib: float, first_mib: float | None = None) -> dict:
    """`src` as parts of at most `part_mib` MiB in `out` (the first of `first_mib` where given), with
    manifest.json (any earlier split's parts removed); returns the manifest."""
    if not src.is_file():
        raise InputError("no such file", path=src)
    size, first = int(part_mib * 2**20), int((first_mib or part_mib) * 2**20)
    if size < 1 or first < 1:
        raise InputError(f"--part-mib and --first-mib must be positive, got {part_mib} and {first_mib}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{src.name}.part-*"):
        old.unlink()
    parts = []
    with open(src, "rb") as f:
        k = 0
        while k == 0 or f.tell() < src.stat().st_size:
            name = f"{src.name}.part-{k:03d}"
            (out / name).write_bytes(f.read(first if k == 0 else size))
            parts.append({"file": name, "bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)})
            k += 1
    manifest = {"name": src.name, "bytes": src.stat().st_size, "sha256": sha256_file(src), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    sizes = ", ".join(f"{p['bytes'] / 2**20:.1f}" for p in parts)
    print(f"{src.name}: {len(parts)} parts ({sizes} MiB) in {out}, sha256 {manifest['sha256']}")
    return manifest


def join(parts_dir: Path, stash: Path, into: Path) -> Path | None:
    """Take the parts present in `parts_dir` into `stash` (each checked against the manifest); when the stash
    holds them all, the joined file `into/<name>`, checked, atomically. Returns its path, or None while
    parts are missing."""
    import os
    import shutil

    manifest_path = parts_dir / "manifest.json"
    if not manifest_path.is_file():
        raise InputError("no manifest.json (made by `gpu_kit.py split`)", path=parts_dir)
    m = json.loads(manifest_path.read_text())
    stash.mkdir(parents=True, exist_ok=True)
    for part in m["parts"]:
        src = parts_dir / part["file"]
        if src.is_file():
            if sha256_file(src) != part["sha256"]:
                raise InputError(f"{part['file']}: sha256 differs from the manifest's (damaged in transfer)",
                                 path=src)
            shutil.copyfile(src, stash / part["file"])
    have = [p for p in m["parts"] if (stash / p["file"]).is_file() and sha256_file(stash / p["file"]) == p["sha256"]]
    if len(have) < len(m["parts"]):
        print(f"{m['name']}: have {len(have)} of {len(m['parts'])} parts in {stash}")
        return None
    into.mkdir(parents=True, exist_ok=True)
    target = into / m["name"]
    tmp = into / f".{m['name']}.tmp-{os.getpid()}"
    with open(tmp, "wb") as out:
        for p in m["parts"]:
            with open(stash / p["file"], "rb") as f:
                shutil.copyfileobj(f, out)
    digest = sha256_file(tmp)
    if digest != m["sha256"] or tmp.stat().st_size != m["bytes"]:
        tmp.unlink()
        raise InputError(f"the joined file hashes {digest}, the manifest says {m['sha256']}", path=target)
    os.replace(tmp, target)
    print(f"{target}: complete, {m['bytes']} bytes, sha256 {digest} (equal to the manifest's)")
    return target


# The kit (`kit`): what the GPU machine needs, made in one command.

# The size (MiB) one copy to the GPU machine may hold, the working tree included, unless `kit --transfer-mib`
# gives another: a machine reached through an upload of limited size takes the kit in copies that fit it.
TRANSFER_MIB = 64

WHEELS = {  # distribution: why the GPU machine's Python (3.12, with CUDA torch and JAX) needs it carried
    "typer": "the CLI catches its bundled click's exceptions: the project's version range",
    "gguf": "absent there: the embedded SmolLM2 is a GGUF",
    "zstandard": "absent there: the corpus is zstd-compressed",
    "deepspeed": "absent there: paper-gpu trains under ZeRO-1",
    "hjson": "deepspeed's dependency, absent there",
    "pydantic": "deepspeed's dependency, absent there",
    "pydantic_core": "pydantic's, absent there",
    "annotated-types": "pydantic's, absent there",
    "typing-inspection": "pydantic's, absent there",
    "transformers": "the image holds an older release than the project's lower end (pyproject.toml)",
    "trl": "absent there: the CUDA tests train TRL's SFTTrainer with its default SFTConfig",
    "datasets": "TRL's dependency (and the Trainer tests' datasets), absent there",
    "dill": "datasets' dependency, absent there",
    "multiprocess": "datasets' dependency, absent there",
}
BUILT_HERE = {"deepspeed"}  # source-only on PyPI: built into a wheel here (pure Python: no ops compiled)
GPU_PYTHON = ("3.12", "cp312", ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"])

GGUF = Path(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
PARTS_ARCHIVES = Path("results/gpu/parity")  # parts_<gpu>.tgz: `keep` writes them, gpu_parity.sh `seed` reads them
DEVKIT = Path(".devkit")
CALLS = {  # tools/gpu_parity.sh's plan: what each copy holds beside the working tree. The wheels (25 MiB with
    # transformers) go alone: the CUDA tests need no weights and start with them; the weights follow.
    "1: wheels": [".whl"],
    "2: weights part 1": ["parts/manifest.json", "parts/{part0}"],
    "3 (parity): weights part 2": ["parts/manifest.json", "parts/{part1}"],
    "3 (paper-gpu): weights part 2, held-out documents": ["parts/manifest.json", "parts/{part1}", "heldout.jsonl"],
}
# The command to run on the GPU machine after each copy, and timeout_s, the seconds it may take there (a step
# stops its own work before that and keeps what it finished). kit.json holds them with the checkout's commit
# filled in, ready to run one after the other. R=/tmp/res holds the results there; each command ends by packing
# all of it as $OUT/r.tgz, what to copy back (OUT: where the runner collects a command's output). For paper-gpu
# the first command installs the wheels without starting the CUDA tests (they would share the GPU with the
# timed runs); the second is the same in both.
GPU = "export ANCHOR_COMMIT={commit}; G='bash tools/gpu_parity.sh /tmp/res'; "
# The tests started in the background may still be writing their log: tar's "file changed as we read it" (exit 1)
# still leaves a whole archive of what was there, and only a fatal error (exit 2) fails the command.
BACK = "; tar --warning=no-file-changed -czf $OUT/r.tgz -C /tmp/res . || [ $? -eq 1 ]"
COMMANDS = {
    "1: wheels": (GPU + "$G start" + BACK, 120),
    "1 (paper-gpu): wheels": (GPU + "$G seed" + BACK, 120),
    "2: weights part 1": (GPU + "$G join" + BACK, 60),
    "3 (parity): weights part 2": (GPU + "$G join && BUDGET=540 $G plan" + BACK, 590),
    "4 (parity): the plan again, until it is done": (GPU + "BUDGET={budget} $G plan" + BACK, 0),
    "3 (paper-gpu): weights part 2, held-out documents":
        (GPU + "$G join && PROFILE=paper-gpu-short HELDOUT=.devkit/heldout.jsonl LIMIT=560 $G paper" + BACK, 590),
}
# attn_grad_inputs.npz (the inputs of experiments/attn_grad_diag, 10 MiB) is in no planned copy: `kit
# --attention-inputs` captures it, to be copied by hand with the third, and gpu_parity.sh's plan runs diag
# where it is there.


def _pip(*args: str) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "pip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise InputError(f"`{' '.join(cmd[2:])}` failed: {tail[0]}")


def kit_wheels(dest: Path) -> list[Path]:
    """WHEELS at this environment's versions into `dest`, for the GPU image's Python; kept if present."""
    import os
    from importlib.metadata import PackageNotFoundError, version

    from packaging.utils import canonicalize_name

    dest.mkdir(parents=True, exist_ok=True)
    pins = {}
    for name in WHEELS:
        try:
            pins[name] = version(name)
        except PackageNotFoundError:
            raise InputError(f"{name} is not installed here (run `make install` first): its version is the kit's")

    def have(name: str, v: str) -> Path | None:
        stem = f"{canonicalize_name(name).replace('-', '_')}-{v}-"
        return next((w for w in dest.glob("*.whl") if w.name.lower().startswith(stem)), None)

    py, abi, platforms = GPU_PYTHON
    fetch = [f"{n}=={v}" for n, v in pins.items() if n not in BUILT_HERE and not have(n, v)]
    if fetch:
        _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", py, "--implementation", "cp",
             "--abi", abi, "--abi", "none", *[a for p in platforms for a in ("--platform", p)], "-d", str(dest), *fetch)
    for n in sorted(BUILT_HERE):
        if not have(n, pins[n]):
            os.environ.setdefault("DS_BUILD_OPS", "0")
            _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), f"{n}=={pins[n]}")
    missing = [n for n, v in pins.items() if not have(n, v)]
    if missing:
        raise InputError(f"no wheel of {', '.join(missing)} after pip", path=dest)
    return [have(n, v) for n, v in pins.items()]


def kit_heldout(out: Path, min_bytes: int = 100_000) -> int:
    """The held-out long documents (this Python's test-suite files over `min_bytes`) as JSONL, atomically."""
    from anchor_core.atomic import write_text_atomic
    from anchor.eval.perplexity import heldout_files

    files = [p for p in heldout_files() if p.stat().st_size > min_bytes]
    if not files:
        raise InputError("this Python has no test suite to hold out (anchor.eval.perplexity.heldout_files)")
    out.parent.mkdir(parents=True, exist_ok=True)  # a fresh checkout has no .devkit yet
    write_text_atomic(out, "".join(json.dumps({"text": p.read_text(errors="replace")}) + "\n" for p in files))
    return len(files)


def travelling_tree_bytes(root: Path) -> int:
    """Bytes of the working tree that each copy to the GPU machine holds besides its own files: tracked files
    and untracked files git does not ignore."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def carried(item: str, fill: dict[str, str] | None = None) -> Path:
    """A CALLS item's path relative to the root: `.whl` as it is, the others under DEVKIT (`fill` names the
    weights' parts for `{part0}` and `{part1}`)."""
    return Path(item) if item.startswith(".whl") else DEVKIT / item.format(**(fill or {}))


def carry_plan(root: Path, parts: list[str], transfer_mib: float = TRANSFER_MIB) -> dict:
    """Each planned copy's files (paths relative to root) and its MiB with the working tree; raises
    InputError naming a copy over `transfer_mib`."""
    tree = travelling_tree_bytes(root)
    fill = {"part0": parts[0], "part1": parts[1] if len(parts) > 1 else parts[0]}
    calls = {}
    for call, items in CALLS.items():
        paths = [str(carried(i, fill)) for i in items]
        mib = (tree + sum(_bytes(root / p) for p in paths)) / 2**20
        calls[call] = {"carry": paths, "mib_with_tree": round(mib, 1)}
        if mib > transfer_mib:
            fix = "make the parts smaller (--part-mib)" if any(i.startswith("parts/") for i in items) else \
                "carry fewer wheels (WHEELS)"
            raise InputError(f"call {call} holds {mib:.1f} MiB with the working tree, over the "
                             f"{transfer_mib:g} MiB one copy may hold (--transfer-mib): {fix}")
    return {"tree_mib": round(tree / 2**20, 1), "calls": calls}


def call_commands(commit: str | None = None) -> dict[str, dict]:
    """COMMANDS with the checkout's commit (anchor_core.machine.commit, `+dirty` where tracked files differ from it)
    for ANCHOR_COMMIT: each call's command and timeout_s. timeout_s 0: the plan run again for as long as the user
    chooses, S seconds: `{budget}` in the command is to be filled with S less 20, the margin in which the plan
    packs R before a runner that stops commands at S would stop it."""
    from anchor_core.machine import commit as checkout_commit

    named = commit or checkout_commit() or "unknown"
    return {call: {"command": cmd.replace("{commit}", named), "timeout_s": t} for call, (cmd, t) in COMMANDS.items()}


def kit(root: Path, part_mib: float | None = None, capture_attention: bool = False,
        transfer_mib: float = TRANSFER_MIB) -> dict:
    """Make the kit under `root` (module docstring) and return kit.json's content; each copy is checked to fit
    `transfer_mib` with the working tree. `part_mib` None: the weights in two parts sized so that the fullest
    copy with part 1 (call 2) and the fullest with part 2 (paper-gpu's, with the held-out documents) leave the
    same room for the working tree (which holds the parity parts kept from the GPU machine's earlier runs,
    results/gpu/parity/parts_*.tgz)."""
    import math

    from anchor_core.atomic import write_text_atomic

    gguf, devkit = root / GGUF, root / DEVKIT
    if not gguf.is_file():
        raise InputError("no embedded model (run `make install` first)", path=gguf)
    wheels = kit_wheels(root / ".whl")
    print(f".whl: {len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 2**20:.1f} MiB")
    n = kit_heldout(devkit / "heldout.jsonl")
    print(f"{DEVKIT / 'heldout.jsonl'}: {n} held-out documents")
    first = None
    if part_mib is None:
        def extra(items: list[str]) -> float:  # MiB a call carries besides the weights' parts
            return sum(_bytes(root / carried(i)) for i in items if not i.startswith("parts/")) / 2**20

        with_part = {k: [extra(v) for v in CALLS.values() if f"parts/{{{k}}}" in v] for k in ("part0", "part1")}
        gguf_mib = gguf.stat().st_size / 2**20
        first = math.ceil((gguf_mib + max(with_part["part1"]) - max(with_part["part0"])) / 2 * 10) / 10
        part_mib = math.ceil((gguf_mib - first) * 10) / 10 + 0.1
    manifest = split(gguf, devkit / "parts", part_mib, first)
    if len(manifest["parts"]) > 2:
        raise InputError(f"{len(manifest['parts'])} parts: the plan's calls carry two (a larger --part-mib)",
                         path=devkit / "parts")
    npz = devkit / "attn_grad_inputs.npz"
    if capture_attention and not npz.is_file():
        sys.path.insert(0, str(ROOT / "experiments" / "attn_grad_diag"))
        import attn_grad_diag

        attn_grad_diag.capture(str(npz), attn_grad_diag.LAYERS)
        print(f"{DEVKIT / 'attn_grad_inputs.npz'}: captured")
    files = [*wheels, devkit / "parts" / "manifest.json", *(devkit / "parts" / p["file"] for p in manifest["parts"]),
             devkit / "heldout.jsonl", *([npz] if npz.is_file() else [])]
    record = {"files": {str(f.relative_to(root)): {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                        for f in files},
              "wheels": {w.name: WHEELS[next(n for n in WHEELS if w.name.lower().startswith(
                  n.lower().replace("-", "_") + "-"))] for w in wheels},
              **carry_plan(root, [p["file"] for p in manifest["parts"]], transfer_mib),
              "commands": call_commands()}
    write_text_atomic(devkit / "kit.json", json.dumps(record, indent=1) + "\n")
    for call, c in record["calls"].items():
        print(f"call {call}: {c['mib_with_tree']} MiB with the tree; carry {json.dumps(c['carry'])}")
    print(f"each call's command and timeout_s: {DEVKIT / 'kit.json'} (commands)")
    return record


# Parity parts carried from one run on the GPU machine to the next (`keep` here, gpu_parity.sh `seed` there), so
# that a machine whose results are not kept there (a fresh one each time, or /tmp cleared) computes only what no
# earlier run finished; `anchor parity --keep-parts` keeps each finished case, and its key
# (settings, code, library versions, the GPU's name) decides there whether a carried case is taken again.

def gpu_slug(name: str) -> str:
    """A GPU's name as nvidia-smi gives it, as a file-name word: "NVIDIA H100 80GB HBM3" ->
    "nvidia-h100-80gb-hbm3" (gpu_parity.sh's `seed` makes the same with tr)."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def keep(results: Path, into: Path) -> Path:
    """The parity parts folders of `results` (`.<run>.parts` with anchor's marker) added to
    `into/parts_<gpu>.tgz` (a part there under the same path replaced), written atomically and reproducibly
    (sorted, no times kept but each part's own, gzip without a time). The GPU: `results/weights.txt`'s second
    line (nvidia-smi's name, ...). Returns the archive's path."""
    import gzip
    import io
    import os
    import tarfile

    from anchor_core.outdir import read_marker

    try:
        gpu = (results / "weights.txt").read_text().splitlines()[1].split(",")[0].strip()
    except (OSError, IndexError):
        raise InputError("no GPU named in weights.txt (gpu_parity.sh writes it there)", path=results) from None
    target = into / f"parts_{gpu_slug(gpu)}.tgz"
    members: dict[str, tuple[bytes, int]] = {}
    if target.is_file():
        with tarfile.open(target, "r:gz") as t:
            for m in t.getmembers():
                if m.isfile():
                    members[m.name] = (t.extractfile(m).read(), int(m.mtime))
    added = 0
    for folder in sorted(results.glob(".*.parts")):
        if not folder.is_dir() or read_marker(folder) is None:
            continue
        for f in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".json"):
            members[f"{folder.name}/{f.name}"] = (f.read_bytes(), int(f.stat().st_mtime))
            added += f.name != ".anchor-output.json"
    if not added:
        raise InputError("no parity parts in it (.<run>.parts folders)", path=results)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name in sorted(members):
            data, mtime = members[name]
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), mtime, 0o644
            t.addfile(info, io.BytesIO(data))
    into.mkdir(parents=True, exist_ok=True)
    tmp = into / f".{target.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as z:
            z.write(raw.getvalue())
    os.replace(tmp, target)
    print(f"{target}: {added} parts from {results} added, {len(members)} files, "
          f"{target.stat().st_size / 2**20:.2f} MiB")
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="config.json and tokenizer of --model into --out (no weights)")
    p.add_argument("--model", default="default")
    p.add_argument("--out", type=Path, required=True)
    w = sub.add_parser("weights", help="random weights of FOLDER's config.json into FOLDER")
    w.add_argument("folder", type=Path)
    w.add_argument("--seed", type=int, default=0)
    sp = sub.add_parser("split", help="FILE as parts of at most --part-mib MiB, with manifest.json, in --out")
    sp.add_argument("file", type=Path)
    sp.add_argument("--out", type=Path, required=True)
    sp.add_argument("--part-mib", type=float, default=30.0)
    sp.add_argument("--first-mib", type=float, default=None, help="the first part's size (default --part-mib)")
    j = sub.add_parser("join", help="the parts of PARTS into --stash; when all are there, the checked file in --into")
    j.add_argument("parts", type=Path)
    j.add_argument("--stash", type=Path, default=Path("/tmp/anchor-parts"))
    j.add_argument("--into", type=Path, required=True)
    k = sub.add_parser("kit", help="everything the GPU machine needs (.whl, .devkit), each copy checked to fit "
                                   "--transfer-mib")
    k.add_argument("--part-mib", type=float, default=None,
                   help="parts of this size (default: two, balanced between copies 2 and 3)")
    k.add_argument("--transfer-mib", type=float, default=TRANSFER_MIB,
                   help=f"the MiB one copy to the GPU machine may hold, working tree included (default "
                        f"{TRANSFER_MIB})")
    k.add_argument("--attention-inputs", action="store_true",
                   help="also capture experiments/attn_grad_diag's inputs (about 30 s; carried by hand: CALLS)")
    kp = sub.add_parser("keep", help="the parity parts that came back (R, gpu_parity.sh's OUT) into the tracked "
                                     "results/gpu/parity/parts_<gpu>.tgz the GPU's next run seeds from")
    kp.add_argument("results", type=Path)
    kp.add_argument("--into", type=Path, default=ROOT / PARTS_ARCHIVES)
    a = ap.parse_args()
    try:
        if a.verb == "pack":
            pack(a.model, a.out)
        elif a.verb == "weights":
            weights(a.folder, a.seed)
        elif a.verb == "kit":
            kit(ROOT, a.part_mib, a.attention_inputs, a.transfer_mib)
        elif a.verb == "keep":
            keep(a.results, a.into)
        elif a.verb == "split":
            split(a.file, a.out, a.part_mib, a.first_mib)
        else:
            join(a.parts, a.stash, a.into)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
