"""The column/row-sample article's claims that are not about speed, run as tests asserting the measured values.

The speed halves (claims 3, 7 and parts of 9, 11) are benchmark questions and never run
here; only the logic that folds their answers into a verdict is tested, with made-up answers.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.backends.entries import module_name
from mha_rosetta.explain import claims as claims_module
from mha_rosetta.explain.claims import (
    CAVEAT,
    CONFIRMED,
    PARTLY,
    REFUTED,
    add_speed,
    merge_verdicts,
    run_claims,
)
from mha_rosetta.explain.seed_setup import make_setup

HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(scope="module")
def seed_setup():
    return make_setup()  # 6 tokens, d_model 12, 3 heads of d_k 4, batch 2


def _adapter_present(name: str) -> bool:
    from mha_rosetta.backends import REGISTRY, available_backends

    return name in available_backends() and importlib.util.find_spec(module_name(REGISTRY[name].module)) is not None


def test_claim_12_worked_numbers_exact(seed_setup):
    result = claims_module.claim_12(seed_setup)
    scores = result.measured["scores"]
    assert scores["column samples (W_A @ x)"] == 2.5
    assert scores["row samples (x @ W_B)"] == 2.5
    if HAS_TORCH:
        assert scores["torch nn.Linear"] == 2.5
    blocks = result.measured["blocks"]
    assert blocks["D[0, 0]"] == [[1, 2], [5, 6]]
    assert blocks["D[0, 1]"] == [[3, 4], [7, 8]]
    assert blocks["D[1, 0]"] == [[9, 10], [13, 14]]
    assert blocks["D[1, 1]"] == [[11, 12], [15, 16]]
    assert result.verdict == CONFIRMED


def test_claim_4_row_5_locations_and_round_trip(seed_setup):
    result = claims_module.claim_4(seed_setup)
    libraries = ["numpy", "torch"] if HAS_TORCH else ["numpy"]
    assert sorted(result.measured) == sorted(libraries)
    for library in libraries:
        facts = result.measured[library]
        assert facts["row_5"] == list(range(40, 48))
        assert facts["d_0_0_5"] == [40, 41, 42, 43]
        assert facts["d_0_1_5"] == [44, 45, 46, 47]
        assert facts["every_row_found"] and facts["round_trip_exact"]
        assert facts["all_views"]  # reshape/transpose here never copies
    assert result.verdict == CONFIRMED


def test_claim_1_rows_and_columns_agree(seed_setup):
    result = claims_module.claim_1(seed_setup)
    assert result.measured["max_abs_y_b_minus_y_a_t"] <= 1e-12
    if _adapter_present("numpy") and _adapter_present("torch"):
        # numpy holds q as (B, H*Dk, N) and torch as (B, N, H*Dk): the same numbers transposed.
        assert "max_abs_numpy_vs_torch_q" in result.measured, result.evidence
        assert result.measured["max_abs_numpy_vs_torch_q"] <= 1e-12
    assert result.verdict == CONFIRMED


@requires("torch")
def test_claim_2_linear_weight_is_out_in(seed_setup):
    result = claims_module.claim_2(seed_setup)
    assert result.measured["weight_shape"] == (2, 4)
    assert result.measured["max_abs"] <= 1e-12
    assert "cannot be multiplied" in result.measured["x_at_w_error"]
    assert result.verdict == CONFIRMED


def test_claim_2_skips_without_torch(seed_setup, monkeypatch):
    import mha_rosetta.core.probe as probe_module

    # The probe's answer for torch, as on a machine without it: every demonstration that needs torch skips.
    monkeypatch.setitem(probe_module._ANSWERS, "torch", probe_module.Probe("torch", installed=False))
    result = claims_module.claim_2(seed_setup)
    assert result.verdict == "skipped: torch not installed"
    assert result.evidence == ["needs torch.nn.Linear"]


def test_claim_3_layout_facts(seed_setup):
    result = claims_module.claim_3(seed_setup)
    assert result.measured["x_t_c_contiguous"] is False
    assert result.measured["max_abs"] <= 1e-12
    assert result.verdict.startswith("skipped")  # the verdict itself is a speed question


def test_claim_5_standard_split_exact(seed_setup):
    result = claims_module.claim_5(seed_setup)
    assert result.measured["unbatched_exact"]
    if HAS_TORCH:
        assert result.measured["batched_exact"] and result.measured["batched_is_view"]
    if _adapter_present("torch"):
        assert result.measured["torch_adapter_split_exact"]
    assert result.verdict == CONFIRMED


def test_claim_6_direct_reshape_differs(seed_setup):
    result = claims_module.claim_6(seed_setup)
    m = result.measured
    assert m["correct_head0_tokens"] == [0, 1, 2, 3, 4, 5]
    assert m["wrong_head0_tokens"] == [0, 1]  # 6 tokens / 3 heads: two whole tokens
    assert m["wrong_head0_features"] == list(range(12))
    assert m["seed_correct_head0"] == [[1, 2], [5, 6], [9, 10], [13, 14]]
    assert m["seed_wrong_head0"] == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert m["correct_error"] <= 1e-12
    assert m["wrong_error"] > 0.1
    for name in ("numpy", "torch"):
        if _adapter_present(name):
            assert m["adapter_errors"][name] > 0.1, f"{name}'s direct_reshape strategy was not caught"
    assert result.verdict == CONFIRMED


def test_claim_7_slicing_is_correct(seed_setup):
    result = claims_module.claim_7(seed_setup)
    assert result.measured["max_abs_sliced_vs_batched"] <= 1e-12
    for error in result.measured["adapter_errors"].values():
        assert error <= 1e-10


def test_claim_8_per_head_equals_merged(seed_setup):
    result = claims_module.claim_8(seed_setup)
    assert result.measured["max_abs"] <= 1e-12
    assert result.measured["layout_exact"] and result.measured["round_trip_exact"]
    for error in result.measured["adapter_errors"].values():
        assert error <= 1e-10
    assert result.verdict == CONFIRMED


def test_claim_9_view_after_transpose(seed_setup):
    result = claims_module.claim_9(seed_setup)
    numpy_facts = result.measured["numpy"]
    assert numpy_facts["reshape_copies"]
    assert numpy_facts["no_copy_reshape_error"].startswith("ValueError")
    if HAS_TORCH:
        torch_facts = result.measured["torch"]
        assert torch_facts["transposed_contiguous"] is False
        assert torch_facts["view_error"].startswith("RuntimeError: view size is not compatible")
        assert torch_facts["contiguous_copies"] and torch_facts["reshape_copies"]
        assert torch_facts["reshape_warnings"] == 0  # "silently"
        assert torch_facts["reshape_of_contiguous_is_view"]
        assert torch_facts["same_values"]
    assert result.verdict == CONFIRMED


@requires("torch")
def test_claim_10_sequence_first_default(seed_setup):
    result = claims_module.claim_10(seed_setup)
    assert result.measured["default_batch_first"] is False
    errors = result.measured["errors"]
    assert errors["seq_first_input"] <= 1e-12
    assert errors["batch_first_true"] <= 1e-12
    assert errors["batch_first_input_to_default"] > 0.1  # runs without an error, gives wrong numbers
    assert result.verdict == CONFIRMED


def test_claim_11_einsum_without_transpose(seed_setup):
    result = claims_module.claim_11(seed_setup)
    assert result.measured["score_diff"] <= 1e-12
    assert result.measured["output_error"] <= 1e-12
    assert result.measured["merge_is_view"]
    if _adapter_present("einops-numpy"):
        assert result.measured["einops_adapter_error"] <= 1e-10
    assert result.verdict == CONFIRMED


def test_run_claims_without_speed(seed_setup):
    results = run_claims(setup=seed_setup, speed=False)
    assert [r.claim for r in results] == list(range(1, 13))
    for result in results:
        data = result.to_dict()
        assert set(data) >= {"claim", "title", "verdict", "evidence"}
        assert data["evidence"]
    verdicts = {r.claim: r.verdict for r in results}
    assert verdicts[3].startswith("skipped") and verdicts[7].startswith("skipped")
    expected_confirmed = [1, 4, 5, 6, 8, 9, 11, 12] + ([2, 10] if HAS_TORCH else [])
    assert all(verdicts[n] == CONFIRMED for n in expected_confirmed), verdicts


def test_run_claims_rejects_unknown_numbers():
    with pytest.raises(ValueError, match="numbered 1-12"):
        run_claims([13])


# --- folding the benchmark questions' answers into the verdicts (made-up answers) -------------------


def test_merge_verdicts():
    assert merge_verdicts([CONFIRMED, CONFIRMED]) == CONFIRMED
    assert merge_verdicts([REFUTED, "skipped: no GPU"]) == REFUTED
    assert merge_verdicts([CONFIRMED, REFUTED]) == PARTLY
    assert merge_verdicts([CONFIRMED, CAVEAT]) == CAVEAT
    assert merge_verdicts(["skipped: no GPU"]) == "skipped: no GPU"


def test_speed_only_claim_takes_the_benchmark_verdict(seed_setup):
    result = claims_module.claim_3(seed_setup)
    answer = {"claim": 3, "title": "X @ W.T vs W @ X.T", "verdict": "partly", "evidence": "numpy 1.1x, torch 0.99x"}
    result = add_speed(result, [answer], "")
    assert result.verdict == PARTLY
    assert any("numpy 1.1x, torch 0.99x" in line for line in result.evidence)


def test_mixed_claim_gets_a_caveat_when_speed_is_refuted(seed_setup):
    result = claims_module.claim_11(seed_setup)
    answer = {"claim": 11, "title": "einsum at no cost", "verdict": "refuted", "evidence": "einsum 19.8x slower"}
    assert add_speed(result, [answer], "").verdict == CAVEAT


def test_missing_benchmark_skips_speed_only_claims(seed_setup):
    result = add_speed(claims_module.claim_7(seed_setup), [], "benchmark questions unavailable (no module)")
    assert result.verdict.startswith("skipped: speed not measured")
    kept = add_speed(claims_module.claim_9(seed_setup), [], "benchmark questions unavailable (no module)")
    assert kept.verdict == CONFIRMED  # the layout half still stands


def test_speed_answers_reports_a_failing_benchmark(monkeypatch):
    import mha_rosetta.benchmarks.questions as questions

    def broken(threads, quick):
        raise RuntimeError("child crashed")

    monkeypatch.setattr(questions, "run_speed_questions", broken)
    answers, why = claims_module.speed_answers()
    assert answers == {} and "child crashed" in why


def test_claims_json_is_serialisable(seed_setup):
    import json

    data = [r.to_dict() for r in run_claims([4, 12], setup=seed_setup)]
    text = json.dumps(data)
    assert json.loads(text)[1]["measured"]["blocks"]["D[0, 1]"] == [[3, 4], [7, 8]]
    assert np.isclose(json.loads(text)[1]["measured"]["scores"]["row samples (x @ W_B)"], 2.5)


def test_claims_on_other_configurations():
    from mha_rosetta.core import MHAConfig

    no_bias = run_claims([6, 8, 11], setup=make_setup(MHAConfig(d_model=15, n_heads=3, bias=False), tokens=7))
    assert [r.verdict for r in no_bias] == [CONFIRMED] * 3
    grouped = {
        r.claim: r
        for r in run_claims([6, 8], setup=make_setup(MHAConfig(d_model=16, n_heads=4, n_kv_heads=2), tokens=7))
    }
    assert grouped[6].verdict.startswith("skipped: the demonstration assumes one kv head per query head")
    assert grouped[8].verdict == CONFIRMED


def test_the_registry_carries_every_claim_and_its_speed_question():
    from mha_rosetta.explain.claims import CLAIMS, speed_claims, speed_only_claims

    assert sorted(CLAIMS) == list(range(1, 13))
    assert speed_claims() == (3, 7, 9, 11)  # the claims the benchmark questions answer
    assert speed_only_claims() == (3, 7)
    assert [n for n in sorted(CLAIMS) if CLAIMS[n].plain_mha_only] == [6, 7, 10, 11]
    assert all(CLAIMS[n].check.__name__ == f"claim_{n}" for n in CLAIMS)
    assert CLAIMS[12].title.startswith("Worked numbers: token [1, 0, 2, 0, ...]")


def test_the_claim_decorator_refuses_a_number_twice_and_speed_only_without_a_question():
    from mha_rosetta.explain.claims import claim

    with pytest.raises(ValueError, match="claim 4 is registered twice: claim_4 and imposter"):

        @claim(4, "a second claim 4")
        def imposter(setup):
            return None

    with pytest.raises(ValueError, match="claim 13: speed_only=True needs a speed question"):
        claim(13, "no question", speed_only=True)
