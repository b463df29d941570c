"""labkit.parallel.tensor_parallel_gpt on real gloo processes: the GPT split over 2 and 4 ranks (attention by heads,
the Megatron MLP, the vocabulary-parallel embedding and head), with and without sequence parallelism, tied and
untied, computes what one process computes (logits, loss, every gradient, 20 AdamW steps; float64, 1e-10), on
sub-groups too, with Megatron's collectives, and saves the activation memory Korthikanti et al. 2022 predict."""

import pytest
import torch

import labkit
from labkit import groups
from labkit.activations import saved_activation_nbytes
from labkit.models import TinyGPT, char_batches, lesson_text, next_token_loss
from labkit.parallel import (
    ColumnParallelLinear,
    allreduce_sequence_parallel_grads,
    count_collectives,
    gather_full_parameters,
    shard_sizes,
    tensor_parallel_gpt,
)

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

VOCAB = len(set(lesson_text()))  # 82 characters: 41 + 41 over 2 ranks, 21 + 21 + 20 + 20 over 4
BATCH, LENGTH, WIDTH, LAYERS, HEADS = 2, 16, 32, 2, 4
TOLERANCE = 1e-10
CASES = [(sequence_parallel, tied) for sequence_parallel in (False, True) for tied in (True, False)]


def model(tied=True, layers=LAYERS):
    return TinyGPT(VOCAB, d_model=WIDTH, layers=layers, heads=HEADS, tied=tied).double()


def batches(steps=1):
    return list(char_batches(lesson_text(), BATCH, LENGTH, steps, seed=1))


def error(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.detach().cpu() - b.detach().cpu()).abs().max().item()


def compare(sequence_parallel, tied, group=None):
    """Logits, loss and every parameter's gradient of the split model against the full one: the largest error of
    each, and the names whose gradients were compared."""
    full = model(tied)
    split = tensor_parallel_gpt(full, group, sequence_parallel)
    (inputs, targets), = batches()
    logits_full = full(inputs)
    next_token_loss(logits_full, targets).backward()
    logits = split(inputs)
    loss = next_token_loss(logits, targets)
    loss.backward()
    if sequence_parallel:
        allreduce_sequence_parallel_grads(split, group)
    grads = gather_full_parameters(split, group, grads=True)
    expected = dict(full.named_parameters())
    errors = {"logits": error(logits, logits_full), "loss": error(loss, next_token_loss(logits_full, targets))}
    errors |= {name: error(grads[name], p.grad) for name, p in expected.items()}
    return errors, sorted(grads) == sorted(expected)


def every_case():
    return [compare(sequence_parallel, tied) for sequence_parallel, tied in CASES]


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_gpt_computes_what_one_process_does(world_size):
    for rank, results in enumerate(labkit.run(every_case, world_size=world_size)):
        for (sequence_parallel, tied), (errors, same_names) in zip(CASES, results, strict=True):
            assert same_names, (rank, sequence_parallel, tied)
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOLERANCE, (rank, sequence_parallel, tied, worst, errors[worst])


def on_pairs():
    """Ranks {0, 2} split the GPT over their pair without sequence parallelism, ranks {1, 3} with it, at once."""
    pairs = [groups.new_group([0, 2]), groups.new_group([1, 3])]
    mine = pairs[labkit.rank() % 2]
    with count_collectives() as counted:
        errors, _ = compare(sequence_parallel=labkit.rank() % 2 == 1, tied=False, group=mine)
    return max(errors.values()), sorted(counted.by_group), sorted(counted.calls)


def test_on_sub_groups_each_pair_computes_alone():
    results = labkit.run(on_pairs, world_size=4)
    for rank, (worst, counted_groups, kinds) in enumerate(results):
        assert worst <= TOLERANCE, (rank, worst)
        assert counted_groups == [(0, 2) if rank % 2 == 0 else (1, 3)], (rank, counted_groups)
        assert kinds == (["all_gather", "all_reduce"] if rank % 2 == 0 else
                         ["all_gather", "all_reduce", "reduce_scatter"]), (rank, kinds)


def alone():
    """A group of one rank, and the world of one: the split model is the model."""
    me = [groups.new_group([r]) for r in range(labkit.world_size())][labkit.rank()]
    return [max(compare(sequence_parallel, tied, me)[0].values()) for sequence_parallel, tied in CASES]


