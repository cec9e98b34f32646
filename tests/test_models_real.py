"""Every layout loaded into its family's real module (float64) gives the spec's output.

Tiny modules are built from the libraries' config objects (nothing is downloaded), loaded
by their own parameter names (``load_state_dict(strict=True)`` for torch modules) with
`Layout.to_state_dict`, and run with the masks their own models build (Hugging Face's
``create_causal_mask`` / ``create_bidirectional_mask``). Where a module stops before the
output projection (BERT's self-attention, Megatron's core attention), its merged context
is checked too.

Facts these tests handle rather than hide:
* Hugging Face's eager attention for Llama and GPT-NeoX runs its softmax in float32 even in a
  float64 model, and their rotary modules compute the angles in float32 (errors ~1e-7); so
  does ``jax.nn.dot_product_attention`` (Keras on JAX) with its softmax. Those runs are held
  to the float32 row of `core.tolerances` (``RealRun.precision``). HF's SDPA path with the
  spec's float64 (cos, sin) is held to float64, which shows that nothing else differs.
* Keras 3 ``MultiHeadAttention`` on the JAX backend fails when ``value_dim != key_dim``
  (``jax.nn.dot_product_attention`` wants value shaped like key): the runner reports it
  as ``known_difference`` and takes Keras's ``return_attention_scores=True`` path instead.
* timm does not import on these machines, so ``timm-vit`` is proved on the equivalent
  block packing: ``nn.MultiheadAttention`` loaded strictly with timm's tensors renamed
  (``qkv`` -> ``in_proj``). Megatron-LM is not installable, so ``megatron`` is proved
  against its ``linear_qkv`` split rewritten from its source (``view`` then ``split``).
"""

from __future__ import annotations

import os

# Keras picks its backend at first import; without one it wants TensorFlow, absent here.
# Set before anything in this process imports keras (an explicit KERAS_BACKEND wins).
os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np
import pytest

from mha_rosetta.core import MHAConfig, assert_close, init_params, reference_stages
from mha_rosetta.explain.oracle_modules import run_layout, unavailable_reason
from mha_rosetta.models import convert_state_dict, get_layout
from mha_rosetta.models.real_modules import allowed_mask, meta_reference_forward, run_real

BATCH, TOKENS = 2, 7
PADDING = np.ones((BATCH, TOKENS), dtype=bool)
PADDING[1, 4:] = False  # right padding: every query row keeps at least one key, even when causal

# The 2024-26 families, each with its variants on and sizes that differ from the defaults (6 heads: not a power
# of two, so ALiBi's second series is used; a window of 3 keys on 7 tokens).
VARIANT_FAMILIES = {
    "hf-qwen2": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias="qkv", rope="half", causal=True),
    "hf-mistral": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, rope="half", causal=True, window=3),
    "hf-qwen3": MHAConfig(
        d_model=16, n_heads=4, n_kv_heads=2, d_k=6, rope="half", causal=True, qk_norm="head", norm_eps=1e-5, window=3
    ),
    "hf-olmo2": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, rope="half", causal=True,
                          qk_norm="projection"),
    "hf-gemma2": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, rope="half", rope_base=500.0, causal=True,
                           scale=0.25, softcap=2.0, window=3),
    "hf-gemma3": MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, rope="half", causal=True,
                           scale=1 / 3, qk_norm="head", window=3),
    "hf-gpt-oss": MHAConfig(
        d_model=16, n_heads=4, n_kv_heads=2, d_k=6, rope="half", causal=True, sinks=True, window=3,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4},
    ),
    "hf-bloom": MHAConfig(d_model=18, n_heads=6, causal=True, alibi=True),
    "hf-mpt": MHAConfig(d_model=18, n_heads=6, bias=False, causal=True, alibi=True, scale=0.5),
}  # fmt: skip
GEMMA2_GLOBAL = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, rope="half", causal=True, scale=0.25, softcap=2.0)
GEMMA3_GLOBAL = MHAConfig(
    d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, rope="half", rope_base=1e6, causal=True, scale=0.25,
    qk_norm="head", rope_scaling={"rope_type": "linear", "factor": 8.0},
)  # fmt: skip
T5_RELATIVE = MHAConfig(d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0, rel_buckets=8, rel_max_distance=5)
T5_RELATIVE_DECODER = MHAConfig(
    d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0, causal=True, rel_buckets=8, rel_max_distance=5,
    rel_bidirectional=False,
)  # fmt: skip

