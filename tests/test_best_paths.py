"""Each framework's best path (`backends.best`): it agrees with the oracle, and it does what makes it the best.

No test here times anything. The fairness tests assert what a timing would only suggest:

* the JAX step's compiled program (compiled as the benchmark compiles it) aliases its cache
  parameters to its outputs (the cache is donated) and holds no copy or transpose of anything as
  large as a cache or a weight;
* torch's step allocates nothing that grows with the context (torch's profiler, 1k against 4k
  tokens) and concatenates nothing;
* NumPy's step reads each kv head's keys and values once (its GEMMs' operands, counted through
  ``np.matmul``), where a broadcast over the group would read them once per query head;
* MLX's step holds nothing that grows like its cache (``mx.get_peak_memory``, 1k against 4k tokens) and
  concatenates nothing the size of a cache (``mx.concatenate`` metered), where mlx-lm's stepped cache does.

Each meter is shown to see the thing it rules out (a donation-free step, the torch adapter's
growing cache, a product broadcast over the group), so none of these tests can pass by measuring
nothing. Sizes are distinct (tokens 7, d_model 24, 6 heads on 2 kv heads, d_k 4) wherever no
fairness meter needs its own.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import installed_backend
from mha_rosetta.backends import get_backend
from mha_rosetta.backends.best.common import decode_step_inputs
from mha_rosetta.backends.best.numpy import KV_BLOCK  # NumPy only: its page of cache slots
from mha_rosetta.core import (
    MHAConfig,
    apply_rotary,
    assert_close,
    init_params,
    reference_mha,
    reference_mha_vjp,
    softmax_with_empty_rows,
)
from mha_rosetta.core.decode import reference_decode

BEST = ("numpy-best", "torch-best", "jax-best")
GQA = MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, d_k=4, rope="half", causal=True)
CROSS = MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, d_k=4, kdim=11, vdim=9, bias="qkv")
DTYPES = ("float64", "float32")


def _best(name: str):
    return installed_backend(name)


def _tokens(shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def _padding(batch: int, kv_tokens: int, q_tokens: int) -> np.ndarray:
    mask = np.ones((batch, 1, q_tokens, kv_tokens), dtype=bool)  # (B, 1, Nq, Nk)
    mask[1, :, :, kv_tokens - 2 :] = False  # item 1's last two keys are padding
    mask[0, :, 3, :] = False  # item 0's query 3 sees nothing: the spec's zero row
    return mask


# -- agreement with the oracle ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", BEST)
def test_the_forward_agrees_with_the_oracle(name, dtype):
    backend = _best(name)
    x = _tokens((2, 7, 24), 1)
    params = init_params(GQA, seed=2)
    assert_close(backend.run(GQA, params, x, dtype=dtype), reference_mha(GQA, params, x), dtype, what=name)
    key, value = _tokens((2, 5, 11), 3), _tokens((2, 5, 9), 4)
    params, mask = init_params(CROSS, seed=5), _padding(2, 5, 7)
    actual = backend.run(CROSS, params, x, key, value, mask, dtype=dtype)
    expected = reference_mha(CROSS, params, x, key, value, mask)
    np.testing.assert_array_equal(expected[0, 3], params.b_o if params.b_o is not None else 0.0)  # the zero row
    assert_close(actual, expected, dtype, what=f"{name} cross-attention with padding")


@pytest.mark.parametrize("name", BEST)
def test_the_backward_agrees_with_the_oracle(name):
    backend = _best(name)
    x, key, value = _tokens((2, 7, 24), 6), _tokens((2, 5, 11), 7), _tokens((2, 5, 9), 8)
    for cfg, args in ((GQA, (x,)), (CROSS, (x, key, value, _padding(2, 5, 7)))):
        params = init_params(cfg, seed=9)
        actual = backend.run_vjp(cfg, params, *args, dtype="float64").tensors()
        expected = reference_mha_vjp(cfg, params, *args).tensors()
        assert list(actual) == list(expected)  # every gradient there is, no more (CROSS has no output bias)
        for grad_name, grad in expected.items():
            assert_close(actual[grad_name], grad, "float64", what=f"{name} d{grad_name}")


@pytest.mark.parametrize("name", BEST)
def test_a_decode_run_agrees_with_the_full_forward(name):
    backend = _best(name)
    params = init_params(GQA, seed=10)
    x = _tokens((2, 7, 24), 11)
    right = np.ones((2, 7), dtype=bool)
    right[0, 5:] = False  # item 0: two pads after its real tokens
    left = np.ones((2, 7), dtype=bool)
    left[1, :2] = False  # item 1: two pads before (positions -1: they see nothing)
    # numpy-best allocates whole pages of `best.numpy.KV_BLOCK` slots; the others the run's 7 tokens.
    slots = -(-7 // KV_BLOCK) * KV_BLOCK if name == "numpy-best" else 7
    for prefill, step, mask in ((3, 1, None), (2, 2, None), (7, 1, None), (3, 1, right), (3, 2, left)):
        expected = reference_decode(GQA, params, x, prefill=prefill, step=step, mask=mask)
        prepared, _ = backend.prepare_decode_run(GQA, params, x, prefill=prefill, step=step, mask=mask)
        assert_close(prepared.output(), expected, "float64", what=f"{name} prefill {prefill} step {step}")
        assert prepared.info["cache"] == {
            "kind": "static",
            "layout": backend.decode_layouts["static"].split(" preallocated")[0],
            "slots": slots,
            "bytes": 2 * 2 * slots * (4 + 4) * 8,  # B x Hkv x slots x (Dk + Dv) x float64
        }
    actual = backend.run_decode(GQA, params, x, prefill=3, dtype="float32")
    assert_close(actual, reference_decode(GQA, params, x, prefill=3), "float32", what=f"{name} in float32")


def expected_step(cfg: MHAConfig, params, data) -> np.ndarray:
    """The float64 step from its inputs: the new tokens' q, k, v, rotated, over the cache grown by them."""
    B, s, _ = data.x.shape
    H, Hkv, Dk, Dv = cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v

    def heads(w, b, n, d):  # (B, s, in) -> (B, n, s, d)
        y = data.x @ w.T + (0.0 if b is None else b)
        return y.reshape(B, s, n, d).transpose(0, 2, 1, 3)

    q, k = heads(params.w_q, params.b_q, H, Dk), heads(params.w_k, params.b_k, Hkv, Dk)
    v = heads(params.w_v, params.b_v, Hkv, Dv)
    if data.tables is not None:
        cos, sin = (t[:, None] for t in data.tables)  # (1, 1, s, r/2)
        q, k = apply_rotary(q, cos, sin, cfg.rope), apply_rotary(k, cos, sin, cfg.rope)
    keys, values = np.concatenate([data.k, k], axis=2), np.concatenate([data.v, v], axis=2)  # (B, Hkv, T, d)
    contexts = []
    for h in range(H):
        g = cfg.kv_head_of(h)
        scores = cfg.scale * q[:, h] @ keys[:, g].swapaxes(-1, -2)  # (B, s, T)
        if data.allowed is not None:
            scores = np.where(data.allowed[:, 0], scores, -np.inf)
        contexts.append(softmax_with_empty_rows(scores) @ values[:, g])  # (B, s, Dv)
    return np.concatenate(contexts, axis=-1) @ params.w_o.T + (0.0 if params.b_o is None else params.b_o)


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("name", BEST)
def test_the_timed_step_agrees_with_the_step_written_out(name, step):
    backend = _best(name)
    params = init_params(GQA, seed=12)
    prepared = backend.prepare_decode(GQA, params, context=9, batch=2, step=step, dtype="float64", seed=13)
    if prepared.compile is not None:
        prepared.compile()
    data = decode_step_inputs(GQA, batch=2, context=9, step=step, seed=13)
    expected = expected_step(GQA, params, data)
    for _ in range(2):  # the same step every call: the cache each call writes is the one the next reads
        assert_close(prepared.output(), expected, "float64", what=f"{name} step of {step}")
    slots = -(-(9 + step) // KV_BLOCK) * KV_BLOCK if name == "numpy-best" else 9 + step  # numpy-best: whole pages
    assert prepared.info["cache"]["slots"] == slots
    assert prepared.info["cache"]["bytes"] == 2 * 2 * slots * 8 * 8


def test_the_step_draws_the_torch_adapters_cache():
    """One seed, one cache: torch-best's timed step computes what the torch adapter's static-cache step does."""
    best = _best("torch-best")
    params = init_params(GQA, seed=14)
    ours = best.prepare_decode(GQA, params, context=6, batch=2, step=2, dtype="float64", seed=15).output()
    theirs = get_backend("torch").prepare_decode(GQA, params, context=6, batch=2, step=2, dtype="float64", seed=15)
    assert_close(ours, theirs.output(), "float64", atol=1e-13, rtol=1e-13)


# -- refusals, with their reasons ------------------------------------------------------------------
@pytest.mark.parametrize("name", BEST)
def test_what_a_best_path_does_not_implement_is_refused_with_the_reason(name):
    backend = _best(name)
    window = MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, d_k=4, causal=True, window=3)
    reason = backend.unsupported_reason(window, "float32", "cpu", "standard")
    assert "window" in reason and "convention adapters" in reason
    assert "window" in backend.decode_reason(window, "float32", "cpu", "standard", None)
    assert "float16" in backend.unsupported_reason(GQA, "float16", "cpu", "standard")
    assert "bfloat16" in backend.decode_reason(GQA, "bfloat16", "cpu", "standard", None)
    assert backend.unsupported_reason(GQA, "float32", "cpu", "standard") is None
    assert backend.decode_reason(GQA, "float64", "cpu", "standard", "static") is None


