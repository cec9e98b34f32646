"""FlexAttention (``torch.nn.attention.flex_attention``) as an oracle: the library users reach for to write variants.

The model code around the kernel is the SDPA oracle's (`oracles.torch.projected_heads_pass`:
``F.linear`` projections, QK-norm with ``F.rms_norm``, the head split, rotary), and the
variants go where FlexAttention's API puts them:

* ``score_mod(score, b, h, q_idx, kv_idx)`` on each scaled score: the softcap
  ``c * tanh(s / c)``, then ALiBi's ``slope[h] * (p_j - p_i)`` and T5's
  ``rel_bias[bucket[p_j - p_i - lowest], h]``. The slopes, the positions and T5's bucket of
  every distance come from `core.variants` at prepare time (`torch.variants.ScoreBias`'s
  tables), read inside ``score_mod`` by index.
* ``mask_mod(b, h, q_idx, kv_idx)`` turned into a `BlockMask` by ``create_block_mask`` (once,
  in prepare): causal ``kv_idx <= q_idx``, the window and Llama 4's chunks (``p_j // C == p_i // C``) on the
  positions, the caller's mask.
* the sinks: FlexAttention has no sink logit, but it returns each row's log-sum-exp
  (``return_aux=AuxRequest(lse=True)``), and with ``Z = exp(lse)`` the spec's rows are
  ``out * Z / (Z + exp(sink_h)) = out * sigmoid(lse - sink_h)``: exact, the way Hugging Face's
  flex path for gpt-oss adds them.

Modes, per dtype (``compiled_dtypes``): by default every dtype runs eagerly (FlexAttention's
unfused path, which has every dtype and agrees within each dtype's tolerance); with
``MHA_ROSETTA_FLEX_COMPILE=1`` float16 and bfloat16 run ``torch.compile(flex_attention)``
(the fused kernel users time, its running softmax in float32). Why the compiled kernel is
opt-in: it made the whole default check take 434 s cold instead of about a minute (measured on
this loaded machine, so indicative), because each new shape, dtype and score_mod/mask_mod compiles once (static shapes:
``dynamic=True`` would reuse one program across token counts, but torch 2.13's dynamic-shape
lowering of these programs fails, measured: "LoweringException: 'Mul' object has no attribute
'get_name'" for a window, "unbacked_bindings" for a softcap, a C++ compile error for ALiBi), and
the check's cases are all different shapes. torch-flex alone in the default check (34 cases,
this loaded 2-core machine, indicative only), worker time summed over 2 workers: float16,
bfloat16 and float32 compiled 375 s with a cold inductor cache; the half dtypes only, 164 s
cold (87 s wall) and 33 s with the cache warm (20 s wall).
``TorchFlexOracle(compiled_dtypes=("float32", "float16", "bfloat16"))`` runs float32 compiled
as well. One compiled function serves every case of a process (`_compiled_flex`); a compile
took 4-15 s here, the first of a process up to 37 s, a reuse under a millisecond.
Sinks run eagerly in every dtype: the compiled CPU kernel returns no log-sum-exp (torch 2.13:
"torch.compile on CPU only supports inference and return_lse is not supported yet").
No backward: FlexAttention has none on the CPU (torch
2.13 raises "FlexAttention does not support backward on CPU").
"""

from __future__ import annotations

import time
import warnings
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, prepare_inputs
from mha_rosetta.core.decode import DecodeInputs
from mha_rosetta.core.variants import BUILTIN_VARIANTS

from .._recording import StageRecorder
from ..base import Backend, DecodeStep, Prepared, PreparedDecode, UnsupportedCase
from ..torch.common import (
    TorchDevices,
    inference_run,
    param_tensors,
    precision_info,
    recorded_prepared,
    torch_device,
    torch_inputs,
)
from ..torch.variants import ScoreBias
from .torch_heads import projected_heads_pass

COMPILED_DTYPES = ("float16", "bfloat16")  # what MHA_ROSETTA_FLEX_COMPILE=1 compiles (module docstring)
COMPILE_ENV = "MHA_ROSETTA_FLEX_COMPILE"


def default_compiled_dtypes() -> tuple[str, ...]:
    """`COMPILED_DTYPES` when ``MHA_ROSETTA_FLEX_COMPILE`` is set (and not "0"), else none: every dtype eager."""
    import os

    return COMPILED_DTYPES if os.environ.get(COMPILE_ENV, "0") not in ("", "0") else ()


# Distinct (H, Hkv, Dk, dtype, score_mod, mask_mod) programs one process may compile before dynamo would fall
# back to running eagerly behind our back (its default recompile_limit is 8; the check's cases need about 30).
RECOMPILE_LIMIT = 128
_COMPILED: list = []


