"""Pipeline parallel (notebook 04): the stage split, a stage's layers, recording a step, the training
loop, PyTorch's pipelining, and the bubble.

Stage `s` of `p` holds a contiguous run of the course's MLP's layers (`stage_layers`), built from
`utils.model.layer_weight`: exactly the reference's weights. A `Stage` is only its layers. A schedule
is a function

    schedule(stage, batch, num_micro_batches) -> the batch's loss on the last stage, None elsewhere

that runs one step's forwards and backwards on this rank (the student writes it). What the checks and
the plots need to know about a step is recorded from outside the stage, by whoever owns the step:

    with pp.record_step(stage) as record:
        schedule(stage, batch, m)
    record.events      # Event(kind "F"/"B", micro-batch, start, end): when each forward and backward ran
    record.calls       # utils.intercept.Call: each send/recv, when it started and when it was waited for
    record.peak_alive  # micro-batches whose activations autograd held at once

`train_pipeline` runs a schedule for several steps with an optimizer and returns a `PipelineRun`.

Past 1F1B (notebook 11): a rank may hold `v` pieces of the model (`build_pieces`: the model cut into
p*v pieces, rank r holding pieces r, r+p, ...), each a `Stage` of p*v; the schedule then gets them as
an `nn.ModuleList` and `record_step` records each piece's events (`Event.piece`). A backward may be split
into B (the input's gradient) and W (the weights'): `record_step(..., split=True)` labels a backward call
that reached the piece's input "B" and one that did not "W". The tables
`gpipe_order`, `one_f_one_b_order`, `interleaved_order` and `zb_h1_order` say what each rank runs, in
order; `idle_slots` plays them with unit-time computations: the exact bubble each formula approximates.
"""
import contextlib
import dataclasses
import functools
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from utils.bench import stopwatch
from utils.intercept import intercept
from utils.memory import Saved, unpack
from utils.model import Layer, detached_parameters, layer_weight, make_batch, make_optimizer, step_batches, train
from utils.sizes import check_int, divide


def check_sizes(num_layers, world_size, batch_size, num_micro_batches=1):
    """At least one layer per stage; equal micro-batches. Returns the micro-batch size."""
    stage_layers(num_layers, world_size)
    return divide("batch_size", batch_size, "num_micro_batches", num_micro_batches,
                  "each micro-batch must have the same number of rows")


def stage_layers(num_layers, world_size):
    """The layers of each stage, as ranges: L // p each, and the first L % p stages take one more."""
    num_layers, world_size = check_int("num_layers", num_layers), check_int("world_size", world_size)
    if world_size > num_layers:
        raise ValueError(f"world size {world_size} is more stages than num layers {num_layers}: "
                         f"every stage needs at least one layer")
    base, extra = divmod(num_layers, world_size)
    ranges, start = [], 0
    for stage in range(world_size):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class Stage(nn.Module):
    """This rank's layers of the MLP (parameters `layers.{k}.linear.weight`, k counting from 0 on each stage)."""

    def __init__(self, rank, world_size, hidden_dim, num_layers, seed=0, dtype=torch.float64):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.layer_indices = stage_layers(num_layers, world_size)[rank]
        self.is_first, self.is_last = rank == 0, rank == world_size - 1
        with torch.device("meta"):  # no default init: it would draw from the global RNG
            layers = [Layer(hidden_dim) for _ in self.layer_indices]
        self.layers = nn.ModuleList(layers).to_empty(device="cpu").to(dtype)
        with torch.no_grad():
            for layer, i in zip(self.layers, self.layer_indices):
                layer.linear.weight.copy_(layer_weight(hidden_dim, seed, i, dtype))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_stage(rank, world_size, hidden_dim, num_layers, seed=0, dtype=torch.float64):
    return Stage(rank, world_size, hidden_dim, num_layers, seed, dtype)


