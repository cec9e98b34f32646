"""`mha_rosetta.diagnose`: every injected bug named first, correct code never blamed, bad candidates named.

The injected candidates (`diagnose.injected`) are independent code from the simulator the
diagnosis ranks with (`diagnose.simulate`), so naming their bugs tests the simulator too.
The suite's own implementations and oracles, fed through `Backend.run`, must come back
"agrees"; the known mistake (`direct_reshape`) must come back as `head_split`.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from conftest import installed_backend, requires, run_cli
from mha_rosetta.backends import DIRECT_RESHAPE, REGISTRY, available_backends, get_backend
from mha_rosetta.checks.agreement import backend_level
from mha_rosetta.core import MHAConfig, reference_mha
from mha_rosetta.diagnose import CAUSE_CODES, Bug, DiagnoseError, diagnose, hypotheses, simulate
from mha_rosetta.diagnose.confusion import SETTINGS, VARIANT_SETTINGS, confusion, render_markdown, render_tables
from mha_rosetta.diagnose.injected import BUGS, bugs_for, numpy_candidate
from mha_rosetta.diagnose.probes import make_probes

ROOT = Path(__file__).resolve().parents[1]
PLAIN, GQA, ROTARY = SETTINGS["plain"], SETTINGS["gqa"], SETTINGS["rotary-gqa"]


@functools.cache
def outcomes():
    """The confusion table's diagnoses (NumPy and, where installed, torch candidates)."""
    return confusion()


def test_every_injected_bug_is_named_first_by_its_own_code():
    results = outcomes()
    frameworks = {o.framework for o in results}
    assert "numpy" in frameworks
    # Every bug of the vocabulary is injected somewhere, in every setting it applies to.
    assert {BUGS[o.bug][0] for o in results} == set(CAUSE_CODES)
    assert {(o.setting, o.bug) for o in results} == {(s, b) for s, cfg in SETTINGS.items() for b in bugs_for(cfg)}
    misses = [(o.setting, o.framework, o.bug, o.named) for o in results if not o.correct]
    assert misses == []


@requires("torch")
def test_torch_candidates_are_in_the_table():
    """Every setting runs in torch too: a variant the torch candidate did not spell would be refused by name
    (`backends.injected_torch.unspelled`) and run in NumPy only; since issue 45 it spells every variant's (Llama 4's
    forms and MLA included)."""
    from mha_rosetta.backends.injected_torch import unspelled

    assert {o.framework for o in outcomes()} == {"numpy", "torch"}
    spelled = {name for name, cfg in SETTINGS.items() if not unspelled(cfg)}
    assert spelled == set(SETTINGS)
    torch_runs = sorted((o.setting, o.bug) for o in outcomes() if o.framework == "torch")
    assert torch_runs == sorted(
        (o.setting, o.bug) for o in outcomes() if o.framework == "numpy" and o.setting in spelled
    )


def test_the_docs_confusion_table_is_the_generated_one():
    readme = (ROOT / "docs" / "your-own-implementation.md").read_text(encoding="utf-8")
    if {o.framework for o in outcomes()} != {"numpy", "torch"}:
        pytest.skip("torch is not installed: the page's table has NumPy and torch candidates")
    base = [o for o in outcomes() if o.setting not in VARIANT_SETTINGS]
    variants = [o for o in outcomes() if o.setting in VARIANT_SETTINGS]
    assert base and variants
    for part in (base, variants):  # the page shows the two tables of render_tables, as the command prints them
        assert render_markdown(part).split("\n- ")[0].strip() in readme
    assert render_tables(outcomes()) == render_markdown(base) + "\n" + render_markdown(variants)


@pytest.mark.parametrize("setting", SETTINGS)
def test_a_correct_candidate_is_never_blamed(setting):
    cfg = SETTINGS[setting]

    def oracle(params, query, key, value, mask):
        return reference_mha(cfg, params, query, key, value, mask)

    result = diagnose(oracle, cfg)
    assert result.agrees and result.causes == [] and result.max_error == 0.0
    assert set(result.probe_errors) >= {
        "random",
        "single token",
        "identical tokens",
        "mask",
        "all-True mask",
        "one head",
    }


