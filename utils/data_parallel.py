"""Data parallel training (notebook 02): the size rule, the training loop, its single-process reference,
PyTorch DDP's run of it, and the step-time and byte measurements.

The loop is the same for every way of synchronizing gradients; what changes is the step:

    train_data_parallel(rank, world_size, broadcast_parameters, train_step=...)     # step(model, optimizer, batch)
    train_data_parallel(rank, world_size, broadcast_parameters, gradient_sync=...)  # sync = gradient_sync(model)

With `gradient_sync`, each step is: forward, backward (the sync's hooks start the all-reduces),
`sync.finish()` (wait for them), optimizer step. Every step runs inside `utils.intercept.intercept`,
whose clock reads (how many gradients are ready, phase): so each all-reduce says when it started
and when it was waited for, in the backward pass or in finish().

Two models: the course's MLP, and `utils.model.build_awkward_model` (a frozen parameter, one used
every other forward call, a float32 parameter in a float64 model, a buffer, an embedding).

A parameter used on some ranks only (a branch on the data) would make the ranks' collectives pair up wrongly:
`UsedParameters` refuses such a step on the rank that left it out, before its gradients are synchronized
(utils.fsdp's driver uses it too).
"""
import copy
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn

from utils.bench import interleaved_samples
from utils.counting import bytes_written, calls
from utils.intercept import intercept
from utils.model import (
    EACH_RANK_SAME_ROWS,
    MLP,
    build_awkward_model,
    build_mlp,
    local_batch,
    loss_fn,
    make_batch,
    make_optimizer,
)
from utils.sizes import divide

START_SEED_STRIDE = 1000  # rank r starts from seed + 1000 r: every rank differs, rank 0 is the reference
MODELS = ("mlp", "awkward", "branch")
BACKWARD, FINISH, AFTER = "in the backward pass", "in finish()", "after finish()"  # the phases of a step


def check_sizes(batch_size, world_size, num_micro_batches=1):
    """The batch must split evenly over the ranks, and each rank's slice over its micro-batches."""
    local_batch_size = divide("batch_size", batch_size, "world_size", world_size, EACH_RANK_SAME_ROWS)
    divide("local_batch_size", local_batch_size, "num_micro_batches", num_micro_batches,
           "each micro-batch must have the same number of rows")
    return local_batch_size


class DataBranch(nn.Module):
    """`trunk`, then `branch` only if the batch's first feature is positive on average: a branch on the data, taken
    on some ranks and not on others (as an expert that no token reached), which UsedParameters refuses. `frozen`
    (requires_grad=False) is never used, on any rank: that is fine."""

    def __init__(self, trunk, branch, frozen):
        super().__init__()
        self.trunk, self.branch, self.frozen = trunk, branch, frozen.requires_grad_(False)

    def forward(self, x):
        h = self.trunk(x)
        return self.branch(h) if x[:, 0].mean() > 0 else h


def build_model(sizes, seed, dtype=torch.float64):
    if sizes.model == "awkward":
        return build_awkward_model(sizes.hidden_dim, seed, dtype)
    if sizes.model == "branch":
        h = sizes.hidden_dim
        return DataBranch(build_mlp(h, sizes.num_layers, seed, dtype), build_mlp(h, 1, seed + 1, dtype),
                          build_mlp(h, 1, seed + 2, dtype))
    return build_mlp(sizes.hidden_dim, sizes.num_layers, seed, dtype)


def state(model):
    """Copies of the parameters, then the buffers: what every rank must agree on."""
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


def state_names(model):
    return [name for name, _ in [*model.named_parameters(), *model.named_buffers()]]


def gradients(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


@dataclasses.dataclass
class DataParallelRun:
    """What one rank's run holds, step by step. Clock readings are (gradients ready, phase)."""

    start: list           # parameters and buffers after broadcast_parameters
    grads: list           # by step: the gradients the optimizer saw (None where a parameter had none)
    weights: list         # parameters and buffers at the end
    losses: list          # this rank's, by step
    calls: list           # by step: the utils.intercept.Call log
    ready_at: list        # by step: {parameter index: clock reading when its gradient was ready}
    error: str = None     # what the code under test raised, if it did (the run stops there)

    def all_reduces(self, step):
        return calls(self.calls[step], "all_reduce")


class StepClock:
    """How far the step is: how many gradients are ready (counted by hooks registered before the code
    under test registers its own), and in which phase."""

    def __init__(self, model):
        self.ready, self.phase, self.ready_at = 0, BACKWARD, {}
        for i, p in enumerate(model.parameters()):
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.gradient_ready(i))

    def gradient_ready(self, i):
        self.ready += 1
        self.ready_at[i] = self()

    def new_step(self):
        self.ready, self.phase, self.ready_at = 0, BACKWARD, {}

    def __call__(self):
        return self.ready, self.phase


