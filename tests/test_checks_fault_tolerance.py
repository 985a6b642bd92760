"""utils.checks.fault_tolerance (notebook 08): the solution passes; each plausible wrong answer fails at its
exercise's own check, with a message that names the mistake. Right answers come from the solution notebook;
each wrong one is a small edit of it (utils.notebooks.solution)."""
import json
import os
import tempfile

import pytest
import torch

from utils import checkpoint as ckpt  # as: `checkpoint` is this file's helper that runs check_checkpoint
from utils import elastic, fsdp, sharded_run
from utils.checks import fault_tolerance as checks_ft
from utils.checks.fault_tolerance import (
    _save_any_main,
    any_tensors,
    check_checkpoint,
    check_controller,
    check_latest_checkpoint,
    check_sampler,
    verify_any_tensors,
)
from utils.launch import spawn
from utils.notebooks import solution

NOTEBOOK = "08_fault_tolerance"
SIZES = sharded_run.RunSizes(hidden_dim=8, num_layers=3, dataset_size=52, global_batch_size=12, num_steps=6)
STOP_AFTER = 5


def edited(replace):
    return solution(NOTEBOOK, replace=replace)


def checkpoint(module, world_size=4):
    check_checkpoint(module.save_checkpoint, module.load_checkpoint, module.ShardedSampler, world_size, SIZES,
                     STOP_AFTER)


# ---------------------------------------------------------------- they pass

@pytest.mark.slow  # 10 s; notebook 08's own strict nbval run (default run) makes the same four checks on the right
# answers and compares their verdicts
def test_right_answers_pass(capsys):
    sol = solution(NOTEBOOK)
    check_sampler(sol.ShardedSampler)
    checkpoint(sol)
    check_latest_checkpoint(sol.latest_checkpoint)
    controller(sol)
    out = capsys.readouterr().out
    assert "DistributedSampler" in out and "torch.distributed.checkpoint" in out and "latest_checkpoint: correct" in out
    assert "train_step: correct" in out
    assert "loaded on 4, 3, 2 ranks" in out and "exactly on 4 ranks" in out


def test_latest_checkpoint_may_read_the_metadata():
    """The fake complete checkpoints hold metadata as a save writes it: an answer that reads it is right."""
    reads = edited({"and os.path.exists(checkpoint.metadata_path(os.path.join(root, name)))]":
                    "and os.path.exists(checkpoint.metadata_path(os.path.join(root, name)))\n"
                    "                and __import__('json').load(open(checkpoint.metadata_path(\n"
                    "                    os.path.join(root, name))))]"})
    check_latest_checkpoint(reads.latest_checkpoint)


def test_sizes_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="global batch size 12 is not divisible by world size 5"):
        sharded_run.check_run_sizes(SIZES, 5)
    with pytest.raises(ValueError, match="larger than the dataset"):
        sharded_run.RunSizes(8, 3, 10, 12, 6)
    with pytest.raises(TypeError, match="num_replicas must be an int"):
        sharded_run.check_sampler_sizes(10, 2.0, 0)
    with pytest.raises(ValueError, match="stop_after must be below num_steps=6"):
        checkpoint_sol = solution(NOTEBOOK)
        check_checkpoint(checkpoint_sol.save_checkpoint, checkpoint_sol.load_checkpoint, checkpoint_sol.ShardedSampler,
                         4, SIZES, 6)


