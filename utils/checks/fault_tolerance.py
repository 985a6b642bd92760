"""Checks for notebook 08 (runs that survive): the sampler, the sharded checkpoint, the checkpoint to restart from,
the controller over RPC.

- check_sampler: in this process (a sampler communicates nothing): index for index against
  torch.utils.data.DistributedSampler, every row once per epoch without padding, resumed against
  uninterrupted;
- check_checkpoint: on ranks: what a stopped run saved is what the loaded one holds, on the same and on other
  world sizes (uneven shards), bit for bit, and what torch.distributed.checkpoint (FSDP2) loads from the same
  state; resumed runs end with the uninterrupted run's weights; broken checkpoints get errors naming the file;
- check_latest_checkpoint: in this process: the latest complete checkpoint among folders as runs leave them
  (what a restarted run resumes from);
- check_controller: a controller and one worker per stage over torch.distributed.rpc: step 0's gradients and the
  final weights against the single-process run and PyTorch's SPMD pipeline (ScheduleGPipe).
"""
import hashlib
import json
import os
import pickle
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
from torch.utils.data import DistributedSampler

from utils import checkpoint, fsdp, pytorch_reference, rpc_controller, sharded_run
from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff
from utils.launch import RankError, apart, runnable_world_sizes, spawn
from utils.sizes import check_int

# torch.distributed's checkpoint, pipelining and optim are imported though unused here: the ranks these checks
# fork use them (dcp in every checkpoint check: 13 rank processes in notebook 08), and inherit them (utils.launch).
# optim's warnings: torch.jit.script's deprecation, PyTorch's (as in utils.checks.fsdp).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch.distributed.optim  # noqa: F401

DATASET_SIZES = (1, 3, 8, 10, 12, 13)  # fewer rows than ranks, divisible by 2 and 4, by 3 and 4, by none
EPOCHS = 3


# ---------------------------------------------------------------- the sampler

def _pytorch(dataset_size, num_replicas, rank, epoch, **kwargs):
    sampler = DistributedSampler(range(dataset_size), num_replicas=num_replicas, rank=rank, **kwargs)
    sampler.set_epoch(epoch)
    return list(sampler)


def _build(Sampler, dataset_size, num_replicas, rank, epoch, **kwargs):
    sampler = Sampler(dataset_size, num_replicas, rank, **kwargs)
    sampler.set_epoch(epoch)
    return sampler


def _repeats_epoch_0(Sampler, kwargs, dataset_size=13):
    """Whether the sampler gives epoch 0's order in later epochs too, on a dataset where a coincidence is unlikely
    (a sampler drawing from the global RNG can hit epoch 0's order of a few rows by chance)."""
    return all(list(_build(Sampler, dataset_size, 1, 0, epoch, **kwargs)) == _pytorch(dataset_size, 1, 0, 0, **kwargs)
               for epoch in (1, 2))


def _never_shuffles(Sampler, kwargs, dataset_size=13):
    """Whether the sampler keeps the rows in order in every epoch, on a dataset where a coincidence is unlikely (a
    permutation of a few rows drawn from the global RNG can be the identity by chance)."""
    return all(list(_build(Sampler, dataset_size, 1, 0, epoch, **kwargs)) == list(range(dataset_size))
               for epoch in (1, 2))


_TAIL_CUT_FIRST = ("the rows were cut to a multiple of num_replicas before the shuffle, so the same rows are dropped "
                   "in every epoch (of {rows} rows, {lost} never yielded in {epochs} epochs): shuffle all the rows, "
                   "then cut the permutation's tail, as DistributedSampler does, so that each epoch drops other rows")


def _never_yielded(Sampler, dataset_size, n, seed, epochs=20):
    """The rows no rank yields in `epochs` epochs with drop_last (DistributedSampler yields every one of 3 rows on 2
    ranks, and of 13 on 3 and 4, by epoch 20: each epoch drops other rows)."""
    seen = {i for epoch in range(epochs) for rank in range(n)
            for i in _build(Sampler, dataset_size, n, rank, epoch, seed=seed, drop_last=True)}
    return sorted(set(range(dataset_size)) - seen)


def _lost_hint(Sampler, dataset_size, n, seed, epochs=20):
    lost = _never_yielded(Sampler, dataset_size, n, seed, epochs)
    if not lost:
        return None
    said = f"row {lost[0]}" if len(lost) == 1 else f"rows {', '.join(map(str, lost))}"
    return _TAIL_CUT_FIRST.format(rows=dataset_size, lost=said, epochs=epochs)


def _sampler_hint(Sampler, got, want, dataset_size, n, rank, epoch, kwargs):
    """Why a rank's indices differ from DistributedSampler's: the usual mistakes, in words."""
    if len(got) != len(want):
        if kwargs["drop_last"]:
            return (f"{len(got)} indices, expected {len(want)}: with drop_last, each rank gets "
                    f"dataset_size // num_replicas = {dataset_size} // {n}")
        return (f"{len(got)} indices, expected {len(want)}: without drop_last, the epoch is padded up to a multiple "
                f"of num_replicas, each rank gets ceil({dataset_size} / {n}) = {len(want)}")
    every = _pytorch(dataset_size, 1, 0, epoch, **kwargs)
    if n > 1 and got == [i for r in [rank] for i in every[r * len(want):(r + 1) * len(want)]] and got != want:
        return "a contiguous block of the permutation: DistributedSampler gives rank r every N-th index from r"
    if (kwargs["shuffle"] and epoch > 0 and got == _pytorch(dataset_size, n, rank, 0, **kwargs)
            and _repeats_epoch_0(Sampler, kwargs)):
        return "the order of epoch 0 again: seed the permutation from seed + epoch, so that each epoch reshuffles"
    if (kwargs["shuffle"] and got == _pytorch(dataset_size, n, rank, epoch, **{**kwargs, "shuffle": False})
            and _never_shuffles(Sampler, kwargs)):
        return "not shuffled: draw a permutation with torch.randperm"
    if sorted(got) == sorted(want):
        return "the right indices in another order: the permutation must come from a torch.Generator seeded with "\
               "seed + epoch (not the global RNG), with torch.randperm"
    if kwargs["drop_last"] and kwargs["shuffle"] and dataset_size % n:
        lost = _lost_hint(Sampler, dataset_size, n, kwargs["seed"])
        if lost:
            return lost
    padded = not kwargs["drop_last"] and len(want) * n > dataset_size  # with drop_last nothing is padded
    if padded and ((len(want) > 1 and got[:-1] == want[:-1]) or set(got) - set(want)):
        return "the padding: pad with the first indices of the permutation (repeated as often as needed)"
    return "different indices: shuffle from seed + epoch, pad or cut to a multiple of num_replicas, take every N-th"


