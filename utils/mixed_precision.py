"""Notebook 06's helpers: number formats measured, the size and dtype rules, saved-activation bytes.

    format_rows()                     fp32, bf16, fp16 from torch.finfo, one FormatRow each
    underflow_share(g, dtype)         the share of a gradient's nonzero entries that become 0 in `dtype`
    update_is_lost(w, update, dtype)  w + update == w in `dtype` (the update is below half the spacing)
    running_sum_error(n, dtype)       a sum accumulated one value at a time in `dtype`, vs float64
    SavedActivations(model)           bytes autograd saves for backward, parameters left out
    check_dtype / check_loss_scale / check_recomputable: bad input fails before any rank starts
    one_thread()                      tiny tensors: one thread, no threads waiting on each other
    fsdp_runs_main, mixed_precision_reference, train_fsdp2_mixed_precision, fsdp2_memory_main
                                      section 4: mixed-precision FSDP, the reference, FSDP2, both trackers
    Recomputed, PeakSavedBytes, gpipe_saved_formula, gpipe_memory_main, equal_gradients
                                      section 5: recomputation in notebook 04's GPipe, peak saved bytes
    model_state_formulas, activation_bytes_per_parameter, measured_activation_bytes
                                      section 6: where the bytes go
"""
import contextlib
import copy
import dataclasses
import functools
import math

import torch
import torch.nn as nn

from utils import fsdp, pytorch_reference
from utils import pipeline as pp
from utils.bench import interleaved_samples
from utils.memory import FP32, MIXED, MemoryTracker, Saved, unpack
from utils.model import build_mlp, generator, local_batch, loss_fn, make_batch, step_batches, train

LOW_PRECISION = (torch.bfloat16, torch.float16)
DTYPES = (torch.float32, *LOW_PRECISION)
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def check_dtype(name, dtype, allowed=DTYPES):
    """`dtype`, if it is a torch.dtype among `allowed`: a TypeError or ValueError naming `name` otherwise."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {dtype!r}")
    if dtype not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {dtype}")
    return dtype


def check_loss_scale(name, value):
    """A loss scale is a power of two in float32's normal range: float32 holds it exactly (GradScaler keeps its
    scale in float32), and dividing a gradient by it is exact, so equal to GradScaler's multiplying by 1/scale."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number above 0, got {value}")
    if math.frexp(value)[0] != 0.5 or not 2.0**-126 <= value <= 2.0**127:
        raise ValueError(f"{name} must be a power of two from 2**-126 to 2**127, got {value}: float32, which "
                         f"GradScaler keeps its scale in, holds those exactly, and dividing a gradient by one is "
                         f"exact, so equal to GradScaler's multiplying by 1/scale (by 1000, say, they differ in the "
                         f"last bit)")
    return float(value)


def check_recomputable(module):
    """Recomputing a block only makes sense around a module with parameters to get gradients for."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"recompute wraps an nn.Module, got {type(module).__name__}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"recompute: {type(module).__name__} has no parameters that need a gradient: there is "
                         f"nothing to recompute for; wrap the blocks that hold the weights")
    return module


@dataclasses.dataclass
class FormatRow:
    name: str
    bits: int
    mantissa_bits: int  # stored fraction bits; precision is one more
    eps: float  # spacing just above 1.0
    max: float
    smallest_normal: float


def format_rows():
    rows = []
    for dtype in DTYPES:
        info = torch.finfo(dtype)
        rows.append(FormatRow(SHORT[dtype], info.bits, round(-math.log2(info.eps)), info.eps, info.max,
                              info.smallest_normal))
    return rows


def underflow_share(gradient, dtype):
    """The share of the gradient's nonzero entries that are exactly 0 once cast to `dtype`."""
    nonzero = gradient != 0
    return ((gradient.to(dtype) == 0) & nonzero).sum().item() / max(1, nonzero.sum().item())


def update_is_lost(weight, update, dtype):
    """Whether the update leaves the weight unchanged when both are held in `dtype`."""
    w = torch.tensor(weight, dtype=dtype)
    return bool((w + torch.tensor(update, dtype=dtype)) == w)


