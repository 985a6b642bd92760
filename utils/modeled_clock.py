"""A modeled clock (issue 42): a pipeline step's recorded order replayed on a modeled cluster.

Two shared cores cannot show a bubble of a few percent; a model can. What is replayed is what each rank ran, in
the order it ran it (the StepRecords of `utils.pipeline.record_step`, or a schedule's table), so a wrong schedule
gives a wrong timeline. The costs are the planner's (utils.planner), not a second model:

    a computation   its matrix products' FLOPs through the device's roofline (`matmul_seconds`), its element-wise
                    work through its memory (`memory_bound_seconds`)
    a hand-off      one micro-batch's activation (or its gradient) through `message_seconds` on the link the
                    pipeline group crosses (`group_links`); it holds the sender while it travels

and the clock is `utils.pipeline.play`, the player `idle_slots` uses. Two cost models:

- `mlp_costs`: the course's MLP (Linear then GELU, no bias) scaled up: hidden 8192, 32 layers, micro-batches of
  4096 rows in bf16, on 4 H100 SXM in one node (NVLink). Per layer: F = the product x W^T and GELU; B = GELU's
  backward and the input's gradient dz W (none on the model's first layer: the data needs no gradient); W = the
  weights' gradient dz^T x. F, B and W multiply as many FLOPs; B also moves GELU's backward through memory, so
  B > F > W by a few percent.
- `planner_costs`: the planner's transformer, its per-stage F, B and W (step.py) piece by piece, tensor parallel
  inside the stages (notebook 12's 3-D step): the replay of a layout's table and the planner's step time are one
  model used twice (tests/test_modeled_clock.py).

A rank whose collectives overlap its computations (notebooks 02 and 05) is replayed on two streams
(`stream_replay`): its computations in the order it ran them, and its collectives one at a time on the link, each
started and waited for where the rank did (the communication log's clock readings): `data_parallel_replay` for the
all-reduces of 02's syncs, `recorded_fsdp_program` for 05's gathers and reduce-scatters, `fsdp_program` for FSDP2's
order of a planner layout (its step time is the planner's, tests/test_modeled_clock.py).
"""
import dataclasses
import statistics

from utils import planner as pl
from utils.pipeline import Event, play, stage_layers

HIDDEN_DIM, NUM_LAYERS, ROWS = 8192, 32, 4096  # the course's MLP, scaled up
ELEMENT_BYTES = 2  # bf16
GPU, NUM_DEVICES = "H100 SXM", 4


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds of one micro-batch's computations on each piece of the model (piece j runs on rank j % p), and of
    one hand-off between neighbouring pieces."""

    forward: tuple
    input_grad: tuple  # B
    weight_grad: tuple  # W
    hand_off: float  # or one per boundary between pieces j and j + 1 (utils.pipeline.play)
    model: str  # what is modeled, for labels
    cluster: str
    one_way_at_a_time: bool = False  # a boundary's two directions take turns (utils.pipeline.play)

    @property
    def where(self):
        return f"{self.model} on {self.cluster}"

    def seconds(self, kind, piece, split):
        """One computation: F, B or W; a backward not split (`split` False) is B + W."""
        if kind == "F":
            return self.forward[piece]
        b, w = self.input_grad[piece], self.weight_grad[piece]
        return {"B": b if split else b + w, "W": w if split else b + w}[kind]


def mlp_costs(num_pieces, hidden_dim=HIDDEN_DIM, num_layers=NUM_LAYERS, rows=ROWS, gpu=GPU,
              num_devices=NUM_DEVICES, element_bytes=ELEMENT_BYTES):
    """Costs of the course's MLP cut into `num_pieces` pieces by notebook 04's rule (utils.pipeline.stage_layers),
    on `num_devices` devices named `gpu` (utils.planner.cluster), each a pipeline rank, piece j on device j % p;
    the hand-offs on the pipeline group's link."""
    cluster = pl.cluster(gpu, num_devices)
    h, e = hidden_dim, element_bytes
    forward, input_grad, weight, product = mlp_layer_seconds(h, rows, cluster, e)
    counts = [len(layers) for layers in stage_layers(num_layers, num_pieces)]
    link = pl.group_links(cluster, pl.Config(pp=num_devices))["pp"][1]  # every device a pipeline rank
    nodes = "one node" if num_devices <= cluster.devices_per_node else f"nodes of {cluster.devices_per_node}"
    where = (f"the course's MLP at hidden {h}, {num_layers} layers, {rows} rows a micro-batch, bf16",
             f"{num_devices} {gpu} in {nodes} ({'NVLink' if link == cluster.intra else 'InfiniBand'})")
    return Costs(forward=tuple(n * forward for n in counts),
                 input_grad=tuple(n * input_grad - product * (j == 0) for j, n in enumerate(counts)),
                 weight_grad=tuple(n * weight for n in counts),
                 hand_off=pl.message_seconds(rows * h * e, link), model=where[0], cluster=where[1])


