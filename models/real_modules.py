"""The real modules of each family, built tiny from config objects and loaded with a layout's state dict.

Nothing is downloaded: every module is built from its library's config object with the
sizes of an ``MHAConfig``, in float64, and loaded from `Layout.to_state_dict` by the
module's own parameter names (``load_state_dict(strict=True)`` for torch modules; by
variable path for Keras; Flax and Equinox through the project's oracle backends, which
build the module's tree from the same converters). `run_real` then runs it on
row-sample inputs with an optional key padding mask, building the mask the way the
family's own model does (Hugging Face's ``create_causal_mask`` /
``create_bidirectional_mask``, Keras's boolean ``attention_mask``...).

Where the real library cannot run here, the runner says so in `RealRun.kind`:
``"real"`` (the library's own module), ``"equivalent"`` (another real module with the
same packing, e.g. ``nn.MultiheadAttention`` for timm's ``qkv``) or ``"reimplementation"``
(the family's split written from its source, for Megatron-LM and Meta's Llama).

Every framework is imported inside the function that uses it; importing this module
imports NumPy only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mha_rosetta.core import MHAConfig

from . import get_layout

# Hugging Face and Keras module families need these libraries; the rest need torch or JAX.
REQUIRES = {
    "hf-gpt2": ("torch", "transformers"),
    "hf-bert": ("torch", "transformers"),
    "hf-llama": ("torch", "transformers"),
    "meta-llama": ("torch", "transformers"),
    "hf-gpt-neox": ("torch", "transformers"),
    "hf-t5": ("torch", "transformers"),
    "megatron": ("torch",),
    "timm-vit": ("torch",),
    "keras": ("keras",),
    "torch-mha": ("torch",),
    "flax": ("flax", "jax"),
    "equinox": ("equinox", "jax"),
}
# The extra that installs each library: its own name, except where the "models" extra brings it.
INSTALL = {"transformers": "models", "keras": "models"}


@dataclass
class RealRun:
    """What a real module computed, and what it was."""

    layout: str
    kind: str  # "real", "equivalent" or "reimplementation"
    module: str  # what ran, in words
    output: np.ndarray  # (B, N, E)
    merged: np.ndarray | None = None  # (B, N, H*Dv) where the module stops before the output projection
    parameters: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the real module's own names and shapes
    precision: str = "float64"  # the dtype whose tolerance applies (float32 where the module computes in float32)
    note: str = ""
    known_difference: str = ""  # what failed in the module's default path (the output then comes from another path)


def unavailable_reason(layout: str) -> str | None:
    """None when the libraries `run_real` needs for ``layout`` import here; else why not, with the install command."""
    from mha_rosetta.backends._probe import probe

    for module in REQUIRES[get_layout(layout).name]:
        found = probe(module)
        if not found.installed:
            return f"{found.reason}: pip install 'mha-rosetta[{INSTALL.get(module, module)}]'"
        if not found.ok:
            return found.reason
    return None


def allowed_mask(cfg: MHAConfig, batch: int, tokens: int, padding: np.ndarray | None) -> np.ndarray:
    """The spec's boolean mask (B, 1, N, N) for key padding ``padding (B, N)`` (True = real token) and cfg.causal."""
    allowed = np.ones((batch, 1, tokens, tokens), dtype=bool)
    if padding is not None:
        allowed &= np.asarray(padding, dtype=bool)[:, None, None, :]
    if cfg.causal:
        allowed &= np.tril(np.ones((tokens, tokens), dtype=bool))
    return allowed


HF_IMPLEMENTATIONS = ("eager", "sdpa")  # Hugging Face's reference path, and the default one (torch SDPA)


