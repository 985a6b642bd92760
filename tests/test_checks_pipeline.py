"""utils/checks/pipeline.py: the notebook 04 (and 12) solution passes every check on any stage count; each plausible
wrong answer, written as a small edit of the solution itself, fails at its own exercise's check with a
hint that names the mistake."""
import pytest
import torch

from utils import pipeline as pp
from utils.checks.pipeline import (
    check_backward_split,
    check_forward_backward,
    check_gpipe_step,
    check_hand_offs,
    check_interleaved_step,
    check_naive_step,
    check_one_f_one_b_step,
    check_zb_h1_step,
)
from utils.notebooks import solution

NOTEBOOK = "04_pipeline_parallel"
HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, NUM_STEPS, NUM_MICRO_BATCHES = 8, 5, 8, 2, 4
HANG = 2  # seconds: the checks' timeout in the tests where a stage waits forever


def check(exercise, sol, world_size=2, timeout=20):
    """Run the check cell of `exercise` on the functions of `sol` (a solution module, maybe edited)."""
    sizes = (HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE)
    if exercise == "hand_offs":
        check_hand_offs(sol.send_forward, sol.recv_forward, sol.send_backward, sol.recv_backward, world_size,
                        HIDDEN_DIM, BATCH_SIZE // NUM_MICRO_BATCHES, timeout=timeout)
    elif exercise == "forward_backward":
        check_forward_backward(sol.forward_step, sol.backward_step, world_size, *sizes, timeout=timeout)
    elif exercise == "naive":
        check_naive_step(sol.naive_step, world_size, *sizes, NUM_STEPS, timeout=timeout)
    elif exercise == "gpipe":
        check_gpipe_step(sol.gpipe_step, world_size, *sizes, NUM_STEPS, NUM_MICRO_BATCHES, timeout=timeout)
    else:
        check_one_f_one_b_step(sol.one_f_one_b_step, world_size, *sizes, NUM_STEPS, NUM_MICRO_BATCHES, timeout=timeout)


# ---------------------------------------------------------------- the solution passes

# Slow at 3 stages too (7 s): the default run makes the same checks in notebook 04's strict nbval run, at 4 and 2 stages
# (6 layers: 2, 2, 1, 1 and 3, 3; the hand-offs at 3 and 4), and the wrong answers' tests below run them at 2 and 4
# stages (5 layers). An odd stage count for the schedules (3, here) and the notebook at WORLD_SIZE=2 are left to
# pytest -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 2])  # 4: the notebook's own run
def test_the_solution_passes_every_check(world_size, capsys):
    sol = solution(NOTEBOOK)
    for exercise in ("hand_offs", "forward_backward", "naive", "gpipe", "1f1b"):
        check(exercise, sol, world_size)
    out = capsys.readouterr().out
    for verdict in ("hand-offs: correct", "forward_step and backward_step: correct", "naive_step: correct",
                    "gpipe_step: correct", "one_f_one_b_step: correct", "Schedule1F1B", "still in flight"):
        assert verdict in out


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
        check("gpipe", solution(NOTEBOOK), 6)


def events(*rows):
    return [[pp.Event(*e) for e in row] for row in rows]


def test_bubble_formula_idle_fraction_and_replay():
    assert pp.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    step = events([("F", 0, 0.0, 1.0), ("B", 0, 3.0, 4.0)], [("F", 0, 1.0, 2.0), ("B", 0, 2.0, 3.0)])
    assert pp.idle_fraction(step) == pytest.approx(0.5)
    # the same step with a 0.5 s hand-off into stage 1 and a gap of 0.5 s on stage 0: the replay closes both
    late = events([("F", 0, 0.0, 1.0), ("B", 0, 4.5, 5.5)], [("F", 0, 1.5, 2.5), ("B", 0, 2.5, 3.5)])
    assert [e.start for e in pp.replay(late)[0]] == [0.0, 3.0]
    assert pp.idle_fraction(pp.replay(late)) == pytest.approx(0.5)
    assert sorted(pp.hand_off_delays(late)) == pytest.approx([0.5, 1.0])


def test_idle_shares_add_up_to_the_idle_fraction():
    late = events([("F", 0, 0.0, 1.0), ("B", 0, 4.5, 5.5)], [("F", 0, 1.5, 2.5), ("B", 0, 2.5, 3.5)])
    records = [pp.StepRecord(events=row) for row in late]
    shares = pp.idle_shares(records)
    assert sum(vars(shares).values()) == pytest.approx(pp.idle_fraction(late))
    assert shares.hand_off == pytest.approx((0.5 + 1.0) / 11)  # stage 1's wait for F0, stage 0's for B0


def test_recording_stays_outside_the_stage():
    stage = pp.build_stage(0, 1, HIDDEN_DIM, 2)
    with pp.record_step(stage) as record:
        for micro_batch in torch.ones(4, HIDDEN_DIM, dtype=torch.float64).chunk(2):
            stage(micro_batch).square().mean().backward()
    assert [(e.kind, e.micro_batch) for e in record.events] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert record.peak_alive == 1
    assert not stage._forward_hooks and not stage._forward_pre_hooks  # removed on leaving the block


# ---------------------------------------------------------------- wrong answers, each an edit of the solution

SEND_FORWARD = "    dist.send(y.detach(), dst=dist.get_rank() + 1)\n"
RECV_BACKWARD = ("    grad = torch.empty(shape, dtype=dtype)\n    dist.recv(grad, src=dist.get_rank() + 1)\n"
                 "    return grad\n")
FORWARD_LOSS = "        return x, loss_fn(y) / num_micro_batches\n"
BACKWARD_RECV = "        y.backward(recv_backward(y.shape, y.dtype))\n"
GPIPE_FORWARDS = ("    alive = [forward_step(stage, micro_batch, num_micro_batches) for micro_batch in "
                  "batch.chunk(num_micro_batches)]\n    for x, y in alive:\n        backward_step(stage, x, y)\n")
ISEND_FORWARD = "        sends.append(dist.isend(y.detach(), dst=stage.rank + 1))\n"
ISEND_BACKWARD = "            sends.append(dist.isend(x.grad, dst=stage.rank - 1))\n"

WRONG = {  # exercise: [(what the student wrote, {solution text: wrong text}, the hint the check must give)]
    "hand_offs": [
        ("send_forward to the previous stage",
         {SEND_FORWARD: SEND_FORWARD.replace("+ 1", "- 1")},
         r"send_forward on stage 0 of 2: dist.send with rank -1 \(no such rank\); it should send to rank 1, the "
         r"next stage"),
        ("recv_backward from the previous stage",
         {RECV_BACKWARD: RECV_BACKWARD.replace("+ 1", "- 1")},
         r"recv_backward on stage 0 of 2: dist.recv with rank -1 \(no such rank\); it should receive from rank "
         r"1, the next stage"),
        ("recv_backward returns a new buffer, not the one it received into",
         {RECV_BACKWARD: RECV_BACKWARD.replace("    return grad\n", "    return torch.zeros(shape, dtype=dtype)\n")},
         r"recv_backward on stage 0 of 2: gave a tensor that is not what the next stage sent \(return the buffer "
         r"that dist.recv filled\)"),
        ("send_backward forgotten",
         {"    dist.send(grad, dst=dist.get_rank() - 1)\n": "    pass\n"},
         r"send_backward on stage 1 of 2: 0 send\(s\); expected 1"),
        ("send_forward sends twice",
         {SEND_FORWARD: SEND_FORWARD * 2},
         r"send_forward on stage 0 of 2: a second dist.send; each hand-off is one message"),
        ("recv_forward ignores the dtype",
         {"    x = torch.empty(shape, dtype=dtype)\n": "    x = torch.empty(shape)\n"},
         r"recv_forward on stage 1 of 2: receives into a torch.float32 buffer of shape \(2, 8\); the message is "
         r"torch.float64 of shape \(2, 8\) \(use the shape and dtype arguments\)"),
    ],
    "forward_backward": [
        ("the loss not divided by the number of micro-batches",
         {FORWARD_LOSS: "        return x, loss_fn(y)\n"},
         r"forward_step on stage 1 of 2 \(layers \[3, 4\]\): returned the micro-batch's loss undivided; divide it "
         r"by num_micro_batches"),
        ("the received input not made a leaf that requires grad",
         {"\n        x = recv_forward(micro_batch.shape, micro_batch.dtype).requires_grad_()\n":
          "\n        x = recv_forward(micro_batch.shape, micro_batch.dtype)\n"},
         r"forward_step on stage 1 of 2 .*: the input it returns must be the received tensor made a leaf that "
         r"requires grad"),
        ("an extra send of the output",
         {"    send_forward(y)\n    return x, y\n": "    send_forward(y)\n    send_forward(y)\n    return x, y\n"},
         r"forward_step on stage 0 of 2 .*: a second dist.send; each hand-off is one message"),
        ("loss.backward on a non-last stage: the received gradient not used",
         {BACKWARD_RECV: "        y.sum().backward()\n"},
         r"backward_step on stage 0 of 2 \(layers \[0, 1, 2\]\): received no gradient from stage 1: on every "
         r"stage but the last, y.backward needs the gradient of y that the next stage sends"),
        ("the received gradient ignored, a gradient of ones back-propagated",
         {BACKWARD_RECV: "        recv_backward(y.shape, y.dtype)\n        y.backward(torch.ones_like(y))\n"},
         r"backward_step on stage 0 of 2 .*: the gradient of layers.0.linear.weight differs .*: back-propagate "
         r"the gradient of y that came from the next stage"),
        ("the input sent back instead of its gradient",
         {"        send_backward(x.grad)\n": "        send_backward(x.detach())\n"},
         r"backward_step on stage 1 of 2 .*, what it sent: gave a tensor that is not the gradient of its input"),
    ],
    "naive": [
        ("a loss returned on every stage",
         {"    return y.detach() if stage.is_last else None\n    ### END SOLUTION":
          "    return y.detach()\n    ### END SOLUTION"},
         r"naive_step on stage 0 of 2 .*: returned a loss; only the last stage has one"),
        ("no loss returned on the last stage",
         {"    return y.detach() if stage.is_last else None\n    ### END SOLUTION": "    ### END SOLUTION"},
         r"naive_step on stage 1 of 2 .*: the loss returned at step 0 is None"),
        ("the backward forgotten",
         {"    backward_step(stage, x, y)\n    return y.detach()": "    return y.detach()"},
         # no stage runs its backward: stage 0 receives no gradient and stage 1 sends none, both in step 0;
         # whichever stage's check fails first is the one reported
         r"naive_step on stage (0 of 2 .*: 0 receive\(s\) in one step; expected 1: 1 gradient\(s\) from the next"
         r"|1 of 2 .*: sent 0 message\(s\), 0 bytes, in one step; expected 1 gradient\(s\) to the previous)"),
        ("the loss divided by the number of rows, as if each row were a micro-batch",
         {"    x, y = forward_step(stage, batch, 1)\n": "    x, y = forward_step(stage, batch, len(batch))\n"},
         r"naive_step on stage 0 of 2 .*: after step 0's backward, the gradient of layers.0.linear.weight differs"),
    ],
    "gpipe": [
        ("each micro-batch's loss not divided by m",
         {GPIPE_FORWARDS: GPIPE_FORWARDS.replace("forward_step(stage, micro_batch, num_micro_batches)",
                                                 "forward_step(stage, micro_batch, 1)")},
         r"gpipe_step on stage 0 of 2 .*, 2 micro-batches: the gradient of layers.0.linear.weight is 2 times the "
         r"full batch's"),
        ("only the last micro-batch's loss returned",
         {"    return sum(y.detach() for _, y in alive) if stage.is_last else None\n":
          "    return alive[-1][1].detach() if stage.is_last else None\n"},
         r"gpipe_step on stage 1 of 2 .*, 2 micro-batches: the loss returned at step 0"),
        ("forward and backward of each micro-batch in turn, not all forwards first",
         {GPIPE_FORWARDS: "    alive = []\n    for micro_batch in batch.chunk(num_micro_batches):\n"
                          "        alive.append(forward_step(stage, micro_batch, num_micro_batches))\n"
                          "        backward_step(stage, *alive[-1])\n"},
         r"gpipe_step on stage 0 of 2 .*, 2 micro-batches: held the activations of 1 micro-batch\(es\) at once; "
         r"expected 2 \(all the forwards, then all the backwards\)"),
    ],
    "1f1b": [
        ("blocking dist.send, the receives still posted early",
         {ISEND_FORWARD: "        dist.send(y.detach(), dst=stage.rank + 1)\n",
          ISEND_BACKWARD: "            dist.send(x.grad, dst=stage.rank - 1)\n"},
         r"one_f_one_b_step on stage \d of 2 .*: sent with dist.send, which returns only once the neighbour has "
         r"taken the message: 1F1B needs dist.isend"),
        ("isend waited for at once",
         {ISEND_FORWARD: "        dist.isend(y.detach(), dst=stage.rank + 1).wait()\n"},
         r"one_f_one_b_step on stage 0 of 2 .*: an isend was waited for before the stage's next forward or "
         r"backward started: that is a blocking send again"),
        ("the isends never waited for",
         {"    for handle in sends:\n        handle.wait()\n": ""},
         r"one_f_one_b_step on stage \d of 2 .*: an isend's handle was never waited for"),
        ("1F1B run in GPipe order: every forward, then every backward",
         {"    for i in range(num_warmup):\n        forward(micro_batches[i])\n"
          "    for i in range(num_warmup, num_micro_batches):\n        forward(micro_batches[i])\n        backward()\n"
          "    for _ in range(num_warmup):\n        backward()\n":
          "    for micro_batch in micro_batches:\n        forward(micro_batch)\n    for _ in micro_batches:\n"
          "        backward()\n"},
         r"one_f_one_b_step on stage 1 of 2 .*, 2 micro-batches: held the activations of 2 micro-batch\(es\) at "
         r"once; expected 1 \(0 warm-up forward"),
        ("the gradient received into one buffer, the backward given another",
         {"        alive.append((x, y, grad, dist.irecv(grad, src=stage.rank + 1)))\n":
          "        alive.append((x, y, torch.zeros_like(y), dist.irecv(grad, src=stage.rank + 1)))\n"},
         r"one_f_one_b_step on stage 0 of 2 .*: after step 0's backward, the gradient of layers.0.linear.weight "
         r"differs from the single-process MLP's by .*: back-propagate each micro-batch's output with the gradient "
         r"received from the next stage"),
        ("each micro-batch's loss not divided by m",
         {"            alive.append((x, loss_fn(y) / num_micro_batches, None, None))\n":
          "            alive.append((x, loss_fn(y), None, None))\n"},
         r"one_f_one_b_step on stage 0 of 2 .*, 2 micro-batches: the gradient of layers.0.linear.weight is 2 times "
         r"the full batch's: .* divide each micro-batch's loss by num_micro_batches"),
    ],
}
CATALOGUE = [(exercise, *entry) for exercise, entries in WRONG.items() for entry in entries]


@pytest.mark.parametrize("exercise, mistake, edit, hint", CATALOGUE, ids=[f"{e[0]}: {e[1]}" for e in CATALOGUE])
def test_a_wrong_answer_fails_at_its_own_check_naming_the_mistake(exercise, mistake, edit, hint):
    with pytest.raises(AssertionError, match=hint):
        check(exercise, solution(NOTEBOOK, replace=edit))


def test_every_exercise_has_at_least_three_wrong_answers():
    assert all(len(entries) >= 3 for entries in WRONG.values())


@pytest.mark.parametrize("exercise, edit", [
    ("naive", {SEND_FORWARD: "    pass\n"}),  # the next stage waits for an activation forever
    ("1f1b", {ISEND_FORWARD: ""}),  # the next stage waits for an activation forever
])
def test_a_missing_message_in_a_schedule_ends_in_the_timeout_naming_the_stuck_stage(exercise, edit):
    with pytest.raises(TimeoutError, match=f"did not finish within {HANG:g} s"):
        check(exercise, solution(NOTEBOOK, replace=edit), timeout=HANG)


def test_a_wrong_stage_split_fails(monkeypatch):
    def last_stages_take_more(num_layers, world_size):
        sizes = [num_layers // world_size + (s >= world_size - num_layers % world_size) for s in range(world_size)]
        starts = [sum(sizes[:s]) for s in range(world_size)]
        return [range(a, a + n) for a, n in zip(starts, sizes)]

    monkeypatch.setattr(pp, "stage_layers", last_stages_take_more)
    with pytest.raises(AssertionError, match=r"holds 2 layer\(s\); expected 3: 5 // 2 each, and one more on the"):
        check("naive", solution(NOTEBOOK))


# ---------------------------------------------------------------- notebook 11: schedules past 1F1B

SCHEDULES_NOTEBOOK = "11_pipeline_schedules"
NUM_VIRTUAL = 2


@pytest.fixture(scope="module")
def schedules_right():
    return solution(SCHEDULES_NOTEBOOK)


THREE_RANKS = dict(world_size=3, num_layers=6, batch_size=6, num_micro_batches=3)  # where directions show


def check_12(exercise, sol, world_size=2, timeout=20, num_layers=NUM_LAYERS, batch_size=BATCH_SIZE,
             num_micro_batches=NUM_MICRO_BATCHES):
    sizes = (HIDDEN_DIM, num_layers, batch_size)
    if exercise == "split":
        check_backward_split(sol.backward_input, sol.backward_weight, *sizes, num_micro_batches)
    elif exercise == "interleaved":
        check_interleaved_step(sol.interleaved_step, world_size, *sizes, 1, num_micro_batches, NUM_VIRTUAL,
                               timeout=timeout)
    else:
        check_zb_h1_step(sol.zb_h1_step, world_size, *sizes, 1, num_micro_batches, timeout=timeout)


def test_notebook_12_solution_passes_every_check(schedules_right, capsys):
    for exercise in ("split", "interleaved", "zb-h1"):
        check_12(exercise, schedules_right)
    out = capsys.readouterr().out
    for verdict in ("backward_weight (W): correct", "interleaved_step: correct", "2 m (p v - 1)",
                    "zb_h1_step: correct"):
        assert verdict in out


def test_the_split_passes_where_a_sums_bits_depend_on_the_thread_count(schedules_right):
    """B and W run in apart's rank, on one thread; the caller compares with references computed on one thread too:
    at a batch of 1024, 32 wide, a weight's gradient summed on two threads differs from one thread's by ~1e-13."""
    check_backward_split(schedules_right.backward_input, schedules_right.backward_weight, 32, 3, 1024, 2)


@pytest.mark.slow
def test_notebook_12_solution_passes_on_more_ranks(schedules_right):
    check_12("interleaved", schedules_right, 4, num_layers=8, num_micro_batches=4)
    check_12("zb-h1", schedules_right, 3)


def test_the_tables_and_their_exact_bubbles():
    assert pp.zb_h1_order(1, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 0), ("W", 1)]
    assert pp.interleaved_order(0, 2, 1, 3) == [(k, 0, i) for k, i in pp.one_f_one_b_order(0, 2, 3)]
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 3)]:
        tables = {"GPipe": (pp.chunked(pp.gpipe_order), 1), "1F1B": (pp.chunked(pp.one_f_one_b_order), 1),
                  "interleaved": (pp.interleaved_order, v), "ZB-H1": (pp.chunked(pp.zb_h1_order), 1)}
        for name, (order, vv) in tables.items():
            busy, length = pp.idle_slots([order(r, p, vv, m) for r in range(p)], vv)
            assert 1 - sum(busy) / (p * length) == pytest.approx(pp.formula_idle_share(name, p, m, vv))


