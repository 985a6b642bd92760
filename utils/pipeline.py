"""Pipeline parallel (notebook 04): the stage split, a stage's layers, the training loop, PyTorch's pipelining.

Stage `s` of `p` holds a contiguous run of the course's MLP's layers (`stage_layers`), built from
`utils.model.layer_weight`: exactly the reference's weights. A schedule is a function

    schedule(stage, batch, num_micro_batches) -> the batch's loss on the last stage, None elsewhere

that runs one step's forwards and backwards on this rank (the student writes it); `train_pipeline`
runs it for several steps with an optimizer. A `Stage` also records, for the checks and the plots,
when each forward and backward of each micro-batch ran and how many micro-batches' activations it
holds at once (`alive`, counted from the tensors autograd saves, not from the schedule's lists).
"""
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from utils.counting import record_communication
from utils.sizes import check_int, divide
from utils.model import Layer, layer_weight, loss_fn, make_batch, make_optimizer


def check_sizes(num_layers, world_size, batch_size, num_micro_batches=1):
    """At least one layer per stage; equal micro-batches. Returns the micro-batch size."""
    num_layers, world_size = check_int("num_layers", num_layers), check_int("world_size", world_size)
    if world_size > num_layers:
        raise ValueError(f"world size {world_size} is more stages than num layers {num_layers}: "
                         f"every stage needs at least one layer")
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
    """This rank's layers of the MLP (parameters `layers.{k}.linear.weight`, k counting from 0 on each stage).

    Calling it runs the layers, like the MLP, and records each forward as ("F", micro-batch, start, end);
    each backward of its output is recorded as ("B", micro-batch, start, end). Micro-batches are numbered
    in the order of the forwards; `new_step()` starts the numbering again.
    """

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
        self.events, self.num_forwards, self.alive, self.peak_alive = [], 0, {}, 0
        self._backward = None  # (micro-batch, start time) of the backward running now
        # The first layer's weight gets its gradient last: the end of this stage's backward.
        self.layers[0].linear.weight.register_post_accumulate_grad_hook(self._backward_done)

    def new_step(self):
        self.events, self.num_forwards = [], 0

    def forward(self, x):
        micro_batch = self.num_forwards
        self.num_forwards += 1
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(self._pack(micro_batch), _unpack):
            for layer in self.layers:
                x = layer(x)
        self.events.append(("F", micro_batch, start, time.perf_counter()))
        if x.requires_grad:
            x.register_hook(lambda grad: self._backward_started(micro_batch))
        return x

    # What autograd saves for the backward (the layers' inputs, the GELUs' inputs) is packed into a
    # holder; it dies when the backward frees the graph. A micro-batch is alive while it has holders.
    def _pack(self, micro_batch):
        def pack(tensor):
            holder = _Saved(tensor)
            self.alive[micro_batch] = self.alive.get(micro_batch, 0) + 1
            self.peak_alive = max(self.peak_alive, len(self.alive))
            weakref.finalize(holder, self._release, micro_batch)
            return holder
        return pack

    def _release(self, micro_batch):
        self.alive[micro_batch] -= 1
        if not self.alive[micro_batch]:
            del self.alive[micro_batch]

    def _backward_started(self, micro_batch):
        self._backward = (micro_batch, time.perf_counter())

    def _backward_done(self, param):
        if self._backward is not None:
            micro_batch, start = self._backward
            self.events.append(("B", micro_batch, start, time.perf_counter()))
            self._backward = None


class _Saved:
    def __init__(self, tensor):
        self.tensor = tensor


def _unpack(holder):
    return holder.tensor


def build_stage(rank, world_size, hidden_dim, num_layers, seed=0, dtype=torch.float64):
    return Stage(rank, world_size, hidden_dim, num_layers, seed, dtype)


def weights(module):
    return [p.detach().clone() for p in module.parameters()]


def train_pipeline(rank, world_size, schedule, *, hidden_dim, num_layers, batch_size, num_steps,
                   num_micro_batches=1, optimizer="sgd", seed=0, dtype=torch.float64):
    """One rank's run of `num_steps` steps of `schedule`. Returns a dict: `weights` (this stage's, at the
    end), `grads` (step 0's), `losses` (by step; None except on the last stage), `logs` (each step's
    communication, from utils.counting), `events` (each step's), `peak_alive` (micro-batches)."""
    check_sizes(num_layers, world_size, batch_size, num_micro_batches)
    stage = build_stage(rank, world_size, hidden_dim, num_layers, seed, dtype)
    opt = make_optimizer(stage.parameters(), optimizer)
    run = {"grads": None, "losses": [], "logs": [], "events": []}
    for step in range(num_steps):
        batch = make_batch(batch_size, hidden_dim, seed, step, dtype)  # every stage knows the shapes
        stage.new_step()
        with record_communication() as log:
            loss = schedule(stage, batch, num_micro_batches)
        if run["grads"] is None:
            run["grads"] = [None if p.grad is None else p.grad.clone() for p in stage.parameters()]
        opt.step()
        opt.zero_grad()
        run["losses"].append(None if loss is None else float(loss))
        run["logs"].append(log)
        run["events"].append(stage.events)
    run["weights"], run["peak_alive"] = weights(stage), stage.peak_alive
    return run


