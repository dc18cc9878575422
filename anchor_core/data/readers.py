"""Streaming document readers: JSONL (plain, .zst, .gz), Parquet, saved `datasets`, text folders.

    counts = ReadCounts()
    for doc in iter_documents("chunk1/", text_field="text", domain_field=None, counts=counts):
        doc.text, doc.domain

Every reader is a generator that holds one line (JSONL), one record batch (Parquet, datasets)
or one file (text folders) at a time, so a corpus larger than memory streams through.

Fields are dotted paths into each record (`meta.redpajama_set_name`). With `domain_field=None`
the domain is `domain` if the record has it, else SlimPajama's `meta.redpajama_set_name`, else
the name of the file's folder relative to the root (text folders), else "default".

Bad records: invalid JSON, invalid UTF-8, a missing or non-string text field raise an
InputError naming the file and line, unless `skip_bad=True`, which skips and counts them.
Empty documents (only whitespace) are always skipped and counted.
"""

from __future__ import annotations

import gzip
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from anchor_core.data.corpus import corpus_folder_file
from anchor_core.errors import InputError
from anchor_core.errors import current_verb

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.zst", ".json.zst", ".jsonl.gz", ".json.gz", ".zst")
PARQUET_SUFFIXES = (".parquet",)
AUTO_DOMAIN_FIELDS = ("domain", "meta.redpajama_set_name")
DEFAULT_DOMAIN = "default"


@dataclass(frozen=True)
class Document:
    text: str
    domain: str
    source: str  # "file:line" or "file" or "dir[split]:row", for error messages


@dataclass
class ReadCounts:
    """Documents read and skipped, by reason (`empty`, `bad_json`, `bad_utf8`, `missing_text`, ...)."""

    read: int = 0
    skipped: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "skipped": {k: v for k, v in sorted(self.skipped.items()) if v}}


def _suffix_kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def recognized_corpus_file(path: str | Path) -> bool:
    """Whether a file's name is one the corpus readers read as JSONL or Parquet (else it is plain text)."""
    return _suffix_kind(Path(path)) is not None


def _hint(kind: str, unit: str = "lines") -> str:
    """How the running verb lets the user get past a bad record: `kind` is "skip" or "field".

    Only `anchor pack` has --skip-bad/--text-field, `anchor train` has the config keys (data.pack.skip_bad,
    data.pack.text_field); a library caller has the keyword arguments; other verbs (audit, demo) have
    neither, so their messages carry no hint.
    """
    verb = current_verb()
    if verb == "pack":
        return f" (use --skip-bad to skip such {unit})" if kind == "skip" else " (use --text-field, or --skip-bad)"
    if verb == "train":  # the keys as a train config or an override names them
        return (f" (set data.pack.skip_bad: true to skip such {unit})" if kind == "skip"
                else " (set data.pack.text_field, or data.pack.skip_bad: true)")
    if verb == "anchor":  # called as a library
        return f" (skip_bad=True skips such {unit})" if kind == "skip" else " (see text_field, skip_bad)"
    return ""


def _get(record: Any, dotted: str) -> Any:
    cur = record
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


class _Fields:
    """Pulls text and domain out of one record; shared by JSONL, Parquet and datasets readers."""

    def __init__(self, text_field: str, domain_field: str | None, fallback_domain: str):
        self.text_field = text_field
        self.domain_field = domain_field
        self.fallback = fallback_domain

    def domain(self, record: dict) -> str:
        if self.domain_field is not None:
            value = _get(record, self.domain_field)
            return DEFAULT_DOMAIN if value is None else str(value)
        for name in AUTO_DOMAIN_FIELDS:
            value = _get(record, name)
            if value is not None:
                return str(value)
        return self.fallback


def _emit(text: Any, domain: str, source: str, fields: _Fields, skip_bad: bool,
          counts: ReadCounts) -> Document | None:
    if not isinstance(text, str):
        if skip_bad:
            counts.skipped["missing_text"] += 1
            return None
        what = "missing" if text is None else f"not a string ({type(text).__name__})"
        raise InputError(f"text field {fields.text_field!r} is {what}{_hint('field')}",
                         path=source)
    if not text.strip():
        counts.skipped["empty"] += 1
        return None
    counts.read += 1
    return Document(text=text, domain=domain, source=source)


