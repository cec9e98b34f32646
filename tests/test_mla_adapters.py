"""MLA in the conventions (issue 45): each adapter that applies it runs its ``naive`` and ``absorbed`` strategies,
forward, decode through a latent cache and backward, against the float64 oracle; the two forms agree with each
other to about 1e-12; every other strategy, and every other adapter, refuses it by name. The einops adapters
(on NumPy, torch and JAX arrays) run both forms in named axes and agree with the numpy adapter's column samples;
einops-numpy has no backward (NumPy has no autodiff) and says so. Every convention records the forms' stages (the
latent, the shared key, the queries, the scores and their steps; the naive form its values and context), in its own
layout, equal to the oracle's and to NumPy's once made canonical. MLX's float64 is held to float32's tolerance, as
it declares (`tolerance_levels`: its exp is float32-accurate); its own facts are in tests/test_mlx_mla.py.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.backends.vocabulary import STANDARD
from mha_rosetta.core import MHAConfig, init_params, reference_mha, reference_mha_vjp, reference_stages
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.core.tolerances import assert_close
from mha_rosetta.core.variants import VARIANT_REGISTRY, adapted_variants, strategy_forms
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE, MLA_ADAPTERS
from mha_rosetta.core.variants.models import MISTRAL4_LIKE

FORMS = ("naive", "absorbed")
# The adapters that apply MLA, each with the library it needs (the numpy env has NumPy only).
ADAPTERS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch", id="torch", marks=requires("torch")),
    pytest.param("jax", id="jax", marks=requires("jax")),
    pytest.param("einops-numpy", id="einops-numpy", marks=requires("einops")),
    pytest.param("einops-torch", id="einops-torch", marks=[requires("einops"), requires("torch")]),
    pytest.param("einops-jax", id="einops-jax", marks=[requires("einops"), requires("jax")]),
    pytest.param("mlx", id="mlx", marks=requires("mlx")),
]
# einops-numpy has no backward: NumPy has no autodiff (`backends.einops.vjp`).
VJP_ADAPTERS = [param for param in ADAPTERS if param.values[0] != "einops-numpy"]
EINOPS = [param for param in ADAPTERS if param.values[0].startswith("einops-")]
CONFIGS = {
    "v3": MHAConfig(**DEEPSEEK_V3_LIKE),  # q LoRA, YaRN on both sides, interleaved pairs
    "v2_lite": MHAConfig(**DEEPSEEK_V2_LITE_LIKE),  # one q_proj, attention_bias on kv_a and o_proj
    "v3_half_window": MHAConfig(**dict(DEEPSEEK_V3_LIKE, rope_interleave=False, window=3)),
    "v3_softcap_chunks": MHAConfig(**dict(DEEPSEEK_V3_LIKE, softcap=4.0, attention_chunk_size=3)),
    # Mistral 4's temperature on both query parts, at the positions (a decode step's with the cache offset)
    "mistral4": MHAConfig(**MISTRAL4_LIKE),
}


def _backend(name):
    from mha_rosetta.backends import get_backend

    return get_backend(name)


def _x(cfg, shape, seed=1):
    return np.random.default_rng(seed).standard_normal((*shape, cfg.d_model))


def _case(config: str, params_seed: int, shape, x_seed: int = 1):
    """``CONFIGS[config]``, its parameters drawn with ``params_seed``, inputs ``(*shape, d_model)`` with ``x_seed``."""
    cfg = CONFIGS[config]
    return cfg, init_params(cfg, seed=params_seed), _x(cfg, shape, x_seed)


def _level(backend) -> str:
    """The tolerance a float64 run of ``backend`` is held to: the level it declares (MLX: float32, its float64 exp is
    float32-accurate, `frameworks.mlx.FLOAT64_LIMIT`), else float64's."""
    return getattr(backend, "tolerance_levels", {}).get("float64", "float64")


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("config", CONFIGS)
def test_both_strategies_agree_with_the_oracle_and_each_other_to_1e_12(name, config):
    cfg, params, x = _case(config, 4, (2, 9))
    ref = reference_mha(cfg, params, x)
    backend = _backend(name)
    naive, absorbed = (backend.run(cfg, params, x, strategy=form, dtype="float64") for form in FORMS)
    if _level(backend) != "float64":  # a declared level: the tolerance table's, no tighter
        for out, want, what in ((naive, ref, "naive"), (absorbed, ref, "absorbed"), (absorbed, naive, "the forms")):
            assert_close(out, want, _level(backend), what=what)
        return
    scale = np.abs(ref).max()
    assert np.abs(naive - ref).max() <= 1e-12 * scale
    assert np.abs(absorbed - ref).max() <= 1e-12 * scale
    assert np.abs(absorbed - naive).max() <= 1e-12 * scale


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("form", FORMS)
def test_a_mask_positions_and_float32(name, form):
    cfg, params, x = _case("v2_lite", 0, (2, 6))
    mask = np.random.default_rng(3).random((6, 6)) < 0.7
    positions = np.array([0, 2, 3, 5, 8, 9])
    ref = reference_mha(cfg, params, x, mask=mask, positions=positions)
    backend = _backend(name)
    out = backend.run(cfg, params, x, mask=mask, positions=positions, strategy=form, dtype="float64")
    assert_close(out, ref, _level(backend))
    assert_close(backend.run(cfg, params, x, strategy=form, dtype="float32"), reference_mha(cfg, params, x), "float32")


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("config", ["v3", "v3_half_window", "mistral4"])
def test_decode_through_the_latent_cache_equals_the_full_forward(name, form, config):
    cfg, params, x = _case(config, 5, (2, 8), x_seed=2)
    mask = np.ones((2, 8), dtype=bool)
    mask[1, :2] = False  # left padding in one sequence
    backend = _backend(name)
    prepared, inputs = backend.prepare_decode_run(
        cfg, params, x, prefill=3, step=2, mask=mask, strategy=form, dtype="float64"
    )
    out = inputs.unbatch(prepared.output())
    expected = reference_decode(cfg, params, x, prefill=3, step=2, mask=mask)
    assert_close(out[mask], expected[mask], _level(backend))
    cache = prepared.info["cache"]
    R, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert cache["bytes_per_token"] == (R + dr) * 8  # 16 numbers a token: the latent and the shared key
    assert cache["expanded_bytes_per_token"] == cfg.n_heads * (cfg.d_k + cfg.d_v) * 8  # 3 * (10 + 5) = 45 numbers
    # A slot a token; mlx-lm's KVCache grows in steps of 256 slots, and a window makes it a ring of W - 1 + step.
    slots = 8
    if name == "mlx":
        from mha_rosetta.backends.mlx.decode import MLX_LM_STEP

        slots = MLX_LM_STEP if cfg.window is None else cfg.window - 1 + 2
    assert cache["slots"] == slots
    assert cache["bytes"] == 2 * slots * (R + dr) * 8


