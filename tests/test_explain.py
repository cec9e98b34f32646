"""The explainer: stage tables measured from real tensors, weight layouts, head split, differences, CLI."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from conftest import BATCH, D_K, D_MODEL, HEADS, Q_TOKENS, python_stdout, requires
from mha_rosetta.backends.entries import module_name
from mha_rosetta.cli.main import main
from mha_rosetta.core import MHAConfig, init_params
from mha_rosetta.explain import explain, head_splits, make_setup, weight_layouts
from mha_rosetta.explain.head_split import grid_text, head_summary, save_png
from mha_rosetta.explain.memory import contiguity, shares_memory, strides_in_elements
from mha_rosetta.explain.stages_table import build_stage_tables, measure_backend, scorer_location
from mha_rosetta.explain.weights import _layout


def _adapter_present(name: str) -> bool:
    from mha_rosetta.backends import REGISTRY, available_backends

    return name in available_backends() and importlib.util.find_spec(module_name(REGISTRY[name].module)) is not None


def needs_adapter(name: str):
    return pytest.mark.skipif(not _adapter_present(name), reason=f"backend {name!r} is not installed or not written")


@pytest.fixture(scope="module")
def distinct_setup():
    # Distinct sizes (batch 2, 7 tokens, d_model 15, 3 heads of 5) so every stride is telling.
    return make_setup(MHAConfig(d_model=D_MODEL, n_heads=HEADS), tokens=Q_TOKENS, batch=BATCH)


def _stage_table(backend: str, setup):
    """The backend's summary and its stage-table rows by stage name, measured on ``setup``."""
    summary, rows = measure_backend(backend, setup.cfg, setup.params, setup.x)
    return summary, {row.stage: row for row in rows}


# --- memory facts ------------------------------------------------------------------------------


def test_memory_facts_numpy():
    a = np.zeros((3, 5), dtype=np.float32)
    assert strides_in_elements(a) == (5, 1)
    assert strides_in_elements(a.T) == (1, 5)
    assert contiguity(a) == "C" and contiguity(a.T) == "F" and contiguity(a[:, ::2]) == "no"
    assert shares_memory(a.T, a) and not shares_memory(a.T.copy(), a)


@requires("torch")
def test_memory_facts_torch():
    import torch

    t = torch.zeros(3, 5)
    assert strides_in_elements(t.T) == (1, 5)
    assert contiguity(t) == "C" and contiguity(t.T) == "F"
    assert shares_memory(t.T, t) and not shares_memory(t.T.contiguous(), t)


# --- the stage tables ---------------------------------------------------------------------------


