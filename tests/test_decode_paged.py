"""Paged decode: every token's output through a shuffled page pool equals the contiguous cache's."""

import importlib.util

import numpy as np
import pytest

from mha_rosetta.backends import UnsupportedCase, get_backend
from mha_rosetta.core import MHAConfig, assert_close, init_params
from mha_rosetta.core.decode import CacheFull, reference_decode
from mha_rosetta.core.page_pool import PagePool, pool_pages
from mha_rosetta.core.paged import PAD

CONFIGS = {
    "gqa_rope": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half"),
    # W = 5 over pages of 3: the window's first key falls mid-page at every step.
    "window_alibi": MHAConfig(d_model=14, n_heads=2, causal=True, window=5, alibi=True),
    "sinks_softcap": MHAConfig(d_model=15, n_heads=3, causal=True, sinks=True, softcap=5.0),
}


def _run(backend, cfg, **options):
    params = init_params(cfg, seed=1)
    x = np.random.default_rng(2).standard_normal((3, 17, cfg.d_model))
    mask = np.ones((3, 17), dtype=bool)
    mask[1, :4] = False  # left padding in one row
    expected = reference_decode(cfg, params, x, prefill=5, step=2, mask=mask)
    out = get_backend(backend).run_decode(cfg, params, x, prefill=5, step=2, mask=mask, **options)
    return out, expected


# Each convention's paged cache and the library it needs: NumPy's key columns, torch's vLLM pages, JAX's static
# pool gathered inside the jitted step, einops' "p t g k" pool on each array library, MLX's pool behind mlx-lm's
# update_and_fetch. The compiled ones run fewer page sizes (each is a compilation).
PAGED_BACKENDS = {
    "numpy": (None, (1, 3, 4, 16)),
    "torch": ("torch", (1, 3, 4, 16)),
    "jax": ("jax", (1, 3, 16)),
    "einops-numpy": ("einops", (1, 3, 16)),
    "einops-torch": ("torch", (3, 16)),
    "einops-jax": ("jax", (3, 16)),
    "mlx": ("mlx.core", (3, 16)),
}
RUNS = [(backend, size) for backend, (_, sizes) in PAGED_BACKENDS.items() for size in sizes]


def _needs(backend):
    module = PAGED_BACKENDS[backend][0]
    if module is not None:
        pytest.importorskip(module, reason=f"{backend}'s paged cache needs {module}")
    if backend.startswith("einops"):
        pytest.importorskip("einops", reason="the einops convention needs einops")


