"""`diagnose_decode`: the decode simulator equals the full causal forward, each decode mistake is what it claims
(hand-computed cases and exact identities), each is diagnosed as itself ranked first, and bad candidates are errors.

The independent candidate is `examples/my_decode.py` (a torch static cache, written apart from the simulator).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import load_example, requires, run_cli
from mha_rosetta.checks.agreement import backend_level
from mha_rosetta.core import MHAConfig, MHAParams, init_params, reference_mha
from mha_rosetta.core.decode import reference_decode
from mha_rosetta.diagnose import DECODE_CAUSE_CODES, DecodeBug, DiagnoseError, diagnose_decode, simulate_decode
from mha_rosetta.diagnose.decode import decode_hypotheses, make_decode_probes, probe_tokens

ROOT = Path(__file__).resolve().parents[1]
GQA_HALF = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half")
PARTIAL_INTERLEAVED = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="interleaved", rope_dims=2)
WINDOW = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", window=3)
CONFIGS = {
    "gqa rope half": GQA_HALF,
    "gqa partial interleaved": PARTIAL_INTERLEAVED,
    "window 3": WINDOW,
    "qk-norm softcap sinks window": MHAConfig(
        d_model=16, n_heads=4, causal=True, rope="half", window=3, softcap=5.0, qk_norm="head", sinks=True
    ),
    "qk-norm projection, yarn": MHAConfig(
        d_model=16,
        n_heads=4,
        n_kv_heads=2,
        causal=True,
        rope="half",
        qk_norm="projection",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    ),
    "alibi window": MHAConfig(d_model=16, n_heads=4, causal=True, alibi=True, window=4),
    "t5 buckets": MHAConfig(d_model=16, n_heads=4, causal=True, rel_buckets=8, rel_max_distance=5),
}
N = 11


def _run(cfg, bug: DecodeBug | None = None):
    """The simulated mistake as a candidate, in the candidate's signature."""

    bug = DecodeBug() if bug is None else bug

    def candidate(params, x, prefill, step, mask, positions):
        return simulate_decode(cfg, params, x, prefill=prefill, step=step, mask=mask, positions=positions, bug=bug)

    return candidate


def _padded(kind: str) -> np.ndarray:
    mask = np.ones((2, N), dtype=bool)
    if kind == "left":
        mask[0, :3] = False
    else:
        mask[1, -2:] = False
    return mask


# -- the simulator without a mistake is the oracle ----------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_the_simulator_without_a_mistake_equals_the_full_causal_forward(name):
    cfg = CONFIGS[name]
    params = init_params(cfg, seed=1)
    x = np.random.default_rng(2).standard_normal((2, N, cfg.d_model))
    ring = 3 - 1 + 1  # window 3, one token per step: a prefill of 6 is longer than the ring, 2 shorter
    splits = [(1, 1), (2, 1), (3, 2), (6, 1), (6, 3), (N, 1)]
    assert any(p > ring for p, _ in splits) and any(p < ring for p, _ in splits)
    masks = [None, _padded("left")] + ([] if cfg.window is not None else [_padded("right")])
    for prefill, step in splits:
        for mask in masks:
            got = simulate_decode(cfg, params, x, prefill=prefill, step=step, mask=mask)
            want = reference_decode(cfg, params, x, prefill=prefill, step=step, mask=mask)
            rows = np.ones((2, N), bool) if mask is None else mask
            assert np.abs(got - want)[rows].max() < 1e-12, (prefill, step, mask)
            # Pads are the spec's empty rows too (left pads at position -1 see nothing: output b_o).
            np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)


def test_the_simulator_takes_an_unbatched_sequence_and_refuses_a_ring_mistake_without_a_window():
    params = init_params(GQA_HALF, seed=1)
    x = np.random.default_rng(3).standard_normal((5, 16))
    out = simulate_decode(GQA_HALF, params, x, prefill=2, step=2)
    assert out.shape == (5, 16)
    np.testing.assert_allclose(out, reference_decode(GQA_HALF, params, x, prefill=2), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"bug.ring_off_by needs a window \(cfg.window\)"):
        simulate_decode(GQA_HALF, params, x, prefill=2, bug=DecodeBug(ring_off_by=1))
    with pytest.raises(ValueError, match="prefill must be between 1 and the sequence's 5 tokens, got 0"):
        simulate_decode(GQA_HALF, params, x, prefill=0)
    with pytest.raises(TypeError, match="bug must be a DecodeBug, got str"):
        simulate_decode(GQA_HALF, params, x, prefill=1, bug="top-left")


