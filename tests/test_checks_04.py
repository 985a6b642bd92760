"""The notebook 04 checks: right schedules pass on any stage count, each typical wrong one fails with a hint."""
from collections import deque

import pytest
import torch
import torch.distributed as dist

from utils import pipeline as pp
from utils.checks.pipeline import check_gpipe_step, check_naive_step, check_one_f_one_b_step
from utils.model import loss_fn

HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS, NUM_MICRO_BATCHES = 8, 5, 8, 2, 4
HANG = 3  # seconds: the checks' timeout in the tests where a stage waits forever


# ---------------------------------------------------------------- right answers, with switches for the wrong ones

def schedules(send_fwd=True, recv_fwd=True, hand_off=True, scale=True, extra_send=False, whole_loss=True,
              blocking_1f1b=False, one_f_one_b_order=True):
    """(naive_step, gpipe_step, one_f_one_b_step) as in the notebook; each switch breaks one thing."""
    def send_forward(y):
        if send_fwd:
            dist.send(y.detach(), dst=dist.get_rank() + 1)
        if extra_send:
            dist.send(y.detach(), dst=dist.get_rank() + 1)

    def recv_forward(shape, dtype):
        x = torch.zeros(shape, dtype=dtype)
        if recv_fwd:
            dist.recv(x, src=dist.get_rank() - 1)
        if extra_send:
            dist.recv(x, src=dist.get_rank() - 1)
        return x

    def forward_step(stage, micro_batch, m):
        x = micro_batch if stage.is_first else recv_forward(micro_batch.shape, micro_batch.dtype).requires_grad_()
        y = stage(x)
        if stage.is_last:
            return x, loss_fn(y) / (m if scale else 1)
        send_forward(y)
        return x, y

    def backward_step(stage, x, y):
        if stage.is_last:
            y.backward()
        elif hand_off:
            grad = torch.empty_like(y)
            dist.recv(grad, src=stage.rank + 1)
            y.backward(grad)
        else:  # no hand-off: each stage back-propagates something of its own
            y.backward(torch.ones_like(y))
        if hand_off and not stage.is_first:
            dist.send(x.grad, dst=stage.rank - 1)

    def naive_step(stage, batch):
        x, y = forward_step(stage, batch, 1)
        backward_step(stage, x, y)
        return y.detach() if stage.is_last else None

    def gpipe_step(stage, batch, m):
        alive = [forward_step(stage, mb, m) for mb in batch.chunk(m)]
        for x, y in alive:
            backward_step(stage, x, y)
        if not stage.is_last:
            return None
        return sum(y.detach() for _, y in alive) if whole_loss else alive[-1][1].detach()

    def one_f_one_b_step(stage, batch, m):
        micro_batches = batch.chunk(m)
        num_warmup = min(stage.world_size - stage.rank - 1, m) if one_f_one_b_order else m
        alive, sends, loss = deque(), [], 0.0

        def send(tensor, dst):
            if blocking_1f1b:
                dist.send(tensor, dst=dst)
            else:
                sends.append(dist.isend(tensor, dst=dst))

        def forward(micro_batch):
            x = micro_batch if stage.is_first else recv_forward(micro_batch.shape, micro_batch.dtype).requires_grad_()
            y = stage(x)
            if stage.is_last:
                alive.append((x, loss_fn(y) / (m if scale else 1), None, None))
                return
            send(y.detach(), stage.rank + 1)
            grad = torch.empty_like(y)
            alive.append((x, y, grad, None if blocking_1f1b else dist.irecv(grad, src=stage.rank + 1)))

        def backward():
            nonlocal loss
            x, y, grad, received = alive.popleft()
            if stage.is_last:
                y.backward()
                loss = loss + y.detach()
            else:
                if received is None:
                    dist.recv(grad, src=stage.rank + 1)
                else:
                    received.wait()
                y.backward(grad)
            if not stage.is_first:
                send(x.grad, stage.rank - 1)

        for i in range(num_warmup):
            forward(micro_batches[i])
        for i in range(num_warmup, m):
            forward(micro_batches[i])
            backward()
        for _ in range(num_warmup):
            backward()
        for handle in sends:
            handle.wait()
        return loss if stage.is_last else None

    return naive_step, gpipe_step, one_f_one_b_step


SIZES = (HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS)