def run_real(
    layout: str,
    cfg: MHAConfig,
    state: dict[str, np.ndarray],
    x: np.ndarray,
    padding=None,
    implementation: str = "eager",
    float64_rotary: bool = False,
) -> RealRun:
    """Load ``state`` into ``layout``'s real module built for ``cfg`` and run it on ``x (B, N, E)``.

    ``padding (B, N)``: True for real tokens (a key padding mask); ``cfg.causal`` adds the
    causal mask. ``implementation``: Hugging Face's attention path for the ``hf-*`` and
    ``meta-llama`` families (``"eager"`` or ``"sdpa"``). ``float64_rotary``: give Llama and
    GPT-NeoX the spec's float64 cos/sin tables instead of their rotary module's, which
    computes its angles in float32 even in a float64 model.
    """
    reason = unavailable_reason(layout)
    if reason:
        raise ImportError(f"layout {layout!r}: cannot build the real module: {reason}")
    get_layout(layout).require(cfg)
    x = np.asarray(x, dtype=np.float64)
    padding = None if padding is None else np.asarray(padding, dtype=bool)
    if layout in _HF_RUNNERS:
        if implementation not in HF_IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {', '.join(HF_IMPLEMENTATIONS)}, got {implementation!r}")
        return _HF_RUNNERS[layout](cfg, state, x, padding, _HFOptions(implementation, float64_rotary))
    if implementation != "eager" or float64_rotary:
        raise ValueError(f"implementation and float64_rotary apply to Hugging Face layouts only, not {layout!r}")
    return _RUNNERS[layout](cfg, state, x, padding)


# --- torch helpers ------------------------------------------------------------------------


def _torch_state(state: dict[str, np.ndarray]):
    import torch

    return {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in state.items()}


def _shapes(module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(value.shape) for name, value in module.state_dict().items()}


def _hf_mask(config, cfg: MHAConfig, x, padding):
    """The mask the family's own model passes to its attention layers (None: the module's own is_causal / no mask).

    Eager gets a 4-D additive float mask; SDPA a boolean one, or None where the mask is
    plain causal or empty, leaving the causal part to the module's ``is_causal``.
    """
    import torch
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    pad = None if padding is None else torch.from_numpy(padding.astype(np.int64))  # (B, N), 1 = real token
    if cfg.causal:
        tokens = x.shape[1]
        return create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=torch.arange(tokens)[None]
        )
    return create_bidirectional_mask(config=config, inputs_embeds=x, attention_mask=pad)


@dataclass(frozen=True)
class _HFOptions:
    implementation: str  # "eager" (HF's reference path) or "sdpa" (its default: torch SDPA)
    float64_rotary: bool  # the spec's cos/sin tables instead of the module's float32 ones


def _hf_config(config, options: _HFOptions):
    config._attn_implementation = options.implementation
    return config


def _hf_run(layout: str, module, description: str, state, x, forward, **extra) -> RealRun:
    """Load ``state`` into the HF ``module`` (strict) and run ``forward(x as a tensor)`` without gradients."""
    import torch

    module.load_state_dict(_torch_state(state), strict=True)
    with torch.no_grad():
        output = forward(torch.from_numpy(x))
    return RealRun(layout, "real", description, output.numpy(), parameters=_shapes(module), **extra)


# --- Hugging Face -------------------------------------------------------------------------


def _gpt2(cfg, state, x, padding, options):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    config = _hf_config(GPT2Config(n_embd=cfg.d_model, n_head=cfg.n_heads, attn_pdrop=0.0, resid_pdrop=0.0), options)
    module = GPT2Attention(config, layer_idx=0).double().eval()

    def forward(xt):
        return module(xt, attention_mask=_hf_mask(config, cfg, xt, padding))[0]

    return _hf_run("hf-gpt2", module, f"transformers GPT2Attention ({options.implementation})", state, x, forward)


