"""Packed sequences: the spec and every backend equal the per-document forward, concatenated."""

import itertools

import numpy as np
import pytest

from mha_rosetta.backends import UnsupportedCase, available_backends, get_backend
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha
from mha_rosetta.core.ragged import RaggedBatch

# A zero-length and a one-token document among them; T = 13.
LENGTHS = [4, 0, 1, 6, 2]
CONFIGS = {
    "causal_rope": dict(d_model=15, n_heads=3, d_k=6, causal=True, rope="half"),
    "plain": dict(d_model=15, n_heads=3),
    "gqa_interleaved": dict(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="interleaved"),
    "alibi": dict(d_model=15, n_heads=3, causal=True, alibi=True),
    "window": dict(d_model=14, n_heads=2, causal=True, window=3),
    "rel_bias": dict(d_model=16, n_heads=4, d_k=5, bias=False, rel_buckets=8, rel_max_distance=5),
    "sinks": dict(d_model=20, n_heads=5, causal=True, sinks=True),
}


def _per_document(cfg, params, x, lengths):
    cu = RaggedBatch(lengths).cu_seqlens()
    parts = [reference_mha(cfg, params, x[a:b]) for a, b in itertools.pairwise(cu) if b > a]
    return np.concatenate(parts)  # (T, d_model)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reference_equals_per_document_forward(name):
    cfg = MHAConfig(**CONFIGS[name])
    params = init_params(cfg, seed=3)
    batch = RaggedBatch(LENGTHS)
    x = np.random.default_rng(4).standard_normal((batch.total, cfg.d_model))
    expected = _per_document(cfg, params, x, LENGTHS)
    packed = reference_mha(cfg, params, x, cu_seqlens=batch.cu_seqlens())
    assert packed.shape == (13, cfg.d_model)
    np.testing.assert_allclose(packed, expected, rtol=1e-12, atol=1e-12)
    batched = reference_mha(cfg, params, x[None], cu_seqlens=batch.cu_seqlens())
    assert batched.shape == (1, 13, cfg.d_model)
    np.testing.assert_array_equal(batched[0], packed)
    # Hugging Face's spelling: the packed position_ids (the zero-length document leaves no trace).
    from_positions = reference_mha(cfg, params, x[None], position_ids=batch.position_ids(drop_empty=True)[None])
    np.testing.assert_array_equal(from_positions, batched)


def test_packing_changes_the_result():
    # The test above could not fail if the document mask did nothing: one causal row differs.
    cfg = MHAConfig(**CONFIGS["causal_rope"])
    params = init_params(cfg, seed=3)
    x = np.random.default_rng(4).standard_normal((13, cfg.d_model))
    packed = reference_mha(cfg, params, x, cu_seqlens=RaggedBatch(LENGTHS).cu_seqlens())
    plain = reference_mha(cfg, params, x)
    assert np.allclose(packed[:4], plain[:4]) and not np.allclose(packed[4:], plain[4:])


