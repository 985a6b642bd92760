"""Checks for notebook 08 (runs that survive): the sampler, the sharded checkpoint.

- check_sampler: in this process (a sampler communicates nothing): index for index against
  torch.utils.data.DistributedSampler, every row once per epoch without padding, resumed against
  uninterrupted;
- check_checkpoint: on ranks: what a stopped run saved is what the loaded one holds, on the same and on other
  world sizes (uneven shards), bit for bit, and what torch.distributed.checkpoint (FSDP2) loads from the same
  state; resumed runs end with the uninterrupted run's weights; broken checkpoints get errors naming the file.
"""
import hashlib
import os
import shutil
import tempfile

import torch
from torch.utils.data import DistributedSampler

from utils import fault_tolerance as ft
from utils import fsdp, pytorch_reference
from utils.checks import CHECK_TIMEOUT, max_abs_diff
from utils.launch import RankError, runnable_world_sizes, spawn
from utils.sizes import check_int

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


def _sampler_hint(got, want, dataset_size, n, rank, epoch, kwargs):
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
    if kwargs["shuffle"] and epoch > 0 and got == _pytorch(dataset_size, n, rank, 0, **kwargs):
        return "the order of epoch 0 again: seed the permutation from seed + epoch, so that each epoch reshuffles"
    if kwargs["shuffle"] and got == _pytorch(dataset_size, n, rank, epoch, **{**kwargs, "shuffle": False}):
        return "not shuffled: draw a permutation with torch.randperm"
    if sorted(got) == sorted(want):
        return "the right indices in another order: the permutation must come from a torch.Generator seeded with "\
               "seed + epoch (not the global RNG), with torch.randperm"
    unpadded = dataset_size - dataset_size % n if kwargs["drop_last"] else dataset_size
    if got[:-1] == want[:-1] or (len(want) * n > unpadded and set(got) - set(want)):
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
                                        else _sampler_hint(got, want, dataset_size, n, rank, epoch, kwargs))
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


def check_sampler(Sampler):
    """ShardedSampler against DistributedSampler; each row once per epoch; resumed against uninterrupted."""
    runs = _verify_against_pytorch(Sampler)
    _verify_each_row_once(Sampler)
    _verify_resume(Sampler)
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


def _spawn(fn, world_size, what, *args, **kwargs):
    try:
        return spawn(fn, world_size, *args, timeout=CHECK_TIMEOUT, **kwargs)
    except RankError as e:
        raise AssertionError(f"{what} failed on {world_size} ranks: {e}") from e


def _folder_digest(directory):
    digest = hashlib.sha256()
    for name, _ in ft.file_bytes(directory).items():
        with open(os.path.join(directory, name), "rb") as f:
            digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _verify_files(directory, sizes, world_size):
    """One shard file per rank holding only that rank's shards, and the metadata."""
    files = set(ft.file_bytes(directory))
    want = {f"shard_{r}.pt" for r in range(world_size)} | {ft.METADATA}
    if files != want:
        raise AssertionError(f"save_checkpoint on {world_size} ranks wrote {sorted(files)}; expected "
                             f"{sorted(want)}: one file per rank (ft.shard_path) and rank 0's metadata")
    for rank in range(world_size):
        saved = torch.load(ft.shard_path(directory, rank), weights_only=True)
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
        if not isinstance(state, ft.TrainState):
            raise AssertionError(f"{where}: load_checkpoint returned {type(state).__name__} on rank {rank}: return "
                                 f"an ft.TrainState")
        for name, shape in sizes.shapes().items():
            want_numel = fsdp.shard_numel(torch.Size(shape).numel(), loaded_on)
            got = state.sharded.get(name)
            if got is None or got.numel() != want_numel:
                got_numel = None if got is None else got.numel()
                raise AssertionError(f"{where}: rank {rank}'s loaded shard of '{name}' has {got_numel} elements; on "
                                     f"{loaded_on} ranks a shard has {want_numel}: reshard (each rank takes its range "
                                     f"of the full flat tensor, from the old shards that hold it)")
        if state.step != saved[0].step:
            raise AssertionError(f"{where}: rank {rank} loaded step {state.step}; {saved[0].step} were saved: "
                                 f"AdamW's bias correction depends on it")
        if state.sampler != saved[0].sampler:
            raise AssertionError(f"{where}: rank {rank} loaded the sampler position {state.sampler}; "
                                 f"{saved[0].sampler} was saved")
        if rank < saved_on and not torch.equal(state.rng, saved[rank].rng):
            raise AssertionError(f"{where}: rank {rank} did not get its own RNG state back (saved by rank {rank})")
    got, want = ft.full_state(loaded, sizes), ft.full_state(saved, sizes)
    for name in sizes.shapes():
        if not torch.equal(got[name], want[name]):
            diff = max_abs_diff(got[name], want[name])
            raise AssertionError(f"{where}: the loaded '{name}', gathered, differs from the saved one by up to "
                                 f"{diff:.3g}: each rank must take elements [r * s', (r + 1) * s') of the full flat "
                                 f"tensor, s' = ceil(numel / {loaded_on}), from the old shards that hold them")
    return got


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
    with ft.temporary_checkpoint_folder() as directory:
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
    tolerance = 0.0 if n == saved_on else ft.resume_tolerance(sizes)
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
    other = ft.RunSizes(sizes.hidden_dim + 1, sizes.num_layers, sizes.dataset_size, sizes.global_batch_size,
                        sizes.num_steps, sizes.seed)
    cases = [("corrupted metadata", lambda d: open(ft.metadata_path(d), "w").write("{\"world_size\": "),
              sizes, ft.METADATA, "corrupted"),
             ("metadata without shapes", lambda d: _drop_key(d, "shapes"), sizes, ft.METADATA, "corrupted"),
             ("a missing shard", lambda d: os.remove(ft.shard_path(d, 1)), sizes, "shard_1.pt", "missing"),
             ("a truncated shard", lambda d: _truncate(ft.shard_path(d, 0)), sizes, "shard_0.pt", "truncated"),
             ("another model", None, other, ft.METADATA, "another model")]
    for what, breakage, shapes_of, file, words in cases:
        with tempfile.TemporaryDirectory() as broken:
            shutil.copytree(directory, broken, dirs_exist_ok=True)
            if breakage:
                breakage(broken)
            before = _folder_digest(broken)
            results = _spawn(ft.load_main, runnable_world_sizes([2])[0], "load_checkpoint", student, broken,
                             shapes_of.shapes())
            error = next((e for e in results if isinstance(e, Exception)), None)
            if not isinstance(error, Exception):
                raise AssertionError(f"load_checkpoint of a checkpoint with {what} returned without an error: read "
                                     f"the metadata with ft.read_metadata and the shards with ft.read_shard")
            message = str(error)
            if file not in message or words not in message:
                raise AssertionError(f"load_checkpoint of a checkpoint with {what} raised {type(error).__name__}: "
                                     f"{message!r}; the error must name {file} and say '{words}': read the metadata "
                                     f"with ft.read_metadata and the shards with ft.read_shard")
            if _folder_digest(broken) != before:
                raise AssertionError(f"load_checkpoint of a checkpoint with {what} changed the checkpoint's files: "
                                     f"loading must only read")
    return [case[0] for case in cases]


