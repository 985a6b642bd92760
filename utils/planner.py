"""The planner (notebook 12, section 5): memory per device and time per step of every way to split a training run.

    model + cluster + global batch -> for each (dp, tp, pp, cp, ep, micro-batch size, recompute, ZeRO stage):
        memory per device = parameters + gradients + optimizer states (+ a gathered FSDP unit) + activations
        step time         = compute + tensor/expert/pipeline communication + bubble + what data/context-parallel
                            communication the compute does not hide
    -> the configurations that fit in memory, fastest first.

Every formula is the course's (its notebook or handout named where it is used), or Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", for activations. The mesh is (pp, dp, cp, tp),
tp innermost: a group whose ranks fit in one node talks over the intra-node link (NVLink), any other over the
inter-node one (InfiniBand). Experts borrow their axis from the data axis (dp x cp), as Megatron-Core and
torchtitan do: ep divides dp * cp, and each expert's copies form a data group of dp * cp / ep ranks.

An estimate, not a simulator: communication is alpha-beta (notebook 01), compute is FLOPs at an assumed MFU,
and the stated overlaps are assumed, not measured.
"""
import dataclasses
import itertools

from utils.sizes import check_int, divide

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
BACKENDS = ("ring", "gloo")
GB = 1e9


# ---------------------------------------------------------------- what is planned: a model, a cluster, a split

@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder-only transformer. Bytes per parameter default to the ZeRO paper's mixed precision (2 bf16 weight,
    2 bf16 gradient, 12 fp32 master weight + Adam's two moments: notebook 05); activations in 16 bits."""

    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    seq_len: int
    vocab_size: int
    num_kv_heads: int = 0  # 0: as many as num_heads (no grouped-query attention)
    num_experts: int = 1  # 1: dense; more: every layer's MLP is a mixture of experts
    top_k: int = 1
    ffn_matrices: int = 2  # the course's w1, GELU, w2; Llama's SwiGLU has 3
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    activation_bytes: int = 2
    name: str = "model"

    def __post_init__(self):
        for field in ("num_layers", "dim", "num_heads", "ffn_dim", "seq_len", "vocab_size", "num_experts", "top_k",
                      "ffn_matrices", "param_bytes", "grad_bytes", "activation_bytes"):
            check_int(field, getattr(self, field))
        check_int("optimizer_bytes", self.optimizer_bytes, 0)  # 0: plain SGD
        check_int("num_kv_heads", self.num_kv_heads, 0)
        divide("dim", self.dim, "num_heads", self.num_heads, "every head gets dim / num_heads features")
        divide("num_heads", self.num_heads, "num_kv_heads", self.kv_heads, "query heads share key/value heads evenly")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}")

    @property
    def kv_heads(self):
        return self.num_kv_heads or self.num_heads

    @property
    def kv_dim(self):
        return self.kv_heads * self.dim // self.num_heads

    @property
    def moe(self):
        return self.num_experts > 1

    # parameters, counted layer by layer (utils/transformer.py's names)
    @property
    def attention_params(self):
        return 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim  # wq, wo; wk, wv (smaller under GQA)

    @property
    def expert_params(self):
        return self.ffn_matrices * self.dim * self.ffn_dim  # one MLP

    @property
    def layer_dense_params(self):
        """A layer's weights outside its experts: attention, two norms, the router of a MoE layer (or the MLP of a
        dense layer, which has one 'expert' that every rank holds)."""
        router = self.dim * self.num_experts if self.moe else 0
        mlp = 0 if self.moe else self.expert_params
        return self.attention_params + 2 * self.dim + router + mlp

    @property
    def layer_expert_params(self):
        return self.num_experts * self.expert_params if self.moe else 0

    @property
    def num_params(self):
        """Every parameter: layers, tok_embeddings, the final norm and output (not tied)."""
        layer = self.layer_dense_params + self.layer_expert_params
        return self.num_layers * layer + 2 * self.vocab_size * self.dim + self.dim

    @property
    def active_params(self):
        """The parameters one token goes through: top_k of the experts (the course's 6 P FLOPs per token uses these)."""
        idle = (self.num_experts - self.top_k) * self.expert_params if self.moe else 0
        return self.num_params - self.num_layers * idle


