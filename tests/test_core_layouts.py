"""Every converter between the canonical layout and the layouts users meet: exact round trips."""

import inspect

import numpy as np
import pytest

import mha_rosetta.core
from conftest import requires
from mha_rosetta.core import MHAConfig, assert_close, init_params, layouts, reference_stages

CROSS = MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=13)
SELF = MHAConfig(d_model=15, n_heads=3)


def test_every_converter_is_public():
    """The converters are the public contract: each function of `core.layouts` is exported by `mha_rosetta.core`
    (the tests below call them through their module)."""
    converters = [n for n, f in vars(layouts).items() if inspect.isfunction(f) and f.__module__ == layouts.__name__]
    public = [name for name in converters if not name.startswith("_")]
    assert len(public) == 17 and "to_torch_mha_state_dict" in public and "from_equinox_weights" in public
    assert all(getattr(mha_rosetta.core, name) is getattr(layouts, name) for name in public)
    assert set(public) <= set(mha_rosetta.core.__all__)


def _params_equal(a, b):
    for name, value in a.as_dict().items():
        other = b.as_dict()[name]
        if value is None:
            assert other is None, name
        else:
            assert np.array_equal(value, other), name


def test_column_and_row_samples_compute_the_same_numbers(rng):
    # Seed claim 1: Y_A = W_A @ X_col and Y_B = X_row @ W_B with W_B = W_A.T, Y_B = Y_A.T.
    w_a = rng.standard_normal((4, 6))  # 4 scorers (rows) of 6 features
    x_col = rng.standard_normal((6, 9))  # 9 samples as columns
    y_a = w_a @ x_col
    y_b = x_col.T @ layouts.to_row_sample(w_a)
    assert_close(y_b, y_a.T)
    assert np.array_equal(layouts.from_row_sample(layouts.to_row_sample(w_a)), w_a)


def test_per_head_matrices_side_by_side_equal_the_merged_matrix(rng):
    p = init_params(SELF, seed=1)
    per_head = layouts.split_head_matrices(p.w_q, 3)  # (H, D, Dk)
    assert per_head.shape == (3, 15, 5)
    x = rng.standard_normal((7, 15))
    merged_out = x @ p.w_q.T  # (N, H*Dk)
    per_head_out = np.concatenate([x @ per_head[h] for h in range(3)], axis=1)
    assert_close(per_head_out, merged_out)
    assert np.array_equal(layouts.merge_head_matrices(per_head), p.w_q)


def test_output_matrix_blocks_round_trip(rng):
    p = init_params(SELF, seed=1)
    blocks = layouts.split_output_matrix(p.w_o, 3)  # (H, Dv, D)
    assert blocks.shape == (3, 5, 15)
    assert np.array_equal(layouts.merge_output_matrix(blocks), p.w_o)
    c = rng.standard_normal((7, 15))  # merged heads
    assert_close(sum(c[:, 5 * h : 5 * (h + 1)] @ blocks[h] for h in range(3)), c @ p.w_o.T)


@pytest.mark.parametrize(
    "cfg", [SELF, CROSS, MHAConfig(d_model=15, n_heads=3, bias=False)], ids=["packed", "separate", "no-bias"]
)
def test_torch_mha_state_dict_round_trip(cfg):
    p = init_params(cfg, seed=4)
    state = layouts.to_torch_mha_state_dict(cfg, p)
    if cfg.is_self_attention_shaped:
        assert state["in_proj_weight"].shape == (45, 15)
        assert np.array_equal(state["in_proj_weight"][15:30], p.w_k)  # q;k;v order
    else:
        assert state["k_proj_weight"].shape == (15, 11) and state["v_proj_weight"].shape == (15, 13)
    assert ("in_proj_bias" in state) == cfg.bias
    _params_equal(layouts.from_torch_mha_state_dict(cfg, state), p)


@pytest.mark.parametrize(
    ("cfg", "fragment"),
    [
        (MHAConfig(d_model=12, n_heads=6, n_kv_heads=2), "no grouped kv heads"),
        (MHAConfig(d_model=12, n_heads=3, d_k=5), "d_k = d_v = embed_dim / num_heads"),
        (MHAConfig(d_model=12, n_heads=3, scale=1.0), "scales by 1/sqrt"),
    ],
)
def test_torch_mha_refuses_configs_it_cannot_hold(cfg, fragment):
    assert fragment in layouts.torch_mha_unsupported_reason(cfg)
    with pytest.raises(ValueError, match="cannot express"):
        layouts.to_torch_mha_state_dict(cfg, init_params(cfg))


def test_flax_keras_kernels_round_trip_and_compute_the_projection(rng):
    cfg = MHAConfig(d_model=15, n_heads=3, d_v=4, kdim=11, vdim=13)
    p = init_params(cfg, seed=6)
    tree = layouts.to_flax_params(cfg, p)
    assert tree["query"]["kernel"].shape == (15, 3, 5)
    assert tree["value"]["kernel"].shape == (13, 3, 4)
    assert tree["value"]["bias"].shape == (3, 4)
    assert tree["out"]["kernel"].shape == (3, 4, 15)
    _params_equal(layouts.from_flax_params(cfg, tree), p)
    x = rng.standard_normal((2, 7, 15))
    stages = reference_stages(cfg, p, x, rng.standard_normal((2, 5, 11)), rng.standard_normal((2, 5, 13)))
    # DenseGeneral: einsum('bnd,dhk->bnhk') + bias gives the split heads directly, (B, N, H, Dk).
    q = np.einsum("bnd,dhk->bnhk", x, tree["query"]["kernel"]) + tree["query"]["bias"]
    assert_close(q.transpose(0, 2, 1, 3), stages["q_heads"])
    assert np.array_equal(layouts.from_dense_general_kernel(layouts.to_dense_general_kernel(p.w_k, 3)), p.w_k)


def test_equinox_weights_are_canonical_under_other_names():
    p = init_params(CROSS, seed=8)
    weights = layouts.to_equinox_weights(CROSS, p)
    assert np.array_equal(weights["key_proj"]["weight"], p.w_k)
    _params_equal(layouts.from_equinox_weights(CROSS, weights), p)


def test_params_from_another_config_are_rejected():
    with pytest.raises(ValueError, match=r"params.w_k has shape \(15, 15\), expected \(15, 11\)"):
        layouts.to_torch_mha_state_dict(CROSS, init_params(SELF))


@requires("torch")
def test_state_dict_loads_into_real_torch_module_and_back():
    import torch

    module = torch.nn.MultiheadAttention(15, 3, kdim=11, vdim=13, batch_first=True)
    p = layouts.from_torch_mha_state_dict(CROSS, module.state_dict())
    assert p.w_k.shape == (15, 11)
    state = layouts.to_torch_mha_state_dict(CROSS, p)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    for name, tensor in module.state_dict().items():
        assert np.array_equal(tensor.numpy(), state[name]), name
