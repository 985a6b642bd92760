"""The run notebook 08 stops and resumes: its sizes, the data order, the FSDP-style training state, and the
training loop that saves or loads it.

A run is killed at step k and resumed from its last checkpoint; it must end with the weights of the run
that never stopped. Everything the rest of the run depends on goes into the checkpoint (a TrainState per
rank; utils.checkpoint writes and reads it):

    sharded (1/N per rank)       the weights (FSDP-style flat shards, utils.fsdp), AdamW's exp_avg, exp_avg_sq
    the same on every rank       the optimizer step, the sampler's position (epoch, step in the epoch)
    one per rank                 the rank's RNG state

The data: a fixed dataset of DATASET rows; each step, the sampler hands each rank its rows of the global
batch. With the global batch fixed, the rows of step s are the same whatever the world size: only the
order of the sums changes (see `resume_tolerance`).
"""
import dataclasses

import torch
import torch.distributed as dist

from utils import fsdp
from utils.model import build_mlp, generator, loss_fn, make_batch, parameter_names
from utils.sizes import check_int, divide

EACH_RANK_SAME_ROWS = "the global batch is split evenly: each rank must get the same number of rows"


# ---------------------------------------------------------------- sizes, and the data order

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


def full_state(states, sizes):
    """The full tensors of every rank's TrainState (in the parent), {name: tensor}, by gathering the shards."""
    shapes = sizes.shapes()
    return {name: fsdp.gather_shards([[s.sharded[name]] for s in states], [shape])[0] for name, shape in shapes.items()}


def fresh_rng_state(seed, step, rank):
    """The RNG state of a rank that did not exist when the checkpoint was saved: seeded from (seed, step, rank),
    the same in every process (saved ranks get their own state back)."""
    return generator(seed, 3, f"{step},{rank}").get_state()


# ---------------------------------------------------------------- the run the checks and the notebook train

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


def train_main(rank, world_size, sizes, student, stop_after=None, directory=None, resume=False, fault=None):
    """Train the ShardedRun to sizes.num_steps; with `resume`, from the checkpoint in `directory` (loaded with the
    student's load_checkpoint); with `stop_after`, stop after that many steps and save there (save_checkpoint);
    with a `fault` (a utils.elastic.Fault), one rank dies or hangs in the middle of a step."""
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
