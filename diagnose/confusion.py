"""The confusion table: every injected bug, in NumPy and torch candidates, against the cause named first.

`confusion(settings, frameworks)` diagnoses `injected.numpy_candidate` / `torch_candidate`
with every bug that applies to each setting (plain, GQA, causal) and records the first
cause; `render_markdown` prints the causes x bugs table (diagonal when every bug is named
by its own code) and, per bug, the probe that told the winner from the runner-up.
``mha-rosetta diagnose --confusion`` prints it.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass

from mha_rosetta.core import MHAConfig

from .causes import CAUSE_CODES
from .diagnosis import diagnose
from .injected import BUGS, bugs_for, numpy_candidate, torch_candidate

SETTINGS: dict[str, MHAConfig] = {
    "plain": MHAConfig(d_model=12, n_heads=3),  # d_k = 4
    "gqa": MHAConfig(d_model=20, n_heads=4, n_kv_heads=2),  # d_k = 5
    "causal": MHAConfig(d_model=12, n_heads=3, causal=True),
}
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
    return [name for name in FRAMEWORKS if name == "numpy" or importlib.util.find_spec(name) is not None]


def confusion(settings=None, frameworks=None) -> list[Outcome]:
    settings = SETTINGS if settings is None else {name: SETTINGS[name] for name in settings}
    frameworks = frameworks_present() if frameworks is None else list(frameworks)
    outcomes = []
    for setting, cfg in settings.items():
        for framework in frameworks:
            for bug in bugs_for(cfg):
                result = diagnose(FRAMEWORKS[framework](cfg, bug), cfg)
                first = result.causes[0] if result.causes else None
                outcomes.append(
                    Outcome(
                        setting,
                        framework,
                        bug,
                        BUGS[bug][0],
                        first.code if first else "agrees",
                        first.evidence if first else "",
                    )
                )
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


def render_evidence(outcomes: list[Outcome]) -> str:
    """Per bug, the evidence of one diagnosis: which probe shows it, which probe rules out the runner-up."""
    seen, lines = set(), []
    for o in outcomes:
        if o.bug in seen or not o.correct:
            continue
        seen.add(o.bug)
        lines.append(f"- **{o.bug}** ({o.setting}, {o.framework}): {o.evidence}")
    return "\n".join(lines) + "\n"
