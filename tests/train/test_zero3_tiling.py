"""The long-window pieces under ZeRO-3: the tiled MLP (`torchtrain.model.tiling`) and the lm-head fused with the loss
(`torchtrain.model.loss.lm_head_cross_entropy`) on 2 gloo processes give each step's loss and gradient norm of the same
run with both off (the MLP whole, the loss from the whole [B, T, V] logits), within the fp32 rule; a planted error
in either is caught by the same comparison; and the config that asks for them at ZeRO-3 is accepted.

The runs: random:llama (untied head) and random:qwen2 (head tied to the embedding) at T = 129, 2 ranks of 2
windows each, 3 steps. Each rank's 258 rows are 4 tiles of the MLP (84 rows, the hidden size; the last of 6) and,
with at most 97 rows per chunk, 3 chunks of the fused loss. The ranks run every variant one after another in the
same 2 processes (`trainer.worker` on a run folder prepared here), forked from the fork server that has imported
the trainer (tests/forked.py): the runs' cost is their steps, not their imports.

The rule: per step, |on - off| <= 2 |reordered - off| + eps32 |off|, where `reordered` is the off run with its
batch split in micro-batches of 1 (gradient accumulation: the same sums in another order, DeepSpeed adding the
micro-steps' gradients in fp32), the measured rounding of the same arithmetic; the tiles and chunks sum the same
terms in another order. The floor of one fp32 epsilon covers a step where the reordered run rounds to the off
run exactly (as tests/torchtrain/test_tiling.py's rule for the loss). Measured: |on - off| up to 1e-6 of losses
near 27 (about a third of the floor), the reordered run 0.5-2e-6 from the off run.
"""

from __future__ import annotations

import functools
import json
import os
import traceback
from pathlib import Path

import numpy as np
import pytest

from tests import forked
from tests.train.conftest import TINY

STEPS, T = 3, 129
COMMON = (f"schedule.steps={STEPS}", f"data.seq_len={T}", "data.global_batch=4", "eval.window=0",
          "checkpoint.save_every=0", "parallel.nproc=2", "parallel.zero_stage=3")
OFF = ("model.tiled_mlp=false", "data.micro_batch=2")
REORDERED = ("model.tiled_mlp=false", "data.micro_batch=1")
ON = ("model.tiled_mlp=true", "data.micro_batch=2")
CHUNK_ROWS = 97  # rows per chunk of the fused loss in the `on` runs: 258 rows in 3 chunks

# variant: (model, config overrides, what the rank patches in: see `_patch`)
VARIANTS = {
    "off": ("llama", OFF, ("unfused",)),
    "reordered": ("llama", REORDERED, ("unfused",)),
    "on": ("llama", ON, ("small_chunks",)),
    "on_checkpointed": ("llama", (*ON, "model.activation_checkpointing=true"), ("small_chunks",)),
    "tied_off": ("qwen2", OFF, ("unfused",)),
    "tied_reordered": ("qwen2", REORDERED, ("unfused",)),
    "tied_on": ("qwen2", ON, ("small_chunks",)),
    # planted errors: the second tile moved by one row (an overlap and a gap, the row count intact) with the
    # cover check off; the lm-head's weight detached from the fused loss (its gradient not routed back)
    "tile_shifted": ("llama", ON, ("shift_tile",)),
    "head_not_routed": ("llama", ON, ("detach_head",)),
}


def _patch(what: tuple[str, ...]) -> list:
    """Patch this rank's modules as a variant asks; the (module, name, value) triples to put back."""
    from torchtrain.model import loss
    from torchtrain.model import tiling
    from torchtrain.training import trainer

    undo = []

    def put(module, name, value):
        undo.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    for w in what:
        if w == "unfused":  # the loss from the whole logits: the reference the fused loss is held to
            put(trainer, "_micro_batch_loss", functools.partial(trainer._micro_batch_loss, fused=False))
        elif w == "small_chunks":
            put(loss, "_CHUNK_ELEMENTS", CHUNK_ROWS * 331)  # the random presets' vocabulary
        elif w == "shift_tile":
            good = tiling.tile_ranges

            def shifted(rows, tile):
                ranges = good(rows, tile)
                s, e = ranges[1]
                ranges[1] = (s + 1, e + 1)
                return ranges

            put(tiling, "tile_ranges", shifted)
            put(tiling, "_check_cover", lambda ranges, rows: None)
        elif w == "detach_head":
            fused = loss.linear_cross_entropy
            put(loss, "linear_cross_entropy", lambda h, w, t, b=None: fused(h, w.detach(), t, b))
        else:
            raise ValueError(w)
    return undo


