"""The JAX adapter: `JaxBackend`, the vmapped token-first pass of `layer` behind the `Backend` interface.

`layer` says what the JAX convention is and shows (its docstring); this module picks a
strategy, compiles the pass, wires `chunked` and `vjp` in and fills `Prepared.info`.
"""

from __future__ import annotations

from typing import ClassVar

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from .._chunking import CHUNKED, CHUNKED_STAGES_NOTE
from .._layouts import XLA_LAYOUT
from .._mla import ABSORBED, MLA_STRATEGIES, NAIVE, MLAForms
from .._paged import PAGED
from ..base import STANDARD, Backend, DecodeStep, Prepared, StageTensor
from ..frameworks.ops import RegistryVariants
from . import decode
from .chunked import chunked_attention, chunked_hidden
from .common import (
    CompiledForward,
    check_matmul_precision,
    compiled_prepared,
    jax_devices,
    jax_inputs,
    jax_params,
    jax_target,
    precision_info,
    tokens_first_axes,
    variant_provenance,
)
from .layer import (
    STAGE_NOTES,
    vmapped_pass,
)
from .mla import (  # MLA's two forms
    prepare_jax_mla,
    prepare_jax_mla_decode_run,
    prepare_jax_mla_decode_step,
    prepare_jax_mla_vjp,
)
from .paged import PAGED_LAYOUT, paged_decoders, prepare_paged_decode_step
from .vjp import canonical_param_grads, jax_vjp_prepared  # jax.vjp of this same vmapped forward


class JaxBackend(MLAForms, Backend):
    """One head unbatched, ``jax.vmap`` over heads (double vmap for GQA) and batch, ``jax.jit``."""

    name = "jax"
    convention = "one head written unbatched; jax.vmap over heads (in_axes=1) and batch; x @ W.T + b; jax.jit"
    gap_causes: ClassVar[dict[str, str]] = {
        "decode": "the timed step is not donated its cache, so every step copies it (2.1x by itself); its (B, T, Hkv, "
        "D) layout makes XLA:CPU transpose K and V every step; its `x @ w.T` projections compile to loop fusions "
        "(measured, issue 43)",
        "forward:chunked": "its key blocks run in a `lax.fori_loop`, whose iterations XLA:CPU runs one after another, "
        "so the core gains little from a second thread: 32.4 ms at one thread, 25.9 at two (1.25x), where jax-best's "
        "unchunked core goes from 29.7 to 17.2 (1.73x) (`bench --breakdown`, the reference size; issue 43)",
    }
    strategies = (STANDARD, CHUNKED, NAIVE, ABSORBED)  # the last two: MLA's (`_mla`, `mla`)
    # Every variant, forward and backward (jax.vjp of this same pass); the chunked step carries
    # them all in its online softmax (`chunked`).
    variants = RegistryVariants("jax")
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8: a static (B, T, Hkv, Dk) cache and one jitted step (`decode`), every variant.
    # The paged cache: a static page pool read by a gather inside the jitted step (`paged`).
    decode_caches = (decode.STATIC, PAGED)
    decode_layouts: ClassVar[dict[str, str]] = {**decode.DECODE_LAYOUTS, PAGED: PAGED_LAYOUT}
    paged_decode_step = True  # bench --mode decode: the paged step (its gather inside the jitted step) is timed
    ragged_decode_step = True  # and a ragged batch's step (rows left padded to the longest)
    decode_strategies = (STANDARD, *MLA_STRATEGIES)  # MLA's through its static latent cache (`mla`)

    def __init__(self, name: str | None = None, matmul_precision: str = "highest") -> None:
        super().__init__(name)
        # "highest" for comparisons; "default" shows what TF32 does to float32 on a GPU.
        self.matmul_precision = check_matmul_precision(matmul_precision)

    def devices(self) -> tuple[str, ...]:
        return jax_devices()

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str, chunk=None
    ) -> Prepared:
        if strategy in MLA_STRATEGIES:
            info = precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision)
            return prepare_jax_mla(cfg, params, inputs, dtype, device, strategy, self.matmul_precision, info)
        target = jax_target(dtype, device)
        weights = jax_params(params, dtype, target)
        x_q, x_k, x_v = jax_inputs(inputs, dtype, target)
        stage_axes, info, attend, attend_extras = tokens_first_axes(cfg), {}, None, None
        if strategy == CHUNKED:
            attend, chunk, attend_extras, skipping = chunked_attention(cfg, inputs, chunk, dtype)
            stage_axes = tokens_first_axes(cfg, chunked_hidden(cfg))
            info = {"chunk": chunk, "stages": CHUNKED_STAGES_NOTE, "tile_skipping": skipping}
        all_stages, forward, extras, key = vmapped_pass(cfg, inputs, dtype, target, attend, chunk, attend_extras)

        compiled = CompiledForward(forward, (weights, x_q, x_k, x_v, *extras), self.matmul_precision, key)

        def native_stages() -> dict[str, StageTensor]:
            stages = compiled.trace_and_run(all_stages)
            notes = dict(STAGE_NOTES)
            if cfg.rope is None:
                for name in ("q", "k"):
                    before = variant_provenance(f"{name}_rotated", cfg)[1]  # the normed heads, or the heads
                    notes[f"{name}_rotated"] = f"{before} itself: no rotary embedding (cfg.rope is None); {XLA_LAYOUT}"
            return {
                name: StageTensor(stages[name], axes, notes.get(name, XLA_LAYOUT), *variant_provenance(name, cfg))
                for name, axes in stage_axes.items()
            }

        info.update(precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision))
        info["head_vmap"] = (
            "double vmap over (Hkv, G); kv heads shared, not repeated" if cfg.group_size > 1 else "one vmap over H"
        )
        return compiled_prepared(compiled, native_stages, info)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        if strategy in MLA_STRATEGIES:
            info = precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision)
            return prepare_jax_mla_vjp(
                cfg, params, inputs, cotangent, dtype, device, strategy, self.matmul_precision, info
            )
        target = jax_target(dtype, device)
        _, forward, extras, key = vmapped_pass(cfg, inputs, dtype, target)
        primals = (jax_params(params, dtype, target), *jax_inputs(inputs, dtype, target))
        info = precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision)
        return jax_vjp_prepared(
            forward, primals, extras, cotangent, dtype, target, self.matmul_precision, canonical_param_grads, info, key
        )

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache, **paging):
        info = precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision)
        if strategy in MLA_STRATEGIES:
            return prepare_jax_mla_decode_run(cfg, params, inputs, dtype, device, strategy, self.matmul_precision, info)
        pages = paged_decoders(cfg, params, inputs, **paging) if cache == PAGED else None
        return decode.prepare_decode_run(cfg, params, inputs, dtype, device, self.matmul_precision, info, pages)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        info = precision_info(device=job.device, dtype=job.dtype, matmul_precision=self.matmul_precision)
        if job.strategy in MLA_STRATEGIES:  # one step onto the static latent cache (`mla`)
            return prepare_jax_mla_decode_step(cfg, params, job, self.matmul_precision, info)
        if job.cache == PAGED:  # the pool gathered inside the jitted step, its host half timed with it
            return prepare_paged_decode_step(cfg, params, job, self.matmul_precision, info)
        return decode.prepare_decode_step(cfg, params, job, self.matmul_precision, info)
