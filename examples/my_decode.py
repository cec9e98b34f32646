"""A user's KV-cache decode loop in torch with a real porting bug, for ``mha-rosetta diagnose --decode``.

``StaticDecoder`` keeps Hugging Face's static cache layout, (B, Hkv, T, D) preallocated with a write index,
keys cached after rotary (rotate_half) and before the GQA repeat. Its step builds the causal mask the way
``is_causal=True`` does, ``tril(ones(q_len, kv_len))``, when a step has more than one query: top-left, where
a step's queries sit at the end of the cache and need bottom-right. A single-token step passes no causal
mask and is right; a prefill is right (q_len == kv_len); a step of two tokens is wrong.

    mha-rosetta diagnose --decode examples.my_decode:candidate --d-model 16 --heads 4 --kv-heads 2 --rope half

``candidate`` is the adapter the diagnosis calls: ``(params, x, prefill, step, mask, positions) -> (B, N, D)``.
``fixed_candidate`` is the same loop with the mask on positions (key j visible iff p_j <= p_i).
"""

from __future__ import annotations

import numpy as np
import torch

D_MODEL, HEADS, KV_HEADS, ROPE_BASE = 16, 4, 2, 10000.0


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class StaticDecoder:
    def __init__(self, params, batch: int, capacity: int, top_left: bool) -> None:
        t = {
            name: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float64))
            for name, a in params.as_dict().items()
        }
        self.t, self.top_left = t, top_left
        self.d_k = D_MODEL // HEADS
        self.k_cache = torch.zeros(batch, KV_HEADS, capacity, self.d_k, dtype=torch.float64)  # (B, Hkv, T, D)
        self.v_cache = torch.zeros(batch, KV_HEADS, capacity, self.d_k, dtype=torch.float64)
        self.pos_cache = torch.zeros(batch, capacity, dtype=torch.long)
        self.valid_cache = torch.zeros(batch, capacity, dtype=torch.bool)
        self.write = 0
        self.inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, self.d_k, 2, dtype=torch.float64) / self.d_k)

    def _rope(self, x, positions):  # x (B, h, s, D), positions (B, s)
        freqs = positions[..., None].to(torch.float64) * self.inv_freq  # (B, s, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, s, D)
        return x * emb.cos() + rotate_half(x) * emb.sin()

    def forward(self, x, positions, valid):  # x (B, s, E), positions (B, s), valid (B, s)
        t, B, s = self.t, x.shape[0], x.shape[1]
        q = (x @ t["w_q"].T + t["b_q"]).view(B, s, HEADS, self.d_k).transpose(1, 2)
        k = (x @ t["w_k"].T + t["b_k"]).view(B, s, KV_HEADS, self.d_k).transpose(1, 2)
        v = (x @ t["w_v"].T + t["b_v"]).view(B, s, KV_HEADS, self.d_k).transpose(1, 2)
        q, k = self._rope(q, positions), self._rope(k, positions)
        end = self.write + s
        self.k_cache[:, :, self.write : end], self.v_cache[:, :, self.write : end] = k, v
        self.pos_cache[:, self.write : end], self.valid_cache[:, self.write : end] = positions, valid
        self.write = end
        keys = self.k_cache[:, :, :end].repeat_interleave(HEADS // KV_HEADS, dim=1)  # (B, H, T, D)
        values = self.v_cache[:, :, :end].repeat_interleave(HEADS // KV_HEADS, dim=1)
        allowed = self.valid_cache[:, None, None, :end].expand(B, 1, s, end)  # (B, 1, s, T)
        if self.top_left and s > 1:  # the bug: is_causal=True's mask, top-left
            allowed = allowed & torch.ones(s, end, dtype=torch.bool).tril()
        elif not self.top_left:  # the fix: on positions, bottom-right
            allowed = allowed & (self.pos_cache[:, None, None, :end] <= positions[:, None, :, None])
        scores = (q @ keys.transpose(-1, -2)) / self.d_k**0.5
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        merged = (weights @ values).transpose(1, 2).reshape(B, s, HEADS * self.d_k)
        return merged @ t["w_o"].T + t["b_o"]


def _loop(params, x, prefill, step, mask, positions, top_left: bool):
    x, positions = torch.from_numpy(np.asarray(x, dtype=np.float64)), torch.from_numpy(positions)
    B, N = x.shape[:2]
    valid = torch.ones(B, N, dtype=torch.bool) if mask is None else torch.from_numpy(mask)
    decoder = StaticDecoder(params, B, N, top_left)
    chunks = [(0, prefill), *((i, min(i + step, N)) for i in range(prefill, N, step))]
    out = [decoder.forward(x[:, a:b], positions[:, a:b], valid[:, a:b]) for a, b in chunks]
    return torch.cat(out, dim=1).numpy()


def candidate(params, x, prefill, step, mask, positions):
    return _loop(params, x, prefill, step, mask, positions, top_left=True)


def fixed_candidate(params, x, prefill, step, mask, positions):
    return _loop(params, x, prefill, step, mask, positions, top_left=False)
