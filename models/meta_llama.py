"""``meta-llama``: Meta's reference ``Attention`` (llama/model.py of Meta's Llama repositories).

Keys are relative to the ``Attention`` module (``layers.{i}.attention.`` in Meta's
``consolidated.*.pth``): ``wq``, ``wk``, ``wv``, ``wo``, ``(out, in)`` like ``nn.Linear``,
no biases. The module applies rotary embeddings to *interleaved* pairs (features ``2i``
and ``2i+1``, as complex numbers). The same layer in Hugging Face's ``LlamaAttention``
(``hf-llama``) rotates halves; the conversion between the two checkpoints permutes the
rows of ``wq``/``wk`` per head (`mha_rosetta.core.rotary`), which `convert_state_dict`
applies.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import MHAConfig

from . import hf_llama
from ._convert import convert_layouts
from ._layout import (
    SEPARATE,
    Layout,
    bias_is,
    default_scale,
    head_dim_is_width_over_heads,
    rotary_is,
    same_head_dims,
    self_attention_widths,
    separate_linears,
)
from ._real import HF_REQUIRES, allowed_mask, state_shapes, torch_state

MODULE = "Meta's llama Attention"


def _meta_llama(cfg, state, x, padding, options):
    """Meta's layout in HF's real LlamaAttention after the rope converter, checked against Meta's own rotary."""
    hf_cfg, hf_state = convert_layouts(cfg, state, LAYOUT, hf_llama.LAYOUT)
    run = hf_llama.LAYOUT.runner(hf_cfg, hf_state, x, padding, options)
    reimplemented = meta_reference_forward(cfg, state, x, padding)
    run.layout, run.kind = LAYOUT.name, "equivalent"
    run.module = (
        f"transformers LlamaAttention ({options.implementation}) after convert_state_dict(meta-llama -> hf-llama)"
    )
    run.note = (
        "Meta's model.py is not a package: the weights go through the q/k row permutation into HF's real "
        f"LlamaAttention; Meta's own complex-number rotary, rewritten from its source, agrees within "
        f"{np.max(np.abs(reimplemented - run.output)):.1e}"
    )
    run.parameters = state_shapes(state)
    return run


def meta_reference_forward(cfg: MHAConfig, state: dict[str, np.ndarray], x: np.ndarray, padding=None) -> np.ndarray:
    """Meta's Attention.forward rewritten from llama/model.py (float64): wq/wk/wv/wo and view_as_complex rotary."""
    import torch

    B, N, _ = x.shape
    H, G, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_k
    w = torch_state(state)
    xt = torch.from_numpy(x)
    xq = (xt @ w["wq.weight"].T).view(B, N, H, d)  # (B, N, H, d)
    xk = (xt @ w["wk.weight"].T).view(B, N, G, d)  # (B, N, G, d)
    xv = (xt @ w["wv.weight"].T).view(B, N, G, d)
    freqs = 1.0 / (cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # (d/2,)
    freqs_cis = torch.polar(
        torch.ones(N, d // 2, dtype=torch.float64), torch.outer(torch.arange(N, dtype=torch.float64), freqs)
    )

    def rotate(t):  # Meta's apply_rotary_emb: pairs (2i, 2i+1) as one complex number
        as_complex = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))  # (B, N, heads, d/2), a view
        return torch.view_as_real(as_complex * freqs_cis[None, :, None, :]).flatten(3)  # (B, N, heads, d)

    xq, xk = rotate(xq), rotate(xk)
    xk = torch.repeat_interleave(xk, H // G, dim=2)  # Meta's repeat_kv: kv head g serves query heads g*Q..(g+1)*Q-1
    xv = torch.repeat_interleave(xv, H // G, dim=2)
    scores = torch.einsum("bnhd,bmhd->bhnm", xq, xk) / d**0.5  # (B, H, N, N)
    allowed = torch.from_numpy(allowed_mask(cfg, B, N, padding))
    scores = scores.masked_fill(~allowed, float("-inf"))
    context = torch.einsum("bhnm,bmhd->bnhd", torch.softmax(scores, dim=-1), xv).reshape(B, N, H * d)  # (B, N, H*d)
    return (context @ w["wo.weight"].T).numpy()


LAYOUT = Layout(
    name="meta-llama",
    module="Attention (Meta's llama/model.py)",
    description="Llama (Meta): wq/wk/wv/wo (out, in), no bias, interleaved rotary pairs",
    packing=SEPARATE,
    scale="1/sqrt(d_k)",
    rotary="interleaved (pairs 2i, 2i+1, as complex numbers), every feature of a head",
    source="llama/model.py in Meta's Llama repositories",
    split="wq(x).view(B, N, H, d); wk/wv with n_kv_heads; apply_rotary_emb via view_as_complex(reshape(..., -1, 2))",
    rules=(
        head_dim_is_width_over_heads(MODULE),
        same_head_dims(MODULE),
        self_attention_widths(MODULE),
        bias_is(False, "Meta's wq/wk/wv/wo are built with bias=False"),
        default_scale(MODULE),
        rotary_is(("interleaved",), MODULE),
    ),
    **separate_linears({"w_q": "wq", "w_k": "wk", "w_v": "wv", "w_o": "wo"}),
    notes=(
        "to load into Hugging Face's LlamaAttention, permute the rows of wq and wk per head "
        "(convert_state_dict(cfg, state, 'meta-llama', 'hf-llama')); copying them unchanged gives "
        "fluent-looking wrong output",
        "Meta shards wq/wk/wv by rows and wo by columns across model-parallel ranks (consolidated.NN.pth)",
    ),
    runner=_meta_llama,
    requires=HF_REQUIRES,
    hf_options=True,
    example={"n_kv_heads": 2, "bias": False, "rope": "interleaved"},
)
