"""``mlx-deepseek-v3``: mlx-lm's ``DeepseekV3Attention`` (mlx_lm/models/deepseek_v3.py), multi-head latent attention.

The same latent as Hugging Face's (`hf_deepseek`): ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (``q_proj`` without
``q_lora_rank``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``o_proj``, ``(out, in)`` weights, biases on
``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` with ``attention_bias``. What mlx-lm does its own way (read in
the installed source):

* **No ``kv_b_proj``.** ``Model.sanitize`` splits it per head into two ``MultiLinear`` (``mlx_lm/models/mla.py``):
  ``embed_q.weight (H, R, d_nope)`` = W_UK per head, transposed, and ``unembed_out.weight (H, d_v, R)`` = W_UV
  per head. The spec's ``w_k (H*d_nope, R)`` and ``w_v (H*d_v, R)`` are those, reshaped (`pack`/`unpack`).
* **The forms.** A call of L > 1 tokens expands the latent (``k = embed_q(latent, transpose=False)``,
  ``v = unembed_out(latent)``); a call of one token absorbs: ``embed_q(q_nope)`` scores against the latent, and
  ``unembed_out`` maps the context back (the spec's naive and absorbed forms, `core.variants.mla`). The rotary
  part of the scores is written out (``(q_pe * scale) @ k_pe^T``), masked by ``mx.where`` and handed to the SDPA
  as its additive mask: the model passes a boolean array (``create_attention_mask(..., return_array=True)``).
* **The rotary** is ``initialize_rope(qk_rope_head_dim, traditional=True)``: adjacent pairs, always (Hugging
  Face's V3 chooses by ``rope_interleave``; with True its scores are the same). YaRN's ``mscale / mscale_all_dim``
  is on the rope (``YarnRoPE.mscale``), ``m(factor, mscale_all_dim)**2`` on ``self.scale``, as Hugging Face's.
  The instance keeps its model args (``self.config``): a ``YarnRoPE`` is read from them (`_mlx_io._table_rope`).
* **The cache** (``KVCache.update_and_fetch(kv_latent, k_pe)``) holds the normalised latent ``(B, 1, S, R)`` as
  its keys and the rotated ``k_pe (B, 1, S, d_rope)`` as its values: kv_lora_rank + qk_rope_head_dim numbers a
  token, as Hugging Face 5.17 and later cache.
* The latent norms are ``nn.RMSNorm(rank, eps=1e-6)`` whatever ``rms_norm_eps`` says (Hugging Face's too).

mlx's exp/sin/cos are float32-accurate in float64 (`_mlx_io.FLOAT64_NOTE`): held to float32. MLX is imported
inside the functions; importing this module imports NumPy only.
"""

from __future__ import annotations

import importlib
import math

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, expected_param_shapes
from mha_rosetta.core.variants.mla import softmax_scale

from ._layout import SEPARATE, Layout
from ._mlx_build import cast_parameters, mlx_rope_arguments, tiny_model_args
from ._mlx_io import load_mlx, mlx_forward, mlx_reader, mlx_rope, scaling_read
from ._module_io import unexpressible, unexpressible_config
from .hf_deepseek import _names as latent_names  # the tensors stored one to one, as Hugging Face names them
from .hf_deepseek import latent_norm_eps, latent_only, latent_scale  # the latent's rules, as Hugging Face's reader

MODULE = "mlx_lm.models.deepseek_v3.DeepseekV3Attention"
EMBED_Q, UNEMBED_OUT = "embed_q.weight", "unembed_out.weight"


def shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
    canonical = expected_param_shapes(cfg)
    out = {stored: shape for c, stored in latent_names(cfg).items() if (shape := canonical[c]) is not None}
    H, R = cfg.n_heads, cfg.kv_lora_rank
    out[EMBED_Q] = (H, R, cfg.qk_nope_head_dim)
    out[UNEMBED_OUT] = (H, cfg.v_head_dim, R)
    return out


def pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
    state = {stored: np.array(getattr(params, c)) for c, stored in latent_names(cfg).items()}
    H, R = cfg.n_heads, cfg.kv_lora_rank
    # (H*dn, R) -> (H, dn, R) view -> (H, R, dn) copy: sanitize's v[:, :dn, :].swapaxes(-1, -2)
    state[EMBED_Q] = np.ascontiguousarray(params.w_k.reshape(H, cfg.qk_nope_head_dim, R).transpose(0, 2, 1))
    state[UNEMBED_OUT] = params.w_v.reshape(H, cfg.v_head_dim, R).copy()  # (H, dv, R) copy: sanitize's v[:, dn:, :]
    return state


def unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
    arrays: dict = {c: np.array(state[stored], dtype=np.float64) for c, stored in latent_names(cfg).items()}
    H, R = cfg.n_heads, cfg.kv_lora_rank
    embed = np.asarray(state[EMBED_Q], dtype=np.float64)  # (H, R, dn)
    w_k = embed.transpose(0, 2, 1).reshape(H * cfg.qk_nope_head_dim, R)  # (H, dn, R) view -> (H*dn, R) copy
    w_v = np.asarray(state[UNEMBED_OUT], dtype=np.float64).reshape(H * cfg.v_head_dim, R)  # (H*dv, R) copy
    return MHAParams(w_k=np.array(w_k), w_v=np.array(w_v), **arrays)


