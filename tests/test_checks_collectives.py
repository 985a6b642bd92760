"""Notebook 01's checks: the solution passes at any world size; each wrong answer in the catalogue fails at its
own check with a hint that names the mistake. Right answers come from the solution notebook, wrong ones are
small edits of it."""
import pytest
import torch
import torch.distributed as dist

from utils.bench import bytes_on_the_wire
from utils.checks.collectives import check_exchange, check_pipelined_ring, check_ring, ring_bytes_per_rank
from utils.counting import bytes_sent, calls, record_communication
from utils.launch import spawn
from utils.notebooks import solution

NAME = "01_collectives"
SOLUTION = solution(NAME)

# The solution's lines that the wrong answers edit.
EXCHANGE = """    receive = dist.irecv(recv_tensor, src=src)  # posted first: the data can land straight in place
    send = dist.isend(send_tensor, dst=dst)
    receive.wait()
    send.wait()
"""
RS_STEPS = "    for step in range(world_size - 1):\n        send_chunk = "
RS_RECV = "        recv_chunk = chunks[(rank - step - 2) % world_size]\n"
RS_ADD = "        recv_chunk += incoming\n"
RS_EXCHANGE = "        exchange(send_chunk, right, incoming, left)\n"
AG_STEP = "        exchange(chunks[(rank - step) % world_size], right, chunks[(rank - step - 1) % world_size], left)\n"
AG_LOOP = "    for step in range(world_size - 1):\n        exchange(chunks[(rank - step) % world_size]"
AR = "    ring_reduce_scatter(tensor)\n    ring_all_gather(tensor)\n    ### END SOLUTION"
P_WAIT = """            following = receive(k + 1) if k + 1 < segments else None  # travels while segment k is added
            pending.wait()
"""


def wrong(old, new):
    return solution(NAME, replace={old: new})


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2,  # 4: the notebook's own run
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_the_solution_passes(world_size, capsys):
    check_exchange(SOLUTION.exchange, world_size)
    check_ring(SOLUTION.ring_reduce_scatter, "reduce_scatter", world_size)
    check_ring(SOLUTION.ring_all_gather, "all_gather", world_size)
    check_ring(SOLUTION.ring_all_reduce, "all_reduce", world_size)
    check_pipelined_ring(SOLUTION.pipelined_ring_reduce_scatter, world_size)
    assert capsys.readouterr().out.count("correct on") == 5


# ---------------------------------------------------------------- exchange

EXCHANGE_MISTAKES = {
    "blocking send and recv, ordered by rank parity": (
        "    if dist.get_rank() % 2 == 0:\n        dist.send(send_tensor, dst=dst)\n"
        "        dist.recv(recv_tensor, src=src)\n"
        "    else:\n        dist.recv(recv_tensor, src=src)\n        dist.send(send_tensor, dst=dst)\n",
        "one after the other, not at the same time"),
    "src and dst swapped": (
        "    receive = dist.irecv(recv_tensor, src=dst)\n    send = dist.isend(send_tensor, dst=src)\n"
        "    receive.wait()\n    send.wait()\n", r"holds rank \d's tensor"),
    "receives into a copy": (
        "    receive = dist.irecv(recv_tensor.clone(), src=src)\n    send = dist.isend(send_tensor, dst=dst)\n"
        "    receive.wait()\n    send.wait()\n", "its zeros, unchanged"),
}


@pytest.mark.parametrize("right", [
    "    send = dist.isend(send_tensor, dst=dst)\n    dist.recv(recv_tensor, src=src)\n    send.wait()\n",
    "    receive = dist.irecv(recv_tensor, src=src)\n    dist.send(send_tensor, dst=dst)\n    receive.wait()\n",
])
def test_a_blocking_call_while_the_other_transfer_is_in_flight_is_right(right):
    """One request in flight, the other transfer blocking: they overlap, and no rank can wait for another."""
    check_exchange(wrong(EXCHANGE, right).exchange, 3)


@pytest.mark.parametrize("mistake", EXCHANGE_MISTAKES)
def test_a_wrong_exchange_fails_and_names_the_mistake(mistake):
    new, hint = EXCHANGE_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_exchange(wrong(EXCHANGE, new).exchange, 3)


@pytest.mark.parametrize("mistake, new", [
    ("blocking send, then recv", "    dist.send(send_tensor, dst=dst)\n    dist.recv(recv_tensor, src=src)\n"),
    ("never sends", "    dist.irecv(recv_tensor, src=src).wait()\n"),
    ("waits for the send before starting the receive", "    send = dist.isend(send_tensor, dst=dst)\n    send.wait()\n"
                                                      "    receive = dist.irecv(recv_tensor, src=src)\n"
                                                      "    receive.wait()\n"),
    ("sends twice", EXCHANGE + "    dist.isend(send_tensor, dst=dst).wait()\n"),
])
def test_an_exchange_that_deadlocks_ends_in_a_timeout_that_says_why(mistake, new):
    with pytest.raises(TimeoutError, match="(?s)a blocking dist.send.*a send has no receive.*did not finish"):
        check_exchange(wrong(EXCHANGE, new).exchange, 2, timeout=1.5)


