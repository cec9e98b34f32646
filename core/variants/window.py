"""The sliding window: W keys including the query's own position, on the token positions."""

from __future__ import annotations

import numpy as np

from ._diagnose import REPAIRS, DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, Explanation, Variant, demo, value_option
from ._shared import position_grid, positional_mask, relative_distances


def window_allowed(window: int, causal: bool, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """The sliding window on positions, bool (1|B, 1, Nq, Nk): W keys including the query's own.

    Causal: ``p_i - W < p_j`` (the causal mask adds ``p_j <= p_i``); otherwise two-sided,
    ``|p_i - p_j| < W``.
    """
    distance = relative_distances(positions, kv_positions)  # (1|B, Nq, Nk), p_j - p_i
    allowed = distance > -window if causal else np.abs(distance) < window
    return allowed[:, None]


def _forward(cfg: Config, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    return window_allowed(cfg.window, cfg.causal, positions, kv_positions)  # the registry's mask step (`ScoreStep`)


def explain(demo) -> Explanation:
    W = ENTRY.demo_on["window"]
    tokens = demo.tokens
    positions, i, j = position_grid(tokens)  # (1, N), (N, 1), (1, N)

    def flash(left: int, right: int) -> np.ndarray:  # FlashAttention's window_size=(left, right), causal
        return (j >= i - left) & (j <= i + right) & (j <= i)

    spec = window_allowed(W, True, positions, positions)[0, 0] & (j <= i)  # (N, N)
    same = bool(np.array_equal(spec, flash(W - 1, 0)))
    return Explanation(
        "window=W",
        "key j visible to query i iff p_i - W < p_j <= p_i (causal); |p_i - p_j| < W without causal",
        "in the mask, with causal and the user's mask",
        [
            (
                "Hugging Face config",
                f"sliding_window = {W} (Mistral, Gemma 2, gpt-oss): W keys, the query's own included",
            ),
            ("FlashAttention", f"flash_attn_func(..., causal=True, window_size=({W - 1}, 0))"),
            ("JAX", f"jax.nn.dot_product_attention(..., is_causal=True, local_window_size=({W - 1}, 0))"),
            ("FlexAttention", f"mask_mod = lambda b, h, q, kv: (kv <= q) & (q - kv < {W}); create_block_mask"),
        ],
        [
            f"W = {W} is window_size=({W - 1}, 0): the same mask over {tokens} tokens: {'yes' if same else 'NO'} "
            f"(keys per query {[int(n) for n in spec.sum(axis=1)]})",
            f"window_size=({W}, 0) taken for a window of {W} keys lets {W + 1} through (keys per query "
            f"{[int(n) for n in flash(W, 0).sum(axis=1)]}): eager and flash disagreed by this one key (transformers #29623, #39408)",
        ],
    )


# -- diagnose: one key more (FlashAttention's window_size read as W keys), or counted from the wrong end --------------
def window_mask(cfg: Config, mask):
    """The (B, 1, Nq, Nk) mask AND the spec's window (positions 0..N-1), for code whose window is wider than W.

    A candidate that lets W + 1 keys through computes its own window AND this mask, which is
    the spec's window of W. ``mask`` must be an array (start from an all-True one); it is not
    its own inverse: the candidate's code must still be fixed (`diagnose.repairs` has it).
    """
    mask = np.asarray(mask, dtype=bool)
    q_tokens, kv_tokens = mask.shape[-2:]
    allowed = window_allowed(cfg.window, cfg.causal, np.arange(q_tokens)[None], np.arange(kv_tokens)[None])
    return mask & allowed  # (1, 1, Nq, Nk) broadcast to the mask's shape


def _rule(cfg: Config) -> tuple[str, str]:
    """(the spec's rule in positions, FlashAttention's window_size of it)."""
    W = cfg.window
    if cfg.causal:
        return f"p_i - {W} < p_j <= p_i", f"({W - 1}, 0)"
    return f"|p_i - p_j| < {W}", f"({W - 1}, {W - 1})"


def _one_more_fix(cfg: Config) -> str:
    (rule, flash), W = _rule(cfg), cfg.window
    return (
        f"the window holds W = {W} keys including the query's own: key j visible iff {rule} (Hugging Face's "
        f"sliding_window = {W}); FlashAttention spells it window_size={flash}, and one more there is one key "
        f"more (transformers #29623, #39408); or feed {REPAIRS}.window_mask(cfg, mask), which the candidate's "
        "wider window then cuts to the spec's"
    )


def _wrong_end_fix(cfg: Config) -> str:
    rule, flash = _rule(cfg)
    return (
        f"the window reaches back from the query: key j visible iff {rule}; FlashAttention's "
        f"window_size=(left, right) is {flash}, not (0, {cfg.window - 1})"
    )


def _simulated_window(cfg: Config, positions, kv_positions, mistake):
    d = relative_distances(positions, kv_positions)[:, None]  # (1|B, 1, Nq, Nk), p_j - p_i
    w = cfg.window + 1 if mistake == "one_more" else cfg.window
    if mistake == "future":
        return (d >= 0) & (d < w)
    return d > -w if cfg.causal else np.abs(d) < w


def _planted_window(cfg: Config, q_tokens: int, kv_tokens: int, mistake):
    """(Nq, Nk) bool: the keys the NumPy candidate's window lets through."""
    i, j = np.arange(q_tokens)[:, None], np.arange(kv_tokens)[None, :]
    w = cfg.window + 1 if mistake == "one_more" else cfg.window
    if mistake == "future":
        return (j >= i) & (j < i + w)
    return (j > i - w) if cfg.causal else (np.abs(i - j) < w)


DIAGNOSE = DiagnoseSpec(
    rank=20,
    causes=(
        DiagnoseCause(
            "window",
            "one_more",
            lambda cfg: f"{cfg.window + 1} keys where the window holds {cfg.window} (the query's own included)",
            _one_more_fix,
            repair=lambda cfg, p, m: (p, window_mask(cfg, m)),
            needs_mask=True,
        ),
        DiagnoseCause(
            "window",
            "future",
            lambda cfg: (
                f"counted from the wrong end: the {cfg.window} keys from the query's own forward (the causal "
                "mask leaves the diagonal)"
            ),
            _wrong_end_fix,
            when=lambda cfg: cfg.causal and cfg.window > 1,  # a window of one key is the diagonal from either end
        ),
    ),
    mistakes=(
        # One more key shows only where the window is shorter than the probes.
        PlantedMistake(
            "window W+1",
            "window",
            "FlashAttention's window_size=(W, 0) for a window of W keys",
            "one_more",
            runs=lambda cfg, q_tokens: cfg.window < q_tokens,
        ),
        PlantedMistake(
            "window wrong end",
            "window",
            "keys i <= j < i + W instead of i - W < j <= i",
            "future",
            runs=lambda cfg, q_tokens: cfg.causal and cfg.window > 1,  # a window of one key: the diagonal either way
        ),
    ),
    simulated=SimulatedSteps(allowed=_simulated_window),
    planted=PlantedSteps(mask=_planted_window),
)


ENTRY = Variant(
    name="window",
    summary="sliding window of W keys including the query's own position",
    **positional_mask("window"),  # on where not None; None (off) or a positive int
    forward=_forward,
    check_cases=(
        CaseSpec(
            "window",
            "causal sliding window of 3 keys (the query's own and the 2 before it)",
            dict(d_model=14, n_heads=2, causal=True, window=3),  # d_k = 7
            dict(batch=3, q_tokens=8, dtypes=("float64", "float32"), seed=19),
        ),
        CaseSpec(
            "window_two_sided",
            "a window without causal: keys within 2 positions either side (|p_i - p_j| < 3)",
            dict(d_model=14, n_heads=2, window=3),
            dict(batch=3, q_tokens=6, dtypes=("float64",), seed=20),
        ),
        CaseSpec(
            "window_longer",
            "a window of 16 keys over 7 tokens: the same as plain causal attention",
            dict(d_model=15, n_heads=3, causal=True, window=16),
            dict(dtypes=("float32",), seed=21),
        ),
    ),
    # The window's decode cases are the cache's (a ring buffer outgrown, a prefill longer than the
    # ring, left padding): `checks.decode_cases` lists them with the other cache cases.
    # A quarter of the tokens, so that it blocks keys at every size; against causal (a causal mask with fewer keys).
    bench=BenchSpec({"causal": True, "window": "tokens/4"}, "causal"),
    cli=(value_option("--window", "window", "sliding window of W keys, the query's own included", rank=10, type=int),),
    **demo("window", 3, None),
    explain=explain,
    diagnose=DIAGNOSE,
)
