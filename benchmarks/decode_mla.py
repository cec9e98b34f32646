"""``bench --mode decode``'s MLA row (issue 45): DeepSeek's latent attention decoded in its two forms, the bytes a
step reads, and absorbed over naive per context.

The row's layer is the sweep's ``d_model`` and ``heads`` with the latent sizes of ``settings.mla``
(`mla_config`). Its cells are ``backend:naive`` and ``backend:absorbed`` for each backend of the sweep's
implementations that decodes MLA (its ``decode_strategies`` hold both forms), at ``mla_contexts``. Both forms cache
the latent, ``kv_lora_rank + d_rope`` numbers a token (`core.mla_forms.cache_bytes_per_token`), against
``2 Hkv d_k`` for the sweep's plain layer; what a step reads (`mla_read_bytes`, by `core.mla_forms.decode_step_costs`):

* both forms: the latent cache, ``B x T x (R + dr) x itemsize``, and the weights: the query projection(s), ``W_kva``
  (D, R + dr), ``W_UK`` (H dn, R), ``W_UV`` (H dv, R) and ``W_O`` (D, H dv);
* naive also expands the whole cache through ``W_UK`` and ``W_UV`` every step and attends over what it made: the
  per-head keys and values, ``B x T x H x (d_k + d_v) x itemsize``, written and read back (counted once, as read).

An absorbed implementation that folds ``W_O W_UV`` ahead (NumPy's ``(H, D, R)``) reads those numbers instead of
``W_UV`` and ``W_O``; the count is the layer's weights as it holds them, the same for every implementation.
"""

from __future__ import annotations

MLA_ROW = "mla"  # `DecodeCellSpec.row` of the MLA row's cells
# The MLA layer's fields a sweep's ``mla`` setting may hold (MHAConfig's names, as transformers names them).
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank")


def check_mla_layer(mla: dict | None) -> None:
    """Refuse a ``mla`` setting that is not a dict of `MLA_FIELDS` (positive ints; ``q_lora_rank`` may be None)."""
    if mla is None:
        return
    if not isinstance(mla, dict) or "kv_lora_rank" not in mla:
        raise ValueError(f"decode mla must be a dict of {', '.join(MLA_FIELDS)} (kv_lora_rank at least), got {mla!r}")
    unknown = sorted(set(mla) - set(MLA_FIELDS))
    if unknown:
        raise ValueError(f"decode mla takes {', '.join(MLA_FIELDS)}, got unknown {', '.join(unknown)}")


def mla_config(layer: dict):
    """The causal MLA `MHAConfig` of a cell record or spec's fields: ``d_model``, ``heads``, ``bias``, ``window`` and
    the latent sizes of ``layer["mla"]``."""
    from mha_rosetta.core import MHAConfig

    return MHAConfig(
        d_model=layer["d_model"], n_heads=layer["heads"], causal=True, bias=layer.get("bias", False),
        window=layer.get("window"), **layer["mla"],
    )  # fmt: skip


def mla_implementations(implementations: list[str]) -> list[str]:
    """``backend:form`` for each MLA form, for each backend of ``implementations`` (in their order) that decodes
    MLA: its ``decode_strategies`` hold both forms (`backends._mla.MLA_STRATEGIES`). A backend that does not load
    (its library missing: an ImportError, `BackendNotInstalled` among them) or refuses (`UnsupportedCase`) is left
    out: the main row's cells say why. Any other error is a bug and is raised."""
    from mha_rosetta.backends import UnsupportedCase, get_backend
    from mha_rosetta.backends._mla import MLA_STRATEGIES

    from .cell import implementation_label, split_implementation

    labels: list[str] = []
    for backend in dict.fromkeys(split_implementation(label)[0] for label in implementations):
        try:
            decodes = set(MLA_STRATEGIES) <= set(get_backend(backend).decode_strategies)
        except (ImportError, UnsupportedCase):
            continue
        if decodes:
            labels += [implementation_label(backend, form) for form in MLA_STRATEGIES]
    return labels