@dataclasses.dataclass(frozen=True)
class Link:
    """A link of the alpha-beta model (notebook 01): a message of S bytes takes alpha + S / beta seconds."""

    alpha: float  # seconds
    beta: float  # bytes per second, per device


@dataclasses.dataclass(frozen=True)
class Cluster:
    num_devices: int
    devices_per_node: int
    memory_bytes: float
    intra: Link  # within a node (NVLink)
    inter: Link  # between nodes (InfiniBand), per device
    peak_flops: float  # per device, in the training's precision
    mfu: float = 0.5  # the share of peak the computation reaches: an assumption, stated with every answer

    def __post_init__(self):
        check_int("num_devices", self.num_devices)
        check_int("devices_per_node", self.devices_per_node)
        if self.num_devices > self.devices_per_node:
            divide("num_devices", self.num_devices, "devices_per_node", self.devices_per_node, "nodes are whole")
        for name, value in (("memory_bytes", self.memory_bytes), ("peak_flops", self.peak_flops),
                            ("intra.beta", self.intra.beta), ("inter.beta", self.inter.beta)):
            _check_positive(name, value)
        for name, value in (("intra.alpha", self.intra.alpha), ("inter.alpha", self.inter.alpha)):
            _check_positive(name, value, allow_zero=True)
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")


@dataclasses.dataclass(frozen=True)
class Config:
    dp: int = 1
    tp: int = 1  # always with sequence parallel outside the column/row pairs (Korthikanti et al.)
    pp: int = 1  # 1F1B
    cp: int = 1  # ring attention
    ep: int = 1  # borrowed from the data axis dp * cp
    micro_batch_size: int = 1  # sequences
    recompute: str = "none"
    zero_stage: int = 1  # over the data axis dp * cp; 3 is FSDP


def _check_positive(name, value, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value}")


def check_config(model, cluster, global_batch, config):
    """The number of micro-batches per step, if `config` splits `model` on `cluster` evenly; else a ValueError
    that names what does not divide."""
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size"):
        check_int(name, getattr(config, name))
    check_int("global_batch", global_batch)
    if config.recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {config.recompute!r}")
    if config.zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {config.zero_stage!r}")
    mesh = config.dp * config.tp * config.pp * config.cp
    if mesh != cluster.num_devices:
        raise ValueError(f"the mesh dp x tp x pp x cp = {config.dp} x {config.tp} x {config.pp} x {config.cp} = {mesh} "
                         f"is not the number of devices, {cluster.num_devices}")
    divide("num_heads", model.num_heads, "tp", config.tp, "each tensor-parallel rank computes whole heads")
    divide("num_kv_heads", model.kv_heads, "tp", config.tp, "each tensor-parallel rank holds whole key/value heads")
    divide("ffn_dim", model.ffn_dim, "tp", config.tp, "each tensor-parallel rank holds as many MLP features")
    divide("num_layers", model.num_layers, "pp", config.pp, "every pipeline stage holds as many layers")
    local_seq = divide("seq_len", model.seq_len, "cp", config.cp, "every context-parallel rank holds a chunk")
    divide("seq_len / cp", local_seq, "tp", config.tp, "sequence parallel splits each rank's chunk over tp")
    divide("dp x cp", config.dp * config.cp, "ep", config.ep, "expert parallel borrows its ranks from the data axis")
    divide("num_experts", model.num_experts, "ep", config.ep, "every expert-parallel rank holds as many experts")
    replica_batch = divide("global_batch", global_batch, "dp", config.dp, "every data-parallel replica gets as many")
    return divide("global_batch / dp", replica_batch, "micro_batch_size", config.micro_batch_size,
                  "a replica's batch is a whole number of micro-batches")