def _verify_against_pytorch(Sampler):
    runs = 0
    for dataset_size in DATASET_SIZES:
        for n in range(1, 5):
            for drop_last in (False, True):
                for shuffle in (True, False):
                    kwargs = dict(shuffle=shuffle, seed=7, drop_last=drop_last)
                    for epoch in range(EPOCHS):
                        for rank in range(n):
                            sampler = _build(Sampler, dataset_size, n, rank, epoch, **kwargs)
                            got, want = list(sampler), _pytorch(dataset_size, n, rank, epoch, **kwargs)
                            runs += 1
                            if got != want or len(sampler) != len(want):
                                what = (f"len() is {len(sampler)}" if got == want
                                        else _sampler_hint(Sampler, got, want, dataset_size, n, rank, epoch, kwargs))
                                raise AssertionError(
                                    f"ShardedSampler({dataset_size} rows, {n} replicas, rank {rank}, "
                                    f"shuffle={shuffle}, drop_last={drop_last}), epoch {epoch}: got {got[:12]}, "
                                    f"DistributedSampler gives {want[:12]}: {what}")
    return runs


def _verify_each_row_once(Sampler):
    """Without padding (drop_last, or a dataset the world size divides) an epoch sees each row at most once,
    and, if nothing is dropped, every row."""
    for dataset_size in DATASET_SIZES:
        for n in range(1, 5):
            for drop_last in (False, True):
                if not drop_last and dataset_size % n:
                    continue
                for epoch in range(EPOCHS):
                    seen = [i for rank in range(n)
                            for i in _build(Sampler, dataset_size, n, rank, epoch, seed=3, drop_last=drop_last)]
                    want = dataset_size - dataset_size % n
                    if len(seen) != len(set(seen)) or len(seen) != want or not set(seen) <= set(range(dataset_size)):
                        raise AssertionError(f"ShardedSampler on {dataset_size} rows, {n} replicas, drop_last="
                                             f"{drop_last}, epoch {epoch}: the ranks together saw {len(set(seen))} "
                                             f"distinct rows in {len(seen)} indices; expected each of {want} rows once")


def _verify_every_row_over_epochs(Sampler):
    """With drop_last, each epoch drops other rows (the tail is cut after the shuffle): every row is yielded in 20
    epochs."""
    for dataset_size, n in ((3, 2), (13, 3), (13, 4)):
        lost = _lost_hint(Sampler, dataset_size, n, seed=3)
        if lost:
            raise AssertionError(f"ShardedSampler on {dataset_size} rows, {n} replicas, drop_last=True: {lost}")


def _verify_resume(Sampler):
    """Resumed at every step of two epochs, a sampler continues with the stopped one's next indices."""
    for dataset_size, n, local in ((13, 3, 2), (52, 4, 3), (10, 2, 1)):
        per_epoch = dataset_size // (local * n)
        for rank in range(n):
            whole = [_build(Sampler, dataset_size, n, rank, e, seed=5, drop_last=True) for e in range(2)]
            whole = [list(s) for s in whole]
            for step in range(2 * per_epoch):
                epoch, k = divmod(step, per_epoch)
                resumed = Sampler(dataset_size, n, rank, seed=5, drop_last=True)
                resumed.resume(step, local)
                got = list(resumed)[:(per_epoch - k) * local]
                want = whole[epoch][k * local:per_epoch * local]
                if got != want:
                    if got == whole[epoch][:len(got)] and k:
                        why = "it starts the epoch again: skip the indices of the steps already done in this epoch"
                    elif got == whole[0][k * local:k * local + len(got)] and epoch:
                        why = "it resumes in epoch 0: the epoch is step // steps_per_epoch"
                    else:
                        why = (f"expected the indices from this rank's {k * local}-th of epoch {epoch} on "
                               f"({per_epoch} steps per epoch of {local} per rank)")
                    raise AssertionError(f"ShardedSampler({dataset_size} rows, {n} replicas, rank {rank}) resumed "
                                         f"after {step} steps of {local} indices per rank: got {got}, the "
                                         f"uninterrupted sampler continues with {want}: {why}")


def _verify_global_rng_untouched(Sampler):
    """A sampler draws from its own generator: seeding or drawing from torch's global RNG would reset every
    rank's dropout and initialisation stream to the same values, and undo the RNG state a checkpoint restores."""
    state = torch.get_rng_state()
    torch.manual_seed(12345)
    before = torch.get_rng_state()
    for epoch in range(2):
        sampler = Sampler(13, 3, 1, seed=7)
        sampler.set_epoch(epoch)
        list(sampler)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    if not torch.equal(before, after):
        raise AssertionError("ShardedSampler changed torch's global RNG (torch.manual_seed, or torch.randperm "
                             "without a generator): shuffle with a torch.Generator of its own, seeded from "
                             "seed + epoch, as DistributedSampler does (the global RNG is the model's: dropout, "
                             "initialisation, and the state a checkpoint restores)")


def check_sampler(Sampler):
    """ShardedSampler against DistributedSampler; each row once per epoch; resumed against uninterrupted; its
    own generator, not torch's global RNG."""
    runs = _verify_against_pytorch(Sampler)
    _verify_each_row_once(Sampler)
    _verify_every_row_over_epochs(Sampler)
    _verify_resume(Sampler)
    _verify_global_rng_untouched(Sampler)
    print(f"ShardedSampler: correct, checked in this process (a sampler needs no communication, so no ranks): "
          f"index for index equal to DistributedSampler in {runs} cases (datasets of "
          f"{', '.join(map(str, DATASET_SIZES))} rows, 1-4 replicas, every rank, {EPOCHS} epochs, shuffled or not, "
          f"padded or drop_last); without padding each row once per epoch; resumed at every step of two epochs, "
          f"it continues where the stopped one was")


