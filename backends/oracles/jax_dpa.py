"""The jax-dpa oracle: ``jax.nn.dot_product_attention`` fed the canonical parameters (see `jax_common`).

The variants, each in the library's own spelling where it has one:

* the window: ``local_window_size=(W-1, 0)`` with ``is_causal=True``, ``(W-1, W-1)`` without
  (two-sided), when the positions are the indices (the library counts its window on the
  token indices); with other positions the window goes into the boolean ``mask``. Three
  spellings of one window of W keys that include the query's own::

      Hugging Face (Mistral, Gemma, gpt-oss)    sliding_window=W         p_i - W < p_j <= p_i
      FlashAttention                            window_size=(W-1, 0)     W-1 keys left, 0 right
      jax.nn.dot_product_attention              local_window_size=(W-1, 0), is_causal=True

* ALiBi and T5's relative bias: the library's additive ``bias`` (B|1, N, T, S), ALiBi's from
  `core.variants.alibi_bias` (constants), T5's gathered from ``params.rel_bias`` by bucket
  inside the traced pass (so its gradient flows);
* the sinks: the library has none, but it returns its logsumexp (``return_residual=True``),
  and a sink only adds ``exp(sink)`` to each denominator, so the context is the library's
  times ``sigmoid(lse - sink)`` (the way FlashAttention-based gpt-oss kernels fold it in).
  Forward only: the library's custom VJP drops the residual's cotangent;
* QK-norm and ``bias="qkv"``: in the oracle's own jnp projections (the library takes heads);
* rope_scaling: the rotary tables of `core.rotary` (scaled frequencies), applied before the call;
* the softcap: unsupported, the library never exposes the logits between the product and
  the softmax (``bias`` is added, a tanh cannot be).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, causal_on_indices, linear
from mha_rosetta.core.variants import BUILTIN_VARIANTS, kernel_refusal, kernel_refusals

from .._layouts import XLA_LAYOUT
from ..base import Prepared, StageTensor, UnsupportedCase
from ..jax.common import (
    CompiledForward,
    allowed_for_heads,
    compiled_prepared,
    empty_query_rows,
    jax_inputs,
    jax_params,
    jax_rotary_tables,
    jax_target,
    normed_heads,
    rotate_last_axis,
    to_jax,
    tokens_first_axes,
    variant_provenance,
)
from .jax_common import JaxOracle, bias_tables, gathered_bias

# The window spelled three ways (the module docstring), and this library's in words.
KERNEL = "jax.nn.dot_product_attention"  # as its refusals name it
WINDOW_SPELLINGS = (
    "window of W keys including the query's own: Hugging Face sliding_window=W (p_i - W < p_j <= p_i), "
    "FlashAttention window_size=(W-1, 0), jax.nn.dot_product_attention local_window_size=(W-1, 0) with "
    "is_causal=True; without causal the two-sided |p_i - p_j| < W is local_window_size=(W-1, W-1)"
)


def _dpa_stages(
    params, x_q, x_k, x_v, mask, empty_context_rows, tables, bias_tables, *, cfg: MHAConfig, is_causal: bool, window
):
    """Projections in jnp, attention by jax.nn.dot_product_attention in its (B, T, N, H) layout.

    ``tables``: None or the rotary (q_cos, q_sin, k_cos, k_sin), (1|B, N, r/2) each,
    applied to the heads before the library call, as models around it do. ``bias_tables``:
    ALiBi's bias (1|B, H, Nq, Nk) and T5's buckets (1|B, Nq, Nk), where on. ``window``: the
    library's ``local_window_size``, or None (no window, or one in ``mask``).
    """
    import jax
    import jax.numpy as jnp

    batch, n_q, n_k = x_q.shape[0], x_q.shape[1], x_k.shape[1]
    q = linear(x_q, params["w_q"], params["b_q"])  # (B, Nq, H*Dk)
    k = linear(x_k, params["w_k"], params["b_k"])  # (B, Nk, Hkv*Dk)
    v = linear(x_v, params["w_v"], params["b_v"])  # (B, Nk, Hkv*Dv); bias="qkv": b_o None below
    q_heads = q.reshape(batch, n_q, cfg.n_heads, cfg.d_k)  # (B, Nq, H, Dk): "BTNH"
    k_heads = k.reshape(batch, n_k, cfg.n_kv_heads, cfg.d_k)  # (B, Nk, Hkv, Dk): fewer heads = GQA
    v_heads = v.reshape(batch, n_k, cfg.n_kv_heads, cfg.d_v)  # (B, Nk, Hkv, Dv)
    normed = normed_heads(cfg, params, q, k, q_heads, k_heads)  # QK-norm's (the jax adapter's), or {}
    q_normed, k_normed = normed.get("q_normed", q_heads), normed.get("k_normed", k_heads)  # (B, N, heads, Dk)
    q_rotated, k_rotated = q_normed, k_normed
    if tables is not None:
        q_cos, q_sin, k_cos, k_sin = (table[:, :, None] for table in tables)  # (1|B, N, 1, r/2): every head
        q_rotated = rotate_last_axis(q_normed, q_cos, q_sin, cfg.rope)  # (B, Nq, H, Dk)
        k_rotated = rotate_last_axis(k_normed, k_cos, k_sin, cfg.rope)  # (B, Nk, Hkv, Dk)
    bias = gathered_bias(cfg, params.get("rel_bias"), bias_tables)  # (1|B, H, Nq, Nk): "BNTS", or None
    if bias is not None:
        bias = bias.astype(q_rotated.dtype)  # the library adds it to its logits in the inputs' dtype
    attend = partial(jax.nn.dot_product_attention, scale=cfg.scale, is_causal=is_causal, local_window_size=window)
    if cfg.sinks:
        context, lse = attend(q_rotated, k_rotated, v_heads, bias=bias, mask=mask, return_residual=True)
        # lse (B, Nq, H) = log sum_j exp(s_j): the sink's share leaves sum/(sum + exp(sink)) = sigmoid(lse - sink).
        keep = jax.nn.sigmoid(lse.astype(jnp.float32) - params["sinks"].astype(jnp.float32))  # (B, Nq, H)
        context = (context * keep[..., None]).astype(context.dtype)  # (B, Nq, H, Dv)
    else:
        context = attend(q_rotated, k_rotated, v_heads, bias=bias, mask=mask)  # (B, Nq, H, Dv)
    if empty_context_rows is not None:
        context = jnp.where(empty_context_rows, 0, context)  # spec: no allowed key -> zero context
    merged = context.reshape(batch, n_q, cfg.context_width)  # (B, Nq, H*Dv)
    output = linear(merged, params["w_o"], params["b_o"])  # (B, Nq, D)
    stages = dict(q=q, k=k, v=v, q_heads=q_heads, k_heads=k_heads, v_heads=v_heads, **normed)
    stages.update(q_rotated=q_rotated, k_rotated=k_rotated)
    return {**stages, "context": context, "merged": merged, "output": output}


def _window_by_index(cfg: MHAConfig, inputs: MHAInputs) -> tuple[int, int] | None:
    """The library's ``local_window_size`` for ``cfg.window`` when the positions are the indices, else None."""
    if cfg.window is None:
        return None
    for positions in (inputs.positions, inputs.kv_positions):
        if not np.array_equal(positions, np.arange(positions.shape[-1])[None]):
            return None  # the library counts its window on the indices: the spec's is on the positions
    return (cfg.window - 1, 0) if cfg.causal else (cfg.window - 1, cfg.window - 1)


