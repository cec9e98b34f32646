"""A prepared forward cut after each stage: the programs ``bench --breakdown`` times to say where the time goes.

Why truncated programs and not a profiler: the cut runs the adapter's own code, the same in every framework,
and a stage's time is the difference of two consecutive cuts; a profiler's operators would have to be
mapped to stages by hand for each adapter, and XLA's fused kernels cannot be split by one at all.

How a program is cut, without the adapter's help:

* NumPy and torch (the adapters and their best paths): the forward records its stages through a
  `StageRecorder` when one is given (`_recording.record_stages`, the adapter's ``native_stages``). A
  `_CuttingRecorder` stands in for it: it copies nothing, and when every stage up to the cut has been
  recorded it stops the pass (an exception carrying the cut's tensors). The pass runs exactly the adapter's
  code up to there, plus the recorder's bookkeeping (``relation_to`` checks, a few microseconds).
* JAX (the adapter and jax-best): the stage dump is a jitted function returning every stage
  (`jax.common.CompiledForward.trace_and_run`). The cut is that function returning only the cut's stages,
  jitted and compiled: XLA drops the dead rest. It may fuse the kept part differently from the whole
  program (a stage returned must be written out, where the whole program may fuse it away): that is the
  cost of the method, visible as the gap between the last cut and the untouched forward.

* A path with its own stage-truncated programs (`Prepared.stage_cuts`, `stage_cuts.StageCuts`: the best
  paths, forward and decode step, and the jax adapter's decode step) is cut by them: it stops at the end of
  the stage asked, and a decode step's cache write is a stage of its own (`stage_cuts.CACHE_WRITE`).

No cut is made (`NoCut`, with the reason) where it would mislead: a strategy that computes its stages one
head at a time (slicing, per_head: a cut would stop after the first head); a pass without cuts of its own
that records its stages after computing its output (a cut would stop it after all its work). The second is
checked on every pass, not listed: the first record keeps the locals of the frames above it, and if the
output recorded last is among them, it existed before any stage was recorded (conservative: a pass that
preallocates its output in a local is refused too). Nothing here imports a framework at module import.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from mha_rosetta.core.stages import STAGE_NAMES

from . import _recording
from .base import Prepared
from .stage_cuts import StageCuts

# The breakdown's stages, each the canonical stage tensors it ends with, in pipeline order. A stage whose tensors
# a configuration lacks (qk-norm, a softcap, a mask) is left out of its breakdown.
STAGE_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("latents", ("kv_latent", "k_rope", "q_latent")),  # DeepSeek MLA's, only with kv_lora_rank
    ("projections", ("q", "k", "v")),
    ("head split", ("q_heads", "k_heads", "v_heads")),
    ("value norm", ("v_normed",)),  # Gemma 4's, only with value_norm
    ("qk-norm", ("q_normed", "k_normed")),
    ("rotary", ("q_rotated", "k_rotated")),
    ("after rotary", ("q_rotated_normed", "k_rotated_normed", "q_tempered")),  # Llama 4's, only when on
    ("scores", ("scores", "capped_scores", "biased_scores")),
    ("softmax", ("masked_scores", "weights")),
    ("context", ("context",)),
    ("merge", ("merged",)),
    ("output gate", ("gate",)),  # Qwen3-Next's sigmoid(gate) factor, only with attn_output_gate
    ("output", ("output",)),
)


_FRAMES_UP = 6  # how many frames above a first record `_ListingRecorder` reads: the recording helpers and the pass


class NoCut(ValueError):
    """This program cannot be cut after its stages (the reason says why); only its whole time is measured."""


class PerHeadStages(NoCut):
    """The pass records its stages one head at a time: no cut after a whole stage exists."""


class _Cut(Exception):  # a control-flow signal, not an error
    def __init__(self, values: tuple, reached: tuple[str, ...]) -> None:
        super().__init__("the pass was cut here")
        self.values, self.reached = values, reached


class _CuttingRecorder(_recording.StageRecorder):
    """Stops the pass once every stage of ``wanted`` is recorded, carrying the stages of ``keep``."""

    def __init__(self, wanted: frozenset[str], keep: tuple[str, ...]) -> None:
        super().__init__()
        self.wanted, self.keep, self.seen = wanted, keep, {}

    def record(self, name, value, axes=(), note="", relation="new", parent=None) -> None:
        self.seen[name] = value  # no copy: the live tensor, used at once
        if self.wanted <= self.seen.keys():
            raise _Cut(tuple(self.seen[stage] for stage in self.keep if stage in self.seen), tuple(self.seen))

    def record_head(self, name, head, *args, **kwargs) -> None:
        raise PerHeadStages(f"the pass computes stage {name!r} one head at a time: a cut would time one head only")


class _Captured(Exception):  # a control-flow signal
    def __init__(self, compiled, fn) -> None:
        super().__init__("stage dump captured")
        self.compiled, self.fn = compiled, fn


@contextlib.contextmanager
def _recorder_factory(factory: Callable[[], _recording.StageRecorder]) -> Iterator[None]:
    """Inside the block, every backends module that makes its recorders by the name ``StageRecorder`` (through
    `_recording.record_stages`, or its own import of the class: the decode steps) makes them with ``factory``."""
    original = _recording.StageRecorder
    patched = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("mha_rosetta.backends") and getattr(module, "StageRecorder", None) is original
    ]
    for module in patched:
        module.StageRecorder = factory
    try:
        yield
    finally:
        for module in patched:
            module.StageRecorder = original


def _jax_stage_dump(prepared: Prepared):
    """(the `CompiledForward`, its stage-dump function) of a jitted adapter's forward, or None."""
    from .jax.common import CompiledForward

    if not isinstance(prepared.forward, CompiledForward):
        return None

    def capture(self, fn):
        raise _Captured(self, fn)

    before = CompiledForward.trace_and_run
    CompiledForward.trace_and_run = capture  # type: ignore[method-assign]
    try:
        prepared.native_stages()
    except _Captured as captured:
        return captured.compiled, captured.fn
    finally:
        CompiledForward.trace_and_run = before  # type: ignore[method-assign]
    return None


