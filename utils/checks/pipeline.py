"""Checks for notebook 04 (pipeline parallel): the hand-offs, one micro-batch's forward and backward,
the naive schedule, GPipe and 1F1B.

- `check_hand_offs`: each of the four hand-offs alone, on every stage: whom it sends to or receives
  from, how many messages, what it sends, what it returns.
- `check_forward_backward`: one micro-batch's `forward_step` and `backward_step` on every stage,
  against the single-process MLP's activations and gradients (the micro-batch being one of 3, so
  that the loss's division shows): the input, the output, what goes over the wire, the gradients.
- `check_naive_step`, `check_gpipe_step`, `check_one_f_one_b_step`: train the course's MLP with the
  student's schedule on WORLD_SIZE stages and on another stage count (one of them split unevenly),
  for several micro-batch counts, with SGD and AdamW, and compare with the single-process run
  (float64, to TOLERANCE) and with PyTorch's own pipelining on the same stages. They also count what
  each stage sends and receives, how many micro-batches' activations it held at once, and, for 1F1B,
  that every send was an `isend` still in flight while the stage went on computing.

Notebook 11 (schedules past 1F1B):

- `check_backward_split`: B (the input's gradient) and W (the weights'), in this process, on the
  first, a middle and the last piece: B then W equal one full backward bit for bit, B alone leaves
  `.grad` untouched, W deferred over several micro-batches still equals the full backwards.
- `check_interleaved_step`, `check_zb_h1_step`: train with the student's schedule on WORLD_SIZE ranks
  and on 2, and compare with the single-process run; each rank's recorded order of computations
  against the schedule's table (`pp.interleaved_order`, `pp.zb_h1_order`), its messages against the
  count, every send an isend in flight, and (ZB-H1) the micro-batches alive at once. Each send and
  receive is compared, before it runs, with the table's next hand-off (a peer right on 2 ranks only,
  a skipped send, a skipped receive); when the ranks stall anyway, the journals of their sends and
  receives (notebook 12's: nd.journal_message, nd.unpaired_messages) name the messages that never
  paired up, by the table; gradients that are all one multiple of one process's name the count the
  loss was divided by; an error raised inside the student's function is said with its cause.

The order, shown by the values (`check_gpipe_step`, `check_one_f_one_b_step`, `check_interleaved_step`,
`check_zb_h1_step`): after every check of the records, one more step per micro-batch count runs with every layer
chained to a running state of its rank (`chain_layers`: each forward and each backward, B and W each, scales its
result by 1 + the state and sets the state from that result), and each rank's gradients are compared with the
table's order played in one process (`chained_reference`). A rank's record can be edited by its own code; these
values cannot be had without computing in the table's order (a rank that replays every rank's share itself, the
model and data being deterministic, is the gap of forged messages: utils.grading's docstring, "The limits").

A mistake found on one rank raises there, so the check names it before a neighbour waiting for a
message that never comes runs into the timeout.
"""
import contextlib
import dataclasses
import functools
import itertools
import os
import tempfile

import torch
import torch.distributed.pipelining  # noqa: F401

from utils import pipeline as pp
from utils import pytorch_reference
from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff, seeded_randn
from utils.intercept import RECEIVES, SENDS, intercept
from utils.launch import RankError, apart, runnable_world_sizes, spawn
from utils.mixed_precision import one_thread
from utils.nd_parallel import journal_message, unpaired_messages
from utils.model import build_mlp, loss_fn, make_batch, parameter_names, reference_gradients, train_reference

# torch.distributed.pipelining is imported above, in the caller: forked ranks inherit it (utils.launch says why).

OPTIMIZERS = ("sgd", "adamw")
PYTORCH_OPTIMIZER = "adamw"  # the runs compared with PyTorch's pipelining as well
AS_ONE_OF = 3  # check_forward_backward: the micro-batch is one of 3, so the loss must be divided by 3
SCHEDULES = {  # kind: (what the student wrote, PyTorch's schedule to compare with)
    "naive": ("naive_step", "gpipe"),
    "gpipe": ("gpipe_step", "gpipe"),
    "1f1b": ("one_f_one_b_step", "1f1b"),
}


def stage_counts(world_size, num_layers):
    """WORLD_SIZE and one other stage count; if WORLD_SIZE splits the layers evenly, the other one does not."""
    candidates = [n for n in (2, 4, 3, 5) if n != world_size and n <= num_layers]
    if num_layers % world_size == 0:  # prefer an uneven split: the rule "the first stages take one more"
        candidates.sort(key=lambda n: num_layers % n == 0)
    pp.stage_layers(num_layers, world_size)  # raises if world_size > num_layers
    return runnable_world_sizes([world_size] + candidates[:1])


def micro_batch_counts(kind, batch_size, num_micro_batches):
    """1, 2, the notebook's count and the whole batch (one row each): those that divide the batch."""
    if kind == "naive":
        return [1]
    return [m for m in sorted({1, 2, num_micro_batches, batch_size}) if batch_size % m == 0]


def _spawn(fn, world_size, *args, timeout, **kwargs):
    """spawn, with a rank's AssertionError (a mistake it found) raised here as an AssertionError."""
    try:
        return spawn(fn, world_size, *args, timeout=timeout, **kwargs)
    except RankError as e:
        if e.summary.startswith("AssertionError: "):
            raise AssertionError(e.summary.removeprefix("AssertionError: ")) from e
        raise


# ---------------------------------------------------------------- messages: to whom, from whom, what

@dataclasses.dataclass
class Message:
    name: str  # send, isend, recv, irecv
    peer: int  # dst or src


def _neighbour(peer, rank, world_size):
    if not 0 <= peer < world_size:
        return "no such rank"
    return {rank + 1: "the next stage", rank - 1: "the previous stage"}.get(peer, "not a neighbour")


@contextlib.contextmanager
def _messages(where, rank, world_size, sends_to=None, receives_from=None, buffer=None, message=None):
    """The point-to-point messages of the block, at most one each way. A send to, or a receive from, the
    wrong rank, a second message, a receive into a buffer unlike `buffer` (a tensor), or a send of
    something else than `message` ((tensor, what it is)) fails before it is made: so this stage, not
    the neighbour that would hang, crash or compute with it, names the mistake."""
    log = []

    def before(call, arguments):
        if call.name in SENDS + RECEIVES:
            sending = call.name in SENDS
            want, verb = (sends_to, "send to") if sending else (receives_from, "receive from")
            peer = arguments.get("dst" if sending else "src")
            if want is None:
                raise AssertionError(f"{where}: called dist.{call.name}; it should not {verb} anyone")
            if peer != want:
                raise AssertionError(f"{where}: dist.{call.name} with rank {peer} "
                                     f"({_neighbour(peer, rank, world_size)}); it should {verb} rank {want}, "
                                     f"{_neighbour(want, rank, world_size)}")
            if any((m.name in SENDS) == sending for m in log):
                raise AssertionError(f"{where}: a second dist.{call.name}; each hand-off is one message")
            tensor = arguments["tensor"]
            if not sending and buffer is not None and (tensor.shape, tensor.dtype) != (buffer.shape, buffer.dtype):
                raise AssertionError(f"{where}: receives into a {tensor.dtype} buffer of shape {tuple(tensor.shape)}; "
                                     f"the message is {buffer.dtype} of shape {tuple(buffer.shape)} (use the shape and "
                                     f"dtype arguments)")
            if sending and message is not None:
                _expect_tensor(f"{where}, what it sent", tensor.detach(), *message)
        log.append(Message(call.name, arguments.get("dst", arguments.get("src"))))

    with intercept(before=before):
        yield log


def _expect_counts(where, log, sends, receives):
    """Exactly `sends` sends and `receives` receives, and nothing else."""
    others = sorted({m.name for m in log if m.name not in SENDS + RECEIVES})
    if others:
        raise AssertionError(f"{where}: called {others}; a pipeline only needs send and recv (or isend and irecv)")
    for names, want, what in ((SENDS, sends, "send"), (RECEIVES, receives, "receive")):
        got = sum(m.name in names for m in log)
        if got != want:
            raise AssertionError(f"{where}: {got} {what}(s); expected {int(want)}")


def _expect_tensor(where, got, want, what):
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}: gave {type(got).__name__}; expected a tensor: {what}")
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{where}: gave a {got.dtype} tensor of shape {tuple(got.shape)}; expected {what}, "
                             f"{want.dtype} of shape {tuple(want.shape)} (the shape and dtype arguments)")
    diff = max_abs_diff(got, want)
    if diff > TOLERANCE:
        raise AssertionError(f"{where}: gave a tensor that is not {what} (they differ by up to {diff:.3g})")


# ---------------------------------------------------------------- the four hand-offs

def _hand_off(where, rank, world_size, call, sends_to=None, receives_from=None, buffer=None, message=None):
    with _messages(where, rank, world_size, sends_to, receives_from, buffer, message) as log:
        result = call()
    _expect_counts(where, log, sends_to is not None, receives_from is not None)
    return result


