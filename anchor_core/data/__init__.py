"""The data pipeline: readers, token store, mixtures, packing, batches and the loader.

    from anchor_core.data import iter_documents, build_store, select_documents, MixtureSpec
    from anchor_core.data import PackedData, Loader, make_batch, Variant, VARIANTS
    from anchor_core.data import pack_corpus, PackConfig, Layout, write_default_corpus

Heavy dependencies (tokenizers, pyarrow, datasets, matplotlib) are imported where used.
"""

from anchor_core.data.batch import VARIANTS, Batch, Variant, check_variant, make_batch, reset_positions
from anchor_core.data.corpus import default_corpus_documents, write_default_corpus
from anchor_core.data.mixture import MIXTURES, Mixture, MixtureSpec, mixture_table, select_documents
from anchor_core.data.packed import Loader, PackedData
from anchor_core.data.packing import Layout, Packer, interleave_block, tag_text, window_stats
from anchor_core.data.pipeline import PackConfig, pack_corpus
from anchor_core.data.readers import Document, ReadCounts, iter_documents
from anchor_core.data.store import TokenStore, build_store, is_store, write_store

__all__ = [
    "VARIANTS", "Batch", "Variant", "check_variant", "make_batch", "reset_positions",
    "default_corpus_documents", "write_default_corpus",
    "MIXTURES", "Mixture", "MixtureSpec", "mixture_table", "select_documents",
    "Loader", "PackedData",
    "Layout", "Packer", "interleave_block", "tag_text", "window_stats",
    "PackConfig", "pack_corpus",
    "Document", "ReadCounts", "iter_documents",
    "TokenStore", "build_store", "is_store", "write_store",
]
