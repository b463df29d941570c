"""Context parallelism: one sequence split over the ranks of a `cp` group, attention computed exactly all the same.

Everything in a transformer but attention acts on each position alone, so a rank holding 1/cp of the sequence runs
it on its positions and keeps 1/cp of the activations. Attention mixes positions: each query needs every key and
value before it. Two ways to give it them, both here, both equal to one process:

    ring_attention(q, k, v, length, group)       Ring attention (Liu et al. 2023, "Ring Attention with Blockwise
                                                 Transformers for Near-Infinite Context"): each rank keeps its
                                                 queries and passes its keys and values around the ring, cp - 1
                                                 steps; each step's partial attention is merged into the running
                                                 one by the log-sum-exp rule (merge_partials). Never more than two
                                                 blocks of K and V held at once.
    allgather_attention(q, k, v, length, group)  All-gather K and V first, then attend (Llama 3 training, Dubey et
                                                 al. 2024, "The Llama 3 Herd of Models", section 3.3.2): simpler,
                                                 any mask, but every rank holds the whole sequence's K and V.

Causal attention on a contiguous split idles ranks: rank 0's queries see only its own block, the last rank's see
every block, so the last rank computes cp times rank 0's work while the others wait. The zig-zag (head-tail)
layout cuts the sequence into 2 cp chunks and gives rank r chunks r and 2 cp - 1 - r, an early one and a late one,
so every rank computes the same (Brandon et al. 2023, "Striped Attention", discusses the imbalance; the head-tail
order is torch's own, torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py,
_HeadTailLoadBalancer). `context_layout` gives the chunks for any length (no world size needs to divide it:
chunk sizes differ by at most one), `shard_sequence` takes a rank's positions, `attention_work` counts each rank's
score elements.

The merge (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; the rule FlashAttention uses,
Dao et al. 2022, section 3.1): a partial attention over a block of keys is its output o = softmax(s) v and its
log-sum-exp l = log sum exp(s). Two of them over disjoint blocks merge into the attention over both:

    l = max(l1, l2) + log(exp(l1 - max) + exp(l2 - max)),    o = o1 exp(l1 - l) + o2 exp(l2 - l)

The backward does not keep each step's blocks: like the forward it passes K and V around the ring again,
recomputing each block's probabilities from the saved log-sum-exp (FlashAttention's backward, Dao et al. 2022,
algorithm 4), and the gradients of K and V travel with them, one more step bringing them home. So a rank saves only
its own q, k, v, output and log-sum-exp for the backward: about 1/cp of one process's (`saved_activation_nbytes`).

Tensors are (..., positions, head_dim), the same leading dims (batch, heads) on every rank, on labkit.device(). The
ring's sends go out through labkit.comm's transport, one dist.batch_isend_irecv per step where the backend needs
it (NCCL: a send forward and a receive from behind in one batch cannot deadlock; NCCL's user guide,
"Point-to-point communication"), each counted as a "send" by labkit.parallel.counters; the all-gather variant's
collectives are _collectives.py's, counted there. labkit.plan.context_parallel_nbytes predicts both.
"""

from __future__ import annotations

import math

import torch

from labkit import groups
from labkit._refusals import refuse_while_graded
from labkit.comm.torch_transport import default_transport
from labkit.parallel._collectives import all_gather, record_collective, reduce_scatter
from labkit.plan.context_parallel import attention_work, context_layout

__all__ = ["READY_MADE", "allgather_attention", "attend_and_merge", "attention_work", "context_layout",
           "context_positions", "merge_partials", "partial_attention", "reference_attention", "ring_attention",
           "shard_sequence", "unshard_sequence"]

READY_MADE = ("labkit.parallel.context's partial_attention", "labkit.parallel.context's merge_partials")

_TAG = 61  # the ring's message tag (ordered messages between the same two ranks; NCCL ignores tags)


# ==== the layout: which positions each rank holds =================================================================

