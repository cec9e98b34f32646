"""Scaled rotary frequencies (``MHAConfig.rope_scaling``): linear, dynamic NTK, Llama 3, YaRN, proportional, longrope.

A model trained with rotary embeddings at a context length ``L`` is stretched to a longer
one by changing the frequencies of its pairs. ``rope_scaling`` names how, in Hugging Face's
form: a dict with ``"rope_type"`` and the keys that type needs. `validate_rope_scaling`
checks it and normalises it; `scaled_frequencies` turns it into the frequency of each pair
and the factor on cos and sin. The plain frequencies, with ``r = rope_dims`` and
``i = 0 .. r/2 - 1``, are (`core.rotary.inverse_frequencies`)::

    inv_i = base ** (-2i / r)

and each type, with ``f = factor`` and ``L = original_max_position_embeddings``, is the
function of transformers' ``modeling_rope_utils`` named after it (``ROPE_INIT_FUNCTIONS``):

* ``"linear"`` (``_compute_linear_scaling_rope_parameters``, position interpolation)::

      inv_i / f

* ``"dynamic"`` (``_compute_dynamic_ntk_parameters``, NTK-aware): the base grows with the
  length ``S`` of the call (1 + its largest position), and only past ``L``::

      base' = base * (f * S / L - (f - 1)) ** (r / (r - 2))   if S > L, else base
      inv_i = base' ** (-2i / r)

  ``L`` is Hugging Face's ``config.max_position_embeddings`` (dynamic has no key of its own
  there). With ``r = 2`` the only pair is ``i = 0``, whose frequency is 1 whatever the base
  (Hugging Face divides by ``r - 2`` and raises ZeroDivisionError instead).
  Hugging Face's ``dynamic_rope_update`` also caches: a module keeps the frequencies of the
  longest call it has seen until a call is shorter than ``L``. The spec is a function of the
  call alone, the same as a fresh module (or one whose calls only grow).

* ``"llama3"`` (``_compute_llama3_parameters``, Llama 3.1), with wavelength
  ``w_i = 2 pi / inv_i`` and ``lo = low_freq_factor``, ``hi = high_freq_factor``::

      w_i > L / lo  (low frequencies):   inv_i / f
      w_i < L / hi  (high frequencies):  inv_i
      otherwise, s = (L / w_i - lo) / (hi - lo):  (1 - s) * inv_i / f + s * inv_i

* ``"yarn"`` (``_compute_yarn_parameters``, YaRN), with ``bf = beta_fast`` (default 32),
  ``bs = beta_slow`` (default 1). The pair index at which a frequency turns ``n`` times over
  ``L`` positions, and the correction range between ``n = bf`` and ``n = bs``::

      d(n) = r * ln(L / (2 pi n)) / (2 ln base)
      low, high = d(bf), d(bs)                  floor(low), ceil(high) when truncate (default True)
      low, high = max(low, 0), min(high, r - 1)
      ramp_i = clip((i - low) / (high - low), 0, 1)      (high += 0.001 when low == high)
      inv_i' = (inv_i / f) * ramp_i + inv_i * (1 - ramp_i)

  so the pairs below ``low`` (fast, many turns within ``L``) keep their frequency and the
  pairs past ``high`` are interpolated by ``f``. cos and sin are multiplied by the
  attention factor: ``attention_factor`` if given, else, with ``m(s, k) = 1`` for ``s <= 1``
  and ``0.1 k ln(s) + 1`` otherwise, ``m(f, mscale) / m(f, mscale_all_dim)`` when both are
  given (DeepSeek), else ``m(f, 1) = 0.1 ln(f) + 1``. The rotated queries and keys are both
  scaled by it, so the rotated part of every score is scaled by its square (1.81 for gpt-oss's
  ``f = 32``); features past ``rope_dims`` are not rotated and not scaled.

* ``"proportional"`` (Gemma 4's global layers): the first ``int(partial_rotary_factor * r // 2)``
  pairs turn at ``inv_i / f``, the others not at all.

* ``"longrope"`` (``_compute_longrope_parameters``, Phi-3's 128k models): ``inv_i / t_i`` with
  the per-pair table ``t = long_factor`` when the call's length ``S`` exceeds ``L``, else
  ``short_factor``; cos and sin times ``sqrt(1 + ln f / ln L)`` (or ``attention_factor``). Its
  rules, and where transformers, mlx-lm and keras-hub differ, are `core.longrope`'s.

Design rules: NumPy and the standard library only; every number float64 (Hugging Face
computes the tables in float32). `validate_rope_scaling` is idempotent (its output validates
to itself), and refuses rather than guesses: an unknown type or key, a missing key, a value of
the wrong type or range, each a ValueError or TypeError that starts with
``MHAConfig.rope_scaling`` and names the key. Where Hugging Face silently substitutes
(``beta_fast=0`` read as 32, ``mscale`` without ``mscale_all_dim`` not read at all), the spec
says so in an error instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ._rope_checks import NAME as _NAME
from ._rope_checks import is_real as _is_real
from ._rope_checks import length as _length
from ._rope_checks import number as _number
from .longrope import MEANING as LONGROPE_MEANING
from .longrope import OPTIONAL as LONGROPE_OPTIONAL
from .longrope import REQUIRED as LONGROPE_REQUIRED
from .longrope import describe_longrope, longrope_frequencies, longrope_options

# The scaled types the spec expresses (transformers' ROPE_INIT_FUNCTIONS has these and "default", which is None here).
ROPE_SCALING_TYPES: tuple[str, ...] = ("linear", "dynamic", "llama3", "yarn", "proportional", "longrope")

# Per type: the keys it needs, and its optional keys with their defaults (filled in by
# validate_rope_scaling, so that a normalised dict of a type always has the same keys).
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "proportional": (),
    "longrope": LONGROPE_REQUIRED,
}
_OPTIONAL: dict[str, dict[str, object]] = {
    "linear": {},
    "dynamic": {},
    "llama3": {},
    # None: not given, as in Hugging Face (attention_factor then comes from factor and mscale).
    "yarn": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": None,
        "mscale": None,
        "mscale_all_dim": None,
        "truncate": True,
    },
    # Gemma 4's global layers: {"rope_type": "proportional", "partial_rotary_factor": 0.25} (factor 1).
    "proportional": {"factor": 1.0, "partial_rotary_factor": 1.0},
    # Phi-3's 128k models (core.longrope): factor or attention_factor, at least one
    "longrope": LONGROPE_OPTIONAL,
}

# Keys of Hugging Face's rope_parameters that MHAConfig holds elsewhere (one fact in one place).
_HELD_ELSEWHERE = {
    "rope_theta": "MHAConfig.rope_base",
    "partial_rotary_factor": "MHAConfig.rope_dims (rope_dims = int(head_dim * partial_rotary_factor))",
}

# What each key means, for the error that says it is missing.
_MEANING = {
    "factor": "the ratio of the new context length to the original",
    "original_max_position_embeddings": "the context length the model was trained at",
    "low_freq_factor": "L / low_freq_factor is the wavelength past which a pair is divided by factor",
    "high_freq_factor": "L / high_freq_factor is the wavelength below which a pair is kept",
    **LONGROPE_MEANING,
}


def _rope_type(value: Mapping) -> str:
    """The type, from "rope_type" or Hugging Face's legacy "type" (both: they must agree)."""
    if "rope_type" in value and "type" in value and value["rope_type"] != value["type"]:
        raise ValueError(
            f"{_NAME} gives 'rope_type'={value['rope_type']!r} and the legacy 'type'={value['type']!r}; "
            "they name the same thing and must agree (pass one)"
        )
    if "rope_type" in value:
        rope_type = value["rope_type"]
    elif "type" in value:
        rope_type = value["type"]
    else:
        raise ValueError(
            f"{_NAME} needs the key 'rope_type' (or Hugging Face's legacy 'type'), one of "
            f"{', '.join(map(repr, ROPE_SCALING_TYPES))}; got the keys {sorted(map(str, value))}"
        )
    if rope_type == "default":
        raise ValueError(f"{_NAME}['rope_type']='default' is no scaling: pass rope_scaling=None")
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"{_NAME}['rope_type'] must be one of {', '.join(map(repr, ROPE_SCALING_TYPES))}, got {rope_type!r}"
        )
    return rope_type


