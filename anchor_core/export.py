"""Hugging Face folders of trained weights: config.json, model.safetensors and the tokenizer.

    export_hf(spec, state, "RUN/checkpoints/step-8/hf", tokenizer_of="default")

The folder loads in transformers (`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer`) and as
`--model` everywhere in this toolkit (anchor_core.weights, anchor_core.tokenizer).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from anchor_core.paths import resolve_model_name
from anchor_core.spec import ModelSpec
from anchor_core.tokenizer import BYTE_BOS, BYTE_EOS, BYTE_OFFSET, BYTE_UNK, bytes_to_unicode, gguf_tokenizer_cached
from anchor_core.weights import StateDict, write_hf_dir

_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def byte_tokenizer_json(spec: ModelSpec) -> str:
    """The `random:<preset>` byte tokenizer (0 unk, 1 bos, 2 eos, 3 + byte) as a `tokenizers` BPE
    without merges over the byte-level alphabet: every byte is one token, as anchor_core.tokenizer.ByteTok."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": BYTE_UNK, "<s>": BYTE_BOS, "</s>": BYTE_EOS}
    vocab.update({ch: BYTE_OFFSET + b for b, ch in bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok.to_str()


def _tokenizer_config(tokenizer_json: str, bos_id: int | None, eos_id: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None if bos_id is None else tok.id_to_token(bos_id),
        "eos_token": tok.id_to_token(eos_id),
        "pad_token": tok.id_to_token(eos_id),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def write_tokenizer(model: str, spec: ModelSpec, folder: Path) -> None:
    """The tokenizer of the model named `model` (docs/DESIGN.md §6) into a Hugging Face folder."""
    name = resolve_model_name(model)
    folder = Path(folder)
    if name.startswith("random:"):
        text, bos, eos = byte_tokenizer_json(spec), spec.bos_token_id, spec.eos_token_id
    elif name.endswith(".gguf"):
        text, meta = gguf_tokenizer_cached(Path(name))
        bos, eos = meta["bos_id"], meta["eos_id"]
    else:
        for f in _HF_TOKENIZER_FILES:
            if (Path(name) / f).is_file():
                shutil.copyfile(Path(name) / f, folder / f)
        return
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(text, bos, eos), indent=1),
                                                  encoding="utf-8")


def export_hf(spec: ModelSpec, state: StateDict, folder: str | Path, *, tokenizer_of: str) -> Path:
    """Write `state` (float32 numpy, Hugging Face names) with `spec`'s config and the tokenizer of
    the model `tokenizer_of` into `folder`. Returns the folder."""
    folder = write_hf_dir(spec, state, Path(folder))
    write_tokenizer(tokenizer_of, spec, folder)
    return folder
