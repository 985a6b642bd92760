"""Checks for notebook 12 (parallelisms composed on one mesh).

check_mesh_position: a rank's coordinates and groups, computed from its rank alone, against the groups
`init_device_mesh` builds on the ranks (every shape of the world's size given), and against DeviceMesh's layout for
other shapes, so that an answer right for (2, 2, 2) only fails. A wrong answer is named when one of the usual
mistakes, recomputed, gives exactly its values.

check_fsdp_tensor_parallel: the course's transformer trained on a (data, tensor) mesh with the student's
parallelize and sync_gradients. First the groups each collective ran on (tensor parallel on the tensor group, FSDP on
the data group), then the first step's gradient shards against one process's, a wrong one named when a usual
mistake recomputed from the ranks' own gradients explains it, then losses and weights after several AdamW steps
against one process's (utils.transformer.train_transformer_reference, float64, 1e-12), on several meshes. A sync
right in values but not in kind or order (an all-reduce where FSDP reduce-scatters, the tensor group's all-reduce
before the reduce-scatter) is named with its bytes.

check_pipeline_3d: a first step on (2, 2, 1) (4 ranks), where the pipeline neighbour is 1 rank away, then the world's
(data, pipeline, tensor) mesh: every send and receive to a pipeline neighbour and of a micro-batch's hidden states'
shape, every collective on its group, the calls counted, each stage's forwards and backwards in 1F1B's order, the
gradient shards, losses and weights against one process. The order is then shown by the values too (as 04's and 11's
schedules: checks.pipeline's chained run): one more first step on (2, 2, 1) with every layer of each stage scaled by
a running state of its rank that each forward and backward reads and sets, against each data rank's 1F1B tables
played in one process (chained_3d_gradients); a record of the order edited to read as 1F1B's does not pass it.

check_context_parallel_nd: the (context, tensor) mesh (2, 2), then (4, 1) for one step, where C and T differ: the
ring on the context group, the calls counted, RoPE's positions, each rank's loss share, the gradient shards, losses
and weights against one process. An error raised inside the student's functions is said with the student's line.
"""
import math
import tempfile

import torch
import torch.distributed as dist

from utils import fsdp
from utils import nd_parallel as nd
from utils.checks import CHECK_TIMEOUT, close, confirmed, max_abs_diff
from utils.launch import RankError, runnable_world_sizes, spawn, under_torchrun
from utils.transformer import TransformerSizes, build_transformer, lm_loss, make_tokens, train_transformer_reference

def _raise_composition_mistake(error, where):
    """A rank's CompositionMistake (a call refused, or a library's error said where the student's code caused it)
    raised here as an AssertionError `where: ...`; any other RankError as it is."""
    if "CompositionMistake" in error.summary:
        raise AssertionError(f"{where}: " + error.summary.split("CompositionMistake: ", 1)[-1]) from None
    raise error


# ---------------------------------------------------------------- section 1: the mesh

RANK_SHAPES = {8: [(2, 2, 2), (1, 2, 4), (4, 2), (2, 4, 1)], 4: [(1, 2, 2), (2, 2), (4, 1, 1)], 2: [(1, 1, 2), (2, 1)]}
LAYOUT_SHAPES = [(2, 2, 1), (1, 2, 4), (4, 2), (2, 3, 2), (3, 1, 2), (6,)]  # DeviceMesh's layout, on one process


def _device_mesh_main(rank, world_size, shapes):
    found = [nd.device_mesh_groups(shape, nd.MESH_3D[-len(shape):] if len(shape) < 3 else nd.MESH_3D)
             for shape in shapes]
    dist.barrier()  # every rank has finished connecting its groups before any returns and hangs up
    return found


