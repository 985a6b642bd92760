"""Notebook 12's checks: the solution passes; each wrong answer in the catalogue fails with a hint that names the
mistake; right answers written another way pass; sizes that do not fit are refused before any rank starts. Right
answers come from the solution notebook, wrong ones are small edits of it. The mesh's catalogue runs on 2 ranks (the
shapes of other sizes, computed from DeviceMesh's layout in the parent, show every mistake); the 2-D composition's on
the (2, 2) mesh, one step, where the data group, the tensor group and the world all differ."""
import pytest

from utils import nd_parallel as nd
from utils.checks import nd_parallel as checks_nd
from utils.checks.nd_parallel import (
    SIZES,
    check_context_parallel_nd,
    check_fsdp_tensor_parallel,
    check_mesh_position,
    check_pipeline_3d,
    _layout_truth,
)
from utils.notebooks import solution
from utils.transformer import TransformerSizes

NAME = "12_nd_parallel"

# ---------------------------------------------------------------- section 1: the mesh

STRIDES = "    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]\n"
GROUPS = ("    groups = [[rank + (k - c) * stride for k in range(size)] for c, stride, size in zip(coordinates, "
          "strides, shape)]\n")
COORDINATES = "    coordinates = tuple(rank // stride % size for stride, size in zip(strides, shape))\n"
MESH_MISTAKES = {
    "column-major order": ({STRIDES: "    strides = [math.prod(shape[:i]) for i in range(len(shape))]\n"},
                           "column-major order"),
    "strides in reverse order": (
        {STRIDES: "    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))][::-1]\n"},
        "the strides in reverse order"),
    "groups that share the coordinate": (
        {GROUPS: "    groups = [[r for r in range(math.prod(shape)) if r // stride % size == c]\n"
                 "              for c, stride, size in zip(coordinates, strides, shape)]\n"}, "SHARE this rank's"),
    "groups of consecutive ranks": ({GROUPS: "    groups = [[rank - rank % size + k for k in range(size)] for size in "
                                             "shape]\n"}, "consecutive ranks"),
    "right for (2, 2, 2) only": ({STRIDES: "    strides = [4, 2, 1]\n"}, "right for \\(2, 2, 2\\) only"),
    "groups in another order": ({"for k in range(size)] for c": "for k in reversed(range(size))] for c"},
                                "another order"),
    "coordinates without % size": ({COORDINATES: "    coordinates = tuple(rank // stride for stride in strides)\n"},
                                   "without the % size_i"),
    "coordinates as rank % size, no stride": ({COORDINATES: "    coordinates = tuple(rank % size for size in shape)\n"},
                                              "rank % size_i is the last dimension's coordinate only"),
    "the coordinates' mistake with groups built another way": (
        {COORDINATES: "    coordinates = tuple(rank % size for size in shape)\n",
         GROUPS: "    position = lambda r: tuple(r % size for size in shape)\n"
                 "    groups = [[r for r in range(math.prod(shape)) if all(a == b for j, (a, b) in "
                 "enumerate(zip(position(r), coordinates)) if j != i)] for i in range(len(shape))]\n"},
        "the coordinates: rank % size_i is the last dimension's coordinate"),
    "stride = the next size alone": (
        {STRIDES: "    strides = [shape[i + 1] if i + 1 < len(shape) else 1 for i in range(len(shape))]\n"},
        r"mesh_position\(\d+, \(2, 3, 2\)\).*the product of ALL the sizes after it, not the next size alone"),
    "stride counting its own size": ({STRIDES: STRIDES.replace("shape[i + 1:]", "shape[i:]")},
                                     "the product of the sizes AFTER it, not from it"),
    "groups stepping by 1": ({GROUPS: GROUPS.replace("(k - c) * stride", "(k - c)")}, "each group steps by 1"),
    "groups without the rank itself": ({GROUPS: GROUPS.replace("for k in range(size)]", "for k in range(size) if k != c]")},
                                       "each group leaves this rank out"),
    "groups one rank short": ({GROUPS: GROUPS.replace("range(size)", "range(size - 1)")}, "stops one rank short"),
    "three dimensions written in": ({COORDINATES: "    coordinates = tuple(rank // strides[i] % shape[i] for i in range(3))\n"},
                                    r"raised IndexError: .*loop over len\(shape\)"),
}


ON_RANKS = ("column-major order", "groups that share the coordinate", "groups of consecutive ranks",
            "right for (2, 2, 2) only")  # with init_device_mesh on 2 ranks; the others with its layout, in this process


