"""`diagnose_decode(candidate, cfg)`: does a KV-cache decode loop agree with the full causal forward, and if not, why.

The candidate is a whole decode loop, the form a user wraps most easily (their own prefill and
step calls inside one function)::

    def candidate(params, x, prefill, step, mask, positions):
        # params: core.MHAParams (canonical, NumPy); x: (B, N, d_model); mask: (B, N) bool padding mask
        # (True = a real token) or None; positions: (B, N) int64, every token's position (always given)
        cache = MyCache(...)
        out = [my_forward(params, x[:, :prefill], positions[:, :prefill], cache)]  # fills the cache
        for start in range(prefill, x.shape[1], step):
            out.append(my_forward(params, x[:, start:start + step], positions[:, start:start + step], cache))
        return np.concatenate(out, axis=1)  # (B, N, d_model): every token's output

(a backend's decode path is ``lambda params, x, prefill, step, mask, positions: backend.run_decode(cfg, params,
x, prefill=prefill, step=step, mask=mask, positions=positions)``). Why a function of its own and not a
``decode=True`` path of `diagnose`: the candidate's signature, the probes (one sequence split into
chunks, not query/key/value) and the hypotheses (how a cache is kept) are all different; what is shared
is reused: the bounded calling (`calling`), the tolerance scoring and the `Diagnosis` it returns.

Method, as `diagnose`'s: the candidate runs on designed decode probes (`make_decode_probes`); every
decode mistake of `decode_hypotheses` is simulated on the same probes by `simulate_decode`, a NumPy
decode loop with one switch per mistake (`DecodeBug`; no switch on, it equals `core.decode.reference_decode`);
each hypothesis is scored by the candidate's worst distance from it in tolerances of the candidate's dtype.
Only the real tokens' rows are compared (a pad's output is a convention, not an answer).

The mistakes (`DECODE_CAUSE_CODES`), and how the simulation makes each one:

- ``decode_positions_not_offset``: the rotary positions restart at 0 on each call (``arange(s)`` for a chunk
  of s tokens) instead of the tokens' positions; the masks still read the right positions.
- ``decode_top_left_causal``: a multi-query step masked with top-left causality on the cache's slots
  (``is_causal=True`` over s queries and T > s keys: query i sees slots 0..i) instead of bottom-right. A
  single-query step is unaffected where the code passes ``is_causal`` only when the step has more than one
  query (Hugging Face's ``is_causal = query.shape[2] > 1``): its probe needs step >= 2. The detail "every
  step" is the code that passes it on a single query too, which then sees only the oldest slot (flax #5591).
- ``decode_empty_slots_attended``: a static cache (preallocated with zeros, N slots, or the ring's with a
  window) whose unwritten slots are attended: each adds a score of 0 with a zero value (transformers #30400).
- ``decode_ring_off_by_one``: the ring buffer keeps one slot too many or too few, so a decode step sees the
  last W + 1 or W - 1 keys (transformers #29623, #37574); the prefill, a plain forward, is right.
- ``decode_rotated_twice``: keys cached after rotary and rotated again by their positions on every read.
- the variants' decode mistakes, their registry entries' causes with ``decode`` (`DiagnoseCause`), made in their
  steps (`DecodeBug.mistakes`): ``decode_temperature_not_offset``, Llama 4's temperature factors computed from
  ``arange(s)`` on each call instead of the tokens' positions (the cache offset left out); MLA's (its latent
  cache, `core.variants.mla_diagnose`): ``decode_latent_not_normed``, the cache holding the latent before
  ``kv_a_layernorm``, and ``decode_k_rope_not_rotated``, the shared rotary key cached before rotary, each
  expanded and scored as cached.

The simulated loop writes each chunk's keys into the cache, then reads the cache (the prefill too), as
Hugging Face's ``cache.update`` does: so a mistake of the read path shows on the prefill as well. Under MLA
the cache holds each token's normalised latent and rotated shared key (`core.mla_forms.LatentCache`), and a
read expands every head's keys and values from it (the naive form: the absorbed form reads the same cache
and computes the same numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, check_dtype_name, init_params, lower_precision, numpy_dtype
from mha_rosetta.core.decode import prepare_decode_inputs, ring_capacity
from mha_rosetta.core.variants import variants_on

from .calling import DiagnoseError, _as_output, _call
from .causes import DECODE_CAUSE_CODES, diagnosed_variants, unseen_variants
from .decode_simulation import DecodeBug, simulate_decode
from .diagnosis import _evidence, _explaining_pair, _Fit

__all__ = [
    "DECODE_CAUSE_CODES",
    "DecodeBug",
    "DecodeHypothesis",
    "DecodeProbe",
    "decode_hypotheses",
    "diagnose_decode",
    "make_decode_probes",
    "simulate_decode",
]


# -- the hypotheses -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeHypothesis:
    code: str  # one of DECODE_CAUSE_CODES
    detail: str
    bug: DecodeBug
    fix: str

    @property
    def label(self) -> str:
        return f"{self.code} ({self.detail})"


def decode_hypotheses(cfg: MHAConfig) -> list[DecodeHypothesis]:
    """Every decode mistake that can change an output for ``cfg`` (no rotary: nothing about rotary; no window: no ring)."""
    bottom_right = (
        "a step's queries sit at the last positions of the cache, so causality is bottom-right (key j visible iff "
        "p_j <= p_i): pass an explicit mask (torch.nn.attention.bias.causal_lower_right, or the positions' rule), "
        "not is_causal=True, whose mask is top-left (query i sees slots 0..i)"
    )
    W = cfg.window
    every = [
        DecodeHypothesis(
            "decode_positions_not_offset",
            "rotary positions restart at 0 on each call",
            DecodeBug(positions_not_offset=True),
            "rotate each new token at its own position (cache_position = past length + arange(step), or the "
            "positions passed in), not at arange(step): the cache's keys sit at positions 0..T-1",
        ),
        DecodeHypothesis(
            "decode_top_left_causal",
            "is_causal=True (top-left) on steps of more than one query",
            DecodeBug(top_left_causal="multi"),
            bottom_right + "; a single-query step is unaffected, as it passes is_causal=False",
        ),
        DecodeHypothesis(
            "decode_top_left_causal",
            "top-left causality on every step: a single query sees only the oldest slot",
            DecodeBug(top_left_causal="every"),
            bottom_right + " (flax #5591)",
        ),
        DecodeHypothesis(
            "decode_empty_slots_attended",
            "a static cache's unwritten slots attended (score 0, value 0)",
            DecodeBug(empty_slots_attended=True),
            "mask every slot at or past the write index (the cache's valid length): with SDPA pass the mask, do not "
            "drop it for is_causal on a preallocated cache (transformers #30400)",
        ),
        *(
            DecodeHypothesis(
                "decode_ring_off_by_one",
                f"the ring keeps {'one slot more' if off > 0 else 'one slot less'}: a step sees the last "
                f"{W + off} keys where the window holds {W}",
                DecodeBug(ring_off_by=off),
                f"a window of W = {W} keys (the query's own included) needs a ring of W - 1 + step slots "
                f"(core.decode.ring_capacity: {W} for one token per step) and the window rule p_i - {W} < p_j "
                "on the slots' positions (transformers #29623, #37574)",
            )
            for off in (1, -1)
            if W is not None and W + off >= 1
        ),
        DecodeHypothesis(
            "decode_rotated_twice",
            "keys cached after rotary and rotated again on read",
            DecodeBug(rotated_twice=True),
            "rotate keys once: either cache them rotated (Hugging Face's place, the contract's) and read them "
            "as they are, or cache them unrotated and rotate on read, never both",
        ),
    ]
    every += _variant_decode_hypotheses(cfg)
    return [h for h in every if cfg.rope is not None or not h.bug.rotary]


def _variant_decode_hypotheses(cfg: MHAConfig) -> list[DecodeHypothesis]:
    """The variants' decode mistakes (their entries' `DiagnoseCause`s with ``decode``), those ``cfg`` has."""
    found = []
    for entry in diagnosed_variants(variants_on(cfg)):
        for cause in entry.diagnose_causes:
            if cause.decode and cause.applies(cfg):
                detail, fix = cause.words(cfg)
                found.append(
                    DecodeHypothesis(cause.code, detail, DecodeBug(mistakes=((entry.name, cause.mistake),)), fix)
                )
    return found


# -- the probes ---------------------------------------------------------------------------------
BATCH = 2
BASE_TOKENS = 9


@dataclass(frozen=True)
class DecodeProbe:
    name: str
    params: MHAParams
    x: np.ndarray  # (B, N, d_model) float64
    prefill: int
    step: int
    mask: np.ndarray | None  # (B, N) bool padding mask, or None
    positions: np.ndarray  # (B, N) int64

    @property
    def rows(self) -> np.ndarray:
        """(B, N): the rows compared (the real tokens; a pad's output is a convention)."""
        return np.ones(self.x.shape[:2], dtype=bool) if self.mask is None else self.mask


def probe_tokens(cfg: MHAConfig) -> int:
    """The probes' sequence length: 9, or long enough that the sequence outgrows a window's ring twice."""
    return BASE_TOKENS if cfg.window is None else max(BASE_TOKENS, 2 * (cfg.window + 2) + 3)


def make_decode_probes(cfg: MHAConfig, seed: int = 0, *, prefill=None, step=None) -> list[DecodeProbe]:
    """The decode probes: every split the mistakes need, or the one ``prefill`` / ``step`` the candidate takes.

    Default splits (N tokens): one token per step from prefill 1 (every position offset, every empty slot, the
    ring filled and outgrown); two tokens per step from prefill 3 (top-left causality shows); prefill N (no
    step: the forward through the loop); a left-padded batch (item 0's first two tokens are pads, at position
    -1); with a window, a prefill longer than the ring. A given ``prefill`` or ``step`` replaces that part of
    every split (splits that become the same are run once).
    """
    N = probe_tokens(cfg)
    rng = np.random.default_rng(seed)
    params = init_params(cfg, seed=seed + 1)
    splits = [("one token per step", 1, 1, False), ("two tokens per step", 3, 2, False)]
    splits += [("prefill only", N, 1, False), ("left-padded batch", 3, 2, True)]
    ring = ring_capacity(cfg, 1 if step is None else step)
    if ring is not None and ring + 2 < N:
        splits.append(("prefill past the ring", ring + 2, 1, False))
    probes, seen = [], set()
    for label, p, s, padded in splits:
        p = p if prefill is None else min(prefill, N)
        s = s if step is None else step
        if (p, s, padded) in seen:
            continue
        seen.add((p, s, padded))
        mask = None
        if padded:
            mask = np.ones((BATCH, N), dtype=bool)
            mask[0, :2] = False  # item 0 left-padded by two
        inputs = prepare_decode_inputs(cfg, np.zeros((BATCH, N, cfg.d_model)), prefill=p, step=s, mask=mask)
        x = rng.standard_normal((BATCH, N, cfg.d_model))
        # Given a prefill or a step, the labels would not hold: name the split itself.
        name = label if (prefill, step) == (None, None) else f"prefill {p}, step {s}" + (", left-padded" * padded)
        probes.append(DecodeProbe(name, params, x, p, s, mask, inputs.positions))
    return probes


# -- the diagnosis ------------------------------------------------------------------------------
class _DecodeFit(_Fit):
    """`diagnosis._Fit` (the hypothesis, its bug, per-probe distances, predictions) for a decode mistake."""

    @property
    def label(self) -> str:
        return "no mistake" if self.hypothesis is None else self.hypothesis.label


def _fit(cfg, observed, bug: DecodeBug, hypothesis, dtype: str) -> _DecodeFit:
    from .diagnosis import _distance

    per_probe, predictions = {}, {}
    for probe, output in observed:
        predicted = simulate_decode(
            cfg, probe.params, probe.x, prefill=probe.prefill, step=probe.step, mask=probe.mask,
            positions=probe.positions, bug=bug,
        )  # fmt: skip
        predictions[probe.name] = predicted
        per_probe[probe.name] = _distance(output, predicted, probe.rows, dtype)
    return _DecodeFit(hypothesis, bug, per_probe, predictions)


def _same(a: _DecodeFit, b: _DecodeFit, observed, dtype: str) -> bool:
    from .diagnosis import _distance

    return all(_distance(a.predictions[p.name], b.predictions[p.name], p.rows, dtype)[1] <= 1.0 for p, _ in observed)


def diagnose_decode(
    candidate,
    cfg: MHAConfig | None = None,
    *,
    like=None,
    prefill: int | None = None,
    step: int | None = None,
    dtype: str = "float64",
    timeout: float | None = None,
    seed: int = 0,
    announce: Callable[[str, str], None] | None = None,
):
    """Probe the decode loop ``candidate(params, x, prefill, step, mask, positions) -> (B, N, d_model)``.

    The arguments are the module docstring's (NumPy arrays of ``dtype``; positions (B, N) int64 always given).
    ``cfg`` must be causal (a decode loop is). ``prefill`` / ``step``: the one prefill length or tokens per step
    the candidate supports, where it does not take any (a prefill longer than the probes' tokens takes them all;
    default: the probes choose; a loop that takes one token
    per step only is ``step=1``, and then top-left causality on multi-query steps cannot be seen: a note says
    so). ``like``, ``timeout``, ``announce`` as in `diagnose`. Returns a `Diagnosis`; raises `DiagnoseError`
    when the candidate cannot be diagnosed (raised, timed out, wrong shape or dtype, NaN everywhere).
    """
    from .diagnosis import DEFAULT_TIMEOUT_S, Cause, Diagnosis, reference_config

    if not callable(candidate):
        raise TypeError(
            "candidate must be callable as candidate(params, x, prefill, step, mask, positions) -> output "
            f"(B, N, d_model); got {type(candidate).__name__} {candidate!r:.80}"
        )
    cfg = reference_config(cfg, like, decode=True)
    if not cfg.causal:
        raise ValueError("diagnose_decode needs a causal configuration (a decode loop is causal), got causal=False")
    dtype = check_dtype_name(dtype)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    for name, value in (("prefill", prefill), ("step", step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int (or None: the probes choose), got {value!r}")
    np_dtype = numpy_dtype(dtype)
    out_dtypes = {dtype}
    observed = []
    for probe in make_decode_probes(cfg, seed, prefill=prefill, step=step):
        args = (probe.params.astype(np_dtype), probe.x.astype(np_dtype), probe.prefill, probe.step)
        args += (None if probe.mask is None else probe.mask.copy(), probe.positions.copy())
        result = _call(candidate, args, timeout, probe.name, announce)
        output, out_dtype = _as_output(result, (*probe.x.shape[:2], cfg.d_model), probe.name)
        if not observed and not np.isfinite(output).any():
            raise DiagnoseError(f"the candidate returned NaN or inf everywhere on probe {probe.name!r}")
        out_dtypes.add(out_dtype)
        observed.append((probe, output))
    tol_dtype = lower_precision(*out_dtypes)
    notes = unseen_variants(cfg, max(probe.x.shape[1] for probe, _ in observed))
    if all(probe.step == 1 for probe, _ in observed):
        notes.append(
            "every probe steps one token at a time: top-left causality on steps of more than one query cannot be "
            "seen (a single-query step is unaffected by it); give step >= 2 to test it"
        )

    oracle = _fit(cfg, observed, DecodeBug(), None, tol_dtype)
    errors = {name: err for name, (err, _) in oracle.per_probe.items()}
    max_error = max(errors.values())
    if oracle.score <= 1.0:
        return Diagnosis(True, max_error, [], [], notes, errors, tol_dtype)

    fits: list[_DecodeFit] = []
    for hypothesis in decode_hypotheses(cfg):
        fit = _fit(cfg, observed, hypothesis.bug, hypothesis, tol_dtype)
        if _same(fit, oracle, observed, tol_dtype):
            notes.append(f"{hypothesis.label} changes no probe's output here: not considered")
            continue
        if any(_same(fit, kept, observed, tol_dtype) for kept in fits):
            continue  # the same outputs as one already listed (the first in order is kept)
        fits.append(fit)
    fits.sort(key=lambda f: f.score)
    explained = [f for f in fits if f.score <= 1.0]
    partial = False
    if not explained:
        pair = _explaining_pair(fits, lambda bug: _fit(cfg, observed, bug, None, tol_dtype))
        if pair:
            explained = list(pair)
            notes.append(f"no single mistake explains every probe; {pair[0].label} and {pair[1].label} together do")
        else:
            explained, partial = fits[:3], True
            notes.append("no decode mistake (nor any pair) explains every probe; the best partial fits follow")
            forward = [(p, o) for p, o in observed if p.prefill == p.x.shape[1]]
            if forward and oracle.per_probe[forward[0][0].name][1] > 1.0:
                name = forward[0][0].name
                notes.append(
                    f"the candidate already disagrees on probe {name!r}, which has no decode step (max abs "
                    f"{oracle.per_probe[name][0]:.3g}): the error may be in its forward itself; diagnose that with "
                    "mha_rosetta.diagnose.diagnose (its candidate: params, query, key, value, mask -> output)"
                )
    causes = []
    for fit in explained:
        h = fit.hypothesis
        evidence = "; ".join(_evidence(fit, fits, oracle, partial, "mistake"))
        causes.append(Cause(h.code, h.detail, evidence, h.fix, fit.score))
    return Diagnosis(False, max_error, causes, [], notes, errors, tol_dtype)
