"""What several variants share: the key-minus-query distance and the softmax whose empty rows are zeros."""

from __future__ import annotations

import numpy as np


def relative_distances(positions: np.ndarray, kv_positions: np.ndarray) -> np.ndarray:
    """``p_j - p_i``: (1|B, Nq) and (1|B, Nk) int positions -> (1|B, Nq, Nk), key minus query."""
    return kv_positions[:, None, :] - positions[:, :, None]


def softmax_with_empty_rows(scores: np.ndarray) -> np.ndarray:
    """Softmax over the last axis where rows of all -inf give zeros instead of NaN."""
    row_max = np.max(scores, axis=-1, keepdims=True)
    empty = np.isneginf(row_max)
    # Subtracting the row maximum keeps exp() in range for logits of any size.
    shifted = scores - np.where(empty, 0.0, row_max)
    exp = np.exp(shifted)
    total = np.sum(exp, axis=-1, keepdims=True)
    return np.where(empty, 0.0, exp / np.where(empty, 1.0, total))
