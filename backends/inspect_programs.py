"""What a prepared program moves and allocates, asked of each framework in its own terms (``bench --breakdown``).

* JAX: the compiled HLO. XLA writes every program it compiles in this process to a directory when
  ``XLA_FLAGS`` holds `xla_dump_flags` (set before JAX starts: the breakdown's child gets it in its
  environment), so the programs an adapter compiles are read without the adapter's help. `hlo_moves`
  names each ``copy`` and ``transpose`` instruction, and each fusion whose root is one, with its shape
  and bytes; the modules compiled by a second call of the same program are its recompiles.
* torch: ``torch.profiler`` with ``profile_memory``: every operator that kept memory it allocated
  (``self_cpu_memory_usage`` > 0, or the CUDA figure on a GPU), with its input shapes and bytes.
* NumPy: NumPy reports its buffers to ``tracemalloc``: the peak of one call above what was held before
  (its temporaries and its output), and, of a forward, whether each stage tensor is a view or a copy
  (the adapter measured it: `StageTensor.relation`).

Which allocations grow with the context: the breakdown asks twice, at the cell's context and at half
of it (`grows_with_context`). Nothing here imports a framework at module import.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

MOVE_OPCODES = ("copy", "transpose")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_ITEMSIZE.update({"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16})
# `%name = f32[2,3]{1,0} opcode(...)`; a tuple-shaped result (`(f32[..], ..)`) does not match: it moves nothing itself.
_INSTRUCTION = re.compile(
    r"^\s*(ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<type>\w+)\[(?P<dims>[\d,]*)\](?:\{[^}]*\})? (?P<op>[\w\-]+)\("
)
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY )?%(?P<name>[\w.\-]+) \(.*\{\s*$")
_CALLS = re.compile(r"calls=%(?P<callee>[\w.\-]+)")


def hlo_moves(text: str) -> list[dict]:
    """Every ``copy``/``transpose`` of a compiled HLO module's text, and every fusion whose root is one.

    Each: ``{"instruction", "opcode"`` (for a fusion: ``"fusion(copy)"``), ``"shape"``, ``"dtype"``, ``"bytes"}``
    (the bytes written: the result's), in program order. Instructions inside a fusion's body are not listed
    apart: XLA runs the fusion as one kernel, which the fusion's own line stands for.
    """
    roots: dict[str, str] = {}  # computation -> its root's opcode
    lines_of: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header["name"]
            lines_of[current] = []
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        lines_of[current].append(line)
        found = _INSTRUCTION.match(line)
        if found and found.group(1):
            roots[current] = found["op"]
    called = {match["callee"] for lines in lines_of.values() for line in lines for match in _CALLS.finditer(line)}
    moves = []
    for computation, lines in lines_of.items():
        if computation in called:
            continue  # a fusion's (or a call's) body: its caller's line is listed
        for line in lines:
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            opcode = found["op"]
            if opcode == "fusion":
                callee = _CALLS.search(line)
                root = roots.get(callee["callee"]) if callee else None
                if root not in MOVE_OPCODES:
                    continue
                opcode = f"fusion({root})"
            elif opcode not in MOVE_OPCODES:
                continue
            shape = [int(d) for d in found["dims"].split(",") if d]
            count = 1
            for dim in shape:
                count *= dim
            moves.append(
                {
                    "instruction": found["name"],
                    "opcode": opcode,
                    "shape": shape,
                    "dtype": found["type"],
                    "bytes": count * _ITEMSIZE.get(found["type"], 0),
                }
            )
    return moves


def xla_dump_flags(directory: str | Path) -> str:
    """The ``XLA_FLAGS`` that make XLA write each compiled module's optimized HLO text to ``directory``."""
    return f"--xla_dump_to={directory} --xla_dump_hlo_as_text"


def dumped_modules(directory: str | Path) -> dict[str, str]:
    """``{module file stem: optimized HLO text}`` of every module XLA dumped to ``directory`` so far."""
    suffix = ".cpu_after_optimizations.txt", ".gpu_after_optimizations.txt", ".after_optimizations.txt"
    found = {}
    for path in sorted(Path(directory).glob("*after_optimizations.txt")):
        name = path.name
        for ending in suffix:
            if name.endswith(ending):
                found[name[: -len(ending)]] = path.read_text()
                break
    return found


def module_moves(modules: dict[str, str]) -> list[dict]:
    """`hlo_moves` of each dumped module: ``[{"module", "moves", "bytes"}]``, every module listed (none moving:
    empty ``moves``)."""
    listed = []
    for module, text in modules.items():
        moves = hlo_moves(text)
        listed.append({"module": module, "moves": moves, "bytes": sum(move["bytes"] for move in moves)})
    return listed


def torch_allocations(call: Callable[[], object], device: str = "cpu") -> list[dict]:
    """The operators of one ``call()`` that kept memory they allocated (torch.profiler, ``profile_memory``):
    ``[{"op", "input_shapes", "bytes"}]`` in call order (the same operator twice: two entries)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "gpu" else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
        call()
    kept = []
    for event in prof.events():
        size = event.self_device_memory_usage if device == "gpu" else event.self_cpu_memory_usage
        if event.name.startswith("[memory]") or size <= 0:
            continue
        kept.append({"op": event.name, "input_shapes": [list(shape) for shape in event.input_shapes], "bytes": size})
    return kept


def torch_operator_times(call: Callable[[], object], calls: int = 10, device: str = "cpu") -> list[dict]:
    """Where ``calls`` calls of ``call()`` spend their time by torch's own profiler: each operator's self time
    per call (``[{"op", "calls", "self_s"}]``, the largest first), what a fused kernel's time is seen by."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "gpu" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
    rows = [
        {"op": entry.key, "calls": entry.count / calls, "self_s": entry.self_cpu_time_total / 1e6 / calls}
        for entry in prof.key_averages()
        if entry.self_cpu_time_total > 0
    ]
    return sorted(rows, key=lambda row: -row["self_s"])


def traced_peak_bytes(call: Callable[[], object]) -> int:
    """The peak of traced memory (NumPy reports its buffers to ``tracemalloc``) during one ``call()``, above
    what was held before it: its temporaries and its result."""
    import tracemalloc

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = call()
        _, peak = tracemalloc.get_traced_memory()
        del result
    finally:
        if started:
            tracemalloc.stop()
    return max(0, peak - before)


def grows_with_context(at_context: list[dict], at_half: list[dict], key: str = "op") -> list[dict]:
    """The entries of ``at_context`` (allocations at a context C, in call order) marked ``"grows"``: True where
    the same entry at C/2 (the same ``key`` and occurrence) had at most 3/4 of the bytes, as something
    proportional to the context has (a context-free allocation keeps its size); None when it has no match."""
    seen: dict[str, int] = {}
    halves: dict[tuple[str, int], int] = {}
    for entry in at_half:
        count = seen.get(entry[key], 0)
        halves[(entry[key], count)] = entry["bytes"]
        seen[entry[key]] = count + 1
    seen.clear()
    marked = []
    for entry in at_context:
        count = seen.get(entry[key], 0)
        seen[entry[key]] = count + 1
        half = halves.get((entry[key], count))
        marked.append({**entry, "grows": None if half is None else half <= 0.75 * entry["bytes"]})
    return marked
