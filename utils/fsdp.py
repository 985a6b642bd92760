"""ZeRO and FSDP (notebook 05): shards, the training loop, the memory tracker, PyTorch's ZeRO and FSDP2.

A unit is one layer. Its weight (h x h) is flattened, padded with zeros to a multiple of the world size,
and cut into N equal contiguous shards: rank r keeps shard r. Equal shards are what all-gather and
reduce-scatter need; the padding (fewer than N elements per unit) is never read back.

    flat weight:  [ w_0 w_1 ... w_{h*h-1} 0 0 ]        padded to N * ceil(h*h / N)
    shards:       [ rank 0 | rank 1 | ... | rank N-1 ]

Every run here is data parallel: rank r trains on its `local_batch` of each step's batch, and the
gradients are averaged over the ranks, so every version must reproduce `train_reference`.
"""
import contextlib
import functools
import math
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


from utils.model import (EACH_RANK_SAME_ROWS, build_mlp, layer_weight, local_batch, loss_fn, make_batch,
                         make_optimizer)
from utils.sizes import check_int, divide

CATEGORIES = ("parameters", "gradients", "optimizer state", "gathered")


def check_sizes(batch_size, world_size):
    """Data parallel: the batch splits evenly over the ranks (a weight need not: it is padded)."""
    return divide("batch_size", batch_size, "world_size", world_size, EACH_RANK_SAME_ROWS)


# ---------------------------------------------------------------- shards

def shard_numel(numel, world_size):
    """Elements per shard: ceil(numel / N), so that N shards cover the unit, padding included."""
    return math.ceil(check_int("numel", numel) / check_int("world_size", world_size))


def flat_padded(tensor, world_size):
    """The tensor flattened and padded with zeros to N * shard_numel elements (a copy only if padded)."""
    flat = tensor.detach().reshape(-1)
    padding = world_size * shard_numel(flat.numel(), world_size) - flat.numel()
    return F.pad(flat, (0, padding)) if padding else flat  # no padding: a view, no copy


def shard(tensor, rank, world_size):
    """Rank `rank`'s shard of a unit: its contiguous 1/N of the flat, padded tensor (a copy)."""
    return flat_padded(tensor, world_size).chunk(world_size)[rank].clone()


def unshard(flat, shape):
    """The unit from its gathered, padded flat form: drop the padding, restore the shape (a view)."""
    return flat[:math.prod(shape)].view(shape)


def free(tensor):
    """Give a gathered tensor's memory back now, as FSDP does: its storage shrinks to 0 bytes, whoever still
    refers to it (a view, the layer, the communication library). The tensor must not be read afterwards."""
    tensor.untyped_storage().resize_(0)


def gather_shards(shards_by_rank, shapes):
    """Full weights from every rank's shards (in the parent process, for the checks)."""
    return [unshard(torch.cat([shards[i] for shards in shards_by_rank]), shape) for i, shape in enumerate(shapes)]


def local(t):
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------- the models and the loop

class FSDPLayer(nn.Module):
    """gelu(x @ W.T), W kept only as this rank's shard, `self.shard`: the Parameter the optimizer steps.

    `self.gather(phase)` returns the full weight when FSDPLinear asks for it ("forward" or
    "backward"): all-gathered on demand, or taken from a prefetcher. Like FSDP's unsharded parameter,
    the layer keeps the weight it gathered last (`self.gathered`): until FSDPLinear frees it, it holds
    a whole unit of memory.
    """

    def __init__(self, FSDPLinear, weight, rank, world_size):
        super().__init__()
        self.FSDPLinear, self.shape = FSDPLinear, tuple(weight.shape)
        self.shard = nn.Parameter(shard(weight, rank, world_size))
        self.gather, self.gathered = None, None

    def forward(self, x):
        return F.gelu(self.FSDPLinear.apply(x, self.shard, self.gather))


