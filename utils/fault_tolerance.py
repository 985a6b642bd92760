"""Runs that survive (notebook 08): the data order, the sharded training run, its checkpoint's files, and the
same run under torchrun, restarted by its elastic agent when a rank dies (section 3).

A run is killed at step k and resumed from its last checkpoint; it must end with the weights of the run
that never stopped. Everything the rest of the run depends on goes into the checkpoint:

    sharded (1/N per rank)       the weights (FSDP-style flat shards, utils.fsdp), AdamW's exp_avg, exp_avg_sq
    the same on every rank       the optimizer step, the sampler's position (epoch, step in the epoch)
    one per rank                 the rank's RNG state

A checkpoint is a folder: `shard_{r}.pt` written by rank r (its shards and RNG state), and
`metadata.json` written by rank 0 once every shard is on disk (the world size it was saved on, every
tensor's full shape, the replicated values, each shard file's size). The metadata is what lets N' ranks
load what N ranks saved: rank r' computes which elements of each full flat tensor it owns now, and reads
them from the old shard files that hold them.

The data: a fixed dataset of DATASET rows; each step, the sampler hands each rank its rows of the global
batch. With the global batch fixed, the rows of step s are the same whatever the world size: only the
order of the sums changes (see `resume_tolerance`).
"""
import contextlib
import dataclasses
import datetime
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from utils import fsdp
from utils.launch import loopback_interface, under_torchrun
from utils.model import build_mlp, loss_fn, make_batch, parameter_names
from utils.sizes import check_int, divide

METADATA = "metadata.json"
EACH_RANK_SAME_ROWS = "the global batch is split evenly: each rank must get the same number of rows"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong with it."""


def shard_path(directory, rank):
    return os.path.join(directory, f"shard_{rank}.pt")


def metadata_path(directory):
    return os.path.join(directory, METADATA)


# ---------------------------------------------------------------- where checkpoints go

_shared_folders = itertools.count()


@contextlib.contextmanager
def temporary_checkpoint_folder():
    """A temporary folder every rank can write to, removed at the end. Locally, the ranks are this process's
    children and see the folder it makes. Under torchrun every rank runs the notebook: each makes the same
    folder, named after torchrun's run id and a count of the folders made so far, and all of them wait for
    each other before it is removed (spawn has set up the process group by then)."""
    if not under_torchrun():
        with tempfile.TemporaryDirectory() as folder:
            yield folder
        return
    folder = os.path.join(tempfile.gettempdir(),
                          f"checkpoints-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{next(_shared_folders)}")
    os.makedirs(folder, exist_ok=True)
    try:
        yield folder
    finally:
        if dist.is_initialized():
            dist.barrier()
        if int(os.environ["RANK"]) == 0:
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- sizes

def check_sampler_sizes(dataset_size, num_replicas, rank):
    """DistributedSampler's own rules, before anything is drawn."""
    dataset_size = check_int("dataset_size", dataset_size)
    num_replicas = check_int("num_replicas", num_replicas)
    rank = check_int("rank", rank, 0)
    if rank >= num_replicas:
        raise ValueError(f"rank must be below num_replicas={num_replicas}, got {rank}")
    return dataset_size, num_replicas, rank


def check_resume(dataset_size, num_replicas, step, local_batch_size):
    """A sampler's resume(step, local_batch_size): a step count of at least 0, and a global batch of at least one
    row and no more than the dataset (an epoch of no step has nowhere to resume)."""
    step, local_batch_size = check_int("step", step, 0), check_int("local_batch_size", local_batch_size)
    global_batch_size = local_batch_size * num_replicas
    if global_batch_size > dataset_size:
        raise ValueError(f"local_batch_size {local_batch_size} x {num_replicas} replicas = {global_batch_size} rows "
                         f"per step, more than the dataset ({dataset_size} rows): an epoch would have no step")
    return step, local_batch_size


def local_batch_size(global_batch_size, world_size):
    return divide("global_batch_size", global_batch_size, "world_size", world_size, EACH_RANK_SAME_ROWS)