def test_read_metadata_names_the_file_and_the_problem():
    shapes = {"w": (2, 3)}
    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(ckpt.CheckpointError, match="metadata.json: not found"):
            ckpt.read_metadata(d, shapes)
        metadata = {"world_size": 2, "shapes": {"w": [2, 3]}, "dtypes": {"w": "torch.int64"}, "step": 1,
                    "sampler": {}, "shard_bytes": [5]}
        ckpt.write_metadata(d, metadata)
        with pytest.raises(ckpt.CheckpointError, match="corrupted: 1 shard sizes for world size 2"):
            ckpt.read_metadata(d, shapes)
        ckpt.write_metadata(d, {**metadata, "shard_bytes": [5, 5]})
        with pytest.raises(ckpt.CheckpointError, match="'w' has shape \\(2, 3\\) in the checkpoint, \\(3, 2\\)"):
            ckpt.read_metadata(d, {"w": (3, 2)})
        with pytest.raises(ckpt.CheckpointError, match="has no 'v': it is from another model"):
            ckpt.read_metadata(d, {"v": (2, 3)})
        assert ckpt.read_metadata(d, shapes)["shapes"] == {"w": (2, 3)}
        assert ckpt.read_metadata(d, shapes)["dtypes"] == {"w": torch.int64}
        ckpt.write_metadata(d, {**metadata, "shard_bytes": [5, 5], "dtypes": {"w": "torch.nn"}})
        with pytest.raises(ckpt.CheckpointError, match="metadata.json: corrupted: the dtype of 'w' is 'torch.nn', not"):
            ckpt.read_metadata(d, shapes)
        ckpt.write_metadata(d, {**metadata, "shard_bytes": [5, 5]})
        with pytest.raises(ckpt.CheckpointError, match="shard_0.pt: missing"):
            ckpt.read_shard(d, 0, ckpt.read_metadata(d, shapes))
        with open(ckpt.shard_path(d, 1), "wb") as f:
            f.write(b"12345")
        with pytest.raises(ckpt.CheckpointError, match="shard_1.pt: unreadable"):
            ckpt.read_shard(d, 1, ckpt.read_metadata(d, shapes))
        with open(ckpt.metadata_path(d), "w") as f:
            json.dump([1], f)
        with pytest.raises(ckpt.CheckpointError, match="corrupted: 'world_size' is missing"):
            ckpt.read_metadata(d, shapes)
        assert sorted(os.listdir(d)) == ["metadata.json", "shard_1.pt"]  # a reader writes nothing


def test_resume_refuses_what_has_no_step_to_resume_at():
    """local_batch_size 0 and a global batch larger than the dataset were a ZeroDivisionError; a negative step was
    taken for a step of the last epoch."""
    sampler = solution(NOTEBOOK).ShardedSampler(52, 4, 1, drop_last=True)
    for step, local, error, match in (
            (0, 0, ValueError, "local_batch_size must be at least 1, got 0"),
            (0, 14, ValueError, "14 x 4 replicas = 56 rows per step, more than the dataset \\(52 rows"),
            (-1, 3, ValueError, "step must be at least 0, got -1"),
            (1.0, 3, TypeError, "step must be an int")):
        with pytest.raises(error, match=match):
            sampler.resume(step, local)
    sampler.resume(4, 13)  # one step per epoch: epoch 4
    assert (sampler.epoch, sampler.start) == (4, 0)


def test_tensors_of_any_dtype_and_size_round_trip_on_every_world_size():
    """int64 beyond 2**53, float32, bfloat16 and a tensor with no elements, saved on N and loaded on M ranks (N, M in
    1..4; ranks that hold only padding among them): bit for bit, each in its own dtype."""
    sol = solution(NOTEBOOK)
    verify_any_tensors(sharded_run.Student(sol.ShardedSampler, sol.save_checkpoint, sol.load_checkpoint), [1, 2, 3, 4],
                       [1, 2, 3, 4])


