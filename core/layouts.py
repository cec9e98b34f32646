"""Converters between the canonical parameter layout and every layout users meet.

Canonical (see `core.params`): weights ``(out, in)``, rows are scorers, the layout of
``torch.nn.Linear.weight`` and of the column-sample convention ``Y = W_A @ X``.
Every converter here is pure NumPy and has an exact inverse (a transpose or a reshape
loses nothing), which the tests check bit for bit.

=====================================  ==============================  =====================
layout                                 shape of the query weight       from canonical
=====================================  ==============================  =====================
column samples, ``Y = W_A @ X``        ``(H*Dk, D)``                   identity
row samples, ``Y = X @ W_B``           ``(D, H*Dk)``                   ``W_B = W_A.T``
``nn.Linear.weight``                   ``(H*Dk, D)``                   identity
per-head row-sample ``W_h``            ``(H, D, Dk)``                  reshape, then transpose
``nn.MultiheadAttention`` packed       ``in_proj_weight (3E, E)``      stack q;k;v rows
Flax / Keras ``DenseGeneral`` kernel   ``(D, H, Dk)``                  transpose, then reshape
Flax / Keras output kernel             ``(H, Dv, D)``                  transpose, then reshape
Equinox ``MultiheadAttention``         ``(H*Dk, D)``                   identity
=====================================  ==============================  =====================
"""

from __future__ import annotations

from typing import overload

import numpy as np

from .config import MHAConfig
from .params import MHAParams, validate_params

# --- column samples and row samples -----------------------------------------------------


def to_row_sample(w_a: np.ndarray) -> np.ndarray:
    """Column-sample weight ``W_A (n, m)`` (rows are scorers) -> row-sample ``W_B = W_A.T (m, n)``."""
    return np.ascontiguousarray(w_a.T)


def from_row_sample(w_b: np.ndarray) -> np.ndarray:
    """Row-sample weight ``W_B (m, n)`` (columns are scorers) -> column-sample ``W_A (n, m)``."""
    return np.ascontiguousarray(w_b.T)


# --- per-head matrices and the merged matrix ---------------------------------------------


