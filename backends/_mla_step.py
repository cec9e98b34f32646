"""The timed decode step of MLA's forms (issue 45, `bench --mode decode`): `MLATimedStep`.

`_mla.MLAStrategies` refuses ``prepare_decode`` for MLA's forms (a form with no timed step). An adapter whose
``_prepare_decode_step`` times MLA's forms on its latent cache names `MLATimedStep` before `MLAStrategies`, and
its MLA forms' step is validated as any other (`decoding.DecodeMixin.prepare_decode`, `MLAStrategies.decode_reason`'s
refusals included) and handed to its ``_prepare_decode_step``.
"""

from __future__ import annotations

from ._mla import MLA_STRATEGIES
from .decoding import DecodeMixin


class MLATimedStep:
    """A mixin before `MLAStrategies` (``class NumpyBackend(MLATimedStep, MLAStrategies, Backend)``): the adapter's
    ``_prepare_decode_step`` takes MLA's forms (``job.strategy`` naive or absorbed)."""

    def prepare_decode(self, cfg, params, **options):
        if options.get("strategy") in MLA_STRATEGIES:
            return DecodeMixin.prepare_decode(self, cfg, params, **options)  # type: ignore[arg-type]
        return super().prepare_decode(cfg, params, **options)  # type: ignore[misc]
