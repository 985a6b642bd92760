"""The notebook 05 checks: right answers pass, each typical wrong one fails and says what is wrong."""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from utils import fsdp
from utils.checks.fsdp import check_fsdp, check_memory, check_prefetch, check_zero1, check_zero2
from utils.model import make_optimizer

HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS = 8, 3, 4, 2


# ---------------------------------------------------------------- right answers, with switches for the wrong ones

def gather_parameters(params, shards, gather=True, free=True):
    n = dist.get_world_size()
    for p, shard in zip(params, shards):
        full = torch.empty(n * shard.numel(), dtype=shard.dtype)
        if gather:
            dist.all_gather_single(full, shard.detach())
            p.detach().copy_(fsdp.unshard(full, p.shape))
        if free:
            fsdp.free(full)


def zero1(all_reduce=True, divide=True, gather=True, whole_state=False):
    class Zero1AdamW:
        def __init__(self, params):
            self.params = list(params)
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            self.shards = [nn.Parameter(fsdp.shard(p, self.rank, self.world_size)) for p in self.params]
            self.optimizer = make_optimizer(self.params if whole_state else self.shards, "adamw")

        def step(self):
            for p, shard in zip(self.params, self.shards):
                if all_reduce:
                    dist.all_reduce(p.grad)
                if divide:
                    p.grad /= self.world_size
                if whole_state:
                    shard.grad = fsdp.shard(p.grad, self.rank, self.world_size)
                    continue
                shard.grad = fsdp.shard(p.grad, self.rank, self.world_size)
                p.grad = None
            self.optimizer.step()
            if not whole_state:
                gather_parameters(self.params, self.shards, gather)

        def zero_grad(self):
            for p in self.params:
                p.grad = None
            self.optimizer.zero_grad()

    return Zero1AdamW


def reduce_scatter_gradient(grad, how="reduce_scatter", divide=True, pad=True):
    n, rank = dist.get_world_size(), dist.get_rank()
    flat = fsdp.flat_padded(grad, n) if pad else grad.reshape(-1)
    if how == "reduce_scatter":
        shard = torch.empty(flat.numel() // n, dtype=flat.dtype)
        dist.reduce_scatter_single(shard, flat)
    elif how == "all_reduce":
        total = flat.clone()
        dist.all_reduce(total)
        shard = total.chunk(n)[rank].clone()
    else:  # skipped
        shard = flat.chunk(n)[rank].clone()
    return shard / n if divide else shard


def zero2(drop=True, **scatter):
    class Zero2AdamW(zero1()):
        def __init__(self, params):
            super().__init__(params)
            for p, shard in zip(self.params, self.shards):
                p.register_post_accumulate_grad_hook(functools.partial(self.scatter_gradient, shard=shard))

        def scatter_gradient(self, p, shard):
            shard.grad = reduce_scatter_gradient(p.grad, **scatter)
            if drop:
                p.grad = None

        def step(self):
            self.optimizer.step()
            gather_parameters(self.params, self.shards)

    return Zero2AdamW


def all_gather_unit(shard, shape, gather=True, unpad="end"):
    full = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
    if gather:
        dist.all_gather_single(full, shard)
    numel = shape[0] * shape[1]
    return (full[:numel] if unpad == "end" else full[-numel:]).view(shape)


def fsdp_linear(free=True, regather=True, **scatter):
    class FSDPLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, gather):
            weight = gather("forward")
            ctx.save_for_backward(x)
            ctx.gather, ctx.weight = gather, (None if regather else weight)
            out = x @ weight.T
            if free and regather:
                fsdp.free(weight)
            return out

        @staticmethod
        def backward(ctx, grad_output):
            (x,) = ctx.saved_tensors
            weight = ctx.gather("backward") if regather else ctx.weight
            grad_x = grad_output @ weight
            if free:
                fsdp.free(weight)
            return grad_x, reduce_scatter_gradient(grad_output.T @ x, **scatter), None

    return FSDPLinear


def prefetcher(ahead=True, extra=0):
    class Prefetcher:
        def __init__(self, shards, shapes, cap):
            self.shards, self.shapes, self.cap = shards, shapes, cap + extra
            self.in_flight = {}

        def start(self, unit):
            shard = self.shards[unit].detach()
            full = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype)
            self.in_flight[unit] = full, dist.all_gather_single(full, shard, async_op=True)

        def get(self, unit, phase):
            direction = 1 if phase == "forward" else -1
            if unit not in self.in_flight:
                self.start(unit)
            full, work = self.in_flight.pop(unit)
            following = unit + direction
            while ahead and len(self.in_flight) < self.cap and 0 <= following < len(self.shards):
                if following not in self.in_flight:
                    self.start(following)
                following += direction
            work.wait()
            return fsdp.unshard(full, self.shapes[unit])

    return Prefetcher


SIZES = (2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)


# ---------------------------------------------------------------- they pass