# ---------------------------------------------------------------- the checkpoint

def _other_world_sizes(world_size):
    """Load on the same world size and on others, uneven shards among them (under torchrun: torchrun's only)."""
    others = [n for n in (3, 2, 4) if n != world_size][:2]
    return runnable_world_sizes([world_size] + others)


LATE = 0.2  # seconds a rank is held back, so that code which does not wait for it shows it deterministically


def _saved_in_order(save_checkpoint):
    """save_checkpoint as the stopped run calls it, checking the order of a save: every rank but 0 writes its file
    LATE, rank 0 writes the metadata LATE; the metadata must find every shard written and come from rank 0 only,
    and no rank may return before it exists (a restart would find the checkpoint half done)."""
    def save(directory, state, shapes, rank, world_size):
        write_metadata, save_file = checkpoint.write_metadata, torch.save

        def late_save_file(*args, **kwargs):
            time.sleep(LATE)
            return save_file(*args, **kwargs)

        def checked_write_metadata(folder, metadata):
            if rank != 0:
                raise AssertionError(f"rank {rank} wrote the metadata: only rank 0 writes it (every rank writing "
                                     f"the same file at once can leave it half written)")
            missing = [r for r in range(world_size) if not os.path.exists(checkpoint.shard_path(folder, r))]
            if missing:
                raise AssertionError(f"rank 0 wrote the metadata before rank {missing[0]}'s shard file existed: the "
                                     f"metadata is the checkpoint's last file; wait for every rank's file (learning "
                                     f"the file sizes from every rank does) before writing it")
            time.sleep(LATE)
            write_metadata(folder, metadata)

        torch.save, checkpoint.write_metadata = (late_save_file if rank else save_file), checked_write_metadata
        try:
            save_checkpoint(directory, state, shapes, rank, world_size)
        finally:
            torch.save, checkpoint.write_metadata = save_file, write_metadata
        if not os.path.exists(checkpoint.metadata_path(directory)):
            raise AssertionError(f"save_checkpoint returned on rank {rank} before rank 0 had written the metadata: "
                                 f"return only once the checkpoint is complete (every rank waits for rank 0)")
    return save


def _read_what_overlaps(load_checkpoint):
    """load_checkpoint, checking that each rank reads (checkpoint.read_shard) each old shard that overlaps its new range
    once (and its own old file, for its RNG state), and no other: on N ranks each reads about 1/N of the
    checkpoint, not all of it."""
    def load(directory, shapes, rank, world_size):
        read_shard, reads = checkpoint.read_shard, []

        def counted(folder, old_rank, metadata):
            reads.append(old_rank)
            return read_shard(folder, old_rank, metadata)

        checkpoint.read_shard = counted
        try:
            state = load_checkpoint(directory, shapes, rank, world_size)
        finally:
            checkpoint.read_shard = read_shard
        if any(state.sharded.get(name) is None or state.sharded[name].numel() != fsdp.shard_numel(
                torch.Size(shape).numel(), world_size) for name, shape in shapes.items()):
            return state  # not resharded: the check says so, from the values
        saved_on = checkpoint.read_metadata(directory, shapes)["world_size"]
        needed = {old for shape in shapes.values() for old in _overlapping(torch.Size(shape).numel(), saved_on,
                                                                         rank, world_size)}
        needed |= {rank} if rank < saved_on else set()  # its own old file holds its RNG state
        if sorted(reads) != sorted(needed):
            raise AssertionError(f"load_checkpoint on rank {rank} of {world_size} read the old shards {reads} (saved "
                                 f"on {saved_on} ranks); it needs {sorted(needed)} (the old shards its new range "
                                 f"overlaps, and its own old file for its RNG state): read each of those once, and no "
                                 f"other")
        return state
    return load


def _overlapping(numel, saved_on, rank, world_size):
    """The old ranks whose shards hold part of `rank`'s new range of a tensor of `numel` elements."""
    old, new = fsdp.shard_numel(numel, saved_on), fsdp.shard_numel(numel, world_size)
    start, stop = rank * new, min((rank + 1) * new, numel)
    return [r for r in range(saved_on) if max(start, r * old) < min(stop, (r + 1) * old)]


def _resume(checked, directory, sizes, saved, saved_on, n):
    """The runs resumed on n ranks from the checkpoint; if one fails and what was loaded is wrong, say what."""
    try:
        return _spawn(sharded_run.train_main, n, "load_checkpoint", sizes, checked, directory=directory, resume=True)
    except AssertionError:
        states = _spawn(checkpoint.load_main, n, "load_checkpoint", checked, directory, sizes.shapes())
        if not any(isinstance(state, Exception) for state in states):
            _verify_loaded(saved, states, sizes, saved_on, n)
        raise


def _any_saved_on(world_size):
    """The world sizes verify_any_tensors saves on: the run's and 2, so that loading on 3 and 4 ranks gives ranks
    that did not exist at the save (they get fresh RNG states), whatever the run's world size."""
    return sorted(set(runnable_world_sizes([world_size, 2])), reverse=True)


def _spawn(fn, world_size, what, *args, copies_only=False, **kwargs):
    """fn on world_size ranks, a rank's failure an AssertionError naming `what`. copies_only: ranks that only save
    and load tensors (the same bits on any number of threads), so a rank of one runs apart (one thread, forked)
    rather than spawn's rank of one, which has the cores to itself and so starts the warm server: 3 s of notebook
    08's check."""
    try:
        if copies_only and world_size == 1:
            return [apart(fn, *args, timeout=CHECK_TIMEOUT)]
        return spawn(fn, world_size, *args, timeout=CHECK_TIMEOUT, **kwargs)
    except RankError as e:
        raise AssertionError(f"{what} failed on {world_size} ranks: {e}") from e