# (layout, cfg, padded, kind): the kind says what ran, so a silent fallback would fail the test.
CASES = [
    ("hf-gpt2", MHAConfig(d_model=15, n_heads=3, causal=True), True, "real"),
    ("hf-gpt2", MHAConfig(d_model=15, n_heads=3), False, "real"),
    ("hf-bert", MHAConfig(d_model=15, n_heads=3), True, "real"),
    ("hf-t5", MHAConfig(d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0), True, "real"),
    ("hf-t5", MHAConfig(d_model=15, n_heads=3, d_k=4, bias=False, scale=1.0, causal=True), False, "real"),
    (
        "hf-llama",
        MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, rope="half", bias=False, causal=True),
        True,
        "real",
    ),
    ("hf-llama", MHAConfig(d_model=15, n_heads=3, d_k=4, rope="half", rope_base=500.0), True, "real"),
    (
        "meta-llama",
        MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="interleaved", bias=False, causal=True),
        True,
        "equivalent",
    ),
    ("hf-gpt-neox", MHAConfig(d_model=24, n_heads=3, rope="half", rope_dims=2, causal=True), True, "real"),
    ("hf-gpt-neox", MHAConfig(d_model=24, n_heads=3, rope="half", bias=False), False, "real"),
    (
        "hf-phi3",
        MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, d_k=6, bias=False, rope="half", rope_dims=4, causal=True),
        True,
        "real",
    ),
    ("hf-falcon", MHAConfig(d_model=24, n_heads=6, n_kv_heads=2, rope="half", causal=True), True, "real"),  # per group
    ("hf-falcon", MHAConfig(d_model=24, n_heads=6, n_kv_heads=1, rope="half", causal=True, bias=False), True, "real"),
    ("hf-falcon", MHAConfig(d_model=24, n_heads=6, rope="half", rope_base=500.0, causal=True), False, "real"),
    ("hf-t5", T5_RELATIVE, True, "real"),  # encoder: bidirectional buckets
    ("hf-t5", T5_RELATIVE_DECODER, False, "real"),  # decoder: past distances only
    # padded only without a window: a padded query whose W keys are all padding has no key left (the spec's zero
    # row; the modules' NaN or uniform rows are another matter, shown in the checks)
    *((layout, cfg, cfg.window is None, "real") for layout, cfg in VARIANT_FAMILIES.items()),
    ("hf-gemma2", GEMMA2_GLOBAL, True, "real"),  # a full-attention layer of layer_types: no window
    ("hf-gemma3", GEMMA3_GLOBAL, True, "real"),  # Gemma 3's global layers: base 1e6, linear scaling (27B: factor 8)
    ("hf-bloom", MHAConfig(d_model=20, n_heads=5, causal=True, alibi=True), False, "real"),  # 5 heads: 2nd series
    ("timm-vit", MHAConfig(d_model=15, n_heads=3), False, "equivalent"),
    ("megatron", MHAConfig(d_model=16, n_heads=6, n_kv_heads=2, d_k=3), True, "reimplementation"),
    ("megatron", MHAConfig(d_model=15, n_heads=3, causal=True, bias=False), False, "reimplementation"),
    (
        "megatron",
        MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="interleaved", rope_dims=2, causal=True),
        True,
        "reimplementation",
    ),
    ("keras", MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=4), True, "real"),
    ("keras", MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=4, window=3), False, "real"),  # sliding_window: two-sided
    ("keras", MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=4, window=2, causal=True), False, "real"),
    ("torch-mha", MHAConfig(d_model=15, n_heads=3, causal=True), True, "real"),
    ("flax", MHAConfig(d_model=15, n_heads=3, d_k=4), True, "real"),
    ("equinox", MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=6, bias=False), True, "real"),
]