@pytest.fixture
def layout_for_ranks(monkeypatch):
    """The check's ranks replaced by DeviceMesh's layout (which the check asserts they build): no spawn."""
    def ranks(fn, n, shapes, timeout):
        return [[_layout_truth(shape)[rank] for shape in shapes] for rank in range(n)]
    monkeypatch.setattr(checks_nd, "spawn", ranks)


@pytest.mark.parametrize("mistake", MESH_MISTAKES)
def test_mesh_mistakes_are_named(mistake, request):
    if mistake not in ON_RANKS:
        request.getfixturevalue("layout_for_ranks")
    replace, hint = MESH_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_mesh_position(solution(NAME, replace=replace).mesh_position, 2)


def test_mesh_position_written_with_numpy_passes(capsys):
    module = solution(NAME, replace={STRIDES + "    coordinates = tuple(rank // stride % size for stride, size in "
                                     "zip(strides, shape))\n" + GROUPS: """    import numpy as np

    coordinates = np.unravel_index(rank, shape)
    groups = [[r for r in range(math.prod(shape))
               if all(a == b for j, (a, b) in enumerate(zip(np.unravel_index(r, shape), coordinates)) if j != i)]
              for i in range(len(shape))]
"""})
    check_mesh_position(module.mesh_position, 2)
    assert "equal init_device_mesh's on 2 ranks" in capsys.readouterr().out


def test_mesh_position_written_with_a_tensor_and_with_divmod_passes(layout_for_ranks, capsys):
    """init_device_mesh's own layout, torch.arange(W).view(shape), indexed; and the coordinates peeled off from the
    last dimension with divmod, each group from its first rank: right answers written another way."""
    with_tensor = solution(NAME, replace={STRIDES + COORDINATES + GROUPS: """    mesh = torch.arange(math.prod(shape)).view(shape)
    coordinates = tuple((mesh == rank).nonzero()[0])
    groups = [mesh[coordinates[:i] + (slice(None),) + coordinates[i + 1:]] for i in range(len(shape))]
"""})
    check_mesh_position(with_tensor.mesh_position, 2)
    with_divmod = solution(NAME, replace={STRIDES + COORDINATES + GROUPS: """    rest, coordinates = rank, []
    for size in reversed(shape):
        rest, c = divmod(rest, size)
        coordinates.insert(0, c)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    groups = []
    for c, stride, size in zip(coordinates, strides, shape):
        first = rank - c * stride
        groups.append(list(range(first, first + size * stride, stride)))
"""})
    check_mesh_position(with_divmod.mesh_position, 2)
    assert capsys.readouterr().out.count("equal init_device_mesh's on 2 ranks") == 2


def test_a_mesh_that_does_not_fill_the_world_is_refused():
    with pytest.raises(ValueError, match="mesh data 2 x pipeline 2 x tensor 3 = 12 ranks, but the world has 8"):
        nd.check_mesh((2, 2, 3), 8, nd.MESH_3D)


# ---------------------------------------------------------------- section 2: FSDP x tensor (and sequence) parallel

