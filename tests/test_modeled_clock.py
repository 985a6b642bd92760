"""The modeled clock (utils/modeled_clock.py): the slots with equal costs, a wrong order's timeline, the planner's
step time with the planner's costs. Pure Python, no ranks."""
import dataclasses
import types

import pytest
import torch

from utils import modeled_clock as mc
from utils import pipeline as pp
from utils import planner as pl
from utils.pipeline import Event, StepRecord

P, M, V = 4, 8, 2
TABLES = {"GPipe": (pp.chunked(pp.gpipe_order), 1), "1F1B": (pp.chunked(pp.one_f_one_b_order), 1),
          "interleaved": (pp.interleaved_order, V), "ZB-H1": (pp.chunked(pp.zb_h1_order), 1)}
# Llama 2 70B's shape (Touvron et al. 2023): 80 layers of 8192, 64 heads, 8 key/value heads, SwiGLU 28672, vocab 32000
LLAMA_70B = pl.Model(num_layers=80, dim=8192, num_heads=64, num_kv_heads=8, ffn_dim=28672, seq_len=4096,
                     vocab_size=32000, ffn_matrices=3, name="Llama 2 70B")


def tables(name, p=P, m=M):
    order, v = TABLES[name]
    return [order(r, p, v, m) for r in range(p)], v


def as_record(order, shift=0.0):
    """A StepRecord whose events started in `order` (made-up times, one unit apart, the event's end order mixed)."""
    events = [Event(kind, i, k + shift, k + 0.5, chunk) for k, (kind, chunk, i) in enumerate(order)]
    return StepRecord(events=sorted(events, key=lambda e: (e.kind, e.micro_batch)))


@pytest.mark.parametrize("name", TABLES)
def test_equal_costs_and_free_hand_offs_give_the_slots_and_the_formula(name):
    orders, v = tables(name)
    clock = mc.replay(orders, num_virtual=v)
    busy, length = pp.idle_slots(orders, v)
    assert clock.step == length and clock.busy == busy
    assert clock.idle_share == pytest.approx(1 - sum(busy) / (P * length))
    assert clock.idle_share == pytest.approx(pp.formula_idle_share(name, P, M, v))
    assert clock.idle == pytest.approx([clock.idle_share] * P)  # equal costs: every rank idles alike


def test_zb_h1_below_m_equal_p_is_played_not_the_formula():
    orders, _ = tables("ZB-H1", m=2)
    busy, length = pp.idle_slots(orders)
    clock = mc.replay(orders)
    assert (clock.step, clock.busy) == (length, busy)
    assert clock.idle_share != pytest.approx(pp.formula_idle_share("ZB-H1", P, 2))


def test_costs_written_another_way_give_the_formula():
    """Equal F = B = W on every piece and free hand-offs, in seconds: the same shares as the slots."""
    for name in TABLES:
        orders, v = tables(name)
        costs = mc.Costs((0.3,) * (P * v), (0.3,) * (P * v), (0.3,) * (P * v), 0.0, "equal", "anywhere")
        assert mc.replay(orders, costs, v).idle_share == pytest.approx(pp.formula_idle_share(name, P, M, v))


def test_a_recorded_order_is_what_is_replayed():
    orders, _ = tables("1F1B")
    by_tables = mc.replay(orders, mc.mlp_costs(P))
    recorded = mc.replay([as_record(o, shift=r) for r, o in enumerate(orders)], mc.mlp_costs(P))
    assert recorded.events == by_tables.events and recorded.step == by_tables.step
    assert [[(e.kind, e.piece, e.micro_batch) for e in rank] for rank in recorded.events] == orders


def test_a_warm_up_one_forward_too_long_gives_another_timeline():
    orders, _ = tables("1F1B")
    right = mc.replay(orders, mc.mlp_costs(P))
    long_warm_up = [pp.one_f_one_b_order(s, P + 1, M) for s in range(P)]  # p - s warm-up forwards, not p - s - 1
    wrong = mc.replay(long_warm_up, mc.mlp_costs(P))
    assert wrong.events != right.events
    assert [e.kind for e in wrong.events[0][:P + 1]] == ["F"] * (P + 1)


