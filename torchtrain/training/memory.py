"""What one training step will take in memory, estimated from the sizes before any work.

    need = step_memory(spec, seq_len=65536, micro_batch=1, dtype=torch.float32, engine="varlen",
                       zero_stage=0, procs=1, sequence_parallel=1, activation_checkpointing=False)
    need.total          # bytes on this machine (all local processes on the CPU; one device on CUDA)
    engine = check_device(cfg, "cpu")   # what the config asks of the device, before its memory (below)

Legend: P parameters, T slots per window, B windows per micro-batch, h hidden size, i MLP size, N query
heads, K kv heads, D head dim, V vocabulary, L layers, e bytes per activation element (4 fp32, 2 bf16).

The parts, per process:
  base         the process itself (Python, torch, transformers, DeepSpeed): `BASE_PROCESS_BYTES`, measured
  states       weights, gradients and AdamW's two moments: fp32 4 + 4 + 8 bytes per parameter; bf16 under
               DeepSpeed 2 + 2 (+ 4 fp32 master) + 8; ZeRO-1 shards the moments (and the master), ZeRO-2 the
               gradients too, ZeRO-3 the weights too, over the processes. The gradients are those held at
               the peak: the backward's start holds the head's and one layer's beside every layer's
               checkpoint, its end every gradient beside the first layer's checkpoint; the larger is the peak
               (the moments exist from the start: torchtrain.training.optim.allocate_state)
  activations  B T / sp slots, each keeping per layer what the backward reads:
               e (7 h + 4 i + (3 N + 4 K) D) (the norms' inputs and outputs, q/k/v before and after RoPE, the
               attention output, o_proj and the residual; gate, up, act(gate), their product), for every
               layer (for one, plus the layer inputs, under activation checkpointing), one more layer for
               the backward's transients without checkpointing; the fused loss's one chunk where it outweighs
               the layer (at every ZeRO stage)
  dense        the engine's T x T tensors (`torchtrain.attention.engines.dense_attention_bytes`; 0 for the linear ones)
  optimizer    a peak of its own, with every gradient and no activation: DeepSpeed's partitioned step (ZeRO >= 1),
  step         or at ZeRO-0 DeepSpeed's flat copy of the gradients it all-reduces (`zero0_reduce_bytes`) or torch's
               AdamW temporaries (`torch_adamw_temporaries`); the larger of it and the backward's is the step's

What a config asks of the device besides memory (`check_device`: bf16 under ZeRO-0, an engine the device or
this machine lacks, checkpoints offloaded from a CPU) is one function, which `anchor train`
(torchtrain.training.fit.check_model) and `anchor plan` both call: a plan never says "fits" for a config the
trainer refuses, and refuses it in the same words.

Checked against measured peaks (peak RSS of a fresh `anchor train` process) in
`benchmarks/bench_memory.py` (`results/memory/memory_cpu.json`: estimate / peak per row) and, for SmolLM2-135M
from 8K to the longest window this machine trains, `benchmarks/bench_longest_window.py`
(`results/memory/longest_window_cpu.json`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from anchor_core.errors import InputError, UnavailableError
from anchor_core.spec import ModelSpec
from torchtrain.attention import engines
from torchtrain.config.deepspeed_json import bucket_sizes
from torchtrain.model import float8
from torchtrain.model.loss import chunk_working_bytes

if TYPE_CHECKING:
    from torchtrain.config import TrainConfig

# Peak RSS of a training process at T -> 0: `anchor train --config tiny` (CPU, fp32, T = 128, one step, its corpus
# packed by the same command) peaked 0.58 GiB, 0.55 once its model was built; SmolLM2-135M's process held 0.56 GiB
# when its model's build began, and its steps add heap that their small temporaries leave fragmented.
BASE_PROCESS_BYTES = int(0.58 * 2**30)
PLAN_STOP = 1 << 24  # the longest window a plan tries (16M slots): `plan_windows` stops there
# What a process holds beyond its tensors (the allocator's caching and fragmentation, freed buffers not given back
# to the system), as a share of the tensors' bytes. The longest-window record measured peaks 1.8-4.2% above the
# tensors counted (results/memory/longest_window_cpu.json, SmolLM2-135M from 8K to 128K): a plan counts 5%, so
# that it errs on the safe side; a window is accepted only with this margin inside the budget.
ALLOCATOR_MARGIN = 0.05
DEEPSPEED_ALLREDUCE_BUCKET = 500_000_000  # elements of DeepSpeed's ZeRO-0 all-reduce bucket (MEMORY_OPT_ALLREDUCE_SIZE)


def check_device(cfg: TrainConfig, device: str | None, *, here: bool = True) -> str:
    """What the run config `cfg` asks of the device it trains on, beyond memory; an InputError naming the keys
    where the device cannot serve it. The one check of these that `anchor train` (torchtrain.training.run_folder.
    check_model, on the machine that trains) and `anchor plan` (for the device it plans) make.

    device: "cuda" or "cpu", the kind of device the run trains on; None: any (only the rules of every device).
    here: the device is this machine's, whose installed packages decide the engines (flash-attn); a plan for
      a named GPU checks only what any GPU would refuse.
    Returns the engine that runs: `model.engine`, `auto` resolved for this machine (torchtrain.attention.engines.
    resolve_engine; for another, varlen: auto is linear in T either way)."""
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    if cfg.model.dtype == "bfloat16" and cfg.parallel.zero_stage == 0:
        # DeepSpeed's stage-0 bf16 optimizer departs from the fp32 update (tiny.yaml, 5 steps: 4% in
        # the loss, where ZeRO 1-3 in bf16 stay within 1e-3 of fp32); ZeRO-1 on one process is the
        # same memory as stage 0.
        raise InputError("model.dtype bfloat16 needs parallel.zero_stage >= 1 (DeepSpeed's stage-0 bf16 optimizer "
                         "drifts from the fp32 update; ZeRO-1 costs nothing extra on one process)",
                         path=cfg.where("model.dtype", "parallel.zero_stage"))
    engine = engines.resolve_engine(cfg.model.engine, device if here and device else "cpu", dtype)
    if device is None:
        return engine
    if here:
        engines.check_engine(engine, dtype)
    elif engine == "flash_varlen" and dtype == torch.float32:  # any GPU: flash-attn has no fp32 kernel
        raise UnavailableError("engine 'flash_varlen' runs in bfloat16/float16 only (FlashAttention has no float32 "
                               "kernel); use dtype='bfloat16', or engine 'sdpa' / 'flash_varlen_emulated' in float32")
    if device == "cpu" and cfg.model.offload_checkpoints:
        raise InputError("model.offload_checkpoints moves the checkpoints from a GPU to host memory; this machine "
                         "trains on the CPU, where they already are", path=cfg.where("model.offload_checkpoints"))
    if cfg.model.float8 is not None or cfg.model.float8_emulation:
        _check_float8(cfg, device if here or device == "cpu" else None)
    if device == "cpu" and engine == "flex":
        raise InputError("engine 'flex' has no backward on CPU (FlexAttention); train with varlen, sdpa, eager "
                         "or flash_varlen_emulated on CPU", path=cfg.where("model.engine"))
    return engine


def _check_float8(cfg: TrainConfig, device: str | None) -> None:
    """model.float8 on `device` ("cpu", "cuda" here, or None: a plan for a named GPU, not checked: FP8 came with
    the L40S and H100), its emulation asked for without it, and the ZeRO stages it trains under."""
    if cfg.model.float8 is None:
        raise InputError("model.float8_emulation emulates FP8 linear layers: set model.float8 (rowwise or tensorwise)",
                         path=cfg.where("model.float8_emulation"))
    if cfg.parallel.zero_stage == 3:
        raise InputError("model.float8 trains under ZeRO 0-2: ZeRO-3's partitioned build does not convert its "
                         "linears to torchao's Float8Linear", path=cfg.where("model.float8", "parallel.zero_stage"))
    try:
        float8.check(cfg.model.float8, device, cfg.model.float8_emulation)
    except InputError as e:
        raise InputError(str(e).removeprefix("model.float8: "), path=cfg.where("model.float8")) from None


def layer_parameters(spec: ModelSpec) -> int:
    """The parameters of one decoder layer (attention, MLP, its two norms)."""
    h, d = spec.hidden_size, spec.head_dim
    attn = h * (spec.num_heads + 2 * spec.num_kv_heads) * d + spec.num_heads * d * h
    if spec.qkv_bias:
        attn += (spec.num_heads + 2 * spec.num_kv_heads) * d
    if spec.qk_norm:
        attn += 2 * d  # Qwen3's q and k RMSNorm weights
    return attn + 3 * h * spec.intermediate_size + 2 * h


def parameters(spec: ModelSpec) -> int:
    """P of a Llama-family decoder (embedding, layers, final norm, the head when not tied)."""
    h = spec.hidden_size
    head = 0 if spec.tie_embeddings else spec.vocab_size * h
    return spec.vocab_size * h + spec.num_layers * layer_parameters(spec) + h + head


def largest_parameter(spec: ModelSpec) -> int:
    """The elements of the model's largest parameter: the embedding (the head is its size), an MLP matrix, or
    the query or output projection."""
    h = spec.hidden_size
    return max(spec.vocab_size * h, spec.intermediate_size * h, spec.num_heads * spec.head_dim * h)


def torch_adamw_temporaries(spec: ModelSpec, elem: int, device: str) -> int:
    """Bytes torch's AdamW allocates for the length of its step (ZeRO-0: the optimizer over the model's own
    parameters, torchtrain.training.optim.build_optimizer): on a CPU it steps one parameter at a time (its single-tensor
    path), the second moment's square root and its quotient two temporaries of that parameter's size, the
    largest's at the peak; on a GPU (its foreach path) the square roots of every parameter at once. SmolLM2-135M
    in fp32 on the CPU: 0.21 GiB; its engine's build (`allocate_state`, the same step) measured 2.23 GiB above the
    process before the model, 2.00 GiB of it the weights, zero gradients and moments (16 P)."""
    if device == "cpu":
        return 2 * largest_parameter(spec) * elem
    return parameters(spec) * elem


def zero0_reduce_bytes(spec: ModelSpec, elem: int) -> int:
    """Bytes DeepSpeed adds at ZeRO-0 to all-reduce the gradients at the backward's end, one process or several: one
    flat copy of them (its buffered fallback, in buckets of `DEEPSPEED_ALLREDUCE_BUCKET` elements, one at a time).
    SmolLM2-135M at T=2048 on one process: the backward peaked 3.10 GiB with it, 2.71 GiB with the reduction
    switched off (`enable_backward_allreduce`), its end then below AdamW's step (2.81 GiB)."""
    return min(parameters(spec), DEEPSPEED_ALLREDUCE_BUCKET) * elem


