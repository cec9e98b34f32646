"""The PyTorch layer: multi-head attention in row samples, the way ``nn.Linear`` code does it.

The row-sample layer's four head-split strategies (standard, direct_reshape, slicing, per_head), a method each,
and the steps they share: projections, rotary, merge and the output gate here; QK-norm in `heads`
(`RowHeadSteps`); scores, mask, softmax and weighted sum in `scores` (`RowScoreSteps`). One class joins them, so
that the strategies read top to bottom.

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
from mha_rosetta.core.variants import norm_step

from .._layouts import HEADS_FIRST_SPLIT_AXES, ROW_SAMPLE_PROJECTION_AXES, head_slice_axes, layer_sizes
from .._recording import LayerRecording, StageRecorder, relation_to
from ..frameworks.ops_torch import TorchOps
from ..frameworks.score_parts import part_names
from .common import (
    bool_tensor,
    optional_tensor,
    rotate_last_axis,
    temperature_table,
    torch_inputs,
    torch_rotary_tables,
)
from .heads import ROTATE_HOW, RowHeadSteps
from .scores import RowScoreSteps
from .variants import ScoreBias, SumReducer

HEAD_SLICE_AXES = head_slice_axes(HEADS_FIRST_SPLIT_AXES)  # q_heads: (B, Nq, Dk), the head axis stacked back in later


class RowSampleMHA(RowHeadSteps, RowScoreSteps, LayerRecording):
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
        # The variants' parameters (None when off): QK-norm weights (Dk,) or (H*Dk,)/(Hkv*Dk,), T5's table
        # (buckets, H), and by their names those the score steps read (`frameworks.score_parts`: one value per head).
        self.norm_step = norm_step(cfg)  # QK-norm's place and weight fields (`heads.RowHeadSteps` reads it), or None
        self.q_norm, self.k_norm = tensor(params.q_norm), tensor(params.k_norm)
        self.rel_bias = tensor(params.rel_bias)
        for name in part_names():
            setattr(self, name, tensor(getattr(params, name)))  # (H,)
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
        return temperature_table(self.cfg, positions, dtype, device)

    def _laid_out_factors(self, batched: bool):
        # (1|B, 1, Nq, 1) against the heads (B, H, Nq, Dk), or (1|B, Nq, 1) against one head's (B, Nq, Dk): views
        return self.factors[:, None, :, None] if batched else self.factors[:, :, None]

    def _projections(self):
        F = self.F
        q = F.linear(self.x_q, self.w_q, self.b_q)  # (B, Nq, H*Dk)
        k = F.linear(self.x_k, self.w_k, self.b_k)  # (B, Nk, Hkv*Dk)
        v = F.linear(self.x_v, self.w_v, self.b_v)  # (B, Nk, Hkv*Dv)
        return q, k, v

    def _rotate(self, x, which: str, head_axis: bool):
        """Query ("q") or key ("k") heads (..., N, Dk) with rotary applied; ``x`` itself without rope."""
        if self.rotary is None:
            return x
        cos, sin = self.rotary[which]  # (1|B, N, r/2)
        if head_axis:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (1|B, 1, N, r/2): the same angles for every head
        return rotate_last_axis(x, cos, sin, self.cfg.rope)

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

    # -- one head at a time: SLICING and PER_HEAD -----------------------------------------

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