def _skip_unless_runnable(layout: str) -> None:
    reason = unavailable_reason(layout)
    if reason:
        pytest.skip(reason)


def _inputs(cfg: MHAConfig) -> np.ndarray:
    return np.random.default_rng(11).standard_normal((BATCH, TOKENS, cfg.d_model))


def _check(layout: str, cfg: MHAConfig, padded: bool, seed: int = 0, **options):
    params = init_params(cfg, seed=seed)
    x = _inputs(cfg)
    padding = PADDING if padded else None
    run = run_layout(layout, cfg, get_layout(layout).to_state_dict(cfg, params), x, padding, **options)
    expected = reference_stages(cfg, params, x, mask=allowed_mask(cfg, BATCH, TOKENS, padding))
    assert_close(run.output, expected["output"], run.precision, what=f"{layout} real module output")
    if run.merged is not None:
        assert_close(run.merged, expected["merged"], run.precision, what=f"{layout} merged context")
    return run, params, expected


@pytest.mark.parametrize(
    ("layout", "cfg", "padded", "kind"),
    CASES,
    ids=lambda v: v.describe().replace(" ", ",") if isinstance(v, MHAConfig) else str(v),
)
def test_real_module_gives_the_spec_output(layout, cfg, padded, kind):
    _skip_unless_runnable(layout)
    run, _, _ = _check(layout, cfg, padded)
    assert run.kind == kind, f"{layout}: expected a {kind} run, got {run.kind}: {run.module}"
    if kind == "real" and layout not in ("hf-bert",):
        # the real module stores exactly the layout's names and shapes
        assert run.parameters == get_layout(layout).expected_shapes(cfg)
    if kind == "real" and layout == "hf-bert":
        stored = {k: v for k, v in run.parameters.items() if not k.startswith("output.LayerNorm")}
        assert stored == get_layout(layout).expected_shapes(cfg)


SDPA_CASES = [
    ("hf-gpt2", MHAConfig(d_model=15, n_heads=3, causal=True), False),  # no mask at all: the module's own is_causal
    ("hf-llama", MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="half", bias=False, causal=True), False),
    ("hf-llama", MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="half", bias=False, causal=True), True),
    # Two-sided: no mask at all reaches SDPA, so only the module's is_causal (False here) keeps it two-sided.
    ("hf-llama", MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="half", bias=False), False),
    ("hf-llama", MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="half", bias=False), True),
    ("hf-gpt-neox", MHAConfig(d_model=24, n_heads=3, rope="half", rope_dims=4, causal=True), True),
    ("hf-bert", MHAConfig(d_model=15, n_heads=3), True),
    (
        "hf-phi3",
        MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, bias=False, rope="half", rope_dims=2, causal=True),
        True,
    ),
    ("hf-falcon", MHAConfig(d_model=24, n_heads=6, n_kv_heads=3, rope="half", causal=True), True),
    ("hf-qwen2", VARIANT_FAMILIES["hf-qwen2"], True),
    ("hf-mistral", VARIANT_FAMILIES["hf-mistral"], False),  # the sliding-window mask, as SDPA gets it
    ("hf-t5", T5_RELATIVE, True),
]


@pytest.mark.parametrize(
    ("layout", "cfg", "padded"),
    SDPA_CASES,
    ids=lambda v: v.describe().replace(" ", ",") if isinstance(v, MHAConfig) else str(v),
)
def test_hugging_face_sdpa_path_agrees_in_float64(layout, cfg, padded):
    """HF's default path (torch SDPA) keeps float64 once the rotary tables are float64 too.

    Llama's and GPT-NeoX's rotary modules compute their angles in float32 even in a float64
    model, so here they get the spec's float64 (cos, sin); with the eager softmax (float32) or
    the module's own tables the float32 tolerance applies (see CASES).
    """
    _skip_unless_runnable(layout)
    run, _, _ = _check(layout, cfg, padded, implementation="sdpa", float64_rotary=cfg.rope is not None)
    assert run.precision == "float64" and "(sdpa" in run.module


