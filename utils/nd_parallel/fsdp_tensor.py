"""2-D: FSDP x tensor (and sequence) parallel, on a (data, tensor) mesh (notebook 12, section 2).

Inside a tensor group, each transformer block is notebook 09's tensor + sequence parallel block
(utils.sequence_parallel, its collectives on the tensor group); the embedding, the final norm and the LM head stay
whole on every tensor rank, each applied to the rank's chunk of the sequence. Across the data group, every parameter a
rank holds (its tensor-parallel shard, or a whole weight) is sharded as notebook 05's FSDP shards a unit: flattened,
padded, cut into `data` equal pieces (utils.fsdp.shard).

A rank (d, t) trains on data rank d's sequences, and holds tensor rank t's chunk of their positions outside the
column/row pairs; its loss is its chunk's share of the data rank's mean loss (the mean over its chunk / T), so that
the shares of a tensor group add up to the data rank's loss. Sections 3 and 4 build on these pieces: each pipeline
stage, and the (context, tensor) mesh, is this composition on its own plane.
"""
import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from utils import fsdp, pytorch_reference
from utils import sequence_parallel as sp
from utils.bench import slowest, stopwatch
from utils.counting import bytes_written
from utils.memory import MemoryTracker
from utils.model import make_optimizer
from utils.nd_parallel.communication import (bytes_per_group, calls_per_group, communication_by_group, phase_marker,
                                             raised_in)
from utils.nd_parallel.mesh import MESH_2D, check_mesh, mesh_groups
from utils.sizes import divide
from utils.transformer import Transformer, build_transformer, lm_loss, make_tokens


def check_sizes_2d(sizes, data_parallel, tensor_parallel, world_size):
    """The mesh fills the world; heads, MLP features and the sequence split over the tensor group; the batch over
    the data group: a ValueError names what does not, before any rank starts."""
    check_mesh((data_parallel, tensor_parallel), world_size, MESH_2D)
    sp.check_sizes(sizes, tensor_parallel, "tensor_parallel")
    return divide("batch_size", sizes.batch_size, "data_parallel", data_parallel,
                  "each data-parallel rank trains on as many sequences")


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
    try:
        model, shards = parallelize(build_transformer(sizes, seed), groups["tensor"], groups["data"])
    except Exception as e:  # a library's error inside the student's code: said where it came from
        raise raised_in("parallelize_2d", e, ": the order is tensor + sequence parallel first, on the tensor group "
                        "(nd.tensor_sequence_parallel(model, tensor_group)), then FlatShards of what each rank then "
                        "holds, on the data group (FlatShards flattens the parameters it shards)") from e
    optimizer = make_optimizer(shards.parameters(), "adamw", lr)
    for step in range(num_steps):
        inputs, targets = my_tokens(*make_tokens(sizes, seed, step), coordinate, data_parallel, tensor_parallel)
        phases, tracked = {}, track_memory and step == min(1, num_steps - 1)
        tracker = MemoryTracker(lambda: shards.parameters() + list(model.parameters()), optimizer)
        elapsed = stopwatch()  # the step's seconds, and what this thread waited for a core (utils.bench)
        with communication_by_group(groups) as log, (tracker if tracked else contextlib.nullcontext()):
            mark = phase_marker(log, phases)
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
            except Exception as e:  # a collective refused its tensors (a shard's size for another group), a key
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
        run.seconds.append(elapsed())
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
        elapsed, written = stopwatch(), bytes_written()
        loss = lm_loss(model(inputs, torch.arange(sizes.seq_len)), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(elapsed())
        wire.append(None if written is None else bytes_written() - written)
        losses.append(loss.item())
    weights = {name: pytorch_reference.full_tensor(p) for name, p in model.named_parameters()}
    return losses, weights, seconds, wire


def train_and_record(run, shards, groups, guard, step, num_steps, lr):
    """The loop of train_3d_main and train_cp_main: each step unshard, loss = step(i) (the forwards, backwards and
    the gradients' sync: every shard's .grad set), every call guarded; AdamW on the shards, reshard. The first
    step's gradient shards, calls and bytes per group are recorded in `run`."""
    optimizer = make_optimizer(shards.parameters(), "adamw", lr)
    for i in range(num_steps):
        elapsed = stopwatch()
        with communication_by_group(groups, guard) as log:
            shards.unshard()
            loss = step(i)
        if i == 0:
            run.synced = {name: None if s.grad is None else s.grad.clone() for name, s in shards.shards.items()}
            run.counts, run.bytes = calls_per_group(log), bytes_per_group(log)
        optimizer.step()
        optimizer.zero_grad()
        shards.reshard()
        run.seconds.append(elapsed())
        run.losses.append(float(loss or 0.0))  # a pipeline stage without the loss returns 0
    run.shards = {name: s.detach().clone() for name, s in shards.shards.items()}
    return run


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


def agreement(runs, want, want_losses, tolerance=1e-12):
    """Lines: whether each run's losses and weights (`runs`: name: (weights by name, losses by step)) equal one
    process's (`want`, `want_losses`) to `tolerance`, then whether the first two runs' weights equal each other."""
    lines = []
    for name, (weights, losses) in runs.items():
        weight_diff = max((weights[k] - want[k]).abs().max().item() for k in want)
        loss_diff = max(abs(a - b) for a, b in zip(losses, want_losses))
        lines.append(f"{name:>9}: losses and weights against one process: largest difference below {tolerance:g}: "
                     f"{max(weight_diff, loss_diff) < tolerance}")
    if len(runs) > 1:
        (first, (ours, _)), (second, (theirs, _)) = list(runs.items())[:2]
        between = max((ours[k] - theirs[k]).abs().max().item() for k in want)
        lines.append(f"{first} against {second}: weights' largest difference below {tolerance:g}: "
                     f"{between < tolerance}")
    return "\n".join(lines)


def slowest_steps(seconds_by_rank):
    """Each step's seconds on its slowest rank (a step ends with its last rank; with what waiting for a core added to
    it, utils.bench.slowest), the first step left out (it opens gloo's connections): the samples of bench.spread."""
    return [slowest(step) for step in zip(*seconds_by_rank)][1:]
