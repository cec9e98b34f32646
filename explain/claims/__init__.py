"""The column/row-sample article's twelve claims, each an executable check.

The column/row-sample article is the (Chinese) text this project grew from. It explains
multi-head attention through two ways of holding data: column samples (a token per
column, ``Y = W @ X``, rows of W are the scorers) and row samples (a token per row,
``Y = X @ W.T``, PyTorch's ``nn.Linear``). It claims that the two give the same numbers,
that heads are split by a reshape plus a transpose while a direct reshape is wrong,
that per-head matrices side by side are the merged one, that slicing heads one at a
time is slower, that ``view`` after a transpose needs ``.contiguous()``, and that einsum
keeps ``(N, h, d_k)`` without a transpose; `CLAIMS` lists all twelve.

Every check returns a `ClaimResult`: the claim's number and title, a verdict, and the
evidence, which is what was measured or the error that was actually raised. Nothing
is asserted from memory: the 2.5 score is computed, the torch ``view`` error is
caught from torch, the sequence-first default is read off a real module.

Verdicts: ``confirmed``; ``refuted``; ``confirmed with caveat`` (the claim holds, but
a part of it, usually the speed part, does not); ``partly confirmed`` (speed results
that disagree across sizes or devices); ``skipped: <reason>`` (a library or the
benchmark is missing). The claims about speed (3, 7 and the speed halves of 9 and 11)
take their numbers from the benchmark questions, `benchmarks.questions`, which run
only when asked (``speed=True``); the rest run in the test suite.

The package: `registry` (the `claim` decorator, `CLAIMS`, `ClaimResult`, the shared helpers), the checks
by group (`layouts`: 1-4, `heads`: 5-8, `modules`: 9-12), and `run` (`run_claims`, the speed folding).
Importing the package imports every group, so `CLAIMS` is complete.
"""

from __future__ import annotations

from .heads import claim_5, claim_6, claim_7, claim_8
from .layouts import claim_1, claim_2, claim_3, claim_4
from .modules import claim_9, claim_10, claim_11, claim_12
from .registry import (
    CAVEAT,
    CLAIMS,
    CONFIRMED,
    PARTLY,
    REFUTED,
    SPEED_NOT_RUN,
    Claim,
    ClaimResult,
    claim,
    speed_claims,
    speed_only_claims,
)
from .run import add_speed, merge_verdicts, run_claims, speed_answers

__all__ = [
    "CAVEAT",
    "CLAIMS",
    "CONFIRMED",
    "PARTLY",
    "REFUTED",
    "SPEED_NOT_RUN",
    "Claim",
    "ClaimResult",
    "add_speed",
    "claim",
    "claim_1",
    "claim_2",
    "claim_3",
    "claim_4",
    "claim_5",
    "claim_6",
    "claim_7",
    "claim_8",
    "claim_9",
    "claim_10",
    "claim_11",
    "claim_12",
    "merge_verdicts",
    "run_claims",
    "speed_answers",
    "speed_claims",
    "speed_only_claims",
]
