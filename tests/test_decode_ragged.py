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