# -- fairness: JAX's step holds no copy of its cache -----------------------------------------------
# A small layer whose sizes are all distinct from the slot counts below.
SMALL = MHAConfig(d_model=64, n_heads=8, n_kv_heads=2, d_k=16, rope="half", bias=False, causal=True)
CONTEXTS = (1030, 4102)  # slots 1031 and 4103

_HLO_PROGRAM = """
import json, sys
from mha_rosetta.backends.best.common import decode_step_inputs
from mha_rosetta.backends.best.jax import step_program
from mha_rosetta.core import MHAConfig, init_params
cfg = MHAConfig(**json.loads(sys.argv[1]))
out = {}
for context, donate in json.loads(sys.argv[2]):
    data = decode_step_inputs(cfg, batch=2, context=context, step=1, seed=0)
    decoder, args = step_program(cfg, init_params(cfg, seed=0), data, "float32", donate=donate)
    out[f"{context}-{donate}"] = decoder.executable(*args).as_text()
print(json.dumps(out))
"""


def _step_hlo(runs: list) -> dict[str, str]:
    """The compiled step's HLO for each (context, donate), compiled as the benchmark compiles it: in a fresh
    interpreter with the bench's XLA flags (one thread), not this suite's fast-compile ones."""
    pytest.importorskip("jax")
    from mha_rosetta.benchmarks.pinning import thread_env

    base = {name: value for name, value in os.environ.items() if name != "XLA_FLAGS"}
    fields = {"d_model": 64, "n_heads": 8, "n_kv_heads": 2, "d_k": 16, "rope": "half", "bias": False, "causal": True}
    assert MHAConfig(**fields) == SMALL
    done = subprocess.run(
        [sys.executable, "-c", _HLO_PROGRAM, json.dumps(fields), json.dumps(runs)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env=thread_env(1, base, device="cpu"),
    )
    return json.loads(done.stdout)


def aliased_parameters(hlo: str) -> set[int]:
    """The parameters the module's ``input_output_alias`` lets its outputs reuse (a donated buffer)."""
    header = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo)
    return set() if header is None else {int(n) for n in re.findall(r":\s*\((\d+),", header.group(1))}


