"""Claims 5-8: the standard head split, the wrong direct reshape, slicing heads one at a time, and per-head
matrices side by side.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_rosetta.backends.demos import LibraryMissing, batched_head_split
from mha_rosetta.core import MHAConfig, linear, merge_head_matrices, reference_mha, split_head_matrices

from ..head_split import head_splits
from ..seed_setup import Setup
from .registry import (
    CONFIRMED,
    REFUTED,
    SPEED_NOT_RUN,
    ClaimResult,
    _backend_stages,
    _max_abs,
    _result,
    _strategy_errors,
    claim,
)


@claim(
    5,
    "Standard head split: (N, d_model) -> (N, h, d_k) -> (h, N, d_k); with batch, (B, N, h, d_k).permute(0, 2, 1, 3)",
)
def claim_5(setup: Setup) -> ClaimResult:
    cfg = setup.cfg
    H, Dk = cfg.n_heads, cfg.d_k
    q_batched = setup.x @ setup.params.w_q.T  # (B, N, H*Dk)
    q = q_batched[0]  # (N, H*Dk)
    N = q.shape[0]
    heads = q.reshape(N, H, Dk).transpose(1, 0, 2)  # (N, H, Dk) -> (H, N, Dk)
    unbatched_ok = all(np.array_equal(heads[h], q[:, h * Dk : (h + 1) * Dk]) for h in range(H))
    evidence = [
        f"numpy: {q.shape} -> {(N, H, Dk)} -> {heads.shape}; head h == Q[:, h*Dk:(h+1)*Dk] exactly for every h: {unbatched_ok}"
    ]
    measured = {"unbatched_exact": unbatched_ok}
    ok = unbatched_ok
    try:
        torch_split = batched_head_split(q_batched, H)  # torch: view(B, N, H, Dk).permute(0, 2, 1, 3)
    except LibraryMissing:
        evidence.append("torch not installed: batched permute not shown")
    else:
        heads_t, B = torch_split["heads"], q_batched.shape[0]  # (B, H, N, Dk)
        batched_ok = all(
            np.array_equal(heads_t[b, h], q_batched[b, :, h * Dk : (h + 1) * Dk]) for b in range(B) for h in range(H)
        )
        measured["batched_exact"] = batched_ok
        measured["batched_is_view"] = torch_split["is_view"]
        ok = ok and batched_ok
        evidence.append(
            f"torch: {torch_split['shape']} -> view {(B, N, H, Dk)} -> permute(0, 2, 1, 3) {torch_split['heads_shape']}, strides "
            f"{torch_split['strides']} (a view: {measured['batched_is_view']}); [b, h] == Q[b, :, h*Dk:(h+1)*Dk] exactly: {batched_ok}"
        )
    stages, why = _backend_stages("torch", setup)
    if stages is not None and "q_heads" in stages and "q" in stages:
        from mha_rosetta.backends import canonical_stage

        q_stage, heads_stage = canonical_stage("q", stages["q"]), canonical_stage("q_heads", stages["q_heads"])
        adapter_ok = all(np.array_equal(heads_stage[:, h], q_stage[..., h * Dk : (h + 1) * Dk]) for h in range(H))
        measured["torch_adapter_split_exact"] = adapter_ok
        ok = ok and adapter_ok
        evidence.append(
            f"torch adapter: q_heads axes {stages['q_heads'].axes}, head h == q[..., h*Dk:(h+1)*Dk]: {adapter_ok}"
        )
    elif why:
        evidence.append(why)
    return _result(5, CONFIRMED if ok else REFUTED, evidence, measured)


def _attention_with_split(cfg: MHAConfig, params, x: np.ndarray, split: Callable, merge: Callable) -> np.ndarray:
    """One batch item of MHA (float64) with a given head split/merge, to isolate the split's effect."""
    q = linear(x, params.w_q, params.b_q)  # (N, H*Dk)
    k = linear(x, params.w_k, params.b_k)  # (N, H*Dk)
    v = linear(x, params.w_v, params.b_v)  # (N, H*Dv)
    qh, kh, vh = split(q), split(k), split(v)  # (H, N, Dk) each
    scores = cfg.scale * qh @ kh.transpose(0, 2, 1)  # (H, N, N)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    context = weights @ vh  # (H, N, Dv)
    return linear(merge(context), params.w_o, params.b_o)  # (N, D)


