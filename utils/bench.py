"""Timing: medians of repeated runs, bandwidths, the alpha-beta model. Tests never assert on these."""
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist


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
    """{name: seconds} for several calls that every rank makes, timed in turns (a, b, a, b, ...)
    so that a change in the machine's load hits them all alike. See collective_seconds."""
    times = {name: [] for name in fns}
    for run in range(warmup + repeat):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            if run >= warmup:
                times[name].append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times[name]) for name in fns], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(zip(fns, slowest.tolist()))


# nccl-tests conventions: algorithm bandwidth = size / time, where size is the full tensor (the
# input of all_reduce and reduce_scatter, the output of all_gather); bus bandwidth rescales it to
# what each rank's link carries, comparable across world sizes and with the hardware's peak.
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}


def bus_bandwidth(op, size_bytes, seconds, world_size):
    """(algorithmic, bus) bandwidth in bytes per second."""
    algorithmic = size_bytes / seconds
    return algorithmic, algorithmic * BUS_FACTOR[op](world_size)


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