def _folder_digest(directory):
    digest = hashlib.sha256()
    for name, _ in checkpoint.file_bytes(directory).items():
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _verify_files(directory, sizes, world_size):
    """One shard file per rank holding only that rank's shards, and the metadata."""
    files = set(checkpoint.file_bytes(directory))
    want = {f"shard_{r}.pt" for r in range(world_size)} | {checkpoint.METADATA}
    if files != want:
        raise AssertionError(f"save_checkpoint on {world_size} ranks wrote {sorted(files)}; expected "
                             f"{sorted(want)}: one file per rank (checkpoint.shard_path) and rank 0's metadata")
    with open(checkpoint.metadata_path(directory)) as f:
        dtypes = json.load(f).get("dtypes")
    if not isinstance(dtypes, dict) or set(dtypes) != set(sizes.shapes()):
        raise AssertionError(f"the metadata's 'dtypes' is {str(dtypes)[:60]}; it must give every tensor's dtype, "
                             f"{{name: str(tensor.dtype)}} for each of state.sharded: a rank that holds only padding "
                             f"of a tensor reads no file for it, and makes its shard in that dtype")
    for rank in range(world_size):
        try:
            saved = torch.load(checkpoint.shard_path(directory, rank), weights_only=True)
        except pickle.UnpicklingError as e:
            refused = str(e).split("Unsupported global: GLOBAL ")[-1].split(" ")[0]
            raise AssertionError(f"shard_{rank}.pt cannot be loaded with torch.load(weights_only=True), the safe way "
                                 f"to read a checkpoint (it unpickles no code): it holds a {refused}; save plain "
                                 f"tensors in a dict, {{'sharded': ..., 'rng': ...}}") from None
        for name, shape in sizes.shapes().items():
            tensor = saved.get("sharded", {}).get(name) if isinstance(saved, dict) else None
            want_numel = fsdp.shard_numel(torch.Size(shape).numel(), world_size)
            if tensor is None:
                raise AssertionError(f"shard_{rank}.pt holds no '{name}' under 'sharded': save state.sharded")
            if tensor.numel() != want_numel:
                raise AssertionError(f"shard_{rank}.pt holds {tensor.numel()} elements of '{name}'; rank {rank}'s "
                                     f"shard has {want_numel}: each rank must write only its own shard")


def _verify_loaded(saved, loaded, sizes, saved_on, loaded_on):
    """The loaded TrainStates hold what was saved: the full tensors bit for bit, the shards of the new world
    size, the step, the sampler's position, each saved rank's RNG state."""
    where = f"saved on {saved_on} ranks, loaded on {loaded_on}"
    for rank, state in enumerate(loaded):
        if not isinstance(state, sharded_run.TrainState):
            raise AssertionError(f"{where}: load_checkpoint returned {type(state).__name__} on rank {rank}: return "
                                 f"an sharded_run.TrainState")
        for name, shape in sizes.shapes().items():
            want_numel = fsdp.shard_numel(torch.Size(shape).numel(), loaded_on)
            got = state.sharded.get(name)
            if got is None or got.numel() != want_numel:
                got_numel = None if got is None else got.numel()
                raise AssertionError(f"{where}: rank {rank}'s loaded shard of '{name}' has {got_numel} elements; on "
                                     f"{loaded_on} ranks a shard has {want_numel}: reshard (each rank takes its range "
                                     f"of the full flat tensor, from the old shards that hold it)")
            if got.dtype != saved[0].sharded[name].dtype:
                raise AssertionError(f"{where}: rank {rank}'s loaded '{name}' is {got.dtype}, the saved one "
                                     f"{saved[0].sharded[name].dtype}: save and load each tensor in its own dtype (a "
                                     f"cast on the way loses bits, or invents them)")
        if state.step != saved[0].step:
            raise AssertionError(f"{where}: rank {rank} loaded step {state.step}; {saved[0].step} were saved: "
                                 f"AdamW's bias correction depends on it")
        if state.sampler != saved[0].sampler:
            raise AssertionError(f"{where}: rank {rank} loaded the sampler position {state.sampler}; "
                                 f"{saved[0].sampler} was saved")
        _verify_rng(state.rng, [t.rng for t in saved], saved[0].sampler["seed"], saved[0].step, rank, where)
    got, want = sharded_run.full_state(loaded, sizes), sharded_run.full_state(saved, sizes)
    for name in sizes.shapes():
        if not torch.equal(got[name], want[name]):
            diff = max_abs_diff(got[name], want[name])
            raise AssertionError(f"{where}: the loaded '{name}', gathered, differs from the saved one by up to "
                                 f"{diff:.3g}: each rank must take elements [r * s', (r + 1) * s') of the full flat "
                                 f"tensor, s' = ceil(numel / {loaded_on}), from the old shards that hold them")
    return got


def _verify_rng(got, saved_rngs, seed, step, rank, where):
    """A saved rank gets its own saved RNG state back; a rank that did not exist at the save gets
    sharded_run.fresh_rng_state(seed, step, rank), no saved rank's (it would draw that rank's random numbers)."""
    own = rank < len(saved_rngs)
    want = saved_rngs[rank] if own else sharded_run.fresh_rng_state(seed, step, rank)
    if isinstance(got, torch.Tensor) and torch.equal(got, want):
        return
    whose = next((r for r, rng in enumerate(saved_rngs) if isinstance(got, torch.Tensor) and torch.equal(got, rng)),
                 None)
    got_what = f"rank {whose}'s saved RNG state" if whose is not None else "an RNG state no rank saved"
    if own:
        raise AssertionError(f"{where}: rank {rank} got {got_what}, not its own (saved by rank {rank}): a rank that "
                             f"existed at the save gets its own state back, from its own old file")
    raise AssertionError(f"{where}: rank {rank}, which did not exist when the checkpoint was saved (on "
                         f"{len(saved_rngs)} ranks), got {got_what}; it must get "
                         f"sharded_run.fresh_rng_state(seed, step, rank)"
                         + (f": with rank {whose}'s state it would draw the same random numbers as rank {whose}"
                            if whose is not None else ""))


def _dcp_main(rank, world_size, sizes, directory, full_state, saved_on):
    """dcp.save on `saved_on` ranks of the full state (the first saved_on ranks of this group save, all of them
    then load): run twice, as two process groups, by _dcp_round_trip."""
    model, optimizer = pytorch_reference.fsdp2_with_adamw(world_size, sizes.hidden_dim, sizes.num_layers, sizes.seed,
                                                          full_state if saved_on else None)
    if saved_on:
        pytorch_reference.dcp_save(directory, model, optimizer)
        return None
    return pytorch_reference.dcp_load(directory, model, optimizer)


