"""`--out` never deletes the user's files: unsafe targets are refused before any work starts, the files
unchanged by hash; anchor's own outputs (the marker) and empty folders are replaced."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from anchor_core.errors import InputError
from anchor_core.outdir import MARKER, guard_out, read_marker, write_marker
from tests.cli.helpers import assert_usage_error, leftovers, run_cli, tree_hash, user_folder, write_corpus

# the function each verb calls once its checks pass: patched to fail, so a refusal provably comes first
WORK = {
    "pack": ("anchor_core.data.pipeline", "pack_corpus"),
    "audit": ("parity_tests.audit", "run_audit"),
    "parity": ("parity_tests.suite", "run_parity"),
    "corpus": ("anchor_core.data.corpus", "write_default_corpus"),
    "demo": ("anchor.demo", "run_demo"),
    "train": ("torchtrain.training.trainer", "train"),
    "bench": ("anchor.bench.run", "run_bench"),
    "eval": ("anchor.eval.runner", "run_eval"),
}
TINY = Path(__file__).resolve().parents[2] / "configs/train/tiny.yaml"
INPUT_DATA = ("pack", "audit", "train", "bench")  # the verbs given the corpus as an input (argv)


def argv(verb: str, out: str, corpus: Path, model: str = "random:llama") -> list[str]:
    return {
        "pack": ["pack", "--model", model, "--data", str(corpus), "--seq-len", "16", "--no-progress"],
        "audit": ["audit", "--model", model, "--data", str(corpus), "--quick", "--no-progress"],
        "parity": ["parity", "--model", model, "--variants", "full", "--engines", "eager", "--policies", "fp32",
                   "--no-progress"],
        "corpus": ["corpus", "--max-docs", "1", "--no-progress"],
        "demo": ["demo", "--model", model, "--jobs", "top5", "--no-progress"],
        "train": ["train", "--config", str(TINY), f"model.name={model}", f"data.path={corpus}", "--no-progress"],
        "bench": ["bench", "--model", model, "--data", str(corpus), "--seq-len", "64", "--windows", "1",
                  "--no-progress"],
        "eval": ["eval", "--model", model, "--tasks", "vt", "--lengths", "256", "--samples", "1", "--no-progress"],
    }[verb] + ["--out", out]


@pytest.fixture
def no_work(monkeypatch):
    import importlib

    calls = []

    def patch(verb):
        module, name = WORK[verb]
        monkeypatch.setattr(importlib.import_module(module), name,
                            lambda *a, **k: calls.append(verb) or pytest.fail(f"{verb} started work"))
    return patch, calls


def _targets():
    """(id, setup(tmp) -> (out argument, folder whose files must stay, cwd or None), needle)."""

    def dot(tmp):
        home = user_folder(tmp / "mine")
        return ".", home, home

    def cwd_abs(tmp):
        home = user_folder(tmp / "mine")
        return str(home), home, home

    def cwd_parent(tmp):
        home = user_folder(tmp / "mine")
        (home / "deeper").mkdir()
        return "..", home, home / "deeper"

    def user_files(tmp):
        folder = user_folder(tmp / "results")
        return str(folder), folder, None

    def data_folder(tmp):
        folder = tmp / "corpus"  # holds the corpus given as --data (audit, pack)
        return str(folder), folder, None

    def parent_is_file(tmp):
        (tmp / "afile").write_text("x")
        return str(tmp / "afile" / "out"), tmp, None

    def existing_file(tmp):
        (tmp / "afile").write_text("x")
        return str(tmp / "afile"), tmp, None

    def root(tmp):
        return "/", tmp, None

    return [
        ("dot", dot, "working directory"),
        ("cwd-absolute", cwd_abs, "working directory"),
        ("cwd-parent", cwd_parent, "parent of the working directory"),
        ("user-files", user_files, "anchor did not write"),
        ("data-folder", data_folder, "holds the input"),
        ("parent-is-file", parent_is_file, "is a file"),
        ("existing-file", existing_file, "not a folder"),
        ("root", root, "root"),
    ]


@pytest.mark.parametrize("verb", sorted(WORK))
@pytest.mark.parametrize("target, setup, needle", [pytest.param(*t, id=t[0]) for t in _targets()])
def test_unsafe_out_is_refused_before_work(verb, target, setup, needle, tmp_path, capsys, monkeypatch, no_work):
    corpus = write_corpus((tmp_path / "corpus").mkdir() or tmp_path / "corpus" / "c.jsonl")
    out, keep, cwd = setup(tmp_path)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    patch, calls = no_work
    patch(verb)
    before = tree_hash(keep)
    code, _, err = run_cli(argv(verb, out, corpus), capsys)
    if target == "data-folder" and verb not in INPUT_DATA:
        # the folder is no input of this verb: it is still a folder of the user's files
        needle = "anchor did not write"
    assert_usage_error(code, err, verb, needle)
    after = tree_hash(keep)
    print(f"{len(before)} files hashed before, {len(after)} after; work calls: {calls}")
    assert after == before and calls == []


@pytest.mark.parametrize("verb", ["audit", "parity", "demo", "pack", "train", "bench", "eval"])
def test_out_holding_the_model_folder_is_refused(verb, tmp_path, capsys, no_work):
    from anchor_core.spec import random_preset
    from anchor_core.export import write_model
    from anchor_core.weights import random_state

    spec = random_preset("llama")
    model = write_model(spec, random_state(spec), tmp_path / "models" / "m")
    corpus = write_corpus(tmp_path / "c.jsonl")
    patch, calls = no_work
    patch(verb)
    before = tree_hash(tmp_path / "models")
    for out in (tmp_path / "models", model, model / "out"):
        code, _, err = run_cli(argv(verb, str(out), corpus, model=str(model)), capsys)
        assert_usage_error(code, err, verb, "input")
    assert tree_hash(tmp_path / "models") == before and calls == []


@pytest.mark.parametrize("verb", sorted(WORK))
def test_another_verbs_output_is_never_replaced(verb, tmp_path, capsys, no_work):
    """A verb replaces only outputs of its own verb; a training run (its checkpoints) is
    no eval's, bench's or pack's to replace (train itself resumes only a train folder)."""
    corpus = write_corpus(tmp_path / "c.jsonl")
    run = tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "weights.bin").write_bytes(b"expensive" * 100)
    write_marker(run, "demo" if verb == "train" else "train")
    patch, calls = no_work
    patch(verb)
    before = tree_hash(run)
    code, _, err = run_cli(argv(verb, str(run), corpus), capsys)
    assert_usage_error(code, err, verb, "holds the output of `anchor")
    assert tree_hash(run) == before and calls == []


