"""The NumPy adapter: `NumpyBackend`, the column-sample layer of `layer` behind the `Backend` interface.

`layer` says what the column-sample convention is and shows (its docstring); this module
only picks a strategy, wires `chunked` and `vjp` in, and fills `Prepared.info`.
"""

from __future__ import annotations

from typing import ClassVar

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from .._chunking import CHUNKED, CHUNKED_STAGES_NOTE
from .._mla import ABSORBED, MLA_STRATEGIES, NAIVE, MLAForms
from .._recording import record_stages
from ..base import DIRECT_RESHAPE, PER_HEAD, SLICING, STANDARD, Backend, DecodeStep, Prepared
from ..frameworks.ops import RegistryVariants
from .chunked import ChunkedColumnSampleMHA
from .common import NumpyPrecision
from .decode import CACHE_KINDS, CACHE_LAYOUTS, prepare_numpy_decode_run, prepare_numpy_decode_step
from .heads import columns_to_rows
from .layer import ColumnSampleMHA
from .mla import prepare_numpy_mla  # MLA's naive and absorbed forms, column samples
from .mla_decode import prepare_numpy_mla_decode_run, prepare_numpy_mla_decode_step
from .mla_vjp import prepare_numpy_mla_vjp
from .vjp import prepare_numpy_vjp  # the hand-written column-sample backward


class NumpyBackend(MLAForms, Backend):
    name = "numpy"
    convention = (
        "column samples: X (features, tokens), Y = W @ X + b, rows of W are scorers; heads split (H, Dk, N) by reshape"
    )
    gap_causes: ClassVar[dict[str, str]] = {
        "decode": "its GQA broadcast runs one GEMV per query head (16 at 16 heads over 4 kv heads), so each query head "
        "re-reads its kv head, where numpy-best's grouped GEMM reads each once (measured, issue 43)",
        "forward:per_head": "its projections are one thin product per head (the head's (64, 512) W_h^T over each "
        "item's (512, N) columns): 7.2-7.7 ms a weight against 5.4-5.8 for the whole (512, 512) weight in one "
        "product, about 5.5 ms over q, k and v at the reference size (one thread, OpenBLAS; two runs; issue 43)",
    }
    strategies = (STANDARD, PER_HEAD, SLICING, DIRECT_RESHAPE, CHUNKED, NAIVE, ABSORBED)  # the last two: MLA's (`_mla`)
    # Every variant, in every strategy, the chunked one included (`variants` says how each is laid out in
    # column samples; `_chunking` how the tiles carry them). The hand-written backward has them all too.
    variants = RegistryVariants("numpy")
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8: keys stay columns, (B, Hkv, Dk, T); every variant (`decode` reuses the layer's pieces).
    decode_caches = CACHE_KINDS
    decode_layouts = CACHE_LAYOUTS
    decode_strategies = (STANDARD, *MLA_STRATEGIES)  # MLA's through its latent cache (`mla_decode`)
    paged_decode_step = True  # bench --mode decode times the paged step beside the contiguous one (its gather)
    ragged_decode_step = True  # and a ragged batch's step (rows left padded to the longest)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str, chunk=None
    ) -> Prepared:
        precision = NumpyPrecision.for_dtype(dtype)
        if strategy in MLA_STRATEGIES:
            return prepare_numpy_mla(cfg, params, inputs, precision, strategy)
        if strategy == CHUNKED:
            layer = ChunkedColumnSampleMHA(cfg, params, inputs, precision, chunk)
        else:
            layer = ColumnSampleMHA(cfg, params, inputs, precision, batched=strategy in (STANDARD, DIRECT_RESHAPE))
        run = getattr(layer, strategy)  # each strategy is the layer's method of that name

        info = {
            "layout": "column samples (B, features, tokens); scores (B, H, Nk, Nq), one column per query",
            "strategy": strategy,
            "workspace": "one score buffer reused by every call" if layer.workspace is not None else None,
            **layer.precision.info(),
        }
        if strategy == CHUNKED:
            info.update(chunk=layer.chunk, stages=CHUNKED_STAGES_NOTE, tiles=layer.plan.counts)
        return Prepared(forward=run, to_numpy=columns_to_rows, native_stages=lambda: record_stages(run), info=info)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        precision = NumpyPrecision.for_dtype(dtype)
        if strategy in MLA_STRATEGIES:
            return prepare_numpy_mla_vjp(cfg, params, inputs, cotangent, precision, strategy)
        return prepare_numpy_vjp(ColumnSampleMHA, cfg, params, inputs, cotangent, precision, strategy)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache, **paging):
        if strategy in MLA_STRATEGIES:
            return prepare_numpy_mla_decode_run(cfg, params, inputs, dtype, strategy)
        return prepare_numpy_decode_run(cfg, params, inputs, dtype, cache, **paging)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        if job.strategy in MLA_STRATEGIES:
            return prepare_numpy_mla_decode_step(cfg, params, job)  # one step onto a latent cache (`mla_decode`)
        return prepare_numpy_decode_step(cfg, params, job)
