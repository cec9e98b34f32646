"""Adding a variant: one registry entry and one ops method per array library, proved end to end.

A throwaway variant, a logit temperature (``s <- s / t`` after the softcap, before the biases and
the mask), is written to a temporary directory as two files: its registry entry (NumPy only: its
`MHAConfig` field with its validation, its stage, its float64 forward and backward, its check and
decode cases, its bench cell, its command-line option, its explainer text and what diagnose knows of
it) and its ops methods (one for each of NumPy, torch and JAX, with how the pipeline calls them), each
registered by one entry point (the groups ``mha_rosetta.variants`` and ``mha_rosetta.score_ops``).
Nothing in the project is edited. The CLIs run in subprocesses with that directory on ``PYTHONPATH``
and show the variant in ``check`` (every adapter that runs the score pipeline agrees with the
oracle; the third-party oracles refuse it, naming it), ``check --decode``, ``check --grad``,
``explain``, ``bench --list`` and ``diagnose`` (which names a candidate that drops it). README's
"Adding a variant" cites this test for the number of files a new variant takes.

The temperature is one number, not one per head: a per-head parameter is laid out in each
convention's score layout from its ``ParamSpec`` (``head_axis``, ``score_part``:
``backends.frameworks.score_parts``, as the sinks are), but ``score_steps`` hands the ops object
only the parts its interface names (the bias, the mask, the sinks), so a plugin's own per-head
part would not reach its op yet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mha_rosetta.backends import available_backends
from mha_rosetta.backends._mla import MLA_STRATEGIES

ENTRY = '''
"""A logit temperature: every score divided by t after the softcap (a throwaway variant)."""
import math

import numpy as np

from mha_rosetta.core.variants import (
    BenchSpec, CaseSpec, CliOption, ConfigField, DiagnoseCause, DiagnoseSpec, Explanation, PlantedMistake,
    PlantedSteps, ScoreStep, SimulatedSteps, StageSpec, Variant, register_variant,
)


def temper(cfg, scores):
    return scores / cfg.logit_temperature


def temper_vjp(cfg, scores, d_tempered):
    return d_tempered / cfg.logit_temperature


def validate(cfg):
    t = cfg.logit_temperature
    if t is None:
        return {}
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"MHAConfig.logit_temperature must be a finite positive number, got {t!r}")
    return {"logit_temperature": float(t)}


def explain(demo):
    t = ENTRY.demo_on["logit_temperature"]
    _, _, on, _, off = demo.run("logit_temperature")
    return Explanation(
        "logit_temperature=t", "s <- s / t", "after the softcap, before the biases and the mask",
        [("by hand", "scores / t")],
        [f"with t = {t:g} the largest weight of the demonstration falls from "
         f"{off['weights'].max():.4g} to {on['weights'].max():.4g}"],
    )


def steps(cfg, scores, mistake):
    return scores if mistake == "dropped" else scores / cfg.logit_temperature


ENTRY = Variant(
    name="logit_temperature",
    summary="every score divided by t",
    fields=("logit_temperature",),
    config_fields=(ConfigField("logit_temperature", None, "float | None"),),
    is_on=lambda cfg: cfg.logit_temperature is not None,
    validate=validate,
    stage_specs=(StageSpec("temperature", "tempered_scores", "the scores divided by t", after="capped_scores"),),
    score_step=ScoreStep("transform", "temper"),
    forward=temper,
    backward=temper_vjp,
    check_cases=(CaseSpec("logit_temperature", "every score divided by t = 2.5",
                          dict(d_model=18, n_heads=3, logit_temperature=2.5), dict(dtypes=("float64", "float32"), seed=901)),),
    decode_cases=(CaseSpec("logit_temperature", "scores divided by 2.5",
                           dict(d_model=18, n_heads=3, rope="half", causal=True, logit_temperature=2.5),
                           dict(tokens=8, prefill=3, seed=902)),),
    bench=BenchSpec({"logit_temperature": 2.0}, "plain"),
    cli=(CliOption("--logit-temperature", dict(type=float, help="divide every score by T"),
                   lambda value: {"logit_temperature": value}, rank=90),),
    demo_on={"logit_temperature": 4.0},
    demo_off={"logit_temperature": None},
    explain=explain,
    diagnose=DiagnoseSpec(
        rank=90,
        causes=(DiagnoseCause("logit_temperature", "dropped", "not applied (the scores are not divided by t)",
                              lambda cfg: f"divide the scores by t = {cfg.logit_temperature:g} after the softcap"),),
        mistakes=(PlantedMistake("temperature dropped", "logit_temperature", "scores never divided by t", "dropped"),),
        settings=(("temperature", dict(d_model=24, n_heads=4, causal=True, logit_temperature=2.5)),),
        simulated=SimulatedSteps(transform=steps),
        planted=PlantedSteps(transform=steps),
    ),
)
register_variant(ENTRY)
'''

OPS = '''
"""The logit temperature's ops method, one per array library, and how the score pipeline calls it."""
from mha_rosetta.backends.frameworks.ops import ScoreStep, register_score_op