def running_sum_error(count, dtype, seed=0):
    """Relative error of a sum of `count` values in [0, 1), added one at a time into a `dtype` accumulator.

    (torch.sum of a bf16 tensor accumulates in fp32 internally: the drift is in running sums that are
    *stored* in low precision, as gradient accumulation or a reduction in bf16 are.)"""
    values = torch.rand(count, generator=generator(seed, 2, count), dtype=torch.float64)
    exact = values.sum().item()
    total = torch.zeros((), dtype=dtype)
    for v in values.to(dtype):
        total = total + v
    return abs(total.item() - exact) / exact


class SavedActivations:
    """Inside the block, count the bytes autograd saves for backward (each storage once), leaving out the
    model's parameters (they are stored anyway): the activation memory of one forward pass."""

    def __init__(self, model):
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)

    @property
    def nbytes(self):
        return sum(self.storages.values())


def activation_bytes_formula(batch_size, hidden_dim, num_layers, element_size, recompute):
    """What the course MLP's forward saves, per the formula: each layer gelu(x @ W.T) saves its input x (for
    W's gradient) and z = x @ W.T (for GELU's); the loss saves the output. Recomputing each layer keeps its
    input only. (L layers, B x h activations, e bytes each.)"""
    per_layer = 1 if recompute else 2
    return (per_layer * num_layers + 1) * batch_size * hidden_dim * element_size


@contextlib.contextmanager
def one_thread():
    """Run the block on one thread. The checks' tensors are tiny: with two threads on two busy cores, each op
    waits for the other thread (measured here: 5.8 s instead of 0.2 s for the step check)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 dot products in AVX-512; bf16 matrix tiles (AMX)


def cpu_bf16_flags():
    """{flag: whether this CPU has it} for the bf16 instructions, from /proc/cpuinfo (Linux); None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    return {flag: flag in flags for flag in BF16_FLAGS}


# ---------------------------------------------------------------- mixed-precision FSDP (section 4)
#
# Notebook 05's FSDP (utils.fsdp.build_fsdp_mlp) with the notebook's own pieces: the layers keep fp32 shards
# (the master weights the optimizer steps), all_gather_unit(shard, shape, param_dtype) gathers a copy cast to
# param_dtype, and the layer's autograd function computes in the gathered dtype and reduce-scatters its weight's
# gradient in the shard's dtype (fp32: FSDP2's reduce_dtype).

def fsdp_student(FSDPLinear, all_gather_unit, param_dtype):
    """The notebook's code as utils.fsdp's runs take it: all_gather_unit bound to `param_dtype`."""
    gather = functools.partial(all_gather_unit, param_dtype=param_dtype)
    return fsdp.Student(FSDPLinear=FSDPLinear, all_gather_unit=gather)


def fsdp_job(doubled=False):
    return fsdp.Job("fsdp", dtype=torch.float32, doubled=doubled)  # the shards (and the batches) in fp32


def fsdp_runs_main(rank, world_size, FSDPLinear, all_gather_unit, param_dtypes, sizes, fsdp2=True, doubled=False):
    """(a utils.fsdp.Run of the notebook's FSDP for each param_dtype, and with `doubled` one more step 0 in the first
    with every shard doubled between forward and backward (fsdp.Job's doubled: its gradients are what counts);
    FSDP2's run with a MixedPrecisionPolicy or None), on this rank."""
    student = functools.partial(fsdp_student, FSDPLinear, all_gather_unit)
    runs = [fsdp.train_and_record(rank, world_size, fsdp_job(), student(dtype), sizes) for dtype in param_dtypes]
    if doubled:
        runs.append(fsdp.train_and_record(rank, world_size, fsdp_job(doubled=True), student(param_dtypes[0]),
                                          dataclasses.replace(sizes, num_steps=1)))
    return runs, train_fsdp2_mixed_precision(rank, world_size, sizes) if fsdp2 else None


@dataclasses.dataclass
class Fsdp2Run:
    weights: list  # the full weights after the run (fp32)
    losses: list  # this rank's loss by step
    output_dtype: torch.dtype
    grad_dtypes: list  # the sharded gradients' dtypes


