"""Communication: the bytes each collective sends (notebook 01's counts) and its time on the link it crosses.

`message_seconds` and `collective_seconds` are the two primitives a replay of recorded steps uses (issue 42): one
cost model for the planner and the replay. The mesh is (pp, dp, cp, tp), tp innermost: a group whose ranks fit in
one node talks over the intra-node link (NVLink), any other over the inter-node one (InfiniBand).

What each term was checked against (the constants are the devices', describe.py):
    bandwidth in a node  0.8 of NVLink one way: 360 GB/s on an H100, where nccl-tests reach about 370 (NVIDIA/nccl
                         issue 1374); 240 on an A100, where they reach 208-235 (NVIDIA/nccl-tests issues 100, 178).
    latency per step     NCCL's own model for its Simple protocol (src/graph/tuning.cc): 3.4 us on NVLink, 14 us
                         across nodes, paid across nodes only nodes - 1 times in a ring (group_link).
    across nodes         one NIC's bandwidth per rank, 0.9 of it. Known limit: NCCL's ring enters and leaves each
                         node once, so a group with g ranks in each node uses g NICs ("~12 GB/s with each NIC, then ~24
                         when using 2 NICs", S. Jeaugey, NVIDIA/nccl issue 307; 256 H100s all-gather at 200 GB/s
                         of bus bandwidth, issue 1218). Priced so (g x 45 GB/s, up to NVLink's), the table moves away
                         from its sources: Narayanan et al.'s DeepSpeed 0.3 ZeRO-3 rows go from 0.88-1.00 to 1.25-2.23
                         and tensor parallel 16 across two nodes costs what 8 in one does; throughput within 15% falls
                         from 65 to 58 of 72 runs (megatron24 1.7B too, 1.05 to 1.15), layouts within 10% from 50 to
                         46 of 73, among those offered from 70 to 62 (the search takes t 16 across nodes for MT-NLG
                         and Llama 3's CP 16 run, t 2-4 with more data parallel for Megatron-LM's 18.4B to 70B; the
                         530B ZeRO-3 on 640 and torchtitan's 8B FSDP rows come within 10%). Not priced until those
                         rows have another explanation. What DeepSpeed 0.3.15 does (partition_parameters.py,
                         stage3.py at v0.3.15), which one NIC's bandwidth stands in for: every tensor gathered alone
                         (_allgather_param: torch.cuda.synchronize() first, so each pays a ring's whole latency,
                         NCCL's LL, 0.6 and 5 us a step, for the biases and norms); a third gather per layer,
                         recomputation's (its trace-based reuse, stage3_max_reuse_distance, needs the tracing that
                         failed: issue 1174);
                         each reduce-scatter a list (ProcessGroupNCCL copies the n inputs into one buffer: n kernels)
                         on a side stream that the next fetch's torch.cuda.synchronize() waits for: exposed. All of it
                         at one NIC predicts 0.50-0.69 of the six rows' throughput; at g NICs 0.90-1.08 for the 175B
                         and 1.23-1.25 for the 530B (35-48 s a step, a fifth of it, not found; not memory: 51 and
                         34 GB at 1120 and 2240 GPUs). Tensor parallel across nodes: Narayanan et al.'s Figure 13
                         (162.2B, 32 layers, hidden 20480, 64 GPUs, t x p = 64, batch 32 and 128: Megatron-LM's
                         examples/sc21/run_figure_13.sh) is the published test; at g NICs the planner puts t 16 x p 4
                         at 0.88-0.95 of t 8 x p 8's throughput, at one NIC 0.42-0.45. The figure's values are not
                         in the stored sources: recorded as runs, they decide between the two.
    not priced           NCCL's base latency per collective (6.6 us), its LL and LL128 protocols (less latency, less
                         bandwidth: kilobytes to a few megabytes), its tree all-reduce: all alpha terms together move
                         no published layout into or out of 10% (zeroed: 45 of 73 either way).
"""
from utils.planner.describe import Link

BACKENDS = ("ring", "gloo")


def message_seconds(nbytes, link):
    """One message of nbytes on a link: alpha + nbytes / beta (notebook 01)."""
    return link.alpha + nbytes / link.beta


def collective_bytes(op, world_size, size, backend="ring"):
    """Bytes each rank sends in one collective over world_size ranks, `size` the whole tensor (an all-reduce's
    input, an all-gather's output, a reduce-scatter's input, an all-to-all's input). Ring (notebook 01; NCCL):
    all-reduce 2(N-1)/N S, all-gather, reduce-scatter and all-to-all (N-1)/N S; a send S. Gloo, measured at the
    sockets in notebook 01: the same, except that its reduce-scatter all-reduces and keeps one chunk, 2(N-1)/N S."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if op == "send":
        return size
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n,
              "reduce_scatter": (2 if backend == "gloo" else 1) * (n - 1) / n}[op]
    return factor * size


def collective_seconds(op, world_size, size, link):
    """Alpha-beta time of a ring collective (notebook 01): all-reduce 2(N-1) alpha + 2(N-1)/N S / beta; all-gather,
    reduce-scatter, all-to-all (N-1) alpha + (N-1)/N S / beta; a send alpha + S / beta."""
    if world_size == 1 and op != "send":
        return 0.0
    if op == "send":
        return message_seconds(size, link)
    steps = 2 * (world_size - 1) if op == "all_reduce" else world_size - 1
    return steps * link.alpha + collective_bytes(op, world_size, size) / link.beta


def group_link(cluster, stride, size, ring=True):
    """The link a group of `size` ranks, `stride` apart on the mesh, runs at: intra-node when its ranks span at most
    one node's devices (inner axes first), inter-node otherwise. A collective across nodes runs as NCCL's ring, which
    enters and leaves each node once ("Ring Allreduce requires data to go through each GPU and enter/exit the node
    once", S. Jeaugey, NVIDIA/nccl issue 687): with g of the group's ranks in each node, of its size - 1 steps,
    size/g - 1 cross the network and the rest NVLink (NCCL's own latency model counts them so: src/graph/tuning.cc,
    nInterSteps = nNodes - 1 for an all-gather or reduce-scatter, 2 (nNodes - 1) for an all-reduce). Its alpha is
    the mean over those steps; ring False (a pipeline's sends between neighbours): the network's."""
    if stride * size <= cluster.devices_per_node:
        return cluster.intra
    per_node = cluster.devices_per_node // stride if stride < cluster.devices_per_node else 1
    if per_node <= 1 or not ring:
        return cluster.inter
    nodes = -(-size // per_node)
    alpha = ((size - nodes) * cluster.intra.alpha + (nodes - 1) * cluster.inter.alpha) / (size - 1)
    return Link(alpha, cluster.inter.beta)


def group_links(cluster, config):
    """{group: (size, link)} on the mesh (pp, dp, cp, tp), tp innermost; the data group is dp x cp, the expert
    group ep consecutive ranks of it."""
    c = config
    return {"tp": (c.tp, group_link(cluster, 1, c.tp)), "cp": (c.cp, group_link(cluster, c.tp, c.cp)),
            "ep": (c.ep, group_link(cluster, c.tp, c.ep)), "dp": (c.dp * c.cp, group_link(cluster, c.tp, c.dp * c.cp)),
            "pp": (c.pp, group_link(cluster, c.tp * c.cp * c.dp, c.pp, ring=False))}
