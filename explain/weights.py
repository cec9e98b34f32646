"""One layer's weights in every layout users meet, side by side, each tied back to canonical.

For every layout the table states the transpose/reshape that makes it from the
canonical ``(out, in)`` weight, then proves it: the formula computed here with plain
NumPy must equal what the converter in `core.layouts` returns, bit for bit; the
converter's inverse must give the canonical weight back exactly; and one scorer
(scorer ``j`` of head ``h``) must be found where the table says it is. Where the
library itself is installed, the weight is also loaded into the real module (or its
shapes are read from the real module's initialiser).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np

from mha_rosetta.backends.demos import (
    LibraryMissing,
    equinox_query_weight_shape,
    flax_kernel_shapes,
    torch_linear,
    torch_mha_state_round_trip,
)
from mha_rosetta.core import (
    MHAConfig,
    MHAParams,
    from_dense_general_kernel,
    from_equinox_weights,
    from_row_sample,
    from_torch_mha_state_dict,
    merge_head_matrices,
    merge_output_matrix,
    split_head_matrices,
    split_output_matrix,
    to_dense_general_kernel,
    to_equinox_weights,
    to_row_sample,
    to_torch_mha_state_dict,
    torch_mha_unsupported_reason,
)


@dataclass(frozen=True)
class WeightLayout:
    layout: str
    shape: tuple[int, ...]
    scorers: str  # where the scorers (one per output feature) are
    from_canonical: str  # the formula that makes this layout from canonical
    to_canonical: str  # the formula that goes back
    head_scorer: str  # where scorer j of head h lives in this layout
    verified: bool | None  # None: this layout cannot hold the configuration (evidence says why)
    evidence: str

    def to_dict(self) -> dict:
        return asdict(self)


def _layout(
    layout: str,
    scorers: str,
    from_text: str,
    to_text: str,
    head_text: str,
    formula: np.ndarray,
    converted: np.ndarray,
    back: np.ndarray,
    scorer_here: np.ndarray,
    extra: list[str] | None = None,
    *,
    canonical: np.ndarray,
    scorer_canonical: np.ndarray,
) -> WeightLayout:
    """One layout, verified by the three checks every layout passes (formula == converter, exact round trip,
    scorer found) and by the real-module evidence in ``extra`` (an item starting "FAILED" fails it)."""
    checks = {
        "formula == converter": formula.shape == converted.shape and np.array_equal(formula, converted),
        "round trip exact": back.shape == canonical.shape and np.array_equal(back, canonical),
        "scorer found": np.array_equal(scorer_here, scorer_canonical),
    }
    extra = extra or []
    ok = all(checks.values()) and not any(item.startswith("FAILED") for item in extra)
    evidence = [f"{name}: {'yes' if passed else 'NO'}" for name, passed in checks.items()] + extra
    return WeightLayout(layout, tuple(converted.shape), scorers, from_text, to_text, head_text, ok, "; ".join(evidence))


def _torch_linear_evidence(cfg: MHAConfig, params: MHAParams, x: np.ndarray) -> str:
    """Load w_q into a real nn.Linear and measure what it computes."""
    y, shape = torch_linear(params.w_q, params.b_q if cfg.bias else None, x)
    expected = x @ params.w_q.T + (params.b_q if cfg.bias else 0.0)
    error = float(np.max(np.abs(y - expected)))
    status = "" if shape == params.w_q.shape and error < 1e-12 else "FAILED "
    return f"{status}real nn.Linear({cfg.d_model}, {cfg.q_width}).weight.shape = {shape}; max |linear(x) - (x @ W.T + b)| = {error:.1e}"


def _torch_mha_evidence(cfg: MHAConfig, params: MHAParams) -> str:
    """Load the state dict into a real nn.MultiheadAttention and read it back."""
    back, shapes = torch_mha_state_round_trip(cfg, params)  # strict: every name and shape
    same = all(
        (a is None and b is None) or np.array_equal(a, b)
        for a, b in zip(back.as_dict().values(), params.as_dict().values(), strict=True)
    )
    names = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
    status = "" if same else "FAILED "
    return f"{status}real nn.MultiheadAttention loaded it (strict) and gave every parameter back exactly: {names}"


def _flax_evidence(cfg: MHAConfig) -> str:
    """Shapes of the real Flax module's parameters, from its initialiser (nothing computed)."""
    kernels = flax_kernel_shapes(cfg.n_heads, cfg.q_width, cfg.d_model, out_features=cfg.d_model)
    query, out = kernels["query"], kernels["out"]
    expected_query = (cfg.d_model, cfg.n_heads, cfg.d_k)
    expected_out = (cfg.n_heads, cfg.d_v, cfg.d_model)
    status = "" if (query, out) == (expected_query, expected_out) else "FAILED "
    return (
        f"{status}real flax MultiHeadDotProductAttention(num_heads={cfg.n_heads}, qkv_features={cfg.q_width}) "
        f"initialises query.kernel {query}, out.kernel {out}"
    )