def test_backwards_in_another_order_than_the_neighbours_lengthen_the_step():
    orders, _ = tables("GPipe")
    reversed_backwards = [list(o) for o in orders]
    reversed_backwards[1] = [a for a in orders[1] if a[0] == "F"] + [a for a in orders[1] if a[0] == "B"][::-1]
    assert mc.replay(reversed_backwards, mc.mlp_costs(P)).step > mc.replay(orders, mc.mlp_costs(P)).step


def test_a_deadlocking_table_is_a_clear_error():
    orders, _ = tables("1F1B")
    stuck = [list(o) for o in orders]
    stuck[1] = [("B", 0, 0)] + [a for a in stuck[1] if a != ("B", 0, 0)]  # a backward before any forward
    with pytest.raises(ValueError, match="deadlock.*rank 1 at B0"):
        mc.replay(stuck, mc.mlp_costs(P))


@pytest.mark.parametrize("edit, hint", [(lambda o: o[:-1], "micro-batch 7: ran F x1, B x0"),
                                        (lambda o: o + [("F", 0, 0)], "micro-batch 0: ran F x2"),
                                        (lambda o: [a for a in o if a != ("F", 0, 3)], "F x0")])
def test_a_missing_or_repeated_computation_is_named_before_playing(edit, hint):
    orders, _ = tables("1F1B")
    orders[2] = edit(orders[2])
    with pytest.raises(ValueError, match=hint):
        mc.replay(orders, num_micro_batches=M)


def test_costs_for_the_wrong_number_of_pieces_are_refused():
    orders, v = tables("interleaved")
    with pytest.raises(ValueError, match="costs are for 4 pieces.*8"):
        mc.replay(orders, mc.mlp_costs(P), v)


def test_the_first_stage_records_w_alone_and_pays_the_whole_backward():
    """Recorded ZB-H1: the first stage's input needs no gradient, so it runs W only (utils.pipeline.record_step)."""
    orders, _ = tables("ZB-H1")
    recorded = [[a for a in o if not (r == 0 and a[0] == "B")] for r, o in enumerate(orders)]
    costs = mc.mlp_costs(P)
    clock = mc.replay(recorded, costs)
    w = [e for e in clock.events[0] if e.kind == "W"]
    assert len(w) == M
    assert w[0].end - w[0].start == pytest.approx(costs.input_grad[0] + costs.weight_grad[0])


def test_the_mlp_costs_b_above_f_above_w_and_hand_offs_held_by_the_sender():
    costs = mc.mlp_costs(P)
    assert costs.input_grad[1] > costs.forward[1] > costs.weight_grad[1]
    assert costs.input_grad[0] < costs.input_grad[1]  # the first layer computes no input gradient
    for name in TABLES:
        orders, v = tables(name)
        clock = mc.replay(orders, mc.mlp_costs(P * v), v)
        assert clock.idle_share > pp.formula_idle_share(name, P, M, v)  # hand-offs are idle time, and B > W
        assert all(end - start == pytest.approx(clock_costs.hand_off)
                   for clock_costs in [mc.mlp_costs(P * v)] for sends in clock.sends for start, end in sends)
        assert sum(len(s) for s in clock.sends) == 2 * M * (P * v - 1)


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("interleaved", 2), ("ZB-H1", 1)])
def test_the_replay_of_a_layout_equals_the_planners_step(schedule, v):
    """pp = 4 on 4 H100s, Llama 2 70B, m = 8: the replay with the planner's F, B, W per piece and its hand-off, and
    the planner's step (without the optimizer, which runs after the pipeline), within 2%: one model, two uses.
    What is left is the output layer: the planner charges every stage the slowest (last) stage's times."""
    cluster, config = pl.cluster("H100 SXM", 4), pl.Config(pp=4, schedule=schedule, v=v)
    seconds = pl.step_seconds(LLAMA_70B, cluster, config, M)
    order, _ = TABLES[schedule]
    clock = mc.replay([order(r, 4, v, M) for r in range(4)], mc.planner_costs(LLAMA_70B, cluster, config), v)
    assert clock.step == pytest.approx(seconds["step"] - seconds["optimizer"], rel=0.02)


