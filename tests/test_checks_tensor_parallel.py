"""The notebook 03 checks (utils.checks.tensor_parallel): the solution passes at any world size; each typical wrong
answer, written as a small edit of the solution notebook's own code, fails at its own check with a hint naming it."""
import pytest
import torch

from utils import pytorch_reference
from utils import tensor_parallel as tp
from utils.checks import max_abs_diff
from utils.checks.tensor_parallel import (
    check_all_gather_forward,
    check_parallel_linear,
    check_parallel_regions,
    check_tensor_parallel_mlp,
)
from utils.launch import RankError, spawn
from utils.model import build_mlp, layer_weight, make_batch
from utils.notebooks import solution

NAME = "03_tensor_parallel"
HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS = 12, 4, 6, 2


def linears(sol):
    return sol.ColumnParallelLinear, sol.RowParallelLinear


def regions(sol):
    return sol.CopyToParallelRegion, sol.ReduceFromParallelRegion


# ---------------------------------------------------------------- the solution passes

# 2 ranks under pytest -m slow (0.75 s): an even split of the features, as the notebook's own check cells (4 ranks,
# every check); 1 (a group of one) and 3 (another world size than the notebook's) stay
@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_the_solution_passes(world_size, capsys):
    sol = solution(NAME)
    check_all_gather_forward(sol.all_gather_forward, world_size, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE)
    check_parallel_regions(*regions(sol), world_size)
    check_parallel_linear(*linears(sol), world_size, HIDDEN_DIM, BATCH_SIZE)
    check_tensor_parallel_mlp(*linears(sol), world_size, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)
    out = capsys.readouterr().out
    assert out.count("correct on") == 4 and "DTensor" in out


def test_sizes_name_both_numbers():
    with pytest.raises(ValueError, match="hidden dim 10 .* world size 4"):
        tp.check_sizes(10, 4)
    with pytest.raises(ValueError, match="num layers 3 is odd"):
        tp.check_sizes(12, 4, 3)
    with pytest.raises(ValueError, match="hidden dim 10 .* world size 4"):
        check_parallel_linear(*linears(solution(NAME)), 4, 10, BATCH_SIZE)


def test_features_the_world_size_does_not_divide_are_refused_naming_both():
    """torch.chunk would give 3 pieces of 2 for 6 features on 4 ranks (IndexError on rank 3), or unequal ones."""
    sol = solution(NAME)
    weight = torch.randn(6, 8, dtype=torch.float64)
    for make in (sol.ColumnParallelLinear, lambda w, r, n: tp.column_shard(w, r, n)):
        with pytest.raises(ValueError, match="out features 6 is not divisible by world size 4: each rank must hold"):
            make(weight, 3, 4)
    for make in (sol.RowParallelLinear, lambda w, r, n: tp.row_shard(w, r, n)):
        with pytest.raises(ValueError, match="in features 6 is not divisible by world size 4"):
            make(weight.T, 0, 4)


def _uneven_gather_main(rank, world_size, all_gather_forward, rows_on_rank_0):
    w = layer_weight(4, 0, 0)
    shard = w[:rows_on_rank_0] if rank == 0 else w[rows_on_rank_0:]
    return all_gather_forward(make_batch(2, 4, 0), [shard])


def test_shards_cut_unevenly_get_an_error_naming_each_ranks_size():
    """gloo aborts the process on an all-gather of unequal pieces: the sizes are compared first."""
    with pytest.raises(RankError, match="ValueError: all_gather_forward: the output features of layer 0's shard "
                                        "differ between ranks: 3 on rank 0, 1 on rank 1"):
        spawn(_uneven_gather_main, 2, solution(NAME).all_gather_forward, 3)


def _sequence_main(rank, world_size, ColumnParallelLinear, RowParallelLinear, x):
    ours = tp.build_tp_mlp(ColumnParallelLinear, RowParallelLinear, rank, world_size, HIDDEN_DIM, NUM_LAYERS)
    theirs = pytorch_reference.tensor_parallel_mlp(world_size, HIDDEN_DIM, NUM_LAYERS, 0)
    with torch.no_grad():
        return ours(x), tp.local_part(theirs(x))