def _equinox_evidence(cfg: MHAConfig) -> str:
    sizes = {"key_size": cfg.kdim, "value_size": cfg.vdim, "qk_size": cfg.d_k, "vo_size": cfg.d_v}
    shape = equinox_query_weight_shape(cfg.n_heads, cfg.d_model, **sizes)
    status = "" if shape == (cfg.q_width, cfg.d_model) else "FAILED "
    return f"{status}real equinox MultiheadAttention(qk_size={cfg.d_k}) holds query_proj.weight {shape}"


def _library_evidence(make: Callable[[], str]) -> list[str]:
    """``make()``'s evidence from a real module, or why its library cannot build it here."""
    try:
        return [make()]
    except LibraryMissing as missing:
        return [f"{missing.reason}: real-module check skipped"]


def weight_layouts(cfg: MHAConfig, params: MHAParams, head: int | None = None, scorer: int = 0) -> list[WeightLayout]:
    """Every layout of the query weight (and the output weight's per-head forms), verified."""
    H, Dk, Dv, D = cfg.n_heads, cfg.d_k, cfg.d_v, cfg.d_model
    h = min(1, H - 1) if head is None else head  # head 1 when there is one: row h*Dk+j is not row j
    j = scorer
    if not 0 <= h < H or not 0 <= j < Dk:
        raise ValueError(f"head must be in [0, {H}) and scorer in [0, {Dk}); got head={h}, scorer={j}")
    w = params.w_q
    row = h * Dk + j  # canonical row of scorer j of head h
    target = w[row]
    x = np.random.default_rng(7).standard_normal((5, D))
    layouts = []
    query_layout = partial(_layout, canonical=w, scorer_canonical=target)  # every layout of w_q

    layouts.append(
        query_layout(
            "canonical w_q (MHAParams, (out, in))",
            "rows",
            "-",
            "-",
            f"row {row} (= h*Dk + j)",
            w,
            w,
            w,
            w[row],
        )
    )
    layouts.append(
        query_layout(
            "column-sample W_A (Y = W_A @ X)",
            "rows",
            "W_A = w_q",
            "w_q = W_A",
            f"row {row}",
            w,
            w,
            w,
            w[row],
        )
    )
    w_b = to_row_sample(w)
    layouts.append(
        query_layout(
            "row-sample W_B (Y = X @ W_B)",
            "columns",
            "W_B = w_q.T",
            "w_q = W_B.T",
            f"column {row}",
            w.T,
            w_b,
            from_row_sample(w_b),
            w_b[:, row],
        )
    )
    layouts.append(
        query_layout(
            "torch nn.Linear.weight (computes x @ W.T + b)",
            "rows (applied as columns of W.T)",
            "weight = w_q",
            "w_q = weight",
            f"row {row}",
            w,
            w,
            w,
            w[row],
            _library_evidence(lambda: _torch_linear_evidence(cfg, params, x)),
        )
    )
    reason = torch_mha_unsupported_reason(cfg)
    if reason is None:
        state = to_torch_mha_state_dict(cfg, params)
        packed = "in_proj_weight" in state
        name = "in_proj_weight" if packed else "q_proj_weight"
        block = state[name]
        formula = np.concatenate([params.w_q, params.w_k, params.w_v], axis=0) if packed else params.w_q  # (3E, E)
        back = from_torch_mha_state_dict(cfg, state).w_q
        layouts.append(
            query_layout(
                f"torch nn.MultiheadAttention.{name}" + (" (q;k;v blocks)" if packed else ""),
                "rows; q rows 0:E, k rows E:2E, v rows 2E:3E" if packed else "rows",
                "concatenate([w_q, w_k, w_v], axis=0)  # (3E, E)" if packed else "q_proj_weight = w_q",
                "w_q = in_proj_weight[:E]" if packed else "w_q = q_proj_weight",
                f"row {row} (q block)",
                formula,
                block,
                back,
                block[row],
                _library_evidence(lambda: _torch_mha_evidence(cfg, params)),
            )
        )
    else:
        layouts.append(
            WeightLayout(
                "torch nn.MultiheadAttention.in_proj_weight", (), "-", "-", "-", "-", None, f"not expressible: {reason}"
            )
        )
    per_head = split_head_matrices(w, H)
    layouts.append(
        query_layout(
            "per-head W_h, row samples (the article's W^Q_h: Q_h = X @ W_h)",
            "columns of each W_h",
            "w_q.reshape(H, Dk, D).transpose(0, 2, 1)  # (H, D, Dk)",
            "merge_head_matrices(W): [W_0 | W_1 | ...].T",
            f"W[{h}][:, {j}]",
            w.reshape(H, Dk, D).transpose(0, 2, 1),
            per_head,
            merge_head_matrices(per_head),
            per_head[h][:, j],
        )
    )
    side_by_side = np.concatenate(list(per_head), axis=1)  # (D, H*Dk): [W_0 | W_1 | ...]
    layouts.append(
        query_layout(
            "merged [W_0 | W_1 | ...] (row samples)",
            "columns; head h owns columns h*Dk:(h+1)*Dk",
            "concatenate(W_h, axis=1) = w_q.T",
            "w_q = merged.T",
            f"column {row}",
            w.T,
            side_by_side,
            from_row_sample(side_by_side),
            side_by_side[:, row],
        )
    )
    kernel = to_dense_general_kernel(w, H)
    layouts.append(
        query_layout(
            "Flax/Keras query kernel (in, heads, head_dim)",
            "the last axis, per head: kernel[:, h, :]",
            "w_q.T.reshape(D, H, Dk)",
            "kernel.reshape(D, H*Dk).T",
            f"kernel[:, {h}, {j}]",
            w.T.reshape(D, H, Dk),
            kernel,
            from_dense_general_kernel(kernel),
            kernel[:, h, j],
            _library_evidence(lambda: _flax_evidence(cfg)) if cfg.n_kv_heads == H and Dv == Dk else [],
        )
    )
    eqx_weights = to_equinox_weights(cfg, params)
    layouts.append(
        query_layout(
            "Equinox query_proj.weight (out, in)",
            "rows",
            "weight = w_q",
            "w_q = weight",
            f"row {row}",
            w,
            eqx_weights["query_proj"]["weight"],
            from_equinox_weights(cfg, eqx_weights).w_q,
            eqx_weights["query_proj"]["weight"][row],
            _library_evidence(lambda: _equinox_evidence(cfg)),
        )
    )

    # The output projection reads the heads: column h*Dv+j of w_o takes feature j of head h.
    w_o = params.w_o
    out_col = h * Dv + min(j, Dv - 1)
    blocks = split_output_matrix(w_o, H)
    layouts.append(
        _layout(
            "canonical w_o (out, H*Dv)",
            "rows (each reads all heads' features)",
            "-",
            "-",
            f"column {out_col} reads head {h}",
            w_o,
            w_o,
            w_o,
            w_o[:, out_col],
            canonical=w_o,
            scorer_canonical=w_o[:, out_col],
        )
    )
    layouts.append(
        _layout(
            "per-head output blocks / Flax-Keras out kernel (heads, head_dim, out)",
            "the last axis: out = sum_h C_h @ block[h]",
            "w_o.T.reshape(H, Dv, D)",
            "block.reshape(H*Dv, D).T",
            f"block[{h}][{min(j, Dv - 1)}, :]",
            w_o.T.reshape(H, Dv, D),
            blocks,
            merge_output_matrix(blocks),
            blocks[h][min(j, Dv - 1)],
            canonical=w_o,
            scorer_canonical=w_o[:, out_col],
        )
    )
    return layouts
