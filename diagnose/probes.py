"""Designed inputs and parameters: each probe isolates part of the pipeline.

The configuration is the candidate's (its module was built for fixed sizes), so the probes
vary what can vary: token counts (5 queries, 7 keys: distinct primes, so a swapped axis
cannot pass by luck), the inputs and the parameters.

- ``random``: random inputs and parameters, no mask: every stage is exercised.
- ``single token``: one token, so every softmax weight is 1: scores cannot matter, only the
  projections, biases, head split and merge can.
- ``identical tokens``: every token the same, so every score row is constant and the weights
  uniform whatever the scale or the softmax axis: the value path alone.
- ``mask``: a random mask, every query row with allowed and blocked keys, every key seen by some query.
- ``all-True mask``: the correct answer is the unmasked one; a candidate that reads the mask
  as True = blocked sees nothing at all.
- ``w_k = w_q``: symmetric scores, so exchanging the q and k projections changes nothing here
  while a softmax over the wrong axis still does.
- ``one head``: w_o reads only the last head (the H=1 probe): where each head's context
  lands in the merged vector.
- ``cross``: key and value of 7 tokens (and kdim, vdim widths; MLA: value = key, one latent) for 5 queries; optional: a
  self-attention module may refuse it (raise) or ignore key and value (the same output for
  other key and value), and then the probe is left out with a note.
- ``empty row``: one query row may attend to nothing; never used to rank causes, only to
  name what the candidate does there (the spec: zero weights, output b_o).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, init_params
from mha_rosetta.core.variants import variants_on

BATCH, Q_TOKENS, KV_TOKENS = 2, 5, 7


@dataclass(frozen=True)
class Probe:
    name: str
    params: MHAParams
    query: np.ndarray  # (B, Nq, d_model) float64
    key: np.ndarray  # (B, Nk, kdim)
    value: np.ndarray  # (B, Nk, vdim)
    mask: np.ndarray | None  # (B, 1, Nq, Nk) bool, True = may attend
    optional: bool = False  # the candidate may refuse it (cross-attention)
    ranks: bool = True  # used to rank causes (False: the empty-row probe)


def _mask(rng: np.random.Generator, q_tokens: int, kv_tokens: int) -> np.ndarray:
    """Random (B, 1, Nq, Nk) mask: every query row has an allowed and a blocked key, every key a query that sees it."""
    mask = rng.random((BATCH, 1, q_tokens, kv_tokens)) < 0.6
    cols = rng.integers(0, kv_tokens, size=(BATCH, 1, q_tokens))
    other = (cols + 1 + rng.integers(0, kv_tokens - 1, size=cols.shape)) % kv_tokens
    np.put_along_axis(mask, cols[..., None], True, axis=-1)
    np.put_along_axis(mask, other[..., None], False, axis=-1)
    rows = rng.integers(0, q_tokens, size=(BATCH, 1, kv_tokens))
    np.put_along_axis(mask, rows[:, :, None, :], True, axis=-2)  # and every key some query that sees it
    return mask


def make_probes(cfg: MHAConfig, seed: int = 0) -> list[Probe]:
    rng = np.random.default_rng(seed)
    params = init_params(cfg, seed=seed + 1)

    def tokens(n: int, width: int) -> np.ndarray:
        return rng.standard_normal((BATCH, n, width))

    def self_probe(name, x, **kw) -> Probe:
        # Self-attention where the widths allow (key = value = query); else other tokens, as many.
        def same_tokens(width):
            if width == cfg.d_model:
                return x
            other = tokens(x.shape[1], width)
            return np.repeat(other[:, :1], x.shape[1], axis=1) if name == "identical tokens" else other

        return Probe(
            name, kw.pop("params", params), x, same_tokens(cfg.kdim), same_tokens(cfg.vdim), kw.pop("mask", None), **kw
        )

    x = tokens(Q_TOKENS, cfg.d_model)
    probes = [
        self_probe("random", x),
        self_probe("single token", tokens(1, cfg.d_model)),
        self_probe("identical tokens", np.repeat(tokens(1, cfg.d_model), Q_TOKENS, axis=1)),
        self_probe("mask", tokens(Q_TOKENS, cfg.d_model), mask=_mask(rng, Q_TOKENS, Q_TOKENS)),
        self_probe("all-True mask", tokens(Q_TOKENS, cfg.d_model), mask=np.ones((BATCH, 1, Q_TOKENS, Q_TOKENS), bool)),
    ]
    latent = any(entry.base_shapes is not None for entry in variants_on(cfg))  # MLA: w_k reads the latent
    if cfg.kdim == cfg.d_model and not latent:
        group = cfg.n_heads // cfg.n_kv_heads
        rows = np.concatenate(
            [np.arange(g * group * cfg.d_k, (g * group + 1) * cfg.d_k) for g in range(cfg.n_kv_heads)]
        )
        tied = replace(params, w_k=params.w_q[rows], b_k=None if params.b_q is None else params.b_q[rows])
        held_twice = {name: getattr(tied, same) for e in variants_on(cfg) for name, same in e.tied.items()}
        tied = replace(tied, **held_twice)  # attention_k_eq_v: w_v is w_k, so it moves with it
        probes.append(self_probe("w_k = w_q", x, params=tied))
    w_o = np.zeros_like(params.w_o)
    last = slice((cfg.n_heads - 1) * cfg.d_v, cfg.n_heads * cfg.d_v)
    w_o[:, last] = params.w_o[:, last]
    probes.append(self_probe("one head", x, params=replace(params, w_o=w_o)))
    cross_mask = _mask(rng, Q_TOKENS, KV_TOKENS)
    query, key, value = tokens(Q_TOKENS, cfg.d_model), tokens(KV_TOKENS, cfg.kdim), tokens(KV_TOKENS, cfg.vdim)
    value = key if latent else value  # MLA's keys and values are one latent of the same tokens
    probes.append(Probe("cross", params, query, key, value, cross_mask, optional=True))
    empty = np.ones((BATCH, 1, Q_TOKENS, Q_TOKENS), bool)
    empty[0, 0, 2] = False  # query row 2 of batch item 0 may attend to nothing
    probes.append(self_probe("empty row", x, mask=empty, ranks=False))
    return probes
