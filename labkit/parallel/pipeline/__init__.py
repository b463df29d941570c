"""Pipeline parallelism by hand: consecutive layers on consecutive ranks (stages); the batch cut into
micro-batches that flow forward through the stages and whose gradients flow back, so stages work at once.

    schedule.py   schedule("1f1b", 4, 8)            each stage's ordered actions: Action("F", i), Action("B", i)
                  schedule("interleaved", 4, 8, chunks=2)   v chunks per stage: Action("F", i, chunk)
                  schedule("zb-h1", 4, 8)           zero bubble: the backward split, Action("B", i) and Action("W", i)
                  communication_plan("1f1b", 4, 8)  the same, with the messages each stage posts between them
    zero_bubble.py    zero_bubble_h1(r, p, m)       ZB-H1's order (Qi et al. 2023); W's fill the cool-down
                      dualpipe_v(p, m)              DualPipeV's (DeepSeek-V3), two chunks a stage as a V: simulated
    layout.py         piece_after, piece_before     which stage and chunk holds the model's next or previous piece
    split_backward.py split_forward, backward_input, backward_weight   a chunk's backward as B, then W
    timeline.py   PipelineEvent, measured_bubble(events)   idle share of a timeline: 1 - busy / (makespan x stages)
    simulate.py   simulate_pipeline("1f1b", 4, 8)   the step's timeline from stage costs, without processes
                  HandOver(alpha_seconds, ...)      what a message between stages costs (posting, on the way)
    handover.py   measure_handover(0.02)            that cost on this machine: labkit's transport timed, fitted
    measured.py   steps_taking_turns, bubbles_by_round   measured bubbles on a shared machine, settings taking turns
    executor.py   run_pipeline(model, "1f1b", 8, x, y, loss_fn, group=None)   one training step on the ranks of
                                                    a process group (activations and gradients over
                                                    point-to-point, as communication_plan says), timed action
                                                    by action
    stage_run.py  StageRun, StageLink               one stage's side of that step: its chunks, tensors, messages

GPipe (Huang et al. 2019) and 1F1B (PipeDream-Flush, Narayanan et al. 2021) both idle (p-1)/(m+p-1) of the
time with equal stage costs, interleaved 1F1B with v chunks per stage (the same paper, section 2.2.2)
(p-1)/(v m+p-1) (labkit.plan.bubble_fraction); ZB-H1 (p-1)(F+B-W) of its step, B the input-gradient half of
the backward and W its weight-gradient half (labkit.plan.zero_bubble_fraction); their orders match
torch.distributed.pipelining's.
"""

from labkit.parallel.pipeline.executor import PipelineResult, run_pipeline, stage_layers
from labkit.parallel.pipeline.handover import (
    HANDOVER_SIZES,
    fitted_handover,
    handover_seconds_by_size,
    measure_handover,
)
from labkit.parallel.pipeline.measured import bubbles_by_round, steps_taking_turns
from labkit.parallel.pipeline.schedule import (
    KINDS,
    SPLIT_BACKWARD,
    Action,
    Message,
    communication_plan,
    peak_in_flight,
    schedule,
)
from labkit.parallel.pipeline.simulate import HandOver, simulate_pipeline
from labkit.parallel.pipeline.stage_run import StageLink
from labkit.parallel.pipeline.timeline import PipelineEvent, measured_bubble
from labkit.parallel.pipeline.zero_bubble import dualpipe_v, zero_bubble_h1

__all__ = ["HANDOVER_SIZES", "KINDS", "SPLIT_BACKWARD",
           "Action", "HandOver", "Message", "PipelineEvent", "PipelineResult", "StageLink",
           "bubbles_by_round", "communication_plan", "dualpipe_v", "fitted_handover", "handover_seconds_by_size",
           "measure_handover",
           "measured_bubble", "peak_in_flight", "run_pipeline", "schedule", "simulate_pipeline", "stage_layers",
           "steps_taking_turns", "zero_bubble_h1"]