def test_an_invisible_mistake_is_not_a_cause():
    """Dropping b_k adds q . b_k to a whole score row; the softmax cancels it: that code is correct."""

    def no_b_k(params, query, key, value, mask):
        return reference_mha(PLAIN, replace(params, b_k=np.zeros_like(params.b_k)), query, key, value, mask)

    assert diagnose(no_b_k, PLAIN).agrees


def test_float32_candidates_are_judged_at_float32_tolerance():
    good = diagnose(numpy_candidate(GQA), GQA, dtype="float32")
    assert good.agrees and good.dtype == "float32" and 0 < good.max_error < 2e-5
    bad = diagnose(numpy_candidate(GQA, "kv heads tiled"), GQA, dtype="float32")
    assert [c.code for c in bad.causes] == ["gqa_grouping"]


def test_evidence_names_the_probes_and_the_verified_repair():
    result = diagnose(numpy_candidate(PLAIN, "merge (Dv, H)"), PLAIN)
    assert not result.agrees and result.max_error > 0.5
    cause = result.causes[0]
    assert (cause.code, cause.detail) == ("head_merge_order", "context merged as (Dv, H) instead of (H, Dv)")
    assert cause.residual <= 1.0
    assert "from the oracle" in cause.evidence and "next best" in cause.evidence
    assert "fed the repair, the candidate agrees with the oracle on every probe" in cause.evidence
    assert "repairs.reorder_output_columns(cfg, params)" in cause.fix


def test_two_bugs_at_once_are_both_named():
    def two_bugs(params, query, key, value, mask):
        return simulate(PLAIN, params, query, key, value, mask, Bug(scale=1.0, bias_dropped=("b_o",)))

    result = diagnose(two_bugs, PLAIN)
    assert sorted(c.code for c in result.causes) == ["bias", "scale"]
    assert any("together" in note for note in result.notes)


def test_rope_convention_names_the_pairing_and_its_converter():
    result = diagnose(numpy_candidate(ROTARY, "rope pairs swapped"), ROTARY)
    cause = result.causes[0]
    assert cause.code == "rope_convention"
    assert (
        cause.detail
        == "features (i, i + r/2) rotated together where the spec ('interleaved') pairs features (2i, 2i + 1)"
    )
    assert "mha_rosetta.core.to_rotate_half_params(cfg, params)[1]" in cause.fix
    assert "fed the repair, the candidate agrees with the oracle on every probe" in cause.evidence
    missing = diagnose(numpy_candidate(ROTARY, "rope missing"), ROTARY).causes[0]
    assert (missing.code, missing.detail) == ("rope_convention", "q and k not rotated")


def test_weight_transposed_names_the_weight():
    for weight in ("w_q", "w_o"):
        result = diagnose(numpy_candidate(PLAIN, f"{weight} transposed"), PLAIN)
        assert (result.causes[0].code, result.causes[0].detail) == ("weight_transposed", weight)


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_repair_undoes_its_bug(setting):
    """Simulated bug + its repair fed in = the oracle, on every probe: the repairs are exact."""
    cfg = SETTINGS[setting]
    repaired = [h for h in hypotheses(cfg) if h.repair is not None]
    # A weightless QK-norm after the projections (Llama 4's) undoes any rescaled weight: the scale has no repair.
    scale = set() if cfg.qk_norm_after_rope else {"scale"}
    # MLA's weights read latents: none of its settings' is square, so none can be used transposed.
    square = set() if cfg.kv_lora_rank else {"weight_transposed"}
    assert {h.code for h in repaired} >= {"mask_polarity", "head_merge_order", *scale, *square}
    for probe in make_probes(cfg):
        expected = reference_mha(cfg, probe.params, probe.query, probe.key, probe.value, probe.mask)
        for h in repaired:
            mask = probe.mask
            if mask is None and h.needs_mask:  # as diagnose does: the repair adds to an all-True mask
                mask = np.ones((probe.query.shape[0], 1, probe.query.shape[1], probe.key.shape[1]), bool)
            params, mask = h.repair(cfg, probe.params, mask)
            got = simulate(cfg, params, probe.query, probe.key, probe.value, mask, h.bug)
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"{h.label} on {probe.name}")