class UnusedParameterError(RuntimeError):
    """A trainable parameter took no part in a step's loss on this rank (raised by UsedParameters.check)."""


class UsedParameters:
    """Which trainable parameters this rank's forward calls used in the current step, read from the autograd graph of
    each output (as DDP's find_unused_parameters does, but with no collective): local, and known before backward.

    `check()` refuses a step in which one was not used. Every rank must make the same collective calls in the same
    order (gloo pairs them by order, not by name or size); a gradient that exists on some ranks only breaks that, and
    ends in a wrong result, an unrelated error, "Connection reset by peer" or a hang. So the course does what DDP does
    without find_unused_parameters (which costs an all-reduce per step): it refuses, on the rank that left it out,
    before the step's gradients are synchronized. Frozen parameters are fine, and so are those the model names in
    `unused_alike` (left out on every rank alike, by construction: utils.model.AwkwardModel)."""

    def __init__(self, model, rank):
        alike = set(getattr(model, "unused_alike", ()))
        self.names = {p: name for name, p in model.named_parameters() if p.requires_grad and name not in alike}
        self.rank, self.step, self.used, self.checked = rank, 0, set(), False
        model.register_forward_hook(lambda module, inputs, output: self.used.update(leaves(output)))

    def new_step(self, step):
        self.step, self.used, self.checked = step, set(), False

    def check(self, *_):
        """Raise UnusedParameterError naming what this step's forward calls left out (once a step; the arguments of a
        utils.intercept `before` are ignored, so that it can run just before the step's first collective)."""
        if self.checked:
            return
        self.checked = True
        unused = [name for p, name in self.names.items() if id(p) not in self.used]
        if unused:
            raise UnusedParameterError(unused_message(unused, self.rank, self.step))


def leaves(output):
    """The ids of the leaf tensors (parameters) that the autograd graph of `output` (a tensor, or a tuple or list of
    them) reaches: those that backward would give a gradient."""
    tensors = [output] if isinstance(output, torch.Tensor) else [t for t in output if isinstance(t, torch.Tensor)]
    todo, seen, found = [t.grad_fn for t in tensors if t.grad_fn is not None], set(), set()
    found.update(id(t) for t in tensors if t.grad_fn is None and t.requires_grad)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: where a leaf's gradient goes
            found.add(id(node.variable))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def unused_message(names, rank, step):
    listed = ", ".join(names)
    return (f"rank {rank}, step {step}: trainable parameter{'s' if len(names) > 1 else ''} {listed} took no part "
            f"in this step's loss on this rank, so {'they get' if len(names) > 1 else 'it gets'} no gradient here. "
            f"If another rank used {'them' if len(names) > 1 else 'it'} (a branch on the data, an expert that no "
            f"token reached), the ranks would make different collective calls and gloo, which pairs them by order, "
            f"would sum the wrong gradients or hang: the step is refused before any gradient is synchronized. Every "
            f"trainable parameter must take part in every step's loss on every rank; freeze one that should not "
            f"train (requires_grad=False). PyTorch's DDP allows it with find_unused_parameters=True, at the cost of "
            f"one more all-reduce per step (of which parameters each rank used)")


def one_step(model, optimizer, batch, train_step=None, sync=None, clock=None, used=None):
    """train_step(model, optimizer, batch), or forward, backward, sync.finish(), optimizer step. `used`
    (UsedParameters) checks the forward before backward starts the sync's hooks."""
    if sync is None:
        return train_step(model, optimizer, batch)
    loss = loss_fn(model(batch))
    if used is not None:
        used.check()
    loss.backward()
    if clock is not None:
        clock.phase = FINISH
    sync.finish()
    if clock is not None:
        clock.phase = AFTER
    optimizer.step()
    optimizer.zero_grad()
    return loss


