"""The torch diagnose candidate spells the forms of 2025-26 (issue 45): Llama 4's two layers and DeepSeek's MLA.

`backends.injected_torch_forms` writes the temperature, the weightless QK-norm after rotary and MLA's heads as
``transformers`` writes them, apart from the simulator and from the NumPy candidate's entry steps. Here: the torch
candidate refuses none of the forms' settings, computes the spec without a bug, plants each bug exactly as the
NumPy candidate does (the same numbers on every probe), and every bug it plants is named first by its own code.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import requires
from mha_rosetta.diagnose import diagnose
from mha_rosetta.diagnose.confusion import SETTINGS, confusion
from mha_rosetta.diagnose.injected import BUGS, VARIANT_BUGS, bugs_for, numpy_candidate, torch_candidate
from mha_rosetta.diagnose.probes import make_probes

# The settings whose variants only the NumPy candidate planted until the torch spellings of issue 45.
FORMS = ("llama4-rope", "llama4-nope", "deepseek-v3", "deepseek-absorbed")
FORM_BUGS = {
    "llama4-rope": {"qk-norm after rope across heads", "qk-norm after rope forgotten", "chunk boundary off by one",
                    "chunk forgotten"},
    "llama4-nope": {"temperature forgotten", "temperature floor off by one"},
    "deepseek-v3": {"mla mscale missing", "mla mscale for mscale_all_dim", "mla keys de-interleaved",
                    "rope scaling linear", "rope scaling ignored"},  # its YaRN
    "deepseek-absorbed": {"mla value head from the key", "mla W_UK transposed"},
}  # fmt: skip


@requires("torch")
@pytest.mark.parametrize("setting", FORMS)
def test_the_torch_candidate_spells_each_form_and_agrees_without_a_bug(setting):
    from mha_rosetta.backends.injected_torch import unspelled

    cfg = SETTINGS[setting]
    assert unspelled(cfg) == []
    result = diagnose(torch_candidate(cfg), cfg)
    assert result.agrees and result.max_error < 1e-12, result.summary()


@requires("torch")
@pytest.mark.parametrize("setting", FORMS)
def test_the_torch_candidate_plants_each_bug_as_the_numpy_candidate_does(setting):
    """Two spellings, one mistake: on every probe the torch candidate's output is the NumPy candidate's (float64)."""
    cfg = SETTINGS[setting]
    bugs = bugs_for(cfg)
    assert {bug for bug in bugs if bug in VARIANT_BUGS} == FORM_BUGS[setting]
    probes = make_probes(cfg)
    for bug in (None, *bugs):
        ours, theirs = torch_candidate(cfg, bug), numpy_candidate(cfg, bug)
        for p in probes:
            want = theirs(p.params, p.query, p.key, p.value, p.mask)
            got = ours(p.params, p.query, p.key, p.value, p.mask).numpy()
            finite = np.isfinite(want)
            assert np.array_equal(finite, np.isfinite(got)), (bug, p.name)
            assert np.abs(got - want)[finite].max(initial=0.0) < 1e-12, (bug, p.name)  # the empty rows: NaN in both


@requires("torch")
def test_every_bug_the_torch_candidate_plants_in_the_forms_is_named_first_by_its_own_code():
    outcomes = confusion(FORMS, ["torch"])
    assert [(o.setting, o.bug) for o in outcomes] == [(s, bug) for s in FORMS for bug in bugs_for(SETTINGS[s])]
    assert {o.bug for o in outcomes} >= set().union(*FORM_BUGS.values())
    wrong = [(o.setting, o.bug, o.named) for o in outcomes if o.named != BUGS[o.bug][0]]
    assert wrong == [] and all(o.correct for o in outcomes)
    assert len(outcomes) == sum(len(bugs_for(SETTINGS[s])) for s in FORMS)  # every cell on the diagonal
