"""Third-party JAX attention fed the canonical parameters: jax.nn.dot_product_attention, Flax, Equinox.

Each oracle runs the library's own attention with the same parameters (through the
converters of `core.layouts`) and the same inputs as every implementation. Where the
library's convention differs from the spec, the oracle maps it and says so in
``known_differences``; nothing is mapped silently:

* Rows with no allowed key. All three libraries fill blocked logits with a large
  finite negative number instead of -inf, so such a row gets uniform weights and the
  mean of V over *all* keys. The spec wants zero weights (context 0, output b_o). The
  rows are known from the mask before the timed region, so the oracle replaces them
  (the dot-product oracle in the context, Flax and Equinox in the output, where a row
  must then be empty in every head). ``spec_empty_rows=False`` shows the raw answer.
* Matmul precision on a GPU: "highest" for float32 comparisons, the same as the
  implementations; ``matmul_precision="default"`` shows what TF32 does.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, linear, numpy_dtype, to_equinox_weights, to_flax_params
from mha_rosetta.core.layouts import EQUINOX_NAMES

from .._grad_layout import gradients_to_canonical
from .._layouts import ROW_SAMPLE_PROJECTION_AXES, TOKENS_FIRST_STAGE_AXES, XLA_LAYOUT, xla_provenance
from ..base import Backend, Prepared, StageTensor, UnsupportedCase
from ..jax.common import (
    CompiledForward,
    allowed_for_heads,
    check_matmul_precision,
    compiled_prepared,
    empty_query_rows,
    jax_devices,
    jax_inputs,
    jax_params,
    jax_rotary_tables,
    jax_target,
    precision_info,
    rotate_last_axis,
    to_jax,
)
from ..jax.vjp import canonical_param_grads, jax_vjp_prepared  # jax.vjp through the library's own attention


def _scale_is_default(cfg: MHAConfig) -> bool:
    return math.isclose(cfg.scale, 1.0 / math.sqrt(cfg.d_k), rel_tol=1e-12)


class _JaxOracle(Backend):
    """What the three oracles share: devices, float64, precision, the empty-row switch."""

    def __init__(
        self, name: str | None = None, matmul_precision: str = "highest", spec_empty_rows: bool = True
    ) -> None:
        super().__init__(name)
        self.matmul_precision = check_matmul_precision(matmul_precision)
        # True: rows with no allowed key follow the spec (zeros); False: the library's own answer.
        self.spec_empty_rows = bool(spec_empty_rows)

    def devices(self) -> tuple[str, ...]:
        return jax_devices()

    def _info(self, dtype: str, device: str, **extra) -> dict:
        info = precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision)
        info["known_differences"] = list(self.known_differences)
        info.update(extra)
        return info

    def _rows_empty_in_every_head(self, cfg: MHAConfig, inputs: MHAInputs) -> np.ndarray | None:
        """(B|1, Nq, 1) rows whose output the oracle replaces by b_o, or None.

        Flax and Equinox hide the per-head context, so only a row that is empty in every
        head can be mapped (its spec output is exactly b_o). A row empty in some heads
        only cannot, and is reported as unsupported instead of being compared wrongly.
        """
        empty = empty_query_rows(cfg, inputs)  # (B|1, H|1, Nq) or None
        if empty is None or not self.spec_empty_rows:
            return None
        in_every_head = empty.all(axis=1)  # (B|1, Nq)
        if (empty.any(axis=1) & ~in_every_head).any():
            raise UnsupportedCase(
                f"{self.name}: some query rows may attend to no key in some heads but not all; the library gives them "
                "the mean of V and hides the per-head context, so the spec's zero context cannot be mapped "
                "(construct with spec_empty_rows=False to see the raw answer)"
            )
        return in_every_head[..., None]  # (B|1, Nq, 1)

    # Flax and Equinox replace a row with no allowed key by b_o after the module: b_o's gradient
    # from such rows would be the adapter's, not the library's, so their backward refuses them.
    maps_output_rows = False

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        prepared = self._prepare(cfg, params, inputs, dtype, device, strategy)
        if self.maps_output_rows and prepared.info.get("empty_rows_mapped"):
            raise UnsupportedCase(
                f"{self.name}: query rows with no allowed key are mapped to the spec's output b_o after the library "
                "runs; the gradient of that mapping would be the adapter's, not the library's"
            )
        compiled = prepared.forward  # a CompiledForward: its function and its converted arguments
        target = jax_target(dtype, device)
        x_q, x_k, x_v = (to_jax(x, dtype, target) for x in (inputs.query, inputs.key, inputs.value))  # 3 slots
        primals, extras = (compiled.args[0], x_q, x_k, x_v), compiled.args[4:]
        to_canonical, info = partial(self._canonical_grads, cfg), self._info(dtype, device)
        return jax_vjp_prepared(
            compiled.fn, primals, extras, cotangent, dtype, target, self.matmul_precision, to_canonical, info
        )

    def _canonical_grads(self, cfg: MHAConfig, grads) -> dict:
        """The gradient of the library's parameter tree, by canonical name (subclasses with other trees override)."""
        return canonical_param_grads(grads)

    def _output_rows(self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, target) -> _OutputRows:
        """What the module oracles (Flax, Equinox) need to give an empty row the spec's output b_o."""
        empty = self._rows_empty_in_every_head(cfg, inputs)  # (B|1, Nq, 1) or None
        return _OutputRows(
            rows=to_jax(empty, None, target),
            b_o=to_jax(params.b_o if cfg.bias else np.zeros(cfg.d_model), dtype, target),
            count=0 if empty is None else int(np.broadcast_to(empty, (inputs.batch, inputs.q_tokens, 1)).sum()),
        )


