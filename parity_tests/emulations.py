"""The oracle emulation of each torchtrain engine: one table, read by the parity runners
(`parity_tests.runners.TorchRunner`) and the torch-stack audit (`parity_tests.audit.torch_stack`).

Its keys are the core's engine names (`anchor_core.engines.ENGINES`); the values are jaxref dtype-policy
presets (docs/DESIGN.md §4), named as strings so that this module imports neither side.
"""

from __future__ import annotations

from anchor_core.engines import Engine

# The oracle policy whose bf16 arithmetic each engine follows on the CPU (where the runners run):
#   eager                  Hugging Face eager: bf16 logits, softmax in fp32 rounded to bf16, then p·v
#   sdpa                   torch's fused CPU kernel: fp32 logits, online softmax over key blocks of
#                          512, unnormalised probabilities rounded to bf16, division at the end
#   flex                   FlashAttention-2's forward over key blocks of 128, FlexAttention's backward
#   flash_varlen           FlashAttention-2 over key blocks of 128, forward and backward (fa2_bf16)
#   flash_varlen_emulated  the same FA-2 arithmetic with a segment's keys in one block
#   varlen                 the fused CPU kernel per segment (sdpa's arithmetic; a segment's keys
#                          start a block of 512)
# sdpa is held against sdpa_cpu_bf16, not hf_bf16: the CPU kernel computes fp32 logits and rounds
# unnormalised probabilities, and held against hf_bf16's bf16 logits and normalised probabilities
# SmolLM2's anchor cases fail at one document-start token whose layer-11 MLP amplifies attention
# roundings (the note in parity_tests/test_matrix.py).
EMULATIONS: dict[Engine, str] = {  # keys: exactly ENGINES, in its order (tests/train/test_config_keys.py)
    "eager": "hf_bf16",
    "sdpa": "sdpa_cpu_bf16",
    "flex": "flex_bf16",
    "flash_varlen": "fa2_bf16",
    "flash_varlen_emulated": "fa2_bf16_1pass",
    "varlen": "sdpa_cpu_bf16",
}

# On CUDA (`anchor parity --device cuda`, the torch-stack audit where torch sees a GPU) two engines run
# other kernels than on the CPU, and their emulation follows:
#   sdpa    torch's CUDA SDPA with the engine's dense mask: the memory-efficient kernel, FA-2-style online
#           softmax with fp32 accumulators and the probabilities rounded to bf16 before p·v (its key blocks
#           are 64 wide where fa2_bf16's are 128: a summation order, inside the rule's spread over orders)
#   varlen  torch's varlen_attn (FlashAttention-2) or FlexAttention on the packed segments
# varlen is not held against sdpa_cpu_bf16 there: that is the CPU kernel's arithmetic, which neither GPU
# kernel runs. The gradients: fa2_bf16 and flex_bf16 follow each kernel's backward (`backward` fa2 / flex:
# dS rounded to bf16 before dQ and dK, which the autodiff of the forward does not do); held against the
# kernels on a GPU, the varlen kernel's dQ and dK lie nearest fa2's, and FlexAttention's keep
# D = rowsum(dO·O) in fp32, as flex's backward does
# (experiments/attn_grad_diag/results/attn_grad_diag_h100.json).
CUDA_EMULATIONS: dict[Engine, str] = {**EMULATIONS, "sdpa": "fa2_bf16", "varlen": "fa2_bf16"}


def emulation(engine: str, device: str = "cpu") -> str:
    """The oracle policy emulating `engine`'s bf16 arithmetic on `device` ("cpu" or "cuda");
    fa2_bf16 for an engine the tables do not name (a user's registered runner)."""
    return (CUDA_EMULATIONS if device == "cuda" else EMULATIONS).get(engine, "fa2_bf16")


# transformers' own attention implementations (parity_tests.hf_stack, `anchor parity --stack hf`):
#   eager              eager_attention_forward: bf16 q·kᵀ, softmax in fp32 rounded to bf16, bf16 p·v (hf_bf16)
#   sdpa               F.scaled_dot_product_attention with transformers' mask: torch's fused CPU kernel
#   flex_attention     compiled FlexAttention: FlashAttention-2's arithmetic over key blocks of 128 (flex_bf16)
#   flash_attention_2  FlashAttention-2 (CUDA; not run by the CPU runners)
HF_EMULATIONS: dict[str, str] = {
    "eager": "hf_bf16",
    "sdpa": "sdpa_cpu_bf16",
    "flex_attention": "flex_bf16",
    "flash_attention_2": "fa2_bf16",
}
