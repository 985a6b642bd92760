"""A sharded checkpoint (notebook 08, section 2): its files, its metadata, where checkpoints go.

A checkpoint is a folder: `shard_{r}.pt` written by rank r (its shards and RNG state: a
utils.sharded_run.TrainState), and `metadata.json` written by rank 0 once every shard is on disk (the world
size it was saved on, every tensor's full shape, the replicated values, each shard file's size). The
metadata is what lets N' ranks load what N ranks saved: rank r' computes which elements of each full flat
tensor it owns now, and reads them from the old shard files that hold them. A run that saves as it goes
keeps each checkpoint in a folder of its own, root/step_{k}.
"""
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import tempfile

import torch
import torch.distributed as dist

from utils import pytorch_reference
from utils.bench import interleaved_samples
from utils.launch import under_torchrun
from utils.model import loss_fn
from utils.sharded_run import ShardedRun, check_run_sizes, dataset

METADATA = "metadata.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong with it."""


def shard_path(directory, rank):
    return os.path.join(directory, f"shard_{rank}.pt")


def metadata_path(directory):
    return os.path.join(directory, METADATA)


# ---------------------------------------------------------------- where checkpoints go

CHECKPOINT_FOLDER = re.compile(r"^step_(\d+)$")  # root/step_{k}: the checkpoint saved after k steps


def checkpoint_folder(root, step):
    return os.path.join(root, f"step_{step}")


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


def load_main(rank, world_size, student, directory, shapes):
    """Only load (the bad-input checks): the TrainState, or the error's type and message."""
    try:
        return student.load_checkpoint(directory, shapes, rank, world_size)
    except Exception as e:
        return e


# ---------------------------------------------------------------- measurements

def save_load_seconds_main(rank, world_size, sizes, student, ours, theirs, repeat=3):
    """{"save", "load", "dcp.save", "dcp.load": [seconds of each timed run, slowest rank]} of the same sizes (one step in),
    saved with save_checkpoint under `ours` and with dcp.save under `theirs`, each run to a new folder, and
    loaded back into the run on the same world size (ours: load_checkpoint, then ShardedRun.load_state; DCP's:
    dcp.load, then set_state_dict)."""
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

    seconds = interleaved_samples({"save": save, "dcp.save": lambda: pytorch_reference.dcp_save(
        folder("theirs", 1), model, optimizer)}, repeat=repeat)
    seconds.update(interleaved_samples({"load": load, "dcp.load": lambda: pytorch_reference.dcp_load(
        folder("theirs", 0), model, optimizer, full=False)}, repeat=repeat))
    return seconds


def checkpoint_files(directory):
    """(bytes of each rank's file, bytes of the rest: the metadata) of a checkpoint folder, ours or DCP's."""
    files = file_bytes(directory)
    shards = [size for name, size in files.items() if name.startswith("shard_") or name.endswith(".distcp")]
    return shards, sum(files.values()) - sum(shards)
