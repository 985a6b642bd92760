"""Count communication: which torch.distributed calls a piece of code makes, and how many bytes.

    with record_communication() as log:
        ring_all_reduce(tensor)
    sent = bytes_sent(log)          # what this rank's send/isend calls handed to the network

Checks also use it to forbid calls: `record_communication(forbid=COLLECTIVES)` makes an exercise
that must be built from send/recv fail loudly if it calls dist.all_reduce instead.
"""
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

SENDS = ("send", "isend")
RECEIVES = ("recv", "irecv")
COLLECTIVES = ("broadcast", "scatter", "gather", "reduce", "all_reduce", "all_gather", "all_gather_single",
               "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "barrier")


def tensor_bytes(x):
    """Bytes of a tensor, or of a list of tensors."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(t) for t in x)
    return 0


@contextlib.contextmanager
def record_communication(forbid=()):
    """Log (name, bytes of the first argument) for each call in the block; forbidden names raise."""
    log, depth = [], [0]

    def recorded(name, original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            if name in forbid:
                raise AssertionError(f"dist.{name} is not allowed here: build this from send and recv")
            if depth[0] == 0:  # only the outermost call: dist.send itself calls isend
                first = args[0] if args else next(iter(kwargs.values()), None)
                log.append((name, tensor_bytes(first)))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    # Patch both namespaces: user code calls dist.isend, and P2POp / batch_isend_irecv look the
    # functions up in distributed_c10d.
    saved = {name: getattr(c10d, name) for name in SENDS + RECEIVES + COLLECTIVES if hasattr(c10d, name)}
    try:
        for name, original in saved.items():
            wrapper = recorded(name, original)
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        yield log
    finally:
        for name, original in saved.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)


def bytes_sent(log):
    """Bytes handed to send/isend (batch_isend_irecv calls isend for each send it batches)."""
    return sum(nbytes for name, nbytes in log if name in SENDS)


def calls(log, name):
    return sum(1 for logged, _ in log if logged == name)
