"""`anchor audit` through the CLI: a quick run writes every output; bad input is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anchor_app.cli import main
from anchor.outdir import write_marker


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
