"""Sharded tensors and SimpleFSDP (notebook 07): placements, shards along dim 0, the runs the checks record.

A DTensor is a local tensor plus where it sits: a mesh (here 1-D: the ranks) and a placement.

    Shard(0)     rank r holds rows [r*k, (r+1)*k) of the whole tensor, k = ceil(rows / N): torch.chunk's
                 split, so the last ranks may hold fewer rows, or none (uneven shards)
    Replicate()  every rank holds the whole tensor
    Partial()    every rank holds a tensor of the whole shape; the value is their sum

Collectives need equal pieces: a shard is padded with zero rows to k rows before it is sent, and the
padding is dropped after (`pad_rows`, then a slice). FSDP as a parametrization keeps each parameter as
its Shard(0) local tensor and computes with its Replicate() form: the all-gather is the redistribution.

`record_collectives()` names the collectives a block issues, and the bytes of each one's input, whether
they come from torch.distributed (utils.intercept: the notebook's code) or from functional collectives
(`torch.distributed._functional_collectives`: what DTensor and compiled code use).

Also here: the runs the checks record (`train_main`, `units_main`: a Run per rank, measured with
`utils.memory.SettledMemoryTracker`, which is not fooled by gloo's lingering references), and the compiled version
(`functional_fully_shard`, `compiled_main`, inductor's bucketing pass on the captured graphs).
"""
import contextlib
import dataclasses
import math
import re
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from utils import pytorch_reference
from utils.fsdp import ADAMW, doubled_between
from utils.intercept import intercept
from utils.memory import SettledMemoryTracker
from utils.model import (
    EACH_RANK_SAME_ROWS,
    WEIGHTS,
    Layer,
    build_awkward_model,
    build_mlp,
    generator,
    local_batch,
    loss_fn,
    make_batch,
)
from utils.sizes import check_int, divide

MODES = ("fully_shard", "replicate")
MODELS = ("mlp", "awkward")  # what data_parallel's check trains; resharding's trains the fused model too


# ---------------------------------------------------------------- bad input, before any rank starts

def check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_mesh(mesh_size, world_size):
    """A 1-D mesh covers every rank once: its size is the world size."""
    mesh_size, world_size = check_int("mesh_size", mesh_size), check_int("world_size", world_size)
    if mesh_size != world_size:
        raise ValueError(f"a 1-D mesh of {mesh_size} ranks does not match the world of {world_size} ranks: "
                         f"init_device_mesh('cpu', ({world_size},))")
    return mesh_size


def check_shardable(model):
    """Every parameter can be cut along dim 0: a 0-dimensional one (a scalar) cannot."""
    for name, p in model.named_parameters():
        if p.dim() == 0:
            raise ValueError(f"parameter {name!r} is a scalar (0 dimensions): it cannot be sharded along dim 0; "
                             f"keep it as a tensor of shape (1,)")
    return model


def check_sizes(batch_size, world_size):
    """Data parallel: every rank gets the same number of rows of the batch."""
    return divide("batch_size", batch_size, "world_size", world_size, EACH_RANK_SAME_ROWS)


# ---------------------------------------------------------------- placements: the moves redistribute makes

# Section 1's moves, each one collective (or none); DTensor makes more (other dims, other reduce ops, to Partial).
MOVES = ((Shard(0), Replicate()), (Partial(), Replicate()), (Partial(), Shard(0)), (Replicate(), Shard(0)))


