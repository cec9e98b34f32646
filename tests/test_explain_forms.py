"""The explainer's "Forms" section (issue 45): each form's own stages in each convention, measured on the variants'
demonstration layer (a real config: 6 tokens, 6 heads), the shapes read from the adapters' stage tensors; a
convention that refuses a form is listed with the reason."""

from __future__ import annotations

import pytest

from conftest import requires
from mha_rosetta.core import STAGE_BY_NAME, VARIANT_REGISTRY, stage_shapes
from mha_rosetta.explain import explain
from mha_rosetta.explain.forms import form_names, form_shapes, form_tables, shown_stages
from mha_rosetta.explain.variants import Demonstration

CONVENTIONS = [
    pytest.param("numpy", id="numpy"),
    pytest.param("torch", id="torch", marks=requires("torch")),
    pytest.param("jax", id="jax", marks=requires("jax")),
    pytest.param("einops-numpy", id="einops-numpy", marks=requires("einops")),
]


def test_the_forms_are_read_from_the_registry():
    names = form_names()
    # The forms: MLA (and its query LoRA), the chunked mask, the temperature, the gate, the value norm.
    assert {"mla", "mla_q_lora", "chunked", "temperature", "gate", "value_norm"} <= set(names)
    assert not {"softcap", "alibi", "rel_bias", "sinks"} & set(names)  # score-shaped or no stage: the stage table's
    assert shown_stages("mla") == ("kv_latent", "k_rope") and shown_stages("gate") == ("gate",)
    assert shown_stages("chunked") == ("masked_scores",)  # no stage of its own: the first it changes, measured


@pytest.mark.parametrize("name", CONVENTIONS)
@pytest.mark.parametrize("form", form_names())
def test_every_shape_is_the_canonical_one_in_the_conventions_own_axis_order(name, form):
    shapes = form_shapes(form, [name])
    cfg = Demonstration.run(form)[0]
    canonical = stage_shapes(cfg, 1, Demonstration.tokens, Demonstration.tokens)  # B 1, 6 tokens
    strategies = VARIANT_REGISTRY[form].strategies or (None,)
    assert not shapes.refused, shapes.refused
    assert len(shapes.rows) == len(strategies) * len(shapes.stages)
    for row in shapes.rows:
        symbols = STAGE_BY_NAME[row.stage].shape
        assert sorted(row.axes) == sorted(symbols), row
        assert row.shape == tuple(canonical[row.stage][symbols.index(symbol)] for symbol in row.axes), row
        assert row.note


def _rows(form: str, name: str) -> dict:
    return {(row.strategy, row.stage): row for row in form_shapes(form, [name]).rows}


def test_mla_in_numpy_keeps_the_latent_and_the_shared_key_as_columns():
    rows = _rows("mla", "numpy")
    for strategy in ("naive", "absorbed"):  # latent 8, rope 2, 6 tokens (explain.variants.DEMO with MLA's demo_on)
        assert rows[strategy, "kv_latent"].axes == ("B", "kv_lora_rank", "Nk")
        assert rows[strategy, "kv_latent"].shape == (1, 8, 6)
        assert rows[strategy, "k_rope"].shape == (1, 2, 6)


@requires("torch")
def test_mla_in_torch_keeps_them_as_rows_and_says_how_the_shared_key_is_broadcast():
    rows = _rows("mla", "torch")
    latent = rows["naive", "kv_latent"]
    assert latent.axes == ("B", "Nk", "kv_lora_rank") and latent.shape == (1, 6, 8)
    assert "unsqueeze(1)" in rows["absorbed", "k_rope"].note


@requires("jax")
def test_mla_in_jax_reads_the_shared_key_unmapped_in_the_head_vmap():
    rows = _rows("mla", "jax")
    assert rows["naive", "k_rope"].shape == (1, 6, 2)
    assert "in_axes=None" in rows["naive", "k_rope"].note


@requires("einops")
def test_mla_in_einops_names_its_axes():
    rows = _rows("mla", "einops-numpy")
    assert "'b s e', no head axis" in rows["absorbed", "k_rope"].note
    assert "'b s l'" in rows["naive", "kv_latent"].note


def test_an_implementation_without_the_forms_strategies_is_listed_with_the_reason():
    shapes = form_shapes("mla", ["numpy-best"])
    assert shapes.rows == []
    assert "none of the strategies that run mla (naive, absorbed)" in shapes.refused["numpy-best"]


def test_the_section_renders_each_conventions_shapes_for_each_form(capsys):
    from mha_rosetta.cli.main import main

    result = explain(sections=("forms",), backends=["numpy"])
    assert [shapes.form for shapes in result.forms] == form_names()
    text, markdown = result.to_text(), result.to_markdown()
    assert "## Forms in each convention" in markdown
    for title, _, rows in form_tables(result.forms):
        assert f"### {title}" in markdown
        for row in rows:  # e.g. "numpy (naive)", "kv_latent", "B 1 x kv_lora_rank 8 x Nk 6"
            assert f"| {row[0]} | {row[1]} | {row[2]} |" in markdown
    assert "B 1 x kv_lora_rank 8 x Nk 6" in text
    assert result.to_dict()["forms"][0]["form"] == form_names()[0]
    assert main(["explain", "--sections", "forms", "--backends", "numpy", "--plain"]) == 0
    assert "B 1 x kv_lora_rank 8 x Nk 6" in capsys.readouterr().out