def test_user_mask_is_anded_and_weights_stay_in_documents():
    cfg = MHAConfig(d_model=15, n_heads=3)
    params = init_params(cfg, seed=1)
    batch = RaggedBatch([3, 2])
    x = np.random.default_rng(2).standard_normal((5, 15))
    _out, weights = reference_mha(cfg, params, x, cu_seqlens=batch.cu_seqlens(), return_weights=True)
    assert weights.shape == (3, 5, 5)
    assert np.all(weights[:, :3, 3:] == 0) and np.all(weights[:, 3:, :3] == 0)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-12)
    keep_first = np.zeros((5, 5), dtype=bool)
    keep_first[:, [0, 3]] = True  # each query may see only its document's first key
    masked = reference_mha(cfg, params, x, mask=keep_first, cu_seqlens=batch.cu_seqlens())
    np.testing.assert_allclose(masked[:3], reference_mha(cfg, params, x[:3], mask=keep_first[:3, :3]), rtol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(cu_seqlens=[0, 5, 4, 13]), ValueError, "non-decreasing"),
        (dict(cu_seqlens=[0, 5, 12]), ValueError, r"cu_seqlens\[-1\] must equal T=13"),
        (dict(cu_seqlens=[0, 13], position_ids=np.arange(13)), ValueError, "cu_seqlens or position_ids, not both"),
        (dict(position_ids=np.arange(12)), ValueError, "position_ids must have T=13 entries"),
        (dict(cu_seqlens=[0, 13], positions=np.arange(13)), ValueError, "positions come from the packing"),
        (dict(cu_seqlens=[0, 13], key=np.zeros((13, 15))), ValueError, "packed call is self-attention"),
    ],
)
def test_bad_packed_calls(kwargs, error, match):
    cfg = MHAConfig(d_model=15, n_heads=3)
    params = init_params(cfg, seed=0)
    x = np.zeros((13, 15))
    with pytest.raises(error, match=match):
        reference_mha(cfg, params, x, **kwargs)
    with pytest.raises(ValueError, match="packed query must have shape"):
        reference_mha(cfg, params, np.zeros((2, 13, 15)), cu_seqlens=[0, 13])


BACKENDS = ("numpy", "torch", "jax", "einops-numpy", "einops-torch", "einops-jax")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["causal_rope", "alibi", "window"])
def test_backends_run_packed(backend, name):
    if backend not in available_backends():
        pytest.skip(f"{backend} is not installed")
    cfg = MHAConfig(**CONFIGS[name])
    params = init_params(cfg, seed=3)
    batch = RaggedBatch(LENGTHS)
    x = np.random.default_rng(4).standard_normal((1, batch.total, cfg.d_model))
    expected = _per_document(cfg, params, x[0], LENGTHS)[None]
    out = get_backend(backend).run(cfg, params, x, cu_seqlens=batch.cu_seqlens(), dtype="float32")
    assert out.shape == (1, 13, cfg.d_model)
    assert_close(out, expected, "float32", what=f"{backend} packed {name}")


def test_an_implementation_without_the_form_refuses_the_packed_call():
    # Equinox's rotary always reads positions 0..N-1: packing restarts them, so it must refuse, not run.
    if "equinox" not in available_backends():
        pytest.skip("equinox is not installed")
    cfg = MHAConfig(**CONFIGS["causal_rope"])
    x = np.zeros((13, cfg.d_model))
    with pytest.raises(UnsupportedCase, match="positions differ"):
        get_backend("equinox").run(cfg, init_params(cfg, seed=0), x, cu_seqlens=RaggedBatch(LENGTHS).cu_seqlens())


def test_seq_lens_longer_than_the_rows_are_refused_by_the_spec_and_every_backend():
    cfg = MHAConfig(d_model=15, n_heads=3)
    params, x = init_params(cfg, seed=0), np.zeros((2, 4, 15))
    with pytest.raises(ValueError, match=r"seq_lens must be <= N=4 \(the padded row length\), got seq_lens\[1\]=5"):
        reference_mha(cfg, params, x, seq_lens=[2, 5])
    for name in available_backends():
        with pytest.raises(ValueError, match=r"seq_lens must be <= N=4 .* got seq_lens\[1\]=5"):
            get_backend(name).run(cfg, params, x, seq_lens=[2, 5])


def test_a_backend_that_masks_on_indices_refuses_a_packed_call_saying_it_is_packed():
    # Its refusal said "a decode step: queries after cached keys" for a packed call (issue 47): now it says the
    # positions restart per document.
    pytest.importorskip("transformers", reason="hf-attention needs transformers (the models extra)")
    cfg = MHAConfig(d_model=16, n_heads=4, causal=True, rope="half", bias=False)
    with pytest.raises(UnsupportedCase, match=r"hf-attention masks on .* these positions restart per document "):
        get_backend("hf-attention").run(
            cfg, init_params(cfg, seed=0), np.zeros((7, 16)), dtype="float32", cu_seqlens=[0, 3, 7]
        )