def test_activations_with_a_sequence_dimension():
    """(batch, sequence, hidden), as the transformer notebooks have them: the tensor parallel MLP built from the
    solution's layers and DTensor's equal the single-process MLP on every rank."""
    x = torch.randn(3, 5, HIDDEN_DIM, dtype=torch.float64)
    with torch.no_grad():
        want = build_mlp(HIDDEN_DIM, NUM_LAYERS, 0)(x)
    for ours, theirs in spawn(_sequence_main, 3, *linears(solution(NAME)), x):
        assert ours.shape == theirs.shape == want.shape
        assert max_abs_diff(ours, want) < 1e-12 and max_abs_diff(theirs, want) < 1e-12


# ---------------------------------------------------------------- all_gather_forward: wrong answers

CAT = "        x = torch.cat(pieces, dim=-1)\n"
GATHER = "        pieces = [torch.empty_like(y) for _ in range(world_size)]\n        dist.all_gather(pieces, y)\n" + CAT
PADDED_ALL_REDUCE = ("        x = torch.zeros(*y.shape[:-1], world_size * y.shape[-1], dtype=y.dtype)\n"
                     "        x[..., dist.get_rank() * y.shape[-1]:(dist.get_rank() + 1) * y.shape[-1]] = y\n"
                     "        dist.all_reduce(x)\n")
GATHER_MISTAKES = {
    "no gather": ({"        pieces = [torch.empty_like(y) for _ in range(world_size)]\n": "",
                   "        dist.all_gather(pieces, y)\n": "", CAT: "        x = y\n"},
                  "this rank's features only: all-gather"),
    "wrong order": ({CAT: "        x = torch.cat(pieces[::-1], dim=-1)\n"}, "wrong order .* in rank order"),
    "joined along the batch": ({CAT: "        x = torch.cat(pieces, dim=0)\n"},
                               "joined along the batch, dim 0: concatenate them along the features, the last "
                               "dimension, dim=-1"),
    "joined along the sequence (dim 1: right for (B, h) only)": (
        {CAT: "        x = torch.cat(pieces, dim=1)\n"},
        "\\(batch, sequence, hidden\\) = \\(6, 3, 12\\): .* joined along the sequence, dim 1: "
        "concatenate them along the features, the last dimension"),
    "one tensor N times": ({"[torch.empty_like(y) for _ in range(world_size)]": "[torch.empty_like(y)] * world_size"},
                           "holds one tensor 3 times"),
    "no GELU": ({"        y = F.gelu(x @ w.T)\n": "        y = x @ w.T\n"}, "hold no rank's slice .* gelu"),
    "gathered list never filled": ({"        dist.all_gather(pieces, y)\n": ""},
                                   "hold no rank's slice \\(NaN or uninitialised memory\\)|hold no rank's slice"),
    "input never updated": ({CAT: "        out = torch.cat(pieces, dim=-1)\n",
                             "### END SOLUTION\n    return x": "### END SOLUTION\n    return out"},
                            "take the previous layer's whole .* output as its input"),
    "pieces laid out rank after rank, then reshaped": (
        {GATHER: "        flat = torch.empty(world_size * y.numel(), dtype=y.dtype)\n"
                 "        dist.all_gather_single(flat, y.flatten())\n        x = flat.view(*y.shape[:-1], -1)\n"},
        "rank after rank in memory .* mixes the ranks' features within each row; join the slices along the "
        "features"),
    "all-reduce of zero-padded slices instead of an all-gather": (
        {GATHER: PADDED_ALL_REDUCE}, "0 all-gathers for 4 layers; expected one per layer: the whole activation came "
                                     "from another collective"),
    "extra all-gather": ({"        dist.all_gather(pieces, y)\n": "        dist.all_gather(pieces, y)\n"
                                                                   "        dist.all_gather(pieces, y)\n"},
                         "8 all-gathers for 4 layers"),
}