def test_planner_costs_refuse_what_the_replay_does_not_play():
    with pytest.raises(ValueError, match="tensor parallel.*cp=2"):
        mc.planner_costs(LLAMA_70B, pl.cluster("H100 SXM", 8), pl.Config(pp=4, cp=2))
    with pytest.raises(ValueError, match="zero_stage=3"):
        mc.planner_costs(LLAMA_70B, pl.cluster("H100 SXM", 8), pl.Config(pp=4, dp=2, zero_stage=3))


@pytest.mark.parametrize("devices, dp, pp, tp, m", [(16, 1, 2, 8, 2), (64, 4, 2, 8, 2), (64, 2, 4, 8, 8),
                                                    (8, 2, 2, 2, 4)])
def test_the_replay_of_a_3d_layout_equals_the_planners_step(devices, dp, pp, tp, m):
    """Notebook 12's 3-D step: 1F1B over pp stages, tensor parallel inside each, the data axis's sync once per step
    after the pipeline; the replay plus the planner's data term against the planner's step, within 2%."""
    cluster, config = pl.cluster("H100 SXM", devices), pl.Config(dp=dp, pp=pp, tp=tp)
    seconds = pl.step_seconds(LLAMA_70B, cluster, config, dp * m)
    clock = mc.replay([pp_order(r, pp, m) for r in range(pp)], mc.planner_costs(LLAMA_70B, cluster, config))
    modeled = clock.step + mc.data_parallel_seconds(LLAMA_70B, cluster, config, dp * m)
    assert modeled == pytest.approx(seconds["step"] - seconds["optimizer"], rel=0.02)


def pp_order(stage, p, m):
    return pp.one_f_one_b_order(stage, p, m)


def zigzag(seq_len, n):
    chunk = seq_len // (2 * n)
    return [torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * n - 1 - r) * chunk, (2 * n - r) * chunk)])
            for r in range(n)]


def test_the_ring_replay_shows_zigzag_balanced_and_contiguous_waiting_for_its_last_rank():
    from utils import ring_attention as ra
    from utils.checks.context_parallel import work_per_rank

    seq_len = 1536
    contiguous, zz = ra.chunk_positions(seq_len, 4), zigzag(seq_len, 4)
    clocks = {name: mc.ring_replay(*mc.ring_attention_costs(positions, num_heads=4, num_kv_heads=4, head_dim=64))
              for name, positions in (("contiguous", contiguous), ("zigzag", zz))}
    assert clocks["zigzag"].busy == pytest.approx([clocks["zigzag"].busy[0]] * 4)
    assert clocks["contiguous"].busy == sorted(clocks["contiguous"].busy) and clocks["contiguous"].idle[-1] < 0.01
    work = work_per_rank(contiguous)
    assert clocks["contiguous"].busy[-1] / clocks["contiguous"].busy[0] == pytest.approx(work[-1] / work[0], rel=0.05)


def test_a_ring_with_nothing_to_compute_waits_for_its_hand_offs():
    clock = mc.ring_replay([[0.0] * 3 for _ in range(3)], 2.0)
    assert clock.step == 4.0 and clock.idle == [1.0, 1.0, 1.0]
    assert mc.ring_replay([[1.0, 5.0], [1.0, 1.0]], 0.5).step == 6.0  # the ring ends with its slowest rank


# ---------------------------------------------------------------- two streams: data parallel's overlap (notebook 02)

def hand_costs(forward=(1.0, 1.0, 1.0), backward=(2.0, 3.0, 3.0), seconds_per_byte=1.0):
    """Costs by hand: an all-reduce of S recorded bytes takes S seconds (no alpha) on an intra-node link."""
    link = pl.Link(alpha=0.0, beta=1.0)
    # a world of 2: a ring all-reduce moves 2 (N-1)/N S = S bytes
    return mc.DataParallelCosts(tuple(forward), tuple(backward), seconds_per_byte, 2, link, "by hand", "anywhere")


