"""The column/row-sample article's twelve claims, each an executable check.

The column/row-sample article is the (Chinese) text this project grew from. It explains
multi-head attention through two ways of holding data: column samples (a token per
column, ``Y = W @ X``, rows of W are the scorers) and row samples (a token per row,
``Y = X @ W.T``, PyTorch's ``nn.Linear``). It claims that the two give the same numbers,
that heads are split by a reshape plus a transpose while a direct reshape is wrong,
that per-head matrices side by side are the merged one, that slicing heads one at a
time is slower, that ``view`` after a transpose needs ``.contiguous()``, and that einsum
keeps ``(N, h, d_k)`` without a transpose; `CLAIM_TITLES` lists all twelve.

Every check returns a `ClaimResult`: the claim's number and title, a verdict, and the
evidence, which is what was measured or the error that was actually raised. Nothing
is asserted from memory: the 2.5 score is computed, the torch ``view`` error is
caught from torch, the sequence-first default is read off a real module.

Verdicts: ``confirmed``; ``refuted``; ``confirmed with caveat`` (the claim holds, but
a part of it, usually the speed part, does not); ``partly confirmed`` (speed results
that disagree across sizes or devices); ``skipped: <reason>`` (a library or the
benchmark is missing). The claims about speed (3, 7 and the speed halves of 9 and 11)
take their numbers from the benchmark questions, `benchmarks.questions`, which run
only when asked (``speed=True``); the rest run in the test suite.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mha_rosetta.backends._probe import importable as _installed
from mha_rosetta.core import (
    MHAConfig,
    compare,
    error_line,
    linear,
    merge_head_matrices,
    reference_mha,
    split_head_matrices,
    to_torch_mha_state_dict,
    torch_mha_unsupported_reason,
)

from .head_split import head_splits
from .memory import shares_memory, strides_in_elements
from .seed_setup import Setup, make_setup

CONFIRMED, REFUTED, CAVEAT, PARTLY = "confirmed", "refuted", "confirmed with caveat", "partly confirmed"
SPEED_CLAIMS = (3, 7, 9, 11)  # claims with a speed part measured by the benchmark questions
SPEED_ONLY_CLAIMS = (3, 7)  # claims that are about speed and nothing else
SPEED_NOT_RUN = "skipped: speed not measured in this run"


@dataclass
class ClaimResult:
    claim: int
    title: str
    verdict: str
    evidence: list[str]
    measured: dict = field(default_factory=dict)  # the numbers, for scripts and tests

    def to_dict(self) -> dict:
        return {
            "claim": self.claim,
            "title": self.title,
            "verdict": self.verdict,
            "evidence": "; ".join(self.evidence),
            "measured": _jsonable(self.measured),
        }


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _fmt(values) -> str:
    """A short list of numbers: [40, 41, 42, 43] or [0.5, 2.5]."""
    array = np.asarray(values)
    if np.all(array == np.round(array)) and np.all(np.abs(array) < 1e15):
        return str(array.astype(np.int64).tolist())
    return np.array2string(array, precision=4, separator=", ")


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# --- running the project's own backends as extra evidence ---------------------------------------


def _backend_run(name: str, setup: Setup, strategy: str = "standard", dtype: str = "float64"):
    """Output of backend ``name`` for the setup, or (None, why not)."""
    try:
        from mha_rosetta.backends import get_backend

        return get_backend(name).run(setup.cfg, setup.params, setup.x, dtype=dtype, strategy=strategy), ""
    except Exception as error:  # a missing or unfinished adapter is reported, not fatal
        return None, f"{name} ({strategy}) not run: {error_line(error)}"


def _backend_stages(name: str, setup: Setup, dtype: str = "float64"):
    """Native stage tensors of backend ``name``, or (None, why not)."""
    try:
        from mha_rosetta.backends import get_backend

        prepared, _ = get_backend(name).prepare(setup.cfg, setup.params, setup.x, dtype=dtype)
        return prepared.native_stages(), ""
    except Exception as error:
        return None, f"{name} stages not available: {error_line(error)}"


def _strategy_errors(
    setup: Setup, strategy: str, spec: str = ".1e", backends=("numpy", "torch")
) -> tuple[dict[str, float], list[str]]:
    """Max abs error against the float64 oracle of each backend running ``strategy``, and the evidence lines
    (each error formatted with ``spec``, then why a backend did not run)."""
    reference = reference_mha(setup.cfg, setup.params, setup.x)
    errors, lines, notes = {}, [], []
    for name in backends:
        output, why = _backend_run(name, setup, strategy)
        if output is None:
            notes.append(why)
        else:
            errors[name] = _max_abs(output, reference)
            lines.append(f"{name} adapter, {strategy} strategy: max error vs oracle {errors[name]:{spec}}")
    return errors, lines + notes


# --- the claims ------------------------------------------------------------------------------

# The claims in this project's words (the article states them in Chinese; the numbers are this project's).
CLAIM_TITLES = {
    1: "Column samples (Y = W_A @ X, rows of W are scorers) and row samples (Y = X @ W_B, columns are scorers) give the same numbers: W_B = W_A.T, Y_B = Y_A.T",
    2: "nn.Linear.weight is (out, in) and computes x @ W.T + b",
    3: "X @ W.T is preferred to W @ X.T because of memory layout (contiguity)",
    4: "reshape/transpose chains lose nothing: (32, 8) -> (4, 8, 8) -> (4, 8, 2, 4) -> (4, 2, 8, 4); row 5 lands at D[0, 0, 5] and D[0, 1, 5]",
    5: "Standard head split: (N, d_model) -> (N, h, d_k) -> (h, N, d_k); with batch, (B, N, h, d_k).permute(0, 2, 1, 3)",
    6: "A direct reshape (N, d_model) -> (h, N, d_k) is wrong: each head gets a slice of the tokens with all their features",
    7: "Slicing heads one at a time is correct but slower than one batched product (1.5-2x, more with more heads)",
    8: "Per-head matrices W_h (d_model, d_k) side by side equal the merged W (d_model, h*d_k)",
    9: "After a transpose, view needs .contiguous(); reshape copies silently",
    10: "nn.MultiheadAttention is sequence-first (N, B, E) unless batch_first=True",
    11: "einsum can keep (N, h, d_k) and skip the transpose",
    12: "Worked numbers: token [1, 0, 2, 0, ...] with scorer [0.5, 0, 1.0, 0, ...] gives 2.5; the 4-token example D[0, 0] = [[1, 2], [5, 6]], D[0, 1] = [[3, 4], [7, 8]]",
}


def _result(number: int, verdict: str, evidence: list[str], measured: dict | None = None) -> ClaimResult:
    """Claim ``number``'s result, with its title from `CLAIM_TITLES`."""
    return ClaimResult(number, CLAIM_TITLES[number], verdict, evidence, {} if measured is None else measured)


