"""Claims 9-12: view after a transpose, nn.MultiheadAttention's sequence-first default, einsum without a
transpose, and the article's worked numbers.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.backends import UnsupportedCase
from mha_rosetta.backends.demos import LibraryMissing, torch_linear, torch_mha_axis_order, view_after_transpose
from mha_rosetta.core import error_line, linear, reference_mha

from ..memory import shares_memory
from ..seed_setup import Setup
from .registry import CONFIRMED, REFUTED, ClaimResult, _backend_run, _max_abs, _result, claim


@claim(
    9,
    "After a transpose, view needs .contiguous(); reshape copies silently",
    speed="merging heads after a transpose by .contiguous().view() against .reshape() (and a true view, the floor)",
)
def claim_9(setup: Setup) -> ClaimResult:
    cfg = setup.cfg
    H, N, Dv = cfg.n_heads, setup.tokens, cfg.d_v
    evidence, measured, ok = [], {}, True
    try:
        torch_facts = view_after_transpose(H, N, Dv)  # torch: context (H, N, Dv).transpose(0, 1), then merged
    except LibraryMissing:
        evidence.append("torch not installed: view/contiguous shown with NumPy only")
    else:
        facts = measured["torch"] = torch_facts["measured"]
        view_error = facts["view_error"]
        ok = ok and view_error != "no error" and facts["contiguous_copies"] and facts["reshape_copies"]
        ok = ok and facts["reshape_warnings"] == 0 and facts["same_values"]
        evidence += [
            f"torch: context {torch_facts['context_shape']}.transpose(0, 1) has strides {torch_facts['transposed_strides']}, contiguous: {facts['transposed_contiguous']}",
            f".view({N}, {H * Dv}) raises {view_error}",
            f".contiguous() copies (new storage: {facts['contiguous_copies']}), then .view works",
            f".reshape({N}, {H * Dv}) copies (new storage: {facts['reshape_copies']}) with {facts['reshape_warnings']} warnings; "
            f"on a contiguous tensor reshape is a view: {facts['reshape_of_contiguous_is_view']}",
        ]
    context_np = np.arange(H * N * Dv, dtype=np.float64).reshape(H, N, Dv)  # (H, N, Dv)
    swapped_np = context_np.transpose(1, 0, 2)  # (N, H, Dv), a view
    try:
        np.reshape(swapped_np, (N, H * Dv), copy=False)  # NumPy's "view or fail" (numpy >= 2.1)
        numpy_error = "no error"
    except ValueError as error:
        numpy_error = error_line(error)
    except TypeError:
        numpy_error = "n/a (this NumPy has no reshape(copy=False))"
    reshaped_np = swapped_np.reshape(N, H * Dv)  # (N, H*Dv): a silent copy
    measured["numpy"] = {
        "no_copy_reshape_error": numpy_error,
        "reshape_copies": not shares_memory(reshaped_np, context_np),
    }
    ok = ok and measured["numpy"]["reshape_copies"]
    evidence.append(
        f"numpy: reshape(copy=False) of the transposed array raises {numpy_error}; plain reshape copies silently: "
        f"{measured['numpy']['reshape_copies']}"
    )
    return _result(9, CONFIRMED if ok else REFUTED, evidence, measured)


@claim(
    10,
    "nn.MultiheadAttention is sequence-first (N, B, E) unless batch_first=True",
    plain_mha_only=True,
)
def claim_10(setup: Setup) -> ClaimResult:
    try:
        outputs = torch_mha_axis_order(setup.cfg, setup.params, setup.x)
    except LibraryMissing:
        return _result(10, "skipped: torch not installed", ["needs torch.nn.MultiheadAttention"])
    except UnsupportedCase as reason:
        return _result(10, "skipped: configuration not expressible as nn.MultiheadAttention", [str(reason)])
    cfg, params, x = setup.cfg, setup.params, setup.x
    reference = reference_mha(cfg, params, x)
    default_batch_first = outputs.pop("default_batch_first")
    errors = {name: _max_abs(output, reference) for name, output in outputs.items()}
    measured = {"default_batch_first": default_batch_first, "errors": errors}
    ok = (
        default_batch_first is False
        and errors["seq_first_input"] <= 1e-10
        and errors["batch_first_true"] <= 1e-10
        and errors["batch_first_input_to_default"] > 1e-3
    )
    B, N, E = x.shape
    evidence = [
        f"nn.MultiheadAttention({cfg.d_model}, {cfg.n_heads}).batch_first = {default_batch_first}",
        f"default module fed (N, B, E) = {(N, B, E)}: max error vs oracle {errors['seq_first_input']:.1e}",
        f"default module fed (B, N, E) = {(B, N, E)}: no error raised, output shape {outputs['batch_first_input_to_default'].shape}, "
        f"max error {errors['batch_first_input_to_default']:.2f} (it attended across the batch instead of the tokens)",
        f"batch_first=True fed (B, N, E): max error {errors['batch_first_true']:.1e}",
    ]
    return _result(10, CONFIRMED if ok else REFUTED, evidence, measured)


@claim(
    11,
    "einsum can keep (N, h, d_k) and skip the transpose",
    speed="einsum on (B, N, H, d_k) against transpose + matmul",
    plain_mha_only=True,
)
def claim_11(setup: Setup) -> ClaimResult:
    cfg, params, x = setup.cfg, setup.params, setup.x[0]
    N, H = x.shape[0], cfg.n_heads
    q = (linear(x, params.w_q, params.b_q)).reshape(N, H, cfg.d_k)  # (N, H, Dk): a view, no transpose
    k = (linear(x, params.w_k, params.b_k)).reshape(N, H, cfg.d_k)  # (N, H, Dk)
    v = (linear(x, params.w_v, params.b_v)).reshape(N, H, cfg.d_v)  # (N, H, Dv)
    scores_einsum = cfg.scale * np.einsum("nhd,mhd->hnm", q, k)  # (H, N, N) straight from (N, H, Dk)
    scores_transposed = cfg.scale * q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)  # (H, N, Dk) @ (H, Dk, N)
    weights = np.exp(scores_einsum - scores_einsum.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    context = np.einsum("hnm,mhd->nhd", weights, v)  # (N, H, Dv): tokens first again
    merged = context.reshape(N, -1)  # (N, H*Dv): a view, since context is already token-major
    output = linear(merged, params.w_o, params.b_o)  # (N, D)
    reference = reference_mha(cfg, params, x)
    score_diff, output_error = _max_abs(scores_einsum, scores_transposed), _max_abs(output, reference)
    merge_is_view = shares_memory(merged, context)
    evidence = [
        f"scores: einsum('nhd,mhd->hnm') on {q.shape} vs transpose + matmul: max diff {score_diff:.1e}",
        f"context einsum('hnm,mhd->nhd') -> {context.shape}; merge to {merged.shape} is a view (no copy): {merge_is_view}",
        f"whole pass without any transpose vs float64 oracle: max error {output_error:.1e}",
    ]
    measured = {"score_diff": score_diff, "output_error": output_error, "merge_is_view": merge_is_view}
    ok = score_diff <= 1e-10 and output_error <= 1e-10 and merge_is_view
    output_einops, why = _backend_run("einops-numpy", setup)
    if output_einops is not None:
        measured["einops_adapter_error"] = _max_abs(output_einops, reference_mha(cfg, params, setup.x))
        ok = ok and measured["einops_adapter_error"] <= 1e-10
        evidence.append(
            f"einops-numpy adapter (rearrange + einsum, no transpose): max error {measured['einops_adapter_error']:.1e}"
        )
    else:
        evidence.append(why)
    return _result(11, CONFIRMED if ok else REFUTED, evidence, measured)


@claim(
    12,
    "Worked numbers: token [1, 0, 2, 0, ...] with scorer [0.5, 0, 1.0, 0, ...] gives 2.5; the 4-token example D[0, 0] = [[1, 2], [5, 6]], D[0, 1] = [[3, 4], [7, 8]]",
)
def claim_12(setup: Setup) -> ClaimResult:
    d_model = 12  # the column/row-sample article's token width
    token = np.zeros(d_model)
    token[[0, 2]] = [1.0, 2.0]
    scorer = np.zeros(d_model)
    scorer[[0, 2]] = [0.5, 1.0]
    w_a = np.zeros((4, d_model))  # (d_k, d_model): column samples, scorer 0 is row 0
    w_a[0] = scorer
    w_b = np.zeros((d_model, 4))  # (d_model, d_k): row samples, scorer 0 is column 0
    w_b[:, 0] = scorer
    scores = {
        "column samples (W_A @ x)": float((w_a @ token[:, None])[0, 0]),
        "row samples (x @ W_B)": float((token[None, :] @ w_b)[0, 0]),
    }
    try:
        scores["torch nn.Linear"] = float(
            torch_linear(w_a, None, token)[0][0]
        )  # nn.Linear.weight is W_A: scorer 0 is row 0
    except LibraryMissing:
        pass
    a = np.arange(1, 17).reshape(4, 4)  # 4 tokens of 4 numbers
    d = a.reshape(2, 2, 4).reshape(2, 2, 2, 2).transpose(0, 2, 1, 3)  # (2, 2, 4) -> (2, 2, 2, 2) -> swap axes 1, 2
    blocks = {f"D[{g}, {s}]": d[g, s].tolist() for g in range(2) for s in range(2)}
    expected = {
        "D[0, 0]": [[1, 2], [5, 6]],
        "D[0, 1]": [[3, 4], [7, 8]],
        "D[1, 0]": [[9, 10], [13, 14]],
        "D[1, 1]": [[11, 12], [15, 16]],
    }
    ok = all(value == 2.5 for value in scores.values()) and blocks == expected
    evidence = [", ".join(f"{name}: {value}" for name, value in scores.items())]
    evidence.append(", ".join(f"{name} = {value}" for name, value in blocks.items()))
    evidence.append(
        f"token a1 = {a[1].tolist()} sits at D[0, 0, 1] = {d[0, 0, 1].tolist()} and D[0, 1, 1] = {d[0, 1, 1].tolist()}"
    )
    measured = {"scores": scores, "blocks": blocks}
    return _result(12, CONFIRMED if ok else REFUTED, evidence, measured)
