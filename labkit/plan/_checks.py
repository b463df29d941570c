"""Argument checks shared by the planners: each error names the argument, its value and what to pass instead.

A planner fed nonsense (zero devices, a negative size, `True` for a count) would otherwise return a
confident, wrong number, so every public function checks its inputs with these.
"""

from __future__ import annotations

import math
import numbers


def whole(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= `minimum`, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}={value!r}: pass a whole number >= {minimum} (an int, not a bool).")
    return int(value)


def number(name: str, value, minimum: float = 0.0, inclusive: bool = True) -> float:
    """`value` as a finite float >= `minimum` (> `minimum` unless `inclusive`), or ValueError."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (value == minimum and not inclusive):
        bound = ">=" if inclusive else ">"
        raise ValueError(f"{name}={value!r}: pass a finite number {bound} {minimum:g} (not a bool).")
    return float(value)


def fraction(name: str, value) -> float:
    """`value` as a float in [0, 1], or ValueError."""
    share = number(name, value)
    if share > 1:
        raise ValueError(f"{name}={value!r}: pass a fraction between 0 and 1.")
    return share


def choice(name: str, value, options) -> str:
    """`value` if it is one of `options`, or ValueError listing them."""
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(map(repr, options))}.")
    return value