def mlp_layer_seconds(hidden_dim, rows, cluster, element_bytes=ELEMENT_BYTES):
    """(F, B, W, product) of one layer of the course's MLP (Linear then GELU, no bias) on `rows` rows, on one device
    of `cluster`: F the product x W^T and GELU; B GELU's backward and the input's gradient dz W (the model's first
    layer has none: subtract `product`); W the weights' gradient dz^T x."""
    h, e = hidden_dim, element_bytes
    product = pl.matmul_seconds(rows, h, h, cluster, element_bytes=e)  # x W^T, dz W: (rows, h) x (h, h)
    weight = pl.matmul_seconds(h, rows, h, cluster, element_bytes=e)  # dz^T x: (h, rows) x (rows, h)
    gelu, gelu_back = (pl.memory_bound_seconds(k * rows * h * e, cluster) for k in (2, 3))  # z in, a out; g, z in, dz
    return product + gelu, product + gelu_back, weight, product


def planner_costs(model, cluster, config):
    """The planner's F, B and W per micro-batch (utils/planner/step.py), piece by piece, for a pipeline with tensor
    (and sequence) parallel inside each stage (cp = ep = 1, no recomputation): each piece's layers
    (stage_layer_counts), each layer's exposed tensor-parallel collectives as step.py counts them (per pass, an
    all-gather and a reduce-scatter of the micro-batch's activations per column/row pair, 2 pairs a layer, on F and
    on B), the output layer and its loss on the last piece (its backward half B, half W, as the planner splits it),
    one hand-off of the micro-batch's activations (1/tp of them) on the pipeline group's link. The data axis (dp,
    ZeRO-0 or 1) syncs once per step, after the pipeline: not a piece's cost (data_parallel_seconds)."""
    c = config
    if (c.cp, c.ep) != (1, 1) or c.recompute != "none" or c.zero_stage > 1 or c.tp_overlap:
        raise ValueError(f"planner_costs replays a pipeline with tensor parallel: cp, ep must be 1, recompute "
                         f"'none', zero_stage 0 or 1, no tp_overlap; got cp={c.cp} ep={c.ep} "
                         f"recompute={c.recompute!r} zero_stage={c.zero_stage} tp_overlap={c.tp_overlap}")
    lt = pl.layer_times(model, cluster, c)
    out_f, out_b = pl.output_layer_seconds(model, cluster, c)
    counts = pl.stage_layer_counts(model.num_layers, c.pp * c.v)
    last = [j == len(counts) - 1 for j in range(len(counts))]
    activations = c.micro_batch_size * model.seq_len * model.dim * model.activation_bytes
    links = pl.group_links(cluster, c)
    tp_link = links["tp"][1]
    pairs = 1 if model.moe else 2  # column/row pairs a layer: attention's, and the MLP's (a MoE's experts: none)
    tp = pairs * sum(pl.collective_seconds(op, c.tp, activations, tp_link) for op in ("all_gather", "reduce_scatter"))
    shape = f", tp={c.tp}" * (c.tp > 1) + f", dp={c.dp}" * (c.dp > 1)
    return Costs(forward=tuple(n * (lt.forward + tp) + out_f * end for n, end in zip(counts, last)),
                 input_grad=tuple(n * (lt.input_grad + tp) + out_b / 2 * end for n, end in zip(counts, last)),
                 weight_grad=tuple(n * lt.weight_grad + out_b / 2 * end for n, end in zip(counts, last)),
                 hand_off=pl.message_seconds(activations / c.tp, links["pp"][1]),
                 model=f"{model.name}, pp={c.pp}, v={c.v}{shape}", cluster=f"{cluster.num_devices} {cluster.gpu}")


