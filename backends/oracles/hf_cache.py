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
from mha_rosetta.core.decode import DecodeInputs, check_capacity, decode_allowed

from ..base import Backend, Prepared, PreparedDecode, StageTensor, UnsupportedCase, tensor_to_numpy

DYNAMIC, STATIC = "dynamic", "static"
FLOAT32_INSIDE = (
    "float32 inside a float64 module: eager attention's softmax (softmax(..., dtype=torch.float32)) and the "
    "rotary module's angles (inv_freq and positions in torch.float): a float64 run agrees at float32's level"
)


def family(cfg: MHAConfig) -> str:
    """The layout whose real module runs ``cfg``: Mistral's where there is a window, Llama's otherwise."""
    return "hf-llama" if cfg.window is None else "hf-mistral"


def config_reason(cfg: MHAConfig) -> str | None:
    """Why neither module can hold ``cfg`` (the layout's own reason, naming the module), or None."""
    from mha_rosetta.models import get_layout

    if not cfg.causal:
        return "LlamaAttention / MistralAttention are causal decoder layers (is_causal=True), got causal=False"
    if cfg.kdim != cfg.d_model or cfg.vdim != cfg.d_model:
        return f"{family(cfg)}: self-attention only (kdim = vdim = d_model), got kdim={cfg.kdim}, vdim={cfg.vdim}"
    reason = get_layout(family(cfg)).unsupported_reason(cfg)
    if reason is None and cfg.d_model % cfg.n_heads:
        reason = (
            f"transformers' config checks hidden_size % num_attention_heads == 0 (validate_architecture) even with "
            f"an explicit head_dim, and d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}"
        )
    return None if reason is None else f"{family(cfg)}: {reason}"


def build_module(cfg: MHAConfig, params: MHAParams, dtype: str):
    """The real module for ``cfg`` loaded with ``params`` (in ``dtype``), its config and its rotary module.

    The module is built by the layout's own factory (`models._hf_decoder.Decoder.build`: Llama's, or
    Mistral's with a window), with the eager attention, Hugging Face's reference path (it returns the weights).
    """
    import torch
    from huggingface_hub.errors import StrictDataclassError  # the configs' own validation (transformers 5.x)

    from mha_rosetta.models import hf_llama, hf_mistral, to_module
    from mha_rosetta.models._real import RunOptions

    decoder = hf_llama.DECODER if cfg.window is None else hf_mistral.DECODER
    try:
        module = decoder.build(cfg, RunOptions(implementation="eager"))
    except (ValueError, StrictDataclassError) as error:
        why = f"{family(cfg)}: transformers' {decoder.config_class} refuses {cfg.describe()}: {error}"
        raise UnsupportedCase(why) from error
    module = to_module(cfg, params, module)  # the layout's converter; refuses a module built for another cfg
    torch_dtype = getattr(torch, dtype)
    module = module.to(torch_dtype).requires_grad_(False)
    rotary = decoder.rotary(module.config)  # its forward computes the angles in float32 and returns x's dtype
    return module, module.config, rotary


def mask_function(cfg: MHAConfig):
    """The model's own mask function, as ``MistralModel.forward`` picks it."""
    from transformers import masking_utils

    return masking_utils.create_causal_mask if cfg.window is None else masking_utils.create_sliding_window_causal_mask


def positions_reason(inputs: DecodeInputs) -> str | None:
    """Why Hugging Face's index-based masks would differ from the spec's rule on these positions, or None."""
    valid = inputs.valid
    for b in range(inputs.batch):
        real = inputs.positions[b, valid[b]]
        if np.any(np.diff(real) <= 0):
            return (
                "hf-attention: the model's mask functions are causal on cache indices, which equals the rule on "
                f"positions only where the real tokens' positions increase strictly; item {b}'s do not"
            )
    return None


def empty_rows(cfg: MHAConfig, inputs: DecodeInputs) -> np.ndarray:
    """(B, N) bool: tokens whose query may attend to no key under the spec's rule (left pads)."""
    p = inputs.positions
    return ~decode_allowed(cfg, p, p, inputs.valid)[:, 0].any(axis=-1)  # (B, 1, N, N) -> (B, N)


