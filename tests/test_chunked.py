"""The chunked (online-softmax, memory-linear) strategy of the numpy, torch and jax adapters.

Against the float64 oracle on the adapter cases (GQA, cross-attention, causal, padding,
rows with nothing to attend to, unbatched), block sizes that do not divide the token
counts, the stages it exposes, causal block skipping counted tile by tile, peak memory
measured with tracemalloc, bad block sizes, and a Hypothesis property over odd blocks.
The variants in the tiles (numpy): the sliding window's tiles counted by hand and against an
independent count from the full mask, per batch item's positions; softcap, ALiBi, T5's
buckets and the sinks against the oracle at shifted positions; linear memory with a score bias.
"""

from __future__ import annotations

import importlib.util
import tracemalloc

import numpy as np
import pytest
from adapter_cases import CASES, DTYPES, assert_stages_close, empty_rows_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_rosetta.backends import CHUNKED, DEFAULT_CHUNK, STANDARD, UnsupportedCase, get_backend
from mha_rosetta.checks.cases import SPEC_CASES, SpecCase
from mha_rosetta.core import MHAConfig, assert_close, compare, init_params, reference_mha

ADAPTERS = ("numpy", "torch", "jax")
CHUNKED_STAGE_NAMES = (
    "q", "k", "v", "q_heads", "k_heads", "v_heads", "q_rotated", "k_rotated", "context", "merged", "output",
)  # fmt: skip


def _adapter(name: str):
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    return get_backend(name)


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunked_matches_the_oracle_in_float64(name, case):
    backend = _adapter(name)
    if reason := backend.unsupported_reason(case.cfg, "float64", "cpu", CHUNKED):
        pytest.skip(reason)  # a variant this adapter's chunked strategy does not declare (Backend rule 6)
    # Blocks (3, 2) divide none of the cases' odd token counts: every block shape occurs.
    output = case.run(backend, "float64", CHUNKED, chunk=(3, 2))
    expected = case.reference()
    assert output.shape == expected.shape
    assert np.max(np.abs(output - expected)) < 1e-13  # float64: only the order of the sums differs


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_in_every_dtype(name, dtype):
    backend = _adapter(name)
    # GQA; rows with nothing to attend to (one in a single head), no bias
    for case in (SPEC_CASES["gqa"], empty_rows_case(MHAConfig(d_model=15, n_heads=3, bias=False))):
        output = case.run(backend, dtype, CHUNKED, chunk=(2, 3))
        assert_close(output, case.reference(), dtype, what=f"{name}:chunked/{dtype} on {case}")


@pytest.mark.parametrize("name", ADAPTERS)
def test_chunked_exposes_what_it_holds_and_says_why_not_the_weights(name):
    backend = _adapter(name)
    case = SPEC_CASES["rope_gqa_causal"]  # GQA, causal, rotary
    _, stages = case.run(backend, "float64", CHUNKED, chunk=(4, 2), return_stages=True)
    assert set(stages) == set(CHUNKED_STAGE_NAMES)
    assert_stages_close(stages, case.reference_stages(), "float64", CHUNKED_STAGE_NAMES)
    with pytest.raises(UnsupportedCase, match=r"does not expose attention weights \(the chunked strategy never"):
        case.run(backend, "float64", CHUNKED, return_weights=True)


@pytest.mark.parametrize("name", ADAPTERS)
def test_default_blocks_and_blocks_larger_than_the_tokens(name):
    backend = _adapter(name)
    case = SPEC_CASES["self_attention"]
    prepared, _ = backend.prepare(case.cfg, case.params(), *case.inputs().arrays, strategy=CHUNKED)
    # 7 tokens: the default (128, 256) is cut to the token counts.
    assert prepared.info["chunk"] == (min(DEFAULT_CHUNK[0], 7), min(DEFAULT_CHUNK[1], 7))
    output = case.run(backend, "float64", CHUNKED, chunk=1000)
    assert np.max(np.abs(output - case.reference())) < 1e-13


def _layers_built(monkeypatch, name: str) -> list:
    """Every chunked layer the adapter builds from now on (to read its tile counter)."""
    module = importlib.import_module(f"mha_rosetta.backends.{name}.chunked")
    cls = module.ChunkedColumnSampleMHA if name == "numpy" else module.ChunkedRowSampleMHA
    built, init = [], cls.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(cls, "__init__", spy)
    return built


