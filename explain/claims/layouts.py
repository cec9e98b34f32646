"""Claims 1-4: column and row samples, nn.Linear's weight, memory layout, and the reshape/transpose chain."""

from __future__ import annotations

import numpy as np

from mha_rosetta.backends import installed
from mha_rosetta.backends.demos import LibraryMissing, linear_weight_facts
from mha_rosetta.backends.frameworks import get_framework
from mha_rosetta.core import compare

from ..memory import shares_memory, strides_in_elements
from ..seed_setup import Setup
from .registry import CONFIRMED, REFUTED, SPEED_NOT_RUN, ClaimResult, _backend_stages, _fmt, _max_abs, _result, claim


@claim(
    1,
    "Column samples (Y = W_A @ X, rows of W are scorers) and row samples (Y = X @ W_B, columns are scorers) give the same numbers: W_B = W_A.T, Y_B = Y_A.T",
)
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
        from mha_rosetta.backends import canonical_stage

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


@claim(
    2,
    "nn.Linear.weight is (out, in) and computes x @ W.T + b",
)
def claim_2(setup: Setup) -> ClaimResult:
    try:
        measured = linear_weight_facts()  # the article's nn.Linear(in_features=4, out_features=2), seeded
    except LibraryMissing:
        return _result(2, "skipped: torch not installed", ["needs torch.nn.Linear"])
    shape, difference, raised = measured["weight_shape"], measured["max_abs"], measured["x_at_w_error"]
    ok = shape == (2, 4) and difference <= 1e-12 and raised != "no error"
    evidence = [
        f"nn.Linear(in_features=4, out_features=2).weight.shape = {shape} (out, in)",
        f"max |linear(x) - (x @ W.T + b)| = {difference:.1e}",
        f"x @ W without .T raises {raised}",
    ]
    return _result(2, CONFIRMED if ok else REFUTED, evidence, measured)


@claim(
    3,
    "X @ W.T is preferred to W @ X.T because of memory layout (contiguity)",
    speed="X @ W.T against W @ X.T (both read a transposed view; the second also needs a copy back to row samples)",
    speed_only=True,
)
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


# The libraries whose arrays claim 4 walks: the article's NumPy, and torch; JAX arrays are immutable and XLA
# chooses their buffers, so there are no views of them to show.
CLAIM_4_LIBRARIES = ("numpy", "torch")


@claim(
    4,
    "reshape/transpose chains lose nothing: (32, 8) -> (4, 8, 8) -> (4, 8, 2, 4) -> (4, 2, 8, 4); row 5 lands at D[0, 0, 5] and D[0, 1, 5]",
)
def claim_4(setup: Setup) -> ClaimResult:
    evidence, measured, ok = [], {}, True
    libraries = [library for library in CLAIM_4_LIBRARIES if installed(library)]
    row = lambda t, i: np.asarray(t[i])  # noqa: E731  (row i of a NumPy array or a torch tensor, as NumPy)
    for library in libraries:
        xp = get_framework(library).namespace()
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
