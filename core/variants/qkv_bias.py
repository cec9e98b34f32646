"""Qwen2's biases: q, k and v biased, the output not (``bias="qkv"``; the projections' formula is `core.linear`)."""

from __future__ import annotations

from ._entry import BenchSpec, CaseSpec, Explanation, Variant, demo, switch_option

# Qwen2's layer, GQA and rotary: the check case and the decode case read the same configuration.
QWEN2_LIKE = dict(d_model=21, n_heads=3, n_kv_heads=1, rope="half", d_k=6, causal=True, bias="qkv")


def explain(demo) -> Explanation:
    return Explanation(
        "bias='qkv'",
        "q, k, v = x @ w.T + b; out = merged @ w_o.T (no b_o)",
        "the projections",
        [
            ("Hugging Face", "Qwen2: q_proj, k_proj, v_proj with bias=True, o_proj with bias=False"),
            ("Hugging Face config", "attention_bias = True (Llama family, gpt-oss) biases all four: bias=True here"),
        ],
        ["a dropped b_k changes nothing (the softmax cancels q.b_k along a row): only b_q, b_v and b_o show"],
    )


ENTRY = Variant(
    name="qkv_bias",
    summary='bias on q, k and v, none on the output (bias="qkv")',
    fields=("bias",),
    is_on=lambda cfg: cfg.bias == "qkv",
    # MHAConfig validates `bias` itself: True and False are the 2017-23 layer's, "qkv" this variant's.
    check_cases=(
        CaseSpec(
            "qkv_bias",
            "Qwen2: q, k and v biased, the output not; grouped kv heads with rotary",
            QWEN2_LIKE,
            dict(dtypes=("float64", "float16"), seed=25),
        ),
    ),
    decode_cases=(
        CaseSpec(
            "qkv_bias",
            "Qwen2's biases on q, k and v and none on the output, GQA and rotary",
            QWEN2_LIKE,
            dict(tokens=8, prefill=3, seed=118),
        ),
    ),
    bench=BenchSpec({"bias": "qkv"}, "plain"),
    cli=(
        switch_option(
            "--qkv-bias",
            {"bias": "qkv"},
            "q, k and v biased, the output not (Qwen2)",
            rank=40,
            conflicts={"--no-bias": "q, k and v biased"},
        ),
    ),
    **demo("bias", "qkv", True),
    explain=explain,
)
