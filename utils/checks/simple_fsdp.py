"""Checks for notebook 07 (sharded tensors, SimpleFSDP): redistribute, data_parallel, resharding after forward, units.

Each check runs the notebook's code on the given world size and on 3 ranks with sizes that do not divide
(uneven Shard(0) pieces, a rank with no rows at all), compares in float64 with the single-process result
and with PyTorch's own (DTensor's redistribute, FSDP2's fully_shard), and counts the collectives and the
bytes handed to them (utils.simple_fsdp.record_collectives).
"""
from typing import NamedTuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from utils import pytorch_reference, simple_fsdp
from utils.checks import (CHECK_TIMEOUT, TOLERANCE, diagnose_gradient, max_abs_diff, seeded_randn,
                          verify_gathered_again)
from utils.fsdp import doubled_gradients
from utils.launch import RankError, runnable_world_sizes, spawn
from utils.model import Sizes, build_mlp, make_batch
from utils.sizes import check_int

ISSUES = dict(zip(simple_fsdp.MOVES, ("all-gather", "all-reduce", "reduce-scatter", "nothing")))
# The awkward model's float32 `gate` sums in float32, in another order than one process: it (and through it every
# parameter after the first step) agrees to float32's precision only, as in notebook 05.
FLOAT32_TOLERANCE = 1e-6


def _other_world_size(world_size):
    return runnable_world_sizes([3])[0]


def _spawn(fn, world_size, *args, what, hints):
    """spawn, with a rank's failure turned into an AssertionError; hints: {text in the error: what it means}."""
    try:
        return spawn(fn, world_size, *args, timeout=CHECK_TIMEOUT)
    except RankError as e:
        hint = next((hint for text, hint in hints.items() if text in str(e)), "")
        raise AssertionError(f"{what} failed on {world_size} ranks{hint}: {e}") from e


UNEVEN = (" (uneven Shard(0) pieces: a collective needs equal pieces, so pad each shard to k = ceil(rows / N) rows "
          "before it, and drop the padding after)")
FEWER_PIECES = (" (torch.chunk gives fewer than N pieces when the rows do not fill N chunks of ceil(rows / N): 2 "
                "rows on 3 ranks give 2 pieces, and rank 2 has none to index; a rank's Shard(0) rows are "
                "simple_fsdp.local_shard's, empty where it holds none)")
WRONG_VIEW = (" (on the fused model, right with the MLP and the awkward one: backward got a saved tensor of another "
              "shape than the one autograd saved: a half of the fused weight (gate_up.weight.chunk(2)) is a view of "
              "part of the gathered weight, at a storage offset for the second half; unpack_gathered must rebuild "
              "that very view: as_strided(size, stride, storage_offset) of the weight gathered again)")
MODEL_NAMES = {"mlp": "mlp", "awkward": "awkward", "fused": "fused model"}
PACKED_NONE = (" (unpack_gathered got (None, ...): pack_gathered kept a source for a tensor that is not a gathered "
               "weight, for which simple_fsdp.gathered_from gives None: keep such a tensor as it is)")
FLAT_UNIT_CRASHES = {
    "invalid tensor size": UNEVEN,
    "cannot assign": " (the module still has its own parameters where forward sets the views: delete them from the "
                     "module once the flat shard holds their values; the flat shard is the unit's only parameter)",
    "invalid gradient": " (Unshard's backward returns one rank's shard of the padded flat gradient: flat_shard must be "
                        "this rank's shard of the padded flat buffer, not the whole buffer)",
    "does not require grad": " (all-gather self.flat_shard itself, not a detached copy: its gradient reaches the shard "
                             "only through Unshard's backward)",
}


# ---------------------------------------------------------------- section 1: redistribute

class Case(NamedTuple):
    shape: tuple
    src: object
    dst: object
    column_major: bool = False  # the local tensor stored column-major (a transposed tensor's layout)

    def __str__(self):
        layout = ", stored column-major" if self.column_major else ""
        name = simple_fsdp.placement_name
        return f"redistribute {name(self.src)} -> {name(self.dst)} of shape {self.shape}{layout}"


def shapes_for(world_size):
    """Uneven rows (2N + 1), even rows (2N), and fewer rows than ranks (the last ranks hold none)."""
    return [(2 * world_size + 1, 3), (2 * world_size, 3), (max(1, world_size - 1), 2)]


def cases_for(world_size):
    """Every move on shapes_for's shapes; a scalar's sum (a summed loss); Shard dims counted from the end (1-D, 2-D,
    3-D); and every move of a local tensor stored column-major (DTensor moves a contiguous copy)."""
    uneven = shapes_for(world_size)[0]
    return ([Case(shape, src, dst) for shape in shapes_for(world_size) for src, dst in simple_fsdp.MOVES]
            + [Case((), Partial(), Replicate()), Case(uneven, Shard(-2), Replicate()),
               Case((uneven[0],), Partial(), Shard(-1)), Case((world_size + 1, 2, 2), Replicate(), Shard(-3))]
            + [Case(uneven, src, dst, column_major=True) for src, dst in simple_fsdp.MOVES])


