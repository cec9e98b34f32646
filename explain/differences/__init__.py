"""Framework differences that bite people porting attention code, each shown live.

Every demonstration calls the libraries themselves (not this project's adapters, which
map the differences away) with the same canonical parameters and inputs, and reports
what came out: which keys a query attended to, the error against the float64 oracle,
what a row with nothing to attend to became, which shapes a module created. A library
that is not installed turns its line into a skip with the reason; a demonstration that
needs a GPU is skipped on a machine without one.

The package: `calls` (the `Difference` result and the library calls), `masks` and `modules` (the
demonstrations), and here the catalogue `DEMONSTRATIONS` and `run_differences`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

from mha_rosetta.backends._probe import importable as _installed  # imports the library once to be sure it loads

from ..seed_setup import Setup, make_setup
from .calls import Difference
from .masks import fully_masked_row, mask_polarity, sequence_first
from .modules import head_size_arguments, scale_placement, tf32_default

DEMONSTRATIONS: dict[str, Callable[[Setup], Difference]] = {
    "mask_polarity": mask_polarity,
    "sequence_first": sequence_first,
    "fully_masked_row": fully_masked_row,
    "scale_placement": scale_placement,
    "head_size_arguments": head_size_arguments,
    "tf32_default": tf32_default,
}


# The demonstrations whose subject is the device's own precision: everything else is pinned.
ON_THE_DEVICE = ("tf32_default",)


@contextmanager
def jax_on_cpu_at_highest():
    """JAX work inside runs on the CPU with float32 products at full precision ("highest").

    On a machine whose JAX has a GPU, the default device is the GPU and its default float32
    matmul precision may be TF32 (errors ~1e-3): the demonstrations' verdicts (which keys a
    query used, what an empty row became, at atol 1e-4) must not depend on that. Without
    JAX installed it does nothing.
    """
    if not _installed("jax"):
        yield
        return
    import jax

    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        yield


def run_differences(setup: Setup | None = None, keys: list[str] | None = None) -> list[Difference]:
    """Run the demonstrations (all by default) on ``setup`` (default: the article's configuration).

    Every demonstration but `ON_THE_DEVICE` runs its JAX calls on the CPU at "highest"
    precision (`jax_on_cpu_at_highest`), so a CUDA-JAX machine gives the same verdicts.
    """
    setup = make_setup() if setup is None else setup
    keys = list(DEMONSTRATIONS) if keys is None else keys
    unknown = [key for key in keys if key not in DEMONSTRATIONS]
    if unknown:
        raise ValueError(f"unknown demonstration(s) {unknown}; choose from {', '.join(DEMONSTRATIONS)}")
    results = []
    for key in keys:
        if key in ON_THE_DEVICE:
            results.append(DEMONSTRATIONS[key](setup))
            continue
        with jax_on_cpu_at_highest():
            results.append(DEMONSTRATIONS[key](setup))
    return results


__all__ = [
    "DEMONSTRATIONS",
    "ON_THE_DEVICE",
    "Difference",
    "fully_masked_row",
    "head_size_arguments",
    "jax_on_cpu_at_highest",
    "mask_polarity",
    "run_differences",
    "scale_placement",
    "sequence_first",
    "tf32_default",
]
