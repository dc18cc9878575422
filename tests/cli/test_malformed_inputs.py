"""Malformed models, configs, safetensors, YAML and pack stores.

Every case is one row of CASES: a name, what it breaks (a function of the case's fresh copy of the
fixtures), the command, and what must come out: "ok" (read the way transformers reads it), or the
pieces of the one-line error (exit 2, naming the file). A new case is one line.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from tests.cli.helpers import assert_usage_error, leftovers, run_cli

WORDS = [f"w{i}" for i in range(60)]


# ---------------------------------------------------------------------------------------------
# Fixtures: a Hugging Face folder (random llama weights + a word-level tokenizer), a corpus, a pack


def _tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def make_model(folder: Path, words: list[str] = WORDS) -> Path:
    from anchor_core.spec import random_preset
    from anchor_core.export import write_model
    from anchor_core.weights import random_state

    spec = random_preset("llama")
    write_model(spec, random_state(spec), folder)
    _tokenizer(words).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def make_corpus(path: Path, words: list[str] = WORDS) -> Path:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(30):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 40)), "domain": ["a", "b"][i % 2]}) + "\n")
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from anchor_core.data.pipeline import PackConfig, pack_corpus

    root = tmp_path_factory.mktemp("malformed")
    make_model(root / "model")
    make_corpus(root / "corpus.jsonl")
    pack_corpus("random:llama", root / "corpus.jsonl", root / "pack", PackConfig(seq_len=16))
    return root


@pytest.fixture
def fx(base, tmp_path) -> Path:
    """A fresh copy of the fixtures for one case."""
    for name in ("model", "pack"):
        shutil.copytree(base / name, tmp_path / name, symlinks=True)
    shutil.copy(base / "corpus.jsonl", tmp_path / "corpus.jsonl")
    return tmp_path


# ---------------------------------------------------------------------------------------------
# Breakers


def edit_config(**changes) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        p = fx / "model" / "config.json"
        cfg = json.loads(p.read_text())
        for k, v in changes.items():
            if v is DELETE:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        p.write_text(json.dumps(cfg))
    return edit


DELETE = object()


def edit_rope(**changes) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        p = fx / "model" / "config.json"
        cfg = json.loads(p.read_text())
        cfg["rope_parameters"].update(changes)
        p.write_text(json.dumps(cfg))
    return edit


def write(rel: str, data: bytes | str) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        p = fx / rel
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return edit


def _default_config(config_cls, preset: str) -> str:
    """config.json as transformers writes a default `config_cls` at the sizes of the `preset`."""
    from anchor_core.spec import random_preset

    s = random_preset(preset)
    return config_cls(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                      num_key_value_heads=s.num_kv_heads, tie_word_embeddings=True).to_json_string()


def qwen2_default_config(fx: Path) -> None:
    """What transformers writes for a default Qwen2Config (bos/eos null), at the preset's sizes."""
    from transformers import Qwen2Config

    (fx / "model" / "config.json").write_text(_default_config(Qwen2Config, "qwen2"))


def qwen3_config(**changes) -> Callable[[Path], None]:
    """What transformers writes for a Qwen3Config at the preset's sizes (head_dim its default, 128), with
    `changes` to the written file."""
    def edit(fx: Path) -> None:
        from transformers import Qwen3Config

        (fx / "model" / "config.json").write_text(_default_config(Qwen3Config, "qwen3"))
        edit_config(**changes)(fx)
    return edit


def no_eos_anywhere(fx: Path) -> None:
    edit_config(eos_token_id=None)(fx)
    (fx / "model" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))


