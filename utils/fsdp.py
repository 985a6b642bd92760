"""ZeRO and FSDP (notebook 05): shards, the sharded layers, the training runs the checks record, PyTorch's versions.

A unit is one layer. Its weight is flattened, padded with zeros to a multiple of the world size,
and cut into N equal contiguous shards: rank r keeps shard r. Equal shards are what all-gather and
reduce-scatter need; the padding (fewer than N elements per unit) is never read back.

    flat weight:  [ w_0 w_1 ... w_{h*h-1} 0 0 ]        padded to N * ceil(h*h / N)
    shards:       [ rank 0 | rank 1 | ... | rank N-1 ]

PyTorch's words: `unshard` is the all-gather of a unit, `reshard` (here: `free`) gives its memory
back; `unpad` drops the padding of a gathered flat buffer.

Every run here is data parallel: rank r trains on its `local_batch` of each step's batch, and the
gradients are averaged over the ranks, so every version must reproduce the single-process run.
The memory tracker lives in utils.memory.
"""
import contextlib
import dataclasses
import functools
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from utils import data_parallel, pytorch_reference
from utils.counting import bytes_written
from utils.memory import MemoryTracker, inner_optimizer
from utils.model import (
    EACH_RANK_SAME_ROWS,
    WEIGHTS,
    build_awkward_model,
    build_mlp,
    generator,
    layer_weight,
    local_batch,
    loss_fn,
    make_batch,
    make_optimizer,
    step_batches,
    train,
)
from utils.sizes import check_int, divide
from utils.tensor_parallel import local_part

