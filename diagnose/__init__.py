"""mha_rosetta.diagnose: name the convention error in an attention implementation.

`diagnose(candidate, cfg)` runs ``candidate(params, query, key, value, mask) -> output``
on designed probes (`probes`), compares it with the float64 oracle and with simulations
of every known convention error (`simulate`, `causes`), and returns a `Diagnosis`:
``agrees`` with the error against the oracle, or the ranked `Cause` list, each with its
evidence and its fix (in words, and as the converter in `repairs` to call).

Packed q/k/v weights. The candidate always receives canonical `MHAParams`; a candidate
whose module holds one packed ``(3E, E)`` matrix packs them with its own converter. The
``qkv_packing`` cause is a candidate that packs in one layout (blocks [q; k; v], or per
head [q_0; k_0; v_0; q_1; ...]) and unpacks in the other; its repair,
`repairs.repack_qkv`, feeds it parameters whose rows are pre-permuted so that its wrong
unpacking reads the right rows.

`diagnose_decode(candidate, cfg)` (`diagnose.decode`) does the same for a KV-cache decode loop,
``candidate(params, x, prefill, step, mask, positions) -> output``, against the full causal
forward, naming the decode mistakes (`DECODE_CAUSE_CODES`: positions not offset, top-left
causality on a step, a static cache's empty slots attended, the ring off by one, keys rotated
twice).

`diagnose_packed`, `diagnose_padded` and `diagnose_paged` (`diagnose.ragged`, issue 47) name the mistakes of
packed documents (leaking, positions not restarting), padded rows (padding keys attended) and paged reads (the
physical page index used as the logical one, the last page's length off by one).

``diagnose(candidate, like=module)`` takes the reference configuration from a real attention
module (`mha_rosetta.models.from_module`) instead of an ``MHAConfig``.

Imports NumPy, `core`, `backends` and (for ``like``) `models` only (no framework).
"""

from .causes import CAUSE_CODES, DECODE_CAUSE_CODES, Hypothesis, hypotheses
from .decode import DecodeBug, diagnose_decode, simulate_decode
from .diagnosis import DEFAULT_TIMEOUT_S, Cause, DiagnoseError, Diagnosis, diagnose, reference_config
from .ragged import RAGGED_CAUSE_CODES, diagnose_packed, diagnose_padded, diagnose_paged
from .simulate import Bug, simulate

__all__ = [
    "CAUSE_CODES",
    "DECODE_CAUSE_CODES",
    "DEFAULT_TIMEOUT_S",
    "RAGGED_CAUSE_CODES",
    "Bug",
    "Cause",
    "DecodeBug",
    "DiagnoseError",
    "Diagnosis",
    "Hypothesis",
    "diagnose",
    "diagnose_decode",
    "diagnose_packed",
    "diagnose_padded",
    "diagnose_paged",
    "hypotheses",
    "reference_config",
    "simulate",
    "simulate_decode",
]