def _hand_offs_main(rank, world_size, hand_offs, shape, seed):
    send_forward, recv_forward, send_backward, recv_backward = hand_offs
    first, last, where = rank == 0, rank == world_size - 1, f"on stage {rank} of {world_size}"
    activation, gradient = (lambda s: seeded_randn(shape, seed, s)), (lambda s: seeded_randn(shape, seed + 1, s))
    if not last:
        y = activation(rank).requires_grad_() * 1  # an output, with its graph
        _hand_off(f"send_forward {where}", rank, world_size, lambda: send_forward(y), sends_to=rank + 1,
                  message=(activation(rank), "the output's values"))
    if not first:
        x = _hand_off(f"recv_forward {where}", rank, world_size, lambda: recv_forward(shape, torch.float64),
                         receives_from=rank - 1, buffer=activation(rank - 1))
        _expect_tensor(f"recv_forward {where}", x, activation(rank - 1), "what the previous stage sent "
                       "(return the buffer that dist.recv filled)")
    if not first:
        _hand_off(f"send_backward {where}", rank, world_size, lambda: send_backward(gradient(rank)),
                  sends_to=rank - 1, message=(gradient(rank), "the gradient it was given"))
    if not last:
        grad = _hand_off(f"recv_backward {where}", rank, world_size,
                            lambda: recv_backward(shape, torch.float64), receives_from=rank + 1,
                            buffer=gradient(rank + 1))
        _expect_tensor(f"recv_backward {where}", grad, gradient(rank + 1), "what the next stage sent "
                       "(return the buffer that dist.recv filled)")


def check_hand_offs(send_forward, recv_forward, send_backward, recv_backward, world_size, hidden_dim, batch_size,
                    seed=0, timeout=CHECK_TIMEOUT):
    """Each hand-off alone, on `world_size` stages and on 3 (a stage with both neighbours)."""
    worlds = runnable_world_sizes(sorted({max(world_size, 2), 3}))
    shape = (batch_size, hidden_dim)
    for n in worlds:
        _spawn(_hand_offs_main, n, (send_forward, recv_forward, send_backward, recv_backward), shape, seed,
               timeout=timeout)
    print(f"hand-offs: correct on {' and '.join(map(str, worlds))} stages")
    print("  send_forward / recv_forward: one message to / from the next / previous stage, the values intact; "
          "send_backward / recv_backward the other way")


# ---------------------------------------------------------------- one micro-batch's forward and backward

@dataclasses.dataclass
class Reference:
    """The single-process MLP on one micro-batch that is one of `m`."""

    inputs: list  # of each layer, and the last layer's output
    input_grads: list  # the gradient of each of those
    grads: list  # of each weight
    loss: torch.Tensor  # the micro-batch's loss / m


def _reference_step(hidden_dim, num_layers, batch_size, m, seed):
    mlp = build_mlp(hidden_dim, num_layers, seed)
    activations = [make_batch(batch_size, hidden_dim, seed).requires_grad_()]
    for layer in mlp.layers:
        activations.append(layer(activations[-1]))
        activations[-1].retain_grad()
    loss = loss_fn(activations[-1]) / m
    loss.backward()
    return Reference([a.detach() for a in activations], [a.grad for a in activations],
                     [p.grad for p in mlp.parameters()], loss.detach())


def _check_forward(where, stage, x, y, log, reference):
    lo, hi = stage.layer_indices[0], stage.layer_indices[-1] + 1
    _expect_counts(where, log, not stage.is_last, not stage.is_first)
    if not stage.is_first:
        if not (isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad):
            raise AssertionError(f"{where}: the input it returns must be the received tensor made a leaf that "
                                 f"requires grad (requires_grad_()), so that x.grad is what goes back")
        _expect_tensor(where + ", its input", x.detach(), reference.inputs[lo], "the received activation")
    if stage.is_last:
        undivided = AS_ONE_OF * reference.loss.item()
        if isinstance(y, torch.Tensor) and y.shape == () and abs(y.detach().item() - undivided) < TOLERANCE:
            raise AssertionError(f"{where}: returned the micro-batch's loss undivided; divide it by "
                                 f"num_micro_batches ({AS_ONE_OF} here), so that the micro-batches' losses add up "
                                 f"to the batch's")
        _expect_tensor(where + ", its loss", y.detach(), reference.loss, f"the micro-batch's loss / {AS_ONE_OF}")
        return
    if not (isinstance(y, torch.Tensor) and y.grad_fn is not None):
        raise AssertionError(f"{where}: the output it returns must keep its graph (send y.detach(), return y)")
    _expect_tensor(where + ", its output", y.detach(), reference.inputs[hi], "the stage's output")


def _check_backward(where, stage, log, reference):
    if not stage.is_last and not any(m.name in RECEIVES for m in log):
        raise AssertionError(f"{where}: received no gradient from stage {stage.rank + 1}: on every stage but the "
                             f"last, y.backward needs the gradient of y that the next stage sends (recv_backward), "
                             f"not a loss of its own")
    _expect_counts(where, log, not stage.is_first, not stage.is_last)
    names = parameter_names(len(reference.grads))
    for i, p in zip(stage.layer_indices, stage.parameters()):
        want = reference.grads[i]
        if p.grad is None:
            raise AssertionError(f"{where}: {names[i]} got no gradient: back-propagate through the stage")
        diff = max_abs_diff(p.grad, want)
        if diff <= TOLERANCE:
            continue
        if max_abs_diff(p.grad, AS_ONE_OF * want) <= TOLERANCE * AS_ONE_OF:
            raise AssertionError(f"{where}: the gradient of {names[i]} is {AS_ONE_OF} times the reference's: the "
                                 f"loss was not divided by num_micro_batches")
        raise AssertionError(f"{where}: the gradient of {names[i]} differs from the single-process MLP's by "
                             f"{diff:.3g}" + ("" if stage.is_last else ": back-propagate the gradient of y that "
                                              "came from the next stage, y.backward(received gradient)"))


def _forward_backward_main(rank, world_size, forward_step, backward_step, sizes, reference):
    hidden_dim, num_layers, batch_size, seed = sizes
    stage = pp.build_stage(rank, world_size, hidden_dim, num_layers, seed)
    batch = make_batch(batch_size, hidden_dim, seed)
    where = f"on stage {rank} of {world_size} (layers {list(stage.layer_indices)})"
    previous, following = (None if stage.is_first else rank - 1), (None if stage.is_last else rank + 1)
    lo, hi = stage.layer_indices[0], stage.layer_indices[-1] + 1
    output = (reference.inputs[hi], "the stage's output")
    with _messages(f"forward_step {where}", rank, world_size, following, previous, batch, output) as log:
        x, y = forward_step(stage, batch, AS_ONE_OF)
    _check_forward(f"forward_step {where}", stage, x, y, log, reference)
    input_grad = (reference.input_grads[lo], "the gradient of its input (x.grad, after the backward)")
    with _messages(f"backward_step {where}", rank, world_size, previous, following, batch, input_grad) as log:
        backward_step(stage, x, y)
    _check_backward(f"backward_step {where}", stage, log, reference)


def check_forward_backward(forward_step, backward_step, world_size, hidden_dim, num_layers, batch_size, seed=0,
                           timeout=CHECK_TIMEOUT):
    """forward_step then backward_step of one micro-batch (one of 3), on every stage, against the single process."""
    worlds = stage_counts(world_size, num_layers)
    reference = _reference_step(hidden_dim, num_layers, batch_size, AS_ONE_OF, seed)
    for n in worlds:
        _spawn(_forward_backward_main, n, forward_step, backward_step, (hidden_dim, num_layers, batch_size, seed),
               reference, timeout=timeout)
    print(f"forward_step and backward_step: correct on {' and '.join(map(str, worlds))} stages")
    print(f"  each stage's input, output (the loss / {AS_ONE_OF} on the last), what it sends each way and its "
          f"weights' gradients equal the single-process MLP's to {TOLERANCE:g}")


# ---------------------------------------------------------------- schedules: training runs

@dataclasses.dataclass
class Comparison:
    ours: pp.PipelineRun
    pytorch: pp.PytorchRun = None  # with PYTORCH_OPTIMIZER only


