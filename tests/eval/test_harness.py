"""The lm-evaluation-harness bridge: `anchor eval --harness lm-eval`.

The wrapper must decode exactly as our own RULER does (same greedy call, the same first token), score
continuations as a full forward does; lm-eval's own niah_single_1 runs end to end through the CLI on
our model, the local MMLU YAML scores as a direct forward; bad input (unknown harness or task, missing
data) is one line and exit 2 with nothing written; the shipped YAMLs parse and document their JSONL
fields; `anchor eval` without --harness never imports lm_eval.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from anchor_core.errors import InputError
from anchor.eval import harness
from anchor.eval.generate import greedy_generate, load_eval_model
from anchor_core.tokenizer import load_tokenizer

torch.set_num_threads(1)  # shared cores

needs_lm_eval = pytest.mark.skipif(not harness.available(),
                                   reason='lm-eval is not installed (pip install -e ".[eval]")')
NAME = "random:llama"
TEXT = "The grass is green. The sky is blue. One of the special magic numbers for tiny-cat is: 1234567. " * 2


@functools.cache
def _model():
    return load_eval_model(NAME, dtype="float32")


def _lm(**kw):
    tok = load_tokenizer(NAME)
    return harness.make_lm(_model(), tok, max_length=512, **kw), tok


def _req(*args):
    return SimpleNamespace(args=args)


@needs_lm_eval
def test_generate_until_equals_our_greedy_generate():
    lm, tok = _lm(batch_size=2)
    contexts = [TEXT, TEXT[:37], "What is the magic number?"]
    budgets = [12, 7, 20]
    got = lm.generate_until([_req(c, {"max_gen_toks": b, "until": [], "do_sample": False, "temperature": 0.0})
                             for c, b in zip(contexts, budgets)])
    prompts = [[tok.first_token_id] + ids for ids in tok.encode_batch(contexts)]  # as our RULER
    want = [harness.decode_ids(tok, o) for o in greedy_generate(_model(), tok, prompts, budgets, batch_size=2, progress=False)]
    for g, w in zip(got, want):  # (decode_ids drops the random model's ids past the byte tokenizer's 259)
        print(f"wrapper {g!r}\nours    {w!r}")
    assert got == want
    # `until` cuts at the first stop string, as lm-eval's contract says
    stop = want[0][len(want[0]) // 2:][:2] or "x"
    cut = lm.generate_until([_req(contexts[0], {"max_gen_toks": 12, "until": [stop]})])
    print(f"until {stop!r}: {cut!r}")
    assert cut == [want[0].split(stop, 1)[0]]
    with pytest.raises(InputError, match="greedily"):
        lm.generate_until([_req(TEXT, {"max_gen_toks": 4, "do_sample": True, "temperature": 1.0})])


@needs_lm_eval
def test_loglikelihood_equals_a_full_forward():
    lm, tok = _lm()
    context, continuation = TEXT[:60], " blue sky"
    (logp, greedy), = lm.loglikelihood([_req(context, continuation)])
    ids = [tok.first_token_id] + tok.encode_batch([context + continuation])[0]
    n = len(tok.encode_batch([context + continuation])[0]) - len(tok.encode_batch([context])[0])
    with torch.no_grad():
        lp = torch.log_softmax(_model()(input_ids=torch.tensor([ids[:-1]]), use_cache=False).logits[0].float(), -1)
    want = float(lp[-n:].gather(1, torch.tensor(ids[-n:])[:, None]).sum())
    print(f"wrapper {logp:.6f} greedy={greedy}  full forward {want:.6f} over {n} tokens")
    assert logp == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert greedy == bool((lp[-n:].argmax(-1) == torch.tensor(ids[-n:])).all())
    # a continuation that is the greedy token is greedy: the first context whose greedy next token is ASCII
    for k in [k for k in range(20, 80) if not TEXT[k - 1].isspace()]:  # (lm-eval moves trailing spaces)
        prompt = [tok.first_token_id] + tok.encode_batch([TEXT[:k]])[0]
        (t,), = greedy_generate(_model(), tok, [prompt], 1, stop_ids=(), progress=False)
        if 3 + 33 <= t < 3 + 127:  # a printable ASCII byte: decodes and encodes back to itself
            break
    (_, is_greedy), = lm.loglikelihood([_req(TEXT[:k], tok.decode([t]))])
    print(f"greedy next token of {TEXT[:k]!r}: {tok.decode([t])!r}, is_greedy={is_greedy}")
    assert is_greedy


VALID = {
    "mmlu": {"question": "2 + 2 =", "choices": ["1", "2", "3", "4"], "answer": 3, "subject": "arithmetic"},
    "hellaswag": {"activity_label": "Cooking", "ctx_a": "A man cracks an egg.", "ctx_b": "he",
                  "endings": ["fries it.", "sings.", "flies.", "sleeps."], "label": "0"},
    "longbench": {"input": "Who?", "context": "Ada wrote it.", "answers": ["Ada"], "dataset": "hotpotqa"},
}


@pytest.mark.parametrize("task", ["mmlu", "hellaswag", "longbench"])
@pytest.mark.parametrize("damage", ["not-json", "missing-field", "wrong-type", "not-an-object", "empty"])
def test_malformed_local_data_is_refused_before_any_work(task, damage, tmp_path, capsys, monkeypatch):
    """A non-JSON line, a missing field, a field of the wrong type: one line naming the file and the line,
    exit 2, before RULER's evaluation starts (not a traceback after all of it)."""
    from anchor.eval import runner
    from tests.cli.helpers import assert_usage_error, run_cli

    pytest.importorskip("lm_eval")
    good = json.dumps(VALID[task])
    field = next(iter(VALID[task]))
    bad = {"not-json": "{not json", "missing-field": json.dumps({k: v for k, v in VALID[task].items() if k != field}),
           "wrong-type": json.dumps({**VALID[task], field: 7}), "not-an-object": "[1, 2]", "empty": None}[damage]
    data = tmp_path / "data"
    data.mkdir()
    (data / harness.LOCAL_TASKS[task].data).write_text("" if bad is None else f"{good}\n{good}\n{bad}\n")
    monkeypatch.setattr(runner, "run_eval", lambda *a, **k: pytest.fail("the evaluation started"))
    code, _, err = run_cli(["eval", "--model", "random:llama", "--tasks", "vt", "--lengths", "256", "--samples", "1",
                            "--harness", "lm-eval", "--harness-tasks", task, "--harness-data", str(data),
                            "--out", str(tmp_path / "out"), "--no-progress"], capsys)
    line = assert_usage_error(code, err, "eval", harness.LOCAL_TASKS[task].data)
    assert ("line 3" in line) if bad is not None else ("no records" in line)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("task", ["mmlu", "hellaswag", "longbench"])