def _bert(cfg, state, x, padding, options):
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertAttention

    config = _hf_config(
        BertConfig(
            hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads,
            attention_probs_dropout_prob=0.0,
            hidden_dropout_prob=0.0,
            is_decoder=cfg.causal,
        ),
        options,
    )
    module = BertAttention(config, is_causal=cfg.causal).double().eval()
    tensors = _torch_state(state)
    # BertAttention also holds output.LayerNorm, which is not attention: load the two parts strictly, apart.
    for part, prefix in ((module.self, "self."), (module.output.dense, "output.dense.")):
        part.load_state_dict(
            {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}, strict=True
        )
    xt = torch.from_numpy(x)
    mask = _hf_mask(config, cfg, xt, padding)
    with torch.no_grad():
        merged = module.self(xt, attention_mask=mask)[0]  # (B, N, H*d): BertSelfAttention stops here
        output = module.output.dense(merged)
    return RealRun(
        "hf-bert",
        "real",
        f"transformers BertSelfAttention + BertSelfOutput.dense ({options.implementation})",
        output.numpy(),
        merged.numpy(),
        parameters=_shapes(module),
        note="BertSelfOutput then computes LayerNorm(dense + input): outside the spec",
    )


def _cos_sin(cfg: MHAConfig, options: _HFOptions, rotary, x):
    """The (cos, sin) each HF rotary model passes its attention layers, each (1, N, rope_dims), rotate-half layout."""
    import torch

    tokens = x.shape[1]
    if not options.float64_rotary:
        return rotary(x, torch.arange(tokens)[None])  # the module's own tables, positions 0..N-1
    from mha_rosetta.core.rotary import angles

    theta = angles(cfg, np.arange(tokens))  # (N, r/2), float64: the spec's angles
    doubled = np.concatenate([theta, theta], axis=-1)[None]  # (1, N, r): HF repeats them for the two halves
    return torch.from_numpy(np.cos(doubled)), torch.from_numpy(np.sin(doubled))


def _llama_config(cfg, options):
    from transformers import LlamaConfig

    return _hf_config(
        LlamaConfig(
            hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.d_k,
            attention_bias=cfg.bias,
            attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
        ),
        options,
    )


def _llama(cfg, state, x, padding, options, layout="hf-llama"):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = _llama_config(cfg, options)
    module = LlamaAttention(config, layer_idx=0).double().eval()

    def forward(xt):
        cos_sin = _cos_sin(cfg, options, LlamaRotaryEmbedding(config).double(), xt)
        return module(xt, position_embeddings=cos_sin, attention_mask=_hf_mask(config, cfg, xt, padding))[0]

    description = f"transformers LlamaAttention ({options.implementation})"
    return _hf_run(layout, module, description, state, x, forward, **_rotary_precision(options))


def _meta_llama(cfg, state, x, padding, options):
    """Meta's layout in HF's real LlamaAttention after the rope converter, checked against Meta's own rotary."""
    from . import convert_state_dict

    hf_cfg, hf_state = convert_state_dict(cfg, state, "meta-llama", "hf-llama")
    run = _llama(hf_cfg, hf_state, x, padding, options, layout="meta-llama")
    reimplemented = meta_reference_forward(cfg, state, x, padding)
    run.kind = "equivalent"
    run.module = (
        f"transformers LlamaAttention ({options.implementation}) after convert_state_dict(meta-llama -> hf-llama)"
    )
    run.note = (
        "Meta's model.py is not a package: the weights go through the q/k row permutation into HF's real "
        f"LlamaAttention; Meta's own complex-number rotary, rewritten from its source, agrees within "
        f"{np.max(np.abs(reimplemented - run.output)):.1e}"
    )
    run.parameters = {name: tuple(np.shape(value)) for name, value in state.items()}
    return run


def meta_reference_forward(cfg: MHAConfig, state: dict[str, np.ndarray], x: np.ndarray, padding=None) -> np.ndarray:
    """Meta's Attention.forward rewritten from llama/model.py (float64): wq/wk/wv/wo and view_as_complex rotary."""
    import torch

    B, N, _ = x.shape
    H, G, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_k
    w = _torch_state(state)
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


