"""The decode check (`checks.decode`, ``mha-rosetta check --decode``) on fake decode backends built from `core` only.

`ChunkReference` decodes through a "cache" of the tokens so far: each chunk (the prefill, then
each step) is `core.reference_stages` of the chunk's queries over the cache's keys, with the
mask `core.decode.decode_allowed` gives; a window keeps a ring of `ring_capacity` tokens. It is
right on every decode case. Each subclass makes one of the mistakes issue 25 lists, and the
check must say where it shows: the chunk, its position and the first divergent stage.
"""

from __future__ import annotations

import json
import time
from typing import ClassVar

import numpy as np
import pytest

from mha_rosetta.backends import Backend, StageTensor
from mha_rosetta.backends.base import PreparedDecode
from mha_rosetta.checks import Status, run_check
from mha_rosetta.checks.decode import DECODE, locate
from mha_rosetta.checks.decode_cases import DECODE_CASES, DecodeCase, get_decode_cases
from mha_rosetta.checks.engine import executor_for
from mha_rosetta.checks.json_report import decode_to_json, to_json
from mha_rosetta.core import STAGE_BY_NAME, VARIANTS, MHAConfig, reference_stages
from mha_rosetta.core.decode import decode_allowed, decode_stage_names, ring_capacity


class ChunkReference(Backend):
    """Right: each chunk's queries over the cached tokens (a window: the last ``ring_capacity`` of them)."""

    name = "chunk-ref"
    decode_caches = ("tokens",)
    decode_variants = frozenset(VARIANTS)
    decode_layouts: ClassVar[dict[str, str]] = {
        "tokens": "(B, T, D): the tokens so far, projected again for each chunk"
    }

    def cache_view(self, cfg, inputs, index, start, stop):
        """The keys a chunk sees: token range (lo, hi) of the sequence (the new tokens are its last)."""
        ring = ring_capacity(cfg, inputs.step)
        lo = 0 if index == 0 or ring is None else max(0, stop - ring)  # the prefill attends within itself
        return lo, stop

    def keys(self, inputs, lo, hi):
        """(keys x (B, T, D), their positions (B, T), valid (B, T)) for cache tokens lo..hi."""
        return inputs.x[:, lo:hi], inputs.positions[:, lo:hi], inputs.valid[:, lo:hi]

    def rotary_positions(self, inputs, start, stop, k_positions):
        return inputs.positions[:, start:stop], k_positions

    def mask(self, cfg, q_positions, k_positions, k_valid):
        return decode_allowed(cfg, q_positions, k_positions, k_valid)  # (B, 1, s, T)

    def chunk_stages(self, cfg, params, inputs):
        chunks = []
        for index, (start, stop) in enumerate(inputs.chunks()):
            lo, hi = self.cache_view(cfg, inputs, index, start, stop)
            keys, k_positions, k_valid = self.keys(inputs, lo, hi)
            mask = self.mask(cfg, inputs.positions[:, start:stop], k_positions, k_valid)
            q_pos, k_pos = self.rotary_positions(inputs, start, stop, k_positions)
            stages = reference_stages(cfg, params, inputs.x[:, start:stop], keys, keys, mask, q_pos, k_pos)
            new = np.arange(start - lo, stop - lo)  # the chunk's own tokens among the keys
            chunk = {}
            for name in decode_stage_names(cfg):
                shape = STAGE_BY_NAME[name].shape
                value = stages[name] if "Nk" not in shape else np.take(stages[name], new, axis=shape.index("Nk"))
                chunk[name] = StageTensor(value, shape)
            chunks.append(chunk)
        return chunks

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
        ring = ring_capacity(cfg, inputs.step)
        slots = inputs.tokens if ring is None else min(ring, inputs.tokens)

        def run():
            return np.concatenate([c["output"].value for c in self.chunk_stages(cfg, params, inputs)], axis=1)

        per_slot = cfg.n_kv_heads * (cfg.d_k + cfg.d_v) * 8
        info = {"cache": {"kind": cache, "layout": self.decode_layouts[cache], "slots": slots}}
        info["cache"]["bytes"] = inputs.batch * slots * per_slot
        return PreparedDecode(
            run=run,
            to_numpy=lambda out: np.asarray(out, dtype=np.float64),
            step_stages=lambda: self.chunk_stages(cfg, params, inputs),
            info=info,
        )


