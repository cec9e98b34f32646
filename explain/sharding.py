"""How tensor parallelism cuts the layer's stored weights, in both conventions, from real arrays.

For one configuration and world size: which axis of each stored ``(out, in)`` weight is
cut (rows of w_q, w_k, w_v: column-parallel; columns of w_o: row-parallel), what each
rank holds (shapes read from `core.shard_params`), what the matrix each convention
actually multiplies looks like after the cut (row samples apply ``W.T``, column samples
``W``), the framework spelling, and where the one all-reduce happens. The identity behind
it is checked live: the sum over ranks of each rank's partial output, plus ``b_o``, is
the oracle's output (the max abs difference is printed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from mha_rosetta.core import MHAConfig, init_params, reference_mha, shard_params, shard_plan
from mha_rosetta.core.sharding import LATENT_PARAMS
from mha_rosetta.core.tables import markdown_table


@dataclass(frozen=True)
class WeightCut:
    weight: str
    stored: tuple[int, ...]  # canonical (out, in)
    cut: str  # which axis of the stored weight, and why
    rank_slice: str  # what rank r holds, in stored coordinates
    shard: tuple[int, ...]  # one rank's shape, read from shard_params
    row_samples: str  # the applied matrix x @ W.T and the axis of it that is cut
    column_samples: str  # the applied matrix W @ X and the axis of it that is cut
    api: str  # how torch and JAX users spell it


@dataclass(frozen=True)
class Step:
    step: str
    row_samples: str
    column_samples: str
    communication: str


@dataclass
class ShardingExplanation:
    cfg: MHAConfig
    world: int
    plan: str
    cuts: list[WeightCut] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    identity_error: float = float("nan")  # max |sum of partial outputs + b_o - oracle output|

    def to_dict(self) -> dict:
        return {
            "config": self.cfg.describe(),
            "world": self.world,
            "plan": self.plan,
            "cuts": [dataclasses.asdict(cut) for cut in self.cuts],
            "steps": [dataclasses.asdict(step) for step in self.steps],
            "identity_max_abs_error": self.identity_error,
        }

    def to_markdown(self) -> str:
        lines = [
            f"# Heads over {self.world} ranks (tensor parallelism): {self.cfg.describe()}",
            "",
            f"Split: {self.plan}. Rows of a stored `(out, in)` weight are scorers (one output feature each);",
            "q, k and v are cut by rows (column-parallel), the output projection by columns (row-parallel).",
            "",
        ]
        cut_columns = ["weight", "stored (out, in)", "cut", "rank r holds", "one rank's shard"]
        cut_columns += ["row samples: x @ W.T", "column samples: W @ X", "API"]
        cuts = [
            [f"`{c.weight}`", c.stored, c.cut, c.rank_slice, c.shard, c.row_samples, c.column_samples, c.api]
            for c in self.cuts
        ]
        lines += [*markdown_table(cut_columns, cuts), ""]
        step_columns = ["step", "row samples (torch: `(B, N, features)`)"]
        step_columns += ["column samples (NumPy: `(B, features, N)`)", "communication"]
        steps = [[s.step, s.row_samples, s.column_samples, s.communication] for s in self.steps]
        lines += markdown_table(step_columns, steps)
        lines += [
            "",
            f"Checked now: the sum over the {self.world} ranks of their partial outputs, plus `b_o`, equals the float64",
            f"oracle's output to {self.identity_error:.1e} (max abs).",
            "",
        ]
        return "\n".join(lines)


def explain_sharding(
    cfg: MHAConfig | None = None, world: int | None = None, tokens: int = 6, batch: int = 1, seed: int = 0
) -> ShardingExplanation:
    """The cut of every weight and the place of the all-reduce for ``cfg`` on ``world`` ranks.

    ``cfg`` defaults to the explainer's layer (d_model 12, 3 heads of 4); ``world`` to the largest
    rank count up to 4 that splits the heads (3 for that layer).
    """
    cfg = MHAConfig(d_model=12, n_heads=3) if cfg is None else cfg
    if world is None:
        world = max(w for w in range(1, min(4, cfg.n_heads) + 1) if _splits(cfg, w))
    plan = shard_plan(cfg, world)  # raises with the reason when the heads do not split
    params = init_params(cfg, seed=seed)
    shards = shard_params(cfg, params, world)
    Hl, Dk, Dv = plan.local_heads, cfg.d_k, cfg.d_v
    kv = plan.local_kv_heads
    kv_note = "" if plan.kv_replicas == 1 else f" (each kv head on {plan.kv_replicas} ranks)"
    kv_owner = "r" if plan.kv_replicas == 1 else f"(r//{plan.kv_replicas})"
    kv_api = (
        "ColwiseParallel; P('heads', None)"
        if plan.kv_replicas == 1
        else "replicated per group (by hand: ColwiseParallel would cut a kv head); P() replicated"
    )
    result = ShardingExplanation(cfg, world, plan.describe())

    def q_like(name: str, out_block: int, heads: str, col_api: str, owner: str = "r") -> WeightCut:
        stored = getattr(params, name).shape
        return WeightCut(
            weight=name,
            stored=stored,
            cut="axis 0 (out): rows, by head",
            rank_slice=f"rows {owner}*{out_block} ... ({owner}+1)*{out_block}-1: {heads}",
            shard=getattr(shards[0], name).shape,
            row_samples=f"W.T {stored[::-1]} cut by columns: rank r computes its heads' features",
            column_samples=f"W {stored} cut by rows: rank r's row blocks of the projection",
            api=col_api,
        )

    rows = {name: getattr(shards[0], name).shape[0] for name in ("w_q", "w_k", "w_v")}  # MLA's w_k: nope rows a head
    result.cuts = [
        q_like("w_q", rows["w_q"], f"query heads r*{Hl} ... (r+1)*{Hl}-1", "ColwiseParallel; P('heads', None)"),
        q_like("w_k", rows["w_k"], f"{kv} kv head(s){kv_note}", kv_api, kv_owner),
        q_like("w_v", rows["w_v"], f"{kv} kv head(s){kv_note}", kv_api, kv_owner),
        WeightCut(
            weight="w_o",
            stored=params.w_o.shape,
            cut="axis 1 (in): columns, by head",
            rank_slice=f"columns r*{Hl * Dv} ... (r+1)*{Hl * Dv}-1: what its heads' context feeds",
            shard=shards[0].w_o.shape,
            row_samples=f"W_o.T {params.w_o.shape[::-1]} cut by rows: merged_r @ W_o[:, cols_r].T is a partial sum",
            column_samples=f"W_o {params.w_o.shape} cut by columns: W_o[:, cols_r] @ merged_r is a partial sum",
            api="RowwiseParallel; P(None, 'heads')",
        ),
    ]
    # MLA: the down projections and latent norms read the whole input and feed every head: replicated, uncut.
    result.cuts += [
        WeightCut(name, getattr(params, name).shape, "none: replicated (the latent feeds every head)", "all of it",
                  getattr(shards[0], name).shape, "the whole latent on every rank", "the whole latent on every rank",
                  "replicated; P()")
        for name in LATENT_PARAMS
        if getattr(params, name) is not None
    ]  # fmt: skip
    D = cfg.d_model
    result.steps = [
        Step("input", f"x (B, N, {D}) on every rank", f"X (B, {D}, N) on every rank", "none (replicated)"),
        Step(
            "project q/k/v",
            f"q_r = x @ W_q[rows_r].T: (B, N, {Hl * Dk})",
            f"Q_r = W_q[rows_r] @ X: (B, {Hl * Dk}, N)",
            "none",
        ),
        Step("attention", f"{Hl} local head(s), full tokens", f"{Hl} local head(s), full tokens", "none"),
        Step(
            "merge heads",
            f"merged_r (B, N, {Hl * Dv}): its columns of merged",
            f"merged_r (B, {Hl * Dv}, N): its rows of merged",
            "none",
        ),
        Step(
            "output projection",
            f"partial_r = merged_r @ W_o[:, cols_r].T: (B, N, {D})",
            f"partial_r = W_o[:, cols_r] @ merged_r: (B, {D}, N)",
            f"**one all-reduce (sum) of (B, N, {D})** (torch: dist.all_reduce / RowwiseParallel; JAX: lax.psum)",
        ),
        Step("bias", "+ b_o once, after the sum", "+ b_o once, after the sum", "none (b_o replicated)"),
    ]
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((batch, tokens, D))
    partials = [
        reference_mha(plan.local_cfg, dataclasses.replace(shard, b_o=None if shard.b_o is None else shard.b_o * 0), x)
        for shard in shards
    ]
    total = sum(partials) + (0 if params.b_o is None else params.b_o)
    result.identity_error = float(np.max(np.abs(total - reference_mha(cfg, params, x))))
    return result


def _splits(cfg: MHAConfig, world: int) -> bool:
    try:
        shard_plan(cfg, world)
    except ValueError:
        return False
    return True