def build_fsdp_mlp(FSDPLinear, all_gather_unit, rank, world_size, hidden_dim, num_layers, seed=0,
                   dtype=torch.float64, prefetcher=None):
    """The course's MLP, sharded: layer i keeps its shard; it gathers with all_gather_unit(shard, shape),
    or, given `prefetcher(shards, shapes)` (e.g. a Prefetcher with its cap bound), through its get(i, phase)."""
    layers = nn.ModuleList(FSDPLayer(FSDPLinear, layer_weight(hidden_dim, seed, i, dtype), rank, world_size)
                           for i in range(check_int("num_layers", num_layers)))
    if prefetcher is not None:
        gatherer = prefetcher([layer.shard for layer in layers], [layer.shape for layer in layers])
        gathers = [functools.partial(gatherer.get, i) for i in range(len(layers))]
    else:
        gathers = [functools.partial(_gather_on_demand, all_gather_unit, layer) for layer in layers]
    for layer, gather in zip(layers, gathers):
        layer.gather = functools.partial(_gather_and_keep, layer, gather)
    return nn.Sequential(*layers)


def _gather_on_demand(all_gather_unit, layer, phase):
    return all_gather_unit(layer.shard.detach(), layer.shape)


def _gather_and_keep(layer, gather, phase):
    layer.gathered = gather(phase)
    return layer.gathered


class DDPAdamW:
    """Plain data parallel for comparison: every rank holds everything; the step all-reduces each gradient."""

    def __init__(self, params):
        self.params = list(params)
        self.optimizer = make_optimizer(self.params, "adamw")

    def step(self):
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()


def train(rank, world_size, model, optimizer, stepped, *, hidden_dim, batch_size, num_steps, seed=0,
          dtype=torch.float64, watch=None, after_backward=None, track_step=1):
    """`num_steps` data parallel steps. `stepped`: the tensors the optimizer updates (shards, or whole
    weights). Returns (their gradients as the first optimizer step saw them, this rank's losses).

    Step `track_step` (the second: AdamW's state exists from the first step on) runs inside the
    context manager `watch` (e.g. a MemoryTracker), and calls `after_backward()` between its backward
    and its optimizer step."""
    check_sizes(batch_size, world_size)
    first_grads, losses = None, []

    def keep_first_gradients(opt, args, kwargs):
        nonlocal first_grads
        if first_grads is None:
            first_grads = [None if p.grad is None else local(p.grad).detach().clone() for p in stepped]

    handle = getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(keep_first_gradients)
    for step in range(num_steps):
        watched = step == track_step
        with watch if watch is not None and watched else contextlib.nullcontext():
            loss = loss_fn(model(local_batch(make_batch(batch_size, hidden_dim, seed, step, dtype), rank, world_size)))
            loss.backward()
            if after_backward is not None and watched:
                after_backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    handle.remove()
    return first_grads, losses


def build_fsdp2_mlp(world_size, hidden_dim, num_layers, seed=0, dtype=torch.float64):
    """The course's MLP under PyTorch's FSDP2: fully_shard on each layer, then on the root, CPU device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_mlp(hidden_dim, num_layers, seed, dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def zero_redundancy_optimizer(params):
    """PyTorch's ZeRO-1 (whole parameters assigned to ranks) around the course's AdamW; gradients averaged first."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class AveragingZero(ZeroRedundancyOptimizer):
        def step(self, closure=None):
            for p in self._all_params:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            return super().step(closure)

    defaults = make_optimizer([torch.zeros(1)], "adamw").defaults  # the course's hyperparameters
    return AveragingZero(params, torch.optim.AdamW, lr=defaults["lr"], weight_decay=defaults["weight_decay"],
                         foreach=False)


KINDS = ("ddp", "zero1", "zero2", "fsdp", "zero-pytorch", "fsdp2")


