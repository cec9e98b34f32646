"""What the JAX oracles share (`jax_dpa`, `flax`, `equinox`): the base class and the empty-row mapping.

Third-party JAX attention fed the canonical parameters: jax.nn.dot_product_attention, Flax, Equinox.

Each oracle runs the library's own attention with the same parameters (through the
converters of `core.layouts`) and the same inputs as every implementation. Where the
library's convention differs from the spec, the oracle maps it and says so in
``known_differences``; nothing is mapped silently:

* Rows with no allowed key. All three libraries fill blocked logits with a large
  finite negative number instead of -inf, so such a row gets uniform weights and the
  mean of V over *all* keys. The spec wants zero weights (context 0, output b_o). The
  rows are known from the mask before the timed region, so the oracle replaces them
  (the dot-product oracle in the context, Flax and Equinox in the output, where a row
  must then be empty in every head). ``spec_empty_rows=False`` shows the raw answer.
* Matmul precision on a GPU: "highest" for float32 comparisons, the same as the
  implementations; ``matmul_precision="default"`` shows what TF32 does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import numpy as np

from mha_rosetta.core import MHAConfig, MHAInputs, MHAParams
from mha_rosetta.core.variants import relative_distances, t5_buckets

from ..base import Backend, Prepared, UnsupportedCase
from ..frameworks.score_parts import distance_slopes
from ..jax.common import (
    CompiledForward,
    check_matmul_precision,
    compiled_prepared,
    empty_query_rows,
    jax_devices,
    jax_inputs,
    jax_target,
    precision_info,
    to_jax,
)
from ..jax.vjp import canonical_param_grads, jax_vjp_prepared  # jax.vjp through the library's own attention


def scale_is_default(cfg: MHAConfig) -> bool:
    return math.isclose(cfg.scale, 1.0 / math.sqrt(cfg.d_k), rel_tol=1e-12)


class JaxOracle(Backend):
    """What the three oracles share: devices, float64, precision, the empty-row switch."""

    def __init__(
        self, name: str | None = None, matmul_precision: str = "highest", spec_empty_rows: bool = True
    ) -> None:
        super().__init__(name)
        self.matmul_precision = check_matmul_precision(matmul_precision)
        # True: rows with no allowed key follow the spec (zeros); False: the library's own answer.
        self.spec_empty_rows = bool(spec_empty_rows)

    def devices(self) -> tuple[str, ...]:
        return jax_devices()

    def _info(self, dtype: str, device: str, **extra) -> dict:
        info = precision_info(device=device, dtype=dtype, matmul_precision=self.matmul_precision)
        info["known_differences"] = list(self.known_differences)
        info.update(extra)
        return info

    def _rows_empty_in_every_head(self, cfg: MHAConfig, inputs: MHAInputs) -> np.ndarray | None:
        """(B|1, Nq, 1) rows whose output the oracle replaces by b_o, or None.

        Flax and Equinox hide the per-head context, so only a row that is empty in every
        head can be mapped (its spec output is exactly b_o). A row empty in some heads
        only cannot, and is reported as unsupported instead of being compared wrongly.
        """
        empty = empty_query_rows(cfg, inputs)  # (B|1, H|1, Nq) or None
        if empty is None or not self.spec_empty_rows:
            return None
        in_every_head = empty.all(axis=1)  # (B|1, Nq)
        if (empty.any(axis=1) & ~in_every_head).any():
            raise UnsupportedCase(
                f"{self.name}: some query rows may attend to no key in some heads but not all; the library gives them "
                "the mean of V and hides the per-head context, so the spec's zero context cannot be mapped "
                "(construct with spec_empty_rows=False to see the raw answer)"
            )
        return in_every_head[..., None]  # (B|1, Nq, 1)

    # Flax and Equinox replace a row with no allowed key by b_o after the module: b_o's gradient
    # from such rows would be the adapter's, not the library's, so their backward refuses them.
    maps_output_rows = False

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy):
        prepared = self._prepare(cfg, params, inputs, dtype, device, strategy)
        if self.maps_output_rows and prepared.info.get("empty_rows_mapped"):
            raise UnsupportedCase(
                f"{self.name}: query rows with no allowed key are mapped to the spec's output b_o after the library "
                "runs; the gradient of that mapping would be the adapter's, not the library's"
            )
        compiled = prepared.forward  # a CompiledForward: its function and its converted arguments
        target = jax_target(dtype, device)
        x_q, x_k, x_v = (to_jax(x, dtype, target) for x in (inputs.query, inputs.key, inputs.value))  # 3 slots
        primals, extras = (compiled.args[0], x_q, x_k, x_v), compiled.args[4:]
        to_canonical, info = partial(self._canonical_grads, cfg), self._info(dtype, device)
        return jax_vjp_prepared(
            compiled.fn,
            primals,
            extras,
            cotangent,
            dtype,
            target,
            self.matmul_precision,
            to_canonical,
            info,
            compiled.key,
        )

    def _canonical_grads(self, cfg: MHAConfig, grads) -> dict:
        """The gradient of the library's parameter tree, by canonical name (subclasses with other trees override)."""
        return canonical_param_grads(grads)

    def _prepare(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, device: str, strategy: str
    ) -> Prepared:
        """A module oracle's prepare (Flax, Equinox; `jax_dpa` has its own): the device, the rows the spec maps
        to b_o and the inputs on it, then the library's module (`_module_program`), then the info."""
        target = jax_target(dtype, device)
        spec = self._output_rows(cfg, params, inputs, dtype, target)
        x = jax_inputs(inputs, dtype, target)  # (x_q, x_k, x_v): (B, Nq, D), (B, Nk, kdim), (B, Nk, vdim)
        compiled, native_stages = self._module_program(cfg, params, inputs, dtype, target, spec, x)
        return compiled_prepared(compiled, native_stages, self._info(dtype, device, empty_rows_mapped=spec.count))

    def _module_program(
        self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, target, spec: OutputRows, x: tuple
    ) -> tuple[CompiledForward, Callable[[], dict]]:
        """The library's module run on ``x``: its jitted forward and its native stages (a module oracle's part)."""
        raise NotImplementedError(f"{type(self).__name__} defines _prepare or _module_program")

    def _output_rows(self, cfg: MHAConfig, params: MHAParams, inputs: MHAInputs, dtype: str, target) -> OutputRows:
        """What the module oracles (Flax, Equinox) need to give an empty row the spec's output b_o."""
        empty = self._rows_empty_in_every_head(cfg, inputs)  # (B|1, Nq, 1) or None
        return OutputRows(
            rows=to_jax(empty, None, target),
            b_o=to_jax(params.b_o if cfg.output_bias else np.zeros(cfg.d_model), dtype, target),
            count=0 if empty is None else int(np.broadcast_to(empty, (inputs.batch, inputs.q_tokens, 1)).sum()),
        )


