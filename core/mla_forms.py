"""MLA's two forms and its latent cache, in NumPy float64: `mla_forward` and `mla_decode` (issue 45).

Two ways to compute the same attention (`core.variants.mla` has the spec, `core.variants.mla_algebra` the proof):

* ``naive``: each head's keys ``[W_UK_h c | k_rope]`` and values ``W_UV_h c`` expanded from the latent, then
  attention as ever (what `core.reference` computes and what transformers' ``DeepseekV3Attention`` does);
* ``absorbed``: ``W_UK`` folded into the query and ``W_UV`` into the output, so every head attends to the one
  key head ``[c | k_rope]`` (multi-query attention over the latent) and no per-head key or value is formed.

Both read the same cache: the normalised latent ``c`` (``kv_lora_rank`` numbers a token) and the rotated shared key
``k_rope`` (``qk_rope_head_dim``), as transformers 5.17 and later hold it (4.57 cached the expanded keys and
values: `cache_numbers_per_token`). In decode the naive form re-expands every cached token's keys and values at
each step (``Nk * H * (d_nope + d_v) * R`` multiply-adds); the absorbed form reads the latent once for all heads.

Column samples, had this module a column-sample spelling: the latent's columns are its tokens, ``C = kv_latent.T``
(R, Nk), so ``W_UK_h C`` is (dn, Nk) without a transpose. Here, as in `core`, row samples: (B, N, features).

The score steps these forms apply are the positional masks (causal, the window, Llama 4's chunks, the user's
mask), and on the queries Mistral 4's temperature (both parts, nope and rope, at the queries' positions, the cache
offset included in decode); a layer with another variant (a softcap, a bias, sinks, the output gate, ...) is
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .config import MHAConfig
from .decode import decode_allowed, prepare_decode_inputs
from .inputs import allowed_positions, prepare_inputs
from .params import MHAParams, validate_params
from .reference import as_float64, float_params
from .rotary import apply_rotary, rotary_tables
from .variants import VARIANT_REGISTRY, softmax_with_empty_rows, strategy_forms, temper
from .variants.mla import STRATEGIES, cache_numbers_per_token, mla_on
from .variants.mla_algebra import absorbed_output, absorbed_queries, absorbed_scores, latent_keys
from .variants.mla_heads import Rotation, expand, latent_entries, query_stages
from .variants.temperature import ENTRY as TEMPERATURE

__all__ = [
    "FORMS",
    "LatentCache",
    "cache_bytes_per_token",
    "decode_step_costs",
    "latent_attention",
    "mla_decode",
    "mla_forward",
]

FORMS = STRATEGIES  # MLA's two forms, the entry's strategies (`Variant.strategies`)


def applied_variants() -> frozenset[str]:
    """The variants these forms apply: MLA's own, the rotary's scaling, the positional masks, the temperature."""
    masks = {name for name, entry in VARIANT_REGISTRY.items() if entry.score_step and entry.score_step.place == "mask"}
    return frozenset(strategy_forms(FORMS) | {"rope_scaling", TEMPERATURE.name} | masks)


def check_form(cfg: MHAConfig, form: str) -> None:
    """Refuse a form not in `FORMS`, a layer that is not MLA, and variants these forms do not apply."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    if not mla_on(cfg):
        raise ValueError(
            f"the MLA forms need MHAConfig.kv_lora_rank (multi-head latent attention), got {cfg.describe()}"
        )
    others = [name for name in cfg.variants if name not in applied_variants()]
    if others:
        raise ValueError(
            f"core.mla_forms applies MLA's positional masks and the temperature only; {', '.join(others)} is "
            "refused here (core.reference_mha computes the naive form with every variant)"
        )


