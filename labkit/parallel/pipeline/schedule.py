"""Pipeline schedules: which forward and backward each stage runs, in what order, and the messages in between.

GPipe (Huang et al. 2019): every forward, then every backward (in micro-batch order, as torch's ScheduleGPipe
does); m micro-batches of activations wait on each stage. 1F1B (PipeDream-Flush, Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2): stage r runs
min(p - r - 1, m) warm-up forwards, then one forward and one backward in turn, then the remaining backwards; at
most min(p - r, m) micro-batches wait. The orders match torch.distributed.pipelining's (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import choice, whole

__all__ = ["KINDS", "Action", "Message", "communication_plan", "peak_in_flight", "schedule"]

KINDS = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: the forward ("F") or backward ("B") of micro-batch `microbatch`."""
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def schedule(kind: str, stages: int, microbatches: int) -> list[list[Action]]:
    """Each stage's actions, in the order it runs them, for "gpipe" or "1f1b" (case ignored).

    >>> [" ".join(map(str, actions)) for actions in schedule("1f1b", 3, 4)]
    ['F0 F1 F2 B0 F3 B1 B2 B3', 'F0 F1 B0 F2 B1 F3 B2 B3', 'F0 B0 F1 B1 F2 B2 F3 B3']
    """
    kind = choice("kind", kind.lower() if isinstance(kind, str) else kind, KINDS)
    p, m = whole("stages", stages), whole("microbatches", microbatches)
    plan = []
    for r in range(p):
        warmup = m if kind == "gpipe" else min(p - r - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            actions += [Action("F", warmup + i), Action("B", i)]
        actions += [Action("B", i) for i in range(m - warmup, m)]  # cool-down
        plan.append(actions)
    return plan


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward has run and backward not yet, along one stage's actions.

    >>> peak_in_flight(schedule("gpipe", 4, 8)[0]), peak_in_flight(schedule("1f1b", 4, 8)[0])
    (8, 4)
    """
    waiting = peak = 0
    for action in actions:
        waiting += 1 if action.kind == "F" else -1
        peak = max(peak, waiting)
    return peak


@dataclass(frozen=True)
class Message:
    """One point-to-point operation of a stage: "send" to or "recv" from neighbour stage `peer` micro-batch
    `microbatch`'s "activation" (forward) or "gradient" (backward), or the "header" (the first activation's
    dtype and shape, so that the receiver can size its buffers). `peer` is a stage: a rank of the pipeline's
    group, not necessarily a global rank."""
    op: str
    what: str
    microbatch: int
    peer: int

    @property
    def tag(self) -> int:
        """0 for the header, 2i+1 for activation i, 2i+2 for its gradient (gloo matches by tag; NCCL ignores
        tags and matches each pair's operations in posting order, which communication_plan keeps equal)."""
        return 0 if self.what == "header" else 2 * self.microbatch + (1 if self.what == "activation" else 2)

    def __str__(self) -> str:
        return f"{self.op} {self.what[0]}{self.microbatch}"


def communication_plan(kind: str, stages: int, microbatches: int) -> list[list[Action | tuple[Message, ...]]]:
    """Each stage's schedule with its messages: actions, and between them groups of Messages posted together.

    After each action comes one group: its output's send and the next action's input's receive (torch's
    Schedule1F1B and Megatron's send_forward_recv_backward pair them the same way); the header, needed on
    the host before the first activation's buffer exists, travels alone. Why groups: under NCCL each rank
    runs its point-to-point operations in posting order on one stream (with `device_id`, eager init), and a
    send waits for its receive; a stage that posted "receive gradient i" before "send activation i", with its
    neighbour posting "receive activation i" first, would hang both. The operations of one group run
    together (NCCL user guide, "Group calls"; dist.batch_isend_irecv), so any order inside it is safe. No
    barrier sits between a posted receive and its send. tests/distributed/test_pipeline_parallel.py runs
    every group, as posted on real ranks, through that single-stream model.

    >>> def show(step):
    ...     return str(step) if isinstance(step, Action) else "[" + " ".join(map(str, step)) + "]"
    >>> [" ".join(map(show, steps)) for steps in communication_plan("1f1b", 2, 2)]  # a: activation, g: gradient
    ['F0 [send h0] [send a0] F1 [send a1 recv g0] B0 [recv g1] B1', '[recv h0] [recv a0] F0 B0 [send g0 recv a1] F1 B1 \
[send g1]']
    """
    plan = []
    for r, actions in enumerate(schedule(kind, stages, microbatches)):
        steps: list = [(Message("recv", "header", 0, r - 1),)] if r > 0 else []
        steps += [tuple(_messages(actions[0], "recv", r, stages))]
        for k, action in enumerate(actions):
            steps.append(action)
            if action == Action("F", 0) and r < stages - 1:
                steps.append((Message("send", "header", 0, r + 1),))
            after = _messages(action, "send", r, stages)
            steps.append(tuple(after + (_messages(actions[k + 1], "recv", r, stages) if k + 1 < len(actions) else [])))
        plan.append([step for step in steps if step != ()])
    return plan


def _messages(action: Action, op: str, stage: int, stages: int) -> list[Message]:
    """What `stage` must "recv" before `action` (its input), or "send" after it (its output): none at the ends."""
    forward = action.kind == "F"
    peer = stage + (1 if forward == (op == "send") else -1)
    if not 0 <= peer < stages:
        return []
    return [Message(op, "activation" if forward else "gradient", action.microbatch, peer)]
