"""What the sharded backends (`jax-sharded`, `torch-tp`) share: a worker group, the head plan, prepare.

Each splits the layer's heads over ``world`` ranks (`core.shard_plan`) and runs in worker
processes (`workers`): a configuration whose heads do not split is refused with the
plan's reason, and a case is prepared by sending the canonical parameters, the inputs and
the world size to the workers, which build, compile and keep it.

Multi-head latent attention runs in both, in its own two strategies (``naive``, ``absorbed``: `backends._mla`),
split as Megatron and vLLM split it (`core.sharding`): each rank its heads' rows and columns, the latent's down
projections replicated, so every rank computes, and in decode caches, the whole latent ``[c | k_rope]``
(`replicated_latent_cache`; `rank_latent_caches` reads each rank's copy).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.core import STAGE_BY_NAME, MHAConfig, MHAInputs, MHAParams, ShardPlan, shard_plan
from mha_rosetta.core.variants import norm_step

from .._mla import MLAStrategies, latent_cache_info
from ..base import Backend, DecodeStep, Prepared, PreparedDecode, StageTensor, tensor_to_numpy
from ..frameworks.score_parts import distance_slopes, head_params, head_slice
from .workers import WorkerGroup, worker_prepared

PREPARE_SECONDS = 300.0  # building and compiling on a loaded machine can be slow
FORWARD_SECONDS = 120.0
DECODE_SECONDS = 300.0  # a whole decode run (the prefill and every step; jax-sharded compiles its two programs)


def check_positive_int(name: str, value: object, rule: str = "a positive int") -> None:
    """A sharded backend's count argument (ranks, devices, threads): a ValueError naming ``name`` and ``rule`` unless
    ``value`` is an int above 0 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