class RotaryRestarts(ChunkReference):
    """Rotary applied at positions that restart at 0 on each chunk (keys keep those of their own chunk)."""

    name = "rotary-restarts"

    def rotary_positions(self, inputs, start, stop, k_positions):
        starts = np.zeros(inputs.tokens, dtype=np.int64)  # each token's chunk's first token
        for s, e in inputs.chunks():
            starts[s:e] = s
        p = inputs.positions
        own = p - p[:, starts]  # (B, N): positions counted from each chunk's start
        return own[:, start:stop], own[:, stop - k_positions.shape[1] : stop]


class TopLeftStep(ChunkReference):
    """The top-left causal rule on indices on a step: its first query sees only cache slot 0."""

    name = "top-left"

    def mask(self, cfg, q_positions, k_positions, k_valid):
        s, t = q_positions.shape[1], k_positions.shape[1]
        top_left = np.arange(t)[None, :] <= np.arange(s)[:, None]  # (s, T): j <= i
        return super().mask(cfg, q_positions, k_positions, k_valid) & top_left


class RingOffByOne(ChunkReference):
    """A ring buffer one slot short: the oldest key the window still sees is gone."""

    name = "ring-short"

    def cache_view(self, cfg, inputs, index, start, stop):
        lo, hi = super().cache_view(cfg, inputs, index, start, stop)
        return (lo if index == 0 or cfg.window is None else min(lo + 1, start)), hi


class EmptySlots(ChunkReference):
    """A static cache of N slots whose unwritten slots (zeros, position 0) are attended."""

    name = "empty-slots"
    decode_caches = ("static",)
    decode_layouts: ClassVar[dict[str, str]] = {"static": "(B, N, D) preallocated"}

    def cache_view(self, cfg, inputs, index, start, stop):
        return 0, stop

    def keys(self, inputs, lo, hi):
        x = np.zeros_like(inputs.x)  # (B, N, D): the whole static cache
        x[:, :hi] = inputs.x[:, :hi]
        positions = np.where(np.arange(inputs.tokens) < hi, inputs.positions, 0)  # unwritten: position 0
        return x, positions, np.ones_like(inputs.valid)  # every slot "valid": the bug


class NoStages(RotaryRestarts):
    """The rotary mistake with no stages exposed: only the chunk's output can name it."""

    name = "no-stages"

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
        prepared = super()._prepare_decode_run(cfg, params, inputs, dtype, device, strategy, cache)
        prepared.step_stages = None
        return prepared


class NoCache(Backend):
    name = "no-cache"
    decode_unsupported = "the library's API has no KV cache"


class HangsDecoding(ChunkReference):
    name = "hangs"

    def _prepare_decode_run(self, cfg, params, inputs, dtype, device, strategy, cache):
        time.sleep(3600)  # a blocked call


def _check(backends, cases, dtypes=("float64",), **options):
    return run_check(backends=list(backends), cases=list(cases), dtypes=list(dtypes), kind="decode", **options)


def _runs(result, backend: str) -> dict:
    return {(run.case, run.dtype): run for run in result.runs if run.impl.backend == backend}


# -- the cases ------------------------------------------------------------------------------
def test_the_registry_covers_what_the_issue_names_and_every_variant():
    cases = DECODE_CASES.values()
    assert all(case.cfg.causal for case in cases)
    assert {case.prefill for case in cases} >= {1} and any(case.prefill == case.tokens for case in cases)
    assert any(case.step == 2 and (case.tokens - case.prefill) % 2 for case in cases)
    assert any(c.cfg.n_kv_heads < c.cfg.n_heads and c.cfg.rope == "half" for c in cases)
    assert any(c.cfg.rope == "interleaved" and c.cfg.rope_dims < c.cfg.d_k for c in cases)
    outgrown = [c for c in cases if c.window_outgrown]
    ring = {c.name: ring_capacity(c.cfg, c.step) for c in outgrown}
    assert any(c.prefill < ring[c.name] for c in outgrown) and any(c.prefill > ring[c.name] for c in outgrown)
    assert {c.padding for c in cases} == {None, "left", "right"}
    # issue 47: rows at different lengths decoding together with an idle (zero-length) row, paged and contiguous
    # (every kind); a paged case whose window starts mid-page (W not a multiple of P, pages smaller than W)
    ragged = [c for c in cases if c.padding == "left" and 0 in c.lengths and len(set(c.lengths)) == c.batch]
    assert ragged and all(c.caches is None and c.page_size is not None for c in ragged)
    assert any(
        c.page_size and c.cfg.window and c.cfg.window % c.page_size and c.page_size < c.cfg.window for c in cases
    )
    assert any(c.cfg.rope is None and c.cfg.n_kv_heads == c.cfg.n_heads and c.step == 1 for c in cases)
    assert set(VARIANTS) <= {v for c in cases for v in c.cfg.variants}
    # No two cases share (d_model, heads, tokens): a swapped axis cannot pass by luck.
    sizes = [(c.cfg.d_model, c.cfg.n_heads, c.cfg.n_kv_heads, c.cfg.d_k, c.tokens) for c in cases]
    assert len(set(sizes)) == len(sizes)