def test_train_refuses_the_root_and_a_config_inside_out(tmp_path, capsys):
    """`--out /` is one line, exit 2 (the guard runs before the lock beside the folder is taken), also
    through the Python API; a --config inside --out is an input, refused."""
    from torchtrain.config import load_train_config
    from torchtrain.training.trainer import train

    with pytest.raises(InputError, match="root"):
        train(load_train_config(TINY, []), "/")
    out = tmp_path / "run"
    out.mkdir()
    config = out / "my.yaml"
    config.write_text(TINY.read_text())
    code, _, err = run_cli(["train", "--config", str(config), "--out", str(out), "--no-progress"], capsys)
    assert_usage_error(code, err, "train", "input")
    assert sorted(p.name for p in out.iterdir()) == ["my.yaml"]


def test_home_folder_is_refused(tmp_path, capsys, monkeypatch, no_work):
    home = user_folder(tmp_path / "home")
    monkeypatch.setenv("HOME", str(home))
    patch, calls = no_work
    patch("corpus")
    before = tree_hash(home)
    for out in ("~", str(home)):
        code, _, err = run_cli(argv("corpus", out, tmp_path), capsys)
        assert_usage_error(code, err, "corpus", "home folder")
    assert tree_hash(home) == before and calls == []


def test_pack_data_equal_out_and_out_inside_data(tmp_path, capsys):
    """`--data X --out X` (a pack output reused as data) and an output inside --data are refused."""
    corpus = write_corpus(tmp_path / "c.jsonl")
    first = tmp_path / "p1"
    assert run_cli(["pack", "--model", "random:llama", "--data", corpus, "--seq-len", "16", "--no-progress",
                    "--out", first], capsys)[0] == 0
    before = tree_hash(first)
    for out, needle in ((first, "is the input"), (first / "again", "inside the input"),
                        (first / "store", "inside the input")):
        code, _, err = run_cli(["pack", "--model", "random:llama", "--data", first, "--seq-len", "16",
                                "--no-progress", "--out", out], capsys)
        assert_usage_error(code, err, "pack", needle)
    assert tree_hash(first) == before


