"""Run by tests/test_launch.py::test_under_torchrun (contract bullet 11):

    torchrun --standalone --nproc_per_node=2 tests/torchrun_spawn.py

Under torchrun, `spawn(fn, 2)` must run fn in the torchrun ranks themselves (same pid), give every
rank the whole list of results in rank order, work twice in a row (the process group is reused),
and refuse a world_size that does not match torchrun's with a ValueError naming both numbers.
Each rank prints "rank R ok (...)" after each check; any failed check exits non-zero.
"""
import os
import re

import torch
import torch.distributed as dist

from utils.launch import spawn


def fn(rank, world_size, scale=1):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    print(f"fn ran on rank {rank}")
    return rank, dist.get_world_size(), os.getpid(), t.item() * scale


def main():
    rank = int(os.environ["RANK"])
    for call in (1, 2):
        results = spawn(fn, 2, scale=call)
        assert [r[0] for r in results] == [0, 1], results
        assert [r[1] for r in results] == [2, 2], results
        assert results[rank][2] == os.getpid(), (results, os.getpid())  # fn ran in this process
        assert results[1 - rank][2] != os.getpid(), results  # and the other rank in the other one
        assert [r[3] for r in results] == [3.0 * call, 3.0 * call], results
        print(f"rank {rank} ok (call {call})", flush=True)
    try:
        spawn(fn, 3)
    except ValueError as e:
        assert re.search(r"\b3\b", str(e)) and re.search(r"\b2\b", str(e)), str(e)
    else:
        raise AssertionError("spawn(fn, 3) under a 2-rank torchrun did not raise ValueError")
    print(f"rank {rank} ok (world_size mismatch refused)", flush=True)


if __name__ == "__main__":
    main()
