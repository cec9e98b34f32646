"""``explain --ragged``: one small ragged batch in every ecosystem's spelling, side by side, and its block table drawn.

Every spelling is converted from the one canonical `RaggedBatch` (and `PagedLayout`), and converted
back: the "round trip" column is computed, not asserted. The block table is drawn as each row's
logical pages and the physical pages the seeded shuffle gave them, then the pool page by page.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mha_rosetta.core.paged import PAD, PagedLayout, pages_needed
from mha_rosetta.core.ragged import RaggedBatch

DEMO_LENGTHS = (3, 0, 1, 5)  # a zero-length and a one-token document among them
DEMO_PAGE_SIZE = 2


@dataclass(frozen=True)
class RaggedExplanation:
    lengths: tuple[int, ...]
    page_size: int
    seed: int
    spellings: list[tuple[str, str, str, bool]]  # (who, how, value, round trip exact)
    table: list[str]  # the block table drawn, one line each

    def to_dict(self) -> dict:
        return {
            "lengths": list(self.lengths),
            "page_size": self.page_size,
            "seed": self.seed,
            "spellings": [dict(who=w, how=h, value=v, round_trip=r) for w, h, v, r in self.spellings],
            "block_table": self.table,
        }

    def to_markdown(self) -> str:
        lines = [
            f"## One ragged batch, every spelling: documents of lengths {list(self.lengths)}",
            "",
            "| who | spelling | value | converted back exactly |",
            "|---|---|---|---|",
        ]
        lines += [f"| {w} | {h} | `{v}` | {'yes' if r else 'NO'} |" for w, h, v, r in self.spellings]
        lines += ["", f"### The block table (page size {self.page_size}, pages shuffled with seed {self.seed})", ""]
        return "\n".join([*lines, "```", *self.table, "```", ""])


def _flat(array) -> str:
    return np.array2string(np.asarray(array), separator=", ", max_line_width=10_000).replace("\n", "")


def draw_block_table(layout: PagedLayout) -> list[str]:
    """Each row's logical pages -> physical pages, then the pool: which row's which tokens each page holds."""
    lines, owner = [], {}
    for b, (row, length) in enumerate(zip(layout.block_table, layout.seq_lens, strict=True)):
        used = [int(p) for p in row if p != PAD]
        cells = " ".join(f"[{j}->{p}]" for j, p in enumerate(used)) or "(no page)"
        lines.append(f"row {b} ({int(length)} tokens): {cells}")
        for j, p in enumerate(used):
            first, last = j * layout.page_size, min((j + 1) * layout.page_size, int(length)) - 1
            owner[p] = f"row {b} tokens {first}..{last}"
    lines.append("pool: " + " | ".join(f"{p}: {owner.get(p, 'free')}" for p in range(layout.n_pages)))
    return lines


def explain_ragged(
    lengths=DEMO_LENGTHS, page_size: int = DEMO_PAGE_SIZE, seed: int = 0, tokens: int | None = None
) -> RaggedExplanation:
    batch = RaggedBatch(np.asarray(lengths, dtype=np.int64))
    tokens = batch.max_len + 1 if tokens is None else tokens
    nonempty = RaggedBatch(batch.lengths[batch.lengths > 0])
    layout = PagedLayout.assign(
        batch, page_size, n_pages=int(pages_needed(batch.lengths, page_size).sum()) + 1, seed=seed
    )
    fi = layout.flashinfer()
    cu, pos, mask = batch.cu_seqlens(), batch.position_ids(drop_empty=True), batch.document_mask(drop_empty=True)
    pad = batch.padding_mask(tokens)
    spellings = [
        ("FlashAttention varlen, torch varlen_attn", "cu_seqlens", _flat(cu), RaggedBatch.from_cu_seqlens(cu) == batch),
        (
            "Hugging Face packed rows",
            "position_ids (a step other than +1 starts a document; empty documents vanish)",
            _flat(pos),
            RaggedBatch.from_position_ids(pos) == nonempty,
        ),
        (
            "FlexAttention (attention-gym)",
            "document mask, row by row (empty documents vanish)",
            " ".join("".join("1" if c else "." for c in row) for row in mask),
            RaggedBatch.from_document_mask(mask) == nonempty,
        ),
        (
            "jax.nn.dot_product_attention",
            f"query_seq_lengths on a (B, N={tokens}) padded batch",
            _flat(batch.lengths),
            RaggedBatch.from_padding_mask(pad) == batch,
        ),
        (
            "vLLM",
            "block_tables (-1: no page) and seq_lens",
            f"{_flat(layout.block_table)}, {_flat(layout.seq_lens)}",
            PagedLayout(layout.block_table, layout.seq_lens, page_size, layout.n_pages) == layout,
        ),
        (
            "FlashInfer",
            "kv_indptr, kv_indices, kv_last_page_len",
            ", ".join(_flat(a) for a in fi),
            PagedLayout.from_flashinfer(*fi, page_size=page_size, n_pages=layout.n_pages) == layout,
        ),
    ]
    return RaggedExplanation(tuple(int(n) for n in batch.lengths), page_size, seed, spellings, draw_block_table(layout))
