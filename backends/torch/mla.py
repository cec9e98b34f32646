"""DeepSeek's multi-head latent attention (MLA) in row samples: the torch adapter's ``naive`` and ``absorbed``.

Row samples with ``nn.Linear`` as transformers' ``DeepseekV3Attention`` writes it: ``F.linear(x, W, b)``, tokens
on axis 1, features last. ``kv_a_proj_with_mqa`` gives ``(B, N, R + dr)``, split on the last axis into the latent
``c`` (normed) and the one rotary key ``k_pe`` every head shares; heads are ``view(B, N, H, d).transpose(1, 2)``.

* ``naive``: each head's keys ``F.linear(c, W_UK)`` and values ``F.linear(c, W_UV)`` expanded from the latent, the
  shared key ``k_rope.unsqueeze(1)`` ``(B, 1, T, dr)`` broadcast against every head's ``q_rot`` (no ``expand``);
* ``absorbed``: ``q_nope_h @ W_UK_h`` ``(B, H, N, R)`` beside ``q_rot`` is each head's query against the cache's
  ``[c | k_rope]`` ``(B, 1, T, R + dr)``, one key head for all (MQA); the context ``A_h @ c`` stays in the latent
  and ``W_O_h W_UV_h`` ``(H, D, R)`` brings it out. The fold is computed in the forward from ``w_o`` and ``w_v``,
  so that autograd reaches both (the decode path folds once, when prepared).

The score steps (the softcap, the masks, the softmax) on torch's ops object, keys on the last axis; Mistral 4's
temperature on both query parts, ``q_nope`` and the rotated ``q_rot``, each row times its position's factor. Decode
(`prepare_torch_mla_decode_run`) writes each step's ``[c | k_rope]`` rows in place into one preallocated cache
``(B, T, R + dr)``: ``kv_lora_rank + d_rope`` numbers a token. The backward is autograd through this forward.

Stages (``native_stages``, the same pass with a recorder): the latent ``kv_latent`` and the shared key ``k_rope``
(row views of the cache rows), ``q_latent`` and ``q``, the scores and their steps (B, H, Nq, Nk) in both forms; the
naive form adds its expanded values ``v`` (B, T, H*dv) and ``v_heads`` (B, H, T, dv), the context and the merge. The
absorbed form has no per-head value or context of width dv: its context stays in the latent.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions
from mha_rosetta.core.decode import DecodeInputs, decode_allowed
from mha_rosetta.core.variants.mla_heads import check_one_input

from .._mla import ABSORBED, NAIVE, latent_cache_info
from .._recording import StageRecorder, relation_to, score_recorder
from ..base import Prepared, PreparedDecode, tensor_to_numpy
from ..frameworks.ops import score_steps
from ..frameworks.ops_torch import TorchOps
from ..vocabulary import UnsupportedCase
from .common import (
    bool_tensor,
    inference_run,
    optional_tensor,
    precision_info,
    recorded_prepared,
    rotate_last_axis,
    synchronizer,
    temperature_table,
    to_tensor,
    torch_inputs,
    torch_rotary_tables,
)
from .vjp import autograd_prepared, leaf

PARAMS = ("w_q", "w_k", "w_v", "w_o", "b_o", "w_q_a", "b_q_a", "q_a_norm", "w_kv_a", "b_kv_a", "kv_a_norm")


def _mask(allowed, device: str):
    """(blocked, empty_rows) as bool tensors from a NumPy ``allowed`` (1|B, 1|H, Nq, Nk), or (None, None)."""
    if allowed is None:
        return None, None
    empty = ~allowed.any(axis=-1, keepdims=True)  # (1|B, 1|H, Nq, 1)
    return bool_tensor(~allowed, device), bool_tensor(empty, device) if empty.any() else None


# The stages both forms record, in row samples (`_record_queries`, `attend`); the naive form adds its values.
SCORE_AXES = ("B", "H", "Nq", "Nk")
ROPE_KEY_NOTE = "the shared key rot(k_pe), the cache rows' last dr: one for all heads, unsqueeze(1) broadcasts it"
SCORE_NOTES = {
    NAIVE: "(q_nope @ k_nope^T + q_rot @ k_rope^T) * scale, the shared key broadcast over heads",
    ABSORBED: "[q_nope W_UK | q_rot] @ [c | k_rope]^T * scale: one key head for all (MQA)",
}


def _record_queries(rec: StageRecorder, q_latent, q) -> None:
    if q_latent is not None:
        rec.record("q_latent", q_latent, ("B", "Nq", "q_lora_rank"), "RMSNorm(F.linear(x, W_qa, b_qa))")
    rec.record("q", q, ("B", "Nq", "H*Dk"), "F.linear(q_latent or x, W_q): q_b_proj, no bias")


def _record_values(rec: StageRecorder, values, v) -> None:
    rec.record("v", values, ("B", "Nk", "Hkv*Dv"), "F.linear(c, W_UV): every head's values from the latent")
    rec.record("v_heads", v, ("B", "Hkv", "Nk", "Dv"), "view(B, T, H, dv).transpose(1, 2)", relation_to(v, values), "v")


def _record_merge(rec: StageRecorder, context, merged, out) -> None:
    rec.record("context", context, ("B", "H", "Nq", "Dv"), "weights @ v_h")
    note = "transpose(1, 2).reshape(B, N, H*dv)"
    rec.record("merged", merged, ("B", "Nq", "H*Dv"), note, relation_to(merged, context), "context")
    rec.record("output", out, ("B", "Nq", "D"), "F.linear(merged, W_o, b_o)")


class RowSampleMLA:
    """One MLA layer's parameters as tensors (``nn.Linear`` layout, used as is by ``F.linear``) and its steps.
    ``factors``: the temperature's (1|B, N) of the positions ``tables`` were made for (`temperature_table`), or None."""

    def __init__(
        self, cfg: MHAConfig, params: MHAParams, dtype: str, device: str, tables: dict | None, factors=None
    ) -> None:
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.cfg, self.rotary, self.factors = torch, F, cfg, tables, factors
        self.ops = TorchOps()  # the score steps, keys on the last axis
        tensor = partial(optional_tensor, dtype=dtype, device=device)
        for name in PARAMS:
            setattr(self, name, tensor(getattr(params, name)))

    def _rms(self, x, weight):
        xs = x.float() if x.element_size() < 4 else x  # half precision: the norm in float32, as HF's RMSNorm
        return (xs * self.torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).to(x.dtype) * weight

    def _rotate(self, x, which: str, tokens: slice | None):
        cos, sin = self.rotary[which]  # (1|B, N, dr/2)
        if tokens is not None:
            cos, sin = cos[:, tokens], sin[:, tokens]  # a decode chunk's rows
        if x.dim() == 4:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (1|B, 1, N, dr/2): every head alike
        return rotate_last_axis(x, cos, sin, self.cfg.rope)

    def latent(self, x, tokens: slice | None = None):
        """``[kv_latent | k_rope]`` (B, N, R + dr): the rows the cache holds for tokens ``x`` (B, N, D)."""
        c, k_pe = self.F.linear(x, self.w_kv_a, self.b_kv_a).split(
            [self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], -1
        )
        return self.torch.cat([self._rms(c, self.kv_a_norm), self._rotate(k_pe, "k", tokens)], dim=-1)

    def queries(self, x, tokens: slice | None = None, rec: StageRecorder | None = None):
        """(q_nope (B, H, N, dn), q_rot (B, H, N, dr) rotated), both tempered with the temperature; ``rec`` records
        q_latent and q."""
        cfg, F = self.cfg, self.F
        source = x if self.w_q_a is None else self._rms(F.linear(x, self.w_q_a, self.b_q_a), self.q_a_norm)
        B, N, _ = x.shape
        projected = F.linear(source, self.w_q)  # (B, N, H*Dk): q_b_proj has no bias
        if rec is not None:
            _record_queries(rec, source if self.w_q_a is not None else None, projected)
        q = projected.view(B, N, cfg.n_heads, cfg.d_k).transpose(1, 2)  # (B, H, N, Dk) view
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        q_rot = self._rotate(q_rot, "q", tokens)
        if self.factors is None:
            return q_nope, q_rot
        factors = self.factors if tokens is None else self.factors[:, tokens]  # (1|B, s): a decode chunk's
        factors = factors[:, None, :, None]  # (1|B, 1, N, 1) view: every head and feature of a row alike
        return self.ops.temper_queries(q_nope, factors), self.ops.temper_queries(q_rot, factors)

    def folded_output(self):
        """``W_O_h W_UV_h`` (H, D, R): each head's value up-projection folded into its columns of ``o_proj``."""
        H, dv = self.cfg.n_heads, self.cfg.d_v
        w_o_heads = self.w_o.view(-1, H, dv).transpose(0, 1)  # (H, D, dv) view: columns h*dv:(h+1)*dv
        return w_o_heads @ self.w_v.view(H, dv, -1)  # (H, D, dv) @ W_UV (H, dv, R)

    def attend(self, form: str, q_nope, q_rot, entries, blocked, empty_rows, w_ouv=None, rec=None):
        """The queries over the cached rows ``entries`` (B, T, R + dr): the output (B, N, D). ``rec`` records the
        latent, the shared key, the score steps and (naive) the expanded values, the context and the merge."""
        cfg, torch, R = self.cfg, self.torch, self.cfg.kv_lora_rank
        kv_latent, k_rope = entries[..., :R], entries[..., R:]  # (B, T, R), (B, T, dr) views
        if rec is not None:
            rec.record("kv_latent", kv_latent, ("B", "Nk", "kv_lora_rank"), "RMSNorm(c): the cache rows' first R")
            rec.record("k_rope", k_rope, ("B", "Nk", "qk_rope_head_dim"), ROPE_KEY_NOTE)
        B, H, N, _ = q_nope.shape
        if form == ABSORBED:
            w_uk = self.w_k.view(H, cfg.qk_nope_head_dim, R)  # (H, dn, R) view: head h's rows of kv_b_proj
            queries = torch.cat([q_nope @ w_uk, q_rot], dim=-1)  # (B, H, N, R + dr): W_UK_h folded into q
            scores = (queries @ entries.unsqueeze(1).transpose(-1, -2)) * cfg.scale  # (B, H, N, T): MQA
        else:
            T = entries.shape[1]
            k_nope = self.F.linear(kv_latent, self.w_k).view(B, T, H, -1).transpose(1, 2)  # (B, H, T, dn) view
            values = self.F.linear(kv_latent, self.w_v)  # (B, T, H*dv): W_UV c, expanded with the keys
            v = values.view(B, T, H, cfg.d_v).transpose(1, 2)  # (B, H, T, dv) view
            if rec is not None:
                _record_values(rec, values, v)
            rope = q_rot @ k_rope.unsqueeze(1).transpose(-1, -2)  # (B, H, N, T): the shared key, broadcast
            scores = (q_nope @ k_nope.transpose(-1, -2) + rope) * cfg.scale
        on_stage = score_recorder(rec, scores, SCORE_AXES, SCORE_NOTES[form])
        weights = score_steps(self.ops, cfg, scores, blocked=blocked, empty_rows=empty_rows, on_stage=on_stage)
        if form == ABSORBED:
            context = weights @ kv_latent.unsqueeze(1)  # (B, H, N, R): the context stays in the latent
            w_ouv = self.folded_output() if w_ouv is None else w_ouv
            out = torch.einsum("bhnr,hdr->bnd", context, w_ouv)  # sum over heads of context_h (W_O_h W_UV_h)^T
            out = out if self.b_o is None else out + self.b_o
            if rec is not None:
                rec.record("output", out, ("B", "Nq", "D"), "einsum('bhnr,hdr->bnd'): the latent context, W_O W_UV")
            return out
        context = weights @ v  # (B, H, N, dv)
        merged = context.transpose(1, 2).reshape(B, N, H * cfg.d_v)  # (B, N, H*dv): a copy (reshape)
        out = self.F.linear(merged, self.w_o, self.b_o)
        if rec is not None:
            _record_merge(rec, context, merged, out)
        return out


