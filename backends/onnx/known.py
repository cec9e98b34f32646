"""What the ONNX ``Attention`` op does with the spec's variants, and its known differences with their answers.

The one place that knows the op's variants: which spec variant it takes and how (`OP_VARIANTS`), which
it carries in an attribute of its own (`OP_ATTRIBUTES`, `op_attributes`), and which stages its
``qk_matmul_output`` shows (`qk_modes`). The graph (`graph.build`), the backends (`adapter`,
``torch-onnx``), the probe (`probe`) and the explainer (`explain.differences.onnx`) read them here.

One table (`KNOWN`) says each difference once; the backends quote it in ``known_differences``,
the explainer prints it (`explain.differences.onnx`: each entry's ``topic`` makes its title, each
``advice`` its takeaway), and `known_answer` computes, in float64
NumPy from the oracle's own stage tensors, the output a library gives *because of* the
difference. The check (`checks.agreement`) compares a run that leaves the spec with these
answers: a run that lands on one within its dtype's tolerance is a known difference, named
with its source, and anything else stays a disagreement. Nothing passes silently.

Measured here (onnx 1.23, onnxruntime 1.32, torch 2.13, CPU, float64; `tests/test_onnx_known.py`
repeats each):

* ``sqrt_scale``: the op multiplies Q and K each by ``sqrt(scale)``, taken in float32 (the
  attribute is a float32) in ORT and in the ReferenceEvaluator, even in a float64 graph: the
  output equals the spec's with ``scale' = float32(sqrt(float32(scale)))**2`` to 2e-16 and is
  2.8e-8 (relative) from the exact one. ``torch.onnx.ops.attention`` computes it in float64.
* ``export_scale_float32``: ``torch.onnx.export`` stores SDPA's scale as a float32 constant
  (float64 output 1.3e-8 from the exact spec, 4e-16 from ``scale = float32(scale)``).
* ``softcap_after_mask``: the spec caps before the mask (onnx #7865, #7867); torch's
  ``torch.onnx.ops.attention`` caps after it, so a blocked logit becomes ``-softcap`` and keeps
  weight (0.37 max abs on a 3x5 case with softcap 2).
* ``causal_past_top_left``: with ``past_key``, ORT and the ReferenceEvaluator offset causality by
  the past length (bottom-right, the errata of onnx #8068); ``torch.onnx.ops.attention`` stays
  top-left on indices, so queries miss the keys after their own index.
* ``empty_rows_zero``: a query row with no allowed key gives 0 in ORT, the ReferenceEvaluator and
  ``torch.onnx.ops.attention`` (the spec's answer too); SDPA gives NaN, MLX's SDPA the mean of V.
* ``qk_mode_numbering``: modes 1 and 2 of ``qk_matmul_output_mode`` were swapped (onnx #7913).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, allowed_positions, prepare_inputs, reference_stages
from mha_rosetta.core.variants import softcap, variant

# The spec's variants the op takes, each by the registry entry's name, and where it goes (`graph.build` builds the
# graph around the op so; torch-onnx's layers around torch's op do the same). QK-norm, at every place the registry
# has one, is RMSNorm nodes before the op (`adapter.ONNX_VARIANTS` adds those entries from their `NormStep`).
OP_VARIANTS: dict[str, str] = {
    "window": "attn_mask (bool, on the positions)",
    "softcap": "the op's softcap attribute (applied before the mask: the spec's order)",
    "qkv_bias": "the projections' Add nodes",
    "alibi": "attn_mask (float: the bias where allowed, -inf where blocked)",
    "rel_bias": "attn_mask (float: T5's bias by bucket where allowed, -inf where blocked)",
    "rope_scaling": "the rotary tables fed to the graph (core.rotary's scaled frequencies)",
}
# The variants the op carries in an attribute of its own: registry entry -> the attribute (`op_attributes`).
OP_ATTRIBUTES: dict[str, str] = {"softcap": "softcap"}


def op_attributes(cfg: MHAConfig) -> dict[str, float]:
    """The op's attributes for the variants ``cfg`` switches on (`OP_ATTRIBUTES`), each the value of the entry's
    field (``{"softcap": 1.5}``); {} for none."""
    return {
        attribute: float(getattr(cfg, variant(name).fields[0]))
        for name, attribute in OP_ATTRIBUTES.items()
        if variant(name).is_on(cfg)
    }


# What the op's qk_matmul_output shows, and where a runtime departs from it (`KNOWN["qk_mode_numbering"]`).
HIDDEN_NOTE = (
    "the Attention node fuses the scores, the softcap, the mask and the softmax; its qk_matmul_output shows the "
    "scores (mode 0), the capped scores (1), the masked scores (2) and the weights (3), one more node each "
    "(onnx #7913 numbering), never the biased scores apart from the mask they ride in, and the "
    "ReferenceEvaluator's mode 0 returns the capped scores under a softcap, so onnx-reference shows no scores then"
)


def attribute_transform(scores: np.ndarray, attributes: dict) -> np.ndarray:
    """The spec's float64 formula of the op's variant attributes set in ``attributes`` (`OP_ATTRIBUTES`: the cap
    ``c * tanh(s / c)`` of its softcap), applied to ``scores``; the probe's readings of the op (`probe`)."""
    return softcap(scores, attributes["softcap"]) if "softcap" in attributes else scores


