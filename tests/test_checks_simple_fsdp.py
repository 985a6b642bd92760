"""utils.checks.simple_fsdp (notebook 07): the solution passes; each plausible wrong answer fails at its exercise's
own check, with a message that names the mistake. Right answers come from the solution notebook; each wrong one is
a small edit of it (utils.notebooks.solution)."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from utils import pytorch_reference, simple_fsdp
from utils.checks.simple_fsdp import check_data_parallel, check_redistribute, check_reshard, check_units
from utils.launch import spawn
from utils.model import Sizes
from utils.notebooks import solution

HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS = 8, 3, 4, 2
SIZES = (2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)
SOL = solution("07_simple_fsdp")


def edited(replace):
    return solution("07_simple_fsdp", replace=replace)


# ---------------------------------------------------------------- they pass

# natural right answers written another way: the mean as ReduceOp.AVG, the gradient divided before the
# reduce-scatter, the parametrization registered as a safe one (its forward gives the whole parameter's shape), the
# views made with reshape, the weight gathered again with Unshard and viewed with torch.as_strided, the flat shard
# copied into a new buffer (the solution itself passes in the notebook, under nbval)
OTHER_WAY = edited({"        dist.all_reduce(summed)\n        return summed / dist.get_world_size()\n":
    "        dist.all_reduce(summed, op=dist.ReduceOp.AVG)\n        return summed\n",
    "simple_fsdp.pad_rows(grad, world_size * k).contiguous())":
    "simple_fsdp.pad_rows(grad / world_size, world_size * k).contiguous())",
    "    return mine[:simple_fsdp.local_rows(rows, rank, world_size)] / world_size":
    "    return mine[:simple_fsdp.local_rows(rows, rank, world_size)]",
    "parametrization, unsafe=True)": "parametrization)",
    "setattr(*self.owner(name), piece.view(shape))":
    "setattr(*self.owner(name), piece.reshape(shape))",
    "    return all_gather_rows(shard, rows).as_strided(size, stride, offset)\n":
    "    return torch.as_strided(Unshard.apply(shard, rows), size, stride, storage_offset=offset)\n",
    "        self.flat_shard = nn.Parameter(simple_fsdp.local_shard(flat, dist.get_rank(), dist.get_world_size())"
    ".clone())\n":
    "        mine = simple_fsdp.local_shard(flat, dist.get_rank(), dist.get_world_size())\n"
    "        self.flat_shard = nn.Parameter(torch.empty_like(mine).copy_(mine))\n"})


def test_right_answers_pass(capsys):
    check_redistribute(SOL.redistribute, 2)
    check_data_parallel(OTHER_WAY.data_parallel, *SIZES)
    units = check_reshard(OTHER_WAY.data_parallel, OTHER_WAY.reshard_after_forward, *SIZES)
    rows = check_units(OTHER_WAY.FlatUnit, 2, HIDDEN_DIM, 2, BATCH_SIZE, NUM_STEPS)
    assert [rows[unit][0] for unit in ("layer", "pair", "model")] == [4, 2, 2]
    out = capsys.readouterr().out
    assert "DTensor's redistribute" in out and "FSDP2" in out and "awkward" in out
    assert units == {"resharded": {"forward": 1, "backward": 1}, "kept": {"forward": NUM_LAYERS - 1,
                                                                           "backward": NUM_LAYERS - 1}}


def test_a_list_all_gather_put_together_is_one_unit():
    """dist.all_gather into a list of pieces, then torch.cat: as right as one flat buffer, and one unit."""
    listed = edited({"    padded = torch.empty((world_size * k, *shard.shape[1:]), dtype=shard.dtype)\n"
                     "    dist.all_gather_single(padded, simple_fsdp.pad_rows(shard, k).contiguous())\n"
                     "    return padded[:rows]":
                     "    pieces = [torch.empty((k, *shard.shape[1:]), dtype=shard.dtype) for _ in range(world_size)]\n"
                     "    dist.all_gather(pieces, simple_fsdp.pad_rows(shard, k).contiguous())\n"
                     "    return torch.cat(pieces)[:rows]"})
    units = check_reshard(listed.data_parallel, listed.reshard_after_forward, 4, *SIZES[1:])
    assert units["resharded"] == {"forward": 1, "backward": 1}


# ---------------------------------------------------------------- bad input, before any rank starts

def test_bad_input_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="mode must be one of"):
        simple_fsdp.check_mode("zero3")
    with pytest.raises(ValueError, match="mesh of 2 ranks does not match the world of 4"):
        simple_fsdp.check_mesh(2, 4)
    model = nn.Linear(2, 2)
    model.scale = nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match="'scale' is a scalar"):
        simple_fsdp.check_shardable(model)
    with pytest.raises(ValueError, match="batch size 5 .* world size 2"):
        check_data_parallel(SOL.data_parallel, 2, HIDDEN_DIM, NUM_LAYERS, 5, NUM_STEPS)
    with pytest.raises(ValueError, match="mode must be one of"):
        SOL.data_parallel(nn.Linear(2, 2), "ddp")
    with pytest.raises(ValueError, match="num_layers must be even"):
        check_units(SOL.FlatUnit, 2, HIDDEN_DIM, 3, BATCH_SIZE, NUM_STEPS)


def test_shards_follow_torch_chunk():
    whole = torch.arange(7.0)
    assert [simple_fsdp.local_shard(whole, r, 3).tolist() for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [simple_fsdp.local_rows(3, r, 4) for r in range(4)] == [1, 1, 1, 0]
    assert simple_fsdp.original_name("a.parametrizations.weight.original") == "a.weight"


def test_redistribute_refuses_what_it_does_not_move():
    """A ValueError naming the move, before any collective (no process group needed): a Partial that is not a sum
    (DTensor's Partial("max") is the max over the ranks), a scalar's Shard, Shard(-1) of a 2-D tensor (Shard(1))."""
    for op in ("max", "min", "avg", "product"):
        with pytest.raises(ValueError, match=f'Partial\\("{op}"\\) -> Replicate\\(\\).*a Partial\\(\\) here is a sum'):
            SOL.redistribute(torch.ones(5, 3), Partial(op), Replicate(), (5, 3))
        with pytest.raises(ValueError, match=f'Partial\\("{op}"\\) -> Shard\\(0\\).*the {op} over the ranks'):
            SOL.redistribute(torch.ones(5, 3), Partial(op), Shard(0), (5, 3))
    with pytest.raises(ValueError, match="Shard\\(0\\) of a tensor of shape \\(\\).*a scalar cannot be sharded"):
        SOL.redistribute(torch.tensor(1.0), Partial(), Shard(0), ())
    with pytest.raises(ValueError, match="Replicate\\(\\) -> Shard\\(1\\) of a tensor of shape \\(5, 3\\) is not"):
        SOL.redistribute(torch.ones(5, 3), Replicate(), Shard(-1), (5, 3))
    with pytest.raises(ValueError, match="Shard\\(-3\\) of a tensor of shape \\(5, 3\\), which has dims -2 to 1"):
        SOL.redistribute(torch.ones(5, 3), Shard(-3), Replicate(), (5, 3))
    with pytest.raises(ValueError, match="Replicate\\(\\) -> Partial\\(\\).*the moves here"):
        SOL.redistribute(torch.ones(5, 3), Replicate(), Partial(), (5, 3))
    with pytest.raises(TypeError, match="dst must be a placement"):
        SOL.redistribute(torch.ones(5, 3), Replicate(), "Shard(0)", (5, 3))
    assert simple_fsdp.check_move(Shard(-2), Replicate(), (5, 3)) == (Shard(0), Replicate())
    assert simple_fsdp.check_move(Partial(), Shard(-1), (5,)) == (Partial(), Shard(0))
    assert simple_fsdp.check_move(Partial("max"), Partial("max"), ()) == (Partial("max"), Partial("max"))


def _from_end(placement, shape):
    return Shard(placement.dim - len(shape)) if placement.is_shard() else placement


def _values(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(-100, 100, shape, generator=generator, dtype=dtype)


def against_dtensor_main(rank, world_size, redistribute):
    """The cases where `redistribute` and DTensor's differ on this rank (values bit for bit, dtype, contiguous where
    DTensor's is, collectives and bytes): every move, Shard(0) also written from the end, 1-D to 3-D, uneven rows and
    ranks with none, local tensors stored column-major, float32, float64 and int64; and a scalar's Partial()."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh, n = init_device_mesh("cpu", (world_size,)), world_size
    shapes = [(1,), (n + 1,), (2 * n + 1, 3), (max(1, n - 1), 2), (2, 2, 3), (2 * n + 1, 2, 3)]
    cases = [((), Partial(), Replicate(), False)]
    for shape in shapes:
        for src, dst in simple_fsdp.MOVES:
            cases += [(shape, src, dst, False), (shape, _from_end(src, shape), _from_end(dst, shape), len(shape) > 1)]
    differ = []
    for dtype in (torch.float32, torch.float64, torch.int64):
        for shape, src, dst, column_major in cases:
            local = _values(shape, dtype, rank if src.is_partial() else n + 1)
            local = simple_fsdp.local_shard(local, rank, n).clone() if src.is_shard() else local
            local = local.mT.contiguous().mT if column_major else local
            with simple_fsdp.record_collectives() as ours_log:
                ours = redistribute(local.clone(), src, dst, shape)
            with simple_fsdp.record_collectives() as theirs_log:
                theirs = pytorch_reference.dtensor_redistribute(local.clone(), src, dst, shape, mesh)
            if (ours.dtype != theirs.dtype or not torch.equal(ours, theirs) or ours_log != theirs_log
                    or (theirs.is_contiguous() and not ours.is_contiguous())):
                differ.append((str(src), str(dst), shape, column_major, str(dtype)))
    return differ, len(cases) * 3


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow),
                                        pytest.param(2, marks=pytest.mark.slow),
                                        3, 4])  # 3: rows that do not divide; 4: the notebook's
