"""Checks for notebook 04 (pipeline parallel): the naive schedule, GPipe and 1F1B.

Each check trains the course's MLP with the student's schedule on WORLD_SIZE stages and on another
stage count (one of them split unevenly), for several micro-batch counts, with SGD and AdamW, and
compares with the single-process run (float64, to TOLERANCE) and with PyTorch's own pipelining
(PipelineStage with ScheduleGPipe / Schedule1F1B) on the same stages. It also counts what each stage
sends and receives, and how many micro-batches' activations each stage held at once.
"""
import itertools

from utils import pipeline as pp
from utils.checks import CHECK_TIMEOUT, TOLERANCE, max_abs_diff
from utils.counting import RECEIVES, SENDS
from utils.launch import runnable_world_sizes, spawn
from utils.model import parameter_names, reference_gradients, train_reference

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = {  # kind: (what the student wrote, PyTorch's schedule to compare with)
    "naive": ("naive_step", "gpipe"),
    "gpipe": ("gpipe_step", "gpipe"),
    "1f1b": ("one_f_one_b_step", "1f1b"),
}


def stage_counts(world_size, num_layers):
    """WORLD_SIZE and one other stage count; if WORLD_SIZE splits the layers evenly, the other one does not."""
    candidates = [n for n in (2, 4, 3, 5) if n != world_size and n <= num_layers]
    if num_layers % world_size == 0:  # prefer an uneven split: the rule "the first stages take one more"
        candidates.sort(key=lambda n: num_layers % n == 0)
    pp.stage_layers(num_layers, world_size)  # raises if world_size > num_layers
    return runnable_world_sizes([world_size] + candidates[:1])


def micro_batch_counts(kind, batch_size, num_micro_batches):
    """1, 2, the notebook's count and the whole batch (one row each): those that divide the batch."""
    if kind == "naive":
        return [1]
    return [m for m in sorted({1, 2, num_micro_batches, batch_size}) if batch_size % m == 0]


def _schedule_main(rank, world_size, schedule, kind, counts, sizes):
    runs = {}
    for m in counts:
        # PyTorch's Schedule1F1B needs at least as many micro-batches as stages; with fewer, 1F1B is GPipe
        pytorch_name = SCHEDULES[kind][1] if m >= world_size else "gpipe"
        for optimizer in OPTIMIZERS:
            ours = pp.train_pipeline(rank, world_size, schedule, num_micro_batches=m, optimizer=optimizer, **sizes)
            theirs = pp.train_pytorch_pipeline(rank, world_size, pytorch_name, num_micro_batches=m,
                                               optimizer=optimizer, **sizes)
            runs[m, optimizer] = dict(ours=ours, pytorch=theirs, pytorch_name=pytorch_name)
    return runs


def _check_traffic(where, log, stage, num_stages, m, micro_bytes):
    """Forward: m activations to the next stage; backward: m gradients to the previous one."""
    expected = m * ((stage < num_stages - 1) + (stage > 0))
    sends = [call.nbytes for call in log if call.name in SENDS]
    receives = sum(1 for call in log if call.name in RECEIVES)
    others = sorted({call.name for call in log if call.name not in SENDS + RECEIVES})
    if others:
        raise AssertionError(f"{where}: called {others}; a pipeline only needs send and recv (or isend and irecv)")
    what = (f"{m} activation(s) to the next stage" if stage < num_stages - 1 else "") + \
        (" and " if 0 < stage < num_stages - 1 else "") + \
        (f"{m} gradient(s) to the previous stage" if stage > 0 else "")
    if len(sends) != expected or sum(sends) != expected * micro_bytes:
        raise AssertionError(f"{where}: sent {len(sends)} message(s), {sum(sends)} bytes, in one step; expected "
                             f"{what}: {expected} of {micro_bytes} bytes (a micro-batch's activation) = "
                             f"{expected * micro_bytes} bytes")
    if receives != expected:
        what = (f"{m} activation(s) from the previous stage" if stage > 0 else "") + \
            (" and " if 0 < stage < num_stages - 1 else "") + \
            (f"{m} gradient(s) from the next stage" if stage < num_stages - 1 else "")
        raise AssertionError(f"{where}: {receives} receive(s) in one step; expected {expected}: {what}")


