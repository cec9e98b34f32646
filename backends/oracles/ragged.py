"""Ragged batches in the oracles' own spellings, each converted from the one canonical `RaggedBatch`.

* FlexAttention: attention-gym's document mask, ``mask_mod = doc[q] == doc[kv]`` (and ``kv <= q``
  with causality), over a ``(1, H, T, D)`` packed row, made by ``create_block_mask``;
* ``jax.nn.dot_product_attention``: a right-padded ``(B, N, H, D)`` batch with
  ``query_seq_lengths`` and ``key_value_seq_lengths``.

Each takes the spec's own rotated heads (float64 NumPy, `core.reference_stages` layout) and returns
the context ``(B, H, N, Dv)``, so a test compares the library's rule for raggedness, and nothing else,
with the spec's (`tests/test_ragged_oracles.py`).
"""

from __future__ import annotations

import numpy as np

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