def test_redistribute_is_dtensors(world_size):
    """The solution's redistribute equals DTensor's, bit for bit, with the same collectives, over a case matrix."""
    for differ, tried in spawn(against_dtensor_main, world_size, SOL.redistribute):
        assert tried == 3 * 49 and differ == []


def counting_main(rank, world_size):
    """record_collectives sees torch.distributed calls and functional collectives alike, with the input's bytes."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    with simple_fsdp.record_collectives() as log:
        out = torch.empty(world_size * 3)
        dist.all_gather_single(out, torch.ones(3))
        funcol.reduce_scatter_single(torch.ones(world_size * 2), "sum", 0, dist.group.WORLD).wait()
    return [str(c) for c in log]


def test_record_collectives_names_both_kinds():
    assert spawn(counting_main, 2)[0] == ["all-gather of 12 bytes", "reduce-scatter of 16 bytes"]


# min_cut: under pytest -m slow, since notebook 07's own run (section 5, strict nbval in the default run) compiles
# with it and compares what backward saved and captured (bucketed there); 15 s of compiling on 2 ranks
@pytest.mark.parametrize("partition, saves_whole_weights", [pytest.param("min_cut", False, marks=pytest.mark.slow),
                                                            ("default", True)])
def test_compiled_the_gathers_are_recomputed_not_saved(partition, saves_whole_weights):
    """Notebook 07, section 5: with the min-cut partitioner the forward saves no gathered (whole) weight for backward
    and the backward gathers again; aot_eager's default partitioner ignores the recomputation tags and saves some."""
    sizes = Sizes(HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS, 0)
    whole = (HIDDEN_DIM, HIDDEN_DIM)
    eager, compiled, graphs, same = spawn(simple_fsdp.compiled_main, 2, sizes, partition=partition)[0]
    backward = next(graph for graph in graphs if graph.kind == "backward")
    assert compiled == eager and same
    assert (whole in backward.saved) == saves_whole_weights, backward.saved
    assert ("all_gather_into_tensor" in backward.captured) != saves_whole_weights, backward.captured


