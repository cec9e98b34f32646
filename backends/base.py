"""What every backend adapter is: the interface, and the shared `run` built on it.

Design rules (the checks and the benchmarks rely on each one):

1. An adapter converts canonical NumPy parameters and inputs into its own convention
   once, in `prepare`, outside any timed region. `Prepared.forward` is the timed region:
   it runs the forward pass on already-converted, device-resident data and nothing else.
2. Results come back as NumPy in the exchange layout, ``(batch, q_tokens, d_model)``.
3. Stage tensors come back twice: ``native_stages()`` as the adapter holds them (with
   the meaning of every axis, for the explainer) and ``stages()`` converted to the
   canonical layout of `core.stages` (for the divergence report). An adapter that
   cannot see inside a fused kernel exposes the stages it can (at least "output").
4. The framework is imported inside the adapter's methods, never at module import.
5. A configuration, dtype, device or strategy the adapter cannot run gives a reason
   string from `unsupported_reason`, never a crash half-way through a check.
6. A variant of `core.VARIANTS` runs only where the adapter declares it (``variants``, per
   strategy in ``strategy_variants``, for the backward pass in ``vjp_variants``, for decoding
   in ``decode_variants``): an
   adapter that does not say it implements a softcap is unsupported for a softcap case,
   with a reason, and never runs it without. `prepare` checks this even when a subclass's
   `unsupported_reason` forgets to ask the base class.
7. Causality is on positions (`core.inputs.causal_allowed`). An adapter whose causal mask is
   the top-left rule on indices (``is_causal=True``, tile skipping on indices) leaves
   ``causal_on_positions`` False (or names the strategies in ``causal_on_indices_strategies``)
   and is unsupported, with the reason, where the positions make the rule bottom-right.
8. Decoding (`run_decode`) goes through the adapter's own KV cache, in its own layout
   (``decode_caches``, ``decode_layouts``), keys cached after QK-norm and rotary and before
   the GQA repeat, a sliding window as a ring buffer (`core.decode`). An adapter without one
   is unsupported for decoding with ``decode_unsupported`` as the reason.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from mha_rosetta.core import (
    DTYPE_NAMES,
    MHAConfig,
    MHAGrads,
    MHAInputs,
    MHAParams,
    check_cotangent,
    check_dtype_name,
    prepare_inputs,
    validate_params,
)
from mha_rosetta.core.grad import output_shape
from mha_rosetta.core.inputs import causal_on_indices
from mha_rosetta.core.packing import RAGGED_OPTIONS, ragged_arguments
from mha_rosetta.core.reference import call_result

from ._chunking import CHUNKED, CHUNKED_STAGES_NOTE, check_chunk
from .decoding import DecodeMixin, DecodeStep
from .entries import registered_entry
from .prepared import (
    RELATIONS,
    Prepared,
    PreparedDecode,
    PreparedVJP,
    StageTensor,
    canonical_stage,
    grads_from_native,
    tensor_to_numpy,  # the adapters' name for the framework layer's conversion
)
from .vocabulary import (
    DEVICE_ALIASES,
    DEVICE_NAMES,
    DIRECT_RESHAPE,
    KNOWN_WRONG_STRATEGIES,
    PER_HEAD,
    SLICING,
    STANDARD,
    BackendNotInstalled,
    UnsupportedCase,
    check_device_name,
)

# What the adapters import from here; the result types live in `prepared`, the names and refusals in
# `vocabulary`, the decode half of the interface in `decoding`.
__all__ = [
    "DEVICE_ALIASES",
    "DEVICE_NAMES",
    "DIRECT_RESHAPE",
    "KNOWN_WRONG_STRATEGIES",
    "PER_HEAD",
    "RELATIONS",
    "SLICING",
    "STANDARD",
    "Backend",
    "BackendNotInstalled",
    "DecodeStep",
    "Prepared",
    "PreparedDecode",
    "PreparedVJP",
    "StageTensor",
    "UnsupportedCase",
    "canonical_stage",
    "check_device_name",
    "grads_from_native",
    "tensor_to_numpy",
]


class SameAs:
    """A class attribute that reads another one's value unless a subclass sets its own (``decode_variants``: ``variants``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return getattr(owner if obj is None else obj, self.name)


