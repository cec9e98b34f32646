"""`torch-tp`'s multi-head latent attention (MLA, issue 45): the torch adapter's two forms on each rank's heads.

Tensor parallelism over heads as Megatron and vLLM shard DeepSeek's MLA (`core.sharding`): each rank holds its
heads' rows of ``w_q`` (``q_b_proj``, or ``q_proj``), of ``w_k`` and ``w_v`` (``kv_b_proj``'s ``k_nope`` and ``v``
rows) and its columns of ``w_o``; the down projections ``w_q_a`` and ``w_kv_a``, their biases and RMSNorms are
replicated (`core.sharding.LATENT_PARAMS`), so every rank computes the whole latent ``[c | k_rope]`` of the tokens
(no collective: the input is replicated). Each rank runs the torch adapter's own form (`torch.mla.RowSampleMLA`)
on its heads, with no ``b_o``: ``naive`` expands its heads' keys and values from the latent, ``absorbed`` folds
its own heads' ``W_UK_h`` into their queries and ``W_O_h W_UV_h`` into its columns of the output. Either way the
result is its partial output; one ``dist.all_reduce`` sums the ranks' and ``b_o`` is added once.

Decoding (``build_decode``): each rank keeps the whole latent cache ``(B, T, R + dr)``, replicated (the latent has
no head axis to split), written in place chunk by chunk (`torch.mla.decode_chunk`): ``kv_lora_rank + d_rope``
numbers a token on every rank. One all-reduce of the partial outputs per chunk, as in a real decode, where the
next token needs the whole output.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from mha_rosetta.core import MHAConfig, MHAParams, shard_mask, shard_params, shard_plan
from mha_rosetta.core.decode import DecodeInputs

HOW = "each rank its heads' rows of w_q, w_k, w_v and columns of w_o, the latent's weights replicated; "


def _rank_shard(cfg: MHAConfig, params: MHAParams, world: int, rank: int):
    """(the plan, this rank's parameters without ``b_o``: valid for ``plan.local_cfg``, its partial output's)."""
    plan = shard_plan(cfg, world)
    return plan, dataclasses.replace(shard_params(cfg, params, world)[rank], b_o=None)


def _output_bias(params: MHAParams, dtype: str):
    from ..torch.common import optional_tensor

    return optional_tensor(params.b_o, dtype=dtype, device="cpu")  # added once, after the all-reduce


def build_forward(rank: int, world: int, cfg: MHAConfig, params: MHAParams, inputs, dtype: str, strategy: str):
    """(run, how, local stages) of MLA's ``strategy`` on this rank: ``run`` gives the all-reduced output (B, Nq, D).
    The forms' inner tensors are not recorded (as in the torch adapter): the local stages are none, the output all."""
    import torch.distributed as dist

    from ..torch.mla import _layer_pass  # the torch adapter's own MLA forward, on this rank's heads

    plan, shard = _rank_shard(cfg, params, world, rank)
    local_inputs = dataclasses.replace(inputs, mask=shard_mask(inputs.mask, plan, rank))
    partial_output, _ = _layer_pass(plan.local_cfg, shard, local_inputs, dtype, "cpu", strategy, as_leaves=False)
    b_o = _output_bias(params, dtype)

    def run():
        output = partial_output()  # (B, Nq, D): this rank's heads only, no b_o
        dist.all_reduce(output)  # the one all-reduce: the sum over ranks of the partial outputs
        return output if b_o is None else output + b_o

    how = HOW + f"the torch adapter's {strategy} form on the local heads, one dist.all_reduce, + b_o"
    return run, how, dict


def build_decode(rank: int, world: int, cfg: MHAConfig, params: MHAParams, inputs: DecodeInputs, dtype, strategy):
    """One decode run of MLA's ``strategy`` on this rank: its whole latent cache, its heads' partial outputs, one
    all-reduce per chunk. Answers as `torch_decode.build_decode` does, and ``cache``: this rank's cache as NumPy."""
    import torch
    import torch.distributed as dist

    from .._mla import ABSORBED
    from ..base import tensor_to_numpy
    from ..torch.common import to_tensor, torch_rotary_tables
    from ..torch.mla import RowSampleMLA, decode_chunk
    from .common import replicated_latent_cache, run_and_fetch

    plan, shard = _rank_shard(cfg, params, world, rank)
    local = plan.local_cfg
    run_inputs = SimpleNamespace(positions=inputs.positions, kv_positions=inputs.positions)
    layer = RowSampleMLA(local, shard, dtype, "cpu", torch_rotary_tables(local, run_inputs, dtype, "cpu"))
    xs = to_tensor(inputs.x, dtype, "cpu")  # (B, N, D): the same on every rank
    B, N, _ = inputs.x.shape
    rows = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    w_ouv = layer.folded_output() if strategy == ABSORBED else None  # its own heads' W_O_h W_UV_h, folded once
    b_o = _output_bias(params, dtype)
    chunks = inputs.chunks()
    state: dict = {}

    def run_all() -> list:
        outputs = []
        with torch.inference_mode():
            cache = xs.new_zeros((B, N, rows))  # (B, T, R + dr): the whole latent, on every rank, written in place
            for chunk in chunks:
                output = decode_chunk(layer, strategy, cache, xs, inputs, chunk, "cpu", w_ouv)  # (B, s, D) partial
                dist.all_reduce(output)  # the chunk's one all-reduce of the partial outputs
                outputs.append(output if b_o is None else output + b_o)
        state.update(outputs=outputs, cache=cache)
        return outputs

    run, fetch = run_and_fetch(run_all, state, rank)

    def stages():
        """Per chunk: no local stage (the forms record none) and the all-reduced output."""
        return [({}, tensor_to_numpy(output)) for output in run_all()]

    layout = "(B, T, R + dr) per rank: [c | k_rope] a row per token, replicated, preallocated, written in place"
    info = {
        "cache": replicated_latent_cache(cfg, B, N, xs.element_size(), layout, world, "ranks"),
        "world": world,
        "plan": plan.describe(),
        "how": HOW + "one request runs the prefill and every step in each rank, dist.all_reduce per chunk, + b_o",
        "chunks": len(chunks),
    }
    return {
        "info": info,
        "run": run,
        "fetch": fetch,
        "stages": stages,
        "cache": lambda: tensor_to_numpy(state["cache"]),
    }
