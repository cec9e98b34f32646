"""The torch SDPA oracle's decoding: its own growing cache and ``F.scaled_dot_product_attention`` per chunk.

Design rules (the contract is `core.decode`'s):

* The cache is Hugging Face's ``DynamicCache`` layout, ``(B, Hkv, T, Dk)`` and ``(B, Hkv, T, Dv)``,
  grown with ``torch.cat`` on T every call; keys go in after QK-norm and rotary (the
  oracle's own model code, `projected_heads_pass`) with Hkv heads, which ``enable_gqa=True``
  reads for the G query heads of each.
* It keeps every token, a window included: the window is in the mask. It is an oracle, so
  its cache is the plainest one there is, and a bug in the implementations' rings shows
  against it.
* Each chunk's mask is chosen at prepare time from its allowed pattern (`core.inputs.
  allowed_positions` on the chunk's positions over the cached ones): none when every cached
  key is visible (one query at the end of the cache, no window, no padding);
  ``torch.nn.attention.bias.causal_lower_right(s, T)`` when the pattern is the bottom-right
  causal rule on indices and nothing else; an explicit boolean (B, 1, s, T) mask otherwise,
  and a float one (the bias, -inf where blocked) with ALiBi or T5's bias. ``is_causal=True``
  is never used: it is top-left, so on a step of s > 1 queries over T > s cached keys query
  i would see keys j <= i only (flax #5591's bug).
* Rotary tables are the whole run's, made once at prepare and sliced per chunk (a dynamic
  rope scaling reads the run's length, as the full forward does).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, allowed_positions, prepare_inputs
from mha_rosetta.core.decode import DecodeInputs

from .._recording import StageRecorder
from ..base import PreparedDecode, tensor_to_numpy
from ..torch.common import (
    bool_tensor,
    in_inference_mode,
    optional_tensor,
    precision_info,
    rotate_last_axis,
    synchronizer,
    to_tensor,
    torch_rotary_tables,
    with_matmul_precision,
)
from ..torch.variants import ScoreBias

SDPA_DECODE_LAYOUT = (
    "(B, Hkv, T, Dk) and (B, Hkv, T, Dv) grown with torch.cat on T, Hugging Face's DynamicCache layout; every token "
    "kept (a window is in the mask, no ring)"
)
SDPA_DECODE_DIFFERENCES = (
    "decoding: is_causal=True is top-left, wrong on a step of several queries over a longer cache; the oracle passes "
    "causal_lower_right(Nq, Nk) where nothing else is masked, else an explicit boolean mask (info['masks'])",
    "decoding: its cache keeps every token and masks the window (memory O(N), no ring buffer)",
)


def chunk_mask_kind(cfg: MHAConfig, allowed: np.ndarray) -> str:
    """How SDPA is told a chunk's pattern ``allowed`` (1|B, 1, s, T): "none", "causal_lower_right", "bool" or
    "float" (with a score bias)."""
    if cfg.has_score_bias:
        return "float"
    s, T = allowed.shape[-2:]
    if allowed.all():
        return "none"
    bottom_right = np.tril(np.ones((s, T), dtype=bool), k=T - s)  # query i sees keys j <= i + T - s
    return "causal_lower_right" if (allowed == bottom_right).all() else "bool"


def prepare_sdpa_decode_run(
    cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str, device: str, allow_tf32: bool = False
) -> PreparedDecode:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from .torch import float_score_mask, projected_heads_pass  # the oracle's own model code around the kernel

    p = {name: optional_tensor(array, dtype, device) for name, array in params.as_dict().items()}
    x_all = to_tensor(inputs.x, dtype, device)  # (B, N, D)
    every = SimpleNamespace(positions=inputs.positions, kv_positions=inputs.positions)
    tables = torch_rotary_tables(cfg, every, dtype, device)  # (B, N, r/2): the whole run's, sliced per chunk
    gqa = {"enable_gqa": True} if cfg.n_kv_heads != cfg.n_heads else {}
    cache: dict = {}  # "k" (B, Hkv, T, Dk), "v" (B, Hkv, T, Dv): the growing cache of one run

    def chunk_pass(start: int, stop: int):
        s, T = stop - start, stop
        mask = None if inputs.mask is None else inputs.mask[:, None, None, :stop]  # (B, 1, 1, T): the padding
        over = prepare_inputs(
            cfg,
            inputs.x[:, start:stop],
            inputs.x[:, :stop],
            None,
            mask,
            inputs.positions[:, start:stop],
            inputs.positions[:, :stop],
        )
        allowed = allowed_positions(cfg, over)  # (1|B, 1, s, T): causal and window on positions, the padding
        kind = chunk_mask_kind(cfg, allowed)
        attn_mask = {"none": None, "causal_lower_right": causal_lower_right(s, T)}.get(kind)
        allowed_t = bool_tensor(allowed, device)
        if kind == "bool":
            attn_mask = allowed_t
        score_bias = ScoreBias(cfg, over, dtype, device) if kind == "float" else None

        def rotate(heads, which: str):
            if tables is None:
                return heads
            cos, sin = (t[:, start:stop].unsqueeze(1) for t in tables[which])  # (1|B, 1, s, r/2)
            return rotate_last_axis(heads, cos, sin, cfg.rope)

        def attend(p: dict, q_rotated, k_rotated, v_heads):
            k = k_rotated if start == 0 else torch.cat((cache["k"], k_rotated), dim=2)  # (B, Hkv, T, Dk)
            v = v_heads if start == 0 else torch.cat((cache["v"], v_heads), dim=2)  # (B, Hkv, T, Dv)
            cache["k"], cache["v"] = k, v
            mask = attn_mask
            if score_bias is not None:  # float: the bias where allowed, -inf where blocked, (1|B, H, s, T)
                mask = float_score_mask(score_bias(p.get("rel_bias")), allowed_t, q_rotated.dtype)
            return F.scaled_dot_product_attention(q_rotated, k, v, attn_mask=mask, scale=cfg.scale, **gqa)

        sizes = SimpleNamespace(batch=inputs.batch, q_tokens=s)
        note = f"F.scaled_dot_product_attention over the cache ({kind} mask)"
        return projected_heads_pass(cfg, sizes, dtype, device, attend, note, rotate), kind

    chunks = inputs.chunks()
    passes = [chunk_pass(start, stop) for start, stop in chunks]

    def run_all(recorders=None):
        outputs = []
        for i, ((start, stop), (forward, _)) in enumerate(zip(chunks, passes, strict=True)):
            x = x_all[:, start:stop]  # (B, s, D), a view
            outputs.append(forward(p, x, x, x, None if recorders is None else recorders[i]))
        return outputs

    run_all = in_inference_mode(with_matmul_precision(run_all, device, allow_tf32))

    def step_stages():
        recorders = [StageRecorder() for _ in chunks]
        run_all(recorders)
        return [recorder.stages() for recorder in recorders]

    itemsize = x_all.element_size()
    slots = inputs.tokens
    info = {
        "cache": {
            "kind": "dynamic",
            "layout": SDPA_DECODE_LAYOUT,
            "slots": slots,
            "bytes": inputs.batch * cfg.n_kv_heads * slots * (cfg.d_k + cfg.d_v) * itemsize,
        },
        "masks": [kind for _, kind in passes],
        "is_causal": "never: it is top-left; causal_lower_right or an explicit mask instead",
        "enable_gqa": bool(gqa),
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return PreparedDecode(
        run_all,
        lambda outputs: tensor_to_numpy(torch.cat(outputs, dim=1)),
        step_stages,
        synchronize=synchronizer(device),
        info=info,
    )
