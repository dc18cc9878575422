"""examples/slurm/train_multinode.sbatch, run as SLURM would run it on two nodes: the script itself under bash with
SLURM's variables, its `srun` and `scontrol` stood in for by two small scripts that do what they do with
`--ntasks-per-node=1` (start the command once per node; print the nodes' names: here 127.0.0.1 twice), so that its
own torchrun command line meets through the c10d rendezvous and trains; the losses equal a one-node two-process
run's (fp32 rule, 1e-6). Where Slurm's daemons are installed, the script is also submitted for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import ENV, ROOT, TINY, metrics, run_train

SCRIPT = ROOT / "examples" / "slurm" / "train_multinode.sbatch"
OVERRIDES = ("schedule.steps=3", "data.global_batch=4", "data.micro_batch=1", "eval.window=0",
             "logging.report_to=[]", "parallel.zero_stage=1")

SRUN = """#!/bin/bash
# srun with --ntasks-per-node=1: the command once per node, together; its options are srun's own
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n "$@" > "$SRUN_LOGS/node$n.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/bin/bash
for ((n = 0; n < SLURM_NNODES; n++)); do echo 127.0.0.1; done
"""


def _stand_ins(folder: Path) -> Path:
    folder.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.slow  # minutes of CPU: make test-all
def test_the_sbatch_script_trains_on_two_nodes_through_its_own_torchrun_line(packed, tmp_path):
    from torchtrain.parallel.distributed import free_port

    bin_ = _stand_ins(tmp_path / "bin")
    logs = tmp_path / "logs"
    logs.mkdir()
    out = tmp_path / "run"
    path = os.pathsep.join([str(bin_), str(Path(sys.executable).parent), ENV.get("PATH", os.environ["PATH"])])
    env = {**ENV, "PATH": path, "SLURM_NNODES": "2",  # `python` is this venv's, as a job's activated one
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "ANCHOR_GPUS_PER_NODE": "1",
           "ANCHOR_RDZV_PORT": str(free_port()), "SRUN_LOGS": str(logs)}
    done = subprocess.run(["bash", str(SCRIPT), str(TINY), str(out), *OVERRIDES, f"data.path={packed}"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    node_logs = "\n".join((logs / f"node{n}.log").read_text() for n in (0, 1) if (logs / f"node{n}.log").exists())
    assert done.returncode == 0, (done.stderr + node_logs)[-3000:]
    ref = tmp_path / "one-node"
    run_train(ref, *OVERRIDES, "parallel.nproc=2", f"data.path={packed}")
    a = np.array([r["loss"] for r in metrics(ref)])
    b = np.array([r["loss"] for r in metrics(out)])
    print(f"one node {a.round(7)}\nsbatch, two nodes {b.round(7)}")
    assert (np.abs(a - b) / np.abs(a)).max() <= 1e-6


def test_the_script_is_submitted_to_a_real_cluster_where_one_runs():
    missing = [d for d in ("slurmctld", "slurmd", "sbatch") if shutil.which(d) is None]
    if missing:
        pytest.skip(f"Slurm is not installed here ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm): "
                    "the script ran above under bash with srun and scontrol stood in for")
    pytest.skip("a one-node Slurm cluster needs slurmctld and slurmd started as root with a generated slurm.conf; "
                "this suite does not start daemons")
