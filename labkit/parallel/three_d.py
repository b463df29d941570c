"""3D parallelism: a GPT trained with data, pipeline and tensor parallelism at once, each on its own axis of a
labkit.parallel.Mesh (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 3: tensor parallelism inside a node, pipeline stages across nodes, data-parallel replicas of
the whole pipeline).

    ThreeDGPT(model, mesh, microbatches)   this rank's part of a TinyGPT and its AdamW
    .train_step(inputs, targets)           one step on the whole batch (every rank passes the same one); returns
                                           the whole batch's mean loss, on every rank
    .full_state_dict()                     every parameter back at full shape, on every rank: for checks
    .planned_traffic(batch) / .planned_memory() / .measured_memory() / .pipeline_bubble()
                                           what labkit.plan predicts for this rank, and what it holds and idles
    gpt_shape(model)                       a TinyGPT's sizes as labkit.plan.GPTShape

Rank (dp i, pp j, tp k) holds stage j's layers (stage_layers' cut of [Embeddings, Block x L, Head] into pp x
chunks pieces), each split over its tp group as tensor_parallel_gpt splits it (attention by heads, the Megatron
MLP, embedding and head by vocabulary), and replica i's share of every batch. One step:

    1. run_pipeline on the pp group: micro-batches of the replica's share forward and back through the stages
       (activations and their gradients between neighbours), each layer's tp collectives inside it;
    2. under sequence parallelism, the tp all-reduce of the gradients used on sequence shards;
    3. BucketedDDP's all-reduce of the stage's gradients on the dp group (accumulated over the micro-batches
       inside no_sync(), reduced once, as torch DDP accumulates; Li et al. 2020, section 3.2.4);
    4. AdamW on the rank's own parameters: elementwise, so updating shards updates the whole model.

With `zero_stage` 1 or 2, steps 3 and 4 are ShardedOptimizer(AdamW)'s on the dp group (ZeRO-1, ZeRO-2;
Rajbhandari et al. 2020, section 5): the micro-batches' backwards inside its no_sync(), then in step() one
reduce-scatter of the stage's gradients, AdamW on the rank's 1/dp slice of them, one all-gather of the updated
slices. The stage's parameters are one bucket: the reduce comes after the last micro-batch either way, so smaller
buckets would overlap it with nothing, and one bucket makes labkit.plan's formula exact (dp x ceil(P / dp) and
ceil(P / dp) numbers).

labkit.plan.axis_traffic predicts every axis's bytes of this step; count_collectives() counts them. The loss is
then summed over the world in one all-reduce of one number that is not counted: it reports the step, it does
not train it.

The head is untied: the embedding sits on the first stage and the head on the last, and tying them would take an
all-reduce of the two copies' gradients between those stages every step (Megatron-LM's embedding group), on no
axis of the mesh. A tied TinyGPT is refused unless the whole model is one pipeline piece.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn

import labkit
from labkit import groups
from labkit.measure import training_state_nbytes
from labkit.models import TinyGPT, next_token_loss
from labkit.parallel.data import BucketedDDP, MiB
from labkit.parallel.mesh import Mesh
from labkit.parallel.pipeline import PipelineResult, measured_bubble, run_pipeline, schedule, stage_layers
from labkit.parallel.sequence import allreduce_sequence_parallel_grads
from labkit.parallel.tensor_gpt import gather_full_parameters, model_description, tensor_parallel_gpt
from labkit.parallel.zero import ShardedOptimizer
from labkit.plan.axis_traffic import GPTShape, ParallelLayout, axis_traffic, check_fit, rank_params
from labkit.plan.memory import training_memory

__all__ = ["OtherStage", "ThreeDGPT", "gpt_shape"]


def gpt_shape(model: TinyGPT) -> GPTShape:
    """`model`'s sizes, as labkit.plan's per-axis formulas take them.

    >>> from labkit.models import TinyGPT
    >>> gpt_shape(TinyGPT(82, tied=False))
    GPTShape(vocab=82, d_model=32, layers=2, heads=4, context=32, d_ff=128, tied=False)
    """
    if not isinstance(model, TinyGPT):
        raise TypeError(f"model: a {type(model).__name__}; pass a labkit.models.TinyGPT (ThreeDGPT splits its layers "
                        "over a mesh).")
    blocks = list(model.blocks)
    return GPTShape(vocab=model.embeddings.tok.num_embeddings, d_model=model.embeddings.tok.embedding_dim,
                    layers=len(blocks), heads=blocks[0].heads if blocks else 1, context=model.context,
                    d_ff=blocks[0].mlp[0].out_features if blocks else None, tied=model.tied)


class OtherStage(nn.Module):
    """Holds the place of a layer that another pipeline stage holds: run_pipeline cuts the same full-length
    nn.Sequential on every stage and runs only the stage's own pieces, so the others need no weights here."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"layer {self.name} lives on another pipeline stage: run the model with run_pipeline on "
                           "the mesh's pp group, which runs each stage's own layers.")

    def extra_repr(self) -> str:
        return f"layer {self.name}, on another stage"


