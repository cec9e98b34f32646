"""`diagnose(candidate, cfg)`: does an attention implementation agree with the spec, and if not, why.

Method. The candidate runs on every probe of `diagnose.probes`. Every hypothesis of
`diagnose.causes` (one convention error each, plus "no error") is simulated on the same
probes by `diagnose.simulate`, and each is scored by how far the candidate's outputs are
from that simulation, in units of the tolerance of the candidate's dtype (the worst probe
counts). "No error" within tolerance: the candidate agrees. Otherwise the causes are the
hypotheses that explain every probe, best first; when no single one does, pairs of the
best few are tried (two bugs at once); when nothing explains everything, the best partial
fits are returned and say so. Hypotheses that change no probe's output (a dropped ``b_k``,
GQA grouping with one kv head) are never named, so a correct candidate is never blamed,
and two hypotheses that predict the same outputs on every probe are reported as one.

Each cause carries its evidence: the probe that shows it best (the candidate's error there
against the oracle and against the cause), the probe that tells it from the next best
hypothesis, and, where the cause has a repair (a change of the parameters or mask fed to the
candidate, `diagnose.repairs`), the result of running the candidate again with it.

Time limit. Each call of the candidate runs in a daemon worker thread joined with a
timeout: the candidate may be any callable (a closure over a torch module, a jitted
function), which a subprocess could not receive without pickling it and re-importing its
framework for every probe; a thread keeps it in this process. A call past the limit is
abandoned (Python cannot kill a thread; being a daemon, it does not keep the interpreter
alive: no non-daemon thread is ever started) and `diagnose` raises `DiagnoseError` naming
the probe: it never hangs. A candidate that ends its process, or hangs in native code that
holds the GIL, can only be contained by a process: `diagnose.isolated` runs a candidate
named by import path (what the command line gets) in a child process, watching each call
through ``announce``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, check_dtype_name, lower_precision, numpy_dtype, tolerance_for
from mha_rosetta.core.config import require_config
from mha_rosetta.core.variants import VARIANT_REGISTRY

from .calling import DiagnoseError, _as_output, _call
from .causes import Hypothesis, hypotheses, latent_form, unseen_variants
from .probes import Q_TOKENS, Probe, make_probes
from .simulate import Bug, allowed_under, simulate, unsimulated_reason

DEFAULT_TIMEOUT_S = 30.0
PAIR_CANDIDATES = 8  # how many of the best single causes are combined in pairs


@dataclass(frozen=True)
class Cause:
    code: str  # one of causes.CAUSE_CODES
    detail: str
    evidence: str
    fix: str
    residual: float = math.nan  # the candidate's worst distance from this cause, in tolerances (<= 1: explained)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Diagnosis:
    agrees: bool
    max_error: float  # max abs error against the oracle over the ranking probes
    causes: list[Cause] = field(default_factory=list)
    known_differences: list[str] = field(default_factory=list)  # named conventions (a row with nothing to attend to)
    notes: list[str] = field(default_factory=list)  # probes left out, and why
    probe_errors: dict[str, float] = field(default_factory=dict)  # max abs error against the oracle, per probe
    dtype: str = "float64"  # the tolerance used

    def summary(self) -> str:
        tol = tolerance_for(self.dtype)
        head = (
            f"agrees with the oracle: max abs error {self.max_error:.3g} "
            f"(tolerance {self.dtype}: atol {tol.atol:g}, rtol {tol.rtol:g})"
            if self.agrees
            else f"DISAGREES with the oracle: max abs error {self.max_error:.3g} "
            f"({self.dtype} tolerance atol {tol.atol:g})"
        )
        lines = [head]
        lines += [f"known difference: {text}" for text in self.known_differences]
        lines += [
            "per probe (max abs error against the oracle): "
            + ", ".join(f"{k} {v:.2g}" for k, v in self.probe_errors.items())
        ]
        for rank, cause in enumerate(self.causes, 1):
            lines.append(f"{rank}. {cause.code}: {cause.detail}")
            lines.append(f"   evidence: {cause.evidence}")
            lines.append(f"   fix: {cause.fix}")
        lines += [f"note: {text}" for text in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        fields = asdict(self)  # copies; the causes become dicts too
        # The JSON's key order (dtype after max_error, not where the field stands).
        order = ("agrees", "max_error", "dtype", "causes", "known_differences", "notes", "probe_errors")
        return {key: fields[key] for key in order}


# -- scoring --------------------------------------------------------------------------------
@dataclass
class _Observed:
    probe: Probe
    output: np.ndarray  # (B, Nq, D) float64


def _valid_rows(cfg: MHAConfig, probe: Probe, bug: Bug) -> np.ndarray:
    """(B, Nq): rows where every head may attend to some key under ``bug`` (others differ by convention)."""
    B, Nq, Nk = probe.query.shape[0], probe.query.shape[1], probe.key.shape[1]
    allowed = allowed_under(cfg, Nq, Nk, probe.mask, bug)
    if allowed is None:
        return np.ones((B, Nq), dtype=bool)
    allowed = np.broadcast_to(allowed, (B, cfg.n_heads, Nq, Nk))
    if bug.softmax_axis == -2:
        # Normalised over queries, a key no query may see is 0/0 (NaN, or zero, by convention) and
        # its value reaches every query row of that batch item: only items without one can be compared.
        return np.broadcast_to(allowed.any(axis=-2).all(axis=(1, 2))[:, None], (B, Nq))
    return allowed.any(axis=-1).all(axis=1)


def _distance(actual: np.ndarray, expected: np.ndarray, rows: np.ndarray, dtype: str) -> tuple[float, float]:
    """(max abs error, that error in tolerances) over ``rows``; NaN or inf where finite was expected is inf."""
    if not rows.any():
        return 0.0, 0.0
    a, e = actual[rows], expected[rows]
    with np.errstate(invalid="ignore"):
        diff = np.where(np.isfinite(a), np.abs(a - e), np.inf)
    tol = tolerance_for(dtype)
    allowed = tol.atol + tol.rtol * np.abs(e)
    return float(diff.max()), float((diff / allowed).max())


@dataclass
class _Fit:
    hypothesis: Hypothesis | None  # None: no error (the oracle)
    bug: Bug
    per_probe: dict[str, tuple[float, float]]  # probe -> (max abs, in tolerances)
    predictions: dict[str, np.ndarray]

    @property
    def score(self) -> float:
        return max((ratio for _, ratio in self.per_probe.values()), default=0.0)

    @property
    def label(self) -> str:
        return "no error" if self.hypothesis is None else self.hypothesis.label


def _fit(cfg, observed: list[_Observed], bug: Bug, hypothesis, dtype: str) -> _Fit:
    per_probe, predictions = {}, {}
    for obs in observed:
        p = obs.probe
        predicted = simulate(cfg, p.params, p.query, p.key, p.value, p.mask, bug)
        predictions[p.name] = predicted
        per_probe[p.name] = _distance(obs.output, predicted, _valid_rows(cfg, p, bug), dtype)
    return _Fit(hypothesis, bug, per_probe, predictions)


def _same_prediction(cfg, a: _Fit, b: _Fit, observed: list[_Observed], dtype: str) -> bool:
    for obs in observed:
        rows = _valid_rows(cfg, obs.probe, a.bug) & _valid_rows(cfg, obs.probe, b.bug)
        if _distance(a.predictions[obs.probe.name], b.predictions[obs.probe.name], rows, dtype)[1] > 1.0:
            return False
    return True


# -- the diagnosis --------------------------------------------------------------------------
def diagnose(
    candidate,
    cfg: MHAConfig | None = None,
    *,
    like=None,
    dtype: str = "float64",
    timeout: float = DEFAULT_TIMEOUT_S,
    seed: int = 0,
    announce: Callable[[str, str], None] | None = None,
) -> Diagnosis:
    """Probe ``candidate(params, query, key, value, mask) -> output`` and name what it gets wrong.

    ``params`` is `core.MHAParams` (canonical layout, NumPy); ``query`` (B, Nq, d_model),
    ``key`` (B, Nk, kdim), ``value`` (B, Nk, vdim) and ``mask`` (B, 1, Nq, Nk) bool, True = may
    attend, or None: NumPy arrays of ``dtype``. The candidate loads the parameters into its
    own module with its own conversion and returns (B, Nq, d_model) as a NumPy, torch or JAX
    array. Raises `DiagnoseError` when it cannot be diagnosed, naming the probe and the reason.
    ``like``: a real attention module (Hugging Face, ``nn.MultiheadAttention``, Keras, Flax, Equinox)
    whose configuration is the reference, instead of ``cfg``: ``mha_rosetta.models.from_module(like).cfg``
    (its sizes, kv heads, scale, causal, rotary...). Give one of ``cfg`` and ``like``.
    ``announce(event, probe)``, if given, is called with ``"call"`` before and ``"done"`` after
    each call of the candidate (`diagnose.isolated` watches a child process's calls with it).
    """
    if not callable(candidate):
        raise TypeError(
            f"candidate must be callable as candidate(params, query, key, value, mask) -> output; "
            f"got {type(candidate).__name__} {candidate!r:.80}"
        )
    cfg = reference_config(cfg, like)
    dtype = check_dtype_name(dtype)
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    np_dtype = numpy_dtype(dtype)
    out_dtypes = {dtype}
    notes: list[str] = unseen_variants(cfg, Q_TOKENS)

    def run(probe: Probe, params: MHAParams | None = None, mask="probe") -> np.ndarray:
        params = probe.params if params is None else params
        mask = probe.mask if isinstance(mask, str) else mask
        # Self-attention probes pass one array three times, as callers do (torch's fast path checks identity).
        cast = {id(a): a.astype(np_dtype) for a in (probe.query, probe.key, probe.value)}
        args = (params.astype(np_dtype), *(cast[id(a)] for a in (probe.query, probe.key, probe.value)), mask)
        expected = (probe.query.shape[0], probe.query.shape[1], cfg.d_model)
        output, out_dtype = _as_output(_call(candidate, args, timeout, probe.name, announce), expected, probe.name)
        out_dtypes.add(out_dtype)
        return output

    observed: list[_Observed] = []
    empty_probe: _Observed | None = None
    for probe in make_probes(cfg, seed):
        try:
            output = run(probe)
        except DiagnoseError as error:
            if not probe.optional:
                raise
            notes.append(f"probe {probe.name!r} left out: {error}")
            continue
        if probe.optional and _ignores_key_value(run, probe, output):
            notes.append(f"probe {probe.name!r} left out: the candidate ignores key and value (self-attention only)")
            continue
        if not observed and not np.isfinite(output).any():
            # Only on the first probe (no mask): NaN where a mask blocks a whole row is evidence, not an error.
            raise DiagnoseError(f"the candidate returned NaN or inf everywhere on probe {probe.name!r}")
        if probe.ranks:
            observed.append(_Observed(probe, output))
        else:
            empty_probe = _Observed(probe, output)
    tol_dtype = lower_precision(*out_dtypes)

    oracle = _fit(cfg, observed, Bug(), None, tol_dtype)
    errors = {name: err for name, (err, _) in oracle.per_probe.items()}
    max_error = max(errors.values())
    if oracle.score <= 1.0:
        known = _empty_row_difference(cfg, empty_probe, tol_dtype) if empty_probe else []
        return Diagnosis(True, max_error, [], known, notes, errors, tol_dtype)

    fits = []
    for hypothesis in hypotheses(cfg):
        fit = _fit(cfg, observed, hypothesis.bug, hypothesis, tol_dtype)
        if _same_prediction(cfg, fit, oracle, observed, tol_dtype):
            continue  # changes no probe's output: it can never be the cause
        if any(_same_prediction(cfg, fit, kept, observed, tol_dtype) for kept in fits):
            continue  # indistinguishable from one already listed (the first in vocabulary order is kept)
        fits.append(fit)
    fits.sort(key=lambda f: f.score)
    explained = [f for f in fits if f.score <= 1.0]
    partial = False
    if not explained:
        pair = _explaining_pair(fits[:PAIR_CANDIDATES], lambda bug: _fit(cfg, observed, bug, None, tol_dtype))
        if pair:
            explained = list(pair)
            notes.append(f"no single cause explains every probe; {pair[0].label} and {pair[1].label} together do")
        else:
            explained, partial = fits[:3], True
            notes.append(
                "no single cause (nor any pair of the likeliest) explains every probe; the best partial fits follow"
            )
    causes = [_cause(cfg, fit, fits, oracle, run, observed, partial, tol_dtype) for fit in explained]
    return Diagnosis(False, max_error, causes, [], notes, errors, tol_dtype)


def reference_config(cfg: MHAConfig | None, like=None, decode: bool = False) -> MHAConfig:
    """The configuration to diagnose against: ``cfg``, or the one `models.from_module` reads from ``like``
    (``decode``: for `diagnose_decode`, whose loop caches a form's latents where its `SimulatedSteps.cached` says)."""
    if like is None:
        if cfg is None:
            raise TypeError("diagnose needs the reference configuration: cfg=MHAConfig(...) or like=<attention module>")
        return _simulated(require_config(cfg), decode)
    if cfg is not None:
        raise TypeError("give cfg or like, not both: like=<module> is the reference configuration (from_module)")
    from mha_rosetta.models import from_module

    return _simulated(from_module(like).cfg, decode)


def _simulated(cfg: MHAConfig, decode: bool = False) -> MHAConfig:
    """``cfg`` when diagnose's probes and simulator reproduce it; a DiagnoseError naming the form otherwise."""
    # A form whose weights read latents (`Variant.base_shapes`) decodes only where its entry says what it caches.
    entries = [VARIANT_REGISTRY[name] for name in cfg.variants]
    uncached = [e.name for e in entries if e.base_shapes and not (e.diagnose and e.diagnose.simulated.cached)]
    if uncached and decode:
        raise DiagnoseError(
            f"diagnose_decode cannot probe {', '.join(uncached)} yet: its loop keeps no cache of that form's latents"
        )
    reason = unsimulated_reason(cfg)
    if reason:
        raise DiagnoseError(reason)
    return cfg


def _ignores_key_value(run, probe: Probe, output: np.ndarray) -> bool:
    """True when other key and value give the very same output (a self-attention-only candidate)."""
    other = replace(probe, key=probe.key[:, ::-1] * 1.5, value=probe.value[:, ::-1] * 1.5)
    try:
        return np.array_equal(run(other), output)
    except DiagnoseError:
        return False


def _explaining_pair(fits: list[_Fit], fit_bug: Callable) -> tuple[_Fit, _Fit] | None:
    """The two of ``fits`` (different codes) whose bugs together, ``fit_bug(bug)``, fit every probe best, or None."""
    pairs = []
    for i, a in enumerate(fits):
        for b in fits[i + 1 :]:
            if a.hypothesis.code != b.hypothesis.code:
                pair = fit_bug(a.bug.combine(b.bug))
                if pair.score <= 1.0:
                    pairs.append((pair.score, a, b))
    if not pairs:
        return None
    _, a, b = min(pairs, key=lambda item: item[0])
    return a, b


def _evidence(fit: _Fit, fits: list[_Fit], oracle: _Fit, partial: bool, noun: str = "cause") -> list[str]:
    """The sentences that explain a cause (or a decode ``noun="mistake"``): the probe that shows it best, the one
    that rules out the next best fit, and whether it explains only part of the probes."""
    shows = max(oracle.per_probe, key=lambda name: oracle.per_probe[name][1])
    off, _ = oracle.per_probe[shows]
    err, ratio = fit.per_probe[shows]
    away = "NaN or inf where the oracle is finite" if math.isinf(off) else f"{off:.3g} from the oracle"
    parts = [
        f"probe {shows!r}: {away}, {err:.2g} from this {noun} ({'within' if ratio <= 1 else f'{ratio:.3g}x'} tolerance)"
    ]
    rival = next((f for f in fits if f is not fit), None)
    if rival is not None:
        apart = max(rival.per_probe, key=lambda name: rival.per_probe[name][1])
        by = rival.per_probe[apart][0]
        parts.append(
            f"next best, {rival.label}, misses probe {apart!r} by {'NaN or inf' if math.isinf(by) else f'{by:.3g}'}"
        )
    if partial:
        parts.append(f"explains no probe set fully (worst probe at {fit.score:.3g}x tolerance)")
    return parts


def _cause(cfg, fit: _Fit, fits: list[_Fit], oracle: _Fit, run, observed, partial: bool, dtype: str) -> Cause:
    hypothesis = fit.hypothesis
    parts = _evidence(fit, fits, oracle, partial)
    if hypothesis.repair is not None:
        parts.append(_verify_repair(cfg, hypothesis, run, observed, oracle, dtype))
    return Cause(hypothesis.code, hypothesis.detail, "; ".join(parts), hypothesis.fix, fit.score)


def _verify_repair(cfg, hypothesis: Hypothesis, run, observed: list[_Observed], oracle: _Fit, dtype: str) -> str:
    worst = 0.0
    for obs in observed:
        mask = obs.probe.mask
        if mask is None and hypothesis.needs_mask:  # the repair adds to the mask: start from "every key allowed"
            mask = np.ones((obs.probe.query.shape[0], 1, obs.probe.query.shape[1], obs.probe.key.shape[1]), bool)
        params, mask = hypothesis.repair(cfg, obs.probe.params, mask)
        try:
            output = run(obs.probe, params, mask)
        except DiagnoseError as error:
            return f"the repair could not be checked ({error})"
        rows = _valid_rows(cfg, obs.probe, Bug())
        err, ratio = _distance(output, oracle.predictions[obs.probe.name], rows, dtype)
        worst = max(worst, err)
        if ratio > 1.0:
            return f"fed the repair, the candidate still misses probe {obs.probe.name!r} by {err:.3g}"
    return f"fed the repair, the candidate agrees with the oracle on every probe (max abs {worst:.2g})"


def _empty_row_difference(cfg: MHAConfig, obs: _Observed, dtype: str) -> list[str]:
    """What the candidate returns for a query row with nothing to attend to, when it is not the spec's b_o."""
    p = obs.probe
    expected = simulate(cfg, p.params, p.query, p.key, p.value, p.mask)
    rows = _valid_rows(cfg, p, Bug())
    if _distance(obs.output, expected, rows, dtype)[1] > 1.0:
        return []  # the rest of the probe disagrees: nothing to name
    got = obs.output[~rows]
    if _distance(obs.output, expected, ~rows, dtype)[1] <= 1.0:
        return []
    latent = latent_form(cfg)  # MLA's w_v reads its latent, not the values
    if np.isnan(got).all():
        what = "NaN"
    elif not latent and _distance(obs.output, _uniform_output(cfg, p), ~rows, dtype)[1] <= 1.0:
        what = "the average of all values (the mask is a large negative number, not -inf)"
    else:
        what = f"other values (max abs {_distance(obs.output, expected, ~rows, dtype)[0]:.3g} from the spec's)"
    return [f"a query row with no allowed key gives {what}; the spec gives zero weights, output = b_o"]


def _uniform_output(cfg: MHAConfig, p: Probe) -> np.ndarray:
    """The output if every query attended to every key with equal weight."""
    v = p.value @ p.params.w_v.T + (0.0 if p.params.b_v is None else p.params.b_v)  # (B, Nk, Hkv*Dv)
    mean = v.mean(axis=1).reshape(v.shape[0], cfg.n_kv_heads, cfg.d_v)  # (B, Hkv, Dv)
    merged = mean[:, [cfg.kv_head_of(h) for h in range(cfg.n_heads)]].reshape(v.shape[0], 1, -1)  # (B, 1, H*Dv)
    out = merged @ p.params.w_o.T + (0.0 if p.params.b_o is None else p.params.b_o)
    return np.broadcast_to(out, (v.shape[0], p.query.shape[1], cfg.d_model))
