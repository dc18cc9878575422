"""Take a model's shape and tokenizer to a GPU machine that cannot hold its weights file.

The lent GPU machine receives at most 64 MiB with the working tree and cannot download; the embedded
SmolLM2 GGUF is 90 MB. Speed does not depend on weight values, so the benchmark there runs on
random weights of SmolLM2's exact shape, with its real tokenizer (the corpus windows are packed
with it, so their document lengths are the real ones):

    here:   python benchmarks/gpu_kit.py pack --model default --out .devkit/smollm2
            (config.json and the tokenizer files, no weights)
    there:  python3 benchmarks/gpu_kit.py weights .devkit/smollm2
            (model.safetensors: random weights of config.json's shapes, seed 0)

Then `anchor bench --model .devkit/smollm2 ...` runs there as here.

The real weights (issue 28) go in parts, one part per device call while the machine stays held, and are
joined there only when every part and the whole file hash as they did here:

    here:   python benchmarks/gpu_kit.py split .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf --out .devkit/parts
            (parts of at most --part-mib MiB and manifest.json: name, bytes, sha256 of the whole and of
            each part)
    there:  python3 benchmarks/gpu_kit.py join .devkit/parts --stash /tmp/anchor-parts --into .cache/models
            once per call, carrying `.devkit/parts/manifest.json` and the next part: each part is checked
            and kept in the stash; when all are there, the file is joined beside its target, its sha256
            checked against the manifest, and renamed into place (never a partial file under the name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from anchor.atomic import sha256_file  # noqa: E402
from anchor.errors import InputError  # noqa: E402

NOTE = "random weights of this config's shapes (benchmarks/gpu_kit.py): for timing only"


def pack(model: str, out: Path) -> None:
    from anchor.export import write_tokenizer
    from anchor.spec import to_hf_config
    from anchor.weights import load_spec

    spec = load_spec(model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_hf_config(spec), indent=2))
    write_tokenizer(model, spec, out)
    (out / "WEIGHTS.txt").write_text(f"{NOTE}; shape and tokenizer of {model}\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.1f} MiB, no weights)")


def weights(folder: Path, seed: int) -> None:
    from anchor.weights import random_state, read_hf_config, write_hf_dir

    spec = read_hf_config(folder)
    write_hf_dir(spec, random_state(spec, seed), folder)
    print(f"wrote {folder / 'model.safetensors'} ({NOTE}, seed {seed})")


def split(src: Path, out: Path, part_mib: float) -> dict:
    """`src` as parts of at most `part_mib` MiB in `out`, with manifest.json; returns the manifest."""
    if not src.is_file():
        raise InputError("no such file", path=src)
    size = int(part_mib * 2**20)
    if size < 1:
        raise InputError(f"--part-mib must be positive, got {part_mib}")
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(src, "rb") as f:
        for k in range(-(-src.stat().st_size // size) or 1):
            name = f"{src.name}.part-{k:03d}"
            (out / name).write_bytes(f.read(size))
            parts.append({"file": name, "bytes": (out / name).stat().st_size, "sha256": sha256_file(out / name)})
    manifest = {"name": src.name, "bytes": src.stat().st_size, "sha256": sha256_file(src), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{src.name}: {len(parts)} parts of at most {part_mib:g} MiB in {out}, sha256 {manifest['sha256']}")
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
    j = sub.add_parser("join", help="the parts of PARTS into --stash; when all are there, the checked file in --into")
    j.add_argument("parts", type=Path)
    j.add_argument("--stash", type=Path, default=Path("/tmp/anchor-parts"))
    j.add_argument("--into", type=Path, required=True)
    a = ap.parse_args()
    try:
        if a.verb == "pack":
            pack(a.model, a.out)
        elif a.verb == "weights":
            weights(a.folder, a.seed)
        elif a.verb == "split":
            split(a.file, a.out, a.part_mib)
        else:
            join(a.parts, a.stash, a.into)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
