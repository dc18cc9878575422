"""`anchor_core.tokenizer`: GGUF tokenizers equal transformers' own, byte tokenizers, errors."""

from __future__ import annotations

import inspect
import json

import pytest

from anchor_core.errors import InputError
from anchor_core.tokenizer import ByteTok, load_tokenizer

# Code, prose, unicode, whitespace runs, special-token text, digits, contractions.
SAMPLES = [
    "def f(x):\n    return x**2  # square\n\n\n",
    "class A:\n\tpass\r\n",
    "Héllo wörld — ünïcödé 日本語 한국어 العربية 🤖🚀 emoji",
    "   many    spaces\t\ttabs\r\n\n\n   \n",
    "<|im_start|>user\nhi<|im_end|><|endoftext|>x",
    "",
    " ",
    "123456789 3.14159 1e-10 0x1F",
    "I'm sure they'll say we'd've CAN'T",
    "\u00a0non-breaking\u2028line-sep\u200bzero-width",
    "Zürich’s “quoted” text… and ‹more›",
]


def _varied_texts() -> list[str]:
    import pydoc_data.topics

    texts = list(SAMPLES)
    texts += list(pydoc_data.topics.topics.values())[:40]
    texts.append(inspect.getsource(json))
    return texts


@pytest.mark.model
def test_gguf_tokenizer_equals_transformers(gguf_path, tmp_path):
    """Ours from the GGUF metadata == transformers' `gguf_file=` tokenizer; its saved folder loads as
    an HF directory with the same identity. (One test: building transformers' tokenizer is slow.)"""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = load_tokenizer(str(gguf_path))
    texts = _varied_texts()
    ours = tok.encode_batch(texts)
    mismatches = 0
    for text, ids in zip(texts, ours):
        want = ref.encode(text, add_special_tokens=False)
        if ids != want:
            mismatches += 1
            print("MISMATCH", repr(text[:60]), ids[:16], want[:16])
        assert tok.decode(ids) == ref.decode(want, skip_special_tokens=False)
    print(f"compared {len(texts)} texts, {sum(map(len, ours))} tokens, {mismatches} mismatches")
    assert mismatches == 0
    assert tok.bos_id == ref.bos_token_id == 1
    assert tok.eos_id == ref.eos_token_id == 2
    assert tok.first_token_id == 1
    assert tok.vocab_size == len(ref) == 49152

    assert load_tokenizer("default").identity == load_tokenizer("smollm2").identity == tok.identity
    ref.save_pretrained(tmp_path)
    hf = load_tokenizer(str(tmp_path))
    assert hf.encode_batch(texts) == ours
    assert (hf.bos_id, hf.eos_id) == (tok.bos_id, tok.eos_id)
    assert hf.identity == tok.identity
    assert load_tokenizer("random:llama").identity != tok.identity


@pytest.mark.parametrize("preset", ["llama", "llama3", "mistral", "qwen2", "qwen3", "smollm2"])
def test_random_byte_tokenizer(preset):
    from anchor_core.spec import random_preset

    tok = load_tokenizer(f"random:{preset}")
    spec = random_preset(preset)
    assert isinstance(tok, ByteTok)
    assert tok.bos_id == spec.bos_token_id and tok.eos_id == spec.eos_token_id
    assert tok.first_token_id == spec.first_token_id
    assert tok.vocab_size <= spec.vocab_size
    ids = tok.encode_batch(SAMPLES)
    for text, row in zip(SAMPLES, ids):
        assert row == [3 + b for b in text.encode("utf-8")]
        assert tok.decode(row) == text
        assert all(3 <= i < tok.vocab_size for i in row)
    # a random model may generate any id of its vocabulary, beyond the 259 the tokenizer encodes to
    beyond = list(range(tok.vocab_size, spec.vocab_size, max(1, (spec.vocab_size - tok.vocab_size) // 7)))
    assert tok.decode([3 + ord("a"), *beyond, 0, 3 + ord("b")]) == "a" + "<unk>" * len(beyond) + "<unk>b"


def test_identity_depends_on_special_tokens():
    assert load_tokenizer("random:llama").identity == load_tokenizer("random:mistral").identity
    assert load_tokenizer("random:llama").identity != load_tokenizer("random:qwen2").identity


def test_hf_dir_without_bos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1, "a": 2}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.bos_id is None and tok.eos_id == 1 and tok.first_token_id == 1
    assert tok.encode_batch(["a a b"]) == [[2, 2, 0]]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: str(p / "nope"), "no such model"),
        (lambda p: (p / "w.bin").write_bytes(b"x") and str(p / "w.bin"), "unsupported model format"),
        (lambda p: (p / "x.gguf").write_bytes(b"not gguf") and str(p / "x.gguf"), "GGUF"),
        (lambda p: (p / "d").mkdir() or str(p / "d"), "no tokenizer.json"),
        (lambda p: "random:gpt5", "unknown random preset"),
    ],
)
def test_bad_model_names(tmp_path, make, message):
    with pytest.raises(InputError, match=message) as e:
        load_tokenizer(make(tmp_path))
    assert "\n" not in str(e.value)


@pytest.mark.model
@pytest.mark.slow  # transformers' tokenizer built from the GGUF twice: make test-all
@pytest.mark.parametrize("pre, arch", [("qwen2", "qwen2")])  # llama-bpe goes the same way
def test_gguf_pre_tokenizer_splits_match_transformers(gguf_path, tmp_path, pre, arch):
    """A GGUF whose `tokenizer.ggml.pre` selects a split regex (and with a user-defined token) builds
    the same tokenizer as transformers' GGUF converter; Qwen files get no BOS."""
    gguf = pytest.importorskip("gguf")
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    reader = gguf.GGUFReader(str(gguf_path))
    tokens, merges, types = (reader.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "merges", "token_type"))
    types = list(types)
    types[-1] = 4  # user-defined: kept whole
    path = tmp_path / f"{pre}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref, _ = mapping.convert_gguf_tokenizer(*mapping.get_gguf_tokenizer(str(path))[:2])
    tok = load_tokenizer(str(path))
    texts = SAMPLES + [f"x{tokens[-1]} y", "1234567 89"]
    assert tok.encode_batch(texts) == [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
    assert tok.bos_id == (None if arch == "qwen2" else 1)
