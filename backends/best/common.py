"""What the best paths share: what they implement and refuse (with the reason), and their decode plans.

NumPy and the standard library only: each framework's module imports its library inside its functions.

A decode run here is a static cache of the run's ``N`` tokens (no window, so no ring): slot ``t``
holds token ``t``, so which slots a chunk's queries see is fixed by the positions and the padding
mask before the run starts (`decode_chunks`, `core.decode.decode_allowed`), and a step that sees
every slot it reads (one token a step, no padding) needs no mask at all. The timed step
(`decode_step_inputs`) is one of ``step`` tokens over ``context`` cached tokens of arbitrary
numbers, drawn as the torch adapter's step draws them (the step's x, then K, then V), so that one
seed gives every implementation the same cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, rotary_tables
from mha_rosetta.core.decode import DecodeInputs, decode_allowed

from ..base import DecodeStep, Prepared, StageTensor
from ..decoding import kv_cache_info
from ..numpy.common import HALF_TYPES

# The variants a best path implements: the qkv bias is an absent output bias; rope scaling lives in the
# rotary tables (`core.rotary_tables`), which every path takes from core.
BEST_VARIANTS = frozenset({"qkv_bias", "rope_scaling"})
BEST_DTYPES = ("float64", "float32")
STATIC = "static"
NOT_A_BEST_PATH = (
    "a best path implements the layer the timings compare (GQA, rotary, the causal and padding masks, a static "
    "cache); the other variants run in the convention adapters"
)


def half_precision_reason(name: str, dtype: str) -> str:
    return (
        f"{name} runs float32 (the timings' dtype) and float64 (the checks') only, not {dtype}: the CPU timings "
        "here are float32 (no CPU library here has fast 16-bit kernels; NumPy has no 16-bit BLAS at all)"
    )


class BestPath:
    """The rules every best path keeps, as a mixin before `Backend` in the bases.

    What it implements is declared once here (`BEST_VARIANTS`, `BEST_DTYPES`, a static cache);
    each refusal says why, and a variant's refusal says what a best path is for.
    """

    best_path = True  # refuses, by design, what the timings do not compare (the convention adapters run it all)
    variants = BEST_VARIANTS
    dtypes = BEST_DTYPES
    causal_on_positions = True  # every causal mask comes from the positions (base rule 7)
    decode_caches = (STATIC,)
    # The measured library limitations that keep this best path from its peers' time (the other best paths), by mode
    # with `Backend.gap_causes`' keys ("decode", "decode at B=4", "forward"), each with its condition in the text:
    # the bench tables name them under a gap of over 1.3x between two best paths (`benchmarks.best_gap.peer_lines`).
    peer_limits: ClassVar[dict[str, str]] = {}

    def variant_reason(self, cfg: MHAConfig, strategy: str, backward: bool = False) -> str | None:
        reason = super().variant_reason(cfg, strategy, backward)  # type: ignore[misc]
        return None if reason is None else f"{reason}: {NOT_A_BEST_PATH}"

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if dtype in HALF_TYPES:
            return half_precision_reason(self.name, dtype)  # type: ignore[attr-defined]
        return super().unsupported_reason(cfg, dtype, device, strategy)  # type: ignore[misc]

    def decode_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str, cache: str | None) -> str | None:
        if dtype in HALF_TYPES:
            return half_precision_reason(self.name, dtype)  # type: ignore[attr-defined]
        reason = super().decode_reason(cfg, dtype, device, strategy, cache)  # type: ignore[misc]
        if reason and any(name not in self.decode_variants for name in cfg.variants):
            reason += f": {NOT_A_BEST_PATH}"
        return reason

    def _prepare_decode_step(self, cfg: MHAConfig, params, job: DecodeStep) -> Prepared:
        """The timed step: `decode_step_inputs` drawn from ``job``'s seed, through the path's `prepare_step`."""
        data = decode_step_inputs(cfg, batch=job.batch, context=job.context, step=job.step, seed=job.seed)
        return self.prepare_step(cfg, params, data, job.dtype, job.device)

    def prepare_step(self, cfg: MHAConfig, params, data: DecodeStepInputs, dtype: str, device: str) -> Prepared:
        """One timed step of ``data`` on a static cache that holds its context: each best path's own."""
        raise NotImplementedError


def cache_info(cfg: MHAConfig, batch: int, slots: int, itemsize: int, layout: str) -> dict:
    """``info["cache"]`` of a best path's static cache (`decoding.kv_cache_info`)."""
    return kv_cache_info(STATIC, layout, cfg, batch, slots, itemsize)


