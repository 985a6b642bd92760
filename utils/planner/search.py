"""The search: every split that divides evenly, its memory per device (the stage that needs the most) and its
step time; those that fit, fastest first."""
import itertools
import operator

from utils.planner.describe import GB, RECOMPUTE, Config, check_config
from utils.planner.memory import model_state_bytes, peak_total
from utils.planner.step import _step_seconds

SCHEDULE_CHOICES = (("1F1B", 1), ("interleaved", 2), ("interleaved", 4), ("ZB-H1", 1))


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def configs(model, cluster, global_batch, micro_batch_sizes=(1, 2, 4, 8), recomputes=RECOMPUTE,
            zero_stages=(1, 3), schedules=SCHEDULE_CHOICES, settings=None):
    """Every Config that check_config accepts, from the given choices."""
    return [config for config, _ in _valid(model, cluster, global_batch, micro_batch_sizes, recomputes, zero_stages,
                                           schedules, settings)]


def _valid(model, cluster, global_batch, micro_batch_sizes=(1, 2, 4, 8), recomputes=RECOMPUTE, zero_stages=(1, 3),
           schedules=SCHEDULE_CHOICES, settings=None):
    """(config, micro-batches) for every valid config. The sizes check_config would refuse are skipped by
    arithmetic first (the search's cost is here: tests check that both agree); recomputation and the ZeRO stage
    never make a split invalid. Without a pipeline, one schedule; ZB-H1 where m >= p (its formula's range); context
    parallel only with flash (blockwise) attention, as the ring computes it. settings: Config fields that are not
    choices of the search but what the run's framework does (sequence_parallel, fused, float8, prefetch, ...), the
    same for every config: a layout is priced as that framework would run it."""
    fields = vars(Config(**(settings or {})))  # every field but the search's choices: the framework's settings
    n = cluster.num_devices
    ns = divisors(n)
    tps = [t for t in ns if model.num_heads % t == 0 and model.ffn_dim % t == 0
           and (model.kv_heads % t == 0 or t % model.kv_heads == 0)]
    # Context parallel is ring attention, which is blockwise: each hop's block of scores is computed and folded into
    # the output by an online softmax, never kept (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
    # section 3; Megatron-Core runs it only on TransformerEngine's flash/fused attention: its context-parallel docs).
    # A model whose attention keeps the s x s scores (flash_attention False) has no ring to run: cp 1 only.
    cps = [c for c in ns if model.seq_len % c == 0 and (c == 1 or model.flash_attention)]
    pps = [p for p in ns if p <= model.num_layers]
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if n % (tp * pp * cp) or (model.seq_len // cp) % tp:
            continue
        dp = n // (tp * pp * cp)
        eps = [e for e in ns if (dp * cp) % e == 0 and model.num_experts % e == 0]  # divisors of dp cp, which divides n
        for ep, mbs, (schedule, v) in itertools.product(eps, micro_batch_sizes, schedules):
            if (pp == 1 and (schedule, v) != schedules[0]) or pp * v > model.num_layers:
                continue
            if global_batch % (dp * mbs):
                continue
            m = global_batch // (dp * mbs)
            if (schedule == "interleaved" and m % pp) or (schedule == "ZB-H1" and m < pp):
                continue  # ZB-H1 below m = p is played exactly (estimate), too slowly for a search
            for recompute, zero in itertools.product(recomputes, zero_stages):
                yield _config(fields, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch_size=mbs, recompute=recompute,
                              zero_stage=zero, schedule=schedule, v=v), m


def _config(fields, **choices):
    """Config(**fields | choices), as the dataclass's __init__ builds it (Config has no __post_init__ to run: a
    test checks it, and that the search's configs equal those built by Config) in half the time: a frozen
    dataclass sets each of its 25 fields through object.__setattr__ (2.5 µs a config)."""
    config = object.__new__(Config)
    config.__dict__.update(fields, **choices)
    return config


def estimate(model, cluster, global_batch, config):
    """One row of the plan: the config, its memory per device and its step time, as a dict."""
    return _estimate(model, cluster, global_batch, config, check_config(model, cluster, global_batch, config))


def _estimate(model, cluster, global_batch, config, m, peak=None, only_fitting=False):
    """The row; without step times if it does not fit and only_fitting. `peak`: peak_total's, if known."""
    stage, total = peak or peak_total(model, config, m)
    row = vars(config).copy()  # one dict, filled in place: a search builds 24,000 of them
    row["micro_batches"], row["memory_gb"], row["memory_stage"] = m, total / GB, stage
    row["fits"] = total <= cluster.memory_bytes
    if only_fitting and not row["fits"]:
        return row
    seconds = _step_seconds(model, cluster, config, global_batch, m)
    for k, name in _TIMES.items():
        row[name] = seconds[k]
    row["mfu"], row["tflops"] = seconds["mfu"], seconds["flops_per_device"] / 1e12
    row["tokens_per_s"] = global_batch * model.seq_len / seconds["step"]
    return row


_TIMES = {k: f"{k}_s" for k in ("compute", "tp", "cp", "ep", "pp", "dp", "bubble", "optimizer", "exposed", "step")}


_SPLIT = operator.attrgetter("dp", "tp", "pp", "cp", "ep", "zero_stage", "v")  # what the model states depend on
_KNOBS = operator.attrgetter("micro_batch_size", "recompute", "cp_mode", "tp_overlap")  # the rest but the schedule
_SCHEDULES_SHARE = operator.attrgetter("dp", "tp", "pp", "cp", "ep", "micro_batch_size")  # _valid yields them together


def _rows(model, cluster, global_batch, choices, only_fitting):
    """A row for every valid config (only those that fit, with only_fitting). Two shortcuts, neither changing a
    row: a config whose model states alone (on the first pipeline rank, whose memory peak_memory always counts)
    exceed the device is left out of a search for fitting ones, without its activations counted; and a schedule's
    memory is the one its pieces per rank v already had under another schedule (1F1B and ZB-H1 hold as many
    micro-batches in flight: memory.py), counted once. Step times are computed for fitting configs only.
    The memories are kept only while _valid yields the schedules of one split and micro-batch size, the only configs
    that share them: a search's worth of them kept would make Python's garbage collector scan the whole heap once
    more (0.2 s of a 405B search's 2 s)."""
    states, memories, rows, schedules_of = {}, {}, [], None
    for config, m in _valid(model, cluster, global_batch, **choices):
        split = _SPLIT(config)
        if only_fitting:
            if split not in states:
                states[split] = sum(model_state_bytes(model, config, 0).values())
            if states[split] > cluster.memory_bytes:
                continue
        if _SCHEDULES_SHARE(config) != schedules_of:
            schedules_of = _SCHEDULES_SHARE(config)
            memories.clear()
        key = (split, _KNOBS(config), m)
        peak = memories.get(key)
        if peak is None:
            peak = memories[key] = peak_total(model, config, m)
        row = _estimate(model, cluster, global_batch, config, m, peak, only_fitting)
        if row["fits"] or not only_fitting:
            rows.append(row)
    return rows


def estimates(model, cluster, global_batch, micro_batch_sizes=(1, 2, 4, 8), recomputes=RECOMPUTE,
              zero_stages=(1, 3), schedules=SCHEDULE_CHOICES, settings=None):
    """A row for every valid configuration (the choices as `configs`'), fitting in memory or not."""
    choices = dict(micro_batch_sizes=micro_batch_sizes, recomputes=recomputes, zero_stages=zero_stages,
                   schedules=schedules, settings=settings)
    return _rows(model, cluster, global_batch, choices, only_fitting=False)


def plan(model, cluster, global_batch, **choices):
    """The configurations that fit in memory, fastest step first (ties: less memory first)."""
    rows = _rows(model, cluster, global_batch, choices, only_fitting=True)
    return sorted(rows, key=lambda r: (r["step_s"], r["memory_gb"]))


COLUMNS = ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "micro_batches", "schedule", "v", "recompute",
           "zero_stage", "memory_gb", "step_s", "mfu", "compute_s", "tp_s", "cp_s", "ep_s", "pp_s", "dp_s", "bubble_s")


def format_rows(rows, columns=COLUMNS):
    """A fixed-width table of the rows, numbers rounded: what a notebook prints."""
    short = {"micro_batch_size": "mbs", "micro_batches": "m", "zero_stage": "zero", "recompute": "recomp",
             "schedule": "sched"}
    heads = [short.get(c, c) for c in columns]

    def cell(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    table = [heads] + [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in table)