def qk_modes(cfg: MHAConfig, masked: bool, reference: bool) -> tuple[tuple[int, str], ...]:
    """The op's qk outputs that are spec stages of ``cfg``, as (qk_matmul_output_mode, stage), in the spec's
    numbering (onnx #7913); ``reference``: the ReferenceEvaluator, whose mode 0 returns the capped scores when a
    softcap is set (measured, onnx 1.23), so it shows no scores then."""
    capped = cfg.softcap is not None
    modes = [(3, "weights")]
    if not (reference and capped):
        modes.append((0, "scores"))
    if capped:
        modes.append((1, "capped_scores"))
    if masked:
        modes.append((2, "masked_scores"))
    return tuple(modes)


@dataclass(frozen=True)
class KnownDifference:
    """One known difference: its text and source; ``topic``: a few words for the explainer's title; ``advice``:
    what to do about it (the explainer's takeaway; differences with one answer share it); ``variant``: the registry
    entry it concerns (it shows only on a case that switches that on; "" for any case); ``of_op``: a property of
    the Attention op itself (probed bare: `probe.findings`), not of an exporter's graph; ``readings``: (the spec's,
    the other) as the probe names what a runtime does, where it tells two apart."""

    name: str
    text: str
    source: str
    topic: str = ""
    advice: str = ""
    variant: str = ""
    of_op: bool = True
    readings: tuple[str, str] = ("", "")

    def line(self) -> str:
        return f"{self.text} [source: {self.source}]"

    def shows_on(self, cfg: MHAConfig) -> bool:
        """Whether a case of ``cfg`` can show it: always, or where ``cfg`` switches its variant on."""
        return not self.variant or variant(self.variant).is_on(cfg)


# torch's eager op departs from the spec in two ways, with one answer.
TORCH_EAGER_ADVICE = (
    "do not trust torch.onnx.ops.attention's eager answer for softcap with a mask or for is_causal with past_key"
)

KNOWN = {
    known.name: known
    for known in (
        KnownDifference(
            "sqrt_scale",
            "the Attention op multiplies Q and K each by sqrt(scale), the square root taken in float32 (the scale "
            "attribute is a float32) even in a float64 graph: float64 outputs are ~3e-8 (relative) from the exact "
            "spec unless the scale is folded into Q",
            "ONNX Attention (opset 23/24) 'scale' attribute type; measured: onnxruntime 1.32 and onnx 1.23 "
            "ReferenceEvaluator, float64",
            topic="sqrt(scale)",
            readings=("exact scale", "float32 sqrt(scale)"),
            advice="fold the scale into Q for float64 graphs",
        ),
        KnownDifference(
            "export_scale_float32",
            "torch.onnx.export (dynamo) decomposes F.scaled_dot_product_attention into MatMul/Mul/Softmax (opset 20, "
            "no Attention op) with the scale stored as a float32 constant, even in a float64 graph: float64 outputs "
            "use float32(scale)",
            "measured: torch 2.13 torch.onnx.export(dynamo=True) with onnxscript 0.7, run by onnxruntime 1.32",
            of_op=False,  # shown by the check's torch-onnx:export runs
        ),
        KnownDifference(
            "softcap_after_mask",
            "torch.onnx.ops.attention applies the softcap after the mask (a blocked logit becomes -softcap and keeps "
            "weight); the spec applies it before the mask",
            "onnx #7865, #7867 (spec order: softcap, then mask); measured: torch 2.13 torch.onnx.ops.attention",
            topic="softcap order",
            readings=("softcap, then mask (the spec)", "mask, then softcap"),
            advice=TORCH_EAGER_ADVICE,
            variant="softcap",
        ),
        KnownDifference(
            "causal_past_top_left",
            "with past_key and is_causal=1, torch.onnx.ops.attention masks top-left on indices (j <= i), ignoring "
            "the past length; the op's spec, ONNX Runtime and the ReferenceEvaluator use j <= i + past",
            "onnx errata #8068 (offset-aware, bottom-right causal); measured: torch 2.13 torch.onnx.ops.attention",
            topic="causal offset",
            readings=("bottom-right (j <= i + past)", "top-left (j <= i)"),
            advice=TORCH_EAGER_ADVICE,
        ),
        KnownDifference(
            "empty_rows_zero",
            "a query row with no allowed key gives a zero row (as the spec); SDPA gives NaN, MLX SDPA the mean of V",
            "ONNX Attention spec (fully-masked-row guard); measured: onnxruntime 1.32, onnx 1.23, torch 2.13",
            topic="empty rows",
            readings=("zero row", "mean of V"),
        ),
        KnownDifference(
            "qk_mode_numbering",
            "qk_matmul_output_mode 1 and 2 were swapped: the spec and ONNX Runtime now read 1 = after the softcap, "
            "2 = after softcap and mask; torch.onnx.ops.attention still reads 1 = after the mask, 2 = mask then "
            "softcap; the ReferenceEvaluator's mode 0 returns the capped scores when a softcap is set",
            "onnx #7913; measured: onnxruntime 1.32, onnx 1.23 ReferenceEvaluator, torch 2.13",
            topic="qk output modes",
            advice="read qk_matmul_output modes from the runtime's own numbering",
        ),
    )
}


