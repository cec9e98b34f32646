"""What the chunked (memory-linear) strategy of every adapter shares: block sizes and tile masks.

The chunked strategy is the FlashAttention recurrence, written in each adapter's own
convention. Queries are taken ``q_block`` at a time; for each query block the keys are
walked ``k_block`` at a time, and each query keeps three running quantities:

* ``m``, the largest score seen so far (the softmax shift);
* ``l``, the sum of ``exp(score - m)`` over the keys seen so far;
* ``acc``, the sum of ``exp(score - m) * v`` over the keys seen so far.

When a new key block raises the maximum from ``m`` to ``m'``, the old sums are rescaled
by ``exp(m - m')`` before the block's own terms are added; after the last block the
context is ``acc / l``. At no time is more than one ``(q_block, k_block)`` score tile
per head alive, so memory grows linearly with the tokens instead of quadratically.
The sums run in another order than a full softmax, so results differ from the other
strategies in the last bits (float64: about 1e-16 relative), never more.

Masks: a causal mask is computed per tile from the token indices (never materialised),
and key blocks that lie entirely above the diagonal are not visited at all; a user mask
is read one tile at a time, and a tile with nothing allowed is skipped. A query with
no allowed key ends with ``l = 0`` and ``acc = 0`` and gets a zero context, the spec's
answer, without any 0/0. Half precision: the tiles and the running sums are float32.

The chunked path cannot expose the full score, masked-score or weight tensors (it never
holds them): its stage tensors are the projections, the split heads (rotated, with rope),
the context, the merged heads and the output. The rotary embedding is the adapter's own,
applied to whole heads before the blocks (its tables are linear in the tokens).
"""

from __future__ import annotations

import numpy as np

CHUNKED = "chunked"
# (q_block, k_block): a (128, 256) float32 tile is 128 KiB per head, so eight heads of one
# batch item fit a 1 MiB L2 cache; blocks larger than the token count are cut to it.
DEFAULT_CHUNK = (128, 256)
# What the agreement check passes: blocks that divide none of its token counts (5 to 9),
# so every case crosses partial blocks, skipped causal blocks and rescaling steps.
CHECK_CHUNK = (3, 4)
# The stages the chunked strategy never holds whole (one tile per head at a time).
CHUNKED_HIDDEN_STAGES = ("scores", "masked_scores", "weights")
CHUNKED_STAGES_NOTE = (
    "the chunked strategy never holds the full scores or weights (one (q_block, k_block) tile per head at a time); "
    "it exposes q, k, v, the split (and rotated) heads, context, merged and output"
)


def check_chunk(chunk: object) -> tuple[int, int] | None:
    """``chunk`` as ``(q_block, k_block)`` positive ints (an int means both), or None for the defaults."""
    if chunk is None:
        return None
    values = (chunk, chunk) if isinstance(chunk, (int, np.integer)) and not isinstance(chunk, bool) else chunk
    try:
        q_block, k_block = values
    except (TypeError, ValueError):
        raise TypeError(f"chunk must be (q_block, k_block) or one int for both, got {chunk!r}") from None
    for name, value in (("q_block", q_block), ("k_block", k_block)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"chunk: {name} must be an int, got {value!r} ({type(value).__name__})")
        if value <= 0:
            raise ValueError(f"chunk: {name} must be a positive int, got {value}")
    return int(q_block), int(k_block)


def resolve_chunk(chunk: tuple[int, int] | None, q_tokens: int, kv_tokens: int) -> tuple[int, int]:
    """Concrete blocks for these token counts: the defaults where None, cut to the token counts."""
    q_block, k_block = DEFAULT_CHUNK if chunk is None else chunk
    return min(q_block, q_tokens), min(k_block, kv_tokens)


def key_block_end(q_end: int, kv_tokens: int, causal: bool) -> int:
    """How far the keys of a query block ending at ``q_end`` go: under a (top-left) causal
    mask query ``i`` sees keys ``j <= i``, so keys from ``q_end`` on are masked for the block."""
    return min(kv_tokens, q_end) if causal else kv_tokens


def tile_allowed(mask: np.ndarray | None, causal: bool, q_range: tuple[int, int], k_range: tuple[int, int]):
    """The allowed positions of one tile, (1|B, 1|H, q_block, k_block), True = may attend; None: all.

    ``mask`` is the caller's mask, 4-D broadcastable to (B, H, Nq, Nk) (`MHAInputs.mask`),
    without the causal part: that is computed here from the indices of this tile only.
    """
    (q_start, q_end), (k_start, k_end) = q_range, k_range
    allowed = None
    if mask is not None:
        # An axis of length 1 broadcasts (a padding mask is (B, 1, 1, Nk)): keep it whole.
        rows = slice(q_start, q_end) if mask.shape[2] > 1 else slice(None)
        cols = slice(k_start, k_end) if mask.shape[3] > 1 else slice(None)
        allowed = mask[:, :, rows, cols]  # (1|B, 1|H, qb|1, kb|1), a view
    if causal and k_end - 1 > q_start:  # some key of the tile lies after some query: the diagonal crosses it
        rows = np.arange(q_start, q_end)[:, None]  # (qb, 1)
        cols = np.arange(k_start, k_end)[None, :]  # (1, kb)
        below = (cols <= rows)[None, None]  # (1, 1, qb, kb)
        allowed = below if allowed is None else allowed & below
    return allowed
