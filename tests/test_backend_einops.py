"""The einops adapter on NumPy, torch and JAX arrays against the float64 oracle.

Also proves the convention itself: the adapter's source calls no transpose, permute,
swapaxes, moveaxis or ``.T`` (checked on the syntax tree, so comments do not count).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from functools import partial

import numpy as np
import pytest
from adapter_cases import random_inputs

from conftest import BATCH, D_MODEL, HEADS, Q_TOKENS, requires
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha, reference_stages

pytestmark = requires("einops")


def _library_param(library: str):
    marks = [] if library == "numpy" else [requires(library)]
    return pytest.param(library, marks=marks, id=library)


LIBRARIES = [_library_param(name) for name in ("numpy", "torch", "jax")]

CASES = {
    "self": MHAConfig(d_model=D_MODEL, n_heads=HEADS),
    # cross-attention: key/value of other widths and token count, d_v != d_k
    "cross": MHAConfig(d_model=16, n_heads=HEADS, d_k=6, d_v=4, kdim=11, vdim=9),
    "gqa_causal": MHAConfig(d_model=18, n_heads=6, n_kv_heads=2, causal=True),  # 6 query heads on 2 kv heads
    "no_bias_scale": MHAConfig(d_model=D_MODEL, n_heads=HEADS, bias=False, scale=0.37),
}


# Batch item 0 has its last two keys padded unless padding=False.
make_inputs = partial(random_inputs, padding=True, padded_item=0)


def backend_for(library: str):
    from mha_rosetta.backends import get_backend

    return get_backend(f"einops-{library}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("library", LIBRARIES)
def test_half_precision_matches_reference(library, dtype):
    cfg = CASES["cross"]
    params = init_params(cfg, seed=2)
    query, key, value, mask = make_inputs(cfg, cross=True)
    prepared, _ = backend_for(library).prepare(cfg, params, query, key, value, mask, dtype=dtype)
    result = prepared.forward()
    assert str(result.dtype).endswith(dtype)  # "float16", "torch.float16", "bfloat16"
    assert_close(prepared.to_numpy(result), reference_mha(cfg, params, query, key, value, mask), dtype)
    if library == "numpy":  # the NumPy adapter's policy: stored in the half type, computed in float32, and said so
        assert (prepared.info["storage_dtype"], prepared.info["compute_dtype"]) == (dtype, "float32")
        assert "float32" in prepared.info["rounding"]


@pytest.mark.parametrize("library", LIBRARIES)
def test_every_stage_equals_the_reference_stage(library):
    """GQA with a per-head mask and an empty row: every stage, in canonical layout."""
    cfg = CASES["gqa_causal"]
    params = init_params(cfg, seed=3)
    query = np.random.default_rng(3).standard_normal((BATCH, Q_TOKENS, cfg.d_model))
    mask = np.ones((BATCH, cfg.n_heads, Q_TOKENS, Q_TOKENS), dtype=bool)  # (B, H, Nq, Nk): per head
    mask[1, 5, :, 1:] = False  # head 5 of item 1 sees key 0 only
    mask[0, 2, 4, :] = False  # query 4 of head 2, item 0, may attend to nothing
    out, stages = backend_for(library).run(cfg, params, query, mask=mask, return_stages=True)
    expected = reference_stages(cfg, params, query, mask=mask)
    assert sorted(stages) == sorted(expected)
    for name, value in expected.items():
        assert_close(stages[name], value, "float64", what=f"einops-{library} stage {name}")
    assert_close(out, expected["output"], "float64")


@pytest.mark.parametrize("library", LIBRARIES)
def test_empty_row_gives_zero_weights_and_bias_output(library):
    cfg = CASES["self"]
    params = init_params(cfg, seed=4)
    query, _, _, _ = make_inputs(cfg, cross=False, padding=False)
    mask = np.ones((BATCH, 1, Q_TOKENS, Q_TOKENS), dtype=bool)
    mask[1, :, 2, :] = False  # query 2 of item 1 may attend to nothing
    out, weights = backend_for(library).run(cfg, params, query, mask=mask, return_weights=True, dtype="float32")
    assert not np.isnan(out).any() and not np.isnan(weights).any()
    assert np.array_equal(weights[1, :, 2], np.zeros((HEADS, Q_TOKENS)))
    np.testing.assert_allclose(out[1, 2], params.b_o, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("library", LIBRARIES)
def test_unbatched_call(library):
    cfg = CASES["self"]
    params = init_params(cfg, seed=5)
    query = np.random.default_rng(5).standard_normal((Q_TOKENS, D_MODEL))  # (Nq, D)
    out = backend_for(library).run(cfg, params, query, dtype="float32")
    assert out.shape == (Q_TOKENS, D_MODEL)
    assert_close(out, reference_mha(cfg, params, query), "float32")


@pytest.mark.parametrize("library", [p for p in LIBRARIES if p.values[0] != "jax"])
def test_layout_notes_are_measured_on_the_tensors(library):
    """q_heads is the projection einsum's own output: merging (g r k) back into q is a view."""
    cfg = CASES["self"]
    prepared, _ = backend_for(library).prepare(cfg, init_params(cfg), make_inputs(cfg, cross=False)[0])
    stages = prepared.native_stages()
    assert stages["q_heads"].axes == ("B", "Nq", "H", "Dk")
    assert (stages["q"].relation, stages["q"].parent) == ("view", "q_heads")
    assert (stages["q_heads"].relation, stages["q_heads"].parent) == ("new", None)  # no split step
    # NumPy reshapes the contiguous context in place; torch's einsum hands back a permuted
    # context, which the merge has to copy.
    expected = {"numpy": "view", "torch": "copy"}[library]
    assert (stages["merged"].relation, stages["merged"].parent) == (expected, "context")


