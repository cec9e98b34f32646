"""A user's attention layer with a real porting bug, for ``mha-rosetta diagnose``.

``FusedAttention`` holds q, k and v in one ``nn.Linear(E, 3E)``, like GPT-2's ``c_attn``;
``load_canonical`` fills it the GPT-2 / ``in_proj_weight`` way, as blocks [W_q; W_k; W_v].
Its forward pass splits the fused projection the GPT-NeoX way, per head
[q_0, k_0, v_0, q_1, ...]: a module written for one checkpoint layout, loaded with the
other. It runs, has every shape right, and is wrong.

    mha-rosetta diagnose examples.my_attention:candidate --d-model 12 --heads 3

``candidate`` is the adapter the diagnosis calls: canonical parameters in, the module's
output out. ``fixed_candidate`` is the same module with the split made to match the loader.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

D_MODEL, HEADS = 12, 3


class FusedAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, split_per_head: bool = True) -> None:
        super().__init__()
        self.heads, self.split_per_head = heads, split_per_head
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=torch.float64)
        self.out = nn.Linear(d_model, d_model, dtype=torch.float64)

    def load_canonical(self, params) -> None:
        """Canonical (out, in) weights are nn.Linear's layout: stack q, k, v as blocks."""
        with torch.no_grad():
            self.qkv.weight.copy_(torch.from_numpy(np.concatenate([params.w_q, params.w_k, params.w_v])))
            self.qkv.bias.copy_(torch.from_numpy(np.concatenate([params.b_q, params.b_k, params.b_v])))
            self.out.weight.copy_(torch.from_numpy(params.w_o))
            self.out.bias.copy_(torch.from_numpy(params.b_o))

    def forward(self, query, key, value, mask=None):
        B, N, E = query.shape
        H, d = self.heads, E // self.heads
        if self.split_per_head:  # GPT-NeoX: (B, N, H, 3*d), q, k, v per head
            fused = self.qkv(query).view(B, N, H, 3 * d).transpose(1, 2)  # (B, H, N, 3d) view
            q, k, v = fused.split(d, dim=-1)  # (B, H, N, d) each
        else:  # GPT-2: (B, N, 3E), q, k, v as blocks
            q, k, v = (t.view(B, N, H, d).transpose(1, 2) for t in self.qkv(query).split(E, dim=-1))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, N, d)
        return self.out(context.transpose(1, 2).reshape(B, N, E))  # (B, N, E)


def _adapter(split_per_head: bool):
    module = FusedAttention(D_MODEL, HEADS, split_per_head)

    def run(params, query, key, value, mask):
        module.load_canonical(params)
        with torch.no_grad():
            as_tensor = torch.from_numpy
            return module(as_tensor(query), as_tensor(key), as_tensor(value), None if mask is None else as_tensor(mask))

    return run


candidate = _adapter(split_per_head=True)
fixed_candidate = _adapter(split_per_head=False)