def _check_gradients(where, got, want, names, m):
    for name, g, w in zip(names, got, want):
        if g is None:
            raise AssertionError(f"{where}: {name} got no gradient: did this stage run its backward?")
        diff = max_abs_diff(g, w)
        if diff <= TOLERANCE:
            continue
        if m > 1 and max_abs_diff(g, m * w) <= TOLERANCE * m:
            raise AssertionError(f"{where}: the gradient of {name} is {m} times the full batch's: each micro-batch's "
                                 f"loss is a mean over its own rows, so summing {m} of them counts the batch {m} "
                                 f"times; divide each micro-batch's loss by num_micro_batches")
        raise AssertionError(f"{where}: after step 0's backward, the gradient of {name} differs from the "
                             f"single-process MLP's by {diff:.3g}")


def _check_split(where, num_weights, num_layers, stage, num_stages):
    want = num_layers // num_stages + (stage < num_layers % num_stages)  # the first L % p stages take one more
    if num_weights != want:
        raise AssertionError(f"{where}: the stage holds {num_weights} layer(s); expected {want}: {num_layers} // "
                             f"{num_stages} each, and one more on the first {num_layers % num_stages} stage(s)")


def _check_losses(where, got, want, is_last):
    if not is_last:
        if got != [None] * len(got):
            raise AssertionError(f"{where}: returned a loss; only the last stage has one (return None)")
        return
    for step, (g, w) in enumerate(zip(got, want)):
        if g is None or abs(g - w) > TOLERANCE:
            raise AssertionError(f"{where}: the loss returned at step {step} is {g}; the full batch's loss is {w:.6g} "
                                 f"(the sum of the micro-batches' losses, each divided by num_micro_batches)")


def _check_weights(where, names, ours, reference, pytorch, pytorch_name):
    for name, got, want, theirs in zip(names, ours, reference, pytorch):
        diff = max_abs_diff(got, want)
        if diff > TOLERANCE:
            raise AssertionError(f"{where}: at the end, {name} differs from the single-process run's by {diff:.3g} "
                                 f"(step 0's gradients were right: look at what changes from step to step)")
        diff = max_abs_diff(theirs, got)
        if diff > TOLERANCE:
            raise AssertionError(f"{where}: at the end, {name} differs from PyTorch's {pytorch_name} run's by "
                                 f"{diff:.3g}")


def _check_alive(where, kind, peak, stage, num_stages, m):
    """GPipe holds every micro-batch until the backwards; 1F1B at most p - s on stage s."""
    want = {"naive": 1, "gpipe": m, "1f1b": min(num_stages - stage, m)}[kind]
    if peak != want:
        why = {"naive": "one batch, one forward, one backward",
               "gpipe": "all the forwards, then all the backwards",
               "1f1b": f"{num_stages - stage - 1} warm-up forward(s) on stage {stage} of {num_stages}, then one "
                       f"forward and one backward in turn: a backward frees the oldest micro-batch"}[kind]
        raise AssertionError(f"{where}: held the activations of {peak} micro-batch(es) at once; expected {want} "
                             f"({why})")