def test_numpy_einsum_with_explicit_path_equals_einops_einsum():
    """The NumPy fast path (explicit contraction path) computes what einops.einsum computes."""
    import einops

    from mha_rosetta.backends.einops.plans import GQA_PLAN
    from mha_rosetta.backends.frameworks.ops_numpy import NumpyOps

    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 7, 2, 3, 5))  # (B, Nq, Hkv, G, Dk)
    k = rng.standard_normal((2, 4, 2, 5))  # (B, Nk, Hkv, Dk)
    fast = NumpyOps("float64", "cpu").einsum(GQA_PLAN.scores, q, k)
    plain = einops.einsum(q, k, GQA_PLAN.scores)
    assert fast.shape == (2, 2, 7, 3, 4)  # (B, Hkv, Nq, G, Nk)
    np.testing.assert_allclose(fast, plain, rtol=1e-12, atol=1e-12)


# --- the convention: no hand-written axis swaps --------------------------------------------

FORBIDDEN = frozenset(
    {"transpose", "permute", "swapaxes", "moveaxis", "T", "mT", "t", "permute_dims", "matrix_transpose"}
)


def axis_swaps(source: str) -> list[str]:
    """Every use of an axis-swapping function or attribute in ``source`` (comments and strings ignored)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN:
            found.append(f"line {node.lineno}: {node.id}")
    return found


def test_the_checker_finds_axis_swaps():
    snippet = "a = x.transpose(0, 2, 1)\nb = y.T\nc = torch.permute(z, (1, 0))\nd = np.swapaxes(w, 0, 1)\n"
    assert len(axis_swaps(snippet)) == 4
    assert axis_swaps("# x.transpose(1, 2) in a comment\ns = 'y.T in a string'\n") == []


def test_einops_adapter_never_swaps_axes_by_hand():
    from mha_rosetta.backends.einops import adapter, layer, plans, vjp
    from mha_rosetta.backends.jax import common as _jax_common

    for module in (plans, layer, adapter, vjp, _jax_common):  # the einops family and the JAX helpers it calls
        assert axis_swaps(inspect.getsource(module)) == [], module.__name__


def test_rejects_an_unknown_array_library():
    from mha_rosetta.backends.einops.adapter import EinopsBackend

    with pytest.raises(ValueError, match="array_library must be one of numpy, torch, jax; got 'cupy'"):
        EinopsBackend(array_library="cupy")


def test_requirements_name_the_array_library():
    from mha_rosetta.backends import REGISTRY, get_backend
    from mha_rosetta.backends.einops.adapter import EinopsBackend

    # The registry is the one place that says what a backend needs; get_backend copies it on.
    assert REGISTRY["einops-numpy"].requires == ("einops",)
    assert REGISTRY["einops-torch"].requires == ("einops", "torch")
    assert get_backend("einops-numpy").requires == ("einops",)
    assert EinopsBackend(array_library="jax").name == "einops-jax"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_devices_follow_cuda_availability():
    import torch

    expected = ("cpu", "gpu") if torch.cuda.is_available() else ("cpu",)
    assert backend_for("torch").devices() == expected
