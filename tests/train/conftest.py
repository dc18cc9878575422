"""Shared fixtures of the trainer tests: a packed corpus made once, runs as processes of their own
(forked from one that has imported the trainer: tests/forked.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests import forked

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "train" / "tiny.yaml"
ENV = forked.ENV  # one intra-op thread per run; the environment the fork server was started with


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Short documents (10 to 250 characters, cut from the embedded corpus, seeded), so a window of
    128 byte tokens holds two to three documents and the variants differ."""
    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus

    root = tmp_path_factory.mktemp("train-corpus")
    write_default_corpus(root / "full", max_docs_per_domain=10)
    rng = np.random.default_rng(0)
    out = root / "short.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for line in (root / "full" / CORPUS_FILE).read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            text, i = rec["text"], 0
            while i < len(text) - 10:
                n = int(rng.integers(10, 250))
                f.write(json.dumps({"text": text[i:i + n], "domain": rec["domain"]}) + "\n")
                i += n
    return out


def pack_for(corpus: Path, out: Path, *, tags: bool = False, interleave: bool = False) -> Path:
    """The corpus packed for random:llama at T=128 (the tiny config's model and length)."""
    from anchor_core.data.mixture import MixtureSpec
    from anchor_core.data.packing import Layout
    from anchor_core.data.pipeline import PackConfig, pack_corpus

    pack_corpus("random:llama", corpus, out, PackConfig(seq_len=128, mixture=MixtureSpec(budget=60000),
                                                        layout=Layout(tags=tags, interleave=interleave)))
    return out


@pytest.fixture(scope="session")
def packed(corpus, tmp_path_factory) -> Path:
    return pack_for(corpus, tmp_path_factory.mktemp("train-data") / "pack")


def train_args(out: Path, *overrides: str, config: Path = TINY) -> list[str]:
    """`anchor train`'s arguments for a run of `config` in `out` (tests.forked runs them)."""
    return ["train", "--config", str(config), "--out", str(out), "--no-progress", *overrides]


def run_train(out: Path, *overrides: str, config: Path = TINY, check: bool = True,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """`anchor train` in a process of its own, forked from one that imported the trainer (tests.forked)."""
    p = forked.run(train_args(out, *overrides, config=config), env or ENV, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"anchor train failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_weights(run: Path, step: int) -> dict[str, np.ndarray]:
    from anchor_core.weights import read_safetensors

    return read_safetensors(run / "checkpoints" / f"step-{step}" / "hf" / "model.safetensors")


DETERMINISTIC = ("step", "loss", "tokens", "lr", "grad_norm", "flops")  # tokens_per_s, elapsed_s, mfu: timings


def kill_after(args: list[str], run: Path, lines: int, *, job: bool = False) -> int:
    """Start `anchor ARGS` (a training run into `run`), SIGKILL it once its metrics.jsonl has `lines` lines; returns
    the lines seen. `job`: the whole job (the launcher and its ranks, one process group) killed as a scheduler
    would. Fails when the run ended by itself first."""
    path = run / "metrics.jsonl"

    def seen() -> int:
        return len(path.read_text().splitlines()) if path.is_file() else 0

    kill_when(args, lambda: seen() >= lines, job=job)
    return seen()


def kill_when(args: list[str], ready: Callable[[], bool], *, env: dict | None = None, job: bool = False,
              what: str = "") -> None:
    """Start `anchor ARGS` (with `env`, default ENV), SIGKILL it once `ready()` holds (polled every 5 ms); `job` as
    for kill_after. Fails when the run ended by itself first."""
    p = forked.Run(args, ENV if env is None else env, new_session=job)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not ready():
        time.sleep(0.005)
    if job:
        os.killpg(p.pid, signal.SIGKILL)
    else:
        p.kill()
    p.wait()
    assert p.returncode == -9, f"the run ended by itself ({p.returncode}) before the kill {what}:\n{p.stderr()[-2000:]}"


def heldout_reference(hf: Path, data: Path, held: int, edges: np.ndarray) -> tuple[float, list[float], int]:
    """The loss of `data`'s `held` held-out windows (seed 0) under the exported weights in `hf`, through
    transformers' forward (anchor_sdpa, full logits, float64 cross-entropy): overall, per slot range of `edges`,
    and the predictions counted."""
    import torch
    from transformers import AutoModelForCausalLM

    import torchtrain.hf  # noqa: F401  (registers anchor_sdpa)
    from anchor_core.data.packed import PackedData, heldout_windows
    from torchtrain.parallel.ulysses import counted_predictions

    packed = PackedData.open(data)
    model = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="anchor_sdpa", dtype=torch.float32)
    batch = packed.batch(heldout_windows(packed.num_windows, held, 0), "anchor")
    tokens = torch.as_tensor(batch.tokens, dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=torch.as_tensor(batch.positions, dtype=torch.long),
                       doc_ids=torch.as_tensor(batch.doc_ids, dtype=torch.long), variant="anchor").logits.double()
    targets = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    counted = counted_predictions(torch.as_tensor(batch.loss_mask)).double()
    per_slot, n = (ce * counted).sum(0).numpy(), counted.sum(0).numpy()
    by = [per_slot[a:b].sum() / n[a:b].sum() for a, b in zip(edges[:-1], edges[1:])]
    return per_slot.sum() / n.sum(), by, int(n.sum())