class HFAttentionOracle(Backend):
    """``LlamaAttention`` / ``MistralAttention`` (eager) through ``DynamicCache`` / ``StaticCache``, as generate."""

    convention = (
        "transformers LlamaAttention / MistralAttention (eager) driven as generate does: the model's rotary "
        "module, its mask function, DynamicCache or StaticCache (B, Hkv, T, Dk)"
    )
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
    def _prepare_decode_run(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        inputs: DecodeInputs,
        dtype: str,
        device: str,
        strategy: str,
        cache: str,
    ) -> PreparedDecode:
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

    def _prepare_decode_step(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        *,
        batch: int,
        context: int,
        step: int,
        dtype: str,
        device: str,
        strategy: str,
        cache: str,
        seed: int,
    ) -> Prepared:
        import torch

        driver = Driver(cfg, params, dtype)
        rng = np.random.default_rng(seed)
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


class Driver:
    """One real module, its config and rotary module, called as ``MistralModel.forward`` calls its layers."""

    def __init__(self, cfg: MHAConfig, params: MHAParams, dtype: str) -> None:
        import torch

        self.cfg = cfg
        self.params = params
        self.module, self.config, self.rotary = build_module(cfg, params, dtype)
        self.torch_dtype = getattr(torch, dtype)

    def new_cache(self, kind: str, capacity: int):
        """The library's cache for the model's config: its sliding layers where the config has a window."""
        from transformers import DynamicCache, StaticCache

        if kind == DYNAMIC:
            return DynamicCache(config=self.config)
        return StaticCache(config=self.config, max_cache_len=capacity)  # a sliding layer takes min(W, capacity)

    def call(self, kv, chunk, position_ids, pad):
        """One call of the layer on ``chunk`` (B, s, D) at ``position_ids`` (B, s), as the model makes it.

        ``pad``: the 2-D padding mask (B, tokens seen so far, this call's included), 1 = real, or None.
        Returns the module's (output (B, s, D), weights (B, H, s, slots read)).
        """
        mask4d = mask_function(self.cfg)(
            config=self.config, inputs_embeds=chunk, attention_mask=pad, cache=kv, position_ids=position_ids
        )
        cos_sin = self.rotary(chunk, position_ids)  # the model's rotary module: (B, s, Dk) each, float32 angles
        return self.module(chunk, position_embeddings=cos_sin, attention_mask=mask4d, cache=kv)

    def decode(
        self,
        inputs: DecodeInputs,
        kind: str,
        *,
        capacity: int | None = None,
        record: dict | None = None,
        stages: list | None = None,
    ):
        """The prefill, then every step through a fresh cache of ``kind``: every token's output (B, N, D).

        ``capacity``: a static cache's ``max_cache_len`` (default N, which run_decode never exceeds); a write
        past it is `CacheFull` before the library's ``index_copy_`` sees it. ``record`` gets the key slots each
        call read, the stored slots and the bytes; ``stages`` (a list) gets each chunk's recorded stage tensors
        (`StageRecording`).
        """
        import torch

        x = torch.from_numpy(inputs.x).to(self.torch_dtype)  # (B, N, D), a copy
        positions = torch.from_numpy(inputs.positions)  # (B, N) int64, a view
        pad = None if inputs.mask is None else torch.from_numpy(inputs.mask.astype(np.int64))  # (B, N), 1 = real
        capacity = inputs.tokens if capacity is None else capacity
        kv = self.new_cache(kind, capacity)
        outputs, read = [], []
        with torch.no_grad():
            for start, stop in inputs.chunks():
                if kind == STATIC and self.cfg.window is None:
                    check_capacity(capacity, start, stop - start)  # a write past max_cache_len: CacheFull
                args = (kv, x[:, start:stop], positions[:, start:stop], None if pad is None else pad[:, :stop])
                if stages is None:
                    output, weights = self.call(*args)
                else:
                    with StageRecording(self, kv) as recording:
                        output, weights = self.call(*args)
                    stages.append(recording.stages(self.cfg, output))
                outputs.append(output)
                read.append(weights.shape[-1])  # (B, H, s, slots read): the keys this call attended over
        if record is not None:
            layer = kv.layers[0]
            record.update(read=read, stored=layer.keys.shape[-2], bytes=layer.keys.nbytes + layer.values.nbytes)
        return torch.cat(outputs, dim=1)  # (B, N, D), a copy


RECORDED = "mha-rosetta-eager-recorded"  # the eager attention, registered under this name, which also records
_RECORDINGS: list[dict] = []  # the recording in progress (StageRecording), innermost last


