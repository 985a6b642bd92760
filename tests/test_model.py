"""The shared model: the same in every process, clear errors, and a reference that data parallel reproduces."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from utils.launch import spawn
from utils.model import (
    build_mlp,
    layer_weight,
    local_batch,
    loss_fn,
    make_batch,
    make_optimizer,
    step_batches,
    train,
    train_reference,
)

TOLERANCE = 1e-12  # float64, only the order of additions differs


def weights(model):
    return [layer.linear.weight.detach().clone() for layer in model.layers]


def max_diff(xs, ys):
    return max((x - y).abs().max().item() for x, y in zip(xs, ys, strict=True))


# ---------------------------------------------------------------- the model

def _build_main(rank, world_size, seed):
    torch.manual_seed(100 + rank)  # a different global RNG state on every rank
    torch.rand(rank + 1)
    return weights(build_mlp(8, 3, seed=seed))


def test_build_mlp_is_the_same_in_every_process():
    torch.manual_seed(0)
    mine = weights(build_mlp(8, 3, seed=5))
    for rank, theirs in enumerate(spawn(_build_main, 2, 5, timeout=20)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), f"rank {rank} built other weights"


def test_build_mlp_ignores_the_global_rng_and_leaves_it_alone():
    torch.manual_seed(1)
    first = weights(build_mlp(8, 3))
    torch.manual_seed(2)
    state = torch.get_rng_state()
    second = weights(build_mlp(8, 3))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(torch.get_rng_state(), state), "building the model drew from the global RNG"


def test_seeds_and_layers_give_different_weights():
    a, b = weights(build_mlp(8, 3, seed=0)), weights(build_mlp(8, 3, seed=1))
    assert not any(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], a[1])


def test_weights_are_randn_over_sqrt_hidden_dim():
    w = layer_weight(64, seed=0, layer=0)
    assert w.shape == (64, 64)
    assert 0.95 < w.std().item() * 64**0.5 < 1.05
    assert abs(w.mean().item()) < 0.01


def test_dtype_is_respected_and_holds_the_same_model_rounded():
    model32, model64 = build_mlp(8, 2, dtype=torch.float32), build_mlp(8, 2)
    assert {p.dtype for p in model32.parameters()} == {torch.float32}
    assert {p.dtype for p in model64.parameters()} == {torch.float64}
    assert all(torch.equal(a, b.float()) for a, b in zip(weights(model32), weights(model64), strict=True))
    assert model32(make_batch(4, 8, 0, dtype=torch.float32)).dtype == torch.float32


def test_layer_weight_equals_the_full_models_layer_built_in_any_order():
    full = weights(build_mlp(8, 4, seed=3, dtype=torch.float32))
    for i in reversed(range(4)):  # e.g. the last pipeline stage builds only its own layers
        assert torch.equal(layer_weight(8, seed=3, layer=i, dtype=torch.float32), full[i])


def test_parameter_names_and_forward():
    model = build_mlp(8, 3)
    assert [name for name, _ in model.named_parameters()] == [f"layers.{i}.linear.weight" for i in range(3)]
    x = make_batch(4, 8, seed=0)
    expected = x
    for w in weights(model):
        expected = F.gelu(expected @ w.T)
    assert torch.equal(model(x), expected)


# ---------------------------------------------------------------- data, loss, optimizer

def test_make_batch_depends_on_seed_and_step_only():
    batch = make_batch(4, 8, seed=0, step=2)
    assert batch.shape == (4, 8) and batch.dtype == torch.float64
    assert torch.equal(batch, make_batch(4, 8, seed=0, step=2))
    assert not torch.equal(batch, make_batch(4, 8, seed=0, step=3))
    assert not torch.equal(batch, make_batch(4, 8, seed=1, step=2))
    # batches and weights come from separate streams: step i's batch is no copy of layer i's weight
    for i in range(3):
        assert not torch.allclose(make_batch(8, 8, seed=0, step=i) / 8**0.5, layer_weight(8, 0, i))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_local_batches_are_contiguous_and_tile_the_batch(world_size):
    batch = make_batch(8, 3, seed=0)
    pieces = [local_batch(batch, rank, world_size) for rank in range(world_size)]
    assert all(len(p) == 8 // world_size for p in pieces)
    assert torch.equal(torch.cat(pieces), batch)


def test_loss_is_the_mean_over_the_whole_batch():
    output = make_batch(6, 4, seed=0)
    assert loss_fn(output).item() == pytest.approx(output.pow(2).sum().item() / 24, abs=TOLERANCE)
    # equal slices: the full loss is the average of the local losses (so data parallel averages gradients)
    local = [loss_fn(local_batch(output, rank, 3)) for rank in range(3)]
    assert sum(local).item() / 3 == pytest.approx(loss_fn(output).item(), abs=TOLERANCE)
    # unequal micro-batches: each weighted by its share of the batch
    small, large = output[:2], output[2:]
    weighted = loss_fn(small) * 2 / 6 + loss_fn(large) * 4 / 6
    assert weighted.item() == pytest.approx(loss_fn(output).item(), abs=TOLERANCE)
    assert (loss_fn(small) + loss_fn(large)).item() / 2 != pytest.approx(loss_fn(output).item(), abs=1e-6)


def test_make_optimizer_settings():
    params = [torch.zeros(2, requires_grad=True)]
    sgd, adamw = make_optimizer(params, "sgd"), make_optimizer(params, "adamw")
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["lr"] == 0.1
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["lr"] == 1e-2 and adamw.defaults["weight_decay"] == 0.01
    assert make_optimizer(params, "sgd", lr=0.5).defaults["lr"] == 0.5
    assert make_optimizer(params, "adamw", lr=0.0).defaults["lr"] == 0.0  # 0 means 0, not the default


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_flat_sharded_updates_equal_per_parameter_updates_bit_for_bit(name):
    """ZeRO / FSDP update flat shards that cut across parameters; the result must not change."""
    model = build_mlp(7, 3)
    per_parameter = [p.detach().clone().requires_grad_() for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shards = [s.clone().requires_grad_() for s in flat.tensor_split(3)]  # uneven, across layers
    opt_a, opt_b = make_optimizer(per_parameter, name), make_optimizer(shards, name)
    for step in range(3):
        grads = [make_batch(7, 7, seed=9, step=10 * step + i) for i in range(3)]
        for p, g in zip(per_parameter, grads, strict=True):
            p.grad = g.clone()
        for s, g in zip(shards, torch.cat([g.reshape(-1) for g in grads]).tensor_split(3), strict=True):
            s.grad = g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in per_parameter]),
                       torch.cat([s.detach() for s in shards]))


BAD_CALLS = [
    (lambda: build_mlp(0, 2), ["hidden_dim", "0"]),
    (lambda: build_mlp(8, -1), ["num_layers", "-1"]),
    (lambda: build_mlp(2.5, 2), ["hidden_dim", "2.5"]),
    (lambda: build_mlp(8, True), ["num_layers", "True"]),
    (lambda: layer_weight(8, seed=0, layer=-1), ["layer", "-1"]),
    (lambda: make_batch(0, 8, seed=0), ["batch_size", "0"]),
    (lambda: make_batch(4, 8, seed=0, step=-2), ["step", "-2"]),
    (lambda: local_batch(torch.zeros(8, 2), 0, 3), ["8", "3"]),
    (lambda: local_batch(torch.zeros(8, 2), 2, 2), ["rank", "2"]),
    (lambda: make_optimizer([torch.zeros(1, requires_grad=True)], "bogus"), ["bogus"]),
    (lambda: train_reference(8, 2, 4, 1, optimizer="bogus"), ["bogus"]),
    (lambda: train_reference(8, 2, 4, -1), ["num_steps", "-1"]),
]


@pytest.mark.parametrize("call, names", BAD_CALLS, ids=[", ".join(names) for _, names in BAD_CALLS])
def test_bad_arguments_raise_and_name_them(call, names):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    assert all(name in str(info.value) for name in names), str(info.value)


# ---------------------------------------------------------------- the reference run

SIZES = dict(hidden_dim=16, num_layers=4, batch_size=8, num_steps=5)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_training_lowers_the_loss(name):
    """Each step's batch is new, so the losses are not monotonic: compare with not training at all."""
    final, losses = train_reference(**SIZES, optimizer=name)
    initial, untrained = train_reference(**SIZES, optimizer=name, lr=0.0)
    assert len(losses) == 5 and all(isinstance(loss, float) for loss in losses)
    assert losses[0] == untrained[0]
    assert all(a < b for a, b in zip(losses[1:], untrained[1:], strict=True)), (losses, untrained)
    assert losses[-1] < losses[0]
    assert max_diff(final, initial) > 1e-3 and max_diff(initial, weights(build_mlp(16, 4))) == 0
    again, again_losses = train_reference(**SIZES, optimizer=name)
    assert again_losses == losses and all(torch.equal(a, b) for a, b in zip(again, final, strict=True))


