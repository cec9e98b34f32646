"""DeepSeek's multi-head latent attention (MLA) in MLX: the mlx adapter's ``naive`` and ``absorbed`` strategies.

As mlx-lm writes it (``mlx_lm/models/deepseek_v3.py``'s ``DeepseekV3Attention``), on the canonical parameters:
``nn.Linear`` projections ``x @ W.T + b`` (`layer.MlxAttention.linear`), ``nn.RMSNorm`` as ``mx.fast.rms_norm``,
the query heads ``reshape(B, L, H, -1).transpose(0, 2, 1, 3)`` split on the last axis into ``q_nope`` and ``q_pe``;
``kv_a_proj_with_mqa`` split into the latent ``c`` (normed) and the one rotary key ``k_pe``, both with one key head,
``(B, 1, L, R)`` and ``(B, 1, L, dr)``, broadcast against every query head by ``@`` (no tiling); the rotary is
``nn.RoPE``'s rotation (`layer.rotate`) by the spec's tables. Per head, mlx-lm's ``embed_q`` weight is ``W_UK_h^T``
``(H, R, dn)`` and ``unembed_out``'s is ``W_UV_h`` ``(H, dv, R)``: head h's rows of kv_b_proj.

* ``naive``: each head's keys ``c @ embed_q`` ``(B, H, T, dn)`` and values ``c @ W_UV^T`` ``(B, H, T, dv)`` expanded
  from the latent; the scores ``scale (q_nope k_nope^T + q_pe k_pe^T)`` go through the score steps on MLX's ops
  object (`frameworks.ops.score_steps` on `MlxOps`), as `layer` does, then ``o_proj`` of the merged heads.
* ``absorbed``: ``embed_q(q_nope)`` ``(B, H, N, R)`` is each head's query against the latent itself, one key head
  for all (MQA); the context ``A_h c`` ``(B, H, N, R)`` stays in the latent and ``unembed_out`` brings it out,
  ``(B, H, N, dv)``, before ``o_proj``. Its attention is ``mx.fast.scaled_dot_product_attention`` as mlx-lm calls it
  at decode time: queries, keys and values all the latent's ``R`` features (``k = v = c``), the rotary half of the
  scores ``scale q_pe k_pe^T`` passed as the kernel's additive ``mask`` (-inf where blocked). The kernel would take
  keys ``[c | k_pe]`` of ``R + dr`` features against values of ``R`` too (mlx 0.32.4: tried), but joining them is a
  copy of the whole cache at every step; mlx-lm's split reads the cache as it is. The kernel has no softcap (a
  transform of the whole score before the mask), so a layer with one runs the score steps on the ops object
  instead; and it gives a query row with no allowed key NaN from an all -inf mask: such rows attend to every key
  in the kernel and are set to the spec's zeros after it (``info["attention"]`` says which path ran). ``mx.vjp``
  through the kernel gives its additive mask its gradient, so the rotary part of the gradients rides in it (mlx
  0.32.4 on the CPU: equal to the composed ops' in float32, checked; not run on a GPU here).

Decode goes through mlx-lm's ``KVCache`` (`decode.MlxKVCache`, steps of 256 slots; a window's ring) as
``DeepseekV3Attention`` uses it: its keys are the normed latent ``(B, 1, T, R)`` and its values the rotated ``k_pe``
``(B, 1, T, dr)``, ``kv_lora_rank + d_rope`` numbers a token. The backward is ``mx.vjp`` of the forward
(`adapter.prepare_mlx_vjp`). Every function is pure and lazy: nothing runs until ``mx.eval``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams, allowed_positions
from mha_rosetta.core.decode import decode_allowed
from mha_rosetta.core.variants import VARIANT_REGISTRY
from mha_rosetta.core.variants.mla_heads import check_one_input

from .._inputs import convert_inputs
from .._mla import ABSORBED, latent_cache_info
from .._recording import StageRecorder
from ..base import Prepared, StageTensor, tensor_to_numpy
from ..frameworks.mlx import mlx_stream, precision_info, to_mlx
from ..frameworks.ops import score_steps
from ..frameworks.ops_mlx import compute_dtype
from ..vocabulary import UnsupportedCase
from .decode import MlxDecoder, decode_run, timed_step
from .layer import MlxAttention, mlx_tables, rotate

FUSED = "mx.fast.scaled_dot_product_attention over the latent (k = v = c), the rotary scores as its additive mask"
STEPS = "the score steps on MlxOps"
LATENT_LAYOUT = (
    "mlx-lm's KVCache as DeepseekV3Attention fills it: keys the normed latent (B, 1, T, R), values the rotated k_pe "
    "(B, 1, T, dr), grown in steps of 256 slots (a window's ring)"
)
OUTPUT_NOTE = "o_proj of the merged heads: the naive context, or the latent context through unembed_out"


class LatentMasks(NamedTuple):
    """A pattern's MLX masks: ``blocked`` (1|B, 1|H, Nq, T) True = may not attend, and ``empty`` (1|B, 1|H, Nq, 1)
    the rows with no allowed key (None where none is); each None without a pattern."""

    blocked: object = None
    empty: object = None

    @classmethod
    def of(cls, allowed: np.ndarray | None) -> LatentMasks:
        if allowed is None:
            return cls()
        empty = ~allowed.any(axis=-1, keepdims=True)  # (1|B, 1|H, Nq, 1)
        return cls(to_mlx(~allowed, None), to_mlx(empty, None) if empty.any() else None)


def kernel_reason(cfg: MHAConfig) -> str | None:
    """Why the fused kernel cannot run ``cfg``'s score steps (the ones other than a mask: the softcap), or None."""
    steps = [
        name
        for name in cfg.variants
        if (step := VARIANT_REGISTRY[name].score_step) is not None and step.place != "mask"
    ]
    if not steps:
        return None
    return f"{', '.join(steps)}: mx.fast.scaled_dot_product_attention takes the scores as q.k + mask only"


