"""The variant registry (`core.variants.VARIANT_REGISTRY`): every list the project keeps of the variants is its.

Each test reads a fact two ways, from the registry and from the consumer that used to keep its
own table, and asserts they are the same, so that a new entry shows up everywhere or fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.core import (
    STAGE_NAMES,
    VARIANT_PARAM_NAMES,
    VARIANT_REGISTRY,
    VARIANT_STAGES,
    VARIANTS,
    MHAConfig,
    init_params,
    score_steps,
    variant,
    variants_on,
)
from mha_rosetta.core.params import expected_param_shapes
from mha_rosetta.core.variants import SCORE_PLACES, param_spec
from mha_rosetta.core.variants.models import MODELS


def test_the_variant_names_are_the_registry_in_its_order():
    assert (
        VARIANTS
        == tuple(VARIANT_REGISTRY)
        == (
            "window",
            "softcap",
            "qk_norm_head",
            "qk_norm_projection",
            "qkv_bias",
            "alibi",
            "rel_bias",
            "sinks",
            "rope_scaling",
            "chunked",
            "gate",
            "qk_norm_after_rope",
            "temperature",
            "mla",
            "mla_q_lora",
            "k_eq_v",
            "value_norm",
        )
    )
    assert all(name == entry.name for name, entry in VARIANT_REGISTRY.items())


def test_an_unknown_variant_is_refused_with_the_known_names():
    with pytest.raises(KeyError, match="unknown variant 'query_scale'; known variants: window, softcap"):
        variant("query_scale")


def test_every_variant_parameter_belongs_to_an_entry_and_shapes_come_from_it():
    owned = {spec.name for entry in VARIANT_REGISTRY.values() for spec in entry.params}
    mla = {"w_kv_a", "b_kv_a", "kv_a_norm", "w_q_a", "b_q_a", "q_a_norm"}
    assert owned == set(VARIANT_PARAM_NAMES) == {"q_norm", "k_norm", "sinks", "rel_bias", "w_gate", "b_gate"} | mla
    cfg = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, qk_norm="projection", sinks=True, rel_buckets=8)
    shapes = expected_param_shapes(cfg)
    assert [shapes[name] for name in VARIANT_PARAM_NAMES] == [(24,), (12,), (4,), (8, 4)] + [None] * 8
    assert param_spec("rel_bias").field == "rel_buckets"


def test_init_params_draws_each_variant_parameter_from_its_entry():
    cfg = MHAConfig(d_model=12, n_heads=3, qk_norm="head", sinks=True)
    params = init_params(cfg, seed=5)
    rng = np.random.default_rng((5, 24))  # the variants' generator, in MHAParams field order
    assert np.array_equal(params.q_norm, 1.0 + 0.3 * rng.standard_normal(4))
    assert np.array_equal(params.k_norm, 1.0 + 0.3 * rng.standard_normal(4))
    assert np.array_equal(params.sinks, 0.0 + 1.0 * rng.standard_normal(3))


def test_the_variant_stages_are_the_entries_and_exist_in_the_stage_table():
    from_entries = {stage for entry in VARIANT_REGISTRY.values() for stage in entry.stages}
    mla = {"kv_latent", "k_rope", "q_latent"}
    assert (
        set(VARIANT_STAGES)
        == from_entries
        == {
            "q_normed",
            "k_normed",
            "capped_scores",
            "biased_scores",
            "gate",
            "q_rotated_normed",
            "k_rotated_normed",
            "q_tempered",
            "v_normed",
        }
        | mla
    )
    assert list(VARIANT_STAGES) == [name for name in STAGE_NAMES if name in from_entries]
    assert VARIANT_STAGES["biased_scores"](MHAConfig(d_model=12, n_heads=3, rel_buckets=8))
    assert not VARIANT_STAGES["biased_scores"](MHAConfig(d_model=12, n_heads=3, softcap=2.0))


def test_every_variant_stage_is_declared_by_its_entry_in_the_pipeline_order_it_has_always_had():
    """`core.stages` writes only the stages every configuration has; each variant's stage comes from its entry's
    `StageSpec` (the package's own as one registered from outside), at the place, with the backward place, that the
    stage and gradient tables have always printed. A stage several entries add into (the additive biases) is one
    stage, its meaning joined from each entry's term."""
    from mha_rosetta.core.grad import GRAD_STAGE_NAMES
    from mha_rosetta.core.stages import BASE_STAGE_NAMES, STAGE_BY_NAME

    declared = {spec.name for entry in VARIANT_REGISTRY.values() for spec in entry.stage_specs}
    assert declared == set(VARIANT_STAGES)
    assert STAGE_NAMES == (
        *("kv_latent", "k_rope", "q_latent", "q", "k", "v", "q_heads", "k_heads", "v_heads", "v_normed"),
        *("q_normed", "k_normed", "q_rotated", "k_rotated", "q_rotated_normed", "k_rotated_normed", "q_tempered"),
        *("scores", "capped_scores", "biased_scores", "masked_scores", "weights", "context", "merged", "gate"),
        "output",
    )
    assert BASE_STAGE_NAMES == tuple(name for name in STAGE_NAMES if name not in declared)
    assert GRAD_STAGE_NAMES == (
        *("d_output", "d_gate", "d_merged", "d_context", "d_weights", "d_v_normed", "d_v_heads", "d_biased_scores"),
        *("d_capped_scores", "d_scores", "d_q_tempered", "d_q_rotated_normed", "d_k_rotated_normed", "d_q_rotated"),
        *("d_k_rotated", "d_q_normed", "d_k_normed", "d_q_heads", "d_k_heads", "d_q", "d_k", "d_v", "d_q_latent"),
        *("d_k_rope", "d_kv_latent"),
    )
    assert STAGE_BY_NAME["biased_scores"].meaning == (
        "plus m_h (p_j - p_i) (alibi) and rel_bias[bucket(p_j - p_i), h] (rel_buckets); only with either"
    )
    assert STAGE_BY_NAME["capped_scores"].shape == STAGE_BY_NAME["scores"].shape == ("B", "H", "Nq", "Nk")
    assert STAGE_BY_NAME["k_normed"].shape == ("B", "Hkv", "Nk", "Dk")


def test_a_stage_two_entries_declare_otherwise_is_refused_by_name(monkeypatch):
    from dataclasses import replace

    from mha_rosetta.core import stages

    base = tuple(stage for stage in stages.STAGES if stage.name in stages.BASE_STAGE_NAMES)
    monkeypatch.setattr(stages, "BUILT_FROM_REGISTRY", [])
    assert stages._with_registry_stages(base) == stages.STAGES  # rebuilt from the catalogue and the entries
    rel_bias = VARIANT_REGISTRY["rel_bias"]
    moved = replace(rel_bias, stage_specs=(replace(rel_bias.stage_specs[0], after="scores"),))
    monkeypatch.setattr(stages, "VARIANT_REGISTRY", {**VARIANT_REGISTRY, "rel_bias": moved})
    with pytest.raises(ValueError, match=r"variant 'rel_bias' declares the stage 'biased_scores' otherwise"):
        stages._with_registry_stages(base)
    monkeypatch.setattr(stages, "VARIANT_REGISTRY", VARIANT_REGISTRY)
    with pytest.raises(
        ValueError, match=r"variant 'softcap' declares the stage 'capped_scores', which core.stages has"
    ):
        stages._with_registry_stages(stages.STAGES)


def test_score_steps_come_in_pipeline_order_with_their_ops_methods():
    cfg = MHAConfig(d_model=12, n_heads=3, sinks=True, window=2, alibi=True, softcap=3.0, rel_buckets=8, causal=True)
    steps = score_steps(cfg)
    assert [(s.place, s.op, s.variant) for s in steps] == [
        ("transform", "softcap", "softcap"),
        ("bias", "add_score_bias", "alibi"),
        ("bias", "add_score_bias", "rel_bias"),
        ("mask", "positional_mask", "window"),
        ("softmax", "softmax", "sinks"),
    ]
    assert [SCORE_PLACES.index(s.place) for s in steps] == sorted(SCORE_PLACES.index(s.place) for s in steps)
    assert score_steps(MHAConfig(d_model=12, n_heads=3, qk_norm="head")) == ()


def test_variants_on_and_cfg_variants_agree():
    cfg = MHAConfig(d_model=12, n_heads=3, bias="qkv", rope="half", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert tuple(e.name for e in variants_on(cfg)) == cfg.variants == ("qkv_bias", "rope_scaling")


def test_every_variant_has_a_check_case_and_the_case_numbers_are_unique():
    checked = set()
    seeds = []
    for spec in [c for e in VARIANT_REGISTRY.values() for c in e.check_cases] + [
        m.check for m in MODELS.values() if m.check is not None
    ]:
        checked |= set(MHAConfig(**spec.config).variants)
        seeds.append(spec.seed)
    assert checked == set(VARIANTS)
    assert len(seeds) == len(set(seeds))


def test_validation_lives_in_the_entries_with_its_words():
    with pytest.raises(ValueError, match=r"MHAConfig.softcap must be a finite positive number, got 0"):
        MHAConfig(d_model=12, n_heads=3, softcap=0)
    with pytest.raises(TypeError, match=r"MHAConfig.sinks must be a bool, got 1 \(int\)"):
        MHAConfig(d_model=12, n_heads=3, sinks=1)
    assert MHAConfig(d_model=12, n_heads=3, softcap=2).softcap == 2.0  # resolved to a float by its entry


def test_kernel_refusals_come_from_the_entries_and_name_the_kernel():
    """Each entry's `kernel_refusal` is a template over the kernel's name; `kernel_refusals` fills it, less ``has``."""
    from mha_rosetta.core.variants import VARIANT_REGISTRY, kernel_refusal, kernel_refusals

    refusals = kernel_refusals("K")
    assert list(refusals) == [name for name, entry in VARIANT_REGISTRY.items() if entry.kernel_refusal]
    assert set(refusals) == {"softcap", "sinks", "gate"}  # a score transform, the softmax's extra logit, after it
    assert refusals["softcap"] == "K has no softcap: the scores are never exposed between the product and the softmax"
    assert refusals["sinks"] == "K has no sinks: its softmax takes no extra logit in the denominator"
    assert refusals["gate"].startswith("K has no output gate: ")
    assert set(kernel_refusals("K", frozenset({"sinks"}))) == {"softcap", "gate"}
    both = MHAConfig(d_model=12, n_heads=2, softcap=2.0, sinks=True)
    assert kernel_refusal(both, "K") == f"{refusals['softcap']}; {refusals['sinks']}"  # registry order, both named
    assert kernel_refusal(both, "K", frozenset({"softcap", "sinks"})) is None
    assert kernel_refusal(MHAConfig(d_model=12, n_heads=2, window=2), "K") is None


@pytest.mark.parametrize(
    ("backend", "kernel", "has"),
    [
        ("torch-sdpa", "scaled_dot_product_attention", frozenset()),
        ("jax-dpa", "jax.nn.dot_product_attention", frozenset({"sinks"})),
        ("mlx-sdpa", "mx.fast.scaled_dot_product_attention", frozenset({"sinks"})),
    ],
)
def test_a_kernel_oracle_claims_the_package_variants_but_those_it_has_no_hook_for(backend, kernel, has):
    """The set and the refusals of a fused kernel's oracle follow the registry: a variant that needs a hook the kernel
    lacks is left out and refused with the entry's sentence (``has``: the library's own hooks, its idiom)."""
    from mha_rosetta.backends import BackendNotInstalled, get_backend
    from mha_rosetta.core.variants import BUILTIN_VARIANTS, kernel_refusals

    try:
        oracle = get_backend(backend)
    except BackendNotInstalled as error:  # a library missing here (tox's numpy-only environments); nothing else
        pytest.skip(f"{backend}: {error}")
    refused = kernel_refusals(kernel, has)
    assert oracle.variants == BUILTIN_VARIANTS - refused.keys()
    for name, why in refused.items():
        cfg = next(spec.config for spec in registry_check_configs(name))
        assert why in oracle.variant_reason(MHAConfig(**cfg), "standard")


def registry_check_configs(name: str):
    """The check cases of variant ``name``'s entry (their `CaseSpec`)."""
    from mha_rosetta.core.variants import VARIANT_REGISTRY

    return VARIANT_REGISTRY[name].check_cases


def test_a_module_over_400_lines_is_a_catalogue_that_says_so_and_there_are_at_most_5():
    """Issue 42's size rule over every package folder (pyproject's ``package-dir``): at most 5 modules over 400 lines,
    each a catalogue that says so at its top (its docstring's first lines); core holds none (the registry's entry
    types grew past 400 when the entries began declaring their op calls, and the score-step types then moved to
    `core.variants._score_step`)."""
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10, as scripts/duplicate-gate reads it
        import tomli as tomllib  # type: ignore[no-redef]

    root = Path(__file__).resolve().parent.parent
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    paths = [path for folder in folders for path in (root / folder).rglob("*.py")]
    assert len(paths) > 200 and root / "core" / "variants" / "_entry.py" in paths  # every package folder is read
    long = {str(path.relative_to(root)): path.read_text() for path in paths if len(path.read_text().splitlines()) > 400}
    assert len(long) <= 5, sorted(long)
    not_saying = [name for name, text in long.items() if "A catalogue, over 400 lines on purpose" not in text[:600]]
    assert not_saying == []
    assert [name for name in long if name.startswith("core/")] == []


def test_an_entrys_stages_are_its_stage_specs_names_written_once():
    """`Variant.stages` is derived from ``stage_specs`` (one place the stage is written); an entry that names other
    stages beside its specs is refused by name, and one whose stages are declared elsewhere names them itself."""
    from dataclasses import replace

    softcap = VARIANT_REGISTRY["softcap"]
    assert softcap.stages == ("capped_scores",) == tuple(spec.name for spec in softcap.stage_specs)
    assert VARIANT_REGISTRY["mla"].stages == ("kv_latent", "k_rope")
    assert replace(softcap, stages=()).stages == ("capped_scores",)
    with pytest.raises(ValueError, match=r"variant 'softcap': stages \('capped',\) must be its stage_specs' names"):
        replace(softcap, stages=("capped",))
    assert replace(softcap, stage_specs=(), stages=("capped_scores",)).stages == ("capped_scores",)
