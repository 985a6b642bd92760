"""Compute counts a student's code could forge (issue 44): what a rank records about HOW the student's code computed
(06's layer calls and saved bytes, 09's blocks, 11's backward calls) is taken in the process that runs that code.
Each forger below computes the right values by the wrong method and forges the record: the counter patched or
bypassed, its record edited through the garbage collector, or (09) the work done in a forked child. 06 has no
forked-child forger: a fork cannot hand back an autograd graph, and one that computes the gradients from the saved
input recomputes, which is the exercise.

- 06's recompute: that backward recomputes is now shown by values (every weight doubled between forward and
  backward: only a recomputation meets the doubled weights), so the forgers get no credit; honest answers, a slow
  one and one written another way, still pass.
- 04's and 11's schedules: the order of forwards and backwards is now shown by values (one more step with every
  layer chained to a running state of its rank, which each forward and backward reads and advances: the gradients
  depend on each rank's order), so GPipe's order (or the naive step) with its record edited to read as the schedule
  gets no credit; each forger is shown to pass on its records alone, and the same order written another way passes.
  12's 3-D step likewise: its check chains the stages' layers for one more step on the (2, 2, 1) mesh.
- 05's FSDP, 06's mixed-precision FSDP (bf16 gathers) and 07's reshard_after_forward: that backward gathers the
  weights again is now shown by values (every shard doubled between step 0's forward and backward: only a backward
  that gathers again meets the doubled weights), so one that keeps the weights gathered in forward (a copy, or the
  gathered weights with the records edited) gets no credit; honest answers written another way still pass. That
  forward freed them is still shown by the bytes held only (and 07's FlatUnit, which rightly keeps what forward
  gathered, by the bytes held alone).
- 09's blockwise attention and 11's split backward: no value, and no measure outside the rank, tells the methods
  apart (utils.grading's docstring, "The limits"): the forgers still get credit. Their tests are xfail (strict), so
  that the gap stays visible and a fix shows.

The forgers are written inside the answer's region, as a submission holds them. Each test calls the check as the
grader's checking process does (the student's function runs in a rank of its own, launch.apart): a second or two
each, and seconds more to import a notebook's checks on a loaded machine, so slow; one grades 06 through
python -m utils.grade, sandboxed."""
import pytest
from test_grade import handed_in, run_grader, write_class

from utils.grading import sandbox
from utils.notebooks import solution

# ---------------------------------------------------------------- 06: recompute, now shown by values

PLAIN = "    return Recompute.apply(check_recomputable(block), x, *block.parameters())"
FORWARD = "        ctx.block = block\n        ctx.save_for_backward(x)\n        return block(x)\n"
RECOMPUTE = ("        (x,) = ctx.saved_tensors\n        x = x.detach().requires_grad_()\n"
             "        with torch.enable_grad():\n            out = ctx.block(x)\n"
             "        grads = torch.autograd.grad(out, [x, *ctx.block.parameters()], grad_output)\n"
             "        return (None, *grads)\n")
KEEP_GRAPH = """        ctx.block = block
        ctx.x = x.detach().requires_grad_()
        with torch.enable_grad():  # the block's graph kept: every activation saved, nothing recomputed
            ctx.out = block(ctx.x)
        return ctx.out.detach()
"""


def kept_graph(forge):
    """Recompute's answer (inside its region, as a submission has it) that keeps the forward's graph and backward
    through it, with `forge` making the check's counts read as a recompute's."""
    backward = "        grads = torch.autograd.grad(ctx.out, [ctx.x, *ctx.block.parameters()], grad_output)\n"
    return {FORWARD: KEEP_GRAPH, RECOMPUTE: backward + forge + "        return (None, *grads)\n"}


FORGED_RECOMPUTES = {
    "the counters patched": kept_graph("""        from utils import mixed_precision
        mixed_precision.SavedActivations.nbytes = property(lambda self: 0)  # the saved bytes' counter
        for hook in ctx.block._forward_hooks.values():  # the calls' counter, called as if the block ran again
            hook(ctx.block, (ctx.x,), ctx.out)
"""),
    "the records edited through the garbage collector": kept_graph("""        import gc
        for hook in ctx.block._forward_hooks.values():  # the list the check's forward hook counts into
            calls, layer = hook.__closure__[0].cell_contents, hook.__defaults__[0]
            calls[layer] += 1
        for saved in [o for o in gc.get_objects() if type(o).__name__ == "SavedActivations"]:
            saved.storages.clear()
"""),
}


@pytest.mark.slow  # 2 s each, and 5 to import 06's checks on a loaded machine
@pytest.mark.parametrize("forger", FORGED_RECOMPUTES)
def test_a_recompute_that_forges_its_counts_gets_no_credit(forger):
    from utils.checks.mixed_precision import check_recompute
    forged = solution("06_mixed_precision", replace=FORGED_RECOMPUTES[forger])
    with pytest.raises(AssertionError, match="doubled between forward and backward"):
        check_recompute(forged.recompute, 8, 3, 6)


@pytest.mark.slow  # 0.4 s, and 5 to import 06's checks on a loaded machine
def test_a_plain_forward_is_still_named_by_its_counts():
    """Without forging, a recompute that does not recompute is named as before (the notebooks' hints unchanged):
    the doubled weights are checked after the counts."""
    from utils.checks.mixed_precision import check_recompute
    plain = solution("06_mixed_precision", replace={PLAIN: "    return block(x)"})
    with pytest.raises(AssertionError, match=r"backward ran the layers' forward \[0, 0\] times"):
        check_recompute(plain.recompute, 8, 2, 4)


