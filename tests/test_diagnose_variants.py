"""`diagnose` and the variants: each variant's mistake named with its detail, only where the configuration has it.

The confusion table's test (`test_diagnose.py`) proves every injected bug, the variants' included, is
named first by its own code in the NumPy and torch candidates; here: the detail of each variant cause,
hand-computed values of the injected candidates' tables and of the repairs, the rule that a variant's
cause is never a hypothesis without its variant, and that every variant check case's correct
candidates (the oracle, the injected NumPy and torch ones, and each backend that declares the case's
variants) come back "agrees".
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest

from conftest import installed_backend, requires, run_cli
from mha_rosetta.backends import missing_backends
from mha_rosetta.backends.injected_torch import torch_alibi_slopes, unspelled
from mha_rosetta.checks.cases import SPEC_CASES
from mha_rosetta.core import MHAConfig, init_params, reference_mha
from mha_rosetta.core.variants.alibi import numpy_alibi_slopes
from mha_rosetta.diagnose import Bug, diagnose, hypotheses, repairs, simulate
from mha_rosetta.diagnose.calling import DiagnoseError
from mha_rosetta.diagnose.confusion import SETTINGS, VARIANT_SETTINGS
from mha_rosetta.diagnose.injected import VARIANT_BUGS, bugs_for, numpy_candidate, torch_candidate
from mha_rosetta.diagnose.simulate import unsimulated_reason

# Each variant bug's cause detail (the code is VARIANT_BUGS[bug][0]).
DETAILS = {
    "softcap after mask": "applied after the mask (a blocked score becomes -c, not -inf)",
    "softcap dropped": "not applied (the scores are not capped)",
    "window W+1": "4 keys where the window holds 3 (the query's own included)",
    "window wrong end": "counted from the wrong end: the 3 keys from the query's own forward (the causal mask leaves "
    "the diagonal)",
    "alibi power-of-two slopes": "slopes 2**(-8k/6) for 6 heads: the power-of-two formula",
    "alibi sign": "the sign flipped: m_h (p_i - p_j), past keys raised instead of lowered",
    "qk-norm per head": "over the head where the spec normalises over the projection",
    "qk-norm over projection": "over the projection where the spec normalises over the head",
    "sinks ignored": "ignored: the plain softmax",
    "sink with a value": "the sink's weight multiplies a value (the first key's) instead of being dropped",
    "rope scaling linear": "linear (every frequency / ",
    "rope scaling ignored": "ignored: the plain frequencies where the spec has ",
    "t5 buckets reversed": "buckets of p_i - p_j (query minus key): ",
    "chunk boundary off by one": "chunk boundaries one position late: (p + 1) // ",  # C: 3 or 4 (llama4-rope)
    "chunk forgotten": "no chunk mask: every earlier key visible where chunks of ",
    "gate forgotten": "the output gate forgotten: the merged context goes to w_o without the sigmoid",
    "k_eq_v after the key path": "V taken after the key path: value_states = the normed, rotated keys",
    "value norm forgotten": "the value norm forgotten: each kv head's values reach the weighted sum without",
    "value norm with K's weight": "V normed with K's weight: the values' RMS norm multiplied by k_norm's weight",
    "temperature forgotten": "the temperature forgotten: no query multiplied by 1 + 0.5 * log1p(floor((p + 1) / 3))",
    "temperature floor off by one": "the temperature's floor one position early: floor(p / 3) where Llama 4 has "
    "floor((p + 1) / 3)",
    "qk-norm after rope across heads": "the QK-norm across the heads: each token's whole projection (H*d_k features)",
    "qk-norm after rope forgotten": "the QK-norm after rotary forgotten: q and k unnormed",
    "mla mscale missing": "YaRN's m(f, mscale_all_dim)^2 = 1.265 missing from the softmax scale",
    "mla mscale for mscale_all_dim": "m(f, mscale)^2 = 1.234 on the softmax scale where m(f, mscale_all_dim)^2 = 1.265",
    "mla keys de-interleaved": "the rotary interleave permutation: the keys' rotary features in V3's de-interleaved",
    "mla value head from the key": "the value head size taken from the key's: head h's values read from column h * 6",
    "mla W_UK transposed": "W_UK transposed in the absorbed form: q_nope_h @ W_UK_h^T where q_nope_h @ W_UK_h",
}
# The rule that makes each variant's cause a hypothesis.
HAS_VARIANT = {
    "softcap": lambda cfg: cfg.softcap is not None,
    "window": lambda cfg: cfg.window is not None,
    "alibi": lambda cfg: cfg.alibi,
    "qk_norm": lambda cfg: cfg.qk_norm is not None,
    "sinks": lambda cfg: cfg.sinks,
    "rope_scaling": lambda cfg: cfg.rope_scaling is not None,
    "rel_bias": lambda cfg: cfg.rel_buckets is not None,
    "chunked": lambda cfg: cfg.attention_chunk_size is not None,
    "gate": lambda cfg: cfg.attn_output_gate,
    "k_eq_v": lambda cfg: cfg.attention_k_eq_v,
    "value_norm": lambda cfg: cfg.value_norm,
    "temperature": lambda cfg: cfg.attn_temperature_tuning,
    "qk_norm_after_rope": lambda cfg: cfg.qk_norm_after_rope,
    "mla": lambda cfg: cfg.kv_lora_rank is not None,
}
VARIANT_CASES = [name for name, case in SPEC_CASES.items() if case.cfg.variants]


@functools.cache
def variant_diagnoses() -> dict[tuple[str, str], list]:
    """(setting, bug) -> the causes of the NumPy candidate with that variant bug."""
    return {
        (setting, bug): diagnose(numpy_candidate(SETTINGS[setting], bug), SETTINGS[setting]).causes
        for setting in VARIANT_SETTINGS
        for bug in bugs_for(SETTINGS[setting])
        if bug in VARIANT_BUGS
    }


def test_every_variant_bug_is_named_with_its_detail():
    results = variant_diagnoses()
    assert {bug for _, bug in results} == set(VARIANT_BUGS)  # each runs in some setting
    for (setting, bug), causes in results.items():
        first = causes[0]
        assert (first.code, first.detail[: len(DETAILS[bug])]) == (VARIANT_BUGS[bug][0], DETAILS[bug]), (setting, bug)
        assert first.residual <= 1.0


def test_the_repairable_variant_mistakes_are_repaired():
    results = variant_diagnoses()
    for key in (
        ("softcap-window", "window W+1"),
        ("qk-norm-projection", "window W+1"),
        ("t5-encoder", "t5 buckets reversed"),
    ):
        evidence = results[key][0].evidence
        assert "fed the repair, the candidate agrees with the oracle on every probe" in evidence, key
    decoder = results[("t5-decoder", "t5 buckets reversed")][0]  # every past key in bucket 0: nothing to repair
    assert "fed the repair" not in decoder.evidence and decoder.detail.endswith("every past key in bucket 0")


def test_a_variant_cause_is_a_hypothesis_only_with_its_variant():
    configs = {**SETTINGS, **{name: case.cfg for name, case in SPEC_CASES.items()}}
    for name, cfg in configs.items():
        codes = {h.code for h in hypotheses(cfg)}
        for code, has in HAS_VARIANT.items():
            if code in codes:
                assert has(cfg), (name, code)
        if not cfg.variants:
            assert not codes & set(HAS_VARIANT), name
    # and every variant setting offers its own causes
    for name in VARIANT_SETTINGS:
        cfg = SETTINGS[name]
        assert {code for code, has in HAS_VARIANT.items() if has(cfg)} <= {h.code for h in hypotheses(cfg)}, name


def test_no_variant_cause_for_a_plain_bug():
    """A softcap cannot be blamed on a model without one: a plain model's scale bug is named as the scale."""
    cfg = SETTINGS["causal"]
    causes = diagnose(numpy_candidate(cfg, "scale twice"), cfg).causes
    assert [c.code for c in causes] == ["scale"]


