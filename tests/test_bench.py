"""The timing discipline's verdicts, on made-up samples: an order or a ratio only when the runs separate."""
import pickle
import time

import torch
import torch.distributed as dist

from utils import bench
from utils.launch import spawn


def test_spread_is_the_median_and_the_range():
    assert bench.spread([0.3, 0.1, 0.2, 0.5, 0.4]) == bench.Spread(0.3, 0.1, 0.5, 5)
    assert bench.format_spread(bench.Spread(0.0148, 0.0139, 0.0162)) == "14.8 ms (13.9 to 16.2)"


def test_separated_spreads_give_the_order():
    fast, slow = bench.spread([1.0, 1.1, 1.2, 1.1, 1.15]), bench.spread([2.0, 2.1, 2.3, 2.2, 2.1])
    assert bench.order_verdict({"slow": slow, "fast": fast}) == "fastest to slowest: fast < slow"


def test_overlapping_spreads_cannot_be_separated_even_when_the_medians_differ():
    a, b = bench.spread([1.0, 1.5, 3.0]), bench.spread([2.0, 2.5, 2.6])
    assert bench.order_verdict({"a": a, "b": b}) == "this machine cannot separate a and b: their runs overlap"


def test_an_order_of_several_marks_the_pairs_it_cannot_separate():
    spreads = {"c": bench.spread([5, 6, 5, 6, 5, 5]), "b": bench.spread([2.5, 3.5, 3, 3, 3, 3]),
               "a": bench.spread([1, 3, 2, 2, 2, 2])}
    assert bench.order_verdict(spreads) == "fastest to slowest: a ~ b < c (~: this machine cannot separate them)"


def test_an_order_of_another_measure_names_its_ends():
    idle = {"1F1B": bench.spread([0.30, 0.35, 0.31, 0.32, 0.33]),
            "ZB-H1": bench.spread([0.10, 0.12, 0.11, 0.11, 0.10])}
    assert bench.order_verdict(idle, ("least idle", "most idle")) == "least idle to most idle: ZB-H1 < 1F1B"


def test_separated_spreads_give_the_ratio_and_its_range():
    a, b = bench.spread([3.0, 3.2, 3.5, 3.2, 3.2]), bench.spread([1.0, 1.1, 1.2, 1.1, 1.1])
    assert bench.ratio_verdict("ranks", a, "one process", b) == \
        "ranks / one process = 2.91 (runs allow 2.50 to 3.50)"


def test_three_runs_each_are_too_few_to_claim_an_order_even_when_they_separate():
    # of the 20 orders of 6 alike runs, 2 separate them: a claim from 3 runs each would be wrong 1 time in 10
    assert bench.chance_of_separating(3, 3) == 0.1
    assert bench.chance_of_separating(4, 4) > bench.CHANCE > bench.chance_of_separating(5, 5)
    fast, slow = bench.spread([1.0, 1.1, 1.2]), bench.spread([2.0, 2.1, 2.3])
    assert bench.order_verdict({"fast": fast, "slow": slow}) == \
        "this machine cannot separate fast and slow: 3 runs are too few to tell"
    assert bench.ratio_verdict("slow", slow, "fast", fast).startswith(
        "this machine cannot separate slow and fast: 3 runs are too few to tell (ratio 1.67")


def test_a_chain_is_held_to_chance_as_a_family():
    # a chain of k makes k - 1 claims, each at CHANCE / (k - 1): 5 runs each (1 in 126) are enough for 2
    # variants, not for 3; 6 each (1 in 462) for up to 5; 7 each (1 in 1716) for up to 18
    assert bench.chance_of_separating(6, 6) == 1 / 462 and bench.chance_of_separating(7, 7) == 1 / 1716
    assert bench.separated(bench.spread([1] * 5), bench.spread([2] * 5))
    assert not bench.separated(bench.spread([1] * 5), bench.spread([2] * 5), claims=2)
    assert bench.separated(bench.spread([1] * 6), bench.spread([2] * 6), claims=4)
    assert not bench.separated(bench.spread([1] * 6), bench.spread([2] * 6), claims=5)
    assert bench.separated(bench.spread([1] * 7), bench.spread([2] * 7), claims=17)
    assert [bench.runs_needed(k) for k in (2, 3, 5, 6, 7, 18, 19)] == [5, 6, 6, 7, 7, 7, 8]


def three_ratios(runs, claims=3):
    # three variants each clearly slower than one baseline, the ratios printed by one cell: a family of 3 claims
    base = bench.spread([1.0 + 0.01 * i for i in range(runs)])
    slower = {name: bench.spread([k + 0.01 * i for i in range(runs)]) for name, k in (("x", 2), ("y", 3), ("z", 4))}
    return [bench.ratio_verdict(name, s, "base", base, claims=claims) for name, s in slower.items()]