def edit_header(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite model.safetensors' JSON header (the data block stays as it is)."""
    def edit(fx: Path) -> None:
        p = fx / "model" / "model.safetensors"
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        new = fn(header)
        text = new if isinstance(new, bytes) else json.dumps(new).encode()
        p.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return edit


def _first_tensor(h: dict) -> str:
    return sorted(k for k in h if k != "__metadata__")[0]


def tensor(**changes) -> Callable[[Path], None]:
    def fn(h: dict) -> dict:
        info = h[_first_tensor(h)]
        for k, v in changes.items():
            if v is DELETE:
                info.pop(k)
            else:
                info[k] = v(info) if callable(v) else v
        return h
    return edit_header(fn)


def pack_json(**changes) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        p = fx / "pack" / "pack.json"
        meta = json.loads(p.read_text())
        meta.update({k: (v(fx) if callable(v) else v) for k, v in changes.items()})
        p.write_text(json.dumps(meta))
    return edit


def store_index(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        p = fx / "pack" / "store" / "docs.npz"
        with np.load(p) as z:
            arrays = {k: z[k].copy() for k in z.files}
        fn(arrays)
        p.unlink()  # a hard link to the fixture's file: never write through it
        np.savez(p, **arrays)
    return edit


def store_meta(**changes) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        p = fx / "pack" / "store" / "store.json"
        meta = json.loads(p.read_text())
        meta.update(changes)
        p.unlink()
        p.write_text(json.dumps(meta))
    return edit


def tokens(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        p = fx / "pack" / "store" / "tokens.bin"
        t = fn(np.fromfile(p, dtype=np.uint32))
        p.unlink()
        t.astype(np.uint32).tofile(p)
    return edit


def symlink_out(fx: Path) -> None:
    outside = fx / "elsewhere.json"
    shutil.copy(fx / "pack" / "store" / "store.json", outside)
    (fx / "pack" / "store" / "store.json").unlink()
    (fx / "pack" / "store" / "store.json").symlink_to(outside)


def big_tokenizer(fx: Path) -> None:
    """A tokenizer of 400 words for a model of 331 embeddings; the corpus uses words past 331."""
    words = [f"w{i}" for i in range(400)]
    _tokenizer(words).save(str(fx / "model" / "tokenizer.json"))
    make_corpus(fx / "corpus.jsonl", words[340:])


def both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(fx: Path) -> None:
        for e in edits:
            e(fx)
    return edit


# ---------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Case:
    name: str
    breaks: Callable[[Path], None]
    argv: tuple[str, ...]
    expect: str | tuple[str, ...]  # "ok", or the pieces of the error line
    hf: bool | None = None  # config cases: does transformers' AutoConfig accept it (None: not compared)


PACK_MODEL = ("pack", "--model", "{fx}/model", "--data", "{fx}/corpus.jsonl", "--seq-len", "16")
TOP5 = ("demo", "--jobs", "top5", "--model", "{fx}/model")
PACK_DATA = ("pack", "--model", "random:llama", "--data", "{fx}/pack", "--seq-len", "16")
PACK_STORE = ("pack", "--model", "random:llama", "--data", "{fx}/pack/store", "--seq-len", "16")
CFG = "config.json"
ST = "model.safetensors"

CASES = [
    # config.json, read the way transformers reads it
    Case("cfg-ok", lambda fx: None, PACK_MODEL, "ok", hf=True),
    Case("cfg-eos-null", edit_config(eos_token_id=None), PACK_MODEL, "ok", hf=True),
    Case("cfg-eos-empty-list", edit_config(eos_token_id=[]), PACK_MODEL, "ok", hf=True),
    Case("cfg-eos-list", edit_config(eos_token_id=[2, 5]), PACK_MODEL, "ok", hf=True),
    Case("cfg-bos-null", edit_config(bos_token_id=None), PACK_MODEL, "ok", hf=True),
    Case("cfg-qwen2-default", qwen2_default_config, PACK_MODEL, "ok", hf=True),
    Case("cfg-qwen3-default", qwen3_config(), PACK_MODEL, "ok", hf=True),
    Case("cfg-qwen3-head-dim-null", qwen3_config(head_dim=None), PACK_MODEL, (CFG, "head_dim", "integer"), hf=False),
    Case("cfg-qwen3-attention-bias", qwen3_config(attention_bias=True), PACK_MODEL, (CFG, "attention_bias")),
    Case("cfg-qwen3-sliding-window", qwen3_config(use_sliding_window=True), PACK_MODEL, (CFG, "use_sliding_window")),
    Case("cfg-rope-theta-string", edit_rope(rope_theta="10000.0"), PACK_MODEL, "ok", hf=True),
    Case("cfg-json-list", write("model/config.json", "[1, 2]"), PACK_MODEL, (CFG, "JSON object"), hf=False),
    Case("cfg-not-utf8", write("model/config.json", b'{"model_type": "\xff"}'), PACK_MODEL, (CFG, "unreadable"),
         hf=False),
    Case("cfg-vocab-string", edit_config(vocab_size="331"), PACK_MODEL, (CFG, "vocab_size", "integer"), hf=False),
    Case("cfg-hidden-float", edit_config(hidden_size=84.0), PACK_MODEL, (CFG, "hidden_size"), hf=False),
    Case("cfg-eos-string", edit_config(eos_token_id="2"), PACK_MODEL, (CFG, "eos_token_id"), hf=False),
    Case("cfg-eos-list-strings", edit_config(eos_token_id=["2"]), PACK_MODEL, (CFG, "eos_token_id"), hf=False),
    Case("cfg-bos-list", edit_config(bos_token_id=[1]), PACK_MODEL, (CFG, "bos_token_id"), hf=False),
    Case("cfg-heads-zero", edit_config(num_attention_heads=0), PACK_MODEL, (CFG, "num_attention_heads"), hf=False),
    Case("cfg-eos-beyond-vocab", edit_config(eos_token_id=5000), PACK_MODEL, (CFG, "eos_token_id", "vocabulary")),
    Case("cfg-rope-type-unknown", edit_rope(rope_type="wat"), PACK_MODEL, (CFG, "rope_type", "'wat'")),
    Case("cfg-rope-factor-word", edit_rope(rope_type="linear", factor="two"), PACK_MODEL, (CFG, "factor")),
    Case("cfg-kv-heads", edit_config(num_key_value_heads=4), PACK_MODEL, (CFG, "num_kv_heads 4")),
    Case("cfg-eps-nan", edit_config(rms_norm_eps=math.nan), PACK_MODEL, (CFG, "rms_norm_eps")),
    Case("cfg-no-hidden-size", edit_config(hidden_size=DELETE), PACK_MODEL, (CFG, "hidden_size")),
    Case("cfg-no-eos-anywhere", no_eos_anywhere, PACK_MODEL, ("model", "cannot tell the EOS token")),
    Case("tok-beyond-model-vocab", big_tokenizer, PACK_MODEL, ("corpus.jsonl", "beyond the model's vocabulary")),
    # safetensors headers, validated before any tensor is read
    Case("st-header-list", edit_header(lambda h: []), TOP5, (ST, "JSON object")),
    Case("st-header-not-utf8", edit_header(lambda h: b'{"\xff": 1}'), TOP5, (ST, "unreadable")),
    Case("st-no-data-offsets", tensor(data_offsets=DELETE), TOP5, (ST, "data_offsets")),
    Case("st-offsets-reversed", tensor(data_offsets=lambda i: i["data_offsets"][::-1]), TOP5, (ST, "out of order")),
    Case("st-offsets-past-end", tensor(data_offsets=lambda i: [i["data_offsets"][0], 10**9]), TOP5,
         (ST, "runs past the end")),
    Case("st-shape-vs-bytes", tensor(shape=lambda i: [i["shape"][0] + 1, *i["shape"][1:]]), TOP5,
         (ST, "needs", "bytes")),
    Case("st-shape-strings", tensor(shape=lambda i: [str(s) for s in i["shape"]]), TOP5, (ST, "shape")),
    Case("st-dtype-unknown", tensor(dtype="I64"), TOP5, (ST, "unsupported safetensors dtype 'I64'")),
    Case("st-entry-not-object", edit_header(lambda h: {**h, _first_tensor(h): [1, 2]}), TOP5, (ST, "not an object")),
    # YAML: policies and --config
    Case("yaml-policy-not-utf8", write("p.yaml", b"base: hf_bf16\nname: \xff\xfe\n"),
         ("audit", "--model", "random:llama", "--quick", "--policies", "{fx}/p.yaml"), ("p.yaml", "UTF-8")),
    Case("yaml-config-not-utf8", write("d.yaml", b"seq_len: 16\n# \xff\n"), ("pack", "--config", "{fx}/d.yaml"),
         ("d.yaml", "UTF-8")),
    Case("yaml-config-list", write("d.yaml", "- 1\n- 2\n"), ("pack", "--config", "{fx}/d.yaml"),
         ("d.yaml", "mapping")),
    Case("yaml-config-budget-0", write("d.yaml", "budget: 0\n"), (*PACK_STORE, "--config", "{fx}/d.yaml"),
         ("d.yaml: budget must be at least 1",)),
    Case("yaml-config-seed-negative", write("d.yaml", "seed: -3\n"), (*PACK_STORE, "--config", "{fx}/d.yaml"),
         ("d.yaml: seed must be at least 0",)),
    Case("yaml-config-upsample-inf", write("d.yaml", "upsample_factor: .inf\n"),
         (*PACK_STORE, "--config", "{fx}/d.yaml"), ("d.yaml: upsample_factor",)),
    Case("yaml-config-seq-len-1", write("d.yaml", "seq_len: 1\n"),
         ("pack", "--model", "random:llama", "--data", "{fx}/pack", "--config", "{fx}/d.yaml"),
         ("d.yaml: seq_len must be at least 2",)),
    # pack outputs and token stores used as --data
    Case("pack-ok", lambda fx: None, PACK_DATA, "ok"),
    Case("store-ok", lambda fx: None, PACK_STORE, "ok"),
    Case("pack-store-outside-file", pack_json(store=lambda fx: str(fx / "corpus.jsonl")), PACK_DATA,
         ("pack.json", "not a folder inside")),
    Case("pack-store-dotdot", pack_json(store="../model"), PACK_DATA, ("pack.json", "not a folder inside")),
    Case("pack-store-itself", pack_json(store="."), PACK_DATA, ("pack.json", "not a folder inside")),
    Case("pack-store-not-a-store", pack_json(store="shard-00000.tokens.npy"), PACK_DATA,
         ("pack.json", "not a token store")),
    Case("pack-json-list", write("pack/pack.json", "[]"), PACK_DATA, ("pack", "JSON object")),
    Case("store-offsets-not-monotone", store_index(lambda a: a["offset"].__setitem__(1, 0)), PACK_DATA,
         ("docs.npz", "not increasing")),
    Case("store-offsets-past-end", store_index(lambda a: a["offset"].__setitem__(-1, 10**6)), PACK_DATA,
         ("docs.npz", "past the end")),
    Case("store-negative-length", store_index(lambda a: a["length"].__setitem__(0, -4)), PACK_DATA,
         ("docs.npz", "negative")),
    Case("store-domain-out-of-range", store_index(lambda a: a["domain"].__setitem__(0, 9)), PACK_DATA,
         ("docs.npz", "domain")),
    Case("store-index-missing-array", store_index(lambda a: a.pop("domain")), PACK_DATA,
         ("docs.npz", "unreadable document index")),
    Case("store-tokens-truncated", tokens(lambda t: t[:-5]), PACK_DATA, ("tokens.bin", "bytes")),
    Case("store-num-tokens-string", store_meta(num_tokens="12"), PACK_DATA, ("store.json: `num_tokens` must be a count",)),
    Case("store-json-symlink-out", symlink_out, PACK_DATA, ("store.json points outside",)),
    Case("store-token-beyond-vocab", tokens(lambda t: np.where(np.arange(t.size) == 3, 5000, t)), PACK_STORE,
         ("token id 5000", "beyond the model's vocabulary")),
    Case("corpus-empty", write("corpus.jsonl", ""), PACK_MODEL, ("corpus.jsonl", "no documents")),
]


def _argv(case: Case, fx: Path) -> list[str]:
    return [a.format(fx=fx) for a in case.argv] + ["--out", str(fx / "out")]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input(case, fx, capsys):
    case.breaks(fx)
    argv = _argv(case, fx)
    if argv[0] in ("pack", "audit", "demo"):
        argv.append("--no-progress")
    code, out, err = run_cli(argv, capsys)
    if case.expect == "ok":
        print("expect exit 0:", out)
        assert code == 0, err
        assert (fx / "out" / ".anchor-output.json").is_file()
    else:
        line = assert_usage_error(code, err, argv[0], *case.expect)
        print("error line:", line)
        assert not (fx / "out").exists() and leftovers(fx, "out") == []


@pytest.mark.parametrize("case", [c for c in CASES if c.hf is not None], ids=[c.name for c in CASES if c.hf is not None])
def test_config_read_as_transformers_reads_it(case, fx):
    """Where transformers' own AutoConfig accepts a config.json, anchor reads it; where it refuses, so do we."""
    import transformers

    from anchor_core.errors import InputError
    from anchor_core.weights import load_spec

    case.breaks(fx)
    try:
        transformers.AutoConfig.from_pretrained(str(fx / "model"))
        hf_ok = True
    except Exception as e:  # noqa: BLE001 - any refusal counts
        print("transformers:", type(e).__name__, str(e).splitlines()[0][:200])
        hf_ok = False
    try:
        spec = load_spec(str(fx / "model"))
        ours = True
        print("anchor:", spec.family, spec.eos_token_id, spec.bos_token_id, spec.rope.base)
    except InputError as e:
        print("anchor:", e)
        ours = False
    print(f"{case.name}: transformers {hf_ok}, anchor {ours}, table {case.hf}")
    assert hf_ok == case.hf and ours == case.hf


def test_packed_folder_validation(base, tmp_path):
    """`anchor train` reads a pack output with PackedData.open: shards must be files of it, shapes as pack.json."""
    from anchor_core.data.packed import PackedData
    from anchor_core.errors import InputError

    good = PackedData.open(base / "pack")
    assert good.num_windows > 0
    for change, needle in (({"shards": [{"name": "../pack/shard-00000", "windows": 1}]}, "no valid name"),
                           ({"seq_len": 17}, "pack.json implies"),
                           ({"num_windows": 10**6}, "num_windows"),
                           ({"shards": "shard-00000"}, "shards")):
        folder = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        shutil.copytree(base / "pack", folder)
        meta = json.loads((folder / "pack.json").read_text())
        meta.update(change)
        (folder / "pack.json").write_text(json.dumps(meta))
        with pytest.raises(InputError) as e:
            PackedData.open(folder)
        print(change, "->", e.value)
        assert needle in str(e.value)


@pytest.mark.parametrize("verb, hint", [("pack", "--skip-bad"), ("audit", None)])
def test_bad_record_hint_names_only_options_the_verb_has(verb, hint, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    args = {"pack": ["pack", "--model", "random:llama", "--seq-len", "16"],
            "audit": ["audit", "--model", "random:llama", "--quick"]}[verb]
    code, _, err = run_cli([*args, "--data", bad, "--no-progress", "--out", tmp_path / "out"], capsys)
    line = assert_usage_error(code, err, verb, "bad.jsonl:2", "invalid JSON")
    print("hint expected:", hint)
    assert (hint in line) if hint else ("--skip-bad" not in line)