def _dcp_main(rank, world_size, directory, save, tensors):
    """torch.distributed.checkpoint with each tensor a DTensor sharded along dim 0 (unevenly where it must)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {name: distribute_tensor(t if save else torch.zeros_like(t), mesh, [Shard(0)])
             for name, t in tensors.items()}
    (dcp.save if save else dcp.load)(state, checkpoint_id=directory)
    return {name: d.full_tensor() for name, d in state.items()}


def _ours_main(rank, world_size, load_checkpoint, directory, shapes):
    return load_checkpoint(directory, shapes, rank, world_size).sharded


@pytest.mark.parametrize("saved_on, loaded_on", [(4, 2), (1, 3), (3, 4)])
def test_any_tensors_load_as_torch_distributed_checkpoint_loads_them(saved_on, loaded_on, tmp_path):
    """The same tensors saved by dcp.save and by save_checkpoint on N ranks, loaded on M: the same dtypes and bits
    (DCP keeps each tensor's dtype in its metadata too)."""
    sol = solution(NOTEBOOK)
    tensors = any_tensors()
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    spawn(_dcp_main, saved_on, str(tmp_path / "dcp"), True, tensors)
    theirs = spawn(_dcp_main, loaded_on, str(tmp_path / "dcp"), False, tensors)[0]
    (tmp_path / "ours").mkdir()
    spawn(_save_any_main, saved_on, sol.save_checkpoint, str(tmp_path / "ours"))
    shards = spawn(_ours_main, loaded_on, sol.load_checkpoint, str(tmp_path / "ours"), shapes)
    for name, shape in shapes.items():
        ours = fsdp.gather_shards([[s[name]] for s in shards], [shape])[0]
        assert ours.dtype == theirs[name].dtype == tensors[name].dtype
        assert torch.equal(ours, theirs[name]) and torch.equal(ours, tensors[name])


def test_steps_per_epoch_do_not_depend_on_the_world_size():
    assert {sharded_run.check_run_sizes(SIZES, n)[1] for n in (1, 2, 3, 4)} == {4}


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
     "from a torch.Generator seeded with seed \\+ epoch"),  # on a few rows, by chance in order: not "not shuffled"
    ({"torch.randperm(self.dataset_size, generator=generator).tolist()": "list(range(self.dataset_size))"},
     "not shuffled: draw a permutation"),
    ({"            self.num_samples = dataset_size // num_replicas\n":
      "            self.num_samples = math.ceil(dataset_size / num_replicas)\n"},
     "with drop_last, each rank gets dataset_size // num_replicas"),
    ({"        self.set_epoch(epoch, start=step_in_epoch * local_batch_size)": "        self.set_epoch(epoch)"},
     "resumed after .* it starts the epoch again"),
    ({"        epoch, step_in_epoch = divmod(step, steps_per_epoch)":
      "        epoch, step_in_epoch = 0, step % steps_per_epoch"}, "it resumes in epoch 0"),
    # the same permutation, from torch's global RNG (seeded with seed + epoch): every rank's dropout reset
    ({"            generator = torch.Generator()\n            generator.manual_seed(self.seed + self.epoch)\n"
      "            indices = torch.randperm(self.dataset_size, generator=generator).tolist()":
      "            torch.manual_seed(self.seed + self.epoch)\n"
      "            indices = torch.randperm(self.dataset_size).tolist()"}, "changed torch's global RNG"),
]


# issue 43: the tail cut before the shuffle (a permutation of the rows that fit, or the others filtered out): the
# same last rows are dropped in every epoch; one index per rank made got[:-1] == want[:-1] name the padding
TAIL_CUT_FIRST = [
    {"torch.randperm(self.dataset_size, generator=generator)":
     "torch.randperm(self.total_size if self.drop_last else self.dataset_size, generator=generator)"},
    {"torch.randperm(self.dataset_size, generator=generator).tolist()":
     "[i for i in torch.randperm(self.dataset_size, generator=generator).tolist() if i < self.total_size]"},
]
SAMPLER += [(replace, "drop_last=True\\), epoch 0: .*the rows were cut to a multiple of num_replicas before the "
                      "shuffle, so the same rows are dropped in every epoch \\(of \\d+ rows, rows? .* never yielded "
                      "in 20 epochs\\): shuffle all the rows, then cut the permutation's tail")
            for replace in TAIL_CUT_FIRST]


def test_every_row_over_epochs_is_checked_beside_distributed_sampler():
    """The second line: a sampler that cuts the tail first loses the same rows in every epoch, whatever its order."""
    with pytest.raises(AssertionError, match="3 rows, 2 replicas, drop_last=True: .* row 2 never yielded"):
        checks_ft._verify_every_row_over_epochs(edited(TAIL_CUT_FIRST[0]).ShardedSampler)
    checks_ft._verify_every_row_over_epochs(solution(NOTEBOOK).ShardedSampler)


@pytest.mark.parametrize("replace, match", SAMPLER)
def test_wrong_sampler_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        check_sampler(edited(replace).ShardedSampler)


