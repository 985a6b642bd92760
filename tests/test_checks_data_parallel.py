"""utils/checks/data_parallel.py: right answers (the solution notebook's own code) pass at any world size;
each wrong answer in the catalogue, a small edit of the real solution, fails at its own check with a hint
that names the mistake."""
import pytest
import torch

from utils.checks.data_parallel import (
    check_bucketed_sync,
    check_data_parallel,
    check_matches_pytorch_ddp,
    check_micro_batches,
    check_overlapped_sync,
)
from utils.data_parallel import check_sizes, expected_buckets, train_data_parallel
from utils.launch import RankError, spawn
from utils.model import Sizes
from utils.notebooks import solution

SIZES = dict(hidden_dim=8, num_layers=4, batch_size=12, num_steps=3, seed=0)
NOTEBOOK = "02_data_parallel"


def run_check(exercise, sol, world_size=2, num_micro_batches=2, **sizes):
    sizes = {**SIZES, **sizes}
    if exercise == "data parallel":
        check_data_parallel(sol.broadcast_parameters, sol.average_gradients, world_size, **sizes)
    elif exercise == "micro-batches":
        check_micro_batches(sol.broadcast_parameters, sol.average_gradients, sol.train_step_with_micro_batches,
                            num_micro_batches, world_size, **sizes)
    elif exercise == "overlapped":
        check_overlapped_sync(sol.OverlappedGradientSync, world_size, **sizes)
    else:
        check_bucketed_sync(sol.BucketedGradientSync, world_size, **sizes)


# ---------------------------------------------------------------- right answers

# 2 ranks under pytest -m slow (1.8 s): an even split, as the notebook's own check cells (4 ranks, every check and
# PyTorch DDP's match) and the 4-rank test below; 1 (a group of one) and 3 (odd) stay
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_right_answers_pass(world_size, capsys):
    sol = solution(NOTEBOOK)
    for exercise in ("data parallel", "micro-batches", "overlapped", "bucketed"):
        run_check(exercise, sol, world_size)
    variants = {"naive": dict(train_step=sol.train_step),
                "overlapped": dict(gradient_sync=sol.OverlappedGradientSync),
                "bucketed": dict(gradient_sync=lambda m: sol.BucketedGradientSync(m, 0.0003))}
    check_matches_pytorch_ddp(variants, sol.broadcast_parameters, 2, world_size, **SIZES)
    assert capsys.readouterr().out.count(f"on {world_size} ranks") == 5


def test_right_answers_pass_on_4_ranks_and_an_even_number_of_layers():
    sol = solution(NOTEBOOK)
    for exercise in ("data parallel", "micro-batches", "overlapped", "bucketed"):
        run_check(exercise, sol, 4, batch_size=16, num_layers=2)


# ---------------------------------------------------------------- the catalogue of wrong answers

