"""Checks for notebook 05 (ZeRO and FSDP): ZeRO-1, ZeRO-2, the naive FSDP, its memory, its prefetching.

Each check trains with the notebook's code on the given world size and on a second one where a
unit's size does not divide by the world size (3 ranks, hidden_dim + 1: padded shards), compares
with the single-process run (float64, to TOLERANCE) and with PyTorch's own implementation, counts
the collectives of one step, and measures what the ranks hold (utils.memory.MemoryTracker): the
optimizer state, the gradients, the gathered units alive in forward and in backward, and when each
gathered weight's all-gather was started and waited for (utils.fsdp.Moment). ZeRO-1 and ZeRO-2 also
train utils.model's awkward model (a bias, a frozen parameter, one without a gradient every other
step, a float32 parameter in a float64 model, a buffer, an embedding); the prefetcher also trains an
MLP behind an embedding-like unit, whose backward gathers nothing. The ZeRO constructors must refuse bad
`params` (a single tensor, a non-tensor, param groups, all frozen) with a TypeError or ValueError naming it.
"""
import warnings

import torch

from utils import fsdp
from utils.checks import CHECK_TIMEOUT, TOLERANCE, diagnose_gradient, max_abs_diff, verify_gathered_again
from utils.fsdp import Job, Student
from utils.launch import RankError, runnable_world_sizes, spawn
from utils.memory import formula_bytes
from utils.model import Sizes, build_awkward_model, build_mlp, local_batch, loss_fn, make_batch, train_steps
from utils.sizes import check_int

LABELS = {"zero1": "Zero1AdamW", "zero2": "Zero2AdamW", "fsdp": "the naive FSDP", "ddp": "DDP",
          "zero-pytorch": "PyTorch's ZeroRedundancyOptimizer", "fsdp2": "PyTorch's FSDP2 (fully_shard)"}
MODEL_NAMES = {"mlp": "the MLP", "awkward": "the awkward model", "embedded": "the MLP behind an embedding"}
# The awkward model's float32 parameter sums in float32, in another order than the single process: it and,
# through it, every parameter of the later steps agree to float32's precision only (with a float64 `gate`
# they agree to TOLERANCE).
FLOAT32_TOLERANCE = 1e-6

# ZeroRedundancyOptimizer's package, imported in the caller so that forked ranks inherit it (utils.launch says why;
# not in utils.fsdp, which warm ranks import in every call). The warnings: torch.jit.script's deprecation, PyTorch's.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch.distributed.optim  # noqa: F401


def checked_sizes(hidden_dim, num_layers, batch_size, num_steps, seed):
    return Sizes(check_int("hidden_dim", hidden_dim, 2), check_int("num_layers", num_layers),
                 check_int("batch_size", batch_size), check_int("num_steps", num_steps, 2), check_int("seed", seed, 0))


def world_configurations(world_size, sizes):
    """The notebook's sizes, and ones whose units need padding (3 ranks, the next hidden dim whose square 3
    does not divide; under torchrun, torchrun's world size), each rank keeping its local batch size."""
    local_batch_size = fsdp.check_sizes(sizes.batch_size, world_size)
    other = runnable_world_sizes([3])[0]
    padded = sizes.hidden_dim + 1
    while other > 1 and padded**2 % other == 0:
        padded += 1
    return [(world_size, sizes),
            (other, Sizes(padded, sizes.num_layers, other * local_batch_size, sizes.num_steps, sizes.seed))]


def ranks_and_sizes(configurations):
    h = [s.hidden_dim for _, s in configurations]
    return " and ".join(f"{n} ranks (hidden {h}: {h * h} elements per unit, "
                        f"{'padded to ' + str(n * fsdp.shard_numel(h * h, n)) if h * h % n else 'no padding'})"
                        for (n, _), h in zip(configurations, h))


# ---------------------------------------------------------------- the single-process run

