"""A TinyGPT whose blocks' MLPs are mixtures of experts (`MoEGPT`), and its training on a dp x ep mesh
(`ExpertParallelGPT`): every rank holds its share of the batch's sequences; the experts are split over each ep
group (experts/ep per rank), everything else, the routers included, is replicated. Equal to one process training
the same model on the whole batch, each rank's tokens routed as one group
(tests/distributed/test_expert_parallel_gpt.py).

Gradients, as DeepSpeed-MoE reduces them (Rajbhandari et al. 2022, "DeepSpeed-MoE"; DeepSpeed's
deepspeed/moe/experts.py marks each expert's parameters allreduce=False, to be reduced over the "expert data
parallel" group only): a replicated parameter's gradient is summed over every rank (dp x ep), an expert's
over the dp group only, since within an ep group it lives on one rank, which the all-to-all already brought every
token routed to it. The loss is each rank's summed cross-entropy over the whole batch's token count, plus
`aux_weight` x the mean of every group's and layer's load-balancing loss (Switch, section 2.2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.models import TinyGPT
from labkit.parallel.counters import all_reduce_sum
from labkit.parallel.experts import ExpertParallelMoE, MoE
from labkit.parallel.mesh import Mesh

__all__ = ["ExpertParallelGPT", "MoEGPT", "moe_gpt_shape"]


class MoEGPT(nn.Module):
    """TinyGPT's layers with a MoE (`experts` expert MLPs, `top_k`, `capacity_factor`) in place of each block's
    MLP, float64 by `.double()` like TinyGPT. forward(tokens, groups) -> (logits, mean auxiliary loss): the tokens
    of the batch cut into `groups` groups, in order, for capacity (the ranks' shares)."""

    def __init__(self, vocab: int, d_model: int = 16, layers: int = 2, heads: int = 2, experts: int = 4,
                 top_k: int = 2, capacity_factor: float = 1.25, context: int = 32, seed: int = 0):
        super().__init__()
        self.gpt = TinyGPT(vocab, d_model=d_model, layers=layers, heads=heads, context=context, tied=False,
                           seed=seed)
        for i, block in enumerate(self.gpt.blocks):
            block.mlp = MoE(d_model, 2 * d_model, experts, top_k, capacity_factor, seed=seed + 1 + i)

    def forward(self, tokens: torch.Tensor, groups: int = 1, layers=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the mean auxiliary loss; `layers[i]` replaces block i's MoE (the ranks' ExpertParallelMoE)."""
        x, losses = self.gpt.embeddings(tokens), []
        for i, block in enumerate(self.gpt.blocks):
            x, aux = _block(block, x, groups, None if layers is None else layers[i])
            losses.append(aux)
        return self.gpt.head(x), torch.stack(losses).mean()


def moe_gpt_shape(model: MoEGPT):
    """`model`'s sizes as labkit.plan takes them: TinyGPT's (labkit.parallel.gpt_shape), each block's MLP `experts`
    experts of width d_ff, `top_k` each token.

    >>> moe_gpt_shape(MoEGPT(82, d_model=16, experts=4, top_k=2))
    GPTShape(vocab=82, d_model=16, layers=2, heads=2, context=32, d_ff=32, tied=False, experts=4, top_k=2)
    """
    from labkit.plan import GPTShape

    if not isinstance(model, MoEGPT):
        raise TypeError(f"model: a {type(model).__name__}; pass a labkit.parallel.experts_gpt.MoEGPT.")
    gpt, moe = model.gpt, model.gpt.blocks[0].mlp
    return GPTShape(vocab=gpt.embeddings.tok.num_embeddings, d_model=gpt.embeddings.tok.embedding_dim,
                    layers=len(gpt.blocks), heads=gpt.blocks[0].heads, context=gpt.context,
                    d_ff=moe.experts[0][0].out_features, tied=gpt.tied, experts=len(moe.experts), top_k=moe.top_k)


def _block(block, x: torch.Tensor, groups: int, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """TinyGPT's Block with its MoE: attention as TinyGPT runs it, then x + MoE(LN(x)) over the flattened tokens."""
    batch, length, width = x.shape
    q, k, v = block.qkv(block.ln1(x)).view(batch, length, 3, block.heads, -1).permute(2, 0, 3, 1, 4)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + block.proj(attended.transpose(1, 2).reshape(batch, length, width))
    flat = block.ln2(x).reshape(-1, width)
    moe_out, aux = (block.mlp(flat, groups=groups)[:2] if layer is None else layer(flat)[:2])
    return x + moe_out.view(batch, length, width), aux


class ExpertParallelGPT:
    """`model` (a MoEGPT, the same on every rank) trained by SGD on `mesh`'s dp x ep ranks (module docstring).
    train_step(inputs, targets) takes the whole batch, the same on every rank; returns the batch's loss."""

    def __init__(self, model: MoEGPT, mesh: Mesh, lr: float = 0.1, aux_weight: float = 0.01):
        if mesh.size("pp") > 1 or mesh.size("tp") > 1 or mesh.size("cp") > 1:
            raise ValueError(f"ExpertParallelGPT runs on dp x ep meshes: this one is {mesh!r}.")
        self.model, self.mesh, self.lr, self.aux_weight = model, mesh, lr, aux_weight
        # one rank per ep group: its own group of one, not the world (None would be the world's group)
        ep_group = mesh.group("ep") if mesh.size("ep") > 1 else _alone()
        self.layers = [ExpertParallelMoE(block.mlp, ep_group) for block in model.gpt.blocks]
        local = {id(p) for layer in self.layers for p in layer.local_experts.parameters()}
        experts = {id(p) for block in model.gpt.blocks for p in block.mlp.experts.parameters()}
        self.replicated = [p for p in model.parameters() if id(p) not in experts]
        self.own_experts = [p for p in model.parameters() if id(p) in local]

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One SGD step on the whole batch; the batch's loss (cross-entropy + aux_weight x auxiliary)."""
        world = self.mesh.size("dp") * self.mesh.size("ep")
        if inputs.shape[0] % world:
            raise ValueError(f"a batch of {inputs.shape[0]} sequences does not split over {world} ranks.")
        rows = inputs.shape[0] // world
        me = self.mesh.rank_in("dp") * self.mesh.size("ep") + (self.mesh.rank_in("ep") if self.mesh.size("ep") > 1
                                                               else 0)
        tokens, wanted = inputs[me * rows:(me + 1) * rows], targets[me * rows:(me + 1) * rows]
        self.model.zero_grad()
        logits, aux = self.model(tokens, layers=self.layers)
        summed = F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), reduction="sum")
        loss = summed / inputs.numel() + self.aux_weight * aux / world
        loss.backward()
        self._sum_gradients()
        with torch.no_grad():
            for p in self.replicated + self.own_experts:
                p -= self.lr * p.grad
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # the loss, for printing: not labkit's traffic
        return total.item()

    def _sum_gradients(self) -> None:
        """Replicated parameters over every rank (ep, then dp); this rank's experts over dp only."""
        for p in self.replicated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            for axis in ("ep", "dp"):
                if self.mesh.size(axis) > 1:
                    all_reduce_sum(p.grad, self.mesh.group(axis))
        for p in self.own_experts:
            if p.grad is None:  # an expert no token reached on any rank of this ep group
                p.grad = torch.zeros_like(p)
            if self.mesh.size("dp") > 1:
                all_reduce_sum(p.grad, self.mesh.group("dp"))


def _alone():
    """This rank's own group of one, for an ep axis of size 1 (the layer then exchanges with itself)."""
    import torch.distributed as dist

    from labkit import groups

    me = dist.get_rank()
    made = [groups.new_group([r]) for r in range(dist.get_world_size())]  # new_group is a collective of the world
    return made[me]