def _schedule_main(rank, world_size, schedule, kind, counts, sizes):
    """{(m, optimizer): Comparison} on this stage, and {m: the weights' gradients of one step with its layers
    chained} (GPipe and 1F1B). Each step's messages are checked here, as soon as the step ends: a stage that skipped
    one leaves its neighbour waiting for ever, so it must say so first."""
    runs = {}
    layers = pp.stage_layers(sizes["num_layers"], world_size)[rank]
    for m, optimizer in itertools.product(counts, OPTIMIZERS):
        # PyTorch's Schedule1F1B needs at least as many micro-batches as stages; with fewer, 1F1B is GPipe
        pytorch_name = SCHEDULES[kind][1] if m >= world_size else "gpipe"
        where = Where(SCHEDULES[kind][0], kind, rank, world_size, layers, m, optimizer)
        after_step = functools.partial(_check_step, where, sizes["batch_size"] // m * sizes["hidden_dim"] * 8)
        ours = pp.train_pipeline(rank, world_size, schedule, num_micro_batches=m, optimizer=optimizer,
                                 after_step=after_step, **sizes)
        # PyTorch's run once per m, with the optimizer that has state: the reference run covers both
        theirs = None
        if optimizer == PYTORCH_OPTIMIZER:
            theirs = pytorch_reference.train_pipeline(rank, world_size, pytorch_name, num_micro_batches=m,
                                                      optimizer=optimizer, **sizes)
        runs[m, optimizer] = Comparison(ours, theirs)
    # one micro-batch: every schedule is one forward and one backward
    chained = {m: _chained_gradients(rank, world_size, schedule, m, sizes)
               for m in counts if kind != "naive" and m > 1}
    return runs, chained


@dataclasses.dataclass
class Where:
    """One stage of one run, and what it should have computed."""

    label: str  # the schedule's name, e.g. one_f_one_b_step
    kind: str
    stage: int
    num_stages: int
    layers: range
    m: int
    optimizer: str

    def __str__(self):
        return (f"{self.label} on stage {self.stage} of {self.num_stages} (layers {list(self.layers)}), {self.m} "
                f"micro-batch{'es' * (self.m > 1)}")


def _check_traffic(where, calls, micro_bytes):
    """Forward: m activations to the next stage; backward: m gradients to the previous one."""
    s, p, m = where.stage, where.num_stages, where.m
    expected = m * ((s < p - 1) + (s > 0))
    sends = [call.nbytes for call in calls if call.name in SENDS]
    receives = sum(1 for call in calls if call.name in RECEIVES)
    others = sorted({call.name for call in calls if call.name not in SENDS + RECEIVES})
    if others:
        raise AssertionError(f"{where}: called {others}; a pipeline only needs send and recv (or isend and irecv)")
    forward, backward = (f"{m} activation(s)" if s < p - 1 else ""), (f"{m} gradient(s)" if s > 0 else "")
    if len(sends) != expected or sum(sends) != expected * micro_bytes:
        what = " and ".join(filter(None, [forward and forward + " to the next stage",
                                          backward and backward + " to the previous stage"]))
        raise AssertionError(f"{where}: sent {len(sends)} message(s), {sum(sends)} bytes, in one step; expected "
                             f"{what}: {expected} of {micro_bytes} bytes (a micro-batch's activation) = "
                             f"{expected * micro_bytes} bytes")
    if receives != expected:
        what = " and ".join(filter(None, [backward and f"{m} activation(s) from the previous stage",
                                          forward and f"{m} gradient(s) from the next stage"]))
        raise AssertionError(f"{where}: {receives} receive(s) in one step; expected {expected}: {what}")


def _check_gradients(where, got, want, names):
    m = where.m
    for name, g, w in zip(names, got, want):
        if g is None:
            raise AssertionError(f"{where}: {name} got no gradient: did this stage run its backward?")
        diff = max_abs_diff(g, w)
        if diff <= TOLERANCE:
            continue
        if m > 1 and max_abs_diff(g, m * w) <= TOLERANCE * m:
            raise AssertionError(f"{where}: the gradient of {name} is {m} times the full batch's: each micro-batch's "
                                 f"loss is a mean over its own rows, so summing {m} of them counts the batch {m} "
                                 f"times; divide each micro-batch's loss by num_micro_batches")
        raise AssertionError(f"{where}: after step 0's backward, the gradient of {name} differs from the "
                             f"single-process MLP's by {diff:.3g}" + (
                                 "" if where.stage == where.num_stages - 1 else ": back-propagate each micro-batch's "
                                 "output with the gradient received from the next stage for it (the buffer its "
                                 "receive filled, after the receive completed)"))


def _check_split(where, num_weights, num_layers):
    p, s = where.num_stages, where.stage
    want = num_layers // p + (s < num_layers % p)  # the first L % p stages take one more
    if num_weights != want:
        raise AssertionError(f"{where}: the stage holds {num_weights} layer(s); expected {want}: {num_layers} // "
                             f"{p} each, and one more on the first {num_layers % p} stage(s)")


def _check_losses(where, got, want, last_alone=None):
    """The last stage's loss by step against one process's; `last_alone`: step 0's last micro-batch's loss / m,
    what a loss overwritten instead of added up returns."""
    if where.stage < where.num_stages - 1:
        if any(g is not None for g in got):
            raise AssertionError(f"{where}: returned a loss; only the last stage has one (return None)")
        return
    for step, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, float) and abs(g - w) <= TOLERANCE:
            continue
        hint, text = "", f"a tensor of shape {tuple(g.shape)}" if isinstance(g, torch.Tensor) else repr(g)
        if isinstance(g, float):
            diff = abs(g - w)
            hint = f", {diff:.3g} apart (tolerance {TOLERANCE:g})"
            if diff <= 1e-6 * abs(w):
                hint += (": a float32 rounding error; the loss was computed or added up in float32 (a .float(), or "
                         "a float32 tensor): keep the model's float64")
            elif step == 0 and last_alone is not None and abs(g - last_alone) <= TOLERANCE:
                hint += (": that is the last micro-batch's loss alone: the loss was overwritten at each micro-batch; "
                         "add each micro-batch's (loss = loss + y.detach())")
            elif m := next((k for k in range(2, 65) if abs(g * k - w) <= TOLERANCE * k), None):
                hint += (f": 1/{m} of it: the sum was divided again (by num_micro_batches or a rank count); each "
                         f"micro-batch's loss is already divided by num_micro_batches: return their sum" if m > 1
                         else "")
        raise AssertionError(f"{where}: the loss returned at step {step} is {text}; the full batch's loss is {w!r}"
                             f"{hint} (the sum of the micro-batches' losses, each divided by num_micro_batches)")


def _check_weights(where, names, ours, reference, pytorch):
    for k, (name, got, want) in enumerate(zip(names, ours, reference)):
        diff = max_abs_diff(got, want)
        if diff > TOLERANCE:
            raise AssertionError(f"{where} ({where.optimizer}): at the end, {name} differs from the single-process "
                                 f"run's by {diff:.3g} (step 0's gradients were right: look at what changes from "
                                 f"step to step)")
        if pytorch is None:
            continue
        diff = max_abs_diff(pytorch.weights[k], got)
        if diff > TOLERANCE:
            raise AssertionError(f"{where} ({where.optimizer}): at the end, {name} differs from PyTorch's "
                                 f"{pytorch.schedule} run's by {diff:.3g}")


def _check_alive(where, peak):
    """GPipe holds every micro-batch until the backwards; 1F1B at most p - s on stage s."""
    p, s, m = where.num_stages, where.stage, where.m
    want = {"naive": 1, "gpipe": m, "1f1b": min(p - s, m)}[where.kind]
    if peak != want:
        why = {"naive": "one batch, one forward, one backward",
               "gpipe": "all the forwards, then all the backwards",
               "1f1b": f"{p - s - 1} warm-up forward(s) on stage {s} of {p}, then one forward and one backward in "
                       f"turn: a backward frees the oldest micro-batch"}[where.kind]
        raise AssertionError(f"{where}: held the activations of {peak} micro-batch(es) at once; expected {want} "
                             f"({why})")


def _check_isends(where, record, schedule="1F1B"):
    """Each send is an isend, still in flight when the stage's next computation starts, waited for before
    the step returns."""
    starts = sorted(e.start for e in record.events)
    for call in (c for c in record.calls if c.name in SENDS):
        if call.blocking:
            raise AssertionError(f"{where}: sent with dist.send, which returns only once the neighbour has taken "
                                 f"the message: {schedule} needs dist.isend, its handle kept and waited for at "
                                 f"the end of the step")
        if call.waited_at is None:
            raise AssertionError(f"{where}: an isend's handle was never waited for: wait for every send before the "
                                 f"step returns (its tensor must stay intact until it is sent)")
        following = next((t for t in starts if t > call.started_at), None)
        if following is not None and call.waited_at < following:
            raise AssertionError(f"{where}: an isend was waited for before the stage's next forward or backward "
                                 f"started: that is a blocking send again; keep the handle and wait for it at the "
                                 f"end of the step")


def _check_sends_in_flight(where, record):
    """1F1B: each send is an isend, still in flight when the stage's next computation starts, waited for
    before the step returns; each gradient's irecv is waited for before the backward that uses it."""
    _check_isends(where, record)
    backwards = sorted((e for e in record.events if e.kind == "B"), key=lambda e: e.micro_batch)
    posted = [c for c in record.calls if c.name == "irecv"]
    if any(c.waited_at is None for c in posted):
        raise AssertionError(f"{where}: an irecv's handle was never waited for: wait() on it before using its "
                             f"buffer")
    for call, backward in zip(posted, backwards) if len(posted) == len(backwards) else ():
        if call.waited_at > backward.start:
            raise AssertionError(f"{where}: the backward of micro-batch {backward.micro_batch} started before its "
                                 f"gradient's irecv was waited for: wait() on the handle, then back-propagate")


def _check_step(where, micro_bytes, record):
    """On the rank, after each step: its messages, and for 1F1B when they were waited for."""
    _check_traffic(where, record.calls, micro_bytes)
    if where.kind == "1f1b":
        _check_sends_in_flight(where, record)


def _check_stage(where, run, reference, sizes):
    """Every other property of one stage's run (`reference`: step 0's gradients, final weights, losses)."""
    ours, layers, names = run.ours, where.layers, parameter_names(sizes["num_layers"])
    grads, weights, losses = reference
    _check_split(where, len(ours.weights), sizes["num_layers"])
    _check_gradients(where, ours.grads, [grads[i] for i in layers], [names[i] for i in layers])
    _check_losses(where, ours.losses, losses)
    _check_weights(where, [names[i] for i in layers], ours.weights, [weights[i] for i in layers], run.pytorch)
    _check_alive(where, ours.peak_alive)


