"""A rank dies, torchrun restarts (notebook 08, section 3): faults, the torchrun worker, the run under torchrun
and what its elastic agent logs.
"""
import contextlib
import dataclasses
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from utils.checkpoint import checkpoint_folder
from utils.launch import loopback_interface
from utils.sharded_run import ShardedRun, batches, check_run_sizes, dataset, fresh_rng_state
from utils.sizes import check_int


@dataclasses.dataclass(frozen=True)
class Fault:
    """Rank `rank` dies (os._exit: no exception, no cleanup, as when a node is lost) or hangs (sleeps: a
    stuck rank) in the middle of step `step` (after its backward, before the gradients' reduce-scatter), on
    attempt `attempt` of a torchrun run (TORCHELASTIC_RESTART_COUNT; under spawn, 0)."""

    rank: int
    step: int
    how: str = "dies"
    attempt: int = 0

    def __post_init__(self):
        if self.how not in ("dies", "hangs"):
            raise ValueError(f"a Fault 'dies' or 'hangs', got {self.how!r}")

    def strike(self, rank, step, attempt=0, log=None):
        if (rank, step, attempt) != (self.rank, self.step, self.attempt):
            return
        if log:
            log(f"{self.how} in step {step}")
        if self.how == "dies":
            os._exit(1)
        time.sleep(3600)  # until the agent, or spawn, stops it


def elastic_main(root, sizes, student, save_every, faults=(), timeout=60.0):
    """One torchrun worker: train to sizes.num_steps from the latest checkpoint under `root` (the student's
    latest_checkpoint and load_checkpoint), saving one after every `save_every` steps (save_checkpoint).
    Each worker logs what it did, with wall-clock times, to root/events_{attempt}_{rank}.jsonl; rank 0
    writes the final full weights to root/final.pt."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    events = os.path.join(root, f"events_{attempt}_{rank}.jsonl")

    def log(event, **details):
        with open(events, "a") as f:
            record = {"attempt": attempt, "rank": rank, "event": event, "time": time.time(), **details}
            f.write(json.dumps(record) + "\n")

    log("started")
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface() or "lo")
    # The ranks of each attempt meet in a file of their own (and no one listens). Through torchrun's store
    # (env://), which outlives the attempts, restarted ranks here failed to connect: gloo's connectFullMesh
    # tried an address of the attempt before ("Connection refused"; torch 2.13, CPU).
    store = dist.FileStore(os.path.join(root, f"store_{attempt}"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    local, per_epoch = check_run_sizes(sizes, world_size)
    data, run, loaded, seed = dataset(sizes), ShardedRun(rank, world_size, sizes), None, sizes.seed
    torch.set_rng_state(fresh_rng_state(seed, 0, rank))
    shapes, checkpoints = sizes.shapes(), os.path.join(root, "checkpoints")
    latest = student.latest_checkpoint(checkpoints)
    if latest is not None:
        loaded = student.load_checkpoint(latest, shapes, rank, world_size)
        run.load_state(loaded)
        seed = loaded.sampler["seed"]
        log("loaded", checkpoint=os.path.relpath(latest, checkpoints), step=loaded.step)
    sampler = student.Sampler(sizes.dataset_size, world_size, rank, seed=seed, drop_last=True)
    start = loaded.sampler["step"] if loaded else 0
    try:
        for step, indices in batches(sampler, start, sizes.num_steps, local, per_epoch):
            def strike():
                for fault in faults:
                    fault.strike(rank, step, attempt, log)

            run.train_step(data[indices], mid_step=strike)
            if run.step % save_every == 0 and run.step < sizes.num_steps:
                folder = checkpoint_folder(checkpoints, run.step)
                os.makedirs(folder, exist_ok=True)
                student.save_checkpoint(folder, run.state({"seed": seed, "step": run.step}), shapes, rank, world_size)
                log("saved", checkpoint=os.path.relpath(folder, checkpoints))
        weights = run.full_weights()
    except Exception as e:  # a peer died or hung: gloo raises here; torchrun restarts the group
        log("failed", error=type(e).__name__)
        raise
    if rank == 0:
        torch.save(weights, os.path.join(root, "final.pt"))
    log("finished", step=run.step)
    dist.barrier()
    dist.destroy_process_group()


SCRIPT = """\
# Written by utils.elastic.run_torchrun: one torchrun worker of notebook 08, section 3.
import sys
sys.path.insert(0, {root!r})
import cloudpickle
from utils import elastic
with open({payload!r}, "rb") as f:
    kwargs = cloudpickle.load(f)
