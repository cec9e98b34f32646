"""The oracles' own spellings of a ragged batch, converted from RaggedBatch, against the spec."""

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha
from mha_rosetta.core.ragged import RaggedBatch

CFG = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half")
LENGTHS = [4, 0, 1, 6, 2]  # a zero-length and a one-token document


def _stages(**ragged):
    params = init_params(CFG, seed=3)
    rng = np.random.default_rng(4)
    if "cu_seqlens" in ragged:
        x = rng.standard_normal((1, 13, CFG.d_model))
    else:
        x = rng.standard_normal((len(ragged["seq_lens"]), 7, CFG.d_model))
    _, stages = reference_mha(CFG, params, x, return_stages=True, **ragged)
    return stages


def test_flex_document_mask_equals_the_packed_spec():
    pytest.importorskip("torch")
    from mha_rosetta.backends.oracles.ragged import flex_document_context

    batch = RaggedBatch(LENGTHS)
    s = _stages(cu_seqlens=batch.cu_seqlens())
    context = flex_document_context(s["q_rotated"], s["k_rotated"], s["v_heads"], batch, causal=True, scale=CFG.scale)
    assert_close(context, s["context"], "float64", what="FlexAttention document mask")


def test_jax_dpa_sequence_lengths_equal_the_padded_spec():
    pytest.importorskip("jax")
    from mha_rosetta.backends.oracles.ragged import jax_dpa_lengths_context

    seq_lens = [5, 0, 1, 7]  # a zero-length row and a one-token row
    s = _stages(seq_lens=seq_lens)
    context = jax_dpa_lengths_context(
        s["q_rotated"], s["k_rotated"], s["v_heads"], seq_lens, causal=True, scale=CFG.scale
    )
    assert_close(context, s["context"], "float32", what="jax.nn.dot_product_attention with sequence lengths")
    # Padding query rows and the empty row: zero context in the spec, and exactly zero in jax too (jax 0.10.2).
    padded = ~RaggedBatch(seq_lens).padding_mask(7)  # (B, N)
    assert np.all(context.transpose(0, 2, 1, 3)[padded] == 0)


@pytest.mark.parametrize(("page_size", "seed"), [(2, 0), (4, 5)])
def test_torch_paged_attention_with_flex_equals_the_padded_spec(page_size, seed):
    pytest.importorskip("torch", reason="torch's PagedAttention and FlexAttention need torch")
    from mha_rosetta.backends.oracles.ragged import torch_paged_flex_context
    from mha_rosetta.core.paged import PagedLayout

    seq_lens = [5, 0, 1, 7]  # a zero-length row, a one-token row, and rows across pages
    s = _stages(seq_lens=seq_lens)
    layout = PagedLayout.assign(RaggedBatch(seq_lens), page_size, n_pages=9, seed=seed)  # shuffled, spare pages
    assert (layout.block_table[layout.block_table >= 0] != np.arange((layout.block_table >= 0).sum())).any()
    context = torch_paged_flex_context(
        s["q_rotated"], s["k_rotated"], s["v_heads"], layout, causal=True, scale=CFG.scale
    )
    real = RaggedBatch(seq_lens).padding_mask(7)  # (B, N): the real query rows
    assert_close(context.transpose(0, 2, 1, 3)[real], s["context"].transpose(0, 2, 1, 3)[real], "float64",
                 what="torch PagedAttention + FlexAttention")  # fmt: skip


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("lengths", [LENGTHS, [1, 1, 3], [9]])
def test_hugging_face_reads_the_same_documents_from_position_ids(implementation, lengths):
    pytest.importorskip("transformers", reason="Hugging Face's packed masks need transformers (the models extra)")
    from mha_rosetta.backends.oracles.ragged import hf_packed_allowed

    batch = RaggedBatch(lengths)
    expected = batch.document_mask(drop_empty=True) & np.tril(np.ones((batch.total, batch.total), dtype=bool))
    np.testing.assert_array_equal(hf_packed_allowed(batch, implementation), expected)
    # and the spec reads HF's spelling back into the same documents (the empty one leaves no trace)
    again = RaggedBatch.from_position_ids(batch.position_ids(drop_empty=True))
    assert again.lengths.tolist() == [n for n in lengths if n]