def _attention_standard_split(cfg: MHAConfig, params, x: np.ndarray) -> np.ndarray:
    """`_attention_with_split` with the standard split: (N, H*d) -> (N, H, d) -> (H, N, d) and back."""
    N, H = x.shape[0], cfg.n_heads
    split = lambda t: t.reshape(N, H, -1).transpose(1, 0, 2)  # noqa: E731  (N, H, d) -> (H, N, d), a view
    merge = lambda c: c.transpose(1, 0, 2).reshape(N, -1)  # noqa: E731  (H, N, Dv) -> (N, H*Dv), a copy
    return _attention_with_split(cfg, params, x, split, merge)


@claim(
    6,
    "A direct reshape (N, d_model) -> (h, N, d_k) is wrong: each head gets a slice of the tokens with all their features",
    plain_mha_only=True,
)
def claim_6(setup: Setup) -> ClaimResult:
    cfg, x = setup.cfg, setup.x[0]
    N, H, Dk = x.shape[0], cfg.n_heads, cfg.d_k
    splits = head_splits(N, H, Dk)
    right, wrong = splits["correct"], splits["direct_reshape"]
    evidence = [
        f"correct split: head 0 sees tokens {right.tokens_of(0)} and features {right.features_of(0)}",
        f"direct reshape: head 0 sees tokens {wrong.tokens_of(0)} and features {wrong.features_of(0)}",
    ]
    # The column/row-sample article's 4-token example: 4 tokens of 4 numbers, 2 heads of 2.
    a = np.arange(1, 17).reshape(4, 4)  # (4 tokens, 4 features)
    correct_head0 = a.reshape(4, 2, 2).transpose(1, 0, 2)[0]  # (4, 2, 2) -> (2, 4, 2), head 0
    wrong_head0 = a.reshape(2, 4, 2)[0]  # (2, 4, 2) in one reshape, head 0
    evidence.append(
        f"the article's 4-token example: correct head 0 = {correct_head0.tolist()}, "
        f"direct reshape head 0 = {wrong_head0.tolist()}"
    )
    correct_out = _attention_standard_split(cfg, setup.params, x)
    wrong_out = _attention_with_split(
        cfg,
        setup.params,
        x,
        lambda t: t.reshape(H, N, -1),  # (H, N, d) straight from memory order: the mistake
        lambda c: c.reshape(N, -1),  # (H, N, Dv) -> (N, H*Dv), undoing that reshape
    )
    reference = reference_mha(cfg, setup.params, x)
    correct_error, wrong_error = _max_abs(correct_out, reference), _max_abs(wrong_out, reference)
    evidence.append(
        f"attention output vs float64 oracle: correct split max error {correct_error:.1e}, direct reshape {wrong_error:.2f}"
    )
    adapter_errors, lines = _strategy_errors(setup, "direct_reshape", ".2f")
    evidence += lines
    measured = {
        "correct_head0_tokens": right.tokens_of(0),
        "wrong_head0_tokens": wrong.tokens_of(0),
        "wrong_head0_features": wrong.features_of(0),
        "seed_correct_head0": correct_head0.tolist(),
        "seed_wrong_head0": wrong_head0.tolist(),
        "correct_error": correct_error,
        "wrong_error": wrong_error,
        "adapter_errors": adapter_errors,
    }
    tolerance = 1e-10
    ok = (
        len(wrong.tokens_of(0)) < N
        and right.tokens_of(0) == list(range(N))
        and correct_error <= tolerance
        and wrong_error > 1e-3
        and all(error > 1e-3 for error in adapter_errors.values())
    )
    return _result(6, CONFIRMED if ok else REFUTED, evidence, measured)


