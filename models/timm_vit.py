"""``timm-vit``: timm's ViT ``Attention`` (timm/models/vision_transformer.py).

Keys are relative to ``Attention`` (``blocks.{i}.attn.`` in a timm ViT checkpoint):
``qkv (3E, E)`` packs q, k and v as **blocks** ``[Q; K; V]`` — exactly
``nn.MultiheadAttention.in_proj_weight`` — and timm splits it with
``reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4)``; ``proj (E, E)`` is the output.
"""

from __future__ import annotations

from mha_rosetta.core.probe import importable

from ._layout import BLOCKS, Layout, classic_heads, default_scale, fused_qkv, rotary_is
from ._packing import pack_blocks, unpack_blocks
from ._real import RealRun, module_shapes, state_shapes, torch_state
from .library_oracles import run_torch_mha

MODULE = "timm Attention"

TIMM_TO_TORCH_MHA = {
    "qkv.weight": "in_proj_weight",
    "qkv.bias": "in_proj_bias",
    "proj.weight": "out_proj.weight",
    "proj.bias": "out_proj.bias",
}


def _timm(cfg, state, x, padding, options):
    if importable("timm"):
        return _timm_real(cfg, state, x, padding)
    renamed = {TIMM_TO_TORCH_MHA[name]: value for name, value in state.items()}
    output, _ = run_torch_mha(cfg, renamed, x, padding)  # strict: timm's qkv/proj are in_proj/out_proj renamed
    return RealRun(
        "timm-vit",
        "equivalent",
        "torch.nn.MultiheadAttention loaded with timm's tensors renamed (same [Q; K; V] packing)",
        output,
        parameters=state_shapes(state),
        note="timm does not import here; its qkv is nn.MultiheadAttention's in_proj_weight, row for row",
    )


def _timm_real(cfg, state, x, padding):
    import torch
    from timm.models.vision_transformer import Attention

    if padding is not None or cfg.causal:
        raise ValueError("timm's ViT Attention takes no mask here: run it without padding and causal=False")
    module = Attention(cfg.d_model, num_heads=cfg.n_heads, qkv_bias=cfg.bias).double().eval()
    if not cfg.bias and getattr(module.proj, "bias", None) is not None:
        raise ValueError("this timm version always gives proj a bias; the spec's bias=False needs proj_bias=False")
    module.load_state_dict(torch_state(state), strict=True)
    with torch.no_grad():
        output = module(torch.from_numpy(x)).numpy()
    return RealRun("timm-vit", "real", "timm vision_transformer.Attention", output, parameters=module_shapes(module))


LAYOUT = Layout(
    name="timm-vit",
    module="Attention (timm.models.vision_transformer)",
    description="timm ViT: fused qkv (3E, E) as [Q; K; V] blocks (nn.MultiheadAttention's in_proj packing); proj",
    packing=BLOCKS,
    scale="1/sqrt(d_k)",
    rotary="none (learned absolute position embeddings, outside attention)",
    source="timm/models/vision_transformer.py",
    split="qkv(x).reshape(B, N, 3, H, d).permute(2, 0, 3, 1, 4).unbind(0) -> q, k, v (B, H, N, d)",
    rules=(
        *classic_heads(MODULE),
        default_scale(MODULE),
        rotary_is((None,), MODULE),
    ),
    **fused_qkv("qkv", "proj", pack_blocks, unpack_blocks),
    notes=(
        "bias: qkv_bias (True in ViTs) and proj_bias; the spec's bias is all-or-none",
        "qkv.weight == nn.MultiheadAttention's in_proj_weight and proj == out_proj: a timm block loads into "
        "nn.MultiheadAttention by renaming the keys",
        "q_norm/k_norm (qk_norm=True) are outside the spec; by default they are Identity and store nothing",
    ),
    runner=_timm,
    requires=("torch",),
)
