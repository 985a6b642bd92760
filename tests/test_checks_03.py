"""The notebook 03 checks: right answers pass at any world size, each typical wrong one fails with a hint."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from utils import tensor_parallel as tp
from utils.checks.tensor_parallel import (
    check_all_gather_forward,
    check_parallel_linear,
    check_parallel_regions,
    check_tensor_parallel_mlp,
)

HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS = 12, 4, 6, 2


# ---------------------------------------------------------------- right answers, with switches for the wrong ones

def regions(copy_forward=False, copy_backward=True, reduce_forward=True, reduce_backward=False, clone=True):
    """(Copy, Reduce) autograd functions that all-reduce in the directions asked for."""
    def maybe_all_reduce(t, on):
        if not on:
            return t.view_as(t)
        t = t.clone() if clone else t
        dist.all_reduce(t)
        return t

    class CopyToParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return maybe_all_reduce(x, copy_forward)

        @staticmethod
        def backward(ctx, grad):
            return maybe_all_reduce(grad, copy_backward)

    class ReduceFromParallelRegion(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return maybe_all_reduce(x, reduce_forward)

        @staticmethod
        def backward(ctx, grad):
            return maybe_all_reduce(grad, reduce_backward)

    return CopyToParallelRegion, ReduceFromParallelRegion


def linears(copy=None, reduce=None, column_dim=0, row_dim=1, shift=0, **region_kwargs):
    """(Column, Row) parallel linear classes; copy/reduce=False leaves that autograd function out."""
    Copy, Reduce = regions(**region_kwargs)

    class ColumnParallelLinear(nn.Module):
        def __init__(self, weight, rank, world_size):
            super().__init__()
            self.weight = nn.Parameter(weight.chunk(world_size, dim=column_dim)[(rank + shift) % world_size].clone())

        def forward(self, x):
            return (x if copy is False else Copy.apply(x)) @ self.weight.T

    class RowParallelLinear(nn.Module):
        def __init__(self, weight, rank, world_size):
            super().__init__()
            self.weight = nn.Parameter(weight.chunk(world_size, dim=row_dim)[rank].clone())

        def forward(self, x):
            y = x @ self.weight.T
            return y if reduce is False else Reduce.apply(y)

    return ColumnParallelLinear, RowParallelLinear


def all_gather_forward(x, shards, order=1, gather=True):
    n = dist.get_world_size()
    for w in shards:
        y = F.gelu(x @ w.T)
        if not gather:
            x = y
            continue
        pieces = [torch.empty_like(y) for _ in range(n)]
        dist.all_gather(pieces, y)
        x = torch.cat(pieces[::order], dim=1)
    return x


# ---------------------------------------------------------------- they pass

@pytest.mark.parametrize("world_size", [2, 3])
def test_right_answers_pass(world_size, capsys):
    check_all_gather_forward(all_gather_forward, world_size, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE)
    check_parallel_regions(*regions(), world_size)
    check_parallel_linear(*linears(), world_size, HIDDEN_DIM, BATCH_SIZE)
    check_tensor_parallel_mlp(*linears(), world_size, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)
    out = capsys.readouterr().out
    assert "tensor parallel MLP: correct" in out and "DTensor" in out


def test_sizes_name_both_numbers():
    with pytest.raises(ValueError, match="hidden dim 10 .* world size 4"):
        tp.check_sizes(10, 4)
    with pytest.raises(ValueError, match="num layers 3 is odd"):
        tp.check_sizes(12, 4, 3)
    with pytest.raises(ValueError, match="hidden dim 10 .* world size 4"):
        check_parallel_linear(*linears(), 4, 10, BATCH_SIZE)


# ---------------------------------------------------------------- they fail, saying why

def test_all_gather_forward_without_gather_fails():
    with pytest.raises(AssertionError, match="this rank's features only"):
        check_all_gather_forward(lambda x, s: all_gather_forward(x, s, gather=False), 2, HIDDEN_DIM, 1, BATCH_SIZE)


def test_all_gather_forward_in_wrong_order_fails():
    with pytest.raises(AssertionError, match="rank order"):
        check_all_gather_forward(lambda x, s: all_gather_forward(x, s, order=-1), 2, HIDDEN_DIM, 2, BATCH_SIZE)


@pytest.mark.parametrize("kwargs, match", [
    (dict(copy_backward=False), "CopyToParallelRegion on rank 0 of 2: backward: it is this rank's own gradient"),
    (dict(copy_forward=True), "CopyToParallelRegion on rank 0 of 2: forward: it is the sum over ranks"),
    (dict(reduce_forward=False), "ReduceFromParallelRegion on rank 0 of 2: forward: it is this rank's own input"),
    (dict(reduce_backward=True), "ReduceFromParallelRegion on rank 0 of 2: backward: it is the sum over ranks"),
    (dict(clone=False), "changed its input in place"),
])
def test_wrong_regions_fail(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        check_parallel_regions(*regions(**kwargs), 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(copy=False), "ColumnParallelLinear on rank 0 of 2: wrong input gradient; it is this rank's part"),
    (dict(copy_backward=False), "ColumnParallelLinear on rank 0 of 2: wrong input gradient; it is this rank's part"),
    (dict(reduce=False), "RowParallelLinear on rank 0 of 2: wrong output; it is this rank's partial sum"),
    (dict(reduce_forward=False), "RowParallelLinear on rank 0 of 2: wrong output; it is this rank's partial sum"),
    (dict(reduce_backward=True), "RowParallelLinear on rank 0 of 2: wrong input gradient; it is 2 times too large"),
    (dict(copy_forward=True), "ColumnParallelLinear on rank 0 of 2: wrong output"),
    (dict(shift=1), "ColumnParallelLinear on rank 0 of 2: self.weight is not this rank's rows .* it is rank 1's"),
    (dict(column_dim=1), "ColumnParallelLinear on rank 0 of 2: self.weight .* expected shape \\(6, 12\\)"),
    (dict(row_dim=0), "RowParallelLinear on rank 0 of 2: self.weight is not this rank's columns"),
])
def test_wrong_linears_fail(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        check_parallel_linear(*linears(**kwargs), 2, HIDDEN_DIM, BATCH_SIZE)


@pytest.mark.parametrize("kwargs, match", [
    (dict(copy_backward=False), "the input's gradient differs"),
    (dict(reduce_forward=False), "the output differs"),
    (dict(reduce_backward=True), "the input's gradient differs"),
    (dict(shift=1), "the output differs"),
])
def test_wrong_mlps_fail(kwargs, match):
    with pytest.raises(AssertionError, match="the tensor parallel MLP on rank 0 of 2: " + match):
        check_tensor_parallel_mlp(*linears(**kwargs), 2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)


def test_an_extra_all_reduce_that_changes_nothing_is_counted():
    """An all-reduce whose result is thrown away changes no value: only the count shows it."""
    Column, Row = linears()

    class ExtraRow(Row):
        def forward(self, x):
            y = super().forward(x)
            extra = y.detach().clone()
            dist.all_reduce(extra)
            return y

    with pytest.raises(AssertionError, match="4 all-reduce\\(s\\) in forward and 2 in backward .* expected 2 and 2"):
        check_tensor_parallel_mlp(Column, ExtraRow, 2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)
