"""Decoding through the Attention op's own cache: ``past_key``/``past_value`` in, ``present_key``/``present_value`` out.

One step graph (`graph.build` with ``past=True``) serves the prefill (an empty past, (B, Hkv, 0, d))
and every later chunk: the op concatenates the chunk's keys after the past ones and returns the
whole cache as ``present_*``, which the next call feeds back as ``past_*``. The cache layout is the
op's, (B, Hkv, T, Dk): keys after QK-norm and rotary, before the GQA grouping (the op groups).

The causal rule: with causality alone the op's ``is_causal=1``, whose offset is the past length
(bottom-right: the query at chunk index i sees cache slots j <= i + past, measured in ORT 1.32 and
the ReferenceEvaluator). With padding, a window or a score bias, the chunk's ``attn_mask`` over
(past + chunk) slots is `core.decode.decode_allowed` on the slots' positions (float with ALiBi/T5).
A window keeps the cache a ring in effect: after each call only the last ``W - 1`` slots are fed
back (the next chunk's first query needs no older key), so memory is O(W).

The rotary tables are the run's, computed once for every position (`core.rotary`), sliced per chunk.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.decode import DecodeInputs, decode_allowed
from mha_rosetta.core.rotary import rotary_tables

from ..base import Prepared, PreparedDecode, StageTensor
from ..decoding import DecodeStep
from .graph import GraphSpec, build, full_tables
from .known import KNOWN
from .runtime import float_mask, make_runner


def _mask_kind(cfg: MHAConfig, padded: bool) -> str | None:
    if cfg.has_score_bias:
        return "float"
    return "bool" if padded or cfg.window is not None else None


def _tables(cfg: MHAConfig, positions: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Full-width rotary tables (B, 1, N, Dk) for every position of the run, or None without rope."""
    tables = rotary_tables(cfg, SimpleNamespace(positions=positions, kv_positions=positions))
    if tables is None:
        return None
    cos, sin = full_tables(cfg.rope, cfg.d_k, tables.q_cos, tables.q_sin)
    return cos.astype(dtype), sin.astype(dtype)


class StepGraph:
    """The step graph of one run, its runner, and the feeds of one chunk."""

    def __init__(self, backend, cfg: MHAConfig, params: MHAParams, dtype: str, mask: str | None) -> None:
        spec = GraphSpec(
            cfg, dtype, backend.opset, is_causal=mask is None and cfg.causal, mask=mask,
            rope=cfg.rope is not None, past=True, fold_scale=backend.fold_scale,
        )  # fmt: skip
        self.cfg, self.params, self.dtype, self.mask = cfg, params, dtype, mask
        self.run = make_runner(build(spec, params)[0], backend.reference)

    def feeds(self, x, tables, chunk: slice, past_k, past_v, q_pos, k_pos, k_valid) -> dict:
        """The feeds of one call: x (B, s, D), the chunk's tables, the past and, where used, the chunk's mask."""
        feeds = {"x_q": x, "x_k": x, "x_v": x, "past_key": past_k, "past_value": past_v}
        if tables is not None:
            cos, sin = (table[:, :, chunk] for table in tables)  # (B, 1, s, Dk) views
            feeds.update(q_cos=cos, q_sin=sin, k_cos=cos, k_sin=sin)
        if self.mask is not None:
            allowed = decode_allowed(self.cfg, q_pos, k_pos, k_valid)  # (B, 1, s, T)
            if self.mask == "float":
                feeds["attn_mask"] = float_mask(self.cfg, self.params, q_pos, k_pos, allowed, self.dtype)
            else:
                feeds["attn_mask"] = allowed
        return feeds


def _info(backend, cfg: MHAConfig, dtype: str, step: StepGraph, slots: int, batch: int) -> dict:
    itemsize = np.dtype(dtype).itemsize
    info = {
        "cache": {
            "kind": "past_key",
            "layout": "(B, Hkv, T, Dk): past_key in, present_key out",
            "slots": slots,
            "bytes": batch * cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * itemsize,
        },
        "is_causal": step.mask is None and cfg.causal,
        "attn_mask": step.mask,
        "runtime": "onnx.reference.ReferenceEvaluator" if backend.reference else "onnxruntime CPUExecutionProvider",
    }
    if dtype == "float64" and not backend.fold_scale:  # the op's float32 sqrt(scale) (`known.KNOWN`)
        info.update(tolerance_dtype="float32", known_difference="sqrt_scale", note=KNOWN["sqrt_scale"].line())
    return info