READY = [2, 1, 0]  # the MLP's gradients, last layer first


def test_a_synthetic_record_replays_to_hand_computed_times():
    """Forward 3 s; gradients ready at 6, 9, 11; all-reduces of 2 s each, started as each is ready, waited for at
    the end: the link runs 6-8, 9-11, 11-13; the step ends at 13, 2 s exposed."""
    syncs = [mc.Sync(2, k + 1, 3) for k in range(3)]
    clock = mc.data_parallel_replay(READY, syncs, hand_costs())
    assert [(s, e) for _, s, e in clock.communication] == [(6, 8), (9, 11), (11, 13)]
    assert [label for label, _, _ in clock.compute] == ["F0", "F1", "F2", "B2", "B1", "B0"]
    assert (clock.step, clock.busy, clock.exposed) == (13, 11, 2)


def test_a_busy_link_queues_the_all_reduces_in_the_order_they_started():
    syncs = [mc.Sync(4, 1, 3), mc.Sync(1, 2, 3), mc.Sync(1, 3, 3)]
    clock = mc.data_parallel_replay(READY, syncs, hand_costs())
    assert [(s, e) for _, s, e in clock.communication] == [(6, 10), (10, 11), (11, 12)]
    assert clock.step == 12


@pytest.mark.parametrize("syncs", [[mc.Sync(2, k + 1, 3) for k in range(3)], [mc.Sync(4, 2, 3), mc.Sync(2, 3, 3)],
                                   [mc.Sync(6, 3, None)]])
def test_no_overlap_is_compute_plus_communication(syncs):
    costs = hand_costs()
    clock = mc.data_parallel_replay(READY, syncs, costs, after_backward=True)
    compute = sum(costs.forward) + sum(costs.backward)
    assert clock.step == pytest.approx(compute + sum(costs.all_reduce(s.nbytes) for s in syncs))
    assert clock.exposed == pytest.approx(clock.communicating)


@pytest.mark.parametrize("backward", [(2.0, 3.0, 3.0), (0.5, 0.5, 0.5), (9.0, 9.0, 9.0)])
def test_full_overlap_is_bounded_below_by_the_last_buckets_all_reduce(backward):
    """Each gradient's all-reduce started as it is ready: the step is at least the backward plus the last one
    (its gradient is the last ready), and at least the forward plus everything the link carries; with a backward
    longer than each all-reduce it is exactly the first bound."""
    costs, syncs = hand_costs(backward=backward), [mc.Sync(2, k + 1, 3) for k in range(3)]
    clock = mc.data_parallel_replay(READY, syncs, costs)
    compute = sum(costs.forward) + sum(backward)
    last = costs.all_reduce(syncs[-1].nbytes)
    assert clock.step == pytest.approx(max(compute + last, sum(costs.forward) + backward[2] + 3 * last))
    assert clock.step >= compute + last
    if min(backward) >= last:
        assert clock.exposed == pytest.approx(last)


def test_waiting_in_the_hook_or_one_bucket_give_other_timelines():
    costs = hand_costs()
    overlapped = mc.data_parallel_replay(READY, [mc.Sync(2, k + 1, 3) for k in range(3)], costs)
    in_the_hook = mc.data_parallel_replay(READY, [mc.Sync(2, k + 1, k + 1) for k in range(3)], costs)
    one_bucket = mc.data_parallel_replay(READY, [mc.Sync(6, 3, 3)], costs)
    assert overlapped.step < one_bucket.step == in_the_hook.step == 11 + 6
    assert [e for _, _, e in in_the_hook.compute] != [e for _, _, e in overlapped.compute]  # the backward held