def _layer_pass(cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype, device, strategy, as_leaves: bool):
    """(the forward of ``strategy``, with no argument, and the leaves): the parameters and the three inputs as
    leaves that require grad when ``as_leaves`` (three even for self-attention), else None."""
    check_one_input(inputs.key, inputs.value)
    factors = temperature_table(cfg, inputs.positions, dtype, device)  # Mistral 4's temperature, or None
    layer = RowSampleMLA(cfg, params, dtype, device, torch_rotary_tables(cfg, inputs, dtype, device), factors)
    x_q, x_k, x_v = torch_inputs(inputs, dtype, device)
    leaves = None
    if as_leaves:
        x_q, x_k, x_v = leaf(x_q), leaf(x_k), leaf(x_v)
        for name in PARAMS:
            setattr(layer, name, leaf(getattr(layer, name)))
        leaves = {"d_x_q": x_q, "d_x_k": x_k, "d_x_v": x_v, **{name: getattr(layer, name) for name in PARAMS}}
    blocked, empty = _mask(allowed_positions(cfg, inputs), device)

    def forward(rec: StageRecorder | None = None):
        q_nope, q_rot = layer.queries(x_q, rec=rec)
        return layer.attend(strategy, q_nope, q_rot, layer.latent(x_k), blocked, empty, rec=rec)

    return forward, leaves


