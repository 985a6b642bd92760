"""The notebook 02 checks: right answers pass at any world size, each typical wrong one fails with a hint."""
import pytest
import torch
import torch.distributed as dist

from utils.checks.data_parallel import (
    check_bucketed_sync,
    check_data_parallel,
    check_matches_pytorch_ddp,
    check_micro_batches,
    check_overlapped_sync,
)
from utils.data_parallel import check_sizes, expected_buckets
from utils.model import loss_fn

SIZES = dict(hidden_dim=8, num_layers=4, batch_size=12, num_steps=2, seed=0)


# ---------------------------------------------------------------- right answers

def broadcast_parameters(model):
    for p in model.parameters():
        dist.broadcast(p.detach(), src=0)


def average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def train_step_with_micro_batches(model, optimizer, batch, num_micro_batches):
    for micro_batch in batch.chunk(num_micro_batches):
        (loss_fn(model(micro_batch)) / num_micro_batches).backward()
    average_gradients(model)
    optimizer.step()
    optimizer.zero_grad()


class OverlappedGradientSync:
    def __init__(self, model, async_op=True, wait=True, in_hook=True):
        self.pending, self.params = [], list(model.parameters())
        self.async_op, self.wait, self.in_hook = async_op, wait, in_hook
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.gradient_ready)

    def gradient_ready(self, param):
        if self.in_hook:
            self.start(param)

    def start(self, param):
        param.grad /= dist.get_world_size()
        self.pending.append(dist.all_reduce(param.grad, async_op=self.async_op))

    def finish(self):
        if not self.in_hook:
            for p in reversed(self.params):
                self.start(p)
        for handle in self.pending:
            if self.wait and handle is not None:
                handle.wait()
        if not self.wait:  # the values stay right (no race to lose); only the missing wait is wrong
            dist.barrier()
        self.pending.clear()


class BucketedGradientSync:
    def __init__(self, model, bucket_size_mb, order="reverse", wait=True):
        params = list(model.parameters())
        params = params[::-1] if order == "reverse" else params
        self.buckets, size, self.wait = [], 0, wait
        for p in params:
            nbytes = p.numel() * p.element_size()
            if self.buckets and size + nbytes <= bucket_size_mb * 2**20:
                self.buckets[-1].append(p)
                size += nbytes
            else:
                self.buckets.append([p])
                size = nbytes
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.ready, self.handles = [0] * len(self.buckets), [None] * len(self.buckets)
        for p in params:
            p.register_post_accumulate_grad_hook(self.gradient_ready)

    def gradient_ready(self, param):
        b = self.bucket_of[param]
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            self.flat = getattr(self, "flat", {})
            self.flat[b] = torch.cat([p.grad.view(-1) for p in self.buckets[b]])
            self.handles[b] = dist.all_reduce(self.flat[b], async_op=True)

    def finish(self):
        for b, bucket in enumerate(self.buckets):
            if self.wait:
                self.handles[b].wait()
            else:
                dist.barrier()
            flat, offset = self.flat[b] / dist.get_world_size(), 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self.ready, self.handles = [0] * len(self.buckets), [None] * len(self.buckets)


# ---------------------------------------------------------------- wrong answers

def no_broadcast(model):
    pass


def broadcast_from_rank_1(model):
    for p in model.parameters():
        dist.broadcast(p.detach(), src=1)


def summed_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def local_gradients(model):
    pass


def all_reduce_per_micro_batch(model, optimizer, batch, num_micro_batches):
    for micro_batch in batch.chunk(num_micro_batches):
        (loss_fn(model(micro_batch)) / num_micro_batches).backward()
        average_gradients(model)
    optimizer.step()
    optimizer.zero_grad()