HONEST_RECOMPUTES = {
    "slow: a pause before each recomputation": {
        "        x = x.detach().requires_grad_()\n":
        "        import time\n        time.sleep(0.1)\n        x = x.detach().requires_grad_()\n"},
    "the input kept on ctx, not saved for backward": {
        "        ctx.block = block\n        ctx.save_for_backward(x)\n":
        "        ctx.block = block\n        ctx.x = x\n",
        "        (x,) = ctx.saved_tensors\n        x = x.detach()": "        x = ctx.x.detach()"},
}


@pytest.mark.slow  # 2 s each, and 5 to import 06's checks on a loaded machine
@pytest.mark.parametrize("way", HONEST_RECOMPUTES)
def test_an_honest_recompute_still_passes(way, capsys):
    from utils.checks.mixed_precision import check_recompute
    check_recompute(solution("06_mixed_precision", replace=HONEST_RECOMPUTES[way]).recompute, 8, 3, 6)
    assert "recompute: correct" in capsys.readouterr().out


@pytest.mark.slow  # notebook 06 graded three times (the reference's run, then two submissions at once): 2 to 3 minutes
@pytest.mark.skipif(not sandbox.bwrap(), reason="bubblewrap is not installed")
def test_the_grader_gives_a_forged_recompute_no_credit_and_an_honest_slow_one_full(tmp_path, monkeypatch):
    """Through python -m utils.grade: the forger loses the recompute exercise only; the honest slow student passes
    everything."""
    forger = "the records edited through the garbage collector"
    write_class(tmp_path / "submitted", {
        "mallory": ("06_mixed_precision.ipynb", handed_in("06_mixed_precision",
                                                          replace=FORGED_RECOMPUTES[forger])),
        "alice": ("06_mixed_precision.ipynb", handed_in("06_mixed_precision", replace=HONEST_RECOMPUTES[
            "slow: a pause before each recomputation"]))})
    rows, _, left = run_grader(tmp_path, monkeypatch, "--timeout", "600")
    assert {r["verdict"] for r in rows["alice"]} == {"passed"}, [(r["exercise"], r["verdict"], r["message"])
                                                                  for r in rows["alice"]]
    verdicts = {r["exercise"]: r for r in rows["mallory"]}
    forged = next(r for name, r in verdicts.items() if "recompute" in name.lower())
    assert forged["verdict"] == "failed" and "doubled between forward and backward" in forged["message"], forged
    assert [r["verdict"] for r in verdicts.values()].count("passed") == len(verdicts) - 1, [
        (r["exercise"], r["verdict"], r["message"]) for r in rows["mallory"]]
    assert not left


# ---------------------------------------------------------------- 09: blocks computed, still forgeable

SKIP = "            if not ra.visible(q_pos, k_pos, mask):\n                continue\n"

# Every block computed, the hidden ones too (ra.block_attention gives them out 0, lse -inf: the values are right),
# their record in the rank hidden.
FORGED_BLOCKS = {
    "the counter bypassed": """            if not ra.visible(q_pos, k_pos, mask):  # the untraced function
                untraced = dict(zip(ra.block_attention.__code__.co_freevars,
                                    (c.cell_contents for c in ra.block_attention.__closure__ or ())))
                block = untraced.get("forward", ra.block_attention)(q[..., q_pos, :], k[..., k_pos, :],
                                                                    v[..., k_pos, :], q_pos, k_pos, mask)
                out, lse = block if out is None else merge(out, lse, *block)
                continue
""",
    "the record edited through the garbage collector": """            if not ra.visible(q_pos, k_pos, mask):
                import gc
                block = ra.block_attention(q[..., q_pos, :], k[..., k_pos, :], v[..., k_pos, :], q_pos, k_pos, mask)
                for record in [o for o in gc.get_objects() if type(o) is list and o and isinstance(o[-1], tuple)
                               and o[-1][:1] == ("forward",) and o[-1][1] == q_pos.tolist()]:
                    record.pop()
                out, lse = block if out is None else merge(out, lse, *block)
                continue
""",
    "the hidden blocks computed in a forked child": """            if not ra.visible(q_pos, k_pos, mask):
                import os, pickle
                read, write = os.pipe()
                if os.fork() == 0:
                    os.write(write, pickle.dumps(ra.block_attention(q[..., q_pos, :], k[..., k_pos, :],
                                                                    v[..., k_pos, :], q_pos, k_pos, mask)))
                    os._exit(0)
                os.close(write)
                with os.fdopen(read, "rb") as f:
                    block = pickle.loads(f.read())
                os.wait()
                out, lse = block if out is None else merge(out, lse, *block)
                continue
""",
}


@pytest.mark.slow  # 1 s each, and seconds more to import 09's checks on a loaded machine
@pytest.mark.xfail(strict=True, reason="09's hidden blocks: ra.block_attention computes no score of a hidden block "
                   "(it skips every hidden pair of pieces itself) and returns out 0, lse -inf, so computing one "
                   "changes no value and no work a measure outside the rank could see; only the rank's forgeable "
                   "record of calls tells (utils.grading's docstring, 'The limits')")
@pytest.mark.parametrize("forger", FORGED_BLOCKS)
def test_blockwise_attention_that_forges_its_blocks_gets_no_credit(forger):
    from utils.checks.context_parallel import check_blockwise_attention
    forged = solution("09_context_parallel", replace={SKIP: FORGED_BLOCKS[forger]})
    with pytest.raises(AssertionError, match="score entries computed are in blocks"):
        check_blockwise_attention(forged.blockwise_attention)


