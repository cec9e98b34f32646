"""Backends ``onnx`` (ONNX Runtime, CPU) and ``onnx-reference`` (onnx's ReferenceEvaluator): one graph, two runtimes.

The graph is `graph.build`'s: the spec's layer exported around the standard ``Attention`` op
(opset 23 as the ``standard`` strategy, or ``opset=24``; the ``opset24`` strategy runs opset 24 where the
installed onnx has it, so the check covers both). Both backends are third-party runtimes of a standard op,
so they are oracles: where the op's convention differs from the spec, their raw answer is
passed through and the check names it from `known.KNOWN` (`known_answers`): nothing is mapped
in the adapter. The timed region is one ``InferenceSession.run`` (or ``ReferenceEvaluator.run``)
on NumPy feeds prepared outside it. ORT's thread pools are pinned per session through
``SessionOptions`` (`frameworks.onnx.session_options`), from the benchmark child's thread count.

Which causal rule the op gets (its ``is_causal`` is ``j <= i + past``, on indices):

* causality alone, the positions the indices: ``is_causal=1``;
* causality alone, queries after cached keys (positions ``P..`` over keys ``0..``, a decode step
  written as one forward): the first ``P`` keys go in as ``past_key``/``past_value`` (sliced in
  the graph) and ``is_causal=1``, the op's own offset;
* anything else (padding, a window, other positions, ALiBi/T5 bias): all in ``attn_mask``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from mha_rosetta.core import STAGE_BY_NAME, MHAConfig, MHAInputs, MHAParams
from mha_rosetta.core.rotary import rotary_tables
from mha_rosetta.core.variants import VARIANT_REGISTRY, kernel_refusal, kernel_refusals

from ..base import Backend, Prepared, StageTensor, UnsupportedCase
from ..decoding import DecodeStep
from .decode import prepare_decode_run, prepare_decode_step
from .graph import ONNX_DTYPES, GraphSpec, build, full_tables, opsets
from .known import HIDDEN_NOTE, KNOWN, OP_ATTRIBUTES, OP_VARIANTS, known_answer, qk_modes
from .runtime import make_runner, op_plan

# What the op takes (`known.OP_VARIANTS`), and QK-norm at every place the registry has one (`NormStep`): RMSNorm
# nodes where the entry's step says, with its weights (`graph.build`, `oracles.torch_heads`).
ONNX_VARIANTS = frozenset(OP_VARIANTS) | frozenset(
    name for name, entry in VARIANT_REGISTRY.items() if entry.norm_step is not None
)
# This backend's graph also applies the output gate (`graph.build`: MatMul, Sigmoid and Mul after the Attention
# node); torch-onnx's layers around the op (which share ONNX_VARIANTS) do not.
ONNX_GRAPH_VARIANTS = ONNX_VARIANTS | {"gate"}
OPSET24 = "opset24"  # the strategy that builds the same graph at opset 24
OP = "the ONNX Attention op"  # as its refusals name it
# The registry's refusals of the variants a kernel takes only through a hook that neither the op's attributes
# (`known.OP_ATTRIBUTES`) nor this graph (the gate) give: each refused with its reason (`op_refusal`).
OP_REFUSALS = tuple(kernel_refusals(OP, ONNX_GRAPH_VARIANTS).values())


def op_refusal(cfg: MHAConfig) -> str | None:
    """Why the Attention op cannot take a variant ``cfg`` switches on (`OP_REFUSALS`), or None."""
    return kernel_refusal(cfg, OP, ONNX_GRAPH_VARIANTS)


class OnnxBackend(Backend):
    """The spec's layer as an ONNX graph around ``Attention``, run by ONNX Runtime on the CPU."""

    name = "onnx"
    reference = False  # True: onnx.reference.ReferenceEvaluator runs the graph instead of ORT
    convention = (
        "an ONNX graph: MatMul+Add projections (weights (in, out)), Reshape+Transpose to (B, H, N, d), the standard "
        f"Attention op (opset 23/24; scale, is_causal, {', '.join(OP_ATTRIBUTES.values())} attributes; "
        "bool attn_mask True = attend; past_key/present_key cache), run by ONNX Runtime"
    )
    dtypes = ONNX_DTYPES
    variants = ONNX_GRAPH_VARIANTS
    causal_on_positions = True  # is_causal only where the op's rule equals the positions' (see attention_plan)
    decode_caches = ("past_key",)
    decode_variants = ONNX_GRAPH_VARIANTS
    decode_layouts: ClassVar[dict[str, str]] = {"past_key": "(B, Hkv, T, Dk): past_key in, present_key out"}
    known_differences = (
        *(
            KNOWN[name].line()
            for name in ("sqrt_scale", "causal_past_top_left", "empty_rows_zero", "qk_mode_numbering")
        ),
        "float16/bfloat16 are not run: this backend builds float32 and float64 graphs",
        *(f"{why} (refused)" for why in OP_REFUSALS),
        HIDDEN_NOTE,
    )

    strategies = ("standard", OPSET24)

    def __init__(self, name: str | None = None, opset: int = 23, fold_scale: bool = False) -> None:
        super().__init__(name)
        self.opset, self.fold_scale = int(opset), bool(fold_scale)
        # Where no run's info is at hand (diagnose's probes, a test), a float64 run is held to float32's level:
        # the op takes sqrt(scale) in float32 (known.KNOWN["sqrt_scale"]: about 1e-7 in a float64 graph, measured),
        # unless the scale is folded into Q. The check names the exact known answer instead (known_answers).
        self.tolerance_levels = {} if self.fold_scale else {"float64": "float32"}

    def variant_reason(self, cfg: MHAConfig, strategy: str, backward: bool = False) -> str | None:
        if why := op_refusal(cfg):  # the variants of the spec the op cannot take, with their reason
            return f"{self.name}: {why}"
        return super().variant_reason(cfg, strategy, backward)

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        opset = self._opset(strategy)
        if opset not in opsets():
            return f"{self.name}: the installed onnx has no Attention op at opset {opset} (it has {opsets()})"
        if dtype not in ONNX_DTYPES:
            return f"{self.name} builds float32 and float64 graphs only, not {dtype}"
        if device != "cpu":
            return (
                f"{self.name}: no {device} device present on this machine for it: it runs ONNX Runtime's CPU "
                "provider (no CUDA build installed; docs/onnx.md)"
            )
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def known_answers(self, cfg: MHAConfig, params: MHAParams, args: tuple, stages: dict, info: dict) -> list:
        """The outputs the op's known differences give on this case (`known.known_answer`), for the check."""
        return [] if info.get("fold_scale") else [known_answer("sqrt_scale", cfg, params, args, stages)]

    def _graph(self, cfg: MHAConfig, dtype: str, **switches):
        return GraphSpec(cfg, dtype, fold_scale=self.fold_scale, rope=cfg.rope is not None, **switches)

    def _opset(self, strategy: str) -> int:
        return 24 if strategy == OPSET24 else self.opset

    def _feeds(self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, mask) -> dict:
        feeds = {"x_q": inputs.query.astype(dtype), "x_k": inputs.key.astype(dtype), "x_v": inputs.value.astype(dtype)}
        if mask is not None:
            feeds["attn_mask"] = mask
        tables = rotary_tables(cfg, inputs)
        if tables is not None:
            for which, cos, sin in (("q", tables.q_cos, tables.q_sin), ("k", tables.k_cos, tables.k_sin)):
                full_cos, full_sin = full_tables(cfg.rope, cfg.d_k, cos, sin)  # (1|B, 1, N, Dk)
                feeds[f"{which}_cos"], feeds[f"{which}_sin"] = full_cos.astype(dtype), full_sin.astype(dtype)
        return feeds

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        is_causal, past, mask = op_plan(cfg, params, inputs, dtype)
        kind = None if mask is None else ("bool" if mask.dtype == np.bool_ else "float")
        spec = self._graph(cfg, dtype, opset=self._opset(strategy), is_causal=is_causal, mask=kind, past_split=past)
        model, _ = build(spec, params)  # the weights cast to the graph dtype as initializers
        run = make_runner(model, self.reference)
        modes = qk_modes(cfg, is_causal or mask is not None, self.reference)
        stage_model, names = build(dataclasses.replace(spec, stages=True, qk_modes=modes), params)
        feeds = self._feeds(cfg, params, inputs, dtype, mask)

        def forward():
            return run(feeds, ["output"])[0]

        def native_stages() -> dict[str, StageTensor]:
            runner = make_runner(stage_model, self.reference)
            values = dict(zip(names, runner(feeds, list(names.values())), strict=True))
            if "masked_scores" in values:  # ORT fills blocked logits with the lowest finite float (measured, 1.32)
                masked = values["masked_scores"]
                values["masked_scores"] = np.where(masked <= np.finfo(masked.dtype).min, -np.inf, masked)
            shown = {
                name: StageTensor(values[name], STAGE_BY_NAME[name].shape, self._note(name, spec)) for name in names
            }
            return shown  # every graph output is in the canonical layout already

        info = {
            "runtime": "onnx.reference.ReferenceEvaluator" if self.reference else "onnxruntime CPUExecutionProvider",
            "opset": spec.opset,
            "is_causal": is_causal,
            "past_key_tokens": past,
            "attn_mask": None if mask is None else f"{mask.dtype} {tuple(mask.shape)}",
            "fold_scale": self.fold_scale,
            "stages_hidden": [
                name for name in ("scores", "capped_scores", "biased_scores", "masked_scores") if name not in names
            ],
            "stages_note": HIDDEN_NOTE,
            "known_differences": list(self.known_differences),
        }
        return Prepared(forward, lambda output: np.asarray(output, dtype=np.float64), native_stages, info=info)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        raise UnsupportedCase(
            f"{self.name} has no backward pass: an inference session computes no gradients (ONNX Runtime's training "
            "graphs and onnx's gradient ops are not part of this backend)"
        )

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
        return prepare_decode_run(self, cfg, params, inputs, dtype)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        return prepare_decode_step(self, cfg, params, job)

    @staticmethod
    def _note(name: str, spec: GraphSpec) -> str:
        if name == "masked_scores":
            return "qk_matmul_output_mode=2 of a node of its own; ORT's lowest finite float for blocked shown as -inf"
        if name in ("scores", "capped_scores", "weights"):
            return "the qk_matmul_output of an Attention node of its own (qk_matmul_output_mode, the spec's numbering)"
        if name == "context":
            return f"the Attention node's Y (is_causal={int(spec.is_causal)}, past_key tokens={spec.past_split})"
        return "a graph output of the exported graph"


class OnnxReferenceBackend(OnnxBackend):
    """The same graph run by onnx's ReferenceEvaluator (Python/NumPy, the spec's executable reading)."""

    name = "onnx-reference"
    reference = True
    convention = OnnxBackend.convention.replace("run by ONNX Runtime", "run by onnx.reference.ReferenceEvaluator")
