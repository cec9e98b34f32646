"""The benchmark plots stay readable with 20 or more lines: distinct (colour, marker) pairs, and a
relative-to-fastest panel whose values are each time over the fastest at the same size."""

from __future__ import annotations

import pytest

from conftest import requires
from mha_rosetta.benchmarks.plots import MARKERS, line_style, relative_to_fastest


@pytest.mark.parametrize("lines", [20, 23, 40, 200])
def test_every_line_gets_its_own_colour_and_marker(lines):
    pairs = [line_style(index)[:2] for index in range(lines)]
    assert len(set(pairs)) == lines
    assert all(0 <= colour < 20 and marker in MARKERS for colour, marker in pairs)


def test_the_first_twenty_lines_use_all_twenty_colours():
    assert sorted(line_style(index)[0] for index in range(20)) == list(range(20))
    assert [line_style(index)[0] for index in range(3)] == [0, 2, 4]  # dark shades first: neighbours differ in hue
    assert line_style(20)[:2] == (0, MARKERS[1])  # line 0's colour, the next marker


def test_relative_to_fastest_by_hand():
    series = {"a": {64: 2.0, 128: 8.0}, "b": {64: 1.0, 128: 10.0}, "c": {128: 4.0}}
    assert relative_to_fastest(series) == {"a": {64: 2.0, 128: 2.0}, "b": {64: 1.0, 128: 2.5}, "c": {128: 1.0}}


@requires("matplotlib")
def test_a_plot_of_22_implementations_draws_22_distinct_lines(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mha_rosetta.benchmarks import plots

    cells = [
        {"implementation": f"impl{index:02d}", "strategy": None, "status": "ok", "device": "cpu", "dtype": "float32",
         "batch": 1, "d_model": 16, "heads": 2, "threads": 1, "tokens": tokens, "median_s": (index + 1) * tokens * 1e-6}
        for index in range(22) for tokens in (64, 128)
    ]  # fmt: skip
    drawn = []
    original = plots.save_figure

    def keep(plt_, figure, path):
        # Per panel, the data lines: error-bar caps are lines too, with the marker "_".
        drawn.append(
            [
                [(line.get_color(), line.get_marker()) for line in axes.get_lines() if line.get_marker() in MARKERS]
                for axes in figure.axes
            ]
        )
        return original(plt_, figure, path)

    plots.save_figure = keep
    try:
        written = plots.plot_report({"cells": cells}, tmp_path)
    finally:
        plots.save_figure = original
    assert written[0].name == "time_vs_tokens_cpu_float32_B1_D16_H2_T1.png" and written[0].stat().st_size > 10_000
    time_panel, ratio_panel = drawn[0]
    assert len(time_panel) == len(set(time_panel)) == 22
    assert ratio_panel == time_panel  # the same style for the same line in both panels
    plt.close("all")
