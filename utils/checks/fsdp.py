"""Checks for notebook 05 (ZeRO and FSDP): ZeRO-1, ZeRO-2, the naive FSDP, its memory, its prefetching.

Each check trains with the notebook's code on the given world size and on a second one where a
unit's size does not divide by the world size (3 ranks, hidden_dim + 1: padded shards), compares
with the single-process run (float64, to TOLERANCE) and with PyTorch's own implementation, counts
the collectives of one step, and measures the model state the ranks hold (utils.fsdp.MemoryTracker).
"""
import torch

from utils import fsdp
from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff
from utils.launch import runnable_world_sizes, spawn
from utils.model import parameter_names, reference_gradients, train_reference
from utils.sizes import check_int

LABELS = {"zero1": "Zero1AdamW", "zero2": "Zero2AdamW", "fsdp": "the naive FSDP", "ddp": "DDP",
          "zero-pytorch": "PyTorch's ZeroRedundancyOptimizer", "fsdp2": "PyTorch's FSDP2 (fully_shard)"}


def _main(rank, world_size, jobs, impl, sizes):
    return [fsdp.run(rank, world_size, kind, impl, **sizes, dtype=dtype, cap=cap) for kind, cap, dtype in jobs]


def _configurations(world_size, hidden_dim, batch_size):
    """(world size, hidden dim, batch size): the notebook's, and one whose units need padding (3 ranks, the
    next hidden dim whose square 3 does not divide; under torchrun, torchrun's world size), each rank keeping
    its local batch size."""
    local_batch_size = fsdp.check_sizes(batch_size, world_size)
    other = runnable_world_sizes([3])[0]
    padded = hidden_dim + 1
    while other > 1 and padded**2 % other == 0:
        padded += 1
    return [(world_size, hidden_dim, batch_size), (other, padded, other * local_batch_size)]


def _sizes(hidden_dim, num_layers, batch_size, num_steps, seed):
    return dict(hidden_dim=check_int("hidden_dim", hidden_dim), num_layers=check_int("num_layers", num_layers),
                batch_size=check_int("batch_size", batch_size), num_steps=check_int("num_steps", num_steps),
                seed=check_int("seed", seed, 0))


def _count(calls, prefix):
    return sum(name.startswith(prefix) for name in calls)


def _diagnose_gradient(got, want, local, world_size):
    if got is None:
        return "it is None: no gradient reached the shard"
    if got.shape != want.shape:
        return f"its shape is {tuple(got.shape)}, expected this rank's shard, {tuple(want.shape)}"
    for value, hint in ((want * world_size, f"it is {world_size} times too large: the sum over ranks, not the "
                                            f"mean; divide by the world size"),
                        (local, "it is this rank's own gradient: it was never summed over the ranks"),
                        (local / world_size, "it is this rank's own gradient divided by the world size: it was "
                                             "never summed over the ranks")):
        if max_abs_diff(got, value) < TOLERANCE:
            return hint
    return f"max abs difference {max_abs_diff(got, want):.3g}"


def _verify_training(kind, results, world_size, sizes, reference):
    """Step 0's gradient shards and the weights after num_steps steps, on every rank."""
    label, names = LABELS[kind], parameter_names(sizes["num_layers"])
    h = sizes["hidden_dim"]
    where = f"{label} on {world_size} ranks (hidden {h})"
    grads = reference_gradients(h, sizes["num_layers"], sizes["batch_size"], sizes["seed"])
    if kind in ("zero1", "zero2", "fsdp"):  # the optimizer steps this rank's shards
        for rank in range(world_size):
            local_grads = reference_gradients(h, sizes["num_layers"], sizes["batch_size"], sizes["seed"], rank,
                                              world_size)
            got = results[rank]["first_grads"]
            for i, g in enumerate(grads):
                want = fsdp.shard(g, rank, world_size)
                if got[i] is None or got[i].shape != want.shape or max_abs_diff(got[i], want) > TOLERANCE:
                    hint = _diagnose_gradient(got[i], want, fsdp.shard(local_grads[i], rank, world_size), world_size)
                    raise AssertionError(f"{where}: at step 0, the gradient of rank {rank}'s shard of {names[i]} is "
                                         f"not its shard of the whole batch's gradient; {hint}")
    if kind == "fsdp":
        shapes = [(h, h)] * sizes["num_layers"]
        finals = [fsdp.gather_shards([results[r]["weights"] for r in range(world_size)], shapes)]
    else:
        finals = [results[r]["weights"] for r in range(world_size)]
    for rank, weights in enumerate(finals):
        for i, (got, want) in enumerate(zip(weights, reference)):
            diff = max_abs_diff(got, want) if got.shape == want.shape else float("inf")
            if diff > TOLERANCE:
                whose = "the gathered" if kind == "fsdp" else f"rank {rank}'s"
                raise AssertionError(f"{where}: after {sizes['num_steps']} steps, {whose} {names[i]} differs from "
                                     f"the single-process run's by {diff:.3g} (step 0's gradients were right: look "
                                     f"at the optimizer step and at how the shards get back into the weights)")