# -- each mistake computes what it says (hand-computed) ----------------------------------------
# One head, d_model 2, no bias, w_v = w_o = I: each output is the weighted mean of the visible tokens' x; with
# w_q = 0 every score is 0, so the weights are uniform over what a query sees (or what a mistake adds).
PLAIN = MHAConfig(d_model=2, n_heads=1, causal=True, bias=False)
UNIFORM = MHAParams(w_q=np.zeros((2, 2)), w_k=np.eye(2), w_v=np.eye(2), w_o=np.eye(2))
X = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0], [5.0, 0.0], [0.0, 6.0]])  # (6, 2)


def _means(rows: list[list[int]], divisors: list[int] | None = None) -> np.ndarray:
    divisors = divisors or [len(r) for r in rows]
    return np.stack([X[r].sum(axis=0) / d for r, d in zip(rows, divisors, strict=True)])


def test_top_left_on_a_two_token_step_shows_the_first_query_only_the_oldest_slot():
    out = simulate_decode(PLAIN, UNIFORM, X, prefill=2, step=2, bug=DecodeBug(top_left_causal="multi"))
    # prefill 0, 1 right; step (2, 3): query 2 sees slot 0, query 3 slots 0, 1; step (4, 5): slots 0 / 0, 1.
    np.testing.assert_allclose(out, _means([[0], [0, 1], [0], [0, 1], [0], [0, 1]]), atol=1e-15, rtol=0)
    # A single-query step is unaffected by the multi-query mistake, and sees only slot 0 under "every".
    one = simulate_decode(PLAIN, UNIFORM, X, prefill=2, step=1, bug=DecodeBug(top_left_causal="multi"))
    np.testing.assert_allclose(one, reference_decode(PLAIN, UNIFORM, X, prefill=2), atol=1e-15, rtol=0)
    every = simulate_decode(PLAIN, UNIFORM, X, prefill=2, step=1, bug=DecodeBug(top_left_causal="every"))
    np.testing.assert_allclose(every, _means([[0], [0, 1], [0], [0], [0], [0]]), atol=1e-15, rtol=0)


def test_empty_static_slots_add_zero_values_to_every_softmax():
    out = simulate_decode(PLAIN, UNIFORM, X, prefill=2, step=1, bug=DecodeBug(empty_slots_attended=True))
    # A static cache of 6 slots: a query's uniform weights spread over what it sees and the unwritten slots (0 each).
    # The prefill's query 0 sees slot 0 and the 4 unwritten ones (slot 1 is written, and causally hidden): 1/5.
    rows = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], list(range(6))]
    np.testing.assert_allclose(out, _means(rows, [5, 6, 6, 6, 6, 6]), atol=1e-15, rtol=0)


def test_a_ring_off_by_one_shows_a_step_one_key_more_or_less_and_leaves_the_prefill_alone():
    cfg = replace(PLAIN, window=2)
    more = simulate_decode(cfg, UNIFORM, X, prefill=2, step=1, bug=DecodeBug(ring_off_by=1))
    np.testing.assert_allclose(more, _means([[0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5]]), atol=1e-15)
    less = simulate_decode(cfg, UNIFORM, X, prefill=2, step=1, bug=DecodeBug(ring_off_by=-1))
    np.testing.assert_allclose(less, _means([[0], [0, 1], [2], [3], [4], [5]]), atol=1e-15)
    right = simulate_decode(cfg, UNIFORM, X, prefill=2, step=1)
    np.testing.assert_allclose(right, _means([[0], [0, 1], [1, 2], [2, 3], [3, 4], [4, 5]]), atol=1e-15)


def test_keys_rotated_twice_are_keys_at_twice_their_positions():
    params = init_params(GQA_HALF, seed=4)
    x = np.random.default_rng(5).standard_normal((2, N, 16))
    out = simulate_decode(GQA_HALF, params, x, prefill=N, bug=DecodeBug(rotated_twice=True))
    p = np.arange(N)
    # R(p) R(p) = R(2p): the forward with the keys rotated at positions 2p, causality kept on the true positions
    # (an explicit lower-triangular mask on a non-causal configuration).
    tril = np.tril(np.ones((N, N), dtype=bool))
    want = reference_mha(replace(GQA_HALF, causal=False), params, x, mask=tril, positions=p, kv_positions=2 * p)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    assert np.abs(out - reference_decode(GQA_HALF, params, x, prefill=N)).max() > 0.1  # not the spec


