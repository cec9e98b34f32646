"""The PyTorch adapter: `TorchBackend`, the row-sample layer of `layer` behind the `Backend` interface.

`layer` says what the row-sample convention is and shows (its docstring); this module picks a
strategy, wires `chunked`, `vjp` and `decode` (KV-cache decoding, Hugging Face's cache layout,
dynamic and static) in, sets the matmul precision and fills `Prepared.info`.
"""

from __future__ import annotations

from typing import ClassVar

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from .._chunking import CHUNKED, CHUNKED_STAGES_NOTE
from .._mla import ABSORBED, MLA_STRATEGIES, NAIVE, MLAForms
from ..base import DIRECT_RESHAPE, PER_HEAD, SLICING, STANDARD, Backend, DecodeStep, Prepared
from ..frameworks.ops import RegistryVariants
from .chunked import ChunkedRowSampleMHA
from .common import TorchDevices, inference_run, precision_info, recorded_prepared
from .decode import DECODE_CACHES, DECODE_LAYOUTS, prepare_torch_decode_run, prepare_torch_decode_step
from .layer import RowSampleMHA
from .mla import (  # MLA's two forms
    prepare_torch_mla,
    prepare_torch_mla_decode_run,
    prepare_torch_mla_decode_step,
    prepare_torch_mla_vjp,
)
from .vjp import prepare_row_sample_vjp  # autograd through this same nn.Linear path


class TorchBackend(MLAForms, TorchDevices, Backend):
    name = "torch"
    convention = (
        "row samples: x (tokens, features), F.linear(x, W, b) = x @ W.T + b; heads by view(B, N, H, Dk).transpose(1, 2)"
    )
    gap_causes: ClassVar[dict[str, str]] = {
        "decode": "the bench takes its default `dynamic` cache, which `torch.cat`s all of K and V every step (its own "
        "`static` cache, written in place, is not what the bench times; measured, issue 43)",
        "forward:chunked": "the chunked strategy is memory-linear: at its default blocks of 128 queries and 256 keys "
        "it walks (N/128)(N/256) tiles from Python (8 at N=512), each with its own two bmm calls and the online "
        "softmax's rescaling, where torch-best's SDPA is one fused call (read in the code; not timed apart)",
        "forward": "it writes attention as the spec's steps, `baddbmm` scores and a separate softmax, each a (B*H, "
        "N, N) array (32 MiB at the reference size), and copies its split heads contiguous (8 `aten::copy_` a call "
        "against torch-best's 4), where torch-best's SDPA is the fused CPU flash kernel, which never holds the "
        "scores (torch 2.13's profiler, one thread; not timed apart)",
        "forward:per_head": "one head at a time: 24 `aten::mm` for the heads' q, k and v slices and 8 rounds of "
        "scores, softmax and context on (B, N, N) arrays, where torch-best makes 4 `addmm` and one fused SDPA call "
        "(torch 2.13's profiler, one thread; not timed apart)",
    }
    strategies = (STANDARD, PER_HEAD, SLICING, DIRECT_RESHAPE, CHUNKED, NAIVE, ABSORBED)  # the last two: MLA's (`_mla`)
    # Every variant, in every strategy (chunked included: window tiles skipped, the score steps on each tile,
    # the sinks in the online softmax), forward and backward (autograd; chunked is forward only).
    variants = RegistryVariants("torch")
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8 (`decode`): Hugging Face's (B, Hkv, T, D) cache, growing or static, a ring with a window; every variant.
    decode_caches = DECODE_CACHES
    decode_layouts = DECODE_LAYOUTS
    paged_decode_step = True  # bench --mode decode times the paged step (vLLM's gather) beside the contiguous one
    ragged_decode_step = True  # and a ragged batch's step (rows left padded to the longest)
    decode_strategies = (STANDARD, *MLA_STRATEGIES)  # MLA's through its latent cache (`mla`)

    def __init__(self, name: str | None = None, allow_tf32: bool = False) -> None:
        super().__init__(name)
        self.allow_tf32 = bool(allow_tf32)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str, chunk=None
    ) -> Prepared:
        if strategy in MLA_STRATEGIES:
            return prepare_torch_mla(cfg, params, inputs, dtype, device, strategy, self.allow_tf32)
        if strategy == CHUNKED:
            layer = ChunkedRowSampleMHA(cfg, params, inputs, dtype, device, chunk)
        else:
            layer = RowSampleMHA(cfg, params, inputs, dtype, device, batched=strategy in (STANDARD, DIRECT_RESHAPE))
        method = getattr(layer, strategy)  # each strategy is the layer's method of that name
        run = inference_run(method, device, self.allow_tf32)

        info = {
            "layout": "row samples (B, tokens, features)",
            "strategy": strategy,
            "torch_dtype": dtype,
            "device": str(layer.x_q.device),
            "gqa": "query heads of a group folded into the token axis (no repeat_interleave)",
            "workspace": "score and weight buffers reused by every call" if layer.scores_buffer is not None else None,
            **precision_info(device=device, dtype=dtype, allow_tf32=self.allow_tf32),
        }
        if strategy == CHUNKED:
            info.update(chunk=layer.chunk, stages=CHUNKED_STAGES_NOTE)
            if cfg.window is not None or inputs.mask is not None:
                run(None)  # once, untimed: how many key tiles the window and the mask let it skip
                info.update(tiles_visited=layer.tiles_visited, tiles_skipped=layer.tiles_skipped)
        return recorded_prepared(run, device, info)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        if strategy in MLA_STRATEGIES:
            return prepare_torch_mla_vjp(cfg, params, inputs, cotangent, dtype, device, strategy, self.allow_tf32)
        layer = RowSampleMHA(cfg, params, inputs, dtype, device, batched=False)  # no out= buffers under autograd
        return prepare_row_sample_vjp(layer, strategy, cotangent, dtype, device, self.allow_tf32)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache, capacity=None, **paging):
        """``capacity``: a static cache's slots (no window), default the run's tokens; a smaller one is how the
        tests reach `CacheFull` (``prepare_decode_run`` always passes the default). ``paging``: the paged cache's
        ``page_size`` and ``page_seed``."""
        if strategy in MLA_STRATEGIES:
            return prepare_torch_mla_decode_run(cfg, params, inputs, dtype, device, strategy, self.allow_tf32)
        return prepare_torch_decode_run(cfg, params, inputs, dtype, device, cache, self.allow_tf32, capacity, **paging)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        if job.strategy in MLA_STRATEGIES:
            return prepare_torch_mla_decode_step(cfg, params, job, self.allow_tf32)  # onto a latent cache (`mla`)
        return prepare_torch_decode_step(cfg, params, job, self.allow_tf32)
