"""The ``long`` preset's pieces: memory predictions and a budget, and log-log slopes.

At long context the question is memory as much as time. A materialising implementation
holds the ``(B, H, Nq, Nk)`` scores (2 GiB per copy at 8k tokens, 8 heads, float32), so a
sweep over 1k ... 32k tokens would push such cells into swap on a shared machine. Before a
cell runs, `predicted_peak_mb` estimates its peak from the sizes alone; a cell whose
prediction exceeds the budget (`memory_budget_mb`) is not run but recorded as skipped, with
the prediction as the reason. The prediction is deliberately generous (several copies of
the scores for the implementations that build them): a skipped cell costs nothing, a
cell in swap costs the machine.

After the sweep, `fitted_slopes` fits ``log(y) = a + slope * log(tokens)`` per
implementation for the time and for the peak memory: about 2 for materialising memory,
about 1 for memory-linear memory, and between 1 and 2 for time (the projections are
linear, the scores quadratic). Each slope is fitted twice: over every measured size, and
over the three largest ("tail"), where the leading term dominates. A constant part (the
framework's caches and compiled code, tens of MiB) flattens the all-sizes memory slope of
a memory-linear implementation well below 1 at 1k tokens; the tail slope shows its growth.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

from mha_rosetta.core.tables import markdown_table as table_lines

from .memory import proc_mb
from .rounds import cell_time, published

# How much of the (B, H, Nq, Nk) scores an implementation holds at once: its memory kind.
LINEAR, ONE_HEAD, ALL_HEADS = "memory-linear", "one head at a time", "materialising"
# Never the (Nq, Nk) scores: the chunked strategies; torch's SDPA, whose CPU kernel is a
# flash-attention loop for unmasked float inputs; and nn.MultiheadAttention with
# batch_first=False, whose need_weights=False call goes through F.multi_head_attention_forward
# to that SDPA kernel. With batch_first=True the same module takes the fused fast path, which
# holds the scores: measured at 8k tokens (docs/bench/long), 142 MiB against 2,210 MiB.
MEMORY_LINEAR_STRATEGIES = ("chunked",)
MEMORY_LINEAR_BACKENDS = ("torch-sdpa", "torch-mha-seqfirst")
# The column/row-sample article's per-head strategies in NumPy loop over the heads and hold one
# head's (Nq, Nk) scores at a time, 1/H of the whole (measured at 8k tokens: 331 and 347 MiB
# against 2,151 MiB for the batched standard strategy); torch's build every head's at once.
ONE_HEAD_IMPLEMENTATIONS = ("numpy:per_head", "numpy:slicing")
# Copies of the score tensor an implementation may hold at once (scores, masked scores or
# exp, weights; XLA and the oracles' own temporaries): generous on purpose.
SCORE_COPIES = 3
# Copies of a (B, N, D)-sized tensor any implementation holds: inputs, q, k, v, their head
# splits, context, merged, output, and the framework's conversions.
LINEAR_COPIES = 16
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
# Leave this much of the available memory to everyone else on the machine.
BUDGET_FRACTION = 0.5
BUDGET_CAP_MB = 8192.0


def memory_kind(implementation: str) -> str:
    """`LINEAR`, `ONE_HEAD` or `ALL_HEADS`: how much of the scores ``implementation`` holds at once."""
    backend, _, strategy = implementation.partition(":")
    if strategy in MEMORY_LINEAR_STRATEGIES or (backend in MEMORY_LINEAR_BACKENDS and not strategy):
        return LINEAR
    return ONE_HEAD if implementation in ONE_HEAD_IMPLEMENTATIONS else ALL_HEADS


def is_memory_linear(implementation: str) -> bool:
    return memory_kind(implementation) == LINEAR


def predicted_peak_mb(
    implementation: str, batch: int, tokens: int, d_model: int, heads: int, dtype: str = "float32"
) -> float:
    """A generous estimate of a self-attention cell's peak memory, in MiB."""
    item = ITEMSIZE.get(dtype, 4)
    linear = LINEAR_COPIES * batch * tokens * d_model * item
    kind = memory_kind(implementation)
    held_heads = {LINEAR: 0, ONE_HEAD: 1, ALL_HEADS: heads}[kind]
    # Half-precision runs compute the softmax in float32 somewhere in every implementation.
    quadratic = SCORE_COPIES * batch * held_heads * tokens * tokens * max(item, 4)
    return (linear + quadratic) / 2**20