@pytest.mark.parametrize("mistake", GATHER_MISTAKES)
def test_a_wrong_all_gather_forward_fails_and_names_the_mistake(mistake):
    replace, hint = GATHER_MISTAKES[mistake]
    wrong = solution(NAME, replace=replace)
    with pytest.raises(AssertionError, match="all_gather_forward on rank 0 of 3, x of shape .*" + hint):
        check_all_gather_forward(wrong.all_gather_forward, 3, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE)


# right answers written another way, at 2, 3 and 4 ranks
OTHER_GATHERS = {
    "GELU after the all-gather (it acts element by element)": {"        y = F.gelu(x @ w.T)\n": "        y = x @ w.T\n",
                                                              CAT: "        x = F.gelu(torch.cat(pieces, dim=-1))\n"},
    "F.linear, all_gather_single, the rank dimension moved next to the features": {
        "        y = F.gelu(x @ w.T)\n": "        y = F.gelu(F.linear(x, w))\n",
        GATHER: "        stacked = torch.empty(world_size * y.shape[0], *y.shape[1:], dtype=y.dtype)\n"
                "        dist.all_gather_single(stacked, y.contiguous())\n"
                "        x = stacked.unflatten(0, (world_size, -1)).movedim(0, -2).flatten(-2)\n"},
}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("way", OTHER_GATHERS)
def test_an_all_gather_forward_written_another_way_passes(way, world_size):
    right = solution(NAME, replace=OTHER_GATHERS[way])
    check_all_gather_forward(right.all_gather_forward, world_size, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE)


# ---------------------------------------------------------------- the parallel regions: wrong answers

COPY_BACKWARD = "        grad = grad_output.clone()\n        dist.all_reduce(grad)\n        return grad\n"
REDUCE_FORWARD = "        out = x.clone()\n        dist.all_reduce(out)\n        return out\n"
REGION_MISTAKES = {
    "copy: no all-reduce in backward": ({COPY_BACKWARD: "        return grad_output\n"},
                                        "CopyToParallelRegion on rank 0 of 2: backward: it is this rank's own "
                                        "gradient; the backward must all-reduce"),
    "copy: all-reduce in forward instead of backward": (
        {COPY_BACKWARD: "        return grad_output\n", "        return x.view_as(x)\n": REDUCE_FORWARD},
        "CopyToParallelRegion on rank 0 of 2: the all-reduce is in the forward; it belongs in the backward"),
    "copy: all-reduce in both directions": ({"        return x.view_as(x)\n": REDUCE_FORWARD},
                                            "CopyToParallelRegion on rank 0 of 2: forward: it is the sum over ranks; "
                                            "the forward must be the identity"),
    "copy: averages in backward": ({"        dist.all_reduce(grad)\n": "        dist.all_reduce(grad)\n"
                                                                        "        grad /= dist.get_world_size()\n"},
                                   "CopyToParallelRegion .* backward: it is the mean over ranks: .* do not divide"),
    "copy: all-reduces the incoming gradient in place": ({"        grad = grad_output.clone()\n":
                                                          "        grad = grad_output\n"},
                                                         "CopyToParallelRegion .* changed the incoming gradient in "
                                                         "place; all-reduce a clone"),
    "reduce: no all-reduce in forward": ({"        dist.all_reduce(out)\n": ""},
                                         "ReduceFromParallelRegion on rank 0 of 2: forward: it is this rank's own "
                                         "input; the forward must all-reduce"),
    "reduce: all-reduce in backward instead of forward": (
        {"        dist.all_reduce(out)\n": "", "        return grad_output\n": COPY_BACKWARD},
        "ReduceFromParallelRegion on rank 0 of 2: the all-reduce is in the backward; it belongs in the forward"),
    "reduce: all-reduce in both directions": ({"        return grad_output\n": COPY_BACKWARD},
                                              "ReduceFromParallelRegion on rank 0 of 2: backward: it is the sum over "
                                              "ranks; the backward must be the identity"),
    "reduce: averages": ({"        dist.all_reduce(out)\n": "        dist.all_reduce(out, op=dist.ReduceOp.AVG)\n"},
                         "ReduceFromParallelRegion .* forward: it is the mean over ranks"),
    "reduce: divides its backward by the world size": (
        {"        return grad_output\n": "        return grad_output / dist.get_world_size()\n"},
        "ReduceFromParallelRegion on rank 0 of 2: backward: it is this rank's own gradient divided by the world "
        "size: do not divide"),
    "copy: broadcasts the gradient instead of summing it": (
        {"        dist.all_reduce(grad)\n": "        dist.broadcast(grad, 0)\n"},
        "CopyToParallelRegion on 2 ranks: backward: every rank returned rank 0's own tensor: that is a broadcast"),
    "copy: the gradient counted twice (all-reduced twice)": (
        {"        dist.all_reduce(grad)\n": "        dist.all_reduce(grad)\n        dist.all_reduce(grad)\n"},
        "CopyToParallelRegion on rank 0 of 2: backward: it is the sum over ranks times the world size: it was "
        "all-reduced twice"),
    "reduce: no clone": ({REDUCE_FORWARD: "        dist.all_reduce(x)\n        return x\n"},
                         "ReduceFromParallelRegion .* changed its input in place; all-reduce a clone"),
}


