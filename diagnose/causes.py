"""The fixed vocabulary of causes, and every hypothesis a configuration allows.

A hypothesis is one cause code with its detail (which weight, which pair, which way),
the `simulate.Bug` that reproduces it, the fix in words with the converter to call, and,
where one exists, a repair: a change to the parameters or mask fed to the candidate
that makes a candidate with this bug compute the spec's answer (`diagnose.repairs`).

Some errors cannot be seen in any output and are left out on purpose: a dropped ``b_k``
adds ``q . b_k`` to every score of a row, which the softmax cancels, so a candidate that
drops it is correct; `diagnose` never names what changes no output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import combinations

from mha_rosetta.core import MHAConfig, expected_param_shapes, to_interleaved_params, to_rotate_half_params
from mha_rosetta.core.variants import REPAIRS, VARIANT_REGISTRY, Variant, variants_on

from . import repairs
from .simulate import Bug, other_rope_style, packing_applies


def diagnosed_variants(entries=None) -> list[Variant]:
    """The registry's entries that diagnose knows (`Variant.diagnose`), in diagnose's order (`DiagnoseSpec.rank`)."""
    entries = VARIANT_REGISTRY.values() if entries is None else entries
    return sorted((e for e in entries if e.diagnose is not None), key=lambda e: e.diagnose.rank)


def unseen_variants(cfg: MHAConfig, q_tokens: int) -> list[str]:
    """Notes on ``cfg``'s variants whose mistakes probes of ``q_tokens`` queries cannot show (`DiagnoseSpec.unseen`)."""
    unseen = (entry.diagnose.unseen for entry in diagnosed_variants(variants_on(cfg)))
    return [note for note in (why(cfg, q_tokens) for why in unseen if why is not None) if note]


CAUSE_CODES = (
    "weight_transposed",
    "qkv_swapped",
    "qkv_packing",
    "scale",
    "softmax_axis",
    "mask_polarity",
    "causal_offset",
    "head_split",
    "head_merge_order",
    "gqa_grouping",
    "bias",
    "rope_convention",
    # The variants' mistakes (their entries' `DiagnoseCause`s): each is a hypothesis only when the configuration
    # has the variant.
    *dict.fromkeys(cause.code for entry in diagnosed_variants() for cause in entry.diagnose_causes if not cause.decode),
)
# The decode mistakes (`diagnose.decode.diagnose_decode`): how a KV cache is kept, apart from the forward's.
DECODE_CAUSE_CODES = (
    "decode_positions_not_offset",
    "decode_top_left_causal",
    "decode_empty_slots_attended",
    "decode_ring_off_by_one",
    "decode_rotated_twice",
    # The variants' decode mistakes (their entries' `DiagnoseCause`s with ``decode``: Llama 4's temperature positions).
    *dict.fromkeys(cause.code for entry in diagnosed_variants() for cause in entry.diagnose_causes if cause.decode),
)


@dataclass(frozen=True)
class Hypothesis:
    code: str
    detail: str
    bug: Bug
    fix: str  # in words, with the converter to call
    # (cfg, params, mask) -> (params, mask) fed to the candidate; None where only the code can change
    repair: Callable | None = None
    needs_mask: bool = False  # the repair adds to the mask: give it an all-True one where the probe has none

    @property
    def label(self) -> str:
        return f"{self.code} ({self.detail})"


def hypotheses(cfg: MHAConfig) -> list[Hypothesis]:
    """Every single-cause hypothesis that can run for ``cfg`` (a transposed non-square weight cannot)."""
    return list(_each_hypothesis(cfg))


def latent_form(cfg: MHAConfig) -> bool:
    """A form whose w_q, w_k, w_v read latents, not the tokens (MLA, `Variant.base_shapes`): the candidate builds its
    heads from them, so the q/k/v swaps, packings, head splits and q/k/v biases of the tokens' projections do not
    exist there."""
    return any(entry.base_shapes is not None for entry in variants_on(cfg))


