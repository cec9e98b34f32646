"""``bench --mode decode``: one KV-cache decode step per implementation and context length, against the bandwidth.

A cell is one implementation decoding ``step`` new tokens (B=1, one token by default) on a cache
that already holds ``context`` tokens: `Backend.prepare_decode` builds it (the cache filled with
arbitrary numbers, a window's ring already full), its ``forward`` is the step, ``compile`` runs
ahead and ``info["cache"]`` says the cache's kind, layout, slots and bytes. Cells follow the
rules of the other modes (`cell`): a fresh pinned process per cell and round, the thread and
allocator rules, compilation and the first call timed apart, warm-up, adaptive repeats, each
sample paired with the fixed reference product (`gemm.reference_product`, issue 28) so that the
drift-corrected figure (`correction.correct_cell`) is the published one, rounds in shuffled orders
merged by `rounds.merge_visits`.

The yardstick is the memory bandwidth (`bandwidth`), measured at the start of every round like
the GEMM peak: a decode step reads every cached key and value once and does two flops per byte or
so, so its limit is ``kv_read_bytes / bandwidth``. A cell reports the step's time with its round
range, its share of that limit (``limit_fraction``), the same with the projection weights counted
(``limit_fraction_with_weights``: at short contexts the four weight matrices, 40 MiB in float32 at
the default size, outweigh the cache), tokens per second, the cache's own record, and the
prefill/decode split.

The prefill is timed through the implementation's decode path itself: ``prepare_decode_run`` of a
``context``-token sequence with ``prefill=context``, whose ``run`` is exactly the forward that fills
the cache (no steps follow). It is timed in the same child after the step, raw (not paired), up
to ``prefill_max`` tokens: beyond, a full causal forward's scores would not fit beside the other
work on the machine, and the cell says so.

The windowed row (``window``) is the same layer with a sliding window at ``window_contexts``: its
step reads at most the ring's ``W - 1 + step`` slots (`core.decode.ring_capacity`), and its cache's
``slots`` stay there however long the context grows, which is the O(W) memory the table shows.

The sweep (settings, rounds, resume, the report) is `decode_sweep`; the published files and the README's
block are `decode_docs`.

Child usage: ``python -m mha_rosetta.benchmarks.decode '{"implementation": "numpy", "context": 1024, ...}'``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from .cell import MeasuredSpec, _cell_error, jsonable, split_implementation
from .decode_mla import check_mla_layer, mla_config
from .fresh import child_main, run_fresh
from .pinning import DEFAULT_MALLOC_MODE, malloc_env, require_positive_int

# 2: cells record ``bias`` (the layer's biases; the preset's layer has none since schema 2). A schema-1
# file's layer had biases on all four projections: `report.upgrade_decode_cells` reads its cells so.
# 3: the control-variate correction (`correction.correct_cell`); a schema-2 file's, by the plain paired
# ratio, is re-derived from its kept samples at load (`report.upgrade_report`).
SCHEMA = 3
RAGGED_ROW = "ragged"  # `DecodeCellSpec.row` of the ragged row's cells
KIND = "decode"  # the report's "kind": `load_report` readers and --render tell a decode report by it
# What a cell is; two cells with the same identity measure the same thing.
DECODE_IDENTITY = (
    "implementation", "device", "dtype", "batch", "context", "step", "d_model", "heads", "kv_heads", "d_k",
    "rope", "bias", "window", "cache", "lengths", "threads", "malloc", "mla",
)  # fmt: skip


@dataclass(kw_only=True)
class DecodeLayer:
    """The decoder layer a decode step runs, and how many tokens a step takes: the same fields in a sweep's
    settings (`decode_settings.DecodeSettings`) and in each of its cells (`DecodeCellSpec`, `layer_of`)."""

    batch: int = 1
    step: int = 1
    d_model: int = 2048
    heads: int = 16
    kv_heads: int = 4
    d_k: int = 128
    rope: str | None = "half"
    bias: bool = False  # biases on the four projections (MHAConfig.bias); the preset's Llama-style layer has none


def layer_of(settings: DecodeLayer) -> dict:
    """The `DecodeLayer` fields of ``settings`` (a sweep's), by name: what every cell of the sweep times."""
    return {item.name: getattr(settings, item.name) for item in fields(DecodeLayer)}


@dataclass
class DecodeCellSpec(MeasuredSpec, DecodeLayer):
    """Everything a child needs to time one decode step (its layer: `DecodeLayer`). Plain data: it travels as JSON."""

    spec_name = "decode cell spec"

    implementation: str
    context: int
    window: int | None = None
    cache: str | None = None  # None: the backend's default cache (its first decode_caches entry)
    # A ragged batch (the ragged row, continuous batching): row b's cached tokens, summing to batch x context (the
    # rectangular cell's tokens); the cache is left padded to max(lengths). None: every row holds ``context``.
    lengths: list[int] | None = None
    row: str | None = None  # "ragged": a cell of the ragged row (its ragged batches and their rectangular reference)
    mla: dict | None = None  # the MLA row's latent sizes (`decode_mla.MLA_FIELDS`); None: the plain layer
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 1
    cpus: list[int] | None = None
    policy: dict = field(default_factory=dict)  # timing.RepeatPolicy of the step
    prefill: bool = True  # also time a prefill of the context (the sweep sets it from prefill_max)
    prefill_policy: dict = field(default_factory=dict)
    seed: int = 0
    malloc: str = DEFAULT_MALLOC_MODE
    plugins: list[str] = field(default_factory=list)  # "module:Class" backends to register in the child

    def __post_init__(self) -> None:
        split_implementation(self.implementation)
        for name in ("context", "batch", "step", "d_model", "heads", "kv_heads", "d_k", "threads"):
            require_positive_int(f"DecodeCellSpec.{name}", getattr(self, name))
        if self.window is not None:
            require_positive_int("DecodeCellSpec.window", self.window)
        if self.lengths is not None and (len(self.lengths) != self.batch or sum(self.lengths) != self.tokens):
            raise ValueError(
                f"DecodeCellSpec.lengths must hold batch={self.batch} lengths summing to batch x context = "
                f"{self.tokens} (the rectangular cell's tokens), got {self.lengths}"
            )
        check_mla_layer(self.mla)
        malloc_env(self.malloc)

    @property
    def tokens(self) -> int:
        """The cached tokens of the whole batch before the step: ``batch x context`` (a ragged cell's too)."""
        return self.batch * self.context

    @property
    def width(self) -> int:
        """The cache's slots per row: ``context``, or a ragged cell's longest row (its left-padded width)."""
        return self.context if self.lengths is None else max(self.lengths)

    def identity(self) -> dict:
        """What its resume key (`MeasuredSpec.key`) is made of: the same as `decode_cell_key` of its record."""
        return {name: getattr(self, name) for name in DECODE_IDENTITY}


def decode_cell_key(record: dict) -> str:
    """The resume key of a recorded decode cell (its `DECODE_IDENTITY` fields, as `DecodeCellSpec.key`)."""
    return json.dumps({name: record.get(name) for name in DECODE_IDENTITY}, sort_keys=True)


def decode_config(spec: DecodeCellSpec):
    """The causal `MHAConfig` of a decode cell (GQA, rotary, the window where the row has one; the MLA row's latent
    attention, `decode_mla.mla_config`)."""
    from mha_rosetta.core import MHAConfig

    if spec.mla is not None:
        return mla_config(vars(spec))

    return MHAConfig(
        d_model=spec.d_model, n_heads=spec.heads, n_kv_heads=spec.kv_heads, d_k=spec.d_k, causal=True,
        rope=spec.rope, bias=spec.bias, window=spec.window,
    )  # fmt: skip


def ragged_lengths(context: int, shares: list[int]) -> list[int]:
    """The ragged row's lengths at ``context``: ``len(shares)`` rows holding the tokens of as many rows of ``context``
    (``len(shares) x context`` exactly), split in proportion to ``shares`` (positive ints), rounded down, the
    tokens left over one each to the first rows."""
    if len(shares) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shares):
        raise ValueError(f"ragged_rows must be two or more positive ints (each row's share), got {shares}")
    tokens, total = len(shares) * context, sum(shares)
    lengths = [tokens * share // total for share in shares]
    for row in range(tokens - sum(lengths)):  # fewer than len(shares) tokens left by the rounding
        lengths[row] += 1
    return lengths


def row_label(cell: dict) -> str:
    """What sets a decode cell apart beside its implementation, for the tables and the plot: its cache kind when
    paged, its window, and for the ragged row its rows (``ragged 4096+2048+1024+1024``) or ``B=4 rectangular``."""
    parts = [cell["cache"]] if cell.get("cache") else []
    if cell.get("window") is not None:
        parts.append(f"W={cell['window']}")
    if cell.get("lengths"):
        parts.append("ragged " + "+".join(str(length) for length in cell["lengths"]))
    elif cell.get("row") == RAGGED_ROW:
        parts.append(f"B={cell['batch']} rectangular")
    return "".join(f" ({part})" for part in parts)


def ring_slots(spec: DecodeCellSpec) -> int | None:
    """The ring buffer's slots of a windowed cell (`core.decode.ring_capacity`), None without a window."""
    return None if spec.window is None else spec.window - 1 + spec.step


def time_prepared(
    forward: Callable[[], object],
    synchronize: Callable[[object], None],
    compile_step: Callable[[], None] | None,
    policy,
    *,
    reference: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
) -> dict:
    """Compile (timed apart), the first call (timed apart), warm-up, then `timing.time_repeats` of
    ``forward`` + ``synchronize``, each sample followed by one ``reference`` sample where given."""
    from .timing import RepeatPolicy, time_repeats, warm_up

    record: dict = {"compile_s": None}
    if compile_step is not None:
        start = clock()
        compile_step()
        record["compile_s"] = clock() - start

    def run_once() -> None:
        synchronize(forward())

    start = clock()
    run_once()
    record["first_call_s"] = clock() - start
    record["warmup_calls"] = warm_up(run_once, policy, clock)
    if reference is not None:
        warm_up(reference, RepeatPolicy(min_time=0.0, warmup=2), clock)
    record.update(time_repeats(run_once, policy, clock=clock, cpu_clock=cpu_clock, reference=reference))
    return record


def _time_prefill(backend, cfg, params, spec: DecodeCellSpec) -> dict:
    """The prefill of ``context`` tokens through the decode path (``prefill=context``: the run is one forward
    that fills the cache), raw timings; or why it was not timed."""
    import numpy as np

    from mha_rosetta.backends import UnsupportedCase

    from .timing import RepeatPolicy

    x = np.random.default_rng(spec.seed + 2).standard_normal((spec.batch, spec.context, spec.d_model))  # (B, N, D)
    try:
        prepared, _inputs = backend.prepare_decode_run(
            cfg, params, x, prefill=spec.context, step=spec.step, dtype=spec.dtype, device=spec.device,
            strategy=spec.strategy, cache=spec.cache,
        )  # fmt: skip
        timings = time_prepared(
            prepared.run, prepared.synchronize, prepared.compile, RepeatPolicy(**spec.prefill_policy)
        )
    except UnsupportedCase as reason:
        return {"prefill_status": "unsupported", "prefill_error": str(reason)}
    except MemoryError as error:
        return {"prefill_status": "error", "prefill_error": f"MemoryError: {error}"}
    compilations = jsonable(prepared.info.get("compilations"))  # a JIT's count, of the last timed run
    record = {
        "prefill_status": "ok",
        "prefill_median_s": timings["median_s"],
        "prefill_iqr_s": timings["iqr_s"],
        "prefill_min_s": timings["min_s"],
        "prefill_repeats": timings["repeats"],
        "prefill_compile_s": timings["compile_s"],
        "prefill_first_call_s": timings["first_call_s"],
        "prefill_compilations": compilations,
    }
    if compiled_count(compilations):
        record["prefill_warning"] = (
            f"the prefill compiled during a timed run (info['compilations'] after the last one: {compilations}): "
            "its time includes compilation"
        )
    return record


def compiled_count(compilations) -> int:
    """How many compilations a ``PreparedDecode.info["compilations"]`` record counts: an int, or a dict of
    ints by program (JAX's ``{"prefill": 1, "step": 0}``); 0 for None or anything else."""
    if isinstance(compilations, bool):
        return 0
    if isinstance(compilations, int):
        return compilations
    if isinstance(compilations, dict):
        return sum(compiled_count(value) for value in compilations.values())
    return 0


def measure(spec: DecodeCellSpec) -> dict:
    """Time one decode step in this process (call it in a fresh, pinned child)."""
    from . import pinning
    from .gemm import reference_product
    from .timing import RepeatPolicy

    record: dict = {
        "affinity": sorted(os.sched_getaffinity(0)) if pinning.affinity_supported() else None,
        "malloc_env": pinning.malloc_env_report(),
        "thread_env": pinning.thread_env_report(),
    }
    from mha_rosetta.backends import UnsupportedCase, get_backend
    from mha_rosetta.backends.registry import register_path
    from mha_rosetta.core import init_params

    for path in spec.plugins:
        register_path(path)
    backend = get_backend(spec.backend)
    frameworks = backend.requires
    record["framework_threads"] = pinning.configure_frameworks(spec.threads, frameworks)
    cfg = decode_config(spec)
    params = init_params(cfg, seed=spec.seed)
    reference, record["reference"] = reference_product(spec.device, frameworks)
    try:
        prepared = backend.prepare_decode(
            cfg, params, context=spec.width, batch=spec.batch, step=spec.step, dtype=spec.dtype,
            device=spec.device, strategy=spec.strategy, cache=spec.cache, seed=spec.seed, lengths=spec.lengths,
        )  # fmt: skip
    except UnsupportedCase as reason:
        record.update(status="unsupported", error=str(reason))
        return record
    with pinning.limit_thread_pools(spec.threads):
        record["thread_pools"] = pinning.thread_pool_report()
        timings = time_prepared(
            prepared.forward, prepared.synchronize, prepared.compile, RepeatPolicy(**spec.policy),
            reference=reference, cpu_clock=pinning.family_cpu_seconds,
        )  # fmt: skip
        info = jsonable(dict(prepared.info))
        del prepared  # the step's cache is freed before the prefill allocates its own
        prefill = _time_prefill(backend, cfg, params, spec) if spec.prefill else {"prefill_status": "skipped"}
    record.update(timings)
    cpu_util = pinning.cpu_utilisation(timings["span_cpu_s"], timings["span_wall_s"])
    record.update(
        status="ok",
        cpu_util=cpu_util,
        warnings=[
            *pinning.cpu_warnings(cpu_util, spec.threads, spec.device),
            *filter(None, [pinning.page_fault_warning(timings["page_faults_per_call"], spec.malloc)]),
        ],
        cache_info=info.get("cache"),
        backend_info=info,
        **prefill,
    )
    if record.get("prefill_warning"):
        record["warnings"].append(record["prefill_warning"])
    if not isinstance(record["cache_info"], dict):
        record["warnings"].append("the prepared step has no info['cache'] record (kind, layout, slots, bytes)")
    return record


def decode_record(spec: DecodeCellSpec, outcome: dict) -> dict:
    """A cell's identity and settings, then the child's measurements (or its error)."""
    record = {**spec.identity(), "strategy": spec.strategy, "backend": spec.backend, "cpus": spec.cpus, "mode": KIND}
    if spec.row is not None:
        record["row"] = spec.row
    record.update(outcome)
    record.setdefault("status", "error")
    return record


def run_decode_cell(spec: DecodeCellSpec, timeout: float = 900.0) -> dict:
    """Time ``spec`` in a fresh pinned process (parent side)."""
    outcome = run_fresh(
        "mha_rosetta.benchmarks.decode", spec.to_dict(), threads=spec.threads, timeout=timeout,
        extra_env=malloc_env(spec.malloc),
    )  # fmt: skip
    return decode_record(spec, outcome)


def main(argv: list[str] | None = None) -> int:
    return child_main(
        argv, "mha_rosetta.benchmarks.decode", lambda data: measure(DecodeCellSpec.from_dict(data)),
        on_error=_cell_error, spec_name="json decode cell spec",
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
