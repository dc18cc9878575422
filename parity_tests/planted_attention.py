"""Users' attention functions for `anchor parity --attention` (parity_tests/test_hf_stack.py): one correct,
and one per planted defect, each of which the harness must catch and localise.

They apply RoPE themselves (`rope_in="attention"`: q and k arrive unrotated), as the paper's recipe needs
in transformers (RoPE in fp32 before q and k are cast to bf16), and implement the variant's mask from the
`doc_ids` and `variant` keywords (docs/DESIGN.md §2). Plain torch: nothing of this repository, as a
user's module would be. Default RoPE only (`rope_type` "default").

    anchor parity --stack hf --attention parity_tests.planted_attention:correct --rope-in attention ...

Legend: B windows, T slots, N/K query/kv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inv_freq(module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """theta_i = base^(-2i/D) as transformers' default RoPE computes it (float32), then cast to `dtype`."""
    params = module.config.rope_parameters
    if params.get("rope_type", "default") != "default":
        raise NotImplementedError(f"these example functions implement default RoPE, not {params['rope_type']!r}")
    D = module.head_dim
    freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    return freq.to(dtype)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor,
         table_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,N,T,D], k [B,K,T,D] rotated at positions [B,T]: angles in fp32, tables in `table_dtype`, the
    rotation in fp32, the result cast back to q's dtype (the paper's recipe)."""
    angles = positions[..., None].float() * freq.float()  # [B,T,D/2]
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # [B,1,T,D]
    cos, sin = emb.cos().to(table_dtype).float(), emb.sin().to(table_dtype).float()

    def apply(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * cos + _rotate_half(x32) * sin).to(x.dtype)

    return apply(q), apply(k)


def variant_mask(doc_ids: torch.Tensor, variant: str, documents: bool = True) -> torch.Tensor:
    """bool [B,1,T,T]: query i sees key j iff i == j, or j <= i, both real and the variant's rule holds.
    documents=False leaves the documents out (every variant becomes causal attention over the window)."""
    T = doc_ids.shape[1]
    i = torch.arange(T, device=doc_ids.device)[:, None]
    j = torch.arange(T, device=doc_ids.device)[None, :]
    dq, dk = doc_ids[:, :, None], doc_ids[:, None, :]
    real = (dq >= 0) & (dk >= 0)
    if variant == "full" or not documents:
        rule = torch.ones_like(real)
    elif variant in ("intra_doc", "intra_doc_reset"):
        rule = dq == dk
    elif variant == "anchor":
        rule = (dq == dk) | (j == 0)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return ((i == j) | ((j <= i) & real & rule))[:, None]


def _attention(module, query, key, value, *, doc_ids, variant, position_ids, scaling, record_qk=None,
               freq_dtype=torch.float32, table_dtype=torch.float32, reset=True, documents=True):
    """The shared body: RoPE at the variant's positions, the mask, SDPA; out [B,T,N,D]."""
    positions = position_ids if reset else torch.arange(query.shape[2], device=query.device).expand_as(position_ids)
    q, k = rope(query, key, positions, inv_freq(module, freq_dtype), table_dtype)
    if record_qk is not None:
        record_qk(q, k)
    mask = variant_mask(doc_ids, variant, documents)
    out = F.scaled_dot_product_attention(q, k, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).contiguous(), None


def correct(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The variant as docs/DESIGN.md §2 and §3 define it, RoPE in fp32."""
    return _attention(module, query, key, value, doc_ids=kwargs["doc_ids"], variant=kwargs["variant"],
                      position_ids=kwargs["position_ids"], scaling=scaling, record_qk=kwargs.get("record_qk"))


def bf16_tables(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Defect: the cos/sin tables are rounded to bfloat16 before the rotation."""
    return _attention(module, query, key, value, doc_ids=kwargs["doc_ids"], variant=kwargs["variant"],
                      position_ids=kwargs["position_ids"], scaling=scaling, record_qk=kwargs.get("record_qk"),
                      table_dtype=torch.bfloat16)


def inv_freq_bf16(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Defect: inv_freq in bfloat16 (what `model.to(torch.bfloat16)` does to transformers' buffer):
    angles drift with the position."""
    return _attention(module, query, key, value, doc_ids=kwargs["doc_ids"], variant=kwargs["variant"],
                      position_ids=kwargs["position_ids"], scaling=scaling, record_qk=kwargs.get("record_qk"),
                      freq_dtype=torch.bfloat16)


def no_document_mask(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Defect: causal attention over the whole window, the documents ignored."""
    return _attention(module, query, key, value, doc_ids=kwargs["doc_ids"], variant=kwargs["variant"],
                      position_ids=kwargs["position_ids"], scaling=scaling, record_qk=kwargs.get("record_qk"),
                      documents=False)


def positions_not_reset(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Defect: rotates at the slot index, so `intra_doc_reset`'s positions are never reset."""
    return _attention(module, query, key, value, doc_ids=kwargs["doc_ids"], variant=kwargs["variant"],
                      position_ids=kwargs["position_ids"], scaling=scaling, record_qk=kwargs.get("record_qk"),
                      reset=False)


def mask_only(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A function in transformers' convention (`rope_in="model"`: q and k arrive rotated): the variant's
    mask and SDPA, nothing else."""
    mask = variant_mask(kwargs["doc_ids"], kwargs["variant"])
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None