def _as_dcp_state(full, step, names):
    return {"model": {name: full[name] for name in names},
            "optim": {"state": {name: {"step": torch.tensor(float(step)), "exp_avg": full[f"exp_avg.{name}"],
                                       "exp_avg_sq": full[f"exp_avg_sq.{name}"]} for name in names}}}


def _verify_against_dcp(loaded_full, saved_full, step, sizes, saved_on, world_sizes):
    """torch.distributed.checkpoint saves the same state on the same ranks, loads it on each world size: the
    same tensors as ours, bit for bit."""
    names = [n for n in sizes.shapes() if not n.startswith("exp_avg")]
    with checkpoint.temporary_checkpoint_folder() as directory:
        _spawn(_dcp_main, saved_on, "torch.distributed.checkpoint's save", sizes, directory,
               _as_dcp_state(saved_full, step, names), saved_on)
        for n in world_sizes:
            theirs = _spawn(_dcp_main, n, "torch.distributed.checkpoint's load", sizes, directory, None, 0)[0]
            ours = _as_dcp_state(loaded_full[n], step, names)
            for name in names:
                pairs = [("weight", ours["model"][name], theirs["model"][name])]
                pairs += [(k, ours["optim"]["state"][name][k], theirs["optim"]["state"][name][k])
                          for k in ("exp_avg", "exp_avg_sq", "step")]
                for what, a, b in pairs:
                    if not torch.equal(a.to(b.dtype), b):
                        raise AssertionError(f"saved on {saved_on} ranks, loaded on {n}: {name}'s {what} differs "
                                             f"from what torch.distributed.checkpoint loads by "
                                             f"{max_abs_diff(a, b):.3g}")


def _global_rows(trained, steps):
    return {step: sorted(i for t in trained for i in t.rows.get(step, [])) for step in steps}


def _verify_resumed(resumed, uninterrupted, sizes, stop_after, saved_on, n):
    where = f"saved on {saved_on} ranks after {stop_after} steps, resumed on {n}"
    steps = range(stop_after, sizes.num_steps)
    got_rows, want_rows = _global_rows(resumed, steps), _global_rows(uninterrupted, steps)
    for step in steps:
        if got_rows[step] != want_rows[step]:
            raise AssertionError(f"{where}: step {step} trained on rows {got_rows[step]}; the uninterrupted run on "
                                 f"{want_rows[step]}: the resumed run must continue the data order where the stopped "
                                 f"one was (save and load the sampler's position)")
    tolerance = 0.0 if n == saved_on else sharded_run.resume_tolerance(sizes)
    worst = 0.0
    for i, (got, want) in enumerate(zip(resumed[0].weights, uninterrupted[0].weights)):
        diff = max_abs_diff(got, want)
        worst = max(worst, diff)
        if diff > tolerance or (n == saved_on and not torch.equal(got, want)):
            raise AssertionError(f"{where}: after {sizes.num_steps} steps, weight {i} differs from the uninterrupted "
                                 f"run's by {diff:.3g} (allowed: {tolerance:g}): the loaded state was right, so look "
                                 f"at what the run needs that the state lacks (AdamW's moments and step)")
    return worst


def _verify_bad_input(student, directory, sizes):
    """Broken copies of the checkpoint: a clear error naming the file, and the checkpoint unchanged."""
    other = sharded_run.RunSizes(sizes.hidden_dim + 1, sizes.num_layers, sizes.dataset_size, sizes.global_batch_size,
                        sizes.num_steps, sizes.seed)
    cases = [("corrupted metadata", lambda d: open(checkpoint.metadata_path(d), "w").write("{\"world_size\": "),
              sizes, checkpoint.METADATA, "corrupted"),
             ("metadata without shapes", lambda d: _drop_key(d, "shapes"), sizes, checkpoint.METADATA, "corrupted"),
             ("a missing shard", lambda d: os.remove(checkpoint.shard_path(d, 1)), sizes, "shard_1.pt", "missing"),
             ("a truncated shard", lambda d: _truncate(checkpoint.shard_path(d, 0)), sizes, "shard_0.pt", "truncated"),
             ("another model", None, other, checkpoint.METADATA, "another model")]
    with tempfile.TemporaryDirectory() as root:  # every broken copy loaded in one launch
        folders = [os.path.join(root, str(i)) for i in range(len(cases))]
        for folder, (_, breakage, _, _, _) in zip(folders, cases):
            shutil.copytree(directory, folder)
            if breakage:
                breakage(folder)
        before = [_folder_digest(folder) for folder in folders]
        results = _spawn(_load_each_main, runnable_world_sizes([2])[0], "load_checkpoint", student.load_checkpoint,
                         list(zip(folders, [case[2].shapes() for case in cases])))
        for i, (what, _, _, file, words) in enumerate(cases):
            error = next((r[i] for r in results if isinstance(r[i], Exception)), None)
            if not isinstance(error, Exception):
                raise AssertionError(f"load_checkpoint of a checkpoint with {what} returned without an error: read "
                                     f"the metadata with checkpoint.read_metadata and the shards with "
                                     f"checkpoint.read_shard")
            message = str(error)
            if file not in message or words not in message:
                raise AssertionError(f"load_checkpoint of a checkpoint with {what} raised {type(error).__name__}: "
                                     f"{message!r}; the error must name {file} and say '{words}': read the metadata "
                                     f"with checkpoint.read_metadata and the shards with checkpoint.read_shard")
            if _folder_digest(folders[i]) != before[i]:
                raise AssertionError(f"load_checkpoint of a checkpoint with {what} changed the checkpoint's files: "
                                     f"loading must only read")
    return [case[0] for case in cases]


def _load_each_main(rank, world_size, load_checkpoint, folders_and_shapes):
    """Load each (folder, shapes): the TrainState, or the error (the broken copies)."""
    results = []
    for folder, shapes in folders_and_shapes:
        try:
            results.append(load_checkpoint(folder, shapes, rank, world_size))
        except Exception as e:  # noqa: BLE001 - every error is reported, by type and message
            results.append(e)
    return results