@pytest.mark.parametrize("kv_heads", [2, 1, 6], ids=["new_decoder_architecture", "multi_query", "per head"])
def test_falcon_eager_path_keeps_float64_given_float64_rotary_tables_where_it_is_falcons_own(kv_heads):
    """Falcon's own eager attention (before transformers 5.25) ran its softmax in the hidden states' dtype; from
    5.25 its eager path is the shared ``eager_attention_forward``, whose softmax is float32, and the run says so
    (held to the float32 tolerance, `_check`)."""
    _skip_unless_runnable("hf-falcon")
    from mha_rosetta.models.hf_falcon import falcon_eager_is_shared

    cfg = MHAConfig(d_model=24, n_heads=6, n_kv_heads=kv_heads, rope="half", causal=True)
    run, _, _ = _check("hf-falcon", cfg, True, implementation="eager", float64_rotary=True)
    packing = {2: "new_decoder_architecture", 1: "multi_query", 6: "per head"}[kv_heads]
    assert run.module == f"transformers FalconAttention, {packing} packing (eager)"
    if falcon_eager_is_shared():
        assert run.precision == "float32" and "softmax runs in float32" in run.note
    else:
        assert run.precision == "float64"


@pytest.mark.parametrize(
    ("layout", "cfg"), [("hf-gpt-oss", VARIANT_FAMILIES["hf-gpt-oss"]), ("hf-t5", T5_RELATIVE_DECODER)]
)
def test_eager_paths_that_keep_float64(layout, cfg):
    """gpt-oss's eager softmax keeps the scores' dtype (with its sinks, and YaRN's tables in float64); so does T5's."""
    _skip_unless_runnable(layout)
    run, _, _ = _check(layout, cfg, False, implementation="eager", float64_rotary=cfg.rope is not None)
    assert run.precision == "float64", run.note


@pytest.mark.parametrize("layout", ["hf-qwen3", "hf-olmo2", "hf-gemma3", "hf-gemma2", "hf-bloom", "hf-mpt"])
def test_families_that_compute_in_float32_on_every_path_say_where(layout):
    """No path of these modules keeps float64 (the QK-norm, BLOOM's and MPT's softmax, Gemma 2's softcap)."""
    _skip_unless_runnable(layout)
    cfg = VARIANT_FAMILIES[layout]
    hf = get_layout(layout).hf_options
    run, _, _ = _check(layout, cfg, False, **({"implementation": "eager", "float64_rotary": True} if hf else {}))
    assert run.precision == "float32"
    where = {"hf-qwen3": "RMSNorm", "hf-olmo2": "RMSNorm", "hf-gemma3": "Gemma3RMSNorm", "hf-gemma2": "softmax",
             "hf-bloom": "softmax", "hf-mpt": "softmax"}[layout]  # fmt: skip
    assert where in run.note


def test_softcap_and_sinks_families_refuse_sdpa():
    _skip_unless_runnable("hf-gemma2")
    for layout in ("hf-gemma2", "hf-gpt-oss"):
        cfg = VARIANT_FAMILIES[layout]
        with pytest.raises(ValueError, match=r"_supports_sdpa = False .*use implementation='eager'"):
            _check(layout, cfg, False, implementation="sdpa")


