"""Sequence parallel beside tensor parallel (notebook 09, section 3): the course's transformer block, Megatron style.

    tensor parallel:   x -> norm -> [copy]   -> column (wq, wk, wv / w1) ... row (wo / w2) -> [all-reduce]     -> + x
    sequence parallel: x -> norm -> [gather] -> column (wq, wk, wv / w1) ... row (wo / w2) -> [reduce-scatter] -> + x

Between the column and the row layer a rank holds some heads (some of the MLP's features) of the whole sequence; in
tensor parallel the norms and residual adds outside that pair hold the whole sequence on every rank, the same
values N times. Sequence parallel gives each rank a chunk of the sequence there instead: an all-gather along the
sequence enters the pair, a reduce-scatter along the sequence leaves it. The block is written once, with the two
functions that enter and leave the pair as arguments; the shards are cut from the single-process block's weights
(utils.transformer.initial_value) with notebook 03's column_shard and row_shard.
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


def check_sizes(sizes, world_size):
    """Heads, the MLP's features and the sequence must all split over the tensor-parallel group: a ValueError names
    the one that does not."""
    divide("num_heads", sizes.num_heads, "world_size", world_size, "each rank computes the same number of heads")
    divide("ffn_dim", sizes.ffn_dim, "world_size", world_size, "each rank holds the same number of MLP features")
    return divide("seq_len", sizes.seq_len, "world_size", world_size,
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

    def __init__(self, block, rank, world_size, enter, leave):
        super().__init__()
        self.attention_norm, self.attention = block.attention_norm, block.attention
        self.ffn_norm, self.feed_forward = block.ffn_norm, block.feed_forward
        self.enter, self.leave = enter, leave
        for name, p in list(self.named_parameters()):
            module_name, _, attribute = name.rpartition(".")
            setattr(self.get_submodule(module_name), attribute,
                    nn.Parameter(shard(name, p.detach(), rank, world_size).clone()))

    def forward(self, x, positions):
        """x: what this rank holds of the block's input; positions: the whole sequence's (the pairs see all of it)."""
        h = x + self.leave.apply(self.attention(self.enter.apply(self.attention_norm(x)), positions))
        return h + self.leave.apply(self.feed_forward(self.enter.apply(self.ffn_norm(h))))


def parallel_block(sizes, rank, world_size, enter, leave, seed=0, dtype=torch.float64):
    """This rank's block: tensor parallel with enter, leave = CopyToTensorParallelRegion, ReduceFromTensorParallelRegion
    (the whole sequence in, the whole sequence out); sequence parallel with the gather and the reduce-scatter along
    the sequence (this rank's chunk in, its chunk out)."""
    check_sizes(sizes, world_size)
    return ParallelBlock(reference_block(sizes, seed, dtype), rank, world_size, enter, leave)


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Notebook 03's: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Notebook 03's: all-reduce of the partial sums forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


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
