"""The modeled clock (utils/modeled_clock.py): the slots with equal costs, a wrong order's timeline, the planner's
step time with the planner's costs. Pure Python, no ranks."""
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
    with pytest.raises(ValueError, match="pure pipeline.*tp=2"):
        mc.planner_costs(LLAMA_70B, pl.cluster("H100 SXM", 8), pl.Config(pp=4, tp=2))


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
