"""The agreement harness, tested with fake backends whose right and wrong answers we control.

A correct fake runs the spec pipeline; wrong fakes make one known mistake each (the
direct-reshape head split, a forgotten scale, a swapped output weight), so the
divergence report must name exactly that stage. Fakes that raise, NaN-returning
"oracles" and fakes that cannot express a case cover the other statuses, and the
command line is driven end to end for its exit codes and its JSON.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from mha_rosetta.backends import DIRECT_RESHAPE, STANDARD, Backend, Prepared, StageTensor
from mha_rosetta.checks import SPEC_CASES, Status, first_divergence, get_cases, run_check
from mha_rosetta.checks.json_report import SCHEMA_VERSION, to_json
from mha_rosetta.checks.matrices import build_matrices
from mha_rosetta.checks.report import render_markdown, render_plain, report_blocks, summary_lines
from mha_rosetta.cli.main import main
from mha_rosetta.core import STAGE_BY_NAME, allowed_positions, numpy_dtype, reference_stages, softmax_with_empty_rows


def fake_pipeline(cfg, params, inputs, *, split="correct", scale=None, swap_output=False, empty_rows="zeros"):
    """The spec pipeline in NumPy (float64), vectorised, with switchable mistakes."""
    x_q, x_k, x_v = (np.asarray(a, dtype=np.float64) for a in (inputs.query, inputs.key, inputs.value))
    B, Nq, Nk = x_q.shape[0], x_q.shape[1], x_k.shape[1]
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v

    def linear(x, w, b):
        return x @ w.T + (0.0 if b is None else b)

    q = linear(x_q, params.w_q, params.b_q)  # (B, Nq, H*Dk)
    k = linear(x_k, params.w_k, params.b_k)  # (B, Nk, Hkv*Dk)
    v = linear(x_v, params.w_v, params.b_v)  # (B, Nk, Hkv*Dv)
    if split == "correct":
        q_heads = q.reshape(B, Nq, H, Dk).transpose(0, 2, 1, 3)  # (B, H, Nq, Dk)
    else:
        q_heads = q.reshape(B, H, Nq, Dk)  # the mistake: tokens and features mixed up across heads
    if split == "direct_undone":  # the mistake everywhere, undone the same way when merging
        k_heads = k.reshape(B, Hkv, Nk, Dk)
        v_heads = v.reshape(B, Hkv, Nk, Dv)
    else:
        k_heads = k.reshape(B, Nk, Hkv, Dk).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dk)
        v_heads = v.reshape(B, Nk, Hkv, Dv).transpose(0, 2, 1, 3)  # (B, Hkv, Nk, Dv)
    group = [cfg.kv_head_of(h) for h in range(H)]
    scores = (cfg.scale if scale is None else scale) * (q_heads @ k_heads[:, group].swapaxes(-1, -2))  # (B, H, Nq, Nk)
    allowed = allowed_positions(cfg, inputs)
    masked = scores if allowed is None else np.where(allowed, scores, -np.inf)
    weights = softmax_with_empty_rows(masked)
    if empty_rows == "nan":  # what torch's SDPA does for a row with nothing to attend to
        weights = np.where(np.isneginf(masked).all(axis=-1, keepdims=True), np.nan, weights)
    context = weights @ v_heads[:, group]  # (B, H, Nq, Dv)
    if split == "direct_undone":
        merged = context.reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv), the inverse of the direct reshape
    else:
        merged = context.transpose(0, 2, 1, 3).reshape(B, Nq, H * Dv)  # (B, Nq, H*Dv)
    w_o = params.w_o[::-1] if swap_output else params.w_o  # rows in the wrong order
    output = linear(merged, w_o, params.b_o)  # (B, Nq, D)
    return {
        "q": q, "k": k, "v": v, "q_heads": q_heads, "k_heads": k_heads, "v_heads": v_heads,
        "q_rotated": q_heads, "k_rotated": k_heads,  # the fake has no rotary: the heads themselves
        "scores": scores, "masked_scores": masked, "weights": weights, "context": context,
        "merged": merged, "output": output,
    }  # fmt: skip


class FakeBackend(Backend):
    """Runs `fake_pipeline` and rounds every stage to the requested dtype."""

    strategies = (STANDARD, DIRECT_RESHAPE)
    dtypes = ("float64", "float32", "float16")

    def __init__(
        self,
        name,
        *,
        kind="implementation",
        fail=False,
        hide_stages=(),
        unsupported_gqa=False,
        mistake_split="direct",
        info=None,
        **mistakes,
    ):
        super().__init__(name)
        self.kind = kind
        self.fail = fail
        self.hide_stages = hide_stages
        self.unsupported_gqa = unsupported_gqa
        self.mistakes = mistakes
        self.mistake_split = mistake_split
        self.info = info or {}

    def unsupported_reason(self, cfg, dtype, device, strategy):
        if self.unsupported_gqa and cfg.n_kv_heads != cfg.n_heads:
            return f"{self.name} has no grouped kv heads"
        return super().unsupported_reason(cfg, dtype, device, strategy)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        split = self.mistake_split if strategy == DIRECT_RESHAPE else "correct"
        stages = fake_pipeline(cfg, params, inputs, split=split, **self.mistakes)
        rounded = {name: value.astype(numpy_dtype(dtype)) for name, value in stages.items()}

        def forward():
            if self.fail:
                raise RuntimeError("the fake kernel exploded")
            return rounded["output"]

        def native_stages():
            return {
                name: StageTensor(value, STAGE_BY_NAME[name].shape)
                for name, value in rounded.items()
                if name not in self.hide_stages
            }

        to_numpy = lambda r: np.asarray(r, dtype=np.float64)  # noqa: E731
        return Prepared(forward=forward, to_numpy=to_numpy, native_stages=native_stages, info=dict(self.info))


def good(name="fake-good", **kw):
    return FakeBackend(name, **kw)


def cases_in(dtypes, *names):
    """Spec cases re-labelled to run in ``dtypes`` (their own lists are trimmed for speed)."""
    return [replace(SPEC_CASES[name], dtypes=tuple(dtypes)) for name in names]


SMALL_CASES = cases_in(("float64", "float32"), "self_attention", "cross_attention", "gqa", "causal_padding")


# -- the fake itself matches the oracle (otherwise nothing below means anything) -------------
def test_correct_fake_matches_the_oracle_stage_by_stage():
    case = SPEC_CASES["gqa"]
    backend = good()
    data = case.inputs()
    _, stages = backend.run(case.cfg, case.params(), data.query, data.key, data.value, data.mask, return_stages=True)
    reference = reference_stages(case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    assert first_divergence(reference, stages, "float64") is None
    assert set(stages) == set(reference)


# -- divergence: the first stage is named -----------------------------------------------------
@pytest.mark.parametrize(
    ("mistake", "expected_stage"),
    [({"split": "direct"}, "q_heads"), ({"scale": 1.0}, "scores"), ({"swap_output": True}, "output")],
    ids=["direct-reshape", "forgotten-scale", "swapped-output-rows"],
)
def test_first_divergence_names_the_stage_of_the_mistake(mistake, expected_stage):
    case = SPEC_CASES["cross_attention"]
    data = case.inputs()
    from mha_rosetta.core import prepare_inputs

    inputs = prepare_inputs(case.cfg, data.query, data.key, data.value, data.mask)
    wrong = fake_pipeline(case.cfg, case.params(), inputs, **mistake)
    reference = reference_stages(case.cfg, case.params(), data.query, data.key, data.value, data.mask)
    divergence = first_divergence(reference, wrong, "float64")
    assert divergence is not None
    assert divergence.stage == expected_stage
    assert divergence.max_abs > 1e-3  # a real mistake, far above the float64 tolerance
    assert divergence.max_abs == pytest.approx(np.max(np.abs(reference[expected_stage] - wrong[expected_stage])))


def test_divergence_skips_stages_one_side_does_not_expose():
    case = SPEC_CASES["self_attention"]
    data = case.inputs()
    reference = reference_stages(case.cfg, case.params(), data.query)
    wrong = {name: value.copy() for name, value in reference.items()}
    wrong["weights"][0, 0, 0, 0] += 0.5  # the first real difference, at "weights"
    wrong["output"][0, 0, 0] += 0.5
    fused = {"q": wrong["q"], "output": wrong["output"]}  # a fused kernel shows only these
    assert first_divergence(reference, wrong, "float32").stage == "weights"
    divergence = first_divergence(reference, fused, "float32")
    assert divergence.stage == "output"
    assert divergence.compared == ("q", "output")
    assert divergence.max_abs == pytest.approx(0.5)
    assert first_divergence(reference, reference, "float64") is None


# -- statuses ---------------------------------------------------------------------------------
def test_good_fakes_agree_and_the_mistake_is_caught_at_q_heads():
    result = run_check(backends=[good("fake-a"), good("fake-b")], cases=SMALL_CASES, dtypes=["float64", "float32"])
    assert result.exit_status == 0, summary_lines(result)
    by_label = {}
    for run in result.runs:
        by_label.setdefault(run.label, set()).add(run.status)
    assert by_label == {
        "fake-a": {Status.AGREE},
        "fake-b": {Status.AGREE},
        "fake-a:direct_reshape": {Status.CAUGHT},
        "fake-b:direct_reshape": {Status.CAUGHT},
    }
    caught = [run for run in result.runs if run.status is Status.CAUGHT]
    assert len(caught) == 2 * len(SMALL_CASES) * 2
    assert {run.divergence.stage for run in caught} == {"q_heads"}
    # Two copies of the same mistake agree with each other; every mistake/correct pair is caught.
    pairs = {(p.a.label, p.b.label): p.status for p in result.pairs if p.case == "gqa" and p.dtype == "float32"}
    assert pairs[("fake-a", "fake-b")] is Status.AGREE
    assert pairs[("fake-a:direct_reshape", "fake-b:direct_reshape")] is Status.AGREE
    assert pairs[("fake-a", "fake-a:direct_reshape")] is Status.CAUGHT
    assert pairs[("fake-a:direct_reshape", "fake-b")] is Status.CAUGHT
    assert len(result.pairs) == len(SMALL_CASES) * 2 * 6  # 4 runs per case and dtype: 6 pairs


def test_a_wrong_implementation_is_named_with_its_first_divergent_stage():
    wrong = FakeBackend("fake-noscale", scale=1.0)
    wrong.strategies = (STANDARD,)
    result = run_check(backends=[good(), wrong], cases=cases_in(["float32"], "self_attention"), strategies=[STANDARD])
    assert result.exit_status == 1
    (bad_run,) = [run for run in result.runs if run.label == "fake-noscale"]
    assert bad_run.status is Status.DISAGREE
    assert bad_run.divergence.stage == "scores"
    (pair,) = result.pairs
    assert pair.status is Status.DISAGREE
    assert pair.divergence.stage == "scores"
    text = render_plain(report_blocks(result), summary_lines(result))
    assert "first divergent stage scores" in text
    assert "FAIL" in text


def test_a_mistake_that_agrees_is_a_failure():
    # With one token per sequence the direct reshape happens to be right: the check must say
    # so loudly instead of counting it as caught.
    one_token = replace(SPEC_CASES["self_attention"], name="one_token", q_tokens=1, batch=2)
    result = run_check(backends=[good()], cases=[replace(one_token, dtypes=("float64",))])
    statuses = {run.label: run.status for run in result.runs}
    assert statuses == {"fake-good": Status.AGREE, "fake-good:direct_reshape": Status.MISSED}
    assert [p.status for p in result.pairs] == [Status.MISSED]
    assert result.exit_status == 1


def test_a_mistake_that_cancels_out_in_the_output_is_caught_at_its_stage():
    # With one kv head and no mask, a direct reshape undone the same way gives the right
    # output (every query chunk meets the same keys); q_heads still shows the mistake.
    undone = FakeBackend("fake-undone", mistake_split="direct_undone")
    result = run_check(backends=[undone], cases=cases_in(["float64"], "mqa", "gqa"))
    runs = {(run.case, run.label): run for run in result.runs}
    mqa = runs[("mqa", "fake-undone:direct_reshape")]
    assert mqa.status is Status.CAUGHT
    assert mqa.max_abs < 1e-12  # the output really agrees
    assert mqa.divergence.stage == "q_heads"
    assert mqa.reason == "the output happens to agree on this case; the mistake shows at stage q_heads"
    gqa = runs[("gqa", "fake-undone:direct_reshape")]
    assert gqa.status is Status.CAUGHT and gqa.max_abs > 0.1  # with two kv heads the output is wrong too
    pair = next(p for p in result.pairs if p.case == "mqa")
    assert pair.status is Status.CAUGHT and pair.reason.startswith("outputs agree; fake-undone:direct_reshape")
    assert result.exit_status == 0
    # Hiding the stages leaves nothing to see: then the check must say it missed the mistake.
    hidden = FakeBackend(
        "fake-fused",
        mistake_split="direct_undone",
        hide_stages=(
            "q_heads",
            "k_heads",
            "v_heads",
            "q_rotated",
            "k_rotated",
            "scores",
            "masked_scores",
            "weights",
            "context",
            "merged",
        ),
    )
    result = run_check(backends=[hidden], cases=cases_in(["float64"], "mqa"))
    assert [run.status for run in result.runs] == [Status.AGREE, Status.MISSED]
    assert result.exit_status == 1


def test_an_error_is_reported_and_the_rest_goes_on():
    result = run_check(
        backends=[FakeBackend("fake-broken", fail=True), good()], cases=cases_in(["float64"], "self_attention", "gqa")
    )
    errors = result.errors()
    assert len(errors) == 4  # two strategies on two cases
    assert all(run.reason == "RuntimeError: the fake kernel exploded" for run in errors)
    assert {run.status for run in result.runs if run.impl.backend == "fake-good"} == {Status.AGREE, Status.CAUGHT}
    assert result.exit_status == 2


def test_unsupported_cases_and_dtypes_are_reasons_not_failures():
    limited = good("fake-mha", unsupported_gqa=True)
    cases = cases_in(["float32", "bfloat16"], "gqa", "self_attention")
    result = run_check(backends=[limited], cases=cases, strategies=[STANDARD])
    reasons = {(run.case, run.dtype): (run.status, run.reason) for run in result.runs}
    assert reasons[("gqa", "float32")] == (Status.UNSUPPORTED, "fake-mha has no grouped kv heads")
    assert reasons[("self_attention", "bfloat16")] == (Status.UNSUPPORTED, "fake-mha does not support bfloat16")
    assert reasons[("self_attention", "float32")][0] is Status.AGREE
    assert result.exit_status == 0


def test_nan_for_empty_rows_is_a_named_known_difference_for_oracles_only():
    library = FakeBackend("fake-library", kind="oracle", empty_rows="nan")
    ours = FakeBackend("fake-ours", empty_rows="nan")
    for backend in (library, ours):
        backend.strategies = (STANDARD,)
    result = run_check(backends=[good(), library, ours], cases=cases_in(["float64"], "fully_masked_row", "padding"))
    runs = {(run.case, run.label): run for run in result.runs}
    known = runs[("fully_masked_row", "fake-library")]
    assert known.status is Status.KNOWN_DIFFERENCE
    assert known.reason.startswith("a query row with no allowed key gives NaN")
    assert "(2 such row(s))" in known.reason
    assert known.max_abs < 1e-12  # measured on the rows that may attend somewhere
    # Our own implementations must follow the spec: the same NaN is a disagreement.
    assert runs[("fully_masked_row", "fake-ours")].status is Status.DISAGREE
    assert runs[("fully_masked_row", "fake-ours")].divergence.stage == "weights"
    # Where no row is empty there is nothing to excuse.
    assert runs[("padding", "fake-library")].status is Status.AGREE
    pairs = {(p.a.label, p.b.label): p for p in result.pairs if p.case == "fully_masked_row"}
    assert pairs[("fake-good", "fake-library")].status is Status.KNOWN_DIFFERENCE
    assert pairs[("fake-library", "fake-ours")].status is Status.AGREE  # NaN equals NaN
    assert result.exit_status == 1  # because of fake-ours
    text = render_plain(report_blocks(result), summary_lines(result))
    assert "Known differences" in text and "fake-library" in text


def test_an_adapter_mapped_difference_is_named_not_passed_as_agree():
    mapped = FakeBackend("fake-mapped", kind="oracle", info={"empty_rows_mapped": 2})
    mapped.strategies = (STANDARD,)
    mapped.known_differences = ("rows with no allowed key: a uniform average; mapped to the spec's b_o",)
    result = run_check(backends=[mapped, good()], cases=cases_in(["float32"], "fully_masked_row"))
    run = next(run for run in result.runs if run.label == "fake-mapped")
    assert run.status is Status.KNOWN_DIFFERENCE
    assert run.reason.startswith("2 query row(s) with no allowed key")
    assert result.exit_status == 0
    assert result.declared_differences == {"fake-mapped": mapped.known_differences}
    assert to_json(result)["declared_differences"] == {"fake-mapped": list(mapped.known_differences)}
    text = render_plain(report_blocks(result), summary_lines(result))
    assert "as each adapter declares them" in text and "a uniform average; mapped" in text


def test_missing_library_is_skipped_with_the_install_hint(monkeypatch):
    from mha_rosetta import backends

    monkeypatch.setitem(
        backends.REGISTRY, "fake-missing", backends.BackendEntry("nowhere", "Nothing", ("no_such_module_xyz",), "fake")
    )
    result = run_check(backends=["fake-missing"], cases=["self_attention"])
    assert "pip install 'mha-rosetta[fake]'" in result.skipped_backends["fake-missing"]
    assert result.nothing_checked and result.exit_status == 2


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("backends", "nosuch", "unknown backend 'nosuch'"),
        ("dtypes", "float8", "dtype must be one of"),
        ("devices", "tpu", "device must be one of"),
        ("cases", "nosuch", "unknown case(s) 'nosuch'"),
        ("strategies", "sideways", "unknown strategy 'sideways'"),
    ],
)
def test_bad_options_name_the_option_and_the_accepted_values(option, value, message):
    with pytest.raises(ValueError, match=option if option != "cases" else "known cases") as info:
        run_check(**{"backends": [good()], option: value})
    assert message in str(info.value)


def test_one_facade_runs_every_kind_and_the_old_names_are_its_deprecated_aliases():
    from mha_rosetta.checks import CHECKS, run_decode_check, run_grad_check

    assert list(CHECKS) == ["forward", "grad", "decode"]
    options = {"backends": ["numpy"], "dtypes": ["float64"], "strategies": [STANDARD]}
    for kind, case, old in (("grad", "self_attention", run_grad_check), ("decode", "gqa_rotary", run_decode_check)):
        result = run_check(cases=[case], kind=kind, **options)
        assert type(result).__name__ == {"grad": "GradCheckResult", "decode": "DecodeCheckResult"}[kind]
        assert result.runs and all(run.status is Status.AGREE for run in result.runs), result.runs
        with pytest.warns(
            DeprecationWarning, match=rf"{old.__name__} is deprecated: use run_check\(\.\.\., kind='{kind}'\)"
        ):
            again = old(cases=[case], **options)
        assert [(r.label, r.case, r.dtype, r.status) for r in again.runs] == [
            (r.label, r.case, r.dtype, r.status) for r in result.runs
        ]
    forward = run_check(cases=["self_attention"], **options)
    assert type(forward).__name__ == "CheckResult" and forward.exit_status == 0
    with pytest.raises(ValueError, match="kind: expected one of forward, grad, decode; got 'backward'"):
        run_check(kind="backward")
    with pytest.raises(ValueError, match="self_attention"):  # a decode check takes decode cases only
        run_check(cases=["self_attention"], kind="decode", **options)


def test_case_dtypes_limit_what_runs_unless_all_are_asked_for():
    cases = ["self_attention", "no_bias"]
    assert SPEC_CASES["self_attention"].dtypes == ("float64", "bfloat16")
    assert SPEC_CASES["no_bias"].dtypes == ("float32",)
    result = run_check(backends=[good()], cases=cases, strategies=[STANDARD])
    ran = [(run.case, run.dtype, run.status) for run in result.runs]
    assert ran == [
        ("self_attention", "float64", Status.AGREE),
        ("self_attention", "bfloat16", Status.UNSUPPORTED),  # the fake has no bfloat16
        ("no_bias", "float32", Status.AGREE),
    ]
    explicit = run_check(backends=[good()], cases=cases, strategies=[STANDARD], dtypes="float32,float64")
    assert [(run.case, run.dtype) for run in explicit.runs] == [("self_attention", "float64"), ("no_bias", "float32")]
    everything = run_check(backends=[good()], cases=cases, strategies=[STANDARD], dtypes="all")
    assert len(everything.runs) == 2 * 4
    assert everything.settings["dtypes"] == "all"


def test_spec_cases_have_distinct_sizes_and_the_features_they_claim():
    for case in get_cases():
        cfg = case.cfg
        sizes = [case.q_tokens, cfg.d_model, cfg.n_heads, cfg.d_k]
        sizes += [case.batch] if case.batch else []
        assert len(set(sizes)) == len(sizes), case.name
    cases = SPEC_CASES
    assert (
        cases["cross_attention"].cfg.kdim != cases["cross_attention"].cfg.vdim != cases["cross_attention"].cfg.d_model
    )
    assert cases["cross_attention"].kv_tokens != cases["cross_attention"].q_tokens
    assert cases["gqa"].cfg.n_kv_heads not in (1, cases["gqa"].cfg.n_heads)
    assert cases["mqa"].cfg.n_kv_heads == 1
    assert cases["dv_ne_dk"].cfg.d_v != cases["dv_ne_dk"].cfg.d_k
    assert cases["unbatched"].inputs().query.ndim == 2
    assert cases["padding"].inputs().mask.shape == (4, 1, 1 * 8, 8)
    assert cases["padding"].inputs().mask[3, 0, 0].tolist() == [True] + [False] * 7
    assert cases["fully_masked_row"].empty_rows().sum() == 2
    assert not cases["causal_padding"].empty_rows().any()  # causal + padding still leaves key 0
    for name in ("cross_attention", "gqa", "causal_padding"):
        assert "float16" in cases[name].dtypes
    for dtype in ("float64", "float32", "float16", "bfloat16"):  # every dtype runs on at least two cases
        assert sum(dtype in case.dtypes for case in cases.values()) >= 2, dtype


# -- the report -------------------------------------------------------------------------------
def test_matrix_cells_are_the_worst_over_cases():
    cases = cases_in(["float16"], "self_attention", "gqa")
    result = run_check(backends=[good("fake-a"), good("fake-b")], cases=cases)
    (matrix,) = build_matrices(result)
    assert matrix.labels == ["fake-a", "fake-a:direct_reshape", "fake-b", "fake-b:direct_reshape"]
    pairs = [p for p in result.pairs if {p.a.label, p.b.label} == {"fake-a", "fake-b:direct_reshape"}]
    assert len(pairs) == 2
    cell = matrix.cells[("fake-a", "fake-b:direct_reshape")]
    assert cell is matrix.cells[("fake-b:direct_reshape", "fake-a")]
    assert cell.max_abs == max(p.max_abs for p in pairs)
    assert cell.status is Status.CAUGHT
    assert matrix.oracle["fake-a"].status is Status.AGREE
    per_case = build_matrices(result, per_case=True)
    assert sorted(m.case for m in per_case) == ["gqa", "self_attention"]


def test_json_shape():
    result = run_check(
        backends=[good(), FakeBackend("fake-broken", fail=True)], cases=cases_in(["float32"], "self_attention")
    )
    data = json.loads(json.dumps(to_json(result)))  # plain JSON all the way down
    assert data["schema"] == SCHEMA_VERSION
    assert data["exit_status"] == 2
    assert data["settings"]["cases"] == ["self_attention"]
    assert data["summary"]["runs"] == {"agree": 1, "caught": 1, "error": 2}
    assert data["summary"]["pairs"] == {"caught": 1}
    run = next(r for r in data["runs"] if r["implementation"] == "fake-good:direct_reshape")
    assert run["status"] == "caught" and run["known_mistake"] is True
    assert run["first_divergence"]["stage"] == "q_heads"
    assert run["tolerance"] == {"atol": 2e-5, "rtol": 2e-4}
    (matrix,) = data["matrices"]
    assert matrix["labels"] == ["fake-good", "fake-good:direct_reshape"]
    assert matrix["status"] == [[None, "caught"], ["caught", None]]
    assert matrix["max_abs"][0][1] == matrix["max_abs"][1][0] > 0.01
    assert data["cases"][0]["config"]["d_model"] == 15


def test_markdown_has_the_matrix_and_the_summary():
    result = run_check(backends=[good()], cases=cases_in(["float64"], "self_attention"))
    text = render_markdown(report_blocks(result), summary_lines(result))
    assert "| # | implementation | oracle abs | oracle rel | 1 | 2 |" in text
    assert "## Summary" in text and "exit status 0" in text


# -- the command line -------------------------------------------------------------------------
def test_cli_exit_codes_and_atomic_json(tmp_path, monkeypatch, capsys):
    from mha_rosetta.checks import selection

    path = tmp_path / "check.json"
    fakes = {
        "good": [good()],
        "wrong": [good(), FakeBackend("fake-noscale", scale=1.0)],
        "broken": [FakeBackend("x", fail=True)],
    }
    real_resolve = selection.resolve_backends
    monkeypatch.setattr(
        selection,
        "resolve_backends",
        lambda names: (fakes[names[0]], {}, {}) if names and names[0] in fakes else real_resolve(names),
    )
    argv = ["check", "--cases", "self_attention", "--dtypes", "float64", "--plain"]
    assert main([*argv, "--backends", "good", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["exit_status"] == 0
    assert main([*argv, "--backends", "wrong", "--quiet"]) == 1
    assert "Problems against the oracle" in capsys.readouterr().out
    assert main([*argv, "--backends", "broken", "--json", str(path)]) == 2
    assert json.loads(path.read_text())["exit_status"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["check.json"]  # no temporary file left behind
    assert main(["check", "--dtypes", "float8"]) == 2
    assert "dtypes: dtype must be one of" in capsys.readouterr().err


def test_cli_json_to_stdout_keeps_stdout_pure(monkeypatch, capsys):
    from mha_rosetta.checks import selection

    monkeypatch.setattr(selection, "resolve_backends", lambda names: ([good()], {}, {}))
    assert main(["check", "--cases", "self_attention", "--dtypes", "float64", "--json", "-", "--plain"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["summary"]["runs"] == {"agree": 1, "caught": 1}
    assert "agreement matrix" in captured.err


def test_an_adapter_that_fails_to_load_is_an_error_not_a_crash(monkeypatch):
    from mha_rosetta import backends

    monkeypatch.setitem(
        backends.REGISTRY, "fake-broken-module", backends.BackendEntry("no_such_adapter", "Nothing", ("numpy",), "test")
    )
    result = run_check(backends=["fake-broken-module", good()], cases=cases_in(["float64"], "self_attention"))
    assert result.broken_backends["fake-broken-module"].startswith("the adapter failed to load: ModuleNotFoundError")
    assert {run.status for run in result.runs} == {Status.AGREE, Status.CAUGHT}
    assert result.exit_status == 2


class InterruptingBackend(FakeBackend):
    """Ctrl-C arrives while this backend runs a GQA case."""

    def _prepare(self, cfg, *args):
        if cfg.n_kv_heads != cfg.n_heads:
            raise KeyboardInterrupt
        return super()._prepare(cfg, *args)


def test_ctrl_c_keeps_finished_results_and_exits_130(tmp_path, monkeypatch):
    from mha_rosetta.checks import selection

    cases = cases_in(["float64"], "self_attention", "gqa")
    result = run_check(backends=[good(), InterruptingBackend("fake-ctrl-c")], cases=cases)
    assert result.interrupted
    # The finished case is kept whole; the interrupted one is dropped, not half-reported.
    assert {run.case for run in result.runs} == {"self_attention"}
    assert len(result.runs) == 4 and all(run.compared for run in result.runs)
    path = tmp_path / "partial.json"
    monkeypatch.setattr(selection, "resolve_backends", lambda names: ([good(), InterruptingBackend("x")], {}, {}))
    assert (
        # --jobs 0: the fake's KeyboardInterrupt stands for Ctrl-C only in this process (in a worker it is a crash)
        main(
            [
                "check",
                "--cases",
                "self_attention,gqa",
                "--dtypes",
                "float64,float16",
                "--json",
                str(path),
                "--plain",
                "--jobs",
                "0",
            ]
        )
        == 130
    )
    data = json.loads(path.read_text())
    assert data["interrupted"] is True and data["exit_status"] == 130
    assert {run["case"] for run in data["runs"]} == {"self_attention"}


def test_cli_list_names_every_case(capsys):
    assert main(["check", "--list"]) == 0
    out = capsys.readouterr().out
    for name in SPEC_CASES:
        assert name in out


def test_importing_the_checks_imports_no_framework():
    import subprocess
    import sys

    code = (
        "import sys, mha_rosetta.checks, mha_rosetta.checks.report, mha_rosetta.cli.check; "
        "print(sorted(m for m in ('torch', 'jax', 'flax', 'equinox', 'einops', 'rich') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_report_fits_120_columns_and_markdown_keeps_the_whole_matrix(monkeypatch, capsys):
    """Forty implementations make a matrix far wider than a terminal: the text splits it, Markdown does not."""
    from mha_rosetta.checks.report import print_rich, rich_available

    backends = [good(f"fake-impl-{i:02d}") for i in range(40)]
    result = run_check(backends=backends, cases=cases_in(["float32"], "self_attention"), strategies=[STANDARD])
    blocks, summary = report_blocks(result), summary_lines(result)
    wide = render_plain(blocks, summary)  # no width: every line as long as it needs
    assert max(len(line) for line in wide.splitlines()) > 120
    text = render_plain(blocks, summary, width=120)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "(part 1 of " in text and "(part 2 of " in text
    for i in range(40):  # every row label and every column number is still there
        assert f"fake-impl-{i:02d}" in text
    header = [line for line in text.splitlines() if line.startswith("#  ")]
    assert sorted({int(c) for line in header for c in line.split() if c.isdigit()}) == list(range(1, 41))
    markdown = render_markdown(blocks, summary)
    matrix_header = next(line for line in markdown.splitlines() if line.startswith("| # | implementation"))
    assert matrix_header.count("|") == 4 + 40 + 1  # one table, all 40 columns
    if rich_available():
        monkeypatch.setenv("COLUMNS", "120")
        print_rich(blocks, summary)
        printed = capsys.readouterr().out
        assert max(len(line) for line in printed.splitlines()) <= 120
        assert "fake-impl-39" in printed


def test_a_wide_matrix_splits_into_parts_that_keep_the_row_labels():
    from mha_rosetta.core.tables import Table
    from mha_rosetta.core.tables import render_plain as render_tables

    numbers = [str(i + 1) for i in range(20)]
    rows = [[str(i + 1), f"implementation-{i:02d}", *("3e-07~" for _ in numbers)] for i in range(20)]
    matrix = Table("matrix", ["#", "implementation", *numbers], rows, notes=["legend " * 30], key_columns=2)
    text = render_tables([matrix], width=120)
    assert max(len(line) for line in text.splitlines()) <= 120
    parts = [line for line in text.splitlines() if line.startswith("matrix (part ")]
    assert len(parts) == 2  # 2 + 20 columns of 8 characters: two parts of 120 columns
    assert text.count("implementation-19") == 2 and text.count("3e-07~") == 20 * 20
    assert render_tables([matrix]).splitlines()[1].split()[-1] == "20"  # no width: one line per row


def test_text_columns_wrap_but_never_narrower_than_their_header():
    """The explainer's backend table with one backend: a 30-character header beside 55- and 109-character cells
    used to get a 20-character limit, so the header widened its column past the width."""
    from mha_rosetta.core.tables import Table, plain_lines

    headers = ["backend", "samples", "where the weights' scorers are", "convention"]
    row = ["numpy", "column samples: features x tokens, one token per column", "rows of W " * 6, "words " * 18]
    lines = plain_lines(Table("", headers, [row]), width=100)
    assert max(map(len, lines)) <= 100
    assert "where the weights' scorers are" in lines[0]  # the header on one line
    text = " ".join(" ".join(line.split()) for line in lines[2:])
    assert text.count("W") == 6 and text.count("words") == 18  # nothing lost to the wrapping
