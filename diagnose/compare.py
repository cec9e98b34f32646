"""Two real attention modules side by side: does the port compute what the original computes, and if not, why.

`compare(a, b)`:

1. reads both (`mha_rosetta.models.from_module`);
2. names every `MHAConfig` field where their configurations differ (the rotary convention, the scale, a
   window, an eps...);
3. loads A's canonical parameters into B (`to_module`, B's configuration: the numbers a porter copies);
4. runs both through their own forward (`models.real_modules.run_module`: the module's own call, its
   model's mask) on the same input;
5. reports agreement within the tolerance of the lower of ``dtype`` and the two runs' declared levels
   (an MLX float64 run, Hugging Face's float32 rotary angles), or the first stage where the spec of A's
   configuration and the spec of B's part (`core.reference_stages` with A's parameters: each module is
   first checked against the spec of what was read from it) and the likeliest causes in diagnose's
   vocabulary: every `diagnose.hypotheses` of A's configuration whose simulation (`diagnose.simulate`)
   reproduces B's output within the tolerance.

``decode=True`` also steps both modules through their own caches token by token
(`models.decode_steps`: Hugging Face's ``DynamicCache``, mlx-lm's ``KVCache``) and names the first step
whose outputs differ.

It lives in diagnose, not models: it uses diagnose's causes, and models imports only core (the layering
contract in pyproject.toml); `mha_rosetta.diagnose.compare` is its name.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from mha_rosetta.core import MHAConfig, expected_param_shapes, reference_mha, tolerance_for
from mha_rosetta.core.dtypes import check_dtype_name, numpy_dtype
from mha_rosetta.core.reference import reference_stages
from mha_rosetta.core.tolerances import lower_precision

from .causes import Hypothesis, hypotheses
from .simulate import Bug, simulate


@dataclass(frozen=True)
class FieldDifference:
    name: str  # the MHAConfig field
    a: object
    b: object

    def __str__(self) -> str:
        return f"{self.name}: A {self.a!r}, B {self.b!r}"


@dataclass(frozen=True)
class LikelyCause:
    code: str  # one of diagnose.CAUSE_CODES
    detail: str
    fix: str
    residual: float  # the worst |B - simulation|, in units of the tolerance (<= 1: explained)


@dataclass
class Comparison:
    a: str  # the modules' classes
    b: str
    differences: list[FieldDifference]
    agrees: bool
    max_error: float  # max |A - B| of the forward outputs
    dtype: str  # the tolerance level used
    stage: str | None = None  # the first stage where the specs of A's and B's configurations part
    causes: list[LikelyCause] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # each run's declared precision cause; what was left out
    decode_steps: list[float] = field(default_factory=list)  # max |A - B| per decode step (decode=True)
    first_decode_step: int | None = None  # the first step beyond the tolerance

    def summary(self) -> str:
        tol = tolerance_for(self.dtype)
        lines = [f"A: {self.a}", f"B: {self.b}"]
        lines += [f"differs: {d}" for d in self.differences] or ["the configurations read are the same"]
        verdict = "AGREE" if self.agrees else "DISAGREE"
        lines.append(
            f"{verdict}: forward max abs error {self.max_error:.3g} ({self.dtype} tolerance atol {tol.atol:g}, "
            f"rtol {tol.rtol:g})"
        )
        if self.stage:
            lines.append(f"first divergent stage: {self.stage}")
        lines += [f"likeliest cause: {c.code} ({c.detail}); fix: {c.fix}" for c in self.causes]
        if self.decode_steps:
            steps = ", ".join(f"{e:.2g}" for e in self.decode_steps)
            where = "none" if self.first_decode_step is None else f"step {self.first_decode_step}"
            lines.append(f"decode: max abs error per step {steps}; first step that differs: {where}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self)


def config_fields_differing(a: MHAConfig, b: MHAConfig) -> list[FieldDifference]:
    """Every field of two configurations that differs (`models.differing_fields`: floats within 1e-12 relative
    are the same)."""
    from mha_rosetta.models import differing_fields

    return [FieldDifference(*difference) for difference in differing_fields(a, b)]


def compare(a, b, *, x=None, dtype: str = "float64", decode: bool = False, seed: int = 0) -> Comparison:
    """Compare real attention modules ``a`` (the original) and ``b`` (the port); see the module's docstring.

    ``x (B, N, d_model)``: the input (default: a seeded normal draw of (2, 7, d_model)), rounded to
    ``dtype``. ``b`` is loaded with ``a``'s parameters (in place where its framework's modules are mutable).
    Raises ValueError when B cannot hold A's parameters (other sizes), naming the fields.
    """
    from mha_rosetta.models import from_module, to_module

    dtype = check_dtype_name(dtype)
    cfg_a, params = from_module(a)
    cfg_b = from_module(b).cfg
    differences = config_fields_differing(cfg_a, cfg_b)
    if expected_param_shapes(cfg_a) != expected_param_shapes(cfg_b):
        raise ValueError(
            "compare: B cannot hold A's parameters (their shapes differ): " + "; ".join(map(str, differences))
        )
    b = to_module(cfg_b, params, b)
    if x is None:
        x = np.random.default_rng(seed).standard_normal((2, 7, cfg_a.d_model))
    x = np.asarray(x).astype(numpy_dtype(dtype)).astype(np.float64)
    if x.ndim != 3 or x.shape[-1] != cfg_a.d_model:
        raise ValueError(f"compare: x must be (B, N, d_model={cfg_a.d_model}), got shape {x.shape}")
    notes: list[str] = []
    run_a, run_b = _run(a, x, "A", notes), _run(b, x, "B", notes)
    level = lower_precision(dtype, run_a.precision, run_b.precision)
    tol = tolerance_for(level)
    notes += [f"{name}: {run.note}" for name, run in (("A", run_a), ("B", run_b)) if run.note]
    error = float(np.abs(run_a.output - run_b.output).max())
    agrees = bool(np.allclose(run_b.output, run_a.output, atol=tol.atol, rtol=tol.rtol))
    result = Comparison(_name(a), _name(b), differences, agrees, error, level, notes=notes)
    if not agrees:
        _explain(result, cfg_a, cfg_b, params, x, run_a.output, run_b.output, tol)
    if decode:
        _decode(result, a, b, cfg_a, cfg_b, x, tol)
    return result


def _run(module, x, label: str, notes: list[str]):
    """The module's own forward (`run_module`); where its reader has none, its library's module rebuilt from what
    was read (`run_real`, said in ``notes``); where there is neither, ValueError naming the layout."""
    from mha_rosetta.models import from_module, layout_of_module
    from mha_rosetta.models.real_modules import run_module, run_real

    layout = layout_of_module(module)
    if layout.reader is not None and layout.reader.forward is not None:
        return run_module(module, x)[0]
    if layout.runner is None:
        raise ValueError(
            f"compare: {label} ({layout.name}) has no forward in mha_rosetta.models (its library's oracle backend "
            "runs it): it cannot be run here"
        )
    cfg, params = from_module(module)
    notes.append(
        f"{label}: layout {layout.name!r} reads no instance forward: its library's own module, rebuilt from what "
        "from_module read, ran (run_real)"
    )
    return run_real(layout.name, cfg, layout.to_state_dict(cfg, params), x)


def _name(module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _explain(result: Comparison, cfg_a, cfg_b, params, x, out_a, out_b, tol) -> None:
    """The first stage where the specs part, and diagnose's hypotheses that reproduce B."""
    for name, cfg, out in (("A", cfg_a, out_a), ("B", cfg_b, out_b)):
        if not np.allclose(out, reference_mha(cfg, params, x), atol=tol.atol, rtol=tol.rtol):
            result.notes.append(f"{name}'s output is not the spec of what from_module read from it")
    stages_a, stages_b = reference_stages(cfg_a, params, x), reference_stages(cfg_b, params, x)
    for name, array in stages_a.items():
        other = stages_b.get(name)
        if other is not None and (other.shape != array.shape or not _close(array, other, tol)):  # a split differs
            result.stage = name
            break
    fits = []
    for hypothesis in [*_field_hypotheses(cfg_a, cfg_b), *hypotheses(cfg_a)]:
        simulated = simulate(cfg_a, params, x, x, x, None, hypothesis.bug)
        residual = float(np.max(np.abs(out_b - simulated) / (tol.atol + tol.rtol * np.abs(simulated))))
        if residual <= 1.0:
            fits.append(LikelyCause(hypothesis.code, hypothesis.detail, hypothesis.fix, residual))
    result.causes = sorted(dict.fromkeys(fits), key=lambda c: c.residual)
    if not fits:
        result.notes.append("no single cause of diagnose's vocabulary reproduces B's output")