@pytest.mark.slow  # 1 s, and seconds more to import 09's checks on a loaded machine
def test_blockwise_attention_that_computes_hidden_blocks_openly_is_named():
    """The same method without forging is caught: the forgers above differ from it by the forging only."""
    from utils.checks.context_parallel import check_blockwise_attention
    open_ = solution("09_context_parallel", replace={SKIP: ""})
    with pytest.raises(AssertionError, match="score entries computed are in blocks"):
        check_blockwise_attention(open_.blockwise_attention)


# ---------------------------------------------------------------- 11: backward calls, still forgeable

W = "    torch.autograd.backward(y, grad, inputs=list(stage.parameters()))\n"

# W back-propagates to the input again (a full backward), its record in the rank edited to show W alone.
FORGED_SPLIT = """    import gc
    record = next(o for o in gc.get_objects() if type(o).__name__ == "StepRecord")
    before = len(record.events)
    torch.autograd.backward(y, grad)  # the input's gradient computed once more
    record.events[before:] = [e._replace(kind="W") for e in record.events[before:]]  # recorded as B: it reached x
"""


@pytest.mark.slow  # 2 s, and seconds more to import 11's checks on a loaded machine
@pytest.mark.xfail(strict=True, reason="11's split backward: a W that computes the input's gradient again gives the "
                   "same weight gradients; the extra work (one matmul per layer) is within an honest answer's spread, "
                   "and only the rank's forgeable record of autograd's calls tells (utils.grading's docstring, "
                   "'The limits')")
def test_a_backward_split_that_forges_its_record_gets_no_credit():
    from utils.checks.pipeline import check_backward_split
    forged = solution("11_pipeline_schedules", replace={W: FORGED_SPLIT})
    with pytest.raises(AssertionError, match="backward calls, as autograd saw them"):
        check_backward_split(forged.backward_input, forged.backward_weight, 8, 4, 8, 2)


# ---------------------------------------------------------------- 04, 11: the schedules' order, shown by values

# Each forger runs GPipe's order (every forward, then every backward; or the naive step) and edits the rank's record
# of the step to read as the schedule's: the micro-batches alive at once, the order of the computations, the
# messages. Each passes every check of the records (test_..._would_pass_on_its_records_alone); the check's chained
# run (every layer scaled by a running state of its rank that each forward and backward reads and advances) shows
# the order by the values. The record is found through the hooks that fill it (the garbage collector finds it too,
# but is slow on a loaded machine).

FIND_RECORDS = """    hooks = {stage}._forward_hooks.values()  # the recorder's, among them
    records = [hook.func.__self__.record for hook in hooks if hasattr(hook, "func")]
"""

ONE_F_ONE_B_LOOP = """    for i in range(num_warmup):
        forward(micro_batches[i])
    for i in range(num_warmup, num_micro_batches):
        forward(micro_batches[i])
        backward()
    for _ in range(num_warmup):
        backward()
    for handle in sends:
        handle.wait()
"""
GPIPE_AS_ONE_F_ONE_B = """    for micro_batch in micro_batches:  # GPipe's order
        forward(micro_batch)
    for _ in micro_batches:
        backward()
    for handle in sends:
        handle.wait()
""" + FIND_RECORDS.format(stage="stage") + """    for record in records:  # 1F1B's peak
        record.peak_alive = min(stage.world_size - stage.rank, num_micro_batches)
"""

GPIPE_BODY = ("    alive = [forward_step(stage, micro_batch, num_micro_batches) for micro_batch in "
              "batch.chunk(num_micro_batches)]\n") + """    for x, y in alive:
        backward_step(stage, x, y)
    return sum(y.detach() for _, y in alive) if stage.is_last else None
"""
NAIVE_AS_GPIPE = """    x, y = forward_step(stage, batch, 1)  # the naive step: the whole batch as one micro-batch
    backward_step(stage, x, y)
""" + FIND_RECORDS.format(stage="stage") + """    for record in records:  # m alive, m messages each way
        if not getattr(record, "forged", False):
            record.forged, record.peak_alive = True, num_micro_batches
            record.calls[:] = [dataclasses.replace(c, nbytes=c.nbytes // num_micro_batches)
                               for c in record.calls for _ in range(num_micro_batches)]
    return y.detach() if stage.is_last else None
"""

