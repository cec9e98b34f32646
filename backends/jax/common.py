"""What the JAX adapters and oracles share: float64, devices, inputs, matmul precision, compiling.

Nothing here imports JAX at module import; every function imports it when called.

Three JAX facts that every JAX-based adapter must handle the same way:

* float64 needs ``jax_enable_x64``. Without it JAX silently turns float64 arrays into
  float32. The switch is process-global (it changes the default dtype of every later
  ``jnp.arange`` or ``jnp.zeros`` in this process), so it is turned on lazily, only
  when a float64 case is prepared. Arrays created with an explicit dtype keep it, so
  float32 runs stay float32 after the switch; the adapters never rely on defaults.
* On a GPU, JAX's default float32 matmul precision may use TF32 (10-bit mantissa).
  Comparisons run at ``"highest"``; ``"default"`` is selectable to show TF32's effect.
  Six names select three programs (`LOWERED_PRECISION`); only HIGHEST is float32 throughout.
  The precision is a tracing-time setting, so it is applied around ``lower()``.
* ``jax.jit`` compiles on the first call. `CompiledForward` does ``lower().compile()``
  on the converted, device-resident arguments in `Prepared.compile`, outside the
  timed region, and the timed forward calls the compiled executable.

Compiled programs are reused within a process (`shared_program`). JAX caches a traced and
compiled program by the identity of the Python function, then by the arguments' shapes,
dtypes, devices and tree structure and by the trace-time settings (matmul precision,
``jax_enable_x64``). Each `prepare` builds a new closure, so without help every run would be
traced and compiled again. An adapter therefore names its program by a key that holds
everything its closure captures (the config, the strategy and its blocks, the vmap axes,
the dtype a module is built with) and gets back the function first registered under that
key; JAX's own cache then handles shapes, dtypes and devices. Parameters, inputs, masks and
rotary tables are always traced arguments, never closed over, so they are not in the key.
A key that misses something the closure depends on would reuse a wrong program: each key
is built next to the closure it names.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    MHAInputs,
    MHAParams,
    allowed_positions,
    linear,
    rotary_tables,
    stage_names,
)
from mha_rosetta.core.stages import SCORE_VARIANT_STAGES
from mha_rosetta.core.variants import norm_step, relative_distances, t5_buckets

from .._inputs import convert_inputs
from .._layouts import TOKENS_FIRST_STAGE_AXES, xla_provenance
from ..base import Prepared, tensor_to_numpy

# Re-exported: the precision and device facts live in the framework layer.
from ..frameworks.jax import (  # noqa: F401
    LOWERED_PRECISION,
    MATMUL_PRECISIONS,
    allows_tf32,
    check_matmul_precision,
    effective_precision,
    enable_float64_if_needed,
    jax_device,
    jax_devices,
    precision_info,
)
from ..frameworks.ops import temperature_factors

# Re-exported: the conversions and the synchronisation are JAX's ops object's module's.
from ..frameworks.ops_jax import TRACED_OPS, block_until_ready, compute_dtype, jax_target, to_jax  # noqa: F401
from ..frameworks.score_parts import distance_slopes

# The softmax with the spec's zeros for a row with no allowed key, under the name it had here: JAX's ops object's.
softmax_with_empty_rows = TRACED_OPS.softmax


def jax_params(params: MHAParams, dtype: str, device) -> dict:
    """The canonical parameters by name (w_q ... b_o), as JAX arrays of ``dtype`` on ``device``; no bias: None."""
    return {name: to_jax(value, dtype, device) for name, value in params.as_dict().items()}


def jax_inputs(inputs: MHAInputs, dtype: str, device) -> tuple:
    """(x_q, x_k, x_v) as JAX arrays of ``dtype`` on ``device``, one device copy per distinct input."""
    return convert_inputs(inputs, lambda array: to_jax(array, dtype, device))


def numpy_rotary_tables(cfg: MHAConfig, inputs: MHAInputs) -> tuple | None:
    """The rotary tables ``(q_cos, q_sin, k_cos, k_sin)``, NumPy ``(1|B, N, r/2)`` float64; None without rope."""
    tables = rotary_tables(cfg, inputs)
    return None if tables is None else (tables.q_cos, tables.q_sin, tables.k_cos, tables.k_sin)


def jax_rotary_tables(cfg: MHAConfig, inputs: MHAInputs, dtype: str, device) -> tuple | None:
    """The rotary tables ``(q_cos, q_sin, k_cos, k_sin)`` as JAX arrays ``(1|B, N, r/2)``; None without rope."""
    tables = numpy_rotary_tables(cfg, inputs)
    return None if tables is None else tuple(to_jax(table, dtype, device) for table in tables)


def rotate_last_axis(x, cos, sin, style: str):
    """The rotary embedding on the last (feature) axis: x (..., N, Dk), tables (..., N, r/2) broadcastable.

    "half" pairs features i and i + r/2 (two slices); "interleaved" pairs 2i and 2i + 1
    (a reshape of the feature axis to (r/2, 2)). Features past r pass through.
    """
    import jax.numpy as jnp

    h = cos.shape[-1]  # r/2 pairs
    r = 2 * h
    x_rot = x[..., :r]  # (..., N, r)
    if style == "half":
        a, b = x_rot[..., :h], x_rot[..., h:]  # (..., N, r/2) each
        rotated = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)  # (..., N, r)
    else:
        pairs = x_rot.reshape(*x_rot.shape[:-1], h, 2)  # (..., N, r/2, 2)
        a, b = pairs[..., 0], pairs[..., 1]  # (..., N, r/2) each
        rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x_rot.shape)  # (..., N, r)
    return rotated if r == x.shape[-1] else jnp.concatenate([rotated, x[..., r:]], axis=-1)  # (..., N, Dk)


# -- the variants (`core.variants`), in jnp ---------------------------------------------------
# The tables (ALiBi's slopes and distances, T5's buckets) are computed in NumPy at prepare time
# with `core.variants` and passed in as arguments, the way the rotary tables are; every
# operation on the queries and keys (RMSNorm) is jnp's, and the score steps are JAX's ops
# object's (`frameworks.ops_jax.JaxOps`). Half precision computes each of them in float32 and
# rounds the result back, as the softmax does.

# The variant stages in the tokens-first layout of every JAX pass (and of einops): the normed
# heads as the heads, the capped and biased scores (every score-like variant stage) as the scores.
VARIANT_STAGE_AXES = {
    "q_normed": TOKENS_FIRST_STAGE_AXES["q_heads"],
    "k_normed": TOKENS_FIRST_STAGE_AXES["k_heads"],
    **{name: TOKENS_FIRST_STAGE_AXES["scores"] for name in SCORE_VARIANT_STAGES},
    "gate": TOKENS_FIRST_STAGE_AXES["merged"],  # the output gate: one factor per merged feature
}


def tokens_first_axes(cfg: MHAConfig, hidden: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """The axes of every stage of ``cfg``'s pipeline (`core.stage_names`) but ``hidden``, tokens first, in order."""
    axes = {**TOKENS_FIRST_STAGE_AXES, **VARIANT_STAGE_AXES}
    return {name: axes[name] for name in stage_names(cfg) if name not in hidden}