def test_recorded_syncs_read_a_data_parallel_runs_clock():
    """utils.data_parallel's clock reads (gradients ready, phase): the order the gradients were ready in, and each
    all-reduce's bytes, when it started and was waited for (a blocking one where it started)."""
    from utils.data_parallel import BACKWARD, FINISH
    from utils.intercept import Call

    ready_at = {2: (1, BACKWARD), 0: (3, BACKWARD), 1: (2, BACKWARD)}
    calls = [Call("all_reduce", 16, False, (1, BACKWARD), (3, FINISH)), Call("broadcast", 8, True, (1, BACKWARD)),
             Call("all_reduce", 32, True, (3, BACKWARD), (3, BACKWARD)), Call("all_reduce", 8, False, (3, FINISH))]
    ready, syncs = mc.recorded_syncs(types.SimpleNamespace(ready_at=[ready_at], calls=[calls]))
    assert ready == [2, 1, 0]
    assert syncs == [mc.Sync(16, 1, 3), mc.Sync(32, 3, 3), mc.Sync(8, 3, None)]


def test_a_wait_before_its_start_is_a_clear_error():
    with pytest.raises(ValueError, match="waits for 'x' before starting it"):
        mc.stream_replay([("compute", "F", 1.0), ("wait", "x")])


def test_the_mlp_data_parallel_costs_are_the_planners():
    costs = mc.mlp_data_parallel_costs(4, recorded_weight_bytes=16 * 16 * 8)
    cluster = pl.cluster("H100 SXM", 64)
    h, rows = 8192, 32768
    link = pl.group_links(cluster, pl.Config(dp=64))["dp"][1]  # NCCL's ring of 8 nodes of 8
    assert costs.all_reduce(16 * 16 * 8) == pl.collective_seconds("all_reduce", 64, h * h * 2, link)
    assert costs.forward[0] > pl.matmul_seconds(rows, h, h, cluster)  # the product, and GELU
    assert costs.backward[0] < costs.backward[1]  # the first layer computes no input gradient
    assert "64 H100 SXM in 8 nodes of 8 (InfiniBand)" in costs.where


# ---------------------------------------------------------------- FSDP's prefetch (notebook 05)

FSDP_HAND = mc.FSDPCosts(forward=2.0, backward=4.0, gather=1.0, reduce=1.0, output=(3.0, 5.0), model="by hand",
                         cluster="anywhere")


def test_fsdp_with_prefetch_exposes_the_first_gather_and_the_last_reduce_scatter():
    """L = 2, F 2, B 4, gather 1, reduce-scatter 1, output 3 + 5: forward AG0 0-1, AG1 1-2, F0 1-3, F1 3-5, out
    5-13 (AG1' 5-6 beside it); backward AG0' 13-14, B1 13-17, RS1 17-18, B0 17-21, RS0 21-22."""
    clock = mc.stream_replay(mc.fsdp_program(2, FSDP_HAND))
    assert [(label, s, e) for label, s, e in clock.compute] == [
        ("F0", 1, 3), ("F1", 3, 5), ("out F", 5, 8), ("out B", 8, 13), ("B1", 13, 17), ("B0", 17, 21)]
    assert clock.step == 22 and clock.exposed == FSDP_HAND.gather + FSDP_HAND.reduce
    assert (clock.waited("AG"), clock.waited("RS")) == (FSDP_HAND.gather, FSDP_HAND.reduce)


def test_fsdp_without_prefetch_exposes_every_gather_and_queues_them_behind_the_reduce_scatters():
    L, c = 3, FSDP_HAND
    clock = mc.stream_replay(mc.fsdp_program(L, c, prefetch=False))
    # forward: each gather exposed; backward: each gather waits behind the previous layer's reduce-scatter
    assert clock.exposed == pytest.approx(L * c.gather + L * (c.gather + c.reduce))


def test_fsdp_on_a_busy_link_is_link_bound():
    c = dataclasses.replace(FSDP_HAND, gather=3.0)  # longer than a layer's forward
    L = 4
    clock = mc.stream_replay(mc.fsdp_program(L, c))
    forward_end = next(e for label, _, e in clock.compute if label == f"F{L - 1}")
    assert forward_end == L * c.gather + c.forward  # the forward waits on the link: g + (L-1)(g - F) exposed


