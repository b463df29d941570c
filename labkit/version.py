"""labkit's version: a leaf, so that any module may name it (the attached ranks compare theirs with the notebook's)."""

__all__ = ["VERSION"]

VERSION = "0.1.0"  # pyproject.toml says the same