def check_virtual_sizes(num_layers, world_size, num_virtual, batch_size, num_micro_batches, groups=True):
    """Interleaved stages: v >= 1 pieces per rank, at least one layer per piece (the 04 rule splits the
    layers into p*v pieces), equal micro-batches, and, if `groups`, micro-batches in groups of p.
    Returns the micro-batch size."""
    world_size, num_virtual = check_int("world_size", world_size), check_int("num_virtual", num_virtual)
    if num_virtual < 1:
        raise ValueError(f"num virtual {num_virtual}: each rank must hold at least one piece of the model")
    if check_int("num_layers", num_layers) < world_size * num_virtual:
        raise ValueError(f"num layers {num_layers} do not split into world size {world_size} x num virtual "
                         f"{num_virtual} = {world_size * num_virtual} pieces: every piece needs at least one layer")
    if groups and check_int("num_micro_batches", num_micro_batches) % world_size:
        raise ValueError(f"num micro batches {num_micro_batches} is not a multiple of world size {world_size}: "
                         f"interleaved 1F1B runs the micro-batches in groups of {world_size} (as Megatron-LM)")
    return check_sizes(num_layers, world_size * num_virtual, batch_size, num_micro_batches)


def build_pieces(rank, world_size, num_virtual, hidden_dim, num_layers, seed=0, dtype=torch.float64):
    """This rank's v pieces of the model cut into p*v: pieces rank, rank + p, ..., each a Stage of p*v
    (its `rank` is the piece's index, `is_first` / `is_last` the whole model's ends)."""
    pieces = world_size * num_virtual
    return nn.ModuleList(Stage(rank + k * world_size, pieces, hidden_dim, num_layers, seed, dtype)
                         for k in range(num_virtual))


# ---------------------------------------------------------------- recording a step, from outside the stage

class Event(NamedTuple):
    kind: str  # "F" or "B" (and "W" when the backward is split)
    micro_batch: int  # numbered in the order of this step's forwards (of its piece)
    start: float  # perf_counter seconds: one clock for every rank on the machine
    end: float
    piece: int = 0  # which of the rank's pieces (0 when it holds one stage)


@dataclasses.dataclass
class StepRecord:
    """What one stage did in one step."""

    events: list = dataclasses.field(default_factory=list)  # Event, in the order they ended
    calls: list = dataclasses.field(default_factory=list)  # utils.intercept.Call, times on the same clock
    peak_alive: int = 0  # micro-batches whose saved activations were alive at once
    waited: float = None  # seconds this rank's thread waited for a core in the step (record_timelines; utils.bench)


class _Recorder:
    """Module and tensor hooks that fill a StepRecord. A forward is timed by each piece's forward hooks;
    a backward from the gradient reaching the piece's output to the end of that backward call (the
    input's gradient included). What autograd saves for the backward is packed into
    a holder that dies when the backward frees the graph: a micro-batch is alive while it has holders.
    With `split`, a backward call that did not reach the piece's input is a "W" (on the first piece, whose
    input is the data, every backward is)."""

    def __init__(self, pieces, record, clock, split=False):
        self.pieces, self.record, self.clock, self.split = pieces, record, clock, split
        self.num_forwards, self.current, self.alive = [0] * len(pieces), None, {}
        self.forward_start, self.reached = None, False

    def hooks(self):
        handles = []
        for k, piece in enumerate(self.pieces):
            handles += [piece.register_forward_pre_hook(functools.partial(self.before_forward, k)),
                        piece.register_forward_hook(functools.partial(self.after_forward, k))]
        return handles

    def before_forward(self, k, module, args):
        self.current, self.forward_start = (k, self.num_forwards[k]), self.clock()
        self.num_forwards[k] += 1
        if self.split and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(self.input_reached)

    def input_reached(self, grad):
        self.reached = True

    def after_forward(self, k, module, args, output):
        piece, micro_batch = self.current
        self.record.events.append(Event("F", micro_batch, self.forward_start, self.clock(), piece))
        if output.requires_grad:
            output.register_hook(lambda grad: self.backward_started(piece, micro_batch))

    def backward_started(self, piece, micro_batch):
        start, self.reached = self.clock(), False

        def ended():  # autograd has finished this backward call: the input's gradient included
            kind = "W" if self.split and not self.reached else "B"
            self.record.events.append(Event(kind, micro_batch, start, self.clock(), piece))

        torch.autograd.Variable._execution_engine.queue_callback(ended)

    def pack(self, tensor):
        key = self.current
        self.alive[key] = self.alive.get(key, 0) + 1
        self.record.peak_alive = max(self.record.peak_alive, len(self.alive))
        return Saved(tensor, functools.partial(self.release, key))

    def release(self, key):
        self.alive[key] -= 1
        if not self.alive[key]:
            del self.alive[key]