@pytest.mark.parametrize("mistake", REGION_MISTAKES)
def test_wrong_regions_fail_and_name_the_mistake(mistake):
    replace, hint = REGION_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_parallel_regions(*regions(solution(NAME, replace=replace)), 2)


def test_a_missing_all_reduce_is_counted_even_on_one_rank():
    wrong = solution(NAME, replace={COPY_BACKWARD: "        return grad_output\n"})
    with pytest.raises(AssertionError, match="0 collective\\(s\\) in forward and 0 in backward; expected 0 and 1"):
        check_parallel_regions(*regions(wrong), 1)


# ---------------------------------------------------------------- the parallel linear layers: wrong answers

COLUMN_SHARD = "weight.chunk(world_size, dim=0)[rank].clone()"
ROW_SHARD = "weight.chunk(world_size, dim=1)[rank].clone()"
COLUMN_FORWARD = "CopyToParallelRegion.apply(x) @ self.weight.T"
ROW_FORWARD = "ReduceFromParallelRegion.apply(x @ self.weight.T)"
LINEAR_MISTAKES = {
    "column without Copy": ({COLUMN_FORWARD: "x @ self.weight.T"},
                            "ColumnParallelLinear on rank 0 of 2: wrong input gradient; it is this rank's part of it: "
                            "the backward must all-reduce"),
    "column with Reduce instead of Copy": ({COLUMN_FORWARD: "ReduceFromParallelRegion.apply(x) @ self.weight.T"},
                                           "ColumnParallelLinear on rank 0 of 2: wrong output; it is 2 times too "
                                           "large: the forward all-reduced an input that is already whole"),
    "row without Reduce": ({ROW_FORWARD: "x @ self.weight.T"},
                           "RowParallelLinear on rank 0 of 2: wrong output; it is this rank's partial sum"),
    "row all-reduces its gradient too": ({ROW_FORWARD: "CopyToParallelRegion.apply(ReduceFromParallelRegion.apply("
                                                       "x @ self.weight.T))"},
                                         "RowParallelLinear on rank 0 of 2: wrong input gradient; it is 2 times too "
                                         "large"),
    "column cut along the input features": ({COLUMN_SHARD: COLUMN_SHARD.replace("dim=0", "dim=1")},
                                            "ColumnParallelLinear on rank 0 of 2: self.weight is not this rank's rows "
                                            ".* it is this rank's columns .* cut along the other dimension"),
    "row cut along the output features": ({ROW_SHARD: ROW_SHARD.replace("dim=1", "dim=0")},
                                          "RowParallelLinear on rank 0 of 2: self.weight is not this rank's columns "
                                          ".* it is this rank's rows"),
    "another rank's shard": ({COLUMN_SHARD: COLUMN_SHARD.replace("[rank]", "[(rank + 1) % world_size]")},
                             "ColumnParallelLinear on rank 0 of 2: .* it is rank 1's shard"),
    "no copy of the shard": ({ROW_SHARD: ROW_SHARD.replace(".clone()", "")},
                             "RowParallelLinear on rank 0 of 2: self.weight shares memory with the whole weight"),
    "not a parameter": ({f"self.weight = nn.Parameter({COLUMN_SHARD})": f"self.weight = {COLUMN_SHARD}"},
                        "ColumnParallelLinear on rank 0 of 2: self.weight is a plain tensor: wrap it in nn.Parameter"),
    "row: Reduce around the input, not the partial product": (
        {ROW_FORWARD: "ReduceFromParallelRegion.apply(x) @ self.weight.T"},
        "RowParallelLinear on rank 0 of 2: wrong output; .* ReduceFromParallelRegion was applied to the input x_r, "
        "before the matmul"),
    "column: Copy around the output, not the input": (
        {COLUMN_FORWARD: "CopyToParallelRegion.apply(x @ self.weight.T)"},
        "ColumnParallelLinear on rank 0 of 2: wrong input gradient; .* CopyToParallelRegion was applied to the "
        "output of the matmul"),
    "column: Copy twice (the input gradient summed twice)": (
        {COLUMN_FORWARD: "CopyToParallelRegion.apply(CopyToParallelRegion.apply(x)) @ self.weight.T"},
        "ColumnParallelLinear on rank 0 of 2: wrong input gradient; it is 2 times too large: the backward "
        "all-reduces a gradient that is already whole"),
    "row: the shard cut from W.T": ({ROW_SHARD: "weight.T.chunk(world_size, dim=0)[rank].clone()"},
                                    "RowParallelLinear on rank 0 of 2: .* it is the transpose of this rank's shard"),
    "row: Copy where Reduce belongs": ({ROW_FORWARD: "CopyToParallelRegion.apply(x @ self.weight.T)"},
                                       "RowParallelLinear on rank 0 of 2: wrong output; it is this rank's partial "
                                       "sum"),
}