def unweighted_micro_batches(model, optimizer, batch, num_micro_batches):
    for micro_batch in batch.chunk(num_micro_batches):
        loss_fn(model(micro_batch)).backward()
    average_gradients(model)
    optimizer.step()
    optimizer.zero_grad()


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_right_answers_pass(world_size, capsys):
    check_data_parallel(broadcast_parameters, average_gradients, world_size, **SIZES)
    check_micro_batches(broadcast_parameters, average_gradients, train_step_with_micro_batches, 2, world_size, **SIZES)
    check_overlapped_sync(OverlappedGradientSync, world_size, **SIZES)
    check_bucketed_sync(BucketedGradientSync, world_size, **SIZES)
    variants = {"naive": dict(train_step=lambda m, o, b: train_step_with_micro_batches(m, o, b, 1)),
                "overlapped": dict(gradient_sync=OverlappedGradientSync),
                "bucketed": dict(gradient_sync=lambda m: BucketedGradientSync(m, 0.0003))}
    check_matches_pytorch_ddp(variants, broadcast_parameters, 2, world_size, **SIZES)
    out = capsys.readouterr().out
    assert out.count(f"on {world_size} ranks") == 5


@pytest.mark.parametrize("broadcast, average, message", [
    (no_broadcast, average_gradients, "did you broadcast rank 0's parameters"),
    (broadcast_from_rank_1, average_gradients, "broadcast with src=0"),
    (broadcast_parameters, summed_gradients, "sum over ranks, not the mean"),
    (broadcast_parameters, local_gradients, "never all-reduced"),
])
def test_wrong_data_parallel_fails_and_says_why(broadcast, average, message):
    with pytest.raises(AssertionError, match=message):
        check_data_parallel(broadcast, average, 2, **SIZES)


def test_all_reduce_per_micro_batch_has_the_right_values_but_fails_the_count():
    with pytest.raises(AssertionError, match=r"\[8, 8\] all-reduces per step \(one round per micro-batch\)"):
        check_micro_batches(broadcast_parameters, average_gradients, all_reduce_per_micro_batch, 2, 2, **SIZES)


def test_unweighted_micro_batches_fail_on_the_gradient():
    with pytest.raises(AssertionError, match="at step 0, the gradient of layers.0.linear.weight"):
        check_micro_batches(broadcast_parameters, average_gradients, unweighted_micro_batches, 2, 2, **SIZES)


@pytest.mark.parametrize("options, message", [
    (dict(async_op=False), "without async_op=True"),
    (dict(wait=False), "had not been waited for"),
    (dict(in_hook=False), "after the backward pass had finished"),
])
def test_wrong_overlap_fails_and_says_why(options, message):
    with pytest.raises(AssertionError, match=message):
        check_overlapped_sync(lambda model: OverlappedGradientSync(model, **options), 2, **SIZES)


@pytest.mark.parametrize("options, message", [
    (dict(order="forward"), r"got 3 of \[512, 1024, 1024\] bytes"),
    (dict(wait=False), "had not been waited for"),
])
def test_wrong_buckets_fail_and_say_why(options, message):
    with pytest.raises(AssertionError, match=message):
        check_bucketed_sync(lambda model, mb: BucketedGradientSync(model, mb, **options), 2, **SIZES)


def test_buckets_of_the_wrong_size_fail():
    with pytest.raises(AssertionError, match=r"expected 3 all-reduce\(s\) of \[1024, 1024, 512\] bytes"):
        check_bucketed_sync(lambda model, mb: BucketedGradientSync(model, 2 * mb), 2, **SIZES)


def test_sizes_that_do_not_divide_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="batch size 10 is not divisible by world size 4"):
        check_data_parallel(broadcast_parameters, average_gradients, 4, **{**SIZES, "batch_size": 10})
    with pytest.raises(ValueError, match="local batch size 6 is not divisible by num micro batches 4"):
        check_micro_batches(broadcast_parameters, average_gradients, train_step_with_micro_batches, 4, 2, **SIZES)
    assert check_sizes(12, 3, 2) == 4


def test_expected_buckets():
    assert expected_buckets([100] * 5, 250 / 2**20) == [[4, 3], [2, 1], [0]]
    assert expected_buckets([100] * 3, 1) == [[2, 1, 0]]
    assert expected_buckets([100, 300, 100], 150 / 2**20) == [[2], [1], [0]]