# ---------------------------------------------------------------- data parallel reproduces the reference

def _average_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _data_parallel_main(rank, world_size, name, batch_size, num_steps, average=True):
    """The manual data-parallel loop: own slice, own loss, then average the gradients."""
    model = build_mlp(16, 4, seed=0)
    losses = train(model, make_optimizer(model.parameters(), name),
                   step_batches(batch_size, 16, 0, num_steps, rank, world_size),
                   synchronize=(lambda: _average_gradients(model)) if average else None)
    return weights(model), losses


def _ddp_main(rank, world_size, name, batch_size, num_steps):
    """The same with PyTorch's DistributedDataParallel, which averages the gradients in backward."""
    model = DistributedDataParallel(build_mlp(16, 4, seed=0))
    losses = train(model, make_optimizer(model.parameters(), name),
                   step_batches(batch_size, 16, 0, num_steps, rank, world_size))
    return weights(model.module), losses


@pytest.mark.parametrize("world_size, batch_size", [(2, 8), (3, 12)])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
@pytest.mark.parametrize("main", [_data_parallel_main, _ddp_main], ids=["manual", "ddp"])
def test_data_parallel_training_matches_the_reference(main, name, world_size, batch_size):
    reference, reference_losses = train_reference(16, 4, batch_size, 3, optimizer=name)
    results = spawn(main, world_size, name, batch_size, 3, timeout=30)
    for rank, (final, _) in enumerate(results):
        assert max_diff(final, reference) < TOLERANCE, f"rank {rank}: {max_diff(final, reference):.3g}"
    mean_losses = [sum(losses) / world_size for losses in zip(*(r[1] for r in results), strict=True)]
    assert max(abs(a - b) for a, b in zip(mean_losses, reference_losses, strict=True)) < TOLERANCE


def test_data_parallel_without_averaging_misses_the_reference():
    """The comparison above has teeth: drop the all-reduce and every rank drifts away."""
    reference, _ = train_reference(16, 4, 8, 3)
    for final, _ in spawn(_data_parallel_main, 2, "sgd", 8, 3, average=False, timeout=30):
        assert max_diff(final, reference) > 1e-6
