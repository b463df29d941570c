"""Parameter counts as people write them: "70B", "7e9", "6.7 billion", "7,000,000,000", "175 B", "1.5T", "350M".

Model cards and papers name sizes with a suffix (LLaMA-7B, GPT-3 175B, BERT-large 340M), so the planner's
parameter field reads these forms with `parse_count` and writes its default back with `format_count`.
M is always million here (a count of parameters has no milli), B billion (10^9, not a byte) and T trillion.

It also holds the other count every parallel layout needs: `shard_sizes`, the even split of n items over k ranks
(labkit's one copy, cut as torch.tensor_split cuts).
"""

from __future__ import annotations

import math
import re

from labkit.checks import number, shown, whole

__all__ = ["format_count", "parse_count", "shard_sizes"]

SCALES = {"": 1.0, "k": 1e3, "thousand": 1e3, "m": 1e6, "million": 1e6, "b": 1e9, "bn": 1e9, "billion": 1e9,
          "t": 1e12, "trillion": 1e12}
BYTE_UNITS = ("kb", "mb", "gb", "tb", "kib", "mib", "gib", "tib")  # "70 GB": bytes, refused
SUFFIXES = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3))  # format_count's, largest first
EXPECTED = "a count like 70B, 6.7 billion, 350M, 1.5T, 7e9 or 7,000,000,000 (suffix k, M, B or T)"
# a number, with commas only between groups of three digits, an optional exponent, then an optional suffix word
COUNT = re.compile(r"(?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?P<exponent>e[+-]?\d+)?"
                   r"\s*(?P<suffix>[a-z]*?)(?:\s*(?:parameters|params))?", re.IGNORECASE)


def parse_count(text: str) -> float:
    """The positive, finite count that `text` writes, or ValueError naming `text` and saying what is expected
    (TypeError if it is no string at all).

    >>> parse_count("70B"), parse_count("6.7 billion"), parse_count("7,000,000,000"), parse_count("350M")
    (70000000000.0, 6700000000.0, 7000000000.0, 350000000.0)
    """
    if not isinstance(text, str):
        raise TypeError(f"text={shown(text)}: pass a string, {EXPECTED}; not a {type(text).__name__}.")
    match = COUNT.fullmatch(text.strip())
    suffix = match["suffix"].lower() if match else None
    if suffix in BYTE_UNITS:
        raise ValueError(f"text={shown(text)}: a size in bytes, not a parameter count; type {EXPECTED}.")
    if suffix not in SCALES:
        raise ValueError(f"text={shown(text)}: not a parameter count; type {EXPECTED}.")
    count = float(match["number"].replace(",", "") + (match["exponent"] or "")) * SCALES[suffix]
    if not math.isfinite(count) or count <= 0:
        raise ValueError(f"text={shown(text)}: not a positive, finite parameter count; type {EXPECTED}.")
    return count


def format_count(count: float) -> str:
    """`count` (a number >= 0) with the largest suffix that leaves at least 1 (7e9 -> "7B"), to 15 significant
    digits, so that parse_count reads it back to within 1e-14.

    >>> format_count(7e9), format_count(6.7e9), format_count(1.5e12), format_count(350e6), format_count(512)
    ('7B', '6.7B', '1.5T', '350M', '512')
    """
    value = number("count", count)
    suffix, scale = next(((suffix, scale) for suffix, scale in SUFFIXES if value >= scale), ("", 1.0))
    return f"{value / scale:.15g}{suffix}"


def shard_sizes(count: int, parts: int) -> list[int]:
    """How many of `count` items each of `parts` ranks holds, cut as torch.tensor_split cuts: the first
    count % parts ranks hold one more. The one even split in labkit: the tensor-parallel layers' features, the
    ring's chunks (and the grader's diagnosis of them), the pipeline's layers per stage and the matrix figure
    all use it.

    >>> shard_sizes(10, 4)
    [3, 3, 2, 2]
    >>> shard_sizes(2, 4)
    [1, 1, 0, 0]
    """
    count, parts = whole("count", count, minimum=0), whole("parts", parts)
    return [count // parts + (1 if r < count % parts else 0) for r in range(parts)]
