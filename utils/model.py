"""The course's one toy model, its data, its loss, and the single-process reference training run.

Notebooks 02-05 split this model across ranks (data, tensor, pipeline parallel, FSDP) and compare
with `train_reference`. So everything random here comes from its own generator, seeded from
(seed, layer) or (seed, step): every process can rebuild any layer or any batch on its own,
bit for bit, whatever the global RNG state and in whatever order it builds them.
"""
import contextlib
import dataclasses
import hashlib

import torch
import torch._dynamo  # noqa: F401
import torch.nn as nn
import torch.nn.functional as F

from utils.sizes import check_int, divide

# torch._dynamo is imported above though nothing here uses it: every optimizer loads it, and a notebook that trains
# imports this module, so its forked ranks inherit it (utils.launch says why).

WEIGHTS, BATCHES = 0, 1  # separate random streams: a batch never repeats a weight matrix


class Layer(nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim, bias=False)

    def forward(self, x):
        return F.gelu(self.linear(x))


class MLP(nn.Module):
    """Parameters are named `layers.{i}.linear.weight`: what TP plans, fully_shard and PP splits address."""

    def __init__(self, hidden_dim, num_layers):
        super().__init__()
        self.layers = nn.ModuleList([Layer(hidden_dim) for _ in range(num_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def parameter_names(num_layers):
    """The MLP's parameter names, in layer order."""
    return [f"layers.{i}.linear.weight" for i in range(num_layers)]


def generator(seed, stream, index):
    """A generator that depends only on (seed, stream, index), the same in every process."""
    # The CPU generator keeps only the low 32 bits of its seed (2**32 + 5 draws what 5 draws), so
    # packing the three numbers into one big int would repeat streams; hash them into 32 bits instead.
    key = hashlib.sha256(f"{seed},{stream},{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(key[:4], "little"))


def layer_weight(hidden_dim, seed, layer, dtype=torch.float64):
    """Layer `layer`'s weight alone (a stage or a shard builds only its own), randn / sqrt(hidden_dim).

    The 1 / sqrt(hidden_dim) keeps x @ W.T at the scale of x: outputs neither explode nor vanish.
    """
    hidden_dim, seed = check_int("hidden_dim", hidden_dim), check_int("seed", seed, 0)
    layer = check_int("layer", layer, 0)
    w = torch.randn(hidden_dim, hidden_dim, generator=generator(seed, WEIGHTS, layer), dtype=torch.float64)
    return (w / hidden_dim**0.5).to(dtype)  # drawn in float64: every dtype holds the same model, rounded


def build_mlp(hidden_dim, num_layers, seed=0, dtype=torch.float64):
    """The model every notebook trains: the same weights in any process, they depend only on `seed`."""
    hidden_dim, num_layers = check_int("hidden_dim", hidden_dim), check_int("num_layers", num_layers)
    with torch.device("meta"):  # no default init: it would draw from (and advance) the global RNG
        model = MLP(hidden_dim, num_layers)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.linear.weight.copy_(layer_weight(hidden_dim, seed, i, dtype))
    return model


def loss_fn(output):
    """The mean of the squared outputs: no targets needed (as in CS336's parallelism lecture).

    The mean is over every element of the whole batch. A data-parallel rank that takes the mean over
    its own slice gets the gradient of a different loss: the ranks must average their gradients
    (equal slices) to get the full batch's. Likewise a micro-batch's loss must be weighted by its
    share of the batch (its size / the batch size) before the gradients are summed.
    """
    return output.square().mean()


def make_batch(batch_size, hidden_dim, seed, step=0, dtype=torch.float64):
    """The whole input batch of step `step`: every rank can make it and take its own slice."""
    batch_size, hidden_dim = check_int("batch_size", batch_size), check_int("hidden_dim", hidden_dim)
    step, seed = check_int("step", step, 0), check_int("seed", seed, 0)
    x = torch.randn(batch_size, hidden_dim, generator=generator(seed, BATCHES, step), dtype=torch.float64)
    return x.to(dtype)


EACH_RANK_SAME_ROWS = "each rank must get the same number of rows"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A training run's sizes, as the notebooks' runs and checks pass them around."""

    hidden_dim: int
    num_layers: int
    batch_size: int
    num_steps: int
    seed: int = 0
    model: str = "mlp"  # or "awkward": build_awkward_model


def local_batch(batch, rank, world_size):
    """This rank's contiguous slice of the batch: rows [rank * n, (rank + 1) * n), n = batch_size / world_size."""
    world_size = check_int("world_size", world_size)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank must be below world_size={world_size}, got {rank}")
    local_batch_size = divide("batch_size", len(batch), "world_size", world_size, EACH_RANK_SAME_ROWS)
    return batch[rank * local_batch_size:(rank + 1) * local_batch_size]


def make_optimizer(params, name, lr=None):
    # foreach=False: one parameter at a time, the same arithmetic however the parameters are
    # grouped or sharded (on CPU it is the default; foreach=True agreed bit for bit here too)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1 if lr is None else lr, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2 if lr is None else lr, weight_decay=0.01, foreach=False)
    raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {name!r}")


def reference_gradients(hidden_dim, num_layers, batch_size, seed=0, rank=None, world_size=1):
    """Step 0's gradients at rank 0's starting weights: of the whole batch, or of one rank's slice."""
    model = build_mlp(hidden_dim, num_layers, seed)
    batch = make_batch(batch_size, hidden_dim, seed, 0)
    if rank is not None:
        batch = local_batch(batch, rank, world_size)
    loss_fn(model(batch)).backward()
    return [p.grad for p in model.parameters()]


def train_reference(hidden_dim, num_layers, batch_size, num_steps, optimizer="sgd", lr=None, seed=0,
                    dtype=torch.float64):
    """The single-process run every parallel version must reproduce: (final weights by layer, losses by step)."""
    batch_size, num_steps = check_int("batch_size", batch_size), check_int("num_steps", num_steps, 0)
    model = build_mlp(hidden_dim, num_layers, seed, dtype)
    losses = train_steps(model, make_optimizer(model.parameters(), optimizer, lr), hidden_dim, batch_size, num_steps,
                         seed, dtype)
    return [layer.linear.weight.detach().clone() for layer in model.layers], losses


def train_steps(model, opt, hidden_dim, batch_size, num_steps, seed=0, dtype=torch.float64):
    """`num_steps` steps, each on the whole of that step's batch; returns the losses by step."""
    return train(model, opt, step_batches(batch_size, hidden_dim, seed, num_steps, dtype=dtype))


def step_batches(batch_size, hidden_dim, seed, num_steps, rank=None, world_size=1, dtype=torch.float64):
    """The batches of steps 0, 1, ...: whole, or this rank's slices of them (data parallel)."""
    for step in range(check_int("num_steps", num_steps, 0)):
        batch = make_batch(batch_size, hidden_dim, seed, step, dtype)
        yield batch if rank is None else local_batch(batch, rank, world_size)


def forward_backward(model, batch):
    loss = loss_fn(model(batch))
    loss.backward()
    return loss


def train(model, optimizer, batches, *, forward_backward=forward_backward, synchronize=None, watch=None):
    """The training loop of the course, once: for each batch, forward and backward, synchronise, step.

    The variation points:
      forward_backward(model, batch) -> loss   micro-batches, or a pipeline stage's schedule (a stage
                                                without the loss returns None)
      synchronize()                             between backward and the optimizer step: e.g. wait for
                                                the gradients' all-reduces
      watch(step)                               a context manager around one whole step, or None: e.g.
                                                a memory tracker, a communication log
    Returns the losses by step (see `loss_value`)."""
    losses = []
    for step, batch in enumerate(batches):
        with watch(step) if watch is not None else contextlib.nullcontext():
            loss = forward_backward(model, batch)
            if synchronize is not None:
                synchronize()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss_value(loss))
    return losses


def loss_value(loss):
    """A one-element loss tensor as a float; anything else (None on a pipeline stage without the loss, or a
    student's wrong return value, such as a whole activation) as it is, detached, for a check to name."""
    if isinstance(loss, torch.Tensor):
        return loss.item() if loss.numel() == 1 else loss.detach()
    return loss


def detached_parameters(module):
    """Copies of `module`'s parameters, detached: its weights at this moment."""
    return [p.detach().clone() for p in module.parameters()]

class AwkwardModel(nn.Module):
    """What the course's MLP lacks, in one small model, for the checks of notebooks 02 and 05:

    - `embedding`: rows picked by the input's signs; its backward needs no weight (like a real embedding);
    - `linear`: a weight and a **bias**;
    - `frozen`: a parameter that does not require a gradient;
    - `sometimes`: used only by every other forward call, so it has no gradient in those steps;
    - `gate`: a float32 parameter in a float64 model (**mixed dtypes**);
    - `shift`: a **buffer**, not a parameter.

    Every rank makes the same forward calls, so `sometimes` is used (or not) on all of them alike.
    """

    unused_alike = ("sometimes.weight",)  # for utils.data_parallel.UsedParameters: never used on some ranks only

    def __init__(self, hidden_dim):
        super().__init__()
        self.embedding = nn.Embedding(4, hidden_dim)
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.frozen = nn.Linear(hidden_dim, hidden_dim, bias=False).requires_grad_(False)
        self.sometimes = nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.gate = nn.Parameter(torch.ones(hidden_dim))
        self.register_buffer("shift", torch.zeros(hidden_dim))
        self.calls = 0

    def forward(self, x):
        rows = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
        h = x + self.embedding(rows)
        h = F.gelu(self.linear(h)) + self.frozen(h)
        if self.calls % 2 == 0:
            h = h + self.sometimes(h)
        self.calls += 1
        return h * self.gate.to(h.dtype) + self.shift


def build_awkward_model(hidden_dim, seed=0, dtype=torch.float64):
    """An AwkwardModel whose values (parameters and buffer) depend only on `seed`; `gate` stays float32."""
    hidden_dim = check_int("hidden_dim", hidden_dim)
    with torch.device("meta"):
        model = AwkwardModel(hidden_dim)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for i, tensor in enumerate([*model.parameters(), *model.buffers()]):
            fan_in = tensor.shape[-1] if tensor.dim() > 1 else hidden_dim
            draw = torch.randn(tensor.shape, generator=generator(seed, WEIGHTS, 1000 + i), dtype=torch.float64)
            tensor.copy_(draw / fan_in**0.5)
    model.gate.data = model.gate.data.float()
    return model
