"""The user's attention function README.md's pytest example holds against the oracle (`my_project.attention:
packed_attention`): a packed attention with transformers' AttentionInterface signature that reads `doc_ids` and
`variant`, here the toolkit's own SDPA one (a correct function: the example's check passes)."""

from torchtrain.hf import anchor_sdpa as packed_attention

__all__ = ["packed_attention"]