@dataclasses.dataclass(frozen=True)
class RunSizes:
    """A training run: the MLP's sizes, a dataset of `dataset_size` rows, `global_batch_size` rows per step."""

    hidden_dim: int
    num_layers: int
    dataset_size: int
    global_batch_size: int
    num_steps: int
    seed: int = 0

    def __post_init__(self):
        check_int("hidden_dim", self.hidden_dim)
        check_int("num_layers", self.num_layers)
        check_int("dataset_size", self.dataset_size)
        check_int("global_batch_size", self.global_batch_size)
        check_int("num_steps", self.num_steps)
        check_int("seed", self.seed, 0)
        if self.global_batch_size > self.dataset_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is larger than the dataset "
                             f"({self.dataset_size} rows): an epoch would have no step")

    def shapes(self):
        """{name: full shape} of every tensor the checkpoint shards: weights, then AdamW's two moments."""
        weights = {name: (self.hidden_dim, self.hidden_dim) for name in parameter_names(self.num_layers)}
        return {**weights, **{f"{moment}.{name}": shape for moment in ("exp_avg", "exp_avg_sq")
                              for name, shape in weights.items()}}


def dataset(sizes, dtype=torch.float64):
    """The run's dataset: `dataset_size` rows, the same in every process."""
    return make_batch(sizes.dataset_size, sizes.hidden_dim, sizes.seed, 0, dtype)


def steps_per_epoch(sizes, world_size):
    """Whole steps in an epoch on this world size (a partial last batch is skipped: every rank the same rows)."""
    samples_per_rank = sizes.dataset_size // world_size  # the smaller of drop_last's and padding's counts
    return samples_per_rank // local_batch_size(sizes.global_batch_size, world_size)


def resume_tolerance(sizes):
    """How far weights resumed on another world size may be from the uninterrupted run's (float64): the same
    rows, summed in another order, differ by a few units in the last place per step; AdamW divides by
    sqrt(exp_avg_sq) and can grow such a difference; 1e-10 is far above what that gives and far below any
    real mistake (a skipped or repeated batch moves weights by about lr = 1e-2)."""
    return 1e-10


def shown_difference(difference):
    """A max difference as a verdict prints it. Below 1e-15 its last bits vary from run to run (resumed on 3
    ranks: 6.9e-18 in one run, 4.3e-19 in another; a pipeline stage adds its micro-batches' gradients in
    the order their backwards arrive), and a printed verdict must not: it says 'below 1e-15'."""
    return "below 1e-15" if difference < 1e-15 else f"{difference:.1e}"


# ---------------------------------------------------------------- the training state, as the checkpoint sees it

@dataclasses.dataclass
class TrainState:
    """What one rank's checkpoint holds (see the module's docstring)."""

    sharded: dict  # {name: this rank's flat shard}, names as in RunSizes.shapes()
    step: int  # optimizer steps done
    sampler: dict  # {"seed": s, "step": global steps done}: the data order resumes from these, on any world size
    rng: torch.Tensor  # torch.get_rng_state() of this rank