class ShardedBackend(MLAStrategies, Backend):
    """MLA (issue 45) in its ``naive`` and ``absorbed`` strategies on every sharded backend (`MLAStrategies`): the
    heads' weights split as `core.sharding` says, the latent's replicated; a whole decode run, no timed step yet."""

    splits_heads = True  # a configuration whose heads do not split over the ranks is refused, with the reason
    rank_noun = "ranks"  # what the plan's ranks are, for messages ("devices", "ranks")
    own_processes = True  # the ranks (torch-tp) or the mesh worker (jax-sharded): `Backend.own_processes`

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._group: WorkerGroup | None = None

    # -- what a subclass provides -------------------------------------------------------------
    def world_for(self, cfg: MHAConfig) -> int:
        raise NotImplementedError

    def _new_group(self) -> WorkerGroup:
        raise NotImplementedError

    def plan_reason(self, plan: ShardPlan, strategy: str) -> str | None:
        """Why a strategy cannot run a valid plan (None: it can)."""
        return None

    # -- shared ---------------------------------------------------------------------------------
    def group(self) -> WorkerGroup:
        """The worker processes, started anew when there are none or one has gone."""
        if self._group is None or not self._group.alive:
            self.close()
            self._group = self._new_group()
        return self._group

    def close(self) -> None:
        """Stop the worker processes (the next prepare starts new ones)."""
        if self._group is not None:
            self._group.close()

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        return super().unsupported_reason(cfg, dtype, device, strategy) or self._head_plan_reason(cfg, strategy)

    def decode_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str, cache: str | None) -> str | None:
        """The base's decode rules (rule 8), then the head plan's, as for the forward."""
        return super().decode_reason(cfg, dtype, device, strategy, cache) or self._head_plan_reason(cfg, strategy)

    def _head_plan_reason(self, cfg: MHAConfig, strategy: str) -> str | None:
        """Why ``cfg``'s heads cannot be split over this backend's ranks for ``strategy``, or None."""
        try:
            plan = shard_plan(cfg, self.world_for(cfg))
        except ValueError as error:
            return f"{self.name}: {error}"
        reason = self.plan_reason(plan, strategy)
        return None if reason is None else f"{self.name}: {reason}"

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache) -> PreparedDecode:
        """A whole decode run inside the workers: "decode_prepare" sends the case (each worker builds and keeps
        its heads' part), "decode_run" runs the prefill and every step there (each rank's cache stays on it
        between the steps), "decode_fetch" returns every token's output (rank 0's, all-reduced) and
        "decode_stages" each chunk's stages, gathered by `_decode_chunk_stages`."""
        world = self.world_for(cfg)
        plan = shard_plan(cfg, world)
        group = self.group()
        payload = ("run", cfg, params, inputs, dtype, strategy, world, cache)
        what = f"preparing a {strategy} decode on {world} {self.rank_noun}"
        key, info = group.request("decode_prepare", payload, PREPARE_SECONDS, what=what)[0]

        def run():
            answer = group.request("decode_run", key, DECODE_SECONDS, what="running the decode")[0]
            info.update(answer or {})  # e.g. jax-sharded's compilations of this run
            return key

        def to_numpy(_token) -> np.ndarray:
            return tensor_to_numpy(group.request("decode_fetch", key, FORWARD_SECONDS, what="fetching the outputs")[0])

        def step_stages() -> list[dict[str, StageTensor]]:
            answers = group.request("decode_stages", key, DECODE_SECONDS, what="gathering the step stages")
            return self._decode_chunk_stages(answers, plan)

        return PreparedDecode(run, to_numpy, step_stages, info=info)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        """The benchmark's one step (`Backend.prepare_decode`) in the workers: "decode_prepare" with a "step"
        payload builds each rank's cache of ``context`` random tokens; ``forward`` is one "decode_run" request
        (each rank writes and attends its heads, one all-reduce, then restores its cache), so its time includes
        the request's round trip to the workers, as the sharded forward's does."""
        world = self.world_for(cfg)
        plan = shard_plan(cfg, world)
        group = self.group()
        payload = (
            "step",
            cfg,
            params,
            job.batch,
            job.context,
            job.step,
            job.dtype,
            job.strategy,
            world,
            job.cache,
            job.seed,
        )
        what = f"preparing a {job.strategy} decode step at context {job.context} on {world} {self.rank_noun}"
        key, info = group.request("decode_prepare", payload, PREPARE_SECONDS, what=what)[0]

        def forward():
            group.request("decode_run", key, FORWARD_SECONDS, what="running the decode step")
            return key

        def to_numpy(_token) -> np.ndarray:
            return tensor_to_numpy(group.request("decode_fetch", key, FORWARD_SECONDS, what="fetching the output")[0])

        def native_stages() -> dict[str, StageTensor]:
            answers = group.request("decode_stages", key, FORWARD_SECONDS, what="gathering the step's stages")
            return self._decode_chunk_stages(answers, plan)[0]

        return Prepared(forward=forward, to_numpy=to_numpy, native_stages=native_stages, info=info)

    def rank_latent_caches(self, token) -> list[np.ndarray]:
        """Each rank's (device's) MLA latent cache after a decode run, in rank order, as NumPy (B, T, R + dr):
        ``token`` is what the run's ``PreparedDecode.run`` returned. Every rank holds the whole latent (replicated):
        the tests compare each with the single-device cache (`core.mla_forms.mla_decode`)."""
        answers = self.group().request("decode_cache", token, FORWARD_SECONDS, what="fetching the latent caches")
        return [cache for answer in answers for cache in answer]  # each rank answers a list: its device(s)' caches

    def _decode_chunk_stages(self, answers: list, plan: ShardPlan) -> list[dict[str, StageTensor]]:
        """The workers' answers to "decode_stages" -> per chunk, canonical stage tensors. Each rank answers
        a list of ``(stages, output)`` per chunk: its heads' canonical stages and the all-reduced output."""
        chunks = []
        for number in range(len(answers[0])):
            per_rank = [answer[number][0] for answer in answers]
            stages = per_rank[0] if len(answers) == 1 else gather_heads(plan, per_rank)
            stages["output"] = answers[0][number][1]
            note = f"chunk {number}: each rank's heads ({plan.describe()}), side by side in rank order"
            chunks.append({name: StageTensor(value, STAGE_BY_NAME[name].shape, note) for name, value in stages.items()})
        return chunks

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        world = self.world_for(cfg)
        payload = (cfg, params, inputs, dtype, strategy, world)  # validated inputs: arrays, mask, positions
        what = f"preparing {strategy} on {world} {self.rank_noun}"
        plan = shard_plan(cfg, world)
        stages_of = partial(self._stages, plan=plan)
        return worker_prepared(self.group(), payload, what, (PREPARE_SECONDS, FORWARD_SECONDS), stages_of)

    def _stages(self, answers: list, plan: ShardPlan) -> dict[str, StageTensor]:
        """The workers' answers to "stages" -> canonical stage tensors (rank 0's: already the layer's)."""
        stages, note = answers[0]
        return {name: StageTensor(value, STAGE_BY_NAME[name].shape, note) for name, value in stages.items()}