def cache_parameters(hlo: str, slots: int) -> set[int]:
    """The entry computation's parameters shaped like a cache: (B*Hkv, slots, d)."""
    entry = hlo[hlo.index("\nENTRY") :]
    return {int(n) for n in re.findall(rf"= \w+\[\d+,{slots},\d+\]\S* parameter\((\d+)\)", entry)}


def large_moves(hlo: str, elements: int) -> list[str]:
    """Every copy or transpose in the module (fused computations included) of ``elements`` elements or more."""
    moves = []
    for line in hlo.splitlines():
        found = re.search(r"= \w+\[([\d,]*)\]\S* (copy|transpose)\(", line)
        if found and math.prod(int(d) for d in found.group(1).split(",") if d) >= elements:
            moves.append(line.strip())
    return moves


def test_the_jax_step_donates_its_cache_and_copies_nothing_large():
    runs = [(context, True) for context in CONTEXTS] + [(CONTEXTS[0], False)]
    hlo = _step_hlo(runs)
    # Nothing as large as the smallest weight (d_model x Hkv*Dk) or one kv head's keys is copied or transposed.
    smallest = min(SMALL.d_model * SMALL.k_width, CONTEXTS[0] * SMALL.d_k)
    for context in CONTEXTS:
        text = hlo[f"{context}-True"]
        caches = cache_parameters(text, context + 1)
        assert len(caches) == 2, caches  # K and V
        assert caches <= aliased_parameters(text), "the cache is not donated: each step would copy it"
        assert large_moves(text, smallest) == []
    # The meters see what they rule out: without donation the outputs alias nothing, and the step copies a cache.
    undonated = hlo[f"{CONTEXTS[0]}-False"]
    assert not cache_parameters(undonated, CONTEXTS[0] + 1) & aliased_parameters(undonated)
    assert large_moves(undonated, smallest)


