"""torchtrain.hf: the packing collator and the attention functions in transformers' Trainer.

- The collator's windows are those of docs/DESIGN.md §1-§2, held against a plain reading of the design
  written here (stream, windows, documents renumbered per window, positions, loss mask), and the windows of
  an `anchor pack` folder come out as `anchor train`'s loader makes them.
- The attention functions give the same logits as torchtrain's engines (the same arithmetic: equal).
- Three steps of transformers' Trainer with both equal three steps of `anchor train` on the same windows:
  with torchtrain's fused loss, bit for bit; with transformers' own loss, within its rounding (the bounds
  are at the test).
- The functions satisfy `anchor parity --stack hf --attention` (parity_tests.hf_stack) in fp32 and bf16.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import torchtrain.hf as hf
from anchor_core.errors import InputError
from anchor_core.variants import VARIANTS
from torchtrain.parallel.distributed import environ_for_child

FIRST, EOS = 1, 2


def reference_windows(docs: list[list[int]], T: int, variant: str, mask_cross_doc_loss: bool = False) -> dict[str, np.ndarray]:
    """docs/DESIGN.md §1-§2 read slot by slot: each document + EOS back to back, window w holds FIRST at
    slot 0 and stream slots [w(T-1), (w+1)(T-1)), the last window padded with token 0."""
    stream = [(t, k) for k, d in enumerate(docs) for t in [*d, EOS]]
    C = T - 1
    out: dict[str, list] = {"input_ids": [], "doc_ids": [], "position_ids": [], "labels": []}
    for w in range(-(-len(stream) // C)):
        part = stream[w * C:(w + 1) * C]
        tokens = [FIRST] + [t for t, _ in part] + [0] * (C - len(part))
        number: dict[int, int] = {}
        doc = [0 if variant == "anchor" else 1]
        for _, k in part:
            doc.append(number.setdefault(k, len(number) + 1))
        doc += [-1] * (C - len(part))
        first_slot = {d: doc.index(d) for d in set(doc)}
        pos = [s - first_slot[d] if variant == "intra_doc_reset" and d >= 0 else s for s, d in enumerate(doc)]
        labels = [-100] * T
        for t in range(T - 1):
            real = doc[t] >= 0 and doc[t + 1] >= 0
            same = doc[t] == doc[t + 1] or (variant == "full" and not mask_cross_doc_loss)
            if real and same:
                labels[t + 1] = tokens[t + 1]
        for key, value in (("input_ids", tokens), ("doc_ids", doc), ("position_ids", pos), ("labels", labels)):
            out[key].append(value)
    return {k: np.array(v, dtype=np.int64) for k, v in out.items()}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [2, 13, 31])
def test_collator_is_the_design(variant: str, T: int) -> None:
    rng = np.random.default_rng(T)
    lengths = [0, 1, 29, 3, 12, 0, 7, 41, 1, 5]  # empty and one-token documents, ones longer than a window
    docs = [rng.integers(3, 300, n).tolist() for n in lengths]
    for cross in (False, True):
        got = hf.PackingCollator(variant, T, first_token_id=FIRST, eos_token_id=EOS, mask_cross_doc_loss=cross)(
            [{"input_ids": d, "text": "ignored"} for d in docs])
        want = reference_windows(docs, T, variant, cross)
        assert got["variant"].tolist() == [VARIANTS.index(variant)] * len(want["input_ids"])
        assert hf.variant_name(got["variant"]) == variant
        assert set(got) == {*want, "variant"}
        for key, value in want.items():
            assert got[key].dtype == torch.int64
            np.testing.assert_array_equal(got[key].numpy(), value, err_msg=f"{key}, cross={cross}")


def test_collator_takes_tensors_numpy_and_a_tokenizer() -> None:
    class Tok:
        bos_token_id, eos_token_id = None, 7  # no BOS (Qwen): slot 0 holds EOS

    docs = [[5, 6, 8], [9] * 11]
    as_lists = hf.PackingCollator("anchor", 9, tokenizer=Tok())([{"input_ids": d} for d in docs])
    assert int(as_lists["input_ids"][0, 0]) == 7 and int(as_lists["input_ids"][0, 4]) == 7
    for convert in (torch.tensor, np.array):
        other = hf.PackingCollator("anchor", 9, first_token_id=7, eos_token_id=7)([{"input_ids": convert(d)} for d in docs])
        for key in ("input_ids", "doc_ids", "position_ids", "labels"):
            assert torch.equal(other[key], as_lists[key]), key


@pytest.mark.parametrize("make, names", [
    (lambda: hf.PackingCollator("causal", 8, first_token_id=1, eos_token_id=2), "variant"),
    (lambda: hf.PackingCollator("anchor", 1, first_token_id=1, eos_token_id=2), "seq_len"),
    (lambda: hf.PackingCollator("anchor", 8.0, first_token_id=1, eos_token_id=2), "seq_len"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=1), "eos_token_id"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=-1, eos_token_id=2), "first_token_id"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=1, eos_token_id=2, tokenizer=object()), "tokenizer"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=1, eos_token_id=2)([]), "features"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=1, eos_token_id=2)([{"ids": [1]}]), "features[0]"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=1, eos_token_id=2)([{"input_ids": [1, -3]}]),
     "features[0]['input_ids']"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=1, eos_token_id=2)([{"input_ids": [[1, 2]]}]),
     "features[0]['input_ids']"),
    (lambda: hf.PackingCollator("anchor", 8, first_token_id=1, eos_token_id=2)([{"input_ids": ["a"]}]),
     "features[0]['input_ids']"),
    (lambda: hf.PackingCollator("anchor", 4, first_token_id=1, eos_token_id=2, windows=True)(
        [{"input_ids": [1, 5, 6], "seg": [0, 1, 1], "tag": [0, 0, 0]}]), "seq_len"),
    (lambda: hf.PackingCollator("anchor", 3, first_token_id=1, eos_token_id=2, windows=True)([{"input_ids": [1, 5, 6]}]),
     "features[0] has no seg"),
    (lambda: hf.PackingCollator("anchor", 3, first_token_id=1, eos_token_id=2)(
        [{"input_ids": [1, 5, 6], "seg": [0, 1, 1], "tag": [0, 0, 0]}]), "windows=True"),
    (lambda: hf.PackingCollator("anchor", 3, first_token_id=1, eos_token_id=2, windows=1), "windows"),
])
def test_collator_errors_name_the_argument(make, names: str) -> None:
    with pytest.raises(InputError, match=names.replace("[", r"\[").replace("]", r"\]")):
        make()


# ---------------------------------------------------------------------------------------------
# The attention functions


@pytest.fixture(scope="module")
def llama():
    from torchtrain import build_model

    return build_model("random:llama", engine="sdpa", dtype="float32", seed=0)


def _stock(reference: torch.nn.Module, name: str) -> torch.nn.Module:
    """A stock transformers model of the reference's config and weights, with attention `name`."""
    import copy

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(copy.deepcopy(reference.config), attn_implementation=name)
    model.load_state_dict(reference.state_dict())
    return model


