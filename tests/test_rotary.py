"""Rotary position embeddings: the formulas by hand, their properties, the converter, every implementation.

Hand-computed: a unit vector turned by a known angle. Properties of a rotation: position
0 is the identity, norms are kept, and the scores depend only on the distance between
a query's and a key's positions. The converter between Meta's interleaved pairs and
Hugging Face's rotate-half pairs is exact both ways, is Hugging Face's own permutation,
and gives the same layer, on the oracle and on every implementation. A wrong convention
is caught, and the first divergent stage is ``q_rotated``. Where transformers is
installed, its own Llama and GPT-J rotary functions are compared with ours.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import installed_backend, requires
from mha_rosetta.backends import REGISTRY, STANDARD, get_backend
from mha_rosetta.checks import SpecCase, Status, run_check
from mha_rosetta.checks.agreement import backend_level
from mha_rosetta.checks.divergence import first_divergence
from mha_rosetta.core import (
    MHAConfig,
    apply_rotary,
    assert_close,
    init_params,
    inverse_frequencies,
    prepare_inputs,
    reference_mha,
    reference_stages,
    rope_permutation,
    rotary_tables,
    to_interleaved_params,
    to_rotate_half_params,
)

IMPLEMENTATIONS = [name for name, entry in REGISTRY.items() if entry.kind == "implementation"]


def _installed(name: str):
    return installed_backend(name)


def _heads_do_not_split(backend, cfg: MHAConfig) -> bool:
    """A sharded backend (torch-tp: 2 ranks) refuses heads that do not split over its ranks."""
    return getattr(backend, "splits_heads", False) and backend.unsupported_reason(cfg, "float64", "cpu", "standard")


def _tokens(cfg: MHAConfig, batch: int = 2, tokens: int = 7, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, tokens, cfg.d_model))


# -- the formulas, by hand --------------------------------------------------------------------


def test_inverse_frequencies_by_hand():
    np.testing.assert_allclose(inverse_frequencies(4, 100.0), [1.0, 0.1], rtol=1e-15)
    np.testing.assert_allclose(inverse_frequencies(6, 10000.0), [1.0, 10000 ** (-1 / 3), 10000 ** (-2 / 3)])


def test_two_features_turn_by_position_times_frequency():
    # d = 2: one pair, frequency 1, so token m turns (1, 0) to (cos m, sin m) in both conventions.
    x = np.tile([1.0, 0.0], (4, 1))  # (N=4, 2)
    angles = np.arange(4.0)[:, None]  # (4, 1)
    for style in ("half", "interleaved"):
        turned = apply_rotary(x, np.cos(angles), np.sin(angles), style)
        np.testing.assert_allclose(turned, np.stack([np.cos(np.arange(4.0)), np.sin(np.arange(4.0))], -1), atol=1e-15)


def test_the_two_conventions_pair_different_features():
    # d = 4, base 100: pair 0 turns by 1 rad per position, pair 1 by 0.1 rad. Feature 0 at
    # position 1 turns into feature 2 ("half": pair (0, 2)) or feature 1 ("interleaved": (0, 1)).
    cfg_half = MHAConfig(d_model=4, n_heads=1, rope="half", rope_base=100.0)
    inputs = prepare_inputs(cfg_half, np.zeros((1, 2, 4)))
    tables = rotary_tables(cfg_half, inputs)
    np.testing.assert_allclose(tables.q_cos[0, 1], [np.cos(1.0), np.cos(0.1)], rtol=1e-15)
    e0 = np.array([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # (N=2, 4): feature 0 at position 1
    half = apply_rotary(e0, tables.q_cos[0], tables.q_sin[0], "half")
    interleaved = apply_rotary(e0, tables.q_cos[0], tables.q_sin[0], "interleaved")
    np.testing.assert_allclose(half[1], [np.cos(1.0), 0.0, np.sin(1.0), 0.0], atol=1e-15)
    np.testing.assert_allclose(interleaved[1], [np.cos(1.0), np.sin(1.0), 0.0, 0.0], atol=1e-15)
    e1 = np.array([0.0, 1.0, 0.0, 0.0])  # feature 1: pair 1 of "half" (slow), pair 0 of "interleaved" (fast)
    np.testing.assert_allclose(
        apply_rotary(e1, tables.q_cos[0, 1], tables.q_sin[0, 1], "half"), [0, np.cos(0.1), 0, np.sin(0.1)], atol=1e-15
    )
    np.testing.assert_allclose(
        apply_rotary(e1, tables.q_cos[0, 1], tables.q_sin[0, 1], "interleaved"),
        [-np.sin(1.0), np.cos(1.0), 0, 0],
        atol=1e-15,
    )


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_partial_rotary_passes_the_last_features_through(style):
    cfg = MHAConfig(d_model=12, n_heads=2, d_k=6, rope=style, rope_dims=4)
    stages = reference_stages(cfg, init_params(cfg, seed=1), _tokens(cfg))
    np.testing.assert_array_equal(stages["q_rotated"][..., 4:], stages["q_heads"][..., 4:])
    np.testing.assert_array_equal(stages["k_rotated"][..., 4:], stages["k_heads"][..., 4:])
    assert not np.allclose(stages["q_rotated"][:, :, 1:, :4], stages["q_heads"][:, :, 1:, :4])


# -- what a rotation must do ------------------------------------------------------------------


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_position_zero_is_the_identity_and_norms_are_kept(style):
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=6, rope=style)
    stages = reference_stages(cfg, init_params(cfg, seed=2), _tokens(cfg))
    np.testing.assert_array_equal(stages["q_rotated"][:, :, 0], stages["q_heads"][:, :, 0])
    np.testing.assert_allclose(
        np.linalg.norm(stages["q_rotated"], axis=-1), np.linalg.norm(stages["q_heads"], axis=-1), rtol=1e-13
    )
    assert not np.allclose(stages["q_rotated"][:, :, 1:], stages["q_heads"][:, :, 1:])  # it did turn


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_scores_depend_only_on_relative_positions(style):
    # <R(m) q, R(n) k> = <q, R(n - m) k>: shifting every position by 37 changes no score.
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=6, rope=style)
    params, x = init_params(cfg, seed=3), _tokens(cfg)
    plain = reference_stages(cfg, params, x)
    shifted = reference_stages(cfg, params, x, positions=np.arange(7) + 37)
    np.testing.assert_allclose(shifted["scores"], plain["scores"], rtol=1e-12, atol=1e-12)
    assert not np.allclose(shifted["q_rotated"], plain["q_rotated"])  # the tensors moved, the scores did not


def test_rope_changes_the_layer_and_self_attention_keys_follow_the_query_positions():
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=6, rope="half")
    params, x = init_params(cfg, seed=4), _tokens(cfg)
    without = reference_mha(dataclasses.replace(cfg, rope=None, rope_dims=None), params, x)
    assert not np.allclose(reference_mha(cfg, params, x), without)
    positions = np.array([np.arange(7) + 3, np.arange(7) + 20])  # (B, Nq)
    stages = reference_stages(cfg, params, x, positions=positions)
    explicit = reference_stages(cfg, params, x, positions=positions, kv_positions=positions)
    np.testing.assert_array_equal(stages["k_rotated"], explicit["k_rotated"])


# -- the converter ------------------------------------------------------------------------------


def test_rope_permutation_is_hugging_faces_permute():
    # transformers' convert_llama_weights_to_hf.py:
    # permute(w, n_heads, dim1, dim2) =
    #     w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)
    cfg = MHAConfig(d_model=16, n_heads=2, d_k=8, rope="interleaved", bias=False)
    params = init_params(cfg, seed=5)
    w = params.w_q
    hf = w.reshape(2, 4, 2, 16).transpose(0, 2, 1, 3).reshape(16, 16)
    half_cfg, half_params = to_rotate_half_params(cfg, params)
    np.testing.assert_array_equal(half_params.w_q, hf)
    assert half_cfg.rope == "half"
    np.testing.assert_array_equal(rope_permutation(6, 4), [0, 2, 1, 3, 4, 5])  # partial: rows 4, 5 stay
    np.testing.assert_array_equal(rope_permutation(4, 4), [0, 2, 1, 3])


@pytest.mark.parametrize(
    "cfg",
    [
        MHAConfig(d_model=15, n_heads=3, d_k=6, rope="interleaved"),
        MHAConfig(d_model=20, n_heads=4, n_kv_heads=2, d_k=6, d_v=5, rope="interleaved", rope_dims=4, kdim=9),
        MHAConfig(d_model=12, n_heads=2, d_k=4, rope="interleaved", bias=False),
    ],
    ids=["mha", "gqa-partial-kdim", "no-bias"],
)
def test_converter_round_trips_exactly_and_moves_only_rotated_q_k_rows(cfg):
    params = init_params(cfg, seed=6)
    half_cfg, half_params = to_rotate_half_params(cfg, params)
    back_cfg, back_params = to_interleaved_params(half_cfg, half_params)
    assert back_cfg == cfg
    for name, value in params.as_dict().items():
        if value is None:
            assert getattr(back_params, name) is None
            continue
        np.testing.assert_array_equal(getattr(back_params, name), value)
    for name in ("w_v", "b_v", "w_o", "b_o"):  # untouched
        value = getattr(params, name)
        assert value is None or np.array_equal(getattr(half_params, name), value)
    # Rows past rope_dims in every head stay; the rotated ones move.
    per_head = half_params.w_k.reshape(cfg.n_kv_heads, cfg.d_k, -1)
    original = params.w_k.reshape(cfg.n_kv_heads, cfg.d_k, -1)
    np.testing.assert_array_equal(per_head[:, cfg.rope_dims :], original[:, cfg.rope_dims :])
    assert not np.array_equal(per_head[:, : cfg.rope_dims], original[:, : cfg.rope_dims])


def test_converter_needs_the_right_convention():
    cfg = MHAConfig(d_model=12, n_heads=2, rope="half")
    with pytest.raises(ValueError, match=r"cfg\.rope must be 'interleaved'"):
        to_rotate_half_params(cfg, init_params(cfg))
    plain = MHAConfig(d_model=12, n_heads=2)
    with pytest.raises(ValueError, match=r"cfg\.rope must be 'half'"):
        to_interleaved_params(plain, init_params(plain))


def test_meta_interleaved_equals_hf_half_on_the_oracle():
    cfg = MHAConfig(d_model=20, n_heads=4, n_kv_heads=2, d_k=6, rope="interleaved", rope_dims=4, causal=True)
    params, x = init_params(cfg, seed=7), _tokens(cfg)
    positions = np.array([np.arange(7) + 2, np.arange(7) + 9])
    meta = reference_stages(cfg, params, x, positions=positions)
    hf = reference_stages(*to_rotate_half_params(cfg, params), x, positions=positions)
    for name in ("scores", "weights", "context", "output"):
        assert_close(hf[name], meta[name], "float64", what=name)
    assert not np.allclose(hf["q_heads"], meta["q_heads"])  # the heads are permuted, the layer is not
    # The same weights with the other convention are a different layer.
    wrong = reference_mha(dataclasses.replace(cfg, rope="half"), params, x, positions=positions)
    assert not np.allclose(wrong, meta["output"])


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_meta_interleaved_equals_hf_half_in_every_implementation(name):
    backend = _installed(name)
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=6, rope="interleaved")
    if _heads_do_not_split(backend, cfg):
        pytest.skip(backend.unsupported_reason(cfg, "float64", "cpu", "standard"))
    params, x = init_params(cfg, seed=8), _tokens(cfg)
    meta = backend.run(cfg, params, x, dtype="float64", positions=np.arange(7) + 5)
    hf = backend.run(*to_rotate_half_params(cfg, params), x, dtype="float64", positions=np.arange(7) + 5)
    level = backend_level(backend, "float64")  # MLX: float32-accurate sin/cos in float64 (declared)
    assert_close(hf, meta, level, what=f"{name}: HF layout + half vs Meta layout + interleaved")
    assert_close(meta, reference_mha(cfg, params, x, positions=np.arange(7) + 5), level, what=name)


# -- every implementation, stage by stage; a wrong convention is caught at q_rotated ------------

ROPE_CONFIGS = {
    "half-cross-offsets": (MHAConfig(d_model=15, n_heads=3, d_k=6, d_v=4, kdim=11, vdim=9, rope="half"), True),
    "interleaved-partial-gqa-causal": (
        MHAConfig(d_model=20, n_heads=4, n_kv_heads=2, d_k=6, rope="interleaved", rope_dims=4, causal=True),
        False,
    ),
}


def _rope_inputs(cfg: MHAConfig, cross: bool):
    rng = np.random.default_rng(9)
    query = rng.standard_normal((2, 7, cfg.d_model))
    if not cross:
        return query, None, None, {"positions": np.array([np.arange(7) + 4, np.arange(7)])}
    key, value = rng.standard_normal((2, 5, cfg.kdim)), rng.standard_normal((2, 5, cfg.vdim))
    kv_positions = np.array([np.arange(5), np.arange(5) + 1])  # (B, Nk)
    return query, key, value, {"positions": np.arange(7) + 3, "kv_positions": kv_positions}


def _plain_strategies(backend) -> list[str]:
    """The strategies of plain attention: MLA's forms (naive, absorbed) run only MLA (tests/test_mla_adapters.py)."""
    from mha_rosetta.backends._mla import MLA_STRATEGIES

    return [strategy for strategy in backend.strategies if strategy not in MLA_STRATEGIES]