SYNC_IF = "        if not nd.sharded_over_tensor(name):\n"
REDUCE_SCATTER = "dist.reduce_scatter_single(grad, fsdp.flat_padded(p.grad, data_parallel), group=data_group)"
ALL_REDUCE = "            dist.all_reduce(grad, group=tensor_group)\n"
MISTAKES = {
    "norms' gradients not all-reduced over the tensor group": (
        {SYNC_IF: "        if not nd.sharded_over_tensor(name) and not name.startswith('layers.'):\n"},
        "the norms' gradients were not all-reduced over the tensor group"),
    "embedding and LM head not synced": (
        {SYNC_IF: "        if not nd.sharded_over_tensor(name) and name.startswith('layers.'):\n"},
        "tok_embeddings.weight's gradient was not summed over the tensor group"),
    "FSDP's reduce-scatter on the world": (
        {REDUCE_SCATTER: REDUCE_SCATTER.replace(", group=data_group", "")},
        "FSDP's reduce-scatter ran on the whole world instead of the data group"),
    "divided by the world size": ({"        grad /= data_parallel\n": "        grad /= dist.get_world_size()\n"},
                                  "divided by the world size \\(4\\) instead of the data size \\(2\\)"),
    "not divided": ({"        grad /= data_parallel\n": ""}, "2 times too large: the sum over the data group"),
    "tensor parallel on the data group": (
        {"nd.tensor_sequence_parallel(model, tensor_group)": "nd.tensor_sequence_parallel(model, data_group)"},
        "the tensor-parallel collectives ran on the data group"),
    "FSDP on the tensor group": ({"nd.FlatShards(model, data_group)": "nd.FlatShards(model, tensor_group)"},
                                "FSDP's all-gather ran on the tensor group"),
    "whole weights all-reduced on the data group": (
        {ALL_REDUCE: ALL_REDUCE.replace("tensor_group", "data_group")},
        "the whole weights' gradients were all-reduced on the data group"),
    "every gradient all-reduced over the tensor group": ({SYNC_IF: "        if True:\n"},
                                                         "a tensor-parallel shard's gradient was all-reduced"),
    "whole weights averaged over the tensor group": (
        {ALL_REDUCE: ALL_REDUCE + "            grad /= dist.get_world_size(tensor_group)\n"},
        "averaged over the tensor group \\(divided by 2\\)"),
    # students' list: right values, the wrong collective or the wrong order, named with their bytes
    "all-reduce on the data group, a slice kept": (
        {"        grad = torch.empty_like(shards[name])\n"
         f"        {REDUCE_SCATTER}\n":
         "        whole = p.grad.clone()\n        dist.all_reduce(whole, group=data_group)\n"
         "        grad = fsdp.shard(whole, dist.get_rank(data_group), data_parallel)\n"},
        "all-reduced on the data group and a slice of them kept: FSDP's reduce-scatter written as an all-reduce. The "
        "values are right, but every rank receives and holds the whole gradient \\(\\d+ bytes handed to the "
        "all-reduces\\), 2 times the shard it keeps; .* Use a reduce-scatter"),
    "the tensor group's all-reduce before the reduce-scatter": (
        {"        grad = torch.empty_like(shards[name])\n"
         f"        {REDUCE_SCATTER}\n"
         "        grad /= data_parallel\n" + SYNC_IF + ALL_REDUCE:
         SYNC_IF + ALL_REDUCE.replace("(grad,", "(p.grad,")
         + "        grad = fsdp.reduce_scatter_mean(p.grad, data_group)\n"},
        "all-reduced over the tensor group BEFORE FSDP's reduce-scatter: the values are right, but that all-reduce "
        "moves whole gradients \\(\\d+ bytes handed to it\\) where, after the reduce-scatter, it moves the shards "
        "\\(\\d+ bytes, 1/2, \\+\\d+% on the tensor group's step\\)"),
    "the reduce-scatter's input not flattened and padded": (
        {"fsdp.flat_padded(p.grad, data_parallel)": "p.grad"},
        "sync_gradients raised RuntimeError: .*: reduce_scatter_single's input must hold data-size times its "
        "output's elements"),
    "FSDP's shards taken before tensor parallel": (
        {"    model = nd.tensor_sequence_parallel(model, tensor_group)\n    return model, nd.FlatShards(model, data_group)\n":
         "    shards = nd.FlatShards(model, data_group)\n    model = nd.tensor_sequence_parallel(model, tensor_group)\n"
         "    return model, shards\n"},
        "parallelize_2d raised ValueError: .*, at `model = nd.tensor_sequence_parallel\\(model, tensor_group\\)`: the "
        "order is tensor \\+ sequence parallel first"),
    "shards looked up by a name of its own": (
        {"        shards[name].grad = grad\n": "        shards[name.split('.')[-1]].grad = grad\n"},
        "sync_gradients raised KeyError: 'weight': shards is keyed by the names of model.named_parameters"),
}


def check_2d(module, **kwargs):
    kwargs = {"mesh_shapes": [(2, 2)], "num_steps": 1, **kwargs}
    check_fsdp_tensor_parallel(module.parallelize_2d, module.sync_gradients_2d, 4, **kwargs)


# about 1 s each: the classic bugs and one of the students' list run by default, the rest under pytest -m slow
SLOW = ("not divided", "FSDP on the tensor group", "whole weights all-reduced on the data group",
        "every gradient all-reduced over the tensor group", "whole weights averaged over the tensor group",
        "the reduce-scatter's input not flattened and padded", "shards looked up by a name of its own",
        "all-reduce on the data group, a slice kept", "FSDP's shards taken before tensor parallel")


@pytest.mark.parametrize("mistake", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MISTAKES])
def test_2d_mistakes_are_named(mistake):
    replace, hint = MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_2d(solution(NAME, replace=replace))


