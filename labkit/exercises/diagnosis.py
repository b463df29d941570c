"""From what each rank's call left behind to what is wrong with it: the values in t, the traffic, and what the
messages carried.

A solution's traffic must be the algorithm's, per rank, S being the tensor's bytes:
    hub (naive): every message has rank 0 at one end; every other rank sends its S bytes to rank 0 and
        receives S back; rank 0 sends S to each of the others, (N-1) x S in all.
    ring: every rank sends only to its right neighbour (r + 1) mod N and receives only from its left
        one, in 2(N-1) messages (one chunk of t.tensor_split(N) per step), and exactly the bytes of the
        chunks a ring sends (`ring_nbytes_per_rank`): 2(N-1)/N x S when N divides S
        (labkit.plan.ring_allreduce_bytes; Patarasuk & Yuan 2009), and for other sizes every chunk but
        the one it completes, then every chunk but the one it receives last. Any consistent numbering of
        the chunks is accepted.

Counting is not checking: a solution could send the right messages from a scratch copy and get the values another
way (the rendezvous store, a file). So what each send carried is checked too (`hub_contents`, `ring_contents`):
the hub receives each rank's own t and sends back the sum; in a ring's reduce-scatter, the message a rank sends at
step s is the running sum of one chunk over it and the s ranks before it (its own chunk plus what it received at
the step before), and in the all-gather every message is a fully reduced chunk.

It holds what it reads, `Outcome` (one rank's call), which labkit.exercises.allreduce's rank side fills and its
checks pass here: the grader imports this module, never the reverse.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from labkit.checks import whole
from labkit.plan.counts import shard_sizes
from labkit.plan.traffic import naive_allreduce_bytes, ring_allreduce_bytes

__all__ = ["Outcome", "hub_contents", "ring_contents", "ring_nbytes_per_rank"]


@dataclass
class Outcome:
    """What one rank's call of the student's AllReduce left behind (labkit.exercises.allreduce's attempt): t's
    values, what fn returned, and every message it posted (with the values each send carried, `sent_values`,
    copied as it was posted)."""

    tensor: list[float]
    returned: list | None  # a tensor fn returned other than t, as a list
    same_memory: bool  # t still uses the memory it came in
    sends: list[tuple[int, int]] = field(default_factory=list)  # (dst, nbytes) per message, in order
    recvs: list[tuple[int, int]] = field(default_factory=list)  # (src, nbytes)
    forbidden: list[str] = field(default_factory=list)  # what it called that is switched off
    unwaited: list[tuple[str, int]] = field(default_factory=list)  # ("send" or "recv", peer) never waited
    posts: list[tuple] = field(default_factory=list)  # groups of ("send"/"recv", peer) as NCCL runs them
    sent_values: list[list[float]] = field(default_factory=list)  # per send, in order: the values it carried


def ring_nbytes_per_rank(numel: int, world_size: int, element_size: int = 4,
                         order: tuple[int, ...] | None = None) -> list[int]:
    """Bytes each rank sends in a ring AllReduce of `numel` elements cut with tensor_split(world_size).

    In a ring what rank r sends at step s is what rank r - 1 sent at step s - 1, so it is chunk
    order[(r - s) mod N] for one numbering `order` of the chunks. Rank r completes chunk order[r + 1], the
    one it never sends in the reduce-scatter; in the all-gather it sends every chunk but order[r + 2], the
    last it receives. The default is the lesson's numbering (rank r sends chunk r - s - 1 and completes
    chunk r). When N divides numel, every rank sends 2(N-1)/N x S bytes (labkit.plan.ring_allreduce_bytes).

    >>> ring_nbytes_per_rank(10, 4)    # chunks of 3, 3, 2, 2 elements, 4 bytes each
    [56, 60, 64, 60]
    """
    numel, world_size = whole("numel", numel, minimum=0), whole("world_size", world_size)
    element_size = whole("element_size", element_size)
    sizes = shard_sizes(numel, world_size)  # torch.tensor_split's chunk sizes
    order = order or tuple((i - 1) % world_size for i in range(world_size))
    return [element_size * (2 * numel - sizes[order[(r + 1) % world_size]] - sizes[order[(r + 2) % world_size]])
            for r in range(world_size)]


def wrong_values(outcomes: list[Outcome], inputs: list[torch.Tensor], ring: bool,
                 earlier: torch.Tensor | None = None) -> str | None:
    """The first rank whose t does not hold the sum of `inputs` (each rank's t as it came in), in its own memory,
    and the likely reason. `earlier`: the sum an earlier call of the same function gave, if any, to recognise a
    result kept from that call."""
    world_size, numel = len(outcomes), inputs[0].numel()
    inputs = [x.double().cpu() for x in inputs]
    total = sum(inputs)
    for rank, outcome in enumerate(outcomes):
        got, mine = torch.tensor(outcome.tensor, dtype=torch.float64), inputs[rank]
        if not outcome.same_memory:
            return (f"rank {rank}'s t was pointed at new memory (t.set_ or t.data = ...): an AllReduce works in "
                    "place, in t's own memory, so that every view of it (a gradient bucket, a parameter) sees the "
                    "sum.")
        if torch.equal(got, total):
            continue
        if outcome.returned is not None and torch.equal(torch.tensor(outcome.returned, dtype=torch.float64), total):
            state = "unchanged" if torch.equal(got, mine) else f"{got.tolist()}"
            return (f"rank {rank} returned the sum in a new tensor, but its t is {state}: the AllReduce must work "
                    "in place, so that t itself holds the sum.")
        if got.shape != total.shape:
            return f"rank {rank} ended with {got.numel()} elements in t instead of {numel}."
        if earlier is not None and torch.equal(got, earlier.double().cpu()):
            return (f"rank {rank} holds {got.tolist()}, the sum the first call gave, not this call's sum "
                    f"{total.tolist()}: a result kept from an earlier call (on a global, a class, a default "
                    "argument) is wrong as soon as the inputs change. Compute it afresh from t on every call.")
        if torch.equal(got, mine):
            return (f"rank {rank} still holds its own input {mine.tolist()}: the result never reached it. "
                    "Did the result get sent back to every rank (and received into the same tensor)?")
        if torch.equal(got, total + mine):
            return (f"rank {rank} holds its input plus the sum: it added the result to its own tensor instead "
                    "of replacing it (summed twice).")
        missing = [r for r in range(world_size) if torch.equal(total - got, inputs[r])]
        if missing:
            return (f"rank {rank} got {got.tolist()}, expected {total.tolist()}: the sum is missing rank "
                    f"{missing[0]}'s input {inputs[missing[0]].tolist()}. Did every rank's tensor get added, once?")
        if ring:
            return _wrong_ring_values(rank, got, inputs, world_size, numel)
        return f"rank {rank} got {got.tolist()}, expected {total.tolist()}."
    return None


def _wrong_ring_values(rank: int, got: torch.Tensor, inputs: list[torch.Tensor], world_size: int, numel: int) -> str:
    total = sum(inputs)
    expected = f"rank {rank} got {got.tolist()}, expected {total.tolist()}."
    if numel % world_size:  # the cases that N divides come first, so those passed
        return (f"{expected} The cases where {world_size} divides the size passed; here {numel} is not a multiple "
                f"of {world_size}, and t.tensor_split({world_size})'s chunks hold {shard_sizes(numel, world_size)} "
                "elements: a chunk or a buffer sized as if they were equal.")
    chunks = list(zip(got.tensor_split(world_size), total.tensor_split(world_size), strict=True))
    complete = [c for c, (g, t) in enumerate(chunks) if torch.equal(g, t)]
    wrong = [c for c in range(world_size) if c not in complete]
    if len(complete) == 1 and all(_partial_sum(rank, c, got, inputs) for c in wrong):
        return (f"on rank {rank} only chunk {complete[0]} is fully reduced: the reduce-scatter worked; the "
                "all-gather that passes the finished chunks around the ring is missing.")
    right = f" (chunks {complete} are right)" if complete else " (no chunk holds its sum)"
    return (f"{expected} Chunks {wrong} of t.tensor_split({world_size}) are wrong{right}: some step sent, or added "
            "into, another chunk than the ring's. Check which chunk each step sends and which it adds into.")


def _partial_sum(rank: int, chunk: int, got: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Whether chunk `chunk` of rank `rank`'s t holds the sum of some ranks' inputs, its own among them: what a
    reduce-scatter leaves in the chunks a rank does not complete. Why ask: with a chunk of one element, a wrong
    value can equal the sum by chance, and one right chunk alone is not yet the sign of a missing all-gather."""
    n = len(inputs)
    parts = [x.tensor_split(n)[chunk] for x in inputs]
    others = [r for r in range(n) if r != rank]
    return any(torch.equal(got.tensor_split(n)[chunk], parts[rank] + sum((parts[r] for r in subset),
                                                                          torch.zeros_like(parts[rank])))
               for size in range(n - 1) for subset in itertools.combinations(others, size))


def ring_traffic(outcomes: list[Outcome], numel: int, element_size: int) -> str | None:
    """Each rank: only to its right neighbour, only from its left, 2(N-1) messages, exactly a ring's bytes, for a
    tensor of `numel` elements of `element_size` bytes (t's dtype: a count that assumes 4 bytes fails)."""
    n = len(outcomes)
    nbytes = numel * element_size
    for rank, outcome in enumerate(outcomes):
        right, left = (rank + 1) % n, (rank - 1) % n
        for verb, peers, allowed in (("sent to", outcome.sends, right), ("received from", outcome.recvs, left)):
            strays = sorted({peer for peer, _ in peers} - {allowed})
            if strays:
                backwards = "" if {peer for peer, _ in peers} != {left if allowed == right else right} else \
                    f" (its {'left' if allowed == right else 'right'} neighbour only: your ring runs the wrong way)"
                return (f"rank {rank} {verb} rank(s) {strays}{backwards}. In a ring each rank sends only to its "
                        f"right neighbour, here rank {right}, and receives only from its left one, rank {left}. "
                        "The answer may be right, but this is not a ring.")
    unpaired = unmatched([(o.sends, o.recvs) for o in outcomes])
    if unpaired:
        return unpaired
    expected = ring_nbytes_per_rank(numel, n, element_size)
    rule = (f"one chunk of t.tensor_split({n}) per step, N-1 steps of reduce-scatter then N-1 of all-gather: "
            f"2(N-1)/N x S = {ring_allreduce_bytes(nbytes, n):g} bytes per rank")
    for rank, outcome in enumerate(outcomes):
        sent = sum(b for _, b in outcome.sends)
        if len(outcome.sends) != 2 * (n - 1):
            largest_chunk = shard_sizes(numel, n)[0] * element_size
            whole = "" if nbytes <= largest_chunk or all(b != nbytes for _, b in outcome.sends) else (
                f" Its messages carried the whole tensor ({nbytes} bytes): passing the whole tensor around the ring "
                "gives the right answer but moves (N-1) x S bytes per rank, more for every rank you add.")
            count = f"{len(outcome.sends)} message" + "s" * (len(outcome.sends) != 1)
            return (f"rank {rank} sent {count}, {sent} bytes in all, to rank {(rank + 1) % n}. "
                    f"A ring AllReduce sends 2(N-1) = {2 * (n - 1)} messages, {rule} (exactly {expected[rank]} bytes "
                    f"from rank {rank} here).{whole}")
    sent = tuple(sum(b for _, b in o.sends) for o in outcomes)
    accepted = {tuple(ring_nbytes_per_rank(numel, n, element_size, order))
                for order in itertools.permutations(range(n))}
    if sent not in accepted:
        rank = next(r for r in range(n) if sent[r] != expected[r])
        return (f"rank {rank} sent {sent[rank]} bytes to rank {(rank + 1) % n} in {2 * (n - 1)} messages; expected "
                f"{expected[rank]}: {rule}. Exactly, each rank sends every chunk but the one it completes in the "
                "reduce-scatter, then every chunk but the one it receives last in the all-gather. Check which "
                "chunk each step sends.")
    return None


def hub_traffic(outcomes: list[Outcome], numel: int, element_size: int) -> str | None:
    """Every message has rank 0 at one end; S bytes (numel x element_size) each way between rank 0 and every other
    rank."""
    n = len(outcomes)
    nbytes = numel * element_size
    for rank, outcome in enumerate(outcomes[1:], start=1):
        for verb, peers in (("sent to", outcome.sends), ("received from", outcome.recvs)):
            strays = sorted({peer for peer, _ in peers} - {0})
            if strays:
                return (f"rank {rank} {verb} rank(s) {strays}. In the naive AllReduce every message has rank 0, the "
                        "hub, at one end: every other rank sends to rank 0 and receives from rank 0 only. The answer "
                        "may be right, but it did not go through the hub.")
    unpaired = unmatched([(o.sends, o.recvs) for o in outcomes])
    if unpaired:
        return unpaired
    per_peer = (f"each rank sends its whole tensor (S = {nbytes} bytes) to rank 0 once and receives the sum back "
                f"once; rank 0 sends S to each of the others, (N-1) x S = {naive_allreduce_bytes(nbytes, n):g} "
                "bytes in all")
    hub = outcomes[0]
    for rank, outcome in enumerate(outcomes[1:], start=1):
        for who, verb, count, peer in (
            (f"rank {rank}", "sent", sum(b for _, b in outcome.sends), "to rank 0"),
            (f"rank {rank}", "received", sum(b for _, b in outcome.recvs), "from rank 0"),
            ("rank 0 (the hub)", "sent", sum(b for p, b in hub.sends if p == rank), f"to rank {rank}"),
            ("rank 0 (the hub)", "received", sum(b for p, b in hub.recvs if p == rank), f"from rank {rank}"),
        ):
            if count != nbytes:
                return f"{who} {verb} {count} bytes {peer}, expected {nbytes}: in the naive AllReduce {per_peer}."
    return None


def unmatched(messages: list[tuple[list, list]]) -> str | None:
    """A send that no recv took, or a recv that no send filled, given each rank's (sends, recvs): left
    over, it would meet the next call's messages."""
    for src, dst in itertools.permutations(range(len(messages)), 2):
        sent = [b for peer, b in messages[src][0] if peer == dst]
        received = [b for peer, b in messages[dst][1] if peer == src]
        if sent != received:
            return (f"rank {src} sent {len(sent)} message(s) to rank {dst} (bytes: {sent}), but rank {dst} posted "
                    f"{len(received)} receive(s) from rank {src} (bytes: {received}). Every send needs exactly one "
                    "recv of the same size on the other rank, and every recv one send.")
    return None



_SCRATCH = ("The right number of messages of the right sizes is not enough: messages sent from a scratch copy, with "
            "the values obtained another way (the rendezvous store, a file, a recomputation), are not an AllReduce.")


def hub_contents(outcomes: list[Outcome], inputs: list[torch.Tensor]) -> str | None:
    """What the hub's messages carried (checked after hub_traffic: S bytes each way per rank): every other rank
    sends its own t, as it came in (`inputs`), to rank 0; rank 0 sends the sum back to each. A tensor sent in
    pieces is read whole, its messages in order."""
    inputs = [x.double().cpu() for x in inputs]
    total = sum(inputs)
    rule = ("In the naive AllReduce each rank sends its own t, as it came in, to rank 0, and rank 0 sends the sum of "
            f"all of them back to each rank. {_SCRATCH}")
    for rank, outcome in enumerate(outcomes[1:], start=1):
        carried = _carried(outcome, 0)
        if not _carries(carried, inputs[rank]):
            return f"rank {rank}'s message to rank 0 carried {carried}, not its t {inputs[rank].tolist()}. {rule}"
    for dst in range(1, len(outcomes)):
        carried = _carried(outcomes[0], dst)
        if not _carries(carried, total):
            return f"rank 0's message to rank {dst} carried {carried}, not the sum {total.tolist()}. {rule}"
    return None


def _carried(outcome: Outcome, dst: int) -> list[float]:
    """The values of every message `outcome`'s rank sent to rank `dst`, in order."""
    return [x for (peer, _), values in zip(outcome.sends, outcome.sent_values, strict=True) if peer == dst
            for x in values]


def ring_contents(outcomes: list[Outcome], inputs: list[torch.Tensor]) -> str | None:
    """What the ring's messages carried (checked after ring_traffic: 2(N-1) messages per rank, in order): at step s
    of the reduce-scatter a chunk of t.tensor_split(N) summed over the sender and the s ranks before it, in the
    all-gather a fully reduced chunk. Any numbering of the chunks is accepted."""
    n = len(outcomes)
    chunks = [x.double().cpu().tensor_split(n) for x in inputs]  # chunks[rank][c]
    totals = [sum(chunks[r][c] for r in range(n)) for c in range(n)]
    for rank, outcome in enumerate(outcomes):
        for index, values in enumerate(outcome.sent_values):
            reducing = index < n - 1
            allowed = ([sum(chunks[(rank - j) % n][c] for j in range(index + 1)) for c in range(n)] if reducing
                       else totals)
            if any(_carries(values, chunk) for chunk in allowed):
                continue
            if reducing:
                should = (f"a chunk of t.tensor_split({n}) summed over rank {rank} and the {index} rank(s) before it "
                          "in the ring" if index else f"one of rank {rank}'s own chunks of t.tensor_split({n})")
                step = f"step {index + 1} of the reduce-scatter"
            else:
                should = f"a fully reduced chunk of t.tensor_split({n}) (one of {[c.tolist() for c in totals]})"
                step = f"step {index - n + 2} of the all-gather"
            return (f"rank {rank}'s message at {step} carried {values}, which is not {should}. In a ring's "
                    "reduce-scatter each message carries the running sum of one chunk (the rank's own chunk plus "
                    "what it received at the step before); in the all-gather each carries a chunk that is fully "
                    f"reduced. {_SCRATCH}")
    return None


def _carries(values: list[float], expected: torch.Tensor) -> bool:
    """Whether a message's values are exactly `expected` (whole numbers: every sum of them is exact)."""
    return len(values) == expected.numel() and torch.equal(torch.tensor(values, dtype=torch.float64), expected)

