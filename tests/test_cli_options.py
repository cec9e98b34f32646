"""One option vocabulary across the subcommands (`cli.options`): new and old spellings give the same
settings, commas and repeats combine, and ``--markdown`` takes an optional PATH (bare or ``-``: stdout)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import run_cli
from mha_rosetta.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]

PARSER = build_parser()


def untimed(text: str) -> str:
    """The check's report without its measured seconds (they differ from run to run)."""
    return re.sub(r"\d+(\.\d+)? s\b", "T s", text)


def parse(*argv: str):
    return PARSER.parse_args(list(argv))


@pytest.mark.parametrize("command", ["check", "bench", "explain"])
def test_backends_take_commas_and_repeats_combined(command):
    args = parse(command, "--backends", "numpy,torch", "--backends", "jax", "--backends", " einops , ")
    assert args.backends == ["numpy", "torch", "jax", "einops"]
    assert parse(command).backends is None  # not given: the subcommand's default


@pytest.mark.parametrize("command", ["check", "bench"])
@pytest.mark.parametrize("option", ["--devices", "--dtypes"])
def test_devices_and_dtypes_take_commas_and_repeats(command, option):
    dest = option.lstrip("-")
    assert getattr(parse(command, option, "a,b", option, "c"), dest) == ["a", "b", "c"]
    assert getattr(parse(command, f"{option}=a", option, "b,c"), dest) == ["a", "b", "c"]


def test_bench_old_spelling_implementations_is_backends():
    new = parse("bench", "--backends", "numpy,numpy:slicing", "--backends", "torch-sdpa")
    old = parse("bench", "--implementations", "numpy,numpy:slicing", "--implementations", "torch-sdpa")
    assert vars(new) == vars(old)
    mixed = parse("bench", "--implementations", "numpy", "--backends", "torch")
    assert mixed.backends == ["numpy", "torch"]
    assert not hasattr(old, "implementations")  # one destination: nothing downstream reads two names


def test_bench_settings_are_the_same_for_both_spellings():
    from mha_rosetta.cli.bench import _settings

    new = _settings(parse("bench", "--quick", "--backends", "numpy,numpy:slicing", "--dtypes", "float32"))
    old = _settings(parse("bench", "--quick", "--implementations", "numpy", "--implementations", "numpy:slicing"))
    assert new.implementations == old.implementations == ["numpy", "numpy:slicing"]


def test_help_marks_the_old_spelling(capsys):
    with pytest.raises(SystemExit):
        parse("bench", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--implementations LIST deprecated: use --backends" in text
    assert (
        "--quick deprecated: use --preset quick" in text and "--plugin MODULE:CLASS deprecated: use --backend" in text
    )
    assert "--mode {fwd,grad,both,decode}" in text and "fwdbwd: deprecated: use grad" in text
    with pytest.raises(SystemExit):
        parse("explain", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "--markdown [PATH]" in text and "the flag alone: deprecated: use --markdown -" in text
    assert "--backward deprecated: use --grad" in text


def test_every_old_spelling_is_listed_with_its_new_one():
    from mha_rosetta.cli.options import BARE, deprecated_spellings

    assert sorted(deprecated_spellings(PARSER)) == sorted(
        [
            ("bench", "--implementations", None, "--backends"),
            ("bench", "--quick", None, "--preset quick"),
            ("bench", "--plugin", None, "--backend"),
            ("bench", "--mode", "fwdbwd", "--mode grad"),
            ("diagnose", "--dtype", None, "--dtypes"),
            ("explain", "--backward", None, "--grad"),
            *[(command, "--markdown", BARE, "--markdown -") for command in ("check", "bench", "explain")],
        ]
    )


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["bench", "--quick"], ["bench", "--preset", "quick"]),
        (["bench", "--mode", "decode", "--quick"], ["bench", "--mode", "decode", "--preset", "quick"]),
        (["bench", "--mode", "fwdbwd"], ["bench", "--mode", "grad"]),
        (["bench", "--plugin", "m:C", "--plugin", "n:D"], ["bench", "--backend", "m:C", "--backend", "n:D"]),
        (["explain", "--backward"], ["explain", "--grad"]),
        (["check", "--markdown"], ["check", "--markdown", "-"]),
    ],
)
def test_an_old_spelling_gives_what_the_new_one_gives(old, new):
    assert vars(parse(*old)) == vars(parse(*new))


def test_the_new_bench_spellings_reach_the_settings_the_old_ones_did():
    from mha_rosetta.cli.bench import _settings
    from mha_rosetta.cli.bench_decode import decode_settings_of as _decode_settings

    quick = _settings(parse("bench", "--preset", "quick", "--mode", "grad"))
    assert quick == _settings(parse("bench", "--quick", "--mode", "fwdbwd"))
    assert quick.modes == ["fwdbwd"] and quick.preset == "quick"  # the cells' and the JSON's name stays fwdbwd
    assert _settings(parse("bench", "--preset", "reference")).preset == "reference"
    decode = _decode_settings(parse("bench", "--mode", "decode", "--preset", "quick"))
    assert decode == _decode_settings(parse("bench", "--mode", "decode", "--quick")) and decode.preset == "decode-quick"
    with pytest.raises(SystemExit):
        parse("bench", "--quick", "--preset", "quick")  # one preset: still mutually exclusive


