"""ONNX's standard ``Attention`` op in three runtimes: each known difference, measured live and named with its source.

The op is called bare (`backends.onnx.probe`: one node, float64, B=1, H=2, d=4) in ONNX Runtime,
onnx's ReferenceEvaluator and torch's ``torch.onnx.ops.attention``; each row says which reading
each runtime follows. The table of differences and their sources is `backends.onnx.known.KNOWN`,
the same one the check quotes when it finds a difference in a run.
"""

from __future__ import annotations

from mha_rosetta.backends.demos import LibraryMissing, onnx_findings, onnx_known_differences, onnx_runtimes
from mha_rosetta.core import error_line

from ..seed_setup import Setup
from .calls import Difference

TITLE = "ONNX Attention (opset 23/24): sqrt(scale), softcap order, causal offset, empty rows, qk output modes"


def onnx_attention(setup: Setup) -> Difference:
    """Every entry of `KNOWN`, as each runtime does it (the setup's layer is not needed: the op is called bare)."""
    runtimes, labels = onnx_runtimes()
    measured: dict[str, dict[str, str]] = {}
    skipped = []
    for runtime in runtimes:
        try:
            measured[runtime] = onnx_findings(runtime)
        except LibraryMissing as missing:
            skipped.append(f"{labels[runtime]}: {missing.reason}")
        except Exception as error:  # a runtime refusing the call is itself the evidence
            skipped.append(f"{labels[runtime]}: raised {error_line(error)}")
    if not measured:
        return Difference("onnx_attention", TITLE, "skipped: " + "; ".join(skipped))
    rows = []
    for name, known in onnx_known_differences().items():
        if name == "export_scale_float32":
            continue  # a property of torch.onnx.export's graph, shown by the check's torch-onnx:export runs
        rows.append((f"{name}: {known.text}", f"source: {known.source}"))
        rows += [(f"  {labels[runtime]}", found[name]) for runtime, found in measured.items()]
    rows += [(f"  {line}", "skipped") for line in skipped]
    takeaway = (
        "fold the scale into Q for float64 graphs; do not trust torch.onnx.ops.attention's eager answer for softcap "
        "with a mask or for is_causal with past_key; read qk_matmul_output modes from the runtime's own numbering"
    )
    return Difference("onnx_attention", TITLE, "demonstrated", rows, takeaway)