def test_bad_virtual_sizes_name_the_values():
    with pytest.raises(ValueError, match="num_virtual must be at least 1, got 0"):
        pp.check_virtual_sizes(8, 4, 0, 8, 4)
    with pytest.raises(ValueError, match="num layers 6 do not split into world size 4 x num virtual 2 = 8 pieces"):
        pp.check_virtual_sizes(6, 4, 2, 8, 4)
    with pytest.raises(ValueError, match="num micro batches 2 is not a multiple of world size 4"):
        pp.check_virtual_sizes(8, 4, 2, 8, 2)
    with pytest.raises(ValueError, match="num micro batches 3 is not a multiple of world size 2"):
        check_interleaved_step(None, 2, HIDDEN_DIM, NUM_LAYERS, BATCH_SIZE, 1, 3, NUM_VIRTUAL)


def test_recording_names_b_and_w():
    stage = pp.build_stage(1, 3, HIDDEN_DIM, 3)
    x = torch.ones(2, HIDDEN_DIM, dtype=torch.float64, requires_grad=True)
    with pp.record_step(stage, split=True) as record:
        y = stage(x)
        torch.autograd.grad(y, x, torch.ones_like(y), retain_graph=True)
        torch.autograd.backward(y, torch.ones_like(y), inputs=list(stage.parameters()))
    assert [e.kind for e in record.events] == ["F", "B", "W"]


