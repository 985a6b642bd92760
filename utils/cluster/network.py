"""The nodes and the link between them: one network namespace per node, each joined to one bridge by a veth
pair, the pair shaped by `tc`.

    root namespace:   dtfs-br (bridge) -- dtfs-h0, dtfs-h1, ...       (the host ends of the veth pairs)
    dtfs-node0:       lo (ranks inside the node) + dtfs-n0 10.213.0.1/24
    dtfs-node1:       lo                         + dtfs-n1 10.213.0.2/24

Bandwidth is shaped on the egress of both ends of every pair: what leaves node i is shaped on dtfs-n{i}, what
reaches it on dtfs-h{i}, like a full-duplex network card of that rate. Full duplex needs one thing more than a rate
limit: a node's egress carries its own data and its TCP acknowledgements of what it receives, and behind a deep
queue of data (a plain tbf's: 100 ms of the link) an acknowledgement waits for all of it, so each direction's sender
stalls while the other direction sends. A real card's queue is short, and its wire carries each direction on its
own. So the shaper is htb with two classes sharing the rate, pure acknowledgements first (as in the "wondershaper"
of the Linux Advanced Routing & Traffic Control HOWTO; segments with data, however small, keep their order).
Measured over 100mbit (utils.cluster.duplex), 128 KB each way at once on two gloo pairs: 15.8-18.1 ms behind tbf,
11.1-17.9 ms with acknowledgements first (gloo's small notices, data to TCP, still queue behind the other
direction's data: a segment with data may not overtake its own connection's), against 10.7-10.8 ms one way. The
planner's time for the four-rank all-reduce ring across two nodes (its edges leave each node one way while the
other's come in) was 0.75-0.94 of the measured median behind tbf, 0.92-0.97 with acknowledgements first
(utils.cluster.boundary). fq_codel or sfq, the usual cure for such queues, are missing from some kernels (this one);
htb and u32 are there wherever tc shapes at all. Latency (netem) is added on the node ends only, under both classes,
so one way between two nodes crosses it once; where the kernel has no netem, none is added and `up` says so. Ranks
inside a node talk over its loopback (their own address is local: the kernel routes it over lo, unshaped).
Everything is named with the prefix `dtfs-`, so `down` finds ours and only ours.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

PREFIX = "dtfs-"
BRIDGE = PREFIX + "br"
SUBNET = "10.213.0"  # node i is SUBNET.(i+1); no address in the root namespace, so no clash with the host's
STATE = Path("/run") / (PREFIX + "cluster.json")  # /run is a tmpfs: gone at reboot, like the namespaces
# `ip netns exec NAME` shows /etc/netns/NAME/hosts as /etc/hosts: the nodes' names and addresses, so that a
# reverse lookup of a peer's address answers at once (else c10d warns that it cannot name the client socket).
HOSTS = Path("/etc/netns")
MAX_NODES = 64
FRAME = 1514  # bytes of an Ethernet frame with MTU 1500, what tc counts
RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmg]?)bit$", re.IGNORECASE)
DELAY = re.compile(r"^(\d+(?:\.\d+)?)\s*(us|ms|s)$", re.IGNORECASE)
NO_NETEM_NOTE = ("note: this kernel has no netem queueing discipline (sch_netem), so no latency was added: the "
                 "link is shaped in bandwidth only")


class ClusterError(RuntimeError):
    """Something the user can fix: a bad argument, a missing privilege or tool, a cluster in the way."""


def namespace(node):
    return f"{PREFIX}node{node}"


def node_interface(node):
    """The node's end of its veth pair, inside its namespace: GLOO_SOCKET_IFNAME."""
    return f"{PREFIX}n{node}"


def host_interface(node):
    return f"{PREFIX}h{node}"


def address(node):
    return f"{SUBNET}.{node + 1}"


# ---------------------------------------------------------------- arguments, privileges

def bits_per_second(rate):
    """'100mbit' -> 1e8. tc's units: bit, kbit, mbit, gbit, powers of 1000."""
    match = RATE.match(str(rate).strip())
    if not match or float(match[1]) <= 0:
        raise ClusterError(f"--link must be a rate such as 100mbit, 1gbit or 500kbit (bits per second), got {rate!r}")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2].lower()]


