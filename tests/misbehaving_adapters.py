"""User adapters that misbehave, one way each, for the worker-pool tests (`tests/test_check_pool.py`).

Module-level classes, so a spawned worker can import them (`--backend misbehaving_adapters:Hangs`).
Each is the float64 oracle (right on every case) except in its forward pass on the
``self_attention`` spec case (recognised by its inputs: 7 query tokens, not causal); the tests
pair it with the ``causal`` case (7 tokens, causal), where every adapter behaves.
"""

from __future__ import annotations

import os
import time

import numpy as np

from mha_rosetta.backends import Backend, Prepared, StageTensor
from mha_rosetta.core import STAGE_BY_NAME, numpy_dtype, reference_stages

BAD_Q_TOKENS = 7  # self_attention's query tokens


def oracle_stages(cfg, params, inputs, dtype) -> tuple[dict, dict]:
    """The float64 oracle's stages rounded to ``dtype``, as arrays and as the `StageTensor`s a `Prepared` shows."""
    positions = np.broadcast_to(inputs.positions, (inputs.batch, inputs.q_tokens))  # (B, Nq) from (1|B, Nq)
    kv_positions = np.broadcast_to(inputs.kv_positions, (inputs.batch, inputs.kv_tokens))  # (B, Nk)
    args = (inputs.query, inputs.key, inputs.value, inputs.mask, positions, kv_positions)
    stages = {k: v.astype(numpy_dtype(dtype)) for k, v in reference_stages(cfg, params, *args).items()}
    native = {name: StageTensor(value, STAGE_BY_NAME[name].shape) for name, value in stages.items()}
    return stages, native


class Good(Backend):
    """The float64 oracle rounded to the run's dtype."""

    name = "good"
    dtypes = ("float64",)

    def misbehave(self, output: np.ndarray) -> np.ndarray:
        return output

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        stages, native = oracle_stages(cfg, params, inputs, dtype)
        bad = inputs.q_tokens == BAD_Q_TOKENS and not cfg.causal

        def forward():
            return self.misbehave(stages["output"]) if bad else stages["output"]

        to_numpy = lambda r: np.asarray(r, dtype=np.float64)  # noqa: E731
        return Prepared(forward=forward, to_numpy=to_numpy, native_stages=lambda: native)


class Hangs(Good):
    name = "hangs"

    def misbehave(self, output):
        time.sleep(3600)  # a blocked call (a lock, a device that never answers)
        return output


class Spins(Good):
    name = "spins"

    def misbehave(self, output):
        while True:  # pure Python: no signal or sleep can interrupt it from inside
            pass


class Exits(Good):
    name = "exits"

    def misbehave(self, output):
        os._exit(3)  # what a native extension fault or a CUDA abort does to the process


class Raises(Good):
    name = "raises"

    def misbehave(self, output):
        raise RuntimeError("adapter bug: index out of range")


class WrongShape(Good):
    name = "wrong-shape"

    def misbehave(self, output):
        return output[..., :-1]  # (B, Nq, D - 1)


class ReturnsNaN(Good):
    name = "returns-nan"

    def misbehave(self, output):
        return output * np.nan