def variant_provenance(name: str, cfg: MHAConfig) -> tuple[str, str | None]:
    """(relation, parent) of stage ``name`` of an XLA pass, the variants' stages included: QK-norm makes
    the normed heads from the heads (a new tensor) and the rotary turns those; the score variants are
    each made from the score stage before them (`core.stages` order)."""
    if name in ("q_normed", "k_normed"):
        return "new", f"{name[0]}_heads"
    if name in ("q_rotated", "k_rotated") and norm_step(cfg) is not None:
        return ("view" if cfg.rope is None else "new"), f"{name[0]}_normed"
    names = stage_names(cfg)
    if name in (*SCORE_VARIANT_STAGES, "masked_scores"):
        return "new", names[names.index(name) - 1]
    return xla_provenance(name, cfg.rope)


def output_gate(x, params: dict, merged) -> dict:
    """The output gate (``attn_output_gate``) of one item's tokens ``x`` (N, D): {"gate": sigmoid(x @ w_gate.T +
    b_gate), "gated": merged * gate}, (N, H*Dv) each in the merged heads' layout (JAX's ops object's sigmoid)."""
    gate, gated = TRACED_OPS.output_gate(merged, linear(x, params["w_gate"], params.get("b_gate")))
    return {"gate": gate, "gated": gated}


def rms_norm_last_axis(x, weight, eps: float, sum_squares=None):
    """RMSNorm over the last axis, ``x * rsqrt(mean(x**2) + eps) * weight`` (`core.variants.rms_norm`).

    ``sum_squares(s, width)`` -> ``(s, width)`` lets a sharded pass replace the local sum of
    squares (..., 1) and width by the whole projection's (a psum); None: this array is all of it.
    """
    import jax.numpy as jnp
    from jax import lax

    compute = compute_dtype(x.dtype)
    xc = x.astype(compute)
    total, width = jnp.sum(xc * xc, axis=-1, keepdims=True), x.shape[-1]  # (..., 1)
    if sum_squares is not None:
        total, width = sum_squares(total, width)
    return (xc * lax.rsqrt(total / width + eps) * weight.astype(compute)).astype(x.dtype)


