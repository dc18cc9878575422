"""torchtrain.hf under the precision GPU users train in: bf16 (and fp16) autocast, as `Trainer(bf16=True)` and
TRL's default `SFTConfig` run it, and bf16 weights.

- Each attention function that trains on the CPU, called under autocast with what a Llama layer hands it there
  (q and k in float32: transformers' rotary tables follow the float32 residual stream; v in the autocast
  dtype), computes exactly what it computes on q, k, v rounded to that dtype by the caller: outputs and
  gradients equal (torchtrain.attention.engines.compute_dtype, the rule torch's SDPA follows under autocast).
- A bf16-weight model trains through each of them (forward and backward finite).
- Three steps of transformers' `Trainer` with `bf16=True`, and of TRL's `SFTTrainer` with its default
  `SFTConfig` (bf16 on, activation checkpointing on), on `PackingCollator` windows: at each step, on that
  step's own weights and batch, the loss and every parameter's gradient against the oracle's fp64 truth, by
  the bf16 rule (`parity_tests.core.RULE`: within 2 x the error of the oracle's bf16 emulation of the same
  step + the floor). The emulation (`autocast_emulation`) is the CPU kernel's bf16 preset with RoPE in
  float32, as autocast computes it; it also rounds the residual stream to bf16, which autocast keeps in
  float32, so its error bounds autocast's from above. The same steps judged against another variant's truth
  fail the rule: the comparison sees the mask.
- TRL's default `max_length` (1024) cuts every document before the collator sees it; `max_length=None` hands
  them over whole.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

import jaxref
import torchtrain.hf as hf
from anchor_core.spec import from_hf_config
from jaxref.policy import cpu_kernel_policy
from parity_tests.core import RULE
from parity_tests.grads import errors

FIRST, EOS, VOCAB = 1, 2, 331
T = 127  # odd: windows of 126 stream slots
STEPS = 3
CPU_TRAINING = ("anchor_sdpa", "anchor_eager", "anchor_varlen", "anchor_fa2_emulated")
LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=FIRST, eos_token_id=EOS)


def documents(count: int, seed: int = 0, longest: int = 150) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in rng.integers(5, longest, count)]


def features(count: int, seed: int = 0, longest: int = 150) -> list[dict]:
    return [{"input_ids": d} for d in documents(count, seed, longest)]


# ---------------------------------------------------------------------------------------------
# The functions


def _layer_inputs(dtype: torch.dtype, seed: int = 0):
    """q, k [B,N|K,T,D] in float32 and v in `dtype`: what a Llama layer hands the function under autocast."""
    g = torch.Generator().manual_seed(seed)
    B, N, K, D = 2, 4, 2, 16
    q, k = torch.randn(B, N, T, D, generator=g), torch.randn(B, K, T, D, generator=g)
    v = torch.randn(B, K, T, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("low", sorted(LOW))
@pytest.mark.parametrize("name", CPU_TRAINING)
def test_autocast_computes_the_rounded_inputs(name: str, low: str) -> None:
    dtype = LOW[low]
    batch = hf.PackingCollator("anchor", T, first_token_id=FIRST, eos_token_id=EOS)(features(5, seed=1, longest=60))
    doc_ids, variant = batch["doc_ids"][:2], batch["variant"][:2]
    fn = hf.FUNCTIONS[name]
    q, k, v = (x.requires_grad_() for x in _layer_inputs(dtype))
    with torch.autocast("cpu", dtype=dtype):
        out, _ = fn(None, q, k, v, None, doc_ids=doc_ids, variant=variant)
    assert out.dtype == dtype
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(g)
    rounded = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    want, _ = fn(None, *rounded, None, doc_ids=doc_ids, variant=variant)
    want.backward(g)
    assert torch.equal(out, want), float((out.float() - want.float()).abs().max())
    for got, ref in zip((q, k, v), rounded):
        assert torch.isfinite(got.grad).all()
        assert torch.equal(got.grad, ref.grad.to(got.dtype))


@pytest.mark.parametrize("name", CPU_TRAINING)
def test_bf16_weights_train(name: str) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=name, dtype=torch.bfloat16).train()
    batch = hf.PackingCollator("anchor", T, first_token_id=FIRST, eos_token_id=EOS)(features(6, seed=2))
    loss = model(**batch).loss
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Trainer and TRL against the oracle, step by step


class StepRecorder(TrainerCallback):
    """What each optimizer step of a Trainer computed: its float32 weights before the step, the batch the
    model got, the model's loss and every parameter's gradient as the backward left it (before the
    Trainer clips it)."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.steps = model, []
        model.register_forward_pre_hook(self._batch, with_kwargs=True)
        model.register_forward_hook(self._loss)
        self._names = {id(p): n for n, p in model.named_parameters()}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._grad)

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append({"params": {n: p.detach().float().cpu().numpy().copy()
                                      for n, p in self.model.named_parameters()},
                           "grads": {}})

    def _batch(self, module, args, kwargs):
        self.steps[-1]["batch"] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def _loss(self, module, args, output):
        self.steps[-1]["loss"] = float(output.loss.detach())

    def _grad(self, p):
        self.steps[-1]["grads"][self._names[id(p)]] = p.grad.detach().float().cpu().numpy().copy()