class ShardedRun:
    """The course's MLP trained FSDP-style: each rank keeps the flat shard of each weight and AdamW's state of
    that shard; each step all-gathers the weights, runs forward and backward on the rank's rows, and
    reduce-scatters the gradients (the mean over ranks) into the shards' .grad."""

    def __init__(self, rank, world_size, sizes, dtype=torch.float64):
        self.rank, self.world_size, self.sizes = rank, world_size, sizes
        self.model = build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed, dtype)
        self.names = parameter_names(sizes.num_layers)
        self.shards = [torch.nn.Parameter(fsdp.shard(p, rank, world_size)) for p in self.model.parameters()]
        self.optimizer = torch.optim.AdamW(self.shards, **fsdp.ADAMW)
        self.step = 0

    def gather_weights(self):
        for p, s in zip(self.model.parameters(), self.shards):
            full = torch.empty(self.world_size * s.numel(), dtype=s.dtype)
            dist.all_gather_single(full, s.detach())
            p.detach().copy_(fsdp.unpad(full, p.shape))

    def train_step(self, rows, mid_step=None):
        """One step; `mid_step()`, if given, runs between the backward and the gradients' reduce-scatter (where
        section 3's faults strike: the other ranks are then waiting in that collective)."""
        torch.rand(1)  # what a dropout layer would draw: each rank's RNG state moves on every step, as in real runs
        self.gather_weights()
        loss_fn(self.model(rows)).backward()
        if mid_step is not None:
            mid_step()
        for p, s in zip(self.model.parameters(), self.shards):
            s.grad = fsdp.reduce_scatter_mean(p.grad)
            p.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.step += 1

    def full_weights(self):
        self.gather_weights()
        return [p.detach().clone() for p in self.model.parameters()]

    # the checkpoint's view of it
    def state(self, sampler_state):
        sharded = {name: s.detach() for name, s in zip(self.names, self.shards)}
        for moment in ("exp_avg", "exp_avg_sq"):
            for name, s in zip(self.names, self.shards):
                sharded[f"{moment}.{name}"] = self._adamw_state(s, moment)
        return TrainState(sharded, self.step, dict(sampler_state), torch.get_rng_state())

    def _adamw_state(self, shard, moment):
        state = self.optimizer.state.get(shard)
        return state[moment] if state else torch.zeros_like(shard.detach())

    def load_state(self, state):
        """Put a loaded TrainState in place: shards, AdamW's moments and step, the RNG state."""
        with torch.no_grad():
            for name, s in zip(self.names, self.shards):
                if state.sharded[name].shape != s.shape:
                    raise ValueError(f"the loaded shard of {name} has {tuple(state.sharded[name].shape)} elements "
                                     f"on rank {self.rank} of {self.world_size}; this rank's shard has "
                                     f"{tuple(s.shape)}: reshard to the new world size")
                s.copy_(state.sharded[name])
                if state.step:
                    self.optimizer.state[s] = {
                        "step": torch.tensor(float(state.step)),
                        "exp_avg": state.sharded[f"exp_avg.{name}"].clone(),
                        "exp_avg_sq": state.sharded[f"exp_avg_sq.{name}"].clone()}
        self.step = state.step
        torch.set_rng_state(state.rng)


# ---------------------------------------------------------------- the files

def write_metadata(directory, metadata):
    """Write metadata.json atomically (a reader never sees half of it): the checkpoint's last file."""
    path = metadata_path(directory)
    with open(path + ".tmp", "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def read_metadata(directory, shapes):
    """The metadata of the checkpoint in `directory`, checked against the model it is loaded into
    (`shapes`: {name: full shape}); a CheckpointError naming the file and what is wrong otherwise."""
    path = metadata_path(directory)
    try:
        with open(path) as f:
            metadata = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found: no checkpoint here, or one whose saving did not finish "
                              f"(the metadata is written last)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupted: not valid JSON ({e})") from None
    needed = {"world_size": int, "shapes": dict, "dtypes": dict, "step": int, "sampler": dict, "shard_bytes": list}
    for key, kind in needed.items():
        if not isinstance(metadata, dict) or not isinstance(metadata.get(key), kind):
            raise CheckpointError(f"{path}: corrupted: '{key}' is missing or not a {kind.__name__}")
    if len(metadata["shard_bytes"]) != metadata["world_size"]:
        raise CheckpointError(f"{path}: corrupted: {len(metadata['shard_bytes'])} shard sizes for world size "
                              f"{metadata['world_size']}")
    saved = {name: tuple(shape) for name, shape in metadata["shapes"].items()}
    for name, shape in shapes.items():
        if name not in saved:
            raise CheckpointError(f"{path}: the checkpoint has no '{name}': it is from another model")
        if saved[name] != tuple(shape):
            raise CheckpointError(f"{path}: '{name}' has shape {saved[name]} in the checkpoint, {tuple(shape)} in "
                                  f"the model: the checkpoint is from another model")
    metadata["shapes"], metadata["dtypes"] = saved, _saved_dtypes(path, metadata["dtypes"], shapes)
    return metadata


def _saved_dtypes(path, names, shapes):
    """{name: torch.dtype} from the metadata's {name: "torch.int64", ...}: each tensor comes back in its own dtype,
    on a rank that holds only padding of it too."""
    dtypes = {}
    for name in shapes:
        dtype = getattr(torch, str(names.get(name)).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{path}: corrupted: the dtype of '{name}' is {names.get(name)!r}, not a torch "
                                  f"dtype")
        dtypes[name] = dtype
    return dtypes