@pytest.mark.parametrize("mistake, new", [
    ("the send never waited for", "    receive = dist.irecv(recv_tensor, src=src)\n"
                                  "    send = dist.isend(send_tensor, dst=dst)\n    receive.wait()\n"),
    ("the receive never waited for", "    receive = dist.irecv(recv_tensor, src=src)\n"
                                     "    send = dist.isend(send_tensor, dst=dst)\n    send.wait()\n"),
])
def test_an_exchange_that_forgets_a_wait_ends_in_an_error_that_names_it(mistake, new):
    """A stall when gloo leaves the partner waiting; else (the bytes went through in time) the log names it."""
    with pytest.raises((TimeoutError, AssertionError), match="(?s)never waited for: wait for both"):
        check_exchange(wrong(EXCHANGE, new).exchange, 2, timeout=1.5)


def test_a_receive_buffer_of_the_wrong_size_is_named_not_only_gloos_abort():
    """The buffer sized by this rank's chunk, not the longest: on 3 ranks a (2,) tensor has an empty chunk 2."""
    short = wrong("    buffer = torch.empty_like(chunks[0])  # chunk 0 is the longest\n",
                  "    buffer = torch.empty_like(chunks[rank])\n")
    with pytest.raises(AssertionError, match="SIGABRT .*: a message arrived whose size is not its receive buffer's"):
        check_ring(short.ring_reduce_scatter, "reduce_scatter", 3)


def test_a_ring_whose_receives_do_not_match_its_sends_ends_in_a_timeout_that_says_why():
    receives_twice = wrong(RS_ADD, RS_ADD + "        dist.irecv(incoming, src=left).wait()\n")
    with pytest.raises(TimeoutError, match="(?s)waits for a message that never comes.*did not finish"):
        check_ring(receives_twice.ring_reduce_scatter, "reduce_scatter", 3, timeout=1.5)


# ---------------------------------------------------------------- the ring

RING_MISTAKES = {
    "reduce_scatter": {
        "receive index off by one": (RS_RECV, RS_RECV.replace("step - 2", "step - 1"),
                                     "which chunk each step receives"),
        "send index off by one": ("        send_chunk = chunks[(rank - step - 1) % world_size]\n",
                                  "        send_chunk = chunks[(rank - step) % world_size]\n", "mixes parts of chunks"),
        "a step too few": (RS_STEPS, RS_STEPS.replace("world_size - 1", "world_size - 2"), "too few steps"),
        "received but not added": (RS_ADD, "        recv_chunk.copy_(incoming)\n", "never reached it"),
        "sends left, receives from the right": (RS_EXCHANGE,
                                                RS_EXCHANGE.replace("right, incoming, left", "left, incoming, right"),
                                                "mixes parts of chunks"),
        "nothing added at all": (RS_EXCHANGE + RS_ADD, RS_EXCHANGE, "only this rank's own contribution"),
        "uses dist.reduce_scatter_single": (
            RS_STEPS, "    dist.reduce_scatter_single(chunks[rank], tensor.clone().view(-1))\n"
                      "    return chunks[rank]\n" + RS_STEPS,
            "calls dist.reduce_scatter_single"),
    },
    "all_gather": {
        "indices off by one": (AG_STEP, AG_STEP.replace("step) %", "step - 1) %")
                                        .replace("step - 1) % world_size], left", "step - 2) % world_size], left"),
                               "holds rank 1's chunk 0, not rank 0's"),
        "a step too few": (AG_LOOP, AG_LOOP.replace("world_size - 1", "world_size - 2"),
                           "too few steps.*never arrived"),
        "sends left, receives from the right": (AG_STEP, AG_STEP.replace("], right, chunks", "], left, chunks")
                                                .replace("], left)\n", "], right)\n"), "the ring turns the wrong way"),
        "uses dist.all_gather_single": (AG_LOOP, "    dist.all_gather_single(tensor.view(-1), chunks[rank].clone())\n"
                                                 "    return\n" + AG_LOOP,
                                        "calls dist.all_gather_single"),
    },
    "all_reduce": {
        "no all-gather": (AR, "    ring_reduce_scatter(tensor)\n    ### END SOLUTION",
                          "too few steps.*the all-gather .* is missing"),
        "all-gather before reduce-scatter": (AR, "    ring_all_gather(tensor)\n    ring_reduce_scatter(tensor)\n"
                                                 "    ### END SOLUTION", "all-gather runs before the reduce-scatter"),
        "everyone to everyone": (AR, "    everyone_to_everyone(tensor)\n    ### END SOLUTION",
                                 "a bandwidth-optimal ring sends"),
        "reduce to rank 0, then broadcast": (AR, "    reduce_then_broadcast(tensor)\n    ### END SOLUTION",
                                             "a bandwidth-optimal ring sends"),
        "uses dist.all_reduce": (AR, "    dist.all_reduce(tensor)\n    ### END SOLUTION", "calls dist.all_reduce"),
    },
}
FUNCTIONS = {"reduce_scatter": "ring_reduce_scatter", "all_gather": "ring_all_gather", "all_reduce": "ring_all_reduce"}


