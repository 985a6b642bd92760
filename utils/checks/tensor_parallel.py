"""Checks for notebook 03 (tensor parallel): the all-gather forward, the parallel regions, column/row layers,
the Megatron MLP.

Each check runs the student's code on the ranks, brings back what it saw (a small dataclass per run), and
compares it in the parent with a single-process float64 reference, one property per function: the values,
then the number of collectives in each direction. A wrong value is explained in words when it is one of
the usual mistakes (this rank's part only, the sum where the identity belongs, N times too large, another
rank's shard, ...).
"""
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils import pytorch_reference
from utils import tensor_parallel as tp
from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff, seeded_randn
from utils.counting import calls, record_communication
from utils.launch import spawn
from utils.model import build_mlp, layer_weight, loss_fn, make_batch, parameter_names, train_reference


def _close(got, want):
    """Same shape and equal to TOLERANCE (a None or a non-tensor is never close)."""
    return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape
            and max_abs_diff(got, want) < TOLERANCE)


def _differs(got, want, whose):
    """What differs and where, when no known mistake explains it."""
    difference = (got - want).abs()
    row, column = divmod(int(difference.argmax()), want.shape[-1])
    return (f"it differs from {whose} by up to {difference.max().item():.3g} (at [{row}, {column}]; largest entry "
            f"{want.abs().max().item():.3g})")


def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)[:40]


# ---------------------------------------------------------------- section 1: all_gather_forward

SEQUENCE_LENGTH = 3  # the second input: a batch of sequences, (batch, sequence, hidden), as a transformer's
DIMENSIONS = {2: ("batch", "features"), 3: ("batch", "sequence", "features")}


def _gather_inputs(batch_size, hidden_dim, seed):
    """x of shape (batch, hidden), then (batch, sequence, hidden): in both, the features are the last dimension."""
    return [make_batch(batch_size, hidden_dim, seed),
            seeded_randn((batch_size, SEQUENCE_LENGTH, hidden_dim), seed)]


def _gather_forward_main(rank, world_size, all_gather_forward, hidden_dim, num_layers, batch_size, seed):
    shards = [tp.column_shard(layer_weight(hidden_dim, seed, i), rank, world_size) for i in range(num_layers)]
    runs = []
    for x in _gather_inputs(batch_size, hidden_dim, seed):
        one_layer = all_gather_forward(x.clone(), shards[:1])  # after one layer, each slice can be traced to its rank
        if not isinstance(one_layer, torch.Tensor) or one_layer.shape != x.shape:
            return runs + [(one_layer, None, 0)]  # the parent names the mistake; more layers would only crash
        with record_communication() as log:
            out = all_gather_forward(x, shards)
        runs.append((one_layer, out, calls(log, "all_gather")))
    return runs


def _first_layer_slices(x, hidden_dim, world_size, seed):
    """Each rank's slice of the first layer's output, as one process computes it."""
    w = layer_weight(hidden_dim, seed, 0)
    return [F.gelu(x @ tp.column_shard(w, r, world_size).T) for r in range(world_size)]


def _joined_along(got, slices):
    """The dimension along which `got` stacks the slices when that is not the features' (None if it does not)."""
    n, shape = len(slices), tuple(slices[0].shape)
    return next((d for d in range(len(shape) - 1) if _shape(got) == shape[:d] + (n * shape[d],) + shape[d + 1:]),
                None)


