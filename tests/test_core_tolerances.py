"""The dtype tolerance table and the comparison every check uses."""

import numpy as np
import pytest

from mha_rosetta.core import TOLERANCES, assert_close, compare, lower_precision, tolerance_for


def test_table_covers_every_dtype_and_loosens_with_precision():
    names = ["float64", "float32", "float16", "bfloat16"]
    assert list(TOLERANCES) == names
    atols = [TOLERANCES[n].atol for n in names]
    assert atols == sorted(atols)


def test_overrides_merge_on_top_of_the_table():
    tol = tolerance_for("float32", rtol=1e-2)
    assert tol.atol == TOLERANCES["float32"].atol and tol.rtol == 1e-2


def test_compare_reports_max_abs_rel_and_worst_index():
    expected = np.array([[1.0, 2.0], [4.0, 8.0]])
    actual = expected + np.array([[0.0, 0.0], [0.0, 1e-2]])
    result = compare(actual, expected, "float32")
    assert not result.ok
    assert result.max_abs == pytest.approx(1e-2)
    assert result.max_rel == pytest.approx(1e-2 / 8)
    assert result.worst_index == (1, 1)
    assert compare(actual, expected, "float16").ok


def test_nan_matches_nan_but_not_a_number():
    assert compare([np.nan, 1.0], [np.nan, 1.0], "float64").ok
    result = compare([np.nan, 1.0], [0.0, 1.0], "float64")
    assert not result.ok and "NaN" in result.reason


def test_shape_mismatch_is_a_disagreement():
    result = compare(np.zeros((2, 3)), np.zeros((3, 2)), "float64")
    assert not result.ok and "shape" in result.reason


def test_assert_close_message_names_the_numbers():
    with pytest.raises(AssertionError, match=r"max abs 0\.5"):
        assert_close([1.5], [1.0], "bfloat16", what="output")


def test_lower_precision_of_a_pair():
    assert lower_precision("float32", "float16") == "float16"
    assert lower_precision("float64", "float64") == "float64"


def test_unknown_dtype_names_the_accepted_values():
    with pytest.raises(ValueError, match="float64, float32, float16, bfloat16"):
        tolerance_for("int8")
