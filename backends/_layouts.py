"""Axis orders of stage tensors that more than one adapter holds, named once.

The symbols are those of `core.stages`. Each adapter still states its own convention:
these are only the layouts that several of them share, so that a reader (and the
explainer) sees one definition instead of three copies that could drift apart.
"""

from __future__ import annotations

# The projections as row samples, tokens before features: ``x @ W.T + b`` in torch,
# JAX, einops and every oracle that exposes them.
ROW_SAMPLE_PROJECTION_AXES = {
    "q": ("B", "Nq", "H*Dk"),
    "k": ("B", "Nk", "Hkv*Dk"),
    "v": ("B", "Nk", "Hkv*Dv"),
}


def heads_axes(q_heads: tuple[str, ...], k_heads: tuple[str, ...], v_heads: tuple[str, ...]) -> dict:
    """The axes of the heads stages; a rotated stage has the axes of the heads it turns."""
    return {
        "q_heads": q_heads,
        "k_heads": k_heads,
        "v_heads": v_heads,
        "q_rotated": q_heads,
        "k_rotated": k_heads,
        # Llama 4's steps after rotary and Gemma 4's value norm keep the layout of the heads they act on.
        "q_rotated_normed": q_heads,
        "k_rotated_normed": k_heads,
        "q_tempered": q_heads,
        "v_normed": v_heads,
    }


# Tokens first all the way through: heads split after the token axis (B, N, H, d), the
# way jax.vmap(in_axes=1), einsum "b n h k" and jax.nn.dot_product_attention's BTNH hold
# them, so that splitting and merging heads are reshapes. Only the score-like stages
# put the heads first, (B, H, Nq, Nk).
TOKENS_FIRST_STAGE_AXES = {
    **ROW_SAMPLE_PROJECTION_AXES,
    **heads_axes(("B", "Nq", "H", "Dk"), ("B", "Nk", "Hkv", "Dk"), ("B", "Nk", "Hkv", "Dv")),
    "scores": ("B", "H", "Nq", "Nk"),
    "masked_scores": ("B", "H", "Nq", "Nk"),
    "weights": ("B", "H", "Nq", "Nk"),
    "context": ("B", "Nq", "H", "Dv"),
    "merged": ("B", "Nq", "H*Dv"),
    "output": ("B", "Nq", "D"),
}

# Heads before tokens, (B, H, N, d): torch's ``view(B, N, H, d).transpose(1, 2)``, the
# layout F.scaled_dot_product_attention takes.
HEADS_FIRST_SPLIT_AXES = heads_axes(("B", "H", "Nq", "Dk"), ("B", "Hkv", "Nk", "Dk"), ("B", "Hkv", "Nk", "Dv"))


HEAD_STAGES = ("q_heads", "k_heads", "v_heads", "q_rotated", "k_rotated", "q_tempered", "v_normed")


def head_slice_axes(axes: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """One head's slice of the heads stages in ``axes``: the head axis (H or Hkv) dropped, the
    layout a per-head strategy records before the recorder stacks the heads back in."""
    return {
        name: tuple(a for a in axes[name] if a not in ("H", "Hkv")) for name in axes if name.startswith(HEAD_STAGES)
    }


XLA_LAYOUT = "XLA-managed layout"  # the note of a stage whose memory layout XLA chooses

# Where each stage of an XLA pass comes from, as `StageTensor` (relation, parent). JAX
# arrays are immutable values whose buffers XLA places, so a layout-only step (a reshape)
# counts as a copy of its parent; a computation is "new".
XLA_PROVENANCE = {
    "q_heads": ("copy", "q"),
    "k_heads": ("copy", "k"),
    "v_heads": ("copy", "v"),
    "q_rotated": ("new", "q_heads"),
    "k_rotated": ("new", "k_heads"),
    "masked_scores": ("new", "scores"),
    "weights": ("new", "masked_scores"),
    "merged": ("copy", "context"),
}


def xla_provenance(name: str, rope: str | None) -> tuple[str, str | None]:
    """(relation, parent) of stage ``name`` of an XLA pass; without rope the rotated stages are the heads."""
    relation, parent = XLA_PROVENANCE.get(name, ("new", None))
    if rope is None and name in ("q_rotated", "k_rotated"):
        relation = "view"
    return relation, parent


def layer_sizes(cfg, inputs) -> tuple[int, ...]:
    """``(B, Nq, Nk, H, Hkv, G, Dk, Dv)``: the sizes of these symbols for ``cfg`` and ``inputs``, in the
    order every strategy of the NumPy and torch layers unpacks them (``B, Nq, ... = self.sizes``)."""
    B, Nq, Nk = inputs.batch, inputs.q_tokens, inputs.kv_tokens
    return (B, Nq, Nk, cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_k, cfg.d_v)