def latent_attention(cfg: MHAConfig, p: dict, query: dict, kv_latent, k_rope, allowed, form: str, positions=None):
    """(output (B, Nq, D), weights (B, H, Nq, Nk)) of the queries ``query`` (`query_stages`) over the cached latent.

    ``allowed``: bool broadcastable to (B, H, Nq, Nk) or None; ``positions`` (1|B, Nq): the queries' (the
    temperature's, with ``attn_temperature_tuning``).
    """
    H, dn = cfg.n_heads, cfg.qk_nope_head_dim
    q_rotated = query["q_rotated"]  # (B, H, Nq, Dk): [q_nope_h | rot(q_rot_h)]
    if cfg.attn_temperature_tuning:  # Mistral 4: both parts times the position's factor
        q_rotated = temper(cfg, q_rotated, positions)
    if form == "absorbed":
        scores = absorbed_scores(cfg, absorbed_queries(cfg, p["w_k"], q_rotated), latent_keys(kv_latent, k_rope))
    else:
        k_nope, _ = expand(cfg, p, kv_latent)  # (B, Nk, H*dn)
        k_nope = k_nope.reshape(*k_nope.shape[:2], H, dn)  # (B, Nk, H, dn) view
        scores = cfg.scale * (
            np.einsum("bhnd,bkhd->bhnk", q_rotated[..., :dn], k_nope)
            + np.einsum("bhnd,bkd->bhnk", q_rotated[..., dn:], k_rope)  # the one rotary key, every head
        )
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    weights = softmax_with_empty_rows(scores)  # (B, H, Nq, Nk)
    if form == "absorbed":
        return absorbed_output(cfg, p, weights, kv_latent), weights
    _, v = expand(cfg, p, kv_latent)  # (B, Nk, H*dv)
    v = v.reshape(*v.shape[:2], H, cfg.d_v)  # (B, Nk, H, dv) view
    B, _, Nq, _ = weights.shape
    merged = np.einsum("bhnk,bkhd->bnhd", weights, v).reshape(B, Nq, H * cfg.d_v)  # (B, Nq, H, dv) -> merged copy
    out = merged @ p["w_o"].T  # (B, Nq, H*dv) @ (H*dv, D)
    return (out if p.get("b_o") is None else out + p["b_o"]), weights


def mla_forward(cfg: MHAConfig, params: MHAParams, query, *, form: str = "naive", mask=None, positions=None):
    """Self-attention of ``query`` (B, N, D) (or (N, D)) through MLA's ``form``, float64; the output's shape."""
    check_form(cfg, form)
    validate_params(cfg, params)
    inputs = prepare_inputs(cfg, query, None, None, mask, positions, None)
    p, x = float_params(params), as_float64(inputs.query)
    rotate = Rotation(rotary_tables(cfg, inputs), apply_rotary)
    kv_latent, k_rope = latent_entries(cfg, p, x, rotate)
    out, _ = latent_attention(cfg, p, query_stages(cfg, p, x, rotate), kv_latent, k_rope,
                              allowed_positions(cfg, inputs), form, inputs.positions)  # fmt: skip
    return inputs.unbatch(out)


@dataclass
class LatentCache:
    """What MLA caches: per token its latent (B, T, R) and rotated shared key (B, T, dr), position and validity."""

    kv_latent: np.ndarray
    k_rope: np.ndarray
    positions: np.ndarray
    valid: np.ndarray

    @classmethod
    def empty(cls, cfg: MHAConfig, batch: int) -> LatentCache:
        return cls(
            np.zeros((batch, 0, cfg.kv_lora_rank)),
            np.zeros((batch, 0, cfg.qk_rope_head_dim)),
            np.zeros((batch, 0), dtype=np.int64),
            np.zeros((batch, 0), dtype=bool),
        )

    def append(self, kv_latent, k_rope, positions, valid) -> None:
        self.kv_latent = np.concatenate([self.kv_latent, kv_latent], axis=1)  # (B, T + s, R) copy
        self.k_rope = np.concatenate([self.k_rope, k_rope], axis=1)  # (B, T + s, dr) copy
        self.positions = np.concatenate([self.positions, positions], axis=1)
        self.valid = np.concatenate([self.valid, valid], axis=1)

    @property
    def numbers_per_token(self) -> int:
        return self.kv_latent.shape[-1] + self.k_rope.shape[-1]


