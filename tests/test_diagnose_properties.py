"""Random configurations: a correct candidate is never blamed, and every injected bug is named first.

Sizes, grouping, causality, bias and rotary style are drawn by Hypothesis; `bugs_for`
leaves out the bugs a configuration cannot show (one head has one layout, two rotated
features have one pairing), and every other one must be named by its own code.
"""

from __future__ import annotations

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


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs())
def test_random_configs_correct_agrees_and_each_bug_is_named_first(cfg):
    assert diagnose(numpy_candidate(cfg), cfg).agrees
    named = {}
    for bug in bugs_for(cfg):
        causes = diagnose(numpy_candidate(cfg, bug), cfg).causes
        named[bug] = causes[0].code if causes else "agrees"
    assert named == {bug: BUGS[bug][0] for bug in bugs_for(cfg)}
