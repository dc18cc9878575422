"""Processes and process groups of a training run: launch, DP × SP layout, DeepSpeed's view.

Rank layout: `rank = dp_rank * sp + sp_rank`, so each sequence-parallel group is `sp` consecutive
ranks (they share one data-parallel slice of the batch and split its windows along the sequence),
and the data-parallel peers of a rank are the ranks with its `sp_rank`. A window's `sp` ranks are
Ulysses x context parallel: `sp_rank = cp_rank * ulysses + ulysses_rank`, so a Ulysses group (its
all-to-all, the heavier exchange) is consecutive ranks, and the context-parallel peers of a rank are
those with its `ulysses_rank` (torchtrain.parallel.context.window_groups); the slots a rank holds are `World.slots`.

Gradients: every rank holds a full replica of the parameters (ZeRO partitions the optimizer
state, gradients or parameters over the same ranks), and SP ranks hold *partial* gradients (each
from its slice of the sequence). So the one reduce group is all DP × SP ranks; DeepSpeed averages
over it, and the trainer multiplies each rank's loss by the group's size (see torchtrain.training.trainer).
DeepSpeed is handed this group through `mpu` *without* its sequence-parallel methods: given those,
DeepSpeed rescales gradients by the SP degree in some ZeRO stages and not others (TOOLCHAIN-FACTS).

Launch: `nproc: N` starts N local worker processes through torch's elastic launcher API
(`torch.distributed.launcher.api.elastic_launch`, what `torchrun` runs); under `torchrun` or the
`deepspeed` launcher (RANK/WORLD_SIZE set) the same command is one worker of a larger job, on one node or
several.

Several nodes: every rank checks that it was started with rank 0's config (`check_same_config`), and a
`Watchdog` thread on every rank ends it within a minute of another node's death, whatever its main thread waits in
(a collective, the store, a long checkpoint write), independently of `parallel.timeout_s`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from anchor_core.errors import InputError
from torchtrain.config.deepspeed_json import quiet_deepspeed_import
from torchtrain.parallel.context import rank_slots


@dataclass(frozen=True)
class World:
    """This process's place in the run: global rank and size, DP and SP coordinates, device. `sp` counts the
    ranks a window is split over (Ulysses x context parallel), `cp` the context-parallel degree among them."""

    rank: int
    size: int
    sp: int
    device: torch.device
    cp: int = 1

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
    def ulysses(self) -> int:
        return self.sp // self.cp

    @property
    def cp_rank(self) -> int:
        return self.sp_rank // self.ulysses

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.ulysses

    def slots(self, T: int) -> np.ndarray:
        """The slots of a T-slot window this rank holds (torchtrain.parallel.context.rank_slots)."""
        return rank_slots(T, self.cp, self.cp_rank, self.ulysses, self.ulysses_rank)

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


def _quiet_deepspeed() -> None:
    """DeepSpeed's shared-memory all-reduce serves inference only; building it costs 1-2 min of
    C++ compilation on first use and leaves 69 MB /dev/shm files per rank (TOOLCHAIN-FACTS)."""
    quiet_deepspeed_import()
    import deepspeed  # noqa: F401  (imports deepspeed.comm.torch)

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]


def init_world(sp: int, timeout_s: int = 600, cp: int = 1) -> World:
    """Join (or, alone, create) the process group: gloo on CPU, NCCL on CUDA, its collectives waiting `timeout_s`
    seconds for the other ranks (`parallel.timeout_s`: a rank whose peer died stops then, not after torch's 30
    minutes or never). `sp`: the ranks a window is split over, `cp` the context-parallel degree among them.
    Returns this rank's World."""
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
    return World(rank=dist.get_rank(), size=dist.get_world_size(), sp=sp, device=device, cp=cp)


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


# ---------------------------------------------------------------------------------------------
# Several nodes: one config, and a dead node's peers stopped