class _OutputRows(NamedTuple):
    """Output rows a module oracle replaces by b_o: which (on the device), the b_o, and how many."""

    rows: object  # (B|1, Nq, 1) bool JAX array, or None when no row is replaced
    b_o: object  # (D,) JAX array, zeros without bias
    count: int  # (batch item, query) rows replaced, for Prepared.info["empty_rows_mapped"]


def _spec_rows(output, replacement, rows):
    """``output`` with the rows marked in ``rows`` replaced (the spec's answer for a row with no allowed key)."""
    import jax.numpy as jnp

    return output if rows is None else jnp.where(rows, replacement, output)


# --- jax.nn.dot_product_attention -------------------------------------------------------------


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


class JaxDotProductAttentionOracle(_JaxOracle):
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
        compiled = CompiledForward(lambda *a: stages_fn(*a)["output"], args, self.matmul_precision)

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


class FlaxMHAOracle(_JaxOracle):
    """``flax.linen.MultiHeadDotProductAttention`` with its params tree from `core.to_flax_params`."""

    name = "flax"
    convention = (
        "flax.linen.MultiHeadDotProductAttention: DenseGeneral kernels (in, heads, head_dim), (heads, head_dim, out)"
    )
    known_differences = (
        "mask polarity: True = may attend (same as the spec)",
        "qkv_features is the total width heads * head_dim (like torch's embed_dim), not Keras' per-head key_dim",
        "kernels keep the head axis: query/key/value (in, H, head_dim), out (H, head_dim, D); biases (H, head_dim)",
        "inputs_k/inputs_v of other widths (kdim, vdim) are accepted: the key/value kernels take their width",
        "scale fixed at 1/sqrt(head_dim), applied to the query before q @ k: a custom scale is unsupported",
        "one head_dim for q, k and v: d_v != d_k and grouped kv heads are unsupported",
        "rows with no allowed key: masked with finfo(dtype).min, so uniform weights and the mean of V; "
        "mapped to the spec's output b_o (rows empty in some heads only are unsupported)",
        "softmax in the computation dtype (float16 stays float16) unless force_fp32_for_softmax",
        "weights visible only through sow_weights=True and the 'intermediates' collection",
        "no rotary embedding: q and k are projected inside the module",
    )

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if cfg.rope is not None:
            return (
                f"Flax MultiHeadDotProductAttention has no rotary embedding (cfg.rope={cfg.rope!r}): "
                "it projects q and k inside the module"
            )
        if cfg.n_kv_heads != cfg.n_heads:
            return f"Flax MultiHeadDotProductAttention has no grouped kv heads (n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads})"
        if cfg.d_v != cfg.d_k:
            return f"Flax MultiHeadDotProductAttention uses one head_dim for q, k and v (d_k={cfg.d_k}, d_v={cfg.d_v})"
        if not _scale_is_default(cfg):
            return f"Flax MultiHeadDotProductAttention always scales by 1/sqrt(head_dim); cfg.scale={cfg.scale:g}"
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        import flax.linen as nn
        import jax
        import jax.numpy as jnp

        target = jax_target(dtype, device)
        spec = self._output_rows(cfg, params, inputs, dtype, target)
        # Kernels (in, H, head_dim), out kernel (H, head_dim, D), each a JAX array on the target.
        tree = jax.tree_util.tree_map(lambda array: to_jax(array, dtype, target), to_flax_params(cfg, params))
        compute_dtype = jnp.dtype(numpy_dtype(dtype))
        module = nn.MultiHeadDotProductAttention(
            num_heads=cfg.n_heads,
            qkv_features=cfg.q_width,
            out_features=cfg.d_model,
            use_bias=cfg.bias,
            dtype=compute_dtype,
            param_dtype=compute_dtype,
            deterministic=True,
        )
        x_q, x_k, x_v = jax_inputs(inputs, dtype, target)
        mask = to_jax(allowed_for_heads(cfg, inputs), None, target)  # (B|1, H|1, Nq, Nk), True = attend

        def forward(tree, x_q, x_k, x_v, mask, rows, b_o):
            output = module.apply({"params": tree}, x_q, x_k, x_v, mask=mask)  # (B, Nq, D)
            return _spec_rows(output, b_o, rows)  # spec: a row with no allowed key outputs b_o

        def stages(tree, x_q, x_k, x_v, mask, rows, b_o):
            output, state = module.apply(
                {"params": tree}, x_q, x_k, x_v, mask=mask, sow_weights=True, mutable=["intermediates"]
            )
            (weights,) = state["intermediates"]["attention_weights"]  # (B, H, Nq, Nk)
            rows_4d = None if rows is None else rows[:, None]  # (B|1, 1, Nq, 1)
            return {"weights": _spec_rows(weights, 0, rows_4d), "output": _spec_rows(output, b_o, rows)}

        args = (tree, x_q, x_k, x_v, mask, spec.rows, spec.b_o)
        compiled = CompiledForward(forward, args, self.matmul_precision)
        mapped = (
            "; rows with no allowed key mapped to the spec (library: uniform weights)" if spec.rows is not None else ""
        )

        def native_stages() -> dict[str, StageTensor]:
            result = compiled.trace_and_run(stages)
            return {
                "weights": StageTensor(result["weights"], ("B", "H", "Nq", "Nk"), f"sown 'attention_weights'{mapped}"),
                "output": StageTensor(result["output"], ("B", "Nq", "D"), f"module output{mapped}"),
            }

        return compiled_prepared(compiled, native_stages, self._info(dtype, device, empty_rows_mapped=spec.count))

    maps_output_rows = True
    # Declared above: float16 logits are soft-maxed in float16, less accurate than the spec's float32 path.
    half_precision_softmax = True

    def _canonical_grads(self, cfg: MHAConfig, grads) -> dict:
        return gradients_to_canonical(cfg, partial(to_flax_params, cfg), grads)  # kernels (in, H, d) -> (out, in)