def outside_autograd(call, arguments):
    """Before a collective: refuse one that would write into a tensor autograd tracks.

    dist.broadcast(p) into a parameter that requires grad gives the right values, but autograd records the
    write as an in-place operation it cannot differentiate, and every backward then warns that it
    'backprops through' c10d::broadcast_ (a deprecated behaviour, to become an error)."""
    tensor = next(iter(arguments.values()), None)
    if torch.is_grad_enabled() and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        raise RuntimeError(f"dist.{call.name} into a tensor that requires grad: autograd would record the write as "
                           f"an in-place operation it cannot differentiate, and every backward would warn about it; "
                           f"write the values outside autograd, into the parameter's detached view (the same "
                           f"storage) or under torch.no_grad()")


def train_data_parallel(rank, world_size, broadcast_parameters, train_step=None, gradient_sync=None, *,
                        sizes, optimizer="sgd", dtype=torch.float64, keep_errors=False):
    """One rank's run: a different random start on every rank, rank 0's broadcast, then the steps.

    A check's own hooks (the clock's) are registered before `gradient_sync(model)` registers its own.
    With `keep_errors` (the checks), an exception from the code under test ends the run and is returned
    in `error`, with what happened before it, so that the check can explain it; an exercise not written
    yet (NotImplementedError) is raised as it is."""
    check_sizes(sizes.batch_size, world_size)
    model = build_model(sizes, sizes.seed + START_SEED_STRIDE * rank, dtype)
    run = DataParallelRun(None, [], None, [], [], [])
    try:
        with intercept(before=outside_autograd):
            broadcast_parameters(model)
        run.start = state(model)
        opt = make_optimizer(model.parameters(), optimizer)
        opt.register_step_pre_hook(lambda *_: run.grads.append(gradients(model)))
        clock, used = StepClock(model), UsedParameters(model, rank)
        sync = gradient_sync(model) if gradient_sync is not None else None
        for step in range(sizes.num_steps):
            batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step, dtype), rank,
                                world_size)
            clock.new_step()
            used.new_step(step)
            # train_step makes its own forward and backward calls: check just before its first collective
            with intercept(clock=clock, before=used.check if sync is None else None) as log:
                run.calls.append(log)
                run.ready_at.append(clock.ready_at)
                loss = one_step(model, opt, batch, train_step, sync, clock, used)
            run.losses.append(None if loss is None else loss.item())
    except (NotImplementedError, UnusedParameterError):  # not the code under test's mistake: the model's
        raise
    except Exception as e:  # noqa: BLE001 (reported by the check, after what it saw before)
        if not keep_errors:
            raise
        run.error = " ".join(f"{type(e).__name__}: {e}".split()).rstrip(".")  # one line
    run.weights = state(model)
    return run


def micro_batches(batch, world_size, num_micro_batches, ranks):
    """Micro-batch k of a step, for each k: micro-batch k of each rank in `ranks`, together."""
    slices = [local_batch(batch, r, world_size).chunk(num_micro_batches) for r in ranks]
    return [torch.cat([s[k] for s in slices]) for k in range(num_micro_batches)]


@dataclasses.dataclass
class ReferenceRun:
    start: list    # rank 0's parameters and buffers
    grads: list    # by step: the whole batch's gradients
    local: list    # by step, by rank: that rank's own gradients (its slice alone)
    weights: list  # parameters and buffers at the end
    names: list    # of the parameters and buffers

    @property
    def mixed_dtypes(self):
        """A float32 parameter in a float64 model: after step 0 every value carries float32 rounding."""
        return len({t.dtype for t in self.start}) > 1


def accumulate(model, batches):
    """Gradients of the mean of the batches' losses (each batch's loss weighted 1 / len(batches))."""
    model.zero_grad()
    for micro_batch in batches:
        (loss_fn(model(micro_batch)) / len(batches)).backward()
    return gradients(model)


def train_reference_run(sizes, world_size, num_micro_batches=1, optimizer="sgd", dtype=torch.float64):
    """One process on the whole batch, making the same forward calls as each rank (micro-batch k of the
    step is micro-batch k of every rank together): the run every rank must reproduce."""
    model = build_model(sizes, sizes.seed, dtype)
    opt = make_optimizer(model.parameters(), optimizer)
    run = ReferenceRun(state(model), [], [], None, state_names(model))
    for step in range(sizes.num_steps):
        batch = make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step, dtype)
        run.local.append([accumulate(copy.deepcopy(model), micro_batches(batch, world_size, num_micro_batches, [r]))
                          for r in range(world_size)])
        run.grads.append(accumulate(model, micro_batches(batch, world_size, num_micro_batches, range(world_size))))
        opt.step()
        opt.zero_grad()
    run.weights = state(model)
    return run