def build(kind, impl, rank, world_size, hidden_dim, num_layers, seed=0, dtype=torch.float64, cap=None):
    """(model, optimizer, the tensors it steps, this rank's parameters: the whole weights and/or its shards).

    `impl`: the notebook's classes and functions by name (Zero1AdamW, Zero2AdamW, FSDPLinear,
    all_gather_unit, Prefetcher). FSDP prefetches through impl["Prefetcher"] when `cap` is not None."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "fsdp":
        prefetcher = None if cap is None else functools.partial(impl["Prefetcher"], cap=cap)
        model = build_fsdp_mlp(impl["FSDPLinear"], impl.get("all_gather_unit"), rank, world_size, hidden_dim,
                               num_layers, seed, dtype, prefetcher)
    elif kind == "fsdp2":
        model = build_fsdp2_mlp(world_size, hidden_dim, num_layers, seed, dtype)
    else:
        model = build_mlp(hidden_dim, num_layers, seed, dtype)
    if kind in ("fsdp", "fsdp2"):
        optimizer = make_optimizer(model.parameters(), "adamw")
        return model, optimizer, list(model.parameters()), list(model.parameters())
    if kind == "zero-pytorch":
        optimizer = zero_redundancy_optimizer(model.parameters())
        return model, optimizer, list(model.parameters()), list(model.parameters())
    optimizer = {"ddp": DDPAdamW, "zero1": impl.get("Zero1AdamW"), "zero2": impl.get("Zero2AdamW")}[kind](
        model.parameters())
    stepped = list(getattr(optimizer, "shards", model.parameters()))
    return model, optimizer, stepped, list(model.parameters()) + (stepped if kind != "ddp" else [])


def run(rank, world_size, kind, impl, *, hidden_dim, num_layers, batch_size, num_steps, seed=0,
        dtype=torch.float64, cap=None):
    """One training run of `kind`, watched: its final weights (whole, or this rank's shards for FSDP), the
    gradients its optimizer saw first, the model state at the peak of step 1 and right after its backward,
    the gathered units alive at most, and the collectives step 1 called."""
    model, optimizer, stepped, params = build(kind, impl, rank, world_size, hidden_dim, num_layers, seed, dtype, cap)
    tracker = MemoryTracker(lambda: params, optimizer)
    after = {}

    def after_backward():
        after["state"] = tracker.now()[0]
        after["whole gradients"] = sum(p.grad is not None for p in model.parameters())

    first_grads, losses = train(rank, world_size, model, optimizer, stepped, hidden_dim=hidden_dim,
                                batch_size=batch_size, num_steps=num_steps, seed=seed, dtype=dtype,
                                watch=tracker, after_backward=after_backward)
    if kind == "fsdp2":
        weights = [p.full_tensor().detach().clone() for p in model.parameters()]
    else:  # FSDP: this rank's shards
        weights = [p.detach().clone() for p in model.parameters()]
    return dict(weights=weights, first_grads=first_grads, losses=losses, peak=tracker.peak,
                max_units=tracker.max_units, after_backward=after, calls=tracker.calls)


# ---------------------------------------------------------------- memory you can see

class MemoryTracker:
    """The peak, over a stretch of code, of the model state this rank holds, measured from live tensors.

    At every operation (a TorchDispatchMode) and at every collective it adds up the bytes of the
    distinct storages alive in four groups:
      parameters       the tensors in `params()` (the shards, or the whole weights)
      gradients        their .grad, and the input of a reduce-scatter while it runs
      optimizer state  every tensor in the optimizer's state
      gathered         the outputs of all-gathers not yet freed (finished or still in flight)
    A storage counts while anything at all refers to it (a local variable, a view, ctx, a list) and it
    has not been freed (`free`: its storage resized to 0 bytes), so a gathered unit that is never freed
    keeps counting. Use as `with tracker:`; read `peak` (bytes by
    group at the moment of the highest total), `max_units` (the most gathered storages alive at once)
    and `calls` (the collectives called, by name).
    """

    def __init__(self, params, optimizer):
        # the torch optimizer inside: ours keep it as .optimizer, PyTorch's ZeroRedundancyOptimizer as .optim
        self.params = params
        self.optimizer = getattr(optimizer, "optimizer", getattr(optimizer, "optim", optimizer))
        self.gathered, self.reducing, self.calls = [], [], []
        self.peak, self.max_units = None, 0

    def _storages(self):
        groups = {name: [] for name in CATEGORIES}
        for p in self.params():
            groups["parameters"].append(local(p).untyped_storage())
            if p.grad is not None:
                groups["gradients"].append(local(p.grad).untyped_storage())
        groups["gradients"] += self.reducing
        for state in self.optimizer.state.values():
            groups["optimizer state"] += [local(v).untyped_storage() for v in state.values()
                                          if isinstance(v, torch.Tensor)]
        groups["gathered"] = [s for ref in self.gathered if (s := ref()) is not None]
        return groups

    def now(self):
        """{group: bytes} held right now, each storage counted once (a view is its base), and the number of
        gathered storages alive."""
        seen, sizes, units = set(), dict.fromkeys(CATEGORIES, 0), 0
        for name, storages in self._storages().items():
            for s in storages:
                if s.nbytes() and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    sizes[name] += s.nbytes()
                    units += name == "gathered"
        return sizes, units

    def sample(self):
        sizes, units = self.now()
        self.max_units = max(self.max_units, units)
        if self.peak is None or sum(sizes.values()) > sum(self.peak.values()):
            self.peak = sizes

    def _watch(self, name, original):
        gathers = name.startswith("all_gather")

        @functools.wraps(original)
        def call(*args, **kwargs):
            self.calls.append(name)
            if name == "all_reduce":
                return original(*args, **kwargs)
            # all-gathers write their first argument (a tensor or a list); reduce-scatters read their second
            if gathers:
                buffers = args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list"))
            else:
                buffers = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
            buffers = buffers if isinstance(buffers, (list, tuple)) else [buffers]
            if gathers:
                self.gathered += [weakref.ref(t.untyped_storage()) for t in buffers]
            else:
                self.reducing = [t.untyped_storage() for t in buffers]
            self.sample()
            result = original(*args, **kwargs)
            self.sample()
            self.reducing = []  # done reading it (the caller may still hold it: then it counts there)
            return result
        return call

    def __enter__(self):
        names = [n for n in ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
                             "reduce_scatter_single", "reduce_scatter_tensor") if hasattr(c10d, n)]
        self._saved = {n: (getattr(c10d, n), getattr(dist, n)) for n in names}
        for n in names:
            wrapper = self._watch(n, self._saved[n][0])
            setattr(c10d, n, wrapper)
            setattr(dist, n, wrapper)
        self._mode = _SampleEveryOp(self)
        self._mode.__enter__()
        self.sample()
        return self

    def __exit__(self, *exc):
        self.sample()
        self._mode.__exit__(*exc)
        for n, (in_c10d, in_dist) in self._saved.items():
            setattr(c10d, n, in_c10d)
            setattr(dist, n, in_dist)
        return False


class _SampleEveryOp(TorchDispatchMode):
    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker.sample()  # after the op: its output is alive, its inputs too
        return out


def model_state_bytes(params, optimizer):
    """Bytes right now: {group: bytes} of the parameters, their gradients and the optimizer state."""
    return MemoryTracker(lambda: params, optimizer).now()[0]


def sharded_state_bytes(shard_numels, element_size):
    """What ZeRO-3 keeps between units: per shard, parameter + gradient + AdamW's two moments
    (4 x element_size per element), plus AdamW's `step` counter (a 4-byte float32 scalar) per shard."""
    return {"parameters": element_size * sum(shard_numels), "gradients": element_size * sum(shard_numels),
            "optimizer state": 2 * element_size * sum(shard_numels) + 4 * len(shard_numels)}


def formula_bytes(num_params, world_size):
    """Per-rank model state with Adam in fp32, Psi parameters, N ranks (16 bytes per parameter in all)."""
    psi, n = num_params, world_size
    return {"DDP": 16 * psi, "ZeRO-1": 8 * psi + 8 * psi / n, "ZeRO-2": 4 * psi + 12 * psi / n,
            "FSDP": 16 * psi / n}
