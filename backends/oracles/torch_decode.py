"""The torch oracles' decoding: a growing cache of their own and the library's kernel per chunk (SDPA here, flex).

`prepare_growing_cache_run` is the run both share (torch-flex passes its ``flex_attention`` with a
BlockMask per chunk, `oracles.flex.prepare_flex_decode_run`); the rest is SDPA's.

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

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.decode import DecodeInputs, decode_allowed

from .._recording import StageRecorder
from ..base import DecodeStep, Prepared, PreparedDecode
from ..decoding import kv_cache_info
from ..torch.common import (
    bool_tensor,
    decode_prepared,
    heads_rotator,
    inference_run,
    param_tensors,
    precision_info,
    recorded_prepared,
    table_rotator,
    to_tensor,
    torch_dtype,
    torch_rotary_tables,
)
from ..torch.decode import CACHE_AXES, random_cache
from ..torch.variants import ScoreBias
from .torch_heads import float_score_mask, projected_heads_pass  # the oracles' model code around the kernel

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


def chunk_mask(cfg: MHAConfig, q_positions, kv_positions, kv_valid, dtype: str, device: str):
    """``(kind, mask_of)`` for queries at ``q_positions`` (B, s) over cached keys at ``kv_positions`` (B, T),
    ``kv_valid`` (B, T): `chunk_mask_kind` and ``mask_of(p)``, the ``attn_mask`` to pass (``p``: the parameter
    tensors, whose T5 table a float mask reads)."""
    from torch.nn.attention.bias import causal_lower_right

    q_positions, kv_positions = np.array(q_positions, dtype=np.int64), np.array(kv_positions, dtype=np.int64)
    allowed = decode_allowed(cfg, q_positions, kv_positions, kv_valid)  # (B, 1, s, T), the rule on positions
    kind = chunk_mask_kind(cfg, allowed)
    s, T = allowed.shape[-2:]
    if kind in ("none", "causal_lower_right"):
        fixed = None if kind == "none" else causal_lower_right(s, T)
        return kind, lambda p: fixed
    allowed_t = bool_tensor(allowed, device)  # True = may attend
    if kind == "bool":
        return kind, lambda p: allowed_t
    bias = ScoreBias(cfg, SimpleNamespace(positions=q_positions, kv_positions=kv_positions), dtype, device)

    def float_mask(p):  # the bias where allowed, -inf where blocked, (B, H, s, T)
        return float_score_mask(bias(p.get("rel_bias")), allowed_t, torch_dtype(dtype))

    return kind, float_mask


def sdpa_kernel(cfg: MHAConfig, mask_of):
    """``kernel(p, q, k, v)``: SDPA of the queries (B, H, s, Dk) over the cache (B, Hkv, T, Dk), (B, Hkv, T, Dv)
    with ``attn_mask=mask_of(p)`` (`chunk_mask`), ``enable_gqa`` where the kv heads are fewer."""
    import torch.nn.functional as F

    gqa = {"enable_gqa": True} if cfg.n_kv_heads != cfg.n_heads else {}

    def kernel(p: dict, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_of(p), scale=cfg.scale, **gqa)

    return kernel


def prepare_sdpa_decode_run(
    cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str, device: str, allow_tf32: bool = False
) -> PreparedDecode:
    """A whole decode run through SDPA, each chunk's mask chosen here (`chunk_mask`)."""

    def kernel_for(start: int, stop: int):
        kind, mask_of = chunk_mask(
            cfg, inputs.positions[:, start:stop], inputs.positions[:, :stop], inputs.valid[:, :stop], dtype, device
        )
        return sdpa_kernel(cfg, mask_of), kind

    note = "F.scaled_dot_product_attention over the cache"
    prepared = prepare_growing_cache_run(cfg, params, inputs, dtype, device, allow_tf32, kernel_for, note)
    prepared.info.update(
        is_causal="never: it is top-left; causal_lower_right or an explicit mask instead",
        enable_gqa=cfg.n_kv_heads != cfg.n_heads,
    )
    return prepared