# Moves redistribute does not make, each refused with a ValueError: a Partial that is not a sum, a scalar's Shard,
# Shard(-1) of a 2-D tensor (Shard(1)).
REFUSED = [Case((5, 3), Partial("max"), Replicate()), Case((), Replicate(), Shard(0)),
           Case((5, 3), Replicate(), Shard(-1))]


def local_tensor(case, rank, world_size, seed):
    """Rank `rank`'s local tensor under `case.src` of the DTensor whose value `whole_value` gives."""
    if case.src.is_partial():
        local = seeded_randn(case.shape, seed, rank)
    else:
        local = seeded_randn(case.shape, seed, world_size + 1)
        local = simple_fsdp.local_shard(local, rank, world_size).clone() if case.src.is_shard() else local
    return local.mT.contiguous().mT if case.column_major else local


def whole_value(placement, shape, world_size, seed):
    if placement.is_partial():
        return sum(seeded_randn(shape, seed, rank) for rank in range(world_size))
    return seeded_randn(shape, seed, world_size + 1)


def _refusal(redistribute, case, local):
    """What redistribute does with a move it must refuse: ("refused",), ("raised", error) or ("returned", tensor)."""
    try:
        out = redistribute(local, case.src, case.dst, case.shape)
    except ValueError:
        return ("refused",)
    except Exception as e:  # noqa: BLE001 - reported, with its type, as not the ValueError wanted
        return ("raised", f"{type(e).__name__}: {e}")
    return ("returned", out)


def redistribute_main(rank, world_size, redistribute, cases, seed):
    """([what each REFUSED case did], [(case, (ours, contiguous, our collectives), (DTensor's, ...))]) on this
    rank; the moves are tried only once every refusal is a ValueError (all ranks alike)."""
    from torch.distributed.device_mesh import init_device_mesh

    refusals = [_refusal(redistribute, case, local_tensor(case, rank, world_size, seed)) for case in REFUSED]
    if any(refusal[0] != "refused" for refusal in refusals):
        return refusals, []
    mesh = init_device_mesh("cpu", (world_size,))
    results = []
    for case in cases:
        local = local_tensor(case, rank, world_size, seed)
        try:  # name the move in the error: the crash hints depend on it
            with simple_fsdp.record_collectives() as ours_log:
                ours = redistribute(local.clone(), case.src, case.dst, case.shape).detach()
        except Exception as e:
            raise RuntimeError(f"{case}: {type(e).__name__}: {e}") from e
        with simple_fsdp.record_collectives() as theirs_log:
            theirs = pytorch_reference.dtensor_redistribute(local.clone(), case.src, case.dst, case.shape, mesh)
        # contiguous is asked here: the copy that brings a tensor to the parent may lay it out anew
        results.append((case, (ours, ours.is_contiguous(), ours_log), (theirs, theirs.is_contiguous(), theirs_log)))
    return refusals, results


SCALAR = (" (a scalar, such as a summed loss, has shape (): it has no rows, so shape[0] fails; its Partial() -> "
          "Replicate() is an all-reduce that needs no rows or k)")
NEGATIVE = (" (DTensor counts a negative Shard dim from the end: Shard(-2) of a 2-D tensor is Shard(0); move it as "
            "Shard(0): simple_fsdp.check_move returns the placements so)")
NO_RESULT = " (a move returned None: every move returns this rank's new local tensor)"


def _diagnose_refusal(refusal, case, rank, world_size, seed):
    """Why what redistribute did with a move it must refuse is not a ValueError, in words."""
    what = f"{case} on rank {rank} of {world_size}"
    if refusal[0] == "raised":
        return (f"{what} raised {refusal[1]}; a move not made here is refused with a ValueError that names it "
                f"(simple_fsdp.check_move raises it)")
    out, wanted = refusal[1], "a ValueError naming the move (simple_fsdp.check_move raises it)"
    if case.src.is_partial() and isinstance(out, torch.Tensor) and out.shape == case.shape:
        summed = whole_value(Partial(), case.shape, world_size, seed)
        if max_abs_diff(out, summed) < TOLERANCE:
            return (f"{what} returned the sum over the ranks: a {simple_fsdp.placement_name(case.src)}'s value is "
                    f"the {case.src.reduce_op} over the ranks, not their sum; a Partial() here is a sum, so the "
                    f"others get {wanted}")
    return f"{what} returned {'None' if out is None else 'a tensor'}; a move not made here gets {wanted}"


