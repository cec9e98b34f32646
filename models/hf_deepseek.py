"""``hf-deepseek-v2`` and ``hf-deepseek-v3``: transformers' multi-head latent attention (MLA, issue 45).

``DeepseekV2Attention`` and ``DeepseekV3Attention`` (transformers/models/deepseek_v{2,3}/modeling_deepseek_v{2,3}.py)
store ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (``q_proj`` without ``q_lora_rank``), ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj``. The spec's names (`core.variants.mla`): ``w_q_a``, ``q_a_norm``,
``w_q``; ``w_kv_a``, ``kv_a_norm``; ``kv_b_proj`` is split per head into ``w_k`` (W_UK) and ``w_v`` (W_UV)
(`split_kv_b`: head h's rows are ``[k_nope_h | v_h]``); ``w_o``. ``attention_bias`` biases ``q_a_proj``,
``kv_a_proj_with_mqa`` and ``o_proj`` only.

What differs between the two (read in transformers 5.25's sources):

* V2 rotates adjacent pairs through complex ``freqs_cis`` (its ``position_embeddings`` is that complex64 tensor,
  and ``apply_rotary_emb`` casts q and k to float32 first): the spec's ``"interleaved"``, always.
* V3 chooses by ``config.rope_interleave`` (default True). Its interleaved path writes the rotated features
  de-interleaved, ``[evens | odds]``, then rotates halves: the scores equal the spec's ``"interleaved"``, but its
  rotated q/k (and the cached ``k_rot``) are the spec's stages permuted. False: rotate_half (``"half"``).
* Both scale by ``yarn_apply_mscale``: ``qk_head_dim^-1/2 * m(factor, mscale_all_dim)^2`` with a scaled rope.
* The latent norms are ``RMSNorm(rank)`` with eps 1e-6 whatever ``rms_norm_eps`` says, in float32.

``hf-mistral4`` (`models.hf_mistral4`) is V3's layout with Mistral 4's query temperature and rotary width, through
the hooks of `DeepSeek` (``config_kwargs``, ``call_kwargs``, ``float32_causes``, ``rope``, ``read_fields``, ``rules``).

Float32 inside a float64 module, on every path: the two RMSNorms (``hidden_states.to(torch.float32)``), V2's
complex64 rotary, the rotary module's float32 angles (V3 takes the spec's float64 tables with
``RunOptions.float64_rotary``), eager's float32 softmax. The runs are held to float32 with those causes named;
tests/test_mla_hf.py also patches the norms to float64 and proves V3 in float64 (SDPA, the spec's tables).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, expected_param_shapes
from mha_rosetta.core.variants.mla import KV_RANK, SIZES, fuse_kv_b, softmax_scale, split_kv_b

from ._hf import hf_config, hf_forward, hf_implementation, hf_mask, hf_max_positions, hf_rope_parameters, rotary_tables
from ._layout import SEPARATE, Layout, Rule
from ._module_io import HFRope, hf_rope, torch_reader, unexpressible, unexpressible_config
from ._real import HF_REQUIRES, torch_state

# The latent sizes transformers' DeepSeek configs and modules name as the spec does: kv_lora_rank, which switches
# MLA on, and the sizes MLA owns beside it (`core.variants.mla`).
LATENT = (KV_RANK, *SIZES)
# canonical -> stored, for the tensors stored one to one (w_q's name depends on q_lora_rank; w_k, w_v share kv_b_proj)
STORED = {
    "w_q_a": "q_a_proj.weight",
    "b_q_a": "q_a_proj.bias",
    "q_a_norm": "q_a_layernorm.weight",
    "w_kv_a": "kv_a_proj_with_mqa.weight",
    "b_kv_a": "kv_a_proj_with_mqa.bias",
    "kv_a_norm": "kv_a_layernorm.weight",
    "w_o": "o_proj.weight",
    "b_o": "o_proj.bias",
}
KV_B = "kv_b_proj.weight"
NORM_FLOAT32 = "the latent RMSNorms (q_a_layernorm, kv_a_layernorm) run in float32 (hidden_states.to(torch.float32))"


def _names(cfg: MHAConfig) -> dict[str, str]:
    """canonical -> stored name, for the parameters ``cfg`` has (w_k and w_v: both in kv_b_proj)."""
    shapes = expected_param_shapes(cfg)
    names = {c: s for c, s in STORED.items() if shapes[c] is not None}
    names["w_q"] = "q_proj.weight" if cfg.q_lora_rank is None else "q_b_proj.weight"
    return names


def shapes(cfg: MHAConfig) -> dict[str, tuple[int, ...]]:
    canonical = expected_param_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for c, stored in _names(cfg).items():
        shape = canonical[c]
        if shape is None:  # _names lists only the parameters MLA's layer stores
            raise ValueError(f"{stored}: params.{c} is absent for this configuration, but DeepSeek's layer stores it")
        out[stored] = shape
    out[KV_B] = (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.d_v), cfg.kv_lora_rank)
    return out


def pack(cfg: MHAConfig, params: MHAParams) -> dict[str, np.ndarray]:
    state = {stored: np.array(getattr(params, c)) for c, stored in _names(cfg).items()}
    state[KV_B] = fuse_kv_b(params.w_k, params.w_v, cfg.n_heads)
    return state


def unpack(cfg: MHAConfig, state: dict[str, np.ndarray]) -> MHAParams:
    arrays: dict = {c: np.array(state[stored], dtype=np.float64) for c, stored in _names(cfg).items()}
    w_k, w_v = split_kv_b(np.asarray(state[KV_B], dtype=np.float64), cfg.n_heads, cfg.qk_nope_head_dim, cfg.d_v)
    return MHAParams(w_k=w_k, w_v=w_v, **arrays)


@dataclass(frozen=True)
class DeepSeek:
    layout: str
    module: str
    package: str
    config_class: str
    rotary_class: str
    complex_rotary: bool  # V2: position_embeddings is complex64 freqs_cis, the rotation in float32 whatever the tables

    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.package}.modeling_{self.package}")

    def config_kwargs(self, cfg: MHAConfig) -> dict:
        """The keywords of the family's config for ``cfg`` (`build`)."""
        kwargs = dict(
            hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_heads,
            **{name: getattr(cfg, name) for name in LATENT},
            attention_bias=bool(cfg.bias),
            attention_dropout=0.0,
            num_hidden_layers=1,
            rope_parameters=hf_rope_parameters(cfg),
            **hf_max_positions(cfg),
        )
        if not self.complex_rotary:
            kwargs["rope_interleave"] = cfg.rope_interleave
        return kwargs

    def build(self, cfg: MHAConfig, options):
        """A tiny float64 module for ``cfg`` (layer 0), not loaded."""
        transformers = importlib.import_module("transformers")
        config = hf_config(getattr(transformers, self.config_class)(**self.config_kwargs(cfg)), options)
        return getattr(self.modeling(), self.module)(config, layer_idx=0).double().eval()

    # -- what a family beside DeepSeek's (Mistral 4: `models.hf_mistral4`) computes otherwise ----------------------
    def call_kwargs(self, xt) -> dict:
        """What the module's forward takes beside the rotary tables and the mask (DeepSeek: nothing)."""
        return {}

    def float32_causes(self, cfg: MHAConfig) -> list[str]:
        """The module's own float32 steps inside a float64 module (the rotary's and eager's aside)."""
        causes = [NORM_FLOAT32]
        if self.complex_rotary:
            causes.append("the rotary multiplies complex64 q and k (apply_rotary_emb casts them to float32)")
        return causes

    def rope(self, module) -> HFRope:
        """The instance's rotary settings (the rotary module's width is ``qk_rope_head_dim``: V3's config sets
        ``head_dim`` to it)."""
        return hf_rope(module, module.config, module.qk_rope_head_dim)

    def read_fields(self, module) -> dict:
        """`MHAConfig` fields the instance holds beside MLA's and the rotary's (DeepSeek: none)."""
        return {}

    def rules(self) -> tuple:
        return _rules(self)


