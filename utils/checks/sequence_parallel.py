"""Checks for notebook 09, section 3 (sequence parallel beside tensor parallel): the gather and the reduce-scatter
along the sequence, as autograd functions, and the norms' gradients.

The two functions are first run alone on every rank (a chunk in, the whole sequence out, and the other way round,
forward and backward) and compared with what they must return, the collectives they called counted; a wrong value
is named when one of the usual mistakes explains it (the wrong dimension, no sum, a mean, an all-reduce where a
reduce-scatter belongs). Then the course's transformer block runs with them (utils.sequence_parallel) and its
output, its input's gradient and every parameter's gradient are compared with the tensor-parallel block's and the
single-process block's, in float64.
"""
import dataclasses
import re

import torch

from utils import sequence_parallel as sp
from utils.checks import CHECK_TIMEOUT, close, confirmed, max_abs_diff, seeded_randn
from utils.counting import record_communication
from utils.launch import runnable_world_sizes, spawn
from utils.transformer import TransformerSizes

SIZES = TransformerSizes(dim=48, num_heads=12, ffn_dim=96, seq_len=24)  # heads, MLP, sequence split over 2, 3, 4
WORLD_SIZES = (2, 3, 4)
GATHER, SCATTER = "all_gather", "reduce_scatter"  # all_gather_single, reduce_scatter_single count as these


def _names(log):
    return [GATHER if call.name.startswith(GATHER) else SCATTER if call.name.startswith(SCATTER) else call.name
            for call in log]


def _region_inputs(sizes, seed, rank, world_size, gathers):
    """What a rank feeds the function and the upstream gradient of its output: a chunk in and the whole sequence
    out for the gather, the other way round for the reduce-scatter."""
    chunk, whole = (sizes.batch_size, sizes.seq_len // world_size, sizes.dim), (sizes.batch_size, sizes.seq_len,
                                                                                 sizes.dim)
    shapes = (chunk, whole) if gathers else (whole, chunk)
    offset = 0 if gathers else 2
    return seeded_randn(shapes[0], seed + offset, rank), seeded_randn(shapes[1], seed + offset + 1, rank)


@dataclasses.dataclass
class RegionRun:
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    error: str = ""
    forward_calls: list = dataclasses.field(default_factory=list)
    backward_calls: list = dataclasses.field(default_factory=list)


def _region_run(fn, x, upstream):
    run, x = RegionRun(), x.clone().requires_grad_()
    try:
        with record_communication() as log:
            y = fn.apply(x)
        run.output, run.forward_calls = y.detach().clone(), _names(log)
        if y.shape == upstream.shape:
            with record_communication() as log:
                y.backward(upstream)
            run.grad, run.backward_calls = x.grad, _names(log)
    except NotImplementedError:  # an exercise not written yet: say so, as it is
        raise
    except RuntimeError as e:  # a gradient of the wrong shape: autograd says which
        run.error = str(e).splitlines()[0]
    return run


@dataclasses.dataclass
class BlockRun:
    output: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    unsynced: dict | None = None  # parameter gradients before all_reduce_norm_grads
    grads: dict | None = None  # after
    calls: dict | None = None  # forward, backward, norms: the collectives' names
    norm_bytes: int = 0  # handed to the norms' all-reduces
    saved: dict | None = None  # activation bytes the norms save, sequence parallel and tensor parallel
    error: str = ""


