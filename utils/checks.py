"""Checks for the exercises: run the student's code on several ranks, compare with a reference.

A check prints one short, deterministic verdict when the answer is right, and raises an
AssertionError that says what is wrong (and, where it can tell, why) when it is not.
"""
import torch
import torch.distributed as dist

from utils import data_parallel as dp
from utils.counting import COLLECTIVES, bytes_sent, record_communication
from utils.launch import runnable_world_sizes, spawn
from utils.model import build_mlp, loss_fn, train_reference

TOLERANCE = 1e-12  # float64 results that only differ in the order of additions


def seeded_randn(shape, seed, rank=0, dtype=torch.float64):
    """The same 'random' tensor in any process: it depends only on (seed, rank, shape)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=generator, dtype=dtype)


def max_abs_diff(a, b):
    """The largest |a - b| in float64; infinite where either holds a NaN (NaN > tolerance is False)."""
    if not a.numel():
        return 0.0
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    return float("inf") if diff.isnan().any() else diff.max().item()


# ---------------------------------------------------------------- 00 setup: average_over_ranks

AVERAGE_SHAPES = [(1,), (5,), (3, 4)]


def _average_main(rank, world_size, average_over_ranks, shapes, seed):
    runs = []
    for shape in shapes:
        before = seeded_randn(shape, seed, rank)
        tensor = before.clone()
        average_over_ranks(tensor)
        pytorch = before.clone()
        dist.all_reduce(pytorch, op=dist.ReduceOp.AVG)  # PyTorch's own average, as a second opinion
        runs.append((before, tensor, pytorch))
    return runs


def check_average_over_ranks(average_over_ranks, world_size, seed=0):
    """Every rank must end with the mean over ranks of its tensor, written in place."""
    results = spawn(_average_main, world_size, average_over_ranks, AVERAGE_SHAPES, seed, timeout=20)
    for i, shape in enumerate(AVERAGE_SHAPES):
        inputs = torch.stack([results[rank][i][0] for rank in range(world_size)])
        mean = inputs.mean(dim=0)  # the single-process reference
        for rank in range(world_size):
            before, got, pytorch = results[rank][i]
            where = f"average_over_ranks on rank {rank}, shape {tuple(shape)}"
            assert max_abs_diff(pytorch, mean) < TOLERANCE, f"{where}: dist.all_reduce(AVG) disagrees with the mean"
            if max_abs_diff(got, mean) < TOLERANCE:
                continue
            if torch.equal(got, before):
                hint = "the tensor is unchanged: change it in place (all_reduce and /= do; t = t / n does not)"
            elif max_abs_diff(got, inputs.sum(dim=0)) < TOLERANCE:
                hint = "it holds the sum over ranks: divide by the world size"
            elif max_abs_diff(got, before / world_size) < TOLERANCE:
                hint = "it holds this rank's own tensor divided by the world size: the ranks never communicated"
            else:
                hint = f"max abs difference from the mean over ranks {max_abs_diff(got, mean):.3g}"
            raise AssertionError(f"{where}: wrong result; {hint}")
    shapes = ", ".join(str(tuple(s)) for s in AVERAGE_SHAPES)
    print(f"average_over_ranks: correct on {world_size} ranks for shapes {shapes}; "
          f"matches the single-process mean and dist.all_reduce(op=AVG) to {TOLERANCE:g}")


# ---------------------------------------------------------------- 01 collectives: the ring

RING_DTYPES = (torch.float64, torch.float32, torch.int64)
RING_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.int64: 0}


def ring_shapes(world_size):
    """Lengths that divide by the world size, that do not, that are shorter than it; and 2-D, 3-D."""
    return [(1,), (max(world_size - 1, 1),), (4 * world_size,), (4 * world_size + 3,), (5, 7), (2, 3, 4)]


def ring_input(shape, dtype, seed, rank):
    if dtype.is_floating_point:
        return seeded_randn(shape, seed, rank).to(dtype)
    return (seeded_randn(shape, seed, rank) * 100).round().to(dtype)


def _exchange_main(rank, world_size, exchange, seed):
    """Two rounds around the ring: to the right, then to the left, for several shapes and dtypes."""
    received = []
    for shape, dtype in [((3,), torch.float64), ((2, 5), torch.int64), ((0,), torch.float32)]:
        for step in (1, -1):
            incoming = torch.zeros(shape, dtype=dtype)
            exchange(ring_input(shape, dtype, seed, rank), (rank + step) % world_size,
                     incoming, (rank - step) % world_size)
            received.append((shape, dtype, step, incoming))
    return received


def check_exchange(exchange, world_size, seed=0, timeout=20):
    """Each rank sends to one neighbour and receives from the other, at the same time."""
    world_sizes = runnable_world_sizes(sorted({max(world_size, 2), 3}))  # one rank has no neighbour
    for n in world_sizes:
        results = spawn(_exchange_main, n, exchange, seed, timeout=timeout)
        for rank in range(n):
            for shape, dtype, step, got in results[rank]:
                sender = (rank - step) % n
                if not torch.equal(got, ring_input(shape, dtype, seed, sender)):
                    raise AssertionError(
                        f"exchange on {n} ranks: rank {rank} should have received rank {sender}'s "
                        f"{tuple(shape)} {str(dtype)[6:]} tensor into recv_tensor, but it holds something else")
    print(f"exchange: correct on {' and '.join(map(str, world_sizes))} ranks, sending to the right and to the left")


def _ring_main(rank, world_size, fn, kind, seed):
    """Run the student's ring on every shape and dtype, logging what it sends."""
    runs = []
    for shape in ring_shapes(world_size):
        for dtype in RING_DTYPES:
            x = ring_input(shape, dtype, seed, rank)
            theirs = x.clone()
            if kind == "all_reduce":
                dist.all_reduce(theirs)  # PyTorch's own, on the same data
            with record_communication(forbid=COLLECTIVES) as log:
                returned = fn(x)
            runs.append((x if kind != "reduce_scatter" else returned, theirs, bytes_sent(log)))
    return runs