@pytest.mark.parametrize("name", ("numpy", "torch"))
def test_causal_blocks_above_the_diagonal_are_skipped(name, monkeypatch):
    backend = _adapter(name)
    built = _layers_built(monkeypatch, name)
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True)
    x = np.random.default_rng(0).standard_normal((1, 12, 8))
    output = backend.run(cfg, init_params(cfg), x, strategy=CHUNKED, chunk=3)
    # 4 query blocks of 3; query block i sees key blocks 0..i: 1 + 2 + 3 + 4 = 10 of 16 tiles.
    assert built[0].tiles_visited == 10
    assert_close(output, reference_mha(cfg, init_params(cfg), x), "float64")


def test_fully_masked_tiles_are_skipped_and_give_the_spec_zero(monkeypatch):
    backend = get_backend("numpy")
    cfg = MHAConfig(d_model=8, n_heads=2, bias=False)
    x = np.random.default_rng(1).standard_normal((2, 6, 8))
    mask = np.ones((2, 1, 6, 6), dtype=bool)
    mask[:, :, :, 3:] = False  # keys 3..5 are padding for everyone: their tiles are never computed
    mask[1, :, 4] = False  # query 4 of item 1 may attend to nothing: zero context, output b_o = 0
    built = _layers_built(monkeypatch, "numpy")
    output = backend.run(cfg, init_params(cfg), x, mask=mask, strategy=CHUNKED, chunk=3)
    assert built[0].tiles_visited == 2  # two query blocks x the first key block
    assert np.array_equal(output[1, 4], np.zeros(8))
    assert np.max(np.abs(output - reference_mha(cfg, init_params(cfg), x, mask=mask))) < 1e-13


def test_numpy_chunked_peak_memory_is_linear_in_the_tokens():
    """tracemalloc sees every NumPy allocation: the chunked pass never holds the (Nq, Nk) scores."""
    backend = get_backend("numpy")
    cfg = MHAConfig(d_model=16, n_heads=2)
    params = init_params(cfg)

    def peak_bytes(tokens: int, strategy: str) -> int:
        x = np.random.default_rng(2).standard_normal((1, tokens, 16))
        blocks = {"chunk": (64, 64)} if strategy == CHUNKED else {}
        tracemalloc.start()  # before prepare: the standard path allocates its score buffer there
        prepared, _ = backend.prepare(cfg, params, x, dtype="float32", strategy=strategy, **blocks)
        prepared.forward()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    scores = 2 * 1024 * 1024 * 4  # (H, N, N) float32 at N = 1024: 8 MiB
    chunked, standard = peak_bytes(1024, CHUNKED), peak_bytes(1024, STANDARD)
    assert standard >= scores  # the materialising path holds at least the scores ...
    assert chunked < scores / 8  # ... the chunked one a few (64, 64) tiles and O(N) vectors
    # Doubling the tokens about doubles the chunked peak (linear), never quadruples it.
    assert peak_bytes(2048, CHUNKED) < 2.5 * chunked


@pytest.mark.parametrize(
    ("chunk", "error", "message"),
    [
        (0, ValueError, r"chunk: q_block must be a positive int, got 0"),
        ((4, -1), ValueError, r"chunk: k_block must be a positive int, got -1"),
        ((2.5, 4), TypeError, r"chunk: q_block must be an int, got 2.5"),
        ((True, 4), TypeError, r"chunk: q_block must be an int, got True"),
        ((1, 2, 3), TypeError, r"chunk must be \(q_block, k_block\) or one int for both, got \(1, 2, 3\)"),
        ("8", TypeError, r"chunk must be \(q_block, k_block\)"),
    ],
)
def test_bad_block_sizes_name_chunk(chunk, error, message):
    case = SPEC_CASES["self_attention"]
    with pytest.raises(error, match=message):
        case.run(get_backend("numpy"), "float64", CHUNKED, chunk=chunk)


def test_chunk_with_another_strategy_is_refused():
    case = SPEC_CASES["self_attention"]
    with pytest.raises(ValueError, match=r"chunk=\(4, 4\) applies only to strategy='chunked', got strategy='standard'"):
        case.run(get_backend("numpy"), "float64", STANDARD, chunk=4)