def _open_binary(path: Path) -> io.BufferedIOBase:
    name = path.name.lower()
    raw = open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, buffer_size=1 << 20)  # type: ignore[arg-type]
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw


def read_jsonl(path: Path, fields: _Fields, *, skip_bad: bool, counts: ReadCounts) -> Iterator[Document]:
    """One document per line of a JSONL file (optionally zstd- or gzip-compressed)."""
    try:
        f = _open_binary(path)
    except OSError as e:
        raise InputError(f"cannot open: {e.strerror or e}", path=path) from None
    with f:
        lineno = 0
        while True:
            try:
                raw = f.readline()
            except Exception as e:  # zstandard.ZstdError, gzip.BadGzipFile, EOFError, OSError
                raise InputError(f"line {lineno + 1}: cannot decompress: {e}", path=path) from None
            if not raw:
                return
            lineno += 1
            if not raw.strip():
                continue
            source = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if skip_bad:
                    counts.skipped["bad_utf8"] += 1
                    continue
                raise InputError(f"invalid UTF-8 at byte {e.start}{_hint('skip')}",
                                 path=source) from None
            try:
                record = json.loads(line)
            except ValueError as e:
                if lineno == 1 and _json_document(path):
                    raise InputError("a JSON document, not JSONL (one JSON object a line, each with the text)",
                                     path=path) from None
                if skip_bad:
                    counts.skipped["bad_json"] += 1
                    continue
                raise InputError(f"invalid JSON: {e}{_hint('skip')}", path=source) from None
            if not isinstance(record, dict):
                if skip_bad:
                    counts.skipped["bad_json"] += 1
                    continue
                raise InputError(f"a JSON line must be an object{_hint('skip')}", path=source)
            doc = _emit(_get(record, fields.text_field), fields.domain(record), source, fields, skip_bad, counts)
            if doc is not None:
                yield doc


def _json_document(path: Path, limit: int = 1 << 26) -> bool:
    """Whether `path` (uncompressed, under `limit` bytes) holds one JSON document over several lines (e.g. the
    corpus.json summary beside `anchor corpus`'s JSONL): what a JSONL reader refuses by name, not by line."""
    try:
        if path.name.lower().endswith((".zst", ".gz")) or path.stat().st_size > limit:
            return False
        json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return True


def check_documents(path: str | Path, *, text_field: str = "text") -> None:
    """Read `path` up to its first document (iter_documents): a file or folder that cannot be read as
    documents is its one-line InputError now, before the work that reads it later."""
    counts = ReadCounts()
    for _ in iter_documents(path, text_field=text_field, counts=counts):
        return
    raise InputError("holds no documents (every one empty or unreadable)", path=path)


def _top(dotted: str | None) -> str | None:
    return None if dotted is None else dotted.split(".", 1)[0]


def _records_from_arrow_batches(batches: Iterable[Any], where: str, fields: _Fields, *, skip_bad: bool,
                                counts: ReadCounts) -> Iterator[Document]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            source = f"{where}:row {row}"
            row += 1
            doc = _emit(_get(record, fields.text_field), fields.domain(record), source, fields, skip_bad, counts)
            if doc is not None:
                yield doc


def _columns(names: list[str], fields: _Fields) -> list[str]:
    wanted = {_top(fields.text_field)}
    wanted |= {_top(fields.domain_field)} if fields.domain_field else {_top(d) for d in AUTO_DOMAIN_FIELDS}
    return [c for c in names if c in wanted]