def _build_single(model, sizes, dtype=torch.float64):
    if model == "awkward":
        return build_awkward_model(sizes.hidden_dim, sizes.seed, dtype)
    if model == "embedded":
        return fsdp.build_embedded_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed, dtype)
    return build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed, dtype)


def first_gradients(model, sizes, rank=None, world_size=1):
    """Step 0's gradients of the parameters that require one: of the whole batch, or of one rank's slice."""
    net = _build_single(model, sizes)
    batch = make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0)
    loss_fn(net(batch if rank is None else local_batch(batch, rank, world_size))).backward()
    return [p.grad for p in net.parameters() if p.requires_grad]


def final_weights(model, sizes):
    net = _build_single(model, sizes)
    train_steps(net, torch.optim.AdamW(net.parameters(), **fsdp.ADAMW), sizes.hidden_dim, sizes.batch_size,
                sizes.num_steps, sizes.seed)
    return [p.detach() for p in net.parameters()]


def _tolerance(t, model):
    return FLOAT32_TOLERANCE * max(1.0, t.abs().max().item()) if model == "awkward" else TOLERANCE


# ---------------------------------------------------------------- one property each

def _verify_gathered_again(label, runs, sizes, where):
    """Step 0 with every shard doubled between forward and backward (Job(doubled=True)): the inputs' gradients, and
    through them the earlier layers' weight gradients, show whether backward gathered the weights again."""
    doubled = list(fsdp.doubled_gradients(_build_single("mlp", sizes),
                                          make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0)).values())
    verify_shards_gathered_again(runs, doubled, first_gradients("mlp", sizes), where,
                                 lambda got, want: max_abs_diff(got, want) <= TOLERANCE)


def verify_shards_gathered_again(runs, doubled, kept, where, close):
    """Each rank's step 0 shard gradients, run with every shard doubled, against its shards of the whole gradients of
    the doubled weights (`doubled`) and of the plain step (`kept`): 05's and 06's FSDP."""
    n = len(runs)
    verify_gathered_again(
        ((rank, f"shard of parameter {i}", got, fsdp.shard(doubled[i], rank, n), fsdp.shard(kept[i], rank, n))
         for rank, run in enumerate(runs) for i, got in enumerate(run.first_grads)), where, close,
        "the gradients were computed with the weights gathered in forward: the gathered weights were kept, not freed "
        "after forward and gathered again in backward",
        "a backward that gathers them again: backward must gather the weights again and use them for the input's "
        "gradient")


def _verify_gradients(label, runs, model, sizes, where):
    """Step 0: each tensor the optimizer steps holds this rank's shard of the whole batch's gradient."""
    n, want_all = len(runs), first_gradients(model, sizes)
    for rank, run in enumerate(runs):
        if len(run.first_grads) != len(want_all):
            raise AssertionError(f"{where}: the optimizer steps {len(run.first_grads)} shards; the model has "
                                 f"{len(want_all)} parameters that require a gradient (one shard each: a frozen "
                                 f"parameter never changes, leave it out)")
        local = first_gradients(model, sizes, rank, n)
        for i, (got, whole) in enumerate(zip(run.first_grads, want_all)):
            want = fsdp.shard(whole, rank, n)
            if got is None or got.shape != want.shape or max_abs_diff(got, want) > _tolerance(want, model):
                hint = diagnose_gradient(got, want, fsdp.shard(local[i], rank, n), n)
                raise AssertionError(f"{where}: at step 0, rank {rank}'s shard of parameter {i} does not hold its "
                                     f"shard of the whole batch's gradient; {hint}")


def _verify_weights(label, runs, model, sizes, where, sharded):
    """After num_steps steps: every rank's weights (or the gathered shards) equal the single-process run's."""
    reference = final_weights(model, sizes)
    if sharded:
        finals = [fsdp.gather_shards([run.weights for run in runs], [w.shape for w in reference])]
    else:
        finals = [run.weights for run in runs]
    for rank, weights in enumerate(finals):
        for i, (got, want) in enumerate(zip(weights, reference)):
            diff = max_abs_diff(got, want) if got.shape == want.shape else float("inf")
            if diff > _tolerance(want, model):
                whose = "the gathered" if sharded else f"rank {rank}'s"
                raise AssertionError(f"{where}: after {sizes.num_steps} steps, {whose} parameter {i} differs from "
                                     f"the single-process run's by {diff:.3g} (step 0's gradients were right: look "
                                     f"at the optimizer step and at how the shards get back into the weights)")


