"""One measured cell: one implementation at one size, dtype, device and thread count.

Run it in a fresh process (the sweep always does)::

    python -m mha_rosetta.benchmarks.cell '{"implementation": "numpy", "tokens": 64, ...}'

It prints one ``MHA_ROSETTA_RESULT {json}`` line (see `fresh`). The order inside the
child is what makes the number fair:

1. pin to the spec's cores (the parent already set every thread variable, and the
   allocator variables of ``malloc``, see `pinning.malloc_env`);
2. import the framework and set its runtime thread knobs (`pinning.configure_frameworks`);
3. ``prepare`` (parameter and input conversion, device transfer): untimed;
4. ``compile`` when the adapter has one (JIT): timed on its own, reported as ``compile_s``;
5. the first call, timed on its own (``first_call_s``: lazy compilation shows up here);
6. warm-up, then adaptive repeats of ``forward`` + ``synchronize`` (`timing.time_repeats`),
   with process CPU time read over the same span (``cpu_util``), each sample followed by one
   sample of the fixed reference product (`gemm.reference_product`: sample, reference,
   sample, ...), so that every sample has a paired ratio (``paired_ratios``) from which the
   sweep's drift-corrected figures are computed (`rounds`, `report`). The reference is
   built before ``prepare`` (its operands are part of the memory base, not of the cell's
   memory, except on a GPU, where they are in the device peak: 3 x 2048² float32, 48 MiB);
7. peak memory (``peak_mem_mb``), `memory.MemoryProbe`: what ``prepare`` and the timed
   calls left held, plus the peak of one more, untimed call (tracemalloc for NumPy arrays,
   the resident set and its reset high-water mark for torch and XLA); on a GPU, the
   framework's own peak allocation. ``host_peak_growth_mb`` keeps the growth of
   ``ru_maxrss`` over the whole cell.

Implementation labels: a backend name from the registry, optionally with a strategy,
``"numpy"`` (its standard strategy) or ``"numpy:slicing"``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields

from .flops import mode_flops
from .fresh import child_main, error_result, run_fresh
from .memory import MemoryProbe
from .pinning import DEFAULT_MALLOC_MODE, cpu_utilisation, cpu_warnings, malloc_env, require_positive_int

STANDARD_STRATEGY = "standard"  # the same string as backends.base.STANDARD (not imported: keep this light)

# Fields that say *what* is measured; two cells with the same identity measure the same thing.
IDENTITY_FIELDS = (
    "implementation", "device", "dtype", "batch", "tokens", "kv_tokens", "d_model", "heads",
    "kv_heads", "d_k", "kdim", "vdim", "causal", "threads", "malloc",
)  # fmt: skip


def split_implementation(label: str) -> tuple[str, str]:
    """``"numpy:slicing"`` -> ("numpy", "slicing"); ``"torch"`` -> ("torch", "standard")."""
    if not isinstance(label, str) or not label.strip():
        raise ValueError(f"implementation must be a backend name such as 'numpy' or 'numpy:slicing', got {label!r}")
    backend, _, strategy = label.strip().partition(":")
    return backend, strategy or STANDARD_STRATEGY


def implementation_label(backend: str, strategy: str) -> str:
    """The inverse of `split_implementation`."""
    return backend if strategy == STANDARD_STRATEGY else f"{backend}:{strategy}"


class MeasuredSpec:
    """What the spec of a measured cell shares, forward (`CellSpec`) or decode (`decode.DecodeCellSpec`), each a
    dataclass of plain data that travels as JSON: the implementation label split into backend and strategy, a
    resume key from its `identity`, and its JSON form."""

    spec_name = "cell spec"  # what its errors call it
    implementation: str

    @property
    def backend(self) -> str:
        return split_implementation(self.implementation)[0]

    @property
    def strategy(self) -> str:
        return split_implementation(self.implementation)[1]

    def identity(self) -> dict:
        raise NotImplementedError

    def key(self) -> str:
        """A stable string for resuming: equal keys mean the same measurement."""
        return json.dumps(self.identity(), sort_keys=True)

    def to_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass

    @classmethod
    def from_dict(cls, data: dict):
        known = {spec_field.name for spec_field in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.spec_name} fields {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclass
class CellSpec(MeasuredSpec):
    """Everything a child needs to measure one cell. Plain data: it travels as JSON."""

    implementation: str
    device: str = "cpu"
    dtype: str = "float32"
    batch: int = 4
    tokens: int = 512
    kv_tokens: int | None = None  # None: self-attention (kv tokens = tokens)
    d_model: int = 512
    heads: int = 8
    kv_heads: int | None = None  # None: plain MHA
    d_k: int | None = None  # None: d_model // heads
    kdim: int | None = None
    vdim: int | None = None
    causal: bool = False
    threads: int = 1
    cpus: list[int] | None = None
    policy: dict = field(default_factory=dict)  # timing.RepeatPolicy fields
    seed: int = 0
    malloc: str = DEFAULT_MALLOC_MODE  # pinning.MALLOC_MODES: the allocator rule of the child
    mode: str = "fwd"  # flops.MODES: "fwd" times the forward, "fwdbwd" forward+backward (run_vjp)
    variant: str | None = None  # benchmarks.variants.BENCH_VARIANTS: the configuration's variant (None: plain)

    def __post_init__(self) -> None:
        split_implementation(self.implementation)  # validates the label
        for name in ("batch", "tokens", "d_model", "heads", "threads"):
            require_positive_int(f"CellSpec.{name}", getattr(self, name))
        malloc_env(self.malloc)  # validates the mode
        mode_flops(1, self.mode)  # validates the timing mode
        # Imported here: the variants' table reads core's registry (NumPy), and this module is imported
        # by measured children before they pin themselves (test_bench_harness proves nothing heavy is).
        from .variants import check_variant

        check_variant(self.variant)

    def identity(self) -> dict:
        identity = {name: getattr(self, name) for name in IDENTITY_FIELDS}
        identity = identity if self.mode == "fwd" else {**identity, "mode": self.mode}  # old records: forward
        return identity if self.variant is None else {**identity, "variant": self.variant}  # old records: plain


def cell_key(result: dict) -> str:
    """The resume key of a recorded cell result (same as `CellSpec.key` of its spec)."""
    identity = {name: result.get(name) for name in IDENTITY_FIELDS}
    mode = result.get("mode", "fwd")  # records from before training cells are forward cells
    identity = identity if mode == "fwd" else {**identity, "mode": mode}
    if result.get("variant") is not None:  # records from before the variants are plain cells
        identity["variant"] = result["variant"]
    return json.dumps(identity, sort_keys=True)


def build_config(spec: CellSpec):
    """The `MHAConfig` of a cell."""
    from mha_rosetta.core import MHAConfig

    from .variants import variant_overrides

    return MHAConfig(
        d_model=spec.d_model,
        n_heads=spec.heads,
        d_k=spec.d_k,
        n_kv_heads=spec.kv_heads,
        kdim=spec.kdim,
        vdim=spec.vdim,
        **{"causal": spec.causal, **variant_overrides(spec.variant, spec.tokens)},
    )


def peak_rss_mb() -> float | None:
    """The process's peak resident set so far, in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def _reset_gpu_peak(device: str, frameworks: tuple[str, ...]) -> None:
    """Restart each framework's count of its peak device allocation before prepare (where it keeps one)."""
    if device == "gpu":
        from mha_rosetta.backends.frameworks import in_order  # after pinning: it imports NumPy

        for framework in in_order(frameworks):
            framework.reset_peak_memory()


