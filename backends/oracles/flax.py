"""The flax oracle: ``flax.linen.MultiHeadDotProductAttention`` fed the canonical parameters (see `jax_common`).

The variants it can express: the window (in the boolean mask, `core.inputs.allowed_positions`),
and ALiBi and T5's relative bias through the module's ``attention_fn`` hook, which here is
Flax's own ``flax.linen.dot_product_attention`` with its additive ``bias`` argument (ALiBi's
bias from `core.variants.alibi_bias`, constants; T5's gathered from ``rel_bias`` by bucket in
the traced pass, the table kept next to the module's tree so that its gradient comes back).
The rest is unsupported, each with its reason (`unsupported_reason`).
"""

from __future__ import annotations

from functools import partial

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, numpy_dtype, to_flax_params

from .._grad_layout import gradients_to_canonical
from ..base import Prepared, StageTensor
from ..jax.common import (
    CompiledForward,
    allowed_for_heads,
    compiled_prepared,
    jax_inputs,
    jax_target,
    to_jax,
)
from .jax_common import JaxOracle, bias_tables, gathered_bias, scale_is_default, spec_rows


class FlaxMHAOracle(JaxOracle):
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
        "window: in the boolean mask; ALiBi and the relative bias: attention_fn=flax.linen.dot_product_attention "
        "with its bias argument",
    )
    variants = frozenset({"window", "alibi", "rel_bias"})
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if cfg.softcap is not None:
            return (
                "Flax's dot_product_attention has no softcap: its logits go straight from the product to the "
                "softmax (an attention_fn that capped them would be this project's attention, not Flax's)"
            )
        if cfg.sinks:
            return "Flax's dot_product_attention has no sinks: its softmax has no extra term in the denominator"
        if cfg.qk_norm is not None:
            return (
                "Flax's normalize_qk is a LayerNorm of each head (mean subtracted, no weight of the projection), "
                f"not RMSNorm; cfg.qk_norm={cfg.qk_norm!r}"
            )
        if cfg.bias == "qkv":
            return "Flax MultiHeadDotProductAttention has one use_bias for q, k, v and the output (bias='qkv')"
        if cfg.rope is not None:
            return (
                f"Flax MultiHeadDotProductAttention has no rotary embedding (cfg.rope={cfg.rope!r}): "
                "it projects q and k inside the module"
            )
        if cfg.n_kv_heads != cfg.n_heads:
            return f"Flax MultiHeadDotProductAttention has no grouped kv heads (n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads})"
        if cfg.d_v != cfg.d_k:
            return f"Flax MultiHeadDotProductAttention uses one head_dim for q, k and v (d_k={cfg.d_k}, d_v={cfg.d_v})"
        if not scale_is_default(cfg):
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
        if cfg.rel_buckets is not None:  # T5's table next to the module's tree: a primal, so its gradient comes back
            tree = {**tree, "rel_bias": to_jax(params.rel_bias, dtype, target)}
        score_tables = {name: to_jax(table, None, target) for name, table in bias_tables(cfg, inputs).items()}

        def applied(tree, bias_tables):
            """The module and its params: with a score bias, attention_fn is Flax's dot_product_attention given it."""
            tree = dict(tree)
            rel_table = tree.pop("rel_bias", None)
            if not cfg.has_score_bias:
                return module, tree
            bias = gathered_bias(cfg, rel_table, bias_tables)  # (1|B, H, Nq, Nk)
            return module.clone(attention_fn=partial(nn.dot_product_attention, bias=bias.astype(compute_dtype))), tree

        def forward(tree, x_q, x_k, x_v, mask, rows, b_o, bias_tables):
            layer, tree = applied(tree, bias_tables)
            output = layer.apply({"params": tree}, x_q, x_k, x_v, mask=mask)  # (B, Nq, D)
            return spec_rows(output, b_o, rows)  # spec: a row with no allowed key outputs b_o

        def stages(tree, x_q, x_k, x_v, mask, rows, b_o, bias_tables):
            layer, tree = applied(tree, bias_tables)
            output, state = layer.apply(
                {"params": tree}, x_q, x_k, x_v, mask=mask, sow_weights=True, mutable=["intermediates"]
            )
            (weights,) = state["intermediates"]["attention_weights"]  # (B, H, Nq, Nk)
            rows_4d = None if rows is None else rows[:, None]  # (B|1, 1, Nq, 1)
            return {"weights": spec_rows(weights, 0, rows_4d), "output": spec_rows(output, b_o, rows)}

        args = (tree, x_q, x_k, x_v, mask, spec.rows, spec.b_o, score_tables)
        key = ("flax", cfg, dtype)  # what the closures capture: the module, built from cfg and the dtype
        compiled = CompiledForward(forward, args, self.matmul_precision, key)
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
        return gradients_to_canonical(cfg, partial(_flax_tree, cfg), grads)  # kernels (in, H, d) -> (out, in)


def _flax_tree(cfg: MHAConfig, params: MHAParams) -> dict:
    """The oracle's first primal: the module's params tree, and T5's table next to it with relative bias."""
    tree = to_flax_params(cfg, params)
    return tree if cfg.rel_buckets is None else {**tree, "rel_bias": params.rel_bias}
