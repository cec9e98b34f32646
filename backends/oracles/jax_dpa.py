"""The jax-dpa oracle: ``jax.nn.dot_product_attention`` fed the canonical parameters (see `jax_common`)."""

from __future__ import annotations

from functools import partial

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, linear

from .._layouts import TOKENS_FIRST_STAGE_AXES, XLA_LAYOUT, xla_provenance
from ..base import Prepared, StageTensor
from ..jax.common import (
    CompiledForward,
    allowed_for_heads,
    compiled_prepared,
    empty_query_rows,
    jax_inputs,
    jax_params,
    jax_rotary_tables,
    jax_target,
    rotate_last_axis,
    to_jax,
)
from .jax_common import JaxOracle


def _dpa_stages(params, x_q, x_k, x_v, mask, empty_context_rows, tables, *, cfg: MHAConfig, is_causal: bool):
    """Projections in jnp, attention by jax.nn.dot_product_attention in its (B, T, N, H) layout.

    ``tables``: None or the rotary (q_cos, q_sin, k_cos, k_sin), (1|B, N, r/2) each,
    applied to the heads before the library call, as models around it do.
    """
    import jax
    import jax.numpy as jnp

    batch, n_q, n_k = x_q.shape[0], x_q.shape[1], x_k.shape[1]
    q = linear(x_q, params["w_q"], params["b_q"])  # (B, Nq, H*Dk)
    k = linear(x_k, params["w_k"], params["b_k"])  # (B, Nk, Hkv*Dk)
    v = linear(x_v, params["w_v"], params["b_v"])  # (B, Nk, Hkv*Dv)
    q_heads = q.reshape(batch, n_q, cfg.n_heads, cfg.d_k)  # (B, Nq, H, Dk): "BTNH"
    k_heads = k.reshape(batch, n_k, cfg.n_kv_heads, cfg.d_k)  # (B, Nk, Hkv, Dk): fewer heads = GQA
    v_heads = v.reshape(batch, n_k, cfg.n_kv_heads, cfg.d_v)  # (B, Nk, Hkv, Dv)
    q_rotated, k_rotated = q_heads, k_heads
    if tables is not None:
        q_cos, q_sin, k_cos, k_sin = (table[:, :, None] for table in tables)  # (1|B, N, 1, r/2): every head
        q_rotated = rotate_last_axis(q_heads, q_cos, q_sin, cfg.rope)  # (B, Nq, H, Dk)
        k_rotated = rotate_last_axis(k_heads, k_cos, k_sin, cfg.rope)  # (B, Nk, Hkv, Dk)
    context = jax.nn.dot_product_attention(
        q_rotated, k_rotated, v_heads, mask=mask, scale=cfg.scale, is_causal=is_causal
    )  # (B, Nq, H, Dv)
    if empty_context_rows is not None:
        context = jnp.where(empty_context_rows, 0, context)  # spec: no allowed key -> zero context
    merged = context.reshape(batch, n_q, cfg.context_width)  # (B, Nq, H*Dv)
    output = linear(merged, params["w_o"], params["b_o"])  # (B, Nq, D)
    stages = dict(q=q, k=k, v=v, q_heads=q_heads, k_heads=k_heads, v_heads=v_heads, q_rotated=q_rotated)
    return {**stages, "k_rotated": k_rotated, "context": context, "merged": merged, "output": output}


# BTNH is the tokens-first layout; the scores and weights stay inside dot_product_attention.
_DPA_AXES = {
    name: axes for name, axes in TOKENS_FIRST_STAGE_AXES.items() if name not in ("scores", "masked_scores", "weights")
}


