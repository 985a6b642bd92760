"""Tensor parallel (notebook 03): the size rule, the shards, the MLP built from the student's layers, DTensor's.

Layer i of the course's MLP is `x -> gelu(x @ W_i.T)`, W_i of shape (hidden, hidden) stored (out, in).
Layers pair up, Megatron style: layer 2k is column parallel (rank r holds rows r*h/N ... of W: a
slice of the output features), layer 2k+1 is row parallel (rank r holds the same range of columns:
a slice of the input features). Every shard is cut from `utils.model.layer_weight`, so it is exactly
the reference's slice.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from utils.model import layer_weight, make_optimizer, train_steps
from utils.sizes import check_int, divide


def check_sizes(hidden_dim, world_size, num_layers=2):
    """hidden_dim must split evenly over the ranks; layers come in (column, row) pairs."""
    local_dim = divide("hidden_dim", hidden_dim, "world_size", world_size,
                       "each rank must hold the same number of features")
    if check_int("num_layers", num_layers) % 2:
        raise ValueError(f"num layers {num_layers} is odd: tensor parallel layers come in (column, row) "
                         f"pairs; use an even number")
    return local_dim


FEATURES = {0: "out_features", 1: "in_features"}  # what W (out, in) holds along each dimension


def features_per_rank(weight, dim, world_size):
    """How many of W's features along `dim` (0: output, 1: input) each rank holds: a ValueError naming the sizes
    unless the world size divides them (torch.chunk would give fewer pieces than ranks, or unequal ones)."""
    return divide(FEATURES[dim], weight.shape[dim], "world_size", world_size,
                  "each rank must hold the same number of features")


def rank_slice(local, rank):
    """Rank `rank`'s `local` features out of N * local: [rank * local, (rank + 1) * local)."""
    return slice(rank * local, (rank + 1) * local)


def shard_range(hidden_dim, rank, world_size):
    """The features rank `rank` owns: [rank * h/N, (rank + 1) * h/N)."""
    return rank_slice(check_sizes(hidden_dim, world_size), rank)


def column_shard(weight, rank, world_size):
    """Rows of W (out, in): this rank's output features."""
    return weight[rank_slice(features_per_rank(weight, 0, world_size), rank), :]


def row_shard(weight, rank, world_size):
    """Columns of W (out, in): this rank's input features."""
    return weight[:, rank_slice(features_per_rank(weight, 1, world_size), rank)]


def check_gathered_pieces(x, shards):
    """Before all_gather_forward moves any activation: every rank's piece of each layer's output, (*x.shape[:-1],
    rows of its shard), must be the same size on every rank, or gloo aborts the process inside the all-gather. One
    all-reduce of a few integers (each rank fills its own row of a zero table) tells every rank every rank's sizes;
    a ValueError names them."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sizes = torch.zeros(world_size, 1 + len(shards), dtype=torch.int64)
    sizes[rank] = torch.tensor([x.shape[:-1].numel()] + [w.shape[0] for w in shards])
    dist.all_reduce(sizes)
    for column, what in enumerate(["rows of x (all but its last dimension)"] + [
            f"output features of layer {i}'s shard" for i in range(len(shards))]):
        if len(set(sizes[:, column].tolist())) > 1:
            raise ValueError(f"all_gather_forward: the {what} differ between ranks: "
                             + ", ".join(f"{n} on rank {r}" for r, n in enumerate(sizes[:, column].tolist()))
                             + "; an all-gather needs the same size on every rank (cut each weight with "
                               "tp.column_shard, which refuses sizes the world size does not divide)")


def is_column(layer):
    return layer % 2 == 0


class TensorParallelLayer(nn.Module):
    """gelu(linear(x)), with `linear` a column or a row parallel linear: parameter names as in utils.model."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return F.gelu(self.linear(x))


class TensorParallelMLP(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_tp_mlp(ColumnParallelLinear, RowParallelLinear, rank, world_size, hidden_dim, num_layers, seed=0,
                 dtype=torch.float64):
    """The course's MLP on this rank: layer 2k ColumnParallelLinear(W, rank, world_size), 2k+1 RowParallelLinear."""
    check_sizes(hidden_dim, world_size, num_layers)
    layers = []
    for i in range(num_layers):
        linear_class = ColumnParallelLinear if is_column(i) else RowParallelLinear
        layers.append(TensorParallelLayer(linear_class(layer_weight(hidden_dim, seed, i, dtype), rank, world_size)))
    return TensorParallelMLP(layers)


def local_part(tensor):
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor as it is (None stays None)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_weights(model):
    """This rank's weight shards, as plain tensors (DTensor's too)."""
    return [local_part(p.detach()).clone() for p in model.parameters()]


def gather_weights(shards_by_rank, num_layers):
    """Full weights from every rank's shards: column layers stack rows, row layers stack columns."""
    return [torch.cat([shards[i] for shards in shards_by_rank], dim=0 if is_column(i) else 1)
            for i in range(num_layers)]


def train_tensor_parallel(model, hidden_dim, batch_size, num_steps, seed=0, optimizer="sgd", dtype=torch.float64):
    """`num_steps` steps on the whole batch (every rank sees all of it); returns this rank's losses."""
    return train_steps(model, make_optimizer(model.parameters(), optimizer), hidden_dim, batch_size, num_steps, seed,
                       dtype)
