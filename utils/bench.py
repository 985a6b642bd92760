"""Timing: medians of repeated runs, interleaved, with their spread and a verdict that states an order or a ratio
only when the runs separate, even once the time their ranks waited for a core is removed (Linux; elsewhere the
runs' ranges alone); bandwidths (by convention and as measured at the sockets), the alpha-beta model.
Tests never assert on timings, only on verdicts from made-up samples."""
import collections
import contextlib
import math
import os
import re
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


def core_waits():
    """Nanoseconds the calling thread has been runnable but waiting for a core, from Linux's
    /proc/thread-self/schedstat (its second field); None where there is none (macOS). The thread that runs the timed
    code is the one whose waits delay it: a rank's other threads (gloo's, the intra-op pool's) mostly sleep, and
    their waits, summed with its own, would count one delay several times."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def seconds_waited(before, after, seconds):
    """Seconds the calling thread waited for a core between two core_waits(), at most the `seconds` the run took;
    None where the OS does not say."""
    if before is None or after is None:
        return None
    return min((after - before) / 1e9, seconds)


class Seconds(float):
    """A run's seconds, and `waited`: the seconds its ranks were ready to run but waited for a core meanwhile (None
    where the OS does not say). A list of them keeps the waits through +, slices and max; arithmetic drops them."""

    def __new__(cls, seconds, waited=None):
        run = super().__new__(cls, seconds)
        run.waited = waited
        return run


def stopwatch():
    """Start timing: returns a function that gives the Seconds since, with what this thread waited for a
    core meanwhile (for loops that time their own steps)."""
    before, start = core_waits(), time.perf_counter()

    def elapsed():
        seconds = time.perf_counter() - start
        return Seconds(seconds, seconds_waited(before, core_waits(), seconds))
    return elapsed


def interleaved_samples(fns, repeat=5, warmup=1):
    """{name: [Seconds of each timed run]} for several calls, timed in turns (a, b, a, b, ...) after `warmup` untimed
    turns, so that a change in the machine's load hits them all alike. On ranks (a process group is up), every rank
    makes the calls, each run starts after a barrier, and a run's seconds are its slowest rank's (a step ends with its
    last rank); in a single process, its own. With each run, the seconds its timing thread waited for a core
    (core_waits; on ranks, the most any rank waited): what other ranks and processes on the machine cost it."""
    ranks = dist.is_initialized()
    times = {name: [] for name in fns}
    for run in range(warmup + repeat):
        for name, fn in fns.items():
            if ranks:
                dist.barrier()
            elapsed = stopwatch()
            fn()
            seconds = elapsed()
            if run >= warmup:
                times[name].append(seconds)
    if ranks:  # the slowest rank's seconds and the most any rank waited (-1: the OS does not say)
        slowest = torch.tensor([[[t, -1.0 if t.waited is None else t.waited] for t in times[name]] for name in fns],
                               dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times = {name: [Seconds(t, None if w < 0 else w) for t, w in runs] for name, runs in zip(fns, slowest.tolist())}
    return times


def slowest(runs):
    """The slowest of one step's Seconds on several ranks (a step ends with its last rank), and what waiting for a
    core added to it: the slowest less the slowest of (a run - its wait)."""
    if any(getattr(run, "waited", None) is None for run in runs):
        return Seconds(max(runs))
    return Seconds(max(runs), max(runs) - max(run - run.waited for run in runs))


def interleaved_seconds(fns, repeat=5, warmup=1):
    """{name: median seconds} of interleaved_samples."""
    return {name: statistics.median(s) for name, s in interleaved_samples(fns, repeat, warmup).items()}


@contextlib.contextmanager
def threads(n):
    """Run the block with `n` threads, then restore the count: time a baseline with as many threads as each rank
    gets (utils.launch.threads_per_rank), or it measures the threads, not the method."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# The discipline of every timing cell: equal threads, warm-up, variants interleaved (interleaved_samples), and