def _field_hypotheses(cfg_a: MHAConfig, cfg_b: MHAConfig) -> list[Hypothesis]:
    """diagnose's causes with B's own value where the configurations say it (diagnose's scale hypotheses are
    the usual slips, missing, twice, 1/sqrt(d_model); a port's scale may be any other, Gemma's head_dim**-0.5)."""
    if math.isclose(cfg_a.scale, cfg_b.scale, rel_tol=1e-12):
        return []
    return [
        Hypothesis(
            "scale",
            f"B scales scores by {cfg_b.scale:.6g} where A scales by {cfg_a.scale:.6g}",
            Bug(scale=cfg_b.scale),
            f"scores must be multiplied by {cfg_a.scale:.6g} (A's scale): set B's scale to it",
        )
    ]


def _close(a, b, tol) -> bool:
    finite = np.isfinite(a) & np.isfinite(b)
    return bool(
        np.array_equal(np.isfinite(a), np.isfinite(b)) and np.allclose(a[finite], b[finite], tol.rtol, tol.atol)
    )


def _decode(result: Comparison, a, b, cfg_a, cfg_b, x, tol) -> None:
    from mha_rosetta.models.decode_steps import decode_steps

    steps_a, steps_b = decode_steps(a, x, cfg_a.window), decode_steps(b, x, cfg_b.window)
    for t, (ya, yb) in enumerate(zip(steps_a, steps_b, strict=True)):
        result.decode_steps.append(float(np.abs(ya - yb).max()))
        if result.first_decode_step is None and not np.allclose(yb, ya, atol=tol.atol, rtol=tol.rtol):
            result.first_decode_step = t