@pytest.mark.slow  # 3 s: two meshes
def test_2d_divided_by_the_tensor_size_is_named_where_it_differs_from_the_data_size():
    """On (2, 2) the tensor group's size is the data group's: the mistake shows on (1, 4), where both the world's and
    the tensor group's size are 4 (both named)."""
    module = solution(NAME, replace={"        grad /= data_parallel\n": "        grad /= dist.get_world_size(tensor_group)\n"})
    with pytest.raises(AssertionError, match=r"on mesh \(data, tensor\) = \(1, 4\).*divided by the world size or the "
                                             r"tensor size \(4\) instead of the data size \(1\)"):
        check_2d(module, mesh_shapes=[(2, 2), (1, 4)])


@pytest.mark.slow  # 2.3 s: two meshes
def test_2d_right_only_on_the_default_mesh_is_named():
    """/ 2 written in: right on (2, 2), wrong on (1, 4); the check says it passed the first mesh."""
    module = solution(NAME, replace={"        grad /= data_parallel\n": "        grad /= 2\n"})
    with pytest.raises(AssertionError, match="right on mesh \\(2, 2\\), wrong on \\(1, 4\\)"):
        check_2d(module, mesh_shapes=[(2, 2), (1, 4)])


def test_2d_the_librarys_reduce_scatter_then_a_sum_op_passes(capsys):
    """The right order written another way: FSDP's mean with utils.fsdp.reduce_scatter_mean on the data group, then
    the whole weights' shards summed over the tensor group in place."""
    module = solution(NAME, replace={
        "        grad = torch.empty_like(shards[name])\n"
        f"        {REDUCE_SCATTER}\n"
        "        grad /= data_parallel\n": "        grad = fsdp.reduce_scatter_mean(p.grad, data_group)\n",
        ALL_REDUCE: ALL_REDUCE.replace("group=tensor_group", "op=dist.ReduceOp.SUM, group=tensor_group")})
    check_2d(module)
    assert "equal one process's" in capsys.readouterr().out


@pytest.mark.slow  # 6 s: three meshes, three steps each; the notebook's run checks the same
def test_2d_solution_passes_on_every_mesh(capsys):
    module = solution(NAME)
    check_fsdp_tensor_parallel(module.parallelize_2d, module.sync_gradients_2d, 4)
    assert "meshes (data x tensor) 2 x 2, 1 x 4, 4 x 1" in capsys.readouterr().out


@pytest.mark.parametrize("sizes, mesh, world, message", [
    (SIZES, (2, 2), 8, "mesh data 2 x tensor 2 = 4 ranks, but the world has 8"),
    (TransformerSizes(num_heads=2, dim=16), (1, 4), 4, "num heads 2 is not divisible by tensor parallel 4"),
    (TransformerSizes(ffn_dim=30), (1, 4), 4, "ffn dim 30 is not divisible by tensor parallel 4"),
    (TransformerSizes(seq_len=6), (1, 4), 4, "seq len 6 is not divisible by tensor parallel 4"),
    (TransformerSizes(batch_size=3), (2, 2), 4, "batch size 3 is not divisible by data parallel 2"),
])
def test_sizes_that_do_not_fit_the_mesh_are_refused(sizes, mesh, world, message):
    with pytest.raises(ValueError, match=message):
        nd.check_sizes_2d(sizes, *mesh, world)


def test_the_check_refuses_bad_sizes_before_any_rank_starts():
    module = solution(NAME)
    with pytest.raises(ValueError, match="batch size 3 is not divisible by data parallel 2"):
        check_fsdp_tensor_parallel(module.parallelize_2d, module.sync_gradients_2d, 4,
                                   sizes=TransformerSizes(batch_size=3), mesh_shapes=[(2, 2)])


# ---------------------------------------------------------------- section 3: pipeline stages (3-D)
# The catalogue runs on 4 ranks, mesh (1, 2, 2) (every mistake but the wrong data group shows without a data
# dimension; a world-group sync is refused on any mesh), one step: the first step's calls and gradients name each.