# -- fairness: torch's step allocates nothing that grows with the context ------------------------
def allocated(prepared) -> tuple[int, set[str]]:
    """Bytes a step allocates (torch's profiler, every allocation event summed) and the ops it runs.

    A ``torch.cat`` of the cache allocates the grown cache, so it shows here (the control below)."""
    from torch.profiler import ProfilerActivity, profile

    prepared.output()  # warm: first-call work is not the step's
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        prepared.forward()
    events = prof.events()
    return sum(max(event.cpu_memory_usage, 0) for event in events), {event.name for event in events}


def test_the_torch_step_allocates_nothing_that_grows_with_the_context():
    best = _best("torch-best")
    params = init_params(SMALL, seed=0)

    def step_of(backend, context: int, **options):
        return backend.prepare_decode(SMALL, params, context=context, dtype="float32", **options)

    cache_growth = step_of(best, 4096).info["cache"]["bytes"] - step_of(best, 1024).info["cache"]["bytes"]
    small, ops = allocated(step_of(best, 1024))
    large, _ = allocated(step_of(best, 4096))
    assert small > 0  # the meter sees the step's own small buffers (projections, the output)
    assert large - small <= cache_growth // 100, (small, large)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops  # the fused kernel, which keeps no scores
    # The meter sees a step that grows: the torch adapter's dynamic cache concatenates K and V every step.
    adapter = get_backend("torch")
    grown = (
        allocated(step_of(adapter, 4096, cache="dynamic"))[0] - allocated(step_of(adapter, 1024, cache="dynamic"))[0]
    )
    assert grown >= cache_growth


# -- fairness: NumPy's step reads each kv head once --------------------------------------------------
GROUPED = MHAConfig(d_model=30, n_heads=6, n_kv_heads=2, d_k=6, d_v=5, rope="half", causal=True)


def _owner(array):
    """The array that owns ``array``'s memory (a view's base; NumPy keeps one level)."""
    return array if not isinstance(array, np.ndarray) or array.base is None else array.base


class MatmulMeter:
    """Counts what ``np.matmul`` reads of the cache: each operand that is a view of an array shaped like the keys'
    or the values' cache (``owners``), read once per product of the broadcast batch."""

    def __init__(self, owners: tuple[tuple[int, ...], ...]) -> None:
        self.owners, self.calls, self.elements = owners, 0, 0
        self._matmul = np.matmul

    def __call__(self, a, b, *args, **kwargs):
        batch = math.prod(np.broadcast_shapes(np.shape(a)[:-2], np.shape(b)[:-2]))
        for operand in (a, b):
            if np.shape(_owner(operand)) in self.owners:
                self.calls += 1
                self.elements += batch * math.prod(np.shape(operand)[-2:])
        return self._matmul(a, b, *args, **kwargs)


