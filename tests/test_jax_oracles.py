"""The JAX-family oracles (jax.nn.dot_product_attention, Flax, Equinox) against the float64 oracle.

Each agrees with the reference where it can run the case, gives a reason where it
cannot, and the libraries' own answers for rows with nothing to attend to are
asserted as what they are (the mean of V), not only as what the adapters map them to.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import BATCH, D_MODEL, HEADS, KV_TOKENS, Q_TOKENS, requires
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha, reference_stages

pytestmark = requires("jax")

SELF = MHAConfig(d_model=D_MODEL, n_heads=HEADS)
CROSS = MHAConfig(d_model=D_MODEL, n_heads=HEADS, kdim=11, vdim=9)  # kdim != vdim != d_model
CAUSAL_NO_BIAS = MHAConfig(d_model=D_MODEL, n_heads=HEADS, causal=True, bias=False)
GQA = MHAConfig(d_model=18, n_heads=6, n_kv_heads=2)  # 6 query heads on 2 kv heads
DV_NE_DK = MHAConfig(d_model=16, n_heads=HEADS, d_k=6, d_v=4)
CUSTOM_SCALE = MHAConfig(d_model=D_MODEL, n_heads=HEADS, scale=0.37)


def _oracle_param(name: str, *modules: str):
    return pytest.param(name, marks=[requires(m) for m in modules], id=name)


ORACLES = [_oracle_param("jax-dpa"), _oracle_param("flax", "flax"), _oracle_param("equinox", "equinox")]


def oracle(name: str, **kwargs):
    from mha_rosetta.backends import get_backend
    from mha_rosetta.backends.oracles.equinox import EquinoxMHAOracle
    from mha_rosetta.backends.oracles.flax import FlaxMHAOracle
    from mha_rosetta.backends.oracles.jax_dpa import JaxDotProductAttentionOracle

    if not kwargs:
        return get_backend(name)
    cls = {"jax-dpa": JaxDotProductAttentionOracle, "flax": FlaxMHAOracle, "equinox": EquinoxMHAOracle}[name]
    return cls(**kwargs)


def make_inputs(cfg: MHAConfig, *, cross: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((BATCH, Q_TOKENS, cfg.d_model))
    if not cross:
        return query, None, None, Q_TOKENS
    key = rng.standard_normal((BATCH, KV_TOKENS, cfg.kdim))
    value = rng.standard_normal((BATCH, KV_TOKENS, cfg.vdim))
    return query, key, value, KV_TOKENS


def padding_mask(n_k: int) -> np.ndarray:
    mask = np.ones((BATCH, 1, Q_TOKENS, n_k), dtype=bool)  # (B, 1, Nq, Nk)
    mask[1, :, :, n_k - 2 :] = False  # batch item 1: the last two keys are padding
    return mask


# The float dtype each oracle is checked in besides float32 (jax-dpa cannot do float64,
# nor float16 under jit on CPU; see the unsupported-reason tests).
SECOND_DTYPE = {"jax-dpa": "bfloat16", "flax": "float64", "equinox": "float64"}


@pytest.mark.parametrize("name", ORACLES)
def test_cross_attention_with_padding_matches_reference(name):
    params = init_params(CROSS, seed=1)
    query, key, value, n_k = make_inputs(CROSS, cross=True)
    mask = padding_mask(n_k)
    expected = reference_mha(CROSS, params, query, key, value, mask)
    for dtype in ("float32", SECOND_DTYPE[name]):
        out = oracle(name).run(CROSS, params, query, key, value, mask, dtype=dtype)
        assert_close(out, expected, dtype, what=f"{name} cross {dtype}")


@pytest.mark.parametrize("name", ORACLES)
def test_causal_without_bias_matches_reference(name):
    params = init_params(CAUSAL_NO_BIAS, seed=2)
    query, _, _, _ = make_inputs(CAUSAL_NO_BIAS, cross=False)
    out = oracle(name).run(CAUSAL_NO_BIAS, params, query, dtype="float32")
    assert_close(out, reference_mha(CAUSAL_NO_BIAS, params, query), "float32")


@pytest.mark.parametrize("name", ORACLES)
def test_unbatched_self_attention_matches_reference(name):
    params = init_params(SELF, seed=3)
    query = np.random.default_rng(3).standard_normal((Q_TOKENS, D_MODEL))  # (Nq, D)
    out = oracle(name).run(SELF, params, query, dtype="float32")
    assert out.shape == (Q_TOKENS, D_MODEL)
    assert_close(out, reference_mha(SELF, params, query), "float32")


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        pytest.param("flax", "float16", marks=requires("flax")),
        pytest.param("equinox", "float16", marks=requires("equinox")),
    ],
)
def test_float16_matches_reference(name, dtype):
    params = init_params(SELF, seed=4)
    query, _, _, n_k = make_inputs(SELF, cross=False)
    mask = padding_mask(n_k)
    out = oracle(name).run(SELF, params, query, mask=mask, dtype=dtype)
    assert_close(out, reference_mha(SELF, params, query, mask=mask), dtype)


def test_dot_product_attention_runs_gqa_natively():
    params = init_params(GQA, seed=5)
    query, _, _, n_k = make_inputs(GQA, cross=False)
    mask = padding_mask(n_k)
    out, stages = oracle("jax-dpa").run(GQA, params, query, mask=mask, dtype="float32", return_stages=True)
    expected = reference_stages(GQA, params, query, mask=mask)
    assert stages["k_heads"].shape == (BATCH, 2, Q_TOKENS, 3)  # canonical (B, Hkv, Nk, Dk): 2 kv heads, not 6
    for name in ("q_heads", "k_heads", "v_heads", "context", "merged", "output"):
        assert_close(stages[name], expected[name], "float32", what=name)
    assert_close(out, expected["output"], "float32")


@requires("equinox")
def test_equinox_supports_dv_ne_dk_and_exposes_its_projections():
    params = init_params(DV_NE_DK, seed=6)
    query, _, _, _ = make_inputs(DV_NE_DK, cross=False)
    out, stages = oracle("equinox").run(DV_NE_DK, params, query, return_stages=True)
    expected = reference_stages(DV_NE_DK, params, query)
    assert sorted(stages) == ["k", "output", "q", "v"]
    for name, value in stages.items():
        assert_close(value, expected[name], "float64", what=name)
    assert out.shape == (BATCH, Q_TOKENS, 16)
    assert_close(out, expected["output"], "float64")


@requires("flax")
def test_flax_exposes_its_attention_weights():
    params = init_params(CROSS, seed=7)
    query, key, value, n_k = make_inputs(CROSS, cross=True)
    mask = padding_mask(n_k)
    _, weights = oracle("flax").run(CROSS, params, query, key, value, mask, return_weights=True)
    assert_close(weights, reference_mha(CROSS, params, query, key, value, mask, return_weights=True)[1], "float64")


# --- unsupported cases give reasons ----------------------------------------------------------

UNSUPPORTED = [
    ("jax-dpa", DV_NE_DK, "float32", "d_v=4 != d_k=6"),
    ("jax-dpa", SELF, "float64", "softmax in float32"),
    ("jax-dpa", SELF, "float16", "F16_F16_F32"),
    ("flax", GQA, "float32", "n_kv_heads=2"),
    ("flax", DV_NE_DK, "float32", "d_k=6, d_v=4"),
    ("flax", CUSTOM_SCALE, "float32", "scale=0.37"),
    ("equinox", GQA, "float32", "n_kv_heads=2"),
    ("equinox", CUSTOM_SCALE, "float32", "scale=0.37"),
]


@pytest.mark.parametrize(
    ("name", "cfg", "dtype", "fragment"),
    [
        pytest.param(*case, marks=requires({"jax-dpa": "jax"}.get(case[0], case[0])), id=f"{case[0]}-{case[3]}")
        for case in UNSUPPORTED
    ],
)
def test_unsupported_cases_give_a_reason(name, cfg, dtype, fragment):
    from mha_rosetta.backends import UnsupportedCase

    backend = oracle(name)
    reason = backend.unsupported_reason(cfg, dtype, "cpu", "standard")
    assert reason is not None and fragment in reason
    with pytest.raises(UnsupportedCase, match=fragment.replace("(", r"\(")):
        backend.run(cfg, init_params(cfg), make_inputs(cfg, cross=False)[0], dtype=dtype)


def test_float16_dot_product_attention_under_jit_fails_on_cpu():
    """Why jax-dpa refuses float16 on CPU: the library's own jitted call does not compile there."""
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "cpu":
        pytest.skip("the failure is specific to XLA:CPU")
    heads = jnp.ones((1, 3, 2, 4), jnp.float16)  # (B, T, N, H)
    with pytest.raises(ValueError, match="F16_F16_F32"):
        jax.jit(jax.nn.dot_product_attention)(heads, heads, heads)
    assert jax.nn.dot_product_attention(heads, heads, heads).dtype == jnp.float16  # eagerly it falls back


