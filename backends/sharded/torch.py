"""`torch-tp`: the layer's heads split over processes with torch.distributed (tensor parallelism).

``world`` processes (2 by default), each a rank of a gloo process group on this machine,
each holding ``H / world`` heads. Two ways PyTorch users write it, as two strategies:

* ``standard``: a module with ``nn.Linear`` projections ``q_proj``, ``k_proj``, ``v_proj``,
  ``o_proj`` on a 1-D `DeviceMesh`, parallelised with `parallelize_module`:
  `ColwiseParallel` for q/k/v (each rank keeps the **rows** of the ``(out, in)`` weight
  that produce its heads' features) and `RowwiseParallel` for the output (each rank keeps
  the **columns** of ``w_o`` that read its heads; the partial outputs are summed by one
  all-reduce, and the bias is added once). Between them each rank runs the torch adapter's
  own attention (`RowSampleMHA._attend_batched`) on its local heads.
* ``manual``: the same split written by hand: each rank gets its shard of the canonical
  parameters (`core.shard_params`), runs the torch adapter's standard strategy on its
  local configuration with ``b_o`` left out (the result is its partial output), then one
  ``dist.all_reduce`` and ``+ b_o``.

A dispatch mode counts the collectives of one forward pass (in `prepare`, untimed; what `CommDebugMode` counts):
`Prepared.info["all_reduces"]` is 1 for both strategies (3 with a projection-wide QK-norm,
below); the tests assert it.

The variants (issue 24), split the way the heads are (`common.shard_variant_params`), and what
each costs in collectives per forward pass:

* sinks ``(H,)`` and T5's table columns ``(buckets, H)``: each rank keeps its query heads'
  entries; ALiBi's slopes: each rank its heads' slice of the whole layer's series (the local
  head count's own series would be other slopes). No collective: the positions, and so every
  distance, bucket and window, are replicated with the inputs.
* QK-norm over each head: the one ``(Dk,)`` weight replicated. No collective.
* QK-norm over the whole projection: the weights by the rows of the rank's heads, but the
  statistic ``mean(x**2)`` runs over every head's features: each rank sums its own squares
  (``(B, N, 1)``) and **one all-reduce each for q and k** adds the ranks' sums (2 more, 3 in
  all; ``B * (Nq + Nk)`` numbers, tiny next to the output's ``B * Nq * D``). With kv heads
  replicated on ``r`` ranks the k sum counts each kv head ``r`` times and is divided by ``r``.
* the window, the other score steps, the qkv bias and rope scaling: rank-local arithmetic on its own heads.

MLA (`torch_mla`): its own two strategies, ``naive`` and ``absorbed``, each the torch adapter's form on the
rank's heads (its rows of q_b_proj and kv_b_proj, its columns of o_proj), the latent's down projections and norms
replicated, one all-reduce of the partial outputs (forward, and per chunk in decode, where each rank caches the
whole latent).

GQA: `ColwiseParallel` cuts the rows of ``w_k`` evenly, which keeps kv heads whole only
when ``world`` divides the kv heads; with fewer kv heads than ranks the standard strategy
refuses the case (it would cut a kv head in half) while ``manual`` replicates each kv
head on ``world / n_kv_heads`` ranks (Megatron's choice; see `core.sharding`).

Decoding through a KV cache (`torch_decode`, both strategies): one request runs a whole decode in
every rank, each keeping its heads' Hugging Face cache through it, one all-reduce per chunk.

Processes: started by the first `prepare` and reused by later ones (starting torch costs
seconds), torn down at exit or by `close()`. Every collective has a time limit
(``timeout`` of the process group) and every request a deadline; a rank that dies is
reported as a `WorkerError` naming it, and the group is restarted by the next prepare.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os
from types import SimpleNamespace
from typing import ClassVar

import numpy as np

from mha_rosetta.core import STAGE_BY_NAME, MHAConfig, MHAParams, shard_mask, shard_params, shard_plan

from .._mla import ABSORBED, MLA_STRATEGIES, NAIVE
from ..base import STANDARD, StageTensor, tensor_to_numpy
from ..frameworks.ops import RegistryVariants
from . import torch_decode
from .common import (
    PREPARE_SECONDS,
    ShardedBackend,
    alibi_slopes_of,
    check_positive_int,
    gather_heads,
    latent_cache_of,
    shard_variant_params,
)
from .workers import Programs, WorkerGroup, serve

MANUAL = "manual"
COLLECTIVE_SECONDS = 60  # gloo's limit on every collective


class TorchTPBackend(ShardedBackend):
    name = "torch-tp"
    convention = (
        "heads over gloo ranks: parallelize_module with ColwiseParallel q/k/v (rows of W) and RowwiseParallel "
        "output (columns of W_o), one all-reduce; or the same split by hand"
    )
    strategies = (STANDARD, MANUAL, NAIVE, ABSORBED)  # the last two: MLA's (`torch_mla`)
    # Each split as the module docstring says; no backward pass. MLA in its naive and absorbed strategies only.
    variants = RegistryVariants("torch")
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8: one request runs a whole decode in every rank, each keeping its heads' Hugging Face cache through
    # it, one all-reduce per chunk (`torch_decode`); both strategies, both cache kinds, every variant; MLA's forms
    # through each rank's whole latent cache (`torch_mla`).
    decode_caches = (torch_decode.DYNAMIC, torch_decode.STATIC)
    decode_strategies = (STANDARD, MANUAL, *MLA_STRATEGIES)
    decode_layouts: ClassVar[dict[str, str]] = torch_decode.DECODE_LAYOUTS

    def __init__(self, name: str | None = None, world: int = 2, threads: int = 1) -> None:
        super().__init__(name)
        check_positive_int("world", world)
        check_positive_int("threads", threads)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if world * threads > 4 * cores:
            raise ValueError(
                f"world={world} processes x threads={threads} would put {world * threads} threads on {cores} core(s)"
            )
        self.world, self.threads = world, threads

    def world_for(self, cfg: MHAConfig) -> int:
        return self.world

    def _stages(self, answers: list, plan) -> dict[str, StageTensor]:
        """Every rank's heads side by side (gathered here), and the all-reduced output."""
        stages = gather_heads(plan, [local for local, _output in answers])
        stages["output"] = answers[0][1]
        note = f"each rank's heads ({plan.describe()}), side by side in rank order"
        return {name: StageTensor(value, STAGE_BY_NAME[name].shape, note) for name, value in stages.items()}

    def plan_reason(self, plan, strategy: str) -> str | None:
        if strategy == STANDARD and plan.kv_replicas > 1:
            return (
                f"n_kv_heads={plan.cfg.n_kv_heads} < world={plan.world}: ColwiseParallel would cut a kv head "
                "in half; the 'manual' strategy replicates kv heads instead"
            )
        return None

    def _new_group(self) -> WorkerGroup:
        # A fresh rendezvous file for every start, in the group's own folder (gloo's FileStore must not be reused).
        return WorkerGroup(
            self.name, _rank_main, self.world, args=(self.threads,), start_timeout=PREPARE_SECONDS,
            scratch="mha-rosetta-tp-",
        )  # fmt: skip


