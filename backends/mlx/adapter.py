"""The MLX adapter: `MlxBackend`, mlx-lm's attention (`layer.MlxAttention`) behind the `Backend` interface.

The forward is built lazily and evaluated by ``mx.eval`` (`Prepared.synchronize`: the timed region
ends there); the backward is ``mx.vjp`` of the same pure function, the three inputs as three
primals even for self-attention; decoding goes through mlx-lm's caches (`decode`). MLA's two forms are
strategies of their own (`mla`, `backends._mla`), through a latent cache when decoding. float64 runs on
the CPU only, held to float32's tolerance (`frameworks.mlx.FLOAT64_LIMIT`, declared in
``info["tolerance_dtype"]``).
"""

from __future__ import annotations

from mha_rosetta.core import MHAConfig, MHAInputs, allowed_positions
from mha_rosetta.core.params import PARAM_NAMES
from mha_rosetta.core.variants import relative_distances

from .._chunking import CHUNKED, CHUNKED_STAGES_NOTE
from .._inputs import convert_inputs
from .._mla import ABSORBED, MLA_STRATEGIES, NAIVE, MLAForms
from .._recording import record_stages
from ..base import STANDARD, Backend, DecodeStep, Prepared, PreparedVJP, tensor_to_numpy
from ..frameworks.mlx import FLOAT64_LIMIT, TOLERANCE_LEVELS, mlx_devices, mlx_stream, precision_info, to_mlx
from ..frameworks.ops import RegistryVariants
from .chunked import ChunkedMlxAttention
from .decode import DECODE_CACHES, DECODE_LAYOUTS, prepare_mlx_decode_run, prepare_mlx_decode_step
from .layer import MlxAttention, mlx_tables
from .mla import (  # MLA's two forms
    attention_info,
    mla_pass,
    prepare_mlx_mla,
    prepare_mlx_mla_decode_run,
    prepare_mlx_mla_decode_step,
)

INPUT_SLOTS = ("d_x_q", "d_x_k", "d_x_v")


class MlxDevices:
    """A mixin for a `Backend` on MLX: its devices are MLX's; float64 only on the CPU (MLX has none on a GPU)."""

    def devices(self) -> tuple[str, ...]:
        return mlx_devices()

    def unsupported_reason(self, cfg: MHAConfig, dtype: str, device: str, strategy: str) -> str | None:
        if device == "gpu" and dtype == "float64":
            return f"{self.name}: MLX has no float64 on the GPU (Metal); float64 runs on the CPU stream only"  # type: ignore[attr-defined]
        return super().unsupported_reason(cfg, dtype, device, strategy)  # type: ignore[misc]


def layer_inputs(cfg: MHAConfig, inputs: MHAInputs, dtype: str, mask: bool = True) -> dict:
    """What `MlxAttention.forward` reads beside the parameters, converted once: the three inputs (self-attention
    keeps one array), the rotary tables, the blocked mask and the score bias's distances (``mask=False``: neither,
    the chunked strategy makes them per tile: they are quadratic in the tokens)."""
    x_q, x_k, x_v = convert_inputs(inputs, lambda array: to_mlx(array, dtype))  # (B, N, features) each
    allowed = allowed_positions(cfg, inputs) if mask else None  # (1|B, 1|H, Nq, Nk) True = may attend, or None
    distance = relative_distances(inputs.positions, inputs.kv_positions) if cfg.has_score_bias and mask else None
    return {
        "x_q": x_q,
        "x_k": x_k,
        "x_v": x_v,
        "tables": mlx_tables(cfg, inputs, dtype),
        "blocked": None if allowed is None else to_mlx(~allowed, None),
        "distance": distance,
    }


def prepare_mlx_vjp(forward, params: dict, given: dict, cotangent, dtype: str, device: str, info: dict) -> PreparedVJP:
    """``mx.vjp`` of ``forward(p, x_q, x_k, x_v)`` (the parameters by name, the three inputs): the timed ``run`` is
    the forward and its backward of ``cotangent``. The inputs are three primals even for self-attention, so each
    slot gets its own gradient; the parameters' gradients are already canonical (``(out, in)`` as held)."""
    import mlx.core as mx

    names = [*INPUT_SLOTS, *params]
    primals = [given["x_q"], given["x_k"], given["x_v"], *params.values()]
    cot = to_mlx(cotangent, dtype)
    stream = mlx_stream(device)

    def pure(*values):
        slots = dict(zip(names, values, strict=True))
        return [forward({name: slots[name] for name in params}, *(slots[name] for name in INPUT_SLOTS))]

    def run():
        with mx.stream(stream):
            _, grads = mx.vjp(pure, primals, [cot])
        return dict(zip(names, grads, strict=True))

    def to_grads(native: dict) -> dict:
        return {name: tensor_to_numpy(grad) for name, grad in native.items() if name in (*INPUT_SLOTS, *PARAM_NAMES)}

    info = {"backward": "mx.vjp", **info}
    return PreparedVJP(run, to_grads, synchronize=lambda grads: mx.eval(list(grads.values())), info=info)


