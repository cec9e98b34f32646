"""Hypothesis: on random small configurations, every installed implementation agrees with the oracle.

Each example is a `SpecCase` built from drawn numbers (shapes, GQA grouping, cross-
attention widths, bias, causal, rotary (none, half or interleaved, full or partial), a
mask: none, key padding or random, shared or per head) and a dtype, run through
`run_check` exactly as the command runs it. Sizes are drawn distinct from one another so
that a swapped pair of axes cannot pass by luck.

Properties, per backend:
- every correct strategy agrees with the float64 oracle at its dtype's tolerance; a
  third-party oracle may instead show a named known difference on rows with no
  allowed key, or declare a configuration it cannot express;
- the direct-reshape mistake is caught, at stage ``q_heads``, whenever it can be seen
  at all (at least two heads and two query tokens; with one of either it is correct).

Bounded: few examples for the JAX-based backends (each new shape costs a compile), more
for the rest; ``deadline=None`` because a first compile is slow by design.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from conftest import installed_backend
from mha_rosetta.backends import REGISTRY, STANDARD
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.checks import SpecCase, Status, run_check
from mha_rosetta.core import MHAConfig

# Examples per backend: compiling backends pay for every new shape.
EXAMPLES = {"numpy": 40, "einops-numpy": 40, "jax": 6, "einops-jax": 5, "jax-dpa": 5, "flax": 4, "equinox": 4}
# The sharded backends run in worker processes: every example is a compile (JAX) or a module
# parallelised over two ranks (torch); a few examples each.
EXAMPLES.update({"jax-sharded": 4, "torch-tp": 6})
DEFAULT_EXAMPLES = 25


# A plain configuration and a decoder layer's (causal self-attention, rotate-half over every feature).
PLAIN = MHAConfig(d_model=8, n_heads=2)
DECODER = MHAConfig(d_model=8, n_heads=2, n_kv_heads=1, causal=True, rope="half", bias=False)


def decoder_only(backend) -> bool:
    """A backend that is a real decoder layer (hf-attention) refuses every draw but a decoder layer's."""
    refuses = [backend.unsupported_reason(cfg, "float32", "cpu", STANDARD) for cfg in (PLAIN, DECODER)]
    return refuses[0] is not None and refuses[1] is None