@st.composite
def chunked_examples(draw):
    n_kv = draw(st.integers(1, 2))
    cfg = MHAConfig(
        d_model=draw(st.sampled_from([6, 10])),
        n_heads=n_kv * draw(st.integers(1, 2)),
        d_k=draw(st.integers(1, 4)),
        n_kv_heads=n_kv,
        kdim=7,
        vdim=5,
        bias=draw(st.booleans()),
        causal=draw(st.booleans()),
    )
    batched = draw(st.booleans())
    mask = draw(st.sampled_from([None, "padding", "empty rows"]))
    case = SpecCase(
        "drawn",
        "drawn by Hypothesis",
        cfg,
        batch=2 if batched else None,
        q_tokens=7,
        kv_tokens=5,
        key_lengths=((5, 3) if batched else (3,)) if mask == "padding" else None,
        blocked_rows=((0, 4),) if mask == "empty rows" else (),
        seed=draw(st.integers(0, 100)),
    )
    chunk = (draw(st.sampled_from([1, 2, 3, 5, 7, 9])), draw(st.sampled_from([1, 2, 3, 4, 5, 9])))
    return case, chunk


EXAMPLES = {"numpy": 40, "torch": 25, "jax": 4}


@pytest.mark.parametrize("name", ADAPTERS)
def test_odd_block_sizes_agree_with_the_oracle(name):
    backend = _adapter(name)

    @settings(max_examples=EXAMPLES[name], deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(example=chunked_examples())
    def check(example):
        case, chunk = example
        output = case.run(backend, "float64", CHUNKED, chunk=chunk)
        result = compare(output, case.reference(), "float64", atol=1e-12, rtol=1e-12)
        assert result.ok, f"{case.describe()} chunk={chunk}: {result.summary()}"

    check()


@pytest.mark.parametrize("name", ADAPTERS)
@pytest.mark.parametrize("rope", ("half", "interleaved"))
def test_chunked_applies_rotary_before_the_blocks(name, rope):
    backend = _adapter(name)
    cfg = MHAConfig(d_model=12, n_heads=4, n_kv_heads=2, d_k=6, rope=rope, rope_dims=4, causal=True)
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 7, 12))
    positions = np.array([[5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6]])  # item 0 starts at 5
    output, stages = backend.run(
        cfg, params, x, strategy=CHUNKED, chunk=(3, 2), positions=positions, return_stages=True
    )
    expected = reference_mha(cfg, params, x, positions=positions, return_stages=True)[1]
    assert np.max(np.abs(output - expected["output"])) < 1e-13
    assert_stages_close(stages, expected, "float64", ("q_rotated", "k_rotated", "context"))


# -- the variants in the tiles ----------------------------------------------------------------
def test_a_causal_window_visits_only_the_band_of_tiles(monkeypatch):
    """12 tokens, blocks of 3, a window of 4: counted by hand, tile by tile.

    Query block 0 (queries 0-2) sees key block 0; block 1 (3-5) key blocks 0 and 1 (key 2 is
    within 4 of query 3); block 2 (6-8) key blocks 1 and 2 (keys 0-2 are 4 or more before
    query 6); block 3 (9-11) key blocks 2 and 3. 7 of the 16 tiles; 6 lie above the diagonal,
    3 wholly outside the window.
    """
    backend = get_backend("numpy")
    built = _layers_built(monkeypatch, "numpy")
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True, window=4)
    x = np.random.default_rng(5).standard_normal((2, 12, 8))
    prepared, _ = backend.prepare(cfg, init_params(cfg), x, strategy=CHUNKED, chunk=3)
    assert prepared.info["tiles"] == {"total": 16, "above_diagonal": 6, "outside_window": 3, "planned": 7}
    output = prepared.to_numpy(prepared.forward())
    assert built[0].tiles_visited == 7
    assert np.max(np.abs(output - reference_mha(cfg, init_params(cfg), x))) < 1e-13


