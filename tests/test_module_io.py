"""The models' shared reading and building helpers, by hand: no framework is imported.

`_module_io.unexpressible_config` turns what MHAConfig refuses inside it into the `LayoutError` naming the class;
`_mlx_build` writes the ModelArgs entries every tiny mlx-lm build shares and the rotary's entries, whose
``length`` stands in where the configuration gives no original length (4096, DeepSeek V3's 2048, Llama 4's 8192).
"""

from __future__ import annotations

import pytest

from mha_rosetta.core import MHAConfig
from mha_rosetta.models import LayoutError
from mha_rosetta.models._mlx_build import mlx_rope_arguments, tiny_model_args
from mha_rosetta.models._module_io import unexpressible_config


class FakeAttention:
    """A stand-in module: only its class path is read."""


def test_what_mhaconfig_refuses_is_named_with_the_class_and_the_reason():
    with pytest.raises(LayoutError) as caught, unexpressible_config(FakeAttention()):
        MHAConfig(d_model=15, n_heads=4)  # 15 is not 4 heads of a whole width
    message = str(caught.value)
    assert message.startswith(f"{__name__}.FakeAttention has a configuration MHAConfig refuses, which the spec")
    assert "d_model" in message and isinstance(caught.value.__cause__, ValueError)


def test_a_config_that_holds_returns_through_the_block_and_other_errors_pass():
    def read() -> MHAConfig:
        with unexpressible_config(FakeAttention()):
            return MHAConfig(d_model=15, n_heads=3)

    assert read() == MHAConfig(d_model=15, n_heads=3)
    with pytest.raises(KeyError), unexpressible_config(FakeAttention()):
        raise KeyError("not a refusal: passes unchanged")


def test_tiny_model_args_are_the_configurations_sizes():
    cfg = MHAConfig(d_model=24, n_heads=4, n_kv_heads=2, rope="half", rope_base=500_000.0)
    assert tiny_model_args(cfg, layers=4) == {
        "hidden_size": 24,
        "intermediate_size": 24,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500_000.0,
        "vocab_size": 8,
    }


def test_rope_arguments_drop_unset_keys_and_fall_back_to_the_given_length():
    plain = MHAConfig(d_model=16, n_heads=4, rope="half")
    assert mlx_rope_arguments(plain) == {"rope_scaling": None, "max_position_embeddings": 4096}
    assert mlx_rope_arguments(plain, length=2048) == {"rope_scaling": None, "max_position_embeddings": 2048}
    linear = MHAConfig(d_model=16, n_heads=4, rope="half", rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert mlx_rope_arguments(linear, length=8192) == {  # no original length in the configuration: the given one
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "max_position_embeddings": 8192,
    }
    yarn = MHAConfig(
        d_model=16,
        n_heads=4,
        rope="half",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    assert yarn.rope_scaling["mscale"] is None  # the spec's form keeps YaRN's unset keys as None
    assert mlx_rope_arguments(yarn, length=2048) == {  # the configuration's own length wins; None keys dropped
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,
        },
        "max_position_embeddings": 64,
    }