def test_alibi_slopes_hand_computed():
    # 6 heads: the 4-head series 2**-2, 2**-4, 2**-6, 2**-8, then terms 1 and 3 of the 8-head one, 2**-1, 2**-3.
    bloom = np.array([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3])
    np.testing.assert_array_equal(numpy_alibi_slopes(6, False), bloom)
    np.testing.assert_allclose(numpy_alibi_slopes(6, True), 2.0 ** (-np.arange(1, 7) * 8 / 6), rtol=1e-15)
    np.testing.assert_array_equal(numpy_alibi_slopes(4, False), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])


@requires("torch")
def test_torch_alibi_slopes_are_blooms():
    np.testing.assert_allclose(torch_alibi_slopes(6, False).numpy(), numpy_alibi_slopes(6, False), rtol=1e-15)
    np.testing.assert_allclose(torch_alibi_slopes(6, True).numpy(), numpy_alibi_slopes(6, True), rtol=1e-15)


@requires("torch")
def test_candidate_steps_written_once_give_both_candidates_the_same_numbers():
    """An entry that writes its candidate steps once (`DiagnoseSpec.planted_in`) gives the NumPy candidate
    ``planted_in(NumPy's idioms)`` and the torch candidate the same steps over torch's (`torch_steps`); the others
    are spelled in torch apart (`TORCH_STEPS`), never both. On the same float64 inputs, right and with each
    mistake, the two agree to the last bit (the sink column) or to rounding (each library's tanh and rsqrt)."""
    import torch

    from mha_rosetta.backends.injected_torch import TORCH_STEPS, torch_steps
    from mha_rosetta.core.variants import VARIANT_REGISTRY, variant

    once = {name for name, e in VARIANT_REGISTRY.items() if e.diagnose and e.diagnose.planted_in}
    assert once == {"softcap", "qk_norm_head", "qk_norm_projection", "sinks", "rope_scaling", "k_eq_v"}
    assert not once & set(TORCH_STEPS)
    rng = np.random.default_rng(7)
    scores = rng.standard_normal((2, 4, 5, 6)) * 3  # (B, H, Nq, Nk)
    v = rng.standard_normal((2, 4, 6, 3))  # (B, H, Nk, Dv)
    cfg = SETTINGS["softcap-window"]
    steps = {"numpy": variant("softcap").diagnose.planted, "torch": torch_steps(variant("softcap"))}
    for mistake in (None, "after_mask", "dropped"):
        for place in ("transform", "masked"):
            want = getattr(steps["numpy"], place)(cfg, scores, mistake)
            got = getattr(steps["torch"], place)(cfg, torch.from_numpy(scores), mistake)
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-15, atol=0, err_msg=f"{place} {mistake}")
    assert np.array_equal(steps["numpy"].transform(cfg, scores, None), 1.5 * np.tanh(scores / 1.5))
    cfg = SETTINGS["sinks-yarn"]
    params = init_params(cfg, seed=3)
    numpy_column, torch_column = variant("sinks").diagnose.planted.columns, torch_steps(variant("sinks")).columns
    for mistake in (None, "ignored", "value"):
        want = numpy_column(cfg, params, scores, v, mistake)
        got = torch_column(cfg, params, torch.from_numpy(scores), torch.from_numpy(v), mistake)
        assert got[2] == want[2] and want[2] == (mistake is None), mistake
        for a, b in zip(got[:2], want[:2], strict=True):
            np.testing.assert_array_equal(a.numpy(), b, err_msg=str(mistake))
    assert np.array_equal(
        numpy_column(cfg, params, scores, v, None)[0][..., -1], np.broadcast_to(params.sinks[:, None], (2, 4, 5))
    )
    cfg = SETTINGS["qk-norm-head"]
    params = init_params(cfg, seed=4)
    q, k = rng.standard_normal((2, cfg.n_heads, 5, cfg.d_k)), rng.standard_normal((2, cfg.n_kv_heads, 5, cfg.d_k))
    numpy_heads, torch_heads = (
        variant("qk_norm_head").diagnose.planted.heads,
        torch_steps(variant("qk_norm_head")).heads,
    )
    for mistake in (None, "projection"):
        want = numpy_heads(cfg, params, q, k, mistake)
        got = torch_heads(cfg, params, torch.from_numpy(q), torch.from_numpy(k), mistake)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a.numpy(), b, rtol=1e-14, atol=1e-15, err_msg=str(mistake))


