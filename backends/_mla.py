"""MLA's two forms as strategies of our adapters (issue 45): their names, what each declares, and the refusals.

DeepSeek's multi-head latent attention (`core.variants.mla`) has two ways to compute the same numbers, and
each adapter that applies MLA offers both as strategies, selected by name like every other strategy:

* ``naive``: each head's keys ``[W_UK_h c | k_rope]`` and values ``W_UV_h c`` expanded from the latent ``c``,
  then attention as ever;
* ``absorbed``: ``W_UK`` folded into the query and ``W_UV`` into the output, so every head attends to the
  one key head ``[c | k_rope]``: multi-query attention over the latent (`core.variants.mla_algebra`).

Only these two strategies run MLA (the head-split strategies of the 2023 article have no latent), and they
run only MLA: a layer without ``kv_lora_rank`` is refused by them with the reason. Besides MLA's own entries
they apply what acts on the rotary's tables (``rope_scaling``) and the score steps that need no per-head
parameter or bias (the softcap, the positional masks: causal, the window, chunks, the user's mask), on the
library's ops object like every other path; anything else (sinks, a score bias, the output gate, ...) is
refused by name.

The query steps after rotary (`QUERY_STEPS`: Mistral 4's temperature, a factor per position on both query
parts, nope and rope) are each owner's to declare: an owner lists those its MLA strategies apply, forward,
backward and decode (``MLAStrategies.mla_query_steps``), and its MLA strategies refuse the others by name. An
owner that declares none (the default) refuses them all.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.mla_forms import cache_bytes_per_token
from mha_rosetta.core.variants import VARIANT_REGISTRY, strategy_forms
from mha_rosetta.core.variants.mla import STRATEGIES, mla_on
from mha_rosetta.core.variants.temperature import ENTRY as TEMPERATURE

from .vocabulary import UnsupportedCase

NAIVE, ABSORBED = MLA_STRATEGIES = STRATEGIES  # the entry's (`Variant.strategies`), said once in core
# The score places the MLA strategies run through the ops object without a parameter of their own.
_PLACES = ("transform", "mask")
# The steps on the queries after rotary an MLA owner may apply to both query parts (nope and rope): entries
# without a score step, each a factor per query position. An owner declares those it applies (`MLAStrategies`).
QUERY_STEPS: tuple[str, ...] = (TEMPERATURE.name,)


def form_variants(query_steps: tuple[str, ...] = ()) -> frozenset[str]:
    """The variants the MLA strategies apply: MLA's own (the entries that run only in them, `Variant.strategies`),
    rope_scaling, the softcap and positional masks, and the owner's ``query_steps`` (of `QUERY_STEPS`)."""
    unknown = [name for name in query_steps if name not in QUERY_STEPS]
    if unknown:
        raise ValueError(f"query_steps must be among {', '.join(QUERY_STEPS)}, got {', '.join(unknown)}")
    steps = {
        name
        for name, entry in VARIANT_REGISTRY.items()
        if entry.score_step is not None and entry.score_step.place in _PLACES
    }
    return frozenset(strategy_forms(MLA_STRATEGIES) | {"rope_scaling"} | steps | set(query_steps))


class MLAStrategyVariants:
    """``strategy_variants`` of an adapter with the MLA strategies (a class attribute, read each time it is asked).

    Each MLA strategy declares the adapter's variants that `form_variants` lists (with the adapter's
    ``mla_query_steps``); every other strategy declares the adapter's variants it runs (`Variant.runs_in`: not
    MLA's, which has no latent there). Read from the adapter's own ``variants``.
    """

    def __get__(self, obj, owner=None) -> dict[str, frozenset[str]]:
        this = owner if obj is None else obj
        declared = frozenset(this.variants)
        forms = declared & form_variants(getattr(this, "mla_query_steps", ()))
        return {
            strategy: forms
            if strategy in MLA_STRATEGIES
            else frozenset(name for name in declared if VARIANT_REGISTRY[name].runs_in(strategy))
            for strategy in this.strategies
        }


