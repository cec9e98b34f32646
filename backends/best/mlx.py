"""``mlx-best``: MLX as mlx-lm writes it at its best: ``mx.fast.scaled_dot_product_attention`` over a static cache.

* The forward: mlx-lm's model code (``nn.Linear`` projections ``x @ W.T`` on the ``(out, in)`` weights, the
  head split ``reshape(B, L, H, -1).transpose(0, 2, 1, 3)``, ``nn.RoPE``'s rotation by the spec's tables),
  then the fused ``mx.fast.scaled_dot_product_attention`` with GQA as it comes (Hkv heads, no tiling),
  ``mask="causal"`` where the positions make it bottom-right, else a bool mask; the backward is ``mx.vjp``
  of it (`mlx.adapter.prepare_mlx_vjp`). The kernel gives a query row with no allowed key the mean of V
  (`oracles.mlx.MEAN_OF_V`): this path sets such rows to the spec's zeros after it (an ``mx.where`` on
  (B, 1, Nq, 1)); the ``mlx-sdpa`` oracle keeps the kernel's answer and reports it.
* The decode step: one static cache ``(B, Hkv, C, d)`` allocated once, each chunk's keys and values written
  by slice assignment at the write index (``cache[..., start:stop, :] = new``, mlx-lm's own write; MLX
  reuses the buffer: no copy of the cache, measured by ``mx.get_peak_memory`` in tests/test_best_paths.py)
  and read as the slice ``[..., :stop, :]`` (the written slots: one token needs no mask). mlx-lm's
  ``KVCache`` grows in steps of 256 slots by ``mx.concatenate`` (a copy of the whole cache each time,
  the ``mlx`` adapter's cache); preallocating the run's slots, as mlx-lm does for a known length, never
  concatenates. Evaluation is lazy: the timed region ends at ``mx.eval`` of the output, which evaluates
  the cache write it reads.
* ``mx.compile`` is not used: the step is four GEMVs and one fused kernel, and compiling a step that
  writes a cache in place needs the cache as the compiled function's state (inputs and outputs);
  whether it helps was not measured (no quiet machine at the time), so it is not claimed.

MLX is imported inside the functions. float64 runs on the CPU, held to float32's tolerance
(`frameworks.mlx.FLOAT64_LIMIT`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, allowed_positions, softmax_with_empty_rows

from .._recording import record_stages
from ..base import Prepared, PreparedDecode, StageTensor, tensor_to_numpy
from ..frameworks.mlx import FLOAT64_LIMIT, mlx_stream, precision_info, to_mlx
from ..mlx.adapter import layer_inputs
from ..mlx.layer import MlxAttention, rotate
from ..oracles.mlx import MlxSDPAOracle, bottom_right_causal
from ..stage_cuts import CACHE_WRITE, FUSED_ATTENTION, eager_cuts, path_groups, reached
from . import common
from .common import STATIC, BestPath, DecodeStepInputs, cache_info

CACHE_LAYOUT = "(B, Hkv, C, Dk), (B, Hkv, C, Dv)"
DECODE_LAYOUTS = {
    STATIC: f"{CACHE_LAYOUT} preallocated to the run's C tokens, written by slice assignment (no mx.concatenate) "
    "and read up to the write index; mx.fast.scaled_dot_product_attention with GQA as it comes (no tiling)"
}


RECOMPUTED = "recomputed (untimed, in NumPy) from q_rotated and k_rotated: the fused MLX kernel keeps its scores inside"


def _score_stages(cfg: MHAConfig, q: np.ndarray, k: np.ndarray, allowed: np.ndarray | None) -> dict[str, StageTensor]:
    """scores, masked_scores and weights (B, H, Nq, Nk) from q_rotated (B, H, Nq, Dk) and k_rotated (B, Hkv, Nk, Dk)."""
    k = np.repeat(k, cfg.group_size, axis=1)  # (B, H, Nk, Dk): a copy, for inspection only
    scores = cfg.scale * (q @ np.swapaxes(k, -1, -2))  # (B, H, Nq, Nk)
    masked = scores if allowed is None else np.where(allowed, scores, -np.inf)  # (B, H, Nq, Nk)
    axes = ("B", "H", "Nq", "Nk")
    return {
        "scores": StageTensor(scores, axes, RECOMPUTED),
        "masked_scores": StageTensor(masked, axes, RECOMPUTED, "new", "scores"),
        "weights": StageTensor(softmax_with_empty_rows(masked), axes, RECOMPUTED, "new", "masked_scores"),
    }


class MlxBestLayer(MlxAttention):
    """mlx-lm's layer (`mlx.layer.MlxAttention`'s projections, split and merge) around the fused kernel, each step
    able to stop after a breakdown stage (``until``, `stage_cuts.reached`)."""

    def heads_until(self, p: dict, x_q, x_k, x_v, tables, until=None):
        """(q (B, H, Nq, Dk), k (B, Hkv, Nk, Dk), v (B, Hkv, Nk, Dv)): projected, split and rotated."""
        cfg = self.cfg
        q, k, v = self.linear(p, x_q, "q"), self.linear(p, x_k, "k"), self.linear(p, x_v, "v")  # (B, N, n*d)
        reached(until, "projections", q, k, v)
        q, k, v = self.split(q, cfg.n_heads), self.split(k, cfg.n_kv_heads), self.split(v, cfg.n_kv_heads)
        reached(until, "head split", q, k, v)  # (B, n, N, d)
        if tables is not None:
            q, k = rotate(q, *tables["q"], self.traditional), rotate(k, *tables["k"], self.traditional)
            reached(until, "rotary", q, k)
        return q, k, v

    def fused(self, q, k, v, mask, empty):
        """The kernel's context (B, H, Nq, Dv); ``empty`` (1|B, 1, Nq, 1) bool: rows set to the spec's zeros."""
        mx = self.mx
        context = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.cfg.scale, mask=mask)
        return context if empty is None else mx.where(empty, mx.zeros((), dtype=context.dtype), context)

    def merge_until(self, p: dict, context, until=None):
        """The heads merged, ``transpose(0, 2, 1, 3).reshape(B, L, -1)``, then ``o_proj``: (B, Nq, D)."""
        B, H, L, Dv = context.shape
        merged = context.transpose(0, 2, 1, 3).reshape(B, L, H * Dv)  # (B, L, H*Dv), a copy when evaluated
        reached(until, "merge", merged)
        return self.linear(p, merged, "o")  # (B, L, D)


def _mask_and_empty(allowed: np.ndarray | None, causal: bool):
    """(the kernel's ``mask=``, the empty rows (1|B, 1, Nq, 1) or None) of a pattern (1|B, 1|H, Nq, Nk)."""
    if causal:
        return "causal", None
    if allowed is None:
        return None, None
    empty = ~allowed.any(axis=-1, keepdims=True)
    return to_mlx(allowed, None), (to_mlx(empty, None) if empty.any() else None)


class MlxBestBackend(BestPath, MlxSDPAOracle):
    name = "mlx-best"
    convention = (
        "MLX at its best, as mlx-lm writes it: nn.Linear projections, mx.fast.scaled_dot_product_attention (GQA "
        "without tiling, mask='causal' where it is bottom-right), mx.vjp; decoding a static cache written in place"
    )
    known_differences = ("the softmax is float32 whatever the input dtype", FLOAT64_LIMIT)
    peer_limits: ClassVar[dict[str, str]] = {
        "decode": "MLX 0.32's own CPU products are slow on this Linux CPU (`scripts/mlx-cpu-costs`, one pinned core, "
        "one BLAS thread: a one-row x @ W.T 3.5 ms against NumPy's 0.47; one token's fused attention over 8k cached "
        "tokens 19.2 ms against 7.7); mlx-lm's code is not at fault, and MLX's CPU backend is not what Apple silicon "
        "runs",
        "forward": "MLX 0.32's own CPU products are slow on this Linux CPU (`scripts/mlx-cpu-costs`, one pinned core, "
        "one BLAS thread: a 512x512x512 float32 product 45.9 ms against NumPy's 2.7); MLX's CPU backend is not what "
        "Apple silicon runs",
    }
    decode_unsupported = ""
    decode_layouts = DECODE_LAYOUTS

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name or "mlx-best"

    def _forward(self, cfg, params, inputs, dtype):
        """``forward(p, x_q, x_k, x_v, until=None)``, its layer and inputs, and how the mask is given."""
        layer = MlxBestLayer(cfg, params, dtype)
        given = layer_inputs(cfg, inputs, dtype, mask=False)
        causal = bottom_right_causal(cfg, inputs)
        mask, empty = _mask_and_empty(None if causal else allowed_positions(cfg, inputs), causal)

        def forward(p, x_q, x_k, x_v, until=None):
            q, k, v = layer.heads_until(p, x_q, x_k, x_v, given["tables"], until)
            context = layer.fused(q, k, v, mask, empty)  # (B, H, Nq, Dv)
            reached(until, FUSED_ATTENTION, context)
            return layer.merge_until(p, context, until)

        how = 'mask="causal" (bottom-right)' if causal else "none" if mask is None else "bool, True = may attend"
        return forward, layer, given, how, (mask, empty)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy) -> Prepared:
        import mlx.core as mx

        forward, layer, given, how, (mask, empty) = self._forward(cfg, params, inputs, dtype)
        stream = mlx_stream(device)
        args = (layer.params, given["x_q"], given["x_k"], given["x_v"])

        def run(until=None):
            with mx.stream(stream):
                return forward(*args, until)

        def recorded(rec):  # the stage dump: mlx-lm's layer recording its stages, the same kernel and zero rows
            with mx.stream(stream):
                q, k, v = layer.heads(*args, given["tables"], rec)
                context = layer.fused(q, k, v, mask, empty)
                rec.record("context", context, ("B", "H", "Nq", "Dv"), "mx.fast.scaled_dot_product_attention")
                return layer.finish(layer.params, context, rec)

        def native_stages() -> dict[str, StageTensor]:
            stages = record_stages(recorded)
            q, k = (tensor_to_numpy(stages[name].value) for name in ("q_rotated", "k_rotated"))
            stages.update(_score_stages(cfg, q, k, allowed_positions(cfg, inputs)))
            return stages

        groups = path_groups(rope=cfg.rope is not None, decode=False, fused=True)
        info = {"mask": how, "gqa": "no tiling (Hkv heads)", **precision_info(dtype)}
        return Prepared(
            run,
            tensor_to_numpy,
            native_stages,
            synchronize=mx.eval,
            info=info,
            stage_cuts=eager_cuts(run, groups, mx.eval),
        )

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        from ..mlx.adapter import prepare_mlx_vjp

        forward, layer, given, how, _ = self._forward(cfg, params, inputs, dtype)
        info = {"mask": how, **precision_info(dtype)}
        return prepare_mlx_vjp(forward, layer.params, given, cotangent, dtype, device, info)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache) -> PreparedDecode:
        import mlx.core as mx

        layer = MlxBestLayer(cfg, params, dtype)
        x = to_mlx(inputs.x, dtype)  # (B, N, D)
        chunks = [
            (chunk, _tables(chunk.tables, dtype), *_mask_and_empty(chunk.allowed, False))
            for chunk in common.decode_chunks(cfg, inputs)
        ]
        stream = mlx_stream(device)

        def run():
            cache = MlxStaticCache(cfg, inputs.batch, inputs.tokens, x.dtype)  # a fresh cache per run
            outputs = []
            with mx.stream(stream):
                for chunk, tables, mask, empty in chunks:
                    x_chunk = x[:, chunk.start : chunk.stop]  # (B, s, D)
                    outputs.append(decode_step(layer, cache, x_chunk, chunk.start, tables, mask, empty))
                    mx.eval(outputs[-1])  # one chunk at a time, as a generation loop evaluates
            return outputs

        info = {
            "cache": cache_info(cfg, inputs.batch, inputs.tokens, x.itemsize, CACHE_LAYOUT),
            **precision_info(dtype),
        }
        return PreparedDecode(
            run, lambda outputs: np.concatenate([tensor_to_numpy(o) for o in outputs], axis=1), synchronize=mx.eval,
            info=info,
        )  # fmt: skip

    def prepare_step(self, cfg, params, data, dtype, device) -> Prepared:
        return prepare_decode_step(cfg, params, data, dtype, device)