def _drop_key(directory, key):
    with open(checkpoint.metadata_path(directory)) as f:
        metadata = json.load(f)
    del metadata[key]
    with open(checkpoint.metadata_path(directory), "w") as f:
        json.dump(metadata, f)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def any_tensors():
    """{name: full tensor}: what a state may hold besides the run's float64 weights. Fewer elements than ranks, so
    that some ranks hold only padding: an int64 counter not exact in float64, float32, bfloat16, none at all."""
    return {"num_batches_tracked": torch.tensor([2**53 + 1]),
            "tokens_seen": torch.tensor([[2**62 + 3, -5, 2**53 + 1]]),
            "scale": torch.tensor([0.1, -3.5, 1e-30], dtype=torch.float32),
            "bias": torch.tensor([1 / 3, -7.0], dtype=torch.bfloat16),
            "empty": torch.zeros(0, 4, dtype=torch.float64)}


ANY_STEP = 3


def _any_rng(rank):
    """Rank `rank`'s saved RNG state in verify_any_tensors: its own, so that another rank's is told apart."""
    return sharded_run.fresh_rng_state(1, 0, rank)


def _save_any_main(rank, world_size, save_checkpoint, directory):
    tensors = any_tensors()
    state = sharded_run.TrainState({name: fsdp.shard(t, rank, world_size) for name, t in tensors.items()}, ANY_STEP,
                          {"seed": 0, "step": ANY_STEP}, _any_rng(rank))
    save_checkpoint(directory, state, {name: tuple(t.shape) for name, t in tensors.items()}, rank, world_size)


def _load_any_main(rank, world_size, load_checkpoint, directories):
    shapes = {name: tuple(t.shape) for name, t in any_tensors().items()}
    return [(state.sharded, state.rng) for state in (load_checkpoint(directory, shapes, rank, world_size)
                                                     for directory in directories)]


def verify_any_tensors(student, saved_on, loaded_on):
    """any_tensors() saved on each of `saved_on` world sizes, loaded on each of `loaded_on`: every tensor comes
    back bit for bit, every rank's shard in the tensor's own dtype (ranks holding only padding too)."""
    tensors = any_tensors()
    with checkpoint.temporary_checkpoint_folder() as root:
        folders = [os.path.join(root, str(n)) for n in saved_on]
        for n, folder in zip(saved_on, folders):
            os.makedirs(folder, exist_ok=True)
            _spawn(_save_any_main, n, "save_checkpoint", student.save_checkpoint, folder, copies_only=True)
        for m in loaded_on:
            loaded = _spawn(_load_any_main, m, "load_checkpoint", student.load_checkpoint, folders,
                            copies_only=True)
            for i, n in enumerate(saved_on):
                for name, full in tensors.items():
                    _verify_any_tensor(f"{name}, {full.dtype} of shape {tuple(full.shape)}, saved on {n} ranks, "
                                       f"loaded on {m}", full, [states[i][0][name] for states in loaded])
                for rank, states in enumerate(loaded):
                    _verify_rng(states[i][1], [_any_rng(r) for r in range(n)], 0, ANY_STEP, rank,
                                f"saved on {n} ranks, loaded on {m}")


def _verify_any_tensor(where, full, shards):
    per_rank = fsdp.shard_numel(full.numel(), len(shards))
    for rank, shard in enumerate(shards):
        if shard.dtype != full.dtype:
            held = min(per_rank, max(0, full.numel() - rank * per_rank))
            why = (f"rank {rank} holds only padding of it ({full.numel()} elements, {per_rank} per rank): it reads "
                   f"no file for it, so make its shard with the saved dtype (the metadata's dtypes)" if held == 0
                   else "keep the dtype of what was saved")
            raise AssertionError(f"{where}: rank {rank}'s shard is {shard.dtype}: {why}")
    got = fsdp.gather_shards([[shard] for shard in shards], [full.shape])[0]
    if not torch.equal(got, full):
        raise AssertionError(f"{where}: gathered, it is {got.flatten()[:4].tolist()}..., saved "
                             f"{full.flatten()[:4].tolist()}...: each rank takes its range of the full flat tensor "
                             f"from the old shards that hold it")


def check_checkpoint(save_checkpoint, load_checkpoint, Sampler, world_size, sizes, stop_after):
    """Stop, save, load on several world sizes, compare with what was saved and with DCP, resume, break it."""
    world_size = check_int("world_size", world_size)
    stop_after = check_int("stop_after", stop_after)
    if stop_after >= sizes.num_steps:
        raise ValueError(f"stop_after must be below num_steps={sizes.num_steps}, got {stop_after}")
    sharded_run.check_run_sizes(sizes, world_size)
    student = sharded_run.Student(Sampler, save_checkpoint, load_checkpoint)
    checked = sharded_run.Student(Sampler, _saved_in_order(save_checkpoint), _read_what_overlaps(load_checkpoint))
    world_sizes = _other_world_sizes(world_size)
    any_sizes = runnable_world_sizes([1, 2, 3, 4])
    # each stage stops the check at its first mistake, the cheap and telling ones first: the save; the load (and
    # resumed run) on the same world size, the uninterrupted run to compare it with; the loads on other world sizes;
    # broken copies; other tensors, and more ranks than saved; DCP last
    with checkpoint.temporary_checkpoint_folder() as directory:
        stopped = _spawn(sharded_run.train_main, world_size, "save_checkpoint", sizes, checked, stop_after=stop_after,
                         directory=directory)
        _verify_files(directory, sizes, world_size)
        saved = [t.saved for t in stopped]
        loaded_full, worst, uninterrupted = {}, {}, None
        for n in world_sizes:
            sharded_run.check_run_sizes(sizes, n)
            resumed = _resume(checked, directory, sizes, saved, world_size, n)
            loaded_full[n] = _verify_loaded(saved, [t.loaded for t in resumed], sizes, world_size, n)
            uninterrupted = uninterrupted or _spawn(sharded_run.train_main, world_size, "the uninterrupted run", sizes,
                                                    student)
            worst[n] = _verify_resumed(resumed, uninterrupted, sizes, stop_after, world_size, n)
        broken = _verify_bad_input(student, directory, sizes)
        saved_on = _any_saved_on(world_size)
        verify_any_tensors(student, saved_on, any_sizes)
        _verify_against_dcp(loaded_full, sharded_run.full_state(saved, sizes), saved[0].step, sizes, world_size,
                            world_sizes)
    others = [n for n in world_sizes if n != world_size]
    print(f"save_checkpoint / load_checkpoint: correct. Saved on {world_size} ranks after {stop_after} of "
          f"{sizes.num_steps} steps (one shard file per rank, each with only its shards), loaded on "
          f"{', '.join(map(str, world_sizes))} ranks: the weights, exp_avg, exp_avg_sq, step, sampler position and "
          f"each saved rank's RNG state are what was saved, bit for bit, and what torch.distributed.checkpoint "
          f"(FSDP2, dcp.save / dcp.load) loads from the same state. Resumed, the run ends with the uninterrupted "
          f"run's weights: exactly on {world_size} ranks"
          + "".join(f"; on {n} ranks within {sharded_run.resume_tolerance(sizes):g} (max difference "
                    f"{sharded_run.shown_difference(worst[n])})" for n in others)
          + f". Tensors of other dtypes and sizes (int64 beyond 2**53, float32, bfloat16, one with no elements; "
          f"fewer elements than ranks) saved on {' and '.join(map(str, saved_on))} ranks come back bit for bit, "
          f"each in its own dtype, on {', '.join(map(str, any_sizes))} ranks, ranks that hold only padding among them"
          + ("; loaded on more ranks than saved, each new rank gets a fresh RNG state, no saved rank's"
             if min(saved_on) < max(any_sizes) else "")
          + f". Broken copies "
          f"({', '.join(broken)}) get an error naming the file, and stay unchanged.")


