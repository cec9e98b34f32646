"""The explainer's "Real checkpoints" section and the packing picture."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mha_rosetta.explain import explain
from mha_rosetta.explain.real_checkpoints import (
    FALCON_PACKINGS,
    FALCON_TENSOR,
    PACKING_EXAMPLES,
    checkpoint,
    family_config,
    numbered_params,
    packing_rows,
    save_packing_png,
    stored_tensor,
)
from mha_rosetta.models import LAYOUTS


def _segments(layout: str, tensor: str):
    c = checkpoint(layout, real_modules=False)
    found = {t.name: t for t in c.tensors}[tensor]
    return found.axis, list(found.segments)


def test_per_head_packing_read_back_from_the_converter():
    axis, segments = _segments("hf-gpt-neox", "query_key_value.weight")  # d_model 16, 4 heads of 4
    assert axis == 0
    assert segments[:4] == [(0, 4, "q head 0"), (4, 8, "k head 0"), (8, 12, "v head 0"), (12, 16, "q head 1")]
    assert len(segments) == 12


def test_per_group_packing_read_back_from_the_converter():
    axis, segments = _segments("megatron", "linear_qkv.weight")  # 4 query heads, 2 kv groups
    assert axis == 0
    assert segments == [
        (0, 4, "q head 0"), (4, 8, "q head 1"), (8, 12, "k kv head 0"), (12, 16, "v kv head 0"),
        (16, 20, "q head 2"), (20, 24, "q head 3"), (24, 28, "k kv head 1"), (28, 32, "v kv head 1"),
    ]  # fmt: skip


def test_conv1d_and_keras_kernels_keep_heads_on_other_axes():
    axis, segments = _segments("hf-gpt2", "c_attn.weight")  # (in, out): heads along the columns
    assert axis == 1 and segments[4] == (16, 20, "k head 0")
    axis, segments = _segments("keras", "query/kernel")  # (in, H, d): heads on their own axis
    assert axis == 1 and segments == [(h, h + 1, f"q head {h}") for h in range(4)]
    axis, segments = _segments("hf-bert", "output.dense.weight")  # (out, H*d): columns read the heads
    assert axis == 1 and segments[1] == (4, 8, "reads head 1")


def test_numbered_params_survive_every_layout_exactly():
    for name in LAYOUTS:
        cfg = family_config(name)
        numbered = numbered_params(cfg)
        state = LAYOUTS[name].to_state_dict(cfg, numbered)
        back = LAYOUTS[name].from_state_dict(cfg, state)
        assert all(np.array_equal(getattr(back, k), v) for k, v in numbered.as_dict().items() if v is not None), name
        for tensor_name, array in state.items():
            assert stored_tensor(cfg, tensor_name, array).segments, tensor_name


def test_packing_rows_of_the_three_examples():
    owners = {packing: packing_rows(layout, tensor)[1] for packing, layout, tensor, _ in PACKING_EXAMPLES}
    assert list(owners["blocks"][[0, 16, 32]]) == ["q head 0", "k head 0", "v head 0"]
    assert list(owners["per head"][[0, 4, 8, 12]]) == ["q head 0", "k head 0", "v head 0", "q head 1"]
    assert list(owners["per group"][[4, 8, 12, 16]]) == ["q head 1", "k kv head 0", "v kv head 0", "q head 2"]


def test_falcons_three_packings_in_the_picture_come_from_its_converter():
    """G = 2, 1 and 4 kv heads: per group, one group (multi_query) and per head, as `falcon_packings_table` says."""
    owners = {G: packing_rows("hf-falcon", FALCON_TENSOR, G)[1] for _, G, _ in FALCON_PACKINGS}
    assert [len(owners[G]) for G in (2, 1, 4)] == [32, 24, 48]
    assert list(owners[2][[4, 8, 12, 16]]) == ["q head 1", "k kv head 0", "v kv head 0", "q head 2"]
    assert list(owners[1][[12, 16, 20]]) == ["q head 3", "k kv head 0", "v kv head 0"]
    assert list(owners[4][[0, 4, 8, 12]]) == ["q head 0", "k head 0", "v head 0", "q head 1"]


def test_packing_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed: pip install 'mha-rosetta[bench]'")
    path = save_packing_png(tmp_path / "packings.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_section_runs_every_real_module_it_can_and_names_the_rest():
    result = explain(sections=("checkpoints",))
    assert [c.layout for c in result.checkpoints] == list(LAYOUTS)
    for c in result.checkpoints:
        assert c.verified is not False, c.real
        if c.verified is None:
            assert c.real.startswith("skipped: ") and ("pip install" in c.real or "failed to import" in c.real)
        else:
            assert c.real.split(":")[0] in ("real", "equivalent", "reimplementation") and "agrees" in c.real
    markdown = result.to_markdown(png_name="head_split.png")
    assert "## Real checkpoints" in markdown and "![three packings of q, k, v](packings.png)" in markdown
    assert "| query_key_value.weight | (48, 16) | axis 0: 0:4 q head 0 \\| 4:8 k head 0" in markdown
    assert "Real checkpoints: the families at a glance" in result.to_text()
    assert result.to_dict()["checkpoints"][0]["tensors"][0]["name"] == "c_attn.weight"


DOCS = Path(__file__).resolve().parents[1] / "docs" / "checkpoints.md"


def test_falcons_three_packings_are_the_converters_in_the_explainer_and_on_the_docs_page():
    """Falcon's packings as the explainer draws them from `hf-falcon`'s converter, and the docs page's table."""
    from mha_rosetta.explain.real_checkpoints import falcon_packings_table

    title, headers, rows = falcon_packings_table()
    assert "d_model 16, 4 heads of 4" in title and headers[:2] == ["FalconConfig", "G"]
    assert [row[:3] for row in rows] == [
        ["new_decoder_architecture=True", "2", "(32, 16)"],
        ["multi_query=True", "1", "(24, 16)"],
        ["neither (per head)", "4", "(48, 16)"],
    ]
    assert rows[0][3] == (
        "axis 0: 0:4 q head 0 | 4:8 q head 1 | 8:12 k kv head 0 | 12:16 v kv head 0 | "
        "16:20 q head 2 | 20:24 q head 3 | 24:28 k kv head 1 | 28:32 v kv head 1"
    )  # hand-checked: view(B, N, G, H/G + 2, d) puts each group's 2 query heads before its k and v
    page = DOCS.read_text(encoding="utf-8")
    for _, groups, shape, owners in rows:
        line = next(line for line in page.splitlines() if line.startswith("| ") and f"`{shape}`" in line)
        assert f"| {groups} |" in line or f"| H = {groups} |" in line, line
        assert "`" + owners.removeprefix("axis 0: ").replace("|", "\\|") + "`" in line, line


