"""Name the mistakes of ragged batches and paged caches (issue 47): `diagnose_packed`, `diagnose_padded`, `diagnose_paged`.

Each takes a candidate in the form the mistake lives in, runs it on designed probes, compares it with
the float64 spec, and scores every hypothesis (the same call with one mistake made, simulated in NumPy)
by the candidate's worst distance from it in tolerances of the candidate's dtype: a `Diagnosis` whose
causes are the hypotheses within one tolerance, best first.

``diagnose_packed(candidate, cfg)``: ``candidate(params, x (T, d_model), cu_seqlens (B+1,)) -> (T, d_model)``.

- ``packed_documents_leak``: the documents attend into each other. Simulated twice: the packed row run
  as one causal sequence (``cu_seqlens`` ignored), and the positions restarting per document (rotary
  right, as Hugging Face's ``position_ids`` give them) under a causal mask over the whole row;
- ``packed_positions_not_restarting``: the document mask right, the positions ``0 .. T-1`` along the
  row (chunks and rotary read the row's index, not the token's place in its document). Rotary alone
  does not show it: its scores depend on ``p_j - p_i`` only, and a constant offset within a document
  cancels (measured: 4e-16 apart in float64). Llama 4's chunks read absolute positions and show it;
  without them the result says so in a note.

``diagnose_padded(candidate, cfg)``: ``candidate(params, x (B, N, d_model), seq_lens (B,)) -> (B, N, d_model)``.

- ``padding_keys_attended``: the lengths not applied to the keys (a right-padded batch run as if full).
  Only the real query rows are compared (a padding row's output is a convention). A causal query
  never sees the right padding after it: the mistake shows with ``causal=False`` (said in a note).

``diagnose_paged(candidate)``: one decode query per row over its paged keys, the kernel's signature,
``candidate(q (B, H, D), k_pool (pages, P, Hkv, D), v_pool (pages, P, Hkv, Dv), block_table (B, M),
seq_lens (B,), scale) -> (B, H, Dv)`` (vLLM's NHD pool and block table). The probe's pages sit in a
shuffled physical order and its free pages and unwritten slots hold stale numbers, as a reused pool does.

- ``paged_physical_as_logical``: row ``b``'s logical page ``j`` read from physical page ``j`` instead of
  ``block_table[b, j]`` (attention-gym #189's wrong mapping);
- ``paged_last_page_off_by_one``: the last page read with one slot too many (a stale slot attended) or
  one too few (the newest key dropped), FlashInfer's ``kv_last_page_len`` off by one.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mha_rosetta.core import MHAConfig, check_dtype_name, init_params, reference_mha
from mha_rosetta.core.paged import PagedLayout
from mha_rosetta.core.ragged import RaggedBatch
from mha_rosetta.core.tolerances import tolerance_for

from .diagnosis import Cause, Diagnosis

__all__ = ["RAGGED_CAUSE_CODES", "diagnose_packed", "diagnose_padded", "diagnose_paged"]

RAGGED_CAUSE_CODES = (
    "packed_documents_leak",
    "packed_positions_not_restarting",
    "padding_keys_attended",
    "paged_physical_as_logical",
    "paged_last_page_off_by_one",
)
FIXES = {
    "packed_documents_leak": "AND the document mask into the causal mask (cu_seqlens: a block-diagonal mask, or a "
    "varlen kernel that takes cu_seqlens)",
    "packed_positions_not_restarting": "restart the positions at each document: position_ids = "
    "RaggedBatch.from_cu_seqlens(cu).position_ids(drop_empty=True)",
    "padding_keys_attended": "mask the keys past each row's length (seq_lens) out of every query's scores",
    "paged_physical_as_logical": "read logical page j of row b from physical page block_table[b, j]",
    "paged_last_page_off_by_one": "the last page holds seq_len - (pages - 1) * P tokens, in 1..P: read exactly those",
}
PACKED_PROBES = {"documents 5, 0, 3, 6": (5, 0, 3, 6), "documents 2, 7, 1, 4": (2, 7, 1, 4)}
PADDED_PROBES = {"lengths 6, 2, 4 of 7": ((6, 2, 4), 7), "lengths 3, 5 of 5": ((3, 5), 5)}


def _score(dtype: str, got: dict, expected: dict, rows=None) -> float:
    """The worst distance over the probes in tolerances: max |got - expected| / (atol + rtol |expected|)."""
    tol, worst = tolerance_for(dtype), 0.0
    for name, value in got.items():
        a, b = np.asarray(value, dtype=np.float64), np.asarray(expected[name], dtype=np.float64)
        if rows is not None:
            a, b = a[rows[name]], b[rows[name]]
        worst = max(worst, float(np.max(np.abs(a - b) / (tol.atol + tol.rtol * np.abs(b)), initial=0.0)))
    return worst


def _diagnosis(dtype, got, oracle, hypotheses, rows=None, notes=()) -> Diagnosis:
    """`Diagnosis` of ``got`` (probe -> output) against ``oracle`` and ``hypotheses`` ((code, detail) -> outputs)."""
    errors = {}
    for name, value in got.items():
        difference = np.abs(np.asarray(value, dtype=np.float64) - oracle[name])
        errors[name] = float(np.max(difference if rows is None else difference[rows[name]], initial=0.0))
    agrees = _score(dtype, got, oracle, rows) <= 1.0
    causes = []
    if not agrees:
        for (code, detail), simulated in hypotheses.items():
            residual = _score(dtype, got, simulated, rows)
            if residual <= 1.0:
                evidence = f"the candidate matches this mistake within {residual:.2g} tolerances on every probe"
                causes.append(Cause(code, detail, evidence, FIXES[code], residual))
        causes.sort(key=lambda cause: cause.residual)
    return Diagnosis(agrees, max(errors.values()), causes, notes=list(notes), probe_errors=errors, dtype=dtype)


def _check_candidate(candidate) -> None:
    if not callable(candidate):
        raise TypeError(f"candidate must be callable, got {type(candidate).__name__}")


def diagnose_packed(candidate, cfg: MHAConfig, *, dtype: str = "float64", seed: int = 0) -> Diagnosis:
    """Does ``candidate(params, x, cu_seqlens)`` keep packed documents apart, each from position 0 (module docstring)."""
    _check_candidate(candidate)
    dtype = check_dtype_name(dtype)
    if not isinstance(cfg, MHAConfig) or not cfg.causal:
        raise ValueError(f"cfg must be a causal MHAConfig (packed documents are causal sequences), got {cfg!r}")
    params, rng = init_params(cfg, seed=seed), np.random.default_rng(seed + 1)
    got, oracle, hypotheses = {}, {}, {}
    as_one_row = replace(cfg, causal=False)  # the whole row's causal mask given explicitly below
    for name, lengths in PACKED_PROBES.items():
        batch = RaggedBatch(lengths)
        x = rng.standard_normal((batch.total, cfg.d_model))  # (T, D)
        cu, pos = batch.cu_seqlens(), batch.position_ids(drop_empty=True)
        got[name] = candidate(params, x, cu)
        oracle[name] = reference_mha(cfg, params, x, cu_seqlens=cu)
        row_causal = np.tril(np.ones((batch.total, batch.total), dtype=bool))  # (T, T): j <= i over the row
        simulated = {
            ("packed_documents_leak", "the packed row run as one causal sequence: cu_seqlens ignored"): reference_mha(
                cfg, params, x
            ),
            (
                "packed_documents_leak",
                "positions restart per document but the causal mask spans the whole row (no document mask)",
            ): reference_mha(as_one_row, params, x, mask=row_causal, positions=pos),
            (
                "packed_positions_not_restarting",
                "the document mask is right, the positions run 0 .. T-1 along the row",
            ): reference_mha(cfg, params, x, mask=batch.document_mask(drop_empty=True)),
        }
        for key, value in simulated.items():
            hypotheses.setdefault(key, {})[name] = value
    notes = []
    if cfg.attention_chunk_size is None:
        notes.append(
            "without chunks (attention_chunk_size), positions that do not restart change nothing: rotary reads "
            "p_j - p_i, and an offset within a document cancels; packed_positions_not_restarting is invisible"
        )
    return _diagnosis(dtype, got, oracle, hypotheses, notes=notes)


def diagnose_padded(candidate, cfg: MHAConfig, *, dtype: str = "float64", seed: int = 0) -> Diagnosis:
    """Does ``candidate(params, x, seq_lens)`` keep every padding key out (the real query rows compared)."""
    _check_candidate(candidate)
    dtype = check_dtype_name(dtype)
    params, rng = init_params(cfg, seed=seed), np.random.default_rng(seed + 2)
    got, oracle, hypotheses, rows = {}, {}, {}, {}
    key = ("padding_keys_attended", "the batch run as if every row were full: padding keys in every softmax")
    for name, (lengths, tokens) in PADDED_PROBES.items():
        x = rng.standard_normal((len(lengths), tokens, cfg.d_model))  # (B, N, D)
        got[name] = candidate(params, x, np.asarray(lengths))
        oracle[name] = reference_mha(cfg, params, x, seq_lens=lengths)
        hypotheses.setdefault(key, {})[name] = reference_mha(cfg, params, x)
        rows[name] = RaggedBatch(lengths).padding_mask(tokens)  # (B, N): only the real query rows are compared
    notes = []
    if cfg.causal:
        notes.append(
            "causal: a real query never sees the right padding after it, so padding_keys_attended is invisible "
            "here (an encoder's bidirectional cfg, causal=False, shows it)"
        )
    return _diagnosis(dtype, got, oracle, hypotheses, rows=rows, notes=notes)


# -- paged decode attention --------------------------------------------------------------------------
def paged_attention(q, k_pool, v_pool, pages, lengths, scale: float) -> np.ndarray:
    """The float64 answer: row b's query (H, D) over the first ``lengths[b]`` slots of ``pages[b]`` (its physical
    pages in logical order), every kv head shared by ``H // Hkv`` query heads. Returns (B, H, Dv)."""
    B, H, _ = q.shape
    out = np.zeros((B, H, v_pool.shape[-1]))
    for b in range(B):
        keys = k_pool[pages[b]].reshape(-1, *k_pool.shape[2:])[: lengths[b]]  # (L, Hkv, D) in logical order
        values = v_pool[pages[b]].reshape(-1, *v_pool.shape[2:])[: lengths[b]]  # (L, Hkv, Dv)
        group = H // keys.shape[1]
        keys, values = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)  # (L, H, D): GQA
        scores = np.einsum("hd,lhd->hl", q[b], keys) * scale  # (H, L)
        if scores.shape[1]:
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[b] = np.einsum("hl,lhd->hd", weights / weights.sum(axis=1, keepdims=True), values)
    return out