def latent_cache_of(decoder: dict):
    """The worker side of "decode_cache": a decode run's latent cache (MLA's naive and absorbed runs keep one, as
    NumPy: a rank's, or each device's in a list), or a ValueError saying that this run keeps none."""
    if "cache" not in decoder:
        raise ValueError("this decode run keeps no latent cache (only MLA's naive and absorbed runs do)")
    return decoder["cache"]()


def replicated_latent_cache(cfg: MHAConfig, batch: int, slots: int, itemsize: int, layout: str, world: int,
                            noun: str) -> dict:  # fmt: skip
    """``info["cache"]`` of MLA's latent cache held whole on each of ``world`` ranks (``noun``: "ranks", "devices"):
    `latent_cache_info`'s record of one copy, with ``bytes`` counting every copy (as the sharded caches count a
    replicated kv head) and ``bytes_per_rank`` / ``bytes_per_device`` one. The latent has no head axis to split, so
    a rank's cache is no smaller than the single-device one: ``kv_lora_rank + d_rope`` numbers a token per rank."""
    record = latent_cache_info(cfg, batch, slots, itemsize, layout)
    one = record["bytes"]
    record.update(bytes=one * world, replicated=f"the whole latent on each of the {world} {noun}")
    record[f"bytes_per_{noun.removesuffix('s')}"] = one
    record["note"] += f"; per {noun.removesuffix('s')}: the latent is replicated, not split by head"
    return record


def gather_heads(plan: ShardPlan, per_rank: list[dict]) -> dict[str, np.ndarray]:
    """Each rank's canonical stage tensors (its heads only) -> the layer's, heads side by side in rank
    order. A kv head replicated on several ranks is taken once; stages with no head axis (the
    partial outputs) are left out: the output is the all-reduced one."""
    gathered = {}
    for name in per_rank[0]:
        shape = STAGE_BY_NAME[name].shape
        axis = next((i for i, symbol in enumerate(shape) if symbol.startswith("H")), None)
        if axis is None:
            continue
        ranks = range(0, plan.world, plan.kv_replicas) if shape[axis].startswith("Hkv") else range(plan.world)
        gathered[name] = np.concatenate([per_rank[rank][name] for rank in ranks], axis=axis)
    return gathered


