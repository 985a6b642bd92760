"""Checks for notebook 06 (mixed precision and activation recomputation).

- check_loss_scaler: the scaler's unscale_ and update against torch.amp.GradScaler("cpu"), bit for bit;
- check_mixed_precision_step: the student's step against one process applying the same casts (fp32, bf16,
  fp16 with the scaler), against torch.autocast with torch.amp.GradScaler("cpu"), a step whose
  gradients hold an inf (skipped, scale halved), and a frozen layer;
- check_reduce_dtype: a data-parallel gradient average with a reduce dtype, every all-reduce watched;
- check_mixed_precision_fsdp: notebook 05's FSDP with bf16 all-gathers and fp32 reduce-scatters, every collective
  and the gathered units watched, against the single-process cast reference and FSDP2's MixedPrecisionPolicy, and
  one more step 0 with every shard doubled between forward and backward (05's: only a backward that gathers again
  meets the doubled weights);
- check_recompute: gradients bit for bit, and the bytes autograd saves, against the formula.
"""
import copy
import dataclasses
import functools
import math

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from utils import fsdp
from utils.checks import CHECK_TIMEOUT, diagnose_gradient, max_abs_diff
from utils.checks.fsdp import (
    checked_sizes,
    ranks_and_sizes,
    verify_calls,
    verify_shards_gathered_again,
    verify_units,
    world_configurations,
)
from utils.intercept import intercept
from utils.launch import RankError, apart, spawn
from utils.mixed_precision import (
    SHORT,
    SavedActivations,
    activation_bytes_formula,
    check_dtype,
    fsdp_bytes_per_step,
    fsdp_runs_main,
    mixed_precision_reference,
    one_thread,
)
from utils.model import Sizes, build_mlp, detached_parameters, local_batch, loss_fn, make_batch, make_optimizer
from utils.sizes import check_int

LOW_PRECISION_TOLERANCE = 1e-6  # on fp32 master weights after a few SGD steps: another rounding of a bf16/fp16
# gradient moves a weight by about lr * eps * |g|; every wrong answer in the catalogue moves it 100x more
GROWTH_INTERVAL = 3  # the checks' scaler grows after 3 clean steps, so a few steps show growth


# ---------------------------------------------------------------- the loss scaler

FLOAT32_MAX = torch.finfo(torch.float32).max  # GradScaler never grows its scale (a float32) past it: 2**127 stays
GRADS = [torch.tensor([8.0, -4.0]), None, torch.tensor([2.0]), torch.tensor([6.0, 1.0, -2.0])]  # None: frozen
UNSCALE_SCALE = 8.0


