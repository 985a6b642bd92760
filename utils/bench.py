"""Timing: the median wall-clock time of a call, after warm-up. Tests never assert on these."""
import statistics
import time


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
