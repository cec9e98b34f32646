"""Results that travel: provenance for every JSON the tool writes, and one report across runs.

- `provenance`: who, where and from what a result came (standard library only; it never
  imports a framework, it reads versions from the installed packages' metadata).
- `runs`: check, bench and explain JSON files loaded into one shape, old files (no provenance) included.
- `compare`: one comparison of the bench runs (ratios, spread, "within noise") and the
  regression gate against a baseline; its docstring states the rules.
- `agreement`: the check's matrices read back cell by cell (worst case, first divergent stage).
- `build`: `build_report(files, baseline=..., threshold_pct=...)`, the one entry point.
- `markdown` and `html`: the renderings; the HTML page is one self-contained file.

Nothing here imports a framework (tests/test_provenance.py proves it in a fresh interpreter).
"""