def _compiled_flex():
    """The one ``torch.compile(flex_attention)`` of this process (made on first use), static shapes."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if not _COMPILED:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


def _eager_flex(*args, direct: bool = True, **kwargs):
    """flex_attention without torch.compile: its unfused path, whose "use torch.compile" advice is the point here.

    Called eagerly, `flex_attention` still hands its higher-order op to ``torch.compile(backend="eager")``,
    which re-traces score_mod and mask_mod with dynamo for every new closure: 0.52 s a call, 47 traces over
    the default check's 56 runs (cProfile, torch 2.13 CPU). Its own switch for calling the op directly
    (``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG``) runs the same dense kernel on the same score_mod, and is set
    here for the call only (``direct=False``: the capture, for the test that compares them): over the 35 spec cases in float64 and float32 both give bit-identical outputs
    (`tests/test_flex_direct.py`) and take 0.75 s instead of 15.7 s for the 70 runs. The capture matters only
    for gradients (it lifts closed-over tensors so they get theirs), and this oracle has no CPU backward.
    """
    import torch.nn.attention.flex_attention as flex

    before = flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = direct
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex.flex_attention(*args, **kwargs)
    finally:
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


def compiled_mode(cfg: MHAConfig, dtype: str, compiled_dtypes: tuple[str, ...] = COMPILED_DTYPES) -> bool:
    """Whether ``dtype`` runs the compiled kernel: one of ``compiled_dtypes`` (never float64) and no sinks."""
    return dtype in compiled_dtypes and dtype != "float64" and not cfg.sinks


class TorchFlexOracle(TorchDevices, Backend):
    """``flex_attention`` with ``score_mod`` and a ``BlockMask``, on heads projected with ``F.linear``."""

    name = "torch-flex"
    convention = (
        "torch.nn.attention.flex_attention on (B, H, N, d) heads: score_mod (softcap, ALiBi, T5 bias), "
        "a BlockMask from mask_mod (causal, window, chunks, the user's mask), sinks from the returned log-sum-exp"
    )
    gap_causes: ClassVar[dict[str, str]] = {
        "forward": "it runs flex_attention eagerly, FlexAttention's unfused path, in every dtype unless told to compile "
        "(`compiled_dtypes`; read in the code, torch 2.13), where torch-best's SDPA is one fused kernel",
    }
    # Every one of the package's, written out (a library's idiom is the reason): score_mod, mask_mod, the sinks from
    # the lse, QK-norm and biases outside. A variant registered later is not in its score_mod, so it is refused.
    variants = BUILTIN_VARIANTS - {"gate"}  # the output gate is model code after the kernel (KERNEL_REFUSAL)
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8 (`prepare_flex_decode_run`): the growing cache of the torch oracles, a BlockMask over it per chunk.
    decode_caches = ("dynamic",)
    decode_layouts: ClassVar[dict[str, str]] = {
        "dynamic": "(B, Hkv, T, Dk) and (B, Hkv, T, Dv) grown with torch.cat on T, Hugging Face's DynamicCache "
        "layout; every token kept, the window in each chunk's BlockMask over the cache"
    }
    known_differences = (
        "every dtype runs eagerly (the unfused path); with MHA_ROSETTA_FLEX_COMPILE=1 float16/bfloat16 run "
        "torch.compile(flex_attention), whose fused kernel sums in another order and keeps its running softmax in "
        "float32 (opt-in: its compiles made the default check 434 s cold)",
        "sinks: FlexAttention has no sink logit; the adapter rescales each row by sigmoid(lse - sink_h) from the "
        "returned log-sum-exp (exact), and runs them eagerly in every dtype (the compiled CPU kernel returns no lse)",
        "the softcap and ALiBi / T5's bias are the adapter's score_mod (the tables from core.variants, indexed inside); "
        "causal, the window, the chunks and the user mask its mask_mod, made a BlockMask once in prepare",
        "scores and weights stay inside the kernel: only projections, heads (normed, rotated), context, merged and "
        "output are stages",
        "a query that may attend to no key: zeros and lse = -inf (torch 2.13 CPU), the spec's answer",
        "no backward on the CPU: torch 2.13's FlexAttention raises for inputs that require grad there",
        "decoding: eager in every dtype (a compiled kernel would compile once per chunk shape), a BlockMask per "
        "chunk over its growing cache (every token kept, memory O(N)), made in prepare; the timed step (bench --mode decode) is eager too, a BlockMask over the grown cache",
    )

    def __init__(
        self, name: str | None = None, allow_tf32: bool = False, compiled_dtypes: tuple[str, ...] | None = None
    ) -> None:
        super().__init__(name)
        self.allow_tf32 = bool(allow_tf32)
        compiled_dtypes = default_compiled_dtypes() if compiled_dtypes is None else compiled_dtypes
        unknown = [d for d in compiled_dtypes if d not in ("float32", "float16", "bfloat16")]
        if unknown:
            raise ValueError(
                f"compiled_dtypes must name float32, float16 or bfloat16 (float64 runs eagerly), got {unknown}"
            )
        self.compiled_dtypes = tuple(compiled_dtypes)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        p = param_tensors(params, dtype, device)
        x_q, x_k, x_v = torch_inputs(inputs, dtype, device)  # (B, Nq, D), (B, Nk, kdim), (B, Nk, vdim)
        compiled = compiled_mode(cfg, dtype, self.compiled_dtypes)
        attend, block_mask = flex_attend(cfg, inputs, dtype, device, compiled)
        forward = projected_heads_pass(cfg, inputs, dtype, device, attend, "flex_attention (score_mod, block mask)")

        def run(rec: StageRecorder | None):
            return forward(p, x_q, x_k, x_v, rec)

        run = inference_run(run, device, self.allow_tf32)
        compile_seconds: list[float] = []

        def compile_once() -> None:
            """One call, untimed: dynamo traces and inductor compiles (or reuses) the program for this shape."""
            start = time.perf_counter()
            run(None)
            compile_seconds.append(time.perf_counter() - start)

        info = {
            "mode": "torch.compile(flex_attention), static shapes" if compiled else "eager (unfused)",
            "block_mask": None if block_mask is None else f"{block_mask.shape}, blocks {block_mask.BLOCK_SIZE}",
            "score_mod": ", ".join(flex_score_parts(cfg)) or None,
            "sinks": "out * sigmoid(lse - sink_h)" if cfg.sinks else None,
            "compile_seconds": compile_seconds,
            **precision_info(device=device, dtype=dtype, allow_tf32=self.allow_tf32),
        }
        return recorded_prepared(run, device, info, compile=compile_once if compiled else None)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
        return prepare_flex_decode_run(cfg, params, inputs, dtype, device, self.allow_tf32)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        return prepare_flex_decode_step(cfg, params, job, self.allow_tf32)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        if device == "cpu":
            raise UnsupportedCase(
                f"{self.name}: FlexAttention has no backward on the CPU (torch 2.13 raises for inputs that require grad)"
            )
        raise UnsupportedCase(f"{self.name}: the backward pass is not wired up (forward only)")


def flex_score_parts(cfg: MHAConfig) -> list[str]:
    """What the score_mod does for ``cfg``, in pipeline order (empty: no score_mod)."""
    parts = []
    if cfg.softcap is not None:
        parts.append(f"{cfg.softcap:g} * tanh(s / {cfg.softcap:g})")
    if cfg.alibi:
        parts.append("+ slope[h] * (p_j - p_i)")
    if cfg.rel_buckets is not None:
        parts.append("+ rel_bias[bucket(p_j - p_i), h]")
    return parts


def flex_attend(cfg: MHAConfig, inputs: MHAInputs, dtype: str, device: str, compiled: bool):
    """``(attend(p, q, k, v) -> context, block_mask)``: the kernel call of the flex oracle for these inputs."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    B, Nq, Nk, H = inputs.batch, inputs.q_tokens, inputs.kv_tokens, cfg.n_heads
    place = torch_device(device)
    # Positions (1|B, N) -> (B, N), contiguous, so score_mod and mask_mod index them by the batch index b.
    q_pos = torch.from_numpy(np.array(np.broadcast_to(inputs.positions, (B, Nq)))).to(place)
    k_pos = torch.from_numpy(np.array(np.broadcast_to(inputs.kv_positions, (B, Nk)))).to(place)
    bias = ScoreBias(cfg, inputs, dtype, device) if cfg.has_score_bias else None

    block_mask = None
    if cfg.causal or cfg.window is not None or cfg.attention_chunk_size is not None or inputs.mask is not None:
        user = None
        if inputs.mask is not None:  # (1|B, 1|H, Nq|1, Nk|1) -> (B, H, Nq, Nk), indexed by mask_mod
            user = torch.from_numpy(np.array(np.broadcast_to(inputs.mask, (B, H, Nq, Nk)))).to(place)
        causal, window, chunk = cfg.causal, cfg.window, cfg.attention_chunk_size

        def mask_mod(b, h, q_idx, kv_idx):
            allowed = torch.ones_like(q_idx, dtype=torch.bool) if user is None else user[b, h, q_idx, kv_idx]
            if causal:  # on positions (p_j <= p_i): bottom-right on a decode step, top-left by default
                allowed = allowed & (k_pos[b, kv_idx] <= q_pos[b, q_idx])
            if window is not None:
                distance = k_pos[b, kv_idx] - q_pos[b, q_idx]  # p_j - p_i
                allowed = allowed & ((distance > -window) if causal else (distance.abs() < window))
            if chunk is not None:  # Llama 4's chunks on the positions: p_j // C == p_i // C
                allowed = allowed & (k_pos[b, kv_idx] // chunk == q_pos[b, q_idx] // chunk)
            return allowed

        with warnings.catch_warnings():  # create_block_mask's own eager evaluation of mask_mod
            warnings.simplefilter("ignore")
            block_mask = create_block_mask(mask_mod, B, H, Nq, Nk, device=place)

    def attend(p: dict, q, k, v):
        score_mod = None
        if cfg.softcap is not None or bias is not None:
            cap, slopes, table = cfg.softcap, None if bias is None else bias.slopes, p.get("rel_bias")
            buckets, lowest = (None, 0) if bias is None else (bias.bucket_of, getattr(bias, "lowest", 0))

            def score_mod(score, b, h, q_idx, kv_idx):
                if cap is not None:
                    score = cap * torch.tanh(score / cap)
                if slopes is not None or buckets is not None:
                    distance = k_pos[b, kv_idx] - q_pos[b, q_idx]  # p_j - p_i
                    if slopes is not None:
                        score = score + (slopes[h] * distance).to(score.dtype)
                    if buckets is not None:
                        score = score + table[buckets[distance - lowest], h].to(score.dtype)
                return score

        kernel = _compiled_flex() if compiled else _eager_flex
        options = dict(score_mod=score_mod, block_mask=block_mask, scale=cfg.scale, enable_gqa=cfg.n_kv_heads != H)
        if not cfg.sinks:
            return kernel(q, k, v, **options)  # (B, H, Nq, Dv)
        context, aux = kernel(q, k, v, return_aux=AuxRequest(lse=True), **options)  # lse (B, H, Nq), float32+
        sink = p["sinks"].to(aux.lse.dtype).view(1, H, 1)  # (1, H, 1)
        share = torch.sigmoid(aux.lse - sink)  # Z / (Z + exp(sink)): 0 for a row with no allowed key (lse -inf)
        return (context * share.unsqueeze(-1)).to(context.dtype)  # (B, H, Nq, Dv)

    return attend, block_mask


def prepare_flex_decode_run(
    cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str, device: str, allow_tf32: bool = False
) -> PreparedDecode:
    """A decode run through eager flex_attention: each chunk's queries over the growing cache (`torch_decode`), its
    score_mod and BlockMask those of `flex_attend` for the chunk's positions over the cached ones."""
    from .torch_decode import prepare_growing_cache_run

    def kernel_for(start: int, stop: int):
        mask = None if inputs.mask is None else inputs.mask[:, None, None, :stop]  # (B, 1, 1, T): the padding
        over = prepare_inputs(
            cfg,
            inputs.x[:, start:stop],
            inputs.x[:, :stop],
            None,
            mask,
            inputs.positions[:, start:stop],
            inputs.positions[:, :stop],
        )  # the chunk's queries over every cached token, for the masks and the score bias
        attend, block_mask = flex_attend(cfg, over, dtype, device, compiled=False)
        return attend, f"BlockMask {tuple(block_mask.shape)}"

    note = "eager flex_attention over the cache"
    return prepare_growing_cache_run(cfg, params, inputs, dtype, device, allow_tf32, kernel_for, note)


def prepare_flex_decode_step(cfg: MHAConfig, params: MHAParams, job: DecodeStep, allow_tf32: bool = False) -> Prepared:
    """One timed step (`bench --mode decode`): eager flex_attention of the step's queries over the grown cache,
    its BlockMask (causal and the window on the positions) made here, once (`torch_decode.prepare_growing_cache_step`)."""
    from .torch_decode import prepare_growing_cache_step

    def kernel_for(q_positions, kv_positions):
        B, T = kv_positions.shape
        keys = np.broadcast_to(np.zeros((), dtype=np.float64), (B, T, cfg.d_model))  # a view: only its shape is read
        over = prepare_inputs(cfg, keys[:, : q_positions.shape[1]], keys, None, None, q_positions, kv_positions)
        attend, block_mask = flex_attend(cfg, over, job.dtype, job.device, compiled=False)
        shape = None if block_mask is None else tuple(block_mask.shape)
        return attend, f"eager flex_attention over the cache (BlockMask {shape})", {"block_mask": str(shape)}

    return prepare_growing_cache_step(cfg, params, job, allow_tf32, kernel_for)
