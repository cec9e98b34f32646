"""The chunked (memory-linear) strategy of the NumPy adapter, in column samples.

The recurrence is the one described in `_chunking`. In column samples every query is a
column, so a score tile is ``K_blk^T @ Q_blk``, ``(k_block, q_block)``: the running maximum
and sum are reductions over axis -2 (the keys), one value per query column, and the
accumulator update ``V_blk @ P`` is ``(Dv, k_block) @ (k_block, q_block)``, a plain
product, exactly as in the full column-sample pipeline. All heads (and GQA groups, as
``(B, Hkv, G, ...)``) are handled by one broadcast product per tile, so one tile per head
is alive at a time.
"""

from __future__ import annotations

import numpy as np

from .._chunking import key_block_end, resolve_chunk, tile_allowed
from .._recording import StageRecorder, relation_to
from .layer import ColumnSampleMHA, _split_reshape


class ChunkedColumnSampleMHA(ColumnSampleMHA):
    """`ColumnSampleMHA` with the chunked strategy; the mask stays the caller's (causal by index)."""

    materialise_mask = False  # the causal part is computed per tile; see `_chunking.tile_allowed`

    def __init__(self, cfg, params, inputs, precision, chunk: tuple[int, int] | None) -> None:
        super().__init__(cfg, params, inputs, precision, batched=False)
        self.user_mask = inputs.mask  # (1|B, 1|H, Nq, Nk) or None, True = may attend
        self.chunk = resolve_chunk(chunk, inputs.q_tokens, inputs.kv_tokens)

    def _tile_allowed(self, q_range, k_range):
        """The tile's allowed positions in this adapter's layout, (1|B, 1|Hkv, 1|G, kb, qb), or None."""
        allowed = tile_allowed(self.user_mask, self.cfg.causal, q_range, k_range)  # (1|B, 1|H, qb, kb)
        if allowed is None:
            return None
        B_, H_, n_q, n_k = allowed.shape  # token axes may be 1 (broadcast)
        groups = (self.cfg.n_kv_heads, self.cfg.group_size) if H_ > 1 else (1, 1)
        return allowed.swapaxes(-1, -2).reshape(B_, *groups, n_k, n_q)  # (1|B, 1|Hkv, 1|G, kb, qb), keys first

    def chunked(self, rec: StageRecorder | None = None) -> np.ndarray:
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes
        P = self.precision
        q_block, k_block = self.chunk
        self.tiles_visited = 0  # score tiles computed (skipped ones not counted): the tests read it
        q, k, v = self._projections()  # (B, H*Dk, Nq), (B, Hkv*Dk, Nk), (B, Hkv*Dv, Nk)
        q_heads = q.reshape(B, H, Dk, Nq)  # (B, H, Dk, Nq), view: head h owns rows h*Dk:(h+1)*Dk
        k_heads = k.reshape(B, Hkv, Dk, Nk)  # (B, Hkv, Dk, Nk), view
        v_heads = v.reshape(B, Hkv, Dv, Nk)  # (B, Hkv, Dv, Nk), view
        how = "reshape of the row axis, no transpose"
        heads = (q_heads, k_heads, v_heads)
        q_rotated, k_rotated = self._rotate_split(rec, (q, k, v), heads, how, _split_reshape)  # QK-normed, rotated
        q_groups = q_rotated.reshape(B, Hkv, G, Dk, Nq)  # (B, Hkv, G, Dk, Nq), view: query head h = g*G + r
        keys_t = k_rotated[:, :, None].swapaxes(-1, -2)  # (B, Hkv, 1, Nk, Dk), view: K_g^T, shared by the group
        values = v_heads[:, :, None]  # (B, Hkv, 1, Dv, Nk), view
        context = np.empty((B, Hkv, G, Dv, Nq), dtype=P.storage)  # linear in the tokens
        for q_start in range(0, Nq, q_block):
            q_end = min(q_start + q_block, Nq)
            queries = P.operand(q_groups[..., q_start:q_end]) * self.cfg.scale  # (B, Hkv, G, Dk, qb), a copy
            n_q = q_end - q_start
            peak = np.full((B, Hkv, G, 1, n_q), -np.inf, dtype=P.compute)  # running max, one per query column
            total = np.zeros((B, Hkv, G, 1, n_q), dtype=P.compute)  # running sum of exp(score - peak)
            acc = np.zeros((B, Hkv, G, Dv, n_q), dtype=P.compute)  # running sum of exp(score - peak) * v
            for k_start in range(0, key_block_end(q_end, Nk, self.cfg.causal), k_block):
                k_end = min(k_start + k_block, Nk)
                allowed = self._tile_allowed((q_start, q_end), (k_start, k_end))
                if allowed is not None and not allowed.any():
                    continue  # nothing in this tile may be attended to: it changes no sum
                self.tiles_visited += 1
                tile = np.matmul(P.operand(keys_t[..., k_start:k_end, :]), queries)  # (B, Hkv, G, kb, qb)
                if allowed is not None:
                    np.copyto(tile, -np.inf, where=~allowed)
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
            # A query that saw no allowed key has total 0 and acc 0: dividing by 1 gives the spec's zero.
            context[..., q_start:q_end] = P.store(acc / np.where(total > 0, total, 1.0))
        context = context.reshape(B, H, Dv, Nq)  # (B, H, Dv, Nq), view
        if rec is not None:
            rec.record("context", context, ("B", "H", "Dv", "Nq"), "acc / l per query block (online softmax)")
        merged = context.reshape(B, H * Dv, Nq)  # (B, H*Dv, Nq), view: heads stacked as row blocks
        if rec is not None:
            relation = relation_to(merged, context)
            rec.record("merged", merged, ("B", "H*Dv", "Nq"), "reshape, no transpose", relation, "context")
        return self._finish(merged, rec)
