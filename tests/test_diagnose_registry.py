"""`diagnose` reads its variants from the registry: a new entry appears in ``diagnose --confusion`` with no edit there.

The throwaway variant below is a per-head logit temperature (head h's scores times 1 + (h + 1) / H),
with two causes, the two bugs its candidates plant and a setting, registered in a fresh interpreter
before `mha_rosetta.diagnose` is imported: its cause code and bugs join the vocabulary, its setting the
confusion table, and the NumPy candidate and the simulator run it from its entry's steps. The torch
candidate has no spelling of it, so it refuses the setting with the reason and the table runs it in
NumPy only. MHAConfig has no field for it: it is switched on by ``rope_base`` without rotary, a value
nothing else reads.
"""

from __future__ import annotations

import json

from conftest import python_stdout
from mha_rosetta.core.variants import VARIANT_REGISTRY
from mha_rosetta.diagnose import CAUSE_CODES, DECODE_CAUSE_CODES
from mha_rosetta.diagnose.confusion import SETTINGS, VARIANT_SETTINGS
from mha_rosetta.diagnose.injected import VARIANT_BUGS

THROWAWAY = """
import json
import numpy as np
from mha_rosetta.core.variants import VARIANT_REGISTRY, Variant
from mha_rosetta.core.variants import (
    DiagnoseCause, DiagnoseSpec, PlantedMistake, PlantedSteps, SimulatedSteps,
)

def temperatures(cfg, mistake):
    t = 1.0 + np.arange(1, cfg.n_heads + 1) / cfg.n_heads  # (H,)
    return np.full_like(t, t[0]) if mistake == "first_head" else t

def simulated(cfg, scores, mistake):
    return scores if mistake == "dropped" else scores * temperatures(cfg, mistake)[None, :, None, None]

def planted(cfg, scores, mistake):  # written apart: one head at a time
    if mistake == "dropped":
        return scores
    H = cfg.n_heads
    t = [1.0 + (1 if mistake == "first_head" else h + 1) / H for h in range(H)]
    return np.stack([scores[:, h] * t[h] for h in range(H)], axis=1)

VARIANT_REGISTRY["head_temperature"] = Variant(
    name="head_temperature",
    summary="head h's scores times 1 + (h + 1) / H",
    fields=("rope_base",),
    is_on=lambda cfg: cfg.rope is None and cfg.rope_base == 1234.0,
    diagnose=DiagnoseSpec(
        rank=80,
        causes=(
            DiagnoseCause("head_temperature", "dropped", "not applied", "multiply head h's scores by 1 + (h + 1) / H"),
            DiagnoseCause("head_temperature", "first_head", "head 0's for every head", "one temperature per head"),
        ),
        mistakes=(
            PlantedMistake("head temperature dropped", "head_temperature", "scores never multiplied", "dropped"),
            PlantedMistake("head temperature of head 0", "head_temperature", "t[0] for every head", "first_head"),
        ),
        settings=(("head-temperature", dict(d_model=12, n_heads=3, rope_base=1234.0)),),
        simulated=SimulatedSteps(transform=simulated),
        planted=PlantedSteps(transform=planted),
    ),
)

from mha_rosetta.diagnose import CAUSE_CODES
from mha_rosetta.diagnose.confusion import SETTINGS, VARIANT_SETTINGS, confusion, frameworks_present, render_tables
from mha_rosetta.diagnose.injected import VARIANT_BUGS, torch_candidate

try:
    torch_candidate(SETTINGS["head-temperature"])
    refused = None
except NotImplementedError as error:
    refused = str(error)
except ImportError:
    refused = "torch is not installed"
outcomes = confusion(["head-temperature"])
print(json.dumps({
    "codes": CAUSE_CODES[-2:],
    "bugs": list(VARIANT_BUGS)[-2:],
    "variant_setting": "head-temperature" in VARIANT_SETTINGS,
    "outcomes": [[o.framework, o.bug, o.expected, o.named] for o in outcomes],
    "table": render_tables(outcomes),
    "refused": refused,
}))
"""