# ---------------------------------------------------------------- the latest complete checkpoint

def _make_checkpoints(root, complete=(), incomplete=(), half_written=(), other=()):
    """Checkpoint folders as a run leaves them: complete ones (shards and metadata), incomplete ones (shards, no
    metadata: the run died while saving), half-written metadata (metadata.json.tmp only), and other files."""
    os.makedirs(root, exist_ok=True)
    for step in (*complete, *incomplete, *half_written):
        folder = checkpoint.checkpoint_folder(root, step)
        os.makedirs(folder)
        for rank in range(2):
            open(checkpoint.shard_path(folder, rank), "wb").close()
        if step in complete:  # what a save writes (a real one also holds shapes, sampler, shard bytes)
            checkpoint.write_metadata(folder, {"world_size": 2, "step": step})
        if step in half_written:
            open(checkpoint.metadata_path(folder) + ".tmp", "w").close()
    for name in other:
        os.makedirs(os.path.join(root, name))


LATEST_CASES = [
    # (what, how the folder is, the step expected or None)
    ("no folder yet (the first attempt)", None, None),
    ("an empty folder", {}, None),
    ("step_2 and step_4, complete", {"complete": (2, 4)}, 4),
    ("step_2, step_4, step_10 complete", {"complete": (2, 4, 10)}, 10),
    ("step_2, step_4 complete; step_6 without metadata.json (the run died while saving)",
     {"complete": (2, 4), "incomplete": (6,)}, 4),
    ("step_8 complete; step_10 with only metadata.json.tmp (died while writing the metadata)",
     {"complete": (8,), "half_written": (10,)}, 8),
    ("step_9, step_10 complete, and folders that are not checkpoints (step_x, logs)",
     {"complete": (9, 10), "other": ("step_x", "logs")}, 10),
    ("only step_3, without metadata.json", {"incomplete": (3,)}, None),
]


def _latest_hint(got, want, case, root):
    if isinstance(got, Exception):
        if case[1] is None:
            return f"it raised {type(got).__name__}: {got}: the first attempt has no checkpoint folder yet: return None"
        return f"it raised {type(got).__name__}: {got}: with no complete checkpoint, return None"
    if got is not None and not isinstance(got, str):
        return f"it returned {got!r}: return the checkpoint's folder, os.path.join(root, 'step_{{k}}') (or None)"
    name = os.path.basename(got) if isinstance(got, str) else got
    kind = case[1] or {}
    if isinstance(got, str) and os.path.dirname(os.path.normpath(got)) != os.path.normpath(root):
        return f"it returned {got!r}: return the checkpoint's folder, os.path.join(root, 'step_{{k}}')"
    unfinished = (*kind.get("incomplete", ()), *kind.get("half_written", ()))
    if name is not None and any(name == f"step_{s}" for s in unfinished):
        return (f"it chose {name}, whose saving did not finish (no metadata.json: it is written last): "
                f"take only complete checkpoints")
    steps = kind.get("complete", ())
    if name is not None and steps and name == f"step_{min(steps)}" and want is not None:
        return f"it chose {name}, the oldest: take the one with the most steps"
    if name is not None and steps and name == max(f"step_{s}" for s in steps):
        return f"it chose {name}: compare the step counts as numbers, not the names as strings ('step_10' < 'step_4')"
    return f"it returned {got!r}"


def check_latest_checkpoint(latest_checkpoint):
    """The latest complete checkpoint in folders as runs leave them (in this process: no ranks needed)."""
    for case in LATEST_CASES:
        what, kind, step = case
        with tempfile.TemporaryDirectory() as parent:
            root = os.path.join(parent, "checkpoints")
            if kind is not None:
                _make_checkpoints(root, **kind)
            want = None if step is None else checkpoint.checkpoint_folder(root, step)
            try:
                got = latest_checkpoint(root)
            except Exception as e:
                got = e
            if isinstance(got, Exception) or got is None or want is None:
                same = got is None and want is None
            else:
                same = isinstance(got, str) and os.path.normpath(got) == os.path.normpath(want)
            if not same:
                raise AssertionError(f"latest_checkpoint with {what}: expected "
                                     f"{'None' if want is None else os.path.basename(want)}; "
                                     f"{_latest_hint(got, want, case, root)}")
    print(f"latest_checkpoint: correct, checked in this process on {len(LATEST_CASES)} folders as runs leave them: "
          f"none yet, empty, step_10 after step_4 (numbers, not names), a save the run died in (no metadata.json, "
          f"or only its .tmp), folders that are not checkpoints")


