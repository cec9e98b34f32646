"""Llama 4's chunked local attention: key j visible to query i iff both lie in one chunk of C positions.

``attention_chunk_size = C`` (transformers' name, `Llama4TextConfig`): the token positions are cut
into chunks ``[0, C), [C, 2C), ...`` and a query sees only the keys of its own chunk,
``floor(p_j / C) == floor(p_i / C)``, ANDed with causality (``p_j <= p_i``) as Llama 4's rotary layers
run it. The rule is on positions, so it holds across decode steps: a step's query at position p
(the cache offset included) sees the cached keys of its own chunk only.
"""

from __future__ import annotations

import numpy as np

from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, ConfigField, Explanation, Variant, demo, value_option
from ._shared import position_grid, positional_mask


def chunk_allowed(chunk: int, positions: np.ndarray, kv_positions: np.ndarray, shift: int = 0) -> np.ndarray:
    """bool (1|B, 1, Nq, Nk): key j lies in query i's chunk of ``chunk`` positions, ``p_j // C == p_i // C``.

    ``positions`` (1|B, Nq), ``kv_positions`` (1|B, Nk), int. ``shift`` moves every chunk boundary
    (diagnose's off-by-one: ``(p + 1) // C``); the spec's is 0.
    """
    q_chunk = (np.asarray(positions) + shift) // chunk  # (1|B, Nq)
    k_chunk = (np.asarray(kv_positions) + shift) // chunk  # (1|B, Nk)
    return (q_chunk[:, :, None] == k_chunk[:, None, :])[:, None]  # (1|B, 1, Nq, Nk)


def _forward(cfg: Config, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    return chunk_allowed(cfg.attention_chunk_size, positions, kv_positions)  # the registry's mask step


def explain(demo) -> Explanation:
    C = ENTRY.demo_on["attention_chunk_size"]
    tokens = demo.tokens
    positions, i, j = position_grid(tokens)  # (1, N), (N, 1), (1, N)
    spec = chunk_allowed(C, positions, positions)[0, 0] & (j <= i)  # (N, N)
    shifted = chunk_allowed(C, positions, positions, shift=1)[0, 0] & (j <= i)
    window = (j <= i) & (j > i - C)
    return Explanation(
        "attention_chunk_size=C",
        "key j visible to query i iff p_j <= p_i and floor(p_j / C) == floor(p_i / C) (on positions, the cache "
        "offset included)",
        "in the mask, with causal, the window and the user's mask",
        [
            (
                "Hugging Face config",
                f"attention_chunk_size = {C} (Llama 4: its rotary layers; NoPE layers attend fully)",
            ),
            ("transformers", "masking_utils.create_chunked_causal_mask (chunks start after any left padding)"),
            ("FlexAttention", f"mask_mod = lambda b, h, q, kv: (kv <= q) & (kv // {C} == q // {C})"),
        ],
        [
            f"keys per query over {tokens} tokens with C = {C}: {[int(n) for n in spec.sum(axis=1)]}; a sliding window "
            f"of {C} keys instead lets {[int(n) for n in window.sum(axis=1)]} through (a chunk resets at each boundary)",
            f"a boundary off by one ((p + 1) // C) moves {int((spec != shifted).sum())} of {int(spec.sum())} allowed "
            "pairs (transformers #37351, #37329: the chunked mask)",
        ],
    )


# -- diagnose: the boundary off by one, or the chunk forgotten (full causal attention) ----------------------------
def _shift(mistake) -> int:
    return 1 if mistake == "off_by_one" else 0


def _simulated_chunk(cfg: Config, positions, kv_positions, mistake):
    if mistake == "forgotten":
        return np.ones((1, 1, np.shape(positions)[1], np.shape(kv_positions)[1]), dtype=bool)
    return chunk_allowed(cfg.attention_chunk_size, positions, kv_positions, shift=_shift(mistake))


def _planted_chunk(cfg: Config, q_tokens: int, kv_tokens: int, mistake):
    """(Nq, Nk) bool, True = allowed: the chunks the NumPy candidate cuts, on the indices."""
    C = cfg.attention_chunk_size
    i, j = np.arange(q_tokens)[:, None], np.arange(kv_tokens)[None, :]
    if mistake == "forgotten":
        return np.ones((q_tokens, kv_tokens), dtype=bool)
    start = _shift(mistake)
    return (i + start) // C == (j + start) // C


def _boundary_fix(cfg: Config) -> str:
    C = cfg.attention_chunk_size
    return (
        f"chunks start at the multiples of C = {C}: key j visible iff p_j // {C} == p_i // {C} on the positions "
        "(the cache offset included), as transformers' create_chunked_causal_mask (#37351, #37329)"
    )


def _shows(cfg: Config, q_tokens: int) -> bool:
    """A chunk shorter than the probes (else every probe lies in chunk 0); a shift needs C > 1 to move anything."""
    return cfg.attention_chunk_size < q_tokens


DIAGNOSE = DiagnoseSpec(
    rank=75,  # after the variants of 2024 (rel_bias: 70): diagnose lists the forms of 2025-26 after them
    causes=(
        DiagnoseCause(
            "chunked",
            "off_by_one",
            lambda cfg: f"chunk boundaries one position late: (p + 1) // {cfg.attention_chunk_size}",
            _boundary_fix,
            when=lambda cfg: cfg.attention_chunk_size > 1,
        ),
        DiagnoseCause(
            "chunked",
            "forgotten",
            lambda cfg: f"no chunk mask: every earlier key visible where chunks of {cfg.attention_chunk_size} cut",
            _boundary_fix,
        ),
    ),
    mistakes=(
        PlantedMistake(
            "chunk boundary off by one",
            "chunked",
            "(p + 1) // C for the chunk index",
            "off_by_one",
            runs=lambda cfg, q_tokens: cfg.attention_chunk_size > 1 and _shows(cfg, q_tokens),
        ),
        PlantedMistake("chunk forgotten", "chunked", "full causal attention on a chunked layer", "forgotten", _shows),
    ),
    settings=(("llama4-chunked", dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, attention_chunk_size=3)),),
    simulated=SimulatedSteps(allowed=_simulated_chunk),
    planted=PlantedSteps(mask=_planted_chunk),
)


