"""Checks for notebook 00 (setup): average_over_ranks."""
import torch
import torch.distributed as dist

from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff, seeded_randn
from utils.launch import spawn

AVERAGE_SHAPES = [(1,), (5,), (3, 4)]


def _average_main(rank, world_size, average_over_ranks, shapes, seed):
    runs = []
    for shape in shapes:
        before = seeded_randn(shape, seed, rank)
        tensor = before.clone()
        average_over_ranks(tensor)
        pytorch = before.clone()
        dist.all_reduce(pytorch, op=dist.ReduceOp.AVG)  # PyTorch's own average, as a second opinion
        runs.append((before, tensor, pytorch))
    return runs


def check_average_over_ranks(average_over_ranks, world_size, seed=0):
    """Every rank must end with the mean over ranks of its tensor, written in place."""
    results = spawn(_average_main, world_size, average_over_ranks, AVERAGE_SHAPES, seed, timeout=CHECK_TIMEOUT)
    for i, shape in enumerate(AVERAGE_SHAPES):
        inputs = torch.stack([results[rank][i][0] for rank in range(world_size)])
        mean = inputs.mean(dim=0)  # the single-process reference
        for rank in range(world_size):
            before, got, pytorch = results[rank][i]
            where = f"average_over_ranks on rank {rank}, shape {tuple(shape)}"
            assert max_abs_diff(pytorch, mean) < TOLERANCE, f"{where}: dist.all_reduce(AVG) disagrees with the mean"
            if max_abs_diff(got, mean) < TOLERANCE:
                continue
            if torch.equal(got, before):
                hint = "the tensor is unchanged: change it in place (all_reduce and /= do; t = t / n does not)"
            elif max_abs_diff(got, inputs.sum(dim=0)) < TOLERANCE:
                hint = "it holds the sum over ranks: divide by the world size"
            elif max_abs_diff(got, before / world_size) < TOLERANCE:
                hint = "it holds this rank's own tensor divided by the world size: the ranks never communicated"
            else:
                hint = f"max abs difference from the mean over ranks {max_abs_diff(got, mean):.3g}"
            raise AssertionError(f"{where}: wrong result; {hint}")
    shapes = ", ".join(str(tuple(s)) for s in AVERAGE_SHAPES)
    print(f"average_over_ranks: correct on {world_size} ranks for shapes {shapes}; "
          f"matches the single-process mean and dist.all_reduce(op=AVG) to {TOLERANCE:g}")


