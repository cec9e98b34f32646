"""Attention sinks (gpt-oss): one learned logit per head in the softmax denominator only."""

from __future__ import annotations

import numpy as np

from .._validate import require_bool
from ._diagnose import GQA_ROTARY, DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, Explanation, ParamSpec, ScoreStep, Variant, switch_option
from ._shared import flag, softmax_with_empty_rows, written_once
from .models import GPT_OSS_YARN


def softmax_with_sinks(scores: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """Softmax over the last axis of (B, H, Nq, Nk) scores, with head h's sink in every denominator.

    ``a_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik))``: the sink takes a share of each row and
    gives nothing back, so a row sums to less than 1. A row with no allowed key is all zeros
    (the spec's rule, with or without sinks). ``sinks`` None is the plain softmax.
    """
    if sinks is None:
        return softmax_with_empty_rows(scores)
    sink = np.broadcast_to(np.asarray(sinks, dtype=scores.dtype)[None, :, None, None], (*scores.shape[:-1], 1))
    row_max = np.maximum(np.max(scores, axis=-1, keepdims=True), sink)  # finite: the sink always is
    exp = np.exp(scores - row_max)
    return exp / (np.exp(sink - row_max) + np.sum(exp, axis=-1, keepdims=True))


def sink_vjp(weights: np.ndarray, row_dot: np.ndarray):
    """One head's sink gradient: the sink's weight ``1 - sum_j A_ij`` times ``(0 - row_dot)``, summed.

    ``weights`` (B, Nq, Nk) are the head's attention weights, ``row_dot`` (B, Nq, 1) is
    ``sum_j dA_ij A_ij``, the softmax backward's row term (the sink's own score gradient is
    ``A_sink (0 - row_dot)``: its value vector is zero).
    """
    return -np.sum((1.0 - weights.sum(axis=-1, keepdims=True)) * row_dot)


def _forward(cfg: Config, p, masked: np.ndarray) -> np.ndarray:  # the registry's softmax step (`ScoreStep`)
    return softmax_with_sinks(masked, p["sinks"])


def _backward(cfg: Config, weights: np.ndarray, row_dot: np.ndarray) -> dict:
    return {"sinks": sink_vjp(weights, row_dot)}


def _validate(cfg: Config) -> dict:
    require_bool("sinks", cfg.sinks)
    return {}


def explain(demo) -> Explanation:
    _, _, stages, _, _ = demo.run("sinks")
    sums = stages["weights"].sum(axis=-1)  # (B, H, Nq)
    return Explanation(
        "sinks=True",
        "a_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik))",
        "in the softmax's denominator",
        [
            (
                "Hugging Face",
                "gpt-oss: self_attn.sinks (n_heads,): concatenated as one more logit column, softmax, "
                "then dropped (probs[..., :-1])",
            ),
            ("any library", "one more key with logit sink_h and a zero value vector"),
        ],
        [
            f"rows sum to less than 1: in the demonstration between {sums.min():.3g} and {sums.max():.3g}",
            "a sink that keeps its column with a value vector (a sink token) adds that value: the sink's value must be zero",
        ],
    )


# -- diagnose: the sinks ignored, or a sink with a value ----------------------------------------------------------
def _simulated_softmax(cfg: Config, p, masked, mistake):
    return softmax_with_sinks(masked, None if mistake == "ignored" else p.sinks)


def _simulated_value(cfg: Config, weights, values, mistake):
    """What a sink with a value adds to the context: its share of each row times the first key's value, or 0."""
    if mistake != "value":
        return 0.0
    share = 1.0 - weights.sum(axis=-1, keepdims=True)  # (B, H, Nq, 1): the sink's weight
    return share * values[:, :, :1]  # (B, H, Nq, Dv)


def _planted(idioms) -> PlantedSteps:
    """gpt-oss's sink in the candidates, in ``idioms``' library: one more logit column (and, mistaken, a value
    row); each step returns (scores, v, drop the column after the softmax)."""

    def column(cfg: Config, params, scores, v, mistake):
        if mistake == "ignored":
            return scores, v, False
        logits = idioms.asarray(params.sinks)  # (H,)
        sink = idioms.broadcast_to(logits[:, None, None], (*scores.shape[:-1], 1))  # (B, H, Nq, 1) view
        scores = idioms.concat([scores, sink], axis=-1)  # (B, H, Nq, Nk+1)
        if mistake == "value":  # (B, H, Nk+1, Dv): the first key's value
            return scores, idioms.concat([v, v[:, :, :1]], axis=2), False
        return scores, v, True

    return PlantedSteps(columns=column)


DIAGNOSE = DiagnoseSpec(
    rank=50,
    causes=(
        DiagnoseCause(
            "sinks",
            "ignored",
            "ignored: the plain softmax",
            "put head h's sink in every row's denominator, a_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik)): "
            "gpt-oss concatenates the sink as one more logit column, takes the softmax, and drops that column",
        ),
        DiagnoseCause(
            "sinks",
            "value",
            "the sink's weight multiplies a value (the first key's) instead of being dropped",
            "the sink takes a share of each row and gives nothing back: drop its column after the softmax "
            "(gpt-oss's probs[..., :-1]), do not pair it with a value row (a sink token)",
        ),
    ),
    mistakes=(
        PlantedMistake("sinks ignored", "sinks", "the plain softmax, no sink column", "ignored"),
        PlantedMistake("sink with a value", "sinks", "the sink column kept, with the first key's value", "value"),
    ),
    # gpt-oss's: sinks, a causal window of 3, biases, YaRN (its defaults of beta_fast and beta_slow), GQA; d_k = 6.
    settings=(("sinks-yarn", dict(GQA_ROTARY, rope_base=150000.0, window=3, sinks=True, rope_scaling=GPT_OSS_YARN)),),
    simulated=SimulatedSteps(softmax=_simulated_softmax, context=_simulated_value),
    **written_once(_planted),
    regroup_heads=lambda cfg, params, order: {"sinks": params.sinks[order]},
)


ENTRY = Variant(
    name="sinks",
    summary="one learned logit per head in the softmax denominator",
    **flag("sinks", declare=False),  # a field of MHAConfig's own
    validate=_validate,
    # Sink logits N(0, 1): the size of a score, so that a sink takes a visible share of each row.
    # One per query head (``head_axis``), fed to the softmax (``score_part``: `score_steps(..., sinks=)`).
    params=(
        ParamSpec(
            "sinks",
            "sinks",
            lambda cfg: (cfg.n_heads,) if cfg.sinks else None,
            centre=0.0,
            spread=1.0,
            head_axis=0,
            score_part="sinks",
        ),
    ),
    score_step=ScoreStep("softmax", "softmax"),  # the ops objects' softmax(scores, empty_rows, sinks=)
    # A fused kernel takes them only with a sinks argument of its own (MLX's sinks=) or through the log-sum-exp
    # it returns (jax-dpa's, FlexAttention's rescaling by sigmoid(lse - sink)).
    kernel_refusal="{kernel} has no sinks: its softmax takes no extra logit in the denominator",
    forward=_forward,
    backward=_backward,
    check_cases=(
        CaseSpec(
            "sinks",
            "attention sinks: one learned logit per head in the softmax denominator (rows sum to less than 1)",
            dict(d_model=20, n_heads=5, sinks=True),  # d_k = 4
            dict(dtypes=("float64", "float32"), seed=27),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "sinks",
            "one learned sink logit per head in the softmax denominator",
            dict(d_model=20, n_heads=5, causal=True, sinks=True),  # d_k = 4
            dict(tokens=8, prefill=2, seed=115),
        ),
    ),
    bench=BenchSpec({"sinks": True}, "plain"),
    cli=(switch_option("--sinks", {"sinks": True}, "one learned logit per head in the softmax denominator", rank=60),),
    explain=explain,
    diagnose=DIAGNOSE,
)
