"""`diagnose` against a real module: the reference configuration comes from `models.from_module`.

``diagnose(candidate, like=module)`` and ``mha-rosetta diagnose pkg.port:attention --like pkg.ref:module``
read the module's configuration (sizes, kv heads, scale, causal, rotary) instead of taking it by hand.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mha_rosetta.core import MHAConfig, reference_mha
from mha_rosetta.diagnose import diagnose
from mha_rosetta.models import LayoutError, from_module
from mha_rosetta.models.real_modules import libraries_missing

ROOT = Path(__file__).resolve().parents[1]


def _need(*modules):
    reason = libraries_missing(modules)
    if reason:
        pytest.skip(reason)


def _llama():
    _need("torch", "transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    return LlamaAttention(config, layer_idx=0).double().eval()


def test_diagnose_like_a_module_takes_its_configuration():
    module = _llama()
    cfg = from_module(module).cfg
    assert cfg == MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, bias=False, causal=True, rope="half", rope_base=500.0)

    def port(params, query, key, value, mask):  # a port with the module's configuration: agrees
        return reference_mha(cfg, params, query, key, value, mask)

    def unscaled(params, query, key, value, mask):  # a port that forgot 1/sqrt(d_k)
        return reference_mha(dataclasses.replace(cfg, scale=1.0), params, query, key, value, mask)

    assert diagnose(port, like=module).agrees
    result = diagnose(unscaled, like=module)
    assert not result.agrees and result.causes[0].code == "scale"
    # a port that is right for the default rotary base is wrong for this module's base of 500
    default_base = dataclasses.replace(cfg, rope_base=10000.0)
    assert not diagnose(lambda p, q, k, v, m: reference_mha(default_base, p, q, k, v, m), like=module).agrees


def test_diagnose_takes_cfg_or_like_not_both_nor_neither():
    def port(params, query, key, value, mask):
        return reference_mha(MHAConfig(d_model=12, n_heads=3), params, query, key, value, mask)

    with pytest.raises(TypeError, match=r"give cfg or like, not both"):
        diagnose(port, MHAConfig(d_model=12, n_heads=3), like=object())
    with pytest.raises(TypeError, match=r"diagnose needs the reference configuration: cfg=MHAConfig\(...\) or like="):
        diagnose(port)
    with pytest.raises(LayoutError, match=r"no layout reads builtins\.object .*known classes"):
        diagnose(port, like=object())


REFERENCE = """
    import dataclasses

    import torch

    from mha_rosetta.core import reference_mha
    from mha_rosetta.models import from_module

    module = torch.nn.MultiheadAttention(12, 3, kdim=7, vdim=5, batch_first=True, dtype=torch.float64)
    linear = torch.nn.Linear(3, 4)


    def make():
        return torch.nn.MultiheadAttention(12, 3, kdim=7, vdim=5, batch_first=True, dtype=torch.float64)


    CFG = from_module(module).cfg


    def port(params, query, key, value, mask):
        return reference_mha(CFG, params, query, key, value, mask)


    def unscaled(params, query, key, value, mask):
        return reference_mha(dataclasses.replace(CFG, scale=1.0), params, query, key, value, mask)
"""


def _cli(cwd: Path, *args):
    return subprocess.run(
        [sys.executable, "-m", "mha_rosetta.cli.main", "diagnose", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_cli_diagnose_like(tmp_path):
    _need("torch")
    (tmp_path / "ref_mod.py").write_text(textwrap.dedent(REFERENCE), encoding="utf-8")
    done = _cli(tmp_path, "ref_mod:port", "--like", "ref_mod:module", "--json", "-")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["agrees"] is True and report["like"] == "ref_mod:module"
    assert report["config"] == "d_model=12 heads=3 d_k=4 d_v=4 kdim=7 vdim=5"
    wrong = _cli(tmp_path, "ref_mod:unscaled", "--like", "ref_mod:make")  # a function builds the module
    assert wrong.returncode == 1, wrong.stderr
    assert "like ref_mod:make" in wrong.stdout and "1. scale:" in wrong.stdout
    for args, message in [
        (
            ("--like", "ref_mod:module", "--heads", "3", "--causal"),
            "--like gives the whole configuration; drop --heads, --causal",
        ),
        (("--like", "ref_mod:linear"), "--like ref_mod:linear: from_module/to_module: no layout reads torch.nn"),
        (("--like", "ref_mod:nothing"), "has no attribute 'nothing'"),
        ((), "--d-model and --heads required: the sizes the candidate's module was built for (or --like"),
    ]:
        failed = _cli(tmp_path, "ref_mod:port", *args)
        assert failed.returncode == 2, (args, failed.stdout)
        assert message in failed.stderr, (args, failed.stderr)


def test_diagnose_like_a_windowed_module_names_the_window_off_by_one():
    _need("torch", "transformers")
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralAttention

    config = MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, sliding_window=3, head_dim=8)
    module = MistralAttention(config, layer_idx=0).double().eval()
    cfg = from_module(module).cfg
    assert cfg.window == 3 and cfg.causal

    def port(params, query, key, value, mask):  # the module's own window: agrees
        return reference_mha(cfg, params, query, key, value, mask)

    def one_more_key(params, query, key, value, mask):  # FlashAttention's window_size=(W, 0) taken for W
        return reference_mha(dataclasses.replace(cfg, window=4), params, query, key, value, mask)

    assert diagnose(port, like=module).agrees
    result = diagnose(one_more_key, like=module)
    assert not result.agrees and result.causes[0].code == "window"
