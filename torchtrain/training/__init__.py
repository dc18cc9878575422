"""The training part: `anchor train` from the run folder to the last checkpoint.

Owns the run folder (`run_folder`: preparing and checking RUN/), the memory plan (`memory`), the DeepSpeed
config (`deepspeed_json`), the optimizer and its schedule (`optim`), the length schedule (`phases`), the
checkpoints (`checkpoint`, and `universal` for a resume on another process count), the metrics and the trackers
(`metrics`, `trackers`, `throughput`), the held-out loss (`heldout`), and the launch and the loop (`trainer`).

May import: every other part of torchtrain, anchor_core, torch, DeepSpeed. No other part imports it.
"""