# -- the rank processes -----------------------------------------------------------------------
def _rank_main(conn, rank: int, world: int, threads: int, folder: str) -> None:
    import torch
    import torch.distributed as dist

    store = os.path.join(folder, "store")
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=COLLECTIVE_SECONDS)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    programs = Programs(lambda *payload: _build(mesh, rank, world, *payload))

    def forward(key):
        programs[key]["result"] = programs[key]["run"]()

    def fetch(key):
        return tensor_to_numpy(programs[key]["result"])

    def stages(key):
        return programs[key]["stages"]()

    from .torch_decode import build_decode, build_decode_step

    # A decode run ("run": built once, then run whole, prefill and steps, per request, each rank keeping its
    # heads' cache) or the benchmark's one step ("step"), by the payload's first entry.
    builders = {"run": build_decode, "step": build_decode_step}
    forward_parts = SimpleNamespace(mesh=mesh, head_parallel_module=_head_parallel_module)  # what decode reuses
    decoders = Programs(lambda kind, *payload: builders[kind](forward_parts, rank, world, *payload))
    handlers = {"prepare": programs.prepare, "forward": forward, "fetch": fetch, "stages": stages}
    handlers.update(
        decode_prepare=decoders.prepare,
        decode_run=lambda key: decoders[key]["run"](),
        decode_fetch=lambda key: decoders[key]["fetch"](),
        decode_stages=lambda key: decoders[key]["stages"](),
        decode_cache=lambda key: [latent_cache_of(decoders[key])],  # MLA: `rank_latent_caches`
    )
    conn.send(("ok", {"rank": rank, "world": world, "threads": torch.get_num_threads()}))
    try:
        serve(conn, handlers)
    finally:
        dist.destroy_process_group()