class MlxStaticCache:
    """K (B, Hkv, C, Dk) and V (B, Hkv, C, Dv), allocated once; ``write`` fills slots by slice assignment."""

    def __init__(self, cfg: MHAConfig, batch: int, slots: int, dtype) -> None:
        import mlx.core as mx

        self.k = mx.zeros((batch, cfg.n_kv_heads, slots, cfg.d_k), dtype=dtype)  # (B, Hkv, C, Dk)
        self.v = mx.zeros((batch, cfg.n_kv_heads, slots, cfg.d_v), dtype=dtype)  # (B, Hkv, C, Dv)
        mx.eval(self.k, self.v)

    def write(self, k_new, v_new, start: int) -> tuple:
        """Keys (B, Hkv, s, Dk) and values into slots ``start .. start+s-1``; the slots ``0 .. start+s-1``."""
        stop = start + k_new.shape[2]
        self.k[..., start:stop, :] = k_new  # mlx-lm's write: MLX reuses the buffer (no copy of the cache)
        self.v[..., start:stop, :] = v_new
        return self.k[..., :stop, :], self.v[..., :stop, :]  # (B, Hkv, T, d)

    def info(self, cfg: MHAConfig) -> dict:
        return cache_info(cfg, self.k.shape[0], self.k.shape[2], self.k.itemsize, CACHE_LAYOUT)


