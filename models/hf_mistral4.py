"""``hf-mistral4``: transformers' ``Mistral4Attention`` (transformers/models/mistral4/modeling_mistral4.py, 5.25).

DeepSeek V3's multi-head latent attention (`models.hf_deepseek`: the same tensors, ``kv_b_proj`` split per head,
``rope_interleave`` choosing adjacent pairs (default) or rotate_half, ``yarn_apply_mscale`` on the softmax scale,
the latent RMSNorms in float32), and two things of its own, read in 5.25's source:

* **the query temperature**, on every layer and always: after rotary, the concatenated ``[q_pass | q_rot]`` times
  ``get_llama_4_attn_scale(position_ids, beta, original_max_position_embeddings)`` = ``1 + beta * log(1 +
  floor(position_ids / original_max_position_embeddings))``, both read from ``config.rope_parameters``
  (``llama_4_scaling_beta``, and the YaRN's own ``original_max_position_embeddings``). That is the spec's
  ``temperature`` with ``floor_offset=0`` (Llama 4 floors ``p + 1``), ``attn_scale`` = beta, ``floor_scale`` = the
  original length; the positions are ``position_ids``, which the forward requires (a decode step passes its own,
  the cache offset included). Its factors are float32 (an int tensor divided by an int: torch's default dtype);
* **the rotary's width**: ``Mistral4Config`` sets ``head_dim = qk_nope_head_dim + qk_rope_head_dim`` and
  ``partial_rotary_factor = qk_rope_head_dim / head_dim``, so a scaled rope type's tables have
  ``int(head_dim * partial_rotary_factor)`` features: the rope part, unless the float product rounds down (nope 14
  + rope 30: 29, frequencies of another width; refused by name). The default type's tables
  (``Mistral4RotaryEmbedding.compute_default_rope_parameters``) read ``head_dim`` and ignore the factor, so they
  are nope + rope wide and do not fit the rope part: the module runs with a scaled rope type only (its config's
  default is YaRN).

Float32 inside a float64 module: the latent norms, the temperature's factors, the rotary module's angles (the spec's
float64 tables with ``RunOptions.float64_rotary``) and eager's softmax; held to float32 with those causes named.
tests/test_mistral4_hf.py patches the norms and the factors to float64 and proves the module in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from mha_rosetta.core import MHAConfig
from mha_rosetta.core.variants.temperature import MISTRAL4_OFFSET, offset_reason

from ._module_io import HFRope, hf_rope, unexpressible
from .hf_deepseek import LAYOUT_V3, DeepSeek, deepseek_layout

MODULE = "Mistral4Attention"
# The temperature's keys in config.rope_parameters (not the rotary's: hf_rope leaves them out).
BETA, ORIGINAL = "llama_4_scaling_beta", "original_max_position_embeddings"
TEMPERATURE_KEYS = (BETA, "max_position_embeddings")
TEMPERATURE_FLOAT32 = (
    "the temperature's factors are float32 (get_llama_4_attn_scale: log(1 + floor(position_ids / "
    "original_max_position_embeddings)) of an int tensor)"
)


def rotary_width(nope: int, rope: int) -> int:
    """The rotary tables' width of a scaled rope type: ``int(head_dim * partial_rotary_factor)`` as transformers
    computes it from Mistral4Config's ``head_dim = nope + rope`` and ``partial_rotary_factor = rope / head_dim``."""
    return int((nope + rope) * (rope / (nope + rope)))