def _gpt_neox(cfg, state, x, padding, options):
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding

    config = _hf_config(
        GPTNeoXConfig(
            hidden_size=cfg.d_model,
            num_attention_heads=cfg.n_heads,
            attention_bias=cfg.bias,
            attention_dropout=0.0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": cfg.rope_base,
                "partial_rotary_factor": cfg.rope_dims / cfg.d_k,
            },
        ),
        options,
    )
    module = GPTNeoXAttention(config, layer_idx=0).double().eval()
    if module.rotary_ndims != cfg.rope_dims:
        raise ValueError(f"GPTNeoXAttention rotates {module.rotary_ndims} features per head, the spec {cfg.rope_dims}")

    def forward(xt):
        cos_sin = _cos_sin(cfg, options, GPTNeoXRotaryEmbedding(config).double(), xt)
        return module(xt, attention_mask=_hf_mask(config, cfg, xt, padding), position_embeddings=cos_sin)[0]

    description = f"transformers GPTNeoXAttention ({options.implementation})"
    return _hf_run("hf-gpt-neox", module, description, state, x, forward, **_rotary_precision(options))


def _rotary_precision(options: _HFOptions) -> dict[str, str]:
    """Where Llama and GPT-NeoX compute in float32 inside a float64 model, and so which tolerance applies."""
    causes = []
    if not options.float64_rotary:
        causes.append("the rotary module computes its angles in float32 (inv_freq and positions in torch.float)")
    if options.implementation == "eager":
        causes.append("eager attention's softmax runs in float32 (softmax(..., dtype=torch.float32))")
    return {"precision": "float32", "note": "; ".join(causes)} if causes else {}


def _t5(cfg, state, x, padding, options):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = _hf_config(
        T5Config(d_model=cfg.d_model, d_kv=cfg.d_k, num_heads=cfg.n_heads, dropout_rate=0.0, is_decoder=cfg.causal),
        options,
    )
    module = T5Attention(config, has_relative_attention_bias=False, layer_idx=0, is_causal=cfg.causal).double().eval()

    def forward(xt):
        return module(xt, mask=_hf_mask(config, cfg, xt, padding))[0]

    description = f"transformers T5Attention ({options.implementation}, no relative bias)"
    return _hf_run("hf-t5", module, description, state, x, forward)


# --- torch: timm's block packing, Megatron's group packing, nn.MultiheadAttention --------------


def _run_torch_mha(cfg, state, x, padding):
    """``state`` loaded (strictly) into ``nn.MultiheadAttention(batch_first=True)``, run on x: (output, module)."""
    import torch

    module = torch.nn.MultiheadAttention(
        cfg.d_model, cfg.n_heads, bias=cfg.bias, kdim=cfg.kdim, vdim=cfg.vdim, batch_first=True, dtype=torch.float64
    ).eval()
    module.load_state_dict(_torch_state(state), strict=True)
    B, N, _ = x.shape
    blocked = ~allowed_mask(cfg, B, N, padding)  # (B, 1, N, N): nn.MultiheadAttention's True means "blocked"
    attn_mask = torch.from_numpy(np.repeat(blocked, cfg.n_heads, axis=1).reshape(B * cfg.n_heads, N, N))  # (B*H, N, N)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        return module(xt, xt, xt, attn_mask=attn_mask, need_weights=False)[0].numpy(), module


def _torch_mha(cfg, state, x, padding):
    output, module = _run_torch_mha(cfg, state, x, padding)
    return RealRun(
        "torch-mha", "real", "torch.nn.MultiheadAttention(batch_first=True)", output, parameters=_shapes(module)
    )


TIMM_TO_TORCH_MHA = {
    "qkv.weight": "in_proj_weight",
    "qkv.bias": "in_proj_bias",
    "proj.weight": "out_proj.weight",
    "proj.bias": "out_proj.bias",
}