def check_move(src, dst, shape):
    """(src, dst) for a tensor of global `shape`, a negative Shard dim counted from the end as DTensor does
    (Shard(-1) of a 2-D tensor is Shard(1)); a ValueError naming it for a move that is neither none nor one of
    MOVES: a Partial that is not a sum, sharding a scalar, another dim than 0, into Partial."""
    shape = tuple(shape)
    for name, placement in (("src", src), ("dst", dst)):
        if not isinstance(placement, Placement):
            raise TypeError(f"redistribute: {name} must be a placement (Shard(0), Replicate(), Partial()), "
                            f"got {placement!r}")
    src, dst = (_normalized(placement, shape) for placement in (src, dst))
    if src == dst or (src, dst) in MOVES:
        return src, dst
    move = f"{placement_name(src)} -> {placement_name(dst)}"
    other = next((p for p in (src, dst) if p.is_partial() and p.reduce_op != "sum"), None)
    moves = ", ".join(f"{placement_name(a)} -> {placement_name(b)}" for a, b in MOVES)
    why = (f"a Partial() here is a sum; {placement_name(other)}'s value is the {other.reduce_op} over the ranks"
           if other else f"the moves here: {moves}")
    raise ValueError(f"redistribute: {move} of a tensor of shape {shape} is not a move made here ({why}); "
                     f"DTensor's redistribute makes it")


def _normalized(placement, shape):
    """Shard(dim) with dim in [0, ndim); a ValueError for a dim the shape does not have (a scalar has none)."""
    if not placement.is_shard():
        return placement
    ndim = len(shape)
    if not -ndim <= placement.dim < ndim:
        has = f"dims -{ndim} to {ndim - 1}" if ndim else "no dim: a scalar cannot be sharded"
        raise ValueError(f"redistribute: {placement_name(placement)} of a tensor of shape {shape}, which has {has}")
    return Shard(placement.dim % ndim)


def placement_name(placement):
    """Shard(0), Replicate(), Partial(), Partial("max"): as the notebook writes them."""
    if placement.is_shard():
        return f"Shard({placement.dim})"
    if placement.is_partial():
        return "Partial()" if placement.reduce_op == "sum" else f'Partial("{placement.reduce_op}")'
    return "Replicate()" if placement.is_replicate() else repr(placement)


# ---------------------------------------------------------------- shards along dim 0

def shard_rows(rows, world_size):
    """k = ceil(rows / N): the rows of every shard once padded (and of all but the last ones before)."""
    return math.ceil(check_int("rows", rows, 0) / check_int("world_size", world_size))


def local_rows(rows, rank, world_size):
    """How many of the whole tensor's rows rank `rank` holds under Shard(0) (0 for a rank past the end)."""
    k = shard_rows(rows, world_size)
    return max(0, min(rows - rank * k, k))


def local_shard(full, rank, world_size):
    """Rank `rank`'s Shard(0) piece of `full` (a view; empty for a rank past the end): DTensor's split."""
    k = shard_rows(full.shape[0], world_size)
    return full[rank * k:(rank + 1) * k]


def pad_rows(t, rows):
    """`t` with zero rows appended up to `rows` (itself if it has them already)."""
    missing = rows - t.shape[0]
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, missing]) if missing else t


def original_name(name):
    """A parameter's name in the model it came from: 'layers.0.linear.parametrizations.weight.original'
    is 'layers.0.linear.weight'."""
    return re.sub(r"parametrizations\.(\w+)\.original$", r"\1", name)


# ---------------------------------------------------------------- gathered weights remember their shard

def mark_gathered(weight, shard, rows):
    """Note on an all-gathered weight (on its base: every view of it finds it) the shard and row count it came
    from, so that it can be gathered again later instead of kept (section 3)."""
    base = weight if weight._base is None else weight._base
    base.gathered_from = (shard.detach(), rows)
    return weight


def gathered_from(t):
    """(shard, rows) if `t` is an all-gathered weight or a view of one (marked by mark_gathered), else None."""
    base = t if t._base is None else t._base
    return getattr(base, "gathered_from", None)


# ---------------------------------------------------------------- what communicates

KINDS = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter", "all_reduce": "all-reduce",
         "all_to_all": "all-to-all", "broadcast": "broadcast"}
# the argument of a torch.distributed call that is the collective's input (the first one, for the rest)
INPUTS = {"all_gather_single": "input_tensor", "all_gather_into_tensor": "input_tensor", "all_gather": "tensor",
          "reduce_scatter_single": "input", "reduce_scatter_tensor": "input", "reduce_scatter": "input_list"}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective: its kind ("all-gather", "reduce-scatter", "all-reduce", ...) and its input's bytes."""

    kind: str
    nbytes: int

    def __str__(self):
        return f"{self.kind} of {self.nbytes} bytes"


