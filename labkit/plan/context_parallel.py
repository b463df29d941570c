"""Context parallelism's arithmetic: which positions each rank holds, the attention work each computes, the bytes
its K and V exchanges move and what its attention saves for the backward. Pure Python, no torch: labkit.parallel's
context.py runs the kernels these numbers describe (ring attention, Liu et al. 2023; the all-gather variant of
Llama 3, Dubey et al. 2024, section 3.3.2), and its tests check every number here against what the ranks did.

    context_layout(length, cp, zigzag)            each rank's chunks (start, stop): zig-zag (head-tail) or contiguous
    attention_work(length, cp, zigzag, causal)    score elements each rank computes (the step waits for the largest)
    context_parallel_nbytes(...)                  bytes each rank sends, forward and backward, for either variant
    context_attention_saved_nbytes(...)           bytes each rank's attention saves for the backward

Shapes: `rows` is batch x heads (every rank the same), `head_dim` the width of one head; K and V of one position are
2 x rows x head_dim numbers. Bytes are on the wire, per rank, for ring algorithms as NCCL runs them: an all-gather of
cp parts of p bytes sends (cp - 1) p from each rank, a reduce-scatter of a whole of cp p bytes the same (Patarasuk &
Yuan 2009, "Bandwidth Optimal All-reduce Algorithms for Clusters of Workstations": each is half a ring
all-reduce).
"""

from __future__ import annotations

from labkit.checks import choice, finite_result, flag, whole

__all__ = ["CONTEXT_VARIANTS", "MAX_CP", "attention_work", "context_attention_saved_nbytes", "context_layout",
           "context_parallel_nbytes", "held_positions"]

CONTEXT_VARIANTS = ("ring", "allgather")
MAX_CP = 512  # ranks of one cp group: far beyond any published run's (Llama 3: 16), small enough to list pairs


def _checked(length, cp, zigzag) -> tuple[int, int, bool]:
    """The layout's arguments checked: cp ranks (1 to MAX_CP), a flag, and a length of a token per chunk."""
    cp, zigzag = whole("cp", cp), flag("zigzag", zigzag)
    if cp > MAX_CP:
        raise ValueError(f"cp={cp}: context parallelism over at most {MAX_CP} ranks here; pass a smaller cp.")
    pieces = 2 * cp if zigzag else cp
    length = whole("length", length)
    if length < pieces:
        raise ValueError(f"length={length}: a sequence of {length} tokens cannot be cut into {pieces} chunks (cp = "
                         f"{cp}{', zig-zag: 2 cp chunks' if zigzag else ''}); pass at least {pieces} tokens, or "
                         "fewer ranks.")
    return length, cp, zigzag


def context_layout(length: int, cp: int, zigzag: bool = True) -> list[list[tuple[int, int]]]:
    """Each rank's chunks of a `length`-token sequence as (start, stop) pairs, in the order it holds them.
    Zig-zag: 2 cp chunks, rank r holding chunks r and 2 cp - 1 - r, an early one and a late one, so that under a
    causal mask every rank computes alike (torch's _HeadTailLoadBalancer, torch/distributed/tensor/experimental/
    _context_parallel/_load_balancer.py, lays out the same order). Else cp contiguous chunks, one each. Chunk
    sizes differ by at most one (the first `length % chunks` are a token longer), so no cp needs to divide the
    length; it needs a token per chunk.

    >>> context_layout(10, 2)
    [[(0, 3), (8, 10)], [(3, 6), (6, 8)]]
    """
    length, cp, zigzag = _checked(length, cp, zigzag)
    pieces = 2 * cp if zigzag else cp
    size, longer = divmod(length, pieces)
    starts = [i * size + min(i, longer) for i in range(pieces + 1)]
    chunks = [(starts[i], starts[i + 1]) for i in range(pieces)]
    if not zigzag:
        return [[chunk] for chunk in chunks]
    return [[chunks[r], chunks[pieces - 1 - r]] for r in range(cp)]


def held_positions(length: int, cp: int, zigzag: bool = True) -> list[int]:
    """How many positions each rank holds."""
    return [sum(stop - start for start, stop in chunks) for chunks in context_layout(length, cp, zigzag)]