def claim_1(setup: Setup) -> ClaimResult:
    x_row = setup.x[0]  # (N, D): one token per row
    x_col = x_row.T  # (D, N): one token per column
    w_a = setup.params.w_q  # (H*Dk, D): rows are scorers
    w_b = w_a.T  # (D, H*Dk): columns are scorers
    y_a = w_a @ x_col  # (H*Dk, N)
    y_b = x_row @ w_b  # (N, H*Dk)
    difference = _max_abs(y_b, y_a.T)
    ok = compare(y_b, y_a.T, "float64").ok
    evidence = [
        f"W_A {w_a.shape} @ X_col {x_col.shape} -> Y_A {y_a.shape}; X_row {x_row.shape} @ W_B {w_b.shape} -> Y_B {y_b.shape}",
        f"max |Y_B - Y_A.T| = {difference:.1e} (bitwise equal: {np.array_equal(y_b, y_a.T)})",
    ]
    measured = {"max_abs_y_b_minus_y_a_t": difference}
    # The same fact from two real adapters: NumPy holds q as (B, H*Dk, N), torch as (B, N, H*Dk).
    numpy_stages, why_numpy = _backend_stages("numpy", setup)
    torch_stages, why_torch = _backend_stages("torch", setup)
    if numpy_stages is not None and torch_stages is not None and "q" in numpy_stages and "q" in torch_stages:
        from mha_rosetta.backends.base import canonical_stage

        q_col = numpy_stages["q"]
        q_row = torch_stages["q"]
        adapters = _max_abs(canonical_stage("q", q_col), canonical_stage("q", q_row))
        measured["max_abs_numpy_vs_torch_q"] = adapters
        ok = ok and adapters <= 1e-10
        evidence.append(
            f"adapters: numpy q axes {q_col.axes} shape {tuple(q_col.value.shape)}, torch q axes {q_row.axes} "
            f"shape {tuple(q_row.value.shape)}; after transposing one onto the other max diff {adapters:.1e}"
        )
    else:
        evidence.append(why_numpy or why_torch)
    return _result(1, CONFIRMED if ok else REFUTED, evidence, measured)