@pytest.mark.parametrize(("backend", "page_size"), RUNS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_paged_equals_contiguous(backend, name, page_size):
    _needs(backend)
    cfg = CONFIGS[name]
    out, expected = _run(backend, cfg, cache="paged", page_size=page_size, page_seed=page_size)
    contiguous, _ = _run(backend, cfg, cache=get_backend(backend).decode_caches[0])
    level = _level(backend, cfg)
    assert_close(out, expected, level, what=f"{backend} paged P={page_size}")
    assert_close(out, contiguous, level, what=f"{backend} paged against its contiguous cache")


def _level(backend, cfg) -> str:
    """The precision level the backend declares for float64 (MLX's CPU float64 is held to float32's)."""
    prepared, _ = get_backend(backend).prepare_decode_run(
        cfg, init_params(cfg, seed=1), np.zeros((1, 2, cfg.d_model)), prefill=1, cache="paged", page_size=1
    )
    return prepared.info.get("tolerance_dtype", "float64")


def test_windows_free_whole_pages():
    chunks = [(0, 5), *((s, min(s + 2, 17)) for s in range(5, 17, 2))]
    assert pool_pages(3, 3, chunks, window=None) == 3 * 6  # every token kept: ceil(17 / 3) pages a row
    assert pool_pages(3, 3, chunks, window=5) == 3 * 3  # W - 1 + step = 6 tokens span at most 3 pages of 3
    pool = PagePool(batch=2, page_size=2, n_pages=2 * 3, seed=0, window=3)
    for _ in range(9):  # one token at a time: the window needs the 2 keys before the new one
        pool.write_slots(1)
        assert pool.in_use <= 2 * 3
    pages, start = pool.live()
    assert start == 6 and pages.shape == (2, 2)  # tokens 6..8 on logical pages 3 and 4; pages 0..2 freed
    assert (pool.table[:, :3] == PAD).all()
    assert sorted(pool.free + pages.ravel().tolist()) == list(range(6))  # freed pages came back and were reused


def test_pads_take_no_pages_their_pages_point_at_one_null_page():
    # 3 rows of 12 tokens in pages of 4, left padded: row 1 holds 3 tokens after 9 pads, row 2 holds 8 after 4.
    valid = np.arange(12)[None, :] >= np.array([0, 9, 4])[:, None]  # (B, 12)
    pool = PagePool(batch=3, page_size=4, n_pages=9, seed=0)
    page, offset, given = pool.write_slots(12, valid)
    null = pool.null
    assert pool.table[1, :2].tolist() == [null, null] and pool.table[2, 0] == null  # the pad-only pages
    own = pool.table[pool.table != null]  # (6,): the rows' own pages, 3 + 1 + 2
    assert len(set(own.tolist())) == 6 and null not in own.tolist()
    assert pool.in_use == 7  # 6 and the null page, where pads taking pages held 9
    assert sorted(given.tolist()) == sorted([*own.tolist(), null])  # the caller marks all of them unwritten
    assert (page[valid] != null).all()  # every real token in a page of its row's own
    assert (page[1, :8] == null).all() and page[1, 8] != null  # token 8: a pad in a page that holds real tokens
    assert offset.tolist() == [t % 4 for t in range(12)]
    with pytest.raises(ValueError, match="the pool's pad-only pages point at the shared null page"):
        pool.layout()  # a canonical PagedLayout has one row per page


def test_a_pad_only_page_that_receives_a_real_token_gets_its_own_page():
    # Row 1: three pads, then its first token, fed two at a time: its page 0 is the null page until token 3.
    valid = np.arange(4)[None, :] >= np.array([0, 3])[:, None]
    pool = PagePool(batch=2, page_size=4, n_pages=3, seed=1)
    _, _, given = pool.write_slots(2, valid[:, :2])
    null = pool.null
    assert pool.table[:, 0].tolist() == [given[0], null] and given.tolist()[1] == null and pool.in_use == 2
    page, _, given = pool.write_slots(2, valid[:, 2:])
    assert given.tolist() == [pool.table[1, 0]] and pool.table[1, 0] != null  # a page of its own, given anew
    assert pool.null is None and null in pool.free and pool.in_use == 2  # no page points at the null page now
    assert page[1].tolist() == [pool.table[1, 0]] * 2


def test_a_pool_without_a_spare_page_gives_the_freed_null_page_to_the_row_that_needs_it():
    # The same rows in a pool of 2 pages (`pool_pages`: 2 rows x 1 page, no spare for the null page): row 0's page
    # and the null page take both; when row 1's first real token comes, the null page has no other row and becomes
    # row 1's own page (given again, so the caller marks its pad slots unwritten). It ran out before (CacheFull).
    valid = np.arange(4)[None, :] >= np.array([0, 3])[:, None]
    assert pool_pages(2, 4, [(0, 2), (2, 4)], window=None) == 2
    pool = PagePool(batch=2, page_size=4, n_pages=2, seed=1)
    pool.write_slots(2, valid[:, :2])
    null = pool.null
    assert pool.free == [] and pool.table[1, 0] == null
    page, _, given = pool.write_slots(2, valid[:, 2:])
    assert given.tolist() == [null] and pool.table[1, 0] == null and pool.null is None  # now row 1's own page
    assert pool.in_use == 2 and pool.free == [] and page[1].tolist() == [null, null]
    with pytest.raises(CacheFull, match="page pool exhausted: 2 rows need 2 more pages of 4 tokens, 0 of 2 are free"):
        pool.write_slots(1)  # token 4: a second page for each row, none left


def test_a_window_frees_pad_only_pages_and_then_the_null_page():
    valid = np.arange(8)[None, :] >= np.array([0, 2])[:, None]  # row 1: two pads, then six tokens
    chunks = [(t, t + 1) for t in range(8)]
    pool = PagePool(batch=2, page_size=2, n_pages=pool_pages(2, 2, chunks, window=2), seed=0, window=2)
    held = []
    for t in range(8):  # one token at a time; the window keeps the key before the new one
        pool.write_slots(1, valid[:, t : t + 1])
        held.append((pool.in_use, pool.null is not None))
    # Token 0 and 1: row 0's page and the null page; token 2: both rows' page 1; token 3: page 0 freed, the null too.
    assert held[:4] == [(2, True), (2, True), (4, True), (2, False)] and pool.n_pages == 4
    assert all(count <= 4 and not has_null for count, has_null in held[3:])


def test_pages_are_shuffled_and_the_result_does_not_depend_on_where_they_sit():
    pool = PagePool(batch=2, page_size=2, n_pages=8, seed=3)
    pool.write_slots(8)
    assert sorted(pool.table.ravel().tolist()) == list(range(8))
    assert pool.table.ravel().tolist() != list(range(8))  # physical order != logical order
    layout = pool.layout()
    assert layout.seq_lens.tolist() == [8, 8] and np.array_equal(layout.block_table, pool.table)
    cfg = CONFIGS["gqa_rope"]
    for backend, (module, _) in PAGED_BACKENDS.items():  # the installed ones (all of them in the `all` env)
        if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
            continue
        if backend.startswith("einops") and importlib.util.find_spec("einops") is None:
            continue
        a, _ = _run(backend, cfg, cache="paged", page_size=2, page_seed=0)
        b, _ = _run(backend, cfg, cache="paged", page_size=2, page_seed=1)
        # pytorch #182593: an output that depends on where the pages sit (the same products in another order
        # of pages: equal here to the last bit, as the gather restores the logical order before any sum)
        np.testing.assert_array_equal(a, b, err_msg=backend)


def test_pool_exhausted_and_bad_page_options():
    pool = PagePool(batch=2, page_size=4, n_pages=3, seed=0)
    pool.write_slots(4)
    with pytest.raises(CacheFull, match="page pool exhausted: 2 rows need 2 more pages of 4 tokens, 1 of 3 are free"):
        pool.write_slots(1)
    cfg = CONFIGS["gqa_rope"]
    with pytest.raises(ValueError, match=r"page_size must be a positive int .* got 0"):
        _run("numpy", cfg, cache="paged", page_size=0)
    with pytest.raises(ValueError, match="page_size is for cache='paged', got cache='columns'"):
        _run("numpy", cfg, cache="columns", page_size=4)
    with pytest.raises(UnsupportedCase, match="numpy has no 'dynamic' cache"):
        get_backend("numpy").prepare_decode(cfg, init_params(cfg, seed=0), context=8, cache="dynamic")


def test_torch_pool_is_vllm_layout_and_reads_back_through_the_canonical_layout():
    torch = pytest.importorskip("torch")
    from mha_rosetta.backends.torch.paged import TorchPagedCache

    cfg = CONFIGS["gqa_rope"]  # Hkv = 2, Dk = Dv = 4
    cache = TorchPagedCache(2, cfg, page_size=3, n_pages=8, seed=5, like=torch.zeros((), dtype=torch.float64))
    k = torch.randn(2, 2, 7, 4, dtype=torch.float64)  # (B, Hkv, s, Dk)
    positions = torch.arange(7).expand(2, 7)
    gathered = cache.write(k, 2 * k, positions, torch.ones(2, 7, dtype=torch.bool), token=0)
    assert cache.k.shape == (8, 3, 2, 4)  # (pages, P, Hkv, Dk)
    torch.testing.assert_close(gathered[0][:, :, :7], k, rtol=0, atol=0)
    assert not gathered[3][:, 7:].any()  # the last page's two unwritten slots are invalid
    layout = cache.pool.layout()  # core's description of the same pages: its gather reads the same keys
    packed = layout.gather(cache.k.numpy())  # (T, Hkv, Dk), rows one after the other
    np.testing.assert_array_equal(packed, k.transpose(1, 2).reshape(14, 2, 4).numpy())
    with pytest.raises(ValueError, match="written in token order: token 9 after 7"):
        cache.write(k[:, :, :1], k[:, :, :1], positions[:, :1], torch.ones(2, 1, dtype=torch.bool), token=9)


def test_jax_pool_is_static_donated_and_gathered_inside_one_compiled_step():
    pytest.importorskip("jax", reason="the jax adapter's paged cache needs JAX")
    from mha_rosetta.backends.jax.decode_programs import full_rotary_tables
    from mha_rosetta.backends.jax.paged import JaxPagedDecoder, paged_decoders
    from mha_rosetta.core.decode import prepare_decode_inputs

    cfg = MHAConfig(d_model=18, n_heads=3, n_kv_heads=1, causal=True, rope="half", window=4)  # a config of its own
    params = init_params(cfg, seed=4)
    x = np.random.default_rng(5).standard_normal((2, 14, cfg.d_model))
    inputs = prepare_decode_inputs(cfg, x, prefill=3, step=1)
    common = {"dtype": "float64", "device": "cpu", "matmul_precision": "highest", "span": 13}
    decoder = paged_decoders(cfg, params, inputs, page_size=2, page_seed=7)(**common)
    assert isinstance(decoder, JaxPagedDecoder)
    # W - 1 + step = 4 tokens span at most 3 pages of 2: the block table is 3 wide, the pool 2 rows x 3 pages
    assert (decoder.live_pages, decoder.pool.n_pages) == (3, 6)
    shapes = {name: array.shape for name, array in decoder.cache.items()}
    assert shapes == {"k_pages": (6, 2, 1, 6), "v_pages": (6, 2, 1, 6), "pos": (6, 2), "valid": (6, 2)}
    positions, valid = inputs.positions, inputs.valid
    tables = full_rotary_tables(cfg, positions)  # (B, N, r/2) each
    outputs = []
    for start, stop in inputs.chunks():
        before = decoder.cache["k_pages"]
        part = (x[:, start:stop], positions[:, start:stop], valid[:, start:stop])
        part = (*part, tuple(table[:, start:stop] for table in tables))
        outputs.append(np.asarray(decoder.step(*part)["output"]))
        assert before.is_deleted()  # donated: XLA wrote the step's slots into the pool's own buffer
        assert {name: array.shape for name, array in decoder.cache.items()} == shapes  # static: nothing grows
    assert decoder.compilations == {"step": 2}  # the prefill's shape and the step's: 11 steps, one program
    expected = reference_decode(cfg, params, x, prefill=3, step=1)
    assert_close(np.concatenate(outputs, axis=1), expected, "float64", what="the jax paged decoder driven by hand")
    assert decoder.pool.peak <= 6 and (decoder.pool.table[:, :4] == PAD).all()  # the window freed pages 0..3


@pytest.mark.parametrize("backend", sorted(PAGED_BACKENDS))
@pytest.mark.parametrize("page_size", [0, -3, 2.0, True])
def test_every_paged_cache_refuses_a_page_size_that_is_not_a_positive_int(backend, page_size):
    _needs(backend)
    with pytest.raises(ValueError, match=rf"page_size must be a positive int \(tokens per page\), got {page_size!r}"):
        _run(backend, CONFIGS["gqa_rope"], cache="paged", page_size=page_size)


# Every convention's timed step (`prepare_decode`, bench --mode decode) pages: each in its own pool layout.
TIMED_PAGED = tuple(PAGED_BACKENDS)


@pytest.mark.parametrize("backend_name", TIMED_PAGED)
@pytest.mark.parametrize("window", [None, 40])
def test_each_timed_paged_step_equals_its_contiguous_step(backend_name, window):
    # bench --mode decode's paged row: the same step on the same cached numbers, the pages gathered first. (A window
    # shorter than the context: the contiguous ring draws only the numbers it keeps, the pool the whole context's.)
    _needs(backend_name)
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", window=window)
    params, backend = init_params(cfg, seed=0), get_backend(backend_name)
    contiguous = backend.decode_caches[0]
    steps = {
        cache: backend.prepare_decode(cfg, params, context=37, batch=2, dtype="float64", cache=cache, seed=3)
        for cache in (contiguous, "paged")
    }
    out = {cache: prepared.to_numpy(prepared.forward()) for cache, prepared in steps.items()}  # (B, 1, D)
    assert out["paged"].shape == (2, 1, 16)
    assert_close(out["paged"], out[contiguous], "float64", what=f"{backend_name}'s paged step against {contiguous}")
    again = steps["paged"].to_numpy(steps["paged"].forward())  # rewound: the same slots, no new page
    np.testing.assert_array_equal(again, out["paged"])
    info = steps["paged"].info["cache"]
    assert info["kind"] == "paged" and info["page_size"] == 16  # vLLM's default block size
    assert info["pages"] == 2 * 3  # ceil(38 / 16) pages a row for the context and the step


def test_a_paged_decode_cell_runs_in_a_fresh_child():
    from mha_rosetta.benchmarks.decode import DecodeCellSpec, run_decode_cell

    fast = dict(min_time=0.01, min_repeats=3, max_time=0.2, warmup=1)
    spec = DecodeCellSpec(
        implementation="numpy", context=64, cache="paged", policy=fast, prefill=False, d_model=32, heads=4, kv_heads=2
    )
    record = run_decode_cell(spec, timeout=120)  # a smoke run of the path, not a figure
    assert record["status"] == "ok", record.get("error") or record.get("stderr_tail")
    assert record["cache_info"]["kind"] == "paged" and record["cache_info"]["page_size"] == 16
