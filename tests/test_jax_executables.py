"""The executable cache (`backends.jax.executables`): a warm check reads the project's compiled programs.

What must hold: a program read back gives the freshly compiled program's bits; everything that
decides a program (its key, the arguments' shapes, dtypes and tree, the matmul precision, x64, the
source, the versions and flags) names another entry; a broken entry is deleted and compiled again;
a user's adapter and an executable that JAX's own cache served are never stored; and across two
processes (as a check's workers are) the second reads every program the first compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from adapter_cases import random_inputs

from conftest import D_MODEL, HEADS, requires
from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_mha

pytestmark = requires("jax")

CFG = MHAConfig(d_model=D_MODEL, n_heads=HEADS, causal=True)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """The executable cache on in this process, in an empty directory, with no program shared from earlier tests."""
    from mha_rosetta.backends.jax import common, executables

    monkeypatch.setenv(executables.SWITCH, str(tmp_path))
    monkeypatch.setattr(common, "_PROGRAMS", {})
    monkeypatch.setattr(executables, "STATS", type(executables.STATS)())
    return executables


def _output(name: str, seed: int, dtype: str = "float32", strategy: str = "standard", cfg: MHAConfig = CFG):
    from mha_rosetta.backends import get_backend

    params = init_params(cfg, seed=seed)
    query, _, _, mask = random_inputs(cfg, cross=False, padding=True, padded_item=1, seed=seed)
    prepared, _ = get_backend(name).prepare(cfg, params, query, mask=mask, dtype=dtype, strategy=strategy)
    prepared.compile()
    return prepared.output(), reference_mha(cfg, params, query, mask=mask)


def _entries(path) -> list[str]:
    return sorted(entry.name for entry in path.iterdir() if entry.suffix == ".jaxexe")


@pytest.mark.parametrize(("name", "strategy"), [("jax", "standard"), ("jax", "chunked"), ("equinox", "standard")])
def test_a_program_read_back_gives_the_fresh_programs_bits(cache, monkeypatch, tmp_path, name, strategy):
    if name == "equinox":
        pytest.importorskip("equinox")
    from mha_rosetta.backends.jax import common

    _output(name, 1, strategy=strategy)  # compiled and stored
    assert cache.STATS["compiled"] == 1 and len(_entries(tmp_path)) == 1
    monkeypatch.setattr(common, "_PROGRAMS", {})  # as a new process: nothing shared in memory
    read, expected = _output(name, 2, strategy=strategy)
    assert cache.STATS["loaded"] == 1 and cache.STATS["compiled"] == 1
    assert_close(read, expected, "float32")  # seed 2's answer: the parameters are arguments of the stored program
    monkeypatch.setenv(cache.SWITCH, str(tmp_path / "other"))  # an empty cache: compiled afresh
    monkeypatch.setattr(common, "_PROGRAMS", {})
    again, _ = _output(name, 2, strategy=strategy)
    np.testing.assert_array_equal(read, again)


def test_everything_that_decides_a_program_names_another_entry(cache, monkeypatch):
    import jax
    import jax.numpy as jnp

    a32, a16 = jnp.ones((2, 3), jnp.float32), jnp.ones((2, 3), jnp.bfloat16)
    base = cache.program_digest(("k", CFG), (a32,))
    assert base == cache.program_digest(("k", CFG), (jnp.zeros((2, 3), jnp.float32),))  # values are not in it
    others = [
        cache.program_digest(("k", MHAConfig(d_model=D_MODEL, n_heads=HEADS, causal=False)), (a32,)),  # the key
        cache.program_digest(("k", CFG), (a16,)),  # a dtype
        cache.program_digest(("k", CFG), (jnp.ones((3, 2), jnp.float32),)),  # a shape
        cache.program_digest(("k", CFG), ((a32,),)),  # the tree
        cache.program_digest(("k", CFG), (a32, a32)),
    ]
    with jax.default_matmul_precision("highest"):
        others.append(cache.program_digest(("k", CFG), (a32,)))  # the precision
    monkeypatch.setattr(cache, "source_digest", lambda: "edited")
    others.append(cache.program_digest(("k", CFG), (a32,)))  # an edit to the project's code
    assert len({base, *others}) == len(others) + 1
    # Never an entry: a key that names an object by its address, an argument that is not a JAX array.
    assert cache.program_digest(("k", object()), (a32,)) is None
    assert cache.program_digest(("k",), (np.ones(3),)) is None
    assert cache.program_digest(None, (a32,)) is None


def test_x64_and_the_environment_are_in_the_digest(cache, monkeypatch):
    import jax.numpy as jnp

    text = cache.environment_text()
    for library in ("jax=", "jaxlib=", "numpy=", "python="):
        assert library in text
    a = jnp.ones(3, jnp.float32)
    before = cache.program_digest(("k",), (a,))
    monkeypatch.setattr(cache, "environment_text", lambda: text + "|--xla_some_flag")
    assert cache.program_digest(("k",), (a,)) != before


def test_a_broken_entry_is_deleted_and_compiled_again(cache, monkeypatch, tmp_path):
    from mha_rosetta.backends.jax import common

    _output("jax", 1)
    (entry,) = _entries(tmp_path)
    (tmp_path / entry).write_bytes(b"not an executable")
    monkeypatch.setattr(common, "_PROGRAMS", {})
    output, expected = _output("jax", 3)
    assert_close(output, expected, "float32")
    assert cache.STATS["loaded"] == 0 and cache.STATS["compiled"] == 2
    assert _entries(tmp_path) == [entry]  # written again, whole


def test_nothing_is_stored_where_the_cache_is_off_or_not_allowed(cache, monkeypatch, tmp_path):
    from mha_rosetta.backends.jax import common

    with cache.allowed(False):  # the check's worker, running a user's adapter
        assert cache.directory() is None
        _output("jax", 1)
    assert _entries(tmp_path) == [] and cache.STATS["uncached"] == 1
    monkeypatch.delenv(cache.SWITCH)
    monkeypatch.setattr(common, "_PROGRAMS", {})
    _output("jax", 1)
    assert _entries(tmp_path) == []
    _, jitted = common.shared_program(("plain",), lambda x: x)
    assert not isinstance(jitted, cache.CachedJit)  # off: the plain jax.jit, nothing added to its calls


def _child(code: str, env: dict) -> dict:
    script = textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_TWO_PROGRAMS = """
    import json
    import numpy as np
    from mha_rosetta.backends import get_backend
    from mha_rosetta.backends.jax import executables
    from mha_rosetta.core import MHAConfig, init_params
    cfg = MHAConfig(d_model=16, n_heads=4, causal=True)
    query = np.random.default_rng(0).standard_normal((2, 5, 16))
    outputs = []
    for dtype in ("float32", "float64"):
        prepared, _ = get_backend("jax").prepare(cfg, init_params(cfg, seed=0), query, dtype=dtype)
        prepared.compile()
        outputs.append(np.asarray(prepared.output()).tobytes().hex())
    print(json.dumps({"stats": dict(executables.STATS), "outputs": outputs}))