def test_the_simulator_without_a_bug_is_the_oracle():
    for cfg in (*SETTINGS.values(), MHAConfig(d_model=16, n_heads=3, d_k=6, d_v=4, kdim=11, vdim=9)):
        for probe in make_probes(cfg):
            expected = reference_mha(cfg, probe.params, probe.query, probe.key, probe.value, probe.mask)
            np.testing.assert_array_equal(
                simulate(cfg, probe.params, probe.query, probe.key, probe.value, probe.mask), expected
            )


def _backend_candidate(name, cfg, dtype, strategy="standard"):
    backend = get_backend(name)

    def candidate(params, query, key, value, mask):
        return backend.run(cfg, params, query, key, value, mask, dtype=dtype, strategy=strategy)

    return candidate


def _first_supported(backend):
    """One setting and dtype per backend: rotary + GQA + causal where it can, else less; float64 where it can."""
    for setting in ("rotary-gqa", "rotary", "gqa", "causal"):
        for dtype in ("float64", "float32"):
            if backend.unsupported_reason(SETTINGS[setting], dtype, "cpu", "standard") is None:
                return SETTINGS[setting], dtype
    pytest.skip(f"{backend.name} supports neither setting")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_backend_of_the_suite_is_diagnosed_agrees(name):
    backend = installed_backend(name)
    cfg, dtype = _first_supported(backend)
    level = backend_level(backend, dtype)  # a declared precision limit (MLX's float64)
    result = diagnose(_backend_candidate(name, cfg, dtype), cfg, dtype=level)
    assert result.agrees, result.summary()
    assert result.causes == []
    if DIRECT_RESHAPE in backend.strategies:  # the known mistake is named as what it is
        wrong = diagnose(_backend_candidate(name, cfg, dtype, DIRECT_RESHAPE), cfg, dtype=dtype)
        assert [c.code for c in wrong.causes][:1] == ["head_split"], wrong.summary()


def test_the_registry_drives_the_list():
    assert set(available_backends()) <= set(REGISTRY)


@requires("torch")
def test_nn_multihead_attention_is_named_with_its_empty_row_difference():
    """Real nn.MultiheadAttention, loaded with the project's converter: agrees, and names its empty-row answer."""
    import torch

    from mha_rosetta.core import to_torch_mha_state_dict

    cfg = MHAConfig(d_model=12, n_heads=2)  # even heads, bias, self-attention, eval: torch's fused fast path
    module = torch.nn.MultiheadAttention(cfg.d_model, cfg.n_heads, batch_first=True, dtype=torch.float64).eval()

    def candidate(params, query, key, value, mask):
        module.load_state_dict({k: torch.from_numpy(v) for k, v in to_torch_mha_state_dict(cfg, params).items()})
        blocked = None if mask is None else torch.from_numpy(~mask).expand(-1, cfg.n_heads, -1, -1)
        blocked = None if blocked is None else blocked.reshape(-1, *blocked.shape[2:])  # (B*H, Nq, Nk)
        with torch.no_grad():
            q = torch.from_numpy(query)
            k = q if key is query else torch.from_numpy(key)  # one tensor three times: the fast path checks identity
            v = k if value is key else torch.from_numpy(value)
            return module(q, k, v, attn_mask=blocked, need_weights=False)[0]

    result = diagnose(candidate, cfg)
    assert result.agrees, result.summary()
    assert result.known_differences == [
        "a query row with no allowed key gives NaN; the spec gives zero weights, output = b_o"
    ]


# -- bad candidates -----------------------------------------------------------------------
def _oracle(params, query, key, value, mask):
    return reference_mha(PLAIN, params, query, key, value, mask)