@pytest.mark.parametrize("world_size", [1, 2])
def test_on_one_rank_the_split_model_is_the_model(world_size):
    """Equal to 1e-12 (float64), not bit for bit: a row-parallel layer adds its bias after the reduce (Megatron's
    order), F.linear(x, w) + b, where nn.Linear does one addmm with the bias inside the GEMM; MKL's default
    kernels accumulate those in another order (the logits differ by 2.2e-16 on an AMD EPYC; by 0 under
    MKL_CBWR=COMPATIBLE)."""
    for errors in labkit.run(alone, world_size=world_size):
        assert max(errors) <= 1e-12, errors


# --- Attention by heads: the fused qkv weight is split per head, not by contiguous rows ---

def split_attention():
    full = model()
    block, size, rank = full[1], labkit.world_size(), labkit.rank()
    attention = tensor_parallel_gpt(full)[1].attention
    head_width, mine = WIDTH // HEADS, HEADS // size
    rows = [third * WIDTH + head * head_width + i for third in range(3)
            for head in range(rank * mine, (rank + 1) * mine) for i in range(head_width)]
    x = torch.randn(BATCH, LENGTH, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected = block.proj(_attend(block.qkv(x), HEADS))
    naive = ColumnParallelLinear.from_linear(block.qkv, gather_output=False)  # the rank's contiguous third of rows
    naive_out = attention.proj(_attend(naive(x), mine))
    return (torch.equal(attention.qkv.weight, block.qkv.weight[rows]), error(attention(x), expected),
            error(naive_out, expected))


def _attend(qkv, heads):
    batch, length = qkv.shape[:2]
    q, k, v = qkv.view(batch, length, 3, heads, -1).permute(2, 0, 3, 1, 4)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(batch, length, -1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_attention_holds_whole_heads_rows_of_q_k_and_v(world_size):
    for rank, (rows_right, ours, naive) in enumerate(labkit.run(split_attention, world_size=world_size)):
        assert rows_right, rank
        assert ours <= TOLERANCE, (rank, ours)
        assert naive > 1e-3, (rank, naive)  # contiguous rows would be wrong: the trap is real for these weights


def three_ranks():
    tensor_parallel_gpt(model())


def test_heads_that_the_group_does_not_divide_are_refused():
    with pytest.raises(labkit.RankError, match="4 heads cannot be split over a tensor-parallel group of 3 ranks"):
        labkit.run(three_ranks, world_size=3, timeout=60)


def odd_length():
    split = tensor_parallel_gpt(model(), sequence_parallel=True)
    split(torch.zeros(1, 6, dtype=torch.long))


def test_sequence_parallel_needs_a_length_the_group_divides():
    with pytest.raises(labkit.RankError, match="sequences of 6 tokens do not split evenly; pass a sequence length "
                                               "that is a multiple of 4"):
        labkit.run(odd_length, world_size=4, timeout=60)


def different_models():
    full = TinyGPT(VOCAB, seed=labkit.rank())
    tensor_parallel_gpt(full)


def test_ranks_with_different_models_get_a_clear_error():
    with pytest.raises(labkit.RankError, match="tensor_parallel_gpt: the ranks passed different models"):
        labkit.run(different_models, world_size=2, timeout=60)


# --- Megatron's collectives, counted ---

def counted(sequence_parallel):
    full = model(tied=False)
    split = tensor_parallel_gpt(full, sequence_parallel=sequence_parallel)
    (inputs, targets), = batches()
    with count_collectives() as forward:
        loss = next_token_loss(split(inputs), targets)
    with count_collectives() as backward:
        loss.backward()
    with count_collectives() as step:
        allreduce_sequence_parallel_grads(split)
    return [(dict(c.calls), dict(c.nbytes)) for c in (forward, backward, step)]


def megatron(sequence_parallel, t):
    """Per forward, backward and step: the calls and bytes of each kind, from the shapes (float64: 8 bytes)."""
    activation, part = BATCH * LENGTH * WIDTH * 8, BATCH * LENGTH // t * WIDTH * 8
    logits = BATCH * LENGTH * max(shard_sizes(VOCAB, t)) * 8  # each rank's part, padded to the largest
    n = 2 * LAYERS + 1  # 2 per block, and the embedding's (forward) or the head's (backward)
    if not sequence_parallel:
        return [({"all_reduce": n, "all_gather": 1}, {"all_reduce": n * activation, "all_gather": logits}),
                ({"all_reduce": n}, {"all_reduce": n * activation}), ({}, {})]
    replicated = LAYERS * 6 * WIDTH + 32 * WIDTH + 2 * WIDTH  # LayerNorms, row biases; positions; final norm
    forward = ({"all_gather": n + 1, "reduce_scatter": n}, {"all_gather": n * part + logits,
                                                            "reduce_scatter": n * activation})
    # backward: each all-gather's reduce-scatter and each reduce-scatter's all-gather, and a column layer's input
    # gathered again for its weight's gradient (blocks: 2 each; the head: 1)
    backward = ({"all_gather": 2 * n, "reduce_scatter": n}, {"all_gather": 2 * n * part,
                                                             "reduce_scatter": n * activation})
    return [forward, backward, ({"all_reduce": 1}, {"all_reduce": replicated * 8})]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_collectives_are_megatrons(world_size, sequence_parallel):
    expected = megatron(sequence_parallel, world_size)
    for rank, measured in enumerate(labkit.run(counted, sequence_parallel, world_size=world_size)):
        assert measured == expected, (rank, measured, expected)


# --- Sequence parallelism's activation memory: Korthikanti et al. 2022, sections 4.2.1 and 4.2.2 ---

def block_activation_nbytes(sequence_parallel):
    """The bytes autograd saves for the blocks: the embedding and the blocks, less the embedding alone."""
    split = tensor_parallel_gpt(model(tied=False), sequence_parallel=sequence_parallel)
    (inputs, _), = batches()
    return saved_activation_nbytes(split[:-1], inputs) - saved_activation_nbytes(split[:1], inputs)


def activation_savings():
    return block_activation_nbytes(False), block_activation_nbytes(True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_parallelism_saves_what_korthikanti_predicts(world_size):
    """Per layer, tensor parallelism keeps sbh(10 + 24/t + 5as/(ht)) bytes, sequence parallelism
    sbh(34/t + 5as/(ht)) (2-byte activations,
    1-byte dropout masks): sequence parallelism divides by t the 10sbh that tensor parallelism replicates, the
    inputs of the two LayerNorms (4sbh), of the QKV projection and of the MLP's first layer (4sbh), and two
    dropout masks (2sbh). This model has no dropout: 4 sbh numbers go to 4 sbh / t, 8 bytes each here. The
    LayerNorms' mean and 1/std (b s numbers each, which the paper leaves out) shrink the same way: so the saving
    is exactly (4 sbh + 4 bs)(1 - 1/t) numbers, the formula's times 1 + 1/h (1/32 more here)."""
    t, s, b, h = world_size, LENGTH, BATCH, WIDTH
    predicted = LAYERS * 4 * s * b * h * (t - 1) // t * 8
    norm_statistics = LAYERS * 4 * s * b * (t - 1) // t * 8
    for rank, (plain, sequence_parallel) in enumerate(labkit.run(activation_savings, world_size=world_size)):
        assert plain - sequence_parallel == predicted + norm_statistics, (rank, plain, sequence_parallel)
        assert (plain - sequence_parallel) / predicted == pytest.approx(1 + 1 / h)


# --- Training: 20 AdamW steps equal to one process ---

def train(sequence_parallel, tied, steps=20):
    """The losses of `steps` AdamW steps on the lesson text, split and whole, and the largest parameter gap."""
    full = model(tied)
    split = tensor_parallel_gpt(full, sequence_parallel=sequence_parallel)
    losses = {"full": [], "split": []}
    for net, name in ((full, "full"), (split, "split")):
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
        for inputs, targets in batches(steps):
            optimizer.zero_grad()
            loss = next_token_loss(net(inputs), targets)
            loss.backward()
            if name == "split" and sequence_parallel:
                allreduce_sequence_parallel_grads(split)
            optimizer.step()
            losses[name].append(loss.item())
    gathered = gather_full_parameters(split)
    return losses, max(error(gathered[n], p) for n, p in full.named_parameters())


@pytest.mark.parametrize("world_size,sequence_parallel,tied", [(2, False, False), (4, True, True)])
def test_twenty_adamw_steps_equal_one_process(world_size, sequence_parallel, tied):
    for rank, (losses, gap) in enumerate(labkit.run(train, sequence_parallel, tied, world_size=world_size,
                                                    timeout=120)):
        assert max(abs(a - b) for a, b in zip(losses["split"], losses["full"], strict=True)) <= TOLERANCE, rank
        assert gap <= TOLERANCE, (rank, gap)
        assert losses["full"][-1] < losses["full"][0] - 0.5, losses["full"]  # it learned
