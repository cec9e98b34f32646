"""``bench --breakdown``: the stage cuts compose to the adapter's output, the framework inspectors find the copies
and the context-sized allocations that are there (and none where there are none), and the option is checked.
No timing is asserted: the breakdown's figures are measured, never tested."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from mha_rosetta.backends import get_backend
from mha_rosetta.backends.inspect_programs import grows_with_context, hlo_moves
from mha_rosetta.backends.stage_programs import STAGE_GROUPS, NoCut, PerHeadStages, stage_programs
from mha_rosetta.cli.main import main as cli_main
from mha_rosetta.core import MHAConfig, init_params
from mha_rosetta.core.stages import STAGE_NAMES
from mha_rosetta.core.tolerances import assert_close
from mha_rosetta.core.variants import NORM_PLACES, norm_step, rms_norm

# Distinct sizes: 6 heads in 3 kv groups of 2, d_k 4, d_model 18, 7 tokens, batch 2.
CFG = MHAConfig(d_model=18, n_heads=6, n_kv_heads=3, d_k=4)
DECODE_CFG = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, d_k=6, causal=True, rope="half")
FORWARD_PATHS = ("numpy", "torch", "jax", "jax-best")  # the paths whose forward records each stage as it goes
TINY_POLICY = {"min_time": 0.0, "min_repeats": 3, "max_repeats": 3, "max_time": 1.0, "warmup": 1}


def _backend(name: str):
    framework = {"numpy": "numpy", "torch": "torch", "jax": "jax", "mlx": "mlx"}[name.split("-")[0]]
    if framework != "numpy":
        pytest.importorskip(framework, reason=f"{name} needs {framework}")
    return get_backend(name)


def _forward(name: str, strategy: str = "standard"):
    backend = _backend(name)
    x = np.random.default_rng(1).standard_normal((2, 7, CFG.d_model))  # (B, N, D)
    prepared, _ = backend.prepare(CFG, init_params(CFG, seed=0), x, None, None, dtype="float32", device="cpu",
                                  strategy=strategy)  # fmt: skip
    return backend, prepared


def test_the_breakdowns_stages_hold_every_pipeline_stage_once_in_order():
    grouped = [name for _, names in STAGE_GROUPS for name in names]
    assert grouped == list(STAGE_NAMES)


@pytest.mark.parametrize("name", FORWARD_PATHS)
def test_the_last_cut_of_a_forward_is_its_output(name):
    backend, prepared = _forward(name)
    cuts = stage_programs(prepared, backend.requires)
    groups = [group for group, _ in cuts.groups]
    assert groups[0] == "projections" and groups[-1] == "output"
    with cuts.active():
        outputs = [cuts.program(index)() for index in range(len(groups))]
        empty = cuts.baseline()()  # stops before any stage (NumPy, torch: nothing), or computes a constant (JAX)
    assert np.size(empty) == (1 if "jax" in backend.requires else 0)
    assert_close(prepared.to_numpy(outputs[-1][-1]), prepared.output(), "float32", what=f"{name}: the full cut")
    # Each cut returns its own stage: the projections cut gives q, k, v with the projections' widths.
    widths = sorted(int(np.prod(np.shape(value))) for value in outputs[0])
    assert widths == sorted([2 * 7 * 24, 2 * 7 * 12, 2 * 7 * 12])


def test_a_pass_that_records_its_stages_after_its_output_is_not_cut_by_its_recorder():
    # torch-best's stage dump records after SDPA has made the output; without its own cuts, no cut is made.
    backend, prepared = _forward("torch-best")
    with pytest.raises(NoCut, match="after it has computed its output"):
        stage_programs(dataclasses.replace(prepared, stage_cuts=None), backend.requires)


BEST_PATHS = ("numpy-best", "torch-best", "jax-best", "mlx-best")
# Each path's cache after its cache-write cut, at the written slot (context 9, batch 1, one token), in the
# layout of its rotary cut's new keys (B, s, Hkv, Dk) -> (Hkv, Dk): the slot holds exactly the step's keys.
SLOT_OF = {
    "numpy-best": lambda k_cache: k_cache[0, :, 0, :, 9],  # (B, Hkv, P, Dk, L): slot 9 on the first page
    "torch-best": lambda k_cache: k_cache[0, :, 9],  # (B, Hkv, T, Dk), the view up to the write index
    "jax-best": lambda k_cache: k_cache[:, 9],  # (B*Hkv, C, Dk)
    "jax": lambda k_cache: k_cache[0, 9],  # (B, T, Hkv, Dk)
    "mlx-best": lambda k_cache: k_cache[0, :, 9],  # (B, Hkv, T, Dk), the slots written
}
NEW_KEYS = {  # the rotary cut's k_rotated -> (Hkv, Dk)
    "numpy-best": lambda k: k[0, 0],  # (B, s, Hkv, Dk)
    "torch-best": lambda k: k[0, :, 0],  # (B, Hkv, s, Dk)
    "jax-best": lambda k: k[0, 0],  # (B, s, Hkv, Dk)
    "jax": lambda k: k[0, 0],  # (B, s, Hkv, Dk), the vmapped item's
    "mlx-best": lambda k: k[0, :, 0],  # (B, Hkv, s, Dk)
}


@pytest.mark.parametrize("name", BEST_PATHS)
def test_a_best_forward_is_cut_by_its_own_programs_and_the_last_cut_is_its_output(name):
    backend, prepared = _forward(name)
    cuts = stage_programs(prepared, backend.requires)
    groups = [group for group, _ in cuts.groups]
    fused = name in ("torch-best", "mlx-best")  # SDPA keeps the scores and the softmax inside its kernel: one row
    rotary = ["rotary"] if name == "jax-best" else []  # jax-best's jitted stage dump holds q_rotated without rope too
    assert groups == ["projections", "head split", *rotary] + (
        ["scores, softmax, context (one fused kernel)"] if fused else ["scores", "softmax", "context"]
    ) + ["merge", "output"]  # fmt: skip
    with cuts.active():
        outputs = [cuts.program(index)() for index in range(len(groups))]
    assert_close(prepared.to_numpy(outputs[-1][-1]), prepared.output(), "float32", what=f"{name}: the full cut")
    widths = sorted(int(np.prod(np.shape(value))) for value in outputs[0])
    assert widths == sorted([2 * 7 * 24, 2 * 7 * 12, 2 * 7 * 12])  # q, k, v: the projections' widths


@pytest.mark.parametrize("name", (*BEST_PATHS, "jax"))
def test_a_decode_step_is_cut_with_its_cache_write_as_a_stage_of_its_own(name):
    backend, prepared = _decode_step(name, 9)
    if prepared.compile is not None:
        prepared.compile()
    before = prepared.output()
    cuts = stage_programs(prepared, backend.requires)
    groups = [group for group, _ in cuts.groups]
    assert groups[:4] == ["projections", "head split", "rotary", "cache write"] and groups[-2:] == ["merge", "output"]
    with cuts.active():  # copied at once: the next cut donates (jax-best) or rewrites (numpy) the live cache
        outputs = {
            group: [np.array(prepared.to_numpy(value)) for value in cuts.program(index)()]
            for index, group in enumerate(groups)
        }
    np.testing.assert_array_equal(SLOT_OF[name](outputs["cache write"][0]), NEW_KEYS[name](outputs["rotary"][1]))
    last = outputs["output"][0] if "jax" in backend.requires else outputs["output"][-1]
    assert_close(last, before, "float32", what=f"{name}: the decode step's last cut")
    # The cuts share the timed step's cache (jax-best's donated one included): the step is unchanged after them.
    assert_close(prepared.output(), before, "float32", what=f"{name}: the timed step after the cuts")


@pytest.mark.parametrize("place", NORM_PLACES)
def test_a_jax_decode_step_with_a_norm_before_rotary_is_cut_after_it(place):
    # The norm's place and weights come from the registry's step (`core.variants.norm_step`): its cut holds the
    # normed heads, RMS-normed per head or over the whole projection, with the step's own weights.
    cfg = dataclasses.replace(DECODE_CFG, qk_norm=place)
    backend, params, step = _backend("jax"), init_params(cfg, seed=0), norm_step(cfg)
    prepared = backend.prepare_decode(cfg, params, context=9, batch=1, step=1, dtype="float32", device="cpu", seed=0)
    cuts = stage_programs(prepared, backend.requires)
    assert [group for group, _ in cuts.groups][:4] == ["projections", "head split", "qk-norm", "rotary"]
    with cuts.active():
        projected, normed = ([np.array(prepared.to_numpy(v)) for v in cuts.program(i)()] for i in (0, 2))
    sides = (("q", projected[0], normed[0], cfg.n_heads), ("k", projected[1], normed[1], cfg.n_kv_heads))
    for which, x, heads, n in sides:
        weight = getattr(params, step.weight(which))
        split = x.reshape(*x.shape[:-1], n, cfg.d_k)  # (B, s, n*Dk) -> (B, s, n, Dk), the adapter's split
        want = rms_norm(split, weight, cfg.norm_eps) if place == "head" else rms_norm(x, weight, cfg.norm_eps)
        assert_close(heads, want.reshape(split.shape), "float32", what=f"jax: {which}_normed at {place}")


def test_a_per_head_strategy_is_refused_with_its_reason():
    backend, prepared = _forward("numpy", "slicing")
    with pytest.raises(PerHeadStages, match="one head at a time"):
        stage_programs(prepared, backend.requires)


def _decode_step(name: str, context: int):
    backend = _backend(name)
    prepared = backend.prepare_decode(DECODE_CFG, init_params(DECODE_CFG, seed=0), context=context, batch=1, step=1,
                                      dtype="float32", device="cpu", seed=0)  # fmt: skip
    return backend, prepared


@pytest.mark.parametrize("name", ("numpy", "torch"))
def test_the_last_cut_of_a_decode_step_is_its_output(name):
    backend, prepared = _decode_step(name, 9)
    cuts = stage_programs(prepared, backend.requires)
    with cuts.active():
        last = cuts.program(len(cuts.groups) - 1)()
    assert_close(prepared.to_numpy(last[-1]), prepared.output(), "float32", what=f"{name}: the decode step's cut")


def test_a_decode_step_that_cannot_be_cut_says_why():
    backend, prepared = _decode_step("numpy-best", 9)  # its stage dump is its output alone
    with pytest.raises(NoCut, match="records no stage"):
        stage_programs(dataclasses.replace(prepared, stage_cuts=None), backend.requires)


HLO = """HloModule jit_step, is_scheduled=true