def test_ratios_printed_together_are_held_to_chance_as_a_family():
    # 5 runs each (1 in 126) are enough for one ratio, not for one of 3 (each at 1 in 300): 6 (1 in 462) are
    assert three_ratios(5, claims=1)[0] == "x / base = 1.98 (runs allow 1.92 to 2.04)"
    lines = three_ratios(5)
    assert lines[0] == ("this machine cannot separate x and base: 5 runs are too few to tell in a family of 3 claims "
                        "(ratio 1.92 to 2.04)")
    assert all("too few to tell in a family of 3 claims" in line for line in lines)
    assert [bench.verdict_relations(line) for line in lines] == [set()] * 3
    assert bench.runs_needed(3 + 1) == 6
    lines = three_ratios(6)
    assert lines[2] == "z / base = 3.93 (runs allow 3.81 to 4.05)"
    assert [bench.verdict_relations(line) for line in lines] == [{("base", name)} for name in "xyz"]
    # a loaded run's "too few" agrees with the stored ratios; the stored ratios are the verdicts the loaded-run
    # check finds (tests/test_timing_verdicts.py)
    assert all(bench.verdicts_agree(stored, loaded) for stored, loaded in zip(three_ratios(6), three_ratios(5)))
    from test_timing_verdicts import VERDICT  # tests/ is on the path of its own tests
    assert all(VERDICT.search(line) for line in three_ratios(5) + three_ratios(6))


def four_apart(runs):
    return {name: bench.spread([base + 0.01 * i for i in range(runs)]) for name, base in zip("dcba", (4, 3, 2, 1))}


def test_separated_spreads_of_7_runs_give_the_order_of_a_chain():
    assert bench.order_verdict(four_apart(7)) == "fastest to slowest: a < b < c < d"
    seven = {f"v{i}": bench.spread([i + 0.01 * j for j in range(7)]) for i in range(7)}
    assert bench.order_verdict(seven) == "fastest to slowest: v0 < v1 < v2 < v3 < v4 < v5 < v6"


def test_5_runs_in_a_chain_of_4_cannot_separate_it():
    verdict = bench.order_verdict(four_apart(5))
    assert verdict == ("fastest to slowest: a ~ b ~ c ~ d (~: this machine cannot separate them; 5 runs are too few "
                       "to tell in a chain of 4)")
    assert bench.verdict_relations(verdict) == set()


def test_a_chain_separates_only_where_every_run_before_is_faster_than_every_run_after():
    # b and c separate, but a's runs reach into c's: "a ~ b < c" would claim a faster than c
    spreads = {"a": bench.spread([1, 1, 1, 1, 1, 6.5, 6.5]), "b": bench.spread([4] * 7), "c": bench.spread([6] * 7)}
    verdict = bench.order_verdict(spreads)
    assert verdict == "fastest to slowest: a ~ b ~ c (~: this machine cannot separate them)"
    spreads["a"] = bench.spread([1, 1, 1, 1, 1, 5, 5])
    assert bench.order_verdict(spreads) == "fastest to slowest: a ~ b < c (~: this machine cannot separate them)"
    assert bench.verdict_relations(bench.order_verdict(spreads)) == {("a", "c"), ("b", "c")}


def test_overlapping_spreads_give_no_ratio():
    a, b = bench.spread([1.0, 1.2, 2.0]), bench.spread([1.5, 1.6, 1.7])
    assert bench.ratio_verdict("ring", a, "all-gather", b) == \
        "this machine cannot separate ring and all-gather: their runs overlap (ratio 0.59 to 1.33)"