def verify_calls(label, runs, num_layers, expected):
    """expected: {collective: calls per step}; every other collective must be absent."""
    for rank, run in enumerate(runs):
        got = {name: sum(c.name.startswith(name) for c in run.calls) for name in ("all_reduce", "all_gather",
                                                                                 "reduce_scatter")}
        want = {name: expected.get(name, 0) for name in got}
        if got != want:
            said, wanted = (", ".join(f"{k} {name.replace('_', '-')}(s)" for name, k in d.items()) for d in (got, want))
            raise AssertionError(f"{label} on rank {rank} of {len(runs)}: one step called {said} for {num_layers} "
                                 f"layers; expected {wanted}")


def sharded_state_bytes(model, sizes, world_size, dtype=torch.float64):
    """AdamW's state for this rank's shards: two moments per shard element, a 4-byte step per shard."""
    params = [p for p in _build_single(model, sizes, dtype).parameters() if p.requires_grad]
    return sum(2 * fsdp.shard_numel(p.numel(), world_size) * p.element_size() + 4 for p in params)


def _verify_state_sharded(label, runs, model, sizes, where, dtype=torch.float64):
    want = sharded_state_bytes(model, sizes, len(runs), dtype)
    whole = sharded_state_bytes(model, sizes, 1, dtype)
    for rank, run in enumerate(runs):
        got = run.after_backward["optimizer state"]
        if got != want:
            what = "the whole weights'" if got >= whole else "neither this rank's shards' nor the whole weights'"
            raise AssertionError(f"{where}: on rank {rank}, the optimizer's state takes {got} bytes: {what} (this "
                                 f"rank's shards: {want}; the whole model: {whole}); the optimizer must step "
                                 f"self.shards only, so that each rank keeps the state of its 1/N")


def _verify_whole_gradients_dropped(label, runs, where):
    for rank, run in enumerate(runs):
        if run.whole_gradients:
            raise AssertionError(f"{where}: after backward, on rank {rank}, {run.whole_gradients} whole weights still "
                                 f"hold their whole gradient (.grad); once its shard is reduce-scattered, drop it "
                                 f"(p.grad = None): that is the memory ZeRO-2 saves")


def verify_units(label, runs, want, where):
    """Exactly `want` gathered units alive at most, in forward and in backward, each, in every step (`want`: a
    number, or one per phase)."""
    for rank, run in enumerate(runs):
        for (step, phase), got in run.units_by_phase.items():
            if phase not in ("forward", "backward"):
                continue
            held = want[phase] if isinstance(want, dict) else want
            if got == held:
                continue
            if got > held:
                hint = ("more gathers in flight than the cap allows, or a gathered weight kept after its unit is "
                        "done with it (in ctx, a list, an attribute?): free it with fsdp.free once it is used")
            else:
                hint = (f"the next units' all-gathers are not started ahead in {phase} (async_op=True, the units "
                        f"that come next in order[phase]) before waiting for this unit's")
            raise AssertionError(f"{where}: on rank {rank}, up to {got} gathered units were alive at once in step "
                                 f"{step}'s {phase}; the schedule holds {held} (the unit in use plus {held - 1} in "
                                 f"flight): {hint}")


