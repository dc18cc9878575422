"""The model shapes and GPUs that plans and estimates are made for without weights or a device: one registry
for `anchor plan`'s memory (torchtrain.training.memory) and `anchor bench`'s paper-scale time estimate
(anchor.bench.estimate).

    SHAPES["llama2-7b"].spec.num_layers        # 32
    GPUS["h100"].memory_bytes                   # 80e9

Shapes are the models' Hugging Face config values (sizes only: no weights). A GPU's memory is its nominal size
in bytes (what a plan holds a step against); its peak is the dense bf16 rate the vendor states; the fractions
of it reached (`mfu_*`) and the all-to-all bandwidth are assumptions of the estimate (`source`), replaced where
a step was measured (anchor.bench.estimate.calibrate).
"""

from __future__ import annotations

from dataclasses import dataclass

from anchor_core.spec import ModelSpec, RopeSpec


@dataclass(frozen=True)
class Shape:
    """A model's name as its authors write it, and its sizes."""

    name: str
    spec: ModelSpec


def _llama(vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int, max_pos: int, theta: float,
           bos: int, eos: int) -> ModelSpec:
    return ModelSpec(family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, head_dim=hidden // heads, intermediate_size=inter, max_position=max_pos,
                     rope=RopeSpec(base=theta), bos_token_id=bos, eos_token_id=eos)


SHAPES: dict[str, Shape] = {
    # the paper's model
    "llama2-7b": Shape("Llama-2-7B", _llama(32000, 4096, 32, 32, 32, 11008, 4096, 1e4, 1, 2)),
    "llama3-8b": Shape("Llama-3-8B", _llama(128256, 4096, 32, 32, 8, 14336, 8192, 5e5, 128000, 128001)),
    # ALST's model (the published long-sequence figures a plan is set beside)
    "llama3.1-8b": Shape("Llama-3.1-8B", _llama(128256, 4096, 32, 32, 8, 14336, 131072, 5e5, 128000, 128001)),
    "llama3.1-70b": Shape("Llama-3.1-70B", _llama(128256, 8192, 80, 64, 8, 28672, 131072, 5e5, 128000, 128001)),
    "mistral-7b": Shape("Mistral-7B-v0.1", ModelSpec(
        family="mistral", vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, intermediate_size=14336, max_position=32768, rope=RopeSpec(base=1e4))),
    "qwen2-7b": Shape("Qwen2-7B", ModelSpec(
        family="qwen2", vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, intermediate_size=18944, max_position=32768, rope=RopeSpec(base=1e6), qkv_bias=True,
        bos_token_id=None, eos_token_id=151643)),
}


@dataclass(frozen=True)
class Gpu:
    """A GPU as a plan and an estimate see it."""

    name: str
    memory_bytes: int        # as sold: what one process's step is held against (the CUDA context and the
                             # allocator keep some of it, which a plan does not subtract)
    peak_tflops: float       # dense bf16, as the vendor states it
    mfu_dense: float         # assumed fraction of the peak that dense layers reach
    mfu_attention: float     # ... and FlashAttention-2's forward + backward
    all_to_all_gbps: float   # assumed all-to-all bandwidth per GPU, GB/s
    source: str = "assumed"


# The fractions: Megatron-style dense layers and FlashAttention-2 at these sizes (the FA-2 paper: 50-70% for the
# kernel alone, less within a model). All-to-all at a third of NVLink's bandwidth per direction (A100: NVLink-3,
# 300 GB/s; H100/H200: NVLink-4, 450 GB/s; B200: NVLink-5, 900 GB/s).
GPUS: dict[str, Gpu] = {
    "a100-40gb": Gpu("A100-SXM4-40GB", 40 * 10**9, 312.0, 0.45, 0.45, 100.0),
    "a100-80gb": Gpu("A100-SXM4-80GB", 80 * 10**9, 312.0, 0.45, 0.45, 100.0),
    "h100": Gpu("H100-SXM5-80GB", 80 * 10**9, 989.0, 0.40, 0.40, 150.0),
    "h200": Gpu("H200-SXM-141GB", 141 * 10**9, 989.0, 0.40, 0.40, 150.0),
    "b200": Gpu("B200-180GB", 180 * 10**9, 2250.0, 0.40, 0.40, 300.0),
}
