"""Resolving what a check runs: backends, strategies, devices, dtypes and cases, from the options.

Shared by the forward and the gradient check. Bad names raise ValueError naming the option,
the bad value and the accepted ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mha_rosetta.backends import (
    CHUNKED,
    DIRECT_RESHAPE,
    PER_HEAD,
    SLICING,
    STANDARD,
    Backend,
    BackendNotInstalled,
    available_backends,
    check_device_name,
    get_backend,
    missing_backends,
)
from mha_rosetta.backends import REGISTRY as BACKEND_REGISTRY
from mha_rosetta.core import DTYPE_NAMES, check_dtype_name, error_line

from .cases import SpecCase, get_cases
from .results import Implementation

KNOWN_STRATEGIES = (STANDARD, PER_HEAD, SLICING, DIRECT_RESHAPE, CHUNKED)
DEFAULT_DEVICES = ("cpu",)


# -- resolving what to run ----------------------------------------------------------------
def _split(values) -> list[str] | None:
    """Accept None, "a,b", or an iterable of such strings."""
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        out += [part.strip() for part in str(value).split(",") if part.strip()]
    return out


def resolve_backends(backends) -> tuple[list[Backend], dict[str, str], dict[str, str]]:
    """Backends to run; requested ones not installed (with the hint); ones that failed to load.

    ``backends`` is None (every installed backend), names, or `Backend` instances
    (the tests pass fakes this way). An installed backend whose adapter fails to
    import is an error of the check, reported with the message, not a crash.
    """
    chosen: list[Backend] = []
    skipped: dict[str, str] = {}
    broken: dict[str, str] = {}
    if backends is None:
        names: list = available_backends()
        skipped.update(missing_backends())
    else:
        names = _backend_items(backends)
    for name in names:
        if isinstance(name, Backend):
            chosen.append(name)
            continue
        if name not in BACKEND_REGISTRY:
            raise ValueError(f"backends: unknown backend {name!r}; registered backends: {', '.join(BACKEND_REGISTRY)}")
        if any(backend.name == name for backend in chosen):
            continue  # named twice: run once
        try:
            chosen.append(get_backend(name))
        except BackendNotInstalled as error:
            skipped[name] = str(error)
        except Exception as error:
            broken[name] = f"the adapter failed to load: {error_line(error)}"
    return chosen, skipped, broken


def _resolve_strategies(strategies, backends: Sequence[Backend]) -> list[str] | None:
    names = _split(strategies)
    if names is None:
        return None
    known = set(KNOWN_STRATEGIES).union(*(b.strategies for b in backends))
    unknown = [s for s in names if s not in known]
    if unknown:
        raise ValueError(
            f"strategies: unknown strategy {', '.join(map(repr, unknown))}; known strategies: {', '.join(sorted(known))}"
        )
    return names


def _resolve_devices(devices) -> list[str]:
    names = _split(devices) or list(DEFAULT_DEVICES)
    if names == ["all"]:
        return ["cpu", "gpu"]
    resolved: list[str] = []
    for name in names:
        try:
            device = check_device_name(name)
        except ValueError as error:
            raise ValueError(f"devices: {error}") from None
        if device not in resolved:
            resolved.append(device)
    return resolved


def _resolve_dtypes(dtypes) -> tuple[list[str], bool]:
    """The dtypes to run, and whether every case runs all of them ("all") or only those it lists."""
    names = _split(dtypes) or list(DTYPE_NAMES)
    if names == ["all"]:
        return list(DTYPE_NAMES), True
    try:
        return [check_dtype_name(name) for name in names], False
    except ValueError as error:
        raise ValueError(f"dtypes: {error} (or 'all': every case in every dtype)") from None


@dataclass
class Selection:
    """What a check runs, resolved from its options (shared by the forward and the gradient check)."""

    backends: list[Backend]
    skipped: dict[str, str]
    broken: dict[str, str]
    strategy_filter: list[str] | None
    devices: list[str]
    dtypes: list[str]
    every_dtype: bool
    cases: list[SpecCase]

    @property
    def settings(self) -> dict:
        return {
            "backends": [b.name for b in self.backends],
            "strategies": self.strategy_filter,
            "devices": self.devices,
            "dtypes": "all" if self.every_dtype else self.dtypes,
            "cases": [c.name for c in self.cases],
        }

    def case_dtypes(self, case: SpecCase) -> list[str]:
        """The dtypes ``case`` runs: every selected one under "all", else those it lists."""
        return self.dtypes if self.every_dtype else [d for d in self.dtypes if d in case.dtypes]

    def implementations(self):
        """(backend, strategy, device) for every selected implementation."""
        for backend in self.backends:
            for strategy in backend.strategies:
                if self.strategy_filter is None or strategy in self.strategy_filter:
                    for device in self.devices:
                        yield backend, strategy, device


def resolve_selection(backends, strategies, devices, dtypes, cases, executor=None) -> Selection:
    """Resolve a check's options (see `run_check`); bad names raise ValueError naming the option.

    ``executor``: one with a ``probe(modules)`` (the worker pool) imports the selected backends' libraries
    in its workers, which run them, and tells this process the answers, so it never imports them itself.
    """
    device_names = _resolve_devices(devices)
    if hasattr(executor, "probe"):
        executor.probe(_required_modules(backends))
    dtype_names, every_dtype = _resolve_dtypes(dtypes)
    if cases is None or all(isinstance(c, str) for c in _as_list(cases)):
        spec_cases = get_cases(None if cases is None else _split(cases))
    else:
        spec_cases = list(cases)
    chosen, skipped, broken = resolve_backends(backends)
    strategy_filter = _resolve_strategies(strategies, chosen)
    return Selection(chosen, skipped, broken, strategy_filter, device_names, dtype_names, every_dtype, spec_cases)


def _backend_items(backends) -> list:
    """``backends`` (a name, "a,b", or an iterable of names and `Backend` instances) as a flat list."""
    items: list = []
    for item in [backends] if isinstance(backends, str) else backends:
        items += [item] if isinstance(item, Backend) else _split(item)
    return items


def _required_modules(backends) -> list[str]:
    """The libraries the registered backends named in ``backends`` require (None: every registered backend)."""
    names = list(BACKEND_REGISTRY) if backends is None else _backend_items(backends)
    return [module for name in names if name in BACKEND_REGISTRY for module in BACKEND_REGISTRY[name].requires]


def _as_list(values) -> list:
    return [values] if isinstance(values, (str, SpecCase)) else list(values)


def case_dtypes_for(backend: Backend, impl: Implementation, case: SpecCase, dtypes, every_dtype: bool) -> list[str]:
    """The dtypes one implementation runs ``case`` in: every case reaches every implementation.

    With ``every_dtype`` (``--dtypes all``): every requested dtype. Otherwise the case's own
    dtypes (`SpecCase.dtypes`) among the requested ones; and when the implementation supports
    none of the case's own dtypes (an adapter with only float64, a case listed in float16),
    the first requested dtype it does support, so no implementation misses a case (GQA,
    causal, padding) because of the dtypes the case happens to list. When it supports no
    requested dtype for this case, the case's dtypes run anyway and each run says why.
    """
    if every_dtype:
        return list(dtypes)
    listed = [d for d in dtypes if d in case.dtypes]

    def supported(dtype: str) -> bool:
        try:
            return backend.unsupported_reason(case.cfg, dtype, impl.device, impl.strategy) is None
        except Exception:  # a broken unsupported_reason shows as an error when the run raises
            return True

    if any(supported(d) for d in case.dtypes):
        return listed
    fallback = next((d for d in dtypes if supported(d)), None)
    return [fallback] if fallback is not None else listed
