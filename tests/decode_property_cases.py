"""The decode property every KV cache is held to (`core.decode`), as data the decode test files share.

`DECODE_CASES`: name -> (cfg, tokens, mask kind); `SPLITS`: the (prefill, step) splits of a run;
`VARIANT_CFGS`: one config per variant of `core.VARIANTS`, on GQA + rotary. `decode_run_inputs`
gives a case's x and padding mask; `assert_decode_matches` runs one backend's `run_decode`
against `reference_decode` and, in float64, its step stages against `reference_decode_stages`.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, compare, init_params
from mha_rosetta.core.decode import prepare_decode_inputs, reference_decode, reference_decode_stages

TOKENS = 9  # long enough for a window of 3 to be outgrown several times


def _gqa(**extra) -> MHAConfig:
    """GQA (4 query heads on 2 kv heads) with half rotary, causal: the base of every decode case."""
    fields = {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "causal": True, "rope": "half", **extra}
    return MHAConfig(**fields)


# name -> (cfg, padding): padding None, "left" (item 0's first 3 tokens are pads) or "right" (its last 2).
DECODE_CASES = {
    "gqa_rope_half": (_gqa(), None),
    "partial_interleaved": (_gqa(rope="interleaved", rope_dims=2), None),  # d_k 4, 2 dims turned
    "window_outgrown": (_gqa(window=3), None),  # ring of 3 slots (step 1), 9 tokens
    "window_d_v": (_gqa(window=4, d_v=3), None),  # values narrower than keys, a ring of 4
    "left_padded": (_gqa(), "left"),
    "left_padded_window": (_gqa(window=3), "left"),
    "right_padded": (_gqa(), "right"),
    "mha_no_rope": (MHAConfig(d_model=12, n_heads=3, causal=True), None),
}

# (prefill, step): one token at a time from the first, two per step, the whole sequence as the prefill,
# a prefill longer than a window's ring (3 or 4 slots) and one shorter.
SPLITS = [(1, 1), (2, 2), (TOKENS, 1), (6, 1), (5, 3)]

ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4},  # 9 > 4: rescaled
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4,
    },
}

# One configuration per variant of core.VARIANTS (the window one is DECODE_CASES' window_outgrown too).
VARIANT_CFGS = {
    "window": _gqa(window=3),
    "softcap": _gqa(softcap=2.0),
    "qk_norm_head": _gqa(qk_norm="head"),
    "qk_norm_projection": _gqa(qk_norm="projection"),
    "qkv_bias": _gqa(bias="qkv"),
    "alibi": _gqa(rope=None, alibi=True),
    "rel_bias": _gqa(rope=None, rel_buckets=6, rel_max_distance=5, rel_bidirectional=False),
    "sinks": _gqa(sinks=True, window=3),
    **{f"rope_scaling_{kind}": _gqa(rope_scaling=scaling) for kind, scaling in ROPE_SCALINGS.items()},
    "chunked": _gqa(attention_chunk_size=3),  # Llama 4's chunks: boundaries at 3, 6 across the steps
    # Qwen3-Next's output gate: each step's tokens gated by their own sigmoid(x @ w_gate.T + b), nothing cached.
    "gate": _gqa(attn_output_gate=True, qk_norm="head", bias="qkv"),
    # Gemma 4's global layers: V is the raw key projection (w_v tied to w_k), so the cache's values are keys unrotated.
    "k_eq_v": _gqa(attention_k_eq_v=True),
    # Llama 4's rotary layer: the cache holds each key rotated at its position, then normed (weightless, per head).
    "qk_norm_after_rope": _gqa(rope="interleaved", qk_norm_after_rope=True),
    # Llama 4's NoPE layer: floor_scale 3 steps the factor at positions 2, 5, 8, inside the decoded steps, so a step
    # whose positions lost the cache offset is caught.
    "temperature": _gqa(rope=None, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5),
    # Gemma 4's value norm: the cache holds the normed values (each token's own norm).
    "value_norm": _gqa(value_norm=True),
}


def decode_run_inputs(cfg: MHAConfig, padding: str | None, seed: int = 0, batch: int = 2):
    """(x (B, N, D), mask (B, N) or None): random tokens and the case's padding mask."""
    x = np.random.default_rng(seed).standard_normal((batch, TOKENS, cfg.d_model))
    if padding is None:
        return x, None
    mask = np.ones((batch, TOKENS), dtype=bool)
    if padding == "left":
        mask[0, :3] = False
    else:
        mask[0, -2:] = False
    return x, mask


def assert_decode_matches(backend, cfg, x, mask, prefill, step, dtype, stages=True, **options):
    """``backend.run_decode`` equals the full causal forward within ``dtype``'s tolerance; in float64 (and when
    ``stages``) each chunk's step stages equal the full forward's stages sliced to the chunk's tokens."""
    params = init_params(cfg, seed=3)
    expected = reference_decode(cfg, params, x, prefill=prefill, step=step, mask=mask)
    prepared, inputs = backend.prepare_decode_run(
        cfg, params, x, prefill=prefill, step=step, mask=mask, dtype=dtype, **options
    )
    actual = inputs.unbatch(prepared.output())
    result = compare(actual, expected, dtype)
    assert result.ok, f"{backend.name} {dtype} prefill={prefill} step={step}: {result}"
    if dtype != "float64" or not stages:
        return prepared
    reference = reference_decode_stages(
        cfg, params, prepare_decode_inputs(cfg, x, prefill=prefill, step=step, mask=mask)
    )
    chunks = backend.decode_stages(prepared, cfg)
    assert chunks is not None and len(chunks) == len(reference)
    for number, (got, want) in enumerate(zip(chunks, reference, strict=True)):
        assert set(want) <= set(got), f"chunk {number} lacks {sorted(set(want) - set(got))}"
        for name, value in want.items():
            check = compare(got[name], value, dtype)
            assert check.ok, f"chunk {number} ({inputs.chunks()[number]}) diverges at {name}: {check}"
    return prepared


def assert_variant_decodes(backend, variant: str, prefill: int, step: int) -> None:
    """``VARIANT_CFGS[variant]`` decoded on a left-padded batch: in float64 with its stages, in float32 without."""
    cfg = VARIANT_CFGS[variant]
    x, mask = decode_run_inputs(cfg, "left")
    assert_decode_matches(backend, cfg, x, mask, prefill, step, "float64")
    assert_decode_matches(backend, cfg, x, mask, prefill, step, "float32", stages=False)