# a median with the range of the runs. A cell states an order or a ratio only when the ranges separate (every
# run of one variant is faster than every run of the other) and there are runs enough that this would rarely
# happen by chance; otherwise it says that this machine cannot separate them. On shared cores that is often the
# honest answer.
#
# And only when waiting for a core cannot explain the order. With other processes running, a variant that needs
# more CPU or more rounds of synchronisation also waits longer for a core, and the gap grows: an order that an idle
# machine cannot see appears under load. So the order a < b is claimed only if it survives removing from every run
# of b the seconds its ranks' timing thread waited for a core (Linux's schedstat, read around each run): every run
# of a is faster than every run of b less its wait (Spread.unwaited). Where the OS does not say (macOS), waits are None and the
# rule is the ranges' alone. On an idle machine with no more busy ranks than cores the waits are microseconds, and
# change nothing; with more, the ranks wait for each other's cores, and only an order larger than that stands.
Spread = collections.namedtuple("Spread", "median low high runs unwaited waited", defaults=(None, None, None))
# seconds; runs: how many; unwaited: the least of (a run - what waiting for a core added to it); waited: the largest
# share of a run its ranks waited for a core (0.38: 38%); both None where the OS does not say

CHANCE = 0.01  # the largest chance, for two variants whose runs are alike, that their ranges separate all the same:
# a notebook prints dozens of verdicts; at 1 in 20 each, a loaded run would contradict some stored one

# A chain of k variants (order_verdict) makes k - 1 claims, one between each pair of neighbours, and the chain is
# wrong if any one is. Where the variants come in alike neighbours (two that are the same code path, two caps
# that change nothing), each such pair is one more chance to separate by luck, so the chain is held to CHANCE as
# a family (Bonferroni): each of its k - 1 claims at CHANCE / (k - 1). Two variants need 5 runs each (1 in 126);
# a chain of 3 to 5 needs 6 each (1 in 462), of 6 to 18 7 each (1 in 1716). And a `<` in a chain claims every
# variant before it faster than every one after it (verdict_relations reads it so): it is printed only where
# all their runs separate, not just the two neighbours'. Several ratio_verdict lines printed by one cell about one
# set of runs are a family too: each is passed claims=k, the number of such lines, and the cell takes
# runs_needed(k + 1) runs (the runs of a chain of k + 1).


def _spread(samples, removable, waited_shares):
    known = removable is not None and None not in removable  # a run without its wait: the ranges' rule alone
    unwaited = min(s - w for s, w in zip(samples, removable)) if known else None
    waited = max(waited_shares) if known else None
    return Spread(statistics.median(samples), min(samples), max(samples), len(samples), unwaited, waited)


def spread(samples, waited=None):
    """The median and range of the seconds of each run, with what the rule needs of the seconds its ranks waited
    for a core in each (`waited`; by default the runs' own, Seconds.waited, None where unknown)."""
    waited = [getattr(run, "waited", None) for run in samples] if waited is None else waited
    known = None not in waited
    return _spread(samples, waited, [w / s if s > 0 else 0 for s, w in zip(samples, waited)] if known else None)


def share_spread(shares, waited=None):
    """The median and range of a share of each step (an idle share), with `waited`: the share of each step its ranks
    waited for a core (a wait may have been counted in the share, so it is removed from it as seconds are)."""
    return _spread(shares, waited, waited)


def format_spread(s, unit="ms"):
    scale = {"s": 1, "ms": 1e3, "us": 1e6}[unit]
    return f"{s.median * scale:.1f} {unit} ({s.low * scale:.1f} to {s.high * scale:.1f})"


def chance_of_separating(n, m):
    """The chance that n runs of one variant and m of another, all alike (drawn from the same spread of the
    machine's noise, in turns), have ranges that do not overlap: of the C(n + m, n) equally likely orders of
    the n + m runs, 2 put one variant's all below the other's. 3 runs each: 1 in 10, too often to claim an order
    from; 4 each: 1 in 35; 5 each: 1 in 126; 6 each: 1 in 462; 7 each: 1 in 1716."""
    return 2 / math.comb(n + m, n)