def test_a_new_entry_appears_in_the_confusion_table_with_no_edit_in_diagnose():
    result = json.loads(python_stdout(THROWAWAY))
    # the vocabulary's last code: rank 80 (the forms of 2025-26 at 75, in registry order: value_norm last)
    assert result["codes"] == ["value_norm", "head_temperature"]
    assert result["bugs"] == ["head temperature dropped", "head temperature of head 0"]
    assert result["variant_setting"]
    outcomes = result["outcomes"]
    planted = {bug: (expected, named) for framework, bug, expected, named in outcomes if bug.startswith("head temp")}
    assert planted == {
        "head temperature dropped": ("head_temperature", "head_temperature"),
        "head temperature of head 0": ("head_temperature",) * 2,
    }
    assert all(expected == named for _, _, expected, named in outcomes), outcomes  # the generic bugs still named
    assert {framework for framework, *_ in outcomes} == {"numpy"}  # the torch candidate spells no head_temperature
    if result["refused"] != "torch is not installed":
        assert "the torch candidate spells no head_temperature" in result["refused"]
        # Both places a torch spelling can come from: the entry's steps written once, or the torch module's own.
        assert "DiagnoseSpec.planted_in nor backends.injected_torch.TORCH_STEPS" in result["refused"]
    table = result["table"]
    assert "| head temperature dropped | head temperature of head 0 |" in table
    assert "| `head_temperature` |" in table and f"{len(outcomes)} of {len(outcomes)} diagnoses" in table


def test_the_vocabulary_the_settings_and_the_bugs_are_the_registrys():
    """Each variant's cause codes, planted bugs and settings are its entry's, in diagnose's order (`rank`)."""
    entries = sorted((e for e in VARIANT_REGISTRY.values() if e.diagnose), key=lambda e: e.diagnose.rank)
    codes = list(dict.fromkeys(c.code for e in entries for c in e.diagnose_causes if not c.decode))
    assert list(CAUSE_CODES[-len(codes) :]) == codes
    assert codes == [
        "softcap",
        "window",
        "alibi",
        "qk_norm",
        "sinks",
        "rope_scaling",
        "rel_bias",
        "chunked",
        "gate",
        "qk_norm_after_rope",
        "temperature",
        "mla",
        "k_eq_v",
        "value_norm",
    ]
    decode_codes = [c.code for e in entries for c in e.diagnose_causes if c.decode]
    # Llama 4's temperature positions, then MLA's latent cache (the latent un-normalised, k_rope unrotated)
    assert decode_codes == ["decode_temperature_not_offset", "decode_latent_not_normed", "decode_k_rope_not_rotated"]
    assert DECODE_CAUSE_CODES[-3:] == tuple(decode_codes)
    assert list(VARIANT_BUGS) == list(dict.fromkeys(m.name for e in entries for m in e.planted_mistakes))
    assert VARIANT_BUGS["window W+1"] == ("window", "FlashAttention's window_size=(W, 0) for a window of W keys")
    settings = [name for e in entries for name, _ in e.diagnose.settings]
    assert list(VARIANT_SETTINGS) == settings == [
        "softcap-window", "alibi", "qk-norm-head", "qk-norm-projection", "sinks-yarn", "t5-encoder", "t5-decoder",
        "llama4-chunked",
        "qwen3-next-gate",
        "llama4-rope",
        "llama4-nope",
        "deepseek-v3",
        "deepseek-absorbed",
        "gemma4-global",
        "gemma4-sliding",
    ]  # fmt: skip
    # every planted bug's code is a cause of its own entry, and every cause code is planted somewhere
    for entry in entries:
        assert {m.code for m in entry.planted_mistakes} <= {c.code for c in entry.diagnose_causes if not c.decode}
    assert {code for code, _ in VARIANT_BUGS.values()} == set(codes)
    assert SETTINGS["t5-decoder"].d_k == 4 and SETTINGS["softcap-window"].d_k == 6  # square q: transposed w_q runs


def test_steps_written_once_without_the_numpy_candidates_are_refused_by_name():
    """An entry whose ``planted_in`` is set and whose ``planted`` is left empty would have the NumPy candidate skip its
    steps silently: `DiagnoseSpec` refuses it and names the rule; `_shared.written_once` gives both."""
    import pytest

    from mha_rosetta.core.variants import DiagnoseSpec, PlantedSteps
    from mha_rosetta.core.variants._shared import written_once

    def planted_in(idioms):
        return PlantedSteps(transform=lambda cfg, scores, mistake: idioms.tanh(scores))

    with pytest.raises(ValueError, match=r"planted_in is set but planted is empty.*written_once\(planted_in\)"):
        DiagnoseSpec(rank=1, planted_in=planted_in)
    spec = DiagnoseSpec(rank=1, **written_once(planted_in))
    assert spec.planted.transform is not None and spec.planted_in is planted_in
    assert DiagnoseSpec(rank=1).planted == PlantedSteps()  # no candidate steps at all stays allowed
