"""Random configurations: a correct candidate is never blamed, and every injected bug is named first.

Sizes, grouping, causality, bias and rotary style (and, in the second test, the variants) are drawn by
Hypothesis; `bugs_for`
leaves out the bugs a configuration cannot show (one head has one layout, two rotated
features have one pairing), and every other one must be named by its own code.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_rosetta.core import MHAConfig
from mha_rosetta.diagnose import diagnose
from mha_rosetta.diagnose.injected import BUGS, bugs_for, numpy_candidate


@st.composite
def configs(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4]))
    kv_heads = heads // draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    d_k = draw(st.sampled_from([2, 4, 6]))
    d_v = draw(st.sampled_from([d_k, 3]))
    d_model = draw(st.sampled_from([heads * d_k, 7]))
    return MHAConfig(
        d_model=d_model,
        n_heads=heads,
        d_k=d_k,
        d_v=d_v,
        n_kv_heads=kv_heads,
        causal=draw(st.booleans()),
        bias=draw(st.booleans()),
        rope=draw(st.sampled_from([None, "half", "interleaved"])),
    )


def assert_agrees_and_each_bug_is_named_first(cfg):
    """The correct candidate agrees, and each planted mistake that ``cfg`` can show is the first cause named."""
    assert diagnose(numpy_candidate(cfg), cfg).agrees
    named = {}
    for bug in bugs_for(cfg):
        causes = diagnose(numpy_candidate(cfg, bug), cfg).causes
        named[bug] = causes[0].code if causes else "agrees"
    assert named == {bug: BUGS[bug][0] for bug in bugs_for(cfg)}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_random_configs_correct_agrees_and_each_bug_is_named_first(cfg):
    assert_agrees_and_each_bug_is_named_first(cfg)


@st.composite
def variant_configs(draw):
    """A random configuration with random variants on: each variant's bugs join the plain ones.

    No window of one key: each query then sees itself alone, every softmax weight is 1, and no score
    mistake can show (the plain bugs' `bugs_for` rules do not know windows).
    """
    base = draw(configs())
    qk_norm = draw(st.sampled_from([None, "head", "projection"]))
    return replace(
        base,
        window=draw(st.sampled_from([None, 2, 3])),
        softcap=draw(st.sampled_from([None, 1.5, 4.0])),
        qk_norm=qk_norm,
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        bias=draw(st.sampled_from([base.bias, "qkv"])),
        rel_buckets=draw(st.sampled_from([None, 6, 8])),
        rel_max_distance=7,
        rel_bidirectional=draw(st.booleans()),
    )


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=variant_configs())
def test_random_variant_configs_correct_agrees_and_each_bug_is_named_first(cfg):
    assert_agrees_and_each_bug_is_named_first(cfg)
