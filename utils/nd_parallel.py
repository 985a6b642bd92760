"""Parallelisms composed on one mesh (notebook 12): the mesh, then FSDP x tensor (and sequence) parallel.

The mesh. W ranks laid out as a tensor of shape (data, pipeline, tensor), row-major as `init_device_mesh` lays them
out: rank = ((d * P) + p) * T + t. A rank belongs to one group per dimension: the ranks that differ from it in that
coordinate only. Each parallelism runs its collectives on its own dimension's group:

    data      FSDP: all-gather of the parameters' shards, reduce-scatter of the gradients
    pipeline  send / recv of activations forward, of their gradients backward, between neighbouring stages
    tensor    TP + SP: all-gather and reduce-scatter along the sequence around each column/row pair,
              all-reduce of the gradients of the weights every tensor rank holds whole

2-D: FSDP x tensor (and sequence) parallel, on a (data, tensor) mesh. Inside a tensor group, each transformer block
is notebook 09's tensor + sequence parallel block (utils.sequence_parallel, its collectives on the tensor group);
the embedding, the final norm and the LM head stay whole on every tensor rank, each applied to the rank's chunk of
the sequence. Across the data group, every parameter a rank holds (its tensor-parallel shard, or a whole weight) is
sharded as notebook 05's FSDP shards a unit: flattened, padded, cut into `data` equal pieces (utils.fsdp.shard).

A rank (d, t) trains on data rank d's sequences, and holds tensor rank t's chunk of their positions outside the
column/row pairs; its loss is its chunk's share of the data rank's mean loss (the mean over its chunk / T), so that
the shares of a tensor group add up to the data rank's loss.
"""
import contextlib
import dataclasses
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from utils import fsdp, pytorch_reference
from utils import sequence_parallel as sp
from utils.counting import bytes_written
from utils.intercept import intercept
from utils.memory import MemoryTracker
from utils.model import make_optimizer
from utils.sizes import check_int, divide
from utils.transformer import Transformer, build_transformer, lm_loss, make_tokens

MESH_3D = ("data", "pipeline", "tensor")
MESH_2D = ("data", "tensor")
COLLECTIVES_ON = {"data": "FSDP: all-gather of the parameters' shards, reduce-scatter of the gradients",
                  "pipeline": "send/recv: activations forward, their gradients backward, stage to stage",
                  "tensor": "TP/SP: all-gather and reduce-scatter along the sequence around each column/row pair; "
                            "all-reduce of the whole weights' gradients"}


# ---------------------------------------------------------------- the mesh

def check_mesh(shape, world_size, names=None):
    """The mesh's sizes, as a tuple of ints, when they multiply to the world size; else a ValueError naming them."""
    shape = tuple(check_int("mesh size", s) for s in shape)
    names = names or tuple(f"dim {i}" for i in range(len(shape)))
    if len(names) != len(shape):
        raise ValueError(f"mesh shape {shape} has {len(shape)} dimensions, its names {names} {len(names)}")
    if math.prod(shape) != check_int("world_size", world_size):
        sizes = " x ".join(f"{n} {s}" for n, s in zip(names, shape))
        raise ValueError(f"mesh {sizes} = {math.prod(shape)} ranks, but the world has {world_size}: the mesh's "
                         f"sizes must multiply to the world size")
    return shape


def default_mesh(world_size, names=MESH_3D):
    """A mesh of `world_size` ranks: 2 for each dimension from the last (tensor) while 2 divides what is left, the
    rest on the first (data). 8 ranks: (2, 2, 2); 4: (1, 2, 2) in 3-D, (2, 2) in 2-D; 2: the tensor dimension."""
    left, sizes = check_int("world_size", world_size), []
    for _ in names[1:]:
        size = 2 if left % 2 == 0 else 1
        sizes.append(size)
        left //= size
    return (left, *reversed(sizes))


def device_mesh_layout(shape):
    """What DeviceMesh computes, on one process: (coordinates by rank, groups by dimension, each a list of rank
    lists). Its layout is torch.arange(W).view(shape); the groups of dimension i are the lines along i."""
    mesh = torch.arange(math.prod(shape)).view(shape)
    coordinates = {int(r): tuple(int(c) for c in torch.nonzero(mesh == r)[0]) for r in mesh.flatten()}
    groups = [mesh.movedim(i, -1).reshape(-1, size).tolist() for i, size in enumerate(shape)]
    return coordinates, groups