# ---------------------------------------------------------------- PyTorch's pipelining, on the same model

def build_pytorch_schedule(rank, world_size, schedule_name, hidden_dim, num_layers, num_micro_batches, seed=0,
                           dtype=torch.float64):
    """(this stage's module, PyTorch's schedule) with PipelineStage and ScheduleGPipe or Schedule1F1B.

    PyTorch's schedules compute the loss of each micro-batch (a mean over its rows) and, with
    scale_grads=True (the default), divide the gradients by the number of micro-batches at the end:
    the full batch's gradients, as ours.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if schedule_name not in schedules:
        raise ValueError(f"schedule must be one of {list(schedules)}, got {schedule_name!r}")
    module = Stage(rank, world_size, hidden_dim, num_layers, seed, dtype)
    stage = PipelineStage(module, rank, world_size, torch.device("cpu"))
    return module, schedules[schedule_name](stage, num_micro_batches, loss_fn=lambda output, target: loss_fn(output),
                                            scale_grads=True)


def pytorch_step(module, schedule, batch):
    """One step's forwards and backwards; returns the batch's loss on the last stage (None elsewhere)."""
    module.new_step()
    if module.is_first:
        schedule.step(batch)
        return None
    losses = []
    target = torch.zeros(len(batch)) if module.is_last else None  # the loss ignores it
    schedule.step(target=target, losses=losses)
    return sum(loss.detach() for loss in losses) / len(losses) if module.is_last else None


def train_pytorch_pipeline(rank, world_size, schedule_name, *, hidden_dim, num_layers, batch_size, num_steps,
                           num_micro_batches=1, optimizer="sgd", seed=0, dtype=torch.float64):
    """PyTorch's run of the same training: returns {"weights": this stage's, "losses": by step}."""
    check_sizes(num_layers, world_size, batch_size, num_micro_batches)
    module, schedule = build_pytorch_schedule(rank, world_size, schedule_name, hidden_dim, num_layers,
                                              num_micro_batches, seed, dtype)
    opt = make_optimizer(module.parameters(), optimizer)
    losses = []
    for step in range(num_steps):
        loss = pytorch_step(module, schedule, make_batch(batch_size, hidden_dim, seed, step, dtype))
        opt.step()
        opt.zero_grad()
        losses.append(None if loss is None else float(loss))
    return {"weights": weights(module), "losses": losses}


# ---------------------------------------------------------------- bubbles

def bubble_fraction(num_stages, num_micro_batches):
    """The idle share of a step when every stage takes the same time per micro-batch: (p-1)/(m+p-1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def idle_fraction(events_by_stage):
    """1 - (time the stages computed) / (stages x the step's span), from one step's events of every stage."""
    events = [e for stage in events_by_stage for e in stage]
    span = max(e[3] for e in events) - min(e[2] for e in events)
    busy = sum(e[3] - e[2] for e in events)
    return 1 - busy / (len(events_by_stage) * span)


def record_timelines(rank, world_size, schedules, micro_batch_counts, *, hidden_dim, num_layers, batch_size,
                     num_steps=2, warmup=1, seed=0, dtype=torch.float32):
    """{(schedule name, m): this stage's events, one list per timed step} for each schedule in `schedules`
    ({name: schedule}) and each micro-batch count, after `warmup` untimed steps. Every step starts after a
    barrier, so all stages start together; times are perf_counter seconds (one clock per machine)."""
    for m in micro_batch_counts:
        check_sizes(num_layers, world_size, batch_size, m)
    stage = build_stage(rank, world_size, hidden_dim, num_layers, seed, dtype)
    opt = make_optimizer(stage.parameters(), "sgd")
    batch = make_batch(batch_size, hidden_dim, seed, 0, dtype)
    timelines = {}
    for name, schedule in schedules.items():
        for m in micro_batch_counts:
            timelines[name, m] = []
            for step in range(warmup + num_steps):
                stage.new_step()
                dist.barrier()
                schedule(stage, batch, m)
                opt.step()
                opt.zero_grad()
                if step >= warmup:
                    timelines[name, m].append(stage.events)
    return timelines
