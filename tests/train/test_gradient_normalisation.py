"""The trainer's gradient of one global batch, however it is split, is the oracle's single-batch
gradient of the mean loss over all counted targets (docs/DESIGN.md §8): on 2 data-parallel processes, on
2 sequence-parallel processes, and with gradient accumulation of 2 (fp32, CPU, gloo). The trainer
writes the averaged gradient at the accumulation boundary (`dump_grads`), the oracle is
`jaxref.value_and_grad` in fp64 on the same four windows."""

from __future__ import annotations

import numpy as np
import pytest

from tests.train.conftest import run_train

GLOBAL = 4
SPLITS = {
    "data_parallel_2": ("parallel.nproc=2", "data.micro_batch=2"),
    "sequence_parallel_2": ("parallel.nproc=2", "parallel.sequence_parallel=2", "data.micro_batch=4"),
    "grad_accumulation_2": ("parallel.nproc=1", "data.micro_batch=2"),
}


@pytest.fixture(scope="module")
def oracle(packed):
    import jaxref
    from anchor_core.data.packed import Loader, PackedData

    batch = next(Loader(PackedData.open(packed), batch_size=GLOBAL, variant="anchor", seed=0))
    params, config = jaxref.load_model("random:llama", seed=0)
    loss, grads = jaxref.value_and_grad(params, config, batch.tokens, positions=batch.positions,
                                        doc_ids=batch.doc_ids, loss_mask=batch.loss_mask, variant="anchor",
                                        policy="fp64")
    return float(loss), {k: np.asarray(v, dtype=np.float64) for k, v in grads.items()}


def relative_l2(got: dict, want: dict) -> float:
    num = sum(float(((got[k].astype(np.float64) - want[k]) ** 2).sum()) for k in want)
    den = sum(float((want[k] ** 2).sum()) for k in want)
    return (num / den) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("split", SPLITS)
def test_split_batch_gradient_is_the_oracles(oracle, packed, tmp_path, split):
    from safetensors.numpy import load_file

    from tests.train.conftest import metrics

    out = tmp_path / "run"
    run_train(out, "schedule.steps=1", f"data.global_batch={GLOBAL}", "model.variant=anchor", "eval.window=0", "logging.dump_grads=[1]",
              f"data.path={packed}", *SPLITS[split])
    grads = load_file(str(out / "grads" / "step-1.safetensors"))
    loss, want = oracle
    assert grads.keys() == want.keys()
    err = relative_l2(grads, want)
    worst = max(want, key=lambda k: np.linalg.norm(grads[k] - want[k]) / (np.linalg.norm(want[k]) + 1e-30))
    got_loss = metrics(out)[0]["loss"]
    print(f"{split}: loss {got_loss:.7f} vs oracle {loss:.7f}; gradient rel L2 {err:.2e} (worst parameter {worst})")
    assert abs(got_loss - loss) / loss <= 1e-6
    assert err <= 1e-6