# ---------------------------------------------------------------- one controller over RPC

def _single_process(hidden_dim, num_layers, batch_size, num_steps, num_stages, seed):
    """The whole MLP in this process, SGD: step 0's gradients and the final weights, split by stage."""
    from utils.model import build_mlp, loss_fn, make_optimizer, step_batches
    from utils.pipeline import stage_layers

    model = build_mlp(hidden_dim, num_layers, seed)
    optimizer, grads = make_optimizer(model.parameters(), "sgd"), None
    for batch in step_batches(batch_size, hidden_dim, seed, num_steps):
        loss_fn(model(batch)).backward()
        if grads is None:
            grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    ranges = stage_layers(num_layers, num_stages)
    return [[grads[i] for i in r] for r in ranges], [[weights[i] for i in r] for r in ranges]


def _controller_hint(got, want, num_micro_batches):
    m = num_micro_batches
    if m > 1 and torch.allclose(got, want * m, rtol=1e-9, atol=0):
        return f"{m} times too large, the number of micro-batches: divide each micro-batch's loss by {m}"
    if m > 1 and torch.allclose(got * m, want, rtol=1e-9, atol=0):
        return f"{m} times too small: each micro-batch's loss is divided by {m} once, not twice"
    return "not the whole batch's gradient: every micro-batch's loss (divided by their number) in one backward"


CONTROLLER_TIMEOUT = 8  # seconds; the right controller's run takes a fraction of one here


CONTROLLER_ERROR_HINTS = [  # (words in the controller's error, what they usually mean)
    ("requires_grad not set on root", "the loss does not depend on what the stages computed; send each micro-batch "
                                      "through every stage (stage.rpc_sync().forward(x)) inside the distributed "
                                      "autograd context"),
    ("graphTask_", "the distributed autograd context ran no backward: run it with dist_autograd.backward(context_id, "
                   "[loss]) (a local loss.backward() stops at the RPC boundary)"),
]


def check_controller(train_step, num_stages, hidden_dim, num_layers, batch_size, num_micro_batches, num_steps=2,
                     seed=0):
    """The controller's step against the single-process run and PyTorch's SPMD pipeline (notebook 04's reference:
    torch.distributed.pipelining's ScheduleGPipe, one process per stage)."""
    from utils.pipeline import check_sizes

    num_stages = check_int("num_stages", num_stages)
    check_sizes(num_layers, num_stages, batch_size, num_micro_batches)
    sizes = dict(hidden_dim=hidden_dim, num_layers=num_layers, batch_size=batch_size, num_steps=num_steps)
    try:
        run = rpc_controller.run_controller(train_step, num_stages, num_micro_batches=num_micro_batches, seed=seed,
                                timeout=CONTROLLER_TIMEOUT, **sizes)
    except RankError as e:
        hints = [hint for words, hint in CONTROLLER_ERROR_HINTS if words in e.summary]
        raise AssertionError(f"the controller's run failed{''.join(': ' + h for h in hints)}\n{e}") from e
    except TimeoutError as e:
        raise AssertionError(f"the controller's run did not finish: {e}\nA distributed backward waits for a "
                             f"gradient through every RPC call made in its context: each micro-batch's output must "
                             f"be part of the one loss, with one backward per context") from None
    where = f"{num_stages} stages, {num_micro_batches} micro-batches"
    if run.optimizer_steps != num_steps:
        why = ("once per step, after the backward of every micro-batch" if run.optimizer_steps
               else "never: call optimizer.step(context_id) inside the distributed autograd context")
        raise AssertionError(f"{where}: the optimizer stepped {run.optimizer_steps} times in {num_steps} steps; "
                             f"expected {num_steps}: {why}")
    want_grads, want_weights = _single_process(num_layers=num_layers, num_stages=num_stages, seed=seed,
                                               **{k: v for k, v in sizes.items() if k != "num_layers"})
    worst = 0.0
    for s, (got_stage, want_stage) in enumerate(zip(run.grads, want_grads)):
        for i, (got, want) in enumerate(zip(got_stage, want_stage)):
            if got is None:
                raise AssertionError(f"{where}: stage {s}'s weight {i} got no gradient in the distributed autograd "
                                     f"context: run the backward with dist_autograd.backward(context_id, [loss]) "
                                     f"inside the context (a local loss.backward() stops at the RPC boundary)")
            diff = max_abs_diff(got, want)
            if diff > TOLERANCE:
                hint = _controller_hint(got, want, num_micro_batches)
                raise AssertionError(f"{where}: step 0's gradient of stage {s}'s weight {i} differs from the "
                                     f"single-process run's by {diff:.3g}: {hint}")
    for s, (got_stage, want_stage) in enumerate(zip(run.weights, want_weights)):
        for i, (got, want) in enumerate(zip(got_stage, want_stage)):
            diff = max_abs_diff(got, want)
            worst = max(worst, diff)
            if diff > TOLERANCE:
                raise AssertionError(f"{where}: after {num_steps} steps, stage {s}'s weight {i} differs from the "
                                     f"single-process run's by {diff:.3g}, though step 0's gradients were right: one "
                                     f"optimizer step per batch, each in its own distributed autograd context")
    theirs = spawn(pytorch_reference.train_pipeline, num_stages, "gpipe", num_micro_batches=num_micro_batches,
                   optimizer="sgd", seed=seed, timeout=CHECK_TIMEOUT, **sizes)
    spmd = max(max_abs_diff(a, b) for got, pt in zip(run.weights, theirs) for a, b in zip(got, pt.weights))
    if spmd > TOLERANCE:
        raise AssertionError(f"{where}: the final weights differ from PyTorch's SPMD pipeline's (ScheduleGPipe) by "
                             f"{spmd:.3g}")

    print(f"train_step: correct. {num_stages} stages on their own workers, driven by one controller over RPC "
          f"({num_micro_batches} micro-batches, {num_steps} steps): step 0's gradients and the final weights equal "
          f"the single-process run's (max difference {sharded_run.shown_difference(worst)}) and PyTorch's SPMD "
          f"pipeline's, "
          f"ScheduleGPipe with one process per stage (max difference {sharded_run.shown_difference(spmd)})")
