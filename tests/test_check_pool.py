"""The check's worker pool: a user adapter that hangs, spins, exits, raises, returns a wrong shape or NaN.

Each is reported as what it did (the time limit and the case named, the exit code, the
message), a good adapter next to it still agrees, the check goes on and ends, and an
interrupted check leaves a valid JSON of what finished. Small time limits keep it bounded;
no test here asserts a speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from misbehaving_adapters import Exits, Good, Hangs, Raises, ReturnsNaN, Spins, WrongShape

from conftest import requires
from mha_rosetta.checks import Status, run_check
from mha_rosetta.checks.engine import executor_for
from mha_rosetta.checks.pool import exit_description
from mha_rosetta.checks.worker import jax_cache_dir, jax_cache_environment
from mha_rosetta.cli.main import main as cli_main

TIMEOUT = 4.0
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def result():
    adapters = [Good(), Hangs(), Spins(), Exits(), Raises(), WrongShape(), ReturnsNaN()]
    with executor_for(2, timeout=TIMEOUT) as executor:
        return run_check(backends=adapters, cases=["self_attention", "causal"], dtypes=["float64"], executor=executor)


def _runs(result, case: str) -> dict:
    return {run.label: run for run in result.runs if run.case == case}


def test_every_adapter_behaves_on_the_case_it_does_not_misbehave_on(result):
    runs = _runs(result, "causal")
    assert {label: run.status for label, run in runs.items()} == dict.fromkeys(
        ["good", "hangs", "spins", "exits", "raises", "wrong-shape", "returns-nan"], Status.AGREE
    )


def test_a_hanging_and_a_spinning_adapter_time_out_naming_the_limit_the_implementation_and_the_case(result):
    runs = _runs(result, "self_attention")
    for label in ("hangs", "spins"):
        assert runs[label].status is Status.ERROR
        assert runs[label].reason.startswith(f"timed out: {label} on case self_attention (float64) ")
        assert f"time limit of {TIMEOUT:g} s (--timeout)" in runs[label].reason
        assert "killed and replaced" in runs[label].reason


def test_an_adapter_that_ends_its_process_is_reported_with_its_exit_code(result):
    run = _runs(result, "self_attention")["exits"]
    assert run.status is Status.ERROR
    assert run.reason.startswith("the worker process died (exit code 3) while running exits on case self_attention")


def test_raising_wrong_shape_and_nan_are_reported_as_in_process(result):
    runs = _runs(result, "self_attention")
    assert runs["raises"].status is Status.ERROR
    assert runs["raises"].reason == "RuntimeError: adapter bug: index out of range"
    assert runs["wrong-shape"].status is Status.ERROR
    assert runs["wrong-shape"].reason == "output has shape (2, 7, 14), expected (2, 7, 15) (batch, q_tokens, d_model)"
    assert runs["returns-nan"].status is Status.DISAGREE and "NaN" in runs["returns-nan"].reason


def test_the_good_adapter_still_agrees_and_the_exit_status_is_an_error(result):
    assert _runs(result, "self_attention")["good"].status is Status.AGREE
    assert len(result.runs) == 14 and not result.interrupted
    assert result.exit_status == 2  # errors outrank the NaN disagreement (1)
    compared = {(p.a.label, p.b.label) for p in result.pairs if p.case == "self_attention"}
    assert compared == {("good", "returns-nan")}  # the runs that produced an output of the right shape


def test_the_pool_gives_the_same_answers_as_one_process():
    """Same statuses and the same numbers, run in workers or here."""
    kwargs = dict(backends=["numpy"], cases=["self_attention", "gqa"], dtypes=["float64", "float16"])
    with executor_for(2, timeout=60) as executor:
        pooled = run_check(**kwargs, executor=executor)
    inline = run_check(**kwargs)
    key = lambda r: (r.case, r.label, r.dtype, str(r.status), r.max_abs, r.max_rel)  # noqa: E731
    assert [key(r) for r in pooled.runs] == [key(r) for r in inline.runs]
    assert [(p.a.label, p.b.label, p.status, p.max_abs) for p in pooled.pairs] == [
        (p.a.label, p.b.label, p.status, p.max_abs) for p in inline.pairs
    ]
    assert pooled.timings["jobs"] == 2 and pooled.timings["backends"]["numpy"]["runs"] == len(pooled.runs)


def test_exit_descriptions():
    assert exit_description(3) == "exit code 3"
    assert exit_description(-signal.SIGKILL) == "signal SIGKILL"
    assert exit_description(None) == "no exit status"


def test_the_jax_cache_lives_in_the_users_cache_directory_and_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jax_cache_dir() == tmp_path / "mha-rosetta" / "xla"
    environment = jax_cache_environment(True)
    assert environment["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "mha-rosetta" / "xla")
    # The project's own programs: compiled executables, keyed by what builds them (`backends.jax.executables`).
    assert environment["MHA_ROSETTA_JAX_EXECUTABLES"] == str(tmp_path / "mha-rosetta" / "executables")
    # The check's programs compile in milliseconds: without these, JAX would cache none of them.
    assert environment["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert environment["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "-1"
    assert jax_cache_environment(False) == {}
    from mha_rosetta.checks.worker import cache_enabled

    monkeypatch.setenv("MHA_ROSETTA_JAX_CACHE", "0")
    assert cache_enabled() is False and cache_enabled(True) is True


def test_workers_compile_with_the_fast_xla_settings_unless_switched_off_and_the_users_flags_win(monkeypatch):
    from mha_rosetta.checks.worker import FAST_COMPILE_FLAGS, fast_compile_enabled, worker_environment

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("MHA_ROSETTA_FAST_COMPILE", raising=False)
    assert fast_compile_enabled() is True
    assert worker_environment(False, True) == {"XLA_FLAGS": " ".join(FAST_COMPILE_FLAGS)}
    assert worker_environment(False, False) == {}  # XLA's defaults: nothing set
    # A user's own flags come last, so that one of theirs that sets the same option wins (XLA reads left to right).
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
    assert worker_environment(False, True)["XLA_FLAGS"] == (
        "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0 "
        "--xla_cpu_parallel_codegen_split_count=1 --xla_backend_optimization_level=2"
    )
    assert worker_environment(False, False) == {"XLA_FLAGS": "--xla_backend_optimization_level=2"}
    monkeypatch.setenv("MHA_ROSETTA_FAST_COMPILE", "0")
    assert fast_compile_enabled() is False and fast_compile_enabled(True) is True


@requires("jax")
@pytest.mark.parametrize("option", ([], ["--no-fast-compile"]))
def test_the_json_says_which_xla_flags_the_workers_compiled_with(tmp_path, monkeypatch, option):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("MHA_ROSETTA_FAST_COMPILE", raising=False)
    path = tmp_path / "check.json"
    args = ["check", "--backends", "jax", "--cases", "gqa", "--jobs", "1", "--quiet"]
    assert cli_main([*args, *option, "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["summary"]["runs"]["agree"] >= 2  # jax and jax:chunked, compiled in the worker
    assert report["timings"]["xla_flags"] == (
        ""
        if option
        else "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0 "
        "--xla_cpu_parallel_codegen_split_count=1"
    )


def _check_good_and(adapter: str, *, cases: str, timeout: int, json_path) -> list[str]:
    """``mha-rosetta check`` of Good and one misbehaving adapter in float64, two workers, plain output, JSON written."""
    options = ["--cases", cases, "--dtypes", "float64", "--jobs", "2", "--timeout", str(timeout), "--plain"]
    backends = ["--backend", "misbehaving_adapters:Good", "--backend", f"misbehaving_adapters:{adapter}"]
    main = "import sys; from mha_rosetta.cli.main import main; sys.exit(main())"
    return [sys.executable, "-c", main, "check", *backends, *options, "--json", str(json_path)]


def test_the_command_reports_a_dead_worker_and_writes_every_result(tmp_path):
    path = tmp_path / "check.json"
    args = _check_good_and("Exits", cases="self_attention,causal", timeout=30, json_path=path)
    done = subprocess.run(args, cwd=TESTS, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    data = json.loads(path.read_text())
    assert data["interrupted"] is False and data["exit_status"] == 2
    statuses = {(r["implementation"], r["case"]): r["status"] for r in data["runs"]}
    assert statuses == {
        ("good", "self_attention"): "agree",
        ("exits", "self_attention"): "error",
        ("good", "causal"): "agree",
        ("exits", "causal"): "agree",
    }
    assert "exit code 3" in next(r["reason"] for r in data["runs"] if r["status"] == "error")


def test_sigterm_leaves_a_valid_json_of_what_finished_marked_interrupted(tmp_path):
    path = tmp_path / "check.json"
    # causal (every adapter behaves) runs first, then self_attention, where one adapter hangs.
    args = _check_good_and("Hangs", cases="causal,self_attention", timeout=300, json_path=path)
    process = subprocess.Popen(args, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not path.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        assert path.exists(), "no partial JSON was written"
        partial = json.loads(path.read_text())  # written while the check still runs: valid, marked interrupted
        assert partial["interrupted"] is True and partial["exit_status"] == 130
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    data = json.loads(path.read_text())
    assert data["interrupted"] is True and data["exit_status"] == 130
    statuses = {(r["implementation"], r["case"]): r["status"] for r in data["runs"]}
    assert statuses[("good", "causal")] == "agree" and statuses[("hangs", "causal")] == "agree"
    # The group still running (self_attention: hangs never finished) is left out whole.
    assert set(statuses) == {("good", "causal"), ("hangs", "causal")}
    assert [p.name for p in tmp_path.iterdir()] == ["check.json"]  # no temporary file left behind


def test_estimated_seconds_put_the_compiling_backends_first():
    from mha_rosetta.backends import REGISTRY
    from mha_rosetta.checks.pool import JAX_RUN_SECONDS, OTHER_RUN_SECONDS, PROCESS_RUN_SECONDS, estimated_seconds

    assert estimated_seconds(("jax",), 54) == pytest.approx(JAX_RUN_SECONDS * 54)
    assert estimated_seconds(("jax", "flax"), 10) == pytest.approx(JAX_RUN_SECONDS * 10)
    assert estimated_seconds((), 10) == pytest.approx(OTHER_RUN_SECONDS * 10)
    assert estimated_seconds(("torch",), 10, own_processes=True) == pytest.approx(
        (OTHER_RUN_SECONDS + PROCESS_RUN_SECONDS) * 10
    )
    assert estimated_seconds(("jax",), 10, measured=0.02) == pytest.approx(0.2)  # measured here: that wins
    # 135 NumPy runs are less work than 27 einops-jax runs, though they are five times as many.
    assert estimated_seconds(REGISTRY["numpy"].requires, 135) < estimated_seconds(REGISTRY["einops-jax"].requires, 27)
    # torch-tp's process group: more than eager torch, less than a JAX backend (0.33 s a run measured cold).
    from mha_rosetta.backends.sharded.torch import TorchTPBackend  # the class: torch is imported only when it runs

    tp = estimated_seconds(REGISTRY["torch-tp"].requires, 54, own_processes=TorchTPBackend.own_processes)
    assert estimated_seconds(REGISTRY["torch"].requires, 54) < tp < estimated_seconds(REGISTRY["jax"].requires, 54)


def test_the_scheduler_starts_the_longest_work_first_and_keeps_a_worker_on_its_backend():
    from types import SimpleNamespace

    from mha_rosetta.checks.pool import WorkerPool

    pool = WorkerPool(jobs=2, cache=False)  # no worker starts until there is work; no history of earlier checks
    try:
        pending = {"numpy": 135, "torch": 135, "flax": 27, "jax": 54, "einops-jax": 27}
        requires = {"numpy": (), "torch": ("torch",), "flax": ("flax", "jax"), "jax": ("jax",), "einops-jax": ("jax",)}
        for name, runs in pending.items():
            pool.pending[name].extend(f"{name}/{i}" for i in range(runs))
            pool.requires[name] = requires[name]
        first = SimpleNamespace(last=None, imported=set(), task=None)
        second = SimpleNamespace(last=None, imported=set(), task=None)
        pool.workers = [first, second]
        assert pool._choose(first) == "jax/0"  # 54 x 0.5 s: the most work, though numpy has more runs
        first.last, first.task, first.imported = "jax", "jax/0", {"jax"}
        assert pool._choose(second) == "einops-jax/0"  # jax is taken: the next most work
        second.last, second.task = "einops-jax", "einops-jax/0"
        assert pool._choose(first) == "jax/1"  # a worker stays on its backend while it has runs
        pool.pending["jax"].clear()
        assert pool._choose(first) == "flax/0"  # then flax (13.5 s) before torch and numpy (4 s each)
    finally:
        pool.workers = []
        pool.close()


def test_the_probe_deals_a_library_to_the_worker_that_imports_its_framework():
    from mha_rosetta.checks.pool import deal_imports

    tops = ["numpy", "torch", "jax", "einops", "flax", "equinox", "transformers"]
    # flax and equinox run on JAX only, transformers on torch only (the registry's requires); einops on any.
    assert deal_imports(tops, 2) == [["jax", "flax", "equinox"], ["torch", "transformers", "numpy", "einops"]]
    assert deal_imports(tops, 1) == [["jax", "flax", "equinox", "torch", "transformers", "numpy", "einops"]]
    assert deal_imports(["numpy"], 4) == [["numpy"]]  # no worker is asked for nothing


def _pool_with(pending: dict, requires: dict, **options):
    from collections import deque

    from mha_rosetta.checks.pool import WorkerPool

    pool = WorkerPool(jobs=2, **options)
    for name, runs in pending.items():
        pool.pending[name] = deque(f"{name}/{i}" for i in range(runs))
        pool.requires[name] = requires[name]
    return pool


def test_a_backend_with_processes_of_its_own_is_not_joined_by_a_second_worker():
    from types import SimpleNamespace

    from mha_rosetta.backends.sharded.jax import JaxShardedBackend
    from mha_rosetta.backends.sharded.torch import TorchTPBackend

    assert TorchTPBackend.own_processes and JaxShardedBackend.own_processes
    pool = _pool_with({"torch-tp": 10, "jax": 10}, {"torch-tp": ("torch",), "jax": ("jax",)}, cache=False)
    try:
        pool.solo = {"torch-tp"}
        busy = SimpleNamespace(last="torch-tp", imported={"torch"}, task="torch-tp/x")
        other = SimpleNamespace(last="jax", imported={"jax"}, task="jax/x")
        idle = SimpleNamespace(last=None, imported=set(), task=None)
        pool.workers = [busy, other, idle]
        pool.pending["jax"].clear()
        assert pool._choose(idle) is None  # torch-tp's runs wait for its worker: no second group of ranks
        pool.pending["jax"].append("jax/9")
        assert pool._choose(idle) == "jax/9"  # every backend is taken: an idle worker joins a plain one
        pool.solo = set()
        assert pool._choose(idle) == "torch-tp/0"  # without the rule it would join torch-tp (the most work)
    finally:
        pool.workers = []
        pool.close()


def test_the_scheduler_orders_by_the_seconds_measured_last_time_and_keeps_them(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from mha_rosetta.checks import pool as pool_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MHA_ROSETTA_JAX_CACHE", raising=False)
    pool_module.save_history({"ForwardJob|torch-tp": [14.4, 100], "ForwardJob|jax": [2.5, 100]})
    assert pool_module.load_history() == {"ForwardJob|torch-tp": pytest.approx(0.144), "ForwardJob|jax": 0.025}
    requires = {"torch-tp": ("torch",), "jax": ("jax",)}
    pool = _pool_with({"torch-tp": 54, "jax": 54}, requires)
    try:
        pool.job_name = "ForwardJob"
        fresh = SimpleNamespace(last=None, imported=set(), task=None)
        pool.workers = [fresh]
        # Measured: 54 x 0.144 s against 54 x 0.025 s (from the registry alone: 0.33 against 0.5, an empty cache's).
        assert pool._choose(fresh) == "torch-tp/0"
        # The imports a worker would add count against the work: one that has JAX takes jax when it is close.
        pool.history["ForwardJob|jax"] = 0.120
        has_jax = SimpleNamespace(last=None, imported={"jax"}, task=None)
        pool.workers = [has_jax]
        assert pool._choose(has_jax) == "jax/0"
        pool.measured = {"ForwardJob|jax": [1.0, 4]}
    finally:
        pool.workers = []
        pool.close()  # saves what it measured, merged into the file
    assert pool_module.load_history()["ForwardJob|jax"] == pytest.approx(0.25)
    assert pool_module.load_history()["ForwardJob|torch-tp"] == pytest.approx(0.144)
    off = _pool_with({}, {}, cache=False)  # the cache switched off: no history read or written
    assert off.history == {}
    off.measured = {"ForwardJob|numpy": [1.0, 1]}
    off.close()
    assert "ForwardJob|numpy" not in pool_module.load_history()
    pool_module.history_path().write_text("not json")
    assert pool_module.load_history() == {}


def test_the_parent_plans_a_gqa_check_without_importing_a_framework():
    """The workers import the frameworks; the parent, which plans and compares, imports none (SDPA's GQA
    support is read from torch's metadata: importing torch there cost 1.7 s of every check's start)."""
    code = (
        "import sys; from mha_rosetta.cli.main import main\n"
        "status = main(['check', '--cases', 'gqa,mqa', '--backends', 'numpy,torch-sdpa,jax', '--quiet', '--jobs', '1'])\n"
        "print(status, sorted(m for m in ('torch', 'jax', 'flax', 'equinox', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "0 []"


def test_the_partial_json_is_rewritten_at_most_once_per_interval(monkeypatch):
    """One update when the first group finishes, then none until the interval has passed, and the last at the end
    (it was rewritten after every group: 67 rewrites of a 3.9 MB file in the default check)."""
    from mha_rosetta.checks import engine, run_check

    updates = []
    monkeypatch.setattr(engine, "UPDATE_SECONDS", 1e9)
    result = run_check(backends="numpy", cases="self_attention,gqa,mqa,causal", on_update=updates.append)
    assert len({(run.case, run.dtype) for run in result.runs}) >= 4  # four groups finished...
    assert len(updates) == 2  # ...the first written at once, then only the final result


def _processes_marked(mark: str) -> list[int]:
    """The live processes whose environment holds ``mark`` (a check run with it, and everything it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to list processes")
def test_a_check_with_sharded_backends_leaves_no_process_behind(tmp_path):
    """The workers end without the interpreter's shutdown (`checks.worker._leave`), after stopping their sharded
    backends' own processes: when the command returns, none of them is left."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    mark = f"MHA_ROSETTA_TEST_MARK={tmp_path.name}"
    env = {**os.environ, "MHA_ROSETTA_TEST_MARK": tmp_path.name, "XDG_CACHE_HOME": str(tmp_path)}
    command = [sys.executable, "-m", "mha_rosetta.cli", "check", "--cases", "heads_split", "--quiet"]
    # Output to files, not pipes: a process left behind would hold a pipe open, and `run` would wait for it.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        done = subprocess.run(
            [*command, "--backends", "numpy,torch-tp,jax-sharded", "--jobs", "2"], env=env, stdout=out, stderr=err
        )
    assert done.returncode == 0, (tmp_path / "err").read_text()[-2000:]
    assert "agree" in (tmp_path / "out").read_text()
    # multiprocessing's resource tracker ends a moment after the command (its pipe closes): a few seconds' grace.
    deadline = time.monotonic() + 5.0
    while _processes_marked(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_marked(mark) == []


_MAPPINGS_PER_PROGRAM = r"""
import numpy as np
from mha_rosetta.backends import get_backend
from mha_rosetta.core import MHAConfig, init_params
def mappings():
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)
backend = get_backend("jax")
cfg = MHAConfig(d_model=15, n_heads=3, d_k=6, d_v=6, causal=True, rope="half")
params = init_params(cfg, seed=0)
backend.run(cfg, params, np.ones((2, 3, 15)), dtype="float32")  # JAX's own first programs, before the count
before = mappings()
for tokens in range(4, 14):  # 10 programs of the jax adapter (each token count compiles anew)
    backend.run(cfg, params, np.ones((2, tokens, 15)), dtype="float32")
print((mappings() - before) / 10)
"""


@requires("jax")
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="counts memory mappings in /proc/self/maps (Linux)")
def test_one_codegen_module_per_program_keeps_fewer_memory_mappings():
    # Each part of a split program's codegen took mappings of its own; a long-lived process that compiled about
    # 1200 programs reached vm.max_map_count (65530) and XLA crashed (checks.worker.FAST_COMPILE_FLAGS).
    from mha_rosetta.checks.worker import FAST_COMPILE_FLAGS

    def per_program(flags) -> float:
        env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(
            [sys.executable, "-c", _MAPPINGS_PER_PROGRAM], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout.strip().splitlines()[-1])

    split = [flag for flag in FAST_COMPILE_FLAGS if not flag.startswith("--xla_cpu_parallel_codegen_split_count")]
    assert len(split) == len(FAST_COMPILE_FLAGS) - 1
    # Measured with jaxlib 0.10.2: 3.4 mappings a program with it, 27.1 without.
    assert 2 * per_program(FAST_COMPILE_FLAGS) < per_program(split)
