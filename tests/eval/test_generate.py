"""Greedy generation with a KV cache and perplexity on held-out windows.

The key check: batched, cached greedy decoding equals an argmax over a full forward without a cache
at every step (float32, random tiny presets, prompts of odd different lengths, every engine that runs
the prefill here), and a batch of different-length prompts gives each prompt's tokens alone.
Perplexity equals exp(torchtrain.next_token_loss) computed by hand on the same windows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time

import numpy as np
import pytest
import torch

import torchtrain
from anchor_core.errors import InputError
from anchor.eval import generate as gen
from anchor.eval import perplexity as ppl
from anchor.eval.generate import eval_model_source, greedy_generate, load_eval_model
from anchor.eval.perplexity import heldout_files, heldout_windows, perplexity
from anchor_core.tokenizer import load_tokenizer
from anchor_core.export import write_model
from anchor_core.weights import load_weights
from tests.torchtrain.conftest import needs_smollm2
from torchtrain.training.checkpoint import write_manifest
from torchtrain.attention.engines import attn_implementation, engine_of
from torchtrain.attention.variants import VARIANTS

torch.set_num_threads(1)  # shared cores: one intra-op thread (see tests/torchtrain/conftest.py)

LENGTHS = (5, 17, 97)
BUDGETS = (20, 13, 20)


@functools.cache
def _model(name: str, engine: str, dtype: str = "float32"):
    return load_eval_model(name, engine=engine, dtype=dtype)


def _prompts(lengths=LENGTHS, vocab: int = 331, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _recompute(model, prompt: list[int], budget: int, stop=()) -> list[int]:
    """The reference: argmax of a full forward (no cache, the model's own engine) at every step."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(budget):
            t = int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            if t in stop:
                break
            out.append(t)
            ids.append(t)
    return out


@pytest.mark.parametrize("engine", ["eager", "sdpa", "flash_varlen_emulated"])
@pytest.mark.parametrize("name", ["random:llama3", "random:qwen2"])
def test_cached_greedy_equals_uncached_recompute(name, engine, monkeypatch):
    model = _model(name, engine)
    tok = load_tokenizer(name)
    prompts = _prompts()
    calls = []
    real_attend = gen.attend
    monkeypatch.setattr(gen, "attend", lambda e, *a: calls.append(e) or real_attend(e, *a))
    got = greedy_generate(model, tok, prompts, list(BUDGETS), batch_size=3, stop_ids=(), progress=False)
    assert model.config._attn_implementation == attn_implementation(engine)  # restored after the call
    want = [_recompute(model, p, b) for p, b in zip(prompts, BUDGETS)]
    for n, g, w in zip(LENGTHS, got, want):
        print(f"{name} {engine} prompt {n}: cached {g}\n{' ' * len(name)} {' ' * len(engine)} recompute {w}")
    print(f"prefill attention calls through engine {engine!r}: {len(calls)} (layers: {model.config.num_hidden_layers})")
    assert got == want
    assert calls == [engine] * model.config.num_hidden_layers  # one prefill, every layer through the engine


def test_batch_gives_each_prompt_its_tokens_alone():
    model, tok = _model("random:smollm2", "sdpa"), load_tokenizer("random:smollm2")
    prompts = _prompts((17, 5, 97, 33, 5), seed=1)
    budgets = [9, 16, 4, 16, 0]
    batched = greedy_generate(model, tok, prompts, budgets, batch_size=4, stop_ids=(), progress=False)
    alone = [greedy_generate(model, tok, [p], b, batch_size=1, stop_ids=(), progress=False)[0]
             for p, b in zip(prompts, budgets)]
    print("batched", batched, "\nalone  ", alone)
    assert batched == alone
    assert [len(o) for o in batched] == budgets


def test_stops_at_eos():
    name = "random:mistral"
    model, tok = _model(name, "sdpa"), load_tokenizer(name)
    prompts = _prompts((11, 40), seed=2)
    free = greedy_generate(model, tok, prompts, 12, batch_size=2, stop_ids=(), progress=False)
    eos = free[0][5]  # make a token row 0 generates its EOS
    cut = free[0].index(eos)
    tok_eos = dataclasses.replace(tok, eos_id=eos)
    got = greedy_generate(model, tok_eos, prompts, 12, batch_size=2, progress=False)
    want = [f[:f.index(eos)] if eos in f else f for f in free]
    print(f"EOS {eos}: free {free}\nstopped {got}")
    assert got == want and len(got[0]) == cut < 12
    assert got == [_recompute(model, p, 12, stop=(eos,)) for p in prompts]
    assert greedy_generate(model, tok, prompts, 12, batch_size=2, stop_ids=(eos,), progress=False) == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic(dtype):
    model, tok = _model("random:llama", "sdpa", dtype), load_tokenizer("random:llama")
    prompts = _prompts((97, 5, 17), seed=3)
    a = greedy_generate(model, tok, prompts, 16, batch_size=2, stop_ids=(), progress=False)
    b = greedy_generate(model, tok, prompts, 16, batch_size=2, stop_ids=(), progress=False)
    print(dtype, a)
    assert a == b


def test_bad_generation_inputs():
    model, tok = _model("random:llama", "sdpa"), load_tokenizer("random:llama")
    with pytest.raises(InputError, match="prompt 1 is empty"):
        greedy_generate(model, tok, [[5], []], 3, progress=False)
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        greedy_generate(model, tok, [[5, 331]], 3, progress=False)
    with pytest.raises(InputError, match="2 entries for 1 prompts"):
        greedy_generate(model, tok, [[5]], [3, 4], progress=False)
    assert greedy_generate(model, tok, [[5, 6]], 0, progress=False) == [[]]


def test_checkpoint_folders(tmp_path):
    step = tmp_path / "checkpoints" / "step-3"
    spec, state = load_weights("random:llama")
    write_model(spec, state, step / "hf")
    write_manifest(step, 3)  # a checkpoint is read only through its manifest
    assert eval_model_source(step) == str(step / "hf")
    model, tok = load_eval_model(step, dtype="float32"), load_tokenizer("random:llama")
    prompts = _prompts((5, 17))
    ref = _model("random:llama", "sdpa")
    assert greedy_generate(model, tok, prompts, 6, stop_ids=(), progress=False) == \
        greedy_generate(ref, tok, prompts, 6, stop_ids=(), progress=False)
    (step / "hf" / "model.safetensors").unlink()
    for folder in (step, step / "hf", tmp_path / "empty"):
        folder.mkdir(exist_ok=True)
        with pytest.raises(InputError) as e:
            load_eval_model(folder)
        print(e.value)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Perplexity


@pytest.fixture(scope="module")
def heldout_corpus(tmp_path_factory):
    """A small held-out corpus of documents of uneven lengths (document boundaries in every window)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("heldout") / "heldout.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "anchor", "attention", "rope", "window"]
    with open(path, "w") as f:
        for _ in range(80):
            text = " ".join(rng.choice(words, size=int(rng.integers(1, 8))))
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.mark.parametrize("variant", VARIANTS)
def test_perplexity_equals_next_token_loss(variant, heldout_corpus, monkeypatch):
    name = "random:qwen2"
    model, tok = _model(name, "sdpa"), load_tokenizer(name)
    windows = heldout_windows(tok, 61, 5, data=heldout_corpus)
    monkeypatch.setattr(ppl, "LOGIT_CHUNK_ELEMENTS", 3 * 331 * 17)  # several lm-head chunks per window
    got = perplexity(model, windows, variant, batch_size=3)
    b = windows.batch(np.arange(5), variant)
    tokens = torch.as_tensor(b.tokens).long()
    with torch.no_grad():
        logits = model(input_ids=tokens, position_ids=torch.as_tensor(b.positions).long(),
                       doc_ids=torch.as_tensor(b.doc_ids), variant=variant).logits
    loss, count = torchtrain.next_token_loss(logits, tokens, torch.as_tensor(b.loss_mask))
    print(f"{variant}: {got}; by hand: nll {float(loss):.8f} over {int(count)} targets, ppl {math.exp(float(loss)):.6g}; "
          f"documents per window {windows.seg[0].max(axis=1).tolist()}")
    assert got.tokens == int(count) and got.windows == 5 and got.seq_len == 61
    assert got.nll == pytest.approx(float(loss), rel=1e-6)
    assert got.ppl == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert windows.seg[0].max(axis=1).min() >= 2  # boundaries: the variants' masks and losses differ


def test_heldout_windows_from_the_stdlib_test_suites(tmp_path):
    if not heldout_files():
        pytest.skip("this Python has no test suite (the default corpus' held-out part)")
    tok = load_tokenizer("random:llama")
    t0 = time.perf_counter()
    short, long = heldout_windows(tok, 50, 3), heldout_windows(tok, 129, 2)
    print(f"held-out windows in {time.perf_counter() - t0:.2f} s from {len(heldout_files())} test-suite modules")
    for w, T in ((short, 50), (long, 129)):
        tokens, seg, tag = w.windows(np.arange(w.num_windows))
        assert tokens.shape == (w.num_windows, T) and (seg >= 0).all() and not tag.any()
        assert (tokens[:, 0] == tok.first_token_id).all()
    stream = lambda w: w.windows(np.arange(w.num_windows))[0][:, 1:].ravel()  # noqa: E731
    assert np.array_equal(stream(short), stream(long)[:stream(short).size])  # one stream for every length
    (tmp_path / "small.txt").write_text("too little held-out text")
    with pytest.raises(InputError, match="held-out text holds 25 tokens; 3 windows of 1000 need 2997"):
        heldout_windows(tok, 1000, 3, data=tmp_path / "small.txt")


@pytest.mark.model
@needs_smollm2
def test_smollm2_bf16_answers_and_stops():
    t0 = time.perf_counter()
    model, tok = load_eval_model("default"), load_tokenizer("default")
    prompt = tok.encode_batch(["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"])[0]
    t1 = time.perf_counter()
    out = greedy_generate(model, tok, [prompt], 8, progress=False)
    text = tok.decode(out[0])
    print(f"SmolLM2 bf16: load {t1 - t0:.1f} s, {len(out[0])} tokens in {time.perf_counter() - t1:.2f} s: {text!r}")
    assert engine_of(model) == "sdpa" and next(model.parameters()).dtype == torch.bfloat16
    assert "Paris" in text and len(out[0]) < 8  # stopped at EOS (<|im_end|>) within the budget