B_SPLIT = "    (dx,) = torch.autograd.grad(y, x, grad, retain_graph=True)\n    return dx\n"
W_SPLIT = "    torch.autograd.backward(y, grad, inputs=list(stage.parameters()))\n"
I_SEND_FORWARD = "                sends.append(dist.isend(y.detach(), dst=(rank + 1) % p))\n"
I_SEND_GRAD = "            sends.append(dist.isend(x.grad, dst=(rank - 1) % p))\n"
I_LOOP = "    for kind, chunk, i in order(rank, p, len(pieces), num_micro_batches):\n"
Z_LOOP = "    for kind, i in pp.zb_h1_order(stage.rank, stage.world_size, num_micro_batches):\n"
Z_B = "            dx = backward_input(x, y, grad)\n"
Z_W = "            _, y, grad = alive.pop(i)\n            backward_weight(stage, y, grad)\n"
I_RECV_GRAD = "            grad = torch.empty_like(y)\n            dist.recv(grad, src=(rank + 1) % p)\n"
I_RECV_INPUT = "                x = torch.empty_like(micro_batches[i])\n                dist.recv(x, src=(rank - 1) % p)\n"
Z_SEND_B = "            if not stage.is_first:\n                sends.append(dist.isend(dx, dst=stage.rank - 1))\n"
Z_RECV_GRAD = "                grad = torch.empty_like(y)\n                dist.recv(grad, src=stage.rank + 1)\n"

