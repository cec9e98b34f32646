"""``mlx-llama4-text``: mlx-lm's text-only Llama 4 ``Attention`` (mlx_lm/models/llama4_text.py), rotary and NoPE.

Llama's four ``nn.Linear`` (``(out, in)``, no biases), ``reshape(B, L, H, -1)``, grouped kv heads handed to the
SDPA as they are, ``head_dim**-0.5``. What it does its own way, read in the installed source, against Hugging
Face's ``Llama4TextAttention`` (`hf_llama4`) and mlx-lm's other Llama 4 (`mlx_llama4`, ``llama4.Attention``):

* **The layer kind is** ``Attention(args, use_rope)`` with ``use_rope = args.no_rope_layers[i]`` (as Hugging
  Face's ``no_rope_layers``), kept on the instance: the reader reads ``use_rope``.
* **The rotary** is ``nn.RoPE(head_dim, traditional=True, base=rope_theta)``: interleaved pairs, every feature, no
  scaling; none on NoPE layers.
* **The QK-norm** is ``mx.fast.rms_norm(x, None, rms_norm_eps)`` on each head of q and k when ``use_qk_norm``, on
  EVERY layer, BEFORE rotary. Hugging Face norms its rotary layers only, after rotary: the same numbers, since
  rotary turns each pair of features by an angle and so keeps each head's sum of squares. So a rotary layer's norm is
  read as ``qk_norm_after_rope`` (what Hugging Face's is read as), eps ``rms_norm_eps`` (not ``llama4.Attention``'s
  1e-6). The spec's ``qk_norm_after_rope`` needs a rotary; a NoPE layer's norm is read as ``qk_norm="head"`` with
  unit weights (RMSNorm with weight 1 is the weightless norm, exactly): `from_module` gives ``q_norm = k_norm =
  ones(d_k)`` and `to_module` refuses any other weight (the module has none to hold it).
* **No chunk and no temperature**: ``LanguageModel`` gives every layer ``create_attention_mask`` (plain causal; None
  for a one-token decode step over a ``KVCache``), and the class has no ``attn_temperature_tuning``.

mlx's exp/sin/cos are float32-accurate in float64 (`_mlx_io.FLOAT64_NOTE`): held to float32. MLX is imported
inside the functions; importing this module imports NumPy only.
"""

from __future__ import annotations

import importlib

import numpy as np

from mha_rosetta.core import MHAConfig

from ._errors import LayoutError
from ._hf_decoder import LINEARS
from ._layout import SEPARATE, Layout, separate_linears
from ._mlx_build import cast_parameters, tiny_model_args
from ._mlx_io import load_mlx, mlx_forward, mlx_state
from ._module_io import ModuleReader, class_name, unexpressible_config
from .mlx_llama4 import llama4_fields, llama4_rules

MODULE = "mlx_lm.models.llama4_text.Attention"
# The weightless norm of a NoPE layer, read as qk_norm="head" with these unit weights (stored by these names)
NORMS = {"q_norm": "q_norm", "k_norm": "k_norm"}
_PACKING = separate_linears(LINEARS, extras=NORMS)


def build(cfg: MHAConfig, dtype: str = "float64"):
    """A tiny mlx-lm ``llama4_text.Attention`` for ``cfg``: layer 0 (rotary) or 1 (NoPE) of ``no_rope_layers=[1, 0]``."""
    models = importlib.import_module("mlx_lm.models.llama4_text")
    args = models.ModelArgs(
        model_type="llama4_text",
        **tiny_model_args(cfg, layers=2),
        intermediate_size_mlp=cfg.d_model,
        rms_norm_eps=cfg.norm_eps,
        head_dim=cfg.d_k,
        tie_word_embeddings=True,
        no_rope_layers=[1, 0],
        use_qk_norm=bool(cfg.qk_norm_after_rope or cfg.qk_norm == "head"),
    )
    layer = 0 if cfg.rope is not None else 1
    module = models.Attention(args, args.no_rope_layers[layer])  # as LanguageModel builds layer i
    return cast_parameters(module, dtype)


