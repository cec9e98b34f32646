"""The score pipeline, written once: the steps between ``scale * q.k^T`` and the weights, on an ops object.

Every adapter and every path (forward, chunked, decode, sharded, the hand-written backward) runs
its scores through `score_steps` (or, for a chunked tile that feeds an online softmax,
`masked_scores`), on its library's ops object (`ops_numpy.NumpyOps`, `ops_torch.TorchOps`,
`ops_jax.JaxOps`). The ops object holds the library's own primitive for each step (in place
where the library can, its precision policy, its measured tricks); core's variant registry holds
their order, which variant turns each on and how each op is called on an ops object (each entry's
``score_step`` and its `core.variants.OpsCall`, gathered in `OP_STEPS`); this module, the pipeline
that runs them. What stays in each convention is only what differs between conventions: the layout
of the scores and of what is added to them (the bias in the scores' layout, the mask as ``blocked``,
True where a query may not attend, broadcastable against the scores), the head split, the cache.

An adapter whose point is a library's own idiom keeps that idiom instead (FlexAttention's
``score_mod``, ``jax.nn.dot_product_attention``'s ``bias``, SDPA's float mask).

The ops interface (each method takes and returns the library's arrays):

* ``softcap(scores, cap)``, ``add_score_bias(scores, bias)``, ``positional_mask(scores, blocked)``: one
  step each, possibly in place (the caller snapshots what it records);
* ``softmax(scores, empty_rows, sinks=None, out=None)``: over the key axis, rows with no allowed key
  (``empty_rows``, the mask with its key axis reduced to 1, or None) all zeros, each head's sink
  logit (broadcastable against the scores with a key axis of 1) in every denominator;
* ``full(shape, value, dtype, like=None)`` and ``broadcast(array, shape, dtype)``: new arrays (`online_start`);
* ``in_blocks(steps, scores, **parts)`` (optional): run ``steps`` on blocks of the scores (NumPy's
  cache-sized blocks); without it, on the whole;
* ``softmax_backward(weights, d_weights, sinks)`` and ``softcap_backward(d_capped, scores, cap)``:
  what a hand-written backward needs (`score_steps_backward`; NumPy's only, the others differentiate
  with autograd).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.stages import VARIANT_STAGES
from mha_rosetta.core.variants import SCORE_PLACES, VARIANT_REGISTRY, OpsCall, strategy_forms, temperature_scales

from .ops_jax import JaxOps
from .ops_mlx import MlxOps
from .ops_numpy import NumpyOps
from .ops_torch import TorchOps
from .score_parts import part_keywords, softmax_keywords, softmax_part

# library name -> its ops class, ``cls(dtype, device)`` (the classes import their library when made).
OPS_BY_LIBRARY = {"numpy": NumpyOps, "torch": TorchOps, "jax": JaxOps, "mlx": MlxOps}


@dataclass(frozen=True)
class ScoreStep(OpsCall):
    """One step of the score pipeline: the stage it makes and how, on an ops object (`core.variants.OpsCall`'s
    fields: ``stage``, ``how``, ``forward``, ``backward``, ``saves_input``), with the rule that switches it on."""

    def on(self, cfg: MHAConfig) -> bool:
        """Whether ``cfg`` has this step: a variant's stage only with its variant (`core.stages.VARIANT_STAGES`)."""
        rule = VARIANT_STAGES.get(self.stage)
        return True if rule is None else bool(rule(cfg))


def _step(call: OpsCall) -> ScoreStep:
    """``call`` as a step of the pipeline (the same fields, with `ScoreStep.on`)."""
    return call if isinstance(call, ScoreStep) else ScoreStep(**{f.name: getattr(call, f.name) for f in fields(call)})