def _tiles_with_an_allowed_pair(allowed: np.ndarray, chunk: tuple[int, int]) -> int:
    """Independent count: the tiles of a full (Nq, Nk) allowed matrix holding at least one True."""
    q_block, k_block = chunk
    n_q, n_k = allowed.shape
    return sum(
        bool(allowed[i : i + q_block, j : j + k_block].any())
        for i in range(0, n_q, q_block)
        for j in range(0, n_k, k_block)
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "two_sided"])
@pytest.mark.parametrize(
    ("tokens", "window", "chunk"), [(12, 4, (3, 3)), (20, 3, (4, 2)), (17, 6, (5, 3)), (9, 16, (2, 4))]
)
def test_a_window_of_w_over_n_tokens_plans_exactly_the_tiles_it_needs(causal, tokens, window, chunk):
    """With consecutive positions, the planned tiles are exactly those with an allowed (query, key) pair."""
    cfg = MHAConfig(d_model=6, n_heads=2, causal=causal, window=window)
    x = np.random.default_rng(tokens).standard_normal((1, tokens, 6))
    prepared, _ = get_backend("numpy").prepare(cfg, init_params(cfg), x, strategy=CHUNKED, chunk=chunk)
    i, j = np.arange(tokens)[:, None], np.arange(tokens)[None, :]
    allowed = (j > i - window) & (j <= i) if causal else np.abs(i - j) < window
    counts = prepared.info["tiles"]
    assert counts["planned"] == _tiles_with_an_allowed_pair(allowed, chunk)
    n_tiles = -(-tokens // chunk[0]) * -(-tokens // chunk[1])
    assert counts["total"] == n_tiles == counts["planned"] + counts["above_diagonal"] + counts["outside_window"]
    assert (counts["above_diagonal"] > 0) == causal
    assert np.max(np.abs(prepared.to_numpy(prepared.forward()) - reference_mha(cfg, init_params(cfg), x))) < 1e-13


def test_the_window_plan_reads_the_positions_of_each_batch_item():
    """Blocks of 2 over 10 tokens, a causal window of 3: 15 tiles on or below the diagonal, 10 above.

    Item 0 at positions 0..9 may skip the tiles two or more blocks back: (2, 0), (3, 0), (3, 1),
    (4, 0), (4, 1), (4, 2) by (query block, key block). Item 1 at 0..3 then 20..25 (a jump of 17
    between blocks 1 and 2) may skip those and (2, 1) too. Alone, item 1 skips 7 tiles; in a batch
    with item 0 a tile is skipped only when both may skip it: 6.
    """
    cfg = MHAConfig(d_model=6, n_heads=2, causal=True, window=3)
    params = init_params(cfg)
    x = np.random.default_rng(6).standard_normal((2, 10, 6))
    item_1 = np.r_[0:4, 20:26]
    for xs, positions, skipped in ((x[1:], item_1[None], 7), (x, np.stack([np.arange(10), item_1]), 6)):
        prepared, _ = get_backend("numpy").prepare(cfg, params, xs, strategy=CHUNKED, chunk=2, positions=positions)
        expected = {"total": 25, "above_diagonal": 10, "outside_window": skipped, "planned": 15 - skipped}
        assert prepared.info["tiles"] == expected
        reference = reference_mha(cfg, params, xs, positions=positions)
        assert np.max(np.abs(prepared.to_numpy(prepared.forward()) - reference)) < 1e-13


@pytest.mark.parametrize(
    "cfg",
    [
        MHAConfig(d_model=12, n_heads=3, softcap=1.2, alibi=True, causal=True),
        MHAConfig(d_model=12, n_heads=4, n_kv_heads=2, rel_buckets=8, rel_max_distance=6, sinks=True, bias="qkv"),
        MHAConfig(d_model=12, n_heads=2, rel_buckets=6, rel_max_distance=5, rel_bidirectional=False, causal=True,
                  window=3, softcap=0.8, alibi=True),
        MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=4, qk_norm="projection", rope="half", sinks=True,
                  window=2),
    ],
    ids=["softcap_alibi", "t5_sinks_gqa", "everything_on_the_scores", "qk_norm_sinks_window"],
)  # fmt: skip
@pytest.mark.parametrize("chunk", [(3, 2), (1, 4), (8, 8)])
def test_softcap_biases_and_sinks_in_the_tiles_match_the_oracle(cfg, chunk):
    """At positions that start at 4 and 9 (the tiles' bias reads them), cross-attention with padding."""
    rng = np.random.default_rng(7)
    x, kv = rng.standard_normal((2, 7, cfg.d_model)), rng.standard_normal((2, 6, cfg.kdim))
    positions = np.array([np.arange(4, 11), np.arange(9, 16)])
    kv_positions = np.array([np.arange(3, 9), np.arange(10, 16)])
    mask = np.ones((2, 1, 7, 6), dtype=bool)
    mask[1, :, :, 4:] = False  # item 1's last two keys are padding
    params = init_params(cfg, seed=8)
    where = {"positions": positions, "kv_positions": kv_positions}
    expected = reference_mha(cfg, params, x, kv, kv, mask, **where)
    output = get_backend("numpy").run(cfg, params, x, kv, kv, mask, strategy=CHUNKED, chunk=chunk, **where)
    assert np.max(np.abs(output - expected)) < 1e-13


