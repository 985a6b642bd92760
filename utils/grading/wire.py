"""Messages on the wire, counted by the kernel: what a check's ranks sent, which no code in them can lower.

    before = wire.counters()          # in the checking process, in the sandbox's own network namespace
    ...                               # a check cell: its ranks talk over loopback
    sent = wire.since(before)         # TCP segments sent with new data since `before`

In bubblewrap's sandbox (--unshare-net) a submission has a network namespace of its own, with only loopback, and the
kernel keeps that namespace's TCP counters (/proc/net/netstat, /proc/net/snmp, as this process sees them). The
checking process, where no student code runs, reads them around each cell. Every byte any process of the
submission sends over TCP counts, whoever sends it: a rank, a child it forks, a socket or a process group it opens
of its own; a student's code can add to them, never take away. The counter is TcpExt TCPOrigDataSent: the TCP
segments that carried new data (retransmissions excluded). On loopback
  (64 KB segments, TCP_NODELAY in gloo) that is about one per message gloo sends, whatever its size below 64 KB, so
  the count says how many messages the ranks exchanged, which is what a method changes: notebook 01's ring
  reduce-scatter from isend/irecv sends 456 segments in its check, the same values through dist.all_reduce 1008.
It was the same number in every run of a check here; a large tensor's writes can split differently, hence SLACK.
Connections opened (Tcp ActiveOpens) are not compared: a connect retried while the store starts counts again.

Bytes are not used: a ring's chunk and gloo's all-reduce's move about the same bytes, and the IP counters also hold
headers and acknowledgements, whose number varies from run to run. The verdict compares with the solution's run of
the same check cells, in the same sandbox (utils.grading.command.reference_run): more than SLACK times its
segments is not the exercise's method. Outside a private namespace (no bwrap) the counters
are the machine's, shared with everything else: nothing is compared (the grader's warning says so).
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