def _kind(name):
    return next((kind for prefix, kind in KINDS.items() if name.startswith(prefix)), name)


def _nbytes(x):
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0


class _FunctionalCollectives(TorchDispatchMode):
    """Logs every functional collective (what DTensor and compiled code issue); wait_tensor is not one."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and not name.startswith(("wait", "_wrap")):
            self.log.append(Collective(_kind(name), _nbytes(args[0])))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_collectives():
    """A list of the Collective issued in the block, in order, from torch.distributed and functional ones."""
    log = []

    def before(call, arguments):
        if call.name != "barrier":
            log.append(Collective(_kind(call.name), _nbytes(arguments[INPUTS.get(call.name, next(iter(arguments)))])))

    with intercept(before=before), _FunctionalCollectives(log):
        yield log


def count(log, kind):
    return sum(c.kind == kind for c in log)


# ---------------------------------------------------------------- the models and the single-process run

class FusedModel(nn.Module):
    """A layer, then a gated layer whose two weights are one parameter (as Llama's fused gate_up_proj): forward
    splits it, so the product with its second half saves for backward a view at a storage offset (hidden_dim**2),
    which resharding must rebuild at that offset. The first layer makes the input of the split products need a
    gradient: without it autograd would save no weight."""

    def __init__(self, hidden_dim):
        super().__init__()
        self.layer = Layer(hidden_dim)
        self.gate_up = nn.Linear(hidden_dim, 2 * hidden_dim, bias=False)

    def forward(self, x):
        h = self.layer(x)
        gate, up = self.gate_up.weight.chunk(2)
        return F.silu(h @ gate.T) * (h @ up.T)


def build_fused_model(hidden_dim, seed=0, dtype=torch.float64):
    """A FusedModel whose weights depend only on `seed`, randn / sqrt(hidden_dim) as the MLP's."""
    with torch.device("meta"):  # no default init: it would draw from (and advance) the global RNG
        model = FusedModel(check_int("hidden_dim", hidden_dim))
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            draw = torch.randn(p.shape, generator=generator(seed, WEIGHTS, 2000 + i), dtype=torch.float64)
            p.copy_(draw / hidden_dim**0.5)
    return model


def build_model(model, hidden_dim, num_layers, seed=0, dtype=torch.float64):
    if model not in (*MODELS, "fused"):
        raise ValueError(f"model must be one of {(*MODELS, 'fused')}, got {model!r}")
    if model == "fused":
        return build_fused_model(hidden_dim, seed, dtype)
    return build_mlp(hidden_dim, num_layers, seed, dtype) if model == "mlp" else build_awkward_model(hidden_dim, seed,
                                                                                                    dtype)


def used_parameters(model, step, names):
    """The parameters a step's forward reads: all, but the awkward model's `sometimes` on odd steps."""
    return [n for n in names if not (model == "awkward" and step % 2 and n.startswith("sometimes."))]


def train_single(model, sizes, dtype=torch.float64):
    """The single-process run every version must reproduce: ({name: final parameter}, losses by step)."""
    net = build_model(model, sizes.hidden_dim, sizes.num_layers, sizes.seed, dtype)
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
    losses = []
    for step in range(sizes.num_steps):
        loss = loss_fn(net(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step, dtype)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {name: p.detach() for name, p in net.named_parameters()}, losses


def first_gradients(model, sizes, rank=None, world_size=1, saving=contextlib.nullcontext):
    """Step 0's {name: gradient}: of the whole batch, or of one rank's slice of it; the forward inside `saving()`."""
    net = build_model(model, sizes.hidden_dim, sizes.num_layers, sizes.seed)
    batch = make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0)
    with saving():
        loss = loss_fn(net(batch if rank is None else local_batch(batch, rank, world_size)))
    loss.backward()
    return {name: p.grad for name, p in net.named_parameters() if p.requires_grad}


def storage_offset_dropped():
    """Saved-tensor hooks that give backward each saved view of a parameter rebuilt without its storage offset
    (as_strided(size, stride)): the mistake a check compares a wrong resharding run with, to name it."""
    def pack(t):
        return t.as_strided(t.size(), t.stride(), 0) if isinstance(t._base, nn.Parameter) else t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


# ---------------------------------------------------------------- memory, measured without gloo's lingering references

# ---------------------------------------------------------------- the runs the checks record

@dataclasses.dataclass
class Run:
    """What a data parallel run leaves on one rank."""

    local: dict  # {parameter name: what this rank holds at the end} (a shard, or the whole parameter)
    first_grads: dict  # {parameter name: its .grad after step 0's backward}
    losses: list  # this rank's loss (of its slice) by step
    calls: list  # by step: the Collective issued
    units_by_phase: dict  # {(step, phase): the most gathered buffers alive at once}
    peak: dict  # {group: bytes} at the highest total over the run (utils.memory.MemoryTracker)
    initial: dict = dataclasses.field(default_factory=dict)  # {parameter name: what this rank held before step 0}
    storage: dict = dataclasses.field(default_factory=dict)  # {parameter name: bytes of the storage it keeps alive}


def train_main(rank, world_size, data_parallel, model, mode, sizes, reshard=None, dtype=torch.float64, track=True,
               doubled=False):
    """Train utils.model's `model` made data parallel by the notebook's `data_parallel(model, mode)` for
    sizes.num_steps AdamW steps; each forward inside `reshard()` if given; under a memory tracker if `track`;
    with `doubled`, every parameter this rank holds doubled between step 0's forward and backward
    (utils.fsdp.doubled_between). Returns a Run."""
    net = data_parallel(build_model(model, sizes.hidden_dim, sizes.num_layers, sizes.seed, dtype), mode)
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
    now = {"step": 0, "phase": "forward"}
    tracker = SettledMemoryTracker(lambda: list(net.parameters()), optimizer,
                                   phase=lambda: (now["step"], now["phase"]))
    losses, calls, first_grads = [], [], {}
    with tracker if track else contextlib.nullcontext():
        for step in range(sizes.num_steps):
            batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step, dtype), rank,
                                world_size)
            now.update(step=step, phase="forward")
            with record_collectives() as log:
                with reshard() if reshard is not None else contextlib.nullcontext():
                    loss = loss_fn(net(batch))
                now["phase"] = "backward"
                with doubled_between(list(net.parameters()), doubled and step == 0):
                    loss.backward()
            if step == 0:
                first_grads = {original_name(n): p.grad.clone() for n, p in net.named_parameters()
                               if p.grad is not None}
            now["phase"] = "optimizer"
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            calls.append(log)
    local = {original_name(n): p.detach().clone() for n, p in net.named_parameters()}
    return Run(local, first_grads, losses, calls, tracker.units_by_phase, tracker.peak)


