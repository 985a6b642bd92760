"""Tensor parallel (notebook 03): the size rule, the shards, the MLP built from the student's layers, DTensor's.

Layer i of the course's MLP is `x -> gelu(x @ W_i.T)`, W_i of shape (hidden, hidden) stored (out, in).
Layers pair up, Megatron style: layer 2k is column parallel (rank r holds rows r*h/N ... of W: a
slice of the output features), layer 2k+1 is row parallel (rank r holds the same range of columns:
a slice of the input features). Every shard is cut from `utils.model.layer_weight`, so it is exactly
the reference's slice.
"""
import torch
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


def shard_range(hidden_dim, rank, world_size):
    """The features rank `rank` owns: [rank * h/N, (rank + 1) * h/N)."""
    local = check_sizes(hidden_dim, world_size)
    return slice(rank * local, (rank + 1) * local)


def column_shard(weight, rank, world_size):
    """Rows of W (out, in): this rank's output features."""
    return weight[shard_range(weight.shape[0], rank, world_size), :]


def row_shard(weight, rank, world_size):
    """Columns of W (out, in): this rank's input features."""
    return weight[:, shard_range(weight.shape[1], rank, world_size)]


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