def test_missing_local_data_is_one_line(task, tmp_path):
    file = harness.LOCAL_TASKS[task].data
    with pytest.raises(InputError) as e:
        harness.check_tasks([task], None)
    print(e.value)
    assert "\n" not in str(e.value) and file in str(e.value) and "--harness-data" in str(e.value)
    with pytest.raises(InputError) as e:
        harness.check_tasks(["niah_single_1", task], tmp_path)
    print(e.value)
    assert "\n" not in str(e.value) and f"no {file}" in str(e.value) and str(tmp_path) in str(e.value)
    (tmp_path / file).write_text(json.dumps(VALID[task]) + "\n")
    harness.check_tasks(["niah_single_1", task], tmp_path)  # present and well-formed: no error
    with pytest.raises(InputError, match="unknown task 'qa_1'"):
        harness.check_tasks(["qa_1"], tmp_path)


class _TaskLoader(yaml.SafeLoader):
    """yaml.safe_load plus lm-eval's one tag, `!function module.name`, read as its string."""


_TaskLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


@pytest.mark.parametrize("task", sorted(harness.LOCAL_TASKS))
def test_local_yamls_parse_and_document_their_fields(task):
    lt = harness.LOCAL_TASKS[task]
    text = (harness.CONFIGS / lt.yaml).read_text()
    cfg = yaml.load(text, Loader=_TaskLoader)
    if "!function" not in text:
        assert yaml.safe_load(text) == cfg
    print(task, {k: cfg[k] for k in ("task", "dataset_path", "dataset_kwargs", "output_type")})
    assert cfg["task"] == lt.harness_task and cfg["dataset_path"] == "json"
    assert cfg["dataset_kwargs"]["data_files"]["test"] == f"{harness.DATA_PLACEHOLDER}/{lt.data}"
    assert lt.metric in [m["metric"] for m in cfg["metric_list"]]
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    fields = [f.split(" ")[0] for f in lt.fields.split("(")[0].split(", ")]
    for f in fields:  # every JSONL field is documented in the YAML's header
        assert f"#   {f} " in comments, f"{lt.yaml} does not document the field {f!r}"
    for tag in [v for v in cfg.values() if isinstance(v, str) and v.startswith("harness_utils.")]:
        assert tag.split(".", 1)[1] in (harness.CONFIGS / "harness_utils.py").read_text()


