"""ZeRO-1 and ZeRO-2 by hand: data parallelism whose optimizer state (ZeRO-1), and gradients too (ZeRO-2), are
split over the ranks instead of replicated (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020, section 5: P_os and P_os+g).

    ShardedOptimizer(params, torch.optim.AdamW, lr=...)                         ZeRO-1
    ShardedOptimizer(params, torch.optim.AdamW, shard_gradients=True, lr=...)   ZeRO-2

Layout (zero_buckets.py): the trainable parameters (each tensor once; frozen ones never touched) end to end,
per param group and dtype, in buckets of at most `bucket_mb` MiB, each cut over the group's ranks with
labkit.plan.counts.shard_sizes, so each rank owns 1/N of every bucket, up to one element. The inner optimizer
(`optimizer_cls`) sees only this rank's slice, as "pieces": 1-D views into the model's own parameters, one per
parameter the slice touches, so its state (Adam's m and v) is 1/N of the model's and no weight is copied.

A step, per bucket: the gradients are reduce-scattered (summed, then divided by the group's size) so that each
rank gets the average of its slice; the inner optimizer updates the slices; the slices are all-gathered back into
every rank's parameters. That is a reduce-scatter plus an all-gather, 2(N-1)/N x the parameter bytes sent per
rank, what DDP's all-reduce sends (paper, section 7.2.1). Both stages reduce-scatter each bucket during the
backward, as soon as its gradients are ready (post-accumulate-grad hooks, as BucketedDDP does), so the
communication overlaps the rest of the backward. What they keep differs:

- ZeRO-1 keeps every gradient (P_os shards the optimizer state only): a reduced bucket's gradients are zeroed and
  the slice this rank owns receives the group's sum, which step() divides by N for the inner optimizer and then
  restores. A later backward before zero_grad() sends that sum along with its new gradients, so accumulation
  stays exact: the reduce of (sum so far + new gradients) is the sum of everything.
- ZeRO-2 drops the gradients it sent: p.grad is None for every parameter after the backward, and the rank's
  averaged gradient slice is held by the inner optimizer's pieces. Its peak holds 1/N of the gradients plus the
  bucket being filled.

Gradient accumulation without a reduce per micro-batch: backwards inside `no_sync()` only accumulate into p.grad
(as inside torch DDP's no_sync); the first backward outside it reduces each bucket as it fills, or, if none comes,
step() reduces every bucket, in bucket order. Either way each bucket is reduce-scattered once per step, whatever
the number of micro-batches. ZeRO-2 holds the whole gradient inside no_sync(), as torch's FSDP does in its
no_sync ("FSDP will accumulate the full model gradients (instead of gradient shards) until the eventual sync",
torch.distributed.fsdp.FullyShardedDataParallel.no_sync's note).

The collectives, reduce_scatter_single and all_gather_single (gloo runs both, CPU included, in torch 2.13), are
flat_shards.py's post_reduce_scatter and post_all_gather, which ZeRO-3 uses too: each slice travels padded to the
largest, and each is counted by labkit.parallel.counters ("reduce_scatter": the padded bucket this rank puts in,
of which a ring sends (N-1)/N; "all_gather": its padded slice, of which a ring sends N-1 copies).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.weak import WeakIdKeyDictionary

from labkit import groups
from labkit.checks import flag, number, shown
from labkit.parallel._collectives import broadcast
from labkit.parallel.data import MiB
from labkit.parallel.flat_shards import post_all_gather, post_reduce_scatter
from labkit.parallel.zero_buckets import (
    Piece,
    ShardBucket,
    check_ranks_agree,
    layout_difference,
    shard_buckets,
)

__all__ = ["ShardedOptimizer"]


_hooks = WeakIdKeyDictionary()  # parameter -> the ZeRO-2 hook on it (by identity: a tensor's == is elementwise)


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (and ZeRO-2 with `shard_gradients=True`): a torch optimizer whose state for each number of the
    model lives on one rank of `group` only, and which keeps the replicas identical itself.

    DO NOT also average the gradients (no DDP, no average_gradients): step() reduce-scatters them, averaging
    over the group, as part of the update. Give every rank its slice of the batch, call backward(), then step().

    - `params`: tensors or param-group dicts, as any torch optimizer takes them; `optimizer_cls` (SGD, Adam,
      AdamW...) and `**optimizer_kwargs` build the inner optimizer over this rank's slice. The optimizer must be
      elementwise (each number updated from its own state): the slice is flattened, across parameters.
    - `group`: the data-parallel ranks (None: the world); group rank 0's trainable parameters are broadcast to
      the others at construction, so the replicas start identical (frozen parameters and buffers are not
      touched: they must agree already, as broadcast_parameters(model) makes them).
    - `bucket_mb`: the most MiB of gradients reduced together (torch DDP's 25 by default). ZeRO-2's gradients
      peak at 1/N of the model plus up to one bucket: on a small model, pass a small bucket_mb to see the saving.
    - `param_groups` are the user's groups: a change there (a learning-rate schedule) reaches the inner optimizer
      at the next step. `state` is the inner optimizer's: the state of this rank's pieces only.
    - A trainable parameter with no gradient on a rank counts as a zero gradient there, and is stepped (a torch
      optimizer would skip a parameter that has no gradient anywhere): freeze what you do not train.
    - Gradients must come from backward() (the hooks reduce them as it makes them). Several backwards
      (gradient accumulation) before a step work when every parameter gets a gradient in each; inside
      `no_sync()` they only accumulate, and the last backward (outside it) or step() reduces the sum once.
      ZeRO-2 holds the whole gradient until then. A backward inside no_sync() after one outside it, before
      step(), is refused: the buckets already reduced would never send its gradients.
    - After a backward, ZeRO-1's p.grad holds zeros except the slice this rank owns, which holds the sum of the
      group's gradients (N x their average: step() divides it for the update and restores it, so a backward
      before the next zero_grad() accumulates as in one process). ZeRO-2's p.grad stays None.
    - `state_dict()` holds this rank's slice and the layout it belongs to; `load_state_dict` refuses another's.

    Example::

        >>> import labkit, torch, torch.nn.functional as F
        >>> from labkit.models import make_classification, mlp
        >>> from labkit.parallel import ShardedOptimizer
        >>> def train(steps=3):
        ...     x, y = (t.to(labkit.device()) for t in make_classification())
        ...     model = mlp(seed=labkit.rank()).to(labkit.device())      # rank 0's weights after the next line
        ...     optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        ...     mine = slice(labkit.rank() * 256, (labkit.rank() + 1) * 256)      # this rank's half of 512
        ...     for _ in range(steps):
        ...         optimizer.zero_grad()
        ...         F.cross_entropy(model(x[mine]), y[mine]).backward()   # reduce-scatters as it goes
        ...         optimizer.step()           # AdamW on this rank's half, all-gather
        ...     state = sum(t.numel() for s in optimizer.state.values() for t in s.values() if t.dim())
        ...     return state, model[0].weight.sum().item()
        >>> (state0, w0), (state1, w1) = labkit.run(train, world_size=2)
        >>> state0, state1, w0 == w1           # m and v of 5508 numbers, half on each rank; identical replicas
        (5508, 5508, True)
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], group=None, shard_gradients: bool = False,
                 bucket_mb: float = 25.0, **optimizer_kwargs):
        groups.require_member("ShardedOptimizer", group)
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls={shown(optimizer_cls)}: pass a torch optimizer class, such as "
                            "torch.optim.AdamW (the class, not an instance).")
        self.shard_gradients = flag("shard_gradients", shard_gradients)
        self.bucket_mb = number("bucket_mb", bucket_mb, minimum=0, inclusive=False)
        self.optimizer_cls, self.group, self._building = optimizer_cls, group, True
        super().__init__(params, dict(optimizer_kwargs))
        self._building = False
        self.rank, self.size = groups.group_rank(group), groups.group_size(group)
        check_ranks_agree(self.param_groups, self.bucket_mb, group)
        self.buckets = shard_buckets(self.param_groups, self.bucket_mb * MiB, self.rank, self.size)
        self.inner = optimizer_cls([{**_hyperparameters(g), "params": [pc.tensor for pc in self._pieces(i)]}
                                    for i, g in enumerate(self.param_groups)], **optimizer_kwargs)
        self.defaults, self.state = self.inner.defaults, self.inner.state
        for g, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            g.update(_hyperparameters(inner))
        for piece in (pc for b in self.buckets for pc in b.pieces):
            self.state[piece.tensor]  # an entry per piece, so that labkit.measure finds the gradient shard
        self._next = 0  # the next bucket to reduce, in bucket order on every rank
        self._sync, self._since_step = True, False  # hooks reduce (outside no_sync); a gradient came since step()
        self._buffers: dict[tuple, torch.Tensor] = {}  # (dtype, bucket parity) -> a reused collective buffer
        self._hook_params()
        self._broadcast_from_first()

    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing: the layout is fixed then (pass every group to the constructor)."""
        if not getattr(self, "_building", False):
            raise RuntimeError("ShardedOptimizer: add_param_group after construction would change every rank's "
                               "slice; pass all param groups to the constructor.")
        super().add_param_group(param_group)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate into p.grad (ZeRO-2 too: the whole gradient); the first backward after
        it, or step(), reduces the sum, one reduce-scatter per bucket."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _pieces(self, group_index: int) -> list[Piece]:
        return [pc for b in self.buckets if b.group_index == group_index for pc in b.pieces]

    def _hook_params(self) -> None:
        """Each gradient reports when it is accumulated. A parameter answers to the last ShardedOptimizer built
        over it: an earlier one's hook goes."""
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                old = _hooks.pop(p, None)
                if old is not None:
                    old.remove()
                _hooks[p] = p.register_post_accumulate_grad_hook(lambda param, b=bucket, i=i: self._grad_ready(b, i))

    @torch.no_grad()
    def _broadcast_from_first(self) -> None:
        for bucket in self.buckets:
            for p in bucket.params:
                broadcast(p.detach(), 0, group=self.group)

    # --- The step ---

    def step(self, closure=None):
        """Reduce-scatter what the backwards left (buckets a missing gradient kept from filling, or all of them
        after backwards inside no_sync()), update this rank's slice with the inner optimizer, all-gather every
        rank's slice into the parameters. Returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            self._reduce_the_rest()
            for inner, group in zip(self.inner.param_groups, self.param_groups, strict=True):
                inner.update(_hyperparameters(group))
            self._scale_owned_sums(1 / self.size)
            self.inner.step()
            self._scale_owned_sums(self.size)
            _pipelined(self.buckets, self._post_all_gather, self._place_gathered)
        return loss

    def _reduce_the_rest(self) -> None:
        """Reduce, in bucket order, what the backwards since the last step left: the buckets after one a missing
        gradient kept from filling (zeros for it), or every bucket after backwards inside no_sync() only. A step
        with no backward since the last one reduces nothing (it steps with the gradients as they are, as torch's
        optimizers do). Then every bucket waits for the next step's backwards."""
        while self._next or (self._since_step and not all(b.reduced for b in self.buckets)):
            self._launch_next()
        for bucket in self.buckets:
            bucket.reduced = False
        self._since_step = False

    def _scale_owned_sums(self, factor: float) -> None:
        """ZeRO-1: multiply the owned slices of the gradients (the group's sums, viewed by the pieces) by `factor`:
        1/N turns them into the averages the inner optimizer steps with, N turns them back."""
        for pc in (pc for b in self.buckets for pc in b.pieces if not self.shard_gradients):
            if pc.tensor.grad is not None:
                pc.tensor.grad.mul_(factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' gradients and this rank's gradient slice: dropped (set_to_none) or zeroed."""
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)  # zeroing the pieces' gradients zeroes ZeRO-2's bucket.grad they view
        for bucket in self.buckets if set_to_none else ():
            bucket.grad = None

    def _grad_ready(self, bucket: ShardBucket, i: int) -> None:
        """p.grad of `bucket`'s i-th parameter is accumulated; reduce every bucket that is now full, in
        bucket order (the same collectives in the same order on every rank). Inside no_sync(): nothing to do."""
        self._since_step = True
        if not self._sync:
            if bucket.reduced:
                raise RuntimeError("ShardedOptimizer: a backward inside no_sync() after a backward outside it, before "
                                   "step(): the buckets that backward reduced would never send these gradients. Run "
                                   "the backwards inside no_sync() first and the last one outside it (or call step() "
                                   "in between).")
            return
        if bucket.index < self._next:
            raise RuntimeError("ShardedOptimizer: a second backward before step(), while the first left a bucket "
                               "waiting for a gradient that never came (a parameter unused in it): call step() "
                               "after each backward, or freeze the unused parameter.")
        bucket.ready[i] = True
        while self._next < len(self.buckets) and all(self.buckets[self._next].ready):
            self._launch_next()

    def _launch_next(self) -> None:
        """Reduce the next bucket; drop its gradients (ZeRO-2) or zero them (ZeRO-1: the owned slice gets the sum);
        settle the bucket before it (so at most two are in flight) and, after the last bucket, that one too: the
        backward ends with every slice reduced."""
        bucket = self.buckets[self._next]
        self._launch(bucket)
        for p in bucket.params:
            if self.shard_gradients:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        bucket.ready, bucket.reduced = [False] * len(bucket.params), True
        if self._next:
            self._settle(self.buckets[self._next - 1])
        self._next += 1
        if self._next == len(self.buckets):
            self._settle(bucket)
            self._next = 0

    def _launch(self, bucket: ShardBucket) -> None:
        """Start the reduce-scatter (SUM) of the bucket's gradients, laid end to end (zeros for a missing one)."""
        layout = bucket.layout
        sent = self._flat_buffer(bucket)
        torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket.params],
                  out=sent[:layout.numel])
        bucket.pending = (*post_reduce_scatter(layout, sent, self.group), sent)

    def _settle(self, bucket: ShardBucket) -> None:
        """Wait for the bucket's reduce-scatter and hand this rank's slice to the pieces: ZeRO-1 writes the sum into
        p.grad (the pieces' gradients are views of it); ZeRO-2 divides it by the group's size and keeps the
        average (adding to an earlier backward's) in bucket.grad."""
        if bucket.pending is None:
            return
        work, out, _ = bucket.pending
        work.wait()
        bucket.pending = None
        mine = out[:bucket.layout.sizes[self.rank]]
        if not self.shard_gradients:
            _sum_into_params(bucket.pieces, mine)
            return
        mine = mine.div(self.size)
        bucket.grad = mine if bucket.grad is None else bucket.grad.add_(mine)
        for pc in bucket.pieces:
            pc.tensor.grad = bucket.grad[pc.offset:pc.offset + pc.tensor.numel()]

    def _flat_buffer(self, bucket: ShardBucket, piece_only: bool = False) -> torch.Tensor:
        """`parts` x `piece` numbers (or one `piece`) for `bucket`'s collective, in a buffer kept from step to step:
        two of each size per dtype, as large as its largest bucket needs, taken by bucket parity (the buckets in
        flight together are neighbours). A fresh buffer would cost its page faults at every step: 10 ms for 15 MB
        on this course's CPUs, as long as the copy into it. DDP keeps its buckets for the same reason."""
        dtype = bucket.params[0].dtype
        key = (dtype, bucket.index % 2, piece_only)

        def numel(b: ShardBucket) -> int:
            return b.layout.piece * (1 if piece_only else b.layout.parts)
        if key not in self._buffers:
            self._buffers[key] = bucket.params[0].new_empty(max(numel(b) for b in self.buckets
                                                                if b.params[0].dtype == dtype))
        return self._buffers[key][:numel(bucket)]

    def _post_all_gather(self, bucket: ShardBucket) -> None:
        """Start gathering every rank's updated slice of the bucket (this rank's padded to the largest)."""
        mine = [pc.tensor.detach() for pc in bucket.pieces] or [bucket.params[0].detach().view(-1)[:0]]
        sent = bucket.layout.padded(mine, out=self._flat_buffer(bucket, piece_only=True))
        bucket.pending = (*post_all_gather(bucket.layout, sent, self.group, out=self._flat_buffer(bucket)), sent)

    def _place_gathered(self, bucket: ShardBucket) -> None:
        """Wait for the bucket's all-gather; copy every rank's slice into this rank's parameters."""
        work, gathered, _ = bucket.pending
        work.wait()
        bucket.pending = None
        bucket.layout.compact(gathered)
        for p, values in zip(bucket.params, bucket.layout.views(gathered), strict=True):
            p.copy_(values)

    # --- Saving and loading ---

    def _layout(self) -> dict:
        """What a state_dict's slice belongs to: the group's size, this rank in it, and every bucket."""
        return {"group size": self.size, "group rank": self.rank, "optimizer": self.optimizer_cls.__name__,
                "buckets": [(b.group_index, str(b.params[0].dtype), [tuple(p.shape) for p in b.params])
                            for b in self.buckets]}

    def state_dict(self) -> dict:
        """This rank's slice of the optimizer state, the user's param groups, and the layout (see load_state_dict)."""
        inner = self.inner.state_dict()
        param_groups = [{**_hyperparameters(g), "params": i["params"]}
                        for g, i in zip(self.param_groups, inner["param_groups"], strict=True)]
        return {"state": inner["state"], "param_groups": param_groups, "layout": self._layout()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state_dict saved by the same rank of a ShardedOptimizer with the same layout (group size, rank,
        optimizer class, buckets); anything else is refused, saying what differs."""
        saved = state_dict.get("layout") if isinstance(state_dict, dict) else None
        difference = layout_difference(saved, self._layout())
        if difference:
            raise ValueError(f"ShardedOptimizer.load_state_dict: {difference}. Load, on each rank, the state_dict "
                             "that rank saved, with the same model, param groups, optimizer, bucket_mb and group.")
        self.inner.load_state_dict({"state": state_dict["state"], "param_groups": state_dict["param_groups"]})
        for g, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            g.update(_hyperparameters(inner))


def _pipelined(buckets: list[ShardBucket], post, finish) -> None:
    """post(bucket) for each bucket in order, and finish(bucket) for each once the next is posted: one collective
    on the wire while the previous one's result is copied out, and at most two buckets' buffers alive."""
    for before, bucket in zip([None, *buckets], buckets, strict=False):
        post(bucket)
        if before is not None:
            finish(before)
    if buckets:
        finish(buckets[-1])


def _sum_into_params(pieces: list[Piece], mine: torch.Tensor) -> None:
    """ZeRO-1: this rank's reduced slice `mine` written over the parts of the gradients it owns (a zero gradient
    made for a parameter that has none); each piece's gradient is a view of its part, so no gradient is copied."""
    for pc in pieces:
        grad = pc.param.grad
        if grad is None or not grad.is_contiguous():
            pc.param.grad = grad = torch.zeros_like(pc.param) if grad is None else grad.contiguous()
        n = pc.tensor.numel()
        pc.tensor.grad = grad.view(-1)[pc.start:pc.start + n].copy_(mine[pc.offset:pc.offset + n])


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}

