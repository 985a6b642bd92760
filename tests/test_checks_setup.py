"""The notebook 00 checks (utils.checks.setup): the solution passes at any world size; each typical wrong answer,
written as a small edit of the solution notebook's own code, fails at its own check with a hint naming it.
Also the helpers every check uses (utils.checks)."""
import pytest
import torch

from utils.checks import max_abs_diff, seeded_randn
from utils.checks.setup import check_average_over_ranks
from utils.notebooks import solution

NAME = "00_setup"
ALL_REDUCE = "    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)\n"
DIVIDE = "    tensor /= dist.get_world_size()\n"


# The check runs at {world_size, 3}: 3 alone repeats what every other member runs, and 4 (3 and 4) is the notebook's
# own check cell under nbval; both in pytest -m slow only.
@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_the_solution_passes(world_size, capsys):
    check_average_over_ranks(solution(NAME).average_over_ranks, world_size)
    assert f"correct on {' and '.join(map(str, sorted({world_size, 3})))} ranks" in capsys.readouterr().out


MISTAKES = {
    "no all-reduce": ({ALL_REDUCE: ""}, "the ranks never communicated: dist.all_reduce sums"),
    "no division": ({DIVIDE: ""}, "it holds the sum over ranks: divide it by the world size, in place"),
    "division not in place": ({DIVIDE: "    tensor = tensor / dist.get_world_size()\n"},
                              "it holds the sum over ranks: .*t = t / n makes a new tensor"),
    "all-reduce of a copy": ({"dist.all_reduce(tensor, op": "dist.all_reduce(tensor.clone(), op"},
                             "the all-reduce's result was lost .* works in place"),
    "all-reduce of a copy, result rebound": ({"dist.all_reduce(tensor, op": "dist.all_reduce(tensor.clone(), op",
                                              DIVIDE: "    tensor = tensor / dist.get_world_size()\n"},
                                             "the tensor is unchanged: change it in place"),
    "AVG, then divided again": ({"op=dist.ReduceOp.SUM": "op=dist.ReduceOp.AVG"},
                                "the mean divided by the world size once more: ReduceOp.AVG already divides"),
    "MAX instead of SUM": ({"op=dist.ReduceOp.SUM": "op=dist.ReduceOp.MAX"}, "the maximum over ranks"),
    "divided by a fixed number": ({DIVIDE: "    tensor /= 2\n"},
                                  "the sum divided by 2: divide by the world size, "
                                  "dist.get_world_size\\(\\) \\(here 3\\)"),
    "all-reduced twice": ({ALL_REDUCE: ALL_REDUCE * 2}, "2 all-reduces for one average"),
    "asynchronous, never waited for": ({"op=dist.ReduceOp.SUM)": "op=dist.ReduceOp.SUM, async_op=True)"},
                                       "asynchronous .* never waited for: .* call .wait\\(\\) before dividing"),
    "an extra collective whose result is thrown away": (
        {DIVIDE: DIVIDE + "    dist.broadcast(tensor.clone(), src=0)\n"},
        "the result is right but took 2 communication calls; one dist.all_reduce"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_wrong_average_fails_and_names_the_mistake(mistake):
    replace, hint = MISTAKES[mistake]
    with pytest.raises(AssertionError, match="average_over_ranks on rank 0 of 3, shape \\(1,\\): .*" + hint):
        check_average_over_ranks(solution(NAME, replace=replace).average_over_ranks, 3)


def test_a_division_by_the_default_world_size_fails_on_another():
    """tensor /= 4 is right on the notebook's 4 ranks: the check runs on 3 ranks too."""
    wrong = solution(NAME, replace={DIVIDE: "    tensor /= 4\n"})
    with pytest.raises(AssertionError, match="on rank 0 of 3, .* the sum divided by 4: divide by the world size"):
        check_average_over_ranks(wrong.average_over_ranks, 4)


def test_a_missing_all_reduce_fails_even_on_one_rank():
    with pytest.raises(AssertionError, match="took 0 communication calls"):
        check_average_over_ranks(solution(NAME, replace={ALL_REDUCE: ""}).average_over_ranks, 1)


# ---------------------------------------------------------------- the helpers every check uses

def test_seeded_randn_depends_only_on_seed_rank_and_shape():
    assert torch.equal(seeded_randn((3,), 0, 1), seeded_randn((3,), 0, 1))
    assert not torch.equal(seeded_randn((3,), 0, 1), seeded_randn((3,), 0, 2))
    assert seeded_randn((2, 2), 1).dtype == torch.float64


def test_max_abs_diff_counts_nan_as_infinitely_far():
    assert max_abs_diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])) == float("inf")
    assert max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == 0.5