def latent_only(module: str) -> Rule:
    """The rule of every DeepSeek latent reader (Hugging Face's and mlx-lm's): ``module`` is latent attention."""

    def rule(cfg: MHAConfig) -> str | None:
        return None if cfg.kv_lora_rank is not None else f"{module} is latent attention: it needs kv_lora_rank"

    return rule


def latent_norm_eps(cfg: MHAConfig) -> str | None:
    """The rule of every DeepSeek latent reader: its latent norms' eps is 1e-6 whatever ``rms_norm_eps`` says."""
    return None if cfg.norm_eps == 1e-6 else f"MHAConfig.norm_eps={cfg.norm_eps!r}: its latent norms use 1e-6"


def latent_scale(cfg: MHAConfig) -> float:
    """The spec's default scale of ``cfg``'s latent sizes and rope scaling (`core.variants.mla.softmax_scale`):
    what DeepSeek's modules apply, Hugging Face's and mlx-lm's alike."""
    return MHAConfig(**{**_sizes(cfg), "scale": None}).scale


def _rules(family: DeepSeek):
    def causal(cfg: MHAConfig) -> str | None:
        return None if cfg.causal else f"MHAConfig.causal=False: {family.module} is a decoder layer (is_causal=True)"

    def interleave(cfg: MHAConfig) -> str | None:
        if family.complex_rotary and not cfg.rope_interleave:
            return f"MHAConfig.rope_interleave=False: {family.module} always rotates adjacent pairs (freqs_cis)"
        return None

    def scale(cfg: MHAConfig) -> str | None:
        expected = latent_scale(cfg)
        if abs(cfg.scale - expected) > 1e-15 * expected:
            return f"MHAConfig.scale={cfg.scale!r}: {family.module} scales by yarn_apply_mscale (here {expected!r})"
        return None

    return (latent_only(family.module), causal, latent_norm_eps, interleave, scale)


def _sizes(cfg: MHAConfig) -> dict:
    return {n: getattr(cfg, n) for n in ("d_model", "n_heads", *LATENT)} | {"rope_scaling": cfg.rope_scaling}


