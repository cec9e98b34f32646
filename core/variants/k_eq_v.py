"""Gemma 4's ``attention_k_eq_v``: on global layers the values are the key projection's raw output.

``Gemma4TextAttention`` (transformers 5.25) builds no ``v_proj`` on a global layer when
``config.attention_k_eq_v`` is set, and takes::

    key_states = k_proj(x).view(..., n_kv_heads, head_dim)
    value_states = key_states                       # before k_norm and rotary
    key_states = rotary(k_norm(key_states))         # the key path only
    value_states = v_norm(value_states)             # the value norm (core.variants.value_norm)

so V is ``x @ w_k.T (+ b_k)``, split per kv head: one weight for both. The values are taken *before* the
K-norm and the rotation (taking them after is the mistake to look for).

How the spec's parameters hold it: **tied**, ``w_v`` is ``w_k`` (and ``b_v`` is ``b_k``), not absent.
`init_params` draws ``w_k`` and copies it into ``w_v``; `validate_params` refuses parameters where the two
differ (`Variant.tied`). Why tied and not ``w_v=None``: every layout, converter, shard plan, cache and
convention of the package keeps one value projection, and with ``w_v == w_k`` each of them computes
``V = x @ w_k.T`` through its own value path unchanged: the form holds in every convention by the
parameters alone, with nothing to refuse. The cost is a second product of the same weight (a reader that
cares computes it once); the gradient of the one weight is ``d_w_k + d_w_v`` (each reports its use, as for
any tied weight). Readers (`models`) store ``k_proj`` once and fill ``w_v`` from it; writers write only ``k_proj``.

It needs ``d_v == d_k`` (V is a key head) and ``vdim == kdim`` (one input): `_validate` refuses either
mismatch. V is the key projection of the value input: in self-attention, Gemma 4's only use, that is the
key input.
"""

from __future__ import annotations

import numpy as np

from .._validate import require_bool
from ._diagnose import DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps
from ._entry import BenchSpec, CaseSpec, Config, Explanation, Variant, numbers, switch_option
from ._registry import norm_step  # the registry's lookup, at call time (a leaf: no import circle)
from ._shared import every_candidate, flag, resolved_head_dims
from .value_norm import GEMMA4_SLIDING

FIELD = "attention_k_eq_v"


def _validate(cfg: Config) -> dict:
    on = getattr(cfg, FIELD)
    require_bool(FIELD, on)
    if not on:
        return {}
    d_k, d_v = resolved_head_dims(cfg)  # and kdim, vdim below: as MHAConfig resolves them
    if d_v != d_k:
        raise ValueError(
            f"MHAConfig.{FIELD}=True needs d_v == d_k: the values are the key projection's output, one key head "
            f"(d_k features) per kv head; got d_k={d_k}, d_v={d_v}"
        )
    kdim = cfg.d_model if cfg.kdim is None else cfg.kdim
    vdim = cfg.d_model if cfg.vdim is None else cfg.vdim
    if kdim != vdim:
        raise ValueError(
            f"MHAConfig.{FIELD}=True needs vdim == kdim: w_v is w_k, so both read inputs of one width; "
            f"got kdim={kdim}, vdim={vdim}"
        )
    return {}


# Gemma 4's global layer at a small size: its own head size and kv-head count, V = K's projection, the value
# norm, proportional rotary (a quarter of the pairs turn), scale 1, full causal attention.
GEMMA4_GLOBAL = dict(
    GEMMA4_SLIDING,
    n_heads=2,
    n_kv_heads=1,
    d_k=16,
    value_norm=True,
    attention_k_eq_v=True,
    rope_base=1_000_000.0,
    rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25},
)


def _has_k_path(cfg: Config) -> bool:
    return norm_step(cfg) is not None or cfg.rope is not None  # something between k_proj and the keys


def values_read(cfg: Config, p, v, k_raw, k_rotated, mistake):
    """The values as a candidate with ``mistake`` takes them: the raw key projection's heads (the tied ``v``), or with
    ``"after_k_path"`` the keys after k_norm and rotary (NumPy or torch). The value norm's step runs after this one."""
    return k_rotated if mistake == "after_k_path" else v