def validate_rope_scaling(value: object) -> dict | None:
    """None -> None; else the normalised form of a dict in Hugging Face's form.

    The normalised dict has the key ``"rope_type"`` (Hugging Face's legacy ``"type"`` is
    read as it), exactly the keys its type takes, numbers as floats, lengths as ints,
    ``truncate`` as a bool, and yarn's optional keys filled with their defaults
    (``beta_fast=32.0``, ``beta_slow=1.0``, ``truncate=True``; ``attention_factor``,
    ``mscale`` and ``mscale_all_dim`` None when not given, as Hugging Face reads them).
    Every error is a ValueError or TypeError starting with ``MHAConfig.rope_scaling`` that
    names the key, the rule and the value given.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{_NAME} must be None or a dict in Hugging Face's form, e.g. {{'rope_type': 'linear', 'factor': 2.0}}, "
            f"got {value!r} ({type(value).__name__})"
        )
    rope_type = _rope_type(value)
    required, optional = _REQUIRED[rope_type], _OPTIONAL[rope_type]
    known = ("rope_type", "type", *required, *optional)
    for key in value:
        if key in _HELD_ELSEWHERE and key not in optional:
            raise ValueError(
                f"{_NAME} has the key {key!r}, which MHAConfig holds in {_HELD_ELSEWHERE[key]}; "
                "remove it from rope_scaling and set it there"
            )
        if key not in known:
            raise ValueError(
                f"{_NAME} has the unknown key {key!r} for rope_type={rope_type!r} "
                f"(it takes {', '.join(map(repr, (*required, *optional)))})"
            )
    for key in required:
        if key not in value:
            where = ", Hugging Face's config.max_position_embeddings" if rope_type == "dynamic" else ""
            raise ValueError(
                f"{_NAME}[{key!r}] is required for rope_type={rope_type!r} ({_MEANING[key]}{where}); it is missing"
            )

    if rope_type == "proportional":
        return _proportional_options(value)
    if rope_type == "longrope":
        return longrope_options(value)
    out: dict = {"rope_type": rope_type, "factor": _number("factor", value["factor"])}
    if "original_max_position_embeddings" in required:
        key = "original_max_position_embeddings"
        out[key] = _length(key, value[key])
    if rope_type == "llama3":
        low = _number("low_freq_factor", value["low_freq_factor"])
        high = _number("high_freq_factor", value["high_freq_factor"])
        if low >= high:
            raise ValueError(
                f"{_NAME}['low_freq_factor'] must be less than 'high_freq_factor' (the smoothed band lies between "
                f"L / high_freq_factor and L / low_freq_factor), got low_freq_factor={low:g}, high_freq_factor={high:g}"
            )
        out["low_freq_factor"], out["high_freq_factor"] = low, high
    if rope_type == "yarn":
        out.update(_yarn_options(value))
    return out


def _yarn_options(value: Mapping) -> dict:
    """yarn's optional keys, checked, with their defaults filled."""
    given = {key: value.get(key) for key in _OPTIONAL["yarn"]}
    out: dict = {}
    for key in ("beta_fast", "beta_slow"):
        # None is "not given" (Hugging Face reads `get(key) or default`); 0 is refused, not read as the default.
        out[key] = _OPTIONAL["yarn"][key] if given[key] is None else _number(key, given[key])
    if out["beta_fast"] < out["beta_slow"]:
        raise ValueError(
            f"{_NAME}['beta_fast'] must be at least 'beta_slow' (beta_fast rotations mark the start of the "
            f"correction range, beta_slow its end), got beta_fast={out['beta_fast']:g}, beta_slow={out['beta_slow']:g}"
        )
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        out[key] = None if given[key] is None else _number(key, given[key])
    if (out["mscale"] is None) != (out["mscale_all_dim"] is None):
        lone, other = ("mscale", "mscale_all_dim") if out["mscale"] is not None else ("mscale_all_dim", "mscale")
        raise ValueError(
            f"{_NAME}[{lone!r}] is given without {other!r}: Hugging Face reads them only as a pair "
            f"(attention_factor = m(factor, mscale) / m(factor, mscale_all_dim)) and otherwise ignores {lone!r}; "
            f"pass both, or neither, or attention_factor itself"
        )
    truncate = value.get("truncate", True)
    if not isinstance(truncate, (bool, np.bool_)):
        raise TypeError(
            f"{_NAME}['truncate'] must be True or False (round the correction range outwards to whole pairs), "
            f"got {truncate!r} ({type(truncate).__name__})"
        )
    out["truncate"] = bool(truncate)
    return out