# ---------------------------------------------------------------- they fail, saying why

CHECK_MOVE = ("    src, dst = simple_fsdp.check_move(src, dst, shape)  # Shard(-1) is Shard(ndim - 1); other moves: "
              "ValueError\n")
R_TO_SHARD = "        return simple_fsdp.local_shard(local, rank, world_size).clone()\n"
SUM_ON = "local.clone(memory_format=torch.contiguous_format)  # gloo sums in memory order: DTensor's bits"
REDISTRIBUTE = [
    # torch.chunk for this rank's rows: fewer pieces than ranks when there are fewer rows
    ({R_TO_SHARD: "        return local.chunk(world_size)[rank].clone()\n"},
     "torch.chunk gives fewer than N pieces .* IndexError"),
    ({"        dist.all_gather_single(padded, simple_fsdp.pad_rows(local, k).contiguous())\n"
      "        return padded[:rows]":
      "        dist.all_gather_single(padded, simple_fsdp.pad_rows(local, k).contiguous())\n        return padded"},
     "Shard\\(0\\) -> Replicate\\(\\).*the padding rows were not dropped"),
    ({"        dist.all_reduce(summed)\n        return summed\n":
      "        dist.all_reduce(summed)\n        return summed / world_size\n"},
     "Partial\\(\\) -> Replicate\\(\\).*it is the mean over the ranks"),
    ({"        mine = torch.empty((k, *shape[1:]), dtype=local.dtype)\n"
      "        dist.reduce_scatter_single(mine, simple_fsdp.pad_rows(local, world_size * k).contiguous())\n":
      "        mine = local.clone()\n        dist.all_reduce(mine)\n        mine = simple_fsdp.local_shard(mine, rank, "
      "world_size)\n"},
     "Partial\\(\\) -> Shard\\(0\\).*issued all-reduce of .* bytes; DTensor's redistribute issues reduce-scatter"),
    ({"        dist.all_reduce(summed)\n        return summed\n": "        return summed\n"},
     "Partial\\(\\) -> Replicate\\(\\).*never summed over the ranks"),
    ({R_TO_SHARD: "        return local\n"},
     "Replicate\\(\\) -> Shard\\(0\\).*it has all 5 rows: Shard\\(0\\) keeps only this rank.s rows"),
    ({"dist.all_gather_single(padded, simple_fsdp.pad_rows(local, k).contiguous())":
      "dist.all_gather_single(padded, local.contiguous())"},
     "redistribute failed on 2 ranks \\(uneven Shard\\(0\\) pieces: a collective needs equal pieces"),
    # the rows read before the move that needs none: a scalar (a summed loss) crashes
    ({"    ### BEGIN SOLUTION\n    if src.is_partial() and dst.is_replicate():":
      "    ### BEGIN SOLUTION\n    rows, k = shape[0], simple_fsdp.shard_rows(shape[0], world_size)\n"
      "    if src.is_partial() and dst.is_replicate():"},
     "a scalar, such as a summed loss, has shape \\(\\).*Partial\\(\\) -> Replicate\\(\\) of shape \\(\\): IndexError"),
    # the placements checked but not normalised: Shard(-2) is not Shard(0)
    ({CHECK_MOVE: "    simple_fsdp.check_move(src, dst, shape)\n"},
     "Shard\\(-2\\) of a 2-D tensor is Shard\\(0\\).*Shard\\(-2\\) -> Replicate\\(\\) of shape \\(5, 3\\)"),
    # no check of the move: a Partial("max") is summed
    ({CHECK_MOVE: ""},
     "Partial\\(\"max\"\\) -> Replicate\\(\\) of shape \\(5, 3\\) on rank 0 of 2 returned the sum over the ranks: "
     "a Partial\\(\"max\"\\)'s value is the max over the ranks"),
    # a guard of its own that refuses a Partial("max") but crashes on sharding a scalar
    ({CHECK_MOVE: "    if src.is_partial() and src.reduce_op != \"sum\":\n        raise ValueError(\"not a sum\")\n"},
     "Replicate\\(\\) -> Shard\\(0\\) of shape \\(\\) on rank 0 of 2 raised IndexError: .*; a move not made "
     "here is refused with a ValueError"),
    # the sum taken on a copy that keeps the local tensor's strides: not contiguous
    ({SUM_ON: "local.clone()"},
     "Partial\\(\\) -> Replicate\\(\\) of shape \\(5, 3\\), stored column-major on rank 0 of 2: the result is not "
     "contiguous"),
    # ... made contiguous after the sum: gloo summed in another order than DTensor (3 ranks: the last bits differ)
    ({SUM_ON: "local.clone()", "        dist.all_reduce(summed)\n        return summed\n":
      "        dist.all_reduce(summed)\n        return summed.contiguous()\n"},
     "Partial\\(\\) -> Replicate\\(\\) of shape \\(7, 3\\), stored column-major on rank 0 of 3: equal to DTensor's "
     "result only to .*, not bit for bit"),
    # this rank's rows, a view of the local tensor: its strides too (DTensor's last, uneven, shard is contiguous)
    ({R_TO_SHARD: "        return simple_fsdp.local_shard(local, rank, world_size)\n"},
     "Replicate\\(\\) -> Shard\\(0\\) of shape \\(7, 3\\), stored column-major on rank 2 of 3: the result is not "
     "contiguous"),
]