CATALOGUE = {
    # broadcast_parameters
    "no broadcast": ("data parallel", {
        "    for p in model.parameters():\n        dist.broadcast(p.detach(), src=0)\n"
        "    for buffer in model.buffers():\n        dist.broadcast(buffer, src=0)\n": "    pass\n"},
        "ranks disagree: broadcast every parameter"),
    "broadcast from rank 1": ("data parallel", {"dist.broadcast(p.detach(), src=0)":
                                                "dist.broadcast(p.detach(), src=1)"},
                              "every rank holds the same value, but not rank 0's: broadcast with src=0"),
    "buffers not broadcast": ("data parallel", {"    for buffer in model.buffers():\n"
                                                "        dist.broadcast(buffer, src=0)\n": ""},
                              r"rank 1's shift differs .* it is a buffer: broadcast model.buffers\(\) too"),
    "frozen parameters not broadcast": ("data parallel", {
        "        dist.broadcast(p.detach(), src=0)\n":
        "        if p.requires_grad:\n            dist.broadcast(p.detach(), src=0)\n"},
        r"rank 1's frozen.weight differs .* broadcast every parameter \(frozen ones too\)"),
    "broadcast into the parameter itself (autograd records it)": (
        "data parallel", {"dist.broadcast(p.detach(), src=0)": "dist.broadcast(p, src=0)"},
        r"\(mlp, sgd\): rank 0 raised RuntimeError: dist.broadcast into a tensor that requires grad: autograd "
        r"would record the write .* outside autograd"),
    # average_gradients
    "sum, not mean": ("data parallel", {"            p.grad /= world_size\n": ""},
                      "2 times too large: the sum over ranks, not the mean; divide by the world size"),
    "never all-reduced": ("data parallel", {"            dist.all_reduce(p.grad)\n": ""},
                          "this rank's own gradient divided by the world size: it was never summed over the ranks"),
    "divided twice": ("data parallel", {"            dist.all_reduce(p.grad)\n":
                                        "            p.grad /= world_size\n            dist.all_reduce(p.grad)\n"},
                      "the mean divided by the world size once more"),
    "a None gradient all-reduced": ("data parallel", {
        "        if p.grad is not None:\n            dist.all_reduce(p.grad)\n            p.grad /= world_size\n":
        "        dist.all_reduce(p.grad)\n        p.grad /= world_size\n"},
        r"data parallel \(awkward, sgd\): rank 0 raised .* frozen.weight is frozen"),
    # train_step_with_micro_batches
    "micro-batch losses not divided": ("micro-batches", {
        "        loss = loss_fn(model(micro_batch)) / num_micro_batches\n":
        "        loss = loss_fn(model(micro_batch))\n"},
        "2 times too large, the number of micro-batches: divide each micro-batch's loss by num_micro_batches"),
    "all-reduce per micro-batch": ("micro-batches", {
        "        loss.backward()\n    average_gradients(model)\n":
        "        loss.backward()\n        average_gradients(model)\n"},
        r"made \[8, 8, 8\] all-reduces in steps \[0, 1, 2\] \(a round per micro-batch\); average_gradients once "
        r"per step makes \[4, 4, 4\]"),
    "optimizer step per micro-batch": ("micro-batches", {
        "        loss.backward()\n    average_gradients(model)\n    optimizer.step()\n":
        "        loss.backward()\n        average_gradients(model)\n        optimizer.step()\n"},
        r"called optimizer.step\(\) 6 times in 3 steps: step once per batch"),
    # OverlappedGradientSync
    "overlap: wait in the hook": ("overlapped", {
        "        self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))\n":
        "        self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))\n"
        "        self.pending[-1][1].wait()\n"},
        r"all-reduce 0 was waited for in the backward pass \(1 of 4 gradients ready\), while the backward pass was "
        r"still running: nothing overlaps"),
    "overlap: blocking all-reduce": ("overlapped", {"dist.all_reduce(param.grad, async_op=True)":
                                                    "dist.all_reduce(param.grad)"},
                                     "all-reduce 0 is blocking: start it with async_op=True"),
    "overlap: all-reduces started in finish": ("overlapped", {
        "        self.pending.append((param, dist.all_reduce(param.grad, async_op=True)))\n":
        "        self.pending.append((param, None))\n",
        "            handle.wait()\n": "            dist.all_reduce(param.grad, async_op=True).wait()\n"},
        r"all-reduce 0 started in finish\(\) \(4 of 4 gradients ready\), not when it should; it should start in the "
        r"backward pass \(1 of 4 gradients ready\)"),
    "overlap: handles not forgotten": ("overlapped", {"        self.pending.clear()\n": ""},
                                       r"at step 1, .*\(step 0 was right: reset what your code keeps between "
                                       r"steps\)"),
    "overlap: divided twice": ("overlapped", {
        "        self.pending.append((param, dist.all_reduce(": "        param.grad /= self.world_size\n"
                                                                "        self.pending.append((param, dist.all_reduce("},
        "at step 0, .* the mean divided by the world size once more"),
    "overlap: hooks on frozen parameters": ("overlapped", {
        "            if p.requires_grad:  # a frozen parameter gets no gradient, and cannot take a hook\n"
        "                p.register_post_accumulate_grad_hook(self.gradient_ready)\n":
        "            p.register_post_accumulate_grad_hook(self.gradient_ready)\n"},
        r"OverlappedGradientSync \(awkward\): rank 0 raised RuntimeError: .*hook.* frozen.weight is frozen"),
    # BucketedGradientSync
    "buckets: wait in the hook": ("bucketed", {
        "== len(self.buckets[b]):\n            self.handles[b] = dist.all_reduce(self.buffers[b], async_op=True)\n":
        "== len(self.buckets[b]):\n            self.handles[b] = dist.all_reduce(self.buffers[b], async_op=True)\n"
        "            self.handles[b].wait()\n"},
        "all-reduce 0 was waited for in the backward pass .* nothing overlaps"),
    "buckets: filled in forward order": ("bucketed", {
        "reversed([p for p in model.parameters() if p.requires_grad])":
        "[p for p in model.parameters() if p.requires_grad]"},
        r"expected 3 all-reduce\(s\) of \[1024, 1024, 512\] bytes, in this order .* reverse parameter order.* "
        r"got 3 of \[512, 1024, 1024\] bytes"),
    "buckets: started before full": ("bucketed", {"if self.ready[b] == len(self.buckets[b]):":
                                                  "if self.ready[b] == 1:"},
                                     r"all-reduce 0 started in the backward pass \(1 of 5 gradients ready\), "
                                     r"before its bucket was full"),
    "buckets: handles not reset": ("bucketed", {
        "        self.ready, self.handles = [0] * len(self.buckets), [None] * len(self.buckets)\n":
        "        self.ready = [0] * len(self.buckets)\n"},
        r"\(awkward, one bucket\), rank 0, step 1: expected 2 all-reduce\(s\).* \(step 0 was right: reset what your "
        r"code keeps between steps\)"),
    "buckets: counts not reset": ("bucketed", {
        "        self.ready, self.handles = [0] * len(self.buckets), [None] * len(self.buckets)\n":
        "        self.handles = [None] * len(self.buckets)\n"},
        r"step 1: all-reduce 0 started in finish\(\) .* from the hook of its last gradient \(step 0 was right"),
    "buckets: hooks on frozen parameters": ("bucketed", {
        "reversed([p for p in model.parameters() if p.requires_grad])": "reversed(list(model.parameters()))"},
        r"BucketedGradientSync \(awkward, one bucket\): rank 0 raised RuntimeError: .* frozen.weight is frozen"),
    # values that match no known mistake (as when a sum is divided before its wait): the reminder of the wait
    "overlapped: gradients off by an unexplained amount": ("overlapped", {
        "            param.grad /= self.world_size\n": "            param.grad /= self.world_size\n"
                                                        "            param.grad += 0.01\n"},
        "it differs from the whole batch's gradient .* divide \\(or copy out\\) after the wait"),
    "buckets: a parameter that fills a bucket exactly opens a new one": ("bucketed", {
        "size + nbytes <= capacity": "size + nbytes < capacity"},
        r"BucketedGradientSync \(mlp, 2 weights per bucket\)"),
    "buckets: dtypes mixed in a bucket": ("bucketed", {"p.numel() * p.element_size(), p.dtype  #":
                                                       "p.numel() * p.element_size(), None  #"},
                                          r"\(awkward, one bucket\): rank 0 raised .* a flat buffer holds one dtype: "
                                          r"keep one open bucket per dtype"),
    "buckets: a bucket that is not full never sent": ("bucketed", {
        "                self.handles[b] = dist.all_reduce(self.buffers[b], async_op=True)\n":
        "                pass\n"},
        r"\(awkward, one bucket\): rank 0 raised AttributeError: .* a bucket that did not fill up has no handle until "
        r"finish\(\) starts its all-reduce"),
}


@pytest.mark.parametrize("mistake", list(CATALOGUE))
def test_each_wrong_answer_fails_at_its_own_check_and_says_why(mistake):
    exercise, replace, message = CATALOGUE[mistake]
    with pytest.raises(AssertionError, match=message):
        run_check(exercise, solution(NOTEBOOK, replace=replace))


@pytest.mark.parametrize("world_size, batch_size", [(2, 12), (3, 12), (4, 16)])
def test_unweighted_micro_batches_are_named_at_every_world_size(world_size, batch_size):
    wrong = solution(NOTEBOOK, replace={"        loss = loss_fn(model(micro_batch)) / num_micro_batches\n":
                                        "        loss = loss_fn(model(micro_batch))\n"})
    with pytest.raises(AssertionError) as failure:
        run_check("micro-batches", wrong, world_size, batch_size=batch_size)
    message = str(failure.value)
    assert "2 times too large, the number of micro-batches" in message
    assert "world size" not in message and " 0.0" not in message


# ---------------------------------------------------------------- sizes and buckets

def test_sizes_that_do_not_divide_fail_before_any_process_starts():
    sol = solution(NOTEBOOK)
    with pytest.raises(ValueError, match="batch size 10 is not divisible by world size 4"):
        run_check("data parallel", sol, 4, batch_size=10)
    with pytest.raises(ValueError, match="local batch size 6 is not divisible by num micro batches 4"):
        run_check("micro-batches", sol, 2, num_micro_batches=4)
    assert check_sizes(12, 3, 2) == 4


def test_expected_buckets_skip_frozen_parameters_and_keep_one_dtype_per_bucket():
    def params(*specs):
        return [torch.zeros(n, dtype=dtype, requires_grad=grad) for n, dtype, grad in specs]

    f64, f32 = torch.float64, torch.float32
    assert expected_buckets(params(*[(25, f32, True)] * 5), 250 / 2**20) == [[4, 3], [2, 1], [0]]
    assert expected_buckets(params(*[(10, f64, True)] * 3), 1) == [[2, 1, 0]]
    assert expected_buckets(params((10, f64, True), (10, f64, False), (10, f32, True), (10, f64, True)), 1) == \
        [[3, 0], [2]]


# ---------------------------------------------------------------- ranks that disagree: refused, never a hang

# utils.data_parallel.DataBranch on 2 ranks, 2 rows each, one step: with seed 3 rank 0's rows take the branch and rank
# 1's do not (whole or in micro-batches of one row); with seed 4 both ranks take it (and leave `frozen` unused alike).
BRANCH = dict(hidden_dim=4, num_layers=2, batch_size=4, num_steps=1)
DISAGREE, AGREE = 3, 4
UNUSED_ON_RANK_1 = (r"rank 1 of 2 failed: utils\.data_parallel\.UnusedParameterError: rank 1, step 0: trainable "
                    r"parameter branch\.layers\.0\.linear\.weight took no part in this step's loss on this rank.*"
                    r"find_unused_parameters")


def branch_versions(sol):
    return {"average_gradients": dict(train_step=sol.train_step),
            "micro-batches": dict(train_step=lambda m, o, b: sol.train_step_with_micro_batches(m, o, b, 2)),
            "overlapped": dict(gradient_sync=sol.OverlappedGradientSync),
            "bucketed": dict(gradient_sync=lambda model: sol.BucketedGradientSync(model, 1))}


@pytest.mark.parametrize("version", ["average_gradients", "micro-batches", "overlapped", "bucketed"])
def test_a_parameter_used_on_one_rank_only_is_refused_naming_it_the_rank_and_the_step(version):
    """Before the refusal: 'Connection closed by peer' (naive, micro-batches, overlapped), or ranks that silently
    diverge (bucketed). Now the rank that left the parameter out raises before its gradients are synchronized; the
    other, left waiting, is stopped (timeout=30: a stall would be a TimeoutError, not this)."""
    sol = solution(NOTEBOOK)
    sizes = Sizes(**BRANCH, seed=DISAGREE, model="branch")
    with pytest.raises(RankError, match=UNUSED_ON_RANK_1):
        spawn(train_data_parallel, 2, sol.broadcast_parameters, **branch_versions(sol)[version], sizes=sizes,
              timeout=30)


def train_each_version(rank, world_size, versions, sizes):
    return [train_data_parallel(rank, world_size, versions["broadcast"], **version, sizes=sizes)
            for version in versions["steps"]]


def test_a_frozen_parameter_unused_on_every_rank_still_trains():
    sol = solution(NOTEBOOK)
    versions = dict(broadcast=sol.broadcast_parameters, steps=list(branch_versions(sol).values()))
    runs = spawn(train_each_version, 2, versions, Sizes(**BRANCH, seed=AGREE, model="branch"), timeout=30)
    for on_rank_0, on_rank_1 in zip(*runs):
        assert on_rank_0.losses and all(torch.equal(a, b) for a, b in zip(on_rank_0.weights, on_rank_1.weights))
        assert not torch.equal(on_rank_0.start[-2], on_rank_0.weights[-2])  # the branch trained
        assert torch.equal(on_rank_0.start[-1], on_rank_0.weights[-1])  # frozen: unchanged