def _each_hypothesis(cfg: MHAConfig) -> Iterator[Hypothesis]:
    shapes = expected_param_shapes(cfg)
    latent = latent_form(cfg)
    for name in ("w_q", "w_k", "w_v", "w_o"):
        rows, cols = shapes[name]
        if rows == cols:
            yield Hypothesis(
                "weight_transposed",
                name,
                Bug(transposed=(name,)),
                f"{name} is used as x @ W where the spec means x @ W.T (W is (out, in), nn.Linear's layout): "
                f"load W.T into that layer, or feed {REPAIRS}.transpose_weight(params, {name!r}) "
                "(the same as core.to_row_sample)",
                lambda cfg, p, m, name=name: (repairs.transpose_weight(p, name), m),
            )
    widths = {"q": (cfg.q_width, cfg.d_model), "k": (cfg.k_width, cfg.kdim), "v": (cfg.v_width, cfg.vdim)}
    for a, b in combinations("qkv", 2):
        if widths[a] == widths[b] and not latent:
            yield Hypothesis(
                "qkv_swapped",
                f"{a} and {b}",
                Bug(swapped=(a, b)),
                f"the {a} and {b} projections are exchanged (w_{a}/b_{a} loaded where w_{b}/b_{b} belong): "
                f"load each into its own layer, or feed {REPAIRS}.swap_projections(params, {a!r}, {b!r})",
                lambda cfg, p, m, a=a, b=b: (repairs.swap_projections(p, a, b), m),
            )
    if packing_applies(cfg) and not latent:
        for written, read in (("blocks", "interleaved"), ("interleaved", "blocks")):
            yield Hypothesis(
                "qkv_packing",
                f"packed as {written}, read as {read}",
                Bug(packing=f"{written}->{read}"),
                f"q, k, v are packed {written} ({_layout(written)}) and unpacked {read} ({_layout(read)}): "
                f"use one layout on both sides, or feed {REPAIRS}.repack_qkv(cfg, params, {written!r}, {read!r})",
                lambda cfg, p, m, w=written, r=read: (repairs.repack_qkv(cfg, p, w, r), m),
            )
    s = cfg.scale
    # With QK-norm the scores are linear in the norm's weight, not in w_q (the norm undoes a scaled w_q).
    entries = diagnosed_variants(variants_on(cfg))
    normed = any(entry.diagnose.normalises_qk for entry in entries)
    rescale = repairs.rescale_query_norm if normed else repairs.rescale_query
    # A weightless norm after the projections (Llama 4's after rotary) undoes any rescaled parameter: no repair.
    unrepairable = any(entry.diagnose.weightless_qk_norm for entry in entries)
    for detail, factor in (
        ("missing: scores not scaled", 1.0),
        ("applied twice", s * s),
        ("1/sqrt(d_model) instead of the per-head scale", cfg.d_model**-0.5),
        ("multiplied by sqrt(d_k) instead of divided", 1.0 / s),
    ):
        if abs(factor - s) > 1e-12 * s:
            yield Hypothesis(
                "scale",
                detail,
                Bug(scale=factor),
                f"scores must be multiplied by cfg.scale = {s:.6g} exactly once (the candidate uses {factor:.6g}): "
                + (
                    "fix the scaling (the weightless QK-norm undoes any rescaled weight)"
                    if unrepairable
                    else f"fix the scaling, or feed {REPAIRS}.{rescale.__name__}(params, {s / factor:.6g})"
                ),
                None if unrepairable else lambda cfg, p, m, f=s / factor, rescale=rescale: (rescale(p, f), m),
            )
    yield Hypothesis(
        "softmax_axis",
        "normalised over queries instead of keys",
        Bug(softmax_axis=-2),
        "the softmax must run over the key axis (the last axis of (B, H, Nq, Nk) scores): softmax(scores, axis=-1)",
    )
    yield Hypothesis(
        "mask_polarity",
        "mask read as True = blocked",
        Bug(mask_inverted=True),
        "the spec's mask is True = may attend (SDPA, JAX, Flax); nn.MultiheadAttention's attn_mask and "
        f"key_padding_mask are True = blocked: pass ~mask there, or feed {REPAIRS}.invert_mask(mask)",
        lambda cfg, p, m: (p, repairs.invert_mask(m)),
    )
    if cfg.causal:
        for detail, knob, fix in (
            ("the diagonal is hidden too (key j < i)", "strict", "tril(ones(Nq, Nk)) (k=0), not triu(..., k=0)"),
            ("one key ahead is visible (key j <= i + 1)", "ahead", "tril(ones(Nq, Nk)), not tril(..., k=1)"),
            (
                "aligned bottom-right",
                "bottom_right",
                "causality on positions; at the default ones query i sees keys j <= i",
            ),
        ):
            yield Hypothesis(
                "causal_offset",
                detail,
                Bug(causal=knob),
                f"the causal mask must let query i see keys j <= i: {fix}",
            )
    for detail, knob in (
        ("(B, N, H*d) reshaped straight to (B, H, N, d)", "direct"),
        ("(B, N, H*d) reshaped straight to (B, H, N, d), merged back the same way", "direct_undone"),
    )[: 0 if latent else 2]:
        yield Hypothesis(
            "head_split",
            detail,
            Bug(head_split=knob),
            "split heads with reshape(B, N, H, d).transpose(1, 2) (or rearrange 'b n (h d) -> b h n d'); "
            "merge with transpose(1, 2).reshape(B, N, H*d)",
        )
    if cfg.n_heads > 1 and cfg.d_v > 1:
        yield Hypothesis(
            "head_merge_order",
            "context merged as (Dv, H) instead of (H, Dv)",
            Bug(merge_order=True),
            "merge heads as (B, N, H, Dv) -> (B, N, H*Dv) (rearrange 'b h n d -> b n (h d)'), not '(d h)': "
            f"fix the merge, or feed {REPAIRS}.reorder_output_columns(cfg, params)",
            lambda cfg, p, m: (repairs.reorder_output_columns(cfg, p), m),
        )
    if 1 < cfg.n_kv_heads < cfg.n_heads:
        # ALiBi's slopes belong to the head slot, not to the weights: no reordering can move them.
        fixed = any(entry.diagnose.head_slots for entry in diagnosed_variants(variants_on(cfg)))
        yield Hypothesis(
            "gqa_grouping",
            "kv heads tiled (h % Hkv) instead of repeated (h // group)",
            Bug(gqa_tiled=True),
            "query head h reads kv head h // (H / Hkv): repeat_interleave(k, group, dim=1), "
            "not k.repeat(1, group, 1, 1)" + ("" if fixed else f"; or feed {REPAIRS}.regroup_query_heads(cfg, params)"),
            None if fixed else lambda cfg, p, m: (repairs.regroup_query_heads(cfg, p), m),
        )
    if cfg.bias:
        named = ("b_q", "b_k", "b_v", "b_o") if cfg.output_bias else ("b_q", "b_k", "b_v")  # bias="qkv": no b_o
        biases = tuple(name for name in named if shapes[name] is not None)  # MLA: b_o only
        for names in dict.fromkeys((*((name,) for name in biases if name != "b_k"), biases)):
            which = "all biases" if len(names) > 1 else names[0]
            yield Hypothesis(
                "bias",
                f"{which} dropped",
                Bug(bias_dropped=names),
                f"add {which} (y = x @ W.T + b): check that the layer has bias=True and that the bias is loaded",
            )
        if cfg.output_bias and cfg.context_width == cfg.d_model:
            yield Hypothesis(
                "bias",
                "b_o added before the output projection",
                Bug(bias_misplaced="b_o before w_o"),
                "add b_o after the output projection: out = merged @ w_o.T + b_o",
            )
    if cfg.rope is not None:
        other = other_rope_style(cfg.rope)
        converter = {"half": to_interleaved_params, "interleaved": to_rotate_half_params}[cfg.rope]
        yield Hypothesis(
            "rope_convention",
            f"{_pairs(other)} rotated together where the spec ({cfg.rope!r}) pairs {_pairs(cfg.rope)}",
            Bug(rope="other"),
            f"the rotary pairing is swapped (or {'Meta' if cfg.rope == 'half' else 'Hugging Face'} weights were "
            f"loaded without the q/k row permutation between the conventions): rotate with rope={cfg.rope!r}"
            + (
                " (attention_k_eq_v ties w_v to w_k, so no permutation of the key rows converts the weights)"
                if cfg.attention_k_eq_v
                else " (MLA's rotary features come from w_q and w_kv_a: no converter permutes them here)"
                if latent
                else f", or feed mha_rosetta.core.{converter.__name__}(cfg, params)[1]"
                if not normed
                else f", or feed {REPAIRS}.convert_rotary_pairing(cfg, params, mha_rosetta.core.{converter.__name__}) "
                "(the QK-norm weights permuted too)"
            ),
            None
            if cfg.attention_k_eq_v or latent
            else lambda cfg, p, m, convert=converter: (repairs.convert_rotary_pairing(cfg, p, convert), m),
        )
        yield Hypothesis(
            "rope_convention",
            "q and k not rotated",
            Bug(rope="none"),
            "rotate q and k by their positions after the head split (mha_rosetta.core.apply_rotary)",
        )
    yield from _variant_hypotheses(cfg)


def _variant_hypotheses(cfg: MHAConfig) -> Iterator[Hypothesis]:
    """The variants' mistakes (each entry's `DiagnoseCause`s, simulated by its steps), only those ``cfg`` has."""
    for entry in diagnosed_variants(variants_on(cfg)):
        for cause in entry.diagnose_causes:
            if cause.applies(cfg) and not cause.decode:  # a decode mistake is `diagnose.decode`'s hypothesis
                detail, fix = cause.words(cfg)
                bug = Bug(mistakes=((entry.name, cause.mistake),))
                yield Hypothesis(cause.code, detail, bug, fix, cause.repair, cause.needs_mask)


def _pairs(style: str) -> str:
    return "features (i, i + r/2)" if style == "half" else "features (2i, 2i + 1)"


def _layout(name: str) -> str:
    return "[q; k; v], as in_proj_weight" if name == "blocks" else "[q_0; k_0; v_0; q_1; ...] per head"