@pytest.mark.parametrize("name", VJP_ADAPTERS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("config", ["v3", "v2_lite", "v3_softcap_chunks", "mistral4"])
def test_the_backward_agrees_with_the_oracle(name, form, config):
    cfg, params, x = _case(config, 6, (2, 7), x_seed=3)
    cotangent = np.random.default_rng(9).standard_normal((2, 7, cfg.d_model))
    expected = reference_mha_vjp(cfg, params, x, cotangent=cotangent)
    backend = _backend(name)
    grads = backend.run_vjp(cfg, params, x, cotangent=cotangent, strategy=form, dtype="float64")
    assert_close(grads.d_query, expected.d_query, _level(backend))
    checked = 0
    for field in fields(expected.d_params):
        want = getattr(expected.d_params, field.name)
        if want is not None:
            assert_close(getattr(grads.d_params, field.name), want, _level(backend), what=field.name)
            checked += 1
    assert checked >= 7  # w_q, w_k, w_v, w_o, w_kv_a, kv_a_norm and more


@requires("einops")
@pytest.mark.parametrize("form", FORMS)
def test_einops_numpy_refuses_the_backward_with_the_reason(form):
    from mha_rosetta.backends.base import UnsupportedCase

    cfg = CONFIGS["v3"]
    x = _x(cfg, (1, 4))
    with pytest.raises(UnsupportedCase, match="einops-numpy has no backward: NumPy has no autodiff"):
        _backend("einops-numpy").run_vjp(cfg, init_params(cfg, seed=0), x, cotangent=x, strategy=form)


@pytest.mark.parametrize("name", EINOPS)
@pytest.mark.parametrize("config", CONFIGS)
def test_einops_forms_agree_with_the_numpy_adapters_column_samples(name, config):
    cfg, params, x = _case(config, 7, (2, 8), x_seed=4)
    scale = np.abs(reference_mha(cfg, params, x)).max()
    for form in FORMS:
        numpy_out = _backend("numpy").run(cfg, params, x, strategy=form, dtype="float64")
        einops_out = _backend(name).run(cfg, params, x, strategy=form, dtype="float64")
        assert np.abs(einops_out - numpy_out).max() <= 1e-12 * scale, form
    backend = _backend(name)
    prepared, _ = backend.prepare(cfg, params, x, strategy="absorbed", dtype="float64")
    stages = backend.canonical_stages(prepared)  # the latent, the shared key and the queries, in the oracle's layout
    expected = reference_stages(cfg, params, x)
    for stage in ("kv_latent", "k_rope", "q", "output") + (("q_latent",) if cfg.q_lora_rank else ()):
        assert_close(stages[stage], expected[stage], "float64", what=stage)


@requires("einops")
def test_the_einops_mla_module_names_its_axes_and_never_swaps_them():
    import inspect

    from test_backend_einops import axis_swaps  # the einops convention's checker, one place

    from mha_rosetta.backends.einops import mla

    assert axis_swaps(inspect.getsource(mla)) == []


@pytest.mark.parametrize("name", ADAPTERS)
def test_mla_runs_only_in_its_strategies_and_they_run_only_mla(name):
    backend = _backend(name)
    v3, plain = CONFIGS["v3"], MHAConfig(d_model=12, n_heads=3)
    for strategy in backend.strategies:
        reason = backend.variant_reason(v3, strategy) or backend.unsupported_reason(v3, "float64", "cpu", strategy)
        assert (reason is None) == (strategy in FORMS), (strategy, reason)
    for form in FORMS:
        assert "needs MHAConfig.kv_lora_rank" in backend.unsupported_reason(plain, "float64", "cpu", form)
        sinks = MHAConfig(**dict(DEEPSEEK_V3_LIKE, sinks=True))
        assert "sinks" in backend.variant_reason(sinks, form)
        assert "latent cache" in backend.decode_reason(v3, "float64", "cpu", form, "paged")
    assert "naive' and 'absorbed' strategies only" in backend.decode_reason(v3, "float64", "cpu", "standard", None)


def test_the_entries_name_the_libraries_and_the_strategies_that_run_them():
    assert VARIANT_REGISTRY["mla"].implemented_by == MLA_ADAPTERS == VARIANT_REGISTRY["mla_q_lora"].implemented_by
    assert MLA_ADAPTERS == ("numpy", "torch", "jax", "mlx")
    assert VARIANT_REGISTRY["mla"].strategies == MLA_STRATEGIES == VARIANT_REGISTRY["mla_q_lora"].strategies
    assert MLA_STRATEGIES == FORMS
    # The forms that run only in those strategies, read from the registry: what a standard path never declares.
    assert strategy_forms(MLA_STRATEGIES) == {"mla", "mla_q_lora"}
    assert adapted_variants("numpy") - adapted_variants("numpy", strategy=STANDARD) == {"mla", "mla_q_lora"}
    assert strategy_forms(("standard", "naive")) == set()  # both strategies, or none of the form


def test_an_adapter_declares_mla_only_with_its_strategies_and_refuses_it_by_name_without():
    from mha_rosetta.backends.base import Backend
    from mha_rosetta.backends.frameworks.ops import RegistryVariants

    class Plain(Backend):
        name = "plain"
        variants = RegistryVariants("numpy")

    class WithForms(Plain):
        strategies = (STANDARD, *MLA_STRATEGIES)

    assert not {"mla", "mla_q_lora"} & Plain.variants
    assert {"mla", "mla_q_lora"} <= WithForms.variants
    assert Plain.variants == WithForms.variants - {"mla", "mla_q_lora"}
    reason = Plain().variant_reason(CONFIGS["v3"], STANDARD)
    assert reason.startswith("plain does not implement mla, mla_q_lora (it implements: "), reason


@requires("torch")
def test_the_third_party_oracles_refuse_mla():
    assert "mla" in _backend("torch-sdpa").variant_reason(CONFIGS["v3"], "standard")


# The stages both forms record in every convention; the naive form adds its expanded values and their context (the
# absorbed form's context stays in the latent: no stage of the table has its shape). Keys are left out in both: the
# naive form expands only each head's dn "nope" features, never the table's k_heads of dn + dr.
BOTH_FORMS = {"kv_latent", "k_rope", "q", "scores", "masked_scores", "weights", "output"}
NAIVE_ADDS = {"v_heads", "context"}


def _recorded(name, cfg, params, x, form):
    backend = _backend(name)
    prepared, _ = backend.prepare(cfg, params, x, strategy=form, dtype="float64")
    return backend.canonical_stages(prepared)


# mlx's forms record their output only (rule 3: `backends/mlx/mla.py`, mlx-lm's layer has no stage to read).
STAGE_RECORDERS = [param for param in ADAPTERS if param.values[0] != "mlx"]


@requires("mlx")
@pytest.mark.parametrize("form", FORMS)
def test_mlx_forms_record_their_output_only_and_say_so(form):
    cfg, params, x = _case("v3", 8, (2, 7), x_seed=5)
    stages = _recorded("mlx", cfg, params, x, form)
    assert set(stages) == {"output"}
    assert_close(stages["output"], reference_stages(cfg, params, x)["output"], "float32", what=f"mlx {form}")


@pytest.mark.parametrize("name", STAGE_RECORDERS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("config", ["v3", "v3_softcap_chunks", "v2_lite"])
def test_each_form_records_its_stages_and_they_agree_with_the_oracle_and_numpy(name, form, config):
    from mha_rosetta.checks.divergence import first_divergence

    cfg, params, x = _case(config, 8, (2, 7), x_seed=5)
    stages = _recorded(name, cfg, params, x, form)
    expected = set(BOTH_FORMS)
    expected |= {"q_latent"} if cfg.q_lora_rank else set()
    expected |= {"capped_scores"} if cfg.softcap else set()
    expected |= NAIVE_ADDS if form == "naive" else set()
    assert expected <= set(stages), sorted(expected - set(stages))
    if form == "absorbed":
        assert not {"v", "v_heads", "context", "merged"} & set(stages)  # never formed
    reference = reference_stages(cfg, params, x)
    assert stages["masked_scores"].shape == (2, cfg.n_heads, 7, 7)  # (B, H, Nq, Nk) in every convention
    assert np.isneginf(stages["masked_scores"]).any()  # causal: the blocked scores are there, -inf
    for stage, value in stages.items():
        assert_close(value, reference[stage], "float64", what=f"{name} {form} {stage}")
    numpy_stages = _recorded("numpy", cfg, params, x, form)
    assert first_divergence(numpy_stages, stages, "float64") is None
    shared = set(numpy_stages) & set(stages)
    assert expected <= shared, sorted(expected - shared)  # the check compares them all, pair by pair


def test_numpys_naive_values_and_merge_are_views_of_its_columns():
    cfg, params, x = _case("v2_lite", 1, (2, 5))
    numpy_backend = _backend("numpy")
    prepared, _ = numpy_backend.prepare(cfg, params, x, strategy="naive")
    native = prepared.native_stages()
    assert native["v_heads"].axes == ("B", "Hkv", "Dv", "Nk") and native["v_heads"].relation == "view"
    assert native["merged"].axes == ("B", "H*Dv", "Nq") and native["merged"].relation == "view"


@requires("torch")
def test_torchs_naive_values_are_a_view_and_its_merge_a_copy():
    cfg = CONFIGS["v2_lite"]
    params = init_params(cfg, seed=1)
    prepared, _ = _backend("torch").prepare(cfg, params, _x(cfg, (2, 6)), strategy="naive")
    native = prepared.native_stages()
    assert (native["v_heads"].relation, native["v_heads"].parent) == ("view", "v")  # view(...).transpose(1, 2)
    assert (native["merged"].relation, native["merged"].parent) == ("copy", "context")  # transpose + reshape
    assert tuple(native["v_heads"].value.shape) == (2, 4, 6, 5)  # (B, H, T, dv): 4 heads, 6 tokens, d_v 5


@requires("torch")
@requires("jax")
def test_the_timed_steps_of_torch_and_jax_record_the_same_stages():
    from mha_rosetta.checks.divergence import first_divergence

    cfg = CONFIGS["v3"]
    params = init_params(cfg, seed=4)
    recorded = {}
    for name in ("torch", "jax"):
        backend = _backend(name)
        for form in FORMS:
            prepared = backend.prepare_decode(cfg, params, context=5, batch=2, step=2, dtype="float64", strategy=form)
            recorded[name, form] = backend.canonical_stages(prepared)
    steps = recorded["torch", "naive"]
    assert steps["scores"].shape == (2, 3, 2, 7)  # (B, H, the step's 2 queries, the 5 cached + 2 new keys)
    assert steps["kv_latent"].shape == (2, 7, 10) and steps["k_rope"].shape == (2, 7, 6)
    for form in FORMS:
        assert first_divergence(recorded["torch", form], recorded["jax", form], "float64") is None
        torch_only = {"v", "merged"} if form == "naive" else set()  # jax never merges: each head's o_proj, summed
        assert set(recorded["torch", form]) == set(recorded["jax", form]) | torch_only
    assert first_divergence(recorded["jax", "naive"], recorded["jax", "absorbed"], "float64") is None


@pytest.mark.parametrize("name", [param for param in STAGE_RECORDERS if not param.values[0].startswith("einops-")])
@pytest.mark.parametrize("form", FORMS)
def test_bench_breakdowns_cuts_stop_each_form_where_it_makes_the_stage(name, form):
    """The forms record each stage when they make it, so `bench --breakdown`'s cut after the softmax stops before
    the context is made (NumPy and torch: the recorder stops the pass; JAX: a jitted cut of the stage dump)."""
    from mha_rosetta.backends.stage_programs import stage_programs

    cfg = CONFIGS["v3"]
    backend = _backend(name)
    prepared, _ = backend.prepare(cfg, init_params(cfg, seed=2), _x(cfg, (2, 5)), strategy=form)
    cuts = stage_programs(prepared, backend.requires)
    groups = [group for group, _ in cuts.groups]
    assert groups[0] == "latents" and groups[-1] == "output" and "softmax" in groups
    with cuts.active():
        at = groups.index("softmax")
        cuts.program(at)()
        reached = cuts.reached(at)
    assert {"kv_latent", "k_rope", "q", "scores", "weights"} <= set(reached)
    assert not {"context", "merged", "output"} & set(reached)
