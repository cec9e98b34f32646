"""The PyTorch layer: multi-head attention in row samples, the way ``nn.Linear`` code does it.

A catalogue, over 400 lines on purpose: the row-sample layer's four head-split strategies (standard,
direct_reshape, slicing, per_head), a method each, and the steps they share (projections, QK-norm, rotary,
mask and softmax, merge), in one class so that the convention reads top to bottom.

Convention B of the column/row-sample article, as PyTorch users write it (nanoGPT's ``CausalSelfAttention``).
Each batch item is ``(tokens, features)``: every token is a row. Weights stay in the
``nn.Linear.weight`` layout ``(out, in)`` and a projection is ``F.linear(x, W, b)``,
that is ``x @ W.T + b``: the *columns* of ``W.T`` are the scorers. Heads are split with
``view(B, N, H, Dk).transpose(1, 2)`` (a strided view) and merged with
``transpose(1, 2).contiguous().view(B, N, H*Dv)``.

GQA: query head h reads kv head ``h // G`` (G = H / Hkv). Rather than repeating the kv
heads G times (``repeat_interleave``, G copies of K and V), the G query heads of a group
are folded into the token axis, ``(B, H, Nq, Dk) -> (B*Hkv, G*Nq, Dk)``, so one batched
product per kv head serves the whole group. That reshape copies the queries, the same copy
a batched product of the strided head view needs anyway; with G = 1 it is plain MHA.

Strategies: STANDARD (merged projection, view + transpose); PER_HEAD (the column/row-sample article's own
matrices ``W_h`` (D, Dk) per head, ``Q_h = X @ W_h``, in a loop); SLICING (merged projection,
then column slices ``q[:, :, h*Dk:(h+1)*Dk]`` one head at a time); DIRECT_RESHAPE (the
known mistake: ``q.view(B, H, N, Dk)`` without the transpose).

Rotary (``cfg.rope``) turns pairs of the last (feature) axis of each head, as Hugging Face
and Meta code do: two slices for "half", ``unflatten(-1, (r/2, 2))`` for "interleaved".

Variants (`core.variants`, in torch by `variants`): QK-norm with ``F.rms_norm`` on the merged
projection before the split ("projection") or on the split heads ("head"), before rotary;
the score steps (`frameworks.ops.score_steps` on torch's ops object) on the (B, H, Nq, Nk)
scores, in pipeline order. Their stages (``q_normed`` ... ``biased_scores``) are recorded
only when on.

GPU float32: TF32 is off unless the backend is built with ``allow_tf32=True``; see
`common`.
"""

from __future__ import annotations

from functools import partial

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions, split_head_bias, split_head_matrices

from .._layouts import HEADS_FIRST_SPLIT_AXES, ROW_SAMPLE_PROJECTION_AXES, head_slice_axes, layer_sizes
from .._recording import LayerRecording, StageRecorder, record_rotated, relation_to
from ..frameworks.ops import STEP_HOW, score_steps, temperature_factors
from ..frameworks.ops_torch import HALF, TorchOps
from .common import (
    bool_tensor,
    optional_tensor,
    rotate_last_axis,
    torch_inputs,
    torch_rotary_tables,
)
from .variants import ScoreBias, SumReducer, rms_norm, rms_norm_of_sum

HEAD_SLICE_AXES = head_slice_axes(HEADS_FIRST_SPLIT_AXES)  # q_heads: (B, Nq, Dk), the head axis stacked back in later
ROTATE_HOW = "pairs of the last (feature) axis turned by each token's angle (rotary)"


def _step_note(stage: str, in_place: bool, parent: str, masked: bool, sinks: bool) -> str:
    """How this adapter makes a score stage (`RowSampleMHA._mask_and_softmax`), as its recording says."""
    if stage == "capped_scores":
        return STEP_HOW[stage] + (", in place" if in_place else "")
    if stage == "biased_scores":
        return STEP_HOW[stage] + ", the tables from NumPy"
    if stage == "masked_scores":
        return "masked_fill_(blocked, -inf), in place" if masked else f"no mask: {parent} itself"
    if sinks:
        return "torch.softmax over keys with the sink as one more column, dropped after; empty rows zeros"
    return "torch.softmax over keys; empty rows set to zeros"


