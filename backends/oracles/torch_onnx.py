"""The torch-onnx oracle: ``torch.onnx.ops.attention`` (torch's eager reading of ONNX ``Attention``), and the
graph ``torch.onnx.export`` makes of a torch attention layer, run by ONNX Runtime.

Two strategies:

* ``standard``: a model's code around the op (`torch_heads.projected_heads_pass`: ``F.linear``
  projections, QK-norm, the head split, rotary, the merge), the op called as an exporter
  would emit it: the same causal plan as the ``onnx`` backend (`onnx.adapter.op_plan`):
  ``is_causal`` when causality is the only rule, cached keys as ``past_key``/``past_value``
  when queries come after them, everything else in ``attn_mask``. Torch's eager op differs
  from the ONNX spec in two ways that the check finds and names (`onnx.known`): it caps
  after the mask (``softcap_after_mask``) and its causal rule ignores the past length
  (``causal_past_top_left``). Its scale is applied in the tensors' dtype: no float32 square
  root (float64 agrees with the spec).
* ``export``: the same layer with ``F.scaled_dot_product_attention`` as its kernel, exported by
  ``torch.onnx.export(..., dynamo=True)`` (which needs onnxscript) to an ONNX model, run by ONNX
  Runtime on the CPU with the session threads pinned. The exporter decomposes SDPA into
  primitive ops (MatMul, Softmax, ...); only the output is a stage.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams

from .._recording import StageRecorder, record_stages
from ..base import Backend, Prepared, StageTensor, tensor_to_numpy
from ..onnx.adapter import ONNX_VARIANTS, op_refusal
from ..onnx.known import KNOWN, OP_ATTRIBUTES, known_answer, op_attributes
from ..onnx.runtime import make_runner, op_plan
from ..torch.common import param_tensors, torch_dtype, torch_inputs
from .torch_heads import projected_heads_pass

EXPORT = "export"


class TorchOnnxOracle(Backend):
    """``torch.onnx.ops.attention`` between projections written in torch; or torch.onnx.export's graph in ORT."""

    convention = (
        "torch.onnx.ops.attention(Q, K, V, attn_mask, past_key, past_value, is_causal=, scale=, "
        f"{', '.join(f'{attribute}=' for attribute in OP_ATTRIBUTES.values())}) on (B, H, N, d) heads from F.linear "
        "projections; strategy 'export': torch.onnx.export(dynamo=True) of the layer around "
        "F.scaled_dot_product_attention, run by ONNX Runtime"
    )
    strategies = ("standard", EXPORT)
    dtypes = ("float32", "float64")
    variants = ONNX_VARIANTS
    strategy_variants: ClassVar[dict[str, frozenset[str]]] = {EXPORT: frozenset()}
    causal_on_positions = True
    decode_unsupported = (
        "torch.onnx.ops.attention's is_causal ignores the past length (top-left with past_key, a known difference "
        "the forward check finds on the causal_cache case), so stepping it through past_key would hide every "
        "cached key after the query's index"
    )
    known_differences = (
        *(KNOWN[name].line() for name in ("softcap_after_mask", "causal_past_top_left", "qk_mode_numbering")),
        KNOWN["export_scale_float32"].line(),
        "the scale is applied in the tensors' dtype (float64 agrees with the spec; ONNX Runtime's op does not)",
        KNOWN["empty_rows_zero"].line(),
        "export strategy: torch.onnx.export (dynamo) of the layer around F.scaled_dot_product_attention, run by "
        "ONNX Runtime; no variants; only the output is a stage",
    )

    def variant_reason(self, cfg: MHAConfig, strategy: str, backward: bool = False) -> str | None:
        if why := op_refusal(cfg):
            return f"{self.name}: torch.onnx.ops.attention follows the op: {why}"
        return super().variant_reason(cfg, strategy, backward)

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if device != "cpu":
            return f"{self.name}: no {device} device present on this machine for it (ONNX Runtime's CPU provider only)"
        if strategy == EXPORT and (cfg.rope is not None or cfg.causal or cfg.n_kv_heads != cfg.n_heads):
            return (
                f"{self.name}:export exports the plain layer (no rotary, no causal mask, no GQA): the exported "
                "program is traced once per case and those paths are the standard strategy's"
            )
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def known_answers(self, cfg: MHAConfig, params: MHAParams, args: tuple, stages: dict, info: dict) -> list:
        """The outputs of torch's two known departures from the ONNX spec on this case (`onnx.known`)."""
        if info.get("exported_ops"):
            return [known_answer("export_scale_float32", cfg, params, args, stages)]
        answers = []
        if KNOWN["softcap_after_mask"].shows_on(cfg):  # a case with the variant it concerns
            answers.append(known_answer("softcap_after_mask", cfg, params, args, stages))
        if info.get("past_key_tokens"):
            answers.append(known_answer("causal_past_top_left", cfg, params, args, stages))
        return answers

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        import torch

        p = param_tensors(params, dtype, device)
        x_q, x_k, x_v = torch_inputs(inputs, dtype, device)  # (B, Nq, D), (B, Nk, kdim), (B, Nk, vdim)
        if strategy == EXPORT:
            return _exported(cfg, inputs, dtype, p, (x_q, x_k, x_v))
        is_causal, past, mask = op_plan(cfg, params, inputs, dtype)
        attn_mask = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))

        def attend(p, q, k, v):  # (B, H, Nq, Dk), (B, Hkv, Nk, Dk), (B, Hkv, Nk, Dv) -> (B, H, Nq, Dv)
            past_k = past_v = None
            if past:  # cached keys as the op's past: (B, Hkv, P, d) and the new (B, Hkv, Nk - P, d), views
                past_k, k, past_v, v = k[:, :, :past], k[:, :, past:], v[:, :, :past], v[:, :, past:]
            return torch.onnx.ops.attention(
                q, k, v, attn_mask, past_k, past_v, is_causal=is_causal, scale=float(cfg.scale), **op_attributes(cfg)
            )[0]

        note = f"torch.onnx.ops.attention (is_causal={is_causal}, past_key tokens={past})"
        forward = projected_heads_pass(cfg, inputs, dtype, device, attend, note)

        def run(rec: StageRecorder | None):
            with torch.inference_mode():
                return forward(p, x_q, x_k, x_v, rec)

        info = {
            "is_causal": is_causal,
            "past_key_tokens": past,
            "attn_mask": None if mask is None else f"{mask.dtype} {tuple(mask.shape)}",
            "known_differences": list(self.known_differences),
        }
        return Prepared(lambda: run(None), tensor_to_numpy, lambda: record_stages(run), info=info)


