"""The tensor-parallelism explainer: which weight axis is cut, where the all-reduce is, checked live."""

from __future__ import annotations

import json

import pytest

from mha_rosetta.cli.main import main
from mha_rosetta.core import MHAConfig
from mha_rosetta.explain.sharding import explain_sharding


def test_seed_layer_over_three_ranks():
    result = explain_sharding()  # the explainer's default 3 heads: the most ranks up to 4 that split them is 3
    assert result.world == 3
    cuts = {cut.weight: cut for cut in result.cuts}
    assert cuts["w_q"].cut.startswith("axis 0 (out): rows") and cuts["w_q"].shard == (4, 12)
    assert cuts["w_o"].cut.startswith("axis 1 (in): columns") and cuts["w_o"].shard == (12, 4)
    assert "RowwiseParallel" in cuts["w_o"].api and "ColwiseParallel" in cuts["w_q"].api
    [reduce_step] = [step for step in result.steps if "all-reduce" in step.communication]
    assert reduce_step.step == "output projection"  # the one all-reduce, after W_o, before b_o
    assert result.identity_error < 1e-13  # partial outputs summed + b_o == the oracle


def test_replicated_kv_heads_are_named():
    result = explain_sharding(MHAConfig(d_model=16, n_heads=8, n_kv_heads=2), world=4)
    cuts = {cut.weight: cut for cut in result.cuts}
    assert "each kv head replicated on 2 ranks" in result.plan
    assert cuts["w_k"].rank_slice.startswith("rows (r//2)*2") and cuts["w_k"].shard == (2, 16)
    assert result.identity_error < 1e-13


def test_cli(capsys, tmp_path):
    assert main(["explain", "--sharding", "--heads", "4", "--world", "2", "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "| `w_o` | (12, 12) | axis 1 (in): columns, by head |" in out
    assert json.loads((tmp_path / "s.json").read_text())["world"] == 2
    assert main(["explain", "--sharding", "--heads", "3", "--world", "2"]) == 2
    assert "world=2 does not divide n_heads=3" in capsys.readouterr().err


def test_world_that_does_not_split_raises():
    with pytest.raises(ValueError, match="world=2 does not divide n_heads=3"):
        explain_sharding(world=2)