def _without_variants(cfg: MHAConfig, params):
    """cfg with its variants off (the biases kept as True), and params without the variants' parameters."""
    import dataclasses

    plain = dataclasses.replace(
        cfg, window=None, softcap=None, qk_norm=None, alibi=False, sinks=False, rel_buckets=None, rope_scaling=None,
        bias=bool(cfg.bias),
    )  # fmt: skip
    kept = {k: v for k, v in params.as_dict().items() if k not in ("q_norm", "k_norm", "sinks", "rel_bias")}
    if cfg.bias == "qkv":
        kept["b_o"] = np.full(cfg.d_model, 0.1)  # the output bias a port that reads bias=True adds
    return plain, type(params)(**kept)


@pytest.mark.parametrize("layout", [*VARIANT_FAMILIES, "hf-t5"])
def test_each_variant_changes_the_real_modules_output(layout):
    """The agreement above is not vacuous: the spec without the family's variants is far from the real module."""
    _skip_unless_runnable(layout)
    cfg = VARIANT_FAMILIES.get(layout, T5_RELATIVE)
    run, params, _ = _check(layout, cfg, False)
    plain_cfg, plain_params = _without_variants(cfg, params)
    plain = reference_stages(plain_cfg, plain_params, _inputs(cfg))["output"]
    assert np.max(np.abs(run.output - plain)) > 1e-3, layout


def test_hugging_face_rotary_module_computes_in_float32():
    """The same Llama layer: the module's own cos/sin cost float32-sized errors that float64 tables remove."""
    _skip_unless_runnable("hf-llama")
    cfg = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="half", bias=False, causal=True)
    own, _, expected = _check("hf-llama", cfg, True, implementation="sdpa")
    assert own.precision == "float32" and "angles in float32" in own.note
    error = np.max(np.abs(own.output - expected["output"]))
    assert 1e-9 < error < 1e-5  # float32 angles: wrong in the 8th digit, not in the 2nd


def test_implementation_is_checked():
    _skip_unless_runnable("torch-mha")
    cfg = MHAConfig(d_model=15, n_heads=3)
    state = get_layout("torch-mha").to_state_dict(cfg, init_params(cfg))
    with pytest.raises(
        ValueError, match=r"implementation and float64_rotary apply to Hugging Face layouts only, not 'torch-mha'"
    ):
        run_real("torch-mha", cfg, state, _inputs(cfg), implementation="sdpa")


def test_bert_attention_block_is_layernorm_of_the_spec_output_plus_input():
    """The whole BertAttention (self + output): LayerNorm(spec output + x), with the real LayerNorm at its initial values."""
    _skip_unless_runnable("hf-bert")
    import torch
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertAttention

    cfg = MHAConfig(d_model=15, n_heads=3)
    params = init_params(cfg, seed=2)
    config = BertConfig(
        hidden_size=15, num_attention_heads=3, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0
    )
    config._attn_implementation = "eager"
    module = BertAttention(config).double().eval()
    state = {k: torch.from_numpy(v) for k, v in get_layout("hf-bert").to_state_dict(cfg, params).items()}
    result = module.load_state_dict(state, strict=False)
    assert (
        sorted(result.missing_keys) == ["output.LayerNorm.bias", "output.LayerNorm.weight"]
        and not result.unexpected_keys
    )
    x = _inputs(cfg)
    with torch.no_grad():
        block = module(torch.from_numpy(x))[0].numpy()
    expected = reference_stages(cfg, params, x)["output"] + x
    expected = (expected - expected.mean(-1, keepdims=True)) / np.sqrt(
        expected.var(-1, keepdims=True) + config.layer_norm_eps
    )
    assert_close(block, expected, "float64", what="BertAttention block")


def test_keras_value_dim_different_from_key_dim_is_reported():
    """Keras 3 on JAX fails when value_dim != key_dim; the runner says so and uses the einsum path."""
    _skip_unless_runnable("keras")
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=4, d_v=6)
    run, _, _ = _check("keras", cfg, padded=True)
    import keras

    if keras.backend.backend() == "jax":
        assert "the default call fails" in run.known_difference
        # jax.nn.dot_product_attention rejects the value shape; Keras's fallback then fails to reshape
        assert "cannot reshape array of shape (2, 7, 3, 1, 6)" in run.known_difference
        assert run.precision == "float64"  # the einsum path keeps float64
    else:
        assert run.known_difference == ""


