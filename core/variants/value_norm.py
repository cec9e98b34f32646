"""Gemma 4's value norm: each kv head's values through an RMS norm without a weight, before the weighted sum.

``Gemma4TextAttention`` (transformers 5.25) builds ``v_norm = Gemma4RMSNorm(head_dim, eps=rms_norm_eps,
with_scale=False)`` and runs it on the split values::

    value_states = v_norm(v_proj(x).view(..., n_kv_heads, head_dim))      # v / sqrt(mean_d(v**2) + eps)

The spec's stage ``v_normed`` (B, Hkv, Nk, Dv) is ``v_heads`` so normed, over each head's ``d_v`` features,
with the QK-norm's ``norm_eps`` (Gemma 4 has one ``rms_norm_eps`` for q, k and v); the context reads it in
place of ``v_heads``. A decode cache holds the normed values (transformers caches ``value_states`` after
``v_norm``): the norm is per token, so a step normalises only its own new values.

``transformers`` has no switch: every Gemma 4 attention layer has it. The field is ``value_norm`` (True: on),
the entry's name; ``v_norm`` is the module's attribute, and the spec keeps ``q_norm``/``k_norm`` for weights.
The norm has no weight, so it adds no parameter: reading a checkpoint, nothing of ``v_norm`` is stored.
"""

from __future__ import annotations

import numpy as np

from .._validate import require_bool
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, ConfigField, Explanation, StageSpec, Variant, numbers, switch_option
from ._registry import norm_place  # the registry's lookup, at call time (a leaf: no import circle)
from ._shared import OUR_ADAPTERS, rms_norm, rms_norm_vjp

FIELD = "value_norm"


def value_rms_norm(v_heads: np.ndarray, eps: float) -> np.ndarray:
    """``v / sqrt(mean(v**2 over the last axis) + eps)``: (..., Dv) -> the same shape, a new array (no weight)."""
    return rms_norm(v_heads, 1.0, eps)


def value_rms_norm_vjp(v_heads: np.ndarray, eps: float, d_normed: np.ndarray) -> np.ndarray:
    """The gradient of `value_rms_norm`'s input for the cotangent ``d_normed`` (RMSNorm's backward, weight 1)."""
    return rms_norm_vjp(v_heads, np.ones(v_heads.shape[-1]), eps, d_normed)[0]


# -- diagnose: the value norm forgotten, or taken with K's weight ---------------------------------------------
def values_read(cfg: Config, p, v, k_raw, k_rotated, mistake):
    """The values (B, Hkv, Nk, Dv) the weighted sum reads, as a candidate with ``mistake`` computes them (NumPy).

    None: the spec's ``value_rms_norm``; ``"dropped"``: the split values as projected; ``"k_weight"``: normed, then
    multiplied by the keys' ``k_norm`` weight (d_k == d_v). ``k_raw`` and ``k_rotated`` are k_eq_v's to read.
    """
    if mistake == "dropped":
        return v
    normed = value_rms_norm(v, cfg.norm_eps)
    return normed * p.k_norm if mistake == "k_weight" else normed


def _with_k_weight(cfg: Config) -> bool:
    return norm_place(cfg) == "head" and cfg.d_v == cfg.d_k  # a per-head (d_k,) key weight that fits the values


CAUSES = (
    DiagnoseCause(
        FIELD,
        "dropped",
        "the value norm forgotten: each kv head's values reach the weighted sum without v / sqrt(mean(v**2) + eps)",
        "normalise each kv head's values over its d_v features, no weight (Gemma4TextAttention.v_norm; "
        "core.variants.value_rms_norm); a cache holds the normed values",
    ),
    DiagnoseCause(
        FIELD,
        "k_weight",
        "V normed with K's weight: the values' RMS norm multiplied by k_norm's weight",
        "the value norm has no weight (Gemma4RMSNorm(head_dim, with_scale=False)): k_norm.weight scales the keys only",
        when=_with_k_weight,
    ),
)
MISTAKES = (
    PlantedMistake("value norm forgotten", FIELD, "v_proj(x) split and attended without v_norm", "dropped"),
    PlantedMistake(
        "value norm with K's weight",
        FIELD,
        "v_norm(v) * k_norm.weight: the keys' norm weight on the values",
        "k_weight",
        runs=lambda cfg, q_tokens: _with_k_weight(cfg),
    ),
)