def test_the_from_module_example_on_the_docs_page_prints_what_it_says():
    pytest.importorskip("transformers", reason="the example builds a transformers LlamaAttention")
    page = DOCS.read_text(encoding="utf-8")
    example = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "from_module" in block)
    expected = re.search(r"^# (d_model=.*)$", example, re.M).group(1)
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_the_variants_parameters_are_read_back_from_the_converters_and_match_the_docs_page():
    from mha_rosetta.explain.real_checkpoints import variant_parameters_table

    title, headers, rows = variant_parameters_table()
    assert "d_model 16, 4 heads of 4, 2 kv heads" in title and headers[:3] == ["layout", "stored tensor", "shape"]
    found = {(row[0], row[1]): row for row in rows}
    assert found["hf-qwen2", "o_proj.bias"][2:5] == ["absent", "b_o", "none (bias='qkv')"]
    assert found["hf-qwen3", "q_norm.weight"][2] == "(4,)" and "every head" in found["hf-qwen3", "q_norm.weight"][5]
    olmo = found["hf-olmo2", "k_norm.weight"]  # (G*d,): each kv head's 4 rows
    assert olmo[2] == "(8,)" and olmo[5] == "axis 0: 0:4 k norm kv head 0 | 4:8 k norm kv head 1"
    assert found["hf-gemma3", "q_norm.weight"][4] == "canonical - 1 (used as 1 + w)"
    assert found["hf-qwen3", "q_norm.weight"][4] == "canonical"
    assert found["hf-gpt-oss", "sinks"][5].startswith("axis 0: 0:1 sink head 0 | 1:2 sink head 1")
    assert found["hf-t5", "relative_attention_bias.weight"][2] == "(8, 4)"
    assert found["hf-t5", "relative_attention_bias.weight"][5].startswith("axis 1: 0:1 rel head 0")  # column = head
    page = DOCS.read_text(encoding="utf-8")
    for (layout, tensor), row in found.items():
        if tensor.endswith(".bias") and row[2] != "absent":
            continue  # the biases are in the per-family tables
        cells = [line.split(" | ") for line in page.splitlines() if line.startswith(f"| `{layout}` | ")]
        line = " | ".join(next(c for c in cells if len(c) == 5 and f"`{tensor}`" in c[1]))  # the variants table
        assert f"`{row[2]}`" in line or row[2] in line, line
        assert row[4].split(" (")[0] in line, line