def _proportional_options(value: Mapping) -> dict:
    """proportional's keys, checked, with their defaults filled (factor 1, partial_rotary_factor 1)."""
    out: dict = {"rope_type": "proportional"}
    for key, default in _OPTIONAL["proportional"].items():
        out[key] = default if value.get(key) is None else _number(key, value[key])
    if out["partial_rotary_factor"] > 1:
        raise ValueError(
            f"{_NAME}['partial_rotary_factor'] is the share of the head's pairs that turn (proportional rope), "
            f"so it must be in (0, 1], got {out['partial_rotary_factor']:g}"
        )
    return out


def proportional_pairs(rope_dims: int, partial_rotary_factor: float) -> int:
    """How many of the ``rope_dims / 2`` pairs turn under proportional rope: ``int(p * r // 2)``, as transformers."""
    return int(partial_rotary_factor * rope_dims // 2)


def _mscale(scale: float, k: float = 1.0) -> float:
    """YaRN's ``m(s, k)``: 1 for ``s <= 1``, else ``0.1 k ln(s) + 1``."""
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def yarn_attention_factor(rope_scaling: dict) -> float:
    """The factor YaRN puts on cos and sin (see the module docstring), for a normalised yarn dict."""
    if rope_scaling["attention_factor"] is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling["factor"]
    if rope_scaling["mscale"] is not None:  # validated: mscale_all_dim is given too
        return _mscale(factor, rope_scaling["mscale"]) / _mscale(factor, rope_scaling["mscale_all_dim"])
    return _mscale(factor)


def yarn_correction_range(rope_dims: int, base: float, rope_scaling: dict) -> tuple[float, float]:
    """``(low, high)``: the pair indices between which YaRN blends from kept to interpolated frequencies."""
    length = rope_scaling["original_max_position_embeddings"]

    def pair_index(turns: float) -> float:  # d(n): the pair that turns `turns` times over `length` positions
        return rope_dims * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_index(rope_scaling["beta_fast"]), pair_index(rope_scaling["beta_slow"])
    if rope_scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    return float(max(low, 0)), float(min(high, rope_dims - 1))


def _as_int(name: str, value: object, rule: str) -> int:
    """``value`` as an int (NumPy's integers too), or a TypeError naming ``name`` (a bool is not an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"scaled_frequencies: {name} must be {rule}, got {value!r} ({type(value).__name__})")
    return int(value)


def _require_arguments(rope_dims: object, base: object, seq_len: object) -> None:
    rule = "a positive even int"
    dims = _as_int("rope_dims", rope_dims, rule)
    if dims <= 0 or dims % 2:
        raise ValueError(f"scaled_frequencies: rope_dims must be {rule}, got {rope_dims!r}")
    if not _is_real(base):
        raise TypeError(f"scaled_frequencies: base must be a finite number > 0 (MHAConfig.rope_base), got {base!r}")
    if not math.isfinite(float(base)) or float(base) <= 0:
        raise ValueError(f"scaled_frequencies: base must be a finite number > 0 (MHAConfig.rope_base), got {base!r}")
    rule = "a positive int (1 + the largest position in the call)"
    if _as_int("seq_len", seq_len, rule) <= 0:
        raise ValueError(f"scaled_frequencies: seq_len must be {rule}, got {seq_len!r}")


def scaled_frequencies(
    rope_dims: int, base: float, rope_scaling: dict | None, seq_len: int
) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_factor)``: the turn per position of each pair, ``(rope_dims/2,)`` float64, and the factor on cos and sin.

    ``rope_scaling`` None gives ``base ** (-2i / rope_dims)`` and 1.0. ``seq_len`` is 1 +
    the largest position in the call; only ``"dynamic"`` reads it. The formulas are those of
    the module docstring. ``rope_scaling`` may be a raw dict: it is validated here too.
    """
    _require_arguments(rope_dims, base, seq_len)
    rope_dims, base, seq_len = int(rope_dims), float(base), int(seq_len)
    scaling = validate_rope_scaling(rope_scaling)
    pair = np.arange(0, rope_dims, 2, dtype=np.float64)  # (r/2,): 2i
    inv_freq = base ** (-pair / rope_dims)  # (r/2,)
    if scaling is None:
        return inv_freq, 1.0
    rope_type, factor = scaling["rope_type"], scaling["factor"]
    if rope_type == "longrope":  # the short or the long table, by the call's length (core.longrope)
        return longrope_frequencies(inv_freq, scaling, seq_len)
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "proportional":  # the first int(p * r // 2) pairs turn, at the whole head's frequencies
        turning = np.arange(rope_dims // 2) < proportional_pairs(rope_dims, scaling["partial_rotary_factor"])
        return np.where(turning, inv_freq, 0.0) / factor, 1.0
    length = scaling["original_max_position_embeddings"]
    if rope_type == "dynamic":
        if seq_len <= length or rope_dims == 2:  # the base is unchanged; with r = 2 it does not matter (base ** 0)
            return inv_freq, 1.0
        grown = base * (factor * seq_len / length - (factor - 1)) ** (rope_dims / (rope_dims - 2))
        return grown ** (-pair / rope_dims), 1.0
    if rope_type == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq  # (r/2,)
        smooth = (length / wavelength - low) / (high - low)  # (r/2,): 0 at L / low, 1 at L / high
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = np.where(wavelength > length / low, inv_freq / factor, blended)
        return np.where(wavelength < length / high, inv_freq, out), 1.0
    # yarn
    if base == 1.0:
        raise ValueError(
            f"{_NAME}: rope_type='yarn' needs MHAConfig.rope_base != 1 (its correction range divides by ln(base)), "
            f"got {base:g}"
        )
    low, high = yarn_correction_range(rope_dims, base, scaling)
    if low == high:
        high += 0.001  # Hugging Face's guard against a zero-width ramp
    ramp = np.clip((np.arange(rope_dims // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # (r/2,)
    return (inv_freq / factor) * ramp + inv_freq * (1 - ramp), yarn_attention_factor(scaling)


def describe_rope_scaling(rope_scaling: dict | None) -> str:
    """A short summary for `MHAConfig.describe`, e.g. ``yarn(factor=32, orig=4096)``; "none" for None.

    Only the keys that differ from their defaults are shown after the type's own.
    """
    scaling = validate_rope_scaling(rope_scaling)
    if scaling is None:
        return "none"
    if scaling["rope_type"] == "longrope":
        return describe_longrope(scaling)
    parts = [f"factor={scaling['factor']:g}"]
    if scaling["rope_type"] == "proportional":
        parts.append(f"partial_rotary_factor={scaling['partial_rotary_factor']:g}")
        return f"proportional({', '.join(parts)})"
    if scaling["rope_type"] == "llama3":
        parts += [f"low={scaling['low_freq_factor']:g}", f"high={scaling['high_freq_factor']:g}"]
    if "original_max_position_embeddings" in scaling:
        parts.append(f"orig={scaling['original_max_position_embeddings']}")
    for key, default in _OPTIONAL[scaling["rope_type"]].items():
        if scaling[key] != default:
            shown = f"{scaling[key]:g}" if isinstance(scaling[key], float) else str(scaling[key])
            parts.append(f"{key}={shown}")
    return f"{scaling['rope_type']}({', '.join(parts)})"