@pytest.mark.parametrize("context", [37, 2500])  # one page of slots, and ten (`best.numpy.KV_BLOCK`)
def test_the_numpy_step_reads_each_kv_head_once(monkeypatch, context):
    from mha_rosetta.backends.best.numpy import KV_BLOCK

    best = _best("numpy-best")
    batch, slots, Hkv, Dk, Dv = 2, context + 1, GROUPED.n_kv_heads, GROUPED.d_k, GROUPED.d_v
    pages = math.ceil(slots / KV_BLOCK)
    params = init_params(GROUPED, seed=0)
    prepared = best.prepare_decode(GROUPED, params, context=context, batch=batch, dtype="float64", seed=1)
    assert prepared.info["cache"]["slots"] == pages * KV_BLOCK  # whole pages, as allocated
    # Pages of keys as columns and of values as rows (B, Hkv, P, Dk, L), (B, Hkv, P, L, Dv).
    meter = MatmulMeter(((batch, Hkv, pages, Dk, KV_BLOCK), (batch, Hkv, pages, KV_BLOCK, Dv)))
    monkeypatch.setattr(np, "matmul", meter)
    output = prepared.forward()
    monkeypatch.undo()
    assert meter.calls == 2  # one batched product over the pages for the keys, one for the values
    assert meter.elements == batch * Hkv * pages * KV_BLOCK * (Dk + Dv)  # every kv head's pages once
    data = decode_step_inputs(GROUPED, batch=batch, context=context, step=1, seed=1)
    assert_close(output, expected_step(GROUPED, params, data), "float64", what=f"the blocked step at {slots} slots")


def test_the_meter_sees_a_product_broadcast_over_the_group():
    """The same meter on the product a broadcast over the group makes: each kv head read once per query head."""
    G, keys = GROUPED.group_size, np.ones((2, GROUPED.n_kv_heads, 38, GROUPED.d_k))  # (B, Hkv, T, Dk)
    queries = np.ones((2, GROUPED.n_kv_heads, G, 1, GROUPED.d_k))  # (B, Hkv, G, s, Dk)
    broadcast = MatmulMeter((keys.shape,))
    broadcast(queries, keys[:, :, None].swapaxes(-1, -2))  # (B, Hkv, 1, Dk, T): one product per query head
    assert broadcast.calls == 1 and broadcast.elements == G * keys.size


# -- mlx-best: agreement, and its step writes its cache in place ----------------------------------------------
# MLX's float64 (CPU only) is float32-accurate in exp, sin and cos (`frameworks.mlx.FLOAT64_LIMIT`): every mlx-best
# comparison is held to float32's tolerance, as the check holds it.
def test_mlx_best_agrees_with_the_oracle_forward_backward_and_decoding():
    backend = _best("mlx-best")
    x = _tokens((2, 7, 24), 1)
    params = init_params(GQA, seed=2)
    for dtype in DTYPES:
        assert_close(backend.run(GQA, params, x, dtype=dtype), reference_mha(GQA, params, x), "float32", what=dtype)
    key, value = _tokens((2, 5, 11), 3), _tokens((2, 5, 9), 4)
    cross, mask = init_params(CROSS, seed=5), _padding(2, 5, 7)
    expected = reference_mha(CROSS, cross, x, key, value, mask)
    # The kernel gives item 0's query 3 (no key allowed) the mean of V; mlx-best sets the spec's zero row.
    assert_close(backend.run(CROSS, cross, x, key, value, mask), expected, "float32", what="padding, an empty row")
    actual = backend.run_vjp(GQA, params, x, dtype="float64").tensors()
    for grad_name, grad in reference_mha_vjp(GQA, params, x).tensors().items():
        assert_close(actual[grad_name], grad, "float32", what=f"mlx-best d{grad_name}")
    left = np.ones((2, 7), dtype=bool)
    left[1, :2] = False  # item 1: two pads before (they see nothing)
    for prefill, step, pads in ((3, 1, None), (2, 2, None), (3, 2, left)):
        prepared, _ = backend.prepare_decode_run(GQA, params, x, prefill=prefill, step=step, mask=pads)
        expected = reference_decode(GQA, params, x, prefill=prefill, step=step, mask=pads)
        assert_close(prepared.output(), expected, "float32", what=f"mlx-best prefill {prefill} step {step}")
    for step in (1, 3):
        prepared = backend.prepare_decode(GQA, params, context=9, batch=2, step=step, dtype="float64", seed=13)
        data = decode_step_inputs(GQA, batch=2, context=9, step=step, seed=13)
        for _ in range(2):  # the same step every call
            assert_close(prepared.output(), expected_step(GQA, params, data), "float32", what=f"mlx-best step {step}")
        assert prepared.info["cache"]["slots"] == 9 + step


