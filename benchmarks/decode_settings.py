"""What ``bench --mode decode`` runs: `DecodeSettings`, a `presets.DECODE_PRESETS` entry plus overrides.

Its own module so that the sweep (`decode_sweep`) and the rows it expands to (`decode_rows`) both import it
plainly, neither from the other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .decode import DecodeLayer, ragged_lengths
from .decode_mla import check_mla_layer
from .pinning import DEFAULT_MALLOC_MODE, malloc_env, require_positive_int

# The rows a decode sweep can leave out (``bench --mode decode --rows``), each with the settings field that lists its
# contexts: the main row (every context) always runs, since every other row is read against it. The full preset
# takes 80-90 minutes on one core (the ragged row at 32k holds 4 x 32k tokens; MLA's naive step at 32k takes 1.3 s).
OPTIONAL_ROWS = {
    "window": "window_contexts",
    "paged": "paged_contexts",
    "ragged": "ragged_contexts",
    "mla": "mla_contexts",
}
DECODE_ROWS = ("main", *OPTIONAL_ROWS)


def rows_left_out(rows: list[str] | None) -> dict[str, list]:
    """The overrides that drop each optional row not in ``rows`` (its contexts emptied); none when ``rows`` is None."""
    if rows is None:
        return {}
    unknown = [row for row in rows if row not in DECODE_ROWS]
    if unknown or "main" not in rows:
        raise ValueError(f"--rows takes names among {', '.join(DECODE_ROWS)}, main among them; got {','.join(rows)}")
    return {field_name: [] for row, field_name in OPTIONAL_ROWS.items() if row not in rows}


@dataclass
class DecodeSettings(DecodeLayer):
    """What ``bench --mode decode`` runs (a `presets.DECODE_PRESETS` entry plus overrides): the layer
    (`decode.DecodeLayer`) and the rest."""

    preset: str = "decode"
    implementations: list[str] = field(default_factory=lambda: ["main"])
    contexts: list[int] = field(default_factory=lambda: [1024])
    window: int | None = None
    window_contexts: list[int] = field(default_factory=list)
    # The paged row: the default layer's step through each convention's paged cache (`DecodeStep.paging`: pages of
    # 16, vLLM's), beside its contiguous cell at the same context: ``paged_over_contiguous`` is the gather's cost.
    paged_contexts: list[int] = field(default_factory=list)
    # The ragged row (continuous batching at a fixed number of tokens): at each of ``ragged_contexts``, a batch of
    # ``len(ragged_rows)`` rows holding as many tokens as that many rows of the context, split by the shares
    # ``ragged_rows`` (`decode.ragged_lengths`), beside the rectangular batch of those rows, each through the
    # contiguous and the paged cache: ``ragged_over_rectangular`` is what the rows' different lengths cost.
    ragged_contexts: list[int] = field(default_factory=list)
    ragged_rows: list[int] = field(default_factory=lambda: [4, 2, 1, 1])
    # The MLA row (issue 45, `decode_mla`): DeepSeek's latent attention with ``heads`` heads of the latent sizes
    # ``mla``, its naive and absorbed forms at ``mla_contexts``: ``absorbed_over_naive`` per context.
    mla: dict | None = None
    mla_contexts: list[int] = field(default_factory=list)
    dtype: str = "float32"
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    threads: int = 1
    cpus: list[int] | None = None
    policy: dict = field(default_factory=dict)
    prefill_max: int = 4096
    prefill_policy: dict = field(default_factory=dict)
    bandwidth_policy: dict = field(default_factory=dict)
    array_mb: float | None = None
    rounds: int = 1
    seed: int | None = None
    malloc: str = DEFAULT_MALLOC_MODE
    cell_timeout: float = 900.0
    plugins: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("batch", "step", "d_model", "heads", "kv_heads", "d_k", "threads", "rounds"):
            require_positive_int(f"decode {name}", getattr(self, name))
        for context in [*self.contexts, *self.window_contexts, *self.paged_contexts, *self.ragged_contexts,
                        *self.mla_contexts]:  # fmt: skip
            require_positive_int("decode context", context)
        if self.ragged_contexts:
            ragged_lengths(self.ragged_contexts[0], self.ragged_rows)  # bad shares refused before a cell runs
        check_mla_layer(self.mla)
        if self.mla_contexts and self.mla is None:
            raise ValueError(f"mla_contexts needs the MLA layer's sizes (mla), got mla=None and {self.mla_contexts}")
        if not self.contexts:
            raise ValueError("contexts must name at least one context length, got []")
        malloc_env(self.malloc)

    def as_dict(self) -> dict:
        return asdict(self)