def _block_run(rank, world_size, gather, scatter, all_reduce_norm_grads, sizes, seed):
    x, upstream = seeded_randn(_whole(sizes), seed + 4), seeded_randn(_whole(sizes), seed + 5)
    positions, run = torch.arange(sizes.seq_len), BlockRun()
    try:
        block = sp.parallel_block(sizes, rank, world_size, gather, scatter, seed)
        mine = sp.sequence_chunk(x, rank, world_size).clone().requires_grad_()
        with record_communication() as forward:
            out = block(mine, positions)
        with record_communication() as backward:
            (out * sp.sequence_chunk(upstream, rank, world_size)).sum().backward()
        run.unsynced = {name: p.grad.clone() for name, p in block.named_parameters()}
        with record_communication() as norms:
            all_reduce_norm_grads(block)
        run.output, run.grad = out.detach(), mine.grad
        run.grads = {name: p.grad for name, p in block.named_parameters()}
        run.calls = {"forward": _names(forward), "backward": _names(backward), "norms": _names(norms)}
        run.norm_bytes = sum(call.nbytes for call in norms)
        tp_block = sp.parallel_block(sizes, rank, world_size, sp.CopyToTensorParallelRegion,
                                     sp.ReduceFromTensorParallelRegion, seed)
        whole = x.clone().requires_grad_()  # as in a model, where the block's input has a gradient
        run.saved = {name: sp.saved_activation_bytes(lambda b=b, x=x: b(x, positions), [b.attention_norm, b.ffn_norm])
                     for name, b, x in (("sequence parallel", block, mine), ("tensor parallel", tp_block, whole))}
    except NotImplementedError:
        raise
    except RuntimeError as e:
        run.error = str(e).splitlines()[0]
    return run


def _whole(sizes):
    return sizes.batch_size, sizes.seq_len, sizes.dim


def _sp_main(rank, world_size, gather, scatter, all_reduce_norm_grads, sizes, seed):
    regions = [_region_run(fn, *_region_inputs(sizes, seed, rank, world_size, gathers))
               for fn, gathers in ((gather, True), (scatter, False))]
    return (regions, _block_run(rank, world_size, gather, scatter, all_reduce_norm_grads, sizes, seed),
            _tensor_parallel_run(rank, world_size, sizes, seed))


def _shape_in(error):
    """The shape autograd complains about in 'returned an invalid gradient at index 0 - got [2, 16, 32] ...'."""
    found = re.search(r"invalid gradient at index 0 - got \[([\d, ]*)\]", error)
    return tuple(int(d) for d in found.group(1).split(",")) if found else None


def _shape(value):
    return "None" if value is None else str(tuple(value.shape))


GLOO_ERRORS = [  # (gloo's words, what in the student's collective causes them), a library error said in its terms
    (re.compile(r"Check failed: outputs\[0\]\.sizes\(\)\.vec\(\) == inputs\[0\]\[i\]\.sizes\(\)\.vec\(\) "
                r"\(([\d ]+) vs\. ([\d ]+)\)"),
     lambda m: (f"dist.reduce_scatter was given an output of shape ({m[1].replace(' ', ', ')}) for input pieces of "
                f"shape ({m[2].replace(' ', ', ')}): the output is one of the N equal pieces of the input, cut along "
                f"the sequence (dim 1), and every piece has that shape")),
    (re.compile(r"allgather: invalid output tensor list at index 0 \(expected length (\d+), got (\d+)\)"),
     lambda m: f"dist.all_gather's output list holds {m[2]} tensors: one per rank, {m[1]}"),
]


def _error_hint(error, shape_hints):
    """What a region's error means: autograd's wrong-shape gradient, or one of gloo's enforce failures."""
    if _shape_in(error) in shape_hints:
        return shape_hints[_shape_in(error)]
    return next((hint(m) for pattern, hint in GLOO_ERRORS if (m := pattern.search(error))), None)


def _region_problem(where, got, error, want, mistakes, shape_hints):
    """Why a region's output (or gradient) is not `want`, or None. mistakes: (value, hint); shape_hints: {shape:
    hint} for a gradient whose wrong shape made autograd refuse it."""
    if error:
        hint = _error_hint(error, shape_hints)
        return f"{where}: {error}" + (f": {hint}" if hint else "")
    if close(got, want):
        return None
    if got is not None and got.shape != want.shape and tuple(got.shape) in shape_hints:
        return f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}: {shape_hints[tuple(got.shape)]}"
    hint = confirmed(got, [(value, h) for value, h in mistakes if value is not None]) if got is not None else None
    if got is None or got.shape != want.shape:
        return f"{where}: expected shape {tuple(want.shape)}, got {_shape(got)}" + (f": {hint}" if hint else "")
    return f"{where}: differs from the expected value by up to {max_abs_diff(got, want):.3g}" + (
        f": {hint}" if hint else " (no usual mistake explains it: is every element written, by a collective?)")


