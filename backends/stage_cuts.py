"""A path's own stage-truncated programs (`Prepared.stage_cuts`): how a best path says where its time goes.

The convention adapters record their stages as they go, and ``bench --breakdown`` cuts them through their
recorder (`stage_programs`). The best paths cannot be cut that way without slowing them: numpy-best's
forward fills its score stages one (item, head) at a time, torch-best's scores live inside SDPA's kernel,
jax-best's decode step is one donated program. So each of them takes ``until``, the name of a breakdown
stage (`STAGE_GROUPS`' names and `CACHE_WRITE`), and stops at the end of that stage:

* NumPy and torch: the path calls ``reached(until, stage, *tensors)`` after each stage; it raises
  `StageReached` (carrying the tensors) only when ``until`` names that stage. The timed call passes
  ``until=None``: a Python call and a string comparison per stage, under a microsecond a call.
* JAX: the path's stage function returns every stage by name (the caches too); each cut is that function
  returning only its stage's tensors, jitted apart (`jax_cuts`), and XLA drops the dead rest. A cut that
  includes the cache write returns the caches and donates them as the timed step does.

`CACHE_WRITE` is a decode step's own stage (between the rotary and the scores): writing the new keys and
values into the cache in place. A fused kernel's stages are one row (`FUSED_ATTENTION`). Standard library
only; JAX is imported inside `jax_cuts`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

CACHE_WRITE = "cache write"
CACHE_NAMES = ("k_cache", "v_cache")  # what the cache write stage ends with (the caches after the write)
FUSED_ATTENTION = "scores, softmax, context (one fused kernel)"


class StageReached(Exception):  # a control-flow signal, raised only in a cut run
    def __init__(self, values: tuple) -> None:
        super().__init__("the path reached the stage it was cut after")
        self.values = values


def reached(until: str | None, stage: str, *values) -> None:
    """Raise `StageReached` with ``values`` when ``until`` names ``stage``; nothing otherwise (the timed call)."""
    if until == stage:
        raise StageReached(values)


def path_groups(
    *, rope: bool, decode: bool, fused: bool, joined: str = FUSED_ATTENTION, normed: bool = False
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The breakdown's stages of a path, in order, each with the tensors it ends with: the projections, the
    head split, the norm before rotary (with ``normed``: the path's config has one, `core.variants.norm_step`,
    QK-norm's), the rotary (with rope), the cache write (a decode step), the scores and softmax (with ``fused``
    one row with the context, named ``joined``: a fused kernel keeps them, or the program exposes none), the
    context, the merge, the output."""
    groups = [("projections", ("q", "k", "v")), ("head split", ("q_heads", "k_heads", "v_heads"))]
    if normed:
        groups.append(("qk-norm", ("q_normed", "k_normed")))
    if rope:
        groups.append(("rotary", ("q_rotated", "k_rotated")))
    if decode:
        groups.append((CACHE_WRITE, CACHE_NAMES))
    if fused:
        groups.append((joined, ("scores", "masked_scores", "weights", "context")))
    else:
        groups += [("scores", ("scores",)), ("softmax", ("masked_scores", "weights")), ("context", ("context",))]
    return (*groups, ("merge", ("merged",)), ("output", ("output",)))


@dataclass(frozen=True)
class StageCuts:
    """A path's stage-truncated programs.

    groups:  the stages in pipeline order, each ``(name, the tensors the stage ends with)``;
    cut:     a stage's name -> a callable running the path through that stage, waited for, returning the
             stage's tensors (built when asked: a JAX cut compiles there, outside any timed region);
    empty:   the cuts' fixed cost (a call that stops before the first stage), taken off the first stage;
    method:  how the cuts are made, in words.
    """

    groups: tuple[tuple[str, tuple[str, ...]], ...]
    cut: Callable[[str], Callable[[], tuple]]
    empty: Callable[[], object]
    method: str


def eager_cuts(run: Callable[..., object], groups, synchronize: Callable[[object], None]) -> StageCuts:
    """The cuts of an eager path (NumPy, torch): ``run(until)`` runs it with ``until`` (None: all of it)."""
    names = [name for name, _ in groups]

    def cut(stage: str) -> Callable[[], tuple]:
        if stage not in names:
            raise ValueError(f"no stage {stage!r} in this path; its stages: {', '.join(names)}")

        def program() -> tuple:
            try:
                result = run(stage)
            except StageReached as stop:
                synchronize(stop.values)  # all of them: a lazy library (MLX) evaluates only what it is given
                return stop.values
            synchronize(result)
            return (result,)  # the last stage: the path's own output

        return program

    def empty() -> tuple:
        return ()

    method = "the path's own stage-truncated programs (it stops at the end of the stage asked)"
    return StageCuts(tuple(groups), cut, empty, method)


def jax_cuts(stage_fn: Callable, args: list, groups, *, cache_args: Sequence[int] = (), precision: str) -> StageCuts:
    """The cuts of a jitted path: ``stage_fn(*args)`` returns every stage by name (with a decode step's
    `CACHE_NAMES`). Each cut is ``stage_fn`` returning only its stage's tensors, jitted and compiled apart.

    A decode step's cut from the cache write on also returns the caches, as the whole step does (without
    them XLA would drop the write). ``cache_args``: the positions in ``args`` of the caches the timed step
    donates (k, v), or none (a step that copies its cache): such a cut donates them too and puts the returned
    caches back into ``args`` (the list the timed step reads: the two share the live caches, as a generation
    loop would); an earlier cut returns no cache and donates nothing.
    """
    import jax
    import jax.numpy as jnp

    names = [name for name, _ in groups]
    cache_from = names.index(CACHE_WRITE) if CACHE_WRITE in names else len(names)
    present: list = []  # the names stage_fn returns (traced once, abstractly, at the first cut)

    def cut(stage: str) -> Callable[[], tuple]:
        if stage not in names:
            raise ValueError(f"no stage {stage!r} in this path; its stages: {', '.join(names)}")
        if not present:
            with jax.default_matmul_precision(precision):
                present.extend(jax.eval_shape(stage_fn, *args))
        index = names.index(stage)
        keep = tuple(name for name in groups[index][1] if name in present)
        if not keep:
            raise ValueError(f"the program returns none of stage {stage!r}'s tensors {groups[index][1]}")
        with_cache = index >= cache_from
        if with_cache:
            keep = tuple(name for name in keep if name not in CACHE_NAMES) + CACHE_NAMES
        donate = tuple(cache_args) if with_cache else ()  # empty for a step that does not donate its cache
        with jax.default_matmul_precision(precision):
            executable = (
                jax.jit(lambda *a: tuple(stage_fn(*a)[name] for name in keep), donate_argnums=donate)
                .lower(*args)
                .compile()
            )

        def program() -> tuple:
            values = executable(*args)
            if donate:  # the donated caches are dead: the returned ones are the live cache now
                for position, value in zip(cache_args, values[-len(CACHE_NAMES) :], strict=True):
                    args[position] = value
            return jax.block_until_ready(values)

        return program

    compiled: dict = {}  # the empty cut's program, compiled at its first call (the breakdown's warm-up)

    def empty():
        if "constant" not in compiled:
            compiled["constant"] = jax.jit(lambda *a: jnp.zeros(())).lower(*args).compile()
        return jax.block_until_ready(compiled["constant"](*args))

    method = "the path's stage function cut after each stage, jitted apart (XLA drops the rest)"
    return StageCuts(tuple(groups), cut, empty, method)
