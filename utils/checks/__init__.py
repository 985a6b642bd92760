"""Checks for the exercises: run the student's code on several ranks, compare with a reference.

A check prints one short, deterministic verdict when the answer is right, and raises an
AssertionError that says what is wrong (and, where it can tell, why) when it is not.

One module per notebook (utils.checks.setup, .collectives, .data_parallel, .tensor_parallel, ...);
this one holds what they share.
"""
import contextlib

import torch

from utils.launch import RankError, spawn

TOLERANCE = 1e-12  # float64 results that only differ in the order of additions
CHECK_TIMEOUT = 20  # seconds: a rank that skips a collective ends the check, not the notebook


def seeded_randn(shape, seed, rank=0, dtype=torch.float64):
    """The same 'random' tensor in any process: it depends only on (seed, rank, shape)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=generator, dtype=dtype)


GLOO_SIZE_MISMATCH = "Received data size doesn't match expected size"  # gloo aborts the receiving process


def spawn_explaining_stalls(fn, world_size, *args, timeout, hint, sizes=""):
    """spawn; a stall is still a TimeoutError, its message opened by `hint`, what usually causes it in the exercise at
    hand; a receive into a buffer of the wrong size (gloo aborts the process) an AssertionError that says so, and
    `sizes`: how the exercise's messages should be sized."""
    try:
        return spawn(fn, world_size, *args, timeout=timeout)
    except TimeoutError as e:
        raise TimeoutError(f"{hint}.\n{e}") from None
    except RankError as e:
        if GLOO_SIZE_MISMATCH not in str(e):
            raise
        raise AssertionError(f"{e.args[0].splitlines()[0]}: a message arrived whose size is not its receive buffer's: "
                             f"gloo ends the process. Every irecv's buffer must have exactly the size of what its "
                             f"neighbour sends in that step{'; ' + sizes if sizes else ''}") from None


def close(got, want):
    """Equal to TOLERANCE relative to want's largest entry (at least absolute 1e-12); a None, or another shape, is
    never close."""
    return got is not None and got.shape == want.shape and max_abs_diff(got, want) < TOLERANCE * max(
        1.0, want.abs().max().item() if want.numel() else 0.0)


def confirmed(got, candidates):
    """The hint of the first candidate value `got` equals (each a (value, hint) pair: what a mistake computes on the
    same inputs), or None: a hint is given only when its diagnosis is confirmed."""
    for value, hint in candidates:
        with contextlib.suppress(RuntimeError):  # a candidate of another shape: not this mistake
            if torch.isfinite(value).all() and close(got, value):
                return hint
    return None


def verify_gathered_again(shards, where, close, kept, again):
    """Step 0 run with every shard doubled between forward and backward (in place, unseen by autograd): a backward
    that gathers the weights again meets the doubled ones, one that kept those gathered in forward the old ones.
    shards: (rank, what, got, want: the doubled weights' gradient shard, the old weights') for each gradient; close
    on tensors of one shape; `kept` says what the old weights' gradient means, `again` what gathers them again.
    05's, 06's and 07's checks: values, where the bytes held and the calls counted, taken in the rank that runs the
    student's code, could be forged."""
    def near(got, want):
        return got is not None and got.shape == want.shape and close(got, want)

    doubled = f"{where}: with every shard doubled between forward and backward (in place, unseen by autograd)"
    for rank, what, got, want, old in shards:
        if near(got, want):
            continue
        if near(got, old):
            raise AssertionError(f"{doubled}, rank {rank}'s {what} is the gradient of the weights before the "
                                 f"doubling: {kept}; is the record of bytes held edited?")
        raise AssertionError(f"{doubled}, rank {rank}'s {what} is neither the doubled weights' gradient ({again}) nor "
                             f"the old ones'")


def max_abs_diff(a, b):
    """The largest |a - b| in float64; infinite where either holds a NaN (NaN > tolerance is False)."""
    if not a.numel():
        return 0.0
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    return float("inf") if diff.isnan().any() else diff.max().item()


def diagnose_gradient(got, want, local, world_size, num_micro_batches=1, unexplained=""):
    """Why a gradient (or a shard of one) is not `want`, the whole batch's: the usual mistakes, in words.

    `local` is this rank's own gradient (of its slice of the batch, the same part as `want`); `unexplained` is
    added when the values match no known mistake (what else to look at, in the exercise at hand)."""
    if got is None:
        return "it is None: no gradient reached it"
    if got.shape != want.shape:
        return f"its shape is {tuple(got.shape)}, expected {tuple(want.shape)}"
    n, m = world_size, num_micro_batches
    # With micro-batches, their weighting comes first: when m == n, "m times" and "n times" look alike,
    # and a check of micro-batches runs after the averaging has been checked on its own.
    candidates = [(want * m, f"it is {m} times too large, the number of micro-batches: divide each "
                             f"micro-batch's loss by num_micro_batches"),
                  (want * m * n, f"it is {m * n} times too large: divide each micro-batch's loss by "
                                 f"num_micro_batches, and the summed gradient by the world size")] if m > 1 else []
    candidates += [(want * n, f"it is {n} times too large: the sum over ranks, not the mean; divide by the world "
                              f"size"),
                   (local, "it is this rank's own gradient: it was never summed over the ranks"),
                   (local / n, "it is this rank's own gradient divided by the world size: it was never summed over "
                               "the ranks"),
                   (want / n, "it is the mean divided by the world size once more")]
    tolerance = TOLERANCE if got.dtype == torch.float64 else 1e-5  # float32: about 100 units in the last place
    for value, hint in candidates:
        if max_abs_diff(got, value) < tolerance * max(1.0, value.abs().max().item()):
            return hint
    difference, scale = max_abs_diff(got, want), want.abs().max().item()
    return (f"it differs from the whole batch's gradient by up to {difference:.3g} (its largest entry is {scale:.3g})"
            f"{unexplained}")
