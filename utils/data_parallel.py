"""Data parallel training (notebook 02): the size rule, the training loop, PyTorch DDP's run of it.

The loop is the same for every way of synchronizing gradients; what changes is the step:

    train_data_parallel(rank, world_size, broadcast_parameters, train_step=...)     # step(model, optimizer, batch)
    train_data_parallel(rank, world_size, broadcast_parameters, gradient_sync=...)  # sync = gradient_sync(model)

With `gradient_sync`, each step is: forward, backward (the sync's hooks start the all-reduces),
`sync.finish()` (wait for them), optimizer step.
"""
import torch

from utils.counting import calls, record_communication
from utils.sizes import divide
from utils.model import EACH_RANK_SAME_ROWS, build_mlp, local_batch, loss_fn, make_batch, make_optimizer

START_SEED_STRIDE = 1000  # rank r starts from build_mlp(seed + 1000 r): every rank differs, rank 0 is the reference


def check_sizes(batch_size, world_size, num_micro_batches=1):
    """The batch must split evenly over the ranks, and each rank's slice over its micro-batches."""
    local_batch_size = divide("batch_size", batch_size, "world_size", world_size, EACH_RANK_SAME_ROWS)
    divide("local_batch_size", local_batch_size, "num_micro_batches", num_micro_batches,
           "each micro-batch must have the same number of rows")
    return local_batch_size


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def train_data_parallel(rank, world_size, broadcast_parameters, train_step=None, gradient_sync=None, *,
                        hidden_dim, num_layers, batch_size, num_steps, optimizer="sgd", seed=0,
                        dtype=torch.float64, watch=None):
    """One rank's run: a different random start on every rank, rank 0's broadcast, then `num_steps` steps.

    Returns a dict: `start` (the weights after broadcast_parameters), `grads` (the gradients the
    optimizer saw at step 0), `weights` (at the end), `losses` (this rank's, by step) and
    `all_reduces` (how many dist.all_reduce calls each step made). `watch(model, optimizer)`, if
    given, runs before `gradient_sync(model)`: a check's own hooks go first.
    """
    check_sizes(batch_size, world_size)
    model = build_mlp(hidden_dim, num_layers, seed + START_SEED_STRIDE * rank, dtype)
    broadcast_parameters(model)
    run = {"start": weights(model), "grads": None, "losses": [], "all_reduces": []}
    opt = make_optimizer(model.parameters(), optimizer)

    def keep_first_gradients(opt, args, kwargs):
        if run["grads"] is None:
            run["grads"] = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]

    opt.register_step_pre_hook(keep_first_gradients)
    if watch is not None:
        watch(model, opt)
    sync = gradient_sync(model) if gradient_sync is not None else None
    for step in range(num_steps):
        batch = local_batch(make_batch(batch_size, hidden_dim, seed, step, dtype), rank, world_size)
        with record_communication() as log:
            if sync is None:
                loss = train_step(model, opt, batch)
            else:
                loss = loss_fn(model(batch))
                loss.backward()
                sync.finish()
                opt.step()
                opt.zero_grad()
        run["losses"].append(None if loss is None else loss.item())
        run["all_reduces"].append(calls(log, "all_reduce"))
    run["weights"] = weights(model)
    return run


def train_pytorch_ddp(rank, world_size, *, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches=1,
                      optimizer="sgd", seed=0, dtype=torch.float64):
    """The same run with torch.nn.parallel.DistributedDataParallel (no_sync for all but the last micro-batch)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    check_sizes(batch_size, world_size, num_micro_batches)
    model = DDP(build_mlp(hidden_dim, num_layers, seed + START_SEED_STRIDE * rank, dtype))  # broadcasts rank 0's
    opt = make_optimizer(model.parameters(), optimizer)
    for step in range(num_steps):
        micro_batches = local_batch(make_batch(batch_size, hidden_dim, seed, step, dtype), rank, world_size)
        micro_batches = micro_batches.chunk(num_micro_batches)
        for i, micro_batch in enumerate(micro_batches):
            if i < len(micro_batches) - 1:
                with model.no_sync():
                    (loss_fn(model(micro_batch)) / num_micro_batches).backward()
            else:
                (loss_fn(model(micro_batch)) / num_micro_batches).backward()
        opt.step()
        opt.zero_grad()
    return {"weights": weights(model.module)}


def expected_buckets(param_bytes, bucket_size_mb):
    """Greedy buckets over the parameters in reverse order: [[parameter indices], ...], each at most
    bucket_size_mb * 2**20 bytes unless one parameter alone is larger."""
    cap = bucket_size_mb * 2**20
    buckets, size = [], 0
    for i in reversed(range(len(param_bytes))):
        if buckets and size + param_bytes[i] <= cap:
            buckets[-1].append(i)
            size += param_bytes[i]
        else:
            buckets.append([i])
            size = param_bytes[i]
    return buckets

