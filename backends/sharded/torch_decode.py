"""`torch-tp`'s KV-cache decode: each rank keeps its heads' Hugging Face cache through a whole run.

One request runs a whole decode (the prefill and every step) inside every rank: the worker
protocol answers one request at a time, so the cache lives in the rank for the length of the
request, which is the length of the run. Each rank holds the torch adapter's cache
(`torch.decode.TorchKVCache`, Hugging Face's ``(B, Hkv_local, T, D)``, dynamic or static, a
ring of `core.decode.ring_capacity` slots with a window) for its own kv heads only: ``Hkv /
world`` of them, or, with fewer kv heads than ranks (``manual`` only), the one its group of
``world / Hkv`` ranks shares (`core.shard_plan`). Each chunk is the torch adapter's decode step
(`torch.decode.DecodeRowSampleMHA.step`: its projections, split, QK-norm, rotary, cache write,
attention on the slots' positions, merge) on the rank's heads, ending in its partial output;
one all-reduce of the partial outputs per chunk (and ``+ b_o`` once) gives the output.

The two strategies, as in the forward (`sharded.torch`):

* ``manual``: the rank's shard of the canonical parameters (`core.shard_params`), the partial
  output ``F.linear(merged, w_o[:, cols])`` then one ``dist.all_reduce`` and ``+ b_o``;
* ``standard``: the projections and the output projection are the ``q_proj`` .. ``o_proj`` of
  the forward's `parallelize_module` (ColwiseParallel, RowwiseParallel on a DeviceMesh): the
  step calls them for its chunk's projections and its output, and RowwiseParallel's all-reduce
  is the chunk's one collective. It refuses fewer kv heads than ranks, as the forward does.

The benchmark's one step (`build_decode_step`, `Backend.prepare_decode`) is one request per call on a
cache of the torch adapter's random numbers for the same seed, each rank keeping its kv heads' part.

A projection-wide QK-norm adds its two all-reduces of the sums of squares per chunk (as in the
forward); ALiBi's slopes are the rank's slice of the whole layer's series; sinks and T5's table
columns are the rank's heads'.

MLA's ``naive`` and ``absorbed`` decode through a latent cache instead (`torch_mla.build_decode`): each rank the
whole ``[c | k_rope]`` (B, T, R + dr), replicated, its heads' partial outputs, one all-reduce per chunk.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, ShardPlan, shard_params, shard_plan
from mha_rosetta.core.decode import DecodeInputs, cache_capacity, decode_stage_names, ring_capacity
from mha_rosetta.core.variants import norm_step

from ..decoding import kv_cache_bytes
from .common import sharded_cache_info

DYNAMIC, STATIC = "dynamic", "static"
DECODE_LAYOUTS = {
    DYNAMIC: "each rank its kv heads' (B, Hkv_local, T, Dk) and (B, Hkv_local, T, Dv), grown with torch.cat on T "
    "every step (Hugging Face's DynamicCache layout), kept through the run; with a window a ring of W - 1 + step "
    "slots",
    STATIC: "each rank its kv heads' (B, Hkv_local, T, Dk) and (B, Hkv_local, T, Dv), preallocated to T slots "
    "and written at a write index (Hugging Face's StaticCache layout), kept through the run; with a window a ring "
    "of W - 1 + step slots",
}
CACHE_LAYOUT = "(B, Hkv_local, T, Dk), (B, Hkv_local, T, Dv) per rank"


def rank_norm_sum(cfg: MHAConfig, plan: ShardPlan):
    """``norm_sum(squares, which)`` of a rank of torch-tp (`torch.heads.RowHeadSteps`): a projection-wide QK-norm's
    statistic, this rank's sum of squares (B, N, 1) summed over the ranks (a kv head on ``r`` ranks counted once);
    None when the registry's `NormStep` is off or per head (each rank holds whole heads: nothing to add up)."""
    step = norm_step(cfg)
    if step is None or step.per_head:
        return None
    import torch.distributed as dist

    def norm_sum(squares, which: str):
        dist.all_reduce(squares)  # one all-reduce for q, one for k
        return squares / plan.kv_replicas if which == "k" and plan.kv_replicas > 1 else squares

    return norm_sum