def test_a_single_bfloat16_score_is_refused_with_xla_s_reason_and_its_failure_is_real():
    """jax-dpa refuses a bfloat16 call whose scores are one element (B = H = Nq = Nk = 1): the library's jitted call
    does not compile there (a Hypothesis draw found it); one more query token compiles and runs."""
    import jax
    import jax.numpy as jnp

    from mha_rosetta.backends import UnsupportedCase

    if jax.default_backend() != "cpu":
        pytest.skip("the failure is specific to XLA:CPU")
    one = jnp.ones((1, 1, 1, 4), jnp.bfloat16)  # (B, T, N, H)
    with pytest.raises(Exception, match="BF16_BF16_F32"):
        jax.jit(jax.nn.dot_product_attention)(one, one, one)
    cfg = MHAConfig(d_model=4, n_heads=1)
    x = np.random.default_rng(3).standard_normal((1, 1, 4))
    with pytest.raises(UnsupportedCase, match="single score"):
        oracle("jax-dpa").run(cfg, init_params(cfg), x, dtype="bfloat16")
    two = np.random.default_rng(3).standard_normal((1, 2, 4))  # two tokens: four scores, and it runs
    assert oracle("jax-dpa").run(cfg, init_params(cfg), two, dtype="bfloat16").shape == (1, 2, 4)