WRONG_12 = {
    "split": [
        ("B runs the full backward: the weights' .grad accumulated in B",
         {B_SPLIT: "    y.backward(grad, retain_graph=True)\n    return x.grad\n"},
         r"backward_input on the middle piece .*: B left layers.2.linear.weight.grad set: B alone must leave the "
         r"weights' .grad untouched"),
        ("retain_graph missing: W fails",
         {B_SPLIT: B_SPLIT.replace(", retain_graph=True", "")},
         r"backward_weight on the middle piece .*: W failed: the graph was freed by B. B must keep it for W "
         r"\(retain_graph=True\)"),
        ("W overwrites .grad instead of accumulating",
         {W_SPLIT: "    for p, g in zip(stage.parameters(), torch.autograd.grad(y, list(stage.parameters()), grad)):\n"
                   "        p.grad = g\n"},
         r"after W of 4 micro-batches, layers.0.linear.weight.grad holds only the last one's: W overwrote .grad"),
        ("W returns the gradients without storing them",
         {W_SPLIT: "    return torch.autograd.grad(y, list(stage.parameters()), grad)\n"},
         r"after W, layers.0.linear.weight.grad is None: W must accumulate the weights' gradients into .grad"),
        ("W without inputs=: the input's gradient computed again",
         {W_SPLIT: "    torch.autograd.backward(y, grad)\n"},
         r"the backward calls, as autograd saw them, were B W; expected B W|were B B; expected B W: W must compute "
         r"only the weights' gradients"),
        ("W back-propagates y.sum(), not the gradient it was given",
         {W_SPLIT: "    torch.autograd.backward(y.sum(), inputs=list(stage.parameters()))\n"},
         r"backward_weight|B then W on the first piece .*: after W, layers.0.linear.weight.grad is what a gradient of ones "
         r"gives \(y.sum\(\)'s backward\)"),
        ("B returns the gradient it was given",
         {B_SPLIT: "    return grad\n"},
         r"backward_input on the middle piece .*: returned the gradient it was given, not the input's"),
        ("B without the gradient of y: autograd's 'only for scalar outputs'",
         {B_SPLIT: B_SPLIT.replace("(y, x, grad,", "(y, x,")},
         r"backward_input on the middle piece .*: raised RuntimeError: grad can be implicitly created only for "
         r"scalar outputs: autograd was not given grad"),
        ("W without the gradient of y",
         {W_SPLIT: W_SPLIT.replace("(y, grad,", "(y,")},
         r"backward_weight on the first piece .*: raised RuntimeError: .*autograd was not given grad"),
        ("B asks for the data's gradient on the first piece",
         {"    if not x.requires_grad:\n        return None\n": ""},
         r"backward_input on the first piece .*: raised RuntimeError: .*on the first piece x is the data"),
        ("B returns torch.autograd.grad's tuple",
         {B_SPLIT: B_SPLIT.replace("(dx,) =", "dx =")},
         r"backward_input on the middle piece .*: returned a tuple: torch.autograd.grad returns one gradient per "
         r"input, unpack it"),
    ],
    "interleaved": [
        ("the hand-off after the last rank not wrapped to rank 0",
         {I_SEND_FORWARD: I_SEND_FORWARD.replace("(rank + 1) % p", "rank + 1")},
         r"interleaved_step on rank 1 of 2.*: dist.isend with rank 2, which does not exist: the piece after the last "
         r"rank's is on rank 0"),
        ("each micro-batch's loss not divided by m",
         {"                y = loss_fn(y) / num_micro_batches\n            else:\n" + I_SEND_FORWARD:
          "                y = loss_fn(y)\n            else:\n" + I_SEND_FORWARD},
         r"the gradient of layers.\d.linear.weight is 2 times the full batch's"),
        ("each forward's tensors kept by micro-batch only, not (chunk, micro-batch)",
         {"            alive[chunk, i] = (x, y)\n": "            alive[i] = (x, y)\n",
          "        x, y = alive.pop((chunk, i))\n": "        x, y = alive.pop(i)\n"},
         r"interleaved_step on rank \d of 2, 2 pieces each, 2 micro-batches: interleaved_step raised KeyError: 0: a "
         r"forward's tensors were not found at their backward .*by \(chunk, micro-batch\)"),
        ("the received input not made to require grad: x.grad is None",
         {"                dist.recv(x, src=(rank - 1) % p)\n                x.requires_grad_()\n":
          "                dist.recv(x, src=(rank - 1) % p)\n"},
         r"interleaved_step on rank \d of 2.*: interleaved_step raised .*(NoneType|None).*x.requires_grad_\(\)"),
        ("the loss overwritten at each micro-batch, not added up",
         {"            loss = loss + y.detach()\n        else:\n            grad = torch.empty_like(y)\n"
          "            dist.recv(grad, src=(rank + 1) % p)":
          "            loss = y.detach()\n        else:\n            grad = torch.empty_like(y)\n"
          "            dist.recv(grad, src=(rank + 1) % p)"},
         r"the loss returned at step 0 is .*that is the last micro-batch's loss alone: the loss was overwritten"),
        ("the returned loss divided by m again",
         {"    return loss if pieces[-1].is_last else None": "    return loss / num_micro_batches if pieces[-1].is_last else None"},
         r"the loss returned at step 0 is .*: 1/2 of it: the sum was divided again"),
        ("the loss added up in float32 (students' list: the message printed two numbers that look equal)",
         {"            loss = loss + y.detach()\n        else:\n            grad = torch.empty_like(y)\n"
          "            dist.recv(grad, src=(rank + 1) % p)":
          "            loss = loss + y.detach().float()\n        else:\n            grad = torch.empty_like(y)\n"
          "            dist.recv(grad, src=(rank + 1) % p)"},
         r"the loss returned at step 0 is .*, \S+ apart \(tolerance 1e-12\): a float32 rounding error"),
        ("each micro-batch's loss divided by the number of pieces p v, not by m",
         {"                y = loss_fn(y) / num_micro_batches\n            else:\n" + I_SEND_FORWARD:
          "                y = loss_fn(y) / (p * len(pieces))\n            else:\n" + I_SEND_FORWARD},
         r"every weight's gradient is 0.5 times the full batch's: each micro-batch's loss was .*divided by the "
         r"pieces p v = 4, not by m = 2"),
        ("the activations received from the next rank (right on 2 ranks only)",
         {"                dist.recv(x, src=(rank - 1) % p)\n": "                dist.recv(x, src=(rank + 1) % p)\n"},
         r"interleaved_step on rank \d of 3, 2 pieces each, 3 micro-batches: dist.recv with rank \d for F0.\d's "
         r"input, from the previous piece's rank: that is the previous rank, \(rank - 1\) % p = \d, expected; a "
         r"direction that is right on 2 ranks only", THREE_RANKS),
        ("the model's last piece taken to be each rank's last chunk: a send skipped",
         {"            if piece.is_last:\n                y = loss_fn(y) / num_micro_batches\n":
          "            if chunk == len(pieces) - 1:\n                y = loss_fn(y) / num_micro_batches\n"},
         r"interleaved_step on rank 0 of 2, 2 pieces each, 2 micro-batches: a blocking dist.recv from rank 1 where the "
         r"table's next hand-off on this rank is a send: F0.1's output, to the next piece's rank. Was that send "
         r"skipped\?"),
        ("the input's gradient not sent back: a send skipped in the backward",
         {"        if not piece.is_first:\n" + I_SEND_GRAD: ""},
         r"interleaved_step on rank 1 of 2, 2 pieces each, 2 micro-batches: a blocking dist.recv from rank 0 where "
         r"the table's next hand-off on this rank is a send: B0.1's input gradient, to the previous piece's rank. Was "
         r"that send skipped\?"),
        ("the input's gradient sent back for micro-batches after the first only, on 3 ranks",
         {"        if not piece.is_first:\n" + I_SEND_GRAD: "        if not piece.is_first and i > 0:\n" + I_SEND_GRAD},
         r"interleaved_step on rank 2 of 3, 2 pieces each, 3 micro-batches: a blocking dist.recv from rank 1 where "
         r"the table's next hand-off on this rank is a send: B0.1's input gradient.* Was that send skipped\?",
         THREE_RANKS),
        ("the output's gradient not received: a buffer of ones back-propagated",
         {I_RECV_GRAD: "            grad = torch.ones_like(y)\n"},
         # both ranks' first backward sends before its receive: whichever rank reports first is right
         r"interleaved_step on rank \d of 2.*: dist.isend of (B0.1's|B0.0's) input gradient, to the previous piece's "
         r"rank before its receive, \1 output gradient, from the next piece's rank: was that receive skipped\?"),
        ("the input not received: a buffer never filled",
         {I_RECV_INPUT: "                x = torch.empty_like(micro_batches[i])\n"},
         r"interleaved_step on rank \d of 2.*: dist.isend of F0.\d's output.* before its receive, F0.\d's input, from "
         r"the previous piece's rank: was that receive skipped\?"),
        ("the table not followed: all forwards, then all backwards",
         {I_LOOP: I_LOOP.replace("order(rank, p, len(pieces), num_micro_batches)",
                                 'sorted(order(rank, p, len(pieces), num_micro_batches), key=lambda a: a[0] == "B")')},
         r"interleaved_step on rank \d of 2, 2 pieces each, \d micro-batches: the computations ran in another order "
         r"than the table \(pp.interleaved_order\)"),
    ],
    "zb-h1": [
        ("W right after B, not deferred",
         {Z_B: Z_B + "            backward_weight(stage, y, grad)\n", Z_W: "            alive.pop(i)\n"},
         r"zb_h1_step on rank 1 of 2, 2 micro-batches: the computations ran in another order than the table "
         r"\(pp.zb_h1_order\) from position 2: ran \('W', 0, 0\), the table says \('F', 0, 1\): a W ran early"),
        ("every W deferred to the end of the step",
         {Z_LOOP: Z_LOOP.replace("pp.zb_h1_order(stage.rank, stage.world_size, num_micro_batches)",
                                 'sorted(pp.zb_h1_order(stage.rank, stage.world_size, num_micro_batches), '
                                 'key=lambda a: a[0] == "W")')},
         r"zb_h1_step on rank \d of 2, 4 micro-batches: .*the W that the table puts here did not run"),
        ("B runs the full backward, then W adds the weights' gradients again",
         {Z_B: "            y.backward(grad, retain_graph=True)\n"
               "            dx = None if stage.is_first else x.grad\n"},
         r"zb_h1_step on rank 0 of 2, 1 micro-batch: .*W of micro-batch 0 ran twice, so its weights' gradients were "
         r"accumulated twice"),
        ("W with the gradient of the last B's micro-batch, not its own (shows from 3 stages on)",
         {Z_W: Z_W.replace("_, y, grad = alive.pop(i)", "_, y, _ = alive.pop(i)")},
         r"zb_h1_step on rank 1 of 3, \d micro-batches: after step 0's backward, the gradient of "
         r"layers.2.linear.weight "
         r"differs .*: back-propagate each micro-batch's output with the gradient received from the next stage for it",
         3),
        ("the output's gradient received from the previous stage",
         {"                dist.recv(grad, src=stage.rank + 1)\n": "                dist.recv(grad, src=stage.rank - 1)\n"},
         r"zb_h1_step on rank 0 of 2.*: dist.recv with rank -1, which does not exist: the first stage receives "
         r"nothing forward and sends nothing back"),
        ("the first stage sends B's result back too",
         {"            if not stage.is_first:\n                sends.append(dist.isend(dx, dst=stage.rank - 1))\n":
          "            sends.append(dist.isend(dx, dst=stage.rank - 1))\n"},
         r"zb_h1_step on rank 0 of 2.*: dist.isend with rank -1, which does not exist"),
        ("B's result not sent back: a send skipped",
         {Z_SEND_B: ""},
         r"zb_h1_step on rank 1 of 2, 1 micro-batch: sent 0 message\(s\) in one step; expected 1.*the calls stopped "
         r"short of the table's send B0's input gradient, to the previous piece's rank \(rank 0\): was it skipped\?"),
        ("B's result not sent back on 3 ranks",
         {Z_SEND_B: ""},
         r"zb_h1_step on rank 2 of 3, 1 micro-batch: sent 0 message\(s\).*the table's send B0's input gradient", 3),
        ("the received input not made to require grad: B returns None",
         {"                dist.recv(x, src=stage.rank - 1)\n                x.requires_grad_()\n":
          "                dist.recv(x, src=stage.rank - 1)\n"},
         r"zb_h1_step on rank 1 of 2.*: zb_h1_step raised .*x.requires_grad_\(\)"),
    ],
}