def ring_reference(kind, inputs, rank, world_size):
    """The single-process answer on `rank`, from every rank's input tensor."""
    total = torch.stack(inputs).sum(dim=0)
    if kind == "all_reduce":
        return total
    if kind == "reduce_scatter":
        return total.view(-1).tensor_split(world_size)[rank]
    # all_gather: chunk r of the result is chunk r of rank r's input
    pieces = [inputs[r].view(-1).tensor_split(world_size)[r] for r in range(world_size)]
    return torch.cat(pieces).view(inputs[0].shape)


def ring_bytes_per_rank(kind, numel, element_size, world_size):
    """What a bandwidth-optimal ring sends from each rank: every chunk but one, once per phase."""
    chunks = [len(c) for c in torch.arange(numel).tensor_split(world_size)]
    sent = []
    for rank in range(world_size):
        reduce_scatter = numel - chunks[rank]  # all but the chunk this rank ends up owning
        all_gather = numel - chunks[(rank + 1) % world_size]  # all but the next rank's own chunk
        sent.append(element_size * {"reduce_scatter": reduce_scatter, "all_gather": all_gather,
                                    "all_reduce": reduce_scatter + all_gather}[kind])
    return sent


def _wrong_chunks(got, want, world_size, tolerance):
    pairs = zip(got.reshape(-1).tensor_split(world_size), want.reshape(-1).tensor_split(world_size))
    return [i for i, (g, w) in enumerate(pairs) if max_abs_diff(g, w) > tolerance]


def check_ring(fn, kind, world_size, seed=0, timeout=20):
    """Check ring_reduce_scatter / ring_all_gather / ring_all_reduce on world_size ranks and on 3."""
    name = fn.__name__ if getattr(fn, "__name__", "<lambda>") != "<lambda>" else f"ring_{kind}"
    world_sizes = runnable_world_sizes(sorted({world_size, 3}))
    for n in world_sizes:
        results = spawn(_ring_main, n, fn, kind, seed, timeout=timeout)
        cases = [(shape, dtype) for shape in ring_shapes(n) for dtype in RING_DTYPES]
        for i, (shape, dtype) in enumerate(cases):  # first the values, on every rank
            inputs = [ring_input(shape, dtype, seed, rank) for rank in range(n)]
            for rank in range(n):
                got, theirs, _ = results[rank][i]
                want = ring_reference(kind, inputs, rank, n)
                tolerance = RING_TOLERANCE[dtype]
                where = f"{name} on {n} ranks, shape {shape}, {str(dtype)[6:]}, rank {rank}"
                if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != dtype:
                    described = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)[:60]
                    raise AssertionError(f"{where}: expected a {tuple(want.shape)} {dtype} tensor, got {described}")
                if kind == "all_reduce" and max_abs_diff(theirs, want) > tolerance:
                    raise AssertionError(f"{where}: dist.all_reduce disagrees with the single-process sum")
                if max_abs_diff(got, want) > tolerance:
                    wrong = (f"chunks {_wrong_chunks(got, want, n, tolerance)} of {n} are wrong"
                             if kind != "reduce_scatter" else "the reduced chunk is wrong")
                    unchanged = " (the tensor is unchanged)" if torch.equal(got, inputs[rank]) else ""
                    raise AssertionError(f"{where}: {wrong}{unchanged}; max abs difference from the "
                                         f"single-process reference {max_abs_diff(got, want):.3g}")
        for i, (shape, dtype) in enumerate(cases):  # then the bytes: right values, the ring's traffic
            numel, element_size = results[0][i][1].numel(), results[0][i][1].element_size()
            expected = ring_bytes_per_rank(kind, numel, element_size, n)
            for rank in range(n):
                sent = results[rank][i][2]
                if sent != expected[rank]:
                    raise AssertionError(
                        f"{name} on {n} ranks, shape {shape}, {str(dtype)[6:]}, rank {rank}: sent {sent} bytes; "
                        f"a bandwidth-optimal ring sends {expected[rank]} (each step passes one chunk, "
                        f"about 1/{n} of the tensor, to the next rank)")
    print(f"{name}: correct on {' and '.join(map(str, world_sizes))} ranks, {len(cases)} shapes and dtypes; "
          f"equals the single-process reference{' and dist.all_reduce' if kind == 'all_reduce' else ''}; "
          f"sends exactly what a bandwidth-optimal ring sends")


# ---------------------------------------------------------------- 02 data parallel

DP_TIMEOUT = 20  # seconds: a rank that skips a collective ends the check, not the notebook


def _parameter_names(num_layers):
    return [f"layers.{i}.linear.weight" for i in range(num_layers)]


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
    names = _parameter_names(sizes["num_layers"])
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
    full = dp.reference_gradients(sizes["hidden_dim"], sizes["num_layers"], sizes["batch_size"], sizes["seed"])
    for rank in range(world_size):  # 2. the optimizer sees the whole batch's gradient
        local = dp.reference_gradients(sizes["hidden_dim"], sizes["num_layers"], sizes["batch_size"],
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
    results = spawn(_run_main, world_size, jobs, timeout=DP_TIMEOUT)
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
    results = spawn(_run_main, world_size, jobs, timeout=DP_TIMEOUT)
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
    names = _parameter_names(num_params)
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
    results = spawn(_hooked_main, world_size, configs, sizes, timeout=DP_TIMEOUT)
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
    results = spawn(_run_main, world_size, jobs, timeout=DP_TIMEOUT)
    names = _parameter_names(num_layers)
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


# ---------------------------------------------------------------- 03 tensor parallel

TP_TIMEOUT = 20  # seconds: a rank that skips a collective ends the check, not the notebook


def _max_diff(a, b):
    """max_abs_diff, with NaN (say, from a buffer never written) counted as infinitely far."""
    diff = max_abs_diff(a, b)
    return float("inf") if diff != diff else diff


def _count(log, *names):
    """How many calls the log holds: of these names, or of any collective but barrier."""
    return sum(1 for name, _ in log if (name in names if names else name != "barrier"))


def _gather_forward_main(rank, world_size, all_gather_forward, hidden_dim, num_layers, batch_size, seed):
    from utils import tensor_parallel as tp
    from utils.model import layer_weight, make_batch

    shards = [tp.column_shard(layer_weight(hidden_dim, seed, i), rank, world_size) for i in range(num_layers)]
    x = make_batch(batch_size, hidden_dim, seed)
    with record_communication() as log:
        out = all_gather_forward(x, shards)
    return out, log


def check_all_gather_forward(all_gather_forward, world_size, hidden_dim, num_layers, batch_size, seed=0):
    """Every layer column-sharded, the activations all-gathered after each: every rank ends with the whole output."""
    from utils import tensor_parallel as tp
    from utils.model import make_batch

    tp.check_sizes(hidden_dim, world_size)
    results = spawn(_gather_forward_main, world_size, all_gather_forward, hidden_dim, num_layers, batch_size, seed,
                    timeout=TP_TIMEOUT)
    with torch.no_grad():
        want = build_mlp(hidden_dim, num_layers, seed)(make_batch(batch_size, hidden_dim, seed))
    for rank, (got, log) in enumerate(results):
        where = f"all_gather_forward on rank {rank} of {world_size}"
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else repr(got)[:40]
            hint = (" (this rank's features only: all-gather the shards after each layer)"
                    if isinstance(got, torch.Tensor) and got.shape[-1] == hidden_dim // world_size else "")
            raise AssertionError(f"{where}: expected the whole output, shape {tuple(want.shape)}, got {shape}{hint}")
        gathers = _count(log, "all_gather", "all_gather_single", "all_gather_into_tensor")
        if gathers != num_layers:
            raise AssertionError(f"{where}: {gathers} all-gathers for {num_layers} layers; expected one per layer")
        diff = _max_diff(got, want)
        if diff > TOLERANCE:
            raise AssertionError(f"{where}: the output differs from the single-process MLP by {diff:.3g}; after "
                                 f"each layer, concatenate the gathered shards in rank order along the features")
    print(f"all_gather_forward: correct on {world_size} ranks, {num_layers} layers; every rank's output equals the "
          f"single-process MLP's to {TOLERANCE:g}, with one all-gather per layer")


def _regions_main(rank, world_size, CopyToParallelRegion, ReduceFromParallelRegion, seed):
    runs = {}
    for name, fn in (("copy", CopyToParallelRegion), ("reduce", ReduceFromParallelRegion)):
        x = seeded_randn((3, 5), seed, rank).requires_grad_()
        with record_communication() as forward_log:
            y = fn.apply(x)
        grad = seeded_randn((3, 5), seed + 1, rank)
        with record_communication() as backward_log:
            y.backward(grad)
        runs[name] = dict(output=y.detach().clone(), input=x.detach().clone(), grad=x.grad,
                          forward=_count(forward_log), backward=_count(backward_log))
    return runs


def check_parallel_regions(CopyToParallelRegion, ReduceFromParallelRegion, world_size, seed=0):
    """Copy: forward identity, backward all-reduce. Reduce: forward all-reduce, backward identity."""
    results = spawn(_regions_main, world_size, CopyToParallelRegion, ReduceFromParallelRegion, seed, timeout=TP_TIMEOUT)
    xs = [seeded_randn((3, 5), seed, r) for r in range(world_size)]
    gs = [seeded_randn((3, 5), seed + 1, r) for r in range(world_size)]
    x_sum, g_sum = sum(xs), sum(gs)
    for rank in range(world_size):
        x, g = xs[rank], gs[rank]
        for name, cls, want_out, want_grad, out_hint, grad_hint in (
                ("copy", CopyToParallelRegion, x, g_sum,
                 "the forward must be the identity: the input is already whole on every rank",
                 "the backward must all-reduce (sum) the incoming gradients: every rank's copy of the input "
                 "fed a different part of the output"),
                ("reduce", ReduceFromParallelRegion, x_sum, g,
                 "the forward must all-reduce (sum) the partial outputs of the ranks",
                 "the backward must be the identity: the output is whole on every rank, and so is its gradient")):
            run = results[rank][name]
            where = f"{cls.__name__} on rank {rank} of {world_size}"
            if _max_diff(run["input"], x) > TOLERANCE:
                raise AssertionError(f"{where}: the forward changed its input in place; all-reduce a clone")
            if _max_diff(run["output"], want_out) > TOLERANCE:
                got = run["output"]
                seen = ("it is the sum over ranks" if _max_diff(got, x_sum) < TOLERANCE else
                        "it is this rank's own input" if _max_diff(got, x) < TOLERANCE else "it is wrong")
                raise AssertionError(f"{where}: forward: {seen}; {out_hint}")
            if run["grad"] is None or _max_diff(run["grad"], want_grad) > TOLERANCE:
                got = run["grad"]
                seen = ("no gradient reached the input" if got is None else
                        "it is the sum over ranks" if _max_diff(got, g_sum) < TOLERANCE else
                        "it is this rank's own gradient" if _max_diff(got, g) < TOLERANCE else "it is wrong")
                raise AssertionError(f"{where}: backward: {seen}; {grad_hint}")
            want_calls = (0, 1) if name == "copy" else (1, 0)
            if (run["forward"], run["backward"]) != want_calls:
                raise AssertionError(f"{where}: {run['forward']} collective(s) in forward and {run['backward']} in "
                                     f"backward; expected {want_calls[0]} and {want_calls[1]}")
    print(f"{CopyToParallelRegion.__name__} (forward identity, backward all-reduce) and "
          f"{ReduceFromParallelRegion.__name__} (forward all-reduce, backward identity): correct on {world_size} ranks")


def _linear_main(rank, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, batch_size, seed):
    from utils.model import layer_weight

    runs = {}
    x_full = seeded_randn((batch_size, hidden_dim), seed)
    upstream = seeded_randn((batch_size, hidden_dim), seed + 1)
    local = slice(rank * hidden_dim // world_size, (rank + 1) * hidden_dim // world_size)
    for name, cls, layer in (("column", ColumnParallelLinear, 0), ("row", RowParallelLinear, 1)):
        linear = cls(layer_weight(hidden_dim, seed, layer), rank, world_size)
        local_dim = hidden_dim // world_size
        local_shape = (local_dim, hidden_dim) if name == "column" else (hidden_dim, local_dim)
        if tuple(linear.weight.shape) != local_shape:  # the parent names the mistake; a forward would only crash
            runs[name] = dict(weight=linear.weight.detach().clone())
            continue
        x = (x_full if name == "column" else x_full[:, local]).clone().requires_grad_()
        with record_communication() as forward_log:
            out = linear(x)
        g = upstream[:, local] if name == "column" else upstream
        if out.shape != g.shape:
            runs[name] = dict(weight=linear.weight.detach().clone(), output=out.detach().clone(), grad=None,
                              weight_grad=None, forward=_count(forward_log), backward=0)
            continue
        with record_communication() as backward_log:
            (out * g).sum().backward()
        runs[name] = dict(weight=linear.weight.detach().clone(), output=out.detach().clone(), grad=x.grad,
                          weight_grad=linear.weight.grad, forward=_count(forward_log), backward=_count(backward_log))
    return runs


def check_parallel_linear(ColumnParallelLinear, RowParallelLinear, world_size, hidden_dim, batch_size, seed=0):
    """Each layer alone: its weight shard, output, input gradient and weight gradient equal the reference's slices."""
    from utils import tensor_parallel as tp
    from utils.model import layer_weight

    local_dim = tp.check_sizes(hidden_dim, world_size)
    results = spawn(_linear_main, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, batch_size, seed,
                    timeout=TP_TIMEOUT)
    x = seeded_randn((batch_size, hidden_dim), seed)
    g = seeded_randn((batch_size, hidden_dim), seed + 1)
    for name, cls, layer in (("column", ColumnParallelLinear, 0), ("row", RowParallelLinear, 1)):
        w = layer_weight(hidden_dim, seed, layer)
        out, x_grad, w_grad = x @ w.T, g @ w, g.T @ x  # the single-process reference
        for rank in range(world_size):
            run = results[rank][name]
            local = tp.shard_range(hidden_dim, rank, world_size)
            where = f"{cls.__name__} on rank {rank} of {world_size}"
            if name == "column":
                want = dict(weight=w[local, :], output=out[:, local], grad=x_grad, weight_grad=w_grad[local, :])
                partial = g[:, local] @ w[local, :]
                calls_wanted, what = (0, 1), "rows (output features)"
            else:
                want = dict(weight=w[:, local], output=out, grad=x_grad[:, local], weight_grad=w_grad[:, local])
                partial = x[:, local] @ w[:, local].T
                calls_wanted, what = (1, 0), "columns (input features)"
            got_w = run["weight"]
            if got_w.shape != want["weight"].shape or _max_diff(got_w, want["weight"]) > TOLERANCE:
                owner = next((r for r in range(world_size) if got_w.shape == want["weight"].shape and _max_diff(
                    got_w, (w[tp.shard_range(hidden_dim, r, world_size), :] if name == "column"
                            else w[:, tp.shard_range(hidden_dim, r, world_size)])) < TOLERANCE), None)
                hint = (f"it is rank {owner}'s shard" if owner is not None else
                        f"expected shape {tuple(want['weight'].shape)}, got {tuple(got_w.shape)}")
                raise AssertionError(f"{where}: self.weight is not this rank's {what} of W, "
                                     f"[{local.start}:{local.stop}]; {hint}")
            got = run["output"]
            if got.shape != want["output"].shape or _max_diff(got, want["output"]) > TOLERANCE:
                hint = ("it is this rank's partial sum x_r @ W_r.T: all-reduce it (ReduceFromParallelRegion)"
                        if name == "row" and got.shape == partial.shape and _max_diff(got, partial) < TOLERANCE
                        else f"expected shape {tuple(want['output'].shape)}, got {tuple(got.shape)}"
                        if got.shape != want["output"].shape
                        else f"max abs difference {_max_diff(got, want['output']):.3g}")
                raise AssertionError(f"{where}: wrong output; {hint}")
            got = run["grad"]
            if got is None or _max_diff(got, want["grad"]) > TOLERANCE:
                if got is None:
                    hint = "no gradient reached the input"
                elif name == "column" and _max_diff(got, partial) < TOLERANCE:
                    hint = ("it is this rank's part of it: the backward must all-reduce the input gradient "
                            "(CopyToParallelRegion)")
                elif _max_diff(got, world_size * want["grad"]) < TOLERANCE:
                    hint = (f"it is {world_size} times too large: the backward all-reduces a gradient that is "
                            f"already whole")
                else:
                    hint = f"max abs difference {_max_diff(got, want['grad']):.3g}"
                raise AssertionError(f"{where}: wrong input gradient; {hint}")
            got = run["weight_grad"]
            if got is None or _max_diff(got, want["weight_grad"]) > TOLERANCE:
                hint = ("it is None" if got is None
                        else f"max abs difference {_max_diff(got, want['weight_grad']):.3g}")
                raise AssertionError(f"{where}: the weight's gradient is not the reference's slice; {hint}")
            if (run["forward"], run["backward"]) != calls_wanted:
                raise AssertionError(f"{where}: {run['forward']} collective(s) in forward and {run['backward']} in "
                                     f"backward; expected {calls_wanted[0]} and {calls_wanted[1]}")
    print(f"{ColumnParallelLinear.__name__} and {RowParallelLinear.__name__}: correct on {world_size} ranks "
          f"({local_dim} of {hidden_dim} features each); weight shards, outputs, input and weight gradients equal "
          f"the single-process layer's to {TOLERANCE:g}; column: 0 all-reduce forward, 1 backward; row: 1 and 0")


def _tp_mlp_main(rank, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, num_layers, batch_size,
                 num_steps, seed):
    from utils import tensor_parallel as tp
    from utils.model import make_batch

    builders = {"ours": lambda: tp.build_tp_mlp(ColumnParallelLinear, RowParallelLinear, rank, world_size,
                                                hidden_dim, num_layers, seed),
                "dtensor": lambda: tp.build_dtensor_mlp(world_size, hidden_dim, num_layers, seed)}
    runs = {}
    for kind, build in builders.items():
        model = build()
        x = make_batch(batch_size, hidden_dim, seed).requires_grad_()
        with record_communication() as forward_log:
            out = model(x)
        with record_communication() as backward_log:
            loss_fn(out).backward()
        run = dict(output=out.detach().clone(), grad=x.grad,
                   weight_grads=[None if p.grad is None else
                                 (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                                 for p in model.parameters()],
                   forward=_count(forward_log, "all_reduce"), backward=_count(backward_log, "all_reduce"))
        for optimizer in ("sgd", "adamw"):
            model = build()
            tp.train_tensor_parallel(model, hidden_dim, batch_size, num_steps, seed, optimizer)
            run[optimizer] = tp.local_weights(model)
        runs[kind] = run
    return runs


def check_tensor_parallel_mlp(ColumnParallelLinear, RowParallelLinear, world_size, hidden_dim, num_layers, batch_size,
                              num_steps, seed=0):
    """The whole MLP: outputs, input and weight gradients, K steps of SGD and AdamW; against DTensor's too."""
    from utils import tensor_parallel as tp
    from utils.model import make_batch

    tp.check_sizes(hidden_dim, world_size, num_layers)
    results = spawn(_tp_mlp_main, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, num_layers,
                    batch_size, num_steps, seed, timeout=TP_TIMEOUT)
    names = _parameter_names(num_layers)
    model = build_mlp(hidden_dim, num_layers, seed)
    x = make_batch(batch_size, hidden_dim, seed).requires_grad_()
    out = model(x)
    loss_fn(out).backward()
    references = {o: train_reference(hidden_dim, num_layers, batch_size, num_steps, o, seed=seed)[0]
                  for o in ("sgd", "adamw")}
    pairs = num_layers // 2
    for kind, label in (("dtensor", "PyTorch's DTensor tensor parallel"), ("ours", "the tensor parallel MLP")):
        for rank in range(world_size):
            run, where = results[rank][kind], f"{label} on rank {rank} of {world_size}"
            diff = _max_diff(run["output"], out.detach()) if run["output"].shape == out.shape else float("inf")
            if diff > TOLERANCE:
                raise AssertionError(f"{where}: the output differs from the single-process MLP's by {diff:.3g}")
            if run["grad"] is None or _max_diff(run["grad"], x.grad) > TOLERANCE:
                raise AssertionError(f"{where}: the input's gradient differs from the single-process MLP's")
            for i, p in enumerate(model.parameters()):
                want = tp.column_shard(p.grad, rank, world_size) if tp.is_column(i) else \
                    tp.row_shard(p.grad, rank, world_size)
                got = run["weight_grads"][i]
                if got is None or got.shape != want.shape or _max_diff(got, want) > TOLERANCE:
                    raise AssertionError(f"{where}: the gradient of {names[i]} is not this rank's "
                                         f"{'rows' if tp.is_column(i) else 'columns'} of the reference's gradient")
            if kind == "ours" and (run["forward"], run["backward"]) != (pairs, pairs):
                raise AssertionError(f"{where}: {run['forward']} all-reduce(s) in forward and {run['backward']} in "
                                     f"backward for {pairs} (column, row) pair(s); expected {pairs} and {pairs}")
        for optimizer, reference in references.items():
            gathered = tp.gather_weights([results[r][kind][optimizer] for r in range(world_size)], num_layers)
            for i in range(num_layers):
                diff = _max_diff(gathered[i], reference[i])
                if diff > TOLERANCE:
                    raise AssertionError(f"{label} ({optimizer}): after {num_steps} steps, the gathered {names[i]} "
                                         f"differs from the single-process run's by {diff:.3g} (step 0's gradients "
                                         f"were right: look at what changes from step to step)")
    print(f"tensor parallel MLP: correct on {world_size} ranks, {num_layers} layers; outputs, input gradients and "
          f"sharded weight gradients equal the single-process MLP's, and after {num_steps} steps of SGD and of AdamW "
          f"the gathered weights equal the single-process run's and PyTorch DTensor's (ColwiseParallel / "
          f"RowwiseParallel) to {TOLERANCE:g}; {pairs} all-reduce(s) in forward, {pairs} in backward")
