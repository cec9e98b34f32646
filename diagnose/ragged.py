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

from mha_rosetta.core import MHAConfig, check_dtype_name, init_params, lower_precision, numpy_dtype, reference_mha
from mha_rosetta.core.paged import PagedLayout
from mha_rosetta.core.ragged import RaggedBatch
from mha_rosetta.core.tolerances import tolerance_for

from .calling import DiagnoseError, _as_output, _call
from .diagnosis import DEFAULT_TIMEOUT_S, Cause, Diagnosis

__all__ = [
    "PAGED_SIZES",
    "RAGGED_CAUSE_CODES",
    "RAGGED_FORMS",
    "diagnose_packed",
    "diagnose_padded",
    "diagnose_paged",
    "diagnose_ragged",
]

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
# The paged kernel's probe: query heads, kv heads, head width and page size (a kernel takes any: these are its own).
PAGED_SIZES = {"H": 4, "Hkv": 2, "D": 6, "P": 4}
PAGED_SIZES_TEXT = ", ".join(f"{name} {size}" for name, size in PAGED_SIZES.items())
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


class _Probing:
    """The candidate's calls, as `diagnose`'s: each in a worker thread under the per-probe time limit
    (`calling._call`, announced to ``announce`` so that `isolated` can watch a child), its float arrays cast
    to ``dtype``, its result checked (an array of the expected shape, floating point, not NaN everywhere) and
    made float64. The tolerance is the lower precision of ``dtype`` and what the candidate returned."""

    def __init__(self, candidate, dtype: str, timeout: float | None, announce) -> None:
        if not callable(candidate):
            raise TypeError(f"candidate must be callable, got {type(candidate).__name__}")
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.candidate, self.timeout, self.announce = candidate, timeout, announce
        self.dtype = check_dtype_name(dtype)
        self.np_dtype = numpy_dtype(self.dtype)
        self.out_dtypes = {self.dtype}

    def cast(self, array):
        """A float64 probe array (or `MHAParams`) in the diagnosis' dtype, as the candidate receives it."""
        return array.astype(self.np_dtype)

    def __call__(self, probe: str, args: tuple, shape: tuple[int, ...], axes: str) -> np.ndarray:
        result = _call(self.candidate, args, self.timeout, probe, self.announce)
        output, out_dtype = _as_output(result, shape, probe, axes)
        if not np.isfinite(output).any():
            raise DiagnoseError(f"the candidate returned NaN or inf everywhere on probe {probe!r}")
        self.out_dtypes.add(out_dtype)
        return output

    @property
    def tolerance_dtype(self) -> str:
        return lower_precision(*self.out_dtypes)


def diagnose_packed(
    candidate, cfg: MHAConfig, *, dtype: str = "float64", seed: int = 0, timeout=None, announce=None
) -> Diagnosis:
    """Does ``candidate(params, x, cu_seqlens)`` keep packed documents apart, each from position 0 (module docstring).
    ``timeout`` (seconds per call, default `DEFAULT_TIMEOUT_S`) and ``announce`` as in `diagnose`."""
    call = _Probing(candidate, dtype, timeout, announce)
    if not isinstance(cfg, MHAConfig) or not cfg.causal:
        raise ValueError(f"cfg must be a causal MHAConfig (packed documents are causal sequences), got {cfg!r}")
    params, rng = init_params(cfg, seed=seed), np.random.default_rng(seed + 1)
    got, oracle, hypotheses = {}, {}, {}
    as_one_row = replace(cfg, causal=False)  # the whole row's causal mask given explicitly below
    for name, lengths in PACKED_PROBES.items():
        batch = RaggedBatch(lengths)
        x = rng.standard_normal((batch.total, cfg.d_model))  # (T, D)
        cu, pos = batch.cu_seqlens(), batch.position_ids(drop_empty=True)
        got[name] = call(name, (call.cast(params), call.cast(x), cu.copy()), x.shape, "(T, d_model)")
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
    return _diagnosis(call.tolerance_dtype, got, oracle, hypotheses, notes=notes)