def _verify_calls(kind, results, world_size, num_layers, expected):
    """expected: {collective prefix: calls per step}; every other collective must be absent."""
    for rank in range(world_size):
        calls = results[rank]["calls"]
        got = {prefix: _count(calls, prefix) for prefix in ("all_reduce", "all_gather", "reduce_scatter")}
        want = {prefix: expected.get(prefix, 0) for prefix in got}
        if got != want:
            said = ", ".join(f"{n} {p.replace('_', '-')}(s)" for p, n in got.items())
            wanted = ", ".join(f"{n} {p.replace('_', '-')}(s)" for p, n in want.items())
            raise AssertionError(f"{LABELS[kind]} on rank {rank} of {world_size}: one step called {said} for "
                                 f"{num_layers} layers; expected {wanted}")


def _train_and_verify(kinds, impl, world_size, sizes, expected_calls):
    for n, h, b in _configurations(world_size, sizes["hidden_dim"], sizes["batch_size"]):
        run_sizes = {**sizes, "hidden_dim": h, "batch_size": b}
        jobs = [(kind, cap, torch.float64) for kind, cap in kinds]
        results = spawn(_main, n, jobs, impl, run_sizes, timeout=CHECK_TIMEOUT)
        reference = train_reference(h, sizes["num_layers"], b, sizes["num_steps"], "adamw", seed=sizes["seed"])[0]
        for j, (kind, _) in enumerate(kinds):
            by_rank = [results[r][j] for r in range(n)]
            if kind in expected_calls:
                _verify_calls(kind, by_rank, n, sizes["num_layers"], expected_calls[kind](sizes["num_layers"]))
            _verify_training(kind, by_rank, n, run_sizes, reference)
    return [(n, h) for n, h, _ in _configurations(world_size, sizes["hidden_dim"], sizes["batch_size"])]


def _where(configurations):
    return " and ".join(f"{n} ranks (hidden {h}: {h * h} elements per unit, "
                        f"{'padded to ' + str(n * fsdp.shard_numel(h * h, n)) if h * h % n else 'no padding'})"
                        for n, h in configurations)


def check_zero1(Zero1AdamW, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """ZeRO-1: gradients all-reduced, AdamW on this rank's shards, shards all-gathered; against PyTorch's ZeRO."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    done = _train_and_verify([("zero-pytorch", None), ("zero1", None)], {"Zero1AdamW": Zero1AdamW}, world_size, sizes,
                             {"zero1": lambda n: {"all_reduce": n, "all_gather": n}})
    print(f"Zero1AdamW: correct on {_where(done)}; the shards' gradients at step 0 are the whole batch's, and after "
          f"{num_steps} AdamW steps every rank's weights equal the single-process run's and PyTorch's "
          f"ZeroRedundancyOptimizer's to {TOLERANCE:g}; per step {num_layers} all-reduces and {num_layers} all-gathers")


def check_zero2(Zero2AdamW, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """ZeRO-2: each gradient reduce-scattered in backward and the whole one dropped; against the reference and ZeRO."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    done = _train_and_verify([("zero-pytorch", None), ("zero2", None)], {"Zero2AdamW": Zero2AdamW}, world_size, sizes,
                             {"zero2": lambda n: {"reduce_scatter": n, "all_gather": n}})
    results = spawn(_main, world_size, [("zero2", None, torch.float64)], {"Zero2AdamW": Zero2AdamW}, sizes,
                    timeout=CHECK_TIMEOUT)
    for rank in range(world_size):
        held = results[rank][0]["after_backward"]["whole gradients"]
        if held:
            raise AssertionError(f"Zero2AdamW on rank {rank} of {world_size}: after backward, {held} of the "
                                 f"{num_layers} weights still hold their whole gradient (.grad); once its shard is "
                                 f"reduce-scattered, drop it (p.grad = None): that is the memory ZeRO-2 saves")
    print(f"Zero2AdamW: correct on {_where(done)}; after {num_steps} steps the weights equal the single-process run's "
          f"and ZeroRedundancyOptimizer's to {TOLERANCE:g}; per step {num_layers} reduce-scatters (no all-reduce) "
          f"and {num_layers} all-gathers; after backward no weight holds a whole gradient")


