"""The chunked (online-softmax, memory-linear) strategy of the numpy, torch and jax adapters.

Against the float64 oracle on the adapter cases (GQA, cross-attention, causal, padding,
rows with nothing to attend to, unbatched), block sizes that do not divide the token
counts, the stages it exposes, causal block skipping counted tile by tile, peak memory
measured with tracemalloc, bad block sizes, and a Hypothesis property over odd blocks.
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