def seconds_of(delay):
    """'5ms' -> 0.005; None -> 0."""
    if delay is None:
        return 0.0
    match = DELAY.match(str(delay).strip())
    if not match:
        raise ClusterError(f"--delay must be a time such as 5ms, 200us or 0.1s, got {delay!r}")
    return float(match[1]) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[match[2].lower()]


def check_nodes(nodes, name="--nodes"):
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
        raise ClusterError(f"{name} must be a whole number from 1 to {MAX_NODES}, got {nodes!r}")
    return nodes


def user_namespaces_allowed():
    """Whether an unprivileged user may create a user namespace here (then `unshare -rnm` gives a private root)."""
    def read(path, default):
        try:
            return Path(path).read_text().strip()
        except OSError:
            return default
    return (read("/proc/sys/user/max_user_namespaces", "0") != "0"
            and read("/proc/sys/kernel/unprivileged_userns_clone", "1") != "0"  # Debian's switch
            and read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "0") != "1")  # Ubuntu 24.04's


def missing_privileges():
    """What stops us from making namespaces here, with how to get it; None when nothing does. Asked before any
    command runs, so a refused call touches nothing."""
    if not sys.platform.startswith("linux"):
        return (f"utils.cluster needs Linux (network namespaces and tc); this is {sys.platform}. Run it in a Linux "
                f"virtual machine, or in a container started with --privileged (or --cap-add NET_ADMIN --cap-add "
                f"SYS_ADMIN).")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"utils.cluster needs the {' and '.join(missing)} command(s) from iproute2: install it "
                f"(Debian/Ubuntu: sudo apt-get install iproute2; Fedora: sudo dnf install iproute iproute-tc).")
    if os.geteuid() != 0:
        rootless = ("or, without sudo, inside a user namespace of your own (this kernel allows them): "
                    "unshare --user --map-root-user --net --mount sh -c 'mount -t tmpfs tmpfs /run && "
                    "python -m utils.cluster run ...' (up and down do not outlive that shell)"
                    if user_namespaces_allowed() else
                    "or enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or on "
                    "Ubuntu kernel.apparmor_restrict_unprivileged_userns=0) and run it inside `unshare --user "
                    "--map-root-user --net --mount`")
        return (f"utils.cluster needs root to create network namespaces (CAP_NET_ADMIN and CAP_SYS_ADMIN); this "
                f"is uid {os.geteuid()}. Run it with sudo (sudo -E env PATH=$PATH python -m utils.cluster ...), "
                f"{rootless}.")
    return None


def require_privileges():
    message = missing_privileges()
    if message:
        raise ClusterError(message)


# ---------------------------------------------------------------- commands

def sh(*command, check=True):
    """Run one command; on failure raise with its own message."""
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"`{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def in_node(node, *command):
    return ("ip", "netns", "exec", namespace(node), *command)


# ---------------------------------------------------------------- what exists