def read_shard(directory, rank, metadata):
    """What rank `rank` saved, checked against the metadata: a CheckpointError naming the file otherwise."""
    path = shard_path(directory, rank)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing: the checkpoint was saved on {metadata['world_size']} ranks and "
                              f"rank {rank}'s shard is not there")
    size, want = os.path.getsize(path), metadata["shard_bytes"][rank]
    if size != want:
        raise CheckpointError(f"{path}: {size} bytes, the metadata says {want}: the file is truncated or "
                              f"from another checkpoint")
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def file_bytes(directory):
    """{file name: bytes} of a checkpoint folder."""
    return {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(os.listdir(directory))}


def state_bytes(sizes, dtype=torch.float64):
    """The bytes of the whole model state a checkpoint holds: weights and AdamW's two moments."""
    return sum(math.prod(shape) for shape in sizes.shapes().values()) * torch.empty(0, dtype=dtype).element_size()


def fresh_rng_state(seed, step, rank):
    """The RNG state of a rank that did not exist when the checkpoint was saved: seeded from (seed, step, rank),
    the same in every process (saved ranks get their own state back)."""
    from utils.model import generator

    return generator(seed, 3, f"{step},{rank}").get_state()


# ---------------------------------------------------------------- the training run the checks and the notebook use

@dataclasses.dataclass
class Student:
    """The notebook's code a run uses."""

    Sampler: type
    save_checkpoint: object = None
    load_checkpoint: object = None
    latest_checkpoint: object = None


@dataclasses.dataclass
class Trained:
    """What one rank's run leaves: the full weights at the end, the dataset rows it trained on at each step,
    the TrainState it loaded (resumed runs) and the one it saved (stopped runs)."""

    weights: list
    rows: dict  # {step: [row indices of this rank]}
    loaded: TrainState = None
    saved: TrainState = None


def check_run_sizes(sizes, world_size):
    local = local_batch_size(sizes.global_batch_size, world_size)
    return local, sizes.dataset_size // sizes.global_batch_size  # steps per epoch: the same on every world size


def batches(sampler, start_step, num_steps, local_batch_size, steps_per_epoch):
    """(step, this rank's row indices) from `start_step` to `num_steps`: the sampler, resumed at each epoch's
    start (or mid-epoch, at the first step), hands out local_batch_size indices per step."""
    step = start_step
    while step < num_steps:
        sampler.resume(step, local_batch_size)
        indices = iter(sampler)
        for _ in range(min(steps_per_epoch - step % steps_per_epoch, num_steps - step)):
            yield step, [next(indices) for _ in range(local_batch_size)]
            step += 1


def train_main(rank, world_size, sizes, student, stop_after=None, directory=None, resume=False, fault=None):
    """Train the ShardedRun to sizes.num_steps; with `resume`, from the checkpoint in `directory` (loaded with the
    student's load_checkpoint); with `stop_after`, stop after that many steps and save there (save_checkpoint);
    with a `fault` (a Fault), one rank dies or hangs in the middle of a step."""
    local, per_epoch = check_run_sizes(sizes, world_size)
    data, run, loaded = dataset(sizes), ShardedRun(rank, world_size, sizes), None
    seed = sizes.seed
    torch.set_rng_state(fresh_rng_state(seed, 0, rank))  # each rank its own random stream
    if resume:
        loaded = student.load_checkpoint(directory, sizes.shapes(), rank, world_size)
        run.load_state(loaded)
        seed = loaded.sampler["seed"]
    sampler = student.Sampler(sizes.dataset_size, world_size, rank, seed=seed, drop_last=True)
    start = loaded.sampler["step"] if loaded else 0
    end = sizes.num_steps if stop_after is None else stop_after
    rows = {}
    for step, indices in batches(sampler, start, end, local, per_epoch):
        run.train_step(data[indices], mid_step=fault and (lambda: fault.strike(rank, step)))
        rows[step] = indices
    saved = None
    if stop_after is not None:
        saved = run.state({"seed": seed, "step": run.step})
        student.save_checkpoint(directory, saved, sizes.shapes(), rank, world_size)
    return Trained(run.full_weights(), rows, loaded, saved)


def load_main(rank, world_size, student, directory, shapes):
    """Only load (the bad-input checks): the TrainState, or the error's type and message."""
    try:
        return student.load_checkpoint(directory, shapes, rank, world_size)
    except Exception as e:
        return e


