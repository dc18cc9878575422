"""Stock transformers under the oracle (issue 31 item 1): `anchor parity --stack hf` on random:llama and SmolLM2.

    .venv/bin/python experiments/hf_stack/hf_stack.py [--runs random:llama@97,default@97,default@515] [--inputs all]

For each run (model @ T): transformers' eager, sdpa and flex_attention (forward only on the CPU) and
flash_attention_2 (reported as not run without CUDA and flash-attn), each asked for the four variants
in each input style (parity_tests.hf_stack.INPUT_STYLES: how a real loop hands the batch to the model):
which variant it computes, and, where it computes the one asked, whether its bf16 forward passes the
suite's rule. Writes results/hf_stack_<model>_T<T>_<machine>.json beside it (machine: cpu or the GPU) (the
report with the machine; the per-layer tables are left out, `anchor parity --stack hf` writes them) and .md
(summary.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def where() -> str:
    """The machine in a result's name: cpu, or the CUDA device's name as a file-name word."""
    import re

    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def slim(result: dict) -> dict:
    """The report without its per-layer tables (each row keeps its verdicts, first divergences, margins)."""
    rows = []
    for row in result["rows"]:
        row = dict(row)
        for key in ("fp32", "bf16"):
            if row.get(key):
                row[key] = {k: v for k, v in row[key].items() if k != "layers"}
        rows.append(row)
    return {**result, "rows": rows}


def main() -> None:
    from parity_tests.hf_report import render_markdown
    from parity_tests.hf_stack import run_hf_stack
    from parity_tests.report import _finite, _json_default

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="random:llama@97,default@97,default@515")
    ap.add_argument("--inputs", default="all", help="input styles (comma-separated, or all)")
    args = ap.parse_args()
    for run in args.runs.split(","):
        model, _, T = run.partition("@")
        result = run_hf_stack(model, seq_len=int(T), inputs=args.inputs, progress=True)
        result["command"] = f"anchor parity --stack hf --model {model} --seq-len {T} --inputs {args.inputs} --out DIR"
        name = f"hf_stack_{model.replace('random:', 'random_').replace('default', 'smollm2')}_T{T}_{where()}"
        stem = HERE / "results" / name
        stem.with_suffix(".json").write_text(json.dumps(_finite(slim(result)), indent=1, default=_json_default))
        stem.with_suffix(".md").write_text(render_markdown(result))
        print(render_markdown(result))


if __name__ == "__main__":
    main()