def our_namespaces():
    """Our namespaces' names, in node order."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines() if line.strip()]
    ours = [n for n in names if re.fullmatch(re.escape(PREFIX) + r"node\d+", n)]
    return sorted(ours, key=lambda n: int(n.removeprefix(PREFIX + "node")))


def our_links():
    """Our interfaces in the root namespace (the bridge and the host ends)."""
    names = [m[1] for m in re.finditer(r"^\d+: ([^:@]+)", sh("ip", "-o", "link", "show").stdout, re.MULTILINE)]
    return [n for n in names if n.startswith(PREFIX)]


def processes_in(name):
    return [int(p) for p in sh("ip", "netns", "pids", name, check=False).stdout.split()]


def read_state():
    """The cluster `up` made ({'nodes', 'link', 'delay', 'latency_added'}), or None if there is none."""
    try:
        state = json.loads(STATE.read_text())
    except (OSError, ValueError):
        return None
    return state if len(our_namespaces()) == state.get("nodes") else None


# ---------------------------------------------------------------- up, down, status

def up(nodes, link="1gbit", delay=None, quiet=False):
    """Make the cluster (idempotent: the same cluster already up is left alone; another one is replaced)."""
    check_nodes(nodes)
    bits_per_second(link)
    seconds_of(delay)
    require_privileges()
    wanted = {"nodes": nodes, "link": link, "delay": delay}
    state = read_state()
    if state and all(state[k] == v for k, v in wanted.items()):
        if not quiet:
            print(f"already up: {describe(state)}")
            if delay and not state["latency_added"]:
                print(NO_NETEM_NOTE)
        return state
    down(quiet=True)
    try:
        latency_added = build(nodes, link, delay)
    except BaseException:
        down(quiet=True)  # a half-made cluster is removed, whatever stopped it (Ctrl-C included)
        raise
    state = {**wanted, "latency_added": latency_added}
    STATE.write_text(json.dumps(state))
    if not quiet:
        print(f"up: {describe(state)}")
    if delay and not latency_added:
        print(NO_NETEM_NOTE)
    return state


def build(nodes, link, delay):
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "link", "set", BRIDGE, "up")
    latency_added = bool(delay)
    for node in range(nodes):
        ns, inner, outer = namespace(node), node_interface(node), host_interface(node)
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
        segment = str(segment_bytes(link))
        sh("ip", "link", "set", outer, "master", BRIDGE, "gso_max_size", segment, "up")
        sh("ip", "-n", ns, "link", "set", inner, "gso_max_size", segment)
        sh("ip", "-n", ns, "addr", "add", f"{address(node)}/24", "dev", inner)
        sh("ip", "-n", ns, "link", "set", inner, "up")
        shape(outer, link)
        write_hosts(node, nodes)
        latency_added = shape(inner, link, delay if latency_added else None, namespace=ns)
    return latency_added


def write_hosts(node, nodes):
    folder = HOSTS / namespace(node)
    names = "".join(f"{address(i)}\t{namespace(i)}\n::ffff:{address(i)}\t{namespace(i)}\n" for i in range(nodes))
    try:  # the TCPStore listens on IPv6: its peers are IPv4-mapped addresses
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n"
                                      f"{address(node)}\t{socket.gethostname()}\n{names}")
    except PermissionError:  # in a user namespace of one's own, /etc is not ours: c10d warns, and works
        pass


def segment_bytes(link):
    """The largest packet the veth pair passes (gso_max_size): an eighth of a millisecond of the link, from one
    Ethernet frame to 64 KB. Whole 64 KB segments would need a bucket that large (below); single frames cost
    too much CPU above a few hundred Mbit/s (1gbit here: 630 Mbit/s with frames, 930 with 16 KB segments)."""
    return min(65536, max(FRAME, int(bits_per_second(link) / 8 / 8000)))


def bucket_bytes(link):
    """htb's bucket: small (a fifth of a millisecond of the link, at least three segments), so that the link
    behaves like a wire of that rate. A message's first bucketful leaves at once: smaller messages cross at
    the speed of memory, and an alpha-beta fit over them would see two lines."""
    return max(int(bits_per_second(link) / 8 * 2e-4), 3 * segment_bytes(link))


ACK_SHARE = 0.05  # of the rate, guaranteed to the acknowledgements (either class may borrow the whole rate)


def pure_ack_filters(interface):
    """u32 filters that send TCP's pure acknowledgements (no payload) to class 1:10: IPv4 (the addresses `up`
    gives) with a 20-byte header, whose total length is the header's 20 plus the TCP header's, 4 x its data offset
    (5 to 15 words: every option that an acknowledgement carries, timestamps and SACK blocks). A segment with data
    stays in 1:20, behind the data before it: were it to jump them, its connection would see its bytes out of order
    (duplicate acknowledgements, a retransmission, a halved window)."""
    return [("filter", "add", "dev", interface, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "u8", "0x45", "0xff", "at", "0",  # IPv4, 20-byte header
             "match", "u8", "0x06", "0xff", "at", "9",  # TCP
             "match", "u16", f"0x{20 + 4 * words:04x}", "0xffff", "at", "2",  # total length: the headers only
             "match", "u8", f"0x{words << 4:02x}", "0xf0", "at", "32",  # the TCP header's length
             "flowid", "1:10") for words in range(5, 16)]


def shaping_commands(interface, link, delay=None):
    """tc's arguments (after `tc [-n NS]`) that limit the interface's egress to `link`: htb, TCP's pure
    acknowledgements in class 1:10, served before everything else in 1:20, each class behind a netem delay if
    `delay`."""
    bits, burst = bits_per_second(link), str(bucket_bytes(link))
    quantum = str(segment_bytes(link) + 100)  # one whole packet per round: htb wants at least the largest
    dev = ("dev", interface)
    commands = [("qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "20"),
                ("class", "add", *dev, "parent", "1:", "classid", "1:1", "htb", "rate", link, "burst", burst,
                 "cburst", burst)]
    for classid, share, prio in (("1:10", ACK_SHARE, "0"), ("1:20", 1 - ACK_SHARE, "1")):
        commands.append(("class", "add", *dev, "parent", "1:1", "classid", classid, "htb", "rate",
                         f"{int(bits * share)}bit", "ceil", link, "prio", prio, "burst", burst, "cburst", burst,
                         "quantum", quantum))
    commands += pure_ack_filters(interface)
    if delay:
        commands += [("qdisc", "add", *dev, "parent", classid, "handle", f"{classid[2:]}:", "netem", "delay", delay)
                     for classid in ("1:10", "1:20")]
    return commands


def shape(interface, link, delay=None, namespace=None):
    """Limit the interface's egress to `link`, and add `delay` where the kernel has netem. Returns whether the
    delay was added (False without one, or without netem: the rate is shaped all the same); raises on any other
    failure."""
    tc = ("tc", "-n", namespace) if namespace else ("tc",)
    for command in shaping_commands(interface, link, delay):
        done = sh(*tc, *command, check=False)
        if done.returncode != 0:
            if "netem" in command and ("unknown" in done.stderr.lower() or "no such file" in done.stderr.lower()):
                return False
            raise ClusterError(f"`{' '.join(tc + command)}` failed: {(done.stderr or done.stdout).strip()}")
    return bool(delay)


def stop_processes(names):
    """Kill every process inside the namespaces `names` (SIGKILL: they are ours, started by `run`)."""
    for name in names:
        for pid in processes_in(name):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def down(quiet=False):
    """Remove everything ours: processes in our namespaces, the namespaces (their veth ends go with them, and
    the host ends with those), the bridge, the state file. Idempotent."""
    require_privileges()
    names = our_namespaces()
    stop_processes(names)
    for name in names:
        sh("ip", "netns", "del", name, check=False)
    for link in our_links():
        sh("ip", "link", "del", link, check=False)
    for folder in HOSTS.glob(PREFIX + "node*"):
        shutil.rmtree(folder, ignore_errors=True)
    STATE.unlink(missing_ok=True)
    left = our_namespaces() + our_links()
    if left:
        raise ClusterError(f"down: could not remove {', '.join(left)}")
    if not quiet:
        print(f"down: removed {len(names)} node(s)" if names else "down: nothing to remove")


def shaping(namespace, interface):
    """What tc shows on the interface, in a few words: 'htb 100Mbit, acknowledgements first[, ...]'."""
    tc = ("tc", "-n", namespace)
    rate = re.search(r"class htb 1:1 root rate (\S+)", sh(*tc, "class", "show", "dev", interface, check=False).stdout)
    delay = re.search(r"qdisc netem .*?delay (\S+)", sh(*tc, "qdisc", "show", "dev", interface, check=False).stdout)
    if not rate:
        return "unshaped"
    return f"htb {rate[1]}, acknowledgements first" + (f", netem delay {delay[1]}" if delay else "")


def describe(state):
    delay = state.get("delay")
    latency = (f", {delay} one way" if state.get("latency_added") else f", no latency added ({delay} asked; "
               f"no netem)") if delay else ""
    return f"{state['nodes']} node(s) {', '.join(address(i) for i in range(state['nodes']))}; link {state['link']}" \
           f" each way per node{latency}"


def status():
    """What is up: each node, its address, its shaping and its processes. Returns the state (None if down)."""
    require_privileges()
    state, names, links = read_state(), our_namespaces(), our_links()
    if not names and not links:
        print("down: no namespace, interface or state of ours")
        return None
    print(describe(state) if state else "partial: not made by a complete `up`; `python -m utils.cluster down` "
                                        "removes it")
    for name in names:
        node = int(name.removeprefix(PREFIX + "node"))
        print(f"  {name}: {address(node)} on {node_interface(node)}, {len(processes_in(name))} process(es); "
              f"{shaping(name, node_interface(node))}")
    return state
