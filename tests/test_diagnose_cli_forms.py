"""``mha-rosetta diagnose``'s options for the forms of 2025-26 (issue 45), each its registry entry's (`Variant.cli`).

The output gate (``--attn-output-gate``), V tied to K (``--attention-k-eq-v``) and MLA (``--kv-lora-rank`` and its
sizes) build the configuration their entries' fields describe; ``--norm-eps`` is refused by name unless a variant
that reads it is given (the QK-norms, the norm after rotary, the value norm, MLA's latent norms); MLA's forward and
its decode loop are diagnosed from the command line.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap

import pytest

from conftest import run_cli
from mha_rosetta.cli.diagnose import _config, add_arguments
from mha_rosetta.cli.variant_options import OPTIONS, readers
from mha_rosetta.core import MHAConfig
from mha_rosetta.core.variants import VARIANT_REGISTRY
from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE, DEEPSEEK_V3_LIKE, YARN

V3_WORDS = "--d-model 24 --heads 3 --kv-lora-rank 10 --q-lora-rank 7 --qk-nope-head-dim 4 --qk-rope-head-dim 6"
V3_WORDS += " --v-head-dim 5 --causal --no-bias"
V2_LITE_SIZES = "--kv-lora-rank 6 --qk-nope-head-dim 3 --qk-rope-head-dim 4 --v-head-dim 5"
V2_LITE_WORDS = "--d-model 20 --heads 4 " + V2_LITE_SIZES
NORMS = "--qk-norm, --qk-norm-after-rope, --kv-lora-rank or --value-norm"  # registry order


def _parsed(words: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*words.split(), *extra])


def test_the_options_are_the_registrys_and_the_forms_have_theirs():
    flags = {option.flag for entry in VARIANT_REGISTRY.values() for option in entry.cli}
    assert {option.flag for option in OPTIONS} == flags  # no option kept anywhere else
    new = {"--attn-output-gate": "gate", "--attention-k-eq-v": "k_eq_v", "--kv-lora-rank": "mla"}
    new |= dict.fromkeys(("--q-lora-rank", "--qk-nope-head-dim", "--qk-rope-head-dim", "--v-head-dim"), "mla")
    new["--no-rope-interleave"] = "mla"
    owner = {option.flag: entry.name for entry in VARIANT_REGISTRY.values() for option in entry.cli}
    assert {flag: owner[flag] for flag in new} == new


def test_mla_options_build_deepseek_v3s_configuration():
    args = _parsed(V3_WORDS, "--rope-scaling", json.dumps(YARN))
    cfg = _config(args)
    assert cfg == MHAConfig(**DEEPSEEK_V3_LIKE)
    # MLA resolves the head sizes, the pairing and YaRN's scale itself: the options go to the constructor.
    assert (cfg.d_k, cfg.d_v, cfg.rope, cfg.rope_dims) == (10, 5, "interleaved", 6)
    assert cfg.scale == pytest.approx(10**-0.5 * (0.09 * math.log(4) + 1) ** 2, rel=1e-15)
    assert set(cfg.variants) == {"mla", "mla_q_lora", "rope_scaling"}
    half = _config(_parsed(V2_LITE_WORDS, "--causal", "--no-rope-interleave", "--norm-eps", "1e-5"))
    assert (half.rope, half.q_lora_rank, half.norm_eps) == ("half", None, 1e-5)
    assert half == MHAConfig(**DEEPSEEK_V2_LITE_LIKE, rope_interleave=False, norm_eps=1e-5)


def test_the_gate_and_k_eq_v_options_switch_their_variants_on():
    gate = _config(_parsed("--d-model 16 --heads 4 --attn-output-gate"))
    assert gate == MHAConfig(d_model=16, n_heads=4, attn_output_gate=True) and gate.variants == ("gate",)
    tied = _config(_parsed("--d-model 16 --heads 4 --kv-heads 2 --attention-k-eq-v --value-norm --norm-eps 1e-5"))
    assert (tied.attention_k_eq_v, tied.value_norm, tied.norm_eps) == (True, True, 1e-5)
    assert set(tied.variants) == {"k_eq_v", "value_norm"}


@pytest.mark.parametrize(
    "words, message",
    [
        ("--norm-eps 1e-5", f"--norm-eps needs {NORMS}: it sets norm_eps, which only those variants read "
         "(given alone it would change nothing)"),
        ("--norm-eps 1e-5 --attn-output-gate", f"--norm-eps needs {NORMS}"),
        ("--q-lora-rank 7", "--q-lora-rank needs --kv-lora-rank (it sets a part of that variant)"),
        ("--no-rope-interleave", "--no-rope-interleave needs --kv-lora-rank (it sets a part of that variant)"),
        ("--kv-lora-rank 4", "MHAConfig.kv_lora_rank=4 needs qk_rope_head_dim"),
        (f"{V2_LITE_SIZES} --rope half --rope-dims 4", "MHAConfig.rope='half' contradicts MLA: it must be 'interleaved'"),
    ],
)  # fmt: skip
def test_bad_variant_options_are_refused_naming_the_options(words, message):
    with pytest.raises(ValueError) as error:
        _config(_parsed("--d-model 20 --heads 4 " + words))
    assert message in str(error.value)


def test_norm_eps_is_accepted_with_every_norm_that_reads_it():
    assert readers(next(o for o in OPTIONS if o.flag == "--norm-eps"), 1e-5) == NORMS.replace(" or", ",").split(", ")
    for words in (
        "--qk-norm head",
        "--qk-norm-after-rope --rope interleaved --rope-dims 4",
        "--value-norm",
        V2_LITE_SIZES,
    ):
        assert _config(_parsed(f"--d-model 20 --heads 4 {words} --norm-eps 1e-5")).norm_eps == 1e-5, words


PORT = textwrap.dedent(
    """
    from mha_rosetta.core import MHAConfig
    from mha_rosetta.core.mla_forms import mla_forward
    from mha_rosetta.core.variants.mla import DEEPSEEK_V2_LITE_LIKE
    from mha_rosetta.diagnose import DecodeBug, simulate_decode

    CFG = MHAConfig(**DEEPSEEK_V2_LITE_LIKE)

    def forward(params, query, key, value, mask):
        return mla_forward(CFG, params, query, mask=mask, form="absorbed")

    def raw_latent_loop(params, x, prefill, step, mask, positions):
        bug = DecodeBug(mistakes=(("mla", "unnormed_latent"),))
        return simulate_decode(CFG, params, x, prefill=prefill, step=step, mask=mask, positions=positions, bug=bug)
    """
)


def test_the_command_line_diagnoses_mlas_forward_and_names_its_decode_loops_cache(tmp_path):
    (tmp_path / "deepseek_port.py").write_text(PORT, encoding="utf-8")
    done = run_cli("diagnose", "deepseek_port:forward", *V2_LITE_WORDS.split(), "--causal", cwd=tmp_path)
    assert done.returncode == 0 and "agrees with the oracle" in done.stdout, done.stdout + done.stderr
    loop = run_cli("diagnose", "--decode", "deepseek_port:raw_latent_loop", *V2_LITE_WORDS.split(), cwd=tmp_path)
    assert loop.returncode == 1, loop.stdout + loop.stderr
    assert "1. decode_latent_not_normed: the cache holds the un-normalised latent" in loop.stdout
    refused = run_cli("diagnose", "deepseek_port:forward", "--d-model", "20", "--heads", "4", "--norm-eps", "1e-5",
                      cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and f"error: --norm-eps needs {NORMS}" in refused.stderr, refused.stderr