def cache_bytes_per_token(cfg: MHAConfig, itemsize: int = 8) -> dict:
    """Bytes a token adds to the cache: ``latent`` ((R + dr) * itemsize) against ``expanded`` (H (d_k + d_v) * itemsize).

    ``expanded`` is the ``2 H d`` of plain attention with these head sizes (``d_k != d_v`` here), and what
    transformers 4.57 cached for MLA. One layer, one sequence; ``itemsize`` 8 for float64, 2 for bfloat16.
    """
    numbers = cache_numbers_per_token(
        cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    )
    return dict(latent=numbers["latent"] * itemsize, expanded=numbers["expanded"] * itemsize, ratio=numbers["ratio"])


def decode_step_costs(cfg: MHAConfig, context: int, form: str, itemsize: int = 2) -> dict:
    """What one decode step of one new token costs at ``context`` cached tokens, one layer and one sequence.

    ``bytes``: what the step reads beyond the weights both forms share (w_q, w_kv_a, w_o): the latent cache
    ``T (R + dr)``, ``W_UK`` and ``W_UV`` (``H (dn + dv) R``), and in the naive form the per-head keys and values it
    expands from the cache and then attends over, ``T H (d_k + d_v)``. ``macs``: the multiply-adds of the attention
    and of the expansion (naive: ``T H (dn + dv) R`` + ``T H (d_k + d_v)``; absorbed: ``H dn R`` to fold W_UK into
    the query, ``T H (R + dr)`` for the scores, ``T H R`` for the latent context, ``H dv R`` to unfold W_UV).
    """
    check_form(cfg, form)
    T, H, R, dr = context, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    dn, dv, dk = cfg.qk_nope_head_dim, cfg.d_v, cfg.d_k
    weights = H * (dn + dv) * R
    if form == "naive":
        read = T * (R + dr) + weights + T * H * (dk + dv)
        macs = T * H * (dn + dv) * R + T * H * (dk + dv)
    else:
        read = T * (R + dr) + weights
        macs = H * dn * R + T * H * (R + dr) + T * H * R + H * dv * R
    return dict(bytes=read * itemsize, macs=macs)


def mla_decode(cfg: MHAConfig, params: MHAParams, x, *, prefill, step=1, form="naive", mask=None, positions=None,
               return_cache=False):  # fmt: skip
    """``x`` fed through MLA's latent cache: a prefill of ``prefill`` tokens, then ``step`` at a time (float64).

    Every chunk's new tokens add their latent and rotated shared key to the cache, then attend over the whole
    cache by positions (`core.decode.decode_allowed`: bottom-right causal, the window, chunks, padding). The
    outputs, (B, N, D), equal the full causal forward (`core.decode.reference_decode`) in both forms.
    """
    check_form(cfg, form)
    validate_params(cfg, params)
    inputs = prepare_decode_inputs(cfg, x, prefill=prefill, step=step, mask=mask, positions=positions)
    p, xs = float_params(params), as_float64(inputs.x)
    cache = LatentCache.empty(cfg, inputs.batch)
    outputs = []
    for start, stop in inputs.chunks():
        pos = inputs.positions[:, start:stop]  # (B, s)
        rotate = Rotation(rotary_tables(cfg, SimpleNamespace(positions=pos, kv_positions=pos)), apply_rotary)
        chunk = xs[:, start:stop]  # (B, s, D) view
        cache.append(*latent_entries(cfg, p, chunk, rotate), pos, inputs.valid[:, start:stop])
        allowed = decode_allowed(cfg, pos, cache.positions, cache.valid)  # (B, 1, s, T)
        out, _ = latent_attention(cfg, p, query_stages(cfg, p, chunk, rotate), cache.kv_latent, cache.k_rope,
                                  allowed, form, pos)  # fmt: skip
        outputs.append(out)
    out = inputs.unbatch(np.concatenate(outputs, axis=1))
    return (out, cache) if return_cache else out
