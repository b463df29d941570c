"""Pipeline schedules: which forward and backward each stage runs, in what order, and the messages in between.

GPipe (Huang et al. 2019): every forward, then every backward (in micro-batch order, as torch's ScheduleGPipe
does); m micro-batches of activations wait on each stage. 1F1B (PipeDream-Flush, Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2): stage r runs
min(p - r - 1, m) warm-up forwards, then one forward and one backward in turn, then the remaining backwards; at
most min(p - r, m) micro-batches wait. Interleaved 1F1B (the same paper, section 2.2.2): the model is cut into
v p chunks and stage r holds v of them, r, r + p, ..., r + (v-1) p, so that a micro-batch passes every stage v
times and the pipeline fills and drains in chunks 1/v the size. Each chunk is a virtual stage (Megatron-LM's
"virtual pipeline stage": its virtual_pipeline_model_parallel_size is v): v p virtual stages on p devices. The
orders match torch.distributed.pipelining's (tested). Zero-bubble ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", section 3.1) splits each backward in two: B, the gradient with respect to the stage's input, which the
previous stage waits for, and W, the gradient with respect to its weights, which nobody waits for; deferred W's fill
the bubble 1F1B leaves (zero_bubble.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from labkit._refusals import refuse_while_graded
from labkit.checks import choice, flag, whole
from labkit.parallel.pipeline.action import Action
from labkit.parallel.pipeline.layout import V_SHAPED, piece_after, piece_before
from labkit.parallel.pipeline.zero_bubble import dualpipe_v, zero_bubble_h1

__all__ = ["KINDS", "SPLIT_BACKWARD", "Action", "Message", "chunks_per_stage", "communication_plan", "peak_in_flight",
           "schedule"]

KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipe-v")
# kinds whose backward is split: "B" the input gradient, "W" the weight gradient, "BW" both at once
SPLIT_BACKWARD = ("zb-h1", "dualpipe-v")
_MANY_CHUNKS = ("interleaved", *V_SHAPED)  # a stage's receives ordered per direction: forward and backward
_TAG_CHUNK_STRIDE = 2**20  # a Message's tag: chunk c's tags start at c * 2**20 (gloo's tags are 32-bit)


def schedule(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """Each stage's actions, in the order it runs them, for "gpipe", "1f1b", "interleaved", "zb-h1" or
    "dualpipe-v" (case ignored; the last two: zero_bubble.zero_bubble_h1 and zero_bubble.dualpipe_v, whose two
    chunks per stage are implied: pass chunks=1 or 2).

    "interleaved" takes `chunks` = v >= 2 per stage (v virtual stages per device) and m a multiple of p
    (Megatron-LM's requirement: the micro-batches go through in groups of p). Its order is torch 2.13's
    ScheduleInterleaved1F1B (tested) and Megatron-LM's forward_backward_pipelining_with_interleaving: stage r's
    forward number k runs chunk (k // p) mod v, its backward number k chunk v - 1 - (k // p) mod v, each on
    micro-batch (k // (v p)) p + k mod p; (v-1) p + 2 (p - r - 1) warm-up forwards (at most m v), then one forward
    and one backward in turn, then the remaining backwards. (Where m = p, Megatron-LM runs every forward first;
    torch, and this, keep the warm-up above: fewer activations held, the same bubble.)

    >>> [" ".join(map(str, actions)) for actions in schedule("1f1b", 3, 4)]
    ['F0 F1 F2 B0 F3 B1 B2 B3', 'F0 F1 B0 F2 B1 F3 B2 B3', 'F0 B0 F1 B1 F2 B2 F3 B3']
    >>> for actions in schedule("interleaved", 2, 4, chunks=2):  # F3.1: micro-batch 3's forward, chunk 1
    ...     print(" ".join(map(str, actions)))
    F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3
    F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3
    """
    refuse_while_graded("labkit.parallel.pipeline's schedule")  # notebook 06 asks for one stage's order: graded
    kind, p, m, v = _checked(kind, stages, microbatches, chunks)
    if kind == "zb-h1":
        return [zero_bubble_h1(r, p, m) for r in range(p)]
    if kind == "dualpipe-v":
        return dualpipe_v(p, m)
    return [_interleaved(r, p, m, v) if kind == "interleaved" else _one_chunk(kind, r, p, m) for r in range(p)]


def _checked(kind, stages, microbatches, chunks) -> tuple[str, int, int, int]:
    """The schedule's kind (lower case), p, m and v, once they make a schedule."""
    kind = choice("kind", kind.lower() if isinstance(kind, str) else kind, KINDS)
    p, m, v = whole("stages", stages), whole("microbatches", microbatches), whole("chunks", chunks)
    if kind in V_SHAPED:
        return kind, p, _v_shaped_microbatches(kind, p, m, v), 2
    if kind != "interleaved" and v != 1:
        raise ValueError(f"chunks={v}: {kind!r} runs one chunk per stage; more (chunks >= 2) is kind='interleaved'.")
    if kind == "interleaved" and v == 1:
        raise ValueError("chunks=1: 'interleaved' needs chunks >= 2 per stage (with one chunk it is '1f1b').")
    if kind == "interleaved" and m % p:
        raise ValueError(f"microbatches={m}: interleaving runs micro-batches in groups of stages={p}; pass a "
                         f"multiple of {p} (Narayanan et al. 2021, section 2.2.2).")
    return kind, p, m, v


def chunks_per_stage(kind: str, chunks: int = 1) -> int:
    """How many chunks each stage holds under `kind`: `chunks`, or 2 for a V-shaped kind ("dualpipe-v")."""
    return 2 if isinstance(kind, str) and kind.lower() in V_SHAPED else whole("chunks", chunks)


def _v_shaped_microbatches(kind: str, p: int, m: int, v: int) -> int:
    """m, once it is at least the 2p pieces (torch's ScheduleDualPipeV's requirement) and chunks is 1 or 2."""
    if v not in (1, 2):
        raise ValueError(f"chunks={v}: {kind!r} runs two chunks per stage, laid out as a V; leave chunks out.")
    if m < 2 * p:
        raise ValueError(f"microbatches={m}: {kind!r} needs at least 2 x stages = {2 * p} micro-batches (its V's "
                         "2p pieces; torch's ScheduleDualPipeV refuses fewer).")
    return m


def _warmup(kind: str, r: int, p: int, m: int, v: int) -> int:
    """How many forwards stage r runs before its steady state (one forward, one backward in turn)."""
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - r - 1, m)
    return min((v - 1) * p + 2 * (p - r - 1), m * v)


def _one_chunk(kind: str, r: int, p: int, m: int) -> list[Action]:
    """Stage r's GPipe or 1F1B order: warm-up forwards, then one forward and one backward, then backwards."""
    refuse_while_graded("labkit.parallel.pipeline's schedule")
    warmup = _warmup(kind, r, p, m, 1)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(m - warmup, m)]  # cool-down


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    """Stage r's interleaved 1F1B order (see schedule): forward and backward number k, counted per kind."""
    total, warmup = m * v, _warmup("interleaved", r, p, m, v)

    def forward(k: int) -> Action:
        return Action("F", k // (p * v) * p + k % p, k // p % v)

    def backward(k: int) -> Action:
        return Action("B", k // (p * v) * p + k % p, v - 1 - k // p % v)

    actions = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [forward(warmup + k), backward(k)]
    return actions + [backward(k) for k in range(total - warmup, total)]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most activations held along one stage's actions: those of a (micro-batch, chunk) whose forward has run
    and backward not yet. Without interleaving, micro-batches; with v chunks, each holds 1/v of the stage's
    layers' activations (interleaved 1F1B's first stage holds (v+1) p - 1 of them, 1F1B's p). Where the
    backward is split, until its W: W needs the layers' inputs (ZB-H1 holds p on every stage, 1F1B's peak).

    >>> peak_in_flight(schedule("gpipe", 4, 8)[0]), peak_in_flight(schedule("1f1b", 4, 8)[0])
    (8, 4)
    >>> peak_in_flight(schedule("interleaved", 4, 8, chunks=2)[0])  # 11 chunks of 1/2: 5.5 stages' worth
    11
    """
    released_by = ("W", "BW") if any(action.kind == "W" for action in actions) else ("B", "BW")
    waiting = peak = 0
    for action in actions:
        waiting += 1 if action.kind == "F" else -1 if action.kind in released_by else 0
        peak = max(peak, waiting)
    return peak


@dataclass(frozen=True)
class Message:
    """One point-to-point operation of a stage: "send" to or "recv" from neighbour stage `peer` micro-batch
    `microbatch`'s "activation" (forward) or "gradient" (backward), or the "header" (the first activation's
    dtype and shape, so that the receiver can size its buffers). `chunk` is the chunk whose forward takes the
    activation as input (on the receiving stage; the last stage's chunk c hands on to the first stage's chunk
    c + 1), and whose backward sends the gradient back. `peer` is a stage: a rank of the pipeline's group, not
    necessarily a global rank."""
    op: str
    what: str
    microbatch: int
    peer: int
    chunk: int = 0

    @property
    def tag(self) -> int:
        """0 for the header, 2i+1 for activation i, 2i+2 for its gradient, plus chunk * 2**20 (gloo matches by
        tag; NCCL ignores tags and matches each pair's operations in posting order, which communication_plan
        keeps equal)."""
        kind = 0 if self.what == "header" else 2 * self.microbatch + (1 if self.what == "activation" else 2)
        return self.chunk * _TAG_CHUNK_STRIDE + kind

    def __str__(self) -> str:
        return f"{self.op} {self.what[0]}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def communication_plan(kind: str, stages: int, microbatches: int, chunks: int = 1,
                       receives_ahead: bool = False) -> list[list[Action | tuple[Message, ...]]]:
    """Each stage's schedule with its messages: actions, and between them groups of Messages posted together.

    After each action comes one group: its output's send, and an input's receive. In GPipe and 1F1B the
    next action's (torch's Schedule1F1B and Megatron's send_forward_recv_backward pair them the same way).
    Interleaved, the next action of the same direction's: a forward's group receives the next forward's
    activation, a backward's the next backward's gradient (the first of each after the action before it).
    With two stages both neighbours are one rank, and the 1F1B pairing posts, in a steady-state forward and
    backward, sends and receives in orders that hang (tested); the forward and backward streams each keep
    their own order. So no send waits for a later action either, and the simulator's timeline is the one
    run. A header, needed on the host before its chunk's first activation buffer exists, travels alone,
    one per chunk that receives activations.

    Why groups: under NCCL each rank runs its point-to-point operations in posting order on one stream (with
    `device_id`, eager init), and a send waits for its receive; a stage that posted "receive gradient i"
    before "send activation i", with its neighbour posting "receive activation i" first, would hang both. The
    operations of one group run together (NCCL user guide, "Group calls"; dist.batch_isend_irecv), so any
    order inside it is safe. No barrier sits between a posted receive and its send.
    tests/distributed/test_pipeline_parallel.py and test_pipeline_interleaved.py run every plan (and groups
    as posted on real ranks) through that single-stream model. With one stage and several chunks, each chunk
    hands on to the next in place: no messages.

    `receives_ahead` (gloo only): each receive but a chunk's first of its kind is posted one action of its kind
    earlier, in the group before the previous action of its kind and chunk runs (a gradient's, never before
    the forward whose output it differentiates). Gloo matches by tag and moves data on its own threads, and a
    send it posts goes straight onto the wire only if the receive is already posted; else it announces itself
    and waits for the receiver's answer, a round trip (gloo/transport/tcp/pair.cc: Pair::send, Pair::recv). A
    receive posted ahead lets the message arrive while the receiver still computes. On NCCL's single stream
    such a plan hangs (tested): there it stays False.

    >>> def show(step):
    ...     return str(step) if isinstance(step, Action) else "[" + " ".join(map(str, step)) + "]"
    >>> [" ".join(map(show, steps)) for steps in communication_plan("1f1b", 2, 2)]  # a: activation, g: gradient
    ['F0 [send h0] [send a0] F1 [send a1 recv g0] B0 [recv g1] B1', '[recv h0] [recv a0] F0 B0 [send g0 recv a1] F1 B1 \
[send g1]']
    """
    kind, p, m, v = _checked(kind, stages, microbatches, chunks)
    if 2 * m + 2 >= _TAG_CHUNK_STRIDE:
        raise ValueError(f"microbatches={m}: pass fewer than {_TAG_CHUNK_STRIDE // 2 - 1} (the messages' tags).")
    if v * _TAG_CHUNK_STRIDE >= 2**32:
        raise ValueError(f"chunks={v}: pass fewer than {2**32 // _TAG_CHUNK_STRIDE} (the messages' tags).")
    ahead = flag("receives_ahead", receives_ahead)
    return [_stage_plan(kind, actions, r, p, v, ahead) for r, actions in enumerate(schedule(kind, p, m, v))]


def _stage_plan(kind: str, actions: list[Action], r: int, p: int, v: int,
                ahead: bool) -> list[Action | tuple[Message, ...]]:
    """Stage r's actions with, after each, the group of its sends and the receives posted there (before that
    group, alone: the header it sends, the headers it receives)."""
    receive_points = (_receive_points_ahead if ahead else _receive_points)(kind, actions)
    steps: list = []
    for k in range(-1, len(actions)):
        sends = []
        if k >= 0:
            sends = _messages(kind, actions[k], "send", r, p, v)
            steps += [actions[k]] + [(m,) for m in sends if m.what == "header"]
        receiving = receive_points.get(k, [])
        steps += [header for action in receiving for header in _header_before(kind, action, r, p, v)]
        receives = [m for action in receiving for m in _messages(kind, action, "recv", r, p, v)]
        steps.append(tuple([m for m in sends if m.what != "header"] + receives))
    return [step for step in steps if step != ()]


def _receive_points(kind: str, actions: list[Action]) -> dict[int, list[Action]]:
    """After which action (its index; -1: before the first) each action's input is received: the action before
    it, or with several chunks, the one before it of its direction (forward F, or backward B, BW, W; the first of
    each, the action before it)."""
    points: dict[int, list[Action]] = {}
    latest: dict[bool, int] = {}  # forward? -> index of the latest action of that direction
    for k, action in enumerate(actions):
        forward = action.kind == "F"
        after = latest.get(forward, k - 1) if kind in _MANY_CHUNKS else k - 1
        points.setdefault(after, []).append(action)
        latest[forward] = k
    return points


def _receive_points_ahead(kind: str, actions: list[Action]) -> dict[int, list[Action]]:
    """_receive_points, each receive one action of its kind and chunk earlier: posted after the action before
    that one (its first stays where it was), a gradient's after the forward whose output it differentiates."""
    normal = {action: k for k, moved in _receive_points(kind, actions).items() for action in moved}
    index = {(a.kind, a.microbatch, a.chunk): k for k, a in enumerate(actions)}
    points: dict[int, list[Action]] = {}
    previous: dict[tuple[str, int], int] = {}  # (kind, chunk) -> index of its latest action
    for k, action in enumerate(actions):
        after = normal[action]
        if (action.kind, action.chunk) in previous:
            after = min(after, previous[action.kind, action.chunk] - 1)
        if action.kind in ("B", "BW"):
            after = max(after, index[("F", action.microbatch, action.chunk)])
        points.setdefault(after, []).append(action)
        previous[action.kind, action.chunk] = k
    return points


