"""A backend registered once shows up in the check, the benchmark and the explainer.

The throwaway backend below is the float64 oracle wrapped as an adapter (its stages are
the oracle's, in the canonical layout). Registering it is the only step: no list of names
in the check, the benchmark or the explainer is edited, and each of them picks it up.
"""

from __future__ import annotations

import numpy as np
import pytest

from mha_rosetta.backends import REGISTRY, Backend, Prepared, StageTensor, register, registry
from mha_rosetta.core import STAGE_BY_NAME, MHAConfig, init_params, reference_stages

TOY = "toy-oracle-loop"


class ToyBackend(Backend):
    """The spec's own loop over heads, exposed as an implementation."""

    convention = "the float64 oracle's loop over heads, wrapped as a backend (a test fixture)"
    requires = ("numpy",)
    dtypes = ("float64",)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy) -> Prepared:
        # MHAInputs holds positions as (1|B, N); the oracle takes (N,) or (B, N).
        positions = [np.broadcast_to(p, (inputs.batch, p.shape[-1])) for p in (inputs.positions, inputs.kv_positions)]
        args = (inputs.query, inputs.key, inputs.value, inputs.mask, *positions)

        def native_stages() -> dict[str, StageTensor]:
            stages = reference_stages(cfg, params, *args)
            return {name: StageTensor(value, STAGE_BY_NAME[name].shape, "the oracle") for name, value in stages.items()}

        return Prepared(
            forward=lambda: reference_stages(cfg, params, *args)["output"],
            to_numpy=np.asarray,
            native_stages=native_stages,
        )


@pytest.fixture
def toy(monkeypatch):
    """The toy backend registered the public way, for one test; the registry and the instances restored after."""
    monkeypatch.setattr(registry, "_INSTANCES", dict(registry._INSTANCES))
    register(TOY, ToyBackend)
    assert REGISTRY[TOY].kind == "implementation"
    yield TOY
    del REGISTRY[TOY]


def test_the_check_runs_and_compares_a_registered_backend(toy):
    from mha_rosetta.checks import run_check
    from mha_rosetta.checks.cases import get_cases

    case = get_cases(None)[0]
    result = run_check(backends=[toy, "numpy"], cases=[case.name], dtypes="float64")
    toy_runs = [run for run in result.runs if run.impl.backend == toy]
    assert toy_runs and all(run.status.value == "agree" for run in toy_runs), toy_runs
    assert toy_runs[0].max_abs == 0.0  # it is the oracle
    toy_pairs = [pair for pair in result.pairs if toy in (pair.a.impl.backend, pair.b.impl.backend)]
    statuses = {pair.status.value for pair in toy_pairs if not (pair.a.impl.known_mistake or pair.b.impl.known_mistake)}
    assert statuses == {"agree"}, toy_pairs
    # and without naming it: every installed backend is every registered one
    from mha_rosetta.checks.selection import resolve_backends

    assert toy in [backend.name for backend in resolve_backends(None)[0]]


def test_the_benchmark_plans_cells_for_a_registered_backend(toy):
    from mha_rosetta.benchmarks.sweep import expand_cells, preset_settings

    cells = expand_cells(preset_settings("quick", dtypes=["float64"]))
    assert any(cell.implementation == toy for cell in cells)


def test_the_explainer_measures_a_registered_backend(toy):
    from mha_rosetta.explain.stages_table import build_stage_tables, default_backends

    assert toy in default_backends()
    cfg = MHAConfig(d_model=12, n_heads=3)
    x = np.random.default_rng(0).standard_normal((2, 6, 12))
    summaries, rows = build_stage_tables(cfg, init_params(cfg), x, backends=[toy], dtype="float64")
    assert [summary.backend for summary in summaries] == [toy] and not summaries[0].skipped
    q_heads = next(row for row in rows if row.stage == "q_heads")
    assert q_heads.shape == (2, 3, 6, 4) and q_heads.memory == "new buffer (computed)"
    assert q_heads.strides_text == str((72, 24, 4, 1))  # read off the NumPy array