# The kernel each function's bf16 attention runs on CUDA, by the preset that emulates it: torch's varlen kernel
# (FlashAttention-2 inside), compiled FlexAttention, and SDPA's memory-efficient kernel (a mask rules out its flash
# kernel; the same online softmax over key blocks as FA-2)
CUDA_KERNELS = {"anchor_varlen": "fa2_bf16", "anchor_sdpa": "fa2_bf16", "anchor_flex": "flex_bf16"}


def autocast_emulation(name: str = "anchor_varlen", device: str = "cpu"):
    """The oracle's emulation of a bf16-autocast step with attention `name` on `device` (module docstring): on the
    CPU every function runs torch's fused CPU kernel."""
    kernel = cpu_kernel_policy() if device == "cpu" else jaxref.get_policy(CUDA_KERNELS[name])
    return kernel.with_stages(rope_table="float32", rope_apply="float32")


ROWS = 8  # the oracle's batches are padded to a multiple of this many windows


def oracle_step(spec, step: dict, policy, variant: str | None = None) -> tuple[float, dict[str, np.ndarray]]:
    """The oracle's loss and gradients on one recorded step's weights and batch (its variant, or `variant`).

    The collator packs a step's documents into as many windows as they fill (4, 5, 7, ...), and each number of
    windows is another program for the oracle to compile. So the batch is padded to a multiple of ROWS windows with
    copies of its last window whose slots count for nothing (loss mask 0): windows do not see one another, so the
    loss and every gradient are those of the batch as it was."""
    b = step["batch"]
    labels = b["labels"].numpy()
    loss_mask = np.zeros(labels.shape, dtype=np.int64)
    loss_mask[:, :-1] = labels[:, 1:] != -100  # the prediction at slot t is of labels[t + 1]
    rows = ((0, -len(labels) % ROWS), (0, 0))
    ids, positions, doc_ids = (np.pad(b[k].numpy(), rows, mode="edge")
                               for k in ("input_ids", "position_ids", "doc_ids"))
    params = jaxref.params_from_state(spec, step["params"], np.float64 if policy == "fp64" else np.float32)
    loss, grads = jaxref.value_and_grad(params, spec, ids, positions=positions, doc_ids=doc_ids,
                                        loss_mask=np.pad(loss_mask, rows),
                                        variant=variant or hf.variant_name(b["variant"]), policy=policy)
    return float(loss), grads


def rel_l2(x, truth) -> float:
    return errors(x, truth)["rel_l2"]


def judge(spec, steps: list[dict], truth_variant: str | None = None, emulation=None) -> list[str]:
    """Every (step, quantity) outside the bf16 rule: rel. error <= factor x the emulation's + floor, both
    against fp64 truth of the step's variant (or `truth_variant`)."""
    emulation, failures = emulation or autocast_emulation(), []
    for i, step in enumerate(steps, start=1):
        assert np.isfinite(step["loss"]) and all(np.isfinite(g).all() for g in step["grads"].values())
        truth_loss, truth = oracle_step(spec, step, "fp64", truth_variant)
        emu_loss, emu = oracle_step(spec, step, emulation, truth_variant)
        quantities = {"loss": (step["loss"], emu_loss, truth_loss),
                      **{f"grad {n}": (g, emu[n], truth[n]) for n, g in step["grads"].items()}}
        for what, (got, base, want) in quantities.items():
            err, tol = rel_l2(got, want), RULE.factor * rel_l2(base, want) + RULE.floor
            if not err <= tol:
                failures.append(f"step {i} {what}: {err:.3g} > {tol:.3g}")
    return failures


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(), attn_implementation=name)