@pytest.mark.parametrize("name", ["anchor_sdpa", "anchor_eager", "anchor_varlen", "anchor_fa2_emulated"])
def test_attention_functions_are_the_engines(llama, name: str) -> None:
    """A stock model with the function gives the logits of torchtrain's engine: the same arithmetic, equal."""
    from torchtrain.model import set_engine

    engine = hf.ATTENTION_NAMES[name]
    docs = [list(range(3, 3 + n)) for n in (4, 17, 1, 30, 9)]
    model = _stock(llama, name)
    set_engine(llama, engine)
    try:
        for variant in VARIANTS:
            batch = hf.PackingCollator(variant, 23, first_token_id=FIRST, eos_token_id=EOS)([{"input_ids": d} for d in docs])
            inputs = {k: batch[k] for k in ("input_ids", "position_ids", "doc_ids")}
            with torch.no_grad():
                want = llama(**inputs, variant=variant).logits
                got = model(**inputs, variant=batch["variant"]).logits
            assert torch.equal(got, want), (name, variant, float((got - want).abs().max()))
    finally:
        set_engine(llama, "sdpa")


def test_attention_computes_the_variant(llama) -> None:
    """The variant reaches the mask: anchor and intra_doc differ on the same windows (no silent fallback)."""
    model = _stock(llama, "anchor_sdpa")
    batch = hf.PackingCollator("anchor", 23, first_token_id=FIRST, eos_token_id=EOS)(
        [{"input_ids": list(range(3, 3 + n))} for n in (6, 20)])
    with torch.no_grad():
        anchor = model(**{**batch, "labels": None}).logits
        other = batch["doc_ids"].clone()
        other[:, 0] = 1
        intra = model(**{**batch, "labels": None, "doc_ids": other, "variant": "intra_doc"}).logits
    assert float((anchor - intra)[:, 8:].abs().max()) > 1e-2  # document 2 sees the anchor, or not


