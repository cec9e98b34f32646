"""Converters that undo one convention error by changing what a candidate is fed.

Each takes canonical parameters (or a mask) and returns what a candidate with that error
must be given to compute the spec's attention. `diagnose` applies the top cause's repair,
runs the candidate again and reports whether it then agrees with the oracle; a user can
call the same function while loading weights, as a stop-gap or to confirm the diagnosis,
before fixing the code itself. Each is its own inverse or says which call undoes it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.variants import variants_on

# The variants' repairs are their entries' (`core.variants`, each `DiagnoseCause.repair`); these are the functions
# the causes' fixes name.
from mha_rosetta.core.variants.rel_bias import mirror_relative_buckets
from mha_rosetta.core.variants.window import window_mask

from .simulate import Bug, params_as_used

__all__ = [
    "convert_rotary_pairing",
    "invert_mask",
    "mirror_relative_buckets",
    "regroup_query_heads",
    "reorder_output_columns",
    "repack_qkv",
    "rescale_query",
    "rescale_query_norm",
    "swap_projections",
    "tiled_query_head_order",
    "transpose_weight",
    "window_mask",
]


def transpose_weight(params: MHAParams, name: str) -> MHAParams:
    """Feed ``name`` (w_q, w_k, w_v or w_o) transposed to code that computes ``x @ W`` (as `core.to_row_sample`)."""
    return replace(params, **{name: np.ascontiguousarray(getattr(params, name).T)})


def swap_projections(params: MHAParams, a: str, b: str) -> MHAParams:
    """Exchange two projections' weights and biases (``a``, ``b`` in "q", "k", "v")."""
    p = params.as_dict()
    for kind in ("w", "b"):
        p[f"{kind}_{a}"], p[f"{kind}_{b}"] = p[f"{kind}_{b}"], p[f"{kind}_{a}"]
    return MHAParams(**p)


def repack_qkv(cfg: MHAConfig, params: MHAParams, written: str, read: str) -> MHAParams:
    """Parameters that a candidate packing with ``written`` and unpacking with ``read`` turns back into ``params``.

    ``written``/``read`` are "blocks" ([q; k; v], `core.to_torch_mha_state_dict`'s
    ``in_proj_weight``) or "interleaved" ([q_0; k_0; v_0; q_1; ...] per head). The
    candidate computes ``unpack(read, pack(written, p))``; feeding it
    ``p = unpack(written, pack(read, params))`` makes that ``params``: what the reverse mistake
    (packing with ``read``, unpacking with ``written``) would use, as `simulate` computes it.
    """
    return params_as_used(cfg, params, Bug(packing=f"{read}->{written}"))


def rescale_query(params: MHAParams, factor: float) -> MHAParams:
    """Multiply w_q and b_q by ``factor``: scores are linear in q, so this undoes a wrong score scale."""
    return replace(params, w_q=params.w_q * factor, b_q=None if params.b_q is None else params.b_q * factor)


def invert_mask(mask):
    """Flip a boolean mask between True = may attend (the spec) and True = blocked."""
    return None if mask is None else ~np.asarray(mask, dtype=bool)


def reorder_output_columns(cfg: MHAConfig, params: MHAParams) -> MHAParams:
    """w_o for code that merges heads as (Dv, H): column ``d*H + h`` must read head h's feature d."""
    d_model = params.w_o.shape[0]
    w_o = params.w_o.reshape(d_model, cfg.n_heads, cfg.d_v).transpose(0, 2, 1)  # (D, Dv, H) view
    # The output gate multiplies the merged columns: its rows must come in the candidate's (Dv, H) order too.
    gate = {
        name: None if a is None else a.reshape(cfg.n_heads, cfg.d_v, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
        for name, a in (("w_gate", params.w_gate), ("b_gate", params.b_gate))
    }  # (Dv, H, ...) copies
    return replace(params, w_o=w_o.reshape(d_model, cfg.d_v * cfg.n_heads), **gate)  # (D, Dv*H) copy


def tiled_query_head_order(cfg: MHAConfig) -> np.ndarray:
    """For code that gives query head slot s kv head ``s % Hkv``: which spec head to put in slot s."""
    group = cfg.n_heads // cfg.n_kv_heads
    slots = np.arange(cfg.n_heads)
    return (slots % cfg.n_kv_heads) * group + slots // cfg.n_kv_heads


def regroup_query_heads(cfg: MHAConfig, params: MHAParams) -> MHAParams:
    """Reorder query heads (rows of w_q and b_q, columns of w_o) for code that tiles kv heads, not repeats them."""
    order = tiled_query_head_order(cfg)
    H, Dk, Dv = cfg.n_heads, cfg.d_k, cfg.d_v
    w_q = params.w_q.reshape(H, Dk, -1)[order].reshape(H * Dk, -1)  # (H, Dk, D) rows regrouped, copy
    b_q = None if params.b_q is None else params.b_q.reshape(H, Dk)[order].reshape(H * Dk)
    d_model = params.w_o.shape[0]
    w_o = params.w_o.reshape(d_model, H, Dv)[:, order].reshape(d_model, H * Dv)  # (D, H, Dv) columns regrouped, copy
    # The per-head parameters of the variants move with their heads (ALiBi's slopes cannot: no repair there).
    extra = {}
    for entry in variants_on(cfg):
        if entry.diagnose is not None and entry.diagnose.regroup_heads is not None:
            extra.update(entry.diagnose.regroup_heads(cfg, params, order))
    return replace(params, w_q=w_q, b_q=b_q, w_o=w_o, **extra)


def rescale_query_norm(params: MHAParams, factor: float) -> MHAParams:
    """Multiply the QK-norm weight q_norm by ``factor``: with QK-norm the scores are linear in it, not in w_q."""
    return replace(params, q_norm=params.q_norm * factor)


def convert_rotary_pairing(cfg: MHAConfig, params: MHAParams, converter) -> MHAParams:
    """``converter(cfg, params)[1]`` (`core.to_interleaved_params` or `to_rotate_half_params`).

    The core converters permute the rows of w_q/w_k (and b_q/b_k) within each head, and the
    QK-norm weights with them (each head's slice of a weight scales those same features).
    """
    return converter(cfg, params)[1]
