"""Checks for notebook 02 (data parallel): gradient averaging, micro-batches, overlap, buckets, DDP.

Every check runs the student's code on two models: the course's MLP and `utils.model.build_awkward_model`
(a frozen parameter, a parameter used every other forward call, a float32 parameter in a float64 model,
a buffer, an embedding), and compares each rank, step by step, with one process on the whole batch
(`utils.data_parallel.train_reference_run`, which makes the same forward calls). The gradient syncs are
also watched: each all-reduce's size, whether it is asynchronous, when it starts and when it is waited
for, read off a clock of (gradients ready, phase of the step).
"""
import torch
import torch.distributed as dist

from utils import data_parallel as dp
from utils import pytorch_reference
from utils.checks import CHECK_TIMEOUT, TOLERANCE, diagnose_gradient, max_abs_diff
from utils.launch import spawn
from utils.model import Sizes, loss_fn

FLOAT32_TOLERANCE = 1e-5  # relative: the awkward model's float32 `gate`, summed in another order, and
# everything it touches after step 0 (the gate's float32 rounding reaches every float64 value)
AWKWARD = ("frozen.weight is frozen (requires_grad=False: no gradient, no hook), sometimes.weight gets no "
           "gradient every other step (its .grad stays None, as in one process), gate is float32 in a float64 "
           "model, shift is a buffer")


def _sizes(hidden_dim, num_layers, batch_size, num_steps, seed, model="mlp"):
    return Sizes(hidden_dim, num_layers, batch_size, num_steps, seed, model)


def _both_models(sizes):
    return [sizes, Sizes(**{**vars(sizes), "model": "awkward"})]


def _run_main(rank, world_size, jobs):
    """Several training runs in one launch: [(kind, kwargs)], kind 'ours' or 'ddp'."""
    return [dp.train_data_parallel(rank, world_size, **kwargs, keep_errors=True) if kind == "ours" else
            pytorch_reference.train_ddp(rank, world_size, **kwargs) for kind, kwargs in jobs]


def _launch(world_size, jobs):
    """runs[j][rank]: job j's result on each rank."""
    results = spawn(_run_main, world_size, jobs, timeout=CHECK_TIMEOUT)
    return [[results[rank][j] for rank in range(world_size)] for j in range(len(jobs))]


def _close(got, want, float32=False):
    """Equal to float64 precision, or to float32 precision for a float32 value (or where `float32`)."""
    exact = want.dtype == torch.float64 and not float32
    tolerance = TOLERANCE if exact else FLOAT32_TOLERANCE * max(1.0, want.abs().max().item())
    return got is not None and got.dtype == want.dtype and max_abs_diff(got, want) <= tolerance


def _label(name, sizes, extra=""):
    return f"{name} ({sizes.model}{extra})"


def _later_step(step):
    return "" if step == 0 else f" (step {step - 1} was right: reset what your code keeps between steps)"


# ---------------------------------------------------------------- values: start, gradients, weights

ERROR_HINTS = [  # (words in the error, what they usually mean)
    ("dtype", "a flat buffer holds one dtype: keep one open bucket per dtype"),
    ("hook", "a frozen parameter (requires_grad=False) gets no gradient: register no hook on it"),
    ("NoneType", "something is None: a parameter without a gradient in this step has .grad None (skip it), and "
                 "a bucket that did not fill up has no handle until finish() starts its all-reduce"),
]


def check_errors(label, runs, sizes):
    for rank, run in enumerate(runs):
        if run.error is not None:
            hints = [f" {hint}." for words, hint in ERROR_HINTS if words in run.error][:1]
            awkward = f" On this model, {AWKWARD}." if sizes.model == "awkward" else ""
            raise AssertionError(f"{label}: rank {rank} raised {run.error}.{''.join(hints)}{awkward}")