def _rank_layer(
    forward, rank, world, cfg: MHAConfig, params: MHAParams, x, positions, valid, kv_positions, dtype, strategy
):
    """This rank's decode layer over ``x`` (B, s, D) at ``positions`` (B, s) (``kv_positions``: every position its
    cache will hold, for the score bias's range), and the autograd mode its steps run in. ``forward``: the rank's
    DeviceMesh and `sharded.torch`'s parallelised module builder (it passes them: it imports this module)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from ..base import STANDARD
    from ..torch.common import to_tensor
    from ..torch.decode import DecodeRowSampleMHA
    from ..torch.variants import ScoreBias
    from .common import alibi_slopes_of, shard_variant_params

    plan = shard_plan(cfg, world)
    local_cfg = plan.local_cfg
    shard = dataclasses.replace(shard_params(cfg, params, world)[rank], **shard_variant_params(cfg, params, plan, rank))
    b_o = None if params.b_o is None else to_tensor(params.b_o, dtype, "cpu")

    module = None
    if strategy == STANDARD:
        module = forward.head_parallel_module(cfg, params, dtype, forward.mesh, attend=None)

    class RankDecodeLayer(DecodeRowSampleMHA):
        """The torch adapter's decode step on this rank's heads, its output all-reduced (module docstring)."""

        def _projections(self):
            if module is None:
                return super()._projections()
            return module.q_proj(self.x_q), module.k_proj(self.x_k), module.v_proj(self.x_v)  # this rank's features

        def _finish(self, merged, rec):
            merged = self._gated(merged, rec)  # the gate's rows are this rank's heads' (shard_variant_params)
            if module is None:
                output = self.F.linear(merged, self.w_o, None)  # this rank's partial output (B, s, D)
                dist.all_reduce(output)  # the chunk's one all-reduce of the partial outputs
                output = output if b_o is None else output + b_o
                how = "F.linear(merged, W_o[:, its heads' columns]), dist.all_reduce, + b_o"
            else:
                output = module.o_proj(merged)  # RowwiseParallel: partial outputs all-reduced, then + b_o once
                if isinstance(output, AsyncCollectiveTensor):  # wait here: rank > 0 never reads its outputs
                    output = output.wait()
                how = "RowwiseParallel o_proj: the partial outputs all-reduced, + b_o once"
            if rec is not None:
                rec.record("output", output, ("B", "Nq", "D"), how)
            return output

    layer = RankDecodeLayer(local_cfg, dataclasses.replace(shard, b_o=None), x, positions, valid, dtype, "cpu")
    layer.norm_sum = rank_norm_sum(cfg, plan)  # None unless the norm spans the projection
    layer.norm_widths = (cfg.q_width, cfg.k_width)  # the whole layer's widths, which its statistic is over
    layer.set_position_tables(positions, kv_positions, dtype, "cpu")
    if layer.bias_tables is not None:  # the rank's slice of the layer's ALiBi slopes, not a local series
        _, lowest, highest = layer.bias_tables
        span = SimpleNamespace(
            positions=np.array(positions, dtype=np.int64), kv_positions=np.array(kv_positions)
        )  # copies
        bias = ScoreBias(local_cfg, span, dtype, "cpu", alibi_slopes_of(cfg, plan, rank))
        layer.bias_tables = (bias, lowest, highest)
    # Under inference_mode DTensor resolves RowwiseParallel's partial sums with two all-gathers (sharded.torch).
    return layer, torch.inference_mode if module is None else torch.no_grad


def build_decode(
    forward, rank, world, cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype, strategy, payload_world, cache
):
    """One decode run on this rank: its layer, its cache kind, the run and what it exposes (MLA's forms: each rank
    its whole latent cache, `torch_mla.build_decode`)."""
    if payload_world != world:
        raise ValueError(f"a case for world={payload_world} sent to a group of {world} ranks")
    from .._mla import MLA_STRATEGIES

    if strategy in MLA_STRATEGIES:
        from .torch_mla import build_decode as build_mla_decode

        return build_mla_decode(rank, world, cfg, params, inputs, dtype, strategy)
    import torch

    from .._recording import StageRecorder
    from ..base import STANDARD, canonical_stage, tensor_to_numpy
    from ..torch.common import torch_dtype
    from ..torch.decode import TorchKVCache

    plan = shard_plan(cfg, world)
    local_cfg = plan.local_cfg
    positions = inputs.positions
    layer, mode = _rank_layer(
        forward, rank, world, cfg, params, inputs.x, positions, inputs.valid, positions, dtype, strategy
    )
    ring = ring_capacity(cfg, inputs.step)
    slots = cache_capacity(cfg, inputs.tokens, inputs.step)
    chunks = inputs.chunks()
    names = [name for name in decode_stage_names(local_cfg) if name != "output"]
    state: dict = {}

    def run_all(recorders=None):
        kv, outputs = TorchKVCache(cache, inputs.batch, local_cfg, ring=ring, capacity=slots, like=layer.w_q), []
        with mode():
            for i, (start, stop) in enumerate(chunks):
                outputs.append(layer.step(kv, start, stop, None if recorders is None else recorders[i]))
        state.update(outputs=outputs, slots=kv.slots, bytes=kv.nbytes)
        return outputs

    from .common import run_and_fetch

    run, fetch = run_and_fetch(run_all, state, rank)

    def stages():
        """Per chunk: this rank's canonical stages (its heads) and the all-reduced output."""
        recorders = [StageRecorder() for _ in chunks]
        outputs = run_all(recorders)
        out = []
        for recorder, output in zip(recorders, outputs, strict=True):
            recorded = recorder.stages()  # the output is the all-reduced one, below
            local = {name: canonical_stage(name, recorded[name]) for name in names if name in recorded}
            out.append((local, tensor_to_numpy(output)))
        return out

    itemsize = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    per_rank = kv_cache_bytes(cfg, inputs.batch, slots, itemsize, plan.local_kv_heads)
    info = {
        "cache": sharded_cache_info(cache, CACHE_LAYOUT, slots, per_rank, world),
        "world": world,
        "plan": plan.describe(),
        "how": (
            "one request runs the prefill and every step in each rank, its heads' cache kept through them; "
            + (
                "dist.all_reduce of each chunk's partial outputs, + b_o"
                if strategy != STANDARD
                else "parallelize_module q/k/v/o projections, RowwiseParallel's all-reduce per chunk"
            )
        ),
        "chunks": len(chunks),
    }
    return {"info": info, "run": run, "fetch": fetch, "stages": stages}