def _check_gathered_slices(where, got, slices):
    """One layer's gathered activation: every rank's slice, in rank order along the features (the last dimension)."""
    n, (*lead, local_dim) = len(slices), slices[0].shape
    want = (*lead, n * local_dim)
    if not isinstance(got, torch.Tensor) or got.shape != want:
        joined, names = _joined_along(got, slices), DIMENSIONS.get(len(want), ())
        hint = (" (this rank's features only: all-gather the slices after each layer)"
                if _shape(got) == tuple(slices[0].shape) else
                f" (the slices are joined along the {names[joined]}, dim {joined}: concatenate them along the "
                f"features, the last dimension, dim=-1)" if joined is not None and names else "")
        raise AssertionError(f"{where}: after one layer, expected the whole activation, shape {want}, got "
                             f"{_shape(got)}{hint}")
    blocks = got.tensor_split(n, dim=-1)
    owners = [next((r for r in range(n) if _close(block, slices[r])), None) for block in blocks]
    if owners == list(range(n)):
        return
    if None not in owners and n > 1 and len(set(owners)) == 1:
        raise AssertionError(f"{where}: after one layer, every slice of the gathered activation is rank {owners[0]}'s:"
                             f" the list given to dist.all_gather holds one tensor {n} times; give it {n} separate "
                             f"tensors")
    if None not in owners and sorted(owners) == list(range(n)):  # each rank's slice once: a permutation
        raise AssertionError(f"{where}: after one layer, the slices are in the wrong order (the feature blocks hold "
                             f"the slices of ranks {owners}, in that order): concatenate the gathered list in rank "
                             f"order")
    if _close(got, torch.cat(slices).reshape(got.shape)):
        raise AssertionError(f"{where}: after one layer, the gathered activation holds the slices rank after rank in "
                             f"memory (as a flat all_gather_single or a concatenation along dim 0 lays them out), "
                             f"reshaped to {tuple(got.shape)}: that mixes the ranks' features within each row; join "
                             f"the slices along the features, the last dimension (torch.cat(pieces, dim=-1))")
    # a block with no rank's slice, or a copy of one that belongs elsewhere (memory never filled can hold an earlier
    # layer's slices: the same one twice is no ordering mistake)
    missing = [j for j, owner in enumerate(owners) if owner != j]
    difference = max_abs_diff(got, torch.cat(slices, dim=-1))
    seen = ("NaN or uninitialised memory" if difference == float("inf") else
            f"values up to {difference:.3g} away from the single-process layer's")
    raise AssertionError(f"{where}: after one layer, feature block(s) {missing} of the gathered activation hold no "
                         f"rank's slice ({seen}), or one that belongs in another block: each rank's slice is "
                         f"gelu(x @ w.T) of its rows w; fill a list with dist.all_gather and concatenate that list")


def check_all_gather_forward(all_gather_forward, world_size, hidden_dim, num_layers, batch_size, seed=0):
    """Every layer column-sharded, the activations all-gathered after each: every rank ends with the whole output,
    for x of shape (batch, hidden) and (batch, sequence, hidden)."""
    tp.check_sizes(hidden_dim, world_size)
    results = spawn(_gather_forward_main, world_size, all_gather_forward, hidden_dim, num_layers, batch_size, seed,
                    timeout=CHECK_TIMEOUT)
    mlp = build_mlp(hidden_dim, num_layers, seed)
    for x_index, x in enumerate(_gather_inputs(batch_size, hidden_dim, seed)):
        slices = _first_layer_slices(x, hidden_dim, world_size, seed)
        with torch.no_grad():
            want = mlp(x)
        names = ", ".join(DIMENSIONS[x.dim()][:-1] + ("hidden",))
        for rank, runs in enumerate(results):
            one_layer, out, gathers = runs[x_index]
            where = f"all_gather_forward on rank {rank} of {world_size}, x of shape ({names}) = {tuple(x.shape)}"
            _check_gathered_slices(where, one_layer, slices)
            if not _close(out, want):
                raise AssertionError(f"{where}: one layer is right, but the output of {num_layers} differs from the "
                                     f"single-process MLP's: each layer must take the previous layer's whole "
                                     f"(gathered) output as its input")
            if gathers != num_layers:
                instead = ("" if gathers else
                           ": the whole activation came from another collective (an all-reduce of zero-padded "
                           "slices moves twice an all-gather's bytes); gather the slices with dist.all_gather")
                raise AssertionError(f"{where}: {gathers} all-gathers for {num_layers} layers; expected one per "
                                     f"layer{instead}")
    print(f"all_gather_forward: correct on {world_size} ranks, {num_layers} layers, x of shape (batch, hidden) and "
          f"(batch, sequence, hidden); every rank's output equals the single-process MLP's to {TOLERANCE:g}, with one "
          f"all-gather per layer")


