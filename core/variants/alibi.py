"""ALiBi (BLOOM, MPT): ``m_h * (p_j - p_i)`` added to head h's scores, with BLOOM's slopes m_h."""

from __future__ import annotations

import math

import numpy as np

from .._validate import require_bool
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, Explanation, Variant, numbers, switch_option
from ._shared import BIAS_PLACE, additive_bias, flag, relative_distances, softmax_with_empty_rows


def alibi_slopes(n_heads: int) -> np.ndarray:
    """BLOOM's ``_get_alibi_slopes``: head h's slope m_h, float64 ``(n_heads,)``.

    For a power of two n the slopes are the geometric series ``2**(-8 k / n)``, k = 1..n.
    Otherwise the first ``c = 2**floor(log2 n)`` heads take the series for c, and the
    remaining ``n - c`` heads take every other term (the odd ones) of the series for 2c:
    the interleaved second series. 6 heads: the 4-head series, then terms 1 and 3 of the 8-head one.
    """
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))  # 2**(-8/closest)
    slopes = base ** np.arange(1, 1 + closest, dtype=np.float64)
    if closest != n_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))  # 2**(-4/closest)
        remaining = min(closest, n_heads - closest)
        slopes = np.concatenate([slopes, extra_base ** np.arange(1, 1 + 2 * remaining, 2, dtype=np.float64)])
    return slopes


