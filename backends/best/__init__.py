"""Each framework at its best: ``numpy-best``, ``torch-best``, ``jax-best`` and ``mlx-best``.

The convention adapters (`backends.numpy`, `.torch`, `.jax`, `.einops`) teach a convention and
are checked against each other; they are never a framework's speed. A figure that compares
frameworks compares what each framework can do, so each has a path written the way that
library's best users write it, for the forward, the backward and the decode step, checked
against the same float64 oracle as everything else (issue 43). One module per framework, each
importing its library inside its functions:

* `numpy`: row samples ``x @ W``, W stored ``(in, out)``; the forward one BLAS product per (batch
  item, head) on the heads' column slices (no head transposes; a per-head loop beat the batched
  pipeline on this kind of machine, DESIGN.md), one score workspace reused; the backward by hand (NumPy has no
  autodiff); the decode step a grouped GEMM: each group's query heads folded into the rows of one
  product per kv head, so each kv head is read once per step, not once per query head.
* `torch`: ``F.linear`` + ``F.scaled_dot_product_attention`` (the ``torch-sdpa`` oracle's own
  pass, `oracles.torch.sdpa_pass`), autograd for the backward; decoding a static cache written in
  place (slice assignment, never ``torch.cat``) read up to its write index, the group folded into
  the query axis (CPU SDPA with ``enable_gqa`` re-reads K and V per query head).
* `jax`: one jitted function, the weights stored ``(in, out)`` so that ``x @ W`` is what XLA
  reads without a transpose, ``jax.vjp`` of it for the backward; the decode step jitted with its
  cache donated (``donate_argnums``: written in place), in the layout XLA reads without a copy.
* `mlx`: mlx-lm's model code around ``mx.fast.scaled_dot_product_attention`` (GQA without tiling),
  ``mx.vjp`` for the backward; decoding a static cache written by slice assignment (never
  ``mx.concatenate``, which mlx-lm's stepped cache does when it grows), evaluated by ``mx.eval``.

What each of them must do is asserted, not timed, by ``tests/test_best_paths.py`` (the fairness
test: the JAX step's program holds no copy of its cache, torch's step allocates nothing that
grows with the context, NumPy's step reads each kv head once). They implement the layer the
timings compare (GQA, rotary, the causal and padding masks, the qkv bias, rope scaling) in
float32 and float64, and refuse everything else with a reason (`common.BestPath`).
"""

from __future__ import annotations

# The best path of each framework, by the array library an implementation computes in (the last of its
# registry's ``requires`` that is one of these: einops-torch computes in torch, numpy-best in NumPy).
BEST_BY_LIBRARY = {"numpy": "numpy-best", "torch": "torch-best", "jax": "jax-best", "mlx": "mlx-best"}


# Libraries that compute in NumPy's arrays without being an array library of their own (einops-numpy).
ON_NUMPY = frozenset({"numpy", "einops"})
# Runtimes an implementation computes in that have no best path here (torch-onnx exports from torch, then runs
# in ONNX Runtime): such an implementation is compared with no best path rather than with a wrong one.
NO_BEST_PATH = frozenset({"onnxruntime"})


def best_path_for(implementation: str) -> str | None:
    """The name of the best path ``implementation`` is compared with (``"einops-jax"`` -> ``"jax-best"``,
    ``"torch:slicing"`` -> ``"torch-best"``, ``"einops-numpy"`` -> ``"numpy-best"``), or None for an
    implementation the registry does not know or whose library has no best path here (ONNX Runtime's
    ``onnx``: its numbers are not NumPy's)."""
    from mha_rosetta.backends.registry import REGISTRY

    entry = REGISTRY.get(implementation.split(":")[0])
    if entry is None or NO_BEST_PATH & set(entry.requires):
        return None
    libraries = [module for module in entry.requires if module in BEST_BY_LIBRARY]
    if libraries:
        return BEST_BY_LIBRARY[libraries[-1]]
    return BEST_BY_LIBRARY["numpy"] if set(entry.requires) <= ON_NUMPY else None