THREE_D = dict(world_size=4, num_steps=1)
PIPELINE_MISTAKES = {
    "the output's gradient received from the previous stage (None on the first: any source, right on 2 stages)": (
        {"                dist.recv(grad, following, group=pipeline)\n":
         "                dist.recv(grad, previous, group=pipeline)\n"}, "names no peer \\(None: from any rank\\)"),
    "the returned loss divided by m again": ({"                loss += y.item()\n": "                loss += y.item() / m\n"},
                                             "the loss returned is 1/2 of one process's at every step"),
    "peer rank - 1 (the tensor neighbour)": (
        {"    previous = rank - tensor_parallel if stage > 0 else None":
             "    previous = rank - 1 if stage > 0 else None",
         "    following = rank + tensor_parallel if stage < num_stages - 1 else None":
             "    following = rank + 1 if stage < num_stages - 1 else None"}, "its tensor neighbour"),
    "sync after each micro-batch": (
        {"                sends.append(dist.isend(x.grad, previous, group=pipeline))\n":
         "                sends.append(dist.isend(x.grad, previous, group=pipeline))\n"
         "            sync_gradients_2d(model, shards, groups[\"tensor\"], groups[\"data\"])\n",
         "    sync_gradients_2d(model, shards, groups[\"tensor\"], groups[\"data\"])\n    return loss":
         "    return loss"}, "after each micro-batch"),
    "only the last micro-batch's gradient": (
        {"            x, y = inputs.pop(i), outputs.pop(i)\n":
         "            x, y = inputs.pop(i), outputs.pop(i)\n            model.zero_grad()\n"},
        "only the last micro-batch's gradient was kept"),
    "loss not divided by the micro-batches": (
        {"model.sizes.seq_len) / m\n": "model.sizes.seq_len)\n"}, "not divided by the number of micro-batches"),
    "embedding on the last stage": (
        {"    if stage > 0:\n        model.tok_embeddings = None": "    if stage < num_stages - 1:\n"
                                                                   "        model.tok_embeddings = None"},
        "the embedding on the last stage"),
    "LM head on the first stage": (
        {"    if stage < num_stages - 1:\n        model.norm = model.output = None":
         "    if stage > 0:\n        model.norm = model.output = None"}, "the LM head on the first stage"),
    "sync on the pipeline group": (
        {"    sync_gradients_2d(model, shards, groups[\"tensor\"], groups[\"data\"])\n    return loss":
         "    sync_gradients_2d(model, shards, groups[\"tensor\"], groups[\"pipeline\"])\n    return loss"},
        "on the pipeline group: the gradients were synchronised"),
    "sync over data x pipeline": (  # a group of the ranks with this rank's tensor coordinate, built by hand
        {"    sync_gradients_2d(model, shards, groups[\"tensor\"], groups[\"data\"])\n    return loss":
         "    planes = [dist.new_group([r for r in range(dist.get_world_size()) if r % tensor_parallel == t])\n"
         "              for t in range(tensor_parallel)]\n"
         "    sync_gradients_2d(model, shards, groups[\"tensor\"], planes[rank % tensor_parallel])\n    return loss"},
        "a group of ranks \\[\\d, \\d[^\\]]*\\]: the gradients were synchronised over more than the data group"),
    "sync over the whole world": (
        {"    sync_gradients_2d(model, shards, groups[\"tensor\"], groups[\"data\"])\n    return loss":
         "    sync_gradients_2d(model, shards, groups[\"tensor\"], dist.group.WORLD)\n    return loss"},
        "more than the data group"),
    # sends and receives that do not pair up: a peer leaves (on a longer run the ranks stall until the check's
    # timeout); each rank's journal says which messages were never received, or never sent
    "a forward's receive left out": ({"dist.recv(x, previous, group=pipeline)": "pass"},
                                     "sent 2 message\\(s\\) to rank \\d \\(stage 1\\), which posted 0 receive"),
    # right values, wrong schedule: a warm-up one forward too long (the last stage then holds 2 micro-batches)
    "1F1B's warm-up one forward too long": (
        {"    for kind, i in pp.one_f_one_b_order(stage, num_stages, m):\n":
         "    for kind, i in pp.one_f_one_b_order(stage, num_stages + 1, m):\n"},
        "stage 1 ran F F B B, 1F1B's table \\(pp.one_f_one_b_order\\(1, 2, 2\\)\\) says F B F B: 2 forward\\(s\\) "
        "before its first backward where 1F1B's stage 1 of 2 runs 1 \\(a warm-up of P - s - 1 = 0, .*\\); it held 2 "
        "micro-batches' activations at once instead of 1"),
    # right on (2, 2, 2) and (1, 2, 2), where P = T: the check's (2, 2, 1) mesh tells them apart
    "the pipeline neighbour P ranks away, not T": (
        {"    previous = rank - tensor_parallel if stage > 0 else None":
             "    previous = rank - num_stages if stage > 0 else None",
         "    following = rank + tensor_parallel if stage < num_stages - 1 else None":
             "    following = rank + num_stages if stage < num_stages - 1 else None"},
        "on mesh \\(data, pipeline, tensor\\) = \\(2, 2, 1\\): .*a step of 2 ranks \\(.*the pipeline size P.*\\); "
        "the pipeline dimension's stride is T = 1"),
    "the loss share not divided by T": (
        {"nd.loss_share(model, x, targets, tensor_parallel, model.sizes.seq_len)":
         "nd.loss_share(model, x, targets, 1, model.sizes.seq_len)"},
        "it is 2 times too large: the loss share was not divided by T = 2 .*\\(right on mesh \\(2, 2, 1\\), wrong on "
        "\\(1, 2, 2\\)\\)"),
    # a library's error inside the student's code, said where it came from (gloo would abort the receiving rank)
    "the hidden states received into a buffer shaped like the tokens": (
        {"                x = nd.hidden_like(tokens, model.sizes)\n":
         "                x = torch.empty_like(tokens, dtype=torch.float64)\n"},
        "rank \\d's recv receives into a torch.float64 tensor of shape \\(1, 8\\); what travels between stages is a "
        "micro-batch's hidden states .* float64 of shape \\(1, 8, 16\\)"),
    "groups read by a name the mesh does not have": (
        {'    stage, num_stages = dist.get_rank(groups["pipeline"]), dist.get_world_size(groups["pipeline"])':
         '    stage, num_stages = dist.get_rank(groups["stage"]), dist.get_world_size(groups["stage"])'},
        "parallelize_3d raised KeyError: 'stage', at `stage, num_stages = .*`: groups is a dict keyed by the mesh's "
        "dimension names"),
    "a backward's send left out": ({"sends.append(dist.isend(x.grad, previous, group=pipeline))": "pass"},
                                   "sent 0 message\\(s\\) to rank 0 \\(stage 0\\), which posted 1 receive"),
}