def _print_verdict(kind, worlds, counts, num_layers, num_steps, runs):
    label = SCHEDULES[kind][0]
    names = {c.pytorch.schedule for by_key in runs for c in by_key.values() if c.pytorch is not None}
    pytorch = {"naive": "ScheduleGPipe", "gpipe": "ScheduleGPipe",
               "1f1b": "Schedule1F1B" + (" (ScheduleGPipe for m < stages)" if "gpipe" in names else "")}[kind]
    splits = "; ".join(f"{n} stages: " + ", ".join(str(len(r)) for r in pp.stage_layers(num_layers, n)) + " layers"
                       for n in worlds)
    print(f"{label}: correct on {' and '.join(map(str, worlds))} stages ({splits}), micro-batches {counts}")
    print(f"  step 0's gradients, the losses, and the weights after {num_steps} steps of SGD and AdamW equal the "
          f"single-process run's, and with AdamW PyTorch's {pytorch}'s, to {TOLERANCE:g}")
    print("  each stage sends m activations forward and m gradients backward per step, one micro-batch each")
    if kind == "1f1b":
        print("  every send an isend, still in flight when the stage's next forward or backward started")
    if kind != "naive":
        peaks = {m: [by_key[m, "sgd"].ours.peak_alive for by_key in runs] for m in counts}
        print(f"  micro-batches alive at once on each of {worlds[0]} stages (counted): "
              + ", ".join(f"m={m}: {peaks[m]}" for m in counts))


def check_schedule(kind, schedule, world_size, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches=1,
                   seed=0, timeout=CHECK_TIMEOUT):
    """Train with `schedule` on every stage count and micro-batch count; compare everything (see the module doc)."""
    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {list(SCHEDULES)}, got {kind!r}")
    pp.check_sizes(num_layers, world_size, batch_size, num_micro_batches)
    counts, worlds = micro_batch_counts(kind, batch_size, num_micro_batches), stage_counts(world_size, num_layers)
    sizes = dict(hidden_dim=hidden_dim, num_layers=num_layers, batch_size=batch_size, num_steps=num_steps, seed=seed)
    grads = reference_gradients(hidden_dim, num_layers, batch_size, seed)
    references = {o: (grads, *train_reference(hidden_dim, num_layers, batch_size, num_steps, o, seed=seed))
                  for o in OPTIMIZERS}
    first_runs = None
    for n in worlds:
        runs, chained = zip(*_spawn(_schedule_main, n, schedule, kind, counts, sizes, timeout=timeout))
        first_runs = first_runs or runs
        for m, optimizer, (stage, layers) in itertools.product(counts, OPTIMIZERS,
                                                                enumerate(pp.stage_layers(num_layers, n))):
            where = Where(SCHEDULES[kind][0], kind, stage, n, layers, m, optimizer)
            _check_stage(where, runs[stage][m, optimizer], references[optimizer], sizes)
        for m in chained[0]:  # the order, shown by the values: after every check of the records
            order = {"gpipe": pp.gpipe_order, "1f1b": pp.one_f_one_b_order}[kind]
            want = chained_reference([pp.chunked(order)(r, n, 1, m) for r in range(n)], 1, False, sizes, m)
            for stage, layers in enumerate(pp.stage_layers(num_layers, n)):
                where = Where(SCHEDULES[kind][0], kind, stage, n, layers, m, "sgd")
                _check_chained(where, chained[stage][m], want[stage], {"gpipe": "GPipe", "1f1b": "1F1B"}[kind],
                               f"pp.{order.__name__}")
    _print_verdict(kind, worlds, counts, num_layers, num_steps, first_runs)


def check_naive_step(naive_step, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0,
                     timeout=CHECK_TIMEOUT):
    check_schedule("naive", lambda stage, batch, m: naive_step(stage, batch), world_size, hidden_dim, num_layers,
                   batch_size, num_steps, 1, seed, timeout)


def check_gpipe_step(gpipe_step, world_size, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches, seed=0,
                     timeout=CHECK_TIMEOUT):
    check_schedule("gpipe", gpipe_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                   num_micro_batches, seed, timeout)


def check_one_f_one_b_step(one_f_one_b_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                           num_micro_batches, seed=0, timeout=CHECK_TIMEOUT):
    check_schedule("1f1b", one_f_one_b_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                   num_micro_batches, seed, timeout)


# ---------------------------------------------------------------- the order, shown by the values

class _Chain:
    """A rank's running state, read and advanced by every forward and backward of its layers: each scales its
    result by 1 + state, and the state becomes a quarter of that result's sum over its absolute sum. Each value
    then depends on what the rank computed before it, in order (a forward that runs before a backward in one order
    and after it in another gets another scale), and on that computation's values: no count that code can set.
    Smooth in the values, so that an answer whose additions round differently stays within TOLERANCE."""

    def __init__(self):
        self.state = 0.0

    def advance(self, t):
        t = t * (1 + self.state)
        self.state = 0.25 * (t.sum() / t.abs().sum()).item()
        return t


class _Chained(torch.autograd.Function):
    """The identity on a layer's output, scaled by the rank's chain in forward, and its gradient in backward (B and
    W each go through it, so each advances the chain)."""

    @staticmethod
    def forward(ctx, y, chain):
        ctx.chain = chain
        return chain.advance(y)

    @staticmethod
    def backward(ctx, grad):
        return ctx.chain.advance(grad), None


def chain_layers(pieces):
    """Every layer of a rank's pieces (a Stage, or a ModuleList of them; or a model whose layers are a ModuleDict,
    notebook 12's transformer stage) chained to one new _Chain."""
    chain = _Chain()
    for piece in pieces if isinstance(pieces, torch.nn.ModuleList) else [pieces]:
        layers = piece.layers.values() if isinstance(piece.layers, torch.nn.ModuleDict) else piece.layers
        for layer in layers:
            layer.register_forward_hook(lambda module, args, y: _Chained.apply(y, chain))


def _chained_gradients(rank, world_size, schedule, m, sizes, num_virtual=None, split=False):
    """This rank's weights' gradients after one step of `schedule` with its layers chained (recorded as the step
    of any run, which a forger edits in vain)."""
    hidden_dim, num_layers, seed = sizes["hidden_dim"], sizes["num_layers"], sizes["seed"]
    pieces = (pp.build_stage(rank, world_size, hidden_dim, num_layers, seed) if num_virtual is None
              else pp.build_pieces(rank, world_size, num_virtual, hidden_dim, num_layers, seed))
    chain_layers(pieces)
    with pp.record_step(pieces, split=split):
        schedule(pieces, make_batch(sizes["batch_size"], hidden_dim, seed, 0), m)
    return [None if p.grad is None else p.grad.detach().clone() for p in pieces.parameters()]


def chained_reference(tables, num_virtual, split, sizes, m):
    """Each rank's weights' gradients after one step of the course's MLP whose ranks ran `tables` (one per rank,
    (kind, chunk, micro-batch)) with their layers chained (chained_replay)."""
    p, last = len(tables), len(tables) * num_virtual - 1
    ranks = [pp.build_pieces(r, p, num_virtual, sizes["hidden_dim"], sizes["num_layers"], sizes["seed"])
             for r in range(p)]
    micro_batches = make_batch(sizes["batch_size"], sizes["hidden_dim"], sizes["seed"], 0).chunk(m)
    chained_replay(tables, ranks, micro_batches, lambda j, piece, x, i: loss_fn(piece(x)) / m if j == last
                   else piece(x), split)
    return [[g.grad for g in pieces.parameters()] for pieces in ranks]


def chained_replay(tables, ranks, inputs, forward, split=False):
    """One step whose ranks ran `tables` (one per rank, (kind, chunk, micro-batch)) with their layers chained: one
    process plays every rank (`ranks`: each rank's pieces, chunk c of rank r being piece r + c p), each with its own
    chain, in an order that respects the hand-offs (pp.play's). `inputs`: the first piece's input per micro-batch;
    forward(j, piece, x, i): piece j's output of micro-batch i (the last piece's: its share of the loss). The
    gradients are left in the pieces' .grad."""
    p, v = len(tables), len(ranks[0])
    last = p * v - 1
    for pieces in ranks:
        chain_layers(pieces)
    timelines, _ = pp.play(tables, v)
    sent, alive = {}, {}  # (kind, piece, micro-batch): the output (F) or the input's gradient (B) handed on
    for *_, r, kind, chunk, i in sorted((end, r, *a[:3]) for r, t in enumerate(timelines) for *a, _, end in t):
        j, piece = r + chunk * p, ranks[r][chunk]
        if kind == "F":
            x = inputs[i] if j == 0 else sent["F", j - 1, i].detach().requires_grad_()
            sent["F", j, i] = y = forward(j, piece, x, i)
            alive[j, i] = x, y
            continue
        x, y = alive[j, i]
        grad = None if j == last else sent["B", j + 1, i]
        if kind == "W":
            torch.autograd.backward(y, grad, inputs=list(piece.parameters()))
        elif split:
            sent["B", j, i] = torch.autograd.grad(y, x, grad, retain_graph=True)[0] if x.requires_grad else None
        else:
            y.backward(grad)
            sent["B", j, i] = x.grad


def _check_chained(where, got, want, schedule, table):
    """After every check of the records: a rank whose chained gradients are not the table's ran its forwards and
    backwards in another order, whatever its record says."""
    diff = max(max_abs_diff(g, w) if g is not None else float("inf") for g, w in zip(got, want))
    if diff > TOLERANCE:
        raise AssertionError(f"{where}: the gradients show the forwards and backwards ran in another order than "
                             f"{schedule}'s ({table}): with every layer scaled by a running state of its rank that "
                             f"each forward and backward reads and advances, the weights' gradients differ from that "
                             f"order's by {diff:.3g}; is the record of the order edited?")


