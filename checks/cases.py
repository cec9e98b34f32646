"""The spec cases: small named configurations that together touch every MHAConfig feature.

A catalogue, over 400 lines on purpose: the check's cases, one entry each, so that every MHAConfig
feature's case is found in one list.

Each case uses sizes that differ from one another (batch, tokens, d_model, heads, d_k,
d_v, kdim, vdim), so that an implementation which swaps two axes fails with a shape
error or a wrong number instead of passing by luck.

Each case says which dtypes it runs: one or two per case, every dtype on at least two
cases, float16 on the cases the issue names (cross-attention with kdim != vdim, GQA,
causal + padding). Not every case runs in every dtype because a JIT backend compiles
once per case and dtype (0.3 s of CPU at the very least for XLA on this machine, up to
about 1 s for the module-based oracles), and five such backends would make the full
product (48 combinations) take minutes instead of the default check's one. An
implementation that supports none of a case's dtypes still gets the case, in the first
dtype it supports (`agreement.case_dtypes_for`): every implementation sees every case. A logic
error shows in any dtype (its error is O(1), far above every tolerance); the dtypes are
there to check each one's plumbing and rounding. The exhaustive product stays one
option away: ``mha-rosetta check --dtypes all``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from mha_rosetta.core import (
    DTYPE_NAMES,
    MHAConfig,
    MHAParams,
    allowed_positions,
    init_params,
    prepare_inputs,
    reference_mha,
    reference_stages,
)
from mha_rosetta.core.ragged import RaggedBatch
from mha_rosetta.core.variants import CaseSpec, registry_cases

ALL_DTYPES = DTYPE_NAMES  # float64, float32, float16, bfloat16


def check_case_dtypes(where: str, dtypes) -> None:
    """A case's ``dtypes`` are among `ALL_DTYPES`, or a ValueError naming the case (``where``) and the unknown ones."""
    unknown = [d for d in dtypes if d not in ALL_DTYPES]
    if unknown:
        raise ValueError(f"{where}: dtypes {unknown} are not among {ALL_DTYPES}")


@dataclass(frozen=True)
class CaseInputs:
    """The arrays one case feeds to every implementation (canonical, float64)."""

    query: np.ndarray
    key: np.ndarray | None
    value: np.ndarray | None
    mask: np.ndarray | None
    positions: np.ndarray | None = None  # the queries' rotary positions; None: 0 .. Nq-1
    kv_positions: np.ndarray | None = None  # the keys'; None: the default of prepare_inputs

    @property
    def arrays(self) -> tuple:
        """(query, key, value, mask): the positional arguments of `Backend.run` and `reference_mha`."""
        return self.query, self.key, self.value, self.mask

    @property
    def positions_kwargs(self) -> dict:
        return {"positions": self.positions, "kv_positions": self.kv_positions}