@pytest.mark.parametrize("kind, mistake", [(k, m) for k, ms in RING_MISTAKES.items() for m in ms])
def test_a_wrong_ring_fails_and_names_the_mistake(kind, mistake):
    old, new, hint = RING_MISTAKES[kind][mistake]
    with pytest.raises(AssertionError, match=hint):
        check_ring(getattr(wrong(old, new), FUNCTIONS[kind]), kind, 3)


def test_a_ring_that_returns_something_else_is_told_what_to_return():
    returns_a_list = wrong("        recv_chunk += incoming\n    ### END SOLUTION\n    return chunks[rank]",
                           "        recv_chunk += incoming\n    return chunks[rank].tolist()\n    ### END SOLUTION")
    with pytest.raises(AssertionError, match="expected it to return a"):
        check_ring(returns_a_list.ring_reduce_scatter, "reduce_scatter", 3)


def test_a_ring_that_changes_nothing_is_told_so():
    with pytest.raises(AssertionError, match="the tensor is unchanged"):
        check_ring(wrong(AR, "    pass\n    ### END SOLUTION").ring_all_reduce, "all_reduce", 3)


# ---------------------------------------------------------------- the pipelined ring

PIPELINE_MISTAKES = {
    "waits before posting the next receive": (
        P_WAIT, "            pending.wait()\n"
                "            following = receive(k + 1) if k + 1 < segments else None\n",
        "waits for segment k before it posts"),
    "one buffer for every segment": (
        "            return dist.irecv(buffers[k % 2][: targets[k].numel()], src=left)\n",
        "            return dist.irecv(buffers[0][: targets[k].numel()], src=left)\n", "still writing"),
    "the plain ring, not cut into segments": (
        "    for step in range(world_size - 1):\n        outgoing",
        "    return ring_reduce_scatter(tensor)\n    for step in range(world_size - 1):\n        outgoing",
        "cut each chunk"),
    "index off by one": ("        targets = chunks[(rank - step - 2) % world_size]",
                         "        targets = chunks[(rank - step - 1) % world_size]", "which chunk each step receives"),
    "a step too few": ("    for step in range(world_size - 1):\n        outgoing",
                       "    for step in range(world_size - 2):\n        outgoing", "too few steps"),
}


@pytest.mark.parametrize("mistake", PIPELINE_MISTAKES)
def test_a_wrong_pipelined_ring_fails_and_names_the_mistake(mistake):
    old, new, hint = PIPELINE_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_pipelined_ring(wrong(old, new).pipelined_ring_reduce_scatter, 3)


# ---------------------------------------------------------------- counting bytes


def test_ring_bytes_formula():
    # divisible: every rank sends 2(N-1)/N * S; not divisible: the total is still 2(N-1) * S
    assert ring_bytes_per_rank("all_reduce", 8, 4, 4) == [48] * 4
    assert sum(ring_bytes_per_rank("all_reduce", 10, 1, 4)) == 2 * 3 * 10
    assert sum(ring_bytes_per_rank("reduce_scatter", 2, 8, 3)) == 2 * 8 * 2


def _counted(rank, world_size):
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
    assert spawn(_counted, 2) == [(120, 1, 5), (40, 1, 5)]


def _on_the_wire(rank, world_size):
    x = torch.ones(2**18)  # 1 MB
    send = bytes_on_the_wire(lambda: dist.send(x, dst=1) if rank == 0 else dist.recv(x, src=0))
    reduce_scatter = bytes_on_the_wire(lambda: dist.reduce_scatter_single(torch.empty(2**17), x))
    return send, reduce_scatter


def test_bytes_on_the_wire_sees_what_gloo_sends():
    (send, reduce_scatter), (received, _) = spawn(_on_the_wire, 2)
    if send is None:
        pytest.skip("this system does not count the bytes a process writes")
    assert 2**20 <= send < 1.01 * 2**20 and received < 2**10
    # gloo's reduce-scatter all-reduces: it sends S on 2 ranks, where a ring sends S/2
    assert 2**20 <= reduce_scatter < 1.01 * 2**20
