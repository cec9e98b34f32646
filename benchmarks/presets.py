"""The named sweep presets: the registry that ``bench --preset`` offers its choices from.

Plain data (`sweep.SweepSettings` fields): the command line reads it while it builds its parser,
before anything is measured, so it imports only registries (the variants' and the backends',
no framework). `sweep.preset_settings` turns a name into settings; a new preset is one entry here
and shows up in ``bench --preset`` and its help.
"""

from __future__ import annotations

from mha_rosetta.backends import REGISTRY

from .variants import preset_cells

# The fused references the GPU preset times beside our adapters: the one kernel each library fuses
# (nn.MultiheadAttention's fast path, SDPA, jax.nn.dot_product_attention). The others are a layout of
# one of these (torch-mha-seqfirst), unfused unless compiled (torch-flex), module stacks (flax,
# equinox), or a decode oracle (hf-attention).
FUSED_REFERENCES = ["torch-mha", "torch-sdpa", "jax-dpa"]
# Our adapters that run on a GPU: every implementation of the registry on torch or JAX (the sharded
# ones apart: they split the heads over processes on one machine).
GPU_IMPLEMENTATIONS = [
    name
    for name, entry in REGISTRY.items()
    if entry.kind == "implementation"
    and {"torch", "jax"} & set(entry.requires)
    and not entry.module.startswith(".sharded")
]

PRESETS: dict[str, dict] = {
    # Under two minutes on 2 cores: every installed implementation, two small sizes, short budgets, one round.
    "quick": dict(
        implementations=["main"], tokens=[32, 128], batch=[2], d_model=[64], heads=[4], dtypes=["float32"],
        policy=dict(min_time=0.05, min_repeats=5, max_time=0.3, warmup=1),
        gemm_n=1024, gemm_policy=dict(min_time=0.2, min_repeats=5, max_time=0.5, warmup=1), cell_timeout=120.0,
        rounds=1,
    ),
    # Every implementation and strategy, tokens 64 ... 1024 at the reference width, three rounds.
    "default": dict(
        implementations=["all"], tokens=[64, 128, 256, 512, 1024], batch=[4], d_model=[512], heads=[8],
        dtypes=["float32"], policy=dict(min_time=0.3, min_repeats=5, max_time=1.5, warmup=2),
        gemm_n=1024, gemm_policy=dict(min_time=0.5, min_repeats=5, max_time=2.0, warmup=2), rounds=3,
    ),
    # The reference size, three rounds of two visits a cell: the figures the README quotes (its block is
    # generated from them). Two visits: a cell's speed moves from one process to the next by 2-3% (the
    # measurement is in benchmarks.rounds), and two runs of one visit a round then differed by over 5% on
    # 2-4 of 20 cells.
    "reference": dict(
        implementations=["all"], tokens=[512], batch=[4], d_model=[512], heads=[8], dtypes=["float32"],
        policy=dict(min_time=1.0, min_repeats=7, max_time=3.0, warmup=3),
        gemm_n=1024, gemm_policy=dict(min_time=1.0, min_repeats=7, max_time=3.0, warmup=2), rounds=3, visits=2,
    ),
    # What each variant of 2024-26 attention costs (benchmarks.variants): the reference size, our four
    # conventions and the einops ones, every variant and its baseline, three rounds.
    "variants": dict(
        implementations=["main"], tokens=[512], batch=[4], d_model=[512], heads=[8], dtypes=["float32"],
        policy=dict(min_time=0.5, min_repeats=5, max_time=1.5, warmup=2),
        gemm_n=1024, gemm_policy=dict(min_time=0.5, min_repeats=5, max_time=2.0, warmup=2), rounds=3,
        variants=preset_cells("variants"),
    ),
    # What the attention forms of 2025-26 cost (issue 45: Llama 4's chunked attention, ...), each against its
    # baseline at the reference size: the cells are the registry entries whose BenchSpec.preset is "forms".
    "forms": dict(
        implementations=["main"], tokens=[512], batch=[4], d_model=[512], heads=[8], dtypes=["float32"],
        policy=dict(min_time=0.5, min_repeats=5, max_time=1.5, warmup=2),
        gemm_n=1024, gemm_policy=dict(min_time=0.5, min_repeats=5, max_time=2.0, warmup=2), rounds=3,
        variants=preset_cells("forms"),
    ),
    # One GPU (scripts/gpu-run; pass --devices gpu): the reference size, 4k and 16k tokens, every GPU-capable
    # adapter and the fused references, float32 (TF32 off; MHA_ROSETTA_TF32=1 for on), bfloat16, float16.
    "gpu": dict(
        implementations=GPU_IMPLEMENTATIONS + FUSED_REFERENCES,
        tokens=[512, 4096, 16384], batch=[4], d_model=[512], heads=[8], dtypes=["float32", "bfloat16", "float16"],
        policy=dict(min_time=0.1, min_repeats=5, max_time=0.5, warmup=2),
        gemm_policy=dict(min_time=0.2, min_repeats=5, max_time=1.0, warmup=3), cell_timeout=60.0, rounds=1,
    ),
    # Long context (B=1, H=8, D=512): every implementation and strategy from 1k to 16k tokens and the
    # memory-linear ones (chunked, torch SDPA) to 32k; cells predicted over the memory budget are skipped.
    # No warm-up beyond the first call (timed on its own): at these sizes a call takes up to 40 s.
    "long": dict(
        implementations=["all"], tokens=[1024, 2048, 4096, 8192, 16384, 32768], batch=[1], d_model=[512],
        heads=[8], dtypes=["float32"], policy=dict(min_time=0.2, min_repeats=3, max_time=2.0, warmup=0),
        gemm_n=1024, gemm_policy=dict(min_time=0.5, min_repeats=5, max_time=2.0, warmup=1), rounds=1,
        cell_timeout=1800.0,
    ),
}  # fmt: skip

