"""Does every installed framework reach the GPU? Asked before a ``--devices gpu`` check counts as passed.

A GPU check that compares only what happens to run there proves little: plain ``jax`` is
CPU-only, a CPU build of torch sees no CUDA, and ``JAX_PLATFORMS=cpu`` or
``CUDA_VISIBLE_DEVICES=`` hide a GPU without an error. Every backend of such a framework then
turns "unsupported" on the GPU, and the check would still pass on whatever else ran. So when
the GPU is asked for, each framework that a selected backend needs and that can drive a GPU
must see one; one that does not is an error of the check that names it and says why.

The probes are the framework layer's (`Framework.gpu_probe`), built on the same device lists
the adapters use (`frameworks.torch.torch_devices`, `frameworks.jax.jax_devices`), so the check
and the adapters cannot disagree about a device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mha_rosetta.backends.frameworks import gpu_frameworks

# framework (a module name in BackendEntry.requires) -> probe: (sees a GPU, why not)
GPU_PROBES: dict[str, Callable[[], tuple[bool, str]]] = {
    name: framework.gpu_probe for name, framework in gpu_frameworks().items()
}


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