def diagnose_padded(
    candidate, cfg: MHAConfig, *, dtype: str = "float64", seed: int = 0, timeout=None, announce=None
) -> Diagnosis:
    """Does ``candidate(params, x, seq_lens)`` keep every padding key out (the real query rows compared).
    ``timeout`` and ``announce`` as in `diagnose_packed`."""
    call = _Probing(candidate, dtype, timeout, announce)
    params, rng = init_params(cfg, seed=seed), np.random.default_rng(seed + 2)
    got, oracle, hypotheses, rows = {}, {}, {}, {}
    key = ("padding_keys_attended", "the batch run as if every row were full: padding keys in every softmax")
    for name, (lengths, tokens) in PADDED_PROBES.items():
        x = rng.standard_normal((len(lengths), tokens, cfg.d_model))  # (B, N, D)
        got[name] = call(name, (call.cast(params), call.cast(x), np.asarray(lengths)), x.shape, "(B, N, d_model)")
        oracle[name] = reference_mha(cfg, params, x, seq_lens=lengths)
        hypotheses.setdefault(key, {})[name] = reference_mha(cfg, params, x)
        rows[name] = RaggedBatch(lengths).padding_mask(tokens)  # (B, N): only the real query rows are compared
    notes = []
    if cfg.causal:
        notes.append(
            "causal: a real query never sees the right padding after it, so padding_keys_attended is invisible "
            "here (an encoder's bidirectional cfg, causal=False, shows it)"
        )
    return _diagnosis(call.tolerance_dtype, got, oracle, hypotheses, rows=rows, notes=notes)


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


def diagnose_paged(candidate, *, dtype: str = "float64", seed: int = 0, timeout=None, announce=None) -> Diagnosis:
    """Does ``candidate(q, k_pool, v_pool, block_table, seq_lens, scale)`` read each row's pages as its block
    table says (module docstring). ``timeout`` and ``announce`` as in `diagnose_packed`."""
    call = _Probing(candidate, dtype, timeout, announce)
    rng = np.random.default_rng(seed + 3)
    H, Hkv, D, P = PAGED_SIZES.values()
    got, oracle, hypotheses = {}, {}, {}
    # No length a multiple of P: one slot past the last page's length stays inside that page.
    for name, lengths in {"rows of 7, 1, 11 tokens": (7, 1, 11), "rows of 9, 6 tokens": (9, 6)}.items():
        layout = PagedLayout.assign(RaggedBatch(lengths), P, n_pages=12, seed=seed + len(lengths))  # shuffled pages
        q = rng.standard_normal((len(lengths), H, D))
        k_pool, v_pool = rng.standard_normal((12, P, Hkv, D)), rng.standard_normal((12, P, Hkv, D))  # stale slots too
        table, seq_lens, scale = layout.block_table, layout.seq_lens, 1 / np.sqrt(D)
        args = (call.cast(q), call.cast(k_pool), call.cast(v_pool), table.copy(), seq_lens.copy(), scale)
        got[name] = call(name, args, q.shape[:2] + v_pool.shape[-1:], "(B, H, Dv)")
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
    return _diagnosis(call.tolerance_dtype, got, oracle, hypotheses)


# What each form's candidate is (``mha-rosetta diagnose --ragged FORM``), in words.
RAGGED_FORMS = {
    "packed": "candidate(params, x (T, d_model), cu_seqlens (B+1,)) -> (T, d_model): packed causal documents",
    "padded": "candidate(params, x (B, N, d_model), seq_lens (B,)) -> (B, N, d_model): right-padded rows",
    "paged": "candidate(q (B, H, D), k_pool (pages, P, Hkv, D), v_pool (pages, P, Hkv, Dv), block_table (B, M), "
    f"seq_lens (B,), scale) -> (B, H, Dv): a paged decode kernel, on the probe's own sizes ({PAGED_SIZES_TEXT})",
}


def diagnose_ragged(form: str, candidate, cfg: MHAConfig | None = None, **options) -> Diagnosis:
    """`diagnose_packed`, `diagnose_padded` or `diagnose_paged` by ``form`` (`RAGGED_FORMS`): the command line's
    ``--ragged``. ``cfg`` is None for ``paged`` (its kernel's probe has its own sizes); ``options``: dtype, seed,
    timeout, announce."""
    if form not in RAGGED_FORMS:
        raise ValueError(f"form must be one of {', '.join(RAGGED_FORMS)}, got {form!r}")
    if form == "paged":
        if cfg is not None:
            raise ValueError(
                f"the paged kernel's probe has its own sizes ({PAGED_SIZES_TEXT}): cfg must be None, got {cfg!r}"
            )
        return diagnose_paged(candidate, **options)
    return (diagnose_packed if form == "packed" else diagnose_padded)(candidate, cfg, **options)
