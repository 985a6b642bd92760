"""Checks for the exercises: run the student's code on several ranks, compare with a reference.

A check prints one short, deterministic verdict when the answer is right, and raises an
AssertionError that says what is wrong (and, where it can tell, why) when it is not.

One module per notebook (utils.checks.setup, .collectives, .data_parallel, .tensor_parallel, ...);
this one holds what they share.
"""
import torch

TOLERANCE = 1e-12  # float64 results that only differ in the order of additions
CHECK_TIMEOUT = 20  # seconds: a rank that skips a collective ends the check, not the notebook


def seeded_randn(shape, seed, rank=0, dtype=torch.float64):
    """The same 'random' tensor in any process: it depends only on (seed, rank, shape)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=generator, dtype=dtype)


def max_abs_diff(a, b):
    """The largest |a - b| in float64; infinite where either holds a NaN (NaN > tolerance is False)."""
    if not a.numel():
        return 0.0
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    return float("inf") if diff.isnan().any() else diff.max().item()