def runs_main(rank, world_size, data_parallel, jobs, sizes, reshard=None, track=False):
    """train_main for each (model, mode, reshard?[, doubled?]) in `jobs`, in order: the worker the checks spawn."""
    return [train_main(rank, world_size, data_parallel, model, mode, sizes, reshard if resharded else None,
                       track=track, doubled=any(doubled)) for model, mode, resharded, *doubled in jobs]


def notebook_05_peak(rank, world_size, job, student, sizes):
    """Peak model state by group of notebook 05's versions (utils.fsdp's Job, Student), as train_main measures it:
    one step to create AdamW's state, one under the tracker."""
    from utils import fsdp

    built = fsdp.build_version(job, student, rank, world_size, sizes)
    batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, job.dtype), rank, world_size)
    for tracked in (False, True):
        with SettledMemoryTracker(lambda: built.held, built.optimizer) if tracked else contextlib.nullcontext() as t:
            loss_fn(built.model(batch)).backward()
            built.optimizer.step()
            built.optimizer.zero_grad()
    return t.peak


def fsdp2_main(rank, world_size, sizes, dtype=torch.float64):
    """PyTorch's FSDP2 on the MLP, trained as train_main: ({name: whole parameter}, losses)."""
    net = pytorch_reference.fully_shard_mlp(world_size, sizes.hidden_dim, sizes.num_layers, sizes.seed, dtype)
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
    losses = []
    for step in range(sizes.num_steps):
        batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step, dtype), rank, world_size)
        loss = loss_fn(net(batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {n: p.full_tensor().detach() for n, p in net.named_parameters()}, losses


# ---------------------------------------------------------------- units: one all-gather per unit of parameters

UNITS = ("layer", "pair", "model")


def wrap_units(model, FlatUnit, unit):
    """The MLP with FlatUnit around each layer ("layer"), each pair of layers ("pair") or the whole model."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    if unit == "model":
        return FlatUnit(model)
    size = 1 if unit == "layer" else 2
    layers = list(model.layers)
    model.layers = nn.ModuleList(FlatUnit(nn.Sequential(*layers[i:i + size])) for i in range(0, len(layers), size))
    return model


def num_units(unit, num_layers):
    return {"layer": num_layers, "pair": math.ceil(num_layers / 2), "model": 1}[unit]


def units_runs_main(rank, world_size, FlatUnit, units, sizes):
    """units_main for each unit size in `units`, in one launch."""
    return [units_main(rank, world_size, FlatUnit, unit, sizes) for unit in units]


def units_main(rank, world_size, FlatUnit, unit, sizes, dtype=torch.float64):
    """Train the MLP with the notebook's FlatUnit as `unit` units for sizes.num_steps AdamW steps, under the
    memory tracker: a Run whose `local` is {parameter name: this rank's flat shard}."""
    net = wrap_units(build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed, dtype), FlatUnit, unit)
    initial = {name: p.detach().clone() for name, p in net.named_parameters()}
    storage = {name: p.untyped_storage().nbytes() for name, p in net.named_parameters()}  # a view's: its base's
    optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
    now = {"step": 0, "phase": "forward"}
    tracker = SettledMemoryTracker(lambda: list(net.parameters()), optimizer, phase=lambda: (now["step"], now["phase"]))
    losses, calls = [], []
    with tracker:
        for step in range(sizes.num_steps):
            batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step, dtype), rank,
                                world_size)
            now.update(step=step, phase="forward")
            with record_collectives() as log:
                loss = loss_fn(net(batch))
                now["phase"] = "backward"
                loss.backward()
            now["phase"] = "optimizer"
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            calls.append(log)
    local = {name: p.detach().clone() for name, p in net.named_parameters()}
    return Run(local, {}, losses, calls, tracker.units_by_phase, tracker.peak, initial, storage)


