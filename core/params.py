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

WEIGHT_NAMES = ("w_q", "w_k", "w_v", "w_o")
BIAS_NAMES = ("b_q", "b_k", "b_v", "b_o")


@dataclass(frozen=True)
class MHAParams:
    """Weights ``(out, in)`` and biases ``(out,)`` in float64; biases are None without bias."""

    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray
    b_q: np.ndarray | None = None
    b_k: np.ndarray | None = None
    b_v: np.ndarray | None = None
    b_o: np.ndarray | None = None

    def as_dict(self) -> dict[str, np.ndarray | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def astype(self, dtype) -> MHAParams:
        """The same parameters cast to ``dtype`` (a NumPy or ml_dtypes dtype)."""
        cast: dict = {k: None if v is None else v.astype(dtype) for k, v in self.as_dict().items()}
        return MHAParams(**cast)  # the weights are arrays, the biases arrays or None, as in self


def expected_param_shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...] | None]:
    """Shape of every canonical parameter for ``cfg`` (None: absent without bias)."""
    weights: dict[str, tuple[int, ...]] = {
        "w_q": (cfg.q_width, cfg.d_model),
        "w_k": (cfg.k_width, cfg.kdim),
        "w_v": (cfg.v_width, cfg.vdim),
        "w_o": (cfg.d_model, cfg.context_width),
    }
    shapes: dict[str, tuple[int, ...] | None] = dict(weights)
    for w_name, b_name in zip(WEIGHT_NAMES, BIAS_NAMES, strict=True):
        shapes[b_name] = (weights[w_name][0],) if cfg.bias else None
    return shapes


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
                    f"params.{name} must be None because cfg.bias is False, got an array of shape {np.shape(value)}"
                )
            continue
        if value is None:
            raise ValueError(f"params.{name} is None but cfg.bias is True; expected shape {shape}")
        if not isinstance(value, np.ndarray):
            raise TypeError(f"params.{name} must be a NumPy array, got {type(value).__name__}")
        if value.shape != shape:
            raise ValueError(
                f"params.{name} has shape {value.shape}, expected {shape} for {cfg.describe()} "
                "(were these parameters made for another configuration?)"
            )
        if value.dtype.kind != "f":
            raise TypeError(f"params.{name} must hold floating-point numbers, got dtype {value.dtype}")
    return params


def init_params(cfg: MHAConfig, seed: int = 0) -> MHAParams:
    """Deterministic canonical parameters for ``cfg`` (float64, same seed -> same numbers).

    Weights are drawn from N(0, 1/fan_in), so each projection keeps unit-variance inputs
    at unit variance; biases from N(0, 0.1^2), small but nonzero so that a dropped or
    misplaced bias is visible. With unit-variance inputs the scaled scores stay O(1),
    far from the float16 limit (65504) at every size the tests and benchmarks use.
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
    return MHAParams(**arrays)