def test_positions_not_offset_rotate_every_single_token_step_at_position_0():
    params = init_params(GQA_HALF, seed=4)
    x = np.random.default_rng(6).standard_normal((2, N, 16))
    out = simulate_decode(GQA_HALF, params, x, prefill=1, step=1, bug=DecodeBug(positions_not_offset=True))
    # Every token rotated by angle 0: the forward without rotary.
    np.testing.assert_allclose(
        out, reference_mha(replace(GQA_HALF, rope=None, rope_dims=None), params, x), atol=1e-12, rtol=0
    )


# -- the diagnosis ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS)
def test_each_simulated_mistake_is_diagnosed_as_itself_ranked_first(name):
    cfg = CONFIGS[name]
    hypotheses = decode_hypotheses(cfg)
    expected = {"decode_top_left_causal", "decode_empty_slots_attended"}
    expected |= {"decode_positions_not_offset", "decode_rotated_twice"} if cfg.rope else set()
    expected |= {"decode_ring_off_by_one"} if cfg.window else set()
    assert {h.code for h in hypotheses} == expected
    for h in hypotheses:
        result = diagnose_decode(_run(cfg, h.bug), cfg)
        assert not result.agrees and result.max_error > 1e-3, h.label
        first = result.causes[0]
        assert (first.code, first.detail) == (h.code, h.detail), (h.label, result.summary())
        assert first.residual <= 1.0
        assert first.code in DECODE_CAUSE_CODES
        assert len(result.causes) == 1  # the probes separate the mistakes: no other explains every probe


def test_a_window_of_one_key_hides_every_mistake_but_the_ring_and_blames_nothing_else():
    cfg = replace(WINDOW, window=1)  # each query sees only itself: cached keys never matter
    assert [h.detail for h in decode_hypotheses(cfg) if h.code == "decode_ring_off_by_one"] == [
        "the ring keeps one slot more: a step sees the last 2 keys where the window holds 1"
    ]
    for h in decode_hypotheses(cfg):
        result = diagnose_decode(_run(cfg, h.bug), cfg)
        assert result.agrees == (h.code != "decode_ring_off_by_one"), h.label


def test_the_oracle_agrees_and_reports_every_probe():
    result = diagnose_decode(_run(WINDOW), WINDOW)
    assert result.agrees and result.causes == [] and result.max_error < 1e-12
    assert list(result.probe_errors) == [
        "one token per step", "two tokens per step", "prefill only", "left-padded batch", "prefill past the ring",
    ]  # fmt: skip
    probes = make_decode_probes(WINDOW)
    assert probe_tokens(WINDOW) == 2 * (3 + 2) + 3 == probes[0].x.shape[1]  # the ring outgrown twice
    assert [(p.prefill, p.step) for p in probes] == [(1, 1), (3, 2), (13, 1), (3, 2), (5, 1)]
    assert probes[3].positions[0].tolist() == [-1, -1, *range(11)]  # left pads at -1 (cumsum - 1)


def test_two_mistakes_at_once_are_named_together():
    bug = DecodeBug(top_left_causal="multi", rotated_twice=True)
    result = diagnose_decode(_run(GQA_HALF, bug), GQA_HALF)
    assert {c.code for c in result.causes} == {"decode_top_left_causal", "decode_rotated_twice"}
    assert any("together do" in note for note in result.notes)


def test_a_forward_error_is_no_decode_mistake_and_the_note_says_so():
    def wrong_scale(params, x, prefill, step, mask, positions):  # the forward's mistake: w_q doubled
        doubled = replace(params, w_q=2 * params.w_q)
        return simulate_decode(GQA_HALF, doubled, x, prefill=prefill, step=step, mask=mask, positions=positions)

    result = diagnose_decode(wrong_scale, GQA_HALF)
    assert not result.agrees
    assert any("no decode mistake (nor any pair) explains every probe" in note for note in result.notes)
    assert any("already disagrees on probe 'prefill only', which has no decode step" in note for note in result.notes)