def test_attention_errors(llama) -> None:
    model = _stock(llama, "anchor_sdpa")
    ids = torch.arange(3, 14)[None]
    with pytest.raises(InputError, match="doc_ids"):
        model(input_ids=ids)
    with pytest.raises(InputError, match="variant"):
        model(input_ids=ids, doc_ids=torch.ones_like(ids), variant="causal")
    with pytest.raises(InputError, match="doc_ids"):
        model(input_ids=ids, doc_ids=torch.ones(1, 5, dtype=torch.long), variant="full")
    with pytest.raises(InputError, match="anchor"):
        model(input_ids=ids, doc_ids=torch.ones_like(ids), variant="anchor")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_other_families_are_refused_in_one_line(dropout: float) -> None:
    """GPT-2 calls the attention interface too, but its positions are learned embeddings the variants do not set."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, attn_pdrop=dropout, resid_pdrop=dropout,
                        embd_pdrop=dropout)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="anchor_sdpa")
    ids = torch.arange(3, 20)[None]
    with pytest.raises(InputError, match=r"^attention 'anchor_sdpa' supports the model types llama, mistral, qwen2, "
                                         r"qwen3 \(.*\), not 'gpt2'$"):
        model(input_ids=ids, doc_ids=torch.ones_like(ids), variant="intra_doc")


def test_register_is_idempotent() -> None:
    from transformers import AttentionInterface

    names = hf.register()
    assert hf.register() == names and set(names) == set(hf.ATTENTION_NAMES)
    for name in names:
        assert AttentionInterface._global_mapping[name] is hf.FUNCTIONS[name]


# ---------------------------------------------------------------------------------------------
# transformers' Trainer against `anchor train`

T = 97  # odd: windows of 96 stream slots
STEPS = 3
TRAIN_OVERRIDES = [f"schedule.steps={STEPS}", "schedule.warmup_steps=0", "schedule.kind=constant", "optim.grad_clip=0",
                   "model.engine=sdpa", f"data.seq_len={T}", f"checkpoint.save_every={STEPS}", "data.pack.budget=20000"]


@pytest.fixture(scope="module")
def anchor_run(tmp_path_factory):
    """Three steps of `anchor train` (configs/train/tiny.yaml: random:llama, anchor variant, AdamW lr 1e-3,
    betas 0.9/0.95, wd 0.1 off the norms, fp32; here constant lr, no warmup, no clipping, the sdpa engine)."""
    from torchtrain.config import load_train_config
    from torchtrain.training.trainer import train

    cfg = load_train_config("configs/train/tiny.yaml", TRAIN_OVERRIDES)
    run = tmp_path_factory.mktemp("anchor_train") / "run"
    assert train(cfg, run, progress=False) == STEPS
    return cfg, run


def _loader_windows(cfg, run) -> list[int]:
    """The window indices `anchor train`'s loader gave, step after step."""
    from anchor_core.data.packed import Loader, PackedData

    loader = Loader(PackedData.open(run / "data"), batch_size=cfg.data.global_batch, variant=cfg.model.variant, seed=cfg.data.seed)
    order: list[int] = []
    for _ in range(STEPS):
        order += [int(i) for i in loader.indices()]
        next(loader)
    return order