def check_start(label, runs, reference, world_size):
    """After broadcast_parameters, every rank holds rank 0's parameters and buffers."""
    for rank, run in enumerate(runs):
        for i, (got, want) in enumerate(zip(run.start, reference.start)):
            if _close(got, want):
                continue
            name = reference.names[i]
            if i >= len(reference.grads[0]):
                hint = "it is a buffer: broadcast model.buffers() too"
            elif all(_close(runs[r].start[i], runs[0].start[i]) for r in range(world_size)):
                hint = "every rank holds the same value, but not rank 0's: broadcast with src=0"
            else:
                hint = "ranks disagree: broadcast every parameter (frozen ones too) and buffer from rank 0"
            raise AssertionError(f"{label}: after broadcast_parameters, rank {rank}'s {name} differs from rank 0's "
                                 f"starting {name}; {hint}")


def _gradient_hint(got, want, local, world_size, num_micro_batches, unexplained):
    if want is None:
        return "it should stay None: no gradient reached it in this step (as in one process)"
    return diagnose_gradient(got, want, local, world_size, num_micro_batches, unexplained)


def check_gradients(label, runs, reference, world_size, num_micro_batches=1, unexplained=""):
    """At every step, the optimizer sees the whole batch's gradient (None where one process has None)."""
    for rank, run in enumerate(runs):
        if len(run.grads) != len(reference.grads):
            raise AssertionError(f"{label}: rank {rank} called optimizer.step() {len(run.grads)} times in "
                                 f"{len(reference.grads)} steps: step once per batch, after its last micro-batch")
    for step, want_step in enumerate(reference.grads):
        for rank, run in enumerate(runs):
            for i, (got, want) in enumerate(zip(run.grads[step], want_step)):
                loose = step > 0 and reference.mixed_dtypes
                if (got is None and want is None) or (want is not None and _close(got, want, loose)):
                    continue
                hint = _gradient_hint(got, want, reference.local[step][rank][i], world_size, num_micro_batches,
                                      unexplained)
                raise AssertionError(f"{label}: at step {step}, the gradient of {reference.names[i]} on rank {rank} "
                                     f"is not the whole batch's gradient; {hint}{_later_step(step)}")


def check_weights(label, runs, reference):
    """After the last step, every rank holds the single-process run's parameters and buffers."""
    for rank, run in enumerate(runs):
        for i, (got, want) in enumerate(zip(run.weights, reference.weights)):
            if not _close(got, want, reference.mixed_dtypes):
                raise AssertionError(f"{label}: at the end, rank {rank}'s {reference.names[i]} differs from the "
                                     f"single-process run by {max_abs_diff(got, want):.3g} (the gradients the "
                                     f"optimizer saw were right: look at what happens after them)")


def check_values(label, runs, reference, world_size, num_micro_batches=1, unexplained=""):
    check_start(label, runs, reference, world_size)
    check_gradients(label, runs, reference, world_size, num_micro_batches, unexplained)
    check_weights(label, runs, reference)


# ---------------------------------------------------------------- data parallel and micro-batches

def _naive_step(average_gradients):
    """The notebook's train_step: forward, backward, average_gradients, optimizer step."""
    def train_step(model, optimizer, batch):
        loss = loss_fn(model(batch))
        loss.backward()
        average_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return train_step


def _accumulated_step(average_gradients, num_micro_batches):
    """The check's own micro-batch step, with the student's average_gradients: what one round costs."""
    def train_step(model, optimizer, batch):
        dp.accumulate(model, batch.chunk(num_micro_batches))
        average_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
    return train_step


def _micro_step(train_step_with_micro_batches, num_micro_batches):
    return lambda model, optimizer, batch: train_step_with_micro_batches(model, optimizer, batch, num_micro_batches)


def check_data_parallel(broadcast_parameters, average_gradients, world_size, hidden_dim, num_layers, batch_size,
                        num_steps, seed=0):
    """Naive DDP with SGD and AdamW, on the MLP and the awkward model: every rank, every step, the
    single-process run's parameters and gradients."""
    dp.check_sizes(batch_size, world_size)
    cases = [(s, o) for s in _both_models(_sizes(hidden_dim, num_layers, batch_size, num_steps, seed))
             for o in ("sgd", "adamw")]
    jobs = [("ours", dict(broadcast_parameters=broadcast_parameters, train_step=_naive_step(average_gradients),
                          sizes=s, optimizer=o)) for s, o in cases]
    for (sizes, optimizer), runs in zip(cases, _launch(world_size, jobs)):
        label = _label("data parallel", sizes, f", {optimizer}")
        check_errors(label, runs, sizes)
        check_values(label, runs, dp.train_reference_run(sizes, world_size, 1, optimizer), world_size)
    print(f"data parallel: correct on {world_size} ranks with SGD and AdamW, on the MLP and on a model with a frozen "
          f"parameter, an unused one, mixed dtypes and a buffer; at each of {num_steps} steps every rank's gradients "
          f"and parameters equal the single-process run on the whole batch")


