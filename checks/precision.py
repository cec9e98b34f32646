"""What float32 really computes on a device: the TF32 table and the GPU questions a first run must answer.

`tf32_table` runs every float32 matmul-precision setting the adapters offer and reports
its error against float64, twice: on one square product (``n``^3, default 1024^3) and
through the whole attention layer (the adapters, against the float64 oracle):

- torch with TF32 off and on (`backends.torch.common.matmul_precision`, cuBLAS and cuDNN switches);
- JAX at every name of ``jax.default_matmul_precision`` (`backends.frameworks.jax.MATMUL_PRECISIONS`),
  with the precision each name lowers to (`backends.frameworks.jax.LOWERED_PRECISION`).

On a CPU every row is plain float32 (TF32 does not exist there): errors of order 1e-5 on
the product, the same for every setting. On an NVIDIA GPU since Ampere, rows that allow
TF32 show errors of order 1e-2 on the product (10-bit mantissa, 1024-term sums).

`empty_row_answers` asks torch what its attention kernels return for a query row that may
attend to no key (NaN, zeros, or an average), on the given device; `sdpa_float32_error`
compares SDPA's float32 error with TF32 off against the plain float32 product's, which
shows whether SDPA's float32 kernels use tensor cores whatever ``allow_tf32`` says.

Command line (used by ``scripts/gpu-run``)::

    python -m mha_rosetta.checks.precision --device gpu --json tf32.json --markdown tf32.md
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import numpy as np

from mha_rosetta.core import MHAConfig, error_line, init_params, reference_mha

# "Through the full MHA": one layer at the reference width, small enough for a CPU test.
MHA_SIZE = {"batch": 2, "tokens": 256, "d_model": 512, "heads": 8}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _errors(result: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(max abs error, max abs error / max |exact|) of a result against its float64 value."""
    diff = float(np.max(np.abs(np.asarray(result, dtype=np.float64) - exact)))
    return diff, diff / float(np.max(np.abs(exact)))


