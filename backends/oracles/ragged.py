"""Ragged batches in the oracles' own spellings, each converted from the one canonical `RaggedBatch`.

* FlexAttention: attention-gym's document mask, ``mask_mod = doc[q] == doc[kv]`` (and ``kv <= q``
  with causality), over a ``(1, H, T, D)`` packed row, made by ``create_block_mask``;
* ``jax.nn.dot_product_attention``: a right-padded ``(B, N, H, D)`` batch with
  ``query_seq_lengths`` and ``key_value_seq_lengths``;
* torch's ``PagedAttention`` (``torch.nn.attention.experimental._paged_attention``) with FlexAttention:
  the keys written into its ``(1, Hkv, pages * P, D)`` pool through the canonical `PagedLayout`'s block
  table (its page table and physical-to-logical map set from it, so the pages sit in the layout's
  shuffled physical order), the logical block mask converted by ``convert_logical_block_mask``. It
  runs on the CPU, eagerly (FlexAttention unfused, as `flex._eager_flex` calls it; tried with torch 2.13);
  the block mask's key block must equal the page size (its own rule);
* Hugging Face: packed rows read from ``position_ids`` alone (``masking_utils.find_packed_sequence_indices``:
  a step other than +1 starts a document), the mask ``create_causal_mask`` builds from them without an
  attention mask, for the eager (additive float) and sdpa (boolean) implementations.

Each takes the spec's own rotated heads (float64 NumPy, `core.reference_stages` layout) and returns
the context ``(B, H, N, Dv)``, so a test compares the library's rule for raggedness, and nothing else,
with the spec's (`tests/test_ragged_oracles.py`).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core.paged import PagedLayout
from mha_rosetta.core.ragged import RaggedBatch

from .flex import _eager_flex


def flex_document_context(q, k, v, batch: RaggedBatch, *, causal: bool, scale: float) -> np.ndarray:
    """q (1, H, T, Dk), k (1, Hkv, T, Dk), v (1, Hkv, T, Dv) packed -> context (1, H, T, Dv), FlexAttention's document mask."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.from_numpy(batch.document_ids())  # (T,): the document of each packed token

    def document_mask(b, h, q_idx, kv_idx):  # attention-gym's generate_doc_mask_mod, with causality inside
        same = doc[q_idx] == doc[kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    T = batch.total
    block_mask = create_block_mask(document_mask, None, None, T, T, device="cpu")
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    out = _eager_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.numpy()


def jax_dpa_lengths_context(q, k, v, seq_lens, *, causal: bool, scale: float) -> np.ndarray:
    """q (B, H, N, Dk), k (B, Hkv, N, Dk), v (B, Hkv, N, Dv) right-padded -> context (B, H, N, Dv) (float32) from
    ``jax.nn.dot_product_attention(..., query_seq_lengths=seq_lens, key_value_seq_lengths=seq_lens)``."""
    import jax
    import jax.numpy as jnp

    lengths = jnp.asarray(RaggedBatch.from_seq_lens(seq_lens, q.shape[2]).lengths, dtype=jnp.int32)  # (B,)
    q, k, v = (jnp.asarray(np.swapaxes(a, 1, 2), dtype=jnp.float32) for a in (q, k, v))  # (B, N, H, D) copies
    out = jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=causal, query_seq_lengths=lengths, key_value_seq_lengths=lengths
    )
    return np.swapaxes(np.asarray(out), 1, 2)  # (B, H, N, Dv) view of the copy


def torch_paged_flex_context(q, k, v, layout: PagedLayout, *, causal: bool, scale: float) -> np.ndarray:
    """q (B, H, N, Dk), k (B, Hkv, N, Dk), v (B, Hkv, N, Dv) right-padded to ``layout.seq_lens`` -> context
    (B, H, N, Dv) from torch's ``PagedAttention`` and FlexAttention, the keys read from pages placed as ``layout``
    says (a padding query row: the spec's zero context where no key is allowed)."""
    import torch
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    B, Hkv, N, Dk = k.shape
    P, n_pages = layout.page_size, layout.n_pages
    paged = PagedAttention(n_pages, P, B, device="cpu")
    used = layout.pages_per_row
    for b in range(B):  # torch's page table and physical->logical map, from the canonical block table
        pages = torch.from_numpy(layout.block_table[b, : used[b]].copy())
        paged.page_table[b, : used[b]] = pages
        paged.physical_to_logical[b, pages] = torch.arange(int(used[b]))
        paged.capacity[b] = int(used[b]) * P
    paged.empty_pages = sorted(set(range(n_pages)) - set(layout.block_table[layout.block_table >= 0].tolist()))
    q, k, v = (torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v))
    k_pool = k.new_zeros((1, Hkv, n_pages * P, Dk))  # (1, Hkv, pages*P, Dk): PagedAttention's pool
    v_pool = v.new_zeros((1, Hkv, n_pages * P, v.shape[-1]))
    lengths = torch.from_numpy(layout.seq_lens.copy())  # (B,)
    for b in range(B):
        L = int(lengths[b])
        if L:
            rows = (slice(b, b + 1), slice(None), slice(0, L))  # row b's real tokens, (1, Hkv, L, D) views
            paged.assign(torch.tensor([b]), torch.arange(L)[None], k[rows], v[rows], k_pool, v_pool)

    def logical_mask(b, h, q_idx, kv_idx):  # on logical token indices: lengths, and causality inside them
        inside = (kv_idx < lengths[b]) & (q_idx < lengths[b])
        return inside & (kv_idx <= q_idx) if causal else inside

    logical = create_block_mask(logical_mask, B, None, N, N, device="cpu", BLOCK_SIZE=(P, P))
    physical = paged.convert_logical_block_mask(logical, kv_len=lengths)
    out = _eager_flex(q, k_pool, v_pool, block_mask=physical, scale=scale, enable_gqa=Hkv != q.shape[1])
    return out.numpy()


def hf_packed_allowed(batch: RaggedBatch, attn_implementation: str = "sdpa") -> np.ndarray:
    """(T, T) bool: the mask transformers' ``create_causal_mask`` builds for one packed row from its ``position_ids``
    (`RaggedBatch.position_ids`, drop_empty: an empty document leaves no trace there), no attention mask given."""
    import torch
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, vocab_size=2)
    config._attn_implementation = attn_implementation  # how the model's layers would call attention
    T = batch.total
    position_ids = torch.from_numpy(batch.position_ids(drop_empty=True))[None]  # (1, T): HF's packed spelling
    mask = create_causal_mask(
        config=config,
        inputs_embeds=torch.zeros(1, T, 8),
        attention_mask=None,
        cache=None,
        position_ids=position_ids,
        allow_is_causal_skip=False,  # the mask itself, never None for "plain causal"
    )  # (1, 1, T, T): bool (sdpa) or additive float, 0 where allowed (eager)
    allowed = mask if mask.dtype == torch.bool else mask == 0
    return allowed[0, 0].numpy()