@pytest.mark.parametrize("config", list(ROPE_CONFIGS))
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_every_strategy_matches_the_oracle_at_every_stage(name, config):
    backend = _installed(name)
    cfg, cross = ROPE_CONFIGS[config]
    if _heads_do_not_split(backend, cfg):
        pytest.skip(backend.unsupported_reason(cfg, "float64", "cpu", "standard"))
    params = init_params(cfg, seed=10)
    query, key, value, positions = _rope_inputs(cfg, cross)
    expected = reference_stages(cfg, params, query, key, value, **positions)
    for strategy in _plain_strategies(backend):
        _, stages = backend.run(cfg, params, query, key, value, return_stages=True, strategy=strategy, **positions)
        divergence = first_divergence(stages, expected, backend_level(backend, "float64"))
        if strategy == "direct_reshape":
            assert divergence is not None and divergence.stage == "q_heads", strategy
            continue
        assert {"q_rotated", "k_rotated"} <= set(stages), strategy
        assert divergence is None, f"{name}:{strategy} {divergence and divergence.summary()}"


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_the_wrong_rotary_convention_is_caught_at_q_rotated(name):
    backend = _installed(name)
    for cfg, cross in ROPE_CONFIGS.values():
        if _heads_do_not_split(backend, cfg):
            continue
        params = init_params(cfg, seed=11)
        query, key, value, positions = _rope_inputs(cfg, cross)
        expected = reference_stages(cfg, params, query, key, value, **positions)
        other = "interleaved" if cfg.rope == "half" else "half"
        for strategy in (s for s in _plain_strategies(backend) if s != "direct_reshape"):
            _, stages = backend.run(
                dataclasses.replace(cfg, rope=other),
                params,
                query,
                key,
                value,
                return_stages=True,
                strategy=strategy,
                **positions,
            )
            divergence = first_divergence(stages, expected, "float64")
            assert divergence is not None and divergence.stage == "q_rotated", f"{name}:{strategy}"
            assert divergence.step == "rotary"


