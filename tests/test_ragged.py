"""The canonical ragged batch and paged layout: every spelling round-trips exactly; bad input is named."""

import numpy as np
import pytest

from mha_rosetta.core.paged import PAD, PagedLayout, pages_needed
from mha_rosetta.core.ragged import RaggedBatch, pack_rows, unpack_rows

# Distinct lengths with a zero-length and a one-token document.
LENGTHS = [3, 0, 1, 5, 2]


def test_hand_computed_spellings():
    batch = RaggedBatch(LENGTHS)
    assert batch.total == 11 and batch.batch == 5 and batch.max_len == 5
    assert batch.cu_seqlens().tolist() == [0, 3, 3, 4, 9, 11]
    assert batch.document_ids().tolist() == [0, 0, 0, 2, 3, 3, 3, 3, 3, 4, 4]
    assert batch.position_ids(drop_empty=True).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1]
    mask = RaggedBatch([2, 1]).document_mask()
    assert mask.tolist() == [[True, True, False], [True, True, False], [False, False, True]]
    assert batch.padding_mask(6)[3].tolist() == [True] * 5 + [False]
    assert not batch.padding_mask(6)[1].any()


@pytest.mark.parametrize("lengths", [LENGTHS, [1, 1, 1], [4], [], [0, 0], [2, 7, 1, 3]])
def test_round_trips(lengths):
    batch = RaggedBatch(lengths)
    cu = batch.cu_seqlens()
    assert RaggedBatch.from_cu_seqlens(cu, total=batch.total) == batch
    assert np.array_equal(RaggedBatch.from_cu_seqlens(cu).cu_seqlens(), cu)
    tokens = max(batch.max_len, 1) + 2
    assert RaggedBatch.from_padding_mask(batch.padding_mask(tokens)) == batch
    assert RaggedBatch.from_seq_lens(batch.lengths, tokens) == batch
    nonempty = RaggedBatch(batch.lengths[batch.lengths > 0])
    pos = batch.position_ids(drop_empty=True)
    assert RaggedBatch.from_position_ids(pos) == nonempty
    assert np.array_equal(RaggedBatch.from_position_ids(pos[None]).position_ids(), pos)  # HF's (1, T)
    mask = batch.document_mask(drop_empty=True)
    assert RaggedBatch.from_document_mask(mask) == nonempty
    assert np.array_equal(RaggedBatch.from_document_mask(mask).document_mask(), mask)


def test_position_ids_follow_hugging_face_rule():
    # Any step other than +1 opens a document, also a document that does not start at 0.
    assert RaggedBatch.from_position_ids([5, 6, 7, 0, 1, 3, 4, 4]).lengths.tolist() == [3, 2, 2, 1]


def test_zero_length_documents_are_refused_where_they_would_vanish():
    batch = RaggedBatch(LENGTHS)
    with pytest.raises(ValueError, match=r"zero-length document \(documents \[1\]"):
        batch.position_ids()
    with pytest.raises(ValueError, match="block-diagonal mask cannot hold a zero-length"):
        batch.document_mask()


def test_pack_and_unpack_rows():
    batch = RaggedBatch(LENGTHS)
    packed = np.arange(batch.total * 2, dtype=np.float64).reshape(batch.total, 2)
    padded = unpack_rows(batch, packed, tokens=6, fill=np.nan)
    assert padded.shape == (5, 6, 2)
    assert np.array_equal(padded[3, :5], packed[4:9]) and np.isnan(padded[3, 5]).all() and np.isnan(padded[1]).all()
    assert np.array_equal(pack_rows(batch, padded), packed)


@pytest.mark.parametrize(
    ("cu", "total", "match"),
    [
        ([0, 3, 2, 5], None, r"non-decreasing .* cu_seqlens\[2\]=2 < cu_seqlens\[1\]=3"),
        ([0, 3, 5], 6, r"cu_seqlens\[-1\] must equal T=6 .* got 5"),
        ([1, 3], None, r"cu_seqlens\[0\] must be 0"),
        ([], None, "at least one entry"),
        ([[0, 2]], None, "one-dimensional"),
    ],
)
def test_bad_cu_seqlens(cu, total, match):
    with pytest.raises(ValueError, match=match):
        RaggedBatch.from_cu_seqlens(np.array(cu, dtype=np.int64), total=total)


def test_bad_lengths_and_masks():
    with pytest.raises(TypeError, match="cu_seqlens must hold integers"):
        RaggedBatch.from_cu_seqlens([0.0, 2.0])
    with pytest.raises(ValueError, match=r"lengths must be >= 0 .* lengths\[1\]=-1"):
        RaggedBatch([2, -1])
    with pytest.raises(ValueError, match=r"seq_lens must be <= N=4 .* seq_lens\[1\]=5"):
        RaggedBatch.from_seq_lens([2, 5], 4)
    with pytest.raises(ValueError, match=r"seq_lens must be <= N=4"):
        RaggedBatch([2, 5]).padding_mask(4)
    with pytest.raises(ValueError, match="row 0 is not right padding"):
        RaggedBatch.from_padding_mask(np.array([[False, True, True]]))
    leaky = RaggedBatch([2, 2]).document_mask()
    leaky[3, 0] = True  # a document that sees into the one before it
    with pytest.raises(ValueError, match=r"block-diagonal .* entry \[3, 0\]=True"):
        RaggedBatch.from_document_mask(leaky)


