"""Sequence parallel beside tensor parallel (notebook 09, section 3): the course's transformer block, Megatron style.

    tensor parallel:   x -> norm -> [copy]   -> column (wq, wk, wv / w1) ... row (wo / w2) -> [all-reduce]     -> + x
    sequence parallel: x -> norm -> [gather] -> column (wq, wk, wv / w1) ... row (wo / w2) -> [reduce-scatter] -> + x

Between the column and the row layer a rank holds some heads (some of the MLP's features) of the whole sequence; in
tensor parallel the norms and residual adds outside that pair hold the whole sequence on every rank, the same
values N times. Sequence parallel gives each rank a chunk of the sequence there instead: an all-gather along the
sequence enters the pair, a reduce-scatter along the sequence leaves it. The block is written once, with the two
functions that enter and leave the pair as arguments; the shards are cut from the single-process block's weights
(utils.transformer.initial_value) with notebook 03's column_shard and row_shard.

Every collective here runs on a process group, the whole world by default (notebook 09); notebook 12 passes the
tensor-parallel group of a 2-D mesh. The regions' autograd functions take it as a second argument
(`GatherFromSequenceParallelRegion.apply(x, group)`); notebook 09's own, written for the whole world, take none.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from utils.sizes import divide
from utils.tensor_parallel import column_shard, row_shard
from utils.transformer import Block, initial_value

LAYER = "layers.0."  # the block's weights are the transformer's first layer's
COLUMN = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight")
ROW = ("attention.wo.weight", "feed_forward.w2.weight")
NORMS = ("attention_norm.weight", "ffn_norm.weight")


def check_sizes(sizes, world_size, group_name="world_size"):
    """Heads, the MLP's features and the sequence must all split over the tensor-parallel group (of `group_name`
    size): a ValueError names the one that does not."""
    divide("num_heads", sizes.num_heads, group_name, world_size, "each rank computes the same number of heads")
    divide("ffn_dim", sizes.ffn_dim, group_name, world_size, "each rank holds the same number of MLP features")
    return divide("seq_len", sizes.seq_len, group_name, world_size,
                  "each rank holds an equal chunk of the sequence outside the column/row pairs")


def reference_block(sizes, seed=0, dtype=torch.float64):
    """The single-process block, with the transformer's first layer's weights."""
    with torch.device("meta"):
        block = Block(sizes)
    block = block.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(initial_value(LAYER + name, p.shape, seed, dtype))
    return block


def shard(name, weight, rank, world_size):
    """Rank `rank`'s part of the block's weight `name`: rows of a column-parallel one, columns of a row-parallel one,
    the whole of a norm's."""
    if name in COLUMN:
        return column_shard(weight, rank, world_size)
    return row_shard(weight, rank, world_size) if name in ROW else weight


class ParallelBlock(nn.Module):
    """utils.transformer.Block with its weights sharded over the group; `enter` and `leave` (autograd functions)
    surround each column/row pair. Parameter names as in Block."""

    def __init__(self, block, rank, world_size, enter, leave, group=None):
        super().__init__()
        self.attention_norm, self.attention = block.attention_norm, block.attention
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward
        self.enter, self.leave = on_group(enter, group), on_group(leave, group)
        for name, p in list(self.named_parameters()):
            module_name, _, attribute = name.rpartition(".")
            setattr(self.get_submodule(module_name), attribute,
                    nn.Parameter(shard(name, p.detach(), rank, world_size).clone()))

    def forward(self, x, positions):
        """x: what this rank holds of the block's input; positions: the whole sequence's (the pairs see all of it)."""
        h = x + self.leave(self.attention(self.enter(self.attention_norm(x)), positions))
        return h + self.leave(self.feed_forward(self.enter(self.ffn_norm(h))))


def on_group(region, group):
    """region.apply with its collectives on `group`; None: the whole world's, region.apply(x) (notebook 09's)."""
    return region.apply if group is None else lambda x: region.apply(x, group)


def parallel_block(sizes, rank, world_size, enter, leave, seed=0, dtype=torch.float64):
    """This rank's block: tensor parallel with enter, leave = CopyToTensorParallelRegion, ReduceFromTensorParallelRegion
    (the whole sequence in, the whole sequence out); sequence parallel with the gather and the reduce-scatter along
    the sequence (this rank's chunk in, its chunk out)."""
    check_sizes(sizes, world_size)
    return ParallelBlock(reference_block(sizes, seed, dtype), rank, world_size, enter, leave)


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Notebook 03's: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Notebook 03's: all-reduce of the partial sums forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def all_gather_sequence(x, group=None):
    """Every rank's chunk (batch, S/N, dim), joined in rank order along the sequence (dim 1): (batch, S, dim)."""
    chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(chunks, x.contiguous(), group=group)
    return torch.cat(chunks, dim=1)


def reduce_scatter_sequence(x, group=None):
    """The sum over ranks of x (batch, S, dim), of which this rank keeps its chunk of the sequence (dim 1)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = torch.empty_like(x.chunk(n, dim=1)[rank])
    dist.reduce_scatter(chunk, [c.contiguous() for c in x.chunk(n, dim=1)], group=group)
    return chunk


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Notebook 09's exercise, on a group: all-gather along the sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return reduce_scatter_sequence(grad_output, ctx.group), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Notebook 09's exercise, on a group: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad_output):
        return all_gather_sequence(grad_output, ctx.group), None


def sequence_chunk(x, rank, world_size, dim=1):
    """Rank `rank`'s chunk of the sequence (dimension `dim`, (batch, seq, dim) by default)."""
    return x.chunk(world_size, dim=dim)[rank]


def saved_activation_bytes(fn, modules):
    """Bytes autograd saves for backward inside `modules`' forwards while fn() runs, parameters left out (each
    storage counted once): the activations of those regions."""
    inside, seen = [0], {}
    parameters = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    def enter(*_):
        inside[0] += 1

    def leave(*_):
        inside[0] -= 1

    handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    finally:
        for handle in handles:
            handle.remove()
    return sum(seen.values())