%fused_transpose (param_0: f32[2,3,4]) -> f32[4,3,2] {
  %param_0 = f32[2,3,4]{2,1,0} parameter(0)
  ROOT %transpose.1 = f32[4,3,2]{2,1,0} transpose(%param_0), dimensions={2,1,0}
}

%fused_add (param_0: f32[5]) -> f32[5] {
  %param_0 = f32[5]{0} parameter(0)
  ROOT %add.0 = f32[5]{0} add(%param_0, %param_0)
}

ENTRY %main.2 (a: f32[2,3,4], b: f32[5], c: f64[7,3]) -> (f32[4,3,2], f32[5], f64[7,3]) {
  %a = f32[2,3,4]{2,1,0} parameter(0)
  %b = f32[5]{0} parameter(1)
  %c = f64[7,3]{1,0} parameter(2)
  %transpose_fusion = f32[4,3,2]{2,1,0} fusion(%a), kind=kLoop, calls=%fused_transpose
  %add_fusion = f32[5]{0} fusion(%b), kind=kLoop, calls=%fused_add
  %copy.3 = f64[7,3]{0,1} copy(%c)
  ROOT %tuple = (f32[4,3,2]{2,1,0}, f32[5]{0}, f64[7,3]{0,1}) tuple(%transpose_fusion, %add_fusion, %copy.3)
}
"""


def test_hlo_moves_names_copies_and_fusions_rooted_in_a_transpose_with_their_bytes():
    moves = hlo_moves(HLO)
    assert [(m["instruction"], m["opcode"], m["shape"], m["bytes"]) for m in moves] == [
        ("transpose_fusion", "fusion(transpose)", [4, 3, 2], 24 * 4),
        ("copy.3", "copy", [7, 3], 21 * 8),
    ]


def test_grows_with_context_matches_each_operator_by_occurrence():
    at_context = [{"op": "cat", "bytes": 1000}, {"op": "cat", "bytes": 64}, {"op": "mm", "bytes": 10}]
    at_half = [{"op": "cat", "bytes": 500}, {"op": "cat", "bytes": 64}]
    assert [entry["grows"] for entry in grows_with_context(at_context, at_half)] == [True, False, None]


def _torch_growth(name: str, context: int) -> list[dict]:
    from mha_rosetta.backends.inspect_programs import torch_allocations

    entries = []
    for tokens in (context, context // 2):
        _, prepared = _decode_step(name, tokens)
        prepared.forward()  # warm
        entries.append(torch_allocations(prepared.forward))
    return grows_with_context(*entries)


def test_torch_allocations_find_the_dynamic_cache_growth_and_none_for_torch_best():
    context = 64
    cache_bytes = 1 * DECODE_CFG.n_kv_heads * (context + 1) * DECODE_CFG.d_k * 4  # K after the step, float32
    grown = [entry for entry in _torch_growth("torch", context) if entry["grows"]]
    assert any(entry["op"] == "aten::cat" and entry["bytes"] >= cache_bytes for entry in grown), grown
    # torch-best may keep a scores-sized buffer (SDPA's, O(H T) floats: 584 B at context 64, the step's own work);
    # nothing the size of a cache (O(Hkv T Dk)) grows with the context.
    best = [entry for entry in _torch_growth("torch-best", context) if entry["grows"]]
    assert [entry for entry in best if entry["bytes"] >= cache_bytes] == [], best


def _decode_breakdown(name: str) -> dict:
    from mha_rosetta.benchmarks.breakdown import run_breakdown_cell
    from mha_rosetta.benchmarks.decode import DecodeCellSpec

    cell = DecodeCellSpec(implementation=name, context=40, d_model=24, heads=4, kv_heads=2, d_k=6, policy=TINY_POLICY)
    record = run_breakdown_cell("decode", cell, timeout=300)
    assert record["status"] == "ok", record
    return record


def test_the_hlo_of_the_jax_adapters_undonated_step_copies_its_cache_and_jax_bests_does_not():
    pytest.importorskip("jax", reason="the HLO inspection needs jax")
    from mha_rosetta.benchmarks.breakdown_markdown import cell_markdown

    record = _decode_breakdown("jax")
    assert [row["stage"] for row in record["stages"]][3] == "cache write"
    assert "| copy | f32[1, 41, 2, 6] | 1.92 KiB |" in cell_markdown(record)  # the cache, copied by the step
    adapter = record["inspection"]
    cache_shape = [1, 41, 2, 6]  # (B, T, Hkv, Dk): context 40 + the step's slot
    copies = [move for module in adapter["modules"] for move in module["moves"] if move["shape"] == cache_shape]
    assert copies and all(move["bytes"] == 41 * 2 * 6 * 4 for move in copies)
    assert adapter["recompiles"] == []
    best_record = _decode_breakdown("jax-best")
    best = best_record["inspection"]
    assert [module for module in best["modules"] if module["moves"]] == []
    assert best["recompiles"] == []
    assert "| cache write |" in cell_markdown(best_record) and "| softmax |" in cell_markdown(best_record)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--breakdown"], "--breakdown needs --backends"),
        (["--breakdown", "--backends", "numpy", "--mode", "both"], "a forward (--mode fwd) or a decode step"),
        (["--breakdown", "--backends", "numpy", "--rounds", "2"], "--breakdown does not take --rounds"),
        (["--breakdown", "--backends", "nosuch"], "nosuch"),
    ],
)
def test_the_option_refuses_bad_input_with_a_clear_error(argv, message, capsys):
    assert cli_main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_command_writes_a_breakdown_report_of_each_cell(tmp_path, capsys):
    out = tmp_path / "breakdown.json"
    argv = ["bench", "--breakdown", "--backends", "numpy,numpy:slicing", "--batch", "2", "--tokens", "9",
            "--d-model", "12", "--heads", "3", "--repeats", "3", "--min-time", "0", "--no-progress", "--json", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "breakdown" and report["mode"] == "fwd"
    numpy_cell, slicing_cell = report["cells"]
    assert numpy_cell["status"] == slicing_cell["status"] == "ok"
    assert [row["stage"] for row in numpy_cell["stages"]] == [
        "projections", "head split", "rotary", "scores", "softmax", "context", "merge", "output",
    ]  # fmt: skip
    assert numpy_cell["inspection"]["stage_copies"] == []  # the column-sample head split is a view
    assert "one head at a time" in slicing_cell["no_stages"] and "stages" not in slicing_cell
    table = capsys.readouterr().out
    assert "### numpy: forward, B=2, N=9, D=12, H=3" in table and "| softmax |" in table


def test_a_torch_forward_names_its_merge_copy_and_its_allocations():
    pytest.importorskip("torch", reason="the torch inspection needs torch")
    from mha_rosetta.benchmarks.breakdown import run_breakdown_cell
    from mha_rosetta.benchmarks.cell import CellSpec

    cell = CellSpec(implementation="torch", batch=2, tokens=9, d_model=12, heads=3, policy=TINY_POLICY)
    record = run_breakdown_cell("fwd", cell, timeout=300)
    assert record["status"] == "ok", record
    found = record["inspection"]
    # transpose(1, 2).contiguous() before the merge: (B, N, H, Dv) float32 = 2 * 9 * 3 * 4 * 4 bytes
    assert found["stage_copies"] == [{"stage": "merged", "from": "context", "bytes": 2 * 9 * 3 * 4 * 4}]
    # the four projections' outputs, each (B*N, D) float32, among the operators that kept memory
    assert sum(entry["op"] == "aten::addmm" and entry["bytes"] == 2 * 9 * 12 * 4 for entry in found["allocations"]) == 4
    assert any(row["op"] == "aten::addmm" and row["calls"] == 4 for row in found["operators"])


def test_the_breakdown_child_imports_no_numpy_or_framework_before_pinning():
    import subprocess
    import sys

    code = (
        "import sys, mha_rosetta.benchmarks.breakdown\n"
        "print(','.join(m for m in ('numpy', 'torch', 'jax') if m in sys.modules))\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == ""