def _strides(shape):
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def _position(rank, shape, strides):
    """Coordinates and groups as a mesh with these strides lays ranks out."""
    coordinates = tuple(rank // stride % size for stride, size in zip(strides, shape))
    groups = [[rank + (k - c) * stride for k in range(size)] for c, stride, size in zip(coordinates, strides, shape)]
    return coordinates, groups


def _groups(rank, coordinates, shape, strides):
    """Each dimension's group as the right formula builds it from these coordinates (right or not)."""
    return [[rank + (k - c) * stride for k in range(size)] for c, stride, size in zip(coordinates, strides, shape)]


def _coordinate_mistakes(rank, shape):
    """(coordinates, the strides its groups step by, hint) of each usual mistake in the coordinates or strides."""
    strides = _strides(shape)
    next_size = [shape[i + 1] if i + 1 < len(shape) else 1 for i in range(len(shape))]
    own_size = [math.prod(shape[i:]) for i in range(len(shape))]
    return [(tuple(rank // stride for stride in strides), strides, "coordinate i is rank // stride_i % size_i: "
             "without the % size_i, a dimension after the first counts past its size"),
            (tuple(rank % size for size in shape), strides, "rank % size_i is the last dimension's coordinate only: "
             "divide by the stride first, rank // stride_i % size_i"),
            (_position(rank, shape, next_size)[0], next_size, "dimension i's stride is the product of ALL the sizes "
             "after it, not the next size alone"),
            (_position(rank, shape, own_size)[0], own_size, "dimension i's stride is the product of the sizes AFTER "
             "it, not from it (the last dimension's stride is 1)")]


def _mesh_mistakes(rank, shape):
    """(coordinates, groups, hint) of each usual mistake, for this rank and shape."""
    row_major = _strides(shape)
    column_major = [math.prod(shape[:i]) for i in range(len(shape))]
    coordinates, groups = _position(rank, shape, row_major)
    world = math.prod(shape)
    by_one = [[rank + (k - c) for k in range(size)] for c, size in zip(coordinates, shape)]
    others = [[r for r in group if r != rank] for group in groups]
    short = [group[:-1] for group in groups]
    complement = [[r for r in range(world) if _position(r, shape, row_major)[0][i] == c]
                  for i, c in enumerate(coordinates)]
    consecutive = [[rank - rank % size + k for k in range(size)] for size in shape]
    mistakes = [(*_position(rank, shape, column_major), "column-major order: the first coordinate varies fastest; "
                 "init_device_mesh lays ranks out row-major (torch.arange(W).view(shape)): the LAST coordinate varies "
                 "fastest, stride of dimension i = product of the sizes after it"),
                (*_position(rank, shape, row_major[::-1]), "the strides in reverse order: dimension i's stride is the "
                 "product of the sizes AFTER it (the last dimension's is 1)"),
                (coordinates, complement, "each group holds the ranks that SHARE this rank's coordinate in that "
                 "dimension; a group is the ranks that differ from it in that coordinate only (it varies, the others "
                 "stay fixed)"),
                (coordinates, consecutive, "each group is a run of consecutive ranks: only the last dimension's is; "
                 "dimension i's group steps by its stride"),
                (coordinates, by_one, "each group steps by 1 from this rank: dimension i's group steps by its stride, "
                 "rank + (k - c_i) · stride_i"),
                (coordinates, others, "each group leaves this rank out: a group holds every rank of its dimension, "
                 "this one too"),
                (coordinates, short, "each group stops one rank short: k runs over range(size_i), all size_i values "
                 "of the coordinate")]
    mistakes += [(c, _groups(rank, c, shape, strides), hint) for c, strides, hint in _coordinate_mistakes(rank, shape)]
    if len(shape) <= 3:
        mistakes.append((*_position(rank, shape, (4, 2, 1)[:len(shape)]), f"right for (2, 2, 2) only: strides 4, 2, "
                         f"1 written in; compute them from the shape {tuple(shape)}"))
    return mistakes


def _as_answer(answer):
    coordinates, groups = answer
    return tuple(int(c) for c in coordinates), [[int(r) for r in g] for g in groups]


def _mesh_problem(mesh_position, shape, truth, source):
    """The first rank whose answer is not `truth`'s (coordinates by rank, groups by rank), in words, or None. A
    mistake is named when it gives the answer's values on every rank of the shape."""
    answers = {}
    for rank in range(math.prod(shape)):
        try:
            answer = mesh_position(rank, shape)
        except Exception as e:  # raised in the student's code: said with its cause
            dims = (f": the shape {shape} has {len(shape)} dimension{'s' * (len(shape) != 1)}; loop over len(shape) "
                    f"(zip(strides, shape)), not a fixed 3" if isinstance(e, IndexError) else "")
            return f"mesh_position({rank}, {shape}) raised {type(e).__name__}: {e}{dims}"
        try:
            answers[rank] = _as_answer(answer)
        except (TypeError, ValueError) as e:
            return f"mesh_position({rank}, {shape}) returned something that is not (coordinates, groups): {e}"
    wrong = [rank for rank, got in answers.items() if got != truth[rank]]
    if not wrong:
        return None
    rank, got = wrong[0], answers[wrong[0]]
    where = f"mesh_position({rank}, {shape}) = {got}, but {source} gives {truth[rank]}"
    if all(a[0] == truth[r][0] and [sorted(g) for g in a[1]] == truth[r][1] for r, a in answers.items()):
        return (f"{where}: the same ranks in another order: list each group in increasing rank order (the order "
                f"of the coordinate that varies)")
    mistakes = {r: _mesh_mistakes(r, shape) for r in answers}
    fits = list(dict.fromkeys(mistakes[rank][i][2] for i in range(len(mistakes[rank]))
                              if all(mistakes[r][i][:2] == answers[r] for r in answers)))
    hint = fits[0] if len(fits) == 1 else (f"on this shape {len(fits)} mistakes give these values: "
                                          + "; OR ".join(fits)) if fits else None
    if hint is None and any(a[0] != truth[r][0] for r, a in answers.items()):  # the coordinates' mistake, whatever
        named = {r: _coordinate_mistakes(r, shape) for r in answers}
        hint = next((named[rank][i][2] for i in range(len(named[rank]))
                     if all(named[r][i][0] == answers[r][0] for r in answers)), None)
        hint = hint and f"the coordinates: {hint}"
    return where + (f": {hint}" if hint else "")


def _layout_truth(shape):
    """{rank: (coordinates, [its group in each dimension])} from DeviceMesh's layout."""
    coordinates, groups = nd.device_mesh_layout(shape)
    return {r: (c, [next(g for g in groups[i] if r in g) for i in range(len(shape))]) for r, c in coordinates.items()}


def check_mesh_position(mesh_position, world_size):
    """mesh_position(rank, shape) -> (coordinates, groups): equal to init_device_mesh's on the world's ranks for
    every shape of its size (RANK_SHAPES), and to DeviceMesh's layout for LAYOUT_SHAPES."""
    for n in runnable_world_sizes([world_size]):
        shapes = RANK_SHAPES.get(n, [(n,), (1, n)])
        on_ranks = spawn(_device_mesh_main, n, shapes, timeout=CHECK_TIMEOUT)
        for i, shape in enumerate(shapes):
            truth = {rank: (tuple(on_ranks[rank][i][0]), on_ranks[rank][i][1]) for rank in range(n)}
            assert truth == _layout_truth(shape), f"nd.device_mesh_layout is not init_device_mesh's for {shape}"
            problem = _mesh_problem(mesh_position, shape, truth, "init_device_mesh")
            if problem:
                raise AssertionError(problem)
    for shape in LAYOUT_SHAPES:
        problem = _mesh_problem(mesh_position, shape, _layout_truth(shape), "DeviceMesh's layout")
        if problem:
            raise AssertionError(problem)
    print(f"mesh_position: coordinates and groups equal init_device_mesh's on {n} ranks for "
          f"{', '.join(map(str, shapes))}, and DeviceMesh's layout for {', '.join(map(str, LAYOUT_SHAPES))}")


# ---------------------------------------------------------------- section 2: FSDP x tensor (and sequence) parallel

SIZES = TransformerSizes(vocab_size=32, dim=16, num_heads=4, num_layers=2, ffn_dim=32, seq_len=8, batch_size=4)
NUM_STEPS = 3


def meshes(world_size, sizes=SIZES):
    """The (data, tensor) meshes of `world_size` ranks the sizes allow, the most mixed first ((2, 2) on 4 ranks:
    each group then differs from the other and from the world)."""
    shapes = [(d, world_size // d) for d in range(1, world_size + 1) if world_size % d == 0]
    allowed = [s for s in shapes if sizes.batch_size % s[0] == 0 and sizes.num_heads % s[1] == 0
               and sizes.ffn_dim % s[1] == 0 and sizes.seq_len % s[1] == 0]
    return sorted(allowed, key=lambda s: abs(math.log(s[0] / s[1])))


def reference_gradients(sizes, seed=0):
    """One process's gradients at the first step, by name."""
    model, (inputs, targets) = build_transformer(sizes, seed), make_tokens(sizes, seed, 0)
    lm_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _expected_shard(grad, name, coordinate, data_parallel, tensor_parallel):
    d, t = coordinate
    return fsdp.shard(nd.tensor_shard(name, grad, t, tensor_parallel), d, data_parallel)


WRONG_GROUP = {
    ("tensor parallel", "data"): "the tensor-parallel collectives ran on the data group: the blocks' all-gathers "
                                 "and reduce-scatters along the sequence belong to the tensor group "
                                 "(tensor_sequence_parallel(model, tensor_group))",
    ("tensor parallel", "world"): "the tensor-parallel collectives ran on the whole world: they belong to the tensor "
                                  "group",
    ("unshard", "tensor"): "FSDP's all-gather ran on the tensor group: shard every parameter over the data group "
                           "(FlatShards(model, data_group))",
    ("unshard", "world"): "FSDP's all-gather ran on the whole world: shard over the data group",
    ("reduce-scatter", "world"): "FSDP's reduce-scatter ran on the whole world instead of the data group: the world "
                                 "holds different tensor-parallel shards (and chunks of the sequence), and a shard "
                                 "has 1/data, not 1/world, of each weight",
    ("reduce-scatter", "tensor"): "FSDP's reduce-scatter ran on the tensor group: it belongs to the data group, whose "
                                  "ranks hold copies of the same weights",
    ("all-reduce", "data"): "the whole weights' gradients were all-reduced on the data group: the reduce-scatter "
                            "already summed over it; they need a sum over the TENSOR group, whose ranks each saw "
                            "a chunk of the sequence",
    ("all-reduce", "world"): "the whole weights' gradients were all-reduced on the whole world: over the data group "
                             "the reduce-scatter already summed; all-reduce over the tensor group",
}


def _sync_problem(run, mesh):
    """The sync's collectives right in values but not in kind or order, in words with their bytes, or None: FSDP's
    reduce-scatter written as an all-reduce on the data group (a slice kept), or the tensor group's all-reduce of
    the whole weights made before the reduce-scatter (whole gradients, not shards)."""
    data_parallel, _ = mesh
    sync = [("reduce-scatter" if name.startswith("reduce_scatter") else "all-reduce" if name == "all_reduce" else name,
             group) for name, group in run.calls["sync"]]
    where = f"on mesh (data, tensor) = {mesh}, rank {run.coordinate}"
    counts = run.counts or {}
    if data_parallel > 1 and ("all-reduce", "data") in sync and ("reduce-scatter", "data") not in sync:
        handed = counts.get(("data", "all_reduce"), (0, 0))[1]
        ring = f"{2 * (data_parallel - 1) * handed // data_parallel} bytes" if handed else "2(D-1)/D of them"
        half = f"{(data_parallel - 1) * handed // data_parallel} bytes" if handed else "(D-1)/D"
        return (f"{where}: the gradients were all-reduced on the data group and a slice of them kept: FSDP's "
                f"reduce-scatter written as an all-reduce. The values are right, but every rank receives and holds "
                f"the whole gradient ({handed} bytes handed to the all-reduces), {data_parallel} times the shard it "
                f"keeps; on a ring an all-reduce sends {ring} per rank, a reduce-scatter half ({half}). Use a "
                f"reduce-scatter (dist.reduce_scatter_single into the shard): on gloo both cost an all-reduce "
                f"(notebook 01), on NCCL the reduce-scatter costs half")
    scatters = [i for i, call in enumerate(sync) if call == ("reduce-scatter", "data")]
    sums = [i for i, call in enumerate(sync) if call == ("all-reduce", "tensor")]
    if data_parallel > 1 and scatters and sums and sums[0] < scatters[0]:
        handed = counts.get(("tensor", "all_reduce"), (0, 0))[1]
        shards = sum(g.numel() * g.element_size() for name, g in (run.synced or {}).items()
                     if g is not None and not nd.sharded_over_tensor(name))
        total = sum(nbytes for (group, _), (_, nbytes) in counts.items() if group == "tensor")
        extra = f", +{100 * (handed - shards) / (total - handed + shards):.0f}% on the tensor group's step" \
            if shards and total else ""
        return (f"{where}: the whole weights' gradients were all-reduced over the tensor group BEFORE FSDP's "
                f"reduce-scatter: the values are right, but that all-reduce moves whole gradients ({handed} bytes "
                f"handed to it) where, after the reduce-scatter, it moves the shards ({shards} bytes, 1/{data_parallel}"
                f"{extra}). Reduce-scatter first, then all-reduce the shard")
    return None


def _error_hint(error):
    """What in sync_gradients caused the library's error `error` (a line of text), or ''."""
    if "outputShape[0] * worldSize == inputShape[0]" in error or "split" in error or "size" in error:
        return (": reduce_scatter_single's input must hold data-size times its output's elements: the input "
                "fsdp.flat_padded(p.grad, D) (the whole gradient flattened, padded to D shards), the output a tensor "
                "of the shard's size (torch.empty_like(shards[name]))")
    if "KeyError" in error:
        return ": shards is keyed by the names of model.named_parameters(), as they are"
    return ""


def _group_problem(run, mesh):
    """The first collective on a wrong group, in words (a hint when the groups differ on this mesh), or None."""
    sync = _sync_problem(run, mesh)
    if sync:
        return sync
    data_parallel, tensor_parallel = mesh
    used = [("tensor parallel", group) for phase in ("forward", "backward") for _, group in run.calls[phase]]
    used += [("unshard", group) for _, group in run.calls["unshard"]]
    used += [("reduce-scatter" if name.startswith("reduce_scatter") else "all-reduce" if name == "all_reduce"
              else name, group) for name, group in run.calls["sync"]]
    want = {"tensor parallel": "tensor", "unshard": "data", "reduce-scatter": "data", "all-reduce": "tensor"}
    for what, group in used:
        if group != want.get(what, group):
            return f"on mesh (data, tensor) = {mesh}, rank {run.coordinate}: " + WRONG_GROUP.get(
                (what, group), f"a {what} ran on the {group} group, expected the {want[what]} group")
    if "reduce-scatter" not in {w for w, _ in used} and data_parallel > 1:
        return (f"on mesh {mesh}, rank {run.coordinate}: sync_gradients made no reduce-scatter: each shard's gradient "
                f"is the data group's mean, reduce-scattered")
    return None


def _check_trained(got, got_losses, weights, losses, mesh, question=""):
    """After the run's steps, whose first step's gradients were right: its weights and losses against one process's
    (1e-12), an AssertionError saying which differ (and `question`) if they do not."""
    wrong = [name for name, w in weights.items() if not close(got[name], w)]
    ratio = {round(b / a, 9) for a, b in zip(got_losses, losses) if a}
    if not wrong and len(ratio) == 1 and (k := ratio.pop()) != 1 and k == round(k):
        raise AssertionError(f"on mesh {mesh}: the gradients and the weights are right, but the loss returned is 1/"
                             f"{k:.0f} of one process's at every step ({[round(x, 6) for x in got_losses]} against "
                             f"{[round(x, 6) for x in losses]}): the loss returned was divided again (each micro-"
                             f"batch's share is already divided by m; the ranks' shares add up): return their sum")
    if wrong or max(abs(a - b) for a, b in zip(got_losses, losses)) > 1e-12:
        raise AssertionError(f"on mesh {mesh}: the first step's gradients are right, but after {len(losses)} steps "
                             f"the losses {[round(x, 6) for x in got_losses]} (one process: "
                             f"{[round(x, 6) for x in losses]}) or the weights {wrong[:3]} differ{question}")


def _first_wrong_shard(runs, mesh, dims, grads, who, mistakes, names=None, plane=tuple):
    """The first step's first gradient shard, rank by rank, that differs from one process's, in words (with the hint
    of the first of `mistakes(run, name, want)`, (value, hint) pairs, that the shard confirms), or None. dims: the
    mesh's dimension names; names(run): the parameters a rank holds (all of `grads`); plane(coordinate): the rank's
    (data, tensor) coordinate."""
    data_parallel, tensor_parallel = mesh[0], mesh[-1]
    for run in runs:
        for name in (names(run) if names else grads):
            want = _expected_shard(grads[name], name, plane(run.coordinate), data_parallel, tensor_parallel)
            got = run.synced[name]
            where = f"on mesh ({', '.join(dims)}) = {mesh}, rank {run.coordinate}: the gradient of {name}'s shard"
            if got is None:
                return f"{where} is None: {who} must set shards[name].grad for every parameter the rank holds"
            if close(got, want):
                continue
            if got.shape != want.shape:
                return f"{where} has shape {tuple(got.shape)}, expected {tuple(want.shape)}: the shard's own shape " \
                       f"(1/{dims[0]} of this rank's parameter)"
            hint = confirmed(got, mistakes(run, name, want))
            return f"{where} differs from one process's by up to {max_abs_diff(got, want):.3g}" + (
                f": {hint}" if hint else "")
    return None


def _gradient_problem(runs, mesh, grads):
    return _first_wrong_shard(runs, mesh, ("data", "tensor"), grads, "sync_gradients",
                              lambda run, name, want: _gradient_mistakes(runs, run, name, want, mesh, grads))


def _gradient_mistakes(runs, run, name, want, mesh, grads):
    """(value, hint) of each usual mistake for this rank's shard of `name`, recomputed from the ranks' own
    gradients before the sync (run.unsynced) and one process's (`grads`)."""
    data_parallel, tensor_parallel = mesh
    d, t = run.coordinate
    world = data_parallel * tensor_parallel
    mine = [r for r in runs if r.coordinate[1] == t]  # this rank's data group: copies of the same tensor shard
    data_mean = fsdp.shard(sum(r.unsynced[name] for r in mine) / data_parallel, d, data_parallel)
    mistakes = []
    if not nd.sharded_over_tensor(name) and tensor_parallel > 1:
        if name.startswith("layers."):
            hint = ("the norms' gradients were not all-reduced over the tensor group: a norm's weight is whole on "
                    "every tensor rank, but under sequence parallel each rank's norm saw only its chunk of the "
                    "sequence, so its gradient is partial: sum it over the tensor group (the classic silent bug of "
                    "composed parallelism: the run trains, the norms drift)")
        else:
            hint = (f"{name}'s gradient was not summed over the tensor group: the embedding, the final norm and the "
                    f"LM head are whole on every tensor rank, each applied to the rank's chunk of the sequence, so "
                    f"each rank holds a part of the gradient")
        mistakes.append((data_mean, hint))
    if world != data_parallel and _scaled_everywhere(run, grads, mesh, data_parallel / world):
        which = f"the world size ({world})" if data_parallel > 1 else f"the world size or the tensor size ({world})"
        mistakes.append((want * data_parallel / world, f"divided by {which} instead of the data size "
                                                      f"({data_parallel}): the tensor ranks' shares add up, only "
                                                      f"the data group's copies are averaged"))
    if data_parallel > 1 and _scaled_everywhere(run, grads, mesh, data_parallel):
        mistakes.append((want * data_parallel, f"it is {data_parallel} times too large: the sum over the data group, "
                                               f"not its mean; divide by the data size"))
    if not nd.sharded_over_tensor(name) and tensor_parallel > 1:
        mistakes.append((want / tensor_parallel, f"the whole weights' gradients were averaged over the tensor group "
                                                 f"(divided by {tensor_parallel}): each tensor rank holds the part of "
                                                 f"its chunk of the sequence, and the parts add up: sum them"))
    if nd.sharded_over_tensor(name) and tensor_parallel > 1:
        same_place = [r for r in runs if r.coordinate[0] == d]
        total = sum(_expected_shard(grads[name], name, r.coordinate, data_parallel, tensor_parallel)
                    for r in same_place)
        mistakes.append((total, "a tensor-parallel shard's gradient was all-reduced over the tensor group: its rows "
                                "(columns) are different heads (features) on each tensor rank, and sequence "
                                "parallel's all-gather already brought every position's gradient: only the weights "
                                "whole on every tensor rank are summed"))
    return mistakes


def _scaled_everywhere(run, grads, mesh, factor):
    """Whether every shard's gradient on this rank is `factor` times one process's: a division wrong for all."""
    return all(run.synced[name] is not None and close(run.synced[name], factor * _expected_shard(
        grad, name, run.coordinate, *mesh)) for name, grad in grads.items())


def check_fsdp_tensor_parallel(parallelize, sync_gradients, world_size, sizes=SIZES, num_steps=NUM_STEPS,
                               mesh_shapes=None, seed=0):
    """Train on each (data, tensor) mesh (default: every one `world_size` ranks allow, (2, 2) first on 4): the
    collectives on their groups, the first step's gradient shards, then losses and weights after `num_steps` AdamW
    steps, against one process (1e-12)."""
    (n,) = runnable_world_sizes([world_size])
    mesh_shapes = meshes(n, sizes) if mesh_shapes is None or under_torchrun() else list(mesh_shapes)
    for mesh in mesh_shapes:
        nd.check_sizes_2d(sizes, *mesh, n)  # a ValueError names what does not split, before any rank starts
    grads = reference_gradients(sizes, seed)
    weights, losses = train_transformer_reference(sizes, num_steps, seed)
    passed = []
    for mesh in mesh_shapes:
        try:
            runs = spawn(nd.train_2d_main, n, parallelize, sync_gradients, sizes, *mesh, num_steps, seed,
                         timeout=CHECK_TIMEOUT)
        except RankError as e:
            _raise_composition_mistake(e, f"on mesh (data, tensor) = {mesh}")
        problem = next((p for run in runs if (p := _group_problem(run, mesh))), None) or next(
            (f"on mesh {mesh}, rank {run.coordinate}: {run.error.rstrip(' .')}{_error_hint(run.error)}" for run in runs
             if run.error), None) or \
            _gradient_problem(runs, mesh, grads)
        if problem and passed:
            problem += (f" (right on mesh {passed[0]}, wrong on {mesh}: is a size of one mesh written in? Take each "
                        f"group's from dist.get_world_size(group))")
        if problem:
            raise AssertionError(problem)
        passed.append(mesh)
        _check_trained(nd.full_weights(runs, {name: w.shape for name, w in weights.items()}, *mesh),
                       nd.global_losses(runs, mesh[0]), weights, losses, mesh,
                       ": is every step's gradient synchronised the same way?")
    shapes = ", ".join(f"{d} x {t}" for d, t in mesh_shapes)
    print(f"FSDP x tensor (and sequence) parallel on {n} ranks, meshes (data x tensor) {shapes}: tensor-parallel "
          f"collectives on the tensor group, FSDP's on the data group; every gradient shard of the first step, "
          f"the losses and the weights after {num_steps} AdamW steps equal one process's (1e-12)")



# ---------------------------------------------------------------- section 3: pipeline stages (3-D)

NUM_MICRO_BATCHES = 2


def mesh_3d(world_size):
    """The (data, pipeline, tensor) mesh of `world_size` ranks: (2, 2, 2) on 8, (1, 2, 2) on 4 (nd.default_mesh)."""
    return nd.default_mesh(world_size, nd.MESH_3D)


def last_micro_batch_gradients(sizes, mesh, num_micro_batches, seed=0):
    """One process's gradient of the mean loss over every data rank's last micro-batch, at the first step: what a
    schedule keeps when each micro-batch's backward drops the gradients of those before it."""
    data_parallel = mesh[0]
    model, (inputs, targets) = build_transformer(sizes, seed), make_tokens(sizes, seed, 0)
    rows = [x.chunk(data_parallel)[d].chunk(num_micro_batches)[-1] for x in (inputs, targets)
            for d in range(data_parallel)]
    inputs, targets = (torch.cat(rows[i * data_parallel:(i + 1) * data_parallel]) for i in range(2))
    lm_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _count_problem(run, sizes, mesh, num_micro_batches):
    """The calls of one rank's first step against nd.formula_calls_3d, in words, or None."""
    want = nd.formula_calls_3d(sizes, mesh, num_micro_batches, run.coordinate[1])
    got = {}
    for (group, name), (calls, _) in run.counts.items():
        if group == "tensor" and mesh[2] == 1:  # a group of one rank: its calls move nothing
            continue
        name = {"send": "isend", "irecv": "recv"}.get(name, name)  # blocking or not: the same hand-off
        got[group, name] = got.get((group, name), 0) + calls
    if got == want:
        return None
    where = f"on mesh (data, pipeline, tensor) = {mesh}, rank {run.coordinate}: calls per step {got}, expected {want}"
    rs, gathers = ("data", "reduce_scatter"), ("data", "all_gather")
    if got.get(rs, 0) == num_micro_batches * want.get(rs, 0) > want.get(rs, 0):
        return (f"{where}: the gradients were synchronised after each micro-batch ({num_micro_batches} reduce-scatters "
                f"per parameter): accumulate every micro-batch's gradient first, then sync once per step")
    if got.get(gathers) != want.get(gathers):
        return f"{where}: FSDP's all-gathers are the loop's (shards.unshard(), once per step): train_step adds none"
    return where


def _gradient_problem_3d(runs, mesh, grads, last, num_micro_batches, per_micro_batch_ruled_out=False):
    """The first wrong gradient shard, in words. `per_micro_batch_ruled_out`: an earlier mesh with T = 1 and the same
    micro-batches passed, so a factor T is the division by T, not by m."""
    data_parallel, _, tensor_parallel = mesh
    m = num_micro_batches
    not_by_m = (f"the loss of each micro-batch was not divided by the number of micro-batches ({m}): the step's loss "
                f"is their mean")
    not_by_t = (f"the loss share was not divided by T = {tensor_parallel} (nd.loss_share(model, x, targets, T, seq_len)"
                f" takes the tensor group's size): a tensor group's shares add up to the data rank's loss")

    def mistakes(run, name, want):
        kept = _expected_shard(last[name], name, run.coordinate[::2], data_parallel, tensor_parallel)
        scaled = []
        if tensor_parallel > 1:
            scaled.append((tensor_parallel * want, f"it is {tensor_parallel} times too large: " + (
                not_by_t if per_micro_batch_ruled_out or tensor_parallel != m else f"{not_by_m}; or {not_by_t} (on "
                f"this mesh both give the same numbers)")))
        return scaled + [
            (m * want, f"it is {m} times too large: {not_by_m}"),
            (kept / m, "only the last micro-batch's gradient was kept: each backward adds to .grad; do not "
                       "zero the gradients between micro-batches"),
            (kept, "only the last micro-batch's gradient was kept (and not divided by the number of "
                   "micro-batches)")]

    return _first_wrong_shard(runs, mesh, ("data", "pipeline", "tensor"), grads, "train_step", mistakes,
                              names=lambda run: run.names, plane=lambda coordinate: coordinate[::2])


def _order_problem(run, mesh, num_micro_batches):
    """A stage's forwards and backwards (F, B) in another order than 1F1B's table, in words with the micro-batches
    it held at once, or None."""
    from utils import pipeline as pp

    stage, num_stages = run.coordinate[1], mesh[1]
    want = [kind for kind, _ in pp.one_f_one_b_order(stage, num_stages, num_micro_batches)]
    if run.order is None or run.order == want:
        return None

    def peak(order):
        alive = [order[:k + 1].count("F") - order[:k + 1].count("B") for k in range(len(order))]
        return max(alive, default=0)

    warm_up = next((k for k, kind in enumerate(run.order) if kind == "B"), len(run.order))
    want_warm_up = want.index("B")
    return (f"on mesh (data, pipeline, tensor) = {mesh}, rank {run.coordinate}: stage {stage} ran "
            f"{' '.join(run.order)}, 1F1B's table (pp.one_f_one_b_order({stage}, {num_stages}, {num_micro_batches})) "
            f"says {' '.join(want)}: " + (
                f"{warm_up} forward(s) before its first backward where 1F1B's stage {stage} of {num_stages} runs "
                f"{want_warm_up} (a warm-up of P - s - 1 = {num_stages - stage - 1}, then one forward and one backward "
                f"in turn); " if warm_up != want_warm_up else "")
            + f"it held {peak(run.order)} micro-batches' activations at once instead of {peak(want)}. The values "
              f"are the same; the schedule, and its memory, are not: run the table's order")


def _unpaired_hint(unpaired, mesh, num_micro_batches):
    """Ranks waited in vain, and the journals show why: messages sent and never received, or awaited and never sent."""
    tensor_parallel = mesh[2]
    lines = [f"rank {a} (stage {a // tensor_parallel % mesh[1]}) sent {sent} message(s) to rank {b} (stage "
             f"{b // tensor_parallel % mesh[1]}), which posted {received} receive(s) from it"
             for a, b, sent, received in unpaired[:4]]
    return (f"on mesh (data, pipeline, tensor) = {mesh} ranks waited for a peer in vain (a stall, or a peer gone), "
            f"and their sends and receives do not pair up: " + "; ".join(lines) + f". Every message needs its "
            f"receive on the neighbour: per step, each stage but the first receives {num_micro_batches} "
            f"micro-batches' hidden states from the previous stage and each but the last sends them on; backward, "
            f"their gradients the other way, as many")


def meshes_3d(world_size, sizes=SIZES, num_micro_batches=NUM_MICRO_BATCHES):
    """The (data, pipeline, tensor) meshes the check trains on, as (world size, mesh): first (2, 2, 1) on 4 ranks for
    one step, where the pipeline neighbour is 1 rank away and the data, pipeline and tensor sizes are not all equal
    (on (2, 2, 2) a stride taken from the wrong size, or a division by T instead of m, gives the same numbers);
    then the world's mesh ((2, 2, 2) on 8)."""
    mesh, extra = mesh_3d(world_size), (2, 2, 1)
    fits = sizes.batch_size % (2 * num_micro_batches) == 0 and sizes.num_layers % 2 == 0
    return ([(4, extra)] if fits and mesh != extra and not under_torchrun() else []) + [(world_size, mesh)]


def _train_3d_main(rank, world_size, parallelize, train_step, sizes, mesh, num_micro_batches, num_steps, seed,
                   journal_dir=None, chained=False):
    """nd.train_3d_main; with `chained`, every layer of the stage chained (checks.pipeline.chain_layers), its steps
    recorded and guarded as any run's."""
    if chained:
        from utils.checks.pipeline import chain_layers

        def parallelize(model, groups, unchained=parallelize):
            model, shards = unchained(model, groups)
            chain_layers(model)
            return model, shards

    return nd.train_3d_main(rank, world_size, parallelize, train_step, sizes, mesh, num_micro_batches, num_steps, seed,
                            journal_dir=journal_dir)


def chained_3d_gradients(sizes, mesh, num_micro_batches, seed=0):
    """One process's gradient shards after a first step of 1F1B on a (data, pipeline, 1) mesh with every layer of
    each rank's stage chained (checks.pipeline.chained_replay, per data rank), the data ranks' mean sharded as FSDP
    shards it: {(data, pipeline) coordinate: {name: shard}}."""
    from utils import pipeline as pp
    from utils.checks.pipeline import chained_replay
    from utils.pytorch_reference import transformer_stage

    data_parallel, num_stages, _ = mesh
    m, last = num_micro_batches, num_stages - 1
    tables = [pp.chunked(pp.one_f_one_b_order)(s, num_stages, 1, m) for s in range(num_stages)]
    grads = [{} for _ in range(num_stages)]
    for d in range(data_parallel):
        stages = [torch.nn.ModuleList([transformer_stage(sizes, s, num_stages, seed)]) for s in range(num_stages)]
        inputs, targets = (x.chunk(data_parallel)[d].chunk(m) for x in make_tokens(sizes, seed, 0))
        chained_replay(tables, stages, inputs, lambda j, stage, x, i: lm_loss(stage(x), targets[i]) / m if j == last
                       else stage(x))
        for s, (stage,) in enumerate(stages):
            for name, p in stage.named_parameters():
                grads[s][name] = grads[s].get(name, 0) + p.grad / data_parallel
    return {(d, s): {name: _expected_shard(g, name, (d, 0), data_parallel, 1) for name, g in grads[s].items()}
            for d in range(data_parallel) for s in range(num_stages)}


def _check_chained_3d(chained, mesh, num_micro_batches, sizes, seed):
    """After every check of the records: each rank's gradient shards in the chained run (Run3D.synced) against
    1F1B's order played in one process (checks.pipeline's hint: another order, whatever the record says). A stage's
    order changes its neighbours' values too, so the hint names every stage's table."""
    from utils.checks.pipeline import _check_chained

    want = chained_3d_gradients(sizes, mesh, num_micro_batches, seed)
    for run in chained:
        d, stage, _ = run.coordinate
        _check_chained(f"on mesh (data, pipeline, tensor) = {mesh}, rank {run.coordinate}",
                       [run.synced[name] for name in run.names], [want[d, stage][name] for name in run.names], "1F1B",
                       f"pp.one_f_one_b_order(s, {mesh[1]}, {num_micro_batches}) on each stage s")


def _run_3d(parallelize, train_step, n, mesh, sizes, num_micro_batches, num_steps, seed, chained=False):
    """The ranks' Run3D on `mesh` (with `chained`, every layer chained); a refused call or a stall (the sends and
    receives that do not pair up, from the ranks' journals) raised as an AssertionError naming it."""
    with tempfile.TemporaryDirectory() as journal_dir:
        try:
            return spawn(_train_3d_main, n, parallelize, train_step, sizes, mesh, num_micro_batches, num_steps,
                         seed, timeout=CHECK_TIMEOUT, journal_dir=journal_dir, chained=chained)
        except (RankError, TimeoutError) as e:
            if isinstance(e, RankError) and "CompositionMistake" in e.summary:
                _raise_composition_mistake(e, f"on mesh (data, pipeline, tensor) = {mesh}")
            waited = isinstance(e, TimeoutError) or "already returned from fn" in e.summary  # for a peer, in vain
            unpaired = waited and nd.unpaired_messages(journal_dir, n)
            if unpaired:
                raise AssertionError(_unpaired_hint(unpaired, mesh, num_micro_batches)) from e
            raise


def check_pipeline_3d(parallelize, train_step, world_size, sizes=SIZES, num_micro_batches=NUM_MICRO_BATCHES,
                      num_steps=NUM_STEPS, seed=0):
    """Train on (2, 2, 1) for one step, then on the (data, pipeline, tensor) mesh of `world_size` ranks ((2, 2, 2) on
    8) with 1F1B over `num_micro_batches`: each send/recv to a pipeline neighbour and each collective on its group
    (refused on the rank before it runs), the stages' parameters, the calls per group against nd.formula_calls_3d,
    each stage's order of forwards and backwards against 1F1B's table, the first step's gradient shards, then (on the
    first mesh with T = 1) the order shown by a chained step's gradient shards, then losses and weights after
    `num_steps` AdamW steps, against one process (1e-12)."""
    (n,) = runnable_world_sizes([world_size])
    runs_on = meshes_3d(n, sizes, num_micro_batches)
    for k, mesh in runs_on:
        nd.check_sizes_3d(sizes, mesh, k, num_micro_batches)  # a ValueError names what does not split
    weights, losses = train_transformer_reference(sizes, num_steps, seed)
    grads = reference_gradients(sizes, seed)
    passed = []
    chained_on = next((mesh for _, mesh in runs_on if mesh[2] == 1 and num_micro_batches > 1), None)
    for k, mesh in runs_on:
        last_mesh = mesh == runs_on[-1][1]
        runs = _run_3d(parallelize, train_step, k, mesh, sizes, num_micro_batches, num_steps if last_mesh else 1,
                       seed)
        errors = [run.error for run in runs if run.error]
        problem = next((e for e in errors if "embedding on" in e or "LM head on" in e), errors[0]) if errors else None
        problem = problem or next((p for run in runs if (p := _count_problem(run, sizes, mesh, num_micro_batches))),
                                  None) or _gradient_problem_3d(
            runs, mesh, grads, last_micro_batch_gradients(sizes, mesh, num_micro_batches, seed), num_micro_batches,
            per_micro_batch_ruled_out=any(m[2] == 1 for m in passed)) or next(
            (p for run in runs if (p := _order_problem(run, mesh, num_micro_batches))), None)
        if problem and passed:
            problem += f" (right on mesh {passed[0]}, wrong on {mesh})"
        if problem:
            raise AssertionError(problem)
        if mesh == chained_on:  # the order, shown by the values: after every check of the records
            chained = _run_3d(parallelize, train_step, k, mesh, sizes, num_micro_batches, 1, seed, chained=True)
            _check_chained_3d(chained, mesh, num_micro_batches, sizes, seed)
        passed.append(mesh)
        if last_mesh:
            _check_trained(nd.full_weights_3d(runs, {name: w.shape for name, w in weights.items()}, mesh),
                           nd.global_losses(runs, mesh[0]), weights, losses, mesh, ": is every step the same?")
    first = "".join(f"{m} on {k} ranks for the first step, then " for k, m in runs_on[:-1])
    mesh = runs_on[-1][1]
    print(f"3-D, mesh (data, pipeline, tensor) = {first}{mesh} on {n}, 1F1B over {num_micro_batches} "
          f"micro-batches: every send/recv to a pipeline neighbour, every collective on its group and counted as the "
          f"formulas say, each stage's forwards and backwards in 1F1B's order; every gradient shard of the first "
          f"step, the losses and the weights after {num_steps} AdamW steps equal one process's (1e-12)")


# ---------------------------------------------------------------- section 4: context parallel, (context, tensor)

CP_SIZES = TransformerSizes(vocab_size=32, dim=16, num_heads=4, num_layers=2, ffn_dim=32, seq_len=16, batch_size=2)


def mesh_cp(world_size):
    """The (context, tensor) mesh of `world_size` ranks: (2, 2) on 4 (nd.default_mesh in 2-D)."""
    return nd.default_mesh(world_size, nd.MESH_CP)


def cp_loss_shares(sizes, mesh, seed=0):
    """{(c, t): rank (c, t)'s loss share at the first step}, one process's: the mean of its tokens' losses (its
    context chunk's tensor part of every sequence) divided by T, so that a data rank's shares add up to its loss."""
    from utils.nd_parallel.context import cp_tokens

    model, (inputs, targets) = build_transformer(sizes, seed), make_tokens(sizes, seed, 0)
    with torch.no_grad():
        logits = model(inputs)
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    per_token = per_token.view(targets.shape)
    context_parallel, tensor_parallel = mesh
    return {(c, t): cp_tokens(per_token, per_token, ((c, t), mesh))[0].mean().item() / tensor_parallel
            for c in range(context_parallel) for t in range(tensor_parallel)}


def _cp_loss_problem(run, mesh, share):
    """This rank's first loss share against one process's, in words naming the count it was divided by, or None."""
    context_parallel, tensor_parallel = mesh
    got = run.losses[0] if run.losses else None
    if got is None or abs(got - share) <= 1e-12:
        return None
    where = f"on mesh (context, tensor) = {mesh}, rank {run.coordinate}: the loss share returned at the first step"
    fits = [(tensor_parallel, "not divided by T: the loss share is lm_loss of this rank's tokens / T (the tensor "
                             "group's size, nd.loss_share's integer), so that a tensor group's shares add up to the "
                             "context rank's loss"),
            (tensor_parallel / context_parallel, f"divided by the context size C = {context_parallel} instead of the "
                                                f"tensor size T = {tensor_parallel}: the loss share is divided by T; "
                                                f"the context group's mean is the sync's (its reduce-scatter's / C)"),
            (1 / context_parallel, f"divided by C = {context_parallel} as well as by T: the context group's mean is "
                                   f"taken once, by the sync")]
    hint = "; or ".join(h for factor, h in fits if factor != 1 and abs(got - factor * share) <= 1e-12)
    return f"{where} is {got:.12g}, one process's {share:.12g}" + (f": {hint}" if hint else "")


def _cp_problem(runs, mesh, sizes, grads, seed=0):
    """The first wrong positions, loss share or gradient shard of the first step, in words, or None."""
    from utils import ring_attention as ra

    context_parallel, tensor_parallel = mesh
    chunks = ra.chunk_positions(sizes.seq_len, context_parallel)
    for run in runs:
        c, _ = run.coordinate
        where = f"on mesh (context, tensor) = {mesh}, rank {run.coordinate}"
        if run.positions != chunks[c].tolist():
            hint = (": RoPE at local positions: the model must get this context chunk's GLOBAL positions "
                    "(ra.chunk_positions(seq_len, C)[c]), or its queries and keys rotate as if every chunk started "
                    "the sequence" if run.positions == list(range(len(chunks[c]))) else "")
            return f"{where}: the attention saw positions {run.positions}, expected {chunks[c].tolist()}{hint}"
    shares = cp_loss_shares(sizes, mesh, seed)
    problem = next((p for run in runs if (p := _cp_loss_problem(run, mesh, shares[run.coordinate]))), None)
    if problem:
        return problem
    return _first_wrong_shard(runs, mesh, ("context", "tensor"), grads, "train_step", lambda run, name, want: [
        (want / context_parallel, f"it is {context_parallel} times too small: the context group's mean was taken "
                                  f"twice (the loss divided by the context size, and the sync's reduce-scatter "
                                  f"averaging over it): divide the loss by T only"),
        (want * context_parallel, "the replicated weights' gradients were summed over the context group, not "
                                  "averaged: each context rank's loss is the mean over its own chunk")])


def _cp_count_problem(run, mesh, want):
    """One rank's calls of the first step against nd.formula_calls_cp, in words (naming FSDP's collectives on the
    tensor group when the counts show them there), or None."""
    got = {k: calls for k, (calls, _) in run.counts.items() if k[0] != "tensor" or mesh[1] > 1}  # a group of one
    if got == want:
        return None
    where = f"on mesh (context, tensor) = {mesh}, rank {run.coordinate}: calls per step {got}, expected {want}"
    fsdp_gathers, fsdp_scatters = want[("context", "all_gather")], want[("context", "reduce_scatter")]
    if got.get(("tensor", "all_gather"), 0) >= fsdp_gathers > got.get(("context", "all_gather"), 0):
        return (f"{where}: FSDP's all-gathers ran on the tensor group: the context group takes the data group's "
                f"place in parallelize_2d (its ranks hold the same weights), the tensor group stays the tensor group")
    if got.get(("tensor", "reduce_scatter"), 0) >= fsdp_scatters > got.get(("context", "reduce_scatter"), 0):
        return (f"{where}: FSDP's reduce-scatters of the gradients ran on the tensor group: the sync's data group is "
                f"the context group, whose ranks hold copies of the same weights")
    return where


def cp_meshes(world_size):
    """The (context, tensor) meshes the check trains on: (2, 2) on 4 ranks, then (4, 1) for one step, where the
    context and tensor sizes differ (on (2, 2) a division by the one instead of the other gives the same numbers)."""
    mesh = mesh_cp(world_size)
    other = (world_size, 1)
    return [mesh] + ([other] if other != mesh and world_size > 2 else [])


def _train_cp(parallelize, train_step, n, sizes, mesh, num_steps, seed):
    """The ranks' RunCP on `mesh`, a rank's refused call (CompositionMistake) raised as an AssertionError."""
    try:
        return spawn(nd.train_cp_main, n, parallelize, train_step, sizes, mesh, num_steps, seed, timeout=CHECK_TIMEOUT)
    except RankError as e:
        _raise_composition_mistake(e, f"on mesh (context, tensor) = {mesh}")


def check_context_parallel_nd(parallelize, train_step, world_size, sizes=CP_SIZES, num_steps=NUM_STEPS, seed=0):
    """Train on the (context, tensor) mesh of `world_size` ranks ((2, 2) on 4): the ring's sends on the context
    group and every collective on its group (refused on the rank before it runs), the calls counted against
    nd.formula_calls_cp, the positions RoPE saw, each rank's loss share and the first step's gradient shards, then
    losses and weights after `num_steps` AdamW steps, against one process (1e-12); then the first step on (4, 1),
    where the context and tensor sizes differ."""
    (n,) = runnable_world_sizes([world_size])
    meshes_cp = cp_meshes(n)
    for mesh in meshes_cp:
        nd.check_sizes_cp(sizes, mesh, n)  # a ValueError names what does not split, before any rank starts
    weights, losses = train_transformer_reference(sizes, num_steps, seed)
    grads = reference_gradients(sizes, seed)
    for k, mesh in enumerate(meshes_cp):
        runs = _train_cp(parallelize, train_step, n, sizes, mesh, num_steps if k == 0 else 1, seed)
        want_calls = nd.formula_calls_cp(sizes, mesh)
        problem = next((p for run in runs if (p := _cp_count_problem(run, mesh, want_calls))), None) or \
            _cp_problem(runs, mesh, sizes, grads, seed)
        if problem and k > 0:
            problem += (f" (right on mesh {meshes_cp[0]}, where the context and tensor sizes are equal: is one "
                        f"group's size used for the other's?)")
        if problem:
            raise AssertionError(problem)
        if k == 0:
            _check_trained(nd.full_weights(runs, {name: w.shape for name, w in weights.items()}, *mesh),
                           nd.global_losses(runs, mesh[0]), weights, losses, mesh)
    mesh, others = meshes_cp[0], "".join(f" and {m} for the first step" for m in meshes_cp[1:])
    print(f"context x tensor parallel on {n} ranks, mesh (context, tensor) = {mesh}{others}, {sizes.seq_len} tokens: "
          f"the ring on the context group, every call counted as the formulas say, RoPE at global positions, each "
          f"rank's loss share; every gradient shard of the first step, the losses and the weights after {num_steps} "
          f"AdamW steps equal one process's (1e-12)")