def runs_needed(variants):
    """The fewest runs each of `variants` variants needs for order_verdict to be able to separate them: 5 for
    two, 6 for 3 to 5, 7 for 6 to 18."""
    runs = 1
    while chance_of_separating(runs, runs) > CHANCE / max(variants - 1, 1):
        runs += 1
    return runs


def enough_runs(a, b, claims=1):
    """True when the runs of two Spreads are enough for one of `claims` claims held to CHANCE together."""
    return a.runs is None or b.runs is None or chance_of_separating(a.runs, b.runs) <= CHANCE / claims


def low_unwaited(s):
    """The least a run of Spread s took had its ranks not waited for a core (its fastest run where unknown)."""
    return s.low if s.unwaited is None else s.unwaited


def apart(faster, slower):
    """True when every run of `faster` is faster than every run of `slower` less what its ranks waited for a core."""
    return faster.high < low_unwaited(slower)


def separated(a, b, claims=1):
    """True when the ranges of two Spreads do not overlap, even with the waits for a core removed from the slower's
    runs, from runs enough to say so: for one claim of `claims` (the k - 1 of a chain of k), each at CHANCE / claims."""
    return enough_runs(a, b, claims) and (apart(a, b) or apart(b, a))


def why_waited(slower):
    share = slower.waited or 0
    return (f"their ranks waited up to {f'{share:.0%}' if share >= 0.01 else 'under 1%'} of a run for a core, "
            f"held by other ranks or processes")


def why_not_separated(a, b, claims=1):
    if not (a.high < b.low or b.high < a.low):
        return "their runs overlap"
    if not (apart(a, b) or apart(b, a)):
        return why_waited(b if a.high < b.low else a)
    family = f" in a family of {claims} claims" if claims > 1 else ""
    return f"{min(a.runs, b.runs)} runs are too few to tell{family}"


def order_verdict(spreads, ends=("fastest", "slowest")):
    """The variants from fastest to slowest (or from `ends[0]` to `ends[1]` of another measure), `a < b` where
    every run of the variants up to a is faster than every run of those from b on (less what their ranks waited for
    a core), from runs enough for the chain's k - 1 claims held to CHANCE together, and `a ~ b` where this machine
    cannot separate them. spreads: {name: Spread}."""
    names = sorted(spreads, key=lambda name: spreads[name].median)
    claims = len(names) - 1
    if claims == 1:
        a, b = (spreads[name] for name in names)
        if not separated(a, b):
            return f"this machine cannot separate {names[0]} and {names[1]}: {why_not_separated(a, b)}"
    chain, too_few, waited = names[0], set(), []
    for i, (a, b) in enumerate(zip(names, names[1:])):
        faster = max(spreads[n].high for n in names[:i + 1])
        slower = [spreads[n] for n in names[i + 1:]]
        ranges_apart = faster < min(s.low for s in slower)
        waits_apart = faster < min(low_unwaited(s) for s in slower)
        enough = enough_runs(spreads[a], spreads[b], claims)
        if ranges_apart and not waits_apart:
            waited.append(max(slower, key=lambda s: s.waited or 0))
        elif waits_apart and not enough:
            too_few.add(min(spreads[a].runs, spreads[b].runs))
        chain += f" {'<' if waits_apart and enough else '~'} {b}"
    tail = ""
    if "~" in chain:
        few = f"; {min(too_few)} runs are too few to tell in a chain of {len(names)}" if too_few else ""
        wait = f"; {why_waited(max(waited, key=lambda s: s.waited or 0))}" if waited else ""
        tail = f" (~: this machine cannot separate them{wait}{few})"
    return f"{ends[0]} to {ends[1]}: {chain}{tail}"