# ---------------------------------------------------------------- notebook 11: the backward in two halves

SPLIT_PIECES = 3  # check_backward_split cuts the model into 3 pieces: the first, a middle and the last


def _piece_inputs(piece, micro_batches, reference_inputs):
    """Each micro-batch's input of `piece`: the data on the first piece, a leaf that requires grad elsewhere."""
    lo = piece.layer_indices[0]
    if piece.is_first:
        return list(micro_batches)
    return [a[lo].clone().requires_grad_() for a in reference_inputs]


def _upstream(piece, y, seed, i):
    """The gradient of a micro-batch's output that the next piece would send (None on the last: y is the loss)."""
    return None if piece.is_last else seeded_randn(tuple(y.shape), seed + 7, i)


def _split_reference(piece_index, sizes, m):
    """Full backwards of m micro-batches on a fresh piece: each input's gradient, and the weights' .grad."""
    hidden_dim, num_layers, batch_size, seed = sizes
    piece = pp.Stage(piece_index, SPLIT_PIECES, hidden_dim, num_layers, seed)
    batch = make_batch(batch_size, hidden_dim, seed)
    inputs = [_reference_activations(hidden_dim, num_layers, mb, seed) for mb in batch.chunk(m)]
    xs = _piece_inputs(piece, batch.chunk(m), inputs)
    input_grads = []
    for i, x in enumerate(xs):
        y = piece(x)
        y = loss_fn(y) / m if piece.is_last else y
        y.backward(_upstream(piece, y, seed, i))
        input_grads.append(None if piece.is_first else x.grad)
    return inputs, input_grads, [p.grad for p in piece.parameters()]


def _reference_activations(hidden_dim, num_layers, micro_batch, seed):
    mlp, activations = build_mlp(hidden_dim, num_layers, seed), [micro_batch]
    with torch.no_grad():
        for layer in mlp.layers:
            activations.append(layer(activations[-1]))
    return activations


def _same(got, want):
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)


SPLIT_ERRORS = [  # (words in the error autograd raised, what in B or W caused it)
    ("second time", "W failed: the graph was freed by B. B must keep it for W (retain_graph=True): W walks the "
                    "same graph to the weights"),
    ("already been freed", "W failed: the graph was freed by B. B must keep it for W (retain_graph=True): W walks "
                           "the same graph to the weights"),
    ("grad can be implicitly created only for scalar outputs",
     "autograd was not given grad: on every piece but the last, y is an activation, not a scalar loss; the gradient "
     "of y (grad) must be passed (torch.autograd.grad(y, x, grad, ...), torch.autograd.backward(y, grad, ...))"),
    ("does not require grad", "a gradient was asked of x, which needs none: on the first piece x is the data "
                              "(x.requires_grad is False): B returns None there"),
    ("does not have a grad_fn", "a gradient was asked of x, which needs none: on the first piece x is the data "
                                "(x.requires_grad is False): B returns None there"),
]


def _expect_weights(where, piece, want, names, m, one=None, ones=None):
    for p, w, name in zip(piece.parameters(), want, names):
        if p.grad is None:
            raise AssertionError(f"{where}: after W, {name}.grad is None: W must accumulate the weights' gradients "
                                 f"into .grad (torch.autograd.grad returns them and stores nothing)")
        if _same(p.grad, w):
            continue
        if max_abs_diff(p.grad, 2 * w) <= TOLERANCE:
            raise AssertionError(f"{where}: after B then W, {name}.grad is twice the full backward's: the weights' "
                                 f"gradients were accumulated twice (by B and by W, or W ran twice); B computes "
                                 f"only the input's gradient")
        if one is not None and m > 1 and max_abs_diff(p.grad, one[name]) <= TOLERANCE:
            raise AssertionError(f"{where}: after W of {m} micro-batches, {name}.grad holds only the last one's: W "
                                 f"overwrote .grad; it must add to it (.grad accumulates over micro-batches)")
        if ones is not None and not piece.is_last and max_abs_diff(p.grad, ones[name]) <= TOLERANCE:
            raise AssertionError(f"{where}: after W, {name}.grad is what a gradient of ones gives (y.sum()'s "
                                 f"backward): W must back-propagate y with the gradient it was given (the one "
                                 f"received from the next stage), as B does")
        raise AssertionError(f"{where}: after W, {name}.grad differs from the full backward's by "
                             f"{max_abs_diff(p.grad, w):.3g} (bit for bit expected: W walks the same graph)")


def _split_piece(piece_index, sizes, m):
    """A fresh piece, its micro-batches' inputs, and its name."""
    hidden_dim, num_layers, batch_size, seed = sizes
    piece = pp.Stage(piece_index, SPLIT_PIECES, hidden_dim, num_layers, seed)
    batch = make_batch(batch_size, hidden_dim, seed)
    inputs = [_reference_activations(hidden_dim, num_layers, mb, seed) for mb in batch.chunk(m)]
    return piece, _piece_inputs(piece, batch.chunk(m), inputs), "first" if piece.is_first else "last" if \
        piece.is_last else "middle"


def _split_forwards(piece, xs):
    """Each micro-batch's output (the loss's share on the last piece)."""
    return [loss_fn(piece(x)) / len(xs) if piece.is_last else piece(x) for x in xs]


def _as_data(value):
    """What B returned, as the checking process may read it: None, a tensor, or the name of what it was."""
    if value is None or type(value) in (torch.Tensor, torch.nn.Parameter):
        return None if value is None else value.detach()
    return "a tuple" if isinstance(value, (tuple, list)) else f"a {type(value).__name__}"