def test_the_check_reports_q_rotated_for_a_swapped_convention():
    # The check's own machinery: an adapter that silently uses the other convention.
    from mha_rosetta.backends.numpy.adapter import NumpyBackend

    class SwappedRope(NumpyBackend):
        def _prepare(self, cfg, params, inputs, dtype, device, strategy):
            other = "interleaved" if cfg.rope == "half" else "half"
            return super()._prepare(dataclasses.replace(cfg, rope=other), params, inputs, dtype, device, strategy)

    case = SpecCase("rope", "rotary", MHAConfig(d_model=15, n_heads=3, d_k=6, rope="half"), dtypes=("float64",))
    backend = SwappedRope("numpy-swapped-rope")
    result = run_check(backends=[backend], cases=[case], dtypes=["float64"], strategies=[STANDARD])
    (run,) = result.runs
    assert run.status is Status.DISAGREE, run.reason
    assert run.divergence is not None and run.divergence.stage == "q_rotated"


# -- oracles: which compare rotary, which say why not -------------------------------------------


@pytest.mark.parametrize("name", ["torch-sdpa", "jax-dpa", "equinox"])
def test_oracles_with_a_rotary_path_agree(name):
    backend = _installed(name)
    cfg = MHAConfig(d_model=12, n_heads=2, d_k=6, rope="half", rope_dims=4)
    params, x = init_params(cfg, seed=12), _tokens(cfg)
    dtype = "float32" if name == "jax-dpa" else "float64"  # jax-dpa has no float64 softmax
    assert_close(backend.run(cfg, params, x, dtype=dtype), reference_mha(cfg, params, x), dtype, what=name)


