"""Argument checks for every public function in labkit: each error names the argument, its value and what to pass.

A function fed nonsense (zero devices, a negative size, `True` for a count, 10**400 bytes) would otherwise return
a confident, wrong number, an inf, or an error from deep inside torch, so public functions check their inputs with
these and, where a formula can overflow, their result with `finite_result`.
TypeError: the value is not the kind of thing asked for (None, a string, a list where a number goes).
ValueError: it is, but cannot be used (a bool or 2.5 as a count, NaN, a negative size, a number past the largest
float, 1.8e308). Fractions and Decimals are numbers like any other (converted to float).

    >>> whole("world_size", 4)
    4
    >>> whole("world_size", 2.5)
    Traceback (most recent call last):
    ...
    ValueError: world_size=2.5: pass a whole number >= 1 (an int, not a bool).
"""

from __future__ import annotations

import decimal
import math
import numbers
import reprlib
import sys
from collections.abc import Iterable, Mapping, Set
from contextlib import contextmanager

__all__ = ["FLOAT_MAX", "MAX_TIMEOUT_SECONDS", "MAX_WORLD_SIZE", "TooLarge", "choice", "finite_result", "flag",
           "fraction", "items", "number", "numbers_list", "overflow_named", "rank_count", "shown", "timeout_seconds",
           "whole"]

MAX_WORLD_SIZE = 16  # ranks per labkit.run or %%ranks call; beyond a laptop's worth, use torchrun
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600  # a week: longer waits overflow gloo's and NCCL's millisecond timeouts
FLOAT_MAX = sys.float_info.max  # 1.8e308: past it a float is inf, and inf or nan would pass for an answer
TOO_LARGE = "is too large to compute with (over 1.8e308)"
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxtuple = 40, 60, 6, 6


class TooLarge(ValueError):
    """A number, given or computed, past the largest float; the message names the inputs it came from."""


def shown(value) -> str:
    """`value` for an error message, short: a huge int as 10**400 (its repr runs to 401 digits, and raises past
    4,300), long strings and lists cut."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) >= 10**21:
        magnitude, sign = abs(int(value)), "-" if value < 0 else ""
        exponent = math.floor(math.log10(magnitude))
        exponent -= 10**exponent > magnitude  # log10 rounds up just below a power of ten
        if magnitude == 10**exponent:
            return f"{sign}10**{exponent}"
        return f"{sign}{magnitude / 10**exponent:.6g}e{exponent} (an int of {exponent + 1} digits)"
    try:
        return _SHORT.repr(value)
    except ValueError:  # a Fraction or other number of more than 4,300 digits
        return f"a {type(value).__name__} too long to print"


def _kind(value) -> str:
    """ "an int", "a str": the type of `value`, for "pass ..., not an int"."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _as_float(name: str, value, wanted: str) -> float:
    """`value` as a float (inf when a finite int, Fraction or Decimal is past the largest float), or TypeError
    when it is no real number at all; `wanted` completes "pass ..." in the message."""
    if not isinstance(value, numbers.Real | decimal.Decimal):
        raise TypeError(f"{name}={shown(value)}: pass {wanted}, not {_kind(value)}.")
    try:
        return float(value)
    except OverflowError:  # an int or Fraction past the largest float
        return math.inf if value > 0 else -math.inf
    except ValueError:  # Decimal("sNaN")
        return math.nan


def _infinite(value) -> bool:
    """True for inf itself (a float or Decimal infinity), not for a finite number too large to convert."""
    if isinstance(value, decimal.Decimal):
        return value.is_infinite()
    return isinstance(value, float) and math.isinf(value)


def whole(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= `minimum` within float range, or TypeError (not a number) or ValueError."""
    wanted = f"a whole number >= {minimum} (an int, not a bool)"
    if not isinstance(value, numbers.Real | decimal.Decimal):
        raise TypeError(f"{name}={shown(value)}: pass {wanted}, not {_kind(value)}.")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={shown(value)}: pass {wanted}.")
    if value > FLOAT_MAX:
        raise TooLarge(f"{name}={shown(value)} {TOO_LARGE}: pass a smaller number.")
    return int(value)


def number(name: str, value, minimum: float = 0.0, inclusive: bool = True) -> float:
    """`value` as a finite float >= `minimum` (> `minimum` unless `inclusive`), or TypeError or ValueError."""
    bound = ">=" if inclusive else ">"
    wanted = f"a finite number {bound} {minimum:g}"
    converted = math.nan if isinstance(value, bool) else _as_float(name, value, wanted)
    if (math.isnan(converted) or _infinite(value) or converted < minimum
            or (converted == minimum and not inclusive)):
        raise ValueError(f"{name}={shown(value)}: pass {wanted} (not a bool).")
    if math.isinf(converted):
        raise TooLarge(f"{name}={shown(value)} {TOO_LARGE}: pass a smaller number.")
    return converted


def fraction(name: str, value) -> float:
    """`value` as a float in [0, 1], or TypeError or ValueError."""
    share = number(name, value)
    if share > 1:
        raise ValueError(f"{name}={shown(value)}: pass a fraction between 0 and 1.")
    return share


def flag(name: str, value) -> bool:
    """`value` if it is True or False, or TypeError (1 and "yes" are not flags)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={shown(value)}: pass True or False.")
    return value


def choice(name: str, value, options) -> str:
    """`value` if it is one of `options`, or ValueError listing them."""
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name}={shown(value)}: use one of {', '.join(map(repr, options))}.")
    return value


