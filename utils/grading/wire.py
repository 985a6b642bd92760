"""Messages on the wire, counted by the kernel: what a check's ranks sent, which no code in them can lower.

    before = wire.counters()          # in the checking process, in the sandbox's own network namespace
    ...                               # a check cell: its ranks talk over loopback
    sent = wire.since(before)         # TCP segments sent with new data since `before`

In bubblewrap's sandbox (--unshare-net) a submission has a network namespace of its own, with only loopback, and
the kernel keeps that namespace's TCP counters (/proc/net/netstat, as a process in it sees it). The checking
process, where no student code runs, reads them around each cell. Whatever any process of the submission sends
over TCP counts: a rank, a child it forks, a socket or a process group it opens of its own; a student's code can
add to the count, never take from it. The counter is TcpExt TCPOrigDataSent, the TCP segments that carried new
data (retransmissions excluded). On loopback (64 KB segments; gloo sets TCP_NODELAY) that is about one per message
below 64 KB, so it says how many messages the ranks exchanged, which is what a method changes: in notebook 01's
check of the ring reduce-scatter, the ring from isend/irecv sends 456 segments, the same values through
dist.all_reduce 1008, through dist.all_gather and a sum 696. The solutions' own counts are stable: two graded runs
of each of the 13 notebooks gave every exercise the same count within 0.5% (01's ring all-reduce, 14,650 and
14,725, its cells' large tensors), 0.25% elsewhere, most of them to the segment. SLACK leaves room for honest
answers that communicate a little differently, and for segmentation under load.

Why this count. Per-socket counts from the kernel's socket table (who sent how much to whom: a ring talks to one
neighbour) would need the sockets alive when read; a socket's counters go with it when its rank ends (a fork's,
sooner), so the ranks would have to be held open for the reading, and a socket the student's code opens and
closes would be missed, where the namespace's count holds every socket, whoever opened it. A relay process that
carried every message would count calls exactly, at the price of a process group of the grader's own (a backend,
or a proxy parsing gloo's framing) and a hop per message; this costs one file read before and after a cell.
Bytes are not used: the IP counters hold headers and acknowledgements too, whose number varies from run to run
(59,140 to 59,532 octets in three runs of the check above), and at the checks' sizes (tensors of tens of elements)
a message's headers outweigh its payload. Connections opened (Tcp ActiveOpens) are not compared either: a connect
retried while the store starts counts again.

The verdict compares with the solution's run of the same cells in a sandbox of its own (utils.grading.command.
reference_run): more than SLACK times its segments (plus ALLOWANCE) is not the exercise's method. Outside a
private namespace (no bwrap) the counters are the machine's, shared with everything else: nothing is compared, and
the grader's warning says so.
"""
SLACK = 1.25  # times the reference's segments, plus ALLOWANCE: honest variations, and segmentation under load
ALLOWANCE = 16


def counters():
    """TCP segments sent with new data in this process's network namespace, or None where the kernel does not say
    (not Linux)."""
    try:
        with open("/proc/net/netstat") as f:
            head, values = [line.split() for line in f if line.startswith("TcpExt:")]
        return int(values[head.index("TCPOrigDataSent")])
    except (OSError, ValueError):
        return None


def since(before):
    """What the counter rose by since `before` (None if either reading is)."""
    now = counters()
    return None if before is None or now is None else now - before


def added(total, sent):
    """A running total of segments plus one cell's (None, outside the sandbox, adds nothing)."""
    return total if sent is None else (total or 0) + sent


def too_much(student, reference):
    """Why the student's checks sent more segments than the reference's (a message), or None."""
    if student is None or reference is None or student <= SLACK * reference + ALLOWANCE:
        return None
    return (f"its checks' ranks sent {student} TCP segments (counted by the sandbox's kernel) where the reference's "
            f"send {reference}: it communicates in another way than the exercise asks (a collective it was to be "
            f"built without, messages of its own)")
