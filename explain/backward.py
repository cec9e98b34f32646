"""The backward pass explained: weight gradients in both conventions, and a backward-only bug caught.

Column samples (convention A, the numpy adapter): ``Y = W_A @ X + b`` with ``X (in, tokens)`` and
``W_A = W (out, in)``; its weight gradient is ``dW_A = dY @ X.T``, ``(out, in)``. Row samples
(convention B, ``x @ W_B + b`` with ``x (tokens, in)``, ``W_B = W.T (in, out)``) give
``dW_B = x.T @ dy``, ``(in, out)``. The two are one matrix, transposed: ``dW_A = (dW_B).T``,
because ``X = x.T`` and ``dY = dy.T``. (torch's ``nn.Linear`` stores ``W`` itself, not ``W_B``, so
its ``weight.grad`` is already ``(out, in)``.) `weight_gradient_rows` computes both from a real
backward pass and measures the difference.

The bug: grouped-query attention written by repeating each kv head for its G query heads is
correct in the forward, but the backward must *sum* the G gradients that come back to a
repeated head. `NoGroupSumBackend` (planted in `backends.demos`, with the numpy adapter it is built
on) takes the first one instead. The forward check passes it; the gradient check (`checks.grad`)
names it: `gqa_demonstration`.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.backends.demos import NoGroupSumBackend, NoGroupSumVJP
from mha_rosetta.core import MHAConfig, init_params, reference_mha_vjp, reference_stages


def weight_gradient_rows(cfg: MHAConfig, batch: int, tokens: int, seed: int) -> list[list[str]]:
    """One row per weight: both conventions' formulas and shapes, and max |dW_A - (dW_B).T| measured."""
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((batch, tokens, cfg.d_model))
    grads = reference_mha_vjp(cfg, params, x)
    # The backward stages give each projection's output gradient dy (row samples, (B, N, out)).
    forward = reference_stages(cfg, params, x)
    pairs = {
        "w_q": (x, grads.stages["d_q"]),
        "w_k": (x, grads.stages["d_k"]),
        "w_v": (x, grads.stages["d_v"]),
        "w_o": (forward["merged"], grads.stages["d_output"]),
    }
    rows = []
    for name, (x_rows, dy_rows) in pairs.items():
        d_w_a = d_w_b = 0.0
        for b in range(batch):
            X, dY = x_rows[b].T, dy_rows[b].T  # column samples: (in, N), (out, N), transposed views
            d_w_a = d_w_a + dY @ X.T  # (out, in)
            d_w_b = d_w_b + x_rows[b].T @ dy_rows[b]  # row samples: x.T @ dy, (in, out)
        difference = float(np.max(np.abs(d_w_a - d_w_b.T)))
        canonical = float(np.max(np.abs(d_w_a - getattr(grads.d_params, name))))
        rows.append(
            [
                name,
                f"dY @ X.T {d_w_a.shape}",
                f"x.T @ dy {d_w_b.shape}",
                f"{difference:.1e}",
                f"{canonical:.1e}",
            ]
        )
    return rows


WEIGHT_HEADERS = [
    "weight",
    "column samples: dW_A",
    "row samples: dW_B",
    "max |dW_A - (dW_B).T|",
    "max |dW_A - oracle|",
]


def gqa_demonstration() -> dict:
    """The bug through both checks on the spec's GQA case (in its own dtype): forward agrees, gradients are named."""
    from mha_rosetta.backends import get_backend
    from mha_rosetta.checks import SPEC_CASES, run_check

    dtype = SPEC_CASES["gqa"].dtypes[0]
    bug = NoGroupSumBackend("numpy:gqa-no-sum")
    backends = [bug, get_backend("numpy")]
    forward = run_check(backends=backends, strategies="standard", cases="gqa", dtypes=dtype)
    grad = run_check(backends=backends, strategies="standard", cases="gqa", dtypes=dtype, kind="grad")
    forward_run = next(r for r in forward.runs if r.label == bug.name)
    grad_run = next(r for r in grad.runs if r.label == bug.name)
    return {
        "dtype": dtype,
        "forward_status": str(forward_run.status),
        "forward_max_abs": forward_run.max_abs,
        "grad_status": str(grad_run.status),
        "grad_reason": grad_run.reason,
        "divergent_stage": grad_run.divergent_stage,
        "caught": forward_run.status.value == "agree" and grad_run.status.value == "DISAGREE",
    }


def backward_blocks(cfg: MHAConfig, batch: int, tokens: int, seed: int) -> tuple[list, bool]:
    """The explainer's backward section as report blocks, and whether the demonstrated bug was caught."""
    from mha_rosetta.checks.report import Block

    weights = Block(
        f"Weight gradients in both conventions ({cfg.describe()}, batch {batch}, {tokens} tokens; one real backward)",
        WEIGHT_HEADERS,
        weight_gradient_rows(cfg, batch, tokens, seed),
    )
    weights.notes.append(
        "Column samples X (in, N): Y = W_A @ X gives dW_A = dY @ X.T (out, in), the canonical layout. Row samples "
        "x (N, in): y = x @ W_B gives dW_B = x.T @ dy (in, out). X = x.T and dY = dy.T, so dW_A = (dW_B).T: the "
        "same numbers. nn.Linear stores W = W_B.T, so torch's weight.grad is (out, in) like dW_A."
    )
    demo = gqa_demonstration()
    bug = Block(
        "A backward-only bug: GQA that repeats kv heads but does not sum their gradients",
        ["check", "status", "what it says"],
        [
            [
                f"forward (mha-rosetta check), {demo['dtype']}",
                demo["forward_status"],
                f"max abs {demo['forward_max_abs']:.1e}: the forward is right",
            ],
            [f"gradients (mha-rosetta check --grad), {demo['dtype']}", demo["grad_status"], demo["grad_reason"]],
        ],
    )
    bug.notes.append(
        "numpy:gqa-no-sum keeps, for each kv head, the gradient of its group's first query head instead of the sum "
        "over the group (explain.backward.NoGroupSumVJP). The forward never sees it; the gradient check names the "
        f"gradients that differ and the first divergent backward stage ({demo['divergent_stage']})."
    )
    return [weights, bug], demo["caught"]


__all__ = [
    "WEIGHT_HEADERS",
    "NoGroupSumBackend",
    "NoGroupSumVJP",
    "backward_blocks",
    "gqa_demonstration",
    "weight_gradient_rows",
]
