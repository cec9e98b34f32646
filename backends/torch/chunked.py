"""The chunked (memory-linear) strategy of the torch adapter, in row samples.

The recurrence is the one described in `_chunking`. In row samples every query is a row,
so a score tile is ``Q_blk @ K_blk^T``, ``(q_block, k_block)``, the running maximum and sum
are reductions over the last axis, and the accumulator update is ``P @ V_blk``. GQA folds
the G query heads of a group into the row axis, as the standard strategy does, so one
``bmm`` per tile serves every head: one tile per head is alive at a time.

Variants: the sliding window is read per tile from the token positions, and a key tile with
no allowed position (outside the window, above the diagonal, or masked) is skipped whole;
``tiles_skipped`` counts them. Each visited tile goes through the score steps before the softmax
(`frameworks.ops.masked_scores`, its bias `variants.ScoreBias` for the tile's positions); the
sinks start the online softmax (`frameworks.ops.online_start`, as `_chunking` says).
QK-norm and the biases of the projections happen before the tiles, on whole heads.

Half precision: the queries, keys and values are converted to float32 once (linear in the
tokens), every tile and running sum is float32, and each query block's context is rounded
back to the run's dtype when it is done.
"""

from __future__ import annotations

from .._chunking import key_block_end, resolve_chunk, tile_allowed
from .._recording import StageRecorder
from ..frameworks.ops import masked_scores, online_start
from ..frameworks.score_parts import score_parts
from .common import bool_tensor
from .layer import RowSampleMHA

HALF = ("float16", "bfloat16")


class ChunkedRowSampleMHA(RowSampleMHA):
    """`RowSampleMHA` with the chunked strategy; the mask stays the caller's (causal on the positions, per tile)."""

    materialise_mask = False  # the causal part is computed per tile; see `_chunking.tile_allowed`

    def __init__(self, cfg, params, inputs, dtype: str, device: str, chunk: tuple[int, int] | None) -> None:
        super().__init__(cfg, params, inputs, dtype, device, batched=False)
        self.user_mask = inputs.mask  # (1|B, 1|H, Nq, Nk) NumPy or None, True = may attend
        self.positions, self.kv_positions = inputs.positions, inputs.kv_positions  # (1|B, N) int64, for the window
        self.device = device
        self.chunk = resolve_chunk(chunk, inputs.q_tokens, inputs.kv_tokens)
        self.compute_dtype = self.torch.float32 if dtype in HALF else self.x_q.dtype

    def _tile_blocked(self, q_range, k_range):
        """The tile's blocked positions as a torch bool tensor (1|B, 1|H, qb, kb); None: nothing
        blocked; False: everything blocked (the tile can be skipped)."""
        where = {"positions": self.positions, "kv_positions": self.kv_positions, "cfg": self.cfg}
        allowed = tile_allowed(self.user_mask, self.cfg.causal, q_range, k_range, **where)
        # causal, the window and Llama 4's chunks on the tile's positions, (1|B, 1|H, qb, kb)
        if allowed is None:
            return None
        if not allowed.any():
            return False
        return bool_tensor(~allowed, self.device)

    def chunked(self, rec: StageRecorder | None = None):
        torch = self.torch
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes
        q_block, k_block = self.chunk
        self.tiles_visited = 0  # score tiles computed (skipped ones not counted): the tests read it
        self.tiles_skipped = 0  # key tiles inside the walked range with nothing allowed (window, mask)
        q_heads, k_heads, v_heads = self._split_and_rotate(rec)  # (B, H, Nq, Dk), (B, Hkv, Nk, Dk/Dv), rotated
        cdt = self.compute_dtype
        # Each kv head's keys and values once, contiguous in the compute dtype (linear in Nk).
        keys = k_heads.to(cdt).reshape(B * Hkv, Nk, Dk)  # (B*Hkv, Nk, Dk), copy
        values = v_heads.to(cdt).reshape(B * Hkv, Nk, Dv)  # (B*Hkv, Nk, Dv), copy
        context = v_heads.new_empty((B, H, Nq, Dv))  # linear in the tokens
        parts = score_parts(self.cfg, self, lambda t: t.view(1, H, 1, 1))  # (1, H, 1, 1): one value per query head
        for q_start in range(0, Nq, q_block):
            q_end = min(q_start + q_block, Nq)
            n_q = q_end - q_start
            # The G query heads of a group folded into the row axis: (B*Hkv, G*qb, Dk), a copy.
            queries = q_heads[:, :, q_start:q_end].to(cdt).reshape(B * Hkv, G * n_q, Dk) * self.cfg.scale
            # The running max and sum of exp(score - peak), (B, H, qb, 1) (from the sink, where on).
            peak, total = online_start(self.ops, parts, (B, H, n_q, 1), cdt, like=keys)
            acc = torch.zeros((B, H, n_q, Dv), dtype=cdt, device=keys.device)  # running sum of exp(score - peak) * v
            stop = key_block_end((q_start, q_end), Nk, self.cfg.causal, self.positions, self.kv_positions)
            for k_start in range(0, stop, k_block):
                k_end = min(k_start + k_block, Nk)
                blocked = self._tile_blocked((q_start, q_end), (k_start, k_end))
                if blocked is False:
                    self.tiles_skipped += 1
                    continue  # nothing in this tile may be attended to: it changes no sum
                self.tiles_visited += 1
                n_k = k_end - k_start
                tile = torch.bmm(queries, keys[:, k_start:k_end].transpose(1, 2))  # (B*Hkv, G*qb, kb)
                tile = tile.view(B, H, n_q, n_k)  # (B, H, qb, kb), view
                bias = None  # (1|B, H, qb, kb) from the tile's positions
                if self.score_bias is not None:
                    bias = self.score_bias(self.rel_bias, (q_start, q_end), (k_start, k_end))
                tile = masked_scores(self.ops, self.cfg, tile, bias=bias, blocked=blocked)  # in place
                new_peak = torch.maximum(peak, tile.amax(dim=-1, keepdim=True))  # (B, H, qb, 1)
                # Nothing allowed yet: peak stays -inf and the shift is 0, so exp(-inf) = 0, never NaN.
                shift = torch.where(torch.isneginf(new_peak), 0.0, new_peak)
                rescale = torch.exp(peak - shift)  # exp(old peak - new peak): 0 where nothing was seen
                tile.sub_(shift).exp_()  # exp(score - new peak), in place
                total.mul_(rescale).add_(tile.sum(dim=-1, keepdim=True))
                update = torch.bmm(tile.view(B * Hkv, G * n_q, n_k), values[:, k_start:k_end])  # (B*Hkv, G*qb, Dv)
                acc.mul_(rescale).add_(update.view(B, H, n_q, Dv))
                peak = new_peak
            # A query that saw no allowed key has total 0 (1 with a sink) and acc 0: the spec's zero context.
            context[:, :, q_start:q_end] = acc / torch.where(total > 0, total, 1.0)
        if rec is not None:
            rec.record("context", context, ("B", "H", "Nq", "Dv"), "acc / l per query block (online softmax)")
        return self._finish(self._merge(context, rec), rec)