@dataclass(frozen=True)
class KnownAnswer:
    """The output a library gives because of one known difference, (B, Nq, D) float64."""

    known: KnownDifference
    output: np.ndarray


def float32_sqrt_scale(scale: float) -> float:
    """The scale the op really applies: ``float32(sqrt(float32(scale)))`` squared, in float64."""
    root = float(np.sqrt(np.float32(scale)))
    return root * root


# The scale each difference really applies, from the spec's (the cap and the bias follow the logits).
SCALE_APPLIED = {"sqrt_scale": float32_sqrt_scale, "export_scale_float32": lambda scale: float(np.float32(scale))}


def _output_from_logits(cfg: MHAConfig, params: MHAParams, stages: dict, logits: np.ndarray) -> np.ndarray:
    """Softmax (a row of -inf only: zeros, the op's guard), then the context, merge and output projection."""
    top = logits.max(axis=-1, keepdims=True)
    finite = np.isfinite(top)
    exp = np.exp(logits - np.where(finite, top, 0.0))  # (B, H, Nq, Nk); exp(-inf) = 0
    total = exp.sum(axis=-1, keepdims=True)
    weights = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
    group = cfg.n_heads // cfg.n_kv_heads
    values = np.repeat(stages["v_heads"], group, axis=1)  # (B, H, Nk, Dv), a copy: query head h reads h // G
    context = np.einsum("bhqk,bhkd->bqhd", weights, values)  # (B, Nq, H, Dv), new
    merged = context.reshape(*context.shape[:2], cfg.context_width)  # (B, Nq, H*Dv) view
    if "gate" in stages:  # the output gate (the graph's Sigmoid and Mul after the Attention node)
        merged = merged * stages["gate"]
    output = merged @ params.w_o.T
    return output + params.b_o if cfg.output_bias else output


def pre_mask_logits(stages: dict) -> np.ndarray:
    """The last score stage before the mask: the biased, else the capped, else the scaled scores (B, H, Nq, Nk)."""
    return next(stages[name] for name in ("biased_scores", "capped_scores", "scores") if name in stages)


def known_answer(name: str, cfg: MHAConfig, params: MHAParams, args: tuple, stages: dict) -> KnownAnswer:
    """The output of difference ``name`` on the case (``args``: query, key, value, mask, positions, kv_positions)."""
    inputs = prepare_inputs(cfg, *args)
    allowed = allowed_positions(cfg, inputs)
    full = stages["scores"].shape  # (B, H, Nq, Nk)
    allowed = np.ones(full, bool) if allowed is None else np.broadcast_to(allowed, full)
    if name in SCALE_APPLIED:  # the spec in float64 with the scale the library really applies
        changed = dataclasses.replace(cfg, scale=SCALE_APPLIED[name](cfg.scale))
        return KnownAnswer(KNOWN[name], reference_stages(changed, params, *args)["output"])
    if name == "softcap_after_mask":
        masked = np.where(allowed, stages["scores"], -np.inf)  # (B, H, Nq, Nk): scores + mask, then the cap
        logits = softcap(masked, cfg.softcap)  # a blocked -inf becomes -softcap
        return KnownAnswer(KNOWN[name], _output_from_logits(cfg, params, stages, logits))
    if name == "causal_past_top_left":
        other = allowed_positions(dataclasses.replace(cfg, causal=False), inputs)  # padding and window only
        top_left = np.tril(np.ones(full[-2:], bool))  # (Nq, Nk): j <= i on indices
        library = top_left if other is None else np.broadcast_to(other, full) & top_left
        logits = np.where(library, pre_mask_logits(stages), -np.inf)
        return KnownAnswer(KNOWN[name], _output_from_logits(cfg, params, stages, logits))
    raise ValueError(
        f"known difference {name!r} has no output answer (answers: {', '.join(SCALE_APPLIED)}, softcap_after_mask, "
        "causal_past_top_left)"
    )
