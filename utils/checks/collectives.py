"""Checks for notebook 01 (collectives): exchange, the ring reduce-scatter / all-gather / all-reduce, and the
pipelined ring reduce-scatter.

Each check runs the student's function on several ranks, logs every torch.distributed call it makes
(utils.intercept), and then, in the parent, checks in this order: no collective was called; for the
pipelined ring, that it is pipelined (segments, a receive posted before the previous one is waited for,
no receive into a buffer still being written); the values equal the single-process reference (and, when
wrong, what the wrong chunk holds: which ranks' parts of which chunk, so that an index off by one or a
missing step is named); each rank sent exactly what a bandwidth-optimal ring sends. A stall is still the
launcher's TimeoutError, its message opened by what usually causes it.
"""
import dataclasses

import torch
import torch.distributed as dist

from utils.checks import CHECK_TIMEOUT, max_abs_diff, seeded_randn, spawn_explaining_stalls
from utils.counting import bytes_sent
from utils.intercept import COLLECTIVES, RECEIVES, SENDS, intercept
from utils.launch import runnable_world_sizes

RING_DTYPES = (torch.float64, torch.float32, torch.int64)
RING_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.int64: 0}


def ring_cases(world_size):
    """(shape, dtype) pairs. First a length long enough (8 N^2, divisible) that a wrong result can be decomposed
    into the pieces it was summed from, in every dtype; then lengths that divide by the world size, that do
    not (also in int64), that are shorter than it; 2-D, 3-D."""
    n = world_size
    return ([((8 * n**2,), dtype) for dtype in RING_DTYPES]
            + [((1,), torch.float64), ((max(n - 1, 1),), torch.float64), ((4 * n,), torch.float64),
               ((4 * n + 3,), torch.float64), ((4 * n + 3,), torch.int64), ((5, 7), torch.float64),
               ((2, 3, 4), torch.float32)])


def ring_input(shape, dtype, seed, rank):
    if dtype.is_floating_point:
        return seeded_randn(shape, seed, rank).to(dtype)
    return (seeded_randn(shape, seed, rank) * 100).round().to(dtype)