def _stage_modules(model: TinyGPT, mesh: Mesh, layout: ParallelLayout) -> nn.Sequential:
    """The model's layers, those of this rank's pipeline stage split over its tp group (copies), the others
    OtherStage, on labkit.device()."""
    pieces = stage_layers(len(model), layout.pp, layout.chunks)
    stage = mesh.rank_in("pp")
    layers = OrderedDict((name, OtherStage(name)) for name, _ in model.named_children())
    for c in range(layout.chunks):
        piece = pieces[c * layout.pp + stage]
        part = model[piece.start:piece.stop]
        split = tensor_parallel_gpt(part, mesh.group("tp"), layout.sequence_parallel) if layout.tp > 1 else \
            copy.deepcopy(part)
        layers.update(split.named_children())
    return nn.Sequential(layers).to(labkit.device())


def _batch_description(inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
    """Shapes and a digest of a batch: equal on two ranks only for the same batch."""
    digest = hashlib.sha256()
    for tensor in (inputs, targets):
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return tuple(inputs.shape), tuple(targets.shape), digest.hexdigest()[:12]


class ThreeDGPT:
    """A labkit.models.TinyGPT (untied: see the module's docstring) trained on every rank of `mesh` at once: data
    parallel over mesh.group("dp"), pipelined over mesh.group("pp") with `microbatches` per step and `schedule`
    ("gpipe", "1f1b", or "interleaved" with `chunks` >= 2 per stage), tensor parallel over mesh.group("tp"), with
    `sequence_parallel` (an option of the tp axis: with tp = 1 it changes nothing); AdamW with `lr` and
    `weight_decay` on each rank's own parameters, replicated over dp and its gradients all-reduced by BucketedDDP
    (`zero_stage=0`), or sharded over dp by ShardedOptimizer: its state (`zero_stage=1`, ZeRO-1) or its state and
    the gradients (`zero_stage=2`, ZeRO-2), with one reduce-scatter and one all-gather of the stage's parameters
    per step (with dp = 1 there is nothing to shard: plain AdamW). Build it on every rank with the same model
    (same seed) and arguments: a layout that does not fit the model (labkit.plan.check_fit) is refused on every
    rank alike, before any collective but the one that checks the ranks agree.

    `stages` is this rank's nn.Sequential (its layers split, the others OtherStage), `optimizer` its AdamW (or
    ShardedOptimizer), `ddp` its BucketedDDP (None under ZeRO or with dp = 1), `shape` and `layout` what
    labkit.plan takes, `last_pipeline` the last step's PipelineResult.

    Example: dp=2 x tp=2 on 4 ranks trains as one process does::

        >>> import labkit, torch
        >>> from labkit.models import TinyGPT, char_batches, lesson_text, next_token_loss
        >>> from labkit.parallel import Mesh, ThreeDGPT
        >>> def losses(steps=3):
        ...     text = lesson_text()
        ...     model = TinyGPT(len(set(text)), tied=False).double()
        ...     run = ThreeDGPT(model, Mesh(dp=2, tp=2), microbatches=2, lr=1e-2)
        ...     return [run.train_step(x, y) for x, y in char_batches(text, batch=8, length=32, steps=steps)]
        >>> def alone(steps=3):
        ...     text = lesson_text()
        ...     model = TinyGPT(len(set(text)), tied=False).double()
        ...     optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ...     result = []
        ...     for x, y in char_batches(text, batch=8, length=32, steps=steps):
        ...         optimizer.zero_grad()
        ...         loss = next_token_loss(model(x), y)
        ...         loss.backward()
        ...         optimizer.step()
        ...         result.append(loss.item())
        ...     return result
        >>> ranks, one = labkit.run(losses, world_size=4), alone()
        >>> max(abs(a - b) for losses in ranks for a, b in zip(losses, one)) < 1e-12, [round(x, 2) for x in one]
        (True, [4.4, 4.22, 3.9])
    """

    def __init__(self, model: TinyGPT, mesh: Mesh, microbatches: int = 1, schedule: str = "1f1b", chunks: int = 1,
                 sequence_parallel: bool = False, zero_stage: int = 0, lr: float = 1e-3, weight_decay: float = 0.01):
        groups.require_group("ThreeDGPT")
        described = model_description(model) if isinstance(model, TinyGPT) else type(model).__name__
        arguments = (described, microbatches, schedule, chunks, sequence_parallel, zero_stage, lr, weight_decay)
        groups.check_same(arguments, "ThreeDGPT", "(model, microbatches, schedule, chunks, sequence_parallel, "
                          "zero_stage, lr, weight_decay)",
                          "Build the same model (same seed) and pass the same arguments on every rank.")
        self.shape = gpt_shape(model)
        self.layout = ParallelLayout(mesh.size("dp"), mesh.size("pp"), mesh.size("tp"), microbatches, chunks,
                                     sequence_parallel, zero_stage)
        check_fit(self.shape, self.layout)
        self.schedule = _checked_schedule(schedule, self.layout)
        self.mesh, self._names = mesh, [name for name, _ in model.named_parameters()]
        self.stages = _stage_modules(model, mesh, self.layout)
        self.ddp, self.optimizer = self._data_parallel(lr, weight_decay)
        self.last_pipeline: PipelineResult | None = None

    def _data_parallel(self, lr: float, weight_decay: float) -> tuple[BucketedDDP | None, torch.optim.Optimizer]:
        """The dp axis's BucketedDDP (or None) and the optimizer: AdamW, or ShardedOptimizer(AdamW) over the dp
        group with the stage's parameters in one bucket (its bytes in MiB: a power of two, so exact)."""
        params, dp_group = list(self.stages.parameters()), self.mesh.group("dp")
        if self.layout.dp == 1 or self.layout.zero_stage == 0:
            ddp = BucketedDDP(self.stages, group=dp_group) if self.layout.dp > 1 else None
            return ddp, torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        bucket_mb = sum(p.numel() * p.element_size() for p in params) / MiB
        return None, ShardedOptimizer(params, torch.optim.AdamW, group=dp_group, bucket_mb=bucket_mb,
                                      shard_gradients=self.layout.zero_stage == 2, lr=lr, weight_decay=weight_decay)

    def _accumulating(self):
        """The context the micro-batches' backwards run in: the dp axis's no_sync(), so that the gradients are
        reduced once a step, after the last one (nothing to hold back with dp = 1)."""
        if self.ddp is not None:
            return self.ddp.no_sync()
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.no_sync()
        return contextlib.nullcontext()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   emulate_compute_seconds: float | tuple[float, float] = 0.0) -> float:
        """One training step on the batch (token ids and next tokens, (batch, length), the same on every rank):
        this rank's replica takes its 1/dp of the rows, the pipeline its micro-batches of those. Returns the
        whole batch's mean next-token loss, on every rank. `emulate_compute_seconds`: run_pipeline's EMULATION of
        a stage's forward (and backward) time per micro-batch, for a bubble that shows on a busy CPU."""
        self._check_batch(inputs, targets)
        share = len(inputs) // self.layout.dp
        rows = slice(self.mesh.rank_in("dp") * share, (self.mesh.rank_in("dp") + 1) * share)
        self.optimizer.zero_grad()
        with self._accumulating():
            self.last_pipeline = run_pipeline(self.stages, self.schedule, self.layout.microbatches, inputs[rows],
                                              targets[rows], next_token_loss, chunks=self.layout.chunks,
                                              emulate_compute_seconds=emulate_compute_seconds,
                                              group=self.mesh.group("pp"))
        if self.layout.sequence_parallel and self.layout.tp > 1:
            allreduce_sequence_parallel_grads(self.stages, self.mesh.group("tp"))
        if self.ddp:
            self.ddp.finish()
        self.optimizer.step()  # ShardedOptimizer: the reduce-scatter, AdamW on the slice, the all-gather
        return self._batch_loss(self.last_pipeline.loss)

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The same ValueError on every rank unless all passed the same batch, one the layout can cut."""
        groups.check_same(_batch_description(inputs, targets), "ThreeDGPT.train_step", "batches",
                          "Pass the whole batch, the same on every rank: each takes its replica's share.")
        if inputs.dim() != 2 or inputs.shape != targets.shape:
            raise ValueError(f"ThreeDGPT.train_step: inputs {tuple(inputs.shape)} and targets "
                             f"{tuple(targets.shape)}; pass two (batch, length) tensors of token ids.")
        check_fit(self.shape, self.layout, batch=inputs.shape[0], sequence=inputs.shape[1])

    def _batch_loss(self, loss: float | None) -> float:
        """The whole batch's mean loss: the last stage's (its tp rank 0's) replica losses, summed over the world
        and averaged over the equal replicas. Not counted: reporting, not training."""
        mine = loss if loss is not None and self.mesh.rank_in("tp") == 0 else 0.0
        total = torch.tensor([mine], dtype=torch.float64, device=labkit.device())
        # parallel/'s one raw collective, left uncounted on purpose: the step's traffic is what it plans, without
        # this report (tests/unit/test_collectives_in_one_place.py names it as the one exception)
        dist.all_reduce(total)
        return total.item() / self.layout.dp

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model at full shape, under TinyGPT's names and in its order, on the CPU, on every
        rank: each tp group puts its stage's shards together (gather_full_parameters), then the pp group its
        stages (object collectives, not counted). The dp replicas are equal; replica i answers from its own."""
        held = nn.Sequential(OrderedDict((name, layer) for name, layer in self.stages.named_children()
                                         if not isinstance(layer, OtherStage)))
        if self.layout.tp > 1:
            mine = gather_full_parameters(held, self.mesh.group("tp"))
        else:
            mine = {name: p.detach().cpu().clone() for name, p in held.named_parameters()}
        full = {}
        for theirs in groups.gather_objects(mine, self.mesh.group("pp")):
            full.update(theirs)
        return {name: full[name] for name in self._names}

    def _number_bytes(self) -> int:
        return next(self.stages.parameters()).element_size()

    def planned_traffic(self, batch: int, sequence: int | None = None) -> dict[str, dict[str, int]]:
        """labkit.plan.axis_traffic for this rank: the bytes one step of `batch` sequences of `sequence` tokens
        (None: the context) hands to each axis's collectives, by collective."""
        return axis_traffic(self.shape, self.layout, batch, groups.group_rank(), sequence, self._number_bytes())

    def planned_memory(self) -> dict[str, float]:
        """labkit.plan.training_memory of this rank's parameters (rank_params): weights, gradients and AdamW's two
        moments, each a number of the parameters' dtype, the moments (and under ZeRO-2 the gradients) 1/dp of them
        under ZeRO."""
        n = self._number_bytes()
        return training_memory(rank_params(self.shape, self.layout, groups.group_rank()), weight_bytes=n,
                               grad_bytes=n, optimizer_bytes=2 * n, zero_stage=self.layout.zero_stage,
                               dp=self.layout.dp)

    def measured_memory(self) -> dict[str, int]:
        """What this rank holds now in weights, gradients and optimizer state (labkit.measure.training_state_nbytes;
        after a step, gradients included)."""
        return training_state_nbytes(self.stages, self.optimizer)

    def pipeline_bubble(self) -> float:
        """The idle share of the last step's pipeline, measured (labkit.parallel.measured_bubble over every stage's
        timed actions, gathered on the pp group); call it on every rank, after a step."""
        if self.last_pipeline is None:
            raise RuntimeError("ThreeDGPT.pipeline_bubble: no step yet; call train_step first.")
        stages = groups.gather_objects(self.last_pipeline.events, self.mesh.group("pp"))
        return measured_bubble([event for events in stages for event in events])


def _checked_schedule(kind: str, layout: ParallelLayout) -> str:
    """`kind`, once schedule() accepts it for the layout's stages, micro-batches and chunks (a ValueError saying
    why not: an unknown kind, chunks without "interleaved", micro-batches not a multiple of the stages)."""
    schedule(kind, layout.pp, layout.microbatches, layout.chunks)
    return kind