@contextlib.contextmanager
def record_step(stage, clock=time.perf_counter, split=False):
    """Record one step of `stage` (see the module's doc), or of a rank's pieces (an nn.ModuleList);
    every hook is removed on leaving the block."""
    record = StepRecord()
    recorder = _Recorder(list(stage) if isinstance(stage, nn.ModuleList) else [stage], record, clock, split)
    with contextlib.ExitStack() as stack:
        record.calls = stack.enter_context(intercept(clock=clock))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(recorder.pack, unpack))
        for handle in recorder.hooks():
            stack.callback(handle.remove)
        yield record


# ---------------------------------------------------------------- the training loop

@dataclasses.dataclass
class PipelineRun:
    """One stage's run of a schedule."""

    weights: list  # this stage's, after the last step
    grads: list  # step 0's, before the optimizer step (None where a parameter got none)
    losses: list  # by step; None except on the last stage
    steps: list  # StepRecord by step

    @property
    def peak_alive(self):
        return max(step.peak_alive for step in self.steps)


def train_pipeline(rank, world_size, schedule, *, hidden_dim, num_layers, batch_size, num_steps,
                   num_micro_batches=1, optimizer="sgd", seed=0, dtype=torch.float64, after_step=None,
                   num_virtual=None, split=False):
    """One rank's run of `num_steps` steps of `schedule` (the course's loop, `utils.model.train`), each step
    recorded: a PipelineRun. `after_step(record)`, if given, sees each step's StepRecord on this rank as soon as
    the step ends. With `num_virtual`, the rank holds that many pieces (`build_pieces`) and the schedule gets
    them; `split` records B and W apart."""
    if num_virtual is None:
        check_sizes(num_layers, world_size, batch_size, num_micro_batches)
        stage = build_stage(rank, world_size, hidden_dim, num_layers, seed, dtype)
    else:
        check_virtual_sizes(num_layers, world_size, num_virtual, batch_size, num_micro_batches, groups=False)
        stage = build_pieces(rank, world_size, num_virtual, hidden_dim, num_layers, seed, dtype)
    opt = make_optimizer(stage.parameters(), optimizer)
    run = PipelineRun(weights=[], grads=None, losses=[], steps=[])

    def keep_first_gradients(*_):
        if run.grads is None:
            run.grads = [None if p.grad is None else p.grad.clone() for p in stage.parameters()]

    @contextlib.contextmanager
    def recorded(step):
        with record_step(stage, split=split) as record:
            yield
        run.steps.append(record)
        if after_step is not None:
            after_step(record)

    opt.register_step_pre_hook(keep_first_gradients)
    batches = step_batches(batch_size, hidden_dim, seed, num_steps, dtype=dtype)  # every stage knows the shapes
    run.losses = train(stage, opt, batches, watch=recorded,
                       forward_backward=lambda stage, batch: schedule(stage, batch, num_micro_batches))
    run.weights = detached_parameters(stage)
    return run


# ---------------------------------------------------------------- PyTorch's pipelining, on the same model

@dataclasses.dataclass
class PytorchRun:
    weights: list  # this stage's, after the last step
    losses: list  # by step; None except on the last stage
    schedule: str  # "gpipe" or "1f1b"


# ---------------------------------------------------------------- bubbles