def alibi_bias(n_heads: int, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """``m_h * (p_j - p_i)``: float64 (1|B, H, Nq, Nk); zero on the diagonal, negative for past keys."""
    distance = relative_distances(positions, kv_positions).astype(np.float64)  # (1|B, Nq, Nk)
    return alibi_slopes(n_heads)[None, :, None, None] * distance[:, None]


def _forward(cfg: Config, p, positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    return alibi_bias(cfg.n_heads, positions, kv_positions)  # the registry's bias step (`ScoreStep`)


def _validate(cfg: Config) -> dict:
    require_bool("alibi", cfg.alibi)
    return {}


# BLOOM's layer with 6 heads (not a power of two): the check case and the decode case read it.
BLOOM_LIKE = dict(d_model=18, n_heads=6, causal=True, alibi=True)  # d_k = 3


def explain(demo) -> Explanation:
    on, _, stages, _, _ = demo.run("alibi")
    H, d_k = on.n_heads, on.d_k
    slopes = alibi_slopes(H)
    power_of_two = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    positions = np.arange(demo.tokens)[None]
    bloom = stages["scores"] + slopes[None, :, None, None] * positions[:, None, None, :]  # m_h * p_j
    allowed = np.isfinite(stages["masked_scores"])
    bloom_weights = softmax_with_empty_rows(np.where(allowed, bloom, -np.inf))
    spec_bias = alibi_bias(H, positions, positions)
    # The weights agree to rounding, and the last bits depend on the machine's BLAS kernels (3e-17 on an
    # AMD EPYC, 6e-17 on an Intel Xeon, OpenBLAS 0.3.31): the page states the bound, not the digits.
    weights_gap = np.abs(bloom_weights - stages["weights"]).max()
    weights_gap_text = "under 1e-15" if weights_gap < 1e-15 else f"{weights_gap:.1g}"
    return Explanation(
        "alibi=True",
        "s_h <- s_h + m_h * (p_j - p_i), BLOOM's slopes m_h",
        f"{BIAS_PLACE} (with the relative bias)",
        [
            ("Hugging Face", "BLOOM: build_alibi_tensor / _get_alibi_slopes; MPT: attn_config alibi=True"),
            ("Hugging Face", "Falcon: alibi=True, added before the 1/sqrt(d_k) scale"),
            ("FlexAttention", "score_mod = lambda s, b, h, q, kv: s + slope[h] * (kv - q)"),
            ("torch SDPA / JAX", "a float attn_mask / bias of m_h (p_j - p_i), (1, H, Nq, Nk)"),
        ],
        [
            f"{H} heads (not a power of two): the slopes are {numbers(slopes)} (the 4-head series, then every "
            f"other term of the 8-head one); the power-of-two formula 2**(-8k/{H}) gives {numbers(power_of_two)}",
            f"Falcon's ALiBi path divides the bias by sqrt(d_k) too: with d_k = {d_k} its slopes are "
            f"{numbers(slopes / math.sqrt(d_k))}",
            f"BLOOM adds m_h * p_j, not m_h * (p_j - p_i): biased_scores differ by up to "
            f"{np.abs(bloom - (stages['scores'] + spec_bias)).max():.3g} in the demonstration, the weights by "
            f"{weights_gap_text} (a constant per row, which the softmax cancels)",
        ],
    )


# -- diagnose: the power-of-two slope formula for any head count, or the sign flipped -------------------------------
def _slopes_text(cfg: Config) -> str:
    return f"core.alibi_slopes({cfg.n_heads}) = [{', '.join(f'{m:.4g}' for m in alibi_slopes(cfg.n_heads))}]"


def _power_of_two_fix(cfg: Config) -> str:
    H = cfg.n_heads
    return (
        f"{H} is not a power of two: the slopes are the series for the power of two below it, then every "
        f"other term of the series for twice that (BLOOM's _get_alibi_slopes; {_slopes_text(cfg)})"
    )


def _sign_fix(cfg: Config) -> str:
    return (
        "add m_h (p_j - p_i) to head h's scores: zero on the diagonal, negative for past keys (BLOOM's m_h p_j "
        f"differs by a constant per row, which the softmax cancels); slopes {_slopes_text(cfg)}"
    )


def _simulated_bias(cfg: Config, p, positions, kv_positions, mistake):
    distance = relative_distances(positions, kv_positions)  # (1|B, Nq, Nk), p_j - p_i
    if mistake == "power_of_two":
        slopes = 2.0 ** (-8.0 * np.arange(1, cfg.n_heads + 1) / cfg.n_heads)  # (H,), right for 2**k heads only
    else:
        slopes = alibi_slopes(cfg.n_heads)  # (H,)
    sign = -1.0 if mistake == "sign" else 1.0
    return sign * slopes[None, :, None, None] * distance[:, None]  # (1|B, H, Nq, Nk)


def numpy_alibi_slopes(n_heads: int, power_of_two_formula: bool) -> np.ndarray:
    """The NumPy candidate's slopes: BLOOM's, written apart from `alibi_slopes`, or the power-of-two formula."""
    if power_of_two_formula or not n_heads & (n_heads - 1):
        return 2.0 ** (-8.0 * np.arange(1, n_heads + 1) / n_heads)
    c = 1 << (n_heads.bit_length() - 1)  # the power of two below n_heads
    first = 2.0 ** (-8.0 * np.arange(1, c + 1) / c)
    second = 2.0 ** (-4.0 * np.arange(1, 2 * (n_heads - c), 2) / c)  # odd terms of the 2c series
    return np.concatenate([first, second])


def _planted_bias(cfg: Config, params, q_tokens: int, kv_tokens: int, mistake):
    i, j = np.arange(q_tokens)[:, None], np.arange(kv_tokens)[None, :]
    slopes = numpy_alibi_slopes(cfg.n_heads, mistake == "power_of_two")
    offset = (i - j) if mistake == "sign" else (j - i)  # (Nq, Nk)
    return slopes[:, None, None] * offset  # (H, Nq, Nk)


DIAGNOSE = DiagnoseSpec(
    rank=30,
    causes=(
        DiagnoseCause(
            "alibi",
            "power_of_two",
            lambda cfg: f"slopes 2**(-8k/{cfg.n_heads}) for {cfg.n_heads} heads: the power-of-two formula",
            _power_of_two_fix,
            when=lambda cfg: bool(cfg.n_heads & (cfg.n_heads - 1)),
        ),
        DiagnoseCause(
            "alibi", "sign", "the sign flipped: m_h (p_i - p_j), past keys raised instead of lowered", _sign_fix
        ),
    ),
    mistakes=(
        PlantedMistake(
            "alibi power-of-two slopes",
            "alibi",
            "slopes 2**(-8k/H) whatever H",
            "power_of_two",
            runs=lambda cfg, q_tokens: bool(cfg.n_heads & (cfg.n_heads - 1)),
        ),
        PlantedMistake("alibi sign", "alibi", "m_h (p_i - p_j) added instead of m_h (p_j - p_i)", "sign"),
    ),
    settings=(("alibi", BLOOM_LIKE),),
    simulated=SimulatedSteps(bias=_simulated_bias),
    planted=PlantedSteps(bias=_planted_bias),
    head_slots=True,
)


ENTRY = Variant(
    name="alibi",
    summary="m_h * (p_j - p_i) added to the scores",
    **flag("alibi", declare=False),  # a field of MHAConfig's own
    validate=_validate,
    **additive_bias("m_h (p_j - p_i) (alibi)"),
    forward=_forward,
    distance_slopes=lambda cfg: alibi_slopes(cfg.n_heads),  # the adapters' m_h (p_j - p_i), in their arithmetic
    check_cases=(
        CaseSpec(
            "alibi",
            "BLOOM: ALiBi with 6 heads (not a power of two: the interleaved second slope series)",
            BLOOM_LIKE,
            dict(q_tokens=9, dtypes=("float64", "float32"), seed=26),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "alibi",
            "ALiBi slopes on the distance of positions (no rotary)",
            BLOOM_LIKE,
            dict(tokens=9, prefill=4, seed=114),
        ),
    ),
    bench=BenchSpec({"alibi": True}, "plain"),
    cli=(switch_option("--alibi", {"alibi": True}, "ALiBi: m_h (p_j - p_i) added to the scores", rank=50),),
    explain=explain,
    diagnose=DIAGNOSE,
)
