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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="config.json and tokenizer of --model into --out (no weights)")
    p.add_argument("--model", default="default")
    p.add_argument("--out", type=Path, required=True)
    w = sub.add_parser("weights", help="random weights of FOLDER's config.json into FOLDER")
    w.add_argument("folder", type=Path)
    w.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        pack(a.model, a.out) if a.verb == "pack" else weights(a.folder, a.seed)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