def train_fsdp2_mixed_precision(rank, world_size, sizes, param_dtype=torch.bfloat16, reduce_dtype=torch.float32):
    """PyTorch's FSDP2 with MixedPrecisionPolicy(param_dtype, reduce_dtype), AdamW, the course's batches."""
    model = pytorch_reference.fully_shard_mlp_mixed_precision(world_size, sizes.hidden_dim, sizes.num_layers,
                                                              sizes.seed, param_dtype, reduce_dtype)
    seen = {}

    def forward_backward(model, batch):
        output = model(batch)
        loss = loss_fn(output)
        loss.backward()
        seen.setdefault("output", output.dtype)
        seen.setdefault("grads", [p.grad.dtype for p in model.parameters()])
        return loss

    losses = train(model, torch.optim.AdamW(model.parameters(), **fsdp.ADAMW),
                   step_batches(sizes.batch_size, sizes.hidden_dim, sizes.seed, sizes.num_steps, rank, world_size,
                                torch.float32), forward_backward=forward_backward)
    weights = [p.full_tensor().detach().clone() for p in model.parameters()]
    return Fsdp2Run(weights, losses, seen["output"], seen["grads"])


@dataclasses.dataclass
class Reference:
    first_grads: list  # step 0's averaged gradients (fp32), whole
    local_grads: list  # step 0's gradients of each rank's slice alone (fp32), by rank
    weights: list  # the fp32 master weights after the run
    losses: list  # rank 0's loss by step


def mixed_precision_reference(sizes, world_size, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              doubled=False):
    """One process doing what mixed-precision FSDP does: each rank's slice through a `param_dtype` copy of the fp32
    master weights, each gradient cast to `reduce_dtype`, summed over the ranks and divided by N, AdamW on the
    master weights. With `doubled`, the copy's weights doubled between step 0's forward and backward
    (fsdp.doubled_between): what an FSDP that gathers again in backward computes when fsdp.Job's doubled doubles its
    fp32 shards (the same numbers: a power of two commutes with the casts)."""
    master = build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed, torch.float32)
    optimizer = torch.optim.AdamW(master.parameters(), **fsdp.ADAMW)
    first_grads, local_grads, losses = None, [], []
    for batch in step_batches(sizes.batch_size, sizes.hidden_dim, sizes.seed, sizes.num_steps, dtype=torch.float32):
        low = copy.deepcopy(master).to(param_dtype)
        total = [torch.zeros_like(p, dtype=reduce_dtype) for p in master.parameters()]
        for rank in range(world_size):
            low.zero_grad(set_to_none=True)
            loss = loss_fn(low(local_batch(batch, rank, world_size).to(param_dtype)))
            with fsdp.doubled_between(list(low.parameters()), doubled and first_grads is None):
                loss.backward()
            total = [t + p.grad.to(reduce_dtype) for t, p in zip(total, low.parameters())]
            if rank == 0:
                losses.append(loss.item())
            if first_grads is None:
                local_grads.append([p.grad.to(torch.float32) for p in low.parameters()])
        for p, t in zip(master.parameters(), total):
            p.grad = (t / world_size).to(torch.float32)
        if first_grads is None:
            first_grads = [p.grad.clone() for p in master.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return Reference(first_grads, local_grads, [p.detach().clone() for p in master.parameters()], losses)


def fsdp_bytes_per_step(calls):
    """{collective: bytes handed to it} in one step's calls (utils.intercept.Call; an all-gather's nbytes is its
    output's, a reduce-scatter's its output shard's)."""
    totals = {"all_gather": 0, "reduce_scatter": 0}
    for call in calls:
        for name in totals:
            if call.name.startswith(name):
                totals[name] += call.nbytes
    return totals


def fsdp2_memory_main(rank, world_size, sizes):
    """FSDP2 with MixedPrecisionPolicy(bf16, fp32) measured twice, on two steps alike (after a first that makes
    AdamW's state): ({group: bytes} at the course tracker's peak (utils.memory), {category: bytes} at
    FSDPMemTracker's peak, or the error FSDPMemTracker raised, as a string)."""
    built = _fsdp2_mixed_precision_built(world_size, sizes)
    batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, torch.float32), rank, world_size)
    _step(built, batch)
    with MemoryTracker(lambda: built.held, built.optimizer) as tracker:
        _step(built, batch)
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        theirs = FSDPMemTracker(built.model, built.optimizer)
        theirs.track_inputs((batch,))
        with theirs:
            _step(built, batch)
        peak = next(iter(theirs.get_tracker_snapshot("peak").values()))
        theirs = {str(getattr(k, "value", k)): v for k, v in peak.items()}
    except Exception as e:  # say what failed, in one line
        theirs = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return tracker.peak, theirs