# --- equinox.nn.MultiheadAttention ----------------------------------------------------------


class EquinoxMHAOracle(_JaxOracle):
    """``equinox.nn.MultiheadAttention`` (unbatched), weights set with ``eqx.tree_at``, vmapped over batch."""

    name = "equinox"
    convention = "equinox.nn.MultiheadAttention: unbatched module, Linear weights (out, in), jax.vmap over batch"
    known_differences = (
        "mask polarity: True = may attend (same as the spec)",
        "unbatched-only API: the module takes (tokens, features); the batch is a jax.vmap",
        "weights (out, in) like torch's nn.Linear, applied per token as W @ x + b (column sample)",
        "qk_size and vo_size are per-head widths, independent of query_size: d_v != d_k and kdim/vdim supported",
        "scale fixed at 1/sqrt(qk_size), applied to the query: a custom scale is unsupported",
        "no grouped kv heads: GQA unsupported",
        "rows with no allowed key: masked with finfo(dtype).min, so uniform weights and the mean of V; "
        "mapped to the spec's output b_o (rows empty in some heads only are unsupported)",
        "softmax in at least float32 (half-precision logits are upcast)",
        "no attention weights returned: only the output and the projections are visible",
        "rotary: the library's own eqx.nn.RotaryPositionalEmbedding, applied through the module's process_heads "
        "hook; it rotates halves (rope='half') at positions 0..N-1 only, so 'interleaved' and custom positions "
        "are unsupported (partial rotary: the module turns the first rope_dims features, the hook passes the rest)",
    )

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if cfg.rope == "interleaved":
            return (
                "equinox.nn.RotaryPositionalEmbedding rotates halves (rotate_half) only, not interleaved pairs; "
                "core.to_rotate_half_params converts such weights"
            )
        if cfg.n_kv_heads != cfg.n_heads:
            return f"equinox MultiheadAttention has no grouped kv heads (n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads})"
        if not _scale_is_default(cfg):
            return f"equinox MultiheadAttention always scales by 1/sqrt(qk_size); cfg.scale={cfg.scale:g}"
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        target = jax_target(dtype, device)
        spec = self._output_rows(cfg, params, inputs, dtype, target)
        model = loaded_equinox_mha(cfg, params, dtype, target)
        dynamic, static = eqx.partition(model, eqx.is_array)

        x_q, x_k, x_v = jax_inputs(inputs, dtype, target)
        mask, batch_axis = _equinox_mask(cfg, inputs)
        mask = to_jax(mask, None, target)
        process_heads = _equinox_rotary(cfg, inputs, jnp.dtype(numpy_dtype(dtype)))

        def forward(dynamic, x_q, x_k, x_v, mask, rows, b_o):
            module = eqx.combine(dynamic, static)
            one_item = lambda q, k, v, m: module(q, k, v, mask=m, process_heads=process_heads)  # noqa: E731
            output = jax.vmap(one_item, in_axes=(0, 0, 0, batch_axis))(x_q, x_k, x_v, mask)  # (B, Nq, D)
            return _spec_rows(output, b_o, rows)  # spec: no allowed key -> b_o

        def stages(dynamic, x_q, x_k, x_v, mask, rows, b_o):
            module = eqx.combine(dynamic, static)
            # The module's own Linear layers, vmapped over batch and tokens as it does inside.
            per_token = lambda layer, x: jax.vmap(jax.vmap(layer))(x)  # noqa: E731
            return {
                "q": per_token(module.query_proj, x_q),  # (B, Nq, H*Dk)
                "k": per_token(module.key_proj, x_k),  # (B, Nk, H*Dk)
                "v": per_token(module.value_proj, x_v),  # (B, Nk, H*Dv)
                "output": forward(dynamic, x_q, x_k, x_v, mask, rows, b_o),
            }

        args = (dynamic, x_q, x_k, x_v, mask, spec.rows, spec.b_o)
        compiled = CompiledForward(forward, args, self.matmul_precision)
        linear_note = "equinox Linear: W (out, in) @ x + b per token, vmapped over tokens and batch"
        mapped = "; rows with no allowed key mapped to b_o (library: mean of V)" if spec.rows is not None else ""

        def native_stages() -> dict[str, StageTensor]:
            result = compiled.trace_and_run(stages)
            return {
                **{
                    name: StageTensor(result[name], axes, linear_note)
                    for name, axes in ROW_SAMPLE_PROJECTION_AXES.items()
                },
                "output": StageTensor(result["output"], ("B", "Nq", "D"), f"module output, vmapped over batch{mapped}"),
            }

        return compiled_prepared(compiled, native_stages, self._info(dtype, device, empty_rows_mapped=spec.count))

    maps_output_rows = True

    def _canonical_grads(self, cfg: MHAConfig, grads) -> dict:
        parts = ("weight", "bias")
        tree = {
            layer: {part: getattr(getattr(grads, layer), part) for part in parts} for layer in EQUINOX_NAMES.values()
        }
        return gradients_to_canonical(cfg, partial(to_equinox_weights, cfg), tree)


