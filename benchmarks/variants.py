"""What each variant of 2024-26 attention costs: the cells of ``bench --preset variants`` and their table.

Every entry is one configuration at the cell's size, named by the variant it adds, with the
configuration it is measured against (its ``baseline``): a variant's cost is its time over
the baseline's, so the sliding window is measured against causal attention (the window is a
causal mask with fewer keys), YaRN against plain rotary, and the others against plain
attention. The settings are the models' own where one exists (each entry's `BenchSpec` names
the model); the window is a quarter of the tokens, so that it blocks keys at every size the
preset measures.

Each variant's cell is its entry's (`Variant.bench` in `core.variants`: its `MHAConfig` keyword
arguments and its baseline); the cells that are no variant (plain, causal, plain rotary) are the
baselines here. The table drives the preset, the cell field ``variant``, the table and its README
block; a new variant's cell is its entry's `BenchSpec`.
"""

from __future__ import annotations

from mha_rosetta.core.variants import VARIANT_REGISTRY

PLAIN = "plain"

# The cells that are no variant: what the variants are measured against (name -> overrides, baseline).
BASELINES: dict[str, tuple[dict, str | None]] = {
    PLAIN: ({}, None),
    "causal": ({"causal": True}, PLAIN),
    "rope": ({"rope": "half"}, PLAIN),
}


def _bench_variants() -> dict[str, tuple[dict, str | None]]:
    """Plain first, then each entry's cell in registry order, preceded by its baseline where not yet listed."""
    table = {PLAIN: BASELINES[PLAIN]}
    for entry in VARIANT_REGISTRY.values():
        if entry.bench is None:
            continue
        baseline = entry.bench.baseline
        table.setdefault(baseline, BASELINES[baseline])
        table[entry.bench.label or entry.name] = (dict(entry.bench.overrides), baseline)
    return table


# name -> (MHAConfig overrides, baseline name). "tokens/4" (the window, a chunk) is resolved at build time.
BENCH_VARIANTS: dict[str, tuple[dict, str | None]] = _bench_variants()


def preset_cells(preset: str) -> list[str]:
    """The cells of ``bench --preset <preset>``: plain, then each entry whose `BenchSpec.preset` is ``preset``
    preceded by its baseline, in registry order (``"variants"``; ``"forms"``, the forms of issue 45). Read from
    the entries each time: a form added to the registry with ``preset="forms"`` is timed with no edit here."""
    cells = [PLAIN]
    for entry in VARIANT_REGISTRY.values():
        if entry.bench is None or entry.bench.preset != preset:
            continue
        for name in (entry.bench.baseline, entry.bench.label or entry.name):
            if name not in cells:
                cells.append(name)
    return cells


def check_variant(name: str | None) -> str | None:
    """``name`` if it is a `BENCH_VARIANTS` entry (or None: the plain cell), else a ValueError naming the choices."""
    if name is not None and name not in BENCH_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(BENCH_VARIANTS)}, got {name!r}")
    return name


def variant_overrides(name: str | None, tokens: int) -> dict:
    """The `MHAConfig` keyword arguments of variant ``name`` at ``tokens`` tokens ({} for None or plain)."""
    if name is None:
        return {}
    overrides = dict(BENCH_VARIANTS[check_variant(name)][0])
    for field, value in overrides.items():  # a size relative to the cell's tokens (the window, a chunk)
        if value == "tokens/4":
            overrides[field] = max(1, tokens // 4)
    return overrides


def variant_rows(cells: list[dict], time_of) -> list[list[str]]:
    """One row per (implementation, variant): median ms, the baseline's, and the cost in ms and in %.

    ``time_of(cell)`` is the figure to compare (the drift-corrected one where the report has it).
    A variant whose implementation is unsupported, or whose baseline was not measured, shows why.
    """
    by_key = {(c["implementation"], c.get("mode", "fwd"), c.get("variant") or PLAIN, c["tokens"]): c for c in cells}
    rows = []
    for (implementation, mode, variant, tokens), cell in by_key.items():
        baseline = BENCH_VARIANTS[variant][1]
        label = implementation if mode == "fwd" else f"{implementation} fwd+bwd"
        if cell.get("status") != "ok":
            reason = str(cell.get("error") or cell.get("status", "")).replace("|", "/").replace("\n", " ")
            rows.append([f"`{label}`", variant, str(tokens), "", "", "", "", reason[:120]])
            continue
        ms = time_of(cell) * 1e3
        base = by_key.get((implementation, mode, baseline, tokens)) if baseline else None
        if baseline is None:
            rows.append([f"`{label}`", variant, str(tokens), f"{ms:.2f}", "", "", "", ""])
        elif base is None or base.get("status") != "ok":
            rows.append([f"`{label}`", variant, str(tokens), f"{ms:.2f}", "", "", "", f"{baseline} not measured"])
        else:
            base_ms = time_of(base) * 1e3
            rows.append(
                [
                    f"`{label}`",
                    variant,
                    str(tokens),
                    f"{ms:.2f}",
                    f"{baseline} {base_ms:.2f}",
                    f"{ms - base_ms:+.2f}",
                    f"{100 * (ms / base_ms - 1):+.0f}%",
                    "",
                ]
            )
    return rows


def variant_pivot(cells: list[dict], time_of) -> tuple[list[str], list[list[str]]]:
    """(columns, rows): one row per variant, one column per implementation, "ms (+cost%)" over its baseline.

    The README's compact form of `variant_rows` (forward cells of one size; the first size if several).
    """
    forward = [c for c in cells if c.get("mode", "fwd") == "fwd"]
    if not forward:
        return [], []
    tokens = forward[0]["tokens"]
    by_key = {(c["implementation"], c.get("variant") or PLAIN): c for c in forward if c["tokens"] == tokens}
    implementations = list(dict.fromkeys(c["implementation"] for c in forward))
    rows = []
    for variant, (_, baseline) in BENCH_VARIANTS.items():
        if not any((impl, variant) in by_key for impl in implementations):
            continue
        row = [variant if baseline is None else f"{variant} (vs {baseline})"]
        for impl in implementations:
            cell, base = by_key.get((impl, variant)), by_key.get((impl, baseline)) if baseline else None
            if cell is None or cell.get("status") != "ok":
                row.append("unsupported" if cell is not None and cell.get("status") == "unsupported" else "")
            elif base is None or base.get("status") != "ok":
                row.append(f"{time_of(cell) * 1e3:.1f}")
            else:
                row.append(f"{time_of(cell) * 1e3:.1f} ({100 * (time_of(cell) / time_of(base) - 1):+.0f}%)")
        rows.append(row)
    return ["variant", *(f"`{impl}` ms" for impl in implementations)], rows


VARIANT_COLUMNS = ("implementation", "variant", "N", "ms", "baseline ms", "cost ms", "cost %", "note")
