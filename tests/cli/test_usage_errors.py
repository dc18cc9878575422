"""Every verb x every class of usage error: exit 2, one line `anchor VERB: error: ...`, no traceback,
nothing written (docs/DESIGN.md §6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

from anchor.cli import app, load_commands
from tests.cli.helpers import assert_usage_error, leftovers, run_cli, write_corpus

load_commands()
COMMANDS = typer.main.get_command(app).commands  # every registered verb, train included when present


def _opts(verb: str) -> set[str]:
    return {o for p in COMMANDS[verb].params for o in p.opts}


def _required(verb: str) -> list[str]:
    return [p.opts[0] for p in COMMANDS[verb].params if p.required and p.opts[0].startswith("--")]


def _takes_arguments(verb: str) -> bool:
    return any(p.param_type_name == "argument" for p in COMMANDS[verb].params)


# Valid arguments of each verb (cheap: random:llama, --quick, one step), so that a value error is about the
# option under test; {out} and {corpus} are filled in per test.
BASE = {
    "audit": ["--model", "random:llama", "--quick", "--no-progress", "--out", "{out}"],
    "corpus": ["--max-docs", "1", "--no-progress", "--out", "{out}"],
    "demo": ["--model", "random:llama", "--jobs", "top5", "--no-progress", "--out", "{out}"],
    "pack": ["--model", "random:llama", "--data", "{corpus}", "--seq-len", "16", "--no-progress", "--out", "{out}"],
    "parity": ["--model", "random:llama", "--variants", "full", "--engines", "eager", "--policies", "fp32",
               "--no-progress", "--out", "{out}"],
    "plan": ["--config", "tiny", "--device", "h100"],  # prints its plan: no --out
}


def _set(args: list[str], flag: str, value: str) -> list[str]:
    args = list(args)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    return args


def _cases() -> list:
    """(verb, case id, argv builder, needles): the matrix of verbs x usage-error classes."""
    cases = [
        (None, "no-arguments", lambda f: [], ["no verb given"]),
        (None, "unknown-verb", lambda f: ["frobnicate"], ["No such command", "frobnicate"]),
        (None, "unknown-top-option", lambda f: ["--bogus"], ["--bogus"]),
    ]
    for verb in sorted(COMMANDS):
        base = BASE.get(verb)
        out_args = base if base is not None else ["--out", "{out}"]
        cases.append((verb, "unknown-option", lambda f, v=verb, b=out_args: [v, *b, "--bogus", "1"], ["--bogus"]))
        valued = "--out" if "--out" in _opts(verb) else "--config"  # an option that takes a value
        cases.append((verb, "option-without-value", lambda f, v=verb, o=valued: [v, o], [valued, "requires an argument"]))
        if "--out" in _required(verb):
            cases.append((verb, "missing-out", lambda f, v=verb: [v], ["--out"]))
        if not _takes_arguments(verb):
            cases.append((verb, "extra-argument", lambda f, v=verb, b=out_args: [v, *b, "surplus"],
                          ["unexpected extra argument", "surplus"]))
        if "--seq-len" in _opts(verb) and base is not None:
            for value, needle in (("abc", "--seq-len"), ("0", "--seq-len"), ("-5", "--seq-len"),
                                  ("", "--seq-len"), ("1.5", "--seq-len")):
                cases.append((verb, f"seq-len-{value or 'empty'}",
                              lambda f, v=verb, b=base, x=value: [v, *_set(b, "--seq-len", x)], [needle]))
        if "--seed" in _opts(verb) and base is not None:
            for value in ("-1", "abc", str(2**32), "99999999999999999999999"):
                cases.append((verb, f"seed-{value[:6]}", lambda f, v=verb, b=base, x=value: [v, *b, "--seed", x],
                              ["--seed"]))
    cases += [
        ("corpus", "max-docs-0", lambda f: ["corpus", "--max-docs", "0", "--out", f["out"]], ["--max-docs"]),
        ("demo", "jobs-empty", lambda f: ["demo", *_set(BASE["demo"], "--jobs", "")], ["--jobs", "no job"]),
        ("demo", "jobs-unknown", lambda f: ["demo", *_set(BASE["demo"], "--jobs", "top5,bake")], ["bake"]),
        ("pack", "budget-0", lambda f: ["pack", *BASE["pack"], "--budget", "0"], ["--budget"]),
        ("pack", "long-threshold-0", lambda f: ["pack", *BASE["pack"], "--long-threshold", "0"], ["--long-threshold"]),
        ("pack", "upsample-factor-inf", lambda f: ["pack", *BASE["pack"], "--upsample-factor", "inf"],
         ["--upsample-factor"]),
        ("pack", "upsample-factor-huge", lambda f: ["pack", *BASE["pack"], "--upsample-factor", "1e9"],
         ["--upsample-factor"]),
        ("pack", "mean-chunk-negative", lambda f: ["pack", *BASE["pack"], "--mean-chunk", "-1"], ["--mean-chunk"]),
        ("pack", "missing-model", lambda f: ["pack", "--data", f["corpus"], "--seq-len", "16", "--out", f["out"]],
         ["--model"]),
        ("parity", "seq-len-beyond-positions", lambda f: ["parity", *_set(BASE["parity"], "--seq-len", "5000")],
         ["--seq-len 5000", "4096 positions"]),
        ("audit", "seq-len-beyond-positions", lambda f: ["audit", *BASE["audit"], "--seq-len", "5000"],
         ["--seq-len 5000", "max position 4096"]),
        ("audit", "num-seqs-0", lambda f: ["audit", *BASE["audit"], "--num-seqs", "0"], ["--num-seqs"]),
        ("parity", "variants-empty", lambda f: ["parity", *_set(BASE["parity"], "--variants", ",")], ["--variants"]),
    ]
    return [pytest.param(*c, id=f"{c[0] or 'anchor'}-{c[1]}") for c in cases]


def _fill(args: list[str], f: dict[str, str]) -> list[str]:
    return [a.format(**f) for a in args]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("usage") / "c.jsonl")


@pytest.mark.parametrize("verb, case, build, needles", _cases())
def test_usage_error_matrix(verb, case, build, needles, corpus, tmp_path, capsys):
    fill = {"out": str(tmp_path / "out"), "corpus": str(corpus)}
    argv = _fill(build(fill), fill)
    code, _, err = run_cli(argv, capsys)
    assert_usage_error(code, err, verb, *needles)
    print("output folder exists:", (tmp_path / "out").exists(), "leftovers:", leftovers(tmp_path, "out"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []


def test_every_verb_is_in_the_matrix():
    """A new verb gets the generic rows automatically; the value rows need its BASE arguments."""
    ids = {p.id for p in _cases()}
    print(sorted(COMMANDS), len(ids))
    for verb in COMMANDS:
        assert f"{verb}-unknown-option" in ids and f"{verb}-option-without-value" in ids
    for verb in BASE:
        assert verb in COMMANDS


def test_big_seq_len_refused_before_anything_is_written(corpus, tmp_path, capsys, monkeypatch):
    """`--seq-len 1000000000` is refused by the memory estimate (8 GiB available here), before staging."""
    import anchor_core.limits

    monkeypatch.setattr(anchor_core.limits, "available_memory", lambda: 8 << 30)
    for verb in ("pack", "demo"):
        fill = {"out": str(tmp_path / "out"), "corpus": str(corpus)}
        argv = [verb, *_set(_fill(BASE[verb], fill), "--seq-len", "1000000000")]
        code, _, err = run_cli(argv, capsys)
        assert_usage_error(code, err, verb, "--seq-len 1000000000", "memory")
        assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []


def test_attention_sized_seq_len_refused_by_the_memory_estimate(corpus, tmp_path, capsys, monkeypatch):
    """Within the model's 4096 positions, but [heads, T, T] maps of T = 4096 do not fit in 1 GiB."""
    import anchor_core.limits

    monkeypatch.setattr(anchor_core.limits, "available_memory", lambda: 1 << 30)
    fill = {"out": str(tmp_path / "out"), "corpus": str(corpus)}
    for verb in ("audit", "parity"):
        argv = [verb, *_set(_fill(BASE[verb], fill), "--seq-len", "4096")]
        code, _, err = run_cli(argv, capsys)
        assert_usage_error(code, err, verb, "--seq-len 4096", "memory", "1.0 GiB is available")
        assert not (tmp_path / "out").exists() and leftovers(tmp_path, "out") == []
    monkeypatch.setattr(anchor_core.limits, "available_memory", lambda: 64 << 30)  # the same sizes fit in 64 GiB
    from anchor_core.limits import check_memory
    from anchor_core.spec import random_preset
    from parity_tests.audit.maps import MEM_BYTES_PER_MAP_ENTRY

    check_memory(2 * MEM_BYTES_PER_MAP_ENTRY * random_preset("llama").num_heads * 4096 ** 2, "audit T=4096")


@pytest.mark.parametrize("argv, verb, needle", [
    ([], None, "no verb given"),
    (["nope"], None, "No such command"),
    (["pack", "--bogus"], "pack", "--bogus"),
    (["parity", "--out", "x", "--seq-len", "abc"], "parity", "--seq-len"),
])
def test_console_script(argv, verb, needle, tmp_path):
    """The installed `anchor` script in its own process: exit 2, one stderr line, no traceback."""
    exe = Path(sys.executable).parent / "anchor"
    r = subprocess.run([str(exe), *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    print(argv, r.returncode, repr(r.stdout[:200]), repr(r.stderr))
    assert_usage_error(r.returncode, r.stderr, verb, needle)
    assert r.stdout == ""