@dataclass(frozen=True)
class Mistral4(DeepSeek):
    """DeepSeek V3's family with Mistral 4's temperature and rotary width (`DeepSeek`'s hooks)."""

    def config_kwargs(self, cfg: MHAConfig) -> dict:
        kwargs = super().config_kwargs(cfg)
        # the YaRN's original_max_position_embeddings is the temperature's floor_scale too (`_temperature_rule`)
        kwargs["rope_parameters"] = dict(kwargs["rope_parameters"], **{BETA: cfg.attn_scale})
        return kwargs

    def call_kwargs(self, xt) -> dict:
        import torch

        return {"position_ids": torch.arange(xt.shape[1])[None]}  # the temperature's positions: 0..N-1

    def float32_causes(self, cfg: MHAConfig) -> list[str]:
        return [*super().float32_causes(cfg), TEMPERATURE_FLOAT32]

    def rope(self, module) -> HFRope:
        config = module.config
        parameters = {key: value for key, value in config.rope_parameters.items() if key not in TEMPERATURE_KEYS}
        read = SimpleNamespace(rope_parameters=parameters, max_position_embeddings=config.max_position_embeddings)
        rope = hf_rope(module, read, module.qk_head_dim, partial=True)
        if rope.rope_scaling is None:
            raise unexpressible(
                module,
                "rope_type 'default'",
                "Mistral4RotaryEmbedding's default tables read head_dim (nope + rope) and ignore "
                "partial_rotary_factor, so they do not fit the rope part: the module cannot run",
            )
        if rope.rope_dims != module.qk_rope_head_dim:
            raise unexpressible(
                module,
                f"rotary tables {rope.rope_dims} features wide (int(head_dim * partial_rotary_factor))",
                f"qk_rope_head_dim is {module.qk_rope_head_dim}: the frequencies are not the rope part's",
            )
        return rope

    def read_fields(self, module) -> dict:
        parameters = module.config.rope_parameters
        if parameters.get(BETA) is None or parameters.get(ORIGINAL) is None:
            raise unexpressible(
                module,
                f"rope_parameters without {BETA} or {ORIGINAL}",
                "its forward multiplies the queries by get_llama_4_attn_scale of both",
            )
        return dict(
            attn_temperature_tuning=True,
            floor_offset=MISTRAL4_OFFSET,
            floor_scale=float(parameters[ORIGINAL]),
            attn_scale=float(parameters[BETA]),
        )

    def rules(self) -> tuple:
        return (*super().rules(), _rotary_rule, _temperature_rule)


def _temperature_rule(cfg: MHAConfig) -> str | None:
    """Mistral 4 tempers every layer, floor(p / original_max_position_embeddings) with the YaRN's own length."""
    if not cfg.attn_temperature_tuning:
        return (
            f"MHAConfig.attn_temperature_tuning=False: {MODULE} always multiplies its queries by 1 + {BETA} * "
            f"log(1 + floor(p / {ORIGINAL})) (attn_scale=0 makes it 1)"
        )
    if reason := offset_reason(cfg, MODULE, MISTRAL4_OFFSET):
        return reason
    original = (cfg.rope_scaling or {}).get(ORIGINAL)
    if original != cfg.floor_scale:
        return (
            f"MHAConfig.floor_scale={cfg.floor_scale:g}: {MODULE} floors by rope_parameters[{ORIGINAL!r}], the rope "
            f"scaling's (here {original!r})"
        )
    return None


def _rotary_rule(cfg: MHAConfig) -> str | None:
    """A scaled rope type (the default tables do not fit), whose width transformers computes as the rope part's."""
    if cfg.rope_scaling is None:
        return (
            f"MHAConfig.rope_scaling=None: Mistral4RotaryEmbedding's default tables ignore partial_rotary_factor "
            f"(they are qk_nope_head_dim + qk_rope_head_dim wide): {MODULE} runs with a scaled rope type (YaRN) only"
        )
    width = rotary_width(cfg.qk_nope_head_dim, cfg.qk_rope_head_dim)
    if width != cfg.qk_rope_head_dim:
        return (
            f"MHAConfig.qk_rope_head_dim={cfg.qk_rope_head_dim} with qk_nope_head_dim={cfg.qk_nope_head_dim}: "
            f"Mistral4Config's tables are int(head_dim * partial_rotary_factor) = {width} features wide"
        )
    return None


FAMILY = Mistral4("hf-mistral4", MODULE, "mistral4", "Mistral4Config", "Mistral4RotaryEmbedding", False)
LAYOUT = deepseek_layout(
    FAMILY,
    description=f"{MODULE}: DeepSeek V3's latent attention and a query temperature on both query parts",
    notes=(
        "the temperature is Llama 4's formula one position later: 1 + llama_4_scaling_beta * log(1 + floor(p / "
        "original_max_position_embeddings)) from position_ids (the spec's floor_offset=0), on [q_nope | q_rot]",
        "the rotary module is head_dim = nope + rope wide with partial_rotary_factor = rope / head_dim: a scaled "
        "rope type's tables are the rope part's; the default type's do not fit (refused)",
        "float32 inside a float64 module on every path: the latent RMSNorms and " + TEMPERATURE_FLOAT32 + "; held "
        "to float32",
    ),
    # explain.real_checkpoints' layer as DeepSeek V3's (nope 2 + rope 2, d_v 3), with YaRN over an original 8 tokens
    # and the temperature's floor the same 8.
    example=dict(
        LAYOUT_V3.example,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8),
        attn_temperature_tuning=True,
        floor_offset=MISTRAL4_OFFSET,
        floor_scale=8,
        attn_scale=0.1,
    ),
    variants=("mla", "mla_q_lora", "rope_scaling", "temperature"),
)

__all__ = ["FAMILY", "LAYOUT", "MODULE", "rotary_width"]