def test_paged_layout_hand_computed():
    table = np.array([[4, 1, PAD], [PAD, PAD, PAD], [0, 3, 2]])
    layout = PagedLayout(table, np.array([5, 0, 9]), page_size=4, n_pages=6)
    indptr, indices, last = layout.flashinfer()
    assert indptr.tolist() == [0, 2, 2, 5]
    assert indices.tolist() == [4, 1, 0, 3, 2]
    assert last.tolist() == [1, 0, 1]
    # Row 0 token 4 is logical page 1, offset 0 -> physical page 1 -> slot 4; row 2 token 6 -> page 3, offset 2.
    slots = layout.slot_mapping()
    assert slots.tolist()[:5] == [16, 17, 18, 19, 4] and slots[5 + 6] == 3 * 4 + 2


@pytest.mark.parametrize("lengths", [LENGTHS, [8, 4, 1], [0], [13]])
@pytest.mark.parametrize("page_size", [1, 4, 5])
def test_paged_round_trips(lengths, page_size):
    batch = RaggedBatch(lengths)
    layout = PagedLayout.assign(batch, page_size, n_pages=int(pages_needed(lengths, page_size).sum()) + 3, seed=7)
    assert layout.ragged == batch
    again = PagedLayout(layout.block_table, layout.seq_lens, page_size, layout.n_pages)
    assert again == layout
    fi = layout.flashinfer()
    assert PagedLayout.from_flashinfer(*fi, page_size=page_size, n_pages=layout.n_pages) == layout
    keys = np.random.default_rng(0).standard_normal((batch.total, 3, 2))  # (T, Hkv, D)
    for pool_layout in ("NHD", "HND"):
        pool = layout.scatter(keys, pool_layout)
        expect = (layout.n_pages, page_size, 3, 2) if pool_layout == "NHD" else (layout.n_pages, 3, page_size, 2)
        assert pool.shape == expect
        assert np.array_equal(layout.gather(pool, pool_layout), keys)


def test_assign_shuffles_pages_by_seed():
    batch = RaggedBatch([16, 16])
    a, b = PagedLayout.assign(batch, 4, seed=1), PagedLayout.assign(batch, 4, seed=2)
    assert sorted(a.block_table.ravel().tolist()) == list(range(8))
    assert a.block_table.ravel().tolist() != list(range(8))  # not the identity: physical != logical
    assert a == PagedLayout.assign(batch, 4, seed=1) and a != b


@pytest.mark.parametrize(
    ("table", "seq_lens", "page_size", "n_pages", "match"),
    [
        ([[0, 1]], [8], 0, 2, "page_size must be a positive int"),
        ([[0, 1]], [8], -4, 2, "page_size must be a positive int"),
        ([[0, 2]], [8], 4, 2, r"block_table\[0, 1\]=2 points outside the pool of 2 pages"),
        ([[0, -1]], [8], 4, 2, r"block_table\[0, 1\]=-1 points outside the pool"),
        ([[0, 1], [1, PAD]], [8, 3], 4, 3, r"points at page 1 more than once, at \[\(0, 1\), \(1, 0\)\]"),
        ([[0]], [8], 4, 2, r"seq_lens\[0\]=8 needs 2 pages of 4, but block_table has 1 columns"),
        ([[0, 1]], [4], 4, 2, r"block_table\[0, 1\]=1 lies past row 0's 1 pages"),
    ],
)
def test_bad_block_tables(table, seq_lens, page_size, n_pages, match):
    with pytest.raises(ValueError, match=match):
        PagedLayout(np.array(table), np.array(seq_lens), page_size, n_pages)


def test_bad_flashinfer_last_page_len():
    indptr, indices = np.array([0, 2]), np.array([1, 0])
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] must be in 1..4 \(page_size\), got 5"):
        PagedLayout.from_flashinfer(indptr, indices, np.array([5]), page_size=4, n_pages=2)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[0\] must be in 1..4 \(page_size\), got 0"):
        PagedLayout.from_flashinfer(indptr, indices, np.array([0]), page_size=4, n_pages=2)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\] must be 0 \(the row has no page\)"):
        PagedLayout.from_flashinfer(np.array([0, 2, 2]), indices, np.array([3, 1]), page_size=4, n_pages=2)
    with pytest.raises(ValueError, match="n_pages=2 is too small"):
        PagedLayout.assign(RaggedBatch([9]), 4, n_pages=2)