class MlxMLA(MlxAttention):
    """One MLA layer's parameters in MLX (`MlxAttention`'s, by canonical name) and mlx-lm's steps as pure functions.
    ``fused``: whether the absorbed form attends through the kernel (`kernel_reason`), decided once."""

    def __init__(self, cfg: MHAConfig, params: MHAParams, dtype: str) -> None:
        super().__init__(cfg, params, dtype)
        self.fused = kernel_reason(cfg) is None

    def latent(self, p: dict, x, tables: dict):
        """The rows the cache holds for tokens ``x`` (B, N, D): the normed latent (B, 1, N, R) and the rotated shared
        key (B, 1, N, dr), one key head each (mlx-lm's ``expand_dims(kv_latent, 1)`` and ``k_pe`` reshape)."""
        mx, R = self.mx, self.cfg.kv_lora_rank
        c, k_pe = mx.split(self.linear(p, x, "kv_a"), [R], axis=-1)  # (B, N, R), (B, N, dr)
        c = self.rms_norm(c, p["kv_a_norm"])[:, None]  # (B, 1, N, R): a new axis, no copy
        return c, rotate(k_pe[:, None], *tables["k"], self.traditional)  # (B, 1, N, dr): rotated once, for all heads

    def queries(self, p: dict, x, tables: dict):
        """(q_nope (B, H, N, dn), q_pe (B, H, N, dr) rotated) of tokens ``x`` (B, N, D), both times the temperature's
        factors (Mistral 4: ``tables["temper"]``, (1|B, 1, N, 1)) with it."""
        cfg = self.cfg
        source = x if "w_q_a" not in p else self.rms_norm(self.linear(p, x, "q_a"), p["q_a_norm"])  # (B, N, Rq)
        q = self.split(self.linear(p, source, "q"), cfg.n_heads)  # (B, H, N, Dk): a transposed copy when evaluated
        q_nope, q_pe = self.mx.split(q, [cfg.qk_nope_head_dim], axis=-1)
        q_pe = rotate(q_pe, *tables["q"], self.traditional)
        if "temper" not in tables:
            return q_nope, q_pe
        return tuple(self.ops.temper_queries(part, tables["temper"][0]) for part in (q_nope, q_pe))

    def per_head(self, p: dict):
        """(embed_q's weight ``W_UK_h^T`` (H, R, dn), unembed_out's ``W_UV_h`` (H, dv, R)) from kv_b_proj's rows."""
        cfg = self.cfg
        H, R = cfg.n_heads, cfg.kv_lora_rank
        w_uk = p["w_k"].reshape(H, cfg.qk_nope_head_dim, R).swapaxes(-1, -2)  # (H, R, dn): head h's rows, transposed
        return w_uk, p["w_v"].reshape(H, cfg.d_v, R)  # (H, dv, R): head h's rows

    def _scores(self, *pairs):
        """``scale * sum(q @ k^T)`` over ``(q, k)`` pairs (B, H|1, N|T, d), accumulated in float32 at least and
        rounded once (`layer.MlxAttention.attend`'s rule): (B, H, N, T)."""
        dtype = pairs[0][0].dtype
        compute = compute_dtype(dtype)
        total = sum(q.astype(compute) @ k.astype(compute).swapaxes(-1, -2) for q, k in pairs)
        return (total * self.cfg.scale).astype(dtype)

    def _fused(self, q_latent, q_pe, c, k_pe, masks: LatentMasks):
        """mlx-lm's absorbed call: the kernel over the latent, the rotary scores its mask: (B, H, N, R)."""
        mx = self.mx
        pe_scores = self._scores((q_pe, k_pe))  # (B, H, N, T): the shared key's part of every head's scores
        empty = masks.empty
        if masks.blocked is not None:  # an empty row attends to every key in the kernel (not NaN), zeroed below
            blocked = masks.blocked if empty is None else mx.logical_and(masks.blocked, mx.logical_not(empty))
            pe_scores = mx.where(blocked, mx.array(-np.inf, dtype=pe_scores.dtype), pe_scores)
        context = mx.fast.scaled_dot_product_attention(q_latent, c, c, scale=self.cfg.scale, mask=pe_scores)
        return context if empty is None else mx.where(empty, mx.zeros((), dtype=context.dtype), context)

    def attend(self, p: dict, form: str, q_nope, q_pe, c, k_pe, masks: LatentMasks):
        """The queries over the latent rows ``c`` (B, 1, T, R) and ``k_pe`` (B, 1, T, dr): the output (B, N, D)."""
        w_uk, w_uv = self.per_head(p)
        if form == ABSORBED:
            q_latent = q_nope @ w_uk.swapaxes(-1, -2)  # (B, H, N, R): embed_q(q_nope), W_UK_h folded into the query
            if self.fused:
                context = self._fused(q_latent, q_pe, c, k_pe, masks)
            else:
                scores = self._scores((q_latent, c), (q_pe, k_pe))  # (B, H, N, T): MQA over the latent
                weights = score_steps(self.ops, self.cfg, scores, blocked=masks.blocked, empty_rows=masks.empty)
                context = weights @ c  # (B, H, N, R): the context stays in the latent
            context = context @ w_uv.swapaxes(-1, -2)  # (B, H, N, dv): unembed_out, W_UV_h folded into the output
        else:
            keys, values = c @ w_uk, c @ w_uv.swapaxes(-1, -2)  # (B, H, T, dn), (B, H, T, dv): expanded per head
            scores = self._scores((q_nope, keys), (q_pe, k_pe))  # (B, H, N, T)
            weights = score_steps(self.ops, self.cfg, scores, blocked=masks.blocked, empty_rows=masks.empty)
            context = weights @ values  # (B, H, N, dv)
        return self.finish(p, context)  # heads merged (a copy), then o_proj: (B, N, D)

    def forward(self, p: dict, form: str, x_q, x_k, tables: dict, masks: LatentMasks):
        """The whole layer over tokens ``x_k``'s latent: (B, Nq, D)."""
        q_nope, q_pe = self.queries(p, x_q, tables)
        return self.attend(p, form, q_nope, q_pe, *self.latent(p, x_k, tables), masks)


