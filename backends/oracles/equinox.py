"""The equinox oracle: ``equinox.nn.MultiheadAttention`` fed the canonical parameters (see `jax_common`).

The variants it can express: the window (in the boolean mask, `core.inputs.allowed_positions`)
and ``bias="qkv"`` (its four ``use_*_bias`` switches are separate, so the output projection goes
without). Everything on the scores is out of reach: the module computes the logits, the
softmax and the weighted sum in one call, and its one hook, ``process_heads``, sees only q, k
and v. The rest is unsupported, each with its reason (`unsupported_reason`).
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, numpy_dtype, to_equinox_weights
from mha_rosetta.core.layouts import EQUINOX_NAMES
from mha_rosetta.core.variants import kernel_refusal, norm_step

from .._grad_layout import gradients_to_canonical
from .._layouts import ROW_SAMPLE_PROJECTION_AXES
from ..base import StageTensor, UnsupportedCase
from ..jax.common import (
    CompiledForward,
    allowed_for_heads,
    to_jax,
)
from .flax import fixed_heads_reason
from .jax_common import JaxOracle, spec_rows


class EquinoxMHAOracle(JaxOracle):
    """``equinox.nn.MultiheadAttention`` (unbatched), weights set with ``eqx.tree_at``, vmapped over batch."""

    name = "equinox"
    convention = "equinox.nn.MultiheadAttention: unbatched module, Linear weights (out, in), jax.vmap over batch"
    gap_causes: ClassVar[dict[str, str]] = {
        "forward": "its Linear applies W @ x to each token under jax.vmap, which XLA:CPU compiles as W @ X.T: each of "
        "x_q, x_k and x_v is transposed to (D, B*N) before its product and the output back after it, four copies of "
        "4 MiB at the reference size that jax-best's x @ W makes none of; the attention itself is the same one "
        "fusion (read in both compiled programs' HLO, jax 0.10.2; not timed apart)",
    }
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
        "window: in the boolean mask; bias='qkv': use_query/key/value_bias on, use_output_bias off",
    )
    variants = frozenset({"window", "qkv_bias"})
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    decode_unsupported = (
        "equinox.nn.MultiheadAttention has no KV cache: its __call__ takes whole query, key_ and value "
        "sequences and keeps no state between calls"
    )

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if norm_step(cfg) is not None:  # the refusal names the config field that asked for it
            return (
                f"equinox MultiheadAttention has no QK-norm (cfg.qk_norm={cfg.qk_norm!r}); its process_heads hook could "
                "apply one, but the norm weights would then be the hook's, not the module's, and this oracle does not"
            )
        # It computes the logits, the softmax and the weighted sum in one call: the registry's reason for each variant
        # a kernel takes only through a hook, and no bias either (its process_heads hook sees only q, k and v).
        if why := kernel_refusal(cfg, "equinox MultiheadAttention"):
            return why
        if cfg.has_score_bias:
            return (
                "equinox MultiheadAttention has no score bias (ALiBi, relative bias): it computes the logits, the "
                "softmax and the weighted sum in one call, and its process_heads hook sees only q, k and v"
            )
        if cfg.rope_scaling is not None:
            return "eqx.nn.RotaryPositionalEmbedding has no frequency scaling (only theta): rope_scaling is unsupported"
        if cfg.rope == "interleaved":
            return (
                "equinox.nn.RotaryPositionalEmbedding rotates halves (rotate_half) only, not interleaved pairs; "
                "core.to_rotate_half_params converts such weights"
            )
        reason = fixed_heads_reason(cfg, "equinox MultiheadAttention", "qk_size")
        return reason or super().unsupported_reason(cfg, dtype, device, strategy)

    def _module_program(self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, target, spec, x):
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        model = loaded_equinox_mha(cfg, params, dtype, target)
        dynamic, static = eqx.partition(model, eqx.is_array)

        x_q, x_k, x_v = x
        mask, batch_axis = _equinox_mask(cfg, inputs)
        mask = to_jax(mask, None, target)
        process_heads = _equinox_rotary(cfg, inputs, jnp.dtype(numpy_dtype(dtype)))

        def forward(dynamic, x_q, x_k, x_v, mask, rows, b_o):
            module = eqx.combine(dynamic, static)
            one_item = lambda q, k, v, m: module(q, k, v, mask=m, process_heads=process_heads)  # noqa: E731
            output = jax.vmap(one_item, in_axes=(0, 0, 0, batch_axis))(x_q, x_k, x_v, mask)  # (B, Nq, D)
            return spec_rows(output, b_o, rows)  # spec: no allowed key -> b_o

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
        # What the closures capture: the module's static part and the rotary hook (from cfg and the dtype), the mask's
        # batch axis. The inputs' positions only decide whether the case is supported (`_equinox_rotary`).
        key = ("equinox", cfg, dtype, batch_axis)
        compiled = CompiledForward(forward, args, self.matmul_precision, key)
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

        return compiled, native_stages

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
        use_query_bias=cfg.qkv_bias,
        use_key_bias=cfg.qkv_bias,
        use_value_bias=cfg.qkv_bias,
        use_output_bias=cfg.output_bias,  # bias="qkv": q, k and v only
        dtype=jnp.dtype(numpy_dtype(dtype)),
        key=jax.random.PRNGKey(0),
    )
    # The canonical (out, in) weights into the module's four Linear layers with eqx.tree_at.
    weights = to_equinox_weights(cfg, params)
    # Every layer's weight, and its bias where it has one (bias="qkv": not the output projection's).
    slots = [
        (layer, part)
        for part in ("weight", "bias")
        for layer in EQUINOX_NAMES.values()
        if weights[layer][part] is not None
    ]

    def leaves(module):
        return [getattr(getattr(module, layer), part) for layer, part in slots]

    values = [to_jax(weights[layer][part], dtype, target) for layer, part in slots]
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
