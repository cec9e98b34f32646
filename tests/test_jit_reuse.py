"""Compiled programs are reused within a process: the same configuration, shapes and dtype compile once.

Each JAX-based adapter names its jitted program by a key of everything its closure captures
(`backends.jax.common.shared_program`). These tests count XLA compilations through
``jax.monitoring`` (one ``backend_compile_duration`` event per program XLA compiles) and check
that a second prepare with other parameters and inputs of the same shapes compiles nothing,
that its output is the one a freshly compiled program gives, bit for bit (so the parameters
are traced arguments, not constants baked into the first program), and that another dtype or
configuration compiles again.
"""

from __future__ import annotations

import numpy as np
import pytest
from adapter_cases import random_inputs

from conftest import D_MODEL, HEADS, importable, requires
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha

pytestmark = requires("jax")

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
_listening = [False]

CFG = MHAConfig(d_model=D_MODEL, n_heads=HEADS, causal=True)
# (backend, strategy, library it needs)
FORWARD_CASES = [
    ("jax", "standard", "jax"),
    ("jax", "chunked", "jax"),
    ("einops-jax", "standard", "einops"),
    ("jax-dpa", "standard", "jax"),
    ("flax", "standard", "flax"),
    ("equinox", "standard", "equinox"),
]


def _count(event: str, duration: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
        _compiles[0] += 1


@pytest.fixture
def fresh_programs(monkeypatch):
    """An empty program table, so that earlier tests in this process cannot have compiled these programs."""
    import jax

    from mha_rosetta.backends.jax import common

    if not _listening[0]:
        jax.monitoring.register_event_duration_secs_listener(_count)
        _listening[0] = True
    monkeypatch.setattr(common, "_PROGRAMS", {})
    return common


def compiles_during(fn):
    """(number of XLA compilations while ``fn`` ran, its result)."""
    before = _compiles[0]
    result = fn()
    return _compiles[0] - before, result


def prepared_output(backend, cfg, seed: int, dtype: str, strategy: str) -> np.ndarray:
    params = init_params(cfg, seed=seed)
    query, _, _, mask = random_inputs(cfg, cross=False, padding=True, padded_item=1, seed=seed)
    prepared, _ = backend.prepare(cfg, params, query, mask=mask, dtype=dtype, strategy=strategy)
    prepared.compile()
    return prepared.output()


@pytest.mark.parametrize(("name", "strategy", "library"), FORWARD_CASES)
def test_same_program_compiles_once_and_keeps_its_arguments(fresh_programs, monkeypatch, name, strategy, library):
    if not importable(library):
        pytest.skip(f"{library} is not importable")
    from mha_rosetta.backends import get_backend

    backend = get_backend(name)
    first, _ = compiles_during(lambda: prepared_output(backend, CFG, 1, "float32", strategy))
    assert first >= 1  # a new program: compiled
    again, second = compiles_during(lambda: prepared_output(backend, CFG, 2, "float32", strategy))
    assert again == 0  # other parameters and inputs, same config, shapes and dtype: nothing compiled
    params = init_params(CFG, seed=2)
    query, _, _, mask = random_inputs(CFG, cross=False, padding=True, padded_item=1, seed=2)
    assert_close(second, reference_mha(CFG, params, query, mask=mask), "float32")  # seed 2's answer, not seed 1's
    monkeypatch.setattr(fresh_programs, "_PROGRAMS", {})  # forget the shared program: compiled afresh
    recompiled, fresh = compiles_during(lambda: prepared_output(backend, CFG, 2, "float32", strategy))
    assert recompiled >= 1
    np.testing.assert_array_equal(second, fresh)  # the shared program gives the fresh program's bits

    other_dtype, _ = compiles_during(lambda: prepared_output(backend, CFG, 1, "bfloat16", strategy))
    assert other_dtype >= 1  # another dtype is another program
    other_cfg = MHAConfig(d_model=D_MODEL, n_heads=HEADS, causal=False)
    other_config, _ = compiles_during(lambda: prepared_output(backend, other_cfg, 1, "float32", strategy))
    assert other_config >= 1  # another configuration (the causal flag is traced in) is another program


@pytest.mark.parametrize("name", ["jax", "equinox", "einops-jax"])
def test_backward_program_compiles_once(fresh_programs, name):
    library = {"jax": "jax", "equinox": "equinox", "einops-jax": "einops"}[name]
    if not importable(library):
        pytest.skip(f"{library} is not importable")
    from mha_rosetta.backends import get_backend

    backend = get_backend(name)

    def grads(seed: int) -> dict:
        params = init_params(CFG, seed=seed)
        query, _, _, mask = random_inputs(CFG, cross=False, padding=True, padded_item=1, seed=seed)
        cotangent = np.random.default_rng(seed).standard_normal(query.shape)
        prepared, _ = backend.prepare_vjp(CFG, params, query, mask=mask, cotangent=cotangent, dtype="float32")
        prepared.compile()
        return prepared.to_grads(prepared.run())

    first, _ = compiles_during(lambda: grads(1))
    assert first >= 1
    again, second = compiles_during(lambda: grads(2))
    assert again == 0
    fresh_programs._PROGRAMS.clear()
    recompiled, fresh = compiles_during(lambda: grads(2))
    assert recompiled >= 1
    assert second.keys() == fresh.keys()
    for name_, value in second.items():
        np.testing.assert_array_equal(value, fresh[name_], err_msg=name_)