def test_pack_windows_are_the_loaders_batches(anchor_run) -> None:
    from anchor_core.data.packed import PackedData

    cfg, run = anchor_run
    windows = hf.PackedWindows(run / "data")
    data = PackedData.open(run / "data")
    order = _loader_windows(cfg, run)[:5]
    for variant in VARIANTS:
        got = hf.PackingCollator(variant, T, windows=True).batch(
            [windows[i] for i in order])
        want = data.batch(np.array(order), variant)
        for key, value in want.as_dict().items():
            np.testing.assert_array_equal(getattr(got, key), value, err_msg=f"{variant} {key}")


def _trainer_run(cfg, run, trainer_class=None):
    """Three steps of transformers' Trainer on the windows `anchor train` took, in its order, from the same
    initial weights (torchtrain's random:llama, seed 0) with the same optimizer. Returns (model, per step
    losses: the sum over its micro-batches of what the loss step returned, float64)."""
    from transformers import Trainer, TrainingArguments

    from torchtrain import build_model

    windows = hf.PackedWindows(run / "data")
    order = _loader_windows(cfg, run)

    class InOrder(torch.utils.data.IterableDataset):  # Trainer shuffles map-style datasets
        def __iter__(self):
            return (windows[i] for i in order)

    model = _stock(build_model(cfg.model.name, engine="sdpa", dtype="float32", seed=cfg.data.seed), "anchor_sdpa")
    micro_losses: list[float] = []
    if trainer_class is None:
        trainer_class = Trainer
        model.register_forward_hook(lambda _m, _a, out: micro_losses.append(out.loss.item()))
    args = TrainingArguments(
        output_dir=str(run.parent / "hf_trainer"), per_device_train_batch_size=cfg.data.micro_batch,
        gradient_accumulation_steps=cfg.data.global_batch // cfg.data.micro_batch, max_steps=STEPS, learning_rate=cfg.optim.lr,
        adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1], adam_epsilon=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, optim="adamw_torch", report_to="none",
        save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
        remove_unused_columns=False, seed=cfg.data.seed, disable_tqdm=True)
    trainer = trainer_class(model=model, args=args, train_dataset=InOrder(),
                            data_collator=hf.PackingCollator(cfg.model.variant, T, windows=True))
    trainer.micro_losses, trainer.counts = micro_losses, []
    trainer.train()
    per_step = len(micro_losses) // STEPS
    return trainer, [sum(micro_losses[s * per_step:(s + 1) * per_step]) for s in range(STEPS)]


def _anchor_results(run):
    from safetensors.torch import load_file

    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    return losses, load_file(run / "checkpoints" / f"step-{STEPS}" / "hf" / "model.safetensors")


def test_trainer_matches_anchor_train(anchor_run) -> None:
    """Trainer + PackingCollator + anchor_sdpa with transformers' own causal-LM loss.

    The attention, the optimizer and the order of the updates are `anchor train`'s; the loss is not the same
    arithmetic: transformers projects all logits and divides the cross-entropy sum by the count, `anchor
    train` fuses the lm-head with a chunked cross-entropy and multiplies by 1/count (the test below
    swaps in that loss and gets bit-for-bit equality, so this is the only cause). Measured (random:llama,
    T = 97, 3 steps): losses within 4.5e-8 relative; final weights within 1.3e-5 absolute, and per tensor
    ||w_trainer - w_anchor|| <= 6.7e-5 ||w_anchor - w_init||. Bounds: 1e-6 and 1e-3, about 20x and 15x the
    measured; the same run with the collator's variant intra_doc (the anchor unseen) moves the losses by
    6e-4 to 1.7e-3 relative."""
    from torchtrain import build_model

    cfg, run = anchor_run
    init = build_model(cfg.model.name, engine="sdpa", dtype="float32", seed=cfg.data.seed).state_dict()
    trainer, losses = _trainer_run(cfg, run)
    want_losses, want_weights = _anchor_results(run)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    state = trainer.model.state_dict()
    assert set(want_weights) <= set(state)
    for name, want in want_weights.items():
        update = float((want - init[name]).norm())
        assert float((state[name] - want).norm()) <= 1e-3 * update, name