def _header_before(kind: str, action: Action, stage: int, stages: int, chunks: int) -> list[tuple[Message]]:
    """The header's receive, alone, before the group that receives a chunk's first activation (micro-batch 0)."""
    if action.kind != "F" or action.microbatch != 0:
        return []
    before = piece_before(kind, stage, action.chunk, stages, chunks)
    if before is None or before[0] == stage:  # the model's first piece, or handed on in place
        return []
    return [(Message("recv", "header", 0, before[0], action.chunk),)]


def _messages(kind: str, action: Action, op: str, stage: int, stages: int, chunks: int) -> list[Message]:
    """What `stage` must "recv" before `action` (its input), or "send" after it (its output; after a chunk's
    first forward, the header first): none at the model's ends, nor between chunks of one stage. A message's
    chunk is the chunk on the downstream side: the one whose forward takes the activation, whose backward sends
    the gradient."""
    forward, c = action.kind == "F", action.chunk
    if action.kind == "W":  # the weights' gradient stays on its stage
        return []
    if forward == (op == "send"):  # to or from the next piece of the model
        neighbour = piece_after(kind, stage, c, stages, chunks)
        peer, chunk = neighbour if neighbour is not None else (stage, c)
    else:  # to or from the previous piece
        neighbour = piece_before(kind, stage, c, stages, chunks)
        peer, chunk = (neighbour[0] if neighbour is not None else stage), c
    if peer == stage:  # the model's end, or the next piece on this stage: handed on in place
        return []
    what = "activation" if forward else "gradient"
    header = [Message(op, "header", 0, peer, chunk)] if forward and op == "send" and action.microbatch == 0 else []
    return header + [Message(op, what, action.microbatch, peer, chunk)]
