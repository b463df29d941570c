"""The measured bubble of a pipeline step, as the tests measure it on a shared machine (used by
test_pipeline_parallel.py and test_pipeline_interleaved.py)."""

import torch

import labkit
from labkit.parallel import measured_bubble

# How much longer each retry's emulated compute is. Load on a shared machine adds a roughly fixed delay per
# message and per wake-up (a rank waiting for a core), so the schedule's own idle share is what is left when the
# compute dwarfs it: doubling the compute halves that delay's share of the makespan. One CI run on a loaded
# 2-core machine measured GPipe's bubble at p = 4, m = 4 as 0.495 against (p-1)/(m+p-1) = 0.429 five times at 40 ms.
SCALES = (1, 1, 2, 2, 4, 4)


def least_bubble(step, formula: float, tolerance: float = 0.15, scales=SCALES) -> float:
    """In a rank: the least bubble of the runs of `step(scale)` (which returns this rank's PipelineResult with
    its emulated compute times `scale` times the test's), stopping once one is within `tolerance` of `formula`.
    Load only adds idle time, so the best run is the one that measures the schedule. Every rank sees the same
    gathered events, so all of them stop at the same run."""
    best = None
    for scale in scales:
        gathered = [None] * labkit.world_size()
        torch.distributed.all_gather_object(gathered, step(scale).events)
        bubble = measured_bubble([e for events in gathered for e in events])
        best = bubble if best is None else min(best, bubble)
        if abs(best - formula) <= tolerance * formula:
            break
    return best


def scaled(emulated: tuple[float, float], scale: float) -> tuple[float, float]:
    """The (forward, backward) emulated seconds, `scale` times longer."""
    return tuple(seconds * scale for seconds in emulated)
