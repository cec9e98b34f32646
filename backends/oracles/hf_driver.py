"""The ``hf-attention`` oracle's driver (`backends.oracles.hf_cache`): which real ``transformers`` module runs
a configuration, built from a tiny config with the canonical parameters, called as ``MistralModel.forward``
calls its layers through the library's own caches, and its stage tensors recorded by an attention function
registered beside the eager one (`hf_cache` re-exports what it used to hold)."""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.decode import DecodeInputs, check_capacity, decode_allowed

from ..base import StageTensor, UnsupportedCase

DYNAMIC, STATIC = "dynamic", "static"


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