def device_mesh_groups(shape, names):
    """On a rank: (its coordinate, the ranks of each of its groups) as init_device_mesh builds them."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return tuple(mesh.get_coordinate()), [dist.get_process_group_ranks(mesh.get_group(n)) for n in names]


def mesh_picture(shape, names, mesh_position):
    """Text: the ranks laid out on the mesh (2 or more dimensions: a grid of the last two per value of the others),
    then each dimension's groups and what runs on them; everything from mesh_position(rank, shape)."""
    position = {rank: mesh_position(rank, shape) for rank in range(math.prod(shape))}
    grids = {}  # the other coordinates -> row -> the row's ranks, in column order
    for rank, (coordinate, _) in sorted(position.items(), key=lambda item: tuple(item[1][0])):
        *others, row, _ = coordinate
        grids.setdefault(tuple(others), {}).setdefault(row, []).append(rank)
    lines = []
    for others, rows in grids.items():
        lines.append(", ".join(f"{n} {c}" for n, c in zip(names, others)) + f":   {names[-1]} ->")
        lines += [f"{f'  {names[-2]} {row}':>12}  " + " ".join(f"{r:>2}" for r in ranks) for row, ranks in rows.items()]
    for i, name in enumerate(names):
        groups = sorted({tuple(groups[i]) for _, groups in position.values()})
        shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups)
        lines.append(f"{name:>9} groups {shown:<28} {COLLECTIVES_ON.get(name, '')}")
    return "\n".join(lines)


# ---------------------------------------------------------------- 2-D: FSDP x tensor (and sequence) parallel

def check_sizes_2d(sizes, data_parallel, tensor_parallel, world_size):
    """The mesh fills the world; heads, MLP features and the sequence split over the tensor group; the batch over
    the data group: a ValueError names what does not, before any rank starts."""
    check_mesh((data_parallel, tensor_parallel), world_size, MESH_2D)
    sp.check_sizes(sizes, tensor_parallel, "tensor_parallel")
    return divide("batch_size", sizes.batch_size, "data_parallel", data_parallel,
                  "each data-parallel rank trains on as many sequences")