NOT_RESHARDED = ("saved on 4 ranks, loaded on 3: rank \\d's loaded shard of '.*' has \\d+ elements; on 3 ranks a "
                 "shard has 22: reshard \\(each rank takes its range of the full flat tensor")
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
    ({'return sharded_run.TrainState(sharded, metadata["step"], metadata["sampler"], rng)':
      'return sharded_run.TrainState(sharded, 0, metadata["sampler"], rng)'}, "loaded step 0; 5 were saved"),
    # the sampler's position not saved
    ({'"sampler": state.sampler,': '"sampler": {"seed": state.sampler["seed"], "step": 0},'},
     "loaded the sampler position"),
    # the RNG state not restored
    ({'        rng = old_shard(rank)["rng"]\n': "        rng = torch.get_rng_state()\n"},
     "rank 0 got an RNG state no rank saved, not its own \\(saved by rank 0\\)"),
    # issue 26: a rank that did not exist at the save takes some old file's RNG state (at the notebook's 4 ranks:
    # the check loads other tensors saved on 2 ranks on 3 and 4)
    ({'        rng = sharded_run.fresh_rng_state(metadata["sampler"]["seed"], metadata["step"], rank)\n':
      '        rng = old_shard(rank % saved_on)["rng"]\n'},
     "saved on 2 ranks, loaded on 3: rank 2, which did not exist when the checkpoint was saved \\(on 2 ranks\\), got "
     "rank 0's saved RNG state; it must get sharded_run.fresh_rng_state\\(seed, step, rank\\): with rank 0's state "
     "it would draw the same random numbers as rank 0"),
    # the shards saved in float32 (to halve the files): the loaded weights lose their last bits
    ({'torch.save({"sharded": state.sharded, "rng": state.rng}, path)':
      'torch.save({"sharded": {k: v.float() for k, v in state.sharded.items()}, "rng": state.rng}, path)'},
     "saved on 4 ranks, loaded on 4: rank 0's loaded '.*' is torch.float32, the saved one torch.float64"),
    # the old shards looked for among the new world size's ranks: on fewer ranks, the last old shards are never read
    ({"        for old_rank in range(saved_on):\n": "        for old_rank in range(world_size):\n"},
     "load_checkpoint on rank 2 of 3 read the old shards \\[2\\] \\(saved on 4 ranks\\); it needs \\[2, 3\\] "
     "\\(the old shards its new range overlaps"),
    # the shard sizes never gathered: rank 0 does not wait for the others' files (and its metadata says 0 bytes);
    # it names the first file missing, rank 1's unless a loaded machine let rank 1 write before ranks 2 and 3 (a race)
    ({"    dist.all_gather_single(shard_bytes, torch.tensor([os.path.getsize(path)]))\n": ""},
     "rank 0 wrote the metadata before rank [1-3]'s shard file existed"),
    # no barrier at the end: a rank returns (and a restart may look) before the metadata is written
    ({"    dist.barrier()  # no rank goes on before the metadata is written: the checkpoint is complete\n": ""},
     "save_checkpoint returned on rank \\d before rank 0 had written the metadata"),
    # every rank writes the metadata
    ({"    if rank == 0:\n        checkpoint.write_metadata": "    if True:\n        checkpoint.write_metadata"},
     "rank \\d wrote the metadata: only rank 0 writes it"),
    # the file sizes assumed to be rank 0's (no collective): the metadata can come before the other shards
    ({"    shard_bytes = torch.zeros(world_size, dtype=torch.int64)\n"
      "    dist.all_gather_single(shard_bytes, torch.tensor([os.path.getsize(path)]))\n":
      "    shard_bytes = torch.tensor([os.path.getsize(path)] * world_size)\n"},
     "rank 0 wrote the metadata before rank [1-3]'s shard file existed"),
    # the TrainState itself saved: torch.load(weights_only=True) refuses it
    ({'torch.save({"sharded": state.sharded, "rng": state.rng}, path)': "torch.save(state, path)"},
     "shard_0.pt cannot be loaded with torch.load\\(weights_only=True\\)"),
    # every rank reads every old shard (the whole checkpoint on every rank)
    ({"    sharded = {}\n    for name, shape in shapes.items():\n":
      "    for old_rank in range(saved_on):\n        old_shard(old_rank)\n"
      "    sharded = {}\n    for name, shape in shapes.items():\n"},
     "read the old shards \\[.*\\] \\(saved on 4 ranks\\); it needs"),
    # a rank that holds only padding of a tensor makes its shard in float64, whatever was saved
    ({'torch.zeros(0, dtype=metadata["dtypes"][name])': "torch.zeros(0, dtype=torch.float64)"},
     "num_batches_tracked, torch.int64 of shape \\(1,\\), saved on 4 ranks, loaded on 2: rank 1's shard is "
     "torch.float64: rank 1 holds only padding of it .* make its shard with the saved dtype"),
    # every dtype taken for float64 when the shards are put together
    ({"mine = torch.cat(pieces) if pieces": "mine = torch.cat(pieces).double() if pieces"},
     "num_batches_tracked, torch.int64 .* loaded on 1: rank 0's shard is torch.float64: keep the dtype"),
    # the dtypes left out of the metadata
    ({',\n                                      "dtypes": {name: str(tensor.dtype) for name, tensor in '
      'state.sharded.items()}})': "})"}, "the metadata's 'dtypes' is None; it must give every tensor's dtype"),
    # the metadata read by hand: a corrupted file's error does not name it
    ({"    metadata = checkpoint.read_metadata(directory, shapes)\n":
      "    metadata = __import__('json').load(open(checkpoint.metadata_path(directory)))\n"},
     "corrupted metadata raised .* must name metadata.json"),
]


