"""The float64 backward oracle: the vector-Jacobian product of `reference_mha`, stage by stage.

Given a cotangent ``dO`` of the output (the gradient of some loss with respect to it),
`reference_mha_vjp` returns the gradient of ``<dO, output>`` with respect to the inputs
and every parameter. It is written from the formulas, in the order of the backward pass,
with every backward stage exposed (canonical layout, the forward stage's shape)::

    d_output  = dO                                           (B, Nq, D)
    d_merged  = d_output @ w_o                              (B, Nq, H*Dv)   dW_o = d_output^T merged, db_o = sum
                (attn_output_gate: d_gate = d_merged * merged, then d_merged * gate; dW_gate, dx_q through the sigmoid)
    d_context = d_merged split into heads                    (B, H, Nq, Dv)
    d_weights = d_context @ V_g^T                            (B, H, Nq, Nk)
    d_v_heads = sum over the group of A_h^T @ d_context      (B, Hkv, Nk, Dv)
    d_scores  = A * (d_weights - rowsum(d_weights * A))      (B, H, Nq, Nk)  softmax backward
    d_q_rotated = scale * d_scores @ K_g (K_g, Q_h rotated)  (B, H, Nq, Dk)
    d_k_rotated = sum over the group of scale * d_scores^T Q_h (B, Hkv, Nk, Dk)
    d_q_heads, d_k_heads = the rotations undone: R(-angle)   (the same without rope)
    d_q, d_k, d_v = the heads merged back                    (B, N, H*Dk) ...
    d_query = d_q @ w_q, dW_q = d_q^T x_q, db_q = sum over batch and tokens (likewise k, v)

Grouped-query attention: kv head ``g`` feeds the ``group_size`` query heads of its group,
so its gradients are the *sum* over that group (the backward-only bug this catches:
repeating the kv heads in the forward without summing their gradients).

Rotary embedding (``cfg.rope``): each feature pair is turned by its token's angle, an
orthogonal map, so its backward is the inverse rotation (the same tables with ``sin`` negated).

Masks need no extra rule: a blocked position has weight 0, so ``A * (...)`` gives it a zero
score gradient, and a query row with nothing to attend to (all weights 0 by the spec) gets
zero gradients everywhere upstream of its context (its output still reads ``b_o``).

The variants (`core.variants`), each undone in reverse pipeline order (the score steps by the
backward of each registry entry, in its own module; no variant is named in that part):

* sinks: the softmax backward is unchanged (the sink's own weight ``1 - sum_j A_ij`` has no
  cotangent), and ``d_sink_h = -sum_{b,i} (1 - sum_j A_ij) * sum_j dA_ij A_ij``;
* ALiBi and the relative bias are added, so ``d_capped_scores = d_biased_scores``, and each
  T5 bucket entry sums the score gradients of the (query, key) pairs that read it;
* softcap: ``d_scores = d_capped_scores * (1 - tanh(scores / c)**2)``;
* Llama 4's steps after rotary, undone first: the temperature (a per-position factor on q: its
  backward is the same factor) and the weightless QK-norm after rotary (RMSNorm's backward, weight 1);
* QK-norm: RMSNorm's backward (`core.variants.rms_norm_vjp`), over each head or over the
  whole projection, its weight gradient summed over batch, tokens (and heads);
* the value norm (Gemma 4): RMSNorm's backward with weight 1 (`core.variants.value_rms_norm_vjp`) from
  ``d_v_normed`` to ``d_v_heads``; with ``attention_k_eq_v`` ``w_v`` is ``w_k``, and its gradient is
  ``d_w_k + d_w_v`` (each parameter's gradient reports its own use);
* YaRN's attention factor scales the rotation; the transpose of a scaled rotation is the
  same tables with ``sin`` negated, as without it.

With ``rounding=dtype`` the same formulas run in float32 with every stage (forward and
backward) rounded to ``dtype``: "the spec's own float32 path rounded the same way", the
baseline of the half-precision gradient rule in `core.tolerances`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import MHAConfig
from .dtypes import check_dtype_name, numpy_dtype
from .inputs import _as_float_array, prepare_inputs
from .params import PARAM_NAMES, MHAParams, validate_params
from .reference import as_float64, forward_stages, operands
from .rotary import apply_rotary, rotary_tables
from .stages import stage_names
from .variants import (
    VARIANT_REGISTRY,
    gate_backward,
    mla_heads,
    norm_after_rope_vjp,
    norm_step,
    rms_norm_vjp,
    steps_at_place,
    temper_vjp,
    value_rms_norm_vjp,
)
from .variants.mla import mla_on

# Backward stages in the order the backward pass produces them, each with the forward
# stage whose shape (and canonical layout) it has.
# A variant's backward stage exists exactly when its forward stage does (`core.stages.stage_names`); those of the
# variants' stages are inserted from their entries' `StageSpec`s below.
GRAD_STAGES: tuple[tuple[str, str], ...] = (
    ("d_output", "output"),
    ("d_merged", "merged"),
    ("d_context", "context"),
    ("d_weights", "weights"),
    ("d_v_heads", "v_heads"),
    ("d_scores", "scores"),
    ("d_q_rotated", "q_rotated"),
    ("d_k_rotated", "k_rotated"),
    ("d_q_heads", "q_heads"),
    ("d_k_heads", "k_heads"),
    ("d_q", "q"),
    ("d_k", "k"),
    ("d_v", "v"),
)


def _with_registry_stages(stages):
    """``stages`` with the backward stage of each stage an entry adds (`StageSpec`), right before that of its
    ``grad_before`` (default: its anchor), in registry order; a stage several entries add into, once."""
    listed, last = list(stages), []  # the backward stages of stages added `before` one: last, in reverse order
    for entry in VARIANT_REGISTRY.values():
        for spec in entry.stage_specs:
            if f"d_{spec.name}" in (name for name, _ in (*listed, *last)):
                continue  # declared by an entry before (`core.stages` checks that the declarations agree)
            if spec.before:
                last.insert(0, (f"d_{spec.name}", spec.name))
                continue
            at = [forward for _, forward in listed].index(spec.grad_before or spec.after)
            listed.insert(at, (f"d_{spec.name}", spec.name))
    return (*listed, *last)


GRAD_STAGES = _with_registry_stages(GRAD_STAGES)
GRAD_STAGE_NAMES = tuple(name for name, _ in GRAD_STAGES)


def grad_stage_names(cfg: MHAConfig) -> tuple[str, ...]:
    """The backward stages of ``cfg``'s pipeline, in the order the backward pass produces them."""
    present = set(stage_names(cfg))
    return tuple(name for name, forward in GRAD_STAGES if forward in present)