class MlxBackend(MLAForms, MlxDevices, Backend):
    name = "mlx"
    convention = (
        "mlx-lm: nn.Linear (out, in) as mx.addmm(b, x, W.T); heads by reshape(B, L, H, -1).transpose(0, 2, 1, 3); "
        "nn.RoPE(traditional=...) for interleaved/half; GQA without tiling; lazy, mx.eval is the sync"
    )
    strategies = (STANDARD, CHUNKED, NAIVE, ABSORBED)  # the last two: MLA's (`_mla`, `mla`)
    # Every variant in standard and chunked (chunked: window tiles skipped, the score steps on each tile, the sinks
    # in the online softmax); the backward on the standard strategy (chunked is forward only); MLA in its forms.
    variants = RegistryVariants("mlx")  # every variant: the score steps on MlxOps, the others in the projections
    causal_on_positions = True  # the mask comes from the positions (base rule 7), never mask="causal"
    known_differences = (FLOAT64_LIMIT,)
    tolerance_levels = TOLERANCE_LEVELS  # the backward's declaration (the forward's: info["tolerance_dtype"])
    decode_caches = DECODE_CACHES
    decode_variants = RegistryVariants("mlx")
    decode_layouts = DECODE_LAYOUTS
    paged_decode_step = True  # bench --mode decode times the paged step (its pool[table] gather) too
    ragged_decode_step = True  # and a ragged batch's step (rows left padded to the longest)
    decode_strategies = (STANDARD, *MLA_STRATEGIES)  # MLA's through mlx-lm's cache holding the latent (`mla`)

    def _prepare(self, cfg, params, inputs, dtype, device, strategy, chunk=None) -> Prepared:
        import mlx.core as mx

        if strategy in MLA_STRATEGIES:
            return prepare_mlx_mla(cfg, params, inputs, dtype, device, strategy)
        layer = MlxAttention(cfg, params, dtype)
        given = layer_inputs(cfg, inputs, dtype, mask=strategy != CHUNKED)
        stream = mlx_stream(device)
        runner = ChunkedMlxAttention(layer, inputs, chunk) if strategy == CHUNKED else layer

        def run(rec=None):
            with mx.stream(stream):
                return runner.forward(layer.params, **given, rec=rec)

        info = {
            "layout": "row samples (B, L, features); heads (B, H, L, d) as mlx-lm splits them",
            "strategy": strategy,
            "device": str(stream),
            "rope": f"nn.RoPE(traditional={layer.traditional})" if cfg.rope else None,
            "gqa": "queries grouped (B, Hkv, G, L, d) against keys (B, Hkv, 1, S, d): no tiling",
            "sync": "mx.eval (lazy evaluation)",
            **precision_info(dtype),
        }
        if strategy == CHUNKED:
            mx.eval(run())  # once, untimed: how many key tiles the window and the mask let it skip
            info.update(chunk=runner.chunk, stages=CHUNKED_STAGES_NOTE, tiles_visited=runner.tiles_visited)
            info.update(tiles_skipped=runner.tiles_skipped, tiles_planned=runner.plan.counts)
        return Prepared(
            forward=run,
            to_numpy=tensor_to_numpy,
            native_stages=lambda: record_stages(run),
            synchronize=mx.eval,
            info=info,
        )

    def _prepare_vjp(self, cfg, params, inputs, cotangent, dtype, device, strategy) -> PreparedVJP:
        info = {"strategy": strategy, **precision_info(dtype)}
        if strategy in MLA_STRATEGIES:  # mx.vjp of MLA's form (`mla`); the value input is unread (the key's latent)
            forward, layer, given = mla_pass(cfg, params, inputs, dtype, strategy)
            info["attention"] = attention_info(cfg, strategy)
            return prepare_mlx_vjp(forward, layer.params, given, cotangent, dtype, device, info)
        layer = MlxAttention(cfg, params, dtype)
        given = layer_inputs(cfg, inputs, dtype)

        def forward(p, x_q, x_k, x_v):
            return layer.forward(p, x_q, x_k, x_v, given["tables"], given["blocked"], given["distance"])

        return prepare_mlx_vjp(forward, layer.params, given, cotangent, dtype, device, info)

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache, **paging):
        if strategy in MLA_STRATEGIES:
            return prepare_mlx_mla_decode_run(cfg, params, inputs, dtype, device, strategy)
        return prepare_mlx_decode_run(cfg, params, inputs, dtype, device, cache, **paging)

    def _prepare_decode_step(self, cfg, params, job: DecodeStep):
        if job.strategy in MLA_STRATEGIES:  # one step onto the latent cache (`mla`)
            return prepare_mlx_mla_decode_step(cfg, params, job)
        return prepare_mlx_decode_step(cfg, params, job)