def _row(library: str, version: str, setting: str, lowered: str, tf32: bool, device: str, gemm, exact, output, mha):
    """One table row: the setting, and the product's and the layer's errors against float64."""
    gemm_abs, gemm_rel = _errors(gemm, exact)
    mha_abs, mha_rel = _errors(output, mha[3])
    return {
        "library": library,
        "version": version,
        "setting": setting,
        "lowered": lowered,
        "tf32_allowed": tf32 and device == "gpu",
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


def _torch_rows(device: str, a: np.ndarray, b: np.ndarray, exact: np.ndarray, mha) -> list[dict]:
    import torch

    from mha_rosetta.backends.torch.adapter import TorchBackend
    from mha_rosetta.backends.torch.common import matmul_precision, tf32_switches, to_tensor

    cfg, params, x, _reference = mha
    ta, tb = to_tensor(a, "float32", device), to_tensor(b, "float32", device)
    rows = []
    for allow in (False, True):
        with matmul_precision(allow):
            switches = tf32_switches()
            product = (ta @ tb).double().cpu().numpy()
        output = TorchBackend(allow_tf32=allow).run(cfg, params, x, dtype="float32", device=device)
        lowered = f"{switches['api']}: matmul {switches['matmul']}, cudnn {switches['cudnn']}"
        rows.append(
            _row("torch", torch.__version__, f"allow_tf32={allow}", lowered, allow, device, product, exact, output, mha)
        )
    return rows


def _jax_rows(device: str, a: np.ndarray, b: np.ndarray, exact: np.ndarray, mha) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from mha_rosetta.backends.jax.adapter import JaxBackend
    from mha_rosetta.backends.jax.common import LOWERED_PRECISION, MATMUL_PRECISIONS, allows_tf32, jax_device

    cfg, params, x, _reference = mha
    target = jax_device(device)
    ja = jax.device_put(np.asarray(a, dtype=np.float32), target)
    jb = jax.device_put(np.asarray(b, dtype=np.float32), target)
    rows = []
    for name in MATMUL_PRECISIONS:
        with jax.default_matmul_precision(name):  # a tracing-time setting: jit inside it
            product = np.asarray(jax.jit(jnp.matmul)(ja, jb), dtype=np.float64)
        output = JaxBackend(matmul_precision=name).run(cfg, params, x, dtype="float32", device=device)
        setting, lowered = f"default_matmul_precision={name!r}", LOWERED_PRECISION[name]
        rows.append(
            _row("jax", jax.__version__, setting, lowered, allows_tf32(name), device, product, exact, output, mha)
        )
    return rows


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
    mha = _mha_problem(mha_size or MHA_SIZE)
    rows: list[dict] = []
    if _installed("torch"):
        rows += _torch_rows(device, a, b, exact, mha)
    if _installed("jax"):
        rows += _jax_rows(device, a, b, exact, mha)
    return rows


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


def empty_row_answers(device: str = "cpu") -> dict[str, str]:
    """What torch's attention returns on ``device`` for a query row that may attend to no key.

    float32, 4 tokens, query 0 fully masked. Each answer is "NaN", "zeros" (the spec's
    zero context), "mean of values" or "other"; a call that raises gives its error.
    """
    import torch
    import torch.nn.functional as F

    from mha_rosetta.backends.torch.common import torch_device

    target = torch_device(device)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=generator).to(target) for _ in range(3))  # (B, H, N, d)
    allowed = torch.ones(4, 4, dtype=torch.bool, device=target)
    allowed[0] = False  # query 0 may attend to nothing

    def classify(row: torch.Tensor, values: torch.Tensor) -> str:
        row = row.double().cpu()
        if torch.isnan(row).any():
            return "NaN"
        if torch.all(row == 0):
            return "zeros"
        if torch.allclose(row, values.double().cpu().mean(dim=0), atol=1e-5):
            return "mean of values"
        return f"other ({row.tolist()[:3]}...)"

    answers: dict[str, str] = {}
    calls = {
        "F.scaled_dot_product_attention(attn_mask)": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)[
            0, 0, 0
        ],
    }
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).to(target).eval()
    x = torch.randn(1, 4, 8, generator=generator).to(target)  # (B, N, E)
    for need_weights in (False, True):
        calls[f"nn.MultiheadAttention(need_weights={need_weights})"] = lambda need_weights=need_weights: mha(
            x, x, x, attn_mask=~allowed, need_weights=need_weights
        )[0][0, 0]
    for label, call in calls.items():
        try:
            with torch.no_grad():
                row = call()
            # SDPA's row 0 against the mean of v; nn.MHA's output row against its output bias alone
            # would need the layer's internals, so NaN/zeros/other is what it reports.
            answers[label] = classify(row, v[0, 0])
        except Exception as error:  # a kernel refusing the case is the answer
            answers[label] = f"raised {error_line(error)}"
    return answers


def sdpa_float32_error(device: str = "cpu", tokens: int = 1024, width: int = 64) -> dict[str, float]:
    """Max abs error against float64 of float32 SDPA and of the same attention by hand, TF32 off.

    If SDPA's error is far above the by-hand error (order 1e-3 against 1e-6), its float32
    kernels use tensor cores whatever ``allow_tf32`` says.
    """
    import torch
    import torch.nn.functional as F

    from mha_rosetta.backends.torch.common import matmul_precision, torch_device

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, tokens, width, generator=generator, dtype=torch.float64) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v)  # float64 on the CPU: the reference
    target = torch_device(device)
    q32, k32, v32 = (t.to(target, torch.float32) for t in (q, k, v))
    with matmul_precision(False), torch.no_grad():
        sdpa = F.scaled_dot_product_attention(q32, k32, v32).double().cpu()
        weights = torch.softmax(q32 @ k32.transpose(-1, -2) / width**0.5, dim=-1)  # (1, 8, N, N)
        by_hand = (weights @ v32).double().cpu()
    return {
        "sdpa_float32_max_abs": float((sdpa - exact).abs().max()),
        "by_hand_float32_max_abs": float((by_hand - exact).abs().max()),
    }


def gpu_questions(device: str) -> dict:
    """The answers a first GPU run must record (see the module docstring); torch only."""
    if not _installed("torch"):
        return {"skipped": "torch is not installed"}
    from mha_rosetta.backends.torch.common import tf32_switches

    return {
        "device": device,
        "empty_row": empty_row_answers(device),
        "sdpa_float32": sdpa_float32_error(device),
        "tf32_switches_after": tf32_switches(),
    }


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
