"""What the held-out loss costs a run: its pass (`heldout_s`) against the training steps between two of them.

    .venv/bin/python benchmarks/bench_heldout.py [--config configs/train/smollm2_2k.yaml] [--steps 12] [--every 4]
        [--windows 8] [--tag NAME] [section.key=value ...]

One `anchor train` run with `eval.heldout_windows` windows held out and their loss every `eval.every` steps. For
each pass the cost is `heldout_s` over the time of the `eval.every` steps before it (each step's time:
`global_batch x T / tokens_per_s`), the first pass left out (its steps include the first, a warm-up).
torchtrain.training.heldout predicts windows / (3 x global_batch x every): one forward per window against a forward and
a backward (about three forwards) per trained window. Reports the measured fractions (mean, median) beside
that prediction.

Writes results/speed/heldout_cost_[<tag>_]<machine>.json. The shipped paper configs' proportions (8 windows held
out, 8 trained per step, a pass every 10 steps: predicted 3.3%) at a CPU's size:

    .venv/bin/python benchmarks/bench_heldout.py --steps 30 --every 10 --windows 8 --tag paper_proportions \
        data.global_batch=8 data.seq_len=128
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/train/smollm2_2k.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--windows", type=int, default=8, help="eval.heldout_windows")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "speed"))
    ap.add_argument("--tag", default="", help="a name for the setting, in the record's file name")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides (as for anchor train)")
    args = ap.parse_args()

    import torch

    from anchor_core.machine import machine
    from torchtrain.config import load_train_config
    from torchtrain.training.metrics import read_metrics
    from torchtrain.training.resume import load_run_config
    from torchtrain.training.trainer import train

    cfg = load_train_config(args.config, [*args.overrides, f"schedule.steps={args.steps}", "checkpoint.save_every=0",
                                          "eval.window=0", f"eval.every={args.every}", f"eval.heldout_windows={args.windows}",
                                          "logging.every=1000", "logging.report_to=[]"])
    with tempfile.TemporaryDirectory(prefix="bench-heldout-") as tmp:
        train(cfg, Path(tmp) / "run", progress=False)
        rows = read_metrics(Path(tmp) / "run")
        T = load_run_config(Path(tmp) / "run").data.seq_len  # the config's, or the pack folder's
    tokens = cfg.data.global_batch * T
    step_s = [tokens / r["tokens_per_s"] for r in rows]
    fractions = [r["heldout_s"] / sum(step_s[i - args.every + 1:i + 1])
                 for i, r in enumerate(rows) if "heldout_s" in r and i + 1 > args.every]
    predicted = args.windows / (3 * cfg.data.global_batch * args.every)
    result = {
        "benchmark": "the held-out loss pass against the training steps between two passes",
        "config": args.config, "overrides": args.overrides, "model": cfg.model.name, "dtype": cfg.model.dtype,
        "seq_len": T, "global_batch": cfg.data.global_batch, "every": args.every,
        "heldout_windows": args.windows, "steps": args.steps, "torch_threads": torch.get_num_threads(),
        "step_s": step_s, "heldout_s": [r["heldout_s"] for r in rows if "heldout_s" in r],
        "fraction": fractions, "fraction_mean": statistics.mean(fractions), "fraction_median": statistics.median(fractions),
        "fraction_predicted": predicted, "machine": machine(),
    }
    print(f"held-out pass: {statistics.mean(fractions):.3f} (mean), {statistics.median(fractions):.3f} (median) of the "
          f"training time between passes; predicted {predicted:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.tag}_" if args.tag else ""
    path = out / f"heldout_cost_{tag}{'cuda' if torch.cuda.is_available() else 'cpu'}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