def _ranks(ranks):
    return "rank " + str(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


CHUNK_SIZES = ("torch.tensor_split makes chunks of unequal sizes: receive chunk k into a buffer of chunk k's size, "
               "and a receive without src must not catch another rank's message")


# ---------------------------------------------------------------- exchange


def _exchange_main(rank, world_size, exchange, seed):
    """Two rounds around the ring: to the right, then to the left, for several shapes and dtypes."""
    received = []
    for shape, dtype in [((3,), torch.float64), ((2, 5), torch.int64), ((0,), torch.float32)]:
        for step in (1, -1):
            incoming = torch.zeros(shape, dtype=dtype)
            outgoing = ring_input(shape, dtype, seed, rank)
            with intercept() as log:
                exchange(outgoing, (rank + step) % world_size, incoming, (rank - step) % world_size)
            received.append((shape, dtype, step, incoming, log, outgoing.numel() * outgoing.element_size()))
    return received


def exchange_order_problem(log, nbytes):
    """What is wrong with how one exchange sent and received (None when nothing is). A blocking send or recv is
    fine while the other transfer is already in flight (isend, then recv, then wait): they overlap."""
    def in_flight(call):
        return any(other.started_at < call.started_at and (other.waited_at is None or other.waited_at > call.started_at)
                   for other in log if other.name in ("isend", "irecv"))

    blocking = [call.name for call in log if call.name in ("send", "recv") and not in_flight(call)]
    if blocking:
        return (f"it calls dist.{blocking[0]}, which blocks until its partner has taken part: ordered as here it "
                f"works, but this rank's send and receive run one after the other, not at the same time, and if "
                f"every rank sent first they would all wait for each other. Start both with dist.isend and "
                f"dist.irecv, then wait for both")
    forgotten = [call.name for call in log if call.name in ("isend", "irecv") and call.waited_at is None]
    if forgotten:  # it may have worked this time: gloo had sent the few bytes before the rank moved on
        return (f"its dist.{forgotten[0]} is never waited for: wait for both the isend and the irecv before "
                f"returning (a receive may not have arrived yet, and on gloo a send whose handle nobody waits for "
                f"can leave its partner waiting)")
    transfers = [call for call in log if call.name in SENDS + RECEIVES]
    for early in transfers:
        late = [call for call in transfers if call.started_at > (early.waited_at if early.waited_at is not None
                                                                 else float("inf"))]
        if late:
            return (f"it waits for its {early.name} before it starts its {late[0].name}: a rank stuck in that "
                    f"wait never starts the transfer its neighbour waits for. Start both, then wait for both")
    if bytes_sent(log) != nbytes:
        return f"it sent {bytes_sent(log)} bytes for a {nbytes}-byte send_tensor: send send_tensor, once"
    return None


def check_exchange(exchange, world_size, seed=0, timeout=CHECK_TIMEOUT):
    """Each rank sends to one neighbour and receives from the other, at the same time."""
    world_sizes = runnable_world_sizes(sorted({max(world_size, 2), 3}))  # one rank has no neighbour
    for n in world_sizes:
        results = spawn_explaining_stalls(_exchange_main, n, exchange, seed, timeout=timeout, sizes=CHUNK_SIZES, hint=(
            "exchange hangs when a rank blocks before both transfers are started: a blocking dist.send (or "
            "dist.recv) on every rank waits for a partner that is itself waiting, or a send has no receive; or "
            "when a request is never waited for: wait for both the isend and the irecv before returning (on "
            "gloo, a send whose handle nobody waits for can leave its partner waiting)"))
        for rank in range(n):
            for shape, dtype, step, got, log, nbytes in results[rank]:
                sender = (rank - step) % n
                if not torch.equal(got, ring_input(shape, dtype, seed, sender)):
                    holds = next((f"rank {r}'s tensor" for r in range(n)
                                  if got.numel() and torch.equal(got, ring_input(shape, dtype, seed, r))),
                                 "its zeros, unchanged" if not got.any() else "something else")
                    raise AssertionError(
                        f"exchange on {n} ranks: rank {rank} should have received rank {sender}'s "
                        f"{tuple(shape)} {str(dtype)[6:]} tensor into recv_tensor (it was sent to dst, the "
                        f"receive comes from src), but recv_tensor holds {holds}")
                problem = exchange_order_problem(log, nbytes)
                if problem:
                    raise AssertionError(f"exchange on {n} ranks, rank {rank}: {problem}")
    print(f"exchange: correct on {' and '.join(map(str, world_sizes))} ranks, sending to the right and to the left")


# ---------------------------------------------------------------- what a wrong chunk holds


def _pieces(tensor, world_size):
    return tensor.reshape(-1).tensor_split(world_size)


def chunk_sources(got, inputs, world_size):
    """got (one chunk's values) as an integer combination of the input chunks: {(rank, chunk): coefficient},
    or None when it is not one (or the chunk is too short to tell)."""
    columns = [(r, c) for r in range(world_size) for c in range(world_size)]
    pieces = [_pieces(inputs[r], world_size)[c] for r, c in columns]
    if any(p.numel() != got.numel() for p in pieces) or got.numel() < len(columns):
        return None
    basis = torch.stack(pieces, dim=1).to(torch.float64)
    coefficients = torch.linalg.lstsq(basis, got.to(torch.float64).reshape(-1, 1)).solution.reshape(-1)
    rounded = coefficients.round()
    if max_abs_diff(basis @ rounded, got) > 1e-9 * max(1.0, got.abs().max().item()):
        return None
    return {column: int(k) for column, k in zip(columns, rounded.tolist()) if k}


def describe_chunk(kind, sources, i, rank, world_size):
    """In words, what chunk i holds on `rank` (sources from chunk_sources), against what it should hold."""
    n = world_size
    if sources is None:
        return "it is not a sum of the ranks' chunks at all"
    if not sources:
        return "it holds zeros"
    chunks = sorted({c for _, c in sources})
    if len(chunks) > 1:
        return (f"it mixes parts of chunks {chunks}: a rank adds (or stores) what it receives into a different "
                f"chunk than the one its neighbour sent; check the direction (send to the right, receive from "
                f"the left) and the chunk indices against the table")
    c, ranks = chunks[0], sorted(r for r, _ in sources)
    twice = sorted(r for (r, _), k in sources.items() if k != 1)
    if twice:
        return f"it counts the contribution of {_ranks(twice)} more than once: a received chunk was added twice"
    if c != i:
        return (f"it holds chunk {c}, not chunk {i}: the chunk indices are shifted by {(c - i) % n}, or the ring "
                f"turns the wrong way (send to the right, receive from the left); compare with the table")
    if kind == "all_gather":
        if ranks == [rank]:
            return f"it still holds this rank's own data: chunk {i} never arrived (a step too few?)"
        return f"it holds {_ranks(ranks)}'s chunk {i}, not rank {i}'s: check which chunk each step sends"
    missing = sorted(set(range(n)) - set(ranks))
    if ranks == [rank]:
        return (f"it holds only this rank's own contribution: nothing that arrived was ever added into chunk {i}; "
                f"check which chunk each step receives into against the table, and that what arrives is added")
    return (f"it is the sum over {_ranks(ranks)} only; {_ranks(missing)} never reached it "
            f"(a step too few, or a chunk that was received and stored instead of added)")


def ring_reference(kind, inputs, rank, world_size):
    """The single-process answer on `rank`, from every rank's input tensor."""
    total = torch.stack(inputs).sum(dim=0)
    if kind == "all_reduce":
        return total
    if kind == "reduce_scatter":
        return _pieces(total, world_size)[rank]
    # all_gather: chunk r of the result is chunk r of rank r's input
    pieces = [_pieces(inputs[r], world_size)[r] for r in range(world_size)]
    return torch.cat(pieces).view(inputs[0].shape)


def what_is_wrong(kind, got, want, inputs, rank, world_size, tolerance):
    """Which chunks of the result are wrong, and what the first of them holds."""
    n = world_size
    if kind == "reduce_scatter":
        return "the returned chunk is wrong: " + describe_chunk(kind, chunk_sources(got, inputs, n), rank, rank, n)
    wrong = [i for i, (g, w) in enumerate(zip(_pieces(got, n), _pieces(want, n))) if max_abs_diff(g, w) > tolerance]
    if kind == "all_reduce" and wrong == [i for i in range(n) if i != rank]:
        return (f"chunks {wrong} of {n} are wrong, only this rank's own chunk {rank} holds the full sum: the "
                f"all-gather that hands each rank's reduced chunk around is missing")
    first = wrong[0]
    holds = describe_chunk(kind, chunk_sources(_pieces(got, n)[first], inputs, n), first, rank, n)
    if kind == "all_reduce" and "more than once" in holds:
        holds += " (in an all-reduce, what happens when the all-gather runs before the reduce-scatter)"
    return f"chunks {wrong} of {n} are wrong; chunk {first}: {holds}"


# ---------------------------------------------------------------- the ring checks


@dataclasses.dataclass
class RingRun:
    """One rank's call of the function under test on one input."""

    result: object  # what the check compares: the tensor (in place) or the returned chunk
    theirs: torch.Tensor  # dist.all_reduce of the same input (all_reduce only; else the input)
    log: list  # utils.intercept.Call, one per communication call
    buffers: dict  # id of a receive Call -> (storage address, first byte, end byte) it received into


def _memory(tensor):
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    return tensor.untyped_storage().data_ptr(), start, start + tensor.numel() * tensor.element_size()


def _ring_main(rank, world_size, fn, kind, seed, kwargs):
    """Run the student's ring on every shape and dtype, logging what it calls and receives into. All ranks
    stop after the first case that went wrong on any of them: a wrong ring's messages soon stop matching
    in size, and gloo aborts the process on that."""
    runs = []
    for shape, dtype in ring_cases(world_size):
        x = ring_input(shape, dtype, seed, rank)
        theirs = x.clone()
        if kind == "all_reduce":
            dist.all_reduce(theirs)  # PyTorch's own, on the same data
        buffers = {}

        def note_buffer(call, arguments):
            if call.name in RECEIVES:
                buffers[len(buffers)] = _memory(arguments["tensor"])

        with intercept(before=note_buffer) as log:
            returned = fn(x, **kwargs)
        runs.append(RingRun(x if kind != "reduce_scatter" else returned, theirs, log, buffers))
        if _went_wrong(runs[-1], kind, shape, dtype, seed, rank, world_size):
            break
    return runs


def _went_wrong(run, kind, shape, dtype, seed, rank, world_size):
    """Whether any rank's last case called a collective or got a wrong value (agreed on by all ranks)."""
    inputs = [ring_input(shape, dtype, seed, r) for r in range(world_size)]
    want = ring_reference(kind, inputs, rank, world_size)
    got = run.result
    wrong = (any(c.name in COLLECTIVES for c in run.log) or not isinstance(got, torch.Tensor)
             or got.shape != want.shape or got.dtype != want.dtype or max_abs_diff(got, want) > RING_TOLERANCE[dtype])
    flag = torch.tensor([int(wrong)])
    dist.all_reduce(flag)
    return bool(flag.item())


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


def _check_values(name, kind, n, results, cases, seed):
    for i, (shape, dtype) in enumerate(cases):
        inputs = [ring_input(shape, dtype, seed, rank) for rank in range(n)]
        for rank in range(n):
            got, theirs = results[rank][i].result, results[rank][i].theirs
            want = ring_reference(kind, inputs, rank, n)
            tolerance = RING_TOLERANCE[dtype]
            where = f"{name} on {n} ranks, shape {shape}, {str(dtype)[6:]}, rank {rank}"
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != dtype:
                described = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)[:60]
                what = "return" if kind == "reduce_scatter" else "leave in place"
                raise AssertionError(f"{where}: expected it to {what} a {tuple(want.shape)} {dtype} tensor, "
                                     f"got {described}")
            if kind == "all_reduce" and max_abs_diff(theirs, want) > tolerance:
                raise AssertionError(f"{where}: dist.all_reduce disagrees with the single-process sum")
            if max_abs_diff(got, want) > tolerance:
                if torch.equal(got, inputs[rank]) and kind != "reduce_scatter":
                    raise AssertionError(f"{where}: the tensor is unchanged; the result must be written into it")
                sent = bytes_sent(results[rank][i].log)
                ring = ring_bytes_per_rank(kind, inputs[rank].numel(), inputs[rank].element_size(), n)[rank]
                short = (f"it made too few steps: it sent {sent} of the {ring} bytes a ring sends (N-1 steps per "
                         f"phase); " if sent < ring else "")
                raise AssertionError(f"{where}: {short}{what_is_wrong(kind, got, want, inputs, rank, n, tolerance)}")