def check_all_reduce_counts(label, runs, rounds):
    """runs: the student's; rounds: runs of the check's own step, which averages once per step."""
    for rank, run in enumerate(runs):
        counts = [run.all_reduces(s) for s in range(len(run.calls))]
        once = [rounds[rank].all_reduces(s) for s in range(len(run.calls))]
        if counts != once:
            per_micro = " (a round per micro-batch)" if any(c > o for c, o in zip(counts, once)) else ""
            raise AssertionError(f"{label}: rank {rank} made {counts} all-reduces in steps {list(range(len(counts)))}"
                                 f"{per_micro}; average_gradients once per step makes {once}: accumulate the "
                                 f"gradients of every micro-batch locally, then communicate once per step")


def check_micro_batches(broadcast_parameters, average_gradients, train_step_with_micro_batches, num_micro_batches,
                        world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """Gradient accumulation: the single-process run's gradients, and one round of all-reduces per step."""
    dp.check_sizes(batch_size, world_size, num_micro_batches)
    models = _both_models(_sizes(hidden_dim, num_layers, batch_size, num_steps, seed))
    steps = [_micro_step(train_step_with_micro_batches, num_micro_batches),
             _accumulated_step(average_gradients, num_micro_batches)]
    jobs = [("ours", dict(broadcast_parameters=broadcast_parameters, train_step=step, sizes=s))
            for s in models for step in steps]
    runs = _launch(world_size, jobs)
    name = f"train_step_with_micro_batches ({num_micro_batches} micro-batches)"
    for k, sizes in enumerate(models):
        label, (ours, rounds) = _label(name, sizes), runs[2 * k:2 * k + 2]
        check_errors(label, ours, sizes)
        reference = dp.train_reference_run(sizes, world_size, num_micro_batches)
        check_values(label, ours, reference, world_size, num_micro_batches)
        check_all_reduce_counts(label, ours, rounds)
    once = runs[1][0].all_reduces(0)
    print(f"{name}: correct on {world_size} ranks, on the MLP and the awkward model; the single-process run's "
          f"gradients at every step, with {once} all-reduce{'s' if once != 1 else ''} per step on the MLP, "
          f"as without micro-batches")


# ---------------------------------------------------------------- overlap and buckets: when things happen

def expected_all_reduces(buckets, ready_at, every_bucket):
    """[(bucket, start)] in the order they should start: a bucket starts when its last gradient is ready; a
    bucket some of whose parameters got no gradient starts in finish() (if `every_bucket`; else, one with
    no gradient at all is not all-reduced)."""
    total = len(ready_at)
    planned = []
    for b, bucket in enumerate(buckets):
        ready = [ready_at[i][0] for i in bucket if i in ready_at]
        if len(ready) == len(bucket):
            planned.append((bucket, (max(ready), dp.BACKWARD), b))
        elif ready or every_bucket:
            planned.append((bucket, (total, dp.FINISH), b))
    planned.sort(key=lambda x: (x[1][0], x[1][1] != dp.BACKWARD, x[2]))
    return [(bucket, start) for bucket, start, _ in planned]


def _bucket_text(bucket, names):
    return "[" + ", ".join(names[i] for i in bucket) + "]"


def check_order(where, started, plan, nbytes, names):
    got = [call.nbytes for call in started]
    want = [sum(nbytes[i] for i in bucket) for bucket, _ in plan]
    if got != want:
        described = "; ".join(_bucket_text(bucket, names) for bucket, _ in plan)
        raise AssertionError(f"{where}: expected {len(want)} all-reduce(s) of {want} bytes, in this order "
                             f"({described}: reverse parameter order, as the backward pass makes them, one dtype "
                             f"per bucket, frozen parameters left out), got {len(got)} of {got} bytes")


def _when(reading, total):
    ready, phase = reading
    return f"{phase} ({ready} of {total} gradients ready)"


def check_start_times(where, started, plan, total, names):
    for k, (call, (bucket, start)) in enumerate(zip(started, plan)):
        if call.started_at == start:
            continue
        if start[1] == dp.FINISH:
            need = (f"its bucket {_bucket_text(bucket, names)} is not full in this step (a parameter got no gradient): "
                    f"start it in finish(), before waiting")
        else:
            need = (f"it should start {_when(start, total)}, as soon as {_bucket_text(bucket, names)} is complete, "
                    f"from the hook of its last gradient")
        early = call.started_at[1] == start[1] and call.started_at[0] < start[0]
        raise AssertionError(f"{where}: all-reduce {k} started {_when(call.started_at, total)}, "
                             f"{'before its bucket was full' if early else 'not when it should'}; {need}")


def check_waits(where, started, total):
    for k, call in enumerate(started):
        if call.waited_at is None or call.waited_at[1] == dp.AFTER:
            raise AssertionError(f"{where}: all-reduce {k} was not waited for before the optimizer step: finish() "
                                 f"must call .wait() on every handle before the gradients are used")
        if call.waited_at[1] == dp.BACKWARD:
            raise AssertionError(f"{where}: all-reduce {k} was waited for {_when(call.waited_at, total)}, while "
                                 f"the backward pass was still running: nothing overlaps; keep the handle and wait "
                                 f"in finish()")


def check_trace(where, run, step, buckets, nbytes, names, every_bucket):
    """What the sync did in one step: async all-reduces of the expected buckets, each started as soon as
    it could, each waited for in finish()."""
    started = [call for call in run.calls[step] if call.name == "all_reduce"]
    for k, call in enumerate(started):
        if call.blocking:
            raise AssertionError(f"{where}: all-reduce {k} is blocking: start it with async_op=True, so that the "
                                 f"backward pass goes on while it runs")
    total = len(run.ready_at[step])
    if step >= len(run.losses):  # the step raised: only what each call did is known
        return check_waits(where, [c for c in started if c.waited_at is not None], total)
    plan = expected_all_reduces(buckets, run.ready_at[step], every_bucket)
    try:
        check_order(where, started, plan, nbytes, names)
        check_start_times(where, started, plan, total, names)
        check_waits(where, started, total)
    except AssertionError as e:
        raise AssertionError(f"{e}{_later_step(step)}") from None


BEFORE_THE_WAIT = (": an asynchronous all-reduce's sum is in its tensor only once its wait has returned, so divide "
                   "(or copy out) after the wait, not before")  # values that match no known mistake, in a sync


def _check_gradient_sync(name, make_syncs, world_size, sizes, buckets_of):
    """make_syncs: [(label, gradient_sync)]; buckets_of(params, label): the expected buckets."""
    dp.check_sizes(sizes.batch_size, world_size)
    models = _both_models(sizes)
    jobs = [("ours", dict(broadcast_parameters=_broadcast, gradient_sync=sync, sizes=s))
            for s in models for _, sync in make_syncs]
    runs = iter(_launch(world_size, jobs))
    for model_sizes in models:
        model = dp.build_model(model_sizes, model_sizes.seed)
        params, names = list(model.parameters()), dp.state_names(model)
        nbytes = [p.numel() * p.element_size() for p in params]
        reference = dp.train_reference_run(model_sizes, world_size)
        for case, _ in make_syncs:
            label, case_runs = _label(name, model_sizes, case), next(runs)
            for rank, run in enumerate(case_runs):  # first what the sync did (a missing wait may give right values)
                for step in range(len(run.calls)):
                    where = f"{label}, rank {rank}, step {step}"
                    check_trace(where, run, step, buckets_of(params, case), nbytes, names,
                                name != "OverlappedGradientSync")
            check_errors(label, case_runs, model_sizes)
            check_values(label, case_runs, reference, world_size, unexplained=BEFORE_THE_WAIT)


def _broadcast(model):
    """The checks of the syncs start every rank from rank 0's model, without the student's broadcast."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.detach(), src=0)


def _one_per_parameter(params, case=None):
    return [[i] for i in reversed(range(len(params))) if params[i].requires_grad]


def check_overlapped_sync(OverlappedGradientSync, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """One async all-reduce per gradient, started from its hook, all waited for in finish()."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    _check_gradient_sync("OverlappedGradientSync", [("", OverlappedGradientSync)], world_size, sizes,
                         _one_per_parameter)
    print(f"OverlappedGradientSync: correct on {world_size} ranks, on the MLP and the awkward model; equals the "
          f"single-process run at every step; each step starts one async all-reduce per gradient, each as soon as "
          f"its gradient is ready, and waits for all of them in finish()")