def deepseek_layout(family: DeepSeek, **overrides) -> Layout:
    """The `Layout` of ``family``; ``overrides``: `Layout` fields a family beside DeepSeek's states otherwise."""

    def runner(cfg, state, x, padding, options):
        module = family.build(cfg, options)
        module.load_state_dict(torch_state(state), strict=True)
        return forward(module, cfg, x, padding, options)

    def forward(module, cfg, x, padding, options):
        import torch

        with hf_implementation(module.config, options) as config:
            rotary = getattr(family.modeling(), family.rotary_class)(config)

            def run(xt):
                if family.complex_rotary:  # complex64 freqs_cis: the module's own, positions 0..N-1
                    tables = rotary(xt, torch.arange(xt.shape[1])[None])
                else:
                    tables = rotary_tables(cfg, options, rotary.to(xt.dtype), xt)
                mask = hf_mask(config, cfg, xt, padding)
                return module(xt, position_embeddings=tables, attention_mask=mask, **family.call_kwargs(xt))[0]

            causes = family.float32_causes(cfg)
            if not family.complex_rotary and not options.float64_rotary:
                causes.append("the rotary module computes its angles in float32")
            if options.implementation == "eager":
                causes.append("eager attention's softmax runs in float32")
            description = f"transformers {family.module} ({options.implementation})"
            return hf_forward(family.layout, module, description, x, run, precision="float32", note="; ".join(causes))

    def read(module) -> MHAConfig:
        config = module.config
        norms = [n for n in (module.kv_a_layernorm, module.q_a_layernorm) if n is not None]
        eps = {float(n.variance_epsilon) for n in norms}
        if len(eps) != 1:
            raise unexpressible(module, f"latent norms of eps {sorted(eps)}", "the spec has one norm_eps")
        if (module.kv_a_proj_with_mqa.bias is None) != (module.o_proj.bias is None):
            raise unexpressible(module, "a bias on one of kv_a_proj_with_mqa and o_proj only")
        rope = family.rope(module)
        # yarn_apply_mscale(head_dim ** -0.5) and the spec's 1 / sqrt(head_dim) * m * m may differ in the last bit
        # (Mistral 4's d_k 12): within the scale rule's 1e-15 the module's scale is the spec's default, read as such
        scale = float(module.scaling)
        default = softmax_scale(module.qk_head_dim, rope.rope_scaling)
        with unexpressible_config(module):
            return MHAConfig(
                d_model=module.kv_a_proj_with_mqa.in_features,
                n_heads=module.num_heads,
                **{name: getattr(module, name) for name in LATENT},
                rope_interleave=True if family.complex_rotary else bool(config.rope_interleave),
                bias=module.o_proj.bias is not None,
                causal=bool(module.is_causal),
                scale=None if abs(scale - default) <= 1e-15 * default else scale,
                rope_base=rope.rope_base,
                rope_scaling=rope.rope_scaling,
                norm_eps=eps.pop(),
                **family.read_fields(module),
            )

    rotary = "interleaved (complex freqs_cis)" if family.complex_rotary else "rope_interleave: interleaved or half"
    fields: dict = dict(
        name=family.layout,
        module=family.module,
        description=f"{family.module}: multi-head latent attention (q/kv LoRA, one shared rotary key)",
        packing=SEPARATE,
        scale="(d_nope + d_rope)**-0.5 * m(factor, mscale_all_dim)**2 (yarn_apply_mscale)",
        rotary=f"{rotary}, on the last qk_rope_head_dim features of each head",
        source=f"transformers/models/{family.package}/modeling_{family.package}.py",
        split="q.view(B, N, -1, nope + rope); kv_b_proj(c).view(B, N, -1, nope + v): per head [k_nope | v]",
        rules=family.rules(),
        shapes=shapes,
        pack=pack,
        unpack=unpack,
        notes=(
            "float32 inside a float64 module on every path: " + NORM_FLOAT32 + "; held to float32",
            "transformers 4.57 cached the expanded per-head keys and values; 5.17 and later cache the normalised "
            "latent and the rotated k_rot (kv_lora_rank + qk_rope_head_dim numbers a token)",
        ),
        runner=runner,
        requires=HF_REQUIRES,
        hf_options=True,
        reader=torch_reader((f"transformers.{family.module}",), read, shapes, forward),
        # explain.real_checkpoints' layer (d_model 16, 4 heads of d_k 4) as MLA: nope 2 + rope 2, d_v 3.
        example=dict(q_lora_rank=5, kv_lora_rank=6, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3, causal=True),
        variants=("mla", "mla_q_lora", "rope_scaling"),
    )
    return Layout(**{**fields, **overrides})


V2 = DeepSeek(
    "hf-deepseek-v2", "DeepseekV2Attention", "deepseek_v2", "DeepseekV2Config", "DeepseekV2RotaryEmbedding", True
)
V3 = DeepSeek(
    "hf-deepseek-v3", "DeepseekV3Attention", "deepseek_v3", "DeepseekV3Config", "DeepseekV3RotaryEmbedding", False
)
LAYOUT_V2 = deepseek_layout(V2)
LAYOUT_V3 = deepseek_layout(V3)