ADAMW = make_optimizer([torch.zeros(1)], "adamw").defaults  # the course's AdamW settings
ADAMW = dict(lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"], foreach=False)


def check_sizes(batch_size, world_size):
    """Data parallel: the batch splits evenly over the ranks (a weight need not: it is padded)."""
    return divide("batch_size", batch_size, "world_size", world_size, EACH_RANK_SAME_ROWS)


# ---------------------------------------------------------------- shards

def shard_numel(numel, world_size):
    """Elements per shard: ceil(numel / N), so that N shards cover the unit, padding included (none: none)."""
    return math.ceil(check_int("numel", numel, 0) / check_int("world_size", world_size))


def flat_padded(tensor, world_size):
    """The tensor flattened and padded with zeros to N * shard_numel elements (a copy only if padded)."""
    flat = tensor.detach().reshape(-1)
    padding = world_size * shard_numel(flat.numel(), world_size) - flat.numel()
    return F.pad(flat, (0, padding)) if padding else flat  # no padding: a view, no copy


def shard(tensor, rank, world_size):
    """Rank `rank`'s shard of a unit: its contiguous 1/N of the flat, padded tensor (a copy)."""
    return flat_padded(tensor, world_size).chunk(world_size)[rank].clone()


def unpad(flat, shape):
    """The unit from its gathered, padded flat form: drop the padding, restore the shape (a view)."""
    return flat[:math.prod(shape)].view(shape)


def free(tensor):
    """Give a gathered tensor's memory back now, as FSDP's reshard does: its storage shrinks to 0 bytes,
    whoever still refers to it (a view, the layer, the communication library). Do not read it afterwards."""
    tensor.untyped_storage().resize_(0)


def gather_shards(shards_by_rank, shapes):
    """Full weights from every rank's shards (in the parent process, for the checks)."""
    return [unpad(torch.cat([shards[i] for shards in shards_by_rank]), shape) for i, shape in enumerate(shapes)]


def reduce_scatter_mean(grad, group=None):
    """This rank's shard of `grad` averaged over the group's ranks (default: all): the library's own, for the
    embedding unit (and for notebook 12's data group)."""
    n = dist.get_world_size(group)
    flat = flat_padded(grad, n)
    out = torch.empty(flat.numel() // n, dtype=flat.dtype)
    dist.reduce_scatter_single(out, flat, group=group)
    return out / n


# ---------------------------------------------------------------- what a ZeRO optimizer steps

def trainable_params(params, owner="the optimizer"):
    """`params` as torch.optim takes them (an iterable of tensors), as the list of those that require a gradient:
    a frozen one never changes, so it gets no shard. Refuses, naming it, what torch.optim refuses (a single tensor,
    something not a tensor, a non-leaf, an empty list), what the course's ZeRO cannot do (param groups: it has one
    set of options, its keyword arguments), and what would silently train nothing (a tensor twice, all frozen)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"params argument given to {owner} should be an iterable of Tensors, but got "
                        f"{torch.typename(params)}: a single tensor (its rows would be iterated); pass [p]")
    try:
        params = list(params)
    except TypeError:
        raise TypeError(f"params argument given to {owner} should be an iterable of Tensors, but got "
                        f"{torch.typename(params)}") from None
    seen = {}
    for i, p in enumerate(params):
        if isinstance(p, dict):
            raise TypeError(f"params[{i}] given to {owner} is a param group (a dict): the course's version takes one "
                            f"group, a list of tensors, with its options as keyword arguments (PyTorch's "
                            f"ZeroRedundancyOptimizer takes groups)")
        if not isinstance(p, torch.Tensor):
            named = " (from named_parameters()? pass parameters())" if isinstance(p, tuple) else ""
            raise TypeError(f"{owner} can only optimize Tensors, but params[{i}] is {torch.typename(p)}{named}")
        if not p.is_leaf:
            raise ValueError(f"{owner} can't optimize a non-leaf Tensor: params[{i}] is computed from others")
        if id(p) in seen:
            raise ValueError(f"params[{i}] given to {owner} is params[{seen[id(p)]}] again: give each tensor once")
        seen[id(p)] = i
    if not params:
        raise ValueError(f"{owner} got an empty parameter list")
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError(f"{owner} got only frozen parameters ({len(params)}, requires_grad=False): a frozen "
                         f"parameter never changes, so each was dropped, and none is left to train")
    return trainable


# ---------------------------------------------------------------- when: the clock a run's calls are stamped with

@dataclasses.dataclass(frozen=True)
class Moment:
    """A reading of a run's clock: which step, which phase ("forward", "backward", "optimizer"), which unit
    the layers asked for last; `tick` orders the readings."""

    tick: int = 0
    step: int = 0
    phase: str = "forward"
    unit: int = None


class Timeline:
    """The clock (utils.intercept's `clock`): the loop and the layers move it on; calling it reads it."""

    def __init__(self):
        self.now = Moment()

    def __call__(self):
        return self.now

    def enter(self, **changes):
        self.now = dataclasses.replace(self.now, tick=self.now.tick + 1, **changes)
        return self.now


@dataclasses.dataclass
class Use:
    """A layer asked for unit `unit`'s weight at `asked`; it got the output of the all-gather `call`."""

    unit: int
    asked: Moment
    call: object  # a utils.intercept.Call, or None if the weight came from no all-gather seen


class Uses(list):
    """The Use of every gathered weight; `which_gather(storage data_ptr)` says which all-gather filled a
    buffer (a MemoryTracker's gather_calls.get), looked up when the layer gets it."""

    def __init__(self):
        super().__init__()
        self.which_gather = lambda data_ptr: None


# ---------------------------------------------------------------- the sharded models

class FSDPLayer(nn.Module):
    """gelu(x @ W.T), W kept only as this rank's shard, `self.shard`: the Parameter the optimizer steps.

    `self.gather(phase)` returns the full weight when FSDPLinear asks for it ("forward" or
    "backward"): all-gathered on demand, or taken from a prefetcher. Like FSDP's unsharded parameter,
    the layer keeps the weight it gathered last (`self.gathered`): until FSDPLinear frees it, it holds
    a whole unit of memory. FSDPLinear is a Linear without bias: the notebook's units are the MLP's layers.
    """

    gathers_in_backward = True  # its backward needs the whole weight (for the input's gradient)

    def __init__(self, FSDPLinear, weight, rank, world_size):
        super().__init__()
        self.FSDPLinear, self.shape = FSDPLinear, tuple(weight.shape)
        self.shard = nn.Parameter(shard(weight, rank, world_size))
        self.gather, self.gathered = None, None

    def forward(self, x):
        return F.gelu(self.FSDPLinear.apply(x, self.shard, self.gather))


def sign_rows(x):
    """Which of 4 rows an input row picks: the signs of its first two features."""
    return (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


class SignEmbedding(nn.Module):
    """x + E[sign_rows(x)]: an embedding-like unit. Its backward needs no weight, only the rows picked."""

    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x):
        return x + self.weight[sign_rows(x)]


class _ShardedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard_, gather):
        weight = gather("forward")
        rows = sign_rows(x)
        out = x + weight[rows]
        free(weight)
        ctx.save_for_backward(rows)
        ctx.shape = weight.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):  # no gather: the weight's gradient is the rows' sums of grad_out
        (rows,) = ctx.saved_tensors
        grad_weight = grad_out.new_zeros(ctx.shape).index_add_(0, rows, grad_out)
        return grad_out, reduce_scatter_mean(grad_weight), None


class FSDPEmbedding(FSDPLayer):
    """SignEmbedding, sharded: gathered in forward only (a Prefetcher that prefetched it in backward would gather it
    in vain)."""

    gathers_in_backward = False

    def forward(self, x):
        return _ShardedEmbedding.apply(x, self.shard, self.gather)


def embedding_weight(hidden_dim, seed, dtype=torch.float64):
    w = torch.randn(4, hidden_dim, generator=generator(seed, WEIGHTS, 2000), dtype=torch.float64)
    return w.to(dtype)


def build_embedded_mlp(hidden_dim, num_layers, seed=0, dtype=torch.float64):
    """The single-process model of `build_fsdp_mlp(..., embedding=True)`: SignEmbedding, then the MLP."""
    return nn.Sequential(SignEmbedding(embedding_weight(hidden_dim, seed, dtype)),
                         *build_mlp(hidden_dim, num_layers, seed, dtype).layers)


def build_fsdp_mlp(FSDPLinear, all_gather_unit, rank, world_size, hidden_dim, num_layers, seed=0,
                   dtype=torch.float64, prefetcher=None, timeline=None, uses=None, embedding=False):
    """The course's MLP, sharded (with `embedding`: a SignEmbedding unit first). Unit i gathers with
    all_gather_unit(shard, shape), or, given `prefetcher(shards, shapes, order=...)` (a Prefetcher with its cap
    bound), through its get(i, phase). Each request moves `timeline` on and is noted in `uses`."""
    units = [FSDPLayer(FSDPLinear, layer_weight(hidden_dim, seed, i, dtype), rank, world_size)
             for i in range(check_int("num_layers", num_layers))]
    if embedding:
        units.insert(0, FSDPEmbedding(FSDPLinear, embedding_weight(hidden_dim, seed, dtype), rank, world_size))
    if prefetcher is not None:
        gatherer = prefetcher([unit.shard for unit in units], [unit.shape for unit in units],
                              order=prefetch_order(units))
        gathers = [functools.partial(gatherer.get, i) for i in range(len(units))]
    else:
        gathers = [functools.partial(_gather_on_demand, all_gather_unit, unit) for unit in units]
    for i, (unit, gather) in enumerate(zip(units, gathers)):
        unit.gather = functools.partial(_gather_and_keep, unit, gather, i, timeline or Timeline(), uses)
    return nn.Sequential(*units)


def prefetch_order(units):
    """The units each phase asks for, in the order it asks: what FSDP records in its first step (FSDP2 lets you
    set it: set_modules_to_forward_prefetch, set_modules_to_backward_prefetch). Backward goes in reverse and skips
    a unit whose backward needs no gathered weight: a prefetch of it would never be used."""
    return {"forward": list(range(len(units))),
            "backward": [i for i in reversed(range(len(units))) if units[i].gathers_in_backward]}


def _gather_on_demand(all_gather_unit, unit, phase):
    return all_gather_unit(unit.shard.detach(), unit.shape)


def _gather_and_keep(unit, gather, index, timeline, uses, phase):
    asked = timeline.enter(phase=phase, unit=index)
    unit.gathered = gather(phase)
    if uses is not None:
        uses.append(Use(index, asked, uses.which_gather(unit.gathered.untyped_storage().data_ptr())))
    return unit.gathered


class DDPAdamW:
    """Plain data parallel for comparison: every rank holds everything; the step all-reduces each gradient."""

    def __init__(self, params):
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, **ADAMW)

    def step(self):
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()