def zero0_stepping(spec: ModelSpec, elem: int, device: str) -> int:
    """Bytes ZeRO-0's optimizer step adds to the weights, gradients and moments: torch's AdamW over the model's own
    parameters (`torch_adamw_temporaries`: on a CPU two of the largest parameter's size, on a GPU one of every
    parameter's), after DeepSpeed all-reduced the gradients through a flat copy of them (`zero0_reduce_bytes`);
    one after the other, so the larger of the two."""
    return max(torch_adamw_temporaries(spec, elem, device), zero0_reduce_bytes(spec, elem))


def activation_bytes_per_slot(spec: ModelSpec, elem: int, *, layers: int) -> int:
    """Bytes one slot keeps for the backward in `layers` decoder layers (module docstring)."""
    per_layer = (7 * spec.hidden_size + 4 * spec.intermediate_size
                 + (3 * spec.num_heads + 4 * spec.num_kv_heads) * spec.head_dim)
    return elem * per_layer * layers


def beyond_the_layers_per_slot(spec: ModelSpec, elem: int) -> int:
    """Bytes a slot keeps for the backward outside the layers, held at its start: the final norm's input, its
    normalised product and its output (the head's input, which the loss keeps for the head's gradient), and the
    float32 rotary tables (cos, sin) every layer reads: 3 H elements and 2 D floats."""
    return 3 * spec.hidden_size * elem + 2 * spec.head_dim * 4