DATA_PARALLEL = [
    # the gradient reduce-scattered without padding: uneven rows on 3 ranks
    ({"dist.reduce_scatter_single(mine, simple_fsdp.pad_rows(grad, world_size * k).contiguous())":
      "dist.reduce_scatter_single(mine, grad.contiguous())"},
     "data_parallel failed on 3 ranks \\(uneven Shard\\(0\\) pieces: a collective needs equal pieces, so pad each "
     "shard to k = ceil\\(rows / N\\) rows"),
    ({"    return mine[:simple_fsdp.local_rows(rows, rank, world_size)] / world_size":
      "    return mine[:simple_fsdp.local_rows(rows, rank, world_size)]"},
     "mode='fully_shard'.*2 times too large: the sum over ranks, not the mean"),
    ({"    dist.reduce_scatter_single(mine, simple_fsdp.pad_rows(grad, world_size * k).contiguous())\n":
      "    mine = simple_fsdp.pad_rows(grad, world_size * k)[rank * k:(rank + 1) * k]\n"},
     "mode='fully_shard'.*issued 3 all-gather\\(s\\), 0 reduce-scatter\\(s\\), 0 all-reduce\\(s\\); expected 3 "
     "all-gather\\(s\\), 3 reduce-scatter"),
    ({"    mine = torch.empty((k, *grad.shape[1:]), dtype=grad.dtype)\n"
      "    dist.reduce_scatter_single(mine, simple_fsdp.pad_rows(grad, world_size * k).contiguous())\n":
      "    summed = grad.clone()\n    dist.all_reduce(summed)\n"
      "    mine = simple_fsdp.pad_rows(summed, world_size * k)[rank * k:(rank + 1) * k]\n"},
     "mode='fully_shard'.*issued 3 all-gather\\(s\\), 0 reduce-scatter\\(s\\), 3 all-reduce"),
    ({"        dist.all_reduce(summed)\n        return summed / dist.get_world_size()\n":
      "        dist.all_reduce(summed)\n        return summed\n"},
     "mode='replicate'.*2 times too large"),
    ({"        for name, param in list(module.named_parameters(recurse=False)):\n":
      "        for name, param in list(module.named_parameters(recurse=False)):\n"
      "            if not param.requires_grad:\n                continue\n"},
     "keeps its whole parameter as 'frozen.weight'.*a frozen parameter is sharded too"),
    ({"        for name, param in list(module.named_parameters(recurse=False)):\n":
      "        for name, param in list(module.named_parameters(recurse=False)):\n"
      "            if name != \"weight\":\n                continue\n"},
     "the awkward .*keeps its whole parameter as 'gate'"),
    ({"    return mine[:simple_fsdp.local_rows(rows, rank, world_size)] / world_size": "    return mine / world_size"},
     "data_parallel failed on 3 ranks \\(uneven Shard\\(0\\) pieces"),
]

