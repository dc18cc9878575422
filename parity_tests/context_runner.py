"""Context parallelism as a parity runner: `cp<C>:<engine>` runs a torchtrain engine with each window's slots
split over C processes (gloo on this machine; torchtrain.parallel.context), every rank holding its balanced
share of the slots and gathering the whole window's keys and values in every layer.

Each rank captures the taps of its own slots (`embed`, `q`, `k`, `attn_out`, `mlp_out`, `hidden`, `logits`);
the runner puts them back in slot order, so the comparison holds them against the oracle of the whole window
exactly as it holds the engine in one process. `scores` and `probs` are not returned (a runner may give a
subset of taps). The case's T must split into the C shares the balancing needs (`check_context_parallel`):
with the suite's T of 97, `anchor parity --engine cp2:varlen --seq-len 98`.

    anchor parity --model default --engine cp2:varlen --variant anchor --seq-len 1026
"""

from __future__ import annotations

import os
import re
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np

import torchtrain
from anchor_core.errors import InputError
from parity_tests.cases import Case, CaseInputs
from parity_tests.emulations import emulation as emulation_of
from parity_tests.runners import Runner, Taps, as_arrays, device, register_family
from torchtrain.model.taps import capture_taps
from torchtrain.parallel.context import check_context_parallel, enable_context_parallel, rank_slots

RUNNER_PREFIX = "cp"
_NAME = re.compile(r"cp(\d+):(\w+)$")
SLOT_AXIS = 2  # every tap returned is [L, B, T, ...]
TAPS = ("embed", "q", "k", "attn_out", "mlp_out", "hidden", "logits")


class ContextParallelRunner(Runner):
    """A torchtrain engine at context-parallel degree `degree` (processes spawned per case)."""

    def __init__(self, degree: int, engine: str):
        self.degree, self.engine = degree, engine
        self.name = f"cp{degree}:{engine}"

    @property
    def emulation(self) -> str:  # type: ignore[override]
        return emulation_of(self.engine, device())

    def available(self) -> str | None:
        try:
            torchtrain.check_engine(self.engine)
        except InputError as e:
            return str(e)
        if device() != "cpu":
            return f"{self.name} runs its ranks on the CPU (gloo); run it with --device cpu"
        return None

    def run(self, case: Case, inputs: CaseInputs, dtype: str) -> Taps:
        import torch
        import torch.multiprocessing as mp

        T = inputs.shape[1]
        check_context_parallel(T, self.degree)
        with tempfile.TemporaryDirectory(prefix="parity-cp-") as folder:
            mp.start_processes(_rank, args=(self, case, inputs, dtype, folder), nprocs=self.degree, join=True,
                               start_method="spawn")
            ranks = [torch.load(Path(folder) / f"rank{r}.pt", weights_only=True) for r in range(self.degree)]
        for r in ranks:
            if "traceback" in r:
                raise RuntimeError(f"{self.name}: a rank failed:\n{r['traceback']}")
        return self.in_slot_order(ranks)

    def in_slot_order(self, ranks: list[dict]) -> Taps:
        """The ranks' taps (in rank order along the slot axis) put back in slot order."""
        slots = np.concatenate([r["slots"].numpy() for r in ranks])
        inverse = np.empty(len(slots), dtype=np.int64)
        inverse[slots] = np.arange(len(slots))
        return {name: np.take(np.concatenate([r["taps"][name].numpy() for r in ranks], axis=SLOT_AXIS), inverse,
                              axis=SLOT_AXIS)
                for name in TAPS if name in ranks[0]["taps"]}


def _rank(rank: int, runner: ContextParallelRunner, case: Case, inputs: CaseInputs, dtype: str, folder: str) -> None:
    """One rank: its share of the window through the model at context parallel `runner.degree`; saves its slots and
    its taps ([L, B, T/C, ...] each) to `folder/rank<r>.pt`."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // runner.degree))
    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=runner.degree,
                                timeout=timedelta(seconds=300))
        model = torchtrain.build_model(case.model, engine=runner.engine, dtype=dtype).eval()
        enable_context_parallel(model, dist.new_group(list(range(runner.degree))))
        slots = torch.as_tensor(rank_slots(inputs.shape[1], runner.degree, rank))
        feed = {"input_ids": torch.from_numpy(inputs.tokens).index_select(1, slots),
                "position_ids": torch.from_numpy(inputs.positions).index_select(1, slots),
                "doc_ids": torch.from_numpy(inputs.doc_ids), "variant": case.variant}
        with torch.no_grad(), capture_taps(model) as taps:
            model(**feed, use_cache=False)
        out = {"slots": slots, "taps": {name: torch.from_numpy(x) for name, x in as_arrays(taps).items()}}
        dist.destroy_process_group()
    except BaseException:
        out = {"traceback": traceback.format_exc()}
        torch.save(out, Path(folder) / f"rank{rank}.pt")
        raise
    torch.save(out, Path(folder) / f"rank{rank}.pt")


def context_runner(name: str) -> ContextParallelRunner:
    """`cp<C>:<engine>`, C >= 2 and a torchtrain engine; an InputError naming the form otherwise."""
    m = _NAME.match(name)
    if m is None or int(m.group(1)) < 2 or m.group(2) not in torchtrain.ENGINES:
        raise InputError(f"unknown engine {name!r}: a context-parallel runner is cp<C>:<engine>, C >= 2, engine one "
                         f"of {', '.join(torchtrain.ENGINES)} (e.g. cp2:varlen)")
    return ContextParallelRunner(int(m.group(1)), m.group(2))


register_family(RUNNER_PREFIX, context_runner)