def test_interleaved_samples_take_turns_after_the_warm_up():
    calls = []
    samples = bench.interleaved_samples({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                        repeat=2, warmup=1)
    assert calls == ["a", "b"] * 3
    assert [len(s) for s in samples.values()] == [2, 2]


def test_threads_restores_the_count():
    before = torch.get_num_threads()
    with bench.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def slowest_rank_main(rank, world_size):
    return bench.interleaved_samples({"a": lambda: time.sleep(0.05 if rank == 1 else 0), "b": lambda: None},
                                     repeat=2)


def test_on_ranks_a_run_takes_its_slowest_ranks_seconds():
    for samples in spawn(slowest_rank_main, 2):
        assert min(samples["a"]) >= 0.05 and len(samples["b"]) == 2


def test_a_verdict_claims_the_pairs_its_order_separates():
    assert bench.verdict_relations("fastest to slowest: fast < slow") == {("fast", "slow")}
    assert bench.verdict_relations("2 ranks, 16 MB, fastest to slowest: all_gather < all_reduce ~ naive FSDP "
                                   "(~: this machine cannot separate them)") == \
        {("all_gather", "all_reduce"), ("all_gather", "naive FSDP")}
    assert bench.verdict_relations("this machine cannot separate a and b: their runs overlap") == set()
    assert bench.verdict_relations("fastest to slowest: a ~ b (~: this machine cannot separate them)") == set()
    assert bench.verdict_relations("m=8, measured idle share: least idle to most idle: 1F1B < GPipe") == \
        {("1F1B", "GPipe")}  # another measure's chain claims its pairs too


def test_a_ratio_verdict_claims_the_faster_of_the_two():
    a, b = bench.spread([3.0, 3.2, 3.5, 3.1, 3.3]), bench.spread([1.0, 1.1, 1.2, 1.1, 1.0])
    assert bench.verdict_relations(bench.ratio_verdict("ranks", a, "one process", b)) == {("one process", "ranks")}
    assert bench.verdict_relations("step time: " + bench.ratio_verdict("x", b, "y", a) + " (target: at most 1.5)") == \
        {("step time: x", "y")}
    assert bench.verdict_relations(bench.ratio_verdict("ring", bench.spread([1.0, 2.0, 1.5, 1.5, 1.5]), "gloo", b)) == set()


def test_a_loaded_run_agrees_when_it_says_the_same_or_cannot_separate():
    stored = "fastest to slowest: a < b < c"
    assert bench.verdicts_agree(stored, stored)
    assert bench.verdicts_agree(stored, "fastest to slowest: a ~ b < c (~: this machine cannot separate them)")
    assert bench.verdicts_agree(stored, "this machine cannot separate a and b: their runs overlap")
    assert not bench.verdicts_agree(stored, "fastest to slowest: b < a < c")  # a flip
    assert not bench.verdicts_agree("this machine cannot separate a and b: their runs overlap",
                                    "fastest to slowest: a < b")  # an order the stored run could not see
    assert bench.verdicts_contradict(stored, "fastest to slowest: b < a < c")
    assert not bench.verdicts_contradict("this machine cannot separate a and b: their runs overlap",
                                         "fastest to slowest: a < b")


def ping_pong_main_and_samples(rank, world_size):
    return bench.ping_pong_main(rank, world_size, [4, 64]), bench.ping_pong_samples(rank, world_size, [4], repeat=3)


def test_ping_pong_gives_the_median_of_its_samples():
    medians, samples = spawn(ping_pong_main_and_samples, 2)[0]
    assert len(medians) == 2 and all(m > 0 for m in medians)
    assert len(samples) == 1 and len(samples[0]) == 3


def waited(seconds, waits):
    return bench.spread([bench.Seconds(t, w) for t, w in zip(seconds, waits or [None] * len(seconds))])


FAST, SLOW = [1.0, 1.1, 1.2, 1.1, 1.15], [2.0, 2.1, 2.3, 2.2, 2.1]


def test_an_order_that_survives_removing_the_waits_for_a_core_is_claimed():
    fast, slow = waited(FAST, [0.01] * 5), waited(SLOW, [0.3, 0.2, 0.5, 0.1, 0.4])
    assert round(slow.unwaited, 9) == 1.7 and slow.waited == 0.5 / 2.3
    assert bench.order_verdict({"slow": slow, "fast": fast}) == "fastest to slowest: fast < slow"
    assert bench.ratio_verdict("slow", slow, "fast", fast) == "slow / fast = 1.91 (runs allow 1.67 to 2.30)"


def test_an_order_that_waiting_for_a_core_can_explain_cannot_be_separated():
    # one run of the slower waited 1.1 s of its 2.2: without it, it could have been faster than a run of the faster
    fast, slow = waited(FAST, [0.0] * 5), waited(SLOW, [0.1, 0.1, 0.1, 1.1, 0.1])
    reason = "their ranks waited up to 50% of a run for a core, held by other ranks or processes"
    assert bench.order_verdict({"fast": fast, "slow": slow}) == f"this machine cannot separate fast and slow: {reason}"
    assert bench.ratio_verdict("slow", slow, "fast", fast) == \
        f"this machine cannot separate slow and fast: {reason} (ratio 1.67 to 2.30)"
    assert bench.ratio_verdict("fast", fast, "slow", slow).startswith(
        f"this machine cannot separate fast and slow: {reason}")
    assert not bench.separated(fast, slow)
    # only the slower side's waits count: the faster's runs are what they are
    assert bench.separated(waited(FAST, [0.9] * 5), waited(SLOW, [0.1] * 5))


def test_without_waits_macos_the_verdicts_are_the_ranges_alone():
    plain = {"fast": bench.spread(FAST), "slow": bench.spread(SLOW)}
    unknown = {"fast": waited(FAST, None), "slow": waited(SLOW, None)}
    assert unknown["slow"].unwaited is None and unknown["slow"].waited is None
    assert bench.order_verdict(unknown) == bench.order_verdict(plain) == "fastest to slowest: fast < slow"
    assert bench.ratio_verdict("slow", unknown["slow"], "fast", unknown["fast"]) == \
        bench.ratio_verdict("slow", plain["slow"], "fast", plain["fast"])


def test_a_chain_marks_the_pairs_that_waiting_for_a_core_can_explain():
    runs = lambda base: [base + 0.01 * i for i in range(7)]
    spreads = {"a": waited(runs(1), [0] * 7), "b": waited(runs(2), [0.5] * 7), "c": waited(runs(3), [1.5] + [0.1] * 6)}
    verdict = bench.order_verdict(spreads)
    assert verdict == ("fastest to slowest: a < b ~ c (~: this machine cannot separate them; their ranks waited up to "
                       "50% of a run for a core, held by other ranks or processes)")
    assert bench.verdict_relations(verdict) == {("a", "b"), ("a", "c")}
    assert bench.verdicts_agree("fastest to slowest: a < b < c", verdict)
    from test_timing_verdicts import VERDICT
    assert VERDICT.search(verdict)
    # a's runs reaching c's less its waits keep a ~ b too: a `<` claims a faster than every variant after it
    spreads["c"] = waited(runs(3), [2.0] + [0.1] * 6)
    assert bench.order_verdict(spreads).startswith("fastest to slowest: a ~ b ~ c (~: this machine cannot separate "
                                                   "them; their ranks waited up to 67% of a run")


def test_idle_shares_lose_the_share_of_the_step_their_ranks_waited():
    less, more = [0.10, 0.12, 0.11, 0.11, 0.10], [0.30, 0.35, 0.31, 0.32, 0.33]
    small = {"1F1B": bench.share_spread(less, [0.01] * 5), "GPipe": bench.share_spread(more, [0.05] * 5)}
    assert bench.order_verdict(small, ("least idle", "most idle")) == "least idle to most idle: 1F1B < GPipe"
    large = dict(small, GPipe=bench.share_spread(more, [0.05, 0.25, 0.05, 0.05, 0.05]))  # 0.32 - 0.25 < 0.12
    assert bench.order_verdict(large, ("least idle", "most idle")) == ("this machine cannot separate 1F1B and GPipe: "
                                                                       "their ranks waited up to 25% of a run for a "
                                                                       "core, held by other ranks or processes")


def test_waits_are_read_around_each_run_and_survive_the_trip_from_the_ranks():
    samples = bench.interleaved_samples({"a": lambda: None}, repeat=3, warmup=0)["a"]
    waits = [run.waited for run in samples]
    assert waits == [None] * 3 or all(0 <= w <= s for w, s in zip(waits, samples))
    assert [run.waited for run in pickle.loads(pickle.dumps(samples))] == waits
    assert [run.waited for run in (samples + samples)[1:]] == (waits + waits)[1:]  # lists keep them
    assert bench.seconds_waited(None, 5, 1.0) is None
    assert bench.seconds_waited(10**9, 3 * 10**9, 5.0) == 2.0
    assert bench.seconds_waited(0, 9 * 10**9, 2.0) == 2.0  # at most the run


def test_a_loop_that_times_its_own_steps_gets_their_waits_too():
    elapsed = bench.stopwatch()
    run = elapsed()
    assert run >= 0 and (run.waited is None or 0 <= run.waited <= run)


def each_stage_alone(stage, batch, num_micro_batches):  # a schedule enough to be recorded: no hand-offs
    stage(torch.ones(4, 8)).sum().backward()


def test_the_pipeline_recorder_reads_the_waits_around_each_step():
    from utils import pipeline as pp
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one stage, in this process
    try:
        step = pp.record_timelines(0, 1, {"alone": each_stage_alone}, [2], hidden_dim=8, num_layers=2, batch_size=4,
                                   num_steps=1, warmup=0)["alone", 2][0:1]
    finally:
        dist.destroy_process_group()
    if step[0].waited is None:  # not Linux
        assert pp.waited_share(step) is None and pp.waited_seconds(step) is None
        return
    assert step[0].waited >= 0 and 0 <= pp.waited_share(step) <= 1 and pp.waited_seconds(step) == step[0].waited


def test_a_step_of_the_slowest_rank_keeps_what_waiting_added_to_it():
    step = bench.slowest([bench.Seconds(1.0, 0.5), bench.Seconds(2.0, 1.5)])  # without waits, 0.5 on either rank
    assert step == 2.0 and step.waited == 1.5
    step = bench.slowest([bench.Seconds(3.0, 0.0), bench.Seconds(2.5, 0.0)])
    assert step == 3.0 and step.waited == 0.0
    assert bench.slowest([bench.Seconds(1.0, 0.5), 2.0]).waited is None
