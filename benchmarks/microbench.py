"""The kernels of the speed questions: each builds a few variants of one computation.

A builder takes the sizes and returns ``{variant name: zero-argument callable}``, all
variants computing the same thing from the same already-made arrays, so that timing them
round-robin (`timing.time_interleaved`) compares formulations and nothing else. Every
callable waits for its result (CUDA synchronisation), so asynchronous work is timed.

Row samples everywhere (``X`` is ``(B, N, D)``), weights in the ``(out, in)`` layout of
``nn.Linear`` — the convention of the column/row-sample article's examples. NumPy and PyTorch variants are
written the way a user of that library would write them. NumPy is imported inside the builders; PyTorch,
its device, its synchronisation and its random arrays come from the framework layer
(`Framework.kernel_arrays`), so this module imports no framework: it is imported by measured children only.
"""

from __future__ import annotations

import math

# -- NumPy --------------------------------------------------------------------------------------


def _np_softmax(scores):
    import numpy as np

    scores = scores - scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def numpy_heads(batch: int, tokens: int, d_model: int, heads: int, dtype: str = "float32") -> dict:
    """Claim 7 in NumPy: one batched product over heads, slicing heads, per-head matrices."""
    import numpy as np

    rng = np.random.default_rng(0)
    d_k = d_model // heads
    scale = 1.0 / math.sqrt(d_k)
    x = rng.standard_normal((batch, tokens, d_model)).astype(dtype)  # (B, N, D)
    w_q, w_k, w_v, w_o = (rng.standard_normal((d_model, d_model)).astype(dtype) / math.sqrt(d_model) for _ in range(4))
    # Per-head matrices: rows h*d_k:(h+1)*d_k of the merged (out, in) weight, stored apart.
    per_head = [
        (
            *(np.ascontiguousarray(w[h * d_k : (h + 1) * d_k]) for w in (w_q, w_k, w_v)),  # (d_k, D) each
            np.ascontiguousarray(w_o[:, h * d_k : (h + 1) * d_k]),  # (D, d_k)
        )
        for h in range(heads)
    ]

    def batched():
        # (B, N, D) -> (B, N, H, d_k) view -> (B, H, N, d_k) view, for each of q, k, v
        q, k, v = ((x @ w.T).reshape(batch, tokens, heads, d_k).transpose(0, 2, 1, 3) for w in (w_q, w_k, w_v))
        weights = _np_softmax((q @ k.transpose(0, 1, 3, 2)) * scale)  # (B, H, N, N)
        context = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, d_model)  # (B, N, H*d_k)
        return context @ w_o.T  # (B, N, D)

    def slicing():
        q, k, v = x @ w_q.T, x @ w_k.T, x @ w_v.T  # (B, N, D) each, heads side by side in the features
        parts = []
        for h in range(heads):
            cols = slice(h * d_k, (h + 1) * d_k)
            weights = _np_softmax((q[:, :, cols] @ k[:, :, cols].transpose(0, 2, 1)) * scale)  # (B, N, N)
            parts.append(weights @ v[:, :, cols])  # (B, N, d_k)
        return np.concatenate(parts, axis=-1) @ w_o.T  # (B, N, D)

    def per_head_matrices():
        out = np.zeros((batch, tokens, d_model), dtype=x.dtype)  # (B, N, D)
        for wq_h, wk_h, wv_h, wo_h in per_head:
            weights = _np_softmax(((x @ wq_h.T) @ (x @ wk_h.T).transpose(0, 2, 1)) * scale)  # (B, N, N)
            out += (weights @ (x @ wv_h.T)) @ wo_h.T  # (B, N, D): each head's share of the output
        return out

    return {"batched": batched, "slicing": slicing, "per_head": per_head_matrices}


