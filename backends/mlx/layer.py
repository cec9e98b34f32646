"""The MLX layer: multi-head attention as mlx-lm writes it (``mlx_lm/models/llama.py``'s ``Attention``).

mlx-lm's idiom, step by step, on the canonical parameters:

* ``nn.Linear`` weights are ``(out, in)`` and a projection is ``x @ W.T + b`` (``mx.addmm(b, x, W.T)``);
* the heads split by ``reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3)``: (B, H, L, Dk); merged back
  by ``transpose(0, 2, 1, 3).reshape(B, L, -1)``;
* QK-norm is ``nn.RMSNorm``, i.e. ``mx.fast.rms_norm`` (per head, Qwen 3's and Gemma 3's place, or over
  the whole projection before the split, OLMo 2's);
* rotary: ``nn.RoPE(dims, traditional=...)``. ``traditional=True`` rotates interleaved pairs (2i, 2i+1),
  the spec's ``rope="interleaved"``; ``traditional=False`` rotates halves (i, i + r/2), ``rope="half"``.
  Choosing the wrong one is the classic porting bug of mlx-lm models. The angles come from the spec's
  tables (`core.rotary_tables`: any positions, rope scaling), and `rotate` turns pairs the way
  ``traditional`` says; a test holds it equal to ``nn.RoPE`` itself on ``0 .. N-1``;
* GQA without tiling the keys: the queries reshaped to (B, Hkv, G, L, Dk) against the keys
  (B, Hkv, 1, S, Dk), as mlx-lm's own fallback (``quantized_scaled_dot_product_attention``) does;
* half precision: ``scale * q @ k^T`` accumulated in float32 and rounded once, and the score steps and
  softmax in float32 (as the fused kernel computes them); float16 gradients of the key bias came out
  about 15% beyond the half rule's allowance with the product rounded in half (measured on the check's
  ``padding`` and ``rope_gqa_causal`` cases), within it this way;
* the score steps (`frameworks.ops.score_steps` on `MlxOps`) instead of the fused
  ``mx.fast.scaled_dot_product_attention``, so that every stage is visible (the fused call is the
  ``mlx-sdpa`` oracle).

Every method is a pure function of the arrays it is given (``p``: the parameters by name), so the
same code runs the forward, ``mx.vjp`` of it, and a decode step. Evaluation is lazy: nothing runs
until ``mx.eval`` (`Prepared.synchronize`).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, rotary_tables
from mha_rosetta.core.params import PARAM_NAMES
from mha_rosetta.core.variants import norm_step, t5_buckets

from .._layouts import HEADS_FIRST_SPLIT_AXES, ROW_SAMPLE_PROJECTION_AXES
from .._recording import StageRecorder, head_step_recorder, record_projections, record_rotated, record_split_heads
from ..frameworks.mlx import to_mlx
from ..frameworks.ops import STEP_HOW, after_rotary, read_values, score_steps, temperature_factors
from ..frameworks.ops_mlx import MlxOps, compute_dtype
from ..frameworks.score_parts import distance_slopes, score_parts

SPLIT_HOW = "reshape(B, L, H, -1).transpose(0, 2, 1, 3)"
ROTATE_HOW = "nn.RoPE's rotation (traditional={}) by the spec's angle tables"
# The normed stages' note, by the norm before rotary's place (`NormStep.place`): mlx-lm's words for each.
NORM_HOW = {
    "head": "mx.fast.rms_norm over each head's Dk features (nn.RMSNorm(head_dim))",
    "projection": "mx.fast.rms_norm over the whole projection, then the same head split",
}


def rotate(x, cos, sin, traditional: bool):
    """``nn.RoPE``'s rotation of the last axis of ``x`` (..., N, Dk) by tables (..., N, r/2); features past r pass.

    ``traditional=True``: interleaved pairs (2i, 2i+1); False: halves (i, i + r/2).
    """
    import mlx.core as mx

    h = cos.shape[-1]  # r/2 pairs
    r = 2 * h
    x_rot = x[..., :r]  # (..., N, r)
    if traditional:
        pairs = x_rot.reshape(*x_rot.shape[:-1], h, 2)  # (..., N, r/2, 2)
        a, b = pairs[..., 0], pairs[..., 1]  # (..., N, r/2) each
        rotated = mx.stack((a * cos - b * sin, b * cos + a * sin), axis=-1).reshape(x_rot.shape)  # (..., N, r)
    else:
        a, b = x_rot[..., :h], x_rot[..., h:]  # (..., N, r/2) each
        rotated = mx.concatenate((a * cos - b * sin, b * cos + a * sin), axis=-1)  # (..., N, r)
    return rotated if r == x.shape[-1] else mx.concatenate((rotated, x[..., r:]), axis=-1)  # (..., N, Dk)


def mlx_tables(cfg: MHAConfig, inputs, dtype: str) -> dict | None:
    """The tables of ``inputs``' positions as MLX arrays, each a tuple whose third axis is the tokens': the rotary
    embedding's {"q": (cos, sin), "k": (cos, sin)} (1|B, 1, N, r/2) with rope, Llama 4's temperature factors
    {"temper": (factors,)} (1|B, 1, Nq, 1, in at least float32) with it; None when there are neither."""
    tables, rotary = {}, rotary_tables(cfg, inputs)
    if rotary is not None:
        tables["q"] = (to_mlx(rotary.q_cos[:, None], dtype), to_mlx(rotary.q_sin[:, None], dtype))
        tables["k"] = (to_mlx(rotary.k_cos[:, None], dtype), to_mlx(rotary.k_sin[:, None], dtype))
    factors = temperature_factors(cfg, inputs.positions)  # (1|B, Nq) float64
    if factors is not None:
        tables["temper"] = (to_mlx(factors[:, None, :, None], "float64" if dtype == "float64" else "float32"),)
    return tables or None


class MlxAttention:
    """One layer's parameters in MLX, and mlx-lm's attention as pure functions of them."""

    def __init__(self, cfg: MHAConfig, params: MHAParams, dtype: str) -> None:
        import mlx.core as mx

        self.mx, self.cfg, self.dtype = mx, cfg, dtype
        self.ops = MlxOps()
        # The parameters by canonical name, (out, in) as nn.Linear holds them; None entries left out.
        self.params = {name: to_mlx(getattr(params, name), dtype) for name in PARAM_NAMES}
        self.params = {name: value for name, value in self.params.items() if value is not None}
        self.traditional = cfg.rope == "interleaved"  # nn.RoPE(traditional=True) is the interleaved style
        self.norm_step = norm_step(cfg)  # the norm before rotary (QK-norm: nn.RMSNorm), or None
        # The score bias is formed in float32 at least (float64 for float64 runs) and added before rounding.
        self.bias_dtype = "float64" if dtype == "float64" else "float32"

    # -- building blocks ------------------------------------------------------------------
    def linear(self, p: dict, x, name: str):
        """nn.Linear: ``x @ W.T + b`` with ``W`` (out, in); ``mx.addmm(b, x, W.T)`` where there is a bias."""
        w, b = p["w_" + name], p.get("b_" + name)
        return x @ w.T if b is None else self.mx.addmm(b, x, w.T)

    @staticmethod
    def split(x, n_heads: int):
        B, L, _ = x.shape
        return x.reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3)  # (B, n, L, d): a transposed copy when evaluated

    def rms_norm(self, x, weight):
        return self.mx.fast.rms_norm(x, weight, self.cfg.norm_eps)  # nn.RMSNorm's kernel

    def heads(self, p: dict, x_q, x_k, x_v, tables, rec: StageRecorder | None = None):
        """Projections, head split, QK-norm, rotary, then Llama 4's steps after it and Gemma 4's value norm: what the
        scores and the weighted sum read, (q (B, H, Nq, Dk), k (B, Hkv, Nk, Dk), v (B, Hkv, Nk, Dv))."""
        cfg = self.cfg
        q, k, v = self.linear(p, x_q, "q"), self.linear(p, x_k, "k"), self.linear(p, x_v, "v")  # (B, N, n*d)
        q_heads, k_heads, v_heads = (
            self.split(q, cfg.n_heads),
            self.split(k, cfg.n_kv_heads),
            self.split(v, cfg.n_kv_heads),
        )
        if rec is not None:
            record_projections(rec, (q, k, v), ROW_SAMPLE_PROJECTION_AXES, "nn.Linear: mx.addmm(b, x, W.T)")
            record_split_heads(rec, (q, k, v), (q_heads, k_heads, v_heads), HEADS_FIRST_SPLIT_AXES, SPLIT_HOW)
        q_normed, k_normed, step = q_heads, k_heads, self.norm_step
        if step is not None:
            w_q, w_k = p[step.weight("q")], p[step.weight("k")]
            if step.per_head:
                q_normed, k_normed = self.rms_norm(q_heads, w_q), self.rms_norm(k_heads, w_k)  # (B, n, L, Dk)
                parents = ("q_heads", "k_heads")
            else:  # the merged projection (B, L, n*Dk), then the same split
                q_normed = self.split(self.rms_norm(q, w_q), cfg.n_heads)  # (B, H, L, Dk)
                k_normed = self.split(self.rms_norm(k, w_k), cfg.n_kv_heads)  # (B, Hkv, L, Dk)
                parents = (None, None)
            if rec is not None:
                for name, value, parent in zip(("q_normed", "k_normed"), (q_normed, k_normed), parents, strict=True):
                    axes = HEADS_FIRST_SPLIT_AXES[name.replace("normed", "heads")]
                    rec.record(name, value, axes, NORM_HOW[step.place], "new", parent)
        rotated = q_normed, k_normed
        if tables is not None and "q" in tables:
            rotated = tuple(rotate(x, *tables[w], self.traditional) for x, w in zip(rotated, "qk", strict=True))
        if rec is not None:
            how = ROTATE_HOW.format(self.traditional)
            parents = (q_heads, k_heads) if step is None else (q_normed, k_normed)  # turned from the normed
            record_rotated(rec, parents, rotated, HEADS_FIRST_SPLIT_AXES, how)
        # Llama 4's steps after rotary and Gemma 4's value norm on MlxOps (frameworks.ops), heads first.
        on_stage = head_step_recorder(rec, HEADS_FIRST_SPLIT_AXES)
        factors = None if tables is None or "temper" not in tables else tables["temper"][0]  # (1|B, 1, Nq, 1)
        q, k = (
            after_rotary(self.ops, cfg, x, w, factors, on_stage=on_stage) for x, w in zip(rotated, "qk", strict=True)
        )
        return q, k, read_values(self.ops, cfg, v_heads, on_stage=on_stage)

    def score_bias(self, p: dict, distance: np.ndarray):
        """ALiBi's ``m_h (p_j - p_i)`` plus T5's ``rel_bias[bucket(p_j - p_i), h]``: (1|B, H, Nq, Nk), or None.

        ``distance`` (1|B, Nq, Nk) int64, key minus query position; T5's table is gathered from ``p``, so
        its gradient flows back through ``mx.vjp``.
        """
        cfg, bias = self.cfg, None
        slopes = distance_slopes(cfg)  # ALiBi's m_h (H,), or None
        if slopes is not None:
            bias = slopes[:, None, None] * distance[:, None].astype(np.float64)  # (1|B, H, Nq, Nk)
            bias = to_mlx(bias, self.bias_dtype)
        if cfg.rel_buckets is not None:
            buckets = t5_buckets(distance, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)
            gathered = p["rel_bias"][to_mlx(buckets, None)]  # (1|B, Nq, Nk, H): a gather
            rel = gathered.transpose(0, 3, 1, 2).astype(
                self.mx.float64 if self.bias_dtype == "float64" else self.mx.float32
            )
            bias = rel if bias is None else bias + rel
        return bias

    def attend(self, p: dict, q, k, v, blocked, distance, rec: StageRecorder | None = None):
        """Scores, the score steps and the weighted sum, GQA without tiling: context (B, H, Nq, Dv).

        ``blocked``: an MLX bool (1|B, 1|H, Nq, Nk), True = may not attend, or None; ``distance``: the
        positions' differences for a score bias (NumPy), or None.
        """
        cfg = self.cfg
        B, H, Nq, Dk = q.shape
        Hkv, Nk, G = k.shape[1], k.shape[2], cfg.group_size
        q_groups = q.reshape(B, Hkv, G, Nq, Dk)  # (B, Hkv, G, Nq, Dk): a group's heads together
        # scale * (q @ k^T) in one op, rounded once (mx.addmm's alpha, as torch's baddbmm): (B, Hkv, G, Nq, Nk)
        compute = compute_dtype(q.dtype)  # half precision: the product accumulated and scaled in float32
        zero = self.mx.array(0, dtype=compute)
        keys = k[:, :, None].swapaxes(-1, -2).astype(compute)
        scores = self.mx.addmm(zero, q_groups.astype(compute), keys, alpha=cfg.scale, beta=0.0).astype(q.dtype)
        scores = scores.reshape(B, H, Nq, Nk)  # keys were (B, Hkv, 1, Dk, Nk): broadcast over the group
        axes = ("B", "H", "Nq", "Nk")
        if rec is not None:
            rec.record(
                "scores", scores, axes, "mx.addmm(0, q, k.swapaxes(-1, -2), alpha=scale), queries grouped by kv head"
            )
        parts = score_parts(cfg, p, lambda a: a.reshape(1, H, 1, 1))  # (1, H, 1, 1): one value per head
        on_stage = None
        if rec is not None:

            def on_stage(name, value, parent, before):
                if name == "masked_scores":
                    note = "mx.where(blocked, -inf, scores)" if blocked is not None else f"no mask: {parent} itself"
                elif name == "weights":
                    # the score parts by their keywords ("sinks"): each in every denominator
                    joined = "".join(f", {part} in the denominator" for part in parts)
                    note = "softmax over keys in float32 at least; empty rows zeros" + joined
                else:
                    note = STEP_HOW[name]
                rec.record(name, value, axes, note, "view" if value is before else "new", parent)

        bias = None if distance is None or not cfg.has_score_bias else self.score_bias(p, distance)
        weights = score_steps(self.ops, cfg, scores, bias=bias, blocked=blocked, **parts, on_stage=on_stage)
        weights_groups = weights.reshape(B, Hkv, G, Nq, Nk)  # (B, Hkv, G, Nq, Nk)
        context = (weights_groups @ v[:, :, None]).reshape(B, H, Nq, v.shape[-1])  # (B, H, Nq, Dv)
        if rec is not None:
            rec.record("context", context, ("B", "H", "Nq", "Dv"), "weights @ v, a group's heads against one kv head")
        return context

    def finish(self, p: dict, context, rec: StageRecorder | None = None, x_gate=None):
        """Heads merged, ``transpose(0, 2, 1, 3).reshape(B, L, -1)``, gated with ``attn_output_gate`` (``x_gate``:
        the query tokens (B, L, D), a decode chunk's own), then ``o_proj``: (B, Nq, D)."""
        B, H, L, Dv = context.shape
        merged = context.transpose(0, 2, 1, 3).reshape(B, L, H * Dv)  # (B, L, H*Dv), a copy when evaluated
        gate, read = None, merged
        if self.cfg.attn_output_gate:  # the gate's nn.Linear (out, in), as q_proj's; MlxOps' sigmoid and product
            gate, read = self.ops.output_gate(merged, self.linear(p, x_gate, "gate"))  # (B, L, H*Dv) each
        output = self.linear(p, read, "o")  # (B, L, D)
        if rec is not None:
            rec.record(
                "merged", merged, ("B", "Nq", "H*Dv"), "transpose(0, 2, 1, 3).reshape(B, L, -1)", "copy", "context"
            )
            if gate is not None:
                rec.record("gate", gate, ("B", "Nq", "H*Dv"), "mx.sigmoid(mx.addmm(b_gate, x_q, W_gate.T))")
            rec.record("output", output, ("B", "Nq", "D"), "o_proj: mx.addmm(b_o, merged, W_o.T)")
        return output

    def forward(self, p: dict, x_q, x_k, x_v, tables, blocked, distance, rec: StageRecorder | None = None):
        """The whole layer, (B, Nq, D)."""
        q, k, v = self.heads(p, x_q, x_k, x_v, tables, rec)
        return self.finish(p, self.attend(p, q, k, v, blocked, distance, rec), rec, x_q)
