"""The NumPy adapter's MLA (`backends.numpy.mla`): the oracle comparison catches the mistakes on record.

Each mistake is planted in the adapter's layer (monkeypatched) and must move its output far beyond the float64
tolerance, on a configuration where the mistake runs at all; the layer as written agrees on the same one.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.backends import get_backend
from mha_rosetta.backends.numpy.layer import rotate_rows
from mha_rosetta.backends.numpy.mla import ColumnSampleMLA
from mha_rosetta.core import MHAConfig, init_params, reference_mha
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE


def _error(cfg, strategy, seed=3) -> float:
    """The adapter's largest difference from the oracle, relative to the output's largest entry."""
    params = init_params(cfg, seed=seed)
    x = np.random.default_rng(seed).standard_normal((2, 6, cfg.d_model))
    ref = reference_mha(cfg, params, x)
    out = get_backend("numpy").run(cfg, params, x, strategy=strategy, dtype="float64")
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def test_w_uk_transposed_in_the_absorbed_form_is_caught(monkeypatch):
    """mlx-lm #1715, Megatron-LM #3193: W_UK_h read (R, dn) instead of (dn, R); it runs only where dn == R."""
    cfg = MHAConfig(**dict(DEEPSEEK_V2_LITE_LIKE, kv_lora_rank=3))  # qk_nope_head_dim 3 == kv_lora_rank 3
    assert _error(cfg, "absorbed") < 1e-12

    def transposed(self, q_nope, q_rot):
        H, dn, R = cfg.n_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_latent = np.matmul(self.w_uk.reshape(H, dn, R), q_nope)  # W_UK_h itself where W_UK_h^T belongs
        return np.concatenate([q_latent, q_rot], axis=-2)

    monkeypatch.setattr(ColumnSampleMLA, "absorbed_queries", transposed)
    assert _error(cfg, "absorbed") > 1e-3


def test_the_value_head_size_taken_from_the_key_is_caught(monkeypatch):
    """llama.cpp #7327: each head's values read at the key head's stride (d_k rows a head, not v_head_dim)."""
    cfg = MHAConfig(**dict(DEEPSEEK_V2_LITE_LIKE, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=6, n_heads=4))
    assert cfg.d_k == 4 and cfg.d_v == 6
    assert _error(cfg, "naive") < 1e-12
    expand = ColumnSampleMLA.expand

    def key_stride(self, kv_latent):
        k_nope, v = expand(self, kv_latent)
        B, H, dv, T = v.shape
        rows = v.reshape(B, H * dv, T)  # (B, H*dv, T) view
        dk = self.cfg.d_k
        return k_nope, np.stack([rows[:, h * dk : h * dk + dv] for h in range(H)], axis=1)  # head h at h*d_k

    monkeypatch.setattr(ColumnSampleMLA, "expand", key_stride)
    assert _error(cfg, "naive") > 1e-3


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_the_shared_rotary_key_rotated_per_head_is_caught(monkeypatch, form):
    """The one k_rope every head shares, turned by a different angle in each head (0 in head 0, 0.5 h after)."""
    cfg = MHAConfig(**DEEPSEEK_V3_LIKE)
    assert _error(cfg, form) < 1e-12
    scores = ColumnSampleMLA.scores

    def per_head(self, form, q, kv_latent, k_rope, keys=None):
        H, (B, dr, T) = self.cfg.n_heads, k_rope.shape
        angle = 0.5 * np.arange(H)[None, :, None, None] * np.ones((1, H, dr // 2, T))  # (1, H, dr/2, T)
        turned = rotate_rows(
            np.broadcast_to(k_rope[:, None], (B, H, dr, T)), np.cos(angle), np.sin(angle), self.cfg.rope, self.precision
        )
        right = scores(self, form, q, kv_latent, k_rope)
        # The rotary part of each head's scores against its own turned key instead of the shared one.
        own = np.matmul(turned.swapaxes(-1, -2), q["q_rot"]) - np.matmul(k_rope[:, None].swapaxes(-1, -2), q["q_rot"])
        return right + self.cfg.scale * own

    monkeypatch.setattr(ColumnSampleMLA, "scores", per_head)
    assert _error(cfg, form) > 1e-3


def test_the_strategies_are_listed_and_selectable_by_name():
    backend = get_backend("numpy")
    assert ("naive", "absorbed") == backend.strategies[-2:]
    assert {"naive", "absorbed"} <= set(backend.decode_strategies)
    info = backend.prepare(
        MHAConfig(**DEEPSEEK_V3_LIKE),
        init_params(MHAConfig(**DEEPSEEK_V3_LIKE), seed=0),
        np.zeros((1, 3, 24)),
        strategy="absorbed",
    )[0].info
    assert info["strategy"] == "absorbed" and "multi-query attention" in info["form"]