def test_left_padding_puts_pads_first_at_position_minus_one():
    case = DECODE_CASES["left_padded"]
    inputs = case.decode_inputs()
    assert inputs.valid.sum(axis=1).tolist() == [8, 5, 3]
    assert inputs.positions[2].tolist() == [-1, -1, -1, -1, -1, 0, 1, 2]
    assert not inputs.valid[1, :3].any() and inputs.valid[1, 3:].all()
    right = DECODE_CASES["right_padded"].decode_inputs()
    assert right.valid[0].tolist() == [True] * 4 + [False] * 5


def test_a_bad_case_is_refused_naming_the_rule():
    with pytest.raises(ValueError, match="causal"):
        DecodeCase("x", "", MHAConfig(d_model=8, n_heads=2))
    with pytest.raises(ValueError, match="prefill must be between 1 and the sequence's 5 tokens, got 6"):
        DecodeCase("x", "", MHAConfig(d_model=8, n_heads=2, causal=True), tokens=5, prefill=6)
    with pytest.raises(ValueError, match=r"lengths needs one entry per batch item \(2\), each 0..6, got \(3,\)"):
        DecodeCase("x", "", MHAConfig(d_model=8, n_heads=2, causal=True), tokens=6, padding="left", lengths=(3,))
    with pytest.raises(ValueError, match=r"page_size must be a positive int \(tokens per page\), got 0"):
        DecodeCase("x", "", MHAConfig(d_model=8, n_heads=2, causal=True), tokens=6, page_size=0)
    with pytest.raises(ValueError, match=r"cases: unknown decode case\(s\) 'nope'; known decode cases: gqa_rotary, "):
        get_decode_cases(["nope"])


# -- the right one and the wrong ones -------------------------------------------------------
@pytest.fixture(scope="module")
def everything():
    backends = [ChunkReference(), NoCache()]
    return _check(backends, DECODE_CASES, dtypes=("float64", "float32", "float16", "bfloat16"))


def test_the_right_implementation_agrees_on_every_case_and_dtype(everything):
    runs = _runs(everything, "chunk-ref")
    expected = {(c.name, d) for c in DECODE_CASES.values() for d in c.dtypes}
    assert set(runs) == expected
    assert {key: run.status for key, run in runs.items()} == dict.fromkeys(expected, Status.AGREE)
    assert all(run.max_abs < 1e-12 for run in runs.values())  # float64 arithmetic: only reordering differs
    assert all(run.impl.cache == "tokens" and run.label == "chunk-ref[tokens]" for run in runs.values())
    assert everything.exit_status == 0


def test_the_cache_it_reports_is_a_ring_of_ring_capacity_slots_with_a_window(everything):
    runs = _runs(everything, "chunk-ref")
    run = runs[("window_outgrown", "float64")]
    case = DECODE_CASES["window_outgrown"]
    assert run.info["cache"]["slots"] == ring_capacity(case.cfg, case.step) == 3 < case.tokens
    assert runs[("gqa_rotary", "float64")].info["cache"]["slots"] == 9


def test_an_implementation_without_decoding_is_unsupported_with_its_reason(everything):
    runs = _runs(everything, "no-cache")
    assert len(runs) == sum(len(c.dtypes) for c in DECODE_CASES.values())  # never left out
    assert {run.status for run in runs.values()} == {Status.UNSUPPORTED}
    assert {run.reason for run in runs.values()} == {
        "no-cache has no KV-cache decoding: the library's API has no KV cache"
    }