# ---------------------------------------------------------------- the compiler sees the collectives

class FunctionalUnshard(torch.autograd.Function):
    """The all-gather of section 2 with functional collectives (they return a new tensor, so the compiler
    can trace them): all-gather in forward, reduce-scatter and average in backward."""

    @staticmethod
    def forward(ctx, shard, rows):
        n = dist.get_world_size()
        ctx.rows = rows
        padded = funcol.all_gather_single(pad_rows(shard, shard_rows(rows, n)), 0, dist.group.WORLD)
        return padded[:rows]

    @staticmethod
    def backward(ctx, grad):
        n, rank = dist.get_world_size(), dist.get_rank()
        padded = pad_rows(grad, n * shard_rows(ctx.rows, n))
        summed = funcol.reduce_scatter_single(padded, "sum", 0, dist.group.WORLD)
        return summed[:local_rows(ctx.rows, rank, n)] / n, None


class FunctionalShard(nn.Module):
    """A parametrization: the parameter is this rank's Shard(0) rows; reading it all-gathers them.

    The gather is checkpointed (SimpleFSDP's reshard after forward, compiled): every node of the region is tagged
    for recomputation, and the min-cut partitioner (recording_backend's, inductor's) then saves the shard for
    backward and gathers it again there. In eager mode the checkpoint changes nothing: the gathered weight is
    saved by the layer's product, outside the region (eager's way is section 3's saved_tensors_hooks)."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def forward(self, shard):
        return checkpoint(FunctionalUnshard.apply, shard, self.rows, use_reentrant=False)

    def right_inverse(self, full):
        return local_shard(full, dist.get_rank(), dist.get_world_size()).clone()


def functional_fully_shard(model):
    """Every parameter of `model` sharded with FunctionalShard (the compiled version of section 2)."""
    for module in list(check_shardable(model).modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            parametrize.register_parametrization(module, name, FunctionalShard(p.shape[0]), unsafe=True)
    return model


def collective_nodes(gm):
    """The functional collectives of a captured graph, in order, by name ('all_gather_into_tensor', ...)."""
    return [node.target.__name__.split(".")[0] for node in gm.graph.nodes
            if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional"]


def bucket_collectives(gm):
    """Inductor's own bucketing passes on a captured graph (torch._inductor.fx_passes.bucketing): neighbouring
    all-gathers, and neighbouring reduce-scatters, merged into one over a flat buffer. The passes leave new
    nodes out of order (inductor's scheduler sorts them later): a stable topological sort puts them back."""
    from torch._inductor.fx_passes.bucketing import bucket_all_gather, bucket_reduce_scatter
    from torch._inductor.pattern_matcher import stable_topological_sort

    bucket_all_gather(gm)
    bucket_reduce_scatter(gm)
    stable_topological_sort(gm.graph)
    gm.graph.lint()
    gm.recompile()


class Graph(NamedTuple):
    """What recording_backend notes of a graph AOTAutograd hands it."""

    kind: str  # "forward" or "backward"
    captured: list  # its collective nodes, in order, as captured
    run: list  # the same after bucket_collectives (with bucket=True), as it runs
    saved: list  # backward: the shapes of the tensors the forward saved for it (its inputs but the gradients)


def recording_backend(graphs, bucket=False, partition="min_cut"):
    """aot_eager that also notes a Graph for each graph AOTAutograd hands it, forward then backward. Its partitioner
    is inductor's ("min_cut"), which honours recomputation tags; aot_eager's own ("default") ignores them."""
    from functorch.compile import default_partition, make_boxed_func, min_cut_rematerialization_partition

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            captured = collective_nodes(gm)
            if bucket:
                bucket_collectives(gm)
            saved = [tuple(node.meta["val"].shape) for node in gm.graph.find_nodes(op="placeholder")
                     if kind == "backward" and not node.name.startswith("tangents")
                     and isinstance(node.meta["val"], torch.Tensor)]  # not a size (a SymInt, if shapes are dynamic)
            graphs.append(Graph(kind, captured, collective_nodes(gm), saved))
            return make_boxed_func(gm.forward)
        return compile_graph

    partitioners = {"min_cut": min_cut_rematerialization_partition, "default": default_partition}
    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=partitioners[partition])