@needs_adapter("numpy")
def test_numpy_stage_table_matches_the_real_tensors(distinct_setup):
    from mha_rosetta.backends import get_backend

    s = distinct_setup
    summary, by_stage = _stage_table("numpy", s)
    q_heads = by_stage["q_heads"]
    # Column samples: q is (B, H*Dk, N); splitting heads is a reshape of the row axis, a view.
    assert q_heads.axes == ("B", "H", "Dk", "Nq")
    assert q_heads.shape == (BATCH, HEADS, D_K, Q_TOKENS)
    assert q_heads.strides == (HEADS * D_K * Q_TOKENS, D_K * Q_TOKENS, Q_TOKENS, 1)  # (105, 35, 7, 1)
    assert q_heads.contiguous == "C"
    assert q_heads.memory == "view of q"
    assert by_stage["merged"].memory == "view of context"  # no transpose needed in column samples
    # The table's numbers are the tensors' own numbers.
    prepared, _ = get_backend("numpy").prepare(s.cfg, s.params, s.x, dtype="float32")
    real = prepared.native_stages()["q_heads"].value
    assert q_heads.strides == tuple(n // real.itemsize for n in real.strides)
    assert summary.scorers.startswith("rows of W")


@needs_adapter("torch")
def test_torch_stage_table_shows_the_transposed_view(distinct_setup):
    s = distinct_setup
    summary, by_stage = _stage_table("torch", s)
    q_heads = by_stage["q_heads"]
    # view(B, N, H, Dk).transpose(1, 2): shape (B, H, N, Dk), strides of the (B, N, H*Dk) buffer.
    assert q_heads.shape == (BATCH, HEADS, Q_TOKENS, D_K)
    assert q_heads.strides == (Q_TOKENS * HEADS * D_K, D_K, HEADS * D_K, 1)  # (105, 5, 15, 1)
    assert q_heads.contiguous == "no"
    assert q_heads.memory == "view of q"
    assert by_stage["merged"].memory == "copy of context"  # .contiguous() before .view
    assert by_stage["merged"].contiguous == "C"
    assert summary.scorers.startswith("columns of the applied matrix")


@needs_adapter("jax")
def test_jax_stage_table_says_xla_manages_layout(distinct_setup):
    s = distinct_setup
    _, rows = measure_backend("jax", s.cfg, s.params, s.x)
    assert rows, "jax exposed no stages"
    for row in rows:
        assert row.strides is None and row.strides_text == "n/a, XLA-managed"


def test_unknown_and_missing_backends_are_reported(distinct_setup):
    s = distinct_setup
    with pytest.raises(ValueError, match="unknown backend"):
        build_stage_tables(s.cfg, s.params, s.x, ["no-such-backend"])


def test_scorer_location_from_axis_order():
    assert scorer_location(("B", "H*Dk", "Nq"))[1].startswith("rows of W")
    assert scorer_location(("B", "Nq", "H*Dk"))[1].startswith("columns")
    assert scorer_location(None)[0].startswith("n/a")


# --- weight layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg", [MHAConfig(d_model=12, n_heads=3), MHAConfig(d_model=D_MODEL, n_heads=HEADS)], ids=["seed", "distinct"]
)
def test_every_weight_layout_verifies(cfg):
    layouts = {layout.layout.split(" (")[0]: layout for layout in weight_layouts(cfg, init_params(cfg, seed=0))}
    for layout in layouts.values():
        assert layout.verified in (True, None), f"{layout.layout}: {layout.evidence}"
    H, Dk, D = cfg.n_heads, cfg.d_k, cfg.d_model
    assert layouts["row-sample W_B"].shape == (D, H * Dk)
    assert layouts["per-head W_h, row samples"].shape == (H, D, Dk)
    assert layouts["Flax/Keras query kernel"].shape == (D, H, Dk)
    assert layouts["per-head output blocks / Flax-Keras out kernel"].shape == (H, cfg.d_v, D)
    assert layouts["canonical w_q"].head_scorer == f"row {Dk} (= h*Dk + j)"  # scorer 0 of head 1
    assert layouts["Flax/Keras query kernel"].head_scorer == "kernel[:, 1, 0]"
    if importlib.util.find_spec("torch"):
        packed = layouts["torch nn.MultiheadAttention.in_proj_weight"]
        assert packed.shape == (3 * D, D) and "real nn.MultiheadAttention loaded it" in packed.evidence


def test_weight_layout_for_a_config_torch_cannot_hold():
    cfg = MHAConfig(d_model=D_MODEL, n_heads=HEADS, d_v=4)
    layouts = weight_layouts(cfg, init_params(cfg))
    packed = [layout for layout in layouts if "MultiheadAttention" in layout.layout]
    assert packed[0].verified is None and "not expressible" in packed[0].evidence


def test_verification_catches_a_wrong_formula():
    w = np.arange(12.0).reshape(3, 4)
    layout = _layout("w", "rows", "-", "-", "row 0", w.T, w.reshape(4, 3), w, w[0], canonical=w, scorer_canonical=w[0])
    assert layout.verified is False and "formula == converter: NO" in layout.evidence  # reshape is not a transpose


# --- head split ---------------------------------------------------------------------------------