def test_a_cache_kind_or_variant_the_backend_lacks_is_unsupported_with_the_reason():
    class NoVariants(ChunkReference):
        name = "plain"
        decode_variants = frozenset()

    case = DecodeCase("cached", "", DECODE_CASES["softcap"].cfg, tokens=5, prefill=2, caches=("tokens", "paged"))
    result = _check([NoVariants()], [case])
    reasons = {run.label: (run.status, run.reason) for run in result.runs}
    assert reasons == {
        "plain[tokens]": (
            Status.UNSUPPORTED,
            "plain's decode path does not implement softcap (it implements: none)",
        ),
        "plain[paged]": (Status.UNSUPPORTED, "plain has no 'paged' cache (it has tokens)"),
    }


def test_rotary_restarting_at_zero_is_named_at_the_first_step_and_q_rotated():
    result = _check([ChunkReference(), RotaryRestarts()], ["gqa_rotary"])
    run = _runs(result, "rotary-restarts")[("gqa_rotary", "float64")]
    assert run.status is Status.DISAGREE
    assert run.where == "step 1 (position 4) diverges at q_rotated"
    assert run.reason.startswith("step 1 (position 4) diverges at q_rotated: DISAGREE: max abs")
    (pair,) = result.pairs
    assert pair.status is Status.DISAGREE and pair.where == "step 1 (position 4) diverges at q_rotated"
    assert result.exit_status == 1


def test_top_left_causal_on_a_step_is_named_at_the_first_step_and_context():
    result = _check([TopLeftStep()], ["gqa_rotary", "two_per_step", "prefill_all"])
    runs = _runs(result, "top-left")
    assert runs[("gqa_rotary", "float64")].where == "step 1 (position 4) diverges at context"
    assert runs[("two_per_step", "float64")].where == "step 1 (position 4) diverges at context"
    assert runs[("prefill_all", "float64")].status is Status.AGREE  # top-left = bottom-right when Nq = Nk


def test_a_ring_buffer_one_slot_short_is_named_where_the_window_first_needs_the_oldest_slot():
    result = _check([RingOffByOne()], ["window_outgrown", "window_long_prefill", "gqa_rotary"])
    runs = _runs(result, "ring-short")
    # window 3, prefill 2: step 1 is the query at position 2, which still sees position 0
    assert runs[("window_outgrown", "float64")].where == "step 1 (position 2) diverges at context"
    # prefill 7 longer than the ring of 4 (window 3, step 2): the first step's query at 7 needs 5
    assert runs[("window_long_prefill", "float64")].where == "step 1 (position 7) diverges at context"
    assert runs[("gqa_rotary", "float64")].status is Status.AGREE  # no window, no ring


def test_attending_the_static_caches_empty_slots_is_named_in_the_prefill():
    result = _check([EmptySlots()], ["gqa_rotary", "prefill_all"])
    runs = _runs(result, "empty-slots")
    assert runs[("gqa_rotary", "float64")].where == "prefill (positions 0..3) diverges at context"
    assert runs[("prefill_all", "float64")].status is Status.AGREE  # a full cache has no empty slot


def test_left_padding_names_the_items_own_position():
    result = _check([RotaryRestarts()], ["left_padded"])
    run = _runs(result, "rotary-restarts")[("left_padded", "float64")]
    # Item 0 has no pads: its positions start at 0 and its prefill is right; item 1's prefill
    # starts with three pads at -1, so restarting there shifts its real tokens: the prefill.
    assert run.where == "prefill (positions -1..0) diverges at q_rotated"


def test_without_stages_the_first_chunk_whose_output_disagrees_is_named():
    result = _check([NoStages()], ["gqa_rotary"])
    assert _runs(result, "no-stages")[("gqa_rotary", "float64")].where == "step 1 (position 4) diverges at output"


