"""Timing: medians of repeated runs, bandwidths (by convention and as measured at the sockets), the alpha-beta
model. Tests never assert on timings."""
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from utils.counting import bytes_written


def median_seconds(fn, repeat=5, warmup=1):
    """Median seconds of `fn()` over `repeat` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def collective_seconds(fn, repeat=5, warmup=1):
    """Seconds of a communication call that every rank makes: each run starts right after a
    barrier; the median over runs, from the slowest rank (a collective ends with its last rank)."""
    return interleaved_seconds({"fn": fn}, repeat, warmup)["fn"]


def interleaved_seconds(fns, repeat=5, warmup=1):
    """{name: median seconds} for several calls, timed in turns (a, b, a, b, ...) so that a change in the
    machine's load hits them all alike. On ranks (a process group is up), every rank makes the calls, each
    run starts after a barrier, and the slowest rank's median counts (see collective_seconds); in a single
    process, its own medians."""
    ranks = dist.is_initialized()
    times = {name: [] for name in fns}
    for run in range(warmup + repeat):
        for name, fn in fns.items():
            if ranks:
                dist.barrier()
            start = time.perf_counter()
            fn()
            if run >= warmup:
                times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[name]) for name in fns], dtype=torch.float64)
    if ranks:
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(fns, medians.tolist()))


# Two ways to turn a time into a link speed, side by side (notebook 01):
#
# - the nccl-tests convention: algorithmic bandwidth = S / t, with S the full tensor (the input of all_reduce
#   and reduce_scatter, the output of all_gather), and bus bandwidth = algbw x BUS_FACTOR, what a
#   bandwidth-optimal ring sends from each rank, per byte of S. That is what each link carried only when the
#   library runs that ring: NCCL's reduce-scatter does; gloo's all-reduces and keeps one chunk, so it sends
#   2(N-1)/N S, and the convention understates what its links carried by half.
# - the measurement: wire bandwidth = the bytes a rank really wrote to its sockets (bytes_on_the_wire) / t.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}

# What the textbook algorithm sends from its busiest rank, in units of S (the full tensor; for scatter
# and gather, the root's whole list): a pipelined chain for broadcast and reduce (each rank forwards S),
# the ring for all-reduce, reduce-scatter and all-gather, one piece to each other rank for all-to-all,
# scatter and gather. No algorithm over point-to-point links sends less; switches that reduce in the
# network (NVIDIA SHARP) do: each rank sends S once and receives the sum once.
TEXTBOOK_BYTES = {"broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
                  "all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                  "all_gather": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                  "scatter": lambda n: (n - 1) / n, "gather": lambda n: 1 / n}


def bus_bandwidth(op, size_bytes, seconds, world_size):
    """(algorithmic, bus) bandwidth in bytes per second, by the nccl-tests convention."""
    algorithmic = size_bytes / seconds
    return algorithmic, algorithmic * BUS_FACTOR[op](world_size)


def bytes_on_the_wire(fn):
    """Bytes this rank wrote to its sockets during one fn(): what the backend really sent, whatever its
    algorithm (Linux's /proc/self/io; None elsewhere). Every rank calls it together; fn must print nothing."""
    dist.barrier()
    before = bytes_written()
    fn()
    after = bytes_written()
    return None if before is None else after - before


def ping_pong_main(rank, world_size, sizes):
    """One-way seconds of a point-to-point message of each size in `sizes` (bytes), between ranks 0 and 1: they
    bounce it back and forth, and half a round trip is one send (notebook 01; 09 fits its alpha-beta model)."""
    times = []
    for size in sizes:
        x = torch.zeros(max(size // 4, 1))

        def round_trip():
            if rank == 0:
                dist.send(x, dst=1)
                dist.recv(x, src=1)
            elif rank == 1:
                dist.recv(x, src=0)
                dist.send(x, dst=0)

        times.append(collective_seconds(round_trip, repeat=5) / 2)
    return times


def fit_alpha_beta(sizes, seconds):
    """Fit t = alpha + size / beta (latency in s, bandwidth in bytes/s), minimizing relative errors
    so that the small messages (which set alpha) count as much as the large ones (which set beta)."""
    sizes, seconds = np.asarray(sizes, dtype=float), np.asarray(seconds, dtype=float)
    slope, intercept = np.polyfit(sizes, seconds, 1, w=1 / seconds)
    return max(intercept, 0.0), 1 / slope


def format_bytes(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