def loaded_equinox_mha(cfg: MHAConfig, params: MHAParams, dtype: str, target):
    """``equinox.nn.MultiheadAttention`` for ``cfg`` holding ``params`` (the oracle's and the explainer's)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    # filter_eval_shape builds the module from shapes alone: its random initial weights
    # would be thrown away below, and computing them costs seconds of eager compiles.
    model = eqx.filter_eval_shape(
        eqx.nn.MultiheadAttention,
        num_heads=cfg.n_heads,
        query_size=cfg.d_model,
        key_size=cfg.kdim,
        value_size=cfg.vdim,
        output_size=cfg.d_model,
        qk_size=cfg.d_k,
        vo_size=cfg.d_v,
        use_query_bias=cfg.bias,
        use_key_bias=cfg.bias,
        use_value_bias=cfg.bias,
        use_output_bias=cfg.bias,
        dtype=jnp.dtype(numpy_dtype(dtype)),
        key=jax.random.PRNGKey(0),
    )
    # The canonical (out, in) weights into the module's four Linear layers with eqx.tree_at.
    weights, layers = to_equinox_weights(cfg, params), EQUINOX_NAMES.values()
    parts = ("weight", "bias") if weights["query_proj"]["bias"] is not None else ("weight",)

    def leaves(module):
        return [getattr(getattr(module, layer), part) for part in parts for layer in layers]

    values = [to_jax(weights[layer][part], dtype, target) for part in parts for layer in layers]
    loaded = eqx.tree_at(leaves, model, values)  # a new module; tree_at never mutates
    for leaf in jax.tree_util.tree_leaves(loaded):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise RuntimeError(f"equinox MultiheadAttention has a parameter the converter does not fill: {leaf}")
    return loaded


def _equinox_rotary(cfg: MHAConfig, inputs: MHAInputs, dtype):
    """The ``process_heads`` hook that applies equinox's own RotaryPositionalEmbedding, or None without rope."""
    if cfg.rope is None:
        return None
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    for name, positions in (("positions", inputs.positions), ("kv_positions", inputs.kv_positions)):
        if not np.array_equal(positions, np.arange(positions.shape[-1])[None]):
            raise UnsupportedCase(
                f"equinox.nn.RotaryPositionalEmbedding always uses positions 0..N-1; {name} differ from that"
            )
    rope = eqx.nn.RotaryPositionalEmbedding(embedding_size=cfg.rope_dims, theta=cfg.rope_base, dtype=dtype)
    r = cfg.rope_dims

    def rotate(heads):  # (N, heads, d): the module is unbatched (N, r), so vmap it over the heads
        turned = jax.vmap(rope, in_axes=1, out_axes=1)(heads[..., :r])  # (N, heads, r)
        return turned if r == heads.shape[-1] else jnp.concatenate([turned, heads[..., r:]], axis=-1)

    def process_heads(q_heads, k_heads, v_heads):
        return rotate(q_heads), rotate(k_heads), v_heads

    return process_heads


def _equinox_mask(cfg: MHAConfig, inputs: MHAInputs):
    """The combined mask as equinox takes it per item ((Nq, Nk) or (H, Nq, Nk)), and its batch in_axes."""
    allowed = allowed_for_heads(cfg, inputs)  # (B|1, H|1, Nq, Nk) or None
    if allowed is None:
        return None, None
    if allowed.shape[1] == 1:
        allowed = allowed[:, 0]  # (B|1, Nq, Nk): one mask for every head
    if allowed.shape[0] == 1:
        return allowed[0], None  # the same mask for every batch item
    return allowed, 0