# -- diagnose: V taken after the key path (k_norm and rotary) instead of k_proj's raw output -------------------
CAUSE = DiagnoseCause(
    "k_eq_v",
    "after_k_path",
    "V taken after the key path: value_states = the normed, rotated keys, where V is k_proj's raw output",
    "take value_states = k_proj(x) before k_norm and rotary (Gemma4TextAttention: value_states = key_states is "
    "read before key_states is normed and turned)",
    when=_has_k_path,
)
MISTAKE = PlantedMistake(
    "k_eq_v after the key path",
    "k_eq_v",
    "value_states = key_states after k_norm and rotary",
    "after_k_path",
    runs=lambda cfg, q_tokens: _has_k_path(cfg),
)


def explain(demo) -> Explanation:
    _, params, stages, _, _ = demo.run("k_eq_v")
    last = demo.tokens - 1  # the last token: its position turns its key, so the K path shows
    k, v = stages["k"][0, last], stages["v"][0, last]  # its raw key and value projections, (Hkv*Dk,)
    after = stages["k_rotated"][0, 0, last]  # its first kv head after the K path, (Dk,)
    return Explanation(
        f"{FIELD}=True (d_v == d_k; params.w_v is params.w_k)",
        "V = x @ w_k.T + b_k, the raw key projection split per kv head (before k_norm and rotary)",
        "the value projection: one weight for keys and values",
        [
            ("Hugging Face", "Gemma4TextAttention: v_proj is None on global layers; value_states = key_states"),
            ("spec", "w_v and b_v tied to w_k and b_k (init_params copies, validate_params refuses a difference)"),
        ],
        [
            f"the values are the key projection before the K path: token {last}'s first value features are "
            f"{numbers(v[:3], 3)} (= k: {numbers(k[:3], 3)}), not the key after its K path (k_norm where on, then rotary) {numbers(after[:3], 3)}",
            f"the one weight's gradient is the sum of both uses: d_w_k + d_w_v (shape {np.shape(params.w_k)})",
        ],
    )


ENTRY = Variant(
    name="k_eq_v",
    summary="the values are the key projection's raw output: one weight, w_v tied to w_k (Gemma 4 global layers)",
    **flag(FIELD),
    validate=_validate,
    tied={"w_v": "w_k", "b_v": "b_k"},
    diagnose=DiagnoseSpec(
        rank=75,  # with the forms of 2025-26, before a variant registered from outside at 80
        causes=(CAUSE,),
        mistakes=(MISTAKE,),
        settings=(("gemma4-global", GEMMA4_GLOBAL),),
        # Before the value norm's step (registry order), which norms what this one gives it. Array-agnostic: the
        # torch candidate runs it too.
        simulated=SimulatedSteps(values=values_read),
        **every_candidate(PlantedSteps(values=values_read)),
    ),
    # Every adapter and oracle computes it through the tied parameters (implemented_by None): nothing to apply.
    check_cases=(
        CaseSpec(
            "k_eq_v",
            "Gemma 4's global layer: V = the raw key projection (w_v tied to w_k), no value norm, scale 1",
            dict(GEMMA4_GLOBAL, value_norm=False),
            dict(batch=3, q_tokens=6, dtypes=("float64", "float32"), seed=83),
        ),
        CaseSpec(
            "gemma4_global",
            "Gemma 4's global layer whole: V = the raw key projection, value norm, proportional rotary, scale 1",
            GEMMA4_GLOBAL,
            dict(batch=3, q_tokens=6, dtypes=("float64",), seed=84),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "k_eq_v",
            "Gemma 4's global layer without the value norm: the cache's values are the raw key projections",
            dict(GEMMA4_GLOBAL, value_norm=False),
            dict(tokens=7, prefill=2, seed=181),
        ),
    ),
    # Its cost against plain attention: the same (V is still a product; a fused reader would save it).
    bench=BenchSpec({FIELD: True}, "plain", preset="forms"),
    cli=(
        switch_option(
            "--attention-k-eq-v",
            {FIELD: True},
            "Gemma 4's global layers: V = the key projection, w_v tied to w_k",
            rank=35,
        ),
    ),
    explain=explain,
)