@st.composite
def spec_cases(draw, dtypes, plain_half_the_time=False, decoder=False):
    """A random small SpecCase. With ``plain_half_the_time`` half the draws keep to what every
    library can express (no GQA, d_v = d_k, d_model = heads * d_k, the default scale), so
    that third-party oracles, which refuse the rest, still meet many valid examples. With
    ``decoder`` every draw is a decoder layer's: causal self-attention, GQA, rotate-half rotary
    over every feature, d_model = heads * d_k, a key padding mask or none."""
    plain = (plain_half_the_time and draw(st.booleans())) or decoder
    n_kv_heads = draw(st.integers(1, 3))
    n_heads = n_kv_heads * (draw(st.integers(1, 3)) if decoder or not plain else 1)
    # Distinct sizes: tokens, widths and head dims never coincide.
    q_tokens, kv_tokens, d_model, d_k, kdim, vdim = draw(
        st.lists(st.integers(1, 12), min_size=6, max_size=6, unique=True)
    )
    d_k = 2 * max(1, d_k // 2) if decoder else d_k  # an even head: rotary turns every pair
    d_v = d_k if plain else draw(st.sampled_from([d_k, max(1, d_k - 1), d_k + 2]))
    cross = not decoder and draw(st.booleans())
    batch = draw(st.sampled_from([None, 1, 2, 3]))
    # Rotary in either convention, full or partial, where a head has a pair of features to turn.
    rope = "half" if decoder else draw(st.sampled_from([None, "half", "interleaved"])) if d_k >= 2 else None
    rope_dims = d_k if decoder else None if rope is None else 2 * draw(st.integers(1, d_k // 2))
    cfg = MHAConfig(
        d_model=n_heads * d_k if plain else d_model,
        n_heads=n_heads,
        d_k=d_k,
        d_v=d_v,
        n_kv_heads=n_kv_heads,
        kdim=kdim if cross else None,
        vdim=vdim if cross else None,
        bias=draw(st.booleans()),
        causal=decoder or draw(st.booleans()),
        scale=None if plain else draw(st.sampled_from([None, 0.3, 1.7])),
        rope=rope,
        rope_dims=rope_dims,
    )
    if not cross:
        kv_tokens = q_tokens
    mask_kind = draw(
        st.sampled_from(["none", "padding"] if decoder else ["none", "padding", "random", "random per head"])
    )
    key_lengths = None
    if mask_kind == "padding":
        key_lengths = tuple(draw(st.integers(0, kv_tokens)) for _ in range(batch or 1))
    return SpecCase(
        "hypothesis",
        "drawn by Hypothesis",
        cfg,
        batch=batch,
        q_tokens=q_tokens,
        kv_tokens=kv_tokens if cross else None,
        key_lengths=key_lengths,
        mask_density=draw(st.sampled_from([0.3, 0.8])) if mask_kind.startswith("random") else None,
        mask_per_head=mask_kind == "random per head",
        dtypes=(draw(st.sampled_from(dtypes)),),
        seed=draw(st.integers(0, 2**16)),
    )


def _declared(run) -> bool:
    """A run that names its known difference (ONNX's float32 sqrt(scale)) or declares a lower precision level."""
    return bool(run.info.get("known_difference") or run.info.get("tolerance_dtype"))


def check_case(backend, case: SpecCase) -> int:
    """Assert the properties on one example; return how many runs were compared with the oracle."""
    result = run_check(backends=[backend], cases=[case], dtypes=list(case.dtypes))
    visible = case.cfg.n_heads >= 2 and case.q_tokens >= 2
    for run in result.runs:
        where = f"{run.label} {run.dtype} on {case.describe()}: {run.status} {run.reason}"
        assert run.status is not Status.ERROR, where
        if run.impl.known_mistake:
            if visible:
                assert run.status is Status.CAUGHT, where
                assert run.divergence is not None and run.divergence.stage == "q_heads", where
        elif run.impl.strategy in MLA_STRATEGIES:  # MLA's forms refuse a layer without its latent, by name
            assert run.status is Status.UNSUPPORTED and "kv_lora_rank" in run.reason, where
        elif backend.kind == "oracle":
            assert run.status in (Status.AGREE, Status.KNOWN_DIFFERENCE, Status.UNSUPPORTED), where
            if run.status is Status.KNOWN_DIFFERENCE:  # empty rows, or a difference the run names and declares
                assert case.empty_rows().any() or _declared(run), where
        elif run.status is Status.KNOWN_DIFFERENCE:  # ours: only a precision level the run declares (MLX's float64)
            assert run.info.get("tolerance_dtype"), where
        else:
            assert run.status is Status.AGREE, where
    for pair in result.pairs:
        where = f"{pair.a.label} vs {pair.b.label} on {case.describe()}: {pair.status} {pair.reason}"
        mistakes = (pair.a.impl.known_mistake, pair.b.impl.known_mistake)
        if not any(mistakes):
            assert pair.status in (Status.AGREE, Status.KNOWN_DIFFERENCE), where
        elif visible and mistakes[0] != mistakes[1]:
            assert pair.status is Status.CAUGHT, where
    return sum(run.compared for run in result.runs)


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_implementation_agrees_with_the_reference(name):
    backend = installed_backend(name)
    compared_examples = []

    @settings(
        max_examples=EXAMPLES.get(name, DEFAULT_EXAMPLES),
        deadline=None,
        # filter_too_much: an oracle that expresses few configurations (torch-mha: no GQA, no rotary)
        # has most draws redrawn by the assume() below; the examples that do run still compare.
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=spec_cases(backend.dtypes, plain_half_the_time=backend.kind == "oracle", decoder=decoder_only(backend)))
    def check(case):
        # Only examples the backend can express count (jax-dpa has no float64, torch-mha
        # no GQA, ...): Hypothesis draws again, so every example below really compares.
        assume(backend.unsupported_reason(case.cfg, case.dtypes[0], "cpu", STANDARD) is None)
        if check_case(backend, case):
            compared_examples.append(case)

    check()
    # The examples must really have compared something (not all refused inside prepare).
    assert len(compared_examples) >= EXAMPLES.get(name, DEFAULT_EXAMPLES) // 2, len(compared_examples)