def data_parallel_seconds(model, cluster, config, global_batch):
    """The data axis's exposed seconds of a step, once per step (ZeRO-0/1: the gradients' all-reduce or
    reduce-scatter beside the last micro-batch's backward, ZeRO-1's gather of the updated weights): the planner's
    own term (step_seconds' dp), which the replay of the pipeline adds after it."""
    return pl.step_seconds(model, cluster, config, global_batch)["dp"]


def recorded_costs(records, hand_offs, model="the recorded computations", cluster="the measured link",
                   one_way_at_a_time=False):
    """Costs whose computations are the step's own, as recorded (each rank's median F, B and W), and whose
    hand-offs are `hand_offs` (one per boundary): for replaying a step on real hardware whose link, not its
    computations, needs the model (issue 45: two nodes joined by a shaped link). One piece per rank."""
    def per_rank(kind):
        return tuple(statistics.median([e.end - e.start for e in r.events if e.kind == kind] or [0.0]) for r in records)

    split = any(e.kind == "W" for r in records for e in r.events)
    backward = per_rank("B")
    return Costs(forward=per_rank("F"), input_grad=backward if split else tuple(b / 2 for b in backward),
                 weight_grad=per_rank("W") if split else tuple(b / 2 for b in backward),
                 hand_off=tuple(hand_offs), model=model, cluster=cluster, one_way_at_a_time=one_way_at_a_time)


@dataclasses.dataclass
class Clock:
    """A step replayed on the modeled clock."""

    events: list  # per rank, utils.pipeline.Event (start, end in modeled seconds; piece: the rank's chunk)
    sends: list  # per rank, (start, end) of each hand-off it sent
    step: float  # seconds, from the first computation's start to the last hand-off's or computation's end
    busy: list  # per rank, seconds computing

    @property
    def idle(self):
        """Each rank's idle share: 1 - (time it computed) / step (its hand-offs count as idle)."""
        return [1 - b / self.step for b in self.busy]

    @property
    def idle_share(self):
        return 1 - sum(self.busy) / (len(self.busy) * self.step)

    @property
    def hand_off_share(self):
        """The share of the ranks' time spent sending."""
        return sum(end - start for sends in self.sends for start, end in sends) / (len(self.sends) * self.step)


def recorded_order(record):
    """A rank's StepRecord as a table: (kind, chunk, micro-batch) of each computation, in the order they started."""
    return [(e.kind, e.piece, e.micro_batch) for e in sorted(record.events, key=lambda e: e.start)]


def replay(orders, costs=None, num_virtual=1, num_micro_batches=None):
    """Replay one step: `orders` per rank (StepRecords, or tables of (kind, micro-batch) or (kind, chunk,
    micro-batch)) on the modeled clock with `costs` (None: F = B = W = 1, a backward not split 2, free hand-offs:
    notebook 11's slots). Every rank must run, for each of its pieces and each micro-batch, one F and its backward
    (one B, or B and W, or, on the first piece, W alone); otherwise a ValueError names what is missing or repeated,
    before anything is played. Returns a Clock."""
    orders = [recorded_order(o) if hasattr(o, "events") else [a if len(a) == 3 else (a[0], 0, a[1]) for a in o]
              for o in orders]
    p = len(orders)
    m = num_micro_batches if num_micro_batches is not None else 1 + max(i for o in orders for _, _, i in o)
    _check_complete(orders, num_virtual, m)
    kinds = {(r + chunk * p, kind) for r, order in enumerate(orders) for kind, chunk, _ in order}
    split = {piece: (piece, "W") in kinds and (piece, "B") in kinds for piece in range(p * num_virtual)}
    if costs is None:
        seconds = lambda kind, piece, i: 1 if split[piece] or kind == "F" else 2
        hand_off = 0.0
    else:
        if len(costs.forward) != p * num_virtual:
            raise ValueError(f"the costs are for {len(costs.forward)} pieces, the tables for {p} ranks x "
                             f"{num_virtual} = {p * num_virtual}")
        seconds = lambda kind, piece, i: costs.seconds(kind, piece, split[piece])
        hand_off = costs.hand_off
    timelines, sends = play(orders, num_virtual, seconds, hand_off, costs is not None and costs.one_way_at_a_time)
    events = [[Event(kind, i, start, end, chunk) for kind, chunk, i, start, end in t] for t in timelines]
    step = max([e.end for t in events for e in t] + [end for s in sends for _, end in s])
    return Clock(events, sends, step, [sum(e.end - e.start for e in t) for t in events])


