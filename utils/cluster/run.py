"""A script on the cluster: torchrun in every node's namespace, one rendezvous, every rank's output gathered.

Node i runs `torchrun --nnodes N --node_rank i --nproc_per_node K` with the c10d rendezvous at node 0's address
(node 0's torchrun hosts it: `is_host`, since every namespace shares the machine's host name), `--local-addr` its
own address (what the others dial), and GLOO_SOCKET_IFNAME its interface. Each rank writes its output to its own
files (utils.cluster.worker); they are printed afterwards in rank order, as `[node i rank r] ...`. A run that fails, times out or is interrupted kills every process it started, and a cluster
it made for itself is removed.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from utils.cluster import network
from utils.cluster.network import ClusterError

RANK_FILE = re.compile(r"^node(\d+)\.rank(\d+)\.out$")  # written by utils.cluster.worker
ROOT = Path(__file__).resolve().parents[2]
GRACE_SECONDS = 5.0  # after one node fails, how long the others get to fail by themselves before being killed


class Interrupted(KeyboardInterrupt):
    """SIGTERM, turned into the exception SIGINT raises, so that the same cleanup runs."""


def check_run(nodes, nproc_per_node, script, timeout):
    network.check_nodes(nodes)
    network.check_nodes(nproc_per_node, "--nproc-per-node")
    if not Path(script).is_file():
        raise ClusterError(f"no such script: {script} (export a notebook with python -m utils.notebooks --script)")
    if not timeout > 0:
        raise ClusterError(f"--timeout must be a positive number of seconds, got {timeout}")


def free_port(node=0):
    """A port nobody listens on inside the node (asked of the kernel there)."""
    code = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
    return int(network.sh(*network.in_node(node, sys.executable, "-c", code)).stdout)


def torchrun_command(node, nodes, nproc_per_node, port, run_id, script, args):
    return network.in_node(node, "env", f"GLOO_SOCKET_IFNAME={network.node_interface(node)}", f"DTFS_NODE={node}",
                           sys.executable, "-m", "torch.distributed.run",
                           f"--nnodes={nodes}", f"--node_rank={node}", f"--nproc_per_node={nproc_per_node}",
                           "--rdzv_backend=c10d", f"--rdzv_endpoint={network.address(0)}:{port}",
                           f"--rdzv_id={run_id}", f"--rdzv_conf=is_host={int(node == 0)}",
                           f"--local_addr={network.address(node)}", "--max_restarts=0",
                           "-m", "utils.cluster.worker", str(script), *args)


def run(nodes, nproc_per_node, script, args=(), link="1gbit", delay=None, timeout=600.0, echo=True):
    """Run `script` on `nodes` x `nproc_per_node` ranks. Returns (returncode, {rank: (node, lines)}, {node: torchrun's own lines}).
    On the cluster `up` made (its first `nodes` nodes), or on a temporary one made and removed here."""
    check_run(nodes, nproc_per_node, script, timeout)
    network.require_privileges()
    state = network.read_state()
    if state and state["nodes"] < nodes:
        raise ClusterError(f"a cluster of {state['nodes']} node(s) is up: run with at most --nodes "
                           f"{state['nodes']}, or `python -m utils.cluster down` first")
    temporary = state is None
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    procs = []
    try:
        if temporary:
            network.up(nodes, link, delay, quiet=True)
        with tempfile.TemporaryDirectory(prefix="dtfs-run-") as logs:
            port, run_id = free_port(), uuid.uuid4().hex[:12]
            for node in range(nodes):
                with open(Path(logs) / f"{node}.out", "w") as out, open(Path(logs) / f"{node}.err", "w") as err:
                    procs.append(subprocess.Popen(
                        torchrun_command(node, nodes, nproc_per_node, port, run_id, script, args),
                        stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                        env=environment(logs)))
            returncode = wait(procs, timeout)
            stop(procs)
            ranks, node_logs = gathered(logs, nodes)
    finally:  # success, failure, timeout, Ctrl-C or SIGTERM: nothing of this run outlives it
        stop(procs)
        network.stop_processes(network.our_namespaces())
        if temporary:
            network.down(quiet=True)
        signal.signal(signal.SIGTERM, previous)
    if echo:
        show(ranks, node_logs, returncode)
    return returncode, ranks, node_logs


def run_for_json(nodes, nproc_per_node, script, args=(), what="the run", **options):
    """Run `script` and return the last line of JSON that rank 0 printed (a measurement's result); raise, with the
    end of rank 0's output, if the run failed or printed none."""
    code, ranks, _ = run(nodes, nproc_per_node, script, args, echo=False, **options)
    lines = ranks.get(0, (0, ["no output"]))[1]
    results = [line for line in lines if line.startswith("{")]
    if code != 0 or not results:
        raise ClusterError(f"{what} on {nodes} node(s) x {nproc_per_node} failed (exit code {code}): "
                           + "\n".join(lines[-10:]))
    return json.loads(results[-1])


def environment(logs):
    """The caller's, with this repository importable (the script may sit anywhere) and torchrun's log folder
    in the run's temporary one."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": logs, "DTFS_RUN_LOGS": logs}


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


def wait(procs, timeout):
    """The first non-zero exit code (0 if all succeed); 124 (as timeout(1)) if the deadline passes first."""
    deadline, failed_at = time.monotonic() + timeout, None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return next((c for c in codes if c != 0), 0)
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()  # the others are likely waiting for the node that failed
        if failed_at is not None and time.monotonic() > failed_at + GRACE_SECONDS:
            return next(c for c in codes if c not in (None, 0))
        if time.monotonic() > deadline:
            print(f"timeout: the run took more than {timeout:g} s; stopping every node", file=sys.stderr)
            return 124
        time.sleep(0.05)


def stop(procs):
    """SIGTERM each torchrun's session (it tells its workers), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + 3
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.05)


def gathered(logs, nodes):
    """({rank: (its node, its lines)}, {node: torchrun's own lines}): each rank's stdout, then its stderr."""
    ranks = {}
    for path in sorted(Path(logs).glob("node*.rank*.out")):
        node, rank = map(int, RANK_FILE.match(path.name).groups())
        lines = path.read_text(errors="replace").splitlines()
        ranks[rank] = (node, lines + path.with_suffix(".err").read_text(errors="replace").splitlines())
    node_logs = {node: (Path(logs) / f"{node}.out").read_text(errors="replace")
                 + (Path(logs) / f"{node}.err").read_text(errors="replace") for node in range(nodes)}
    return ranks, node_logs


def show(ranks, node_logs, returncode):
    for rank in sorted(ranks):
        node, lines = ranks[rank]
        for line in lines:
            print(f"[node {node} rank {rank}] {line}")
    if returncode not in (0, 124):  # a timeout is said when it happens; torchrun's logs then show only the kill
        for node, text in node_logs.items():
            if text.strip():
                print(f"--- torchrun on node {node}:\n" + "\n".join(text.splitlines()[-15:]), file=sys.stderr)
        print(f"failed: exit code {returncode}", file=sys.stderr)