def _count_all_reduces(counts: dict) -> int:
    return sum(n for op, n in counts.items() if "all_reduce" in str(op) or "allreduce" in str(op))


def _collective_counter():
    """A dispatch mode that counts the collectives run under it, by op (``counts``: name -> calls)."""
    return _collective_counter_type()()


@functools.cache
def _collective_counter_type():
    """The counter's class, built once per rank (its op list and torch's imports), not once per case.

    What `CommDebugMode` counts for this, without its module tracker: importing
    `torch.distributed.tensor.debug` cost each rank about 0.5 s (`python -X importtime`, torch 2.13),
    once per group. The collectives are the ops CommDebugMode lists (`_comm_mode.c10d_collective_ops`
    and the native functional ones of ``NATIVE_TO_PY_MAPPING``, torch 2.13), by their native names.
    """
    from collections import Counter

    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    functional = (  # DTensor's redistributions
        "all_gather_into_tensor all_gather_into_tensor_coalesced all_reduce all_reduce_coalesced "
        "all_to_all_single broadcast reduce_scatter_tensor reduce_scatter_tensor_coalesced"
    ).split()
    c10d = (  # what torch.distributed's calls dispatch to
        "_allgather_base_ _reduce_scatter_base_ allgather_ allgather_coalesced_ allgather_into_tensor_coalesced_ "
        "allreduce_ allreduce_coalesced_ alltoall_ alltoall_base_ broadcast_ gather_ scatter_ reduce_ "
        "reduce_scatter_ reduce_scatter_tensor_coalesced_"
    ).split()
    collectives = {f"{space}.{op}" for space in ("_c10d_functional", "c10d_functional") for op in functional}
    collectives |= {f"c10d.{op}" for op in c10d}

    class CollectiveCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # DTensor first turns the op into the local ops and collectives it stands for; they come
            # back through this mode (as in CommDebugMode; other subclasses are counted as they are).
            if DTensor in types:
                return NotImplemented
            packet = getattr(func, "_overloadpacket", None)
            if packet is not None and str(packet) in collectives:
                self.counts[str(packet)] += 1
            return func(*args, **(kwargs or {}))

    return CollectiveCounter


def _build(mesh, rank, world, cfg, params, inputs, dtype, strategy, payload_world):
    """One case on this rank: its forward (MLA's forms: `torch_mla`), and the collectives it makes."""
    if payload_world != world:
        raise ValueError(f"a case for world={payload_world} sent to a group of {world} ranks")
    import torch

    plan = shard_plan(cfg, world)
    if strategy in MLA_STRATEGIES:
        from .torch_mla import build_forward

        run, how, local_stages = build_forward(rank, world, cfg, params, inputs, dtype, strategy)
    else:
        run, how, local_stages = _head_split(mesh, rank, world, plan, cfg, params, inputs, dtype, strategy)

    # No autograd either way; but under inference_mode DTensor resolves RowwiseParallel's partial
    # sums with two all-gathers instead of one all-reduce (CommDebugMode, torch 2.13 and 2.14),
    # so the DTensor path runs under no_grad.
    mode = torch.no_grad if strategy == STANDARD else torch.inference_mode

    def forward():
        with mode():
            return run()

    with _collective_counter() as comm:
        forward()
    counts = comm.counts
    info = {
        "world": world,
        "plan": plan.describe(),
        "how": how,
        "all_reduces": _count_all_reduces(counts),
        "collectives": dict(counts),
        "threads_per_rank": torch.get_num_threads(),
    }

    def stages():
        """This rank's stages (its heads', canonical) and the all-reduced output."""
        with torch.inference_mode():
            local = local_stages()
        return local, tensor_to_numpy(forward())

    return {"run": forward, "info": info, "stages": stages}