def _check_complete(orders, num_virtual, num_micro_batches):
    p = len(orders)
    for r, order in enumerate(orders):
        counts = {}
        for kind, chunk, i in order:
            if not 0 <= chunk < num_virtual:
                raise ValueError(f"rank {r} runs {kind}{i} on chunk {chunk}, but holds {num_virtual} piece(s)")
            counts[kind, chunk, i] = counts.get((kind, chunk, i), 0) + 1
        for chunk in range(num_virtual):
            for i in range(num_micro_batches):
                n = {kind: counts.get((kind, chunk, i), 0) for kind in "FBW"}
                first = r + chunk * p == 0
                backward_ok = (n["B"], n["W"]) in ((1, 0), (1, 1)) or (first and (n["B"], n["W"]) == (0, 1))
                if n["F"] != 1 or not backward_ok:
                    raise ValueError(f"rank {r}, piece {r + chunk * p}, micro-batch {i}: ran F x{n['F']}, B x{n['B']}, "
                                     f"W x{n['W']}; each micro-batch needs one F and one backward (B, or B then W)")



# ---------------------------------------------------------------- ring attention (notebook 09)

def ring_attention_costs(positions, num_heads=32, num_kv_heads=8, head_dim=128, gpu=GPU, element_bytes=2):
    """(seconds, hand_off) of a causal ring attention forward over len(positions) ranks (`positions[r]`: rank r's
    global positions, as utils.ring_attention lays them out), one device of `gpu` each, in one node: seconds[r][t]
    is what rank r computes at ring step t, its queries against rank (r - t) % N's keys, piece pair by piece pair
    as ra.block_attention computes them (QK^T and AV, each through the roofline; none where the mask hides the
    block); hand_off the time of one key/value block to the next rank. Default sizes: Llama 3 8B's attention (32
    query heads, 8 key/value heads of 128), bf16."""
    from utils import ring_attention as ra

    n = len(positions)
    cluster = pl.cluster(gpu, n)
    link = pl.group_links(cluster, pl.Config(cp=n))["cp"][1]

    def block(mine, theirs):
        if not ra.visible(mine, theirs):
            return 0.0
        return sum(2 * pl.matmul_seconds(qb - qa, head_dim, kb - ka, cluster, batch=num_heads,
                                          element_bytes=element_bytes)
                   for (qa, qb), (ka, kb) in ra.visible_pairs(mine, theirs, "causal"))

    seconds = [[block(positions[r], positions[(r - t) % n]) for t in range(n)] for r in range(n)]
    kv_bytes = 2 * len(positions[0]) * num_kv_heads * head_dim * element_bytes
    return seconds, pl.message_seconds(kv_bytes, link)


def ring_replay(seconds, hand_off):
    """A ring's steps on the modeled clock, as utils.ring_attention.ring_attention_forward runs them: at step t
    each rank posts the send of the block it holds to rank + 1 and the receive of the next, computes
    seconds[r][t], and waits for both; a transfer ends `hand_off` after both its ends have posted it. Returns a
    Clock (events: one "F" per step with its computation, micro_batch = the step)."""
    n = len(seconds)
    start, events, sends = [0.0] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    for t in range(n):
        computed = [start[r] + seconds[r][t] for r in range(n)]
        for r in range(n):
            if seconds[r][t]:
                events[r].append(Event("F", t, start[r], computed[r]))
        if t == n - 1:
            start = computed
            break
        sent = [max(start[r], start[(r + 1) % n]) + hand_off for r in range(n)]  # r to r + 1
        for r in range(n):
            sends[r].append((sent[r] - hand_off, sent[r]))
        start = [max(computed[r], sent[r], sent[(r - 1) % n]) for r in range(n)]
    step = max(start)
    return Clock(events, sends, step, [sum(row) for row in seconds])


# ---------------------------------------------------------------- a rank's computations and collectives (02, 05)

