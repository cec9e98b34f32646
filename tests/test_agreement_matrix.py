"""Every registered backend on every device and dtype, against the oracle and against each other.

Parametrised by (backend, device, dtype) triples with readable ids such as
``torch-cpu-float32`` (the way scikit-learn walks namespace/device/dtype combinations):
a backend whose library is missing is skipped with its install command as the reason,
a GPU triple without a GPU is skipped with that reason, and GPU triples carry the
``gpu`` mark. The check itself runs once per (device, dtype) for every installed
backend and is shared by the tests below, so the module costs one full check.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json

import pytest

from conftest import installed_backend, skip_without_gpu
from mha_rosetta.backends import DIRECT_RESHAPE, REGISTRY, available_backends, get_backend
from mha_rosetta.backends._mla import MLA_STRATEGIES
from mha_rosetta.backends.entries import module_name
from mha_rosetta.checks import SPEC_CASES, SpecCase, Status, run_check
from mha_rosetta.checks.devices import GPU_PROBES
from mha_rosetta.cli.main import main
from mha_rosetta.core import DTYPE_NAMES, MHAConfig
from mha_rosetta.core.variants import adapted_variants

DEVICES = ("cpu", "gpu")


def _param(*values, device: str):
    marks = [pytest.mark.gpu] if device == "gpu" else []
    return pytest.param(*values, id="-".join(values), marks=marks)


TRIPLES = [
    _param(name, device, dtype, device=device) for name in REGISTRY for device in DEVICES for dtype in DTYPE_NAMES
]
DEVICE_DTYPES = [_param(device, dtype, device=device) for device in DEVICES for dtype in DTYPE_NAMES]


@functools.cache
def check_for(device: str, dtype: str):
    """The full check of every installed backend on one device and dtype (run once per session)."""
    return run_check(devices=[device], dtypes=[dtype])


def _skip_unless_present(name: str, device: str):
    backend = installed_backend(name)
    if device not in backend.devices():
        if device == "gpu" and set(REGISTRY[name].requires) & set(GPU_PROBES):
            skip_without_gpu(f"{name}: no gpu device present on this machine")
        pytest.skip(f"{name}: runs on the CPU only")
    return backend


def _gpu_present() -> bool:
    for name in available_backends():
        if "gpu" in get_backend(name).devices():
            return True
    return False


@pytest.mark.parametrize(("name", "device", "dtype"), TRIPLES)
def test_backend_agrees_with_the_oracle(name, device, dtype):
    backend = _skip_unless_present(name, device)
    result = check_for(device, dtype)
    runs = [run for run in result.runs if run.impl.backend == name]
    if not any(run.compared for run in runs):
        pytest.skip(f"{name} runs no case in {dtype}: {runs[0].reason if runs else 'no case lists this dtype'}")
    errors = [f"{run.case}/{run.label}: {run.reason}" for run in runs if run.status is Status.ERROR]
    assert not errors, errors
    for run in runs:
        where = f"{run.case} {run.label} {dtype}: {run.reason}"
        unadapted = bool(
            set(SPEC_CASES[run.case].cfg.variants) - adapted_variants()
        )  # an entry limited to some libraries
        if run.impl.known_mistake and not (unadapted and run.status is Status.UNSUPPORTED):
            assert run.status is Status.CAUGHT, where
            assert run.divergence is not None and run.divergence.stage == "q_heads", where
        elif run.status is Status.KNOWN_DIFFERENCE and run.info.get("tolerance_dtype"):
            # A precision limit the backend declares (MLX's float64): held to that level, and said so, or the named
            # difference behind it (torch-onnx:export's float32 scale).
            named = run.info.get("known_difference") and run.info["known_difference"] in run.reason
            assert ("declared" in run.reason or named) and run.info["tolerance_dtype"] != dtype, where
        elif run.status is Status.KNOWN_DIFFERENCE:
            assert backend.kind == "oracle", where  # our own implementations follow the spec exactly
            # rows with no allowed key, or an output on the answer of a difference the oracle names (ONNX)
            assert SPEC_CASES[run.case].empty_rows().any() or run.info.get("known_difference"), where
        elif run.status is Status.UNSUPPORTED:
            # Our adapters express every feature; only a third-party library may not, a sharded
            # backend refuses heads that do not split over its ranks, and a framework's best path
            # (backends/best: the fastest idiom for plain, causal, GQA and rotary attention) refuses the rest.
            split = getattr(backend, "splits_heads", False) and ("divide" in run.reason or "kv head" in run.reason)
            # A form the registry limits to some libraries (`Variant.implemented_by`, core.variants.adapted_variants);
            # MLA's forms (the naive and absorbed strategies) refuse a layer without its latent, by name.
            mla_form = run.impl.strategy in MLA_STRATEGIES and "needs MHAConfig.kv_lora_rank" in run.reason
            assert backend.kind == "oracle" or split or unadapted or mla_form or getattr(backend, "best_path", False), (
                where
            )
        else:
            assert run.status is Status.AGREE, where
            assert run.max_abs <= run.tolerance.atol + run.tolerance.rtol * 10, where  # outputs are O(1)
        if device == "gpu" and dtype == "float32" and "tf32" in run.info:
            assert run.info["tf32"] is False, where  # comparisons run with TF32 off


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_all_pairs_agree(device, dtype):
    if device == "gpu" and not _gpu_present():
        skip_without_gpu("no GPU present on this machine for any installed backend")
    result = check_for(device, dtype)
    if not result.pairs:
        pytest.skip(f"fewer than two implementations ran in {dtype} on {device}")
    failing = [
        f"{p.case}: {p.a.label} vs {p.b.label}: {p.status} {p.reason}"
        for p in result.pairs
        if p.status in (Status.DISAGREE, Status.MISSED)
    ]
    assert not failing, failing[:10]
    for pair in result.pairs:
        if pair.a.impl.known_mistake != pair.b.impl.known_mistake:
            assert pair.status is Status.CAUGHT
        elif pair.status is Status.KNOWN_DIFFERENCE:  # an oracle's convention, or a declared precision limit
            assert "oracle" in (pair.a.kind, pair.b.kind) or "declared" in pair.reason
    assert result.exit_status == 0, result.verdict()


def test_direct_reshape_is_caught_at_q_heads_in_every_backend_that_has_it():
    result = check_for("cpu", "float32")
    with_mistake = {run.impl.backend for run in result.runs if run.impl.strategy == DIRECT_RESHAPE}
    assert "numpy" in with_mistake  # numpy is always installed, so the mistake is always checked
    # A case of a form no adapter applies yet (core.variants.adapted_variants) is refused, mistake or not.
    mistakes = [
        run
        for run in result.runs
        if run.impl.strategy == DIRECT_RESHAPE and not set(SPEC_CASES[run.case].cfg.variants) - adapted_variants()
    ]
    assert mistakes and all(run.status is Status.CAUGHT for run in mistakes)
    assert {run.divergence.stage for run in mistakes} == {"q_heads"}
    assert all(run.divergence.max_abs > 0.05 for run in mistakes)  # far beyond float32 noise


def test_check_command_on_real_backends_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    status = main(
        [
            "check",
            "--backends",
            "numpy",
            "--cases",
            "gqa,cross_attention",
            "--dtypes",
            "float32,float16",
            "--json",
            str(path),
        ]
    )
    assert status == 0, capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["settings"]["backends"] == ["numpy"]
    assert {run["case"] for run in data["runs"]} == {"gqa", "cross_attention"}
    # MLA's strategies refuse a layer without its latent, by name; every other run agrees or is a caught mistake.
    mla = [run for run in data["runs"] if run["implementation"].split(":")[-1] in MLA_STRATEGIES]
    assert mla and all(run["status"] == "unsupported" and "kv_lora_rank" in run["reason"] for run in mla)
    assert {run["status"] for run in data["runs"] if run not in mla} == {"agree", "caught"}
    assert sorted(m["dtype"] for m in data["matrices"]) == ["float16", "float32"]


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed: pip install 'mha-rosetta[torch]'"
)
def test_removing_a_framework_turns_its_rows_into_skips(monkeypatch):
    from mha_rosetta import backends

    for name, entry in list(backends.REGISTRY.items()):
        if "torch" in entry.requires:
            monkeypatch.setitem(
                backends.REGISTRY,
                name,
                backends.BackendEntry(
                    entry.module,
                    entry.cls,
                    (*entry.requires, "torch_is_gone_xyz"),
                    entry.extra,
                    entry.kwargs,
                    kind=entry.kind,
                ),
            )
    result = run_check(cases=["self_attention"], dtypes=["float64"], backends=["numpy", "torch", "torch-sdpa"])
    assert set(result.skipped_backends) == {"torch", "torch-sdpa"}
    assert all("pip install 'mha-rosetta[torch]'" in reason for reason in result.skipped_backends.values())
    assert result.exit_status == 0


# -- TF32 on GPU ----------------------------------------------------------------------------
TF32_CASE = SpecCase(
    "tf32_probe",
    "sizes where TF32's 10-bit mantissa shows: d_model 384, 64 tokens",
    MHAConfig(d_model=384, n_heads=6),
    batch=3,
    q_tokens=64,
    dtypes=("float32",),
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "option"),
    [("torch", {"allow_tf32": True}), ("jax", {"matmul_precision": "default"})],
    ids=["torch", "jax"],
)
def test_tf32_error_is_larger_than_float32(name, option):
    _skip_unless_present(name, "gpu")
    entry = REGISTRY[name]
    adapter = importlib.import_module(module_name(entry.module))
    fast = getattr(adapter, entry.cls)(name=f"{name}-tf32", **entry.kwargs, **option)
    fast.kind = entry.kind
    ieee = get_backend(name)
    result = run_check(
        backends=[ieee, fast], cases=[TF32_CASE], devices=["gpu"], dtypes=["float32"], strategies=["standard"]
    )
    runs = {run.impl.backend: run for run in result.runs}
    exact, tf32 = runs[name], runs[f"{name}-tf32"]
    assert exact.status is Status.AGREE, exact.reason  # TF32 off: float32 agreement
    assert tf32.info.get("tf32") is True
    assert tf32.max_abs > 5 * exact.max_abs, (tf32.max_abs, exact.max_abs)