def prepare_decode_run(backend, cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str):
    """`Backend._prepare_decode_run` for the ONNX backends: the prefill and each step through past/present."""
    step = StepGraph(backend, cfg, params, dtype, _mask_kind(cfg, inputs.mask is not None))
    x_all, valid = inputs.x.astype(dtype), inputs.valid
    tables = _tables(cfg, inputs.positions, dtype)
    batch, keep = inputs.batch, None if cfg.window is None else cfg.window - 1

    def run():
        empty = (
            np.zeros((batch, cfg.n_kv_heads, 0, cfg.d_k), dtype),
            np.zeros((batch, cfg.n_kv_heads, 0, cfg.d_v), dtype),
        )
        past_k, past_v = empty
        k_pos, k_valid = np.zeros((batch, 0), np.int64), np.zeros((batch, 0), bool)
        outputs = []
        for start, stop in inputs.chunks():
            q_pos = inputs.positions[:, start:stop]  # (B, s)
            k_pos = np.concatenate([k_pos, q_pos], axis=1)  # (B, T): the slots after this call
            k_valid = np.concatenate([k_valid, valid[:, start:stop]], axis=1)
            x = x_all[:, start:stop]  # (B, s, D) view
            feeds = step.feeds(x, tables, slice(start, stop), past_k, past_v, q_pos, k_pos, k_valid)
            output, past_k, past_v = step.run(feeds, ["output", "present_key", "present_value"])
            if keep is not None:  # the window: only the last W - 1 slots can be seen again
                past_k, past_v = past_k[:, :, -keep:], past_v[:, :, -keep:]
                k_pos, k_valid = k_pos[:, -keep:], k_valid[:, -keep:]
            outputs.append(output)
        return np.concatenate(outputs, axis=1)  # (B, N, D)

    slots = inputs.tokens if keep is None else min(inputs.tokens, keep + inputs.step)
    info = _info(backend, cfg, dtype, step, slots, batch)
    return PreparedDecode(run, lambda out: np.asarray(out, dtype=np.float64), info=info)


def prepare_decode_step(backend, cfg: MHAConfig, params: MHAParams, job: DecodeStep) -> Prepared:
    """One timed call (`bench --mode decode`): ``job.step`` new tokens over a past of ``job.context`` arbitrary
    slots (a window's past holds its last ``W - 1``); one ``InferenceSession.run``."""
    batch, context, step, dtype, seed = job.batch, job.context, job.step, job.dtype, job.seed
    rng = np.random.default_rng(seed)
    past = context if cfg.window is None else min(context, cfg.window - 1)
    graph = StepGraph(backend, cfg, params, dtype, _mask_kind(cfg, False))
    positions = np.broadcast_to(np.arange(context - past, context + step), (batch, past + step))  # (B, T)
    tables = _tables(cfg, positions, dtype)
    past_k = rng.standard_normal((batch, cfg.n_kv_heads, past, cfg.d_k)).astype(dtype)
    past_v = rng.standard_normal((batch, cfg.n_kv_heads, past, cfg.d_v)).astype(dtype)
    x = rng.standard_normal((batch, step, cfg.d_model)).astype(dtype)
    q_pos, valid = positions[:, past:], np.ones(positions.shape, bool)
    feeds = graph.feeds(x, tables, slice(past, past + step), past_k, past_v, q_pos, positions, valid)

    def forward():
        return graph.run(feeds, ["output"])[0]

    def native_stages():  # the step's output only: the cache and the fused op hide the rest
        return {"output": StageTensor(forward(), ("B", "Nq", "D"), "one step's output")}

    info = _info(backend, cfg, dtype, graph, past + step, batch)
    return Prepared(forward, lambda out: np.asarray(out, dtype=np.float64), native_stages, info=info)