# a sum taken in float32: cast back or not, the values keep only float32's precision; this rank's rows put in place,
# the others never gathered
REDISTRIBUTE += [
    ({"        dist.all_gather_single(padded, simple_fsdp.pad_rows(local, k).contiguous())\n":
      "        padded.zero_()[rank * k:rank * k + local.shape[0]] = local\n"},
     "Shard\\(0\\) -> Replicate\\(\\) of shape \\(5, 3\\) on rank 0 of 2: wrong local tensor; it differs by up to .*, "
     "first in row 3, which rank 1's Shard\\(0\\) held: every rank's rows must arrive"),
    ({SUM_ON: "local.float().contiguous()"},
     "Partial\\(\\) -> Replicate\\(\\) of shape \\(5, 3\\) on rank 0 of 2: wrong local tensor; it is torch.float32, "
     "the local tensor torch.float64: move a tensor in its own dtype"),
    ({SUM_ON: "local.float().contiguous()", "        dist.all_reduce(summed)\n        return summed\n":
      "        dist.all_reduce(summed)\n        return summed.double()\n"},
     "Partial\\(\\) -> Replicate\\(\\) of shape \\(5, 3\\) on rank 0 of 2: wrong local tensor; it differs by up to .* "
     "and every value of it is a float32: it was cast to float32 on the way"),
]