def _verify_prefetches(label, runs, where):
    """Each weight a layer gets: gathered in this step, and a prefetched one still in flight when asked for."""
    for rank, run in enumerate(runs):
        for use in run.uses:
            call, asked = use.call, use.asked
            what = f"{where}: on rank {rank}, unit {use.unit}'s weight in step {asked.step}'s {asked.phase}"
            if call is None:
                raise AssertionError(f"{what} came from no all-gather: gather every weight from the shards")
            if call.started_at.step != asked.step:
                raise AssertionError(f"{what} was gathered in step {call.started_at.step}'s {call.started_at.phase}, "
                                     f"before the optimizer step changed the shards: a stale copy. Never use a "
                                     f"gather started before the last optimizer step: prefetch only the units that "
                                     f"come next in order[phase], nothing past the end of the phase")
            if call.started_at.tick == asked.tick:
                continue  # gathered on demand
            if call.blocking or (call.waited_at is not None and call.waited_at.tick < asked.tick):
                how = "with a blocking all-gather" if call.blocking else "and waited for right after it was started"
                raise AssertionError(f"{what} was prefetched {how} (while unit {call.started_at.unit} was asked "
                                     f"for): that is no overlap. Start it with async_op=True, keep the handle, and "
                                     f"wait only when its unit is asked for")
        used = {id(use.call) for use in run.uses}
        in_vain = [call for call in run.calls if call.name.startswith("all_gather") and id(call) not in used]
        if in_vain:
            at, held = in_vain[0].started_at, run.after_backward["gathered"]
            raise AssertionError(f"{where}: on rank {rank}, an all-gather started in step {at.step}'s {at.phase} "
                                 f"(while unit {at.unit} was asked for) was never used by any unit"
                                 + (f", and {held} bytes of gathered weights were held after backward, through the "
                                    f"optimizer step" if held else "")
                                 + ": a prefetch past the end of the phase. Prefetch only the units that come next "
                                   "in order[phase]")


def bad_params():
    """(what, params, the error torch.optim's way demands, a word its message must have) for each input a ZeRO
    constructor must refuse before it does anything: a silent no-op, or an AttributeError, otherwise."""
    weight, frozen = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2), requires_grad=False)
    return [("one nn.Parameter, not in a list", weight, TypeError, "iterable"),
            ("a list holding a number", [weight, 3], TypeError, "int"),
            ("param groups (dicts with their own lr)", [{"params": [weight], "lr": 0.1}], TypeError, "group"),
            ("a list whose parameters are all frozen", [frozen], ValueError, "frozen")]


def _verify_refuses_bad_params(label, ZeRO):
    """Each bad `params` raises its error, in the parent process: before any process group or collective."""
    for what, params, error, word in bad_params():
        try:
            ZeRO(params, torch.optim.AdamW, **fsdp.ADAMW)
            got = "raised nothing"
        except Exception as e:  # any other: the student's, reported
            if isinstance(e, error) and word in str(e):
                continue
            got = f"raised {type(e).__name__}: {str(e).rstrip('.')}"
        raise AssertionError(f"{label}({what}, ...) {got}; it must refuse it with a {error.__name__} that names the "
                             f"problem, before anything else (torch.optim's way): keep the constructor's given first "
                             f"line, self.params = fsdp.trainable_params(params, type(self).__name__)")


# ---------------------------------------------------------------- running the jobs

def _spawn_runs(jobs, student, world_size, sizes):
    """Each job's Run on every rank: [[job 0's run on rank 0, on rank 1, ...], ...]."""
    try:
        by_rank = spawn(fsdp.runs_main, world_size, jobs, student, sizes, timeout=CHECK_TIMEOUT)
    except RankError as e:
        models = ", ".join(sorted({MODEL_NAMES[job.model] for job in jobs}))
        raise AssertionError(f"{LABELS[jobs[0].version]} failed on {world_size} ranks training {models}: {e}"
                             + ("\nThe awkward model has a frozen parameter (no .grad ever) and one without a "
                                "gradient every other step: skip the parameters whose .grad is None"
                                if any(job.model == "awkward" for job in jobs) else "")) from e
    return [[by_rank[r][j] for r in range(world_size)] for j in range(len(jobs))]