# ---------------------------------------------------------------- section 2: the parallel regions

REGION_SHAPE = (3, 5)


@dataclasses.dataclass
class RegionRun:
    """One autograd function applied to this rank's input, then backward with this rank's upstream gradient."""
    output: torch.Tensor
    input_after: torch.Tensor  # the input once forward returned: must be unchanged
    grad: torch.Tensor | None  # the input's gradient
    upstream_after: torch.Tensor  # the incoming gradient once backward returned: must be unchanged
    forward_calls: int
    backward_calls: int


def _region_run(fn, rank, seed):
    x = seeded_randn(REGION_SHAPE, seed, rank).requires_grad_()
    upstream = seeded_randn(REGION_SHAPE, seed + 1, rank)
    with record_communication() as forward_log:
        y = fn.apply(x)
    output = y.detach().clone()
    with record_communication() as backward_log:
        y.backward(upstream)
    return RegionRun(output, x.detach().clone(), x.grad, upstream, len(forward_log), len(backward_log))


def _regions_main(rank, world_size, CopyToParallelRegion, ReduceFromParallelRegion, seed):
    return _region_run(CopyToParallelRegion, rank, seed), _region_run(ReduceFromParallelRegion, rank, seed)


def _what_it_is(got, own, each, expected):
    """Names what a region returned: this rank's own tensor, the sum or the mean over ranks, or None. The expected
    name is tried first: on one rank, the identity, the sum and the mean are all the same tensor."""
    n = len(each)
    candidates = {"identity": own, "sum": sum(each), "mean": sum(each) / n, "own / N": own / n,
                  "N x sum": n * sum(each), **{f"rank {r}": t for r, t in enumerate(each)}}
    for name in sorted(candidates, key=lambda name: name != expected):
        if _close(got, candidates[name]):
            return name
    return "missing" if got is None else "wrong"


SEEN = {"identity": "it is this rank's own {what}", "sum": "it is the sum over ranks",
        "mean": "it is the mean over ranks: partial results add up, do not divide by the world size",
        "own / N": "it is this rank's own {what} divided by the world size: do not divide",
        "N x sum": "it is the sum over ranks times the world size: it was all-reduced twice (summed once too often)",
        "missing": "no gradient reached the input", "wrong": "it is neither this rank's own {what} nor the sum"}


def _seen(name, what):
    """The words for what a region returned; another rank's own tensor (on every rank: a broadcast)."""
    if name.startswith("rank "):
        return (f"it is {name}'s {what}, not this rank's own nor the sum: a broadcast (or another rank's copy) where "
                f"an all-reduce (sum) belongs")
    return SEEN[name].format(what=what)


def _check_region(where, run, sums_in_forward, x, xs, g, gs):
    """Copy (sums_in_forward=False): identity forward, all-reduce backward. Reduce: the other way round."""
    if not torch.equal(run.input_after, x):
        raise AssertionError(f"{where}: the forward changed its input in place; all-reduce a clone")
    if not torch.equal(run.upstream_after, g):
        raise AssertionError(f"{where}: the backward changed the incoming gradient in place; all-reduce a clone")
    want = ("sum", "identity") if sums_in_forward else ("identity", "sum")
    forward, backward = _what_it_is(run.output, x, xs, want[0]), _what_it_is(run.grad, g, gs, want[1])
    if len(xs) > 1 and (forward, backward) == want[::-1]:
        right, wrong = ("forward", "backward") if sums_in_forward else ("backward", "forward")
        raise AssertionError(f"{where}: the all-reduce is in the {wrong}; it belongs in the {right}")
    if forward != want[0]:
        raise AssertionError(f"{where}: forward: {_seen(forward, 'input')}; " + (
            "the forward must all-reduce (sum) the partial outputs of the ranks" if sums_in_forward else
            "the forward must be the identity: the input is already whole on every rank"))
    if backward != want[1]:
        raise AssertionError(f"{where}: backward: {_seen(backward, 'gradient')}; " + (
            "the backward must be the identity: the output is whole on every rank, and so is its gradient"
            if sums_in_forward else "the backward must all-reduce (sum) the incoming gradients: every rank's copy "
                                    "of the input fed a different part of the output"))
    calls_wanted = (1, 0) if sums_in_forward else (0, 1)
    if (run.forward_calls, run.backward_calls) != calls_wanted:
        raise AssertionError(f"{where}: {run.forward_calls} collective(s) in forward and {run.backward_calls} in "
                             f"backward; expected {calls_wanted[0]} and {calls_wanted[1]}")


