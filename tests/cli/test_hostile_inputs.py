"""What a hostile or careless user can hand anchor, and what anchor must do with it.

`anchor demo --merge` reads parts it did not write here: a path in a part's demo.json never names a file the
merge writes (a planted `summary_json` leaves the file it names untouched), and a part that is not one whole
experiment with the others (mixed resolved evaluation dtypes, a truncated or foreign eval.json, a wrongly
shaped demo.json) is one line, exit 2, and nothing written. Kept parts are keyed by the bytes of the model
they were computed from (`default` resolves to a file); one verb never removes another's parts; an
interrupted `anchor parity` exits 130 or 143 every time with its kept parts whole; a folder `anchor corpus`
wrote is a corpus for every verb that reads one; a demo part of any runs completes its jobs; the refusal of
a planted pickle is its one line alone.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from anchor_core.errors import InputError
from anchor_core.outdir import read_marker
from anchor_core.parts import Parts, normal, parts_dir, remove_parts
from tests.cli.helpers import assert_usage_error, run_cli, tree_hash

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random:llama"


# ---------------------------------------------------------------------------------------------
# Demo parts: two folders of the runs (`--runs full`, `--runs anchor`), each through every job it selects


def _settings():
    from anchor.demo import DemoSettings

    return DemoSettings(model=MODEL, seq_len=128, budget=20_000, train_steps=2, global_batch=1, lr=1e-3,
                        eval_every=1, eval_window=1, parity_seq_len=17, parity_policies=("fp32",),
                        parity_grad_layers=1, eval_tasks=("niah_single_1",), eval_lengths=(1024,), eval_samples=2,
                        perplexity_windows=1, jobs=("corpus", "pack", "train", "parity", "eval"))


WITH_PARITY = ("corpus", "pack", "train", "parity", "eval")
WITHOUT_PARITY = ("corpus", "pack", "train", "eval")


@pytest.fixture(scope="module")
def demo_parts(tmp_path_factory):
    """Two demo parts of one experiment: `full` alone through every job, the parity job included (it checks
    the checkpoint of a run the part has: anchor's is not there), and `anchor` alone without parity."""
    from anchor.demo import run_demo

    root = tmp_path_factory.mktemp("parts")
    records = {}
    for run, jobs in (("full", WITH_PARITY), ("anchor", WITHOUT_PARITY)):
        records[run] = run_demo(MODEL, root / run, jobs=jobs, settings=replace(_settings(), only_runs=(run,)),
                                progress=False, say=lambda _: None)
    return root, records


def copy_parts(demo_parts, tmp_path: Path) -> tuple[Path, Path]:
    root, _ = demo_parts
    a, b = tmp_path / "part-full", tmp_path / "part-anchor"
    shutil.copytree(root / "full", a, symlinks=True)
    shutil.copytree(root / "anchor", b, symlinks=True)
    return a, b


def edit_json(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def merge(capsys, *parts: Path, out: Path, extra: tuple[str, ...] = ()) -> tuple[int, str, str]:
    return run_cli(["demo", *[x for p in parts for x in ("--merge", p)], *extra, "--out", out], capsys)


def test_a_part_without_anchor_completes_its_parity_job(demo_parts):
    _, records = demo_parts
    rec = records["full"]
    assert rec["ran"] == list(WITH_PARITY), rec["ran"]
    par = rec["jobs"]["parity"]["summary"]
    assert par["model"].startswith("train/full/checkpoints/") and par["cases"] > 0, par


def test_the_merge_of_the_parts_holds_their_runs(demo_parts, tmp_path, capsys):
    a, b = copy_parts(demo_parts, tmp_path)
    out = tmp_path / "merged"
    code, stdout, err = merge(capsys, a, b, out=out)
    assert code == 0, err
    rec = json.loads((out / "demo.json").read_text())
    _, records = demo_parts
    for run, part in (("full", a), ("anchor", b)):
        mine = records[run]["jobs"]
        assert rec["jobs"]["train"]["summary"]["runs"][run]["loss"] == mine["train"]["summary"]["runs"][run]["loss"]
        assert rec["jobs"]["eval"]["summary"]["runs"][run]["scores"] == mine["eval"]["summary"]["runs"][run]["scores"]
        assert (out / "eval" / run / "eval.json").read_bytes() == (part / "eval" / run / "eval.json").read_bytes()


def test_parts_an_earlier_version_wrote_merge_as_this_versions_do(demo_parts, tmp_path, capsys):
    """Parts whose demo.json an earlier version wrote (its jobs under `stages`, the settings' `jobs` as `stages`:
    the record before the demo's pipeline units were named jobs), both or one of them, merge into what the
    merge of this version's parts holds; the merged record uses the new names."""
    a, b = copy_parts(demo_parts, tmp_path)
    code, _, err = merge(capsys, a, b, out=tmp_path / "new")
    assert code == 0, err
    new = json.loads((tmp_path / "new" / "demo.json").read_text())

    def as_before(d):
        d["stages"] = d.pop("jobs")
        d["settings"]["stages"] = d["settings"].pop("jobs")
    edit_json(a / "demo.json", as_before)
    for parts, out in (((a, b), tmp_path / "one-old"), ((b, a), tmp_path / "one-old-second")):
        code, _, err = merge(capsys, *parts, out=out)
        assert code == 0, err
    edit_json(b / "demo.json", as_before)
    code, _, err = merge(capsys, a, b, out=tmp_path / "old")
    assert code == 0, err
    def runs(rec, job):  # each run's summary but for the part it came from (the parts' order)
        return {v: {k: x for k, x in r.items() if k != "part"} for v, r in rec["jobs"][job]["summary"]["runs"].items()}
    for out in ("one-old", "one-old-second", "old"):
        rec = json.loads((tmp_path / out / "demo.json").read_text())
        assert "stages" not in rec and "stages" not in rec["settings"] and rec["settings"] == new["settings"], out
        for job in ("train", "eval"):
            assert runs(rec, job) == runs(new, job), (out, job)
        assert (tmp_path / out / "index.html").is_file()


def test_the_merge_carries_the_dtype_choice_its_parts_made(demo_parts, tmp_path, capsys):
    """A part's record says which dtype the machine chose and why (`train_dtype` auto): the merged record and
    page carry it; a choice that is not the dtype the part's settings trained in is refused, nothing written."""
    a, b = copy_parts(demo_parts, tmp_path)
    choice = {"dtype": "float32", "reason": "this CPU has no bf16 units", "bf16_units": []}
    for part in (a, b):
        edit_json(part / "demo.json", lambda d: d.update(dtype_choice=choice))
    code, _, err = merge(capsys, a, b, out=tmp_path / "merged")
    assert code == 0, err
    assert json.loads((tmp_path / "merged" / "demo.json").read_text())["dtype_choice"] == choice
    edit_json(b / "demo.json", lambda d: d.update(dtype_choice={**choice, "dtype": "bfloat16"}))
    code, _, err = merge(capsys, a, b, out=tmp_path / "again")
    assert code == 2 and "dtype_choice" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "again").exists()


@pytest.mark.slow
def test_parts_of_either_run_complete_every_job_and_merge_to_the_whole_demo(tmp_path, capsys):
    """`--runs full` and `--runs anchor`, each through every job (parity on the run it has), merged: each
    run's losses and scores are those of the demo that trained both."""
    from anchor.demo import run_demo

    whole = run_demo(MODEL, tmp_path / "whole", jobs=WITH_PARITY, settings=_settings(), progress=False,
                     say=lambda _: None)
    parts = []
    for run in ("full", "anchor"):
        rec = run_demo(MODEL, tmp_path / run, jobs=WITH_PARITY, settings=replace(_settings(), only_runs=(run,)),
                       progress=False, say=lambda _: None)
        assert rec["ran"] == list(WITH_PARITY) and rec["jobs"]["parity"]["summary"]["cases"] > 0
        parts.append(tmp_path / run)
    code, _, err = merge(capsys, *parts, out=tmp_path / "merged")
    assert code == 0, err
    merged = json.loads((tmp_path / "merged" / "demo.json").read_text())["jobs"]
    for run in ("full", "anchor"):
        for job, field in (("train", "loss"), ("eval", "scores")):
            assert merged[job]["summary"]["runs"][run][field] == whole["jobs"][job]["summary"]["runs"][run][field]


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_planted_summary_path_writes_nothing_outside_out(demo_parts, tmp_path, capsys, where):
    """A part's settings naming `../../victim.json` (or an absolute path) as its summary JSON: refused in one
    line before anything is written; the file it names keeps its bytes."""
    a, b = copy_parts(demo_parts, tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    out = home / "merged"
    victim = home / "victim.json"  # work/../../victim.json of the merge's staging folder beside --out
    victim.write_text('{"mine": 17}\n')
    planted = "../../victim.json" if where == "relative" else str(victim)
    for p in (a, b):
        edit_json(p / "demo.json", lambda d: d["settings"].__setitem__("summary_json", planted))
    code, _, err = merge(capsys, a, b, out=out)
    assert_usage_error(code, err, "demo", "summary_json")
    assert victim.read_text() == '{"mine": 17}\n'
    assert sorted(p.name for p in home.iterdir()) == ["victim.json"]


def test_parts_whose_evaluation_resolved_to_other_dtypes_are_refused(demo_parts, tmp_path, capsys):
    """`--eval-dtype auto` resolved to bf16 in one part, fp32 in the other: not one experiment."""
    a, b = copy_parts(demo_parts, tmp_path)
    mine = json.loads((a / "demo.json").read_text())["jobs"]["eval"]["summary"]["dtype"]
    other = {"bfloat16": "float32", "float32": "bfloat16"}[mine]

    def resolved_otherwise(d):
        d["jobs"]["eval"]["summary"]["dtype"] = other
        d["jobs"]["eval"]["summary"]["dtype_choice"] = {"dtype": other, "why": "another machine"}
    edit_json(b / "demo.json", resolved_otherwise)
    edit_json(b / "eval" / "anchor" / "eval.json", lambda d: d["settings"].__setitem__("dtype", other))
    code, _, err = merge(capsys, a, b, out=tmp_path / "merged")
    assert_usage_error(code, err, "demo", "dtype", "bfloat16", "float32")
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("how", ["another model", "unrecorded here", "unrecorded in the first"])
def test_parts_trained_from_other_model_bytes_are_refused(demo_parts, tmp_path, capsys, how):
    """Parts are one experiment only from the same model bytes; a part whose train job does not say
    which (`model_identity`) is named as the one to run again, not as another model."""
    a, b = copy_parts(demo_parts, tmp_path)

    def summary(d):
        return d["jobs"]["train"]["summary"]
    if how == "another model":
        edit_json(b / "demo.json", lambda d: summary(d).__setitem__("model_identity", {"sha256": "0" * 64}))
        needles = ("another model file", str(a))
    else:
        victim = b if how == "unrecorded here" else a
        edit_json(victim / "demo.json", lambda d: summary(d).pop("model_identity"))
        needles = ("model_identity", "run that part again", str(victim))
    code, _, err = merge(capsys, a, b, out=tmp_path / "merged")
    assert_usage_error(code, err, "demo", *needles)
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("how", ["truncated", "another seed", "another run"])
def test_an_eval_json_that_is_not_the_parts_evaluation_is_refused(demo_parts, tmp_path, capsys, how):
    a, b = copy_parts(demo_parts, tmp_path)
    target = b / "eval" / "anchor" / "eval.json"
    if how == "truncated":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) * 3 // 7])
    elif how == "another seed":
        edit_json(target, lambda d: d["settings"].__setitem__("seed", 5))
    else:  # full's evaluation, put in anchor's place
        shutil.copy(a / "eval" / "full" / "eval.json", target)
    code, _, err = merge(capsys, a, b, out=tmp_path / "merged")
    assert_usage_error(code, err, "demo", str(target))
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["settings"].__setitem__("train_steps", "two"), "train_steps"),
    (lambda d: d.__setitem__("jobs", []), "jobs"),
    (lambda d: d["jobs"]["train"]["summary"]["runs"].__setitem__("anchor", 3), "train run 'anchor'"),
    (lambda d: d["settings"].__setitem__("train_variants", ["../../x", "full"]), "attention variant"),
], ids=["setting type", "jobs", "run", "variant"])
def test_a_wrongly_shaped_part_is_one_line(demo_parts, tmp_path, capsys, edit, needle):
    a, b = copy_parts(demo_parts, tmp_path)
    edit_json(b / "demo.json", edit)
    code, _, err = merge(capsys, a, b, out=tmp_path / "merged")
    assert_usage_error(code, err, "demo", needle)
    assert not (tmp_path / "merged").exists()


