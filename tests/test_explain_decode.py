"""The explainer's KV-cache decoding section: layouts read from the backends' decode_layouts (a fake backend class
that declares some; "no decode path" for one without), the bytes per token, where keys are cached (both consistent
places equal the forward within 1e-12, the mixed one differs by more than 0.1), and the two masks' exact values."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import python_stdout, run_cli
from mha_rosetta.backends import Backend
from mha_rosetta.core import MHAConfig
from mha_rosetta.explain.decode import (
    DEMO,
    cache_layouts,
    cache_places,
    cache_slots,
    explain_decode,
    kv_bytes_per_token,
    step_appends,
    step_masks,
)


class FakeDecoder(Backend):
    """A backend class that only declares its caches (the contract's class attributes)."""

    decode_caches = ("dynamic", "static")
    decode_layouts = {  # noqa: RUF012 (the contract's ClassVar)
        "dynamic": "(B, Hkv, T, Dk) grown with torch.cat, Hugging Face's DynamicCache layout",
        "static": "(B, T, Hkv, Dk) preallocated, written with lax.dynamic_update_slice",
    }


class FakeColumns(Backend):
    decode_caches = ("columns",)
    decode_layouts = {"columns": "(Hkv, Dk, T): keys stay columns"}  # noqa: RUF012


class NoDecoder(Backend):
    decode_unsupported = "its library has no cache"


FAKES = {"fake": FakeDecoder, "columns": FakeColumns, "none": NoDecoder, "absent": "cannot import mypkg.mine:Mine"}
GQA = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half")


def test_layouts_are_read_from_the_declared_class_attributes():
    rows = cache_layouts(GQA, "float32", FAKES)
    table = [(r.backend, r.cache, r.layout, r.appends, r.bytes_per_token) for r in rows]
    assert table == [
        ("fake", "dynamic", FakeDecoder.decode_layouts["dynamic"], "s rows of Dk: axis 2 of (B, Hkv, T, Dk)", 64),
        ("fake", "static", FakeDecoder.decode_layouts["static"], "s slots on axis 1 of (B, T, Hkv, Dk)", 64),
        ("columns", "columns", "(Hkv, Dk, T): keys stay columns", "s columns: axis 2 of (Hkv, Dk, T), the last", 64),
        ("none", "", "no decode path: its library has no cache", "-", None),
        ("absent", "", "cannot load: cannot import mypkg.mine:Mine", "-", None),
    ]


def test_a_registered_backend_without_decode_layouts_says_no_decode_path():
    rows = cache_layouts(GQA)
    by_name = {r.backend: r for r in rows}
    assert "numpy" in by_name and "torch-mha" not in by_name  # implementations only: oracles keep no cache
    for row in rows:  # each row is either a declared layout or says why there is none
        assert row.layout.startswith("no decode path") or row.cache, row


def test_the_layouts_are_read_without_importing_a_framework():
    code = (
        "import sys; from mha_rosetta.explain.decode import explain_decode; explain_decode(); "
        "print(sorted(m for m in ('torch', 'jax', 'einops', 'flax') if m in sys.modules))"
    )
    assert python_stdout(code, timeout=120) == "[]"


def test_einops_named_axes_and_a_layout_without_a_token_axis():
    assert step_appends("named axes 'b t h d', rearranged per step") == "s slots on axis 1 of (b, t, h, d)"
    assert step_appends("a list of arrays") == "s slots (the layout names no token axis)"


def test_bytes_per_token_and_the_ring_buffer_slots():
    assert kv_bytes_per_token(GQA, "float32") == 2 * (4 + 4) * 4 == 64
    assert kv_bytes_per_token(GQA, "bfloat16") == 32
    assert kv_bytes_per_token(MHAConfig(d_model=16, n_heads=4, d_v=2), "float64") == 4 * (4 + 2) * 8
    windowed = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, window=128)
    assert cache_slots(GQA, 4096) == 4096 and cache_slots(windowed, 4096) == 128 and cache_slots(windowed, 100) == 100
    assert cache_slots(windowed, 4096, step=4) == 131
    text = explain_decode(windowed, backends=FAKES).to_markdown()
    assert "at a context of 4096 tokens the cache holds 128 slots: 8 KiB (a window of 128" in text


def test_both_consistent_places_equal_the_forward_and_mixing_them_is_the_rotated_twice_error():
    places, between = cache_places()
    assert [p.place for p in places] == [
        "after rotary, read as they are (Hugging Face; the contract)",
        "before rotary, rotated on read",
        "after rotary and again on read",
    ]
    assert places[0].max_abs_vs_forward < 1e-12 and places[1].max_abs_vs_forward < 1e-12
    assert between < 1e-12
    assert places[2].max_abs_vs_forward > 0.1
    assert [p.consistent for p in places] == [True, True, False]


def test_the_mixed_place_is_what_diagnose_calls_decode_rotated_twice():
    from mha_rosetta.core import init_params
    from mha_rosetta.diagnose.decode import DecodeBug, simulate_decode
    from mha_rosetta.explain.decode import DEMO_PREFILL, DEMO_STEP, DEMO_TOKENS, decode_loop

    params = init_params(DEMO, seed=5)
    x = np.random.default_rng(6).standard_normal((1, DEMO_TOKENS, DEMO.d_model))
    mixed = decode_loop(
        DEMO, params, x, prefill=DEMO_PREFILL, step=DEMO_STEP, rotate_on_write=True, rotate_on_read=True
    )
    twice = simulate_decode(DEMO, params, x, prefill=DEMO_PREFILL, step=DEMO_STEP, bug=DecodeBug(rotated_twice=True))
    np.testing.assert_allclose(mixed, twice, atol=1e-12, rtol=0)


def test_the_step_masks_exact_values():
    bottom_right, top_left = step_masks()
    assert bottom_right.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert top_left.tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    text = explain_decode(backends=FAKES).to_markdown()
    assert "| bottom-right (on positions: p_j <= p_i) | 1 1 1 1 0 / 1 1 1 1 1 |" in text
    assert "| top-left (`is_causal=True`: query i sees slots 0..i) | 1 0 0 0 0 / 1 1 0 0 0 |" in text
    assert "| fake | dynamic | (B, Hkv, T, Dk) grown with torch.cat" in text
    assert "| none | - | no decode path: its library has no cache | - | - |" in text


def test_bad_context_is_refused():
    with pytest.raises(ValueError, match="context must be a positive number of tokens, got 0"):
        explain_decode(context=0, backends=FAKES)


def test_the_command_line_prints_the_section_and_its_json(tmp_path):
    done = run_cli("explain", "--decode", "--json", str(tmp_path / "decode.json"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "## KV-cache decoding" in done.stdout and "| numpy |" in done.stdout
    payload = json.loads((tmp_path / "decode.json").read_text())
    assert payload["masks"]["top_left"] == [[True, False, False, False, False], [True, True, False, False, False]]
    assert payload["bytes_per_token"] == 3 * (4 + 4) * 4  # the article's d_model 12, 3 heads, float32
    assert payload["places"][2]["max_abs_vs_forward"] > 0.1
