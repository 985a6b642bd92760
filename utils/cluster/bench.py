"""The link, measured: the alpha-beta fit of a point-to-point message (notebook 01's), between two ranks inside a
node (its loopback) and between two nodes (the shaped link), against the configured rate.

What reaches the payload is less than the configured rate: tc counts whole Ethernet frames, and a full TCP
segment carries 1448 bytes of payload in 1514 (Ethernet 14, IP 20, TCP 20 with its 12 bytes of timestamps), so
at most 95.6% of the rate."""
from pathlib import Path

from utils.bench import format_bytes
from utils.cluster import network
from utils.cluster.network import ClusterError
from utils.cluster.run import run_for_json

SCRIPT = Path(__file__).with_name("ping_pong.py")
PAYLOAD_SHARE = 1448 / 1514  # TCP payload per Ethernet frame, full-sized segments
TOLERANCE = 0.10


def message_sizes(link, count=8, largest_seconds=0.25):
    """From four buckets (network.bucket_bytes, at least 16 KB) to what the link carries in `largest_seconds`,
    evenly on a log scale. Not smaller: a message's first bucketful leaves at once, so below a few buckets
    the time is not on the line alpha + size / beta."""
    smallest = max(1 << 14, 4 * network.bucket_bytes(link))
    largest = max(int(network.bits_per_second(link) / 8 * largest_seconds), 16 * smallest)
    return [int(smallest * (largest / smallest) ** (i / (count - 1))) for i in range(count)]


def fit_on(nodes, nproc_per_node, sizes):
    return run_for_json(nodes, nproc_per_node, SCRIPT, [str(s) for s in sizes], what="bench: the ping-pong")


def bench(link="1gbit", delay=None):
    """Fit alpha and beta inside a node and across the link; return both fits and the configured rate."""
    network.require_privileges()
    state = network.read_state()
    if state is None:
        state = network.up(2, link, delay, quiet=True)
        temporary = True
    else:
        temporary = False
        if state["nodes"] < 2:
            raise ClusterError("bench needs two nodes: `python -m utils.cluster down` first, or up --nodes 2")
        if (state["link"], state["delay"]) != (link, delay):
            print(f"note: measuring the cluster that is up (link {state['link']}, delay {state['delay']})")
    try:
        rate = network.bits_per_second(state["link"])
        sizes = message_sizes(state["link"])
        inside = fit_on(1, 2, sizes)
        across = fit_on(2, 1, sizes)
    finally:
        if temporary:
            network.down(quiet=True)
    report(state, rate, inside, across)
    return {"configured_bits": rate, "inside": inside, "across": across}


def report(state, rate, inside, across):
    latency = (state["delay"] + " one way" if state.get("latency_added") else
               "none added" + (" (no netem here)" if state["delay"] else ""))
    print(f"link: {state['link']} each way per node ({format_bytes(rate / 8)}/s); latency: {latency}")
    print(f"messages of {format_bytes(inside['sizes'][0])} to {format_bytes(inside['sizes'][-1])}, one way, "
          f"fitted to t = alpha + size / beta")
    for name, fit in (("inside a node (loopback)", inside), ("across the link", across)):
        print(f"  {name:26s} alpha {fit['alpha'] * 1e6:8.1f} us   beta {format_bytes(fit['beta'])}/s "
              f"({fit['beta'] * 8 / 1e6:.1f} Mbit/s)")
    share = across["beta"] * 8 / rate
    verdict = "within" if abs(share - 1) <= TOLERANCE else "NOT within"
    print(f"across the link: {share:.1%} of the configured rate, {verdict} {TOLERANCE:.0%} "
          f"(the payload's share of a full frame is {PAYLOAD_SHARE:.1%})")
    if state.get("latency_added"):  # where the kernel has netem (tests/test_cluster.py fakes it)
        configured = network.seconds_of(state["delay"])
        extra = across["alpha"] - inside["alpha"]  # the software's own latency is the same inside and across
        verdict = "within" if abs(extra / configured - 1) <= TOLERANCE else "NOT within"
        print(f"added latency: configured {configured * 1e6:.0f} us, fitted {extra * 1e6:.0f} us more than inside a "
              f"node ({extra / configured:.0%}), {verdict} {TOLERANCE:.0%}")