def numpy_linear_layout(tokens: int, d_in: int, d_out: int, dtype: str = "float32") -> dict:
    """Claim 3 in NumPy: X @ W.T against W @ X.T (both read a transposed, non-contiguous view)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, d_in)).astype(dtype)  # (N, in), row samples, contiguous
    w = rng.standard_normal((d_out, d_in)).astype(dtype)  # (out, in), nn.Linear layout

    return {
        "x_at_wT": lambda: x @ w.T,  # (N, out); w.T is a view with swapped strides
        "w_at_xT": lambda: w @ x.T,  # (out, N); x.T is a view with swapped strides
        "w_at_xT_back": lambda: np.ascontiguousarray((w @ x.T).T),  # (N, out), copied back to row samples
    }


def numpy_einsum(batch: int, tokens: int, heads: int, d_k: int, dtype: str = "float32") -> dict:
    """Claim 11 in NumPy: scores and context by einsum on (B, N, H, d_k), or transpose + matmul."""
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, tokens, heads, d_k)).astype(dtype) for _ in range(3))  # (B, N, H, d_k)

    def transpose_matmul():
        qt, kt, vt = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # (B, H, N, d_k), views
        scores = qt @ kt.transpose(0, 1, 3, 2)  # (B, H, N, N)
        return (scores @ vt).transpose(0, 2, 1, 3).reshape(batch, tokens, heads * d_k)  # (B, N, H*d_k), a copy

    def einsum_plain():
        scores = np.einsum("bnhd,bmhd->bhnm", q, k)  # (B, H, N, N)
        return np.einsum("bhnm,bmhd->bnhd", scores, v).reshape(batch, tokens, heads * d_k)  # (B, N, H*d_k)

    def einsum_optimized():
        scores = np.einsum("bnhd,bmhd->bhnm", q, k, optimize=True)  # (B, H, N, N)
        return np.einsum("bhnm,bmhd->bnhd", scores, v, optimize=True).reshape(batch, tokens, heads * d_k)

    return {"transpose_matmul": transpose_matmul, "einsum": einsum_plain, "einsum_optimize": einsum_optimized}


def numpy_merge_copy(batch: int, tokens: int, heads: int, d_k: int, dtype: str = "float32") -> dict:
    """Claim 9 in NumPy: merging heads after a transpose copies, whichever way it is spelled."""
    import numpy as np

    rng = np.random.default_rng(0)
    context = rng.standard_normal((batch, heads, tokens, d_k)).astype(dtype)  # (B, H, N, d_k)
    merged_layout = np.ascontiguousarray(context.transpose(0, 2, 1, 3))  # (B, N, H, d_k), already merged order

    return {
        "contiguous_then_view": lambda: np.ascontiguousarray(context.transpose(0, 2, 1, 3)).reshape(batch, tokens, -1),
        "reshape": lambda: context.transpose(0, 2, 1, 3).reshape(batch, tokens, -1),  # copies silently
        "view_no_copy": lambda: merged_layout.reshape(batch, tokens, -1),  # contiguous: a view, the floor
    }


# -- PyTorch ------------------------------------------------------------------------------------


def _torch_setup(device: str, dtype: str):
    """torch, a ``sync(result)`` that waits for the device and returns the result, and ``make(*shape)``:
    standard normal draws from one generator seeded 0, on the device in ``dtype`` (the framework layer's
    `Framework.kernel_arrays`, which also holds float32 products to float32 on a GPU: TF32 off)."""
    from mha_rosetta.backends.frameworks import get_framework

    return get_framework("torch").kernel_arrays(device, dtype)


def torch_heads(batch: int, tokens: int, d_model: int, heads: int, dtype: str = "float32", device: str = "cpu") -> dict:
    """Claim 7 in PyTorch (the column/row-sample article's own setting), on CPU or CUDA."""
    torch, sync, make = _torch_setup(device, dtype)
    d_k = d_model // heads
    scale = 1.0 / math.sqrt(d_k)
    x = make(batch, tokens, d_model)  # (B, N, D)
    w_q, w_k, w_v, w_o = (make(d_model, d_model) / math.sqrt(d_model) for _ in range(4))  # (out, in)
    per_head = [
        (
            *(w[h * d_k : (h + 1) * d_k].contiguous() for w in (w_q, w_k, w_v)),  # (d_k, D) each
            w_o[:, h * d_k : (h + 1) * d_k].contiguous(),  # (D, d_k)
        )
        for h in range(heads)
    ]

    @torch.inference_mode()
    def batched():
        # (B, N, D) -> (B, N, H, d_k) view -> (B, H, N, d_k) view, for each of q, k, v
        q, k, v = ((x @ w.T).view(batch, tokens, heads, d_k).transpose(1, 2) for w in (w_q, w_k, w_v))
        weights = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1)  # (B, H, N, N)
        context = (weights @ v).transpose(1, 2).contiguous().view(batch, tokens, d_model)  # (B, N, H*d_k)
        return sync(context @ w_o.T)  # (B, N, D)

    @torch.inference_mode()
    def slicing():
        q, k, v = x @ w_q.T, x @ w_k.T, x @ w_v.T  # (B, N, D) each
        parts = []
        for h in range(heads):
            cols = slice(h * d_k, (h + 1) * d_k)
            weights = torch.softmax((q[..., cols] @ k[..., cols].transpose(-2, -1)) * scale, dim=-1)  # (B, N, N)
            parts.append(weights @ v[..., cols])  # (B, N, d_k)
        return sync(torch.cat(parts, dim=-1) @ w_o.T)  # (B, N, D)

    @torch.inference_mode()
    def per_head_matrices():
        out = torch.zeros_like(x)  # (B, N, D)
        for wq_h, wk_h, wv_h, wo_h in per_head:
            weights = torch.softmax(((x @ wq_h.T) @ (x @ wk_h.T).transpose(-2, -1)) * scale, dim=-1)  # (B, N, N)
            out += (weights @ (x @ wv_h.T)) @ wo_h.T  # (B, N, D)
        return sync(out)

    return {"batched": batched, "slicing": slicing, "per_head": per_head_matrices}


