"""mha_rosetta.benchmarks: fair timings across frameworks, and the column/row-sample article's speed claims measured.

Modules, one job each (none imports a framework at import time):

- `pinning`: thread environment, CPU affinity, runtime knobs, and the CPU-time check;
- `fresh`: run one measurement in a fresh pinned process and read its JSON back;
- `timing`: warm-up, adaptive repeats, median / IQR / min;
- `flops`: the matmul FLOP count (formula in its docstring);
- `cell`: one measured cell (``python -m mha_rosetta.benchmarks.cell '<json>'``);
- `gemm`: the GEMM peak, same dtype, device and threads, best installed library;
- `bandwidth`: the copy bandwidth, measured like the GEMM peak, and the limit of a decode step;
- `decode`: ``bench --mode decode``'s cell, one KV-cache decode step per context (``python -m mha_rosetta.benchmarks.decode``);
  `decode_settings`: its settings; `decode_rows`: the cells they expand to; `decode_sweep`: its rounds, resume and
  report; `decode_docs`: its published files and README block;
- `presets`: the named presets (the choices of ``bench --preset``);
- `plan`: implementation names and groups, resolved from the registry;
- `sweep`: the sweep: settings, cells, rounds and resume;
- `partial`: the partial file of finished visits; `progress`: the estimate and the progress bar;
- `rounds`: the shuffled visit order, and a cell's figures merged over rounds (spread, drift);
- `report`: the versioned JSON document and the machine it ran on; `correction`: the drift correction of its cells;
- `provenance`: where a result came from (every JSON the tool writes carries it);
- `markdown`, `plots`, `baseline`: the report as a table, as PNG plots, and against a saved one;
- `rerun`: do two runs agree (``bench --compare A.json B.json``)?
- `verdict`: the one rule that compares two runs (which cell is which, its figure and range, slower or not),
  read by ``--baseline``, ``--compare`` and ``report --fail-on-regression``;
- `readme`: the generated benchmark block of docs/benchmarks.md; `publish`: the published docs/bench/ files
  (`publish.write_docs`) and the page's block written;
- `microbench` / `questions`: the column/row-sample article's speed claims as benchmark questions.

The command line is ``mha-rosetta bench`` (`mha_rosetta.cli.bench`). From Python::

    from mha_rosetta.benchmarks import run_speed_questions
    answers = run_speed_questions(threads=1, quick=True)   # list of {"claim", "title", "verdict", "evidence", ...}
"""

from .questions import run_speed_questions

__all__ = ["run_speed_questions"]