@dataclasses.dataclass
class StreamClock:
    """A rank's step on two streams: its computations, and its collectives one at a time in the order it started
    them (a GPU's compute and its network move at once)."""

    compute: list  # (label, start, end), modeled seconds
    communication: list  # (label, start, end)
    step: float  # from the first computation's start to the last computation's or collective's end
    waits: list = dataclasses.field(default_factory=list)  # (label, start, end): the rank held by a collective

    @property
    def busy(self):
        return sum(end - start for _, start, end in self.compute)

    @property
    def exposed(self):
        """The communication the computations did not hide: step - computing."""
        return self.step - self.busy

    @property
    def communicating(self):
        return sum(end - start for _, start, end in self.communication)

    def waited(self, prefix):
        """Seconds the rank was held waiting for the collectives whose labels start with `prefix`."""
        return sum(end - start for label, start, end in self.waits if label.startswith(prefix))


def stream_replay(program):
    """Replay one rank's `program`, in order: ("compute", label, seconds) runs on the rank; ("start", label,
    seconds) hands a collective to the communication stream (asynchronous: it starts when the stream is free,
    after those started before it); ("wait", label) holds the rank until that collective has ended (a blocking
    collective is a start then its wait). Returns a StreamClock."""
    now = free = 0.0
    ends, compute, communication, waits = {}, [], [], []
    for op in program:
        if op[0] == "compute":
            compute.append((op[1], now, now + op[2]))
            now += op[2]
        elif op[0] == "start":
            start = max(now, free)
            free = ends[op[1]] = start + op[2]
            communication.append((op[1], start, free))
        elif op[0] == "wait":
            if op[1] not in ends:
                raise ValueError(f"waits for {op[1]!r} before starting it")
            if ends[op[1]] > now:
                waits.append((op[1], now, ends[op[1]]))
            now = max(now, ends[op[1]])
        else:
            raise ValueError(f"an operation is compute, start or wait, got {op[0]!r}")
    return StreamClock(compute, communication, max([now, free]), waits)


# ---------------------------------------------------------------- data parallel's overlap (notebook 02)

@dataclasses.dataclass(frozen=True)
class Sync:
    """One all-reduce of a data-parallel step, as recorded: its bytes, how many gradients were ready when the rank
    started it and when it waited for it (None: never waited for in the step)."""

    nbytes: int
    started_after: int
    waited_after: int = None


def recorded_syncs(run, step=0):
    """The all-reduces of one step of a utils.data_parallel.DataParallelRun, in the order they started (each call's
    clock reads (gradients ready, phase); a blocking call is waited for where it started), and the parameters'
    indices in the order their gradients were ready."""
    ready_at = run.ready_at[step]
    ready = sorted(ready_at, key=lambda i: ready_at[i][0])
    syncs = [Sync(c.nbytes, c.started_at[0], None if c.waited_at is None else c.waited_at[0])
             for c in run.calls[step] if c.name == "all_reduce"]
    return ready, syncs


@dataclasses.dataclass(frozen=True)
class DataParallelCosts:
    """Seconds of one data-parallel rank's step on a modeled cluster: the forward of each layer, the backward that
    makes each parameter's gradient, and an all-reduce of the recorded bytes times `scale` over the data group."""

    forward: tuple  # by layer
    backward: tuple  # by parameter index
    scale: float  # modeled bytes per recorded byte
    world_size: int
    link: object
    model: str
    cluster: str

    @property
    def where(self):
        return f"{self.model} on {self.cluster}"

    def all_reduce(self, nbytes):
        return pl.collective_seconds("all_reduce", self.world_size, nbytes * self.scale, self.link)


