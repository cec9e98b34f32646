"""The explainer's "KV-cache decoding" section: each convention's cache, where keys are cached, and the causal
alignment of a decode step.

Design rules. (a) The layouts are read, never typed here: each registered implementation's ``decode_caches`` and
``decode_layouts`` class attributes (`backends.base` rule 8) say its cache kinds and their layouts in words; the
token axis a step appends to is found in the layout's shape (the axis named ``T``); an implementation without a
decode path shows "no decode path" with its ``decode_unsupported`` reason. The bytes per token of K and V come
from the configuration (``Hkv * (d_k + d_v) * itemsize``: the cache holds Hkv heads, before the GQA repeat).
(b) Where keys are cached is computed: a small NumPy decode loop (`decode_loop`) runs with keys rotated on write
(Hugging Face's place, the contract's), on read (cached before rotary), and on both (the `decode_rotated_twice`
mistake of `diagnose.decode`), each against the full causal forward (`core.decode.reference_decode`), and the
max abs differences are printed. (c) The two masks of a decode step are `core.decode.decode_allowed` (on
positions: bottom-right) and `core.inputs.causal_mask` (``is_causal=True``: top-left). NumPy and `core` only,
besides reading the backends' class attributes.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import numpy as np

from mha_rosetta.core import MHAConfig, apply_rotary, init_params, linear, numpy_dtype
from mha_rosetta.core.decode import decode_allowed, prepare_decode_inputs, reference_decode, ring_capacity
from mha_rosetta.core.inputs import causal_mask
from mha_rosetta.core.rotary import frequencies
from mha_rosetta.core.tables import markdown_table
from mha_rosetta.core.variants import softmax_with_empty_rows

# The demonstration of (b): GQA (2 kv heads for 4 query heads), rotary half, 7 tokens fed one at a time after 3.
DEMO = MHAConfig(d_model=16, n_heads=4, n_kv_heads=2, causal=True, rope="half", bias=False)
DEMO_TOKENS, DEMO_PREFILL, DEMO_STEP = 7, 3, 1
# The masks of (c): a step of 2 queries at positions 3, 4 over 5 cached keys (3 before the step, 2 of it).
MASK_CACHED, MASK_STEP = 3, 2
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class CacheLayout:
    backend: str
    cache: str  # the cache kind ("" without a decode path)
    layout: str  # the backend's own words, or "no decode path: <reason>"
    appends: str  # what a step of s tokens adds, and on which axis (read from the layout's shape)
    bytes_per_token: int | None  # K and V of one token, for the configuration and dtype (None: no decode path)


@dataclass(frozen=True)
class CachePlace:
    place: str  # where keys are rotated
    max_abs_vs_forward: float  # against the full causal forward
    consistent: bool


@dataclass
class DecodeExplanation:
    cfg: MHAConfig
    dtype: str
    context: int
    layouts: list[CacheLayout] = field(default_factory=list)
    places: list[CachePlace] = field(default_factory=list)
    consistent_difference: float = float("nan")  # max |rotate on write - rotate on read|
    bottom_right: np.ndarray | None = None  # (MASK_STEP, MASK_CACHED + MASK_STEP) bool
    top_left: np.ndarray | None = None

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.cfg, self.dtype)

    def to_dict(self) -> dict:
        return {
            "config": self.cfg.describe(),
            "dtype": self.dtype,
            "context": self.context,
            "bytes_per_token": self.bytes_per_token,
            "cache_slots": cache_slots(self.cfg, self.context),
            "layouts": [asdict(layout) for layout in self.layouts],
            "places": [asdict(place) for place in self.places],
            "consistent_difference": self.consistent_difference,
            "masks": {"bottom_right": self.bottom_right.tolist(), "top_left": self.top_left.tolist()},
        }

    def to_markdown(self) -> str:
        cfg, per_token = self.cfg, self.bytes_per_token
        slots = cache_slots(cfg, self.context)
        lines = ["## KV-cache decoding", ""]
        lines += [
            f"For {cfg.describe()} in {self.dtype}, K and V of one token: Hkv * (d_k + d_v) * itemsize = {cfg.n_kv_heads} * ({cfg.d_k} + {cfg.d_v}) * "
            f"{numpy_dtype(self.dtype).itemsize} = {per_token} bytes (the cache holds the {cfg.n_kv_heads} kv heads, "
            f"before the GQA repeat); at a context of {self.context} tokens the cache holds {slots} slots: "
            f"{_size(slots * per_token)}"
            + (
                f" (a window of {cfg.window}: a ring of W - 1 + step = {slots} slots for one token per step, O(W))"
                if cfg.window is not None
                else ""
            )
            + ".",
            "",
            "Each implementation's cache, read from its `decode_layouts` (rule 8 of `backends.base`):",
            "",
        ]
        rows = [[x.backend, x.cache or "-", x.layout, x.appends, _bytes(x.bytes_per_token)] for x in self.layouts]
        lines += [*markdown_table(["backend", "cache", "layout", "a step appends", "K+V bytes / token"], rows), ""]
        lines += [
            f"Where keys are cached, computed on {DEMO.describe()}, {DEMO_TOKENS} tokens (prefill {DEMO_PREFILL}, "
            f"then {DEMO_STEP} per step), against the full causal forward:",
            "",
        ]
        rows = [
            [p.place, f"{p.max_abs_vs_forward:.3g}", "consistent" if p.consistent else "the decode_rotated_twice error"]
            for p in self.places
        ]
        lines += [*markdown_table(["keys rotated", "max abs vs the forward", "verdict"], rows), ""]
        lines += [
            "Both consistent places give the same output (max abs difference between them "
            f"{self.consistent_difference:.3g}); mixing them rotates each key twice, by R(p) R(p) = R(2p).",
            "",
            f"A decode step of {MASK_STEP} queries (positions {MASK_CACHED}, {MASK_CACHED + 1}) over "
            f"{MASK_CACHED + MASK_STEP} cached keys (positions 0..{MASK_CACHED + MASK_STEP - 1}), 1 = may attend:",
            "",
        ]
        rows = [["bottom-right (on positions: p_j <= p_i)", _grid(self.bottom_right)]]
        rows.append(["top-left (`is_causal=True`: query i sees slots 0..i)", _grid(self.top_left)])
        lines += [*markdown_table(["alignment", "mask (rows: queries)"], rows), ""]
        lines += [
            "Top-left hides keys the step's queries must see (the decode_top_left_causal mistake); with one query "
            "per step, code that passes is_causal only for more than one query (Hugging Face's "
            "`is_causal = q_len > 1`) is unaffected, and code that passes it anyway sees only slot 0 (flax #5591).",
            "",
        ]
        return "\n".join(lines)


def _grid(mask: np.ndarray) -> str:
    return " / ".join(" ".join("1" if v else "0" for v in row) for row in mask)


def _bytes(value: int | None) -> str:
    return "-" if value is None else str(value)


def _size(n: int) -> str:
    return f"{n} bytes" if n < 1024 else f"{n / 1024:.4g} KiB" if n < 1024**2 else f"{n / 1024**2:.4g} MiB"


def kv_bytes_per_token(cfg: MHAConfig, dtype: str) -> int:
    """Bytes of one token's K and V in a cache: ``Hkv * (d_k + d_v) * itemsize``."""
    return cfg.n_kv_heads * (cfg.d_k + cfg.d_v) * numpy_dtype(dtype).itemsize


