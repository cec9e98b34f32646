"""The report's HTML page in a real headless browser (Debian's chromium, driven by selenium).

Skipped, with the reason, where chromium, its driver or selenium is missing; CI installs them
(`.ci/run`). The page is checked for what a reader meets: no console errors, heatmaps and
tables drawn with a size, a tooltip that names the pair, a filter that hides rows, and the
relative-to-fastest view. Nothing on the page may ask for the network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from mha_rosetta.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("MHA_ROSETTA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = os.environ.get("MHA_ROSETTA_CHROMEDRIVER") or shutil.which("chromedriver")


def _missing() -> str | None:
    if CHROMIUM is None:
        return "chromium is not installed (apt-get install chromium chromium-driver; .ci/run does)"
    if DRIVER is None:
        return "chromedriver is not installed (apt-get install chromium-driver; .ci/run does)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install mha-rosetta[browser])"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("page")
    check = folder / "check.json"
    argv = ["check", "--backends", "numpy", "--cases", "self_attention,causal", "--dtypes", "float64,float32"]
    assert main([*argv, "--quiet", "--json", str(check)]) == 0
    claims = folder / "claims.json"
    claims.write_text(json.dumps([{"claim": 1, "title": "one", "verdict": "confirmed", "evidence": "by hand"}]))
    target = folder / "report.html"
    bench = [str(ROOT / "docs" / "bench" / "reference.json"), str(ROOT / "docs" / "bench" / "reference-t2.json")]
    assert main(["report", str(check), *bench, str(claims), "--html", str(target)]) == 0
    return target


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1600",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def test_page_is_self_contained(page):
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", text), "the page links to the network"
    assert "@import" not in text and "<script src" not in text


def test_page_loads_and_renders(page, browser):
    from selenium.webdriver.common.by import By

    browser.get(page.as_uri())
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "ERROR", "WARNING")]
    assert errors == [], errors
    heatmaps = browser.find_elements(By.CSS_SELECTOR, "svg.heatmap")
    assert len(heatmaps) == 2  # one per dtype of the check
    for heatmap in heatmaps:
        assert heatmap.size["width"] > 100 and heatmap.size["height"] > 100
    cells = browser.find_elements(By.CSS_SELECTOR, ".hm-cell")
    assert cells and all(cell.size["width"] > 5 for cell in cells[:10])
    table = browser.find_element(By.CSS_SELECTOR, "table.bench-table")
    assert table.size["height"] > 100
    # One row per implementation timed in the two committed runs (34 since the 2026-12-05 run added the best
    # paths, MLX and ONNX Runtime; hf-attention's cell there is unsupported, so it has no row).
    timed = {
        cell["implementation"]
        for name in ("reference.json", "reference-t2.json")
        for cell in json.loads((ROOT / "docs" / "bench" / name).read_text())["cells"]
        if cell["status"] == "ok"
    }
    assert len(timed) == 34 and "torch-flex" in timed and "hf-attention" not in timed
    rows = [row.get_attribute("data-impl") for row in table.find_elements(By.CSS_SELECTOR, "tbody tr")]
    assert sorted(rows) == sorted(timed)
    plot = browser.find_element(By.CSS_SELECTOR, "svg.plot.absolute")
    assert plot.size["width"] > 300 and plot.size["height"] > 200
    assert "confirmed" in browser.find_element(By.ID, "claims").text


def test_tooltip_and_pinned_details_name_the_pair(page, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser.get(page.as_uri())
    [mistake] = [
        cell
        for cell in browser.find_elements(By.CSS_SELECTOR, "#hm-0-0 .hm-cell")
        if cell.get_attribute("data-pair") == "numpy × numpy:direct_reshape"
    ]
    tooltip = browser.find_element(By.ID, "tooltip")
    assert not tooltip.is_displayed()
    ActionChains(browser).move_to_element(mistake).perform()
    assert tooltip.is_displayed()
    shown = tooltip.text
    assert shown.startswith("numpy × numpy:direct_reshape: caught")
    assert "numpy:direct_reshape: q_heads (split heads)" in shown  # the first divergent stage
    assert "tolerance: atol 1e-10, rtol 1e-09 (float64)" in shown
    assert re.search(r"worst case: (self_attention|causal) \(max abs \S+, max rel \S+\)", shown)
    mistake.click()
    assert browser.find_element(By.ID, "pair-info").text == shown


def test_filter_hides_rows_and_relative_view_switches(page, browser):
    from selenium.webdriver.common.by import By

    browser.get(page.as_uri())
    rows = browser.find_elements(By.CSS_SELECTOR, "table.bench-table tbody tr")
    browser.find_element(By.ID, "filter").send_keys("numpy")
    shown = [row.get_attribute("data-impl") for row in rows if row.is_displayed()]
    assert shown and all("numpy" in name for name in shown)
    assert len(shown) == 6  # numpy, its three other strategies, einops-numpy, numpy-best
    relative = browser.find_element(By.CSS_SELECTOR, "svg.plot.relative")
    assert not relative.is_displayed()
    browser.find_element(By.ID, "view-relative").click()
    assert relative.is_displayed() and not browser.find_element(By.CSS_SELECTOR, "svg.plot.absolute").is_displayed()
    assert "relative to the fastest" in relative.text


@pytest.fixture(scope="module")
def decode_page(tmp_path_factory) -> Path:
    """A decode check (test_check_decode's fakes: one right, one whose rotary restarts at 0) and the decode bench."""
    from test_check_decode import ChunkReference, RotaryRestarts

    from mha_rosetta.checks import run_check
    from mha_rosetta.checks.json_report import write_decode_json

    folder = tmp_path_factory.mktemp("decode-page")
    check = folder / "decode-check.json"
    result = run_check(
        backends=[ChunkReference(), RotaryRestarts()], cases=["gqa_rotary"], dtypes=["float64"], kind="decode"
    )
    write_decode_json(result, str(check))
    target = folder / "report.html"
    assert main(["report", str(check), str(ROOT / "docs" / "bench" / "decode.json"), "--html", str(target)]) == 0
    return target


def test_the_decode_check_and_bench_render_and_the_oracle_grid_says_where_a_run_parts(decode_page, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser.get(decode_page.as_uri())
    errors = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "ERROR", "WARNING")]
    assert errors == [], errors
    [grid] = browser.find_elements(By.CSS_SELECTOR, "svg.oracle-grid")
    assert grid.size["width"] > 100 and grid.size["height"] > 100
    [wrong] = [
        cell
        for cell in grid.find_elements(By.CSS_SELECTOR, ".hm-cell")
        if cell.get_attribute("data-pair").startswith("rotary-restarts[tokens]")
    ]
    ActionChains(browser).move_to_element(wrong).perform()
    tooltip = browser.find_element(By.ID, "tooltip")
    assert tooltip.is_displayed()
    assert tooltip.text.startswith("rotary-restarts[tokens] vs the full causal forward: DISAGREE")
    assert "first divergent stage: step 1 (position 4) diverges at q_rotated" in tooltip.text
    tables = browser.find_elements(By.CSS_SELECTOR, "table.bench-table")
    # docs/bench/decode.json: 3 contexts and 3 windowed ones, one table each; 12 decoders, 8 with the window
    # (the four best paths implement none and say so).
    assert [len(table.find_elements(By.CSS_SELECTOR, "tbody tr")) for table in tables] == [12, 12, 12, 8, 8, 8]
    assert "% of KV limit" in tables[0].text
