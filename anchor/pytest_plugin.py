"""The pytest plugin (entry point `pytest11: anchor`, installed with the package): precision checks of your
own stack in your own tests, held against the oracle (docs/ci.md, examples/ci/).

    def test_my_attention(anchor_parity):                  # a transformers AttentionInterface function
        anchor_parity("random:llama", attention=my_attention, variants=["intra_doc", "anchor"])

    def test_stock_sdpa_packs_documents(anchor_parity):    # transformers' own implementation
        anchor_parity("random:llama", implementations=["sdpa"], variants=["intra_doc_reset"])

    def test_rope_drift_in_bf16(anchor_audit):             # the precision audit with your thresholds
        anchor_audit("random:llama", policy="paper_bf16", max_D=0.05)

    def test_my_training_step(anchor_check_step):          # your model on one batch of your own collator
        anchor_check_step(model, batch, variants=["intra_doc_reset", "anchor"])

`anchor_parity` runs `parity_tests.hf_stack.run_hf_stack` (a model name of docs/DESIGN.md §6 or your own
transformers causal LM of a supported family) and fails the test with one paragraph naming the
implementation, the variant asked, what it computes instead, and the first diverging layer and quantity with
its error and tolerance; it returns the report. `anchor_audit` runs the quick audit (`anchor audit
--quick`: one window of 64 tokens, six shifts) and fails where the mean attention drift D of any shift
exceeds `max_D`. `anchor_check_step` runs `anchor.check_step`: `model(**batch)` exactly as your
loop calls it, which variant that computes against the oracle, and which documents see each other
(docs/guides/hf-trainer.md). Nothing heavy is imported until a fixture is used.

The fixtures need the `oracle` extra (JAX); without it each fails its test at set-up with one line naming the
pip command, before any work (the plugin itself loads in every pytest run of an environment that has the
package, so it imports nothing of the extra).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import pytest

from anchor_core import extras

if TYPE_CHECKING:
    from parity_tests.step_check import StepCheck

ORACLE_MODULES = ("jax", "flax", "optax")  # what the fixtures import of the oracle extra (jaxref)


def require_oracle(fixture: str) -> None:
    """Fail the test with one line where the oracle extra is not installed (parity_tests imports JAX)."""
    line = extras.missing_line("oracle", f"the {fixture} fixture", *ORACLE_MODULES)
    if line is not None:
        pytest.fail(line, pytrace=False)


def _where(first: dict[str, Any] | None) -> str:
    if not first:
        return "no single layer (every tap within its tolerance)"
    layer = first["layer"]
    place = f"layer {layer}" if isinstance(layer, int) else str(layer)
    return f"{place}, quantity `{first['tap']}`: relative L2 error {first['rel_l2']:.3g} > tolerance {first['tol']:.3g}"


def parity_message(row: dict[str, Any], result: dict[str, Any]) -> str:
    """One paragraph: what was asked, what it computes, and where it first diverges."""
    asked = (f"anchor parity: {row['implementation']} on {result['model']} (T={result['seq_len']}), "
             f"variant {row['variant']} asked")
    status = row["status"]
    if status == "error":
        return f"{asked}: it raised {row['error']}."
    fp32 = (row.get("fp32") or {}).get("first_divergence")
    if status == "instead":
        return (f"{asked}: it computes {row['computes']} instead (its float32 output matches the oracle's "
                f"{row['computes']}); against {row['variant']} it first diverges at {_where(fp32)}.")
    if status == "none":
        return (f"{asked}: it computes none of the variants (closest: {row['closest']}); in float32 it first "
                f"diverges at {_where(fp32)}.")
    b = row["bf16"] or {}
    return (f"{asked}: it computes the variant, but fails the bf16 rule (2 x the {b.get('policy', '?')} "
            f"emulation's error + floor) first at {_where(b.get('first_divergence'))}.")


@pytest.fixture
def anchor_parity() -> Callable[..., dict[str, Any]]:
    """`anchor_parity(model, *, attention=None, implementations=None, variants=("intra_doc",), seq_len=97,
    rope_in="model", dtypes=("float32", "bfloat16"), **kw)`: hold the stack against the oracle; a failure
    names the first diverging layer and quantity. Returns the report (`run_hf_stack`'s dict)."""
    require_oracle("anchor_parity")

    def check(model: Any = "random:llama", *, attention: Any = None, implementations: Sequence[str] | None = None,
              variants: Sequence[str] = ("intra_doc",), seq_len: int = 97, rope_in: str = "model",
              dtypes: Sequence[str] = ("float32", "bfloat16"), **kw: Any) -> dict[str, Any]:
        from parity_tests.hf_stack import passed, run_hf_stack

        result = run_hf_stack(model, attention=attention, implementations=implementations, variants=list(variants),
                              seq_len=seq_len, rope_in=rope_in, dtypes=list(dtypes), **kw)
        bad = [r for r in result["rows"] if not passed(r)]
        if bad:
            pytest.fail(parity_message(bad[0], result)
                        + (f" ({len(bad) - 1} more row(s) fail.)" if len(bad) > 1 else ""), pytrace=False)
        return result

    return check


@pytest.fixture
def anchor_audit() -> Callable[..., dict[str, Any]]:
    """`anchor_audit(model, *, policy="paper_bf16", max_D, **settings)`: the quick precision audit of one
    dtype policy; fails where the mean attention drift D at any shift exceeds `max_D`. Returns the audit."""
    require_oracle("anchor_audit")

    def check(model: str = "random:llama", *, policy: str = "paper_bf16", max_D: float, **settings: Any) -> dict[str, Any]:
        from parity_tests.audit.runner import run_audit

        result = run_audit(model, [policy], quick=True, **settings)
        name = next(iter(result["shift_curve"]))
        curve = result["shift_curve"][name]
        worst = max(range(len(curve["shifts"])), key=lambda i: curve["D"][i])
        if curve["D"][worst] > max_D:
            pytest.fail(f"anchor audit: {model} under {name}: shifting every position by {curve['shifts'][worst]} "
                        f"moves the attention by D = {curve['D'][worst]:.3g} (mean over layers, heads and rows of "
                        f"the total variation against the shift {curve['ref_shift']}), above max_D = {max_D:g}.",
                        pytrace=False)
        return result

    return check


CHECK_STEP_KEYWORDS: tuple[str, ...] = ("variants", "dtype", "doc_ids", "probe", "probe_document", "emulation")


def check_step_or_fail(model: Any = None, batch: Any = None, **kw: Any) -> StepCheck:
    """What `anchor_check_step` runs: parity_tests.blackbox.check_step, failing the test with its one-paragraph
    message; an input error (a batch without input_ids, an unknown variant, an unknown keyword) fails it
    with one paragraph naming this fixture's keyword, without a traceback."""
    from anchor_core.errors import InputError

    unknown = sorted(set(kw) - set(CHECK_STEP_KEYWORDS))
    if unknown:
        pytest.fail(f"anchor_check_step: unknown keyword {unknown[0]!r} (known: model, batch, "
                    f"{', '.join(CHECK_STEP_KEYWORDS)})", pytrace=False)
    if model is None or batch is None:
        pytest.fail("anchor_check_step: give model (your transformers causal LM) and batch (the dict your loop "
                    "passes to model(**batch))", pytrace=False)
    from parity_tests.blackbox import check_step

    try:
        report = check_step(model, batch, **kw)
    except InputError as e:
        pytest.fail(f"anchor_check_step: {e}", pytrace=False)
    if not report["pass"]:
        pytest.fail(report["message"], pytrace=False)
    return report


@pytest.fixture
def anchor_check_step() -> Callable[..., StepCheck]:
    """`anchor_check_step(model, batch, *, variants="all", dtype=None, doc_ids=None, probe=True,
    probe_document=None, emulation=None)`: run your model on one batch of your collator exactly as your loop
    does (model(**batch)) and fail unless it computes one of `variants` against the oracle (and, in bfloat16,
    passes the bf16 rule; and the perturbation probe moves no other document unless "full" is asked).
    Returns the report: a StepCheck (parity_tests.step_check), as anchor.check_step returns it."""
    require_oracle("anchor_check_step")
    return check_step_or_fail