def test_head_split_assignment():
    splits = head_splits(Q_TOKENS, HEADS, D_K)
    tokens, features = np.meshgrid(np.arange(Q_TOKENS), np.arange(HEADS * D_K), indexing="ij")
    np.testing.assert_array_equal(splits["correct"].owner, features // D_K)  # head h owns columns h*Dk:(h+1)*Dk
    np.testing.assert_array_equal(splits["correct"].row_in_head, tokens)
    flat = tokens * HEADS * D_K + features
    np.testing.assert_array_equal(splits["direct_reshape"].owner, flat // (Q_TOKENS * D_K))  # runs of memory


def test_head_split_seed_picture():
    splits = head_splits(6, 3, 4)
    wrong = splits["direct_reshape"]
    assert [wrong.tokens_of(h) for h in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert head_summary(wrong)[0] == "head 0 (A): tokens 0-1 only, all features"
    assert head_summary(splits["correct"])[1] == "head 1 (B): all tokens, features 4-7"
    grid = grid_text(wrong).splitlines()
    assert grid[-6] == "token 0 " + " ".join("A" * 12) and grid[-1] == "token 5 " + " ".join("C" * 12)


@requires("matplotlib")
def test_head_split_png(tmp_path):
    path = save_png(head_splits(6, 3, 4), tmp_path / "split.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_head_split_rejects_bad_sizes():
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        head_splits(6, 0, 4)


# --- differences (live) --------------------------------------------------------------------------


@requires("torch")
def test_mask_polarity_demonstrated():
    from mha_rosetta.explain.differences import mask_polarity

    rows = dict(mask_polarity(make_setup()).rows)
    assert rows["nn.MultiheadAttention(attn_mask=M)"].startswith("query 0 attends keys [1, 3, 5]")
    assert rows["nn.MultiheadAttention(attn_mask=~M)"].startswith("query 0 attends keys [0, 2, 4]")
    assert rows["F.scaled_dot_product_attention(attn_mask=M)"].startswith("query 0 attends keys [0, 2, 4]")
    if importlib.util.find_spec("jax"):
        assert rows["jax.nn.dot_product_attention(mask=M)"].startswith("query 0 attends keys [0, 2, 4]")


@requires("torch")
def test_fully_masked_row_demonstrated():
    from mha_rosetta.explain.differences import fully_masked_row

    rows = dict(fully_masked_row(make_setup()).rows)
    assert rows["spec (float64 oracle)"] == "zero context (output = b_o), as the spec"
    assert rows["nn.MultiheadAttention, need_weights=True"] == "NaN"
    if importlib.util.find_spec("jax"):
        assert rows["jax.nn.dot_product_attention"] == "uniform average of all values"


def test_scale_placement_overflow_in_float16():
    from mha_rosetta.explain.differences import scale_placement

    rows = dict(scale_placement(make_setup()).rows)
    assert "overflow: True" in rows["numpy float16, (Q @ K.T) * scale"]
    assert rows["numpy float16, (Q * scale) @ K.T"] == "max logit 12800 (finite: True)"


def test_tf32_skipped_without_gpu():
    from mha_rosetta.explain.differences import tf32_default

    result = tf32_default(make_setup())
    gpu = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()
    assert result.status == "demonstrated" if gpu else result.status.startswith("skipped: no GPU")


# --- explain() and the command line ---------------------------------------------------------------


def test_explain_object_renders_everywhere():
    result = explain(sections=("weights", "head_split"))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["config"] == {
        "tokens": 6,
        "batch": 2,
        "d_model": 12,
        "n_heads": 3,
        "d_k": 4,
        "d_v": 4,
        "dtype": "float32",
    }
    markdown = result.to_markdown()
    assert "## The head split" in markdown and "| row-sample W_B (Y = X @ W_B) | (12, 12) |" in markdown
    assert "token 0 A A A A B B B B C C C C" in result.to_text()


@requires("rich")
def test_rich_rendering_of_claims():
    import io

    from mha_rosetta.explain.claims import run_claims

    result = explain(sections=("head_split",))
    result.sections = ("head_split", "claims")
    result.claims = run_claims([12])
    stream = io.StringIO()
    result.print(file=stream)
    text = stream.getvalue()
    assert "The column/row-sample article's claims" in text and "confirmed" in text and "2.5" in text
    assert "token 0 A A A A B B B B C C C C" in text


def test_explain_rejects_unknown_sections():
    with pytest.raises(ValueError, match="sections must be among"):
        explain(sections=("stages", "poetry"))


def test_cli_claims_json(tmp_path):
    target = tmp_path / "claims.json"
    status = main(["explain", "--claims", "--no-speed", "--json", str(target), "--plain"])
    data = json.loads(target.read_text())
    claims = data["claims"]
    assert data["schema"] == 1 and data["provenance"]["command"]  # where it came from
    assert [c["claim"] for c in claims] == list(range(1, 13))
    assert all({"claim", "title", "verdict", "evidence"} <= set(c) for c in claims)
    assert claims[11]["verdict"] == "confirmed" and "2.5" in claims[11]["evidence"]
    assert status == 0


def test_cli_markdown_for_one_backend(capsys):
    argv = [
        "explain",
        "--markdown",
        "--backends",
        "numpy",
        "--sections",
        "stages,weights",
        "--tokens",
        "5",
        "--d-model",
        "8",
        "--heads",
        "2",
    ]
    status = main(argv)
    out = capsys.readouterr().out
    assert status == 0
    assert "batch 2, tokens 5, d_model 8, heads 2, d_k 4" in out
    if _adapter_present("numpy"):
        assert "| numpy | (2, 2, 4, 5) | B x H x Dk x Nq | (40, 20, 5, 1) | C | view of q |" in out


def test_cli_bad_arguments(capsys):
    assert main(["explain", "--backends", "numpy,nope"]) == 2
    assert "unknown backend(s) nope" in capsys.readouterr().err
    assert main(["explain", "--d-model", "10", "--heads", "3"]) == 2
    assert "not divisible by n_heads=3" in capsys.readouterr().err
    assert main(["explain", "--sections", "stages,poetry"]) == 2
    assert "unknown section(s) poetry" in capsys.readouterr().err


def test_importing_the_explainer_imports_no_framework():
    code = (
        "import sys, mha_rosetta.explain, mha_rosetta.cli.explain\n"
        "print(','.join(m for m in ('torch', 'jax', 'flax', 'equinox', 'einops', 'matplotlib', 'rich') if m in sys.modules))\n"
    )
    assert python_stdout(code) == ""


def test_exit_status_ignores_refuted_speed_claims():
    from mha_rosetta.cli.explain import _failures
    from mha_rosetta.explain.claims import ClaimResult

    result = explain(sections=("head_split",))
    result.claims = [ClaimResult(7, "slicing is slower", "refuted", ["measured"])]
    assert _failures(result) == []  # the column/row-sample article may be wrong about speed
    result.claims.append(ClaimResult(12, "2.5", "refuted", ["measured"]))
    assert _failures(result) == ["claim 12 refuted"]


def _printable_characters(text: str):
    """Every visible character (not white space, rules or rich's box drawing), with its count."""
    from collections import Counter

    return Counter(
        c
        for line in text.splitlines()
        if set(line.strip()) - set("- ")
        for c in line
        if not c.isspace() and not "\u2500" <= c <= "\u257f"
    )


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "rich"])
def test_explain_output_fits_columns_and_keeps_its_content(plain, monkeypatch):
    """With COLUMNS=100 no line is wider than 100, and every character of the unlimited output is still there
    (the 48-feature head-split grid splits into parts that repeat the token labels; table cells wrap)."""
    import io

    if not plain and importlib.util.find_spec("rich") is None:
        pytest.skip("rich is not installed: the rich rendering cannot be shown")
    explanation = explain(
        MHAConfig(d_model=48, n_heads=4), sections=("stages", "weights", "head_split", "claims"), speed=False
    )

    def printed(columns: int) -> str:
        monkeypatch.setenv("COLUMNS", str(columns))
        out = io.StringIO()
        explanation.print(plain=plain, file=out)
        return out.getvalue()

    wide, narrow = printed(1000), printed(100)
    assert max(map(len, wide.splitlines())) > 100  # the check below means something
    assert max(map(len, narrow.splitlines())) <= 100
    assert not _printable_characters(wide) - _printable_characters(narrow)  # nothing lost
    assert narrow.count("token 0") == wide.count("token 0") * 2  # each grid in two parts, each labelled
