"""`anchor parity`: the report it writes, its exit codes (0 pass, 1 a case fails, 2 bad input)."""

from __future__ import annotations

import json
import re

import pytest

from anchor.cli import main
from anchor_core.outdir import write_marker
from parity_tests.conftest import needs_smollm2
from parity_tests.runners import registered
from parity_tests.test_runners import PerturbedRunner


def _run(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code)


def _check_report(out, n_cases: int) -> dict:
    report = json.loads((out / "parity.json").read_text())
    assert len(report["cases"]) == n_cases
    for case in report["cases"]:
        assert {"variant", "policy", "engine", "layers", "pass"} <= set(case)
        assert case["layers"][0]["layer"] == "embed" and case["layers"][-1]["layer"] == "head"
        assert {"q", "k", "scores", "probs", "attn_out", "mlp_out", "hidden"} <= set(case["layers"][1]["taps"])
        assert {"rel_l2", "max_abs", "tol", "pass"} <= set(case["layers"][1]["taps"]["q"])
        assert {"kl_mean", "kl_max"} <= set(case["layers"][-1]["taps"]["logits"])
        if case["dtype"] == "bfloat16":
            assert case["fidelity"][1]["taps"]["hidden"]["emulation_vs_fp64"] > 0
    page = (out / "index.html").read_text()
    figures = re.findall(r"src='(figures/[^']+\.png)'", page)
    assert len(figures) == n_cases and all((out / f).stat().st_size > 10_000 for f in figures)
    assert (out / "summary.md").read_text().startswith("# Parity:")
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))
    return report