# ---------------------------------------------------------------- where the bytes go (section 6)

def model_state_formulas():
    """{(precision, version): bytes per parameter on N ranks as a utils.memory.Formula}: fp32 Adam and the ZeRO
    paper's mixed precision (2 bf16 param + 2 bf16 grad + 12 fp32 master, momentum, variance)."""
    return {**{("fp32", v): f for v, f in FP32.items()}, **{("mixed", v): f for v, f in MIXED.items()}}


def activation_bytes_per_parameter(local_batch_size, hidden_dim, num_layers, element_size, recompute):
    """The saved activations of one rank's forward (activation_bytes_formula), per parameter of the model."""
    return activation_bytes_formula(local_batch_size, hidden_dim, num_layers, element_size, recompute) / (
        num_layers * hidden_dim**2)


def measured_activation_bytes(local_batch_size, hidden_dim, num_layers, dtype, recompute_layer=None, seed=0):
    """What autograd saves for one rank's forward of the course MLP in `dtype` (SavedActivations), each layer run
    as recompute_layer(layer, x) if given."""
    model = build_mlp(hidden_dim, num_layers, seed, dtype)
    x = make_batch(local_batch_size, hidden_dim, seed, 0, dtype)
    with SavedActivations(model) as saved:
        for layer in model.layers:
            x = layer(x) if recompute_layer is None else recompute_layer(layer, x)
        loss_fn(x)
    return saved.nbytes


def _fsdp2_mixed_precision_built(world_size, sizes):
    """FSDP2 with MixedPrecisionPolicy(bf16, fp32) as a utils.fsdp.Built (what the step runners take)."""
    model = pytorch_reference.fully_shard_mlp_mixed_precision(world_size, sizes.hidden_dim, sizes.num_layers,
                                                              sizes.seed)
    params = list(model.parameters())
    return fsdp.Built(model, torch.optim.AdamW(params, **fsdp.ADAMW), params, params, fsdp.Timeline(), [])


def build_versions(rank, world_size, versions, sizes, FSDPLinear=None, all_gather_unit=None):
    """{name: utils.fsdp.Built} for each (name, version): utils.fsdp's versions ("ddp", "zero-pytorch", "fsdp2"),
    the notebook's FSDP ("fsdp fp32", "fsdp bf16": param_dtype), or "fsdp2 mixed" (FSDP2 with a
    MixedPrecisionPolicy)."""
    built = {}
    for name, version in versions:
        if version == "fsdp2 mixed":
            built[name] = _fsdp2_mixed_precision_built(world_size, sizes)
        elif version.startswith("fsdp "):
            dtype = {"fsdp fp32": torch.float32, "fsdp bf16": torch.bfloat16}[version]
            built[name] = fsdp.build_version(fsdp_job(), fsdp_student(FSDPLinear, all_gather_unit, dtype), rank,
                                             world_size, sizes)
        else:
            built[name] = fsdp.build_version(fsdp.Job(version, dtype=torch.float32), fsdp.Student(), rank,
                                             world_size, sizes)
    return built


def _step(built, batch):
    loss_fn(built.model(batch)).backward()
    built.optimizer.step()
    built.optimizer.zero_grad()


def model_state_peaks_main(rank, world_size, versions, sizes, FSDPLinear=None, all_gather_unit=None):
    """{name: {group: bytes}} at the peak of a step (the second: AdamW's state exists from the first on), measured
    by utils.memory.MemoryTracker, for each (name, version) of build_versions."""
    batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, torch.float32), rank, world_size)
    peaks = {}
    for name, built in build_versions(rank, world_size, versions, sizes, FSDPLinear, all_gather_unit).items():
        _step(built, batch)
        with MemoryTracker(lambda held=built.held: held, built.optimizer) as tracker:
            _step(built, batch)
        peaks[name] = tracker.peak
    return peaks


