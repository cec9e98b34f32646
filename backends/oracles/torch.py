"""Third-party oracles from PyTorch: ``nn.MultiheadAttention`` and ``F.scaled_dot_product_attention``.

Both are fed the canonical parameters (through `core.to_torch_mha_state_dict` for the
module) and compared with the spec like any backend. Where torch's convention differs
from the spec the adapter maps it (mask polarity, sequence-first layout) and says so in
``known_differences``; where torch's *answer* differs (a query that may attend to no key)
the adapter passes torch's raw result through, NaN included, so the check reports it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    MHAInputs,
    MHAParams,
    allowed_positions,
    causal_on_indices,
    from_torch_mha_state_dict,
    torch_mha_unsupported_reason,
)
from mha_rosetta.core.variants import BUILTIN_VARIANTS, VARIANT_REGISTRY, NormStep, kernel_refusals

from .._recording import StageRecorder
from ..base import Backend, DecodeStep, Prepared, StageTensor, tensor_to_numpy
from ..torch.common import (
    TorchDevices,
    bool_tensor,
    inference_run,
    optional_tensor,
    param_tensors,
    precision_info,
    recorded_prepared,
    synchronizer,
    to_tensor,
    torch_dtype,
    torch_inputs,
    with_matmul_precision,
)
from ..torch.variants import ScoreBias
from ..torch.vjp import INPUT_SLOTS, autograd_prepared, leaf
from .torch_decode import (
    SDPA_DECODE_DIFFERENCES,
    SDPA_DECODE_LAYOUT,
    prepare_sdpa_decode_run,
    prepare_sdpa_decode_step,
)
from .torch_heads import float_score_mask
from .torch_passes import (
    fast_path_expected,
    loaded_torch_mha,
    sdpa_has_enable_gqa,
    sdpa_pass,
    torch_blocked_mask,
)


def _no_norm_hook(step: NormStep) -> str:
    """Why nn.MultiheadAttention cannot run a norm of q and k before rotary at ``step``'s place (the registry's)."""
    where = "projected and split" if step.per_head else "projected"
    return (
        f"nn.MultiheadAttention has no QK-norm: q and k are {where} inside the module, with no hook before the scores"
    )


class VariantReasons:
    """A mixin for an oracle whose library cannot express some variants: ``variant_why`` says why, per variant.

    `Backend.variant_reason` names what is missing; this replaces that generic sentence with the
    library's reason for each missing variant that has one (the generic one stays for the rest).
    """

    variant_why: ClassVar[dict[str, str]] = {}

    def variant_reason(self, cfg: MHAConfig, strategy: str, backward: bool = False) -> str | None:
        generic = super().variant_reason(cfg, strategy, backward)  # type: ignore[misc]
        if generic is None:
            return None
        declared = self.strategy_variants.get(strategy, self.variants)  # type: ignore[attr-defined]
        if backward and self.vjp_variants is not None:  # type: ignore[attr-defined]
            declared = declared & self.vjp_variants  # type: ignore[attr-defined]
        missing = [name for name in cfg.variants if name not in declared]
        why = [self.variant_why[name] for name in missing if name in self.variant_why]
        return "; ".join(why) if len(why) == len(missing) else f"{generic}; " + "; ".join(why) if why else generic


class TorchMHAOracle(VariantReasons, TorchDevices, Backend):
    """``torch.nn.MultiheadAttention`` in eval mode, loaded with the canonical parameters.

    The timed pass calls the module as inference code does, ``need_weights=False``, which
    lets torch pick its fused paths. `native_stages` calls it once more with
    ``need_weights=True, average_attn_weights=False`` for the per-head weights.
    """

    # The window is in the (boolean) attn_mask; ALiBi and T5's bias ride in a float attn_mask.
    variants = frozenset({"window", "alibi", "rel_bias"})
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    decode_unsupported = (
        "nn.MultiheadAttention's API has no KV cache: it projects whole query, key and value sequences inside the "
        "module and returns no projected keys or values to keep between calls"
    )
    variant_why: ClassVar[dict[str, str]] = {
        **kernel_refusals("nn.MultiheadAttention"),  # the variants that need a hook inside the module (the registry's)
        **{name: _no_norm_hook(entry.norm_step) for name, entry in VARIANT_REGISTRY.items() if entry.norm_step},
        "qkv_bias": "nn.MultiheadAttention's one bias switch covers in_proj and out_proj together: no output "
        "projection without a bias when q, k and v have one (bias='qkv')",
    }
    known_differences = (
        "mask polarity: attn_mask True = blocked (the spec: True = may attend); the adapter passes ~allowed",
        "ALiBi and T5's relative bias go in as a float attn_mask (B*H, Nq, Nk): the bias where allowed, -inf where "
        "blocked; the bias tensor is built by the adapter (torch ScoreBias), the module only adds it",
        "sequence-first by default: (N, B, E) unless batch_first=True; the seq-first adapter transposes in prepare and back in to_numpy",
        "a 3-D attn_mask is (B*H, Nq, Nk), batch-major (index b*H + h); a 2-D one (Nq, Nk) is shared by all",
        "a query that may attend to no key: NaN from the fused fast path (eval, batch_first=True, self-attention, "
        "bias, even heads) and from need_weights=True (NaN weights too); zeros, so output b_o like the spec, from "
        "the SDPA path it takes otherwise (torch 2.13, CPU)",
        "need_weights=True averages the weights over heads unless average_attn_weights=False",
        "no grouped kv heads, d_k = d_v = embed_dim / num_heads, scale fixed at 1/sqrt(d_k)",
        "no rotary embedding: q and k are projected inside the module, with no hook to rotate them",
    )

    def __init__(self, name: str | None = None, batch_first: bool = True, allow_tf32: bool = False) -> None:
        super().__init__(name)
        self.batch_first = bool(batch_first)
        self.allow_tf32 = bool(allow_tf32)
        layout = "(B, N, E), batch_first=True" if self.batch_first else "(N, B, E), the default batch_first=False"
        self.convention = (
            f"torch.nn.MultiheadAttention, {layout}; packed in_proj_weight (3E, E); attn_mask True = blocked"
        )
        if not self.name:
            self.name = "torch-mha" if self.batch_first else "torch-mha-seqfirst"

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if cfg.rope is not None:
            return (
                f"nn.MultiheadAttention has no rotary embedding (cfg.rope={cfg.rope!r}): it projects q and k inside "
                "the module, with no hook to rotate them before the scores"
            )
        return torch_mha_unsupported_reason(cfg) or super().unsupported_reason(cfg, dtype, device, strategy)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        import torch

        module = loaded_torch_mha(cfg, params, dtype, device, self.batch_first)
        module.requires_grad_(False)
        # Self-attention passes one tensor three times: torch's fast path checks identity.
        query, key, value = torch_inputs(inputs, dtype, device, layout=self._layout)
        attn_mask = self._attn_mask(cfg, inputs, dtype, device)(optional_tensor(params.rel_bias, dtype, device))

        def call(need_weights: bool):
            with torch.inference_mode():
                return module(
                    query, key, value, attn_mask=attn_mask, need_weights=need_weights, average_attn_weights=False
                )

        call = with_matmul_precision(call, device, self.allow_tf32)

        def forward():
            return call(False)[0]

        def to_numpy(output) -> np.ndarray:
            output = output if self.batch_first else output.transpose(0, 1)  # (B, Nq, D)
            return tensor_to_numpy(output)

        output_axes = ("B", "Nq", "D") if self.batch_first else ("Nq", "B", "D")

        def native_stages():
            output = forward()
            _, weights = call(True)  # (B, H, Nq, Nk), per head
            return {
                "weights": StageTensor(
                    weights, ("B", "H", "Nq", "Nk"), "need_weights=True, average_attn_weights=False (a second call)"
                ),
                "output": StageTensor(output, output_axes, "the timed call's output, need_weights=False"),
            }

        info = {
            "batch_first": self.batch_first,
            "attn_mask": None
            if attn_mask is None
            else f"{str(attn_mask.dtype).removeprefix('torch.')} {tuple(attn_mask.shape)}, "
            + ("True = blocked" if attn_mask.dtype == torch.bool else "the score bias, -inf = blocked"),
            "fast_path_expected": fast_path_expected(cfg, self.batch_first, query is key is value),
            **precision_info(device=device, dtype=dtype, allow_tf32=self.allow_tf32),
        }
        return Prepared(forward, to_numpy, native_stages, synchronize=synchronizer(device), info=info)

    def _layout(self, x):
        """(B, N, F) -> the module's layout: (N, B, F) when sequence-first."""
        return x if self.batch_first else x.transpose(0, 1).contiguous()

    def _attn_mask(self, cfg: MHAConfig, inputs: MHAInputs, dtype: str, device: str):
        """``attn_mask(rel_bias)``: the module's mask, boolean (True = blocked) or, with a score bias, float
        (the bias, -inf where blocked), (Nq, Nk) or (B*H, Nq, Nk). A function of the T5 table (a leaf
        under autograd), so its gradient flows through the mask."""
        B, H, Nq, Nk = inputs.batch, cfg.n_heads, inputs.q_tokens, inputs.kv_tokens
        allowed = allowed_positions(cfg, inputs)
        if not cfg.has_score_bias:
            blocked = torch_blocked_mask(allowed, B, H, Nq, Nk, device)
            return lambda rel_bias: blocked
        score_bias = ScoreBias(cfg, inputs, dtype, device)
        allowed_t = bool_tensor(allowed, device)  # (1|B, 1|H, Nq, Nk) or None

        def attn_mask(rel_bias):
            mask = float_score_mask(score_bias(rel_bias), allowed_t, torch_dtype(dtype))  # (1|B, H, Nq, Nk)
            return mask.expand(B, H, Nq, Nk).reshape(B * H, Nq, Nk)  # (B*H, Nq, Nk), index b*H + h, a copy

        return attn_mask

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        """Autograd through the module itself; its parameters' gradients are a state dict."""
        # Eval mode means no dropout; with grad enabled torch takes its differentiable (non-fused) path.
        module = loaded_torch_mha(cfg, params, dtype, device, self.batch_first)
        query, key, value = (
            leaf(self._layout(to_tensor(x, dtype, device))) for x in (inputs.query, inputs.key, inputs.value)
        )
        attn_mask = self._attn_mask(cfg, inputs, dtype, device)
        rel_bias = leaf(optional_tensor(params.rel_bias, dtype, device))  # T5's table, through the float mask
        parameters = dict(module.named_parameters())
        leaves = {"d_x_q": query, "d_x_k": key, "d_x_v": value, **parameters, "rel_bias": rel_bias}

        def forward():
            return module(query, key, value, attn_mask=attn_mask(rel_bias), need_weights=False)[0]

        def to_canonical(grads: dict) -> dict:
            rows = {slot: grads.pop(slot) for slot in INPUT_SLOTS}
            table = {"rel_bias": grads.pop("rel_bias")} if "rel_bias" in grads else {}  # (buckets, H), canonical
            # The module's state dict has no T5 table (it rides in the mask): convert under the same layer without it.
            module_cfg = dataclasses.replace(cfg, rel_buckets=None)
            canonical = from_torch_mha_state_dict(module_cfg, grads).as_dict()  # packed in_proj_weight -> w_q, w_k, w_v
            inputs_grads = {slot: g if self.batch_first else g.transpose(1, 0, 2) for slot, g in rows.items()}
            canonical = {name: g for name, g in canonical.items() if g is not None}
            return {**inputs_grads, **canonical, **table}  # inputs (B, N, F)

        info = {"batch_first": self.batch_first, "parameters": ", ".join(parameters)}
        d_output = self._layout(to_tensor(cotangent, dtype, device))
        return autograd_prepared(forward, leaves, d_output, to_canonical, device, self.allow_tf32, info)