def _timm(cfg, state, x, padding):
    from mha_rosetta.backends._probe import importable

    if importable("timm"):
        return _timm_real(cfg, state, x, padding)
    renamed = {TIMM_TO_TORCH_MHA[name]: value for name, value in state.items()}
    output, _ = _run_torch_mha(cfg, renamed, x, padding)  # strict: timm's qkv/proj are in_proj/out_proj renamed
    return RealRun(
        "timm-vit",
        "equivalent",
        "torch.nn.MultiheadAttention loaded with timm's tensors renamed (same [Q; K; V] packing)",
        output,
        parameters={name: tuple(value.shape) for name, value in state.items()},
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
    module.load_state_dict(_torch_state(state), strict=True)
    with torch.no_grad():
        output = module(torch.from_numpy(x)).numpy()
    return RealRun("timm-vit", "real", "timm vision_transformer.Attention", output, parameters=_shapes(module))


def megatron_split(cfg: MHAConfig, mixed_qkv):
    """Megatron-LM's ``SelfAttention.get_query_key_value_tensors`` split, rewritten from its source (torch).

    ``mixed_qkv`` is ``linear_qkv``'s output, sequence-first ``(s, b, (H + 2G)*d)``; returns
    query ``(s, b, H, d)``, key and value ``(s, b, G, d)``.
    """
    import torch

    G, d, Q = cfg.n_kv_heads, cfg.d_k, cfg.group_size
    mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], G, (Q + 2) * d)  # [sq, b, ng, (np/ng + 2) * hn]
    query, key, value = torch.split(mixed_qkv, [Q * d, d, d], dim=3)  # [sq, b, ng, np/ng * hn], [.., hn], [.., hn]
    query = query.reshape(query.size(0), query.size(1), -1, d)  # [sq, b, np, hn]
    return query, key, value


def _megatron(cfg, state, x, padding):
    import torch

    B, N, _ = x.shape
    w = _torch_state(state)
    hidden = torch.from_numpy(x).transpose(0, 1)  # (s, b, h): Megatron is sequence-first
    mixed = hidden @ w["linear_qkv.weight"].T + (w["linear_qkv.bias"] if cfg.bias else 0.0)  # (s, b, (H+2G)*d)
    query, key, value = megatron_split(cfg, mixed)
    q = query.permute(1, 2, 0, 3)  # (b, H, s, d)
    k = key.permute(1, 2, 0, 3)  # (b, G, s, d)
    v = value.permute(1, 2, 0, 3)
    if cfg.rope is not None:
        q, k = _rotate_bhsd(cfg, q), _rotate_bhsd(cfg, k)
    allowed = torch.from_numpy(allowed_mask(cfg, B, N, padding))
    context = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=cfg.scale, enable_gqa=cfg.n_kv_heads != cfg.n_heads
    )  # (b, H, s, d)
    merged = context.permute(2, 0, 1, 3).reshape(N, B, -1)  # (s, b, H*d), Megatron's core_attn_out
    output = merged @ w["linear_proj.weight"].T + (w["linear_proj.bias"] if cfg.bias else 0.0)
    return RealRun(
        "megatron",
        "reimplementation",
        "Megatron-LM's linear_qkv split (view + split, rewritten from its source) + torch SDPA",
        output.transpose(0, 1).numpy(),
        merged.transpose(0, 1).numpy(),
        parameters={name: tuple(value.shape) for name, value in state.items()},
        note="Megatron-LM is not installable here: its split is rewritten from attention.py",
    )


def _rotate_bhsd(cfg, t):
    """Rotary on (b, heads, s, d) with the spec's tables (positions 0..s-1), in cfg.rope's pairing."""
    import torch

    from mha_rosetta.core.rotary import angles, apply_rotary

    positions = np.arange(t.shape[2])
    theta = angles(cfg, positions)  # (s, r/2)
    return torch.from_numpy(apply_rotary(t.numpy(), np.cos(theta), np.sin(theta), cfg.rope))