def mlp_data_parallel_costs(num_layers, recorded_weight_bytes, hidden_dim=HIDDEN_DIM, rows=32768, gpu=GPU,
                            num_devices=64, element_bytes=ELEMENT_BYTES):
    """The course's MLP (one weight per layer) scaled up to `hidden_dim`, `rows` rows per rank in bf16, data
    parallel over `num_devices` devices named `gpu` (utils.planner.cluster; the data group's link); each recorded
    weight of `recorded_weight_bytes` stands for one of hidden_dim^2 bf16 values."""
    cluster = pl.cluster(gpu, num_devices)
    h, e = hidden_dim, element_bytes
    forward, input_grad, weight, product = mlp_layer_seconds(h, rows, cluster, e)
    n, link = pl.group_links(cluster, pl.Config(dp=num_devices))["dp"]
    nodes = f"{num_devices // cluster.devices_per_node} nodes of {cluster.devices_per_node}"
    return DataParallelCosts(forward=(forward,) * num_layers,
                             backward=tuple(input_grad + weight - product * (j == 0) for j in range(num_layers)),
                             scale=h * h * e / recorded_weight_bytes, world_size=n, link=link,
                             model=f"the course's MLP at hidden {h}, {num_layers} layers, {rows} rows a rank, bf16",
                             cluster=f"{num_devices} {gpu} in {nodes} "
                                     f"({'NVLink' if link == cluster.intra else 'InfiniBand'})")


def data_parallel_program(ready, syncs, costs):
    """A rank's step as stream_replay's program: each layer's forward, then the backward gradient by gradient in
    the recorded order, each all-reduce started and waited for where it was recorded (after so many gradients
    were ready), the ones never waited for at the end (the optimizer needs them)."""
    program = [("compute", f"F{j}", f) for j, f in enumerate(costs.forward)]
    for k in range(len(ready) + 1):
        if k:
            program.append(("compute", f"B{ready[k - 1]}", costs.backward[ready[k - 1]]))
        program += [("start", f"AR{j}", costs.all_reduce(s.nbytes)) for j, s in enumerate(syncs)
                    if s.started_after == k]
        program += [("wait", f"AR{j}") for j, s in enumerate(syncs) if s.waited_after == k]
    return program + [("wait", f"AR{j}") for j, s in enumerate(syncs) if s.waited_after is None]


def data_parallel_replay(ready, syncs, costs, after_backward=False):
    """The recorded step on the modeled clock; `after_backward`: the same all-reduces, all started after the
    backward and waited for at the end (no overlap)."""
    if after_backward:
        syncs = [Sync(s.nbytes, len(ready), len(ready)) for s in syncs]
    return stream_replay(data_parallel_program(ready, syncs, costs))


# ---------------------------------------------------------------- FSDP's prefetch (notebook 05)

@dataclasses.dataclass(frozen=True)
class FSDPCosts:
    """Seconds of one FSDP (ZeRO-3) rank's step on a modeled cluster, per micro-batch: each layer's forward and
    backward (B + W), the all-gather of one layer's weights and the reduce-scatter of its gradients over the data
    group, the output layer's forward and backward, and the root unit's gather and reduce-scatter (the weights
    outside the layers, FSDP2's root: the planner's root_unit_seconds; utils/planner/step.py)."""

    forward: float
    backward: float
    gather: float
    reduce: float
    output: tuple  # (forward, backward)
    model: str
    cluster: str
    root: tuple = (0.0, 0.0)  # (gather, reduce)

    @property
    def where(self):
        return f"{self.model} on {self.cluster}"


def fsdp_costs(model, cluster, config):
    """The planner's costs of an FSDP layout (zero_stage 3 over dp, tp = pp = cp = ep = 1, no recomputation):
    layer_times, output_layer_seconds, and each layer's weights gathered (param_bytes a parameter) and its
    gradients reduce-scattered (grad_bytes) through collective_seconds on the data group's link."""
    c = config
    if (c.tp, c.pp, c.cp, c.ep, c.zero_stage) != (1, 1, 1, 1, 3) or c.recompute != "none":
        raise ValueError(f"fsdp_costs replays FSDP alone: zero_stage 3, tp, pp, cp, ep 1, recompute 'none'; got "
                         f"zero_stage={c.zero_stage} tp={c.tp} pp={c.pp} cp={c.cp} ep={c.ep} recompute={c.recompute!r}")
    lt = pl.layer_times(model, cluster, c)
    n, link = pl.group_links(cluster, c)["dp"]
    gather, reduce = (pl.collective_seconds(op, n, model.layer_dense_params * nbytes, link)
                      for op, nbytes in (("all_gather", model.param_bytes), ("reduce_scatter", model.grad_bytes)))
    nodes = "one node" if n <= cluster.devices_per_node else f"{n // cluster.devices_per_node} nodes"
    return FSDPCosts(lt.forward, lt.input_grad + lt.weight_grad, gather, reduce,
                     pl.output_layer_seconds(model, cluster, c), f"{model.name}, FSDP over {n}, {c.micro_batch_size} "
                     f"sequence(s) of {model.seq_len} a rank", f"{cluster.num_devices} {cluster.gpu} in {nodes} "
                     f"({'NVLink' if link == cluster.intra else 'InfiniBand'})",
                     pl.root_unit_seconds(model, c, n, link).get(0, (0.0, 0.0)))