def _gpu_peak_mb(device: str, frameworks: tuple[str, ...]) -> float | None:
    """The first framework's own peak device allocation (torch, JAX: registry order), where there is one."""
    if device != "gpu":
        return None
    from mha_rosetta.backends.frameworks import in_order  # after pinning: it imports NumPy

    return next((mb for mb in (f.peak_memory_mb() for f in in_order(frameworks)) if mb is not None), None)


def _make_inputs(spec: CellSpec, cfg):
    import numpy as np

    rng = np.random.default_rng(spec.seed + 1)
    query = rng.standard_normal((spec.batch, spec.tokens, cfg.d_model))  # (B, Nq, D)
    if spec.kv_tokens is None and cfg.is_self_attention_shaped:
        return query, None, None
    kv_tokens = spec.tokens if spec.kv_tokens is None else spec.kv_tokens
    key = rng.standard_normal((spec.batch, kv_tokens, cfg.kdim))  # (B, Nk, kdim)
    value = rng.standard_normal((spec.batch, kv_tokens, cfg.vdim))  # (B, Nk, vdim)
    return query, key, value


def measure(spec: CellSpec) -> dict:
    """Measure one cell in this process (call it in a fresh, pinned child)."""
    from . import pinning
    from .flops import config_matmul_flops
    from .gemm import reference_product
    from .timing import RepeatPolicy, time_repeats, warm_up

    policy = RepeatPolicy(**spec.policy)
    record: dict = {
        "affinity": sorted(os.sched_getaffinity(0)) if pinning.affinity_supported() else None,
        "malloc_env": pinning.malloc_env_report(),  # what the child really started with
        "thread_env": pinning.thread_env_report(),
    }

    from mha_rosetta.backends import UnsupportedCase, get_backend
    from mha_rosetta.core import init_params

    backend = get_backend(spec.backend)  # BackendNotInstalled / ValueError propagate to main
    frameworks = backend.requires  # pinning and the GPU peak act on the frameworks they know and skip the rest
    record["framework_threads"] = pinning.configure_frameworks(spec.threads, frameworks)

    cfg = build_config(spec)
    params = init_params(cfg, seed=spec.seed)
    query, key, value = _make_inputs(spec, cfg)
    kv_tokens = spec.tokens if spec.kv_tokens is None else spec.kv_tokens
    flops = mode_flops(config_matmul_flops(cfg, spec.batch, spec.tokens, kv_tokens), spec.mode)

    reference, record["reference"] = reference_product(spec.device, frameworks)
    rss_before = peak_rss_mb()
    _reset_gpu_peak(spec.device, frameworks)
    probe = MemoryProbe()
    probe.before_prepare()
    try:
        prepare = backend.prepare_vjp if spec.mode == "fwdbwd" else backend.prepare
        prepared, _inputs = prepare(
            cfg, params, query, key, value, dtype=spec.dtype, device=spec.device, strategy=spec.strategy
        )
        if spec.mode == "fwdbwd":  # forward+backward: the timed call is PreparedVJP.run
            step, results = prepared.run, lambda native: list(prepared.to_grads(native).values())
        else:
            step, results = prepared.forward, lambda native: [prepared.to_numpy(native)]
    except UnsupportedCase as reason:
        record.update(status="unsupported", error=str(reason))
        return record
    finally:
        probe.after_prepare()
    del query, key, value

    with pinning.limit_thread_pools(spec.threads):
        record["thread_pools"] = pinning.thread_pool_report()
        record["compile_s"] = None
        if prepared.compile is not None:
            start = time.perf_counter()
            prepared.compile()
            record["compile_s"] = time.perf_counter() - start

        result_box: list = [None]

        def one_call():
            # The timed region: the forward pass (and in fwdbwd its backward) and the wait, nothing else.
            result = step()
            prepared.synchronize(result)
            return result

        def run_once() -> None:
            result_box[0] = one_call()

        start = time.perf_counter()
        run_once()
        record["first_call_s"] = time.perf_counter() - start
        record["warmup_calls"] = warm_up(run_once, policy)
        if reference is not None:
            warm_up(reference, RepeatPolicy(min_time=0.0, warmup=2))
        workers_before = {worker["pid"]: worker["cpu_s"] for worker in pinning.worker_report()}
        # CPU time of this process and its worker processes (a sharded backend's ranks) over the span.
        timings = time_repeats(run_once, policy, cpu_clock=pinning.family_cpu_seconds, reference=reference)
        workers = pinning.worker_report()
        for worker in workers:
            before = workers_before.get(worker["pid"])
            worker["span_cpu_s"] = None if before is None or worker["cpu_s"] is None else worker["cpu_s"] - before
        record["workers"] = workers  # [] for a backend that runs in this process

        if workers:
            # The work and its memory are in the worker processes: this process's counts would read ~0.
            memory = {
                "peak_mem_mb": None,
                "peak_mem_method": f"not measured: the work runs in {len(workers)} worker processes "
                "(their resident sets are under 'workers')",
            }
        elif spec.device == "cpu":
            # The memory pass: the last timed result is dropped first, so the call's output counts as its own.
            result_box[0] = None
            result_box[0], memory = probe.call(one_call)
        else:  # on a GPU, the framework's peak allocation since before prepare
            memory = {"peak_mem_mb": _gpu_peak_mb(spec.device, frameworks), "peak_mem_method": "device"}

    import numpy as np

    outputs = [np.asarray(array, dtype=np.float64) for array in results(result_box[0]) if isinstance(array, np.ndarray)]
    record["output_finite"] = all(bool(np.isfinite(output).all()) for output in outputs)
    rss_after = peak_rss_mb()
    host_growth = None if rss_before is None else max(0.0, rss_after - rss_before)
    record.update(timings)
    cpu_util = cpu_utilisation(timings["span_cpu_s"], timings["span_wall_s"])
    record.update(
        status="ok",
        flops=flops,
        gflops=flops / timings["median_s"] / 1e9 if timings["median_s"] > 0 else None,
        cpu_util=cpu_util,
        warnings=[
            *cpu_warnings(cpu_util, spec.threads, spec.device),
            *filter(None, [pinning.page_fault_warning(timings["page_faults_per_call"], spec.malloc)]),
        ],
        **memory,  # peak_mem_mb and how it was counted: MemoryProbe on a CPU, the device's peak on a GPU
        host_peak_growth_mb=host_growth,
        peak_rss_mb=rss_after,
        backend_info=jsonable(prepared.info),
    )
    if not record["output_finite"]:
        record["warnings"].append("the output holds NaN or inf: the timing is of a broken computation")
    return record