class RowSampleMHA(LayerRecording):
    """One layer and one set of inputs, converted once to torch tensors on the device.

    With ``batched=True`` the score and weight tensors ``(B*Hkv, G*Nq, Nk)`` get buffers
    here that every call reuses (``out=``). Why: torch has no caching allocator on the
    CPU, and at B=4, H=8, N=512 each of these is 32 MiB, a fresh ``mmap`` per call whose
    page faults and zeroing cost more than the softmax itself (measured: 22 ms for
    ``torch.softmax`` into a new tensor, 5 ms into a reused one). The forward never
    returns a buffer, so results stay independent.
    """

    materialise_mask = True  # the full (Nq, Nk) mask, causal part included
    PROJECTION_AXES = ROW_SAMPLE_PROJECTION_AXES
    SPLIT_AXES = HEADS_FIRST_SPLIT_AXES
    HEAD_SLICE_AXES = HEAD_SLICE_AXES
    PROJECTION_NOTE = "F.linear: x @ W.T + b"
    ROTATE_HOW = ROTATE_HOW

    def __init__(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        inputs: MHAInputs,
        dtype: str,
        device: str,
        batched: bool = True,
        *,
        alibi_slopes=None,
        norm_sum: SumReducer | None = None,
        norm_widths: tuple[int, int] | None = None,
    ) -> None:
        """``alibi_slopes``, ``norm_sum`` and ``norm_widths`` are for a rank holding some of a layer's heads
        (torch-tp): its slice of the layer's ALiBi slopes (NumPy (H,)), the all-reduce of a projection-wide
        QK-norm's sum of squares, and the whole layer's (q, k) projection widths that sum is over."""
        self._convert_params(cfg, params, dtype, device, norm_sum, norm_widths)
        self.sizes = layer_sizes(cfg, inputs)  # (B, Nq, Nk, H, Hkv, G, Dk, Dv)
        self.score_bias = ScoreBias(cfg, inputs, dtype, device, alibi_slopes) if cfg.has_score_bias else None

        # x_q (B, Nq, D), x_k (B, Nk, kdim), x_v (B, Nk, vdim); self-attention keeps one tensor.
        self.x_q, self.x_k, self.x_v = torch_inputs(inputs, dtype, device)
        self.rotary = torch_rotary_tables(cfg, inputs, dtype, device)  # (1|B, N, r/2) tables or None
        self.factors = self._factor_table(inputs.positions, dtype, device)  # (1|B, Nq) or None: the temperature

        # (1|B, 1|H, Nq, Nk), True = may attend; the chunked subclass reads tiles instead.
        allowed = allowed_positions(cfg, inputs) if self.materialise_mask else None
        self.blocked = None if allowed is None else bool_tensor(~allowed, device)
        empty = None if allowed is None else ~allowed.any(axis=-1, keepdims=True)  # (1|B, 1|H, Nq, 1)
        self.empty_rows = bool_tensor(empty, device) if empty is not None and empty.any() else None
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        shape = (B * Hkv, G * Nq, Nk)
        self.scores_buffer = self.x_q.new_empty(shape) if batched else None
        self.weights_buffer = self.x_q.new_empty(shape) if batched else None

    def _convert_params(self, cfg: MHAConfig, params: MHAParams, dtype: str, device: str, norm_sum, norm_widths):
        """The layer's parameters as tensors on the device, once (the decode layer shares this with the forward)."""
        import torch
        import torch.nn.functional as F

        self.torch, self.F, self.cfg = torch, F, cfg
        self.ops = TorchOps()  # the score steps
        tensor = partial(optional_tensor, dtype=dtype, device=device)
        # nn.Linear layout (out, in), used as is by F.linear.
        self.w_q, self.w_k, self.w_v, self.w_o = (tensor(w) for w in (params.w_q, params.w_k, params.w_v, params.w_o))
        self.b_q, self.b_k, self.b_v, self.b_o = (tensor(b) for b in (params.b_q, params.b_k, params.b_v, params.b_o))
        # PER_HEAD: the article's W_h (D, Dk) per head, Q_h = X @ W_h (row samples: columns are scorers).
        self.w_q_heads = tensor(split_head_matrices(params.w_q, cfg.n_heads))  # (H, D, Dk)
        self.w_k_heads = tensor(split_head_matrices(params.w_k, cfg.n_kv_heads))  # (Hkv, kdim, Dk)
        self.w_v_heads = tensor(split_head_matrices(params.w_v, cfg.n_kv_heads))  # (Hkv, vdim, Dv)
        self.b_q_heads = tensor(split_head_bias(params.b_q, cfg.n_heads))  # (H, Dk) or None
        self.b_k_heads = tensor(split_head_bias(params.b_k, cfg.n_kv_heads))  # (Hkv, Dk) or None
        self.b_v_heads = tensor(split_head_bias(params.b_v, cfg.n_kv_heads))  # (Hkv, Dv) or None
        # The variants' parameters (None when off): QK-norm weights (Dk,) or (H*Dk,)/(Hkv*Dk,),
        # one sink logit per head (H,), T5's table (buckets, H).
        self.q_norm, self.k_norm = tensor(params.q_norm), tensor(params.k_norm)
        self.sinks, self.rel_bias = tensor(params.sinks), tensor(params.rel_bias)
        self.w_gate, self.b_gate = tensor(params.w_gate), tensor(params.b_gate)  # (H*Dv, D), (H*Dv,): nn.Linear's
        self.norm_sum = norm_sum
        self.norm_widths = (cfg.q_width, cfg.k_width) if norm_widths is None else norm_widths
        # baddbmm with beta=0 ignores its first argument; a 0-dim zero broadcasts to any shape.
        self.zero = torch.zeros((), dtype=self.w_q.dtype, device=self.w_q.device)

    # -- building blocks ------------------------------------------------------------------
    def _stack(self, arrays: list, axis: int):
        return self.torch.stack(arrays, axis)

    def _factor_table(self, positions, dtype: str, device: str):
        """Llama 4's temperature factors of ``positions`` (1|B, N) as a tensor in at least float32, or None."""
        compute = "float32" if dtype in HALF else dtype  # the product in float32, rounded once (TorchOps)
        return optional_tensor(temperature_factors(self.cfg, positions), compute, device)

    def _laid_out_factors(self, batched: bool):
        # (1|B, 1, Nq, 1) against the heads (B, H, Nq, Dk), or (1|B, Nq, 1) against one head's (B, Nq, Dk): views
        return self.factors[:, None, :, None] if batched else self.factors[:, :, None]

    def _projections(self):
        F = self.F
        q = F.linear(self.x_q, self.w_q, self.b_q)  # (B, Nq, H*Dk)
        k = F.linear(self.x_k, self.w_k, self.b_k)  # (B, Nk, Hkv*Dk)
        v = F.linear(self.x_v, self.w_v, self.b_v)  # (B, Nk, Hkv*Dv)
        return q, k, v

    def _norm_projection(self, x, which: str):
        """A projection-wide QK-norm of the merged q or k (B, N, width): over every head's features at once.

        A rank of torch-tp holds some heads' features only: the sum of squares is all-reduced
        (``norm_sum``) and divided by the whole layer's width.
        """
        weight = self.q_norm if which == "q" else self.k_norm
        if self.norm_sum is None:
            return rms_norm(x, weight, self.cfg.norm_eps)  # F.rms_norm over the whole projection
        squares = self.norm_sum((x * x).sum(dim=-1, keepdim=True), which)  # (B, N, 1), summed over the ranks
        width = self.norm_widths[0 if which == "q" else 1]
        return rms_norm_of_sum(x, weight, self.cfg.norm_eps, squares, width)

    def _normed_split(self, rec, projections: tuple, heads: tuple, split):
        """(q_normed, k_normed): the heads after QK-norm, recorded; the heads themselves without it.

        ``split(x, n_heads)`` is the strategy's own head split (B, N, n*Dk) -> (B, n, N, Dk):
        a projection-wide norm is taken before it, a per-head one after it.
        """
        cfg = self.cfg
        if cfg.qk_norm is None:
            return heads
        (q, k, _), (q_heads, k_heads) = projections, heads
        if cfg.qk_norm == "projection":
            normed = (
                split(self._norm_projection(q, "q"), cfg.n_heads),
                split(self._norm_projection(k, "k"), cfg.n_kv_heads),
            )
            how, parents = "F.rms_norm over the whole projection, then the same head split", (None, None)
        else:
            normed = rms_norm(q_heads, self.q_norm, cfg.norm_eps), rms_norm(k_heads, self.k_norm, cfg.norm_eps)
            how, parents = "F.rms_norm over each head's Dk features (one weight for every head)", ("q_heads", "k_heads")
        if rec is not None:
            for name, value, parent in zip(("q_normed", "k_normed"), normed, parents, strict=True):
                rec.record(name, value, HEADS_FIRST_SPLIT_AXES[name.replace("normed", "heads")], how, "new", parent)
        return normed

    def _rotate(self, x, which: str, head_axis: bool):
        """Query ("q") or key ("k") heads (..., N, Dk) with rotary applied; ``x`` itself without rope."""
        if self.rotary is None:
            return x
        cos, sin = self.rotary[which]  # (1|B, N, r/2)
        if head_axis:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (1|B, 1, N, r/2): the same angles for every head
        return rotate_last_axis(x, cos, sin, self.cfg.rope)

    def _rotate_split(self, rec, q_heads, k_heads):
        """(q_rotated, k_rotated) of the batched heads (B, H, N, Dk) (normed, with QK-norm), recorded when
        ``rec`` is given."""
        rotated = self._rotate(q_heads, "q", head_axis=True), self._rotate(k_heads, "k", head_axis=True)
        if rec is not None:
            record_rotated(rec, (q_heads, k_heads), rotated, HEADS_FIRST_SPLIT_AXES, ROTATE_HOW)
            if self.cfg.qk_norm is not None:  # turned from the normed heads, not the split ones
                for name, value, parent in zip(("q_rotated", "k_rotated"), rotated, (q_heads, k_heads), strict=True):
                    note, relation = (
                        (ROTATE_HOW, "new") if value is not parent else ("the normed heads, no rope", "view")
                    )
                    rec.record(name, value, HEADS_FIRST_SPLIT_AXES[name], note, relation, name[0] + "_normed")
        return rotated

    def _merge(self, context, rec):
        """Heads back side by side, (B, H, Nq, Dv) -> (B, Nq, H*Dv)."""
        B, H, Nq, Dv = context.shape
        merged = context.transpose(1, 2).contiguous().view(B, Nq, H * Dv)  # (B, Nq, H*Dv), copy unless H or Nq is 1
        if rec is not None:
            how = "transpose(1, 2).contiguous().view(B, N, H*Dv)"
            rec.record("merged", merged, ("B", "Nq", "H*Dv"), how, relation_to(merged, context), "context")
        return merged

    def _gated(self, merged, rec):
        """``merged`` (B, Nq, H*Dv) times the output gate ``sigmoid(F.linear(x_q, W_gate, b_gate))`` with
        ``attn_output_gate`` (a decode step's x_q is its own tokens: nothing cached for the gate); else itself."""
        if self.w_gate is None:
            return merged
        gate, gated = self.ops.output_gate(merged, self.F.linear(self.x_q, self.w_gate, self.b_gate))  # (B, Nq, H*Dv)
        if rec is not None:
            rec.record("gate", gate, ("B", "Nq", "H*Dv"), "torch.sigmoid(F.linear(x_q, W_gate, b_gate))")
        return gated  # what W_o reads

    def _finish(self, merged, rec):
        output = self.F.linear(self._gated(merged, rec), self.w_o, self.b_o)  # (B, Nq, D)
        if rec is not None:
            rec.record("output", output, ("B", "Nq", "D"), "F.linear(merged, W_o, b_o)")
        return output

    def _mask_and_softmax(self, scores, blocked, empty_rows, rec, head: int | None, out=None):
        """The score steps after the product (`frameworks.ops.score_steps` on torch's ops object), in place
        where autograd allows; the weights into ``out`` where given.

        Rows with no allowed key get zeros, never NaN. ``head`` None: all heads (B, H, Nq, Nk);
        else query head ``head``'s (B, Nq, Nk).
        """
        axes = ("B", "H", "Nq", "Nk") if head is None else ("B", "Nq", "Nk")
        self._record(
            rec, "scores", head, scores, axes, "baddbmm(q, k^T, alpha=scale): the scale fused into the product"
        )
        on_stage = None
        if rec is not None:

            def on_stage(name, value, parent, before):
                note = _step_note(name, value is before, parent, blocked is not None, self.sinks is not None)
                relation = "view" if value is before and name != "weights" else "new"
                self._record(rec, name, head, value, axes, note, relation, parent)

        bias = None if self.score_bias is None else self.score_bias(self.rel_bias, head=head)
        sinks = None
        if self.sinks is not None:
            sinks = self.sinks.view(-1, 1, 1) if head is None else self.sinks[head].view(1, 1)  # (H, 1, 1) or (1, 1)
        parts = {"bias": bias, "blocked": blocked, "empty_rows": empty_rows, "sinks": sinks}
        return score_steps(self.ops, self.cfg, scores, **parts, out=out, on_stage=on_stage)

    # -- batched heads: STANDARD and DIRECT_RESHAPE --------------------------------------
    def _split_and_rotate(self, rec, projections: tuple | None = None):
        """Projections (by default this layer's own) split into heads by view + transpose, then rotated, then
        what the scores read (`_scored_heads`): (q, k, v) heads, (B, H, Nq, Dk), (B, Hkv, Nk, Dk), (B, Hkv, Nk, Dv)."""
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        q, k, v = self._projections() if projections is None else projections
        q_heads = q.view(B, Nq, H, Dk).transpose(1, 2)  # (B, H, Nq, Dk), strided view
        k_heads = k.view(B, Nk, Hkv, Dk).transpose(1, 2)  # (B, Hkv, Nk, Dk)
        v_heads = v.view(B, Nk, Hkv, Dv).transpose(1, 2)  # (B, Hkv, Nk, Dv)
        if rec is not None:
            self._record_split(rec, (q, k, v), (q_heads, k_heads, v_heads), "view(B, N, H, d).transpose(1, 2)")

        def split(x, n):  # (B, N, n*Dk) -> (B, n, N, Dk), the same strided view
            return x.view(B, x.shape[1], n, Dk).transpose(1, 2)

        q_normed, k_normed = self._normed_split(rec, (q, k, v), (q_heads, k_heads), split)  # QK-norm
        q_rotated, k_rotated = self._rotate_split(rec, q_normed, k_normed)  # (B, H, Nq, Dk), (B, Hkv, Nk, Dk)
        return self._scored_heads(rec, q_rotated, k_rotated, v_heads)  # (B, H, Nq, Dk), (B, Hkv, Nk, Dk/Dv)

    def standard(self, rec: StageRecorder | None = None):
        q_rotated, k_rotated, v_heads = self._split_and_rotate(rec)
        context = self._attend_batched(q_rotated, k_rotated, v_heads, rec)  # (B, H, Nq, Dv)
        return self._finish(self._merge(context, rec), rec)

    def direct_reshape(self, rec: StageRecorder | None = None):
        """The known mistake: reshape (B, N, H*Dk) straight to (B, H, N, Dk), no transpose."""
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        q, k, v = self._projections()
        q_heads = q.view(B, H, Nq, Dk)  # (B, H, Nq, Dk): WRONG, head h gets tokens, not features
        k_heads = k.view(B, Hkv, Nk, Dk)  # (B, Hkv, Nk, Dk): WRONG
        v_heads = v.view(B, Hkv, Nk, Dv)  # (B, Hkv, Nk, Dv): WRONG
        if rec is not None:
            how = "the direct-reshape MISTAKE view(B, H, N, d), no transpose"
            self._record_split(rec, (q, k, v), (q_heads, k_heads, v_heads), how)

        def split(x, n):  # the same mistake on the normed projection
            return x.view(B, n, x.shape[1], Dk)

        q_normed, k_normed = self._normed_split(rec, (q, k, v), (q_heads, k_heads), split)  # QK-norm
        q_rotated, k_rotated = self._rotate_split(rec, q_normed, k_normed)  # (B, H, Nq, Dk), (B, Hkv, Nk, Dk)
        context = self._attend_batched(*self._scored_heads(rec, q_rotated, k_rotated, v_heads), rec)  # (B, H, Nq, Dv)
        merged = context.reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv): the mistake undone the same way
        if rec is not None:
            how = "the direct-reshape mistake undone"
            rec.record("merged", merged, ("B", "Nq", "H*Dv"), how, relation_to(merged, context), "context")
        return self._finish(merged, rec)

    def _attend_batched(self, q_heads, k_heads, v_heads, rec):
        """Scores, mask, softmax, weighted sum for all heads -> context (B, H, Nq, Dv)."""
        torch = self.torch
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes
        # Fold the G query heads of each kv head into the token axis (see the module docstring).
        q_groups = q_heads.reshape(B * Hkv, G * Nq, Dk)  # (B*Hkv, G*Nq, Dk), copy (a view of contiguous rotated heads)
        k_groups = k_heads.reshape(B * Hkv, Nk, Dk)  # (B*Hkv, Nk, Dk), copy
        v_groups = v_heads.reshape(B * Hkv, Nk, Dv)  # (B*Hkv, Nk, Dv), copy
        scores = torch.baddbmm(
            self.zero, q_groups, k_groups.transpose(1, 2), beta=0.0, alpha=self.cfg.scale, out=self.scores_buffer
        )  # (B*Hkv, G*Nq, Nk)
        scores = scores.view(B, H, Nq, Nk)  # (B, H, Nq, Nk)
        out = None if self.weights_buffer is None else self.weights_buffer.view(B, H, Nq, Nk)  # None: autograd
        weights = self._mask_and_softmax(scores, self.blocked, self.empty_rows, rec, head=None, out=out)
        context = torch.bmm(weights.view(B * Hkv, G * Nq, Nk), v_groups)  # (B*Hkv, G*Nq, Dv)
        context = context.view(B, H, Nq, Dv)  # (B, H, Nq, Dv)
        if rec is not None:
            rec.record(
                "context", context, ("B", "H", "Nq", "Dv"), "bmm(weights, v) with each group's queries folded together"
            )
        return context

    # -- one head at a time: SLICING and PER_HEAD -----------------------------------------
    def _attend_one_head(self, h: int, q_h, k_g, v_g, rec):
        """Attention of query head h: (B, Nq, Dk), (B, Nk, Dk), (B, Nk, Dv) -> (B, Nq, Dv)."""
        torch = self.torch
        scores = torch.baddbmm(self.zero, q_h, k_g.transpose(1, 2), beta=0.0, alpha=self.cfg.scale)  # (B, Nq, Nk)

        def head_slice(mask):  # (1|B, 1|H, Nq, n) -> (1|B, Nq, n)
            return None if mask is None else mask[:, 0 if mask.shape[1] == 1 else h]

        weights = self._mask_and_softmax(scores, head_slice(self.blocked), head_slice(self.empty_rows), rec, head=h)
        context = torch.bmm(weights, v_g)  # (B, Nq, Dv)
        self._record(rec, "context", h, context, ("B", "Nq", "Dv"), "bmm(weights_h, v_g)")
        return context

    def _normed_heads(self, rec, which: str, heads: list, merged=None) -> list:
        """One head at a time: the heads (B, N, Dk) after QK-norm (the heads themselves without it), recorded whole.

        A projection-wide norm needs every head's features: ``merged`` (SLICING: the merged
        projection, normed before it is sliced) or, without it (PER_HEAD: the strategy never
        builds the projection), the heads' sums of squares added up, one weight slice per head.
        """
        cfg = self.cfg
        if cfg.qk_norm is None:
            return heads
        weight, Dk = (self.q_norm if which == "q" else self.k_norm), cfg.d_k
        if cfg.qk_norm == "head":
            normed = [rms_norm(x, weight, cfg.norm_eps) for x in heads]
            how = "F.rms_norm of each head's Dk features"
        elif merged is not None:
            whole = self._norm_projection(merged, which)  # (B, N, n*Dk)
            normed = [whole[:, :, i * Dk : (i + 1) * Dk] for i in range(len(heads))]  # column slices, views
            how = "F.rms_norm over the whole projection, then column slices"
        else:
            squares = sum((x * x).sum(dim=-1, keepdim=True) for x in heads)  # (B, N, 1): over every head's features
            if self.norm_sum is not None:
                squares = self.norm_sum(squares, which)
            width = self.norm_widths[0 if which == "q" else 1]
            normed = [
                rms_norm_of_sum(x, weight[i * Dk : (i + 1) * Dk], cfg.norm_eps, squares, width)
                for i, x in enumerate(heads)
            ]
            how = "RMSNorm over the whole projection: the heads' sums of squares added up, each head its weight slice"
        if rec is not None:
            name, head_axis = f"{which}_normed", "H" if which == "q" else "Hkv"
            note = how + " (one head at a time, stacked for inspection)"
            rec.record(name, self.torch.stack(normed, 1), ("B", head_axis, "N" + which, "Dk"), note)
        return normed

    def _record_normed_rotation(self, rec, h: int, q_rotated, k_rotated) -> None:
        """With QK-norm, q_rotated and k_rotated are turned from the normed heads: say so (per head)."""
        if rec is None or self.cfg.qk_norm is None:
            return
        note, relation = (ROTATE_HOW, "new") if self.rotary is not None else ("the normed heads, no rope", "new")
        axes = self.HEAD_SLICE_AXES
        self._record(rec, "q_rotated", h, q_rotated, axes["q_rotated"], note, relation, "q_normed")
        self._record(rec, "k_rotated", self.cfg.kv_head_of(h), k_rotated, axes["k_rotated"], note, relation, "k_normed")

    def slicing(self, rec: StageRecorder | None = None):
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        q, k, v = self._projections()
        if rec is not None:
            self._record_projections(rec, q, k, v)
        contexts = []
        q_heads = [q[:, :, h * Dk : (h + 1) * Dk] for h in range(H)]  # H x (B, Nq, Dk): column slices, strided views
        k_heads = [k[:, :, g * Dk : (g + 1) * Dk] for g in range(Hkv)]  # Hkv x (B, Nk, Dk)
        q_normed = self._normed_heads(rec, "q", q_heads, q)  # the heads themselves without QK-norm
        k_normed = self._normed_heads(rec, "k", k_heads, k)
        # Each kv head's keys rotated once, before the loop over query heads.
        k_rotated = [self._rotate(k_g, "k", head_axis=False) for k_g in k_normed]
        v_heads = [v[:, :, g * Dv : (g + 1) * Dv] for g in range(Hkv)]  # Hkv x (B, Nk, Dv): column slices, views
        k_scored, v_read = self._scored_kv_heads(rec, k_rotated, v_heads)
        for h in range(H):
            g = h // G
            q_h, k_g = q_heads[h], k_heads[g]  # (B, Nq, Dk), (B, Nk, Dk)
            q_rotated = self._rotate(q_normed[h], "q", head_axis=False)  # (B, Nq, Dk)
            note = "column slice of the merged projection"
            self._record_query_head(rec, h, q_h, k_g, v_heads[g], q_rotated, k_rotated[g], note, "view")
            self._record_normed_rotation(rec, h, q_rotated, k_rotated[g])
            q_scored = self._after_rotary(rec, q_rotated, "q", h)  # (B, Nq, Dk)
            contexts.append(self._attend_one_head(h, q_scored, k_scored[g], v_read[g], rec))
        merged = self.torch.cat(contexts, dim=-1)  # (B, Nq, H*Dv): [C_0 | C_1 | ...]
        if rec is not None:
            rec.record("merged", merged, ("B", "Nq", "H*Dv"), "torch.cat of the heads' contexts", "copy", "context")
        return self._finish(merged, rec)

    def per_head(self, rec: StageRecorder | None = None):
        B, Nq, Nk, H, Hkv, G, Dk, Dv = self.sizes  # noqa: RUF059 (every size named once)
        # H x (B, Nq, Dk), Hkv x (B, Nk, Dk) and Hkv x (B, Nk, Dv): X @ W_h + b_h, each head its own matrix
        q_heads = [self._project_head(self.x_q, self.w_q_heads, self.b_q_heads, h) for h in range(H)]
        k_heads = [self._project_head(self.x_k, self.w_k_heads, self.b_k_heads, g) for g in range(Hkv)]
        v_heads = [self._project_head(self.x_v, self.w_v_heads, self.b_v_heads, g) for g in range(Hkv)]
        q_normed, k_normed = self._normed_heads(rec, "q", q_heads), self._normed_heads(rec, "k", k_heads)
        k_rotated = [self._rotate(k_g, "k", head_axis=False) for k_g in k_normed]  # Hkv x (B, Nk, Dk)
        k_scored, v_read = self._scored_kv_heads(rec, k_rotated, v_heads)
        head_note = "X @ W_h with the head's own matrix"
        contexts = []
        for h in range(H):
            g = h // G
            q_rotated = self._rotate(q_normed[h], "q", head_axis=False)  # (B, Nq, Dk)
            self._record_query_head(rec, h, q_heads[h], k_heads[g], v_heads[g], q_rotated, k_rotated[g], head_note)
            self._record_normed_rotation(rec, h, q_rotated, k_rotated[g])
            q_scored = self._after_rotary(rec, q_rotated, "q", h)  # (B, Nq, Dk)
            contexts.append(self._attend_one_head(h, q_scored, k_scored[g], v_read[g], rec))
        merged = self.torch.cat(contexts, dim=-1)  # (B, Nq, H*Dv): [C_0 | C_1 | ...]
        if rec is not None:
            note = "the per-head projections side by side, for inspection (the strategy never builds it)"
            self._record_joined_projections(rec, partial(self.torch.cat, dim=-1), note)
            rec.record("merged", merged, ("B", "Nq", "H*Dv"), "torch.cat of the heads' contexts", "copy", "context")
        return self._finish(merged, rec)

    @staticmethod
    def _project_head(x, w_heads, b_heads, head: int):
        y = x @ w_heads[head]  # (B, N, d): (B, N, in) @ (in, d)
        if b_heads is not None:
            y += b_heads[head]  # in place, (d,) broadcast over tokens
        return y