# ``bench --mode decode`` (benchmarks.decode): one decode step at a context length, timed against the
# memory bandwidth. Fields of `decode_settings.DecodeSettings`. The default is a decoder layer of a 1-3B model
# (d_model 2048, 16 heads of d_k 128 over 4 kv heads: Llama 3's GQA ratio of 4 and head width 128,
# half rotary, no biases: the layer of Llama, Mistral and Gemma, so hf-attention runs it through the real
# LlamaAttention; docs/benchmarks.md measures what biases cost XLA:CPU's one-row products), B=1, float32 (every implementation has it, and no CPU library here has fast
# 16-bit kernels), one token per step; the windowed row is W = 4096 (Mistral 7B's, Gemma 2's local layers),
# at contexts below, at and beyond the ring. A prefill of the context is timed up to 4k tokens (at 8k
# a full float32 score tensor is 16 x 8192^2 x 4 B = 4 GiB, too much beside the other engineers). The paged row
# (issue 47): the same step through each convention's paged cache at 4k-32k, against its contiguous cell. The ragged
# row (issue 47, continuous batching): 4 rows holding 4 x 2k and 4 x 8k tokens, as shares 4:2:1:1 of them
# (4k+2k+1k+1k and 16k+8k+4k+4k), beside the rectangular 4 x 2k and 4 x 8k, contiguous and paged. The MLA row
# (issue 45): DeepSeek V2-Lite's latent attention (its d_model 2048 and 16 heads are the layer's; latent 512, nope
# 128 + rope 64, d_v 128, no query LoRA), naive and absorbed at 1k-32k.
DECODE_PRESETS: dict[str, dict] = {
    "decode": dict(
        implementations=["main"], contexts=[1024, 2048, 4096, 8192, 16384, 32768], window=4096,
        window_contexts=[2048, 8192, 32768], paged_contexts=[4096, 8192, 16384, 32768],
        ragged_contexts=[2048, 8192], ragged_rows=[4, 2, 1, 1], batch=1, step=1, d_model=2048, heads=16, kv_heads=4,
        d_k=128, mla=dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        mla_contexts=[1024, 4096, 16384, 32768],
        rope="half", bias=False, dtype="float32", policy=dict(min_time=0.3, min_repeats=7, max_time=1.5, warmup=3),
        prefill_max=4096, prefill_policy=dict(min_time=0.2, min_repeats=3, max_time=2.0, warmup=1),
        bandwidth_policy=dict(min_time=0.5, min_repeats=7, max_time=2.0, warmup=2), rounds=3,
        cell_timeout=900.0,
    ),
    # Under a minute or two: a small layer at two short contexts, a window smaller than both, one round.
    "decode-quick": dict(
        implementations=["main"], contexts=[256, 1024], window=128, window_contexts=[256, 1024], batch=1, step=1,
        d_model=256, heads=4, kv_heads=2, d_k=64, rope="half", bias=False, dtype="float32",
        mla=dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32), mla_contexts=[256, 1024],
        policy=dict(min_time=0.05, min_repeats=5, max_time=0.3, warmup=1), prefill_max=1024,
        prefill_policy=dict(min_time=0.02, min_repeats=3, max_time=0.3, warmup=1), array_mb=64,
        bandwidth_policy=dict(min_time=0.1, min_repeats=5, max_time=0.5, warmup=1), rounds=1, cell_timeout=120.0,
    ),
}  # fmt: skip