def _check_zero(version, student, world_size, sizes, calls_per_layer):
    """ZeRO-1 or ZeRO-2 on the MLP and the awkward model; PyTorch's ZeroRedundancyOptimizer beside it (on the
    notebook's sizes: it is slow)."""
    label = LABELS[version]
    configurations = world_configurations(world_size, sizes)
    for k, (n, run_sizes) in enumerate(configurations):
        jobs = [Job(version), Job(version, "awkward")] + ([Job("zero-pytorch")] if k == 0 else [])
        runs = dict(zip(jobs, _spawn_runs(jobs, student, n, run_sizes)))
        for job in jobs[:2]:
            where = f"{label} on {n} ranks, {MODEL_NAMES[job.model]} (hidden {run_sizes.hidden_dim})"
            _verify_state_sharded(label, runs[job], job.model, run_sizes, where)
            if job.model == "mlp":
                verify_calls(label, runs[job], sizes.num_layers,
                              {name: per_layer * sizes.num_layers for name, per_layer in calls_per_layer.items()})
            _verify_gradients(label, runs[job], job.model, run_sizes, where)
            _verify_weights(label, runs[job], job.model, run_sizes, where, sharded=False)
            if version == "zero2":
                _verify_whole_gradients_dropped(label, runs[job], where)
        if k == 0:
            _verify_weights(LABELS["zero-pytorch"], runs[jobs[-1]], "mlp", run_sizes,
                            f"{LABELS['zero-pytorch']} on {n} ranks", sharded=False)
    _verify_refuses_bad_params(label, student.Zero1AdamW if version == "zero1" else student.Zero2AdamW)
    return configurations