def output_stage(output) -> dict[str, StageTensor]:
    """A timed decode step's `Prepared.native_stages`: its output (B, s, D), the one stage it exposes."""
    return {"output": StageTensor(output, ("B", "Nq", "D"), "the step's output (its only stage exposed)")}


def folded_allowed(allowed: np.ndarray, group: int) -> np.ndarray:
    """A chunk's pattern (B, 1, s, T) for the group's query heads folded into the query rows: (B, 1, G*s, T).

    Row ``i*s + t`` is query ``t`` of head ``i`` of every group, the order of ``(B, Hkv, G, s, d)``
    reshaped to ``(B, Hkv, G*s, d)``: each head of a group sees the same slots, so the rows repeat.
    """
    return np.tile(allowed, (1, 1, group, 1))  # (B, 1, G*s, T), a copy


@dataclass(frozen=True)
class DecodeChunk:
    """One call of a decode run: tokens ``start:stop`` written to slots ``start:stop``, then attending.

    allowed: (B, 1, s, stop) bool, which of the slots ``0 .. stop-1`` each query sees (the causal rule on
    positions and the padding), or None when every query sees every one of them.
    tables: the chunk's rows of the run's rotary tables (`run_rotary_tables`), (cos, sin) each (1|B, s, r/2)
    float64 views, or None without rope.
    """

    start: int
    stop: int
    allowed: np.ndarray | None
    tables: tuple[np.ndarray, np.ndarray] | None = None


def decode_chunks(cfg: MHAConfig, inputs: DecodeInputs) -> list[DecodeChunk]:
    """The run's chunks (prefill, then each step) with the slots each chunk's queries see and their rotary tables."""
    chunks = []
    positions, valid = inputs.positions, inputs.valid
    tables = run_rotary_tables(cfg, positions)  # (1|B, N, r/2) or None: the whole run's, sliced per chunk
    for start, stop in inputs.chunks():
        allowed = decode_allowed(cfg, positions[:, start:stop], positions[:, :stop], valid[:, :stop])  # (B, 1, s, T)
        chunk_tables = None if tables is None else (tables[0][:, start:stop], tables[1][:, start:stop])  # views
        chunks.append(DecodeChunk(start, stop, None if allowed.all() else allowed, chunk_tables))
    return chunks


def run_rotary_tables(cfg: MHAConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(cos, sin), each (1|B, N, r/2) float64, for tokens at ``positions`` (1|B, N), or None without rope.

    A decode run's tables are the whole run's, made once and sliced per chunk: a dynamic rope scaling
    reads the run's length, as the full forward does. Queries and keys are the same tokens.
    """
    tables = rotary_tables(cfg, SimpleNamespace(positions=positions, kv_positions=positions))
    return None if tables is None else (tables.q_cos, tables.q_sin)


@dataclass(frozen=True)
class DecodeStepInputs:
    """The timed step's data (float64): ``x`` (B, s, D) the new tokens at positions ``context ..``;
    ``k`` (B, Hkv, context, Dk) and ``v`` (B, Hkv, context, Dv) the cache before the step;
    ``tables`` the new tokens' rotary (cos, sin) (1, s, r/2) or None; ``allowed`` (1, 1, s, context + s)
    the slots each new query sees, None when it sees them all (one token a step)."""

    x: np.ndarray
    k: np.ndarray
    v: np.ndarray
    tables: tuple[np.ndarray, np.ndarray] | None
    allowed: np.ndarray | None

    @property
    def context(self) -> int:
        return self.k.shape[2]

    @property
    def step(self) -> int:
        return self.x.shape[1]


def decode_step_inputs(cfg: MHAConfig, *, batch: int, context: int, step: int, seed: int) -> DecodeStepInputs:
    """``step`` new tokens on ``context`` cached ones, drawn in the order of the torch adapter's step
    (`backends.torch.decode.random_cache`): x, then K (scaled like rotated keys), then V."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, step, cfg.d_model))  # (B, s, D)
    shape = (batch, cfg.n_kv_heads, context)
    k = rng.standard_normal((*shape, cfg.d_k)) * (1.0 / np.sqrt(cfg.d_k))  # (B, Hkv, context, Dk)
    v = rng.standard_normal((*shape, cfg.d_v))  # (B, Hkv, context, Dv)
    total = context + step
    q_positions = np.arange(context, total, dtype=np.int64)[None]  # (1, s)
    allowed = decode_allowed(cfg, q_positions, np.arange(total)[None], np.ones((1, total), dtype=bool))
    return DecodeStepInputs(x, k, v, run_rotary_tables(cfg, q_positions), None if allowed.all() else allowed)