SLOW_12 = ("the input's gradient sent back for micro-batches after the first only, on 3 ranks",
           "B's result not sent back on 3 ranks",  # their 2-rank twins show the same hint in the default run
           "the input not received: a buffer never filled",  # as the output's gradient not received
           "the returned loss divided by m again")  # 1.4 s: a loss check the float32 and overwrite entries run


@pytest.mark.parametrize("exercise, what, edit, hint, world_size", [
    pytest.param(*(e, *w, 2)[:5], marks=[pytest.mark.slow] * (w[0] in SLOW_12)) for e, ws in WRONG_12.items()
    for w in ws], ids=[f"{e}: {w[0]}" for e, ws in WRONG_12.items() for w in ws])
def test_notebook_12_each_wrong_answer_fails_with_its_hint(exercise, what, edit, hint, world_size):
    sizes = world_size if isinstance(world_size, dict) else {"world_size": world_size}
    with pytest.raises(AssertionError, match=hint):
        check_12(exercise, solution(SCHEDULES_NOTEBOOK, replace=edit), timeout=HANG * 3, **sizes)


@pytest.mark.slow  # 2.5 s: the check's timeout
def test_notebook_12_a_receive_skipped_where_no_send_follows_is_named_from_the_journals():
    """The first stage's B sends nothing back, so its skipped receive shows only when the ranks stall: the journals
    of their sends and receives name it, not a bare timeout."""
    skipped = solution(SCHEDULES_NOTEBOOK, replace={Z_RECV_GRAD: "                grad = torch.ones_like(y)\n"})
    with pytest.raises(AssertionError, match=r"zb_h1_step on 2 ranks: ranks waited for a message in vain, and their "
                                             r"sends and receives do not pair up: rank 0 never received B0's output "
                                             r"gradient \(m = 1, step 0\), which rank 1 sent \(a receive skipped\?\)"):
        check_12("zb-h1", skipped, timeout=HANG)