def _check_not_one_ranks(got, each, where):
    """Every rank holding one rank's own tensor (rank 0's, say): a broadcast, where the sum or the identity belongs.
    Looked at across ranks first: rank 0 alone would see only its own tensor, and be told so."""
    owner = next((r for r in range(len(each)) if all(_close(g, each[r]) for g in got)), None)
    if len(each) > 1 and owner is not None:
        raise AssertionError(f"{where}: every rank returned rank {owner}'s own tensor: that is a broadcast from rank "
                             f"{owner}; partial results must be summed over ranks (dist.all_reduce), a whole one "
                             f"returned as it is")


def check_parallel_regions(CopyToParallelRegion, ReduceFromParallelRegion, world_size, seed=0):
    """Copy: forward identity, backward all-reduce. Reduce: forward all-reduce, backward identity."""
    results = spawn(_regions_main, world_size, CopyToParallelRegion, ReduceFromParallelRegion, seed,
                    timeout=CHECK_TIMEOUT)
    xs = [seeded_randn(REGION_SHAPE, seed, r) for r in range(world_size)]
    gs = [seeded_randn(REGION_SHAPE, seed + 1, r) for r in range(world_size)]
    for index, cls in enumerate((CopyToParallelRegion, ReduceFromParallelRegion)):
        for direction, field, each in (("forward", "output", xs), ("backward", "grad", gs)):
            _check_not_one_ranks([getattr(result[index], field) for result in results], each,
                                 f"{cls.__name__} on {world_size} ranks: {direction}")
    for rank, (copy_run, reduce_run) in enumerate(results):
        for cls, run, sums_in_forward in ((CopyToParallelRegion, copy_run, False),
                                          (ReduceFromParallelRegion, reduce_run, True)):
            where = f"{cls.__name__} on rank {rank} of {world_size}"
            _check_region(where, run, sums_in_forward, xs[rank], xs, gs[rank], gs)
    print(f"{CopyToParallelRegion.__name__} (forward identity, backward all-reduce) and "
          f"{ReduceFromParallelRegion.__name__} (forward all-reduce, backward identity): correct on {world_size} ranks")


# ---------------------------------------------------------------- section 3: column- and row-parallel layers

KINDS = ("column", "row")  # layer 0 of the course's MLP is column parallel, layer 1 row parallel
WHAT = {"column": "rows (output features, dim 0)", "row": "columns (input features, dim 1)"}


def _shard(kind, weight, rank, world_size):
    return (tp.column_shard if kind == "column" else tp.row_shard)(weight, rank, world_size)


@dataclasses.dataclass
class LinearRun:
    """One layer built on this rank, run forward and backward; None where a wrong shape stopped the run."""
    weight: torch.Tensor
    is_parameter: bool
    shares_memory: bool  # with the whole weight passed to the constructor
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    weight_grad: torch.Tensor | None = None
    forward_calls: int = 0
    backward_calls: int = 0


def _linear_inputs(kind, rank, world_size, hidden_dim, batch_size, seed):
    """The layer's input and its output's upstream gradient, as this rank sees them."""
    x, g = seeded_randn((batch_size, hidden_dim), seed), seeded_randn((batch_size, hidden_dim), seed + 1)
    local = tp.shard_range(hidden_dim, rank, world_size)
    return (x, g[:, local]) if kind == "column" else (x[:, local], g)


