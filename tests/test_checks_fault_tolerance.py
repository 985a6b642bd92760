"""utils.checks.fault_tolerance (notebook 08): the solution passes; each plausible wrong answer fails at its
exercise's own check, with a message that names the mistake. Right answers come from the solution notebook;
each wrong one is a small edit of it (utils.notebooks.solution)."""
import json
import os
import tempfile

import pytest

from utils import fault_tolerance as ft
from utils.checks.fault_tolerance import check_checkpoint, check_sampler
from utils.notebooks import solution

NOTEBOOK = "08_fault_tolerance"
SIZES = ft.RunSizes(hidden_dim=8, num_layers=3, dataset_size=52, global_batch_size=12, num_steps=6)
STOP_AFTER = 5


def edited(replace):
    return solution(NOTEBOOK, replace=replace)


def checkpoint(module, world_size=4):
    check_checkpoint(module.save_checkpoint, module.load_checkpoint, module.ShardedSampler, world_size, SIZES,
                     STOP_AFTER)


# ---------------------------------------------------------------- they pass

def test_right_answers_pass(capsys):
    sol = solution(NOTEBOOK)
    check_sampler(sol.ShardedSampler)
    checkpoint(sol)
    out = capsys.readouterr().out
    assert "DistributedSampler" in out and "torch.distributed.checkpoint" in out
    assert "loaded on 4, 3, 2 ranks" in out and "exactly on 4 ranks" in out


def test_sizes_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="global batch size 12 is not divisible by world size 5"):
        ft.check_run_sizes(SIZES, 5)
    with pytest.raises(ValueError, match="larger than the dataset"):
        ft.RunSizes(8, 3, 10, 12, 6)
    with pytest.raises(TypeError, match="num_replicas must be an int"):
        ft.check_sampler_sizes(10, 2.0, 0)
    with pytest.raises(ValueError, match="stop_after must be below num_steps=6"):
        checkpoint_sol = solution(NOTEBOOK)
        check_checkpoint(checkpoint_sol.save_checkpoint, checkpoint_sol.load_checkpoint, checkpoint_sol.ShardedSampler,
                         4, SIZES, 6)


def test_read_metadata_names_the_file_and_the_problem():
    shapes = {"w": (2, 3)}
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(ft.CheckpointError, match="metadata.json: not found"):
            ft.read_metadata(d, shapes)
        metadata = {"world_size": 2, "shapes": {"w": [2, 3]}, "step": 1, "sampler": {}, "shard_bytes": [5]}
        ft.write_metadata(d, metadata)
        with pytest.raises(ft.CheckpointError, match="corrupted: 1 shard sizes for world size 2"):
            ft.read_metadata(d, shapes)
        ft.write_metadata(d, {**metadata, "shard_bytes": [5, 5]})
        with pytest.raises(ft.CheckpointError, match="'w' has shape \\(2, 3\\) in the checkpoint, \\(3, 2\\)"):
            ft.read_metadata(d, {"w": (3, 2)})
        with pytest.raises(ft.CheckpointError, match="has no 'v': it is from another model"):
            ft.read_metadata(d, {"v": (2, 3)})
        assert ft.read_metadata(d, shapes)["shapes"] == {"w": (2, 3)}
        with pytest.raises(ft.CheckpointError, match="shard_0.pt: missing"):
            ft.read_shard(d, 0, ft.read_metadata(d, shapes))
        with open(ft.shard_path(d, 1), "wb") as f:
            f.write(b"12345")
        with pytest.raises(ft.CheckpointError, match="shard_1.pt: unreadable"):
            ft.read_shard(d, 1, ft.read_metadata(d, shapes))
        with open(ft.metadata_path(d), "w") as f:
            json.dump([1], f)
        with pytest.raises(ft.CheckpointError, match="corrupted: 'world_size' is missing"):
            ft.read_metadata(d, shapes)
        assert sorted(os.listdir(d)) == ["metadata.json", "shard_1.pt"]  # a reader writes nothing


def test_steps_per_epoch_do_not_depend_on_the_world_size():
    assert {ft.check_run_sizes(SIZES, n)[1] for n in (1, 2, 3, 4)} == {4}


# ---------------------------------------------------------------- they fail, saying why

SAMPLER = [
    ({"            indices += (indices * math.ceil(padding / len(indices)))[:padding]\n": ""},
     "without drop_last, the epoch is padded up"),
    ({"            indices += (indices * math.ceil(padding / len(indices)))[:padding]\n":
      "            indices += [indices[-1]] * padding\n"}, "the padding: pad with the first indices"),
    ({"        return indices[self.rank:self.total_size:self.num_replicas]":
      "        return indices[self.rank * self.num_samples:(self.rank + 1) * self.num_samples]"},
     "a contiguous block of the permutation"),
    ({"generator.manual_seed(self.seed + self.epoch)": "generator.manual_seed(self.seed)"},
     "the order of epoch 0 again"),
    ({"torch.randperm(self.dataset_size, generator=generator)": "torch.randperm(self.dataset_size)"},
     "from a torch.Generator seeded with seed \\+ epoch"),
    ({"            self.num_samples = dataset_size // num_replicas\n":
      "            self.num_samples = math.ceil(dataset_size / num_replicas)\n"},
     "with drop_last, each rank gets dataset_size // num_replicas"),
    ({"        self.set_epoch(epoch, start=step_in_epoch * local_batch_size)": "        self.set_epoch(epoch)"},
     "resumed after .* it starts the epoch again"),
    ({"        epoch, step_in_epoch = divmod(step, steps_per_epoch)":
      "        epoch, step_in_epoch = 0, step % steps_per_epoch"}, "it resumes in epoch 0"),
]


