"""explain --ragged: the spellings side by side, each converted back exactly, and the block table drawn."""

import json

from mha_rosetta.cli.main import main
from mha_rosetta.core.paged import PagedLayout
from mha_rosetta.explain.ragged import draw_block_table, explain_ragged


def test_spellings_and_round_trips():
    result = explain_ragged((3, 0, 1, 5), page_size=2, seed=0)
    by_how = {how: (value, exact) for _, how, value, exact in result.spellings}
    assert by_how["cu_seqlens"] == ("[0, 3, 3, 4, 9]", True)
    assert all(exact for _, _, _, exact in result.spellings)
    assert "position_ids" in next(h for h in by_how if h.startswith("position_ids"))
    assert "| FlashInfer | kv_indptr, kv_indices, kv_last_page_len | `[0, 2, 2, 3, 6]," in result.to_markdown()


def test_block_table_drawing_hand_made():
    layout = PagedLayout([[4, 1], [-1, -1], [0, -1]], [3, 0, 2], page_size=2, n_pages=5)
    assert draw_block_table(layout) == [
        "row 0 (3 tokens): [0->4] [1->1]",
        "row 1 (0 tokens): (no page)",
        "row 2 (2 tokens): [0->0]",
        "pool: 0: row 2 tokens 0..1 | 1: row 0 tokens 2..2 | 2: free | 3: free | 4: row 0 tokens 0..1",
    ]


def test_cli_json(tmp_path):
    path = tmp_path / "ragged.json"
    assert main(["explain", "--ragged", "--json", str(path), "--seed", "3"]) == 0
    data = json.loads(path.read_text())
    assert data["lengths"] == [3, 0, 1, 5] and data["seed"] == 3
    assert all(s["round_trip"] for s in data["spellings"]) and len(data["block_table"]) == 5
