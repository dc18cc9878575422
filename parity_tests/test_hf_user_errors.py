"""A user's attention function fails early and clearly: a signature transformers cannot call is refused
before anything runs, a wrong return type or output layout is named with what was expected, and asking only
for implementations that cannot run here checks nothing and says so (exit 2, never 0)."""

from __future__ import annotations

import pytest

from anchor_core.errors import InputError
from parity_tests import planted_attention
from parity_tests.hf_stack import check_output, run_hf_stack, user_stack


def three_tensors(query, key, value):
    return query, None


def no_kwargs(module, query, key, value, attention_mask):
    return query.transpose(1, 2), None


def bare_tensor(module, query, key, value, attention_mask, **kwargs):
    out, _ = planted_attention.correct(module, query, key, value, attention_mask, **kwargs)
    return out


def heads_first(module, query, key, value, attention_mask, **kwargs):
    out, weights = planted_attention.correct(module, query, key, value, attention_mask, **kwargs)
    return out.transpose(1, 2), weights  # [B,N,T,D]: as query arrives, not as transformers reads it


@pytest.mark.parametrize("fn, says", [(three_tensors, "takes (query, key, value)"),
                                      (no_kwargs, "takes (module, query, key, value, attention_mask)")])
def test_a_signature_transformers_cannot_call_is_refused_before_anything_runs(fn, says):
    with pytest.raises(InputError) as e:
        user_stack(fn)
    msg = str(e.value)
    assert "\n" not in msg and says in msg and "fn(module, query, key, value, attention_mask, **kwargs)" in msg


def test_check_output_names_the_return_type_and_the_layout():
    import torch

    q = torch.zeros(1, 3, 5, 4)  # [B,N,T,D] as the function gets it
    with pytest.raises(TypeError, match=r"returned a bare tensor of shape \[1, 5, 3, 4\]; expected a tuple"):
        check_output("f", q, torch.zeros(1, 5, 3, 4))
    with pytest.raises(ValueError, match=r"shape \[1, 3, 5, 4\] \(heads before slots.*expected \[B,T,N,D\] = \[1, 5, 3, 4\]"):
        check_output("f", q, (torch.zeros(1, 3, 5, 4), None))
    out = (torch.zeros(1, 5, 3, 4), None)
    assert check_output("f", q, out) is out


@pytest.mark.parametrize("fn, says", [(bare_tensor, "returned a bare tensor"), (heads_first, "heads before slots")])
def test_a_wrong_result_is_an_error_row_that_names_what_was_expected(fn, says):
    report = run_hf_stack("random:llama", attention=fn, rope_in="attention", variants=["intra_doc"],
                          dtypes=["float32"], seq_len=33)
    (row,) = report["rows"]
    assert row["status"] == "error" and says in row["error"] and "[B,T,N,D]" in row["error"] and not report["pass"]


def test_only_implementations_that_cannot_run_here_check_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("flash_attention_2 may run on this machine")
    with pytest.raises(InputError, match="nothing was checked: flash_attention_2 cannot run here"):
        run_hf_stack("random:llama", implementations=["flash_attention_2"], variants=["full"], seq_len=33)
    from anchor.cli import main

    out = tmp_path / "report"
    with pytest.raises(SystemExit) as e:
        main(["parity", "--stack", "hf", "--model", "random:llama", "--attn-implementation", "flash_attention_2",
              "--out", str(out)])
    assert e.value.code == 2 and not out.exists()


def test_the_cli_refuses_such_a_function_in_one_line_before_any_work(tmp_path, capsys):
    from anchor.cli import main

    out = tmp_path / "report"
    with pytest.raises(SystemExit) as e:
        main(["parity", "--stack", "hf", "--model", "random:llama", "--out", str(out),
              "--attention", "parity_tests.test_hf_user_errors:three_tensors"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and "takes (query, key, value)" in err


def test_every_finding_in_the_summary_gives_its_error_size():
    from parity_tests.hf_report import cell

    candidates = {"intra_doc": {"worst_margin": 7.0e4}, "intra_doc_reset": {"worst_margin": 0.2}}
    instead = {"status": "instead", "variant": "intra_doc", "computes": "intra_doc_reset", "candidates": candidates}
    none = {"status": "none", "variant": "anchor", "closest": "intra_doc", "candidates": candidates}
    assert cell(instead) == "computes `intra_doc_reset` instead (7e+04 x tol from the one asked)"
    assert cell(none) == "computes none (closest `intra_doc`, 7e+04 x tol)"