def test_trainer_with_torchtrain_loss_is_anchor_train_bit_for_bit(anchor_run) -> None:
    """The same Trainer run with `anchor train`'s loss arithmetic (final hidden states, the fused chunked
    lm-head cross-entropy, times 1/count): equal final weights and equal losses (summed in float64 as the
    trainer reports them)."""
    from transformers import Trainer

    from torchtrain.parallel import ulysses as sp
    from torchtrain.model.loss import final_hidden_states

    class FusedLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            mask = torch.zeros_like(labels)
            mask[:, :-1] = labels[:, 1:] != hf.IGNORE_INDEX
            inner = self.accelerator.unwrap_model(model)  # under torch.distributed, accelerate's DDP wraps it
            states = final_hidden_states(model, inner, **inputs)
            local, _ = sp.next_token_loss_shard(states, inputs["input_ids"], mask, 0, 1,
                                                lm_head=inner.get_output_embeddings())
            self.micro_losses.append(float(local.detach().double()))  # summed in float64, as anchor train
            self.counts.append(float(num_items_in_batch))
            return local * (1 / num_items_in_batch.float().clamp_min(1.0))

    cfg, run = anchor_run
    trainer, sums = _trainer_run(cfg, run, FusedLoss)
    want_losses, want_weights = _anchor_results(run)
    counts = trainer.counts[::len(trainer.counts) // STEPS]
    assert [s / c for s, c in zip(sums, counts)] == want_losses
    state = trainer.model.state_dict()
    for name, want in want_weights.items():
        assert torch.equal(state[name], want), name


# ---------------------------------------------------------------------------------------------
# anchor parity --stack hf --attention torchtrain.hf:anchor_sdpa --rope-in model


@pytest.mark.slow
@pytest.mark.parametrize("name", ["anchor_sdpa", "anchor_varlen"])
def test_parity_hf_stack(name: str) -> None:
    """Each function computes every variant asked (fp32 against the oracle's fp64) and its bf16 passes
    (about 80 s per function on 2 CPU cores)."""
    from parity_tests.hf_stack import run_hf_stack

    report = run_hf_stack("random:llama", attention=f"torchtrain.hf:{name}", rope_in="model", variants=list(VARIANTS),
                          dtypes=["float32", "bfloat16"])
    rows = {row["variant"]: row for row in report["rows"]}
    assert set(rows) == set(VARIANTS)
    for variant, row in rows.items():
        assert row["computes"] == variant, row
        assert row["status"] == "computes", row
        assert row["bf16"]["pass"], row["bf16"]  # bf16 within the rule of its emulation (fa2_bf16)
    assert report["pass"], report["rows"]


@pytest.mark.slow
def test_examples_run() -> None:
    """examples/hf_trainer and examples/trl (each a script and its test), which `make test` does not collect."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    folders = [str(root / "examples" / "hf_trainer")]
    try:
        import trl  # noqa: F401  (the `hf` extra)
        folders.append(str(root / "examples" / "trl"))
    except ImportError:
        pass
    # a test of this session that trained in-process left its world of one in os.environ
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *folders],
                          cwd=root, capture_output=True, text=True, timeout=600, env=environ_for_child())
    assert done.returncode == 0, done.stdout[-3000:]