MMLU_ROWS = [
    {"question": "2 + 2 = ?", "choices": ["3", "4", "5", "6"], "answer": 1, "subject": "math"},
    {"question": "The sky is", "choices": ["blue", "red", "green", "black"], "answer": 0, "subject": "x"},
    {"question": " Which one is a prime? ", "choices": ["9", "15", "21", "7"], "answer": 3, "subject": "math"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@needs_lm_eval
def test_local_mmlu_yaml_scores_as_a_direct_forward(tmp_path):
    """configs/eval/mmlu_local.yaml through lm-eval on a 3-row file: every row's choice is the argmax of the
    four letters' log-likelihoods computed here with one forward each, and acc is their mean."""
    _write_jsonl(tmp_path / "mmlu.jsonl", MMLU_ROWS)
    res = harness.run_harness([("m", NAME)], tasks=["mmlu"], lengths=[512], limit=3, data_dir=tmp_path,
                              dtype="float32")
    tok, model = load_tokenizer(NAME), _model()
    want = []
    for row in MMLU_ROWS:
        context = (row["question"].strip() + "".join(f"\n{c}. {x}" for c, x in zip("ABCD", row["choices"]))
                   + "\nAnswer:")
        n_ctx = len(tok.encode_batch([context])[0])
        logps = []
        for letter in "ABCD":  # lm-eval's target delimiter " " starts the continuation
            ids = [tok.first_token_id] + tok.encode_batch([context + " " + letter])[0]
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=torch.tensor([ids[:-1]]), use_cache=False).logits[0].float(), -1)
            logps.append(float(lp[n_ctx:].gather(1, torch.tensor(ids[n_ctx + 1:])[:, None]).sum()))
        want.append(float(max(range(4), key=logps.__getitem__) == row["answer"]))
        print(row["question"].strip(), [round(x, 4) for x in logps], "correct" if want[-1] else "wrong")
    print(json.dumps(res["rows"]), [r["score"] for r in res["samples"]])
    assert [(r["task"], r["harness_task"], r["length"], r["samples"], r["metric"]) for r in res["rows"]] == \
        [("mmlu", "mmlu_local", None, 3, "acc")]
    assert [r["score"] for r in res["samples"]] == want
    assert res["rows"][0]["score"] == round(100.0 * sum(want) / 3, 2)
    assert "| m | mmlu_local |" in harness.render_table(res)


@needs_lm_eval
@pytest.mark.slow
def test_local_hellaswag_and_longbench_run_on_a_tiny_file(tmp_path):
    """hellaswag and longbench end to end through lm-eval on two rows each (random model)."""
    hs = [{"activity_label": "Cooking", "ctx_a": "A man cuts onions.", "ctx_b": "he", "label": "2",
           "endings": ["sings [title] loud.", "runs.", "fries them.", "sleeps."]}] * 2
    lb = [{"input": "Who?", "context": "Passage 1: Ann wrote it.", "answers": ["Ann"], "dataset": d}
          for d in ("hotpotqa", "musique")]
    _write_jsonl(tmp_path / "hellaswag.jsonl", hs)
    _write_jsonl(tmp_path / "longbench.jsonl", lb)
    res = harness.run_harness([("m", NAME)], tasks=["hellaswag", "longbench"], lengths=[256], limit=2,
                              data_dir=tmp_path, dtype="float32")
    print(json.dumps(res["rows"], indent=1))
    assert [(r["task"], r["length"], r["samples"]) for r in res["rows"]] == [("hellaswag", None, 2), ("longbench", None, 2)]
    assert all(0.0 <= r["score"] <= 100.0 for r in res["rows"])


