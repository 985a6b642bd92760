"""Memory you can see: the model state a rank holds, measured from the tensors alive (notebook 05).

    tracker = MemoryTracker(lambda: params, optimizer)
    with tracker:
        train_step()
    tracker.peak        # {group: bytes} at the moment of the highest total
    tracker.max_units   # the most all-gathers whose output is alive at once (gathered units)
    tracker.calls       # the communication calls made (utils.intercept.Call)

At every operation (a TorchDispatchMode) and around every collective (utils.intercept's `before` and
`after` hooks), it adds up the bytes of the distinct storages alive in four groups:
  parameters       the tensors in `params()` (shards, or whole weights)
  gradients        their .grad, and the input of a reduce-scatter while it runs
  optimizer state  every tensor in the optimizer's state
  gathered         the outputs of all-gathers not yet freed (finished or still in flight), and a list
                   all-gather's pieces put together (torch.cat), which belong to the same unit
A storage counts while anything at all refers to it (a local variable, a view, ctx, a list) and it
has not been freed (`utils.fsdp.free`: its storage resized to 0 bytes). Nothing is declared by the
code under test: a gathered unit that is never freed keeps counting.

`SettledMemoryTracker` also waits, after each all-gather, until gloo's own thread has let go of the
output (notebook 07, where Python's reference counting frees the gathered weights, not the code).
"""
import dataclasses
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from utils.intercept import intercept
from utils.tensor_parallel import local_part

GROUPS = ("parameters", "gradients", "optimizer state", "gathered")
# which argument of a collective holds the buffers it fills (all-gathers) or reads (reduce-scatters)
GATHER_OUTPUT = {"all_gather": "tensor_list", "all_gather_single": "output_tensor",
                 "all_gather_into_tensor": "output_tensor"}
SCATTER_INPUT = {"reduce_scatter": "input_list", "reduce_scatter_single": "input", "reduce_scatter_tensor": "input"}


def storages(x):
    """The storages of a tensor or of a list of tensors."""
    return [t.untyped_storage() for t in (x if isinstance(x, (list, tuple)) else [x])]


def inner_optimizer(optimizer):
    """The torch optimizer inside: ours keep it as .optimizer, PyTorch's ZeroRedundancyOptimizer as .optim."""
    return getattr(optimizer, "optimizer", getattr(optimizer, "optim", optimizer))


class MemoryTracker:
    """The peak model state over a stretch of code (see the module's docstring). `phase()`, if given,
    names the part of the step running now: `units_by_phase[phase]` is the most gathered buffers alive
    at once in it. `clock` is utils.intercept's: what `Call.started_at` and `Call.waited_at` read."""

    def __init__(self, params, optimizer, phase=None, clock=None):
        self.params, self.optimizer = params, inner_optimizer(optimizer)
        self.phase, self.clock = phase, clock
        self.gathered, self.reducing, self.calls = [], [], []
        self.gather_calls = {}  # storage data_ptr -> the Call of the all-gather that filled it last
        self.pieces = set()  # data_ptrs of a list all-gather's pieces, once put together: the result counts
        self.peak, self.max_units, self.units_by_phase = None, 0, {}

    def _storages(self):
        groups = {name: [] for name in GROUPS}
        for p in self.params():
            groups["parameters"].append(local_part(p).untyped_storage())
            if p.grad is not None:
                groups["gradients"].append(local_part(p.grad).untyped_storage())
        groups["gradients"] += self.reducing
        for state in self.optimizer.state.values():
            groups["optimizer state"] += [local_part(v).untyped_storage() for v in state.values()
                                          if isinstance(v, torch.Tensor)]
        groups["gathered"] = [s for ref in self.gathered  # a list's pieces put together: their result counts
                              if (s := ref()) is not None and s.data_ptr() not in self.pieces]
        return groups

    def now(self):
        """({group: bytes} held right now, each storage counted once (a view is its base), the number of
        all-gathers whose output is alive: gathered units)."""
        seen, sizes, units = set(), dict.fromkeys(GROUPS, 0), set()
        for name, group in self._storages().items():
            for s in group:
                if s.nbytes() and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    sizes[name] += s.nbytes()
                    if name == "gathered":  # a unit is an all-gather: a list's pieces are one
                        units.add(id(self.gather_calls.get(s.data_ptr())))
        return sizes, len(units)

    def sample(self):
        sizes, units = self.now()
        self.max_units = max(self.max_units, units)
        if self.phase is not None:
            phase = self.phase()
            self.units_by_phase[phase] = max(self.units_by_phase.get(phase, 0), units)
        if self.peak is None or sum(sizes.values()) > sum(self.peak.values()):
            self.peak = sizes

    def note_pieces_put_together(self, func, args, out):
        """torch.cat or torch.stack of one list all-gather's pieces (dist.all_gather fills a list): the result
        belongs to that gather's unit, as all_gather_single's one buffer would, and counts as gathered in the
        pieces' place (they are the code's temporaries, gone when it returns; gloo may hold them a moment more)."""
        if func not in (torch.ops.aten.cat.default, torch.ops.aten.stack.default) or not isinstance(out, torch.Tensor):
            return
        alive = {s.data_ptr() for ref in self.gathered if (s := ref()) is not None and s.nbytes()}
        pointers = {t.untyped_storage().data_ptr() for t in args[0]}
        calls = {id(self.gather_calls.get(p)) for p in pointers}
        if pointers <= alive and len(calls) == 1:
            result = out.untyped_storage()
            self.pieces = (self.pieces - {result.data_ptr()}) | pointers  # the result stands for the unit now
            self.gathered.append(weakref.ref(result))
            self.gather_calls[result.data_ptr()] = self.gather_calls[pointers.pop()]

    def _before(self, call, arguments):
        if call.name in GATHER_OUTPUT:
            outputs = storages(arguments[GATHER_OUTPUT[call.name]])
            self.pieces -= {s.data_ptr() for s in outputs}  # memory reused for a new gather's output
            self.gathered += [weakref.ref(s) for s in outputs]
            self.gather_calls.update((s.data_ptr(), call) for s in outputs)
        elif call.name in SCATTER_INPUT:
            self.reducing = storages(arguments[SCATTER_INPUT[call.name]])
        self.sample()

    def _after(self, call, arguments):
        self.sample()
        self.reducing = []  # done reading it (the caller may still hold it: then it counts there)

    def __enter__(self):
        self._intercepting = intercept(before=self._before, after=self._after, clock=self.clock)
        self.calls = self._intercepting.__enter__()
        self._mode = _SampleEveryOp(self)
        self._mode.__enter__()
        self.sample()
        return self

    def __exit__(self, *exc):
        try:
            self.sample()
        finally:
            self._mode.__exit__(*exc)
            self._intercepting.__exit__(*exc)
        return False


