"""diagnose names the mistakes of ragged batches and paged caches (issue 47): each planted mistake is named by its
own code, first and alone (the confusion stays diagonal), and the right candidates agree."""

import json
from dataclasses import replace

import numpy as np
import pytest

from conftest import run_cli
from mha_rosetta.backends import get_backend
from mha_rosetta.core import MHAConfig, reference_mha
from mha_rosetta.core.ragged import RaggedBatch
from mha_rosetta.diagnose import DiagnoseError
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


# -- the command line: `mha-rosetta diagnose --ragged FORM` ---------------------------------------------------------
CANDIDATES = """
import numpy as np

from mha_rosetta.core import MHAConfig, reference_mha
from mha_rosetta.diagnose.ragged import paged_attention

CHUNKED = MHAConfig(d_model=15, n_heads=3, causal=True, rope="half", d_k=4, attention_chunk_size=3)
ENCODER = MHAConfig(d_model=15, n_heads=3, rope="half", d_k=4)


def packed(params, x, cu):
    return reference_mha(CHUNKED, params, x, cu_seqlens=cu)


def packed_one_row(params, x, cu):  # cu_seqlens ignored: the documents leak
    return reference_mha(CHUNKED, params, x)


def padded_as_full(params, x, seq_lens):  # every row run as if full: padding keys attended
    return reference_mha(ENCODER, params, x)


def paged_physical(q, k_pool, v_pool, table, seq_lens, scale):  # logical page j read from physical page j
    P = k_pool.shape[1]
    return paged_attention(q, k_pool, v_pool, [np.arange(-(-int(n) // P)) for n in seq_lens], seq_lens, scale)


def paged_hangs(q, k_pool, v_pool, table, seq_lens, scale):
    import time

    time.sleep(60)
"""
CHUNKED_SIZES = ("--d-model", "15", "--heads", "3", "--d-k", "4", "--rope", "half")


@pytest.mark.parametrize(
    ("form", "name", "options", "code"),
    [
        ("packed", "packed", (*CHUNKED_SIZES, "--attention-chunk-size", "3"), None),
        ("packed", "packed_one_row", (*CHUNKED_SIZES, "--attention-chunk-size", "3"), "packed_documents_leak"),
        ("padded", "padded_as_full", CHUNKED_SIZES, "padding_keys_attended"),
        ("paged", "paged_physical", (), "paged_physical_as_logical"),
    ],
)
def test_the_command_line_names_each_ragged_mistake(tmp_path, form, name, options, code):
    (tmp_path / "ragged_candidates.py").write_text(CANDIDATES, encoding="utf-8")
    done = run_cli("diagnose", "--ragged", form, f"ragged_candidates:{name}", *options, "--json", "-", cwd=tmp_path)
    assert done.returncode == (0 if code is None else 1), done.stderr
    payload = json.loads(done.stdout)
    assert payload["ragged"] == form and payload["agrees"] == (code is None)
    assert [cause["code"] for cause in payload["causes"]] == ([] if code is None else [code])
    assert f", {form}" in done.stderr  # the verdict's head names the form (stderr: the JSON takes stdout)
    if form == "packed":
        assert "causal" in payload["config"].split()  # --ragged packed implies --causal
    if form == "paged":
        assert payload["config"] is None  # the kernel's probe has its own sizes


def test_the_command_line_contains_a_paged_kernel_that_hangs(tmp_path):
    (tmp_path / "ragged_candidates.py").write_text(CANDIDATES, encoding="utf-8")
    done = run_cli("diagnose", "--ragged", "paged", "ragged_candidates:paged_hangs", "--timeout", "1", cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == (
        "mha-rosetta diagnose: error: the candidate did not return within 1 s on probe 'rows of 7, 1, 11 tokens' "
        "(time limit per probe)"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--ragged", "paged", "m:f", "--d-model", "12", "--window", "3"],
            "--ragged paged probes a decode kernel on its own sizes (H 4, Hkv 2, D 6, P 4); drop --d-model, --window",
        ),
        (
            ["--ragged", "packed", "--decode", "m:f", "--d-model", "12", "--heads", "3"],
            "--ragged and --decode are different candidates (a paged decode kernel is --ragged paged); give one",
        ),
        (["--ragged", "padded", "--confusion"], "--confusion is the forward's table; drop --ragged"),
    ],
)
def test_the_command_line_refuses_ragged_with_what_it_cannot_use(capsys, monkeypatch, argv, message):
    import sys

    from mha_rosetta.cli.main import main

    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts "" first (`python -m`'s rule): undone after
    assert main(["diagnose", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"mha-rosetta diagnose: error: {message}"


def test_a_candidates_wrong_shape_names_the_forms_axes():
    with pytest.raises(DiagnoseError, match=r"expected \(3, 4, 6\) \(B, H, Dv\)"):
        diagnose_paged(lambda q, k, v, table, lens, scale: np.zeros((3, 4)))
    with pytest.raises(DiagnoseError, match="NaN or inf everywhere on probe 'documents 5, 0, 3, 6'"):
        diagnose_packed(lambda params, x, cu: np.full(x.shape, np.nan), CFG)


def test_float32_arguments_are_scored_with_the_float32_tolerance():
    seen = []

    def candidate(params, x, cu):
        seen.append((params.w_q.dtype.name, x.dtype.name))
        return get_backend("numpy").run(CFG, params, x, cu_seqlens=cu, dtype="float32")

    result = diagnose_packed(candidate, CFG, dtype="float32")
    assert result.agrees and result.dtype == "float32" and set(seen) == {("float32", "float32")}
    assert result.max_error > 1e-9  # float32's rounding, within its tolerance (float64's would refuse it)