def cache_slots(cfg: MHAConfig, context: int, step: int = 1) -> int:
    """The slots a cache holds at ``context`` tokens: all of them, or the ring's with a window."""
    ring = ring_capacity(cfg, step)
    return context if ring is None else min(ring, context)


# -- (a) the layouts ----------------------------------------------------------------------------
TOKEN_AXES = ("T", "t", "tokens")  # how a layout names its token axis


def step_appends(layout: str) -> str:
    """What a step of s tokens adds, read from the first shape in ``layout`` that has a token axis.

    A shape is ``(B, Hkv, T, Dk)`` or an einops pattern in quotes, ``'b h t d'``; the token axis is named one
    of `TOKEN_AXES`.
    """
    shapes = [[a.strip() for a in m.split(",")] for m in re.findall(r"\(([^()]*)\)", layout)]
    shapes += [m.split() for m in re.findall(r"'([^']*)'", layout)]
    axes = next((shape for shape in shapes if any(a in TOKEN_AXES for a in shape)), None)
    if axes is None:
        return "s slots (the layout names no token axis)"
    i = next(i for i, a in enumerate(axes) if a in TOKEN_AXES)
    where = f"axis {i} of ({', '.join(axes)})"
    if i == len(axes) - 1 and len(axes) > 1:
        return f"s columns: {where}, the last"
    if i == len(axes) - 2:
        return f"s rows of {axes[-1]}: {where}"
    return f"s slots on {where}"


