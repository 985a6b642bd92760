"""Count communication: which torch.distributed calls a piece of code makes, and how many bytes.

    with record_communication() as log:
        ring_all_reduce(tensor)
    sent = bytes_sent(log)          # what this rank's send/isend calls handed to the network
    calls(log, "all_reduce")        # how many all-reduces

Each entry of the log is a `utils.intercept.Call` (name, nbytes, blocking, ...). Checks also use it
to forbid calls: `record_communication(forbid=utils.intercept.COLLECTIVES)` makes an exercise that must be built
from send/recv fail loudly if it calls dist.all_reduce instead.

`bytes_written()` is the other count: what the process really wrote to its sockets, so what gloo
sent on the wire, whatever the algorithm inside the collective.
"""
from utils.intercept import SENDS, intercept


def record_communication(forbid=()):
    """A context manager: the list of calls made in the block; a name in `forbid` raises instead."""
    return intercept(forbid=forbid)


def bytes_sent(log):
    """Bytes handed to send/isend (batch_isend_irecv calls isend for each send it batches)."""
    return sum(call.nbytes for call in log if call.name in SENDS)


def calls(log, *names):
    """How many calls in the log have one of these names ("all_gather" also counts all_gather_single, ...)."""
    return sum(1 for call in log if call.name.startswith(names))


def bytes_written():
    """Bytes this process has written so far, sockets included (so: what gloo sent). Linux only: None elsewhere."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return None