def read(module) -> MHAConfig:
    """The instance's layer kind (``use_rope``), its rotary, and its norm (after rotary, or per head on NoPE)."""
    fields = llama4_fields(module)
    rotary, normed = fields["rope"] is not None, bool(module.use_qk_norm)
    with unexpressible_config(module):
        return MHAConfig(
            **fields,
            qk_norm_after_rope=normed and rotary,  # the same numbers as its norm before rotary
            qk_norm="head" if normed and not rotary else None,  # weightless: unit weights (`NORMS`)
            norm_eps=float(module.rms_norm_eps) if normed else 1e-6,
        )


def _state(module, cfg: MHAConfig) -> dict[str, np.ndarray]:
    """The linears' weights, and the unit weights of a NoPE layer's weightless norm."""
    shapes = _PACKING["shapes"](cfg)
    state = mlx_state(module, [name for name in shapes if name not in NORMS])
    return {**state, **{name: np.ones(shapes[name]) for name in NORMS if name in shapes}}


def _load(module, state):
    """The linears loaded; a norm weight that is not all ones refused (the module's norm has no weight)."""
    for name in NORMS:
        if name in state and not np.all(np.asarray(state[name]) == 1.0):
            raise LayoutError(
                f"{class_name(module)} cannot hold {name}: its QK-norm is weightless (mx.fast.rms_norm(x, None, "
                f"rms_norm_eps)), so MHAParams.{name} must be all ones, got values from {np.min(state[name]):g} "
                f"to {np.max(state[name]):g}"
            )
    return load_mlx(module, {name: array for name, array in state.items() if name not in NORMS})


def _forward(module, cfg, x, padding, options):
    return mlx_forward("mlx-llama4-text", module, cfg, x, padding)  # LanguageModel's create_attention_mask


def _runner(cfg, state, x, padding, options):
    return _forward(_load(build(cfg), state), cfg, x, padding, options)


def _layer_kind_rule(cfg: MHAConfig) -> str | None:
    """What the class computes beyond its variants (``variants`` refuses a chunk, a temperature, a rope scaling): no
    biases, every feature rotated, its norm as the layer kind reads it."""
    if cfg.bias:
        return f"MHAConfig.bias={cfg.bias!r}: {MODULE}'s four nn.Linear have bias=False"
    if cfg.rope is not None and cfg.rope_dims not in (None, cfg.d_k):
        return f"MHAConfig.rope_dims={cfg.rope_dims}: {MODULE}'s nn.RoPE(head_dim) rotates every feature"
    if cfg.qk_norm is not None and cfg.rope is not None:
        return (
            f"MHAConfig.qk_norm={cfg.qk_norm!r} with rope={cfg.rope!r}: {MODULE}'s weightless per-head norm is read as "
            "qk_norm_after_rope on rotary layers, as qk_norm='head' (unit weights) on NoPE layers only"
        )
    return None


LAYOUT = Layout(
    name="mlx-llama4-text",
    module=MODULE,
    description="mlx-lm Llama 4 text-only: Llama's linears, no biases; rotary layers (interleaved nn.RoPE) and NoPE "
    "layers by no_rope_layers, a weightless QK-norm per head on every layer, a plain causal mask",
    packing=SEPARATE,
    scale="1/sqrt(d_k) (head_dim**-0.5)",
    rotary="nn.RoPE(head_dim, traditional=True, base=rope_theta): interleaved pairs on rotary layers, none on NoPE",
    source="mlx_lm/models/llama4_text.py",
    split="q_proj(x).reshape(B, L, H, -1); the norm, then .transpose(0, 2, 1, 3) and rotary on (B, H, L, d); k/v "
    "with G heads, grouped by the SDPA",
    rules=(
        _layer_kind_rule,
        *llama4_rules(MODULE),
    ),
    **_PACKING,
    notes=(
        "use_rope = args.no_rope_layers[i], as Hugging Face's; the norm on every layer when use_qk_norm, where "
        "Hugging Face norms its rotary layers only",
        "the norm comes before rotary (Hugging Face's after): the same numbers, rotation keeps each head's RMS",
        "a NoPE layer's norm is qk_norm='head' with unit weights: to_module refuses any other",
        "no chunked mask and no temperature, unlike llama4.Attention (mlx-llama4)",
    ),
    runner=_runner,
    requires=("mlx", "mlx_lm"),
    reader=ModuleReader(classes=(MODULE,), config=read, state=_state, load=_load, forward=_forward),
    example={"n_kv_heads": 2, "bias": False, "rope": "interleaved", "causal": True, "qk_norm_after_rope": True},
    variants=("qk_norm_after_rope", "qk_norm_head"),
)
