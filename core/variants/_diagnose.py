"""What ``mha-rosetta diagnose`` knows of a variant: the types of `Variant.diagnose` (`DiagnoseSpec`).

A variant's entry holds, in one place, the mistakes people make in it as diagnose names them
(`DiagnoseCause`: the cause code, the detail and the fix in words, the repair), the bugs diagnose's
candidates plant in it (`PlantedMistake`), its steps in diagnose's two NumPy pipelines, right or
with one of those mistakes (`SimulatedSteps`: the simulator's; `PlantedSteps`: the candidate's,
written apart so that diagnosing the candidate tests the simulator), the layers the confusion
table plants them in, and what diagnose's causes of the 2017-23 layer need to know of it.
`mha_rosetta.diagnose` iterates the registry for all of it: a new entry with causes, mistakes and
steps appears in ``diagnose --confusion`` with no edit there.

Plain data and NumPy, as the rest of the package (`_entry`'s docstring says why nothing here imports `core.config`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# An `MHAConfig`, as `_entry.Config` (which imports this module).
Config = Any
# Diagnose's texts name its functions by their public path; a repair is a function of the entry's module.
REPAIRS = "mha_rosetta.diagnose.repairs"
# The layer the confusion table's settings of Gemma 2 and gpt-oss build on: GQA, causal, rotary; d_k = 6.
GQA_ROTARY = dict(d_model=24, n_heads=4, n_kv_heads=2, causal=True, rope="half")


def _text(text: str | Callable[[Config], str], cfg: Config) -> str:
    return text(cfg) if callable(text) else text


@dataclass(frozen=True)
class DiagnoseCause:
    """A mistake people make in a variant, as ``mha-rosetta diagnose`` names it: one hypothesis of `diagnose.causes`.

    code:    its cause code (the variant's part of `diagnose.CAUSE_CODES`; the variants' causes are hypotheses
             only when the configuration has the variant).
    mistake: what the variant's simulated steps (`DiagnoseSpec.simulated`) read to make the mistake.
    detail, fix: which mistake, and the fix in words with the function to call: a string, or ``text(cfg)``.
    when:    ``when(cfg)``: whether the mistake can happen in ``cfg`` (which has the variant); None: always.
    repair:  ``repair(cfg, params, mask) -> (params, mask)``, what a candidate with the mistake must be fed to
             compute the spec's answer (`diagnose` runs the candidate again with it), or None where only the code
             can change.
    needs_mask: the repair adds to the mask (`diagnose` gives it an all-True one where the probe has none).
    decode:  a mistake of a decode loop (a hypothesis of `diagnose_decode`, its code one of `DECODE_CAUSE_CODES`),
             not of the forward: the mistake only a cache offset shows (the temperature's positions).
    """

    code: str
    mistake: str
    detail: str | Callable[[Config], str]
    fix: str | Callable[[Config], str]
    when: Callable[[Config], bool] | None = None
    repair: Callable | None = None
    needs_mask: bool = False
    decode: bool = False

    def applies(self, cfg: Config) -> bool:
        return self.when is None or self.when(cfg)

    def words(self, cfg: Config) -> tuple[str, str]:
        """(detail, fix) for ``cfg``."""
        return _text(self.detail, cfg), _text(self.fix, cfg)


@dataclass(frozen=True)
class PlantedMistake:
    """A bug `diagnose`'s candidates plant in a variant (`diagnose.injected.BUGS`; a column of ``diagnose --confusion``).

    name:    the bug's name; code: the cause code it must be diagnosed as; what: what the candidate's code does wrong.
    mistake: what the candidates' steps of the variant (`DiagnoseSpec.planted`) read to plant it.
    runs:    ``runs(cfg, q_tokens)``: whether it runs and changes the output in ``cfg`` (which has the variant),
             with probes of ``q_tokens`` queries; None: always.
    """

    name: str
    code: str
    what: str
    mistake: str
    runs: Callable[[Config, int], bool] | None = None

    def applies(self, cfg: Config, q_tokens: int) -> bool:
        return self.runs is None or self.runs(cfg, q_tokens)


@dataclass(frozen=True)
class _Steps:
    """The places of the pipeline where both diagnose's simulator (`SimulatedSteps`) and its planted candidates
    (`PlantedSteps`) run a variant's step, one field each; each subclass documents its steps' arguments and adds the
    places of its own. A step left None: the variant does nothing there (`steps_at` passes it over)."""

    projection: Callable | None = None
    heads: Callable | None = None
    rotated: Callable | None = None
    values: Callable | None = None
    frequencies: Callable | None = None
    scale: Callable | None = None
    transform: Callable | None = None
    bias: Callable | None = None
    masked: Callable | None = None
    output: Callable | None = None

    @property
    def empty(self) -> bool:
        """Whether no place has a step."""
        return all(getattr(self, name) is None for name in self.__dataclass_fields__)


@dataclass(frozen=True)
class SimulatedSteps(_Steps):
    """A variant's steps in `diagnose`'s simulator (`diagnose.simulate`, and the decode loop's `simulate_decode`).

    Each takes the mistake last: None (the spec) or a `DiagnoseCause.mistake`. The simulator runs the steps of the
    variants a configuration has, in registry order, at these places (a step left None: the variant does nothing
    there); ``p`` is `MHAParams`, float64:

    projection(cfg, p, q, k, mistake) -> (q, k): (B, Nq, H*Dk) and (B, Nk, Hkv*Dk), before the head split.
    heads(cfg, p, q_h, k_h, mistake) -> (q_h, k_h): (B, H, Nq, Dk) and (B, Hkv, Nk, Dk), after it.
    rotated(cfg, p, q_h, k_h, positions, mistake) -> (q_h, k_h) after rotary (Llama 4's QK-norm after rotary, its
        temperature): ``positions`` (1|B, Nq) the queries' (a decode step's include the cache offset).
    values(cfg, p, v_h, k_raw, k_rotated, mistake) -> the values (B, Hkv, Nk, Dv) the weighted sum reads (and a
        cache holds): ``v_h`` the split values, ``k_raw`` the split keys before any norm or rotation, ``k_rotated``
        after both (Gemma 4's value norm and k_eq_v).
    frequencies(cfg, seq_len, mistake) -> (inv_freq (r/2,), the factor on cos and sin) of the rotary embedding.
    scale(cfg, mistake) -> the softmax scale the candidate multiplies the scores by (MLA's YaRN mscale).
    transform(cfg, scores, mistake) -> the scaled (B, H, Nq, Nk) scores transformed elementwise.
    bias(cfg, p, positions, kv_positions, mistake) -> what it adds to the scores, (1|B, H, Nq, Nk) (positions
        (1|B, Nq) and (1|B, Nk)).
    allowed(cfg, positions, kv_positions, mistake) -> bool (1|B, 1, Nq, Nk): the keys it lets through.
    masked(cfg, masked, mistake) -> the scores after the mask.
    softmax(cfg, p, masked, mistake) -> the weights (B, H, Nq, Nk) (one variant's at the most).
    context(cfg, weights, values, mistake) -> what it adds to the context (B, H, Nq, Dv), or 0.
    params(cfg, p, mistake) -> the parameters by name (a dict) as the candidate reads them (the gate's halves).
    output(cfg, p, query, merged, mistake) -> what w_o reads: the merged context (B, Nq, H*Dv), gated.
    cached(cfg, p, entries, raw, mistake) -> what a latent cache holds (the decode loop's, MLA's): ``entries``
        (kv_latent (B, N, R), k_rope (B, N, dr)) as the spec caches them, ``raw`` (c, k_pe) the same before the
        latent's norm and the key's rotary.
    """

    allowed: Callable | None = None
    softmax: Callable | None = None
    context: Callable | None = None
    params: Callable | None = None
    cached: Callable | None = None


@dataclass(frozen=True)
class PlantedSteps(_Steps):
    """A variant's steps in a candidate with planted bugs (`diagnose.injected`), written apart from the simulator's.

    The NumPy candidate's are the entry's (`DiagnoseSpec.planted`); the torch candidate's are the same steps over
    torch's idioms where the entry writes them once (`DiagnoseSpec.planted_in`), else `backends.injected_torch`'s,
    in torch idioms. Each takes the mistake last: None (the variant done right) or a
    `PlantedMistake.mistake`; ``params`` is the canonical `MHAParams` (NumPy) the candidate was given:

    latent(cfg, params, query, key, rotate, mistake) -> (q, k, v) heads, (B, H, N, d), for a form that builds its
        heads from latents (MLA), in place of the projections, the split and rotary: ``rotate(x)`` turns
        (B, n, N, r) at positions 0..N-1 as the candidate does (the identity where it forgets rotary).
    projection(cfg, params, q, k, mistake) -> (q, k) before the head split; heads(...) the same after it;
        rotated(...) the same after rotary (the queries at positions 0..Nq-1).
    scale(cfg, mistake) -> the softmax scale the candidate multiplies the scores by.
    values(cfg, params, v, k_raw, k_rotated, mistake) -> the values the weighted sum reads (`SimulatedSteps.values`).
    frequencies(cfg, seq_len, mistake) -> (inv_freq, factor on cos and sin), NumPy, or None (the plain ones).
    transform(cfg, scores, mistake) -> the scaled scores transformed elementwise.
    bias(cfg, params, q_tokens, kv_tokens, mistake) -> what it adds to the (B, H, Nq, Nk) scores (at positions
        0..N-1), or None.
    mask(cfg, q_tokens, kv_tokens, mistake) -> (Nq, Nk) bool in the candidate's polarity (NumPy: True = allowed;
        torch: True = blocked), or None.
    masked(cfg, scores, mistake) -> the scores after the mask.
    columns(cfg, params, scores, v, mistake) -> (scores, v, drop): the columns it adds to the softmax's scores
        (and rows to the values), and whether the candidate drops them after the softmax.
    output(cfg, params, query, merged, mistake) -> what w_o reads (the gate; the torch candidate's take tensors).
    """

    latent: Callable | None = None
    mask: Callable | None = None
    columns: Callable | None = None


@dataclass(frozen=True)
class PlantedIdioms:
    """The array operations that a variant's candidate steps written once (`DiagnoseSpec.planted_in`) call, in one
    candidate's library: NumPy's (`core.variants._shared.NUMPY_IDIOMS`) for the NumPy candidate, torch's
    (`backends.injected_torch`) for the torch one. A step whose arithmetic is the same in both libraries is written
    once over these; one whose idiom differs (BLOOM's slopes in torch, FlashAttention's window) is written per
    candidate.

    tanh(x); rms_norm(x, w, eps) with ``w`` a NumPy weight (Hugging Face's ``torch.rsqrt`` form in torch);
    asarray(a): a NumPy parameter as the library's array; concat(arrays, axis); broadcast_to(x, shape).
    """

    tanh: Callable
    rms_norm: Callable
    asarray: Callable
    concat: Callable
    broadcast_to: Callable


@dataclass(frozen=True)
class DiagnoseSpec:
    """What `diagnose` knows of a variant (`Variant.diagnose`).

    rank:      its place in diagnose's vocabulary and tables (the order of `diagnose.CAUSE_CODES`, of the planted
               bugs and of the confusion table's settings, which it has always had); equal ranks keep registry order.
    causes:    its `DiagnoseCause`s (`Variant.diagnose_causes`); mistakes: its `PlantedMistake`s
               (`Variant.planted_mistakes`).
    settings:  (name, `MHAConfig` keyword arguments): the layers ``diagnose --confusion`` plants mistakes in, each
               a combination a model uses.
    simulated: its `SimulatedSteps`; planted: the NumPy candidate's `PlantedSteps`.
    planted_in: ``planted_in(idioms)`` -> its candidate steps in the library of ``idioms`` (`PlantedIdioms`), where
               they are written once for every candidate (``planted`` is then ``planted_in`` of NumPy's idioms:
               `_shared.written_once`); None where each candidate spells its own (torch's: `backends.injected_torch`).
    normalises_qk: it normalises q and k after the projections (QK-norm): the scores are linear in the norm's
               weight, not in w_q (the scale cause's repair rescales q_norm), and the rotary converters permute
               its weights too (the rope_convention cause's fix says so).
    regroup_heads: ``regroup_heads(cfg, params, order)`` -> its parameters of the query heads reordered by
               ``order`` (a dict for `dataclasses.replace`; `diagnose.repairs.regroup_query_heads`), or None.
    head_slots: its per-head values belong to the head slot, not to a parameter (ALiBi's slopes): no reordering of
               the parameters moves them, so the gqa_grouping cause has no repair.
    weightless_qk_norm: it normalises q and k with no weight after the projections (Llama 4's QK-norm after rotary):
               nothing fed to the candidate rescales its scores, so the scale cause has no repair.
    unseen:    ``unseen(cfg, q_tokens) -> str | None``: why probes of ``q_tokens`` queries cannot show its mistakes
               in ``cfg`` (a note of the diagnosis: "agrees" then says nothing of the variant), or None.
    """

    rank: int
    causes: tuple[DiagnoseCause, ...] = ()
    mistakes: tuple[PlantedMistake, ...] = ()
    settings: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    simulated: SimulatedSteps = SimulatedSteps()
    planted: PlantedSteps = PlantedSteps()
    planted_in: Callable[[PlantedIdioms], PlantedSteps] | None = None
    normalises_qk: bool = False
    regroup_heads: Callable | None = None
    head_slots: bool = False
    weightless_qk_norm: bool = False
    unseen: Callable | None = None

    def __post_init__(self) -> None:
        if self.planted_in is not None and self.planted == PlantedSteps():
            raise ValueError(
                "DiagnoseSpec: planted_in is set but planted is empty, so the NumPy candidate would skip the "
                "variant's steps; the rule: steps written once give both, **written_once(planted_in) "
                "(core.variants._shared)"
            )


def steps_at(entries: Iterable, place: str, mistakes: Mapping[str, str], steps_of: Callable) -> Iterator:
    """(step, mistake) of each of ``entries`` (`Variant`s, in order) that acts at ``place``, a field of its steps.

    ``steps_of(entry)``: its `SimulatedSteps` or `PlantedSteps` (or None); ``mistakes``: variant -> the mistake
    made in it (absent: done right). Diagnose's simulator and both planted candidates run their variants so.
    """
    for entry in entries:
        steps = steps_of(entry)
        step = None if steps is None else getattr(steps, place)
        if step is not None:
            yield step, mistakes.get(entry.name)


def planted_heads(cfg: Config, params, query, key, steps: Callable, rotate: Callable, project: Callable) -> tuple:
    """(q, k, v), each (B, n, N, d): the heads of a planted candidate (both of diagnose's, NumPy and torch) as the
    scores and the weighted sum read them, before the GQA repeat.

    A form that builds its heads from latents (its ``latent`` step, MLA) builds them in place of the candidate's own
    ``project(turn) -> (q, k, v, k_raw)`` (projections, head split, QK-norms, rotary by ``turn``; ``k_raw`` the keys
    before any norm or rotation); then the variants' ``values`` and ``rotated`` steps. ``steps(place)``: the
    candidate's (step, mistake) at ``place``; ``rotate(x, scaled)``: its rotary of (B, n, N, d) with the rope
    scaling's (inv_freq, factor), or None for the plain frequencies.
    """
    scaled = next((step(cfg, max(query.shape[1], key.shape[1]), m) for step, m in steps("frequencies")), None)

    def turn(x):  # (B, n, N, d): its first rope_dims features rotated as this candidate rotates
        return rotate(x, scaled)

    latent = next(steps("latent"), None)
    if latent is None:
        q, k, v, k_raw = project(turn)
    else:
        step, mistake = latent
        q, k, v = step(cfg, params, query, key, turn, mistake)  # (B, H, N, d) each
        k_raw = k
    for step, mistake in steps("values"):  # k_eq_v, the value norm (Gemma 4)
        v = step(cfg, params, v, k_raw, k, mistake)
    for step, mistake in steps("rotated"):  # Llama 4's QK-norm after rotary, its temperature
        q, k = step(cfg, params, q, k, mistake)
    return q, k, v