def expected_buckets(params, bucket_size_mb):
    """The buckets of notebook 02's rule: [[parameter indices], ...] in the order they are made.

    Parameters that require a gradient, in reverse order; one open bucket per dtype; a parameter joins
    its dtype's open bucket if that stays within bucket_size_mb * 2**20 bytes, else it opens a new one."""
    cap = bucket_size_mb * 2**20
    buckets, open_bucket = [], {}  # dtype -> (index into buckets, bytes so far)
    for i in reversed(range(len(params))):
        p = params[i]
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        b, size = open_bucket.get(p.dtype, (None, 0))
        if b is not None and size + nbytes <= cap:
            buckets[b].append(i)
            open_bucket[p.dtype] = (b, size + nbytes)
        else:
            buckets.append([i])
            open_bucket[p.dtype] = (len(buckets) - 1, nbytes)
    return buckets


def pytorch_ddp_bucket_bytes(rank, world_size, sizes, bucket_caps_mb, num_steps=3, dtype=torch.float32):
    """{bucket_cap_mb: the bytes of PyTorch DDP's buckets after each step}, each list in the order the buckets
    are all-reduced (None: DDP's default cap). DDP starts with one assignment and rebuilds it once, from
    the order in which the gradients arrived."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with torch.device("meta"):  # the buckets depend on the parameters' sizes, not their values: zeros are cheap
        shape = MLP(sizes.hidden_dim, sizes.num_layers)
    found = {}
    for cap in bucket_caps_mb:
        zeros = copy.deepcopy(shape).to_empty(device="cpu").to(dtype)
        with torch.no_grad():
            for p in zeros.parameters():
                p.zero_()
        model = DDP(zeros, **({} if cap is None else {"bucket_cap_mb": cap}))
        found[cap] = []
        for step in range(num_steps):
            batch = make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, step, dtype)
            loss_fn(model(local_batch(batch, rank, world_size))).backward()
            logged = model._get_ddp_logging_data()
            now = logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"]
            found[cap].append([int(n) for n in str(now).split(", ")])
    return found


# ---------------------------------------------------------------- measuring: bytes and step time

def make_train_steps(rank, world_size, versions, sizes, bucket_size_mb, dtype=torch.float32):
    """{name: a function running one training step}: each version of `versions` ({name: dict(train_step=...)
    or dict(gradient_sync=...)}) and PyTorch DDP (bucket_cap_mb=bucket_size_mb), each on its own model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, dtype), rank, world_size)
    steps, built = {}, build_model(sizes, sizes.seed, dtype)
    for name, version in {**versions, "pytorch DDP": {}}.items():
        model = copy.deepcopy(built)
        if not version:
            model = DDP(model, bucket_cap_mb=bucket_size_mb)
        optimizer = make_optimizer(model.parameters(), "sgd")
        sync = version["gradient_sync"](model) if "gradient_sync" in version else None
        train_step = version.get("train_step", lambda m, o, b: one_step(m, o, b, sync=_NoSync()))
        steps[name] = lambda m=model, o=optimizer, t=train_step, s=sync: one_step(m, o, batch, t, s)
    return steps


class _NoSync:  # PyTorch DDP synchronizes in its own hooks
    def finish(self):
        pass


def bytes_per_step(rank, world_size, versions, sizes, bucket_size_mb):
    """{name: bytes this rank wrote to its sockets in one step} (after a first step: DDP sorts its buckets)."""
    sent = {}
    for name, step in make_train_steps(rank, world_size, versions, sizes, bucket_size_mb).items():
        step()
        dist.barrier()
        before = bytes_written()
        step()
        sent[name] = None if before is None else bytes_written() - before
    return sent


def seconds_per_step(rank, world_size, versions, sizes, bucket_size_mb, repeat=5, warmup=1):
    """{name: [seconds of each timed step, from the slowest rank]} (bench.Seconds, with their waits for a core): the
    versions timed in turns, `repeat` rounds after `warmup` untimed ones, so that the spread shows next to the
    median."""
    return interleaved_samples(make_train_steps(rank, world_size, versions, sizes, bucket_size_mb), repeat, warmup)