# ---------------------------------------------------------------- memory per device (the first pipeline stage)

def zero_sharded_bytes(num_params, model, data_ranks, zero_stage):
    """{parameters, gradients, optimizer states} in bytes for num_params parameters on a data axis of data_ranks
    (notebook 05's table): ZeRO-1 shards the optimizer states, ZeRO-2 the gradients too, ZeRO-3 (FSDP) all three."""
    def share(stage):
        return num_params / data_ranks if zero_stage >= stage else num_params
    return {"parameters": share(3) * model.param_bytes, "gradients": share(2) * model.grad_bytes,
            "optimizer states": share(1) * model.optimizer_bytes}


def stage_params(model, config):
    """(dense, experts): the parameters of the first pipeline stage on one device. Dense weights are split over tp
    (notebook 03: column and row shards; the norms are small and counted as split too), experts over ep; the
    stage holds num_layers / pp layers and tok_embeddings (and output and the final norm when pp = 1)."""
    layers = model.num_layers // config.pp
    embeddings = model.vocab_size * model.dim + (model.vocab_size * model.dim + model.dim) * (config.pp == 1)
    dense = (layers * model.layer_dense_params + embeddings) / config.tp
    experts = layers * model.layer_expert_params / config.ep
    return dense, experts


def model_state_bytes(model, config):
    """Parameters, gradients and optimizer states on one device; under FSDP, plus one gathered layer."""
    dense, experts = stage_params(model, config)
    data = config.dp * config.cp  # cp ranks hold the same weights: their gradients are summed with dp's
    state = zero_sharded_bytes(dense, model, data, config.zero_stage)
    for group, value in zero_sharded_bytes(experts, model, data // config.ep, config.zero_stage).items():
        state[group] += value
    layer = model.layer_dense_params / config.tp + model.layer_expert_params / config.ep
    state["gathered"] = layer * model.param_bytes if config.zero_stage == 3 else 0
    return state


def layer_activation_bytes(model, config):
    """Bytes one layer keeps for backward, per micro-batch (Korthikanti et al. 2022, eq. 2-5 and Table 2, for 16-bit
    activations; s = seq_len / cp the context-parallel chunk, b the micro-batch, h, a heads, t = tp with sequence
    parallel): none sbh(34 + 5as/h)/t; selective (attention's softmax recomputed) 34sbh/t; full, the layer's input
    only, 2sbh/t. Written for a dense MLP of 4h features; a MoE layer is counted the same (an approximation)."""
    s, b, h, a, t = model.seq_len / config.cp, config.micro_batch_size, model.dim, model.num_heads, config.tp
    per_element = {"none": 34 + 5 * a * s / h, "selective": 34, "full": 2}[config.recompute]
    return s * b * h * per_element / t * model.activation_bytes / 2


def micro_batches_in_flight(config, num_micro_batches):
    """1F1B keeps pp micro-batches' activations on its first stage (fewer if there are fewer); without a pipeline,
    gradient accumulation keeps one (notebook 04)."""
    return min(config.pp, num_micro_batches)


def activation_bytes(model, config, num_micro_batches):
    """The first stage's activations at their peak: its layers' for every micro-batch in flight; with full
    recomputation, plus one layer recomputed in full during its backward."""
    layers = model.num_layers // config.pp
    kept = micro_batches_in_flight(config, num_micro_batches) * layers * layer_activation_bytes(model, config)
    if config.recompute == "full":
        kept += layer_activation_bytes(model, dataclasses.replace(config, recompute="none"))
    return kept


def memory_per_device(model, config, num_micro_batches):
    """{parameters, gradients, optimizer states, gathered, activations, total} in bytes, on the first stage."""
    memory = model_state_bytes(model, config)
    memory["activations"] = activation_bytes(model, config, num_micro_batches)
    memory["total"] = sum(memory.values())
    return memory


# ---------------------------------------------------------------- communication: bytes and alpha-beta time

def collective_bytes(op, world_size, size, backend="ring"):
    """Bytes each rank sends in one collective over world_size ranks, `size` the whole tensor (an all-reduce's
    input, an all-gather's output, a reduce-scatter's input, an all-to-all's input). Ring (notebook 01; NCCL):
    all-reduce 2(N-1)/N S, all-gather, reduce-scatter and all-to-all (N-1)/N S; a send S. Gloo, measured at the
    sockets in notebook 01: the same, except that its reduce-scatter all-reduces and keeps one chunk, 2(N-1)/N S."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if op == "send":
        return size
    n = world_size
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "all_to_all": (n - 1) / n,
              "reduce_scatter": (2 if backend == "gloo" else 1) * (n - 1) / n}[op]
    return factor * size


def collective_seconds(op, world_size, size, link):
    """Alpha-beta time of a ring collective (notebook 01): all-reduce 2(N-1) alpha + 2(N-1)/N S / beta; all-gather,
    reduce-scatter, all-to-all (N-1) alpha + (N-1)/N S / beta; a send alpha + S / beta."""
    if world_size == 1 and op != "send":
        return 0.0
    steps = {"send": 1, "all_reduce": 2 * (world_size - 1)}.get(op, world_size - 1)
    return steps * link.alpha + collective_bytes(op, world_size, size) / link.beta


def group_link(cluster, stride, size):
    """The link a group of `size` ranks, `stride` apart on the mesh, runs at: intra-node when its ranks span at most
    one node's devices (inner axes first), inter-node otherwise."""
    return cluster.intra if stride * size <= cluster.devices_per_node else cluster.inter


def group_links(cluster, config):
    """{group: (size, link)} on the mesh (pp, dp, cp, tp), tp innermost; the data group is dp x cp, the expert
    group ep consecutive ranks of it."""
    c = config
    return {"tp": (c.tp, group_link(cluster, 1, c.tp)), "cp": (c.cp, group_link(cluster, c.tp, c.cp)),
            "ep": (c.ep, group_link(cluster, c.tp, c.ep)), "dp": (c.dp * c.cp, group_link(cluster, c.tp, c.dp * c.cp)),
            "pp": (c.pp, group_link(cluster, c.tp * c.cp * c.dp, c.pp))}


def flops_per_token(model):
    """(the weights' 6 P_active, attention's 12 L s h): the course's training FLOPs per token, forward and backward
    (6 P from the matrix products; attention's scores and their use over the whole sequence, Narayanan et al. 2021)."""
    return 6 * model.active_params, 12 * model.num_layers * model.seq_len * model.dim


def compute_seconds(model, cluster, config, global_batch):
    """(all, attention's part) of the step's compute on one device: FLOPs over every device at the assumed MFU,
    4/3 of them with full recomputation (one more forward)."""
    weights, attention = flops_per_token(model)
    scale = global_batch * model.seq_len * (4 / 3 if config.recompute == "full" else 1)
    scale /= cluster.num_devices * cluster.peak_flops * cluster.mfu
    return (weights + attention) * scale, attention * scale


def step_seconds(model, cluster, config, global_batch):
    """{compute, tp, cp, ep, pp, bubble, dp, exposed, step} in seconds, for one device of the first stage.

    tp: per layer, micro-batch and pass, each column/row pair is an all-gather plus a reduce-scatter of the
        micro-batch's activations b (s/cp) h (notebook 09, sequence parallel); two pairs per dense layer, one (the
        attention's) per MoE layer. Passes: forward, backward, and the forward again under full recomputation.
    cp: ring attention (notebook 09): keys and values, 2 b (s/cp) kv_dim/tp each, make cp-1 hops forward, and they
        and their gradients 2cp-1 backward; overlapped with the attention's compute only (the blocks it computes
        while the next keys travel): what that does not hide counts.
    ep: per MoE layer, micro-batch and pass, two all-to-alls (dispatch, combine) of the rank's b s/(cp tp) tokens'
        top_k copies (notebook 10).
    pp: each micro-batch's activations forward and gradient backward, b (s/cp) h/tp each (notebook 04);
        bubble: (pp-1)/m of the micro-batches' time (1F1B: (p-1)/(m+p-1) of the step).
    dp: once per step over dp x cp (and dp x cp/ep for experts): ZeRO-0 an all-reduce of the gradients, ZeRO-1/2
        a reduce-scatter and an all-gather of the weights, ZeRO-3 two all-gathers and a reduce-scatter
        (notebook 05); overlapped with the whole compute (buckets, prefetch): what that does not hide counts, and
        at least one layer's share (the first gather comes before any compute, the last gradients after it all).
        cp likewise: at least each layer's last hop home.
    tp, ep and pp transfers are on the critical path: not overlapped.
    """
    return _step_seconds(model, cluster, config, global_batch, check_config(model, cluster, global_batch, config))


def _step_seconds(model, cluster, config, global_batch, m):
    links, c = group_links(cluster, config), config
    layers = model.num_layers // c.pp
    passes = 3 if c.recompute == "full" else 2
    s_local = model.seq_len // c.cp
    e = model.activation_bytes
    activations = c.micro_batch_size * s_local * model.dim * e

    def seconds(group, op, size):
        n, link = links[group]
        return collective_seconds(op, n, size, link) if n > 1 else 0.0

    pairs = 1 if model.moe else 2
    tp_pair = seconds("tp", "all_gather", activations) + seconds("tp", "reduce_scatter", activations)
    t = {}
    t["compute"], attention = compute_seconds(model, cluster, config, global_batch)
    t["tp"] = m * layers * passes * pairs * tp_pair
    kv_block = 2 * c.micro_batch_size * s_local * model.kv_dim // c.tp * e
    hops = (c.cp - 1) * (passes - 1) + (2 * c.cp - 1)
    t["cp"] = m * layers * hops * seconds("cp", "send", kv_block)
    tokens = c.micro_batch_size * s_local // c.tp
    dispatch = seconds("ep", "all_to_all", tokens * model.top_k * model.dim * e) if model.moe else 0.0
    t["ep"] = m * layers * passes * 2 * dispatch
    t["pp"] = 2 * m * seconds("pp", "send", activations // c.tp)
    t["bubble"] = (c.pp - 1) / m * (t["compute"] + t["tp"] + t["ep"])
    t["dp"] = data_parallel_seconds(model, c, links)
    first_and_last = t["dp"] / layers  # FSDP's first gather before any compute, the last layer's gradients after
    last_hops = m * layers * seconds("cp", "send", kv_block)  # each backward's gradients' hop home, after the compute
    t["exposed"] = max(t["dp"] - t["compute"], first_and_last) + max(t["cp"] - attention, last_hops)
    t["step"] = t["compute"] + t["tp"] + t["ep"] + t["pp"] + t["bubble"] + t["exposed"]
    return t


def data_parallel_collectives(zero_stage):
    """[(op, what)] each step on the data axis (notebook 05): what = 'gradients' or 'parameters'."""
    sharded = [("reduce_scatter", "gradients"), ("all_gather", "parameters")]
    return {0: [("all_reduce", "gradients")], 1: sharded, 2: sharded,
            3: [("all_gather", "parameters")] + sharded[::-1]}[zero_stage]


def data_parallel_seconds(model, config, links):
    dense, experts = stage_params(model, config)
    n, link = links["dp"]
    expert_link = link  # an expert's copies are ep ranks apart along the data axis: they span it as its group does
    total = 0.0
    for op, what in data_parallel_collectives(config.zero_stage):
        per_param = model.grad_bytes if what == "gradients" else model.param_bytes
        total += collective_seconds(op, n, dense * per_param, link)
        total += collective_seconds(op, n // config.ep, experts * per_param, expert_link) if experts else 0.0
    return total


# ---------------------------------------------------------------- the plan

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def configs(model, cluster, global_batch, micro_batch_sizes=(1, 2, 4, 8), recomputes=RECOMPUTE,
            zero_stages=(1, 3)):
    """Every Config that check_config accepts, from the given choices."""
    return [config for config, _ in _valid(model, cluster, global_batch, micro_batch_sizes, recomputes, zero_stages)]


def _valid(model, cluster, global_batch, micro_batch_sizes, recomputes, zero_stages):
    """(config, micro-batches) for every valid config: each split is checked once, since recomputation and the
    ZeRO stage never make one invalid."""
    n = cluster.num_devices
    for tp, pp, cp in itertools.product(divisors(n), repeat=3):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        for ep, mbs in itertools.product(divisors(dp * cp), micro_batch_sizes):
            try:
                m = check_config(model, cluster, global_batch, Config(dp, tp, pp, cp, ep, mbs))
            except ValueError:
                continue
            for recompute, zero in itertools.product(recomputes, zero_stages):
                yield Config(dp, tp, pp, cp, ep, mbs, recompute, zero), m


def estimate(model, cluster, global_batch, config):
    """One row of the plan: the config, its memory per device and its step time, as a dict."""
    return _estimate(model, cluster, global_batch, config, check_config(model, cluster, global_batch, config))


def _estimate(model, cluster, global_batch, config, m):
    memory = memory_per_device(model, config, m)
    seconds = _step_seconds(model, cluster, config, global_batch, m)
    row = dict(vars(config)) | {"micro_batches": m, "memory_gb": memory["total"] / GB,
                                "fits": memory["total"] <= cluster.memory_bytes}
    row |= {f"{k}_s": v for k, v in seconds.items()}
    row["tokens_per_s"] = global_batch * model.seq_len / seconds["step"]
    return row


def estimates(model, cluster, global_batch, micro_batch_sizes=(1, 2, 4, 8), recomputes=RECOMPUTE,
              zero_stages=(1, 3)):
    """A row for every valid configuration (the choices as `configs`'), fitting in memory or not."""
    return [_estimate(model, cluster, global_batch, config, m)
            for config, m in _valid(model, cluster, global_batch, micro_batch_sizes, recomputes, zero_stages)]


def plan(model, cluster, global_batch, **choices):
    """The configurations that fit in memory, fastest step first (ties: less memory first)."""
    rows = estimates(model, cluster, global_batch, **choices)
    return sorted((r for r in rows if r["fits"]), key=lambda r: (r["step_s"], r["memory_gb"]))


COLUMNS = ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "micro_batches", "recompute", "zero_stage",
           "memory_gb", "step_s", "compute_s", "tp_s", "pp_s", "bubble_s", "ep_s", "dp_s", "cp_s", "exposed_s")


def format_rows(rows, columns=COLUMNS):
    """A fixed-width table of the rows, numbers rounded: what a notebook prints."""
    short = {"micro_batch_size": "mbs", "micro_batches": "m", "zero_stage": "zero", "recompute": "recomp"}
    heads = [short.get(c, c) for c in columns]

    def cell(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)
    table = [heads] + [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in table)


# ---------------------------------------------------------------- the course's small model on gloo: bytes per group
#
# What each rank sends per step on each group of notebook 12's run, for comparison with the bytes it counts at the
# sockets. Assumptions, each one line to change if the notebook's composition differs: FSDP2 (fully_shard on every
# layer, then on the whole model) gathers each layer in forward and again in backward, the root's own parameters
# (tok_embeddings, norm, output) once, and reduce-scatters every unit's gradients, per micro-batch (its defaults);
# tensor parallel shards wq, wk, wv, w1 by rows and wo, w2 by columns (utils.sequence_parallel), and leaves the
# embeddings, the norms and output whole; sequence parallel all-reduces the two norms' weight gradients per layer.
# Checked against FSDP2 on this model (tests/test_planner.py): the bytes its all-gathers return and its
# reduce-scatters keep, call by call, and what gloo writes to the sockets (within 2%: message headers).

def fsdp_unit_bytes(shapes, world_size, element_size):
    """The bytes a unit's all-gather returns, padded as FSDP2 pads: every parameter cut along dim 0 into world_size
    chunks of ceil(rows / N) rows."""
    total = 0
    for shape in shapes:
        rows = -(-shape[0] // world_size)
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += world_size * rows * rest
    return total * element_size


def fsdp_bytes(units, world_size, element_size, backend="gloo", gathers=None):
    """Bytes each rank sends per forward and backward of FSDP on `units` ({name: [shapes]}): gathers[name]
    all-gathers (default 2: forward, and backward after resharding) and one reduce-scatter of the gradients each.
    On a ring 3(N-1)/N of the model's bytes; on gloo, whose reduce-scatter is an all-reduce, 4(N-1)/N (notebook 05)."""
    gathers = gathers or {}
    sent = 0.0
    for name, shapes in units.items():
        size = fsdp_unit_bytes(shapes, world_size, element_size)
        sent += gathers.get(name, 2) * collective_bytes("all_gather", world_size, size, backend)
        sent += collective_bytes("reduce_scatter", world_size, size, backend)
    return sent


def tensor_parallel_layer_bytes(batch, seq, dim, world_size, element_size, backend="gloo", sequence_parallel=True,
                                norms=True):
    """Bytes each rank sends on the tensor-parallel group per layer, forward and backward (notebook 09): two column/
    row pairs, each crossed by M = batch seq dim e bytes in both directions; tensor parallel alone, an all-reduce per
    crossing (forward after the row layer, backward before the column layer); with sequence parallel an all-gather
    and a reduce-scatter per pair and direction, plus (`norms`) the all-reduce of the two norms' weight gradients
    (2 dim e; a composition with FSDP all-reduces them once per step, on their data shard: small_model_bytes)."""
    m = batch * seq * dim * element_size
    if not sequence_parallel:
        return 4 * collective_bytes("all_reduce", world_size, m, backend)
    pairs = 4 * (collective_bytes("all_gather", world_size, m, backend)
                 + collective_bytes("reduce_scatter", world_size, m, backend))
    return pairs + 2 * collective_bytes("all_reduce", world_size, dim * element_size, backend) * norms


def ring_attention_bytes(batch, heads, seq, head_dim, world_size, element_size, backward=True):
    """Bytes each rank sends in ring attention (notebook 09): its keys and values, 2 B H (S/N) D e, make N-1 hops
    forward; backward N-1 hops again and their gradients N (home): (2N-1) blocks."""
    block = 2 * batch * heads * (seq // world_size) * head_dim * element_size
    return (world_size - 1) * block + (2 * world_size - 1) * block * backward


def expert_dispatch_bytes_per_token(dim, top_k, element_size):
    """Bytes one token's copies hand to the all-to-alls of a MoE layer, forward and backward (notebook 10):
    k copies of dim elements, out and back, in each pass, 2 k h e 2; (N-1)/N of them leave the rank."""
    return 2 * top_k * dim * element_size * 2


def small_model_units(sizes, tp=1, pp=1, stage=0):
    """{FSDP unit: [parameter shapes on one tensor-parallel rank]} of utils.transformer's model on pipeline stage
    `stage`: one unit per layer, and the root's own parameters (tok_embeddings on the first stage, the final norm and
    output on the last). Tensor parallel cuts wq, wk, wv, w1 by rows, wo, w2 by columns; norms and embeddings whole."""
    from utils.pipeline import stage_layers  # the course's split: the first L % p stages take one more layer
    from utils.sequence_parallel import COLUMN, ROW

    divide("num_heads", sizes.num_heads, "tp", tp, "each tensor-parallel rank computes whole heads")
    divide("ffn_dim", sizes.ffn_dim, "tp", tp, "each tensor-parallel rank holds as many MLP features")
    d, v, f = sizes.dim, sizes.vocab_size, sizes.ffn_dim
    block = {"attention_norm.weight": (d,), "attention.wq.weight": (d, d), "attention.wk.weight": (d, d),
             "attention.wv.weight": (d, d), "attention.wo.weight": (d, d), "ffn_norm.weight": (d,),
             "feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f)}

    def on_rank(name, shape):
        if name in COLUMN:
            return (shape[0] // tp, *shape[1:])
        return (shape[0], shape[1] // tp) if name in ROW else shape

    units = {f"layers.{i}": [on_rank(n, s) for n, s in block.items()]
             for i in stage_layers(sizes.num_layers, pp)[check_int("stage", stage, 0)]}
    units["root"] = [(v, d)] * (stage == 0) + [(d,), (v, d)] * (stage == pp - 1)
    return units


def small_model_bytes(sizes, dp=1, tp=1, pp=1, cp=1, num_micro_batches=1, stage=0, element_size=8, backend="gloo",
                      sequence_parallel=True, gathers_per_step=2):
    """{group: bytes} that one rank of pipeline stage `stage` sends in one training step of utils.transformer's
    model (TransformerSizes `sizes`, float64 by default) on the mesh (pp, dp, cp, tp), with the assumptions above.
    The batch is split over dp and then into micro-batches; the sequence over cp (ring attention). FSDP all-gathers
    each layer `gathers_per_step` times per micro-batch and the root's own weights once (2: FSDP2, which frees a layer
    after its forward and gathers and reduce-scatters again for every micro-batch; 1: notebook 12's FlatShards, which
    gathers the model once per step and reduce-scatters once, after the last micro-batch: measured in its section
    3, on 2 pipeline stages of 2 micro-batches). The weights whole on every tensor
    rank (norms, embeddings, output) saw different chunks of the sequence: their gradients are all-reduced over tp
    once per step, on the shard FSDP's reduce-scatter left (notebook 12, section 2)."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("num_micro_batches", num_micro_batches)):
        check_int(name, value)
    micro = divide("batch_size / dp", divide("batch_size", sizes.batch_size, "dp", dp, "replicas get equal batches"),
                   "num_micro_batches", num_micro_batches, "micro-batches are equal")
    seq = divide("seq_len", sizes.seq_len, "cp", cp, "every context-parallel rank holds a chunk")
    if sequence_parallel and tp > 1:
        divide("seq_len / cp", seq, "tp", tp, "sequence parallel splits each rank's chunk over tp")
    units = small_model_units(sizes, tp, pp, stage)
    layers, m, d = len(units) - 1, num_micro_batches, sizes.dim
    gathers = {name: 1 if name == "root" else gathers_per_step for name in units}
    rounds = m if gathers_per_step > 1 else 1  # FlatShards: one gather and one reduce-scatter per step
    sent = {"dp": rounds * fsdp_bytes(units, dp * cp, element_size, backend, gathers) if dp * cp > 1 else 0.0}
    sent["tp"] = 0.0
    if tp > 1:
        norms = [shape for name, shapes in units.items() if name != "root" for shape in shapes if len(shape) == 1]
        # tensor parallel alone: every rank saw the whole sequence, and the whole weights' gradients agree
        whole = norms + units["root"] if sequence_parallel else []
        whole_bytes = fsdp_unit_bytes(whole, dp * cp, element_size) / (dp * cp)
        sent["tp"] = (m * layers * tensor_parallel_layer_bytes(micro, seq, d, tp, element_size, backend,
                                                               sequence_parallel, norms=False)
                      + collective_bytes("all_reduce", tp, whole_bytes, backend))
    hand_off = micro * seq * d * element_size / (tp if sequence_parallel else 1)
    sent["pp"] = m * hand_off * ((stage < pp - 1) + (stage > 0))
    sent["cp"] = (m * layers * ring_attention_bytes(micro, sizes.num_heads // tp, sizes.seq_len, sizes.head_dim, cp,
                                                    element_size) if cp > 1 else 0.0)
    return sent