class Backend(DecodeMixin):
    """Base class of every adapter. Subclasses set the class attributes and `_prepare`."""

    name: str = ""
    convention: str = ""  # one line: what this adapter embodies
    # The measured causes of this backend's gap to its framework's best path (`backends.best`), by mode: "forward",
    # "forward+backward", "decode"; "forward:chunked" for one strategy's own; " on jax" after the mode where one class
    # serves several array libraries (einops), " at B=4" where a cause holds at that batch only. Only what a
    # measurement, the code or the compiled program showed, with its condition (size, library version) in the text:
    # the bench tables name it under "x its best" (`benchmarks.best_gap.gap_lines`), "cause not measured yet" without.
    gap_causes: ClassVar[dict[str, str]] = {}
    # Set from the backend's registry entry (backends/registry.py), the one place that
    # says what a backend needs and whether it is ours or a third-party oracle; a plugin
    # class registered by path (or not at all) sets them here, as class attributes.
    requires: tuple[str, ...] = ()  # importable modules this backend needs
    kind: str = "implementation"  # or "oracle" (a third-party implementation)
    strategies: tuple[str, ...] = (STANDARD,)
    dtypes: tuple[str, ...] = DTYPE_NAMES
    # Where a third-party oracle's convention differs from the spec (mask polarity, what a
    # row with nothing to attend to returns, layout defaults), one short sentence each.
    # The check names these instead of hiding them. If the adapter maps an answer back to
    # the spec's, it counts the rows in ``Prepared.info["empty_rows_mapped"]``.
    known_differences: tuple[str, ...] = ()
    # The variants of core.VARIANTS this adapter implements (rule 6), for every strategy unless
    # strategy_variants names the strategy (a library's idiom: an exported graph that carries none);
    # vjp_variants (None: the same) for its backward pass. Ours derive it from core's registry and their library's ops
    # object (`frameworks.ops.RegistryVariants`); a third-party oracle lists the package's own variants
    # its library's idiom has (`core.variants.BUILTIN_VARIANTS` less what it lacks).
    variants: frozenset[str] = frozenset()
    strategy_variants: ClassVar[dict[str, frozenset[str]]] = {}
    vjp_variants: frozenset[str] | None = None
    # Rule 7: True where every strategy but chunked builds its causal mask from the positions.
    causal_on_positions: bool = False
    causal_on_indices_strategies: tuple[str, ...] = ()  # strategies whose causal rule is still on the indices
    # Rule 8: the cache kinds run_decode offers (the first is the default; a window makes each a
    # ring buffer), the strategies and variants its decode path implements, each kind's layout in
    # words for the explainer, and, without any, why (e.g. "the library's API has no KV cache").
    decode_caches: tuple[str, ...] = ()
    decode_strategies: tuple[str, ...] = (STANDARD,)
    decode_variants: frozenset[str] = SameAs("variants")  # type: ignore[assignment]  # a decode path has what its forward has
    decode_layouts: ClassVar[dict[str, str]] = {}
    decode_unsupported: str = ""
    # True where the runs execute in processes of the backend's own (the sharded backends' ranks and
    # mesh worker): the check's pool then keeps it in one worker, since a second worker joining it would
    # start a second group of processes, importing and compiling again, on the same cores.
    own_processes: bool = False

    def __init__(self, name: str | None = None) -> None:
        # The registry passes the name it holds the backend under, so one class can
        # serve several entries (einops on NumPy, torch and JAX arrays).
        if name is not None:
            self.name = name
        # Kind and requires come from this class's registry entry (the one place that says
        # them), so an instance built directly knows them too; unregistered: class attributes.
        entry = registered_entry(type(self), name)
        if entry is not None and entry.kind is not None:
            self.kind, self.requires = entry.kind, tuple(entry.requires)

    # -- what a subclass provides ---------------------------------------------------------
    def devices(self) -> tuple[str, ...]:
        """Devices present for this backend on this machine (always includes "cpu")."""
        return ("cpu",)

    def has_device(self, device: str) -> bool:
        """Whether ``device`` is present: the CPU always is (`devices` includes it), so asking about it imports
        no framework; that keeps a check's parent process, which plans every run, free of torch and JAX."""
        return device == "cpu" or device in self.devices()

    def variant_reason(self, cfg: MHAConfig, strategy: str, backward: bool = False) -> str | None:
        """The variants of ``cfg`` this backend does not implement for ``strategy`` (rule 6), as a reason, or None."""
        if not cfg.variants:
            return None
        declared = self.strategy_variants.get(strategy, self.variants)
        if backward and self.vjp_variants is not None:
            declared = declared & self.vjp_variants
        missing = [name for name in cfg.variants if name not in declared]
        if not missing:
            return None
        where = f" in its {strategy!r} strategy" if strategy != STANDARD else ""
        where += " backward" if backward else ""
        has = ", ".join(sorted(declared)) or "none"
        return f"{self.name} does not implement {', '.join(missing)}{where} (it implements: {has})"

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        """Why this backend cannot run the case, or None. Subclasses extend this."""
        if strategy in self.strategies and (reason := self.variant_reason(cfg, strategy)):
            return reason
        if strategy not in self.strategies:
            return f"{self.name} has no strategy {strategy!r} (it has {', '.join(self.strategies)})"
        return self._dtype_device_reason(dtype, device)

    def _dtype_device_reason(self, dtype: str, device: str) -> str | None:
        """Why this backend cannot run ``dtype`` on ``device`` (the last refusals of a forward and of a decode), or
        None."""
        if dtype not in self.dtypes:
            return f"{self.name} does not support {dtype}"
        if not self.has_device(device):
            return f"{self.name}: no {device} device present on this machine"
        return None

    def positions_reason(self, cfg: MHAConfig, inputs: MHAInputs, strategy: str) -> str | None:
        """Rule 7: why these inputs' positions are beyond this backend's causal mask, or None."""
        index_rule = strategy in self.causal_on_indices_strategies
        if not cfg.causal or causal_on_indices(inputs) or (self.causal_on_positions and not index_rule):
            return None
        how = f"{self.name}'s {strategy} strategy skips tiles" if index_rule else f"{self.name} masks"
        if (np.diff(inputs.positions, axis=-1) < 0).any():  # issue 47: a packed call, not a decode step
            return (
                f"{how} on the top-left causal rule on indices (j <= i), and these positions restart per document "
                "(a packed call: the documents one after another, each from position 0): its mask reads indices, not them"
            )
        return (
            f"{how} on the top-left causal rule on indices (j <= i), and these positions make causality "
            "bottom-right (a decode step: queries after cached keys)"
        )

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        """Convert once and return the `Prepared` pass. A backend with the "chunked" strategy also
        takes ``chunk=(q_block, k_block)``: `prepare` passes it (validated; None means the
        defaults) for that strategy only."""
        raise NotImplementedError

    # -- shared by every backend ------------------------------------------------------
    def _validate(self, cfg, params, args, dtype, device, strategy, *, chunk=None, cotangent=None, backward=False):
        """`prepare`'s and `prepare_vjp`'s checks in the order their errors are reported: names, params, ``chunk``
        (a bad option before bad data), ``args`` (query, key, value, mask, positions, kv_positions), the cotangent
        (backward only; its shape comes from the query), support. Returns (dtype, device, chunk, inputs, cotangent)."""
        dtype = check_dtype_name(dtype)
        device = check_device_name(device)
        validate_params(cfg, params)
        chunk = check_chunk(chunk)
        if chunk is not None and strategy != CHUNKED:
            raise ValueError(f"chunk={chunk} applies only to strategy={CHUNKED!r}, got strategy={strategy!r}")
        inputs = prepare_inputs(cfg, *args)
        if backward:
            cotangent = check_cotangent(cotangent, output_shape(cfg, args[0]))
        reason = self.variant_reason(cfg, strategy, backward) or self.unsupported_reason(cfg, dtype, device, strategy)
        reason = reason or self.positions_reason(cfg, inputs, strategy)
        if backward and strategy == CHUNKED and not reason:
            reason = f"{self.name}: the chunked strategy is forward only (no backward pass)"
        if reason:
            raise UnsupportedCase(reason)
        return dtype, device, chunk, inputs, cotangent

    def prepare(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        query,
        key=None,
        value=None,
        mask=None,
        *,
        dtype: str = "float64",
        device: str = "cpu",
        strategy: str = STANDARD,
        positions=None,
        kv_positions=None,
        chunk=None,
    ) -> tuple[Prepared, MHAInputs]:
        """Validate everything, then convert once into this backend's convention.

        ``positions``/``kv_positions``: the rotary positions (`core.inputs.prepare_inputs`).
        ``chunk`` (the chunked strategy only): ``(q_block, k_block)``, or one int for both.
        """
        dtype, device, chunk, inputs, _ = self._validate(
            cfg, params, (query, key, value, mask, positions, kv_positions), dtype, device, strategy, chunk=chunk
        )
        options = {"chunk": chunk} if strategy == CHUNKED else {}
        return self._prepare(cfg, params, inputs, dtype, device, strategy, **options), inputs

    def run(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        query,
        key=None,
        value=None,
        mask=None,
        return_weights: bool = False,
        return_stages: bool = False,
        **options,
    ):
        """Same arguments and results as `core.reference_mha`; ``options`` are `prepare`'s keywords
        (dtype, device, strategy, positions, kv_positions, chunk), passed on as they are, and the
        packing (``cu_seqlens`` or ``position_ids``, `core.packing`): one row of T tokens with the
        document mask ANDed into the mask and positions restarting per document; or ``seq_lens``
        (``kv_seq_lens``) on a right-padded batch, its lengths ANDed into the mask."""
        ragged = {name: options.pop(name) for name in RAGGED_OPTIONS if name in options}
        positions, kv_positions = options.get("positions"), options.get("kv_positions")
        query, mask, options["positions"] = ragged_arguments(
            cfg, query, key, value, mask, positions, kv_positions, **ragged
        )
        prepared, inputs = self.prepare(cfg, params, query, key, value, mask, **options)
        output = inputs.unbatch(prepared.output())
        if not (return_weights or return_stages):
            return output
        stages = self.canonical_stages(prepared)
        if return_weights and "weights" not in stages:
            why = f" ({CHUNKED_STAGES_NOTE})" if options.get("strategy") == CHUNKED else ""
            raise UnsupportedCase(f"{self.name} does not expose attention weights{why}")
        return call_result(output, stages, return_weights, return_stages, inputs.unbatch)

    # -- the backward pass (vector-Jacobian product) -----------------------------------------
    def _prepare_vjp(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, cotangent, dtype: str, device: str, strategy: str
    ) -> PreparedVJP:
        """Subclasses with a backward pass override this; ``cotangent`` is float64 (B, Nq, D)."""
        raise UnsupportedCase(f"{self.name} has no backward pass (run_vjp)")

    def prepare_vjp(
        self,
        cfg: MHAConfig,
        params: MHAParams,
        query,
        key=None,
        value=None,
        mask=None,
        cotangent=None,
        *,
        dtype: str = "float64",
        device: str = "cpu",
        strategy: str = STANDARD,
        positions=None,
        kv_positions=None,
    ) -> tuple[PreparedVJP, MHAInputs]:
        """Validate everything (the cotangent too), then convert once for forward+backward."""
        args = (query, key, value, mask, positions, kv_positions)
        dtype, device, _, inputs, cotangent = self._validate(
            cfg, params, args, dtype, device, strategy, cotangent=cotangent, backward=True
        )
        batched = cotangent if inputs.batched else cotangent[None]  # (B, Nq, D)
        return self._prepare_vjp(cfg, params, inputs, batched, dtype, device, strategy), inputs

    def run_vjp(
        self, cfg: MHAConfig, params: MHAParams, query, key=None, value=None, mask=None, cotangent=None, **options
    ) -> MHAGrads:
        """Same arguments and result as `core.reference_mha_vjp`; ``options`` are `prepare_vjp`'s keywords
        (dtype, device, strategy, positions, kv_positions), passed on as they are."""
        prepared, inputs = self.prepare_vjp(cfg, params, query, key, value, mask, cotangent, **options)
        native = prepared.run()
        prepared.synchronize(native)
        return grads_from_native(prepared.to_grads(native), inputs, key is not None, value is not None)

    # -- decoding through a KV cache (rule 8) ------------------------------------------------
    def decode_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str, cache: str | None) -> str | None:
        """Why this backend cannot decode the case (rule 8), or None."""
        if not self.decode_caches:
            return f"{self.name} has no KV-cache decoding" + (
                f": {self.decode_unsupported}" if self.decode_unsupported else ""
            )
        if cache is not None and cache not in self.decode_caches:
            return f"{self.name} has no {cache!r} cache (it has {', '.join(self.decode_caches)})"
        if strategy not in self.decode_strategies:
            noun = "strategy" if len(self.decode_strategies) == 1 else "strategies"
            return f"{self.name} decodes with the {', '.join(self.decode_strategies)} {noun} only, not {strategy!r}"
        missing = [name for name in cfg.variants if name not in self.decode_variants]
        if missing:
            has = ", ".join(sorted(self.decode_variants)) or "none"
            return f"{self.name}'s decode path does not implement {', '.join(missing)} (it implements: {has})"
        return self._dtype_device_reason(dtype, device)

    @staticmethod
    def canonical_stages(prepared: Prepared) -> dict[str, np.ndarray]:
        """The prepared pass's stage tensors in the canonical layout (batched)."""
        return {name: canonical_stage(name, stage) for name, stage in prepared.native_stages().items()}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}: {self.convention}>"