def prepare_growing_cache_run(
    cfg: MHAConfig,
    params: MHAParams,
    inputs: DecodeInputs,
    dtype: str,
    device: str,
    allow_tf32: bool,
    kernel_for,
    kernel_note: str,
) -> PreparedDecode:
    """A decode run of a torch oracle: the model code of `projected_heads_pass` per chunk, its keys and values
    appended to a growing cache (every token kept, afresh each run), then ``kernel(p, q, k, v)`` over it.

    ``kernel_for(start, stop) -> (kernel, mask)``, called here once per chunk (prepare time): the library's
    attention of the chunk's queries over the cache and how it masks, in words (``info["masks"]``).
    """
    import torch

    p = param_tensors(params, dtype, device)
    x_all = to_tensor(inputs.x, dtype, device)  # (B, N, D)
    every = SimpleNamespace(positions=inputs.positions, kv_positions=inputs.positions)
    tables = torch_rotary_tables(cfg, every, dtype, device)  # (B, N, r/2): the whole run's, sliced per chunk
    cache: dict = {}  # "k" (B, Hkv, T, Dk), "v" (B, Hkv, T, Dv): the growing cache of one run

    def chunk_pass(start: int, stop: int):
        kernel, mask = kernel_for(start, stop)

        span = slice(start, stop)  # the chunk's rows of the run's tables: (1|B, s, r/2) views
        chunk_tables = None if tables is None else {w: (cos[:, span], sin[:, span]) for w, (cos, sin) in tables.items()}
        rotate = table_rotator(chunk_tables, cfg.rope)

        def attend(p: dict, q_rotated, k_rotated, v_heads):
            k = k_rotated if start == 0 else torch.cat((cache["k"], k_rotated), dim=2)  # (B, Hkv, T, Dk)
            v = v_heads if start == 0 else torch.cat((cache["v"], v_heads), dim=2)  # (B, Hkv, T, Dv)
            cache["k"], cache["v"] = k, v
            return kernel(p, q_rotated, k, v)  # (B, H, s, Dv)

        sizes = SimpleNamespace(batch=inputs.batch, q_tokens=stop - start)
        return projected_heads_pass(cfg, sizes, dtype, device, attend, f"{kernel_note} ({mask})", rotate), mask

    chunks = inputs.chunks()
    passes = [chunk_pass(start, stop) for start, stop in chunks]

    def run_all(recorders=None):
        outputs = []
        for i, ((start, stop), (forward, _)) in enumerate(zip(chunks, passes, strict=True)):
            x = x_all[:, start:stop]  # (B, s, D), a view
            outputs.append(forward(p, x, x, x, None if recorders is None else recorders[i]))
        return outputs

    run_all = inference_run(run_all, device, allow_tf32)

    def step_stages():
        recorders = [StageRecorder() for _ in chunks]
        run_all(recorders)
        return [recorder.stages() for recorder in recorders]

    info = {
        "cache": growing_cache_info(cfg, inputs.batch, inputs.tokens, x_all.element_size()),
        "masks": [mask for _, mask in passes],
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return decode_prepared(run_all, device, info, step_stages)


def growing_cache_info(cfg: MHAConfig, batch: int, slots: int, itemsize: int) -> dict:
    """``info["cache"]`` of the oracles' growing cache, Hugging Face's layout (`decoding.kv_cache_info`)."""
    return kv_cache_info("dynamic", CACHE_AXES, cfg, batch, slots, itemsize)


def prepare_sdpa_decode_step(cfg: MHAConfig, params: MHAParams, job: DecodeStep, allow_tf32: bool = False) -> Prepared:
    """One timed step (`bench --mode decode`) of the SDPA oracle (`prepare_growing_cache_step`); a window is in the
    mask over every cached token."""

    def kernel_for(q_positions, kv_positions):
        valid = np.ones(kv_positions.shape, dtype=bool)  # (B, T): every slot holds a token
        kind, mask_of = chunk_mask(cfg, q_positions, kv_positions, valid, job.dtype, job.device)
        return sdpa_kernel(cfg, mask_of), f"F.scaled_dot_product_attention over the cache ({kind} mask)", {"mask": kind}

    return prepare_growing_cache_step(cfg, params, job, allow_tf32, kernel_for)


def prepare_growing_cache_step(
    cfg: MHAConfig, params: MHAParams, job: DecodeStep, allow_tf32: bool, kernel_for
) -> Prepared:
    """One timed step (`bench --mode decode`) of a torch oracle: ``step`` tokens at positions ``context ..``
    onto ``context`` cached tokens of random K and V (`torch.decode.random_cache`, the same numbers torch's
    caches get from one seed). ``forward`` grows the cache with ``torch.cat`` and calls the library's kernel,
    dropping the grown cache (every call the same step).

    ``kernel_for(q_positions (B, s), kv_positions (B, T)) -> (kernel(p, q, k, v), note, info)``, called once
    here: the library's attention of the step's queries over the grown cache, in words, and what it adds
    to ``info``.
    """
    import torch

    batch, context, step, dtype, device = job.batch, job.context, job.step, job.dtype, job.device
    rng = np.random.default_rng(job.seed)
    x = to_tensor(rng.standard_normal((batch, step, cfg.d_model)), dtype, device)  # (B, step, D), drawn first
    k_old, v_old = random_cache(rng, cfg, batch, context, dtype, device)  # (B, Hkv, context, Dk|Dv)
    total = context + step
    q_positions = job.positions()  # (B, step)
    kv_positions = np.broadcast_to(np.arange(total, dtype=np.int64), (batch, total))  # (B, T)
    kernel, note, kernel_info = kernel_for(q_positions, kv_positions)
    p = param_tensors(params, dtype, device)
    every = SimpleNamespace(positions=np.array(q_positions), kv_positions=np.array(q_positions))
    rotate = heads_rotator(cfg, every, dtype, device)  # the step's tables (B, step, r/2)

    def attend(p: dict, q_rotated, k_rotated, v_heads):
        k = torch.cat((k_old, k_rotated), dim=2)  # (B, Hkv, T, Dk): the grown cache, dropped after the call
        v = torch.cat((v_old, v_heads), dim=2)  # (B, Hkv, T, Dv)
        return kernel(p, q_rotated, k, v)  # (B, H, step, Dv)

    forward = projected_heads_pass(
        cfg, SimpleNamespace(batch=batch, q_tokens=step), dtype, device, attend, note, rotate
    )

    def run(rec: StageRecorder | None):
        return forward(p, x, x, x, rec)

    run = inference_run(run, device, allow_tf32)
    info = {
        "cache": growing_cache_info(cfg, batch, total, x.element_size()),
        **kernel_info,
        "context": context,
        "step": step,
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return recorded_prepared(run, device, info)