def test_keras_cross_attention_widths():
    _skip_unless_runnable("keras")
    cfg = MHAConfig(d_model=15, n_heads=3, d_k=5, d_v=5)
    _check("keras", cfg, padded=False, seed=4)


def test_a_packing_mix_up_is_caught_by_the_real_module():
    """GPT-NeoX's per-head packing read as timm/torch blocks: same shape, no error, wrong output."""
    _skip_unless_runnable("torch-mha")
    cfg = MHAConfig(d_model=15, n_heads=3)
    params = init_params(cfg, seed=6)
    per_head = get_layout("megatron").to_state_dict(cfg, params)  # G = H: GPT-NeoX's [q_h; k_h; v_h]
    blocks = get_layout("timm-vit").to_state_dict(cfg, params)
    mixed = {**blocks, "qkv.weight": per_head["linear_qkv.weight"], "qkv.bias": per_head["linear_qkv.bias"]}
    run = run_real("timm-vit", cfg, mixed, _inputs(cfg))
    expected = reference_stages(cfg, params, _inputs(cfg))["output"]
    assert np.max(np.abs(run.output - expected)) > 0.1


META_CFG = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, rope="interleaved", bias=False, causal=True)


def test_meta_llama_own_forward_is_the_spec_in_float64():
    """Meta's Attention.forward (view_as_complex rotary on wq/wk/wv/wo), rewritten from its source, in float64."""
    _skip_unless_runnable("meta-llama")
    params = init_params(META_CFG, seed=9)
    x = _inputs(META_CFG)
    state = get_layout("meta-llama").to_state_dict(META_CFG, params)
    output = meta_reference_forward(META_CFG, state, x, PADDING)
    expected = reference_stages(META_CFG, params, x, mask=allowed_mask(META_CFG, BATCH, TOKENS, PADDING))["output"]
    assert_close(output, expected, "float64", what="Meta's forward")


def test_meta_weights_in_hf_llama_need_the_row_permutation():
    """Copying wq/wk into q_proj/k_proj unchanged runs without any error and gives wrong output."""
    _skip_unless_runnable("hf-llama")
    params = init_params(META_CFG, seed=10)
    x = _inputs(META_CFG)
    meta = get_layout("meta-llama").to_state_dict(META_CFG, params)
    expected = reference_stages(META_CFG, params, x, mask=allowed_mask(META_CFG, BATCH, TOKENS, PADDING))["output"]
    hf_cfg, hf = convert_state_dict(META_CFG, meta, "meta-llama", "hf-llama")
    converted = run_real("hf-llama", hf_cfg, hf, x, PADDING)
    assert_close(converted.output, expected, converted.precision, what="converted Meta weights in LlamaAttention")
    names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    renamed = {names[k.split(".")[0]] + ".weight": v for k, v in meta.items()}
    naive = run_real("hf-llama", hf_cfg, renamed, x, PADDING)
    assert np.max(np.abs(naive.output - expected)) > 1e-2


def test_each_family_registers_its_runner_with_its_layout_and_models_runs_no_backend():
    from mha_rosetta.models import LAYOUTS

    without = sorted(name for name, layout in LAYOUTS.items() if layout.runner is None)
    assert without == ["equinox", "flax"]  # the library oracles: their backends run them (explain.oracle_modules)
    assert get_layout("hf-t5").requires == ("torch", "transformers") and get_layout("hf-t5").hf_options
    assert get_layout("keras").requires == ("keras",) and not get_layout("keras").hf_options
    with pytest.raises(ImportError, match=r"layout .flax. has no real-module runner in mha_rosetta\.models"):
        run_real("flax", MHAConfig(d_model=15, n_heads=3, d_k=4), {}, np.zeros((1, 2, 15)))
