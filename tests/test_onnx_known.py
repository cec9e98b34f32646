"""The known differences of ONNX's Attention op: each measured in its runtime, and each found by the check.

`backends.onnx.probe.findings` calls one bare node in ONNX Runtime, onnx's ReferenceEvaluator and
``torch.onnx.ops.attention``; the assertions here are the measurements the docs and `known.KNOWN`
quote (onnx 1.23, onnxruntime 1.32, torch 2.13), so a runtime that changes shows up here. The check
then runs the three backends on the spec cases and must name each output-level difference, with its
source, as a known difference, and nothing else: no disagreement, no silent pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx is not installed: pip install 'mha-rosetta[onnx]'")
pytest.importorskip("onnxruntime", reason="onnxruntime is not installed: pip install 'mha-rosetta[onnx]'")

from adapter_cases import CASE_BY_NAME

from mha_rosetta.backends.onnx.known import (
    KNOWN,
    OP_ATTRIBUTES,
    OP_VARIANTS,
    attribute_transform,
    known_answer,
    op_attributes,
    qk_modes,
)
from mha_rosetta.backends.onnx.probe import findings
from mha_rosetta.checks import Status, run_check
from mha_rosetta.core import STAGE_BY_NAME, MHAConfig, compare, init_params, reference_stages
from mha_rosetta.core.variants import VARIANT_REGISTRY


@pytest.fixture(scope="module")
def measured():
    return {runtime: findings(runtime) for runtime in ("onnxruntime", "reference")}


def test_onnx_runtimes_follow_the_spec_but_take_sqrt_scale_in_float32(measured):
    for found in measured.values():
        assert found["sqrt_scale"].startswith("float32 sqrt(scale)")
        assert found["softcap_after_mask"] == "softcap, then mask (the spec)"
        assert found["causal_past_top_left"] == "bottom-right (j <= i + past)"
        assert found["empty_rows_zero"] == "zero row"
    assert measured["onnxruntime"]["qk_mode_numbering"] == "0: scores, 1: capped, 2: capped+masked, 3: weights"
    # The ReferenceEvaluator's mode 0 returns the capped scores when a softcap is set (the rest as the spec).
    assert measured["reference"]["qk_mode_numbering"] == "0: capped, 1: capped, 2: capped+masked, 3: weights"


def test_torch_onnx_ops_attention_departs_from_the_spec():
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    found = findings("torch")
    assert found["sqrt_scale"].startswith("exact scale")
    assert found["softcap_after_mask"] == "mask, then softcap"
    assert found["causal_past_top_left"] == "top-left (j <= i)"
    assert found["empty_rows_zero"] == "zero row"
    assert found["qk_mode_numbering"].startswith("0: scores, 1: masked, 2: masked+capped")


def test_every_known_difference_has_a_source():
    assert set(KNOWN) == {
        "sqrt_scale", "export_scale_float32", "softcap_after_mask", "causal_past_top_left", "empty_rows_zero",
        "qk_mode_numbering",
    }  # fmt: skip
    for known in KNOWN.values():
        assert known.source and known.line().endswith(f"[source: {known.source}]")


def test_the_ops_variant_table_holds_registry_entries_and_the_backends_read_it():
    """`OP_VARIANTS` names registry entries; the onnx backends claim them (plus QK-norm's nodes) and torch-onnx
    the same; each attribute of `OP_ATTRIBUTES` is in both conventions. The sets and texts are written out: what
    the backends claimed and printed before the table moved to `known` (issue 42), so that an entry dropped from
    the table (its cases then skipped by tests/test_backend_onnx.py, not failed) or a convention left behind fails
    here."""
    from mha_rosetta.backends import get_backend
    from mha_rosetta.backends.onnx.adapter import ONNX_VARIANTS
    from mha_rosetta.backends.oracles.torch_onnx import TorchOnnxOracle

    assert set(OP_ATTRIBUTES) <= set(OP_VARIANTS) <= set(VARIANT_REGISTRY)
    assert OP_ATTRIBUTES == {"softcap": "softcap"}
    claimed = {"window", "softcap", "qkv_bias", "alibi", "rel_bias", "rope_scaling"}  # the op's, by hand
    claimed |= {"qk_norm_head", "qk_norm_projection"}  # QK-norm's RMSNorm nodes at both places
    assert ONNX_VARIANTS == claimed and TorchOnnxOracle.variants == claimed
    assert get_backend("onnx").variants == get_backend("onnx-reference").variants == claimed | {"gate"}
    assert "Attention op (opset 23/24; scale, is_causal, softcap attributes; bool attn_mask" in (
        get_backend("onnx").convention
    )
    assert "torch.onnx.ops.attention(Q, K, V, attn_mask, past_key, past_value, is_causal=, scale=, softcap=) on" in (
        TorchOnnxOracle.convention
    )


def test_op_attributes_by_hand_and_in_the_graph():
    """The softcap goes to the op as its own attribute, on every Attention node of the graph; no variant, none."""
    from onnx import helper

    from mha_rosetta.backends.onnx.graph import GraphSpec, build

    plain, capped = MHAConfig(d_model=6, n_heads=2), MHAConfig(d_model=6, n_heads=2, softcap=1.5)
    assert op_attributes(plain) == {}
    assert op_attributes(capped) == {"softcap": 1.5}
    for cfg, expected in ((plain, None), (capped, 1.5)):
        model, _ = build(GraphSpec(cfg, "float64", qk_modes=((3, "weights"),)), init_params(cfg, seed=0))
        nodes = [node for node in model.graph.node if node.op_type == "Attention"]
        assert len(nodes) == 2  # the forward's and the qk output's
        for node in nodes:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attributes.get("softcap") == expected and attributes["is_causal"] == 0


def test_qk_modes_show_the_stages_of_the_case_in_the_spec_numbering():
    plain, capped = MHAConfig(d_model=6, n_heads=2), MHAConfig(d_model=6, n_heads=2, softcap=1.5)
    assert qk_modes(plain, masked=False, reference=False) == ((3, "weights"), (0, "scores"))
    assert qk_modes(plain, masked=True, reference=True) == ((3, "weights"), (0, "scores"), (2, "masked_scores"))
    every = ((3, "weights"), (0, "scores"), (1, "capped_scores"), (2, "masked_scores"))
    assert qk_modes(capped, masked=True, reference=False) == every
    # The ReferenceEvaluator's mode 0 is the capped scores under a softcap: no scores shown.
    assert qk_modes(capped, masked=True, reference=True) == tuple(m for m in every if m[1] != "scores")
    assert all(stage in STAGE_BY_NAME for _, stage in every)


def test_a_difference_shows_only_on_a_case_with_its_variant():
    plain, capped = MHAConfig(d_model=6, n_heads=2), MHAConfig(d_model=6, n_heads=2, softcap=1.5)
    assert KNOWN["softcap_after_mask"].shows_on(capped) and not KNOWN["softcap_after_mask"].shows_on(plain)
    assert KNOWN["sqrt_scale"].shows_on(plain) and KNOWN["causal_past_top_left"].shows_on(capped)
    assert all(not known.variant or known.variant in VARIANT_REGISTRY for known in KNOWN.values())


def test_the_explainer_title_and_takeaway_come_from_the_table():
    """The page's title joins the op's entries' topics, its takeaway their advice (a shared one once)."""
    from mha_rosetta.explain.differences import onnx_attention

    page = onnx_attention(None)
    assert page.status == "demonstrated"
    assert page.title == (
        "ONNX Attention (opset 23/24): sqrt(scale), softcap order, causal offset, empty rows, qk output modes"
    )
    assert page.takeaway == (
        "fold the scale into Q for float64 graphs; do not trust torch.onnx.ops.attention's eager answer for softcap "
        "with a mask or for is_causal with past_key; read qk_matmul_output modes from the runtime's own numbering"
    )
    shown = [run.split(":")[0] for run, _ in page.rows if not run.startswith(" ")]
    assert shown == [name for name, known in KNOWN.items() if known.of_op]
    assert "export_scale_float32" not in shown  # the exporter's, shown by the check's torch-onnx:export runs


def test_softcap_after_mask_answer_by_hand():
    """One query, two keys, the second blocked: capping after the mask gives the blocked key exp(-cap) weight."""
    cfg = MHAConfig(d_model=2, n_heads=1, bias=False, softcap=1.0, scale=1.0)
    params = dataclasses.replace(init_params(cfg, seed=0), w_q=np.eye(2), w_k=np.eye(2), w_v=np.eye(2), w_o=np.eye(2))
    x = np.array([[[0.0, 0.0], [0.0, 1.0]]])  # token 0 scores 0 against both keys
    mask = np.array([[True, False], [True, True]])
    args = (x, None, None, mask, None, None)
    stages = reference_stages(cfg, params, *args)
    answer = known_answer("softcap_after_mask", cfg, params, args, stages).output
    # query 0: logits [0, -1] after the cap of the blocked -inf -> weights [1, e^-1] / (1 + e^-1); values [0,0], [0,1]
    assert np.allclose(answer[0, 0], [0.0, np.exp(-1) / (1 + np.exp(-1))], atol=1e-15)
    assert np.allclose(stages["output"][0, 0], [0.0, 0.0], atol=1e-15)  # the spec: key 1 gets nothing


CASES = ["self_attention", "causal", "causal_cache", "softcap", "gemma2", "fully_masked_row", "padding"]


@pytest.fixture(scope="module")
def check():
    pytest.importorskip("torch", reason="torch is not installed: pip install 'mha-rosetta[torch]'")
    pytest.importorskip("onnxscript", reason="onnxscript is not installed: pip install 'mha-rosetta[onnx]'")
    cases = [CASE_BY_NAME[name] for name in CASES]
    return run_check(backends="onnx,onnx-reference,torch-onnx,numpy", cases=cases, dtypes=["float64", "float32"])


def test_the_check_finds_each_difference_and_names_its_source(check):
    runs = {(run.case, run.label, run.dtype): run for run in check.runs}
    named = {
        key: run.info.get("known_difference") for key, run in runs.items() if run.status is Status.KNOWN_DIFFERENCE
    }
    for case in ("self_attention", "causal_cache", "softcap", "padding"):  # the cases that run in float64
        for label in ("onnx", "onnx-reference"):
            assert named[(case, label, "float64")] == "sqrt_scale"
    assert named[("causal_cache", "torch-onnx", "float64")] == "causal_past_top_left"
    assert named[("causal_cache", "torch-onnx", "float32")] == "causal_past_top_left"
    assert named[("gemma2", "torch-onnx", "float64")] == "softcap_after_mask"  # gemma2: softcap with a window
    assert named[("self_attention", "torch-onnx:export", "float64")] == "export_scale_float32"
    reason = runs[("causal_cache", "torch-onnx", "float64")].reason
    assert "#8068" in reason and "known difference causal_past_top_left" in reason
    # The scale gemma2 uses (1.0) has an exact float32 square root: no difference to find, so plain agreement.
    assert runs[("gemma2", "onnx", "float64")].status is Status.AGREE
    # In float32 the op's square root is within the tolerance: agreement, and the ONNX runtimes give 0 on empty rows.
    assert runs[("fully_masked_row", "onnx", "float32")].status is Status.AGREE
    assert check.exit_status == 0
    assert not [run for run in check.runs if run.status in (Status.DISAGREE, Status.ERROR)]


def test_a_pair_explained_by_known_answers_says_so(check):
    pairs = {(p.case, p.a.label, p.b.label, p.dtype): p for p in check.pairs}
    pair = pairs[("causal_cache", "onnx", "torch-onnx", "float64")]
    assert pair.status is Status.KNOWN_DIFFERENCE
    assert "sqrt_scale" in pair.reason and "causal_past_top_left" in pair.reason
    assert pairs[("self_attention", "onnx", "onnx-reference", "float64")].status is Status.AGREE  # the same answer


def test_an_output_on_no_answer_stays_a_disagreement():
    """The hook excuses only the answer it computes: the op's float64 output, shifted, is a disagreement."""
    case = CASE_BY_NAME["softcap"]
    data = case.inputs()
    args = (data.query, data.key, data.value, data.mask, data.positions, data.kv_positions)
    answer = known_answer("sqrt_scale", case.cfg, case.params(), args, case.reference_stages()).output
    assert not compare(answer + 1e-6, answer, "float64").ok
    assert not compare(answer, case.reference(), "float64").ok  # the difference is real at float64's tolerance


def test_a_disagreement_says_which_stages_the_fused_node_can_show():
    """Without its known answer the op's float64 output is a disagreement, and the report lists what it exposes."""
    from mha_rosetta.backends.onnx.adapter import OnnxBackend

    class Unexcused(OnnxBackend):
        def known_answers(self, *args):
            return []

    result = run_check(
        backends=[Unexcused(name="onnx-unexcused")], cases=[CASE_BY_NAME["self_attention"]], dtypes=["float64"]
    )
    run = next(run for run in result.runs if run.label == "onnx-unexcused")
    assert run.status is Status.DISAGREE
    assert run.divergence.stage == "scores"  # the float32 square root of the scale shows first in the scores
    assert "biased_scores" not in run.divergence.compared and "weights" in run.divergence.compared
    assert "can show only the stages q, k, v, q_heads" in run.reason and "never the biased scores" in run.reason


def test_every_attribute_of_the_op_has_its_formula_in_the_probe():
    """`attribute_transform` (the probe's reading of the op's variant attributes) applies each of `OP_ATTRIBUTES`:
    an attribute added to the table without its formula would leave the probe's scores uncapped, silently. Each one
    set to 2 must change scores of 3 (the softcap: 2 * tanh(3 / 2) = 1.8103, by hand), and none set changes nothing."""
    scores = np.array([[3.0, -1.0]])
    assert np.array_equal(attribute_transform(scores, {}), scores)
    for name, attribute in OP_ATTRIBUTES.items():
        transformed = attribute_transform(scores, {attribute: 2.0})
        assert not np.allclose(transformed, scores), name
    np.testing.assert_allclose(attribute_transform(scores, {"softcap": 2.0}), [[1.8103, -0.9242]], atol=1e-4)
