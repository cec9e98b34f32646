"""``torch-mha``, ``flax`` and ``equinox``: the converters of `mha_rosetta.core.layouts`, as layouts.

These three libraries' attention modules are the project's third-party oracles; their
converters live in `core` (the backends use them). Here they get the same
`Layout` interface as the checkpoint families, with flat state dicts:

* ``torch-mha``: ``torch.nn.MultiheadAttention.state_dict()`` names;
* ``flax``: ``flax.linen.MultiHeadDotProductAttention``'s ``params`` tree flattened with
  ``/`` (``flax.traverse_util.flatten_dict(..., sep="/")``): ``query/kernel`` ...;
* ``equinox``: ``equinox.nn.MultiheadAttention``'s fields, ``query_proj.weight`` ...

``torch-mha``'s runner is here (`run_torch_mha` also serves timm's equivalent run). Flax and Equinox have
none in `models`: the project's oracle backends build those modules from the same converters, and running
a backend is not a job of `models` (which imports only `core`); `mha_rosetta.explain.oracle_modules` does it.
"""

from __future__ import annotations

import numpy as np

from mha_rosetta.core import (
    MHAConfig,
    from_torch_mha_state_dict,
    to_torch_mha_state_dict,
    torch_mha_unsupported_reason,
)
from mha_rosetta.core.layouts import EQUINOX_NAMES

from ._layout import (
    BLOCKS,
    SEPARATE,
    Layout,
    default_scale,
    dense_general,
    no_grouped_kv,
    rotary_is,
    same_head_dims,
    separate_linears,
)
from ._real import RealRun, allowed_mask, module_shapes, torch_state

# --- torch.nn.MultiheadAttention -----------------------------------------------------------


def _torch_mha_shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
    E = cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.is_self_attention_shaped:
        shapes["in_proj_weight"] = (3 * E, E)
    else:
        shapes.update({"q_proj_weight": (E, E), "k_proj_weight": (E, cfg.kdim), "v_proj_weight": (E, cfg.vdim)})
    if cfg.bias:
        shapes["in_proj_bias"] = (3 * E,)
    shapes["out_proj.weight"] = (E, E)
    if cfg.bias:
        shapes["out_proj.bias"] = (E,)
    return shapes


def run_torch_mha(cfg, state, x, padding):
    """``state`` loaded (strictly) into ``nn.MultiheadAttention(batch_first=True)``, run on x: (output, module)."""
    import torch

    module = torch.nn.MultiheadAttention(
        cfg.d_model, cfg.n_heads, bias=cfg.bias, kdim=cfg.kdim, vdim=cfg.vdim, batch_first=True, dtype=torch.float64
    ).eval()
    module.load_state_dict(torch_state(state), strict=True)
    B, N, _ = x.shape
    blocked = ~allowed_mask(cfg, B, N, padding)  # (B, 1, N, N): nn.MultiheadAttention's True means "blocked"
    attn_mask = torch.from_numpy(np.repeat(blocked, cfg.n_heads, axis=1).reshape(B * cfg.n_heads, N, N))  # (B*H, N, N)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        return module(xt, xt, xt, attn_mask=attn_mask, need_weights=False)[0].numpy(), module


def _torch_mha(cfg, state, x, padding, options):
    output, module = run_torch_mha(cfg, state, x, padding)
    return RealRun(
        "torch-mha", "real", "torch.nn.MultiheadAttention(batch_first=True)", output, parameters=module_shapes(module)
    )


TORCH_MHA = Layout(
    name="torch-mha",
    module="torch.nn.MultiheadAttention",
    description="nn.MultiheadAttention: in_proj_weight (3E, E) as [Q; K; V] blocks (q/k/v_proj_weight when kdim/vdim differ)",
    packing=BLOCKS,
    scale="1/sqrt(d_k)",
    rotary="none",
    source="torch/nn/modules/activation.py",
    split="F.linear(x, in_proj_weight).unflatten(-1, (3, E)) -> q, k, v; each .view(N, B*H, d).transpose(0, 1)",
    rules=(torch_mha_unsupported_reason, rotary_is((None,), "nn.MultiheadAttention")),
    shapes=_torch_mha_shapes,
    pack=to_torch_mha_state_dict,
    unpack=from_torch_mha_state_dict,
    notes=(
        "sequence-first (N, B, E) unless batch_first=True",
        "attn_mask/key_padding_mask: True means blocked, the opposite polarity of the spec",
    ),
    runner=_torch_mha,
    requires=("torch",),
)

# --- flax.linen.MultiHeadDotProductAttention -----------------------------------------------


FLAX = Layout(
    name="flax",
    module="flax.linen.MultiHeadDotProductAttention",
    description="Flax linen: DenseGeneral kernels (in, H, d) and out kernel (H, d, E), params tree flattened with '/'",
    packing=SEPARATE,
    scale="1/sqrt(d_k) (applied to the query before the product)",
    rotary="none",
    source="flax/linen/attention.py",
    split="no split: DenseGeneral(features=(H, d)) gives (B, N, H, d) directly",
    rules=(
        no_grouped_kv("flax MultiHeadDotProductAttention"),
        same_head_dims("flax MultiHeadDotProductAttention (qkv_features)"),
        default_scale("flax MultiHeadDotProductAttention"),
        rotary_is((None,), "flax MultiHeadDotProductAttention"),
    ),
    **dense_general("out"),
    notes=("qkv_features is the total H*d (torch-like); out_features defaults to the query width",),
)

# --- equinox.nn.MultiheadAttention ---------------------------------------------------------

EQUINOX = Layout(
    name="equinox",
    module="equinox.nn.MultiheadAttention",
    description="Equinox: query_proj/key_proj/value_proj/output_proj eqx.nn.Linear, weight (out, in) like torch",
    packing=SEPARATE,
    scale="1/sqrt(qk_size)",
    rotary="none (the module takes a process_heads hook where users add it)",
    source="equinox/nn/_attention.py",
    split="query_proj(x).reshape(N, H, qk_size) per example (vmapped over the batch)",
    rules=(
        no_grouped_kv("equinox MultiheadAttention"),
        default_scale("equinox MultiheadAttention"),
        rotary_is((None,), "equinox MultiheadAttention"),
    ),
    **separate_linears(EQUINOX_NAMES),
    notes=("qk_size and vo_size are per head, like Keras's key_dim",),
)