def compiled_main(rank, world_size, sizes, backend="aot_eager", bucket=False, partition="min_cut"):
    """The MLP under functional_fully_shard, trained eagerly and compiled (fullgraph=True; under aot_eager, with
    `bucket`, the collectives bucketed; `partition`: recording_backend's), the same steps: (eager losses, compiled
    losses, [Graph], whether the final shards are equal bit for bit)."""
    runs, graphs = {}, []
    for compiled in (False, True):
        net = functional_fully_shard(build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed))
        optimizer = torch.optim.AdamW(net.parameters(), **ADAMW)
        if compiled:
            chosen = recording_backend(graphs, bucket, partition) if backend == "aot_eager" else backend
            # dynamic=False: a call with other sizes in the same process (under torchrun every call is) compiles anew
            # with static shapes, as each fresh rank process does, instead of recompiling with symbolic sizes
            forward = torch.compile(net, backend=chosen, fullgraph=True, dynamic=False)
        else:
            forward = net
        losses = []
        for step in range(sizes.num_steps):
            batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step), rank, world_size)
            loss = loss_fn(forward(batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs[compiled] = losses, [p.detach().clone() for p in net.parameters()]
    same_weights = all(torch.equal(a, b) for a, b in zip(runs[False][1], runs[True][1]))
    return runs[False][0], runs[True][0], graphs, same_weights
