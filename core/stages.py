"""The MHA pipeline as named stages with shape contracts, written as data.

Every implementation can expose the tensor it holds after each stage, converted to
the canonical layout below. Tests, the divergence report ("the first stage where two
implementations differ") and the explainer all read this one table.

Symbols: B batch, Nq query tokens, Nk key/value tokens, H query heads, Hkv kv heads,
Dk = d_k, Dv = d_v, D = d_model. Canonical layout is row samples (tokens before
features) with the head axis before the token axis once heads are split.

Every implementation exposes ``q_rotated`` and ``k_rotated`` for every configuration:
without rotary embeddings (``cfg.rope`` None) they hold the same numbers as ``q_heads``
and ``k_heads``. The variants' stages (`VARIANT_STAGES`: ``q_normed``/``k_normed`` with
QK-norm, ``capped_scores`` with a softcap, ``biased_scores`` with ALiBi or T5's relative
bias) exist only when their variant is on, so the 2017-23 stage list is unchanged and an
implementation without the variants never has to fake them: `stage_names` is the list for
one configuration, in pipeline order. ``masked_scores`` masks the last score stage present.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import MHAConfig
from .variants import BUILT_FROM_REGISTRY, VARIANT_REGISTRY, StageSpec, stage_owners


@dataclass(frozen=True)
class Stage:
    step: str  # the pipeline step that produces the tensor
    name: str  # the tensor's key in a stage dict
    shape: tuple[str, ...]  # symbolic canonical shape
    meaning: str


# The symbolic shapes several stages share: the query heads (and what is made of them before the scores), the key
# heads (likewise), and the scores (and every stage made of them before the weighted sum).
Q_HEADS = ("B", "H", "Nq", "Dk")
K_HEADS = ("B", "Hkv", "Nk", "Dk")
SCORES = ("B", "H", "Nq", "Nk")

# The stages every configuration has; the variants' own (their entries' `StageSpec`s) are inserted below.
STAGES: tuple[Stage, ...] = (
    Stage("project", "q", ("B", "Nq", "H*Dk"), "query tokens times w_q.T plus b_q: all heads side by side"),
    Stage("project", "k", ("B", "Nk", "Hkv*Dk"), "key tokens times w_k.T plus b_k"),
    Stage("project", "v", ("B", "Nk", "Hkv*Dv"), "value tokens times w_v.T plus b_v"),
    Stage("split heads", "q_heads", Q_HEADS, "each head sees every token, with its own Dk features"),
    Stage("split heads", "k_heads", K_HEADS, "keys per kv head"),
    Stage("split heads", "v_heads", ("B", "Hkv", "Nk", "Dv"), "values per kv head"),
    Stage(
        "rotary",
        "q_rotated",
        Q_HEADS,
        "q_normed (q_heads without qk_norm) with each feature pair turned by its position's angle (cfg.rope); "
        "unchanged without rope",
    ),
    Stage("rotary", "k_rotated", K_HEADS, "k_normed (k_heads) turned the same way"),
    Stage("scores", "scores", SCORES, "scale * q_h @ k_g.T, before any mask (g = h // group size)"),
    Stage("mask", "masked_scores", SCORES, "the last score stage with blocked positions set to -inf"),
    Stage(
        "softmax",
        "weights",
        SCORES,
        "softmax over keys (with each head's sink in the denominator); a row with no allowed key is all zeros",
    ),
    Stage("weighted sum", "context", ("B", "H", "Nq", "Dv"), "weights @ v_g: one Dv-vector per head and query"),
    Stage("merge heads", "merged", ("B", "Nq", "H*Dv"), "heads side by side again, head h in columns h*Dv:(h+1)*Dv"),
    Stage("output projection", "output", ("B", "Nq", "D"), "merged times w_o.T plus b_o"),
)


def _with_registry_stages(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """``stages`` with those of every registered entry (`core.variants.StageSpec`), in registry order, each after
    its anchor; a stage several entries add into (the additive biases') once, its meaning with each one's term."""
    listed = list(stages)
    declared: dict[str, tuple[StageSpec, list[str]]] = {}  # a stage's first declaration and every entry's term
    for entry in VARIANT_REGISTRY.values():
        for spec in entry.stage_specs:
            if spec.name in declared:
                first, terms = declared[spec.name]
                if not first.joins(spec):
                    raise ValueError(
                        f"variant {entry.name!r} declares the stage {spec.name!r} otherwise than an entry before it: "
                        f"{spec!r} against {first!r}"
                    )
                terms.append(spec.term)
                continue
            if spec.name in (stage.name for stage in listed):
                raise ValueError(f"variant {entry.name!r} declares the stage {spec.name!r}, which core.stages has")
            names = [stage.name for stage in listed]
            at = names.index(spec.before) if spec.before else names.index(spec.after) + 1
            shape = spec.shape or next(stage.shape for stage in listed if stage.name == spec.like)
            listed.insert(at, Stage(spec.step, spec.name, shape, spec.meaning))
            declared[spec.name] = (spec, [spec.term])
    for name, (spec, terms) in declared.items():
        if spec.term:  # a template over the terms of every entry that adds into it
            at = [stage.name for stage in listed].index(name)
            listed[at] = replace(listed[at], meaning=spec.meaning.format(terms=" and ".join(terms)))
    BUILT_FROM_REGISTRY.append("the stage table")
    return tuple(listed)


STAGES = _with_registry_stages(STAGES)
STAGE_NAMES = tuple(stage.name for stage in STAGES)
STAGE_BY_NAME = {stage.name: stage for stage in STAGES}


def _any_on(owners):
    return lambda cfg: any(entry.is_on(cfg) for entry in owners)


# The stages that exist only with a variant (each entry's `stages` in `core.variants`), and the rule
# that switches each on: any of the variants that add it is on.
_OWNERS = stage_owners()
assert set(_OWNERS) <= set(STAGE_NAMES), "a variant names a stage that core.stages.STAGES lacks"
VARIANT_STAGES = {name: _any_on(_OWNERS[name]) for name in STAGE_NAMES if name in _OWNERS}
# The variants' stages with the scores' shape, in pipeline order (``capped_scores``, ``biased_scores``, and any a
# variant registered from outside adds): the score-like stages an adapter lays out as its scores.
SCORE_VARIANT_STAGES = tuple(name for name in VARIANT_STAGES if STAGE_BY_NAME[name].shape == SCORES)
# The 2017-23 pipeline: the stages every implementation exposes for every configuration.
BASE_STAGE_NAMES = tuple(name for name in STAGE_NAMES if name not in VARIANT_STAGES)


def stage_names(cfg: MHAConfig) -> tuple[str, ...]:
    """The stages of ``cfg``'s pipeline, in order: the base stages and the variants' that are on."""
    return tuple(name for name in STAGE_NAMES if name not in VARIANT_STAGES or VARIANT_STAGES[name](cfg))


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
    present = stage_names(cfg)  # a symbol not above is a cfg field (MLA's kv_lora_rank: `StageSpec.shape`)
    return {s.name: tuple(sizes.get(d) or getattr(cfg, d) for d in s.shape) for s in STAGES if s.name in present}
