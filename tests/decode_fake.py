"""A fake decoding backend for the decode benchmark's tests (`tests/test_bench_decode.py`).

Module-level, so that a measured child can import it (``--plugin decode_fake:FakeDecode`` with
``tests/`` on PYTHONPATH). Its step is NumPy: a cache of random K and V, (B, Hkv, slots, Dk),
and one attention step of the new tokens over it (projections, the GQA repeat, softmax, the
output projection); rotary is left out (the benchmark times the step, the decode check, not
this file, holds implementations to the numbers). Its whole-run path (the prefill timing) is the
oracle itself, `core.decode.reference_decode`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mha_rosetta.backends import Backend, Prepared
from mha_rosetta.backends.base import DecodeStep, PreparedDecode
from mha_rosetta.core import numpy_dtype
from mha_rosetta.core.decode import reference_decode, ring_capacity

LAYOUT = "(B, Hkv, T, Dk) NumPy arrays; with a window a ring of W - 1 + step slots"


class FakeDecode(Backend):
    name = "fake-decode"
    requires = ("numpy",)
    dtypes = ("float64", "float32")
    decode_caches = ("dynamic",)
    decode_variants = frozenset({"window"})
    decode_layouts: ClassVar[dict[str, str]] = {"dynamic": LAYOUT}
    compiles_every_run = False

    def _prepare(self, cfg, params, inputs, dtype, device, strategy):
        raise NotImplementedError("the fake backend only decodes")

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
        def run():
            return reference_decode(cfg, params, inputs.x, prefill=inputs.prefill, step=inputs.step, mask=inputs.mask)

        info = {"cache": {"kind": cache, "layout": LAYOUT}, "compilations": {"prefill": 0, "step": 0}}
        if self.compiles_every_run:  # a JIT that traces its programs anew in every run
            info["compilations"] = {"prefill": 1, "step": 0}
        return PreparedDecode(run=run, to_numpy=np.asarray, info=info)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        batch, context, step, dtype, cache = job.batch, job.context, job.step, job.dtype, job.cache
        dt = numpy_dtype(dtype)
        rng = np.random.default_rng(job.seed)
        ring = ring_capacity(cfg, step)
        slots = context + step if ring is None else ring  # the ring is full; a growing cache holds context + step
        hkv, h, dk = cfg.n_kv_heads, cfg.n_heads, cfg.d_k
        k_cache = rng.standard_normal((batch, hkv, slots, dk)).astype(dt)  # (B, Hkv, T, Dk)
        v_cache = rng.standard_normal((batch, hkv, slots, dk)).astype(dt)  # (B, Hkv, T, Dv)
        # (in, out) copies, C-contiguous: a one-token product is then one BLAS GEMV, not a strided loop
        w_q, w_k, w_v, w_o = (
            np.ascontiguousarray(np.asarray(getattr(params, name), dtype=dt).T) for name in ("w_q", "w_k", "w_v", "w_o")
        )
        x = rng.standard_normal((batch, step, cfg.d_model)).astype(dt)  # (B, s, D)

        def forward():
            q = (x @ w_q).reshape(batch, step, h, dk).transpose(0, 2, 1, 3)  # (B, H, s, Dk): a view
            k = (x @ w_k).reshape(batch, step, hkv, dk).transpose(0, 2, 1, 3)  # (B, Hkv, s, Dk): a view
            v = (x @ w_v).reshape(batch, step, hkv, dk).transpose(0, 2, 1, 3)  # (B, Hkv, s, Dv): a view
            k_cache[:, :, -step:] = k  # the new keys into the last slots (an in-place write)
            v_cache[:, :, -step:] = v
            group = h // hkv
            q = q.reshape(batch, hkv, group * step, dk)  # (B, Hkv, G s, Dk): a copy (q is a transposed view)
            scores = q @ k_cache.transpose(0, 1, 3, 2) / np.sqrt(dk)  # (B, Hkv, G s, T)
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            context_ = (weights @ v_cache).reshape(batch, h, step, dk)  # (B, H, s, Dv): a view
            merged = context_.transpose(0, 2, 1, 3).reshape(batch, step, h * dk)  # (B, s, H Dv): a copy
            return merged @ w_o  # (B, s, D)

        nbytes = k_cache.nbytes + v_cache.nbytes
        info = {"cache": {"kind": cache, "layout": LAYOUT, "slots": slots, "bytes": nbytes}}
        return Prepared(forward=forward, to_numpy=np.asarray, native_stages=dict, info=info)


class FakeNoWindow(FakeDecode):
    """The fake without a window in its decode path: a windowed cell is unsupported, with the reason."""

    name = "fake-no-window"
    decode_variants = frozenset()


class FakeRecompiles(FakeDecode):
    """The fake whose whole-run path reports a compilation in every run (as a JIT that re-traces would)."""

    name = "fake-recompiles"
    compiles_every_run = True


class FakePagedRunOnly(FakeDecode):
    """The fake declaring a paged cache that `run_decode` runs but no timed paged step (``paged_decode_step``
    False): a paged cell is refused with the reason before a child starts."""

    name = "fake-paged-run-only"
    decode_caches = ("dynamic", "paged")
    decode_layouts: ClassVar[dict[str, str]] = {"dynamic": LAYOUT, "paged": "pages of the same arrays"}
