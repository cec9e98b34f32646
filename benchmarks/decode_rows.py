"""``bench --mode decode``'s rows: the cells a sweep's settings expand to (`expand_decode_cells`), row by row.

The main row (every context), the windowed row, the paged row, and the ragged row (issue 47): at each ragged
context, the rectangular batch of ``len(ragged_rows)`` rows and the ragged batch holding the same tokens
(`decode.ragged_lengths`), each through the contiguous and the paged cache; and the MLA row (issue 45,
`decode_mla`): each MLA-decoding backend's naive and absorbed forms at each MLA context.
"""

from __future__ import annotations

from .decode import RAGGED_ROW, DecodeCellSpec, layer_of, ragged_lengths
from .decode_mla import MLA_ROW, mla_implementations
from .decode_settings import DecodeSettings


def expand_decode_cells(settings: DecodeSettings, implementations: list[str]) -> list[DecodeCellSpec]:
    """Every (device, implementation, context) cell, then the windowed row's cells, then the paged row's, then the
    ragged row's: at each ragged context, the rectangular batch and the ragged one, contiguous and paged (the
    rows after the first take no prefill: the contiguous cell's is not timed again); then the MLA row's (the
    latent cache, its prefill up to ``prefill_max``), each backend's naive and absorbed forms at each MLA context."""
    from mha_rosetta.backends._paged import PAGED

    main = {"batch": settings.batch, "lengths": None, "row": None}
    rows = [(None, context, None, main) for context in settings.contexts]
    if settings.window is not None:
        rows += [(settings.window, context, None, main) for context in settings.window_contexts]
    rows += [(None, context, PAGED, main) for context in settings.paged_contexts]
    batch = len(settings.ragged_rows)
    timed = {None: settings.contexts, PAGED: settings.paged_contexts}  # the main rows' contexts, by cache kind
    for context in settings.ragged_contexts:
        lengths = ragged_lengths(context, settings.ragged_rows)
        for cache in (None, PAGED):
            if batch != settings.batch or context not in timed[cache]:  # else the main row's cell is the reference
                rows.append((None, context, cache, {"batch": batch, "lengths": None, "row": RAGGED_ROW}))
            rows.append((None, context, cache, {"batch": batch, "lengths": lengths, "row": RAGGED_ROW}))

    def cell(label: str, device: str, context: int, prefill: bool, **row) -> DecodeCellSpec:
        """A cell of ``row`` (its layer, cache, ...): the sweep's run settings, each cell its own policy dicts."""
        return DecodeCellSpec(
            implementation=label, context=context, **row, dtype=settings.dtype, device=device,
            threads=settings.threads, cpus=settings.cpus, policy=dict(settings.policy), prefill=prefill,
            prefill_policy=dict(settings.prefill_policy), malloc=settings.malloc, plugins=list(settings.plugins),
        )  # fmt: skip

    cells = [
        cell(
            label,
            device,
            context,
            cache is None and shape is main and context <= settings.prefill_max,
            **{**layer_of(settings), **shape},
            window=window,
            cache=cache,
        )
        for device in settings.devices
        for label in implementations
        for window, context, cache, shape in rows
    ]
    mla_layer = {**layer_of(settings), "batch": settings.batch}
    return cells + [
        cell(
            label,
            device,
            context,
            context <= settings.prefill_max,
            **mla_layer,
            row=MLA_ROW,
            mla=dict(settings.mla or {}),
        )
        for device in settings.devices
        for label in mla_implementations(implementations)
        for context in settings.mla_contexts
    ]