def _split_runs(rank, world_size, backward_input, backward_weight, sizes, cases):
    """In a rank of its own (the student's code runs nowhere else), per (m, piece): B of each micro-batch (what it
    returned, the weights whose .grad it set), then W of each; the weights' .grad after, and the backward calls as
    autograd saw them. A B or W that raises ends its case: (its micro-batch, exception name, first line)."""
    runs = []
    for m, piece_index in cases:
        piece, xs, _ = _split_piece(piece_index, sizes, m)
        names = [f"{i}" for i, _ in enumerate(piece.parameters())]
        run = dict(b=[], b_raised=None, w_raised=None, grads=None, kinds="")
        with pp.record_step(piece, split=True) as record:
            ys = _split_forwards(piece, xs)
            for i, (x, y) in enumerate(zip(xs, ys)):
                try:
                    dx = backward_input(x, y, _upstream(piece, y, sizes[3], i))
                except NotImplementedError:  # not attempted yet: said as such, as every exercise says it
                    raise
                except Exception as e:
                    run["b_raised"] = (i, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                    break
                run["b"].append((_as_data(dx), [n for p, n in zip(piece.parameters(), names) if p.grad is not None]))
            for i, y in enumerate(ys if run["b_raised"] is None else []):
                try:
                    backward_weight(piece, y, _upstream(piece, y, sizes[3], i))
                except NotImplementedError:
                    raise
                except Exception as e:
                    run["w_raised"] = (i, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                    break
        run["grads"] = [None if p.grad is None else p.grad.detach() for p in piece.parameters()]
        run["kinds"] = "".join(e.kind for e in sorted(record.events, key=lambda e: e.start) if e.kind != "F")
        runs.append(run)
    return runs


def _raised(where, raised):
    """The AssertionError for a B or W that raised: its own, or the library's error with its cause named."""
    _, name, text = raised
    if name == "AssertionError":
        raise AssertionError(f"{where}: {text}")
    hint = next((h for words, h in SPLIT_ERRORS if words in text), None)
    raise AssertionError(f"{where}: raised {name}: {text}" + (f": {hint}" if hint else ""))


def _check_split_piece(run, piece_index, sizes, m):
    """What the student's B and W did on one piece (_split_runs), against full backwards, in this process."""
    hidden_dim, num_layers, batch_size, seed = sizes
    piece, xs, kind = _split_piece(piece_index, sizes, m)
    ys = _split_forwards(piece, xs)
    names = [parameter_names(num_layers)[i] for i in piece.layer_indices]
    _, want_dx, want_grads = _split_reference(piece_index, sizes, m)
    for i, y in enumerate(ys):
        where = f"backward_input on the {kind} piece (layers {list(piece.layer_indices)}), micro-batch {i}"
        if run["b_raised"] and run["b_raised"][0] == i:
            _raised(where, run["b_raised"])
        dx, touched = run["b"][i]
        if touched:
            raise AssertionError(f"{where}: B left {names[int(touched[0])]}.grad set: B alone must leave the weights' "
                                 f".grad untouched (ask autograd for the input's gradient only: inputs=, or "
                                 f"torch.autograd.grad); W accumulates them later")
        if piece.is_first:
            if dx is not None:
                raise AssertionError(f"{where}: returned a tensor; the first piece's input is the data, which "
                                     f"needs no gradient: return None")
            continue
        if not _same(dx, want_dx[i]):
            what = ((dx + ": torch.autograd.grad returns one gradient per input, unpack it ((dx,) = ...)"
                     if dx == "a tuple" else dx) if isinstance(dx, str) else "a NoneType" if dx is None else
                    "the gradient it was given, not the input's" if _same(dx, _upstream(piece, y, seed, i)) else
                    f"off by {max_abs_diff(dx, want_dx[i]):.3g}" if dx.shape == want_dx[i].shape else
                    f"of shape {tuple(dx.shape)}")
            raise AssertionError(f"{where}: returned {what}; expected the gradient of the piece's input, equal "
                                 f"bit for bit to the full backward's x.grad")
    if run["w_raised"]:
        i = run["w_raised"][0]
        _raised(f"backward_weight on the {kind} piece (layers {list(piece.layer_indices)}), micro-batch {i}",
                run["w_raised"])
    one = _last_alone(piece_index, sizes, m, names) if m > 1 else None
    for p, grad in zip(piece.parameters(), run["grads"]):
        p.grad = grad
    where = (f"B then W on the {kind} piece (layers {list(piece.layer_indices)}), W deferred until the B's of all "
             f"{m} micro-batches")
    _expect_weights(where, piece, want_grads, names, m, one,
                    _weights_after(piece_index, sizes, m, names, range(m), ones=True))
    want = "W" * m if piece.is_first else "B" * m + "W" * m
    if run["kinds"] != want:
        raise AssertionError(f"{where}: the backward calls, as autograd saw them, were {' '.join(run['kinds'])}; "
                             f"expected {' '.join(want)}: W must compute only the weights' gradients (inputs= the "
                             f"parameters), not the input's again")


def _weights_after(piece_index, sizes, m, names, micro_batches, ones=False):
    """The weights' gradients after the backwards of `micro_batches` (of m), each given its output's gradient, or a
    gradient of ones (`ones`: y.sum()'s backward)."""
    hidden_dim, num_layers, batch_size, seed = sizes
    piece = pp.Stage(piece_index, SPLIT_PIECES, hidden_dim, num_layers, seed)
    batch = make_batch(batch_size, hidden_dim, seed)
    inputs = [_reference_activations(hidden_dim, num_layers, mb, seed) for mb in batch.chunk(m)]
    xs = _piece_inputs(piece, batch.chunk(m), inputs)
    for i in micro_batches:
        y = piece(xs[i])
        y = loss_fn(y) / m if piece.is_last else y
        y.backward(torch.ones_like(y) if ones else _upstream(piece, y, seed, i))
    return dict(zip(names, (p.grad for p in piece.parameters())))


def _last_alone(piece_index, sizes, m, names):
    """The weights' gradients of the last micro-batch alone (what an overwriting W leaves)."""
    return _weights_after(piece_index, sizes, m, names, [m - 1])


def check_backward_split(backward_input, backward_weight, hidden_dim, num_layers, batch_size, num_micro_batches,
                         seed=0):
    """B and W on the first, a middle and the last of 3 pieces, one micro-batch and then num_micro_batches with
    every W deferred after every B: against full backwards, bit for bit. B and W run in a rank of their own, which
    returns what they computed as data; the comparison runs here. The backward calls autograd saw are recorded in
    that rank: code that computes the right gradients could lie about them, not about the gradients."""
    pp.check_sizes(num_layers, SPLIT_PIECES, batch_size, num_micro_batches)
    sizes = (hidden_dim, num_layers, batch_size, seed)
    counts = sorted({1, num_micro_batches})
    cases = list(itertools.product(counts, range(SPLIT_PIECES)))
    runs = apart(_split_runs, backward_input, backward_weight, sizes, cases, timeout=CHECK_TIMEOUT)
    with one_thread():  # the references on one thread, as apart's rank ran B and W: a sum's bits depend on the count
        for run, (m, piece_index) in zip(runs, cases):
            _check_split_piece(run, piece_index, sizes, m)
    print(f"backward_input (B) and backward_weight (W): correct on the first, a middle and the last of "
          f"{SPLIT_PIECES} pieces, micro-batches {counts}")
    print("  B alone leaves every .grad untouched; B then W equals one full backward bit for bit (the input's "
          "gradient and the weights'), with W deferred until after every micro-batch's B too")


# ---------------------------------------------------------------- notebook 11: interleaved 1F1B and ZB-H1

PAST_1F1B = {  # kind: (what the student wrote, the table, pieces per rank, B and W recorded apart)
    "interleaved": ("interleaved_step", "pp.interleaved_order", True, False),
    "zb-h1": ("zb_h1_step", "pp.zb_h1_order", False, True),
}


def schedule_table(kind, rank, world_size, num_virtual, m):
    """The table of `kind` on `rank`, as (kind, chunk, micro-batch); the first stage has no B when the backward
    is split (its input is the data: there is no input gradient to compute)."""
    if kind == "interleaved":
        return pp.interleaved_order(rank, world_size, num_virtual, m)
    return [(k, 0, i) for k, i in pp.zb_h1_order(rank, world_size, m) if not (k == "B" and rank == 0)]


def hand_offs_per_step(rank, world_size, num_virtual, m):
    """Messages a rank sends in one step: m activations from each of its pieces but the model's last, m
    gradients from each but the first. Over all ranks: 2 m (p v - 1)."""
    pieces = [rank + k * world_size for k in range(num_virtual)]
    last = world_size * num_virtual - 1
    return m * (sum(p != last for p in pieces) + sum(p != 0 for p in pieces))


def expected_hand_offs(kind, rank, world_size, num_virtual, m):
    """The sends and receives of one step on `rank`, in the table's order: [("send" or "recv", peer, what, the
    chunks of the forwards the table runs up to it, how many backwards (B or W) it runs up to it)]. A forward receives its input from the previous piece's rank and
    sends its output to the next's; a backward receives its output's gradient from the next and sends its input's
    back (on ZB-H1's first stage too: its B has no input gradient to compute, but receives)."""
    last, hand_offs, forwards, backwards = world_size * num_virtual - 1, [], [], 0
    previous, following = (rank - 1) % world_size, (rank + 1) % world_size
    table = pp.interleaved_order(rank, world_size, num_virtual, m) if kind == "interleaved" else \
        [(k, 0, i) for k, i in pp.zb_h1_order(rank, world_size, m)]
    for action, chunk, i in table:
        piece = rank + chunk * world_size
        label = f"{action}{i}" + (f".{chunk}" if kind == "interleaved" else "")
        forwards = forwards + [chunk] * (action == "F")
        if action == "F":
            hand_offs += [("recv", previous, f"{label}'s input, from the previous piece's rank", forwards,
                           backwards)] * (piece != 0)
            hand_offs += [("send", following, f"{label}'s output, to the next piece's rank", forwards,
                           backwards)] * (piece != last)
        elif action == "B":
            hand_offs += [("recv", following, f"{label}'s output gradient, from the next piece's rank", forwards,
                           backwards)] * (piece != last)
            hand_offs += [("send", previous, f"{label}'s input gradient, to the previous piece's rank", forwards,
                           backwards + 1)] * (piece != 0)
        backwards += action != "F"
    return hand_offs


def _check_peers(where, world_size, expected=(), forwards=None, journal=None, backwards=None):
    """An intercept `before` that refuses a peer outside 0..p-1, and a peer other than the table's (`expected`:
    expected_hand_offs) while the calls come in the table's order (a schedule that posts them in another order is
    left to the other checks); `forwards`: the chunks of the forwards run so far, live (a blocking receive where the
    table's next hand-off is a forward's send, after the table's forwards, means that send was skipped; `backwards`,
    a list whose length is the backwards through a piece's output so far, live: the same for a backward's send). Each send
    and receive let through is written to `journal` (nd.journal_message: if the ranks stall, the check reads which
    messages were never paired); `before.left_out()`, after the step, names the table's send the calls stopped at."""
    position = [0]

    def before(call, arguments):
        check(call, arguments)
        if call.name in SENDS + RECEIVES:
            journal_message(journal, call.name, arguments.get("dst" if call.name in SENDS else "src"))

    def left_out():  # after the step: the table's hand-off the calls stopped at, if a send
        at = position[0]
        if at is not None and at < len(expected) and expected[at][0] == "send":
            return f"{expected[at][2]} (rank {expected[at][1]})"
    before.left_out = left_out

    def check(call, arguments):
        if call.name not in SENDS + RECEIVES:
            return
        sending = call.name in SENDS
        peer = arguments.get("dst" if sending else "src")
        if peer is None or not 0 <= peer < world_size:
            wrap = ("the piece after the last rank's is on rank 0, and the one before rank 0's on rank "
                    f"{world_size - 1} ((rank ± 1) % p)" if where.kind == "interleaved" else
                    "the first stage receives nothing forward and sends nothing back; the last stage sends nothing "
                    "forward and receives nothing back")
            raise AssertionError(f"{where}: dist.{call.name} with rank {peer}, which does not exist: {wrap}")
        if position[0] is None or position[0] >= len(expected):
            return
        kind, want, what, table_forwards, table_backwards = expected[position[0]]
        # a blocking receive where the table sends first, after the table's forwards (and, for a backward's send,
        # its backwards, and no more forwards): that send was skipped
        done = forwards[:len(table_forwards)] == table_forwards if what.startswith("F") else \
            forwards == table_forwards and backwards is not None and len(backwards) >= table_backwards
        if kind == "send" and call.name == "recv" and done:
            rule = ("every piece but the model's last sends its output on (only piece.is_last, the model's last "
                    "piece, keeps the loss)" if what.startswith("F") else
                    "every piece but the model's first sends its input's gradient back, right after its backward "
                    "(only the first piece's input is the data, with no gradient to send)")
            raise AssertionError(
                f"{where}: a blocking dist.recv from rank {peer} where the table's next hand-off on this rank is a "
                f"send: {what}. Was that send skipped? The neighbour may be waiting for it while this rank waits: "
                f"{rule}")
        after = expected[position[0] + 1] if position[0] + 1 < len(expected) else None
        if kind == "recv" and sending and after and after[:2] == ("send", peer) and \
                after[2].split("'")[0] == what.split("'")[0]:  # a computation's send before its own receive
            raise AssertionError(
                f"{where}: dist.{call.name} of {after[2]} before its receive, {what}: was that receive skipped? A "
                f"computation needs what its neighbour sends ({'the input' if what.startswith('F') else 'the gradient of its output'}), "
                f"received into a buffer (torch.empty_like) before it runs; a buffer never received into holds "
                f"garbage, and the neighbour's message stays unread")
        if kind != ("send" if sending else "recv"):
            position[0] = None  # posted in another order: not this check's to judge
            return
        position[0] += 1
        if peer != want:
            direction = "the next rank, (rank + 1)" if want == (where.rank + 1) % world_size else \
                "the previous rank, (rank - 1)"
            raise AssertionError(f"{where}: dist.{call.name} with rank {peer} for {what}: that is {direction} % p = "
                                 f"{want}, expected; a direction that is right on 2 ranks only (where the next rank "
                                 f"is the previous one)")
    return before


def _unpaired_hint(label, kind, world_size, num_virtual, counts, num_steps, unpaired):
    """Ranks waited in vain, and their journals show which messages do not pair up: each named by the table (the
    sender's send, or the receiver's receive, at the count where they part; the check's runs make `num_steps` steps
    for each micro-batch count in `counts`), the run's earliest first (later ones may follow from it)."""
    def nth(rank, action, peer, k):  # (when in the run, what): the k-th hand-off `action` of `rank` with `peer`
        table = [((j, step), f"{what.split(',')[0]} (m = {m}, step {step})") for j, m in enumerate(counts)
                 for step in range(num_steps)
                 for a, p, what, *_ in expected_hand_offs(kind, rank, world_size, num_virtual, m) if (a, p) == (action, peer)]
        return table[k] if k < len(table) else ((len(counts), 0), "a message the table does not have")
    lines = sorted((nth(a, "send", b, sent)[0], f"rank {a} never sent {nth(a, 'send', b, sent)[1]}, which rank {b} "
                    f"waits for (a send skipped?)") if received > sent else
                   (nth(b, "recv", a, received)[0], f"rank {b} never received {nth(b, 'recv', a, received)[1]}, which "
                    f"rank {a} sent (a receive skipped?)") for a, b, sent, received in unpaired)
    return (f"{label} on {world_size} ranks: ranks waited for a message in vain, and their sends and receives do not "
            f"pair up: " + "; ".join(line for _, line in lines[:3]) + ". Every message the table implies is sent by "
            f"one rank and received by its neighbour: a forward receives its input (but on the model's first piece) "
            f"and sends its output on (but on the last), a backward receives its output's gradient (but on the last "
            f"piece) and sends its input's gradient back (but on the first)")


STUDENT_ERRORS = [  # (words in the error, what in the student's code raised it)
    ("grad can be implicitly created only for scalar outputs",
     "backward of an output that is not the loss, without its gradient: only the last piece's output is the loss; "
     "elsewhere back-propagate the gradient received from the next rank (y.backward(grad), or pass it to autograd)"),
    ("does not require grad",
     "a gradient asked of a tensor that does not require one: a received input must be made a leaf that requires "
     "grad (x.requires_grad_()) before the forward; the first piece's input is the data, with no gradient to send"),
    ("second time", "a backward through a graph already freed: each micro-batch's graph is walked once (B then W: "
                    "B keeps it, retain_graph=True)"),
]
NONE_SENT = ("a None where a tensor was expected: x.grad is None when the received input did not require grad "
             "(x.requires_grad_()), and on the first piece (its input is the data: send nothing back from it)")
STUDENT_ERRORS += [("NoneType", NONE_SENT), ("of type torch.Tensor", NONE_SENT)]


def _student_error(where, label, error):
    """An AssertionError naming what, in the student's function, raised `error`."""
    text = str(error).splitlines()[0] if str(error) else ""
    hint = next((h for words, h in STUDENT_ERRORS if words in f"{type(error).__name__} {text}"), None)
    if isinstance(error, KeyError):
        hint = (f"a forward's tensors were not found at their backward (key {text}): keep each forward's (x, y) "
                + ("by (chunk, micro-batch)" if where.kind == "interleaved" else
                   "by micro-batch until its W (B reads them, W pops them)") + " and take the ones the table names")
    return AssertionError(f"{where}: {label} raised {type(error).__name__}: {text}" + (f": {hint}" if hint else ""))


def _check_order(where, record, table):
    got = [(e.kind, e.piece, e.micro_batch) for e in sorted(record.events, key=lambda e: e.start)]
    if got == table:
        return
    k = next((k for k, (a, b) in enumerate(zip(got, table)) if a != b), min(len(got), len(table)))
    show = lambda actions: " ".join(f"{a}{i}" + (f"/chunk{c}" if where.pieces else "") for a, c, i in actions)
    ran = got[k] if k < len(got) else "nothing"
    hint = ""
    twice = sorted({a for a in got if a[0] == "W" and got.count(a) > 1})
    if twice:
        hint = (f": W of micro-batch {twice[0][2]} ran twice, so its weights' gradients were accumulated twice "
                f"(on the first stage, where B has nothing to compute, a full backward in B is a W)")
    elif where.kind == "zb-h1" and k < len(got) and got[k][0] == "W" and k < len(table) and table[k][0] != "W":
        hint = ": a W ran early; ZB-H1 runs it where the table puts it (into the cool-down's bubble)"
    elif where.kind == "zb-h1" and k < len(table) and table[k][0] == "W":
        hint = ": the W that the table puts here did not run (W deferred too long keeps activations alive)"
    elif k < len(got) and k < len(table) and got[k][::2] == table[k][::2] and got[k][1] != table[k][1]:
        hint = (f": {got[k][0]}{got[k][2]} ran on chunk {got[k][1]} where the table says chunk {table[k][1]}: run "
                f"pieces[chunk], the chunk the table names")
    elif where.kind == "interleaved" and k < len(got) and k < len(table) and got[k][0] == table[k][0] == "B":
        hint = (": the backward ran on the wrong piece or micro-batch: keep each forward's tensors by (chunk, "
                "micro-batch) and take the ones the table names")
    raise AssertionError(f"{where}: the computations ran in another order than the table ({PAST_1F1B[where.kind][1]}) "
                         f"from position {k}: ran {ran}, the table says {table[k] if k < len(table) else 'nothing'}"
                         f"{hint}\n  ran:   {show(got)}\n  table: {show(table)}")


@dataclasses.dataclass
class WherePieces:
    label: str
    kind: str
    rank: int
    world_size: int
    num_virtual: int
    m: int
    pieces: bool

    @property
    def stage(self):  # what the 04 checks call it: the last rank holds the loss
        return self.rank

    @property
    def num_stages(self):
        return self.world_size

    def __str__(self):
        pieces = f", {self.num_virtual} pieces each" if self.pieces else ""
        return (f"{self.label} on rank {self.rank} of {self.world_size}{pieces}, {self.m} micro-batch"
                f"{'es' * (self.m > 1)}")


def _on_backward(y, backwards):
    """A forward hook's work: a 1 in `backwards` each time autograd goes through the output y (B, or W)."""
    if torch.is_grad_enabled() and isinstance(y, torch.Tensor) and y.requires_grad:
        y.register_hook(lambda grad: backwards.append(1))


def _past_1f1b_main(rank, world_size, schedule, kind, num_virtual, counts, sizes, journal_dir=None):
    with open(os.path.join(journal_dir, f"{rank}"), "w", buffering=1) if journal_dir else \
            contextlib.nullcontext() as journal:
        return _train_past_1f1b(rank, world_size, schedule, kind, num_virtual, counts, sizes, journal)


def _train_past_1f1b(rank, world_size, schedule, kind, num_virtual, counts, sizes, journal):
    label, _, pieces, split = PAST_1F1B[kind]
    runs = {}
    for m in counts:
        peers = [None]  # this step's _check_peers, which after_step asks where the calls stopped
        where = WherePieces(label, kind, rank, world_size, num_virtual, m, pieces)

        def after_step(record):
            _check_order(where, record, schedule_table(kind, rank, world_size, num_virtual, m))
            sends = [c for c in record.calls if c.name in SENDS]
            want = hand_offs_per_step(rank, world_size, num_virtual if pieces else 1, m)
            if len(sends) != want:
                left_out = peers[0].left_out() if len(sends) < want else None
                first = f"; the calls stopped short of the table's send {left_out}: was it skipped?" if left_out else ""
                raise AssertionError(f"{where}: sent {len(sends)} message(s) in one step; expected {want}: m "
                                     f"activations from each piece but the model's last, m gradients from each but "
                                     f"the first{first}")
            _check_isends(where, record, "this schedule")

        def watched(stage, batch, m):
            expected = expected_hand_offs(kind, rank, world_size, num_virtual if pieces else 1, m)
            forwards, backwards = [], []  # the chunks of the forwards run so far; a 1 a backward through an output
            peers[0] = _check_peers(where, world_size, expected, forwards, journal, backwards)
            modules = list(stage) if isinstance(stage, torch.nn.ModuleList) else [stage]
            hooks = [module.register_forward_pre_hook(lambda *_, k=k: forwards.append(k))
                     for k, module in enumerate(modules)]
            hooks += [module.register_forward_hook(lambda _, __, y: _on_backward(y, backwards)) for module in modules]
            try:
                with intercept(before=peers[0]):
                    return schedule(stage, batch, m)
            except AssertionError:
                raise
            except Exception as e:  # a library's error, raised inside the student's code
                raise _student_error(where, label, e) from e
            finally:
                for hook in hooks:
                    hook.remove()

        run = pp.train_pipeline(rank, world_size, watched, num_micro_batches=m, after_step=after_step,
                                num_virtual=num_virtual if pieces else None, split=split, **sizes)
        runs[m] = run
    chained = {m: _chained_gradients(rank, world_size, schedule, m, sizes, num_virtual if pieces else None, split)
               for m in counts if m > 1}  # one micro-batch: one order, ZB-H1's as 1F1B's
    return runs, chained


def _check_scaled(where, got, want):
    """Every weight's gradient the same multiple c != 1 of the full batch's: a loss divided by the wrong count,
    named by what c is."""
    if any(g is None for g in got) or not got:
        return
    w = torch.cat([x.flatten() for x in want])
    g = torch.cat([x.flatten() for x in got])
    c = (g @ w / (w @ w)).item()
    if abs(c - 1) < 1e-9 or max_abs_diff(g, c * w) > TOLERANCE * max(1.0, abs(c)):
        return
    m, p, v = where.m, where.world_size, (where.num_virtual if where.pieces else 1)
    counts = {2: "accumulated twice (B and W both added to .grad, or W ran twice)", m: None, 1 / m: f"divided by num_micro_batches twice (1/{m} * 1/{m})", 1 / p: "divided by the "
              f"world size p = {p}", 1 / (p * v): f"divided by the number of pieces p v = {p * v}", 1 / v: "divided "
              f"by the pieces per rank v = {v}", m / p: f"divided by the world size p = {p}, not by m = {m}",
              m / (p * v): f"divided by the pieces p v = {p * v}, not by m = {m}", m / v: f"divided by v = {v}, not by "
              f"m = {m}"}
    fits = [w for k, w in counts.items() if abs(c - k) < 1e-9]
    if None in fits:  # m times: _check_gradients says it
        return
    what = " or ".join(dict.fromkeys(fits))  # every count that gives this factor on this run
    raise AssertionError(f"{where}: every weight's gradient is {c:.4g} times the full batch's: " + (
        f"each micro-batch's loss was {what}; divide it by num_micro_batches ({m}) only" if what else
        f"a loss divided by the wrong count; each micro-batch's loss is divided by num_micro_batches ({m}) only"))


def _last_micro_batch_loss(sizes, m):
    """Step 0's last micro-batch's loss / m, on one process: what a schedule returns that overwrites its loss."""
    mlp = build_mlp(sizes["hidden_dim"], sizes["num_layers"], sizes["seed"])
    batch = make_batch(sizes["batch_size"], sizes["hidden_dim"], sizes["seed"], 0)
    with torch.no_grad():
        return (loss_fn(mlp(batch.chunk(m)[-1])) / m).item()


def _check_pieces_run(where, run, reference, sizes):
    grads, weights, losses = reference
    p, v = where.world_size, (where.num_virtual if where.pieces else 1)
    split = pp.stage_layers(sizes["num_layers"], p * v)
    layers = [i for k in range(v) for i in split[where.rank + k * p]]
    doubled = any(g is not None and max_abs_diff(g, 2 * grads[i]) <= TOLERANCE for g, i in zip(run.grads, layers))
    if where.kind == "zb-h1" and where.m == 1 and doubled:
        raise AssertionError(f"{where}: with one micro-batch, the weights' gradients are twice the full batch's: they "
                             f"were accumulated twice; B (backward_input) must leave .grad alone, W adds them once")
    names = parameter_names(sizes["num_layers"])
    _check_scaled(where, run.grads, [grads[i] for i in layers])
    _check_gradients(where, run.grads, [grads[i] for i in layers], [names[i] for i in layers])
    _check_losses(where, run.losses, losses, _last_micro_batch_loss(sizes, where.m))
    for i, got in zip(layers, run.weights):
        diff = max_abs_diff(got, weights[i])
        if diff > TOLERANCE:
            raise AssertionError(f"{where}: at the end, {names[i]} differs from the single-process run's by {diff:.3g}")
    if where.kind == "zb-h1":
        want = min(p, where.m)
        if run.peak_alive > want:
            raise AssertionError(f"{where}: held the activations of {run.peak_alive} micro-batches at once; ZB-H1 "
                                 f"holds at most {want} (1F1B's peak, on its first stage): W frees a micro-batch, "
                                 f"run it where the table puts it")


def check_past_1f1b(kind, schedule, world_size, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches,
                    num_virtual=2, seed=0, timeout=CHECK_TIMEOUT):
    """Train with `schedule` on WORLD_SIZE ranks and on 2 with SGD; compare (see the module's doc)."""
    if kind not in PAST_1F1B:
        raise ValueError(f"kind must be one of {list(PAST_1F1B)}, got {kind!r}")
    label, _, pieces, _ = PAST_1F1B[kind]
    v = num_virtual if pieces else 1
    pp.check_virtual_sizes(num_layers, world_size, v, batch_size, num_micro_batches, groups=pieces)
    worlds = runnable_world_sizes(sorted({world_size, 2}, reverse=True))
    counts = {n: [m for m in sorted({n, num_micro_batches, 2 * n}) if m % n == 0 and batch_size % m == 0]
              if pieces else sorted({1, 2, num_micro_batches}) for n in worlds}
    sizes = dict(hidden_dim=hidden_dim, num_layers=num_layers, batch_size=batch_size, num_steps=num_steps, seed=seed)
    reference = (reference_gradients(hidden_dim, num_layers, batch_size, seed),
                 *train_reference(hidden_dim, num_layers, batch_size, num_steps, "sgd", seed=seed))
    peaks, sent = {}, {}
    for n in worlds:
        try:
            with tempfile.TemporaryDirectory() as journal_dir:
                try:
                    runs = _spawn(_past_1f1b_main, n, schedule, kind, v, counts[n], sizes, timeout=timeout,
                                  journal_dir=journal_dir)
                except (RankError, TimeoutError) as e:
                    # waited in vain (not in a blocking send: the message below says why that hangs)
                    waited = "dist.send(" not in str(e) if isinstance(e, TimeoutError) else \
                        "already returned from fn" in e.summary
                    unpaired = waited and unpaired_messages(journal_dir, n)
                    if unpaired:
                        raise AssertionError(_unpaired_hint(label, kind, n, v, counts[n], num_steps, unpaired)) from e
                    raise
        except TimeoutError as e:
            raise TimeoutError(f"{label} on {n} ranks: a rank waited for ever. A blocking dist.send returns only "
                               f"once the receiver takes the message, and the receiver may be waiting for this rank: "
                               f"send with dist.isend (keep the handles, wait at the end of the step); and check that "
                               f"every message the table implies is sent and received.\n{e}") from None
        runs, chained = zip(*runs)
        for m, rank in itertools.product(counts[n], range(n)):
            _check_pieces_run(WherePieces(label, kind, rank, n, v, m, pieces), runs[rank][m], reference, sizes)
        for m in chained[0]:  # the order, shown by the values: after every check of the records
            tables = [pp.interleaved_order(r, n, v, m) if pieces else pp.chunked(pp.zb_h1_order)(r, n, v, m)
                      for r in range(n)]
            want = chained_reference(tables, v, PAST_1F1B[kind][3], sizes, m)
            for rank in range(n):
                _check_chained(WherePieces(label, kind, rank, n, v, m, pieces), chained[rank][m], want[rank],
                               {"interleaved": "interleaved 1F1B", "zb-h1": "ZB-H1"}[kind], PAST_1F1B[kind][1])
        peaks[n] = {m: [runs[r][m].peak_alive for r in range(n)] for m in counts[n]}
        sent[n] = {m: sum(hand_offs_per_step(r, n, v, m) for r in range(n)) for m in counts[n]}
    n = worlds[0]
    print(f"{label}: correct on {' and '.join(map(str, worlds))} ranks" + (f", {v} pieces each" if pieces else "")
          + ", micro-batches " + "; ".join(f"{counts[w]} on {w}" for w in worlds))
    print(f"  step 0's gradients, the losses and the weights after {num_steps} SGD steps equal the single-process "
          f"run's to {TOLERANCE:g}")
    print(f"  each rank ran its table ({PAST_1F1B[kind][1]}) in order, every send an isend still in flight")
    if pieces:
        print(f"  messages per step on {n} ranks (counted): " + ", ".join(
            f"m={m}: {sent[n][m]} = 2 m (p v - 1), against 1F1B's 2 m (p - 1) = {2 * m * (n - 1)}" for m in counts[n]))
    else:
        print(f"  micro-batches alive at once on each of {n} ranks (counted): "
              + ", ".join(f"m={m}: {peaks[n][m]}" for m in counts[n]) + "; 1F1B's peak: min(p, m)")


def check_interleaved_step(interleaved_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                           num_micro_batches, num_virtual, seed=0, timeout=CHECK_TIMEOUT):
    check_past_1f1b("interleaved", interleaved_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                    num_micro_batches, num_virtual, seed, timeout)


def check_zb_h1_step(zb_h1_step, world_size, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches,
                     seed=0, timeout=CHECK_TIMEOUT):
    check_past_1f1b("zb-h1", zb_h1_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                    num_micro_batches, 1, seed, timeout)
