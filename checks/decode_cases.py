"""The decode cases: one causal sequence each, split into a prefill and steps, for ``mha-rosetta check --decode``.

A `DecodeCase` says how a sequence of ``tokens`` tokens is fed to an implementation's KV
cache: the first ``prefill`` tokens as one forward that fills it, then ``step`` tokens per
call (`core.decode.DecodeInputs.chunks`). Its inputs come from a seeded generator, as the
forward cases' do (`checks.cases`), and its sizes (batch, tokens, d_model, heads, d_k, the
window) differ from one another, so that a swapped axis or a cache indexed on the wrong one
fails instead of passing by luck.

Padding: ``"left"`` puts ``tokens - length`` pads before each item's real tokens (their
positions are ``cumsum(mask) - 1``, so pads sit at -1, as ``generate`` computes them);
``"right"`` puts them after. Left padding is also how rows of different lengths decode together
(continuous batching, ``ragged_rows``): each row at its own position, a length of 0 an idle row. With a window, a ring buffer keeps its slots by index, so the real
tokens' positions must advance by one per token (`core.decode.prepare_decode_inputs` refuses
anything else); the window is exercised with left padding and the right-padded case has none.

``caches``: the cache kinds the case runs (None: every kind each backend declares in
``decode_caches``). `DECODE_CASES` is the registry every list (``--cases``, ``--list``, the
tests) reads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from mha_rosetta.core import MHAConfig, MHAParams, init_params
from mha_rosetta.core.decode import DecodeInputs, prepare_decode_inputs, ring_capacity
from mha_rosetta.core.paged import check_page_size
from mha_rosetta.core.variants import CaseSpec, registry_cases

from .cases import case_table, check_case_dtypes, named_cases

PADDINGS = (None, "left", "right")


@dataclass(frozen=True)
class DecodeCase:
    """One decode run described by numbers: the configuration (causal), the sequence and how it is fed.

    batch:    batch items (the inputs are always batched, (B, N, d_model)).
    tokens:   the sequence's length N (prefill and steps together).
    prefill:  tokens of the first forward (1 .. N).
    step:     tokens per later call (the last call may take fewer).
    padding:  None, "left" or "right", with ``lengths`` the real tokens of each item.
    caches:   the cache kinds to run (None: all of each backend's ``decode_caches``).
    page_size: the paged cache's tokens per page (None: the backends' default, vLLM's 16).
    """

    name: str
    description: str
    cfg: MHAConfig
    batch: int = 2
    tokens: int = 9
    prefill: int = 4
    step: int = 1
    padding: str | None = None
    lengths: tuple[int, ...] | None = None
    dtypes: tuple[str, ...] = ("float64", "float32")
    seed: int = 0
    caches: tuple[str, ...] | None = None
    page_size: int | None = None

    def __post_init__(self) -> None:
        where = f"decode case {self.name!r}"
        if not self.cfg.causal:
            raise ValueError(f"{where}: decoding needs a causal configuration (MHAConfig.causal=True)")
        check_case_dtypes(where, self.dtypes)
        if self.padding not in PADDINGS:
            raise ValueError(f"{where}: padding must be one of {PADDINGS}, got {self.padding!r}")
        if (self.padding is None) != (self.lengths is None):
            raise ValueError(f"{where}: padding and lengths (real tokens per item) go together, got {self.lengths}")
        if self.lengths is not None and (
            len(self.lengths) != self.batch or not all(0 <= n <= self.tokens for n in self.lengths)
        ):
            raise ValueError(
                f"{where}: lengths needs one entry per batch item ({self.batch}), each 0..{self.tokens}, "
                f"got {self.lengths}"
            )
        self.decode_inputs()  # prefill, step and the window's padding rule, checked once here
        if self.page_size is not None:
            check_page_size(self.page_size)

    @property
    def window_outgrown(self) -> bool:
        """True when the sequence is longer than the window's ring buffer (the cache must wrap)."""
        ring = ring_capacity(self.cfg, self.step)
        return ring is not None and self.tokens > ring

    def params(self) -> MHAParams:
        return init_params(self.cfg, seed=self.seed)

    def mask(self) -> np.ndarray | None:
        """(B, N) bool padding mask (True: a real token), or None."""
        if self.padding is None:
            return None
        index = np.arange(self.tokens)[None, :]  # (1, N)
        lengths = np.asarray(self.lengths)[:, None]  # (B, 1)
        return index >= self.tokens - lengths if self.padding == "left" else index < lengths

    def x(self) -> np.ndarray:
        """(B, N, d_model) float64, standard normal from the case's seed."""
        rng = np.random.default_rng(self.seed)
        return rng.standard_normal((self.batch, self.tokens, self.cfg.d_model))

    def paging(self, cache: str | None) -> dict:
        """The paged cache's keywords of `Backend.prepare_decode_run` for a run with cache kind ``cache``."""
        return {"page_size": self.page_size} if cache == "paged" and self.page_size is not None else {}

    def run_args(self) -> dict:
        """The keywords of `Backend.prepare_decode_run` and `core.decode.reference_decode` besides cfg and params."""
        return {"x": self.x(), "prefill": self.prefill, "step": self.step, "mask": self.mask()}

    def decode_inputs(self) -> DecodeInputs:
        return prepare_decode_inputs(self.cfg, **self.run_args())

    def describe(self) -> str:
        cfg = self.cfg
        parts = [f"B={self.batch}", f"N={self.tokens}", f"prefill {self.prefill}", f"step {self.step}"]
        parts.append(f"d_model={cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), d_k={cfg.d_k}")
        if cfg.rope:
            parts.append(f"rope {cfg.rope}" + (f" on {cfg.rope_dims} dims" if cfg.rope_dims else ""))
        if cfg.window is not None:
            ring = ring_capacity(cfg, self.step)
            parts.append(f"window {cfg.window} (ring of {ring}{', outgrown' if self.window_outgrown else ''})")
        if cfg.variants:
            parts.append("variants " + ", ".join(cfg.variants))
        if self.padding:
            parts.append(f"{self.padding}-padded, real lengths {list(self.lengths)}")
        if self.page_size is not None:
            parts.append(f"pages of {self.page_size} (paged cache)")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["cfg"] = asdict(self.cfg)
        data["chunks"] = [list(chunk) for chunk in self.decode_inputs().chunks()]
        return data

    def __str__(self) -> str:
        return self.name


# The cache's cases, written as the variants' are (`core.variants.CaseSpec`: name, description, MHAConfig keywords,
# DecodeCase options).
CACHE_CASES = (
    CaseSpec(
        "gqa_rotary",
        "GQA (4 query heads on 2 kv heads) with half rotary: the cache holds Hkv heads, rotated keys",
        dict(d_model=20, n_heads=4, n_kv_heads=2, d_k=6, rope="half", causal=True),
        dict(batch=2, tokens=9, prefill=4, dtypes=("float64", "float32", "float16"), seed=101),
    ),
    CaseSpec(
        "prefill_one",
        "prefill of one token, then every other token one at a time (GQA, half rotary)",
        dict(d_model=18, n_heads=3, n_kv_heads=1, d_k=4, rope="half", causal=True),
        dict(batch=3, tokens=7, prefill=1, seed=102),
    ),
    CaseSpec(
        "prefill_all",
        "the whole sequence as the prefill: no step at all (the cache is only written)",
        dict(d_model=18, n_heads=3, n_kv_heads=1, d_k=4, rope="half", causal=True),
        dict(batch=2, tokens=6, prefill=6, dtypes=("float64",), seed=103),
    ),
    CaseSpec(
        "window_outgrown",
        "a window of 3 (ring of 3 slots), prefill 2 shorter than the ring, 11 tokens well past it",
        dict(d_model=14, n_heads=2, d_k=6, rope="half", causal=True, window=3),
        dict(batch=2, tokens=11, prefill=2, dtypes=("float64", "float32"), seed=104),
    ),
    CaseSpec(
        "window_long_prefill",
        "a window of 3 with GQA and two tokens a step (ring of 4), prefill 7 longer than the ring",
        dict(d_model=24, n_heads=4, n_kv_heads=2, d_k=6, rope="half", causal=True, window=3),
        dict(batch=1, tokens=12, prefill=7, step=2, dtypes=("float64",), seed=105),
    ),
    CaseSpec(
        "partial_interleaved",
        "partial interleaved rotary (4 of 6 dims rotated, GPT-J style) with GQA",
        dict(d_model=20, n_heads=4, n_kv_heads=2, d_k=6, rope="interleaved", rope_dims=4, causal=True),
        dict(batch=2, tokens=8, prefill=3, dtypes=("float64", "bfloat16"), seed=106),
    ),
    CaseSpec(
        "two_per_step",
        "two tokens per step, the last step one token (9 - 4 = 5 does not divide by 2)",
        dict(d_model=15, n_heads=3, d_k=6, rope="half", causal=True),
        dict(batch=2, tokens=9, prefill=4, step=2, seed=107),
    ),
    CaseSpec(
        "left_padded",
        "a left-padded batch (real lengths 8, 5, 3): positions cumsum(mask) - 1, pads at -1; with a window",
        dict(d_model=21, n_heads=3, n_kv_heads=1, d_k=4, rope="half", causal=True, window=4),
        dict(
            batch=3,
            tokens=8,
            prefill=4,
            padding="left",
            lengths=(8, 5, 3),
            dtypes=("float64", "float32", "float16"),
            seed=108,
        ),
    ),
    CaseSpec(
        "right_padded",
        "a right-padded batch (real lengths 4, 9): pads after the real tokens, no window",
        dict(d_model=16, n_heads=2, d_k=6, rope="half", causal=True),
        dict(batch=2, tokens=9, prefill=5, padding="right", lengths=(4, 9), seed=109),
    ),
    CaseSpec(
        "paged_mid_window",
        "pages of 3 under a window of 5 (two tokens a step): every step's window starts mid-page, whole pages "
        "freed behind it; left padding, GQA, ALiBi; the paged cache beside every other kind",
        dict(d_model=22, n_heads=4, n_kv_heads=2, d_k=6, rope="half", causal=True, window=5, alibi=True),
        dict(
            batch=3,
            tokens=13,
            prefill=4,
            step=2,
            padding="left",
            lengths=(13, 9, 6),
            dtypes=("float64", "float32"),
            seed=111,
            page_size=3,
        ),
    ),
    CaseSpec(
        "ragged_rows",
        "continuous batching: rows of 11, 0, 4 and 7 real tokens decode together, each at its own position "
        "(a row joins where its tokens start; the zero-length row is an idle slot: zero context, output b_o); "
        "contiguous and paged (pages of 2) alike",
        dict(d_model=26, n_heads=2, n_kv_heads=1, d_k=8, rope="half", causal=True),
        dict(
            batch=4,
            tokens=11,
            prefill=3,
            step=2,
            padding="left",
            lengths=(11, 0, 4, 7),
            dtypes=("float64", "float32"),
            seed=112,
            page_size=2,
        ),
    ),
    CaseSpec(
        "plain_mha",
        "no rotary, no GQA, one token a step: the case a Flax decode=True cache can run",
        dict(d_model=12, n_heads=3, causal=True),  # d_k = 4
        dict(batch=2, tokens=7, prefill=3, seed=110),
    ),
)
# After the cache's cases, the variants of core.VARIANTS, one case each or combined as real models do
# (`core.variants`: the entries' and `core.variants.models`' decode cases, by seed).
DECODE_CASES: dict[str, DecodeCase] = case_table(DecodeCase, (*CACHE_CASES, *registry_cases("decode")))


def get_decode_cases(names=None) -> list[DecodeCase]:
    """The named decode cases in the order given (all of them for None); an unknown name is a ValueError."""
    return named_cases(DECODE_CASES, names, "decode case", "cases: ")