def _head_split(mesh, rank, world, plan, cfg, params, inputs, dtype, strategy):
    """(run, how, local stages) of the head-split strategies: the torch adapter's layer on this rank's heads."""
    import torch
    import torch.distributed as dist

    from .._recording import record_stages
    from ..base import canonical_stage
    from ..torch.common import to_tensor
    from ..torch.layer import RowSampleMHA

    local_cfg = plan.local_cfg
    local_inputs = dataclasses.replace(inputs, mask=shard_mask(inputs.mask, plan, rank))
    # The 2017-23 parameters split by core.shard_params, the variants' by common.shard_variant_params.
    shard = dataclasses.replace(shard_params(cfg, params, world)[rank], **shard_variant_params(cfg, params, plan, rank))
    b_o = None if params.b_o is None else to_tensor(params.b_o, dtype, "cpu")

    # The torch adapter on this rank's heads, without b_o: its output is this rank's partial output.
    layer = RowSampleMHA(
        local_cfg,
        dataclasses.replace(shard, b_o=None),
        local_inputs,
        dtype,
        "cpu",
        alibi_slopes=alibi_slopes_of(cfg, plan, rank),
        norm_sum=torch_decode.rank_norm_sum(cfg, plan),  # None unless the norm spans the projection
        norm_widths=(cfg.q_width, cfg.k_width),
    )

    if strategy == STANDARD:

        def attend(q, k, v):
            """This rank's heads through the torch adapter's own split (view + transpose), rotation (head-local),
            attention, merge and output gate (its rows: this rank's heads'): (B, N, local width) -> (B, Nq, Hl*Dv)."""
            q_heads, k_heads, v_heads = layer._split_and_rotate(None, (q, k, v))  # (B, Hl, Nq, Dk), ...
            return layer._gated(layer._merge(layer._attend_batched(q_heads, k_heads, v_heads, None), None), None)

        module = _head_parallel_module(cfg, params, dtype, mesh, attend)

        def run():
            output = module(layer.x_q, layer.x_k, layer.x_v)  # (B, Nq, D), replicated after the all-reduce
            # RowwiseParallel's all-reduce is a functional collective: wait for it before the result is used.
            return torch.ops._c10d_functional.wait_tensor(output)

        how = "parallelize_module: ColwiseParallel(q_proj, k_proj, v_proj), RowwiseParallel(o_proj)"
    else:

        def run():
            output = layer.standard()  # (B, Nq, D): this rank's heads only, no b_o
            dist.all_reduce(output)  # the one all-reduce: the sum over ranks of the partial outputs
            return output if b_o is None else output + b_o

        how = "by hand: shard_params, the torch adapter on the local heads, one dist.all_reduce, + b_o"

    def local_stages():  # from the torch adapter on its shard
        return {name: canonical_stage(name, stage) for name, stage in record_stages(layer.standard).items()}

    return run, how, local_stages


def _head_parallel_module(cfg: MHAConfig, params: MHAParams, dtype: str, mesh, attend):
    """q/k/v/o ``nn.Linear`` layers holding the canonical weights, parallelised over ``mesh``;
    ``attend(q, k, v)`` turns the local projections into the local merged heads."""
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ..torch.common import torch_dtype

    def linear(weight, bias):
        out_features, in_features = weight.shape
        layer = nn.Linear(in_features, out_features, bias=bias is not None, dtype=torch_dtype(dtype))
        with torch.no_grad():  # nn.Linear.weight is (out, in): the canonical layout, copied as is
            layer.weight.copy_(torch.from_numpy(np.asarray(weight, dtype=np.float64)))
            if bias is not None:
                layer.bias.copy_(torch.from_numpy(np.asarray(bias, dtype=np.float64)))
        return layer

    class HeadParallelAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = linear(params.w_q, params.b_q)
            self.k_proj = linear(params.w_k, params.b_k)
            self.v_proj = linear(params.w_v, params.b_v)
            self.o_proj = linear(params.w_o, params.b_o)

        def forward(self, x_q, x_k, x_v):
            # ColwiseParallel: each projection gives this rank's heads' features, (B, N, local width).
            merged = attend(self.q_proj(x_q), self.k_proj(x_k), self.v_proj(x_v))  # (B, Nq, Hl*Dv)
            return self.o_proj(merged)  # RowwiseParallel: partial outputs all-reduced, then + b_o once

    plan = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel()}
    plan["o_proj"] = RowwiseParallel()
    # Every rank builds the module from the same canonical weights, so each can cut its own shard:
    # src_data_rank=None (torch 2.7 and later) takes the local chunk, where the default (0) sends rank
    # 0's: 7 scatters and a broadcast per module (CommDebugMode around parallelize_module, torch 2.13).
    import inspect

    same_weights = (
        {"src_data_rank": None} if "src_data_rank" in inspect.signature(parallelize_module).parameters else {}
    )
    return parallelize_module(HeadParallelAttention(), mesh, plan, **same_weights)