# about 2 s each under load (the right ones pass (2, 2, 1) first): these under pytest -m slow
PIPELINE_SLOW = ("the returned loss divided by m again",
                 "the output's gradient received from the previous stage (None on the first: any source, right on 2 "
                 "stages)", "the loss share not divided by T", "sync over data x pipeline", "sync over the whole world",
                 "LM head on the first stage", "the hidden states received into a buffer shaped like the tokens",
                 "groups read by a name the mesh does not have", "the pipeline neighbour P ranks away, not T")


@pytest.mark.parametrize("mistake", [pytest.param(m, marks=pytest.mark.slow) if m in PIPELINE_SLOW else m
                                     for m in PIPELINE_MISTAKES])
def test_3d_mistakes_are_named(mistake):
    replace, hint = PIPELINE_MISTAKES[mistake]
    wrong = solution(NAME, replace=replace)
    with pytest.raises(AssertionError, match=hint):
        check_pipeline_3d(wrong.parallelize_3d, wrong.train_step_3d, **THREE_D)


@pytest.mark.slow  # 3 s under load; the notebook's run checks the solution itself
def test_3d_blocking_sends_and_group_ranks_pass(capsys):
    """A right answer written another way: peers as group ranks (group_dst/group_src), the hidden states' gradient
    sent after the backward with irecv: the check accepts it."""
    other = solution(NAME, replace={
        "dist.recv(x, previous, group=pipeline)": "dist.irecv(x, group=pipeline, group_src=stage - 1).wait()",
        "dist.recv(grad, following, group=pipeline)": "dist.recv(grad, group=pipeline, group_src=stage + 1)"})
    check_pipeline_3d(other.parallelize_3d, other.train_step_3d, **THREE_D)
    assert "equal one process's" in capsys.readouterr().out


@pytest.mark.parametrize("sizes, micro_batches, message", [
    (TransformerSizes(num_layers=3), 2, "num layers 3 is not divisible by pipeline parallel 2"),
    (SIZES, 3, "not divisible by num micro batches 3"),
])
def test_3d_sizes_that_do_not_fit_are_refused(sizes, micro_batches, message):
    with pytest.raises(ValueError, match=message):
        nd.check_sizes_3d(sizes, (2, 2, 2), 8, micro_batches)
    with pytest.raises(ValueError, match=message):  # the check too, before any rank starts
        check_pipeline_3d(lambda *a: None, lambda *a: None, 8, sizes=sizes, num_micro_batches=micro_batches)


