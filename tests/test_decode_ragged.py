"""Ragged decode (issue 47): rows of one batch at different lengths decode together, each at its own position.

Continuous batching in lockstep: row ``b`` joins where its tokens start (left padding, positions
``cumsum(mask) - 1``), so at every step the rows sit at different positions. The property: each
row's outputs equal that row decoded alone (batch 1, no padding, positions from 0), through every
convention's contiguous and paged caches; a zero-length row is an idle slot whose outputs are
defined (zero context: the output bias).
"""

import importlib.util

import numpy as np
import pytest

from mha_rosetta.backends import get_backend
from mha_rosetta.core import MHAConfig, assert_close, init_params
from mha_rosetta.core.decode import reference_decode

CFG = MHAConfig(d_model=20, n_heads=4, n_kv_heads=2, d_k=6, causal=True, rope="half", window=6, bias=True)
LENGTHS = (9, 0, 2, 5)  # a full row, an idle one, a late short one and one in between
N = 9
NEEDS = {"numpy": None, "torch": "torch", "jax": "jax", "einops-numpy": "einops", "einops-jax": "jax", "mlx": "mlx"}
RUNS = [
    pytest.param(backend, cache, id=f"{backend}-{cache}")
    for backend, module in NEEDS.items()
    if module is None or importlib.util.find_spec(module) is not None
    for cache in get_backend(backend).decode_caches
]


def _batch():
    x = np.random.default_rng(8).standard_normal((len(LENGTHS), N, CFG.d_model))
    mask = np.arange(N)[None, :] >= N - np.asarray(LENGTHS)[:, None]  # (B, N): row b's last L_b tokens are real
    return init_params(CFG, seed=9), x, mask