@claim(
    7,
    "Slicing heads one at a time is correct but slower than one batched product (1.5-2x, more with more heads)",
    speed="one batched product over heads against slicing one head at a time and per-head matrices, as the head count grows",
    speed_only=True,
    plain_mha_only=True,
)
def claim_7(setup: Setup) -> ClaimResult:
    cfg, x, H = setup.cfg, setup.x[0], setup.cfg.n_heads
    batched = _attention_standard_split(cfg, setup.params, x)
    # One head at a time: slice the columns of each head, attend, concatenate.
    q = linear(x, setup.params.w_q, setup.params.b_q)  # (N, H*Dk)
    k = linear(x, setup.params.w_k, setup.params.b_k)
    v = linear(x, setup.params.w_v, setup.params.b_v)
    contexts = []
    for h in range(H):
        cols_k = slice(h * cfg.d_k, (h + 1) * cfg.d_k)
        cols_v = slice(h * cfg.d_v, (h + 1) * cfg.d_v)
        scores = cfg.scale * q[:, cols_k] @ k[:, cols_k].T  # (N, N)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        contexts.append((weights / weights.sum(axis=-1, keepdims=True)) @ v[:, cols_v])  # (N, Dv)
    sliced = linear(np.concatenate(contexts, axis=1), setup.params.w_o, setup.params.b_o)  # (N, D)
    difference = _max_abs(sliced, batched)
    evidence = [f"correctness: slicing vs batched heads max diff {difference:.1e}"]
    adapter_errors, lines = _strategy_errors(setup, "slicing")
    evidence += lines
    measured = {"max_abs_sliced_vs_batched": difference, "adapter_errors": adapter_errors}
    return _result(7, SPEED_NOT_RUN, evidence, measured)


@claim(
    8,
    "Per-head matrices W_h (d_model, d_k) side by side equal the merged W (d_model, h*d_k)",
)
def claim_8(setup: Setup) -> ClaimResult:
    cfg, x = setup.cfg, setup.x[0]
    per_head = split_head_matrices(setup.params.w_q, cfg.n_heads)  # (H, D, Dk)
    merged = np.concatenate(list(per_head), axis=1)  # (D, H*Dk) = [W_0 | W_1 | ...]
    one_product = x @ merged  # (N, H*Dk)
    per_head_products = np.concatenate([x @ w_h for w_h in per_head], axis=1)  # H products of (N, Dk)
    difference = _max_abs(one_product, per_head_products)
    layout_exact = bool(np.array_equal(merged, setup.params.w_q.T))
    round_trip = bool(np.array_equal(merge_head_matrices(per_head), setup.params.w_q))
    evidence = [
        f"{cfg.n_heads} matrices W_h of shape {per_head.shape[1:]} side by side = merged {merged.shape}, equal to w_q.T exactly: {layout_exact}",
        f"X @ [W_0 | W_1 | ...] vs [X @ W_0 | X @ W_1 | ...]: max diff {difference:.1e} (bitwise equal: {np.array_equal(one_product, per_head_products)})",
        f"split_head_matrices -> merge_head_matrices round trip exact: {round_trip}",
    ]
    adapter_errors, lines = _strategy_errors(setup, "per_head")
    evidence += lines
    ok = (
        layout_exact and round_trip and difference <= 1e-10 and all(error <= 1e-10 for error in adapter_errors.values())
    )
    measured = {
        "max_abs": difference,
        "layout_exact": layout_exact,
        "round_trip_exact": round_trip,
        "adapter_errors": adapter_errors,
    }
    return _result(8, CONFIRMED if ok else REFUTED, evidence, measured)