def _forward_error(run):
    return run.error if run.output is None else ""  # with an output, the error is the backward's


def _piece(t, n, dim, rank):
    """Rank `rank`'s piece of t along `dim`, or None when n does not divide it (no rank could have cut it)."""
    return None if t.shape[dim] % n else t.chunk(n, dim=dim)[rank]


MIRRORED = ("rank N-1-r's chunk of the sum, not this rank's: the reduce-scatter's list goes in rank order, chunk r "
            "to rank r (list(x.chunk(N, dim=1)), not reversed)")


def _gather_problems(runs, n, sizes, seed):
    xs, gs = zip(*(_region_inputs(sizes, seed, r, n, True) for r in range(n)))
    b, s, d = _whole(sizes)
    for rank, run in enumerate(runs):
        where = f"GatherFromSequenceParallelRegion on rank {rank} of {n}"
        summed = sum(gs).chunk(n, dim=1)[rank]
        yield _region_problem(f"{where}, forward", run.output, _forward_error(run), torch.cat(xs, dim=1), [
            (torch.cat(xs, dim=0), "the chunks are joined along the batch (dim 0): join them along the sequence, "
                                   "dim 1 (torch.cat(chunks, dim=1))"),
            (torch.cat(xs, dim=-1), "the chunks are joined along the features (dim 2): join them along the "
                                    "sequence, dim 1"),
            (xs[rank], "this rank's chunk only: all-gather every rank's chunk"),
            (torch.cat(xs[::-1], dim=1), "the chunks are joined in reverse rank order: rank r's chunk holds "
                                         "positions r S/N .. (r + 1) S/N - 1, so join them in rank order")], {})
        yield _region_problem(f"{where}, backward", run.grad, run.error, summed, [
            (gs[rank].chunk(n, dim=1)[rank], "this rank's own gradient at its positions only: every rank's copy of "
                                             "the sequence fed its own heads, so the gradients of all ranks add up "
                                             "(reduce-scatter: sum, keep this rank's chunk)"),
            (summed / n, "the mean over ranks: the ranks' gradients add up, do not divide by the world size"),
            (sum(gs).chunk(n, dim=1)[n - 1 - rank], MIRRORED)], {
            (b, s, d): "the gradient of the whole sequence (an all-reduce?): the input is this rank's chunk, its "
                       "gradient is the sum over ranks of their gradients at its positions: a reduce-scatter along "
                       "the sequence",
            (b // n, s, d): "this rank's chunk of the batch: reduce-scatter along the sequence, dim 1",
            (b, s, d // n): "this rank's chunk of the features: reduce-scatter along the sequence, dim 1"})
        yield _calls_problem(where, run, [GATHER], [SCATTER], "reduce-scatter")


def _scatter_problems(runs, n, sizes, seed):
    xs, gs = zip(*(_region_inputs(sizes, seed, r, n, False) for r in range(n)))
    b, s, d = _whole(sizes)
    for rank, run in enumerate(runs):
        where = f"ReduceScatterToSequenceParallelRegion on rank {rank} of {n}"
        summed = sum(xs)
        padded = torch.zeros(b, s, d, dtype=gs[rank].dtype)
        padded.chunk(n, dim=1)[rank].copy_(gs[rank])
        yield _region_problem(f"{where}, forward", run.output, _forward_error(run), summed.chunk(n, dim=1)[rank], [
            (xs[rank].chunk(n, dim=1)[rank], "this rank's own partial sum only: each rank's row-parallel output is a "
                                             "partial sum over its heads, sum it over ranks (reduce-scatter)"),
            (summed.chunk(n, dim=1)[rank] / n, "the mean over ranks: partial sums add up, do not divide by the "
                                               "world size"),
            (_piece(summed, n, 0, rank), "this rank's chunk of the batch (dim 0): keep its chunk of the "
                                           "sequence, dim 1"),
            (_piece(summed, n, -1, rank), "this rank's chunk of the features: keep its chunk of the sequence, "
                                            "dim 1"),
            (summed, "the whole sum: keep this rank's chunk of the sequence (a reduce-scatter, not an all-reduce)"),
            (summed.chunk(n, dim=1)[n - 1 - rank], MIRRORED)],
            {})
        yield _region_problem(f"{where}, backward", run.grad, run.error, torch.cat(gs, dim=1), [
            (padded, "this rank's chunk's gradient, zeros elsewhere: every rank's partial sum fed every chunk, so the "
                     "input's gradient is the whole sequence's: all-gather the chunks' gradients"),
            (torch.cat(gs, dim=1) / n, "divided by the world size: the gradient of a sum passes whole to each term")],
            {(b, s // n, d): "the chunk's gradient as it is: the input is the whole sequence, its gradient is every "
                             "rank's chunk gathered (all-gather along the sequence)",
             (n * b, s // n, d): "the gathered gradients are joined along the batch (dim 0): join them along the "
                                 "sequence, dim 1",
             (b, s // n, n * d): "the gathered gradients are joined along the features: join them along the "
                                 "sequence, dim 1"})
        yield _calls_problem(where, run, [SCATTER], [GATHER], "all-gather")


def _calls_problem(where, run, forward, backward, word):
    """With right values, the collectives: one in each direction, the ring-optimal one."""
    for direction, got, want in (("forward", run.forward_calls, forward), ("backward", run.backward_calls, backward)):
        if got != want:
            instead = (f": an all-reduce sends twice the bytes of a {word if direction == 'backward' else 'reduce'}"
                       f"{'' if direction == 'backward' else '-scatter'} on a ring-optimal backend; the values are "
                       f"right, use dist.{'reduce_scatter' if want == [SCATTER] else 'all_gather'}"
                       if "all_reduce" in got else "")
            if want == [GATHER] and "all_reduce" in got:
                instead = (": an all-reduce of zero-padded chunks sends twice the bytes of an all-gather on a "
                           "ring-optimal backend; the values are right, use dist.all_gather")
            return f"{where}: {direction} called {got or 'no collective'}, expected {want}{instead}"
    return None


def _block_problems(runs, n, sizes, seed, reference):
    out, x_grad, grads = reference
    for rank, run in enumerate(runs):
        where = f"the sequence-parallel block on rank {rank} of {n}"
        if run.error:
            yield f"{where}: {run.error}"
            return
        for what, got, want in (("output", run.output, out), ("input's gradient", run.grad, x_grad)):
            if not close(got, sp.sequence_chunk(want, rank, n)):
                yield f"{where}: its {what} differs from the single-process block's at this rank's positions"
        for name, want in grads.items():
            want, got, before = sp.shard(name, want, rank, n), run.grads[name], run.unsynced[name]
            if close(got, want):
                continue
            if name not in sp.NORMS:
                yield (f"{where}: the gradient of {name} " + (
                    "was right before all_reduce_norm_grads and wrong after it: only the norms' weights are whole "
                    "on every rank; the other weights are shards of different heads (features), whose gradients are "
                    "complete on their rank" if close(before, want) else "differs from the single-process block's"))
                continue
            partials = [r.unsynced[name] for r in runs]
            hint = confirmed(got, [
                (before, "it is this rank's share only: each rank's norm saw its chunk of the sequence, so the "
                         "weight's gradient is partial on every rank: all-reduce it (sum) over the group"),
                (sum(partials) / n, "it is the mean over ranks: the chunks' shares add up (a sum), do not divide by "
                                    "the world size"),
                (n * sum(partials), "it is the world size times the sum: it was all-reduced twice")])
            yield f"{where}: the gradient of {name} differs from the single-process block's" + (
                f": {hint}" if hint else "")
        per_block = {"forward": [GATHER, SCATTER] * 2, "backward": [GATHER, SCATTER] * 2}
        for direction, want in per_block.items():
            if sorted(run.calls[direction]) != sorted(want):
                yield f"{where}: {direction} called {run.calls[direction]}, expected {want} in some order"
        norm_bytes = 2 * sizes.dim * 8
        if set(run.calls["norms"]) != {"all_reduce"} or run.norm_bytes != norm_bytes:
            yield (f"{where}: all_reduce_norm_grads called {run.calls['norms']} on {run.norm_bytes} bytes; expected "
                   f"all-reduces of the two norm weights' gradients, {norm_bytes} bytes")


def single_process_block(sizes, seed=0):
    """(output, input gradient, parameter gradients by name) of the single-process block on the check's input."""
    block = sp.reference_block(sizes, seed)
    x = seeded_randn(_whole(sizes), seed + 4).requires_grad_()
    out = block(x, torch.arange(sizes.seq_len))
    (out * seeded_randn(_whole(sizes), seed + 5)).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def _tensor_parallel_run(rank, world_size, sizes, seed):
    block = sp.parallel_block(sizes, rank, world_size, sp.CopyToTensorParallelRegion,
                              sp.ReduceFromTensorParallelRegion, seed)
    x = seeded_randn(_whole(sizes), seed + 4).requires_grad_()
    out = block(x, torch.arange(sizes.seq_len))
    (out * seeded_randn(_whole(sizes), seed + 5)).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def check_sequence_parallel(GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion,
                            all_reduce_norm_grads, world_size, sizes=SIZES, seed=0, world_sizes=WORLD_SIZES):
    """The gather (forward all-gather, backward reduce-scatter) and the reduce-scatter (the other way round) along
    the sequence, alone; then the block with them: output and every gradient equal the tensor-parallel block's and
    one process's (1e-12); collectives per step; the norms' saved activations per rank 1/N of tensor parallel's."""
    sizes_ok = runnable_world_sizes(sorted({*world_sizes, world_size}))
    for n in sizes_ok:
        sp.check_sizes(sizes, n)  # a ValueError names what does not split, before any rank starts
    reference = single_process_block(sizes, seed)
    for n in sizes_ok:
        results = spawn(_sp_main, n, GatherFromSequenceParallelRegion, ReduceScatterToSequenceParallelRegion,
                        all_reduce_norm_grads, sizes, seed, timeout=CHECK_TIMEOUT)
        regions, blocks, tensor_parallel = zip(*results)
        for problems in (_gather_problems([r[0] for r in regions], n, sizes, seed),
                         _scatter_problems([r[1] for r in regions], n, sizes, seed),
                         _block_problems(blocks, n, sizes, seed, reference)):
            problem = next((p for p in problems if p), None)
            if problem:
                raise AssertionError(problem)
        for rank, (out, x_grad, grads) in enumerate(tensor_parallel):
            assert close(out, reference[0]) and close(x_grad, reference[1]) and all(
                close(g, sp.shard(name, reference[2][name], rank, n)) for name, g in grads.items()), \
                "utils.sequence_parallel: the tensor-parallel block differs from one process (the course's bug)"
        saved = blocks[0].saved
        if saved["sequence parallel"] * n != saved["tensor parallel"]:
            raise AssertionError(f"on {n} ranks the norms save {saved['sequence parallel']} bytes per rank for "
                                 f"backward, tensor parallel {saved['tensor parallel']}: expected 1/{n} of it")
    ranks = ", ".join(map(str, sizes_ok))
    print(f"sequence parallel: the gather (all-gather forward, reduce-scatter backward) and the reduce-scatter "
          f"(reduce-scatter forward, all-gather backward) along the sequence are right on {ranks} ranks; the block's "
          f"output and every gradient equal the tensor-parallel block's and one process's (1e-12), with 4 all-gathers, "
          f"4 reduce-scatters and the norms' gradients all-reduced per step; the norms save 1/N of tensor parallel's "
          f"activations per rank")