def check(kind, world_size=2, timeout=20, **switches):
    naive, gpipe, one_f_one_b = schedules(**switches)
    if kind == "naive":
        check_naive_step(naive, world_size, *SIZES, timeout=timeout)
    elif kind == "gpipe":
        check_gpipe_step(gpipe, world_size, *SIZES, NUM_MICRO_BATCHES, timeout=timeout)
    else:
        check_one_f_one_b_step(one_f_one_b, world_size, *SIZES, NUM_MICRO_BATCHES, timeout=timeout)


# ---------------------------------------------------------------- they pass

@pytest.mark.parametrize("world_size", [3, 2])
def test_right_schedules_pass(world_size, capsys):
    for kind in ("naive", "gpipe", "1f1b"):
        check(kind, world_size)
    out = capsys.readouterr().out
    assert "naive_step: correct" in out and "gpipe_step: correct" in out and "one_f_one_b_step: correct" in out
    assert "Schedule1F1B" in out


def test_stage_split_rule():
    assert [list(r) for r in pp.stage_layers(6, 4)] == [[0, 1], [2, 3], [4], [5]]
    assert [len(r) for r in pp.stage_layers(7, 3)] == [3, 2, 2]
    assert [len(r) for r in pp.stage_layers(4, 4)] == [1, 1, 1, 1]


def test_bad_sizes_name_the_values():
    with pytest.raises(ValueError, match="world size 4 is more stages than num layers 3"):
        pp.check_sizes(3, 4, 8, 1)
    with pytest.raises(ValueError, match="batch size 8 is not divisible by num micro batches 3"):
        pp.check_sizes(6, 2, 8, 3)
    with pytest.raises(TypeError, match="num_micro_batches must be an int, got 2.0"):
        pp.check_sizes(6, 2, 8, 2.0)
    with pytest.raises(ValueError, match="world size 6 is more stages than num layers 5"):
        check("gpipe", 6)


def test_bubble_formula_and_idle_fraction():
    assert pp.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    events = [[("F", 0, 0.0, 1.0), ("B", 0, 3.0, 4.0)], [("F", 0, 1.0, 2.0), ("B", 0, 2.0, 3.0)]]
    assert pp.idle_fraction(events) == pytest.approx(0.5)


# ---------------------------------------------------------------- they fail, saying why

@pytest.mark.parametrize("kind, switches", [
    ("naive", dict(send_fwd=False)),           # the next stage waits for an activation forever
    ("naive", dict(recv_fwd=False)),           # the previous stage's send waits for a receiver forever
    ("1f1b", dict(blocking_1f1b=True)),        # blocking sends both ways: neighbours wait for each other
])
def test_missing_messages_and_deadlocks_end_in_the_timeout(kind, switches):
    with pytest.raises(TimeoutError, match="did not finish within 3 s"):
        check(kind, timeout=HANG, **switches)


@pytest.mark.parametrize("kind, switches, match", [
    ("naive", dict(hand_off=False), "stage 0 of 2 .* 0 receive\\(s\\) in one step; expected 1: 1 gradient\\(s\\) "
                                    "from the next stage"),
    ("gpipe", dict(scale=False), "the gradient of layers.0.linear.weight is 2 times the full batch's"),
    ("1f1b", dict(scale=False), "is 2 times the full batch's: .* divide each micro-batch's loss by num_micro_batches"),
    ("gpipe", dict(extra_send=True), "sent 2 message\\(s\\), 1024 bytes, in one step; expected 1 activation"),
    ("gpipe", dict(whole_loss=False), "the loss returned at step 0"),
    ("1f1b", dict(one_f_one_b_order=False), "stage 1 of 2 .* held the activations of 2 micro-batch\\(es\\) at once; "
                                            "expected 1 \\(0 warm-up forward"),
])
def test_wrong_schedules_fail(kind, switches, match):
    with pytest.raises(AssertionError, match=match):
        check(kind, **switches)


def test_a_wrong_stage_split_fails(monkeypatch):
    def last_stages_take_more(num_layers, world_size):
        sizes = [num_layers // world_size + (s >= world_size - num_layers % world_size) for s in range(world_size)]
        starts = [sum(sizes[:s]) for s in range(world_size)]
        return [range(a, a + n) for a, n in zip(starts, sizes)]

    monkeypatch.setattr(pp, "stage_layers", last_stages_take_more)
    with pytest.raises(AssertionError, match="holds 2 layer\\(s\\); expected 3: 5 // 2 each, and one more on the"):
        check("naive")