# BTNH is the tokens-first layout; the score-like stages and the weights stay inside dot_product_attention.
_DPA_HIDDEN = ("scores", "capped_scores", "biased_scores", "masked_scores", "weights")


class JaxDotProductAttentionOracle(JaxOracle):
    """``jax.nn.dot_product_attention`` between projections written in jnp."""

    name = "jax-dpa"
    convention = "x @ W.T + b in jnp, then jax.nn.dot_product_attention on (B, T, N, H) arrays"
    gap_causes: ClassVar[dict[str, str]] = {
        "forward": "XLA:CPU fuses jax.nn.dot_product_attention's scores and softmax but not its weighted sum: the "
        "(B, H, N, N) weights (32 MiB at the reference size) are written out, copied once more into another layout "
        "and read by a separate product whose context comes out (B, H, Dv, N) and is copied back, where jax-best's "
        "program scores, normalises and weights in one fusion (read in both compiled programs' HLO, jax 0.10.2; "
        "not timed apart)",
    }
    # The package's own variants but those a kernel takes only through a hook (the registry's `kernel_refusals`), the
    # sinks back in through the logsumexp it returns (a library's idiom); one registered from outside is not in the
    # function, so it is refused.
    variants = BUILTIN_VARIANTS - kernel_refusals(KERNEL, frozenset({"sinks"})).keys()
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
        WINDOW_SPELLINGS,
        "local_window_size counts on the token indices; with other positions the window is passed in the mask",
        # The registry's reason for each variant it has no hook for (its `kernel_refusals`, as `variant_reason` gives).
        *(f"{why} (refused)" for why in kernel_refusals(KERNEL, variants).values()),
        "no sinks of its own: the context is rescaled by sigmoid(lse - sink) from its logsumexp (return_residual)",
        "ALiBi and the relative bias through bias=, in the inputs' dtype; QK-norm in the oracle's jnp projections",
    )
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    decode_unsupported = (
        "jax.nn.dot_product_attention is a function of whole q, k and v arrays: JAX's library has no KV cache "
        "object to step (the jax adapter's static cache is this project's, not the library's)"
    )
    # The library's custom VJP drops the cotangent of its logsumexp residual (measured: the
    # gradient of lse.sum() comes back all zeros), so the sinks' rescaling has no backward.
    vjp_variants = variants - {"sinks"}

    def variant_reason(self, cfg: MHAConfig, strategy: str, backward: bool = False) -> str | None:
        if why := kernel_refusal(cfg, KERNEL, self.variants):  # the registry's reason for each it has no hook for
            return why
        if backward and cfg.sinks:
            return (
                "jax.nn.dot_product_attention's backward ignores the cotangent of its logsumexp (return_residual), "
                "so the sinks, folded in through it, have no gradient there"
            )
        return super().variant_reason(cfg, strategy, backward)

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
        if (
            dtype == "bfloat16"
            and device == "cpu"
            and inputs.batch * cfg.n_heads * inputs.q_tokens * inputs.kv_tokens == 1
        ):
            # Measured 2026-12-05 (jax 0.10.2): a score tensor of one element (B = H = Nq = Nk = 1) compiles its dot
            # in XLA:CPU's elemental emitter, which rejects ALG_DOT_BF16_BF16_F32; any larger one runs.
            raise UnsupportedCase(
                "jax.nn.dot_product_attention in bfloat16 with a single score (batch, heads, query and key tokens "
                "all 1): XLA:CPU's elemental emitter rejects the dot algorithm BF16_BF16_F32 at compile time"
            )
        target = jax_target(dtype, device)
        weights = jax_params(params, dtype, target)
        x_q, x_k, x_v = jax_inputs(inputs, dtype, target)
        # The library's is_causal (and local_window_size) when causality (and the window by index) is the only
        # mask, the combined mask otherwise.
        window = _window_by_index(cfg, inputs)
        mask_cfg = cfg if window is None else dataclasses.replace(cfg, window=None)  # the library's window instead
        # A window on other positions is in the mask, and so then is causality.
        # is_causal is top-left on indices: a decode step's bottom-right causality goes in the mask instead.
        is_causal = cfg.causal and inputs.mask is None and (cfg.window is None or window is not None)
        is_causal = is_causal and cfg.attention_chunk_size is None  # Llama 4's chunks are in the mask
        is_causal = is_causal and causal_on_indices(inputs)
        mask = None if is_causal else allowed_for_heads(mask_cfg, inputs)  # (B|1, H|1, Nq, Nk), True = attend
        empty = empty_query_rows(cfg, inputs)  # (B|1, H|1, Nq) or None
        empty_context_rows = None
        if empty is not None and self.spec_empty_rows:
            empty_context_rows = empty.transpose(0, 2, 1)[..., None]  # (B|1, Nq, H|1, 1): BTNH like the context
        tables = jax_rotary_tables(cfg, inputs, dtype, target)
        mask, empty_context_rows = to_jax(mask, None, target), to_jax(empty_context_rows, None, target)
        score_tables = {name: to_jax(table, None, target) for name, table in bias_tables(cfg, inputs).items()}
        args = (weights, x_q, x_k, x_v, mask, empty_context_rows, tables, score_tables)
        stages_fn = partial(_dpa_stages, cfg=cfg, is_causal=is_causal, window=window)
        key = ("jax-dpa", cfg, is_causal, window)  # what stages_fn captures
        compiled = CompiledForward(lambda *a: stages_fn(*a)["output"], args, self.matmul_precision, key)

        def native_stages() -> dict[str, StageTensor]:
            stages = compiled.trace_and_run(stages_fn)
            note = {
                "q_heads": f"reshape to BTNH, the layout dot_product_attention takes; {XLA_LAYOUT}",
                "context": "dot_product_attention's output, BTNH"
                + ("; rows with no allowed key zeroed (library: mean of V)" if empty_context_rows is not None else ""),
            }
            return {
                name: StageTensor(stages[name], axes, note.get(name, XLA_LAYOUT), *variant_provenance(name, cfg))
                for name, axes in tokens_first_axes(cfg, _DPA_HIDDEN).items()
            }

        # Counted as (batch item, head, query) rows whose context was zeroed.
        full = (inputs.batch, cfg.n_heads, inputs.q_tokens)
        mapped = 0 if empty_context_rows is None else int(np.broadcast_to(empty, full).sum())
        info = self._info(dtype, device, is_causal=is_causal, empty_rows_mapped=mapped)
        if cfg.window is not None:
            info["window"] = f"local_window_size={window}" if window is not None else "in the mask (on the positions)"
        return compiled_prepared(compiled, native_stages, info)


# --- flax.linen.MultiHeadDotProductAttention ------------------------------------------------