def trainer_steps(name: str, variant: str, device: str = "cpu") -> tuple[list[dict], object]:
    model = _model(name)
    recorder = StepRecorder(model)
    data = Dataset.from_dict({"input_ids": documents(64)})
    args = TrainingArguments(output_dir="unused", max_steps=STEPS, per_device_train_batch_size=8, learning_rate=1e-3,
                             bf16=True, use_cpu=device == "cpu", save_strategy="no", report_to="none", logging_steps=1)
    collator = hf.PackingCollator(variant, T, first_token_id=FIRST, eos_token_id=EOS)
    Trainer(model=model, args=args, data_collator=collator, train_dataset=data, callbacks=[recorder]).train()
    return recorder.steps, model


ON_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device, name", [
    # anchor_flex has no backward on the CPU. make test runs sdpa; varlen, with the check that the rule fails
    # against the wrong variant's truth (whose fp64 and emulated programs double the oracle's compiling), in make test-all
    pytest.param("cpu", "anchor_varlen", marks=pytest.mark.slow), ("cpu", "anchor_sdpa"),
    *(pytest.param("cuda", n, marks=ON_CUDA) for n in ("anchor_varlen", "anchor_flex", "anchor_sdpa")),
])
def test_trainer_bf16_steps_hold_against_the_oracle(device: str, name: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    steps, model = trainer_steps(name, "anchor", device)
    assert len(steps) == STEPS and all(s["batch"]["input_ids"].shape[1] == T for s in steps)
    spec, emulation = from_hf_config(model.config.to_dict()), autocast_emulation(name, device)
    assert judge(spec, steps, emulation=emulation) == []
    if name == "anchor_varlen":  # the rule sees the mask: the same steps fail against intra_doc's truth
        wrong = judge(spec, steps[:1], truth_variant="intra_doc", emulation=emulation)
        assert any(f.startswith("step 1 grad") for f in wrong)


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": FIRST, "</s>": EOS, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                   pad_token="<pad>", bos_token="<s>", eos_token="</s>")


class SeenDocuments:
    """A collator that records the documents it is handed."""

    def __init__(self, collator):
        self.collator, self.lengths = collator, []

    def __call__(self, features):
        self.lengths += [len(f["input_ids"]) for f in features]
        return self.collator(features)


def sft_trainer(docs: list[list[int]], model, steps: int, device: str = "cpu", **config):
    from trl import SFTConfig, SFTTrainer

    tok = _tokenizer()
    collator = SeenDocuments(hf.PackingCollator("anchor", T, tokenizer=tok))
    # TRL's defaults but for the run's bounds and device (SFTConfig refuses its default bf16 without a GPU unless
    # told to use the CPU)
    args = SFTConfig(output_dir="unused", max_steps=steps, save_strategy="no", report_to="none",
                     use_cpu=device == "cpu", **config)
    trainer = SFTTrainer(model=model, args=args, data_collator=collator, processing_class=tok,
                         train_dataset=Dataset.from_dict({"input_ids": docs}))
    return trainer, collator


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_trl_default_config_steps_hold_against_the_oracle(device: str, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = _model("anchor_varlen")
    recorder = StepRecorder(model)
    trainer, _ = sft_trainer(documents(64), model, STEPS, device, max_length=None)
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing  # TRL's defaults: what its users run
    trainer.add_callback(recorder)
    trainer.train()
    assert len(recorder.steps) == STEPS
    spec = from_hf_config(model.config.to_dict())
    assert judge(spec, recorder.steps, emulation=autocast_emulation("anchor_varlen", device)) == []


def test_trl_default_max_length_cuts_documents(tmp_path, monkeypatch) -> None:
    """SFTConfig's max_length (1024) cuts each document before the collator sees it; None keeps them whole."""
    monkeypatch.chdir(tmp_path)
    docs = [list(range(3, 300)) * 5, list(range(3, 50))]  # 1485 and 47 tokens
    for config, want in (({}, [1024, 47]), ({"max_length": None}, [1485, 47])):
        trainer, seen = sft_trainer(docs, _model("anchor_varlen"), 1, per_device_train_batch_size=2, **config)
        trainer.train()
        assert sorted(seen.lengths, reverse=True) == want, config