@dataclass(frozen=True)
class SpecCase:
    """One configuration and its inputs, described by numbers rather than by arrays.

    batch:        None for an unbatched call (query of shape (tokens, d_model)).
    kv_tokens:    None for self-attention (key = value = query).
    key_lengths:  per batch item, how many leading keys are real; the rest is padding.
    blocked_rows: (batch item, query row) pairs that may attend to no key at all.
    head_blocked_rows: (batch item, head, query row): a row with no key in that head only
                  (the mask becomes per head).
    mask_density: a random mask on top (True with this probability), for property tests;
                  per head when ``mask_per_head``, else shared by the heads.
    position_offsets: per batch item, the rotary position of its first query token
                  (queries at ``offset .. offset + Nq - 1``); None: positions 0 .. Nq-1.
                  Keys keep the default (the queries' positions in self-attention,
                  ``0 .. Nk-1`` otherwise: a cache of earlier tokens).
    documents:    packed documents of these lengths in one row (batch 1, self-attention): the
                  spec's packing (`core.packing`) spelled as what it is, a document mask ANDed
                  into the mask and positions restarting per document, so every implementation
                  and oracle runs it.
    """

    name: str
    description: str
    cfg: MHAConfig
    batch: int | None = 2
    q_tokens: int = 7
    kv_tokens: int | None = None
    key_lengths: tuple[int, ...] | None = None
    blocked_rows: tuple[tuple[int, int], ...] = ()
    head_blocked_rows: tuple[tuple[int, int, int], ...] = ()
    dtypes: tuple[str, ...] = ("float64", "float32")
    seed: int = 0
    mask_density: float | None = None
    mask_per_head: bool = False
    position_offsets: tuple[int, ...] | None = None
    documents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_case_dtypes(f"case {self.name!r}", self.dtypes)
        batch = 1 if self.batch is None else self.batch
        if self.key_lengths is not None and len(self.key_lengths) != batch:
            raise ValueError(
                f"case {self.name!r}: key_lengths needs one entry per batch item ({batch}), got {self.key_lengths}"
            )
        if self.position_offsets is not None and len(self.position_offsets) != batch:
            raise ValueError(
                f"case {self.name!r}: position_offsets needs one entry per batch item ({batch}), "
                f"got {self.position_offsets}"
            )
        if self.documents is not None and (
            batch != 1 or sum(self.documents) != self.q_tokens or self.kv_tokens is not None or self.position_offsets
        ):
            raise ValueError(
                f"case {self.name!r}: documents {self.documents} are packed into one row of self-attention: "
                f"batch 1, q_tokens = their sum, no kv_tokens or position_offsets"
            )

    @property
    def is_cross_attention(self) -> bool:
        return self.kv_tokens is not None

    @property
    def has_mask(self) -> bool:
        masks = (self.key_lengths is not None, self.blocked_rows, self.head_blocked_rows, self.mask_density is not None)
        return any(masks) or self.documents is not None

    def params(self) -> MHAParams:
        return init_params(self.cfg, seed=self.seed)

    def inputs(self) -> CaseInputs:
        """Deterministic unit-variance inputs and the boolean mask (True = may attend)."""
        rng = np.random.default_rng(1000 + self.seed)
        batch = () if self.batch is None else (self.batch,)
        query = rng.standard_normal((*batch, self.q_tokens, self.cfg.d_model))
        key = value = None
        kv_tokens = self.q_tokens
        if self.is_cross_attention:
            kv_tokens = self.kv_tokens
            key = rng.standard_normal((*batch, kv_tokens, self.cfg.kdim))
            value = rng.standard_normal((*batch, kv_tokens, self.cfg.vdim))
        positions = None
        if self.position_offsets is not None:
            positions = np.array([offset + np.arange(self.q_tokens) for offset in self.position_offsets])  # (B, Nq)
            positions = positions if self.batch is not None else positions[0]
        if self.documents is not None:
            positions = RaggedBatch(self.documents).position_ids(drop_empty=True)  # (Nq,): restarting per document
            positions = positions if self.batch is None else positions[None]
        return CaseInputs(query, key, value, self._mask(kv_tokens, rng), positions)

    def _mask(self, kv_tokens: int, rng: np.random.Generator) -> np.ndarray | None:
        if not self.has_mask:
            return None
        batch = 1 if self.batch is None else self.batch
        heads = self.cfg.n_heads if self.mask_per_head or self.head_blocked_rows else 1
        mask = np.ones((batch, heads, self.q_tokens, kv_tokens), dtype=bool)  # (B, H or 1, Nq, Nk)
        if self.mask_density is not None:
            mask &= rng.random(mask.shape) < self.mask_density
        for b, length in enumerate(self.key_lengths or ()):
            mask[b, :, :, length:] = False  # padding keys: nobody attends to them
        for b, row in self.blocked_rows:
            mask[b, :, row, :] = False  # a query row with nothing to attend to
        for b, head, row in self.head_blocked_rows:
            mask[b, head, row, :] = False  # ... in one head only
        if self.documents is not None:
            mask &= RaggedBatch(self.documents).document_mask(drop_empty=True)  # no key of another document
        return mask if self.batch is not None else mask[0]  # unbatched masks have no batch axis

    def arguments(self) -> tuple[tuple, dict]:
        """``(cfg, params, query, key, value, mask)`` and the positions' keywords: this case as the arguments of
        `reference_mha`, `reference_stages`, `reference_mha_vjp`, `Backend.run` and ``run_vjp`` alike."""
        data = self.inputs()
        return (self.cfg, self.params(), *data.arrays), data.positions_kwargs

    def call(self, function, **kwargs):
        """``function(*args, **positions, **kwargs)`` on this case's `arguments`."""
        args, where = self.arguments()
        return function(*args, **where, **kwargs)

    def run(self, backend, dtype: str = "float64", strategy: str = "standard", **kwargs):
        """``backend.run`` on this case's parameters and inputs (kwargs: device, return_stages, ...)."""
        return self.call(backend.run, dtype=dtype, strategy=strategy, **kwargs)

    def reference(self) -> np.ndarray:
        """The float64 oracle's output for this case."""
        return self.call(reference_mha)

    def reference_stages(self) -> dict[str, np.ndarray]:
        """The float64 oracle's stage tensors for this case (batched, canonical layout)."""
        return self.call(reference_stages)

    def __str__(self) -> str:
        return self.name

    def allowed(self) -> np.ndarray:
        """(B, H, Nq, Nk) bool, batched form: the keys each query may attend to in each head (mask and causal)."""
        data = self.inputs()
        inputs = prepare_inputs(self.cfg, data.query, data.key, data.value, data.mask, **data.positions_kwargs)
        allowed = allowed_positions(self.cfg, inputs)
        shape = (inputs.batch, self.cfg.n_heads, inputs.q_tokens, inputs.kv_tokens)
        return np.ones(shape, dtype=bool) if allowed is None else np.broadcast_to(allowed, shape)  # a view

    def empty_rows(self) -> np.ndarray:
        """(B, Nq) bool, batched form: output rows where some head may attend to no key."""
        return (~self.allowed().any(axis=-1)).any(axis=1)  # (B, Nq)

    def describe(self) -> str:
        """One line: sizes and features, e.g. for the report's case list."""
        parts = [self.cfg.describe(), f"batch={'none' if self.batch is None else self.batch}"]
        parts.append(f"Nq={self.q_tokens}" + (f" Nk={self.kv_tokens}" if self.is_cross_attention else ""))
        if self.key_lengths is not None:
            parts.append(f"key_lengths={list(self.key_lengths)}")
        if self.blocked_rows:
            parts.append(f"blocked_rows={[list(r) for r in self.blocked_rows]}")
        if self.head_blocked_rows:
            parts.append(f"head_blocked_rows={[list(r) for r in self.head_blocked_rows]}")
        if self.mask_density is not None:
            parts.append(f"random mask {self.mask_density:g}" + (" per head" if self.mask_per_head else ""))
        if self.cfg.scale != self.cfg.d_k**-0.5:
            parts.append(f"scale={self.cfg.scale:g}")
        if self.position_offsets is not None:
            parts.append(f"positions from {list(self.position_offsets)}")
        if self.documents is not None:
            parts.append(f"packed documents {list(self.documents)}")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "config": asdict(self.cfg),  # every MHAConfig field, resolved (d_k, scale, ...)
            "batch": self.batch,
            "q_tokens": self.q_tokens,
            "kv_tokens": self.q_tokens if self.kv_tokens is None else self.kv_tokens,
            "key_lengths": None if self.key_lengths is None else list(self.key_lengths),
            "blocked_rows": [list(r) for r in self.blocked_rows],
            "mask_density": self.mask_density,
            "mask_per_head": self.mask_per_head,
            "position_offsets": None if self.position_offsets is None else list(self.position_offsets),
            "documents": None if self.documents is None else list(self.documents),
            "dtypes": list(self.dtypes),
        }