def test_parity_on_a_random_preset_passes_and_writes_the_report(tmp_path, capsys):
    out = tmp_path / "parity"
    rc = _run(["parity", "--model", "random:mistral", "--out", str(out), "--variants", "anchor,intra_doc_reset",
               "--layouts", "tags", "--engines", "sdpa", "--policies", "fp32,bf16", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0 and "4/4 cases pass" in printed
    report = _check_report(out, 4)
    # runners.EMULATIONS, sdpa's resolved for the capability torch runs here, which the report names
    capability = report["machine"]["cpu_capability"]
    assert {c["policy"] for c in report["cases"]} == {"fp32", f"sdpa_cpu_bf16_{capability.lower()}"}
    assert report["pass"] and report["model"] == "random:mistral"


def test_a_failing_case_exits_1_and_names_the_layer(tmp_path, capsys):
    out = tmp_path / "parity"
    out.mkdir()
    (out / "stale.txt").write_text("replaced")
    write_marker(out, "parity")  # an earlier anchor output: replaced (a folder of the user's files is refused)
    with registered(PerturbedRunner()):
        rc = _run(["parity", "--model", "random:llama", "--out", str(out), "--variants", "full",
                   "--engines", "eager,perturbed_hidden_layer1", "--policies", "fp32", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 1 and "FAIL" in printed and "layer 1 / hidden" in printed
    report = _check_report(out, 2)
    bad = [c for c in report["cases"] if not c["pass"]]
    assert [c["engine"] for c in bad] == ["perturbed_hidden_layer1"]
    assert bad[0]["first_divergence"]["layer"] == 1 and bad[0]["first_divergence"]["tap"] == "hidden"
    assert not (out / "stale.txt").exists()


@pytest.mark.parametrize("args,message", [
    (["--variants", "sliding"], "unknown variant 'sliding'"),
    (["--layouts", "zigzag"], "unknown layout 'zigzag'"),
    (["--engines", "warp"], "unknown engine 'warp'"),
    (["--engines", "flash_varlen"], "flash-attn"),
    (["--policies", "fp64"], "float32 or bfloat16"),
    (["--policies", "bf17"], "unknown dtype policy 'bf17'"),
    (["--seq-len", "3"], "at least 8"),
    (["--model", "random:gpt5"], "unknown random preset"),
    (["--oracle-device", "tpu"], "--oracle-device: expected cpu or cuda"),
    (["--stack", "hf", "--oracle-device", "cuda"], "--oracle-device apply to --stack torch"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, message):
    rc = _run(["parity", "--model", "random:llama", "--out", str(tmp_path / "p"), "--no-progress", *args])
    err = capsys.readouterr().err
    print(err)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


@pytest.mark.slow
@pytest.mark.model
@needs_smollm2
def test_parity_on_smollm2_passes(tmp_path, capsys):
    out = tmp_path / "parity"
    rc = _run(["parity", "--model", "default", "--out", str(out), "--variants", "intra_doc_reset,anchor",
               "--engines", "sdpa,flash_varlen_emulated", "--policies", "fp32,bf16", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0
    _check_report(out, 8)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["random:llama", "random:qwen2", "random:qwen3"])
def test_parity_on_the_other_random_presets_passes(tmp_path, model):
    out = tmp_path / "parity"
    rc = _run(["parity", "--model", model, "--out", str(out), "--no-progress"])
    report = _check_report(out, 24)
    failing = {c["id"] for c in report["cases"] if not c["pass"]}
    assert not failing and rc == 0, failing


def test_parity_grads_adds_gradient_cases_and_plots(tmp_path, capsys):
    out = tmp_path / "parity"
    rc = _run(["parity", "--model", "random:llama", "--out", str(out), "--variants", "anchor", "--engines", "eager",
               "--policies", "fp32", "--grads", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0 and "Gradients and AdamW steps: 1/1 pass" in printed
    report = json.loads((out / "parity.json").read_text())
    assert report["device"] == "cpu" and report["oracle_device"].startswith("cpu")  # where each side ran
    (g,) = report["grad_cases"]
    assert g["pass"] and g["steps"] == 3 and report["pass"]
    names = [r["param"] for r in g["grads"]["params"]]
    assert names[0] == "lm_head.weight" and names[-1] == "model.embed_tokens.weight"  # backwards from the loss
    for section in ("grads", "step@1", "step@3", "params@3", "update@3"):
        assert len(g[section]["params"]) == len(names)
    figures = sorted((out / "figures").glob("grads_*.png"))
    assert len(figures) == 1 and figures[0].stat().st_size > 10_000
    assert f"figures/{figures[0].name}" in (out / "index.html").read_text()


def test_parity_grads_refuses_flex_on_cpu(tmp_path, capsys):
    rc = _run(["parity", "--model", "random:llama", "--out", str(tmp_path / "p"), "--engines", "flex", "--grads"])
    err = capsys.readouterr().err
    assert rc == 2 and "no backward on the CPU" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p").exists()


def test_a_killed_parity_run_resumes_at_the_case_it_was_on(tmp_path, monkeypatch, capsys):
    """Each finished case (forward and gradients) is kept beside --out (`.<name>.parts`) until the report is
    published; a rerun with the same options computes only what the killed run had not finished and writes the
    report an uninterrupted run writes; other options take nothing from the parts."""
    from anchor_core.parts import parts_dir
    from parity_tests import suite
    from parity_tests.grads import run_grad_case

    calls: dict[str, list[str]] = {"case": [], "grads": []}

    def counting(kind: str, real, die_at: int | None):
        def run(case, rule):
            calls[kind].append(case.variant)
            if len(calls[kind]) == die_at:
                raise KeyboardInterrupt  # as Ctrl-C (or a job's time limit) in the middle of a case
            return real(case, rule)
        return run

    def patch(case_dies: int | None = None, grads_die: int | None = None) -> None:
        calls["case"].clear()
        calls["grads"].clear()
        monkeypatch.setattr(suite, "run_case", counting("case", run_case_real, case_dies))
        monkeypatch.setattr("parity_tests.grads.run_grad_case", counting("grads", run_grad_case, grads_die))

    run_case_real = suite.run_case
    out = tmp_path / "parity"
    argv = lambda o=out, seed=0: ["parity", "--model", "random:llama", "--out", str(o), "--variants", "full,anchor",  # noqa: E731
                                  "--engines", "eager", "--policies", "fp32", "--seq-len", "97", "--seed", str(seed),
                                  "--grads", "--no-progress"]
    patch(grads_die=2)
    assert _run(argv()) == 130
    kept = sorted(p.name for p in parts_dir(out).glob("[!.]*.json"))
    assert kept == ["case-0.json", "case-1.json", "grad_case-0.json"] and not out.exists()
    assert calls == {"case": ["anchor", "full"], "grads": ["anchor", "full"]}  # cases run sorted by their inputs
    patch(case_dies=1)
    assert _run(argv(seed=1)) == 130  # other options: the first case runs again
    assert calls["case"] == ["anchor"]
    patch()
    capsys.readouterr()
    assert _run(argv()) == 0
    assert calls == {"case": [], "grads": ["full"]}  # only what the killed run had not finished
    assert "2 case(s) and 1 gradient case(s) were finished by an earlier" in capsys.readouterr().out
    assert not parts_dir(out).exists()
    resumed = json.loads((out / "parity.json").read_text())
    assert resumed["reused"]["cases"] == 2 and resumed["reused"]["grad_cases"] == 1
    whole = tmp_path / "whole"
    assert _run(argv(whole)) == 0 and calls["case"] == ["anchor", "full"]

    def strip(x):  # what differs between two runs of the same cases: timings, the machine's load
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("runtime_s", "machine", "reused")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    assert strip(resumed) == strip(json.loads((whole / "parity.json").read_text()))


def test_kept_parts_are_taken_by_a_later_run_only_with_the_same_code_and_device(tmp_path, monkeypatch, capsys):
    """--keep-parts leaves each case's part beside --out after the report (a CI cache, or cases carried from one
    run on a GPU machine to the next): a later run with the same options computes nothing; one whose code (the hash of
    the packages a case's numbers come from) or device differs computes every case again."""
    import anchor_core.machine
    import anchor_core.parts
    from anchor_core.parts import parts_dir
    from parity_tests import suite

    ran: list[str] = []
    real = suite.run_case
    monkeypatch.setattr(suite, "run_case", lambda case, rule: ran.append(case.variant) or real(case, rule))
    out = tmp_path / "parity"
    argv = ["parity", "--model", "random:llama", "--out", str(out), "--variants", "anchor", "--engines", "eager",
            "--policies", "fp32", "--seq-len", "33", "--no-progress", "--keep-parts"]  # what is kept, not numbers
    assert _run(argv) == 0 and ran == ["anchor"]
    kept = sorted(p.name for p in parts_dir(out).glob("[!.]*.json"))
    assert kept == ["case-0.json"] and (out / "parity.json").is_file()
    key = json.loads((parts_dir(out) / "case-0.json").read_text())["key"]["run"]
    assert len(key["code"]) == 16 and "torch" in key["versions"] and key["cpu"] and key["gpu"] is None
    ran.clear()
    capsys.readouterr()
    assert _run(argv) == 0 and ran == []
    assert "1 case(s) and 0 gradient case(s) were finished by an earlier" in capsys.readouterr().out
    assert json.loads((out / "parity.json").read_text())["reused"]["cases"] == 1
    monkeypatch.setattr(anchor_core.parts, "sources_id", lambda packages: "another-code")  # a change in the code
    assert _run(argv) == 0 and ran == ["anchor"]
    ran.clear()
    monkeypatch.setattr(anchor_core.machine, "cpu_model", lambda: "another CPU")  # the same code on another machine
    assert _run(argv) == 0 and ran == ["anchor"]
    ran.clear()
    assert _run(argv[:-1]) == 0 and ran == [] and not parts_dir(out).exists()  # without the option: taken, then removed
