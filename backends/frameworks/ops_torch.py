"""torch's ops object: the score steps (`ops.score_steps`) with torch's own primitives, in place where it can.

In place where nothing needs the old values (inference), out of place under autograd (``tanh``'s
backward reads its own output, which a later in-place step would change; softmax's its own).
Half precision computes each step in float32 and rounds it once, as the spec's rounded path does
(the softmax: torch's own, which accumulates half inputs in float32). torch is imported when an
ops object is made, never at module import; the conversions below likewise.
"""

from __future__ import annotations

import numpy as np

HALF = ("float16", "bfloat16")


def torch_dtype(name: str):
    """One of core.DTYPE_NAMES -> the torch dtype of the same name (torch has all four)."""
    import torch

    return getattr(torch, name)


def torch_device(device: str):
    """Our device name ("cpu", "gpu") -> torch.device."""
    import torch

    return torch.device("cuda" if device == "gpu" else "cpu")


def to_tensor(array, dtype: str, device: str):
    """A NumPy array (any float dtype, bfloat16 included) -> contiguous torch tensor.

    Goes through float64, which holds every float16/bfloat16/float32 value exactly, so
    the only rounding is the one to ``dtype``, the same as every other backend's.
    """
    import torch

    host = torch.from_numpy(np.ascontiguousarray(np.asarray(array, dtype=np.float64)))
    return host.to(device=torch_device(device), dtype=torch_dtype(dtype)).contiguous()


def optional_tensor(array, dtype: str, device: str):
    return None if array is None else to_tensor(array, dtype, device)


def bool_tensor(array: np.ndarray | None, device: str):
    import torch

    return None if array is None else torch.from_numpy(np.ascontiguousarray(array)).to(torch_device(device))


class TorchOps:
    """torch tensors: in-place updates, torch's fused softmax, CUDA when asked for.

    ``dtype`` and ``device`` are what `asarray` converts to; the score steps read neither.
    """

    library = "torch"
    works_in_place = True
    has_buffers = True  # view or copy is measurable (untyped_storage)

    def __init__(self, dtype: str | None = None, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.dtype_name, self.device_name = dtype, device
        self.dtype = None if dtype is None else getattr(torch, dtype)
        self.device = torch_device(device)

    # -- arrays and products (what the einops pipeline needs beside einops) ------------------
    def asarray(self, array: np.ndarray | None, cast: bool = True):
        # cast=False: the masks, booleans as they are
        return (
            optional_tensor(array, self.dtype_name, self.device_name) if cast else bool_tensor(array, self.device_name)
        )

    def einsum(self, pattern: str, a, b):
        import einops

        return einops.einsum(a, b, pattern)

    def scale(self, q, factor: float):
        return q * factor

    def add_bias(self, y, bias):
        return y.add_(bias)

    def _compute(self, x):
        """At least float32 (half precision computes the variants in float32, as the softmax does)."""
        return x.float() if x.dtype in (self.torch.float16, self.torch.bfloat16) else x

    def rms_norm(self, x, weight, eps: float, pattern: str):
        import einops

        xs = self._compute(x)
        mean_square = einops.reduce(xs * xs, pattern, "mean")
        return (xs * self.torch.rsqrt(mean_square + eps) * weight).to(x.dtype)

    def head_norm(self, x, eps: float, axis: int = -1):
        """A weightless RMS norm over ``axis`` (each head's features: Llama 4's after rotary, Gemma 4's values),
        ``x * rsqrt(mean(x**2) + eps)`` in at least float32, rounded back to ``x``'s dtype."""
        xs = self._compute(x)
        return (xs * self.torch.rsqrt((xs * xs).mean(dim=axis, keepdim=True) + eps)).to(x.dtype)

    def temper_queries(self, q, factors):
        """Llama 4's temperature: ``q`` times its positions' factors (laid out against it), in at least float32."""
        return (self._compute(q) * factors).to(q.dtype)

    def output_gate(self, merged, logits):
        """The output gate (``attn_output_gate``): (gate, merged * gate) with gate = torch.sigmoid(logits), laid out
        like ``merged``; the sigmoid in at least float32, rounded back to the logits' dtype."""
        gate = self.torch.sigmoid(self._compute(logits)).to(logits.dtype)
        return gate, merged * gate

    def take(self, table, index):
        return table[index]

    def snapshot(self, x):
        return x.clone()

    def synchronize(self, result) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def full(self, shape, value: float, dtype, like=None):
        return self.torch.full(shape, value, dtype=dtype, device=self.device if like is None else like.device)

    def broadcast(self, array, shape, dtype):
        return array.to(dtype).expand(shape).clone()  # a copy, updated in place later

    # -- the score steps --------------------------------------------------------------------
    def softcap(self, scores, cap: float):
        """``cap * tanh(scores / cap)`` (`core.variants.softcap`): in place on the scores' own buffer unless
        autograd tracks them; half precision in float32 (a new tensor), rounded once."""
        torch = self.torch
        x = self._compute(scores)
        out = None if x.requires_grad else x
        return torch.mul(torch.tanh(torch.div(x, cap, out=out), out=out), cap, out=out).to(scores.dtype)

    def add_score_bias(self, scores, bias):
        """``scores + bias`` rounded once to the scores' dtype; in place unless autograd tracks ``scores``.

        Half precision adds in the bias's float32 and rounds the sum (one rounding, as the spec's
        rounded path has it), which needs a new tensor.
        """
        if scores.dtype != bias.dtype and scores.element_size() < 4:
            return (scores.to(bias.dtype) + bias).to(scores.dtype)
        bias = bias.to(scores.dtype)
        return scores + bias if scores.requires_grad else scores.add_(bias)

    def positional_mask(self, scores, blocked):
        return scores.masked_fill_(blocked, float("-inf"))

    def softmax(self, scores, empty_rows, sinks=None, out=None):
        """torch.softmax over the last axis (into ``out`` where given, outside autograd); rows with no allowed key
        become zeros (the spec), never NaN. ``sinks`` broadcastable against the scores with a key axis of 1:
        one more key column, the softmax taken over Nk + 1 and the column dropped (a view), how gpt-oss's
        reference code writes ``exp(s_ij) / (exp(sink_h) + sum_k exp(s_ik))``."""
        torch = self.torch
        if empty_rows is not None:
            # Finite logits first: softmax of an all -inf row is NaN, and a fill after it would hide
            # the NaN in the forward but not in the backward (0 * NaN). The rows are known from the
            # mask before the timed region.
            scores.masked_fill_(empty_rows, 0.0)
        if sinks is not None:
            column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)  # (..., Nq, 1), a broadcast view
            weights = torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]  # (..., Nq, Nk), a view
        else:
            weights = torch.softmax(scores, dim=-1) if out is None else torch.softmax(scores, dim=-1, out=out)
        if empty_rows is not None:
            # Then zero those rows' weights: out of place under autograd (softmax's backward needs its own
            # output unchanged) and with the sinks (the weights are a view of the softmax).
            inplace = not weights.requires_grad and sinks is None
            weights = weights.masked_fill_(empty_rows, 0.0) if inplace else weights.masked_fill(empty_rows, 0.0)
        return weights