def _entries_calls() -> dict[str, ScoreStep]:
    """op -> how each score op of core's variant registry runs on an ops object: its entries' call
    (`core.variants.ScoreStep.call`). Entries that share an op (ALiBi and T5's bias, the window and the chunks)
    share its call; two different calls of one op are refused by name."""
    calls: dict[str, ScoreStep] = {}
    for name, entry in VARIANT_REGISTRY.items():
        step = entry.score_step
        if step is None or step.call is None:
            continue
        made = _step(step.call)
        if calls.setdefault(step.op, made) != made:
            raise ValueError(f"variant {name!r} calls the score op {step.op!r} otherwise than an entry before it")
    return calls


# How each score op runs on an ops object (``ScoreStep.op`` of an entry's ``score_step`` -> the step): the entries'
# calls, then those registered from outside (`register_score_op`). The registry says which ops there are, where each
# sits in the pipeline, which variants turn it on and how it is called; an ops class, the method for it.
OP_STEPS: dict[str, ScoreStep] = _entries_calls()


SCORE_OPS_GROUP = "mha_rosetta.score_ops"


def register_score_op(op: str, step: ScoreStep, **methods: Callable) -> None:
    """A score op of a variant registered from outside (`core.variants.register_variant`): how the pipeline calls
    it (``step``, into `OP_STEPS`) and its method on each library's ops object (``numpy=``, ``torch=``, ``jax=``:
    ``method(self, ...)``, set on `OPS_BY_LIBRARY`'s classes). A library left out has no such method, so the
    adapters on it refuse the variant with the reason (`RegistryVariants`). Call it from a module named by an entry
    point of the group ``mha_rosetta.score_ops``, which this module loads before it builds `SCORE_STEPS`.
    """
    unknown = sorted(set(methods) - set(OPS_BY_LIBRARY))
    if unknown:
        raise ValueError(f"register_score_op: libraries must be among {', '.join(OPS_BY_LIBRARY)}, got {unknown}")
    if op in OP_STEPS:
        raise ValueError(f"register_score_op: the score op {op!r} is already registered")
    for library, method in methods.items():
        if hasattr(OPS_BY_LIBRARY[library], op):
            raise ValueError(f"register_score_op: {OPS_BY_LIBRARY[library].__name__} already has a method {op!r}")
        setattr(OPS_BY_LIBRARY[library], op, method)
    OP_STEPS[op] = _step(step)


def _discover_score_ops() -> None:
    """Import every module named by an entry point of the group ``mha_rosetta.score_ops`` (each registers its op)."""
    import warnings
    from importlib.metadata import entry_points

    for point in entry_points(group=SCORE_OPS_GROUP):
        try:
            point.load()
        except Exception as error:  # a broken plugin is named, not fatal; its variant is then refused
            warnings.warn(
                f"{SCORE_OPS_GROUP}: entry point {point.name!r} = {point.value!r} failed: {error}", stacklevel=2
            )


_discover_score_ops()


def _steps_in_registry_order() -> tuple[tuple[tuple[str, ...], ScoreStep], ...]:
    """(the variants that turn a step on, the step) for each score op before the softmax, in the pipeline
    order of core's registry (`SCORE_PLACES`; registry order within a place). The softmax's sinks are the
    ops object's ``softmax(..., sinks=)``."""
    by_op: dict[str, list[str]] = {}
    entries = [(name, entry.score_step) for name, entry in VARIANT_REGISTRY.items() if entry.score_step is not None]
    for name, step in sorted(entries, key=lambda item: SCORE_PLACES.index(item[1].place)):
        if step.place == "softmax":
            continue
        if step.op not in OP_STEPS:
            raise KeyError(
                f"core's variant registry names the score op {step.op!r} (variant {name!r}), which "
                f"backends/frameworks/ops.py cannot run: give the entry's score step its call (core.variants.OpsCall) "
                f"or register it (register_score_op), and add a method {step.op} to each ops class"
            )
        by_op.setdefault(step.op, []).append(name)
    return tuple((tuple(names), OP_STEPS[op]) for op, names in by_op.items())