def items(name: str, values, wanted: str) -> list:
    """`values` as a list, or TypeError when it is no ordered collection: a number, a string (its characters),
    a dict (its keys) or a set (no order, duplicates gone). `wanted` completes "pass ..." in the message."""
    if isinstance(values, str | bytes | Mapping | Set) or not isinstance(values, Iterable):
        raise TypeError(f"{name}={shown(values)}: pass {wanted}, not {_kind(values)}.")
    try:
        return list(values)
    except TypeError as error:  # iterable in type only, as a 0-d numpy array
        raise TypeError(f"{name}={shown(values)}: pass {wanted} ({error}).") from error


def numbers_list(name: str, values, minimum: float = 0.0, inclusive: bool = True) -> list[float]:
    """`values` (a list, tuple or array) as floats, each checked like `number` and named name[i]."""
    return [number(f"{name}[{i}]", value, minimum, inclusive)
            for i, value in enumerate(items(name, values, "a list of numbers"))]


def _finite(value) -> bool:
    if isinstance(value, numbers.Integral):
        return abs(value) <= FLOAT_MAX
    if isinstance(value, numbers.Real):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return all(map(_finite, value.values()))
    if isinstance(value, list | tuple):
        return all(map(_finite, value))
    return True  # None, strings


def _overflow(function: str, inputs: dict) -> TooLarge:
    called = ", ".join(f"{name}={shown(value)}" for name, value in inputs.items())
    return TooLarge(f"{function}({called}) overflows past 1.8e308, the largest float: pass smaller numbers.")


def finite_result(function: str, value, /, **inputs):
    """`value` unchanged if every number in it (dicts, lists and tuples searched) is finite and within float
    range; else TooLarge naming `function` and the `inputs` it was computed from."""
    if not _finite(value):
        raise _overflow(function, inputs)
    return value


@contextmanager
def overflow_named(function: str, /, **inputs):
    """Re-raise an overflow inside the block (a helper's TooLarge, or Python's OverflowError) as TooLarge naming
    `function` and its own `inputs`: the helper's argument names (nbytes, params) are not the caller's.
    Yields `finite(value)`, `finite_result` with these names, for the block's intermediates and result."""
    try:
        yield lambda value: finite_result(function, value, **inputs)
    except (TooLarge, OverflowError) as error:
        raise _overflow(function, inputs) from error


def rank_count(value) -> int:
    """`value` as a number of ranks for one labkit call, 1 to MAX_WORLD_SIZE, or TypeError or ValueError (as
    `whole`; past MAX_WORLD_SIZE the message points to torchrun).

    >>> rank_count(17)
    Traceback (most recent call last):
    ...
    ValueError: world_size=17: pass a whole number from 1 to 16; for more ranks, run a script under torchrun ...
    """
    count = whole("world_size", value)
    if count > MAX_WORLD_SIZE:
        raise ValueError(f"world_size={shown(value)}: pass a whole number from 1 to {MAX_WORLD_SIZE}; for more ranks, "
                         "run a script under torchrun (see the README's instructor guide).")
    return count


def timeout_seconds(name: str, value) -> float:
    """`value` as seconds, more than 0 and at most a week (MAX_TIMEOUT_SECONDS), or TypeError or ValueError (as
    `number`). 10**400, past the largest float, gets the same message as any other wait beyond a week.

    >>> timeout_seconds("timeout", 8 * 24 * 3600)
    Traceback (most recent call last):
    ...
    ValueError: timeout=691200: pass a number of seconds > 0 and at most a week (604800 s): longer waits ...
    """
    try:
        seconds = number(name, value, minimum=0.0, inclusive=False)
    except TooLarge:
        seconds = math.inf
    if seconds > MAX_TIMEOUT_SECONDS:
        raise ValueError(f"{name}={shown(value)}: pass a number of seconds > 0 and at most a week "
                         f"({MAX_TIMEOUT_SECONDS} s): longer waits overflow gloo's and NCCL's millisecond timeouts.")
    return seconds
