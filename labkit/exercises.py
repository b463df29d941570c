"""Graders for the notebooks' "your turn" cells: run the student's code on real ranks and say what is wrong.

Each grader calls the student's function on 2 to 4 ranks with inputs whose sum is known, compares
every rank's result with it, and turns the usual mistakes into a hint: a rank that still holds its
own input (the result was never sent back), a rank that added the result to its input (summed
twice), a deadlock (sends and receives that do not pair up, or ranks that disagree on the hub),
sizes that are not a multiple of N. Inside the grader torch's own collectives are switched off, so
the exercise is done with point-to-point sends and receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import labkit

_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "batch_isend_irecv", "barrier")


@dataclass
class Verdict:
    """The grade: `passed`, and a message for the student. Shows itself as one line in a notebook."""

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return ("Correct! " if self.passed else "Not yet. ") + self.message

    def _repr_markdown_(self) -> str:
        return ("**✅ Correct!** " if self.passed else "**❌ Not yet.** ") + self.message


def check_naive_allreduce(fn) -> Verdict:
    """Grade `fn(tensor)`: an AllReduce (sum, in place) through a hub, built from send and recv."""
    return _grade(fn, "your naive AllReduce", cases=[(2, 3), (3, 5), (4, 4), (4, 1)], ring=False)


def check_ring_allreduce(fn) -> Verdict:
    """Grade `fn(tensor)`: a ring AllReduce (sum, in place) from send/recv, on sizes that N does not divide.
    In a ring every rank sends only to its right neighbour, rank + 1."""
    return _grade(fn, "your ring AllReduce", cases=[(2, 4), (3, 6), (4, 8), (2, 5), (3, 7), (4, 10), (4, 2)],
                  ring=True)


def _grade(fn, what: str, cases: list[tuple[int, int]], ring: bool) -> Verdict:
    if not callable(fn):
        return Verdict(False, f"pass your function itself, e.g. check(my_allreduce), not {type(fn).__name__}.")
    for world_size, numel in cases:
        try:
            outcomes = labkit.run(_attempt, fn, numel, world_size=world_size, timeout=20)
        except labkit.RankTimeout:
            return Verdict(False, f"on {world_size} ranks {what} never finished: some rank waited for a message "
                                  "that never came. Every send needs a matching recv on the other rank, in an order "
                                  "that cannot leave two ranks both waiting. Do all ranks agree on who sends to "
                                  "whom (the same hub, the same neighbours)?")
        except labkit.RankError as error:
            first = min(error.failures, key=lambda f: f.time)
            return Verdict(False, f"on {world_size} ranks, rank {first.rank} raised {first.summary}")
        problem = _diagnose([result for result, _ in outcomes], world_size, numel, ring)
        strays = {rank: sorted(set(dsts) - {(rank + 1) % world_size}) for rank, (_, dsts) in enumerate(outcomes)}
        if not problem and ring and any(strays.values()):
            rank = next(r for r, s in strays.items() if s)
            problem = (f"rank {rank} sent to rank(s) {strays[rank]}; in a ring each rank sends only to its right "
                       f"neighbour, rank {(rank + 1) % world_size}. The answer is right, but this is not a ring.")
        if problem:
            return Verdict(False, f"on {world_size} ranks with a tensor of {numel} elements, {problem}")
    return Verdict(True, f"{what} gives torch.distributed.all_reduce's answer on 2, 3 and 4 ranks, "
                         "for sizes that N divides and sizes it does not.")


def rank_input(rank: int, numel: int) -> torch.Tensor:
    """Rank r's input: (r + 1) x [1, 2, ..., numel]. Distinct per rank, so every mistake shows."""
    return (rank + 1) * torch.arange(1.0, numel + 1)


def _attempt(fn, numel: int) -> tuple[list[float], list[int]]:
    """On a rank: run the student's fn with torch's collectives switched off; (result, ranks it sent to)."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in (*_COLLECTIVES, "send", "isend")}
    destinations = []

    def forbidden(*args, **kwargs):
        raise RuntimeError("this exercise builds the collective from send/recv (or isend/irecv); "
                           "torch's ready-made collectives are switched off while it is graded.")

    def counted(original):
        def send(tensor, dst=None, *args, **kwargs):
            destinations.append(dst)
            return original(tensor, dst, *args, **kwargs)
        return send
    for name in _COLLECTIVES:
        setattr(dist, name, forbidden)
    dist.send, dist.isend = counted(saved["send"]), counted(saved["isend"])
    try:
        t = rank_input(labkit.rank(), numel)
        returned = fn(t)
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
    result = returned if isinstance(returned, torch.Tensor) else t
    return result.tolist(), destinations


def _diagnose(outcomes: list[list[float]], world_size: int, numel: int, ring: bool) -> str | None:
    total = sum(rank_input(r, numel) for r in range(world_size))
    for rank, got in enumerate(outcomes):
        got = torch.tensor(got)
        mine = rank_input(rank, numel)
        if got.shape != total.shape:
            return f"rank {rank} ended with {got.numel()} elements instead of {numel}."
        if torch.equal(got, total):
            continue
        if torch.equal(got, mine):
            return (f"rank {rank} still holds its own input {mine.tolist()}: the result never reached it. "
                    "Did the result get sent back to every rank (and received into the same tensor)?")
        if torch.equal(got, total + mine):
            return (f"rank {rank} holds its input plus the sum: it added the result to its own tensor instead "
                    "of replacing it (summed twice). Receive into the tensor, or copy the result over it.")
        if not ring:
            return f"rank {rank} got {got.tolist()}, expected {total.tolist()}."
        if numel % world_size:  # the ring's cases that N divides come first, so those passed
            return (f"rank {rank} got {got.tolist()}, expected {total.tolist()}. {numel} is not a multiple of "
                    f"{world_size}: split with tensor.tensor_split(N), whose chunks may differ by one element.")
        chunks = list(zip(got.tensor_split(world_size), total.tensor_split(world_size), strict=True))
        complete = [c for c, (g, t) in enumerate(chunks) if torch.equal(g, t)]
        if len(complete) == 1:
            return (f"on rank {rank} only chunk {complete[0]} is fully reduced: the reduce-scatter worked; "
                    "the all-gather that passes the finished chunks around the ring is missing.")
        return f"rank {rank} got {got.tolist()}, expected {total.tolist()}."
    return None


# The lesson's stack map: each NVIDIA component's purpose in one clause.
STACK_MAP = {"NCCL": "communicates", "TensorRT-LLM": "optimizes", "Triton": "serves", "NIM": "packages",
             "NeMo": "builds", "RAPIDS": "processes data"}


def check_stack_map(answers: dict[str, str]) -> Verdict:
    """Grade a matching of NVIDIA components to what they do ("NCCL" -> "communicates", ...)."""
    missing = [name for name in STACK_MAP if not answers.get(name)]
    if missing:
        return Verdict(False, f"match every component; still open: {', '.join(missing)}.")
    wrong = [name for name, verb in STACK_MAP.items() if answers[name].strip().lower() != verb]
    if not wrong:
        return Verdict(True, "NCCL communicates, TensorRT-LLM optimizes, Triton serves, NIM packages, NeMo builds, "
                             "RAPIDS processes data.")
    hint = " NCCL is a communication library: not a training framework, not a scheduler, not a server." \
        if "NCCL" in wrong else ""
    return Verdict(False, f"{len(STACK_MAP) - len(wrong)} of {len(STACK_MAP)} right; look again at "
                          f"{', '.join(wrong)}.{hint}")