def test_merge_refuses_what_it_would_ignore_and_names_a_repeated_part_once(demo_parts, tmp_path, capsys):
    a, b = copy_parts(demo_parts, tmp_path)
    out = tmp_path / "merged"
    for extra, needle in ((("--model", "random:qwen3"), "--model"), (("--train-steps", "7"), "--train-steps"),
                          (("--profile", "paper-gpu"), "--profile")):
        code, _, err = merge(capsys, a, b, out=out, extra=extra)
        assert_usage_error(code, err, "demo", needle)
    code, _, err = merge(capsys, a, b, a, out=out)
    line = assert_usage_error(code, err, "demo", "given twice")
    assert line.count(str(a)) == 1
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Kept parts: keyed by the model's bytes; one verb's parts are never another's to remove


def test_a_changed_model_file_keys_parity_and_eval_parts_anew(tmp_path, monkeypatch):
    """`default` resolves to the cached GGUF: new bytes of the same size and modification time are another
    key for `anchor parity --keep-parts` and for `anchor eval`'s parts, and the old part is not taken."""
    from anchor_core.paths import DEFAULT_MODEL_FILE
    from anchor.commands.parity import parts_key
    from anchor.eval.runner import part_key

    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    gguf = cache / "models" / DEFAULT_MODEL_FILE
    gguf.write_bytes(bytes(range(251)) * 37)  # never parsed: the keys hash bytes
    monkeypatch.setenv("ANCHOR_CACHE", str(cache))
    keys = lambda: (parts_key("default", "cpu", "cpu", False, ["fp32"]),  # noqa: E731
                    part_key({"samples": 3}, "model", "default", None, {}))
    before = keys()
    st = gguf.stat()
    data = bytearray(gguf.read_bytes())
    data[101] ^= 0xFF
    gguf.write_bytes(bytes(data))
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (gguf.stat().st_size, gguf.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    after = keys()
    assert before[0] != after[0] and before[1] != after[1]
    for key_before, key_after, verb in ((before[0], after[0], "parity"), (before[1], after[1], "eval")):
        parts = Parts(tmp_path / f".{verb}.parts", verb)
        parts.save("part-0", {"key": normal(key_before), "value": {"rows": [1]}})
        assert parts.load("part-0", key_before) is not None and parts.load("part-0", key_after) is None


def test_audit_leaves_the_parts_parity_kept(tmp_path, capsys):
    out = tmp_path / "S"
    kept = parts_dir(out)
    Parts(kept, "parity").save("case-3", {"key": {"seq_len": 97}, "value": {"pass": True}})
    before = tree_hash(kept)
    code, _, err = run_cli(["audit", "--model", MODEL, "--quick", "--policies", "fp32", "--seq-len", "16",
                            "--max-len", "32", "--no-progress", "--out", out], capsys)
    assert_usage_error(code, err, "audit", "kept parts of `anchor parity`")
    assert tree_hash(kept) == before and read_marker(kept)["verb"] == "parity" and not out.exists()
    remove_parts(kept, "audit")
    assert tree_hash(kept) == before
    with pytest.raises(InputError, match="kept parts of `anchor parity`"):
        Parts(kept, "eval")


# ---------------------------------------------------------------------------------------------
# Interrupts of `anchor parity`


def _interrupt_parity(tmp_path: Path, sig: int, delay: float) -> tuple[int, str, Path]:
    """`anchor parity --keep-parts` in a child process, `sig` sent `delay` seconds after its first case was
    kept (the oracle and the trainer computing the next); returns (exit code, stderr, the parts folder)."""
    out = tmp_path / "out"
    kept = parts_dir(out)
    argv = [sys.executable, "-m", "anchor", "parity", "--model", MODEL, "--variants", "full,anchor",
            "--engines", "eager,sdpa", "--policies", "fp32,bf16", "--seq-len", "33", "--keep-parts",
            "--no-progress", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONFAULTHANDLER", None)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    t0 = time.time()
    while not list(kept.glob("case-*.json")) and proc.poll() is None and time.time() - t0 < 300:
        time.sleep(0.02)
    time.sleep(delay)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err, kept


def _check_interrupts(tmp_path: Path, tries: int) -> None:
    rng = random.Random(3)
    codes = []
    for i in range(tries):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        rc, err, kept = _interrupt_parity(tmp_path / f"try-{i}", sig, rng.uniform(0.0, 1.5))
        print(f"try {i}: {signal.Signals(sig).name} -> {rc}")
        codes.append(rc)
        assert rc == {signal.SIGINT: 130, signal.SIGTERM: 143}[sig], err[-3000:]
        assert err.strip().splitlines()[-1] == "anchor parity: interrupted" and "Traceback" not in err, err[-3000:]
        saved = Parts(kept, "parity").saved()  # every kept part whole: JSON with its key and value
        assert saved and all(isinstance(p["value"], dict) for p in saved.values())
    print("exit codes:", codes)


@pytest.mark.slow  # minutes of CPU: make test-all
def test_an_interrupted_parity_exits_130_or_143_with_its_parts_whole(tmp_path):
    _check_interrupts(tmp_path, 3)


@pytest.mark.slow
def test_twenty_interrupted_parity_runs_each_exit_130_or_143(tmp_path):
    _check_interrupts(tmp_path, 20)


# ---------------------------------------------------------------------------------------------
# A folder `anchor corpus` wrote is a corpus


@pytest.fixture(scope="module")
def corpus_folder(tmp_path_factory):
    from anchor.cli import main

    out = tmp_path_factory.mktemp("corpus") / "X"
    with pytest.raises(SystemExit) as e:
        main(["corpus", "--max-docs", "3", "--no-progress", "--out", str(out)])
    assert e.value.code in (0, None)
    assert (out / "corpus.json").is_file() and (out / "corpus.jsonl").is_file()
    return out


def test_every_reader_takes_a_corpus_folder_by_its_declared_jsonl(corpus_folder):
    from anchor_core.data.readers import iter_documents

    texts = [json.loads(line)["text"] for line in (corpus_folder / "corpus.jsonl").read_text().splitlines()]
    assert [d.text for d in iter_documents(corpus_folder)] == texts and len(texts) >= 5


def test_pack_train_audit_and_eval_read_a_corpus_folder(corpus_folder, tmp_path, capsys):
    x = corpus_folder
    code, _, err = run_cli(["pack", "--model", MODEL, "--data", x, "--seq-len", "31", "--no-progress",
                            "--out", tmp_path / "pack"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["train", "--config", ROOT / "configs/train/tiny.yaml", f"model.name={MODEL}",
                            f"data.path={x}", "schedule.steps=1", "--no-progress", "--out", tmp_path / "run"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["audit", "--model", MODEL, "--data", x, "--quick", "--policies", "fp32", "--seq-len",
                            "16", "--max-len", "32", "--no-progress", "--out", tmp_path / "audit"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["eval", "--model", MODEL, "--haystack", x, "--tasks", "niah_single_1", "--lengths",
                            "768", "--samples", "1", "--perplexity-windows", "0", "--no-progress",
                            "--out", tmp_path / "eval"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["demo", "--model", MODEL, "--heldout", x, "--jobs", "corpus", "--no-progress",
                            "--out", tmp_path / "demo"], capsys)
    assert code == 0, err
    from anchor.eval.ruler.common import load_haystack

    assert load_haystack(x).source == str((x / "corpus.jsonl").resolve())  # the JSONL, not the summary beside it


def test_a_corpus_summary_is_refused_by_name_and_the_demo_checks_it_first(corpus_folder, tmp_path, capsys):
    summary = corpus_folder / "corpus.json"
    code, _, err = run_cli(["pack", "--model", MODEL, "--data", summary, "--seq-len", "31", "--no-progress",
                            "--out", tmp_path / "pack"], capsys)
    assert_usage_error(code, err, "pack", str(summary), "not JSONL")
    code, _, err = run_cli(["eval", "--model", MODEL, "--haystack", summary, "--tasks", "vt", "--lengths", "256",
                            "--samples", "1", "--no-progress", "--out", tmp_path / "eval"], capsys)
    assert_usage_error(code, err, "eval", str(summary), "not JSONL")
    out = tmp_path / "demo"
    code, _, err = run_cli(["demo", "--model", MODEL, "--heldout", summary, "--no-progress", "--out", out], capsys)
    assert_usage_error(code, err, "demo", str(summary), "not JSONL")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# A planted pickle


class _Planted:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_the_refusal_of_a_planted_pickle_is_its_one_line(tmp_path):
    """A pickle written with another protocol than torch's makes torch warn before it refuses: the warning is
    silenced, the refusal stays the one line, the object is never built."""
    import torch

    from torchtrain.training.checkpoint import safe_loads

    marker = tmp_path / "payload-ran"
    f = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(3)}, "planted": _Planted(marker)}, f, pickle_protocol=4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(InputError, match="refused before building it"), safe_loads():
            torch.load(f)
    assert [str(w.message) for w in seen] == [] and not marker.exists()
