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

Masks: a causal mask is computed per tile from the token positions (never materialised;
bottom-right on a decode step's positions, top-left with the default ones), and key blocks
that lie entirely after every query's position are not visited at all; a user mask
is read one tile at a time, and a tile with nothing allowed is skipped. A query with
no allowed key ends with ``l = 0`` and ``acc = 0`` and gets a zero context, the spec's
answer, without any 0/0. Half precision: the tiles and the running sums are float32.

The variants (`core.variants`) inside the tiles:

* a sliding window (``cfg.window``) is computed per tile from the token positions, like
  the causal part, and a tile whose every key lies ``window`` or more positions from every
  query is never visited (`plan_tiles` decides that from the blocks' positions alone, at
  prepare time, and counts what it skipped); the band along the diagonal is what remains,
  about ``N / q_block * (window / k_block + 2)`` tiles instead of ``N**2 / (2 q_block k_block)``;
* each tile's scores go through the score steps before the softmax (`frameworks.ops.masked_scores`),
  the score bias that of the tile's positions (`tile_distances`);
* the sinks sit in the denominator only: each query starts with ``m = sink_h`` and
  ``l = 1`` (the sink's own ``exp(sink - m)``) and ``acc = 0`` (`frameworks.ops.online_start`),
  so the recurrence rescales the sink's term with every other. A query with no allowed key then
  ends with ``acc = 0``: a zero context, as the spec says.

QK-norm, the qkv biases and rope scaling act on whole heads before the blocks (their tables
and statistics are linear in the tokens), so they come without a change to the tiles.

The chunked path cannot expose the full score-like tensors (scores, capped and biased
scores, masked scores, weights: it never holds them): its stage tensors are the
projections, the split heads (QK-normed and rotated, with those variants), the context,
the merged heads and the output. The rotary embedding is the adapter's own,
applied to whole heads before the blocks (its tables are linear in the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core.inputs import causal_allowed
from mha_rosetta.core.stages import SCORE_VARIANT_STAGES
from mha_rosetta.core.variants import allowed_by_masks, relative_distances, steps_at_place, window_allowed

CHUNKED = "chunked"
# (q_block, k_block): a (128, 256) float32 tile is 128 KiB per head, so eight heads of one
# batch item fit a 1 MiB L2 cache; blocks larger than the token count are cut to it.
DEFAULT_CHUNK = (128, 256)
# What the agreement check passes: blocks that divide none of its token counts (5 to 9),
# so every case crosses partial blocks, skipped causal blocks and rescaling steps.
CHECK_CHUNK = (3, 4)
# The stages the chunked strategy never holds whole (one tile per head at a time).
CHUNKED_HIDDEN_STAGES = ("scores", *SCORE_VARIANT_STAGES, "masked_scores", "weights")
CHUNKED_STAGES_NOTE = (
    "the chunked strategy never holds the full scores or weights (one (q_block, k_block) tile per head at a time); "
    "it exposes q, k, v, the split (QK-normed and rotated) heads, context, merged and output"
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


def key_block_end(q_range: tuple[int, int], kv_tokens: int, causal: bool, positions=None, kv_positions=None) -> int:
    """How far the keys of a query block go: under the causal rule on positions (``p_j <= p_i``) every key
    after the last one at or before the block's latest query position is masked in every batch item.

    With the default positions that is the top-left ``min(kv_tokens, q_end)``; on a decode step's
    positions (queries after the cached keys) it is bottom-right. Without positions: the indices.
    """
    q_start, q_end = q_range
    if not causal:
        return kv_tokens
    if positions is None or kv_positions is None:
        return min(kv_tokens, q_end)
    latest = positions[:, q_start:q_end].max(axis=1)  # (1|B,): the block's latest query position per item
    visible = np.flatnonzero(np.any(kv_positions <= latest[:, None], axis=0))  # keys some query may see
    return int(visible[-1]) + 1 if visible.size else 0


def tile_allowed(
    mask: np.ndarray | None,
    causal: bool,
    q_range: tuple[int, int],
    k_range: tuple[int, int],
    *,
    window: int | None = None,
    positions: np.ndarray | None = None,
    kv_positions: np.ndarray | None = None,
    cfg=None,
):
    """The allowed positions of one tile, (1|B, 1|H, q_block, k_block), True = may attend; None: all.

    ``mask`` is the caller's mask, 4-D broadcastable to (B, H, Nq, Nk) (`MHAInputs.mask`),
    without the causal part: that is computed here for this tile only, on the positions when given
    (`core.inputs.causal_allowed`), else on the indices. With
    ``window`` (`MHAConfig.window`) the sliding window is computed here too, from the tile's
    token positions (``positions`` (1|B, Nq), ``kv_positions`` (1|B, Nk), `MHAInputs`). With ``cfg``
    (`MHAConfig`) every positional mask entry of core's registry it has (the window, Llama 4's chunks) is.
    """
    (q_start, q_end), (k_start, k_end) = q_range, k_range
    allowed = None
    if mask is not None:
        # An axis of length 1 broadcasts (a padding mask is (B, 1, 1, Nk)): keep it whole.
        rows = slice(q_start, q_end) if mask.shape[2] > 1 else slice(None)
        cols = slice(k_start, k_end) if mask.shape[3] > 1 else slice(None)
        allowed = mask[:, :, rows, cols]  # (1|B, 1|H, qb|1, kb|1), a view
    if causal and positions is not None and kv_positions is not None:  # on the positions (p_j <= p_i)
        q_pos, k_pos = positions[:, q_start:q_end], kv_positions[:, k_start:k_end]  # views, (1|B, qb), (1|B, kb)
        if k_pos.max() > q_pos.min():  # some key of the tile lies after some query: the diagonal crosses it
            below = causal_allowed(q_pos, k_pos)  # (1|B, 1, qb, kb)
            allowed = below if allowed is None else allowed & below
    elif causal and k_end - 1 > q_start:  # no positions: the indices
        rows = np.arange(q_start, q_end)[:, None]  # (qb, 1)
        cols = np.arange(k_start, k_end)[None, :]  # (1, kb)
        below = (cols <= rows)[None, None]  # (1, 1, qb, kb)
        allowed = below if allowed is None else allowed & below
    if window is not None:
        if positions is None or kv_positions is None:
            raise ValueError("tile_allowed: a window needs positions and kv_positions (MHAInputs), got None")
        near = window_allowed(window, causal, positions[:, q_start:q_end], kv_positions[:, k_start:k_end])
        allowed = near if allowed is None else allowed & near  # near: (1|B, 1, qb, kb)
    if cfg is not None and steps_at_place(cfg, "mask"):
        if positions is None or kv_positions is None:
            raise ValueError("tile_allowed: a positional mask needs positions and kv_positions (MHAInputs), got None")
        tile = positions[:, q_start:q_end], kv_positions[:, k_start:k_end]  # views, (1|B, qb), (1|B, kb)
        allowed = allowed_by_masks(cfg, *tile, allowed)  # (1|B, 1|H, qb, kb)
    return allowed


def tile_distances(positions: np.ndarray, kv_positions: np.ndarray, q_range, k_range) -> np.ndarray:
    """``p_j - p_i`` (key minus query) of one tile, int64 (1|B, q_block, k_block): what ALiBi and T5's buckets read."""
    (q_start, q_end), (k_start, k_end) = q_range, k_range
    return relative_distances(positions[:, q_start:q_end], kv_positions[:, k_start:k_end])


def outside_window(window: int, causal: bool, q_positions: np.ndarray, k_positions: np.ndarray) -> bool:
    """True when no query of a tile may see any of its keys through the window, from the positions' bounds.

    ``q_positions`` (1|B, q_block), ``k_positions`` (1|B, k_block). Every key ``window`` or more
    positions before every query (``max p_j <= min p_i - W``), or, two-sided, that far after
    (``min p_j >= max p_i + W``), in every batch item. A sufficient test, exact for blocks of
    consecutive positions (the default); a tile it keeps is masked exactly by `tile_allowed`.
    """
    before = k_positions.max(axis=1) <= q_positions.min(axis=1) - window  # (1|B,)
    if causal:
        return bool(np.all(before))
    after = k_positions.min(axis=1) >= q_positions.max(axis=1) + window
    return bool(np.all(before | after))


def outside_chunk(chunk_size: int, q_positions: np.ndarray, k_positions: np.ndarray) -> bool:
    """True when no key of a tile lies in the chunk of any of its queries (Llama 4's ``attention_chunk_size``).

    ``q_positions`` (1|B, q_block), ``k_positions`` (1|B, k_block): every key's chunk ``p // C`` before the
    earliest query's, or after the latest's, in every batch item. Exact for blocks of consecutive positions.
    """
    before = k_positions.max(axis=1) // chunk_size < q_positions.min(axis=1) // chunk_size  # (1|B,)
    after = k_positions.min(axis=1) // chunk_size > q_positions.max(axis=1) // chunk_size
    return bool(np.all(before | after))


@dataclass(frozen=True)
class TilePlan:
    """Which score tiles the chunked strategy visits: per query block, the key blocks it computes.

    ``blocks``: ``((q_start, q_end), ((k_start, k_end), ...))`` per query block. ``counts``: every
    tile of the grid (``total``), those never visited because they lie above the causal diagonal
    (``above_diagonal``) or outside the sliding window (``outside_window``), and the rest
    (``planned``); a tile that the caller's mask blocks entirely is skipped as well, at run time.
    """

    blocks: tuple
    counts: dict


def plan_for(cfg, inputs, chunk: tuple[int, int]) -> TilePlan:
    """`plan_tiles` of an `MHAConfig` and its `MHAInputs` (causal, the window and Llama 4's chunks, on the positions)."""
    return plan_tiles(
        chunk,
        inputs.q_tokens,
        inputs.kv_tokens,
        cfg.causal,
        cfg.window,
        inputs.positions,
        inputs.kv_positions,
        chunk_size=cfg.attention_chunk_size,
    )


def plan_tiles(
    chunk: tuple[int, int],
    q_tokens: int,
    kv_tokens: int,
    causal: bool,
    window: int | None = None,
    positions: np.ndarray | None = None,
    kv_positions: np.ndarray | None = None,
    chunk_size: int | None = None,
) -> TilePlan:
    """The tiles of the online softmax for resolved blocks ``chunk`` (`resolve_chunk`), decided before any score.

    Causal: key blocks after the block's last visible key are never visited (`key_block_end`, on positions);
    with ``window``, key blocks wholly outside it (`outside_window`) are not visited either, and with
    ``chunk_size`` (Llama 4's `MHAConfig.attention_chunk_size`) key blocks wholly outside every query's chunk
    (`outside_chunk`: counted as ``outside_chunk``), so only the tiles inside a chunk are visited.
    """
    if (window is not None or chunk_size is not None) and (positions is None or kv_positions is None):
        raise ValueError("plan_tiles: a window or chunks need positions and kv_positions (MHAInputs), got None")
    q_block, k_block = chunk
    n_k_blocks = -(-kv_tokens // k_block)
    blocks, above, outside, apart = [], 0, 0, 0
    for q_start in range(0, q_tokens, q_block):
        q_end = min(q_start + q_block, q_tokens)
        keys = []
        starts = range(0, key_block_end((q_start, q_end), kv_tokens, causal, positions, kv_positions), k_block)
        above += n_k_blocks - len(starts)
        for k_start in starts:
            k_end = min(k_start + k_block, kv_tokens)
            tile = () if positions is None else (positions[:, q_start:q_end], kv_positions[:, k_start:k_end])
            if window is not None and outside_window(window, causal, *tile):
                outside += 1
            elif chunk_size is not None and outside_chunk(chunk_size, *tile):
                apart += 1
            else:
                keys.append((k_start, k_end))
        blocks.append(((q_start, q_end), tuple(keys)))
    total = len(blocks) * n_k_blocks
    counts = {"total": total, "above_diagonal": above, "outside_window": outside}
    if chunk_size is not None:
        counts["outside_chunk"] = apart
    counts["planned"] = total - above - outside - apart
    return TilePlan(tuple(blocks), counts)
