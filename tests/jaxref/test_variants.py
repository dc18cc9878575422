"""docs/DESIGN.md §2 masks and positions against a brute-force reading of the contract text."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxref
from anchor_core.errors import InputError
from tests.jaxref.layouts import doc_ids_from_lengths


def brute_mask(doc: np.ndarray, variant: str) -> np.ndarray:
    """The contract, read literally, with plain loops."""
    T = len(doc)
    m = np.zeros((T, T), dtype=bool)
    for i in range(T):
        for j in range(T):
            if doc[i] == -1:  # "padding slots attend only to themselves"
                m[i, j] = i == j
                continue
            if doc[j] == -1 or j > i:  # "never attended to by others"; causal
                continue
            if variant == "full":
                m[i, j] = True
            elif variant in ("intra_doc", "intra_doc_reset"):
                m[i, j] = doc[i] == doc[j]
            elif variant == "anchor":
                m[i, j] = doc[i] == doc[j] or j == 0
    return m


def brute_positions(doc: np.ndarray, variant: str, shift: int) -> np.ndarray:
    T = len(doc)
    pos = np.arange(T) + shift
    if variant == "intra_doc_reset":
        seen: dict[int, int] = {}
        for t in range(T):
            if doc[t] < 0:
                continue
            seen.setdefault(int(doc[t]), t)
            pos[t] = t - seen[int(doc[t])] + shift
    return pos


layouts = st.tuples(
    st.integers(1, 70),  # T
    st.lists(st.integers(1, 25), min_size=0, max_size=8),  # document lengths (1-token docs included)
    st.sampled_from(jaxref.VARIANTS),
    st.integers(0, 3000),  # shift
)


@settings(max_examples=150, deadline=None)
@given(layouts)
def test_mask_and_positions_match_the_contract(case):
    T, lengths, variant, shift = case
    doc = doc_ids_from_lengths(lengths, T, variant)
    np.testing.assert_array_equal(jaxref.attention_mask(doc, variant), brute_mask(doc, variant))
    np.testing.assert_array_equal(jaxref.positions(doc, variant, shift=shift), brute_positions(doc, variant, shift))


# The same mask from JAX arrays: each new length compiles JAX's operations again (150 examples took 40 s; the
# numpy masks above take 150).
@settings(max_examples=15, deadline=None)
@given(layouts)
def test_the_mask_of_jax_arrays_is_the_mask_of_numpy_arrays(case):
    T, lengths, variant, _ = case
    doc = doc_ids_from_lengths(lengths, T, variant)
    np.testing.assert_array_equal(np.asarray(jaxref.attention_mask(jaxref_jnp(doc), variant)), brute_mask(doc, variant))


def jaxref_jnp(doc):
    import jax.numpy as jnp

    return jnp.asarray(doc)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.lists(st.integers(1, 9), max_size=6)), min_size=1, max_size=3),
       st.sampled_from(jaxref.VARIANTS))
def test_batched_masks_equal_per_row_masks(rows, variant):
    T = max(t for t, _ in rows)
    docs = np.stack([doc_ids_from_lengths(lengths, T, variant) for _, lengths in rows])
    batched = jaxref.attention_mask(docs, variant)
    for b in range(len(rows)):
        np.testing.assert_array_equal(batched[b], brute_mask(docs[b], variant))
    np.testing.assert_array_equal(jaxref.positions(docs, variant), np.stack([brute_positions(d, variant, 0) for d in docs]))


def test_anchor_is_seen_by_every_document_and_documents_not_by_each_other():
    doc = doc_ids_from_lengths([5, 1, 7], 16, "anchor")  # anchor, docs of 5, 1 and 7 slots, 2 pads
    m = jaxref.attention_mask(doc, "anchor")
    real = np.flatnonzero(doc >= 0)
    assert m[real, 0].all()
    assert not m[np.flatnonzero(doc == 3)][:, np.flatnonzero(doc == 1)].any()
    assert not m[14, :14].any() and m[14, 14]  # padding sees only itself


def test_unknown_variant_is_an_input_error():
    with pytest.raises(InputError, match="unknown attention variant 'cross'"):
        jaxref.attention_mask(np.ones(4, np.int32), "cross")