def test_window_mask_repair_hand_computed():
    cfg = MHAConfig(d_model=8, n_heads=2, causal=True, window=2)
    mask = np.ones((1, 1, 4, 4), bool)
    mask[0, 0, 3, 0] = False
    # W = 2: query i sees i - 1 and i (causal cuts the future later); the given mask's hole stays.
    expected = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], bool) | np.triu(
        np.ones((4, 4), bool), 1
    )
    np.testing.assert_array_equal(repairs.window_mask(cfg, mask)[0, 0], expected & mask[0, 0])
    two_sided = MHAConfig(d_model=8, n_heads=2, window=2)
    band = np.abs(np.arange(4)[:, None] - np.arange(4)[None, :]) < 2
    np.testing.assert_array_equal(repairs.window_mask(two_sided, np.ones((1, 1, 4, 4), bool))[0, 0], band)


def test_mirrored_buckets_hand_computed():
    cfg = MHAConfig(d_model=8, n_heads=2, rel_buckets=8, rel_max_distance=5)
    params = init_params(cfg, seed=0)
    mirrored = repairs.mirror_relative_buckets(cfg, params)
    np.testing.assert_array_equal(mirrored.rel_bias, params.rel_bias[[0, 5, 6, 7, 4, 1, 2, 3]])
    np.testing.assert_array_equal(repairs.mirror_relative_buckets(cfg, mirrored).rel_bias, params.rel_bias)


