"""A user's adapter for ``mha-rosetta check``: ``FusedAttention`` of my_attention.py as a `Backend`.

    mha-rosetta check --backend examples.my_backend:MyBackend
    mha-rosetta check --backend examples.my_backend:MyBuggyBackend

``MyBackend`` splits the fused projection the way its loader packs it and agrees with the
oracle on every case it can express; ``MyBuggyBackend`` is the per-head split of
``candidate`` in my_attention.py, which the check flags and ``mha-rosetta diagnose`` names.
Only public API is used: `Backend`, `Prepared`, `StageTensor`, `UnsupportedCase` and
`core.allowed_positions` (the user mask and the causal mask combined, True = may attend).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from examples.my_attention import FusedAttention
from mha_rosetta.backends import Backend, Prepared, StageTensor, UnsupportedCase
from mha_rosetta.core import allowed_positions

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32}


class MyBackend(Backend):
    name = "my-fused"
    convention = "a GPT-2-style fused nn.Linear(E, 3E) for q, k, v, then SDPA"
    dtypes = tuple(TORCH_DTYPES)
    split_per_head = False

    def unsupported_reason(self, cfg, dtype, device, strategy):
        if cfg.n_kv_heads != cfg.n_heads or cfg.d_k * cfg.n_heads != cfg.d_model or cfg.d_v != cfg.d_k:
            return "FusedAttention: q, k and v heads all d_model / heads wide, one kv head per query head"
        if cfg.kdim != cfg.d_model or cfg.vdim != cfg.d_model or not cfg.bias:
            return "FusedAttention: self-attention widths, with bias"
        if cfg.rope is not None or not math.isclose(cfg.scale, cfg.d_k**-0.5):
            return "FusedAttention: no rotary embedding, the default scale"
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        if not (inputs.key.shape == inputs.query.shape and np.array_equal(inputs.key, inputs.query)):
            raise UnsupportedCase("FusedAttention is self-attention only (one input)")
        module = FusedAttention(cfg.d_model, cfg.n_heads, self.split_per_head)
        module.load_canonical(params)
        module.to(TORCH_DTYPES[dtype])
        x = torch.from_numpy(inputs.query).to(TORCH_DTYPES[dtype])
        allowed = allowed_positions(cfg, inputs)  # None, or bool broadcastable to (B, H, Nq, Nk)
        mask = None if allowed is None else torch.from_numpy(allowed.copy())

        def forward():
            with torch.no_grad():
                return module(x, x, x, mask)

        return Prepared(
            forward=forward,
            to_numpy=lambda result: result.double().numpy(),
            native_stages=lambda: {"output": StageTensor(forward(), ("B", "Nq", "D"))},
        )


class MyBuggyBackend(MyBackend):
    name = "my-fused-buggy"
    split_per_head = True
