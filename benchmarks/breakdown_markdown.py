"""The Markdown of a ``bench --breakdown`` report (`breakdown.run_breakdown`): per cell, its stage times and
what its program copies, transposes, allocates and recompiles. Plain data in, text out."""

from __future__ import annotations

_MIB = 1024 * 1024


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.4g}"


def _size(count: int) -> str:
    return f"{count / _MIB:.3g} MiB" if count >= _MIB else f"{count / 1024:.3g} KiB" if count >= 1024 else f"{count} B"


def _title(cell: dict) -> str:
    if cell.get("kind") == "decode":
        size = f"context {cell['context']}, step {cell['step']}, B={cell['batch']}, D={cell['d_model']}, "
        size += f"H={cell['heads']}, Hkv={cell['kv_heads']}, d_k={cell['d_k']}"
        what = f"decode step ({cell.get('cache') or 'default'} cache)"
    else:
        size = f"B={cell['batch']}, N={cell['tokens']}, D={cell['d_model']}, H={cell['heads']}"
        what = "forward"
    return (
        f"### {cell['implementation']}: {what}, {size}, {cell['dtype']}, {cell['device']}, {cell['threads']} thread(s)"
    )


def _stage_table(cell: dict) -> list[str]:
    whole = cell["whole"]["median_s"]
    lines = [
        f"Stages ({cell['method']}; each the median of the round-by-round differences of consecutive cuts, "
        "not clamped):",
        "",
        "| stage | ms | q25..q75 ms | of the whole | the cut had reached |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for row in cell["stages"]:
        flag = " (noisy)" if row["noisy"] else ""
        share = f"{row['median_s'] / whole:.0%}" if whole > 0 else "—"
        span = f"{_ms(row['q25_s'])}..{_ms(row['q75_s'])}"
        lines.append(f"| {row['stage']} | {_ms(row['median_s'])}{flag} | {span} | {share} | {row['reached'][-1]} |")
    last = cell["stages"][-1]["cut_median_s"] if cell["stages"] else None
    lines += [
        "",
        f"Whole program, untouched: {_ms(whole)} ms (IQR {_ms(cell['whole']['iqr_s'])}); the last cut: {_ms(last)} ms; "
        f"the empty cut (the cuts' fixed cost, taken off the first stage): {_ms(cell['empty_cut']['median_s'])} ms.",
    ]
    return lines


def _jax_lines(found: dict) -> list[str]:
    modules = found.get("modules", [])
    moving = [module for module in modules if module["moves"]]
    lines = [
        f"XLA compiled {len(modules)} module(s) for this cell; recompiles on a second call: "
        f"{len(found.get('recompiles', []))}"
        + (f" ({', '.join(found['recompiles'])})" if found.get("recompiles") else "")
        + f"; copies and transposes in {len(moving)} of them:"
    ]
    if not moving:
        return [*lines[:1], "", "No `copy` or `transpose` in any compiled module."]
    lines += ["", "| module | instruction | op | shape | bytes |", "| --- | --- | --- | --- | ---: |"]
    for module in moving:
        for move in module["moves"]:
            shape = f"{move['dtype']}{move['shape']}"
            lines.append(
                f"| {module['module']} | {move['instruction']} | {move['opcode']} | {shape} | {_size(move['bytes'])} |"
            )
    return lines


def _torch_lines(found: dict) -> list[str]:
    allocations = found.get("allocations", [])
    total = sum(entry["bytes"] for entry in allocations)
    lines = [f"torch.profiler (profile_memory): {len(allocations)} operator(s) kept memory, {_size(total)} in all."]
    lines += _copy_lines(found)
    if "half_context" in found:
        grows = [entry for entry in allocations if entry.get("grows")]
        lines[0] += f" Grows with the context (against context {found['half_context']}): {len(grows)}."
    operators = found.get("operators", [])
    if operators:
        lines += ["", "Operators by self time per call (torch.profiler over 10 calls, its own overhead included):", ""]
        lines += ["| op | calls per call | self ms per call |", "| --- | ---: | ---: |"]
        lines += [f"| {row['op']} | {row['calls']:.3g} | {_ms(row['self_s'])} |" for row in operators[:12]]
    if not allocations:
        return lines
    lines += ["", "| op | input shapes | bytes | grows with the context |", "| --- | --- | ---: | --- |"]
    for entry in sorted(allocations, key=lambda entry: -entry["bytes"])[:20]:
        grows = {True: "yes", False: "no", None: "—"}[entry.get("grows")]
        shapes = ", ".join(str(shape) for shape in entry["input_shapes"] if shape) or "—"
        lines.append(f"| {entry['op']} | {shapes} | {_size(entry['bytes'])} | {grows} |")
    if len(allocations) > 20:
        lines.append(f"| … {len(allocations) - 20} smaller | | | |")
    return lines


def _numpy_lines(found: dict) -> list[str]:
    lines = [f"Peak traced memory of one call above what it held (tracemalloc): {_size(found.get('peak_bytes', 0))}"]
    if "peak_bytes_half" in found:
        ratio = found["peak_ratio"]
        growth = "" if ratio is None else f" (x{ratio:.2f} from half the context to the whole; x2 if all of it grew)"
        lines[0] += f"; at context {found['half_context']}: {_size(found['peak_bytes_half'])}{growth}"
    lines[0] += "."
    return lines + _copy_lines(found)


def _copy_lines(found: dict) -> list[str]:
    """The stage tensors the adapter made as copies of their parent (NumPy, torch: measured by the adapter)."""
    copies = found.get("stage_copies")
    if copies is None:
        return []
    named = ", ".join(f"{copy['stage']} from {copy['from']} ({_size(copy['bytes'])})" for copy in copies)
    return ["", f"Stage tensors made as copies of their parent: {named or 'none (every reshape a view)'}."]


def cell_markdown(cell: dict) -> str:
    lines = [_title(cell), ""]
    if cell.get("status") != "ok":
        return "\n".join([*lines, f"{cell.get('status')}: {cell.get('error', '')}", ""])
    if cell.get("stages") is not None:
        lines += _stage_table(cell)
    else:
        whole = cell["whole"]
        lines.append(f"Whole program: {_ms(whole['median_s'])} ms (IQR {_ms(whole['iqr_s'])}); no stage times: "
                     f"{cell['no_stages']}.")  # fmt: skip
    found = cell.get("inspection", {})
    if found.get("error"):
        return "\n".join([*lines, "", f"Not inspected: {found['error']}.", ""])
    render = {"jax": _jax_lines, "torch": _torch_lines}.get(found.get("framework"), _numpy_lines)
    lines += ["", *render(found), ""]
    return "\n".join(lines)


def breakdown_markdown(report: dict) -> str:
    """Every cell of a breakdown report, one section each."""
    return "\n".join(cell_markdown(cell) for cell in report["cells"])