def build(cfg: MHAConfig, dtype: str = "float64"):
    """A tiny mlx-lm ``DeepseekV3Attention`` for ``cfg`` (random weights, cast to ``dtype``)."""
    models = importlib.import_module("mlx_lm.models.deepseek_v3")
    args = models.ModelArgs(
        **tiny_model_args(cfg),  # MLA: n_kv_heads is n_heads (every head expands its own keys from the latent)
        **mlx_rope_arguments(cfg, length=2048),  # rope_scaling, max_position_embeddings
        moe_intermediate_size=cfg.d_model,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
        attention_bias=bool(cfg.bias),
    )
    return cast_parameters(models.DeepseekV3Attention(args), dtype)


def read(module) -> MHAConfig:
    norms = [n for n in (module.kv_a_layernorm, getattr(module, "q_a_layernorm", None)) if n is not None]
    eps = {float(n.eps) for n in norms}
    if len(eps) != 1:
        raise unexpressible(module, f"latent norms of eps {sorted(eps)}", "the spec has one norm_eps")
    if ("bias" in module.kv_a_proj_with_mqa) != ("bias" in module.o_proj):
        raise unexpressible(module, "a bias on one of kv_a_proj_with_mqa and o_proj only")
    rope = mlx_rope(module)  # YarnRoPE: from module.config (the model args it keeps), proved on its table
    if rope["rope_dims"] != module.qk_rope_head_dim:
        raise unexpressible(module, f"a rope of {rope['rope_dims']} features", "MLA rotates qk_rope_head_dim")
    # self.scale is q_head_dim**-0.5 * s * s; the spec's default the same to the last bits: None keeps it bit for bit
    default = softmax_scale(module.q_head_dim, rope["rope_scaling"])
    scale = None if math.isclose(module.scale, default, rel_tol=1e-12) else float(module.scale)
    with unexpressible_config(module):
        return MHAConfig(
            d_model=module.hidden_size,
            n_heads=module.num_heads,
            kv_lora_rank=module.kv_lora_rank,
            q_lora_rank=module.q_lora_rank,
            qk_rope_head_dim=module.qk_rope_head_dim,
            qk_nope_head_dim=module.qk_nope_head_dim,
            v_head_dim=module.v_head_dim,
            rope_interleave=rope["rope"] == "interleaved",
            bias="bias" in module.o_proj,
            causal=True,
            scale=scale,
            rope_base=rope["rope_base"],
            rope_scaling=rope["rope_scaling"],
            norm_eps=eps.pop(),
        )


def _rules():
    def causal(cfg: MHAConfig) -> str | None:
        return None if cfg.causal else f"MHAConfig.causal=False: {MODULE} is a decoder layer (its model's causal mask)"

    def interleave(cfg: MHAConfig) -> str | None:
        if cfg.rope_interleave:
            return None
        return f"MHAConfig.rope_interleave=False: {MODULE} always rotates adjacent pairs (initialize_rope(traditional=True))"

    def scale(cfg: MHAConfig) -> str | None:
        expected = latent_scale(cfg)
        if abs(cfg.scale - expected) > 1e-15 * expected:
            return f"MHAConfig.scale={cfg.scale!r}: {MODULE} scales by q_head_dim**-0.5 * m(factor, mscale_all_dim)**2"
        return None

    return (latent_only(MODULE), causal, latent_norm_eps, interleave, scale, scaling_read(MODULE))


def _runner(cfg, state, x, padding, options):
    return _forward(load_mlx(build(cfg), state), cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    return mlx_forward("mlx-deepseek-v3", module, cfg, x, padding, array_mask=True)


LAYOUT = Layout(
    name="mlx-deepseek-v3",
    module=MODULE,
    description="mlx-lm DeepseekV3Attention: multi-head latent attention; kv_b_proj split into embed_q/unembed_out",
    packing=SEPARATE,
    scale="(d_nope + d_rope)**-0.5 * m(factor, mscale_all_dim)**2 (self.scale)",
    rotary="initialize_rope(traditional=True): interleaved pairs on the last qk_rope_head_dim features, always",
    source="mlx_lm/models/deepseek_v3.py",
    split="q.reshape(B, L, H, d_nope + d_rope).transpose(0, 2, 1, 3), split [q_nope | q_pe]; keys and values from "
    "the latent per head: embed_q (H, R, d_nope), unembed_out (H, d_v, R)",
    rules=_rules(),
    shapes=shapes,
    pack=pack,
    unpack=unpack,
    notes=(
        "one token absorbs (embed_q(q_nope) against the cached latent, unembed_out after); more expand the latent",
        "the cache holds the normalised latent (keys) and the rotated k_pe (values): R + d_rope numbers a token",
    ),
    runner=_runner,
    requires=("mlx", "mlx_lm"),
    reader=mlx_reader(MODULE, read, shapes, _forward),
    example=dict(q_lora_rank=5, kv_lora_rank=6, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, causal=True),
    variants=("mla", "mla_q_lora", "rope_scaling"),
)
