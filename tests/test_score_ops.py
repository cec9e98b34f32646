"""The score pipeline written once (`frameworks.ops`) on each library's ops object, against the spec's formulas.

Every adapter runs its scores through `score_steps`; here the steps are checked without an adapter in
between: the order of `SCORE_STEPS` is `core.stages`' order, each library's ops object gives the
float64 spec's weights (softcap, score bias, mask, empty rows, sinks), NumPy's hand-written backward of
the steps gives central differences of its forward, and the in-place promises hold where they are made.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends.frameworks.ops import (
    OPS_BY_LIBRARY,
    SCORE_STEPS,
    masked_scores,
    online_start,
    score_steps,
    score_steps_backward,
)
from mha_rosetta.backends.frameworks.ops_numpy import NumpyOps
from mha_rosetta.core import STAGE_NAMES, MHAConfig, softcap, softmax_with_sinks, stage_names

LIBRARIES = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch", marks=requires("torch"), id="torch"),
    pytest.param("jax", marks=requires("jax"), id="jax"),
]
# Every step on: the softcap, a score bias (ALiBi's flag; the bias itself is given), a mask, the sinks.
ALL_ON = MHAConfig(d_model=8, n_heads=4, softcap=2.5, alibi=True, sinks=True)


def _inputs(seed: int = 5):
    """Row-sample scores (B, H, Nq, Nk), a bias, a mask with one empty row, and each head's sink (1, H, 1, 1)."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((2, 4, 5, 6)) * 3
    bias = rng.standard_normal((1, 4, 5, 6))
    allowed = rng.random((2, 1, 5, 6)) > 0.3
    allowed[1, 0, 3] = False  # query 3 of item 1 sees no key
    sinks = rng.standard_normal(4)[None, :, None, None]
    return scores, bias, allowed, sinks


def _spec(cfg: MHAConfig, scores, bias, allowed, sinks):
    """The float64 spec's weights: `core.variants`' softcap, the bias added, the mask, the softmax with the sinks."""
    s = softcap(scores, cfg.softcap) if cfg.softcap is not None else scores
    s = s + bias if cfg.has_score_bias else s
    return softmax_with_sinks(np.where(allowed, s, -np.inf), sinks[0, :, 0, 0] if cfg.sinks else None)


def _library_arrays(library: str, *arrays):
    """Copies of the NumPy arrays as the library's own (bool masks kept bool), float64 (torch's may share a
    float64 array's memory: the steps work in place)."""
    ops = OPS_BY_LIBRARY[library]("float64", "cpu")
    return [ops.asarray(a.copy(), cast=a.dtype != bool) for a in arrays]


