"""Canonical parameters of one attention layer, and their deterministic initialisation.

The canonical layout is the scorer-rows layout of ``torch.nn.Linear.weight``:
every weight is ``(out_features, in_features)`` and a projection computes
``y = x @ w.T + b`` for row samples (equivalently ``Y = w @ X`` for column samples).
Row ``i`` of a weight is the *scorer* that produces output feature ``i``.

Head ownership follows from the merged layout: rows ``h*d_k:(h+1)*d_k`` of ``w_q``
belong to query head ``h``; rows ``g*d_k:(g+1)*d_k`` of ``w_k`` (and ``g*d_v:(g+1)*d_v``
of ``w_v``) to kv head ``g``; columns ``h*d_v:(h+1)*d_v`` of ``w_o`` read head ``h``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .config import MHAConfig, require_config
from .variants import param_spec, variants_on

WEIGHT_NAMES = ("w_q", "w_k", "w_v", "w_o")
BIAS_NAMES = ("b_q", "b_k", "b_v", "b_o")


@dataclass(frozen=True)
class MHAParams:
    """Weights ``(out, in)`` and biases ``(out,)`` in float64; biases are None without bias.

    The variants' parameters are None unless their `MHAConfig` field is on:
    ``q_norm``/``k_norm`` (QK-norm weights: ``(d_k,)`` each with ``qk_norm="head"``,
    ``(n_heads*d_k,)``/``(n_kv_heads*d_k,)`` with ``"projection"``), ``sinks`` ``(n_heads,)``
    and ``rel_bias`` ``(rel_buckets, n_heads)`` (T5's ``relative_attention_bias.weight``), ``w_gate``
    ``(n_heads*d_k, d_model)`` and ``b_gate`` (with q's bias) with ``attn_output_gate``; MLA's down-projections,
    their biases and latent norms with ``kv_lora_rank`` and ``q_lora_rank`` (`core.variants.mla`, which also
    changes the shapes of ``w_q``, ``w_k``, ``w_v`` and drops ``b_q``, ``b_k``, ``b_v``).
    """

    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray
    b_q: np.ndarray | None = None
    b_k: np.ndarray | None = None
    b_v: np.ndarray | None = None
    b_o: np.ndarray | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    sinks: np.ndarray | None = None
    rel_bias: np.ndarray | None = None
    w_gate: np.ndarray | None = None
    b_gate: np.ndarray | None = None
    w_kv_a: np.ndarray | None = None
    b_kv_a: np.ndarray | None = None
    kv_a_norm: np.ndarray | None = None
    w_q_a: np.ndarray | None = None
    b_q_a: np.ndarray | None = None
    q_a_norm: np.ndarray | None = None

    def as_dict(self) -> dict[str, np.ndarray | None]:
        """Weights and biases by name (None where absent), then the variants' parameters that are present.

        The variants' names appear only when set, so code written for the 2017-23 layer (eight
        names) never meets one it does not know; an implementation that reads them declares the
        variant (`Backend.variants`).
        """
        named = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in named.items() if k not in VARIANT_PARAM_NAMES or v is not None}

    def astype(self, dtype) -> MHAParams:
        """The same parameters cast to ``dtype`` (a NumPy or ml_dtypes dtype)."""
        cast: dict = {k: None if v is None else v.astype(dtype) for k, v in self.as_dict().items()}
        return MHAParams(**cast)  # the weights are arrays, the biases arrays or None, as in self


# The learned parameters of the variants (each a `ParamSpec` of its entry in `core.variants`), each
# present only when its MHAConfig field switches it on: QK-norm weights, one sink logit per head,
# T5's bucket table. In MHAParams' field order, the order init_params draws them in.
PARAM_NAMES = tuple(f.name for f in fields(MHAParams))
VARIANT_PARAM_NAMES = PARAM_NAMES[len(WEIGHT_NAMES) + len(BIAS_NAMES) :]


def expected_param_shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...] | None]:
    """Shape of every canonical parameter for ``cfg`` (None: absent for this configuration, see `absent_because`)."""
    weights: dict[str, tuple[int, ...]] = {
        "w_q": (cfg.q_width, cfg.d_model),
        "w_k": (cfg.k_width, cfg.kdim),
        "w_v": (cfg.v_width, cfg.vdim),
        "w_o": (cfg.d_model, cfg.context_width),
    }
    shapes: dict[str, tuple[int, ...] | None] = dict(weights)
    for w_name, b_name in zip(WEIGHT_NAMES, BIAS_NAMES, strict=True):
        shapes[b_name] = (weights[w_name][0],) if cfg.qkv_bias else None
    if not cfg.output_bias:
        shapes["b_o"] = None
    for name in VARIANT_PARAM_NAMES:
        shapes[name] = param_spec(name).shape(cfg)
    for entry in variants_on(cfg):  # MLA's w_q, w_k, w_v read its latents, and it has no q, k, v biases
        shapes.update(entry.base_shapes(cfg) if entry.base_shapes is not None else {})
    return shapes


def absent_because(cfg: MHAConfig, name: str) -> str:
    """The field of ``cfg`` that decides whether parameter ``name`` exists, with its value (for errors)."""
    owners = [e.name for e in variants_on(cfg) if e.base_shapes is not None and name in e.base_shapes(cfg)]
    if owners:  # MLA: no q, k, v biases whatever cfg.bias says
        return f"variant {owners[0]!r} is on (core.variants.{owners[0]}.base_shapes)"
    if name in BIAS_NAMES:
        return f"cfg.bias is {cfg.bias!r}"
    field = param_spec(name).field
    return f"cfg.{field} is {getattr(cfg, field)!r}"


def validate_params(cfg: MHAConfig, params: MHAParams) -> MHAParams:
    """Raise if ``params`` does not fit ``cfg`` (e.g. parameters made for another config); else return them."""
    require_config(cfg)
    if not isinstance(params, MHAParams):
        raise TypeError(f"params must be MHAParams (from init_params or a converter), got {type(params).__name__}")
    for name, shape in expected_param_shapes(cfg).items():
        value = getattr(params, name)
        if shape is None:
            if value is not None:
                raise ValueError(
                    f"params.{name} must be None because {absent_because(cfg, name)}, "
                    f"got an array of shape {np.shape(value)}"
                )
            continue
        if value is None:
            raise ValueError(f"params.{name} is None but {absent_because(cfg, name)}; expected shape {shape}")
        if not isinstance(value, np.ndarray):
            raise TypeError(f"params.{name} must be a NumPy array, got {type(value).__name__}")
        if value.shape != shape:
            raise ValueError(
                f"params.{name} has shape {value.shape}, expected {shape} for {cfg.describe()} "
                "(were these parameters made for another configuration?)"
            )
        if value.dtype.kind != "f":
            raise TypeError(f"params.{name} must hold floating-point numbers, got dtype {value.dtype}")
    for entry in variants_on(cfg):  # one weight held twice (attention_k_eq_v: w_v is w_k)
        for name, same in entry.tied.items():
            if not np.array_equal(getattr(params, name), getattr(params, same)):
                raise ValueError(
                    f"params.{name} must equal params.{same} because cfg.{entry.fields[0]} is "
                    f"{getattr(cfg, entry.fields[0])!r} ({entry.summary}); they differ"
                )
    return params


def init_params(cfg: MHAConfig, seed: int = 0) -> MHAParams:
    """Deterministic canonical parameters for ``cfg`` (float64, same seed -> same numbers).

    Weights are drawn from N(0, 1/fan_in), so each projection keeps unit-variance inputs
    at unit variance; biases from N(0, 0.1^2), small but nonzero so that a dropped or
    misplaced bias is visible. With unit-variance inputs the scaled scores stay O(1),
    far from the float16 limit (65504) at every size the tests and benchmarks use.

    The variants' parameters come from a second generator, so that switching a variant on
    leaves every other parameter's numbers as they were, and none is trivial: each is
    ``centre + spread * N(0, 1)`` with its entry's figures (`core.variants.ParamSpec`): QK-norm
    weights ``1 + 0.3 N(0, 1)`` (not all one, so a dropped weight shows), sink logits
    ``N(0, 1)`` (the size of a score, so a sink takes a visible share of each row) and T5
    bucket biases ``0.5 N(0, 1)``.
    """
    require_config(cfg)
    rng = np.random.default_rng(seed)
    shapes = expected_param_shapes(cfg)
    arrays: dict = {}  # weights: arrays; biases: arrays or None
    for name in WEIGHT_NAMES:
        out_features, in_features = shapes[name] or ()  # a weight's shape is never None
        arrays[name] = rng.standard_normal((out_features, in_features)) / np.sqrt(in_features)
    for name in BIAS_NAMES:
        arrays[name] = None if shapes[name] is None else 0.1 * rng.standard_normal(shapes[name])
    variant_rng = np.random.default_rng((seed, 24))  # 24: the issue that added the variants
    for name in VARIANT_PARAM_NAMES:
        shape, spec = shapes[name], param_spec(name)
        arrays[name] = None if shape is None else spec.centre + spec.spread * variant_rng.standard_normal(shape)
    for entry in variants_on(cfg):  # a weight held twice is drawn once (attention_k_eq_v: w_v is a copy of w_k)
        arrays.update(
            {name: None if arrays[same] is None else arrays[same].copy() for name, same in entry.tied.items()}
        )
    return MHAParams(**arrays)