class OutputRows(NamedTuple):
    """Output rows a module oracle replaces by b_o: which (on the device), the b_o, and how many."""

    rows: object  # (B|1, Nq, 1) bool JAX array, or None when no row is replaced
    b_o: object  # (D,) JAX array, zeros without bias
    count: int  # (batch item, query) rows replaced, for Prepared.info["empty_rows_mapped"]


def bias_tables(cfg: MHAConfig, inputs: MHAInputs) -> dict[str, np.ndarray]:
    """What an oracle's additive score ``bias`` is made of, NumPy at prepare time (`core.variants`), where on.

    ``sloped``: ALiBi's whole bias ``m_h (p_j - p_i)`` (1|B, H, Nq, Nk) float32 (the slopes from its registry
    entry, `score_parts.distance_slopes`; constants: they are not learned); ``bucket``: T5's bucket of each (query, key) pair (1|B, Nq, Nk) int32,
    which indexes ``params.rel_bias`` inside the traced pass, so that its gradient flows.
    """
    tables = {}
    slopes = distance_slopes(cfg)  # ALiBi's m_h (H,) float64, or None
    if slopes is not None:
        distance = relative_distances(inputs.positions, inputs.kv_positions).astype(np.float64)  # (1|B, Nq, Nk)
        tables["sloped"] = (slopes[None, :, None, None] * distance[:, None]).astype(np.float32)  # (1|B, H, Nq, Nk)
    if cfg.rel_buckets is not None:
        distance = relative_distances(inputs.positions, inputs.kv_positions)  # (1|B, Nq, Nk)
        buckets = t5_buckets(distance, cfg.rel_buckets, cfg.rel_max_distance, cfg.rel_bidirectional)
        tables["bucket"] = buckets.astype(np.int32)
    return tables


def gathered_bias(cfg: MHAConfig, rel_table, tables: dict):
    """The score bias (1|B, H, Nq, Nk) of `bias_tables` in jnp: ALiBi's plus ``rel_table`` (buckets, H) gathered."""
    import jax.numpy as jnp

    bias = tables.get("sloped")
    if cfg.rel_buckets is not None:
        rel = jnp.moveaxis(rel_table[tables["bucket"]], -1, 1)  # (1|B, Nq, Nk, H) -> (1|B, H, Nq, Nk)
        bias = rel if bias is None else bias + rel
    return bias


def spec_rows(output, replacement, rows):
    """``output`` with the rows marked in ``rows`` replaced (the spec's answer for a row with no allowed key)."""
    import jax.numpy as jnp

    return output if rows is None else jnp.where(rows, replacement, output)


# --- jax.nn.dot_product_attention -------------------------------------------------------------