def context_positions(length: int, cp: int, rank: int, zigzag: bool = True) -> torch.Tensor:
    """The global positions rank `rank` holds, in the order it holds them (a LongTensor)."""
    return torch.cat([torch.arange(start, stop) for start, stop in context_layout(length, cp, zigzag)[rank]])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, zigzag: bool = True, dim: int = -2) -> torch.Tensor:
    """Rank `rank`'s positions of the whole sequence `x` (along `dim`), as the layout gives them."""
    index = context_positions(x.shape[dim], cp, rank, zigzag).to(x.device)
    return x.index_select(dim, index)


def unshard_sequence(parts: list[torch.Tensor], zigzag: bool = True, dim: int = -2) -> torch.Tensor:
    """The whole sequence again from every rank's part, in rank order (the inverse of shard_sequence)."""
    length = sum(part.shape[dim] for part in parts)
    order = torch.cat([context_positions(length, len(parts), r, zigzag) for r in range(len(parts))])
    joined = torch.cat(parts, dim)
    return joined.index_select(dim, torch.argsort(order).to(joined.device))


# ==== attention on one block of keys, and the merge ===============================================================

def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      diagonal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v over this block of keys, and its log-sum-exp (one per query). `diagonal`: q and k
    are the same positions and the causal mask applies inside (query i sees keys 0..i)."""
    refuse_while_graded(READY_MADE[0])
    scores = q.matmul(k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if diagonal:
        scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)).matmul(v), lse


def merge_partials(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint blocks of keys merged into the attention over both (the log-sum-exp
    rule, module docstring). Stable: exponents are taken after subtracting the larger log-sum-exp, so nothing
    overflows however large the scores; lse1 may be -inf (nothing seen yet)."""
    refuse_while_graded(READY_MADE[1])
    top = torch.maximum(lse1, lse2)
    weight1, weight2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    lse = top + torch.log(weight1 + weight2)
    return out1 * torch.exp(lse1 - lse).unsqueeze(-1) + out2 * torch.exp(lse2 - lse).unsqueeze(-1), lse