# The planner charges a dense model, per layer's gather and reduce-scatter, the latency of an experts' collective
# of no bytes ((n-1) alpha: step.py's dp_layer tests `expert_n > 1`, not whether there are expert parameters):
# 2-4% of a link-bound step. With that term gone every layout here agrees within 0.5%; it is left to the lead, as
# the planner's published-run validation was calibrated with it (3 of its tests move).
@pytest.mark.parametrize("devices, micro_batch_size", [(8, 1), (16, 1), (64, 4), (64, 1), (128, 1)])
def test_the_replay_of_an_fsdp_layout_equals_the_planners_step(devices, micro_batch_size):
    """One model, two uses: the planner's step time of an FSDP layout (one micro-batch a step, prefetch on), its
    optimizer aside (it runs after both), and the replay of FSDP2's order with the planner's costs, within 2%."""
    cluster = pl.cluster("H100 SXM", devices)
    config = pl.Config(dp=devices, zero_stage=3, micro_batch_size=micro_batch_size)
    planned = pl.step_seconds(LLAMA_70B, cluster, config, devices * micro_batch_size)
    clock = mc.stream_replay(mc.fsdp_program(LLAMA_70B.num_layers, mc.fsdp_costs(LLAMA_70B, cluster, config)))
    assert clock.step == pytest.approx(planned["step"] - planned["optimizer"], rel=0.02)
    assert clock.exposed == pytest.approx(planned["dp"], rel=0.25, abs=1e-3)


def test_fsdp_costs_refuse_what_the_replay_does_not_play():
    with pytest.raises(ValueError, match="zero_stage 3"):
        mc.fsdp_costs(LLAMA_70B, pl.cluster("H100 SXM", 8), pl.Config(dp=8, zero_stage=1))


def fsdp_record(num_layers, cap, blocking_reduce=True):
    """A utils.fsdp.Run's step 1 as the notebook's FSDP records it: at each ask, the unit's gather (unless
    prefetched) and up to `cap` more started, the unit's gather waited for; in backward, the reduce-scatter after."""
    from utils.fsdp import Moment, Use
    from utils.intercept import Call

    calls, uses, tick, started = [], [], 10, {}
    for phase, units in (("forward", range(num_layers)), ("backward", reversed(range(num_layers)))):
        units = list(units)
        started.clear()
        tick += 1
        for k, u in enumerate(units):
            tick += 1
            now = Moment(tick, 1, phase, u)
            uses.append(Use(u, now, None))
            for v in units[k:k + 1 + cap]:
                if v not in started:
                    started[v] = Call("all_gather_single", 8, False, now)
                    calls.append(started[v])
            started[u].waited_at = now
            if phase == "backward":
                calls.append(Call("reduce_scatter_single", 2, blocking_reduce, now, now if blocking_reduce else None))
    return types.SimpleNamespace(calls=calls, uses=uses)


def test_a_recorded_fsdp_step_replays_what_it_did():
    L, c = 3, FSDP_HAND
    on_demand = mc.stream_replay(mc.recorded_fsdp_program(fsdp_record(L, cap=0), c))
    # every gather and every (blocking) reduce-scatter exposed
    assert on_demand.exposed == pytest.approx(2 * L * c.gather + L * c.reduce)
    prefetched = mc.stream_replay(mc.recorded_fsdp_program(fsdp_record(L, cap=1), c))
    # the first gather of each phase exposed, the blocking reduce-scatters too
    assert prefetched.exposed == pytest.approx(2 * c.gather + L * c.reduce)
    asynchronous = mc.stream_replay(mc.recorded_fsdp_program(fsdp_record(L, cap=1, blocking_reduce=False), c))
    assert asynchronous.exposed < prefetched.exposed
    assert [label for label, _, _ in prefetched.compute] == ["F0", "F1", "F2", "out F", "out B", "B2", "B1", "B0"]
