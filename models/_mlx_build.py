"""Building a tiny mlx-lm attention for an `MHAConfig`: the ModelArgs entries every family's build sets alike, the
rotary's entries, the parameters cast to the run's dtype.

Shared by `mlx_lm`'s families, `mlx_deepseek` and the Llama 4 layouts. MLX is imported inside the functions;
importing this module imports `core` only.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig


def tiny_model_args(cfg: MHAConfig, layers: int = 1) -> dict:
    """The ModelArgs keywords every tiny mlx-lm build sets alike: ``cfg``'s widths, heads and rotary base, ``layers``
    layers, an 8-word vocabulary (no embedding runs: the attention is called alone), the MLP as wide as the model."""
    return {
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_model,
        "num_hidden_layers": layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "rope_theta": cfg.rope_base,
        "vocab_size": 8,
    }


def cast_parameters(module, dtype: str):
    """``module`` with every parameter cast to ``dtype`` (a name of ``mlx.core``: "float64", "float32"...)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    module.update(tree_map(lambda a: a.astype(getattr(mx, dtype)), module.parameters()))
    return module


def mlx_rope_arguments(cfg: MHAConfig, length: int = 4096) -> dict:
    """The ModelArgs entries (``rope_scaling``, ``max_position_embeddings``) mlx-lm builds ``cfg``'s rope from: the
    keys Hugging Face's form leaves unset (None) dropped (mlx-lm reads a key it finds); longrope's tables as lists
    under mlx-lm's ``"type"`` (Phi-3's ModelArgs requires it), ``original_max_position_embeddings`` beside (Phi-3's
    ModelArgs field) and the length ``factor * original`` (SuScaledRoPE's factor on cos and sin is
    ``sqrt(1 + ln(max / original) / ln(original))``); otherwise the original length (``length`` without one)."""
    if cfg.rope_scaling is None:
        return {"rope_scaling": None, "max_position_embeddings": length}
    scaling = {key: value for key, value in cfg.rope_scaling.items() if value is not None}
    original = scaling.get("original_max_position_embeddings", length)
    if scaling["rope_type"] != "longrope":
        return {"rope_scaling": scaling, "max_position_embeddings": original}
    tables = {key: list(scaling[key]) for key in ("short_factor", "long_factor")}
    return {
        "rope_scaling": {**scaling, **tables, "type": "longrope"},
        "max_position_embeddings": round(scaling.get("factor", 1.0) * original),
        "original_max_position_embeddings": original,
    }