def bubble_fraction(num_stages, num_micro_batches):
    """The idle share of a step when every stage takes the same time per micro-batch: (p-1)/(m+p-1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def idle_fraction(events_by_stage):
    """1 - (time the stages computed) / (stages x the step's span), from one step's events of every stage."""
    events = [e for stage in events_by_stage for e in stage]
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return 1 - busy / (len(events_by_stage) * span)


def waited_share(records):
    """The largest share of one step's span (its StepRecord on every stage) that a stage's thread waited for a core,
    which its idle share may have counted: what utils.bench removes before it claims an order of idle shares
    (bench.share_spread). None where the OS does not say."""
    if any(r.waited is None for r in records):
        return None
    events = [e for r in records for e in r.events]
    return min(max(r.waited for r in records) / (max(e.end for e in events) - min(e.start for e in events)), 1.0)


def waited_seconds(records):
    """Seconds the stages' threads waited for a core in one step, summed over the stages (what it may have added to
    their computing, summed); None where the OS does not say."""
    return None if any(r.waited is None for r in records) else sum(r.waited for r in records)


def _dependency(events_by_stage, stage, event):
    """The event on a neighbour that `event` needs: F(i) the previous stage's F(i), B(i) the next stage's B(i)."""
    neighbour = stage - 1 if event.kind == "F" else stage + 1
    if not 0 <= neighbour < len(events_by_stage):
        return None
    return next((neighbour, k) for k, e in enumerate(events_by_stage[neighbour])
                if (e.kind, e.micro_batch) == (event.kind, event.micro_batch))


def replay(events_by_stage):
    """The same step with free hand-offs and no time between computations: each event, as long as it was
    measured, starts as soon as the one before it on its stage and the one it needs on a neighbour have ended
    (`play`, on the recorded orders). What idle time is left is the schedule's own (unequal stages included)."""
    events = [sorted(stage, key=lambda e: e.start) for stage in events_by_stage]
    p, t0 = len(events), min(stage[0].start for stage in events)
    seconds = {(e.kind, s + e.piece * p, e.micro_batch): e.end - e.start for s, stage in enumerate(events) for e in stage}
    orders = [[(e.kind, e.piece, e.micro_batch) for e in stage] for stage in events]
    num_virtual = 1 + max(e.piece for stage in events for e in stage)
    timelines, _ = play(orders, num_virtual, lambda kind, piece, i: seconds[kind, piece, i])
    return [[Event(kind, i, t0 + start, t0 + end, chunk) for kind, chunk, i, start, end in timeline]
            for timeline in timelines]


def hand_off_delays(events_by_stage):
    """For each hand-off a stage was waiting for (its previous event had ended before the neighbour's
    event it needs): seconds from the neighbour's event's end to this event's start."""
    events = [sorted(stage, key=lambda e: e.start) for stage in events_by_stage]
    delays = []
    for s, stage in enumerate(events):
        for k, event in enumerate(stage):
            needed = _dependency(events, s, event)
            if needed is None:
                continue
            produced = events[needed[0]][needed[1]].end
            if k == 0 or stage[k - 1].end < produced:
                delays.append(event.start - produced)
    return delays


@dataclasses.dataclass
class IdleShares:
    """Where a step's idle time went, as shares of (stages x the step's span); they add up to idle_fraction."""

    neighbour_computing: float  # waiting while the neighbour computed what this stage needs: the schedule's bubble
    hand_off: float  # from the neighbour's end to this stage's start: the message, and getting back to work
    in_send: float  # inside a blocking send between two computations (gloo's returns once the receiver takes it)
    other: float  # between two computations with nothing to wait for: Python, posting messages, the loss


def idle_shares(records_by_stage):
    """Split each stage's idle time, gap by gap, from one step's StepRecords of every stage."""
    events = [sorted(r.events, key=lambda e: e.start) for r in records_by_stage]
    t0, t1 = min(s[0].start for s in events), max(e.end for s in events for e in s)
    total = [0.0] * 4
    for s, (stage, record) in enumerate(zip(events, records_by_stage)):
        total[0] += t1 - stage[-1].end  # after its last event: the others still computing
        for k, event in enumerate(stage):
            gap_start = stage[k - 1].end if k else t0
            needed = _dependency(events, s, event)
            produced = events[needed[0]][needed[1]].end if needed else gap_start
            waited = min(max(produced - gap_start, 0.0), event.start - gap_start)
            free = event.start - gap_start - waited
            sending = min(free, _blocked_in_send(record.calls, gap_start, event.start))
            if produced > gap_start:
                total[:2] = [total[0] + waited, total[1] + free]
            else:
                total[2:] = [total[2] + sending, total[3] + free - sending]
    return IdleShares(*(t / (len(events) * (t1 - t0)) for t in total))