def test_anchor_outputs_and_empty_folders_are_replaced(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    out.mkdir()  # empty: allowed
    args = ["pack", "--model", "random:llama", "--data", corpus, "--seq-len", "16", "--no-progress", "--out", out]
    assert run_cli(args, capsys)[0] == 0
    marker = read_marker(out)
    print("marker:", marker)
    assert marker is not None and marker["verb"] == "pack" and "version" in marker
    first = json.loads((out / "pack.json").read_text())
    assert run_cli([*args[:-3], "--seq-len", "24", "--out", out], capsys)[0] == 0  # carries the marker: replaced
    second = json.loads((out / "pack.json").read_text())
    print("seq_len before/after:", first["seq_len"], second["seq_len"])
    assert (first["seq_len"], second["seq_len"]) == (16, 24)
    assert leftovers(tmp_path, "out") == []
    # a folder the user put one file into after anchor wrote it still carries the marker: anchor's to replace
    # (documented in the README); a folder without it is not
    (out / MARKER).unlink()
    code, _, err = run_cli(args, capsys)
    assert_usage_error(code, err, "pack", "anchor did not write")
    assert (out / "pack.json").is_file()


def test_guard_out_rules(tmp_path, monkeypatch):
    """The API `anchor train` uses: replace=False needs the same verb's marker."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert guard_out(run, "train", replace=False) == run  # missing
    run.mkdir()
    assert guard_out(run, "train", replace=False) == run  # empty
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(InputError, match="did not write"):
        guard_out(run, "train", replace=False)
    write_marker(run, "train")
    assert guard_out(run, "train", replace=False) == run
    write_marker(run, "pack")
    with pytest.raises(InputError, match="`anchor pack`, not of `anchor train`"):
        guard_out(run, "train", replace=False)
    assert guard_out(run, "pack") == run
    # inputs: None and model names are skipped, paths are checked
    assert guard_out(tmp_path / "o", "x", inputs=(None, "random:llama", "default", str(tmp_path / "nope")))
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "data.jsonl").write_text("")
    with pytest.raises(InputError, match="holds the input"):
        guard_out(tmp_path / "a", "x", inputs=(str(tmp_path / "a" / "b" / "data.jsonl"),))
    with pytest.raises(InputError, match="lies inside the input"):
        guard_out(tmp_path / "a" / "b" / "o", "x", inputs=(str(tmp_path / "a" / "b"),))
    for bad in (".", str(tmp_path), "/", os.path.expanduser("~")):
        with pytest.raises(InputError):
            guard_out(bad, "x")


def test_unwritable_parent_is_refused_before_work(tmp_path, capsys, monkeypatch, no_work):
    """A read-only disk or a folder without write permission (simulated: the tests may run as root)."""
    import anchor_core.outdir

    real = os.access
    parent = tmp_path / "ro"
    parent.mkdir()
    monkeypatch.setattr(anchor_core.outdir.os, "access",
                        lambda p, mode: False if Path(p) == parent else real(p, mode))
    patch, calls = no_work
    for verb in ("audit", "parity"):
        patch(verb)
        code, _, err = run_cli(argv(verb, str(parent / "out"), tmp_path / "c.jsonl"), capsys)
        assert_usage_error(code, err, verb, "cannot write into", str(parent))
    assert calls == [] and list(parent.iterdir()) == []


def test_full_disk_mid_run_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """ENOSPC while writing: one line naming the file, exit 2, the staging folder and lock removed."""
    import errno

    import anchor_core.data.pipeline as pipeline

    def full(length, selection, cfg, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(pipeline, "plot_doc_lengths", full)
    corpus = write_corpus(tmp_path / "c.jsonl")
    code, _, err = run_cli(argv("pack", str(tmp_path / "out"), corpus), capsys)
    assert_usage_error(code, err, "pack", "doc_lengths.png", "No space left on device")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []


def test_pack_refused_when_the_windows_cannot_fit_on_disk(tmp_path, capsys, monkeypatch):
    import anchor_core.limits

    monkeypatch.setattr(anchor_core.limits, "free_disk", lambda folder: 10_000)
    corpus = write_corpus(tmp_path / "c.jsonl")
    code, _, err = run_cli(argv("pack", str(tmp_path / "out"), corpus), capsys)
    assert_usage_error(code, err, "pack", "windows of 16 slots needs about", "of disk")
    code, _, err = run_cli([*argv("pack", str(tmp_path / "out"), corpus), "--budget", "1000000000"], capsys)
    assert_usage_error(code, err, "pack", "--budget 1000000000", "of disk")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []
