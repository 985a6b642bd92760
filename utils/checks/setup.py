"""Checks for notebook 00 (setup): average_over_ranks.

The ranks each average a different random tensor and report what it held before and after, and which
collectives they called; the parent compares with the single-process mean and names the usual
mistakes (the sum, a copy's result thrown away, a division by the wrong number, ...).
"""
import dataclasses

import torch
import torch.distributed as dist

from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff, seeded_randn
from utils.counting import calls, record_communication
from utils.launch import runnable_world_sizes, spawn

AVERAGE_SHAPES = [(1,), (5,), (3, 4)]


@dataclasses.dataclass
class AverageRun:
    """One call of average_over_ranks on one rank."""
    before: torch.Tensor
    after: torch.Tensor
    all_reduces: int
    communication_calls: int
    pytorch: torch.Tensor  # dist.all_reduce(op=AVG) of the same tensor: a second opinion on the reference
    asynchronous: bool = False  # a call made with async_op=True
    unwaited: bool = False  # ... whose handle was never waited for before the function returned


def _average_main(rank, world_size, average_over_ranks, shapes, seed):
    runs = []
    for shape in shapes:
        before = seeded_randn(shape, seed, rank)
        tensor = before.clone()
        with record_communication() as log:
            average_over_ranks(tensor)
        pytorch = before.clone()
        dist.all_reduce(pytorch, op=dist.ReduceOp.AVG)
        runs.append(AverageRun(before, tensor, calls(log, "all_reduce"), len(log), pytorch,
                               any(not call.blocking for call in log),
                               any(not call.blocking and call.waited_at is None for call in log)))
    return runs


def _close(got, want):
    return got.shape == want.shape and max_abs_diff(got, want) < TOLERANCE


def _what_went_wrong(runs, inputs):
    """The usual mistakes, recognised by the values all ranks ended with (one rank alone can hold both its own
    tensor and the maximum)."""
    n, total = len(runs), inputs.sum(dim=0)

    def everywhere(value):  # value(rank) is what rank `rank` would hold after this mistake
        return all(_close(run.after, value(rank)) for rank, run in enumerate(runs))

    all_reduces = max(run.all_reduces for run in runs)
    if all_reduces > 1:
        return f"{all_reduces} all-reduces for one average: one sums the ranks' tensors, a second sums the sums"
    if all(run.communication_calls == 0 for run in runs):
        return "the ranks never communicated: dist.all_reduce sums a tensor over the ranks"
    if any(run.asynchronous for run in runs):
        return ("the all_reduce was asynchronous (async_op=True) and its result was used before it arrived: wait "
                "for its handle (.wait()) before dividing and before returning, or make it blocking")
    if everywhere(lambda rank: inputs[rank]):
        return "the tensor is unchanged: change it in place (all_reduce and /= do; t = t / n makes a new tensor)"
    if everywhere(lambda rank: total):
        return ("it holds the sum over ranks: divide it by the world size, in place (t = t / n makes a new tensor "
                "and leaves the caller's as it was)")
    if everywhere(lambda rank: inputs[rank] / n):
        return ("it holds this rank's own tensor divided by the world size: the all-reduce's result was lost "
                "(all_reduce works in place, on the very tensor you pass it; the result on a copy is thrown away)")
    if everywhere(lambda rank: total / n / n):
        return "it is the mean divided by the world size once more: ReduceOp.AVG already divides; divide once"
    if everywhere(lambda rank: inputs.max(dim=0).values / n):
        return "it is the maximum over ranks divided by the world size: sum over ranks (ReduceOp.SUM, the default)"
    k = next((k for k in range(1, 2 * n + 1) if everywhere(lambda rank: total / k)), None)
    if k is not None:
        return f"it holds the sum divided by {k}: divide by the world size, dist.get_world_size() (here {n})"
    difference = max(max_abs_diff(run.after, total / n) for run in runs)
    return f"its largest difference from the mean over ranks is {difference:.3g}"


def _check_average(where, runs, inputs):
    """The mean over ranks, in place, on every rank, with one collective call."""
    mean = inputs.mean(dim=0)  # the single-process reference
    for rank, run in enumerate(runs):
        assert _close(run.pytorch, mean), f"{where(rank)}: dist.all_reduce(AVG) disagrees with the mean"
        if run.unwaited:  # right or wrong values then depend on timing: say so whatever they are
            raise AssertionError(f"{where(rank)}: the all_reduce was asynchronous (async_op=True) and its handle was "
                                 f"never waited for: the tensor may or may not hold the sum when you use it; call "
                                 f".wait() before dividing, or make it blocking")
        if not _close(run.after, mean):
            raise AssertionError(f"{where(rank)}: wrong result; {_what_went_wrong(runs, inputs)}")
        if run.communication_calls != 1:
            raise AssertionError(f"{where(rank)}: the result is right but took {run.communication_calls} communication "
                                 f"calls; one dist.all_reduce is all an average needs (on 1 rank, any answer that "
                                 f"leaves the tensor alone looks right: the all_reduce must be there all the same)")


def check_average_over_ranks(average_over_ranks, world_size, seed=0):
    """Every rank must end with the mean over ranks of its tensor, written in place: on `world_size` ranks and
    on 3 (a division by a fixed number that happens to be the world size is right on one of them only)."""
    world_sizes = runnable_world_sizes(sorted({world_size, 3}))
    for n in world_sizes:
        results = spawn(_average_main, n, average_over_ranks, AVERAGE_SHAPES, seed, timeout=CHECK_TIMEOUT)
        for i, shape in enumerate(AVERAGE_SHAPES):
            runs = [results[rank][i] for rank in range(n)]
            inputs = torch.stack([run.before for run in runs])
            _check_average(lambda rank: f"average_over_ranks on rank {rank} of {n}, shape {tuple(shape)}", runs,
                           inputs)
    shapes = ", ".join(str(tuple(s)) for s in AVERAGE_SHAPES)
    print(f"average_over_ranks: correct on {' and '.join(map(str, world_sizes))} ranks for shapes {shapes}; matches "
          f"the single-process mean and dist.all_reduce(op=AVG) to {TOLERANCE:g}, with one all_reduce per call")
