"""The ONNX ``Attention`` op's known differences, for the explainer (`explain.differences.onnx`).

The op is called bare by `backends.onnx.probe` (one node, float64) in ONNX Runtime, onnx's
ReferenceEvaluator and ``torch.onnx.ops.attention``; the table of differences and their sources is
`backends.onnx.known.KNOWN`, the one the check quotes. These functions hand both to the explainer, which
imports no adapter module; each imports the ONNX family only when called.
"""

from __future__ import annotations


def onnx_runtimes() -> tuple[tuple[str, ...], dict[str, str]]:
    """The runtimes the bare op is called in, and the label each is shown with."""
    from ..onnx.probe import RUNTIME_LABELS, RUNTIMES

    return RUNTIMES, RUNTIME_LABELS


def onnx_known_differences() -> dict:
    """name -> the known difference (its text and source), `backends.onnx.known.KNOWN`."""
    from ..onnx.known import KNOWN

    return KNOWN


def onnx_findings(runtime: str) -> dict[str, str]:
    """What ``runtime`` does for each known difference, measured live (raises `LibraryMissing` without it)."""
    from ..onnx.probe import findings

    return findings(runtime)