# ---------------------------------------------------------------- the runs the checks record

VERSIONS = ("ddp", "zero1", "zero2", "fsdp", "zero-pytorch", "fsdp2")
PYTORCH = ("zero-pytorch", "fsdp2")  # references: the checks compare their weights only
MODELS = ("mlp", "awkward", "embedded", "branch")  # branch: utils.data_parallel.DataBranch, refused


@dataclasses.dataclass
class Student:
    """The notebook's code a run uses (None where a version does not need it)."""

    Zero1AdamW: type = None
    Zero2AdamW: type = None
    FSDPLinear: type = None
    all_gather_unit: object = None
    Prefetcher: type = None


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run: which version, on which model; `cap`: FSDP prefetches through the Prefetcher; `doubled`:
    every tensor the optimizer steps is doubled between step 0's forward and its backward (see doubled_between)."""

    version: str
    model: str = "mlp"
    cap: int = None
    dtype: torch.dtype = torch.float64
    doubled: bool = False


@dataclasses.dataclass
class Built:
    """A model ready to train: `optimized` are the tensors the optimizer steps (shards, or whole weights),
    `held` every parameter tensor the rank keeps (what the memory tracker counts as parameters)."""

    model: nn.Module
    optimizer: object
    optimized: list
    held: list
    timeline: Timeline
    uses: list


