"""A recorded 1F1B step across a slow link (issue 45's last target): notebook 04's 1F1B (its solution, written once
there) trains the course's MLP on 2 nodes x 2 ranks of `utils.cluster`, every step recorded
(utils.pipeline.train_pipeline / record_step). Stages 0 and 1 sit on node 0, stages 2 and 3 on node 1: every
micro-batch's activation (forward) and its gradient (backward) cross the link once, between stages 1 and 2. Over
100 Mbit/s those hand-offs, not the two shared cores, set the step's time.

`recorded_step()` returns every rank's StepRecord of the last step (the first one also opens gloo's connections)
and the step's measured time: from the first event's start to the last event's end, or the last wait on a send,
on any rank (perf_counter is one clock for every process on the machine, namespaces included). A replay of the
records under a model of the link (the modeled clock, `modeled`) predicts that time.

This file is also the script torchrun runs on each node; rank 0 pickles the records to the file `recorded_step`
names.
"""
import dataclasses
import json
import os
import pickle
import sys
import tempfile
from pathlib import Path

from utils import planner as pl
from utils.cluster import network
from utils.cluster.bench import PAYLOAD_SHARE
from utils.cluster.network import ClusterError
from utils.cluster.run import run
from utils.launch import spawn
from utils.modeled_clock import recorded_costs, replay
from utils.notebooks import solution
from utils.pipeline import train_pipeline

LINK = "100mbit"
NODES, PER_NODE = 2, 2
SIZES = dict(hidden_dim=256, num_layers=4, batch_size=512, num_micro_batches=8)  # float64: 128 KB a hand-off, 11 ms
# on the link, against 4 M multiply-adds a layer per micro-batch
SCRIPT = Path(__file__)


@dataclasses.dataclass
class RecordedStep:
    records: list  # utils.pipeline.StepRecord of the last step, by rank (= stage)
    seconds: float  # the step's measured time
    link: str  # tc's rate between the nodes
    configured_bits: float  # the same, in bits per second
    per_node: int  # ranks per node: stage s sends to s + 1 across the link when they sit on different nodes
    sizes: dict  # hidden_dim, num_layers, batch_size, num_micro_batches

    def crosses_link(self, stage):
        """Whether the hand-off between `stage` and `stage + 1` crosses the link."""
        return stage // self.per_node != (stage + 1) // self.per_node


def step_span(records):
    """Seconds from the first event's start to the last event's end or the last wait on a call, on any rank."""
    starts = [e.start for r in records for e in r.events]
    ends = [e.end for r in records for e in r.events] + [c.waited_at for r in records for c in r.calls
                                                         if c.waited_at is not None]
    return max(ends) - min(starts)


def recorded_step_main(rank, world_size, num_steps, **sizes):
    one_f_one_b_step = solution("04_pipeline_parallel").one_f_one_b_step
    return train_pipeline(rank, world_size, one_f_one_b_step, num_steps=num_steps, **sizes).steps[-1]


def recorded_step(link=LINK, num_steps=2, timeout=600.0, **sizes):
    """Run `num_steps` 1F1B steps on 2 nodes x 2 ranks over `link` (a cluster made for it and removed after, or the
    one `up` made); a RecordedStep of the last. Raises ClusterError where the nodes cannot be built."""
    sizes = SIZES | sizes
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive whole number, got {num_steps!r}")
    network.require_privileges()
    state = network.read_state()
    link = state["link"] if state else link
    with tempfile.TemporaryDirectory(prefix="dtfs-step-") as folder:
        out = Path(folder) / "records.pickle"
        code, ranks, _ = run(NODES, PER_NODE, SCRIPT, [str(out), json.dumps(dict(num_steps=num_steps, **sizes))],
                             link=link, timeout=timeout, echo=False)
        if code != 0 or not out.exists():
            raise ClusterError(f"the recorded 1F1B step failed (exit code {code}): "
                               + "\n".join(ranks.get(0, (0, ["no output"]))[1][-10:]))
        records = pickle.loads(out.read_bytes())
    return RecordedStep(records, step_span(records), link, network.bits_per_second(link), PER_NODE, sizes)


def modeled(step, alpha=0.0):
    """The step replayed on the modeled clock (utils.modeled_clock): each computation as long as it was recorded,
    each hand-off across the link the planner's message_seconds on a Link of the configured rate's payload
    (utils.cluster.bench.PAYLOAD_SHARE: headers, not a fit) and latency `alpha`. Hand-offs inside a node are
    left free: 128 KB on the loopback (1-2 GB/s, notebook 01's section 8) take under 1% of a hop across.
    A boundary carries one hand-off at a time: the link is full duplex, but stages 1 and 2 share one gloo pair, which
    carries one direction at a time (utils.cluster.duplex: 128 KB each way at once on one pair take twice one message
    alone), so an activation and a gradient crossing together take turns."""
    nbytes = step.sizes["batch_size"] // step.sizes["num_micro_batches"] * step.sizes["hidden_dim"] * 8  # float64
    across = pl.Link(alpha, step.configured_bits / 8 * PAYLOAD_SHARE)
    hand_offs = [pl.message_seconds(nbytes, across) if step.crosses_link(s) else 0.0
                 for s in range(len(step.records) - 1)]
    costs = recorded_costs(step.records, hand_offs, cluster=f"2 nodes joined by {step.link}", one_way_at_a_time=True)
    return replay(step.records, costs)


if __name__ == "__main__":  # under torchrun, on the cluster: `recorded_step` runs this
    path, arguments = sys.argv[1], json.loads(sys.argv[2])
    records = spawn(recorded_step_main, int(os.environ["WORLD_SIZE"]), **arguments, timeout=540)
    if os.environ["RANK"] == "0":
        Path(path).write_bytes(pickle.dumps(records))
