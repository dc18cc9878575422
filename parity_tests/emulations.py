"""The oracle emulation of each torchtrain engine: one table, read by the parity runners
(`parity_tests.runners.TorchRunner`) and the torch-stack audit (`parity_tests.torch_audit`).

Its keys are the core's engine names (`anchor.engines.ENGINES`); the values are jaxref dtype-policy
presets (docs/DESIGN.md §4), named as strings so that this module imports neither side.
"""

from __future__ import annotations

from anchor.engines import Engine

# The oracle policy whose bf16 arithmetic each engine follows on the CPU (where the runners run):
#   eager                  Hugging Face eager: bf16 logits, softmax in fp32 rounded to bf16, then p·v
#   sdpa                   torch's fused CPU kernel: fp32 logits, online softmax over key blocks of
#                          512, unnormalised probabilities rounded to bf16, division at the end
#   flex, flash_varlen     FlashAttention-2 over key blocks of 128
#   flash_varlen_emulated  the same FA-2 arithmetic with a segment's keys in one block
#   varlen                 the fused CPU kernel per segment (sdpa's arithmetic; a segment's keys
#                          start a block of 512)
# Holding sdpa against hf_bf16 (as before 2026-11-22) made SmolLM2's anchor cases fail at one
# document-start token whose layer-11 MLP amplifies attention roundings; see tests/parity_tests notes
# in parity_tests/test_matrix.py.
EMULATIONS: dict[Engine, str] = {  # keys: exactly ENGINES, in its order (tests/train/test_config_keys.py)
    "eager": "hf_bf16",
    "sdpa": "sdpa_cpu_bf16",
    "flex": "fa2_bf16",
    "flash_varlen": "fa2_bf16",
    "flash_varlen_emulated": "fa2_bf16_1pass",
    "varlen": "sdpa_cpu_bf16",
}

# transformers' own attention implementations (parity_tests.hf_stack, `anchor parity --stack hf`):
#   eager              eager_attention_forward: bf16 q·kᵀ, softmax in fp32 rounded to bf16, bf16 p·v (hf_bf16)
#   sdpa               F.scaled_dot_product_attention with transformers' mask: torch's fused CPU kernel
#   flex_attention     compiled FlexAttention: FlashAttention-2's arithmetic over key blocks of 128
#   flash_attention_2  FlashAttention-2 (CUDA; not run by the CPU runners)
HF_EMULATIONS: dict[str, str] = {
    "eager": "hf_bf16",
    "sdpa": "sdpa_cpu_bf16",
    "flex_attention": "fa2_bf16",
    "flash_attention_2": "fa2_bf16",
}