def _linear_run(cls, kind, rank, world_size, hidden_dim, batch_size, seed):
    whole = layer_weight(hidden_dim, seed, KINDS.index(kind))
    linear = cls(whole, rank, world_size)
    weight = linear.weight
    run = LinearRun(weight.detach().clone(), isinstance(weight, nn.Parameter),
                    weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr())
    if weight.shape != _shard(kind, whole, rank, world_size).shape:
        return run  # the parent names the mistake; a forward would only crash
    x, upstream = _linear_inputs(kind, rank, world_size, hidden_dim, batch_size, seed)
    x = x.clone().requires_grad_()
    with record_communication() as forward_log:
        out = linear(x)
    run.output, run.forward_calls = out.detach().clone(), len(forward_log)
    if out.shape != upstream.shape:
        return run
    with record_communication() as backward_log:
        (out * upstream).sum().backward()
    run.grad, run.weight_grad, run.backward_calls = x.grad, linear.weight.grad, len(backward_log)
    return run


def _linear_main(rank, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, batch_size, seed):
    return [_linear_run(cls, kind, rank, world_size, hidden_dim, batch_size, seed)
            for cls, kind in zip((ColumnParallelLinear, RowParallelLinear), KINDS)]


@dataclasses.dataclass
class LinearReference:
    """What rank `rank` must hold: its slices of the single-process layer x @ W.T, and its partial sum."""
    weight: torch.Tensor
    output: torch.Tensor
    grad: torch.Tensor
    weight_grad: torch.Tensor
    partial: torch.Tensor  # column: this rank's part of the input gradient; row: its part of the output
    misplaced: torch.Tensor  # the region around the wrong value: column: Copy on the output (the input gradient
    # then sums the output's gradient slices); row: Reduce on the input (the output then multiplies summed slices)


def linear_reference(kind, rank, world_size, hidden_dim, batch_size, seed):
    w = layer_weight(hidden_dim, seed, KINDS.index(kind))
    x, g = seeded_randn((batch_size, hidden_dim), seed), seeded_randn((batch_size, hidden_dim), seed + 1)
    out, x_grad, w_grad = x @ w.T, g @ w, g.T @ x
    local = tp.shard_range(hidden_dim, rank, world_size)
    slices = range(world_size)
    if kind == "column":
        summed_g = sum(g[:, tp.shard_range(hidden_dim, r, world_size)] for r in slices)
        return LinearReference(w[local, :], out[:, local], x_grad, w_grad[local, :], g[:, local] @ w[local, :],
                               summed_g @ w[local, :])
    summed_x = sum(x[:, tp.shard_range(hidden_dim, r, world_size)] for r in slices)
    return LinearReference(w[:, local], out, x_grad[:, local], w_grad[:, local], x[:, local] @ w[:, local].T,
                           summed_x @ w[:, local].T)


def _check_weight_shard(where, kind, run, rank, world_size, hidden_dim, seed):
    """self.weight: an nn.Parameter holding a copy of this rank's rows (column) or columns (row) of W."""
    w = layer_weight(hidden_dim, seed, KINDS.index(kind))
    local = tp.shard_range(hidden_dim, rank, world_size)
    if not _close(run.weight, _shard(kind, w, rank, world_size)):
        other = "row" if kind == "column" else "column"
        owner = next((r for r in range(world_size) if _close(run.weight, _shard(kind, w, r, world_size))), None)
        hint = (f"it is rank {owner}'s shard: take shard number `rank`" if owner is not None else
                f"it is this rank's {WHAT[other]}: cut along the other dimension"
                if _close(run.weight, _shard(other, w, rank, world_size)) else
                "it is the transpose of this rank's shard: cut W (out, in) itself, not W.T, and keep its layout"
                if _close(run.weight.T, _shard(kind, w, rank, world_size)) else
                f"expected shape {tuple(_shard(kind, w, rank, world_size).shape)}, got {tuple(run.weight.shape)}")
        raise AssertionError(f"{where}: self.weight is not this rank's {WHAT[kind]} of W, "
                             f"[{local.start}:{local.stop}]; {hint}")
    if not run.is_parameter:
        raise AssertionError(f"{where}: self.weight is a plain tensor: wrap it in nn.Parameter, or the module has no "
                             f"parameter for the optimizer (and no gradient)")
    if run.shares_memory:
        raise AssertionError(f"{where}: self.weight shares memory with the whole weight passed in: keep a copy of the "
                             f"shard (.clone()), or every optimizer step writes into the caller's weight")