def claim_2(setup: Setup) -> ClaimResult:
    if not _installed("torch"):
        return _result(2, "skipped: torch not installed", ["needs torch.nn.Linear"])
    import torch

    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features=4, out_features=2, dtype=torch.float64)  # the article's example
    x = torch.randn(3, 4, dtype=torch.float64)  # (N, in): 3 row samples
    with torch.no_grad():
        y = linear(x)
        by_hand = x @ linear.weight.T + linear.bias
        difference = float((y - by_hand).abs().max())
        try:
            x @ linear.weight  # (3, 4) @ (2, 4): the weight must be transposed first
            raised = "no error"
        except RuntimeError as error:
            raised = error_line(error)
    shape = tuple(linear.weight.shape)
    ok = shape == (2, 4) and difference <= 1e-12 and raised != "no error"
    evidence = [
        f"nn.Linear(in_features=4, out_features=2).weight.shape = {shape} (out, in)",
        f"max |linear(x) - (x @ W.T + b)| = {difference:.1e}",
        f"x @ W without .T raises {raised}",
    ]
    measured = {"weight_shape": shape, "max_abs": difference, "x_at_w_error": raised}
    return _result(2, CONFIRMED if ok else REFUTED, evidence, measured)


def claim_3(setup: Setup) -> ClaimResult:
    x = np.ascontiguousarray(setup.x[0])  # (N, in), row samples as loaded
    w = setup.params.w_q  # (out, in)
    y_row = x @ w.T  # (N, out): batch axis first, ready for bias and the next layer
    y_col = w @ x.T  # (out, N): needs one more transpose
    evidence = [
        f"X {x.shape} strides {strides_in_elements(x)} C-contiguous; X.T strides {strides_in_elements(x.T)} "
        f"C-contiguous: {x.T.flags.c_contiguous}",
        f"X @ W.T gives {y_row.shape} (tokens first); W @ X.T gives {y_col.shape}, and its .T has strides "
        f"{strides_in_elements(y_col.T)}, C-contiguous: {y_col.T.flags.c_contiguous}",
        f"same numbers: max diff {_max_abs(y_row, y_col.T):.1e}",
    ]
    measured = {"x_t_c_contiguous": bool(x.T.flags.c_contiguous), "max_abs": _max_abs(y_row, y_col.T)}
    return _result(3, SPEED_NOT_RUN, evidence, measured)


