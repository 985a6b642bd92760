"""Context parallel on a (context, tensor) mesh (notebook 12, section 4): notebook 09's ring attention on the context
group inside every block, composed with section 2's FSDP x tensor (and sequence) parallel, the context group in the
data group's place: its ranks hold the same weights (FSDP-sharded over it) and different chunks of every sequence."""
import dataclasses

import torch
import torch.distributed as dist

from utils import pytorch_reference
from utils.bench import stopwatch
from utils import sequence_parallel as sp
from utils.model import make_optimizer
from utils.nd_parallel.communication import PEER_NAMES, CompositionMistake, raised_in
from utils.nd_parallel.fsdp_tensor import sharded_over_tensor, train_and_record
from utils.nd_parallel.mesh import check_mesh, mesh_groups
from utils.nd_parallel.pipeline_3d import stage_names
from utils.sizes import divide
from utils.transformer import build_transformer, lm_loss, make_tokens

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
    try:
        model, shards = parallelize(build_transformer(sizes, seed), groups)
    except Exception as e:  # a library's error inside the student's code: said where it came from
        raise raised_in("parallelize_cp", e) from e
    run = RunCP(coordinate)
    first = next(iter(model.layers.values())).attention
    attend = first.attend

    def recorded(q, k, v, positions):
        run.positions = run.positions or positions.tolist()
        return attend(q, k, v, positions)
    first.attend = recorded

    def step(i):
        inputs, targets = cp_tokens(*make_tokens(sizes, seed, i), (coordinate, mesh))
        try:
            return train_step(model, shards.shards, inputs, targets, groups)
        except AssertionError:  # a call refused by the guard: its own words
            raise
        except Exception as e:  # a library's error inside the student's code: said where it came from
            raise raised_in("train_step", e) from e

    return train_and_record(run, shards, groups, guard_cp(groups), step, num_steps, lr)


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


def train_pytorch_cp_main(rank, world_size, sizes, mesh, num_steps, seed=0, lr=1e-2):
    """PyTorch's composition (pytorch_reference.context_parallel_transformer) trained as train_cp_main trains ours,
    each step's forward and backward inside context_parallel, which shards the tokens, the targets and the positions
    along the sequence: (each step's loss (this rank's chunk's mean), the weights at the end (whole), each step's
    seconds); or the error's text where PyTorch refuses (torch 2.13.0 on CPU: NotImplementedError, its ring has no
    sharding strategy for the CPU attention kernel)."""
    from torch.distributed.tensor.experimental import context_parallel

    model, device_mesh = pytorch_reference.context_parallel_transformer(mesh, sizes, seed)
    optimizer = make_optimizer(model.parameters(), "adamw", lr)
    losses, seconds = [], []
    for step in range(num_steps):
        inputs, targets = (x.clone() for x in make_tokens(sizes, seed, step))  # sharded in place by context_parallel
        positions = torch.arange(sizes.seq_len)
        elapsed = stopwatch()
        try:
            with context_parallel(device_mesh["context"], buffers=[inputs, targets, positions],
                                  buffer_seq_dims=[1, 1, 0]):
                loss = lm_loss(model(inputs, positions), targets)
                loss.backward()
        except NotImplementedError as e:
            return f"{type(e).__name__}: {e}"
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(elapsed())
        losses.append(loss.item())
    weights = {name: pytorch_reference.full_tensor(p) for name, p in model.named_parameters()}
    return losses, weights, seconds
