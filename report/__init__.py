"""Results that travel: one report across runs (the provenance every JSON carries is `benchmarks.provenance`).

`report` sits above `benchmarks`: it reads bench files through `benchmarks` (upgrades, the comparison
rule of `benchmarks.verdict`), and `benchmarks` never imports `report`.

- `runs`: check, bench and explain JSON files loaded into one shape, old files (no provenance) included.
- `compare`: one comparison of the bench runs (ratios, spread, "within noise") and the
  regression gate against a baseline; its docstring states the rules (those of `benchmarks.verdict`).
- `agreement`: the check's matrices read back cell by cell (worst case, first divergent stage).
- `build`: `build_report(files, baseline=..., threshold_pct=...)`, the one entry point.
- `markdown` and `html`: the renderings; the HTML page is one self-contained file.

Nothing here imports a framework (tests/test_provenance.py proves it in a fresh interpreter).
"""
