"""One parity pipeline: transformers' own implementations and users' functions are runners of the same
registry as torchtrain's engines, recorded by the one tap recorder (torchtrain.capture_taps), held against
the one oracle cache (runners.oracle) and judged by the one judge (core.hold, suite.judge_case)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import jaxref
from anchor_core.errors import InputError
from parity_tests import runners
from parity_tests.cases import BF16, Case, case_inputs
from parity_tests.hf_stack import StackRunner, hold, named_subject, stock, stock_model, user_stack
from parity_tests.runners import as_arrays, get_runner, registered
from parity_tests.suite import run_case, run_parity

MODEL = "random:llama"
T = 97
HERE = Path(__file__).resolve().parent


def test_transformers_implementations_are_runners_of_the_suite():
    """`hf:IMPLEMENTATION@STYLE` is a runner the suite runs as it runs an engine: sdpa given the anchor
    mask as a 4-D float mask computes anchor in fp32 and passes the bf16 rule (its emulation: the CPU
    kernel's); given the flattening collator's batch (use_cache=False) it is asked intra_doc and computes
    intra_doc_reset, so the suite's case fails at layer 0's q (the positions restart)."""
    runner = get_runner("hf:sdpa@mask4d-float")
    assert isinstance(runner, StackRunner) and runner.stack.inputs == "mask4d-float"
    assert runner.emulation == "sdpa_cpu_bf16"
    result = run_parity([Case(MODEL, "anchor", "plain", "fp32", "hf:sdpa@mask4d-float", T),
                         Case(MODEL, "anchor", "plain", BF16, "hf:sdpa@mask4d-float", T)])
    assert result["pass"], [(c["id"], c["first_divergence"]) for c in result["cases"]]
    assert [c["engine"] for c in result["cases"]] == ["hf:sdpa@mask4d-float"] * 2
    reset = run_case(Case(MODEL, "intra_doc", "plain", "fp32", "hf:sdpa@flattening-nocache", T))
    assert not reset["pass"] and reset["first_divergence"]["layer"] == 0 and reset["first_divergence"]["tap"] == "q"


def test_an_unknown_implementation_or_style_is_one_line():
    with pytest.raises(InputError, match="unknown input style 'mask3d'"):
        get_runner("hf:sdpa@mask3d")
    with pytest.raises(InputError, match="unknown implementation 'fast'"):
        get_runner("hf:fast")
    with pytest.raises(InputError, match=r"hf:IMPLEMENTATION\[@INPUT_STYLE\]"):
        get_runner("nonesuch")


def test_the_cli_runs_a_stock_implementation_as_an_engine(tmp_path):
    from anchor.cli import main

    with pytest.raises(SystemExit) as e:
        main(["parity", "--model", MODEL, "--engines", "hf:eager@mask4d-float", "--variants", "intra_doc",
              "--policies", "fp32", "--seq-len", str(T), "--out", str(tmp_path / "r")])
    assert e.value.code == 0
    assert (tmp_path / "r" / "parity.json").is_file() and (tmp_path / "r" / "index.html").is_file()


def test_a_users_function_is_a_registered_runner_while_it_is_held():
    """Inside `registered`, a user's function is found by name like any engine and the suite holds it."""
    from torchtrain.hf import anchor_sdpa

    stack = user_stack(anchor_sdpa, name="users_anchor")
    runner = StackRunner(stack, named_subject(MODEL))
    assert runner.name == "hf:users_anchor"
    with registered(runner):
        assert get_runner("hf:users_anchor") is runner
        assert run_case(Case(MODEL, "anchor", "plain", "fp32", "hf:users_anchor", T))["pass"]
    with pytest.raises(InputError):
        get_runner("hf:users_anchor")


def test_the_recorder_of_the_engines_records_a_stock_model():
    """torchtrain.capture_taps on transformers' own sdpa (given the anchor mask as a 4-D float mask) and on
    torchtrain's sdpa engine, same weights and tokens: the same taps, the attention rows included (read
    under the variant given to the recorder)."""
    import torchtrain
    from parity_tests.hf_stack import feed
    from torchtrain.model.taps import capture_taps

    subject = named_subject(MODEL)
    inputs = case_inputs(Case(MODEL, "anchor", seq_len=T))
    doc_ids = torch.from_numpy(inputs.doc_ids)
    model = stock_model(subject.spec, subject.state, "float32", attn_implementation="sdpa")
    with torch.no_grad(), capture_taps(model, list(inputs.rows), doc_ids=doc_ids, variant="anchor") as taps:
        model(**feed(stock("sdpa", "mask4d-float"), inputs, "anchor"))
    stock_taps = as_arrays(taps)
    engine = torchtrain.build_model(MODEL, engine="sdpa").eval()
    with torch.no_grad(), capture_taps(engine, list(inputs.rows)) as taps:
        engine(input_ids=torch.from_numpy(inputs.tokens), position_ids=torch.from_numpy(inputs.positions),
               doc_ids=doc_ids, variant="anchor", use_cache=False)
    engine_taps = as_arrays(taps)
    assert set(stock_taps) == set(engine_taps) >= {"q", "k", "scores", "probs", "hidden", "logits"}
    real = inputs.real
    for name in stock_taps:
        a, b = stock_taps[name], engine_taps[name]
        if name not in ("scores", "probs"):
            a, b = a[:, real], b[:, real]
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-5, (name, rel)


def test_rows_of_a_model_without_an_engine_need_their_mask():
    from torchtrain.model.taps import capture_taps

    subject = named_subject(MODEL)
    model = stock_model(subject.spec, subject.state, "float32", attn_implementation="sdpa")
    with pytest.raises(InputError, match="doc_ids= and variant="), torch.no_grad(), capture_taps(model, [3]):
        model(input_ids=torch.arange(9)[None], use_cache=False)


def test_a_row_and_a_case_on_the_same_inputs_share_the_oracle(monkeypatch):
    """The suite's case and a transformers row on the same model and inputs use the same oracle runs: after
    the case (fp64 truth and the fp32 policy's run of intra_doc), the row's identification runs the oracle
    only for the three other variants (fp64 truth and the fp32 run the fp32 rule measures against)."""
    calls = []
    forward = jaxref.forward
    monkeypatch.setattr(jaxref, "forward", lambda *a, **k: calls.append(k["variant"]) or forward(*a, **k))
    runners.clear_oracle_cache()
    assert run_case(Case(MODEL, "intra_doc", "plain", "fp32", "sdpa", T))["pass"]
    assert sorted(calls) == ["intra_doc", "intra_doc"]
    calls.clear()
    row = hold(named_subject(MODEL), stock("sdpa", "mask4d-float"), "intra_doc", seq_len=T, dtypes=("float32",))
    assert row["status"] == "computes"
    assert sorted(calls) == ["anchor", "anchor", "full", "full", "intra_doc_reset", "intra_doc_reset"]
    runners.clear_oracle_cache()


def _calls(path: Path, names: set[str]) -> set[str]:
    """The functions of `names` a module calls (by attribute or by name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in names:
                found.add(name)
    return found


def test_one_oracle_and_one_judge_in_the_library():
    """Only runners.oracle runs jaxref's forward, and only core.hold compares and judges taps (grads.py
    compares gradients, its own quantity); neither the transformers stack nor the black-box check keeps a
    recorder, oracle or judge of its own."""
    hf_stack = sorted((HERE / "hf_stack").glob("*.py"))
    assert hf_stack, "parity_tests/hf_stack/ holds no modules"
    library = [p for p in [*HERE.glob("*.py"), *hf_stack] if not p.name.startswith(("test_", "conftest"))]
    forward = {p.name for p in library if _calls(p, {"forward"}) and "jaxref.forward(" in p.read_text()}
    assert forward == {"runners.py"}
    judging = {p.name for p in library if _calls(p, {"compare", "judge"})}
    assert judging == {"core.py"}
    for path in [*hf_stack, HERE / "blackbox.py"]:
        source = path.read_text()
        assert "register_forward_hook(lambda m, a, out: rec" not in source, path.name
        assert "_ORACLE" not in source, path.name
