"""The checkpoint layouts of `mha_rosetta.models`, NumPy only: exact round trips, hand-checked packings, bad input.

The real modules are in test_models_real.py; here every layout is held to what its
module's source says, with distinct sizes so that no two axes can be swapped silently.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, init_params
from mha_rosetta.models import LAYOUTS, LayoutError, get_layout, pack_groups, unpack_groups

# One configuration each real module can hold (distinct sizes; GQA where the family has it). GQA: the sizes most
# grouped families share here (4 query heads over 2 kv heads of 6 features each, d_model 15).
GQA = dict(d_model=15, n_heads=4, n_kv_heads=2, d_k=6)
YARN_4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}  # gpt-oss's scaling, smaller
# DeepSeek V3's latent sizes: q and kv LoRA ranks 7 and 6, nope 3 + rope 4 features per head, d_v 5.
LATENT = dict(q_lora_rank=7, kv_lora_rank=6, qk_nope_head_dim=3, qk_rope_head_dim=4, v_head_dim=5)
CONFIGS = {
    "hf-gpt2": MHAConfig(d_model=15, n_heads=3),
    "hf-bert": MHAConfig(d_model=15, n_heads=3),
    "hf-llama": MHAConfig(**GQA, rope="half"),
    "meta-llama": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, bias=False, rope="interleaved"),
    "hf-gpt-neox": MHAConfig(d_model=24, n_heads=3, rope="half", rope_dims=4),
    "hf-phi3": MHAConfig(**GQA, bias=False, rope="half", rope_dims=4, causal=True),
    "hf-falcon": MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, rope="half", causal=True),
    "hf-qwen2": MHAConfig(**GQA, bias="qkv", rope="half", causal=True),
    "hf-mistral": MHAConfig(**GQA, bias=False, rope="half", causal=True, window=3),
    "hf-qwen3": MHAConfig(**GQA, rope="half", causal=True, qk_norm="head"),
    "hf-olmo2": MHAConfig(**GQA, bias=False, rope="half", causal=True, qk_norm="projection"),
    "hf-gemma2": MHAConfig(**GQA, rope="half", causal=True, scale=0.25, softcap=5.0, window=3),
    "hf-gemma3": MHAConfig(**GQA, bias=False, rope="half", causal=True, scale=0.125, qk_norm="head"),
    "hf-gpt-oss": MHAConfig(**GQA, rope="half", causal=True, sinks=True, window=4, rope_scaling=YARN_4),
    "hf-llama4": MHAConfig(
        **GQA, bias=False, rope="interleaved", causal=True, attention_chunk_size=3, qk_norm_after_rope=True
    ),
    "hf-llama4 nope": MHAConfig(**GQA, causal=True, attn_temperature_tuning=True, floor_scale=4),
    "hf-qwen3-next": MHAConfig(
        **{**GQA, "d_model": 18}, rope="half", rope_dims=2, causal=True, qk_norm="head", attn_output_gate=True
    ),
    "mlx-deepseek-v3": MHAConfig(d_model=16, n_heads=2, **LATENT, causal=True, rope_interleave=True, bias=True),
    "mlx-llama4": MHAConfig(
        d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, causal=True, rope="interleaved", attention_chunk_size=3
    ),
    # a NoPE layer's weightless norm: qk_norm="head", stored by the names q_norm/k_norm (unit weights on the module)
    "mlx-llama4-text": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, causal=True, qk_norm="head"),
    "hf-bloom": MHAConfig(d_model=18, n_heads=6, causal=True, alibi=True),
    "hf-mpt": MHAConfig(d_model=18, n_heads=6, bias=False, causal=True, alibi=True),
    "megatron": MHAConfig(d_model=16, n_heads=6, n_kv_heads=2, d_k=3),
    "timm-vit": MHAConfig(d_model=15, n_heads=3),
    "hf-t5": MHAConfig(d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0),
    "hf-t5 relative": MHAConfig(
        d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0, rel_buckets=10, rel_max_distance=20
    ),
    "keras": MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=6, kdim=11, vdim=9),
    "torch-mha": MHAConfig(d_model=15, n_heads=3, kdim=11, vdim=9),
    "flax": MHAConfig(d_model=15, n_heads=3, d_k=4, kdim=11, vdim=9),
    "equinox": MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=6, kdim=11, vdim=9, bias=False),
}
CONFIGS["mlx-qwen3-next"] = replace(CONFIGS["hf-qwen3-next"], bias=True)  # the same rows, biases too
ROUND_TRIP = list(CONFIGS)


def test_registry_lists_every_family():
    assert list(LAYOUTS) == [
        "hf-gpt2", "hf-bert", "hf-llama", "meta-llama", "hf-gpt-neox", "hf-phi3", "hf-falcon", "hf-qwen2",
        "hf-mistral", "hf-qwen3", "hf-olmo2", "hf-gemma2", "hf-gemma3", "hf-gemma4", "hf-gpt-oss", "hf-llama4", "hf-deepseek-v2",
            "hf-deepseek-v3", "hf-mistral4", "hf-qwen3-next", "hf-bloom", "hf-mpt",
        "megatron", "timm-vit", "hf-t5", "keras", "mlx-llama", "mlx-qwen2", "mlx-qwen3", "mlx-olmo2", "mlx-gemma3", "mlx-phi3", "mlx-gemma2",
        "mlx-gpt-oss", "mlx-qwen3-next", "mlx-deepseek-v3", "mlx-llama4", "mlx-llama4-text",
        "keras-hub-llama", "keras-hub-mistral", "keras-hub-gemma", "keras-hub-gemma3", "keras-hub-qwen2",
        "keras-hub-qwen3", "keras-hub-phi3", "keras-hub-gpt-oss",
        "torch-mha", "flax", "equinox",
    ]  # fmt: skip
    for name, layout in LAYOUTS.items():
        assert layout.name == name and get_layout(name) is layout
        assert layout.packing in ("separate", "blocks", "per head", "per group")


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_round_trip_is_exact_and_keys_are_the_real_names(name):
    cfg = CONFIGS[name]
    layout = get_layout(name.split()[0])
    params = init_params(cfg, seed=3)
    state = layout.to_state_dict(cfg, params)
    assert {k: v.shape for k, v in state.items()} == layout.expected_shapes(cfg)
    back = layout.from_state_dict(cfg, state)
    for key, value in params.as_dict().items():
        other = getattr(back, key)
        assert (value is None and other is None) or np.array_equal(value, other), key
    # The state dict owns its memory: writing to it leaves the canonical params alone.
    for array in state.values():
        array[...] = 0.0
    assert np.count_nonzero(params.w_q) == params.w_q.size


def _tagged_params(cfg):
    """Each canonical row tagged: q row r -> 1000 + r, k -> 2000 + r, v -> 3000 + r (every column the same)."""
    params = init_params(cfg)
    tag = {}
    for offset, name in ((1000, "w_q"), (2000, "w_k"), (3000, "w_v")):
        rows, cols = getattr(params, name).shape
        tag[name] = np.repeat((offset + np.arange(rows, dtype=float))[:, None], cols, axis=1)
    return params.__class__(**{**params.as_dict(), **tag})


def test_gpt2_conv1d_is_in_out_with_q_k_v_column_blocks():
    cfg = CONFIGS["hf-gpt2"]
    state = get_layout("hf-gpt2").to_state_dict(cfg, _tagged_params(cfg))
    c_attn = state["c_attn.weight"]  # (E, 3E): Conv1D keeps (in, out)
    assert c_attn.shape == (15, 45)
    assert list(c_attn[0, :3]) == [1000, 1001, 1002] and c_attn[0, 15] == 2000 and c_attn[0, 30] == 3000
    assert np.array_equal(state["c_proj.weight"], init_params(cfg).w_o.T)


def test_gpt_neox_packs_per_head_where_torch_packs_blocks():
    cfg = MHAConfig(d_model=12, n_heads=3, rope="half")  # d = 4
    tagged = _tagged_params(cfg)
    blocks = get_layout("torch-mha").to_state_dict(MHAConfig(d_model=12, n_heads=3), tagged)["in_proj_weight"][:, 0]
    assert list(blocks[:5]) == [1000, 1001, 1002, 1003, 1004]  # blocks: every q row first
    per_head = get_layout("hf-gpt-neox").to_state_dict(cfg, tagged)["query_key_value.weight"][:, 0]
    assert list(per_head[:12]) == [1000, 1001, 1002, 1003, 2000, 2001, 2002, 2003, 3000, 3001, 3002, 3003]  # fmt: skip
    assert list(per_head[12:16]) == [1004, 1005, 1006, 1007]  # [q_0; k_0; v_0], then q_1
    # one query head per group: Megatron's per-group packing is the same thing
    assert np.array_equal(per_head, pack_groups(cfg, *(getattr(tagged, w)[:, 0] for w in ("w_q", "w_k", "w_v"))))


def test_megatron_packs_per_query_group():
    cfg = MHAConfig(d_model=12, n_heads=4, n_kv_heads=2, d_k=2)  # two query heads per group
    column = get_layout("megatron").to_state_dict(cfg, _tagged_params(cfg))["linear_qkv.weight"][:, 0]
    # group 0: q heads 0 and 1 (rows 0..3), k_0 (2 rows), v_0 (2 rows); then group 1
    group_0 = [1000, 1001, 1002, 1003, 2000, 2001, 3000, 3001]
    group_1 = [1004, 1005, 1006, 1007, 2002, 2003, 3002, 3003]
    assert list(column) == group_0 + group_1
    q, k, v = unpack_groups(cfg, column)
    assert list(q) == list(range(1000, 1008))
    assert list(k) == [2000, 2001, 2002, 2003] and list(v) == [3000, 3001, 3002, 3003]


def test_timm_qkv_is_torch_in_proj_row_for_row():
    cfg = CONFIGS["timm-vit"]
    params = init_params(cfg, seed=5)
    timm = get_layout("timm-vit").to_state_dict(cfg, params)
    torch_mha = get_layout("torch-mha").to_state_dict(cfg, params)
    assert np.array_equal(timm["qkv.weight"], torch_mha["in_proj_weight"])
    assert np.array_equal(timm["qkv.bias"], torch_mha["in_proj_bias"])
    assert np.array_equal(timm["proj.weight"], torch_mha["out_proj.weight"])


def test_keras_kernels_keep_the_head_axis():
    cfg = CONFIGS["keras"]
    params = init_params(cfg)
    state = get_layout("keras").to_state_dict(cfg, params)
    assert state["query/kernel"].shape == (15, 3, 4) and state["key/kernel"].shape == (11, 3, 4)
    assert state["value/kernel"].shape == (9, 3, 6) and state["attention_output/kernel"].shape == (3, 6, 15)
    h, j = 2, 1  # scorer j of head h is row h*d_k + j of canonical w_q
    assert np.array_equal(state["query/kernel"][:, h, j], params.w_q[h * 4 + j])


# --- bad input: each a clear error naming the layout and the key or field --------------------


def test_unknown_layout():
    with pytest.raises(LayoutError, match=r"unknown layout 'gpt3'; known layouts: hf-gpt2, hf-bert"):
        get_layout("gpt3")


@pytest.mark.parametrize(
    ("name", "cfg", "match"),
    [
        (
            "hf-gpt2",
            MHAConfig(d_model=16, n_heads=4, n_kv_heads=2),
            r"layout 'hf-gpt2' .*MHAConfig.n_kv_heads=2 != n_heads=4: GPT2Attention",
        ),
        (
            "hf-gpt2",
            MHAConfig(d_model=15, n_heads=3, bias=False),
            r"MHAConfig.bias=False: GPT-2's Conv1D layers always have a bias",
        ),
        (
            "hf-t5",
            MHAConfig(d_model=15, n_heads=3, bias=False),
            r"layout 'hf-t5' .*MHAConfig.scale=0.447214: T5Attention does not scale",
        ),
        (
            "hf-t5",
            MHAConfig(d_model=15, n_heads=3, scale=1.0),
            r"MHAConfig.bias=True: T5's q/k/v/o are nn.Linear\(..., bias=False\)",
        ),
        (
            "hf-bert",
            MHAConfig(d_model=15, n_heads=3, d_k=4),
            r"MHAConfig.d_k=4: BertSelfAttention fixes d_k = d_model / n_heads = 5",
        ),
        ("timm-vit", MHAConfig(d_model=15, n_heads=3, kdim=11), r"MHAConfig.kdim=11, vdim=15: timm Attention projects"),
        ("keras", MHAConfig(d_model=16, n_heads=4, n_kv_heads=1), r"layout 'keras' .*n_kv_heads=1 != n_heads=4"),
        ("flax", MHAConfig(d_model=15, n_heads=3, d_v=4), r"MHAConfig.d_v=4 != d_k=5: flax"),
        (
            "meta-llama",
            MHAConfig(d_model=16, n_heads=4, bias=False),
            r"layout 'meta-llama' .*MHAConfig.rope=None: Meta's llama Attention applies rope='interleaved'",
        ),
        ("hf-llama", MHAConfig(d_model=16, n_heads=4), r"MHAConfig.rope=None: LlamaAttention applies rope='half'"),
        (
            "hf-llama",
            MHAConfig(d_model=16, n_heads=4, rope="interleaved"),
            r"MHAConfig.rope='interleaved': LlamaAttention applies rope='half'",
        ),
        (
            "hf-llama",
            MHAConfig(d_model=16, n_heads=4, rope="half", rope_dims=2),
            r"MHAConfig.rope_dims=2: LlamaAttention rotates every feature",
        ),
        (
            "meta-llama",
            MHAConfig(d_model=16, n_heads=4, rope="interleaved"),
            r"MHAConfig.bias=True: Meta's wq/wk/wv/wo are built with bias=False",
        ),
        (
            "hf-gpt-neox",
            MHAConfig(d_model=24, n_heads=3, rope="interleaved"),
            r"layout 'hf-gpt-neox' .*rope='interleaved': GPTNeoXAttention applies rope='half'",
        ),
        (
            "hf-gpt2",
            MHAConfig(d_model=16, n_heads=4, rope="half"),
            r"MHAConfig.rope='half': GPT2Attention applies rope=None",
        ),
        # a variant the module lacks: named with what the module has
        (
            "hf-gpt2",
            MHAConfig(d_model=16, n_heads=4, softcap=5.0),
            r"MHAConfig switches on softcap: GPT2Attention does not \(it has none of the 2024-26 variants\)",
        ),
        (
            "hf-llama",
            MHAConfig(d_model=16, n_heads=4, rope="half", window=3),
            r"MHAConfig switches on window: LlamaAttention does not \(it has rope_scaling only\)",
        ),
        (
            "hf-mistral",
            MHAConfig(d_model=16, n_heads=4, rope="half", causal=True, bias=False, sinks=True, window=3),
            r"switches on sinks: MistralAttention does not \(it has window only\)",
        ),
        (
            "hf-qwen2",
            MHAConfig(d_model=16, n_heads=4, rope="half", causal=True),
            r"MHAConfig.bias=True: Qwen2Attention biases q_proj, k_proj and v_proj, never o_proj",
        ),
        (
            "hf-qwen3",
            MHAConfig(d_model=16, n_heads=4, rope="half", causal=True, qk_norm="projection"),
            r"switches on qk_norm_projection: Qwen3Attention does not",
        ),
        (
            "hf-gemma2",
            MHAConfig(d_model=16, n_heads=4, rope="half", causal=True, scale=0.3),
            r"MHAConfig.scale=0.3: Gemma2Attention scales by query_pre_attn_scalar\*\*-0.5 with an int",
        ),
        (
            "hf-gpt-oss",
            MHAConfig(d_model=16, n_heads=4, rope="half", causal=True),
            r"MHAConfig.sinks=False: GptOssAttention has one sink logit per head",
        ),
        (
            "hf-bloom",
            MHAConfig(d_model=16, n_heads=4, causal=True),
            r"MHAConfig.alibi=False: BloomAttention adds ALiBi",
        ),
        (
            "hf-mpt",
            MHAConfig(d_model=16, n_heads=4, bias=False, causal=True, alibi=True, rope="half"),
            r"MHAConfig.rope='half': MptAttention applies rope=None",
        ),
    ],
)
def test_config_the_module_cannot_hold_is_refused(name, cfg, match):
    layout = get_layout(name)
    assert layout.unsupported_reason(cfg)
    with pytest.raises(LayoutError, match=match):
        layout.to_state_dict(cfg, init_params(cfg))


def test_state_dict_with_missing_extra_or_wrong_shape_keys():
    cfg = CONFIGS["hf-gpt2"]
    layout = get_layout("hf-gpt2")
    state = layout.to_state_dict(cfg, init_params(cfg))
    missing = {k: v for k, v in state.items() if k != "c_proj.bias"}
    with pytest.raises(LayoutError, match=r"layout 'hf-gpt2': state dict does not match: missing c_proj.bias"):
        layout.from_state_dict(cfg, missing)
    extra = {**state, "attn.masked_bias": np.zeros(1)}
    with pytest.raises(LayoutError, match=r"unexpected attn.masked_bias"):
        layout.from_state_dict(cfg, extra)
    transposed = {**state, "c_attn.weight": state["c_attn.weight"].T}  # the nn.Linear habit
    with pytest.raises(LayoutError, match=r"layout 'hf-gpt2': c_attn.weight has shape \(45, 15\), expected \(15, 45\)"):
        layout.from_state_dict(cfg, transposed)
    with pytest.raises(LayoutError, match=r"c_proj.weight must hold floating-point numbers"):
        layout.from_state_dict(cfg, {**state, "c_proj.weight": np.zeros((15, 15), dtype=np.int64)})
    with pytest.raises(TypeError, match=r"layout 'hf-gpt2': state_dict must be a mapping"):
        layout.from_state_dict(cfg, list(state.values()))


def test_t5_layer_with_relative_bias_needs_a_config_with_buckets():
    cfg = CONFIGS["hf-t5"]
    layout = get_layout("hf-t5")
    state = {**layout.to_state_dict(cfg, init_params(cfg)), "relative_attention_bias.weight": np.zeros((32, 3))}
    with pytest.raises(LayoutError, match=r"unexpected relative_attention_bias.weight"):
        layout.from_state_dict(cfg, state)  # a layer-0 state dict read with a later layer's configuration


def test_t5_relative_bias_is_stored_as_the_canonical_buckets_by_heads():
    cfg = CONFIGS["hf-t5 relative"]
    params = init_params(cfg, seed=2)
    state = get_layout("hf-t5").to_state_dict(cfg, params)
    table = state["relative_attention_bias.weight"]  # nn.Embedding(buckets, H): row = bucket, column = head
    assert table.shape == (10, 3) and np.array_equal(table, params.rel_bias)


def test_gemma3_stores_the_norm_weight_minus_one_and_reads_it_back_exactly():
    cfg = CONFIGS["hf-gemma3"]
    params = init_params(cfg, seed=4)
    layout = get_layout("hf-gemma3")
    state = layout.to_state_dict(cfg, params)
    assert np.array_equal(state["q_norm.weight"], params.q_norm - 1.0)  # Gemma3RMSNorm: x_hat * (1 + weight)
    assert np.array_equal(state["k_norm.weight"], params.k_norm - 1.0)
    # a real checkpoint's float32 (or bfloat16) stored weight: 1 + w in float64 keeps all its bits
    stored = np.random.default_rng(0).normal(0.0, 0.05, 6).astype(np.float32)
    back = layout.from_state_dict(cfg, {**{k: v.astype(np.float32) for k, v in state.items()}, "q_norm.weight": stored})
    assert back.q_norm.dtype == np.float64 and np.array_equal(back.q_norm, 1.0 + stored.astype(np.float64))
    again = layout.to_state_dict(cfg, back.astype(np.float64))["q_norm.weight"].astype(np.float32)
    assert np.array_equal(again, stored)


def test_bloom_packs_per_head_where_mpt_packs_blocks():
    cfg = MHAConfig(d_model=12, n_heads=3, bias=False, causal=True, alibi=True)  # d = 4
    tagged = _tagged_params(cfg)
    mpt = get_layout("hf-mpt").to_state_dict(cfg, tagged)["Wqkv.weight"][:, 0]
    assert list(mpt[[0, 12, 24]]) == [1000, 2000, 3000]  # [Q; K; V]: chunk(3)
    bloom_cfg = MHAConfig(d_model=12, n_heads=3, causal=True, alibi=True)
    per_head = get_layout("hf-bloom").to_state_dict(bloom_cfg, _tagged_params(bloom_cfg))["query_key_value.weight"]
    assert list(per_head[:, 0][[0, 4, 8, 12]]) == [1000, 2000, 3000, 1004]  # view(B, N, H, 3, d): [q_0; k_0; v_0]


def test_qwen2_stores_no_output_bias():
    shapes = get_layout("hf-qwen2").expected_shapes(CONFIGS["hf-qwen2"])
    assert shapes["q_proj.bias"] == (24,) and shapes["k_proj.bias"] == (12,) and "o_proj.bias" not in shapes


def test_olmo2_norms_span_the_projection_and_qwen3_norms_one_head():
    olmo = get_layout("hf-olmo2").expected_shapes(CONFIGS["hf-olmo2"])
    qwen = get_layout("hf-qwen3").expected_shapes(CONFIGS["hf-qwen3"])
    assert (olmo["q_norm.weight"], olmo["k_norm.weight"]) == ((24,), (12,))
    assert (qwen["q_norm.weight"], qwen["k_norm.weight"]) == ((6,), (6,))


def test_odd_rope_dims_is_refused_before_any_layout_sees_it():
    with pytest.raises(ValueError, match=r"MHAConfig.rope_dims must be even"):
        MHAConfig(d_model=24, n_heads=3, rope="half", rope_dims=3)


def test_meta_to_hf_conversion_permutes_q_and_k_rows_per_head_and_back():
    from mha_rosetta.core import rope_permutation
    from mha_rosetta.models import convert_state_dict

    cfg = CONFIGS["meta-llama"]  # d_k = 4: HF's view(H, d/2, 2, E).transpose(1, 2) is rows [0, 2, 1, 3] per head
    meta = get_layout("meta-llama").to_state_dict(cfg, init_params(cfg, seed=8))
    hf_cfg, hf = convert_state_dict(cfg, meta, "meta-llama", "hf-llama")
    assert hf_cfg.rope == "half" and list(rope_permutation(4, 4)) == [0, 2, 1, 3]
    assert np.array_equal(hf["q_proj.weight"][4:8], meta["wq.weight"][[4, 6, 5, 7]])  # head 1
    assert np.array_equal(
        hf["k_proj.weight"], meta["wk.weight"].reshape(2, 2, 2, 16).transpose(0, 2, 1, 3).reshape(8, 16)
    )
    assert np.array_equal(hf["v_proj.weight"], meta["wv.weight"]) and np.array_equal(
        hf["o_proj.weight"], meta["wo.weight"]
    )
    back_cfg, back = convert_state_dict(hf_cfg, hf, "hf-llama", "meta-llama")
    assert back_cfg == cfg and all(np.array_equal(back[k], meta[k]) for k in meta)
