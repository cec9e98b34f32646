"""Does every installed framework reach the GPU? Asked before a ``--devices gpu`` check counts as passed.

A GPU check that compares only what happens to run there proves little: plain ``jax`` is
CPU-only, a CPU build of torch sees no CUDA, and ``JAX_PLATFORMS=cpu`` or
``CUDA_VISIBLE_DEVICES=`` hide a GPU without an error. Every backend of such a framework then
turns "unsupported" on the GPU, and the check would still pass on whatever else ran. So when
the GPU is asked for, each framework that a selected backend needs and that can drive a GPU
must see one; one that does not is an error of the check that names it and says why.

The probes are the adapters' own device lists (`_torch_common.torch_devices`,
`_jax_common.jax_devices`), so the check and the adapters cannot disagree about a device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable


def _torch_probe() -> tuple[bool, str]:
    import torch

    from mha_rosetta.backends.torch.common import torch_devices

    if "gpu" in torch_devices():
        return True, ""
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return False, (
        f"torch {torch.__version__} ({build}) sees no CUDA device: torch.cuda.is_available() is False"
        f"{_env_note('CUDA_VISIBLE_DEVICES')}; install a CUDA build of torch"
    )


def _jax_probe() -> tuple[bool, str]:
    import jax

    from mha_rosetta.backends.jax.common import jax_devices

    if "gpu" in jax_devices():
        return True, ""
    platforms = sorted({device.platform for device in jax.devices()})
    return False, (
        f"jax {jax.__version__} sees no GPU (its devices: {', '.join(platforms)})"
        f"{_env_note('JAX_PLATFORMS')}{_env_note('CUDA_VISIBLE_DEVICES')}; plain jax is CPU-only: "
        "install its CUDA plugin, pip install 'jax[cuda13]' (or 'jax[cuda12]')"
    )


def _env_note(name: str) -> str:
    value = os.environ.get(name)
    return "" if value is None else f" ({name}={value!r})"


# framework (a module name in BackendEntry.requires) -> probe: (sees a GPU, why not)
GPU_PROBES: dict[str, Callable[[], tuple[bool, str]]] = {"torch": _torch_probe, "jax": _jax_probe}


def frameworks_without_gpu(backends: Iterable) -> dict[str, str]:
    """The GPU-capable frameworks the ``backends`` need that see no GPU here: framework -> reason.

    A backend names its frameworks in ``requires`` (set from the registry entry); NumPy and
    einops on NumPy arrays need none that can drive a GPU, so they are never asked.
    """
    needed = sorted({module for backend in backends for module in getattr(backend, "requires", ())} & GPU_PROBES.keys())
    problems = {}
    for framework in needed:
        try:
            seen, reason = GPU_PROBES[framework]()
        except Exception as error:  # a framework that cannot even list its devices does not reach the GPU
            seen, reason = False, f"{framework} could not list its devices: {type(error).__name__}: {error}"
        if not seen:
            problems[framework] = reason
    return problems
