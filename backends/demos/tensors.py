"""torch's own tensors and modules, as the column/row-sample article's claims use them.

nn.Linear's weight layout (claim 2), the batched head split by ``view`` + ``permute`` (claim 5), ``view``
after a transpose (claim 9) and nn.MultiheadAttention's sequence-first default (claim 10). Each function
runs torch and returns what it measured (NumPy arrays, shapes, strides, booleans, error lines); the claims
compare and word them. torch is imported inside each function, behind `needs`.
"""

from __future__ import annotations

import warnings

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, error_line, to_torch_mha_state_dict, torch_mha_unsupported_reason

from ..base import UnsupportedCase
from ..frameworks import shares_memory
from ._needs import needs


@needs("torch")
def linear_weight_facts() -> dict:
    """The article's nn.Linear(in_features=4, out_features=2), seeded: its weight's shape, max |linear(x) -
    (x @ W.T + b)| on 3 row samples, and the error line of ``x @ W`` without the transpose."""
    import torch

    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features=4, out_features=2, dtype=torch.float64)  # the article's example
    x = torch.randn(3, 4, dtype=torch.float64)  # (N, in): 3 row samples
    with torch.no_grad():
        y = linear(x)
        by_hand = x @ linear.weight.T + linear.bias
        difference = float((y - by_hand).abs().max())
        try:
            x @ linear.weight  # (3, 4) @ (2, 4): the weight must be transposed first
            raised = "no error"
        except RuntimeError as error:
            raised = error_line(error)
    return {"weight_shape": tuple(linear.weight.shape), "max_abs": difference, "x_at_w_error": raised}


@needs("torch")
def batched_head_split(q_batched: np.ndarray, heads: int) -> dict:
    """``q_batched (B, N, H*Dk)`` as a torch tensor, ``.view(B, N, H, Dk).permute(0, 2, 1, 3)``: the source's
    shape, the heads (B, H, N, Dk) as NumPy, their strides and whether they are a view of the source."""
    import torch

    qt = torch.from_numpy(q_batched)
    B, N = qt.shape[:2]
    heads_t = qt.view(B, N, heads, -1).permute(0, 2, 1, 3)  # (B, N, H, Dk) -> (B, H, N, Dk)
    return {
        "shape": tuple(qt.shape),
        "heads": heads_t.numpy(),
        "heads_shape": tuple(heads_t.shape),
        "strides": tuple(heads_t.stride()),
        "is_view": shares_memory(heads_t, qt),
    }


@needs("torch")
def view_after_transpose(heads: int, tokens: int, d_v: int) -> dict:
    """A context (H, N, Dv) transposed to (N, H, Dv), then merged: what ``.view`` raises, whether
    ``.contiguous()`` and ``.reshape`` copy, and how many warnings the silent copy gives (torch, float64)."""
    import torch

    H, N, Dv = heads, tokens, d_v
    context = torch.arange(H * N * Dv, dtype=torch.float64).reshape(H, N, Dv)  # (H, N, Dv): heads first
    swapped = context.transpose(0, 1)  # (N, H, Dv), a view with permuted strides
    try:
        swapped.view(N, H * Dv)
        view_error = "no error"
    except RuntimeError as error:
        view_error = error_line(error)
    made_contiguous = swapped.contiguous()  # (N, H, Dv), new memory in row-major order
    merged = made_contiguous.view(N, H * Dv)  # (N, H*Dv), now a view of that copy
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reshaped = swapped.reshape(N, H * Dv)  # (N, H*Dv): copies because it must
    return {
        "context_shape": tuple(context.shape),
        "transposed_strides": tuple(swapped.stride()),
        "measured": {
            "transposed_contiguous": swapped.is_contiguous(),
            "view_error": view_error,
            "contiguous_copies": not shares_memory(made_contiguous, context),
            "reshape_copies": not shares_memory(reshaped, context),
            "reshape_warnings": len(caught),
            "reshape_of_contiguous_is_view": shares_memory(context.reshape(H * N * Dv), context),
            "same_values": bool(torch.equal(reshaped, merged)),
        },
    }


@needs("torch")
def torch_mha_axis_order(cfg: MHAConfig, params: MHAParams, x: np.ndarray) -> dict:
    """nn.MultiheadAttention holding ``params`` (float64), default and ``batch_first=True``, fed ``x (B, N, E)``:
    the default's ``batch_first`` and three outputs, each (B, N, E) NumPy: the default fed (N, B, E) as it
    expects, the default fed (B, N, E) (read as (L=B, N=N, E): no error), and batch_first=True fed (B, N, E).
    A configuration nn.MultiheadAttention cannot hold raises `UnsupportedCase` with the reason."""
    reason = torch_mha_unsupported_reason(cfg)
    if reason:
        raise UnsupportedCase(reason)
    import torch

    state = {name: torch.from_numpy(value) for name, value in to_torch_mha_state_dict(cfg, params).items()}
    default = torch.nn.MultiheadAttention(cfg.d_model, cfg.n_heads, bias=cfg.bias, dtype=torch.float64)
    default.load_state_dict(state)
    batch_first = torch.nn.MultiheadAttention(
        cfg.d_model, cfg.n_heads, bias=cfg.bias, dtype=torch.float64, batch_first=True
    )
    batch_first.load_state_dict(state)
    xt = torch.from_numpy(x)  # (B, N, E)
    with torch.no_grad():
        seq_first_in = xt.transpose(0, 1)  # (N, B, E): what the default expects
        out_seq_first = default(seq_first_in, seq_first_in, seq_first_in, need_weights=False)[0].transpose(
            0, 1
        )  # (B, N, E)
        out_misfed = default(xt, xt, xt, need_weights=False)[0]  # (B, N, E) read as (L=B, N=N, E): no error
        out_batch_first = batch_first(xt, xt, xt, need_weights=False)[0]  # (B, N, E)
    return {
        "default_batch_first": default.batch_first,
        "seq_first_input": out_seq_first.numpy(),
        "batch_first_input_to_default": out_misfed.numpy(),
        "batch_first_true": out_batch_first.numpy(),
    }
