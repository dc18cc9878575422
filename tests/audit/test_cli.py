"""`anchor audit` through the CLI: a quick run writes every output; bad input is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anchor.cli import main
from anchor_core.outdir import write_marker
from parity_tests.audit import metrics


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.fixture
def jsonl(tmp_path) -> Path:
    p = tmp_path / "docs.jsonl"
    texts = ["The quick brown fox jumps over the lazy dog. " * 8, "Rotary embeddings rotate pairs of dims. " * 9,
             "def f(x):\n    return x * 2\n" * 10]
    p.write_text("".join(json.dumps({"text": t, "domain": "d"}) + "\n" for t in texts))
    return p


def test_quick_audit_writes_everything(tmp_path, jsonl, capsys):
    out = tmp_path / "audit"
    out.mkdir()
    (out / "stale.txt").write_text("replaced")
    write_marker(out, "audit")  # an earlier anchor output: replaced (a folder of the user's files is refused)
    code, stdout, err = run_cli(["audit", "--model", "random:smollm2", "--policies", "fp32,hf_bf16", "--quick",
                                 "--data", str(jsonl), "--random-init", "--out", str(out), "--no-progress"], capsys)
    assert code == 0, err
    res = json.loads((out / "audit.json").read_text())
    for key in ("shift_curve", "per_token", "length_curve", "error_budget", "random_init", "settings", "model"):
        assert key in res
    for key in ("shift_curve", "per_token", "length_curve"):
        assert set(res[key]) == {"fp32", "hf_bf16"}
        assert set(res["random_init"][key]) == {"fp32", "hf_bf16"}
    sc = res["shift_curve"]["hf_bf16"]
    assert sc["shifts"] == [0, 8, 15, 17, 100, 2000] and len(sc["D"]) == 6
    assert len(res["per_token"]["hf_bf16"]["values"]) == 64
    # the first token's share at every shift; at shift 0 the per-token curve's (one window: the same number)
    assert len(sc["first_token_share"]) == 6 and all(0 <= x <= 1 for x in sc["first_token_share"])
    assert sc["first_token_share"][0] == pytest.approx(res["per_token"]["hf_bf16"]["first_token_share"], rel=1e-12)
    assert res["length_curve"]["fp32"]["lengths"] == [64, 128, 256]
    for f in ("report.md", "shift_curve.png", "per_token.png", "length_curve.png", "figure1.png"):
        assert (out / f).stat().st_size > 0
    assert not (out / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    report = (out / "report.md").read_text()
    assert "holds" in report and "Shift curve" in report
    assert res["oracle_device"].startswith("cpu")  # --oracle-device's default: jaxref on the CPU


@pytest.mark.parametrize("args, needle", [
    (["--model", "/no/such/model"], "no such model"),
    (["--model", "random:llama", "--seq-len", "5000"], "longer than the model supports"),
    (["--model", "random:llama", "--max-len", "9000"], "longer than the model supports"),
    (["--model", "random:llama", "--policies", "fp32,bf17"], "unknown dtype policy"),
    (["--model", "random:nope"], "unknown random preset"),
    (["--model", "random:llama", "--data", "EMPTY"], "no non-empty"),
    (["--model", "random:llama", "--data", "/no/such.jsonl"], "no such file"),
    (["--model", "random:llama", "--oracle-device", "tpu"], "--oracle-device: expected cpu or cuda, got 'tpu'"),
    (["--model", "random:llama", "--shifts", "0,8,x"], "--shifts: '0,8,x' is not a comma-separated list of integers"),
    (["--model", "random:llama", "--shifts", "8,-1"], "--shifts: '8,-1': give at least one shift, each >= 0"),
    (["--model", "random:llama", "--stack", "torch", "--shifts", "8"], "--shifts applies to --stack oracle"),
    (["--model", "random:llama", "--rope-base", "1e4,0.5"], "--rope-base: each base must be a finite number above 1, got 0.5"),
    (["--model", "random:llama", "--rope-base", "inf"], "--rope-base: each base must be a finite number above 1, got inf"),
    (["--model", "random:llama", "--rope-base", "1e4,x"], "--rope-base: '1e4,x' is not a comma-separated list of numbers"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, needle):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [str(empty) if a == "EMPTY" else a for a in args]
    code, _, err = run_cli(["audit", *args, "--quick", "--out", str(tmp_path / "o"), "--no-progress"], capsys)
    print(err)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("anchor audit: error:") and needle in err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # minutes of CPU: make test-all
def test_a_killed_audit_resumes_at_the_policy_it_was_on(tmp_path, jsonl, capsys, monkeypatch):
    """Each policy's curves (of each kind of weights) and the error budget are kept beside --out
    (`.<name>.parts`) as they finish; a rerun with the same options computes only what the killed audit had
    not finished and writes the audit.json an uninterrupted audit writes; other options take nothing."""
    from anchor_core.parts import parts_dir
    from parity_tests.audit import runner

    calls: dict[str, list[str]] = {"shift": [], "budget": []}
    real_shift, real_budget = runner.shift_curve, runner.error_budget

    def patch(shift_dies: int | None = None, budget_dies: bool = False) -> None:
        calls["shift"].clear()
        calls["budget"].clear()

        def shift(params, spec, windows, policy, *args, **kwargs):
            calls["shift"].append(policy.name)
            if len(calls["shift"]) == shift_dies:
                raise KeyboardInterrupt  # Ctrl-C (or a time limit) in the middle of a policy's curves
            return real_shift(params, spec, windows, policy, *args, **kwargs)

        def budget(params, spec, windows, policy, *args, **kwargs):
            calls["budget"].append(policy.name)
            if budget_dies:
                raise KeyboardInterrupt
            return real_budget(params, spec, windows, policy, *args, **kwargs)

        monkeypatch.setattr(runner, "shift_curve", shift)
        monkeypatch.setattr(runner, "error_budget", budget)

    out = tmp_path / "audit"
    argv = lambda o=out, seed=0: ["audit", "--model", "random:smollm2", "--policies", "fp32,hf_bf16", "--quick",  # noqa: E731
                                  "--budget", "--random-init", "--data", str(jsonl), "--seed", str(seed),
                                  "--out", str(o), "--no-progress"]
    patch(budget_dies=True)  # the pretrained weights' curves finish, then their error budget is cut
    assert run_cli(argv(), capsys)[0] == 130
    assert calls == {"shift": ["fp32", "hf_bf16"], "budget": ["hf_bf16"]}
    assert sorted(p.name for p in parts_dir(out).glob("[!.]*.json")) == ["pretrained-0-fp32.json",
                                                                         "pretrained-1-hf_bf16.json"]
    patch(shift_dies=1)
    assert run_cli(argv(seed=1), capsys)[0] == 130 and calls["shift"] == ["fp32"]  # other options: computed again
    patch(shift_dies=2)  # the budget and the random-init fp32 curves finish; random-init hf_bf16 is cut
    assert run_cli(argv(), capsys)[0] == 130
    assert calls == {"shift": ["fp32", "hf_bf16"], "budget": ["hf_bf16"]}  # nothing of the pretrained curves again
    patch()
    code, _, err = run_cli(argv(), capsys)
    assert code == 0, err
    assert calls == {"shift": ["hf_bf16"], "budget": []} and not parts_dir(out).exists()
    resumed = json.loads((out / "audit.json").read_text())
    assert len(resumed["reused"]["pieces"]) == 4
    assert "taken from a killed audit" in (out / "report.md").read_text()
    whole = tmp_path / "whole"
    patch()
    assert run_cli(argv(whole), capsys)[0] == 0 and calls["shift"] == ["fp32", "hf_bf16"] * 2

    def strip(x):  # what differs between two runs of the same audit: timings, the machine's load
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("runtime_s", "machine", "reused")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    assert strip(resumed) == strip(json.loads((whole / "audit.json").read_text()))


def test_the_rope_bases_and_long_shifts_are_the_audits(tmp_path, capsys, monkeypatch):
    """--shifts million moves the positions to 2^20 and --rope-base measures the shift curve again under each base
    (the weights the model's): fp32's change at 2^20 is many times its change at 0 (its angles, position x inv_freq,
    rounded to an ulp of the product), the curve differs under another base, the model's own base is the audit's
    main curve, and the walls (the first shift past twice fp32's D, past twice the policy's own floor) are those
    its curves give."""
    import threading

    from parity_tests.audit.maps import MapsRunner

    compiled_on, real_compile = [], MapsRunner._compile

    def compile_(self, *args):
        compiled_on.append((threading.current_thread().name, self.spec.rope.base))
        return real_compile(self, *args)

    monkeypatch.setattr(MapsRunner, "_compile", compile_)
    out = tmp_path / "audit"
    args = ["audit", "--model", "random:llama", "--policies", "fp32,hf_bf16", "--quick", "--shifts", "million",
            "--rope-base", "10000,5e6", "--out", str(out), "--no-progress", "--no-compile-cache"]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    # every program, the other base's too, compiled ahead on the audit's compile thread
    assert {b for _, b in compiled_on} == {10000.0, 5e6}
    assert all(name.startswith("audit-compile") for name, _ in compiled_on), compiled_on
    res = json.loads((out / "audit.json").read_text())
    assert res["spec"]["rope"]["base"] == 10000.0 and res["settings"]["rope_bases"] == [10000.0, 5e6]
    own, other = res["rope_bases"]["10000"], res["rope_bases"]["5e+06"]
    assert own["own"] and not other["own"] and other["base"] == 5e6
    assert own["shift_curve"] == res["shift_curve"]
    for block in (own, other):
        sc = block["shift_curve"]["fp32"]
        assert sc["shifts"][-1] == 2 ** 20 and len(sc["first_token_share"]) == len(sc["shifts"])
        assert sc["D"][-1] > 10 * sc["D"][0]  # fp32's angles at 2^20 are rounded far coarser than near 0
        assert block["walls"] == metrics.walls(block["shift_curve"])
        w32, wbf = block["walls"]["fp32"], block["walls"]["hf_bf16"]
        assert w32["over_reference"] is None and set(w32["ratio_to_reference"]) == {1.0}
        assert w32["over_floor"] is not None and 0 < w32["over_floor"] <= 2 ** 20
        assert wbf["over_reference"] == 0  # bf16's noise is past fp32's at every shift, the smallest first
        # the phase error of fp32's RoPE table grows with the position
        pe = block["phase_error"]["fp32"]
        assert pe["positions"][-1] == 2 ** 20 + 63 and pe["max_abs"][-1] > 100 * pe["max_abs"][0]
    assert other["shift_curve"]["fp32"]["D"] != own["shift_curve"]["fp32"]["D"]
    assert res["walls"] == own["walls"]
    report = (out / "report.md").read_text()
    assert "## RoPE bases" in report and "| hf_bf16 | 5e+06 |" in report and (out / "rope_bases.png").stat().st_size
    pe = res["phase_error"]["fp32"]
    assert 2 ** 20 + 63 in pe["positions"] and pe["max_abs"][-1] > 100 * pe["max_abs"][0]


@pytest.mark.slow  # three audits: make test-all
def test_a_killed_base_sweep_resumes_at_the_base_and_policy_it_was_on(tmp_path, capsys, monkeypatch):
    """Each base's policy curves are kept as they finish: cut inside the second base's sweep, the same command
    computes only the curves not finished, and writes the audit.json an uninterrupted audit writes."""
    from parity_tests.audit import runner

    calls: list[str] = []
    real_shift = runner.shift_curve

    def patch(dies: int | None = None) -> None:
        calls.clear()

        def shift(params, spec, windows, policy, *args, **kwargs):
            calls.append(f"{spec.rope.base:g}/{policy.name}")
            if len(calls) == dies:
                raise KeyboardInterrupt
            return real_shift(params, spec, windows, policy, *args, **kwargs)

        monkeypatch.setattr(runner, "shift_curve", shift)

    argv = lambda o: ["audit", "--model", "random:llama", "--policies", "fp32,hf_bf16", "--quick",  # noqa: E731
                      "--shifts", "0,8,4096,65536", "--rope-base", "5e6,1e8", "--out", str(o), "--no-progress"]
    out = tmp_path / "audit"
    patch(dies=4)  # the main curves (base 1e4), base 5e6's fp32, then cut in base 5e6's hf_bf16
    assert run_cli(argv(out), capsys)[0] == 130
    assert calls == ["10000/fp32", "10000/hf_bf16", "5e+06/fp32", "5e+06/hf_bf16"]
    patch()
    code, _, err = run_cli(argv(out), capsys)
    assert code == 0, err
    assert calls == ["5e+06/hf_bf16", "1e+08/fp32", "1e+08/hf_bf16"]
    resumed = json.loads((out / "audit.json").read_text())
    patch()
    assert run_cli(argv(tmp_path / "whole"), capsys)[0] == 0 and len(calls) == 6

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("runtime_s", "machine", "reused")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    assert strip(resumed) == strip(json.loads((tmp_path / "whole" / "audit.json").read_text()))
    assert list(resumed["rope_bases"]) == ["5e+06", "1e+08"]
