"""The decode property every KV cache is held to (`core.decode`), as data the decode test files share.

`DECODE_CASES`: name -> (cfg, tokens, mask kind); `SPLITS`: the (prefill, step) splits of a run;
`VARIANT_CFGS`: one config per adapted variant, from the registry (`variant_configs`), on GQA + rotary. `decode_run_inputs`
gives a case's x and padding mask; `assert_decode_matches` runs one backend's `run_decode`
against `reference_decode` and, in float64, its step stages against `reference_decode_stages`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from mha_rosetta.backends.vocabulary import STANDARD
from mha_rosetta.core import MHAConfig, compare, init_params
from mha_rosetta.core.decode import prepare_decode_inputs, reference_decode, reference_decode_stages
from mha_rosetta.core.variants import VARIANT_REGISTRY, adapted_variants
from mha_rosetta.explain.variants import DEMO

TOKENS = 9  # long enough for a window of 3 to be outgrown several times


# GQA (4 query heads on 2 kv heads) with half rotary, causal: the base of every decode case.
GQA = {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "causal": True, "rope": "half"}


def _gqa(**extra) -> MHAConfig:
    return MHAConfig(**{**GQA, **extra})


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
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 4},  # 9 > 4: rescaled
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4,
    },
}


def variant_configs(base: dict, names=None) -> dict[str, MHAConfig]:
    """One configuration per registered variant (of ``names`` only, where given), derived from the registry so that a
    new entry needs no edit of the decode tests: its entry's demonstration fields (`Variant.demo_on`) on ``base``.

    A variant no adapter applies (`Variant.implemented_by == ()`) is only ever refused, and a variant whose layer
    holds an entry that sets the base weights' shapes (`Variant.base_shapes`: MLA's heads are nope + rope wide and
    never grouped, which ``base``'s d_k and GQA contradict) cannot sit on ``base``: both are switched on in the
    explainer's demonstration layer (`explain.variants.DEMO`), where every entry's fields are valid.
    """
    configs = {}
    for name, entry in VARIANT_REGISTRY.items():
        if names is not None and name not in names:
            continue
        demo = replace(DEMO, **entry.demo_on)
        if entry.implemented_by == () or any(VARIANT_REGISTRY[on].base_shapes for on in demo.variants):
            configs[name] = demo
        else:
            configs[name] = MHAConfig(**{**base, **entry.demo_on})
    return configs


# One configuration per variant every adapter applies in its standard strategy (`adapted_variants`; MLA's forms run in
# their own strategies, tests/test_mla_adapters.py), from the registry: each entry's demonstration fields on GQA +
# rotary. Then the combinations a cache must also get right: the rope scalings whose
# frequencies read the sequence (dynamic NTK past 4 positions, YaRN; the registry's own is linear), sinks with a
# window the tokens outgrow, and Qwen3-Next's gate with its QK-norm and biases (each step's tokens gated by their own
# sigmoid(x @ w_gate.T + b), nothing cached).
VARIANT_CFGS = {
    **variant_configs(GQA, adapted_variants("numpy", "torch", "jax", "mlx", strategy=STANDARD)),
    **{f"rope_scaling_{kind}": _gqa(rope_scaling=ROPE_SCALINGS[kind]) for kind in ("dynamic", "yarn")},
    "sinks_window": _gqa(sinks=True, window=3),
    "gate_qwen3_next": _gqa(attn_output_gate=True, qk_norm="head", bias="qkv"),
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
