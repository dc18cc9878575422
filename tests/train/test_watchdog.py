"""The multi-node watchdog's clock (torchtrain.parallel.distributed.Watchdog), in one process with a stand-in store.

The slow tests in tests/train/test_multinode.py kill real torchrun nodes; here the watchdog's rounds run at a
twentieth of their real periods, so that what a slow store call does to its clock is seen in seconds: a connection
to a dead store retries for the store's whole timeout, and that wait must count as the store failing, not as this
process having been held (which restarts every age and would keep a dead store's node alive forever)."""

import threading
import time

import pytest

import torchtrain.parallel.distributed as dist_mod
from torchtrain.parallel.distributed import Node, Watchdog

SCALE = 0.05  # every period of the watchdog, at this fraction of its real length (a loaded CPU keeps its beats)


class _World:
    rank = 1
    size = 2


class _DeadStore:
    """A client whose every call fails at once (the store's connection broken), as torch's TCPStore does."""

    def set(self, *_):
        raise RuntimeError("Broken pipe")

    def multi_get(self, *_):
        raise RuntimeError("Broken pipe")


@pytest.fixture
def fast(monkeypatch):
    for name in ("BEAT_S", "STALE_S", "SOON_S", "STORE_GRACE_S", "STORE_TIMEOUT_S"):
        monkeypatch.setattr(dist_mod, name, getattr(dist_mod, name) * SCALE)


def _run(client, limit_s: float, held_round: int | None = None) -> tuple[list[str], float]:
    """Run a watchdog of rank 1 (node 1) whose store (held by node 0) is `client`, until it names a lost node or
    `limit_s` pass; with `held_round`, that round's wait lasts 1.5 x STALE_S longer, as a suspended process's does.
    What it ended with and after how many seconds."""
    nodes = [Node(0, "a", (0,)), Node(1, "b", (1,))]
    dog = Watchdog(_World(), nodes, client, ("a", 1), "anchor/watchdog/0/")
    dog.parent = 0  # no launcher to watch
    said: list[str] = []
    ended = threading.Event()

    def die(what):
        said.append(what)
        ended.set()
        dog._stop.set()  # the round ends and the thread with it, as os._exit ends the process

    dog._die = die
    rounds, waits = [], dog._stop.wait

    def wait(timeout):
        rounds.append(timeout)
        if len(rounds) == held_round:
            time.sleep(1.5 * dist_mod.STALE_S)
        return waits(timeout)

    dog._stop.wait = wait
    start = time.monotonic()
    dog._thread.start()
    ended.wait(limit_s)
    dog._stop.set()
    dog._thread.join()
    return said, time.monotonic() - start


def _watch(monkeypatch, connect) -> tuple[list[str], float]:
    """The watchdog with a dead store; `connect` stands for a new connection's attempt. What it ends with and after
    how many (scaled) seconds, or nothing within 600."""
    monkeypatch.setattr(dist_mod, "_store_client", connect)
    said, took = _run(_DeadStore(), 600 * SCALE)
    return said, took / SCALE


def test_a_dead_store_that_refuses_at_once_ends_the_rank_after_its_grace(fast, monkeypatch):
    def refused(*_):
        raise RuntimeError("Connection refused")

    said, took = _watch(monkeypatch, refused)
    assert said and said[0].startswith("node 0 (rank 0 on a) stopped or cannot be reached: the job's store"), said
    assert took < 60, took


def test_connections_that_wait_out_their_timeout_still_end_the_rank_within_a_minute(fast, monkeypatch):
    """Each new connection waits STORE_TIMEOUT_S (5 beats) before it fails: rounds far longer than three beats."""
    def slow_refusal(*_):
        time.sleep(dist_mod.STORE_TIMEOUT_S)
        raise RuntimeError("Connection timed out")

    said, took = _watch(monkeypatch, slow_refusal)
    assert said and "the job's store it holds (a:1) does not answer (Connection timed out)" in said[0], said
    assert took < 60, took


def test_a_process_held_between_rounds_restarts_the_ages(fast, monkeypatch):
    """The other side of the clock: a watchdog that was itself held (suspended, starved) does not count what it did
    not see. Its store answers, node 0 never beats: it is called silent only STALE_S after the hold ended."""
    class Quiet:
        def set(self, *_):
            pass

        def multi_get(self, keys):
            return [b"7" for _ in keys]  # node 0's counter, never changing

    # node 0's counter is first read in round 1; round 2 is held
    said, took = _run(Quiet(), 20 * dist_mod.STALE_S, held_round=2)
    assert said and "no heartbeat from it" in said[0], said
    # node 0's counter was first read in round 1; the hold (1.5 x STALE_S) did not count towards its age
    assert took >= 1.5 * dist_mod.STALE_S + dist_mod.STALE_S * 0.9, took
