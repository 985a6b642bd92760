"""Notebook 06's helpers: number formats measured, the size and dtype rules, saved-activation bytes.

    format_rows()                     fp32, bf16, fp16 from torch.finfo, one FormatRow each
    underflow_share(g, dtype)         the share of a gradient's nonzero entries that become 0 in `dtype`
    update_is_lost(w, update, dtype)  w + update == w in `dtype` (the update is below half the spacing)
    running_sum_error(n, dtype)       a sum accumulated one value at a time in `dtype`, vs float64
    SavedActivations(model)           bytes autograd saves for backward, parameters left out
    check_dtype / check_loss_scale / check_recomputable: bad input fails before any rank starts
    one_thread()                      tiny tensors: one thread, no threads waiting on each other
"""
import contextlib
import dataclasses
import math

import torch

from utils.model import generator

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
    """A loss scale is a finite number above 0 (a power of two keeps scaling exact)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number above 0, got {value}")
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