def mla_read_bytes(cell: dict, itemsize: int) -> dict:
    """What one step of an MLA cell reads (the module's docstring says what each form reads), and the cache's bytes
    a token: ``latent_cache_bytes``, ``expanded_kv_bytes`` (naive's per-head keys and values, 0 absorbed),
    ``kv_read_bytes`` (their sum: what the limit counts), ``weight_bytes``, ``cache_bytes_per_token`` (R + dr),
    ``expanded_bytes_per_token`` (H (d_k + d_v)) and ``plain_bytes_per_token`` (2 Hkv d_k of the sweep's plain layer)."""
    from mha_rosetta.core.mla_forms import cache_bytes_per_token, decode_step_costs

    cfg, form, batch, context = mla_config(cell), cell["strategy"], cell["batch"], cell["context"]
    per_token = cache_bytes_per_token(cfg, itemsize)
    own_weights = decode_step_costs(cfg, 0, form, itemsize)["bytes"]  # W_UK and W_UV: at T = 0, only the weights
    per_sequence = decode_step_costs(cfg, context, form, itemsize)["bytes"] - own_weights
    latent = batch * context * per_token["latent"]
    expanded = batch * per_sequence - latent  # naive's per-head keys and values; 0 in the absorbed form
    queries = [cfg.d_model * cfg.q_lora_rank, cfg.q_lora_rank * cfg.n_heads * cfg.d_k] if cfg.q_lora_rank else []
    shared = (
        sum(queries or [cfg.d_model * cfg.n_heads * cfg.d_k])
        + cfg.d_model * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        + cfg.n_heads * cfg.d_v * cfg.d_model
    )  # the query projection(s), W_kva and W_O: both forms read them
    return {
        "latent_cache_bytes": latent,
        "expanded_kv_bytes": expanded,
        "kv_read_bytes": latent + expanded,
        "weight_bytes": shared * itemsize + own_weights,
        "cache_bytes_per_token": per_token["latent"],
        "expanded_bytes_per_token": per_token["expanded"],
        "plain_bytes_per_token": 2 * cell["kv_heads"] * cell["d_k"] * itemsize,
    }


def absorbed_over_naive(cells: list[dict]) -> None:
    """Each measured absorbed cell's step over the same backend's naive step at the same context, batch, step,
    device, dtype and latent sizes (``absorbed_over_naive``), where the run timed both."""
    from mha_rosetta.backends._mla import ABSORBED, NAIVE

    same = ("backend", "device", "dtype", "batch", "context", "step", "d_model", "heads")

    def key(cell: dict) -> tuple:
        return (*(cell.get(name) for name in same), tuple(sorted((cell.get("mla") or {}).items())))

    naive = {key(cell): cell for cell in cells if cell.get("strategy") == NAIVE and cell.get("mla")}
    for cell in cells:
        reference = naive.get(key(cell))
        if cell.get("strategy") != ABSORBED or not cell.get("mla") or reference is None:
            continue
        if (
            cell.get("status") == "ok"
            and reference.get("status") == "ok"
            and cell.get("step_s")
            and reference.get("step_s")
        ):
            cell["absorbed_over_naive"] = cell["step_s"] / reference["step_s"]


def mla_lines(cells: list[dict]) -> list[str]:
    """The MLA row's paragraph: each cell's cache bytes a token against plain attention's, and absorbed over naive."""
    shown = [cell for cell in cells if cell.get("mla") and cell.get("cache_bytes_per_token")]
    if not shown:
        return []
    first = shown[0]
    lines = [
        "",
        f"MLA ({', '.join(f'{name} {size}' for name, size in first['mla'].items())}): both forms cache the latent, {first['cache_bytes_per_token']} bytes a token "
        f"(kv_lora_rank + d_rope), against {first['plain_bytes_per_token']} for the plain layer's K and V (2 Hkv d_k) "
        f"and {first['expanded_bytes_per_token']} for MLA's per-head keys and values (H (d_k + d_v)); the naive form "
        "also expands the cache through W_UK and W_UV every step and reads what it made (in the KV limit's bytes)",
    ]
    ratios = [cell for cell in shown if cell.get("absorbed_over_naive") is not None]
    if ratios:
        lines.append(
            "Absorbed over naive (the same step with W_UK and W_UV folded in, over the expanding form): "
            + ", ".join(f"`{c['backend']}` {c['context']}: {c['absorbed_over_naive']:.2f}x" for c in ratios)
        )
    return lines