def test_the_sink_with_a_value_is_the_first_keys_value():
    """Hand-built: one head, one query, two keys; the sink's share goes to key 0's value."""
    cfg = MHAConfig(d_model=2, n_heads=1, bias=False, sinks=True, scale=1.0)
    eye = np.eye(2)
    params = replace(init_params(cfg, seed=0), w_q=eye, w_k=eye, w_v=eye, w_o=eye, sinks=np.array([0.5]))
    x = np.array([[[1.0, 0.0], [0.0, 2.0]]])  # (1, 2, 2)
    got = simulate(cfg, params, x, x, x, None, Bug(mistakes=(("sinks", "value"),)))
    s = x[0] @ x[0].T  # (2, 2) scores
    e = np.exp(s)
    denominator = np.exp(0.5) + e.sum(axis=1, keepdims=True)
    expected = (e / denominator) @ x[0] + (np.exp(0.5) / denominator) * x[0][:1]
    np.testing.assert_allclose(got[0], expected, rtol=1e-14)
    np.testing.assert_allclose(
        simulate(cfg, params, x, x, x, None), reference_mha(cfg, params, x), rtol=1e-14
    )  # no bug: the spec's sinks


@pytest.mark.parametrize("case", VARIANT_CASES)
def test_correct_candidates_agree_on_every_variant_case(case):
    cfg = SPEC_CASES[case].cfg

    def oracle(params, query, key, value, mask):
        return reference_mha(cfg, params, query, key, value, mask)

    if unsimulated_reason(cfg):  # a form with stages and no DiagnoseSpec: no simulator step, refused by name
        with pytest.raises(DiagnoseError, match="does not reproduce the spec"):
            diagnose(oracle, cfg)
        return
    candidates = {"oracle": oracle, "numpy": numpy_candidate(cfg)}
    if missing_backends().get("torch") is None and not unspelled(cfg):  # a new entry's: in NumPy first
        candidates["torch"] = torch_candidate(cfg)
    for name, candidate in candidates.items():
        result = diagnose(candidate, cfg)
        assert result.agrees and result.causes == [], (name, result.summary())


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_backends_that_declare_a_variant_are_diagnosed_agrees(name):
    backend = installed_backend(name)
    ran, reasons = [], []
    for case in VARIANT_CASES:
        cfg = SPEC_CASES[case].cfg
        # A form the backend runs but diagnose's simulator has no step for (one with stages and no DiagnoseSpec):
        # refused by diagnose by name (test_correct_candidates_agree_on_every_variant_case), not a disagreement.
        reason = backend.unsupported_reason(cfg, "float64", "cpu", "standard") or unsimulated_reason(cfg)
        if reason is not None:
            reasons.append(f"{case}: {reason}")
            continue

        def candidate(params, query, key, value, mask, cfg=cfg):
            return backend.run(cfg, params, query, key, value, mask, dtype="float64")

        result = diagnose(candidate, cfg)
        assert result.agrees, (case, result.summary())
        ran.append(case)
    if not ran:
        pytest.skip(f"{name} declares none of the variant cases' variants on this branch: {reasons[0]}")