def _check_bytes(name, kind, n, results, cases):
    for i, (shape, dtype) in enumerate(cases):
        x = results[0][i].theirs
        expected = ring_bytes_per_rank(kind, x.numel(), x.element_size(), n)
        for rank in range(n):
            sent = bytes_sent(results[rank][i].log)
            if sent != expected[rank]:
                raise AssertionError(
                    f"{name} on {n} ranks, shape {shape}, {str(dtype)[6:]}, rank {rank}: sent {sent} bytes; "
                    f"a bandwidth-optimal ring sends {expected[rank]} (each of the N-1 steps of a phase passes "
                    f"one chunk, about 1/{n} of the tensor, to the next rank, never the whole tensor)")


def run_ring(fn, kind, world_size, seed=0, timeout=CHECK_TIMEOUT, properties=None, **kwargs):
    """Run fn(tensor, **kwargs) on world_size ranks and on 3; check that it calls no collective, then
    `properties(name, n, cases, results)` if given, then the values, then the bytes."""
    name = fn.__name__ if getattr(fn, "__name__", "<lambda>") != "<lambda>" else f"ring_{kind}"
    world_sizes = runnable_world_sizes(sorted({world_size, 3}))
    for n in world_sizes:
        stall = (f"{name} hangs: some rank waits for a message that never comes. Every isend needs an irecv on the "
                 f"neighbour, of the same size, posted in the same order, every rank must make the same number "
                 f"of steps, and every isend and irecv must be waited for (on gloo, a send whose handle nobody "
                 f"waits for can leave its partner waiting)")
        results = spawn_explaining_stalls(_ring_main, n, fn, kind, seed, kwargs, timeout=timeout, sizes=CHUNK_SIZES,
                                          hint=stall)
        collectives = sorted({c.name for runs in results for run in runs for c in run.log if c.name in COLLECTIVES})
        if collectives:
            raise AssertionError(f"{name} calls dist.{collectives[0]}: build it from isend and irecv "
                                 f"(your exchange), without the collective it replaces")
        cases = ring_cases(n)[: len(results[0])]
        if properties is not None:
            properties(name, n, cases, results)
        _check_values(name, kind, n, results, cases, seed)  # the values, on every rank
        _check_bytes(name, kind, n, results, cases)  # then the traffic
    return name, world_sizes, len(cases)


