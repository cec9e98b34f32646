"""Backward passes with torch autograd: the shared steps, and the torch adapter's nn.Linear path.

The torch oracles (`oracles.torch`: nn.MultiheadAttention, SDPA) build theirs on the same steps.

Each forward runs on leaf tensors that require grad (parameters, and the three inputs as
three separate leaves even when they are one array, so each slot gets its own gradient),
and ``torch.autograd.grad(output, leaves, cotangent)`` gives the gradients: the timed
region is that forward and that backward, nothing else. Gradients come back in the layout
of the tensors the library holds (``nn.Linear.weight`` is the canonical ``(out, in)``; the
per-head ``W_h (in, d)``, the packed ``in_proj_weight (3E, E)``) and are mapped to the
canonical layout by the same converters that loaded the parameters: a layout change is a
permutation of entries, so its gradient is the same permutation undone.

In row samples ``F.linear(x, W, b) = x @ W.T + b`` applies ``W_B = W.T``; autograd's
``dW_B = x.T @ dy`` is the transpose of the column-sample ``dW = dY @ X.T``, and torch
stores ``W`` itself, so ``W.grad`` is already ``(out, in)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mha_rosetta.core import (
    merge_head_bias,
    merge_head_matrices,
)

from ..base import PER_HEAD, PreparedVJP, tensor_to_numpy
from ..frameworks.score_parts import part_names
from .common import synchronizer, to_tensor, with_matmul_precision

INPUT_SLOTS = ("d_x_q", "d_x_k", "d_x_v")


def leaf(tensor):
    """A new leaf tensor that requires grad, sharing ``tensor``'s memory (None stays None)."""
    return None if tensor is None else tensor.detach().requires_grad_(True)


def autograd_prepared(
    forward: Callable,
    leaves: dict,
    cotangent,
    to_canonical: Callable[[dict], dict],
    device: str,
    allow_tf32: bool,
    info: dict,
) -> PreparedVJP:
    """A `PreparedVJP` whose timed ``run`` is ``forward()`` then autograd's backward of ``cotangent``."""
    import torch

    names = [name for name, tensor in leaves.items() if tensor is not None]
    tensors = [leaves[name] for name in names]

    def run():
        with torch.enable_grad():
            output = forward()
            grads = torch.autograd.grad(output, tensors, cotangent, allow_unused=True)
        return dict(zip(names, grads, strict=True))

    def to_grads(native: dict) -> dict:
        grads = {}
        for name, tensor in zip(names, tensors, strict=True):
            grad = native[name]
            grads[name] = np.zeros(tuple(tensor.shape)) if grad is None else tensor_to_numpy(grad)  # unused: zero
        return to_canonical(grads)

    info = {"backward": "torch.autograd.grad", **info}
    return PreparedVJP(with_matmul_precision(run, device, allow_tf32), to_grads, synchronizer(device), info=info)


def prepare_row_sample_vjp(layer, strategy: str, cotangent: np.ndarray, dtype: str, device: str, allow_tf32: bool):
    """Autograd through a `layer.RowSampleMHA` strategy (built with ``batched=False``)."""
    L = layer
    L.x_q, L.x_k, L.x_v = leaf(L.x_q), leaf(L.x_k), leaf(L.x_v)  # three leaves, even for self-attention
    per_head = strategy == PER_HEAD
    # PER_HEAD reads the per-head matrices W_h (in, d); the others the merged (out, in) weights.
    projections = [f"{kind}_{x}" for kind in ("w", "b") for x in "qkv"]
    names = [f"{name}_heads" if per_head else name for name in projections] + ["w_o", "b_o"]
    # the variants' (None, no leaf, when off)
    names += ["q_norm", "k_norm", *part_names(), "rel_bias", "w_gate", "b_gate"]
    for name in names:
        setattr(L, name, leaf(getattr(L, name)))
    leaves = {"d_x_q": L.x_q, "d_x_k": L.x_k, "d_x_v": L.x_v, **{name: getattr(L, name) for name in names}}
    method = getattr(L, strategy)

    def to_canonical(grads: dict) -> dict:
        if per_head:
            for x in "qkv":
                grads[f"w_{x}"] = merge_head_matrices(grads.pop(f"w_{x}_heads"))  # (H, in, d) -> (H*d, in)
                if f"b_{x}_heads" in grads:
                    grads[f"b_{x}"] = merge_head_bias(grads.pop(f"b_{x}_heads"))  # (H, d) -> (H*d,)
        return grads

    info = {"strategy": strategy, "layout": "row samples (B, tokens, features)"}
    return autograd_prepared(
        lambda: method(None), leaves, to_tensor(cotangent, dtype, device), to_canonical, device, allow_tf32, info
    )
