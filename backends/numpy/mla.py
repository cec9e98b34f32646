"""DeepSeek's multi-head latent attention (MLA) in column samples: the NumPy adapter's ``naive`` and ``absorbed``.

Column samples as in `layer`: every token is a column, ``Y = W @ X + b``. Where the latent lives:

* ``W_kva @ X`` is ``(B, R + dr, N)``: rows ``:R`` are the latent ``c`` (one column per token, RMS-normed down
  each column), rows ``R:`` the one rotary key ``k_pe`` every head shares. The cache (`decode`) keeps exactly
  these ``R + dr`` rows, ``(B, R + dr, T)``: the latent's columns are the cached tokens, appended on the last axis;
* the naive form expands each head's keys and values from those columns, ``W_UK @ C`` ``(B, H*dn, T)`` and
  ``W_UV @ C`` ``(B, H*dv, T)``, split by a reshape of the row axis like every head split here (no transpose);
  the shared key ``k_rope`` ``(B, dr, T)`` is read by every head through a broadcast head axis ``(B, 1, dr, T)``;
* the absorbed form never forms a per-head key or value: each head's query ``W_UK_h^T @ q_nope_h`` ``(R, Nq)``
  stacked over its rotated part is ``(B, H, R + dr, Nq)``, and the cache ``(B, R + dr, T)`` itself is the one key
  head, ``K^T @ Q`` ``(T, Nq)`` per head: multi-query attention with no repetition. The context stays in the
  latent, ``C @ A_h`` ``(R, Nq)``, and ``W_O_h @ W_UV_h`` ``(D, R)`` (folded once, when the layer is prepared)
  brings it out.

The scores are ``(B, H, Nk, Nq)``, one column per query, and go through NumPy's ops object like every path
(`frameworks.ops.score_steps`: the softcap, the positional masks, the softmax over keys on axis -2). Mistral 4's
temperature (`backends._mla.QUERY_STEPS`) multiplies each query column of both parts, ``q_nope`` and the rotated
``q_rot``, by its position's factor (``(1|B, 1, 1, N)``, the cache offset included on a decode step).
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions, rotary_tables
from mha_rosetta.core.variants.mla_heads import check_one_input

from .._inputs import convert_inputs
from .._mla import ABSORBED, NAIVE
from .._recording import StageRecorder, record_stages
from ..base import Prepared
from ..frameworks.ops import score_steps, temperature_factors
from ..frameworks.ops_numpy import NumpyOps
from .common import MaskArrays, NumpyPrecision
from .heads import columns_to_rows, rotate_rows
from .variants import rms_norm_rows

SCORE_AXES = ("B", "H", "Nk", "Nq")


def column_tables(cfg: MHAConfig, inputs) -> dict | None:
    """The rotary tables as columns, ``{"q": (cos, sin), "k": (cos, sin)}`` each ``(1|B, dr/2, N)``, or None."""
    tables = rotary_tables(cfg, inputs)
    if tables is None:
        return None

    def columns(a):  # (1|B, N, dr/2) -> (1|B, dr/2, N): one column per token, like the data
        return np.ascontiguousarray(a.transpose(0, 2, 1))

    return {
        "q": (columns(tables.q_cos), columns(tables.q_sin)),
        "k": (columns(tables.k_cos), columns(tables.k_sin)),
    }


def column_factors(cfg: MHAConfig, positions) -> np.ndarray | None:
    """The temperature's factors of the query ``positions`` (1|B, N) laid out against the query columns
    (B, H, d, N): ``(1|B, 1, 1, N)`` float64, or None without the temperature."""
    factors = temperature_factors(cfg, positions)  # (1|B, N)
    return None if factors is None else factors[:, None, None, :]


class ColumnSampleMLA:
    """One MLA layer's parameters converted once to column samples, and the steps of both forms.

    The pieces (`latent`, `queries`, `attend`) serve the forward (`MLAForward`), the decode path (`mla_decode`)
    and the hand-written backward (`mla_vjp`), so the three read the same arithmetic. ``factors``: the temperature's
    (`column_factors` of the positions ``tables`` were made for), or None.
    """

    def __init__(
        self, cfg: MHAConfig, params: MHAParams, precision: NumpyPrecision, tables: dict | None, factors=None
    ) -> None:
        self.cfg, self.precision, self.rotary, self.factors = cfg, precision, tables, factors
        P = precision
        self.ops = NumpyOps(precision.name, keys_axis=-2)  # the score steps, over keys on axis -2
        self.round = lambda a: P.operand(P.store(a))  # a stage rounded to storage, kept in the compute dtype

        def weight(w):
            return None if w is None else P.operand(P.round_to_storage(w))

        def column(b):  # (out,) -> (out, 1): broadcast over the token columns
            return None if b is None else weight(b)[:, None]

        p = params
        self.w_q, self.w_uk, self.w_uv, self.w_o = (weight(w) for w in (p.w_q, p.w_k, p.w_v, p.w_o))
        self.w_q_a, self.w_kv_a = weight(p.w_q_a), weight(p.w_kv_a)
        self.b_q_a, self.b_kv_a, self.b_o = column(p.b_q_a), column(p.b_kv_a), column(p.b_o)
        self.q_a_norm, self.kv_a_norm = column(p.q_a_norm), column(p.kv_a_norm)  # (Rq, 1), (R, 1)
        H, dn, dv, R = cfg.n_heads, cfg.qk_nope_head_dim, cfg.d_v, cfg.kv_lora_rank
        # The absorbed form's folded weights, once: W_UK_h^T (R, dn) per head, and W_O_h W_UV_h (D, R) per head.
        self.w_uk_t = np.ascontiguousarray(self.w_uk.reshape(H, dn, R).transpose(0, 2, 1))  # (H, R, dn)
        w_o_heads = self.w_o.reshape(-1, H, dv).transpose(1, 0, 2)  # (H, D, dv) view: columns h*dv:(h+1)*dv
        self.w_ouv = self.round(np.matmul(w_o_heads, self.w_uv.reshape(H, dv, R)))  # (H, D, R)

    # -- the pieces -------------------------------------------------------------------------------
    def project(self, w, b, x):
        """``W @ X + b`` for every batch item: (out, in) @ (B, in, N) -> (B, out, N)."""
        y = np.matmul(w, x)
        return self.round(y if b is None else y + b)

    def rotate(self, x, which: str, tokens: slice | None = None, sign: float = 1.0):
        """``x`` (B, [H,] dr, N) turned by the query ("q") or key ("k") angles of ``tokens`` (all columns: None);
        ``sign`` -1 turns it back (the rotation's transpose: the backward)."""
        if self.rotary is None:
            return x
        cos, sin = self.rotary[which]  # (1|B, dr/2, N)
        if tokens is not None:
            cos, sin = cos[..., tokens], sin[..., tokens]  # (1|B, dr/2, s) views: a decode chunk's columns
        if x.ndim == 4:
            cos, sin = cos[:, None], sin[:, None]  # (1|B, 1, dr/2, N): the same angles for every head
        return self.precision.operand(rotate_rows(x, cos, sign * sin, self.cfg.rope, self.precision))

    def temper(self, x, tokens: slice | None = None):
        """Query columns ``x`` (B, H, d, N) times their positions' temperature factors (the columns ``tokens``), rounded
        like every stage; ``x`` itself without the temperature. Its own backward: the factor is a diagonal map."""
        if self.factors is None:
            return x
        factors = self.factors if tokens is None else self.factors[..., tokens]  # (1|B, 1, 1, s) view
        return self.precision.operand(self.ops.temper_queries(x, factors))

    def latent(self, x, tokens: slice | None = None) -> dict:
        """What the cache holds for the token columns ``x`` (B, D, N): ``kv_latent`` (B, R, N), ``k_rope`` (B, dr, N),
        with the pre-norm ``c`` and the unrotated ``k_pe`` (row views of ``W_kva @ X``) for the backward."""
        R, P = self.cfg.kv_lora_rank, self.precision
        kv_a = self.project(self.w_kv_a, self.b_kv_a, x)  # (B, R + dr, N)
        c, k_pe = kv_a[:, :R], kv_a[:, R:]  # (B, R, N), (B, dr, N): row-block views
        kv_latent = P.operand(rms_norm_rows([c], [self.kv_a_norm], self.cfg.norm_eps, P)[0])  # down each column
        return dict(c=c, k_pe=k_pe, kv_latent=kv_latent, k_rope=self.rotate(k_pe, "k", tokens))

    def queries(self, x, tokens: slice | None = None) -> dict:
        """``q_a`` and ``q_latent`` (with q_lora_rank), ``q`` (B, H*Dk, N), ``q_nope`` (B, H, dn, N) and the rotated
        ``q_rot`` (B, H, dr, N), both tempered with the temperature (`temper`)."""
        cfg, P = self.cfg, self.precision
        out: dict = {}
        source = x
        if self.w_q_a is not None:
            out["q_a"] = self.project(self.w_q_a, self.b_q_a, x)  # (B, Rq, N)
            source = out["q_latent"] = P.operand(rms_norm_rows([out["q_a"]], [self.q_a_norm], cfg.norm_eps, P)[0])
        q = out["q"] = self.project(self.w_q, None, source)  # (B, H*Dk, N): q_b_proj has no bias
        B, _, N = q.shape
        heads = q.reshape(B, cfg.n_heads, cfg.d_k, N)  # (B, H, Dk, N) view: head h owns rows h*Dk:(h+1)*Dk
        dn = cfg.qk_nope_head_dim
        out["q_nope"] = self.temper(heads[:, :, :dn], tokens)  # (B, H, dn, N) view (new when tempered)
        out["q_rot"] = self.temper(self.rotate(heads[:, :, dn:], "q", tokens), tokens)  # (B, H, dr, N), new
        return out

    def expand(self, kv_latent):
        """The naive form's per-head keys and values from the latent's columns: (B, H, dn, T), (B, H, dv, T)."""
        cfg = self.cfg
        B, _, T = kv_latent.shape
        k_nope = self.project(self.w_uk, None, kv_latent).reshape(B, cfg.n_heads, -1, T)  # (B, H, dn, T) view
        v = self.project(self.w_uv, None, kv_latent).reshape(B, cfg.n_heads, -1, T)  # (B, H, dv, T) view
        return k_nope, v

    def absorbed_queries(self, q_nope, q_rot):
        """``[W_UK_h^T @ q_nope_h ; q_rot_h]`` (B, H, R + dr, N): each head's query against the cache's rows."""
        q_latent = self.round(np.matmul(self.w_uk_t, q_nope))  # (H, R, dn) @ (B, H, dn, N) -> (B, H, R, N)
        return np.concatenate([q_latent, q_rot], axis=-2)  # (B, H, R + dr, N), a copy

    def scores(self, form: str, q: dict, kv_latent, k_rope, keys=None) -> np.ndarray:
        """``scale * K_h^T @ Q_h`` (B, H, T, N), one column per query; the absorbed form's queries kept in ``q``.

        ``keys``: the rows ``[kv_latent ; k_rope]`` (B, R + dr, T) where they are one array already (the cache).
        """
        scale = self.cfg.scale
        if form == ABSORBED:
            if keys is None:
                keys = np.concatenate([kv_latent, k_rope], axis=-2)  # (B, R + dr, T), a copy
            keys = keys[:, None]  # (B, 1, R + dr, T) view: the one key head, every head reads it
            q["absorbed"] = self.absorbed_queries(q["q_nope"], q["q_rot"])  # (B, H, R + dr, N)
            return self.round(scale * np.matmul(keys.swapaxes(-1, -2), q["absorbed"]))  # (B, H, T, N)
        k_nope, _ = q["expanded"] = self.expand(kv_latent)
        nope = np.matmul(k_nope.swapaxes(-1, -2), q["q_nope"])  # (B, H, T, dn) @ (B, H, dn, N)
        rope = np.matmul(k_rope[:, None].swapaxes(-1, -2), q["q_rot"])  # (B, 1, T, dr): the shared key, broadcast
        return self.round(scale * (nope + rope))

    def weights(self, scores, mask: MaskArrays | None, rec=None, saved: dict | None = None):
        """The score steps on NumPy's ops object (the softcap, the masks, the softmax over keys, axis -2)."""
        on_stage = None
        if rec is not None:
            rec.record("scores", scores, SCORE_AXES, "scale * K_h^T @ Q_h, one column per query")

            def on_stage(name, value, parent, before):
                rec.record(name, value, SCORE_AXES, f"{name}, in place", "view", parent)

        blocked, empty = (None, None) if mask is None else (mask.blocked, mask.empty_rows)
        weights = score_steps(
            self.ops, self.cfg, scores, blocked=blocked, empty_rows=empty, on_stage=on_stage, saved=saved
        )
        return self.precision.operand(weights)  # (B, H, T, N)

    def output(self, form: str, q: dict, weights, kv_latent):
        """(the output (B, D, N), the context: (B, H, dv, N) naive, (B, H, R, N) absorbed, still in the latent)."""
        B, H, _, N = weights.shape
        if form == ABSORBED:
            context = self.round(np.matmul(kv_latent[:, None], weights))  # (B, 1, R, T) @ (B, H, T, N): C @ A_h
            y = np.matmul(self.w_ouv, context).sum(axis=1)  # sum_h (W_O_h W_UV_h) @ context_h: (B, D, N)
        else:
            _, v = q["expanded"]  # (B, H, dv, T)
            context = self.round(np.matmul(v, weights))  # (B, H, dv, N): V_h @ A_h
            y = np.matmul(self.w_o, context.reshape(B, H * self.cfg.d_v, N))  # merged (B, H*dv, N) view
        return self.round(y if self.b_o is None else y + self.b_o), context

    def attend(self, form: str, q: dict, kv_latent, k_rope, mask, rec=None, saved=None, keys=None):
        """Queries ``q`` over the latent columns (B, R, T) and the shared key (B, dr, T): (output, context, weights).
        ``rec``: the score steps and (naive) the expanded values and the context, each when it is made."""
        scores = self.scores(form, q, kv_latent, k_rope, keys)
        if rec is not None and form == NAIVE:
            _record_values(rec, q["expanded"][1])
        weights = self.weights(scores, mask, rec, saved)
        out, context = self.output(form, q, weights, kv_latent)
        if rec is not None and form == NAIVE:
            _record_context(rec, context)
        return out, context, weights


class MLAForward:
    """The forward of one layer and one set of inputs: `ColumnSampleMLA` and the inputs as columns, converted once."""

    def __init__(self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, precision: NumpyPrecision) -> None:
        check_one_input(inputs.key, inputs.value)  # one latent of the key tokens: value must be the key
        factors = column_factors(cfg, inputs.positions)  # Mistral 4's temperature, or None
        self.layer = ColumnSampleMLA(cfg, params, precision, column_tables(cfg, inputs), factors)
        P = precision

        def columns(x):  # (B, N, F) rows -> (B, F, N) columns, contiguous
            return np.ascontiguousarray(P.operand(P.round_to_storage(x)).transpose(0, 2, 1))

        self.x_q, self.x_k, _ = convert_inputs(inputs, columns)
        self.mask = MaskArrays.from_allowed(allowed_positions(cfg, inputs), keys_axis=-2)

    def run(self, form: str, rec: StageRecorder | None = None) -> np.ndarray:
        """The output (B, D, Nq) of ``form`` ("naive" or "absorbed"); its stages recorded when ``rec`` is given."""
        L = self.layer
        latent, q = L.latent(self.x_k), L.queries(self.x_q)
        if rec is not None:  # recorded in the order the pass makes them (a breakdown's cuts stop at them)
            _record(rec, latent, q)
        out, _, _ = L.attend(form, q, latent["kv_latent"], latent["k_rope"], self.mask, rec)
        if rec is not None:
            rec.record("output", out, ("B", "D", "Nq"), "the output projection; to_numpy transposes it to rows")
        return out


def _record(rec: StageRecorder, latent: dict, q: dict) -> None:
    rec.record(
        "kv_latent", latent["kv_latent"], ("B", "kv_lora_rank", "Nk"), "rows :R of W_kva @ X, RMSNorm down each column"
    )
    rec.record(
        "k_rope",
        latent["k_rope"],
        ("B", "qk_rope_head_dim", "Nk"),
        "rows R: of W_kva @ X, rotated; every head reads them through a broadcast head axis (B, 1, dr, T)",
    )
    if "q_latent" in q:
        rec.record("q_latent", q["q_latent"], ("B", "q_lora_rank", "Nq"), "RMSNorm(W_qa @ X + b_qa)")
    rec.record("q", q["q"], ("B", "H*Dk", "Nq"), "W_q @ (q_latent or X): rows are features, columns tokens")


def _record_values(rec: StageRecorder, v) -> None:
    """The naive form's expanded values (B, H, dv, T), made with its keys (`ColumnSampleMLA.expand`), as columns."""
    B, H, dv, T = v.shape
    rec.record("v", v.reshape(B, H * dv, T), ("B", "Hkv*Dv", "Nk"), "W_UV @ C: every head's values, as columns")
    rec.record("v_heads", v, ("B", "Hkv", "Dv", "Nk"), "the rows of v split by a reshape", "view", "v")


def _record_context(rec: StageRecorder, context) -> None:
    """The naive form's context (B, H, dv, N) and its merge (B, H*dv, N), as columns."""
    B, H, dv, N = context.shape
    merged = context.reshape(B, H * dv, N)  # (B, H*dv, N) view: head h's rows h*dv:(h+1)*dv
    rec.record("context", context, ("B", "H", "Dv", "Nq"), "V_h @ A_h, one column per query")
    rec.record("merged", merged, ("B", "H*Dv", "Nq"), "reshape of the context's rows", "view", "context")


def prepare_numpy_mla(cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, precision, strategy: str) -> Prepared:
    """The NumPy adapter's `Prepared` for MLA's ``strategy`` (``naive`` or ``absorbed``)."""
    forward = MLAForward(cfg, params, inputs, precision)

    def run(rec=None):
        return forward.run(strategy, rec)

    info = {
        "layout": "column samples (B, features, tokens); the latent (B, R, N) and shared key (B, dr, N) as columns; "
        "scores (B, H, Nk, Nq), one column per query",
        "strategy": strategy,
        "form": FORM_NOTES[strategy],
        **precision.info(),
    }
    return Prepared(forward=run, to_numpy=columns_to_rows, native_stages=lambda: record_stages(run), info=info)


FORM_NOTES = {
    NAIVE: "per-head keys W_UK @ C and values W_UV @ C expanded from the latent's columns",
    ABSORBED: "multi-query attention over [C ; k_rope]: W_UK_h^T folded into each query, W_O_h W_UV_h (folded once, "
    "when prepared) into the output",
}
