"""Communication per group (notebook 12): every call of a composed run recorded with the mesh dimension it ran on and
the bytes it wrote to the sockets, and the vocabulary the compositions' guards share to refuse a call that would hang
or mix the ranks (a send to the wrong peer, a collective on the wrong group) before it runs."""
import contextlib
import traceback

import torch.distributed as dist

from utils.counting import bytes_written
from utils.intercept import intercept


@contextlib.contextmanager
def communication_by_group(groups, guard=None):
    """Record the block's communication calls (utils.intercept.Call), each with `.group`, the name of the group it
    ran on ("world" for the default group, "other" for a group not in `groups`), and `.wire`, the bytes this
    process wrote to its sockets while it ran (utils.counting.bytes_written; gloo's own traffic). `guard(call,
    arguments)`, if given, sees each call before it runs (and may refuse it: a wrong peer would hang the ranks)."""
    def name_of(group):
        group = dist.group.WORLD if group is None else group  # a mesh dimension that spans every rank is WORLD
        return next((name for name, g in groups.items() if g is group),
                    "world" if group is dist.group.WORLD else "other")

    def before(call, arguments):
        call.group, call.wire = name_of(arguments.get("group")), bytes_written()
        if guard is not None:
            guard(call, arguments)

    def after(call, arguments):
        call.wire = None if call.wire is None else bytes_written() - call.wire

    with intercept(before, after) as log:
        yield log


def bytes_per_group(log):
    """{group name: bytes written to the sockets} of a communication_by_group log."""
    totals = {}
    for call in log:
        totals[call.group] = totals.get(call.group, 0) + (call.wire or 0)
    return totals


def calls_per_group(log):
    """{(group name, collective): (calls, bytes handed to them)} of a communication_by_group log."""
    counts = {}
    for call in log:
        name = next((c for c in ("all_gather", "reduce_scatter", "all_reduce") if call.name.startswith(c)), call.name)
        calls, nbytes = counts.get((call.group, name), (0, 0))
        counts[(call.group, name)] = (calls + 1, nbytes + call.nbytes)
    return counts


def phase_marker(log, phases):
    """mark(phase): the calls made since the last mark are `phase`'s, as (collective, group name)."""
    start = [0]

    def mark(phase):
        phases[phase] = [(call.name, call.group) for call in log[start[0]:]]
        start[0] = len(log)
    return mark


PEER_NAMES = {"send": ("dst", "group_dst"), "isend": ("dst", "group_dst"), "recv": ("src", "group_src"),
              "irecv": ("src", "group_src")}


class CompositionMistake(AssertionError):
    """Raised on a rank, before a call that would hang or mix the ranks: the check turns it into its hint."""


def peer_of(name, arguments):
    """The global rank a send/recv talks to."""
    rank_key, group_key = PEER_NAMES[name]
    if arguments.get(group_key) is not None:
        return dist.get_global_rank(arguments.get("group") or dist.group.WORLD, arguments[group_key])
    return arguments.get(rank_key)


def raised_in(function, error, hint=""):
    """A CompositionMistake saying that the student's `function` raised `error`, and on which of its lines (the last
    frame of the traceback in a notebook's code), with `hint` or one of the usual causes: a library's error, said
    where the student's code caused it."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if ".ipynb" in f.filename]
    line = f", at `{frames[-1].line}`" if frames and frames[-1].line else ""
    text = str(error).splitlines()[0] if str(error) else ""
    if hint:
        pass
    elif "chunk_positions" in line and isinstance(error, IndexError):
        hint = (": ra.chunk_positions(seq_len, C) has one chunk per CONTEXT rank: C is the context group's size and "
                "the index its rank (dist.get_world_size / dist.get_rank of groups['context'])")
    elif "recv" in line and isinstance(error, RuntimeError):
        hint = (": the receive's buffer is not what the neighbour sends: the hidden states of this rank's tokens, "
                "float64, (micro-batch, this rank's chunk of positions, dim): nd.hidden_like(tokens, model.sizes); a "
                "gradient is shaped like the output it belongs to (torch.empty_like(y))")
    elif isinstance(error, KeyError):
        hint = ": groups is a dict keyed by the mesh's dimension names" if "group" in line else ""
    return CompositionMistake(f"{function} raised {type(error).__name__}: {text}{line}{hint}")