def test_locate_finds_the_first_token_of_a_two_token_step():
    case = DECODE_CASES["two_per_step"]
    inputs, cfg = case.decode_inputs(), case.cfg
    expected = np.zeros((2, 9, cfg.d_model))
    actual = expected.copy()
    actual[1, 7, 0] = 1.0  # item 1, token 7: the second token of step 2 (tokens 6..7)
    assert locate(inputs, cfg, "float64", actual, expected, None, None) == "step 2 (position 7) diverges at output"
    assert locate(inputs, cfg, "float64", expected, expected, None, None) == ""


# -- the engine: JSON, workers, time limits ---------------------------------------------------
def test_the_decode_json_file_partial_then_final(tmp_path):
    # write_decode_json writes as write_json does: a partial file compact and marked interrupted, the final indented.
    from mha_rosetta.checks.json_report import write_decode_json

    result = _check([ChunkReference()], ["gqa_rotary"])
    path = tmp_path / "decode.json"
    write_decode_json(result, str(path), partial=True)
    text = path.read_text()
    partial = json.loads(text)
    assert text.count("\n") == 1 and (partial["interrupted"], partial["exit_status"]) == (True, 130)
    assert partial["verdict"] == "interrupted: the results that finished are here (the check did not end)"
    write_decode_json(result, str(path))
    text = path.read_text()
    assert text.startswith('{\n "') and json.loads(text) == json.loads(json.dumps(decode_to_json(result), default=str))
    assert json.loads(text)["exit_status"] == 0


def test_the_json_carries_the_cache_and_where_and_the_forward_json_is_unchanged():
    result = _check([ChunkReference(), RotaryRestarts(), NoCache()], ["gqa_rotary"])
    data = json.loads(json.dumps(decode_to_json(result), default=str))
    assert data["tool"] == "mha-rosetta check --decode"
    runs = {run["implementation"]: run for run in data["runs"]}
    assert runs["rotary-restarts[tokens]"]["cache"] == "tokens"
    assert runs["rotary-restarts[tokens]"]["where"] == "step 1 (position 4) diverges at q_rotated"
    assert runs["chunk-ref[tokens]"]["info"]["cache"]["slots"] == 9
    assert "cache" not in runs["no-cache"] and runs["no-cache"]["status"] == "unsupported"
    assert data["pairs"][0]["where"] == "step 1 (position 4) diverges at q_rotated"
    assert data["cases"][0]["chunks"] == [[0, 4], [4, 5], [5, 6], [6, 7], [7, 8], [8, 9]]
    assert data["exit_status"] == 1
    forward = to_json(run_check(backends="numpy", cases=["causal"], dtypes="float32"))
    assert all("cache" not in run and "where" not in run for run in forward["runs"])
    assert list(forward["runs"][0])[:7] == ["case", "implementation", "backend", "strategy", "device", "dtype", "kind"]


def test_workers_give_the_same_result_and_a_hanging_decode_is_reported_within_its_time_limit():
    backends = [ChunkReference(), RotaryRestarts(), HangsDecoding()]
    with executor_for(2, timeout=5.0) as executor:
        result = _check(backends, ["gqa_rotary"], executor=executor)
    runs = {run.label: run for run in result.runs}
    assert runs["chunk-ref[tokens]"].status is Status.AGREE
    assert runs["rotary-restarts[tokens]"].where == "step 1 (position 4) diverges at q_rotated"
    hang = runs["hangs[tokens]"]
    assert hang.status is Status.ERROR
    assert hang.reason.startswith("timed out: hangs[tokens] on case gqa_rotary (float64) ")
    assert "time limit of 5 s (--timeout)" in hang.reason  # the hour-long sleep was cut off, not waited for
    (pair,) = result.pairs  # the pair of the two that ran, its stages fetched from a worker
    assert pair.where == "step 1 (position 4) diverges at q_rotated"
    assert result.exit_status == 2