# -- the command line -------------------------------------------------------------------------
PORT = """
from mha_rosetta.core import MHAConfig
from mha_rosetta.diagnose.injected import numpy_candidate

CFG = MHAConfig(
    d_model=24, n_heads=4, n_kv_heads=2, causal=True, rope="half", window=3, softcap=1.5, scale=0.3, bias=False
)
candidate = numpy_candidate(CFG, "window W+1")
correct = numpy_candidate(CFG)
"""
GEMMA_OPTIONS = ("--d-model", "24", "--heads", "4", "--kv-heads", "2", "--causal", "--rope", "half", "--no-bias")
GEMMA_OPTIONS += ("--window", "3", "--softcap", "1.5", "--scale", "0.3")


def test_cli_diagnoses_a_variant_configuration(tmp_path):
    (tmp_path / "gemma_port.py").write_text(PORT, encoding="utf-8")
    done = run_cli("diagnose", "gemma_port:candidate", *GEMMA_OPTIONS, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "softcap=1.5 window=3):" in done.stdout
    assert "1. window: 4 keys where the window holds 3 (the query's own included)" in done.stdout
    assert "repairs.window_mask(cfg, mask)" in done.stdout
    fixed = run_cli("diagnose", "gemma_port:correct", *GEMMA_OPTIONS, cwd=tmp_path)
    assert fixed.returncode == 0 and "agrees with the oracle" in fixed.stdout, fixed.stderr


def test_cli_variant_options_map_to_the_config():
    import argparse

    from mha_rosetta.cli.diagnose import add_arguments
    from mha_rosetta.cli.variant_options import with_variants

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = "--d-model 16 --heads 4 --qkv-bias --qk-norm projection --norm-eps 1e-5 --alibi --sinks --rel-buckets 8"
    words += " --rel-max-distance 5 --rel-decoder --rope half --rope-scaling"
    args = parser.parse_args([*words.split(), '{"rope_type": "linear", "factor": 2}'])
    cfg = with_variants(MHAConfig(d_model=16, n_heads=4, rope="half"), args)
    assert (cfg.bias, cfg.qk_norm, cfg.norm_eps, cfg.alibi, cfg.sinks) == ("qkv", "projection", 1e-5, True, True)
    assert (cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional) == (8, 5, False)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.variants == ("qk_norm_projection", "qkv_bias", "alibi", "rel_bias", "sinks", "rope_scaling")
    like = parser.parse_args(["--like", "mymod:attention", "--window", "3", "--sinks"])
    with pytest.raises(ValueError, match="--like gives the whole configuration; drop --window, --sinks"):
        with_variants(MHAConfig(d_model=16, n_heads=4), like)


def test_cli_variant_option_errors_name_the_option(tmp_path):
    (tmp_path / "gemma_port.py").write_text(PORT, encoding="utf-8")
    cases = [
        (["--window", "0"], "MHAConfig.window must be a positive int, got 0"),
        (["--softcap", "-1"], "MHAConfig.softcap must be a finite positive number, got -1.0"),
        (["--rope-scaling", "[1]"], "argument --rope-scaling: expected a JSON object (a dict), got '[1]'"),
        (["--rope-scaling", "{"], "argument --rope-scaling: expected a JSON object in Hugging Face's form"),
        (["--rel-decoder"], "--rel-decoder needs --rel-buckets"),
        (["--norm-eps", "1e-5"], "--norm-eps needs --qk-norm"),
        (["--qkv-bias", "--no-bias"], "--qkv-bias (q, k and v biased) contradicts --no-bias"),
    ]
    for extra, message in cases:
        done = run_cli("diagnose", "gemma_port:candidate", "--d-model", "24", "--heads", "4", *extra, cwd=tmp_path)
        assert done.returncode == 2, (extra, done.stdout)
        assert message in done.stderr, (extra, done.stderr)