@dataclass(frozen=True)
class StepMemory:
    base: int
    states: int
    activations: int
    dense: int
    procs: int
    states_are: str = "weights and optimizer"
    # the activations by term, (name, bytes) in the order `describe` prints them; empty where not split
    parts: tuple[tuple[str, int], ...] = ()
    host: int = 0  # offloaded checkpoints: in host memory, not counted in `total` (a GPU's)
    built: int = 0  # the engine's build above the process (`build_memory`), where it is counted: the floor of a step

    @property
    def per_process(self) -> int:
        return self.base + max(self.states + self.activations + self.dense, self.built)

    @property
    def total(self) -> int:
        return self.per_process * self.procs

    def terms(self) -> dict[str, int]:
        """Bytes per process by term: process, the states, the activations' parts, the dense T x T tensors."""
        acts = dict(self.parts) or {"activations": self.activations}
        return {"process": self.base, "states": self.states, **acts, "attention": self.dense}

    def describe(self) -> str:
        g = 2**30
        acts = f"activations {self.activations / g:.2f}"
        if self.parts:
            acts += " (" + " + ".join(f"{name} {b / g:.2f}" for name, b in self.parts) + ")"
        built = (f"; building the engine holds more, {self.built / g:.2f}"
                 if self.built > self.states + self.activations + self.dense else "")
        return (f"{self.total / g:.1f} GiB ({self.procs} x [process {self.base / g:.2f} + {self.states_are} "
                f"{self.states / g:.2f} + {acts} + dense T x T {self.dense / g:.2f}{built}])")


