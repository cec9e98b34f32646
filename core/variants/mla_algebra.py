"""MLA's absorbed form: the algebra that makes multi-query attention over the latent equal the naive form.

With ``c_j`` token j's normalised latent (R), ``W_UK_h`` (dn, R) and ``W_UV_h`` (dv, R) head h's rows of
``w_k`` and ``w_v``, ``W_O_h`` (D, dv) head h's columns of ``w_o``::

    q_nope_h . k_nope_hj = q_nope_h . (W_UK_h c_j) = (W_UK_h^T q_nope_h) . c_j           W_UK_h folds into the query
    s_hij = scale * ([W_UK_h^T q_nope_hi | q_rot_hi] . [c_j | k_rope_j])                one key head: MQA
    out_i = sum_h W_O_h sum_j a_hij (W_UV_h c_j) = sum_h (W_O_h W_UV_h) (sum_j a_hij c_j)  W_UV_h folds into the output

so the cache's ``[c | k_rope]`` (``kv_lora_rank + d_rope`` numbers a token) is read once per step by every head,
and no per-head key or value is ever formed. The products are re-associated, so the two forms agree to rounding
(about 1e-15 relative in float64), not bit for bit. The transposes matter: ``W_UK_h`` multiplies the query on its
output side (``q_nope_h @ W_UK_h``, (Nq, dn) @ (dn, R)); reading it the other way round is the absorbed form's bug
on record (mlx-lm #1715, Megatron-LM #3193), which only type-checks when ``dn == R``.

NumPy only, on the stages' arrays (`core.variants.mla_heads` makes them; `core.mla_forms` runs the form).
"""

from __future__ import annotations

import numpy as np

from ._shared import softmax_with_empty_rows


def absorbed_queries(cfg, w_k: np.ndarray, q_rotated: np.ndarray, transposed: bool = False) -> np.ndarray:
    """``[q_nope_h W_UK_h | q_rot_h]`` (B, H, Nq, R + dr): each head's query against the latent and the shared key.

    ``transposed``: the planted mistake, ``W_UK_h`` read as (R, dn) (needs ``dn == R`` to run at all).
    """
    H, dn = cfg.n_heads, cfg.qk_nope_head_dim
    w_uk = w_k.reshape(H, dn, -1)  # (H, dn, R) view: head h's rows of kv_b_proj's key half
    if transposed:
        w_uk = np.swapaxes(w_uk, -1, -2)  # (H, R, dn) view, read as (H, dn, R): wrong unless symmetric
    q_lat = np.einsum("bhnd,hdr->bhnr", q_rotated[..., :dn], w_uk)  # (B, H, Nq, R)
    return np.concatenate([q_lat, q_rotated[..., dn:]], axis=-1)  # (B, H, Nq, R + dr) copy


def latent_keys(kv_latent: np.ndarray, k_rope: np.ndarray) -> np.ndarray:
    """The one key head of the absorbed form, ``[c | k_rope]`` (B, Nk, R + dr): what the cache holds."""
    return np.concatenate([kv_latent, k_rope], axis=-1)  # (B, Nk, R + dr) copy


def absorbed_scores(cfg, queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``scale * q_h . [c | k_rope]`` (B, H, Nq, Nk): every head against the one key head (MQA, no repetition)."""
    return cfg.scale * np.einsum("bhnr,bkr->bhnk", queries, keys)


def absorbed_output_weight(cfg, w_v: np.ndarray, w_o: np.ndarray) -> np.ndarray:
    """``W_O_h W_UV_h`` (H, D, R): head h's value up-projection folded into its columns of the output projection."""
    H, dv = cfg.n_heads, cfg.d_v
    w_uv = w_v.reshape(H, dv, -1)  # (H, dv, R) view
    w_o_h = w_o.reshape(w_o.shape[0], H, dv)  # (D, H, dv) view: columns h*dv:(h+1)*dv read head h
    return np.einsum("dhv,hvr->hdr", w_o_h, w_uv)


def absorbed_output(cfg, p: dict, weights: np.ndarray, kv_latent: np.ndarray) -> np.ndarray:
    """``sum_h (W_O_h W_UV_h) (a_h @ c) + b_o`` (B, Nq, D): the context stays in the latent until the output."""
    context = np.einsum("bhnk,bkr->bhnr", weights, kv_latent)  # (B, H, Nq, R): one latent context per head
    out = np.einsum("bhnr,hdr->bnd", context, absorbed_output_weight(cfg, p["w_v"], p["w_o"]))
    return out if p.get("b_o") is None else out + p["b_o"]


def form_difference(cfg, params, stages: dict) -> float:
    """The largest difference between the naive form's output (``stages``) and the absorbed form on its stages.

    The absorbed form reads only ``q_rotated``, ``kv_latent``, ``k_rope`` and the blocked positions of
    ``masked_scores``; for a layer with no score step but masks (the explainer's demonstration).
    """
    p = params.as_dict()
    scores = absorbed_scores(
        cfg, absorbed_queries(cfg, p["w_k"], stages["q_rotated"]), latent_keys(stages["kv_latent"], stages["k_rope"])
    )
    weights = softmax_with_empty_rows(np.where(np.isneginf(stages["masked_scores"]), -np.inf, scores))
    return float(np.max(np.abs(absorbed_output(cfg, p, weights, stages["kv_latent"]) - stages["output"])))
