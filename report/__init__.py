"""Results that travel: provenance for every JSON the tool writes, and one report across runs.

- `provenance`: who, where and from what a result came (standard library only; it never
  imports a framework, it reads versions from the installed packages' metadata).
- `runs`: check and bench JSON files loaded into one shape, old files (no provenance) included.
- `compare`: one comparison of the bench runs (ratios, spread, "within noise") and the
  regression gate against a baseline.
- `markdown` and `html`: the two renderings; the HTML page is one self-contained file.
"""