def _with_grads(grads):
    """Parameters holding these gradients (None: a parameter without one, as a frozen layer's)."""
    params = [torch.zeros(g.shape if g is not None else (1,), requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.clone()
    return params


def _gradscaler_unscale(grads, scale):
    """torch.amp.GradScaler("cpu")'s unscale_ of these gradients: the gradients after it, and whether it found an
    inf or a NaN (its update halved the scale)."""
    params = _with_grads(grads)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # creates its scale tensor
    scaler.unscale_(torch.optim.SGD(params))
    scaler.update()
    return [p.grad for p in params], scaler.get_scale() < scale


def _gradscaler_scales(init_scale, growth_interval, found_infs):
    """The scale after each of torch.amp.GradScaler("cpu")'s updates, given which steps found an inf."""
    params = _with_grads([None])
    optimizer = torch.optim.SGD(params)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales = []
    for found_inf in found_infs:
        scaler.scale(torch.ones(()))
        params[0].grad = torch.full((1,), float("inf") if found_inf else 1.0)
        scaler.unscale_(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _scale_hint(got, want, found_infs, init_scale):
    step = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    before = init_scale if step == 0 else want[step - 1]
    if found_infs[step] and got[step] == before:
        why = "an inf/NaN step must halve the scale; it stayed"
    elif found_infs[step]:
        why = f"an inf/NaN step must halve the scale (to {want[step]:g}), got {got[step]:g}"
    elif want[step] * 2 > FLOAT32_MAX and got[step] > want[step]:
        why = (f"the scale grew past 2**127, float32's largest power of two: GradScaler keeps its scale a finite "
               f"float32, so when the doubled scale would be past float32's largest value ({FLOAT32_MAX:g}) it keeps "
               f"the scale as it is (and restarts the count)")
    elif got[step] > want[step]:
        why = (f"the scale grew before {GROWTH_INTERVAL} clean steps in a row: grow only after growth_interval "
               f"clean steps, and restart the count after an inf and after growing")
    else:
        why = (f"the scale should have grown to {want[step]:g} after {GROWTH_INTERVAL} clean steps in a row (grow "
               f"when the count reaches growth_interval, and count afresh after an inf and after each growth)")
    return f"after update #{step} (found_inf={found_infs[step]}): scale {got[step]:g}, expected {want[step]:g}: {why}"


def _student_unscale(DynamicLossScaler, grads):
    params = _with_grads(grads)
    found_inf = DynamicLossScaler(UNSCALE_SCALE, GROWTH_INTERVAL).unscale_(params)
    return [p.grad for p in params], bool(found_inf)


def _check_unscaled(got, want, case):
    for i, (g, w) in enumerate(zip(got, want)):
        if (g is None) != (w is None):
            raise AssertionError(f"DynamicLossScaler.unscale_ ({case}): parameter {i}'s gradient is {g!r} after "
                                 f"unscaling, GradScaler's {w!r}: leave a parameter without a gradient as it is")
        if w is not None and not torch.equal(g, w):
            ratio = (g.flatten()[0] / w.flatten()[0]).item()
            if ratio == UNSCALE_SCALE**2:
                raise AssertionError(f"DynamicLossScaler.unscale_ ({case}): parameter {i}'s gradient is scale**2 = "
                                     f"{ratio:g} x (gradient / scale): it was multiplied by the scale; divide it")
            raise AssertionError(f"DynamicLossScaler.unscale_ ({case}): parameter {i}'s gradient is {ratio:g} x "
                                 f"(gradient / scale): divide each gradient by the scale exactly once, in place")


def _check_unscale(DynamicLossScaler):
    full = [g if g is not None else torch.tensor([5.0]) for g in GRADS]
    got, found_inf = _student_unscale(DynamicLossScaler, full)
    want, _ = _gradscaler_unscale(full, UNSCALE_SCALE)
    _check_unscaled(got, want, "finite gradients")
    assert not found_inf, ("DynamicLossScaler.unscale_ returned found_inf=True for finite gradients: return True "
                           "exactly when some gradient holds an inf or a NaN (after unscaling)")
    frozen = f"parameter {GRADS.index(None)} without a gradient (frozen, or unused this step: its .grad is None)"
    try:
        got, found_inf = _student_unscale(DynamicLossScaler, GRADS)
    except (AttributeError, TypeError) as e:  # it ran without the None: the None is what it fails on
        raise AssertionError(f"DynamicLossScaler.unscale_ raised {type(e).__name__}: {e}, with a {frozen}: skip a "
                             f"parameter whose .grad is None, as GradScaler does") from e
    want, _ = _gradscaler_unscale(GRADS, UNSCALE_SCALE)
    _check_unscaled(got, want, f"finite gradients and a {frozen}")
    assert not found_inf, (f"DynamicLossScaler.unscale_ returned found_inf=True for finite gradients and a {frozen}: "
                           f"a parameter without a gradient holds no inf: skip it, as GradScaler does, and do not "
                           f"count it as an overflow")
    where = [i for i, g in enumerate(GRADS) if g is not None]  # the first, a middle and the last parameter
    found = {}
    for kind in ("inf", "NaN"):
        for i in where:
            poisoned = [None if g is None else g.clone() for g in GRADS]
            poisoned[i][0] = float(kind.lower())
            found[kind, i] = _student_unscale(DynamicLossScaler, poisoned)[1]
            assert _gradscaler_unscale(poisoned, UNSCALE_SCALE)[1], f"GradScaler missed an {kind} in parameter {i}"
    missed = [(kind, i) for (kind, i), f in found.items() if not f]
    if not missed:
        return
    if all(found["inf", i] for i in where):
        raise AssertionError("DynamicLossScaler.unscale_ returned found_inf=False for gradients that are NaN: return "
                             "True exactly when some gradient holds an inf or a NaN (after unscaling)")
    last = where[-1]
    if all(found[kind, last] for kind in ("inf", "NaN")):
        kind, i = missed[0]
        raise AssertionError(f"DynamicLossScaler.unscale_ returned found_inf=False with an {kind} in parameter {i} of "
                             f"{len(GRADS)}, True with one in the last: found_inf is recomputed for each parameter, so "
                             f"only the last one decides; a finite gradient after an inf must not reset it: combine "
                             f"over every parameter (found_inf |= ..., or any(...))")
    kind, i = missed[0]
    raise AssertionError(f"DynamicLossScaler.unscale_ returned found_inf=False with an {kind} in parameter {i} of "
                         f"{len(GRADS)}: return True exactly when some gradient holds an inf or a NaN")


def _check_update(DynamicLossScaler, init_scale, found_infs):
    scaler = DynamicLossScaler(init_scale, GROWTH_INTERVAL)
    got = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        got.append(float(scaler.scale))
    want = _gradscaler_scales(init_scale, GROWTH_INTERVAL, found_infs)
    assert got == want, "DynamicLossScaler.update: " + _scale_hint(got, want, found_infs, init_scale)
    return got


def check_loss_scaler(DynamicLossScaler):
    """unscale_ and update against torch.amp.GradScaler("cpu"), bit for bit: each gradient divided once, a
    parameter without a gradient skipped, an inf or NaN found in any parameter; the scale halved, grown, and
    kept at 2**127 (float32's largest power of two) as GradScaler keeps it."""
    _check_unscale(DynamicLossScaler)
    found_infs = [False, False, True, False, False, False, False, False, False, True, True, False]
    got = _check_update(DynamicLossScaler, 8.0, found_infs)
    _check_update(DynamicLossScaler, 2.0**125, [False] * 9 + [True] + [False] * 3)  # grows to 2**127 and stays
    print(f"DynamicLossScaler: correct; unscale_ divides once and finds inf and NaN; scales over "
          f"{len(found_infs)} updates: {' '.join(f'{s:g}' for s in got)}")


# ---------------------------------------------------------------- the mixed-precision step

@dataclasses.dataclass
class Run:
    """A few steps, step by step: the master weights after each, its loss, the scale after it, whether it
    stepped, and whether its forward ran on the master weights it started from (None where not known)."""
    weights: list
    losses: list
    scales: list
    stepped: list
    fresh: list


def _batches(batch_size, hidden_dim, seed, num_steps, poison_step):
    for step in range(num_steps):
        batch = make_batch(batch_size, hidden_dim, seed, step, torch.float32)
        if step == poison_step:
            batch[0, 0] = float("inf")  # its loss and every gradient: inf or NaN
        yield batch


LOSS_HINTS = {  # what the returned loss is, when it is not the low-precision copy's on the current master weights
    "stale": ("the forward pass did not run on the current master weights (its loss is the low-precision model's "
              "before the step): copy the master weights into the low-precision model before each forward"),
    "fp32": ("the loss is the fp32 master model's, not the low-precision copy's: run the forward on `model` (the "
             "low-precision copy) with the batch cast to its dtype"),
    "scaled": "the returned loss is the scaled one (loss x scale): return the loss before scaling",
    "other": ("the returned loss is not the forward's on the current master weights, cast to the low-precision "
              "dtype: copy the master weights into `model`, then return loss_fn(model(batch)) of that forward"),
}


STEP_ERRORS = [  # (words in the error, what they mean)
    ("assign a gradient with dtype", "the master parameters are fp32, and so must their gradients be: cast the "
                                     "low-precision gradients to fp32 (.float()) before giving them to the master"),
    ("to have the same dtype", "the batch is fp32 and the model's weights low precision: cast the batch to the "
                               "model's dtype (batch.to(dtype)) before the forward"),
]


def _what_loss(loss, model, master, batch, dtype, scaler):
    """Which forward the student's loss came from (True: the right one), tried in this order."""
    with torch.no_grad():
        candidates = [(True, copy.deepcopy(master).to(dtype)(batch.to(dtype))),
                      ("stale", copy.deepcopy(model)(batch.to(dtype))), ("fp32", master(batch))]
        losses = [(name, loss_fn(out).item()) for name, out in candidates]
    if scaler is not None:
        losses.append(("scaled", losses[0][1] * float(scaler.scale)))
    return next((name for name, value in losses if _same(loss, value)), "other")


def _same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def _master(sizes, frozen):
    """The fp32 model the optimizer steps; layer `frozen` (if not None) has no gradient."""
    master = build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed, torch.float32)
    if frozen is not None:
        master.layers[frozen].requires_grad_(False)
    return master


def _run_student(step_fn, scaler, dtype, sizes, poison_step=None, frozen=None):
    master = _master(sizes, frozen)
    model = copy.deepcopy(master).to(dtype)
    optimizer = make_optimizer(master.parameters(), "sgd")
    run = Run([detached_parameters(master)], [], [], [], [])
    for batch in _batches(sizes.batch_size, sizes.hidden_dim, sizes.seed, sizes.num_steps, poison_step):
        forward = functools.partial(_what_loss, model=copy.deepcopy(model), master=copy.deepcopy(master), batch=batch,
                                    dtype=dtype, scaler=None if scaler is None else copy.deepcopy(scaler))
        loss, did_step = step_fn(master, model, optimizer, batch, scaler)
        run.fresh.append(forward(float(loss)))
        run.losses.append(float(loss))
        run.stepped.append(bool(did_step))
        run.scales.append(None if scaler is None else float(scaler.scale))
        run.weights.append(detached_parameters(master))
    return run


def _run_reference(dtype, sizes, init_scale, poison_step=None, frozen=None, autocast=False, unscale_low=False):
    """One process, the same casts (or torch.autocast + GradScaler): the run the student's must equal.
    unscale_low: a wrong run, the gradients unscaled in the low dtype before the cast to fp32."""
    master = _master(sizes, frozen)
    model = copy.deepcopy(master).to(dtype)
    optimizer = make_optimizer(master.parameters(), "sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=GROWTH_INTERVAL,
                                  enabled=init_scale is not None)
    run = Run([detached_parameters(master)], [], [], [], [])
    for batch in _batches(sizes.batch_size, sizes.hidden_dim, sizes.seed, sizes.num_steps, poison_step):
        if autocast:
            with torch.autocast("cpu", dtype=dtype):
                loss = loss_fn(master(batch))
            scaler.scale(loss).backward()
        else:
            with torch.no_grad():
                for low, p in zip(model.parameters(), master.parameters()):
                    low.copy_(p)
            loss = loss_fn(model(batch.to(dtype)))
            scaler.scale(loss.float()).backward()
            for low, p in zip(model.parameters(), master.parameters()):
                if low.grad is not None:
                    if unscale_low:  # what underflows in the low dtype stays lost; x scale in fp32 is exact
                        low.grad = low.grad / scaler.get_scale() * scaler.get_scale()
                    p.grad, low.grad = low.grad.float(), None
        scaler.step(optimizer)  # unscales (x 1/scale, exact for powers of two), skips on inf/NaN
        scaler.update()
        optimizer.zero_grad()
        run.weights.append(detached_parameters(master))
        run.stepped.append(any(not torch.equal(a, b) for a, b in zip(run.weights[-2], run.weights[-1])))
        run.losses.append(loss.item())
        run.scales.append(scaler.get_scale() if init_scale is not None else None)
    return run


def _step_hint(got, want, step, tolerance):
    """What is wrong at `step` (the first step where something is), or None."""
    before, after, right = got.weights[step], got.weights[step + 1], want.weights[step + 1]
    if any(not torch.isfinite(w).all() for w in after) and all(torch.isfinite(w).all() for w in right):
        return "the master weights hold inf or NaN: a step whose gradients are not finite must be skipped"
    if got.fresh and got.fresh[step] is not True:
        return LOSS_HINTS[got.fresh[step]]
    if got.stepped[step] != want.stepped[step]:
        return (f"your step {'stepped' if got.stepped[step] else 'skipped'}, the reference "
                f"{'stepped' if want.stepped[step] else 'skipped'}: skip the optimizer step exactly when a gradient "
                f"holds an inf or a NaN, and report it")
    if got.scales[step] != want.scales[step]:
        return (f"the scale after it is {got.scales[step]}, the reference's {want.scales[step]}: call "
                f"scaler.update(found_inf) once per step, whether the step was skipped or not")
    if want.stepped[step] and all(torch.equal(a, b) for a, b in zip(before, after)):
        return ("the fp32 master weights did not change: the optimizer steps the master parameters, so give them "
                "the low-precision gradients, cast to fp32")
    worst = max(max_abs_diff(g, w) for g, w in zip(after, right))
    size = max(w.abs().max().item() for w in right)
    if worst > tolerance * max(1.0, size) or any(g.dtype != torch.float32 for g in after):
        differ = f"the fp32 master weights differ from the reference's by up to {worst:.3g} (largest {size:.3g})"
        if any(want.stepped[:step]):  # _compare stops at the first wrong step: earlier updates were right
            return (f"{differ}, though the updates before were right: something carries over from one step to the "
                    f"next, such as gradients left in the low-precision model's .grad (they add up unless cleared)")
        if got.scales[step] is None:
            return f"{differ}: give the master parameters the low-precision gradients, cast to fp32, and step"
        return (f"{differ}: if the gradients were divided by the scale twice (or not at all), each update is 1/scale "
                f"(or scale) times the reference's: unscale once, before the optimizer step")
    return None


def _same_weights(got, want):
    return all(torch.equal(a, b) for g, w in zip(got.weights, want.weights) for a, b in zip(g, w))


def _compare(got, want, label, tolerance):
    for step in range(len(want.stepped)):
        hint = _step_hint(got, want, step, tolerance)
        if hint is not None:
            raise AssertionError(f"{label}: step {step}: {hint}")


def check_mixed_precision_step(DynamicLossScaler, mixed_precision_step, hidden_dim, num_layers, batch_size,
                               num_steps, seed=0):
    """Against the same casts in one process: fp32 and fp16 (with the scaler) bit for bit, bf16 to
    LOW_PRECISION_TOLERANCE; bf16 and fp16 against torch.autocast + GradScaler to LOW_PRECISION_TOLERANCE; an inf
    step skipped and the scale halved."""
    sizes = Sizes(check_int("hidden_dim", hidden_dim), check_int("num_layers", num_layers),
                  check_int("batch_size", batch_size), check_int("num_steps", num_steps, 2), check_int("seed", seed, 0))
    with one_thread():
        _check_step_cases(DynamicLossScaler, mixed_precision_step, sizes)
    print(f"mixed_precision_step: correct; {sizes.num_steps} SGD steps equal the reference with the same casts "
          f"(fp32 and fp16 with a dynamic loss scaler bit for bit, bf16 to {LOW_PRECISION_TOLERANCE:g} relative) "
          f"and, in bf16 and fp16, torch.autocast('cpu') + torch.amp.GradScaler('cpu') to "
          f"{LOW_PRECISION_TOLERANCE:g} relative; a step with an inf gradient is skipped and the scale halves")


def _check_step_cases(DynamicLossScaler, mixed_precision_step, sizes):
    poison = sizes.num_steps // 2
    cases = [(torch.float32, None, None, None), (torch.bfloat16, None, None, None),
             (torch.bfloat16, None, poison, None), (torch.float16, 2.0**16, None, None),
             (torch.float16, 2.0**10, poison, None)]
    if sizes.num_layers > 1:  # a layer without gradients, the others with: GradScaler skips it
        cases.append((torch.float16, 2.0**16, None, sizes.num_layers // 2))
    for dtype, init_scale, poison_step, frozen in cases:
        label = f"{SHORT[dtype]}{'' if init_scale is None else f' with a scaler from {init_scale:g}'}"
        label += "" if poison_step is None else f", an inf in step {poison_step}'s batch"
        label += "" if frozen is None else f", layer {frozen} frozen"
        scaler = None if init_scale is None else DynamicLossScaler(init_scale, GROWTH_INTERVAL)
        try:
            got = _run_student(mixed_precision_step, scaler, dtype, sizes, poison_step, frozen)
        except RuntimeError as e:
            hint = next((h for words, h in STEP_ERRORS if words in str(e)), None)
            if hint is None:
                raise
            raise AssertionError(f"{label}: mixed_precision_step raised RuntimeError: {str(e).split('. ')[0]}: "
                                 f"{hint}") from e
        except (AttributeError, TypeError) as e:
            if frozen is None:  # the earlier cases ran: only here is a .grad None
                raise
            raise AssertionError(f"{label}: mixed_precision_step raised {type(e).__name__}: {e}: a frozen parameter "
                                 f"(or one unused this step) has no gradient, its .grad is None: skip it when "
                                 f"moving gradients to the master weights and when unscaling, as GradScaler "
                                 f"does") from e
        # the same casts give the same bits in fp32 and in fp16 with a scaler: there an fp16 rounding more (the
        # gradients unscaled in fp16, where the small ones underflow) is a mistake, though only 1e-7 relative
        exact = dtype == torch.float32 or (dtype == torch.float16 and init_scale is not None)
        tolerance = 0.0 if exact else LOW_PRECISION_TOLERANCE
        if poison_step is None or init_scale is not None:
            try:
                _compare(got, _run_reference(dtype, sizes, init_scale, poison_step, frozen), label, tolerance)
            except AssertionError as e:
                if init_scale is not None and _same_weights(
                        got, _run_reference(dtype, sizes, init_scale, poison_step, frozen, unscale_low=True)):
                    raise AssertionError(f"{label}: the gradients were unscaled in {SHORT[dtype]}, before the cast to "
                                         f"fp32: divided by the scale in {SHORT[dtype]}, the small ones fall below "
                                         f"its smallest normal and lose bits or become 0, the underflow loss scaling "
                                         f"exists to prevent: cast the gradients to fp32 first, then unscale the "
                                         f"master's") from e
                raise
        else:  # no scaler: nothing may skip; the weights turn NaN as in the reference
            assert got.stepped == [True] * sizes.num_steps, f"{label}: without a scaler, every step steps"
        if dtype != torch.float32 and (init_scale is not None or poison_step is None):  # autocast: low dtypes only
            _compare(got, _run_reference(dtype, sizes, init_scale, poison_step, frozen, autocast=True),
                     label + " vs torch.autocast + GradScaler", LOW_PRECISION_TOLERANCE)


# ---------------------------------------------------------------- the reduction dtype in data parallel

def _reduce_main(rank, world_size, average_gradients, sizes, reduce_dtypes):
    model = build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed, torch.float32)
    batch = local_batch(make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0, torch.float32), rank,
                        world_size)
    loss_fn(model(batch)).backward()
    local = [p.grad.clone() for p in model.parameters()]
    reference = [g.clone() for g in local]  # fp32 all-reduced by the same gloo, in the same order: exact
    for g in reference:
        dist.all_reduce(g)
        g /= world_size
    every_local = [torch.zeros(world_size, *g.shape) for g in local]
    for whole, g in zip(every_local, local):
        dist.all_gather(list(whole.unbind(0)), g)
    results = []
    for reduce_dtype in reduce_dtypes:
        for p, g in zip(model.parameters(), local):
            p.grad = g.clone()
        reduced = []
        with intercept(after=lambda call, args: reduced.append(args["tensor"].clone())) as log:
            average_gradients(model, reduce_dtype)
        results.append(([p.grad.clone() for p in model.parameters()], reduced, [c.name for c in log]))
    return local, reference, every_local, results


def rounding_bound(every_local, dtype):
    """Per element: N casts and N - 1 additions, each off by at most u = eps / 2 of what it rounds, or by half
    the subnormal spacing (smallest_normal * u) below the normal range: |mean - exact mean| <= u * sum_i |g_i|
    + 2 * smallest_normal * u (first order; x 1.01 for the rest)."""
    info = torch.finfo(dtype)
    u = info.eps / 2
    return 1.01 * (u * every_local.abs().sum(0) + 2 * info.smallest_normal * u)


def _check_reduced(label, got, reduced, names, local, reference, every_local, reduce_dtype, world_size, num_params):
    all_reduces = [n for n in names if n == "all_reduce"]
    assert len(all_reduces) == num_params, (
        f"{label}: {len(all_reduces)} all-reduce(s) for {num_params} gradients: all-reduce each gradient once")
    dtypes = sorted({str(t.dtype) for t in reduced})
    assert dtypes == [str(reduce_dtype)], (
        f"{label}: the all-reduces were given {', '.join(dtypes)} tensors: cast each gradient to reduce_dtype "
        f"before the all-reduce (that is what halves the bytes)")
    for i, (g, r, mine, ref) in enumerate(zip(got, reduced, local, reference)):
        where = f"{label}, gradient {i}"
        assert g is not None and g.dtype == torch.float32, (
            f"{where}: its .grad is {None if g is None else g.dtype}: keep the gradient in fp32 (the master's dtype)")
        if reduce_dtype == torch.float32:
            close = max_abs_diff(g, ref) <= 4 * world_size * torch.finfo(torch.float32).eps * ref.abs().max().item()
            assert torch.equal(g, ref), f"{where}: " + (
                "equal to an fp32 all-reduce of the gradients divided by the world size only up to rounding, not bit "
                "for bit: all-reduce the gradient itself, then divide" if close
                else diagnose_gradient(g, ref, mine, world_size))
            continue
        bound = rounding_bound(every_local[i], reduce_dtype)
        if not ((g - ref).abs() <= bound).all():
            raise AssertionError(f"{where}: {diagnose_gradient(g, ref, mine, world_size)}; beyond the "
                                 f"{SHORT[reduce_dtype]} rounding bound u * sum_i |g_i|")
        assert torch.equal(g, r.to(torch.float32) / world_size), (
            f"{where}: it is not the {SHORT[reduce_dtype]} all-reduced sum cast to fp32 and then divided by the "
            f"world size: sum in {SHORT[reduce_dtype]}, then divide in fp32 (dividing in {SHORT[reduce_dtype]}, or "
            f"before the all-reduce, rounds once more)")


def check_reduce_dtype(average_gradients, world_size, hidden_dim, num_layers, batch_size, seed=0):
    """fp32: the same bits as an fp32 all-reduce; bf16: one bf16 all-reduce per gradient, within the rounding
    bound of the fp32 mean, and exactly the bf16 sum divided in fp32."""
    sizes = Sizes(check_int("hidden_dim", hidden_dim), check_int("num_layers", num_layers),
                  check_int("batch_size", batch_size), 1, check_int("seed", seed, 0))
    reduce_dtypes = [torch.float32, torch.bfloat16, torch.float16]
    try:
        runs = spawn(_reduce_main, world_size, average_gradients, sizes, reduce_dtypes, timeout=CHECK_TIMEOUT)
    except RankError as e:
        if "assign a gradient with dtype" not in str(e):
            raise
        raise AssertionError(f"average_gradients on {world_size} ranks: a rank assigned a low-precision tensor to "
                             f"p.grad, which must stay fp32 (the master's dtype): cast the reduced sum back to fp32, "
                             f"then divide (p.grad.copy_(...) casts for you)\n{e}") from e
    worst = {}
    for rank, (local, reference, every_local, results) in enumerate(runs):
        for reduce_dtype, (got, reduced, names) in zip(reduce_dtypes, results):
            label = f"average_gradients(reduce_dtype={reduce_dtype}) on rank {rank} of {world_size}"
            _check_reduced(label, got, reduced, names, local, reference, every_local, reduce_dtype, world_size,
                           num_layers)
            worst[reduce_dtype] = max([worst.get(reduce_dtype, 0.0)] + [max_abs_diff(g, r)
                                                                       for g, r in zip(got, reference)])
    print(f"average_gradients: correct on {world_size} ranks; fp32 equals an fp32 all-reduce bit for bit; "
          f"bf16 and fp16: one all-reduce per gradient in that dtype, divided in fp32, within the rounding bound")


# ---------------------------------------------------------------- activation recomputation

def _forward_backward(model, x, recompute=None):
    """Gradients and the bytes saved for backward, with each layer run through `recompute(layer, x)` or not."""
    model.zero_grad(set_to_none=True)
    calls = [0] * len(model.layers)
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
             for i, layer in enumerate(model.layers)]
    try:
        with SavedActivations(model) as saved:
            for layer in model.layers:
                x = layer(x) if recompute is None else recompute(layer, x)
            loss = loss_fn(x)
        forward_calls = list(calls)
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, saved.nbytes, forward_calls, [c - f for c, f in zip(calls, forward_calls)]


RECOMPUTE_ERRORS = [  # (words in the error, what they usually mean)
    ("does not require grad", "recompute under torch.enable_grad() (backward runs with gradients off), from the saved "
                              "input detached and made to require a gradient"),
    ("returned an invalid gradient at index", "return the gradients in the order of forward's inputs: None for the "
                                              "block, then the input's, then each parameter's"),
    ("incorrect number of gradients", "backward returns one gradient per input of forward: None for the block, then "
                                      "the input's, then each parameter's"),
]


def check_recompute(recompute, hidden_dim, num_layers, batch_size, seed=0, dtype=torch.float32):
    """Each layer recomputed once in backward; loss and gradients bit for bit; saved bytes = the formula's."""
    hidden_dim, num_layers = check_int("hidden_dim", hidden_dim), check_int("num_layers", num_layers)
    batch_size, dtype = check_int("batch_size", batch_size), check_dtype("dtype", dtype)
    with one_thread():
        _check_recompute(recompute, hidden_dim, num_layers, batch_size, seed, dtype)


def _recompute_run(rank, world_size, recompute, hidden_dim, num_layers, batch_size, seed, dtype):
    """In a rank of its own (the student's code runs nowhere else): _forward_backward's results with `recompute`,
    or the message of the RuntimeError it raised."""
    with one_thread():
        try:
            return (*_forward_backward(build_mlp(hidden_dim, num_layers, seed, dtype),
                                       make_batch(batch_size, hidden_dim, seed, 0, dtype), recompute),
                    _weights_doubled_before_backward(build_mlp(hidden_dim, num_layers, seed, dtype),
                                                     make_batch(batch_size, hidden_dim, seed, 0, dtype), recompute))
        except NotImplementedError:  # not attempted yet: said as such, as every exercise says it
            raise
        except RuntimeError as e:
            return str(e)


def _weights_doubled_before_backward(model, x, recompute):
    """The weights' gradients when every weight is doubled between forward and backward (in place, out of
    autograd's sight). A backward that recomputes each block from its saved input meets the doubled weights; one
    that kept the forward's activations meets the old ones: the gradients tell the method apart, where the counts
    of calls and saved bytes, taken in the rank that runs the student's code, could be forged."""
    for layer in model.layers:
        x = recompute(layer, x)
    loss = loss_fn(x)
    with fsdp.doubled_between(list(model.parameters())):
        loss.backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _recomputed_reference(hidden_dim, num_layers, batch_size, seed, dtype):
    """_weights_doubled_before_backward with PyTorch's own recomputation (torch.utils.checkpoint)."""
    def checkpointed(layer, x):
        return checkpoint(layer, x, use_reentrant=False)
    return _weights_doubled_before_backward(build_mlp(hidden_dim, num_layers, seed, dtype),
                                            make_batch(batch_size, hidden_dim, seed, 0, dtype), checkpointed)


def _check_recompute(recompute, hidden_dim, num_layers, batch_size, seed, dtype):
    """The student's recompute runs in a rank of its own, which returns its loss, gradients and counts as data; the
    comparison runs here. The counts (layer calls, bytes saved) are taken in that rank, by hooks installed before
    the student's code runs: code that computes the right gradients could lie about them, not about the values.
    That backward recomputes is also shown by values (_weights_doubled_before_backward), which no count can hide;
    how much forward saved and how often a layer ran are shown by the counts only."""
    model = build_mlp(hidden_dim, num_layers, seed, dtype)
    x = make_batch(batch_size, hidden_dim, seed, 0, dtype)
    loss, grads, saved, _, _ = _forward_backward(model, x)
    run = apart(_recompute_run, recompute, hidden_dim, num_layers, batch_size, seed, dtype, timeout=CHECK_TIMEOUT)
    if isinstance(run, str):
        hint = next((h for words, h in RECOMPUTE_ERRORS if words in run), "see the error")
        raise AssertionError(f"recompute: backward raised RuntimeError: {run.splitlines()[0]}; {hint}")
    got_loss, got, got_saved, forward_calls, backward_calls, got_doubled = run
    e = torch.tensor([], dtype=dtype).element_size()
    want = activation_bytes_formula(batch_size, hidden_dim, num_layers, e, recompute=True)
    assert torch.equal(got_loss, loss), "recompute: the loss differs from the plain forward's: return block(x)"
    assert forward_calls == [1] * num_layers, (
        f"recompute: forward ran each layer {forward_calls} times: once in forward, once more in backward")
    assert backward_calls == [1] * num_layers, (
        f"recompute: backward ran the layers' forward {backward_calls} times: recompute each block exactly once, "
        f"in backward")
    for i, (g, w) in enumerate(zip(got, grads)):
        assert g is None or not torch.equal(g, 2 * w) or not w.any(), (
            f"recompute: layer {i}'s weight gradient is twice the plain run's: it is counted twice. Backward both "
            f"accumulated it into .grad (out.backward(...)) and returned it; return torch.autograd.grad's gradients "
            f"and leave .grad to autograd")
        assert g is not None, (f"recompute: layer {i}'s weight got no gradient: backward must return a gradient for "
                               f"every input of forward, the block's parameters included")
        assert torch.equal(g, w), (f"recompute: layer {i}'s weight gradient differs from the plain run's by up to "
                                   f"{max_abs_diff(g, w):.3g}: recompute the block from its saved input and "
                                   f"differentiate that")
    for i, (g, w) in enumerate(zip(got_doubled, _recomputed_reference(hidden_dim, num_layers, batch_size, seed,
                                                                     dtype))):
        assert g is not None and torch.equal(g, w), (
            f"recompute: with every weight doubled between forward and backward, layer {i}'s weight gradient "
            f"differs from a recomputation's (torch.utils.checkpoint's)"
            f"{'' if g is None else f' by up to {max_abs_diff(g, w):.3g}'}: backward used what the forward computed, "
            f"not the block rerun from its saved input (a copy of the block made in forward would not see the "
            f"change either: keep the block itself)")
    assert got_saved <= want, (
        f"recompute: autograd saved {got_saved} bytes, the formula says (L + 1) * B * h * e = {want}: save only the "
        f"block's input (run the block under torch.no_grad() in forward), not what the block computes")
    print(f"recompute: correct; {num_layers} layers, loss and gradients equal the plain run's bit for bit, each "
          f"layer recomputed once in backward; saved {got_saved} bytes instead of {saved} (formula: {want})")


# ---------------------------------------------------------------- mixed-precision FSDP

FSDP_TOLERANCE = 1e-6  # relative; the stored run agrees bit for bit (the same bf16 products, fp32 sums of N terms)
FSDP_ERRORS = [  # (words in a rank's error or its traceback, what they usually mean), the first that matches
    ("is invalid for input of size", "the gathered buffer holds world_size x shard.numel() elements, the padding "
                                     "included: drop the padding before the reshape (fsdp.unpad(full, shape))"),
    ("worldSize == inputShape[0]", "the flat gradient was not padded: the reduce-scatter needs world_size equal "
                                   "pieces, so pad it to a multiple of world_size first (fsdp.flat_padded), as the "
                                   "shards were cut"),
    ("optim/adam", "AdamW failed on a shard whose dtype changed under it: the master weights are lost. The shards "
                   "are the fp32 master weights the optimizer steps: never cast them (shard.data = ...), cast a copy "
                   "to param_dtype for the all-gather"),
    ("expected both", "x and the gathered weight must have one dtype: cast x to the weight's dtype (param_dtype) "
                      "before the matmul"),
    ("same dtype", "x and the gathered weight must have one dtype: cast x to the weight's dtype (param_dtype) "
                   "before the matmul"),
    ("dtype", "the all-gather's input and output must have one dtype: cast the shard to param_dtype, gather into a "
              "param_dtype buffer"),
]


def _spawn_fsdp(FSDPLinear, all_gather_unit, n, param_dtypes, sizes, fsdp2, doubled=False):
    try:
        by_rank = spawn(fsdp_runs_main, n, FSDPLinear, all_gather_unit, param_dtypes, sizes, fsdp2, doubled,
                        timeout=CHECK_TIMEOUT)
    except RankError as e:
        hint = next((h for words, h in FSDP_ERRORS if words in str(e)), "see the rank's error")
        raise AssertionError(f"mixed-precision FSDP failed on {n} ranks: {hint}\n{e}") from e
    runs = [[by_rank[r][0][j] for r in range(n)] for j in range(len(param_dtypes) + doubled)]
    return runs, by_rank[0][1]


def _verify_master_shards(runs, where):
    for rank, run in enumerate(runs):
        dtypes = {str(w.dtype) for w in run.weights} | {str(g.dtype) for g in run.first_grads if g is not None}
        if dtypes != {"torch.float32"}:
            raise AssertionError(f"{where}: on rank {rank}, the shards the optimizer steps (or their gradients) are "
                                 f"{', '.join(sorted(dtypes))}: the master weights are lost. Keep each shard fp32 and "
                                 f"cast a copy to param_dtype for the all-gather")


def _verify_collective_dtypes(runs, unit_numel, shard_numel, where):
    """Every all-gather fills a bf16 unit (2 bytes per element); every reduce-scatter leaves an fp32 shard."""
    rules = {  # collective: (elements, bytes per element, what it must have done, the hint when it did not)
        "all_gather": (unit_numel, 2, "an all-gather filled {said} ({nbytes} bytes for {numel} elements), not bf16 "
                       "({want}): all-gathered in fp32; cast the shard to param_dtype before the all-gather (half the "
                       "bytes), not after it"),
        "reduce_scatter": (shard_numel, 4, "a reduce-scatter left a {said} shard ({nbytes} bytes for {numel} "
                           "elements), not fp32: reduce-scattered in bf16; cast the gradient to reduce_dtype (fp32) "
                           "before the reduce-scatter: a sum kept in bf16 rounds at every addition (section 3)")}
    for rank, run in enumerate(runs):
        for call in run.calls:
            for name, (numel, size, hint) in rules.items():
                if call.name.startswith(name) and call.nbytes != size * numel:
                    said = {2 * numel: "bf16", 4 * numel: "fp32"}.get(call.nbytes, f"{call.nbytes} bytes")
                    raise AssertionError(f"{where}: on rank {rank}, " + hint.format(
                        said=said, nbytes=call.nbytes, numel=numel, want=size * numel))


def _close(got, want):
    return got.shape == want.shape and max_abs_diff(got, want) <= FSDP_TOLERANCE * max(1e-30, want.abs().max().item())


def _verify_against_reference(runs, reference, sizes, where):
    n = len(runs)
    for rank, run in enumerate(runs):
        for i, (got, whole) in enumerate(zip(run.first_grads, reference.first_grads)):
            want = fsdp.shard(whole, rank, n)
            if got is None or not _close(got, want):
                hint = diagnose_gradient(got, want, fsdp.shard(reference.local_grads[rank][i], rank, n), n)
                if got is not None and got.shape == want.shape and _close(got, fsdp.shard(whole.T, rank, n)):
                    hint = ("it is the transpose's shard: the weight's gradient is grad_output.T @ x, not "
                            "x.T @ grad_output")
                elif got is not None and not got.any() and want.any():
                    hint = (f"it is all zeros: no gradient reached layer {i}; backward must return the input's "
                            f"gradient too (grad_output @ W), or the layers before it get none")
                raise AssertionError(f"{where}: at step 0, rank {rank}'s shard of layer {i}'s gradient is not the "
                                     f"reference's (bf16 products, summed in fp32, divided by {n}); {hint}")
    weights = fsdp.gather_shards([run.weights for run in runs], [w.shape for w in reference.weights])
    for i, (got, want) in enumerate(zip(weights, reference.weights)):
        if not _close(got, want):
            raise AssertionError(f"{where}: after {sizes.num_steps} AdamW steps, layer {i}'s gathered weight differs "
                                 f"from the reference's by {max_abs_diff(got, want):.3g}, though step 0's gradients "
                                 f"were right: the optimizer must step the fp32 shards")
    if not all(_close(torch.tensor(a), torch.tensor(b)) for a, b in zip(runs[0].losses, reference.losses)):
        raise AssertionError(f"{where}: rank 0's losses {runs[0].losses} differ from the reference's "
                             f"{reference.losses}: compute the forward in bf16 (x and the gathered weight)")
    return all(torch.equal(g, w) for g, w in zip(weights, reference.weights))


def check_mixed_precision_fsdp(FSDPLinear, all_gather_unit, world_size, hidden_dim, num_layers, batch_size, num_steps,
                               seed=0):
    """Mixed-precision FSDP: fp32 shards; all-gathers in bf16 (exactly half the fp32 run's bytes); reduce-scatters
    in fp32; one gathered unit alive at most; against the single-process cast reference and FSDP2 with
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); backward gathers again (values: step 0 with the shards
    doubled between forward and backward, against the cast reference doubled so, checked last). Returns
    {"bf16": bytes, "fp32": bytes} all-gathered per step on rank 0."""
    sizes = checked_sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    configurations = world_configurations(world_size, sizes)
    exact, gathered = True, {}
    for k, (n, run_sizes) in enumerate(configurations):
        where = f"mixed-precision FSDP on {n} ranks (hidden {run_sizes.hidden_dim})"
        param_dtypes = [torch.bfloat16] + ([torch.float32] if k == 0 else [])
        runs, fsdp2 = _spawn_fsdp(FSDPLinear, all_gather_unit, n, param_dtypes, run_sizes, k == 0, doubled=True)
        unit = run_sizes.hidden_dim**2
        shard = fsdp.shard_numel(unit, n)
        _verify_master_shards(runs[0], where)
        verify_calls("mixed-precision FSDP", runs[0], num_layers, {"all_gather": 2 * num_layers,
                                                                     "reduce_scatter": num_layers})
        _verify_collective_dtypes(runs[0], n * shard, shard, where)
        verify_units("mixed-precision FSDP", runs[0], 1, where)
        reference = mixed_precision_reference(run_sizes, n)
        exact &= _verify_against_reference(runs[0], reference, run_sizes, where)
        # the last run's shards doubled between step 0's forward and backward: after the counts' and bytes' hints
        doubled = mixed_precision_reference(dataclasses.replace(run_sizes, num_steps=1), n, doubled=True)
        verify_shards_gathered_again(runs[-1], doubled.first_grads, reference.first_grads, where, _close)
        if k == 0:
            gathered = {name: fsdp_bytes_per_step(r[0].calls)["all_gather"] for name, r in zip(("bf16", "fp32"), runs)}
            assert gathered["bf16"] * 2 == gathered["fp32"], (
                f"{where}: all-gathered {gathered['bf16']} bytes per step in bf16, {gathered['fp32']} with "
                f"param_dtype=torch.float32: bf16 must be exactly half")
            weights = fsdp2.weights
            assert fsdp2.output_dtype == torch.bfloat16 and set(fsdp2.grad_dtypes) == {torch.float32}, (
                f"PyTorch's FSDP2 with MixedPrecisionPolicy: output {fsdp2.output_dtype}, sharded gradients "
                f"{fsdp2.grad_dtypes}; expected bf16 and fp32")
            assert all(_close(a, b) for a, b in zip(weights, reference.weights)), (
                f"PyTorch's FSDP2 with MixedPrecisionPolicy on {n} ranks differs from the reference")
            exact &= all(torch.equal(a, b) for a, b in zip(weights, reference.weights))
    agree = "bit for bit" if exact else f"to {FSDP_TOLERANCE:g} relative"
    ratio = gathered["bf16"] / gathered["fp32"]
    print(f"mixed-precision FSDP: correct on {ranks_and_sizes(configurations)}; "
          f"shards and their gradients fp32; per step "
          f"{2 * num_layers} all-gathers in bf16 ({gathered['bf16']} bytes on rank 0: {ratio:.2f}x "
          f"the fp32 run's {gathered['fp32']}) and {num_layers} reduce-scatters in fp32; 1 gathered unit alive at "
          f"most, in forward and in backward; step 0's gradients and the weights after {num_steps} AdamW steps equal "
          f"the single-process cast reference {agree} (so do FSDP2's with MixedPrecisionPolicy(param_dtype=bf16, "
          f"reduce_dtype=fp32) on {world_size} ranks)")
    return gathered
