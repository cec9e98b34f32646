"""The confusion table: every injected bug, in NumPy and torch candidates, against the cause named first.

`confusion(settings, frameworks)` diagnoses `injected.numpy_candidate` / `torch_candidate`
with every bug that applies to each setting (plain, GQA, causal, rotary half, and GQA +
causal + partial interleaved rotary, and the variants as models combine them) and records the first
cause; `render_markdown` prints the causes x bugs table (diagonal when every bug is named
by its own code) and, per bug, the probe that told the winner from the runner-up; `render_tables`
prints the variants' settings in a table of their own.
``mha-rosetta diagnose --confusion`` prints it.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import MHAConfig

from .causes import CAUSE_CODES, diagnosed_variants, hypotheses
from .diagnosis import diagnose
from .injected import BUGS, bugs_for, numpy_candidate, torch_candidate
from .probes import make_probes
from .simulate import simulate

SETTINGS: dict[str, MHAConfig] = {
    "plain": MHAConfig(d_model=12, n_heads=3),  # d_k = 4
    "gqa": MHAConfig(d_model=20, n_heads=4, n_kv_heads=2),  # d_k = 5
    "causal": MHAConfig(d_model=12, n_heads=3, causal=True),
    "rotary": MHAConfig(d_model=12, n_heads=3, rope="half"),  # d_k = 4, every feature rotated
    # GQA, causal and partial interleaved rotary at once: d_k = 6, the first 4 features rotated.
    "rotary-gqa": MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, causal=True, rope="interleaved", rope_dims=4),
    # The variants, as the models combine them: each entry's settings (`DiagnoseSpec.settings`), where each bug
    # of the variants (`injected.VARIANT_BUGS`) runs when its variant is on.
    **{name: MHAConfig(**config) for entry in diagnosed_variants() for name, config in entry.diagnose.settings},
}
# The settings with a variant on (`MHAConfig.variants`): their table is printed apart (`render_tables`).
VARIANT_SETTINGS = tuple(name for name, cfg in SETTINGS.items() if cfg.variants)
FRAMEWORKS = {"numpy": numpy_candidate, "torch": torch_candidate}


@dataclass
class Outcome:
    setting: str
    framework: str
    bug: str
    expected: str  # the cause code the bug must be named as
    named: str  # the first cause's code ("agrees" if none)
    evidence: str

    @property
    def correct(self) -> bool:
        return self.named == self.expected


def frameworks_present() -> list[str]:
    return [name for name in FRAMEWORKS if importlib.util.find_spec(name) is not None]  # numpy is always there


def _spells(framework: str, cfg: MHAConfig) -> bool:
    """Whether ``framework``'s candidate spells every variant of ``cfg`` (a new entry's: in NumPy first)."""
    try:
        FRAMEWORKS[framework](cfg)
    except NotImplementedError:
        return False
    return True


def confusion(settings=None, frameworks=None) -> list[Outcome]:
    settings = SETTINGS if settings is None else {name: SETTINGS[name] for name in settings}
    frameworks = frameworks_present() if frameworks is None else list(frameworks)
    outcomes = []
    for setting, cfg in settings.items():
        for framework in frameworks:
            if not _spells(framework, cfg):
                continue
            for bug in bugs_for(cfg):
                result = diagnose(FRAMEWORKS[framework](cfg, bug), cfg)
                first = result.causes[0] if result.causes else None
                named, evidence = (first.code, first.evidence) if first else ("agrees", "")
                outcomes.append(Outcome(setting, framework, bug, BUGS[bug][0], named, evidence))
    return outcomes


def render_markdown(outcomes: list[Outcome]) -> str:
    """Causes (rows) x injected bugs (columns): how often each bug was named first as each cause."""
    bugs = [bug for bug in BUGS if any(o.bug == bug for o in outcomes)]
    counts = Counter((o.named, o.bug) for o in outcomes)
    runs = Counter(o.bug for o in outcomes)
    codes = [code for code in (*CAUSE_CODES, "agrees") if any(counts[(code, bug)] for bug in bugs)]
    lines = ["| named first \\ injected | " + " | ".join(bugs) + " |", "| --- |" + " --- |" * len(bugs)]
    for code in codes:
        cells = [str(counts[(code, bug)]) if counts[(code, bug)] else "·" for bug in bugs]
        lines.append(f"| `{code}` | " + " | ".join(cells) + " |")
    lines.append("| (runs) | " + " | ".join(str(runs[bug]) for bug in bugs) + " |")
    wrong = [o for o in outcomes if not o.correct]
    lines.append("")
    lines.append(
        f"{len(outcomes) - len(wrong)} of {len(outcomes)} diagnoses named the injected bug first "
        f"(settings: {', '.join(sorted({o.setting for o in outcomes}))}; "
        f"candidates: {', '.join(sorted({o.framework for o in outcomes}))})."
    )
    for o in wrong:
        lines.append(f"- MISSED: {o.setting}/{o.framework}/{o.bug}: named {o.named}")
    return "\n".join(lines) + "\n"


def render_tables(outcomes: list[Outcome]) -> str:
    """`render_markdown` twice: the 2017-23 settings, then the variants' (`VARIANT_SETTINGS`), each table readable."""
    parts = [
        [o for o in outcomes if o.setting not in VARIANT_SETTINGS],
        [o for o in outcomes if o.setting in VARIANT_SETTINGS],
    ]
    return "\n".join(render_markdown(part) for part in parts if part)