def attend_and_merge(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the ring for one pair of chunks: the attention of q over this block of keys, merged into the
    running (out, lse) (lse -inf where nothing is seen yet). What notebook 17's "your turn" asks for."""
    return merge_partials(out, lse, *partial_attention(q, k, v, diagonal))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """One process's attention over the whole sequence, what every variant must equal."""
    return partial_attention(q, k, v, diagonal=causal)[0]


def _above_diagonal(scores: torch.Tensor) -> torch.Tensor:
    rows, cols = scores.shape[-2:]
    return torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu(1)


def _pairs(mine: list[tuple[int, int]], theirs: list[tuple[int, int]], causal: bool):
    """The (query slice, key slice, diagonal) of every pair of chunks the mask leaves visible, as offsets into the
    tensors that hold `mine` and `theirs` end to end. Chunks never overlap, so a pair of two chunks is wholly
    visible (keys before queries), wholly masked (keys after), or one chunk with itself (the diagonal)."""
    q_at, pairs = 0, []
    for q0, q1 in mine:
        k_at = 0
        for k0, k1 in theirs:
            if not causal or k0 <= q0:
                pairs.append((slice(q_at, q_at + q1 - q0), slice(k_at, k_at + k1 - k0), causal and k0 == q0))
            k_at += k1 - k0
        q_at += q1 - q0
    return pairs


def _attend_block(q, k, v, out, lse, pairs, update=None) -> None:
    """Merge the attention of q over one block of keys (k, v) into the running (out, lse), pair by pair, with
    `update` (attend_and_merge, or a student's), each call given copies, so that one changing its inputs in place
    changes nothing else."""
    for qs, ks, diagonal in pairs:
        given = (out[..., qs, :], lse[..., qs], q[..., qs, :], k[..., ks, :], v[..., ks, :])
        out[..., qs, :], lse[..., qs] = (update or attend_and_merge)(*(t.clone() for t in given), diagonal)


def _block_gradients(q, k, v, do, lse, delta, dq, dk, dv, pairs) -> None:
    """Accumulate the gradients of one block into dq (this rank's queries) and dk, dv (the block's keys), the
    probabilities recomputed from the saved log-sum-exp (Dao et al. 2022, algorithm 4)."""
    scale = 1 / math.sqrt(q.shape[-1])
    for qs, ks, diagonal in pairs:
        qi, kj, vj, doi = q[..., qs, :], k[..., ks, :], v[..., ks, :], do[..., qs, :]
        scores = qi.matmul(kj.transpose(-2, -1)) * scale
        if diagonal:
            scores = scores.masked_fill(_above_diagonal(scores), float("-inf"))
        p = torch.exp(scores - lse[..., qs].unsqueeze(-1))
        dv[..., ks, :] += p.transpose(-2, -1).matmul(doi)
        ds = p * (doi.matmul(vj.transpose(-2, -1)) - delta[..., qs].unsqueeze(-1))
        dq[..., qs, :] += ds.matmul(kj) * scale
        dk[..., ks, :] += ds.transpose(-2, -1).matmul(qi) * scale


# ==== the ring ====================================================================================================

class _Ring:
    """This rank's place in the ring of `group`, the layout of a `length`-token sequence over it, and the step:
    at step s a rank holds the block of rank (r - s) mod cp."""

    def __init__(self, length: int, group, zigzag: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.group, self.cp, self.rank = group, groups.group_size(group), groups.group_rank(group)
        self.layout = context_layout(length, self.cp, zigzag)
        held = sum(stop - start for start, stop in self.layout[self.rank])
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[-2] != held:
                raise ValueError(f"rank {self.rank} of {self.cp} holds {held} of the {length} positions "
                                 f"({'zig-zag' if zigzag else 'contiguous'} layout), but its {name} has "
                                 f"{t.shape[-2]} (shape {tuple(t.shape)}): shard q, k and v with "
                                 "labkit.parallel.context.shard_sequence and pass the whole sequence's length.")
        if not (q.shape == k.shape == v.shape):
            raise ValueError(f"q, k and v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)}.")

    def owner(self, step: int) -> int:
        return (self.rank - step) % self.cp

    def positions(self, owner: int) -> int:
        return sum(stop - start for start, stop in self.layout[owner])

    def shift(self, tensors: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        """Send `tensors` (the block of owner(step)) to the next rank; return the previous rank's, the block of
        owner(step + 1), shaped alike: one message each way, counted as a "send"."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        coming = self.positions(self.owner(step + 1))
        shapes = [(*t.shape[:-2], coming, t.shape[-1]) for t in tensors]
        arriving = flat.new_empty(sum(math.prod(shape) for shape in shapes))
        record_collective("send", flat, self.group)
        transport = default_transport(self.group)
        for pending in transport.exchange(flat, (self.rank + 1) % self.cp, arriving, (self.rank - 1) % self.cp,
                                          _TAG):
            pending.wait()
        return [piece.view(shape) for piece, shape in
                zip(arriving.split([math.prod(shape) for shape in shapes]), shapes, strict=True)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, length, group, causal, zigzag, update):
        ring = _Ring(length, group, zigzag, q, k, v)
        mine = ring.layout[ring.rank]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        block = [k, v]
        for step in range(ring.cp):
            _attend_block(q, *block, out, lse, _pairs(mine, ring.layout[ring.owner(step)], causal), update)
            if step < ring.cp - 1:
                block = ring.shift(block, step)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal = ring, causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        ring, mine = ctx.ring, ctx.ring.layout[ctx.ring.rank]
        do = do.contiguous()
        delta = (do * out).sum(-1)
        dq = torch.zeros_like(q)
        block = [k, v, torch.zeros_like(k), torch.zeros_like(v)]  # the block, and its gradients travelling along
        for step in range(ring.cp):
            _block_gradients(q, block[0], block[1], do, lse, delta, dq, block[2], block[3],
                             _pairs(mine, ring.layout[ring.owner(step)], ctx.causal))
            if step < ring.cp - 1:
                block = ring.shift(block, step)
        # The gradients now held belong to rank r + 1 (owner(cp - 1)): one more step hands every block's home.
        dk, dv = ring.shift(block[2:], ring.cp - 1) if ring.cp > 1 else block[2:]
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, group=None, causal: bool = True,
                   zigzag: bool = True, update=None) -> torch.Tensor:
    """Attention of this rank's queries over the whole `length`-token sequence, K and V passed around the ring of
    `group` (None: the world); q, k, v hold this rank's positions as `context_layout` gives them. Forward and
    backward equal one process's attention (tests/distributed/test_context_parallel.py). `update(out, lse, q, k,
    v, diagonal)` is the forward's step (attend_and_merge by default; notebook 17's grader passes a student's);
    the backward recomputes with its own."""
    return _RingAttention.apply(q, k, v, length, group, causal, zigzag, update)


# ==== the all-gather variant ======================================================================================

class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, length, group, causal, zigzag):
        ring = _Ring(length, group, zigzag, q, k, v)
        keys, values = _gather_blocks(ring, k, v)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        everyone = [chunk for chunks in ring.layout for chunk in chunks]
        _attend_block(q, keys, values, out, lse, _pairs(ring.layout[ring.rank], everyone, causal))
        ctx.save_for_backward(q, keys, values, out, lse)
        ctx.ring, ctx.causal = ring, causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, keys, values, out, lse = ctx.saved_tensors
        ring = ctx.ring
        do = do.contiguous()
        dq, dkeys, dvalues = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        everyone = [chunk for chunks in ring.layout for chunk in chunks]
        _block_gradients(q, keys, values, do, lse, (do * out).sum(-1), dq, dkeys, dvalues,
                         _pairs(ring.layout[ring.rank], everyone, ctx.causal))
        dk, dv = _scatter_blocks(ring, dkeys, dvalues)
        return dq, dk, dv, None, None, None, None


def _padded(ring: _Ring) -> int:
    return max(ring.positions(r) for r in range(ring.cp))


def _gather_blocks(ring: _Ring, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's K and V in one all_gather (each rank's block padded to the longest), end to end in rank order:
    the whole sequence's, in the layout's order."""
    width = _padded(ring)
    part = torch.stack([_pad(k, width), _pad(v, width)])  # (2, ..., width, d)
    gathered = part.new_empty((ring.cp, *part.shape))
    all_gather(gathered.view(-1), part.reshape(-1), group=ring.group)
    blocks = [gathered[r, :, ..., :ring.positions(r), :] for r in range(ring.cp)]
    return torch.cat([b[0] for b in blocks], -2), torch.cat([b[1] for b in blocks], -2)


def _scatter_blocks(ring: _Ring, dkeys: torch.Tensor, dvalues: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's partial gradients of the whole K and V summed, each rank keeping its own block's: one
    reduce_scatter (the all-gather's backward)."""
    width, sizes = _padded(ring), [ring.positions(r) for r in range(ring.cp)]
    parts = [torch.stack([_pad(dk, width), _pad(dv, width)]) for dk, dv in
             zip(dkeys.split(sizes, -2), dvalues.split(sizes, -2), strict=True)]
    whole = torch.stack(parts).contiguous()
    mine = whole.new_empty(whole.shape[1:])
    reduce_scatter(mine.view(-1), whole.view(-1), group=ring.group)
    held = sizes[ring.rank]
    return mine[0, ..., :held, :].contiguous(), mine[1, ..., :held, :].contiguous()


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` with zero positions appended up to `width` (the longest block)."""
    if t.shape[-2] == width:
        return t
    return torch.cat([t, t.new_zeros((*t.shape[:-2], width - t.shape[-2], t.shape[-1]))], -2)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, group=None,
                        causal: bool = True, zigzag: bool = True) -> torch.Tensor:
    """The same attention as ring_attention, K and V all-gathered first (one all_gather forward, one
    reduce_scatter backward); every rank then holds, and saves, the whole sequence's K and V."""
    return _AllGatherAttention.apply(q, k, v, length, group, causal, zigzag)
