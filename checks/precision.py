"""What float32 really computes on a device: the TF32 table and the GPU questions a first run must answer.

`tf32_table` runs every float32 matmul-precision setting the adapters offer and reports
its error against float64, twice: on one square product (``n``^3, default 1024^3) and
through the whole attention layer (the adapters, against the float64 oracle). The settings
are run by the framework side, `backends.precision.precision_runs` (this module imports no
framework):

- torch with TF32 off and on (`backends.torch.common.matmul_precision`, cuBLAS and cuDNN switches);
- JAX at every name of ``jax.default_matmul_precision`` (`backends.jax.common.MATMUL_PRECISIONS`),
  with the precision each name lowers to (`backends.jax.common.LOWERED_PRECISION`).

On a CPU every row is plain float32 (TF32 does not exist there): errors of order 1e-5 on
the product, the same for every setting. On an NVIDIA GPU since Ampere, rows that allow
TF32 show errors of order 1e-2 on the product (10-bit mantissa, 1024-term sums).

`empty_row_answers` (`backends.precision`) asks torch what its attention kernels return for a
query row that may attend to no key (NaN, zeros, or an average), on the given device; `sdpa_float32_error`
compares SDPA's float32 error with TF32 off against the plain float32 product's, which
shows whether SDPA's float32 kernels use tensor cores whatever ``allow_tf32`` says.

Command line (used by ``scripts/gpu-run``)::

    python -m mha_rosetta.checks.precision --device gpu --json tf32.json --markdown tf32.md
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from mha_rosetta.backends.precision import (  # the framework side: torch and JAX imported when called
    PrecisionRun,
    empty_row_answers,
    gpu_questions,
    precision_runs,
    sdpa_float32_error,
)
from mha_rosetta.core import MHAConfig, init_params, reference_mha

__all__ = [
    "MHA_SIZE",
    "empty_row_answers",
    "gpu_questions",
    "main",
    "sdpa_float32_error",
    "tf32_markdown",
    "tf32_table",
]

# "Through the full MHA": one layer at the reference width, small enough for a CPU test.
MHA_SIZE = {"batch": 2, "tokens": 256, "d_model": 512, "heads": 8}


def _errors(result: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(max abs error, max abs error / max |exact|) of a result against its float64 value."""
    diff = float(np.max(np.abs(np.asarray(result, dtype=np.float64) - exact)))
    return diff, diff / float(np.max(np.abs(exact)))


def _row(run: PrecisionRun, device: str, exact: np.ndarray, reference: np.ndarray) -> dict:
    """One table row: the setting, and the product's and the layer's errors against float64."""
    gemm_abs, gemm_rel = _errors(run.product, exact)
    mha_abs, mha_rel = _errors(run.output, reference)
    return {
        "library": run.library,
        "version": run.version,
        "setting": run.setting,
        "lowered": run.lowered,
        "tf32_allowed": run.tf32 and device == "gpu",
        "device": device,
        "gemm_max_abs": gemm_abs,
        "gemm_max_rel": gemm_rel,
        "mha_max_abs": mha_abs,
        "mha_max_rel": mha_rel,
    }


def _mha_problem(size: dict):
    cfg = MHAConfig(d_model=size["d_model"], n_heads=size["heads"])
    params = init_params(cfg, seed=0)
    x = np.random.default_rng(1).standard_normal((size["batch"], size["tokens"], size["d_model"]))
    return cfg, params, x, reference_mha(cfg, params, x)


def tf32_table(device: str = "cpu", n: int = 1024, mha_size: dict | None = None) -> list[dict]:
    """One row per (library, float32 precision setting) on ``device``: errors against float64.

    The product is (n, n) @ (n, n) of standard normal entries, rounded to float32 first,
    so every row starts from the same float32 numbers; ``gemm_max_rel`` divides by the
    largest exact entry. The MHA errors are the adapters' outputs against the float64 oracle.
    Libraries that are not installed give no rows; a library without the device raises.
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(np.float32)  # (n, n): float32 values, held exactly in float64
    b = rng.standard_normal((n, n)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)  # (n, n) float64 reference of the same inputs
    cfg, params, x, reference = _mha_problem(mha_size or MHA_SIZE)
    return [_row(run, device, exact, reference) for run in precision_runs(device, a, b, cfg, params, x)]


def tf32_markdown(rows: list[dict], n: int = 1024) -> str:
    lines = [
        f"| library | setting | lowered to | TF32 allowed | device | {n}^3 product max abs err | rel | MHA max abs err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['library']} {row['version']} | `{row['setting']}` | {row['lowered']} | "
            f"{'yes' if row['tf32_allowed'] else 'no'} | {row['device']} | {row['gemm_max_abs']:.2e} | "
            f"{row['gemm_max_rel']:.1e} | {row['mha_max_abs']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mha_rosetta.checks.precision", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--n", type=int, default=1024, help="size of the square product (default 1024)")
    parser.add_argument("--json", metavar="PATH", help="write rows and answers as JSON ('-' for stdout)")
    parser.add_argument("--markdown", metavar="PATH", help="write the TF32 table as Markdown")
    args = parser.parse_args(argv)
    from mha_rosetta.core.files import write_output

    rows = tf32_table(args.device, args.n)
    table = tf32_markdown(rows, args.n)
    answers = gpu_questions(args.device)
    out = sys.stderr if args.json == "-" else sys.stdout
    out.write(table + "\n" + json.dumps(answers, indent=2) + "\n")
    if args.json:
        write_output(args.json, json.dumps({"tf32_table": rows, "questions": answers}, indent=2) + "\n")
    if args.markdown:
        write_output(args.markdown, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