def bucket_cases(hidden_dim):
    """{label: bucket_size_mb}: everything in one bucket, 2 of the MLP's weights per bucket (exactly: a
    parameter that fills a bucket to its size still joins it), smaller than one."""
    weight_mb = hidden_dim**2 * 8 / 2**20
    return {", one bucket": 1000 * weight_mb, ", 2 weights per bucket": 2 * weight_mb,
            ", buckets smaller than a weight": 0.5 * weight_mb}


def check_bucketed_sync(BucketedGradientSync, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """Three bucket sizes, on the MLP and the awkward model.

    On an odd number of layers (num_layers, or one more), at least 3: with 2 weights per bucket, the
    last bucket then holds one weight, and buckets filled in forward order show.
    """
    num_layers = max(3, num_layers + 1 - num_layers % 2)
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    cases = bucket_cases(hidden_dim)
    syncs = [(case, lambda model, mb=mb: BucketedGradientSync(model, mb)) for case, mb in cases.items()]
    _check_gradient_sync("BucketedGradientSync", syncs, world_size, sizes,
                         lambda params, case: dp.expected_buckets(params, cases[case]))
    params = list(dp.build_model(sizes, seed).parameters())
    counts = ", ".join(f"{len(dp.expected_buckets(params, mb))}" for mb in cases.values())
    print(f"BucketedGradientSync: correct on {world_size} ranks, on the MLP ({num_layers} layers) and the awkward "
          f"model, for three bucket sizes ({counts} all-reduces per step on the MLP); equals the single-process "
          f"run at every step; each bucket starts as soon as it is full and is waited for in finish()")


def check_matches_pytorch_ddp(variants, broadcast_parameters, num_micro_batches, world_size, hidden_dim, num_layers,
                              batch_size, num_steps, seed=0):
    """variants: {name: dict(train_step=...) or dict(gradient_sync=...)}. Each must end where PyTorch DDP ends
    (on the MLP: PyTorch DDP needs find_unused_parameters for the awkward model)."""
    dp.check_sizes(batch_size, world_size, num_micro_batches)
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    jobs = [("ddp", dict(num_micro_batches=num_micro_batches, sizes=sizes))]
    jobs += [("ours", dict(broadcast_parameters=broadcast_parameters, **variant, sizes=sizes))
             for variant in variants.values()]
    runs = _launch(world_size, jobs)
    reference = dp.train_reference_run(sizes, world_size)
    for rank, theirs in enumerate(runs[0]):
        for i, want in enumerate(reference.weights):
            assert _close(theirs[i], want), \
                f"PyTorch DDP on rank {rank} disagrees with the single-process reference on {reference.names[i]}"
    for name, ours in zip(variants, runs[1:]):
        check_errors(name, ours, sizes)
        for rank, run in enumerate(ours):
            for i, theirs in enumerate(runs[0][rank]):
                if not _close(run.weights[i], theirs):
                    raise AssertionError(f"{name}: rank {rank}'s {reference.names[i]} differs from PyTorch DDP's by "
                                         f"{max_abs_diff(run.weights[i], theirs):.3g} after {num_steps} steps")
    print(f"{', '.join(variants)}: on {world_size} ranks, after {num_steps} steps, every rank's parameters equal "
          f"PyTorch DDP's ({num_micro_batches} micro-batches, no_sync) and the single-process run's to {TOLERANCE:g}")