def cache_layouts(cfg: MHAConfig, dtype: str = "float32", backends: dict | None = None) -> list[CacheLayout]:
    """One row per implementation and cache kind; ``backends`` (name -> class or instance) defaults to the registry's.

    From the registry: every registered implementation (oracles have no cache), its class read without running
    it or importing its framework; one whose module cannot load shows why.
    """
    per_token = kv_bytes_per_token(cfg, dtype)
    if backends is None:
        from mha_rosetta.backends import registered_classes

        backends = registered_classes("implementation")  # read without their frameworks
    rows = []
    for name, backend in backends.items():
        if isinstance(backend, str):  # could not load: the reason
            rows.append(CacheLayout(name, "", f"cannot load: {backend}", "-", None))
            continue
        caches = tuple(getattr(backend, "decode_caches", ()))
        layouts = dict(getattr(backend, "decode_layouts", {}))
        if not caches:
            reason = getattr(backend, "decode_unsupported", "")
            rows.append(CacheLayout(name, "", "no decode path" + (f": {reason}" if reason else ""), "-", None))
            continue
        for cache in caches:
            layout = layouts.get(cache, "")
            words = layout or "(no layout declared in decode_layouts)"
            rows.append(CacheLayout(name, cache, words, step_appends(layout) if layout else "-", per_token))
    return rows


# -- (b) where keys are cached ------------------------------------------------------------------
def decode_loop(cfg: MHAConfig, params, x, *, prefill: int, step: int, rotate_on_write: bool, rotate_on_read: bool):
    """A plain NumPy decode loop ((B, N, D) -> (B, N, D)) whose keys are rotated on write, on read, or both.

    Write: the chunk's keys (rotated or not) are appended to the cache, (B, Hkv, T, Dk), with their positions.
    Read: the whole cache, rotated by its slots' positions when ``rotate_on_read``. Queries are always rotated
    at their positions. No window, QK-norm or score variants (the demonstration's configuration has none).
    """
    inputs = prepare_decode_inputs(cfg, x, prefill=prefill, step=step)
    B, H, Hkv, Dk, Dv = inputs.batch, cfg.n_heads, cfg.n_kv_heads, cfg.d_k, cfg.d_v
    inv_freq, factor = frequencies(cfg, inputs.tokens)

    def rotate(heads, positions):  # (B, n, T, Dk), (B, T)
        angle = positions[..., None] * inv_freq  # (B, T, r/2)
        return apply_rotary(heads, factor * np.cos(angle)[:, None], factor * np.sin(angle)[:, None], cfg.rope)

    K, V, K_pos = np.zeros((B, Hkv, 0, Dk)), np.zeros((B, Hkv, 0, Dv)), np.zeros((B, 0), dtype=np.int64)
    kv_of = [cfg.kv_head_of(h) for h in range(H)]
    out = []
    for start, stop in inputs.chunks():
        s, xs, pos = stop - start, inputs.x[:, start:stop], inputs.positions[:, start:stop]
        q = linear(xs, params.w_q, params.b_q).reshape(B, s, H, Dk).transpose(0, 2, 1, 3)  # (B, H, s, Dk) view
        k = linear(xs, params.w_k, params.b_k).reshape(B, s, Hkv, Dk).transpose(0, 2, 1, 3)  # (B, Hkv, s, Dk)
        v = linear(xs, params.w_v, params.b_v).reshape(B, s, Hkv, Dv).transpose(0, 2, 1, 3)  # (B, Hkv, s, Dv)
        q = rotate(q, pos)
        K = np.concatenate([K, rotate(k, pos) if rotate_on_write else k], axis=2)  # append: a copy
        V, K_pos = np.concatenate([V, v], axis=2), np.concatenate([K_pos, pos], axis=1)
        keys = rotate(K, K_pos) if rotate_on_read else K
        allowed = decode_allowed(cfg, pos, K_pos, np.ones(K_pos.shape, dtype=bool))  # (B, 1, s, T)
        scores = np.where(allowed, cfg.scale * (q @ keys[:, kv_of].swapaxes(-1, -2)), -np.inf)  # (B, H, s, T)
        context = softmax_with_empty_rows(scores) @ V[:, kv_of]  # (B, H, s, Dv)
        merged = context.transpose(0, 2, 1, 3).reshape(B, s, H * Dv)  # (B, s, H*Dv) copy
        out.append(linear(merged, params.w_o, params.b_o))
    return np.concatenate(out, axis=1)


