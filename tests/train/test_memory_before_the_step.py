"""What `anchor train` holds when its first step starts is what the plan counts (torchtrain.training.memory): what preparing
the run leaves in the process (the packing's figure leaves matplotlib's exception tracebacks in reference cycles
that hold every frame of the call that packed, and the weights' reader with them) is collected and handed back
before the model is built (torchtrain.training.trainer.release_memory), and the plan counts the step's own peak at ZeRO-0:
DeepSpeed's flat copy of the gradients it all-reduces, or torch's AdamW temporaries, beside every gradient."""

from __future__ import annotations

import gc
import types

import torch


def test_what_preparing_the_run_left_is_released_before_the_model_is_built(corpus, tmp_path, monkeypatch):
    """When `anchor train` (one process, its corpus packed by the command) starts building its model, no frame of
    the call that prepared the run is alive, nor the weights' reader it held, even where the cyclic collector has
    not run by itself (disabled here: when it runs is up to the allocations between)."""
    from anchor_core.weight_stream import WeightStream
    from torchtrain.training import trainer
    from torchtrain.config import load_train_config

    seen = []
    build = trainer.build_model

    def counting_build(*a, **k):
        frames = [o for o in gc.get_objects() if isinstance(o, types.FrameType)
                  and o.f_code.co_name in ("prepare_run", "_fill_run", "pack_corpus")]
        seen.append((len(frames), sum(isinstance(o, WeightStream) for o in gc.get_objects())))
        del frames
        return build(*a, **k)

    monkeypatch.setattr(trainer, "build_model", counting_build)
    cfg = load_train_config("tiny", [f"data.path={corpus}", "data.seq_len=128", "data.pack.budget=20000",
                                     "schedule.steps=1", "checkpoint.save_every=0"])
    gc.disable()
    try:
        trainer.train(cfg, tmp_path / "run", progress=False)
    finally:
        gc.enable()
    assert seen == [(0, 0)]


def test_the_plan_counts_the_optimizer_step_at_zero0():
    """At ZeRO-0 the step's own peak, with every gradient and no activation, holds the larger of DeepSpeed's flat
    copy of the gradients it all-reduces (one process or several; a bucket at a time) and torch's AdamW temporaries
    (on a CPU two of the largest parameter's size, on a GPU one of every parameter's); at short windows it is the
    step's peak, and the engine's build (its moments allocated by one AdamW step) is counted at its size."""
    from anchor_core.hardware import SHAPES
    from torchtrain.training.memory import (ALLOCATOR_MARGIN, BASE_PROCESS_BYTES, DEEPSPEED_ALLREDUCE_BUCKET,
                                            build_memory, largest_parameter, parameters, step_memory)

    common = dict(seq_len=64, micro_batch=1, dtype=torch.float32, engine="varlen", zero_stage=0,
                  activation_checkpointing=True, tiled_mlp=True)
    eight_b = SHAPES["llama3.1-8b"].spec
    # the embedding the largest parameter (the bucket caps the copy: AdamW's temporaries win on a CPU), and an MLP
    # matrix (the copy wins)
    for spec in (eight_b.replace(num_layers=2), eight_b.replace(num_layers=2, vocab_size=1024)):
        P, big = parameters(spec), largest_parameter(spec)
        assert big == max(spec.vocab_size, spec.intermediate_size) * spec.hidden_size
        flat = 4 * min(P, DEEPSPEED_ALLREDUCE_BUCKET)
        for device, procs, adamw in (("cpu", 1, 8 * big), ("cuda", 1, 4 * P), ("cpu", 2, 8 * big)):
            need = step_memory(spec, procs=procs, device=device, **common)
            terms = need.terms()
            assert terms["optimizer step"] == max(adamw, flat), (device, procs)
            assert terms["states"] == 16 * P
            assert abs(need.per_process - BASE_PROCESS_BYTES
                       - (16 * P + max(adamw, flat)) * (1 + ALLOCATOR_MARGIN)) <= 2
    assert flat > 8 * big  # the second spec's copy outweighs AdamW's temporaries
    assert build_memory(spec, dtype=torch.float32, zero_stage=0, world=1) == (12 * P, 16 * P + 8 * big)
    assert build_memory(spec, dtype=torch.float32, zero_stage=1, world=1) == (12 * P, 12 * P)