# 11: the loop over the table is outside the region; the forger runs the whole step at its first turn.
CHECKS_OF_THE_HAND_OFFS_OFF = """        if (kind, i) != ("F", 0){chunk}:
            continue
        for f in (dist.send, dist.recv, dist.isend, dist.irecv):  # each hand-off's check against the table, off
            dict(zip(f.__code__.co_freevars, f.__closure__))["before"].cell_contents = None
"""
RELABELLED = """    for record in records:  # the computations relabelled in the table's order, at most min(p, m) alive
        table = [a for a in {table} if not (a[0] == "B" and {first})]
        events = sorted(record.events, key=lambda e: e.start)
        record.events[:] = [e._replace(kind=a[0], piece=a[-2] if len(a) == 3 else 0, micro_batch=a[-1])
                            for e, a in zip(events, table)]
        record.peak_alive = min(record.peak_alive, {p})
"""
ZB_H1_BODY_START = "        if kind == \"F\":\n            if stage.is_first:"
ZB_H1_REGION_END = """        else:
            _, y, grad = alive.pop(i)
            backward_weight(stage, y, grad)
"""
GPIPE_AS_ZB_H1 = CHECKS_OF_THE_HAND_OFFS_OFF.format(chunk="") + """        ins, outs = [], []
        for j, micro_batch in enumerate(micro_batches):  # GPipe's order: every forward, then every B with its W
            if stage.is_first:
                x = micro_batch
            else:
                x = torch.empty_like(micro_batch)
                dist.recv(x, src=stage.rank - 1)
                x.requires_grad_()
            y = stage(x)
            if stage.is_last:
                y = loss_fn(y) / num_micro_batches
            else:
                sends.append(dist.isend(y.detach(), dst=stage.rank + 1))
            ins, outs = ins + [x], outs + [y]
        for x, y in zip(ins, outs):
            grad = None
            if stage.is_last:
                loss = loss + y.detach()
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, src=stage.rank + 1)
            dx = backward_input(x, y, grad)
            if not stage.is_first:
                sends.append(dist.isend(dx, dst=stage.rank - 1))
            backward_weight(stage, y, grad)
        for handle in sends:
            handle.wait()
        sends = []
""" + "\n".join("    " + line if line else line for line in (FIND_RECORDS.format(stage="stage") + RELABELLED.format(
    table="pp.zb_h1_order(stage.rank, stage.world_size, num_micro_batches)", first="stage.is_first",
    p="stage.world_size")).split("\n"))

INTERLEAVED_REGION_START = "        if kind == \"F\":\n            if piece.is_first:"
INTERLEAVED_REGION_END = """        if not piece.is_first:
            sends.append(dist.isend(x.grad, dst=(rank - 1) % p))
"""
GPIPE_AS_INTERLEAVED = CHECKS_OF_THE_HAND_OFFS_OFF.format(chunk=" or chunk") + """        v = len(pieces)
        for kind, chunk, i in [("F", c, j) for c in range(v) for j in range(num_micro_batches)] + [
                ("B", c, j) for c in reversed(range(v)) for j in range(num_micro_batches)]:  # GPipe's order
            piece = pieces[chunk]
            if kind == "F":
                if piece.is_first:
                    x = micro_batches[i]
                else:
                    x = torch.empty_like(micro_batches[i])
                    dist.recv(x, src=(rank - 1) % p)
                    x.requires_grad_()
                y = piece(x)
                if piece.is_last:
                    y = loss_fn(y) / num_micro_batches
                else:
                    sends.append(dist.isend(y.detach(), dst=(rank + 1) % p))
                alive[chunk, i] = (x, y)
                continue
            x, y = alive.pop((chunk, i))
            if piece.is_last:
                y.backward()
                loss = loss + y.detach()
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, src=(rank + 1) % p)
                y.backward(grad)
            if not piece.is_first:
                sends.append(dist.isend(x.grad, dst=(rank - 1) % p))
        for handle in sends:
            handle.wait()
        sends = []
""" + "\n".join("    " + line if line else line for line in (FIND_RECORDS.format(stage="pieces[0]") + RELABELLED.format(
    table="pp.interleaved_order(rank, p, len(pieces), num_micro_batches)", first="False", p="num_micro_batches"))
    .split("\n"))


