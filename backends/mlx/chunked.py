"""The chunked (memory-linear) strategy of the MLX adapter: the online softmax of `_chunking`, in mlx-lm's layout.

Where it means something in MLX: on Metal the fused ``mx.fast.scaled_dot_product_attention`` already
walks the keys in blocks; the CPU fallback (this machine's) and any hand-written MLX attention
materialise the (Nq, Nk) scores. This strategy keeps one ``(q_block, k_block)`` tile per head alive.

Row samples, heads first as the layer holds them: a tile is ``q_blk @ k_blk^T`` with the G query heads
of a group grouped against their kv head (B, Hkv, G, qb, kb), no tiling of the keys. The running
maximum and sum are reductions over the last axis; MLX arrays are immutable, so each step makes new
ones (lazily: one graph per query block, evaluated at the end). Key tiles above the causal diagonal
or outside the window are never visited (`_chunking.plan_tiles`, on the positions); a tile the
mask blocks entirely is skipped at run time. Each visited tile goes through the score steps before
the softmax (`frameworks.ops.masked_scores`, its bias for the tile's positions); the sinks start the
online softmax (`frameworks.ops.online_start`). Half precision: tiles and sums in float32, each query
block's context rounded once.
"""

from __future__ import annotations

from .._chunking import plan_for, resolve_chunk, tile_allowed, tile_distances
from .._recording import StageRecorder
from ..frameworks.mlx import to_mlx
from ..frameworks.ops import masked_scores, online_start
from ..frameworks.ops_mlx import compute_dtype
from ..frameworks.score_parts import score_parts
from .layer import MlxAttention


class ChunkedMlxAttention:
    """mlx-lm's attention with the score matrix walked in tiles; ``forward`` as `MlxAttention.forward`'s, chunked."""

    def __init__(self, layer: MlxAttention, inputs, chunk: tuple[int, int] | None) -> None:
        cfg = layer.cfg
        self.layer, self.cfg = layer, cfg
        self.mask = inputs.mask  # (1|B, 1|H, Nq, Nk) NumPy or None, True = may attend (causal and window per tile)
        self.positions, self.kv_positions = inputs.positions, inputs.kv_positions  # (1|B, N) int64
        self.chunk = resolve_chunk(chunk, inputs.q_tokens, inputs.kv_tokens)
        self.plan = plan_for(cfg, inputs, self.chunk)
        self.tiles_visited = self.tiles_skipped = 0

    def _tile_blocked(self, q_range, k_range):
        """The tile's blocked positions as an MLX bool (1|B, 1|H, qb, kb); None: nothing blocked; False: all (the
        tile is skipped). Counts the tiles visited and skipped."""
        where = {"positions": self.positions, "kv_positions": self.kv_positions, "cfg": self.cfg}  # + window, chunks
        allowed = tile_allowed(self.mask, self.cfg.causal, q_range, k_range, **where)  # (1|B, 1|H, qb, kb)
        skip = allowed is not None and not allowed.any()  # nothing in the tile may be attended to: no sum changes
        self.tiles_skipped += skip
        self.tiles_visited += not skip
        return False if skip else None if allowed is None else to_mlx(~allowed, None)

    def attend(self, p: dict, q, k, v):
        """Context (B, H, Nq, Dv) by the online softmax over the planned tiles."""
        mx, cfg, ops = self.layer.mx, self.cfg, self.layer.ops
        B, H, _, Dk = q.shape  # (B, H, Nq, Dk)
        Hkv, Dv, G = k.shape[1], v.shape[-1], cfg.group_size
        cdt = compute_dtype(q.dtype)
        keys = k.astype(cdt)[:, :, None]  # (B, Hkv, 1, Nk, Dk): each kv head once, broadcast over its group
        values = v.astype(cdt)[:, :, None]  # (B, Hkv, 1, Nk, Dv)
        parts = score_parts(cfg, p, lambda a: a.reshape(1, H, 1, 1))  # (1, H, 1, 1): one value per query head
        self.tiles_visited = self.tiles_skipped = 0
        blocks = []
        for (q_start, q_end), key_tiles in self.plan.blocks:
            n_q = q_end - q_start
            queries = (q[:, :, q_start:q_end].astype(cdt) * cfg.scale).reshape(B, Hkv, G, n_q, Dk)
            peak, total = online_start(ops, parts, (B, H, n_q, 1), cdt)  # (B, H, qb, 1) each
            acc = mx.zeros((B, H, n_q, Dv), dtype=cdt)  # running sum of exp(score - peak) * v
            for k_start, k_end in key_tiles:
                blocked = self._tile_blocked((q_start, q_end), (k_start, k_end))
                if blocked is False:
                    continue
                n_k = k_end - k_start
                tile = (queries @ keys[:, :, :, k_start:k_end].swapaxes(-1, -2)).reshape(B, H, n_q, n_k)
                bias = None
                if cfg.has_score_bias:  # (1|B, H, qb, kb) from the tile's positions
                    distance = tile_distances(self.positions, self.kv_positions, (q_start, q_end), (k_start, k_end))
                    bias = self.layer.score_bias(p, distance)
                tile = masked_scores(ops, cfg, tile, bias=bias, blocked=blocked)
                new_peak = mx.maximum(peak, mx.max(tile, axis=-1, keepdims=True))  # (B, H, qb, 1)
                # Nothing allowed yet: the peak stays -inf and the shift is 0, so exp(-inf) = 0, never NaN.
                shift = mx.where(mx.isinf(new_peak), mx.zeros_like(new_peak), new_peak)
                rescale = mx.exp(peak - shift)  # exp(old peak - new peak): 0 where nothing was seen
                weights = mx.exp(tile - shift)  # (B, H, qb, kb)
                total = total * rescale + mx.sum(weights, axis=-1, keepdims=True)
                update = weights.reshape(B, Hkv, G, n_q, n_k) @ values[:, :, :, k_start:k_end]  # (B, Hkv, G, qb, Dv)
                acc = acc * rescale + update.reshape(B, H, n_q, Dv)
                peak = new_peak
            # A query that saw no allowed key has total 0 (1 with a sink) and acc 0: the spec's zero context.
            blocks.append((acc / mx.where(total > 0, total, mx.ones_like(total))).astype(q.dtype))
        return mx.concatenate(blocks, axis=2)  # (B, H, Nq, Dv)

    def forward(self, p: dict, x_q, x_k, x_v, tables, blocked=None, distance=None, rec: StageRecorder | None = None):
        """The whole layer, chunked: (B, Nq, D). ``blocked`` and ``distance`` are unused (made per tile)."""
        q, k, v = self.layer.heads(p, x_q, x_k, x_v, tables, rec)
        context = self.attend(p, q, k, v)
        if rec is not None:
            rec.record("context", context, ("B", "H", "Nq", "Dv"), "acc / l per query block (online softmax)")
        return self.layer.finish(p, context, rec, x_q)
