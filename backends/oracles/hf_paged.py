"""A third-party oracle of ragged decoding: Hugging Face's continuous batching, its paged cache and its paged forward.

transformers 5.x serves many requests at once by continuous batching (``generate_batch``): every
forward takes the new tokens of every running request packed into one ``(1, T_q)`` row, each at its
own position, and reads each request's keys back from a ``PagedAttentionCache``. Here that machinery
runs on the CPU, from the one canonical description of the batch (`core.ragged.RaggedBatch`: the
requests' lengths), through the library's own parts:

* the cache: ``PagedAttentionCache(config, ContinuousBatchingConfig(page_size=P, num_blocks=...),
  device="cpu", ...)``; each request's pages are given by the library's allocator
  (``can_store_request_tokens``), and its physical read and write slots are the allocator's
  (``extend_read_and_write_indices``: its block table, the K and V of one page interleaved);
* the module: the real ``LlamaAttention`` loaded with the canonical parameters (`hf_driver.build_module`),
  its rotary module for each token's own position, its config's attention implementation set to
  ``"paged|eager"`` (``eager_paged_attention_forward``: the paged forward of ``ALL_ATTENTION_FUNCTIONS``;
  ``sdpa_paged`` is deprecated in 5.25 and calls plain SDPA), called with the cache and the
  keywords ``cache.update`` reads (``read_index``, ``write_index``, ``cu_seq_lens_k``, ``max_length_k``),
  as the library's model runner passes them;
* the mask: additive ``(1, 1, T_q, T_k)``, 0 where a query may see a key of its own request at a position
  not after its own, the dtype's minimum elsewhere (what the library's batch builder writes), made here
  from the `RaggedBatch` and the positions.

The requests' first call takes ``prefill`` tokens each (fewer if a request is shorter), later calls
``step`` each; a request with no token never joins. The library's block tables, read back, are a
canonical `core.paged.PagedLayout` (each page one request's, inside the pool). Its eager softmax runs
in float32 (``dtype=torch.float32`` then cast), so a float64 run is float32-accurate.

transformers and torch are imported inside the functions (base rule 4).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams
from mha_rosetta.core.paged import PagedLayout, check_page_size
from mha_rosetta.core.ragged import RaggedBatch

from ..vocabulary import UnsupportedCase
from .hf_driver import build_module

PAGED_EAGER = "paged|eager"  # the paged attention forward's name in transformers' ALL_ATTENTION_FUNCTIONS


def hf_paged_decode(
    cfg: MHAConfig,
    params: MHAParams,
    x,
    batch: RaggedBatch,
    *,
    prefill: int,
    step: int = 1,
    page_size: int = 4,
    dtype: str = "float32",
) -> tuple[np.ndarray, PagedLayout, np.ndarray]:
    """Decode the packed requests ``x`` (T, d_model) (``batch``: their lengths) by continuous batching through
    Hugging Face's paged cache and paged forward: (every token's output (T, d_model), the block tables as a
    `PagedLayout` after the last call, the cached keys as a pool of pages (pages, P, Hkv, Dk), which the layout's
    `PagedLayout.gather` reads in logical order). ``cfg``: what ``LlamaAttention`` holds (causal, half rotary,
    no window). Bad input is refused before torch or transformers is imported."""
    page_size = check_page_size(page_size)
    for name, value in (("prefill", prefill), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an int >= 1 (tokens per request in a call), got {value!r}")
    if cfg.window is not None or not cfg.causal:
        raise UnsupportedCase(
            f"hf_paged_decode drives LlamaAttention's full causal attention; got window={cfg.window}, causal={cfg.causal}"
        )
    x = np.asarray(x, dtype=np.float64)
    if x.shape != (batch.total, cfg.d_model):
        raise ValueError(f"x must have shape (T={batch.total}, d_model={cfg.d_model}), got {x.shape}")
    import torch

    module, config, rotary = build_module(cfg, params, dtype)
    config._attn_implementation = PAGED_EAGER
    torch_dtype = getattr(torch, dtype)
    cache, allocator = _paged_cache(config, batch, page_size, torch_dtype)
    starts = batch.cu_seqlens()[:-1]  # (B,): each request's first packed token
    lengths = batch.lengths.tolist()
    out = np.zeros_like(x)
    done = [0] * len(lengths)  # tokens of each request through the model so far
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        # (request, its tokens before this call, its tokens in it): a request's first call is its prefill
        calls = [(r, d, min(prefill if d == 0 else step, lengths[r] - d)) for r, d in enumerate(done) if d < lengths[r]]
        reads, writes = [[]], [[]]
        for r, past, count in calls:
            cache.can_store_request_tokens(SimpleNamespace(request_id=str(r), current_len=lambda p=past: p), count)
            cache.extend_read_and_write_indices(str(r), past, count, reads, writes)
        rows = np.concatenate([starts[r] + np.arange(past, past + count) for r, past, count in calls])  # (T_q,)
        q_pos = np.concatenate([np.arange(past, past + count) for _, past, count in calls])  # (T_q,)
        q_req = np.concatenate([np.full(count, r) for r, _, count in calls])
        k_pos = np.concatenate([np.arange(past + count) for _, past, count in calls])  # (T_k,) in read order
        k_req = np.concatenate([np.full(past + count, r) for r, past, count in calls])
        allowed = (q_req[:, None] == k_req[None, :]) & (k_pos[None, :] <= q_pos[:, None])  # (T_q, T_k)
        mask = torch.zeros(allowed.shape, dtype=torch_dtype)
        mask[torch.from_numpy(~allowed)] = torch.finfo(torch_dtype).min
        chunk = torch.from_numpy(x[rows][None]).to(torch_dtype)  # (1, T_q, D): every request's new tokens packed
        position_ids = torch.from_numpy(q_pos[None])  # (1, T_q)
        seqlens_k = np.array([past + count for _, past, count in calls])
        kwargs = {
            "read_index": [torch.tensor(reads[0], dtype=torch.int64)],
            "write_index": [torch.tensor(writes[0], dtype=torch.int64)],
            "cu_seq_lens_k": {allocator.layer_type: torch.from_numpy(np.concatenate([[0], np.cumsum(seqlens_k)]))},
            "max_length_k": {allocator.layer_type: int(seqlens_k.max())},
        }
        with torch.no_grad():
            result, _ = module(
                chunk, position_embeddings=rotary(chunk, position_ids), attention_mask=mask[None, None], cache=cache,
                **kwargs,
            )  # fmt: skip
        out[rows] = result[0].double().numpy()
        for r, _, count in calls:
            done[r] += count
    layout = _layout(allocator, batch, page_size)
    # The library's tensor, one page of K then one of V per block: (pages * 2P, Hkv, Dk) -> (pages, 2, P, Hkv, Dk).
    pages = allocator.cache_tensor.reshape(layout.n_pages, 2, page_size, cfg.n_kv_heads, cfg.d_k)  # a view
    return out, layout, pages[:, 0].double().numpy()  # the K pages (pages, P, Hkv, Dk), a copy


def _paged_cache(config, batch: RaggedBatch, page_size: int, torch_dtype):
    """The library's paged cache for ``config`` on the CPU, with room for every request, and its one allocator."""
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    blocks = int(-(-batch.lengths // page_size).sum()) + 1
    settings = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=blocks, max_batch_tokens=max(1, batch.total), max_memory_percent=1.0
    )
    cache = PagedAttentionCache(config, settings, "cpu", DistributedHelper(None, None), dtype=torch_dtype)
    (allocator,) = cache.cache_allocators.values()  # one kind of layer: full attention
    return cache, allocator


def _layout(allocator, batch: RaggedBatch, page_size: int) -> PagedLayout:
    """The library's block tables (its block ids per request, in logical order) as the canonical `PagedLayout`."""
    rows = [allocator.block_table.get(str(r), []) for r in range(batch.batch)]
    width = max((len(row) for row in rows), default=0)
    table = np.full((batch.batch, width), -1, dtype=np.int64)
    for r, row in enumerate(rows):
        table[r, : len(row)] = row
    pool = int(allocator.cache_tensor.shape[0]) // page_size  # every page of the tensor, the trash ones included
    return PagedLayout(table, batch.lengths, page_size, pool)