def test_right_answers_pass(capsys):
    check_zero1(zero1(), *SIZES)
    check_zero2(zero2(), *SIZES)
    check_fsdp(fsdp_linear(), all_gather_unit, *SIZES)
    rows = check_memory(zero1(), zero2(), fsdp_linear(), all_gather_unit, 2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE)
    check_prefetch(fsdp_linear(), prefetcher(), *SIZES)
    out = capsys.readouterr().out
    assert "ZeroRedundancyOptimizer" in out and "FSDP2" in out and "padded to" in out
    assert rows["DDP"][0]["parameters"] == 4 * NUM_LAYERS * HIDDEN_DIM**2
    assert rows["FSDP"][0]["parameters"] == 4 * NUM_LAYERS * HIDDEN_DIM**2 // 2


def test_sizes_name_both_numbers():
    with pytest.raises(ValueError, match="batch size 10 .* world size 4"):
        fsdp.check_sizes(10, 4)
    with pytest.raises(ValueError, match="batch size 5 .* world size 2"):
        check_fsdp(fsdp_linear(), all_gather_unit, 2, HIDDEN_DIM, NUM_LAYERS, 5, NUM_STEPS)


def test_shards_are_padded_and_unshard_drops_the_padding():
    w = torch.arange(10.0).view(2, 5)
    shards = [fsdp.shard(w, r, 3) for r in range(3)]
    assert [s.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert torch.equal(fsdp.unshard(torch.cat(shards), (2, 5)), w)


# ---------------------------------------------------------------- they fail, saying why

@pytest.mark.parametrize("kwargs, match", [
    (dict(gather=False), "Zero1AdamW on rank 0 of 2: one step called 3 all-reduce\\(s\\), 0 all-gather\\(s\\)"),
    (dict(divide=False), "2 times too large"),
    (dict(all_reduce=False, divide=False), "called 0 all-reduce\\(s\\), 3 all-gather\\(s\\)"),
])
def test_wrong_zero1_fails(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        check_zero1(zero1(**kwargs), *SIZES)


def test_zero1_with_the_whole_models_optimizer_state_fails_the_memory_check():
    with pytest.raises(AssertionError, match="Zero1AdamW on rank 0 of 2: AdamW's state .* over the shards only"):
        check_memory(zero1(whole_state=True), zero2(), fsdp_linear(), all_gather_unit, 2, HIDDEN_DIM, NUM_LAYERS,
                     BATCH_SIZE)


@pytest.mark.parametrize("kwargs, match", [
    (dict(how="all_reduce"), "called 3 all-reduce\\(s\\), 3 all-gather\\(s\\), 0 reduce-scatter\\(s\\)"),
    (dict(how="skip"), "called 0 all-reduce\\(s\\), 3 all-gather\\(s\\), 0 reduce-scatter\\(s\\)"),
    (dict(divide=False), "2 times too large"),
    (dict(drop=False), "still hold their whole gradient"),
])
def test_wrong_zero2_fails(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        check_zero2(zero2(**kwargs), *SIZES)


@pytest.mark.parametrize("linear, gather, match", [
    (dict(), dict(gather=False), "called 0 all-reduce\\(s\\), 0 all-gather\\(s\\), 3 reduce-scatter\\(s\\)"),
    (dict(how="skip"), dict(), "called 0 all-reduce\\(s\\), 6 all-gather\\(s\\), 0 reduce-scatter\\(s\\)"),
    (dict(divide=False), dict(), "2 times too large"),
    (dict(pad=False), dict(), "rank . of 3 failed"),  # gloo refuses unequal pieces
    (dict(), dict(unpad="start"), "3 ranks \\(hidden 10\\)"),
    (dict(regather=False), dict(), "called 0 all-reduce\\(s\\), 3 all-gather\\(s\\), 3 reduce-scatter\\(s\\)"),
])
def test_wrong_fsdp_fails(linear, gather, match):
    with pytest.raises(Exception, match=match):
        check_fsdp(fsdp_linear(**linear), functools.partial(all_gather_unit, **gather), *SIZES)


@pytest.mark.parametrize("linear", [dict(free=False), dict(regather=False)])
def test_a_gathered_unit_never_freed_fails_the_memory_check(linear):
    with pytest.raises(AssertionError, match="naive FSDP on rank 0 of 2: up to [2-9] gathered units"):
        check_memory(zero1(), zero2(), fsdp_linear(**linear), all_gather_unit, 2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ahead=False), "Prefetcher\\(cap=1\\) .* not started ahead"),
    (dict(extra=1), "Prefetcher\\(cap=0\\) .* more gathers are in flight"),
])
def test_wrong_prefetchers_fail(kwargs, match):
    with pytest.raises(AssertionError, match=match):
        check_prefetch(fsdp_linear(), prefetcher(**kwargs), *SIZES)


def test_prefetching_without_freeing_fails():
    with pytest.raises(AssertionError, match="Prefetcher\\(cap=0\\) .* more gathers"):
        check_prefetch(fsdp_linear(free=False), prefetcher(), *SIZES)
