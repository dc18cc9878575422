"""`anchor corpus` and `anchor pack` through the CLI: outputs, stats, and bad input (exit 2, one line, no
half-written folder)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from anchor.cli import main
from anchor_core.data.batch import VARIANTS
from anchor_core.data.packed import Loader, PackedData


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    print(argv, e.value.code, out, err)
    return e.value.code, out, err


def pack_args(data, out, *extra, model="random:llama", seq_len=64):
    return ["pack", "--model", model, "--data", str(data), "--seq-len", str(seq_len), "--out", str(out),
            "--no-progress", *extra]


def write_jsonl(path, lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode()
                              for line in lines))
    return path


def no_leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}")] == []


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A synthetic corpus in three domains with long and short documents."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "épsilon", "ζῆτα", "def", "return", "\n", "  "]
    lines = []
    for i in range(240):
        domain = ["web", "code", "books"][i % 3]
        n = int(rng.integers(300, 700)) if rng.random() < [0.1, 0.3, 0.6][i % 3] else int(rng.integers(3, 60))
        lines.append({"text": " ".join(rng.choice(words, n)), "meta": {"redpajama_set_name": domain}})
    return write_jsonl(path, lines)


def test_corpus_command(tmp_path, capsys):
    code, out, _ = run(["corpus", "--out", str(tmp_path / "c"), "--max-docs", "4", "--no-progress"], capsys)
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "c" / "corpus.jsonl").read_text().splitlines()]
    domains = {r["domain"] for r in records}
    assert {"code", "docs", "prose", "license"} <= domains
    assert all(isinstance(r["text"], str) and r["text"].strip() for r in records)
    assert no_leftovers(tmp_path, "c")


def test_pack_upsample_long_on_the_embedded_corpus(tmp_path, capsys):
    """`anchor pack --mixture upsample_long` on the embedded corpus: no document
    repeated (the pool suffices), a long-document share above the original mixture's, the domains' shares
    reported before and after, and moved."""
    from anchor_core.data.corpus import CORPUS_FILE, write_default_corpus

    write_default_corpus(tmp_path / "c")
    out = tmp_path / "packed"
    code, _, _ = run(pack_args(tmp_path / "c" / CORPUS_FILE, out, "--mixture", "upsample_long", "--long-threshold", "16384",
                               "--upsample-factor", "3", seq_len=1024), capsys)
    assert code == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["mixture"]["repeated_docs"] == 0
    rows = stats["domains"].values()
    assert all(r["repeated_docs"] == 0 for r in rows)
    long_then = sum(r["source_long_share"] * r["source_tokens"] for r in rows) / sum(r["source_tokens"] for r in rows)
    long_now = sum(r["long_share"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows)
    print({k: (round(r["source_token_ratio"], 3), round(r["token_ratio"], 3)) for k, r in stats["domains"].items()},
          "long share", round(long_then, 3), "->", round(long_now, 3))
    assert long_now > long_then + 0.02
    assert max(abs(r["token_ratio"] - r["source_token_ratio"]) for r in rows) > 0.005
    assert "0 repeated" in (out / "stats.md").read_text()


def test_pack_interleave_cuts_most_short_documents_at_65536(tmp_path, capsys):
    """`--interleave` at 65536 on a SlimPajama-like length distribution
    (log-normal, median ~500 tokens) cuts most documents of 64-2048 tokens into 2-3 chunks, and
    stats.json says so; the per-slot scheme (`--mean-chunk 8192`, its default T/8 at this length)
    leaves almost all of them whole."""
    rng = np.random.default_rng(3)
    words = np.clip(rng.lognormal(np.log(500), 1.2, 500), 5, 30000).astype(int)
    data = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(["alpha"] * int(n)), "meta": {"redpajama_set_name": "RedPajamaCommonCrawl"}}
                                               for n in words])
    out = {}
    for name, extra in (("chunks", []), ("per_slot", ["--mean-chunk", "8192"])):
        code, _, _ = run(pack_args(data, tmp_path / name, "--interleave", *extra, seq_len=65536), capsys)
        assert code == 0
        out[name] = json.loads((tmp_path / name / "stats.json").read_text())["interleave"]
    c = out["chunks"]
    print({k: (v["docs_in_range"], v["docs_in_range_cut"], v["chunks_in_range"]) for k, v in out.items()})
    assert c["scheme"] == "chunk_docs" and c["docs_in_range"] > 150
    assert c["in_range_cut_share"] > 0.9
    assert set(c["chunks_in_range"]) == {"2", "3"}
    assert min(c["chunks_in_range"].values()) > 0.3 * c["docs_in_range_cut"]
    assert out["per_slot"]["in_range_cut_share"] < 0.3
    assert "documents of 64-2048 slots cut" in (tmp_path / "chunks" / "stats.md").read_text()


def test_pack_end_to_end(small_corpus, tmp_path, capsys):
    out = tmp_path / "packed"
    code, _, _ = run(pack_args(small_corpus, out, "--mixture", "upsample_repeat", "--long-threshold", "2000",
                               "--upsample-factor", "3", "--tags", "--interleave", "--seed", "4"), capsys)
    assert code == 0
    for name in ("pack.json", "stats.json", "stats.md", "doc_lengths.png", "store/store.json"):
        assert (out / name).is_file(), name
    stats = json.loads((out / "stats.json").read_text())
    assert set(stats["domains"]) == {"web", "code", "books"}
    for row in stats["domains"].values():
        assert abs(row["token_ratio"] - row["source_token_ratio"]) < 0.01
        assert row["long_share"] >= row["source_long_share"]
    assert any(r["long_share"] > r["source_long_share"] + 0.05 for r in stats["domains"].values())
    assert 0 < stats["attention_compute_ratio_anchor_vs_full"] <= 1
    assert 0 <= stats["windows"]["boundary_window_share"] <= 1
    md = (out / "stats.md").read_text()
    assert "| web |" in md and "mixture ratio" in md and "long share" in md
    data = PackedData.open(out)
    assert data.seq_len == 64 and data.num_windows == stats["windows"]["count"]
    for variant in VARIANTS:
        b = next(Loader(data, 4, variant, seed=0))
        assert b.tokens.shape == (4, 64) and (b.tokens[:, 0] == 1).all()
        assert (b.loss_mask[data.windows(Loader(data, 4, variant, seed=0).indices())[2].astype(bool)] == 0).all()


def test_pack_reuses_store_and_rejects_other_tokenizer(small_corpus, tmp_path, capsys):
    first = tmp_path / "p1"
    assert run(pack_args(small_corpus, first), capsys)[0] == 0
    assert run(pack_args(first / "store", tmp_path / "p2", "--seq-len", "32"), capsys)[0] == 0
    assert run(pack_args(first, tmp_path / "p2b", "--seq-len", "32"), capsys)[0] == 0
    assert PackedData.open(tmp_path / "p2b").num_windows == PackedData.open(tmp_path / "p2").num_windows
    # a pack made from a store is self-contained: its store lies inside it (hard links of the first one's files)
    for name in ("p2", "p2b"):
        meta = json.loads((tmp_path / name / "pack.json").read_text())
        print(name, "store:", meta["store"])
        assert meta["store"] == "store" and (tmp_path / name / "store" / "tokens.bin").is_file()
    assert (tmp_path / "p2" / "store" / "tokens.bin").read_bytes() == (first / "store" / "tokens.bin").read_bytes()
    code, _, err = run(pack_args(first / "store", tmp_path / "p3", model="random:qwen2"), capsys)
    assert code == 2 and "another tokenizer" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p3").exists() and no_leftovers(tmp_path, "p3")


@pytest.mark.parametrize(
    "lines, message",
    [
        ([{"text": "fine"}, b'{"text": broken\n'], "bad.jsonl:2: invalid JSON"),
        ([{"text": "fine"}, {"body": "no text"}], "bad.jsonl:2: text field 'text' is missing"),
        ([{"text": "fine"}, b'{"text": "\xc3\x28"}\n'], "bad.jsonl:2: invalid UTF-8"),
        ([{"text": "  "}, {"text": ""}], "no documents to tokenize (2 empty)"),
        ([], "no documents to tokenize"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, lines, message):
    data = write_jsonl(tmp_path / "bad.jsonl", lines)
    out = tmp_path / "out"
    code, _, err = run(pack_args(data, out), capsys)
    assert code == 2
    assert message in err and err.startswith("anchor pack: error:")
    assert len(err.strip().splitlines()) == 1
    assert not out.exists() and no_leftovers(tmp_path, "out")


def test_skip_bad_counts(tmp_path, capsys):
    data = write_jsonl(tmp_path / "mixed.jsonl", [
        {"text": "one"}, b'{"text": broken\n', {"body": "x"}, b'{"text": "\xff"}\n', {"text": " "}, {"text": "two"},
    ])
    code, _, _ = run(pack_args(data, tmp_path / "out", "--skip-bad"), capsys)
    assert code == 0
    read = json.loads((tmp_path / "out" / "stats.json").read_text())["read"]
    assert read == {"read": 2, "skipped": {"bad_json": 1, "bad_utf8": 1, "empty": 1, "missing_text": 1}}


def test_empty_documents_are_counted(tmp_path, capsys):
    data = write_jsonl(tmp_path / "e.jsonl", [{"text": "a"}, {"text": ""}, {"text": "\n\t "}, {"text": "b"}])
    assert run(pack_args(data, tmp_path / "out"), capsys)[0] == 0
    read = json.loads((tmp_path / "out" / "stats.json").read_text())["read"]
    assert read == {"read": 2, "skipped": {"empty": 2}}
    assert "2 empty" in (tmp_path / "out" / "stats.md").read_text()


def test_failed_pack_keeps_previous_output(small_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(pack_args(small_corpus, out), capsys)[0] == 0
    before = (out / "pack.json").read_text()
    bad = write_jsonl(tmp_path / "bad.jsonl", [b"{\n"])
    assert run(pack_args(bad, out), capsys)[0] == 2
    assert (out / "pack.json").read_text() == before and no_leftovers(tmp_path, "out")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "random:nope"], "unknown random preset"),
        (["--mixture", "weird"], "unknown mixture"),
        (["--model", "/no/such/model"], "no such model"),
    ],
)
def test_bad_options(small_corpus, tmp_path, capsys, argv, message):
    args = pack_args(small_corpus, tmp_path / "o")
    for key, value in zip(argv[::2], argv[1::2]):
        if key in args:
            args[args.index(key) + 1] = value
        else:
            args += [key, value]
    code, _, err = run(args, capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.model
def test_pack_with_smollm2(gguf_path, small_corpus, tmp_path, capsys):
    out = tmp_path / "s"
    assert run(pack_args(small_corpus, out, model="default", seq_len=128), capsys)[0] == 0
    data = PackedData.open(out)
    tokens, seg, _ = data.windows(range(data.num_windows))
    assert (tokens[:, 0] == 1).all()  # SmolLM2's BOS
    assert int((tokens[seg >= 0] == 2).sum()) >= json.loads((out / "stats.json").read_text())["mixture"]["selected_docs"] - 1


def test_shards_read_back_as_one(small_corpus, tmp_path):
    from anchor_core.data.pipeline import PackConfig, pack_corpus

    cfg = PackConfig(seq_len=48)
    pack_corpus("random:mistral", small_corpus, tmp_path / "one", cfg)
    pack_corpus("random:mistral", small_corpus, tmp_path / "many", cfg, shard_slots=48 * 7)
    one, many = PackedData.open(tmp_path / "one"), PackedData.open(tmp_path / "many")
    assert len(many.tokens) > 2 and len(one.tokens) == 1
    idx = np.random.default_rng(0).permutation(one.num_windows)
    for a, b in zip(one.windows(idx), many.windows(idx)):
        assert np.array_equal(a, b)


def test_config_file_and_overrides(small_corpus, tmp_path, capsys):
    cfg = tmp_path / "d.yaml"
    cfg.write_text(f"model: random:llama\ndata: {small_corpus}\nseq_len: 40\nmixture: upsample_long\n"
                   "long_threshold: 1000\ntags: true\n")
    code, _, _ = run(["pack", "--config", str(cfg), "--out", str(tmp_path / "o"), "--seq-len", "56",
                      "--no-progress"], capsys)
    assert code == 0
    meta = json.loads((tmp_path / "o" / "pack.json").read_text())
    assert meta["seq_len"] == 56 and meta["mixture"]["kind"] == "upsample_long" and meta["layout"]["tags"]
    cfg.write_text("seq_len: 40\nsequence: 3\n")
    code, _, err = run(["pack", "--config", str(cfg), "--out", str(tmp_path / "p")], capsys)
    assert code == 2 and "unknown key 'sequence'" in err and len(err.strip().splitlines()) == 1
    cfg.write_text("seq_len: forty\n")
    code, _, err = run(["pack", "--config", str(cfg), "--out", str(tmp_path / "p")], capsys)
    assert code == 2 and "seq_len: expected" in err
    code, _, err = run(["pack", "--out", str(tmp_path / "p")], capsys)
    assert code == 2 and "missing option --model" in err


def test_shipped_data_configs_validate():
    from pathlib import Path

    from anchor_core.data.config import load_pack_config

    files = sorted((Path(__file__).resolve().parents[2] / "configs" / "data").glob("*.yaml"))
    assert files
    for f in files:
        assert load_pack_config(f)["seq_len"] >= 2