# The score steps in the spec's order, each with the variants that it carries: the one list every path
# iterates, derived from core's registry.
SCORE_STEPS: tuple[tuple[tuple[str, ...], ScoreStep], ...] = _steps_in_registry_order()

STEP_HOW = {step.stage: step.how for _, step in SCORE_STEPS}  # stage -> the step that makes it, in words

# on_stage(name, value, parent_name, parent_value): called after each step with the live arrays (a recorder
# snapshots what it keeps: the next step may work in place).
OnStage = Callable[[str, object, str, object], None]


def masked_scores(ops, cfg: MHAConfig, scores, *, bias=None, blocked=None, on_stage: OnStage | None = None, saved=None):
    """The score steps before the softmax that ``cfg`` turns on, in order: softcap, score bias, mask.

    ``scores`` (``scale * q.k^T``, the caller's layout), ``bias`` (ALiBi plus T5's bias, broadcastable
    against them; read only with a score bias), ``blocked`` (bool, True = may not attend; None: nothing
    blocked). ``saved`` (a dict): receives the inputs the backward reads, by stage name.
    """
    parts = {"bias": bias, "blocked": blocked}
    name, last = "scores", scores
    for _, step in SCORE_STEPS:
        if not step.on(cfg):
            continue
        if saved is not None and step.saves_input:
            saved[name] = ops.snapshot(last)  # the step may work in place
        value = step.forward(ops, cfg, last, parts)
        if on_stage is not None:
            on_stage(step.stage, value, name, last)
        name, last = step.stage, value
    return last


def _joined(cfg: MHAConfig, parts: dict):
    """The score part ``cfg``'s softmax reads among ``parts`` (`score_parts.softmax_part`'s keyword: the sinks), or
    None where ``cfg`` has none; a keyword no registered parameter feeds is a TypeError that names it."""
    unknown = sorted(set(parts) - set(part_keywords()))
    if unknown:
        raise TypeError(
            f"score_steps() got the keyword(s) {unknown}, which no registered parameter feeds; its score parts are "
            f"{list(part_keywords())} (core.variants.ParamSpec.score_part)"
        )
    spec = softmax_part(cfg)
    return None if spec is None else parts.get(spec.score_part)


def score_steps(
    ops,
    cfg: MHAConfig,
    scores,
    *,
    bias=None,
    blocked=None,
    empty_rows=None,
    out=None,
    on_stage: OnStage | None = None,
    saved: dict | None = None,
    **parts,
):
    """``scores`` -> the weights: `masked_scores`, then the softmax with what joins its denominator.

    ``parts``: the score parts of the variants' parameters by keyword (`score_parts.score_parts`); the softmax
    reads the one its entry's parameter feeds (`score_parts.softmax_part`: the sinks, each head's logit,
    broadcastable against the scores with a key axis of 1), where ``cfg`` has it. A keyword no registered
    parameter feeds is a TypeError.
    ``empty_rows``: the rows with no allowed key (the mask with its key axis of length 1), or None.
    ``out``: a buffer for the weights (torch). Neither recording (``on_stage``) nor saving for the
    backward (``saved``: the steps' inputs and the ``weights``): the library may run the steps
    block by block (``ops.in_blocks``: NumPy walks L2-sized blocks).
    """
    joined = _joined(cfg, parts) if parts else None  # (no parts: read nothing, the common call costs nothing more)

    def steps(block, bias=None, blocked=None, empty_rows=None, joined=None, out=None):
        masked = masked_scores(ops, cfg, block, bias=bias, blocked=blocked, on_stage=on_stage, saved=saved)
        weights = ops.softmax(masked, empty_rows, joined, out=out)
        if on_stage is not None:
            on_stage("weights", weights, "masked_scores", masked)
        return weights

    blocks = {"bias": bias, "blocked": blocked, "empty_rows": empty_rows, "joined": joined}
    if on_stage is None and saved is None and out is None and hasattr(ops, "in_blocks"):
        return ops.in_blocks(steps, scores, **blocks)
    weights = steps(scores, **blocks, out=out)
    if saved is not None:
        saved["weights"] = weights
    return weights