def check_schedule(kind, schedule, world_size, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches=1,
                   seed=0, timeout=CHECK_TIMEOUT):
    """Train with `schedule` on every stage count and micro-batch count; compare everything (see the module doc)."""
    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {list(SCHEDULES)}, got {kind!r}")
    pp.check_sizes(num_layers, world_size, batch_size, num_micro_batches)
    counts = micro_batch_counts(kind, batch_size, num_micro_batches)
    worlds = stage_counts(world_size, num_layers)
    sizes = dict(hidden_dim=hidden_dim, num_layers=num_layers, batch_size=batch_size, num_steps=num_steps, seed=seed)
    names = parameter_names(num_layers)
    want_grads = reference_gradients(hidden_dim, num_layers, batch_size, seed)
    references = {o: train_reference(hidden_dim, num_layers, batch_size, num_steps, o, seed=seed) for o in OPTIMIZERS}
    label = SCHEDULES[kind][0]
    pytorch_names, first_results = set(), None
    for n in worlds:
        results = spawn(_schedule_main, n, schedule, kind, counts, sizes, timeout=timeout)
        first_results = first_results or results
        for m, optimizer, (stage, layers) in itertools.product(counts, OPTIMIZERS,
                                                                enumerate(pp.stage_layers(num_layers, n))):
            run = results[stage][m, optimizer]
            ours, weights, losses = run["ours"], references[optimizer][0], references[optimizer][1]
            where = f"{label} on stage {stage} of {n} (layers {list(layers)}), {m} micro-batch{'es' * (m > 1)}"
            _check_split(where, len(ours["weights"]), num_layers, stage, n)
            for step, log in enumerate(ours["logs"]):
                _check_traffic(f"{where}, step {step}", log, stage, n, m, micro_bytes=batch_size // m * hidden_dim * 8)
            _check_gradients(where, ours["grads"], [want_grads[i] for i in layers], [names[i] for i in layers], m)
            _check_losses(where, ours["losses"], losses, stage == n - 1)
            _check_weights(f"{where} ({optimizer}, {num_steps} steps)", [names[i] for i in layers], ours["weights"],
                           [weights[i] for i in layers], run["pytorch"]["weights"], run["pytorch_name"])
            _check_alive(where, kind, ours["peak_alive"], stage, n, m)
            pytorch_names.add(run["pytorch_name"])
    pytorch = {"naive": "ScheduleGPipe", "gpipe": "ScheduleGPipe",
               "1f1b": "Schedule1F1B" + (" (ScheduleGPipe for m < stages)" if "gpipe" in pytorch_names else "")}[kind]
    splits = "; ".join(f"{n} stages: " + ", ".join(str(len(r)) for r in pp.stage_layers(num_layers, n)) + " layers"
                       for n in worlds)
    print(f"{label}: correct on {' and '.join(map(str, worlds))} stages ({splits}), micro-batches {counts}")
    print(f"  step 0's gradients, the losses, and the weights after {num_steps} steps of SGD and AdamW equal the "
          f"single-process run's and PyTorch's {pytorch} to {TOLERANCE:g}")
    print("  each stage sends m activations forward and m gradients backward per step, one micro-batch each")
    if kind != "naive":
        n = worlds[0]
        peaks = {m: [run[m, "sgd"]["ours"]["peak_alive"] for run in first_results] for m in counts}
        print(f"  micro-batches alive at once on each of {n} stages (counted): "
              + ", ".join(f"m={m}: {peaks[m]}" for m in counts))


def check_naive_step(naive_step, world_size, hidden_dim, num_layers, batch_size, num_steps, seed=0,
                     timeout=CHECK_TIMEOUT):
    check_schedule("naive", lambda stage, batch, m: naive_step(stage, batch), world_size, hidden_dim, num_layers,
                   batch_size, num_steps, 1, seed, timeout)


def check_gpipe_step(gpipe_step, world_size, hidden_dim, num_layers, batch_size, num_steps, num_micro_batches, seed=0,
                     timeout=CHECK_TIMEOUT):
    check_schedule("gpipe", gpipe_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                   num_micro_batches, seed, timeout)


def check_one_f_one_b_step(one_f_one_b_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                           num_micro_batches, seed=0, timeout=CHECK_TIMEOUT):
    check_schedule("1f1b", one_f_one_b_step, world_size, hidden_dim, num_layers, batch_size, num_steps,
                   num_micro_batches, seed, timeout)