def _check_output(where, kind, run, want, world_size):
    if _close(run.output, want.output):
        return
    if run.output is None or run.output.shape != want.output.shape:
        hint = f"expected shape {tuple(want.output.shape)}, got {_shape(run.output)}"
    elif kind == "row" and _close(run.output, want.partial):
        hint = "it is this rank's partial sum x_r @ W_r.T: all-reduce it (ReduceFromParallelRegion)"
    elif world_size > 1 and _close(run.output, world_size * want.output):
        hint = (f"it is {world_size} times too large: the forward all-reduced an input that is already whole "
                f"(before a column layer: CopyToParallelRegion, identity in forward)")
    elif kind == "row" and world_size > 1 and _close(run.output, want.misplaced):
        hint = ("it is the sum over ranks of the input slices, times this rank's columns: ReduceFromParallelRegion "
                "was applied to the input x_r, before the matmul; it belongs around the partial product "
                "x_r @ W_r.T")
    else:
        hint = _differs(run.output, want.output, "the single-process layer's")
    raise AssertionError(f"{where}: wrong output; {hint}")


def _check_input_gradient(where, kind, run, want, world_size):
    if _close(run.grad, want.grad):
        return
    if run.grad is None:
        hint = "no gradient reached the input"
    elif kind == "column" and _close(run.grad, want.partial):
        hint = "it is this rank's part of it: the backward must all-reduce the input gradient (CopyToParallelRegion)"
    elif world_size > 1 and _close(run.grad, world_size * want.grad):
        hint = f"it is {world_size} times too large: the backward all-reduces a gradient that is already whole"
    elif kind == "column" and world_size > 1 and _close(run.grad, want.misplaced):
        hint = ("it is the output gradient's slices summed over ranks, times this rank's rows: "
                "CopyToParallelRegion was applied to the output of the matmul, so its backward added up the "
                "gradients of different output features; it belongs around the input x")
    else:
        hint = _differs(run.grad, want.grad, "the single-process layer's")
    raise AssertionError(f"{where}: wrong input gradient; {hint}")


def _check_weight_gradient(where, run, want):
    if not _close(run.weight_grad, want.weight_grad):
        hint = ("it is None" if run.weight_grad is None
                else _differs(run.weight_grad, want.weight_grad, "the reference's"))
        raise AssertionError(f"{where}: the weight's gradient is not the reference's slice; {hint}")


def _check_linear_calls(where, kind, run):
    want = (0, 1) if kind == "column" else (1, 0)
    if (run.forward_calls, run.backward_calls) != want:
        raise AssertionError(f"{where}: {run.forward_calls} collective(s) in forward and {run.backward_calls} in "
                             f"backward; expected {want[0]} and {want[1]}")


def check_parallel_linear(ColumnParallelLinear, RowParallelLinear, world_size, hidden_dim, batch_size, seed=0):
    """Each layer alone: its weight shard, output, input gradient and weight gradient equal the reference's slices."""
    local_dim = tp.check_sizes(hidden_dim, world_size)
    results = spawn(_linear_main, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, batch_size, seed,
                    timeout=CHECK_TIMEOUT)
    for kind, cls in zip(KINDS, (ColumnParallelLinear, RowParallelLinear)):
        for rank in range(world_size):
            run, where = results[rank][KINDS.index(kind)], f"{cls.__name__} on rank {rank} of {world_size}"
            want = linear_reference(kind, rank, world_size, hidden_dim, batch_size, seed)
            _check_weight_shard(where, kind, run, rank, world_size, hidden_dim, seed)
            _check_output(where, kind, run, want, world_size)
            _check_input_gradient(where, kind, run, want, world_size)
            _check_weight_gradient(where, run, want)
            _check_linear_calls(where, kind, run)
    print(f"{ColumnParallelLinear.__name__} and {RowParallelLinear.__name__}: correct on {world_size} ranks "
          f"({local_dim} of {hidden_dim} features each); weight shards, outputs, input and weight gradients equal "
          f"the single-process layer's to {TOLERANCE:g}; column: 0 all-reduce forward, 1 backward; row: 1 and 0")


