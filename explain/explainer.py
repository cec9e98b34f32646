"""`explain()`: everything the explainer shows for one configuration, as one object.

from mha_rosetta.explain import explain
result = explain()                      # the column/row-sample article's 6 tokens, d_model 12, 3 heads of 4
result.print()                          # rich tables (plain text without rich)
print(result.to_markdown())
result.save_png("head_split.png")
explain(claims=True, sections=("claims",)).claims_json()   # [{"claim", "title", "verdict", "evidence"}, ...]
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone

from mha_rosetta.core import MHAConfig

from .claims import ClaimResult, run_claims
from .differences import Difference, run_differences
from .forms import FormShapes, all_form_shapes
from .head_split import HeadSplit, head_splits
from .real_checkpoints import Checkpoint, real_checkpoints
from .seed_setup import DEFAULT_BATCH, SEED_TOKENS, Setup, make_setup
from .stages_table import BackendSummary, StageRow, build_stage_tables
from .variants import VariantEntry, pipeline, variant_entries
from .weights import WeightLayout, weight_layouts

SECTIONS = ("stages", "weights", "head_split", "checkpoints", "differences", "variants", "forms", "claims")
# "forms" runs every implementation on each form (a JIT compiles each): asked for by name, like the claims.
DEFAULT_SECTIONS = ("stages", "weights", "head_split", "checkpoints", "differences", "variants")


@dataclass
class Explanation:
    setup: Setup
    dtype: str
    sections: tuple[str, ...]
    backends: list[BackendSummary] = field(default_factory=list)
    stages: list[StageRow] = field(default_factory=list)
    weights: list[WeightLayout] = field(default_factory=list)
    head_split: dict[str, HeadSplit] = field(default_factory=dict)
    checkpoints: list[Checkpoint] = field(default_factory=list)  # real checkpoint families (own sizes)
    claims: list[ClaimResult] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    variants: list[VariantEntry] = field(default_factory=list)  # one per core.VARIANTS name (explain.variants)
    variants_pipeline: str = ""  # the stage list with every score variant on
    forms: list[FormShapes] = field(default_factory=list)  # each form's stages in each convention (explain.forms)
    settings: dict = field(default_factory=dict)  # how the claims' speed part was run, machine, time

    @property
    def cfg(self) -> MHAConfig:
        return self.setup.cfg

    def claims_json(self) -> list[dict]:
        """The claims in the contract's shape: a list of {"claim", "title", "verdict", "evidence"} (+ "measured")."""
        return [claim.to_dict() for claim in self.claims]

    def to_dict(self) -> dict:
        cfg = self.cfg
        return {
            "schema": 1,
            "config": {
                "tokens": self.setup.tokens,
                "batch": self.setup.batch,
                "d_model": cfg.d_model,
                "n_heads": cfg.n_heads,
                "d_k": cfg.d_k,
                "d_v": cfg.d_v,
                "dtype": self.dtype,
            },
            "settings": self.settings,
            "sections": list(self.sections),
            "backends": [summary.to_dict() for summary in self.backends],
            "stages": [row.to_dict() for row in self.stages],
            "weights": [layout.to_dict() for layout in self.weights],
            "head_split": {name: split.to_dict() for name, split in self.head_split.items()},
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "claims": self.claims_json(),
            "differences": [difference.to_dict() for difference in self.differences],
            "variants": [entry.to_dict() for entry in self.variants],
            "variants_pipeline": self.variants_pipeline,
            "forms": [shapes.to_dict() for shapes in self.forms],
        }

    def to_markdown(self, png_name: str | None = None) -> str:
        from .render import render_markdown

        return render_markdown(self, png_name)

    def to_text(self) -> str:
        from .render import render_text

        return render_text(self)

    def print(self, plain: bool = False, file=None) -> None:
        """Rich tables when rich is installed (and ``plain`` is False); plain text otherwise."""
        from .render import print_explanation

        print_explanation(self, plain=plain, file=file)

    def save_png(self, path) -> str:
        from .head_split import save_png

        cfg = self.cfg
        splits = self.head_split or head_splits(self.setup.tokens, cfg.n_heads, cfg.d_k)
        return save_png(splits, path)


def explain(
    cfg: MHAConfig | None = None,
    backends: list[str] | None = None,
    claims: bool = False,
    *,
    tokens: int = SEED_TOKENS,
    batch: int = DEFAULT_BATCH,
    seed: int = 0,
    dtype: str = "float32",
    sections: tuple[str, ...] | None = None,
    speed: bool = True,
    threads: int = 1,
    quick: bool = True,
) -> Explanation:
    """Build the explanation for ``cfg`` (default: the article's 6 tokens, d_model 12, 3 heads, d_k 4).

    ``backends``: which adapters the stage table measures (default: every installed
    implementation). ``claims=True`` adds the column/row-sample article's claims; with ``speed`` their speed
    parts run the benchmark questions (``threads``, ``quick``). ``sections`` picks parts
    of the output from SECTIONS.
    """
    if sections is None:
        sections = DEFAULT_SECTIONS + (("claims",) if claims else ())
    sections = tuple(sections)
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        raise ValueError(f"sections must be among {', '.join(SECTIONS)}; got {unknown}")
    setup = make_setup(cfg, tokens=tokens, batch=batch, seed=seed)
    settings = {
        "generated": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
    }
    result = Explanation(setup, dtype, sections, settings=settings)
    if "stages" in sections:
        result.backends, result.stages = build_stage_tables(setup.cfg, setup.params, setup.x, backends, dtype)
    if "weights" in sections:
        result.weights = weight_layouts(setup.cfg, setup.params)
    if "head_split" in sections:
        result.head_split = head_splits(setup.tokens, setup.cfg.n_heads, setup.cfg.d_k)
    if "checkpoints" in sections:
        result.checkpoints = real_checkpoints()
    if "differences" in sections:
        result.differences = run_differences(setup)
    if "variants" in sections:  # on its own demonstration layer (explain.variants.DEMO), not on cfg
        result.variants, result.variants_pipeline = variant_entries(), pipeline()
    if "forms" in sections:  # on the same demonstration layer, in every implementation asked for
        result.forms = all_form_shapes(backends)
    if "claims" in sections:
        # The claims use the column/row-sample article's own example sizes where it gives numbers (2.5, the
        # (32, 8) chain); the rest run on this configuration.
        result.claims = run_claims(setup=setup, speed=speed, threads=threads, quick=quick)
        settings["speed"] = {"run": speed, "threads": threads, "quick": quick}
    return result