def _register_recorded() -> None:
    """Register ``RECORDED`` in transformers' attention and mask interfaces, once (additive: a new name only).

    It is the family's own ``eager_attention_forward`` and ``eager_mask``; it also keeps the rotated queries it
    was given and the context it returned, which the module never exposes.
    """
    import sys

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if RECORDED in AttentionInterface._global_mapping:
        return

    def recorded(module, query, key, value, attention_mask, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward  # the family's own
        output, weights = eager(module, query, key, value, attention_mask, **kwargs)
        if _RECORDINGS:
            _RECORDINGS[-1].update(q_rotated=query, context=output)  # (B, H, s, Dk), (B, s, H, Dv)
        return output, weights

    AttentionInterface.register(RECORDED, recorded)
    AttentionMaskInterface.register(RECORDED, eager_mask)


class StageRecording:
    """For one call: the module switched to ``RECORDED``, hooks on its linears and the cache's ``update`` wrapped."""

    def __init__(self, driver: Driver, kv) -> None:
        self.driver, self.kv = driver, kv
        self.seen: dict = {}

    def __enter__(self):
        _register_recorded()
        module, seen = self.driver.module, self.seen
        self.before = self.driver.config._attn_implementation
        self.driver.config._attn_implementation = RECORDED
        keep = lambda name: lambda _module, _args, output: seen.__setitem__(name, output)  # noqa: E731
        self.hooks = [
            module.q_proj.register_forward_hook(keep("q")),
            module.k_proj.register_forward_hook(keep("k")),
            module.v_proj.register_forward_hook(keep("v")),
            module.o_proj.register_forward_pre_hook(lambda _module, args: seen.__setitem__("merged", args[0])),
        ]
        update = self.kv.update

        def recorded_update(key_states, value_states, *args, **kwargs):
            seen.update(k_rotated=key_states, v_written=value_states)  # the new keys, as written to the cache
            return update(key_states, value_states, *args, **kwargs)

        self.kv.update = recorded_update  # this cache object only
        _RECORDINGS.append(seen)
        return self

    def __exit__(self, *exc) -> None:
        _RECORDINGS.remove(self.seen)
        del self.kv.update  # the class's method again
        for hook in self.hooks:
            hook.remove()
        self.driver.config._attn_implementation = self.before

    def stages(self, cfg: MHAConfig, output) -> dict[str, StageTensor]:
        """The chunk's stage tensors as the library held them (the chunk's tokens on the token axis)."""
        seen, d = self.seen, cfg.d_k
        B, s = output.shape[:2]
        head_split = "view(B, s, -1, head_dim).transpose(1, 2), as the module splits them"

        def heads(name):  # (B, s, G*d) -> (B, G, s, d), a view: the module's own split
            return seen[name].view(B, s, -1, d).transpose(1, 2)

        return {
            "q": StageTensor(seen["q"], ("B", "Nq", "H*Dk"), "q_proj's output (forward hook)"),
            "k": StageTensor(seen["k"], ("B", "Nk", "Hkv*Dk"), "k_proj's output (forward hook)"),
            "v": StageTensor(seen["v"], ("B", "Nk", "Hkv*Dv"), "v_proj's output (forward hook)"),
            "q_heads": StageTensor(heads("q"), ("B", "H", "Nq", "Dk"), head_split, "view", "q"),
            "k_heads": StageTensor(heads("k"), ("B", "Hkv", "Nk", "Dk"), head_split, "view", "k"),
            "v_heads": StageTensor(seen["v_written"], ("B", "Hkv", "Nk", "Dv"), "the values cache.update was given"),
            "q_rotated": StageTensor(
                seen["q_rotated"],
                ("B", "H", "Nq", "Dk"),
                "the queries the attention function was given",
                "new",
                "q_heads",
            ),
            "k_rotated": StageTensor(
                seen["k_rotated"], ("B", "Hkv", "Nk", "Dk"), "the new keys cache.update was given", "new", "k_heads"
            ),
            "context": StageTensor(seen["context"], ("B", "Nq", "H", "Dv"), "the attention function's output"),
            "merged": StageTensor(seen["merged"], ("B", "Nq", "H*Dv"), "o_proj's input (forward pre-hook)"),
            "output": StageTensor(output, ("B", "Nq", "D"), "the module's output"),
        }