def _diagnose_values(got, want, local, case, world_size):
    """Why a redistributed local tensor is not `want`: the usual mistakes, in words."""
    src, dst, shape = case.src, case.dst, case.shape
    if got.shape != want.shape and got.dim() and want.dim() == len(shape) > 0:
        rows, k = shape[0], simple_fsdp.shard_rows(shape[0], world_size)
        padded = world_size * k if dst.is_replicate() else k
        if got.shape[0] == padded and got.shape[0] != want.shape[0]:
            return f"it has {got.shape[0]} rows, {want.shape[0]} expected: the padding rows were not dropped"
        if dst.is_shard() and got.shape[0] == rows:
            return f"it has all {rows} rows: Shard(0) keeps only this rank's rows ({want.shape[0]})"
        if dst.is_shard() and got.shape[0] == rows // world_size:
            lost = (f"row {rows - 1} of {rows} was" if rows - world_size * (rows // world_size) == 1 else
                    f"rows {world_size * (rows // world_size)} to {rows - 1} of {rows} were")
            return (f"it has {got.shape[0]} rows, {want.shape[0]} expected: Shard(0) gives each rank ceil(rows / N) "
                    f"= {k} rows, as torch.chunk does (the last ranks fewer, or none), not rows // N = "
                    f"{rows // world_size}: with {rows // world_size} rows a rank, {lost} never handed out "
                    f"(simple_fsdp.local_shard splits so)")
    if got.shape != want.shape:
        return f"its shape is {tuple(got.shape)}, {tuple(want.shape)} expected"
    if got.dtype != local.dtype:
        return f"it is {got.dtype}, the local tensor {local.dtype}: move a tensor in its own dtype (no cast)"
    if got.dtype == torch.float64 and torch.equal(got, got.float().double()) and not torch.equal(want, want.float()
                                                                                                  .double()):
        return (f"it differs by up to {max_abs_diff(got, want):.3g} and every value of it is a float32: it was cast "
                f"to float32 on the way (move a tensor in its own dtype, {local.dtype})")
    if src.is_partial():
        if max_abs_diff(got, want / world_size) < TOLERANCE:
            return "it is the mean over the ranks: a Partial() value is their sum"
        if got.shape == local.shape and max_abs_diff(got, local) < TOLERANCE:
            return "it is this rank's own tensor: it was never summed over the ranks"
    return f"it differs by up to {max_abs_diff(got, want):.3g}{_first_row(got, want, case, world_size)}"


def _first_row(got, want, case, world_size):
    """Where a local tensor first differs: its row, and for a gathered tensor the rank whose shard held it."""
    if not got.dim() or not got.numel():
        return ""
    wrong = ~((got - want).abs() <= TOLERANCE).reshape(got.shape[0], -1).all(dim=1)  # NaN counts as wrong
    if not wrong.any():
        return ""
    row = int(wrong.nonzero()[0])
    whose = ""
    if case.src.is_shard() and case.dst.is_replicate():
        whose = (f", which rank {row // simple_fsdp.shard_rows(case.shape[0], world_size)}'s Shard(0) held: every "
                 f"rank's rows must arrive (all-gathered)")
    return f", first in row {row}{whose}"


def _negative(case):
    return any(p.is_shard() and p.dim < 0 for p in (case.src, case.dst))


def check_redistribute(redistribute, world_size, seed=0):
    """redistribute(local, src, dst, shape) for Shard(0)->Replicate, Partial->Replicate, Partial->Shard(0),
    Replicate->Shard(0), a scalar and negative dims included: the single-process value, DTensor's local tensor bit for
    bit (contiguous where DTensor's is), DTensor's collectives and bytes; other moves refused with a ValueError."""
    world_size = check_int("world_size", world_size)
    seed = check_int("seed", seed, 0)
    sizes = sorted({world_size, _other_world_size(world_size)})
    for n in sizes:
        by_rank = _spawn(redistribute_main, n, redistribute, cases_for(n), seed, what="redistribute",
                         hints={"of shape (): ": SCALAR, "Shard(-": NEGATIVE, "invalid tensor size": UNEVEN,
                                "* worldSize ==": UNEVEN, "IndexError": FEWER_PIECES,
                                "'NoneType' object has no attribute": NO_RESULT})
        for rank, (refusals, results) in enumerate(by_rank):
            for case, refusal in zip(REFUSED, refusals):
                if refusal[0] != "refused":
                    raise AssertionError(_diagnose_refusal(refusal, case, rank, n, seed))
            for case, (ours, ours_contiguous, ours_log), (theirs, theirs_contiguous, theirs_log) in results:
                what = f"{case} on rank {rank} of {n}"
                src, dst = simple_fsdp.check_move(case.src, case.dst, case.shape)
                whole = whole_value(src, case.shape, n, seed)
                want = simple_fsdp.local_shard(whole, rank, n) if dst.is_shard() else whole
                if ours.shape != want.shape or max_abs_diff(ours, want) > TOLERANCE:
                    if _negative(case):
                        raise AssertionError(f"{what}: wrong local tensor{NEGATIVE}")
                    local = local_tensor(case, rank, n, seed)
                    if dst.is_shard():
                        local = simple_fsdp.local_shard(local, rank, n)
                    raise AssertionError(f"{what}: wrong local tensor; {_diagnose_values(ours, want, local, case, n)}")
                if theirs.shape != want.shape or max_abs_diff(theirs, want) > TOLERANCE:
                    raise AssertionError(f"{what}: DTensor's own result differs from the single-process value")
                if ours_log != theirs_log:
                    said = ", ".join(map(str, ours_log)) or "no collective"
                    wanted = ", ".join(map(str, theirs_log)) or "no collective"
                    raise AssertionError(f"{what}: issued {said}; DTensor's redistribute issues {wanted} (the bytes "
                                         f"are those of each collective's input, padded to N equal pieces)")
                if theirs_contiguous and not ours_contiguous:
                    raise AssertionError(f"{what}: the result is not contiguous; DTensor's is: return a contiguous "
                                         f"tensor (a sum taken on a contiguous buffer, a copy of the rows kept)")
                if not torch.equal(ours, theirs):
                    raise AssertionError(f"{what}: equal to DTensor's result only to {max_abs_diff(ours, theirs):.1g}, "
                                         f"not bit for bit: gloo adds element by element in memory order, so reduce "
                                         f"a contiguous copy of the local tensor, as DTensor does")
    issued = "; ".join(f"{simple_fsdp.placement_name(s)} -> {simple_fsdp.placement_name(d)}: {ISSUES[(s, d)]}"
                       for s, d in simple_fsdp.MOVES)
    print(f"redistribute: correct on {' and '.join(map(str, sizes))} ranks, shapes with uneven rows, even rows and "
          f"fewer rows than ranks; equal to the single-process values to {TOLERANCE:g} and to DTensor's redistribute "
          f"bit for bit, with the same collectives and bytes ({issued})")


# ---------------------------------------------------------------- section 2: data_parallel

def _sizes(hidden_dim, num_layers, batch_size, num_steps, seed):
    return Sizes(check_int("hidden_dim", hidden_dim, 2), check_int("num_layers", num_layers),
                 check_int("batch_size", batch_size), check_int("num_steps", num_steps, 2), check_int("seed", seed, 0))


def configurations(world_size, sizes):
    """The notebook's sizes, and 3 ranks with a hidden size 3 does not divide (uneven Shard(0) pieces)."""
    local_batch_size = simple_fsdp.check_sizes(sizes.batch_size, world_size)
    other = _other_world_size(world_size)
    hidden = sizes.hidden_dim  # a hidden size `other` does not divide, and another one than the first run's
    while other > 1 and (hidden % other == 0 or (other == world_size and hidden == sizes.hidden_dim)):
        hidden += 1
    return [(world_size, sizes),
            (other, Sizes(hidden, sizes.num_layers, other * local_batch_size, sizes.num_steps, sizes.seed))]


def _tolerance(model, want):
    scale = want.abs().max().item() if want.numel() else 1.0
    return FLOAT32_TOLERANCE * max(1.0, scale) if model == "awkward" else TOLERANCE


def _verify_sharded(runs, model, mode, sizes, where):
    """Each rank holds its Shard(0) rows of every parameter (fully_shard) or the whole of it (replicate)."""
    n = len(runs)
    shapes = {name: p.shape for name, p in simple_fsdp.build_model(model, sizes.hidden_dim, sizes.num_layers)
              .named_parameters()}
    for rank, run in enumerate(runs):
        for name, shape in shapes.items():
            got = tuple(run.local[name].shape) if name in run.local else None
            rows = simple_fsdp.local_rows(shape[0], rank, n) if mode == "fully_shard" else shape[0]
            want = (rows, *shape[1:])
            if got != want:
                kept = "its whole parameter" if got == tuple(shape) else f"a tensor of shape {got}"
                frozen = " (a frozen parameter is sharded too: it is gathered, never reduce-scattered)" if (
                    name.startswith("frozen")) else ""
                raise AssertionError(f"{where}: rank {rank} keeps {kept} as {name!r}; {mode} keeps "
                                     f"{'its Shard(0) rows' if mode == 'fully_shard' else 'the whole parameter'}, "
                                     f"shape {want}{frozen}")


def _verify_calls(runs, model, mode, where, regathered=0):
    """Per step: fully_shard, one all-gather per parameter read (plus `regathered` in backward) and one
    reduce-scatter per gradient; replicate, one all-reduce per gradient; nothing else."""
    n = len(runs)
    names = list(runs[0].local)
    trainable = set(runs[0].first_grads) | {nm for nm in names if not nm.startswith("frozen")}
    for rank, run in enumerate(runs):
        for step, log in enumerate(run.calls):
            used = simple_fsdp.used_parameters(model, step, names)
            with_grad = [nm for nm in used if nm in trainable]
            if mode == "fully_shard":
                want = {"all-gather": len(used) + regathered, "reduce-scatter": len(with_grad), "all-reduce": 0}
            else:
                want = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": len(with_grad)}
            got = {kind: simple_fsdp.count(log, kind) for kind in want}
            others = [c for c in log if c.kind not in want]
            if got != want or others:
                said = ", ".join(f"{k} {kind}(s)" for kind, k in got.items()) + "".join(f", {c.kind}" for c in others)
                wanted = ", ".join(f"{k} {kind}(s)" for kind, k in want.items())
                raise AssertionError(f"{where}: on rank {rank} of {n}, step {step} issued {said}; expected {wanted} "
                                     f"for its {len(used)} parameters read ({len(with_grad)} with a gradient)")


def _verify_gradients(runs, model, mode, sizes, where):
    """Step 0: each rank's .grad is its part (Shard(0) rows, or all) of the whole batch's gradient."""
    n, whole = len(runs), simple_fsdp.first_gradients(model, sizes)
    for rank, run in enumerate(runs):
        local = simple_fsdp.first_gradients(model, sizes, rank, n)
        for name, grad in whole.items():
            part = (lambda t: simple_fsdp.local_shard(t, rank, n)) if mode == "fully_shard" else (lambda t: t)
            want, got = part(grad), run.first_grads.get(name)
            if got is None or got.shape != want.shape or max_abs_diff(got, want) > _tolerance(model, want):
                hint = diagnose_gradient(got, want, part(local[name]), n)
                raise AssertionError(f"{where}: at step 0, rank {rank}'s gradient of {name!r} is not its part of the "
                                     f"whole batch's gradient: {hint}")


def _verify_weights(runs, model, mode, sizes, where):
    """After the steps: the shards put together (fully_shard), or every rank's parameters (replicate), equal the
    single-process run's."""
    reference, _ = simple_fsdp.train_single(model, sizes)
    if mode == "fully_shard":
        finals = {"the shards put together": {name: torch.cat([run.local[name] for run in runs]) for name in reference}}
    else:
        finals = {f"on rank {rank}": run.local for rank, run in enumerate(runs)}
    for whose, weights in finals.items():
        for name, want in reference.items():
            got = weights[name]
            diff = max_abs_diff(got, want) if got.shape == want.shape else float("inf")
            if diff > _tolerance(model, want):
                raise AssertionError(f"{where}: after {sizes.num_steps} AdamW steps, {name!r} ({whose}) differs from "
                                     f"the single-process run's by {diff:.3g} (step 0's gradients were right)")


def _runs(data_parallel, n, jobs, sizes, reshard=None, track=False, hints=None):
    """{job: [its Run on each rank]} for jobs (model, mode, resharded), all in one launch; hints: as _spawn's, over
    the usual ones."""
    by_rank = _spawn(simple_fsdp.runs_main, n, data_parallel, jobs, sizes, reshard, track,
                     what="data_parallel" + (" with reshard_after_forward" if reshard else ""),
                     hints={"invalid tensor size": UNEVEN, "* worldSize ==": UNEVEN, "invalid gradient": UNEVEN,
                            **({"cannot unpack non-iterable NoneType": PACKED_NONE} if reshard else {}),
                            **(hints or {})})
    return {job: [runs[j] for runs in by_rank] for j, job in enumerate(jobs)}


def check_data_parallel(data_parallel, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """data_parallel(model, mode) in both modes, on the MLP and the awkward model: against the single-process run,
    FSDP2 on the MLP; one all-gather per parameter read and one reduce-scatter per gradient per step (fully_shard),
    one all-reduce per gradient (replicate); each rank holds its Shard(0) rows only (fully_shard)."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    jobs = [(model, mode, False) for model in simple_fsdp.MODELS for mode in simple_fsdp.MODES]
    for k, (n, run_sizes) in enumerate(configurations(world_size, sizes)):
        for (model, mode, _), runs in _runs(data_parallel, n, jobs, run_sizes).items():
            where = f"data_parallel(mode={mode!r}) on {n} ranks, the {model} (hidden {run_sizes.hidden_dim})"
            _verify_sharded(runs, model, mode, run_sizes, where)
            _verify_calls(runs, model, mode, where)
            _verify_gradients(runs, model, mode, run_sizes, where)
            _verify_weights(runs, model, mode, run_sizes, where)
        if k == 0:
            fsdp2 = _spawn(simple_fsdp.fsdp2_main, n, run_sizes, what="FSDP2", hints={})
            reference, losses = simple_fsdp.train_single("mlp", run_sizes)
            for name, want in reference.items():
                if max_abs_diff(fsdp2[0][0][name], want) > TOLERANCE:
                    raise AssertionError(f"PyTorch's FSDP2 differs from the single-process run on {name!r}")
    other = configurations(world_size, sizes)[1]
    print(f"data_parallel: correct in both modes on {world_size} ranks (hidden {hidden_dim}) and {other[0]} ranks "
          f"(hidden {other[1].hidden_dim}: uneven Shard(0) rows), on the MLP and on the awkward model (bias, "
          f"embedding, frozen, unused every other step, float32 in float64); after {num_steps} AdamW steps equal to "
          f"the single-process run to {TOLERANCE:g} (the awkward model to {FLOAT32_TOLERANCE:g}), as is FSDP2 on "
          f"{world_size} ranks; per step and parameter: fully_shard 1 all-gather and 1 reduce-scatter, replicate "
          f"1 all-reduce; each rank keeps only its rows")


# ---------------------------------------------------------------- section 3: resharding after forward

def _verify_resharded(runs, model, sizes):
    """One model's runs with reshard_after_forward: at most one gathered unit alive and every weight gathered again
    in backward (the MLP), step 0's gradients and the weights after the steps (all)."""
    where = f"reshard_after_forward on {len(runs)} ranks, the {MODEL_NAMES[model]} (hidden {sizes.hidden_dim})"
    if model == "mlp":
        for rank, run in enumerate(runs):
            for (step, phase), alive in run.units_by_phase.items():
                if phase in ("forward", "backward") and alive > 1:
                    raise AssertionError(f"{where}: on rank {rank}, up to {alive} gathered units were alive at once "
                                         f"in step {step}'s {phase}: a gathered weight is still kept for backward; "
                                         f"pack it as its shard, gather it again when unpacked")
        # every weight again in backward, but the first layer's: its input needs no gradient, so x @ W.T saves no W
        _verify_calls(runs, model, "fully_shard", where, regathered=sizes.num_layers - 1)
    try:
        _verify_gradients(runs, model, "fully_shard", sizes, where)
        _verify_weights(runs, model, "fully_shard", sizes, where)
    except AssertionError as e:
        if model == "fused" and _offset_dropped(runs, sizes):
            raise AssertionError(f"{where}: the first layer's gradient is the one backward gets when the saved view of "
                                 f"gate_up's second half (up.T, at storage offset {sizes.hidden_dim**2}) is rebuilt "
                                 f"at offset 0, from its first half: unpack_gathered left out the storage offset; "
                                 f"rebuild the view with as_strided(size, stride, storage_offset)") from None
        raise AssertionError(f"{e}. Without reshard_after_forward it is right: look at unpack_gathered, which must "
                             f"return the very view autograd saved (its size, stride and storage offset: as_strided), "
                             f"of the weight gathered again") from None


def _verify_gathered_again(runs, sizes):
    """The MLP's step 0 with every shard doubled between forward and backward: unpack_gathered gathers the doubled
    shards, so the inputs' gradients, and through them the earlier layers' weight gradients, are the doubled
    weights'; a weight kept from forward gives the plain step's. Values, where the bytes held and the calls,
    taken in the rank that runs the student's code, could be forged."""
    where = f"reshard_after_forward on {len(runs)} ranks, the mlp (hidden {sizes.hidden_dim})"
    net = simple_fsdp.build_model("mlp", sizes.hidden_dim, sizes.num_layers, sizes.seed)
    doubled = doubled_gradients(net, make_batch(sizes.batch_size, sizes.hidden_dim, sizes.seed, 0))
    kept = simple_fsdp.first_gradients("mlp", sizes)
    n = len(runs)
    shards = ((rank, f"gradient of {name!r}", run.first_grads.get(name), simple_fsdp.local_shard(whole, rank, n),
               simple_fsdp.local_shard(kept[name], rank, n))
              for rank, run in enumerate(runs) for name, whole in doubled.items())
    verify_gathered_again(
        shards, where, lambda got, want: max_abs_diff(got, want) <= TOLERANCE,
        "backward used the weights gathered in forward: they were kept, not packed as shards and gathered again when "
        "unpacked", "unpack_gathered gathering the shards again")


def _offset_dropped(runs, sizes):
    """Whether each rank's step 0 gradients are those of views of the weights rebuilt without their storage offset."""
    whole = simple_fsdp.first_gradients("fused", sizes, saving=simple_fsdp.storage_offset_dropped)
    return all(name in run.first_grads and max_abs_diff(run.first_grads[name],
                                                        simple_fsdp.local_shard(grad, rank, len(runs))) <= TOLERANCE
               for rank, run in enumerate(runs) for name, grad in whole.items())


def check_reshard(data_parallel, reshard_after_forward, world_size, hidden_dim, num_layers, batch_size, num_steps,
                  seed=0):
    """The same training with every forward inside reshard_after_forward(): the same weights; 1 gathered unit
    alive at most in forward, 2 all-gathers per parameter per step; without it, every unit alive at the end of
    forward. Then a fused weight split in two: the view of its second half starts at a storage offset. Returns
    {"kept": units, "resharded": units} on the notebook's sizes."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    units = {}
    jobs = [("mlp", "fully_shard", True), ("awkward", "fully_shard", True), ("mlp", "fully_shard", False)]
    doubled = ("mlp", "fully_shard", True, True)  # the shards doubled between step 0's forward and backward
    fused = ("fused", "fully_shard", True)  # launched once the others pass: it needs more of unpack_gathered
    for k, (n, run_sizes) in enumerate(configurations(world_size, sizes)):
        all_runs = _runs(data_parallel, n, (jobs if k == 0 else jobs[:2]) + [doubled], run_sizes,
                         reshard_after_forward, track=True)
        doubled_runs = all_runs.pop(doubled)
        if k == 0:
            kept = all_runs.pop(jobs[2])[0]
            units["resharded"] = {phase: max(v for (s, p), v in all_runs[jobs[0]][0].units_by_phase.items()
                                             if p == phase) for phase in ("forward", "backward")}
        for (model, _, _), runs in all_runs.items():
            _verify_resharded(runs, model, run_sizes)
        _verify_gathered_again(doubled_runs, run_sizes)  # after the counts and bytes: their hints first
        runs = _runs(data_parallel, n, [fused], run_sizes, reshard_after_forward,
                     hints={"invalid gradient": WRONG_VIEW, "shapes cannot be multiplied": WRONG_VIEW})
        _verify_resharded(runs[fused], "fused", run_sizes)
    units["kept"] = {phase: max(v for (s, p), v in kept.units_by_phase.items() if p == phase)
                     for phase in ("forward", "backward")}
    print(f"reshard_after_forward: correct on {world_size} and {configurations(world_size, sizes)[1][0]} ranks, the "
          f"MLP, the awkward model and a fused weight split in two (a view at a storage offset), weights equal to the "
          f"single-process run's; per step on the MLP {2 * num_layers - 1} all-gathers (each layer's weight in "
          f"forward, and again in backward but the first layer's, which backward does not need) and {num_layers} "
          f"reduce-scatters; gathered units alive at most (forward, backward): kept for backward "
          f"{units['kept']['forward']}, {units['kept']['backward']}; resharded {units['resharded']['forward']}, "
          f"{units['resharded']['backward']}")
    return units


# ---------------------------------------------------------------- section 4: units

def _verify_units(runs, unit, sizes, where):
    """One flat shard per unit on each rank, the right rows; one all-gather and one reduce-scatter of the unit's
    padded size per unit and step; the whole flat buffers equal the single-process run's parameters, in order;
    no gathered buffer left after forward and backward."""
    n, units = len(runs), simple_fsdp.num_units(unit, sizes.num_layers)
    reference = [p.reshape(-1) for p in simple_fsdp.train_single("mlp", sizes)[0].values()]
    initial = torch.cat([p.detach().reshape(-1) for p in build_mlp(sizes.hidden_dim, sizes.num_layers, sizes.seed,
                                                                    torch.float64).parameters()])
    per_unit = sizes.num_layers // units * sizes.hidden_dim**2  # elements per unit (the layers split evenly here)
    for rank, run in enumerate(runs):
        shapes = [tuple(t.shape) for t in run.local.values()]
        want = [(simple_fsdp.local_rows(per_unit, rank, n),)] * units
        if shapes != want:
            raise AssertionError(f"{where}: rank {rank} trains tensors of shapes {shapes}; {units} unit(s) means "
                                 f"{units} flat shard(s) of shape {want[0]}, and nothing else (remove the module's "
                                 f"own parameters once they are in the flat shard: delattr)")
        _verify_initial_shards(run, rank, n, initial, per_unit, where)
        for name, kept in run.storage.items():
            own = run.initial[name].numel() * run.initial[name].element_size()
            if kept > own:
                raise AssertionError(f"{where}: rank {rank}'s {name!r} is a view of the whole flat buffer: its storage "
                                     f"holds {kept} bytes for its own {own}, so every rank keeps the whole unit in "
                                     f"memory (and the optimizer's in-place steps write into that buffer): keep a "
                                     f"copy of this rank's rows (.clone())")
        for step, log in enumerate(run.calls):
            gathers = [c for c in log if c.kind == "all-gather"]
            scatters = [c for c in log if c.kind == "reduce-scatter"]
            k = simple_fsdp.shard_rows(per_unit, n) * runs[0].local[next(iter(run.local))].element_size()
            if len(gathers) == units and not scatters:
                raise AssertionError(f"{where}: rank {rank}'s step {step} issued no reduce-scatter: Unshard's "
                                     f"backward never ran, so no gradient reached flat_shard (set each parameter as "
                                     f"a plain view of its piece of the gathered buffer: an nn.Parameter or a "
                                     f"detached copy cuts the gradient's way back)")
            if len(gathers) != units or len(scatters) != units or len(log) != 2 * units:
                said = ", ".join(map(str, log))
                raise AssertionError(f"{where}: rank {rank}'s step {step} issued {said}; {units} unit(s): one "
                                     f"all-gather of the whole flat shard per unit in forward, one reduce-scatter "
                                     f"per unit in backward")
            if any(c.nbytes != k for c in gathers):
                raise AssertionError(f"{where}: rank {rank}'s all-gathers take {[c.nbytes for c in gathers]} bytes; a "
                                     f"unit's padded shard is {k} bytes")
        for (step, phase), alive in run.units_by_phase.items():
            if phase == "optimizer" and alive:
                raise AssertionError(f"{where}: on rank {rank}, {alive} gathered buffer(s) still alive after step "
                                     f"{step}'s backward: the views set on the module must be taken away after its "
                                     f"forward (delattr), or they keep the whole unit gathered until the next step")
    got = torch.cat([torch.cat([run.local[name] for run in runs]) for name in runs[0].local])
    diff = max_abs_diff(got, torch.cat(reference)) if got.shape[0] == sum(r.numel() for r in reference) else None
    if diff is None or diff > TOLERANCE:
        what = "a different number of elements" if diff is None else f"values off by up to {diff:.3g}"
        raise AssertionError(f"{where}: after {sizes.num_steps} AdamW steps, the flat shards put together hold {what} "
                             f"against the single-process run's parameters, in order. Before the first step each "
                             f"rank held its rows of the parameters flattened in order, and the collectives were "
                             f"right: look at forward, where each parameter must be set from its own piece of the "
                             f"gathered buffer (split in the order they were flattened)")


def _verify_initial_shards(run, rank, n, initial, per_unit, where):
    """Before step 0, unit u's flat shard on `rank` is its Shard(0) rows of the unit's parameters flattened in order;
    if not, whose rows (or what) it holds."""
    for u, (name, got) in enumerate(run.initial.items()):
        whole = initial[u * per_unit:(u + 1) * per_unit]
        want = simple_fsdp.local_shard(whole, rank, n)
        if got.shape == want.shape and torch.equal(got, want):
            continue
        others = [r for r in range(n) if r != rank and torch.equal(got, simple_fsdp.local_shard(whole, r, n))]
        if others:
            why = (f"it holds rank {others[0]}'s rows: take this rank's, local_shard(flat, dist.get_rank(), "
                   f"dist.get_world_size())")
        elif got.shape == want.shape and torch.equal(torch.sort(got).values, torch.sort(want).values):
            why = "it holds this rank's values in another order: flatten the parameters in named_parameters order"
        else:
            why = f"its shape is {tuple(got.shape)} ({tuple(want.shape)} expected), values off by up to " + (
                f"{max_abs_diff(got, want):.3g}" if got.shape == want.shape else "-")
        raise AssertionError(f"{where}: before the first step, rank {rank}'s {name!r} is not its Shard(0) rows of "
                             f"the unit's parameters flattened and concatenated in order: {why}")


def check_units(FlatUnit, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0):
    """FlatUnit around each layer, each pair of layers and the whole MLP, on world_size ranks and on 3 with uneven
    shards. Returns {unit: (collectives per step, bytes of one all-gather's input, peak gathered bytes, peak total
    bytes)} on the notebook's sizes (rank 0)."""
    sizes = _sizes(hidden_dim, num_layers, batch_size, num_steps, seed)
    if num_layers % 2:
        raise ValueError(f"num_layers must be even to make pairs of layers, got {num_layers}")
    rows = {}
    for k, (n, run_sizes) in enumerate(configurations(world_size, sizes)):
        by_rank = _spawn(simple_fsdp.units_runs_main, n, FlatUnit, simple_fsdp.UNITS, run_sizes, what="FlatUnit",
                         hints=FLAT_UNIT_CRASHES)
        for j, unit in enumerate(simple_fsdp.UNITS):
            runs = [runs_of_rank[j] for runs_of_rank in by_rank]
            _verify_units(runs, unit, run_sizes, f"FlatUnit, one unit per {unit}, on {n} ranks "
                                                 f"(hidden {run_sizes.hidden_dim})")
            if k == 0:
                run = runs[0]
                gathers = [c for c in run.calls[-1] if c.kind == "all-gather"]
                rows[unit] = (len(run.calls[-1]), gathers[0].nbytes, run.peak["gathered"], sum(run.peak.values()))
    print(f"FlatUnit: correct on {world_size} and {configurations(world_size, sizes)[1][0]} ranks, one unit per "
          f"layer, per pair of layers and for the whole model; after {num_steps} AdamW steps the flat shards equal "
          f"the single-process run's parameters to {TOLERANCE:g}; per step one all-gather and one reduce-scatter per "
          f"unit, of the unit's padded size; nothing gathered left after backward")
    return rows
