"""A third-party decode oracle: Hugging Face's own attention modules driven through their own KV caches.

``hf-attention`` builds the real ``transformers`` module of the configuration from a tiny config object
(nothing is downloaded): ``LlamaAttention`` without a window, ``MistralAttention`` with one, loaded with the
canonical parameters by `mha_rosetta.models.to_module` (the ``hf-llama`` / ``hf-mistral`` layouts, which
also check that the module read back is ``cfg``). `run_decode` drives it as ``generate`` drives a model,
the way ``MistralModel.forward`` does for each call:

* a cache built from the model's config: ``DynamicCache(config=...)`` (cache kind "dynamic") or
  ``StaticCache(config=..., max_cache_len=N)`` ("static"). With Mistral's ``sliding_window`` the library
  itself picks its sliding layers (``DynamicSlidingWindowLayer``, ``StaticSlidingWindowLayer``): the ring
  buffer is the library's, not ours;
* ``position_ids`` of the call's tokens, and the rotary ``position_embeddings`` from the model's own rotary
  module (``LlamaRotaryEmbedding`` / ``MistralRotaryEmbedding``, its float32 angles);
* the 4-D mask from the model's own mask function (``create_causal_mask``, or
  ``create_sliding_window_causal_mask`` with a window) given the 2-D padding mask of every token seen so far
  and the cache, which says the query offset and the key length (transformers 5.x has no ``cache_position``:
  the mask and ``StaticLayer`` read the write offset from the cache);
* then the module itself: ``module(x, position_embeddings=..., attention_mask=..., cache=cache)``, with the
  eager attention (Hugging Face's reference path, which also returns the weights whose last axis is the
  number of key slots the call read: `info["cache"]["slots"]` is measured there).

Design rules:

* What the modules cannot express is `UnsupportedCase` with the layout's own reason (`Layout.unsupported_reason`:
  ``rope='half'`` over every feature, bias on all four layers or none (Llama) or none (Mistral), no softcap,
  sinks, ALiBi or QK-norm). ``decode_variants`` is exactly what runs: the window (Mistral) and
  ``rope_scaling`` (Llama's ``config.rope_parameters``).
* The masks are Hugging Face's, on cache indices: equal to the spec's rule on positions when the real
  tokens' positions increase strictly (always true of ``arange`` and of ``cumsum(mask) - 1`` with left
  padding); other positions are refused with the reason, never run under the other rule.
* The float32 inside a float64 module (eager's softmax, the rotary angles) is declared, and a float64 run's
  ``info`` names the tolerance that holds it (``tolerance_dtype``: "float32"), as `models` runs do
  (``RealRun.precision``): the decode check compares such a run under ``core.tolerance_for(info["tolerance_dtype"])``
  and calls the gap to float64's a known difference, as the gradient check does for a declared
  ``half_precision_softmax``. The forward (`_prepare`, the full causal forward through the same module) is
  offered in float32 only for that reason: the forward check holds float64 runs to float64's tolerance.
* A query row with no allowed key (a left pad) is a uniform average in eager (its additive mask is the
  dtype's minimum, not -inf); the decode run maps such rows to the spec's answer (zero weights: output =
  b_o) and counts them in ``info["empty_rows_mapped"]``; the forward passes them through for the check's
  empty-row rule.
* The step stages are the library's tensors: forward hooks on the four linears (q, k, v, merged), the new
  keys and values the module hands ``cache.update`` (k_rotated, v_heads) and, for the rotated queries and
  the context, the family's own ``eager_attention_forward`` registered once in transformers' attention and
  mask interfaces under a name of this project's (``RECORDED``: additive, the library's own names untouched).
* The bench's step (`prepare_decode`): the prefill of ``context`` random tokens fills the cache once; each
  timed call is one step (its mask, rotary and the module), after which a growing cache is cut back with the
  layer's own ``crop``; a full ring stays full, so the step's cost does not drift.

transformers and torch are imported inside the methods (base rule 4).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from ..base import Backend, DecodeStep, Prepared, PreparedDecode, StageTensor, UnsupportedCase, tensor_to_numpy
from .hf_driver import DYNAMIC, STATIC, Driver, build_module, config_reason, empty_rows, mask_function, positions_reason

FLOAT32_INSIDE = (
    "float32 inside a float64 module: eager attention's softmax (softmax(..., dtype=torch.float32)) and the "
    "rotary module's angles (inv_freq and positions in torch.float): a float64 run agrees at float32's level"
)


class HFAttentionOracle(Backend):
    """``LlamaAttention`` / ``MistralAttention`` (eager) through ``DynamicCache`` / ``StaticCache``, as generate."""

    convention = (
        "transformers LlamaAttention / MistralAttention (eager) driven as generate does: the model's rotary "
        "module, its mask function, DynamicCache or StaticCache (B, Hkv, T, Dk)"
    )
    gap_causes: ClassVar[dict[str, str]] = {
        "decode": "the bench takes its default `dynamic` cache, whose DynamicLayer `torch.cat`s all of K and V every "
        "step, and the eager attention's `repeat_kv` copies K and V out to every query head (4x the cache at 16 "
        "heads over 4) before its two matmuls (transformers 5.25's code; torch's profiler sees both copies grow "
        "with the context; not timed apart)",
    }
    dtypes = ("float64", "float32")
    variants = frozenset({"window", "rope_scaling"})
    causal_on_positions = False  # the forward's mask is create_causal_mask's, on indices (rule 7)
    decode_caches = (DYNAMIC, STATIC)
    decode_layouts: ClassVar[dict[str, str]] = {
        DYNAMIC: "(B, Hkv, T, Dk) grown with torch.cat (DynamicLayer); with a window DynamicSlidingWindowLayer "
        "keeps the last W - 1 and a call reads W - 1 + step",
        STATIC: "(B, Hkv, max_cache_len, Dk) preallocated, written with index_copy_ at the cache's cumulative "
        "length (StaticLayer); with a window StaticSlidingWindowLayer holds W slots, rolled by one per token",
    }
    known_differences = (
        FLOAT32_INSIDE + "; info['tolerance_dtype'] = 'float32' says the tolerance that holds it (the forward is "
        "offered in float32 only)",
        "the causal and window masks (create_causal_mask, create_sliding_window_causal_mask) are on cache indices, "
        "with the query offset read from the cache: the spec's rule on positions where real positions increase "
        "strictly, refused otherwise",
        "a query row with no allowed key (a left pad): eager's additive mask is the dtype's minimum, not -inf, so "
        "the row is a uniform average of the values; decoding maps it to the spec's (output = b_o) and counts it "
        "in info['empty_rows_mapped']",
        "left pads at position -1 (cumsum(mask) - 1); generate puts 1 there (masked_fill(attention_mask == 0, 1)): "
        "only the pad's own rotary differs, and nothing reads it (its key is masked, its row empty)",
        "the positions' rotary tables come from the model's rotary module (float32 angles), not the spec's",
        "without a cache and a 2-D mask, the mask functions read position_ids that do not advance by one as "
        "packed sequences (find_packed_sequence_indices) and block attention across them: the forward builds "
        "its mask from the indices alone",
    )

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        reason = super().unsupported_reason(cfg, dtype, device, strategy) or config_reason(cfg)
        if reason is None and dtype != "float32":
            reason = (
                f"{self.name}'s forward runs in float32 only: {FLOAT32_INSIDE}, and the forward check holds a "
                f"{dtype} run to {dtype}'s tolerance (run_decode takes float64, at float32's level)"
            )
        return reason

    def decode_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str, cache: str | None) -> str | None:
        return super().decode_reason(cfg, dtype, device, strategy, cache) or config_reason(cfg)

    def _info(self, dtype: str) -> dict:
        info = {"attention": "eager", "precision": "float32" if dtype == "float64" else dtype}
        if dtype == "float64":
            info.update(tolerance_dtype="float32", note=FLOAT32_INSIDE)
        return info

    # -- the forward: the full causal forward through the same module (no cache) ---------------
    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        import torch

        same = inputs.key is inputs.query or (
            inputs.key.shape == inputs.query.shape
            and np.array_equal(inputs.key, inputs.query)
            and np.array_equal(inputs.value, inputs.query)
        )
        if not same or not np.array_equal(inputs.positions, inputs.kv_positions):
            raise UnsupportedCase(f"{self.name}: a decoder layer attends to its own tokens (self-attention only)")
        padding = None
        if inputs.mask is not None:
            mask = inputs.mask  # (1|B, 1|H, 1|Nq, Nk) bool
            if not np.array_equal(mask, np.broadcast_to(mask[:, :1, :1, :], mask.shape)):
                raise UnsupportedCase(
                    f"{self.name}: the model takes a 2-D padding mask (batch, tokens) only, got a mask of shape "
                    f"{mask.shape} that differs between heads or queries"
                )
            padding = np.broadcast_to(mask[:, 0, 0, :], (inputs.batch, inputs.kv_tokens))  # (B, N), a view
        module, config, rotary = build_module(cfg, params, dtype)
        torch_dtype = getattr(torch, dtype)
        x = torch.from_numpy(inputs.query).to(torch_dtype)  # (B, N, D), a copy
        position_ids = torch.from_numpy(np.broadcast_to(inputs.positions, inputs.query.shape[:2]).copy())  # (B, N)
        pad = None if padding is None else torch.from_numpy(padding.astype(np.int64))  # (B, N), 1 = real

        def call():
            with torch.no_grad():
                # No position_ids for the mask: without a cache and a 2-D mask it would read positions that
                # do not advance by one as packed sequences; rule 7 already refused positions off the indices.
                mask4d = mask_function(cfg)(config=config, inputs_embeds=x, attention_mask=pad, cache=None)
                return module(x, position_embeddings=rotary(x, position_ids), attention_mask=mask4d)

        def native_stages():
            output, weights = call()
            return {
                "weights": StageTensor(weights, ("B", "H", "Nq", "Nk"), "eager_attention_forward's weights"),
                "output": StageTensor(output, ("B", "Nq", "D"), "the module's output"),
            }

        return Prepared(lambda: call()[0], tensor_to_numpy, native_stages, info=self._info(dtype))

    # -- decoding through the library's own cache ------------------------------------------------
    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache) -> PreparedDecode:
        if reason := positions_reason(inputs):
            raise UnsupportedCase(reason)
        driver = Driver(cfg, params, dtype)
        empty = empty_rows(cfg, inputs)  # (B, N)
        record: dict = {}

        def run():
            return driver.decode(inputs, cache, record=record)

        def to_numpy(result) -> np.ndarray:
            output = tensor_to_numpy(result).astype(np.float64)  # (B, N, D), a copy
            output[empty] = np.zeros(cfg.d_model) if params.b_o is None else params.b_o  # the spec's empty row
            return output

        def step_stages():
            stages: list[dict] = []
            driver.decode(inputs, cache, stages=stages)
            return stages

        run()  # once, untimed, so that info measures the cache the library really built
        read = record["read"]
        cache_info = {
            "kind": cache,
            "layout": self.decode_layouts[cache],
            # the most key slots a step's attention read (the prefill's when there is no step), measured on the
            # weights: W - 1 + step with a window, whichever layer holds the ring
            "slots": max(read[1:]) if len(read) > 1 else read[0],
            "stored_slots": record["stored"],  # what the cache's tensors hold between calls
            "bytes": record["bytes"],  # K and V together, as allocated
        }
        info = {**self._info(dtype), "cache": cache_info, "empty_rows_mapped": int(empty.sum())}
        return PreparedDecode(run, to_numpy, step_stages=step_stages, info=info)

    def _prepare_decode_step(self, cfg: MHAConfig, params: MHAParams, job: DecodeStep) -> Prepared:
        import torch

        batch, context, step, dtype, cache = job.batch, job.context, job.step, job.dtype, job.cache
        driver = Driver(cfg, params, dtype)
        rng = np.random.default_rng(job.seed)
        x = torch.from_numpy(rng.standard_normal((batch, context + step, cfg.d_model))).to(driver.torch_dtype)
        positions = torch.arange(context + step).expand(batch, -1)  # (B, context + step), a view
        capacity = context + step
        kv = driver.new_cache(cache, capacity)
        # The prefill: the cache holds context real tokens of random numbers (a window's ring full), fed in
        # blocks of PREFILL_BLOCK so that eager attention's scores stay (B, H, block, context), not
        # (B, H, context, context): one 16k-token call was killed for memory on this 24 GiB machine.
        with torch.no_grad():
            for start in range(0, context, PREFILL_BLOCK):
                stop = min(start + PREFILL_BLOCK, context)
                driver.call(kv, x[:, start:stop], positions[:, start:stop], None)
        new, new_positions = x[:, context:], positions[:, context:]  # (B, step, D), (B, step): views
        # a cache that grows is cut back after each step (a ring not yet full too); a full ring stays full
        refill = cfg.window is None or context + step < cfg.window

        def step_call():
            with torch.no_grad():
                output, weights = driver.call(kv, new, new_positions, None)
            if refill:
                kv.layers[0].crop(-step)  # back to context tokens (DynamicLayer: a slice; StaticLayer: the length)
            return output, weights

        def forward():
            return step_call()[0]

        read = step_call()[1].shape[-1]  # once, untimed: the key slots a step reads, measured on the weights
        layer = kv.layers[0]
        info = {
            **self._info(dtype),
            "cache": {
                "kind": cache,
                "layout": self.decode_layouts[cache],
                "slots": read,
                "stored_slots": layer.keys.shape[-2],
                "bytes": layer.keys.nbytes + layer.values.nbytes,
            },
        }
        return Prepared(
            forward, tensor_to_numpy, lambda: {"output": StageTensor(forward(), ("B", "Nq", "D"))}, info=info
        )


PREFILL_BLOCK = 1024  # tokens per call when the benchmark's step fills its cache
