"""``bench --preset variants``: the variant cells, their configurations and the cost table (no timing here)."""

from __future__ import annotations

import pytest

from mha_rosetta.benchmarks.cell import CellSpec, build_config, cell_key
from mha_rosetta.benchmarks.presets import PRESETS
from mha_rosetta.benchmarks.sweep import SweepSettings, expand_cells, preset_settings
from mha_rosetta.benchmarks.variants import BENCH_VARIANTS, PLAIN, preset_cells, variant_rows
from mha_rosetta.core import VARIANTS


def test_every_spec_variant_is_benchmarked_and_every_baseline_exists():
    cfgs = {name: build_config(CellSpec("numpy", tokens=512, variant=name)) for name in BENCH_VARIANTS}
    assert set().union(*(cfg.variants for cfg in cfgs.values())) == set(VARIANTS)
    for name, (_, baseline) in BENCH_VARIANTS.items():
        assert baseline is None or baseline in BENCH_VARIANTS, name
    # The two presets time all of them: the variants of 2024, and the forms of 2025-26 (issue 45).
    assert PRESETS["variants"]["variants"] == preset_cells("variants")
    assert PRESETS["forms"]["variants"] == preset_cells("forms")
    assert set(preset_cells("variants")) | set(preset_cells("forms")) == set(BENCH_VARIANTS)
    assert preset_cells("forms")[:3] == [PLAIN, "causal", "chunked"]  # Llama 4's chunks against causal
    assert "chunked" not in preset_cells("variants")


def test_a_variant_cell_builds_its_configuration():
    assert build_config(CellSpec("numpy", tokens=512, variant="window")).window == 128  # a quarter of the tokens
    assert build_config(CellSpec("numpy", tokens=512, variant="window")).causal is True
    assert build_config(CellSpec("numpy", variant="softcap")).softcap == 50.0
    assert build_config(CellSpec("numpy", variant="rope_yarn")).rope_scaling["rope_type"] == "yarn"
    assert build_config(CellSpec("numpy")).variants == ()


def test_a_plain_cell_keeps_the_key_it_had_before_the_variants():
    plain, softcap = CellSpec("numpy"), CellSpec("numpy", variant="softcap")
    assert "variant" not in plain.identity() and softcap.identity()["variant"] == "softcap"
    assert cell_key({**plain.identity()}) == plain.key()
    assert cell_key({**softcap.identity()}) == softcap.key() != plain.key()


def test_bad_variant_names_are_named():
    with pytest.raises(ValueError, match="variant must be one of plain, causal, window"):
        CellSpec("numpy", variant="soft-cap")
    with pytest.raises(ValueError, match="variant must be one of"):
        SweepSettings(variants=["sink"])


def test_the_sweep_crosses_implementations_with_variants():
    settings = preset_settings("variants", implementations=["numpy", "torch"], variants=["plain", "alibi"])
    cells = expand_cells(settings, ["numpy", "torch"])
    assert [(c.implementation, c.variant) for c in cells] == [
        ("numpy", "plain"), ("numpy", "alibi"), ("torch", "plain"), ("torch", "alibi"),
    ]  # fmt: skip


def test_variant_rows_compute_the_cost_over_the_baseline():
    def cell(variant, seconds, status="ok"):
        return {"implementation": "numpy", "tokens": 512, "variant": variant, "status": status, "t": seconds}

    cells = [cell(PLAIN, 0.040), cell("causal", 0.044), cell("window", 0.022), cell("sinks", 0.0, "unsupported")]
    cells[-1]["error"] = "numpy does not implement sinks"
    rows = variant_rows(cells, lambda c: c["t"])
    assert rows[0][1:4] == ["plain", "512", "40.00"]
    assert rows[1][3:7] == ["44.00", "plain 40.00", "+4.00", "+10%"]
    assert rows[2][3:7] == ["22.00", "causal 44.00", "-22.00", "-50%"]  # the window against causal
    assert rows[3][7] == "numpy does not implement sinks"


def test_the_variants_option_example_is_plain_and_the_first_variant_timed_against_it():
    """``bench --help``'s example of ``--variants`` comes from the bench table (the registry's cells), and parses."""
    import argparse

    from mha_rosetta.cli.bench import _variant_list, _variants_example, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    example = _variants_example()
    assert example == "plain,softcap"  # the first registry cell whose baseline is plain (window's is causal)
    assert _variant_list(example) == ["plain", "softcap"]
    assert f"e.g. {example}" in " ".join(parser.format_help().split())