def online_start(ops, parts: dict, shape, dtype, like=None) -> tuple:
    """(peak, total): where an online softmax (the chunked paths, `_chunking`) starts each query's running
    maximum and sum, ``shape`` (a key axis of 1) in ``dtype`` (on ``like``'s device).

    ``parts``: the score parts of the variants' parameters (`score_parts.score_parts`, laid out against the
    tile). With a softmax's part among them (`score_parts.softmax_keywords`: the sinks, broadcastable to ``shape``:
    each head's logit) the sink is the first term of every row, ``peak = sink`` and ``total = exp(sink - sink) = 1``,
    so the recurrence rescales it with every other term and it sits in every denominator; a query with no allowed
    key ends with a zero context. Without one: ``(-inf, 0)``.
    """
    joined = next((parts[k] for k in softmax_keywords() if parts.get(k) is not None), None)
    if joined is None:
        return ops.full(shape, float("-inf"), dtype, like), ops.full(shape, 0.0, dtype, like)
    return ops.broadcast(joined, shape, dtype), ops.full(shape, 1.0, dtype, like)


def score_steps_backward(ops, cfg: MHAConfig, d_weights, saved: dict, shape=None):
    """The backward of `score_steps`: (d_scores, d_sinks per query or None, the stages' gradients by name).

    ``saved``: what `score_steps` saved (the weights, each step's input it needs); ``shape``: the layout
    the saved arrays are viewed in to match ``d_weights`` (None: as saved). The gradients are named
    ``d_<stage>`` after the stage each is the gradient of: ``d_weights``, then walking the steps back,
    each step's input (``d_biased_scores`` ... ``d_scores``).
    """

    def view(array):
        return array if shape is None else array.reshape(shape)

    d_last, d_sinks = ops.softmax_backward(view(saved["weights"]), d_weights, softmax_part(cfg) is not None)
    grads = {"d_weights": d_weights}
    names = ["scores"] + [step.stage for _, step in SCORE_STEPS if step.on(cfg)]  # each step's input, then its stage
    on = [step for _, step in SCORE_STEPS if step.on(cfg)]
    for step, input_name in zip(reversed(on), reversed(names[:-1]), strict=True):
        if step.backward is not None:  # the step's input where it saved it (a scaling needs none)
            d_last = step.backward(ops, cfg, d_last, view(saved[input_name]) if step.saves_input else None)
        grads[f"d_{input_name}"] = d_last
    return d_last, d_sinks, grads


# -- the head transforms outside the score pipeline: Llama 4's steps after rotary, Gemma 4's value norm -------------
# Each convention calls these once per head tensor (batched heads, or one head in a loop) with the axis its
# features lie on; the arithmetic is the ops object's (``head_norm``, ``temper_queries``).
HEAD_STEP_HOW = {
    "q_rotated_normed": "weightless RMS norm of each query head's Dk features (qk_norm_after_rope)",
    "k_rotated_normed": "weightless RMS norm of each key head's Dk features (qk_norm_after_rope)",
    "q_tempered": "times 1 + attn_scale * log1p(floor((p + floor_offset) / floor_scale)), p with the cache offset",
    "v_normed": "weightless RMS norm of each kv head's Dv features (value_norm)",
}


def temperature_factors(cfg: MHAConfig, positions):
    """The temperature factors (Llama 4's or Mistral 4's, `core.variants.temperature`) of the query positions
    ``positions`` ((1|B, Nq) int64, the cache offset included on a decode step), NumPy float64 of their shape; None
    when ``cfg`` has no temperature. Each convention converts them once and lays them out against its query heads."""
    if not cfg.attn_temperature_tuning:
        return None
    return temperature_scales(positions, cfg.floor_scale, cfg.attn_scale, cfg.floor_offset)