class TorchMHASeqFirstOracle(TorchMHAOracle):
    """``torch-mha-seqfirst``: `TorchMHAOracle` with nn.MultiheadAttention's default layout, (N, B, E)."""

    gap_causes: ClassVar[dict[str, str]] = {
        "forward": "sequence first, nn.MultiheadAttention takes its SDPA path: the packed in-projection's q, k and v "
        "are copied apart (an `aten::copy_` of (3, N, B, E), 12 MiB at the reference size, 1.4-1.5 ms), and the "
        "fused kernel reads each head's tokens B*E floats apart (8 KiB, against 2 KiB batch first): 15.4 ms "
        "against 13.8-14.1 for the same kernel on batch-first heads (torch 2.13's profiler and wall clock, one "
        "thread; about 3 ms of the gap, whose rounds spread most: 39.0-43.4 ms in one run; issue 43)",
    }

    def __init__(self, name: str | None = None, batch_first: bool = False, allow_tf32: bool = False) -> None:
        super().__init__(name, batch_first, allow_tf32)


class TorchSDPAOracle(VariantReasons, TorchDevices, Backend):
    """``F.scaled_dot_product_attention`` on heads projected with ``F.linear``.

    Projections, head split and merge are in the timed region, as in a model. The mask is
    boolean with True = may attend (the spec's polarity); a causal configuration without
    a user mask uses ``is_causal=True``, which torch aligns top-left (query i sees keys
    j <= i), the spec's alignment. GQA uses ``enable_gqa=True`` (query head h reads kv
    head h // G). The scores and weights live inside the fused kernel and are not exposed.
    Rotary embeddings are applied to the heads before the call, as Hugging Face's Llama
    does around SDPA (``apply_rotary_pos_emb``, then the kernel): the kernel itself is the
    third-party part being compared.
    """

    convention = "F.scaled_dot_product_attention on (B, H, N, d) heads; bool attn_mask True = may attend"
    gap_causes: ClassVar[dict[str, str]] = {
        "decode": "its cache grows by `torch.cat` of all of K and V every step; and CPU SDPA with `enable_gqa` re-reads "
        "K and V per query head (torch 2.13, 8k cached tokens, 16 heads over 4, d_k 128: 12.3 ms against 4.9 with "
        "the group folded into the query axis, as torch-best does; measured, issue 43)",
    }
    # QK-norm, the qkv bias and rope scaling happen in the oracle's own code before the kernel; the
    # window is in the mask; ALiBi and T5's bias ride in a float attn_mask.
    causal_on_positions = True  # its causal mask comes from the positions (base rule 7)
    # Rule 8 (`torch_decode`): its own growing cache, every variant its forward has, never is_causal.
    decode_caches = ("dynamic",)
    decode_layouts: ClassVar[dict[str, str]] = {"dynamic": SDPA_DECODE_LAYOUT}
    # The kernel has no hook between the product and the softmax, none in its softmax (and returns no log-sum-exp to
    # rescale by) and none after it: the registry's refusals say why, per variant.
    variant_why: ClassVar[dict[str, str]] = kernel_refusals("scaled_dot_product_attention")
    # The package's own variants but those (one registered from outside is not in the kernel, so it is refused).
    variants = BUILTIN_VARIANTS - variant_why.keys()
    known_differences = (
        "mask polarity: bool attn_mask True = may attend, like the spec (the opposite of nn.MultiheadAttention)",
        "is_causal=True is top-left aligned (query i sees keys j <= i), which matters when Nq != Nk",
        "a query that may attend to no key: zeros (so output b_o, like the spec) on torch 2.13 CPU; "
        "other kernels (GPU flash / memory-efficient) are not guaranteed to agree",
        "attn_mask and is_causal cannot be combined: a causal mask with a user mask is passed as one boolean mask",
        "scores and weights stay inside the fused kernel: only projections, heads, context, merged and output are stages",
        "no rotary embedding of its own: the heads are rotated before the call (our rotate_last_axis), as models do",
        "ALiBi and T5's relative bias: a float attn_mask (the bias where allowed, -inf where blocked) built by the "
        "adapter (torch ScoreBias) and rounded to the run's dtype; the kernel only adds it. A row whose float mask "
        "is all -inf is not the boolean mask's zero row (none of the check's bias cases has one)",
        "QK-norm is F.rms_norm in the oracle's own code before the kernel, as models write it",
        *SDPA_DECODE_DIFFERENCES,
    )

    def __init__(self, name: str | None = None, allow_tf32: bool = False) -> None:
        super().__init__(name)
        self.allow_tf32 = bool(allow_tf32)
        if not self.name:
            self.name = "torch-sdpa"

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if cfg.n_kv_heads != cfg.n_heads and not sdpa_has_enable_gqa():
            return "this torch's scaled_dot_product_attention has no enable_gqa (torch >= 2.5 has it)"
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        p = param_tensors(params, dtype, device)
        x_q, x_k, x_v = torch_inputs(inputs, dtype, device)  # (B, Nq, D), (B, Nk, kdim), (B, Nk, vdim)
        forward, attn_mask, use_is_causal = sdpa_pass(cfg, inputs, dtype, device)

        def run(rec: StageRecorder | None):
            return forward(p, x_q, x_k, x_v, rec)

        run = inference_run(run, device, self.allow_tf32)

        bool_mask = None if attn_mask is None else f"bool {tuple(attn_mask.shape)}, True = may attend"
        if bool_mask and cfg.causal and not causal_on_indices(inputs):
            bool_mask += " (causal bottom-right on these positions: is_causal=True would be top-left)"
        info = {
            "mask": "is_causal=True (top-left)"
            if use_is_causal
            else ("float: the score bias, -inf where blocked" if cfg.has_score_bias else bool_mask),
            "enable_gqa": cfg.n_kv_heads != cfg.n_heads,
            **precision_info(device=device, dtype=dtype, allow_tf32=self.allow_tf32),
        }
        return recorded_prepared(run, device, info)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
        return prepare_sdpa_decode_run(cfg, params, inputs, dtype, device, self.allow_tf32)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        return prepare_sdpa_decode_step(cfg, params, job, self.allow_tf32)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        """Autograd through ``F.linear`` projections and ``F.scaled_dot_product_attention``: the forward's pass."""
        p = {name: leaf(optional_tensor(a, dtype, device)) for name, a in params.as_dict().items()}
        x_q, x_k, x_v = (leaf(to_tensor(x, dtype, device)) for x in (inputs.query, inputs.key, inputs.value))
        forward, _, use_is_causal = sdpa_pass(cfg, inputs, dtype, device)
        leaves = {"d_x_q": x_q, "d_x_k": x_k, "d_x_v": x_v, **p}
        info = {"enable_gqa": cfg.n_kv_heads != cfg.n_heads, "is_causal": use_is_causal}
        d_output = to_tensor(cotangent, dtype, device)
        return autograd_prepared(
            lambda: forward(p, x_q, x_k, x_v), leaves, d_output, dict, device, self.allow_tf32, info
        )