def full_state(states, sizes):
    """The full tensors of every rank's TrainState (in the parent), {name: tensor}, by gathering the shards."""
    shapes = sizes.shapes()
    return {name: fsdp.gather_shards([[s.sharded[name]] for s in states], [shape])[0] for name, shape in shapes.items()}


# ---------------------------------------------------------------- measurements

def save_load_seconds_main(rank, world_size, sizes, student, ours, theirs, repeat=3):
    """{"save", "load", "dcp.save", "dcp.load": median seconds, slowest rank} of the same sizes (one step in),
    saved with save_checkpoint under `ours` and with dcp.save under `theirs`, each run to a new folder, and
    loaded back into the run on the same world size (ours: load_checkpoint, then ShardedRun.load_state; DCP's:
    dcp.load, then set_state_dict)."""
    from utils import pytorch_reference
    from utils.bench import interleaved_seconds

    run = ShardedRun(rank, world_size, sizes)
    local, _ = check_run_sizes(sizes, world_size)
    rows = dataset(sizes)[rank * local:(rank + 1) * local]
    run.train_step(rows)
    state, shapes = run.state({"seed": sizes.seed, "step": run.step}), sizes.shapes()
    model, optimizer = pytorch_reference.fsdp2_with_adamw(world_size, sizes.hidden_dim, sizes.num_layers, sizes.seed)
    loss_fn(model(rows)).backward()  # AdamW's state exists, as in ours
    optimizer.step()
    saves = {"ours": 0, "theirs": 0}

    def folder(which, new):
        saves[which] += new
        return os.path.join(ours if which == "ours" else theirs, str(saves[which]))

    def save():
        os.makedirs(folder("ours", 1), exist_ok=True)
        student.save_checkpoint(folder("ours", 0), state, shapes, rank, world_size)

    def load():
        run.load_state(student.load_checkpoint(folder("ours", 0), shapes, rank, world_size))

    seconds = interleaved_seconds({"save": save, "dcp.save": lambda: pytorch_reference.dcp_save(
        folder("theirs", 1), model, optimizer)}, repeat=repeat)
    seconds.update(interleaved_seconds({"load": load, "dcp.load": lambda: pytorch_reference.dcp_load(
        folder("theirs", 0), model, optimizer, full=False)}, repeat=repeat))
    return seconds


def checkpoint_files(directory):
    """(bytes of each rank's file, bytes of the rest: the metadata) of a checkpoint folder, ours or DCP's."""
    files = file_bytes(directory)
    shards = [size for name, size in files.items() if name.startswith("shard_") or name.endswith(".distcp")]
    return shards, sum(files.values()) - sum(shards)


# ---------------------------------------------------------------- section 3: a rank dies, torchrun restarts

CHECKPOINT_FOLDER = re.compile(r"^step_(\d+)$")  # root/step_{k}: the checkpoint saved after k steps


def checkpoint_folder(root, step):
    return os.path.join(root, f"step_{step}")


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
# Written by utils.fault_tolerance.run_torchrun: one torchrun worker of notebook 08, section 3.
import sys
sys.path.insert(0, {root!r})
import cloudpickle
from utils import fault_tolerance
with open({payload!r}, "rb") as f:
    kwargs = cloudpickle.load(f)
fault_tolerance.elastic_main(**kwargs)
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


# ---------------------------------------------------------------- section 5: one controller over RPC

def stage_name(stage):
    return f"stage{stage}"


def parameter_rrefs(module_rref):
    """On the stage's worker: an RRef to each of its parameters (what DistributedOptimizer steps)."""
    from torch.distributed import rpc

    return [rpc.RRef(p) for p in module_rref.local_value().parameters()]


def gradients_of(module_rref, context_id):
    """On the stage's worker: its parameters' gradients in distributed autograd context `context_id` (they are
    kept per context, not in .grad), None where a parameter got none."""
    import torch.distributed.autograd as dist_autograd

    grads = dist_autograd.get_gradients(context_id)
    return [None if p not in grads else grads[p].clone() for p in module_rref.local_value().parameters()]


def weights_of(module_rref):
    return [p.detach().clone() for p in module_rref.local_value().parameters()]