def diagnose_paged(candidate, *, dtype: str = "float64", seed: int = 0) -> Diagnosis:
    """Does ``candidate(q, k_pool, v_pool, block_table, seq_lens, scale)`` read each row's pages as its block
    table says (module docstring)."""
    _check_candidate(candidate)
    dtype = check_dtype_name(dtype)
    rng = np.random.default_rng(seed + 3)
    H, Hkv, D, P = 4, 2, 6, 4
    got, oracle, hypotheses = {}, {}, {}
    # No length a multiple of P: one slot past the last page's length stays inside that page.
    for name, lengths in {"rows of 7, 1, 11 tokens": (7, 1, 11), "rows of 9, 6 tokens": (9, 6)}.items():
        layout = PagedLayout.assign(RaggedBatch(lengths), P, n_pages=12, seed=seed + len(lengths))  # shuffled pages
        q = rng.standard_normal((len(lengths), H, D))
        k_pool, v_pool = rng.standard_normal((12, P, Hkv, D)), rng.standard_normal((12, P, Hkv, D))  # stale slots too
        table, seq_lens, scale = layout.block_table, layout.seq_lens, 1 / np.sqrt(D)
        got[name] = candidate(q, k_pool, v_pool, table.copy(), seq_lens.copy(), scale)
        used = layout.pages_per_row
        right = [table[b, : used[b]] for b in range(len(lengths))]
        oracle[name] = paged_attention(q, k_pool, v_pool, right, seq_lens, scale)
        logical = [np.arange(used[b]) for b in range(len(lengths))]
        simulated = {
            ("paged_physical_as_logical", "logical page j read from physical page j, not block_table[b, j]"): (
                logical,
                seq_lens,
            ),
            ("paged_last_page_off_by_one", "one slot past the last page's length: a stale slot attended"): (
                right,
                seq_lens + 1,
            ),
            ("paged_last_page_off_by_one", "one slot short of the last page's length: the newest key dropped"): (
                right,
                seq_lens - 1,
            ),
        }
        for key, (pages, lens) in simulated.items():
            hypotheses.setdefault(key, {})[name] = paged_attention(q, k_pool, v_pool, pages, lens, scale)
    return _diagnosis(dtype, got, oracle, hypotheses)
