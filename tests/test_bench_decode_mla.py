"""``bench --mode decode``'s MLA row (issue 45): its cells, the bytes a step reads by hand, absorbed over naive, and
both forms' timed steps giving the same tokens in every adapter that times them. No test asserts a speed."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import installed_backend, requires
from mha_rosetta.backends import get_backend
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.benchmarks.bandwidth import enrich_decode_cell
from mha_rosetta.benchmarks.decode import DecodeCellSpec, decode_config, run_decode_cell
from mha_rosetta.benchmarks.decode_mla import MLA_ROW, absorbed_over_naive, mla_lines
from mha_rosetta.benchmarks.decode_sweep import (
    DecodeSettings,
    assemble_decode_report,
    decode_settings,
    expand_decode_cells,
)
from mha_rosetta.benchmarks.markdown import decode_markdown
from mha_rosetta.core import MHAConfig, init_params
from mha_rosetta.core.variants.mla import DEEPSEEK_V3_LIKE

TINY_MLA = dict(kv_lora_rank=3, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3)
# A plain layer of 2 heads over 1 kv head of d_k 4, and MLA's 2 heads of d_k 2 + 2, d_v 3, latent 3.
TINY = dict(d_model=8, heads=2, kv_heads=1, d_k=4, bias=False, window=None, batch=2, context=5, step=1)
FAST = dict(min_time=0.01, min_repeats=5, max_time=0.2, warmup=1)


def _cell(form: str, **changes) -> dict:
    return {"implementation": f"numpy:{form}", "backend": "numpy", "strategy": form, "dtype": "float32",
            "device": "cpu", "status": "error", "mla": dict(TINY_MLA), **TINY, **changes}  # fmt: skip


@requires("torch")  # the preset names numpy and torch: both decode MLA
def test_the_mla_rows_cells_are_each_decoding_backends_two_forms():
    settings = decode_settings("decode")
    assert settings.mla_contexts == [1024, 4096, 16384, 32768]  # 1k-32k
    cells = [cell for cell in expand_decode_cells(settings, ["numpy", "numpy:slicing", "torch"]) if cell.mla]
    assert [(cell.implementation, cell.context) for cell in cells] == [
        (f"{backend}:{form}", context)
        for backend in ("numpy", "torch")  # each backend once, in the implementations' order
        for form in MLA_STRATEGIES
        for context in (1024, 4096, 16384, 32768)
    ]
    assert {cell.row for cell in cells} == {MLA_ROW} and [cell.prefill for cell in cells[:4]] == [
        True,
        True,
        False,
        False,
    ]
    cfg = decode_config(cells[0])  # DeepSeek V2-Lite's latent at the preset's d_model and heads
    assert (cfg.d_model, cfg.n_heads, cfg.kv_lora_rank, cfg.d_k, cfg.d_v) == (2048, 16, 512, 192, 128)
    assert cfg.causal and cfg.q_lora_rank is None


def test_a_backend_that_does_not_decode_mla_has_no_mla_cells():
    settings = decode_settings("decode-quick")
    # onnx has no MLA decode strategies: no MLA cells for it (the registry says so, no list of names here)
    onnx = installed_backend("onnx")
    assert not set(MLA_STRATEGIES) <= set(onnx.decode_strategies)
    assert not [cell for cell in expand_decode_cells(settings, ["onnx"]) if cell.mla]


def test_a_backend_that_does_not_load_is_left_out_and_a_bug_is_raised(monkeypatch):
    # `mla_implementations` leaves out a backend whose library is missing (an ImportError) or that refuses
    # (UnsupportedCase): the main row's cells say why. Anything else is a bug, and is not swallowed.
    import mha_rosetta.backends as backends
    from mha_rosetta.backends import BackendNotInstalled, UnsupportedCase
    from mha_rosetta.benchmarks.decode_mla import mla_implementations

    real = backends.get_backend
    errors = {
        "missing": BackendNotInstalled("missing: its library is not installed"),
        "unimportable": ModuleNotFoundError("cannot import missing_module"),
        "refusing": UnsupportedCase("refusing: no decode here"),
        "buggy": TypeError("a bug in the adapter"),
    }

    def get_backend(name):
        if name in errors:
            raise errors[name]
        return real(name)

    monkeypatch.setattr(backends, "get_backend", get_backend)
    forms = [f"numpy:{form}" for form in MLA_STRATEGIES]
    assert mla_implementations(["missing", "numpy", "unimportable:naive", "refusing"]) == forms
    with pytest.raises(TypeError, match="a bug in the adapter"):
        mla_implementations(["numpy", "buggy"])
    monkeypatch.setattr(backends, "get_backend", real)
    with pytest.raises(ValueError, match="unknown backend 'no-such-backend'"):  # a name the plan never resolved
        mla_implementations(["no-such-backend"])


def test_the_bytes_a_step_reads_by_hand():
    # float32. The latent a token: (R + dr) x 4 = (3 + 2) x 4 = 20 bytes; B x T = 2 x 5 tokens: 200 bytes, both forms.
    # Naive also expands the cache: B T H (d_k + d_v) x 4 = 2 x 5 x 2 x (4 + 3) x 4 = 560 bytes.
    # Weights: W_q 8 x 2 x 4 = 64, W_kva 8 x 5 = 40, W_O 2 x 3 x 8 = 48, W_UK 2 x 2 x 3 = 12, W_UV 2 x 3 x 3 = 18:
    # 182 numbers, 728 bytes, both forms.
    naive, absorbed = (enrich_decode_cell(_cell(form), 1.0) for form in MLA_STRATEGIES)
    assert (naive["latent_cache_bytes"], naive["expanded_kv_bytes"], naive["kv_read_bytes"]) == (200, 560, 760)
    assert (absorbed["latent_cache_bytes"], absorbed["expanded_kv_bytes"], absorbed["kv_read_bytes"]) == (200, 0, 200)
    assert naive["weight_bytes"] == absorbed["weight_bytes"] == 728
    for cell in (naive, absorbed):  # 20 bytes a token against plain's 2 Hkv d_k x 4 = 32 and MLA's H (d_k + d_v) = 56
        assert (cell["cache_bytes_per_token"], cell["plain_bytes_per_token"], cell["expanded_bytes_per_token"]) == (
            20, 32, 56,
        )  # fmt: skip
        assert cell["limit_s"] == pytest.approx(cell["kv_read_bytes"] / 1e9)  # 1 GB/s
        assert cell["limit_with_weights_s"] == pytest.approx((cell["kv_read_bytes"] + 728) / 1e9)
    # With a query LoRA of rank 3: W_q_a 8 x 3 = 24 and W_q 3 x 8 = 24 for W_q's 64: 166 numbers.
    lora = enrich_decode_cell(_cell("absorbed", mla={**TINY_MLA, "q_lora_rank": 3}), 1.0)
    assert lora["weight_bytes"] == 166 * 4


def test_absorbed_over_naive_per_context_and_its_paragraph():
    def measured(form, context, step_s):
        return enrich_decode_cell(_cell(form, context=context, status="ok", median_s=step_s), 1.0)

    cells = [measured("naive", 5, 4e-3), measured("absorbed", 5, 1e-3), measured("absorbed", 7, 1e-3)]
    absorbed_over_naive(cells)
    assert [cell.get("absorbed_over_naive") for cell in cells] == [None, pytest.approx(0.25), None]  # 7: no naive
    text = "\n".join(mla_lines(cells))
    assert "20 bytes a token (kv_lora_rank + d_rope), against 32 for the plain layer's K and V" in text
    assert "`numpy` 5: 0.25x" in text


def test_bad_mla_settings_name_the_argument():
    with pytest.raises(ValueError, match=r"mla_contexts needs the MLA layer's sizes \(mla\), got mla=None"):
        DecodeSettings(mla=None, mla_contexts=[64])
    with pytest.raises(ValueError, match=r"decode mla takes .* got unknown d_c"):
        decode_settings("decode-quick", mla={"kv_lora_rank": 4, "d_c": 3})
    with pytest.raises(ValueError, match=r"decode mla must be a dict of .*kv_lora_rank at least"):
        DecodeCellSpec(implementation="numpy:naive", context=4, mla={"v_head_dim": 3})


@pytest.mark.parametrize(
    "backend", ["numpy", pytest.param("torch", marks=requires("torch")), pytest.param("jax", marks=requires("jax"))]
)
def test_both_forms_timed_steps_give_the_same_tokens(backend):
    cfg = MHAConfig(**DEEPSEEK_V3_LIKE)  # q LoRA, YaRN, d_v != d_k
    params = init_params(cfg, seed=4)
    adapter = get_backend(backend)
    outputs = {}
    for form in MLA_STRATEGIES:
        prepared = adapter.prepare_decode(
            cfg, params, context=11, batch=2, step=2, dtype="float64", strategy=form, seed=7
        )
        if prepared.compile is not None:
            prepared.compile()
        outputs[form] = prepared.output()
        np.testing.assert_array_equal(prepared.output(), outputs[form])  # every timed call is the same step
        cache = prepared.info["cache"]
        assert cache["kind"] == "latent" and cache["slots"] == 13 and cache["bytes"] == 2 * 13 * (10 + 6) * 8
    assert outputs["naive"].shape == (2, 2, 24)
    np.testing.assert_allclose(outputs["absorbed"], outputs["naive"], rtol=0, atol=1e-12)
    # The same numbers are drawn in every adapter: the step equals NumPy's.
    numpy = get_backend("numpy").prepare_decode(cfg, params, context=11, batch=2, step=2, dtype="float64",
                                                strategy="naive", seed=7).output()  # fmt: skip
    np.testing.assert_allclose(outputs["naive"], numpy, rtol=0, atol=1e-12)


def test_a_ragged_mla_step_is_refused_with_the_reason():
    from mha_rosetta.backends import UnsupportedCase

    cfg = MHAConfig(**DEEPSEEK_V3_LIKE)
    with pytest.raises(UnsupportedCase, match="MLA's timed step takes a rectangular batch"):
        get_backend("numpy").prepare_decode(cfg, init_params(cfg), context=4, batch=2, strategy="naive", lengths=[4, 2])


def test_an_adapter_without_a_timed_mla_step_refuses_it_by_name():
    # einops decodes MLA through run_decode's latent cache but times no step of it (`MLAStrategies.mla_timed_step`).
    from mha_rosetta.backends import UnsupportedCase

    cfg = MHAConfig(**DEEPSEEK_V3_LIKE)
    einops = installed_backend("einops-numpy")
    assert not einops.mla_timed_step and get_backend("numpy").mla_timed_step
    with pytest.raises(UnsupportedCase, match="einops-numpy: MLA's 'absorbed' form has no timed decode step yet"):
        einops.prepare_decode(cfg, init_params(cfg), context=4, batch=1, strategy="absorbed")


def test_the_mla_forms_timed_step_reaches_the_next_class_of_the_mro():
    # `MLAStrategies.prepare_decode` hands MLA's forms on with super(), as every other strategy: a class between it
    # and `DecodeMixin` (torch's adapter has `TorchDevices` there) is not skipped. The next class here records what
    # it was handed; calling `DecodeMixin.prepare_decode` by name would skip it (and fail: this probe has no cache).
    from mha_rosetta.backends import STANDARD, UnsupportedCase
    from mha_rosetta.backends._mla import MLAStrategies

    handed: list[dict] = []

    class Between:
        def prepare_decode(self, cfg, params, **options):
            handed.append(options)
            return "the next class's step"

    class Probe(MLAStrategies, Between):
        name = "probe"
        mla_timed_step = True

    cfg = MHAConfig(**DEEPSEEK_V3_LIKE)
    for strategy in (*MLA_STRATEGIES, STANDARD):
        assert Probe().prepare_decode(cfg, None, context=4, strategy=strategy) == "the next class's step"
    assert [options["strategy"] for options in handed] == [*MLA_STRATEGIES, STANDARD]
    assert handed[0] == {"context": 4, "strategy": MLA_STRATEGIES[0]}  # every option passed on as given
    Probe.mla_timed_step = False  # no timed step of the forms: refused before the next class is asked
    with pytest.raises(UnsupportedCase, match="probe: MLA's 'naive' form has no timed decode step yet"):
        Probe().prepare_decode(cfg, None, context=4, strategy="naive")
    assert len(handed) == 3


def test_a_tiny_mla_bench_in_fresh_children():
    settings = decode_settings(
        "decode-quick", mla=dict(TINY_MLA), mla_contexts=[32], d_model=8, heads=2, policy=FAST, prefill_policy=FAST
    )
    specs = [spec for spec in expand_decode_cells(settings, ["numpy"]) if spec.mla]
    assert [spec.implementation for spec in specs] == ["numpy:naive", "numpy:absorbed"]
    records = [run_decode_cell(spec, timeout=120) for spec in specs]
    for record in records:
        assert record["status"] == "ok", record.get("error") or record.get("stderr_tail")
        assert record["cache_info"]["kind"] == "latent" and record["cache_info"]["bytes_per_token"] == 20
        assert record["prefill_status"] == "ok"  # the latent run's prefill of the context
    bandwidth = {"device": "cpu", "threads": 1, "gbps": 10.0, "library": "numpy"}
    report = assemble_decode_report(settings.as_dict(), [bandwidth], records)
    naive, absorbed = report["cells"]
    assert naive["kv_read_bytes"] == 32 * 20 + 32 * 2 * 7 * 4 and absorbed["kv_read_bytes"] == 32 * 20
    assert absorbed["absorbed_over_naive"] == pytest.approx(absorbed["step_s"] / naive["step_s"])
    assert "Absorbed over naive" in decode_markdown(report)