def test_the_steps_are_in_the_spec_order_and_make_the_variant_stages():
    stages = [step.stage for _, step in SCORE_STEPS]
    assert (
        stages
        == [name for name in STAGE_NAMES if name in stages]
        == ["capped_scores", "biased_scores", "masked_scores"]
    )
    assert [variants for variants, _ in SCORE_STEPS] == [("softcap",), ("alibi", "rel_bias"), ("window", "chunked")]
    plain = MHAConfig(d_model=8, n_heads=4)
    assert [step.stage for _, step in SCORE_STEPS if step.on(plain)] == ["masked_scores"]
    assert [step.stage for _, step in SCORE_STEPS if step.on(ALL_ON)] == [
        name for name in stage_names(ALL_ON) if name in stages
    ]


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize(
    "cfg",
    [
        MHAConfig(d_model=8, n_heads=4),
        MHAConfig(d_model=8, n_heads=4, softcap=2.5),
        MHAConfig(d_model=8, n_heads=4, alibi=True),
        MHAConfig(d_model=8, n_heads=4, sinks=True),
        ALL_ON,
    ],
    ids=["plain", "softcap", "bias", "sinks", "all"],
)
def test_each_library_gives_the_spec_weights_and_stages(library, cfg):
    from mha_rosetta.backends.frameworks import to_numpy

    scores, bias, allowed, sinks = _inputs()
    ops = OPS_BY_LIBRARY[library]("float64", "cpu")
    s, b, blocked, empty, k = _library_arrays(
        library, scores, bias, ~allowed, ~allowed.any(axis=-1, keepdims=True), sinks
    )
    seen = {}

    def record(name, value, parent, before):
        seen[name] = (to_numpy(ops.snapshot(value)).copy(), parent)

    weights = score_steps(ops, cfg, s, bias=b, blocked=blocked, empty_rows=empty, sinks=k, on_stage=record)
    expected = _spec(cfg, scores, bias, allowed, sinks)
    np.testing.assert_allclose(to_numpy(weights), expected, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(to_numpy(weights)[1, :, 3], 0.0)  # the empty row: zeros, never NaN
    assert list(seen) == [name for name in stage_names(cfg) if name in {"capped_scores", "biased_scores"}] + [
        "masked_scores",
        "weights",
    ]
    if cfg.softcap is not None:
        np.testing.assert_allclose(seen["capped_scores"][0], softcap(scores, 2.5), rtol=1e-15)
    assert np.isneginf(seen["masked_scores"][0][~np.broadcast_to(allowed, scores.shape)]).all()
    assert seen["weights"][1] == "masked_scores"


@pytest.mark.parametrize("library", LIBRARIES)
def test_online_start_puts_the_sink_first_in_every_row(library):
    from mha_rosetta.backends.frameworks import to_numpy

    ops = OPS_BY_LIBRARY[library]("float64", "cpu")
    _, _, _, sinks = _inputs()
    (k,) = _library_arrays(library, sinks)
    dtype = ops.asarray(np.zeros(1)).dtype
    peak, total = online_start(ops, {"sinks": k}, (2, 4, 5, 1), dtype, like=ops.asarray(np.zeros(1)))
    np.testing.assert_array_equal(to_numpy(peak), np.broadcast_to(sinks, (2, 4, 5, 1)))
    np.testing.assert_array_equal(to_numpy(total), 1.0)
    peak, total = online_start(ops, {}, (2, 4, 5, 1), dtype, like=ops.asarray(np.zeros(1)))
    assert np.isneginf(to_numpy(peak)).all() and (to_numpy(total) == 0).all()


def test_numpy_works_in_place_at_full_precision_and_rounds_each_step_in_half():
    scores, bias, allowed, sinks = _inputs()
    ops = NumpyOps("float64", keys_axis=-1)
    s = scores.copy()
    weights = score_steps(ops, ALL_ON, s, bias=bias, blocked=~allowed, sinks=sinks)
    assert weights is s  # every step, the softmax included, wrote into the scores' own buffer
    half = NumpyOps("bfloat16")
    stored = half.asarray(scores)
    capped = masked_scores(half, MHAConfig(d_model=8, n_heads=4, softcap=2.5), stored)
    assert capped.dtype == stored.dtype and capped is not stored  # computed in float32, rounded to storage
    np.testing.assert_array_equal(capped, half.asarray(softcap(stored.astype(np.float32), 2.5)))


@requires("torch")
def test_torch_works_in_place_outside_autograd_and_out_of_place_under_it():
    import torch

    scores, bias, allowed, _ = _inputs()
    ops = OPS_BY_LIBRARY["torch"]()
    s = torch.from_numpy(scores.copy())
    cfg = MHAConfig(d_model=8, n_heads=4, softcap=2.5, alibi=True)
    masked = masked_scores(ops, cfg, s, bias=torch.from_numpy(bias), blocked=torch.from_numpy(~allowed))
    assert masked is s
    leaf = torch.from_numpy(scores.copy()).requires_grad_(True)
    masked = masked_scores(ops, cfg, leaf, bias=torch.from_numpy(bias), blocked=torch.from_numpy(~allowed))
    assert masked is not leaf and torch.equal(leaf.detach(), torch.from_numpy(scores))


def test_numpy_blocks_give_the_whole_tensor_bit_for_bit():
    scores, bias, allowed, sinks = _inputs()
    whole = score_steps(NumpyOps(), ALL_ON, scores.copy(), bias=bias, blocked=~allowed, sinks=sinks, saved={})
    for block_bytes in (1 << 20, 4 * 5 * 6 * 8, 1):  # one block, per batch item, per (item, head)
        ops = NumpyOps(block_bytes=block_bytes)
        np.testing.assert_array_equal(
            score_steps(ops, ALL_ON, scores.copy(), bias=bias, blocked=~allowed, sinks=sinks), whole
        )


@pytest.mark.parametrize(
    ("cfg", "names"),
    [
        (ALL_ON, ["d_weights", "d_biased_scores", "d_capped_scores", "d_scores"]),
        (MHAConfig(d_model=8, n_heads=4, softcap=2.5), ["d_weights", "d_capped_scores", "d_scores"]),
    ],
    ids=["all", "softcap"],
)
def test_numpy_backward_of_the_steps_matches_central_differences(cfg, names):
    scores, bias, allowed, sinks = _inputs(7)
    ops = NumpyOps()
    d_weights = np.random.default_rng(8).standard_normal(scores.shape)
    mask = {"blocked": ~allowed, "empty_rows": ~allowed.any(axis=-1, keepdims=True)}

    def loss(s, k=sinks):
        return float(np.sum(d_weights * score_steps(ops, cfg, s.copy(), bias=bias, sinks=k, **mask)))

    saved: dict = {}
    score_steps(ops, cfg, scores.copy(), bias=bias, sinks=sinks, saved=saved, **mask)
    d_scores, d_sinks, grads = score_steps_backward(ops, cfg, d_weights, saved)
    assert list(grads) == names  # the gradient of each step's input, walking the steps back
    assert grads["d_scores"] is d_scores
    eps = 1e-6
    for index in [(0, 0, 0, 0), (1, 2, 4, 5), (0, 3, 2, 1), (1, 1, 3, 2)]:
        step = np.zeros_like(scores)
        step[index] = eps
        numeric = (loss(scores + step) - loss(scores - step)) / (2 * eps)
        assert d_scores[index] == pytest.approx(numeric, rel=1e-6, abs=1e-9), index
    if cfg.sinks:
        for h in range(4):
            step = np.zeros_like(sinks)
            step[0, h] = eps
            numeric = (loss(scores, sinks + step) - loss(scores, sinks - step)) / (2 * eps)
            assert d_sinks[:, h].sum() == pytest.approx(numeric, rel=1e-6, abs=1e-9), h
    else:
        assert d_sinks is None


def test_the_steps_come_from_core_s_registry_and_an_unknown_op_is_named(monkeypatch):
    """The order and the variants of `SCORE_STEPS` are the registry's; an op the ops module cannot run is refused by name."""
    from dataclasses import replace

    from mha_rosetta.backends.frameworks import ops
    from mha_rosetta.core.variants import VARIANT_REGISTRY, ScoreStep

    # Moved after the mask in the registry, the softcap runs after it (the mistake diagnose plants).
    moved = {
        **VARIANT_REGISTRY,
        "softcap": replace(VARIANT_REGISTRY["softcap"], score_step=ScoreStep("mask", "softcap")),
    }
    monkeypatch.setattr(ops, "VARIANT_REGISTRY", moved)
    steps = ops._steps_in_registry_order()
    assert [variants for variants, _ in steps] == [("alibi", "rel_bias"), ("window", "chunked"), ("softcap",)]
    assert [step.stage for _, step in steps] == ["biased_scores", "masked_scores", "capped_scores"]
    unknown = {
        **VARIANT_REGISTRY,
        "softcap": replace(VARIANT_REGISTRY["softcap"], score_step=ScoreStep("transform", "temperature")),
    }
    monkeypatch.setattr(ops, "VARIANT_REGISTRY", unknown)
    with pytest.raises(KeyError, match=r"score op 'temperature' \(variant 'softcap'\).*OpsCall.*register_score_op"):
        ops._steps_in_registry_order()


def test_how_each_op_is_called_comes_from_its_entries_and_one_op_has_one_call(monkeypatch):
    """`OP_STEPS` is gathered from the entries' `OpsCall`s (ALiBi and T5 share one, the window and the chunks
    another); an entry that calls a shared op otherwise is refused by name, never silently overridden."""
    from dataclasses import replace

    from mha_rosetta.backends.frameworks import ops
    from mha_rosetta.core.variants import VARIANT_REGISTRY, OpsCall, ScoreStep

    calls = {
        e.score_step.op: e.score_step.call for e in VARIANT_REGISTRY.values() if e.score_step and e.score_step.call
    }
    assert sorted(calls) == ["add_score_bias", "positional_mask", "softcap"]
    for op, call in calls.items():
        assert ops.OP_STEPS[op].forward is call.forward and ops.OP_STEPS[op].stage == call.stage, op
    assert VARIANT_REGISTRY["alibi"].score_step.call is VARIANT_REGISTRY["rel_bias"].score_step.call
    assert VARIANT_REGISTRY["window"].score_step.call is VARIANT_REGISTRY["chunked"].score_step.call
    other = OpsCall("biased_scores", "+ twice the bias", forward=lambda o, cfg, s, parts: s + 2 * parts["bias"])
    clashing = replace(VARIANT_REGISTRY["rel_bias"], score_step=ScoreStep("bias", "add_score_bias", call=other))
    monkeypatch.setattr(ops, "VARIANT_REGISTRY", {**VARIANT_REGISTRY, "rel_bias": clashing})
    with pytest.raises(ValueError, match=r"variant 'rel_bias' calls the score op 'add_score_bias' otherwise"):
        ops._entries_calls()


def test_score_steps_read_the_softmax_part_by_its_entry_s_keyword_and_refuse_another():
    """The sinks reach the softmax through the keyword their `ParamSpec.score_part` declares; a keyword no
    registered parameter feeds is a TypeError that names it (a misspelt part would otherwise be dropped)."""
    from mha_rosetta.core.variants import param_spec

    scores, bias, allowed, sinks = _inputs()
    keyword = param_spec("sinks").score_part
    got = score_steps(NumpyOps("float64"), ALL_ON, scores.copy(), bias=bias, blocked=~allowed, **{keyword: sinks})
    np.testing.assert_allclose(got, _spec(ALL_ON, scores, bias, allowed, sinks), rtol=1e-13, atol=1e-15)
    with pytest.raises(TypeError, match=r"score_steps\(\) got the keyword\(s\) \['sink'\].*\['sinks'\]"):
        score_steps(NumpyOps("float64"), ALL_ON, scores.copy(), bias=bias, blocked=~allowed, sink=sinks)


def test_our_adapters_capabilities_are_the_registry_s_variants_their_ops_can_run(monkeypatch):
    """`RegistryVariants`: every registered variant whose score op the library's ops class has, read when asked."""
    from dataclasses import replace

    from mha_rosetta.backends import get_backend
    from mha_rosetta.backends.frameworks import ops
    from mha_rosetta.core import VARIANTS
    from mha_rosetta.core.variants import VARIANT_REGISTRY, ScoreStep

    numpy = get_backend("numpy")
    # The gate acts outside the pipeline, in every library's projections (its ops object's output_gate): no limit.
    assert VARIANT_REGISTRY["gate"].implemented_by is None
    # The forms whose entries name the libraries whose adapters apply them: every library's for Llama 4's steps
    # after rotary and Gemma 4's value norm (their ops methods); MLA's latents in numpy, torch and jax (declared, and
    # run in their naive and absorbed strategies only).
    unadapted = {name for name, entry in VARIANT_REGISTRY.items() if entry.implemented_by == ()}
    assert {"mla", "mla_q_lora"} <= numpy.variants
    for name in ("qk_norm_after_rope", "temperature", "value_norm"):
        assert VARIANT_REGISTRY[name].implemented_by == ("numpy", "torch", "jax", "mlx"), name
        assert name in numpy.variants and name in ops.RegistryVariants("numpy", "torch", "jax").__get__(None, object)
    assert numpy.variants == numpy.decode_variants == frozenset(VARIANTS) - unadapted
    # An entry that names its libraries is declared by those adapters only (einops needs all three of its own).
    monkeypatch.setattr(
        ops,
        "VARIANT_REGISTRY",
        {**VARIANT_REGISTRY, "gate": replace(VARIANT_REGISTRY["gate"], implemented_by=("numpy",))},
    )
    assert "gate" in numpy.variants and "gate" not in ops.RegistryVariants("numpy", "torch").__get__(None, object)
    monkeypatch.undo()
    # A variant registered after import whose op no ops class has: left out, for every adapter and path.
    tempered = replace(
        VARIANT_REGISTRY["softcap"], name="logit_temperature", score_step=ScoreStep("transform", "logit_temperature")
    )
    monkeypatch.setattr(ops, "VARIANT_REGISTRY", {**VARIANT_REGISTRY, "logit_temperature": tempered})
    assert "logit_temperature" not in numpy.variants and numpy.variants == frozenset(VARIANTS) - unadapted
    # The NumPy ops class has the method, but the pipeline (built from the registry at import) does not carry
    # the step: still refused, never run without it.
    monkeypatch.setattr(ops.NumpyOps, "logit_temperature", lambda self, scores, t: scores / t, raising=False)
    assert "logit_temperature" not in numpy.variants
    # Once the pipeline carries it (its call in OP_STEPS, the steps rebuilt from the registry), NumPy declares it;
    # einops (all three libraries) does not yet.
    monkeypatch.setitem(ops.OP_STEPS, "logit_temperature", ops.OP_STEPS["softcap"])
    monkeypatch.setattr(ops, "SCORE_STEPS", ops._steps_in_registry_order())
    assert "logit_temperature" in numpy.variants and "logit_temperature" in numpy.decode_variants
    every_library = ops.RegistryVariants("numpy", "torch", "jax")  # the einops adapter's (any array library)
    assert "logit_temperature" not in every_library.__get__(None, object)
    with pytest.raises(ValueError, match="libraries must be among numpy, torch, jax, mlx, got \\('boxed',\\)"):
        ops.RegistryVariants("boxed")
