"""A Qwen3 attention layer and its MLX ports, as factories for `mha-rosetta compare` (docs/ports.md).

``hf_qwen3`` is Hugging Face's ``Qwen3Attention``; ``mlx_qwen3`` is mlx-lm's port of it; ``mlx_qwen3_traditional``
is the same port with the real-world mistake of writing ``nn.RoPE(head_dim, traditional=True, ...)``: MLX's
interleaved pairs where Qwen3 rotates halves. All are tiny, float64, with seeded random weights (nothing is
downloaded). Run from the repository root::

    mha-rosetta compare examples.ports_qwen3:hf_qwen3 examples.ports_qwen3:mlx_qwen3
"""

from __future__ import annotations

SIZES = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
ROPE_THETA = 1_000_000.0
EPS = 1e-6


def hf_qwen3():
    import torch
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    torch.manual_seed(0)
    config = Qwen3Config(
        **SIZES,
        num_hidden_layers=1,
        rms_norm_eps=EPS,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    )
    config._attn_implementation = "eager"
    return Qwen3Attention(config, layer_idx=0).double().eval()


def mlx_qwen3():
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(
        model_type="qwen3",
        **SIZES,
        num_hidden_layers=1,
        intermediate_size=64,
        rms_norm_eps=EPS,
        vocab_size=8,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=ROPE_THETA,
    )
    module = qwen3.Attention(args)
    module.update(tree_map(lambda a: a.astype(mx.float64), module.parameters()))  # float64 (CPU)
    return module


def mlx_qwen3_traditional():
    import mlx.nn as nn

    module = mlx_qwen3()
    module.rope = nn.RoPE(SIZES["head_dim"], traditional=True, base=ROPE_THETA)  # the planted mistake
    return module