# The cases of the 2017-23 layer, written as the variants' are (`core.variants.CaseSpec`: name, description,
# MHAConfig keywords, SpecCase options). A case that names no batch or q_tokens has the defaults: 2 batch items of
# 7 query tokens.
LAYER_CASES = (
    CaseSpec(
        "self_attention",
        "plain self-attention: key = value = query",
        dict(d_model=15, n_heads=3),  # d_k = d_v = 5
        dict(dtypes=("float64", "bfloat16")),
    ),
    CaseSpec(
        "cross_attention",
        "cross-attention: other tokens (Nq != Nk) of other widths (kdim != vdim != d_model)",
        dict(d_model=15, n_heads=3, kdim=11, vdim=9),
        dict(kv_tokens=6, dtypes=("float32", "float16"), seed=1),
    ),
    CaseSpec(
        "gqa",
        "grouped-query attention: 4 query heads share 2 kv heads",
        dict(d_model=20, n_heads=4, n_kv_heads=2),  # d_k = 5
        dict(batch=3, dtypes=("float16",), seed=2),
    ),
    CaseSpec(
        "mqa",
        "multi-query attention: 3 query heads share one kv head",
        dict(d_model=18, n_heads=3, n_kv_heads=1),  # d_k = 6
        dict(q_tokens=5, dtypes=("float64",), seed=3),
    ),
    CaseSpec(
        "causal",
        "causal self-attention: query i sees keys 0..i",
        dict(d_model=15, n_heads=3, causal=True),
        dict(dtypes=("float32",), seed=4),
    ),
    CaseSpec(
        "padding",
        "key padding per batch item (lengths 8, 6, 3, 1 of 8)",
        dict(d_model=15, n_heads=3),
        dict(batch=4, q_tokens=8, key_lengths=(8, 6, 3, 1), dtypes=("float64",), seed=5),
    ),
    CaseSpec(
        "causal_padding",
        "causal mask combined with key padding (lengths 7, 4 of 7)",
        dict(d_model=12, n_heads=4, causal=True),  # d_k = 3
        dict(key_lengths=(7, 4), dtypes=("float16", "bfloat16"), seed=6),
    ),
    CaseSpec(
        "no_bias",
        "projections without bias",
        dict(d_model=15, n_heads=3, bias=False),
        dict(dtypes=("float32",), seed=7),
    ),
    CaseSpec(
        "unbatched",
        "unbatched call: query of shape (tokens, d_model)",
        dict(d_model=15, n_heads=3),
        dict(batch=None, dtypes=("float64",), seed=8),
    ),
    CaseSpec(
        "custom_scale",
        "a scale other than 1/sqrt(d_k)",
        dict(d_model=15, n_heads=3, scale=0.37),
        dict(dtypes=("float32",), seed=9),
    ),
    CaseSpec(
        "dv_ne_dk",
        "value heads narrower than key heads (d_v=4, d_k=6) and d_model != heads*d_k",
        dict(d_model=16, n_heads=3, d_k=6, d_v=4),
        dict(dtypes=("float64",), seed=10),
    ),
    CaseSpec(
        "fully_masked_row",
        "query rows that may attend to no key (spec: zero weights, output = b_o)",
        # Two heads, self-attention with bias: the shape that sends torch's
        # nn.MultiheadAttention down its fused fast path, which answers such rows with NaN.
        dict(d_model=12, n_heads=2),  # d_k = 6
        dict(batch=3, key_lengths=(7, 5, 4), blocked_rows=((0, 2), (2, 6)), dtypes=("float32",), seed=11),
    ),
    CaseSpec(
        "heads_split",
        "8 heads over 2 kv heads, cross-attention with padding: splits over 2, 4 and 8 ranks (tensor parallelism)",
        # Even head counts, so the sharded backends split it (kv heads split over 2 ranks,
        # replicated over 4 and 8); d_k=3 and kdim/vdim differ from every other width.
        dict(d_model=16, n_heads=8, n_kv_heads=2, d_k=3, kdim=10, vdim=14),
        dict(q_tokens=9, kv_tokens=6, key_lengths=(6, 4), dtypes=("float64", "float32"), seed=18),
    ),
    CaseSpec(
        "rope_half",
        "rotary embedding, rotate-half pairs (i, i + d_k/2): Hugging Face Llama, GPT-NeoX",
        dict(d_model=15, n_heads=3, d_k=6, rope="half"),
        dict(dtypes=("float64", "float32"), seed=12),
    ),
    CaseSpec(
        "rope_interleaved",
        "rotary embedding, interleaved pairs (2i, 2i+1): Meta Llama, GPT-J",
        dict(d_model=15, n_heads=3, d_k=6, rope="interleaved"),
        dict(dtypes=("float64", "bfloat16"), seed=13),
    ),
    CaseSpec(
        "rope_partial",
        "partial rotary (GPT-NeoX): the first 4 of 6 features per head rotate, the last 2 pass through",
        dict(d_model=15, n_heads=3, d_k=6, d_v=5, rope="half", rope_dims=4),
        dict(dtypes=("float64", "float16"), seed=14),
    ),
    CaseSpec(
        "rope_gqa_causal",
        "interleaved partial rotary with grouped kv heads (4 query heads, 2 kv heads) and a causal mask",
        dict(d_model=20, n_heads=4, n_kv_heads=2, d_k=6, rope="interleaved", rope_dims=4, causal=True),
        dict(batch=3, dtypes=("float64", "float32"), seed=15),
    ),
    CaseSpec(
        "rope_positions",
        "rotary at other positions: batch items start at 5 and 11 (queries and keys alike)",
        dict(d_model=15, n_heads=3, d_k=6, rope="half", rope_base=500.0),
        dict(position_offsets=(5, 11), dtypes=("float64",), seed=16),
    ),
    CaseSpec(
        "rope_cache",
        "rotary with a cache: 4 new queries at positions 3..6 attend to 7 cached keys at 0..6",
        dict(d_model=15, n_heads=3, d_k=6, rope="interleaved"),
        dict(q_tokens=4, kv_tokens=7, position_offsets=(3, 3), dtypes=("float64",), seed=17),
    ),
    CaseSpec(
        "causal_cache",
        "a decode step as one forward: 3 causal queries at positions 4..6 over 7 cached keys at 0..6, so "
        "causality on positions is bottom-right (is_causal=True would be top-left)",
        dict(d_model=18, n_heads=5, n_kv_heads=1, d_k=4, rope="half", causal=True),
        dict(q_tokens=3, kv_tokens=7, position_offsets=(4, 4), dtypes=("float64", "float32"), seed=34),
    ),
    CaseSpec(
        "packed",
        "packed documents of 4, 0, 1, 6 and 2 tokens in one row (cu_seqlens [0, 4, 4, 5, 11, 13]): "
        "each attends only within itself, rotary positions restarting per document",
        dict(d_model=18, n_heads=3, n_kv_heads=1, rope="half", causal=True),  # d_k = 6
        dict(batch=1, q_tokens=13, documents=(4, 0, 1, 6, 2), dtypes=("float64", "float32"), seed=35),
    ),
    CaseSpec(
        "packed_window_alibi",
        "packed documents of 5, 1 and 6 tokens with ALiBi and a causal window of 3: distances and the "
        "window read on positions within each document",
        dict(d_model=15, n_heads=3, causal=True, window=3, alibi=True),
        dict(batch=1, q_tokens=12, documents=(5, 1, 6), dtypes=("float64", "float32"), seed=36),
    ),
)


