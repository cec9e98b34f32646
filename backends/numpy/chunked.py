"""The chunked (memory-linear) strategy of the NumPy adapter, in column samples.

The recurrence is the one described in `_chunking`. In column samples every query is a
column, so a score tile is ``K_blk^T @ Q_blk``, ``(k_block, q_block)``: the running maximum
and sum are reductions over axis -2 (the keys), one value per query column, and the
accumulator update ``V_blk @ P`` is ``(Dv, k_block) @ (k_block, q_block)``, a plain
product, exactly as in the full column-sample pipeline. All heads (and GQA groups, as
``(B, Hkv, G, ...)``) are handled by one broadcast product per tile, so one tile per head
is alive at a time. The variants inside the tiles are those `_chunking` describes, each tile's
score steps NumPy's ops object's in the compute dtype; the score bias of a tile comes from its
positions (`variants.ColumnVariants.tile_bias`, the same function the full strategies use).
"""

from __future__ import annotations

import numpy as np

from .._chunking import plan_for, resolve_chunk, tile_allowed, tile_distances
from .._recording import StageRecorder, relation_to
from ..frameworks.ops import masked_scores, online_start
from ..frameworks.ops_numpy import NumpyOps
from .layer import ColumnSampleMHA


class ChunkedColumnSampleMHA(ColumnSampleMHA):
    """`ColumnSampleMHA` with the chunked strategy; the mask stays the caller's (causal and window per tile)."""

    # The causal part, the window and the score bias are computed per tile (`_chunking.tile_allowed`, `_tile_bias`).
    materialise_mask = False

    def __init__(self, cfg, params, inputs, precision, chunk: tuple[int, int] | None) -> None:
        super().__init__(cfg, params, inputs, precision, batched=False)
        self.user_mask = inputs.mask  # (1|B, 1|H, Nq, Nk) or None, True = may attend
        self.positions, self.kv_positions = inputs.positions, inputs.kv_positions  # (1|B, Nq), (1|B, Nk)
        self.chunk = resolve_chunk(chunk, inputs.q_tokens, inputs.kv_tokens)
        # Which tiles are computed, decided once from the blocks' indices and positions (causal, window, chunks).
        self.plan = plan_for(cfg, inputs, self.chunk)

    def _tile_allowed(self, q_range, k_range):
        """The tile's allowed positions in this adapter's layout, (1|B, 1|Hkv, 1|G, kb, qb), or None."""
        allowed = tile_allowed(
            self.user_mask,
            self.cfg.causal,
            q_range,
            k_range,
            positions=self.positions,
            kv_positions=self.kv_positions,
            cfg=self.cfg,  # the window and Llama 4's chunks (core's mask entries) on the tile's positions
        )  # (1|B, 1|H, qb, kb)
        if allowed is None:
            return None
        B_, H_, n_q, n_k = allowed.shape  # token axes may be 1 (broadcast)
        groups = (self.cfg.n_kv_heads, self.cfg.group_size) if H_ > 1 else (1, 1)
        return allowed.swapaxes(-1, -2).reshape(B_, *groups, n_k, n_q)  # (1|B, 1|Hkv, 1|G, kb, qb), keys first

    def _tile_bias(self, q_range, k_range):
        """ALiBi and T5's bias of one tile from its positions, (1|B, Hkv, G, kb, qb), or None without either."""
        if not self.cfg.has_score_bias:
            return None
        distance = tile_distances(self.positions, self.kv_positions, q_range, k_range).swapaxes(-1, -2)  # (1|B, kb, qb)
        bias = self.variants.tile_bias(distance)  # (1|B, H, kb, qb), a new array
        return bias.reshape(bias.shape[0], self.cfg.n_kv_heads, self.cfg.group_size, *bias.shape[2:])  # a view

    def chunked(self, rec: StageRecorder | None = None) -> np.ndarray:
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        P, cfg = self.precision, self.cfg
        self.tiles_visited = 0  # score tiles computed (skipped ones not counted): the tests read it
        q_rotated, k_rotated, v_heads = self._standard_heads(rec)  # the standard split's, QK-normed and rotated
        q_groups = q_rotated.reshape(B, Hkv, G, Dk, Nq)  # (B, Hkv, G, Dk, Nq), view: query head h = g*G + r
        keys_t = k_rotated[:, :, None].swapaxes(-1, -2)  # (B, Hkv, 1, Nk, Dk), view: K_g^T, shared by the group
        values = v_heads[:, :, None]  # (B, Hkv, 1, Dv, Nk), view
        # The score parts (1, H, 1, 1) -> (1, Hkv, G, 1, 1), views: one value per query head, as the tiles group them.
        parts = {part: value.reshape(1, Hkv, G, 1, 1) for part, value in self.variants.parts.items()}
        context = np.empty((B, Hkv, G, Dv, Nq), dtype=P.storage)  # linear in the tokens
        tile_ops = NumpyOps(P.compute.name, keys_axis=-2)  # the score steps on the tiles, never rounded to storage
        for (q_start, q_end), key_blocks in self.plan.blocks:
            queries = P.operand(q_groups[..., q_start:q_end]) * cfg.scale  # (B, Hkv, G, Dk, qb), a copy
            n_q = q_end - q_start
            # The running max and sum of exp(score - peak), one per query column (from the sink, where on).
            peak, total = online_start(tile_ops, parts, (B, Hkv, G, 1, n_q), P.compute)
            acc = np.zeros((B, Hkv, G, Dv, n_q), dtype=P.compute)  # running sum of exp(score - peak) * v
            for k_start, k_end in key_blocks:
                allowed = self._tile_allowed((q_start, q_end), (k_start, k_end))
                if allowed is not None and not allowed.any():
                    continue  # nothing in this tile may be attended to: it changes no sum
                self.tiles_visited += 1
                tile = np.matmul(P.operand(keys_t[..., k_start:k_end, :]), queries)  # (B, Hkv, G, kb, qb)
                bias = self._tile_bias((q_start, q_end), (k_start, k_end))
                blocked = None if allowed is None else ~allowed
                tile = masked_scores(tile_ops, cfg, tile, bias=bias, blocked=blocked)  # in place, the compute dtype
                new_peak = np.maximum(peak, tile.max(axis=-2, keepdims=True))  # (B, Hkv, G, 1, qb)
                # A query with nothing allowed yet keeps peak -inf; shifting by 0 leaves its
                # exp(-inf) = 0 instead of -inf - (-inf) = NaN.
                shift = np.where(np.isneginf(new_peak), 0.0, new_peak).astype(P.compute)
                rescale = np.exp(peak - shift)  # exp(old peak - new peak): 0 where nothing was seen
                tile -= shift
                np.exp(tile, out=tile)  # (B, Hkv, G, kb, qb): exp(score - new peak), in place
                total *= rescale
                total += tile.sum(axis=-2, keepdims=True)
                acc *= rescale
                acc += np.matmul(P.operand(values[..., k_start:k_end]), tile)  # (Dv, kb) @ (kb, qb) per head
                peak = new_peak
            # A query that saw no allowed key has total 0 (or the sink's share) and acc 0: the spec's zero.
            context[..., q_start:q_end] = P.store(acc / np.where(total > 0, total, 1.0))
        context = context.reshape(B, H, Dv, Nq)  # (B, H, Dv, Nq), view
        if rec is not None:
            rec.record("context", context, ("B", "H", "Dv", "Nq"), "acc / l per query block (online softmax)")
        merged = context.reshape(B, H * Dv, Nq)  # (B, H*Dv, Nq), view: heads stacked as row blocks
        if rec is not None:
            relation = relation_to(merged, context)
            rec.record("merged", merged, ("B", "H*Dv", "Nq"), "reshape, no transpose", relation, "context")
        return self._finish(merged, rec)
