"""diagnose names the mistakes of ragged batches and paged caches (issue 47): each planted mistake is named by its
own code, first and alone (the confusion stays diagonal), and the right candidates agree."""

from dataclasses import replace

import numpy as np
import pytest

from mha_rosetta.backends import get_backend
from mha_rosetta.core import MHAConfig, reference_mha
from mha_rosetta.core.ragged import RaggedBatch
from mha_rosetta.diagnose.ragged import RAGGED_CAUSE_CODES, diagnose_packed, diagnose_padded, diagnose_paged

# Llama 4's chunks read absolute positions: restarting them shows (rotary alone is relative, an offset cancels).
CFG = MHAConfig(d_model=15, n_heads=3, causal=True, rope="half", d_k=4, attention_chunk_size=3)
ENCODER = MHAConfig(d_model=15, n_heads=3, rope="half", d_k=4)  # bidirectional: right padding is in every softmax


def _doc_mask(cu):
    return RaggedBatch.from_cu_seqlens(cu).document_mask(drop_empty=True)  # (T, T)


def _attend_pages(q, k_pool, v_pool, table, seq_lens, scale, *, page_of, length_of):
    """A hand-written paged decode kernel, vLLM's loop: row b's token t in page ``page_of(b, t // P)``."""
    B, H, _ = q.shape
    P, Hkv = k_pool.shape[1], k_pool.shape[2]
    out = np.zeros((B, H, v_pool.shape[-1]))
    for b in range(B):
        for h in range(H):
            tokens = range(length_of(b))
            keys = np.array([k_pool[page_of(b, t // P), t % P, h // (H // Hkv)] for t in tokens]).reshape(
                -1, q.shape[2]
            )
            values = np.array([v_pool[page_of(b, t // P), t % P, h // (H // Hkv)] for t in tokens])
            if len(keys):
                s = keys @ q[b, h] * scale
                w = np.exp(s - s.max())
                out[b, h] = w @ values.reshape(len(keys), -1) / w.sum()
    return out


def _paged(mistake=None):
    def candidate(q, k_pool, v_pool, table, seq_lens, scale):
        def page_of(b, j):
            return j if mistake == "physical" else table[b, j]

        def length_of(b):
            return int(seq_lens[b]) + (1 if mistake == "past" else -1 if mistake == "short" else 0)

        return _attend_pages(q, k_pool, v_pool, table, seq_lens, scale, page_of=page_of, length_of=length_of)

    return candidate


PLANTED = {
    "packed_documents_leak": lambda: diagnose_packed(lambda params, x, cu: reference_mha(CFG, params, x), CFG),
    "packed_positions_not_restarting": lambda: diagnose_packed(
        lambda params, x, cu: reference_mha(CFG, params, x, mask=_doc_mask(cu)), CFG
    ),
    "padding_keys_attended": lambda: diagnose_padded(
        lambda params, x, seq_lens: reference_mha(ENCODER, params, x), ENCODER
    ),
    "paged_physical_as_logical": lambda: diagnose_paged(_paged("physical")),
    "paged_last_page_off_by_one": lambda: diagnose_paged(_paged("past")),
}


@pytest.mark.parametrize("code", RAGGED_CAUSE_CODES)
def test_each_planted_mistake_is_named_by_its_own_code_alone(code):
    result = PLANTED[code]()
    assert not result.agrees
    assert [cause.code for cause in result.causes] == [code], result.summary()
    assert result.causes[0].residual <= 1.0 and result.causes[0].fix


def test_the_last_page_one_short_is_the_same_code_with_its_own_detail():
    result = diagnose_paged(_paged("short"))
    assert [(c.code, "newest key dropped" in c.detail) for c in result.causes] == [("paged_last_page_off_by_one", True)]


def test_the_positions_restarting_under_a_row_wide_causal_mask_is_a_leak():
    def candidate(params, x, cu):  # HF position_ids given, flash-attn without varlen: one causal row
        pos = RaggedBatch.from_cu_seqlens(cu).position_ids(drop_empty=True)
        row = np.tril(np.ones((len(x), len(x)), dtype=bool))
        one_row = replace(CFG, causal=False)  # the row-wide causal mask given as is; chunks on the restarting positions
        return reference_mha(one_row, params, x, mask=row, positions=pos)

    result = diagnose_packed(candidate, CFG)
    assert [c.code for c in result.causes] == ["packed_documents_leak"]
    assert "restart per document" in result.causes[0].detail


def test_right_candidates_agree():
    numpy = get_backend("numpy")
    assert diagnose_packed(lambda params, x, cu: numpy.run(CFG, params, x, cu_seqlens=cu), CFG).agrees
    padded = diagnose_padded(lambda params, x, lens: numpy.run(ENCODER, params, x, seq_lens=lens), ENCODER)
    assert padded.agrees and padded.causes == [] and padded.notes == []
    causal = diagnose_padded(lambda params, x, lens: reference_mha(CFG, params, x), CFG)
    assert causal.agrees and "invisible" in causal.notes[0]  # said, not silently passed
    assert diagnose_paged(_paged()).agrees


def test_without_chunks_the_positions_mistake_is_said_to_be_invisible():
    plain = MHAConfig(d_model=15, n_heads=3, causal=True, rope="half", d_k=4)  # rotary: relative, the offset cancels
    result = diagnose_packed(lambda params, x, cu: reference_mha(plain, params, x, mask=_doc_mask(cu)), plain)
    assert result.agrees and "invisible" in result.notes[0]


def test_bad_arguments_name_the_rule():
    with pytest.raises(TypeError, match="candidate must be callable, got int"):
        diagnose_paged(3)
    with pytest.raises(ValueError, match="cfg must be a causal MHAConfig"):
        diagnose_packed(lambda *a: None, MHAConfig(d_model=15, n_heads=3))