class JaxDotProductAttentionOracle(JaxOracle):
    """``jax.nn.dot_product_attention`` between projections written in jnp."""

    name = "jax-dpa"
    convention = "x @ W.T + b in jnp, then jax.nn.dot_product_attention on (B, T, N, H) arrays"
    known_differences = (
        "mask polarity: True = may attend (same as the spec)",
        "layout BTNH: query/key/value are (batch, tokens, heads, head_dim), heads after tokens",
        "rows with no allowed key: masked with -0.7 * float32 max (finite), so the row gets uniform weights "
        "and the mean of V over all keys; mapped to the spec's zero context",
        "softmax always in float32: float16/bfloat16 logits are accumulated in float32 (more accurate than "
        "a half-precision softmax); float64 logits are rounded to float32, so float64 is unsupported",
        "float16 on CPU fails to compile under jax.jit (dot algorithm F16_F16_F32 is not supported by XLA:CPU); "
        "outside jit it runs (the library then falls back to the default precision), but this adapter is jitted, "
        "so float16 on CPU is reported unsupported",
        "GQA native: key/value may have fewer heads than query (query head h reads kv head h // G)",
        "value must have the shape of key: d_v != d_k is unsupported",
        "is_causal=True is top-left aligned (query i sees keys 0..i), as the spec",
        "no attention weights returned: only the output (and the projections around it) are visible",
        "no rotary embedding of its own: the heads are rotated before the call (our rotate_last_axis), as models do",
    )

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if cfg.d_v != cfg.d_k:
            return (
                f"jax.nn.dot_product_attention needs value heads as wide as key heads (d_v={cfg.d_v} != d_k={cfg.d_k})"
            )
        if dtype == "float64":
            return (
                "jax.nn.dot_product_attention computes its softmax in float32 even for float64 inputs, "
                "so it cannot meet the float64 tolerance"
            )
        if dtype == "float16" and device == "cpu":
            return (
                "jax.nn.dot_product_attention under jax.jit asks XLA:CPU for the dot algorithm F16_F16_F32, "
                "which it rejects at compile time (its fallback only catches errors raised while tracing)"
            )
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        target = jax_target(dtype, device)
        weights = jax_params(params, dtype, target)
        x_q, x_k, x_v = jax_inputs(inputs, dtype, target)
        # The library's is_causal when causality is the only mask, the combined mask otherwise.
        is_causal = cfg.causal and inputs.mask is None
        mask = None if is_causal else allowed_for_heads(cfg, inputs)  # (B|1, H|1, Nq, Nk), True = attend
        empty = empty_query_rows(cfg, inputs)  # (B|1, H|1, Nq) or None
        empty_context_rows = None
        if empty is not None and self.spec_empty_rows:
            empty_context_rows = empty.transpose(0, 2, 1)[..., None]  # (B|1, Nq, H|1, 1): BTNH like the context
        tables = jax_rotary_tables(cfg, inputs, dtype, target)
        mask, empty_context_rows = to_jax(mask, None, target), to_jax(empty_context_rows, None, target)
        args = (weights, x_q, x_k, x_v, mask, empty_context_rows, tables)
        stages_fn = partial(_dpa_stages, cfg=cfg, is_causal=is_causal)
        key = ("jax-dpa", cfg, is_causal)  # what stages_fn captures
        compiled = CompiledForward(lambda *a: stages_fn(*a)["output"], args, self.matmul_precision, key)

        def native_stages() -> dict[str, StageTensor]:
            stages = compiled.trace_and_run(stages_fn)
            note = {
                "q_heads": f"reshape to BTNH, the layout dot_product_attention takes; {XLA_LAYOUT}",
                "context": "dot_product_attention's output, BTNH"
                + ("; rows with no allowed key zeroed (library: mean of V)" if empty_context_rows is not None else ""),
            }
            return {
                name: StageTensor(stages[name], axes, note.get(name, XLA_LAYOUT), *xla_provenance(name, cfg.rope))
                for name, axes in _DPA_AXES.items()
            }

        # Counted as (batch item, head, query) rows whose context was zeroed.
        full = (inputs.batch, cfg.n_heads, inputs.q_tokens)
        mapped = 0 if empty_context_rows is None else int(np.broadcast_to(empty, full).sum())
        info = self._info(dtype, device, is_causal=is_causal, empty_rows_mapped=mapped)
        return compiled_prepared(compiled, native_stages, info)


# --- flax.linen.MultiHeadDotProductAttention ------------------------------------------------
