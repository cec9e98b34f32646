"""`MHAConfig`: a frozen, validated description of one multi-head attention layer.

Every other part of the project (the oracle, the backends, the checks, the
benchmarks and the explainer) reads its sizes from here, so the rules that make a
configuration valid are stated once, in `__post_init__`, and every violation names
the field, the value given and the rule it broke.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ._validate import require_bool, require_positive_int
from .rope_scaling import describe_rope_scaling
from .variants import BUILT_FROM_REGISTRY, VARIANT_REGISTRY, validate_variants, variants_on

# The two rotary conventions, by the pairs of features they rotate together (`core.rotary`).
ROPE_STYLES = ("half", "interleaved")

# The variants of the 2024-26 models, by the name an implementation declares in
# `Backend.variants` when it implements one: the names of `core.variants.VARIANT_REGISTRY`, in
# its order. `MHAConfig.variants` lists those a configuration switches on; an implementation
# that does not declare one is unsupported for it, with a reason, never run without it. One
# name per rule an implementation must get right (each entry's `summary` says which).
VARIANTS = tuple(VARIANT_REGISTRY)


def _resolve_rope(rope: str | None, base: float, dims: int | None, d_k: int) -> int | None:
    """Validate the rotary fields; the number of rotated features per head (None without rope)."""
    if rope is not None and rope not in ROPE_STYLES:
        raise ValueError(f"MHAConfig.rope must be None or one of {', '.join(map(repr, ROPE_STYLES))}, got {rope!r}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
        raise ValueError(f"MHAConfig.rope_base must be a finite positive number, got {base!r}")
    if rope is None:
        if dims is not None:
            raise ValueError(f"MHAConfig.rope_dims={dims!r} needs rope='half' or 'interleaved' (rope is None)")
        return None
    if dims is None:
        if d_k % 2:
            raise ValueError(
                f"MHAConfig.rope={rope!r} rotates pairs of features, so d_k must be even, got d_k={d_k}; "
                "pass an even rope_dims < d_k for partial rotary"
            )
        return d_k
    require_positive_int("rope_dims", dims)
    if dims % 2 or dims > d_k:
        raise ValueError(f"MHAConfig.rope_dims must be even and at most d_k={d_k}, got {dims}")
    return dims


def _registry_fields(cls):
    """Add the fields the registry's entries own (`core.variants.ConfigField`) to ``cls`` before `dataclass` reads it.

    The package's own variants have theirs written out below (public API: ``MHAConfig(softcap=...)``, in the
    positional order they have always had); an entry registered from outside declares its own, which become
    keyword fields after those, in registry order, validated by the entry's ``validate``. Without such an
    entry ``MHAConfig`` is exactly the written class (its fields, `asdict` and every output unchanged).
    """
    annotations = cls.__annotations__  # the class's own (it has no base), a dict under Python 3.11-3.13
    for entry in VARIANT_REGISTRY.values():
        for spec in entry.config_fields:
            if spec.name in annotations:
                raise ValueError(f"variant {entry.name!r} declares the MHAConfig field {spec.name!r}, which exists")
            annotations[spec.name] = spec.annotation
            setattr(cls, spec.name, spec.default)
    BUILT_FROM_REGISTRY.append("MHAConfig's fields")
    return cls


@dataclass(frozen=True)
@_registry_fields
class MHAConfig:
    """Sizes and switches of one attention layer.

    Fields left as ``None`` take their conventional defaults:
    ``d_k = d_model // n_heads``, ``d_v = d_k``, ``n_kv_heads = n_heads`` (plain MHA; fewer
    kv heads give grouped-query attention, one gives multi-query attention),
    ``kdim = vdim = d_model`` (self-attention widths) and ``scale = 1 / sqrt(d_k)``.

    ``causal=True`` lets query ``i`` attend to key ``j`` only when ``p_j <= p_i``, on the
    token positions (`core.inputs.causal_allowed`). With the default positions that is the
    top-left rule ``j <= i`` of ``is_causal=True`` in torch's SDPA and
    ``jax.nn.dot_product_attention``; on a decode step (queries at ``Nk-Nq .. Nk-1`` over
    ``Nk`` cached keys) it is bottom-right, as in Hugging Face and FlashAttention.

    ``rope`` turns on rotary position embeddings (see `core.rotary`): queries and keys are
    rotated after the head split, before the scores. ``"half"`` pairs feature ``i`` with
    ``i + rope_dims/2`` (rotate_half: Hugging Face Llama, GPT-NeoX); ``"interleaved"``
    pairs ``2i`` with ``2i+1`` (Meta Llama, GPT-J). Pair ``i`` turns by ``position *
    rope_base**(-2i/rope_dims)``. ``rope_dims`` (default ``d_k``) rotates only the first
    ``rope_dims`` features of each head and passes the rest through (partial rotary, as in
    GPT-NeoX); it is resolved to ``d_k`` when rope is on and stays None when it is off.
    ``rope_scaling`` scales the rotary frequencies in Hugging Face's form (`core.rope_scaling`).

    The variants of the 2024-26 models (`VARIANTS`; the formulas in `core.variants`), in the
    order the score pipeline applies them: ``scale * q.k`` -> ``softcap`` -> + ``alibi`` /
    relative bias (``rel_buckets``) -> mask (causal, ``window``, the user's) -> softmax (with
    ``sinks``) -> context. ``qk_norm`` normalises the queries and keys before rotary. Each
    defaults to off, which is today's attention:

    * ``window``: W keys including the query's own position, on the token positions: key j
      is visible to query i iff ``p_i - W < p_j`` (and ``p_j <= p_i`` from ``causal``);
      without ``causal`` it is two-sided, ``|p_i - p_j| < W`` (Hugging Face's convention;
      FlashAttention spells it ``window_size=(W-1, 0)``).
    * ``softcap``: scores become ``c * tanh(s / c)`` (Gemma 2's ``attn_logit_softcapping``).
    * ``qk_norm`` ``"head"``/``"projection"`` with ``norm_eps``: RMSNorm of q and k
      (``params.q_norm``, ``params.k_norm``).
    * ``bias="qkv"``: q, k and v biased, the output not (Qwen2).
    * ``alibi``: ``m_h * (p_j - p_i)`` added to head h's scores, BLOOM's slopes.
    * ``rel_buckets`` (with ``rel_max_distance``, ``rel_bidirectional``): T5's learned
      relative position bias ``params.rel_bias`` ``(buckets, n_heads)``.
    * ``sinks``: one learned logit per head (``params.sinks``) in the softmax denominator only.
    """

    d_model: int
    n_heads: int
    # Typed as what they are after __post_init__ (always set); None, the default, asks for the
    # conventional value. The ignore is the one place a type checker is told so.
    d_k: int = None  # type: ignore[assignment]
    d_v: int = None  # type: ignore[assignment]
    n_kv_heads: int = None  # type: ignore[assignment]
    kdim: int = None  # type: ignore[assignment]
    vdim: int = None  # type: ignore[assignment]
    bias: bool | str = True  # True, False, or "qkv": q, k and v biased, the output not
    causal: bool = False
    scale: float = None  # type: ignore[assignment]
    rope: str | None = None
    rope_base: float = 10000.0
    rope_dims: int | None = None
    rope_scaling: dict | None = None
    window: int | None = None
    softcap: float | None = None
    qk_norm: str | None = None
    norm_eps: float = 1e-6
    alibi: bool = False
    sinks: bool = False
    rel_buckets: int | None = None
    rel_max_distance: int = 128
    rel_bidirectional: bool = True

    if TYPE_CHECKING:
        # The registry's fields (`_registry_fields`: attention_chunk_size, kv_lora_rank, ...) are added when the
        # class is built, so a type checker cannot list them: to it they are keyword arguments and attributes of
        # any type. Nothing here runs; the dataclass's own __init__ validates every field (`__post_init__`).
        def __init__(self, d_model: int, n_heads: int, **fields: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

    def __post_init__(self) -> None:
        # Resolved defaults are written back with object.__setattr__ (the dataclass is
        # frozen), so that after construction cfg.d_k and friends are always ints.
        require_positive_int("d_model", self.d_model)
        require_positive_int("n_heads", self.n_heads)
        for name in ("d_k", "d_v", "n_kv_heads", "kdim", "vdim"):
            value = getattr(self, name)
            if value is not None:
                require_positive_int(name, value)
        if self.bias != "qkv" and not isinstance(self.bias, bool):
            raise TypeError(
                f"MHAConfig.bias must be True, False or 'qkv' (q, k, v biased, not the output), got {self.bias!r}"
            )
        require_bool("causal", self.causal)

        if self.d_k is None and self.d_model % self.n_heads:
            raise ValueError(
                f"MHAConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pass d_k (and d_v) explicitly"
            )
        d_k = self.d_model // self.n_heads if self.d_k is None else self.d_k
        d_v = d_k if self.d_v is None else self.d_v

        n_kv_heads = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if self.n_heads % n_kv_heads:
            raise ValueError(
                f"MHAConfig: n_heads={self.n_heads} is not divisible by n_kv_heads={n_kv_heads}; "
                "each kv head must serve the same number of query heads"
            )

        scale = 1.0 / math.sqrt(d_k) if self.scale is None else self.scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"MHAConfig.scale must be a finite positive number, got {self.scale!r}")

        rope_dims = _resolve_rope(self.rope, self.rope_base, self.rope_dims, d_k)
        resolved = validate_variants(self)  # each entry checks its fields (core.variants), in registry order

        object.__setattr__(self, "d_k", d_k)
        object.__setattr__(self, "d_v", d_v)
        object.__setattr__(self, "n_kv_heads", n_kv_heads)
        object.__setattr__(self, "kdim", self.d_model if self.kdim is None else self.kdim)
        object.__setattr__(self, "vdim", self.d_model if self.vdim is None else self.vdim)
        object.__setattr__(self, "scale", float(scale))
        object.__setattr__(self, "rope_base", float(self.rope_base))
        object.__setattr__(self, "rope_dims", rope_dims)
        for name, value in resolved.items():  # softcap and norm_eps as floats, rope_scaling normalised
            object.__setattr__(self, name, value)

    def __hash__(self) -> int:
        # rope_scaling is a dict (unhashable); hash its sorted items instead.
        return hash(tuple((f, _hashable(getattr(self, f))) for f in _FIELD_NAMES))

    # Which biases exist, named once (bias="qkv" keeps q, k and v's and drops the output's).
    @property
    def qkv_bias(self) -> bool:
        """True when q, k and v carry biases (``bias`` True or ``"qkv"``)."""
        return bool(self.bias)

    @property
    def output_bias(self) -> bool:
        """True when the output projection carries a bias (``bias is True``)."""
        return self.bias is True

    @property
    def variants(self) -> tuple[str, ...]:
        """The `VARIANTS` this configuration switches on, in `VARIANTS` order (empty: 2017-23 attention)."""
        return tuple(entry.name for entry in variants_on(self))

    @property
    def has_score_bias(self) -> bool:
        """True when something is added to the scores (ALiBi or T5's relative bias): the biased_scores stage."""
        return any(e.score_step is not None and e.score_step.place == "bias" for e in variants_on(self))

    # Derived sizes, named once so that no module recomputes them differently.
    @property
    def q_width(self) -> int:
        """Width of the merged query projection, ``n_heads * d_k``."""
        return self.n_heads * self.d_k

    @property
    def k_width(self) -> int:
        """Width of the merged key projection, ``n_kv_heads * d_k``."""
        return self.n_kv_heads * self.d_k

    @property
    def v_width(self) -> int:
        """Width of the merged value projection, ``n_kv_heads * d_v``."""
        return self.n_kv_heads * self.d_v

    @property
    def context_width(self) -> int:
        """Width of the merged heads before the output projection, ``n_heads * d_v``."""
        return self.n_heads * self.d_v

    @property
    def group_size(self) -> int:
        """Query heads per kv head: query head ``h`` reads kv head ``h // group_size``."""
        return self.n_heads // self.n_kv_heads

    @property
    def is_self_attention_shaped(self) -> bool:
        """True when key and value inputs have the query's width (kdim == vdim == d_model)."""
        return self.kdim == self.d_model and self.vdim == self.d_model

    def kv_head_of(self, head: int) -> int:
        """The kv head that query head ``head`` reads (GQA grouping of torch and JAX)."""
        return head // self.group_size

    def describe(self) -> str:
        """A one-line summary for reports, e.g. ``d_model=12 heads=3 (kv 3) d_k=4 d_v=4``."""
        parts = [f"d_model={self.d_model}", f"heads={self.n_heads}"]
        if self.n_kv_heads != self.n_heads:
            parts.append(f"kv_heads={self.n_kv_heads}")
        parts += [f"d_k={self.d_k}", f"d_v={self.d_v}"]
        if not self.is_self_attention_shaped:
            parts.append(f"kdim={self.kdim} vdim={self.vdim}")
        if not self.bias:
            parts.append("no-bias")
        elif self.bias == "qkv":
            parts.append("qkv-bias")
        if self.causal:
            parts.append("causal")
        if self.rope is not None:
            dims = "" if self.rope_dims == self.d_k else f" dims={self.rope_dims}"
            parts.append(f"rope={self.rope}(base={self.rope_base:g}{dims})")
        if self.rope_scaling is not None:
            parts.append(f"rope_scaling={describe_rope_scaling(self.rope_scaling)}")
        if self.qk_norm is not None:
            parts.append(f"qk_norm={self.qk_norm}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.rel_buckets is not None:
            sides = "bidirectional" if self.rel_bidirectional else "past"
            parts.append(f"rel_bias({self.rel_buckets} buckets, max {self.rel_max_distance}, {sides})")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.sinks:
            parts.append("sinks")
        for entry in variants_on(self):  # the fields of an entry registered from outside, as written
            parts += [f"{spec.name}={getattr(self, spec.name)!s}" for spec in entry.config_fields]
        return " ".join(parts)


def _hashable(value: object) -> object:
    return tuple(sorted(value.items())) if isinstance(value, dict) else value


_FIELD_NAMES = tuple(f.name for f in fields(MHAConfig))


def require_config(cfg: object) -> MHAConfig:
    """Return ``cfg`` if it is an MHAConfig, else raise a TypeError that says what was given."""
    if not isinstance(cfg, MHAConfig):
        raise TypeError(f"cfg must be an MHAConfig, got {type(cfg).__name__}")
    return cfg