def step_memory(spec: ModelSpec, *, seq_len: int, micro_batch: int, dtype: torch.dtype, engine: str,
                zero_stage: int, procs: int, sequence_parallel: int = 1, context_parallel: int = 1,
                activation_checkpointing: bool = False, tiled_mlp: bool = False,
                world: int | None = None, offload_checkpoints: bool = False, offload_optimizer: bool = False,
                offload_params: bool = False, count_build: bool = False, device: str = "cpu",
                float8: str | None = None, float8_emulation: bool = False) -> StepMemory:
    """The estimate of one training step's peak memory (module docstring); `procs` the processes that
    share this memory (the local ones on a CPU, 1 on a CUDA device), `world` the processes ZeRO shards over
    (default `procs`: every process on this machine). Its activations by term:
      checkpoints  what the backward keeps of every layer: the layer inputs under activation
                   checkpointing, else every layer's activations; all of them at the backward's start (with
                   the final norm's tensors and the rotary tables), the first layer's at its end (whichever end
                   is the peak, with the gradients held there)
      recompute    one layer's activations while its backward runs (recomputed under checkpointing: its
                   backward frees them as it goes); a tiled MLP keeps one tile of its intermediate
                   instead of the window's (torchtrain.model.tiling)
      loss         the fused loss's one chunk (`torchtrain.model.loss.chunk_working_bytes`; fused at every ZeRO
                   stage), which its backward holds at the backward's start before the last layer is
                   recomputed: the larger of the two is the peak's
      gathered kv  under context parallelism, the whole window's keys and values (`gathered_kv`)
      float8 casts with FP8 linear layers (`float8`), what the largest linear's backward casts (`float8_casts`)
    `offload_checkpoints` (CUDA) moves the checkpoints to host memory: `host`, not on the device; so do
    `offload_optimizer` (the fp32 master weights, AdamW's moments and the fp32 gradients the CPU optimizer steps
    with) and `offload_params` (ZeRO-3's parameter partitions; the device then holds the layers it gathers).

    The states per parameter, each byte divided once by the processes that shard it: the module's weights
    (e: 4 fp32, 2 bf16; ZeRO-3 shards them), the fp32 master copy (4, where ZeRO >= 1 keeps one: DeepSpeed's
    partition of the flat groups, a copy in fp32 too; sharded), AdamW's moments (8; ZeRO >= 1 shards them) and
    the gradients held at the peak (e; ZeRO >= 2 shards them). A bf16 ZeRO-3 run on N processes: (2 + 4 + 8 + 2)
    / N bytes. At ZeRO-3 the device also holds the layers it has gathered, two at a time (the one computing and
    the one prefetched): `gathered`. Every term but the process's is raised by `ALLOCATOR_MARGIN`.
    DeepSpeed's optimizer step (ZeRO >= 1, not offloaded) is a peak of its own, with every gradient and no
    activation: the fp32 gradient of the flat partition and AdamW's two temporaries of its size, 12 / N bytes a
    parameter (`optimizer step`; at ZeRO-0 `zero0_stepping` on `device`); the larger of it and the backward's is
    the step's. `count_build` (the host's memory, where the engine is built: `step_of` on a CPU) makes the
    engine's build (`build_memory`) the floor. It is longer than 100 lines because this docstring states each term
    beside the one function that forms them all, so that a term and its account are read together."""
    P = parameters(spec)
    n, shards = max(1, procs), max(1, world if world is not None else procs)
    elem = 2 if dtype == torch.bfloat16 else 4
    module, master, moments, grads = elem, (4 if zero_stage >= 1 else 0), 8, elem  # bytes per parameter
    if zero_stage >= 1:
        master, moments = master / shards, moments / shards
    if zero_stage >= 2:
        grads /= shards
    if zero_stage >= 3:
        module /= shards
    host_states = 0.0
    if offload_optimizer:  # the CPU optimizer's: master, moments and its fp32 copy of the gradients
        host_states += master + moments + 4 / (shards if zero_stage >= 1 else 1)
        master = moments = 0
    if offload_params and zero_stage >= 3:
        host_states += module
        module = 0
    gathered = 2 * layer_parameters(spec) * elem if zero_stage >= 3 else 0
    weights = module + master
    slots = micro_batch * -(-seq_len // (max(1, sequence_parallel) * max(1, context_parallel)))
    layer = activation_bytes_per_slot(spec, elem, layers=1) - (elem * 4 * spec.intermediate_size if tiled_mlp else 0)
    kept = elem * spec.hidden_size if activation_checkpointing else layer  # per layer: its input, or everything
    heads = -(-spec.num_heads // max(1, sequence_parallel))
    dense = engines.dense_attention_bytes(engine, seq_len=seq_len, batch=micro_batch,
                                          layers=1 if activation_checkpointing else spec.num_layers,
                                          heads=heads, dtype=dtype) // max(1, context_parallel)
    host = 0
    if offload_checkpoints:
        host, kept = int(kept * slots * spec.num_layers), 0
    # The backward runs from the last layer to the first: the gradients grow from the head's and one layer's
    # while the checkpoints shrink from every layer's to the first's. Their sum is linear in between, so the
    # peak is at one end: the backward's start or its end.
    # At the start the loss's backward runs first, then the last layer's: the fused loss's chunk and the
    # recomputed layer do not coexist.
    early = spec.vocab_size * spec.hidden_size + layer_parameters(spec)  # the head's (tied: the embedding's)
    recompute = layer * slots
    loss = chunk_working_bytes(slots, spec.vocab_size, elem)  # the larger of the two, the other not held then
    recompute, loss = (recompute, 0) if recompute >= loss else (0, loss)
    head = beyond_the_layers_per_slot(spec, elem) * slots
    start = early * grads + kept * slots * spec.num_layers + head + recompute + loss
    end = P * grads + kept * slots + layer * slots
    if start >= end:
        held_grads, held_kept = early * grads, spec.num_layers
    else:
        held_grads, held_kept, head, recompute, loss = P * grads, 1, 0, layer * slots, 0
    buckets = bucket_bytes(spec, zero_stage, elem)
    states = int(P * (weights + moments) + held_grads + buckets)
    parts = (("checkpoints", int(kept * slots * held_kept + head)), ("recompute", int(recompute)), ("loss", int(loss)))
    parts += gathered_kv(spec, seq_len, micro_batch, elem, sequence_parallel, context_parallel, activation_checkpointing)
    if float8 is not None:
        parts += (("float8 casts", float8_casts(spec, slots, float8_emulation)),)
    if gathered:
        parts += (("gathered", int(gathered)),)
    # DeepSpeed (ZeRO >= 1) steps AdamW on one flat fp32 partition, with every gradient held and no activation:
    # the partition's fp32 gradient (4) and AdamW's two partition-sized temporaries (8: the second moment's square
    # root and its quotient). On the host when the optimizer is offloaded (DeepSpeed's CPU Adam steps in place).
    stepping = (zero0_stepping(spec, elem, device) if zero_stage == 0
                else P * 12 / shards if not offload_optimizer else 0)
    optimizer_peak = P * (weights + moments + grads) + stepping + buckets
    if optimizer_peak > states + sum(b for _, b in parts) + dense:
        states = int(P * (weights + moments + grads) + buckets)
        parts, dense = (("optimizer step", int(stepping)),), 0
    activations = sum(b for _, b in parts)
    margin = int(ALLOCATOR_MARGIN * (states + activations + dense))
    parts += (("allocator", margin),)
    built = build_memory(spec, dtype=dtype, zero_stage=zero_stage, world=shards)[1] if count_build else 0
    return StepMemory(base=BASE_PROCESS_BYTES, states=states, activations=activations + margin,
                      dense=int(dense), procs=n, parts=parts, host=host + int(P * host_states), built=built)


def float8_casts(spec: ModelSpec, slots: int, emulation: bool) -> int:
    """`step_memory`'s term "float8 casts" (model.float8, torchtrain.model.float8): torchao casts a linear's operands
    to FP8 anew in each product and frees them after it (its autograd saves the operands as they were, so the
    checkpoints do not change). The backward of one linear holds the most at once: the incoming gradient cast twice
    (along its rows for grad_input, along its columns for grad_weight), the weight and the input cast once each, a
    byte an element; torchao's emulation also reads each cast operand back in float32 and forms the product in
    float32 before rounding it (4 bytes an element more for each, and the product). The largest of the decoder
    layers' linears: the MLP's gate or up projection (out = intermediate) or its down projection (in = intermediate)."""
    h, i = spec.hidden_size, spec.intermediate_size

    def backward(out: int, inp: int) -> int:
        casts = 2 * slots * out + slots * inp + out * inp  # grad_output twice, the input, the weight: a byte each
        return casts * 5 + 4 * max(slots * inp, out * inp) if emulation else casts

    return int(max(backward(i, h), backward(h, i)))


def gathered_kv(spec: ModelSpec, seq_len: int, micro_batch: int, elem: int, sequence_parallel: int,
                context_parallel: int, activation_checkpointing: bool) -> tuple[tuple[str, int], ...]:
    """`step_memory`'s term "gathered kv" under context parallelism (C > 1; none without): the whole window's keys
    and values a rank gathers, kept for the backward by every layer (by one under activation checkpointing)
    ([B, K/U, T, D] twice, Ulysses repeating the kv heads up to lcm(K, U)), and one layer's float32 gradients of
    them summed over the group (torchtrain.parallel.context). The rank's other terms count its T / (U C) slots, and
    a dense engine's mask its T / C query rows of the T keys."""
    if context_parallel <= 1:
        return ()
    U = max(1, sequence_parallel)
    kv_heads = -(-math.lcm(spec.num_kv_heads, U) // U)
    kv = micro_batch * kv_heads * seq_len * spec.head_dim  # one layer's keys (or values) of the whole window
    layers = 1 if activation_checkpointing else spec.num_layers
    return (("gathered kv", 2 * kv * elem * layers + 2 * kv * 4),)


def step_of(cfg: TrainConfig, *, engine: str, dtype: torch.dtype, procs: int, world: int,
            on_gpu: bool) -> dict[str, Any]:
    """The keywords of `step_memory` (all but `seq_len`) for a run config: the one mapping from the config's
    keys to the estimate, shared by `anchor train`'s refusal and `anchor plan`. `procs` the processes that
    share the memory planned for (the local ones on a CPU, 1 on a GPU), `world` those ZeRO shards over;
    the checkpoints, optimizer states and parameters are offloaded only where there is a GPU to offload them from
    (on a CPU the host's memory is the one planned for: they stay counted in it)."""
    return dict(micro_batch=cfg.data.micro_batch, dtype=dtype, engine=engine, zero_stage=cfg.parallel.zero_stage,
                procs=procs, world=world, sequence_parallel=cfg.parallel.sequence_parallel,
                context_parallel=cfg.parallel.context_parallel,
                activation_checkpointing=cfg.model.activation_checkpointing, tiled_mlp=cfg.model.tiled_mlp,
                offload_checkpoints=cfg.model.offload_checkpoints and on_gpu,
                offload_optimizer=cfg.parallel.offload_optimizer and on_gpu,
                offload_params=cfg.parallel.offload_params and on_gpu, count_build=not on_gpu,
                device="cuda" if on_gpu else "cpu", float8=cfg.model.float8, float8_emulation=cfg.model.float8_emulation)


def forward_memory(spec: ModelSpec, *, seq_len: int, batch: int, dtype: torch.dtype, engine: str) -> StepMemory:
    """The estimate of a forward pass without gradients over `batch` rows of `seq_len` slots with a KV
    cache (evaluation's prefill, then its decode): the weights (e P), the cache 2 L K D e per slot, twice
    (transformers' DynamicCache copies a layer's cache when it grows), one layer's transients
    e (4 h + 3 i + (N + 2 K) D) + 8 h per slot (the norms in fp32), and a dense engine's T x T tensors of
    one layer: the boolean mask and its additive copy (sdpa), and the fp32 scores and probabilities (eager).
    Logits are kept for the last slot only (`logits_to_keep=1`), or in chunks for perplexity."""
    elem = 2 if dtype == torch.bfloat16 else 4
    h, d = spec.hidden_size, spec.head_dim
    kv = 2 * 2 * spec.num_layers * spec.num_kv_heads * d * elem
    layer = elem * (4 * h + 3 * spec.intermediate_size + (spec.num_heads + 2 * spec.num_kv_heads) * d) + 8 * h
    slots = batch * seq_len
    dense = 0
    if engine == "sdpa":
        dense = batch * seq_len * seq_len * (1 + elem)
    elif engine == "eager":
        dense = batch * seq_len * seq_len * (1 + 2 * 4 * spec.num_heads)
    return StepMemory(base=BASE_PROCESS_BYTES, states=int(parameters(spec) * elem), activations=int((kv + layer) * slots),
                      dense=int(dense), procs=1, states_are="weights")


# Published figures to set a plan beside: ALST (Bekman et al., "Arctic Long Sequence Training", arXiv:2506.13996),
# Llama-3.1-8B in bf16 on H100s: the longest sequence trained, and the Hugging Face baseline's.
ALST_LLAMA_8B: dict[int, int] = {1: 500_000, 8: 3_700_000, 32: 15_000_000}
ALST_BASELINE = 32_000

@dataclass(frozen=True)
class PlanRow:
    seq_len: int
    need: StepMemory
    fits: bool  # on the device and, where a host budget is given, in the host's memory
    host_total: int = 0  # the offloaded checkpoints of every process on the host
    host_fits: bool | None = None  # None: no host budget given (not checked)


def plan_windows(spec: ModelSpec, *, budget: int, start: int = 8192, stop: int = PLAN_STOP,
                 host_budget: int | None = None, host_procs: int = 1, **step: object) -> list[PlanRow]:
    """`step_memory(spec, seq_len=T, **step)` for T = start, 2 start, ... up to the first length that does not
    fit (included, so the reason is shown) or `stop`: `budget` bytes per device, and where given `host_budget`
    bytes of host memory for what the `host_procs` processes that share the host offload (checkpoints, states)."""
    rows: list[PlanRow] = []
    T = start
    while T <= stop:
        rows.append(plan_row(spec, T, budget=budget, host_budget=host_budget, host_procs=host_procs, **step))
        if not rows[-1].fits:
            break
        T *= 2
    return rows


def plan_row(spec: ModelSpec, seq_len: int, *, budget: int, host_budget: int | None = None, host_procs: int = 1,
             **step: object) -> PlanRow:
    """`plan_windows`' row of one window length."""
    need = step_memory(spec, seq_len=seq_len, **step)  # type: ignore[arg-type]
    host = need.host * host_procs
    host_fits = None if host_budget is None else host <= host_budget
    return PlanRow(seq_len, need, need.total <= budget and host_fits is not False, host, host_fits)


def largest_term(need: StepMemory) -> tuple[str, int]:
    """The term of one process's estimate that weighs most (name, bytes)."""
    return max(need.terms().items(), key=lambda kv: kv[1])



def bucket_bytes(spec: ModelSpec, zero_stage: int, elem: int) -> int:
    """DeepSpeed's communication buffers on a rank, not sharded: the buckets `bucket_sizes` sizes (elements of the
    run's dtype); its persistence threshold is a size limit, no buffer."""
    return elem * sum(v for k, v in bucket_sizes(spec.hidden_size, zero_stage).items() if k.endswith("bucket_size"))


def build_memory(spec: ModelSpec, *, dtype: torch.dtype, zero_stage: int, world: int,
                 reader: bool = True) -> tuple[int, int]:
    """Host bytes a process holds above its idle size (model, engine): once its model is built, and once DeepSpeed's
    engine is built beside it, before the first step (the peaks the trainer logs as `build_peak_gib` and
    `engine_peak_gib`).

    ZeRO-3 (torchtrain.parallel.sharded_build): the model's partitions (e P / N), plus on rank 0 (`reader`) the float32
    arrays of the largest group read together (4 bytes an element: a decoder layer, or the embedding or the head
    alone) and the slice of the largest tensor it converts for another rank (e / N an element; none on one
    process), and on every rank the largest parameter whole in the run's dtype (e), which `zero.Init` creates
    before it partitions it (the last created beside nearly every partition); rank 0 holds the larger of its two.
    Measured (benchmarks/bench_sharded_build.py --build-only, 0.48B Llama, shards of 400 MB): bf16 and fp32 on 1
    and 2 processes, every rank 1.01-1.04 of this. The engine adds
    DeepSpeed's fp32 master partition (4 P / N), the gradient partition (e P / N), the buckets (`bucket_sizes`)
    and, while it moves the partitions into one flat buffer, a second copy of them (e P / N). ZeRO 0-2: the whole
    model in float32 three times while its weights load (the arrays read, their torch copies, the parameters); at
    ZeRO-0 the engine's build then steps AdamW once to allocate its moments (torchtrain.training.optim.allocate_state): the
    weights, zero gradients and both moments (16 P) with the step's temporaries (`torch_adamw_temporaries`)."""
    P = parameters(spec)
    elem = 2 if dtype == torch.bfloat16 else 4
    if zero_stage == 0:  # the engine's build steps AdamW once on zero gradients (torchtrain.training.optim.allocate_state)
        return int(12 * P), int(max(12 * P, 16 * P + torch_adamw_temporaries(spec, elem, "cpu")))
    if zero_stage < 3:
        return int(12 * P), int(12 * P)
    n = max(1, world)
    group = max(layer_parameters(spec), spec.vocab_size * spec.hidden_size)
    whole = elem * largest_parameter(spec)
    model = P * elem / n + (max(4 * group + (whole / n if n > 1 else 0), whole) if reader else whole)
    engine = max(model, P * (3 * elem + 4) / n + bucket_bytes(spec, zero_stage, elem))
    return int((1 + ALLOCATOR_MARGIN) * model), int((1 + ALLOCATOR_MARGIN) * engine)


def run_memory(step: StepMemory, build: tuple[int, int]) -> int:
    """Host bytes every process of a run on this machine holds together at its peak: the launcher (a process at
    its idle size) and each rank at the larger of its build and its step (`step.procs` of them). The export
    gathers one layer at a time (torchtrain.training.checkpoint.export_model): below both."""
    return int(step.base + step.procs * (step.base + max(*build, step.per_process - step.base)))