def prepare_torch_mla(cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype, device, strategy, allow_tf32):
    """The torch adapter's `Prepared` for MLA's ``strategy``."""
    forward, _ = _layer_pass(cfg, params, inputs, dtype, device, strategy, as_leaves=False)
    run = inference_run(forward, device, allow_tf32)  # run(rec): the pass, recorded: `_record_*` and the score steps
    info = {
        "layout": "row samples (B, tokens, features); the cache rows [c | k_rope] (B, T, R + dr)",
        "strategy": strategy,
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return recorded_prepared(run, device, info)


def prepare_torch_mla_vjp(cfg, params, inputs, cotangent, dtype, device, strategy, allow_tf32):
    """Autograd through MLA's ``strategy``: the parameters and the three inputs as leaves."""
    forward, leaves = _layer_pass(cfg, params, inputs, dtype, device, strategy, as_leaves=True)
    info = {"strategy": strategy, "layout": "row samples (B, tokens, features)"}
    return autograd_prepared(forward, leaves, to_tensor(cotangent, dtype, device), dict, device, allow_tf32, info)


def decode_chunk(layer: RowSampleMLA, strategy: str, cache, xs, inputs: DecodeInputs, chunk: tuple, device, w_ouv=None):
    """One chunk ``(start, stop)`` of a decode run: its ``[c | k_rope]`` rows written in place into ``cache``
    (B, T, R + dr), then its queries over the rows written so far; the chunk's output (B, s, D). ``device``: ours
    ("cpu", "gpu"); ``w_ouv``: the absorbed form's ``W_O W_UV``, folded once for the run (None: folded here)."""
    start, stop = chunk
    window = slice(start, stop)
    cache[:, window] = layer.latent(xs[:, window], window)  # the step's rows, in place
    allowed = decode_allowed(layer.cfg, inputs.positions[:, window], inputs.positions[:, :stop], inputs.valid[:, :stop])
    blocked, empty = _mask(allowed, device)  # (B, 1, s, T)
    q_nope, q_rot = layer.queries(xs[:, window], window)
    return layer.attend(strategy, q_nope, q_rot, cache[:, :stop], blocked, empty, w_ouv)


def prepare_torch_mla_decode_run(cfg, params, inputs: DecodeInputs, dtype, device, strategy, allow_tf32):
    """A whole decode run of MLA's ``strategy`` through one preallocated latent cache (B, T, R + dr), in place."""
    import torch

    run_inputs = SimpleNamespace(positions=inputs.positions, kv_positions=inputs.positions)
    tables = torch_rotary_tables(cfg, run_inputs, dtype, device)  # every position of the run, once
    layer = RowSampleMLA(cfg, params, dtype, device, tables, temperature_table(cfg, inputs.positions, dtype, device))
    xs = to_tensor(inputs.x, dtype, device)  # (B, N, D)
    B, N, _ = inputs.x.shape
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    w_ouv = layer.folded_output() if strategy == ABSORBED else None  # folded once for the whole run

    def forward():
        cache = xs.new_zeros((B, N, rows))  # (B, T, R + dr): allocated once, written in place
        outputs = [decode_chunk(layer, strategy, cache, xs, inputs, chunk, device, w_ouv) for chunk in inputs.chunks()]
        return torch.cat(outputs, dim=1)  # (B, N, D)

    run = inference_run(forward, device, allow_tf32)
    layout = "(B, T, R + dr): [c | k_rope] a row per token, preallocated for the run, written in place"
    info = {
        "layout": "row samples (B, tokens, features)",
        "form": strategy,
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    info["cache"] = latent_cache_info(cfg, B, N, xs.element_size(), layout)
    return PreparedDecode(
        run, lambda out: np.asarray(tensor_to_numpy(out)), synchronize=synchronizer(device), info=info
    )


def prepare_torch_mla_decode_step(cfg: MHAConfig, params: MHAParams, job, allow_tf32) -> Prepared:
    """One timed step of MLA's ``job.strategy`` form (`bench --mode decode`): ``job.step`` new tokens onto the latent
    cache (B, T + s, R + dr) holding ``job.context`` tokens of arbitrary numbers, drawn as the NumPy step draws them
    (the step's tokens, then the cache's columns), so that both adapters time the same step. Every call writes the
    step's rows at the same place; ``W_O W_UV`` is folded once, as in the run. A ragged batch is refused."""
    if job.lengths is not None:
        raise UnsupportedCase("torch: MLA's timed step takes a rectangular batch (every row holds the context)")
    B, T, s, form, dtype, device = job.batch, job.context, job.step, job.strategy, job.dtype, job.device
    rng = np.random.default_rng(job.seed)
    everywhere = np.broadcast_to(np.arange(T + s, dtype=np.int64), (B, T + s))  # (B, T + s): the run's positions
    tables = torch_rotary_tables(cfg, SimpleNamespace(positions=everywhere, kv_positions=everywhere), dtype, device)
    layer = RowSampleMLA(cfg, params, dtype, device, tables, temperature_table(cfg, everywhere, dtype, device))
    x = to_tensor(rng.standard_normal((B, s, cfg.d_model)), dtype, device)  # (B, s, D)
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    cache = x.new_zeros((B, T + s, rows))  # (B, T + s, R + dr): rows :T the cached tokens, then the step's
    cache[:, :T] = to_tensor(rng.standard_normal((B, rows, T)).transpose(0, 2, 1), dtype, device)  # NumPy's columns
    w_ouv = layer.folded_output() if form == ABSORBED else None
    tokens = slice(T, T + s)
    valid = np.ones((B, T + s), dtype=bool)

    def forward(rec: StageRecorder | None = None):
        cache[:, tokens] = layer.latent(x, tokens)  # the step's rows, in place: every call the same step
        blocked, empty = _mask(
            decode_allowed(cfg, everywhere[:, tokens], everywhere, valid), device
        )  # (B, 1, s, T + s)
        q_nope, q_rot = layer.queries(x, tokens, rec)
        return layer.attend(form, q_nope, q_rot, cache, blocked, empty, w_ouv, rec)  # (B, s, D)

    run = inference_run(forward, device, allow_tf32)  # run(rec): the step, its queries over the cache (Nk = T + s)
    layout = "(B, T, R + dr): [c | k_rope] a row per token, allocated once with room for the step, written in place"
    info = {
        "layout": "row samples (B, tokens, features)",
        "form": form,
        "context": T,
        "step": s,
        "cache": latent_cache_info(cfg, B, T + s, x.element_size(), layout),
        **precision_info(device=device, dtype=dtype, allow_tf32=allow_tf32),
    }
    return recorded_prepared(run, device, info)