elastic.elastic_main(**kwargs)
"""


@dataclasses.dataclass
class TorchrunRun:
    """What run_torchrun saw: torchrun's exit code, its log (stderr) and its own stdout, the workers' events
    (dicts, in time order) and the final weights (None if the run did not finish)."""

    returncode: int
    log: str
    events: list
    weights: list
    seconds: float


def run_torchrun(sizes, student, world_size, save_every, faults=(), max_restarts=2, pg_timeout=30.0,
                 timeout=120.0):
    """Train under `torchrun --standalone --nproc-per-node=world_size --max-restarts=max_restarts`, started
    with subprocess, in a temporary folder that is removed: the worker script and its arguments (the student's
    functions, by value with cloudpickle), the checkpoints, the workers' events. Bounded by `timeout` seconds,
    after which torchrun and its workers are killed; gloo stays on loopback and the rendezvous picks a free
    port (--standalone)."""
    import cloudpickle

    world_size = check_int("world_size", world_size)
    save_every = check_int("save_every", save_every)
    check_run_sizes(sizes, world_size)
    with tempfile.TemporaryDirectory(prefix="torchrun-") as root:
        payload, script = os.path.join(root, "kwargs.pkl"), os.path.join(root, "train.py")
        with open(payload, "wb") as f:
            cloudpickle.dump(dict(root=root, sizes=sizes, student=student, save_every=save_every,
                                  faults=tuple(faults), timeout=pg_timeout), f)
        with open(script, "w") as f:
            f.write(SCRIPT.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), payload=payload))
        env = {**os.environ, "GLOO_SOCKET_IFNAME": loopback_interface() or "lo", "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO",  # INFO: the agent's lines about the worker group
               "TMPDIR": root}  # torchrun's own log folder too goes where everything is removed
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
                   f"--max-restarts={max_restarts}", "--monitor-interval=0.1", script]
        began = time.time()
        process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        try:
            log, _ = process.communicate(timeout=timeout)
        finally:  # on a timeout, or Ctrl-C: torchrun and every worker it started (its session) go
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        seconds = time.time() - began
        events = []
        for name in os.listdir(root):
            if name.startswith("events_"):
                with open(os.path.join(root, name)) as f:
                    events += [json.loads(line) for line in f]
        final = os.path.join(root, "final.pt")
        weights = torch.load(final, weights_only=True) if os.path.exists(final) else None
    events.sort(key=lambda e: e["time"])
    return TorchrunRun(process.returncode, log, events, weights, seconds)


AGENT_LINE = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ torch/distributed/elastic/\S+\] (.*)$")
AGENT_WORDS = ("failed (exitcode", "closing signal", "Worker group FAILED", "Stopping worker group",
               "Rendezvous'ing worker group", "Starting worker group", "successfully finished")


def agent_lines(log):
    """The elastic agent's lines about the worker group: (seconds since midnight, the message without what changes
    run to run: process ids, the interpreter's path)."""
    lines = []
    for line in log.splitlines():
        m = AGENT_LINE.match(line)
        if m and any(word in m[4] for word in AGENT_WORDS):
            message = re.sub(r"\s*\(pid: \d+\).*", "", m[4])
            message = re.sub(r"process \d+", "process <pid>", message).split(" Waiting")[0]
            lines.append((int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3]), message))
    return lines


def restart_seconds(run):
    """The cost of the first restart, from the agent's log and the workers' events: detect (the rank died -> the
    agent reports it failed), restart (-> the agent starts the new worker group), start (-> the new workers run
    the script: Python and torch imported), load (-> the checkpoint is loaded)."""
    def of_day(t):
        moment = datetime.datetime.fromtimestamp(t)
        return moment.hour * 3600 + moment.minute * 60 + moment.second + moment.microsecond / 1e6

    agent = agent_lines(run.log)
    died = next(e["time"] for e in run.events if e["event"].startswith("dies"))
    failed = next(t for t, line in agent if line.startswith("failed (exitcode"))
    restarted = [t for t, line in agent if "Starting worker group" in line][1]
    started = max(e["time"] for e in run.events if e["attempt"] == 1 and e["event"] == "started")
    loaded = max(e["time"] for e in run.events if e["attempt"] == 1 and e["event"] == "loaded")
    return {"detect": failed - of_day(died), "restart": restarted - failed, "start": of_day(started) - restarted,
            "load": loaded - started}


def describe_attempts(events, world_size):
    """One line per torchrun attempt, from the workers' events, in words that do not change run to run: where it
    started, what every rank saved, the fault, how it ended."""
    lines = []
    for attempt in sorted({e["attempt"] for e in events}):
        mine = [e for e in events if e["attempt"] == attempt]

        def by_every_rank(kind):
            per_rank = [[e.get("checkpoint") for e in mine if e["rank"] == r and e["event"] == kind]
                        for r in range(world_size)]
            return [c for c in per_rank[0] if all(c in others for others in per_rank)]

        loaded = by_every_rank("loaded")
        parts = [f"every rank loaded {loaded[0]}" if loaded else "started from step 0"]
        if saved := by_every_rank("saved"):
            parts.append("saved " + ", ".join(saved))
        parts += [f"rank {e['rank']} {e['event']}" for e in mine if e["event"].startswith(("dies", "hangs"))]
        finished = [e for e in mine if e["event"] == "finished"]
        if len(finished) == world_size:
            parts.append(f"every rank finished step {finished[0]['step']}")
        lines.append(f"attempt {attempt}: " + "; ".join(parts))
    return lines