def step_seconds_main(rank, world_size, versions, sizes, FSDPLinear=None, all_gather_unit=None, repeat=3):
    """{name: [seconds of each timed step, from the slowest rank]}, the versions timed in turns (utils.bench)."""
    batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, torch.float32), rank, world_size)
    built = build_versions(rank, world_size, versions, sizes, FSDPLinear, all_gather_unit)
    steps = {name: functools.partial(_step, b, batch) for name, b in built.items()}
    return interleaved_samples(steps, repeat=repeat, warmup=1)


# ---------------------------------------------------------------- recomputation in notebook 04's GPipe (section 5)
#
class Recomputed(nn.Module):
    """`layer`, run as recompute(layer, x): put around each layer of a stage, any schedule recomputes it."""

    def __init__(self, layer, recompute):
        super().__init__()
        self.layer, self.recompute = layer, recompute

    def forward(self, x):
        return self.recompute(self.layer, x)


class PeakSavedBytes:
    """Inside the block, the bytes autograd holds for backward at the worst moment: what SavedActivations counts
    (the model's parameters left out), but each saved tensor counted only while the graph keeps it (a
    utils.memory.Saved, as utils.pipeline.record_step counts micro-batches), so a backward
    that frees a micro-batch gives its bytes back. Each tensor's own bytes, once while any node holds it: a
    micro-batch is a view of the batch, and the recomputed input is the saved one, detached."""

    def __init__(self, model):
        self.parameters = {p.data_ptr() for p in model.parameters()}
        self.holders = {}  # (data pointer, bytes): how many saved tensors hold it now
        self.alive = self.peak = 0

    def pack(self, tensor):
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if key[0] in self.parameters:
            return Saved(tensor)
        if not self.holders.get(key):
            self.alive += key[1]
            self.peak = max(self.peak, self.alive)
        self.holders[key] = self.holders.get(key, 0) + 1
        return Saved(tensor, functools.partial(self.release, key))

    def release(self, key):
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.alive -= key[1]

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


def gpipe_saved_formula(micro_batch_size, hidden_dim, num_layers, is_last, num_micro_batches, element_size,
                        recompute):
    """Peak bytes a GPipe stage of `num_layers` layers saves, in units of one micro-batch's activation
    b h e: every micro-batch's activations stay until the backwards, so m times one micro-batch's: 2 per layer
    without recomputation (x and z), 1 with it (x), plus the loss's input on the last stage. With recomputation
    a stage that is not last also holds, in its first backward, the recomputed layer's z before the first
    micro-batch's inputs are freed: one more b h e. Returns (bytes, activations)."""
    per_micro_batch = (1 if recompute else 2) * num_layers + (1 if is_last else 0)
    activations = num_micro_batches * per_micro_batch + (1 if recompute and not is_last else 0)
    return activations * micro_batch_size * hidden_dim * element_size, activations


def gpipe_memory_main(rank, world_size, gpipe_step, recompute, micro_batch_counts, micro_batch_size, hidden_dim,
                      num_layers, seed=0, dtype=torch.float32):
    """{(m, recomputed): (peak saved bytes, this stage's gradients)} for one step of notebook 04's
    gpipe_step(stage, batch, m) with m micro-batches of `micro_batch_size` rows each (the batch grows with m),
    without and with recompute(layer, x) on every layer."""
    results = {}
    for m in micro_batch_counts:
        batch = make_batch(m * micro_batch_size, hidden_dim, seed, 0, dtype)
        for recomputed in (False, True):
            stage = pp.build_stage(rank, world_size, hidden_dim, num_layers, seed, dtype)
            if recomputed:
                stage.layers = nn.ModuleList(Recomputed(layer, recompute) for layer in stage.layers)
            with PeakSavedBytes(stage) as saved:
                gpipe_step(stage, batch, m)
            results[m, recomputed] = saved.peak, [None if p.grad is None else p.grad.clone()
                                                  for p in stage.parameters()]
    return results


def equal_gradients(ours, theirs):
    """Bit for bit; a missing gradient (None) equals only another missing one."""
    return len(ours) == len(theirs) and all(a is b if a is None or b is None else torch.equal(a, b)
                                            for a, b in zip(ours, theirs))
