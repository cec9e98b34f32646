"""Framework differences that bite people porting attention code, each shown live.

Every demonstration calls the libraries themselves (not this project's adapters, which
map the differences away) with the same canonical parameters and inputs, and reports
what came out: which keys a query attended to, the error against the float64 oracle,
what a row with nothing to attend to became, which shapes a module created. A library
that is not installed turns its line into a skip with the reason; a demonstration that
needs a GPU is skipped on a machine without one.

The package: `calls` (the `Difference` result and the loop that runs library calls into rows), `masks` and
`modules` (the demonstrations), and here the catalogue `DEMONSTRATIONS` and `run_differences`. The library
calls themselves live in `mha_rosetta.backends.demos`, with the other framework code: nothing here imports
a framework.
"""

from __future__ import annotations

from collections.abc import Callable

from mha_rosetta.backends.demos import jax_on_cpu_at_highest

from ..seed_setup import Setup, make_setup
from .calls import Difference
from .masks import fully_masked_row, mask_polarity, sequence_first
from .mlx import mlx_conventions
from .modules import head_size_arguments, scale_placement, tf32_default
from .onnx import onnx_attention

DEMONSTRATIONS: dict[str, Callable[[Setup], Difference]] = {
    "mask_polarity": mask_polarity,
    "sequence_first": sequence_first,
    "fully_masked_row": fully_masked_row,
    "scale_placement": scale_placement,
    "head_size_arguments": head_size_arguments,
    "tf32_default": tf32_default,
    "onnx_attention": onnx_attention,
    "mlx_conventions": mlx_conventions,
}


# The demonstrations whose subject is the device's own precision: everything else is pinned.
ON_THE_DEVICE = ("tf32_default",)


def run_differences(setup: Setup | None = None, keys: list[str] | None = None) -> list[Difference]:
    """Run the demonstrations (all by default) on ``setup`` (default: the article's configuration).

    Every demonstration but `ON_THE_DEVICE` runs its JAX calls on the CPU at "highest"
    precision (`backends.demos.jax_on_cpu_at_highest`), so a CUDA-JAX machine gives the same verdicts.
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
    "mlx_conventions",
    "run_differences",
    "scale_placement",
    "sequence_first",
    "tf32_default",
]
