"""Phi-3's longrope (LongRoPE, "su" scaling): one divisor per rotated pair, from a short table or a long one.

``rope_scaling = {"rope_type": "longrope", "short_factor": [...], "long_factor": [...],
"original_max_position_embeddings": L, "factor": f}`` (Hugging Face's form; the legacy ``"type"``
is read as ``"rope_type"``). With ``r = rope_dims``, ``i = 0 .. r/2 - 1`` and ``S`` the length of
the call (1 + its largest position)::

    t_i   = long_factor[i]   if S > L   else short_factor[i]
    inv_i = base ** (-2i / r) / t_i
    a     = attention_factor if given, else 1 if f <= 1, else sqrt(1 + ln(f) / ln(L))

and cos and sin are multiplied by ``a`` at every length, with either table (so the rotated part of
each score by ``a**2``). Each table holds ``r / 2`` numbers > 0.

Where the libraries differ (read in their installed sources):

* **transformers 5.25** (``_compute_longrope_parameters``, ``Phi3RotaryEmbedding`` and
  ``dynamic_rope_update``'s ``longrope_frequency_update``): the module is built with the short
  table (``seq_len`` None); each call takes ``S = max(position_ids) + 1`` and uses the long table
  when ``S > L``, the built one otherwise. ``a`` comes from ``attention_factor``, else from
  ``factor``, else from ``config.max_position_embeddings / L`` (Phi-3's configs give no factor:
  `hf_rope` reads that ratio into ``factor``, since ``rope_scaling`` does not hold the model's
  length). The tables and angles are float32.
* **mlx-lm** (``rope_utils.SuScaledRoPE``): ``_freqs = long_factor * base ** (2i / r)``, the long
  table **at every length** (``short_factor`` is taken and never used), and ``a`` from
  ``long_mscale`` or the formula above with ``f = max_position_embeddings / L``: the dict's
  ``factor`` and ``attention_factor`` are not read. It multiplies the first ``r`` features by ``a``
  before the rotation, which is cos and sin times ``a``. Below ``L`` it is not Hugging Face's layer;
  it is the spec's longrope with ``short_factor = long_factor``, which is how it is read.
* **keras-hub** (``Phi3SuScaledRotaryEmbedding``): the long table when ``start_index + seq_len > L``
  (Hugging Face's rule for a call), ``a`` from ``max_sequence_length / L``.

The spec, like dynamic NTK, is a function of the call: a decode run's table is chosen by the run's
length and applied to every key. Hugging Face's cache keeps each key rotated when it was written, so
a decode that crosses ``L`` keeps its first keys rotated by the short table, where a forward over the
whole run rotates them by the long one.

Design rules: NumPy and the standard library only; every number float64; the tables normalised to
tuples of floats (hashable, and a normalised dict validates to itself). Each error is a ValueError or
TypeError starting with ``MHAConfig.rope_scaling`` that names the key (and the entry of a table).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ._rope_checks import NAME, is_real, length, number

REQUIRED: tuple[str, ...] = ("short_factor", "long_factor", "original_max_position_embeddings")
# None: not given. One of the two must be: `longrope_attention_factor` reads attention_factor, else factor.
OPTIONAL: dict[str, object] = {"factor": None, "attention_factor": None}
TABLES = ("short_factor", "long_factor")
MEANING = {
    "short_factor": "each rotated pair's divisor for a call up to original_max_position_embeddings, rope_dims/2 numbers",
    "long_factor": "each rotated pair's divisor for a call past original_max_position_embeddings, rope_dims/2 numbers",
}


def _table(key: str, value: object) -> tuple[float, ...]:
    """A non-empty list of finite numbers > 0 as a tuple of floats, or an error naming ``key`` (and the entry)."""
    rule = "a list of finite numbers > 0, one per rotated pair (rope_dims / 2 of them)"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{NAME}[{key!r}] must be {rule}, got {value!r} ({type(value).__name__})")
    if np.ndim(value) != 1 or len(value) == 0:
        raise ValueError(f"{NAME}[{key!r}] must be {rule}, got {len(value)} entries of shape {np.shape(value)}")
    out = []
    for i, entry in enumerate(value):
        if not is_real(entry):
            raise TypeError(f"{NAME}[{key!r}][{i}] must be a finite number > 0, got {entry!r} ({type(entry).__name__})")
        if not math.isfinite(float(entry)) or float(entry) <= 0:
            raise ValueError(
                f"{NAME}[{key!r}][{i}] must be a finite number > 0 (it divides a frequency), got {entry!r}"
            )
        out.append(float(entry))
    return tuple(out)


def longrope_options(value: Mapping) -> dict:
    """The normalised longrope dict (its keys checked by `validate_rope_scaling` first): tables as tuples, the length
    an int, ``factor`` and ``attention_factor`` floats or None (at least one given)."""
    out: dict = {"rope_type": "longrope", **{key: _table(key, value[key]) for key in TABLES}}
    if len(out["short_factor"]) != len(out["long_factor"]):
        raise ValueError(
            f"{NAME}['short_factor'] and ['long_factor'] must have the same length (one divisor per rotated pair "
            f"each), got {len(out['short_factor'])} and {len(out['long_factor'])}"
        )
    key = "original_max_position_embeddings"
    out[key] = length(key, value[key])
    for key in OPTIONAL:
        out[key] = None if value.get(key) is None else number(key, value[key])
    if out["factor"] is None and out["attention_factor"] is None:
        raise ValueError(
            f"{NAME} of rope_type 'longrope' needs 'factor' (the new context length over "
            "original_max_position_embeddings) or 'attention_factor' (the factor on cos and sin); Hugging Face falls "
            "back to config.max_position_embeddings / original_max_position_embeddings, a length rope_scaling does "
            "not hold: pass that ratio as 'factor'"
        )
    if out["attention_factor"] is None and out["factor"] > 1 and out["original_max_position_embeddings"] == 1:
        raise ValueError(
            f"{NAME}['original_max_position_embeddings']=1 with factor {out['factor']:g} > 1: longrope's attention "
            "factor sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) divides by ln(1) = 0; pass "
            "'attention_factor' itself"
        )
    return out


def check_longrope_pairs(scaling: dict, rope_dims: int) -> None:
    """ValueError unless each table of a normalised longrope dict holds ``rope_dims / 2`` numbers."""
    pairs = rope_dims // 2
    for key in TABLES:
        if len(scaling[key]) != pairs:
            raise ValueError(
                f"{NAME}[{key!r}] has {len(scaling[key])} numbers; longrope needs one per rotated pair, "
                f"rope_dims / 2 = {pairs} (rope_dims={rope_dims})"
            )


def longrope_attention_factor(scaling: dict) -> float:
    """``a``, the factor on cos and sin (the module docstring), of a normalised longrope dict."""
    if scaling["attention_factor"] is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_table(scaling: dict, seq_len: int) -> str:
    """Which table a call of length ``seq_len`` (1 + its largest position) uses: ``"long_factor"`` past
    ``original_max_position_embeddings``, else ``"short_factor"``."""
    return "long_factor" if seq_len > scaling["original_max_position_embeddings"] else "short_factor"


def longrope_frequencies(inv_freq: np.ndarray, scaling: dict, seq_len: int) -> tuple[np.ndarray, float]:
    """``(inv_freq / table, a)``: the plain frequencies ``(r/2,)`` divided by the call's table, and the factor."""
    check_longrope_pairs(scaling, 2 * len(inv_freq))
    table = np.asarray(scaling[longrope_table(scaling, seq_len)], dtype=np.float64)  # (r/2,)
    return inv_freq / table, longrope_attention_factor(scaling)


def _brief(table: tuple[float, ...]) -> str:
    shown = ", ".join(f"{t:g}" for t in table[:3])
    return f"[{shown}{', ...' if len(table) > 3 else ''}]"


def describe_longrope(scaling: dict) -> str:
    """``longrope(orig=4096, factor=32, short=[1, 1.02, 1.1, ...], long=[...], pairs=48)``."""
    parts = [f"orig={scaling['original_max_position_embeddings']}"]
    parts += [f"{key}={scaling[key]:g}" for key in OPTIONAL if scaling[key] is not None]
    parts += [f"short={_brief(scaling['short_factor'])}", f"long={_brief(scaling['long_factor'])}"]
    return f"longrope({', '.join(parts)}, pairs={len(scaling['short_factor'])})"