def mesh_groups(shape, names=MESH_2D):
    """On a rank: the mesh's groups by name ({"data": ..., "tensor": ...} in 2-D) and this rank's coordinate."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    return {name: mesh.get_group(name) for name in names}, tuple(mesh.get_coordinate())


def sharded_over_tensor(name):
    """Whether parameter `name` is a tensor-parallel shard (a column or row layer's weight): different heads
    (features) on each tensor rank. The others (norms, embedding, LM head) are whole on every tensor rank."""
    return name.endswith(sp.COLUMN + sp.ROW)


def tensor_shard(name, weight, rank, tensor_parallel):
    """What tensor rank `rank` holds of the model's parameter `name` (its rows, its columns, or all of it)."""
    return sp.shard(name.split(".", 2)[-1] if name.startswith("layers.") else name, weight, rank, tensor_parallel)


def tensor_sequence_parallel(model, group):
    """Each block of `model` made tensor + sequence parallel over `group` (sp.ParallelBlock, in place); the
    embedding, the final norm and the LM head stay whole, applied to this rank's chunk of the sequence."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    sp.check_sizes(model.sizes, size, "tensor_parallel")
    for name, block in list(model.layers.items()):
        model.layers[name] = sp.ParallelBlock(block, rank, size, sp.GatherFromSequenceParallelRegion,
                                              sp.ReduceScatterToSequenceParallelRegion, group)
    return model


class FlatShards:
    """FSDP over `group` of every parameter of `model` (whatever the model holds: tensor-parallel shards too).
    `shards[name]`: this rank's flat 1/N of it (utils.fsdp.shard), the Parameter the optimizer steps. `unshard()`
    all-gathers every parameter into the model (FSDP2's unshard; here once per step, before forward, as
    fully_shard(reshard_after_forward=False)); `reshard()` frees the gathered weights and their gradients."""

    def __init__(self, model, group):
        self.model, self.group = model, group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.shards = {name: nn.Parameter(fsdp.shard(p, rank, size)) for name, p in model.named_parameters()}
        self.reshard()

    def parameters(self):
        return list(self.shards.values())

    def unshard(self):
        size = dist.get_world_size(self.group)
        for name, p in self.model.named_parameters():
            shard = self.shards[name].detach()
            flat = torch.empty(size * shard.numel(), dtype=shard.dtype)
            dist.all_gather_single(flat, shard, group=self.group)
            p.data = fsdp.unpad(flat, self.shapes[name])

    def reshard(self):
        for p in self.model.parameters():
            p.data, p.grad = torch.empty(0, dtype=p.dtype), None


def my_tokens(inputs, targets, coordinate, data_parallel, tensor_parallel):
    """Rank (d, t)'s tokens: data rank d's sequences, tensor rank t's chunk of their positions."""
    d, t = coordinate
    return tuple(x.chunk(data_parallel, dim=0)[d].chunk(tensor_parallel, dim=1)[t] for x in (inputs, targets))


def loss_share(model, inputs, targets, tensor_parallel, seq_len):
    """This rank's chunk's share of its data rank's mean loss (the chunk's mean / T): the blocks see the whole
    sequence's positions, the embedding and the LM head this rank's chunk."""
    return lm_loss(model(inputs, torch.arange(seq_len)), targets) / tensor_parallel


# ---------------------------------------------------------------- communication per group

@contextlib.contextmanager
def communication_by_group(groups, guard=None):
    """Record the block's communication calls (utils.intercept.Call), each with `.group`, the name of the group it
    ran on ("world" for the default group, "other" for a group not in `groups`), and `.wire`, the bytes this
    process wrote to its sockets while it ran (utils.counting.bytes_written; gloo's own traffic). `guard(call,
    arguments)`, if given, sees each call before it runs (and may refuse it: a wrong peer would hang the ranks)."""
    def name_of(group):
        group = dist.group.WORLD if group is None else group  # a mesh dimension that spans every rank is WORLD
        return next((name for name, g in groups.items() if g is group),
                    "world" if group is dist.group.WORLD else "other")

    def before(call, arguments):
        call.group, call.wire = name_of(arguments.get("group")), bytes_written()
        if guard is not None:
            guard(call, arguments)

    def after(call, arguments):
        call.wire = None if call.wire is None else bytes_written() - call.wire

    with intercept(before, after) as log:
        yield log


def bytes_per_group(log):
    """{group name: bytes written to the sockets} of a communication_by_group log."""
    totals = {}
    for call in log:
        totals[call.group] = totals.get(call.group, 0) + (call.wire or 0)
    return totals


def calls_per_group(log):
    """{(group name, collective): (calls, bytes handed to them)} of a communication_by_group log."""
    counts = {}
    for call in log:
        name = next((c for c in ("all_gather", "reduce_scatter", "all_reduce") if call.name.startswith(c)), call.name)
        calls, nbytes = counts.get((call.group, name), (0, 0))
        counts[(call.group, name)] = (calls + 1, nbytes + call.nbytes)
    return counts


def local_numels(sizes, tensor_parallel):
    """{name: elements} a tensor rank holds of each parameter, before FSDP shards it."""
    with torch.device("meta"):
        model = Transformer(sizes)
    return {name: p.numel() // (tensor_parallel if sharded_over_tensor(name) else 1)
            for name, p in model.named_parameters()}


def formula_memory_2d(sizes, data_parallel, tensor_parallel, element_size=8):
    """{group: bytes} of model state a rank holds at the step's peak, as utils.memory.MemoryTracker counts it:
    parameters, its shards (1/D of the P_t elements its tensor rank holds, padded) and the gathered weights (P_t);
    gradients, the same two; optimizer state, AdamW's two moments of the shards and a 4-byte step count per tensor."""
    numels = local_numels(sizes, tensor_parallel)
    shards = sum(fsdp.shard_numel(n, data_parallel) for n in numels.values()) * element_size
    gathered = sum(numels.values()) * element_size
    return {"parameters": shards + gathered, "gradients": shards + gathered,
            "optimizer state": 2 * shards + 4 * len(numels)}


# ---------------------------------------------------------------- a 2-D run, recorded

@dataclasses.dataclass
class Run2D:
    coordinate: tuple
    groups: dict  # name: the global ranks of this rank's group
    losses: list = dataclasses.field(default_factory=list)  # this rank's loss share, by step
    shards: dict = None  # name: this rank's flat shard after the last step
    unsynced: dict = None  # first step: name: the gradient of the whole (unsharded) parameter, before the sync
    synced: dict = None  # first step: name: the shard's gradient after the sync
    calls: dict = None  # first step: phase ("unshard", "forward", "backward", "sync"): [(collective, group)]
    bytes: dict = None  # first step: group: bytes written to the sockets
    counts: dict = None  # first step: (group, collective): (calls, bytes handed to them)
    peak: dict = None  # second step (optimizer state exists): model state at its peak, {"parameters": ..., ...}
    seconds: list = dataclasses.field(default_factory=list)  # each step's time
    error: str = ""  # what sync_gradients raised, if it did (the run stops there)


def train_2d_main(rank, world_size, parallelize, sync_gradients, sizes, data_parallel, tensor_parallel, num_steps,
                  seed=0, lr=1e-2, track_memory=False):
    """Train the course's transformer on the (data, tensor) mesh: model, shards = parallelize(model, tensor group,
    data group); each step unshard, forward and backward of this rank's loss share, sync_gradients(model,
    shards.shards, tensor group, data group) (which must set every shard's .grad), AdamW on the shards. The first
    step is recorded (Run2D); with track_memory, the model state's peak over the second (utils.memory)."""
    groups, coordinate = mesh_groups((data_parallel, tensor_parallel))
    run = Run2D(coordinate, {name: dist.get_process_group_ranks(g) for name, g in groups.items()})
    model, shards = parallelize(build_transformer(sizes, seed), groups["tensor"], groups["data"])
    optimizer = make_optimizer(shards.parameters(), "adamw", lr)
    for step in range(num_steps):
        inputs, targets = my_tokens(*make_tokens(sizes, seed, step), coordinate, data_parallel, tensor_parallel)
        phases, tracked = {}, track_memory and step == min(1, num_steps - 1)
        tracker = MemoryTracker(lambda: shards.parameters() + list(model.parameters()), optimizer)
        start = time.perf_counter()
        with communication_by_group(groups) as log, (tracker if tracked else contextlib.nullcontext()):
            mark = _phase_marker(log, phases)
            shards.unshard()
            mark("unshard")
            loss = loss_share(model, inputs, targets, tensor_parallel, sizes.seq_len)
            mark("forward")
            loss.backward()
            mark("backward")
            if step == 0:
                run.unsynced = {name: p.grad.clone() for name, p in model.named_parameters()}
            try:
                sync_gradients(model, shards.shards, groups["tensor"], groups["data"])
            except RuntimeError as e:  # a collective refused its tensors (a shard's size for another group)
                run.error = f"sync_gradients raised {type(e).__name__}: {str(e).splitlines()[0]}"
            mark("sync")
            if run.error:
                run.calls = phases
                return run
            if step == 0:
                run.synced = {name: None if s.grad is None else s.grad.clone() for name, s in shards.shards.items()}
                run.calls, run.bytes, run.counts = phases, bytes_per_group(log), calls_per_group(log)
            optimizer.step()
            optimizer.zero_grad()
            shards.reshard()
        run.seconds.append(time.perf_counter() - start)
        run.losses.append(loss.item())
        run.peak = tracker.peak if tracked else run.peak
    run.shards = {name: s.detach().clone() for name, s in shards.shards.items()}
    return run


def measure_2d(parallelize, sync_gradients, sizes, data_parallel, tensor_parallel, seed=0):
    """Two steps of train_2d_main on data x tensor ranks, measured; per rank, in rank order: {"bytes": {group: bytes
    written to the sockets in the first step}, "calls": {(group, collective): (calls, bytes handed to them)},
    "peak": {model state group: bytes at the second step's peak}}. What the planner's predictions are checked
    against."""
    from utils.launch import spawn

    check_sizes_2d(sizes, data_parallel, tensor_parallel, data_parallel * tensor_parallel)
    runs = spawn(train_2d_main, data_parallel * tensor_parallel, parallelize, sync_gradients, sizes, data_parallel,
                 tensor_parallel, 2, seed, track_memory=True)
    return [{"bytes": run.bytes, "calls": run.counts, "peak": run.peak} for run in runs]


def train_pytorch_2d_main(rank, world_size, sizes, data_parallel, tensor_parallel, num_steps, seed=0, lr=1e-2):
    """PyTorch's composition (pytorch_reference.fsdp_tensor_parallel_transformer) trained as train_2d_main trains
    ours: (each step's loss (the data rank's, whole on each of its tensor ranks), the weights at the end (whole),
    each step's seconds, each step's bytes written to the sockets)."""
    model, mesh = pytorch_reference.fsdp_tensor_parallel_transformer(data_parallel, tensor_parallel, sizes, seed)
    data_rank = mesh.get_coordinate()[0]
    optimizer = make_optimizer(model.parameters(), "adamw", lr)
    losses, seconds, wire = [], [], []
    for step in range(num_steps):
        inputs, targets = (x.chunk(data_parallel)[data_rank] for x in make_tokens(sizes, seed, step))
        start, written = time.perf_counter(), bytes_written()
        loss = lm_loss(model(inputs, torch.arange(sizes.seq_len)), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
        wire.append(None if written is None else bytes_written() - written)
        losses.append(loss.item())
    weights = {name: pytorch_reference.full_tensor(p) for name, p in model.named_parameters()}
    return losses, weights, seconds, wire



# ---------------------------------------------------------------- 3-D: pipeline stages

def check_sizes_3d(sizes, mesh, world_size, num_micro_batches):
    """Section 2's sizes on the (data, tensor) dimensions, the layers split evenly over the pipeline dimension, and
    each data rank's sequences into equal micro-batches: a ValueError names what does not, before any rank starts.
    Returns the micro-batch size."""
    data_parallel, pipeline_parallel, tensor_parallel = check_mesh(mesh, world_size, MESH_3D)
    sp.check_sizes(sizes, tensor_parallel, "tensor_parallel")
    divide("num_layers", sizes.num_layers, "pipeline_parallel", pipeline_parallel, "every stage runs as many layers")
    local = divide("batch_size", sizes.batch_size, "data_parallel", data_parallel,
                   "each data-parallel rank trains on as many sequences")
    return divide("batch_size / data_parallel", local, "num_micro_batches", check_int("num_micro_batches",
                  num_micro_batches), "the micro-batches are equal")


def stage_names(sizes, stage, num_stages):
    """The parameter names pipeline stage `stage` holds: its layers (utils.pipeline.stage_layers), the embedding on
    the first stage, the final norm and the LM head on the last."""
    from utils.pipeline import stage_layers

    with torch.device("meta"):
        model = Transformer(sizes)
    layers = {str(i) for i in stage_layers(sizes.num_layers, num_stages)[stage]}
    return [name for name, _ in model.named_parameters()
            if (name.startswith("layers.") and name.split(".")[1] in layers)
            or (name.startswith("tok_embeddings") and stage == 0)
            or (name.startswith(("norm.", "output.")) and stage == num_stages - 1)]


def stage_forward(model, x, seq_len):
    """A stage's forward of one micro-batch: tokens on the first stage, the previous stage's hidden states (this
    tensor rank's chunk of the sequence) elsewhere; the blocks see the whole sequence's positions."""
    return model(x, torch.arange(seq_len))


def hidden_like(tokens, sizes):
    """A buffer for the hidden states of `tokens` (batch, this rank's chunk of positions): what a stage receives."""
    return torch.empty(*tokens.shape, sizes.dim, dtype=torch.float64)


def pipeline_neighbours(pipeline_group):
    """The global ranks of the previous and next pipeline stages (None at the ends): the ranks with the same data
    and tensor coordinates, one pipeline coordinate away (rank -/+ T on a (data, pipeline, tensor) mesh)."""
    stage, size = dist.get_rank(pipeline_group), dist.get_world_size(pipeline_group)
    return tuple(dist.get_global_rank(pipeline_group, s) if 0 <= s < size else None for s in (stage - 1, stage + 1))


PEER_NAMES = {"send": ("dst", "group_dst"), "isend": ("dst", "group_dst"), "recv": ("src", "group_src"),
              "irecv": ("src", "group_src")}


class CompositionMistake(AssertionError):
    """Raised on a rank, before a call that would hang or mix the ranks: the check turns it into its hint."""


def peer_of(name, arguments):
    """The global rank a send/recv talks to."""
    rank_key, group_key = PEER_NAMES[name]
    if arguments.get(group_key) is not None:
        return dist.get_global_rank(arguments.get("group") or dist.group.WORLD, arguments[group_key])
    return arguments.get(rank_key)


def guard_3d(groups, tensor_parallel):
    """guard(call, arguments) for communication_by_group: a send/recv only to a pipeline neighbour, a collective
    only on the data or the tensor group; else CompositionMistake, naming the mistake, before the call runs."""
    neighbours = pipeline_neighbours(groups["pipeline"])
    rank = dist.get_rank()

    def guard(call, arguments):
        if call.name in PEER_NAMES:
            peer = peer_of(call.name, arguments)
            if peer in neighbours and call.group in ("pipeline", "world"):
                return
            if peer in (rank - 1, rank + 1) and peer not in neighbours:
                raise CompositionMistake(
                    f"rank {rank}'s {call.name} talks to rank {peer}, its tensor neighbour (rank +/- 1): the next "
                    f"pipeline stage with the same data and tensor coordinates is rank +/- T = {tensor_parallel} "
                    f"(dist.get_global_rank(pipeline_group, stage +/- 1), or group_dst/group_src on the pipeline "
                    f"group)")
            raise CompositionMistake(f"rank {rank}'s {call.name} on the {call.group} group talks to rank {peer}, not "
                                     f"to a pipeline neighbour {[n for n in neighbours if n is not None]}")
        if call.group not in ("data", "tensor"):
            raise CompositionMistake(
                f"rank {rank}: a {call.name} on the {call.group} group: the gradients were synchronised over more "
                f"than the data group (or on the pipeline group), but the pipeline's stages hold different layers: "
                f"only the ranks of a data group hold copies of the same weights (and a tensor group's whole ones)")
    return guard


@dataclasses.dataclass
class Run3D:
    coordinate: tuple  # (data, pipeline, tensor)
    names: list  # the parameters this rank's stage holds
    losses: list = dataclasses.field(default_factory=list)  # this rank's loss share, by step (0 off the last stage)
    shards: dict = None  # name: this rank's flat shard after the last step
    synced: dict = None  # first step: name: the shard's gradient after the sync
    counts: dict = None  # first step: (group, collective): (calls, bytes handed to them)
    bytes: dict = None  # first step: group: bytes written to the sockets
    seconds: list = dataclasses.field(default_factory=list)  # each step's time
    error: str = ""  # what is wrong with the stage's parameters, if anything (the run stops before training)


def train_3d_main(rank, world_size, parallelize, train_step, sizes, mesh, num_micro_batches, num_steps, seed=0,
                  lr=1e-2):
    """Train the course's transformer on the (data, pipeline, tensor) mesh: model, shards = parallelize(model,
    groups); each step unshard, then loss = train_step(model, shards.shards, micro_batches, groups) (its stage's
    forwards and backwards of this rank's micro-batches, and the gradients' sync: every shard's .grad set), AdamW
    on the shards, reshard. Every call is guarded (guard_3d); the first step is recorded (Run3D)."""
    data_parallel, pipeline_parallel, tensor_parallel = mesh
    groups, coordinate = mesh_groups(mesh, MESH_3D)
    model, shards = parallelize(build_transformer(sizes, seed), groups)
    run = Run3D(coordinate, sorted(shards.shards))
    want = sorted(stage_names(sizes, coordinate[1], pipeline_parallel))
    run.error = "" if run.names == want else _stage_hint(run.names, want, coordinate[1], pipeline_parallel)
    wrong = torch.tensor([float(bool(run.error))])
    dist.all_reduce(wrong, op=dist.ReduceOp.MAX)  # every rank stops if one stage is wrong (not logged: the check's)
    if wrong.item():
        return run
    def step(i):
        inputs, targets = my_tokens(*make_tokens(sizes, seed, i), coordinate[::2], data_parallel, tensor_parallel)
        micro_batches = list(zip(inputs.chunk(num_micro_batches), targets.chunk(num_micro_batches)))
        return train_step(model, shards.shards, micro_batches, groups)

    return _train_and_record(run, shards, groups, guard_3d(groups, tensor_parallel), step, num_steps, lr)


def _train_and_record(run, shards, groups, guard, step, num_steps, lr):
    """The loop of train_3d_main and train_cp_main: each step unshard, loss = step(i) (the forwards, backwards and
    the gradients' sync: every shard's .grad set), every call guarded; AdamW on the shards, reshard. The first
    step's gradient shards, calls and bytes per group are recorded in `run`."""
    optimizer = make_optimizer(shards.parameters(), "adamw", lr)
    for i in range(num_steps):
        start = time.perf_counter()
        with communication_by_group(groups, guard) as log:
            shards.unshard()
            loss = step(i)
        if i == 0:
            run.synced = {name: None if s.grad is None else s.grad.clone() for name, s in shards.shards.items()}
            run.counts, run.bytes = calls_per_group(log), bytes_per_group(log)
        optimizer.step()
        optimizer.zero_grad()
        shards.reshard()
        run.seconds.append(time.perf_counter() - start)
        run.losses.append(float(loss or 0.0))  # a pipeline stage without the loss returns 0
    run.shards = {name: s.detach().clone() for name, s in shards.shards.items()}
    return run


def _stage_hint(names, want, stage, num_stages):
    """Why a stage holds the wrong parameters, in words."""
    has = {n.split(".")[0] for n in names}
    where = f"pipeline stage {stage} of {num_stages} holds {sorted(has)}"
    if stage == num_stages - 1 and "tok_embeddings" in has and stage != 0:
        return f"{where}: the embedding on the last stage: it belongs on the first, which turns tokens into vectors"
    if stage == 0 and "output" in has and num_stages > 1:
        return f"{where}: the LM head on the first stage: it belongs on the last, which computes the loss"
    missing, extra = sorted(set(want) - set(names)), sorted(set(names) - set(want))
    return (f"{where}: missing {missing[:3]}, extra {extra[:3]}: a stage keeps its layers "
            f"(utils.pipeline.stage_layers), the first the embedding, the last the final norm and the LM head")


def full_weights_3d(runs, shapes, mesh):
    """The model's weights from every rank's shards: each stage's from its (data, tensor) ranks (full_weights)."""
    data_parallel, pipeline_parallel, tensor_parallel = mesh
    weights = {}
    for stage in range(pipeline_parallel):
        mine = [runs[(d * pipeline_parallel + stage) * tensor_parallel + t]
                for d in range(data_parallel) for t in range(tensor_parallel)]
        weights.update(full_weights(mine, {name: shapes[name] for name in mine[0].names}, data_parallel,
                                    tensor_parallel))
    return weights


def formula_calls_3d(sizes, mesh, num_micro_batches, stage):
    """{(group, collective): calls} one rank of pipeline stage `stage` makes per step: FSDP's all-gather and
    reduce-scatter of each of the stage's parameters once (data), 4 gathers and 4 reduce-scatters along the
    sequence per layer and micro-batch, an all-reduce per whole weight (tensor), and a send and a receive per
    micro-batch to a neighbour (pipeline)."""
    data_parallel, pipeline_parallel, tensor_parallel = mesh
    names = stage_names(sizes, stage, pipeline_parallel)
    layers, m = sizes.num_layers // pipeline_parallel, num_micro_batches
    calls = {("data", "all_gather"): len(names), ("data", "reduce_scatter"): len(names)}  # on a group of 1 too
    if tensor_parallel > 1:
        calls.update({("tensor", "all_gather"): 4 * layers * m, ("tensor", "reduce_scatter"): 4 * layers * m,
                      ("tensor", "all_reduce"): sum(not sharded_over_tensor(n) for n in names)})
    if pipeline_parallel > 1:
        calls.update({("pipeline", "isend"): m, ("pipeline", "recv"): m})
    return calls



# ---------------------------------------------------------------- context parallel: (context, tensor)

MESH_CP = ("context", "tensor")


def check_sizes_cp(sizes, mesh, world_size):
    """The mesh fills the world; heads and MLP features split over the tensor group; the sequence into a chunk per
    context rank and each chunk over the tensor group: a ValueError names what does not, before any rank starts.
    Returns the tokens of a rank's chunk."""
    from utils import ring_attention as ra

    context_parallel, tensor_parallel = check_mesh(mesh, world_size, MESH_CP)
    sp.check_sizes(dataclasses.replace(sizes, seq_len=tensor_parallel), tensor_parallel, "tensor_parallel")
    chunk = ra.check_sizes(sizes.seq_len, context_parallel)
    return divide("seq_len / context_parallel", chunk, "tensor_parallel", tensor_parallel,
                  "sequence parallel splits each context chunk over the tensor group")


def cp_tokens(inputs, targets, coordinate):
    """Rank (c, t)'s tokens: every sequence's context chunk c, tensor rank t's part of it."""
    (c, t), (context_parallel, tensor_parallel) = coordinate
    return tuple(x.chunk(context_parallel, dim=1)[c].chunk(tensor_parallel, dim=1)[t] for x in (inputs, targets))


def guard_cp(groups):
    """guard(call, arguments): the ring's sends and receives on the context group, every collective on the context
    or the tensor group; else CompositionMistake, naming the mistake, before the call runs."""
    rank = dist.get_rank()

    def guard(call, arguments):
        if call.name in PEER_NAMES and call.group != "context":
            raise CompositionMistake(
                f"rank {rank}: ring attention's {call.name} ran on the {call.group} group: the ring belongs to the "
                f"context group, whose ranks hold the other chunks of the same sequences (ring_attend(..., "
                f"group=context_group))")
        if call.name not in PEER_NAMES and call.group not in ("context", "tensor"):
            raise CompositionMistake(f"rank {rank}: a {call.name} on the {call.group} group: FSDP's collectives "
                                     f"belong to the context group, tensor parallel's to the tensor group")
    return guard


@dataclasses.dataclass
class RunCP:
    coordinate: tuple  # (context, tensor)
    positions: list = None  # the positions the first block's attention saw (RoPE's), first step
    losses: list = dataclasses.field(default_factory=list)
    shards: dict = None
    synced: dict = None
    counts: dict = None
    bytes: dict = None
    seconds: list = dataclasses.field(default_factory=list)


def train_cp_main(rank, world_size, parallelize, train_step, sizes, mesh, num_steps, seed=0, lr=1e-2):
    """Train the course's transformer on the (context, tensor) mesh: model, shards = parallelize(model, groups);
    each step unshard, loss = train_step(model, shards.shards, inputs, targets, groups) (this rank's tokens: its
    chunk of every sequence; forward, backward and the gradients' sync), AdamW on the shards, reshard. Every call
    is guarded (guard_cp); the first step is recorded (RunCP)."""
    groups, coordinate = mesh_groups(mesh, MESH_CP)
    model, shards = parallelize(build_transformer(sizes, seed), groups)
    run = RunCP(coordinate)
    first = next(iter(model.layers.values())).attention
    attend = first.attend

    def recorded(q, k, v, positions):
        run.positions = run.positions or positions.tolist()
        return attend(q, k, v, positions)
    first.attend = recorded

    def step(i):
        inputs, targets = cp_tokens(*make_tokens(sizes, seed, i), (coordinate, mesh))
        return train_step(model, shards.shards, inputs, targets, groups)

    return _train_and_record(run, shards, groups, guard_cp(groups), step, num_steps, lr)


def formula_calls_cp(sizes, mesh):
    """{(group, collective): calls} one rank makes per step: FSDP's all-gather and reduce-scatter of every
    parameter (context); sequence parallel's 4 + 4 per layer and the whole weights' all-reduce (tensor); per layer,
    the ring's C - 1 hops of K/V forward, C - 1 again backward and C of their gradients, each an isend and an irecv
    (context)."""
    context_parallel, tensor_parallel = mesh
    names = stage_names(sizes, 0, 1)
    layers = sizes.num_layers
    calls = {("context", "all_gather"): len(names), ("context", "reduce_scatter"): len(names)}
    if tensor_parallel > 1:
        calls.update({("tensor", "all_gather"): 4 * layers, ("tensor", "reduce_scatter"): 4 * layers,
                      ("tensor", "all_reduce"): sum(not sharded_over_tensor(n) for n in names)})
    if context_parallel > 1:
        hops = layers * (3 * context_parallel - 2)
        calls.update({("context", "isend"): hops, ("context", "irecv"): hops})
    return calls


def _phase_marker(log, phases):
    """mark(phase): the calls made since the last mark are `phase`'s, as (collective, group name)."""
    start = [0]

    def mark(phase):
        phases[phase] = [(call.name, call.group) for call in log[start[0]:]]
        start[0] = len(log)
    return mark


def full_weights(runs, shapes, data_parallel, tensor_parallel):
    """The model's weights from every rank's shards (in the parent): each tensor rank's parameter from its data
    group's flat shards, then the tensor ranks' pieces joined (columns' rows, rows' columns; a whole weight: tensor
    rank 0's). `shapes`: the single-process model's, by name; `runs` in rank order (rank = d * T + t)."""
    weights = {}
    for name, shape in shapes.items():
        pieces = []
        for t in range(tensor_parallel):
            local = tensor_shard(name, torch.empty(shape), t, tensor_parallel).shape
            flat = torch.cat([runs[d * tensor_parallel + t].shards[name] for d in range(data_parallel)])
            pieces.append(fsdp.unpad(flat, local))
        if name.endswith(sp.COLUMN):
            weights[name] = torch.cat(pieces, dim=0)
        elif name.endswith(sp.ROW):
            weights[name] = torch.cat(pieces, dim=1)
        else:
            weights[name] = pieces[0]
    return weights


def global_losses(runs, data_parallel):
    """The batch's loss at each step: the loss shares summed over every rank, divided by the data size."""
    return [sum(run.losses[step] for run in runs) / data_parallel for step in range(len(runs[0].losses))]
