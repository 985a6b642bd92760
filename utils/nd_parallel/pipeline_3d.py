"""3-D: pipeline stages on a (data, pipeline, tensor) mesh (notebook 12, section 3). Each pipeline stage is section 2's
composition (utils.nd_parallel.fsdp_tensor) on its own (data, tensor) plane, holding its share of the layers; between
the stages, notebook 04's 1F1B sends the hidden states forward and their gradients backward to the neighbouring
pipeline coordinate with the same data and tensor coordinates (rank -/+ T)."""
import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from utils import pytorch_reference
from utils.bench import stopwatch
from utils import sequence_parallel as sp
from utils.model import make_optimizer
from utils.nd_parallel.communication import PEER_NAMES, CompositionMistake, peer_of, raised_in
from utils.nd_parallel.fsdp_tensor import full_weights, my_tokens, sharded_over_tensor, train_and_record
from utils.nd_parallel.mesh import MESH_3D, check_mesh, mesh_groups
from utils.sizes import check_int, divide
from utils.transformer import Transformer, build_transformer, make_tokens


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


def guard_3d(groups, tensor_parallel, journal=None, mesh=None, hidden_shape=None):
    """guard(call, arguments) for communication_by_group: a send/recv only to a pipeline neighbour, a collective
    only on the data or the tensor group; else CompositionMistake, naming the mistake, before the call runs. Each
    send/recv let through is written to `journal` (a line-buffered file, if given) as "name peer": if the ranks
    stall, the parent reads which messages were never paired (unpaired_messages). With `hidden_shape`, a message
    of another shape or dtype than a micro-batch's float64 hidden states is refused too (gloo would abort the
    receiving process)."""
    neighbours = pipeline_neighbours(groups["pipeline"])
    rank = dist.get_rank()
    data_parallel, pipeline_parallel = (mesh or (None, None, None))[:2]

    def guard(call, arguments):
        if call.name in PEER_NAMES:
            peer = peer_of(call.name, arguments)
            tensor = arguments.get("tensor")
            if hidden_shape is not None and isinstance(tensor, torch.Tensor) and (
                    tuple(tensor.shape), tensor.dtype) != (hidden_shape, torch.float64):
                what = "receives into" if call.name in ("recv", "irecv") else "sends"
                raise CompositionMistake(
                    f"rank {rank}'s {call.name} {what} a {tensor.dtype} tensor of shape {tuple(tensor.shape)}; what "
                    f"travels between stages is a micro-batch's hidden states (or their gradient), float64 of shape "
                    f"{hidden_shape} (micro-batch, this rank's chunk of positions, dim): receive into "
                    f"nd.hidden_like(tokens, model.sizes), a gradient into torch.empty_like(y)")
            if peer is None:  # gloo's "any source": right only where the one rank that sends is the right one
                raise CompositionMistake(
                    f"rank {rank}'s {call.name} names no peer (None: from any rank): a message comes from one "
                    f"pipeline neighbour, named (the previous stage's rank - T for hidden states, the next stage's "
                    f"rank + T for their gradient); this stage's neighbours are {list(neighbours)} (None: no stage "
                    f"there), so a gradient asked of the previous stage, or hidden states of the next, has no peer")
            if peer in neighbours and call.group in ("pipeline", "world"):
                journal_message(journal, call.name, peer)
                return
            if peer in (rank - 1, rank + 1) and peer not in neighbours:
                raise CompositionMistake(
                    f"rank {rank}'s {call.name} talks to rank {peer}, its tensor neighbour (rank +/- 1): the next "
                    f"pipeline stage with the same data and tensor coordinates is rank +/- T = {tensor_parallel} "
                    f"(dist.get_global_rank(pipeline_group, stage +/- 1), or group_dst/group_src on the pipeline "
                    f"group)")
            step = abs(peer - rank) if peer is not None else None
            strides = {"the data size D": data_parallel, "the pipeline size P": pipeline_parallel,
                       "P x T, the data dimension's stride": pipeline_parallel * tensor_parallel}
            used = [name for name, size in strides.items() if size == step and size != tensor_parallel]
            raise CompositionMistake(
                f"rank {rank}'s {call.name} on the {call.group} group talks to rank {peer}, not to a pipeline "
                f"neighbour {[n for n in neighbours if n is not None]}" + (
                    f": a step of {step} ranks ({' or '.join(used)}); the pipeline dimension's stride is T = "
                    f"{tensor_parallel}, the tensor group's size (rank +/- T)" if used else ""))
        if call.group not in ("data", "tensor"):
            on = f"the {call.group} group" if call.group != "other" else \
                f"a group of ranks {dist.get_process_group_ranks(arguments['group'])}"  # not one of the mesh's
            raise CompositionMistake(
                f"rank {rank}: a {call.name} on {on}: the gradients were synchronised over more "
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
    order: list = None  # first step: "F" and "B" in the order the stage's forwards and backwards ran


def train_3d_main(rank, world_size, parallelize, train_step, sizes, mesh, num_micro_batches, num_steps, seed=0,
                  lr=1e-2, journal_dir=None):
    """Train the course's transformer on the (data, pipeline, tensor) mesh: model, shards = parallelize(model,
    groups); each step unshard, then loss = train_step(model, shards.shards, micro_batches, groups) (its stage's
    forwards and backwards of this rank's micro-batches, and the gradients' sync: every shard's .grad set), AdamW
    on the shards, reshard. Every call is guarded (guard_3d; its sends and receives journaled in `journal_dir`, one
    file per rank, if given); the first step is recorded (Run3D)."""
    data_parallel, pipeline_parallel, tensor_parallel = mesh
    groups, coordinate = mesh_groups(mesh, MESH_3D)
    try:
        model, shards = parallelize(build_transformer(sizes, seed), groups)
    except Exception as e:  # a library's error inside the student's code: said where it came from
        raise raised_in("parallelize_3d", e) from e
    run = Run3D(coordinate, sorted(shards.shards))
    want = sorted(stage_names(sizes, coordinate[1], pipeline_parallel))
    run.error = "" if run.names == want else _stage_hint(run.names, want, coordinate[1], pipeline_parallel)
    wrong = torch.tensor([float(bool(run.error))])
    dist.all_reduce(wrong, op=dist.ReduceOp.MAX)  # every rank stops if one stage is wrong (not logged: the check's)
    if wrong.item():
        return run
    hidden = (sizes.batch_size // data_parallel // num_micro_batches, sizes.seq_len // tensor_parallel, sizes.dim)
    order = []
    model.register_forward_hook(lambda module, args, output: _record_forward(order, output))

    def step(i):
        inputs, targets = my_tokens(*make_tokens(sizes, seed, i), coordinate[::2], data_parallel, tensor_parallel)
        micro_batches = list(zip(inputs.chunk(num_micro_batches), targets.chunk(num_micro_batches)))
        order.clear()
        try:
            loss = train_step(model, shards.shards, micro_batches, groups)
        except AssertionError:  # a call refused by the guard: its own words
            raise
        except Exception as e:  # a library's error inside the student's code: said where it came from
            raise raised_in("train_step", e) from e
        run.order = list(order) if i == 0 else run.order
        return loss

    with contextlib.ExitStack() as stack:
        journal = stack.enter_context(open(os.path.join(journal_dir, f"{rank}"), "w", buffering=1)) \
            if journal_dir else None
        return train_and_record(run, shards, groups, guard_3d(groups, tensor_parallel, journal, mesh, hidden), step,
                                 num_steps, lr)


def _record_forward(order, output):
    """A forward hook's work: "F" now, and "B" when autograd reaches the output's gradient (the backward)."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
        order.append("F")
        output.register_hook(lambda grad: order.append("B"))


def journal_message(journal, name, peer):
    """Write a send/recv about to run (`name`: send, isend, recv, irecv; `peer`: the global rank) to `journal`, a
    line-buffered file or None, for unpaired_messages to read if the ranks stall."""
    if journal is not None:
        journal.write(f"{name} {peer}\n")


def unpaired_messages(journal_dir, world_size):
    """From the journals of a run that stalled: [(sender, receiver, sent, received)] for every pair of ranks whose
    sends (send, isend) and receives (recv, irecv) do not pair up; None when a rank left no journal."""
    names = {rank: os.path.join(journal_dir, f"{rank}") for rank in range(world_size)}
    if not all(os.path.exists(path) for path in names.values()):
        return None
    sent, received = {}, {}
    for rank, path in names.items():
        with open(path) as journal:
            for name, peer in (line.split() for line in journal if line.strip()):
                pair, counts = ((rank, int(peer)), sent) if "send" in name else ((int(peer), rank), received)
                counts[pair] = counts.get(pair, 0) + 1
    return [(a, b, sent.get((a, b), 0), received.get((a, b), 0)) for a, b in sorted(set(sent) | set(received))
            if sent.get((a, b), 0) != received.get((a, b), 0)]


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


def train_pytorch_3d_main(rank, world_size, sizes, mesh, num_micro_batches, num_steps, seed=0, lr=1e-2):
    """PyTorch's 3-D composition (pytorch_reference.pipeline_fsdp_tensor_parallel_transformer) trained as
    train_3d_main trains ours: (each step's loss (the data rank's, on the last stage; None elsewhere), the stage's
    weights at the end (whole), each step's seconds)."""
    model, schedule, device_mesh = pytorch_reference.pipeline_fsdp_tensor_parallel_transformer(
        mesh, num_micro_batches, sizes, seed)
    data_rank, stage, _ = device_mesh.get_coordinate()
    optimizer = make_optimizer(model.parameters(), "adamw", lr)
    losses, seconds = [], []
    for step in range(num_steps):
        inputs, targets = (x.chunk(mesh[0])[data_rank] for x in make_tokens(sizes, seed, step))
        elapsed, micro_losses = stopwatch(), []
        schedule.step(*([inputs] if stage == 0 else []), target=targets, losses=micro_losses)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(elapsed())
        losses.append(sum(loss.item() for loss in micro_losses) / num_micro_batches if micro_losses else None)
    weights = {name: pytorch_reference.full_tensor(p) for name, p in model.named_parameters()}
    return losses, weights, seconds