def test_the_readme_and_the_docs_print_no_old_spelling():
    import shlex

    from test_docs_commands import PAGES, printed_commands

    from mha_rosetta.cli.options import BARE, deprecated_spellings

    old = deprecated_spellings(PARSER)
    found = []
    for page in PAGES:
        for command in printed_commands(page.read_text(encoding="utf-8")):
            words = shlex.split(command)[1:]
            for sub, option, value, new in old:
                if words[0] != sub or option not in words:
                    continue
                given = words[words.index(option) + 1 :][:1]
                if value is None or (value == BARE and (not given or given[0].startswith("--"))) or given == [value]:
                    found.append(f"{page.name}: {command}: {option} {value or ''} -> {new}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("command", ["check", "bench", "explain"])
def test_markdown_bare_dash_or_path(command):
    assert parse(command, "--markdown").markdown == "-"  # the old flag: Markdown on stdout
    assert parse(command, "--markdown", "-").markdown == "-"
    assert parse(command, "--markdown", "out.md").markdown == "out.md"
    assert parse(command).markdown is None


def test_report_markdown_still_needs_a_path():
    # report takes FILE... positionals: a bare --markdown would swallow the first file.
    assert parse("report", "a.json", "--markdown", "-").markdown == "-"
    with pytest.raises(SystemExit):
        parse("report", "a.json", "--markdown")


@pytest.mark.parametrize("command", ["check", "bench", "explain"])
def test_an_empty_list_names_the_option(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(command, "--backends", " , ")
    assert exit_.value.code == 2
    assert "--backends: expected a comma-separated list of names such as a,b; got ' , '" in capsys.readouterr().err


def test_explain_markdown_to_stdout_and_to_a_file_are_the_same(tmp_path, capsys):
    argv = ["explain", "--backends", "numpy", "--sections", "stages", "--tokens", "4"]
    assert main([*argv, "--markdown"]) == 0
    bare = capsys.readouterr().out
    assert bare.startswith("#") and "q_heads" in bare and "\x1b[" not in bare  # Markdown, not terminal tables
    assert main([*argv, "--markdown", "-"]) == 0
    assert capsys.readouterr().out == bare
    target = tmp_path / "explain.md"
    assert main([*argv, "--markdown", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == bare


def test_check_markdown_to_a_file_is_what_stdout_gets(tmp_path, capsys):
    argv = ["check", "--backends", "numpy", "--cases", "heads_split", "--dtypes", "float64", "--jobs", "0", "--plain"]
    assert main([*argv, "--markdown"]) == 0
    bare = capsys.readouterr().out
    assert bare.startswith("# mha-rosetta check")
    target = tmp_path / "check.md"
    assert main([*argv, "--markdown", str(target)]) == 0
    printed = capsys.readouterr().out
    assert untimed(target.read_text(encoding="utf-8")) == untimed(bare)
    assert printed != bare and f"wrote {target}" in printed  # the terminal report, then where the file went


def test_diagnose_old_spelling_dtype_is_dtypes():
    old = parse("diagnose", "m:f", "--dtype", "float32")
    assert vars(old) == vars(parse("diagnose", "m:f", "--dtypes", "float32"))
    assert parse("diagnose", "m:f", "--dtypes", "float64,float32", "--dtype", "bfloat16").dtypes == [
        "float64",
        "float32",
        "bfloat16",
    ]
    assert parse("diagnose", "m:f").dtypes is None  # float64, the default, chosen in run()


CANDIDATE = """
import numpy as np
from mha_rosetta.core import MHAConfig, reference_mha


def candidate(params, query, key, value, mask):
    # The oracle itself, handing back the dtype it was given: a correct candidate in every dtype.
    out = reference_mha(MHAConfig(d_model=12, n_heads=3), params, query, key, value, mask)
    return np.asarray(out, dtype=query.dtype)
"""


def test_diagnose_in_two_dtypes_gives_one_diagnosis_each(tmp_path):
    (tmp_path / "oracle_candidate.py").write_text(CANDIDATE, encoding="utf-8")
    argv = ["diagnose", "oracle_candidate:candidate", "--d-model", "12", "--heads", "3", "--json", "-"]
    done = run_cli(*argv, "--dtypes", "float64", "--dtypes", "float32", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["agrees"] is True and [d["dtype"] for d in data["diagnoses"]] == ["float64", "float32"]
    assert all(d["agrees"] and d["causes"] == [] for d in data["diagnoses"])
    assert data["diagnoses"][0]["max_error"] < 1e-12  # float64: the oracle against itself
    assert "oracle_candidate:candidate (" in done.stderr and ", float32):" in done.stderr  # report on stderr
