"""``numpy-best``: NumPy as its best users write it, forward, backward (by hand) and a grouped-GEMM decode step.

Row samples, ``x @ W + b`` with the weights stored ``(in, out)`` (transposed once, at prepare): a
one-row product reads them 18% faster than ``x @ W.T`` on the canonical ``(out, in)`` weight
(d_model 2048, float32, one core, CPU time: 0.65 against 0.79 ms a matrix). Measured, each choice
below, on this machine (loaded: figures are CPU time, the best of several rounds):

* The forward loops over (batch item, query head) and hands BLAS the head's column slices of the
  projections, ``q[b, :, h*Dk:(h+1)*Dk]`` (rows strided by ``H*Dk``, which BLAS reads as its leading
  dimension): no head transpose, no (B, H, N, N) score tensor, one (Nq, Nk) workspace reused by
  every head, and the context written straight into its columns of the merged heads; the scale goes
  on the queries, (Nq, H*Dk) numbers, not on every score. At B=4, N=512, D=512, H=8, float32: 80.9 ms
  (80 GFLOP/s, the GEMM peak about 100) against 90.5 ms (71) for NumPy's batched pipeline
  (DESIGN.md saw the same order: 96 against 77 GFLOP/s).
* NumPy has no autodiff: the backward is written by hand (`forward_backward`), the same loop.
* The decode step folds each group's query heads into the rows of one product per kv head,
  ``(B, Hkv, G*s, Dk) @ (B, Hkv, Dk, T)``, so each kv head's keys and values are read once per step,
  where a broadcast over the group reads them G times (16 GEMVs per step at 16 heads on 4 kv heads,
  issue 43). The cache is static, written in place and read up to the write index, in contiguous
  pages of `KV_BLOCK` slots, keys as columns ``(B, Hkv, P, Dk, L)``, values as rows ``(B, Hkv, P, L,
  Dv)``, one batched product per step over the pages. OpenBLAS's 4-row products with a 128-long
  contraction read one ``(Dk, C)`` key matrix at 3-7 GB/s past the cache (the Intel Xeon, one pinned
  core, where ``np.max`` reads 18.6), a NumPy limit to name; pages of one contiguous 128 KiB operand
  each read at 11 (the EPYC's step with the one matrix: 2.39 / 5.32 / 13.59 ms at 1k / 8k / 32k).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    MHAInputs,
    MHAParams,
    allowed_positions,
    apply_rotary,
    numpy_dtype,
    rotary_tables,
)

from .._layouts import ROW_SAMPLE_PROJECTION_AXES, TOKENS_FIRST_STAGE_AXES
from .._recording import StageRecorder, record_projections, record_rotated, record_split_heads, record_stages
from ..base import Backend, Prepared, PreparedDecode, PreparedVJP
from ..numpy.common import MaskArrays, softmax_inplace
from ..stage_cuts import CACHE_WRITE, eager_cuts, path_groups, reached
from .common import STATIC, BestPath, cache_info, decode_chunks, folded_allowed, output_stage
from .numpy_cache import CACHE_LAYOUT, KV_BLOCK, NumpyStaticCache

DECODE_LAYOUTS = {
    STATIC: f"{CACHE_LAYOUT} preallocated to the run's C tokens in P pages of L = 256 slots, each page contiguous "
    "(keys as columns, values as rows), written by slice assignment and read up to the write index by one batched "
    "product over the pages; each group's query heads folded into the rows of one product per kv head"
}
# Up to this many rows (B*N) a projection is ``W (out, in) @ x.T``: OpenBLAS packs W (in, out) for a few-row
# ``x @ W`` (the Xeon, 2048 x 2048, float32: 2-16 rows 1.83-2.27 ms as x @ W, 1.20-1.40 as W @ x.T; one row 0.53
# either way, so it keeps x @ W, which the EPYC read 18% faster).
FEW_ROWS = 16
# The score stages the forward's loop fills one (item, head) at a time, with how.
SCORE_STAGES = {
    "scores": "np.matmul(k_g, (q_h * scale).T) into one (Nk, Nq) workspace per (item, head), keys first; shown as "
    "its (Nq, Nk) transpose",
    "masked_scores": "np.copyto(-inf, where=blocked) in place",
    "weights": "softmax over the keys (axis 0 of the workspace) in place (numpy.common.softmax_inplace)",
}


class NumpyBestLayer:
    """One layer's parameters in the run's dtype (float32 or float64), and its forward, backward and decode step."""

    def __init__(self, cfg: MHAConfig, params: MHAParams, dtype: str) -> None:
        self.cfg, self.dtype = cfg, numpy_dtype(dtype)
        # The weights stored (in, out), transposed once here: x @ W reads them row by row.
        self.p = {
            name: None
            if value is None
            else np.ascontiguousarray(value.T if name.startswith("w_") else value, self.dtype)
            for name, value in params.as_dict().items()
        }
        self._canonical: dict[str, np.ndarray] = {}  # (out, in) copies, made by the first few-row product (`canonical`)

    def canonical(self, name: str) -> np.ndarray:
        """Projection ``name``'s weight as ``(out, in)``, contiguous: made on the first few-row product, then kept."""
        if name not in self._canonical:
            self._canonical[name] = np.ascontiguousarray(self.p[f"w_{name}"].T)  # (out, in): a copy, once
        return self._canonical[name]

    # -- the pieces every pass shares -------------------------------------------------------------
    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """``x @ W + b``, W stored (in, out), for projection ``name`` (q, k, v, o): (..., in) -> (..., out), a new array."""
        rows = x.reshape(-1, x.shape[-1])  # (R, in), R = B*N: a view of a contiguous x, else a copy
        if 1 < rows.shape[0] <= FEW_ROWS:  # a batched decode step: (out, in) @ (in, R), the orientation read fastest
            y = (self.canonical(name) @ rows.T).T.reshape(*x.shape[:-1], -1)  # (R, out) view -> (B, N, out) view
        else:
            y = x @ self.p[f"w_{name}"]  # W.T, stored (in, out)
        bias = self.p[f"b_{name}"]
        if bias is not None:
            y += bias
        return y

    def rotate(self, heads: np.ndarray, tables) -> np.ndarray:
        """Rotary on heads (B, N, n, Dk) with tables (cos, sin) (1|B, N, 1, r/2); the heads themselves without rope."""
        return heads if tables is None else apply_rotary(heads, *tables, self.cfg.rope)  # a new array

    def tables(self, tables, head_axis: bool = True):
        """(cos, sin) float64 (1|B, N, r/2) -> the run's dtype, with a head axis (1|B, N, 1, r/2); None stays."""
        if tables is None:
            return None
        return tuple(np.asarray(t[..., None, :] if head_axis else t, dtype=self.dtype) for t in tables)

    def heads(self, x_q, x_k, x_v, q_tables, k_tables, until: str | None = None):
        """Projections (B, N, n*d), their heads (B, N, n, d), views, and the rotated q and k heads.

        ``until``: a breakdown stage to stop after (`stage_cuts.reached`), None to run on (module docstring)."""
        cfg = self.cfg
        q, k, v = self.linear(x_q, "q"), self.linear(x_k, "k"), self.linear(x_v, "v")  # (B, N, n*d)
        reached(until, "projections", q, k, v)
        q_heads = q.reshape(*q.shape[:2], cfg.n_heads, cfg.d_k)  # (B, Nq, H, Dk), a view
        k_heads = k.reshape(*k.shape[:2], cfg.n_kv_heads, cfg.d_k)  # (B, Nk, Hkv, Dk), a view
        v_heads = v.reshape(*v.shape[:2], cfg.n_kv_heads, cfg.d_v)  # (B, Nk, Hkv, Dv), a view
        reached(until, "head split", q_heads, k_heads, v_heads)
        rotated = self.rotate(q_heads, q_tables), self.rotate(k_heads, k_tables)
        reached(until, "rotary", *rotated)
        return (q, k, v), (q_heads, k_heads, v_heads), rotated

    # -- the forward ----------------------------------------------------------------------------------
    def forward(
        self, x_q, x_k, x_v, q_tables, k_tables, mask: MaskArrays | None, rec: StageRecorder | None = None, until=None
    ):
        """(B, Nq, D): one BLAS product per (batch item, head) on the heads' column slices.

        ``mask``: the blocked positions (1|B, 1|H, Nq, Nk) and empty rows, or None; ``until``: a breakdown stage
        to stop after (`stage_cuts.reached`; the loop's score stages stop each (item, head) there).
        """
        projections, heads, (q_rotated, k_rotated) = self.heads(x_q, x_k, x_v, q_tables, k_tables, until)
        B, Nq, H, _ = q_rotated.shape
        shape = (B, H, Nq, k_rotated.shape[1])
        dump = None if rec is None else {name: np.empty(shape, self.dtype) for name in SCORE_STAGES}
        context = self._attend(q_rotated, k_rotated, heads[2], mask, dump, until)  # (B, Nq, H, Dv)
        reached(until, "context", context)
        merged = context.reshape(B, Nq, -1)  # (B, Nq, H*Dv), a view
        reached(until, "merge", merged)
        output = self.linear(merged, "o")  # (B, Nq, D)
        if rec is not None and dump is not None:
            record_projections(rec, projections, ROW_SAMPLE_PROJECTION_AXES, "x @ W + b, W stored (in, out)")
            axes = TOKENS_FIRST_STAGE_AXES
            record_split_heads(rec, projections, heads, axes, "reshape(B, N, n, d): head h owns columns h*d:(h+1)*d")
            record_rotated(rec, heads[:2], (q_rotated, k_rotated), axes, "core.apply_rotary on (B, N, n, d)")
            for name, note in SCORE_STAGES.items():
                rec.record(name, dump[name], axes[name], note)
            rec.record("context", context, axes["context"], "np.matmul(weights, v_g, out=its columns of merged)")
            rec.record("merged", merged, axes["merged"], "reshape(B, Nq, H*Dv) of the context", "view", "context")
            rec.record("output", output, axes["output"], "merged @ W_o + b_o, W_o stored (in, out)")
        return output

    def _attend(self, q_rotated, k_rotated, v_heads, mask: MaskArrays | None, dump: dict | None = None, until=None):
        """Every (batch item, head): scores into one workspace, mask, softmax, context into its columns (B, Nq, H, Dv).

        ``dump``: arrays (B, H, Nq, Nk) by the names of `SCORE_STAGES` to copy those stages into (untimed
        passes: the stage dump, the backward's weights), or None. ``until`` "scores" or "softmax": every
        (item, head) stops after that stage (a cut of the loop: the rest of each iteration is not run).
        """
        cfg = self.cfg
        B, Nq, H, _ = q_rotated.shape
        Nk = k_rotated.shape[1]
        q_scaled = q_rotated * self.dtype.type(cfg.scale)  # (B, Nq, H, Dk): the scale on Nq*H*Dk numbers
        context = np.empty((B, Nq, H, cfg.d_v), dtype=self.dtype)  # every head's columns, side by side
        # One workspace for every (item, head), keys first, (Nk, Nq): the softmax then reduces over its rows, which
        # NumPy does element-wise across each row (the core 20.7-20.8 ms against 23.3-23.5 queries first; B=4,
        # N=512, H=8, d=64, float32, one core, two runs; 19.9 against 21.5 on two threads). ``scores`` is its
        # (Nq, Nk) transpose, a view: the mask, the dumps and the context product read that.
        scores_t = np.empty((Nk, Nq), dtype=self.dtype)
        scores = scores_t.T  # (Nq, Nk), a view
        dump = dump or {}

        def keep(name: str, b: int, h: int) -> None:
            if name in dump:
                dump[name][b, h] = scores

        only_scores, up_to_softmax = until == "scores", until in ("scores", "softmax")
        for h in range(H):
            g = cfg.kv_head_of(h)
            head_mask = None if mask is None else mask.for_head(h)
            for b in range(B):
                np.matmul(k_rotated[b, :, g], q_scaled[b, :, h].T, out=scores_t)  # (Nk, Nq)
                keep("scores", b, h)
                if only_scores:
                    continue
                empty = None
                if head_mask is not None:
                    np.copyto(scores, -np.inf, where=_item(head_mask.blocked, b))  # (Nq, Nk) through the view
                    empty = None if head_mask.empty_rows is None else _item(head_mask.empty_rows, b).T  # (1, Nq)
                keep("masked_scores", b, h)
                softmax_inplace(scores_t, empty, axis=0)
                keep("weights", b, h)
                if up_to_softmax:
                    continue
                np.matmul(scores, v_heads[b, :, g], out=context[b, :, h])  # (Nq, Dv), into its columns
        reached(until, "scores", scores)
        reached(until, "softmax", scores)
        return context

    # -- the backward, by hand ------------------------------------------------------------------------
    def forward_backward(self, x_q, x_k, x_v, q_tables, k_tables, mask: MaskArrays | None, d_output) -> dict:
        """The gradients of ``<d_output, forward(...)>`` (the formulas of `core.grad`), the forward's loop again.

        Returns ``d_x_q``, ``d_x_k``, ``d_x_v`` (B, N, F) and the parameters' gradients in the canonical
        ``(out, in)`` layout (biases only where the layer has them).
        """
        cfg = self.cfg
        _, (_, _, v_heads), (q_rotated, k_rotated) = self.heads(x_q, x_k, x_v, q_tables, k_tables)
        B, Nq, H, _ = q_rotated.shape
        Nk = k_rotated.shape[1]
        weights = np.empty((B, H, Nq, Nk), dtype=self.dtype)  # kept for the backward
        context = self._attend(q_rotated, k_rotated, v_heads, mask, {"weights": weights})  # (B, Nq, H, Dv)
        merged = context.reshape(B, Nq, -1)  # (B, Nq, H*Dv)
        grads = {"w_o": _weight_grad(d_output, merged)}
        d_context = (d_output @ self.p["w_o"].T).reshape(B, Nq, H, cfg.d_v)  # (B, Nq, H, Dv)
        d_q = np.empty_like(q_rotated)  # (B, Nq, H, Dk)
        d_k = np.zeros_like(k_rotated)  # (B, Nk, Hkv, Dk): the group's query heads add up
        d_v = np.zeros_like(v_heads)  # (B, Nk, Hkv, Dv)
        d_scores = np.empty((Nq, Nk), dtype=self.dtype)
        for h in range(H):
            g = cfg.kv_head_of(h)
            for b in range(B):
                a, d_c = weights[b, h], d_context[b, :, h]  # (Nq, Nk), (Nq, Dv)
                np.matmul(d_c, v_heads[b, :, g].T, out=d_scores)  # d_weights
                d_v[b, :, g] += a.T @ d_c
                d_scores -= np.sum(d_scores * a, axis=-1, keepdims=True)  # softmax backward: A * (dA - rowsum)
                d_scores *= a
                d_scores *= cfg.scale
                np.matmul(d_scores, k_rotated[b, :, g], out=d_q[b, :, h])
                d_k[b, :, g] += d_scores.T @ q_rotated[b, :, h]
        if q_tables is not None:  # a rotation's transpose: the same tables with sin negated
            d_q = apply_rotary(d_q, q_tables[0], -q_tables[1], cfg.rope)
            d_k = apply_rotary(d_k, k_tables[0], -k_tables[1], cfg.rope)
        for name, d, x in (("q", d_q, x_q), ("k", d_k, x_k), ("v", d_v, x_v)):
            d = d.reshape(B, d.shape[1], -1)  # (B, N, n*d)
            grads[f"d_x_{name}"] = d @ self.p[f"w_{name}"].T  # (B, N, in): the canonical (out, in) weight
            grads[f"w_{name}"] = _weight_grad(d, x)
            if self.p[f"b_{name}"] is not None:
                grads[f"b_{name}"] = d.sum(axis=(0, 1))
        if self.p["b_o"] is not None:
            grads["b_o"] = d_output.sum(axis=(0, 1))
        return grads

    # -- the decode step ------------------------------------------------------------------------------
    def decode_step(self, cache: NumpyStaticCache, x, start: int, tables, folded: MaskArrays | None, until=None):
        """Tokens ``x`` (B, s, D) written to slots ``start .. start+s-1``, then attending over slots ``0 ..
        start+s-1``: (B, s, D). ``tables`` (cos, sin) (1|B, s, 1, r/2) or None; ``folded``: the mask of
        the folded query rows (B, 1, G*s, T) (`common.folded_allowed`), or None when every slot is seen;
        ``until``: a breakdown stage to stop after (`stage_cuts.reached`), None to run it all."""
        cfg = self.cfg
        B, s = x.shape[:2]
        Hkv, G = cfg.n_kv_heads, cfg.group_size
        _, (_, _, v_heads), (q_rotated, k_rotated) = self.heads(x, x, x, tables, tables, until)
        stop = start + s
        cache.write(start, k_rotated.transpose(0, 2, 1, 3), v_heads.transpose(0, 2, 1, 3))  # (B, Hkv, s, D) views
        reached(until, CACHE_WRITE, cache.k, cache.v)
        q = (q_rotated * self.dtype.type(cfg.scale)).reshape(B, s, Hkv, G, cfg.d_k)  # (B, s, Hkv, G, Dk)
        q = q.transpose(0, 2, 3, 1, 4).reshape(B, Hkv, G * s, cfg.d_k)  # (B, Hkv, G*s, Dk): a copy of s*H*Dk numbers
        pages = -(-stop // KV_BLOCK)  # the pages up to the write index
        paged = np.empty((B, Hkv, G * s, pages, KV_BLOCK), dtype=self.dtype)  # (B, Hkv, G*s, P, L)
        # One batched product, a page at a time: (B, Hkv, 1, G*s, Dk) @ (B, Hkv, P, Dk, L) into the
        # (B, Hkv, P, G*s, L) view of the scores, so that each query's scores lie in one row of P*L slots.
        np.matmul(q[:, :, None], cache.k[:, :, :pages], out=paged.transpose(0, 1, 3, 2, 4))
        scores = paged.reshape(B, Hkv, G * s, pages * KV_BLOCK)  # (B, Hkv, G*s, P*L): a view
        scores[..., stop:] = -np.inf  # the last page's slots past the write index: never written this run
        reached(until, "scores", scores[..., :stop])
        empty = None
        if folded is not None:
            np.copyto(scores[..., :stop], -np.inf, where=folded.blocked)
            empty = folded.empty_rows
        softmax_inplace(scores, empty)
        reached(until, "softmax", scores[..., :stop])
        # (B, Hkv, P, G*s, L) @ (B, Hkv, P, L, Dv): each page's values once, then the pages summed: (B, Hkv, G*s, Dv)
        context = np.matmul(paged.transpose(0, 1, 3, 2, 4), cache.v[:, :, :pages]).sum(axis=2)
        reached(until, "context", context)
        merged = context.reshape(B, Hkv, G, s, cfg.d_v).transpose(0, 3, 1, 2, 4).reshape(B, s, -1)  # (B, s, H*Dv)
        reached(until, "merge", merged)
        return self.linear(merged, "o")  # (B, s, D)


def _item(array: np.ndarray, b: int) -> np.ndarray:
    """Batch item ``b`` of a (1|B, ...) array."""
    return array[b if array.shape[0] > 1 else 0]


def _weight_grad(d_y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``y = x @ W.T``: dW (out, in) = dY^T X over every token of every item."""
    return d_y.reshape(-1, d_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])


def folded_mask(chunk_allowed: np.ndarray | None, group: int) -> MaskArrays | None:
    return None if chunk_allowed is None else MaskArrays.from_allowed(folded_allowed(chunk_allowed, group))


def _forward_inputs(layer: NumpyBestLayer, cfg: MHAConfig, inputs: MHAInputs) -> tuple:
    """(x_q, x_k, x_v, q_tables, k_tables, mask) in the run's dtype: what `forward` and the backward take."""
    cast = {id(a): np.ascontiguousarray(a, dtype=layer.dtype) for a in (inputs.query, inputs.key, inputs.value)}
    x_q, x_k, x_v = (cast[id(a)] for a in (inputs.query, inputs.key, inputs.value))  # one array per distinct input
    tables = rotary_tables(cfg, inputs)
    q_tables = None if tables is None else layer.tables((tables.q_cos, tables.q_sin))
    k_tables = None if tables is None else layer.tables((tables.k_cos, tables.k_sin))
    mask = MaskArrays.from_allowed(allowed_positions(cfg, inputs))  # (1|B, 1|H, Nq, Nk) blocked, empty rows
    return x_q, x_k, x_v, q_tables, k_tables, mask


class NumpyBestBackend(BestPath, Backend):
    name = "numpy-best"
    convention = (
        "NumPy at its best: x @ W on row samples (W stored (in, out)), one BLAS product per (item, head) on the "
        "heads' column slices; a hand-written backward; decoding a static cache with each group's query heads folded "
        "into one GEMM per kv head"
    )
    peer_limits: ClassVar[dict[str, str]] = {
        "decode at B=4": "with four sequences NumPy's BLAS (OpenBLAS) reads the projection weights slower than torch's "
        "and XLA's products: a 2048 x 2048 weight over 4 rows in 1.03-1.14 ms as W_(out,in) @ x.T, numpy-best's form "
        "(1.38-1.41 as x @ W_(in,out)), against 0.79-0.92 for torch's F.linear on a weight stored (in, out) and "
        "0.76-0.82 for XLA's x @ W (`scripts/projection-costs`, one pinned core, two runs); at 1k the four weights "
        "(40 MiB) are 71% of what a step reads, and its projections 2.8 of its 3.9 ms (`bench --breakdown`; Intel "
        "Xeon; measured, issue 43)",
        "forward": "NumPy has no fused attention kernel: its softmax is five ufunc passes over every (item, head)'s "
        "scores (max, shift, exp, sum, scale: 0.85-0.88 ns a score keys first, 7.2-7.4 ms of its 19.9-20.2 ms core "
        "at the reference size, and no faster on two threads, since NumPy's ufuncs run on one), where its "
        "per-(item, head) products alone take 12.5 ms, under torch's whole fused SDPA core (13.4-13.7 ms; "
        "8.8-9.5 against 7.7 on two threads, where OpenBLAS's 512 x 512 x 64 products gain 1.3-1.4x) "
        "(`scripts/attention-core-costs`, two runs each; Intel Xeon; measured, issue 43)",
    }
    decode_layouts = DECODE_LAYOUTS

    def _prepare(self, cfg, params, inputs, dtype, device, strategy) -> Prepared:
        layer = NumpyBestLayer(cfg, params, dtype)
        args = _forward_inputs(layer, cfg, inputs)

        def run(rec: StageRecorder | None):
            return layer.forward(*args, rec)

        groups = path_groups(rope=cfg.rope is not None, decode=False, fused=False)
        cuts = eager_cuts(lambda until: layer.forward(*args, None, until), groups, lambda result: None)
        info = {"layout": "row samples (B, tokens, features)", "loop": "(batch item, head) on column slices"}
        return Prepared(lambda: run(None), np.asarray, lambda: record_stages(run), info=info, stage_cuts=cuts)

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy) -> PreparedVJP:
        layer = NumpyBestLayer(cfg, params, dtype)
        x_q, x_k, x_v, q_tables, k_tables, mask = _forward_inputs(layer, cfg, inputs)
        d_output = np.ascontiguousarray(cotangent, dtype=layer.dtype)  # (B, Nq, D)

        def run():
            return layer.forward_backward(x_q, x_k, x_v, q_tables, k_tables, mask, d_output)

        info = {"backward": "by hand (NumPy has no autodiff): the forward's loop over (item, head), then back"}
        return PreparedVJP(run, lambda grads: {name: np.asarray(g) for name, g in grads.items()}, info=info)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache) -> PreparedDecode:
        layer = NumpyBestLayer(cfg, params, dtype)
        x = np.ascontiguousarray(inputs.x, dtype=layer.dtype)  # (B, N, D)
        group = cfg.group_size
        # Each chunk's first slot, tokens (B, s, D) (a view), tables (1|B, s, 1, r/2) or None, and folded mask.
        calls = [
            (chunk.start, x[:, chunk.start : chunk.stop], layer.tables(chunk.tables), folded_mask(chunk.allowed, group))
            for chunk in decode_chunks(cfg, inputs)
        ]
        slots = -(-inputs.tokens // KV_BLOCK) * KV_BLOCK  # whole pages, as `NumpyStaticCache` allocates them
        info = {"cache": cache_info(cfg, inputs.batch, slots, layer.dtype.itemsize, CACHE_LAYOUT)}

        def run():
            kv = NumpyStaticCache(cfg, inputs.batch, inputs.tokens, layer.dtype)  # a fresh cache per run
            return [layer.decode_step(kv, x_chunk, start, tables, mask) for start, x_chunk, tables, mask in calls]

        return PreparedDecode(run, lambda outputs: np.concatenate(outputs, axis=1), info=info)

    def prepare_step(self, cfg, params, data, dtype, device) -> Prepared:
        batch, context, step = data.x.shape[0], data.context, data.step
        layer = NumpyBestLayer(cfg, params, dtype)
        kv = NumpyStaticCache(cfg, batch, context + step, layer.dtype)
        kv.write(0, data.k, data.v)  # (B, Hkv, context, D) each
        x = np.ascontiguousarray(data.x, dtype=layer.dtype)  # (B, s, D)
        tables = layer.tables(data.tables)
        mask = folded_mask(data.allowed, cfg.group_size)

        def forward(until: str | None = None):  # every call writes the same slots: each timed call is the same step
            return layer.decode_step(kv, x, context, tables, mask, until)

        cuts = eager_cuts(forward, path_groups(rope=cfg.rope is not None, decode=True, fused=False), lambda r: None)
        info = {"cache": kv.info(cfg), "context": context, "step": step}
        return Prepared(forward, np.asarray, lambda: output_stage(forward()), info=info, stage_cuts=cuts)
