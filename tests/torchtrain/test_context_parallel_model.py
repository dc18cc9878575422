"""Context parallelism through a whole model (torchtrain.parallel.context.enable_context_parallel): context parallel 2
on 2 gloo processes, and Ulysses 3 × context parallel 2 on 6, against one process on the whole window: logits,
the masked next-token loss and every parameter gradient, for each variant, layout (documents cut by the window and
by every rank boundary, domain tags, interleaved chunks, padding) and CPU engine with a backward. A run whose ranks
feed contiguous shards while the attention expects balanced slots must fail the same comparison."""

from __future__ import annotations

import pytest

from tests.torchtrain.cp_model_worker import Case, run_pool

VARIANTS = ("full", "intra_doc", "intra_doc_reset", "anchor")
# float32: the same rows through the same kernels, up to matmul blocking and the order of the sums; the gradients'
# sums also run over the ranks' parts of each key's gradient (each rank's queries), summed back to its owner
TOL, GRAD_TOL = 1e-6, 1e-5
CP2 = ([Case("mistral", "sdpa", v, layout, 194) for v in VARIANTS for layout in ("plain", "tags_interleaved")]
       + [Case("mistral", e, "anchor", "interleaved", 194) for e in ("eager", "flash_varlen_emulated", "varlen")]
       + [Case("mistral", "sdpa", "anchor", "plain", 194, broken="contiguous_inputs")])
U3C2 = [Case("kv1", "sdpa", v, "tags_interleaved", 222) for v in ("intra_doc_reset", "anchor")]
FAST = {CP2[6], CP2[-2], CP2[-1]}  # sdpa and varlen on the anchor, and the broken layout: make test's


def _params(cases):
    return [pytest.param(c, id=c.key, marks=() if c in FAST else pytest.mark.slow) for c in cases]


@pytest.fixture(scope="module")
def cp2(request, tmp_path_factory):
    wanted = [c for c in CP2 if any(getattr(i, "callspec", None) and i.callspec.params.get("case") == c
                                    for i in request.session.items)]
    return run_pool(1, 2, tmp_path_factory.mktemp("cp2"), wanted)


@pytest.fixture(scope="module")
def u3c2(tmp_path_factory):
    return run_pool(3, 2, tmp_path_factory.mktemp("u3c2"), U3C2)


def _check(r: dict, key: str) -> None:
    print(f"{key}: loss {r['loss_values']} rel {r['loss']['max_rel']:.2e}; logits max rel {r['logits']['max_rel']:.2e}; "
          f"grads max rel {r['grads']['max_rel']:.2e} ({r['grads']['worst']})")
    assert r["count"][0] == r["count"][1]
    assert r["logits"]["max_rel"] <= TOL and r["loss"]["max_rel"] <= TOL and r["grads"]["max_rel"] <= GRAD_TOL


@pytest.mark.parametrize("case", _params([c for c in CP2 if not c.broken]))
def test_context_parallel_2_equals_one_process(cp2, case):
    _check(cp2[case.key], case.key)


@pytest.mark.parametrize("case", _params([c for c in CP2 if c.broken]))
def test_contiguous_inputs_fail_the_comparison(cp2, case):
    r = cp2[case.key]
    print(f"{case.key}: logits max rel {r['logits']['max_rel']:.2e}, grads {r['grads']['max_rel']:.2e}")
    assert r["logits"]["max_rel"] > 1e-3 and r["grads"]["max_rel"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("case", U3C2, ids=[c.key for c in U3C2])
def test_ulysses_3_by_context_parallel_2_equals_one_process(u3c2, case):
    _check(u3c2[case.key], case.key)