@pytest.mark.parametrize("mistake", LINEAR_MISTAKES)
def test_wrong_linears_fail_and_name_the_mistake(mistake):
    replace, hint = LINEAR_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_parallel_linear(*linears(solution(NAME, replace=replace)), 2, HIDDEN_DIM, BATCH_SIZE)


OTHER_LINEARS = {
    "slices by hand, F.linear": {
        COLUMN_SHARD: "weight[rank * weight.shape[0] // world_size:(rank + 1) * weight.shape[0] // world_size].clone()",
        COLUMN_FORWARD: "F.linear(CopyToParallelRegion.apply(x), self.weight)"},
    "tensor_split, detach().clone()": {ROW_SHARD: "weight.tensor_split(world_size, dim=1)[rank].detach().clone()",
                                       COLUMN_SHARD: "tp.column_shard(weight, rank, world_size).clone()"},
}


@pytest.mark.parametrize("way", OTHER_LINEARS)
def test_linears_written_another_way_pass_at_2_3_and_4_ranks(way):
    right = solution(NAME, replace=OTHER_LINEARS[way])
    for world_size in (2, 3, 4):
        check_parallel_linear(*linears(right), world_size, HIDDEN_DIM, BATCH_SIZE)
    other_regions = solution(NAME, replace={"        return x.view_as(x)\n": "        return x\n", REDUCE_FORWARD:
                                            "        out = x.detach().clone()\n"
                                            "        dist.all_reduce(out, async_op=True).wait()\n        return out\n"})
    check_parallel_regions(*regions(other_regions), 4)