# ---------------------------------------------------------------- section 4: the Megatron MLP

@dataclasses.dataclass
class MLPRun:
    """One forward and backward of the whole MLP on this rank, then the weights after training."""
    layer_outputs: list  # each layer's output after GELU: this rank's slice after a column layer, whole after a row
    grad: torch.Tensor | None  # the input's
    weight_grads: list  # this rank's shard of each weight's gradient (None where there is none)
    forward_calls: int
    backward_calls: int
    trained: dict  # {"sgd": weights, "adamw": weights}: this rank's shards after num_steps steps


def _forward_backward(model, hidden_dim, batch_size, seed):
    """Each layer's output, the input's gradient and each weight's, and the all-reduces in each direction."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, out: outputs.append(tp.local_part(out).detach().clone()))
             for layer in model.layers]
    x = make_batch(batch_size, hidden_dim, seed).requires_grad_()
    with record_communication() as forward_log:
        out = model(x)
    with record_communication() as backward_log:
        loss_fn(out).backward()
    for hook in hooks:
        hook.remove()
    weight_grads = [None if p.grad is None else tp.local_part(p.grad).clone() for p in model.parameters()]
    return outputs, x.grad, weight_grads, calls(forward_log, "all_reduce"), calls(backward_log, "all_reduce")


def _mlp_run(build, hidden_dim, batch_size, num_steps, seed):
    run = MLPRun(*_forward_backward(build(), hidden_dim, batch_size, seed), trained={})
    for optimizer in ("sgd", "adamw"):
        model = build()
        tp.train_tensor_parallel(model, hidden_dim, batch_size, num_steps, seed, optimizer)
        run.trained[optimizer] = tp.local_weights(model)
    return run


def _tp_mlp_main(rank, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, num_layers, batch_size,
                 num_steps, seed):
    ours = _mlp_run(lambda: tp.build_tp_mlp(ColumnParallelLinear, RowParallelLinear, rank, world_size, hidden_dim,
                                            num_layers, seed), hidden_dim, batch_size, num_steps, seed)
    dtensor = _mlp_run(lambda: pytorch_reference.tensor_parallel_mlp(world_size, hidden_dim, num_layers, seed),
                       hidden_dim, batch_size, num_steps, seed)
    return ours, dtensor


@dataclasses.dataclass
class MLPReference:
    layer_outputs: list
    grad: torch.Tensor
    weight_grads: list
    trained: dict


def mlp_reference(hidden_dim, num_layers, batch_size, num_steps, seed):
    """The single-process MLP: one forward and backward, then num_steps steps of SGD and of AdamW."""
    model = build_mlp(hidden_dim, num_layers, seed)
    outputs, grad, weight_grads, _, _ = _forward_backward(model, hidden_dim, batch_size, seed)
    trained = {o: train_reference(hidden_dim, num_layers, batch_size, num_steps, o, seed=seed)[0]
               for o in ("sgd", "adamw")}
    return MLPReference(outputs, grad, weight_grads, trained)


def _layer_name(i, classes):
    return f"layer {i} ({classes[i % 2]}, then GELU)"


def _check_layer_outputs(where, run, want, rank, world_size, classes):
    """The first layer whose output is not the reference's (its slice after a column layer)."""
    for i, (got, whole) in enumerate(zip(run.layer_outputs, want.layer_outputs)):
        expected = whole[:, tp.shard_range(whole.shape[1], rank, world_size)] if tp.is_column(i) else whole
        if not _close(got, expected):
            hint = (f"expected shape {tuple(expected.shape)}, got {_shape(got)}" if got.shape != expected.shape else
                    f"max abs difference {max_abs_diff(got, expected):.3g}")
            raise AssertionError(f"{where}: the forward first goes wrong at {_layer_name(i, classes)}; {hint}")


