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
    LayoutError,
    default_scale,
    dense_general,
    no_grouped_kv,
    rotary_is,
    same_head_dims,
    separate_linears,
)
from ._module_io import ModuleReader, class_key, class_name, to_array, torch_reader, unexpressible
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


def _torch_mha_config(module) -> MHAConfig:
    """The nn.MultiheadAttention instance's configuration; add_bias_kv and add_zero_attn are not in the spec."""
    if module.bias_k is not None:
        raise unexpressible(module, "add_bias_kv=True (bias_k, bias_v appended to the keys and values as a token)")
    if module.add_zero_attn:
        raise unexpressible(module, "add_zero_attn=True (a zero key and value appended to every sequence)")
    return MHAConfig(
        d_model=module.embed_dim,
        n_heads=module.num_heads,
        kdim=module.kdim,
        vdim=module.vdim,
        bias=module.in_proj_bias is not None,
    )


def _torch_mha_forward(module, cfg, x, padding, options):
    import torch

    dtype = module.out_proj.weight.dtype
    B, N, _ = x.shape
    blocked = ~allowed_mask(cfg, B, N, padding)  # (B, 1, N, N): nn.MultiheadAttention's True means "blocked"
    attn_mask = torch.from_numpy(np.repeat(blocked, cfg.n_heads, axis=1).reshape(B * cfg.n_heads, N, N))  # (B*H, N, N)
    xt = torch.from_numpy(x).to(dtype)
    if not module.batch_first:
        xt = xt.transpose(0, 1)  # (N, B, E): sequence-first
    with torch.no_grad():
        output = module(xt, xt, xt, attn_mask=attn_mask, need_weights=False)[0]
    if not module.batch_first:
        output = output.transpose(0, 1)
    run = RealRun("torch-mha", "real", "torch.nn.MultiheadAttention", to_array(output).astype(np.float64))
    run.parameters = module_shapes(module)
    if dtype != torch.float64:
        run.precision = str(dtype).removeprefix("torch.")
    return run


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
    reader=torch_reader(("torch.MultiheadAttention",), _torch_mha_config, _torch_mha_shapes, _torch_mha_forward),
)

# --- flax.linen.MultiHeadDotProductAttention -----------------------------------------------


# Flax has two modules of this attention: linen's MultiHeadDotProductAttention (stateless: its parameters
# live in a variables tree, so `from_module` reads a *bound* module, `module.bind(variables)`) and NNX's
# MultiHeadAttention (it holds its parameters). Both store the same tree.
FLAX_LINEN, FLAX_NNX = "flax.MultiHeadDotProductAttention", "flax.MultiHeadAttention"
_FLAX_PARTS = ("query", "key", "value", "out")


def _flax_arrays(module) -> dict[str, np.ndarray]:
    """The module's params tree flattened with '/' (``query/kernel`` ...), NumPy copies."""
    if class_key(module) == FLAX_LINEN:
        if getattr(module, "scope", None) is None:
            raise LayoutError(
                f"{class_name(module)} is not bound: a linen module holds no parameters; "
                "pass module.bind(variables) (variables from module.init or a checkpoint)"
            )
        tree = module.variables["params"]
        return {f"{part}/{leaf}": to_array(array) for part in _FLAX_PARTS for leaf, array in tree[part].items()}
    arrays = {}
    for part in _FLAX_PARTS:
        layer = getattr(module, part)
        for leaf in ("kernel", "bias"):
            variable = getattr(layer, leaf, None)  # an nnx.Param, or None without bias
            if variable is not None and (variable.get_value() if hasattr(variable, "get_value") else 0) is not None:
                arrays[f"{part}/{leaf}"] = to_array(variable)
    return arrays


def _flax_config(module) -> MHAConfig:
    """The configuration of a bound linen MultiHeadDotProductAttention or an NNX MultiHeadAttention."""
    if module.normalize_qk:
        raise unexpressible(
            module,
            "normalize_qk=True (LayerNorm of each head's q and k)",
            "a LayerNorm subtracts the mean; the spec's qk_norm is RMSNorm (Qwen3, Gemma 3, OLMo 2)",
        )
    function = module.attention_fn
    if getattr(function, "__name__", "") != "dot_product_attention" or not function.__module__.startswith("flax"):
        raise unexpressible(module, f"attention_fn={function!r} (not Flax's own dot_product_attention)")
    if module.decode:
        raise unexpressible(module, "decode=True (its incremental-decoding cache)")
    arrays = _flax_arrays(module)
    width, heads, head_dim = arrays["query/kernel"].shape  # (in, H, d)
    out_width = arrays["out/kernel"].shape[-1]  # (H, d, out)
    if out_width != width:
        raise LayoutError(
            f"{class_name(module)} has out_features={out_width}, queries of width {width}: "
            "the spec's output has the query's width d_model"
        )
    return MHAConfig(
        d_model=width,
        n_heads=heads,
        n_kv_heads=arrays["key/kernel"].shape[1],  # NNX's num_kv_heads; the flax layout has no grouping
        d_k=head_dim,
        d_v=arrays["value/kernel"].shape[2],
        kdim=arrays["key/kernel"].shape[0],
        vdim=arrays["value/kernel"].shape[0],
        bias="query/bias" in arrays,
    )


