"""How long does it take to start ranks? `utils.launch.spawn` against `torch.multiprocessing.spawn`.

    python benchmarks/launch_overhead.py [--world-size 4] [--repeat 5]

The job is the smallest real one: start the ranks, join a gloo process group, one all_reduce,
leave. Each launcher runs it `--repeat` times after one warm-up; the medians are printed.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from utils.bench import median_seconds
from utils.launch import resolve_start_method, spawn


def one_all_reduce(rank, world_size):
    dist.all_reduce(torch.ones(1))


def torch_mp_main(rank, world_size, init_file):
    """What a script using torch.multiprocessing.spawn has to do itself in each rank."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    one_all_reduce(rank, world_size)
    dist.destroy_process_group()


def torch_mp_job(world_size):
    with tempfile.TemporaryDirectory() as tmp:  # a file rendezvous: no port to find
        torch_mp.spawn(torch_mp_main, args=(world_size, os.path.join(tmp, "init")), nprocs=world_size)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n = args.world_size
    ours = median_seconds(lambda: spawn(one_all_reduce, n), repeat=args.repeat)
    theirs = median_seconds(lambda: torch_mp_job(n), repeat=args.repeat)
    print(f"{n} ranks: start, join a gloo group, one all_reduce, leave; median of {args.repeat} "
          f"on {os.cpu_count()} cores, {sys.platform}, torch {torch.__version__}")
    print(f"  {'utils.launch.spawn (' + resolve_start_method() + ')':30} {ours:7.3f} s")
    print(f"  {'torch.multiprocessing.spawn':30} {theirs:7.3f} s")
    print(f"  {'speed-up':30} {theirs / ours:7.1f}x")


if __name__ == "__main__":
    main()