def _check_gradients(where, run, want, rank, world_size, classes):
    """Weight gradients in backward order (the first wrong one is where backward goes wrong), then the input's."""
    names = parameter_names(len(want.weight_grads))
    for i in reversed(range(len(want.weight_grads))):
        expected = (tp.column_shard if tp.is_column(i) else tp.row_shard)(want.weight_grads[i], rank, world_size)
        got = run.weight_grads[i] if i < len(run.weight_grads) else None
        if not _close(got, expected):
            hint = "it is None" if got is None else (
                f"it is {world_size} times too large" if world_size > 1 and _close(got, world_size * expected)
                else f"max abs difference {max_abs_diff(got, expected):.3g}")
            source = (f"layer {i}'s own backward, or the input gradient that {_layer_name(i + 1, classes)} hands "
                      f"back to it" if i + 1 < len(names) else f"layer {i}'s own backward")
            raise AssertionError(f"{where}: the backward first goes wrong at {names[i]}: its gradient is not this "
                                 f"rank's {'rows' if tp.is_column(i) else 'columns'} of the reference's ({hint}); look "
                                 f"at {source}")
    if not _close(run.grad, want.grad):
        raise AssertionError(f"{where}: every weight's gradient is right but the input's is not: the first "
                             f"{classes[0]}'s input gradient must be summed over ranks (CopyToParallelRegion's "
                             f"backward)")


def _check_mlp_calls(where, run, pairs):
    if (run.forward_calls, run.backward_calls) != (pairs, pairs):
        raise AssertionError(f"{where}: {run.forward_calls} all-reduce(s) in forward and {run.backward_calls} in "
                             f"backward for {pairs} (column, row) pair(s); expected {pairs} and {pairs}")


def _check_training(label, runs, want, num_steps):
    names = parameter_names(len(want.weight_grads))
    for optimizer, reference in want.trained.items():
        gathered = tp.gather_weights([run.trained[optimizer] for run in runs], len(reference))
        for i, (got, expected) in enumerate(zip(gathered, reference)):
            if not _close(got, expected):
                raise AssertionError(f"{label} ({optimizer}): after {num_steps} steps, the gathered {names[i]} differs "
                                     f"from the single-process run's by {max_abs_diff(got, expected):.3g} (step 0's "
                                     f"gradients were right: look at what changes from step to step)")


def check_tensor_parallel_mlp(ColumnParallelLinear, RowParallelLinear, world_size, hidden_dim, num_layers, batch_size,
                              num_steps, seed=0):
    """The whole MLP: outputs, input and weight gradients, K steps of SGD and AdamW; against DTensor's too."""
    tp.check_sizes(hidden_dim, world_size, num_layers)
    results = spawn(_tp_mlp_main, world_size, ColumnParallelLinear, RowParallelLinear, hidden_dim, num_layers,
                    batch_size, num_steps, seed, timeout=CHECK_TIMEOUT)
    want, pairs = mlp_reference(hidden_dim, num_layers, batch_size, num_steps, seed), num_layers // 2
    for kind, label, classes in ((1, "PyTorch's DTensor tensor parallel", ("ColwiseParallel", "RowwiseParallel")),
                                 (0, "the tensor parallel MLP", (ColumnParallelLinear.__name__,
                                                                 RowParallelLinear.__name__))):
        for rank in range(world_size):
            run, where = results[rank][kind], f"{label} on rank {rank} of {world_size}"
            _check_layer_outputs(where, run, want, rank, world_size, classes)
            _check_gradients(where, run, want, rank, world_size, classes)
            if kind == 0:
                _check_mlp_calls(where, run, pairs)
        _check_training(label, [results[rank][kind] for rank in range(world_size)], want, num_steps)
    print(f"tensor parallel MLP: correct on {world_size} ranks, {num_layers} layers; outputs, input gradients and "
          f"sharded weight gradients equal the single-process MLP's, and after {num_steps} steps of SGD and of AdamW "
          f"the gathered weights equal the single-process run's and PyTorch DTensor's (ColwiseParallel / "
          f"RowwiseParallel) to {TOLERANCE:g}; {pairs} all-reduce(s) in forward, {pairs} in backward")
