"""One process-wide switch for benchmarks: ``MHA_ROSETTA_TF32=1`` lets every float32 GPU product use TF32.

Comparisons keep TF32 off (see `torch.common` and `jax.common`). A benchmark of float32
with TF32 *on* must change every adapter at once, in fresh child processes that it does
not construct itself, so the request travels as an environment variable: set, every torch
adapter runs as if built with ``allow_tf32=True`` and every JAX adapter whose precision
would be full float32 lowers at "tensorfloat32" instead; ``Prepared.info`` and the GEMM peak
say so (``tf32_forced_by``). Unset (the default), nothing changes. Standard library only.
"""

from __future__ import annotations

import os

TF32_ENV = "MHA_ROSETTA_TF32"


def tf32_forced() -> bool:
    """True when ``MHA_ROSETTA_TF32`` asks for TF32 ("1", "true", "yes", "on"; anything else: no)."""
    return os.environ.get(TF32_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def forced_note() -> dict:
    """What `Prepared.info` adds when the switch is on (empty when off)."""
    return {"tf32_forced_by": f"{TF32_ENV}=1"} if tf32_forced() else {}