# issue 43: rows // N rows a rank (floor), not torch.chunk's ceil: the last rows are never handed out
REDISTRIBUTE += [
    ({R_TO_SHARD: "        f = shape[0] // world_size\n        return local[rank * f:(rank + 1) * f].clone()\n"},
     "Replicate\\(\\) -> Shard\\(0\\) of shape \\(5, 3\\) on rank 0 of 2: wrong local tensor; it has 2 rows, 3 "
     "expected: Shard\\(0\\) gives each rank ceil\\(rows / N\\) = 3 rows, as torch.chunk does .* not rows // N = 2: "
     "with 2 rows a rank, row 4 of 5 was never handed out"),
]

RESHARD = [
    # every saved tensor packed as a gathered weight's source, the input and activations too
    ({"    if source is None:\n        return t\n    return source, t.size()": "    return source, t.size()"},
     "with reshard_after_forward failed on 2 ranks \\(unpack_gathered got \\(None, ...\\): pack_gathered kept a "
     "source for a tensor that is not a gathered weight"),
    ({"    if source is None:\n        return t\n    return source, t.size(), t.stride(), t.storage_offset()\n":
      "    return t\n"},
     "up to 2 gathered units were alive at once in step 0's forward.*pack it as its shard"),
    ({"    return source, t.size(), t.stride(), t.storage_offset()\n":
      "    return source, t.size(), t.stride(), t.storage_offset(), t\n",
      "    (shard, rows), size, stride, offset = kept\n": "    (shard, rows), size, stride, offset, _ = kept\n"},
     "up to 2 gathered units were alive at once"),
    ({"    return source, t.size(), t.stride(), t.storage_offset()\n": "    return t.detach().clone()\n"},
     "step 0 issued 3 all-gather\\(s\\).*expected 5 all-gather"),
    ({"    return all_gather_rows(shard, rows).as_strided(size, stride, offset)\n":
      "    return all_gather_rows(shard, rows)\n"},
     "reshard_after_forward on 2 ranks, the mlp.*not its part of the whole batch's gradient.*look at unpack_gathered"),
    # the view rebuilt without its storage offset: right for every view that starts the weight (W.T), wrong for the
    # second half of a fused weight
    ({"    return all_gather_rows(shard, rows).as_strided(size, stride, offset)\n":
      "    return all_gather_rows(shard, rows).as_strided(size, stride)\n"},
     "reshard_after_forward on 2 ranks, the fused model .* at storage offset 64\\) is rebuilt at offset 0, from its "
     "first half: unpack_gathered left out the storage offset"),
    # the gathered weight transposed: the view x @ W.T saves for a square W, and no other (about 1 s: slow)
    pytest.param({"    return all_gather_rows(shard, rows).as_strided(size, stride, offset)\n":
                  "    return all_gather_rows(shard, rows).T\n"},
                 "failed on 2 ranks \\(on the fused model, right with the MLP .* unpack_gathered must rebuild that "
                 "very view", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("replace, match", REDISTRIBUTE)
def test_wrong_redistribute_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        check_redistribute(edited(replace).redistribute, 2)


@pytest.mark.parametrize("replace, match", DATA_PARALLEL)
def test_wrong_data_parallel_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        check_data_parallel(edited(replace).data_parallel, *SIZES)


@pytest.mark.parametrize("replace, match", RESHARD)
def test_wrong_reshard_fails(replace, match):
    wrong = edited(replace)
    with pytest.raises(AssertionError, match=match):
        check_reshard(wrong.data_parallel, wrong.reshard_after_forward, *SIZES)

UNITS = [
    # the module keeps its own parameters beside the flat shard
    ({"        for name in self.names:\n            delattr(*self.owner(name))\n"
      "        ### END SOLUTION\n\n    def owner": "        ### END SOLUTION\n\n    def owner"},
     "FlatUnit failed on 2 ranks \\(the module still has its own parameters.*cannot assign"),
    ({"        out = self.module(*args)\n        for name in self.names:\n            delattr(*self.owner(name))\n":
      "        out = self.module(*args)\n"}, "still alive after step 0's backward: the views set on the module"),
    ({"        self.flat_shard = nn.Parameter(simple_fsdp.local_shard(flat, dist.get_rank(), dist.get_world_size())"
      ".clone())": "        self.flat_shard = nn.Parameter(flat.clone())"},
     "FlatUnit failed on 2 ranks \\(.*flat_shard must be this rank's shard.*invalid gradient"),
    ({"zip(self.names, self.shapes, flat.split(self.numels))":
      "zip(self.names[::-1], self.shapes, flat.split(self.numels))"},
     "the flat shards put together hold values off by .* Before the first step each rank held its rows .* look at "
     "forward, where each parameter must be set from its own piece of the gathered buffer"),
    ({"        flat = Unshard.apply(self.flat_shard, sum(self.numels))":
      "        flat = Unshard.apply(self.flat_shard.detach(), sum(self.numels))"},
     "FlatUnit failed on 2 ranks \\(all-gather self.flat_shard itself, not a detached copy.*does not require grad"),
    # each piece set on the module as a new nn.Parameter: no gradient reaches the gathered buffer
    ({"setattr(*self.owner(name), piece.view(shape))": "setattr(*self.owner(name), nn.Parameter(piece.view(shape)))"},
     "step 0 issued no reduce-scatter: Unshard's backward never ran, so no gradient reached flat_shard"),
    # the flat shard kept as a view of the whole flat buffer: every rank keeps the whole unit
    ({"simple_fsdp.local_shard(flat, dist.get_rank(), dist.get_world_size()).clone())":
      "simple_fsdp.local_shard(flat, dist.get_rank(), dist.get_world_size()))"},
     "rank 0's 'layers.0.flat_shard' is a view of the whole flat buffer: its storage holds 512 bytes for its own 256, "
     "so every rank keeps the whole unit in memory"),
    # every rank keeps rank 0's rows of the flat buffer
    ({"simple_fsdp.local_shard(flat, dist.get_rank(), dist.get_world_size())":
      "simple_fsdp.local_shard(flat, 0, dist.get_world_size())"},
     "before the first step, rank 1's '.*flat_shard' is not its Shard\\(0\\) rows .*: it holds rank 0's rows"),
]


@pytest.mark.parametrize("replace, match", UNITS)
def test_wrong_flat_unit_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        check_units(edited(replace).FlatUnit, 2, HIDDEN_DIM, 2, BATCH_SIZE, NUM_STEPS)
