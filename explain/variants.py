"""The explainer's "Variants" section: each variant of `core.VARIANTS` with its formula, its place in the pipeline,
the stage it changes, each library's spelling, and the known off-by-ones.

Design rules. The list is driven by `core.VARIANTS`: `variant_entries` raises when a variant has no
explainer entry (`ENTRIES`), so a new variant cannot be left out silently. Every number printed is
computed here from `core` (the slopes from `core.alibi_slopes`, T5's buckets from `core.t5_buckets`,
the frequencies from `core.rope_scaling`, the windows from `core.variants.window_allowed`), and the
stage each variant changes is measured: the float64 oracle runs with the variant on and off on the
same parameters and inputs (`DEMO`, 6 tokens), and the first stage whose tensor differs is named.
The library spellings are the one typed part: names of configuration fields and arguments.
NumPy and `core` only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from mha_rosetta.core import VARIANTS, MHAConfig, init_params, reference_stages, stage_names
from mha_rosetta.core.rope_scaling import scaled_frequencies, validate_rope_scaling, yarn_attention_factor
from mha_rosetta.core.variants import (
    alibi_bias,
    alibi_slopes,
    softcap,
    softmax_with_empty_rows,
    t5_buckets,
    window_allowed,
)

TOKENS = 6
VARIANTS_INTRO = (
    "The variants of 2024-26 attention (core.VARIANTS), each off by default. The score pipeline runs in the order "
    "of the stage list, here with every score variant on (a stage that only a variant adds exists only with it):"
)
# The demonstration layer: 6 heads (not a power of two, as BLOOM's ALiBi needs to show), causal, rotary half.
DEMO = MHAConfig(d_model=24, n_heads=6, d_k=4, causal=True, rope="half", bias=False)
# Each variant switched on in the demonstration (its field and value), and switched off again.
SWITCH_ON: dict[str, dict] = {
    "window": {"window": 3},
    "softcap": {"softcap": 2.0},
    "qk_norm_head": {"qk_norm": "head"},
    "qk_norm_projection": {"qk_norm": "projection"},
    "qkv_bias": {"bias": "qkv"},
    "alibi": {"alibi": True},
    "rel_bias": {"rel_buckets": 8, "rel_max_distance": 5, "rel_bidirectional": False},
    "sinks": {"sinks": True},
    "rope_scaling": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
}
SWITCH_OFF = {"window": None, "softcap": None, "qk_norm": None, "bias": True, "alibi": False, "rel_buckets": None}
SWITCH_OFF |= {"sinks": False, "rope_scaling": None, "rel_max_distance": 128, "rel_bidirectional": True}


@dataclass(frozen=True)
class VariantEntry:
    variant: str  # a core.VARIANTS name
    fields: str  # the MHAConfig fields that switch it on
    formula: str
    place: str  # where it sits in the pipeline
    stages: str  # the stages it adds, and the first stage it changes (measured)
    spellings: list[tuple[str, str]] = field(default_factory=list)  # (library, how it spells the variant)
    pitfalls: list[str] = field(default_factory=list)  # known off-by-ones, with computed numbers

    def to_dict(self) -> dict:
        return asdict(self)


# -- the measured stage, and the demonstration's tensors ------------------------------------------
def _demo(variant: str):
    """(cfg on, params on, stages on, cfg off, stages off) of the demonstration for ``variant``."""
    on = replace(DEMO, **SWITCH_ON[variant])
    off = replace(on, **{name: SWITCH_OFF[name] for name in SWITCH_ON[variant]})
    params = init_params(on, seed=3)
    params_off = replace(params, q_norm=None, k_norm=None, sinks=None, rel_bias=None)
    if on.bias == "qkv":  # off, bias=True: the output bias is back
        params_off = replace(params_off, b_o=init_params(off, seed=3).b_o)
    x = np.random.default_rng(4).standard_normal((1, TOKENS, DEMO.d_model))
    return on, params, reference_stages(on, params, x), off, reference_stages(off, params_off, x)


def _changed_stages(variant: str) -> str:
    on, _, stages_on, off, stages_off = _demo(variant)
    added = [name for name in stage_names(on) if name not in stage_names(off)]
    first = next(
        name
        for name in stage_names(on)
        if name not in stages_off
        or not np.allclose(stages_on[name], stages_off[name], rtol=0.0, atol=1e-12, equal_nan=True)
    )
    text = f"adds {', '.join(added)}; " if added else ""
    return text + f"first changed: {first}"


def _numbers(values, digits: int = 4) -> str:
    return ", ".join(f"{v:.{digits}g}" for v in np.ravel(values))


# -- one entry per variant ---------------------------------------------------------------------------
def _window() -> VariantEntry:
    W = SWITCH_ON["window"]["window"]
    positions = np.arange(TOKENS)[None]
    i, j = np.arange(TOKENS)[:, None], np.arange(TOKENS)[None, :]

    def flash(left: int, right: int) -> np.ndarray:  # FlashAttention's window_size=(left, right), causal
        return (j >= i - left) & (j <= i + right) & (j <= i)

    spec = window_allowed(W, True, positions, positions)[0, 0] & (j <= i)  # (N, N)
    same = bool(np.array_equal(spec, flash(W - 1, 0)))
    return VariantEntry(
        "window",
        "window=W",
        "key j visible to query i iff p_i - W < p_j <= p_i (causal); |p_i - p_j| < W without causal",
        "in the mask, with causal and the user's mask",
        _changed_stages("window"),
        [
            (
                "Hugging Face config",
                f"sliding_window = {W} (Mistral, Gemma 2, gpt-oss): W keys, the query's own included",
            ),
            ("FlashAttention", f"flash_attn_func(..., causal=True, window_size=({W - 1}, 0))"),
            ("JAX", f"jax.nn.dot_product_attention(..., is_causal=True, local_window_size=({W - 1}, 0))"),
            ("FlexAttention", f"mask_mod = lambda b, h, q, kv: (kv <= q) & (q - kv < {W}); create_block_mask"),
        ],
        [
            f"W = {W} is window_size=({W - 1}, 0): the same mask over {TOKENS} tokens: {'yes' if same else 'NO'} "
            f"(keys per query {[int(n) for n in spec.sum(axis=1)]})",
            f"window_size=({W}, 0) taken for a window of {W} keys lets {W + 1} through (keys per query "
            f"{[int(n) for n in flash(W, 0).sum(axis=1)]}): eager and flash disagreed by this one key (transformers #29623, #39408)",
        ],
    )


def _softcap() -> VariantEntry:
    c = SWITCH_ON["softcap"]["softcap"]
    gemma = 50.0  # Gemma 2's attn_logit_softcapping
    scores = np.array([10.0, 50.0, 100.0])
    _, _, stages, _, _ = _demo("softcap")
    blocked = ~np.isfinite(stages["masked_scores"])  # (B, H, N, N): the causal mask's
    capped_after = softcap(np.where(blocked, -np.inf, stages["scores"]), c)  # the mask first, then the cap
    leaked = softmax_with_empty_rows(capped_after)[blocked].max()
    return VariantEntry(
        "softcap",
        "softcap=c",
        "s <- c * tanh(s / c)",
        "after the scale, before ALiBi / the relative bias and the mask",
        _changed_stages("softcap"),
        [
            (
                "Hugging Face config",
                f"attn_logit_softcapping = {gemma:g} (Gemma 2); final_logit_softcapping is the LM head's",
            ),
            (
                "Hugging Face config",
                "query_pre_attn_scalar (Gemma 2): the scale is query_pre_attn_scalar**-0.5, not d_k**-0.5",
            ),
            ("FlashAttention", "flash_attn_func(..., softcap=c)"),
            ("FlexAttention", "score_mod = lambda s, b, h, q, kv: c * torch.tanh(s / c)"),
            ("torch SDPA", "none: the scores are never exposed (transformers PR #32865 dropped Gemma 2's silently)"),
        ],
        [
            f"with c = {gemma:g}, scores {_numbers(scores)} become {_numbers(softcap(scores, gemma))}",
            f"capped after the mask, a blocked score becomes c*tanh(-inf) = {softcap(np.array(-np.inf), c):g} instead "
            f"of -inf: in the demonstration (c = {c:g}) a blocked key then takes up to {leaked:.3g} of a row",
        ],
    )


def _qk_norm(variant: str) -> VariantEntry:
    place = SWITCH_ON[variant]["qk_norm"]
    on, _, stages, _, _ = _demo(variant)
    q = stages["q"][0, 0]  # token 0, (H*Dk,)
    per_head = np.sqrt(np.mean(q.reshape(on.n_heads, on.d_k) ** 2, axis=-1) + on.norm_eps)  # (H,)
    whole = math.sqrt(float(np.mean(q**2)) + on.norm_eps)
    spellings = {
        "head": [
            ("Hugging Face", "Qwen3 / Gemma 3: self_attn.q_norm, k_norm = RMSNorm(head_dim), weight (head_dim,)"),
            ("Hugging Face", "Gemma 3's RMSNorm multiplies by (1 + weight): load weight + 1 as the spec's q_norm"),
        ],
        "projection": [
            ("Hugging Face", "OLMo 2: self_attn.q_norm (n_heads*head_dim,), k_norm (n_kv_heads*head_dim,)"),
        ],
    }[place]
    where = {"head": "after the head split, before rotary", "projection": "before the head split (then rotary)"}
    formula = {
        "head": "q_h <- q_h / sqrt(mean_d(q_h**2) + eps) * w, one w (d_k,) for every head; k the same",
        "projection": "q <- q / sqrt(mean(q**2 over all H*d_k) + eps) * w, w (H*d_k,); k over Hkv*d_k",
    }
    return VariantEntry(
        variant,
        f"qk_norm={place!r}, norm_eps",
        formula[place],
        where[place],
        _changed_stages(variant),
        spellings,
        [
            f"head and projection take different statistics: for token 0 of the demonstration the RMS of each head is "
            f"{_numbers(per_head, 3)}, of the whole projection {whole:.3g}: taking one for the other scales each head "
            "by their ratio (Qwen3 and OLMo 2 differ exactly there)",
        ],
    )


def _qkv_bias() -> VariantEntry:
    return VariantEntry(
        "qkv_bias",
        "bias='qkv'",
        "q, k, v = x @ w.T + b; out = merged @ w_o.T (no b_o)",
        "the projections",
        _changed_stages("qkv_bias"),
        [
            ("Hugging Face", "Qwen2: q_proj, k_proj, v_proj with bias=True, o_proj with bias=False"),
            ("Hugging Face config", "attention_bias = True (Llama family, gpt-oss) biases all four: bias=True here"),
        ],
        ["a dropped b_k changes nothing (the softmax cancels q.b_k along a row): only b_q, b_v and b_o show"],
    )


def _alibi() -> VariantEntry:
    on, _, stages, _, _ = _demo("alibi")
    H, d_k = on.n_heads, on.d_k
    slopes = alibi_slopes(H)
    power_of_two = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    positions = np.arange(TOKENS)[None]
    bloom = stages["scores"] + slopes[None, :, None, None] * positions[:, None, None, :]  # m_h * p_j
    allowed = np.isfinite(stages["masked_scores"])
    bloom_weights = softmax_with_empty_rows(np.where(allowed, bloom, -np.inf))
    spec_bias = alibi_bias(H, positions, positions)
    # The weights agree to rounding, and the last bits depend on the machine's BLAS kernels (3e-17 on an
    # AMD EPYC, 6e-17 on an Intel Xeon, OpenBLAS 0.3.31): the page states the bound, not the digits.
    weights_gap = np.abs(bloom_weights - stages["weights"]).max()
    weights_gap_text = "under 1e-15" if weights_gap < 1e-15 else f"{weights_gap:.1g}"
    return VariantEntry(
        "alibi",
        "alibi=True",
        "s_h <- s_h + m_h * (p_j - p_i), BLOOM's slopes m_h",
        "after the softcap, before the mask (with the relative bias)",
        _changed_stages("alibi"),
        [
            ("Hugging Face", "BLOOM: build_alibi_tensor / _get_alibi_slopes; MPT: attn_config alibi=True"),
            ("Hugging Face", "Falcon: alibi=True, added before the 1/sqrt(d_k) scale"),
            ("FlexAttention", "score_mod = lambda s, b, h, q, kv: s + slope[h] * (kv - q)"),
            ("torch SDPA / JAX", "a float attn_mask / bias of m_h (p_j - p_i), (1, H, Nq, Nk)"),
        ],
        [
            f"{H} heads (not a power of two): the slopes are {_numbers(slopes)} (the 4-head series, then every "
            f"other term of the 8-head one); the power-of-two formula 2**(-8k/{H}) gives {_numbers(power_of_two)}",
            f"Falcon's ALiBi path divides the bias by sqrt(d_k) too: with d_k = {d_k} its slopes are "
            f"{_numbers(slopes / math.sqrt(d_k))}",
            f"BLOOM adds m_h * p_j, not m_h * (p_j - p_i): biased_scores differ by up to "
            f"{np.abs(bloom - (stages['scores'] + spec_bias)).max():.3g} in the demonstration, the weights by "
            f"{weights_gap_text} (a constant per row, which the softmax cancels)",
        ],
    )


def _bucket_edges(buckets: int, max_distance: int) -> list[tuple[int, float, float]]:
    """(distance, T5's float32 log-position, the float64 one) where the exact log-position is a whole number.

    The log-position ``log(d / max_exact) / log(max_distance / max_exact) * (n - max_exact)`` of a past
    distance d (bidirectional halves, n = buckets / 2) is truncated to its bucket; on a whole number a
    last-bit rounding down moves d to the bucket below.
    """
    n = buckets // 2
    max_exact = n // 2
    d = np.arange(max_exact + 1, max_distance)
    f64 = np.log(d / max_exact) / math.log(max_distance / max_exact) * (n - max_exact)
    f32 = (
        np.log(d.astype(np.float32) / np.float32(max_exact))
        / np.float32(math.log(max_distance / max_exact))
        * np.float32(n - max_exact)
    )
    whole = np.abs(f64 - np.round(f64)) < 1e-9
    return [(int(a), float(b), float(c)) for a, b, c in zip(d[whole], f32[whole], f64[whole], strict=True)]


def _rel_bias() -> VariantEntry:
    distances = np.arange(-TOKENS, TOKENS + 1)  # p_j - p_i
    encoder = t5_buckets(distances, 32, 128, True)
    decoder = t5_buckets(distances, 32, 128, False)
    edges = "; ".join(f"d = {d}: {v32!r} in float32, {v64!r} in float64" for d, v32, v64 in _bucket_edges(32, 128))
    return VariantEntry(
        "rel_bias",
        "rel_buckets, rel_max_distance, rel_bidirectional",
        "s_h <- s_h + rel_bias[bucket(p_j - p_i), h], T5's _relative_position_bucket",
        "after the softcap, before the mask (with ALiBi)",
        _changed_stages("rel_bias"),
        [
            ("Hugging Face config", "relative_attention_num_buckets = 32, relative_attention_max_distance = 128 (T5)"),
            (
                "Hugging Face",
                "relative_attention_bias = Embedding(buckets, n_heads) in layer 0, shared; T5 has scale 1",
            ),
            ("Hugging Face", "bidirectional = not is_decoder: the encoder both ways, the decoder past keys only"),
        ],
        [
            f"32 buckets, max distance 128, p_j - p_i = {distances[0]} .. {distances[-1]}: encoder buckets "
            f"{[int(b) for b in encoder]}, decoder {[int(b) for b in decoder]}",
            f"T5 takes the logarithm in float32; at the bucket edges, where the exact log-position is a whole "
            f"number, it is {edges}: a log that rounds one last bit down puts that distance in the bucket below",
            "the distance is key minus query (memory_position - context_position); query minus key exchanges the "
            "encoder's halves and puts every past key of the decoder in bucket 0",
        ],
    )


def _sinks() -> VariantEntry:
    _, _, stages, _, _ = _demo("sinks")
    sums = stages["weights"].sum(axis=-1)  # (B, H, Nq)
    return VariantEntry(
        "sinks",
        "sinks=True",
        "a_ij = exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik))",
        "in the softmax's denominator",
        _changed_stages("sinks"),
        [
            (
                "Hugging Face",
                "gpt-oss: self_attn.sinks (n_heads,): concatenated as one more logit column, softmax, "
                "then dropped (probs[..., :-1])",
            ),
            ("any library", "one more key with logit sink_h and a zero value vector"),
        ],
        [
            f"rows sum to less than 1: in the demonstration between {sums.min():.3g} and {sums.max():.3g}",
            "a sink that keeps its column with a value vector (a sink token) adds that value: the sink's value must be zero",
        ],
    )


def _rope_scaling() -> VariantEntry:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 8192
    plain, _ = scaled_frequencies(8, 500000.0, None, TOKENS)
    scaled, _ = scaled_frequencies(8, 500000.0, llama3, TOKENS)
    linear, _ = scaled_frequencies(8, 500000.0, {"rope_type": "linear", "factor": 8.0}, TOKENS)
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    attention = yarn_attention_factor(validate_rope_scaling(yarn))  # its defaults filled in
    return VariantEntry(
        "rope_scaling",
        "rope_scaling (a dict in Hugging Face's form)",
        "each pair's frequency scaled by its type (linear, dynamic, llama3, yarn); yarn's factor on cos and sin",
        "the rotary tables (q_rotated, k_rotated)",
        _changed_stages("rope_scaling"),
        [
            (
                "Hugging Face config",
                "rope_scaling = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, "
                "'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192} (Llama 3.1)",
            ),
            (
                "Hugging Face config",
                "rope_scaling = {'rope_type': 'yarn', 'factor': 32.0, 'beta_fast': 32.0, "
                "'beta_slow': 1.0, 'original_max_position_embeddings': 4096, 'truncate': False} (gpt-oss)",
            ),
            ("transformers", "ROPE_INIT_FUNCTIONS[rope_type]; the legacy key 'type' is read as 'rope_type'"),
        ],
        [
            f"llama3 (d_k 8, base 500000) divides each pair's frequency by {_numbers(plain / scaled, 3)}; "
            f"linear would divide all by {_numbers(plain / linear, 3)}: the high frequencies are where they differ",
            f"yarn with factor 32 multiplies cos and sin by {attention:.4g}, so the rotated part of each score by "
            f"{attention**2:.3g}",
        ],
    )


ENTRIES = {
    "window": _window,
    "softcap": _softcap,
    "qk_norm_head": lambda: _qk_norm("qk_norm_head"),
    "qk_norm_projection": lambda: _qk_norm("qk_norm_projection"),
    "qkv_bias": _qkv_bias,
    "alibi": _alibi,
    "rel_bias": _rel_bias,
    "sinks": _sinks,
    "rope_scaling": _rope_scaling,
}


def pipeline() -> str:
    """The score pipeline as the stage list of a layer with every score variant on (`core.stage_names`)."""
    every = replace(DEMO, softcap=2.0, alibi=True, qk_norm="head", window=3, sinks=True)
    return " -> ".join(stage_names(every))


def variant_entries() -> list[VariantEntry]:
    """One entry per `core.VARIANTS` name, in that order; a variant without an entry is an error."""
    missing = [name for name in VARIANTS if name not in ENTRIES]
    if missing:
        raise KeyError(
            f"core.VARIANTS has {', '.join(missing)} without an explainer entry: add it to explain.variants.ENTRIES"
        )
    return [ENTRIES[name]() for name in VARIANTS]


def variant_tables(entries: list[VariantEntry]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The section's tables as (title, headers, rows): what each variant is, then how each library spells it."""
    what = [[e.variant, e.fields, e.formula, e.place, e.stages] for e in entries]
    spell = [[e.variant, library, text] for e in entries for library, text in e.spellings]
    slips = [[e.variant, text] for e in entries for text in e.pitfalls]
    return [
        (
            "The variants: formula, place in the pipeline, stage",
            ["variant", "MHAConfig", "formula", "where", "stages"],
            what,
        ),
        ("Each library's spelling", ["variant", "library", "spelling"], spell),
        ("Known off-by-ones and differences (computed)", ["variant", "what to know"], slips),
    ]