def build_version(job, student, rank, world_size, sizes):
    """The model and optimizer of `job` on this rank (see Built)."""
    if job.version not in VERSIONS or job.model not in MODELS:
        raise ValueError(f"a job is one of {VERSIONS} on one of {MODELS}, got {job}")
    h, layers, seed, timeline, uses = sizes.hidden_dim, sizes.num_layers, sizes.seed, Timeline(), Uses()
    if job.version == "fsdp":
        prefetcher = None if job.cap is None else functools.partial(student.Prefetcher, cap=job.cap)
        model = build_fsdp_mlp(student.FSDPLinear, student.all_gather_unit, rank, world_size, h, layers, seed,
                               job.dtype, prefetcher, timeline, uses, embedding=job.model == "embedded")
        if job.model == "branch":
            branch = build_fsdp_mlp(student.FSDPLinear, student.all_gather_unit, rank, world_size, h, 1, seed + 1,
                                    job.dtype)
            model = data_parallel.DataBranch(model, branch, build_mlp(h, 1, seed + 2, job.dtype))
    elif job.version == "fsdp2":
        model = pytorch_reference.fully_shard_mlp(world_size, h, layers, seed, job.dtype)
    elif job.model == "awkward":
        model = build_awkward_model(h, seed, job.dtype)
    elif job.model == "branch":
        model = data_parallel.build_model(dataclasses.replace(sizes, model="branch"), seed, job.dtype)
    else:
        model = build_mlp(h, layers, seed, job.dtype)
    params = list(model.parameters())
    if job.version in ("fsdp", "fsdp2"):
        return Built(model, torch.optim.AdamW(params, **ADAMW), params, params, timeline, uses)
    if job.version == "zero-pytorch":
        zero = pytorch_reference.zero_redundancy_optimizer(params, torch.optim.AdamW, **ADAMW)
        return Built(model, zero, params, params, timeline, uses)
    if job.version == "ddp":
        return Built(model, DDPAdamW(params), params, params, timeline, uses)
    ZeRO = student.Zero1AdamW if job.version == "zero1" else student.Zero2AdamW
    optimizer = ZeRO(params, torch.optim.AdamW, **ADAMW)
    return Built(model, optimizer, list(optimizer.shards), params + list(optimizer.shards), timeline, uses)


@dataclasses.dataclass
class Run:
    """What one training run leaves on one rank. Memory and calls are measured over the whole run; the
    tracked step (the second: AdamW's state exists from the first on) is where `after_backward` is read."""

    weights: list  # at the end: every parameter (whole weights), or this rank's shards (FSDP)
    first_grads: list  # the .grad of each tensor the optimizer steps, as its first step saw them
    losses: list
    peak: dict  # {group: bytes} at the moment of the highest total
    units_by_phase: dict  # {(step, phase): the most gathered buffers alive at once}, in the order they ran
    after_backward: dict  # {group: bytes} right after the tracked step's backward
    whole_gradients: int  # whole weights still holding a .grad then
    calls: list  # utils.intercept.Call of the tracked step, stamped with Moments
    uses: list  # Use of every gathered weight (FSDP)