def test_an_extra_all_reduce_that_changes_nothing_is_counted():
    """An all-reduce whose result is thrown away changes no value: only the count shows it."""
    wrong = solution(NAME, replace={f"        return {ROW_FORWARD}\n":
                                    f"        dist.all_reduce(x.detach().clone())\n        return {ROW_FORWARD}\n"})
    with pytest.raises(AssertionError, match="RowParallelLinear .* 2 collective\\(s\\) in forward and 0 in backward; "
                                             "expected 1 and 0"):
        check_parallel_linear(*linears(wrong), 2, HIDDEN_DIM, BATCH_SIZE)


# ---------------------------------------------------------------- the MLP pairing: wrong answers

MLP_MISTAKES = {
    "column without Copy": ({COLUMN_FORWARD: "x @ self.weight.T"},
                            "the backward first goes wrong at layers.1.linear.weight: .* look at layer 1's own "
                            "backward, or the input gradient that layer 2 \\(ColumnParallelLinear, then GELU\\)"),
    "copy's backward without all-reduce": ({COPY_BACKWARD: "        return grad_output\n"},
                                           "the backward first goes wrong at layers.1.linear.weight"),
    "row without Reduce": ({ROW_FORWARD: "x @ self.weight.T"},
                           "the forward first goes wrong at layer 1 \\(RowParallelLinear, then GELU\\)"),
    "row all-reduces its gradient too": ({ROW_FORWARD: "CopyToParallelRegion.apply(ReduceFromParallelRegion.apply("
                                                       "x @ self.weight.T))"},
                                         "the backward first goes wrong at layers.3.linear.weight: .* 2 times "
                                         "too large"),
    "another rank's shard": ({COLUMN_SHARD: COLUMN_SHARD.replace("[rank]", "[(rank + 1) % world_size]")},
                             "the forward first goes wrong at layer 0"),
    "not a parameter": ({f"self.weight = nn.Parameter({ROW_SHARD})": f"self.weight = {ROW_SHARD}"},
                        "the backward first goes wrong at layers.3.linear.weight: .*it is None"),
}


@pytest.mark.parametrize("mistake", MLP_MISTAKES)
def test_wrong_mlps_fail_and_name_the_layer(mistake):
    replace, hint = MLP_MISTAKES[mistake]
    with pytest.raises(AssertionError, match="the tensor parallel MLP on rank 0 of 2: " + hint):
        check_tensor_parallel_mlp(*linears(solution(NAME, replace=replace)), 2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE,
                                  NUM_STEPS)


def test_an_extra_all_reduce_in_the_mlp_is_counted():
    wrong = solution(NAME, replace={f"        return {ROW_FORWARD}\n":
                                    f"        dist.all_reduce(x.detach().clone())\n        return {ROW_FORWARD}\n"})
    with pytest.raises(AssertionError, match="4 all-reduce\\(s\\) in forward and 2 in backward .* expected 2 and 2"):
        check_tensor_parallel_mlp(*linears(wrong), 2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)


def test_a_slice_twice_is_memory_never_filled_not_a_wrong_order():
    """An all-gather's list left unfilled can hold an earlier layer's slices (torch.empty reuses freed memory): rank 0's
    slice twice is no permutation, so the check must not say 'wrong order' (it did, by chance, in a CI run)."""
    from utils.checks.tensor_parallel import _check_gathered_slices

    slices = [torch.full((2, 3), float(r)) for r in range(3)]
    with pytest.raises(AssertionError, match=r"feature block\(s\) \[0, 2\] .* hold no rank's slice"):
        _check_gathered_slices("here", torch.cat([slices[2], slices[1], slices[1]], dim=-1), slices)
    with pytest.raises(AssertionError, match="wrong order"):
        _check_gathered_slices("here", torch.cat([slices[2], slices[0], slices[1]], dim=-1), slices)