# ---------------------------------------------------------------- section 4: context parallel, (context, tensor)
# On the (2, 2) mesh (context and tensor groups differ from each other and from the world), one step.

CP = dict(world_size=4, num_steps=1)
CP_MISTAKES = {
    "RoPE at local positions": ({"    loss = lm_loss(model(inputs, positions), targets) / tensor_parallel":
                                 "    loss = lm_loss(model(inputs, torch.arange(len(positions))), targets) / "
                                 "tensor_parallel"}, "RoPE at local positions"),
    "the ring on the tensor group": ({"ring_attend(ra.RingAttention, positions, group=groups[\"context\"])":
                                      "ring_attend(ra.RingAttention, positions, group=groups[\"tensor\"])"},
                                     "ran on the tensor group: the ring belongs to the context group"),
    "the ring on the world": ({"ring_attend(ra.RingAttention, positions, group=groups[\"context\"])":
                               "ring_attend(ra.RingAttention, positions, group=dist.group.WORLD)"},
                              "ran on the world group: the ring belongs to the context group"),
    "the groups swapped in parallelize_2d": (
        {'return parallelize_2d(model, groups["tensor"], groups["context"])':
         'return parallelize_2d(model, groups["context"], groups["tensor"])'}, "FSDP's all-gathers ran on the tensor"),
    "the groups swapped in the sync": (
        {'sync_gradients_2d(model, shards, groups["tensor"], context)':
         'sync_gradients_2d(model, shards, context, groups["tensor"])'}, "FSDP's reduce-scatters of the gradients ran"),
    "the context group's mean taken twice": (
        {"    loss = lm_loss(model(inputs, positions), targets) / tensor_parallel":
         "    loss = lm_loss(model(inputs, positions), targets) / tensor_parallel / dist.get_world_size(context)"},
        "divided by C = 2 as well as by T: the context group's mean is taken once"),
    # students' list: on (2, 2) this doubled the gradients as a sum over the context group does, and was named so
    "the loss share not divided by T": (
        {"    loss = lm_loss(model(inputs, positions), targets) / tensor_parallel":
         "    loss = lm_loss(model(inputs, positions), targets)"}, "the loss share returned at the first step is "
        "\\S+, one process's \\S+: not divided by T"),
    "the sync's mean left out: a sum over the context group": (
        {"        grad /= data_parallel\n": ""}, "summed over the context group, not averaged"),
    # equal to the right answer on (2, 2): the check's second mesh, (4, 1), tells them apart
    "the loss share divided by C instead of T": (
        {"    loss = lm_loss(model(inputs, positions), targets) / tensor_parallel":
         "    loss = lm_loss(model(inputs, positions), targets) / dist.get_world_size(context)"},
        "on mesh \\(context, tensor\\) = \\(4, 1\\), .*divided by the context size C = 4 instead of the tensor "
        "size T = 1.*right on mesh \\(2, 2\\)"),
    "the chunks' positions counted by the tensor size": (
        {"    positions = ra.chunk_positions(model.sizes.seq_len, dist.get_world_size(context))[dist.get_rank(context)]":
         "    positions = ra.chunk_positions(model.sizes.seq_len, tensor_parallel)[dist.get_rank(context)]"},
        "on mesh \\(context, tensor\\) = \\(4, 1\\): train_step raised IndexError: list index out of range, at "
        "`positions = .*`: ra.chunk_positions\\(seq_len, C\\) has one chunk per CONTEXT rank"),
}


CP_SLOW = ("the sync's mean left out: a sum over the context group", "the chunks' positions counted by the tensor size",
           "the loss share divided by C instead of T")


@pytest.mark.parametrize("mistake", [pytest.param(m, marks=pytest.mark.slow) if m in CP_SLOW else m
                                     for m in CP_MISTAKES])
def test_cp_mistakes_are_named(mistake):
    replace, hint = CP_MISTAKES[mistake]
    wrong = solution(NAME, replace=replace)
    with pytest.raises(AssertionError, match=hint):
        check_context_parallel_nd(wrong.parallelize_cp, wrong.train_step_cp, **CP)


