"""Parameter counts as people type them: the forms of model cards read right, anything else refused with a hint."""

import doctest
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from labkit.plan import counts, format_count, parse_count

SUFFIX_SCALES = [("k", 1e3), ("K", 1e3), ("thousand", 1e3), ("M", 1e6), ("million", 1e6), ("B", 1e9), ("b", 1e9),
                 ("bn", 1e9), ("Billion", 1e9), ("T", 1e12), ("trillion", 1e12)]


@pytest.mark.parametrize("text, count", [
    ("70B", 70e9), ("7e9", 7e9), ("6.7 billion", 6.7e9), ("7,000,000,000", 7e9), ("175 B", 175e9),
    ("1.5T", 1.5e12), ("350M", 350e6), ("  7b ", 7e9), ("7B parameters", 7e9), ("1.3e9 params", 1.3e9),
    ("0.5T", 0.5e12), (".5T", 0.5e12), ("7000000000", 7e9), ("2.5E+3", 2500.0),
])
def test_the_forms_people_type(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("text, hint", [
    ("", "not a parameter count"), ("abc", "not a parameter count"), ("70BB", "not a parameter count"),
    ("7,00", "not a parameter count"), ("1,2345", "not a parameter count"), ("-7B", "not a parameter count"),
    ("1.2.3", "not a parameter count"), ("nan", "not a parameter count"), ("inf", "not a parameter count"),
    ("70 GB", "a size in bytes"), ("14GiB", "a size in bytes"),
    ("0", "not a positive, finite"), ("0.0B", "not a positive, finite"), ("1e400", "not a positive, finite"),
])
def test_anything_else_is_refused_saying_what_to_type(text, hint):
    with pytest.raises(ValueError, match=hint) as refused:
        parse_count(text)
    assert "70B, 6.7 billion" in str(refused.value) and f"text={text!r}" in str(refused.value)


def test_a_number_is_not_text_and_a_count_is_a_number():
    with pytest.raises(TypeError, match="text=7000000000.0: pass a string"):
        parse_count(7e9)
    with pytest.raises(TypeError, match="count=None"):
        format_count(None)
    with pytest.raises(ValueError, match="count=10\\*\\*400"):
        format_count(10**400)
    with pytest.raises(ValueError, match="count=-1"):
        format_count(-1)


@given(st.floats(min_value=1e-3, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_format_then_parse_round_trips(count):
    assert math.isclose(parse_count(format_count(count)), count, rel_tol=1e-14)


@given(st.integers(min_value=1, max_value=10**18))
def test_whole_numbers_with_or_without_thousands_commas(count):
    assert parse_count(f"{count:,}") == parse_count(str(count)) == float(count)


@given(st.integers(min_value=1, max_value=999_999), st.integers(min_value=0, max_value=3),
       st.sampled_from(SUFFIX_SCALES), st.sampled_from(["", " ", "  "]))
def test_a_decimal_with_a_suffix_is_that_many_of_the_suffix(mantissa, decimals, suffix_scale, space):
    suffix, scale = suffix_scale
    number = f"{mantissa / 10 ** decimals:.{decimals}f}"
    assert parse_count(f"{number}{space}{suffix}") == float(number) * scale


@given(st.floats(min_value=1, max_value=1e15, allow_nan=False, allow_infinity=False))
def test_format_uses_the_largest_suffix_that_leaves_at_least_one(count):
    text = format_count(count)
    suffix = text[-1] if text[-1].isalpha() else ""
    scale = dict(SUFFIX_SCALES).get(suffix, 1.0)
    assert 1 <= count / scale and (suffix == "T" or count / scale < 1000 * (1 + 1e-15))


def test_docstring_examples():
    result = doctest.testmod(counts)
    assert result.attempted > 0 and result.failed == 0
