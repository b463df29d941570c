"""The pipeline simulator: a step's timeline from stage costs and what each hand-over between stages costs,
without processes.

    simulate_pipeline("1f1b", 4, 8, 1.0, 2.0)      equal stages, free hand-overs: the timeline behind (p-1)/(m+p-1)
    simulate_pipeline("1f1b", 4, 8, 0.02, 0.04, handover=HandOver(...), message_nbytes=4096, receives_ahead=True)
                                                   the step as run_pipeline runs it on gloo, hand-overs priced

It walks communication_plan, the plan the executor posts: a stage runs its actions in order and, between them,
posts its groups of messages; each action starts once its stage is free and its input is there. A hand-over
costs what HandOver says: the poster's own time to post each message (it computes nothing meanwhile) and the
message's time on the way (alpha + n beta). With HandOver() every cost is zero and the bubble is the formula's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.checks import flag, number
from labkit.comm.wire import MAX_DIMS
from labkit.parallel.pipeline.layout import piece_after, piece_before
from labkit.parallel.pipeline.schedule import SPLIT_BACKWARD, Action, Message, chunks_per_stage, communication_plan
from labkit.parallel.pipeline.timeline import PipelineEvent

__all__ = ["HEADER_NBYTES", "HandOver", "simulate_pipeline"]

HEADER_NBYTES = (2 + MAX_DIMS) * 8  # the header that sizes a chunk's activation buffers: int64 dtype, dims, shape


@dataclass(frozen=True)
class HandOver:
    """What handing a tensor to a neighbouring stage costs, in seconds (labkit.measure.handover_sweep measures it
    on labkit's transport, labkit.plan.fit_point_to_point fits alpha and beta):

    - `alpha_seconds`, `beta_seconds_per_byte`: a message of n bytes is in its receiver's buffer alpha + n beta
      after its sender starts posting it (the alpha-beta model: Thakur, Rabenseifner & Gropp 2005; half a
      ping-pong's round trip);
    - `send_post_seconds`, `recv_post_seconds`: the part of that the poster spends itself, for each send and
      each receive it posts, during which its stage computes nothing (LogP's overhead o: Culler et al. 1993):
      it delays the stage's next action;
    - `rendezvous`: a send posted before its receive waits for the receiver's answer, which takes alpha (gloo's
      TCP transport: Pair::send, Pair::recv), so the message arrives max(send, receive + alpha) + alpha + n beta.
    """
    alpha_seconds: float = 0.0
    beta_seconds_per_byte: float = 0.0
    send_post_seconds: float = 0.0
    recv_post_seconds: float = 0.0
    rendezvous: bool = False

    def __post_init__(self):
        for name in ("alpha_seconds", "beta_seconds_per_byte", "send_post_seconds", "recv_post_seconds"):
            number(name, getattr(self, name))
        flag("rendezvous", self.rendezvous)

    def arrival(self, sent: float, receive_posted: float, nbytes: float) -> float:
        """When a message of `nbytes` whose send was posted from `sent` on is in its receiver's buffer, the receive
        posted at `receive_posted`."""
        if self.rendezvous:
            sent = max(sent, receive_posted + self.alpha_seconds)
        return sent + self.alpha_seconds + nbytes * self.beta_seconds_per_byte


def simulate_pipeline(kind: str, stages: int, microbatches: int, forward_seconds: float | Sequence[float] = 1.0,
                      backward_seconds: float | Sequence[float] = 2.0, send_seconds: float = 0.0,
                      chunks: int = 1, handover: HandOver | None = None, message_nbytes: float = 0.0,
                      receives_ahead: bool = False, weight_seconds: float | Sequence[float] | None = None
                      ) -> list[PipelineEvent]:
    """The timeline of `schedule(kind, stages, microbatches, chunks)` when each stage's forward of a
    micro-batch takes `forward_seconds` and its backward `backward_seconds` (one number, or one per stage;
    with v chunks, each chunk's action takes 1/v of it), and each hand-over between stages costs what
    `handover` says for an activation or gradient of `message_nbytes` (`send_seconds` alone: a transfer of that
    many seconds, nothing else). Each action starts as soon as its stage is free, in the schedule's order, and
    its input is there: a forward after the previous piece of the model's forward (stage r - 1's, or for chunk
    c > 0 on stage 0, the last stage's chunk c - 1), a backward after the next piece's backward (and after its
    own forward, earlier in the order). The messages go as communication_plan(..., receives_ahead) posts them
    (run_pipeline's plan: receives_ahead on gloo), a chunk's first activation receive after its header is in.
    Where the schedule splits the backward ("zb-h1"), `weight_seconds` of `backward_seconds` are its W (the
    weights' gradient) and the rest its B (None: half, Qi et al. 2023's equal-cost case); elsewhere pass None.
    Events come by stage, then time.

    >>> from labkit.parallel import measured_bubble
    >>> events = simulate_pipeline("gpipe", 4, 8, 1.0, 1.0)
    >>> max(e.end for e in events), round(measured_bubble(events), 4)   # (m+p-1)(F+B); 3/11
    (22.0, 0.2727)
    >>> events = simulate_pipeline("interleaved", 4, 8, 1.0, 1.0, chunks=2)
    >>> max(e.end for e in events), round(measured_bubble(events), 4)   # (m+(p-1)/v)(F+B); 3/19
    (19.0, 0.1579)
    >>> cost = HandOver(alpha_seconds=0.03, send_post_seconds=0.02)  # a send: there 0.03 on, its poster busy 0.02
    >>> events = simulate_pipeline("gpipe", 2, 2, 1.0, 1.0, handover=cost)
    >>> round(max(e.end for e in events), 2), round(measured_bubble(events), 4)  # 6 of compute, 0.12 handing over
    (6.12, 0.3464)
    >>> events = simulate_pipeline("zb-h1", 4, 8, 1.0, 2.0)   # B and W 1.0 each: idle (p-1)(F+B-W) = 3 per stage
    >>> max(e.end for e in events), round(measured_bubble(events), 4)   # 8 x 3 busy + 3: 3/27
    (27.0, 0.1111)
    """
    plan = communication_plan(kind, stages, microbatches, chunks, flag("receives_ahead", receives_ahead))
    p, v = len(plan), chunks_per_stage(kind, chunks)
    seconds = _action_seconds(kind, p, v, forward_seconds, backward_seconds, weight_seconds)
    walk = _Walk(kind.lower(), plan, v, seconds, _handover(send_seconds, handover),
                 number("message_nbytes", message_nbytes))
    return sorted(walk.run(), key=lambda e: (e.stage, e.start))


def _action_seconds(kind, p: int, v: int, forward_seconds, backward_seconds, weight_seconds) -> dict:
    """What each kind of action ("F", "B", "W") costs on each stage: its share of the stage's cost per chunk."""
    forward, backward = _costs("forward_seconds", forward_seconds, p), _costs("backward_seconds", backward_seconds, p)
    if kind.lower() not in SPLIT_BACKWARD:
        if weight_seconds is not None:
            raise ValueError(f"weight_seconds={weight_seconds!r}: {kind!r} runs each backward whole; a W of its own is "
                             f"{' or '.join(map(repr, SPLIT_BACKWARD))}'s. Pass weight_seconds=None.")
        return {"F": [s / v for s in forward], "B": [s / v for s in backward]}
    weight = [b / 2 for b in backward] if weight_seconds is None else _costs("weight_seconds", weight_seconds, p)
    if any(w > b for w, b in zip(weight, backward, strict=True)):
        raise ValueError(f"weight_seconds={weight_seconds!r}: the W is a part of the backward, so at most "
                         f"backward_seconds={backward_seconds!r}.")
    return {"F": [f / v for f in forward], "B": [(b - w) / v for b, w in zip(backward, weight, strict=True)],
            "W": [w / v for w in weight], "BW": [b / v for b in backward]}


def _handover(send_seconds: float, handover: HandOver | None) -> HandOver:
    """The hand-over's cost: `handover`, or a transfer of `send_seconds` (not both)."""
    send = number("send_seconds", send_seconds)
    if handover is None:
        return HandOver(alpha_seconds=send)
    if not isinstance(handover, HandOver):
        raise TypeError(f"handover={handover!r}: pass a HandOver (labkit.parallel.pipeline.HandOver).")
    if send:
        raise ValueError(f"send_seconds={send_seconds} with a handover: a HandOver prices the transfer already "
                         "(its alpha_seconds and beta_seconds_per_byte); pass one or the other.")
    return handover


class _Walk:
    """Every stage through its steps of the plan: its clock, the messages posted (when), the events."""

    def __init__(self, kind: str, plan, chunks: int, seconds: dict[str, list[float]], cost: HandOver, nbytes: float):
        self.kind, self.plan, self.seconds, self.cost, self.nbytes = kind, plan, seconds, cost, nbytes
        self.p, self.v = len(plan), chunks
        self.clock, self.done = [0.0] * self.p, [0] * self.p
        self.sent: dict[tuple, float] = {}  # message key -> when its sender had posted it
        self.receiving: dict[tuple, float] = {}  # message key -> when its receiver posted the receive
        self.sized: set[tuple[int, int]] = set()  # (stage, chunk label) whose header is in
        self.events: list[PipelineEvent] = []

    def run(self) -> list[PipelineEvent]:
        """Step the stages until every one has run its plan."""
        while any(self.done[r] < len(self.plan[r]) for r in range(self.p)):
            progressed = False
            for r in range(self.p):
                while self.done[r] < len(self.plan[r]) and self._step(r, self.plan[r][self.done[r]]):
                    self.done[r] += 1
                    progressed = True
            if not progressed:  # cannot happen for these plans; a guard should one ever deadlock
                raise RuntimeError(f"simulate_pipeline: no stage can go on; next steps {self.done} of {self.plan}.")
        return self.events

    def _step(self, r: int, step) -> bool:
        """Run stage r's next step if its inputs are there (True), else leave it (False)."""
        if isinstance(step, Action):
            return self._act(r, step)
        return self._post(r, step)

    def _act(self, r: int, action: Action) -> bool:
        need = _input(self.kind, action, r, self.p, self.v)
        start = self.clock[r]
        if need is not None:
            if need not in self.sent:
                return False
            start = max(start, self._arrival(need, self.nbytes))
        end = self.clock[r] = start + self.seconds[action.kind][r]
        self.events.append(PipelineEvent(r, action.kind, action.microbatch, start, end, action.chunk))
        return True

    def _post(self, r: int, group: tuple[Message, ...]) -> bool:
        """Post a group: first, as the executor sizes its buffers, wait for the header of any chunk whose first
        activation buffer it makes; then each message in turn, each costing its poster its post time."""
        for label, peer in {(m.chunk, m.peer) for m in group if m.op == "recv" and m.what == "activation"}:
            if (r, label) in self.sized:
                continue
            header = _key(Message("recv", "header", 0, peer, label), r)
            if header not in self.sent:
                return False
            self.clock[r] = max(self.clock[r], self._arrival(header, HEADER_NBYTES))
            self.sized.add((r, label))
        for message in group:
            key = _key(message, r)
            if message.op == "send":
                self.sent[key] = self.clock[r]
                self.clock[r] += self.cost.send_post_seconds
            else:
                self.receiving[key] = self.clock[r]
                self.clock[r] += self.cost.recv_post_seconds
        return True

    def _arrival(self, key: tuple, nbytes: float) -> float:
        return self.cost.arrival(self.sent[key], self.receiving[key], nbytes)


def _key(message: Message, stage: int) -> tuple:
    """What a send and its receive share: (what, chunk label, micro-batch, from stage, to stage)."""
    pair = (stage, message.peer) if message.op == "send" else (message.peer, stage)
    return (message.what, message.chunk, message.microbatch, *pair)


def _input(kind: str, action: Action, stage: int, stages: int, chunks: int) -> tuple | None:
    """The message whose tensor `action` on `stage` takes (None: the batch, the loss, or a chunk's output handed
    on in place on this stage, already there): the previous piece's activation for a forward, the next piece's
    gradient for a backward (B or BW; a W takes the gradient its B received)."""
    i, c = action.microbatch, action.chunk
    if action.kind == "W":
        return None
    if action.kind == "F":
        before = piece_before(kind, stage, c, stages, chunks)
        return None if before is None or before[0] == stage else ("activation", c, i, before[0], stage)
    after = piece_after(kind, stage, c, stages, chunks)
    return None if after is None or after[0] == stage else ("gradient", after[1], i, after[0], stage)


def _costs(name: str, value, stages: int) -> list[float]:
    """One cost per stage: `value` repeated, or `value` itself if it is a sequence of `stages` numbers."""
    values = list(value) if isinstance(value, Sequence) else [value] * stages
    if len(values) != stages:
        raise ValueError(f"{name}: give one number, or one per stage ({stages}), not {len(values)}.")
    return [number(name, v) for v in values]