@pytest.mark.parametrize(
    ("name", "words"),
    [("torch-mha", "has no rotary embedding"), ("flax", "has no rotary embedding"), ("equinox", "rotates halves")],
)
def test_oracles_without_a_rotary_path_say_why(name, words):
    backend = _installed(name)
    cfg = MHAConfig(d_model=12, n_heads=2, rope="interleaved")
    reason = backend.unsupported_reason(cfg, "float64", "cpu", STANDARD)
    assert reason is not None and words in reason


def test_equinox_refuses_positions_its_module_cannot_take():
    from mha_rosetta.backends import UnsupportedCase

    backend = _installed("equinox")
    cfg = MHAConfig(d_model=12, n_heads=2, rope="half")
    with pytest.raises(UnsupportedCase, match=r"positions 0\.\.N-1"):
        backend.run(cfg, init_params(cfg), _tokens(cfg), positions=np.arange(7) + 1)


# -- the real libraries' rotary functions --------------------------------------------------------


@requires("transformers")
def test_hugging_face_llama_apply_rotary_pos_emb_is_half():
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = MHAConfig(d_model=16, n_heads=2, rope="half", rope_base=500.0)
    params, x = init_params(cfg, seed=13), _tokens(cfg)
    positions = np.array([np.arange(7) + 2, np.arange(7) + 30])
    stages = reference_stages(cfg, params, x, positions=positions)
    # Llama's rotary embedding: cos/sin of (positions x inv_freq), duplicated over both halves.
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    freqs = torch.from_numpy(positions).double()[..., None] * inv_freq  # (B, N, 4)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, N, 8)
    q, k = (torch.from_numpy(stages[name]) for name in ("q_heads", "k_heads"))
    q_embed, k_embed = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    np.testing.assert_allclose(q_embed.numpy(), stages["q_rotated"], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(k_embed.numpy(), stages["k_rotated"], rtol=1e-13, atol=1e-13)


@requires("transformers")
def test_gpt_j_partial_rotary_is_interleaved():
    import torch
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

    # GPT-J turns the first rotary_dim features with interleaved pairs (rotate_every_two).
    cfg = MHAConfig(d_model=16, n_heads=2, d_k=8, rope="interleaved", rope_dims=6)
    params, x = init_params(cfg, seed=14), _tokens(cfg)
    stages = reference_stages(cfg, params, x)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 6, 2, dtype=torch.float64) / 6))
    angles = torch.arange(7, dtype=torch.float64)[:, None] * inv_freq  # (N, 3)
    sin, cos = angles.sin()[None], angles.cos()[None]  # (1, N, 3), as GPT-J slices its table
    q = torch.from_numpy(stages["q_heads"]).transpose(1, 2)  # (B, N, H, Dk): GPT-J's layout
    turned = apply_rotary_pos_emb(q[..., :6], sin, cos)
    expected = torch.cat([turned, q[..., 6:]], dim=-1).transpose(1, 2).numpy()  # (B, H, N, Dk)
    np.testing.assert_allclose(expected, stages["q_rotated"], rtol=1e-13, atol=1e-13)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"rope": "rotate"}, ValueError, "MHAConfig.rope must be None or one of 'half', 'interleaved'"),
        ({"rope": "half", "rope_dims": 3}, ValueError, "MHAConfig.rope_dims must be even"),
        ({"rope": "half", "rope_dims": 8}, ValueError, "at most d_k=6"),
        ({"rope": "half", "rope_dims": 0}, ValueError, "MHAConfig.rope_dims must be a positive int"),
        ({"rope": "half", "rope_dims": 4.0}, TypeError, "MHAConfig.rope_dims must be an int"),
        ({"rope_dims": 4}, ValueError, "needs rope='half' or 'interleaved'"),
        ({"rope": "half", "rope_base": 0.0}, ValueError, "MHAConfig.rope_base must be a finite positive number"),
        ({"rope": "half", "rope_base": float("inf")}, ValueError, "MHAConfig.rope_base"),
        ({"rope": "half", "rope_base": True}, ValueError, "MHAConfig.rope_base"),
    ],
)
def test_bad_rotary_config_names_the_field(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        MHAConfig(d_model=12, n_heads=2, **kwargs)


def test_odd_head_width_needs_partial_rotary():
    with pytest.raises(ValueError, match="d_k must be even, got d_k=5"):
        MHAConfig(d_model=15, n_heads=3, rope="interleaved")
    assert MHAConfig(d_model=15, n_heads=3, rope="interleaved", rope_dims=4).rope_dims == 4


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"positions": np.arange(7.0)}, TypeError, "positions must hold integers"),
        ({"positions": np.ones(7, dtype=bool)}, TypeError, "positions must hold integers"),
        ({"positions": np.arange(6)}, ValueError, r"positions must have shape \(7,\) or \(batch=2, 7\)"),
        ({"positions": np.zeros((3, 7), dtype=int)}, ValueError, "got shape"),
        ({"kv_positions": np.arange(4)}, ValueError, r"kv_positions must have shape \(7,\)"),
    ],
)
def test_bad_positions_name_the_argument(kwargs, error, words):
    cfg = MHAConfig(d_model=12, n_heads=2, rope="half")
    with pytest.raises(error, match=words):
        reference_mha(cfg, init_params(cfg), _tokens(cfg), **kwargs)
    with pytest.raises(error, match=words):
        get_backend("numpy").run(cfg, init_params(cfg), _tokens(cfg), **kwargs)