def test_one_token_per_step_cannot_show_top_left_and_says_so():
    result = diagnose_decode(_run(GQA_HALF, DecodeBug(top_left_causal="multi")), GQA_HALF, step=1)
    assert result.agrees  # a single-query step is unaffected
    assert any("top-left causality on steps of more than one query cannot be seen" in n for n in result.notes)
    assert next(iter(result.probe_errors)) == "prefill 1, step 1"
    # With step 2 given, every probe steps two tokens and the mistake shows.
    shown = diagnose_decode(_run(GQA_HALF, DecodeBug(top_left_causal="multi")), GQA_HALF, step=2, prefill=3)
    assert shown.causes[0].code == "decode_top_left_causal"
    assert list(shown.probe_errors) == ["prefill 3, step 2", "prefill 3, step 2, left-padded"]


def test_float32_candidate_is_scored_with_the_float32_tolerance():
    def f32(params, x, prefill, step, mask, positions):
        return simulate_decode(GQA_HALF, params, x, prefill=prefill, step=step, mask=mask, positions=positions).astype(
            np.float32
        )

    result = diagnose_decode(f32, GQA_HALF, dtype="float32")
    assert result.agrees and result.dtype == "float32" and 1e-9 < result.max_error < 1e-5


# -- bad candidates and bad input ---------------------------------------------------------------
def test_a_bad_candidate_is_a_diagnose_error_naming_the_probe():
    def raises(params, x, prefill, step, mask, positions):
        raise RuntimeError("cache full")

    with pytest.raises(
        DiagnoseError, match="the candidate raised RuntimeError: cache full on probe 'one token per step'"
    ):
        diagnose_decode(raises, GQA_HALF)

    def last_token_only(params, x, prefill, step, mask, positions):
        return x[:, -1:]

    with pytest.raises(DiagnoseError, match=r"returned shape \(2, 1, 16\) on probe 'one token per step'; expected "):
        diagnose_decode(last_token_only, GQA_HALF)

    def pair(params, x, prefill, step, mask, positions):
        return x, None

    with pytest.raises(DiagnoseError, match="returned a tuple on probe 'one token per step'"):
        diagnose_decode(pair, GQA_HALF)

    def nan(params, x, prefill, step, mask, positions):
        return np.full_like(x, np.nan)

    with pytest.raises(DiagnoseError, match="NaN or inf everywhere on probe 'one token per step'"):
        diagnose_decode(nan, GQA_HALF)


def test_a_hanging_candidate_times_out():
    def hangs(params, x, prefill, step, mask, positions):
        time.sleep(30)

    start = time.monotonic()
    with pytest.raises(DiagnoseError, match=r"did not return within 0.2 s on probe 'one token per step'"):
        diagnose_decode(hangs, GQA_HALF, timeout=0.2)
    assert time.monotonic() - start < 10


def test_bad_arguments_name_the_rule():
    with pytest.raises(ValueError, match=r"needs a causal configuration .* got causal=False"):
        diagnose_decode(_run(GQA_HALF), replace(GQA_HALF, causal=False))
    with pytest.raises(TypeError, match=r"candidate must be callable as candidate\(params, x, prefill, step, mask"):
        diagnose_decode("not a function", GQA_HALF)
    with pytest.raises(ValueError, match=r"step must be a positive int \(or None: the probes choose\), got 0"):
        diagnose_decode(_run(GQA_HALF), GQA_HALF, step=0)
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got -1"):
        diagnose_decode(_run(GQA_HALF), GQA_HALF, timeout=-1)


# -- an independent candidate (torch) and the command line -------------------------------------
@requires("torch")
def test_the_torch_example_is_diagnosed_top_left_and_its_fix_agrees():
    example = load_example("my_decode")
    candidate, fixed_candidate = example.candidate, example.fixed_candidate
    fixed = diagnose_decode(fixed_candidate, GQA_HALF)
    assert fixed.agrees and fixed.max_error < 1e-12
    result = diagnose_decode(candidate, GQA_HALF)
    assert [(c.code, c.detail) for c in result.causes] == [
        ("decode_top_left_causal", "is_causal=True (top-left) on steps of more than one query")
    ]
    assert result.probe_errors["one token per step"] < 1e-12 and result.probe_errors["two tokens per step"] > 0.1


SIZES = ("--d-model", "16", "--heads", "4", "--kv-heads", "2", "--rope", "half")