class SGD(torch.optim.SGD):
    """torch.optim.SGD under another name: DistributedOptimizer then runs the plain optimizer on each worker, as
    the single-process run does (for SGD itself it would script a functional one, and warn that it is
    deprecated)."""


class RecordingOptimizer:
    """A DistributedOptimizer that, at its first step, also fetches every stage's gradients (for the check)."""

    def __init__(self, stages, optimizer="sgd"):
        from torch.distributed import rpc
        from torch.distributed.optim import DistributedOptimizer

        params = [p for stage in stages for p in rpc.rpc_sync(stage.owner(), parameter_rrefs, args=(stage,))]
        self.stages, self.first_grads, self.steps = stages, None, 0
        if optimizer == "sgd":
            logger = logging.getLogger("torch.distributed.optim.optimizer")
            level = logger.level
            logger.setLevel(logging.ERROR)  # its warning: no TorchScript for this class (as wanted, see SGD)
            try:
                self.optimizer = DistributedOptimizer(SGD, params, lr=0.1, foreach=False)  # make_optimizer's SGD
            finally:
                logger.setLevel(level)
        else:
            raise ValueError(f"optimizer must be 'sgd', got {optimizer!r}")

    def step(self, context_id):
        from torch.distributed import rpc

        if self.first_grads is None:
            self.first_grads = [rpc.rpc_sync(s.owner(), gradients_of, args=(s, context_id)) for s in self.stages]
        self.steps += 1
        self.optimizer.step(context_id)


@dataclasses.dataclass
class ControllerRun:
    grads: list  # [stage][parameter]: step 0's gradients, None where a parameter got none
    weights: list  # [stage][parameter], after the last step
    losses: list  # what the student's step returned, by step
    optimizer_steps: int


def controller_main(rank, world_size, train_step, init_file, hidden_dim, num_layers, batch_size, num_steps,
                    num_micro_batches, seed=0):
    """Rank 0 is the controller, ranks 1..p the p = world_size - 1 stages (notebook 04's split). The controller
    builds each stage on its worker (rpc.remote), a DistributedOptimizer over their parameters, and calls
    `train_step(stages, optimizer, batch, num_micro_batches)` for each step; it returns a ControllerRun. The
    workers only serve: everything they run, the controller asks for."""
    import warnings

    from torch.distributed import rpc

    from utils import pipeline as pp
    from utils.model import step_batches

    num_stages = world_size - 1
    pp.check_sizes(num_layers, num_stages, batch_size, num_micro_batches)
    os.environ.setdefault("TP_SOCKET_IFNAME", loopback_interface() or "lo")
    name = "controller" if rank == 0 else stage_name(rank - 1)
    with warnings.catch_warnings():  # init_rpc and DistributedOptimizer warn (deprecated, TorchScript): not here
        warnings.simplefilter("ignore")
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=f"file://{init_file}", _transports=["uv"]))
        run = None
        try:
            if rank == 0:
                stages = [rpc.remote(stage_name(s), pp.build_stage, args=(s, num_stages, hidden_dim, num_layers, seed))
                          for s in range(num_stages)]
                optimizer = RecordingOptimizer(stages)
                losses = [train_step(stages, optimizer, batch, num_micro_batches)
                          for batch in step_batches(batch_size, hidden_dim, seed, num_steps)]
                losses = [float(loss) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else loss
                          for loss in losses]
                run = ControllerRun(optimizer.first_grads, [rpc.rpc_sync(s.owner(), weights_of, args=(s,))
                                                            for s in stages], losses, optimizer.steps)
        finally:
            rpc.shutdown()
    return run


def run_controller(train_step, num_stages, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches,
                   seed=0, timeout=60.0):
    """The controller and `num_stages` stage workers on spawn's ranks (their RPC agents meet in a file of a
    temporary folder; TensorPipe on loopback): the controller's ControllerRun."""
    from utils.launch import spawn

    num_stages = check_int("num_stages", num_stages)
    with tempfile.TemporaryDirectory(prefix="rpc-") as folder:
        return spawn(controller_main, num_stages + 1, train_step, os.path.join(folder, "rpc_init"), hidden_dim,
                     num_layers, batch_size, num_steps, num_micro_batches, seed, timeout=timeout)[0]