def available_memory_mb() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), in MiB; None elsewhere."""
    return proc_mb("/proc/meminfo", "MemAvailable")


def memory_budget_mb(explicit: float | None = None) -> float:
    """The largest predicted peak a cell may have: ``explicit``, or half the available memory up to 8 GiB."""
    if explicit is not None:
        if not (isinstance(explicit, (int, float)) and explicit > 0 and math.isfinite(explicit)):
            raise ValueError(f"memory budget must be a positive number of MiB, got {explicit!r}")
        return float(explicit)
    env = os.environ.get("MHA_ROSETTA_MEMORY_BUDGET_MB")
    if env:
        return memory_budget_mb(float(env))
    available = available_memory_mb()
    return BUDGET_CAP_MB if available is None else min(BUDGET_CAP_MB, BUDGET_FRACTION * available)


def over_budget_reason(
    implementation: str, batch: int, tokens: int, d_model: int, heads: int, dtype: str, budget_mb: float
) -> str | None:
    """Why a cell is skipped (its prediction and the budget), or None when it fits."""
    predicted = predicted_peak_mb(implementation, batch, tokens, d_model, heads, dtype)
    if predicted <= budget_mb:
        return None
    kind = {
        LINEAR: "memory-linear",
        ONE_HEAD: f"{SCORE_COPIES} copies of one head's (B, N, N) scores",
        ALL_HEADS: f"{SCORE_COPIES} copies of the (B, H, N, N) scores",
    }[memory_kind(implementation)]
    return (
        f"skipped: predicted peak {predicted:,.0f} MiB ({kind} plus inputs) exceeds the memory budget of "
        f"{budget_mb:,.0f} MiB; never run into swap"
    )


def fit_slope(xs, ys) -> float | None:
    """Least-squares slope of log(y) against log(x); None with fewer than two usable points."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x and y and x > 0 and y > 0]
    if len(points) < 2:
        return None
    mean_x = sum(p[0] for p in points) / len(points)
    mean_y = sum(p[1] for p in points) / len(points)
    denominator = sum((p[0] - mean_x) ** 2 for p in points)
    if denominator == 0:
        return None
    return sum((p[0] - mean_x) * (p[1] - mean_y) for p in points) / denominator


TAIL_POINTS = 3  # the tail slopes are fitted over this many of the largest sizes


def fitted_slopes(cells: list[dict]) -> dict[str, dict]:
    """Per implementation: the log-log slopes of median time and of peak memory against tokens,
    over every size and over the `TAIL_POINTS` largest."""
    series: dict[str, list[dict]] = defaultdict(list)
    for cell in cells:
        if cell.get("status") == "ok":
            series[cell["implementation"]].append(cell)
    slopes = {}
    for name, points in series.items():
        points.sort(key=lambda cell: cell["tokens"])
        tokens = [cell["tokens"] for cell in points]
        times = [cell_time(cell) for cell in points]  # drift-corrected where the cell has it
        memory = [cell.get("peak_mem_mb") for cell in points]
        tail = slice(-TAIL_POINTS, None)
        slopes[name] = {
            "tokens": tokens,
            "time_slope": fit_slope(tokens, times),
            "memory_slope": fit_slope(tokens, memory),
            "time_tail_slope": fit_slope(tokens[tail], times[tail]) if len(tokens) > TAIL_POINTS else None,
            "memory_tail_slope": fit_slope(tokens[tail], memory[tail]) if len(tokens) > TAIL_POINTS else None,
            "memory_linear": is_memory_linear(name),
            "memory_kind": memory_kind(name),
        }
    return slopes


def slopes_markdown(slopes: dict[str, dict]) -> str:
    def fmt(value):
        return "n/a" if value is None else f"{value:.2f}"

    columns = ["implementation", "kind", "tokens", "time slope", f"time slope, {TAIL_POINTS} largest"]
    columns += ["peak-memory slope", f"peak-memory slope, {TAIL_POINTS} largest"]
    rows = []
    for name, s in sorted(slopes.items()):
        span = f"{s['tokens'][0]}..{s['tokens'][-1]}" if s["tokens"] else ""
        figures = [fmt(s.get(key)) for key in ("time_slope", "time_tail_slope", "memory_slope", "memory_tail_slope")]
        rows.append([f"`{name}`", s.get("memory_kind") or memory_kind(name), span, *figures])
    return "\n".join(table_lines(columns, rows)) + "\n"


def plot_long(cells: list[dict], directory, slopes: dict[str, dict] | None = None) -> list:
    """Two log-log plots, time and peak memory against tokens, each line labelled with its slope."""
    from .plots import pyplot_into, save_figure

    plt, directory = pyplot_into(directory)
    slopes = fitted_slopes(cells) if slopes is None else slopes
    written = []
    for field, slope_key, label, name in (
        ("median_s", "time_slope", "median time (s)", "long_time_vs_tokens.png"),
        ("peak_mem_mb", "memory_slope", "peak memory (MiB)", "long_memory_vs_tokens.png"),
    ):
        figure, axes = plt.subplots(figsize=(11, 5))
        for implementation, s in sorted(slopes.items()):
            points = sorted(
                (c["tokens"], published(c, field))  # the drift-corrected time where the cell has it
                for c in cells
                if c.get("implementation") == implementation and c.get("status") == "ok" and published(c, field)
            )
            if not points:
                continue
            slope = s[slope_key]
            style = {LINEAR: "-", ONE_HEAD: ":", ALL_HEADS: "--"}[s.get("memory_kind") or memory_kind(implementation)]
            tag = "n/a" if slope is None else f"{slope:.2f}"
            axes.plot(*zip(*points, strict=True), style, marker="o", label=f"{implementation} (slope {tag})")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("tokens")
        axes.set_ylabel(label)
        axes.set_title(
            f"{label} against tokens\n(log-log; solid: memory-linear, dotted: one head at a time, dashed: all heads)"
        )
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the lines stay visible
        axes.grid(True, which="both", alpha=0.3)
        written.append(save_figure(plt, figure, directory / name))
    return written


