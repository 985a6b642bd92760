"""How long does it take to start ranks? Every way the course could, side by side, in one run.

    python benchmarks/launch_overhead.py [--world-size 4] [--repeat 5]

The job is the smallest real one: start the ranks, join a gloo process group, one all_reduce,
leave. Each way runs it once to warm up, then `--repeat` times; the medians are printed, and the
ratios to fork (the Linux default) and to torch.multiprocessing.spawn.

- fork: `spawn` with the fork start method (Linux's default);
- warm: `spawn` with the spawn start method and warm ranks (macOS's default): forks of a forkserver
  that has imported torch once; its first call, which starts that server, is printed too;
- cold: `spawn` with the spawn start method and warm=False: a new Python per rank per call;
- pool: a pool of rank processes kept between calls (the route utils.launch did not take: the
  processes would carry one call's state into the next), a minimal version written here to time it;
- torch.multiprocessing.spawn, as a script using it would do it.
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from utils.launch import spawn, threads_per_rank


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


def pool_worker(rank, world_size, connection):
    """A warm rank: for each (fn, folder) it receives, a fresh process group, fn, teardown, a reply."""
    torch.set_num_threads(threads_per_rank(world_size))
    while (job := connection.recv()) is not None:
        fn, folder = cloudpickle.loads(job)
        store = dist.FileStore(os.path.join(folder, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        fn(rank, world_size)
        dist.destroy_process_group()
        connection.send("done")


class Pool:
    def __init__(self, world_size):
        context = mp.get_context("spawn")
        pipes = [context.Pipe() for _ in range(world_size)]
        self.connections = [mine for mine, _ in pipes]
        self.procs = [context.Process(target=pool_worker, args=(rank, world_size, theirs))
                      for rank, (_, theirs) in enumerate(pipes)]
        for p in self.procs:
            p.start()

    def run(self, fn):
        with tempfile.TemporaryDirectory() as folder:
            job = cloudpickle.dumps((fn, folder))
            for c in self.connections:
                c.send(job)
            for c in self.connections:
                c.recv()

    def close(self):
        for c in self.connections:
            c.send(None)
        for p in self.procs:
            p.join()


def timed(job, repeat):
    """(seconds of the first call, median seconds of `repeat` calls after it)."""
    times = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n, repeat = args.world_size, args.repeat
    pools = []

    def pool_job():  # the first call starts the pool
        pools or pools.append(Pool(n))
        pools[0].run(one_all_reduce)

    rows = {
        "spawn, fork": timed(lambda: spawn(one_all_reduce, n, start_method="fork"), repeat),
        "spawn, spawn start method, warm": timed(lambda: spawn(one_all_reduce, n, start_method="spawn"), repeat),
        "spawn, spawn start method, cold": timed(
            lambda: spawn(one_all_reduce, n, start_method="spawn", warm=False), repeat),
        "a warm pool (not taken)": timed(pool_job, repeat),
        "torch.multiprocessing.spawn": timed(lambda: torch_mp_job(n), repeat),
    }
    pools[0].close()
    fork, theirs = rows["spawn, fork"][1], rows["torch.multiprocessing.spawn"][1]
    print(f"{n} ranks: start, join a gloo group, one all_reduce, leave; median of {repeat} after a first call, "
          f"{os.cpu_count()} cores, {sys.platform}, torch {torch.__version__}")
    print(f"  {'':34}{'first call':>11}{'median':>9}{'/ fork':>8}{'/ mp.spawn':>11}")
    for name, (first, median) in rows.items():
        print(f"  {name:34}{first:10.3f}s{median:8.3f}s{median / fork:7.1f}x{median / theirs:10.3f}x")


if __name__ == "__main__":
    main()
