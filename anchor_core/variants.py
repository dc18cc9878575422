"""The closed set of attention variants (docs/DESIGN.md §2), named in one place (the attention engines' names:
`anchor_core.engines`).

The rules each variant stands for are implemented independently by the oracle
(`jaxref.variants`), the trainer (`torchtrain.attention.variants`) and the batch maker (`anchor_core.data.batch`),
so the parity suite compares two readings of the same rules (docs/DESIGN.md §2); only the names are shared.
"""

from __future__ import annotations

from typing import Literal, get_args

from anchor_core.errors import InputError

Variant = Literal["full", "intra_doc", "intra_doc_reset", "anchor"]
VARIANTS: tuple[str, ...] = get_args(Variant)


def check_variant(variant: object) -> Variant:
    """`variant` if it is one of VARIANTS, else an InputError listing them."""
    if variant not in VARIANTS:
        raise InputError(f"unknown attention variant {variant!r} (known: {', '.join(VARIANTS)})")
    return variant  # type: ignore[return-value]
