"""What a hand-over between pipeline stages costs on this machine, measured on labkit's transport and fitted
(alpha-beta), for simulate_pipeline.

    handover_seconds_by_size(sizes, compute_seconds)   inside a rank: ranks 0 and 1 hand tensors back and forth
    fitted_handover(per_rank)                          the HandOver those readings give (alpha-beta, posting)
    measure_handover(compute_seconds)                  from the notebook: both, in one labkit.run

A stage hands over as run_pipeline does: its neighbour posted the receive ahead (a fresh buffer) and waits; the
stage computes, then posts the send. So the probe is a ping-pong in which each message goes out after
`compute_seconds` of emulated compute (a sleep, as run_pipeline's emulate_compute_seconds) to a rank blocked in
its wait. That matters: a process that slept 20 ms posts and wakes more slowly than one in a tight loop (its core
went idle), so a bare ping-pong would price the hand-over too low. Half the round trip, less the time the other
rank took to answer, is one message's one-way time; plan.fit_point_to_point fits alpha + n beta to it. Each rank
also times its own isend and irecv calls: the poster's share, during which a stage computes nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

import labkit
from labkit.checks import number, numbers_list, whole
from labkit.comm.torch_transport import default_transport
from labkit.parallel.pipeline.simulate import HandOver
from labkit.plan.traffic import fit_point_to_point

__all__ = ["FIT_TRIES", "HANDOVER_SIZES", "fitted_handover", "handover_seconds_by_size", "measure_handover"]

HANDOVER_SIZES = (1 << 10, 16 << 10, 256 << 10, 1 << 20)  # bytes: a pipeline's activations, and enough for beta
FIT_TRIES = 4  # measurements merged before giving up: a busy machine's noise can hide 1 MB's extra time in one
_PING, _PONG = 11, 12  # message tags


def handover_seconds_by_size(sizes_nbytes: Iterable[int], compute_seconds: float, rounds: int = 9,
                             group=None) -> dict[str, object]:
    """Inside a rank of `group` (None: the world; at least 2 ranks, ranks 0 and 1 hand over, the others only
    join the barriers): each size's `rounds` ping-pongs of a float32 tensor on default_transport(group), each
    message sent after `compute_seconds` of sleep to a rank that posted its receive ahead and waits.

    Returns this rank's own readings: "backend" (of the transport), "sizes", and per size lists of "turn" seconds (rank
    0: from its send to the reply's arrival; rank 1: from the ping's arrival to its reply's send), "send" and
    "recv" seconds (its isend and irecv calls, the buffer's allocation included, as a stage's). The first round
    of each size is a warm-up, not kept."""
    sizes = [whole("sizes_nbytes", n) for n in sizes_nbytes]
    compute = number("compute_seconds", compute_seconds)
    rounds = whole("rounds", rounds)
    transport = default_transport(group)
    if transport.world_size < 2:
        raise ValueError("handover_seconds_by_size needs 2 ranks or more: ranks 0 and 1 hand tensors over.")
    device = labkit.device()
    readings = {"backend": transport.carriage(torch.empty(0, device=device)).backend, "sizes": sizes,
                "turn": [], "send": [], "recv": []}
    for nbytes in sizes:
        payload = torch.zeros(max(1, nbytes // 4), device=device)
        kept = {"turn": [], "send": [], "recv": []}
        for round_ in range(rounds + 1):
            dist.barrier(group=group)
            if transport.rank < 2:
                reading = dict(zip(("turn", "send", "recv"), _hand_over(transport, payload, compute), strict=True))
                for key, seconds in reading.items() if round_ else ():
                    kept[key].append(seconds)
        for key, values in kept.items():
            readings[key].append(values)
    return readings


def _hand_over(transport, payload: torch.Tensor, compute_seconds: float) -> tuple[float, float, float]:
    """One ping-pong between ranks 0 and 1: (turn, send, recv) seconds as handover_seconds_by_size names them."""
    peer = 1 - transport.rank
    started = time.perf_counter()
    buffer = torch.empty_like(payload)
    arriving = transport.irecv(buffer, peer, _PONG if transport.rank == 0 else _PING)
    recv = time.perf_counter() - started
    if transport.rank == 1:
        arriving.wait()
        arrived = time.perf_counter()
    time.sleep(compute_seconds)  # the stage computes
    posting = time.perf_counter()
    sending = transport.isend(payload.detach().contiguous(), peer, _PING if transport.rank == 0 else _PONG)
    send = time.perf_counter() - posting
    if transport.rank == 0:
        arriving.wait()
        turn = time.perf_counter() - posting
    else:
        turn = posting - arrived
    sending.wait()
    return turn, send, recv


def measure_handover(compute_seconds: float, sizes_nbytes: Iterable[int] = HANDOVER_SIZES, rounds: int = 9,
                     world_size: int = 2, timeout: float = 300.0) -> tuple[HandOver, dict[int, float]]:
    """From the notebook: a HandOver fitted on this machine, and the one-way seconds it was fitted to (size ->
    median over `rounds`), from labkit.run of handover_seconds_by_size on `world_size` ranks: once, or, when a busy
    machine's noise leaves times that do not grow with size (fit_point_to_point refuses them), again with the
    readings merged, FIT_TRIES times at most."""
    sizes = [int(n) for n in numbers_list("sizes_nbytes", sizes_nbytes, inclusive=False)]
    per_rank: list[list[dict]] = []
    for _ in range(FIT_TRIES):
        readings = labkit.run(handover_seconds_by_size, sizes, compute_seconds, rounds, world_size=world_size,
                              timeout=timeout)
        per_rank = [[*mine, reading] for mine, reading in zip(per_rank or [[] for _ in readings], readings,
                                                              strict=True)]
        try:
            return fitted_handover(per_rank)
        except ValueError as refused:   # the medians did not grow with size: noise from a busy machine
            why = refused
    raise RuntimeError(f"the hand-over could not be fitted after {FIT_TRIES} x {rounds} rounds: {why} The machine "
                       "is too busy to time messages this small; rerun the cell when it is quieter.") from why


def fitted_handover(per_rank: Sequence[dict | Sequence[dict]]) -> tuple[HandOver, dict[int, float]]:
    """The HandOver that every rank's handover_seconds_by_size readings give (labkit.run's list; a rank's entry
    may be a list of several calls' readings, of the same sizes, merged), and the one-way seconds per size.

    One-way = (rank 0's turn - rank 1's turn) / 2 per round, the median per size; alpha, beta =
    plan.fit_point_to_point of the medians; the posting times are the medians of every send and receive call of
    both ranks (a pipeline's messages are small: posting hardly grows with them); rendezvous on gloo (a send
    waits for its receive, Pair::send)."""
    zero, one = (_merged(readings) for readings in per_rank[:2])
    sizes = zero["sizes"]
    one_way = {n: statistics.median((a - b) / 2 for a, b in zip(mine, theirs, strict=True))
               for n, mine, theirs in zip(sizes, zero["turn"], one["turn"], strict=True)}
    alpha, beta = fit_point_to_point(list(one_way), list(one_way.values()))
    posted = {key: statistics.median(s for rank in (zero, one) for per_size in rank[key] for s in per_size)
              for key in ("send", "recv")}
    handover = HandOver(alpha_seconds=alpha, beta_seconds_per_byte=beta, send_post_seconds=posted["send"],
                        recv_post_seconds=posted["recv"], rendezvous=zero["backend"] == "gloo")
    return handover, one_way


def _merged(readings: dict | Sequence[dict]) -> dict:
    """One rank's readings: as given, or several calls' lists joined size by size."""
    if isinstance(readings, dict):
        return readings
    first = readings[0]
    return {"backend": first["backend"], "sizes": first["sizes"],
            **{key: [sum((r[key][i] for r in readings), []) for i in range(len(first["sizes"]))]
               for key in ("turn", "send", "recv")}}