@needs_lm_eval
def test_cli_runs_lm_evals_own_niah_single_1_through_our_model(tmp_path, monkeypatch, capsys):
    """`anchor eval --harness lm-eval` end to end on lm-eval's niah_single_1 (limit 2, length 640): lm-eval
    builds the prompts with our tokenizer folder, our model decodes them (recorded here), and the row
    scores the predictions as lm-eval's string_match_all does."""
    from anchor.cli import main
    from anchor.eval import generate, scoring

    calls = []
    real = generate.greedy_generate

    def recording(model, tok, prompts, budgets, **kw):
        # the random model has 331 ids and its byte tokenizer 259: ids past it are dropped here, as the
        # bridge's decode_ids drops them, because ByteTok.decode (our RULER's decode) fails on them
        outs = [[i for i in o if i < tok.vocab_size] for o in real(model, tok, prompts, budgets, **kw)]
        calls.append((prompts, budgets, outs))
        return outs

    monkeypatch.setattr(generate, "greedy_generate", recording)
    out, L = tmp_path / "eval", 640
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", NAME, "--out", str(out), "--tasks", "niah_single_1", "--lengths", str(L),
              "--samples", "2", "--dtype", "float32", "--perplexity-windows", "0", "--harness", "lm-eval",
              "--harness-tasks", "niah_single_1", "--no-progress"])
    printed = capsys.readouterr().out
    print(printed)
    assert e.value.code in (0, None)
    assert "Max length" not in printed and "punkt" not in printed  # lm-eval's prints stay off the report
    h = json.loads((out / "eval.json").read_text())["harness"]
    assert [(r["checkpoint"], r["task"], r["harness_task"], r["length"], r["samples"]) for r in h["rows"]] == \
        [(NAME, "niah_single_1", "niah_single_1", L, 2)]
    # calls[0]: our RULER; calls[1]: lm-eval's two prompts (its order), each read with the BOS first
    assert len(calls) == 2
    tok = load_tokenizer(NAME)
    prompts, budgets, outs = calls[1]
    texts = [tok.decode(p[1:]) for p in prompts]
    for t in texts:
        print(f"lm-eval prompt ({len(t)} chars): {t[:90]!r} ... {t[-100:]!r}")
    assert budgets == [128, 128] and all(p[0] == tok.first_token_id for p in prompts)
    assert all(len(p) - 1 + 128 <= L for p in prompts)  # lm-eval's sizing, the BOS not counted
    assert all(t.startswith("A special magic number is hidden within the following text.") for t in texts)
    assert all("mentioned in the provided text is" in t[-120:] for t in texts)
    preds = sorted(harness.decode_ids(tok, o) for o in outs)
    assert sorted(s["prediction"] for s in h["samples"]) == preds
    for s in h["samples"]:
        assert len(s["answers"]) == 1 and any(f"is: {s['answers'][0]}." in t for t in texts)
        assert s["prompt_tokens"] in [len(p) for p in prompts]
    want = scoring.lm_eval_score("niah_single_1", [s["prediction"] for s in h["samples"]],
                                 [s["answers"] for s in h["samples"]])
    assert h["rows"][0]["score"] == pytest.approx(want, abs=0.01)
    assert "| niah_single_1 |" in (out / "report.md").read_text()