class StagePrograms:
    """The cuts of one prepared forward: ``groups`` (the breakdown's stages present, in order), ``program(k)``
    the forward cut after group k (a callable returning its native stage tensors, waited for), ``reached(k)``
    the stages a cut had recorded when it stopped (NumPy and torch: a pass may record a later stage first)."""

    def __init__(self, prepared: Prepared, present: list[str], requires: tuple[str, ...]) -> None:
        self.prepared = prepared
        # A stage the pass does not record (a fused kernel keeps it inside) is timed with the next one it records.
        kept = [(group, tuple(name for name in names if name in present)) for group, names in STAGE_GROUPS]
        self.groups = [(group, names) for group, names in kept if names]
        self._jax = _jax_stage_dump(prepared) if "jax" in requires else None
        if "jax" in requires and self._jax is None:
            raise NoCut(
                "this JAX program exposes no jitted stage dump to cut (only the forwards built on "
                "CompiledForward do; a decode step returns its output only)"
            )
        self._reached: dict[int, tuple[str, ...]] = {}
        self._current: tuple | None = None  # (wanted, keep) of the cut that runs now

    @property
    def method(self) -> str:
        return (
            "jitted cuts of the stage dump (XLA drops the rest)" if self._jax else "the forward stopped by its recorder"
        )

    def _wanted(self, index: int) -> frozenset[str]:
        return frozenset(name for _, names in self.groups[: index + 1] for name in names)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The block in which the cuts run: the recorder is swapped in once for all of them (NumPy, torch)."""
        if self._jax is not None:
            yield
            return

        def factory():
            if self._current is None:  # the empty cut: stopped before the pass starts
                raise _Cut((), ())
            return _CuttingRecorder(*self._current)

        with _recorder_factory(factory):
            yield

    def baseline(self) -> Callable[[], tuple]:
        """The empty cut: the cuts' own fixed cost (the stage dump's call, the recorder, the stop; for JAX, a
        compiled program that takes the same arguments and computes nothing), subtracted from the first stage."""
        if self._jax is not None:
            import jax
            import jax.numpy as jnp

            compiled, _ = self._jax
            executable = jax.jit(lambda *args: jnp.zeros(())).lower(*compiled.args).compile()
            return lambda: jax.block_until_ready(executable(*compiled.args))

        def run() -> tuple:
            self._current = None
            try:
                self.prepared.native_stages()
            except _Cut as cut:
                return cut.values
            raise ValueError("the empty cut did not stop the pass")

        return run

    def program(self, index: int) -> Callable[[], tuple]:
        """The forward cut after group ``index``; a NumPy or torch cut runs inside `active`."""
        keep = self.groups[index][1]
        if self._jax is not None:
            return self._jax_program(keep)
        wanted = self._wanted(index)

        def run() -> tuple:
            self._current = (wanted, keep)
            try:
                self.prepared.native_stages()
            except _Cut as cut:
                self._reached.setdefault(index, cut.reached)
                self.prepared.synchronize(cut.values[-1])
                return cut.values
            raise ValueError(f"the pass ended without recording every stage of {sorted(wanted)}")

        return run

    def _jax_program(self, keep: tuple[str, ...]) -> Callable[[], tuple]:
        import jax

        compiled, fn = self._jax
        with jax.default_matmul_precision(compiled.matmul_precision):
            executable = jax.jit(lambda *args: tuple(fn(*args)[name] for name in keep)).lower(*compiled.args).compile()

        def run() -> tuple:
            return jax.block_until_ready(executable(*compiled.args))

        return run

    def reached(self, index: int) -> tuple[str, ...]:
        return self._reached.get(index, tuple(sorted(self._wanted(index), key=STAGE_NAMES.index)))


class _ListingRecorder(_recording.StageRecorder):
    """Records as usual, and lists the names recorded through it (a stage recomputed beside the pass is not).

    At the first record it also keeps every local of the frames above it (the pass's). If the output recorded
    last was already among them, the pass computed everything before recording anything: a cut would stop
    it after its work, so no cut splits its time (`recorded_after_output`).
    """

    def __init__(self, listed: list[str]) -> None:
        super().__init__()
        self.listed = listed
        self.first_locals: list | None = None
        self.output = None

    def record(self, name, value, *args, **kwargs) -> None:
        if self.first_locals is None:
            frame, self.first_locals = sys._getframe(1), []
            for _ in range(_FRAMES_UP):
                if frame is None:
                    break
                self.first_locals += list(frame.f_locals.values())
                frame = frame.f_back
        self.listed.append(name)
        if name == "output":
            self.output = value
        super().record(name, value, *args, **kwargs)

    def record_head(self, name, head, *args, **kwargs) -> None:
        raise PerHeadStages(f"the pass computes stage {name!r} one head at a time: a cut would time one head only")

    def recorded_after_output(self) -> bool:
        return self.output is not None and any(value is self.output for value in self.first_locals or ())


class OwnStagePrograms:
    """`StagePrograms`' interface over a path's own `StageCuts` (each cut built, and compiled, when asked)."""

    def __init__(self, cuts: StageCuts) -> None:
        self.cuts = cuts
        self.groups = list(cuts.groups)
        self.method = cuts.method

    def active(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def baseline(self) -> Callable[[], object]:
        return self.cuts.empty

    def program(self, index: int) -> Callable[[], tuple]:
        return self.cuts.cut(self.groups[index][0])

    def reached(self, index: int) -> tuple[str, ...]:
        return self.groups[index][1]


def stage_programs(prepared: Prepared, requires: tuple[str, ...]) -> StagePrograms | OwnStagePrograms:
    """The cuts of ``prepared`` (a forward's or decode step's `Prepared`; ``requires``: its backend's
    frameworks): its own (`Prepared.stage_cuts`) where it has them, else the recorder's, after one untimed
    stage dump that says which stages the pass itself records. Raises `NoCut` (`PerHeadStages` for a per-head
    strategy) where no cut exists."""
    if prepared.stage_cuts is not None:
        return OwnStagePrograms(prepared.stage_cuts)
    listed: list[str] = []
    recorders: list[_ListingRecorder] = []

    def listing() -> _ListingRecorder:
        recorders.append(_ListingRecorder(listed))
        return recorders[-1]

    with _recorder_factory(listing):
        recorded = prepared.native_stages()
    if any(recorder.recorded_after_output() for recorder in recorders):
        raise NoCut(
            "the pass records its stages after it has computed its output (the output already existed when it "
            "recorded its first stage): a cut would stop it after all its work, so no cut splits its time"
        )
    if not listed and "jax" not in requires:
        raise NoCut(f"the pass records no stage through a recorder (its stage dump, {sorted(recorded)}, is made apart)")
    return StagePrograms(prepared, listed or list(recorded), requires)
