"""The column/row-sample article's speed claims as benchmark questions, each answered with measured ratios
and a verdict.

Public entry point (the explainer's ``explain --claims`` takes its speed verdicts from here)::

    from mha_rosetta.benchmarks.questions import run_speed_questions
    answers = run_speed_questions(threads=1, quick=True)
    # [{"claim": 3, "title": ..., "verdict": ..., "evidence": ..., "measurements": [...]}, ...]

Each answer is a dict with

- ``claim``: the claim's number in the article's list (`explain.claims.CLAIMS`): 3, 7, 9, 11;
- ``title``: the claim in a line;
- ``verdict``: ``"confirmed"``, ``"partly"``, ``"refuted"`` or ``"skipped"`` (nothing could be measured);
- ``evidence``: the measured ratios in one or two sentences;
- ``measurements``: per library and device, the median time of every variant at every size
  (seconds), the ratios the verdict was drawn from, and the child's CPU use.

How it is measured: one fresh pinned process per (claim, library, device), with the same
thread limits as the sweep cells (`fresh.run_fresh`); inside it the variants of each size
run round-robin (`timing.time_interleaved`), so that a change in machine load hits every
variant alike, and only ratios between variants measured side by side are reported. A ratio
is the median of the paired ratios, round by round (`_ratio`): sample i of one variant over
sample i of the other, taken next to each other (the sweep's paired references, issue 28, do
the same for cells that run in separate processes).
``quick=True`` uses small sizes and short budgets (about 20 s in all on 2 cores);
``quick=False`` uses larger sizes (about a minute). No answer raises: a library that is
missing or a child that fails becomes a "skipped" measurement with the reason.

The questions:

- claim 3: ``X @ W.T`` against ``W @ X.T`` (both read a transposed, non-contiguous view;
  the second also needs a copy to get back to row samples);
- claim 7: one batched product over heads against slicing one head at a time and against
  per-head matrices, as the head count grows at a fixed d_model;
- claim 9: merging heads after a transpose by ``.contiguous().view()`` against ``.reshape()``
  (and against a true view of already-contiguous data, the floor);
- claim 11: einsum on ``(B, N, H, d_k)`` against transpose + matmul.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

from .fresh import child_main, run_fresh
from .pinning import choose_cpus, cpu_utilisation, cpu_warnings

CONFIRMED, PARTLY, REFUTED, SKIPPED = "confirmed", "partly", "refuted", "skipped"
# Below this ratio two variants are "the same speed": differences of a few percent are noise
# on a shared machine, and no user would choose a formulation for them.
SAME = 1.10

QUESTIONS = {
    3: {
        "name": "linear_layout",
        "title": "X @ W.T is faster than W @ X.T because X.T is not contiguous",
        "quick": [dict(tokens=2048, d_in=256, d_out=256), dict(tokens=2048, d_in=256, d_out=32)],
        "full": [dict(tokens=8192, d_in=512, d_out=512), dict(tokens=8192, d_in=512, d_out=64)],
    },
    7: {
        "name": "heads",
        "title": "one batched product over heads beats slicing heads one at a time by 1.5-2x, more with more heads",
        "quick": [dict(batch=2, tokens=128, d_model=256, heads=h) for h in (2, 8, 32)],
        "full": [dict(batch=4, tokens=256, d_model=512, heads=h) for h in (2, 8, 32)],
    },
    9: {
        "name": "merge_copy",
        "title": "after a transpose, reshape copies just like .contiguous().view()",
        "quick": [dict(batch=2, tokens=256, heads=8, d_k=32)],
        "full": [dict(batch=4, tokens=512, heads=8, d_k=64)],
    },
    11: {
        "name": "einsum",
        "title": "einsum keeps (N, h, d_k) and skips the transpose at no cost",
        "quick": [dict(batch=2, tokens=128, heads=8, d_k=32)],
        "full": [dict(batch=4, tokens=256, heads=8, d_k=64)],
    },
}

QUICK_POLICY = dict(min_time=0.05, min_repeats=5, max_repeats=2000, max_time=0.6, warmup=1)
FULL_POLICY = dict(min_time=0.3, min_repeats=7, max_repeats=5000, max_time=3.0, warmup=2)


# -- the child ----------------------------------------------------------------------------------


def measure(spec: dict) -> dict:
    """Time every case of one (question, library, device) in this process (a fresh pinned child)."""
    from . import pinning
    from .microbench import BUILDERS
    from .timing import RepeatPolicy, time_interleaved

    question, library, device = spec["question"], spec["library"], spec.get("device", "cpu")
    builder = BUILDERS[(question, library)]
    threads = int(spec.get("threads", 1))
    from mha_rosetta.backends.frameworks import get_framework  # after pinning (main): it imports NumPy

    framework = get_framework(library)
    pinning.configure_frameworks(threads, (library,))  # a no-op for NumPy
    policy = RepeatPolicy(**spec["policy"])
    cases = []
    with pinning.limit_thread_pools(threads):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        for sizes in spec["cases"]:
            kwargs = dict(sizes, dtype=spec.get("dtype", "float32"))
            if framework.drives_gpu:  # the builders of a GPU-capable library take the device
                kwargs["device"] = device
            timings = time_interleaved(builder(**kwargs), policy)
            figures = {
                field: {name: t[field] for name, t in timings.items()}
                for field in ("median_s", "iqr_s", "repeats", "samples_s")
            }
            cases.append({"sizes": sizes, **figures})
        wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
    cpu_util = cpu_utilisation(cpu, wall)
    return {"status": "ok", "cases": cases, "cpu_util": cpu_util, "warnings": cpu_warnings(cpu_util, threads, device)}


def main(argv: list[str] | None = None) -> int:
    return child_main(argv, "mha_rosetta.benchmarks.questions", measure)


# -- verdicts -----------------------------------------------------------------------------------


def _ratio(case: dict, slow: str, fast: str) -> float:
    """``slow`` over ``fast`` in one case: the median of the paired ratios, round by round (sample i of
    each variant ran in the same round of `timing.time_interleaved`, so a slowdown of the host hits
    both and cancels); the ratio of the medians for answers recorded without their samples."""
    samples = case.get("samples_s")
    if samples and samples.get(slow) and samples.get(fast):
        return statistics.median(s / f for s, f in zip(samples[slow], samples[fast], strict=True))
    return case["median_s"][slow] / case["median_s"][fast]


def _combine(verdicts: list[str]) -> str:
    measured = [v for v in verdicts if v != SKIPPED]
    if not measured:
        return SKIPPED
    return measured[0] if all(v == measured[0] for v in measured) else PARTLY


def verdict_heads(cases: list[dict]) -> tuple[str, str]:
    """Claim 7 for one library: slicing/batched ratios as heads grow."""
    by_heads = sorted(cases, key=lambda case: case["sizes"]["heads"])
    slicing = [_ratio(c, "slicing", "batched") for c in by_heads]
    per_head = [_ratio(c, "per_head", "batched") for c in by_heads]
    heads = [c["sizes"]["heads"] for c in by_heads]
    grows = slicing[-1] > slicing[0] * 1.05
    verdict = CONFIRMED if min(slicing) >= 1.5 and grows else REFUTED if max(slicing) < SAME else PARTLY
    text = (
        "slicing / batched = " + ", ".join(f"{r:.2f}x (h={h})" for r, h in zip(slicing, heads, strict=True))
        + "; per-head matrices / batched = " + ", ".join(f"{r:.2f}x (h={h})" for r, h in zip(per_head, heads, strict=True))
        + ("; the gap grows with the head count" if grows else "; the gap does not grow with the head count")
    )  # fmt: skip
    return verdict, text


def verdict_linear_layout(cases: list[dict]) -> tuple[str, str]:
    """Claim 3 for one library: the product alone, and with the copy back to (N, out)."""
    raw = [_ratio(c, "w_at_xT", "x_at_wT") for c in cases]
    back = [_ratio(c, "w_at_xT_back", "x_at_wT") for c in cases]
    if min(raw) >= SAME:
        verdict = CONFIRMED  # W @ X.T is slower at every shape, copy or not
    elif max(back) < SAME or max(raw) <= 1 / SAME:
        verdict = REFUTED  # no cost anywhere, even with the copy back (or W @ X.T is the faster one)
    else:
        verdict = PARTLY  # slower at some shapes, or only once the result is copied back to (N, out)
    shapes = [f"N={c['sizes']['tokens']}, {c['sizes']['d_in']}->{c['sizes']['d_out']}" for c in cases]
    text = "; ".join(
        f"{shape}: (W @ X.T) / (X @ W.T) = {r:.2f}x, with the copy back to (N, out) {b:.2f}x"
        for shape, r, b in zip(shapes, raw, back, strict=True)
    )
    return verdict, text


def verdict_merge_copy(cases: list[dict]) -> tuple[str, str]:
    """Claim 9 for one library: reshape against contiguous + view, and both against a true view."""
    same = _ratio(cases[0], "reshape", "contiguous_then_view")
    copy_cost = _ratio(cases[0], "contiguous_then_view", "view_no_copy")
    # The same speed confirms the claim when both pay for a real copy (at least twice a true view's time).
    verdict = (CONFIRMED if copy_cost >= 2.0 else PARTLY) if 1 / SAME <= same <= SAME else REFUTED
    text = (
        f"reshape / (contiguous + view) = {same:.2f}x; (contiguous + view) / view of contiguous data = "
        f"{copy_cost:.1f}x, i.e. both spellings pay for the same copy"
    )
    return verdict, text


def verdict_einsum(cases: list[dict]) -> tuple[str, str]:
    """Claim 11 for one library: each einsum spelling against transpose + matmul."""
    names = cases[0]["median_s"]
    ratios = {name: _ratio(cases[0], name, "transpose_matmul") for name in names if name.startswith("einsum")}
    fast = [name for name, r in ratios.items() if r < SAME]
    verdict = CONFIRMED if len(fast) == len(ratios) else REFUTED if not fast else PARTLY
    text = ", ".join(f"{name} / (transpose + matmul) = {r:.2f}x" for name, r in ratios.items())
    return verdict, text


VERDICTS = {
    "heads": verdict_heads,
    "linear_layout": verdict_linear_layout,
    "merge_copy": verdict_merge_copy,
    "einsum": verdict_einsum,
}


def answer_question(claim: int, measurements: list[dict]) -> dict:
    """Turn the measurements of one claim (one per library/device) into its answer dict."""
    question = QUESTIONS[claim]
    sentences = []
    for measurement in measurements:
        where = f"{measurement['library']}/{measurement['device']}"
        if measurement.get("status") != "ok":
            measurement["verdict"] = SKIPPED
            sentences.append(f"{where}: not measured ({measurement.get('error', measurement.get('status'))})")
            continue
        verdict, text = VERDICTS[question["name"]](measurement["cases"])
        measurement["verdict"] = verdict
        util = measurement.get("cpu_util")
        sentences.append(f"{where}: {text} [{verdict}{f', {util:.2f} cores' if util is not None else ''}]")
    return {
        "claim": claim,
        "title": question["title"],
        "verdict": _combine([measurement["verdict"] for measurement in measurements]),
        "evidence": ". ".join(sentences) + ".",
        "measurements": measurements,
    }


# -- the parent ---------------------------------------------------------------------------------


def question_targets() -> list[tuple[str, str]]:
    """(library, device) pairs to measure: each library with kernels here (`microbench.BUILDERS`: NumPy, PyTorch)
    that is installed, on the CPU, and on the GPU too where the framework layer says it drives one and a GPU is
    present."""
    from mha_rosetta.backends.frameworks import get_framework

    from .microbench import BUILDERS
    from .sweep import default_devices  # here, not at the top: the measured children must not import NumPy early

    targets = []
    for library in dict.fromkeys(library for _claim, library in BUILDERS):
        if importlib.util.find_spec(library) is None:
            continue
        targets.append((library, "cpu"))
        # The sweep's test for a GPU: the driver's device nodes, no framework imported.
        if get_framework(library).drives_gpu and "gpu" in default_devices():
            targets.append((library, "gpu"))
    return targets


def run_speed_questions(
    threads: int = 1,
    quick: bool = True,
    *,
    claims: list[int] | None = None,
    cpus: list[int] | None = None,
    targets: list[tuple[str, str]] | None = None,
    timeout: float = 300.0,
) -> list[dict]:
    """Measure the column/row-sample article's speed claims (3, 7, 9, 11) and return one answer dict per claim.

    ``threads`` cores for every child (pinned to ``cpus``, default the last ``threads`` cores),
    ``quick`` for small sizes and short budgets, ``claims`` to run a subset, ``targets`` to
    choose (library, device) pairs (default `question_targets`). See the module docstring.
    """
    chosen = sorted(QUESTIONS) if claims is None else list(claims)
    unknown = [claim for claim in chosen if claim not in QUESTIONS]
    if unknown:
        raise ValueError(f"claims {unknown} have no speed question; the speed claims are {sorted(QUESTIONS)}")
    cpus = choose_cpus(threads, cpus)
    targets = question_targets() if targets is None else targets
    answers = []
    for claim in chosen:
        question = QUESTIONS[claim]
        measurements = []
        for library, device in targets:
            spec = {
                "question": question["name"], "library": library, "device": device, "threads": threads, "cpus": cpus,
                "cases": question["quick" if quick else "full"], "policy": QUICK_POLICY if quick else FULL_POLICY,
            }  # fmt: skip
            result = run_fresh("mha_rosetta.benchmarks.questions", spec, threads=threads, timeout=timeout)
            measurements.append({"library": library, "device": device, "threads": threads, **result})
        answers.append(answer_question(claim, measurements))
    return answers


def questions_markdown(answers: list[dict]) -> str:
    """The answers as a Markdown table (claim, verdict, evidence)."""
    from mha_rosetta.core.tables import markdown_table

    rows = [[answer["claim"], answer["title"], f"**{answer['verdict']}**", answer["evidence"]] for answer in answers]
    return "\n".join(markdown_table(["claim", "question", "verdict", "evidence"], rows)) + "\n"


if __name__ == "__main__":
    sys.exit(main())
