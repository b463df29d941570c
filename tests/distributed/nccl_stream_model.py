"""The single-stream model of NCCL's point-to-point operations (labkit.comm.stream_model), and a pipeline's
posted groups as it reads them (used by test_pipeline_parallel.py and test_pipeline_interleaved.py)."""

from labkit.comm.stream_model import stream_deadlock
from labkit.parallel.pipeline import Action, communication_plan

__all__ = ["plan_posts", "stream_deadlock"]


def plan_posts(kind, p, m, chunks=1, receives_ahead=False):
    """communication_plan's groups as stream_deadlock reads them (no sizes): a barrier first, as run_pipeline.
    A message is (op, peer, what, micro-batch, chunk)."""
    return [[(("barrier",),)] + [tuple((msg.op, msg.peer, msg.what, msg.microbatch, msg.chunk) for msg in step)
                              for step in steps if not isinstance(step, Action)]
            for steps in communication_plan(kind, p, m, chunks, receives_ahead)]