@pytest.mark.slow  # 3 s: two meshes; the notebook's run checks the solution itself
def test_cp_positions_by_hand_and_the_share_as_a_product_pass(capsys):
    """A right answer written another way: each context chunk's positions with torch.arange, not ra.chunk_positions;
    the loss share as a product; the ring's positions as a list."""
    other = solution(NAME, replace={
        '    positions = ra.chunk_positions(model.sizes.seq_len, dist.get_world_size(groups["context"]))\n':
        '    size, chunk = dist.get_world_size(groups["context"]), model.sizes.seq_len // dist.get_world_size('
        'groups["context"])\n    positions = [torch.arange(c * chunk, (c + 1) * chunk) for c in range(size)]\n',
        "    positions = ra.chunk_positions(model.sizes.seq_len, dist.get_world_size(context))[dist.get_rank(context)]":
        "    chunk = model.sizes.seq_len // dist.get_world_size(context)\n"
        "    positions = torch.arange(chunk) + dist.get_rank(context) * chunk",
        "    loss = lm_loss(model(inputs, positions), targets) / tensor_parallel":
        "    loss = lm_loss(model(inputs, positions), targets) * (1 / tensor_parallel)"})
    check_context_parallel_nd(other.parallelize_cp, other.train_step_cp, **CP)
    assert "equal one process's" in capsys.readouterr().out


@pytest.mark.parametrize("sizes, mesh, message", [
    (TransformerSizes(seq_len=6), (4, 1), "seq len 6 is not divisible by world size 4"),
    (TransformerSizes(seq_len=6), (2, 2), "not divisible by tensor parallel 2"),
])
def test_cp_sizes_that_do_not_fit_are_refused(sizes, mesh, message):
    with pytest.raises(ValueError, match=message):
        nd.check_sizes_cp(sizes, mesh, 4)
    if mesh == (2, 2):  # the check's own mesh on 4 ranks: it refuses too, before any rank starts
        with pytest.raises(ValueError, match=message):
            check_context_parallel_nd(lambda *a: None, lambda *a: None, 4, sizes=sizes)


@pytest.mark.slow  # 2 s; the notebook's stored run (strict nbval, default run) prints the same equalities
def test_pipeline_and_ring_bytes_at_the_calls_are_the_planners():
    """The planner's pp and cp terms against a live run's bytes handed to the sends (one step, 4 ranks): section
    3's (1, 2, 2) mesh and section 4's (2, 2)."""
    from utils import planner as pl
    from utils.launch import spawn

    right = solution(NAME)
    sizes = TransformerSizes(vocab_size=32, dim=16, num_heads=4, num_layers=2, ffn_dim=32, seq_len=16, batch_size=4)
    runs = spawn(nd.train_3d_main, 4, right.parallelize_3d, right.train_step_3d, sizes, (1, 2, 2), 2, 1)
    for run in runs:
        sent = sum(b for (group, op), (_, b) in run.counts.items() if group == "pipeline" and "send" in op)
        assert sent == pl.small_model_bytes(sizes, tp=2, pp=2, num_micro_batches=2, stage=run.coordinate[1],
                                            gathers_per_step=1)["pp"]
    runs = spawn(nd.train_cp_main, 4, right.parallelize_cp, right.train_step_cp, sizes, (2, 2), 1)
    for run in runs:
        sent = sum(b for (group, op), (_, b) in run.counts.items() if op == "isend")
        assert sent == pl.small_model_bytes(sizes, cp=2, tp=2, gathers_per_step=1)["cp"]


def test_the_agreement_lines_say_false_when_a_run_differs():
    """The notebook prints nd.agreement's verdicts against PyTorch (sections 2 and 3; strict nbval keeps them True):
    they must be able to say False, for the weights, for the losses, and between the runs."""
    import torch

    want, want_losses = {"w": torch.zeros(3)}, [1.0, 0.5]
    off = {"w": torch.tensor([0.0, 1e-9, 0.0])}
    text = nd.agreement({"ours": (want, want_losses), "PyTorch's": (off, want_losses)}, want, want_losses)
    assert text.splitlines() == [
        "     ours: losses and weights against one process: largest difference below 1e-12: True",
        "PyTorch's: losses and weights against one process: largest difference below 1e-12: False",
        "ours against PyTorch's: weights' largest difference below 1e-12: False"]
    assert "False" in nd.agreement({"ours": (want, [1.0, 0.5 + 1e-9])}, want, want_losses)
    assert nd.slowest_steps([[9.0, 1.0, 2.0, 3.0], [9.0, 4.0, 5.0, 6.0]]) == [4.0, 5.0, 6.0]  # the 1st left out