class Saved:
    """A tensor autograd saved for backward, as a saved_tensors_hooks pack returns it: an object of its own, so
    that `released()` runs when autograd lets go of it (after the backward that needed it). Unpack with `unpack`."""

    def __init__(self, tensor, released=None):
        self.tensor = tensor
        if released is not None:
            weakref.finalize(self, released)


def unpack(saved):
    return saved.tensor


class SettledMemoryTracker(MemoryTracker):
    """utils.memory.MemoryTracker, except that after each all-gather it waits (up to `patience` seconds) until
    gloo has dropped its own references to the output buffer.

    A blocking gloo collective returns as soon as its work is complete, but gloo's worker thread lets go of the
    work, which holds the output tensor, a moment later: measured here, after about 1 all-gather in 10 (4 ranks
    on 2 cores) the buffer was still referenced when the next all-gather started. Notebook 05 frees its
    gathered buffers by hand, so it never sees this; a parametrization leaves the freeing to Python's reference
    counting, and the count of gathered units alive would then depend on thread scheduling."""

    def __init__(self, *args, patience=2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.patience, self._before_call = patience, []

    @staticmethod
    def _use_count(storage):
        return torch._C._storage_Use_Count(storage._cdata)

    def _before(self, call, arguments):
        if call.name in GATHER_OUTPUT:
            outputs = storages(arguments[GATHER_OUTPUT[call.name]])
            self._before_call = [(s, self._use_count(s)) for s in outputs]
        super()._before(call, arguments)

    def _after(self, call, arguments):
        deadline = time.monotonic() + self.patience
        while any(self._use_count(s) > n for s, n in self._before_call) and time.monotonic() < deadline:
            time.sleep(0.0001)
        self._before_call = []
        super()._after(call, arguments)


class _SampleEveryOp(TorchDispatchMode):
    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker.note_pieces_put_together(func, args, out)
        self.tracker.sample()  # after the op: its output is alive, its inputs too
        return out


class _PeakOfNewTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.alive, self.peak = [], 0  # weak references to the storages the ops made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.alive += [weakref.ref(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor)]
        sizes = {s.data_ptr(): s.nbytes() for ref in self.alive if (s := ref()) is not None}
        self.peak = max(self.peak, sum(sizes.values()))  # each storage once: a view is its base
        return out


def peak_new_bytes(fn):
    """(fn's result, the most bytes alive at once, after any op, in tensors that fn's ops made): a function's
    working memory, measured. Its inputs do not count; a buffer a collective fills counts from the op that made it
    (torch.empty), and until nothing refers to it, gloo's work objects included."""
    with _PeakOfNewTensors() as mode:
        result = fn()
    return result, mode.peak


def model_state_bytes(params, optimizer):
    """Bytes right now: {group: bytes} of the parameters, their gradients and the optimizer state."""
    return MemoryTracker(lambda: params, optimizer).now()[0]


@dataclasses.dataclass
class Formula:
    """Per-rank model state in bytes per parameter: a whole-model part and a part divided by N."""

    whole: float
    sharded: float

    def bytes(self, num_params, world_size):
        return self.whole * num_params + self.sharded * num_params / world_size


# Adam, Psi parameters, N ranks. fp32: 4 param + 4 grad + 8 state. Mixed precision (the ZeRO paper):
# 2 bf16 param + 2 bf16 grad + 12 fp32 (master weight, momentum, variance).
FP32 = {"DDP": Formula(16, 0), "ZeRO-1": Formula(8, 8), "ZeRO-2": Formula(4, 12), "FSDP": Formula(0, 16)}
MIXED = {"DDP": Formula(16, 0), "ZeRO-1": Formula(4, 12), "ZeRO-2": Formula(2, 14), "FSDP": Formula(0, 16)}


def formula_bytes(num_params, world_size, formulas=FP32):
    """{version: bytes per rank} for Psi = num_params parameters on N = world_size ranks."""
    return {name: f.bytes(num_params, world_size) for name, f in formulas.items()}