def render_evidence(outcomes: list[Outcome]) -> str:
    """Per bug, the evidence of one diagnosis: which probe shows it, which probe rules out the runner-up."""
    seen, lines = set(), []
    for o in outcomes:
        if o.bug in seen or not o.correct:
            continue
        seen.add(o.bug)
        lines.append(f"- **{o.bug}** ({o.setting}, {o.framework}): {o.evidence}")
    return "\n".join(lines) + "\n"


# Probes from the one that exercises least of the pipeline to the one that exercises most.
SIMPLEST_FIRST = (
    "single token",
    "identical tokens",
    "one head",
    "w_k = w_q",
    "random",
    "all-True mask",
    "mask",
    "cross",
)


def separating_probes(settings=None) -> dict[tuple[str, str], tuple[str, float]]:
    """For each pair of cause codes, the simplest probe on which their simulated outputs differ, and by how much.

    Computed from the simulations alone (no candidate): the first hypothesis of each code,
    in the first setting where both apply; "simplest" in the order of `SIMPLEST_FIRST`.
    """
    settings = SETTINGS if settings is None else settings
    best: dict[tuple[str, str], tuple[str, float]] = {}
    for cfg in settings.values():
        first = {}
        for h in hypotheses(cfg):
            first.setdefault(h.code, h)
        probes = sorted((p for p in make_probes(cfg) if p.ranks), key=lambda p: SIMPLEST_FIRST.index(p.name))
        outputs = {
            code: [simulate(cfg, p.params, p.query, p.key, p.value, p.mask, h.bug) for p in probes]
            for code, h in first.items()
        }
        for a in first:
            for b in first:
                if CAUSE_CODES.index(a) >= CAUSE_CODES.index(b) or (a, b) in best:
                    continue
                for p, x, y in zip(probes, outputs[a], outputs[b], strict=True):
                    finite = np.isfinite(x) & np.isfinite(y)
                    gap = float(np.abs(x - y)[finite].max(initial=0.0))
                    if gap > 1e-6 * (1.0 + float(np.abs(x[finite]).max(initial=0.0))):
                        best[(a, b)] = (p.name, gap)
                        break
    return best


def render_separation(best: dict[tuple[str, str], tuple[str, float]]) -> str:
    """The pairs table: for each pair of causes, the simplest probe that tells them apart."""
    codes = [code for code in CAUSE_CODES if any(code in pair for pair in best)]
    lines = ["| cause | " + " | ".join(f"`{c}`" for c in codes[1:]) + " |", "| --- |" + " --- |" * (len(codes) - 1)]
    for a in codes[:-1]:
        cells = []
        for b in codes[1:]:
            pair = best.get((a, b))
            cells.append("" if pair is None else f"{pair[0]} ({pair[1]:.2g})")
        lines.append(f"| `{a}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