def claim_4(setup: Setup) -> ClaimResult:
    evidence, measured, ok = [], {}, True
    libraries = ["numpy"] + (["torch"] if _installed("torch") else [])
    row = lambda t, i: np.asarray(t[i])  # noqa: E731  (row i of a NumPy array or a torch tensor, as NumPy)
    for library in libraries:
        if library == "numpy":
            xp = np
        else:
            import torch as xp
        # The same chain in both libraries; swapaxes(1, 2) is NumPy's transpose(0, 2, 1, 3) and torch's transpose(1, 2).
        a = xp.arange(32 * 8).reshape(32, 8)  # (32, 8): 32 vectors of 8 numbers
        b = a.reshape(4, 8, 8)  # (4, 8, 8): 4 groups of 8 vectors, a view
        c = b.reshape(4, 8, 2, 4)  # (4, 8, 2, 4): each vector cut into 2 halves, a view
        d = c.swapaxes(1, 2)  # (4, 2, 8, 4): halves before vectors, a view
        a_back = d.swapaxes(1, 2).reshape(4, 8, 8).reshape(32, 8)  # back to (32, 8)
        first, second = row(d[0, 0], 5), row(d[0, 1], 5)
        every_row = all(
            np.array_equal(row(d[i // 8, 0], i % 8), row(a, i)[:4])
            and np.array_equal(row(d[i // 8, 1], i % 8), row(a, i)[4:])
            for i in range(32)
        )
        exact = bool(np.array_equal(np.asarray(a_back), np.asarray(a)))
        no_copy = all(shares_memory(t, a) for t in (b, c, d, a_back))
        ok = ok and tuple(d.shape) == (4, 2, 8, 4) and every_row and exact
        ok = ok and first.tolist() == [40, 41, 42, 43] and second.tolist() == [44, 45, 46, 47]
        measured[library] = {
            "row_5": row(a, 5).tolist(),
            "d_0_0_5": first.tolist(),
            "d_0_1_5": second.tolist(),
            "every_row_found": every_row,
            "round_trip_exact": exact,
            "all_views": no_copy,
        }
        evidence.append(
            f"{library}: A[5] = {_fmt(row(a, 5))}; D[0, 0, 5] = {_fmt(first)}, D[0, 1, 5] = {_fmt(second)}; "
            f"every row i found at D[i // 8, k, i % 8]: {every_row}; inverse chain gives A back exactly: {exact}; "
            f"B, C, D and the rebuilt A all share A's memory (no copy): {no_copy}"
        )
    evidence.append("note: the grouping into 4 blocks of 8 tokens is the article's exercise, not a step of MHA")
    return _result(4, CONFIRMED if ok else REFUTED, evidence, measured)


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
    if _installed("torch"):
        import torch

        qt = torch.from_numpy(q_batched)
        B = qt.shape[0]
        heads_t = qt.view(B, N, H, Dk).permute(0, 2, 1, 3)  # (B, N, H, Dk) -> (B, H, N, Dk)
        batched_ok = all(
            np.array_equal(heads_t[b, h].numpy(), q_batched[b, :, h * Dk : (h + 1) * Dk])
            for b in range(B)
            for h in range(H)
        )
        measured["batched_exact"] = batched_ok
        measured["batched_is_view"] = shares_memory(heads_t, qt)
        ok = ok and batched_ok
        evidence.append(
            f"torch: {tuple(qt.shape)} -> view {(B, N, H, Dk)} -> permute(0, 2, 1, 3) {tuple(heads_t.shape)}, strides "
            f"{tuple(heads_t.stride())} (a view: {measured['batched_is_view']}); [b, h] == Q[b, :, h*Dk:(h+1)*Dk] exactly: {batched_ok}"
        )
    else:
        evidence.append("torch not installed: batched permute not shown")
    stages, why = _backend_stages("torch", setup)
    if stages is not None and "q_heads" in stages and "q" in stages:
        from mha_rosetta.backends.base import canonical_stage

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


def claim_9(setup: Setup) -> ClaimResult:
    cfg = setup.cfg
    H, N, Dv = cfg.n_heads, setup.tokens, cfg.d_v
    evidence, measured, ok = [], {}, True
    if _installed("torch"):
        import torch

        context = torch.arange(H * N * Dv, dtype=torch.float64).reshape(H, N, Dv)  # (H, N, Dv): heads first
        swapped = context.transpose(0, 1)  # (N, H, Dv), a view with permuted strides
        try:
            swapped.view(N, H * Dv)
            view_error = "no error"
        except RuntimeError as error:
            view_error = error_line(error)
        made_contiguous = swapped.contiguous()  # (N, H, Dv), new memory in row-major order
        merged = made_contiguous.view(N, H * Dv)  # (N, H*Dv), now a view of that copy
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reshaped = swapped.reshape(N, H * Dv)  # (N, H*Dv): copies because it must
        measured["torch"] = {
            "transposed_contiguous": swapped.is_contiguous(),
            "view_error": view_error,
            "contiguous_copies": not shares_memory(made_contiguous, context),
            "reshape_copies": not shares_memory(reshaped, context),
            "reshape_warnings": len(caught),
            "reshape_of_contiguous_is_view": shares_memory(context.reshape(H * N * Dv), context),
            "same_values": bool(torch.equal(reshaped, merged)),
        }
        facts = measured["torch"]
        ok = ok and view_error != "no error" and facts["contiguous_copies"] and facts["reshape_copies"]
        ok = ok and facts["reshape_warnings"] == 0 and facts["same_values"]
        evidence += [
            f"torch: context {tuple(context.shape)}.transpose(0, 1) has strides {tuple(swapped.stride())}, contiguous: {swapped.is_contiguous()}",
            f".view({N}, {H * Dv}) raises {view_error}",
            f".contiguous() copies (new storage: {facts['contiguous_copies']}), then .view works",
            f".reshape({N}, {H * Dv}) copies (new storage: {facts['reshape_copies']}) with {facts['reshape_warnings']} warnings; "
            f"on a contiguous tensor reshape is a view: {facts['reshape_of_contiguous_is_view']}",
        ]
    else:
        evidence.append("torch not installed: view/contiguous shown with NumPy only")
    context_np = np.arange(H * N * Dv, dtype=np.float64).reshape(H, N, Dv)  # (H, N, Dv)
    swapped_np = context_np.transpose(1, 0, 2)  # (N, H, Dv), a view
    try:
        np.reshape(swapped_np, (N, H * Dv), copy=False)  # NumPy's "view or fail" (numpy >= 2.1)
        numpy_error = "no error"
    except ValueError as error:
        numpy_error = error_line(error)
    except TypeError:
        numpy_error = "n/a (this NumPy has no reshape(copy=False))"
    reshaped_np = swapped_np.reshape(N, H * Dv)  # (N, H*Dv): a silent copy
    measured["numpy"] = {
        "no_copy_reshape_error": numpy_error,
        "reshape_copies": not shares_memory(reshaped_np, context_np),
    }
    ok = ok and measured["numpy"]["reshape_copies"]
    evidence.append(
        f"numpy: reshape(copy=False) of the transposed array raises {numpy_error}; plain reshape copies silently: "
        f"{measured['numpy']['reshape_copies']}"
    )
    return _result(9, CONFIRMED if ok else REFUTED, evidence, measured)


def claim_10(setup: Setup) -> ClaimResult:
    if not _installed("torch"):
        return _result(10, "skipped: torch not installed", ["needs torch.nn.MultiheadAttention"])
    reason = torch_mha_unsupported_reason(setup.cfg)
    if reason:
        return _result(10, "skipped: configuration not expressible as nn.MultiheadAttention", [reason])
    import torch

    cfg, params, x = setup.cfg, setup.params, setup.x
    reference = reference_mha(cfg, params, x)
    state = {name: torch.from_numpy(value) for name, value in to_torch_mha_state_dict(cfg, params).items()}
    default = torch.nn.MultiheadAttention(cfg.d_model, cfg.n_heads, bias=cfg.bias, dtype=torch.float64)
    default.load_state_dict(state)
    batch_first = torch.nn.MultiheadAttention(
        cfg.d_model, cfg.n_heads, bias=cfg.bias, dtype=torch.float64, batch_first=True
    )
    batch_first.load_state_dict(state)
    xt = torch.from_numpy(x)  # (B, N, E)
    with torch.no_grad():
        seq_first_in = xt.transpose(0, 1)  # (N, B, E): what the default expects
        out_seq_first = default(seq_first_in, seq_first_in, seq_first_in, need_weights=False)[0].transpose(
            0, 1
        )  # (B, N, E)
        out_misfed = default(xt, xt, xt, need_weights=False)[0]  # (B, N, E) read as (L=B, N=N, E): no error
        out_batch_first = batch_first(xt, xt, xt, need_weights=False)[0]  # (B, N, E)
    errors = {
        "seq_first_input": _max_abs(out_seq_first.numpy(), reference),
        "batch_first_input_to_default": _max_abs(out_misfed.numpy(), reference),
        "batch_first_true": _max_abs(out_batch_first.numpy(), reference),
    }
    measured = {"default_batch_first": default.batch_first, "errors": errors}
    ok = (
        default.batch_first is False
        and errors["seq_first_input"] <= 1e-10
        and errors["batch_first_true"] <= 1e-10
        and errors["batch_first_input_to_default"] > 1e-3
    )
    B, N, E = x.shape
    evidence = [
        f"nn.MultiheadAttention({cfg.d_model}, {cfg.n_heads}).batch_first = {default.batch_first}",
        f"default module fed (N, B, E) = {(N, B, E)}: max error vs oracle {errors['seq_first_input']:.1e}",
        f"default module fed (B, N, E) = {(B, N, E)}: no error raised, output shape {tuple(out_misfed.shape)}, "
        f"max error {errors['batch_first_input_to_default']:.2f} (it attended across the batch instead of the tokens)",
        f"batch_first=True fed (B, N, E): max error {errors['batch_first_true']:.1e}",
    ]
    return _result(10, CONFIRMED if ok else REFUTED, evidence, measured)


def claim_11(setup: Setup) -> ClaimResult:
    cfg, params, x = setup.cfg, setup.params, setup.x[0]
    N, H = x.shape[0], cfg.n_heads
    q = (linear(x, params.w_q, params.b_q)).reshape(N, H, cfg.d_k)  # (N, H, Dk): a view, no transpose
    k = (linear(x, params.w_k, params.b_k)).reshape(N, H, cfg.d_k)  # (N, H, Dk)
    v = (linear(x, params.w_v, params.b_v)).reshape(N, H, cfg.d_v)  # (N, H, Dv)
    scores_einsum = cfg.scale * np.einsum("nhd,mhd->hnm", q, k)  # (H, N, N) straight from (N, H, Dk)
    scores_transposed = cfg.scale * q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)  # (H, N, Dk) @ (H, Dk, N)
    weights = np.exp(scores_einsum - scores_einsum.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    context = np.einsum("hnm,mhd->nhd", weights, v)  # (N, H, Dv): tokens first again
    merged = context.reshape(N, -1)  # (N, H*Dv): a view, since context is already token-major
    output = linear(merged, params.w_o, params.b_o)  # (N, D)
    reference = reference_mha(cfg, params, x)
    score_diff, output_error = _max_abs(scores_einsum, scores_transposed), _max_abs(output, reference)
    merge_is_view = shares_memory(merged, context)
    evidence = [
        f"scores: einsum('nhd,mhd->hnm') on {q.shape} vs transpose + matmul: max diff {score_diff:.1e}",
        f"context einsum('hnm,mhd->nhd') -> {context.shape}; merge to {merged.shape} is a view (no copy): {merge_is_view}",
        f"whole pass without any transpose vs float64 oracle: max error {output_error:.1e}",
    ]
    measured = {"score_diff": score_diff, "output_error": output_error, "merge_is_view": merge_is_view}
    ok = score_diff <= 1e-10 and output_error <= 1e-10 and merge_is_view
    output_einops, why = _backend_run("einops-numpy", setup)
    if output_einops is not None:
        measured["einops_adapter_error"] = _max_abs(output_einops, reference_mha(cfg, params, setup.x))
        ok = ok and measured["einops_adapter_error"] <= 1e-10
        evidence.append(
            f"einops-numpy adapter (rearrange + einsum, no transpose): max error {measured['einops_adapter_error']:.1e}"
        )
    else:
        evidence.append(why)
    return _result(11, CONFIRMED if ok else REFUTED, evidence, measured)


def claim_12(setup: Setup) -> ClaimResult:
    d_model = 12  # the column/row-sample article's token width
    token = np.zeros(d_model)
    token[[0, 2]] = [1.0, 2.0]
    scorer = np.zeros(d_model)
    scorer[[0, 2]] = [0.5, 1.0]
    w_a = np.zeros((4, d_model))  # (d_k, d_model): column samples, scorer 0 is row 0
    w_a[0] = scorer
    w_b = np.zeros((d_model, 4))  # (d_model, d_k): row samples, scorer 0 is column 0
    w_b[:, 0] = scorer
    scores = {
        "column samples (W_A @ x)": float((w_a @ token[:, None])[0, 0]),
        "row samples (x @ W_B)": float((token[None, :] @ w_b)[0, 0]),
    }
    if _installed("torch"):
        import torch

        linear = torch.nn.Linear(d_model, 4, bias=False, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w_a))  # nn.Linear.weight is W_A: scorer 0 is row 0
            scores["torch nn.Linear"] = float(linear(torch.from_numpy(token))[0])
    a = np.arange(1, 17).reshape(4, 4)  # 4 tokens of 4 numbers
    d = a.reshape(2, 2, 4).reshape(2, 2, 2, 2).transpose(0, 2, 1, 3)  # (2, 2, 4) -> (2, 2, 2, 2) -> swap axes 1, 2
    blocks = {f"D[{g}, {s}]": d[g, s].tolist() for g in range(2) for s in range(2)}
    expected = {
        "D[0, 0]": [[1, 2], [5, 6]],
        "D[0, 1]": [[3, 4], [7, 8]],
        "D[1, 0]": [[9, 10], [13, 14]],
        "D[1, 1]": [[11, 12], [15, 16]],
    }
    ok = all(value == 2.5 for value in scores.values()) and blocks == expected
    evidence = [", ".join(f"{name}: {value}" for name, value in scores.items())]
    evidence.append(", ".join(f"{name} = {value}" for name, value in blocks.items()))
    evidence.append(
        f"token a1 = {a[1].tolist()} sits at D[0, 0, 1] = {d[0, 0, 1].tolist()} and D[0, 1, 1] = {d[0, 1, 1].tolist()}"
    )
    measured = {"scores": scores, "blocks": blocks}
    return _result(12, CONFIRMED if ok else REFUTED, evidence, measured)


CLAIM_CHECKS: dict[int, Callable[[Setup], ClaimResult]] = {
    1: claim_1,
    2: claim_2,
    3: claim_3,
    4: claim_4,
    5: claim_5,
    6: claim_6,
    7: claim_7,
    8: claim_8,
    9: claim_9,
    10: claim_10,
    11: claim_11,
    12: claim_12,
}


# --- speed: the benchmark questions ---------------------------------------------------------


def speed_answers(threads: int = 1, quick: bool = True) -> tuple[dict[int, list[dict]], str]:
    """Run the benchmark questions; answers grouped by claim number, or ({}, why not)."""
    try:
        from mha_rosetta.benchmarks.questions import run_speed_questions
    except ImportError as error:
        return {}, f"benchmark questions unavailable ({error})"
    try:
        answers = run_speed_questions(threads=threads, quick=quick)
    except Exception as error:  # a failed benchmark must not hide the other claims
        return {}, f"benchmark questions failed: {error_line(error)}"
    grouped: dict[int, list[dict]] = {}
    for answer in answers:
        grouped.setdefault(int(answer["claim"]), []).append(answer)
    return grouped, ""


def _evidence_lines(evidence) -> list[str]:
    if isinstance(evidence, str):
        return [evidence]
    if isinstance(evidence, dict):
        return [f"{key}: {value}" for key, value in evidence.items()]
    if isinstance(evidence, (list, tuple)):
        return [str(item) for item in evidence]
    return [str(evidence)]


def _speed_verdict(answer: dict) -> str:
    """The benchmark's verdict in this module's words ("partly" -> "partly confirmed")."""
    verdict = str(answer.get("verdict", "skipped"))
    if verdict == "partly":
        return PARTLY
    if verdict == "skipped":
        return "skipped: nothing could be measured"
    return verdict


def merge_verdicts(verdicts: list[str]) -> str:
    """One verdict for several measured parts (skipped parts do not count)."""
    measured = [v for v in verdicts if not v.startswith("skipped")]
    if not measured:
        return verdicts[0] if verdicts else "skipped: nothing measured"
    if all(v == CONFIRMED for v in measured):
        return CONFIRMED
    if all(v == REFUTED for v in measured):
        return REFUTED
    if all(v.startswith(CONFIRMED) for v in measured):
        return CAVEAT
    return PARTLY


def add_speed(result: ClaimResult, answers: list[dict], why_not: str) -> ClaimResult:
    """Fold the benchmark questions' answers for this claim into its verdict and evidence."""
    if not answers:
        note = why_not or "no benchmark question answers this claim"
        result.evidence.append(f"speed: not measured ({note})")
        if result.claim in SPEED_ONLY_CLAIMS:
            result.verdict = f"skipped: speed not measured ({note})"
        return result
    speed_verdicts = []
    for answer in answers:
        verdict = _speed_verdict(answer)
        speed_verdicts.append(verdict)
        label = answer.get("title", "speed")
        result.evidence.append(f"speed ({label}): {verdict}: " + "; ".join(_evidence_lines(answer.get("evidence", ""))))
    # The per-cell timings stay in the benchmark output; the claim keeps the verdicts and ratios.
    result.measured["speed"] = [{k: answer.get(k) for k in ("title", "verdict", "evidence")} for answer in answers]
    speed = merge_verdicts(speed_verdicts)
    if result.claim in SPEED_ONLY_CLAIMS:
        result.verdict = speed
    elif result.verdict == CONFIRMED and speed not in (CONFIRMED,) and not speed.startswith("skipped"):
        result.verdict = CAVEAT  # the layout facts hold; the speed part does not (or not everywhere)
    return result


def _run_check(number: int, setup: Setup) -> ClaimResult:
    """One claim's check; a configuration the check cannot express becomes a skip, not a crash.

    The claims are statements about plain multi-head attention; grouped kv heads or other
    widths can make a demonstration inapplicable, which the verdict then says.
    """
    if setup.cfg.n_kv_heads != setup.cfg.n_heads and number in (6, 7, 10, 11):
        return _result(number, "skipped: the demonstration assumes one kv head per query head", [setup.cfg.describe()])
    return CLAIM_CHECKS[number](setup)


def run_claims(
    numbers: list[int] | None = None,
    setup: Setup | None = None,
    speed: bool = False,
    threads: int = 1,
    quick: bool = True,
) -> list[ClaimResult]:
    """Run the claims (all by default); with ``speed=True`` also the benchmark questions."""
    numbers = sorted(CLAIM_CHECKS) if numbers is None else list(numbers)
    unknown = [n for n in numbers if n not in CLAIM_CHECKS]
    if unknown:
        raise ValueError(f"claims are numbered 1-12; got {unknown}")
    setup = make_setup() if setup is None else setup
    answers, why_not = speed_answers(threads, quick) if speed and any(n in SPEED_CLAIMS for n in numbers) else ({}, "")
    results = []
    for number in numbers:
        result = _run_check(number, setup)
        if number in SPEED_CLAIMS:
            if speed:
                result = add_speed(result, answers.get(number, []), why_not)
            else:
                result.evidence.append(
                    "speed: not run (the benchmark questions run with speed=True, as `mha-rosetta explain --claims` does)"
                )
        results.append(result)
    return results
