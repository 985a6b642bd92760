"""Runs that survive (notebook 08): the data order, the sharded training run, its checkpoint's files.

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
import itertools
import json
import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from utils import fsdp
from utils.launch import under_torchrun
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

    def train_step(self, rows):
        torch.rand(1)  # what a dropout layer would draw: each rank's RNG state moves on every step, as in real runs
        self.gather_weights()
        loss_fn(self.model(rows)).backward()
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
    needed = {"world_size": int, "shapes": dict, "step": int, "sampler": dict, "shard_bytes": list}
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
    metadata["shapes"] = saved
    return metadata


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


def train_main(rank, world_size, sizes, student, stop_after=None, directory=None, resume=False):
    """Train the ShardedRun to sizes.num_steps; with `resume`, from the checkpoint in `directory` (loaded with the
    student's load_checkpoint); with `stop_after`, stop after that many steps and save there (save_checkpoint)."""
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
        run.train_step(data[indices])
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