def check_fsdp(FSDPLinear, all_gather_unit, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """The naive FSDP: gather, compute, free; gather again, reduce-scatter; against the reference and FSDP2."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    impl = {"FSDPLinear": FSDPLinear, "all_gather_unit": all_gather_unit}
    done = _train_and_verify([("fsdp2", None), ("fsdp", None)], impl, world_size, sizes,
                             {"fsdp": lambda n: {"all_gather": 2 * n, "reduce_scatter": n}})
    print(f"naive FSDP: correct on {_where(done)}; the shards' gradients at step 0 are the whole batch's, and after "
          f"{num_steps} AdamW steps the gathered weights equal the single-process run's and PyTorch FSDP2's to "
          f"{TOLERANCE:g}; per step {2 * num_layers} all-gathers (each unit in forward and again in backward) and "
          f"{num_layers} reduce-scatters")


def _memory_rows(results, world_size, hidden_dim, num_layers, element_size):
    """{version: (measured peak by group, formula bytes)} on rank 0."""
    psi = num_layers * hidden_dim**2
    formula = fsdp.formula_bytes(psi, world_size)
    scale = element_size / 4  # the formulas count 4-byte parameters
    return {name: (results[0][j]["peak"], formula[name] * scale)
            for j, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2", "FSDP"))}


def check_memory(Zero1AdamW, Zero2AdamW, FSDPLinear, all_gather_unit, world_size, hidden_dim, num_layers, batch_size,
                 seed=0, dtype=torch.float32):
    """The model state each version holds at the peak of a step, measured; returns {version: (peak, formula)}."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, 2, seed)
    fsdp.check_sizes(batch_size, world_size)
    impl = {"Zero1AdamW": Zero1AdamW, "Zero2AdamW": Zero2AdamW, "FSDPLinear": FSDPLinear,
            "all_gather_unit": all_gather_unit}
    jobs = [(kind, None, dtype) for kind in ("ddp", "zero1", "zero2", "fsdp")]
    results = spawn(_main, world_size, jobs, impl, sizes, timeout=CHECK_TIMEOUT)
    e = torch.empty(0, dtype=dtype).element_size()
    shard = fsdp.shard_numel(hidden_dim**2, world_size)
    unit = e * world_size * shard  # a gathered unit, padding included
    sharded = fsdp.sharded_state_bytes([shard] * num_layers, e)
    whole = fsdp.sharded_state_bytes([hidden_dim**2] * num_layers, e)
    for rank in range(world_size):
        zero1, zero2, ours = (results[rank][j] for j in (1, 2, 3))
        where = f"on rank {rank} of {world_size}"
        if zero1["peak"]["optimizer state"] != sharded["optimizer state"]:
            raise AssertionError(f"Zero1AdamW {where}: AdamW's state takes {zero1['peak']['optimizer state']} bytes; "
                                 f"for this rank's shards it is {sharded['optimizer state']} (for the whole model: "
                                 f"{whole['optimizer state']}): build the optimizer over the shards only")
        if zero2["after_backward"]["state"]["gradients"] != sharded["gradients"]:
            raise AssertionError(f"Zero2AdamW {where}: after backward the gradients take "
                                 f"{zero2['after_backward']['state']['gradients']} bytes; this rank's shards of them "
                                 f"are {sharded['gradients']}: drop each whole gradient once it is reduce-scattered")
        peak = ours["peak"]
        for group in ("parameters", "optimizer state"):
            if peak[group] != sharded[group]:
                raise AssertionError(f"naive FSDP {where}: at the peak, the {group} take {peak[group]} bytes; this "
                                     f"rank's shards: {sharded[group]}")
        if ours["max_units"] > 1 or peak["gathered"] > unit:
            raise AssertionError(f"naive FSDP {where}: up to {ours['max_units']} gathered units ({peak['gathered']} "
                                 f"bytes at the peak) were alive at once; without prefetching the schedule needs only "
                                 f"one ({unit} bytes): a gathered weight is kept after its unit is done with it (in "
                                 f"ctx, a list, an attribute?); free it, and gather it again in backward")
        if peak["gradients"] > sharded["gradients"] + 2 * unit:
            raise AssertionError(f"naive FSDP {where}: at the peak the gradients take {peak['gradients']} bytes; "
                                 f"the shards' gradients ({sharded['gradients']}) plus one unit's whole gradient in "
                                 f"passing (and its padded copy, {2 * unit}) should be the most")
    rows = _memory_rows(results, world_size, hidden_dim, num_layers, e)
    psi = num_layers * hidden_dim**2
    print(f"model state at the peak of a step, rank 0 of {world_size}, {num_layers} layers of "
          f"{hidden_dim}x{hidden_dim} (psi = {psi} parameters), AdamW, {dtype}; bytes:")
    print(f"  {'':8}{'params':>8}{'grads':>8}{'AdamW':>8}{'gathered':>9}{'total':>8}   formula")
    for name, (got, formula) in rows.items():
        print(f"  {name:8}{got['parameters']:8}{got['gradients']:8}{got['optimizer state']:8}{got['gathered']:9}"
              f"{sum(got.values()):8}   {formula:8.0f}")
    print(f"naive FSDP: the parameters and AdamW's state at the peak are exactly this rank's shards "
          f"({sharded['parameters']} and {sharded['optimizer state']} bytes), with at most 1 gathered unit "
          f"({unit} bytes) alive; ZeRO-1 keeps AdamW's state for its shards only, ZeRO-2 no whole gradient after "
          f"backward")
    return rows


def check_prefetch(FSDPLinear, Prefetcher, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0,
                   caps=(0, 1, 2)):
    """Prefetching with a cap: the same weights as the reference, and exactly 1 + cap gathered units alive at most."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    fsdp.check_sizes(batch_size, world_size)
    impl = {"FSDPLinear": FSDPLinear, "Prefetcher": Prefetcher}
    jobs = [("fsdp", cap, torch.float64) for cap in caps]
    results = spawn(_main, world_size, jobs, impl, sizes, timeout=CHECK_TIMEOUT)
    reference = train_reference(hidden_dim, num_layers, batch_size, num_steps, "adamw", seed=seed)[0]
    units = {}
    for j, cap in enumerate(caps):
        by_rank = [results[r][j] for r in range(world_size)]
        _verify_calls("fsdp", by_rank, world_size, num_layers, {"all_gather": 2 * num_layers,
                                                                 "reduce_scatter": num_layers})
        _verify_training("fsdp", by_rank, world_size, sizes, reference)
        want = 1 + min(cap, num_layers - 1)
        for rank, run in enumerate(by_rank):
            if run["max_units"] != want:
                hint = ("the next units' all-gathers are not started ahead (async_op=True) before waiting for this "
                        "one" if run["max_units"] < want else
                        "more gathers are in flight than the cap allows, or a gathered unit is kept after use")
                raise AssertionError(f"Prefetcher(cap={cap}) on rank {rank} of {world_size}: at most "
                                     f"{run['max_units']} gathered unit(s) alive at once; the schedule holds the "
                                     f"unit in use plus {want - 1} in flight = {want}: {hint}")
        units[cap] = (want, by_rank[0]["peak"])
    print(f"Prefetcher: correct on {world_size} ranks for caps {', '.join(map(str, caps))}; after {num_steps} steps "
          f"the gathered weights equal the single-process run's to {TOLERANCE:g}; gathered units alive at most: "
          + ", ".join(f"cap {cap}: {n}" for cap, (n, _) in units.items()))
    return units
