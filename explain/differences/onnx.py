"""ONNX's standard ``Attention`` op in three runtimes: each known difference, measured live and named with its source.

The op is called bare (`backends.onnx.probe`: one node, float64, B=1, H=2, d=4) in ONNX Runtime,
onnx's ReferenceEvaluator and torch's ``torch.onnx.ops.attention``; each row says which reading
each runtime follows. The table of differences and their sources is `backends.onnx.known.KNOWN`,
the same one the check quotes when it finds a difference in a run; its entries' topics make the title and
their advice the takeaway.
"""

from __future__ import annotations

from mha_rosetta.backends.demos import LibraryMissing, onnx_findings, onnx_known_differences, onnx_runtimes
from mha_rosetta.core import error_line

from ..seed_setup import Setup
from .calls import Difference


def onnx_attention(setup: Setup) -> Difference:
    """Every entry of `KNOWN` that is the op's, as each runtime does it (the setup's layer is not needed: the op is
    called bare); an exporter's entries are shown by the check's torch-onnx:export runs."""
    runtimes, labels = onnx_runtimes()
    of_op = [(name, known) for name, known in onnx_known_differences().items() if known.of_op]
    title = f"ONNX Attention (opset 23/24): {', '.join(known.topic for _, known in of_op)}"
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
        return Difference("onnx_attention", title, "skipped: " + "; ".join(skipped))
    rows = []
    for name, known in of_op:
        rows.append((f"{name}: {known.text}", f"source: {known.source}"))
        rows += [(f"  {labels[runtime]}", found[name]) for runtime, found in measured.items()]
    rows += [(f"  {line}", "skipped") for line in skipped]
    takeaway = "; ".join(dict.fromkeys(known.advice for _, known in of_op if known.advice))  # shared advice once
    return Difference("onnx_attention", title, "demonstrated", rows, takeaway)
