"""A TinyGPT trained on a dp x cp x tp mesh: each dp group takes its share of the batch's sequences, each rank of a
cp group its positions of every sequence (the zig-zag layout), attention runs as ring attention over the cp group
(labkit.parallel.context), and with tp > 1 every layer is split over the tp group as tensor_parallel_gpt splits it
(Megatron-LM's heads and columns; the ring then passes only this rank's heads' K and V). Equal to one process
training the same model on the whole batch (tests/distributed/test_context_parallel_gpt.py), as torchtitan's
context parallelism is to its unsplit model.

Why it is exact: every layer but attention acts on each position alone, so a rank running them on its positions
computes exactly those positions' activations; ring attention gives each query every earlier key; the position
embedding is looked up at each token's global position. The loss is each rank's tokens' summed cross-entropy over
the whole batch's token count, so the gradients summed over the cp group and then the dp group are the whole
batch's mean-loss gradient (parameters, or with tp each rank's shard of them, are replicated over dp and cp, as in
data parallelism; a tp group's replicated ones, LayerNorms and the like, get equal gradients; a cp group shares its
sequences' gradient as a dp group shares the batch's: torchtitan reduces gradients over dp and cp together,
its "dp_cp" mesh). Every collective is counted by labkit.parallel.counters, so by_axis(mesh) shows the ring's sends
and the gradient sums on cp, the gradient sums on dp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit import groups
from labkit.models import TinyGPT
from labkit.parallel.context import context_positions, ring_attention
from labkit.parallel.counters import all_reduce_sum
from labkit.parallel.mesh import Mesh
from labkit.parallel.tensor_gpt import ParallelBlock, gather_full_parameters, tensor_parallel_gpt

__all__ = ["ContextParallelGPT"]


class ContextParallelGPT:
    """`model` (a TinyGPT, the same on every rank) trained by SGD on `mesh`'s dp x cp x tp ranks (module
    docstring). `train_step(inputs, targets)` takes the whole batch (the same on every rank), trains one step, and
    returns the whole batch's mean loss; `full_parameters()` the unsplit model's parameters. With tp = 1 `model`
    itself trains; with tp > 1 this rank's split copy of it (`self.layers`)."""

    def __init__(self, model: TinyGPT, mesh: Mesh, lr: float = 0.1):
        if mesh.size("pp") > 1 or mesh.size("ep") > 1:
            raise ValueError(f"ContextParallelGPT runs on dp x cp x tp meshes: this one is {mesh!r}; pass pp=1, "
                             "ep=1.")
        self.model, self.mesh, self.lr = model, mesh, lr
        self.cp_group, self.dp_group = mesh.group("cp") if mesh.size("cp") > 1 else None, mesh.group("dp")
        self.tp_group = mesh.group("tp") if mesh.size("tp") > 1 else None
        self.layers = tensor_parallel_gpt(model, self.tp_group) if self.tp_group is not None else model

    def _mine(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's rows (its dp share of the sequences) and positions (its cp share of each)."""
        dp, cp = self.mesh.size("dp"), self.mesh.size("cp")
        if inputs.shape[0] % dp:
            raise ValueError(f"a batch of {inputs.shape[0]} sequences does not split over dp = {dp}: pass a "
                             f"multiple of {dp}.")
        rows = inputs.shape[0] // dp
        first = self.mesh.rank_in("dp") * rows
        positions = context_positions(inputs.shape[1], cp, self.mesh.rank_in("cp") if cp > 1 else 0)
        positions = positions.to(inputs.device)
        return (inputs[first:first + rows][:, positions], targets[first:first + rows][:, positions], positions)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """Logits of this rank's tokens at their global `positions` of `length`-token sequences (every rank of a
        tp group the whole vocabulary's: the split head all-gathers them)."""
        embeddings, *blocks, head = self.layers
        if self.tp_group is None:
            x = embeddings.tok(tokens) + embeddings.pos(positions)
        else:
            x = embeddings(tokens, positions)
        for block in blocks:
            x = self._block(block, x, length)
        return head(x)

    def _block(self, block, x: torch.Tensor, length: int) -> torch.Tensor:
        """A Block (or tp's ParallelBlock, this rank's heads and columns) with ring attention over the cp group in
        place of scaled_dot_product_attention."""
        attention = block.attention if isinstance(block, ParallelBlock) else block  # qkv, heads, proj
        batch, held, _ = x.shape
        q, k, v = attention.qkv(block.ln1(x)).view(batch, held, 3, attention.heads, -1).permute(2, 0, 3, 1, 4)
        if self.cp_group is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attended = ring_attention(q.contiguous(), k.contiguous(), v.contiguous(), length, self.cp_group)
        x = x + attention.proj(attended.transpose(1, 2).reshape(batch, held, -1))
        return x + block.mlp(block.ln2(x))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The unsplit model's parameters by name, on the CPU (with tp, put together from the tp group's shards:
        gather_full_parameters, a check, not training traffic)."""
        if self.tp_group is None:
            return {name: p.detach().cpu() for name, p in self.model.named_parameters()}
        return gather_full_parameters(self.layers, self.tp_group)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One SGD step on the whole batch (inputs, targets: (batch, length) token ids); the batch's mean loss."""
        tokens, wanted, positions = self._mine(inputs, targets)
        self.layers.zero_grad()
        logits = self.forward(tokens, positions, inputs.shape[1])
        summed = F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), reduction="sum")
        (summed / inputs.numel()).backward()
        for p in self.layers.parameters():
            for group in (self.cp_group, self.dp_group):
                if group is not None and groups.group_size(group) > 1:
                    all_reduce_sum(p.grad, group)
        with torch.no_grad():
            for p in self.layers.parameters():
                p -= self.lr * p.grad
        total = summed.detach().clone()
        torch.distributed.all_reduce(total)  # the loss, for printing: not labkit's traffic
        return total.item() / inputs.numel() / self.mesh.size("tp")  # a tp group's ranks hold the same tokens' sum