def decode_step(layer: MlxBestLayer, cache: MlxStaticCache, x, start: int, tables, mask, empty, until=None):
    """Tokens ``x`` (B, s, D) written to slots ``start ..``, then attending over the written slots: (B, s, D)."""
    q, k_new, v_new = layer.heads_until(layer.params, x, x, x, tables, until)
    k, v = cache.write(k_new, v_new, start)  # (B, Hkv, T, d)
    reached(until, CACHE_WRITE, k, v)
    context = layer.fused(q, k, v, mask, empty)  # (B, H, s, Dv)
    reached(until, FUSED_ATTENTION, context)
    return layer.merge_until(layer.params, context, until)


def _tables(tables, dtype: str) -> dict | None:
    """(cos, sin) (1|B, N, r/2) float64 -> mlx-lm's layer's {"q": .., "k": ..} (1|B, 1, N, r/2); None stays."""
    if tables is None:
        return None
    pair = tuple(to_mlx(t[:, None], dtype) for t in tables)
    return {"q": pair, "k": pair}


def prepare_decode_step(cfg: MHAConfig, params, data: DecodeStepInputs, dtype: str, device: str) -> Prepared:
    """One timed step: ``data.step`` tokens written at slot ``data.context`` of a cache of ``context + step`` slots
    holding the context; every call writes the same slots (the same step), allocating no cache."""
    import mlx.core as mx

    layer = MlxBestLayer(cfg, params, dtype)
    batch, context = data.x.shape[0], data.context
    x = to_mlx(data.x, dtype)  # (B, s, D)
    cache = MlxStaticCache(cfg, batch, context + data.step, x.dtype)
    cache.k[..., :context, :], cache.v[..., :context, :] = to_mlx(data.k, dtype), to_mlx(data.v, dtype)
    mx.eval(cache.k, cache.v)
    tables = _tables(data.tables, dtype)
    mask, empty = _mask_and_empty(data.allowed, False)
    stream = mlx_stream(device)

    def forward(until=None):
        with mx.stream(stream):
            return decode_step(layer, cache, x, context, tables, mask, empty, until)

    mx.eval(forward())  # once, untimed
    groups = path_groups(rope=cfg.rope is not None, decode=True, fused=True)
    info = {"cache": cache.info(cfg), "context": context, "step": data.step, **precision_info(dtype)}
    return Prepared(
        forward, tensor_to_numpy, lambda: common.output_stage(forward()), synchronize=mx.eval, info=info,
        stage_cuts=eager_cuts(forward, groups, mx.eval),
    )  # fmt: skip
