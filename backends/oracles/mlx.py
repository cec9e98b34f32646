"""MLX's own attention as oracles: ``mx.fast.scaled_dot_product_attention`` and ``mlx.nn.MultiHeadAttention``.

* `MlxSDPAOracle` (``mlx-sdpa``): the heads projected, normed and rotated as mlx-lm does it
  (`mlx.layer.MlxAttention.heads`), then the fused kernel, as every mlx-lm model calls it. Its
  conventions, each reported: ``mask="causal"`` is aligned **bottom-right** (the last query sees the
  last key; torch's ``is_causal`` is top-left), so the string is passed only where the spec's causal
  rule on these positions is bottom-right on indices, and a boolean mask (True = attend) otherwise;
  GQA runs without tiling the keys; the softmax is float32 whatever the inputs; a query row with no
  allowed key gets the **mean of V** (measured here, mlx 0.32.4 CPU: the masked logits are a large
  finite negative, not -inf), where the spec gives zeros and torch's SDPA NaN; ALiBi and T5's bias
  ride in an additive mask (-inf where blocked), the sinks in its ``sinks=``; it has no softcap.
* `MlxMHAOracle` (``mlx-mha``): ``nn.MultiHeadAttention`` loaded with the canonical ``(out, in)``
  weights. It has one head count for queries and keys (no GQA), the scale ``1/sqrt(d_k)`` fixed,
  one ``bias`` flag for all four projections, no rotary, and calls the same kernel.

MLX is imported inside the methods. float64 runs on the CPU, held to float32's tolerance
(`frameworks.mlx.FLOAT64_LIMIT`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions
from mha_rosetta.core.variants import BUILTIN_VARIANTS, kernel_refusals

from .._recording import StageRecorder, record_stages
from ..base import STANDARD, Backend, Prepared, UnsupportedCase, tensor_to_numpy
from ..frameworks.mlx import FLOAT64_LIMIT, TOLERANCE_LEVELS, mlx_stream, precision_info, to_mlx
from ..mlx.adapter import MlxDevices, layer_inputs, prepare_mlx_vjp
from ..mlx.layer import MlxAttention
from .torch import VariantReasons

SDPA = "mx.fast.scaled_dot_product_attention"  # as its refusals name it
SDPA_HOOKS = frozenset({"sinks"})  # what the kernel takes through an argument of its own (sinks=)
MEAN_OF_V = (
    "a query row with no allowed key: the mean of V (the masked logits are a large finite negative, not -inf; "
    "measured on mlx 0.32.4 CPU), where the spec gives zeros (output b_o) and torch's SDPA NaN"
)
HALF_BACKWARD = (
    "mx.fast.scaled_dot_product_attention's backward (mx.vjp of the kernel) rounds scale * q.k^T and its gradients "
    "in the half input type: the key bias's gradient measured up to 15% beyond the check's half rule (2x the spec's "
    "rounded path; float16 rope_partial, alibi, causal_padding), so half-precision gradients are not compared"
)
FUSED_STAGES = "scores and weights stay inside the fused kernel: projections, heads, context, merged, output are stages"


def bottom_right_causal(cfg: MHAConfig, inputs: MHAInputs) -> bool:
    """Whether ``mask="causal"`` (MLX's bottom-right rule on indices) is the whole mask of this case."""
    if not cfg.causal or inputs.mask is not None or cfg.window is not None or cfg.has_score_bias:
        return False
    if cfg.attention_chunk_size is not None:  # Llama 4's chunks: in the bool mask
        return False
    allowed = allowed_positions(cfg, inputs)  # (1|B, 1, Nq, Nk)
    Nq, Nk = inputs.q_tokens, inputs.kv_tokens
    bottom_right = np.tril(np.ones((Nq, Nk), dtype=bool), k=Nk - Nq)  # the last query sees the last key
    return bool(np.array_equal(allowed, np.broadcast_to(bottom_right, allowed.shape)))


def sdpa_mask(cfg: MHAConfig, inputs: MHAInputs, layer: MlxAttention, given: dict):
    """(``mask=`` for the kernel, how it was given in words): "causal", a bool array, an additive array, or None."""
    if bottom_right_causal(cfg, inputs):
        return "causal", 'mask="causal" (bottom-right, equal to the spec on these positions)'
    if cfg.has_score_bias:  # the bias where allowed, -inf where blocked, in the run's dtype
        bias = layer.score_bias(layer.params, given["distance"])  # (1|B, H, Nq, Nk)
        if given["blocked"] is not None:
            bias = layer.mx.where(given["blocked"], layer.mx.array(-np.inf, dtype=bias.dtype), bias)
        dtype = layer.params["w_q"].dtype
        return bias.astype(dtype), "additive: the score bias, -inf where blocked"
    if given["blocked"] is None:
        return None, "none"
    return layer.mx.logical_not(given["blocked"]), "bool, True = may attend"


def refuse_kernel_backward(name: str, cfg: MHAConfig, inputs: MHAInputs, dtype: str) -> None:
    """`UnsupportedCase` where the kernel's backward (``mx.vjp`` of it) cannot be compared: half precision
    (`HALF_BACKWARD`), or a query row with no allowed key (its gradients are the mean of V's)."""
    if dtype in ("float16", "bfloat16"):
        raise UnsupportedCase(HALF_BACKWARD)
    allowed = allowed_positions(cfg, inputs)
    if allowed is not None and not allowed.any(axis=-1).all():
        raise UnsupportedCase(f"{name} backward: {MEAN_OF_V}; its gradients are that answer's, not the spec's")


class MlxSDPAOracle(VariantReasons, MlxDevices, Backend):
    """``mx.fast.scaled_dot_product_attention`` on heads projected and rotated as mlx-lm does (see the module)."""

    convention = 'mx.fast.scaled_dot_product_attention(q, k, v, scale=, mask=): mask="causal" is bottom-right'
    # The package's own but those a kernel takes only through a hook (the registry's), the sinks back in through the
    # kernel's own sinks= (a library's idiom): a plugin variant is never run without it.
    variants = BUILTIN_VARIANTS - kernel_refusals(SDPA, SDPA_HOOKS).keys()
    causal_on_positions = True  # the mask comes from the positions; "causal" only where it is the same
    tolerance_levels = TOLERANCE_LEVELS
    vjp_variants = variants - {"rel_bias"}
    variant_why: ClassVar[dict[str, str]] = {
        **kernel_refusals(SDPA, SDPA_HOOKS),
        "rel_bias": "mx.fast.scaled_dot_product_attention's fused backward (Metal's) refuses a gradient with respect "
        "to its additive mask, where T5's table rides; only its CPU fallback differentiates the mask (MLX 0.32.4 here: "
        "the composed ops' gradient), so checking it here would check a path Apple silicon never takes",
    }
    decode_unsupported = "the oracle is the kernel alone; the mlx adapter decodes through mlx-lm's caches"
    known_differences = (
        'mask="causal" is aligned bottom-right (the last query sees the last key); torch\'s is_causal is top-left. '
        "The adapter passes it only where the spec's rule on these positions is bottom-right, else a bool mask",
        MEAN_OF_V,
        "GQA without tiling: k and v keep Hkv heads (query head h reads kv head h // G)",
        "the softmax is float32 whatever the input dtype",
        FUSED_STAGES,
        "no rotary of its own: the heads are turned before the call (nn.RoPE's rotation), as mlx-lm models do",
        FLOAT64_LIMIT,
    )

    def _prepare(self, cfg, params, inputs, dtype, device, strategy) -> Prepared:
        import mlx.core as mx

        layer = MlxAttention(cfg, params, dtype)
        given = layer_inputs(cfg, inputs, dtype)
        mask, how = sdpa_mask(cfg, inputs, layer, given)
        forward = self.pass_for(cfg, layer, given, mask)
        stream = mlx_stream(device)

        def run(rec=None):
            with mx.stream(stream):
                return forward(layer.params, given["x_q"], given["x_k"], given["x_v"], rec)

        info = {"mask": how, "gqa": "no tiling (Hkv heads)", **precision_info(dtype)}
        return Prepared(run, tensor_to_numpy, lambda: record_stages(run), synchronize=mx.eval, info=info)

    @staticmethod
    def pass_for(cfg: MHAConfig, layer: MlxAttention, given: dict, mask):
        """The oracle's pass as a pure function ``(p, x_q, x_k, x_v, rec=None)`` (the forward and ``mx.vjp``)."""
        import mlx.core as mx

        def forward(p, x_q, x_k, x_v, rec: StageRecorder | None = None):
            q, k, v = layer.heads(p, x_q, x_k, x_v, given["tables"], rec)  # (B, H, Nq, Dk), (B, Hkv, Nk, d) x 2
            sinks = p["sinks"].astype(q.dtype) if cfg.sinks else None  # (H,)
            context = mx.fast.scaled_dot_product_attention(q, k, v, scale=cfg.scale, mask=mask, sinks=sinks)
            if rec is not None:
                rec.record("context", context, ("B", "H", "Nq", "Dv"), "mx.fast.scaled_dot_product_attention")
            return layer.finish(p, context, rec)

        return forward

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        refuse_kernel_backward(self.name, cfg, inputs, dtype)
        layer = MlxAttention(cfg, params, dtype)
        given = layer_inputs(cfg, inputs, dtype)
        mask, how = sdpa_mask(cfg, inputs, layer, given)
        forward = self.pass_for(cfg, layer, given, mask)
        info = {"mask": how, **precision_info(dtype)}
        return prepare_mlx_vjp(forward, layer.params, given, cotangent, dtype, device, info)


class MlxMHAOracle(VariantReasons, MlxDevices, Backend):
    """``mlx.nn.MultiHeadAttention(dims, num_heads, ..., bias=)`` loaded with the canonical weights."""

    convention = "mlx.nn.MultiHeadAttention: Linear (out, in), one head count, scale 1/sqrt(d_k), additive/bool mask"
    variants = frozenset({"window"})  # the window rides in the bool mask
    causal_on_positions = True
    tolerance_levels = TOLERANCE_LEVELS
    variant_why: ClassVar[dict[str, str]] = {
        name: "mlx.nn.MultiHeadAttention has no hook between its projections and the kernel"
        for name in BUILTIN_VARIANTS
        if name != "window"
    }
    decode_unsupported = "mlx.nn.MultiHeadAttention takes no cache"
    known_differences = (
        MEAN_OF_V,
        "one num_heads for queries and keys: no GQA; the scale is fixed at 1/sqrt(d_k); one bias flag for all four",
        "the module's weights are nn.Linear's (out, in), the canonical layout itself: loaded as they are",
        "the output is the only stage (the module exposes none)",
        FLOAT64_LIMIT,
    )

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if cfg.n_kv_heads != cfg.n_heads:
            return "mlx.nn.MultiHeadAttention has one num_heads for queries and keys: no GQA"
        if not np.isclose(cfg.scale, cfg.d_k**-0.5, rtol=1e-12, atol=0):
            return f"mlx.nn.MultiHeadAttention fixes the scale at 1/sqrt(d_k) = {cfg.d_k**-0.5:.6g}; got {cfg.scale!r}"
        if cfg.rope is not None:
            return "mlx.nn.MultiHeadAttention has no rotary embedding (mlx-lm models apply nn.RoPE in their own code)"
        if cfg.bias == "qkv":
            return "mlx.nn.MultiHeadAttention has one bias flag for all four projections, not q, k and v only"
        return super().unsupported_reason(cfg, dtype, device, strategy)

    PROJECTIONS: ClassVar[dict[str, str]] = {"query_proj": "q", "key_proj": "k", "value_proj": "v", "out_proj": "o"}

    def _module(self, cfg: MHAConfig, params: MHAParams, dtype: str):
        """``nn.MultiHeadAttention`` holding the canonical weights, and those weights by canonical name."""
        import mlx.nn as nn

        H, Dk, Dv = cfg.n_heads, cfg.d_k, cfg.d_v
        module = nn.MultiHeadAttention(
            H * Dk, H, cfg.d_model, cfg.kdim, cfg.vdim, value_dims=H * Dv, value_output_dims=cfg.d_model, bias=cfg.bias
        )
        names = [f"w_{x}" for x in self.PROJECTIONS.values()] + (
            [f"b_{x}" for x in self.PROJECTIONS.values()] * cfg.bias
        )
        weights = {name: to_mlx(getattr(params, name), dtype) for name in names}  # (out, in): nn.Linear's own layout
        module.load_weights(self._tree(weights))  # strict: every parameter of the module
        module.eval()
        return module, weights

    def _tree(self, weights: dict) -> list:
        """Canonical names -> the module's parameter paths (``query_proj.weight`` ...)."""
        kind = {"w": "weight", "b": "bias"}
        return [
            (f"{mod}.{kind[name[0]]}", weights[name])
            for mod, x in self.PROJECTIONS.items()
            for name in weights
            if name[2:] == x
        ]

    @staticmethod
    def _mask(cfg: MHAConfig, inputs, given: dict):
        import mlx.core as mx

        if bottom_right_causal(cfg, inputs):
            return "causal"
        return None if given["blocked"] is None else mx.logical_not(given["blocked"])  # bool, True = may attend

    def _prepare(self, cfg, params: MHAParams, inputs, dtype, device, strategy=STANDARD) -> Prepared:
        import mlx.core as mx

        module, _ = self._module(cfg, params, dtype)
        given = layer_inputs(cfg, inputs, dtype)
        mask = self._mask(cfg, inputs, given)
        stream = mlx_stream(device)

        def run(rec=None):
            with mx.stream(stream):
                output = module(given["x_q"], given["x_k"], given["x_v"], mask=mask)  # (B, Nq, D)
            if rec is not None:
                rec.record("output", output, ("B", "Nq", "D"), "nn.MultiHeadAttention(queries, keys, values, mask)")
            return output

        info = {"mask": "causal" if isinstance(mask, str) else ("bool" if mask is not None else "none")}
        return Prepared(
            run,
            tensor_to_numpy,
            lambda: record_stages(run),
            synchronize=mx.eval,
            info={**info, **precision_info(dtype)},
        )

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        """``mx.vjp`` through the module: its parameters set from the primals (``module.update``, as
        ``nn.value_and_grad`` does), so the weights' gradients come back in its (out, in) layout."""
        from mlx.utils import tree_unflatten

        refuse_kernel_backward(self.name, cfg, inputs, dtype)
        module, weights = self._module(cfg, params, dtype)
        given = layer_inputs(cfg, inputs, dtype)
        mask = self._mask(cfg, inputs, given)

        def forward(p, x_q, x_k, x_v):
            module.update(tree_unflatten(self._tree(p)))
            return module(x_q, x_k, x_v, mask=mask)

        return prepare_mlx_vjp(forward, weights, given, cotangent, dtype, device, precision_info(dtype))


__all__ = ["MlxMHAOracle", "MlxSDPAOracle"]