# The parameter gradients a backward pass returns, in the order reports list them.
GRAD_PARAM_NAMES = PARAM_NAMES

# The default cotangent's seed. Never all-ones: with dO = 1 every output feature gets the
# same weight, so a permutation of the value (or output) features would go unseen.
COTANGENT_SEED = 20_241_130


@dataclass(frozen=True)
class MHAGrads:
    """Gradients of ``<cotangent, output>``.

    ``d_query``, ``d_key``, ``d_value`` have the inputs' shapes (unbatched if the call was);
    ``d_key`` is None when key was defaulted to query (its gradient is then part of
    ``d_query``), ``d_value`` None when value was defaulted to key (part of ``d_key``, or of
    ``d_query`` when both were defaulted). ``d_params`` is an `MHAParams` of gradients in the
    canonical ``(out, in)`` layout, biases None without bias. ``stages`` holds the backward
    stages of `GRAD_STAGES` (batched, canonical layout) where the implementation exposes them.
    """

    d_query: np.ndarray
    d_key: np.ndarray | None
    d_value: np.ndarray | None
    d_params: MHAParams
    stages: dict[str, np.ndarray]

    def tensors(self) -> dict[str, np.ndarray]:
        """Every gradient that is present, by name (d_query ... then w_q ... b_o)."""
        named = {"d_query": self.d_query, "d_key": self.d_key, "d_value": self.d_value, **self.d_params.as_dict()}
        return {name: value for name, value in named.items() if value is not None}