def normed_heads(cfg: MHAConfig, params: dict, q, k, q_heads, k_heads, sum_squares=None) -> dict:
    """The queries and keys after the norm before rotary (the registry's `norm_step`: QK-norm), as heads, features
    last: {"q_normed": like ``q_heads`` (..., H, Dk), "k_normed": like ``k_heads`` (..., Hkv, Dk)}; empty without it.

    Each head's Dk features with one (Dk,) weight broadcast over the heads (``step.per_head``), or the merged
    projections ``q`` (..., H*Dk), ``k`` (..., Hkv*Dk), then the same reshape as the split. ``sum_squares``: a
    sharded pass's reduction of the projection's statistics (`mesh_sum_squares`).
    """
    step = norm_step(cfg)
    if step is None:
        return {}
    w_q, w_k, eps = params[step.weight("q")], params[step.weight("k")], cfg.norm_eps
    if step.per_head:
        return {"q_normed": rms_norm_last_axis(q_heads, w_q, eps), "k_normed": rms_norm_last_axis(k_heads, w_k, eps)}
    q_normed = rms_norm_last_axis(q, w_q, eps, sum_squares).reshape(q_heads.shape)  # (..., H, Dk): the split's
    k_normed = rms_norm_last_axis(k, w_k, eps, sum_squares).reshape(k_heads.shape)  # (..., Hkv, Dk)
    return {"q_normed": q_normed, "k_normed": k_normed}


def mesh_sum_squares(cfg: MHAConfig, axis: str, world: int):
    """`normed_heads`' ``sum_squares`` for a pass whose ``world`` devices on mesh axis ``axis`` each hold a slice of
    the projection's features: one psum of the sums of squares, and the whole width (a kv head replicated on r
    devices is counted r times, and so is its width, so the mean is right). None where ``cfg``'s norm before
    rotary takes each head's own statistics (a device holds whole heads) or there is none."""
    step = norm_step(cfg)
    if step is None or step.per_head:
        return None

    def sum_squares(total, width):
        """This device's sum of squares of its features -> the whole projection's, and its width."""
        import jax

        return jax.lax.psum(total, axis), width * world

    return sum_squares


def score_bias_inputs(cfg: MHAConfig, inputs: MHAInputs, dtype: str) -> tuple[dict, dict]:
    """The NumPy tables the score bias reads, and their batch in_axes for a vmap over the batch items.

    ``slopes`` (H,) ALiBi's (`score_parts.distance_slopes`, per head, never per item: in_axes None), ``distance``
    (1|B, Nq, Nk) ``p_j - p_i`` as float (ALiBi), ``bucket`` (1|B, Nq, Nk) int32 T5's bucket of each
    (query, key) pair, which indexes ``params.rel_bias`` inside the traced pass (so its gradient
    flows). A table shared by every batch item loses its batch axis and is left unmapped. The
    floats are float32 for half precision (the bias is added in float32, `JaxOps.add_score_bias`), else ``dtype``.
    With Llama 4's temperature also ``temper`` (1|B, Nq), the queries' factors (`temperature_table`), which
    `layer._mha_one_item` reads before the attention. Empty dicts without any of them.
    """
    float_dtype = np.float64 if dtype == "float64" else np.float32
    tables: dict = temperature_table(cfg, inputs.positions, dtype)  # Llama 4's factors (1|B, Nq), or nothing
    axes: dict = {}
    if not cfg.has_score_bias:
        return _unmap_shared(tables, axes)
    distance = relative_distances(inputs.positions, inputs.kv_positions)  # (1|B, Nq, Nk) int64
    slopes = distance_slopes(cfg)  # ALiBi's m_h, or None
    if slopes is not None:
        tables["slopes"], axes["slopes"] = slopes.astype(float_dtype), None  # (H,)
        tables["distance"] = distance.astype(float_dtype)
    if cfg.rel_buckets is not None:
        buckets = t5_buckets(distance, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)
        tables["bucket"] = buckets.astype(np.int32)  # (1|B, Nq, Nk)
    return _unmap_shared(tables, axes)


def _unmap_shared(tables: dict, axes: dict) -> tuple[dict, dict]:
    """The per-item tables (1|B, ...) with their batch in_axes: one shared by every item loses its batch axis."""
    for name in ("distance", "bucket", "temper"):
        if name in tables:
            shared = tables[name].shape[0] == 1
            tables[name], axes[name] = (tables[name][0], None) if shared else (tables[name], 0)
    return tables, axes