def torch_linear_layout(tokens: int, d_in: int, d_out: int, dtype: str = "float32", device: str = "cpu") -> dict:
    """Claim 3 in PyTorch: ``x @ W.t()`` (what nn.Linear does) against ``W @ x.t()``."""
    torch, sync, make = _torch_setup(device, dtype)
    x, w = make(tokens, d_in), make(d_out, d_in)  # (N, in), (out, in)
    timed = torch.inference_mode()  # each variant runs without autograd's bookkeeping
    return {
        "x_at_wT": timed(lambda: sync(x @ w.t())),  # (N, out)
        "w_at_xT": timed(lambda: sync(w @ x.t())),  # (out, N)
        "w_at_xT_back": timed(lambda: sync((w @ x.t()).t().contiguous())),  # (N, out), copied back to row samples
    }


def torch_einsum(batch: int, tokens: int, heads: int, d_k: int, dtype: str = "float32", device: str = "cpu") -> dict:
    """Claim 11 in PyTorch: ``torch.einsum`` on (B, N, H, d_k) against transpose + matmul."""
    torch, sync, make = _torch_setup(device, dtype)
    q, k, v = (make(batch, tokens, heads, d_k) for _ in range(3))  # (B, N, H, d_k)

    @torch.inference_mode()
    def transpose_matmul():
        qt, kt, vt = (a.transpose(1, 2) for a in (q, k, v))  # (B, H, N, d_k), views
        scores = qt @ kt.transpose(-2, -1)  # (B, H, N, N)
        return sync((scores @ vt).transpose(1, 2).reshape(batch, tokens, heads * d_k))  # (B, N, H*d_k)

    @torch.inference_mode()
    def einsum():
        scores = torch.einsum("bnhd,bmhd->bhnm", q, k)  # (B, H, N, N)
        return sync(torch.einsum("bhnm,bmhd->bnhd", scores, v).reshape(batch, tokens, heads * d_k))

    return {"transpose_matmul": transpose_matmul, "einsum": einsum}


def torch_merge_copy(
    batch: int, tokens: int, heads: int, d_k: int, dtype: str = "float32", device: str = "cpu"
) -> dict:
    """Claim 9 in PyTorch: ``.contiguous().view()`` against ``.reshape()`` after a transpose."""
    torch, sync, make = _torch_setup(device, dtype)
    context = make(batch, heads, tokens, d_k)  # (B, H, N, d_k)
    merged_layout = context.transpose(1, 2).contiguous()  # (B, N, H, d_k)
    timed = torch.inference_mode()  # each variant runs without autograd's bookkeeping
    return {  # (B, N, H*d_k) each
        "contiguous_then_view": timed(lambda: sync(context.transpose(1, 2).contiguous().view(batch, tokens, -1))),
        "reshape": timed(lambda: sync(context.transpose(1, 2).reshape(batch, tokens, -1))),  # copies silently
        "view_no_copy": timed(lambda: sync(merged_layout.view(batch, tokens, -1))),  # contiguous: a view, the floor
    }


BUILDERS = {
    ("heads", "numpy"): numpy_heads,
    ("heads", "torch"): torch_heads,
    ("linear_layout", "numpy"): numpy_linear_layout,
    ("linear_layout", "torch"): torch_linear_layout,
    ("einsum", "numpy"): numpy_einsum,
    ("einsum", "torch"): torch_einsum,
    ("merge_copy", "numpy"): numpy_merge_copy,
    ("merge_copy", "torch"): torch_merge_copy,
}