def target_ratios(cells: list[dict]) -> dict:
    """The issue's two targets from one run: chunked peak memory at 8k over the materialising
    ones', and the best chunked time at 4k over torch SDPA's."""

    def ok(tokens):
        return {c["implementation"]: c for c in cells if c.get("status") == "ok" and c.get("tokens") == tokens}

    def peak_mb_at_8k(chosen):
        return {k: c["peak_mem_mb"] for k, c in ok(8192).items() if chosen(k) and c.get("peak_mem_mb")}

    at_4k = ok(4096)
    chunked_8k = peak_mb_at_8k(lambda k: k.endswith(":chunked"))
    material_8k = peak_mb_at_8k(lambda k: memory_kind(k) == ALL_HEADS)
    one_head_8k = peak_mb_at_8k(lambda k: memory_kind(k) == ONE_HEAD)
    chunked_4k = {k: cell_time(c) for k, c in at_4k.items() if k.endswith(":chunked")}
    sdpa_4k = cell_time(at_4k["torch-sdpa"]) if "torch-sdpa" in at_4k else None
    result: dict = {}
    if chunked_8k and material_8k:
        worst_chunked, best_material = max(chunked_8k.values()), min(material_8k.values())
        result["memory_8k"] = {
            "what": f"peak memory at 8k tokens, chunked {worst_chunked:.0f} MiB (worst) against "
            f"{best_material:.0f} MiB (best materialising)",
            "chunked_max_mb": worst_chunked,
            "materialising_min_mb": best_material,
            "ratio": worst_chunked / best_material,
            "target": "<= 0.1",
            "met": worst_chunked <= 0.1 * best_material,
            # Each chunked strategy against its own framework's standard (batched) strategy.
            "by_framework": {
                name: chunked_8k[name] / material_8k[name.split(":")[0]]
                for name in sorted(chunked_8k)
                if name.split(":")[0] in material_8k
            },
        }
    if chunked_8k and one_head_8k:
        worst_chunked, best_one_head = max(chunked_8k.values()), min(one_head_8k.values())
        result["memory_8k_one_head"] = {
            "what": f"peak memory at 8k tokens, chunked {worst_chunked:.0f} MiB (worst) against "
            f"{best_one_head:.0f} MiB (best of those holding one head's scores at a time: {', '.join(sorted(one_head_8k))})",
            "ratio": worst_chunked / best_one_head,
            "target": None,  # the target is against the materialising ones; this is for information
            "met": None,
        }
    if chunked_4k and sdpa_4k:
        best = min(chunked_4k, key=chunked_4k.get)
        ratio = chunked_4k[best] / sdpa_4k
        result["time_4k"] = {
            "what": f"time at 4k tokens, {best} {chunked_4k[best] * 1e3:.1f} ms against torch SDPA "
            f"{sdpa_4k * 1e3:.1f} ms (one core)",
            "best_chunked": best,
            "chunked_s": chunked_4k[best],
            "torch_sdpa_s": sdpa_4k,
            "ratio": ratio,
            "target": "<= 1.25",
            "met": ratio <= 1.25,
        }
    return result


def long_markdown(cells: list[dict]) -> str:
    """The fitted slopes and, where the sizes were measured, the issue's two targets with their ratios."""
    text = (
        "Log-log slopes against tokens (memory: about 2 materialising, about 1 memory-linear; the kinds are "
        "declared in `benchmarks/long.py` and the slopes check them):\n\n"
    )
    text += slopes_markdown(fitted_slopes(cells))
    targets = target_ratios(cells)
    for t in targets.values():
        if t["target"] is None:
            text += f"\nFor comparison, {t['what']}: ratio {t['ratio']:.3g}\n"
            continue
        verdict = "met" if t["met"] else "missed"
        text += f"\nTarget, {t['what']}: ratio {t['ratio']:.3g}, target {t['target']}: {verdict}\n"
        if t.get("by_framework"):
            pairs = ", ".join(f"`{name}` {ratio:.3g}" for name, ratio in t["by_framework"].items())
            text += f"Each chunked strategy over its own framework's standard one: {pairs}\n"
    return text
