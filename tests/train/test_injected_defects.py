"""Injected gradient defects, each caught and named by the oracle comparison (issue: the oracle
covers training). The trainer runs with one defect patched in (tests/train/defects/sitecustomize.py,
in every process of the run); its step-1 gradient (`dump_grads`) and its parameters after that
step (the step-1 `hf/` export) are held against `jaxref.value_and_grad` and `jaxref.adamw` in fp64,
and `diagnose` must name what went wrong."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.train.conftest import ENV, TINY, run_train
from tests.train.test_gradient_normalisation import GLOBAL, relative_l2

DEFECTS = Path(__file__).parent / "defects"
TOL = 1e-6
# AdamW's first update is about lr * sign(g), so a gradient element near zero amplifies fp32's error:
# an element whose true gradient is smaller than the trainer's measured gradient error (twice the
# parameter's max-abs error) has no determined sign in fp32; where the trainer's sign differs from
# the oracle's there, the element is left out of the update's comparison (one such sign flip in layer 0's up_proj of random:llama, 8148 elements, moved its
# update by 1.7e-2). On the rest, the clean trainer's update is within 1.2e-3 (relative L2 per
# parameter) of the oracle's; weight decay on the norms moves theirs by 1e-1.
STEP_TOL = 1e-2


def _backwards(names):
    """Parameters in the order the backward pass reaches them: head, final norm, last layer first."""
    def key(n):
        if n.startswith("model.layers."):
            return (1, -int(n.split(".")[2]))
        return {"lm_head.weight": (0, 0), "model.norm.weight": (0, 1)}.get(n, (2, 0))
    return sorted(names, key=key)


def diagnose(got: dict, want: dict, got_after: dict | None = None, want_after: dict | None = None,
             start: dict | None = None) -> str | None:
    """None when the trainer's gradient (and its parameters after the step) are the oracle's; else
    one line naming the defect."""
    err = relative_l2(got, want)
    if err > TOL:
        dot = sum(float((got[k].astype(np.float64) * want[k]).sum()) for k in want)
        norm2 = sum(float((want[k] ** 2).sum()) for k in want)
        ratio = dot / norm2
        rest = relative_l2({k: got[k] / ratio for k in got}, want)
        if rest <= TOL:
            return f"gradients scaled by {ratio:.3f} (rel L2 {err:.2e}; the direction is right)"
        per = {k: np.linalg.norm(got[k] - want[k]) / (np.linalg.norm(want[k]) + 1e-30) for k in want}
        first = next(k for k in _backwards(want) if per[k] > TOL)
        return f"gradient differs (rel L2 {err:.2e}); first diverging parameter going backwards from the loss: {first}"
    if got_after is not None:
        # the update itself (parameters after minus before), per parameter, in relative L2
        per, undetermined = {}, 0
        for k in want_after:
            g_err = float(np.abs(got[k].astype(np.float64) - want[k]).max())
            # left out: elements whose gradient sign the trainer got wrong within its measured error
            flipped = (np.sign(got[k]) != np.sign(want[k])) & (np.abs(want[k]) <= 2.0 * g_err)
            sure = ~flipped
            undetermined += int((~sure).sum())
            per[k] = float(np.linalg.norm((got_after[k] - want_after[k])[sure])
                           / np.linalg.norm((want_after[k] - start[k])[sure]))
        print(f"{undetermined} gradient elements within the measured fp32 error of zero (sign flipped) left out of the update check")
        print("update rel L2, worst three:", [(k, f"{v:.1e}") for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:3]])
        bad = sorted((k for k, v in per.items() if v > STEP_TOL), key=lambda k: -per[k])
        if bad:
            return (f"gradients agree but the optimizer step differs at {len(bad)} parameters, "
                    f"most at {bad[0]} ({per[bad[0]]:.1e} of its update)")
    return None


@pytest.fixture(scope="module")
def oracle(packed):
    import jaxref
    import optax

    from anchor_core.data.packed import Loader, PackedData
    from torchtrain.config import load_train_config
    from torchtrain.training.optim import lr_factor

    cfg = load_train_config(TINY, ["schedule.steps=1"])
    batch = next(Loader(PackedData.open(packed), batch_size=GLOBAL, variant="anchor", seed=0))
    params, config = jaxref.load_model("random:llama", seed=0)
    _, grads = jaxref.value_and_grad(params, config, batch.tokens, positions=batch.positions, doc_ids=batch.doc_ids,
                                     loss_mask=batch.loss_mask, variant="anchor", policy="fp64")
    grads = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    start = {k: np.asarray(v, np.float64) for k, v in jaxref.hf_state(params, config).items()}
    opt = jaxref.adamw(cfg.optim.lr * lr_factor(cfg, 0), betas=cfg.optim.betas, eps=cfg.optim.eps,
                       weight_decay=cfg.optim.weight_decay,
                       no_decay=cfg.optim.no_decay)
    updates, _ = opt.update(grads, opt.init(start), start)
    return grads, {k: np.asarray(v) for k, v in optax.apply_updates(start, updates).items()}, start


def _trainer(out: Path, packed: Path, defect: str | None, *split: str):
    from safetensors.numpy import load_file

    from anchor_core.weights import read_safetensors

    env = dict(ENV)
    if defect:
        env.update(ANCHOR_TEST_DEFECT=defect, PYTHONPATH=os.pathsep.join([str(DEFECTS), env.get("PYTHONPATH", "")]))
    run_train(out, "schedule.steps=1", f"data.global_batch={GLOBAL}", "model.variant=anchor", "eval.window=0", "logging.dump_grads=[1]",
              "optim.grad_clip=0", f"data.path={packed}", *split, env=env)
    grads = load_file(str(out / "grads" / "step-1.safetensors"))
    return grads, read_safetensors(out / "checkpoints" / "step-1" / "hf" / "model.safetensors")


CASES = {  # defect: (how the run is split, what the diagnosis must say)
    None: (("parallel.nproc=2", "data.micro_batch=2"), None),
    "per_rank_mean": (("parallel.nproc=2", "data.micro_batch=2"), "gradient differs"),
    "sp_scaled": (("parallel.nproc=2", "parallel.sequence_parallel=2", "data.micro_batch=4"), "gradients scaled by 2.000"),
    "anchor_counted": (("parallel.nproc=1", "data.micro_batch=4"), "gradient differs"),
    "last_counted": (("parallel.nproc=1", "data.micro_batch=4"), "gradient differs"),
    "decay_on_norms": (("parallel.nproc=1", "data.micro_batch=4"), "optimizer step differs"),
}


@pytest.mark.slow
@pytest.mark.parametrize("defect", CASES, ids=[str(d) for d in CASES])
def test_defect_is_caught_and_named(oracle, packed, tmp_path, defect):
    split, expected = CASES[defect]
    grads, after = _trainer(tmp_path / "run", packed, defect, *split)
    want, want_after, start = oracle
    found = diagnose(grads, want, after, want_after, start)
    print(f"{defect}: {found}")
    if expected is None:
        assert found is None  # the clean trainer passes the same check
    else:
        assert found is not None and expected in found
    if defect == "decay_on_norms":
        assert "norm" in found