def default_cotangent(shape: tuple[int, ...]) -> np.ndarray:
    """The fixed random cotangent used when none is given (float64, standard normal)."""
    return np.random.default_rng(COTANGENT_SEED).standard_normal(shape)


def check_cotangent(cotangent, output_shape: tuple[int, ...]) -> np.ndarray:
    """The cotangent as float64, or a clear error; None gives `default_cotangent`.

    NaN or inf entries are accepted and propagate (see `reference_mha_vjp`).
    """
    if cotangent is None:
        return default_cotangent(output_shape)
    array = _as_float_array("cotangent", cotangent)
    if array.shape != tuple(output_shape):
        raise ValueError(
            f"cotangent must have the output's shape {tuple(output_shape)} "
            f"((batch, q_tokens, d_model), or (q_tokens, d_model) unbatched), got shape {array.shape}"
        )
    return array.astype(np.float64)


def fold_defaulted_inputs(d_query, d_key, d_value, key_given: bool, value_given: bool):
    """Gradients of three separate inputs -> the caller's view, where defaulted inputs alias.

    value defaults to key and key to query, so a defaulted input's gradient is added to
    the input it stood for and reported as None.
    """
    if not value_given:
        d_key, d_value = d_key + d_value, None
    if not key_given:
        d_query, d_key = d_query + d_key, None
    return d_query, d_key, d_value


def output_shape(cfg: MHAConfig, query) -> tuple[int, ...]:
    """The shape of the output (and so of the cotangent) for ``query``."""
    return (*np.shape(query)[:-1], cfg.d_model)


def _rounder(rounding):
    """(compute dtype, round-to-storage function) for ``rounding`` (None: float64, exact)."""
    if rounding is None:
        return np.float64, lambda a: a
    storage = numpy_dtype(check_dtype_name(rounding))

    def rounded(array):
        return np.asarray(array).astype(storage).astype(np.float32)

    return np.float32, rounded


def _after_rope_backward(cfg: MHAConfig, fwd, positions, d_q, d_k, stages: dict, r):
    """The cotangents of q_rotated, k_rotated from those of what the scores read (Llama 4's steps undone).

    The temperature is a per-position factor: its backward is the same factor. The weightless norm's is
    RMSNorm's (`core.variants.norm_after_rope_vjp`), on the rotated heads it read.
    """
    if cfg.attn_temperature_tuning:
        stages["d_q_tempered"] = d_q
        d_q = r(temper_vjp(cfg, positions, d_q))
    if cfg.qk_norm_after_rope:
        stages.update(d_q_rotated_normed=d_q, d_k_rotated_normed=d_k)
        d_q, d_k = (r(a) for a in norm_after_rope_vjp(cfg, fwd["q_rotated"], fwd["k_rotated"], d_q, d_k))
    return d_q, d_k


