"""A Llama attention ported to MLX the mlx-lm way, with mlx-lm's classic porting bug, for ``mha-rosetta diagnose``.

``Attention`` is written as ``mlx_lm/models/llama.py`` writes it: ``nn.Linear`` q/k/v/o projections
(weights ``(out, in)``), the heads split by ``reshape(B, L, H, -1).transpose(0, 2, 1, 3)``, ``nn.RoPE``,
``mx.fast.scaled_dot_product_attention``. The checkpoint is a Hugging Face Llama, whose rotary turns
halves (``rotate_half``): ``nn.RoPE(traditional=False)``. The port says ``traditional=True`` (interleaved
pairs, Meta's original layout). It runs, every shape is right, and it is wrong.

    mha-rosetta diagnose examples.my_mlx_attention:candidate --d-model 16 --heads 4 --rope half --dtypes float32

``candidate`` is the adapter the diagnosis calls: canonical parameters in, the module's output out
(MLX arrays: the diagnosis reads them through the framework layer). ``fixed_candidate`` has the right flag.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class Attention(nn.Module):
    def __init__(self, dims: int, n_heads: int, traditional: bool) -> None:
        super().__init__()
        self.n_heads, self.scale = n_heads, (dims // n_heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dims, dims) for _ in range(4))
        self.rope = nn.RoPE(dims // n_heads, traditional=traditional)

    def __call__(self, x, mask=None):
        B, L, _ = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, L, H*d)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)  # (B, H, L, d)
        keys = keys.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        queries, keys = self.rope(queries), self.rope(keys)
        output = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))  # (B, L, D)


def _adapter(traditional: bool):
    def run(params, query, key, value, mask):
        dims, heads = query.shape[-1], params.w_q.shape[0] // 4  # d_k 4 (the docstring's sizes)
        module = Attention(dims, heads, traditional)
        weights = []
        for name, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            weights.append((f"{proj}.weight", mx.array(getattr(params, f"w_{name}"), dtype=mx.float32)))  # (out, in)
            weights.append((f"{proj}.bias", mx.array(getattr(params, f"b_{name}"), dtype=mx.float32)))
        module.load_weights(weights)
        allowed = None if mask is None else mx.array(np.asarray(mask))  # bool, True = may attend (the spec's)
        return module(mx.array(query, dtype=mx.float32), allowed)  # self-attention: key and value are the query

    return run


candidate = _adapter(traditional=True)  # the bug: a Hugging Face checkpoint rotates halves
fixed_candidate = _adapter(traditional=False)
