"""examples/ci: a team's CI holding its attention function against the oracle with the `anchor` pytest
plugin (installed with the toolkit: `pip install anchor-toolkit`, no conftest needed). The second test has
a planted bug and fails, with a message naming the layer and the quantity where the function first
diverges."""

from my_attention import packed_attention, packed_attention_with_a_bug


def test_packed_attention_holds(anchor_parity):
    anchor_parity("random:llama", attention=packed_attention, variants=["intra_doc", "anchor"])


def test_packed_attention_with_a_bug_is_caught(anchor_parity):
    anchor_parity("random:llama", attention=packed_attention_with_a_bug, variants=["intra_doc"])


def test_bf16_rope_drift_stays_small(anchor_audit):
    anchor_audit("random:llama", policy="paper_bf16", max_D=0.5)
