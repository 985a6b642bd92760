"""Notebook 10's checks: the solution passes at 2, 3 and 4 ranks; each wrong answer in the catalogue fails at its own
check with a hint that names the mistake; right answers written another way pass. Right answers come from the
solution notebook, wrong ones are small edits of it."""
import pytest
import torch

from utils import expert_parallel as ep
from utils.checks.expert_parallel import (
    check_all_to_all,
    check_capacity_dispatch,
    check_dropless_dispatch,
    check_expert_data_parallel,
)
from utils.launch import spawn
from utils.notebooks import solution
from utils.transformer import TransformerSizes

NAME = "10_expert_parallel"
SOLUTION = solution(NAME)
SMALL = dict(world_sizes=(2,))  # the mistakes show at 2 ranks


def wrong(old, new):
    return solution(NAME, replace={old: new})


def cases(catalogue, slow=()):
    """The catalogue's names, those in `slow` marked slow: they spawn again (about 1 s each) what another test
    already shows with the same hint; pytest -m slow runs them."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in catalogue]


@pytest.mark.slow  # the notebook's own run (nbval) makes these calls
def test_the_solution_passes(capsys):
    check_all_to_all(SOLUTION.all_to_all, 4)
    check_capacity_dispatch(SOLUTION.capacity_dispatch, 4)
    check_dropless_dispatch(SOLUTION.dropless_dispatch, 4)
    check_expert_data_parallel(SOLUTION.dropless_dispatch, SOLUTION.sync_gradients, 4)
    out = capsys.readouterr().out
    assert out.count("on 2, 3, 4 ranks") == 3 and "1x2, 2x1, 2x2, 1x4" in out


@pytest.mark.parametrize("bad, error, message", [
    ((8, 9, 4), ValueError, "top_k 9 is larger than num_experts 8"),
    ((6, 2, 4), ValueError, "num experts 6 is not divisible by world size 4"),
    ((8, 2, 4, 0.0), ValueError, "capacity_factor must be above 0"),
    ((8, 2, 4, -1), ValueError, "capacity_factor must be above 0"),
    ((8, 2, 4, "1"), TypeError, "capacity_factor must be a number"),
    ((8, 0, 4), ValueError, "top_k must be at least 1")])
def test_bad_sizes_are_refused(bad, error, message):
    with pytest.raises(error, match=message):
        ep.check_sizes(*bad)


def test_the_reference_layer_without_capacity_is_the_plain_sum():
    sizes = TransformerSizes(dim=8, ffn_dim=16, num_heads=2)
    moe = ep.build_moe(sizes, 4, 2, seed=1)
    x = ep.make_tokens(10, 8)
    y = moe(x)
    index, weights, _ = ep.route(x, moe.router, 2)
    plain = torch.stack([sum(weights[t, j] * moe.experts[str(int(index[t, j]))](x[t]) for j in range(2))
                         for t in range(10)])
    assert (y - plain).abs().max() < 1e-12
    # a rank's experts hold the values one process's do
    part = ep.build_moe(sizes, 4, 2, seed=1, experts=[2, 3])
    assert torch.equal(part.experts["3"].w1.weight, moe.experts["3"].w1.weight)


def _splits_that_do_not_add_up(rank, world_size):
    try:
        SOLUTION.all_to_all(torch.zeros(3, 1), [1, 1], [1, 1])
    except ValueError as e:
        return str(e)


def test_splits_that_do_not_add_up_are_named():
    assert spawn(_splits_that_do_not_add_up, 2)[1] == ("rank 1: input_splits [1, 1] add up to 2, but the tensor sent "
                                                       "has 3 rows")


def test_the_layer_takes_a_blocks_feed_forward_place():
    from utils.transformer import Block
    sizes = TransformerSizes(dim=8, ffn_dim=16, num_heads=2)
    block = Block(sizes).double()
    block.feed_forward = ep.build_moe(sizes, 4, 2, seed=1)
    out = block(ep.make_tokens(10, 8).view(2, 5, 8), torch.arange(5))
    out.sum().backward()
    assert out.shape == (2, 5, 8) and block.feed_forward.router.weight.grad is not None
    assert block.feed_forward.index.shape == (10, 2) and block.feed_forward.aux_loss.item() > 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_splits_the_ranks_disagree_on_are_named_on_every_rank(world_size):
    for rank, message in enumerate(spawn(SOLUTION.disagreeing_splits_main, world_size)):
        assert message.startswith(f"rank {rank}: ValueError: rank 0 expects 2 rows from rank 1, which sends it 3")


# ---------------------------------------------------------------- the all-to-all

A2A_MISTAKES = {
    "backward with the forward's splits": (
        "grad_out.contiguous(), ctx.input_splits, ctx.output_splits,",
        "grad_out.contiguous(), ctx.output_splits, ctx.input_splits,",
        "backward used the forward's splits"),
    "backward not reversed (gradient returned as it is)": (
        "        return grad_x, None, None, None\n", "        return grad_out, None, None, None\n",
        "back to the rank the row came"),
    "no gradient for the splits": ("        return grad_x, None, None, None\n", "        return grad_x\n",
                                   "one gradient per input of forward"),
    "forward's splits swapped": (
        "        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)\n",
        "        dist.all_to_all_single(out, x.contiguous(), input_splits, output_splits, group=group)\n",
        "takes \\(output, input, output_split_sizes, input_split_sizes\\)"),
    "forward's output shaped like its input": (
        "        out = x.new_empty((sum(output_splits), *x.shape[1:]))\n", "        out = torch.empty_like(x)\n",
        "sum\\(output_splits\\) rows"),
    "gloo's list all_to_all with uneven sizes": (
        "        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)\n",
        "        received = list(out.split(output_splits))\n"
        "        dist.all_to_all(received, list(x.split(input_splits)))\n"
        "        out = torch.cat(received)\n", "one size only"),
    # issue 43 (found by students): the group left out, which a check on all ranks cannot see
    "backward on all ranks, not the group": (
        "ctx.input_splits, ctx.output_splits, group=ctx.group)", "ctx.input_splits, ctx.output_splits)",
        "on the groups \\[\\[0\\], \\[1\\]\\]\\): RuntimeError: Number of tensor splits not equal to group "
        "size: the backward's all-to-all ran on all ranks, not on the group .* pass group=ctx.group"),
    "forward on all ranks, not the group": (
        "output_splits, input_splits, group=group)\n", "output_splits, input_splits)\n",
        "the all-to-all ran on all ranks, not on `group`: pass group=group"),
    "backward's gradient zeroed": ("        return grad_x, None, None, None\n",
                                   "        return torch.zeros_like(grad_x), None, None, None\n", "it is zero"),
}


@pytest.mark.parametrize("mistake", cases(A2A_MISTAKES, slow={"forward on all ranks, not the group"}))
def test_all_to_all_mistakes_are_named(mistake):
    old, new, hint = A2A_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_all_to_all(wrong(old, new).all_to_all, 2, **SMALL)


def test_all_to_all_written_another_way_passes():
    # backward as the function itself, applied with the splits swapped
    other = wrong("        return grad_x, None, None, None\n",
                  "        back = AllToAll.apply(grad_out, ctx.input_splits, ctx.output_splits, ctx.group)\n"
                  "        return back, None, None, None\n")
    check_all_to_all(other.all_to_all, 3, world_sizes=(3,))


# ---------------------------------------------------------------- capacity

KEPT = "    kept = place < capacity\n"
Y_CAP = "    y = torch.zeros_like(x).index_add(0, tokens[kept], weights.flatten()[kept, None] * returned[slot])\n"
CAPACITY_MISTAKES = {
    "nothing dropped": (KEPT, "    kept = place < len(x) * 10\n", "below capacity"),
    "capacity + 1 kept": (KEPT, "    kept = place <= capacity\n", "below capacity"),
    "capacity - 1 kept": (KEPT, "    kept = place < capacity - 1\n", "capacity - 1 pairs, one short"),
    "the kept pairs' weights taken in order": (Y_CAP, Y_CAP.replace("weights.flatten()[kept, None]",
                                                                    "weights.flatten()[:int(kept.sum()), None]"),
                                               "the kept pairs took the first weights in order, not their own"),
    "last come first served": (
        "    place = (F.one_hot(flat, num_experts).cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # its place in "
        "the queue\n",
        "    place = (F.one_hot(flat, num_experts).flip(0).cumsum(0).flip(0) - 1)"
        ".gather(1, flat[:, None]).squeeze(1)\n",
        "first come, first served"),
    "choice by choice priority": (
        "    flat = index.flatten()\n    place = ",
        "    flat = index.flatten()\n    by_choice = index.T.flatten()\n"
        "    place = (F.one_hot(by_choice, num_experts).cumsum(0) - 1).gather(1, by_choice[:, None]).squeeze(1)\n"
        "    place = place.view(index.shape[1], -1).T.flatten()\n    _ = ", "choice by choice"),
    "router gradient lost": (Y_CAP, Y_CAP.replace("weights.flatten()", "weights.detach().flatten()"),
                             "router has no gradient"),
    "renormalised after the drop": (
        Y_CAP, "    w = weights * kept.view(index.shape)\n"
               "    w = (w / w.sum(-1, keepdim=True).clamp_min(1e-300)).flatten()\n"
               + Y_CAP.replace("weights.flatten()", "w"), "renormalised after the drop"),
    "weights not applied": (Y_CAP, Y_CAP.replace("weights.flatten()[kept, None] * ", ""),
                            "combine weights were not applied"),
    # issue 43 (found by students): a flat mask was told "not the same pairs" before its shape
    "kept returned flat": ("    return y, kept.view(index.shape)\n", "    return y, kept\n",
                           "`kept` has shape \\(24,\\) on the ranks, expected \\(12, 2\\): the \\(tokens, top_k\\) "
                           "bool mask"),
    # issue 43's pattern: a combine that overwrites instead of adds
    "combine overwrites": (Y_CAP, Y_CAP.replace(".index_add(0, tokens[kept], ", ".index_put((tokens[kept],), "),
                           "top-2, capacity .*: each token kept one of its results only"),
    "received rows read expert-major": (
        "    received = all_to_all(buffer, splits, splits).view(world_size, per_rank, capacity, dim)\n",
        "    received = all_to_all(buffer, splits, splits).view(per_rank, world_size, capacity, dim).transpose(0, 1)\n",
        "laid out by source rank, then"),
    "results read from the wrong slot": (Y_CAP, Y_CAP.replace("returned[slot]", "returned[slot.flip(0)]"),
                                         "un-permute is the inverse"),
}


@pytest.mark.parametrize("mistake", cases(CAPACITY_MISTAKES, slow=("capacity - 1 kept",
                                                                          "the kept pairs' weights taken in order")))  # as + 1, in the default run
def test_capacity_mistakes_are_named(mistake):
    old, new, hint = CAPACITY_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_capacity_dispatch(wrong(old, new).capacity_dispatch, 2, **SMALL)


def test_capacity_written_another_way_passes():
    # the drop rule from the helper, and the results gathered per pair instead of index_add
    other = wrong(KEPT, "    kept = ep.within_capacity(index, num_experts, capacity).flatten()\n")
    check_capacity_dispatch(other.capacity_dispatch, 3, world_sizes=(3,))


# ---------------------------------------------------------------- dropless

Y_DROP = "    y = torch.zeros_like(x).index_add(0, tokens[order], weights.flatten()[order, None] * returned)\n"
DROPLESS_MISTAKES = {
    "counts not exchanged": ("    dist.all_to_all_single(received_counts, counts, group=group)\n",
                             "    received_counts = counts.clone()\n", "exchange the counts per expert first"),
    "un-permute with the wrong inverse": (Y_DROP, Y_DROP.replace("tokens[order]", "tokens"),
                                          "un-permute is the inverse"),
    "router gradient lost": (Y_DROP, Y_DROP.replace("weights.flatten()", "weights.detach().flatten()"),
                             "router has no gradient"),
    "results sent back with the forward's splits": (
        "    returned = all_to_all(out, input_splits, output_splits, group)\n",
        "    returned = all_to_all(out, output_splits, input_splits, group)\n", "go back with the splits swapped"),
    "weights not applied": (Y_DROP, Y_DROP.replace("weights.flatten()[order, None] * ", ""),
                            "combine weights were not applied"),
    "combine overwrites": (Y_DROP, Y_DROP.replace(".index_add(0, tokens[order], ", ".index_put((tokens[order],), "),
                           "top-2: .*each token kept one of its results only"),
    # issue 43's pattern: top-1's weights are all 1, top-2's show it
    "weights not permuted with their tokens": (Y_DROP, Y_DROP.replace("weights.flatten()[order, None]",
                                                                      "weights.flatten()[:, None]"),
                                               "top-2: the output differs .* weights were not permuted with their "
                                               "tokens"),
    "splits summed over the wrong axis": (
        "    input_splits = counts.view(world_size, per_rank).sum(1).tolist()\n",
        "    input_splits = counts.view(per_rank, world_size).sum(0).tolist()\n", "E/N consecutive experts"),
    "received rows read expert-major": (
        "    expert_of_row = torch.arange(per_rank).repeat(world_size).repeat_interleave(received_counts)\n",
        "    expert_of_row = torch.arange(per_rank).repeat_interleave(world_size).repeat_interleave("
        "received_counts.view(world_size, per_rank).T.flatten())\n", "went through another expert"),
}


@pytest.mark.parametrize("mistake", cases(DROPLESS_MISTAKES, slow={"combine overwrites"}))
def test_dropless_mistakes_are_named(mistake):
    old, new, hint = DROPLESS_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_dropless_dispatch(wrong(old, new).dropless_dispatch, 2, **SMALL)


def test_dropless_with_an_unstable_sort_passes():
    # the order within an expert does not matter without a capacity: each result goes back to its own pair
    other = wrong("    order = flat.argsort(stable=True)", "    order = flat.argsort(descending=True).flip(0)")
    check_dropless_dispatch(other.dropless_dispatch, 2, **SMALL)


@pytest.mark.parametrize("received", ["received_counts.view(world_size, per_rank).sum(0).tolist()",
                                      pytest.param("list(received_counts.view(world_size, per_rank).sum(0))",
                                                   marks=pytest.mark.slow)])  # 0-d tensors: 1 s more
def test_dropless_counts_as_a_list_pass(received):
    """Issue 43 (found by students): a list of ints, or of 0-d tensors, crashed the check itself."""
    other = wrong("    return y, received_counts.view(world_size, per_rank).sum(0)\n", f"    return y, {received}\n")
    check_dropless_dispatch(other.dropless_dispatch, 2, **SMALL)


def test_dropless_written_another_way_passes():
    # the results un-permuted by scattering into pair order first
    other = wrong(Y_DROP, "    back = torch.empty_like(returned).index_copy(0, order, returned)\n"
                          "    y = torch.zeros_like(x).index_add(0, tokens, weights.flatten()[:, None] * back)\n")
    check_dropless_dispatch(other.dropless_dispatch, 3, world_sizes=(3,))


# ---------------------------------------------------------------- experts and data parallel

REDUCE = "        dist.all_reduce(p.grad, group=data_group if name.startswith(\"experts.\") else None)\n"
DIVIDE = "        p.grad /= world_size\n"
SYNC_MISTAKES = {
    "experts averaged over the data group": (
        DIVIDE, "        p.grad /= dist.get_world_size(data_group) if name.startswith('experts.') else world_size\n",
        "times too large, the expert-parallel size"),
    # issue 43's pattern: on 2 x 2 the two group sizes are equal, so the hint names both
    "experts divided by the expert-parallel size": (
        DIVIDE, "        p.grad /= world_size // dist.get_world_size(data_group) if name.startswith('experts.') "
                "else world_size\n", "not by the data-parallel size \\(or the expert-parallel size: on this mesh "
                                      "both are 2\\)", 4),
    "experts all-reduced over all ranks": (REDUCE, "        dist.all_reduce(p.grad)\n", "other experts' gradients"),
    "router on the data group only": (REDUCE, "        dist.all_reduce(p.grad, group=data_group)\n",
                                      "data-parallel group only", 4),  # 2 x 2: at 2 ranks its data group is itself
    "not divided": (DIVIDE, "", "sum over all ranks"),
    "never all-reduced": (REDUCE, "", "never all-reduced"),
}


@pytest.mark.parametrize("mistake", cases(SYNC_MISTAKES, slow={"experts divided by the expert-parallel size"}))
def test_expert_data_parallel_mistakes_are_named(mistake):
    old, new, hint, *world_size = SYNC_MISTAKES[mistake]
    n = world_size[0] if world_size else 2
    with pytest.raises(AssertionError, match=hint):
        check_expert_data_parallel(SOLUTION.dropless_dispatch, wrong(old, new).sync_gradients, n, world_sizes=(n,))


def test_a_dispatch_on_all_ranks_is_named():
    # the tokens of a 2 (data) x 1 (expert) mesh sent over both ranks: the group argument ignored
    other = wrong("    dist.all_to_all_single(received_counts, counts, group=group)\n",
                  "    dist.all_to_all_single(received_counts, counts)\n")
    with pytest.raises(AssertionError, match="tokens move within its expert-parallel group"):
        check_expert_data_parallel(other.dropless_dispatch, SOLUTION.sync_gradients, 2, world_sizes=(2,))


def test_expert_data_parallel_written_another_way_passes():
    # the mean over the data group, then the expert-parallel share: the same number
    other = wrong(DIVIDE, "        p.grad /= world_size if not name.startswith('experts.') else "
                          "dist.get_world_size(data_group)\n"
                          "        p.grad /= 1 if not name.startswith('experts.') else world_size // "
                          "dist.get_world_size(data_group)\n")
    check_expert_data_parallel(SOLUTION.dropless_dispatch, other.sync_gradients, 2, world_sizes=(2,))
