"""Checks for notebook 02 (data parallel): gradient averaging, micro-batches, overlap, buckets, DDP."""
import torch.distributed as dist

from utils import data_parallel as dp
from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff
from utils.launch import spawn
from utils.model import build_mlp, loss_fn, parameter_names, reference_gradients, train_reference



def _run_main(rank, world_size, jobs):
    """Several training runs in one launch: [(kind, kwargs)], kind 'ours' or 'ddp'."""
    return [dp.train_data_parallel(rank, world_size, **kwargs) if kind == "ours" else
            dp.train_pytorch_ddp(rank, world_size, **kwargs) for kind, kwargs in jobs]


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


def _micro_step(train_step_with_micro_batches, num_micro_batches):
    return lambda model, optimizer, batch: train_step_with_micro_batches(model, optimizer, batch, num_micro_batches)


def _diagnose_gradient(got, full, local, world_size):
    """Why a gradient differs from the whole batch's: the usual mistakes, in words."""
    if got is None:
        return "it is None: no gradient reached the optimizer"
    candidates = [(full * world_size, "it is the sum over ranks, not the mean: divide by the world size"),
                  (local, "it is this rank's own gradient: it was never all-reduced"),
                  (local / world_size, "it is this rank's own gradient divided by the world size: "
                                       "it was never all-reduced"),
                  (full / world_size, "it is the mean divided by the world size once more")]
    for value, hint in candidates:
        if max_abs_diff(got, value) < TOLERANCE:
            return hint
    return f"max abs difference from the whole batch's gradient {max_abs_diff(got, full):.3g}"


def _verify_run(name, runs, world_size, sizes, optimizer="sgd", reference=None):
    """runs[rank]: a train_data_parallel result. Raise AssertionError on the first thing that is wrong."""
    names = parameter_names(sizes["num_layers"])
    start = [p.detach() for p in build_mlp(sizes["hidden_dim"], sizes["num_layers"], sizes["seed"]).parameters()]
    for rank in range(world_size):  # 1. every rank starts from rank 0's parameters
        for i, (got, want) in enumerate(zip(runs[rank]["start"], start)):
            if max_abs_diff(got, want) > TOLERANCE:
                if all(max_abs_diff(runs[r]["start"][i], runs[0]["start"][i]) < TOLERANCE for r in range(world_size)):
                    hint = "every rank holds the same parameters, but not rank 0's: broadcast with src=0"
                else:
                    hint = "ranks disagree: did you broadcast rank 0's parameters to every rank?"
                raise AssertionError(f"{name}: after broadcast_parameters, rank {rank}'s {names[i]} differs from "
                                     f"rank 0's starting {names[i]}; {hint}")
    full = reference_gradients(sizes["hidden_dim"], sizes["num_layers"], sizes["batch_size"], sizes["seed"])
    for rank in range(world_size):  # 2. the optimizer sees the whole batch's gradient
        local = reference_gradients(sizes["hidden_dim"], sizes["num_layers"], sizes["batch_size"],
                                       sizes["seed"], rank, world_size)
        grads = runs[rank]["grads"]
        if grads is None:
            raise AssertionError(f"{name}: rank {rank} never called optimizer.step()")
        for i, got in enumerate(grads):
            if got is None or max_abs_diff(got, full[i]) > TOLERANCE:
                hint = _diagnose_gradient(got, full[i], local[i], world_size)
                raise AssertionError(f"{name}: at step 0, the gradient of {names[i]} on rank {rank} is not the "
                                     f"whole batch's gradient; {hint}")
    if reference is None:
        reference = train_reference(sizes["hidden_dim"], sizes["num_layers"], sizes["batch_size"],
                                    sizes["num_steps"], optimizer, seed=sizes["seed"])[0]
    for rank in range(world_size):  # 3. every step: the same parameters as one process on the whole batch
        for i, (got, want) in enumerate(zip(runs[rank]["weights"], reference)):
            if max_abs_diff(got, want) > TOLERANCE:
                others = [r for r in range(world_size) if max_abs_diff(runs[r]["weights"][i], got) > TOLERANCE]
                disagree = f"; ranks {rank} and {others[0]} disagree" if others else ""
                raise AssertionError(f"{name} ({optimizer}): after {sizes['num_steps']} steps, rank {rank}'s "
                                     f"{names[i]} differs from the single-process reference by "
                                     f"{max_abs_diff(got, want):.3g}{disagree} (step 0 was right: look at what changes "
                                     f"from step to step)")
    return reference


def _sizes(hidden_dim, num_layers, batch_size, num_steps, seed):
    return dict(hidden_dim=hidden_dim, num_layers=num_layers, batch_size=batch_size, num_steps=num_steps, seed=seed)


def check_data_parallel(broadcast_parameters, average_gradients, world_size, hidden_dim, num_layers, batch_size,
                        num_steps, seed=0):
    """Naive DDP with SGD and with AdamW: every rank ends with the single-process reference's parameters."""
    dp.check_sizes(batch_size, world_size)
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    optimizers = ("sgd", "adamw")
    step = _naive_step(average_gradients)
    jobs = [("ours", dict(broadcast_parameters=broadcast_parameters, train_step=step, optimizer=o, **sizes))
            for o in optimizers]
    results = spawn(_run_main, world_size, jobs, timeout=CHECK_TIMEOUT)
    for j, optimizer in enumerate(optimizers):
        _verify_run("data parallel", [results[r][j] for r in range(world_size)], world_size, sizes, optimizer)
    print(f"data parallel: correct on {world_size} ranks with SGD and AdamW; after {num_steps} steps every rank's "
          f"parameters equal the single-process run on the whole batch to {TOLERANCE:g}")


def check_micro_batches(broadcast_parameters, average_gradients, train_step_with_micro_batches, num_micro_batches,
                        world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """Gradient accumulation: the same parameters as without micro-batches, and as many all-reduces per step."""
    dp.check_sizes(batch_size, world_size, num_micro_batches)
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    jobs = [("ours", dict(broadcast_parameters=broadcast_parameters, train_step=_naive_step(average_gradients),
                          **sizes)),
            ("ours", dict(broadcast_parameters=broadcast_parameters,
                          train_step=_micro_step(train_step_with_micro_batches, num_micro_batches), **sizes))]
    results = spawn(_run_main, world_size, jobs, timeout=CHECK_TIMEOUT)
    name = f"train_step_with_micro_batches ({num_micro_batches} micro-batches)"
    _verify_run(name, [results[r][1] for r in range(world_size)], world_size, sizes)
    once = results[0][0]["all_reduces"][0]  # what average_gradients makes, once
    for rank in range(world_size):
        counts = results[rank][1]["all_reduces"]
        if any(c != once for c in counts):
            per_micro = " (one round per micro-batch)" if any(c == once * num_micro_batches for c in counts) else ""
            raise AssertionError(f"{name}: rank {rank} made {counts} all-reduces per step{per_micro}; "
                                 f"average_gradients makes {once}: accumulate the gradients of every micro-batch "
                                 f"locally, then communicate once per step")
    print(f"{name}: correct on {world_size} ranks; the same parameters as the single-process run, with {once} "
          f"all-reduce{'s' if once != 1 else ''} per step, as without micro-batches")


class _WatchedWork:
    """An async all-reduce's handle that remembers whether anyone waited for it."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def get_future(self):
        self.waited = True
        return self.work.get_future()

    def __getattr__(self, name):
        return getattr(self.work, name)


def _watch(trace):
    """watch(model, optimizer) for train_data_parallel: log, step by step, when each gradient is ready, when
    each all-reduce starts (its bytes, how many gradients were ready, async or not) and whether every
    async all-reduce was waited for before the optimizer step."""
    import torch.distributed.distributed_c10d as c10d

    def watch(model, optimizer):
        ready, pending = [0], []
        step_events = []
        trace.append(step_events)
        original = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            async_op = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            trace[-1].append(("all_reduce", tensor.numel() * tensor.element_size(), ready[0], async_op))
            work = original(tensor, *args, **kwargs)
            if async_op and work is not None:
                work = _WatchedWork(work)
                pending.append(work)
            return work

        dist.all_reduce = c10d.all_reduce = all_reduce  # this rank's process only: it ends with the run

        def gradient_ready(param):
            ready[0] += 1

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(gradient_ready)

        def before_step(optimizer, args, kwargs):
            trace[-1].append(("step", sum(not w.waited for w in pending)))
            pending.clear()
            ready[0] = 0
            trace.append([])

        optimizer.register_step_pre_hook(before_step)
    return watch


def _hooked_main(rank, world_size, configs, sizes):
    import torch.distributed.distributed_c10d as c10d

    runs, original = [], dist.all_reduce
    for make_sync in configs:
        trace = []
        try:
            run = dp.train_data_parallel(rank, world_size, _broadcast_for_check, gradient_sync=make_sync,
                                         watch=_watch(trace), **sizes)
        finally:
            dist.all_reduce = c10d.all_reduce = original
        run["trace"] = [events for events in trace if events]
        runs.append(run)
    return runs


def _broadcast_for_check(model):
    """The checks of the gradient syncs broadcast themselves: a sync's check tests the sync alone."""
    for p in model.parameters():
        dist.broadcast(p.detach(), src=0)


def _verify_trace(name, trace, buckets, param_bytes, num_params):
    """Each step: one async all-reduce per bucket, started as soon as its last gradient is ready, all waited for."""
    want, ready = [], 0
    for bucket in buckets:
        ready += len(bucket)
        want.append((sum(param_bytes[i] for i in bucket), ready))
    names = parameter_names(num_params)
    for step, events in enumerate(trace):
        started = [e for e in events if e[0] == "all_reduce"]
        where = f"{name}, step {step}"
        if any(not e[3] for e in started):
            raise AssertionError(f"{where}: dist.all_reduce was called without async_op=True: each call blocks "
                                 f"the backward pass until it has finished")
        if len(started) != len(want) or any(e[1] != w[0] for e, w in zip(started, want)):
            described = "; ".join(f"[{', '.join(names[i] for i in bucket)}]" for bucket in buckets)
            raise AssertionError(f"{where}: expected {len(want)} all-reduce(s) of {[w[0] for w in want]} bytes, in "
                                 f"this order ({described}: reverse parameter order, as the backward pass makes "
                                 f"them), got {len(started)} of {[e[1] for e in started]} bytes")
        for k, (e, (_, need)) in enumerate(zip(started, want)):
            if e[2] != need:
                when = "after the backward pass had finished" if e[2] == num_params else \
                    f"when {e[2]} gradient(s) were ready"
                raise AssertionError(f"{where}: all-reduce {k} started {when}; it should start as soon as its "
                                     f"{'bucket is full' if len(buckets) < num_params else 'gradient is ready'} "
                                     f"({need} gradient(s) ready): start it from a post-accumulate-grad hook")
        unwaited = [e[1] for e in events if e[0] == "step"]
        if unwaited and unwaited[0]:
            raise AssertionError(f"{where}: the optimizer stepped while {unwaited[0]} all-reduce(s) had not been "
                                 f"waited for: finish() must call .wait() on every handle before the gradients "
                                 f"are used")


def _check_gradient_sync(name, configs, world_size, sizes, bucket_sizes_mb):
    """configs: make_sync(model) functions; bucket_sizes_mb: the bucket size of each (None: one per parameter)."""
    dp.check_sizes(sizes["batch_size"], world_size)
    results = spawn(_hooked_main, world_size, configs, sizes, timeout=CHECK_TIMEOUT)
    param_bytes = [sizes["hidden_dim"] ** 2 * 8] * sizes["num_layers"]  # float64 weights
    reference = None
    for c, bucket_size_mb in enumerate(bucket_sizes_mb):
        label = name if bucket_size_mb is None else f"{name} with bucket_size_mb={bucket_size_mb:.3g}"
        runs = [results[r][c] for r in range(world_size)]
        buckets = ([[i] for i in reversed(range(len(param_bytes)))] if bucket_size_mb is None
                   else dp.expected_buckets(param_bytes, bucket_size_mb))
        for rank in range(world_size):  # first what the sync did (a missing wait may still give right values)
            _verify_trace(f"{label}, rank {rank}", runs[rank]["trace"], buckets, param_bytes, len(param_bytes))
        reference = _verify_run(label, runs, world_size, sizes, reference=reference)
    return results


def check_overlapped_sync(OverlappedGradientSync, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """One async all-reduce per parameter, started from its hook, all waited for before the step."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    _check_gradient_sync("OverlappedGradientSync", [OverlappedGradientSync], world_size, sizes, [None])
    print(f"OverlappedGradientSync: correct on {world_size} ranks; equals the single-process run to {TOLERANCE:g}; "
          f"each step starts {num_layers} async all-reduce(s), each as soon as its gradient is ready, "
          f"and waits for all of them")


def check_bucketed_sync(BucketedGradientSync, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """Three bucket sizes: everything in one bucket, a few parameters per bucket, smaller than one parameter.

    On an odd number of layers (num_layers, or one more), at least 3: with 2 weights per bucket, the
    last bucket then holds one weight, and buckets filled in forward order start at other times.
    """
    num_layers = max(3, num_layers + 1 - num_layers % 2)
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    param_mb = hidden_dim**2 * 8 / 2**20
    cases = {"one bucket": 2 * num_layers * param_mb, "2 parameters per bucket": 2.5 * param_mb,
             "smaller than one parameter": 0.5 * param_mb}
    configs = [lambda model, mb=mb: BucketedGradientSync(model, mb) for mb in cases.values()]
    _check_gradient_sync("BucketedGradientSync", configs, world_size, sizes, list(cases.values()))
    counts = ", ".join(f"{case}: {len(dp.expected_buckets([param_mb * 2**20] * num_layers, mb))} all-reduce(s)"
                       for case, mb in cases.items())
    print(f"BucketedGradientSync: correct on {world_size} ranks, {num_layers} layers, for three bucket sizes "
          f"({counts} per step); "
          f"equals the single-process run to {TOLERANCE:g}")


def check_matches_pytorch_ddp(variants, broadcast_parameters, num_micro_batches, world_size, hidden_dim, num_layers,
                              batch_size, num_steps, seed=0):
    """variants: {name: dict(train_step=...) or dict(gradient_sync=...)}. Each must end where PyTorch DDP ends."""
    dp.check_sizes(batch_size, world_size, num_micro_batches)
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    jobs = [("ddp", dict(num_micro_batches=num_micro_batches, **sizes))]
    jobs += [("ours", dict(broadcast_parameters=broadcast_parameters, **variant, **sizes))
             for variant in variants.values()]
    results = spawn(_run_main, world_size, jobs, timeout=CHECK_TIMEOUT)
    names = parameter_names(num_layers)
    reference = train_reference(hidden_dim, num_layers, batch_size, num_steps, seed=seed)[0]
    for rank in range(world_size):
        theirs = results[rank][0]["weights"]
        for i in range(num_layers):
            assert max_abs_diff(theirs[i], reference[i]) < TOLERANCE, \
                f"PyTorch DDP on rank {rank} disagrees with the single-process reference on {names[i]}"
            for j, name in enumerate(variants, start=1):
                diff = max_abs_diff(results[rank][j]["weights"][i], theirs[i])
                if diff > TOLERANCE:
                    raise AssertionError(f"{name}: rank {rank}'s {names[i]} differs from PyTorch DDP's by {diff:.3g} "
                                         f"after {num_steps} steps")
    print(f"{', '.join(variants)}: on {world_size} ranks, after {num_steps} steps, every rank's parameters equal "
          f"PyTorch DDP's ({num_micro_batches} micro-batches, no_sync) and the single-process run's to {TOLERANCE:g}")