def _blocked_in_send(calls, start, end):
    """Seconds inside blocking sends, within [start, end]."""
    return sum(max(0.0, min(c.waited_at, end) - max(c.started_at, start))
               for c in calls if c.name == "send" and c.waited_at is not None)


def alone_and_together(events_by_stage, kind):
    """Median seconds of a computation of `kind` ("F" or "B") that ran (mostly) while no other stage
    computed, and of one that ran (mostly) while another did: two ranks on two cores share more than
    the cores' arithmetic (memory bandwidth, caches, and gloo's threads)."""
    alone, together = [], []
    for s, events in enumerate(events_by_stage):
        others = [e for t, stage in enumerate(events_by_stage) if t != s for e in stage]
        for e in (e for e in events if e.kind == kind):
            overlap = sum(max(0.0, min(e.end, o.end) - max(e.start, o.start)) for o in others)
            (together if overlap > (e.end - e.start) / 2 else alone).append(e.end - e.start)
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")
    return median(alone), median(together)


def record_timelines(rank, world_size, schedules, micro_batch_counts, *, hidden_dim, num_layers, batch_size,
                     num_steps=2, warmup=1, seed=0, dtype=torch.float32, layouts=None):
    """{(schedule name, m): this stage's StepRecord of each timed step} for each schedule in `schedules`
    ({name: schedule}) and each micro-batch count, after `warmup` untimed steps, the variants in turns (step 0 of
    each, then step 1 of each, ...). Every step starts after a barrier, so all stages start together; times are perf_counter seconds (one clock per machine).
    `layouts` ({name: (num_virtual, split)}) gives a schedule v pieces per rank and records B and W apart."""
    layouts = layouts or {}
    for name in schedules:
        v, _ = layouts.get(name, (None, False))
        for m in micro_batch_counts:
            if v is None:
                check_sizes(num_layers, world_size, batch_size, m)
            else:
                check_virtual_sizes(num_layers, world_size, v, batch_size, m)
    batch = make_batch(batch_size, hidden_dim, seed, 0, dtype)
    stages = {}
    for name in schedules:
        v, split = layouts.get(name, (None, False))
        stage = (build_stage(rank, world_size, hidden_dim, num_layers, seed, dtype) if v is None
                 else build_pieces(rank, world_size, v, hidden_dim, num_layers, seed, dtype))
        stages[name] = stage, make_optimizer(stage.parameters(), "sgd"), split
    timelines = {(name, m): [] for name in schedules for m in micro_batch_counts}
    for step in range(warmup + num_steps):  # the variants in turns (utils.bench): a change in load hits them alike
        for name, schedule in schedules.items():
            stage, opt, split = stages[name]
            for m in micro_batch_counts:
                dist.barrier()
                elapsed = stopwatch()
                with record_step(stage, split=split) as record:
                    schedule(stage, batch, m)
                record.waited = elapsed().waited
                opt.step()
                opt.zero_grad()
                if step >= warmup:
                    timelines[name, m].append(record)
    return timelines


# ---------------------------------------------------------------- schedules as tables (notebook 11)

def gpipe_order(stage, num_stages, num_micro_batches):
    """GPipe on `stage`: (kind, micro-batch) of every forward, then of every backward."""
    return [("F", i) for i in range(num_micro_batches)] + [("B", i) for i in range(num_micro_batches)]


def one_f_one_b_order(stage, num_stages, num_micro_batches):
    """1F1B on `stage`: p - s - 1 warm-up forwards, then a forward and a backward in turn, then the rest."""
    warmup = min(num_stages - stage - 1, num_micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, num_micro_batches):
        order += [("F", i), ("B", i - warmup)]
    return order + [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]