ENTRY = Variant(
    name="chunked",
    summary="Llama 4's chunked local attention: a query sees the keys of its own chunk of C positions",
    **positional_mask("attention_chunk_size"),  # on where not None; None (off) or a positive int
    config_fields=(ConfigField("attention_chunk_size", None, "int | None"),),
    forward=_forward,
    check_cases=(
        CaseSpec(
            "chunked",
            "Llama 4's chunked causal attention, chunks of 3 positions over 8 tokens",
            dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, attention_chunk_size=3),  # d_k = 6
            dict(batch=2, q_tokens=8, dtypes=("float64", "float32"), seed=61),
        ),
        CaseSpec(
            "chunked_rope_window",
            "chunks of 4 with interleaved rotary and a window of 3 inside them",
            dict(d_model=16, n_heads=2, causal=True, attention_chunk_size=4, window=3, rope="interleaved"),
            dict(batch=3, q_tokens=9, dtypes=("float64",), seed=62),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "decode_chunked",
            "chunks of 3 across a prefill of 4 and steps of 2: boundaries on the positions, the cache offset included",
            dict(d_model=16, n_heads=4, n_kv_heads=2, causal=True, attention_chunk_size=3, rope="interleaved"),
            dict(batch=2, tokens=11, prefill=4, step=2, seed=63),
        ),
    ),
    # A quarter of the tokens (Llama 4's 8192 of 32k+ contexts, scaled), against causal: a causal mask with fewer keys.
    bench=BenchSpec({"causal": True, "attention_chunk_size": "tokens/4"}, "causal", preset="forms"),
    cli=(
        value_option(
            "--attention-chunk-size",
            "attention_chunk_size",
            "Llama 4's chunked attention: chunks of C positions",
            rank=11,
            type=int,
        ),
    ),
    **demo("attention_chunk_size", 3, None),
    explain=explain,
    diagnose=DIAGNOSE,
)
