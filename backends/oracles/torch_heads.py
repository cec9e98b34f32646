"""A model's code around a library's attention kernel, shared by the torch oracles (SDPA, flex) and their decoding.

`projected_heads_pass` is what Hugging Face's modules do around the kernel (``F.linear``
projections, QK-norm, the head split, rotary, the merge, the output projection); the kernel is
the third-party part each oracle compares. `float_score_mask` is the additive mask torch's
kernels take for a score bias.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig, MHAInputs
from mha_rosetta.core.variants import norm_step

from .._layouts import HEADS_FIRST_SPLIT_AXES, ROW_SAMPLE_PROJECTION_AXES
from .._recording import StageRecorder, record_projections, record_rotated, record_split_heads
from ..stage_cuts import FUSED_ATTENTION, reached
from ..torch.common import heads_rotator
from ..torch.variants import rms_norm


def float_score_mask(bias, allowed, dtype):
    """The additive float ``attn_mask`` of torch's kernels: the score bias where allowed, -inf where blocked.

    ``bias`` (1|B, H, Nq, Nk) (float32 or float64, from `ScoreBias`); ``allowed`` a bool tensor
    broadcastable to it, or None. Rounded to the kernel's ``dtype`` (torch wants the query's).
    """
    mask = bias.to(dtype)
    return mask if allowed is None else mask.masked_fill(~allowed, float("-inf"))


def projected_heads_pass(
    cfg: MHAConfig, inputs: MHAInputs, dtype: str, device: str, attend, kernel_note: str, rotate=None
):
    """``forward(p, x_q, x_k, x_v, rec=None)``: a model's code around a library's attention kernel.

    ``F.linear`` projections (``p``: the parameter tensors by canonical name), QK-norm with
    ``F.rms_norm`` (over the projection before the split, or each head after it), the head
    split ``view(B, N, H, d).transpose(1, 2)``, rotary, then ``attend(p, q, k, v)`` (the
    library's kernel: (B, H, Nq, Dk), (B, Hkv, Nk, Dk), (B, Hkv, Nk, Dv) -> context (B, H, Nq, Dv)),
    the merge and the output projection; every stage outside the kernel is recorded when ``rec``
    is given; ``until`` names a breakdown stage to stop after (`stage_cuts.reached`: the best paths' cuts).
    ``rotate(heads, "q" | "k")`` defaults to the rotary of ``inputs``' positions (a decode
    chunk passes its slice of the whole run's tables).
    """
    import torch.nn.functional as F

    B, Nq = inputs.batch, inputs.q_tokens
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    if rotate is None:
        rotate = heads_rotator(cfg, inputs, dtype, device)  # rotary applied before the kernel
    eps, step = cfg.norm_eps, norm_step(cfg)  # QK-norm's place and weight fields, from the registry (or None)

    def split(x, n, d):  # (B, N, n*d) -> (B, n, N, d), a strided view
        return x.view(B, x.shape[1], n, d).transpose(1, 2)

    def forward(p: dict, x_q, x_k, x_v, rec: StageRecorder | None = None, until: str | None = None):
        q = F.linear(x_q, p["w_q"], p["b_q"])  # (B, Nq, H*Dk)
        k = F.linear(x_k, p["w_k"], p["b_k"])  # (B, Nk, Hkv*Dk)
        v = F.linear(x_v, p["w_v"], p["b_v"])  # (B, Nk, Hkv*Dv)
        reached(until, "projections", q, k, v)  # a breakdown's cut stops here (`stage_cuts`); None runs on
        q_heads, k_heads, v_heads = split(q, H, Dk), split(k, Hkv, Dk), split(v, Hkv, Dv)  # (B, n, N, d), views
        reached(until, "head split", q_heads, k_heads, v_heads)
        q_normed, k_normed = q_heads, k_heads
        if step is not None:
            w_q, w_k = p[step.weight("q")], p[step.weight("k")]
            if step.per_head:
                q_normed, k_normed = rms_norm(q_heads, w_q, eps), rms_norm(k_heads, w_k, eps)
            else:  # over the whole projection, then the same split
                q_normed = split(rms_norm(q, w_q, eps), H, Dk)  # (B, H, Nq, Dk)
                k_normed = split(rms_norm(k, w_k, eps), Hkv, Dk)  # (B, Hkv, Nk, Dk)
        q_rotated, k_rotated = rotate(q_normed, "q"), rotate(k_normed, "k")  # (B, H, Nq, Dk), (B, Hkv, Nk, Dk)
        reached(until, "rotary", q_rotated, k_rotated)
        context = attend(p, q_rotated, k_rotated, v_heads)  # (B, H, Nq, Dv)
        reached(until, FUSED_ATTENTION, context)
        merged = context.transpose(1, 2).contiguous().view(B, Nq, H * Dv)  # (B, Nq, H*Dv), copy
        reached(until, "merge", merged)
        output = F.linear(merged, p["w_o"], p["b_o"])  # (B, Nq, D)
        if rec is not None:
            record_projections(rec, (q, k, v), ROW_SAMPLE_PROJECTION_AXES, "F.linear")
            how = "view(B, N, H, d).transpose(1, 2)"
            record_split_heads(rec, (q, k, v), (q_heads, k_heads, v_heads), HEADS_FIRST_SPLIT_AXES, how)
            if step is not None:
                how = f"F.rms_norm over {'each head' if step.per_head else 'the whole projection'}"
                rec.record("q_normed", q_normed, HEADS_FIRST_SPLIT_AXES["q_heads"], how)
                rec.record("k_normed", k_normed, HEADS_FIRST_SPLIT_AXES["k_heads"], how)
            how = "rotate_last_axis before the kernel"
            record_rotated(rec, (q_normed, k_normed), (q_rotated, k_rotated), HEADS_FIRST_SPLIT_AXES, how)
            rec.record("context", context, ("B", "H", "Nq", "Dv"), kernel_note)
            rec.record("merged", merged, ("B", "Nq", "H*Dv"), "transpose(1, 2).contiguous().view(B, N, H*Dv)")
            rec.record("output", output, ("B", "Nq", "D"), "F.linear(merged, W_o, b_o)")
        return output

    return forward