def _flax_load(module, state: dict[str, np.ndarray]):
    """Linen: a new bound module with the params (linen modules are immutable); NNX: the arrays set in place."""
    import jax.numpy as jnp

    old = _flax_arrays(module)
    new = {name: jnp.asarray(array, dtype=old[name].dtype) for name, array in state.items()}
    if class_key(module) == FLAX_LINEN:
        unbound, variables = module.unbind()
        tree: dict[str, dict] = {}
        for name, array in new.items():
            part, leaf = name.split("/")
            tree.setdefault(part, {})[leaf] = array
        return unbound.bind({**variables, "params": tree})
    for name, array in new.items():
        part, leaf = name.split("/")
        getattr(getattr(module, part), leaf).set_value(array)
    return module


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
    notes=(
        "qkv_features is the total H*d (torch-like); out_features defaults to the query width",
        "from_module reads a bound linen module (module.bind(variables)) or an NNX MultiHeadAttention; "
        "to_module returns a new bound linen module (linen modules are immutable) and sets NNX's in place",
    ),
    reader=ModuleReader(
        classes=(FLAX_LINEN, FLAX_NNX),
        config=_flax_config,
        state=lambda module, cfg: _flax_arrays(module),
        load=_flax_load,
    ),
)

# --- equinox.nn.MultiheadAttention ---------------------------------------------------------


def _equinox_config(module) -> MHAConfig:
    """The equinox.nn.MultiheadAttention instance's configuration (its sizes are fields)."""
    biases = {
        "use_query_bias": module.use_query_bias,
        "use_key_bias": module.use_key_bias,
        "use_value_bias": module.use_value_bias,
        "use_output_bias": module.use_output_bias,
    }
    if len(set(biases.values())) > 1:
        raise unexpressible(
            module, ", ".join(f"{k}={v}" for k, v in biases.items()), "the spec's bias is on every projection or none"
        )
    if module.output_size != module.query_size:
        raise LayoutError(
            f"{class_name(module)} has output_size={module.output_size} != query_size={module.query_size}: "
            "the spec's output has the query's width d_model"
        )
    return MHAConfig(
        d_model=module.query_size,
        n_heads=module.num_heads,
        d_k=module.qk_size,
        d_v=module.vo_size,
        kdim=module.key_size,
        vdim=module.value_size,
        bias=module.use_query_bias,
    )


def _equinox_names(cfg: MHAConfig) -> list[str]:
    return list(EQUINOX_PACKING["shapes"](cfg))


def _equinox_arrays(module, cfg: MHAConfig) -> dict[str, np.ndarray]:
    arrays = {}
    for name in _equinox_names(cfg):
        layer, leaf = name.split(".")
        arrays[name] = to_array(getattr(getattr(module, layer), leaf))
    return arrays


def _equinox_load(module, state: dict[str, np.ndarray]):
    """A new module holding the arrays (Equinox modules are immutable pytrees: eqx.tree_at)."""
    import equinox as eqx
    import jax.numpy as jnp

    names = list(state)

    def where(m):
        return [getattr(getattr(m, name.split(".")[0]), name.split(".")[1]) for name in names]

    old = where(module)
    return eqx.tree_at(where, module, [jnp.asarray(state[n], dtype=o.dtype) for n, o in zip(names, old, strict=True)])


EQUINOX_PACKING = separate_linears(EQUINOX_NAMES)

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
    **EQUINOX_PACKING,
    notes=(
        "qk_size and vo_size are per head, like Keras's key_dim",
        "to_module returns a new module (Equinox modules are immutable pytrees)",
    ),
    reader=ModuleReader(
        classes=("equinox.MultiheadAttention",),
        config=_equinox_config,
        state=_equinox_arrays,
        load=_equinox_load,
    ),
)