@pytest.mark.parametrize("argv, named", [
    (["--harness", "helm"], "unknown harness 'helm'"),
    (["--harness", "lm-eval", "--harness-tasks", "niah_single_1,niah_single_2"], "unknown task 'niah_single_2'"),
    (["--harness", "lm-eval", "--harness-tasks", "mmlu"], "mmlu.jsonl"),
    (["--harness", "lm-eval", "--harness-tasks", "hellaswag", "--harness-data", "DATA"], "hellaswag.jsonl"),
    (["--harness-data", "DATA"], "--harness-data is read by --harness lm-eval"),
])
def test_cli_bad_harness_input_is_one_line_exit_2(argv, named, tmp_path, capsys):
    from anchor.cli import main

    out = tmp_path / "eval"
    (tmp_path / "data").mkdir()
    argv = [str(tmp_path / "data") if a == "DATA" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", NAME, "--out", str(out), "--tasks", "niah_single_1", "--lengths", "256",
              "--samples", "1", "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    print(err)
    assert e.value.code == 2 and len(err.splitlines()) == 1 and named in err
    assert not out.exists()


def test_eval_without_harness_does_not_import_lm_eval(tmp_path):
    """lm-eval's import and task index take seconds: `anchor eval` and its modules load it only for --harness.
    (The run stops at its length check, after run_eval has imported all it runs with.)"""
    code = ("import sys\nfrom anchor.cli import main\n"
            "import anchor.eval, anchor.eval.runner, anchor.eval.generate, anchor.eval.perplexity, anchor.eval.harness\n"
            "for argv, rc in ((['eval', '--help'], 0), (['eval', '--model', 'random:llama', '--out', sys.argv[1],"
            " '--tasks', 'niah_single_1', '--lengths', '99999', '--no-progress'], 2)):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert (e.code or 0) == rc, e.code\n"
            "print('LM_EVAL_IMPORTED' if any(m.split('.')[0] == 'lm_eval' for m in sys.modules) else 'NO_LM_EVAL')\n")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "eval")], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parents[2])
    print(p.stdout[-300:], p.stderr[-300:])
    assert p.returncode == 0 and p.stdout.strip().endswith("NO_LM_EVAL")
    assert "99999" in p.stderr and not (tmp_path / "eval").exists()


def test_cli_puts_the_harness_into_eval_json_and_report(tmp_path, monkeypatch, capsys):
    """The wiring of `--harness lm-eval` (both evaluations stubbed): eval.json's "harness", report.md's table."""
    from anchor.cli import main
    from anchor.eval import runner

    def fake_eval(sources, **kw):
        rows = [{"checkpoint": sources[0][0], "task": "vt", "length": 1024, "score": 80.0, "samples": 5}]
        return {"rows": rows, "summary": [{"task": "vt", "length": 1024, "mean": 80.0, "std": 0.0,
                                 "checkpoints": [sources[0][0]]}],
                "perplexity": [], "samples": [], "checkpoints": [{"label": s[0], "source": s[1]} for s in sources],
                "settings": {"tasks": ["vt"], "lengths": [1024], "samples": 5, "seed": 42, "engine": "sdpa",
                             "dtype": "float32", "scoring": "RULER"}, "runtime_s": 1.0}

    seen = {}

    def fake_harness(sources, **kw):
        seen.update(kw, sources=sources)
        return {"harness": "lm-eval", "version": "0.4.13", "runtime_s": 2.0, "samples": [],
                "settings": {"limit": kw["limit"], "scoring": "lm-eval's"},
                "rows": [{"checkpoint": sources[0][0], "task": "vt", "harness_task": "ruler_vt", "length": 1024,
                          "score": 60.0, "samples": 5, "metric": "1024"}]}

    monkeypatch.setattr(runner, "run_eval", fake_eval)
    monkeypatch.setattr(harness, "run_harness", fake_harness)
    monkeypatch.setattr(harness, "require", lambda: None)
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", NAME, "--out", str(out), "--tasks", "vt", "--lengths", "1024", "--samples", "5",
              "--harness", "lm-eval", "--harness-tasks", "vt", "--dtype", "float32", "--no-progress"])
    print(capsys.readouterr().out)
    assert e.value.code in (0, None)
    assert seen["tasks"] == ["vt"] and seen["lengths"] == [1024] and seen["limit"] == 5 and seen["dtype"] == "float32"
    body = json.loads((out / "eval.json").read_text())
    assert body["harness"]["rows"][0]["score"] == 60.0 and body["rows"][0]["score"] == 80.0
    report = (out / "report.md").read_text()
    print(report)
    assert "## lm-evaluation-harness" in report and "| NAME | ruler_vt | 60.0 |".replace("NAME", NAME) in report
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", NAME, "--out", str(tmp_path / "x"), "--harness", "helm", "--no-progress"])
    assert e.value.code == 2 and "unknown harness 'helm'" in capsys.readouterr().err