def train_and_record(rank, world_size, job, student, sizes, track_step=1):
    """Train `job` for sizes.num_steps data parallel steps under a MemoryTracker; what it did (a Run)."""
    check_sizes(sizes.batch_size, world_size)
    built = build_version(job, student, rank, world_size, sizes)
    tracker = MemoryTracker(lambda: built.held, built.optimizer, clock=built.timeline,
                            phase=lambda: (built.timeline().step, built.timeline().phase))
    built.uses.which_gather = tracker.gather_calls.get
    first_grads, after = [], {}
    used = data_parallel.UsedParameters(built.model, rank)

    def keep_first_gradients(*args):
        if not first_grads:
            first_grads.extend(_grads(built.optimized))

    @contextlib.contextmanager
    def each_step(step):
        built.timeline.enter(step=step, phase="forward", unit=None)
        used.new_step(step)
        yield

    def forward_backward(model, batch):
        loss = loss_fn(model(batch))
        if job.version not in PYTORCH:
            used.check()  # before backward: ZeRO-2's and FSDP's reduce-scatters start in it
        built.timeline.enter(phase="backward", unit=None)
        with doubled_between(built.optimized, job.doubled and built.timeline().step == 0):
            loss.backward()
        return loss

    def after_backward():  # what the rank holds between backward and the optimizer step
        if built.timeline().step == track_step and job.version not in PYTORCH:
            after.update(state=tracker.now()[0], whole=sum(p.grad is not None for p in built.model.parameters()))
        built.timeline.enter(phase="optimizer", unit=None)

    hook = inner_optimizer(built.optimizer).register_step_pre_hook(keep_first_gradients)
    with tracker if job.version not in PYTORCH else contextlib.nullcontext():  # PyTorch's: only the weights
        losses = train(built.model, built.optimizer,
                       step_batches(sizes.batch_size, sizes.hidden_dim, sizes.seed, sizes.num_steps, rank, world_size,
                                    job.dtype),
                       forward_backward=forward_backward, synchronize=after_backward, watch=each_step)
    hook.remove()
    weights = [(p.full_tensor() if job.version == "fsdp2" else p).detach().clone() for p in built.model.parameters()]
    calls = [c for c in tracker.calls if c.started_at.step == track_step]
    return Run(weights, first_grads, losses, tracker.peak, tracker.units_by_phase, after.get("state"),
               after.get("whole"), calls, list(built.uses))


@contextlib.contextmanager
def doubled_between(tensors, doubled=True):
    """Each tensor doubled in place for the block's duration, then halved back (powers of two: exact), out of
    autograd's sight. Around a backward: an FSDP that gathers its weights again in backward meets the doubled
    shards and computes the inputs' gradients with them; one that kept the weights gathered in forward does not
    (05, 07); a backward that recomputes a block meets the doubled weights, one that kept its activations does not
    (06's recompute)."""
    if doubled:
        with torch.no_grad():
            for t in tensors:
                t.data.mul_(2)  # .data: no version bump, so autograd's saved tensors do not refuse it
    try:
        yield
    finally:
        if doubled:
            with torch.no_grad():
                for t in tensors:
                    t.data.mul_(0.5)


def doubled_gradients(net, x):
    """{name: gradient} of one step of `net` on batch x with every weight doubled between forward and backward
    (doubled_between): what an FSDP of `net` that gathers its weights again in backward computes when its shards are
    doubled so (the checks of 05 and 07)."""
    loss = loss_fn(net(x))
    with doubled_between(list(net.parameters())):
        loss.backward()
    return {name: p.grad for name, p in net.named_parameters()}


def _grads(tensors):
    return [None if p.grad is None else local_part(p.grad).detach().clone() for p in tensors]


def runs_main(rank, world_size, jobs, student, sizes):
    """Each job's Run on this rank (the worker the checks spawn)."""
    return [train_and_record(rank, world_size, job, student, sizes) for job in jobs]


def bytes_per_step_main(rank, world_size, jobs, student, sizes):
    """What this rank wrote to its sockets (utils.counting.bytes_written) in one training step of each job, after
    one step that creates AdamW's state: what gloo really sends, whatever each collective's algorithm."""
    written = []
    for job in jobs:
        built = build_version(job, student, rank, world_size, sizes)
        batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, job.dtype), rank, world_size)
        for _ in range(2):
            dist.barrier()
            start = bytes_written()
            loss_fn(built.model(batch)).backward()
            built.optimizer.step()
            built.optimizer.zero_grad()
            end = bytes_written()
        written.append(end - start)
    return written


def step_time_and_peak_main(rank, world_size, named_jobs, student, sizes, repeat=3):
    """{name: ([seconds of each timed step, from the slowest rank], peak model state by group)} for each (name, Job):
    one step to create AdamW's state, one under a MemoryTracker, then `repeat` timed in turns."""
    from utils.bench import interleaved_samples

    steps, peaks = {}, {}
    for name, job in named_jobs:
        built = build_version(job, student, rank, world_size, sizes)
        batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, job.dtype), rank, world_size)

        def step(built=built, batch=batch):
            loss_fn(built.model(batch)).backward()
            built.optimizer.step()
            built.optimizer.zero_grad()

        step()
        with MemoryTracker(lambda held=built.held: held, built.optimizer) as tracker:
            step()
        steps[name], peaks[name] = step, tracker.peak
    samples = interleaved_samples(steps, repeat=repeat, warmup=0)
    return {name: (samples[name], peaks[name]) for name in steps}
