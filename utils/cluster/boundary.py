"""The node boundary, measured (notebook 01, section 8): on 2 nodes x 2 ranks of `utils.cluster`, the link between
the nodes shaped (tc), what crossing it costs, and whether the planner's link model predicts it.

One torchrun run (this file is its script; rank 0 prints the results as one line of JSON) measures:
- notebook 01's alpha-beta fit of a ping-pong inside a node (ranks 0 and 1, the loopback) and across (0 and 2);
- an all-reduce over groups inside the nodes ({0, 1} and {2, 3} at once), over groups across them ({0, 2} and
  {1, 3} at once: both ranks of a node cross its link together) and over all four ranks (gloo's ring 0-1-2-3);
- notebook 03's tensor-parallel pair (column then row parallel, forward and backward) on the same two layouts.
Every variant is timed in turns (utils.bench.interleaved_samples), and its bytes counted at rank 0's sockets
(bytes_on_the_wire) and at node 0's interface (bytes_leaving_node).

The planner is given the link, not assumed: inside a node, the loopback as the fit measured it (it has no
configured rate); across, the configured rate (the payload's share of it) and the latency the fit measured. Ranks
of a node that cross at once share its link: a ring's edges leaving a node (`streams`) divide the rate.
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from utils.bench import (bytes_on_the_wire, fit_alpha_beta, format_bytes, format_spread, interleaved_samples,
                         order_verdict, ping_pong_main, ratio_verdict, runs_needed, spread)
from utils.cluster import network
from utils.cluster.bench import PAYLOAD_SHARE
from utils.cluster.bench import message_sizes as sizes_for
from utils.cluster.run import run_for_json
from utils.launch import spawn, under_torchrun
from utils.model import layer_weight
from utils.planner.communication import collective_bytes, collective_seconds, message_seconds
from utils.planner.describe import Link
from utils.sequence_parallel import CopyToTensorParallelRegion, ReduceFromTensorParallelRegion
from utils.tensor_parallel import column_shard, row_shard

LINK = "100mbit"  # slow enough that the link, not the two shared cores, sets the time across
NODES, PER_NODE = 2, 2
PAIRS = {"inside": (0, 1), "across": (0, 2)}  # the ping-pong's two ranks
INSIDE_SIZES = [4 * 16**k for k in range(6)]  # bytes, 4 B ... 4 MB, section 6's; across: bench.message_sizes(link)
LAYOUTS = {"inside": [[0, 1], [2, 3]], "across": [[0, 2], [1, 3]], "world": [[0, 1, 2, 3]]}  # groups that run at once
ALL_REDUCE_SIZES = [256 * 2**10, 2 * 2**20]  # bytes
TP_BATCH_SIZE, TP_HIDDEN_DIM = 64, 1024  # float32: one all-reduce of 256 KB forward, one backward
FIT_TOLERANCE = 0.10  # the fitted bandwidth across, against the configured rate
PLANNER_TOLERANCE = 0.15  # the planner's time of a collective across the link, against the measured one
SCRIPT = Path(__file__)


# ---------------------------------------------------------------- on the ranks (under torchrun, on the cluster)

def my_group(rank, layout, groups):
    return next(group for ranks, group in zip(LAYOUTS[layout], groups[layout]) if rank in ranks)


def megatron_pair(x, column_weight, row_weight, group):
    """Notebook 03's tensor-parallel pair on `group`: gelu(column parallel), then gelu(row parallel); one all-reduce
    forward (the row layer's partial sums), one backward (x's gradient)."""
    h = F.gelu(CopyToTensorParallelRegion.apply(x, group) @ column_weight.T)
    return F.gelu(ReduceFromTensorParallelRegion.apply(h @ row_weight.T, group))


def tensor_parallel_pass(rank, layout, groups, batch_size, hidden_dim):
    """A forward and backward of the pair on this rank's group of `layout`, as a function of no arguments."""
    group = my_group(rank, layout, groups)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    weights = [shard(layer_weight(hidden_dim, 0, i, torch.float32), me, size).clone().requires_grad_()
               for i, shard in enumerate((column_shard, row_shard))]
    x = torch.randn(batch_size, hidden_dim, generator=torch.Generator().manual_seed(0)).requires_grad_()
    return lambda: megatron_pair(x, *weights, group).sum().backward()


