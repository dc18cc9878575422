"""Readers: SlimPajama .jsonl.zst, Parquet, saved datasets, text folders, dotted fields, streaming."""

from __future__ import annotations

import json

import pytest

from anchor_core.data.readers import ReadCounts, iter_documents
from anchor_core.errors import InputError

SLIMPAJAMA = [
    {"text": "The quick brown fox.", "meta": {"redpajama_set_name": "RedPajamaWikipedia"}},
    {"text": "def f():\n    return 1\n", "meta": {"redpajama_set_name": "RedPajamaGithub"}},
    {"text": "   ", "meta": {"redpajama_set_name": "RedPajamaC4"}},
    {"text": "Abstract. We study…", "meta": {"redpajama_set_name": "RedPajamaArXiv"}},
]


def write_jsonl_zst(path, records):
    zstandard = pytest.importorskip("zstandard")
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return path


def test_slimpajama_jsonl_zst(tmp_path):
    path = write_jsonl_zst(tmp_path / "example_train_0.jsonl.zst", SLIMPAJAMA)
    counts = ReadCounts()
    docs = list(iter_documents(path, counts=counts))
    print([(d.domain, d.source) for d in docs], counts)
    assert [d.domain for d in docs] == ["RedPajamaWikipedia", "RedPajamaGithub", "RedPajamaArXiv"]
    assert docs[2].text == "Abstract. We study…"
    assert docs[1].source.endswith("example_train_0.jsonl.zst:2")
    assert counts.read == 3 and counts.skipped["empty"] == 1


def test_folder_of_chunks_and_dotted_fields(tmp_path):
    (tmp_path / "chunk1").mkdir()
    write_jsonl_zst(tmp_path / "chunk1" / "a.jsonl.zst", SLIMPAJAMA[:2])
    (tmp_path / "chunk1" / "b.jsonl").write_text(
        json.dumps({"body": {"content": "x y"}, "src": {"name": "web"}}) + "\n")
    docs = list(iter_documents(tmp_path, text_field="body.content", domain_field="src.name", skip_bad=True))
    assert [(d.text, d.domain) for d in docs] == [("x y", "web")]


def test_parquet_and_saved_dataset(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    table = pa.table({"text": ["alpha", "", "gamma"], "domain": ["a", "b", "c"], "extra": [1, 2, 3]})
    pq.write_table(table, tmp_path / "x.parquet")
    counts = ReadCounts()
    docs = list(iter_documents(tmp_path / "x.parquet", counts=counts))
    assert [(d.text, d.domain) for d in docs] == [("alpha", "a"), ("gamma", "c")]
    assert counts.skipped["empty"] == 1
    ds = datasets.Dataset.from_dict({"content": ["one", "two"], "meta": [{"set": "p"}, {"set": "q"}]})
    ds.save_to_disk(str(tmp_path / "saved"))
    docs = list(iter_documents(tmp_path / "saved", text_field="content", domain_field="meta.set"))
    assert [(d.text, d.domain) for d in docs] == [("one", "p"), ("two", "q")]
    with pytest.raises(InputError, match="no column 'text'"):
        list(iter_documents(tmp_path / "saved"))


def test_text_folder_domains(tmp_path):
    (tmp_path / "news").mkdir()
    (tmp_path / "news" / "a.txt").write_text("news one")
    (tmp_path / "top.txt").write_text("top level")
    (tmp_path / "news" / "empty.txt").write_text("\n")
    counts = ReadCounts()
    docs = list(iter_documents(tmp_path, counts=counts))
    assert [(d.domain, d.text) for d in docs] == [("news", "news one"), ("text", "top level")]
    assert counts.skipped["empty"] == 1


def test_streaming_reads_lazily(tmp_path):
    """The reader yields documents before it has seen the whole file (here: a bad last line)."""
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(1000):
            f.write(json.dumps({"text": f"doc {i}"}) + "\n")
        f.write("{not json\n")
    it = iter_documents(path)
    assert next(it).text == "doc 0"
    with pytest.raises(InputError, match=r"big.jsonl:1001: invalid JSON"):
        list(it)


@pytest.mark.parametrize(
    "content, message, reason",
    [
        (b'{"text": "ok"}\n{"text": oops}\n', r"bad.jsonl:2: invalid JSON", "bad_json"),
        (b'{"text": "ok"}\n{"txt": "x"}\n', r"bad.jsonl:2: text field 'text' is missing", "missing_text"),
        (b'{"text": "ok"}\n{"text": 5}\n', r"bad.jsonl:2: text field 'text' is not a string", "missing_text"),
        (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', r"bad.jsonl:2: invalid UTF-8", "bad_utf8"),
        (b'{"text": "ok"}\n[1, 2]\n', r"bad.jsonl:2: a JSON line must be an object", "bad_json"),
    ],
)
def test_bad_records(tmp_path, content, message, reason):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message) as e:
        list(iter_documents(path))
    assert "\n" not in str(e.value)
    counts = ReadCounts()
    docs = list(iter_documents(path, skip_bad=True, counts=counts))
    assert [d.text for d in docs] == ["ok"] and counts.skipped[reason] == 1


def test_missing_path(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        list(iter_documents(tmp_path / "nope"))