@pytest.mark.parametrize(
    ("candidate", "message"),
    [
        (
            lambda *a: (_ for _ in ()).throw(RuntimeError("boom")),
            "the candidate raised RuntimeError: boom on probe 'random'",
        ),
        (lambda *a: _oracle(*a)[:, :, :-1], "returned shape (2, 5, 11) on probe 'random'; expected (2, 5, 12)"),
        (lambda *a: _oracle(*a).astype(np.int64), "returned dtype int64 on probe 'random'; expected floating point"),
        (lambda *a: np.full_like(_oracle(*a), np.nan), "returned NaN or inf everywhere on probe 'random'"),
        (lambda *a: (_oracle(*a), None), "returned a tuple on probe 'random'"),
        (lambda *a: "output", "returned dtype <U6 on probe 'random'"),
    ],
    ids=["raises", "shape", "dtype", "nan", "tuple", "string"],
)
def test_a_bad_candidate_is_a_clear_error(candidate, message):
    with pytest.raises(DiagnoseError) as info:
        diagnose(candidate, PLAIN)
    assert message in str(info.value)


def test_not_callable_and_bad_options():
    with pytest.raises(TypeError, match="candidate must be callable"):
        diagnose("my_attention", PLAIN)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        diagnose(_oracle, PLAIN, timeout=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        diagnose(_oracle, PLAIN, dtype="float8")


def test_a_hanging_candidate_hits_the_time_limit():
    release = threading.Event()

    def hangs(*args):
        release.wait(60)
        return _oracle(*args)

    started = time.monotonic()
    try:
        with pytest.raises(
            DiagnoseError, match=r"did not return within 0.3 s on probe 'random' \(time limit per probe\)"
        ):
            diagnose(hangs, PLAIN, timeout=0.3)
    finally:
        release.set()  # let the abandoned worker thread finish
    assert time.monotonic() - started < 30  # returned, rather than waiting out the candidate


def test_a_self_attention_only_candidate_leaves_the_cross_probe_out():
    def self_only(params, query, key, value, mask):
        return reference_mha(
            PLAIN, params, query, None, None, None if mask is None or mask.shape[-1] != query.shape[1] else mask
        )

    result = diagnose(self_only, PLAIN)
    assert result.agrees
    assert result.notes == ["probe 'cross' left out: the candidate ignores key and value (self-attention only)"]


# -- the command line ---------------------------------------------------------------------
def _cli(*args):
    return run_cli("diagnose", *args, cwd=ROOT)


@requires("torch")
def test_cli_names_the_bug_of_the_readme_example():
    done = _cli("examples.my_attention:candidate", "--d-model", "12", "--heads", "3")
    assert done.returncode == 1, done.stderr
    assert "1. qkv_packing: packed as blocks, read as interleaved" in done.stdout
    assert "repairs.repack_qkv(cfg, params, 'blocks', 'interleaved')" in done.stdout
    fixed = _cli("examples.my_attention:fixed_candidate", "--d-model", "12", "--heads", "3", "--json", "-")
    assert fixed.returncode == 0, fixed.stderr
    import json

    assert json.loads(fixed.stdout)["agrees"] is True


def test_cli_errors_name_the_problem(tmp_path):
    cases = [
        (["nosuchpkg.mod:attention", "--d-model", "12", "--heads", "3"], "cannot import nosuchpkg.mod:attention"),
        (["mha_rosetta.core:nothing", "--d-model", "12", "--heads", "3"], "has no attribute 'nothing'"),
        (["mha_rosetta.core:DTYPE_NAMES", "--d-model", "12", "--heads", "3"], "is a tuple, not callable"),
        (["mha_rosetta.core:reference_mha"], "--d-model and --heads required"),
        (["mha_rosetta.core.reference_mha", "--d-model", "12", "--heads", "3"], "expected an import path"),
        (["mha_rosetta.core:init_params", "--d-model", "12", "--heads", "3"], "the candidate raised"),
        (["mha_rosetta.core:reference_mha", "--d-model", "10", "--heads", "3"], "d_model=10 is not divisible"),
    ]
    for args, message in cases:
        done = _cli(*args)
        assert done.returncode == 2, (args, done.stdout)
        assert message in done.stderr, (args, done.stderr)


@requires("torch")
def test_the_docs_python_example_prints_what_the_page_says():
    section = (ROOT / "docs" / "your-own-implementation.md").read_text(encoding="utf-8")
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = re.search(r"^# (.*)$", example, re.M).group(1)
    done = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected
