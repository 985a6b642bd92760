"""Checks for notebook 03 (tensor parallel): parallel regions, column/row layers, the Megatron MLP."""
import torch

from utils import tensor_parallel as tp
from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff, seeded_randn
from utils.counting import record_communication
from utils.launch import spawn
from utils.model import build_mlp, layer_weight, loss_fn, make_batch, parameter_names, train_reference



def _count(log, *names):
    """How many calls the log holds: of these names, or of any collective but barrier."""
    return sum(1 for call in log if (call.name in names if names else call.name != "barrier"))


def _gather_forward_main(rank, world_size, all_gather_forward, hidden_dim, num_layers, batch_size, seed):
    shards = [tp.column_shard(layer_weight(hidden_dim, seed, i), rank, world_size) for i in range(num_layers)]
    x = make_batch(batch_size, hidden_dim, seed)
    with record_communication() as log:
        out = all_gather_forward(x, shards)
    return out, log


def check_all_gather_forward(all_gather_forward, world_size, hidden_dim, num_layers, batch_size, seed=0):
    """Every layer column-sharded, the activations all-gathered after each: every rank ends with the whole output."""
    tp.check_sizes(hidden_dim, world_size)
    results = spawn(_gather_forward_main, world_size, all_gather_forward, hidden_dim, num_layers, batch_size, seed,
                    timeout=CHECK_TIMEOUT)
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
        diff = max_abs_diff(got, want)
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
    results = spawn(_regions_main, world_size, CopyToParallelRegion, ReduceFromParallelRegion, seed, timeout=CHECK_TIMEOUT)
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
            if max_abs_diff(run["input"], x) > TOLERANCE:
                raise AssertionError(f"{where}: the forward changed its input in place; all-reduce a clone")
            if max_abs_diff(run["output"], want_out) > TOLERANCE:
                got = run["output"]
                seen = ("it is the sum over ranks" if max_abs_diff(got, x_sum) < TOLERANCE else
                        "it is this rank's own input" if max_abs_diff(got, x) < TOLERANCE else "it is wrong")
                raise AssertionError(f"{where}: forward: {seen}; {out_hint}")
            if run["grad"] is None or max_abs_diff(run["grad"], want_grad) > TOLERANCE:
                got = run["grad"]
                seen = ("no gradient reached the input" if got is None else
                        "it is the sum over ranks" if max_abs_diff(got, g_sum) < TOLERANCE else
                        "it is this rank's own gradient" if max_abs_diff(got, g) < TOLERANCE else "it is wrong")
                raise AssertionError(f"{where}: backward: {seen}; {grad_hint}")
            want_calls = (0, 1) if name == "copy" else (1, 0)
            if (run["forward"], run["backward"]) != want_calls:
                raise AssertionError(f"{where}: {run['forward']} collective(s) in forward and {run['backward']} in "
                                     f"backward; expected {want_calls[0]} and {want_calls[1]}")
    print(f"{CopyToParallelRegion.__name__} (forward identity, backward all-reduce) and "
          f"{ReduceFromParallelRegion.__name__} (forward all-reduce, backward identity): correct on {world_size} ranks")


def _linear_main(rank, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, batch_size, seed):

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
    local_dim = tp.check_sizes(hidden_dim, world_size)
    results = spawn(_linear_main, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, batch_size, seed,
                    timeout=CHECK_TIMEOUT)
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
            if got_w.shape != want["weight"].shape or max_abs_diff(got_w, want["weight"]) > TOLERANCE:
                owner = next((r for r in range(world_size) if got_w.shape == want["weight"].shape and max_abs_diff(
                    got_w, (w[tp.shard_range(hidden_dim, r, world_size), :] if name == "column"
                            else w[:, tp.shard_range(hidden_dim, r, world_size)])) < TOLERANCE), None)
                hint = (f"it is rank {owner}'s shard" if owner is not None else
                        f"expected shape {tuple(want['weight'].shape)}, got {tuple(got_w.shape)}")
                raise AssertionError(f"{where}: self.weight is not this rank's {what} of W, "
                                     f"[{local.start}:{local.stop}]; {hint}")
            got = run["output"]
            if got.shape != want["output"].shape or max_abs_diff(got, want["output"]) > TOLERANCE:
                hint = ("it is this rank's partial sum x_r @ W_r.T: all-reduce it (ReduceFromParallelRegion)"
                        if name == "row" and got.shape == partial.shape and max_abs_diff(got, partial) < TOLERANCE
                        else f"expected shape {tuple(want['output'].shape)}, got {tuple(got.shape)}"
                        if got.shape != want["output"].shape
                        else f"max abs difference {max_abs_diff(got, want['output']):.3g}")
                raise AssertionError(f"{where}: wrong output; {hint}")
            got = run["grad"]
            if got is None or max_abs_diff(got, want["grad"]) > TOLERANCE:
                if got is None:
                    hint = "no gradient reached the input"
                elif name == "column" and max_abs_diff(got, partial) < TOLERANCE:
                    hint = ("it is this rank's part of it: the backward must all-reduce the input gradient "
                            "(CopyToParallelRegion)")
                elif max_abs_diff(got, world_size * want["grad"]) < TOLERANCE:
                    hint = (f"it is {world_size} times too large: the backward all-reduces a gradient that is "
                            f"already whole")
                else:
                    hint = f"max abs difference {max_abs_diff(got, want['grad']):.3g}"
                raise AssertionError(f"{where}: wrong input gradient; {hint}")
            got = run["weight_grad"]
            if got is None or max_abs_diff(got, want["weight_grad"]) > TOLERANCE:
                hint = ("it is None" if got is None
                        else f"max abs difference {max_abs_diff(got, want['weight_grad']):.3g}")
                raise AssertionError(f"{where}: the weight's gradient is not the reference's slice; {hint}")
            if (run["forward"], run["backward"]) != calls_wanted:
                raise AssertionError(f"{where}: {run['forward']} collective(s) in forward and {run['backward']} in "
                                     f"backward; expected {calls_wanted[0]} and {calls_wanted[1]}")
    print(f"{ColumnParallelLinear.__name__} and {RowParallelLinear.__name__}: correct on {world_size} ranks "
          f"({local_dim} of {hidden_dim} features each); weight shards, outputs, input and weight gradients equal "
          f"the single-process layer's to {TOLERANCE:g}; column: 0 all-reduce forward, 1 backward; row: 1 and 0")


def _tp_mlp_main(rank, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, num_layers, batch_size,
                 num_steps, seed):
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
    tp.check_sizes(hidden_dim, world_size, num_layers)
    results = spawn(_tp_mlp_main, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, num_layers,
                    batch_size, num_steps, seed, timeout=CHECK_TIMEOUT)
    names = parameter_names(num_layers)
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
            diff = max_abs_diff(run["output"], out.detach()) if run["output"].shape == out.shape else float("inf")
            if diff > TOLERANCE:
                raise AssertionError(f"{where}: the output differs from the single-process MLP's by {diff:.3g}")
            if run["grad"] is None or max_abs_diff(run["grad"], x.grad) > TOLERANCE:
                raise AssertionError(f"{where}: the input's gradient differs from the single-process MLP's")
            for i, p in enumerate(model.parameters()):
                want = tp.column_shard(p.grad, rank, world_size) if tp.is_column(i) else \
                    tp.row_shard(p.grad, rank, world_size)
                got = run["weight_grads"][i]
                if got is None or got.shape != want.shape or max_abs_diff(got, want) > TOLERANCE:
                    raise AssertionError(f"{where}: the gradient of {names[i]} is not this rank's "
                                         f"{'rows' if tp.is_column(i) else 'columns'} of the reference's gradient")
            if kind == "ours" and (run["forward"], run["backward"]) != (pairs, pairs):
                raise AssertionError(f"{where}: {run['forward']} all-reduce(s) in forward and {run['backward']} in "
                                     f"backward for {pairs} (column, row) pair(s); expected {pairs} and {pairs}")
        for optimizer, reference in references.items():
            gathered = tp.gather_weights([results[r][kind][optimizer] for r in range(world_size)], num_layers)
            for i in range(num_layers):
                diff = max_abs_diff(gathered[i], reference[i])
                if diff > TOLERANCE:
                    raise AssertionError(f"{label} ({optimizer}): after {num_steps} steps, the gathered {names[i]} "
                                         f"differs from the single-process run's by {diff:.3g} (step 0's gradients "
                                         f"were right: look at what changes from step to step)")
    print(f"tensor parallel MLP: correct on {world_size} ranks, {num_layers} layers; outputs, input gradients and "
          f"sharded weight gradients equal the single-process MLP's, and after {num_steps} steps of SGD and of AdamW "
          f"the gathered weights equal the single-process run's and PyTorch DTensor's (ColwiseParallel / "
          f"RowwiseParallel) to {TOLERANCE:g}; {pairs} all-reduce(s) in forward, {pairs} in backward")