def _mlx_step_peak(step) -> int:
    """The bytes MLX holds at its peak during one evaluated step, above what it held before (mx.get_peak_memory)."""
    import mlx.core as mx

    mx.eval(step())  # warm
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(step())
    return mx.get_peak_memory() - before


def test_the_mlx_step_allocates_no_cache_and_concatenates_none(monkeypatch):
    best = _best("mlx-best")
    import mlx.core as mx

    params = init_params(SMALL, seed=0)
    steps = {context: best.prepare_decode(SMALL, params, context=context, dtype="float32") for context in (1024, 4096)}
    cache_growth = steps[4096].info["cache"]["bytes"] - steps[1024].info["cache"]["bytes"]
    peaks = {context: _mlx_step_peak(prepared.forward) for context, prepared in steps.items()}
    assert peaks[1024] > 0  # the meter sees the step's own buffers (projections, the kernel's scores)
    # What grows is the kernel's scores, H x T floats (1/8 of the cache's growth here), never a copy of the cache.
    assert peaks[4096] - peaks[1024] <= cache_growth // 4, (peaks, cache_growth)
    concatenated = []
    original = mx.concatenate

    def meter(arrays, *args, **kwargs):
        result = original(arrays, *args, **kwargs)
        concatenated.append(tuple(result.shape))
        return result

    monkeypatch.setattr(mx, "concatenate", meter)
    mx.eval(steps[4096].forward())
    monkeypatch.undo()
    assert concatenated  # the meter sees the rotary's concatenated halves (B, H, 1, Dk)
    assert [shape for shape in concatenated if max(shape) > 4096] == []  # and nothing the size of a cache
    # The meters see what they rule out: a step that grows its cache by mx.concatenate (mlx-lm's KVCache when full).
    k = mx.zeros((1, SMALL.n_kv_heads, 4096, SMALL.d_k))
    mx.eval(k)

    def growing():
        return original([k, mx.ones((1, SMALL.n_kv_heads, 1, SMALL.d_k))], axis=2)

    assert _mlx_step_peak(growing) >= k.nbytes


def test_each_implementation_is_compared_with_its_own_frameworks_best_path_or_none():
    from mha_rosetta.backends.best import best_path_for

    expected = {
        "numpy:slicing": "numpy-best", "einops-numpy": "numpy-best", "einops-jax": "jax-best", "flax": "jax-best",
        "torch-sdpa": "torch-best", "hf-attention": "torch-best", "mlx": "mlx-best", "mlx-sdpa": "mlx-best",
        "onnx": None, "onnx-reference": None, "torch-onnx": None, "nosuch": None,  # no best path is no NumPy's
    }  # fmt: skip
    assert {name: best_path_for(name) for name in expected} == expected


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (2, 8), (3, 9)])  # 1, 2, 16 and 27 rows (B*N)
def test_numpy_best_projects_few_and_many_rows_alike(shape):
    """Up to `best.numpy.FEW_ROWS` rows (beyond one) a projection is ``W (out, in) @ x.T``, else ``x @ W (in, out)``:
    both agree with the oracle, on each side of the switch."""
    from mha_rosetta.backends.best.numpy import FEW_ROWS, NumpyBestLayer

    assert FEW_ROWS == 16  # the cases above straddle it
    params = init_params(GQA, seed=21)
    x = _tokens((*shape, GQA.d_model), 22)
    layer = NumpyBestLayer(GQA, params, "float64")
    for name in "qkv":
        weight = getattr(params, f"w_{name}")  # (out, in)
        assert_close(layer.linear(x, name), x @ weight.T + getattr(params, f"b_{name}"), "float64", what=name)
    assert_close(_best("numpy-best").run(GQA, params, x), reference_mha(GQA, params, x), "float64", what=str(shape))