@requires("torch")
def test_the_command_line_diagnoses_a_decode_loop():
    done = run_cli("diagnose", "--decode", "examples.my_decode:candidate", *SIZES, "--json", "-", cwd=ROOT)
    assert done.returncode == 1, done.stderr
    payload = json.loads(done.stdout)
    assert payload["decode"] == {"prefill": None, "step": None}
    assert payload["causes"][0]["code"] == "decode_top_left_causal"
    assert "decode loop" in done.stderr  # the verdict goes to stderr when the JSON takes stdout
    fixed = run_cli("diagnose", "--decode", "examples.my_decode:fixed_candidate", *SIZES, "--step", "1", cwd=ROOT)
    assert fixed.returncode == 0, fixed.stderr
    assert "agrees with the oracle" in fixed.stdout and "give step >= 2 to test it" in fixed.stdout


def test_the_command_line_refuses_prefill_without_decode():
    done = run_cli("diagnose", "examples.my_attention:candidate", "--d-model", "12", "--heads", "3", "--step", "2",
                   cwd=ROOT)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "mha-rosetta diagnose: error: --prefill and --step need --decode (a decode loop)"


BAD_LOOPS = """
import os
import time


def hangs(params, x, prefill, step, mask, positions):
    time.sleep(60)


def exits(params, x, prefill, step, mask, positions):
    os._exit(3)
"""


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("hangs", "the candidate did not return within 1 s on probe 'one token per step' (time limit per probe)"),
        (
            "exits",
            "the candidate's process exited with status 3 on probe 'one token per step', without a result (a crash "
            "in the candidate)",
        ),
    ],
)
def test_the_command_line_contains_a_decode_loop_that_hangs_or_crashes(tmp_path, name, message):
    import os
    import subprocess

    (tmp_path / "bad_loops.py").write_text(BAD_LOOPS, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "mha_rosetta.cli.main", "diagnose", "--decode", f"bad_loops:{name}", *SIZES,
         "--timeout", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip() == f"mha-rosetta diagnose: error: {message}"


# -- every implementation's own decode path, diagnosed (each that has one; the rest skip with the reason) ---------
def _implementations() -> list[str]:
    from mha_rosetta.backends.entries import REGISTRY

    return [name for name, entry in REGISTRY.items() if entry.kind == "implementation"]


@pytest.mark.parametrize("cfg_name", ["gqa rope half", "window 3"])
@pytest.mark.parametrize("backend_name", _implementations())
def test_each_implementations_decode_path_is_diagnosed_as_agreeing(backend_name, cfg_name):
    from mha_rosetta.backends import BackendNotInstalled, get_backend
    from mha_rosetta.backends.base import STANDARD

    cfg = CONFIGS[cfg_name]
    try:
        backend = get_backend(backend_name)
    except BackendNotInstalled as error:
        pytest.skip(str(error))
    reason = backend.decode_reason(cfg, "float64", "cpu", STANDARD, None)
    if reason is not None:
        pytest.skip(reason)

    def candidate(params, x, prefill, step, mask, positions):
        return backend.run_decode(cfg, params, x, prefill=prefill, step=step, mask=mask, positions=positions,
                                  dtype="float64", device="cpu")  # fmt: skip

    result = diagnose_decode(candidate, cfg, dtype=backend_level(backend, "float64"))  # MLX declares float32's level
    assert result.agrees, result.summary()


def test_a_decode_path_through_run_decode_is_diagnosed_through_the_contract():
    """A backend whose decode path (the contract's hook) makes a mistake: named through run_decode."""
    from mha_rosetta.backends.base import Backend, PreparedDecode

    class RotatesTwice(Backend):
        decode_caches = ("dynamic",)
        decode_variants = frozenset({"window"})
        decode_layouts = {"dynamic": "(B, Hkv, T, Dk)"}  # noqa: RUF012 (the contract's ClassVar)

        def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
            def run():
                return simulate_decode(cfg, params, inputs.x, prefill=inputs.prefill, step=inputs.step,
                                       mask=inputs.mask, positions=inputs.positions,
                                       bug=DecodeBug(rotated_twice=True))  # fmt: skip

            return PreparedDecode(run=run, to_numpy=lambda result: result)

    backend = RotatesTwice(name="rotates-twice")

    def candidate(params, x, prefill, step, mask, positions):
        return backend.run_decode(WINDOW, params, x, prefill=prefill, step=step, mask=mask, positions=positions)

    result = diagnose_decode(candidate, WINDOW)
    assert [c.code for c in result.causes] == ["decode_rotated_twice"]