def jsonable(value):
    """``value`` as it can travel in a cell's JSON record (a forward cell's ``backend_info``, a decode cell's): itself
    where JSON takes it; else a dict's keys as strings and its values likewise, anything else as its ``str``."""
    try:
        json.dumps(value)
        return value
    except TypeError:
        return {str(k): jsonable(v) for k, v in value.items()} if isinstance(value, dict) else str(value)


def run_cell(spec: CellSpec, timeout: float = 600.0) -> dict:
    """Measure ``spec`` in a fresh pinned process (parent side); returns the full cell record."""
    outcome = run_fresh(
        "mha_rosetta.benchmarks.cell",
        spec.to_dict(),
        threads=spec.threads,
        timeout=timeout,
        extra_env=malloc_env(spec.malloc),
    )
    return cell_record(spec, outcome)


def cell_record(spec: CellSpec, outcome: dict) -> dict:
    """A cell's identity, settings and the child's measurements (or its error) in one dict."""
    record = {**spec.identity(), "strategy": spec.strategy, "backend": spec.backend, "cpus": spec.cpus}
    record.update(outcome)
    record.setdefault("status", "error")
    return record


def _cell_error(error: Exception) -> dict:
    """A cell whose measurement raised, with the traceback; a missing framework is "unsupported"."""
    result = {**error_result(error), "traceback": traceback.format_exc(limit=-6)}
    try:
        from mha_rosetta.backends import BackendNotInstalled

        if isinstance(error, BackendNotInstalled):
            result["status"] = "unsupported"
    except ImportError:
        pass
    return result


def main(argv: list[str] | None = None) -> int:
    return child_main(
        argv,
        "mha_rosetta.benchmarks.cell",
        lambda data: measure(CellSpec.from_dict(data)),
        on_error=_cell_error,
        spec_name="json cell spec",
    )


if __name__ == "__main__":
    sys.exit(main())
