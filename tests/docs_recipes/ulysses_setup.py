"""What docs/guides/hf-trainer.md's sequence-parallel fragment reads, made once before its ranks start: `path`'s
model folder (the tiny random Llama of hf_prelude.py) and `packed/`, windows of the fragment's T = 65536 slots
packed from the embedded corpus for that model's tokenizer (one window: Trainer's default three epochs are three
steps)."""

import subprocess
import sys
from pathlib import Path

from anchor_core.export import export_hf
from anchor_core.spec import random_preset
from anchor_core.weights import random_state

if not Path("tiny-hf").exists():
    spec = random_preset("llama")
    export_hf(spec, random_state(spec, seed=0), "tiny-hf", tokenizer_of="random:llama")
anchor = [sys.executable, "-m", "anchor"]
subprocess.run([*anchor, "corpus", "--out", "corpus", "--max-docs", "400", "--no-progress"], check=True)
subprocess.run([*anchor, "pack", "--model", "tiny-hf", "--data", "corpus", "--seq-len", "65536", "--budget", "60000",
                "--out", "packed", "--no-progress"], check=True)
