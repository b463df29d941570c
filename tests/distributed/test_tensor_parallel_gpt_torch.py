"""tensor_parallel_gpt next to torch's own tensor parallelism (DeviceMesh + parallelize_module, ColwiseParallel /
RowwiseParallel, and SequenceParallel for the LayerNorms) on the same GPT, on 2 gloo ranks: the same loss and the
same gradients. torch's plan is torchtitan's for Llama (torchtitan/models/llama/parallelize_llama.py), with a learned
position embedding added to the vocabulary-parallel token embedding's all-reduced output, then cut along the
sequence (Megatron-LM does the same under sequence parallelism)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import labkit
from labkit.models import TinyGPT, char_batches, lesson_text, next_token_loss
from labkit.parallel import allreduce_sequence_parallel_grads, gather_full_parameters, tensor_parallel_gpt

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

VOCAB = len(set(lesson_text()))  # 82: 41 per rank, an even cut torch's DTensor handles


class TorchEmbeddings(nn.Module):
    def __init__(self, embeddings):
        super().__init__()
        self.tok, self.pos = copy.deepcopy(embeddings.tok), copy.deepcopy(embeddings.pos)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class TorchBlock(nn.Module):
    """labkit.models.Block with q, k and v as three layers (torch's ColwiseParallel splits each by rows, which are
    whole heads), the heads counted from the local width as torchtitan does."""

    def __init__(self, block):
        super().__init__()
        width = block.qkv.in_features
        self.head_width = width // block.heads
        self.ln1, self.ln2, self.proj, self.mlp = (copy.deepcopy(m) for m in (block.ln1, block.ln2, block.proj,
                                                                              block.mlp))
        for i, name in enumerate("qkv"):
            layer = nn.Linear(width, width, dtype=block.qkv.weight.dtype)
            with torch.no_grad():
                layer.weight.copy_(block.qkv.weight[i * width:(i + 1) * width])
                layer.bias.copy_(block.qkv.bias[i * width:(i + 1) * width])
            setattr(self, name, layer)

    def forward(self, x):
        h = self.ln1(x)
        batch, length = h.shape[:2]  # h may be a DTensor: its shape is the whole sequence's
        q, k, v = (layer(h).view(batch, length, -1, self.head_width).transpose(1, 2) for layer in (self.q, self.k,
                                                                                                    self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        x = x + self.proj(attended.reshape(batch, length, -1))
        return x + self.mlp(self.ln2(x))


def torch_plan(sequence_parallel, layers):
    """torchtitan's plan, per layer of the Sequential."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    sharded = Shard(1) if sequence_parallel else Replicate()
    plan = {"0.tok": RowwiseParallel(input_layouts=Replicate()),
            f"{layers + 1}.linear": ColwiseParallel(input_layouts=sharded, output_layouts=Replicate())}
    if sequence_parallel:
        plan |= {"0": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                          use_local_output=True), f"{layers + 1}.ln_f": SequenceParallel()}
    for i in range(1, layers + 1):
        plan |= {f"{i}.{name}": ColwiseParallel(input_layouts=sharded) for name in ("q", "k", "v", "mlp.0")}
        plan |= {f"{i}.{name}": RowwiseParallel(output_layouts=sharded) for name in ("proj", "mlp.2")}
        if sequence_parallel:
            plan |= {f"{i}.ln1": SequenceParallel(), f"{i}.ln2": SequenceParallel()}
    return plan


def torch_grads(theirs, layers):
    """torch's gradients, whole, under labkit's names (q, k and v put back into one qkv)."""
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in theirs.named_parameters()}
    for i in range(1, layers + 1):
        for kind in ("weight", "bias"):
            grads[f"{i}.qkv.{kind}"] = torch.cat([grads.pop(f"{i}.{n}.{kind}") for n in "qkv"])
    return grads


def against_torch(sequence_parallel, layers=2):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    full = TinyGPT(VOCAB, layers=layers, tied=False).double()
    (inputs, targets), = char_batches(lesson_text(), 2, 16, 1, seed=3)
    ours = tensor_parallel_gpt(full, sequence_parallel=sequence_parallel)
    loss = next_token_loss(ours(inputs), targets)
    loss.backward()
    if sequence_parallel:
        allreduce_sequence_parallel_grads(ours)
    grads = gather_full_parameters(ours, grads=True)
    layers_theirs = [TorchEmbeddings(full[0]), *(TorchBlock(b) for b in full.blocks), copy.deepcopy(full[-1])]
    theirs = parallelize_module(nn.Sequential(*layers_theirs), DeviceMesh("cpu", list(range(labkit.world_size()))),
                                torch_plan(sequence_parallel, layers))
    loss_theirs = next_token_loss(theirs(inputs), targets)
    loss_theirs.backward()
    expected = torch_grads(theirs, layers)
    errors = {name: (grads[name] - expected[name]).abs().max().item() for name in expected}
    return abs(loss.item() - loss_theirs.item()), errors, sorted(expected) == sorted(grads)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_split_gpt_equals_torchs_parallelize_module(sequence_parallel):
    for rank, (loss_gap, errors, same_names) in enumerate(labkit.run(against_torch, sequence_parallel,
                                                                     world_size=2)):
        assert same_names, rank
        assert loss_gap <= 1e-12, (rank, loss_gap)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-12, (rank, worst, errors[worst])
