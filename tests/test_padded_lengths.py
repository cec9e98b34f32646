"""seq_lens on a right-padded batch: real rows equal each row's own forward; padding rows are defined (b_o)."""

import numpy as np
import pytest

from mha_rosetta.backends import available_backends, get_backend
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha
from mha_rosetta.core.ragged import RaggedBatch, pack_rows, unpack_rows

SEQ_LENS = [5, 0, 1, 7]  # an empty row, a one-token row, a full row (N = 7)
CFG = MHAConfig(d_model=15, n_heads=3, d_k=6, causal=True, rope="half", bias=True)


def _padded_inputs(cfg, seed=4):
    x = np.random.default_rng(seed).standard_normal((len(SEQ_LENS), 7, cfg.d_model))
    return init_params(cfg, seed=3), x


@pytest.mark.parametrize(
    "config",
    [CFG, MHAConfig(d_model=15, n_heads=3, alibi=True, bias=True), MHAConfig(d_model=14, n_heads=2, window=2)],
    ids=["causal_rope", "alibi", "two_sided_window"],
)
def test_real_rows_equal_each_rows_forward_and_padding_rows_are_b_o(config):
    params, x = _padded_inputs(config)
    out = reference_mha(config, params, x, seq_lens=SEQ_LENS)
    for b, length in enumerate(SEQ_LENS):
        if length:
            np.testing.assert_allclose(out[b, :length], reference_mha(config, params, x[b, :length]), rtol=1e-12)
        b_o = np.zeros(config.d_model) if params.b_o is None else params.b_o
        np.testing.assert_array_equal(out[b, length:], np.broadcast_to(b_o, (7 - length, config.d_model)))
    # Padding keys are never read: new values there change no real row.
    noisy = x.copy()
    noisy[~RaggedBatch(SEQ_LENS).padding_mask(7)] = 1e3
    np.testing.assert_array_equal(reference_mha(config, params, noisy, seq_lens=SEQ_LENS), out)


def test_padded_equals_packed():
    params, x = _padded_inputs(CFG)
    batch = RaggedBatch(SEQ_LENS)
    packed = reference_mha(CFG, params, pack_rows(batch, x), cu_seqlens=batch.cu_seqlens())  # (T, d_model)
    padded = reference_mha(CFG, params, x, seq_lens=SEQ_LENS)
    np.testing.assert_allclose(pack_rows(batch, padded), packed, rtol=1e-12, atol=1e-13)
    restored = unpack_rows(batch, packed, tokens=7, fill=np.nan)
    real = batch.padding_mask(7)
    np.testing.assert_allclose(restored[real], padded[real], rtol=1e-12, atol=1e-13)


def test_weights_zero_on_padding_and_cross_attention_kv_lengths():
    cfg = MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=13)
    params = init_params(cfg, seed=5)
    rng = np.random.default_rng(6)
    q, kv = rng.standard_normal((2, 4, 15)), rng.standard_normal((2, 6, 11))
    value = rng.standard_normal((2, 6, 13))
    _, weights = reference_mha(cfg, params, q, kv, value, seq_lens=[4, 2], kv_seq_lens=[3, 6], return_weights=True)
    assert np.all(weights[0, :, :, 3:] == 0) and np.all(weights[1, :, 2:] == 0)
    np.testing.assert_allclose(weights[0].sum(-1), 1.0, rtol=1e-12)
    expected = reference_mha(cfg, params, q[:1], kv[:1, :3], value[:1, :3])
    out = reference_mha(cfg, params, q, kv, value, seq_lens=[4, 2], kv_seq_lens=[3, 6])
    np.testing.assert_allclose(out[:1], expected, rtol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(seq_lens=[5, 0, 8, 7]), r"seq_lens must be <= N=7 .* seq_lens\[2\]=8"),
        (dict(seq_lens=[5, 0, 1]), "seq_lens must have one length per row, B=4, got 3"),
        (dict(seq_lens=[5, 0, 1, 7], cu_seqlens=[0, 28]), "packed .* or padded .*, not both"),
    ],
)
def test_bad_lengths(kwargs, match):
    params, x = _padded_inputs(CFG)
    with pytest.raises(ValueError, match=match):
        reference_mha(CFG, params, x, **kwargs)
    with pytest.raises(ValueError, match="seq_lens needs a padded batch"):
        reference_mha(CFG, params, x[0], seq_lens=[3])


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax", "einops-numpy", "einops-torch", "einops-jax"])
def test_backends_take_seq_lens(backend):
    if backend not in available_backends():
        pytest.skip(f"{backend} is not installed")
    params, x = _padded_inputs(CFG)
    expected = reference_mha(CFG, params, x, seq_lens=SEQ_LENS)
    out = get_backend(backend).run(CFG, params, x, seq_lens=SEQ_LENS, dtype="float32")
    assert np.isfinite(out).all()  # padding rows defined: b_o, not NaN
    assert_close(out, expected, "float32", what=f"{backend} seq_lens")
