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


@pytest.mark.parametrize(("lengths", "prefill", "step"), [((5, 0, 1, 9), 3, 2), ((2, 7, 4), 1, 1)])
def test_hugging_face_paged_forward_decodes_a_ragged_batch_as_the_spec(lengths, prefill, step):
    # transformers' continuous batching on the CPU: its PagedAttentionCache, its allocator's block tables and slots,
    # LlamaAttention with the "paged|eager" forward; every request's tokens packed into each call at their own
    # positions. It equals the spec's packed causal forward (each document alone), float32-accurate (its softmax).
    pytest.importorskip(
        "transformers", reason="Hugging Face's paged cache and forward need transformers (models extra)"
    )
    from mha_rosetta.backends.oracles.hf_paged import hf_paged_decode
    from mha_rosetta.core import assert_close, reference_stages

    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", bias=False)
    params = init_params(cfg, seed=0)
    batch = RaggedBatch(lengths)
    x = np.random.default_rng(1).standard_normal((batch.total, cfg.d_model))  # (T, D) packed
    expected = reference_mha(cfg, params, x, cu_seqlens=batch.cu_seqlens())
    out, layout, k_pages = hf_paged_decode(cfg, params, x, batch, prefill=prefill, step=step, page_size=4)
    assert_close(out, expected, "float32", what="Hugging Face's paged forward against the packed spec")
    # Its block tables, read back as the canonical layout: each request's pages, in its logical order.
    assert layout.seq_lens.tolist() == list(lengths) and layout.pages_per_row.tolist() == [-(-n // 4) for n in lengths]
    stages = reference_stages(cfg, params, x[None], positions=batch.position_ids(drop_empty=True)[None])
    keys = stages["k_rotated"][0].transpose(1, 0, 2)  # (T, Hkv, Dk): each token's key at its own position
    assert_close(layout.gather(k_pages), keys, "float32", what="the library's pages read through its block table")
    leaked = hf_paged_decode(cfg, params, x, RaggedBatch([batch.total]), prefill=prefill, step=step, page_size=4)[0]
    assert not np.allclose(leaked, expected, atol=1e-3)  # one document of them all: the requests' separation shows


def test_hugging_face_paged_decode_refuses_what_it_cannot_drive():
    from mha_rosetta.backends import UnsupportedCase
    from mha_rosetta.backends.oracles.hf_paged import hf_paged_decode

    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", bias=False)
    params, batch = init_params(cfg, seed=0), RaggedBatch([3, 2])
    x = np.zeros((5, 16))
    with pytest.raises(ValueError, match=r"prefill must be an int >= 1 .* got 0"):
        hf_paged_decode(cfg, params, x, batch, prefill=0)
    with pytest.raises(ValueError, match=r"x must have shape \(T=5, d_model=16\), got \(4, 16\)"):
        hf_paged_decode(cfg, params, x[:4], batch, prefill=1)
    windowed = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", bias=False, window=3)
    with pytest.raises(UnsupportedCase, match="full causal attention; got window=3"):
        hf_paged_decode(windowed, init_params(windowed, seed=0), x, batch, prefill=1)