def test_the_plan_is_every_implementation_times_its_caches_times_the_cases_dtypes():
    class TwoCaches(ChunkReference):
        name = "two"
        decode_caches = ("dynamic", "static")
        decode_layouts: ClassVar[dict[str, str]] = {"dynamic": "grown", "static": "preallocated"}

    sel = type("Sel", (), {})()
    two, none = TwoCaches(), NoCache()
    chosen = [(two, "standard", "cpu"), (two, "per_head", "cpu"), (none, "standard", "cpu"), (none, "per_head", "cpu")]
    sel.implementations = lambda: iter(chosen)
    sel.case_dtypes = lambda case: list(case.dtypes)
    sel.strategy_filter = None  # no --strategies: a strategy that is not a decode path is left out
    assert [impl.label for impl in DECODE.plan(DECODE_CASES["gqa_rotary"], sel)[0][1]] == [
        "two[dynamic]",
        "two[static]",
        "no-cache",
    ]
    sel.strategy_filter = ["standard", "per_head"]  # asked for by name: per_head is run, and unsupported
    plan = DECODE.plan(DECODE_CASES["gqa_rotary"], sel)
    assert [dtype for dtype, _ in plan] == ["float64", "float32", "float16"]
    labels = ["two[dynamic]", "two[static]", "two:per_head[dynamic]", "two:per_head[static]", "no-cache"]
    assert [impl.label for impl in plan[0][1]] == labels  # no decoding at all: one row, not one per strategy
    oracle = DECODE.oracle(DECODE_CASES["gqa_rotary"], ())
    run = DECODE.run(two, plan[0][1][2], "float64", oracle)
    assert (run.status, run.reason) == (
        Status.UNSUPPORTED,
        "two decodes with the standard strategy only, not 'per_head'",
    )


# -- the command ----------------------------------------------------------------------------
def test_check_decode_on_the_command_line_reports_where_and_exits_by_the_outcome(monkeypatch, capsys, tmp_path):
    from mha_rosetta.checks import selection
    from mha_rosetta.cli.main import main

    fakes = {"good": [ChunkReference(), NoCache()], "wrong": [ChunkReference(), RotaryRestarts()]}
    real_resolve = selection.resolve_backends
    monkeypatch.setattr(
        selection,
        "resolve_backends",
        lambda names: (fakes[names[0]], {}, {}) if names and names[0] in fakes else real_resolve(names),
    )
    path = tmp_path / "decode.json"
    argv = ["check", "--decode", "--cases", "gqa_rotary,window_outgrown", "--dtypes", "float64", "--plain"]
    assert main([*argv, "--backends", "good", "--jobs", "0", "--json", str(path), "--timings"]) == 0
    out = capsys.readouterr().out
    assert "decode, float64: agreement matrix" in out and "Timings, decode check" in out
    assert "no-cache has no KV-cache decoding: the library's API has no KV cache" in out
    assert "chunk-ref[tokens]  (B, T, D): the tokens so far" in out and "window_outgrown 3/11" in out
    data = json.loads(path.read_text())
    assert data["exit_status"] == 0 and data["tool"] == "mha-rosetta check --decode"
    assert main([*argv, "--backends", "wrong", "--jobs", "0", "--markdown", "-"]) == 1
    out = capsys.readouterr().out
    assert "Decode: problems against the full forward" in out
    assert (
        "| gqa_rotary | float64 | rotary-restarts[tokens] | DISAGREE | step 1 (position 4) diverges at q_rotated |"
        in out
    )
    assert "decode: FAIL: 4 failing comparison(s) (exit status 1)" in out  # a run and a pair on each case
    assert main(["check", "--decode", "--cases", "causal"]) == 2
    assert "cases: unknown decode case(s) 'causal'" in capsys.readouterr().err
    assert main(["check", "--decode", "--grad"]) == 2
    assert "--decode and --grad are separate checks" in capsys.readouterr().err


def test_check_decode_list_names_the_decode_cases(capsys):
    from mha_rosetta.cli.main import main

    assert main(["check", "--decode", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decode cases:\n  gqa_rotary ")
    assert "B=3; N=8; prefill 4; step 1" in out and "left-padded, real lengths [8, 5, 3]" in out


def test_a_broken_stage_dump_still_reports_the_disagreement_by_its_output():
    class BrokenStages(RotaryRestarts):
        name = "broken-stages"

        def chunk_stages(self, cfg, params, inputs):
            chunks = super().chunk_stages(cfg, params, inputs)
            if getattr(self, "_ran", False):
                raise RuntimeError("no stages today")
            self._ran = True
            return chunks

    run = _check([BrokenStages()], ["gqa_rotary"]).runs[0]
    assert run.status is Status.DISAGREE
    assert run.where == "step 1 (position 4) diverges at output"
    assert run.reason.endswith("; stages unavailable (RuntimeError: no stages today)")