def attention_info(cfg: MHAConfig, form: str) -> str:
    """How ``form`` attends (``info["attention"]``)."""
    if form != ABSORBED:
        return f"{STEPS}, over the heads' expanded keys and values"
    reason = kernel_reason(cfg)
    return FUSED if reason is None else f"{STEPS} over the latent ({reason})"


def mla_pass(cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, form: str) -> tuple:
    """(``forward(p, x_q, x_k, x_v)``: MLA's ``form`` as a pure function of the parameters by name and the three
    inputs, the value's unread (one latent of the key's tokens, checked), as `adapter.prepare_mlx_vjp` takes it;
    the layer; the three inputs converted once, by slot name)."""
    check_one_input(inputs.key, inputs.value)
    layer = MlxMLA(cfg, params, dtype)
    x_q, x_k, x_v = convert_inputs(inputs, lambda array: to_mlx(array, dtype))  # (B, N, D) each
    tables, masks = mlx_tables(cfg, inputs, dtype), LatentMasks.of(allowed_positions(cfg, inputs))

    def forward(p, x_q, x_k, x_v):
        return layer.forward(p, form, x_q, x_k, tables, masks)

    return forward, layer, {"x_q": x_q, "x_k": x_k, "x_v": x_v}


def prepare_mlx_mla(cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, form: str):
    """The mlx adapter's `Prepared` for MLA's ``form``."""
    import mlx.core as mx

    forward, layer, given = mla_pass(cfg, params, inputs, dtype, form)
    stream = mlx_stream(device)

    def run():
        with mx.stream(stream):
            return forward(layer.params, *given.values())

    def stages():  # the forms' inner arrays are not recorded: the output only (rule 3)
        return {"output": StageTensor(run(), ("B", "Nq", "D"), OUTPUT_NOTE)}

    info = {
        "layout": "row samples (B, L, features); the latent (B, 1, T, R) and k_pe (B, 1, T, dr): one key head",
        "strategy": form,
        "attention": attention_info(cfg, form),
        "device": str(stream),
        "sync": "mx.eval (lazy evaluation)",
        **precision_info(dtype),
    }
    return Prepared(forward=run, to_numpy=tensor_to_numpy, native_stages=stages, synchronize=mx.eval, info=info)