def test_float64_dot_product_attention_is_only_float32_accurate():
    """Why jax-dpa refuses float64: its softmax runs in float32, so errors are ~1e-7, not ~1e-15."""
    import jax
    import jax.numpy as jnp

    from mha_rosetta.core import softmax_with_empty_rows

    jax.config.update("jax_enable_x64", True)  # process-global, as the adapters do for float64
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((BATCH, Q_TOKENS, HEADS, 5)) for _ in range(3))  # (B, T, N, H)
    out = np.asarray(jax.jit(jax.nn.dot_product_attention)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    weights = softmax_with_empty_rows(np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(5))  # (B, H, Nq, Nk)
    expected = np.einsum("bhqk,bkhd->bqhd", weights, v)  # (B, Nq, H, Dv)
    error = np.abs(out - expected).max()
    assert out.dtype == np.float64
    assert 1e-10 < error < 1e-5, error


# --- rows with nothing to attend to --------------------------------------------------------------


def mean_of_values_output(cfg, params, key_input, row_batch: int) -> np.ndarray:
    """What a library that masks with a finite negative gives a fully masked row: the mean of V, projected."""
    stages = reference_stages(cfg, params, key_input)
    v_heads = stages["v_heads"][row_batch]  # (Hkv, Nk, Dv)
    merged = np.concatenate([v_heads[cfg.kv_head_of(h)].mean(axis=0) for h in range(cfg.n_heads)])  # (H*Dv,)
    return merged @ params.w_o.T + params.b_o  # (D,)


@pytest.mark.parametrize("name", ORACLES)
def test_fully_masked_row_library_answer_is_the_mean_of_values(name):
    params = init_params(SELF, seed=9)
    query, _, _, _ = make_inputs(SELF, cross=False)
    mask = np.ones((BATCH, 1, Q_TOKENS, Q_TOKENS), dtype=bool)
    mask[0, :, 4, :] = False  # query 4 of item 0 may attend to nothing
    expected = reference_mha(SELF, params, query, mask=mask)

    dtype = "float32" if name == "jax-dpa" else "float64"  # jax-dpa has no float64 (see above)

    raw = oracle(name, spec_empty_rows=False).run(SELF, params, query, mask=mask, dtype=dtype)
    assert_close(raw[0, 4], mean_of_values_output(SELF, params, query, 0), dtype, what="library answer")
    assert not np.allclose(raw[0, 4], params.b_o, atol=1e-2)  # the library's answer is not the spec's
    assert_close(np.delete(raw, 4, axis=1), np.delete(expected, 4, axis=1), dtype)  # every other row agrees

    prepared, inputs = oracle(name).prepare(SELF, params, query, mask=mask, dtype=dtype)
    mapped = inputs.unbatch(prepared.to_numpy(prepared.forward()))
    assert_close(mapped, expected, dtype)
    assert_close(mapped[0, 4], params.b_o, dtype, what="mapped row")  # spec: output b_o
    # jax-dpa zeroes (batch, head, query) context rows; Flax and Equinox replace (batch, query) output rows.
    assert prepared.info["empty_rows_mapped"] == (HEADS if name == "jax-dpa" else 1)


@pytest.mark.parametrize("name", [p for p in ORACLES if p.values[0] != "jax-dpa"])
def test_row_empty_in_some_heads_only_cannot_be_mapped_by_output_only_oracles(name):
    from mha_rosetta.backends import UnsupportedCase

    params = init_params(SELF, seed=10)
    query, _, _, _ = make_inputs(SELF, cross=False)
    mask = np.ones((BATCH, HEADS, Q_TOKENS, Q_TOKENS), dtype=bool)  # (B, H, Nq, Nk)
    mask[0, 1, 3, :] = False  # query 3 is empty in head 1 only
    with pytest.raises(UnsupportedCase, match="some heads but not all"):
        oracle(name).run(SELF, params, query, mask=mask)


def test_dot_product_attention_maps_a_row_empty_in_one_head():
    """jax-dpa sees the per-head context, so it can zero a row that is empty in one head only."""
    params = init_params(SELF, seed=11)
    query, _, _, _ = make_inputs(SELF, cross=False)
    mask = np.ones((BATCH, HEADS, Q_TOKENS, Q_TOKENS), dtype=bool)  # (B, H, Nq, Nk)
    mask[1, 2, 6, :] = False  # query 6 of item 1 is empty in head 2 only
    out = oracle("jax-dpa").run(SELF, params, query, mask=mask, dtype="float32")
    assert_close(out, reference_mha(SELF, params, query, mask=mask), "float32")


# --- what every oracle states about itself --------------------------------------------------------


@pytest.mark.parametrize("name", ORACLES)
def test_oracles_state_their_known_differences(name):
    backend = oracle(name)
    assert backend.kind == "oracle"
    differences = list(backend.known_differences)
    assert differences and all(isinstance(text, str) and text for text in differences)
    assert any("polarity" in text for text in differences)
    assert any("no allowed key" in text for text in differences)
    info = backend.prepare(SELF, init_params(SELF), make_inputs(SELF, cross=False)[0], dtype="float32")[0].info
    assert info["known_differences"] == differences
    assert info["matmul_precision"] == "highest"
