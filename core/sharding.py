"""Tensor-parallel (head-sharded) parameters: which rank holds which rows and columns.

Splitting an attention layer over ``world`` ranks by heads (Megatron-style tensor
parallelism), in the stored ``(out, in)`` layout of the canonical parameters:

* q, k and v are **column-parallel**: each rank computes the output features of its
  own heads, so it holds a block of **rows** of ``w_q``, ``w_k`` and ``w_v`` (rows
  ``h*d_k:(h+1)*d_k`` belong to head ``h``) and the matching slice of each bias. No
  communication: every rank reads the whole (replicated) input.
* the output is **row-parallel**: each rank holds the **columns** of ``w_o`` that read its
  heads' context and computes a partial output ``merged_r @ w_o[:, cols_r].T``; the sum
  of the partial outputs over the ranks (one all-reduce) is the output. ``b_o`` is
  replicated and added once, after the all-reduce.

("Column" and "row" parallel are named after the ``(in, out)`` matrix that ``x @ W``
multiplies; in the stored ``(out, in)`` layout they cut rows and columns respectively.)

Rank ``r`` holds query heads ``r*H/world ... (r+1)*H/world - 1``. Grouped-query attention:
when ``world`` divides the kv heads, each rank holds ``Hkv/world`` kv heads, exactly
those its query heads read; when the kv heads are fewer than the ranks and divide
``world``, each kv head is **replicated** on ``world/Hkv`` consecutive ranks (what
Megatron does), since every rank's query heads then lie inside one group. Anything else
has no head-aligned split and is refused with the reason.

Multi-head latent attention (`core.variants.mla`) shards the same way, as Megatron and vLLM shard it: a rank
holds its heads' rows of ``w_q`` (``q_b_proj``, or ``q_proj``), of ``w_k`` and ``w_v`` (``kv_b_proj``'s
``k_nope`` and ``v`` rows, ``qk_nope_head_dim`` and ``v_head_dim`` a head) and its columns of ``w_o``; the
down projections ``w_q_a``, ``w_kv_a`` (the latent ``c`` and the one rotary key every head shares), their
biases and RMSNorm weights read the whole input and feed every head, so they are **replicated** (`LATENT_PARAMS`):
every rank computes the whole latent, and a decode cache of it is replicated too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .config import MHAConfig, require_config
from .params import MHAParams, expected_param_shapes, validate_params
from .variants.mla import KV_PARAMS, Q_PARAMS

# MLA's down projections, their biases and latent norms (the entries' own parameters): replicated on every rank.
LATENT_PARAMS = tuple(spec.name for spec in (*KV_PARAMS, *Q_PARAMS))


@dataclass(frozen=True)
class ShardPlan:
    """How ``cfg``'s heads fall on ``world`` ranks."""

    cfg: MHAConfig
    world: int
    local_heads: int  # query heads per rank
    local_kv_heads: int  # kv heads per rank
    kv_replicas: int  # ranks holding each kv head (1: kv heads are split, not replicated)

    @property
    def local_cfg(self) -> MHAConfig:
        """The configuration one rank computes: its heads, the same widths and scale."""
        cfg = self.cfg
        return dataclasses.replace(
            cfg, n_heads=self.local_heads, n_kv_heads=self.local_kv_heads, d_k=cfg.d_k, d_v=cfg.d_v, scale=cfg.scale
        )

    def heads_of(self, rank: int) -> range:
        return range(rank * self.local_heads, (rank + 1) * self.local_heads)

    def kv_heads_of(self, rank: int) -> range:
        first = (rank // self.kv_replicas) * self.local_kv_heads
        return range(first, first + self.local_kv_heads)

    def describe(self) -> str:
        kv = (
            f"{self.local_kv_heads} kv head(s) each"
            if self.kv_replicas == 1
            else f"each kv head replicated on {self.kv_replicas} ranks"
        )
        return f"{self.world} ranks x {self.local_heads} query head(s), {kv}"


def _require_world(world: object) -> int:
    if isinstance(world, bool) or not isinstance(world, (int, np.integer)):
        raise TypeError(f"world must be an int (the number of ranks), got {world!r} ({type(world).__name__})")
    if world <= 0:
        raise ValueError(f"world must be a positive int (the number of ranks), got {world}")
    return int(world)


def shard_plan(cfg: MHAConfig, world: int) -> ShardPlan:
    """The head split of ``cfg`` over ``world`` ranks, or a ValueError saying why there is none."""
    require_config(cfg)
    world = _require_world(world)
    H, Hkv = cfg.n_heads, cfg.n_kv_heads
    if H % world:
        raise ValueError(
            f"world={world} does not divide n_heads={H}: tensor parallelism gives every rank whole heads "
            f"(choose a world size among {[w for w in range(1, H + 1) if H % w == 0]})"
        )
    if Hkv % world == 0:
        return ShardPlan(cfg, world, H // world, Hkv // world, 1)
    if world % Hkv == 0:
        return ShardPlan(cfg, world, H // world, 1, world // Hkv)
    raise ValueError(
        f"world={world} and n_kv_heads={Hkv}: neither divides the other, so the kv heads can be neither split "
        "whole over the ranks nor replicated on whole groups of ranks"
    )


def shard_params(cfg: MHAConfig, params: MHAParams, world: int) -> list[MHAParams]:
    """One `MHAParams` per rank, each valid for ``shard_plan(cfg, world).local_cfg``.

    Views of ``params`` are copied, so a shard can be sent or modified on its own. Every
    shard carries the whole ``b_o`` (replicated): a sharded forward adds it once, after
    the all-reduce, never on each rank; and, with MLA, the whole `LATENT_PARAMS` (replicated).
    The other variants' parameters are left out (`backends.sharded.common.shard_variant_params`).
    """
    plan = shard_plan(cfg, world)
    validate_params(cfg, params)
    shapes = expected_param_shapes(cfg)
    w_q, w_k, w_v, w_o = (shapes[name] for name in ("w_q", "w_k", "w_v", "w_o"))
    assert w_q and w_k and w_v and w_o, "every layer has the four projections"  # for the type checker: never None
    # Rows (columns of w_o) a head owns: d_k / d_v, or with MLA nope + rope for w_q, qk_nope_head_dim for w_k.
    q_head, k_head = w_q[0] // cfg.n_heads, w_k[0] // cfg.n_kv_heads
    v_head, o_head = w_v[0] // cfg.n_kv_heads, w_o[1] // cfg.n_heads
    shards = []
    for rank in range(plan.world):
        heads, kv = plan.heads_of(rank), plan.kv_heads_of(rank)
        q_rows = slice(heads.start * q_head, heads.stop * q_head)  # column-parallel: rows of the (out, in) weight
        k_rows = slice(kv.start * k_head, kv.stop * k_head)
        v_rows = slice(kv.start * v_head, kv.stop * v_head)
        o_cols = slice(heads.start * o_head, heads.stop * o_head)  # row-parallel: columns of w_o

        def take(array, index):
            return None if array is None else np.array(array[index], copy=True)

        shards.append(
            MHAParams(
                w_q=take(params.w_q, q_rows),  # (H/world*Dk, D)
                w_k=take(params.w_k, k_rows),  # (local kv*Dk, kdim)
                w_v=take(params.w_v, v_rows),  # (local kv*Dv, vdim)
                w_o=take(params.w_o, (slice(None), o_cols)),  # (D, H/world*Dv)
                b_q=take(params.b_q, q_rows),
                b_k=take(params.b_k, k_rows),
                b_v=take(params.b_v, v_rows),
                b_o=take(params.b_o, slice(None)),  # replicated, added once after the all-reduce
                # MLA's down projections and latent norms (None without MLA): replicated
                **{name: take(getattr(params, name), slice(None)) for name in LATENT_PARAMS},
            )
        )
    return shards


def unshard_params(cfg: MHAConfig, shards: list[MHAParams]) -> MHAParams:
    """The inverse of `shard_params`: exact, and it checks that replicated pieces agree."""
    if not isinstance(shards, (list, tuple)) or not shards:
        raise TypeError(f"shards must be a non-empty list of MHAParams (one per rank), got {shards!r}")
    plan = shard_plan(cfg, len(shards))
    local = plan.local_cfg
    for rank, shard in enumerate(shards):
        try:
            validate_params(local, shard)
        except (TypeError, ValueError) as error:
            raise ValueError(f"shards[{rank}] does not fit one rank of {plan.describe()}: {error}") from None

    def replicated(name: str, pieces: list) -> np.ndarray | None:
        if pieces[0] is None:
            return None
        for rank, piece in enumerate(pieces[1:], start=1):
            if not np.array_equal(piece, pieces[0]):
                raise ValueError(f"{name} differs between the ranks holding it (ranks 0 and {rank} of that group)")
        return pieces[0].copy()

    def kv(name: str):
        # One copy of each kv block: the first rank of each replica group.
        pieces = [getattr(shard, name) for shard in shards]
        step = plan.kv_replicas
        for start in range(0, plan.world, step):
            replicated(f"{name} (kv heads of ranks {start}..{start + step - 1})", pieces[start : start + step])
        firsts = pieces[:: plan.kv_replicas]
        return None if firsts[0] is None else np.concatenate(firsts, axis=0)

    def cat(name: str, axis: int):
        pieces = [getattr(shard, name) for shard in shards]
        return None if pieces[0] is None else np.concatenate(pieces, axis=axis)

    return MHAParams(
        w_q=cat("w_q", 0),
        w_k=kv("w_k"),
        w_v=kv("w_v"),
        w_o=cat("w_o", 1),
        b_q=cat("b_q", 0),
        b_k=kv("b_k"),
        b_v=kv("b_v"),
        b_o=replicated("b_o", [shard.b_o for shard in shards]),
        **{name: replicated(name, [getattr(shard, name) for shard in shards]) for name in LATENT_PARAMS},
    )


def shard_mask(mask: np.ndarray | None, plan: ShardPlan, rank: int) -> np.ndarray | None:
    """A 4-D mask (1|B, 1|H, Nq, Nk) cut to ``rank``'s query heads (a mask shared by the heads stays whole)."""
    if mask is None or mask.shape[1] == 1:
        return mask
    heads = plan.heads_of(rank)
    return mask[:, heads.start : heads.stop]  # (1|B, H/world, Nq, Nk), a view