class MlxMLADecoder(MlxDecoder):
    """`decode.MlxDecoder` for MLA's ``form``: each chunk's latent rows into mlx-lm's cache (keys the latent, values
    ``k_pe``), then its queries over the slots in use."""

    layer_type = MlxMLA
    records_stages = False  # the forms' inner arrays are not recorded (rule 3)

    def __init__(self, cfg: MHAConfig, params: MHAParams, x, positions, dtype: str, form: str) -> None:
        super().__init__(cfg, params, x, positions, dtype)
        self.form = form

    def cached_entries(self, rng: np.random.Generator, batch: int, context: int, first: int) -> tuple:
        """A timed step's cached tokens ``first ..`` of ``context`` arbitrary ``[c | k_pe]`` rows, drawn as NumPy's
        step draws its cache's columns (B, R + dr, T): the latent (B, 1, n, R) and k_pe (B, 1, n, dr)."""
        R = self.cfg.kv_lora_rank
        rows = rng.standard_normal((batch, R + self.cfg.qk_rope_head_dim, context))[..., first:]  # (B, R + dr, n)
        entries = to_mlx(rows.transpose(0, 2, 1)[:, None], self.layer.dtype)  # (B, 1, n, R + dr)
        return entries[..., :R], entries[..., R:]

    def describe(self, cache) -> dict:
        keys = cache.keys
        info = latent_cache_info(self.cfg, keys.shape[0], cache.slots, keys.itemsize, LATENT_LAYOUT)
        return {"form": self.form, "attention": attention_info(self.cfg, self.form), "cache": info}

    def chunk(self, cache, start: int, stop: int, positions, valid, rec: StageRecorder | None = None):
        """Tokens ``start:stop`` (positions and valid (B, s)) through ``cache``: their output (B, s, D)."""
        layer, p = self.layer, self.layer.params
        x, tables = self.x[:, start:stop], self.chunk_tables(start, stop)  # (B, s, D)
        c, k_pe, k_positions, k_valid = self.fetch(cache, *layer.latent(p, x, tables), positions, valid)
        masks = LatentMasks.of(decode_allowed(self.cfg, positions, k_positions, k_valid))  # (B, 1, s, T)
        output = layer.attend(p, self.form, *layer.queries(p, x, tables), c, k_pe, masks)  # (B, s, D)
        if rec is not None:
            rec.record("output", output, ("B", "Nq", "D"), OUTPUT_NOTE)
        return output


def prepare_mlx_mla_decode_run(cfg, params, inputs, dtype: str, device: str, form: str):
    """A whole decode run of MLA's ``form`` through mlx-lm's cache holding the latent (`decode.decode_run`)."""
    return decode_run(MlxMLADecoder(cfg, params, inputs.x, inputs.positions, dtype, form), inputs, dtype, device)


def prepare_mlx_mla_decode_step(cfg: MHAConfig, params: MHAParams, job) -> Prepared:
    """One timed step of MLA's ``job.strategy`` form (`bench --mode decode`, `decode.timed_step`): ``job.step`` new
    tokens onto the latent cache holding ``job.context`` tokens of arbitrary numbers, drawn as the NumPy step draws
    them (the step's tokens, then the cache's columns), so that every adapter times the same step. A ragged batch
    is refused, as in the other adapters' MLA steps."""
    if job.lengths is not None:
        raise UnsupportedCase("mlx: MLA's timed step takes a rectangular batch (every row holds the context)")
    rng = np.random.default_rng(job.seed)
    x = rng.standard_normal((job.batch, job.step, cfg.d_model))  # (B, s, D)
    positions = job.positions()  # (B, s): context .. context + s - 1
    decoder = MlxMLADecoder(cfg, params, x, positions, job.dtype, job.strategy)
    return timed_step(decoder, job, rng, positions)