def build_decode_step(
    forward,
    rank,
    world,
    cfg: MHAConfig,
    params: MHAParams,
    batch,
    context,
    step,
    dtype,
    strategy,
    payload_world,
    cache,
    seed,
):
    """The benchmark's one step on this rank (`Backend.prepare_decode`): ``step`` new tokens at positions
    ``context ..`` onto its heads' cache already holding ``context`` tokens (a window's ring full).

    The numbers are the torch adapter's (`torch.decode.prepare_torch_decode_step`): the step's x, then the
    whole layer's random K and V (`torch.decode.random_cache`), of which each rank keeps its kv heads', so
    that one seed gives torch and torch-tp the same step. Each call writes the step and then puts the
    cache's state back, so every call times the same step (and its one all-reduce).
    """
    if payload_world != world:
        raise ValueError(f"a case for world={payload_world} sent to a group of {world} ranks")
    import torch

    from .._recording import record_stages
    from ..base import canonical_stage, tensor_to_numpy
    from ..torch.decode import TorchKVCache, random_cache

    plan = shard_plan(cfg, world)
    rng = np.random.default_rng(seed)
    ring = ring_capacity(cfg, step)
    total = context + step
    x = rng.standard_normal((batch, step, cfg.d_model))  # (B, step, D): the same on every rank
    new_positions = np.broadcast_to(np.arange(context, total, dtype=np.int64), (batch, step))  # (B, step)
    held = context if ring is None else min(context, ring)  # the tokens the cache keeps before the step
    kv_positions = np.arange(context - held, total, dtype=np.int64)[None]  # (1, held + step)
    valid = np.ones((batch, step), dtype=bool)
    layer, mode = _rank_layer(
        forward, rank, world, cfg, params, x, np.ascontiguousarray(new_positions), valid, kv_positions, dtype, strategy
    )
    slots = cache_capacity(cfg, total, step)
    kv = TorchKVCache(cache, batch, plan.local_cfg, ring=ring, capacity=slots, like=layer.w_q)
    if held:
        k_all, v_all = random_cache(rng, cfg, batch, held, dtype, "cpu")  # (B, Hkv, held, d): the whole layer's
        heads = plan.kv_heads_of(rank)
        k_old, v_old = k_all[:, heads.start : heads.stop], v_all[:, heads.start : heads.stop]  # this rank's, views
        old = torch.from_numpy(np.broadcast_to(kv_positions[:, :held], (batch, held)).copy())
        kv.write(k_old, v_old, old, torch.ones_like(old, dtype=torch.bool), context - held)
    saved = kv.state()
    state: dict = {}

    def one_step(rec=None):
        try:
            with mode():
                return layer.step(kv, 0, step, rec, token=context)  # (B, step, D), all-reduced
        finally:
            kv.restore(saved)

    def run():
        state["output"] = one_step()

    def fetch():
        return tensor_to_numpy(state["output"]) if rank == 0 else None

    def stages():
        """One chunk: this rank's canonical stages and the all-reduced output."""
        recorded = record_stages(one_step)
        names = [name for name in decode_stage_names(plan.local_cfg) if name != "output"]
        local = {name: canonical_stage(name, recorded[name]) for name in names if name in recorded}
        return [(local, tensor_to_numpy(recorded["output"].value))]

    per_rank = kv_cache_bytes(cfg, batch, slots, layer.w_q.element_size(), plan.local_kv_heads)
    info = {
        "cache": sharded_cache_info(cache, CACHE_LAYOUT, slots, per_rank, world),  # after the step
        "context": context,
        "step": step,
        "world": world,
        "plan": plan.describe(),
        "how": "one request per step: each rank writes its heads' keys, attends, one all-reduce; the cache restored",
    }
    return {"info": info, "run": run, "fetch": fetch, "stages": stages}