def temperature_table(cfg: MHAConfig, positions: np.ndarray, dtype: str) -> dict:
    """``{"temper": factors}``: Llama 4's temperature factors of the query ``positions`` (1|B, Nq) (a decode step's
    with the cache offset), NumPy in at least float32, which `layer._mha_one_item` reads per item; {} without it."""
    factors = temperature_factors(cfg, positions)
    return {} if factors is None else {"temper": factors.astype(np.float64 if dtype == "float64" else np.float32)}


def allowed_for_heads(cfg: MHAConfig, inputs: MHAInputs) -> np.ndarray | None:
    """The combined mask (user AND causal), 4-D (B or 1, H or 1, Nq, Nk), True = may attend."""
    allowed = allowed_positions(cfg, inputs)
    return None if allowed is None else np.ascontiguousarray(allowed)


def empty_query_rows(cfg: MHAConfig, inputs: MHAInputs) -> np.ndarray | None:
    """(B or 1, H or 1, Nq) bool: query rows of a head that may attend to no key; None if none."""
    allowed = allowed_positions(cfg, inputs)
    if allowed is None:
        return None
    empty = ~allowed.any(axis=-1)  # (B|1, H|1, Nq)
    return empty if empty.any() else None


# key -> (the function first registered under it, its jax.jit). Per process; a check's worker
# keeps it for the whole check. Entries are few (one per backend and closure: forward, stage
# dump, backward) and hold no arrays: parameters and inputs are arguments, not captured.
_PROGRAMS: dict[tuple, tuple[Callable, Callable]] = {}


def shared_program(key: tuple | None, fn: Callable, **jit_options) -> tuple[Callable, Callable]:
    """``(function, jitted)``: the pair first registered under ``key``, or ``fn`` and a new ``jax.jit(fn)``.

    ``key`` must hold everything ``fn`` closes over (see the module docstring) and the
    ``jit_options`` (``static_argnums``, ``donate_argnums``: `jax.jit`'s); None: no sharing,
    ``fn`` is jitted afresh (and compiled again by every caller).
    """
    import jax

    from . import executables

    if key is None:
        return fn, jax.jit(fn, **jit_options)
    if key not in _PROGRAMS:
        jitted = jax.jit(fn, **jit_options)
        # Where the check's disk cache is on, its calls run stored executables (static arguments' values join
        # the key); everywhere else the plain jit.
        if executables.directory() is not None:
            static = jit_options.get("static_argnums", ())
            jitted = executables.CachedJit(jitted, key, (static,) if isinstance(static, int) else tuple(static))
        _PROGRAMS[key] = (fn, jitted)
    return _PROGRAMS[key]


class CompiledForward:
    """A jitted function, its device-resident arguments, and its ahead-of-time compilation.

    ``compile()`` traces and compiles under the chosen matmul precision (untimed);
    ``__call__()`` runs the compiled executable (the timed region), compiling first if
    nobody did. ``trace_and_run(fn)`` runs another function of the same arguments (the
    stage dump) under the same precision, untimed. ``key`` names the program for reuse
    across prepares (`shared_program`): two prepares with the same key, shapes, dtypes and
    device compile once.
    """

    def __init__(self, fn: Callable, args: tuple, matmul_precision: str, key: tuple | None = None) -> None:
        self.key = key
        # The traced function itself (the shared one when keyed), for `jax.vjp` (`jax.vjp`).
        self.fn, self._jitted = shared_program(key, fn)
        self.args = args
        self.matmul_precision = effective_precision(matmul_precision)
        self._compiled = None

    def compile(self) -> None:
        import jax

        from .executables import compile_program

        with jax.default_matmul_precision(self.matmul_precision):
            self._compiled = compile_program(self._jitted, self.args, self.key)

    def __call__(self):
        if self._compiled is None:
            self.compile()
        return self._compiled(*self.args)

    def trace_and_run(self, fn: Callable):
        """``fn(*args)``, the adapter's one stage dump, jitted at this precision; shared as ``("stages", *key)``."""
        import jax

        _, jitted = shared_program(None if self.key is None else ("stages", *self.key), fn)
        with jax.default_matmul_precision(self.matmul_precision):
            return jitted(*self.args)


def compiled_prepared(
    compiled: CompiledForward, native_stages: Callable, info: dict, synchronize: Callable = block_until_ready
) -> Prepared:
    """The `Prepared` of a jitted adapter: the compiled executable is the timed forward."""
    return Prepared(compiled, tensor_to_numpy, native_stages, synchronize, compile=compiled.compile, info=info)