def check_zero1(Zero1AdamW, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """ZeRO-1: gradients all-reduced, the optimizer on this rank's shards, shards all-gathered."""
    sizes = checked_sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    done = _check_zero("zero1", Student(Zero1AdamW=Zero1AdamW), world_size, sizes, {"all_reduce": 1, "all_gather": 1})
    print(f"Zero1AdamW: correct on {ranks_and_sizes(done)}; "
          f"the optimizer's state is exactly that of this rank's shards; "
          f"the shards' gradients at step 0 are the whole batch's, and after {num_steps} AdamW steps every rank's "
          f"weights equal the single-process run's to {TOLERANCE:g} (so do PyTorch's ZeroRedundancyOptimizer's on "
          f"{world_size} ranks); per step "
          f"{num_layers} all-reduces and {num_layers} all-gathers; the awkward model (bias, frozen, unused, float32, "
          f"buffer, embedding) trains right too, to float32's precision ({FLOAT32_TOLERANCE:g})")


def check_zero2(Zero2AdamW, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """ZeRO-2: each gradient reduce-scattered in backward and the whole one dropped."""
    sizes = checked_sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    done = _check_zero("zero2", Student(Zero2AdamW=Zero2AdamW), world_size, sizes,
                       {"reduce_scatter": 1, "all_gather": 1})
    print(f"Zero2AdamW: correct on {ranks_and_sizes(done)}; "
          f"after {num_steps} steps the weights equal the single-process "
          f"run's to {TOLERANCE:g}; per step {num_layers} reduce-scatters (no "
          f"all-reduce) and {num_layers} all-gathers; after backward no weight holds a whole gradient; the awkward "
          f"model trains right too, to {FLOAT32_TOLERANCE:g}")


def check_fsdp(FSDPLinear, all_gather_unit, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """The naive FSDP: gather, compute, free; gather again, reduce-scatter; against the reference and FSDP2."""
    sizes = checked_sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    student = Student(FSDPLinear=FSDPLinear, all_gather_unit=all_gather_unit)
    configurations = world_configurations(world_size, sizes)
    for k, (n, run_sizes) in enumerate(configurations):
        jobs = [Job("fsdp")] + ([Job("fsdp2")] if k == 0 else []) + [Job("fsdp", doubled=True)]  # FSDP2: notebook's
        runs = _spawn_runs(jobs, student, n, run_sizes)
        where = f"the naive FSDP on {n} ranks (hidden {run_sizes.hidden_dim})"
        verify_calls(LABELS["fsdp"], runs[0], num_layers, {"all_gather": 2 * num_layers, "reduce_scatter": num_layers})
        _verify_gradients(LABELS["fsdp"], runs[0], "mlp", run_sizes, where)
        _verify_weights(LABELS["fsdp"], runs[0], "mlp", run_sizes, where, sharded=True)
        verify_units(LABELS["fsdp"], runs[0], 1, where)
        _verify_gathered_again(LABELS["fsdp"], runs[-1], run_sizes, where)  # after the counts and bytes: their hints
        if k == 0:
            _verify_weights(LABELS["fsdp2"], runs[1], "mlp", run_sizes, f"{LABELS['fsdp2']} on {n} ranks",
                            sharded=False)
    print(f"naive FSDP: correct on {ranks_and_sizes(configurations)}; "
          f"the shards' gradients at step 0 are the whole batch's, "
          f"and after {num_steps} AdamW steps the gathered weights equal the single-process run's to "
          f"{TOLERANCE:g} (so do PyTorch FSDP2's on {world_size} ranks); per step {2 * num_layers} all-gathers "
          f"(each unit in forward and again in backward) and {num_layers} reduce-scatters; 1 gathered unit alive at "
          f"most, in forward and in backward")


# ---------------------------------------------------------------- memory, measured

def _memory_rows(runs, world_size, sizes, element_size):
    """{version: (measured peak by group on rank 0, formula bytes)}."""
    psi = sizes.num_layers * sizes.hidden_dim**2
    formula = formula_bytes(psi, world_size)
    scale = element_size / 4  # the formulas count 4-byte parameters
    return {name: (runs[j][0].peak, formula[name] * scale) for j, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2",
                                                                                        "FSDP"))}


def _verify_fsdp_peak(runs, sizes, element_size, where):
    """At the peak: FSDP's parameters and optimizer state are exactly the shards'; gradients at most the shards'
    plus one unit's whole gradient in passing (and its padded copy)."""
    n = len(runs)
    shard = fsdp.shard_numel(sizes.hidden_dim**2, n)
    unit = element_size * n * shard
    want = {"parameters": element_size * shard * sizes.num_layers,
            "optimizer state": (2 * element_size * shard + 4) * sizes.num_layers}
    for rank, run in enumerate(runs):
        for group, bytes_ in want.items():
            if run.peak[group] != bytes_:
                raise AssertionError(f"{where}: on rank {rank}, at the peak, the {group} take {run.peak[group]} "
                                     f"bytes; this rank's shards: {bytes_}")
        if run.peak["gradients"] > want["parameters"] + 2 * unit:
            raise AssertionError(f"{where}: on rank {rank}, at the peak the gradients take {run.peak['gradients']} "
                                 f"bytes; the shards' gradients ({want['parameters']}) plus one unit's whole "
                                 f"gradient in passing (and its padded copy, {2 * unit}) should be the most")
    return want, unit


def _print_memory(rows, world_size, sizes, dtype):
    psi = sizes.num_layers * sizes.hidden_dim**2
    print(f"model state at the peak of a step, rank 0 of {world_size}, {sizes.num_layers} layers of "
          f"{sizes.hidden_dim}x{sizes.hidden_dim} (psi = {psi} parameters), AdamW, {dtype}; bytes:")
    print(f"  {'':8}{'params':>8}{'grads':>8}{'AdamW':>8}{'gathered':>9}{'total':>8}   formula")
    for name, (got, formula) in rows.items():
        print(f"  {name:8}{got['parameters']:8}{got['gradients']:8}{got['optimizer state']:8}{got['gathered']:9}"
              f"{sum(got.values()):8}   {formula:8.0f}")


def check_memory(Zero1AdamW, Zero2AdamW, FSDPLinear, all_gather_unit, world_size, hidden_dim, num_layers, batch_size,
                 seed=0, dtype=torch.float32):
    """The model state each version holds at the peak of a step, measured; returns {version: (peak, formula)}."""
    sizes = checked_sizes(hidden_dim, num_layers, batch_size, 2, seed)
    fsdp.check_sizes(batch_size, world_size)
    student = Student(Zero1AdamW, Zero2AdamW, FSDPLinear, all_gather_unit)
    runs = _spawn_runs([Job(v, dtype=dtype) for v in ("ddp", "zero1", "zero2", "fsdp")], student, world_size, sizes)
    e = torch.empty(0, dtype=dtype).element_size()
    for version, version_runs in zip(("zero1", "zero2"), runs[1:3]):
        where = f"{LABELS[version]} on {world_size} ranks, {dtype}"
        _verify_state_sharded(LABELS[version], version_runs, "mlp", sizes, where, dtype)
    _verify_whole_gradients_dropped(LABELS["zero2"], runs[2], f"Zero2AdamW on {world_size} ranks")
    where = f"naive FSDP on {world_size} ranks"
    verify_units(LABELS["fsdp"], runs[3], 1, where)
    sharded, unit = _verify_fsdp_peak(runs[3], sizes, e, where)
    rows = _memory_rows(runs, world_size, sizes, e)
    _print_memory(rows, world_size, sizes, dtype)
    print(f"naive FSDP: the parameters and AdamW's state at the peak are exactly this rank's shards "
          f"({sharded['parameters']} and {sharded['optimizer state']} bytes), with at most 1 gathered unit "
          f"({unit} bytes) alive; ZeRO-1 keeps AdamW's state for its shards only, ZeRO-2 no whole gradient after "
          f"backward")
    return rows


# ---------------------------------------------------------------- prefetching

def check_prefetch(FSDPLinear, Prefetcher, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0,
                   caps=(0, 1, 2)):
    """Prefetching with a cap: the same weights as the reference; in forward and in backward, each, exactly
    1 + cap gathered units alive at most; every prefetched gather still in flight when its unit is asked for;
    no weight gathered before the last optimizer step. Also behind an embedding-like unit (no backward gather)."""
    sizes = checked_sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    fsdp.check_sizes(batch_size, world_size)
    student = Student(FSDPLinear=FSDPLinear, Prefetcher=Prefetcher)
    jobs = [Job("fsdp", cap=cap) for cap in caps] + [Job("fsdp", "embedded", cap) for cap in caps if cap]
    units = {}
    for job, runs in zip(jobs, _spawn_runs(jobs, student, world_size, sizes)):
        label = f"Prefetcher(cap={job.cap})"
        where = f"{label} on {world_size} ranks, {MODEL_NAMES[job.model]}"
        num_units = num_layers + (job.model == "embedded")
        _verify_prefetches(label, runs, where)
        # every unit gathers in forward and again in backward, but the embedding's backward needs no weight
        verify_calls(label, runs, num_layers, {"all_gather": 2 * num_units - (job.model == "embedded"),
                                               "reduce_scatter": num_units})
        asked = {"forward": num_units, "backward": num_layers}  # units each phase asks for
        alive = {phase: 1 + min(job.cap, n - 1) for phase, n in asked.items()}  # the one in use, the cap in flight
        verify_units(label, runs, alive, where)
        _verify_gradients(label, runs, job.model, sizes, where)
        _verify_weights(label, runs, job.model, sizes, where, sharded=True)
        if job.model == "mlp":
            units[job.cap] = alive["forward"]
    print(f"Prefetcher: correct on {world_size} ranks for caps {', '.join(map(str, caps))}, on the MLP and behind an "
          f"embedding (a unit whose backward gathers nothing); after {num_steps} steps the gathered weights equal "
          f"the single-process run's to {TOLERANCE:g}; every prefetched gather was still in flight when its unit "
          f"was asked for, none older than the last optimizer step; gathered units alive at most, in forward and in "
          f"backward each: " + ", ".join(f"cap {cap}: {n}" for cap, n in units.items()))
    return units