def check_ring(fn, kind, world_size, seed=0, timeout=CHECK_TIMEOUT):
    """Check ring_reduce_scatter / ring_all_gather / ring_all_reduce on world_size ranks and on 3."""
    name, world_sizes, cases = run_ring(fn, kind, world_size, seed, timeout)
    print(f"{name}: correct on {' and '.join(map(str, world_sizes))} ranks, {cases} shapes and dtypes; "
          f"equals the single-process reference{' and dist.all_reduce' if kind == 'all_reduce' else ''}; "
          f"sends exactly what a bandwidth-optimal ring sends")


# ---------------------------------------------------------------- the pipelined ring


def pipelining_problem(run, segment_numel, world_size):
    """What keeps one rank's call of a pipelined reduce-scatter from being pipelined (None when nothing)."""
    sends = [c for c in run.log if c.name in SENDS]
    receives = [c for c in run.log if c.name in RECEIVES]
    element_size = run.theirs.element_size()
    largest = max((c.nbytes for c in sends), default=0) // element_size
    if largest > segment_numel:
        return (f"it sends a message of {largest} elements with segment_numel = {segment_numel}: cut each chunk "
                f"into segments of at most segment_numel elements and send them one by one")
    for k, call in enumerate(receives):
        buffer = run.buffers[k]
        for earlier, other in zip(receives[:k], list(run.buffers.values())[:k]):
            still_arriving = earlier.waited_at is None or earlier.waited_at > call.started_at
            if still_arriving and other[0] == buffer[0] and other[1] < buffer[2] and buffer[1] < other[2]:
                return ("it receives a segment into memory that an earlier receive is still writing into: use "
                        "two buffers in turns, so that segment k+1 lands in the other one")
    early = sum(1 for before, after in zip(receives, receives[1:])
                if before.waited_at is not None and after.started_at < before.waited_at)
    if early < len(receives) - (world_size - 1):
        return ("within a step, it waits for segment k before it posts the receive of segment k+1, so nothing "
                "travels while a segment is added: post the next receive first, then wait for and add this one")
    return None


def check_pipelined_ring(fn, world_size, segment_numel=3, seed=0, timeout=CHECK_TIMEOUT):
    """Check a pipelined ring reduce-scatter: the ring's values and bytes, sent in segments, with each
    segment's receive posted before the previous one is waited for and landing in a free buffer."""
    def pipelined(name, n, cases, results):  # checked before the values: a shared buffer garbles them
        for i, (shape, dtype) in enumerate(cases):
            for rank in range(n):
                problem = pipelining_problem(results[rank][i], segment_numel, n)
                if problem:
                    raise AssertionError(f"{name} on {n} ranks, shape {shape}, {str(dtype)[6:]}, rank {rank}, "
                                         f"segment_numel={segment_numel}: {problem}")

    name, world_sizes, cases = run_ring(fn, "reduce_scatter", world_size, seed, timeout, properties=pipelined,
                                        segment_numel=segment_numel)
    print(f"{name}: correct on {' and '.join(map(str, world_sizes))} ranks, {cases} shapes and dtypes; "
          f"sends what a bandwidth-optimal ring sends, in segments of at most {segment_numel} elements, "
          f"each receive posted before the previous one is waited for, into a free buffer")
