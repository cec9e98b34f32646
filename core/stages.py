"""The MHA pipeline as named stages with shape contracts, written as data.

Every implementation can expose the tensor it holds after each stage, converted to
the canonical layout below. Tests, the divergence report ("the first stage where two
implementations differ") and the explainer all read this one table.

Symbols: B batch, Nq query tokens, Nk key/value tokens, H query heads, Hkv kv heads,
Dk = d_k, Dv = d_v, D = d_model. Canonical layout is row samples (tokens before
features) with the head axis before the token axis once heads are split.

Every implementation exposes ``q_rotated`` and ``k_rotated`` for every configuration:
without rotary embeddings (``cfg.rope`` None) they hold the same numbers as ``q_heads``
and ``k_heads``, so that the stage list never depends on the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import MHAConfig


@dataclass(frozen=True)
class Stage:
    step: str  # the pipeline step that produces the tensor
    name: str  # the tensor's key in a stage dict
    shape: tuple[str, ...]  # symbolic canonical shape
    meaning: str


STAGES: tuple[Stage, ...] = (
    Stage("project", "q", ("B", "Nq", "H*Dk"), "query tokens times w_q.T plus b_q: all heads side by side"),
    Stage("project", "k", ("B", "Nk", "Hkv*Dk"), "key tokens times w_k.T plus b_k"),
    Stage("project", "v", ("B", "Nk", "Hkv*Dv"), "value tokens times w_v.T plus b_v"),
    Stage("split heads", "q_heads", ("B", "H", "Nq", "Dk"), "each head sees every token, with its own Dk features"),
    Stage("split heads", "k_heads", ("B", "Hkv", "Nk", "Dk"), "keys per kv head"),
    Stage("split heads", "v_heads", ("B", "Hkv", "Nk", "Dv"), "values per kv head"),
    Stage(
        "rotary",
        "q_rotated",
        ("B", "H", "Nq", "Dk"),
        "q_heads with each feature pair turned by its position's angle (cfg.rope); q_heads itself without rope",
    ),
    Stage("rotary", "k_rotated", ("B", "Hkv", "Nk", "Dk"), "k_heads turned the same way; k_heads without rope"),
    Stage("scores", "scores", ("B", "H", "Nq", "Nk"), "scale * q_h @ k_g.T, before any mask (g = h // group size)"),
    Stage("mask", "masked_scores", ("B", "H", "Nq", "Nk"), "scores with blocked positions set to -inf"),
    Stage("softmax", "weights", ("B", "H", "Nq", "Nk"), "softmax over keys; a row with no allowed key is all zeros"),
    Stage("weighted sum", "context", ("B", "H", "Nq", "Dv"), "weights @ v_g: one Dv-vector per head and query"),
    Stage("merge heads", "merged", ("B", "Nq", "H*Dv"), "heads side by side again, head h in columns h*Dv:(h+1)*Dv"),
    Stage("output projection", "output", ("B", "Nq", "D"), "merged times w_o.T plus b_o"),
)

STAGE_NAMES = tuple(stage.name for stage in STAGES)
STAGE_BY_NAME = {stage.name: stage for stage in STAGES}


def stage_shapes(cfg: MHAConfig, batch: int, q_tokens: int, kv_tokens: int) -> dict[str, tuple[int, ...]]:
    """Concrete canonical shape of every stage tensor."""
    sizes = {
        "B": batch,
        "Nq": q_tokens,
        "Nk": kv_tokens,
        "H": cfg.n_heads,
        "Hkv": cfg.n_kv_heads,
        "Dk": cfg.d_k,
        "Dv": cfg.d_v,
        "D": cfg.d_model,
        "H*Dk": cfg.q_width,
        "Hkv*Dk": cfg.k_width,
        "Hkv*Dv": cfg.v_width,
        "H*Dv": cfg.context_width,
    }
    return {stage.name: tuple(sizes[s] for s in stage.shape) for stage in STAGES}