def mla_reason(
    backend: str, cfg: MHAConfig, strategy: str, decode: bool = False, query_steps: tuple[str, ...] = ()
) -> str | None:
    """Why ``strategy`` cannot run ``cfg`` for MLA's sake, or None: an MLA strategy needs MLA (and only the
    variants it applies: `form_variants` of the owner's ``query_steps``), and MLA needs an MLA strategy.
    ``decode``: the reason for a decode run."""
    path = f"{backend}'s decode path" if decode else backend
    if strategy in MLA_STRATEGIES:
        if not mla_on(cfg):
            return (
                f"{path}: the {strategy!r} strategy is a form of multi-head latent attention and needs "
                f"MHAConfig.kv_lora_rank (got {cfg.describe()})"
            )
        applied = form_variants(query_steps)
        missing = [name for name in cfg.variants if name not in applied]
        if missing:
            has = ", ".join(sorted(applied))
            return f"{path} does not implement {', '.join(missing)} in its {strategy!r} strategy (it implements: {has})"
        return None
    if mla_on(cfg):
        return (
            f"{path} runs multi-head latent attention in its {' and '.join(map(repr, MLA_STRATEGIES))} strategies "
            f"only, not {strategy!r} (its head split has no latent)"
        )
    return None


class MLAStrategies:
    """A mixin for an adapter with the MLA strategies (``class NumpyBackend(MLAStrategies, Backend)``): its
    ``strategy_variants`` (`MLAStrategyVariants`) and the refusals of `mla_reason`, forward and decode, before the
    adapter's own. The decode path of an MLA strategy holds the latent in a cache of its own (the adapter's
    default kind); another kind is refused by name."""

    strategy_variants = MLAStrategyVariants()
    # The query steps after rotary (`QUERY_STEPS`) this owner's MLA strategies apply to both query parts, forward,
    # backward and decode; none by default, so that an owner which does not apply one refuses it by name.
    mla_query_steps: tuple[str, ...] = ()

    def variant_reason(self, cfg, strategy, backward=False):
        if strategy in MLA_STRATEGIES and not mla_on(cfg):  # a form of MLA, asked for plain attention: that first
            return mla_reason(self.name, cfg, strategy)
        return super().variant_reason(cfg, strategy, backward)

    def unsupported_reason(self, cfg, dtype, device, strategy):
        reason = mla_reason(self.name, cfg, strategy, query_steps=self.mla_query_steps)
        return reason or super().unsupported_reason(cfg, dtype, device, strategy)

    def decode_reason(self, cfg, dtype, device, strategy, cache):
        reason = mla_reason(self.name, cfg, strategy, decode=True, query_steps=self.mla_query_steps)
        if not reason and strategy in MLA_STRATEGIES and cache not in (None, *self.decode_caches[:1]):
            reason = (
                f"{self.name}'s {strategy!r} strategy decodes through its latent cache (kv_lora_rank + d_rope numbers "
                f"a token), not a {cache!r} cache of per-head keys and values"
            )
        return reason or super().decode_reason(cfg, dtype, device, strategy, cache)

    # An adapter whose ``_prepare_decode_step`` times MLA's forms on its latent cache (bench --mode decode) says so;
    # its forms' step is then validated as any other (the next ``prepare_decode`` of the MRO, `decoding.DecodeMixin`'s
    # at the end, `decode_reason`'s refusals included) and handed to that step.
    mla_timed_step = False

    def prepare_decode(self, cfg, params, **options):
        strategy = options.get("strategy")
        if strategy in MLA_STRATEGIES and not self.mla_timed_step:  # run_decode decodes; bench times one step
            raise UnsupportedCase(
                f"{self.name}: MLA's {strategy!r} form has no timed decode step yet (run_decode decodes it through "
                "its latent cache)"
            )
        return super().prepare_decode(cfg, params, **options)


class MLAForms(MLAStrategies):
    """`MLAStrategies` for an adapter that runs MLA's forms all the way (numpy, torch, jax, mlx): its
    ``_prepare_decode_step`` times them on the latent cache, and they temper both query parts (`QUERY_STEPS`,
    Mistral 4), forward, backward and decode."""

    mla_timed_step = True
    mla_query_steps = QUERY_STEPS


def latent_cache_info(cfg: MHAConfig, batch: int, slots: int, itemsize: int, layout: str) -> dict:
    """``PreparedDecode.info["cache"]`` of a latent cache: its kind, layout, slots and bytes, and the bytes a token
    adds to it (``(kv_lora_rank + d_rope) * itemsize``) against per-head keys and values (``H (d_k + d_v)``)."""
    per_token = cache_bytes_per_token(cfg, itemsize)
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return {
        "kind": "latent",
        "layout": layout,
        "slots": slots,
        "bytes": batch * slots * rows * itemsize,
        "bytes_per_token": per_token["latent"],
        "expanded_bytes_per_token": per_token["expanded"],
        "note": f"{per_token['latent']} bytes a token (kv_lora_rank + d_rope numbers) against {per_token['expanded']} "
        f"for per-head keys and values (H (d_k + d_v)): {per_token['ratio']:.1f}x fewer",
    }