def after_rotary(ops, cfg: MHAConfig, heads, which: str, factors=None, axis: int = -1, on_stage=None):
    """Rotated query ("q") or key ("k") heads -> what the scores read: Llama 4's weightless RMS norm over each
    head's own features (``qk_norm_after_rope``; ``axis``: where the features lie, never across heads), then for
    the queries the temperature (``attn_temperature_tuning``: ``factors`` laid out against ``heads``). The heads
    themselves when neither is on. ``on_stage(name, value, parent)`` after each step (a recorder)."""
    parent = f"{which}_rotated"
    if cfg.qk_norm_after_rope:
        heads = ops.head_norm(heads, cfg.norm_eps, axis)
        parent = f"{which}_rotated_normed"
        if on_stage is not None:
            on_stage(parent, heads, f"{which}_rotated")
    if which == "q" and cfg.attn_temperature_tuning:
        heads = ops.temper_queries(heads, factors)
        if on_stage is not None:
            on_stage("q_tempered", heads, parent)
    return heads


def read_values(ops, cfg: MHAConfig, v_heads, axis: int = -1, on_stage=None):
    """The values the weighted sum reads: Gemma 4's weightless RMS norm over each kv head's own features
    (``value_norm``; ``axis``: where they lie), else ``v_heads`` themselves. ``on_stage`` as `after_rotary`'s."""
    if not cfg.value_norm:
        return v_heads
    normed = ops.head_norm(v_heads, cfg.norm_eps, axis)
    if on_stage is not None:
        on_stage("v_normed", normed, "v_heads")
    return normed


class RegistryVariants:
    """An adapter's capability set, read from core's registry each time it is asked, never kept in a list.

    Our adapters run the score steps through their library's ops object (`score_steps`), and apply the
    variants that act outside the score pipeline (an entry without a ``score_step``: QK-norm, the qkv
    bias, rope scaling) in their projections and rotary. So an adapter implements every registered
    variant whose score op its ops class has a method for and the pipeline carries (`SCORE_STEPS`), and
    every variant without a score step its entry does not limit to other libraries (`Variant.implemented_by`).
    A form that runs only in strategies of its own (`Variant.strategies`: MLA's naive and absorbed) is declared
    only by an adapter that has them all (`core.variants.strategy_forms`, read from the adapter's ``strategies``).
    One whose op a library's ops class lacks, or that the pipeline does not carry (registered after
    `SCORE_STEPS` was built), is left out, and the adapter refuses it with the reason
    (`Backend.variant_reason`). ``libraries``: the ops classes that must all have the op (einops runs on all three).
    Used as a class attribute: ``variants = RegistryVariants("numpy")``; reads as a frozenset.
    """

    def __init__(self, *libraries: str) -> None:
        unknown = [name for name in libraries if name not in OPS_BY_LIBRARY]
        if not libraries or unknown:
            raise ValueError(f"libraries must be among {', '.join(OPS_BY_LIBRARY)}, got {libraries!r}")
        self.libraries = libraries

    def __get__(self, obj, owner=None) -> frozenset[str]:
        classes = [OPS_BY_LIBRARY[name] for name in self.libraries]
        # the forms of strategies it has (an owner without strategies has none of them)
        forms = strategy_forms(getattr(owner if obj is None else obj, "strategies", ()))
        # A score step before the softmax runs only if the pipeline carries it (`SCORE_STEPS`, built from the
        # registry at import): a variant the pipeline would skip is never declared, so it is refused, not run without.
        carried = {name for names, _ in SCORE_STEPS for name in names}
        return frozenset(
            name
            for name, entry in VARIANT_REGISTRY.items()
            if (entry.strategies is None or name in forms)
            and (
                (entry.implemented_by is None or set(self.libraries) <= set(entry.implemented_by))
                if entry.score_step is None
                else (
                    all(hasattr(cls, entry.score_step.op) for cls in classes)
                    and (entry.score_step.place == "softmax" or name in carried)
                )
            )
        )
