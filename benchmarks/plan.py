"""What a sweep will run: implementation labels and groups resolved from the registry, and the
(device, dtype) pairs that need a GEMM peak.

Implementation names: registry backend names (``numpy``, ``torch-sdpa``, ...), optionally
with a strategy (``numpy:slicing``), or the groups of `GROUPS`: ``main`` (every installed
backend in its standard strategy), ``strategies`` (the column/row-sample article's other
correct strategies of every backend that has them, and ``chunked``), ``all`` (both) and
``dist`` (the sharded backends: the cell counts their worker processes' CPU time but not their
memory; run them with ``--threads`` at least their process count). The direct-reshape
strategy is the known mistake: it is never part of a group, though it can be named explicitly.
"""

from __future__ import annotations

from mha_rosetta.backends import KNOWN_WRONG_STRATEGIES, REGISTRY, available_backends, get_backend
from mha_rosetta.backends._mla import MLA_STRATEGIES  # MLA's forms: not head-split strategies of plain attention

from .cell import CellSpec, implementation_label, split_implementation


def _loaded(name: str):
    """The adapter registered as ``name`` (its module imported, not its framework), or None where it
    does not load: such an adapter shows up as a failing main cell instead."""
    try:
        return get_backend(name)
    except Exception:
        return None


def _is_sharded(name: str) -> bool:
    """A backend that splits the heads over worker processes (``splits_heads``): the cell counts
    their CPU time but not their memory, so it is a group of its own ("dist"), not "main"."""
    return bool(getattr(_loaded(name), "splits_heads", False))


def main_implementations() -> list[str]:
    """Every registered backend whose framework is installed, in its standard strategy (sharded ones apart)."""
    return [name for name in available_backends() if not _is_sharded(name)]


def dist_implementations() -> list[str]:
    """The sharded backends (worker processes), every strategy."""
    return [
        implementation_label(name, strategy)
        for name in available_backends()
        if _is_sharded(name)
        for strategy in get_backend(name).strategies
    ]


def strategy_implementations() -> list[str]:
    """The article's other correct strategies (per-head matrices, slicing) of every installed backend."""
    return [
        implementation_label(name, strategy)
        for name in available_backends()
        if not _is_sharded(name)
        for strategy in getattr(_loaded(name), "strategies", ())
        if strategy != "standard" and strategy not in KNOWN_WRONG_STRATEGIES and strategy not in MLA_STRATEGIES
    ]


# The groups an implementation list may name, each expanded from the registry when the sweep is planned.
GROUPS = {
    "main": main_implementations,
    "strategies": strategy_implementations,
    "all": lambda: main_implementations() + strategy_implementations(),
    "dist": dist_implementations,
}


def resolve_implementations(names: list[str]) -> list[str]:
    """Expand the groups and validate explicit names; order kept, duplicates dropped."""
    resolved: list[str] = []
    for name in names:
        if name in GROUPS:
            expanded = GROUPS[name]()
        else:
            backend, _strategy = split_implementation(name)
            if backend not in REGISTRY:
                raise ValueError(
                    f"unknown implementation {name!r}: the backend must be one of {', '.join(REGISTRY)} "
                    f"(optionally ':strategy'), or a group: {', '.join(GROUPS)}"
                )
            expanded = [name]
        resolved += [label for label in expanded if label not in resolved]
    return resolved


def gemm_groups(cells: list[CellSpec]) -> list[tuple[str, str]]:
    """The (device, dtype) pairs that need a GEMM peak, in first-use order."""
    return list(dict.fromkeys((cell.device, cell.dtype) for cell in cells))


def gemm_key(device: str, dtype: str, threads: int) -> str:
    return f"{device}/{dtype}/{threads}"