def check_same_config(config: Mapping[str, Any], world: World) -> None:
    """Every rank was started with rank 0's config (`config`: the config by section, `TrainConfig.to_dict()`), checked
    before rank 0 prepares the run folder. Each node's launcher runs its own command line while every rank trains
    the config.yaml rank 0 writes, so an override given to one node only would be ignored without a word. A
    collective; every rank refuses with the same line naming the first rank that differs and its keys."""
    flat = {f"{section}.{key}": value for section, keys in config.items() if isinstance(keys, Mapping)
            for key, value in keys.items()}
    seen: list[Any] = [None] * world.size
    dist.all_gather_object(seen, (socket.gethostname(), flat))
    host0, ref = seen[0]
    differing = []
    for rank, (host, theirs) in enumerate(seen):
        keys = sorted(k for k in ref.keys() | theirs.keys() if ref.get(k, _UNSET) != theirs.get(k, _UNSET))
        if keys:
            differing.append((rank, host, theirs, keys))
    if not differing:
        return
    rank, host, theirs, keys = differing[0]
    shown = "; ".join(f"{k} {_value(theirs.get(k, _UNSET))} there, {_value(ref.get(k, _UNSET))} on rank 0"
                      for k in keys[:6])
    more = f" (and {len(keys) - 6} more keys)" if len(keys) > 6 else ""
    ranks = f" (and {len(differing) - 1} more rank{'s' if len(differing) > 2 else ''})" if len(differing) > 1 else ""
    raise InputError(f"rank {rank} on {host}{ranks} was started with another config than rank 0 on {host0}: "
                     f"{shown}{more}; every node's command must give the same --config and key=value overrides")


_UNSET = object()  # a key one rank's config lacks (another version of anchor on that node)


def _value(v: Any) -> str:
    text = "(no such key)" if v is _UNSET else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Node:
    """One node of the run: its index (torchrun's node rank, GROUP_RANK; without it, hosts in the order of their
    first rank), its host name and its ranks."""

    index: int
    host: str
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        r = self.ranks
        if len(r) == 1:
            ranks = f"rank {r[0]}"
        elif r == tuple(range(r[0], r[-1] + 1)):
            ranks = f"ranks {r[0]}-{r[-1]}"
        else:
            ranks = "ranks " + ", ".join(map(str, r))
        return f"node {self.index} ({ranks} on {self.host})"


def run_nodes(world: World) -> list[Node]:
    """The run's nodes, by index (a collective: every rank tells its node and host)."""
    group = os.environ.get("GROUP_RANK")
    seen: list[Any] = [None] * world.size
    dist.all_gather_object(seen, (None if group is None else int(group), socket.gethostname()))
    if all(g is not None for g, _ in seen):
        index = [g for g, _ in seen]
    else:
        order: dict[str, int] = {}
        index = [order.setdefault(host, len(order)) for _, host in seen]
    found: dict[int, tuple[str, list[int]]] = {}
    for rank, (i, (_, host)) in enumerate(zip(index, seen)):
        found.setdefault(i, (host, []))[1].append(rank)
    return [Node(i, host, tuple(ranks)) for i, (host, ranks) in sorted(found.items())]


BEAT_S = 2.0  # how often each node's first rank beats, and every rank reads the other nodes' beats
STALE_S = 30.0  # a node whose beat has not changed for this long is dead
SOON_S = 10.0  # the same once a peer is known to be gone (a collective failed) or may be (the launcher's SIGTERM)
STORE_GRACE_S = 10.0  # the job's store failing this long: its node (rank 0's, whose launcher holds it) is dead
STORE_TIMEOUT_S = 10.0  # one store operation's limit, so that a host gone silent cannot hold the thread
RESUMES = "The same command resumes from the newest checkpoint, on these nodes or others."
_DONE, _LOST = "done", "lost"
_LAST_WORD = threading.Lock()  # held by whichever thread prints the rank's one line about a lost peer


def last_word(world: World, what: str) -> None:
    """Print the one line a rank ends with when a peer is lost (`what` happened); a second caller (the watchdog
    thread and the main thread both concluding) waits here for the process to end."""
    _LAST_WORD.acquire()
    print(f"anchor train: error: rank {world.rank}: {what}; this rank stops too. {RESUMES}", file=sys.stderr,
          flush=True)


