"""Checks for notebook 01 (collectives): exchange and the ring reduce-scatter / all-gather / all-reduce."""
import torch
import torch.distributed as dist

from utils.checks import CHECK_TIMEOUT, max_abs_diff, seeded_randn
from utils.counting import COLLECTIVES, bytes_sent, record_communication
from utils.launch import runnable_world_sizes, spawn

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


def check_exchange(exchange, world_size, seed=0, timeout=CHECK_TIMEOUT):
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


def check_ring(fn, kind, world_size, seed=0, timeout=CHECK_TIMEOUT):
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


