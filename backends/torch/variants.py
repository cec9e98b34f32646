"""The variants of 2024-26 attention (`core.variants`) in torch, on (B, H, Nq, Nk) row-sample scores.

What is computed where (the rule every torch path here keeps):

* Tables that depend only on the positions are made in NumPy at prepare time with
  `core.variants`, as the rotary tables are, and passed in as constant tensors: the ALiBi
  slopes (``distance_slopes``), the token positions, and T5's bucket of every possible
  distance (a lookup table over ``min(p_j - p_i) .. max(p_j - p_i)``, linear in the tokens).
* Everything on the scores is torch's own arithmetic: ``F.rms_norm`` (or its formula, where
  the statistic is a sum over heads or ranks) here, the bias ``slope_h * (p_j - p_i)`` and the
  table gather ``rel_bias[bucket]`` (so autograd reaches ``rel_bias``) in `ScoreBias`, and the
  score steps themselves in torch's ops object (`frameworks.ops_torch.TorchOps`, run by
  `frameworks.ops.score_steps`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs
from mha_rosetta.core.variants import t5_buckets

from ..frameworks.score_parts import distance_slopes
from .common import to_tensor, torch_device


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, ``x / sqrt(mean(x**2) + eps) * weight``: torch's own ``F.rms_norm``."""
    import torch.nn.functional as F

    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_of_sum(x, weight, eps: float, sum_of_squares, width: int):
    """RMSNorm whose statistic is ``sum_of_squares`` (..., N, 1) over ``width`` features, not x's own.

    For a projection-wide norm seen in pieces: one head at a time (the per-head strategies
    add the heads' sums), or one rank's heads (torch-tp all-reduces the ranks' sums).
    """
    import torch

    return x * torch.rsqrt(sum_of_squares / width + eps) * weight


class ScoreBias:
    """ALiBi's ``m_h (p_j - p_i)`` and T5's ``rel_bias[bucket(p_j - p_i), h]`` for any tile of the scores.

    ``slopes`` (the layer's heads' ALiBi slopes) defaults to `frameworks.score_parts.distance_slopes` of
    ``cfg`` (None without ALiBi); a rank of torch-tp passes its slice of the whole layer's slopes.
    """

    def __init__(
        self, cfg: MHAConfig, inputs: MHAInputs, dtype: str, device: str, slopes: np.ndarray | None = None
    ) -> None:
        import torch

        self.cfg = cfg
        # The bias is formed in float32 at least (BLOOM builds its ALiBi tensor in float32) and rounded once.
        self.dtype = torch.float64 if dtype == "float64" else torch.float32
        place = torch_device(device)
        self.positions = torch.from_numpy(inputs.positions).to(place)  # (1|B, Nq) int64
        self.kv_positions = torch.from_numpy(inputs.kv_positions).to(place)  # (1|B, Nk) int64
        self.slopes = None
        slopes = distance_slopes(cfg) if slopes is None else slopes  # ALiBi's m_h, or None
        if slopes is not None:
            self.slopes = to_tensor(slopes, "float64" if dtype == "float64" else "float32", device)  # (H,)
        self.bucket_of = None
        if cfg.rel_buckets is not None:
            # T5's bucket of every distance that occurs, p_j - p_i from its least to its largest.
            self.lowest = int(inputs.kv_positions.min() - inputs.positions.max())
            highest = int(inputs.kv_positions.max() - inputs.positions.min())
            distances = np.arange(self.lowest, highest + 1)
            buckets = t5_buckets(distances, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)
            self.bucket_of = torch.from_numpy(buckets).to(place)  # (highest - lowest + 1,) int64

    def distance(self, q_range: tuple[int, int] | None = None, k_range: tuple[int, int] | None = None):
        """``p_j - p_i`` of the tile, int64 (1|B, qb, kb) (the whole (Nq, Nk) for None)."""
        q = self.positions if q_range is None else self.positions[:, q_range[0] : q_range[1]]  # (1|B, qb), a view
        k = self.kv_positions if k_range is None else self.kv_positions[:, k_range[0] : k_range[1]]  # (1|B, kb)
        return k[:, None, :] - q[:, :, None]  # (1|B, qb, kb)

    def __call__(self, rel_table, q_range=None, k_range=None, head: int | None = None):
        """The bias of the tile, (1|B, H, qb, kb) in ``self.dtype``; (1|B, qb, kb) for one ``head``.

        ``rel_table`` is the layer's ``rel_bias`` tensor (buckets, H): gathered here, so its
        gradient flows back through this call.
        """
        return self.of_distance(rel_table, self.distance(q_range, k_range), head)

    def of_distance(self, rel_table, distance, head: int | None = None):
        """The bias of the distances ``p_j - p_i`` (1|B, qb, kb) int64, each within this bias's range (T5's
        table covers the distances of the positions it was made with): (1|B, H, qb, kb), or (1|B, qb, kb)
        for one ``head``. A decode step passes its queries' distances to the cache's slots."""
        bias = None
        if self.slopes is not None:
            slopes = self.slopes if head is None else self.slopes[head : head + 1]  # (H,) or (1,)
            bias = slopes[:, None, None] * distance.to(self.dtype).unsqueeze(1)  # (1|B, H|1, qb, kb)
        if self.bucket_of is not None:
            table = rel_table if head is None else rel_table[:, head : head + 1]  # (buckets, H|1)
            gathered = table[self.bucket_of[distance - self.lowest]]  # (1|B, qb, kb, H|1): a gather, a copy
            rel = gathered.permute(0, 3, 1, 2).to(self.dtype)  # (1|B, H|1, qb, kb), a strided view (then cast)
            bias = rel if bias is None else bias + rel
        assert bias is not None, "ScoreBias is made only with cfg.has_score_bias"
        return bias if head is None else bias[:, 0]  # (1|B, H, qb, kb) or (1|B, qb, kb)


# torch-tp's hook for a projection-wide QK-norm: (a sum of squares (..., N, 1), "q" or "k") -> the same summed
# over the whole projection (every rank's heads, each once).
SumReducer = Callable[[object, str], object]