@pytest.mark.parametrize("replace, match", CHECKPOINT)
def test_wrong_checkpoint_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        checkpoint(edited(replace))


def test_a_new_rank_given_another_ranks_rng_state_fails():
    """Saved on 2, loaded on 3: rank 2 did not exist, and must not share another rank's random numbers."""
    same = edited({'        rng = sharded_run.fresh_rng_state(metadata["sampler"]["seed"], metadata["step"], rank)\n':
                   '        rng = sharded_run.fresh_rng_state(metadata["sampler"]["seed"], metadata["step"], 0)\n'})
    with pytest.raises(AssertionError, match="saved on 2 ranks, loaded on 3: rank 2, which did not exist when the "
                                             "checkpoint was saved \\(on 2 ranks\\), got an RNG state no rank saved"):
        checkpoint(same, world_size=2)


def test_resumed_run_without_adamw_state_is_caught():
    """A TrainState applied without the moments: the loaded state is right, the resumed weights are not."""
    sol = solution(NOTEBOOK)
    original = sharded_run.ShardedRun.load_state

    def without_moments(self, state):
        original(self, state)
        self.optimizer.state.clear()

    sharded_run.ShardedRun.load_state = without_moments
    try:
        with pytest.raises(AssertionError, match="weight 0 differs from the uninterrupted run's"):
            checkpoint(sol)
    finally:
        sharded_run.ShardedRun.load_state = original


def test_the_check_says_where_the_data_order_diverged():
    """A sampler that resumes at the start of the epoch passes a sampler's state through the checkpoint, but
    the resumed run trains on other rows."""
    wrong = edited({"        self.set_epoch(epoch, start=step_in_epoch * local_batch_size)":
                    "        self.set_epoch(epoch)"})
    with pytest.raises(AssertionError, match="step 5 trained on rows .* continue the data order"):
        check_checkpoint(wrong.save_checkpoint, wrong.load_checkpoint, wrong.ShardedSampler, 4, SIZES, STOP_AFTER)