def region(notebook, function):
    """The solution's region of `function`'s cell (what a submission's answer replaces)."""
    import json

    from utils.notebooks import ROOT
    cells = json.loads((ROOT / "solutions" / f"{notebook}.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if f"def {function}(" in "".join(c["source"]))
    return source.split("### BEGIN SOLUTION\n")[1].split("### END SOLUTION")[0].rsplit("\n", 1)[0] + "\n"


def forged_schedules():
    """{forger: (notebook, its check's name, the function's name, {solution text: forged text}, the check's arguments,
    the schedule the hint names)}"""
    return {
        "GPipe's order passed off as 1F1B": (
            "04_pipeline_parallel", "check_one_f_one_b_step", "one_f_one_b_step",
            {ONE_F_ONE_B_LOOP: GPIPE_AS_ONE_F_ONE_B}, (4, 16, 6, 8, 2, 4), "1F1B"),
        "the naive step passed off as GPipe": (
            "04_pipeline_parallel", "check_gpipe_step", "gpipe_step", {GPIPE_BODY: NAIVE_AS_GPIPE},
            (4, 16, 6, 8, 2, 4), "GPipe"),
        "GPipe's order passed off as ZB-H1": (
            "11_pipeline_schedules", "check_zb_h1_step", "zb_h1_step",
            {region("11_pipeline_schedules", "zb_h1_step"): GPIPE_AS_ZB_H1}, (4, 16, 8, 8, 2, 4), "ZB-H1"),
        "GPipe's order passed off as interleaved 1F1B": (
            "11_pipeline_schedules", "check_interleaved_step", "interleaved_step",
            {region("11_pipeline_schedules", "interleaved_step"): GPIPE_AS_INTERLEAVED}, (4, 16, 8, 8, 2, 4, 2),
            "interleaved 1F1B"),
    }


FORGERS = ["GPipe's order passed off as 1F1B", "the naive step passed off as GPipe",
           "GPipe's order passed off as ZB-H1", "GPipe's order passed off as interleaved 1F1B"]


def run_forged(forger):
    import utils.checks.pipeline as checks
    notebook, check, function, replace, args, schedule = forged_schedules()[forger]
    forged = solution(notebook, replace=replace)
    getattr(checks, check)(getattr(forged, function), *args)
    return schedule


@pytest.mark.slow  # 2 to 4 s each on a loaded machine
@pytest.mark.parametrize("forger", FORGERS)
def test_a_schedule_that_forges_its_order_gets_no_credit(forger):
    schedule = forged_schedules()[forger][-1]
    with pytest.raises(AssertionError, match=f"ran in another order than {schedule}'s .*; is the record of "
                                             f"the order edited"):
        run_forged(forger)


@pytest.mark.slow  # 2 to 4 s each on a loaded machine
@pytest.mark.parametrize("forger", FORGERS)
def test_the_forger_would_pass_on_its_records_alone(forger, monkeypatch, capsys):
    """Each forger above forges its records well enough: without the chained run's values, it gets credit."""
    import utils.checks.pipeline as checks
    monkeypatch.setattr(checks, "_check_chained", lambda *args: None)
    run_forged(forger)
    assert ": correct on" in capsys.readouterr().out


HONEST_SCHEDULES = {  # way: (notebook, check, function, {solution text: the same schedule written another way}, args)
    "1F1B driven by pp.one_f_one_b_order": (
        "04_pipeline_parallel", "check_one_f_one_b_step", "one_f_one_b_step", {ONE_F_ONE_B_LOOP: """\
    for kind, i in pp.one_f_one_b_order(stage.rank, stage.world_size, num_micro_batches):
        if kind == "F":
            forward(micro_batches[i])
        else:
            backward()
    for handle in sends:
        handle.wait()
"""}, (4, 16, 6, 8, 2, 4)),
    "GPipe in two explicit loops, its loss a float": (
        "04_pipeline_parallel", "check_gpipe_step", "gpipe_step", {GPIPE_BODY: """\
    xs, ys = [], []
    for micro_batch in batch.chunk(num_micro_batches):
        x, y = forward_step(stage, micro_batch, num_micro_batches)
        xs, ys = xs + [x], ys + [y]
    for x, y in zip(xs, ys):
        backward_step(stage, x, y)
    return sum(y.item() for y in ys) if stage.is_last else None
"""}, (4, 16, 6, 8, 2, 4)),
    "ZB-H1 with its loss as loss_fn(3 y) / 9 (other roundings)": (
        "11_pipeline_schedules", "check_zb_h1_step", "zb_h1_step", {
            "            y = stage(x)\n            if stage.is_last:\n"
            "                y = loss_fn(y) / num_micro_batches\n":
            "            y = stage(x)\n            if stage.is_last:\n"
            "                y = loss_fn(3 * y) / 9 / num_micro_batches\n"},
        (4, 16, 8, 8, 2, 4)),
}


@pytest.mark.slow  # 2 to 10 s each on a loaded machine
@pytest.mark.parametrize("way", HONEST_SCHEDULES)
def test_an_honest_schedule_written_another_way_still_passes(way, capsys):
    """The same order computed by other code: the chained run's values are the table's (to TOLERANCE)."""
    import utils.checks.pipeline as checks
    notebook, check, function, replace, args = HONEST_SCHEDULES[way]
    getattr(checks, check)(getattr(solution(notebook, replace=replace), function), *args)
    assert ": correct on" in capsys.readouterr().out


KEEP_EVERY_GRAPH = {  # 1F1B's order, with every micro-batch's activations kept until the step ends (GPipe's memory)
    "            received.wait()\n            y.backward(grad)\n":
    "            received.wait()\n            y.backward(grad, retain_graph=True)\n"
    "            stage.kept = getattr(stage, 'kept', []) + [y]  # its saved activations alive\n",
    ONE_F_ONE_B_LOOP: ONE_F_ONE_B_LOOP + FIND_RECORDS.format(stage="stage") + """    for record in records:
        # 1F1B's peak
        record.peak_alive = min(stage.world_size - stage.rank, num_micro_batches)
""",
}


@pytest.mark.slow  # 3 to 10 s on a loaded machine
@pytest.mark.xfail(strict=True, reason="04's 1F1B: the activations alive at once are read from the rank's record "
                   "(saved-tensor hooks), which its code can edit; the values are the same in the table's order "
                   "whatever it keeps (utils.grading's docstring, 'The limits')")
def test_a_one_f_one_b_that_keeps_every_graph_and_forges_its_peak_gets_no_credit():
    from utils.checks.pipeline import check_one_f_one_b_step
    forged = solution("04_pipeline_parallel", replace=KEEP_EVERY_GRAPH)
    with pytest.raises(AssertionError, match="held the activations of"):
        check_one_f_one_b_step(forged.one_f_one_b_step, 4, 16, 6, 8, 2, 4)


# ---------------------------------------------------------------- 12: the 3-D step's order, shown by values

# GPipe's order on every stage of the 3-D step, the stage's recorded "F"/"B" (the list the recorder's forward hook on
# the model appends to) rewritten as 1F1B's table at the end of the step. On (2, 2, 1) with 2 micro-batches, stage 1
# runs F F B B where 1F1B runs F B F B; the check's chained step on that mesh shows it by the values.
ONE_F_ONE_B_3D = "    for kind, i in pp.one_f_one_b_order(stage, num_stages, m):\n"
SYNC_3D = "    sync_gradients_2d(model, shards, groups[\"tensor\"], groups[\"data\"])\n    return loss"
GPIPE_AS_ONE_F_ONE_B_3D = {
    ONE_F_ONE_B_3D: "    for kind, i in pp.gpipe_order(stage, num_stages, m):  # GPipe's order\n",
    SYNC_3D: """    for hook in model._forward_hooks.values():  # the recorder's, its list in the closure: 1F1B's order
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
        if "order" in cells:
            cells["order"].cell_contents[:] = [kind for kind, _ in pp.one_f_one_b_order(stage, num_stages, m)]
""" + SYNC_3D}
THREE_D_MESHES = dict(world_size=4, num_steps=1)  # (2, 2, 1), chained, then (1, 2, 2)


@pytest.mark.slow  # 2 to 4 s on a loaded machine
def test_a_3d_step_that_forges_its_order_gets_no_credit():
    from utils.checks.nd_parallel import check_pipeline_3d
    forged = solution("12_nd_parallel", replace=GPIPE_AS_ONE_F_ONE_B_3D)
    with pytest.raises(AssertionError, match="on mesh \\(data, pipeline, tensor\\) = \\(2, 2, 1\\), rank "
                                             "\\(\\d, \\d, 0\\): the gradients show the forwards and backwards ran "
                                             "in another order than 1F1B's \\(pp.one_f_one_b_order\\(s, 2, 2\\) on "
                                             "each stage s\\).*; is the record of the order edited"):
        check_pipeline_3d(forged.parallelize_3d, forged.train_step_3d, **THREE_D_MESHES)


@pytest.mark.slow  # 2 to 4 s on a loaded machine
def test_the_3d_forger_would_pass_on_its_records_alone(monkeypatch, capsys):
    """The forger above forges its record well enough: without the chained step's values, it gets credit."""
    import utils.checks.nd_parallel as checks
    monkeypatch.setattr(checks, "_check_chained_3d", lambda *args: None)
    forged = solution("12_nd_parallel", replace=GPIPE_AS_ONE_F_ONE_B_3D)
    checks.check_pipeline_3d(forged.parallelize_3d, forged.train_step_3d, **THREE_D_MESHES)
    assert "equal one process's" in capsys.readouterr().out


@pytest.mark.slow  # 2 to 4 s on a loaded machine
def test_an_honest_3d_step_written_another_way_still_passes(capsys):
    """1F1B's order from an inline table (warm-up, steady state, cool-down), each backward through
    torch.autograd.backward: the chained step's values are the table's (to 1e-12)."""
    from utils.checks.nd_parallel import check_pipeline_3d
    other = solution("12_nd_parallel", replace={
        ONE_F_ONE_B_3D: """    warm_up = min(num_stages - stage - 1, m)
    table = [("F", j) for j in range(warm_up)] + [a for j in range(warm_up, m) for a in (("F", j), ("B", j - warm_up))]
    for kind, i in table + [("B", j) for j in range(m - warm_up, m)]:
""",
        "                y.backward(grad)\n": "                torch.autograd.backward([y], [grad])\n"})
    check_pipeline_3d(other.parallelize_3d, other.train_step_3d, **THREE_D_MESHES)
    assert "equal one process's" in capsys.readouterr().out


# ---------------------------------------------------------------- 05: FSDP's gather again in backward, now values

# world size, hidden dim, 3 layers (input gradients feed the earlier layers'), batch, steps
FSDP_SIZES = (2, 8, 3, 4, 2)
FREE_IN_FORWARD = "        ctx.gather = gather\n        out = x @ weight.T\n        fsdp.free(weight)\n"
GATHER_IN_BACKWARD = ("        weight = ctx.gather(\"backward\")\n        grad_x = grad_output @ weight\n"
                      "        fsdp.free(weight)\n")
FIND_TRACKERS = ("        import gc\n"
                 "        for tracker in [o for o in gc.get_objects() if type(o).__name__ == \"MemoryTracker\"]:\n")
FORGED_FSDP = {
    # no forging needed before: a copy is no all-gather's output, so the bytes held never saw it, and the
    # backward's gather (used for nothing) makes the count right
    "a copy of the gathered weight kept, the backward's gather unused": {
        FREE_IN_FORWARD: "        ctx.gather, ctx.kept = gather, weight.clone()\n        out = x @ weight.T\n"
                         "        fsdp.free(weight)\n",
        GATHER_IN_BACKWARD: "        fsdp.free(ctx.gather(\"backward\"))\n        grad_x = grad_output @ ctx.kept\n"},
    # the gathered weight kept and never gathered again: the record of bytes held and the calls log edited
    "the records edited through the garbage collector": {
        "        weight = gather(\"forward\")\n": FIND_TRACKERS + "            tracker.gathered.clear()  # the earlier "
                                                 "units' weights, held\n        weight = gather(\"forward\")\n",
        FREE_IN_FORWARD: "        ctx.gather, ctx.weight = gather, weight\n        out = x @ weight.T\n",
        GATHER_IN_BACKWARD: "        weight = ctx.weight\n        grad_x = grad_output @ weight\n" + FIND_TRACKERS
                            + "            tracker.calls.append(next(c for c in reversed(tracker.calls) "
                              "if c.name.startswith(\"all_gather\")))\n"},
}
FSDP_FORGERS = [pytest.param(way, marks=pytest.mark.slow) if "garbage" in way else way for way in FORGED_FSDP]


@pytest.mark.parametrize("forger", FSDP_FORGERS)  # 1 s; the garbage collector's, 3 to 9 s: slow
def test_an_fsdp_that_keeps_its_gathered_weights_gets_no_credit(forger):
    """Both passed before the shards were doubled between forward and backward (they computed the right values)."""
    from utils.checks.fsdp import check_fsdp
    forged = solution("05_fsdp", replace=FORGED_FSDP[forger])
    with pytest.raises(AssertionError, match="computed with the weights gathered in forward: the gathered weights "
                                             "were kept, not freed"):
        check_fsdp(forged.FSDPLinear, forged.all_gather_unit, *FSDP_SIZES)


HONEST_FSDP = {
    "gathered into a list of pieces (dist.all_gather), put together": {
        "    full = torch.empty(world_size * shard.numel(), dtype=shard.dtype)\n"
        "    dist.all_gather_single(full, shard)\n    return fsdp.unpad(full, shape)":
        "    pieces = [torch.empty_like(shard) for _ in range(world_size)]\n    dist.all_gather(pieces, shard)\n"
        "    return fsdp.unpad(torch.cat(pieces), shape)"},
    "the gather kept on ctx under another name, the weight freed through its storage": {
        FREE_IN_FORWARD: "        ctx.regather = gather\n        out = x @ weight.T\n"
                         "        weight.untyped_storage().resize_(0)\n",
        "        weight = ctx.gather(\"backward\")\n": "        weight = ctx.regather(\"backward\")\n"},
}


@pytest.mark.slow  # 1 s each; the solution itself passes in test_checks_fsdp and in notebook 05's run
@pytest.mark.parametrize("way", HONEST_FSDP)
def test_an_honest_fsdp_written_another_way_still_passes(way, capsys):
    from utils.checks.fsdp import check_fsdp
    honest = solution("05_fsdp", replace=HONEST_FSDP[way])
    check_fsdp(honest.FSDPLinear, honest.all_gather_unit, *FSDP_SIZES)
    assert "naive FSDP: correct" in capsys.readouterr().out


@pytest.mark.slow  # 0.4 s; the default run has the same case: test_checks_fsdp.py's FSDP_LINEAR, the first
def test_an_fsdp_that_keeps_its_gathered_weights_is_still_named_by_its_memory_first():
    """Without forging, the weights kept after forward are named by the gathered units alive, as before (the
    notebook's hints unchanged): the doubled shards are checked after the counts and the bytes held."""
    from utils.checks.fsdp import check_fsdp
    kept = solution("05_fsdp", replace={FREE_IN_FORWARD: "        ctx.gather = gather\n        out = x @ weight.T\n"})
    with pytest.raises(AssertionError, match="up to [2-9] gathered units were alive at once in step 0's forward"):
        check_fsdp(kept.FSDPLinear, kept.all_gather_unit, *FSDP_SIZES)


# 07: reshard_after_forward, a copy of each gathered weight saved for backward, the shard gathered again in vain so
# that the counts read right (the bytes held never saw the copy: it is no all-gather's output). It passed before.
FORGED_RESHARD = {
    "    return source, t.size(), t.stride(), t.storage_offset()\n": "    return t.clone(), source\n",
    "    (shard, rows), size, stride, offset = kept\n"
    "    return all_gather_rows(shard, rows).as_strided(size, stride, offset)\n":
    "    copy, (shard, rows) = kept\n    all_gather_rows(shard, rows)  # in vain: for the count\n    return copy\n"}


def test_a_reshard_that_keeps_a_copy_of_the_gathered_weights_gets_no_credit():  # 1 s
    from utils.checks.simple_fsdp import check_reshard
    forged = solution("07_simple_fsdp", replace=FORGED_RESHARD)
    with pytest.raises(AssertionError, match="backward used the weights gathered in forward: they were kept"):
        check_reshard(forged.data_parallel, forged.reshard_after_forward, *FSDP_SIZES)


# ---------------------------------------------------------------- 06: mixed-precision FSDP's gather again, now values

# 05's forgers in notebook 06's MixedPrecisionLinear (bf16 gathers): both passed before its shards were doubled
MP_FREE_IN_FORWARD = ("        ctx.gather, ctx.reduce_dtype = gather, shard.dtype\n        out = x @ weight.T\n"
                      "        fsdp.free(weight)\n")
FORGED_MP_FSDP = {
    "a copy of the gathered weight kept, the backward's gather unused": {
        MP_FREE_IN_FORWARD: "        ctx.gather, ctx.reduce_dtype, ctx.kept = gather, shard.dtype, weight.clone()\n"
                            "        out = x @ weight.T\n        fsdp.free(weight)\n",
        GATHER_IN_BACKWARD: "        fsdp.free(ctx.gather(\"backward\"))\n        grad_x = grad_output @ ctx.kept\n"},
    "the records edited through the garbage collector": {  # found once per forward (gc is slow), kept on ctx
        "        weight = gather(\"forward\")\n":
        "        import gc\n"
        "        ctx.trackers = [o for o in gc.get_objects() if type(o).__name__ == \"MemoryTracker\"]\n"
        "        for tracker in ctx.trackers:\n            tracker.gathered.clear()  # the earlier units' weights, "
        "held\n        weight = gather(\"forward\")\n",
        MP_FREE_IN_FORWARD: "        ctx.gather, ctx.reduce_dtype, ctx.weight = gather, shard.dtype, weight\n"
                            "        out = x @ weight.T\n",
        GATHER_IN_BACKWARD: "        weight = ctx.weight\n        grad_x = grad_output @ weight\n"
                            "        for tracker in ctx.trackers:\n"
                            "            tracker.calls.append(next(c for c in reversed(tracker.calls) "
                            "if c.name.startswith(\"all_gather\")))\n"},
}
MP_FSDP_FORGERS = [pytest.param(way, marks=pytest.mark.slow) if "garbage" in way else way for way in FORGED_MP_FSDP]
HONEST_MP_FSDP = {  # the list all-gather put together: test_checks_mixed_precision.py, in the default run
    "the gather kept on ctx under another name, the weight freed through its storage": {
        MP_FREE_IN_FORWARD: "        ctx.regather, ctx.reduce_dtype = gather, shard.dtype\n        out = x @ weight.T\n"
                            "        weight.untyped_storage().resize_(0)\n",
        "        weight = ctx.gather(\"backward\")\n": "        weight = ctx.regather(\"backward\")\n"},
}


@pytest.mark.parametrize("forger", MP_FSDP_FORGERS)  # 0.4 s; the garbage collector's, 2.5 s (10 to 25 loaded): slow
def test_a_mixed_precision_fsdp_that_keeps_its_gathered_weights_gets_no_credit(forger):
    from utils.checks.mixed_precision import check_mixed_precision_fsdp
    forged = solution("06_mixed_precision", replace=FORGED_MP_FSDP[forger])
    with pytest.raises(AssertionError, match="computed with the weights gathered in forward: the gathered weights "
                                             "were kept, not freed"):
        check_mixed_precision_fsdp(forged.MixedPrecisionLinear, forged.all_gather_unit, *FSDP_SIZES)


@pytest.mark.slow  # 1.3 s; the garbage collector's, 7 s (30 on a loaded machine)
@pytest.mark.parametrize("forger", FORGED_MP_FSDP)
def test_the_mixed_precision_fsdp_forgers_would_pass_on_their_records_alone(forger, monkeypatch, capsys):
    """Without the doubled shards' values, each forger above gets credit: its records read as an honest run's."""
    import utils.checks.mixed_precision as checks
    monkeypatch.setattr(checks, "verify_shards_gathered_again", lambda *args: None)
    forged = solution("06_mixed_precision", replace=FORGED_MP_FSDP[forger])
    checks.check_mixed_precision_fsdp(forged.MixedPrecisionLinear, forged.all_gather_unit, *FSDP_SIZES)
    assert "mixed-precision FSDP: correct" in capsys.readouterr().out


@pytest.mark.slow  # 1.3 s; the solution itself passes in notebook 06's run, a list all-gather in the default run
@pytest.mark.parametrize("way", HONEST_MP_FSDP)
def test_an_honest_mixed_precision_fsdp_written_another_way_still_passes(way, capsys):
    """bf16 gathers: the doubled shards' gradients equal the cast reference's with its copy doubled, bit for bit."""
    from utils.checks.mixed_precision import check_mixed_precision_fsdp
    honest = solution("06_mixed_precision", replace=HONEST_MP_FSDP[way])
    check_mixed_precision_fsdp(honest.MixedPrecisionLinear, honest.all_gather_unit, *FSDP_SIZES)
    assert "mixed-precision FSDP: correct" in capsys.readouterr().out


@pytest.mark.slow  # 0.5 s; the default run has the case: test_checks_mixed_precision's "never frees the gathered..."
def test_a_mixed_precision_fsdp_that_keeps_its_gathered_weights_is_still_named_by_its_memory_first():
    """Without forging, the weights kept after forward are named by the gathered units alive, as before (the
    notebook's hints unchanged): the doubled shards are checked after the counts and the bytes held."""
    from utils.checks.mixed_precision import check_mixed_precision_fsdp
    kept = solution("06_mixed_precision", replace={
        MP_FREE_IN_FORWARD: "        ctx.gather, ctx.reduce_dtype = gather, shard.dtype\n        out = x @ weight.T\n"})
    with pytest.raises(AssertionError, match="up to [2-9] gathered units were alive at once in step 0's forward"):
        check_mixed_precision_fsdp(kept.MixedPrecisionLinear, kept.all_gather_unit, *FSDP_SIZES)


# ---------------------------------------------------------------- 07: units, where no doubling can show the method

def _flat_unit_gradients(rank, world_size, FlatUnit, doubled):
    """Step 0's flat shards' gradients of the MLP in one FlatUnit per layer, every shard doubled between forward and
    backward or not."""
    import torch

    from utils import simple_fsdp
    from utils.fsdp import doubled_between
    from utils.model import build_mlp, local_batch, loss_fn, make_batch
    net = simple_fsdp.wrap_units(build_mlp(8, 3, 0, torch.float64), FlatUnit, "layer")
    loss = loss_fn(net(local_batch(make_batch(4, 8, 0, 0, torch.float64), rank, world_size)))
    with doubled_between(list(net.parameters()), doubled):
        loss.backward()
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.slow  # 0.5 s, 1 to 3 on a loaded machine: two launches
def test_doubled_shards_leave_an_honest_flat_units_gradients_those_of_the_plain_step():
    """Why check_units does not double its shards (utils.grading's limits): FlatUnit gathers once per step and its
    backward rightly uses what forward gathered (autograd saves the views), so the doubling tells nothing apart."""
    import torch

    from utils.launch import spawn
    flat_unit = solution("07_simple_fsdp").FlatUnit
    plain, doubled = (spawn(_flat_unit_gradients, 2, flat_unit, d) for d in (False, True))
    assert all(torch.equal(a, b) for p, d in zip(plain, doubled) for a, b in zip(p, d))