# --- Keras, Flax, Equinox ---------------------------------------------------------------------


def _keras(cfg, state, x, padding):
    import keras

    if keras.backend.backend() == "jax":
        from mha_rosetta.backends.jax.common import enable_float64_if_needed

        enable_float64_if_needed("float64")
    layer = keras.layers.MultiHeadAttention(
        num_heads=cfg.n_heads, key_dim=cfg.d_k, value_dim=cfg.d_v, use_bias=cfg.bias, dtype="float64"
    )
    layer.build((None, None, cfg.d_model), (None, None, cfg.vdim), (None, None, cfg.kdim))
    by_path = {variable.path.removeprefix(layer.name + "/"): variable for variable in layer.weights}
    if set(by_path) != set(state):
        raise ValueError(f"keras MultiHeadAttention holds {sorted(by_path)}, the state dict {sorted(state)}")
    for name, variable in by_path.items():
        variable.assign(state[name])
    B, N, _ = x.shape
    mask = allowed_mask(cfg, B, N, padding)[:, 0]  # (B, N, N), True = may attend: Keras's polarity
    backend = keras.backend.backend()
    run = RealRun(
        "keras",
        "real",
        f"keras.layers.MultiHeadAttention ({backend} backend)",
        np.zeros(0),
        parameters={name: tuple(variable.shape) for name, variable in by_path.items()},
    )
    try:
        run.output = np.asarray(layer(x, x, key=x, attention_mask=mask))
    except Exception as error:  # the known JAX-backend failure with value_dim != key_dim, kept visible
        run.known_difference = f"the default call fails: {type(error).__name__}: {_first_line(error)}"
        # return_attention_scores=True takes Keras's own einsum path instead of the fused dot_product_attention.
        run.output = np.asarray(layer(x, x, key=x, attention_mask=mask, return_attention_scores=True)[0])
        run.note = "output from the return_attention_scores=True path (Keras's einsum), which runs in float64"
        return run
    if backend == "jax":
        run.precision = "float32"
        run.note = "on JAX the default call uses jax.nn.dot_product_attention, whose softmax always runs in float32"
    return run


def _first_line(error: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # Keras colours its messages for terminals
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Keras wraps the backend error in "Exception encountered when calling ...": keep the backend's own line.
    inner = [line for line in lines if not line.startswith(("Exception encountered", "Arguments received", "•"))]
    return (inner or lines or [""])[0]


def _library_oracle(layout_name: str):
    """Flax and Equinox: the project's own oracle backends already load the real module from the same names."""

    def run(cfg, state, x, padding):
        from mha_rosetta.backends import get_backend

        # from_state_dict checks every flat name against the layout; the backend then builds the real module's
        # tree from the same converter (core.to_flax_params / to_equinox_weights) and runs it in float64.
        layout = get_layout(layout_name)  # layout.module names the library's class, e.g. equinox.nn.MultiheadAttention
        params = layout.from_state_dict(cfg, state)
        B, N, _ = x.shape
        backend = get_backend(layout_name)
        output = backend.run(cfg, params, x, mask=allowed_mask(cfg, B, N, padding), dtype="float64")
        shapes = {name: tuple(value.shape) for name, value in state.items()}
        description = f"{layout.module} (through the {layout_name!r} oracle backend)"
        return RealRun(layout_name, "real", description, output, parameters=shapes)

    return run


_HF_RUNNERS: dict[str, Callable] = {
    "hf-gpt2": _gpt2,
    "hf-bert": _bert,
    "hf-llama": _llama,
    "meta-llama": _meta_llama,
    "hf-gpt-neox": _gpt_neox,
    "hf-t5": _t5,
}
_RUNNERS: dict[str, Callable] = {
    "megatron": _megatron,
    "timm-vit": _timm,
    "keras": _keras,
    "torch-mha": _torch_mha,
    "flax": _library_oracle("flax"),
    "equinox": _library_oracle("equinox"),
}