@pytest.mark.parametrize("replace, match", SAMPLER)
def test_wrong_sampler_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        check_sampler(edited(replace).ShardedSampler)


NOT_RESHARDED = "load_checkpoint failed on 3 ranks: .* elements on rank \\d of 3; .* reshard to the new world size"
CHECKPOINT = [
    # every rank writes the whole (gathered) tensors
    ({'torch.save({"sharded": state.sharded, "rng": state.rng}, path)':
      'torch.save({"sharded": {k: v.repeat(world_size) for k, v in state.sharded.items()}, "rng": state.rng}, path)'},
     "each rank must write only its own shard"),
    # AdamW's moments left out
    ({'torch.save({"sharded": state.sharded, "rng": state.rng}, path)':
      'torch.save({"sharded": {k: v for k, v in state.sharded.items() if not k.startswith("exp_avg")}, '
      '"rng": state.rng}, path)'}, "holds no 'exp_avg.layers.0.linear.weight'"),
    # loading assumes the world size it was saved on
    ({"old, new = fsdp.shard_numel(numel, saved_on), fsdp.shard_numel(numel, world_size)":
      "old = new = fsdp.shard_numel(numel, saved_on)"}, NOT_RESHARDED),
    # the offset inside an old shard forgotten
    ({"[lo - old_rank * old:hi - old_rank * old]": "[:hi - lo]"},
     "saved on 4 ranks, loaded on 3: the loaded '.*', gathered, differs from the saved one"),
    # the last shard not padded to the new shard size
    ({"        sharded[name] = F.pad(mine, (0, new - mine.numel()))  # the padding is never read\n":
      "        sharded[name] = mine\n"}, NOT_RESHARDED),
    # AdamW's step count not restored
    ({'return ft.TrainState(sharded, metadata["step"], metadata["sampler"], rng)':
      'return ft.TrainState(sharded, 0, metadata["sampler"], rng)'}, "loaded step 0; 5 were saved"),
    # the sampler's position not saved
    ({'"sampler": state.sampler,': '"sampler": {"seed": state.sampler["seed"], "step": 0},'},
     "loaded the sampler position"),
    # the RNG state not restored
    ({'        rng = old_shard(rank)["rng"]\n': "        rng = torch.get_rng_state()\n"},
     "did not get its own RNG state back"),
    # the shard sizes never gathered: the metadata says 0 bytes
    ({"    dist.all_gather_single(shard_bytes, torch.tensor([os.path.getsize(path)]))\n": ""},
     "the metadata says 0"),
    # the metadata read by hand: a corrupted file's error does not name it
    ({"    metadata = ft.read_metadata(directory, shapes)\n":
      "    metadata = __import__('json').load(open(ft.metadata_path(directory)))\n"},
     "corrupted metadata raised .* must name metadata.json"),
]


@pytest.mark.parametrize("replace, match", CHECKPOINT)
def test_wrong_checkpoint_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        checkpoint(edited(replace))


def test_resumed_run_without_adamw_state_is_caught():
    """A TrainState applied without the moments: the loaded state is right, the resumed weights are not."""
    sol = solution(NOTEBOOK)
    original = ft.ShardedRun.load_state

    def without_moments(self, state):
        original(self, state)
        self.optimizer.state.clear()

    ft.ShardedRun.load_state = without_moments
    try:
        with pytest.raises(AssertionError, match="weight 0 differs from the uninterrupted run's"):
            checkpoint(sol)
    finally:
        ft.ShardedRun.load_state = original


def test_the_check_says_where_the_data_order_diverged():
    """A sampler that resumes at the start of the epoch passes a sampler's state through the checkpoint, but
    the resumed run trains on other rows."""
    wrong = edited({"        self.set_epoch(epoch, start=step_in_epoch * local_batch_size)":
                    "        self.set_epoch(epoch)"})
    with pytest.raises(AssertionError, match="step 5 trained on rows .* continue the data order"):
        check_checkpoint(wrong.save_checkpoint, wrong.load_checkpoint, wrong.ShardedSampler, 4, SIZES, STOP_AFTER)


def test_checkpoints_leave_no_folders_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # every temporary folder of the check goes here
    checkpoint(solution(NOTEBOOK), world_size=2)
    assert os.listdir(tmp_path) == []