def ratio_verdict(a_name, a, b_name, b, claims=1):
    """`a / b` as the ratio of the medians, with the range that the runs allow, when their ranges separate (with the
    slower's waits for a core removed, as in order_verdict) from runs enough for one of `claims` claims held to
    CHANCE together (a cell that prints k ratio lines about one set of runs passes claims=k, and takes
    runs_needed(k + 1) runs); otherwise that this machine cannot separate them (with the range, which then includes
    1, rests on too few runs, or on runs slowed by waiting for a core)."""
    low, high = a.low / b.high, (a.high / b.low if b.low > 0 else float("inf"))
    if separated(a, b, claims):
        return f"{a_name} / {b_name} = {a.median / b.median:.2f} (runs allow {low:.2f} to {high:.2f})"
    return (f"this machine cannot separate {a_name} and {b_name}: {why_not_separated(a, b, claims)} "
            f"(ratio {low:.2f} to {high:.2f})")


ORDER_ENDS = ("fastest to slowest: ", "least idle to most idle: ")  # how order_verdict's chains begin, in the notebooks


def verdict_relations(verdict):
    """What a printed verdict claims, as a set of (faster, slower) pairs; empty when it claims no order. For
    order_verdict's chains (`a < b ~ c < d`: a is faster than b, c and d; b and c than d) and ratio_verdict's
    lines (`a / b = 0.53 ...`: a faster, since the ratio's range lies below 1; above 1, b faster)."""
    chain = next((ends for ends in ORDER_ENDS if ends in verdict), None)
    if "cannot separate" in verdict and chain is None:
        return set()
    if chain:
        parts = re.split(r" ([<~]) ", verdict.split(chain, 1)[1].split(" (~:")[0])
        names, signs = parts[0::2], parts[1::2]
        groups, group = [], [names[0]]
        for sign, name in zip(signs, names[1:]):
            if sign == "<":
                groups.append(group)
                group = []
            group.append(name)
        groups.append(group)
        return {(a, b) for i, faster in enumerate(groups) for slower in groups[i + 1:] for a in faster for b in slower}
    ratio = re.search(r"(.+?) / (.+?) = [\d.]+ \(runs allow ([\d.]+) to ([\d.inf]+)\)", verdict.strip())
    if ratio:
        a, b, low = ratio.group(1), ratio.group(2), float(ratio.group(3))
        return {(b, a)} if low >= 1 else {(a, b)}
    return set()


def verdicts_agree(stored, loaded):
    """True when the verdict `loaded` claims no order that `stored` does not: it says the same, or that this
    machine cannot separate (some of) the variants. A verdict that flips, or an order the stored run could not
    see, is a spread test too loose for a loaded machine."""
    return verdict_relations(loaded) <= verdict_relations(stored)


def verdicts_contradict(stored, loaded):
    """True when the two verdicts order some pair of variants the opposite ways: a flip, worse than an order
    that only one of the runs could separate (which verdicts_agree also refuses)."""
    return any((b, a) in verdict_relations(stored) for a, b in verdict_relations(loaded))


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


def ping_pong_main(rank, world_size, sizes, peers=(0, 1)):
    """One-way seconds of a point-to-point message of each size in `sizes` (bytes), between ranks `peers` (0 and
    1): they bounce it back and forth, and half a round trip is one send (notebook 01; 09 fits its alpha-beta
    model). Every rank calls it; the others wait."""
    return [statistics.median(samples) for samples in ping_pong_samples(rank, world_size, sizes, peers=peers)]


def ping_pong_samples(rank, world_size, sizes, repeat=5, peers=(0, 1)):
    """[one-way seconds of each timed round trip] for each size of ping_pong_main, so that a spread can be shown."""
    first, second = peers
    times = []
    for size in sizes:
        x = torch.zeros(max(size // 4, 1))

        def round_trip():
            if rank == first:
                dist.send(x, dst=second)
                dist.recv(x, src=second)
            elif rank == second:
                dist.recv(x, src=first)
                dist.send(x, dst=first)

        times.append([seconds / 2 for seconds in interleaved_samples({"round trip": round_trip}, repeat)["round trip"]])
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