def bytes_leaving_node(fn):
    """Bytes that left this rank's node through its link during one fn() (the interface's counter: Ethernet frames,
    headers and the acknowledgements of what came in included). Every rank calls it together."""
    counter = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics" / "tx_bytes"
    dist.barrier()  # what came before has arrived everywhere, so it has left
    before = int(counter.read_text())
    dist.barrier()  # and no rank of the node sends before the count is read
    fn()
    dist.barrier()
    return int(counter.read_text()) - before


def boundary_main(rank, world_size, message_sizes, all_reduce_sizes, batch_size, hidden_dim, repeat):
    """message_sizes: {"inside": [bytes], "across": [bytes]}, the ping-pong's on each pair."""
    groups = {layout: [dist.new_group(ranks) for ranks in LAYOUTS[layout]] for layout in LAYOUTS}  # all, in order
    one_way = {where: ping_pong_main(rank, world_size, message_sizes[where], peers) for where, peers in PAIRS.items()}
    fits = {where: dict(zip(("alpha", "beta"), fit_alpha_beta(message_sizes[where], one_way[where])))
            for where in PAIRS}
    all_reduces = []
    for size in all_reduce_sizes:
        x = torch.zeros(size // 4)  # zeros: summed again and again, they stay what they are
        calls = {layout: (lambda g=my_group(rank, layout, groups): dist.all_reduce(x, group=g)) for layout in LAYOUTS}
        all_reduces.append({"size": size, "samples": interleaved_samples(calls, repeat),
                            "wire": {layout: bytes_on_the_wire(call) for layout, call in calls.items()},
                            "link": {layout: bytes_leaving_node(call) for layout, call in calls.items()}})
    passes = {layout: tensor_parallel_pass(rank, layout, groups, batch_size, hidden_dim)
              for layout in ("inside", "across")}
    return {"message_sizes": message_sizes, "one_way": one_way, "fits": fits, "all_reduce": all_reduces,
            "tensor_parallel": {"batch_size": batch_size, "hidden_dim": hidden_dim,
                                "samples": interleaved_samples(passes, repeat)}}


# ---------------------------------------------------------------- in the notebook: start it, read it

def why_not_here():
    """What stops this machine from building the nodes (and how to get it), or None."""
    if under_torchrun():
        return "skipped under torchrun: this cell starts nodes of its own (run it in the notebook)"
    missing = network.missing_privileges()
    return None if missing is None else f"cannot build the two nodes here: {missing}"


def check_sizes(inside_sizes, across_sizes, all_reduce_sizes, batch_size, hidden_dim, repeat):
    """A ValueError naming the argument, before any node is built."""
    for name, values, fewest, step in (("inside_sizes", inside_sizes, 2, 1), ("across_sizes", across_sizes, 2, 1),
                                       ("all_reduce_sizes", all_reduce_sizes, 1, 4)):  # a fit needs two points;
        if (not isinstance(values, (list, tuple)) or len(values) < fewest  # the bytes counted, whole float32
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 4 or v % step for v in values)):
            raise ValueError(f"{name} must be a list of at least {fewest} size(s) in bytes, each a whole number "
                             f"of at least 4" + (" and a multiple of 4 (float32)" if step == 4 else "")
                             + f", got {values!r}")
    for name, value in (("batch_size", batch_size), ("hidden_dim", hidden_dim), ("repeat", repeat)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive whole number, got {value!r}")
    if hidden_dim % PER_NODE:
        raise ValueError(f"hidden_dim {hidden_dim} must split evenly over a group of {PER_NODE} ranks")


def measure(link=LINK, inside_sizes=INSIDE_SIZES, across_sizes=None, all_reduce_sizes=ALL_REDUCE_SIZES,
            batch_size=TP_BATCH_SIZE, hidden_dim=TP_HIDDEN_DIM, repeat=runs_needed(len(LAYOUTS)), timeout=600.0):
    """Everything above on 2 nodes x 2 ranks (each timing `repeat` runs: enough to order the three layouts), on a
    cluster made for it (removed after, whatever happens: run's own try/finally) or on the one `up` made. The
    results, with the link's configured rate in bits per second; None, having said why, where the nodes cannot be
    built."""
    across_sizes = sizes_for(link) if across_sizes is None else across_sizes
    check_sizes(inside_sizes, across_sizes, all_reduce_sizes, batch_size, hidden_dim, repeat)
    reason = why_not_here()
    if reason:
        print(reason)
        return None
    state = network.read_state()
    if state is not None and state["link"] != link:
        print(f"note: measuring the cluster that is up (link {state['link']})")
        link = state["link"]
    params = dict(message_sizes={"inside": inside_sizes, "across": across_sizes}, all_reduce_sizes=all_reduce_sizes,
                  batch_size=batch_size, hidden_dim=hidden_dim, repeat=repeat)
    result = run_for_json(NODES, PER_NODE, SCRIPT, [json.dumps(params)], what="the node boundary", link=link,
                          timeout=timeout)
    return result | {"link": link, "configured_bits": network.bits_per_second(link)}


# ---------------------------------------------------------------- the planner, given the link

def streams(groups, per_node=PER_NODE):
    """The most ring edges (r_i -> r_i+1, around each group) that leave one node at once: they share its link. 0 when
    every group stays inside a node."""
    leaving = {}
    for ranks in groups:
        if len(ranks) < 2:
            continue
        for a, b in zip(ranks, ranks[1:] + ranks[:1]):
            if a // per_node != b // per_node:
                leaving[a // per_node] = leaving.get(a // per_node, 0) + 1
    return max(leaving.values(), default=0)


def planner_links(result):
    """The planner's two link levels, from the runs: intra the loopback's fit; inter the configured rate, of which a
    full TCP segment's payload is 95.6% (utils.cluster.bench.PAYLOAD_SHARE: headers, not a fit), with the latency
    the fit measured across."""
    inside, across = result["fits"]["inside"], result["fits"]["across"]
    return (Link(inside["alpha"], inside["beta"]),
            Link(across["alpha"], result["configured_bits"] / 8 * PAYLOAD_SHARE))


def layout_link(result, layout):
    """The link one ring step of `layout`'s groups runs at: intra inside a node; across, the inter link's rate shared
    by the streams that leave a node together."""
    intra, inter = planner_links(result)
    shared = streams(LAYOUTS[layout])
    return intra if shared == 0 else Link(inter.alpha, inter.beta / shared)


def predicted_all_reduce(result, layout, size):
    """The planner's time (communication.collective_seconds) of an all-reduce of `size` bytes on `layout`."""
    return collective_seconds("all_reduce", len(LAYOUTS[layout][0]), size, layout_link(result, layout))


def planner_bytes(layout, size):
    return collective_bytes("all_reduce", len(LAYOUTS[layout][0]), size, backend="gloo")


def within(predicted, measured, tolerance):
    return abs(predicted / measured - 1) <= tolerance


# ---------------------------------------------------------------- what the notebook prints

WHERE = {"inside": "inside a node", "across": "across nodes"}


def report_fits(result):
    rate = result["configured_bits"]
    print(f"link {result['link']} ({format_bytes(rate / 8)}/s each way per node); a ping-pong fitted to "
          f"t = alpha + size / beta")
    for where, fit in result["fits"].items():
        sizes = result["message_sizes"][where]
        print(f"  {WHERE[where]:13s} ({format_bytes(sizes[0])} to {format_bytes(sizes[-1])}): alpha "
              f"{fit['alpha'] * 1e6:4.0f} us, beta {format_bytes(fit['beta'])}/s ({fit['beta'] * 8 / 1e6:.0f} Mbit/s)")
    share = result["fits"]["across"]["beta"] * 8 / rate
    print(f"across: {share:.1%} of the configured rate, "
          f"{'within' if abs(share - 1) <= FIT_TOLERANCE else 'NOT within'} {FIT_TOLERANCE:.0%}")
    size, measured = result["message_sizes"]["across"][-1], result["one_way"]["across"][-1]
    predicted = message_seconds(size, planner_links(result)[1])
    print(f"the planner's message_seconds for {format_bytes(size)} across: {predicted * 1e3:.1f} ms, measured "
          f"{measured * 1e3:.1f} ms ({predicted / measured:.2f}x)")


def all_reduce_rows(result):
    """(size, layout, Spread of the measured seconds, the planner's seconds, the planner's bytes per rank, bytes at
    rank 0's sockets, bytes that left node 0) for every all-reduce measured."""
    return [(entry["size"], layout, spread(samples), predicted_all_reduce(result, layout, entry["size"]),
             planner_bytes(layout, entry["size"]), entry["wire"][layout], entry["link"][layout])
            for entry in result["all_reduce"] for layout, samples in entry["samples"].items()]


NAMES = {"inside": "2 ranks inside a node", "across": "2 ranks across nodes", "world": "4 ranks on 2 nodes"}


def report_all_reduce(result):
    """Each all-reduce: measured, the planner's time (and whether within PLANNER_TOLERANCE, across the link), and the
    bytes: per rank, what the planner counts against rank 0's sockets; per node, what left node 0 (in S, the
    tensor's size: headers and acknowledgements included)."""
    for entry in result["all_reduce"]:
        size = entry["size"]
        print(f"all-reduce of S = {format_bytes(size)}:")
        for _, layout, measured, predicted, want, wire, link in (r for r in all_reduce_rows(result) if r[0] == size):
            verdict = ("no target inside a node" if layout == "inside" else
                       f"{'within' if within(predicted, measured.median, PLANNER_TOLERANCE) else 'NOT within'} "
                       f"{PLANNER_TOLERANCE:.0%} of the median")
            print(f"  {NAMES[layout]:21s} {format_spread(measured):>24s}   planner {predicted * 1e3:5.1f} ms "
                  f"({predicted / measured.median:.2f}x the median, {predicted / measured.low:.2f}x the fastest run)")
            print(f"  {'':21s} {verdict}; rank 0 sent {wire / want:.2f}x the planner's bytes; {link / size:.2f} S "
                  f"left node 0")
        print("  " + order_verdict({NAMES[layout]: spread(s) for layout, s in entry["samples"].items()}))


def report_tensor_parallel(result):
    tp = result["tensor_parallel"]
    s = {layout: spread(samples) for layout, samples in tp["samples"].items()}
    activation = tp["batch_size"] * tp["hidden_dim"] * 4
    print(f"tensor-parallel pair (batch {tp['batch_size']}, hidden {tp['hidden_dim']}), forward and backward: "
          f"two all-reduces of {format_bytes(activation)}")
    for layout in s:
        print(f"  {WHERE[layout]:13s}: {format_spread(s[layout])}")
    print("  " + ratio_verdict("across", s["across"], "inside", s["inside"]))
    extra = 2 * sum(sign * collective_seconds("all_reduce", 2, activation, layout_link(result, layout))
                    for sign, layout in ((1, "across"), (-1, "inside")))
    print(f"  what crossing the link adds: measured {(s['across'].median - s['inside'].median) * 1e3:.1f} ms, "
          f"planner {extra * 1e3:.1f} ms")


if __name__ == "__main__":  # under torchrun, on the cluster: `measure` runs this
    results = spawn(boundary_main, int(os.environ["WORLD_SIZE"]), **json.loads(sys.argv[1]), timeout=540)
    if os.environ["RANK"] == "0":
        print(json.dumps(results[0]))