def fsdp_program(num_layers, costs, prefetch=True):
    """A rank's FSDP step as FSDP2 runs it, as stream_replay's program: the root unit gathered first, then forward,
    each layer's weights gathered
    (with `prefetch`, the next layer's started before this one's compute), the output layer, then backward in
    reverse, each layer gathered again (with `prefetch`, the first one beside the output layer's backward, the
    next one before this one's compute) and its gradients reduce-scattered asynchronously after its compute, the
    root's last, all waited for at the end."""
    L, program = num_layers, [("start", "AG root", costs.root[0]), ("wait", "AG root")]  # before anything runs
    for u in range(L):
        program += [("start", f"AG{v}", costs.gather) for v in ((u, u + 1) if prefetch and u == 0 else
                                                               (u + 1,) if prefetch else (u,)) if v < L]
        program += [("wait", f"AG{u}"), ("compute", f"F{u}", costs.forward)]
    program.append(("compute", "out F", costs.output[0]))
    if prefetch:
        program.append(("start", f"AG{L - 1}'", costs.gather))
    program.append(("compute", "out B", costs.output[1]))
    for u in reversed(range(L)):
        program += [("start", f"AG{v}'", costs.gather) for v in ((u - 1,) if prefetch else (u,)) if v >= 0]
        program += [("wait", f"AG{u}'"), ("compute", f"B{u}", costs.backward), ("start", f"RS{u}", costs.reduce)]
    program.append(("start", "RS root", costs.root[1]))  # after the last gradient
    return program + [("wait", f"RS{u}") for u in range(L)] + [("wait", "RS root")]


def recorded_fsdp_program(run, costs, step=1):
    """A rank's recorded FSDP step (a utils.fsdp.Run: its collectives stamped with the Moment they started and were
    waited for, and each unit a layer asked for) as stream_replay's program: at each ask, the all-gathers started
    then and the waits done then, the unit's computation (its forward or backward, one layer of `costs` a unit),
    then the reduce-scatters started then (and waited for then, if they block); the output layer between forward
    and backward; what is never waited for, at the end. The modeled model's root unit (its embedding and output
    layer, which the course's MLP does not have) is gathered and reduce-scattered as fsdp_program does it: first
    and last, so that your order and FSDP2's are compared on the same model."""
    calls = [c for c in run.calls if c.started_at.step == step]
    label = {id(c): f"{'RS' if c.name.startswith('reduce_scatter') else 'AG'}{k}" for k, c in enumerate(calls)}
    gathers = [c for c in calls if c.name.startswith("all_gather")]
    reduces = [c for c in calls if c.name.startswith("reduce_scatter")]
    program, backward = [("start", "AG root", costs.root[0]), ("wait", "AG root")], False
    for use in [u for u in run.uses if u.asked.step == step]:
        t = use.asked.tick
        if use.asked.phase == "backward" and not backward:
            program += [("compute", "out F", costs.output[0]), ("compute", "out B", costs.output[1])]
            backward = True
        program += [("start", label[id(c)], costs.gather) for c in gathers if c.started_at.tick == t]
        program += [("wait", label[id(c)]) for c in gathers if c.waited_at is not None and c.waited_at.tick == t]
        program.append(("compute", f"{'B' if backward else 'F'}{use.unit}", costs.backward if backward else
                        costs.forward))
        program += [("start", label[id(c)], costs.reduce) for c in reduces if c.started_at.tick == t]
        program += [("wait", label[id(c)]) for c in reduces if c.waited_at is not None and c.waited_at.tick == t]
    program.append(("start", "RS root", costs.root[1]))
    return program + [("wait", label[id(c)]) for c in calls if c.waited_at is None or c.waited_at.step != step] + [
        ("wait", "RS root")]