def cache_places(seed: int = 0) -> tuple[list[CachePlace], float]:
    """The three places run on `DEMO`; and the max abs difference between the two consistent ones."""
    params = init_params(DEMO, seed=seed + 5)
    x = np.random.default_rng(seed + 6).standard_normal((1, DEMO_TOKENS, DEMO.d_model))
    forward = reference_decode(DEMO, params, x, prefill=DEMO_PREFILL, step=DEMO_STEP)
    runs = {}
    for place, write, read in (
        ("after rotary, read as they are (Hugging Face; the contract)", True, False),
        ("before rotary, rotated on read", False, True),
        ("after rotary and again on read", True, True),
    ):
        runs[place] = decode_loop(
            DEMO, params, x, prefill=DEMO_PREFILL, step=DEMO_STEP, rotate_on_write=write, rotate_on_read=read
        )
    places = [
        CachePlace(p, float(np.abs(out - forward).max()), not (i == 2)) for i, (p, out) in enumerate(runs.items())
    ]
    first, second = list(runs.values())[:2]
    return places, float(np.abs(first - second).max())


# -- (c) the masks ------------------------------------------------------------------------------
def step_masks() -> tuple[np.ndarray, np.ndarray]:
    """(bottom-right, top-left) masks, (MASK_STEP, MASK_CACHED + MASK_STEP) bool, of one decode step."""
    cfg = MHAConfig(d_model=1, n_heads=1, causal=True)
    T = MASK_CACHED + MASK_STEP
    q_pos = np.arange(MASK_CACHED, T)[None]  # (1, s)
    k_pos = np.arange(T)[None]  # (1, T)
    bottom_right = decode_allowed(cfg, q_pos, k_pos, np.ones((1, T), dtype=bool))[0, 0]  # (s, T)
    return bottom_right, causal_mask(MASK_STEP, T)


def explain_decode(
    cfg: MHAConfig | None = None,
    *,
    dtype: str = "float32",
    context: int = DEFAULT_CONTEXT,
    backends: dict | None = None,
    seed: int = 0,
) -> DecodeExplanation:
    """The section for ``cfg`` (default `DEMO`): layouts and bytes per token, the cache places, the step masks."""
    cfg = DEMO if cfg is None else cfg
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context!r}")
    result = DecodeExplanation(cfg, dtype, context, cache_layouts(cfg, dtype, backends))
    result.places, result.consistent_difference = cache_places(seed)
    result.bottom_right, result.top_left = step_masks()
    return result
