"""Intercept torch.distributed: the one place that replaces its communication functions and puts them back.

    with intercept() as calls:
        ring_all_reduce(tensor)
    calls[0].name, calls[0].nbytes, calls[0].blocking, calls[0].waited_at

Every check that needs to know what code under test communicated, how many bytes, whether a
call was asynchronous and when its handle was waited for, or what memory was alive around a
collective, uses this module; `utils.counting` (bytes and call counts) and `utils.memory.MemoryTracker`
are built on it. Inside the block, each `torch.distributed` communication function is wrapped, in
both namespaces user code reaches (`dist.isend` and `distributed_c10d.isend`, which `P2POp` and
`batch_isend_irecv` use); on leaving the block, even by an exception, the functions that were there
before are put back. Blocks nest: the inner one wraps the outer one's wrappers and restores them.

Only the outermost call is logged: `dist.send` itself calls `dist.isend`.
"""
import contextlib
import dataclasses
import functools
import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

SENDS = ("send", "isend")
RECEIVES = ("recv", "irecv")
COLLECTIVES = ("broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "barrier")
COMMUNICATION = SENDS + RECEIVES + COLLECTIVES


@dataclasses.dataclass(eq=False)
class Call:
    """One communication call. `started_at` and `waited_at` are readings of the block's clock (by default
    the number of calls made so far): `waited_at` is when its handle's wait() (or get_future()) was first
    called, or when a blocking call returned; None while nobody has waited."""

    name: str
    nbytes: int  # of its first tensor argument (a list: the sum): what a send sends, what a collective is given
    blocking: bool
    started_at: object
    waited_at: object = None


class Handle:
    """An asynchronous call's work handle, which notes in its Call when someone first waits for it."""

    def __init__(self, work, call, clock):
        self._work, self._call, self._clock = work, call, clock

    def _waiting(self):
        if self._call.waited_at is None:
            self._call.waited_at = self._clock()

    def wait(self, *args, **kwargs):
        self._waiting()
        return self._work.wait(*args, **kwargs)

    def get_future(self):
        self._waiting()
        return self._work.get_future()

    def __getattr__(self, name):  # is_completed, exception, ...: the work's own
        return getattr(self._work, name)


def tensor_bytes(x):
    """Bytes of a tensor, or of a list of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(t) for t in x)
    return 0


@contextlib.contextmanager
def intercept(before=None, after=None, clock=None, forbid=(), names=COMMUNICATION):
    """Log every communication call made in the block (a list of Call, yielded).

    before(call, arguments) runs just before the call and after(call, arguments) just after it returns
    (`arguments`: the call's arguments by parameter name, e.g. arguments["tensor"]); `clock()` says
    when (default: how many calls so far); a name in `forbid` raises AssertionError instead."""
    log, depth = [], [0]
    clock = clock or (lambda: len(log))

    def wrap(name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(*args, **kwargs):
            if name in forbid:
                raise AssertionError(f"dist.{name} is not allowed here: build this from send and recv")
            if depth[0]:  # called by another communication function (send calls isend): not logged
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            arguments = bound.arguments
            blocking = name in ("send", "recv") or (name not in ("isend", "irecv")
                                                    and not arguments.get("async_op", False))
            record = Call(name, tensor_bytes(next(iter(arguments.values()), None)), blocking, clock())
            log.append(record)
            if before is not None:
                before(record, arguments)
            depth[0] += 1
            try:
                result = original(*args, **kwargs)
            finally:
                depth[0] -= 1
            if blocking:
                record.waited_at = clock()
            if after is not None:
                after(record, arguments)
            return Handle(result, record, clock) if result is not None and not blocking else result
        return call

    saved = {name: (getattr(c10d, name), getattr(dist, name)) for name in names if hasattr(c10d, name)}
    try:
        for name, (in_c10d, _) in saved.items():
            wrapper = wrap(name, in_c10d)
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        yield log
    finally:
        for name, (in_c10d, in_dist) in saved.items():
            setattr(c10d, name, in_c10d)
            setattr(dist, name, in_dist)
