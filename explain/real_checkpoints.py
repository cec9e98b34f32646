"""Real checkpoints: every family's stored tensors, which rows belong to which head, and the split.

Nothing here is typed from memory. The head ownership of every stored tensor is read
back from the layout's own converter: each element of the canonical weights gets its own
number (role, row, column), `Layout.to_state_dict` moves those numbers where the real
checkpoint keeps them, and the numbers found along the tensor's rows (or columns, or head
axis) say which role and head owns each slice. Where the family's library imports, its
real module is built (tiny, from a config object), loaded with the state dict by its own
parameter names and run; the section reports the names and shapes it stores and how far
its output is from the spec's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from mha_rosetta.core import VARIANT_PARAM_NAMES, MHAConfig, MHAParams, compare, init_params, reference_mha
from mha_rosetta.core.variants import norm_step, param_spec

# w_q, w_k, w_v, w_o and the output gate's w_gate (with attn_output_gate): the first digit of every element's number
ROLES = ("q", "k", "v", "o", "gate")
# The variants' other parameters (`core.params.VARIANT_PARAM_NAMES`, the output gate's being a role above), numbered
# after the roles in MHAParams' field order: the QK-norm weights, the sinks, T5's table, then MLA's.
VARIANT_ROLES = tuple(name for name in VARIANT_PARAM_NAMES if name not in {f"{p}_{r}" for r in ROLES for p in "wb"})
# MLA's (`core.variants.mla`): its latents belong to no head (shared by all of them).
MLA_ROLES = ("w_kv_a", "b_kv_a", "kv_a_norm", "w_q_a", "b_q_a", "q_a_norm")
_ROLE_BASE = 1_000_000  # number = (role + 1) * 1e6 + row * 1e3 + column (+ 999 for a bias element)
_BIAS_COLUMN = 999
# A vector parameter's element i is numbered (role + 1) * 1e6 + i * 1e3 + 500: Gemma's stored "w" of "1 + w"
# (canonical - 1) still reads back as row i.
_VECTOR_COLUMN = 500

# The packed q/k/v tensor of each packing, and the family that shows it in the picture.
PACKING_EXAMPLES = (
    (
        "blocks",
        "timm-vit",
        "qkv.weight",
        "[Q; K; V]: timm qkv, nn.MultiheadAttention in_proj, GPT-2 c_attn (along out)",
    ),
    ("per head", "hf-gpt-neox", "query_key_value.weight", "[q_h; k_h; v_h] for each head: GPT-NeoX / Pythia"),
    ("per group", "megatron", "linear_qkv.weight", "[q heads of g | k_g | v_g] for each kv group g: Megatron-LM"),
)
# Falcon holds all three in one tensor, chosen by FalconConfig's two switches (`falcon_packings_table`):
# (packing, kv heads G, caption); the picture draws each from the hf-falcon converter below the three.
FALCON_PACKINGS = (
    ("Falcon per group", 2, "new_decoder_architecture=True: [q heads of g | k_g | v_g], G = num_kv_heads"),
    ("Falcon one group", 1, "multi_query=True: [every q head | k | v], one kv head"),
    ("Falcon per head", 4, "neither switch: [q_h; k_h; v_h] for each head, as GPT-NeoX"),
)
FALCON_TENSOR = "query_key_value.weight"


def family_config(layout: str) -> MHAConfig:
    """A small configuration the family's real module holds: d_model 16, 4 heads of 4, and the layout's own
    `Layout.example` (2 kv heads where it groups, its rotary, T5's scale 1...)."""
    from mha_rosetta.models import get_layout

    return MHAConfig(**{"d_model": 16, "n_heads": 4, "d_k": 4, **get_layout(layout).example})


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint and how its slices map to roles and heads."""

    name: str
    shape: tuple[int, ...]
    axis: int  # the axis along which the owner changes
    segments: tuple[tuple[int, int, str], ...]  # (start, stop, owner such as "q head 0") along that axis

    def layout_text(self) -> str:
        """``axis 0: 0:4 q head 0 | 4:8 k head 0 | ...``; runs of one owner are merged."""
        return f"axis {self.axis}: " + " | ".join(f"{start}:{stop} {owner}" for start, stop, owner in self.segments)


@dataclass
class Checkpoint:
    layout: str
    module: str
    packing: str
    scale: str
    rotary: str
    split: str
    config: str
    tensors: list[StoredTensor]
    real: str  # what the real module stored and computed, or why it was not built
    verified: bool | None  # None: the real module could not be built here
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["tensors"] = [{"name": t.name, "shape": list(t.shape), "layout": t.layout_text()} for t in self.tensors]
        return data


def numbered_params(cfg: MHAConfig) -> MHAParams:
    """Canonical params where every element holds its own (role, row, column) number, exactly representable."""
    shapes = {name: array.shape for name, array in init_params(cfg).as_dict().items() if array is not None}
    arrays = {}
    for role, letter in enumerate(ROLES):
        if f"w_{letter}" not in shapes:  # the gate, off
            continue
        rows, cols = shapes[f"w_{letter}"]
        base = (role + 1) * _ROLE_BASE
        arrays[f"w_{letter}"] = base + 1000.0 * np.arange(rows)[:, None] + np.arange(cols)[None, :]  # (out, in)
        if shapes.get(f"b_{letter}") is not None:  # bias="qkv" has no b_o
            arrays[f"b_{letter}"] = base + 1000.0 * np.arange(rows) + _BIAS_COLUMN  # (out,)
    for offset, name in enumerate(VARIANT_ROLES, start=len(ROLES) + 1):
        if name not in shapes:
            continue
        base = offset * _ROLE_BASE
        if len(shapes[name]) == 2:  # (buckets, H): row = bucket, column = head; MLA's (out, in) down-projections
            buckets, heads = shapes[name]
            arrays[name] = base + 1000.0 * np.arange(buckets)[:, None] + np.arange(heads)[None, :]
        else:  # (d_k,), (H*d_k,), (G*d_k,) or (H,)
            arrays[name] = base + 1000.0 * np.arange(shapes[name][0]) + _VECTOR_COLUMN
    return MHAParams(**arrays)


def _owner(cfg: MHAConfig, number: float) -> str:
    """The role and head that own the canonical element numbered ``number``."""
    role, rest = divmod(round(number), _ROLE_BASE)
    row, column = divmod(rest, 1000)
    if role > len(ROLES):
        return _variant_owner(cfg, VARIANT_ROLES[role - len(ROLES) - 1], row, column)
    letter = ROLES[role - 1]
    if letter == "o":  # w_o reads head h in columns h*Dv:(h+1)*Dv; its bias belongs to no head
        return "out (bias)" if column == _BIAS_COLUMN else f"reads head {column // cfg.d_v}"
    if letter == "gate":  # row block h of w_gate gates head h's context (d_v == d_k)
        return f"gate head {row // cfg.d_v}"
    head_dim = cfg.d_v if letter == "v" else cfg.d_k
    if letter == "k" and cfg.kv_lora_rank is not None:  # MLA's W_UK: qk_nope_head_dim rows a head
        head_dim = cfg.qk_nope_head_dim
    return f"{letter} {_head_kind(cfg, letter)} {row // head_dim}"


def _head_kind(cfg: MHAConfig, letter: str) -> str:
    """What a head of ``letter`` ("q", "k", "v") is called: a query head, or a kv head where GQA groups them."""
    return "head" if letter == "q" or cfg.n_kv_heads == cfg.n_heads else "kv head"


def _canonical_name(number: float) -> str:
    """The canonical parameter (``w_q``, ``b_o``, ``q_norm``...) whose element is numbered ``number``."""
    role, rest = divmod(round(number), _ROLE_BASE)
    if role > len(ROLES):
        return VARIANT_ROLES[role - len(ROLES) - 1]
    return f"{'b' if rest % 1000 == _BIAS_COLUMN else 'w'}_{ROLES[role - 1]}"


def _variant_owner(cfg: MHAConfig, name: str, row: int, column: int) -> str:
    """The head (or heads) that a variant parameter's element belongs to, read from the registry: a parameter with
    one entry per query head (`ParamSpec.head_axis`: the sinks, T5's table) is that head's, named by its first word
    in the singular ("sink head 0", "rel head 0"); the weights of the norm before rotary (`norm_step`: QK-norm) are
    every head's over the head, each head's rows over the projection."""
    spec = param_spec(name)
    if spec.head_axis is not None:  # a vector's element i is row i; a table's column h (every bucket) is head h's
        return f"{name.split('_')[0].removesuffix('s')} head {(row, column)[spec.head_axis]}"
    if name in MLA_ROLES:  # MLA's latents: every head reads them; w_kv_a's last rows are the shared rotary key
        if "q_a" in name:
            return "q latent, every head"
        return "shared rotary key" if name != "kv_a_norm" and row >= cfg.kv_lora_rank else "kv latent, every head"
    step = norm_step(cfg)
    if step is None or name not in step.weights:
        raise ValueError(f"no head owns {name!r}: it holds no entry per head and is no weight of a norm before rotary")
    which = "q" if name == step.weight("q") else "k"
    if step.per_head:
        return f"{which} norm, every head"  # one (d_k,) weight shared by all heads
    return f"{which} norm {_head_kind(cfg, which)} {row // cfg.d_k}"


def stored_tensor(cfg: MHAConfig, name: str, numbers: np.ndarray) -> StoredTensor:
    """Where each role/head sits in one stored tensor of numbered params."""
    owners = np.vectorize(lambda n: _owner(cfg, n), otypes=[object])(numbers)
    varying = [axis for axis in range(owners.ndim) if np.any(owners != owners.take([0], axis=axis))]
    axis = varying[0] if varying else 0
    line = owners[tuple(slice(None) if a == axis else 0 for a in range(owners.ndim))]  # the owners along that axis
    segments, start = [], 0
    for i in range(1, len(line) + 1):
        if i == len(line) or line[i] != line[start]:
            segments.append((start, i, str(line[start])))
            start = i
    return StoredTensor(name, tuple(numbers.shape), axis, tuple(segments))


def checkpoint(layout_name: str, real_modules: bool = True) -> Checkpoint:
    from mha_rosetta.models import get_layout

    layout = get_layout(layout_name)
    cfg = family_config(layout_name)
    state = layout.to_state_dict(cfg, numbered_params(cfg))
    tensors = [stored_tensor(cfg, name, array) for name, array in state.items()]
    real, verified = _real_module_evidence(layout_name, cfg) if real_modules else ("not run (real_modules=False)", None)
    return Checkpoint(
        layout.name,
        layout.module,
        layout.packing,
        layout.scale,
        layout.rotary,
        layout.split,
        cfg.describe(),
        tensors,
        real,
        verified,
        layout.notes,
    )


def _real_module_evidence(layout_name: str, cfg: MHAConfig) -> tuple[str, bool | None]:
    """Build the real module, load the layout's state dict by its own names, run it against the spec."""
    from mha_rosetta.models import get_layout

    from .oracle_modules import run_layout, unavailable_reason

    reason = unavailable_reason(layout_name)
    if reason:
        return f"skipped: {reason}", None
    layout = get_layout(layout_name)
    params = init_params(cfg, seed=0)
    x = np.random.default_rng(5).standard_normal((2, 5, cfg.d_model))
    run = run_layout(layout_name, cfg, layout.to_state_dict(cfg, params), x)
    result = compare(run.output, reference_mha(cfg, params, x), run.precision)
    expected = layout.expected_shapes(cfg)
    stored = {name: shape for name, shape in run.parameters.items() if name in expected or run.kind != "real"}
    names_ok = stored == expected
    parts = [
        f"{run.kind}: {run.module}",
        f"stores {'the same names and shapes' if names_ok else 'OTHER names or shapes: ' + str(stored)}",
        f"output vs spec: max abs {result.max_abs:.1e} ({run.precision} tolerance: {'agrees' if result.ok else 'DISAGREES'})",
    ]
    extra = {name: shape for name, shape in run.parameters.items() if name not in expected}
    if extra and run.kind == "real":
        parts.append(f"also stores {', '.join(extra)} (outside attention)")
    parts += [text for text in (run.known_difference, run.note) if text]
    return "; ".join(parts), names_ok and result.ok


def real_checkpoints(real_modules: bool = True) -> list[Checkpoint]:
    """One `Checkpoint` per registered layout (see `mha_rosetta.models.LAYOUTS`)."""
    from mha_rosetta.models import LAYOUTS

    return [checkpoint(name, real_modules) for name in LAYOUTS]


# --- tables and the picture -----------------------------------------------------------------

PACKING_PNG = "packings.png"  # written next to explainer.md by --write-docs
CHECKPOINTS_INTRO = (
    "Real checkpoints: each family's stored tensors, keyed by the real module's own names (mha_rosetta.models), "
    "which slices belong to which role and head (read back from the converter, element by element), the reshape "
    "the module splits them with, and what the real module stored and computed when loaded with them."
)


def checkpoint_tables(explanation) -> list[tuple[str, list[str], list[list[str]]]]:
    """The overview, Falcon's three packings side by side, then one table of stored tensors per family."""
    if not explanation.checkpoints:
        return []
    falcon = [falcon_packings_table()] if any(c.layout == "hf-falcon" for c in explanation.checkpoints) else []
    variants = (
        [variant_parameters_table()] if any(c.layout in _VARIANT_LAYOUTS for c in explanation.checkpoints) else []
    )
    tables = [overview_table(explanation.checkpoints), *falcon, *variants]
    return tables + [tensor_table(c) for c in explanation.checkpoints]


# The families whose checkpoints store a variant's parameters or fix its biases, in the order of the table.
_VARIANT_LAYOUTS = ("hf-qwen2", "hf-qwen3", "hf-olmo2", "hf-gemma3", "hf-gpt-oss", "hf-t5", "hf-qwen3-next")


def variant_parameters_table() -> tuple[str, list[str], list[list[str]]]:
    """What the 2024-26 families store beyond q/k/v/o, read back from their converters (numbered parameters).

    Qwen3's and OLMo 2's QK-norm weights differ exactly in their axis (one head's d_k, or the whole projection);
    Gemma 3 stores ``w`` for ``1 + w``; gpt-oss one sink per head; T5 a (buckets, H) table; Qwen2 has no o_proj bias.
    """
    from mha_rosetta.models import get_layout

    rows = []
    for name in _VARIANT_LAYOUTS:
        layout = get_layout(name)
        cfg = family_config(name)
        numbered = numbered_params(cfg)
        state = layout.to_state_dict(cfg, numbered)
        canonical = {k: v for k, v in numbered.as_dict().items() if v is not None}
        for stored, array in state.items():
            sources = sorted({_canonical_name(float(n)) for n in array.ravel()})  # the parameters it carries numbers of
            if not set(sources) & set(VARIANT_PARAM_NAMES) and sources[0][0] != "b":  # a variant's, or a bias
                continue
            source = ", ".join(sources)
            if len(sources) > 1:  # Qwen3-Next's q_proj: each head's query rows, then its gate rows
                form = "each head's rows in turn"
            elif np.array_equal(array, canonical[source] - 1.0):
                form = "canonical - 1 (used as 1 + w)"
            else:
                form = "canonical"
            rows.append(
                [name, stored, str(tuple(array.shape)), source, form, stored_tensor(cfg, stored, array).layout_text()]
            )
        if cfg.bias == "qkv":
            rows.append([name, "o_proj.bias", "absent", "b_o", "none (bias='qkv')", "-"])
    sizes = f"d_model {family_config('hf-qwen3').d_model}, 4 heads of 4, 2 kv heads"
    title = f"The 2024-26 families' extra parameters, side by side ({sizes}; read back from each converter)"
    return (
        title,
        ["layout", "stored tensor", "shape", "canonical", "stored as", "which slices belong to which head"],
        rows,
    )


def falcon_packings_table() -> tuple[str, list[str], list[list[str]]]:
    """Falcon's ``query_key_value`` under each of its packings, read back from the ``hf-falcon`` converter.

    The two FalconConfig switches pick G, the number of kv groups of the per-group packing: ``num_kv_heads``
    (``new_decoder_architecture``), 1 (``multi_query``) or H (neither: per head).
    """
    from dataclasses import replace

    from mha_rosetta.models import get_layout
    from mha_rosetta.models.hf_falcon import packing_switches

    base = family_config("hf-falcon")
    rows = []
    for kv_heads in (2, 1, base.n_heads):
        cfg = replace(base, n_kv_heads=kv_heads)
        switches = ", ".join(f"{name}=True" for name, on in packing_switches(cfg).items() if on) or "neither (per head)"
        weight = get_layout("hf-falcon").to_state_dict(cfg, numbered_params(cfg))["query_key_value.weight"]
        tensor = stored_tensor(cfg, "query_key_value.weight", weight)
        rows.append([switches, str(kv_heads), str(tensor.shape), tensor.layout_text()])
    sizes = f"d_model {base.d_model}, {base.n_heads} heads of {base.d_k}"
    title = f"Falcon's three packings of query_key_value, side by side ({sizes}; G kv groups)"
    return title, ["FalconConfig", "G", "shape", "which rows belong to which role and head"], rows


def overview_table(checkpoints: list[Checkpoint]) -> tuple[str, list[str], list[list[str]]]:
    headers = ["layout", "module (keys relative to it)", "packing", "scale", "rotary", "real module"]
    rows = [[c.layout, c.module, c.packing, c.scale, c.rotary, c.real] for c in checkpoints]
    return "Real checkpoints: the families at a glance", headers, rows


def tensor_table(c: Checkpoint) -> tuple[str, list[str], list[list[str]]]:
    rows = [[t.name, str(t.shape), t.layout_text()] for t in c.tensors]
    title = f"{c.layout} ({c.config}): split = {c.split}"
    return title, ["stored tensor", "shape", "which slices belong to which role and head"], rows


def packing_rows(layout_name: str, tensor: str, kv_heads: int | None = None) -> tuple[MHAConfig, np.ndarray]:
    """(cfg, owner label per row) of a family's packed q/k/v weight, read back from its converter;
    ``kv_heads`` replaces the family's example's (Falcon's packing follows it)."""
    from dataclasses import replace

    from mha_rosetta.models import get_layout

    cfg = family_config(layout_name)
    cfg = cfg if kv_heads is None else replace(cfg, n_kv_heads=kv_heads)
    numbers = get_layout(layout_name).to_state_dict(cfg, numbered_params(cfg))[tensor][:, 0]  # (rows,)
    return cfg, np.array([_owner(cfg, n) for n in numbers], dtype=object)


def save_packing_png(path) -> str:
    """The three packings of a fused q/k/v weight, then Falcon's three of its one ``query_key_value``, row by
    row, coloured by role and labelled by head (matplotlib, Agg)."""
    from mha_rosetta.models import get_layout

    from .head_split import pyplot, save_figure

    plt = pyplot("packing picture")

    role_colours = {"q": "#4c78a8", "k": "#f58518", "v": "#54a24b"}  # one colour per role; labels carry the head
    examples = [(packing, layout, tensor, caption, None) for packing, layout, tensor, caption in PACKING_EXAMPLES]
    examples += [(packing, "hf-falcon", FALCON_TENSOR, caption, G) for packing, G, caption in FALCON_PACKINGS]
    figure, axes = plt.subplots(len(examples), 1, figsize=(12, 1.6 * len(examples) + 0.6))
    for ax, (packing, layout_name, tensor, caption, kv_heads) in zip(axes, examples, strict=True):
        cfg, owners = packing_rows(layout_name, tensor, kv_heads)
        for row, owner in enumerate(owners):
            letter, head = owner.split()[0], owner.split()[-1]
            ax.add_patch(
                plt.Rectangle((row, 0), 1, 1, facecolor=role_colours[letter], edgecolor="white", linewidth=0.5)
            )
            ax.text(row + 0.5, 0.5, f"{letter}{head}", ha="center", va="center", fontsize=6, color="white")
            if row and owner != owners[row - 1]:  # a new (role, head) block starts here
                ax.axvline(row, color="black", linewidth=1.2)
        ax.set_xlim(0, len(owners))
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks(range(0, len(owners) + 1, cfg.d_k))
        ax.tick_params(axis="x", labelsize=7)
        shape = get_layout(layout_name).expected_shapes(cfg)[tensor]
        ax.set_title(f"{packing}: {layout_name} {tensor} {shape}  -  {caption}", fontsize=9, loc="left")
    axes[-1].set_xlabel(
        "row of the stored (out, in) weight; label = role + head (the kv head for k and v); blue q, orange k, green v"
    )
    figure.suptitle(
        f"Three packings of q, k, v in one weight ({family_config('timm-vit').describe()}; Megatron with 2 kv "
        "groups), then Falcon's three, one per FalconConfig, in one tensor name",
        fontsize=10,
    )
    return save_figure(figure, path)
