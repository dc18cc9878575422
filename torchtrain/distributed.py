"""Processes and process groups of a training run: launch, DP × SP layout, DeepSpeed's view.

Rank layout: `rank = dp_rank * sp + sp_rank`, so each sequence-parallel group is `sp` consecutive
ranks (they share one data-parallel slice of the batch and split its windows along the sequence),
and the data-parallel peers of a rank are the ranks with its `sp_rank`.

Gradients: every rank holds a full replica of the parameters (ZeRO partitions the optimizer
state, gradients or parameters over the same ranks), and SP ranks hold *partial* gradients (each
from its slice of the sequence). So the one reduce group is all DP × SP ranks; DeepSpeed averages
over it, and the trainer multiplies each rank's loss by the group's size (see torchtrain.trainer).
DeepSpeed is handed this group through `mpu` *without* its sequence-parallel methods: given those,
DeepSpeed rescales gradients by the SP degree in some ZeRO stages and not others (TOOLCHAIN-FACTS).

Launch: `nproc: N` starts N local worker processes through torch's elastic launcher API
(`torch.distributed.launcher.api.elastic_launch`, what `torchrun` runs); under `torchrun` or the
`deepspeed` launcher (RANK/WORLD_SIZE set) the same command is one worker of a larger job.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    """This process's place in the run: global rank and size, DP and SP coordinates, device."""

    rank: int
    size: int
    sp: int
    device: torch.device

    @property
    def dp(self) -> int:
        return self.size // self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# The world-of-one variables `init_world` sets in a plain process (deepspeed and torch read them) stay in
# os.environ afterwards, and child processes inherit them. SOLO_PORT marks them: it names the port of that
# world, so neither a later run in the same process nor a child (`anchor train` run from a notebook or a
# test that trained in-process) mistakes them for a launcher's; a launcher always sets its own MASTER_PORT.
SOLO_PORT = "ANCHOR_SOLO_MASTER_PORT"
_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched_externally() -> bool:
    """True under torchrun / the deepspeed launcher / an elastic worker (the env names the world), not
    when the variables are those `init_world` set for a world of one (in this process or a parent)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    return os.environ.get(SOLO_PORT) is None or os.environ.get(SOLO_PORT) != os.environ.get("MASTER_PORT")


def environ_for_child(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`environ` (os.environ) for a child process that starts a world of its own (a transformers or accelerate script):
    without the world-of-one variables `init_world` set in this process or a parent, which the child would
    take for a launcher's and so listen on this process's port; a launcher's variables are kept."""
    env = dict(os.environ if environ is None else environ)
    if env.get(SOLO_PORT) is not None and env.get(SOLO_PORT) == env.get("MASTER_PORT"):
        for key in (*_WORLD_VARS, SOLO_PORT):
            env.pop(key, None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_deepspeed_import() -> None:
    """Without CUDA, name DeepSpeed's accelerator (`cpu`, what its auto-detection picks) before it is
    imported: its auto-detection prints a WARNING in every process ("Setting accelerator to CPU. If you have
    GPU ..."), twice on every 2-process run, and nothing else differs."""
    if "deepspeed" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _quiet_deepspeed() -> None:
    """DeepSpeed's shared-memory all-reduce serves inference only; building it costs 1-2 min of
    C++ compilation on first use and leaves 69 MB /dev/shm files per rank (TOOLCHAIN-FACTS)."""
    quiet_deepspeed_import()
    import deepspeed  # noqa: F401  (imports deepspeed.comm.torch)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]


def init_world(sp: int, timeout_s: int = 600) -> World:
    """Join (or, alone, create) the process group: gloo on CPU, NCCL on CUDA, its collectives waiting `timeout_s`
    seconds for the other ranks (`parallel.timeout_s`: a rank whose peer died stops then, not after torch's 30
    minutes or never). Returns this rank's World."""
    quiet_deepspeed_import()
    import deepspeed

    _quiet_deepspeed()
    if not launched_externally():  # one plain process: a world of one
        port = (dist.is_initialized() and os.environ.get("MASTER_PORT")) or str(free_port())
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                          **{SOLO_PORT: port})
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    deepspeed.init_distributed(backend, timeout=timeout)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), sp=sp, device=device)


def sequence_parallel_group(world: World):
    """This rank's SP group (consecutive ranks); every rank creates every group, as torch requires."""
    mine = None
    for d in range(world.dp):
        ranks = list(range(d * world.sp, (d + 1) * world.sp))
        g = dist.new_group(ranks)
        if world.rank in ranks:
            mine = g
    return mine


class ParallelGroups:
    """DeepSpeed's `mpu`: no model parallelism; data parallelism over all DP × SP ranks.

    The methods are the Megatron-style names DeepSpeed queries (`get_data_parallel_group`, ...).
    """

    def __init__(self, world: World):
        self.world = world
        ranks = list(range(world.size))
        self._dp = dist.new_group(ranks)
        self._mp = None
        for r in ranks:  # a model-parallel group of one per rank
            g = dist.new_group([r])
            if r == world.rank:
                self._mp = g

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self) -> int:
        return self.world.rank

    def get_data_parallel_world_size(self) -> int:
        return self.world.size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(range(self.world.size))

    def get_model_parallel_group(self):
        return self._mp

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.world.rank


def launch_local(nproc: int, entry: Callable[..., Any], *args: Any, run_id: str = "anchor-train") -> None:
    """Run `entry(*args)` in `nproc` local worker processes (torch's elastic launcher, no restarts).

    A failing worker raises `torch.distributed.elastic.multiprocessing.errors.ChildFailedError`
    after the others are stopped.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id, rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.2,
        start_method="spawn",
    )
    elastic_launch(config, entry)(*args)