def test_unbatched_positions_are_one_dimensional():
    cfg = MHAConfig(d_model=12, n_heads=2, rope="half")
    x = _tokens(cfg)[0]  # (N, D)
    with pytest.raises(ValueError, match=r"positions must have shape \(7,\), got shape \(1, 7\)"):
        reference_mha(cfg, init_params(cfg), x, positions=np.arange(7)[None])
    out = reference_mha(cfg, init_params(cfg), x, positions=np.arange(7) + 2)
    assert_close(out, reference_mha(cfg, init_params(cfg), x[None], positions=np.arange(7) + 2)[0], "float64")


def test_describe_mentions_rope():
    assert "rope=half(base=10000)" in MHAConfig(d_model=12, n_heads=2, rope="half").describe()
    assert "dims=4" in MHAConfig(d_model=12, n_heads=2, rope="interleaved", rope_dims=4).describe()
    assert "rope" not in MHAConfig(d_model=12, n_heads=2).describe()


# -- Hypothesis: rotary configurations and positions, bounded ----------------------------------


@st.composite
def rope_cases(draw):
    n_kv_heads = draw(st.integers(1, 2))
    n_heads = n_kv_heads * draw(st.integers(1, 3))
    d_k = 2 * draw(st.integers(1, 4))
    batch = draw(st.integers(1, 3))
    q_tokens = draw(st.integers(1, 6))
    cfg = MHAConfig(
        d_model=draw(st.integers(3, 13)),
        n_heads=n_heads,
        d_k=d_k,
        n_kv_heads=n_kv_heads,
        causal=draw(st.booleans()),
        rope=draw(st.sampled_from(["half", "interleaved"])),
        rope_dims=2 * draw(st.integers(1, d_k // 2)),
        rope_base=draw(st.sampled_from([10000.0, 500.0, 3.0])),
    )
    offsets = draw(st.one_of(st.none(), st.lists(st.integers(0, 50), min_size=batch, max_size=batch)))
    return SpecCase(
        "hypothesis-rope",
        "drawn by Hypothesis",
        cfg,
        batch=batch,
        q_tokens=q_tokens,
        position_offsets=None if offsets is None else tuple(offsets),
        dtypes=("float64",),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("name", ["numpy", "torch", "einops-numpy"])
def test_hypothesis_rope_configs_agree_with_the_oracle(name):
    backend = _installed(name)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(case=rope_cases())
    def check(case):
        result = run_check(backends=[backend], cases=[case], dtypes=["float64"], strategies=_plain_strategies(backend))
        for run in result.runs:
            if run.impl.known_mistake:
                continue
            assert run.status is Status.AGREE, f"{run.label} on {case.describe()}: {run.status} {run.reason}"
        # The converter holds on every drawn configuration too.
        data = case.inputs()
        cfg, params = case.cfg, case.params()
        convert = to_rotate_half_params if cfg.rope == "interleaved" else to_interleaved_params
        flipped = convert(cfg, params)
        assert_close(
            reference_mha(*flipped, data.query, positions=data.positions),
            reference_mha(cfg, params, data.query, positions=data.positions),
            "float64",
        )

    check()
