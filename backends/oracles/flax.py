"""The flax oracle: ``flax.linen.MultiHeadDotProductAttention`` fed the canonical parameters (see `jax_common`).

The variants it can express: the window (in the boolean mask, `core.inputs.allowed_positions`),
and ALiBi and T5's relative bias through the module's ``attention_fn`` hook, which here is
Flax's own ``flax.linen.dot_product_attention`` with its additive ``bias`` argument (ALiBi's
bias from `core.variants.alibi_bias`, constants; T5's gathered from ``rel_bias`` by bucket in
the traced pass, the table kept next to the module's tree so that its gradient comes back).
The rest is unsupported, each with its reason (`unsupported_reason`).

Decoding (`run_decode`) goes through Flax's own cache: the same module with ``decode=True``, its
``cache`` collection (``cached_key``/``cached_value`` (B, T, H, head_dim), ``cache_index``)
allocated for the whole sequence by a first call on all N tokens, then fed one token per call,
the prefill included: the module refuses a query of more than one token once the cache exists,
so a prefill of P tokens is P calls (the split changes nothing but where the outputs are cut).
The module masks the cache itself with ``arange(T) <= cache_index`` (its one query against the
slots written so far: the causal rule of a decode step, bottom-right); the call's ``mask`` adds
the padding (pads are never keys). So it is supported exactly where that library can express the
case: no rotary, no grouped kv heads, one token per step, positions that follow the cache index
among the real tokens (the default ones and ``cumsum(mask) - 1``), no window (its cache is the
full length, never a ring buffer) and none of the score variants (`decode_reason`).
flax #5591 reports top-left causal masking on a decode step (a query that sees only key 0) when
a causal mask made for the query's own length is passed to a cached call; this oracle passes no
causal mask and leaves the step's causality to the module's cache index.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, numpy_dtype, prepare_inputs, to_flax_params
from mha_rosetta.core.decode import DecodeInputs, decode_allowed
from mha_rosetta.core.variants import kernel_refusal, norm_step

from .._grad_layout import gradients_to_canonical
from ..base import STANDARD, PreparedDecode, StageTensor, UnsupportedCase, tensor_to_numpy
from ..jax.common import (
    CompiledForward,
    allowed_for_heads,
    block_until_ready,
    effective_precision,
    jax_target,
    to_jax,
)
from .jax_common import JaxOracle, bias_tables, gathered_bias, scale_is_default, spec_rows


def fixed_heads_reason(cfg: MHAConfig, module: str, head_dim: str, one_head_dim: bool = False) -> str | None:
    """Why a JAX module with a kv head per query head and the scale 1/sqrt(``head_dim``) built in cannot run ``cfg``
    (grouped kv heads, another scale; with ``one_head_dim``, d_v != d_k), or None: Flax's and equinox's refusals."""
    if cfg.n_kv_heads != cfg.n_heads:
        return f"{module} has no grouped kv heads (n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads})"
    if one_head_dim and cfg.d_v != cfg.d_k:
        return f"{module} uses one {head_dim} for q, k and v (d_k={cfg.d_k}, d_v={cfg.d_v})"
    if not scale_is_default(cfg):
        return f"{module} always scales by 1/sqrt({head_dim}); cfg.scale={cfg.scale:g}"
    return None


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
    # Rule 8: Flax's own decode=True cache (module docstring); no variant on its decode path (the library's idiom:
    # decode=True takes no bias, so written out, not derived from ``variants``).
    decode_caches = ("static",)
    decode_variants: frozenset[str] = frozenset()
    decode_layouts: ClassVar[dict[str, str]] = {
        "static": "(B, T, H, head_dim) cached_key / cached_value in the module's 'cache' collection, allocated "
        "for the whole sequence, written with lax.dynamic_update_slice at cache_index, one token per call"
    }

    def decode_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str, cache: str | None) -> str | None:
        if reason := self.unsupported_reason(cfg, dtype, device, STANDARD):  # what its forward cannot express
            return reason
        if cfg.window is not None:
            return (
                "Flax's decode cache holds the whole sequence (cached_key (B, T, H, head_dim) for every token): "
                "no ring buffer, so a window's O(W) cache cannot be Flax's"
            )
        return super().decode_reason(cfg, dtype, device, strategy, cache)

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if norm_step(cfg) is not None:  # the refusal names the config field that asked for it
            return (
                "Flax's normalize_qk is a LayerNorm of each head (mean subtracted, no weight of the projection), "
                f"not RMSNorm; cfg.qk_norm={cfg.qk_norm!r}"
            )
        # The registry's reason for each variant a kernel takes only through a hook: an attention_fn that added one
        # would be this project's attention, not Flax's.
        if why := kernel_refusal(cfg, "Flax's dot_product_attention"):
            return why
        if cfg.bias == "qkv":
            return "Flax MultiHeadDotProductAttention has one use_bias for q, k, v and the output (bias='qkv')"
        if cfg.rope is not None:
            return (
                f"Flax MultiHeadDotProductAttention has no rotary embedding (cfg.rope={cfg.rope!r}): "
                "it projects q and k inside the module"
            )
        reason = fixed_heads_reason(cfg, "Flax MultiHeadDotProductAttention", "head_dim", one_head_dim=True)
        return reason or super().unsupported_reason(cfg, dtype, device, strategy)

    def _module_program(self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, target, spec, x):
        import flax.linen as nn
        import jax

        # Kernels (in, H, head_dim), out kernel (H, head_dim, D), each a JAX array on the target.
        tree = jax.tree_util.tree_map(lambda array: to_jax(array, dtype, target), to_flax_params(cfg, params))
        module = flax_module(cfg, dtype)
        x_q, x_k, x_v = x
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
            return module.clone(attention_fn=partial(nn.dot_product_attention, bias=bias.astype(module.dtype))), tree

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

        return compiled, native_stages

    def _prepare_decode_run(self, cfg, params, inputs: DecodeInputs, dtype, device, strategy, cache) -> PreparedDecode:
        import jax
        import jax.numpy as jnp

        if inputs.step != 1:
            raise UnsupportedCase(
                f"Flax's decode=True cache takes one token per call (its query must be (B, 1, H, head_dim)); "
                f"step={inputs.step}"
            )
        B, N = inputs.batch, inputs.tokens
        valid, positions = inputs.valid, inputs.positions  # (B, N) each
        # The module's own causal rule is on the cache index (key slot j <= the call's index i):
        # it equals the rule on positions only where the real tokens' positions follow the index.
        index = np.arange(N)
        on_index = (index[None, :] <= index[:, None])[None, None] & valid[:, None, None, :]  # (B, 1, N, N)
        if not np.array_equal(decode_allowed(cfg, positions, positions, valid), on_index):
            raise UnsupportedCase(
                "Flax's decode cache masks its slots by the cache index (arange(T) <= cache_index), not by "
                "positions; these positions do not follow the index among the real tokens"
            )
        target = jax_target(dtype, device)
        module = flax_module(cfg, dtype, decode=True)
        tree = jax.tree_util.tree_map(lambda array: to_jax(array, dtype, target), to_flax_params(cfg, params))
        x = to_jax(inputs.x, dtype, target)  # (B, N, D)
        # Pads are never keys: the call's mask (B, 1, 1, T); the module adds its own cache-index rule.
        pad_mask = to_jax(np.ascontiguousarray(valid[:, None, None, :]), None, target)
        full = prepare_inputs(cfg, inputs.x, mask=inputs.forward_mask(), positions=positions)
        spec = self._output_rows(cfg, params, full, dtype, target)  # rows with no allowed key -> b_o
        precision = effective_precision(self.matmul_precision)
        compilations = {"allocate": 0, "step": 0}

        def allocate(tree, x):
            compilations["allocate"] += 1  # runs only while JAX traces (and so compiles)
            # The first decode=True call creates the zero cache for x's length; its output (an uncached
            # forward over all of x) is discarded.
            _, variables = module.apply({"params": tree}, x, x, x, mutable=["cache"])
            return variables["cache"]

        def step(tree, cache, token, mask):
            compilations["step"] += 1
            out, variables = module.apply(
                {"params": tree, "cache": cache}, token, token, token, mask=mask, mutable=["cache"]
            )
            return out, variables["cache"]  # (B, 1, D)

        allocate_jit, step_jit = jax.jit(allocate), jax.jit(step, donate_argnums=(1,))
        info = self._info(dtype, device, empty_rows_mapped=spec.count)
        size = np.dtype(numpy_dtype(dtype)).itemsize
        info["cache"] = {
            "kind": "static",
            "layout": "(B, T, H, Dk)",
            "slots": N,
            "bytes": 2 * B * N * cfg.q_width * size,
        }
        info["prefill"] = "fed one token per call: the module takes no chunk once its cache exists"
        info["compilations"] = compilations

        def outputs() -> list:
            with jax.default_matmul_precision(precision):
                cache = allocate_jit(tree, x)
                tokens = []
                for t in range(N):
                    out, cache = step_jit(tree, cache, x[:, t : t + 1], pad_mask)
                    tokens.append(out)
            rows = None if spec.rows is None else jnp.broadcast_to(spec.rows, (B, N, 1))
            return [
                spec_rows(out, spec.b_o, None if rows is None else rows[:, t : t + 1]) for t, out in enumerate(tokens)
            ]

        def run():
            return jnp.concatenate(outputs(), axis=1)  # (B, N, D)

        def step_stages() -> list[dict[str, StageTensor]]:
            tokens = outputs()
            mapped = "; rows with no allowed key mapped to the spec" if spec.count else ""
            return [
                {
                    "output": StageTensor(
                        jnp.concatenate(tokens[start:stop], axis=1), ("B", "Nq", "D"), f"module output{mapped}"
                    )
                }
                for start, stop in inputs.chunks()
            ]

        return PreparedDecode(run, tensor_to_numpy, step_stages, block_until_ready, info=info)

    maps_output_rows = True
    # Declared above: float16 logits are soft-maxed in float16, less accurate than the spec's float32 path.
    half_precision_softmax = True

    def _canonical_grads(self, cfg: MHAConfig, grads) -> dict:
        return gradients_to_canonical(cfg, partial(_flax_tree, cfg), grads)  # kernels (in, H, d) -> (out, in)


def flax_module(cfg: MHAConfig, dtype: str, decode: bool = False):
    """``nn.MultiHeadDotProductAttention`` for ``cfg``, computing and holding its parameters in ``dtype``; with
    ``decode`` it keeps its own KV cache (the forward's module and the decode run's are otherwise the same)."""
    import flax.linen as nn
    import jax.numpy as jnp

    compute_dtype = jnp.dtype(numpy_dtype(dtype))
    return nn.MultiHeadDotProductAttention(
        num_heads=cfg.n_heads,
        qkv_features=cfg.q_width,
        out_features=cfg.d_model,
        use_bias=cfg.bias,
        dtype=compute_dtype,
        param_dtype=compute_dtype,
        deterministic=True,
        decode=decode,
    )


def _flax_tree(cfg: MHAConfig, params: MHAParams) -> dict:
    """The oracle's first primal: the module's params tree, and T5's table next to it with relative bias."""
    tree = to_flax_params(cfg, params)
    return tree if cfg.rel_buckets is None else {**tree, "rel_bias": params.rel_bias}