def shard_variant_params(cfg: MHAConfig, params: MHAParams, plan: ShardPlan, rank: int) -> dict:
    """The variants' parameters of ``rank``'s heads (`core.shard_params` splits the 2017-23 ones), by field name.

    Split the way the heads are: the parameters with one entry per query head (`score_parts.head_params`: the
    sinks ``(H,)``, T5's table columns ``(buckets, H)``) along their head axis; QK-norm over each head has one
    ``(Dk,)`` weight for all heads, replicated;
    over the whole projection its ``(H*Dk,)`` / ``(Hkv*Dk,)`` weights by the rows of the
    rank's query / kv heads (the statistic over the whole width is the rank's business: an
    all-reduce of the sum of squares), both by the fields the registry's `NormStep` names; the output
    gate by the rows of the rank's query heads. None where the variant is off (QK-norm's weights: left
    out). Copies, not views.
    ALiBi's slopes are no parameter: see `alibi_slopes_of`.
    """
    heads, kv = plan.heads_of(rank), plan.kv_heads_of(rank)
    Dk = cfg.d_k

    def take(array, index):
        return None if array is None else np.array(array[index], copy=True)

    step, norms = norm_step(cfg), {}  # QK-norm's place and weight fields, from the registry (None: off)
    if step is not None:
        for which, own in (("q", heads), ("k", kv)):
            # the shared (Dk,), or the rows of the rank's heads: (Hl*Dk,) for q, (local kv*Dk,) for k
            rows = slice(None) if step.per_head else slice(own.start * Dk, own.stop * Dk)
            norms[step.weight(which)] = take(getattr(params, step.weight(which)), rows)
    return {
        **norms,
        # (Hl,), (buckets, Hl): the rank's heads along each one's head axis
        **{
            spec.name: take(getattr(params, spec.name), head_slice(spec, slice(heads.start, heads.stop)))
            for spec in head_params()
        },
        # The output gate's rows are per head (row block h gates head h's context, Dv == Dk): they shard with the
        # query heads, like w_q's rows, so each rank gates its own merged heads before its partial w_o product.
        "w_gate": take(params.w_gate, slice(heads.start * cfg.d_v, heads.stop * cfg.d_v)),  # (Hl*Dv, D)
        "b_gate": take(params.b_gate, slice(heads.start * cfg.d_v, heads.stop * cfg.d_v)),  # (Hl*Dv,)
    }


def sharded_cache_info(kind: str, layout: str, slots: int, per_rank: int, world: int, rank: str = "rank") -> dict:
    """``info["cache"]`` of a K and V cache split over ``world`` ranks: ``per_rank`` bytes on each (under
    ``bytes_per_rank``, or ``bytes_per_device`` with ``rank="device"``) and every rank's together under ``bytes`` (a
    replicated kv head counted per copy)."""
    return {"kind": kind, "layout": layout, "slots": slots, "bytes": per_rank * world, f"bytes_per_{rank}": per_rank}


def variant_shards(cfg: MHAConfig, params: MHAParams, world: int) -> list[dict]:
    """Each rank's variant parameters, by name, those present only: `shard_variant_params` and, with ALiBi, the
    slopes of the rank's heads under ``"slopes"`` (`alibi_slopes_of`). jax-sharded's form (its programs take them
    as one dict per rank)."""
    plan = shard_plan(cfg, world)
    shards = []
    for rank in range(world):
        split = shard_variant_params(cfg, params, plan, rank)
        own = {name: value for name, value in split.items() if value is not None}
        slopes = alibi_slopes_of(cfg, plan, rank)  # (Hl,): the whole layer's slopes of its heads
        if slopes is not None:
            own["slopes"] = slopes
        shards.append(own)
    return shards


def alibi_slopes_of(cfg: MHAConfig, plan: ShardPlan, rank: int) -> np.ndarray | None:
    """The ALiBi slopes of ``rank``'s query heads: a slice of the whole layer's (the local head count's own
    slopes would be another series), or None without ALiBi."""
    slopes = distance_slopes(cfg)  # the whole layer's, or None
    if slopes is None:
        return None
    heads = plan.heads_of(rank)
    return slopes[heads.start : heads.stop]  # (Hl,)


def run_and_fetch(run_all, state: dict, rank: int):
    """(run, fetch) of a whole decode run on a rank: ``run`` runs ``run_all``, which keeps the chunks' outputs in
    ``state["outputs"]``; ``fetch`` gives rank 0's, concatenated (B, N, D) (the all-reduced output: one rank's is all)."""

    def run():
        run_all()
        return None

    def fetch():
        import torch

        return tensor_to_numpy(torch.cat(state["outputs"], dim=1)) if rank == 0 else None  # (B, N, D)

    return run, fetch