"""


def test_a_second_process_reads_every_program_the_first_compiled(tmp_path):
    env = {"MHA_ROSETTA_JAX_EXECUTABLES": str(tmp_path / "executables"), "JAX_PLATFORMS": "cpu"}
    first = _child(_TWO_PROGRAMS, env)
    second = _child(_TWO_PROGRAMS, env)
    assert first["stats"] == {"compiled": 2}
    assert second["stats"] == {"loaded": 2}
    assert second["outputs"] == first["outputs"]  # the same bits, float32 and float64


def test_an_executable_that_jaxs_own_cache_served_is_not_stored(tmp_path):
    """XLA:CPU's executables read from JAX's cache lose their kernels when serialized again: never stored."""
    code = """
        import json
        import jax, jax.numpy as jnp
        from mha_rosetta.backends.jax import executables
        f = jax.jit(lambda x: jnp.tanh(x) @ x.T)
        x = jnp.ones((8, 8), jnp.float32)
        f.lower(x).compile()  # the plain program: into JAX's persistent cache
        executables.compile_program(jax.jit(lambda x: jnp.tanh(x) @ x.T), (x,), ("served",))
        print(json.dumps({"stats": dict(executables.STATS), "files": len(list(executables.directory().glob("*.jaxexe")))}))
    """
    env = {
        "MHA_ROSETTA_JAX_EXECUTABLES": str(tmp_path / "executables"),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        "JAX_PLATFORMS": "cpu",
    }
    for _process in range(2):  # the plain program goes into JAX's cache; then JAX's cache serves it, twice
        answer = _child(code, env)
        assert answer["stats"] == {"uncached": 1}
        assert answer["files"] == 0
    # ...and a program compiled on this cache's miss is kept out of JAX's cache, so the next process stores it.
    (tmp_path / "xla").rename(tmp_path / "xla-old")
    fresh = """
        import json
        import jax, jax.numpy as jnp
        from mha_rosetta.backends.jax import executables
        x = jnp.ones((8, 8), jnp.float32)
        xla = executables.directory().parent / "xla"
        before = sorted(xla.glob("*"))  # the eager jnp.ones above is one of JAX's cached programs
        executables.compile_program(jax.jit(lambda x: jnp.tanh(x) @ x.T), (x,), ("served",))
        print(json.dumps({"stats": dict(executables.STATS), "xla": len(sorted(xla.glob("*"))) - len(before)}))
    """
    answer = _child(fresh, env)
    assert answer["stats"] == {"compiled": 1}
    assert answer["xla"] == 0


def test_a_static_arguments_value_names_its_own_entry(cache, monkeypatch, tmp_path):
    """A jit's static arguments (the jax decoder's vmap axes) join the key; the executable takes the others."""
    import jax.numpy as jnp

    from mha_rosetta.backends.jax import common

    def scaled(factor, x):
        return x * factor[0]

    x = jnp.arange(3.0, dtype=jnp.float32)
    _, jitted = common.shared_program(("scaled",), scaled, static_argnums=(0,))
    np.testing.assert_array_equal(jitted((2.0,), x), [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(jitted((3.0,), x), [0.0, 3.0, 6.0])  # another static value: another program
    assert cache.STATS["compiled"] == 2 and len(_entries(tmp_path)) == 2
    monkeypatch.setattr(common, "_PROGRAMS", {})
    _, jitted = common.shared_program(("scaled",), scaled, static_argnums=(0,))
    np.testing.assert_array_equal(jitted((3.0,), x), [0.0, 3.0, 6.0])
    np.testing.assert_array_equal(jitted((2.0,), x), [0.0, 2.0, 4.0])
    assert cache.STATS["loaded"] == 2 and cache.STATS["compiled"] == 2
