"""What labkit.checkpoint raises and warns: defined here, apart, so that every file of the package can raise them.

Their public home is `labkit.checkpoint` (their `__module__`): that is where students import them from, where a
pickled error sent from a rank is looked up, and how error reports name them ("labkit.checkpoint.CheckpointError").
"""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointWarning"]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (truncated, corrupt) or only partly restored."""

    __module__ = "labkit.checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or used: none is intact, the directory belongs to another run, a file
    lacks an entry, or (on the group's other ranks) its writer, group rank 0, failed to save."""

    __module__ = "labkit.checkpoint"