def stop_for_lost_peer(world: World, watchdog: "Watchdog | None", error: BaseException) -> NoReturn:
    """End this rank, whose collective failed with `error` (a peer gone): the watchdog names the lost node where it
    can (`Watchdog.name_lost_node`, which then ends the process), else one line says what failed. SystemExit(1)."""
    if watchdog is not None:
        try:
            watchdog.name_lost_node()
        except KeyboardInterrupt:  # the launcher's SIGTERM, come before the wait ignores it
            watchdog.name_lost_node()
    last_word(world, f"another rank stopped or cannot be reached ({_first_line(error)})")
    raise SystemExit(1) from None


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for a bounded wait of a rank that is stopping already: a launcher that lost its
    rendezvous store with the dead node terminates its ranks, which would report an interrupt, not the node."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _store_client(host: str, port: int):
    """A connection of this thread's own to the job's store (one the main thread waits on is locked meanwhile)."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


class Watchdog:
    """Ends this rank within a minute of another node's death, whatever the main thread waits in.

    A collective (gloo, NCCL) waits `parallel.timeout_s` for a peer that is gone without closing its connections (a
    node powered off or cut from the network), a wait on the job's store does too, and no thread can interrupt
    either. So a thread on every rank, started once the process group stands:
      * beats: each node's first rank writes a counter under its node's key in the job's store every BEAT_S seconds
        (the store torchrun's launcher on rank 0's node holds; the run folder is no channel: it may be one node's);
      * watches: every rank reads the other nodes' keys; a counter unchanged for STALE_S seconds, a node marked lost,
        or the store failing for STORE_GRACE_S seconds (rank 0's node, which holds it, is gone) ends the rank: one
        line naming the node, then `os._exit(1)`;
      * its own launcher: a rank whose launcher died (its parent process changed: the launcher killed, the ranks,
        detached with setsid, left running) marks its node lost and ends the same way.
    Once a collective failed, or the launcher sent SIGTERM (torchrun stops its ranks when its rendezvous store dies
    with a node), the main thread asks (`name_lost_node`): the limits shorten to SOON_S, and it waits until the
    thread names a node or sees every other node beat again (a user's interrupt, a failure of another kind).
    The ages are measured on the watcher's clock (no clocks compared across nodes), and a watcher that was itself
    held (suspended, starved of the CPU) restarts them. The thread runs beside a rank that is busy: a long
    checkpoint write or conversion releases the interpreter's lock in its I/O and tensor work, so the node beats on.
    A node that finished, or left on an interrupt, marks itself done (`close`): its peers do not count its silence.
    """

    def __init__(self, world: World, nodes: list[Node], client: Any, address: tuple[str, int], prefix: str):
        self.world = world
        self.node = next(n for n in nodes if world.rank in n.ranks)
        self.others = [n for n in nodes if n is not self.node]
        self.store_node = next(n for n in nodes if 0 in n.ranks)
        self.leader = world.rank == self.node.ranks[0]
        self.address = address
        self.prefix = prefix
        self.parent = os.getppid()
        self._client = client
        self._asked: float | None = None  # when the main thread asked (`name_lost_node`)
        self._healthy = threading.Event()  # every other node beat after it asked: no node to name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anchor-watchdog", daemon=True)

    @classmethod
    def start(cls, world: World) -> "Watchdog | None":
        """The watchdog of this rank of an externally launched run of several processes (None otherwise); a
        collective."""
        if world.size == 1 or not launched_externally():
            return None
        nodes = run_nodes(world)
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        prefix = f"anchor/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        dog = cls(world, nodes, _store_client(*address), address, prefix)
        if dog.leader:
            dog._client.set(dog._key(dog.node), "0")
        dist.barrier()  # every node's key written before any is read
        dog._thread.start()
        return dog

    def _key(self, node: Node) -> str:
        return f"{self.prefix}node-{node.index}"

    def name_lost_node(self) -> None:
        """The main thread's question once a peer is known to be gone or may be (the class's docstring): returns when
        every other node beat again, or after a bounded wait; a node found lost ends the process first."""
        if not self.others or not self._thread.is_alive():  # one node: its launcher stops its ranks itself
            return
        with _signals_ignored():
            self._asked = time.monotonic()
            self._healthy.clear()
            self._healthy.wait(SOON_S + STORE_TIMEOUT_S + 2 * BEAT_S)

    def close(self, done: bool) -> None:
        """Stop the thread; `done`: this rank trained to the end (or leaves on an interrupt, which its own line
        reports), so its node's silence from now on is no death."""
        self._stop.set()
        if _LAST_WORD.locked():  # the rank ends over a lost peer: nothing to mark, the thread may wait on the lock
            return
        self._thread.join(STORE_TIMEOUT_S + BEAT_S)
        if done and self.leader:
            with contextlib.suppress(Exception):
                (self._client or _store_client(*self.address)).set(self._key(self.node), _DONE)

    def _die(self, what: str) -> NoReturn:
        last_word(self.world, what)
        sys.stdout.flush()
        os._exit(1)

    def _run(self) -> None:
        try:
            self._watch()
        finally:
            self._healthy.set()  # nothing more to wait for

    def _watch(self) -> None:
        beats, values = 0, {}
        tick = time.monotonic()
        changed = {n.index: tick for n in self.others}
        failing_since: float | None = None
        done: set[int] = set()
        while not self._stop.wait(BEAT_S):
            now = time.monotonic()
            # `tick` is taken after the last round's store calls: a round that waited on the store (a connection to a
            # dead store retries for STORE_TIMEOUT_S) is the store failing, not this process held.
            if now - tick > 3 * BEAT_S:  # this process was held: what it did not see, it does not count
                changed = dict.fromkeys(changed, now)
                failing_since = None
            if self.parent > 1 and os.getppid() != self.parent:
                with contextlib.suppress(Exception):
                    (self._client or _store_client(*self.address)).set(self._key(self.node), f"{_LOST} {self.parent}")
                self._die(f"{self.node}, this rank's node, lost its launcher (pid {self.parent})")
            asked = self._asked
            try:
                if self._client is None:
                    self._client = _store_client(*self.address)
                if self.leader:
                    beats += 1
                    self._client.set(self._key(self.node), str(beats))
                got = self._client.multi_get([self._key(n) for n in self.others]) if self.others else []
            except Exception as e:  # noqa: BLE001 (the store's errors share no class narrower than RuntimeError)
                tick = time.monotonic()
                self._client = None
                if self.store_node.index in done:
                    return  # rank 0's node finished: its launcher, and the store, may be gone, rightly
                failing_since = tick if failing_since is None else failing_since
                if asked is not None or tick - failing_since >= STORE_GRACE_S:
                    self._die(f"{self.store_node} stopped or cannot be reached: the job's store it holds "
                              f"({self.address[0]}:{self.address[1]}) does not answer ({_first_line(e)})")
                continue
            tick = time.monotonic()
            failing_since = None
            for node, raw in zip(self.others, got):
                value = bytes(raw).decode(errors="replace")
                if value == _DONE:
                    done.add(node.index)
                    continue
                if value.startswith(_LOST):
                    self._die(f"{node} stopped: its launcher (pid {value[len(_LOST):].strip()}) died")
                if values.get(node.index) != value:
                    values[node.index], changed[node.index] = value, now
                age, limit = now - changed[node.index], STALE_S if asked is None else SOON_S
                if age > limit:
                    self._die(f"{node} stopped: no heartbeat from it for {age:.0f} s (the limit is {limit:.0f} s)")
            # A beat seen more than one period after the question was written after it: a node that died before
            # (its last beat still unread then) shows none.
            if asked is not None and all(n.index in done or changed[n.index] > asked + BEAT_S + 1
                                         for n in self.others):
                self._healthy.set()