def reference_mha_vjp(
    cfg: MHAConfig,
    params: MHAParams,
    query,
    key=None,
    value=None,
    mask=None,
    cotangent=None,
    *,
    positions=None,
    kv_positions=None,
    rounding: str | None = None,
) -> MHAGrads:
    """The float64 backward oracle; see the module docstring for the formulas.

    ``cotangent`` has the output's shape (default: `default_cotangent`). A NaN (or inf) in
    it is not an error: it propagates, like any other number, to every gradient entry that
    sums over it: the whole ``w_o`` row and ``b_o`` entry of its feature, the inputs of its
    batch item that its query attends to, and through them every weight gradient.
    """
    inputs = prepare_inputs(cfg, query, key, value, mask, positions, kv_positions)
    d_out = check_cotangent(cotangent, output_shape(cfg, query))
    compute, r = _rounder(rounding)
    validate_params(cfg, params)
    tables = rotary_tables(cfg, inputs)
    # The forward of `reference_stages`: float64 (r the identity), or every operand and stage rounded to storage.
    p, x_q, x_k, x_v = operands(params, inputs, as_float64 if rounding is None else r)
    fwd = forward_stages(cfg, p, x_q, x_k, x_v, inputs, r)
    d_out = r(d_out if inputs.batched else d_out[None]).astype(compute)  # (B, Nq, D)

    B, Nq, Nk = inputs.batch, inputs.q_tokens, inputs.kv_tokens
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    stages: dict[str, np.ndarray] = {"d_output": d_out}

    # Output projection: out = merged @ w_o.T + b_o (merged * gate with attn_output_gate).
    gate = fwd.get("gate")  # (B, Nq, H*Dv) or None
    read = fwd["merged"] if gate is None else r(fwd["merged"] * gate)  # what w_o reads
    d_w_o = r(np.einsum("bno,bni->oi", d_out, read))  # (D, H*Dv): dY^T X over every token
    d_b_o = None if p["b_o"] is None else r(d_out.sum(axis=(0, 1)))  # (D,)
    d_merged = r(d_out @ p["w_o"])  # (B, Nq, H*Dv)
    d_variant_params: dict = {}
    d_xq_gate = None
    if gate is not None:  # read = merged * gate: each factor's gradient is the other's product with d_read
        d_gate = stages["d_gate"] = r(d_merged * fwd["merged"])
        d_merged = r(d_merged * gate)
        d_xq_gate, d_w_gate, d_b_gate = gate_backward(x_q, p["w_gate"], gate, d_gate)
        d_variant_params["w_gate"] = r(d_w_gate)
        if p.get("b_gate") is not None:
            d_variant_params["b_gate"] = r(d_b_gate)
    stages["d_merged"] = d_merged

    # Merge heads: head h owns columns h*Dv:(h+1)*Dv.
    d_context = stages["d_context"] = np.stack(
        [d_merged[:, :, h * Dv : (h + 1) * Dv] for h in range(H)], axis=1
    )  # (B, H, Nq, Dv)

    # The scores read the rotated queries and keys (the heads themselves without rope).
    q_heads = fwd.get("q_tempered", fwd.get("q_rotated_normed", fwd["q_rotated"]))  # what the scores read
    k_heads = fwd.get("k_rotated_normed", fwd["k_rotated"])
    weights = fwd["weights"]
    v_heads = fwd.get("v_normed", fwd["v_heads"])  # what the weighted sum read (normed with value_norm)
    d_weights = np.empty((B, H, Nq, Nk), dtype=compute)
    d_masked = np.empty_like(d_weights)
    d_v_heads = np.zeros((B, Hkv, Nk, Dv), dtype=compute)
    softmax = steps_at_place(cfg, "softmax")  # the sinks: the softmax backward plus their own gradient
    d_softmax: dict[str, np.ndarray] = {}
    for h in range(H):
        g = cfg.kv_head_of(h)
        a = weights[:, h]  # (B, Nq, Nk)
        d_weights[:, h] = r(d_context[:, h] @ np.swapaxes(v_heads[:, g], -1, -2))  # (B, Nq, Nk)
        # Every query head of group g read V_g and K_g: their gradients add up.
        d_v_heads[:, g] += np.swapaxes(a, -1, -2) @ d_context[:, h]  # (B, Nk, Dv)
        # Softmax backward: dS = A * (dA - sum_j dA_j A_j). Blocked keys and empty rows have A = 0.
        row_dot = np.sum(d_weights[:, h] * a, axis=-1, keepdims=True)  # (B, Nq, 1)
        d_masked[:, h] = r(a * (d_weights[:, h] - row_dot))
        for entry in softmax:  # the sink's weight 1 - sum_j A_ij times (0 - row_dot)
            for name, grad in entry.step_backward(cfg, a, row_dot).items():
                d_softmax.setdefault(name, np.zeros(H, dtype=compute))[h] = grad
    d_v_heads = r(d_v_heads)
    stages["d_weights"] = d_weights
    if "v_normed" in fwd:  # the value norm undone (Gemma 4): RMSNorm's backward with weight 1
        stages["d_v_normed"] = d_v_heads
        d_v_heads = r(value_rms_norm_vjp(fwd["v_heads"], cfg.norm_eps, d_v_heads))
    stages["d_v_heads"] = d_v_heads

    # Back through the registry's score steps: the biases (added), then the transforms in reverse.
    d_last = d_masked
    d_variant_params.update({name: r(grad) for name, grad in d_softmax.items()})
    biases = steps_at_place(cfg, "bias")
    if biases:
        stages[f"d_{biases[0].stages[0]}"] = d_last
        for entry in biases:
            if entry.backward is not None:
                grads = entry.backward(cfg, d_last, inputs.positions, inputs.kv_positions)
                d_variant_params.update({name: r(grad) for name, grad in grads.items()})
    transforms = steps_at_place(cfg, "transform")
    inputs_of = ["scores"] + [entry.stages[0] for entry in transforms]  # each transform's input stage
    for entry, source in zip(reversed(transforms), reversed(inputs_of[:-1]), strict=True):
        stages[f"d_{entry.stages[0]}"] = d_last
        d_last = r(entry.step_backward(cfg, fwd[source], d_last))
    d_scores = stages["d_scores"] = d_last

    d_q_heads = np.empty((B, H, Nq, Dk), dtype=compute)
    d_k_heads = np.zeros((B, Hkv, Nk, Dk), dtype=compute)
    for h in range(H):
        g = cfg.kv_head_of(h)
        d_q_heads[:, h] = r(cfg.scale * (d_scores[:, h] @ k_heads[:, g]))  # (B, Nq, Dk)
        d_k_heads[:, g] += cfg.scale * (np.swapaxes(d_scores[:, h], -1, -2) @ q_heads[:, h])  # (B, Nk, Dk)
    d_k_heads = r(d_k_heads)
    d_q_heads, d_k_heads = _after_rope_backward(cfg, fwd, inputs.positions, d_q_heads, d_k_heads, stages, r)
    stages.update(d_q_rotated=d_q_heads, d_k_rotated=d_k_heads)
    if mla_on(cfg):  # MLA: back through its rotary, expansion and latents (core.variants.mla)
        rotate = mla_heads.Rotation(tables, apply_rotary)
        d_xq, d_xk, d_mla, d_heads = mla_heads.head_stages_vjp(
            cfg, p, fwd, x_q, x_k, d_q_heads, d_k_heads, d_v_heads, rotate, r
        )
        stages = {name: {**stages, **d_heads}[name] for name in grad_stage_names(cfg)}
        d_xq = d_xq if d_xq_gate is None else r(d_xq + d_xq_gate)
        d_query, d_key, _ = fold_defaulted_inputs(d_xq, d_xk, np.zeros_like(d_xk), key is not None, True)
        d_params = MHAParams(
            d_mla.pop("w_q"), d_mla.pop("w_k"), d_mla.pop("w_v"), d_w_o, b_o=d_b_o, **d_mla, **d_variant_params
        )
        return MHAGrads(
            inputs.unbatch(d_query), None if d_key is None else inputs.unbatch(d_key), None, d_params, stages
        )
    if tables is not None:  # undo the rotation: turn each pair back by its angle
        d_q_heads = r(apply_rotary(d_q_heads, tables.q_cos[:, None], -tables.q_sin[:, None], tables.style))
        d_k_heads = r(apply_rotary(d_k_heads, tables.k_cos[:, None], -tables.k_sin[:, None], tables.style))

    def merge(d_heads, n):  # (B, n, N, Dk) -> (B, N, n*Dk): each head's block back into its columns
        return np.concatenate([d_heads[:, h] for h in range(n)], axis=-1)

    def split(d_merged, n):  # the inverse of merge
        return np.stack([d_merged[:, :, h * Dk : (h + 1) * Dk] for h in range(n)], axis=1)

    step = norm_step(cfg)  # the norm before rotary (QK-norm), from the registry
    if step is not None:
        stages.update(d_q_normed=d_q_heads, d_k_normed=d_k_heads)
        q_norm, k_norm = p[step.weight("q")], p[step.weight("k")]  # present exactly when it is on (validate_params)
        if step.per_head:
            d_q_heads, d_q_norm = rms_norm_vjp(fwd["q_heads"], q_norm, cfg.norm_eps, d_q_heads)
            d_k_heads, d_k_norm = rms_norm_vjp(fwd["k_heads"], k_norm, cfg.norm_eps, d_k_heads)
        else:  # over the whole projection, before the split
            d_q_merged, d_q_norm = rms_norm_vjp(fwd["q"], q_norm, cfg.norm_eps, merge(d_q_heads, H))
            d_k_merged, d_k_norm = rms_norm_vjp(fwd["k"], k_norm, cfg.norm_eps, merge(d_k_heads, Hkv))
            d_q_heads, d_k_heads = split(d_q_merged, H), split(d_k_merged, Hkv)
        d_q_heads, d_k_heads, d_q_norm, d_k_norm = (r(a) for a in (d_q_heads, d_k_heads, d_q_norm, d_k_norm))
    stages.update(d_q_heads=d_q_heads, d_k_heads=d_k_heads)

    # Split heads backward: put each head's block back into its columns.
    d_q = stages["d_q"] = merge(d_q_heads, H)  # (B, Nq, H*Dk)
    d_k = stages["d_k"] = merge(d_k_heads, Hkv)  # (B, Nk, Hkv*Dk)
    d_v = stages["d_v"] = np.concatenate([d_v_heads[:, g] for g in range(Hkv)], axis=-1)  # (B, Nk, Hkv*Dv)
    stages = {name: stages[name] for name in grad_stage_names(cfg)}  # GRAD_STAGES order is the contract

    def linear_backward(d_y, x, w, b):
        """y = x @ w.T + b: dX = dY @ w, dW = dY^T X summed over tokens and batch, db = dY summed."""
        return r(d_y @ w), r(np.einsum("bno,bni->oi", d_y, x)), None if b is None else r(d_y.sum(axis=(0, 1)))

    d_xq, d_w_q, d_b_q = linear_backward(d_q, x_q, p["w_q"], p["b_q"])
    d_xq = d_xq if d_xq_gate is None else r(d_xq + d_xq_gate)  # x_q feeds the gate too
    d_xk, d_w_k, d_b_k = linear_backward(d_k, x_k, p["w_k"], p["b_k"])
    d_xv, d_w_v, d_b_v = linear_backward(d_v, x_v, p["w_v"], p["b_v"])
    d_query, d_key, d_value = fold_defaulted_inputs(d_xq, d_xk, d_xv, key is not None, value is not None)
    if step is not None:  # each weight's gradient under its own field, as the step names them
        d_variant_params.update({step.weight("q"): d_q_norm, step.weight("k"): d_k_norm})
    d_params = MHAParams(d_w_q, d_w_k, d_w_v, d_w_o, d_b_q, d_b_k, d_b_v, d_b_o, **d_variant_params)
    d_key, d_value = (None if d is None else inputs.unbatch(d) for d in (d_key, d_value))
    return MHAGrads(inputs.unbatch(d_query), d_key, d_value, d_params, stages)  # d_query is never None