def zb_h1_order(stage, num_stages, num_micro_batches):
    """ZB-H1 on `stage`: 1F1B's forwards and input gradients B, and each weight gradient W run `stage` places
    late (after the B of micro-batch i + stage): the last stage's W fill the cool-down it spent idle in 1F1B,
    and no stage holds more than p micro-batches (1F1B's first stage)."""
    order, done = [], 0
    for kind, i in one_f_one_b_order(stage, num_stages, num_micro_batches):
        order.append((kind, i))
        if kind == "B" and i >= stage:
            order.append(("W", done))
            done += 1
    return order + [("W", i) for i in range(done, num_micro_batches)]


def interleaved_order(rank, num_stages, num_virtual, num_micro_batches):
    """Interleaved 1F1B on `rank` (Megatron-LM's order): (kind, chunk, micro-batch), chunk k being piece
    rank + k * p. Forwards take micro-batches in groups of p, chunk 0 to v-1; backwards chunk v-1 to 0.
    Warm-up: (p - rank - 1) * 2 + (v - 1) * p forwards. With one piece per rank, it is 1F1B."""
    p, v, m = num_stages, num_virtual, num_micro_batches
    check_virtual_sizes(p * v, p, v, m, m, groups=v > 1)
    if v == 1:
        return chunked(one_f_one_b_order)(rank, p, v, m)

    def unit(k, backward):
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [("F", *unit(k, False)) for k in range(warmup)]
    for k in range(warmup, total):
        order += [("F", *unit(k, False)), ("B", *unit(k - warmup, True))]
    return order + [("B", *unit(k, True)) for k in range(total - warmup, total)]


def chunked(order):
    """A one-piece table (gpipe_order, one_f_one_b_order, zb_h1_order) as interleaved_order's: (rank, p, v, m) ->
    [(kind, chunk 0, micro-batch)]."""
    return lambda rank, num_stages, num_virtual, m: [(kind, 0, i) for kind, i in order(rank, num_stages, m)]


def idle_slots(orders, num_virtual=1, durations=None):
    """Play the tables `orders` (one per rank: (kind, micro-batch) or (kind, chunk, micro-batch)) with
    computations of fixed length (default F = B = W = 1, and B = 2 for a backward not split) and free
    hand-offs. Returns (slots each rank computed, the step's length): the exact bubble, in slots."""
    split = any(a[0] == "W" for order in orders for a in order)
    durations = durations or {"F": 1, "B": 1 if split else 2, "W": 1}
    timelines, _ = play(orders, num_virtual, lambda kind, piece, i: durations[kind])
    busy = [sum(durations[kind] for kind, _, _, _, _ in timeline) for timeline in timelines]
    return busy, max(end for timeline in timelines for *_, end in timeline)