def _rank(rank: int, port: int, jobs: list[tuple[str, str]], errors: str) -> None:
    """One rank of the 2-process world: `trainer.worker` on each prepared run folder in turn, patched as its
    variant asks; the checkpoint of the last step is not written (the comparison reads metrics.jsonl only)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torchtrain.training import checkpoint
    from torchtrain.training import trainer

    checkpoint.Checkpointer.save = lambda self, step, elapsed_s: None
    generated = trainer.deepspeed_config

    def every_weight_partitioned(cfg, world):
        """DeepSpeed keeps a parameter of at most 1e5 values whole on every rank by default (all of random:llama's):
        here every one is partitioned and gathered around each call that uses it, as a 7B model's are."""
        config = generated(cfg, world)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return config

    trainer.deepspeed_config = every_weight_partitioned
    code = 0
    for variant, run in jobs:
        undo = _patch(VARIANTS[variant][2])
        try:
            trainer.worker(run, False)
        except BaseException:
            Path(errors, f"{variant}-{rank}.txt").write_text(traceback.format_exc())
            code = 1
            break  # the other rank stops at its next collective: the parent ends it
        finally:
            for module, name, value in reversed(undo):
                setattr(module, name, value)
    os._exit(code)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, list[dict]]:
    """Every variant's metrics.jsonl rows, trained in one 2-process world."""
    from anchor_core.data.mixture import MixtureSpec
    from anchor_core.data.pipeline import PackConfig, pack_corpus
    from torchtrain.config import load_train_config
    from torchtrain.parallel.distributed import free_port
    from torchtrain.training.run_folder import prepare_run
    root = tmp_path_factory.mktemp("zero3-tiling")
    packs = {}
    for m in ("llama", "qwen2"):
        packs[m] = root / f"pack-{m}"
        pack_corpus(f"random:{m}", corpus, packs[m], PackConfig(seq_len=T, mixture=MixtureSpec(budget=6000)))
    jobs = []
    for variant, (model, overrides, _) in VARIANTS.items():
        cfg = load_train_config(TINY, [*COMMON, f"model.name=random:{model}", f"data.path={packs[model]}", *overrides])
        prepare_run(cfg, root / variant, progress=False)
        jobs.append((variant, str(root / variant)))
    errors = root / "errors"
    errors.mkdir()
    ctx = forked._context(forked.ENV)
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, jobs, str(errors))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(600)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join()
    failed = sorted(errors.iterdir())
    assert not failed and all(p.exitcode == 0 for p in procs), \
        "\n".join(f"{f.name}:\n{f.read_text()[-3000:]}" for f in failed) or [p.exitcode for p in procs]
    return {v: [json.loads(line) for line in (root / v / "metrics.jsonl").read_text().splitlines()] for v in VARIANTS}


def disagreements(on: list[dict], off: list[dict], reordered: list[dict], what: str) -> list[str]:
    """The steps and quantities (loss, grad_norm) where `on` breaks the rule (module docstring) against `off`,
    with `reordered` the measured rounding; each comparison printed."""
    bad = []
    assert [r["tokens"] for r in on] == [r["tokens"] for r in off] == [r["tokens"] for r in reordered]
    for key in ("loss", "grad_norm"):
        a, b, c = (np.array([r[key] for r in rows], dtype=np.float64) for rows in (off, on, reordered))
        base = np.abs(c - a)
        bound = 2 * base + np.finfo(np.float32).eps * np.abs(a)
        diff = np.abs(b - a)
        print(f"{what} {key}: off {a}\n  on {b}\n  |on - off| {diff}\n  |reordered - off| {base}\n  bound {bound}")
        bad += [f"{key} at step {s + 1}" for s in np.nonzero(diff > bound)[0]]
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("on,off,reordered", [("on", "off", "reordered"),
                                              ("on_checkpointed", "off", "reordered"),
                                              ("tied_on", "tied_off", "tied_reordered")],
                         ids=["untied", "checkpointed", "tied"])
def test_zero3_tiled_and_fused_equal_the_plain_run(runs, on, off, reordered):
    assert disagreements(runs[on], runs[off], runs[reordered], on) == []


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["tile_shifted", "head_not_routed"])
def test_a_planted_error_is_caught(runs, planted):
    bad = disagreements(runs[planted], runs["off"], runs["reordered"], planted)
    assert bad, f"{planted}: the comparison did not catch it"
    assert "grad_norm at step 1" in bad


def test_tiled_mlp_is_accepted_at_zero3():
    from torchtrain.config import load_train_config

    cfg = load_train_config(TINY, ["model.tiled_mlp=true", "parallel.zero_stage=3"])
    assert (cfg.model.tiled_mlp, cfg.parallel.zero_stage) == (True, 3)


def test_the_paper_configs_tile_and_checkpoint_at_zero3():
    from torchtrain.config import load_train_config

    paper = sorted((TINY.parent / "paper").glob("*.yaml"))
    assert len(paper) >= 12
    for path in paper:
        cfg = load_train_config(path)
        assert (cfg.parallel.zero_stage, cfg.model.tiled_mlp, cfg.model.activation_checkpointing) == (3, True, True), path
