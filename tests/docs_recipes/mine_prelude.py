# `mine`, the model docs/guides/stock-transformers.md's fragment checks: a transformers causal LM the reader built,
# here the small Llama README.md's Python API block builds.
from transformers import LlamaConfig, LlamaForCausalLM

mine = LlamaForCausalLM(LlamaConfig(vocab_size=331, hidden_size=84, intermediate_size=97, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=2))
# ---- the block