def read_parquet(path: Path, fields: _Fields, *, skip_bad: bool, counts: ReadCounts) -> Iterator[Document]:
    """Documents of a Parquet file, one record batch at a time (only the needed columns)."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow.ArrowInvalid, OSError
        raise InputError(f"not a readable Parquet file: {str(e).splitlines()[0]}", path=path) from None
    columns = _columns(pf.schema_arrow.names, fields)
    if _top(fields.text_field) not in columns and not skip_bad:
        raise InputError(f"no column {_top(fields.text_field)!r} (columns: {', '.join(pf.schema_arrow.names)};"
                         " use --text-field)", path=path)
    yield from _records_from_arrow_batches(pf.iter_batches(batch_size=1024, columns=columns), str(path),
                                           fields, skip_bad=skip_bad, counts=counts)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def read_saved_dataset(path: Path, fields: _Fields, *, skip_bad: bool, counts: ReadCounts) -> Iterator[Document]:
    """Documents of a `datasets.Dataset.save_to_disk` folder (a DatasetDict: every split, sorted)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise InputError(f"not a readable saved dataset: {str(e).splitlines()[0]}", path=path) from None
    splits = [(name, ds[name]) for name in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [(None, ds)]
    for name, split in splits:
        where = f"{path}[{name}]" if name else str(path)
        columns = _columns(split.column_names, fields)
        if _top(fields.text_field) not in columns and not skip_bad:
            raise InputError(f"no column {_top(fields.text_field)!r} (columns: {', '.join(split.column_names)};"
                             " use --text-field)", path=where)
        table = split.select_columns(columns).with_format("arrow")
        yield from _records_from_arrow_batches(table.iter(batch_size=1024), where, fields,
                                               skip_bad=skip_bad, counts=counts)


def read_text_file(path: Path, domain: str, *, skip_bad: bool, counts: ReadCounts) -> Iterator[Document]:
    """A whole text file as one document."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path=path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if skip_bad:
            counts.skipped["bad_utf8"] += 1
            return
        raise InputError(f"invalid UTF-8 at byte {e.start}{_hint('skip', 'files')}", path=path) from None
    if not text.strip():
        counts.skipped["empty"] += 1
        return
    counts.read += 1
    yield Document(text=text, domain=domain, source=str(path))


def _walk(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(s.startswith(".") for s in p.relative_to(root).parts))


def iter_documents(path: str | Path, *, text_field: str = "text", domain_field: str | None = None,
                   skip_bad: bool = False, counts: ReadCounts | None = None) -> Iterator[Document]:
    """Stream the documents of a file or folder, in a deterministic order.

    Args:
      path: a `.jsonl[.zst|.gz]` or `.parquet` file; a folder written by `anchor corpus` (its declared
        JSONL, `anchor_core.data.corpus.corpus_folder_file`); a folder saved by `datasets`; a folder of
        such files (read in sorted order); or a folder of text files (one document each, domain =
        the file's first folder under the root, or "text" at the top).
      text_field, domain_field: dotted paths; `domain_field=None` picks `domain`, then
        `meta.redpajama_set_name` (SlimPajama), then the folder name / "default".
      skip_bad: skip (and count) bad records instead of raising.
      counts: filled with read and skipped counts as the stream is consumed.
    """
    counts = counts if counts is not None else ReadCounts()
    path = Path(path)
    fields = _Fields(text_field, domain_field, DEFAULT_DOMAIN)
    if path.is_file():
        kind = _suffix_kind(path)
        if kind == "jsonl":
            yield from read_jsonl(path, fields, skip_bad=skip_bad, counts=counts)
        elif kind == "parquet":
            yield from read_parquet(path, fields, skip_bad=skip_bad, counts=counts)
        else:
            yield from read_text_file(path, "text", skip_bad=skip_bad, counts=counts)
        return
    if not path.is_dir():
        raise InputError("no such file or folder", path=path)

    declared = corpus_folder_file(path)
    if declared is not None:  # `anchor corpus`'s folder: its JSONL, not the corpus.json summary beside it
        yield from read_jsonl(declared, fields, skip_bad=skip_bad, counts=counts)
        return
    if _is_saved_dataset(path):
        yield from read_saved_dataset(path, fields, skip_bad=skip_bad, counts=counts)
        return
    files = _walk(path)
    structured = [p for p in files if _suffix_kind(p)]
    if structured:
        for p in structured:
            sub = _Fields(text_field, domain_field, _folder_domain(path, p, DEFAULT_DOMAIN))
            if _suffix_kind(p) == "jsonl":
                yield from read_jsonl(p, sub, skip_bad=skip_bad, counts=counts)
            else:
                yield from read_parquet(p, sub, skip_bad=skip_bad, counts=counts)
        return
    for p in files:
        yield from read_text_file(p, _folder_domain(path, p, "text"), skip_bad=skip_bad, counts=counts)


def _folder_domain(root: Path, file: Path, top: str) -> str:
    parts = file.relative_to(root).parts
    return parts[0] if len(parts) > 1 else top