@pytest.mark.slow  # 8 s; pytest -m slow also runs the notebook at WORLD_SIZE=2
def test_right_answers_pass_on_other_world_sizes_and_leave_no_folders_behind(tmp_path, monkeypatch, capsys):
    """Saved on 2 ranks and loaded on 3 and 4: the new ranks get fresh RNG states, and read only their shards."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # every temporary folder of the check goes here
    checkpoint(solution(NOTEBOOK), world_size=2)
    assert "loaded on 2, 3, 4 ranks" in capsys.readouterr().out
    # pymp-*: multiprocessing's own folder, made on its first use in this process and removed at exit
    assert [name for name in os.listdir(tmp_path) if not name.startswith("pymp-")] == []


# ---------------------------------------------------------------- section 3: what a restarted run resumes from

COMPLETE = ("(match := checkpoint.CHECKPOINT_FOLDER.match(name))\n"
            "                and os.path.exists(checkpoint.metadata_path(os.path.join(root, name)))]")
LATEST = "    return checkpoint.checkpoint_folder(root, max(complete)) if complete else None\n"
LATEST_CHECKPOINT = [
    # a save the run died in counted as a checkpoint
    ({COMPLETE: "(match := checkpoint.CHECKPOINT_FOLDER.match(name))]"}, "whose saving did not finish"),
    # any file named metadata* counts, metadata.json.tmp too
    ({"os.path.exists(checkpoint.metadata_path(os.path.join(root, name)))":
      "any(f.startswith('metadata') for f in os.listdir(os.path.join(root, name)))"},
     "step_10 with only metadata.json.tmp.*whose saving did not finish"),
    # the latest by name, as strings
    ({LATEST: "    return os.path.join(root, max(f'step_{k}' for k in complete)) if complete else None\n"},
     "compare the step counts as numbers, not the names"),
    # the oldest
    ({LATEST: "    return checkpoint.checkpoint_folder(root, min(complete)) if complete else None\n"}, "the oldest"),
    # the first attempt: no folder yet
    ({"    if not os.path.isdir(root):\n        return None\n": ""}, "no checkpoint folder yet: return None"),
    # nothing complete: max() of nothing
    ({LATEST: "    return checkpoint.checkpoint_folder(root, max(complete))\n"},
     "with no complete checkpoint, return None"),
    # the step count, not the folder
    ({LATEST: "    return max(complete) if complete else None\n"}, "return the checkpoint's folder"),
]


@pytest.mark.parametrize("replace, match", LATEST_CHECKPOINT)
def test_wrong_latest_checkpoint_fails(replace, match):
    with pytest.raises(AssertionError, match=match):
        check_latest_checkpoint(edited(replace).latest_checkpoint)


def test_faults_and_torchrun_sizes_fail_before_anything_starts():
    with pytest.raises(ValueError, match="'dies' or 'hangs'"):
        elastic.Fault(1, 3, "explodes")
    student = sharded_run.Student(None)
    with pytest.raises(ValueError, match="not divisible by world size 5"):
        elastic.run_torchrun(SIZES, student, 5, 2)
    with pytest.raises(ValueError, match="save_every"):
        elastic.run_torchrun(SIZES, student, 2, 0)


AGENT_LOG = """\
I1123 01:33:47.253000 1352 torch/distributed/elastic/agent/server/api.py:707] [default] Rendezvous'ing worker group
I1123 01:33:47.429000 1352 torch/distributed/elastic/agent/server/api.py:715] [default] Starting worker group
[rank0]: RuntimeError: Connection reset by peer
W1123 01:33:57.176000 1352 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 1356 \
closing signal SIGTERM
E1123 01:33:57.382000 1352 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 \
(pid: 1357) of binary: /x/python
I1123 01:33:57.383000 1352 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED. \
2/2 attempts left; will restart worker group
I1123 01:33:58.119000 1352 torch/distributed/elastic/agent/server/api.py:715] [default] Starting worker group
I1123 01:34:08.940000 1352 torch/distributed/elastic/agent/server/api.py:932] [default] worker group successfully \
finished. Waiting 300 seconds for other agents to finish.
"""


def test_agent_lines_keep_what_does_not_change_run_to_run():
    lines = elastic.agent_lines(AGENT_LOG)
    assert [line for _, line in lines] == [
        "[default] Rendezvous'ing worker group", "[default] Starting worker group",
        "Sending process <pid> closing signal SIGTERM", "failed (exitcode: 1) local_rank: 1",
        "[default] Worker group FAILED. 2/2 attempts left; will restart worker group",
        "[default] Starting worker group", "[default] worker group successfully finished."]
    assert lines[0][0] == pytest.approx(1 * 3600 + 33 * 60 + 47.253)


def test_describe_attempts():
    events = [{"attempt": 0, "rank": r, "event": "saved", "checkpoint": "step_2", "time": 1.0 + r} for r in (0, 1)]
    events += [{"attempt": 0, "rank": 1, "event": "dies in step 3", "time": 3.0},
               {"attempt": 0, "rank": 0, "event": "failed", "time": 3.1}]
    events += [{"attempt": 1, "rank": r, "event": "loaded", "checkpoint": "step_2", "step": 2, "time": 4.0}
               for r in (0, 1)]
    events += [{"attempt": 1, "rank": r, "event": "finished", "step": 6, "time": 5.0} for r in (0, 1)]
    assert elastic.describe_attempts(events, 2) == [
        "attempt 0: started from step 0; saved step_2; rank 1 dies in step 3",
        "attempt 1: every rank loaded step_2; every rank finished step 6"]


@pytest.mark.slow
def test_torchrun_restart_ends_with_the_uninterrupted_weights_and_leaves_nothing(tmp_path, monkeypatch):
    """One real torchrun run (seconds): a rank dies, the agent restarts the group, the weights are exact; its
    temporary folder is removed and no process it started is left."""
    import psutil
    import torch

    from utils.launch import spawn

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sol = solution(NOTEBOOK)
    student = sharded_run.Student(sol.ShardedSampler, sol.save_checkpoint, sol.load_checkpoint, sol.latest_checkpoint)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    run = elastic.run_torchrun(SIZES, student, 2, 2, faults=[elastic.Fault(1, 3)])
    assert run.returncode == 0, run.log
    assert elastic.describe_attempts(run.events, 2)[1] == ("attempt 1: every rank loaded step_2; saved step_4; "
                                                           "every rank finished step 6")
    want = spawn(sharded_run.train_main, 2, SIZES, student)[0].weights
    assert all(torch.equal(a, b) for a, b in zip(run.weights, want))
    assert set(elastic.restart_seconds(run)) == {"detect", "restart", "start", "load"}
    assert os.listdir(tmp_path) == []
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


# ---------------------------------------------------------------- section 5: one controller over RPC

def controller(module):
    check_controller(module.train_step, 2, hidden_dim=8, num_layers=3, batch_size=12, num_micro_batches=4)


LOSS = "            loss = loss + loss_fn(x) / num_micro_batches\n"
CONTROLLER = [
    # the micro-batches' losses summed, not averaged
    ({LOSS: "            loss = loss + loss_fn(x)\n"}, "4 times too large, the number of micro-batches"),
    # only the last micro-batch's loss kept
    ({LOSS: "            loss = loss_fn(x) / num_micro_batches\n"},
     "each micro-batch's output must be part of the one loss"),
    # a local backward: it stops at the RPC boundary, the stages get no gradient in the context
    ({"        dist_autograd.backward(context_id, [loss])\n": "        loss.backward()\n"},
     "got no gradient in the distributed autograd context|the distributed autograd context ran no backward"),
    # no optimizer step
    ({"        optimizer.step(context_id)\n": ""}, "stepped 0 times in 2 steps"),
    # a backward and a step per micro-batch
    ({"            loss = loss + loss_fn(x) / num_micro_batches\n        dist_autograd.backward(context_id, [loss])\n"
      "        optimizer.step(context_id)\n":
      "            loss = loss + loss_fn(x) / num_micro_batches\n"
      "            dist_autograd.backward(context_id, [loss_fn(x) / num_micro_batches])\n"
      "            optimizer.step(context_id)\n"}, "with one backward per context"),
    # a stage skipped: the micro-batch never goes over RPC, the loss is the input's (the mutation run's RPC mutant)
    ({"                x = stage.rpc_sync().forward(x)\n": "                x = x\n"},
     "the loss does not depend on what the stages computed"),
    # the stages in the wrong order
    ({"            for stage in stages:\n": "            for stage in reversed(stages):\n"},
     "not the whole batch's gradient"),
]


HANGS = ("each micro-batch's output must be part of the one loss", "with one backward per context")


@pytest.mark.parametrize("replace, match", CONTROLLER)
def test_wrong_controller_fails(replace, match, monkeypatch):
    if match in HANGS:  # these wait forever: a shorter wait than the check's 8 s shows it as well
        monkeypatch.setattr(checks_ft, "CONTROLLER_TIMEOUT", 3)
    with pytest.raises(AssertionError, match=match):
        controller(edited(replace))


def test_controller_sizes_fail_before_any_rank_starts():
    sol = solution(NOTEBOOK)
    with pytest.raises(ValueError, match="not divisible by num micro batches 5"):
        check_controller(sol.train_step, 2, hidden_dim=8, num_layers=3, batch_size=12, num_micro_batches=5)
    with pytest.raises(ValueError, match="more stages than num layers"):
        check_controller(sol.train_step, 4, hidden_dim=8, num_layers=3, batch_size=12, num_micro_batches=4)