def test_the_rows_sit_at_their_own_positions_and_the_spec_decodes_each_as_if_alone():
    params, x, mask = _batch()
    positions = np.cumsum(mask, axis=1) - 1  # what prepare_decode_inputs derives from the mask
    assert positions[:, -1].tolist() == [8, -1, 1, 4]  # the last step: four rows at four positions
    together = reference_decode(CFG, params, x, prefill=3, step=2, mask=mask)
    for b, length in enumerate(LENGTHS):
        if length:
            alone = reference_decode(CFG, params, x[b, N - length :], prefill=1)
            np.testing.assert_allclose(together[b, N - length :], alone, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(together[1], np.broadcast_to(params.b_o, (N, CFG.d_model)), rtol=0, atol=1e-15)


@pytest.mark.parametrize(("backend", "cache"), RUNS)
def test_each_row_of_a_ragged_batch_equals_the_row_decoded_alone(backend, cache):
    params, x, mask = _batch()
    options = {"cache": cache, **({"page_size": 2, "page_seed": 4} if cache == "paged" else {})}
    impl = get_backend(backend)
    prepared, _ = impl.prepare_decode_run(CFG, params, x, prefill=3, step=2, mask=mask, **options)
    together = prepared.output()
    level = prepared.info.get("tolerance_dtype", "float64")  # the level it declares (MLX's float64: float32's)
    run = impl.run_decode
    for b, length in enumerate(LENGTHS):
        if length:
            alone = run(CFG, params, x[b, N - length :], prefill=1, step=2, **options)
            assert_close(together[b, N - length :], alone, level, what=f"{backend}[{cache}] row {b} against alone")
    assert_close(together[1], np.broadcast_to(params.b_o, (N, CFG.d_model)), level, what="the idle row: output b_o")


# -- the timed step of a ragged batch (bench --mode decode's ragged row) ------------------------------------------
# Every convention that decodes ragged batches times a ragged step too: row b's cached tokens the last lengths[b]
# of the cache's max(lengths) slots, its pads invalid, its step at its own position.
TIMED = {"numpy": None, "torch": "torch", "jax": "jax", "einops-numpy": "einops", "einops-torch": "torch", "mlx": "mlx"}
STEP_CFG = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half")
STEP_LENGTHS = (40, 6, 9, 17)  # the longest sets the width (40 slots); pages of 16 holding pads only in rows 1-3
WIDTH = max(STEP_LENGTHS)
TIMED_RUNS = [
    pytest.param(backend, cache, id=f"{backend}-{cache}")
    for backend, module in TIMED.items()
    if (module is None or importlib.util.find_spec(module) is not None)
    and (not backend.startswith("einops") or importlib.util.find_spec("einops") is not None)
    for cache in (get_backend(backend).decode_caches[0], "paged")
]


def _steps(backend, cache, **options):
    params, impl = init_params(STEP_CFG, seed=0), get_backend(backend)
    prepared = impl.prepare_decode(
        STEP_CFG, params, context=WIDTH, batch=4, dtype="float64", cache=cache, seed=3, **options
    )
    return prepared, prepared.to_numpy(prepared.forward())  # (B, 1, D)


@pytest.mark.parametrize(("backend", "cache"), TIMED_RUNS)
def test_a_ragged_step_computes_the_rectangular_steps_token_where_a_row_is_full_and_its_own_elsewhere(backend, cache):
    _, rectangular = _steps(backend, cache)
    prepared, ragged = _steps(backend, cache, lengths=STEP_LENGTHS)
    assert ragged.shape == (4, 1, 16) and np.isfinite(ragged).all()
    # The same seed draws the same cached numbers (the cache is max(lengths) = 40 slots wide either way): the full
    # row is the rectangular step's row, the others see only their own tokens at their own positions.
    assert_close(ragged[0], rectangular[0], "float64", what=f"{backend}[{cache}] the full row")
    for b in (1, 2, 3):
        assert not np.allclose(ragged[b], rectangular[b], rtol=1e-6, atol=1e-9), f"row {b} attended its pads"
    again = prepared.to_numpy(prepared.forward())  # rewound: the same step on the same cache
    np.testing.assert_array_equal(again, ragged)


@pytest.mark.parametrize("backend", [name for name in TIMED if any(run.values[0] == name for run in TIMED_RUNS)])
def test_a_paged_ragged_step_equals_the_contiguous_one_and_its_pads_take_no_page(backend):
    contiguous = get_backend(backend).decode_caches[0]
    _, expected = _steps(backend, contiguous, lengths=STEP_LENGTHS)
    prepared, out = _steps(backend, "paged", lengths=STEP_LENGTHS)
    assert_close(out, expected, "float64", what=f"{backend}'s paged ragged step against {contiguous}")
    info = prepared.info["cache"]
    # Pages of 16 over 41 tokens: 3 a row, 12 in all, when pads took pages. Rows 1-3 hold 6, 9 and 17 tokens after
    # 34, 31 and 23 pads: 2, 1 and 1 pad-only pages, all pointing at the one shared null page; the pool holds no more.
    assert info["pad_only_pages"] == 4 and info["pages_held"] == info["pages"] == 12 - 4 + 1


def test_a_ragged_steps_short_rows_are_the_attention_over_their_own_tokens_by_hand():
    # NumPy's step, rebuilt in float64 from its draws (x, then the cached keys and values, as columns): each row's
    # query at position lengths[b] attends its own lengths[b] cached keys and its new one, nothing else.
    from mha_rosetta.core import reference_stages

    params = init_params(STEP_CFG, seed=0)
    _, out = _steps("numpy", "columns", lengths=STEP_LENGTHS)
    rng = np.random.default_rng(3)
    B, W, H, Hkv, Dk = 4, WIDTH, 4, 2, STEP_CFG.d_k
    x = rng.standard_normal((B, 1, STEP_CFG.d_model))
    keys, values = (rng.standard_normal((B, Hkv, Dk, W)) for _ in range(2))  # (B, Hkv, D, W) columns
    for b, length in enumerate(STEP_LENGTHS):
        stages = reference_stages(STEP_CFG, params, x[b : b + 1], positions=np.array([[length]]))
        q, k, v = stages["q_rotated"][0, :, 0], stages["k_rotated"][0, :, 0], stages["v_heads"][0, :, 0]  # (H|Hkv, D)
        k_all = np.concatenate([keys[b, :, :, W - length :], k[:, :, None]], axis=2)  # (Hkv, Dk, L + 1)
        v_all = np.concatenate([values[b, :, :, W - length :], v[:, :, None]], axis=2)
        g = np.arange(H) // (H // Hkv)  # query head h reads kv head h // group
        scores = np.einsum("hd,hdt->ht", q, k_all[g]) / np.sqrt(Dk)  # (H, L + 1)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        merged = np.einsum("ht,hdt->hd", weights, v_all[g]).reshape(-1)  # (H*Dv,)
        expected = merged @ params.w_o.T + (0 if params.b_o is None else params.b_o)
        np.testing.assert_allclose(out[b, 0], expected, rtol=1e-12, atol=1e-12, err_msg=f"row {b}")


def test_a_ragged_step_refuses_lengths_that_do_not_fit_and_a_backend_without_one():
    from mha_rosetta.backends import UnsupportedCase

    params = init_params(STEP_CFG, seed=0)
    numpy_backend = get_backend("numpy")
    with pytest.raises(ValueError, match=r"context must be max\(lengths\) .* got context=20 and lengths \[21, 6\]"):
        numpy_backend.prepare_decode(STEP_CFG, params, context=20, batch=2, lengths=(21, 6))
    with pytest.raises(ValueError, match=r"lengths must hold one length per row \(batch=3\), got 2"):
        numpy_backend.prepare_decode(STEP_CFG, params, context=21, batch=3, lengths=(21, 6))
    with pytest.raises(ValueError, match=r"lengths must be >= 0"):
        numpy_backend.prepare_decode(STEP_CFG, params, context=21, batch=2, lengths=(21, -1))
    with pytest.raises(UnsupportedCase, match="numpy-best: no timed step of a ragged batch"):
        get_backend("numpy-best").prepare_decode(STEP_CFG, params, context=21, batch=2, lengths=(21, 6))