def _exported(cfg: MHAConfig, inputs: MHAInputs, dtype: str, p: dict, xs: tuple) -> Prepared:
    """``torch.onnx.export(dynamo=True)`` of the layer around SDPA, run by ORT (threads pinned per session)."""
    import torch
    import torch.nn.functional as F

    def attend(p, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.scale)

    mask = None if inputs.mask is None else torch.from_numpy(np.ascontiguousarray(inputs.mask))
    forward = projected_heads_pass(cfg, inputs, dtype, "cpu", attend, "F.scaled_dot_product_attention")

    class Layer(torch.nn.Module):
        def forward(self, x_q, x_k, x_v):
            return forward(p, x_q, x_k, x_v)

    with warnings.catch_warnings():  # the exporter's deprecation chatter, not a result
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Layer(), xs, dynamo=True, verbose=False, optimize=True)
    model = program.model_proto
    runner = make_runner(model, reference=False)
    names = [value.name for value in model.graph.input]
    feeds = {name: np.ascontiguousarray(x.numpy()) for name, x in zip(names, xs, strict=False)}

    def forward_onnx():
        return runner(feeds)[0]

    def stages() -> dict[str, StageTensor]:
        return {"output": StageTensor(forward_onnx(), ("B", "Nq", "D"), "the exported graph's output (ORT)")}

    ops = sorted({node.op_type for node in model.graph.node})
    info = {
        "exported_ops": ops,
        "opset": next(o.version for o in model.opset_import if o.domain == ""),
        "dtype": str(torch_dtype(dtype)),
    }
    if dtype == "float64":  # the exporter stores the scale as a float32 constant (KNOWN["export_scale_float32"])
        info.update(tolerance_dtype="float32", known_difference="export_scale_float32")
    return Prepared(forward_onnx, lambda out: np.asarray(out, dtype=np.float64), stages, info=info)
