"""The 0.5B model's ZeRO-3 export on 2 processes, loaded by stock transformers: at least two shards, bf16 for a bf16
run, and `from_pretrained`'s logits equal to the trainer's forward of the same checkpoint (the trainer's model and
engine, read through anchor_core.weights) on one window, within the project's fp32 rule (1e-5 relative L2), with
fp32's own noise measured beside it (transformers' sdpa against its eager attention).

    .venv/bin/python benchmarks/bench_sharded_build.py --work /tmp/sb --keep --worlds 2   # the model and data
    .venv/bin/python experiments/export_0.5b/check_export.py /tmp/sb

Trains `bench_sharded_build.py`'s world-2 case again (its RUN keys: 500 MB shards) in WORK/run-export, then checks
its hf/; writes experiments/export_0.5b/result.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
FP32_TOL = 1e-5


def main() -> None:
    from bench_sharded_build import RUN  # the benchmark's run keys

    from anchor_core.data.packed import PackedData
    from anchor_core.machine import machine
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from torchtrain.model import build_model

    work = Path(sys.argv[1])
    run = work / "run-export"
    if not (run / "checkpoints" / "step-1" / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "anchor", "train", "--config", "tiny", "--out", str(run), "--no-progress",
                        f"model.name={work / 'llama-0.5b'}", f"data.path={work / 'pack-0.5b'}", *RUN,
                        "parallel.nproc=2", "data.global_batch=2"], check=True, cwd=ROOT)
    step = run / "checkpoints" / "step-1"
    hf = step / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    dtypes = set()
    for f in files:
        with safe_open(hf / f, framework="pt") as st:
            dtypes |= {str(st.get_slice(n).get_dtype()) for n in st.keys()}
    config = json.loads((hf / "config.json").read_text())
    ids = torch.as_tensor(PackedData.open(work / "pack-0.5b").batch([0], "full").tokens, dtype=torch.long)
    with torch.no_grad():
        trainer = build_model(str(step), engine="varlen", dtype="float32").eval()
        want = trainer(input_ids=ids, use_cache=False).logits.double()
        del trainer
        loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        module = type(loaded).__module__
        got = loaded(ids, use_cache=False).logits.double()
        del loaded
        eager = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
        other = eager(ids, use_cache=False).logits.double()
    rel = float((got - want).norm() / want.norm())
    baseline = float((other - got).norm() / got.norm())
    result = {"shards": files, "tensor_dtypes": sorted(dtypes), "config_dtype": config.get("dtype"),
              "model_class": f"{module}.{config['architectures'][0]}", "window_slots": int(ids.shape[-1]),
              "logits_rel_l2_transformers_vs_trainer": rel, "logits_rel_l2_sdpa_vs_eager": baseline,
              "fp32_rule": FP32_TOL, "holds": len(files) >= 2 and dtypes == {"BF16"} and rel <= FP32_TOL,
              "machine": machine()}
    (Path(__file__).parent / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
