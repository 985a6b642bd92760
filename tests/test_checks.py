"""The exercise checks: a right answer passes at any world size, each typical wrong one fails with a hint."""
import pytest
import torch
import torch.distributed as dist

from utils.checks import seeded_randn
from utils.checks.setup import check_average_over_ranks


def right(tensor):
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()


def no_all_reduce(tensor):
    tensor /= dist.get_world_size()


def no_division(tensor):
    dist.all_reduce(tensor)


def not_in_place(tensor):
    dist.all_reduce(tensor.clone())
    tensor = tensor / dist.get_world_size()  # noqa: F841 (the mistake under test)


def divides_by_two(tensor):
    dist.all_reduce(tensor)
    tensor /= 2


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_right_average_passes(world_size, capsys):
    check_average_over_ranks(right, world_size)
    assert f"correct on {world_size} ranks" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, hint", [
    (no_all_reduce, "never communicated"),
    (no_division, "sum over ranks"),
    (not_in_place, "unchanged"),
    (divides_by_two, "max abs difference"),
])
def test_a_wrong_average_fails_and_says_why(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        check_average_over_ranks(wrong, 3)


def test_seeded_randn_depends_only_on_seed_rank_and_shape():
    assert torch.equal(seeded_randn((3,), 0, 1), seeded_randn((3,), 0, 1))
    assert not torch.equal(seeded_randn((3,), 0, 1), seeded_randn((3,), 0, 2))
    assert seeded_randn((2, 2), 1).dtype == torch.float64


# ---------------------------------------------------------------- the ring checks (notebook 01)

from utils.checks.collectives import check_exchange, check_ring, ring_bytes_per_rank  # noqa: E402


def exchange(send_tensor, dst, recv_tensor, src):
    receive = dist.irecv(recv_tensor, src=src)
    send = dist.isend(send_tensor, dst=dst)
    receive.wait()
    send.wait()


def ring_reduce_scatter(tensor, add=True, offset=1):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)
    buffer = torch.empty_like(chunks[0])
    for step in range(n - 1):
        recv_chunk = chunks[(rank - step - 1 - offset) % n]
        incoming = buffer[: recv_chunk.numel()]
        exchange(chunks[(rank - step - 1) % n], (rank + 1) % n, incoming, (rank - 1) % n)
        if add:
            recv_chunk += incoming
    return chunks[rank]


def ring_all_gather(tensor, steps=None):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(n - 1 if steps is None else steps):
        exchange(chunks[(rank - step) % n], (rank + 1) % n, chunks[(rank - step - 1) % n], (rank - 1) % n)


def ring_all_reduce(tensor):
    ring_reduce_scatter(tensor)
    ring_all_gather(tensor)


def everyone_to_everyone(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    others = [r for r in range(n) if r != rank]
    received = {r: torch.empty_like(tensor) for r in others}
    requests = [dist.irecv(received[r], src=r) for r in others] + [dist.isend(tensor, dst=r) for r in others]
    for request in requests:
        request.wait()
    for r in others:
        tensor += received[r]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_right_rings_pass(world_size, capsys):
    check_ring(ring_reduce_scatter, "reduce_scatter", world_size)
    check_ring(ring_all_gather, "all_gather", world_size)
    check_ring(ring_all_reduce, "all_reduce", world_size)
    check_exchange(exchange, world_size)
    assert capsys.readouterr().out.count("correct on") == 4


@pytest.mark.parametrize("kind, wrong, message", [
    ("reduce_scatter", lambda t: ring_reduce_scatter(t, add=False), "the reduced chunk is wrong"),
    ("reduce_scatter", lambda t: ring_reduce_scatter(t, offset=0), "wrong|size"),
    ("all_gather", lambda t: ring_all_gather(t, steps=1), r"chunks \[.*\] of 3 are wrong"),
    ("all_gather", lambda t: None, "unchanged"),
    ("all_reduce", lambda t: ring_reduce_scatter(t), "are wrong"),
    ("all_reduce", everyone_to_everyone, "a bandwidth-optimal ring sends"),
    ("all_reduce", lambda t: dist.all_reduce(t), "not allowed"),
    ("reduce_scatter", lambda t: t.tolist(), "expected a"),
])
def test_wrong_rings_fail_with_a_reason(kind, wrong, message):
    with pytest.raises((AssertionError, RuntimeError), match=message):
        check_ring(wrong, kind, 3)


def test_a_missing_send_ends_in_a_timeout_not_a_hang():
    def receive_only(send_tensor, dst, recv_tensor, src):
        dist.recv(recv_tensor, src=src)

    with pytest.raises(TimeoutError, match="did not finish"):
        check_exchange(receive_only, 2, timeout=2)


def test_ring_bytes_formula():
    # divisible: every rank sends 2(N-1)/N * S; not divisible: the total is still 2(N-1) * S
    assert ring_bytes_per_rank("all_reduce", 8, 4, 4) == [48] * 4
    assert sum(ring_bytes_per_rank("all_reduce", 10, 1, 4)) == 2 * 3 * 10
    assert sum(ring_bytes_per_rank("reduce_scatter", 2, 8, 3)) == 2 * 8 * 2


def _counted(rank, world_size):
    from utils.counting import bytes_sent, calls, record_communication

    x = torch.ones(10)  # 40 bytes
    with record_communication() as log:
        if rank == 0:
            dist.send(x, dst=1)  # send calls isend inside: still one send of 40 bytes
            dist.isend(x, dst=1).wait()
        else:
            dist.recv(x, src=0)
            dist.irecv(x, src=0).wait()
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % 2), dist.P2POp(dist.irecv, torch.empty(10), (rank + 1) % 2)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        dist.all_reduce(x)
    return bytes_sent(log), calls(log, "all_reduce"), len(log)


def test_record_communication_counts_each_call_once():
    from utils.launch import spawn

    assert spawn(_counted, 2) == [(120, 1, 5), (40, 1, 5)]


def test_max_abs_diff_counts_nan_as_infinitely_far():
    from utils.checks import max_abs_diff

    assert max_abs_diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])) == float("inf")
    assert max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])) == 0.5
