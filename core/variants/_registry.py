"""The variant registry's storage, and the lookups an entry needs when it runs.

`VARIANT_REGISTRY` is filled by `core.variants` (its built-in entries, then any registered from outside). It lives
in this leaf module, which imports no entry, so that an entry whose formula depends on another entry at call time
(k_eq_v and value_norm ask which norm before rotary is on) reads the registry here without an import circle
through `core.variants` (tests/test_import_cycles.py).
"""

from __future__ import annotations

from ._entry import Config, NormStep, Variant

# name -> entry, in the order of `core.VARIANTS` (explicit: the order is part of every output); filled by
# `core.variants`.
VARIANT_REGISTRY: dict[str, Variant] = {}


def variant(name: str) -> Variant:
    """The registry's entry ``name``; a KeyError naming the known variants for any other."""
    try:
        return VARIANT_REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r}; known variants: {', '.join(VARIANT_REGISTRY)}") from None


def norm_step(cfg: Config) -> NormStep | None:
    """The weighted norm of the queries and keys before rotary that ``cfg`` switches on (`Variant.norm_step` of the
    entry that is on), or None. Its entries share one field, so at most one is on."""
    steps = [entry.norm_step for entry in VARIANT_REGISTRY.values() if entry.norm_step is not None and entry.is_on(cfg)]
    if len(steps) > 1:
        raise ValueError(f"at most one norm before rotary can be on, got {len(steps)}: {steps!r}")
    return steps[0] if steps else None


def norm_place(cfg: Config) -> str | None:
    """`norm_step`'s place (one of `NORM_PLACES`), or None when ``cfg`` has no norm before rotary."""
    step = norm_step(cfg)
    return None if step is None else step.place
