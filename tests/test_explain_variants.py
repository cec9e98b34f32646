"""The explainer's "Variants" section: driven by `core.VARIANTS`, every number computed, the stage measured.

The expected values are hand-computed (ALiBi's 6-head slopes, YaRN's factor, T5's buckets of small
distances, the keys a window lets through) or read from `core`; the docs page's section must be the
one the command generates.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mha_rosetta.cli.main import main
from mha_rosetta.core import VARIANTS
from mha_rosetta.explain import explain
from mha_rosetta.explain import variants as explainer_variants
from mha_rosetta.explain.variants import SWITCH_ON, pipeline, variant_entries, variant_tables

ROOT = Path(__file__).resolve().parents[1]


def _entries():
    return {entry.variant: entry for entry in variant_entries()}


def _text(entry) -> str:
    return " ".join([entry.formula, entry.place, entry.stages, *(s for _, s in entry.spellings), *entry.pitfalls])


def test_one_entry_per_variant_in_core_order():
    assert [entry.variant for entry in variant_entries()] == list(VARIANTS)
    assert set(SWITCH_ON) == set(VARIANTS)  # each has its demonstration


def test_a_new_variant_without_an_entry_is_an_error(monkeypatch):
    monkeypatch.setattr(explainer_variants, "VARIANTS", (*VARIANTS, "latent_kv"))
    with pytest.raises(KeyError, match=r"core\.VARIANTS has latent_kv without an explainer entry"):
        variant_entries()


def test_the_stage_each_variant_changes_is_measured():
    stages = {name: entry.stages for name, entry in _entries().items()}
    assert stages == {
        "window": "first changed: masked_scores",
        "softcap": "adds capped_scores; first changed: capped_scores",
        "qk_norm_head": "adds q_normed, k_normed; first changed: q_normed",
        "qk_norm_projection": "adds q_normed, k_normed; first changed: q_normed",
        "qkv_bias": "first changed: output",
        "alibi": "adds biased_scores; first changed: biased_scores",
        "rel_bias": "adds biased_scores; first changed: biased_scores",
        "sinks": "first changed: weights",
        "rope_scaling": "first changed: q_rotated",
        "chunked": "first changed: masked_scores",
        "gate": "adds gate; first changed: gate",
        "qk_norm_after_rope": "adds q_rotated_normed, k_rotated_normed; first changed: q_rotated_normed",
        "temperature": "adds q_tempered; first changed: q_tempered",
        "mla": "adds kv_latent, k_rope; first changed: kv_latent",
        "mla_q_lora": "adds q_latent; first changed: q_latent",
        "k_eq_v": "first changed: v",
        "value_norm": "adds v_normed; first changed: v_normed",
    }
    stages = pipeline().split(" -> ")
    rotated = ["q_rotated", "k_rotated", "q_rotated_normed", "k_rotated_normed", "q_tempered"]
    assert stages[9:17] == [*rotated, "scores", "capped_scores", "biased_scores"]
    assert stages[17:19] == ["masked_scores", "weights"]


def test_the_numbers_are_computed():
    entries = _entries()
    alibi = _text(entries["alibi"])
    # BLOOM, 6 heads: 2**-2, 2**-4, 2**-6, 2**-8, then 2**-1, 2**-3; the power-of-two formula 2**(-8k/6).
    assert "the slopes are 0.25, 0.0625, 0.01562, 0.003906, 0.5, 0.125" in alibi
    assert f"2**(-8k/6) gives {2 ** (-8 / 6):.4g}, {2 ** (-16 / 6):.4g}, 0.0625" in alibi
    assert "with d_k = 4 its slopes are 0.125, 0.03125" in alibi  # divided by sqrt(4)
    assert "the weights by " in alibi and "biased_scores differ by up to " in alibi
    window = _text(entries["window"])
    assert "same mask over 6 tokens: yes (keys per query [1, 2, 3, 3, 3, 3])" in window
    assert "lets 4 through (keys per query [1, 2, 3, 4, 4, 4])" in window
    rel = _text(entries["rel_bias"])
    # T5, 32 buckets, 128: bidirectional halves of 16; a key d ahead is 16 + d, d behind is d (exact below 8).
    assert "encoder buckets [6, 5, 4, 3, 2, 1, 0, 17, 18, 19, 20, 21, 22], decoder [6, 5, 4, 3, 2, 1, 0, 0" in rel
    assert "d = 16: 2.0 in float32, 2.0 in float64; d = 32: 4.0" in rel  # log(2)/log(16)*8 = 2 exactly
    rope = _text(entries["rope_scaling"])
    yarn = 0.1 * math.log(32) + 1
    assert f"multiplies cos and sin by {yarn:.4g}, so the rotated part of each score by {yarn**2:.3g}" in rope
    assert f"{yarn:.4g}" == "1.347"
    assert "divides each pair's frequency by 1, 1, 2.69, 8" in rope
    softcap = _text(entries["softcap"])
    assert f"scores 10, 50, 100 become {50 * math.tanh(0.2):.4g}, {50 * math.tanh(1):.4g}" in softcap
    assert "a blocked score becomes c*tanh(-inf) = -2 instead of -inf" in softcap


def test_each_librarys_spelling_is_named():
    text = " ".join(_text(entry) for entry in variant_entries())
    for name in (
        "sliding_window = 3",
        "window_size=(2, 0)",
        "local_window_size=(2, 0)",
        "mask_mod",
        "score_mod",
        "attn_logit_softcapping",
        "query_pre_attn_scalar",
        "softcap=c",
        "q_norm",
        "k_norm",
        "attention_bias",
        "BLOOM",
        "sinks (n_heads,)",
        "relative_attention_num_buckets",
        "'rope_type': 'yarn'",
    ):
        assert name in text, name


def test_the_section_renders_everywhere(capsys):
    result = explain(sections=("variants",))
    assert [entry.variant for entry in result.variants] == list(VARIANTS)
    assert result.to_dict()["variants"][0]["variant"] == "window"
    markdown = result.to_markdown()
    assert "## Variants" in markdown and f"`{pipeline()}`" in markdown
    assert all(f"### {title}" in markdown for title, _, _ in variant_tables(result.variants))
    text = result.to_text()
    assert pipeline() in text
    assert main(["explain", "--sections", "variants", "--plain"]) == 0
    assert "Known off-by-ones and differences (computed)" in capsys.readouterr().out


def test_variants_is_a_default_section():
    from mha_rosetta.explain.explainer import DEFAULT_SECTIONS

    assert "variants" in DEFAULT_SECTIONS


def test_the_docs_section_is_the_generated_one(capsys):
    assert main(["explain", "--sections", "variants", "--markdown", "-"]) == 0
    generated = capsys.readouterr().out
    section = generated[generated.index("## Variants") :].rstrip()
    page = (ROOT / "docs" / "explainer.md").read_text(encoding="utf-8")
    assert section in page