def split_head_matrices(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Canonical merged weight ``(H*d, in)`` -> per-head row-sample matrices ``(H, in, d)``.

    ``W_h = result[h]`` is what the column/row-sample article calls head h's own matrix: ``Q_h = X @ W_h``.
    """
    out_features, in_features = w.shape
    if out_features % n_heads:
        raise ValueError(f"weight has {out_features} output rows, not divisible by n_heads={n_heads}")
    head_dim = out_features // n_heads
    per_head_rows = w.reshape(n_heads, head_dim, in_features)  # (H, d, in): head h's scorer rows
    return np.ascontiguousarray(per_head_rows.transpose(0, 2, 1))  # (H, in, d)


def merge_head_matrices(per_head: np.ndarray) -> np.ndarray:
    """Per-head row-sample matrices ``(H, in, d)`` -> canonical merged weight ``(H*d, in)``.

    In row-sample form this is ``[W_0 | W_1 | ... ]`` side by side, ``(in, H*d)``;
    the canonical layout is its transpose.
    """
    n_heads, in_features, head_dim = per_head.shape
    side_by_side = per_head.transpose(1, 0, 2).reshape(in_features, n_heads * head_dim)  # (in, H*d)
    return np.ascontiguousarray(side_by_side.T)  # (H*d, in)


@overload
def split_head_bias(b: np.ndarray, n_heads: int) -> np.ndarray: ...
@overload
def split_head_bias(b: None, n_heads: int) -> None: ...
def split_head_bias(b: np.ndarray | None, n_heads: int) -> np.ndarray | None:
    """Merged bias ``(H*d,)`` -> per-head ``(H, d)``."""
    return None if b is None else b.reshape(n_heads, -1)  # (H, d)


@overload
def merge_head_bias(b: np.ndarray) -> np.ndarray: ...
@overload
def merge_head_bias(b: None) -> None: ...
def merge_head_bias(b: np.ndarray | None) -> np.ndarray | None:
    """Per-head bias ``(H, d)`` -> merged ``(H*d,)``."""
    return None if b is None else b.reshape(-1)  # (H*d,)


def split_output_matrix(w_o: np.ndarray, n_heads: int) -> np.ndarray:
    """Canonical ``w_o (D, H*Dv)`` -> per-head row-sample blocks ``(H, Dv, D)``: out = sum_h C_h @ W_o_h."""
    out_features, in_features = w_o.shape
    if in_features % n_heads:
        raise ValueError(f"w_o has {in_features} input columns, not divisible by n_heads={n_heads}")
    row_sample = w_o.T  # (H*Dv, D)
    return np.ascontiguousarray(row_sample.reshape(n_heads, in_features // n_heads, out_features))  # (H, Dv, D)


def merge_output_matrix(per_head: np.ndarray) -> np.ndarray:
    """Per-head output blocks ``(H, Dv, D)`` -> canonical ``w_o (D, H*Dv)``."""
    n_heads, head_dim, out_features = per_head.shape
    return np.ascontiguousarray(per_head.reshape(n_heads * head_dim, out_features).T)  # (D, H*Dv)


# --- torch.nn.MultiheadAttention ----------------------------------------------------------


def torch_mha_unsupported_reason(cfg: MHAConfig) -> str | None:
    """Why ``torch.nn.MultiheadAttention`` cannot hold ``cfg``, or None when it can."""
    if cfg.n_kv_heads != cfg.n_heads:
        return f"nn.MultiheadAttention has no grouped kv heads (n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads})"
    if cfg.d_k * cfg.n_heads != cfg.d_model or cfg.d_v != cfg.d_k:
        return (
            "nn.MultiheadAttention fixes d_k = d_v = embed_dim / num_heads "
            f"(here d_k={cfg.d_k}, d_v={cfg.d_v}, d_model={cfg.d_model}, n_heads={cfg.n_heads})"
        )
    if abs(cfg.scale - cfg.d_k**-0.5) > 1e-12 * cfg.d_k**-0.5:
        return f"nn.MultiheadAttention always scales by 1/sqrt(d_k); cfg.scale={cfg.scale}"
    return None


def _require_torch_mha(cfg: MHAConfig) -> None:
    reason = torch_mha_unsupported_reason(cfg)
    if reason:
        raise ValueError(f"cannot express {cfg.describe()} as nn.MultiheadAttention: {reason}")


def to_torch_mha_state_dict(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
    """Canonical params -> the state dict of ``torch.nn.MultiheadAttention(d_model, n_heads, bias=cfg.bias, kdim=cfg.kdim, vdim=cfg.vdim)``.

    With ``kdim == vdim == d_model`` torch packs q, k and v into ``in_proj_weight (3E, E)``
    (rows: q, then k, then v); otherwise it keeps ``q_proj_weight (E, E)``,
    ``k_proj_weight (E, kdim)``, ``v_proj_weight (E, vdim)``. Biases are always packed in
    ``in_proj_bias (3E,)``. Values are NumPy arrays; wrap them with ``torch.from_numpy``.
    """
    validate_params(cfg, params)
    _require_torch_mha(cfg)
    state: dict[str, np.ndarray] = {}
    if cfg.is_self_attention_shaped:
        state["in_proj_weight"] = np.concatenate([params.w_q, params.w_k, params.w_v], axis=0)  # (3E, E)
    else:
        state["q_proj_weight"] = params.w_q.copy()
        state["k_proj_weight"] = params.w_k.copy()
        state["v_proj_weight"] = params.w_v.copy()
    if cfg.bias:
        state["in_proj_bias"] = np.concatenate([params.b_q, params.b_k, params.b_v])  # (3E,)
    state["out_proj.weight"] = params.w_o.copy()
    if cfg.bias:
        state["out_proj.bias"] = params.b_o.copy()  # type: ignore[union-attr]  # cfg.bias: validated present
    return state


def from_torch_mha_state_dict(cfg: MHAConfig, state_dict) -> MHAParams:
    """State dict of ``torch.nn.MultiheadAttention`` (tensors or arrays) -> canonical params."""
    _require_torch_mha(cfg)
    state = {name: _to_numpy(value) for name, value in state_dict.items()}
    E = cfg.d_model
    if "in_proj_weight" in state and state["in_proj_weight"] is not None:
        w_q, w_k, w_v = np.split(state["in_proj_weight"], [E, 2 * E], axis=0)  # three (E, E) blocks
    else:
        missing = [n for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight") if n not in state]
        if missing:
            raise ValueError(f"state_dict has neither in_proj_weight nor {', '.join(missing)}")
        w_q, w_k, w_v = state["q_proj_weight"], state["k_proj_weight"], state["v_proj_weight"]
    biases: dict[str, np.ndarray | None] = {"b_q": None, "b_k": None, "b_v": None, "b_o": None}
    if cfg.bias:
        if "in_proj_bias" not in state or "out_proj.bias" not in state:
            raise ValueError("cfg.bias is True but state_dict lacks in_proj_bias or out_proj.bias")
        biases["b_q"], biases["b_k"], biases["b_v"] = np.split(state["in_proj_bias"], [E, 2 * E])
        biases["b_o"] = state["out_proj.bias"]
    return validate_params(cfg, MHAParams(w_q=w_q, w_k=w_k, w_v=w_v, w_o=state["out_proj.weight"], **biases))


def _to_numpy(value) -> np.ndarray:
    """A torch tensor (on any device) or an array-like -> NumPy, without importing torch."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


# --- Flax / Keras / Equinox -----------------------------------------------------------


def to_dense_general_kernel(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Canonical ``(H*d, in)`` -> Flax/Keras input-projection kernel ``(in, H, d)``."""
    out_features, in_features = w.shape
    return np.ascontiguousarray(w.T.reshape(in_features, n_heads, out_features // n_heads))  # (in, H, d)


def from_dense_general_kernel(kernel: np.ndarray) -> np.ndarray:
    """Flax/Keras input-projection kernel ``(in, H, d)`` -> canonical ``(H*d, in)``."""
    in_features, n_heads, head_dim = kernel.shape
    return np.ascontiguousarray(kernel.reshape(in_features, n_heads * head_dim).T)  # (H*d, in)


def to_flax_params(cfg: MHAConfig, params: MHAParams) -> dict[str, dict[str, np.ndarray]]:
    """Canonical params -> the ``params`` tree of ``flax.linen.MultiHeadDotProductAttention``.

    Flax (and Keras ``MultiHeadAttention``) keep the head axis in the kernel:
    ``query/key/value.kernel (in, H, head_dim)``, ``bias (H, head_dim)``,
    ``out.kernel (H, head_dim, out)``, ``out.bias (out,)``.
    """
    validate_params(cfg, params)
    if cfg.n_kv_heads != cfg.n_heads:
        raise ValueError(f"Flax MultiHeadDotProductAttention has no grouped kv heads (n_kv_heads={cfg.n_kv_heads})")
    tree: dict[str, dict[str, np.ndarray]] = {}
    for name, w, b in (
        ("query", params.w_q, params.b_q),
        ("key", params.w_k, params.b_k),
        ("value", params.w_v, params.b_v),
    ):
        tree[name] = {"kernel": to_dense_general_kernel(w, cfg.n_heads)}
        if b is not None:
            tree[name]["bias"] = split_head_bias(b, cfg.n_heads)  # (H, head_dim)
    tree["out"] = {"kernel": split_output_matrix(params.w_o, cfg.n_heads)}  # (H, Dv, D)
    if params.b_o is not None:
        tree["out"]["bias"] = params.b_o.copy()
    return tree


def from_flax_params(cfg: MHAConfig, tree) -> MHAParams:
    """The ``params`` tree of ``flax.linen.MultiHeadDotProductAttention`` -> canonical params."""
    arrays: dict = {}  # weights: arrays; biases: arrays or None
    for name, short in (("query", "q"), ("key", "k"), ("value", "v")):
        arrays[f"w_{short}"] = from_dense_general_kernel(np.asarray(tree[name]["kernel"]))
        bias = tree[name].get("bias")
        arrays[f"b_{short}"] = merge_head_bias(None if bias is None else np.asarray(bias))
    arrays["w_o"] = merge_output_matrix(np.asarray(tree["out"]["kernel"]))
    bias = tree["out"].get("bias")
    arrays["b_o"] = None if bias is None else np.asarray(bias)
    return validate_params(cfg, MHAParams(**arrays))


EQUINOX_NAMES = {"w_q": "query_proj", "w_k": "key_proj", "w_v": "value_proj", "w_o": "output_proj"}


def to_equinox_weights(cfg: MHAConfig, params: MHAParams) -> dict[str, dict[str, np.ndarray | None]]:
    """Canonical params -> ``{query_proj, key_proj, value_proj, output_proj}: {weight, bias}``.

    ``equinox.nn.MultiheadAttention`` uses ``eqx.nn.Linear`` layers whose weights are
    ``(out, in)`` like torch, so this is the canonical layout under other names.
    """
    validate_params(cfg, params)
    tree: dict[str, dict[str, np.ndarray | None]] = {}
    for w_name, module in EQUINOX_NAMES.items():
        bias = getattr(params, "b" + w_name[1:])  # w_q -> b_q
        tree[module] = {"weight": getattr(params, w_name).copy(), "bias": None if bias is None else bias.copy()}
    return tree


def from_equinox_weights(cfg: MHAConfig, weights) -> MHAParams:
    """Inverse of `to_equinox_weights`."""
    arrays: dict = {}  # weights: arrays; biases: arrays or None
    for w_name, module in EQUINOX_NAMES.items():
        arrays[w_name] = np.asarray(weights[module]["weight"])
        bias = weights[module].get("bias")
        arrays["b" + w_name[1:]] = None if bias is None else np.asarray(bias)
    return validate_params(cfg, MHAParams(**arrays))