def attention_work(length: int, cp: int, zigzag: bool = True, causal: bool = True) -> list[int]:
    """Score elements (query-key pairs) each rank computes: every pair of a query chunk of its own with a key chunk
    the mask leaves visible (keys before, or the chunk itself, computed whole and then masked). Contiguous and
    causal: rank r computes r + 1 chunks' worth while rank 0 computes one; zig-zag evens them out.

    >>> attention_work(16, 4, zigzag=False), attention_work(16, 4)
    ([16, 32, 48, 64], [36, 36, 36, 36])
    """
    layout, causal = context_layout(length, cp, zigzag), flag("causal", causal)
    every = [chunk for chunks in layout for chunk in chunks]
    work = [sum((q1 - q0) * (k1 - k0) for q0, q1 in mine for k0, k1 in every if not causal or k0 <= q0)
            for mine in layout]
    return finite_result("attention_work", work, length=length)


def context_parallel_nbytes(length: int, cp: int, rows: int, head_dim: int, bytes_per_element: int,
                            variant: str = "ring", zigzag: bool = True) -> dict[str, list[int]]:
    """Bytes each rank sends for one attention's forward and backward, {"forward": [...], "backward": [...]} in rank
    order.

    ring: at step s rank r passes on the block of rank (r - s) mod cp, cp - 1 steps forward (K and V); the backward
    passes K, V and their gradients cp - 1 steps, then the gradients one more step home (labkit.parallel.context).
    Summed over the ranks: forward (cp - 1) x length x 2 rows head_dim elements, backward (cp - 1) x length x 4 rows
    head_dim + length x 2 rows head_dim.

    allgather: one all-gather of K and V, each rank's block padded to the longest (p positions), and its backward,
    one reduce-scatter of the gradients: (cp - 1) x p x 2 rows head_dim elements each way, on every rank."""
    choice("variant", variant, CONTEXT_VARIANTS)
    for name, value in (("rows", rows), ("head_dim", head_dim), ("bytes_per_element", bytes_per_element)):
        whole(name, value)
    held = held_positions(length, cp, zigzag)
    per_position = 2 * rows * head_dim * bytes_per_element  # K and V of one position
    if variant == "allgather":
        each = (cp - 1) * max(held) * per_position
        sent = {"forward": [each] * cp, "backward": [each] * cp}
    else:
        passed = [sum(held) - held[(r + 1) % cp] for r in range(cp)]  # blocks of r, r - 1, ..., r - cp + 2
        home = [held[(r + 1) % cp] if cp > 1 else 0 for r in range(cp)]  # the gradients it sends home at the end
        sent = {"forward": [n * per_position for n in passed],
                "backward": [(2 * n + last) * per_position for n, last in zip(passed, home, strict=True)]}
    return finite_result("context_parallel_nbytes", sent, length=length, rows=rows, head_dim=head_dim,
                         bytes_per_element=bytes_per_element)


def context_attention_saved_nbytes(length: int, cp: int, rows: int, head_dim: int, bytes_per_element: int,
                                   variant: str = "ring", zigzag: bool = True) -> list[int]:
    """Bytes each rank's attention saves for the backward: ring, its own q, k, v and output (rows x head_dim each
    per position) and log-sum-exp (rows per position), so 1/cp of cp = 1's, up to the uneven split; allgather, its
    q, output and log-sum-exp, and the whole sequence's K and V (the largest part, not divided by cp)."""
    choice("variant", variant, CONTEXT_VARIANTS)
    for name, value in (("rows", rows), ("head_dim", head_dim), ("bytes_per_element", bytes_per_element)):
        whole(name, value)
    held = held_positions(length, cp, zigzag)
    width = rows * head_dim * bytes_per_element
    lse = rows * bytes_per_element
    saved = ([n * (2 * width + lse) + 2 * length * width for n in held] if variant == "allgather"
             else [n * (4 * width + lse) for n in held])
    return finite_result("context_attention_saved_nbytes", saved, length=length, rows=rows, head_dim=head_dim,
                         bytes_per_element=bytes_per_element)
