"""One tolerance table keyed by dtype, used by every comparison in the project.

Two arrays agree when ``|actual - expected| <= atol + rtol * |expected|`` elementwise
(the rule of ``numpy.allclose``), with NaN equal to NaN and infinities equal only to
themselves. The table is sized for this project's outputs, which are O(1) by the
construction of `init_params` and unit-variance inputs: a few units in the last
place of each dtype, times the depth of the pipeline (two projections, a softmax
and two weighted sums). A wrong head split or a transposed weight gives errors of
order 1, far above every entry, so the table never hides a real mistake.

Per-call overrides merge on top of the table (the way JAX's public_test_util does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import check_dtype_name


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[str, Tolerance] = {
    # float64 eps 2.2e-16: reduction order alone moves the last few digits.
    "float64": Tolerance(atol=1e-10, rtol=1e-9),
    # float32 eps 1.2e-7: sums over up to ~1000 terms in three chained products.
    "float32": Tolerance(atol=2e-5, rtol=2e-4),
    # float16 eps 9.8e-4: inputs, weights and every stage are rounded to 11 bits.
    "float16": Tolerance(atol=2e-2, rtol=2e-2),
    # bfloat16 eps 7.8e-3: 8 bits of mantissa.
    "bfloat16": Tolerance(atol=1e-1, rtol=1e-1),
}


def tolerance_for(dtype: object, atol: float | None = None, rtol: float | None = None) -> Tolerance:
    """The table entry for ``dtype`` with optional per-call overrides merged on top."""
    base = TOLERANCES[check_dtype_name(dtype)]
    return Tolerance(atol=base.atol if atol is None else atol, rtol=base.rtol if rtol is None else rtol)


@dataclass(frozen=True)
class Comparison:
    """How far ``actual`` is from ``expected``, and whether that is within tolerance."""

    max_abs: float
    max_rel: float
    worst_index: tuple[int, ...] | None
    tolerance: Tolerance
    ok: bool
    reason: str = ""

    def summary(self) -> str:
        verdict = "agree" if self.ok else "DISAGREE"
        where = "" if self.worst_index is None else f" at {self.worst_index}"
        extra = f" ({self.reason})" if self.reason else ""
        return (
            f"{verdict}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}{where} "
            f"(atol {self.tolerance.atol:g}, rtol {self.tolerance.rtol:g}){extra}"
        )


def compare(actual, expected, dtype: object, atol: float | None = None, rtol: float | None = None) -> Comparison:
    """Compare two arrays under the tolerance of ``dtype`` (the lower-precision side).

    ``max_rel`` is ``|a - e| / |e|`` over elements where ``|e| > atol`` (a relative
    error next to zero says nothing). Both arrays are compared in float64.
    """
    tol = tolerance_for(dtype, atol, rtol)
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return Comparison(np.inf, np.inf, None, tol, False, f"shape {a.shape} != expected {e.shape}")
    if a.size == 0:
        return Comparison(0.0, 0.0, None, tol, True)
    nan_mismatch = np.isnan(a) != np.isnan(e)
    both_same_inf = np.isinf(a) & np.isinf(e) & (a == e)
    finite = np.isfinite(a) & np.isfinite(e)
    inf_mismatch = ~finite & ~both_same_inf & ~(np.isnan(a) & np.isnan(e))
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in masked stages; masked out below
        diff = np.where(finite, np.abs(a - e), 0.0)
    diff = np.where(nan_mismatch | inf_mismatch, np.inf, diff)
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
    max_abs = float(diff[worst])
    significant = finite & (np.abs(e) > tol.atol)
    max_rel = float(np.max(diff[significant] / np.abs(e[significant]))) if significant.any() else 0.0
    ok = bool(np.all(diff <= tol.atol + tol.rtol * np.where(finite, np.abs(e), 0.0)))
    reason = ""
    if nan_mismatch.any():
        reason = f"NaN in one array only at {int(nan_mismatch.sum())} element(s)"
    elif inf_mismatch.any():
        reason = f"infinity mismatch at {int(inf_mismatch.sum())} element(s)"
    return Comparison(max_abs, max_rel, worst if max_abs > 0 else None, tol, ok, reason)


def assert_close(
    actual,
    expected,
    dtype: object = "float64",
    atol: float | None = None,
    rtol: float | None = None,
    what: str = "arrays",
) -> Comparison:
    """Raise AssertionError with the comparison summary unless the arrays agree."""
    result = compare(actual, expected, dtype, atol, rtol)
    if not result.ok:
        raise AssertionError(f"{what}: {result.summary()}")
    return result


def lower_precision(*dtypes: object) -> str:
    """Of several dtype names, the one with the loosest tolerance (used for pairs)."""
    names = [check_dtype_name(d) for d in dtypes]
    return max(names, key=lambda n: TOLERANCES[n].atol)


# -- gradients ------------------------------------------------------------------------------
# A gradient tensor is compared like a forward one, with two differences. First, gradients
# of weights and biases sum over every (batch item, token), so their size grows with the
# problem where the forward's stays O(1): ``atol`` is taken relative to the tensor's largest
# entry (never below 1), `gradient_scale`. Second, the backward chains about twice as many
# rounded products as the forward (dO -> merged -> context -> weights -> scores -> q/k -> x
# and a weight gradient at each end), so float64 and float32 get about 2.5x the forward's
# entries. Measured on the spec cases (`reference_mha_vjp` with ``rounding=`` against the
# float64 oracle, errors over the tensor's scale): float32 at most 6.4e-7, float16 2.1e-3,
# bfloat16 1.4e-2. A wrong head, a missing GQA sum or a transposed weight gradient is O(1).
GRAD_TOLERANCES: dict[str, Tolerance] = {
    # reduction order in twice as many chained products as the forward
    "float64": Tolerance(atol=1e-9, rtol=1e-8),
    # 80x the worst spec-path error measured above: room for other summation orders
    "float32": Tolerance(atol=5e-5, rtol=5e-4),
    # used only where no float32 baseline is at hand (pairs take the half rule's sum, below):
    # about 5x the spec path's measured error
    "float16": Tolerance(atol=1e-2, rtol=1e-2),
    "bfloat16": Tolerance(atol=8e-2, rtol=8e-2),
}

# The rule FlashAttention's tests use for half precision: an implementation's max abs error
# against the float64 oracle may be at most HALF_GRAD_FACTOR times the error of the spec's
# own float32 path with every stage rounded to the same dtype (`reference_mha_vjp(...,
# rounding=dtype)`), plus a floor of one unit in the last place of the tensor's largest
# entry (the error of merely storing the exact answer in that dtype, so a baseline that
# happens to be exact does not demand exactness). It adapts to each case and tensor instead
# of one number for all, and it cannot be met by an implementation that loses more than
# about one extra bit on the way.
HALF_GRAD_FACTOR = 2.0
HALF_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def gradient_scale(expected) -> float:
    """The largest finite ``|expected|``, never below 1: what gradient ``atol`` is relative to."""
    e = np.asarray(expected, dtype=np.float64)
    finite = e[np.isfinite(e)]
    return max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0


def grad_tolerance(dtype: object, expected, baseline_error: float | None = None) -> Tolerance:
    """The tolerance for one gradient tensor against the oracle's ``expected``.

    float64/float32 (or no baseline): `GRAD_TOLERANCES` with ``atol`` times `gradient_scale`.
    float16/bfloat16 with ``baseline_error`` (max abs error of the rounded spec path on this
    tensor): the half rule, ``atol = HALF_GRAD_FACTOR * baseline_error + ulp``, ``rtol = 0``.
    """
    name = check_dtype_name(dtype)
    scale = gradient_scale(expected)
    if baseline_error is not None and name in HALF_EPS:
        return Tolerance(atol=HALF_GRAD_FACTOR * baseline_error + HALF_EPS[name] * scale, rtol=0.0)
    base = GRAD_TOLERANCES[name]
    return Tolerance(atol=base.atol * scale, rtol=base.rtol)
