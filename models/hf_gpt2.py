"""``hf-gpt2``: Hugging Face ``GPT2Attention`` (transformers/models/gpt2/modeling_gpt2.py).

Keys are relative to the ``GPT2Attention`` module (``transformer.h.{i}.attn.`` in a
``GPT2LMHeadModel`` checkpoint). GPT-2's ``Conv1D`` stores its weight as ``(in, out)`` and
computes ``x @ weight + bias``: the row-sample ``W_B``, the transpose of ``nn.Linear``.
``c_attn`` packs q, k and v as blocks along ``out`` (columns ``0:E`` are q, ``E:2E`` k,
``2E:3E`` v), and the module splits them with ``c_attn(x).split(E, dim=2)``.
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig

from ._hf import hf_config, hf_forward, hf_implementation, hf_mask
from ._layout import BLOCKS, Layout, LayoutError, bias_is, classic_heads, default_scale, fused_qkv, rotary_is
from ._module_io import class_name, torch_reader
from ._packing import pack_blocks, unpack_blocks
from ._real import HF_REQUIRES, torch_state

MODULE = "GPT2Attention"


def _gpt2(cfg, state, x, padding, options):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = hf_config(GPT2Config(n_embd=cfg.d_model, n_head=cfg.n_heads, attn_pdrop=0.0, resid_pdrop=0.0), options)
    module = GPT2Attention(config, layer_idx=0).double().eval()
    module.load_state_dict(torch_state(state), strict=True)
    return _forward(module, cfg, x, padding, options)


def _forward(module, cfg, x, padding, options):
    with hf_implementation(module.config, options) as config:

        def forward(xt):
            return module(xt, attention_mask=hf_mask(config, cfg, xt, padding))[0]

        extra = {}
        if module.reorder_and_upcast_attn and options.implementation == "eager":
            extra = {"precision": "float32", "note": "reorder_and_upcast_attn=True: the eager scores run in float32"}
        description = f"transformers GPT2Attention ({options.implementation})"
        return hf_forward("hf-gpt2", module, description, x, forward, **extra)


def _config(module) -> MHAConfig:
    """The GPT2Attention instance's configuration: heads from the module, GPT-2's fixed choices checked."""
    if module.is_cross_attention:
        raise LayoutError(
            f"{class_name(module)} with is_cross_attention=True (q_attn + c_attn for k, v): not in hf-gpt2"
        )
    if not module.scale_attn_weights or module.scale_attn_by_inverse_layer_idx:
        raise LayoutError(
            f"{class_name(module)} with scale_attn_weights={module.scale_attn_weights}, scale_attn_by_inverse_layer_idx="
            f"{module.scale_attn_by_inverse_layer_idx}: layout 'hf-gpt2' holds GPT-2's default 1/sqrt(d) scale only"
        )
    return MHAConfig(d_model=module.embed_dim, n_heads=module.num_heads, d_k=module.head_dim, causal=module.is_causal)


PACKING = fused_qkv("c_attn", "c_proj", pack_blocks, unpack_blocks, conv1d=True)

LAYOUT = Layout(
    name="hf-gpt2",
    module=MODULE,
    description="GPT-2: one Conv1D c_attn (in, out) holding q, k, v as column blocks; Conv1D c_proj",
    packing=BLOCKS,
    scale="1/sqrt(d_k) (config.scale_attn_weights=True, the default)",
    rotary="none (learned absolute positions, outside attention)",
    source="transformers/models/gpt2/modeling_gpt2.py",
    split="c_attn(x).split(E, dim=2) -> q, k, v (B, N, E); each .view(B, N, H, d).transpose(1, 2)",
    rules=(
        *classic_heads(MODULE),
        bias_is(True, "GPT-2's Conv1D layers always have a bias"),
        default_scale(MODULE),
        rotary_is((None,), MODULE),
    ),
    **PACKING,
    notes=(
        "Conv1D weight is (in, out): the transpose of nn.Linear.weight; loading c_attn.weight into an nn.Linear "
        "without .T is the classic GPT-2 porting bug",
        "scale_attn_by_inverse_layer_idx=True (off by default) divides the scale by layer_idx + 1; not covered here",
        "reorder_and_upcast_attn=True computes the eager scores in float32; in a float64 model HF's own path raises "
        "(the float64 mask promotes its float32 scores and it checks for float32): a known difference",
        "the module is causal in the model (GPT2Model builds the causal mask); the attention itself takes any mask",
    ),
    runner=_gpt2,
    requires=HF_REQUIRES,
    hf_options=True,
    reader=torch_reader(("transformers.GPT2Attention",), _config, PACKING["shapes"], _forward),
)