def case_table(case_class, specs) -> dict:
    """The cases ``case_class`` (`SpecCase`, `checks.decode_cases.DecodeCase`) of ``specs`` (`CaseSpec`), by name."""
    return {
        spec.name: case_class(spec.name, spec.description, MHAConfig(**spec.config), **spec.options) for spec in specs
    }


# After the layer's cases, the variants of 2024-26 attention (issue 24): each variant's cases, then the combinations
# real models use (`core.variants`: the entries' and `core.variants.models`' cases, by seed). Sizes differ from the
# cases above and from each other.
SPEC_CASES: dict[str, SpecCase] = case_table(SpecCase, (*LAYER_CASES, *registry_cases("check")))


def named_cases(table: dict, names, noun: str = "case", where: str = "") -> list:
    """The cases of ``table`` named in ``names``, in the order given (all of them for None); an unknown name is a
    ValueError that lists the known ones (``noun``: what the table holds; ``where``: the option it came from)."""
    if names is None:
        return list(table.values())
    names = list(names)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"{where}unknown {noun}(s) {', '.join(map(repr, unknown))}; known {noun}s: {', '.join(table)}")
    return [table[n] for n in names]


def get_cases(names=None) -> list[SpecCase]:
    """The named spec cases in the order given (all of them for None)."""
    return named_cases(SPEC_CASES, names)