def numpy_temper(self, scores, t):
    P = self.precision  # NumPy's half precision: computed in float32, stored in the half type
    return P.store(P.operand(scores) / t)


def torch_temper(self, scores, t):
    return (self._compute(scores) / t).to(scores.dtype)


def jax_temper(self, scores, t):
    from mha_rosetta.backends.frameworks.ops_jax import compute_dtype

    return (scores.astype(compute_dtype(scores.dtype)) / t).astype(scores.dtype)


register_score_op(
    "temper",
    ScoreStep(
        "tempered_scores",
        "s / t",
        forward=lambda ops, cfg, scores, parts: ops.temper(scores, cfg.logit_temperature),
        backward=lambda ops, cfg, d_tempered, scores: ops.temper(d_tempered, cfg.logit_temperature),
    ),
    numpy=numpy_temper,
    torch=torch_temper,
    jax=jax_temper,
)
'''

# The registration: one entry point for the entry, one for the ops methods.
ENTRY_POINTS = (
    "[mha_rosetta.variants]\ntemperature = temperature_entry\n\n[mha_rosetta.score_ops]\ntemper = temperature_ops\n"
)

# Scaffolding of the diagnose test, not part of the variant: a candidate that forgets the temperature.
CANDIDATE = """
from mha_rosetta.core import MHAConfig, reference_mha


def forgets_the_temperature(params, query, key, value, mask):
    return reference_mha(MHAConfig(d_model=12, n_heads=3), params, query, key, value, mask)
"""


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("temperature_plugin")
    for name, text in (("temperature_entry", ENTRY), ("temperature_ops", OPS)):
        (where / f"{name}.py").write_text(textwrap.dedent(text).lstrip())
    meta = where / "temperature_plugin-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: temperature-plugin\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text(ENTRY_POINTS)
    scaffolding = where / "scaffolding"
    scaffolding.mkdir()
    (scaffolding / "temperature_candidate.py").write_text(textwrap.dedent(CANDIDATE).lstrip())
    return where


def _env(plugin_dir: Path) -> dict:
    paths = [str(plugin_dir), str(plugin_dir / "scaffolding"), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return env


def _cli(plugin_dir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    code = "import sys; from mha_rosetta.cli.main import main; sys.exit(main(sys.argv[1:]))"
    env = _env(plugin_dir)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout)


def _python(plugin_dir: Path, code: str) -> subprocess.CompletedProcess:
    env = _env(plugin_dir)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)


# The adapters that run the score pipeline through their library's ops object.
PIPELINE = {"numpy", "torch", "jax", "einops-numpy", "einops-torch", "einops-jax", "jax-sharded"}
_MISSING = [module for module in ("torch", "jax", "einops") if importlib.util.find_spec(module) is None]
# The runs through every pipeline adapter need every array library: they run in tox's `all` (NumPy's env skips).
needs_every_library = pytest.mark.skipif(bool(_MISSING), reason=f"{', '.join(_MISSING)} not installed (runs in `all`)")


def test_the_variant_is_two_files_and_two_registration_lines(plugin_dir):
    assert sorted(path.name for path in plugin_dir.glob("*.py")) == ["temperature_entry.py", "temperature_ops.py"]
    assert (plugin_dir / "temperature_plugin-0.1.dist-info" / "entry_points.txt").read_text().count(" = ") == 2


def test_the_config_field_the_stage_and_the_float64_oracles_come_from_the_entry(plugin_dir):
    done = _python(
        plugin_dir,
        """
        import dataclasses, json
        import numpy as np
        from mha_rosetta.core import MHAConfig, init_params, reference_mha, stage_names
        from mha_rosetta.core.grad import grad_stage_names, reference_mha_vjp

        cfg = MHAConfig(d_model=12, n_heads=3, softcap=2.0, logit_temperature=4)
        plain = MHAConfig(d_model=12, n_heads=3, softcap=2.0)
        try:
            MHAConfig(d_model=12, n_heads=3, logit_temperature=-1.0)
            refused = ""
        except ValueError as error:
            refused = str(error)
        params = init_params(cfg, seed=3)
        x = np.random.default_rng(0).standard_normal((2, 5, 12))
        out, stages = reference_mha(cfg, params, x, return_stages=True)
        # by hand: the softcapped scores divided by 4, then the plain softmax
        by_hand = stages["capped_scores"] / 4
        grads = reference_mha_vjp(cfg, params, x)
        eps, d_out = 1e-6, np.random.default_rng(20241130).standard_normal(out.shape)
        bumped = params.as_dict()
        w = bumped["w_q"].copy(); w[1, 2] += eps; bumped["w_q"] = w
        moved = reference_mha(cfg, type(params)(**bumped), x)
        print(json.dumps(dict(
            value=cfg.logit_temperature, type=type(cfg.logit_temperature).__name__, off=plain.logit_temperature,
            variants=cfg.variants, replaced=dataclasses.replace(cfg, logit_temperature=None).variants,
            refused=refused, stages=stage_names(cfg), grad_stages=grad_stage_names(cfg),
            tempered=float(np.max(np.abs(stages["tempered_scores"] - by_hand))),
            masked=float(np.max(np.abs(stages["masked_scores"] - by_hand))),
            fd=float(np.sum((moved - out) * d_out) / eps), analytic=float(grads.d_params.w_q[1, 2]),
            describe=cfg.describe(), equal=cfg == MHAConfig(d_model=12, n_heads=3, softcap=2.0, logit_temperature=4.0),
        )))
        """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert (got["value"], got["type"], got["off"]) == (4.0, "float", None)
    assert got["variants"] == ["softcap", "logit_temperature"] and got["replaced"] == ["softcap"]
    assert got["refused"] == "MHAConfig.logit_temperature must be a finite positive number, got -1.0"
    at = got["stages"].index("capped_scores")
    assert got["stages"][at + 1 : at + 3] == ["tempered_scores", "masked_scores"]
    at = got["grad_stages"].index("d_tempered_scores")
    assert got["grad_stages"][at + 1 : at + 3] == ["d_capped_scores", "d_scores"]
    assert got["tempered"] == 0.0 and got["masked"] == 0.0
    assert got["fd"] == pytest.approx(got["analytic"], rel=1e-5, abs=1e-8)
    assert "logit_temperature=4" in got["describe"] and got["equal"]


@needs_every_library
def test_every_pipeline_adapter_records_its_stage_as_the_oracle_has_it(plugin_dir):
    done = _python(
        plugin_dir,
        """
        import json
        import numpy as np
        from mha_rosetta.backends import get_backend
        from mha_rosetta.backends._chunking import CHUNKED_HIDDEN_STAGES
        from mha_rosetta.core import MHAConfig, init_params, reference_stages

        cfg = MHAConfig(d_model=12, n_heads=3, causal=True, softcap=2.0, logit_temperature=2.5)
        params, x = init_params(cfg, 0), np.random.default_rng(0).standard_normal((2, 5, 12))
        want = reference_stages(cfg, params, x)["tempered_scores"]
        errors = {}
        for name in ("numpy", "torch", "jax", "einops-numpy", "einops-torch", "einops-jax"):
            prepared, _ = get_backend(name).prepare(cfg, params, x, dtype="float64")
            got = get_backend(name).canonical_stages(prepared)["tempered_scores"]
            errors[name] = float(np.max(np.abs(got - want)))
        print(json.dumps(dict(errors=errors, hidden="tempered_scores" in CHUNKED_HIDDEN_STAGES)))
        """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert all(error <= 1e-15 for error in got["errors"].values()), got  # float64: one division each
    assert got["hidden"]  # the chunked strategies hold it one tile at a time, like the other score stages


def _runs(path: Path) -> list[dict]:
    return [run for run in json.loads(path.read_text())["runs"] if run["case"] == "logit_temperature"]


@needs_every_library
def test_check_runs_every_pipeline_adapter_with_it_and_refuses_it_elsewhere(plugin_dir, tmp_path):
    out = tmp_path / "check.json"
    done = _cli(plugin_dir, "check", "--cases", "logit_temperature", "--json", str(out), "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = _runs(out)
    agreed = {run["backend"] for run in runs if run["status"] == "agree"}
    assert PIPELINE <= agreed
    # every strategy of those agrees but the planted one (direct_reshape: a known mistake, caught); MLA's forms
    # (naive, absorbed: backends._mla) refuse a layer without its latent, by name
    others = [run for run in runs if run["backend"] in PIPELINE and run["status"] != "agree"]
    assert {run["strategy"] for run in others if run["strategy"] not in MLA_STRATEGIES} == {"direct_reshape"}
    assert all("kv_lora_rank" in run["reason"] for run in others if run["strategy"] in MLA_STRATEGIES)
    # the libraries' own attention (and the best paths) refuse it, naming it: never run without it
    refused = [run for run in runs if run["status"] == "unsupported" and "does not implement" in run["reason"]]
    libraries = {"torch-sdpa", "torch-flex", "jax-dpa", "flax", "hf-attention"} & set(available_backends())
    assert libraries <= {run["backend"] for run in refused}
    assert all(run["reason"].split(" does not implement ")[1].startswith("logit_temperature") for run in refused)


@needs_every_library
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("--decode", PIPELINE),  # step by step, through every pipeline's cache
        ("--grad", {"numpy", "torch", "jax"}),  # numpy's hand-written backward runs the op's backward
    ],
)
def test_check_decode_and_grad_run_it(plugin_dir, tmp_path, mode, expected):
    out = tmp_path / "check.json"
    done = _cli(plugin_dir, "check", mode, "--cases", "logit_temperature", "--json", str(out), "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    agreed = {run["backend"] for run in _runs(out) if run["status"] == "agree"}
    assert expected <= agreed


def test_explain_describes_it(plugin_dir):
    done = _cli(plugin_dir, "explain", "--plain", "--no-speed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "logit_temperature" in done.stdout and "s <- s / t" in done.stdout
    assert "tempered_scores" in done.stdout


@needs_every_library
def test_bench_lists_its_cell(plugin_dir):
    # bench --list prints the implementations a sweep would run; --variants takes the new cell (measured against
    # the plain layer), and its refusal of an unknown name lists it among the cells
    done = _cli(plugin_dir, "bench", "--preset", "variants", "--variants", "logit_temperature", "--list")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"numpy", "torch", "jax"} <= set(done.stdout.split())
    refused = _cli(plugin_dir, "bench", "--variants", "no_such_variant", "--list")
    assert refused.returncode == 2
    assert "expected names among plain, causal, window, softcap," in refused.stderr
    assert (
        ", rope_yarn, chunked, gate, qk_norm_after_rope, temperature, mla, k_eq_v, value_norm, logit_temperature; got 'no_such_variant'"
        in refused.stderr
    )
    cell = _python(
        plugin_dir, "from mha_rosetta.benchmarks.variants import *; print(variant_overrides('logit_temperature', 64))"
    )
    assert cell.stdout.strip() == "{'logit_temperature': 2.0}", cell.stderr[-3000:]


def test_diagnose_names_a_candidate_that_drops_it(plugin_dir, tmp_path):
    out = tmp_path / "diagnosis.json"
    done = _cli(
        plugin_dir,
        "diagnose",
        "temperature_candidate:forgets_the_temperature",
        "--d-model",
        "12",
        "--heads",
        "3",
        "--logit-temperature",
        "2.5",
        "--json",
        str(out),
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "logit_temperature" in done.stdout and "divide the scores by t = 2.5" in done.stdout