def _validate(cfg: Config) -> dict:
    require_bool(FIELD, getattr(cfg, FIELD))
    return {}


STAGE = StageSpec(
    "value norm",
    "v_normed",
    "v_heads / sqrt(mean over each head's Dv features of v**2 + norm_eps), no weight (value_norm); "
    "the weighted sum reads it",
    after="v_heads",
    like="v_heads",
)
# Gemma 4's sliding layer at a small size (H*d = d_model, so every diagnose bug runs): GQA, per-head QK-norm with
# plain weights, scale 1 (the window is the case's).
GEMMA4_SLIDING = dict(
    d_model=32, n_heads=4, n_kv_heads=2, d_k=8, rope="half", causal=True, qk_norm="head", bias=False, scale=1.0
)


def explain(demo) -> Explanation:
    on, _, stages, _, _ = demo.run(FIELD)
    v = stages["v_heads"][0, :, 0]  # batch 0, token 0: (Hkv, Dv)
    rms = np.sqrt(np.mean(v * v, axis=-1) + on.norm_eps)  # (Hkv,)
    return Explanation(
        f"{FIELD}=True, norm_eps",
        "v_g <- v_g / sqrt(mean_d(v_g**2) + eps) for each kv head g and token, no weight; context = A_h @ v_normed_g",
        "after the head split, before the weighted sum (the cache holds the normed values)",
        [
            ("Hugging Face", "Gemma4TextAttention.v_norm = Gemma4RMSNorm(head_dim, with_scale=False): no weight"),
            ("Hugging Face", "Gemma 4's q_norm and k_norm multiply by their weight itself (not 1 + w, as Gemma 3)"),
        ],
        [
            f"forgetting the norm scales each kv head's values by its RMS: for token 0 of the demonstration those "
            f"are {numbers(rms, 3)}, so the context of every head that reads it is off by that factor",
            "normalising V with K's weight (k_norm) multiplies each value feature by that weight: the norm of V has "
            "none (Gemma4RMSNorm(head_dim, with_scale=False))",
        ],
    )


ENTRY = Variant(
    name="value_norm",
    summary="each kv head's values through an RMS norm without a weight before the weighted sum (Gemma 4)",
    fields=(FIELD, "norm_eps"),
    is_on=lambda cfg: bool(getattr(cfg, FIELD)),
    validate=_validate,
    config_fields=(ConfigField(FIELD, False, "bool"),),
    stage_specs=(STAGE,),
    forward=value_rms_norm,
    backward=value_rms_norm_vjp,
    diagnose=DiagnoseSpec(
        rank=75,  # with the forms of 2025-26, before a variant registered from outside at 80
        causes=CAUSES,
        mistakes=MISTAKES,
        settings=(
            ("gemma4-sliding", dict(GEMMA4_SLIDING, value_norm=True, window=3)),
        ),  # 3: the other settings' window
        simulated=SimulatedSteps(values=values_read),
        planted=PlantedSteps(values=values_read),
    ),
    implemented_by=OUR_ADAPTERS,  # through their ops object's `frameworks.ops.read_values`
    check_cases=(
        CaseSpec(
            FIELD,
            "Gemma 4's sliding layer: values RMS-normed per kv head (no weight), scale 1, QK-norm, a window of 4",
            dict(GEMMA4_SLIDING, value_norm=True, window=4),
            dict(q_tokens=7, dtypes=("float64",), seed=85),
        ),
    ),
    decode_cases=(
        CaseSpec(
            FIELD,
            "Gemma 4's value norm: the cache holds the normed values (each token's own norm, so a step norms its own)",
            dict(GEMMA4_SLIDING, value_norm=True),
            dict(tokens=10, prefill=3, seed=182),
        ),
    ),
    # Its cost against plain attention: one weightless RMS norm over the values (Hkv*Dv per token).
    bench=BenchSpec({FIELD: True}, "plain", preset="forms"),
    cli=(
        switch_option("--value-norm", {FIELD: True}, "Gemma 4's weightless RMS norm of each kv head's values", rank=33),
    ),
    demo_on={FIELD: True},
    demo_off={FIELD: False},
    explain=explain,
)