@pytest.mark.slow  # 3.4 s: the check's timeout
def test_notebook_12_a_blocking_send_waits_for_ever_and_the_check_says_why():
    blocking_send = "            dist.send(x.grad, dst=(rank - 1) % p)\n"
    blocking = solution(SCHEDULES_NOTEBOOK, replace={I_SEND_GRAD: blocking_send})
    with pytest.raises(TimeoutError, match="interleaved_step on 2 ranks: a rank waited for ever. A blocking dist.send"):
        check_12("interleaved", blocking, timeout=HANG)


def test_notebook_12_right_answers_written_another_way():
    other = solution(SCHEDULES_NOTEBOOK, replace={
        B_SPLIT: "    y.backward(grad, inputs=[x], retain_graph=True)\n    return x.grad\n",
        W_SPLIT: "    for p, g in zip(stage.parameters(), torch.autograd.grad(y, list(stage.parameters()), grad)):\n"
                 "        p.grad = g if p.grad is None else p.grad + g\n"})
    check_12("split", other)
    # the receives as irecv(...).wait(), the loss added up as a Python float, W's arguments unpacked from the dict
    other = solution(SCHEDULES_NOTEBOOK, replace={
        "                dist.recv(x, src=(rank - 1) % p)\n": "                dist.irecv(x, src=(rank - 1) % p).wait()\n",
        "            loss = loss + y.detach()\n        else:\n            grad = torch.empty_like(y)\n"
        "            dist.recv(grad, src=(rank + 1) % p)":
        "            loss += y.item()\n        else:\n            grad = torch.empty_like(y)\n"
        "            dist.irecv(grad, src=(rank + 1) % p).wait()",
        Z_W: "            backward_weight(stage, *alive.pop(i)[1:])\n",
        "                loss = loss + y.detach()\n            else:\n": "                loss += y.item()\n            else:\n"})
    check_12("interleaved", other)
    check_12("zb-h1", other)