def play(orders, num_virtual=1, seconds=None, hand_off=0.0, one_way_at_a_time=False):
    """Play the tables `orders` (one per rank, in the order the rank runs them: (kind, micro-batch) or (kind,
    chunk, micro-batch); piece = rank + chunk p) on a clock: each computation lasts `seconds(kind, piece,
    micro-batch)`, and starts once the one before it on its rank has ended and what it needs has arrived. F of
    piece j needs F of piece j - 1; B of piece j needs B of piece j + 1 (the last piece's, its own F); W follows
    its B on the rank (on a piece whose table has no B, as the first piece's recorded W, the B of the piece after).
    A computation whose result a neighbour needs then sends it: the message holds the sender `hand_off` seconds
    (a send waited for, as Megatron-LM's schedules do and the planner counts it) and arrives when it ends;
    `hand_off` is one number, or one per boundary (entry j between pieces j and j + 1: a link between nodes).
    With `one_way_at_a_time`, a boundary carries one message at a time: an activation and a gradient crossing it
    together take turns (two ranks whose one connection carries one direction at a time, as a gloo pair does:
    utils.cluster.duplex; the sender waits for its turn).
    Computations are played in the order they end, so turns are taken first come, first served.
    Returns (timelines, sends): per rank, (kind, chunk, micro-batch, start, end) in the order run, and the
    (start, end) of each of its sends. A table that waits for something that never runs first: a ValueError."""
    p = len(orders)
    orders = [[a if len(a) == 3 else (a[0], 0, a[1]) for a in order] for order in orders]
    seconds = seconds or (lambda kind, piece, i: 1)
    last_piece = p * num_virtual - 1
    has_b = {r + chunk * p for r, order in enumerate(orders) for kind, chunk, _ in order if kind == "B"}
    arrived, free, nxt, link_free = {}, [0] * p, [0] * p, {}
    timelines, sends = [[] for _ in range(p)], [[] for _ in range(p)]

    def ready_at(r):  # when rank r's next computation can start, or None while what it needs has not arrived
        kind, chunk, i = orders[r][nxt[r]]
        piece = r + chunk * p
        need = {"F": ("F", piece - 1), "B": ("B", piece + 1),
                "W": ("B", piece) if piece in has_b else ("B", piece + 1)}[kind]
        if kind == "B" and piece == last_piece:
            need = ("F", piece)
        if kind == "F" and piece == 0 or kind == "W" and need[1] > last_piece:
            return free[r]
        return None if need + (i,) not in arrived else max(free[r], arrived[need + (i,)])

    while any(nxt[r] < len(orders[r]) for r in range(p)):
        starts = {r: ready_at(r) for r in range(p) if nxt[r] < len(orders[r])}
        ends = {r: start + seconds(orders[r][nxt[r]][0], r + orders[r][nxt[r]][1] * p, orders[r][nxt[r]][2])
                for r, start in starts.items() if start is not None}
        if not ends:
            raise ValueError("the tables deadlock: some computation waits for one that never runs first ("
                             + "; ".join(f"rank {r} at {orders[r][nxt[r]][0]}{orders[r][nxt[r]][2]}.{orders[r][nxt[r]][1]}"
                                         for r in range(p) if nxt[r] < len(orders[r])) + ")")
        r = min(ends, key=lambda r: (ends[r], r))
        (kind, chunk, i), start, end = orders[r][nxt[r]], starts[r], ends[r]
        piece = r + chunk * p
        free[r] = end
        timelines[r].append((kind, chunk, i, start, end))
        boundary = piece if kind == "F" else piece - 1  # the boundary its result crosses
        sends_result = (kind == "F" and piece < last_piece or kind == "B" and piece > 0) and p > 1
        if sends_result and (h := _boundary(hand_off, boundary)):
            begin = max(end, link_free.get(boundary, 0)) if one_way_at_a_time else end
            free[r] = link_free[boundary] = begin + h
            sends[r].append((begin, free[r]))
        arrived[kind, piece, i] = free[r]
        nxt[r] += 1
    return timelines, sends


def _boundary(hand_off, j):
    return hand_off[j] if isinstance(hand_off, (tuple, list)) else hand_off


def formula_idle_share(schedule, num_stages, num_micro_batches, num_virtual=1):
    """The idle share of a step with unit computations (F = B = W): GPipe and 1F1B (p-1)/(m+p-1);
    interleaved (p-1)/(v m + p-1); ZB-H1 fills W into the cool-down: (p-1)/(3m + p-1)."""
    p, m, v = num_stages, num_micro_batches, num_virtual
    return {"GPipe": (p - 1) / (m + p - 1), "1F1B": (p - 1) / (m + p - 1),
            "interleaved": (p - 1) / (v * m + p - 1), "ZB-H1": (p - 1) / (3 * m + p - 1)}[schedule]


def idle_by_rank(events_by_stage):
    """Each rank's idle share of one step: 1 - (time it computed) / (the step's span, over all ranks)."""
    t0 = min(e.start for stage in events_by_stage for e in stage)
    span = max(e.end for stage in events_by_stage for e in stage) - t0
    return [1 - sum(e.end - e.start for e in stage) / span for stage in events_by_stage]