def test_sinks_give_a_row_with_nothing_to_attend_to_a_zero_context():
    """A query whose keys are all masked: the sink takes its whole row, the context is zero, the output b_o."""
    cfg = MHAConfig(d_model=8, n_heads=2, sinks=True)
    params = init_params(cfg, seed=9)
    x = np.random.default_rng(9).standard_normal((1, 5, 8))
    mask = np.ones((1, 1, 5, 5), dtype=bool)
    mask[0, 0, 2] = False  # query 2 sees nothing
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        output = get_backend("numpy").run(cfg, params, x, mask=mask, strategy=CHUNKED, chunk=2)
    np.testing.assert_allclose(output[0, 2], params.b_o, rtol=1e-14, atol=1e-15)
    assert np.max(np.abs(output - reference_mha(cfg, params, x, mask=mask))) < 1e-13


def test_numpy_chunked_with_a_score_bias_stays_linear_in_memory():
    """ALiBi, a softcap and sinks are computed per tile: the (H, N, N) bias is never held."""
    cfg = MHAConfig(d_model=16, n_heads=2, alibi=True, softcap=5.0, sinks=True, causal=True, window=128)
    params = init_params(cfg)

    def peak_bytes(tokens: int) -> int:
        x = np.random.default_rng(2).standard_normal((1, tokens, 16))
        tracemalloc.start()
        prepared, _ = get_backend("numpy").prepare(cfg, params, x, dtype="float32", strategy=CHUNKED, chunk=64)
        prepared.forward()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    small = peak_bytes(1024)
    assert small < 2 * 1024 * 1024 * 4 / 8  # far below the (H, N, N) float32 bias or scores (8 MiB)
    assert peak_bytes(2048) < 2.5 * small


@st.composite
def variant_chunked_examples(draw):
    """A drawn configuration with the score-side variants switched on at random, odd blocks, shifted positions."""
    n_kv = draw(st.integers(1, 2))
    buckets = draw(st.sampled_from([None, 4, 6]))
    cfg = MHAConfig(
        d_model=6,
        n_heads=n_kv * draw(st.integers(1, 3)),
        n_kv_heads=n_kv,
        d_k=draw(st.integers(1, 3)),
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([None, 1, 2, 4, 9])),
        softcap=draw(st.sampled_from([None, 0.5, 3.0])),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        rel_buckets=buckets,
        rel_max_distance=5,
        rel_bidirectional=draw(st.booleans()),
    )
    rng = np.random.default_rng(draw(st.integers(0, 100)))
    x = rng.standard_normal((2, 7, 6))
    offsets = draw(st.sampled_from([(0, 0), (3, 11)]))
    positions = np.arange(7)[None] + np.array(offsets)[:, None]  # (2, 7): items start at their offsets
    mask = rng.random((2, 1, 7, 7)) < 0.8 if draw(st.booleans()) else None
    chunk = (draw(st.sampled_from([1, 2, 3, 5])), draw(st.sampled_from([1, 2, 4, 7])))
    return cfg, x, positions, mask, chunk


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(example=variant_chunked_examples())
def test_property_numpy_chunked_variants_agree_with_the_oracle(example):
    cfg, x, positions, mask, chunk = example
    params = init_params(cfg, seed=1)
    expected = reference_mha(cfg, params, x, mask=mask, positions=positions)
    output = get_backend("numpy").run(cfg, params, x, mask=mask, strategy=CHUNKED, chunk=chunk, positions=positions)
    result = compare(output, expected, "float64", atol=1e-12, rtol=1e-12)
    assert result.ok, f"{cfg.describe()} chunk={chunk}: {result.summary()}"