def _drop_key(directory, key):
    import json

    with open(ft.metadata_path(directory)) as f:
        metadata = json.load(f)
    del metadata[key]
    with open(ft.metadata_path(directory), "w") as f:
        json.dump(metadata, f)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def check_checkpoint(save_checkpoint, load_checkpoint, Sampler, world_size, sizes, stop_after):
    """Stop, save, load on several world sizes, compare with what was saved and with DCP, resume, break it."""
    world_size = check_int("world_size", world_size)
    stop_after = check_int("stop_after", stop_after)
    if stop_after >= sizes.num_steps:
        raise ValueError(f"stop_after must be below num_steps={sizes.num_steps}, got {stop_after}")
    ft.check_run_sizes(sizes, world_size)
    student = ft.Student(Sampler, save_checkpoint, load_checkpoint)
    world_sizes = _other_world_sizes(world_size)
    uninterrupted = _spawn(ft.train_main, world_size, "the uninterrupted run", sizes, student)
    with ft.temporary_checkpoint_folder() as directory:
        stopped = _spawn(ft.train_main, world_size, "save_checkpoint", sizes, student, stop_after=stop_after,
                         directory=directory)
        _verify_files(directory, sizes, world_size)
        saved = [t.saved for t in stopped]
        loaded_full, worst = {}, {}
        for n in world_sizes:
            ft.check_run_sizes(sizes, n)
            resumed = _spawn(ft.train_main, n, "load_checkpoint", sizes, student, directory=directory, resume=True)
            loaded_full[n] = _verify_loaded(saved, [t.loaded for t in resumed], sizes, world_size, n)
            worst[n] = _verify_resumed(resumed, uninterrupted, sizes, stop_after, world_size, n)
        _verify_against_dcp(loaded_full, ft.full_state(saved, sizes), saved[0].step, sizes, world_size, world_sizes)
        broken = _verify_bad_input(student, directory, sizes)
    others = [n for n in world_sizes if n != world_size]
    print(f"save_checkpoint / load_checkpoint: correct. Saved on {world_size} ranks after {stop_after} of "
          f"{sizes.num_steps} steps (one shard file per rank, each with only its shards), loaded on "
          f"{', '.join(map(str, world_sizes))} ranks: the weights, exp_avg, exp_avg_sq, step, sampler position and "
          f"each saved rank's RNG state are what was saved, bit for bit, and what torch.distributed.checkpoint "
          f"(FSDP2, dcp.save / dcp.load) loads from the same state. Resumed, the run ends with the uninterrupted "
          f"run's weights: exactly on {world_size} ranks"
          + "".join(f"; on {n} ranks within {ft.resume_tolerance(sizes):g} (max difference "
                    f"{'0' if worst[n] == 0 else f'{worst[n]:.1e}'})" for n in others)
          + f". Broken copies ({', '.join(broken)}) get an error naming the file, and stay unchanged.")
