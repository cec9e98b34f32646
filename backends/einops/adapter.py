"""The einops adapter: `EinopsBackend`, the pipeline of `layer` on the array library an entry names.

One class serves einops-numpy, einops-torch and einops-jax (the registry passes
``array_library``); `plans` says what the pipeline is, `layer` runs it, `vjp` differentiates it.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from .._inputs import convert_inputs
from .._mla import ABSORBED, MLA_STRATEGIES, NAIVE, QUERY_STEPS, MLAStrategies
from ..base import STANDARD, Backend, DecodeStep, Prepared, check_device_name, tensor_to_numpy
from ..frameworks.ops import OPS_BY_LIBRARY, RegistryVariants
from ..jax.common import CompiledForward, allows_tf32, check_matmul_precision, compiled_prepared
from ..numpy.common import NumpyPrecision
from ..torch.common import torch_devices, with_matmul_precision
from .decode import CACHE_KINDS, CACHE_LAYOUTS, prepare_einops_decode_run, prepare_einops_decode_step
from .layer import (
    ARRAY_LIBRARIES,
    canonical_weights,
    grouped_masks,
    run_pipeline,
    score_tables,
    stage_tensors,
)
from .mla import prepare_einops_mla, prepare_einops_mla_decode_run  # MLA's two forms, named axes
from .plans import (
    plan_for,
    position_tables,
)
from .vjp import prepare_einops_vjp  # the array library's own autodiff


class EinopsBackend(MLAStrategies, Backend):
    """einsum + rearrange on NumPy, torch or JAX arrays; never a hand-written axis swap."""

    strategies = (STANDARD, NAIVE, ABSORBED)  # the last two: MLA's (`_mla`), in `mla`
    # One class serves three array libraries: each cause is keyed " on <library>" (`Backend.gap_causes`).
    gap_causes: ClassVar[dict[str, str]] = {
        "decode on numpy": "NumPy 2.4's np.einsum rewrites the cache operand into batched-matmul order before its "
        "matmul ('bsgk->gks' at B=1) as a new array: a copy of all of K for the scores and of all of V for the "
        "context, every step (tracemalloc: the step's peak grows with the context by about K's bytes, numpy-best's "
        "by its scores only; not timed apart)",
        "decode on torch": "it materialises the scores and the weights over every cached slot (torch's profiler: the "
        "bmm's and the softmax's outputs grow with the context) and makes the step's mask over every slot in NumPy on "
        "the host (`decode_allowed`, read in the code), where torch-best's fused SDPA keeps its scores inside the "
        "kernel and needs no mask (not timed apart)",
        "forward on numpy": "each call makes its (B, H, N, N) scores anew, 32 MiB at the reference size (tracemalloc: "
        "a peak of 56 MiB a call against numpy-best's 21, which reuses one score workspace; not timed apart)",
        "forward on torch": "each call allocates its (B, H, N, N) scores and weights anew, 32 MiB each at the reference "
        "size (torch's profiler: 104 MiB a call against torch-best's 20), where torch-best's fused SDPA keeps them "
        "inside the kernel (not timed apart)",
        "decode on jax": "host work every step (a NumPy mask over the context, device_put, eager slicing: 0.7-1.3 ms); "
        "the jitted step is not donated its cache, so it copies it; the projection einsums compile to weight "
        "transposes and naive loop kernels (measured, issue 43)",
    }
    mla_query_steps = QUERY_STEPS  # its MLA forms temper both query parts (Mistral 4), forward, backward, decode

    # Every variant with named axes, on every array library (`plans` shows how); the backward
    # (torch and JAX arrays) differentiates the same pipeline, so it has them all too.
    variants = RegistryVariants("numpy", "torch", "jax")  # MLA in its naive and absorbed strategies (`mla`)
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8: the cache is the pipeline's own keys, "b s g k" (`decode`), on every array library; every variant
    # (a step is the pipeline's two halves with the cache between them).
    decode_caches = CACHE_KINDS
    decode_strategies = (STANDARD, *MLA_STRATEGIES)  # MLA's through its latent cache "b s f" (`mla`)
    decode_layouts = CACHE_LAYOUTS
    paged_decode_step = True  # bench --mode decode times the paged step (its pool[table] gather) on every library
    ragged_decode_step = True  # and a ragged batch's step (rows left padded to the longest)

    def __init__(
        self, name: str | None = None, array_library: str = "numpy", matmul_precision: str = "highest"
    ) -> None:
        if array_library not in ARRAY_LIBRARIES:
            raise ValueError(f"array_library must be one of {', '.join(ARRAY_LIBRARIES)}; got {array_library!r}")
        self.array_library = array_library
        self.convention = (
            f"einops.einsum + rearrange on {array_library} arrays, layout (B, N, h, d_k) kept; no transpose/permute"
        )
        super().__init__(name or f"einops-{array_library}")
        # On a GPU: "highest" for float32 comparisons; anything else lets JAX or torch use TF32.
        self.matmul_precision = check_matmul_precision(matmul_precision)

    def devices(self) -> tuple[str, ...]:
        if self.array_library == "torch":
            return torch_devices()
        if self.array_library == "jax":
            from ..jax.common import jax_devices

            return jax_devices()
        return ("cpu",)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        device = check_device_name(device)
        ops = OPS_BY_LIBRARY[self.array_library](dtype, device)
        if strategy in MLA_STRATEGIES:
            return prepare_einops_mla(self, ops, cfg, params, inputs, dtype, device, strategy)
        plan = plan_for(cfg)
        weights = {name: ops.asarray(value) for name, value in canonical_weights(cfg, params, plan).items()}
        x_q, x_k, x_v = convert_inputs(inputs, ops.asarray)
        blocked_np, empty_rows_np = grouped_masks(cfg, inputs, plan)
        blocked, empty_rows = (ops.asarray(mask, cast=False) for mask in (blocked_np, empty_rows_np))
        tables = position_tables(ops, cfg, inputs, plan, dtype)  # rotary, the temperature: against q and k
        info = self._numerics_info(dtype, device)
        info["patterns"] = f"{plan.name}: scores '{plan.scores}', context '{plan.context}'"
        if empty_rows_np is not None:
            info["empty_rows"] = int(empty_rows_np.sum())  # rows with no allowed key, in the mask's own broadcast form

        scores_np = score_tables(cfg, inputs, plan, dtype)  # ALiBi's bias, T5's buckets: NumPy, untimed
        bias_tables = {name: ops.asarray(table, cast=False) for name, table in scores_np.items()}

        def forward(*arrays):
            return run_pipeline(ops, plan, *arrays, cfg=cfg)

        def stages_of(*arrays):
            record: dict = {}
            run_pipeline(ops, plan, *arrays, cfg=cfg, record=record)
            return record

        args = (weights, x_q, x_k, x_v, blocked, empty_rows, tables, bias_tables)
        if self.array_library == "jax":
            # The closures capture ops (the dtype and device it converts to), the plan and cfg: all from these.
            key = ("einops.jax", cfg, dtype, device)
            compiled = CompiledForward(forward, args, self.matmul_precision, key)
            jax_stages = lambda: stage_tensors(ops, plan, compiled.trace_and_run(stages_of), cfg.rope)  # noqa: E731
            return compiled_prepared(compiled, jax_stages, info, ops.synchronize)

        run, record = partial(forward, *args), partial(stages_of, *args)
        if self.array_library == "torch":  # TF32 set for each call and restored (GPU only)
            tf32 = allows_tf32(self.matmul_precision)
            run, record = with_matmul_precision(run, device, tf32), with_matmul_precision(record, device, tf32)
        run.pipeline = (forward, args)  # the call itself, which the backward differentiates (`einops.vjp`)
        native_stages = lambda: stage_tensors(ops, plan, record(), cfg.rope)  # noqa: E731
        return Prepared(run, tensor_to_numpy, native_stages, synchronize=ops.synchronize, info=info)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache, **paging):
        ops = OPS_BY_LIBRARY[self.array_library](dtype, check_device_name(device))
        if strategy in MLA_STRATEGIES:
            return prepare_einops_mla_decode_run(self, ops, cfg, params, inputs, dtype, device, strategy)
        return prepare_einops_decode_run(self, ops, cfg, params, inputs, dtype, device, **paging)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        ops = OPS_BY_LIBRARY[self.array_library](job.dtype, check_device_name(job.device))
        return prepare_einops_decode_step(self, ops, cfg, params, job)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        return prepare_einops_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy)

    def _numerics_info(self, dtype: str, device: str) -> dict:
        info: dict = {"array_library": self.array_library}
        if self.array_library == "numpy":
            info["einsum"] = "np.einsum with an explicit two-operand path (batched matmul), not einops.einsum"
            info.update(NumpyPrecision.for_dtype(dtype).info())
        elif self.array_library == "jax":
            from ..jax.common import precision_info

            info.update(precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision))
        elif device == "gpu":
            from ..torch.common import precision_info

            # torch's switches are set around each forward and restored (`torch.common.matmul_precision`).
            info.update(precision_info(device=device, dtype=dtype, allow_tf32=allows_tf32(self.matmul_precision)))
        return info
