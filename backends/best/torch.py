"""``torch-best``: PyTorch as its best users write it, F.linear + SDPA, autograd, and a static cache written in place.

* The forward and the backward are the ``torch-sdpa`` oracle's own pass (`oracles.torch.sdpa_pass`:
  ``F.linear`` projections, the head split ``view(B, N, H, d).transpose(1, 2)``, rotary, one
  ``F.scaled_dot_product_attention`` with ``enable_gqa`` and ``is_causal`` where the positions allow
  it, the merge and the output projection; autograd through it), because that is how torch's best
  users write attention: this backend adds no second copy of it. ``enable_gqa`` stays in the forward:
  there it measured the same as folding the group into the query axis (B=4, N=512, 8 heads on 2,
  float32, one core: 27.5 against 26.9 ms, within the shared machine's noise), and folding would lose
  ``is_causal`` (27.9 ms causal against 32.4 with repeated kv heads).
* The scores and weights stay inside SDPA's fused kernel. `native_stages` (untimed) recomputes them
  from the recorded rotated queries and keys, in the run's dtype, so the stage-by-stage check has them;
  the context is the kernel's own.
* Decoding: a static cache ``(B, Hkv, C, d)`` allocated once, each chunk's keys and values written in
  place by slice assignment at the write index (never ``torch.cat``, which copies all of K and V every
  step) and read as the view ``[:, :, :stop]`` (the slots written so far: no mask over empty slots).
  Each group's query heads are folded into the query axis, ``(B, H, s, d) -> (B, Hkv, G*s, d)`` (a view
  for one token), so SDPA reads each kv head once: CPU SDPA with ``enable_gqa`` re-reads K and V per
  query head (a torch limit, issue 43; measured here at 16 heads on 4, d 128, one core: 12.3 ms at 8k
  tokens with ``enable_gqa`` against 4.9 ms folded). One token a step sees every slot: no mask at all.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, allowed_positions
from mha_rosetta.core.decode import DecodeInputs

from .._recording import StageRecorder
from ..base import Prepared, PreparedDecode, StageTensor
from ..oracles.torch import TorchSDPAOracle
from ..oracles.torch_heads import projected_heads_pass
from ..oracles.torch_passes import sdpa_pass
from ..stage_cuts import CACHE_WRITE, eager_cuts, path_groups, reached
from ..torch.common import (
    bool_tensor,
    decode_prepared,
    inference_run,
    param_tensors,
    precision_info,
    recorded_prepared,
    synchronizer,
    table_rotator,
    to_tensor,
    torch_dtype,
    torch_inputs,
)
from .common import STATIC, BestPath, DecodeStepInputs, cache_info, decode_chunks, folded_allowed

CACHE_LAYOUT = "(B, Hkv, C, Dk), (B, Hkv, C, Dv)"
DECODE_LAYOUTS = {
    STATIC: f"{CACHE_LAYOUT} preallocated to the run's C tokens, written by slice assignment (no torch.cat) and read "
    "up to the write index; each group's query heads folded into SDPA's query axis (no enable_gqa)"
}
RECOMPUTED = "recomputed (untimed) from q_rotated and k_rotated: the fused SDPA kernel keeps its scores inside"


class TorchBestBackend(BestPath, TorchSDPAOracle):
    name = "torch-best"
    convention = (
        "torch at its best: F.linear + F.scaled_dot_product_attention (enable_gqa, is_causal where it holds), "
        "autograd; decoding a static cache written in place, the group folded into SDPA's query axis"
    )
    # It keeps the spec's conventions (the torch-sdpa oracle shows SDPA's own); one answer is the kernel's.
    known_differences = (
        "a NaN in one query token: CPU SDPA's fused kernel (torch 2.13) gives that token's context zeros, so its "
        "output b_o, where the spec propagates the NaN to its output row (the math kernel does)",
    )
    decode_layouts = DECODE_LAYOUTS

    def __init__(self, name: str | None = None, allow_tf32: bool = False) -> None:
        super().__init__(name, allow_tf32)
        self.name = name or "torch-best"

    def _prepare(self, cfg, params, inputs, dtype, device, strategy) -> Prepared:
        prepared = super()._prepare(cfg, params, inputs, dtype, device, strategy)  # the SDPA oracle's pass
        recorded = prepared.native_stages
        allowed = allowed_positions(cfg, inputs)  # (1|B, 1|H, Nq, Nk) or None

        def native_stages() -> dict[str, StageTensor]:
            stages = recorded()
            stages.update(score_stages(cfg, stages["q_rotated"].value, stages["k_rotated"].value, allowed))
            return stages

        prepared.native_stages = native_stages
        # The breakdown's cuts: the same pass on the same inputs, stopped after a stage (`stage_cuts`).
        p = param_tensors(params, dtype, device)
        x_q, x_k, x_v = torch_inputs(inputs, dtype, device)  # (B, Nq, D), (B, Nk, kdim), (B, Nk, vdim)
        forward, _, _ = sdpa_pass(cfg, inputs, dtype, device)
        cut = inference_run(forward, device, self.allow_tf32)
        groups = path_groups(rope=cfg.rope is not None, decode=False, fused=True)
        prepared.stage_cuts = eager_cuts(lambda until: cut(p, x_q, x_k, x_v, None, until), groups, prepared.synchronize)
        return prepared

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache) -> PreparedDecode:
        return prepare_decode_run(cfg, params, inputs, dtype, device, self.allow_tf32)

    def prepare_step(self, cfg, params, data, dtype, device) -> Prepared:
        return prepare_decode_step(cfg, params, data, dtype, device, self.allow_tf32)


def score_stages(cfg: MHAConfig, q_rotated, k_rotated, allowed: np.ndarray | None) -> dict[str, StageTensor]:
    """scores, masked_scores and weights (B, H, Nq, Nk) from q_rotated (B, H, Nq, Dk) and k_rotated (B, Hkv, Nk, Dk)."""
    import torch

    k = k_rotated.repeat_interleave(cfg.group_size, dim=1)  # (B, H, Nk, Dk): a copy, for inspection only
    scores = cfg.scale * (q_rotated @ k.transpose(-1, -2))  # (B, H, Nq, Nk)
    masked, weights = scores, torch.softmax(scores, dim=-1)
    if allowed is not None:
        allowed_t = torch.from_numpy(np.ascontiguousarray(allowed)).to(scores.device)  # (1|B, 1|H, Nq, Nk)
        empty = ~allowed_t.any(dim=-1, keepdim=True)  # a row with no allowed key: zeros (the spec's), never 0/0
        masked = scores.masked_fill(~allowed_t, float("-inf"))
        weights = torch.softmax(masked.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    axes = ("B", "H", "Nq", "Nk")
    return {
        "scores": StageTensor(scores, axes, RECOMPUTED),
        "masked_scores": StageTensor(masked, axes, RECOMPUTED, "new", "scores"),
        "weights": StageTensor(weights, axes, RECOMPUTED, "new", "masked_scores"),
    }


class TorchStaticCache:
    """K (B, Hkv, C, Dk) and V (B, Hkv, C, Dv), allocated once; ``write`` fills slots in place."""

    def __init__(self, cfg: MHAConfig, batch: int, slots: int, like) -> None:
        self.k = like.new_zeros((batch, cfg.n_kv_heads, slots, cfg.d_k))  # (B, Hkv, C, Dk)
        self.v = like.new_zeros((batch, cfg.n_kv_heads, slots, cfg.d_v))  # (B, Hkv, C, Dv)

    def write(self, k_new, v_new, start: int) -> tuple:
        """Keys (B, Hkv, s, Dk) and values (B, Hkv, s, Dv) into slots ``start .. start+s-1``; returns the written
        slots ``0 .. start+s-1`` as views (B, Hkv, T, d)."""
        stop = start + k_new.shape[2]
        self.k[:, :, start:stop] = k_new  # copy_ into the slots, no allocation
        self.v[:, :, start:stop] = v_new
        return self.k[:, :, :stop], self.v[:, :, :stop]  # views: no copy of the cache

    def info(self, cfg: MHAConfig) -> dict:
        return cache_info(cfg, self.k.shape[0], self.k.shape[2], self.k.element_size(), CACHE_LAYOUT)


def folded_step(cfg: MHAConfig, batch: int, tokens: int, dtype: str, device: str, tables, attn_mask):
    """``forward(p, x, cache, start, rec=None)``: ``tokens`` new tokens x (B, s, D) through a `TorchStaticCache`.

    The model code around the kernel is `projected_heads_pass` (projections, split, rotary with ``tables``
    (cos, sin) (1|B, s, r/2) or None, merge, output); its attention writes the cache and calls SDPA on the
    folded queries (B, Hkv, G*s, Dk) with ``attn_mask`` (B, 1, G*s, T) bool (True = may attend), or None.
    """
    import torch.nn.functional as F

    H, Hkv, G, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.group_size, cfg.d_k, cfg.d_v
    state: dict = {}  # the cache and write index of the call in progress

    def attend(p: dict, q_rotated, k_rotated, v_heads):
        k, v = state["cache"].write(k_rotated, v_heads, state["start"])  # (B, Hkv, T, d) views
        reached(state["until"], CACHE_WRITE, k, v)
        q = q_rotated.reshape(batch, Hkv, G * tokens, Dk)  # (B, Hkv, G*s, Dk): a view for one token
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=cfg.scale)  # (B, Hkv, G*s, Dv)
        return context.view(batch, H, tokens, Dv)  # (B, H, s, Dv)

    note = "F.scaled_dot_product_attention over the static cache, the group folded into the query axis"
    sizes = SimpleNamespace(batch=batch, q_tokens=tokens)
    rotate = table_rotator(None if tables is None else {"q": tables, "k": tables}, cfg.rope)  # the same tokens
    model = projected_heads_pass(cfg, sizes, dtype, device, attend, note, rotate)

    def forward(p: dict, x, cache: TorchStaticCache, start: int, rec: StageRecorder | None = None, until=None):
        state.update(cache=cache, start=start, until=until)  # until: a breakdown stage to stop after, or None
        return model(p, x, x, x, rec, until)  # (B, s, D)

    return forward


def decode_params(params: MHAParams, dtype: str, device: str) -> dict:
    """The decode step's ``p``: each projection weight stored (in, out) and handed to ``F.linear`` as its (out, in)
    transposed view, so that ``F.linear``'s product reads an untransposed operand. Over a few rows that reads the
    weight faster (torch 2.13's CPU product, one core, Intel Xeon, two runs of `scripts/projection-costs`: a 2048 x
    2048 weight over 4 rows in 0.79-0.92 ms against 0.99-1.10 stored (out, in); one row 0.52-0.59 either way).
    The forward keeps the canonical layout: its products have thousands of rows."""
    p = param_tensors(params, dtype, device)
    return {
        name: value.t().contiguous().t() if name.startswith("w_") and value is not None and value.dim() == 2 else value
        for name, value in p.items()
    }  # (out, in) views of (in, out) copies, made once


def _tables(tables, dtype: str, device: str):
    return None if tables is None else tuple(to_tensor(t, dtype, device) for t in tables)


def _folded_mask(allowed: np.ndarray | None, group: int, device: str):
    return None if allowed is None else bool_tensor(folded_allowed(allowed, group), device)  # (B, 1, G*s, T)


def prepare_decode_run(
    cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype: str, device: str, allow_tf32: bool
) -> PreparedDecode:
    """A whole decode run through a fresh `TorchStaticCache` of the run's tokens."""
    p = decode_params(params, dtype, device)
    x_all = to_tensor(inputs.x, dtype, device)  # (B, N, D)
    calls = []
    for chunk in decode_chunks(cfg, inputs):
        mask = _folded_mask(chunk.allowed, cfg.group_size, device)
        tables = _tables(chunk.tables, dtype, device)  # (1|B, s, r/2) or None
        step = folded_step(cfg, inputs.batch, chunk.stop - chunk.start, dtype, device, tables, mask)
        calls.append((chunk, step))

    def run_all():
        cache = TorchStaticCache(cfg, inputs.batch, inputs.tokens, x_all)  # a fresh cache per run
        return [step(p, x_all[:, chunk.start : chunk.stop], cache, chunk.start) for chunk, step in calls]

    run_all = inference_run(run_all, device, allow_tf32)
    info = {
        "cache": cache_info(cfg, inputs.batch, inputs.tokens, x_all.element_size(), CACHE_LAYOUT),
        "gqa": "each group's query heads folded into SDPA's query axis (B, Hkv, G*s, Dk): K and V read once",
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return decode_prepared(run_all, device, info)


def prepare_decode_step(
    cfg: MHAConfig, params: MHAParams, data: DecodeStepInputs, dtype: str, device: str, allow_tf32: bool = False
) -> Prepared:
    """One timed step: ``data.step`` tokens written at slot ``data.context`` of a cache of ``context + step`` slots
    that holds the context (`common.decode_step_inputs`); every call writes the same slots, so each timed call is
    the same step, and allocates nothing that grows with the context."""
    context, batch = data.context, data.x.shape[0]
    p = decode_params(params, dtype, device)
    x = to_tensor(data.x, dtype, device)  # (B, s, D)
    cache = TorchStaticCache(cfg, batch, context + data.step, x)
    cache.k[:, :, :context], cache.v[:, :, :context] = (to_tensor(a, dtype, device) for a in (data.k, data.v))
    mask = _folded_mask(data.allowed, cfg.group_size, device)
    forward = folded_step(cfg, batch, data.step, dtype, device, _tables(data.tables, dtype, device), mask)

    def run(rec: StageRecorder | None, until: str | None = None):
        return forward(p, x, cache, context, rec, until)

    run = inference_run(run, device, allow_tf32)
    groups = path_groups(rope=cfg.rope is not None, decode=True, fused=True)
    cuts = eager_cuts(lambda until: run(None, until), groups, synchronizer(device))
    info = {
        "cache": cache.info(cfg),
        "context": context,
        "step": data.step,
        "mask": "none: one token sees every slot" if mask is None else "bool, the group folded",
        "torch_dtype": str(torch_dtype(dtype)).removeprefix("torch."),
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return recorded_prepared(run, device, info, stage_cuts=cuts)
